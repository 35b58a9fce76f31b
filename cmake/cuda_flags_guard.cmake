# Refuses CUDA compiler flags that change the rounding of single-precision arithmetic: fast math,
# flushing denormals, approximate division or square root. The megakernels rely on the forward's
# h = act(g, u) and the backward's recomputed h being the same bits, computed in different
# translation units (core/activation.hpp), and every path on matching the CPU reference within
# bf16 precision. Used by the top-level CMakeLists.txt; tested by tests/cmake/cuda_flags_guard_test.cmake.
function(moka_check_cuda_flags flags)
  foreach(pattern "-?-use_fast_math" "-?-ftz[= ](true|1)" "-?-prec-div[= ](false|0)" "-?-prec-sqrt[= ](false|0)")
    string(REGEX MATCH "(^|[ ;])${pattern}([ ;]|$)" bad "${flags}")
    if(bad)
      string(STRIP "${bad}" bad)
      message(FATAL_ERROR "moka: the CUDA flag '${bad}' changes single-precision rounding, which breaks the "
                          "megakernels' bitwise match of forward and recomputed activations; remove it "
                          "from CMAKE_CUDA_FLAGS")
    endif()
  endforeach()
endfunction()
