# Regenerates build/generated/moka_version.cpp on every build so `commit` in bench JSON is current.
set(MOKA_VERSION_CPP ${CMAKE_BINARY_DIR}/generated/moka_version.cpp)
add_custom_target(moka_version_gen
  COMMAND ${CMAKE_COMMAND} -DOUT=${MOKA_VERSION_CPP} -DSRC=${CMAKE_SOURCE_DIR}
          -P ${CMAKE_SOURCE_DIR}/cmake/write_version.cmake
  BYPRODUCTS ${MOKA_VERSION_CPP}
  COMMENT "moka: stamping commit")
