// comm_nccl: the COMM component over NCCL for device tensors (host tensors are staged through
// the device). libnccl.so.2 is opened at run time and the CUDA runtime is linked statically, so
// the plugin loads and probes anywhere and refuses create_world with UNAVAILABLE naming why
// (no NCCL, no GPU, two ranks on one GPU). Bootstraps over the host's world communicator under
// mpirun, or over a TCP rendezvous at MASTER_ADDR/MASTER_PORT for env launches; sub-groups by
// ncclCommSplit; every wait bounded (docs/parallelism.md).
#include "nccl_comm.hpp"
#include "rlhost/comm.h"
#include "rlhost/sdk/plugin.hpp"

namespace {

using rlh::sdk::guard;
using namespace rlh::comm_nccl;

rlh::sdk::MakeStatusFn make_of(const rlh_comm* c) {
  return c != nullptr && c->host != nullptr ? c->host->make_status : nullptr;
}

rlh_status* c_create_world(const rlh_host_api* host, const char* config, size_t len, rlh_comm** out) {
  return guard(host != nullptr ? host->make_status : nullptr, [&] {
    if (out == nullptr) throw rlh::sdk::Error(RLH_E_INVALID_ARGUMENT, "comm_nccl: create_world: out is NULL");
    *out = nullptr;
    const std::string text = (config != nullptr && len > 0) ? std::string(config, len) : "{}";
    const nlohmann::json cfg = nlohmann::json::parse(text, nullptr, false);
    if (cfg.is_discarded()) throw rlh::sdk::Error(RLH_E_INVALID_ARGUMENT, "comm_nccl: create_world config is not valid JSON");
    *out = create_world(host, cfg);
  });
}

void c_destroy(rlh_comm* c) {
  try {
    destroy(c);
  } catch (...) {
  }
}
int32_t c_rank(const rlh_comm* c) { return c != nullptr ? c->rank : -1; }
int32_t c_size(const rlh_comm* c) { return c != nullptr ? c->size : -1; }
rlh_status* c_split(rlh_comm* c, int32_t color, int32_t key, rlh_comm** out) {
  return guard(make_of(c), [&] {
    if (out == nullptr) throw rlh::sdk::Error(RLH_E_INVALID_ARGUMENT, "comm_nccl: split: out is NULL");
    *out = nullptr;
    *out = split(c, color, key);
  });
}
rlh_status* c_all_reduce(rlh_comm* c, const rlh_tensor* t, int32_t op, void* s) {
  return guard(make_of(c), [&] { all_reduce(c, t, op, s); });
}
rlh_status* c_all_gather(rlh_comm* c, const rlh_tensor* in, const rlh_tensor* out, void* s) {
  return guard(make_of(c), [&] { all_gather(c, in, out, s); });
}
rlh_status* c_reduce_scatter(rlh_comm* c, const rlh_tensor* in, const rlh_tensor* out, int32_t op, void* s) {
  return guard(make_of(c), [&] { reduce_scatter(c, in, out, op, s); });
}
rlh_status* c_broadcast(rlh_comm* c, const rlh_tensor* t, int32_t root, void* s) {
  return guard(make_of(c), [&] { broadcast(c, t, root, s); });
}
rlh_status* c_send(rlh_comm* c, const rlh_tensor* t, int32_t peer, void* s) {
  return guard(make_of(c), [&] { send(c, t, peer, s); });
}
rlh_status* c_recv(rlh_comm* c, const rlh_tensor* t, int32_t peer, void* s) {
  return guard(make_of(c), [&] { recv(c, t, peer, s); });
}
rlh_status* c_all_to_all(rlh_comm* c, const rlh_tensor* in, const rlh_tensor* out, void* s) {
  return guard(make_of(c), [&] { all_to_all(c, in, out, s); });
}
rlh_status* c_barrier(rlh_comm* c) {
  return guard(make_of(c), [&] { barrier(c); });
}
void c_set_timeout_ms(rlh_comm* c, int64_t ms) { set_timeout(c, ms); }
// COMM 0.2's receive from any source: NCCL matches every receive to a named peer, and a probe
// over the host bootstrap would have to order itself against NCCL's own stream, so comm_nccl
// says so; a rank that serves several clients uses the host's world communicator (comm_mpi).
rlh_status* c_recv_any(rlh_comm* c, const rlh_tensor*, int32_t* peer, void*) {
  return guard(make_of(c), [&] {
    if (peer != nullptr) *peer = -1;
    throw rlh::sdk::Error(RLH_E_UNIMPLEMENTED,
                          "comm_nccl: recv_any: NCCL has no receive from any source (ncclRecv names its peer); receive from "
                          "a named peer with recv, or use comm_mpi for messages from whichever rank sends first");
  });
}

const rlh_comm_api kApi = {
    RLH_STRUCT_SIZE(rlh_comm_api, recv_any),
    c_create_world, c_destroy, c_rank, c_size, c_split, c_all_reduce, c_all_gather, c_reduce_scatter,
    c_broadcast, c_send, c_recv, c_all_to_all, c_barrier, c_set_timeout_ms, c_recv_any,
};

// Score 4 where NCCL and a GPU are (ahead of comm_mpi for device communicators; the host's world
// under mpirun still falls to comm_mpi, which comm_nccl refuses to be), 0 elsewhere with why.
rlh_status* probe(const rlh_host_api* host, int32_t* score, rlh_write_fn write, void* user) {
  return guard(host != nullptr ? host->make_status : nullptr, [&] {
    const std::string why = unavailable_reason();
    *score = why.empty() ? 4 : 0;
    if (!why.empty() && write != nullptr) write(user, why.data(), why.size());
  });
}

const rlh_component_desc kComm = rlh::sdk::component_desc(
    RLH_KIND_COMM, "comm_nccl", "0.1.0", RLH_COMM_API_VERSION_MAJOR, RLH_COMM_API_VERSION_MINOR, &kApi,
    "NCCL collectives on CUDA device tensors (one GPU per rank), sub-groups by ncclCommSplit, every wait bounded");

const rlh_component_desc* const kComponents[] = {&kComm};

constexpr rlh_plugin_desc make_desc() {
  rlh_plugin_desc d = rlh::sdk::plugin_desc("comm_nccl", "0.1.0", "rlhost", kComponents,
                                            "communicator over NCCL for CUDA devices");
  d.probe = probe;
  return d;
}

}  // namespace

RLH_DEFINE_PLUGIN(make_desc())
