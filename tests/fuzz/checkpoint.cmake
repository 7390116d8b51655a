# Checkpoint verification (manifest, training_info.json, files). Coverage-instrumented library.
if(TARGET rlh_checkpoint)
  target_compile_options(rlh_checkpoint PRIVATE -fsanitize=fuzzer-no-link)
  rlh_add_fuzz_test(fuzz_checkpoint_manifest
    SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/fuzz_checkpoint_manifest.cpp
    LINK rlh_checkpoint
    CORPUS ${CMAKE_CURRENT_SOURCE_DIR}/corpus/checkpoint_manifest
    DICT ${CMAKE_CURRENT_SOURCE_DIR}/dict/checkpoint_manifest.dict)
endif()
