// The CUDA engine tests' skip: without a usable Hopper GPU a test skips, naming why.
#pragma once

#include <gtest/gtest.h>

#include <string>

#include "rlhost/engine_cuda/cuda_engine.hpp"

#define NEED_GPU()                                                           \
  do {                                                                       \
    std::string why;                                                         \
    if (!::rlh::engine::cuda_engine_available(&why)) GTEST_SKIP() << why;    \
  } while (0)
