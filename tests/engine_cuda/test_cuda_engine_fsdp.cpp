// The CUDA engine's FSDP (CudaEngineOptions::shard_masters; ZeRO-3, engine_cuda's
// data_parallel.cpp) at the engine's own seam, without MPI: S engines on one GPU, one per thread,
// joined by an in-process DeviceDpComm whose collectives sum on the host in rank order
// (deterministic, so runs repeat bit for bit). Each rank trains on its own sequences of one
// packed batch; one engine without data parallelism trains on all of them.
//   - losses, gradient norms, the summed gradients and three AdamW updates follow the one engine
//     (the gradients' fp32 summation order differs: per micro-batch over ranks, then over
//     micro-batches; so within fp32 tolerance), dense and MoE (the fp64 router reads its weight
//     from the masters' side copy);
//   - a rank with fewer micro-batches than its peers, or none, meets their per-unit collectives
//     (StepOptions::group_microbatches; idle_forward for forward calls);
//   - the collectives on their own stream, overlapping the compute (fsdp_comm_stream), give
//     the bits they give on the compute stream;
//   - a forward before any update gives bitwise the one engine's logprobs (the same bf16 weights,
//     gathered);
//   - each rank keeps 1/S of the bf16 weights and of the state, and no whole gradient buffer;
//   - save_parameters, adam_state and visit_master_views gather unit by unit the same values,
//     and a state saved at S ranks resumes bit for bit at S and loads at another size.
// Label `gpu`: without a Hopper GPU the tests skip with the reason.
#include <gtest/gtest.h>

#include <cuda_runtime_api.h>

#include <array>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <exception>
#include <functional>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "kernels_cuda_abi.hpp"
#include "nll_loss.hpp"
#include "rlhost/engine_cuda/cuda_engine.hpp"
#include "need_gpu.hpp"
#include "small_models.hpp"
#include "tensor_compare.hpp"
#include "thread_comm.hpp"

using namespace rlh;

namespace {

using test::Tensors;
using test::Rendezvous;
using test::ThreadDp;

// Each sequence of a packed batch as a micro-batch of its own (views into the model's ids).
struct Sequences {
  std::vector<std::array<int32_t, 2>> cu;
  std::vector<engine::MicroBatch> mb;
  template <class Model>
  explicit Sequences(const Model& s) : cu(s.cu.size() - 1), mb(s.cu.size() - 1) {
    for (size_t j = 0; j < mb.size(); ++j) {
      const int32_t len = s.cu[j + 1] - s.cu[j];
      cu[j] = {0, len};
      mb[j].input_ids = std::span<const int32_t>(s.ids).subspan(size_t(s.cu[j]), size_t(len));
      mb[j].cu_seqlens = cu[j];
    }
  }
  std::vector<engine::MicroBatch> of(const std::vector<size_t>& which) const {
    std::vector<engine::MicroBatch> out;
    for (size_t j : which) out.push_back(mb[j]);
    return out;
  }
};

// Small's shape with four layers and a tied head: the two layer slots are
// reused within a call (a slot is gathered again only after its previous layer's readers), and
// later micro-batches gather 2L - 4 layers, not all of them.
struct Deep {
  sdk::TransformerDesc desc;
  Tensors weights;
  std::vector<int32_t> ids, cu;
  Deep() {
    const nlohmann::json cfg = {{"architectures", {"LlamaForCausalLM"}}, {"model_type", "llama"},
                                {"vocab_size", 512}, {"hidden_size", 256}, {"intermediate_size", 512},
                                {"num_hidden_layers", 4}, {"num_attention_heads", 4}, {"num_key_value_heads", 2},
                                {"head_dim", 64}, {"rms_norm_eps", 1e-5}, {"max_position_embeddings", 512},
                                {"rope_theta", 10000.0}, {"tie_word_embeddings", true}};
    desc = model::describe(cfg);
    std::mt19937 rng(5);
    weights = test::random_weights(desc, rng, 1.f);
    const test::Small small;  // its packed batch
    ids = small.ids;
    cu = small.cu;
  }
  int64_t predicted() const { return int64_t(ids.size()) - int64_t(cu.size() - 1); }
};

engine::CudaEngineOptions options(bool router_fp64) {
  engine::CudaEngineOptions o = test::cuda_options();
  o.optimizer.weight_decay = 0.1;
  o.optimizer.max_grad_norm = 1.0;
  o.optimizer.eps = 1.0;  // updates proportional to the gradients: no sign flips at zero to blur the comparison
  o.moe.router_fp64 = router_fp64;
  return o;
}

// Runs fn(rank, engine) on S threads, each with its FSDP engine over one group; rethrows the
// first failure.
void on_ranks(int S, const sdk::TransformerDesc& desc, const engine::CudaEngineOptions& base,
              const std::function<void(int, engine::CudaEngine&)>& fn) {
  Rendezvous group(S);
  std::vector<std::exception_ptr> errors(static_cast<size_t>(S));
  std::vector<std::thread> threads;
  for (int r = 0; r < S; ++r)
    threads.emplace_back([&, r] {
      try {
        ThreadDp dp(group, r);
        engine::CudaEngineOptions o = base;
        o.dp = &dp;
        o.shard_optimizer = o.shard_masters = true;
        engine::CudaEngine e(desc, o);
        fn(r, e);
      } catch (...) {
        errors[size_t(r)] = std::current_exception();
      }
    });
  for (std::thread& t : threads) t.join();
  for (const auto& e : errors)
    if (e) std::rethrow_exception(e);
}

using test::relative_error;
using test::update_error;

bool same_bits(const Tensors& a, const Tensors& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i].size() != b[i].size() || std::memcmp(a[i].data(), b[i].data(), a[i].size() * 4) != 0) return false;
  return true;
}

