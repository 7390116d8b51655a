// Peak memory of a training forward+backward at realistic width (Llama-3.2-1B layer shapes:
// d 2048, 32/8 heads of 64, FFN 8192, vocabulary 128256, tied; one layer; one sequence of
// T = 2048 tokens), counted through the engine's one allocator, against an analytic bound.
//
// The bound is parameters + gradients + the activations the engine is designed to keep (per-token
// buffers listed below, O(T * width)) + fixed workspace (one head tile of 8 MiB, attention tiles
// per thread, O(T * heads) softmax statistics). The workspace allowance (~10 MiB) is smaller than
// one head's [T, T] score matrix (16 MiB) and far smaller than a [T, V] logits copy (1 GiB), so
// passing proves the head never holds a second [T, V] copy and attention never holds a T^2
// buffer. T is 2048 rather than 4096 to keep the run near 20 s on 2 cores (the head alone is
// 4 x 2 T C V FLOPs: 8.6 TFLOP at T = 4096); the head tile is set to 8 MiB (engine option) so
// the allowance stays below T^2 at this T. The bound's meaning is the same at any T.
//
// A second case checks activation recompute: 4 layers at a narrower width, where keeping only
// the layer inputs must cost less than keeping every layer's activations, by the analytic
// amount.
#include <gtest/gtest.h>

#include <omp.h>

#include <cstdio>
#include <nlohmann/json.hpp>

#include "kernels_cpu_abi.hpp"
#include "rlhost/engine/engine.hpp"
#include "rlhost/sdk/layer_program.hpp"
#include "rlhost/model/llama_family.hpp"

using namespace rlh;

