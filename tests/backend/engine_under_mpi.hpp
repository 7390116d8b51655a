// What the mpirun backend tests that drive an engine directly share (expert and tensor
// parallelism, test_backend_ep.cpp and test_backend_tp.cpp): a model's description and full
// weights, a harness batch as an engine micro-batch, the host's reference kernels, and a routing
// record as a micro-batch field (replay).
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "backend_harness.hpp"
#include "mpi_harness.hpp"
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

// The routing record as a micro-batch field.
struct RoutingField {
  std::vector<int32_t> data;
  std::vector<int64_t> shape, strides;
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

}  // namespace rlh::test
