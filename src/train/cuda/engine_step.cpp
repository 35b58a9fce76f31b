// The CUDA engine's step: the inputs staged in one transfer, the whole forward (embedding, the
// layers' attention and FFN blocks, the head and the loss) and backward, the step body that a CUDA
// graph captures and replays (TrainConfig::cuda_graph), the stage clock's marks around it, and the
// metrics a step reads back only when asked.
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "cuda/common/check.hpp"
#include "train/cuda/engine_impl.hpp"
#include "train/cuda/ops/cross_entropy.cuh"
#include "train/cuda/ops/embedding.cuh"
#include "train/cuda/ops/reduce.cuh"
#include "train/cuda/ops/rmsnorm.cuh"

namespace moka::train {

double CudaEngine::Impl::mean_abs(const void* x, bool is_bf16, int64_t n) {
  cuda::reduce_partials(cuda::ReduceOp::abs, x, is_bf16, n, partials.data(), stream);
  cuda::reduce_finish(partials.data(), cuda::kReduceBlocks, 1.0 / double(n), scalars.data() + 2, stream);
  return read_scalar(2);
}

// Waits for the stream, then reads scalars[i] (a host synchronization, counted).
double CudaEngine::Impl::read_scalar(int i) {
  double out = 0;
  wait_for_device();
  MOKA_CUDA_CHECK(cudaMemcpy(&out, scalars.data() + i, sizeof(double), cudaMemcpyDeviceToHost));
  return out;
}

void CudaEngine::Impl::wait_for_device() {
  MOKA_CUDA_CHECK(cudaStreamSynchronize(stream));
  ++host_syncs;
}

// The batch and the step's scalars into the device's input block: a host-side counting sort
// (each token's positions), the pinned staging copy, one asynchronous transfer. The host waits
// only when the previous transfer out of the staging copy has not run yet.
void CudaEngine::Impl::stage_inputs(const Batch& b) {
  require(b.tokens() == N && int64_t(b.inputs.size()) == N && int64_t(b.targets.size()) == N, ErrorCode::shape_mismatch,
          "the CUDA engine was sized for " + std::to_string(N) + " tokens per batch, got " +
              std::to_string(b.tokens()));
  const int64_t V = c.vocab;
  for (int32_t t : b.inputs)
    require(t >= 0 && t < V, ErrorCode::invalid_argument, "token id " + std::to_string(t) + " outside vocab");
  if (cudaEventQuery(staging_copied) == cudaErrorNotReady) {
    MOKA_CUDA_CHECK(cudaEventSynchronize(staging_copied));
    ++host_syncs;
  }
  int32_t* words = staging.host();
  std::memcpy(words, &scalars_now, sizeof scalars_now);
  int32_t* tok = words + kScalarWords;
  int32_t* tgt = tok + N;
  int32_t* offsets = tgt + N;
  int32_t* positions = offsets + V + 1;
  std::copy(b.inputs.begin(), b.inputs.end(), tok);
  std::copy(b.targets.begin(), b.targets.end(), tgt);
  std::fill(offsets, offsets + V + 1, 0);
  for (int32_t t : b.inputs) ++offsets[t + 1];
  for (int64_t v = 0; v < V; ++v) offsets[v + 1] += offsets[v];
  std::vector<int32_t> fill(offsets, offsets + V);
  for (int64_t t = 0; t < N; ++t) positions[fill[b.inputs[t]]++] = int32_t(t);
  MOKA_CUDA_CHECK(cudaMemcpyAsync(inputs.data(), words, input_words * sizeof(int32_t), cudaMemcpyHostToDevice, stream));
  MOKA_CUDA_CHECK(cudaEventRecord(staging_copied, stream));
}

// Through the cross-entropy, from the staged inputs; scalars[0] = mean cross-entropy and
// router_losses_dev the routers' losses (on the device). The routers' contexts stay for
// backward; release_contexts() frees them.
void CudaEngine::Impl::forward(ActivationStats* stats) {
  const int64_t H = c.d_model, V = c.vocab;
  const float eps = float(c.norm_eps);
  mark(Stage::embedding_forward);
  cuda::embed_forward(tokens(), embed->value.data(), embed->fwd(), N, H, h.data(), stream);
  MOKA_CUDA_CHECK_LAUNCH();
  if (stats) *stats = ActivationStats{mean_abs(h.data(), false, N * H)};
  // The residual stream h takes each branch's output in the norm that follows it.
  cuda::ResidualDelta pending;
  for (auto& L : layers) {
    mark(Stage::norms_forward);
    cuda::residual_rmsnorm_forward(h.data(), pending, pending.b16 ? h.data() : nullptr, L.attn_in.data(),
                                   L.attn_norm->value.data(), N, H, eps, L.attn_x.data(), nullptr,
                                   L.attn_inv_rms.data(), stream);
    mark(Stage::attention_forward);
    attention_forward(L);
    if (stats) stats->attention += mean_abs(branch.data(), false, N * H);
    mark(Stage::norms_forward);
    cuda::residual_rmsnorm_forward(h.data(), {branch.data(), nullptr}, h.data(), L.ffn_in.data(),
                                   L.ffn_norm->value.data(), N, H, eps, nullptr, L.ffn_x.data(), L.ffn_inv_rms.data(),
                                   stream);
    MOKA_CUDA_CHECK_LAUNCH();
    mark(Stage::moe_forward);
    ffn_forward(L, stats);
    pending = {nullptr, moe_out.data()};
  }
  mark(Stage::head_loss_forward);
  cuda::residual_rmsnorm_forward(h.data(), pending, h.data(), nullptr, final_norm->value.data(), N, H, eps,
                                 final_x.data(), nullptr, final_inv_rms.data(), stream);
  linear(final_x.data(), *head, logits.data());
  cuda::cross_entropy(logits.data(), targets(), N, V, row_loss.data(), d_logits.data(), stream);
  cuda::reduce_partials(cuda::ReduceOp::sum, row_loss.data(), false, N, partials.data(), stream);
  cuda::reduce_finish(partials.data(), cuda::kReduceBlocks, 1.0 / double(N), scalars.data(), stream);
  MOKA_CUDA_CHECK_LAUNCH();
  for (const auto& L : layers)
    if (L.is_moe)
      MOKA_CUDA_CHECK(cudaMemcpyAsync(router_losses_dev.data() + 2 * L.moe_index, L.router_ctx->device_losses(),
                                      2 * sizeof(double), cudaMemcpyDeviceToDevice, stream));
  if (stats) {
    stats->average_over_layers(c.num_layers);
    stats->residual = mean_abs(h.data(), false, N * H);
    stats->logits = mean_abs(logits.data(), false, N * V);
  }
}

void CudaEngine::Impl::backward() {
  const int64_t H = c.d_model;
  mark(Stage::head_loss_backward);
  linear_backward(final_x.data(), *head, d_logits.data(), d_tmp.data(), false);
  cuda::NormGrad dy;
  dy.f32 = d_tmp.data();
  cuda::rmsnorm_backward(h.data(), final_norm->value.data(), final_inv_rms.data(), dy, N, H, false, d_res.data(),
                         d_out16.data(), final_norm->grad.data(), gain_partials.data(), stream);
  MOKA_CUDA_CHECK_LAUNCH();
  for (auto it = layers.rbegin(); it != layers.rend(); ++it) {
    ffn_backward(*it);
    attention_backward(*it);
  }
  mark(Stage::embedding_backward);
  cuda::embed_backward(embed_offsets(), embed_positions(), d_res.data(), embed->fwd(), c.vocab, H, embed->grad.data(),
                       stream);
  MOKA_CUDA_CHECK_LAUNCH();
}

// Everything a step puts on the stream, from the staged inputs: no host synchronization (but
// the coordinate check's `stats`) and no host state changed, so it can be captured.
void CudaEngine::Impl::step_body(ActivationStats* stats) {
  forward(stats);
  backward();
  release_contexts();
  optimizer_step();
  router_bias_step();
}

// Captures step_body into a graph (`count_only`: to count its launches, not to keep it).
cudaGraph_t CudaEngine::Impl::capture_step() {
  if (clock) clock->set_capture(true);
  MOKA_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  cudaGraph_t captured = nullptr;
  try {
    step_body(nullptr);
    if (clock) graph_marks = clock->end();
  } catch (const Error& e) {
    cudaStreamEndCapture(stream, &captured);
    if (captured) cudaGraphDestroy(captured);
    if (clock) clock->set_capture(false);
    throw Error(e.code(), std::string("capturing the training step in a CUDA graph failed (--cuda-graph off runs "
                                      "it uncaptured): ") +
                              e.what());
  }
  const cudaError_t end = cudaStreamEndCapture(stream, &captured);
  if (clock) clock->set_capture(false);
  require(end == cudaSuccess, ErrorCode::cuda,
          std::string("capturing the training step in a CUDA graph failed: a call in the step is not capturable (") +
              cudaGetErrorString(end) + "); --cuda-graph off runs it uncaptured");
  if (clock) {
    clock->count_launches(graph_marks, launches_in(captured) + 1);
    profile.launches[size_t(Stage::inputs)] = 1;  // the inputs' transfer, outside the graph
  }
  return captured;
}

// Reads the last step's numbers: one wait for the device, then small copies.
void CudaEngine::Impl::read_metrics(StepReport& r) {
  wait_for_device();
  std::array<double, 2> ce_and_norm{};
  MOKA_CUDA_CHECK(cudaMemcpy(ce_and_norm.data(), scalars.data(), sizeof ce_and_norm, cudaMemcpyDeviceToHost));
  r.cross_entropy = ce_and_norm[0];
  r.loss = r.cross_entropy + router_losses();
  r.grad_norm = std::sqrt(ce_and_norm[1]);
  r.load_max_over_mean = 0;
  for (const auto& cnt : expert_counts())
    r.load_max_over_mean = std::max(r.load_max_over_mean, load_stats(cnt).max_over_mean);
}

// The last forward's router losses, summed over the layers in order as the CPU does (the
// caller has waited for the device).
double CudaEngine::Impl::router_losses() const {
  std::vector<double> losses(2 * moe_layers);
  if (moe_layers > 0)
    MOKA_CUDA_CHECK(
        cudaMemcpy(losses.data(), router_losses_dev.data(), losses.size() * sizeof(double), cudaMemcpyDeviceToHost));
  double total = 0;
  for (int64_t l = 0; l < moe_layers; ++l) total += losses[2 * l] + losses[2 * l + 1];
  return total;
}

std::vector<std::vector<int64_t>> CudaEngine::Impl::expert_counts() const {
  std::vector<std::vector<int64_t>> out;
  for (const auto& L : layers)
    if (L.is_moe) {
      const auto counts = L.counts.download(stream);
      out.emplace_back(counts.begin(), counts.end());
    }
  return out;
}

void CudaEngine::Impl::run_step(const Batch& batch, double lr_factor, ActivationStats* stats, bool metrics,
                                StepReport& r) {
  const auto host_start = std::chrono::steady_clock::now();
  const int64_t syncs_before = host_syncs;
  ++steps_taken;
  const auto& a = config.adam;
  scalars_now.lr = a.lr * lr_factor;
  scalars_now.bias_correction1 = float(1.0 - std::pow(a.beta1, double(steps_taken)));
  scalars_now.bias_correction2 = float(1.0 - std::pow(a.beta2, double(steps_taken)));
  // The profile starts from an idle device: the unprofiled steps' queued work is not a wait of
  // the profiled ones (profiling's own wait, not counted).
  if (clock && steps_taken == kUnprofiledSteps + 1) MOKA_CUDA_CHECK(cudaStreamSynchronize(stream));
  if (clock) clock->new_step();
  mark(Stage::inputs);
  stage_inputs(batch);
  // The inputs mark; the step's own marks follow (the captured ones on a replay).
  std::vector<DeviceStageClock::Mark> marks;
  if (clock) marks = clock->take();
  if (config.cuda_graph && stats == nullptr && warmed_up) {
    if (!graph) {
      cudaGraph_t captured = capture_step();
      const cudaError_t made = cudaGraphInstantiate(&graph, captured, 0);
      cudaGraphDestroy(captured);
      require(made == cudaSuccess, ErrorCode::cuda,
              std::string("instantiating the captured training step failed: ") + cudaGetErrorString(made));
    }
    MOKA_CUDA_CHECK(cudaGraphLaunch(graph, stream));
    marks.insert(marks.end(), graph_marks.begin(), graph_marks.end());
  } else {
    // Eager profiling counts the launches once, from a capture of the step that never runs.
    if (clock && warmed_up && profile.launches_per_step < 0) cudaGraphDestroy(capture_step());
    step_body(stats);
    if (clock) {
      auto rest = clock->end();
      marks.insert(marks.end(), rest.begin(), rest.end());
    }
  }
  const double host_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - host_start).count();
  if (metrics) read_metrics(r);
  // The first steps allocate workspaces and capture the graph: the profile starts after them.
  if (clock && steps_taken > kUnprofiledSteps) {
    MOKA_CUDA_CHECK(cudaStreamSynchronize(stream));  // profiling's own wait, not counted
    clock->accumulate(marks);
    profile.host_ms += host_ms;
    profile.host_syncs += host_syncs - syncs_before;
  }
  warmed_up = true;
}

}  // namespace moka::train
