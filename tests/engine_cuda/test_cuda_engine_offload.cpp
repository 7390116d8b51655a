// The CUDA engine with its optimizer state offloaded to the host (CudaEngineOptions::
// offload_state, dtensor's cpu_offload): the same steps, bit for bit, as the engine that keeps
// the state on the device, with 12 bytes a parameter moved off it. The staging chunk is made
// small here so that the update streams many chunks and cuts tensors at chunk boundaries.
// Label `gpu`: without a Hopper GPU the tests skip with the reason.
#include <gtest/gtest.h>

#include <cuda_runtime_api.h>

#include <cstring>
#include <string>
#include <vector>

#include "kernels_cuda_abi.hpp"
#include "nll_loss.hpp"
#include "rlhost/engine_cuda/cuda_engine.hpp"
#include "need_gpu.hpp"
#include "small_models.hpp"

using namespace rlh;

namespace {

constexpr auto nll = test::nll_loss;

bool same_bits(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b, std::string* where) {
  if (a.size() != b.size()) {
    *where = "tensor count";
    return false;
  }
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i].size() != b[i].size() || std::memcmp(a[i].data(), b[i].data(), a[i].size() * sizeof(float)) != 0) {
      *where = "tensor " + std::to_string(i);
      return false;
    }
  return true;
}

engine::CudaEngineOptions options(bool offload, bool router_fp64) {
  engine::CudaEngineOptions co = test::cuda_options();
  co.optimizer.weight_decay = 0.1;  // both lists (decayed matrices, undecayed vectors)
  co.optimizer.max_grad_norm = 0.5;  // clipping scales every chunk's gradients alike
  co.moe.router_fp64 = router_fp64;  // the router's weight read from the masters' side copy
  co.offload_state = offload;
  co.offload_chunk_elems = 5000;  // rounded up to 5056: many chunks, tensors cut across them
  return co;
}

// Three steps of the resident and the offloaded engine from the same weights: the losses, norms,
// weights, bf16 views and AdamW moments agree bit for bit; the device holds 12 bytes a parameter
// less (the staging buffer aside) and the host holds them.
template <class Model>
void check_offload(const Model& s, bool router_fp64) {
  engine::MicroBatch mb;
  mb.input_ids = s.ids;
  mb.cu_seqlens = s.cu;
  engine::StepOptions so;
  so.lr = 3e-3;
  so.global_tokens = s.predicted();
  engine::CudaEngine resident(s.desc, options(false, router_fp64));
  engine::CudaEngine offloaded(s.desc, options(true, router_fp64));
  resident.load_parameters(s.weights);
  offloaded.load_parameters(s.weights);
  for (int step = 0; step < 3; ++step) {
    const auto a = resident.train_step({&mb, 1}, so, nll);
    const auto b = offloaded.train_step({&mb, 1}, so, nll);
    EXPECT_EQ(a.loss, b.loss) << "step " << step;
    EXPECT_EQ(a.grad_norm, b.grad_norm) << "step " << step;
    EXPECT_EQ(b.step, step + 1);
  }
  std::string where;
  EXPECT_TRUE(same_bits(resident.save_parameters(), offloaded.save_parameters(), &where)) << "masters: " << where;
  const auto ra = resident.adam_state(), oa = offloaded.adam_state();
  EXPECT_EQ(ra.step, oa.step);
  EXPECT_TRUE(same_bits(ra.exp_avg, oa.exp_avg, &where)) << "exp_avg: " << where;
  EXPECT_TRUE(same_bits(ra.exp_avg_sq, oa.exp_avg_sq, &where)) << "exp_avg_sq: " << where;
  // A forward after the steps reads the bf16 weights the streamed update wrote.
  engine::OutputRequest req;
  req.logprob = true;
  EXPECT_EQ(resident.forward(mb, req).logprob, offloaded.forward(mb, req).logprob);
  // The device views of the masters (a colocated refit's source): staged, the same values.
  const auto views = offloaded.master_views();
  const auto masters = offloaded.save_parameters();
  ASSERT_EQ(views.size(), masters.size());
  for (size_t i = 0; i < views.size(); ++i) {
    const auto& v = views[i];
    std::vector<float> got(size_t(v.pieces * v.piece));
    ASSERT_EQ(cudaMemcpy2D(got.data(), size_t(v.piece) * 4, v.data, size_t(v.stride) * 4, size_t(v.piece) * 4,
                           size_t(v.pieces), cudaMemcpyDeviceToHost),
              cudaSuccess);
    EXPECT_EQ(0, std::memcmp(got.data(), masters[i].data(), got.size() * 4)) << "view " << i;
  }
  const auto rs = resident.stats(), os = offloaded.stats();
  EXPECT_EQ(rs.host_state_bytes, 0);
  EXPECT_GE(os.host_state_bytes, 12 * offloaded.num_elements());
  EXPECT_LT(os.state_bytes, rs.state_bytes);
  EXPECT_EQ(os.weight_bytes, rs.weight_bytes);
  std::printf("offload: device state %lld -> %lld bytes, host %lld bytes\n", (long long)rs.state_bytes,
              (long long)os.state_bytes, (long long)os.host_state_bytes);
}

