// The CUDA layer's memory (issue 29): what a context holds, the caller's allocator getting every
// byte back, several forwards in flight per layer with their backwards in any order, SaveMode::none
// recomputing gate|up to the same bits, threads and streams sharing one layer, consume_backward,
// and the megakernel layer taking its per-call scratch from the caller.
#include <gtest/gtest.h>

#include <mutex>
#include <thread>
#include <unordered_map>
#include <utility>

#include "gpu_case.hpp"
#include "moka/moka.hpp"

using namespace moka;
using gpu_test::GpuCase;

namespace {

using gpu_test::expect_close;
using gpu_test::fresh_seed;
using gpu_test::reference;
using gpu_test::routed_case;
using gpu_test::run_gpu;
using gpu_test::shape;

// A stream-ordered allocator that counts what is out: bytes in use now, at most, and the
// requests, each checked against its own release (size and a known pointer).
class CountingAllocator final : public DeviceAllocator {
 public:
  void* allocate(size_t bytes, Stream stream) override {
    void* p = nullptr;
    MOKA_CUDA_CHECK(cudaMallocAsync(&p, bytes, static_cast<cudaStream_t>(stream.handle)));
    std::lock_guard<std::mutex> lock(mutex_);
    sizes_[p] = bytes;
    in_use_ += int64_t(bytes);
    peak_ = std::max(peak_, in_use_);
    ++allocations_;
    return p;
  }
  void deallocate(void* p, size_t bytes, Stream stream) override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      const auto it = sizes_.find(p);
      EXPECT_TRUE(it != sizes_.end()) << "deallocate of a pointer this allocator did not hand out";
      if (it == sizes_.end()) return;
      EXPECT_EQ(it->second, bytes) << "deallocate with another size than allocate's";
      in_use_ -= int64_t(it->second);
      sizes_.erase(it);
    }
    MOKA_CUDA_CHECK(cudaFreeAsync(p, static_cast<cudaStream_t>(stream.handle)));
  }
  int64_t in_use() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return in_use_;
  }
  int64_t peak() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return peak_;
  }
  int64_t allocations() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return allocations_;
  }
  // The peak from now on (what is in use now included).
  void reset_peak() {
    std::lock_guard<std::mutex> lock(mutex_);
    peak_ = in_use_;
  }

 private:
  mutable std::mutex mutex_;
  std::unordered_map<void*, size_t> sizes_;
  int64_t in_use_ = 0, peak_ = 0, allocations_ = 0;
};

std::unique_ptr<MoeLayer> cuda_layer(const MoeShape& s, SaveMode save, DeviceAllocator* allocator = nullptr,
                                     bool fused_swiglu = false) {
  LayerOptions o;
  o.save = save;
  o.allocator = allocator;
  o.fused_swiglu = fused_swiglu;
  o.path = LayerPath::single_gpu;
  return make_moe_layer(s, Backend::cuda, nullptr, o);
}

// Bytes of the arrays a context keeps: each at least 16 (DeviceArray's minimum).
int64_t array_bytes(int64_t elements, int64_t element_bytes) { return std::max<int64_t>(elements * element_bytes, 16); }

TEST(CudaLayerMemory, ContextHoldsTheRoutesAndGateUpAndEveryByteComesBack) {
  const MoeShape s = shape(256, 128, 16, 4, 96);
  const int64_t T = 77, k = s.top_k, E = s.num_experts, I = s.intermediate, Is = s.shared_intermediate;
  const int64_t rows = T * k;  // one rank's expert segments are not padded
  const int64_t routes = array_bytes(E, 4) + array_bytes(E + 1, 4) + array_bytes(T * k, 4);
  for (SaveMode save : {SaveMode::gate_up, SaveMode::none}) {
    SCOPED_TRACE(to_string(save));
    GpuCase c = routed_case(s, T, fresh_seed());
    CountingAllocator counting;
    auto layer = cuda_layer(s, save, &counting);
    cudaStream_t stream;
    MOKA_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    {
      auto ctx = layer->forward(c.inputs(), c.weights(), c.out_view(), Stream{stream});
      MOKA_CUDA_CHECK(cudaStreamSynchronize(stream));
      const int64_t gate_up = save == SaveMode::gate_up ? 2 * rows * I * 2 + 2 * T * Is * 2 : 0;
      EXPECT_EQ(ctx->saved_bytes(), routes + gate_up);
      EXPECT_EQ(counting.in_use(), ctx->saved_bytes()) << "the forward's scratch went back";
      EXPECT_GT(counting.peak(), ctx->saved_bytes()) << "the forward's scratch came from the caller's allocator";
      layer->backward(*ctx, c.d_out_view(), c.weights(), c.gradients(), Stream{stream});
      MOKA_CUDA_CHECK(cudaStreamSynchronize(stream));
      EXPECT_EQ(counting.in_use(), ctx->saved_bytes()) << "the backward's scratch went back";
    }
    EXPECT_EQ(counting.in_use(), 0) << "the context's memory went back";
    // A context dropped without a backward gives its memory back too.
    layer->forward(c.inputs(), c.weights(), c.out_view(), Stream{stream}).reset();
    MOKA_CUDA_CHECK(cudaStreamSynchronize(stream));
    EXPECT_EQ(counting.in_use(), 0);
    const auto got = c.download();
    reference(c);
    expect_close(got, c.ref, 2e-2);
    layer.reset();
    MOKA_CUDA_CHECK(cudaStreamDestroy(stream));
  }
}

