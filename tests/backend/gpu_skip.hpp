// The backend tests' skip where the CUDA engine cannot run (no GPU, not Hopper), with the reason.
#pragma once

#include <string>

#include <gtest/gtest.h>

#include "rlhost/engine_cuda/cuda_engine.hpp"

#define REQUIRE_GPU()                                                                          \
  do {                                                                                         \
    std::string why;                                                                           \
    if (!rlh::engine::cuda_engine_available(&why)) GTEST_SKIP() << "no GPU path here: " << why; \
  } while (0)
