#include "cuda/expert_exchange.hpp"

#include "cuda/check.hpp"

namespace moka::cuda {
namespace {

template <typename T>
void upload(T*& device, size_t& capacity, const std::vector<T>& host) {
  if (host.size() > capacity) {
    cudaFree(device);
    device = nullptr;
    MOKA_CUDA_CHECK(cudaMalloc(&device, std::max<size_t>(host.size(), 1) * sizeof(T)));
    capacity = host.size();
  }
  if (!host.empty()) MOKA_CUDA_CHECK(cudaMemcpy(device, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
}

}  // namespace

ExpertExchange::ExpertExchange(DeviceGroup& group, const MoeShape& shape, int64_t tile_rows)
    : group_(group), shape_(shape), tile_rows_(tile_rows) {}

ExpertExchange::~ExpertExchange() {
  for (void* p : {static_cast<void*>(row_of_received_), static_cast<void*>(received_of_row_),
                  static_cast<void*>(send_position_), static_cast<void*>(received_weights_), staging_[0],
                  staging_[1], staging_[2]})
    cudaFree(p);
}

void ExpertExchange::plan(const std::vector<int32_t>& all_ids, const std::vector<float>& all_weights,
                          int64_t tokens, cudaStream_t stream) {
  const int R = group_.size(), me = group_.rank();
  const int64_t k = shape_.top_k, E = shape_.num_experts, local = E / R, slots = tokens * k;
  tokens_ = tokens;
  schedule_ = core::build_receive_schedule({R, tokens, k, local, me * local, tile_rows_}, all_ids.data());
  send_plan_ = core::build_send_plan(all_ids.data() + me * slots, tokens, k, E, R);
  const auto by_source = core::rows_by_source(schedule_);

  std::vector<int32_t> row_of_received, received_of_row(schedule_.total_rows(), -1), send_position(slots);
  std::vector<float> weights;
  send_rows_.assign(R, 0);
  recv_rows_.assign(R, 0);
  for (int p = 0; p < R; ++p) {
    recv_rows_[p] = static_cast<int64_t>(by_source[p].size());
    send_rows_[p] = send_plan_.rank_offset[p + 1] - send_plan_.rank_offset[p];
    for (int64_t row : by_source[p]) {
      received_of_row[row] = static_cast<int32_t>(row_of_received.size());
      row_of_received.push_back(static_cast<int32_t>(row));
      weights.push_back(all_weights[p * slots + schedule_.row_slot[row]]);
    }
  }
  for (size_t n = 0; n < send_plan_.slots.size(); ++n) send_position[send_plan_.slots[n]] = static_cast<int32_t>(n);
  received_ = static_cast<int64_t>(row_of_received.size());

  // The path synchronizes anyway (split sizes); plain copies keep the host vectors' lifetime simple.
  MOKA_CUDA_CHECK(cudaStreamSynchronize(stream));
  upload(row_of_received_, map_capacity_, row_of_received);
  upload(received_weights_, weight_capacity_, weights);
  upload(received_of_row_, row_capacity_, received_of_row);
  upload(send_position_, slot_capacity_, send_position);
}

void ExpertExchange::upload_schedule(int32_t* counts, int32_t* offsets) const {
  const std::vector<int32_t> c(schedule_.expert_rows.begin(), schedule_.expert_rows.end());
  const std::vector<int32_t> o(schedule_.expert_offset.begin(), schedule_.expert_offset.end());
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

void ExpertExchange::exchange(const void* send, const std::vector<int64_t>& send_rows, void* recv,
                              const std::vector<int64_t>& recv_rows, size_t row_bytes, cudaStream_t stream) {
  const int R = group_.size();
  std::vector<size_t> sb(R), so(R), rb(R), ro(R);
  size_t s_off = 0, r_off = 0;
  for (int p = 0; p < R; ++p) {
    sb[p] = send_rows[p] * row_bytes;
    rb[p] = recv_rows[p] * row_bytes;
    so[p] = s_off;
    ro[p] = r_off;
    s_off += sb[p];
    r_off += rb[p];
  }
  group_.all_to_all_v(send, sb.data(), so.data(), recv, rb.data(), ro.data(), stream);
}

void ExpertExchange::dispatch(const bf16* tokens, bf16* grouped, int64_t width, cudaStream_t stream) {
  const int64_t slots = tokens_ * shape_.top_k;
  bf16* send = staging<bf16>(0, slots * width);
  bf16* recv = staging<bf16>(1, received_ * width);
  gather_rows(tokens, send, send_position_, slots, shape_.top_k, width, stream);
  exchange(send, send_rows_, recv, recv_rows_, width * sizeof(bf16), stream);
  gather_rows(recv, grouped, row_of_received_, received_, 1, width, stream);
}

void ExpertExchange::combine(const bf16* grouped, bf16* by_send_position, int64_t width, cudaStream_t stream) {
  bf16* send = staging<bf16>(1, received_ * width);
  gather_rows(grouped, send, received_of_row_, grouped_rows(), 1, width, stream);
  exchange(send, recv_rows_, by_send_position, send_rows_, width * sizeof(bf16), stream);
}

void ExpertExchange::combine_scalars(const float* per_received, float* per_slot, cudaStream_t stream) {
  const int64_t slots = tokens_ * shape_.top_k;
  float* by_send_position = staging<float>(2, slots);
  exchange(per_received, recv_rows_, by_send_position, send_rows_, sizeof(float), stream);
  gather_scalars(by_send_position, per_slot, send_position_, slots, stream);
}

}  // namespace moka::cuda
