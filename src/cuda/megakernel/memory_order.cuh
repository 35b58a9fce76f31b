// The megakernels' synchronization primitives with the memory order, the scope and the
// participating threads named at each call, as NCCL's device API names them: atomic loads,
// stores and adds, fences, the generic-to-async proxy fence and CTA barriers over a ThreadGroup.
// Each helper accepts only the combinations the kernels use and emits the instruction they
// always emitted (the SASS of every megakernel object is unchanged by the move to them).
#pragma once
#include <cstdint>

namespace moka::cuda::mk {

// The C++ memory orders that PTX's ld/st/red/atom/fence qualifiers name (seq_cst: fence.sc).
enum class MemoryOrder { relaxed, acquire, release, acq_rel, seq_cst };
// The threads an operation synchronizes with: this CTA, this GPU, every GPU and the host.
enum class Scope { cta, gpu, sys };

template <MemoryOrder, Scope>
inline constexpr bool kUnsupportedOrder = false;  // a static_assert's condition in a discarded branch

// A load of a word of global memory. relaxed at GPU scope: ld.relaxed.gpu (int64_t). relaxed at
// system scope: a volatile access, which PTX orders as a relaxed one at system scope (kept
// volatile, as the status words were always read, so the compiler treats it as it did).
template <MemoryOrder O, Scope S, class T>
__device__ inline T atomic_load(const T* p) {
  if constexpr (O == MemoryOrder::relaxed && S == Scope::gpu) {
    static_assert(sizeof(T) == 8, "ld.relaxed.gpu is emitted for 64-bit words only");
    int64_t v;
    asm volatile("ld.relaxed.gpu.global.s64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return T(v);
  } else if constexpr (O == MemoryOrder::relaxed && S == Scope::sys) {
    return *reinterpret_cast<const volatile T*>(p);
  } else {
    static_assert(kUnsupportedOrder<O, S>, "atomic_load: relaxed at GPU or system scope only");
  }
}

// A store to a word of global memory. relaxed at system scope: a volatile store (see atomic_load).
template <MemoryOrder O, Scope S, class T>
__device__ inline void atomic_store(T* p, T value) {
  if constexpr (O == MemoryOrder::relaxed && S == Scope::sys) {
    *reinterpret_cast<volatile T*>(p) = value;
  } else {
    static_assert(kUnsupportedOrder<O, S>, "atomic_store: relaxed at system scope only");
  }
}

// Adds kValue to a 64-bit word of global memory, the result unused (a `red`). release at GPU
// scope: red.release.gpu. The value is a template argument so that it stays an immediate: a
// register operand holds a register pair in every loop the add is in (the backward's consumers
// were allocated differently).
template <MemoryOrder O, Scope S, int64_t kValue>
__device__ inline void atomic_add(int64_t* p) {
  if constexpr (O == MemoryOrder::release && S == Scope::gpu) {
    asm volatile("red.release.gpu.global.add.u64 [%0], %1;" ::"l"(p), "n"(kValue) : "memory");
  } else {
    static_assert(kUnsupportedOrder<O, S>, "atomic_add: release at GPU scope only");
  }
}

// An add that returns the old value (tickets, arrivals). relaxed at GPU scope: atomicAdd.
template <MemoryOrder O, Scope S, class T>
__device__ inline T atomic_fetch_add(T* p, T value) {
  static_assert(O == MemoryOrder::relaxed && S == Scope::gpu, "atomic_fetch_add: relaxed at GPU scope only");
  return atomicAdd(p, value);
}

// Compare-and-swap, returns the old value. relaxed at GPU scope: atomicCAS.
template <MemoryOrder O, Scope S, class T>
__device__ inline T atomic_cas(T* p, T expected, T desired) {
  static_assert(O == MemoryOrder::relaxed && S == Scope::gpu, "atomic_cas: relaxed at GPU scope only");
  return atomicCAS(p, expected, desired);
}

// A fence. acq_rel at GPU scope: fence.acq_rel.gpu. seq_cst at GPU scope: __threadfence()
// (membar.gl, which PTX defines as fence.sc.gpu).
template <MemoryOrder O, Scope S>
__device__ inline void fence() {
  if constexpr (O == MemoryOrder::acq_rel && S == Scope::gpu) {
    asm volatile("fence.acq_rel.gpu;" ::: "memory");
  } else if constexpr (O == MemoryOrder::seq_cst && S == Scope::gpu) {
    __threadfence();
  } else {
    static_assert(kUnsupportedOrder<O, S>, "fence: acq_rel or seq_cst at GPU scope only");
  }
}

// Proxy fence (global memory): generic-proxy stores of this thread become visible to later TMA
// (async-proxy) reads that are ordered after them by the counters, and this thread's TMA
// accesses after it follow the acquires before it.
__device__ inline void fence_proxy_async_global() { asm volatile("fence.proxy.async.global;" ::: "memory"); }

// The threads of a CTA that pass a barrier together: `threads` threads on named barrier
// `barrier_id`, or, when `threads` is 0, every thread of the CTA on barrier 0 (__syncthreads;
// a named group takes another id). A type per group, so that sync(group) picks its instruction
// at compile time (a runtime test, folded only after inlining, changed the backward's code).
template <uint32_t kBarrierId, uint32_t kThreadCount>
struct ThreadGroup {
  static constexpr uint32_t barrier_id = kBarrierId;
  static constexpr uint32_t threads = kThreadCount;
  static_assert((kBarrierId == 0) == (kThreadCount == 0), "barrier 0 is the whole CTA's");
};
inline constexpr ThreadGroup<0, 0> kCtaGroup{};  // every thread of the CTA

// Waits until every thread of the group arrived; the group's memory accesses before the barrier
// happen before its accesses after it (CTA scope). The whole CTA: __syncthreads(). A named
// group: bar.sync with a "memory" clobber, a compiler fence on both sides (the task-level
// barriers of tile_gemm.cuh, which say why the compiler must not move accesses across them).
template <uint32_t kBarrierId, uint32_t kThreadCount>
__device__ __forceinline__ void sync(ThreadGroup<kBarrierId, kThreadCount>) {
  if constexpr (kThreadCount == 0) {
    __syncthreads();
  } else {
    asm volatile("bar.sync %0, %1;" ::"r"(kBarrierId), "r"(kThreadCount) : "memory");
  }
}

}  // namespace moka::cuda::mk
