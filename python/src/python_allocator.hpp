// moka._moka.PythonAllocator: moka's DeviceAllocator over two Python callables (moka.torch passes
// torch's caching allocator). Part of the extension (python/src/moka_ext.cpp).
#pragma once
#include <nanobind/nanobind.h>

#include <cstdint>
#include <string>
#include <utility>

#include "moka/allocator.hpp"
#include "moka/error.hpp"

namespace moka_python {

namespace nb = nanobind;

// A DeviceAllocator of two Python callables, alloc(nbytes, stream) -> pointer and
// free(pointer, nbytes, stream) (moka.torch passes torch's caching allocator). moka calls them from
// layer calls that released the GIL and from destructors, so each call takes the GIL itself.
class PythonAllocator final : public moka::DeviceAllocator {
 public:
  PythonAllocator(nb::object alloc, nb::object free) : alloc_(std::move(alloc)), free_(std::move(free)) {
    for (auto [name, f] : {std::pair{"alloc", alloc_.ptr()}, std::pair{"free", free_.ptr()}})
      if (!PyCallable_Check(f))
        throw nb::type_error((std::string("PythonAllocator(): ") + name + " must be callable, got " +
                              nb::type_name(nb::handle(f).type()).c_str())
                                 .c_str());
  }

  // A Python exception becomes a moka::Error naming it, which the layer call raises as moka.Error.
  void* allocate(size_t bytes, moka::Stream stream) override {
    nb::gil_scoped_acquire gil;
    const std::string call = "the allocator's alloc(" + std::to_string(bytes) + " bytes)";
    try {
      return reinterpret_cast<void*>(nb::cast<uintptr_t>(alloc_(bytes, reinterpret_cast<uintptr_t>(stream.handle))));
    } catch (const nb::python_error& e) {
      throw moka::Error(moka::ErrorCode::cuda,
                        call + " raised " + nb::type_name(e.type()).c_str() + ": " + nb::str(e.value()).c_str());
    } catch (const nb::cast_error&) {
      throw moka::Error(moka::ErrorCode::invalid_argument, call + " returned no device pointer (a non-negative int)");
    }
  }

  // Called from destructors: an exception is reported to sys.unraisablehook, not raised. At the
  // interpreter's exit nothing is called (the process's device memory goes with it).
  void deallocate(void* pointer, size_t bytes, moka::Stream stream) override {
    if (!nb::is_alive()) return;
    nb::gil_scoped_acquire gil;
    try {
      free_(reinterpret_cast<uintptr_t>(pointer), bytes, reinterpret_cast<uintptr_t>(stream.handle));
    } catch (nb::python_error& e) {
      e.discard_as_unraisable(free_);
    }
  }

  const nb::object& alloc() const { return alloc_; }
  const nb::object& free() const { return free_; }

 private:
  nb::object alloc_, free_;
};

}  // namespace moka_python
