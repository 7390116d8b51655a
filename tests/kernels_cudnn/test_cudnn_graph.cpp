// What of kernels_cudnn a machine without a GPU can check: where it looks for libcudnn.so.9, and,
// when a cuDNN 9 library is loadable here, that every tensor and operation descriptor of the
// forward and backward attention graphs is accepted (each attribute set and finalized by cuDNN's
// backend API): shapes, strides, ragged offsets, data types, pointwise modes. What needs a
// device (the operation graph on a handle, the engine heuristics, the plan, the results) is
// test_cudnn_attention's, on the GPU.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "cudnn_lib.hpp"
#include "sdpa.hpp"

namespace {

using rlh::kcudnn::cudnn_candidates;
using rlh::kcudnn::cudnn_lib;
using rlh::kcudnn::PlanKey;

TEST(KernelsCudnnGraph, LooksWhereTheBriefSays) {
  setenv("RLH_CUDNN_LIB", "/nowhere/cudnn", 1);
  std::vector<std::string> c = cudnn_candidates();
  ASSERT_GE(c.size(), 3u);
  EXPECT_EQ(c[0], "/nowhere/cudnn/libcudnn.so.9");  // a folder: the library inside it
  EXPECT_EQ(c[1], "libcudnn.so.9");                 // then the default loader path
  setenv("RLH_CUDNN_LIB", "/nowhere/libcudnn.so.9.1.0", 1);
  EXPECT_EQ(cudnn_candidates()[0], "/nowhere/libcudnn.so.9.1.0");  // a file: itself
  unsetenv("RLH_CUDNN_LIB");
  setenv("LD_LIBRARY_PATH", "/a:/b", 1);
  c = cudnn_candidates();
  EXPECT_NE(std::find(c.begin(), c.end(), "/a/libcudnn.so.9"), c.end());
  EXPECT_NE(std::find(c.begin(), c.end(), "/b/libcudnn.so.9"), c.end());
  EXPECT_NE(std::find(c.begin(), c.end(), "/usr/local/cuda/lib64/libcudnn.so.9"), c.end());
}

TEST(KernelsCudnnGraph, EveryOperationOfTheAttentionGraphsFinalizes) {
  const rlh::kcudnn::CudnnLib* lib = nullptr;
  try {
    lib = &cudnn_lib();
  } catch (const std::exception& e) {
    GTEST_SKIP() << "no usable cuDNN here: " << e.what();
  }
  std::printf("cuDNN %s from %s\n", lib->version_string().c_str(), lib->path.c_str());
  for (bool bwd : {false, true})
    for (int64_t window : {0, 16})
      for (int64_t hkv : {8, 32})
        for (int64_t D : {64, 128}) {
          PlanKey k;
          k.backward = bwd;
          k.B = 8, k.T = 12288, k.Hq = 32, k.Hkv = hkv, k.D = D, k.window = window;
          k.ldq = k.ldk = k.ldv = (32 + 2 * hkv) * D + 8;  // a fused, padded q|k|v
          k.ldo = k.lddo = 32 * D;
          k.lddq = k.ldq, k.lddk = k.lddv = hkv * D;
          size_t ops = 0;
          try {
            ops = rlh::kcudnn::build_graph_operations(k, lib->version);
          } catch (const std::exception& e) {
            ADD_FAILURE() << (bwd ? "backward" : "forward") << " window " << window << " Hkv " << hkv << " D " << D
                          << ": " << e.what();
            continue;
          }
          // bmm, scale, 6 padding, 4 causal (+5 window), 7 softmax, bmm; the backward's chain
          // (+2 per GQA head sum, +6 second padding before cuDNN 9.10).
          const size_t want = bwd ? 28 + (hkv != 32 ? 2 : 0) + (window ? 5 : 0) + (lib->version < 91000 ? 6 : 0)
                                  : 20 + (window ? 5 : 0);
          EXPECT_EQ(ops, want) << (bwd ? "backward" : "forward") << " window " << window << " Hkv " << hkv;
        }
}

}  // namespace