// Shapes whose bits two ways of running a layer must agree on: a shared expert, the clamped
// activation with ragged widths, and 64 experts for 5 tokens (most of them empty).
struct BitCase {
  const char* name;
  MoeShape shape;
  int64_t tokens;
};
const BitCase kBitCases[] = {{"shared", shape(256, 128, 16, 4, 128), 37},
                             {"clamped", shape(512, 1408, 8, 2, 520, true), 100},
                             {"sparse", shape(2048, 768, 64, 8), 5}};

// SaveMode::none recomputes gate|up from x in the backward: every output and gradient the same
// bits as the default's, unfused and fused SwiGLU, with a shared expert and empty experts.
TEST(CudaLayerMemory, SaveNoneGivesTheBitsOfSaveGateUp) {
  for (const auto& p : kBitCases) {
    for (bool fused : {false, true}) {
      SCOPED_TRACE(std::string(p.name) + (fused ? " fused" : " unfused"));
      GpuCase c = routed_case(p.shape, p.tokens, fresh_seed());
      run_gpu(*cuda_layer(p.shape, SaveMode::gate_up, nullptr, fused), c);
      const auto saved_bits = c.output_bytes();
      c.poison();
      run_gpu(*cuda_layer(p.shape, SaveMode::none, nullptr, fused), c);
      EXPECT_TRUE(c.output_bytes() == saved_bits) << "outputs or gradients differ from save=gate_up's";
    }
  }
}

// consume_backward writes dU and w·h over the context's gate and up: the bits of backward, two
// rows x I buffers (and the shared expert's two T x Is) fewer at the backward's peak (the context
// counted), and every byte back once it returns.
TEST(CudaLayerMemory, ConsumeBackwardGivesTheBitsOfBackwardInLessMemory) {
  for (const auto& p : kBitCases) {
    for (bool fused : {false, true}) {
      SCOPED_TRACE(std::string(p.name) + (fused ? " fused" : " unfused"));
      GpuCase c = routed_case(p.shape, p.tokens, fresh_seed());
      CountingAllocator keeping, consuming;
      {
        auto layer = cuda_layer(p.shape, SaveMode::gate_up, &keeping, fused);
        auto ctx = layer->forward(c.inputs(), c.weights(), c.out_view(), Stream{});
        MOKA_CUDA_CHECK(cudaDeviceSynchronize());
        keeping.reset_peak();
        layer->backward(*ctx, c.d_out_view(), c.weights(), c.gradients(), Stream{});
        MOKA_CUDA_CHECK(cudaDeviceSynchronize());
      }
      const auto kept_bits = c.output_bytes();
      c.poison();
      auto layer = cuda_layer(p.shape, SaveMode::gate_up, &consuming, fused);
      auto ctx = layer->forward(c.inputs(), c.weights(), c.out_view(), Stream{});
      MOKA_CUDA_CHECK(cudaDeviceSynchronize());
      consuming.reset_peak();
      layer->consume_backward(std::move(ctx), c.d_out_view(), c.weights(), c.gradients(), Stream{});
      MOKA_CUDA_CHECK(cudaDeviceSynchronize());
      layer->check_errors();
      EXPECT_TRUE(c.output_bytes() == kept_bits) << "outputs or gradients differ from backward's";
      EXPECT_EQ(consuming.in_use(), 0) << "the consumed context's memory went back";
      const int64_t rows = p.tokens * p.shape.top_k, I = p.shape.intermediate;
      const int64_t overwritten = 2 * rows * I * 2 + 2 * p.tokens * p.shape.shared_intermediate * 2;
      EXPECT_GE(keeping.peak() - consuming.peak(), overwritten);
      EXPECT_EQ(keeping.allocations() - consuming.allocations(), p.shape.has_shared() ? 4 : 2);
    }
  }
}

