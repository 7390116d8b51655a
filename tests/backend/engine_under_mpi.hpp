// What the mpirun backend tests that drive an engine directly share (tensor, context, expert and
// pipeline parallelism: test_backend_{tp,cp,ep,ep_etp,vpp_routing}.cpp): a model's description
// and full weights, a harness batch as an engine micro-batch, the host's reference kernels and the
// one-rank reference engine on them, the world's groups of a layout, the losses the engine tests
// train with, and a routing as a micro-batch field (replay), another routing replayed on the
// reference and on a layout's engine.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "backend_harness.hpp"
#include "mpi_harness.hpp"
#include "nll_loss.hpp"
#include "rlhost/engine/engine.hpp"
#include "rlhost/model/llama_family.hpp"
#include "rlhost/sdk/comm.hpp"
#include "rlhost/sdk/kernel_registry.hpp"
#include "rlhost/sdk/kernels.hpp"
#include "rlhost/sdk/model_weights.hpp"
#include "rlhost/sdk/safetensors.hpp"

namespace rlh::test {

struct EngineModel {
  sdk::TransformerDesc desc;
  std::vector<std::vector<float>> weights;
};
inline const EngineModel& engine_model(const std::string& name) {
  static std::map<std::string, EngineModel> cache;
  auto it = cache.find(name);
  if (it == cache.end()) {
    EngineModel m;
    m.desc = model::describe_model_dir(model_path(name));
    m.weights = sdk::load_weights_f32(m.desc, sdk::st::Checkpoint::open(model_path(name) + "/model.safetensors")).tensors;
    it = cache.emplace(name, std::move(m)).first;
  }
  return it->second;
}

// A harness batch as one engine micro-batch (its offsets as int32 in `cu`).
inline engine::MicroBatch engine_view(const Batch& b, std::vector<int32_t>& cu) {
  cu.clear();
  for (int64_t o : b.offsets()) cu.push_back(int32_t(o));
  engine::MicroBatch mb;
  mb.input_ids = b.ids();
  mb.cu_seqlens = cu;
  return mb;
}

// The reference kernels through the host's registry, as a backend takes them. Released with the
// host, before MPI finishes (the test's main resets the host first).
inline std::unique_ptr<sdk::KernelRegistry> g_registry;
inline std::unique_ptr<engine::Ops> g_ops;
inline engine::Ops& host_ops() {
  if (!g_ops) {
    g_registry = sdk::make_kernel_registry(sdk::Host(host().services()), sdk::kCPU, sdk::KernelPins{}, "test", "{}", false);
    g_ops = engine::make_registry_ops(*g_registry);
  }
  return *g_ops;
}

// For main, before run_mpi_tests: the kernels above go before the host that holds their provider.
inline void release_kernels_before_the_host() {
  struct Release : ::testing::Environment {
    void TearDown() override {
      g_ops.reset();
      g_registry.reset();
    }
  };
  ::testing::AddGlobalTestEnvironment(new Release);
}

// One engine with the whole model and every expert (the reference) on the host's kernels, with
// `o`'s other options (e.g. the MoE settings).
inline std::unique_ptr<engine::Engine> reference_engine(const EngineModel& m, engine::EngineOptions o = {}) {
  o.ops = &host_ops();
  auto e = std::make_unique<engine::Engine>(m.desc, o);
  e->load_parameters(m.weights);
  return e;
}

// A batch as one engine micro-batch and the reference engine's forward of it with its routing
// record (an MoE model): what a layout's engine is held against.
struct EngineReference {
  std::vector<int32_t> cu;
  engine::MicroBatch mb;
  std::unique_ptr<engine::Engine> engine;
  engine::OutputRequest req;
  engine::Outputs full;
  EngineReference(const EngineModel& m, const Batch& b, engine::EngineOptions o = {})
      : mb(engine_view(b, cu)), engine(reference_engine(m, o)) {
    req.routed_experts = true;
    full = engine->forward(mb, req);
  }
  EngineReference(const EngineReference&) = delete;  // mb points into cu
};

// The world's groups of `kinds` under the layout `sizes`.
inline sdk::ParallelComms world_groups(const sdk::ParallelSizes& sizes, const std::vector<sdk::GroupKind>& kinds) {
  return sdk::make_parallel_comms(sdk::Comm::world(sdk::Host(host().services())), sizes, kinds);
}

// The engine tests' losses: nll_loss.hpp's over the micro-batch's sequences (their first tokens
// not predicted), as an engine::LossFn (the name is also backend_harness.hpp's LossBody); and
// -log p over every row the engine hands the loss (under context parallelism a rank's rows are
// not the caller's sequences: none to skip), each by the step's global token count.
inline engine::LossFn sequence_nll() {
  return [](const engine::LossContext& c, const engine::OutputViews& o, engine::OutputGrads& g) {
    return nll_loss(c, o, g);
  };
}
inline engine::LossResult every_row_nll(const engine::LossContext& ctx, const engine::OutputViews& ov,
                                        engine::OutputGrads& og) {
  engine::LossResult lr;
  for (size_t t = 0; t < ov.logprob.size(); ++t) {
    lr.loss -= ov.logprob[t] / double(ctx.global_tokens);
    og.logprob[t] = float(-1.0 / double(ctx.global_tokens));
  }
  return lr;
}

// The request that replays the routing field "routed" (RoutingField's).
inline engine::OutputRequest replay_request(engine::OutputRequest r = {}) {
  r.replay_routing_field = "routed";
  return r;
}

// A routing record as a micro-batch field ("routed"; `data` must outlive the micro-batch).
struct RoutingField {
  std::vector<int32_t> data;
  std::vector<int64_t> shape, strides;
  // Another routing: each choice of `routed` moved `shift` experts on, of E.
  static RoutingField moved(const std::vector<int32_t>& routed, int32_t shift, int32_t E) {
    RoutingField f{routed, {}, {}};
    for (int32_t& x : f.data) x = (x + shift) % E;
    return f;
  }
  // `mb` with this routing of its n tokens (`r` choices each) as its field.
  engine::MicroBatch replaying(const engine::MicroBatch& mb, int64_t n, int64_t r) {
    engine::MicroBatch out = mb;
    out.fields.push_back(field(n, r));
    return out;
  }
  rlh_named_tensor field(int64_t n, int64_t r) {
    shape = {n, r};
    strides = {r, 1};
    rlh_named_tensor f{};
    f.name = "routed";
    f.tensor.data = data.data();
    f.tensor.device = rlh_device{RLH_DEVICE_CPU, 0};
    f.tensor.ndim = 2;
    f.tensor.dtype = rlh_dtype{RLH_DTYPE_INT, 32, 1};
    f.tensor.shape = shape.data();
    f.tensor.strides = strides.data();
    return f;
  }
};

// Another routing of micro-batch `base`'s n tokens (`routed`, `width` choices a token, each moved
// `shift` experts on, of E) replayed with `req` on the reference engine and on a layout's engine
// `e`: the field, the micro-batch that carries it, the request, both outputs under it.
struct OtherRouting {
  RoutingField field;
  engine::MicroBatch mb;
  engine::OutputRequest req;
  engine::Outputs ref, got;
  OtherRouting(engine::Engine& ref_engine, engine::Engine& e, const engine::MicroBatch& base,
               const std::vector<int32_t>& routed, int64_t n, int64_t width, int32_t shift, int32_t E,
               const engine::OutputRequest& request = {})
      : field(RoutingField::moved(routed, shift, E)), mb(field.replaying(base, n, width)), req(replay_request(request)) {
    ref = ref_engine.forward(mb, req);
    got = e.forward(mb, req);
  }
  OtherRouting(const OtherRouting&) = delete;  // mb points into field
};

}  // namespace rlh::test
