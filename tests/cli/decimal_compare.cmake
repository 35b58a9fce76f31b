# Exact comparison of non-negative decimal numbers ("0.0", "9.9e-05", "1e-5", "12.5E+3") in
# CMake, which has no floating point: each number becomes its significant digits and the
# decimal exponent of the leading one, compared as integers and equal-length digit strings.

# Sets <out_digits> (no leading or trailing zeros; "" for zero) and <out_exponent> (power of ten
# of the first digit) of `number`; FATAL_ERROR when `number` is not a non-negative decimal.
function(decimal_parse number out_digits out_exponent)
  # At least one digit before the exponent; the second MATCHES sets the CMAKE_MATCH_n read below.
  if(NOT number MATCHES "^\\.?[0-9]" OR NOT number MATCHES "^([0-9]*)(\\.([0-9]*))?([eE]([+-]?[0-9]+))?$")
    message(FATAL_ERROR "'${number}' is not a non-negative decimal number")
  endif()
  set(whole "${CMAKE_MATCH_1}")
  set(fraction "${CMAKE_MATCH_3}")
  set(exponent "${CMAKE_MATCH_5}")
  if(exponent STREQUAL "")
    set(exponent 0)
  endif()
  string(REGEX REPLACE "^\\+" "" exponent "${exponent}")
  string(LENGTH "${whole}" whole_length)
  set(digits "${whole}${fraction}")
  # Position of the first digit: each leading zero moves it one place right.
  string(LENGTH "${digits}" length_with_zeros)
  string(REGEX REPLACE "^0+" "" digits "${digits}")
  string(LENGTH "${digits}" length)
  math(EXPR zero_count "${length_with_zeros} - ${length}")
  string(REGEX REPLACE "0+$" "" digits "${digits}")
  math(EXPR exponent "${exponent} + ${whole_length} - 1 - ${zero_count}")
  set(${out_digits} "${digits}" PARENT_SCOPE)
  set(${out_exponent} "${exponent}" PARENT_SCOPE)
endfunction()

# Sets <out> to TRUE when a <= b, FALSE otherwise.
function(decimal_less_equal a b out)
  decimal_parse("${a}" a_digits a_exponent)
  decimal_parse("${b}" b_digits b_exponent)
  set(result TRUE)
  if(a_digits STREQUAL "")
    # zero is below everything
  elseif(b_digits STREQUAL "" OR a_exponent GREATER b_exponent)
    set(result FALSE)
  elseif(a_exponent EQUAL b_exponent)
    # Same leading exponent: pad the shorter digit string with zeros and compare as text.
    string(LENGTH "${a_digits}" a_length)
    string(LENGTH "${b_digits}" b_length)
    while(NOT a_length EQUAL b_length)
      if(a_length LESS b_length)
        string(APPEND a_digits 0)
      else()
        string(APPEND b_digits 0)
      endif()
      string(LENGTH "${a_digits}" a_length)
      string(LENGTH "${b_digits}" b_length)
    endwhile()
    if(a_digits STRGREATER b_digits)
      set(result FALSE)
    endif()
  endif()
  set(${out} ${result} PARENT_SCOPE)
endfunction()
