# The jsonl dataset over a hostile file (users' own data): every row layout, indexed and read.
if(TARGET rlh_dataset_jsonl_core)
  target_compile_options(rlh_dataset_jsonl_core PRIVATE -fsanitize=fuzzer-no-link)
  rlh_add_fuzz_test(fuzz_jsonl_dataset
    SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/fuzz_jsonl_dataset.cpp
    LINK rlh_dataset_jsonl_core
    CORPUS ${CMAKE_CURRENT_SOURCE_DIR}/corpus/jsonl_dataset
    DICT ${CMAKE_CURRENT_SOURCE_DIR}/dict/jsonl_dataset.dict)
endif()
