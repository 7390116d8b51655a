# The host's plugin file checks (before dlopen). The library gets coverage instrumentation.
if(TARGET rlh_plugin_file)
  target_compile_options(rlh_plugin_file PRIVATE -fsanitize=fuzzer-no-link)
  rlh_add_fuzz_test(fuzz_plugin_file
    SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/fuzz_plugin_file.cpp
    LINK rlh_plugin_file
    CORPUS ${CMAKE_CURRENT_SOURCE_DIR}/corpus/plugin_file
    DICT ${CMAKE_CURRENT_SOURCE_DIR}/dict/plugin_file.dict)
endif()
