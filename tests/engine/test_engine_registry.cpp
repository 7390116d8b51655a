// The engine on kernels found through the C ABI: the kernels_cpu plugin loaded by the host,
// resolved through the SDK's KernelRegistry (make_registry_ops), must give the same outputs and
// gradients as kernels_cpu called directly. This is the seam a CUDA provider plugs into.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "kernels_cpu_abi.hpp"
#include "rlhost/engine/engine.hpp"
#include "rlhost/host.h"
#include "rlhost/model/llama_family.hpp"
#include "rlhost/sdk/kernels.hpp"

using namespace rlh;

namespace {

sdk::TransformerDesc small_desc() {
  nlohmann::json c = {{"architectures", {"Qwen3ForCausalLM"}}, {"vocab_size", 101},
                      {"hidden_size", 32}, {"intermediate_size", 72}, {"num_hidden_layers", 2},
                      {"num_attention_heads", 4}, {"num_key_value_heads", 2}, {"head_dim", 16},
                      {"max_position_embeddings", 128}, {"rms_norm_eps", 1e-6},
                      {"rope_theta", 1000000.0}, {"tie_word_embeddings", false},
                      {"torch_dtype", "float32"}};
  return model::describe(c);
}

void fill(engine::Engine& e) {
  uint32_t x = 7;
  for (size_t i = 0; i < e.num_params(); ++i)
    for (float& v : e.param(i)) {
      x = x * 1664525u + 1013904223u;
      v = (e.desc().params[i].shape.size() == 1 ? 1.0f : 0.0f) +
          0.2f * (float(x >> 8) / 16777216.0f - 0.5f);
    }
}

TEST(EngineRegistry, PluginThroughTheAbiEqualsDirectCalls) {
  test::KernelsCpuThroughAbi abi_host;
  {
    sdk::KernelRegistry& reg = abi_host.registry();
    std::unique_ptr<engine::Ops> ops = engine::make_registry_ops(reg);
    EXPECT_EQ(ops->name(), "registry(kernels_cpu)");

    engine::EngineOptions via;
    via.ops = ops.get();
    engine::Engine abi(small_desc(), via), direct(small_desc());
    fill(abi);
    fill(direct);
    std::vector<int32_t> ids = {5, 17, 99, 3, 42, 42, 7, 0, 64, 11, 23};
    std::vector<int32_t> cu = {0, 4, 11};
    engine::MicroBatch mb;
    mb.input_ids = ids;
    mb.cu_seqlens = cu;
    engine::StepOptions so;
    so.global_tokens = 9;
    so.apply_optimizer = false;
    so.outputs.entropy = true;
    so.outputs.processed_logprob = true;
    so.outputs.top_k = 10;
    auto loss = [](const engine::LossContext& c, const engine::OutputViews& o,
                   engine::OutputGrads& g) {
      engine::LossResult r;
      for (size_t t = 0; t < o.logprob.size(); ++t) {
        r.loss -= (o.logprob[t] + 0.1 * o.entropy[t]) / double(c.global_tokens);
        g.logprob[t] = float(-1.0 / double(c.global_tokens));
        g.entropy[t] = float(-0.1 / double(c.global_tokens));
        if (std::isfinite(o.processed_logprob[t])) g.processed_logprob[t] = 0.5f;
      }
      return r;
    };
    const engine::Outputs oa = abi.forward(mb, so.outputs), od = direct.forward(mb, so.outputs);
    EXPECT_EQ(oa.logprob, od.logprob);
    EXPECT_EQ(oa.entropy, od.entropy);
    EXPECT_EQ(oa.processed_logprob, od.processed_logprob);
    const engine::StepResult ra = abi.train_step({&mb, 1}, so, loss);
    const engine::StepResult rd = direct.train_step({&mb, 1}, so, loss);
    EXPECT_EQ(ra.loss, rd.loss);
    EXPECT_NEAR(ra.grad_norm, rd.grad_norm, 1e-6 * rd.grad_norm);  // sumsq crosses as float32
    for (size_t i = 0; i < abi.num_params(); ++i) {
      std::vector<float> a(abi.grad(i).begin(), abi.grad(i).end());
      std::vector<float> b(direct.grad(i).begin(), direct.grad(i).end());
      EXPECT_EQ(a, b) << abi.desc().params[i].name;
    }
    // An optimizer step through the ABI moves the weights as the direct one does.
    so.apply_optimizer = true;
    so.lr = 1e-2;
    abi.train_step({&mb, 1}, so, loss);
    direct.train_step({&mb, 1}, so, loss);
    const auto pa = abi.save_parameters(), pd = direct.save_parameters();
    for (size_t i = 0; i < pa.size(); ++i)
      for (size_t j = 0; j < pa[i].size(); ++j) ASSERT_NEAR(pa[i][j], pd[i][j], 1e-6);
  }
}

}  // namespace