namespace {

struct Shape {
  int64_t V, C, F, L, Hq, Hkv, D, T;
};

sdk::TransformerDesc llama_desc(const Shape& s) {
  nlohmann::json c = {{"architectures", {"LlamaForCausalLM"}},
                      {"vocab_size", s.V},
                      {"hidden_size", s.C},
                      {"intermediate_size", s.F},
                      {"num_hidden_layers", s.L},
                      {"num_attention_heads", s.Hq},
                      {"num_key_value_heads", s.Hkv},
                      {"head_dim", s.D},
                      {"max_position_embeddings", 131072},
                      {"rms_norm_eps", 1e-5},
                      {"rope_theta", 500000.0},
                      {"rope_scaling", {{"rope_type", "llama3"}, {"factor", 32.0},
                                        {"low_freq_factor", 1.0}, {"high_freq_factor", 4.0},
                                        {"original_max_position_embeddings", 8192}}},
                      {"tie_word_embeddings", true},
                      {"torch_dtype", "float32"}};
  return model::describe(c);
}

// Cheap deterministic weights (xorshift), small enough to keep activations tame.
void fill_weights(engine::Engine& e) {
  for (size_t i = 0; i < e.num_params(); ++i) {
    std::span<float> p = e.param(i);
    const bool vec = e.desc().params[i].shape.size() == 1;
    uint32_t x = 2463534242u + uint32_t(i) * 7919u;
    for (float& v : p) {
      x ^= x << 13;
      x ^= x >> 17;
      x ^= x << 5;
      const float u = float(x) * (1.0f / 4294967296.0f) - 0.5f;
      v = vec ? 1.0f + 0.1f * u : 0.04f * u;
    }
  }
}

struct Measured {
  size_t peak = 0;
  double loss = 0;
};

constexpr int64_t kHeadTileBytes = int64_t(8) << 20;

Measured run_step(const Shape& s, bool recompute) {
  // The engine's allocator also serves the kernels' workspace (sized by the provider), so its
  // peak is everything the step takes.
  engine::CountingAllocator alloc;
  static test::KernelsCpuThroughAbi kernels;
  std::unique_ptr<engine::Ops> ops = engine::make_registry_ops(kernels.registry(), &alloc);
  engine::EngineOptions eo;
  eo.ops = ops.get();
  eo.allocator = &alloc;
  eo.recompute = recompute;
  eo.logprob_chunk_bytes = kHeadTileBytes;
  engine::Engine e(llama_desc(s), eo);
  fill_weights(e);
  std::vector<int32_t> ids(size_t(s.T));
  for (int64_t t = 0; t < s.T; ++t) ids[size_t(t)] = int32_t((t * 2654435761u) % uint32_t(s.V));
  std::vector<int32_t> cu = {0, int32_t(s.T)};
  engine::MicroBatch mb;
  mb.input_ids = ids;
  mb.cu_seqlens = cu;
  engine::StepOptions so;
  so.global_tokens = s.T - 1;
  so.apply_optimizer = false;
  auto loss = [](const engine::LossContext& c, const engine::OutputViews& o,
                 engine::OutputGrads& g) {
    engine::LossResult r;
    for (size_t t = 1; t < o.logprob.size(); ++t) {
      r.loss -= o.logprob[t] / double(c.global_tokens);
      g.logprob[t] = float(-1.0 / double(c.global_tokens));
    }
    return r;
  };
  const engine::StepResult r = e.train_step({&mb, 1}, so, loss);
  return {alloc.peak_bytes(), r.loss};
}

int64_t param_count(const Shape& s) {
  const int64_t per_layer = 2 * s.C + (s.Hq + 2 * s.Hkv) * s.D * s.C + s.C * s.Hq * s.D +
                            3 * s.F * s.C;
  return s.V * s.C + s.C + s.L * per_layer;  // tied embedding, final norm, layers
}

// Floats of activations kept per token, from the decoder's structure (model.hpp documents each).
int64_t activation_floats(const Shape& s, bool recompute) {
  const int64_t N = s.T, W = (s.Hq + 2 * s.Hkv) * s.D, A = s.Hq * s.D;
  const int64_t layer = N * s.C + N      // attn_norm output + rstd
                        + N * W          // q|k|v
                        + N * A + s.Hq * N  // attention output + log-sum-exp
                        + 2 * N * s.C + N   // residual after attention, mlp_norm output, rstd
                        + 3 * N * s.F;      // gate|up, activation
  const int64_t inputs = (s.L + 1) * N * s.C;  // residual stream at every layer boundary
  const int64_t head = 2 * N * s.C + N + 8 * N;  // final norm, its gradient, per-token outputs and grads
  // Backward scratch: the layer program's gradient buffers (reused as their values die).
  int64_t grad_widths = 0;
  for (int64_t w : sdk::build_program(llama_desc(s)).grad_widths) grad_widths += w;
  const int64_t grads = N * grad_widths;
  return inputs + (recompute ? layer : s.L * layer) + head + grads + 6 * N /* callback views */ +
         2 * N /* int32 positions, targets */;
}

// Workspace the kernels may take: one head tile, attention tiles per thread, softmax statistics.
int64_t workspace_bytes(const Shape& s) {
  const int64_t tile = kHeadTileBytes;
  // per thread two 128 x 256 score tiles (attention.cpp), plus Delta [Hq, T] in the backward
  const int64_t attention = int64_t(omp_get_max_threads()) * 2 * 128 * 256 * 4 + s.Hq * s.T * 4;
  return tile + attention + s.T * 5 * 4 + (1 << 20);  // + head stats, + 1 MiB small items
}

TEST(EngineMemory, NoLogitsCopyNoQuadraticAttentionBuffer) {
  const Shape s{128256, 2048, 8192, 1, 32, 8, 64, 2048};
  const Measured m = run_step(s, false);
  const int64_t P = param_count(s);
  const int64_t designed = 2 * P * 4 + activation_floats(s, false) * 4;
  const int64_t bound = designed + workspace_bytes(s);
  std::printf("params %.1f M; peak %.1f MiB; bound %.1f MiB (params+grads %.1f, activations %.1f, "
              "workspace %.1f); [T,V] copy would be %.1f MiB, one [T,T] head %.1f MiB; loss %.4f\n",
              P / 1e6, m.peak / 1048576.0, bound / 1048576.0, 2 * P * 4 / 1048576.0,
              activation_floats(s, false) * 4 / 1048576.0, workspace_bytes(s) / 1048576.0,
              s.T * s.V * 4 / 1048576.0, s.T * s.T * 4 / 1048576.0, m.loss);
  EXPECT_TRUE(std::isfinite(m.loss));
  EXPECT_LE(int64_t(m.peak), bound);
  EXPECT_GE(int64_t(m.peak), designed) << "the bound's designed part is all really allocated";
  // What the bound proves:
  EXPECT_LT(bound - designed, s.T * s.T * 4) << "workspace allowance must not fit a [T,T] matrix";
  EXPECT_LT(bound - designed, s.T * s.V * 4) << "workspace allowance must not fit [T,V] logits";
}

TEST(EngineMemory, RecomputeKeepsOnlyLayerInputs) {
  const Shape s{32000, 512, 1536, 4, 8, 2, 64, 1024};
  const Measured full = run_step(s, false);
  const Measured rec = run_step(s, true);
  const int64_t P = param_count(s);
  const int64_t bound_full = 2 * P * 4 + activation_floats(s, false) * 4 + workspace_bytes(s);
  const int64_t bound_rec = 2 * P * 4 + activation_floats(s, true) * 4 + workspace_bytes(s);
  std::printf("4 layers, T=%ld: peak %.1f MiB saving all, %.1f MiB with recompute (bounds %.1f, %.1f)\n",
              long(s.T), full.peak / 1048576.0, rec.peak / 1048576.0, bound_full / 1048576.0,
              bound_rec / 1048576.0);
  EXPECT_LE(int64_t(full.peak), bound_full);
  EXPECT_LE(int64_t(rec.peak), bound_rec);
  // Recompute saves at least (L-1) layers of activations minus the allowance.
  const int64_t saved = (activation_floats(s, false) - activation_floats(s, true)) * 4;
  EXPECT_GE(int64_t(full.peak) - int64_t(rec.peak), saved - workspace_bytes(s));
  EXPECT_EQ(full.loss, rec.loss);
}

}  // namespace
