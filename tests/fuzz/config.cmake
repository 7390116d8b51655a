# The config loader: YAML files, defaults chains, overrides, interpolation; and the resolvers
# on their own. The library gets coverage instrumentation.
target_compile_options(rlh_config PRIVATE -fsanitize=fuzzer-no-link)
rlh_add_fuzz_test(fuzz_config
  SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/fuzz_config.cpp
  LINK rlh_config
  CORPUS ${CMAKE_CURRENT_SOURCE_DIR}/corpus/config)
rlh_add_fuzz_test(fuzz_config_resolvers
  SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/fuzz_config_resolvers.cpp
  LINK rlh_config
  CORPUS ${CMAKE_CURRENT_SOURCE_DIR}/corpus/config_resolvers
  DICT ${CMAKE_CURRENT_SOURCE_DIR}/dict/config_resolvers.dict)
