# Regenerates build/generated/moka_version.cpp on every build so `commit` in bench JSON is current.
set(MOKA_VERSION_CPP ${PROJECT_BINARY_DIR}/generated/moka_version.cpp)
add_custom_target(moka_version_gen
  COMMAND ${CMAKE_COMMAND} -DOUT=${MOKA_VERSION_CPP} -DSRC=${PROJECT_SOURCE_DIR}
          -P ${PROJECT_SOURCE_DIR}/cmake/write_version.cmake
  BYPRODUCTS ${MOKA_VERSION_CPP}
  COMMENT "moka: stamping commit")
