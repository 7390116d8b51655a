# Tokenizer fuzz targets: the tokenizer.json loader, encode/decode on real tokenizers, and the
# chat-template (Jinja) engine. The library itself gets coverage instrumentation too.
if(TARGET rlh_tokenizer)
  target_compile_options(rlh_tokenizer PRIVATE -fsanitize=fuzzer-no-link)
  rlh_add_fuzz_test(fuzz_tokenizer_load
    SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/fuzz_tokenizer_load.cpp
    LINK rlh_tokenizer
    CORPUS ${CMAKE_CURRENT_SOURCE_DIR}/corpus/tokenizer_load)
  rlh_add_fuzz_test(fuzz_tokenizer_encode
    SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/fuzz_tokenizer_encode.cpp
    LINK rlh_tokenizer
    CORPUS ${CMAKE_CURRENT_SOURCE_DIR}/corpus/tokenizer_encode)
  target_compile_definitions(fuzz_tokenizer_encode PRIVATE
    RLH_FUZZ_FIXTURES="${CMAKE_SOURCE_DIR}/tests/fixtures"
    RLH_FUZZ_TOK_DATA="${CMAKE_SOURCE_DIR}/tests/tokenizer/data/hf")
  rlh_add_fuzz_test(fuzz_chat_template
    SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/fuzz_chat_template.cpp
    LINK rlh_tokenizer
    CORPUS ${CMAKE_CURRENT_SOURCE_DIR}/corpus/chat_template
    DICT ${CMAKE_CURRENT_SOURCE_DIR}/dict/jinja.dict)
  # Expressions, filters, tests and methods over edge values.
  rlh_add_fuzz_test(fuzz_jinja_filters
    SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/fuzz_jinja_filters.cpp
    LINK rlh_tokenizer
    CORPUS ${CMAKE_CURRENT_SOURCE_DIR}/corpus/jinja_filters
    DICT ${CMAKE_CURRENT_SOURCE_DIR}/dict/jinja.dict)
  # Normalizer and pre-tokenizer chains from tokenizer.json, then encoding.
  rlh_add_fuzz_test(fuzz_tokenizer_pipeline
    SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/fuzz_tokenizer_pipeline.cpp
    LINK rlh_tokenizer
    CORPUS ${CMAKE_CURRENT_SOURCE_DIR}/corpus/tokenizer_pipeline
    DICT ${CMAKE_CURRENT_SOURCE_DIR}/dict/tokenizer_pipeline.dict)
endif()
