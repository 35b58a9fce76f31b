// The stream a call enqueues its GPU work on, passed explicitly to every call that launches
// (as DeepEP's launchers and CUTLASS's run(stream) take theirs). No CUDA headers: `handle` is a
// cudaStream_t (PyTorch: torch.cuda.current_stream().cuda_stream). Stream{} is the legacy
// default stream. The CPU backend ignores it.
#pragma once

namespace moka {

struct Stream {
  void* handle = nullptr;
};

}  // namespace moka
