#include "cuda/layer/expert_exchange.hpp"

#include "cuda/common/check.hpp"

namespace moka::cuda {

ExpertExchange::ExpertExchange(DeviceGroup& group, const MoeShape& shape, int64_t tile_rows)
    : group_(group), shape_(shape), tile_rows_(tile_rows), local_experts_(shape.num_experts / group.size()),
      sort_counts_(shape.num_experts), sort_offsets_(shape.num_experts + 1),
      received_counts_(group.size() * local_experts_),
      host_counts_(shape.num_experts + group.size() * local_experts_, PinnedArray<int32_t>::unmapped),
      error_(kNoRoutingError) {}

void ExpertExchange::plan(const int32_t* topk_ids, const float* topk_weights, int64_t tokens, cudaStream_t stream) {
  const int R = group_.size();
  const int64_t k = shape_.top_k, E = shape_.num_experts, El = local_experts_, slots = tokens * k;
  tokens_ = tokens;
  if (size_t(slots) > send_position_.size()) {
    sort_chunk_counts_ = {};  // freed before the larger arrays are allocated
    send_position_ = {};
    sort_chunk_counts_ = DeviceArray<int32_t>(schedule_chunks(slots) * E);
    send_position_ = DeviceArray<int32_t>(slots);
  }
  error_.store(kNoRoutingError);  // the stream is idle here: the previous plan synchronized
  // Sorting by global expert with tile 1 is the single-rank schedule over all E experts.
  DeviceSchedule sort;
  sort.slots = slots;
  sort.num_experts = E;
  sort.first_expert = 0;
  sort.global_experts = E;
  sort.tile_rows = 1;
  sort.top_k = k;
  sort.chunk_counts = sort_chunk_counts_.data();
  sort.counts = sort_counts_.data();
  sort.offsets = sort_offsets_.data();
  sort.row_of_slot = send_position_.data();
  sort.error = error_.device();
  build_schedule(sort, topk_ids, topk_weights, stream);

  // Counts per expert to every owner: rank p receives [source][its E_local experts].
  std::vector<size_t> bytes(R, El * sizeof(int32_t)), offsets(R);
  for (int p = 0; p < R; ++p) offsets[p] = p * El * sizeof(int32_t);
  group_.all_to_all_v(sort_counts_.data(), bytes.data(), offsets.data(), received_counts_.data(), bytes.data(),
                      offsets.data(), stream);
  int32_t* host_counts = host_counts_.host();
  MOKA_CUDA_CHECK(
      cudaMemcpyAsync(host_counts, sort_counts_.data(), E * sizeof(int32_t), cudaMemcpyDeviceToHost, stream));
  MOKA_CUDA_CHECK(cudaMemcpyAsync(host_counts + E, received_counts_.data(), R * El * sizeof(int32_t),
                                  cudaMemcpyDeviceToHost, stream));
  MOKA_CUDA_CHECK(cudaStreamSynchronize(stream));

  blocks_ = core::plan_exchange_blocks(host_counts, host_counts + E, R, El, tile_rows_);
}

void ExpertExchange::upload_schedule(int32_t* counts, int32_t* offsets) const {
  // Blocking copies: plan() has already waited for the stream, so nothing reads these now.
  const std::vector<int32_t> c(blocks_.expert_rows.begin(), blocks_.expert_rows.end());
  const std::vector<int32_t> o(blocks_.expert_offset.begin(), blocks_.expert_offset.end());
  MOKA_CUDA_CHECK(cudaMemcpy(counts, c.data(), c.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
  MOKA_CUDA_CHECK(cudaMemcpy(offsets, o.data(), o.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
}

template <typename T>
T* ExpertExchange::staging(int which, size_t elems) {
  const size_t bytes = std::max<size_t>(elems, 1) * sizeof(T);
  if (bytes > staging_[which].size()) {
    staging_[which] = {};  // freed before the larger one is allocated
    staging_[which] = DeviceArray<std::byte>(bytes);
  }
  return reinterpret_cast<T*>(staging_[which].data());
}

void ExpertExchange::move(const void* src, const std::vector<core::TransferBlock>& from_blocks, void* dst,
                          const std::vector<core::TransferBlock>& to_blocks, size_t row_bytes, cudaStream_t stream) {
  std::vector<DeviceGroup::Transfer> sends, recvs;
  for (const core::TransferBlock& b : from_blocks)
    if (b.rows)
      sends.push_back(
          {b.peer, const_cast<char*>(static_cast<const char*>(src)) + b.first * row_bytes, b.rows * row_bytes});
  for (const core::TransferBlock& b : to_blocks)
    if (b.rows) recvs.push_back({b.peer, static_cast<char*>(dst) + b.first * row_bytes, b.rows * row_bytes});
  group_.send_recv(sends, recvs, stream);
}

void ExpertExchange::dispatch(const bf16* tokens, bf16* grouped, int64_t width, cudaStream_t stream) {
  const int64_t slots = tokens_ * shape_.top_k;
  bf16* send = staging<bf16>(0, slots * width);
  gather_rows(tokens, send, send_position_.data(), slots, shape_.top_k, width, stream);
  move(send, blocks_.sends, grouped, blocks_.receives, width * sizeof(bf16), stream);
}

void ExpertExchange::dispatch_scalars(const float* per_slot, float* per_row, cudaStream_t stream) {
  const int64_t slots = tokens_ * shape_.top_k;
  float* send = staging<float>(1, slots);
  scatter_scalars(per_slot, send, send_position_.data(), slots, stream);
  move(send, blocks_.sends, per_row, blocks_.receives, sizeof(float), stream);
}

void ExpertExchange::combine(const bf16* grouped, bf16* by_send_position, int64_t width, cudaStream_t stream) {
  move(grouped, blocks_.receives, by_send_position, blocks_.sends, width * sizeof(bf16), stream);
}

void ExpertExchange::combine_scalars(const float* per_row, float* per_slot, cudaStream_t stream) {
  const int64_t slots = tokens_ * shape_.top_k;
  float* back = staging<float>(1, slots);
  move(per_row, blocks_.receives, back, blocks_.sends, sizeof(float), stream);
  gather_scalars(back, per_slot, send_position_.data(), slots, stream);
}

}  // namespace moka::cuda
