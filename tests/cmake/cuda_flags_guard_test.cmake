# The CUDA flags guard (cmake/cuda_flags_guard.cmake) refuses every flag that changes
# single-precision rounding and accepts ordinary flags.
#   cmake -DGUARD=<cmake/cuda_flags_guard.cmake> -P cuda_flags_guard_test.cmake
# With -DFLAGS=... it checks that one set of flags (what each case below runs in a child).
if(DEFINED FLAGS)
  include(${GUARD})
  moka_check_cuda_flags("${FLAGS}")
  return()
endif()

function(expect flags want_refused)
  execute_process(COMMAND ${CMAKE_COMMAND} -DGUARD=${GUARD} "-DFLAGS=${flags}" -P ${CMAKE_CURRENT_LIST_FILE}
                  RESULT_VARIABLE rc OUTPUT_QUIET ERROR_VARIABLE err)
  if(want_refused AND (rc EQUAL 0 OR NOT err MATCHES "changes single-precision rounding"))
    message(FATAL_ERROR "flags '${flags}' were accepted: ${err}")
  elseif(NOT want_refused AND NOT rc EQUAL 0)
    message(FATAL_ERROR "flags '${flags}' were refused: ${err}")
  endif()
endfunction()

foreach(flags "--use_fast_math" "-O2 -use_fast_math -g" "-ftz=true" "--ftz true" "-prec-div=false" "--prec-sqrt=0")
  expect("${flags}" TRUE)
endforeach()
foreach(flags "" "-O3 -lineinfo" "-ftz=false" "-prec-div=true" "-DUSE_FAST_MATH_NOTE=1" "-Xptxas -v")
  expect("${flags}" FALSE)
endforeach()
message(STATUS "cuda_flags_guard: 12 cases as expected")