// An allocator whose memory starts as NaN in every element (every byte 0xff; -1 as an index).
class PoisoningAllocator final : public DeviceAllocator {
 public:
  void* allocate(size_t bytes, Stream stream) override {
    const auto s = static_cast<cudaStream_t>(stream.handle);
    void* p = nullptr;
    MOKA_CUDA_CHECK(cudaMallocAsync(&p, bytes, s));
    MOKA_CUDA_CHECK(cudaMemsetAsync(p, 0xff, bytes, s));
    return p;
  }
  void deallocate(void* p, size_t, Stream stream) override {
    MOKA_CUDA_CHECK(cudaFreeAsync(p, static_cast<cudaStream_t>(stream.handle)));
  }
};

// Every value a call reads from its scratch or its context it wrote there first (padding rows
// included, which the GEMMs must not read): with memory that starts as NaN the outputs and
// gradients are the bits of a run on the default pool. This is what compute-sanitizer's
// initcheck would show, except that it does not see the writes of the GEMMs' TMA-store
// epilogues (docs/MEGAKERNEL.md, "Sanitizers").
TEST(CudaLayerMemory, EveryValueACallReadsItWrote) {
  const struct {
    const char* name;
    MoeShape shape;
    int64_t tokens;
  } cases[] = {{"shared", shape(256, 128, 16, 4, 128), 37}, {"sparse", shape(2048, 768, 64, 8), 5}};
  for (const auto& p : cases) {
    for (SaveMode save : {SaveMode::gate_up, SaveMode::none}) {
      for (bool fused : {false, true}) {
        SCOPED_TRACE(std::string(p.name) + " " + to_string(save) + (fused ? " fused" : " unfused"));
        GpuCase c = routed_case(p.shape, p.tokens, fresh_seed());
        run_gpu(*cuda_layer(p.shape, save, nullptr, fused), c);
        const auto pool_bits = c.output_bytes();
        c.poison();
        PoisoningAllocator poisoning;
        run_gpu(*cuda_layer(p.shape, save, &poisoning, fused), c);
        EXPECT_TRUE(c.output_bytes() == pool_bits) << "a call read memory it had not written";
      }
    }
  }
}

// The megakernel layer takes each call's scratch (the ring's hidden and y rows, the shared
// expert's, the combine and d_x slots, the backward's ring) from the caller's allocator, gives it
// all back, and reads none of it before writing it: with memory that starts as NaN, the bits of
// a run on the default pool, for resident contexts (g and u by slot, and as grouped rows) and a
// replayed one (a ring of 512 rows).
TEST(CudaLayerMemory, MegakernelScratchComesFromTheCallersAllocatorAndIsWrittenBeforeRead) {
  const struct {
    const char* name;
    MoeShape shape;
    int64_t tokens;
    MegakernelConfig config;
  } cases[] = {{"resident_shared", shape(256, 128, 16, 4, 128), 37, gpu_test::megakernel_config(32, 4096, 131072)},
               {"replay_ring_reuse", shape(256, 192, 16, 8), 129, gpu_test::megakernel_config(4, 256, 512)},
               {"resident_ragged", shape(264, 136, 8, 2, 72), 45, gpu_test::megakernel_config(32, 4096, 131072)},
               {"resident_grouped", shape(256, 128, 2, 2), 3000, gpu_test::megakernel_config(32, 4096, 131072)}};
  for (const auto& p : cases) {
    SCOPED_TRACE(p.name);
    GpuCase c = routed_case(p.shape, p.tokens, fresh_seed());
    LayerOptions o = gpu_test::megakernel_options(p.config, p.tokens);
    run_gpu(*make_moe_layer(p.shape, Backend::cuda, nullptr, o), c);
    const auto pool_bits = c.output_bytes();
    PoisoningAllocator poisoning;
    CountingAllocator counting;
    for (DeviceAllocator* allocator :
         {static_cast<DeviceAllocator*>(&poisoning), static_cast<DeviceAllocator*>(&counting)}) {
      c.poison();
      o.allocator = allocator;
      auto layer = make_moe_layer(p.shape, Backend::cuda, nullptr, o);
      run_gpu(*layer, c);
      layer->check_errors();
      EXPECT_TRUE(c.output_bytes() == pool_bits) << "a call read memory it had not written";
    }
    EXPECT_EQ(counting.in_use(), 0) << "every byte of the calls' scratch went back";
    EXPECT_GE(counting.peak(), p.tokens * p.shape.top_k * p.shape.hidden * 2) << "the combine slots came from it";
  }
}

