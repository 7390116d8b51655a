# Model descriptions and checkpoints: safetensors headers and HF config.json.
rlh_add_fuzz_test(fuzz_safetensors_header
  SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/fuzz_safetensors_header.cpp
  LINK rlh_safetensors
  CORPUS ${CMAKE_CURRENT_SOURCE_DIR}/corpus/safetensors_header)
rlh_add_fuzz_test(fuzz_hf_config
  SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/fuzz_hf_config.cpp
  LINK rlh_model_llama_core
  CORPUS ${CMAKE_CURRENT_SOURCE_DIR}/corpus/hf_config)