// Which sequences of the 4-sequence batch each rank trains on: S = 2 evenly, S = 3 with 2, 2
// and none (the last rank only meets its peers' collectives).
std::vector<std::vector<size_t>> split(int S) {
  if (S == 2) return {{0, 3}, {1, 2}};
  return {{0, 2}, {1, 3}, {}};
}

struct Outcome {
  std::vector<double> loss, norm;
  Tensors grads, weights;
  engine::CudaEngineStats stats;
};

// Three steps (the last one accumulating only, so its summed gradients can be read), from the
// given weights: the one engine on every sequence, or rank r of S on its share.
template <class Model>
void train(engine::CudaEngine& e, const Model& s, const std::vector<size_t>& mine, int64_t group_mbs, Outcome& out) {
  const Sequences seqs(s);  // (the micro-batches view into it)
  const std::vector<engine::MicroBatch> mbs = seqs.of(mine);
  engine::StepOptions so;
  so.lr = 3e-3;
  so.global_tokens = s.predicted();
  so.global_sequences = int64_t(s.cu.size()) - 1;
  so.group_microbatches = group_mbs;
  for (int step = 0; step < 3; ++step) {
    so.apply_optimizer = step < 2;
    const engine::StepResult r = e.train_step(mbs, so, test::nll_loss);
    out.loss.push_back(r.loss);
    out.norm.push_back(r.grad_norm);
  }
  out.grads = e.gradients();
  out.weights = e.save_parameters();
  out.stats = e.stats();
}

template <class Model>
void check_follows(const Model& s, bool router_fp64, int S) {
  const engine::CudaEngineOptions o = options(router_fp64);
  Outcome one;
  {
    engine::CudaEngine e(s.desc, o);
    e.load_parameters(s.weights);
    train(e, s, {0, 1, 2, 3}, 0, one);
  }
  const auto share = split(S);
  int64_t most = 0;
  for (const auto& m : share) most = std::max<int64_t>(most, int64_t(m.size()));
  std::vector<Outcome> ranks(static_cast<size_t>(S));
  on_ranks(S, s.desc, o, [&](int r, engine::CudaEngine& e) {
    e.load_parameters(s.weights);
    train(e, s, share[size_t(r)], most, ranks[size_t(r)]);
  });
  for (int step = 0; step < 3; ++step) {
    double loss = 0;
    for (const Outcome& r : ranks) loss += r.loss[size_t(step)];
    EXPECT_NEAR(loss, one.loss[size_t(step)], 1e-5 * std::fabs(one.loss[size_t(step)])) << "step " << step;
    for (const Outcome& r : ranks) {  // one global norm on every rank
      EXPECT_EQ(r.norm[size_t(step)], ranks[0].norm[size_t(step)]);
      EXPECT_NEAR(r.norm[size_t(step)], one.norm[size_t(step)], 1e-5 * one.norm[size_t(step)]) << "step " << step;
    }
  }
  for (const Outcome& r : ranks) {
    EXPECT_TRUE(same_bits(r.weights, ranks[0].weights)) << "the ranks' gathered weights differ";
    EXPECT_TRUE(same_bits(r.grads, ranks[0].grads)) << "the ranks' gathered gradients differ";
  }
  const double gerr = relative_error(ranks[0].grads, one.grads);
  const double uerr = update_error(ranks[0].weights, one.weights, s.weights);
  EXPECT_LE(gerr, 1e-5);
  EXPECT_LE(uerr, 1e-4);
  // Memory per rank: 1/S of the bf16 weights and of the state (16 bytes a parameter against one
  // engine's 12: the summed gradients' blocks are state too), padding per unit aside; no whole
  // gradient buffer, the staging of two layers and the root instead.
  const engine::CudaEngineStats& a = ranks[0].stats;
  EXPECT_NEAR(double(a.weight_bytes), double(one.stats.weight_bytes) / S, 0.02 * one.stats.weight_bytes);
  EXPECT_NEAR(double(a.state_bytes), double(one.stats.state_bytes) * 16 / 12 / S, 0.02 * one.stats.state_bytes);
  EXPECT_EQ(a.grad_bytes, 0);
  EXPECT_GT(one.stats.grad_bytes, 0);
  EXPECT_GT(a.weight_stage_bytes, 0);  // the root and two layers (the test models have two)
  EXPECT_GT(a.dp_bytes, 0);
  std::printf("fsdp S=%d%s: gradients within %.2e, 3 updates within %.2e of one engine; per rank bf16 %lld of %lld "
              "bytes, state %lld of %lld, staging %lld + %lld, no whole gradients (one engine: %lld); dp "
              "traffic %lld bytes\n",
              S, router_fp64 ? " (fp64 router)" : "", gerr, uerr, (long long)a.weight_bytes,
              (long long)one.stats.weight_bytes, (long long)a.state_bytes, (long long)one.stats.state_bytes,
              (long long)a.weight_stage_bytes, (long long)a.grad_stage_bytes, (long long)one.stats.grad_bytes,
              (long long)a.dp_bytes);
}

