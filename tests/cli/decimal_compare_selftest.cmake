# Checks tests/cli/decimal_compare.cmake: cmake -P tests/cli/decimal_compare_selftest.cmake
include(${CMAKE_CURRENT_LIST_DIR}/decimal_compare.cmake)

# Each case: a|b|expected (a <= b).
set(cases
  "0.0|1e-5|TRUE" "0|0.0|TRUE" "1e-5|0.0|FALSE" "9.9e-06|1e-5|TRUE" "1e-5|1e-5|TRUE" "1.0e-05|1e-5|TRUE"
  "0.00001|1e-5|TRUE" "1.00001e-05|1e-5|FALSE" "9.9e-05|1e-5|FALSE" "1.2e-05|1e-5|FALSE" "0.00002|1e-5|FALSE"
  "2e-6|1e-5|TRUE" "3.1e-06|3e-6|FALSE" "12.5E+3|1.25e4|TRUE" "12500.1|1.25e4|FALSE" "1|0.5|FALSE"
  "000.0012|1.2e-3|TRUE" "5.|5|TRUE" ".5|0.5|TRUE")
set(failures 0)
foreach(c IN LISTS cases)
  string(REPLACE "|" ";" parts "${c}")
  list(GET parts 0 a)
  list(GET parts 1 b)
  list(GET parts 2 expected)
  decimal_less_equal("${a}" "${b}" got)
  if(NOT got STREQUAL expected)
    message(SEND_ERROR "${a} <= ${b}: got ${got}, expected ${expected}")
    math(EXPR failures "${failures} + 1")
  endif()
endforeach()
if(failures GREATER 0)
  message(FATAL_ERROR "${failures} decimal comparisons wrong")
endif()
message(STATUS "decimal comparisons all right")
