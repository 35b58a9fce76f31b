#include "cuda/expert_exchange.hpp"

#include "cuda/check.hpp"

namespace moka::cuda {

ExpertExchange::ExpertExchange(DeviceGroup& group, const MoeShape& shape, int64_t tile_rows)
    : group_(group), shape_(shape), tile_rows_(tile_rows), local_experts_(shape.num_experts / group.size()) {
  const int64_t E = shape_.num_experts;
  MOKA_CUDA_CHECK(cudaMalloc(&sort_.counts, E * sizeof(int32_t)));
  MOKA_CUDA_CHECK(cudaMalloc(&sort_.offsets, (E + 1) * sizeof(int32_t)));
  MOKA_CUDA_CHECK(cudaMalloc(&received_counts_, group_.size() * local_experts_ * sizeof(int32_t)));
  MOKA_CUDA_CHECK(cudaHostAlloc(&host_counts_, (E + group_.size() * local_experts_) * sizeof(int32_t), 0));
  MOKA_CUDA_CHECK(cudaHostAlloc(&error_, sizeof(unsigned long long), cudaHostAllocMapped));
  *error_ = kNoRoutingError;
  MOKA_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&sort_.error), error_, 0));
}

ExpertExchange::~ExpertExchange() {
  for (void* p : {static_cast<void*>(sort_.counts), static_cast<void*>(sort_.offsets),
                  static_cast<void*>(sort_.chunk_counts), static_cast<void*>(sort_.row_of_slot),
                  static_cast<void*>(received_counts_), staging_[0], staging_[1]})
    cudaFree(p);
  cudaFreeHost(host_counts_);
  cudaFreeHost(error_);
}

void ExpertExchange::plan(const int32_t* topk_ids, const float* topk_weights, int64_t tokens, cudaStream_t stream) {
  const int R = group_.size();
  const int64_t k = shape_.top_k, E = shape_.num_experts, El = local_experts_, slots = tokens * k;
  tokens_ = tokens;
  if (size_t(slots) > slot_capacity_) {
    cudaFree(sort_.chunk_counts);
    cudaFree(sort_.row_of_slot);
    sort_.chunk_counts = sort_.row_of_slot = nullptr;
    MOKA_CUDA_CHECK(cudaMalloc(&sort_.chunk_counts, schedule_chunks(slots) * E * sizeof(int32_t)));
    MOKA_CUDA_CHECK(cudaMalloc(&sort_.row_of_slot, slots * sizeof(int32_t)));
    slot_capacity_ = slots;
  }
  *error_ = kNoRoutingError;  // the stream is idle here: the previous plan synchronized
  // Sorting by global expert with tile 1 is the single-rank schedule over all E experts.
  sort_.slots = slots;
  sort_.num_experts = E;
  sort_.first_expert = 0;
  sort_.global_experts = E;
  sort_.tile_rows = 1;
  sort_.top_k = k;
  send_position_ = sort_.row_of_slot;
  build_schedule(sort_, topk_ids, topk_weights, stream);

  // Counts per expert to every owner: rank p receives [source][its E_local experts].
  std::vector<size_t> bytes(R, El * sizeof(int32_t)), offsets(R);
  for (int p = 0; p < R; ++p) offsets[p] = p * El * sizeof(int32_t);
  group_.all_to_all_v(sort_.counts, bytes.data(), offsets.data(), received_counts_, bytes.data(), offsets.data(),
                      stream);
  MOKA_CUDA_CHECK(cudaMemcpyAsync(host_counts_, sort_.counts, E * sizeof(int32_t), cudaMemcpyDeviceToHost, stream));
  MOKA_CUDA_CHECK(cudaMemcpyAsync(host_counts_ + E, received_counts_, R * El * sizeof(int32_t),
                                  cudaMemcpyDeviceToHost, stream));
  MOKA_CUDA_CHECK(cudaStreamSynchronize(stream));

  blocks_ = core::plan_exchange_blocks(host_counts_, host_counts_ + E, R, El, tile_rows_);
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
  if (bytes > staging_bytes_[which]) {
    cudaFree(staging_[which]);
    staging_[which] = nullptr;
    MOKA_CUDA_CHECK(cudaMalloc(&staging_[which], bytes));
    staging_bytes_[which] = bytes;
  }
  return static_cast<T*>(staging_[which]);
}

void ExpertExchange::move(const void* src, const std::vector<core::TransferBlock>& from_blocks, void* dst,
                          const std::vector<core::TransferBlock>& to_blocks, size_t row_bytes, cudaStream_t stream) {
  std::vector<DeviceGroup::Transfer> sends, recvs;
  for (const core::TransferBlock& b : from_blocks)
    if (b.rows) sends.push_back({b.peer, const_cast<char*>(static_cast<const char*>(src)) + b.first * row_bytes, b.rows * row_bytes});
  for (const core::TransferBlock& b : to_blocks)
    if (b.rows) recvs.push_back({b.peer, static_cast<char*>(dst) + b.first * row_bytes, b.rows * row_bytes});
  group_.send_recv(sends, recvs, stream);
}

void ExpertExchange::dispatch(const bf16* tokens, bf16* grouped, int64_t width, cudaStream_t stream) {
  const int64_t slots = tokens_ * shape_.top_k;
  bf16* send = staging<bf16>(0, slots * width);
  gather_rows(tokens, send, send_position_, slots, shape_.top_k, width, stream);
  move(send, blocks_.sends, grouped, blocks_.receives, width * sizeof(bf16), stream);
}

void ExpertExchange::dispatch_scalars(const float* per_slot, float* per_row, cudaStream_t stream) {
  const int64_t slots = tokens_ * shape_.top_k;
  float* send = staging<float>(1, slots);
  scatter_scalars(per_slot, send, send_position_, slots, stream);
  move(send, blocks_.sends, per_row, blocks_.receives, sizeof(float), stream);
}

void ExpertExchange::combine(const bf16* grouped, bf16* by_send_position, int64_t width, cudaStream_t stream) {
  move(grouped, blocks_.receives, by_send_position, blocks_.sends, width * sizeof(bf16), stream);
}

void ExpertExchange::combine_scalars(const float* per_row, float* per_slot, cudaStream_t stream) {
  const int64_t slots = tokens_ * shape_.top_k;
  float* back = staging<float>(1, slots);
  move(per_row, blocks_.receives, back, blocks_.sends, sizeof(float), stream);
  gather_scalars(back, per_slot, send_position_, slots, stream);
}

}  // namespace moka::cuda