TEST(CudaEngineFsdp, DenseFollowsOneEngine) {
  NEED_GPU();
  const test::Small s;
  const Deep deep;  // four layers, tied embeddings
  for (int S : {2, 3}) {
    SCOPED_TRACE("S = " + std::to_string(S));
    check_follows(s, false, S);
    check_follows(deep, false, S);
  }
}

TEST(CudaEngineFsdp, MoeFollowsOneEngine) {
  NEED_GPU();
  const test::SmallMoe s;
  for (const bool fp64 : {false, true}) {
    SCOPED_TRACE(fp64 ? "fp64 router" : "fp32 router");
    check_follows(s, fp64, 2);
  }
  check_follows(s, false, 3);
}

// The collectives on their own stream (the default) against the same collectives on the compute
// stream: the same bits, step by step, for ranks with different micro-batch counts (a missed
// wait between the two streams shows up as other bits here, or as a flaky difference).
template <class Model>
void check_streams_agree(const Model& s) {
  const auto share = split(3);
  std::vector<Outcome> on_own(3), on_compute(3);
  for (const bool own : {true, false}) {
    engine::CudaEngineOptions o = options(false);
    o.fsdp_comm_stream = own;
    std::vector<Outcome>& out = own ? on_own : on_compute;
    on_ranks(3, s.desc, o, [&](int r, engine::CudaEngine& e) {
      e.load_parameters(s.weights);
      train(e, s, share[size_t(r)], 2, out[size_t(r)]);
    });
  }
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(on_own[size_t(r)].loss, on_compute[size_t(r)].loss) << "rank " << r;
    EXPECT_EQ(on_own[size_t(r)].norm, on_compute[size_t(r)].norm) << "rank " << r;
    EXPECT_TRUE(same_bits(on_own[size_t(r)].weights, on_compute[size_t(r)].weights)) << "rank " << r;
    EXPECT_TRUE(same_bits(on_own[size_t(r)].grads, on_compute[size_t(r)].grads)) << "rank " << r;
    // The same collectives either way: the same bytes.
    EXPECT_EQ(on_own[size_t(r)].stats.dp_bytes, on_compute[size_t(r)].stats.dp_bytes) << "rank " << r;
  }
}

TEST(CudaEngineFsdp, CommStreamIsBitwiseTheComputeStream) {
  NEED_GPU();
  check_streams_agree(test::SmallMoe());
  check_streams_agree(Deep());
}

// Before any update the ranks' gathered bf16 weights are the one engine's casts: the forward's
// logprobs agree bit for bit, a rank with fewer micro-batches running idle_forward meanwhile.
TEST(CudaEngineFsdp, ForwardIsTheOneEngines) {
  NEED_GPU();
  const test::Small s;
  engine::OutputRequest req;
  req.logprob = true;
  const Sequences seqs(s);
  std::vector<std::vector<float>> one(4);
  {
    engine::CudaEngine e(s.desc, options(false));
    e.load_parameters(s.weights);
    for (size_t j = 0; j < 4; ++j) one[j] = e.forward(seqs.mb[j], req).logprob;
  }
  const auto share = split(3);
  std::vector<std::vector<std::vector<float>>> got(3);
  on_ranks(3, s.desc, options(false), [&](int r, engine::CudaEngine& e) {
    e.load_parameters(s.weights);
    for (size_t j : share[size_t(r)]) got[size_t(r)].push_back(e.forward(seqs.mb[j], req).logprob);
    for (size_t k = share[size_t(r)].size(); k < 2; ++k) e.idle_forward(req);
  });
  for (int r = 0; r < 3; ++r)
    for (size_t k = 0; k < share[size_t(r)].size(); ++k)
      EXPECT_EQ(got[size_t(r)][k], one[share[size_t(r)][k]]) << "rank " << r << ", sequence " << share[size_t(r)][k];
}

