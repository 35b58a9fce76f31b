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
  expert_offset_.assign(1, 0);
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

  // Sends: this rank's send order holds expert after expert, so (owner, expert) blocks follow.
  send_blocks_.clear();
  int64_t first = 0;
  for (int64_t e = 0; e < E; ++e) {
    send_blocks_.push_back({static_cast<int>(e / El), first, host_counts_[e]});
    first += host_counts_[e];
  }
  // Receives: expert by expert, each expert's rows from source 0, then 1, ..., padded to the tile.
  const int32_t* received = host_counts_ + E;
  recv_blocks_.clear();
  expert_rows_.assign(El, 0);
  expert_offset_.assign(El + 1, 0);
  for (int64_t e = 0; e < El; ++e) {
    int64_t row = expert_offset_[e];
    for (int src = 0; src < R; ++src) {
      recv_blocks_.push_back({src, row, received[src * El + e]});
      row += received[src * El + e];
    }
    expert_rows_[e] = row - expert_offset_[e];
    expert_offset_[e + 1] = expert_offset_[e] + (expert_rows_[e] + tile_rows_ - 1) / tile_rows_ * tile_rows_;
  }
}

void ExpertExchange::upload_schedule(int32_t* counts, int32_t* offsets) const {
  // Blocking copies: plan() has already waited for the stream, so nothing reads these now.
  const std::vector<int32_t> c(expert_rows_.begin(), expert_rows_.end());
  const std::vector<int32_t> o(expert_offset_.begin(), expert_offset_.end());
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

void ExpertExchange::move(const void* src, const std::vector<Block>& from_blocks, void* dst,
                          const std::vector<Block>& to_blocks, size_t row_bytes, cudaStream_t stream) {
  std::vector<DeviceGroup::Transfer> sends, recvs;
  for (const Block& b : from_blocks)
    if (b.rows) sends.push_back({b.peer, const_cast<char*>(static_cast<const char*>(src)) + b.first * row_bytes, b.rows * row_bytes});
  for (const Block& b : to_blocks)
    if (b.rows) recvs.push_back({b.peer, static_cast<char*>(dst) + b.first * row_bytes, b.rows * row_bytes});
  group_.send_recv(sends, recvs, stream);
}

void ExpertExchange::dispatch(const bf16* tokens, bf16* grouped, int64_t width, cudaStream_t stream) {
  const int64_t slots = tokens_ * shape_.top_k;
  bf16* send = staging<bf16>(0, slots * width);
  gather_rows(tokens, send, send_position_, slots, shape_.top_k, width, stream);
  move(send, send_blocks_, grouped, recv_blocks_, width * sizeof(bf16), stream);
}

void ExpertExchange::dispatch_scalars(const float* per_slot, float* per_row, cudaStream_t stream) {
  const int64_t slots = tokens_ * shape_.top_k;
  float* send = staging<float>(1, slots);
  scatter_scalars(per_slot, send, send_position_, slots, stream);
  move(send, send_blocks_, per_row, recv_blocks_, sizeof(float), stream);
}

void ExpertExchange::combine(const bf16* grouped, bf16* by_send_position, int64_t width, cudaStream_t stream) {
  move(grouped, recv_blocks_, by_send_position, send_blocks_, width * sizeof(bf16), stream);
}

void ExpertExchange::combine_scalars(const float* per_row, float* per_slot, cudaStream_t stream) {
  const int64_t slots = tokens_ * shape_.top_k;
  float* back = staging<float>(1, slots);
  move(per_row, recv_blocks_, back, send_blocks_, sizeof(float), stream);
  gather_scalars(back, per_slot, send_position_, slots, stream);
}

}  // namespace moka::cuda
