# The config loader: YAML files, defaults chains, overrides, interpolation.
rlh_add_fuzz_test(fuzz_config
  SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/fuzz_config.cpp
  LINK rlh_config
  CORPUS ${CMAKE_CURRENT_SOURCE_DIR}/corpus/config)