// The masters' device views, unit by unit (a colocated refit's source), hold what
// save_parameters gathers; a state saved at 2 ranks resumes bit for bit at 2 and, loaded into 3
// ranks and into one engine, continues as they do from the same state.
TEST(CudaEngineFsdp, StateMovesUnitByUnit) {
  NEED_GPU();
  const test::SmallMoe s;
  const engine::CudaEngineOptions o = options(true);
  const auto share2 = split(2);
  engine::StepOptions so;
  so.lr = 3e-3;
  so.global_tokens = s.predicted();
  so.group_microbatches = 2;
  const Sequences seqs(s);
  auto step_on = [&](engine::CudaEngine& e, const std::vector<size_t>& mine) {
    return e.train_step(seqs.of(mine), so, test::nll_loss).loss;
  };
  Tensors saved, cont;
  engine::CudaEngine::AdamState adam;
  std::vector<double> cont_loss(2);
  on_ranks(2, s.desc, o, [&](int r, engine::CudaEngine& e) {
    e.load_parameters(s.weights);
    step_on(e, share2[size_t(r)]);
    Tensors viewed(s.weights.size());
    e.visit_master_views([&](size_t i, const engine::CudaEngine::ParamView& v) {
      viewed[i].resize(size_t(v.pieces * v.piece));
      EXPECT_EQ(cudaMemcpy2D(viewed[i].data(), size_t(v.piece) * 4, v.data, size_t(v.stride) * 4,
                             size_t(v.piece) * 4, size_t(v.pieces), cudaMemcpyDeviceToHost),
                cudaSuccess);
    });
    const Tensors w = e.save_parameters();
    const auto st = e.adam_state();
    // (Expectations, not throws, inside a rank: a throw would leave its peer in a collective.)
    EXPECT_TRUE(same_bits(viewed, w)) << "rank " << r << ": the views differ from the masters";
    double loss = 0;
    loss += step_on(e, share2[size_t(r)]);
    if (r == 0) {
      saved = w;
      adam = st;
      cont_loss[0] = loss;
    } else {
      cont_loss[1] = loss;
    }
    const Tensors after = e.save_parameters();
    if (r == 0) cont = after;
  });
  ASSERT_FALSE(saved.empty());
  // Resumed at 2 ranks: the same step, bit for bit.
  Tensors resumed;
  std::vector<double> resumed_loss(2);
  on_ranks(2, s.desc, o, [&](int r, engine::CudaEngine& e) {
    e.load_parameters(saved);
    e.load_adam_state(adam);
    resumed_loss[size_t(r)] = step_on(e, share2[size_t(r)]);
    const Tensors w = e.save_parameters();
    if (r == 0) resumed = w;
  });
  EXPECT_EQ(resumed_loss, cont_loss);
  EXPECT_TRUE(same_bits(resumed, cont)) << "resumed at the same size, not bitwise";
  // Loaded at 3 ranks and into one engine: the same state, the same next step (to fp32 order).
  Tensors at3;
  so.group_microbatches = 2;
  const auto share3 = split(3);
  on_ranks(3, s.desc, o, [&](int r, engine::CudaEngine& e) {
    e.load_parameters(saved);
    e.load_adam_state(adam);
    EXPECT_EQ(e.adam_state().step, adam.step);
    step_on(e, share3[size_t(r)]);
    const Tensors w = e.save_parameters();
    if (r == 0) at3 = w;
  });
  engine::CudaEngine single(s.desc, o);
  single.load_parameters(saved);
  single.load_adam_state(adam);
  so.group_microbatches = 0;
  step_on(single, {0, 1, 2, 3});
  const Tensors at1 = single.save_parameters();
  EXPECT_LE(update_error(at3, at1, saved), 1e-4);
  EXPECT_LE(update_error(cont, at1, saved), 1e-4);
}

// Refused: FP8 linears with FSDP (their weight cache is keyed by where a weight lives).
TEST(CudaEngineFsdp, Fp8IsRefused) {
  NEED_GPU();
  const test::Small s;
  engine::CudaEngineOptions o = options(false);
  o.fp8.enabled = true;
  try {
    on_ranks(2, s.desc, o, [](int, engine::CudaEngine&) {});
    FAIL() << "FP8 with FSDP was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("FSDP"), std::string::npos) << e.what();
  }
}

}  // namespace