// Two forwards of one layer in flight, their backwards in reverse order (what a pipeline
// schedule or gradient accumulation does), on one stream and on two: the bits of one at a time.
TEST(CudaLayerMemory, ForwardsInFlightGiveTheBitsOfOneAtATime) {
  const MoeShape s = shape(256, 128, 16, 4, 128);
  const uint64_t seed = fresh_seed();
  GpuCase a = routed_case(s, 61, seed), b = routed_case(s, 90, seed + 7);
  auto layer = cuda_layer(s, SaveMode::gate_up);
  run_gpu(*layer, a);
  run_gpu(*layer, b);
  const auto a_bits = a.output_bytes(), b_bits = b.output_bytes();
  cudaStream_t other;
  MOKA_CUDA_CHECK(cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking));
  for (cudaStream_t second : {cudaStream_t(nullptr), other}) {
    a.poison();
    b.poison();
    auto ctx_a = layer->forward(a.inputs(), a.weights(), a.out_view(), Stream{});
    auto ctx_b = layer->forward(b.inputs(), b.weights(), b.out_view(), Stream{second});
    layer->backward(*ctx_b, b.d_out_view(), b.weights(), b.gradients(), Stream{second});
    MOKA_CUDA_CHECK(cudaStreamSynchronize(second));  // a's backward may then run on the legacy stream
    layer->backward(*ctx_a, a.d_out_view(), a.weights(), a.gradients(), Stream{});
    MOKA_CUDA_CHECK(cudaDeviceSynchronize());
    EXPECT_TRUE(a.output_bytes() == a_bits) << "the first forward's results changed";
    EXPECT_TRUE(b.output_bytes() == b_bits) << "the second forward's results changed";
  }
  layer.reset();
  MOKA_CUDA_CHECK(cudaStreamDestroy(other));
}

// Four threads, each on a stream of its own, share one layer (and moka's default pool): each
// gets the results it gets alone, for several rounds; on the single-GPU path and on the
// megakernel path (which serializes its calls).
TEST(CudaLayerMemory, ThreadsSharingALayerGetTheirOwnResults) {
  const MoeShape s = shape(512, 256, 16, 4, 128);
  const uint64_t seed = fresh_seed();
  constexpr int kThreads = 4;
  std::vector<GpuCase> cases;
  for (int t = 0; t < kThreads; ++t) cases.push_back(routed_case(s, 50 + 31 * t, seed + 10 * t));
  const LayerOptions megakernel =
      gpu_test::megakernel_options(gpu_test::megakernel_config(32, 4096, 131072), 50 + 31 * (kThreads - 1));
  std::vector<std::unique_ptr<MoeLayer>> layers;
  layers.push_back(cuda_layer(s, SaveMode::gate_up));
  layers.push_back(make_moe_layer(s, Backend::cuda, nullptr, megakernel));
  for (auto& layer : layers) {
    SCOPED_TRACE(layer->megakernel() ? "megakernel path" : "single-GPU path");
    std::vector<std::vector<uint8_t>> alone;
    for (auto& c : cases) {
      run_gpu(*layer, c);
      alone.push_back(c.output_bytes());
    }
    for (auto& c : cases) c.poison();
    std::vector<std::string> failures(kThreads);
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t)
      threads.emplace_back([&, t] {
        try {
          cudaStream_t stream;
          MOKA_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
          for (int round = 0; round < 3 && failures[t].empty(); ++round) {
            run_gpu(*layer, cases[t], stream);
            if (cases[t].output_bytes() != alone[t]) failures[t] = "round " + std::to_string(round) + " differs";
          }
          MOKA_CUDA_CHECK(cudaStreamDestroy(stream));
        } catch (const std::exception& e) {
          failures[t] = e.what();
        }
      });
    for (auto& th : threads) th.join();
    for (int t = 0; t < kThreads; ++t) EXPECT_TRUE(failures[t].empty()) << "thread " << t << ": " << failures[t];
  }
}

}  // namespace
