# The math environment's verifier (extraction, normalisation, parsing, exact and float values).
if(TARGET rlh_environments_core)
  target_compile_options(rlh_environments_core PRIVATE -fsanitize=fuzzer-no-link)
  rlh_add_fuzz_test(fuzz_math_verifier
    SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/fuzz_math_verifier.cpp
    LINK rlh_environments_core
    CORPUS ${CMAKE_CURRENT_SOURCE_DIR}/corpus/math_verifier
    DICT ${CMAKE_CURRENT_SOURCE_DIR}/dict/math_verifier.dict)
endif()