TEST(CudaEngineOffload, DenseStepsAreBitwiseTheResidentOnes) {
  NEED_GPU();
  check_offload(test::Small(), false);
}

TEST(CudaEngineOffload, MoeStepsAreBitwiseTheResidentOnes) {
  NEED_GPU();
  const test::SmallMoe s;
  for (const bool fp64 : {false, true}) {
    SCOPED_TRACE(fp64 ? "fp64 router" : "fp32 router");
    check_offload(s, fp64);
  }
}

// A checkpoint of the resident engine loads into an offloaded one (and the reverse), and the
// next step agrees bit for bit: load_parameters and load_adam_state reach the host copies.
TEST(CudaEngineOffload, StateCrossesBetweenResidentAndOffloaded) {
  NEED_GPU();
  const test::Small s;
  engine::MicroBatch mb;
  mb.input_ids = s.ids;
  mb.cu_seqlens = s.cu;
  engine::StepOptions so;
  so.lr = 3e-3;
  so.global_tokens = s.predicted();
  for (const bool from_offloaded : {false, true}) {
    SCOPED_TRACE(from_offloaded ? "offloaded -> resident" : "resident -> offloaded");
    engine::CudaEngine src(s.desc, options(from_offloaded, false));
    src.load_parameters(s.weights);
    for (int i = 0; i < 2; ++i) src.train_step({&mb, 1}, so, nll);
    const auto w = src.save_parameters();
    const auto st = src.adam_state();
    engine::CudaEngine dst(s.desc, options(!from_offloaded, false));
    dst.load_parameters(w);
    dst.load_adam_state(st);
    const auto a = src.train_step({&mb, 1}, so, nll);
    const auto b = dst.train_step({&mb, 1}, so, nll);
    EXPECT_EQ(a.loss, b.loss);
    EXPECT_EQ(b.step, 3);
    std::string where;
    EXPECT_TRUE(same_bits(src.save_parameters(), dst.save_parameters(), &where)) << where;
    EXPECT_TRUE(same_bits(src.adam_state().exp_avg_sq, dst.adam_state().exp_avg_sq, &where)) << where;
  }
}

TEST(CudaEngineOffload, RefusesAChunkOfNothing) {
  NEED_GPU();
  const test::Small s;
  engine::CudaEngineOptions co = options(true, false);
  co.offload_chunk_elems = 0;
  try {
    engine::CudaEngine e(s.desc, co);
    ADD_FAILURE() << "a zero chunk was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("offload_chunk_elems must be at least 1"), std::string::npos) << e.what();
  }
}

}  // namespace
