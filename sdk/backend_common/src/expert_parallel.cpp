// Expert parallelism's communication for the engine (CommEpGroup, data_parallel.hpp) and the
// model's conversions between full expert tensors and this rank's block (backend_internal.hpp).
//
// sdk::Comm's all_to_all moves equal blocks; the dispatch moves exactly the routed rows, which
// differ per pair of ranks, so all_to_all_v is pairwise sends and receives. The pairs follow a
// round-robin tournament (the circle method: size - 1 rounds for an even size, size rounds with
// one rank idle per round for an odd one), every pair disjoint within a round; inside a pair the
// lower rank sends first. Both sides know the counts (the counts' all-to-all came first), so an
// empty message is skipped by both.
#include <chrono>
#include <cstring>

#include "backend_internal.hpp"

namespace rlh::backend {

using sdk::Error;

namespace {

// The circle method: rank x's partner in round r of a tournament of n (even) players; -1 when
// the partner is the bye (n - 1 stands for it when the group size is odd).
int partner(int x, int r, int n) {
  const int m = n - 1;
  if (x == m) return r;
  if (x == r) return m;
  return ((2 * r - x) % m + m) % m;
}

double since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

void CommEpGroup::all_to_all(const int64_t* send, int64_t* recv, int64_t n) {
  const int P = c_.size();
  const int64_t total = n * P;
  const auto t0 = std::chrono::steady_clock::now();
  c_.all_to_all(sdk::host_tensor(const_cast<int64_t*>(send), sdk::dtype_of<int64_t>(), std::span<const int64_t>(&total, 1)),
                sdk::host_tensor(recv, sdk::dtype_of<int64_t>(), std::span<const int64_t>(&total, 1)));
  seconds_ += since(t0);
  bytes_ += (P - 1) * n * int64_t(sizeof(int64_t));
}

void CommEpGroup::all_to_all_v(const float* send, std::span<const int64_t> send_counts, float* recv,
                               std::span<const int64_t> recv_counts) {
  const int P = c_.size(), me = c_.rank();
  if (int(send_counts.size()) != P || int(recv_counts.size()) != P)
    throw Error(RLH_E_INTERNAL, "expert parallelism: all_to_all_v needs one count per rank");
  std::vector<int64_t> sat(size_t(P) + 1, 0), rat(size_t(P) + 1, 0);
  for (int j = 0; j < P; ++j) {
    sat[size_t(j) + 1] = sat[size_t(j)] + send_counts[size_t(j)];
    rat[size_t(j) + 1] = rat[size_t(j)] + recv_counts[size_t(j)];
  }
  if (send_counts[size_t(me)] != recv_counts[size_t(me)])
    throw Error(RLH_E_INTERNAL, "expert parallelism: this rank's own block differs in and out");
  if (send_counts[size_t(me)] > 0)
    std::memcpy(recv + rat[size_t(me)], send + sat[size_t(me)], size_t(send_counts[size_t(me)]) * sizeof(float));
  const auto t0 = std::chrono::steady_clock::now();
  const int n = P % 2 == 0 ? P : P + 1;
  for (int r = 0; r < n - 1; ++r) {
    const int q = partner(me, r, n);
    if (q < 0 || q >= P || q == me) continue;  // the bye
    int64_t out_n = send_counts[size_t(q)], in_n = recv_counts[size_t(q)];
    const auto put = [&] {
      if (out_n > 0)
        c_.send(sdk::host_tensor(const_cast<float*>(send) + sat[size_t(q)], sdk::dtype_of<float>(),
                                 std::span<const int64_t>(&out_n, 1)),
                q);
    };
    const auto get = [&] {
      if (in_n > 0)
        c_.recv(sdk::host_tensor(recv + rat[size_t(q)], sdk::dtype_of<float>(), std::span<const int64_t>(&in_n, 1)), q);
    };
    if (me < q) {
      put();
      get();
    } else {
      get();
      put();
    }
    bytes_ += out_n * int64_t(sizeof(float));
  }
  seconds_ += since(t0);
}

void prepare_expert_parallel(const Backend& b, Model& m, engine::EngineOptions& eo) {
  const int64_t ep = m.config.parallel.ep;
  if (ep <= 1) return;
  const std::string key = "policy.megatron_cfg.expert_model_parallel_size";
  if (!b.dp || b.dp->ep_size() != ep)
    throw Error(RLH_E_INVALID_ARGUMENT,
                std::string(b.flavor->name) + ": " + key + " = " + std::to_string(ep) + " needs a multiple of " +
                    std::to_string(ep) + " launched ranks split that way, but " +
                    (b.dp ? "this backend's groups have expert-parallel size " + std::to_string(b.dp->ep_size())
                          : std::string("one rank was started")));
  if (m.dp_mode == Model::Dp::fsdp)
    throw Error(RLH_E_UNIMPLEMENTED, key + " with FSDP is not implemented (megatron's DDP or distributed optimizer run it)");
  // Every rank's layout (checkpoints gather the blocks of all of them); refused settings name
  // themselves here, before any weight is placed.
  // Under tensor parallelism the experts are cut from this rank's tensor-parallel description,
  // in which they are whole (etp 1) or this rank's blocks of each (etp > 1); its other tensors
  // are this rank's tp pieces.
  const sdk::TransformerDesc& desc = m.tp() ? m.tp()->local : m.desc;
  try {
    for (int64_t r = 0; r < ep; ++r) m.ep_layouts.push_back(sdk::make_ep_layout(desc, ep, r, key));
  } catch (const std::invalid_argument& e) {
    throw Error(RLH_E_UNIMPLEMENTED, m.desc.architecture + " (" + m.dir + "): " + e.what());
  }
  m.ep_comm = std::make_unique<CommEpGroup>(b.dp->ep);
  eo.ep = m.ep();
  eo.ep_comm = m.ep_comm.get();
  // Experts cut over an etp group smaller than the tp group: the engine gathers the rows its
  // experts receive over that group (ep_dispatch.cpp).
  if (m.tp() && m.tp()->expert_size > 1 && m.tp()->expert_size < m.tp()->size) {
    // (The layout's block is the rank's place in Megatron's expert order: tp rank mod etp.)
    if (b.dp->etp.size() != m.tp()->expert_size || b.dp->etp.rank() != m.tp()->expert_rank)
      throw Error(RLH_E_INTERNAL, "expert tensor parallelism: rank " + std::to_string(b.dp->etp.rank()) + " of " +
                                      std::to_string(b.dp->etp.size()) + " in its group for block " +
                                      std::to_string(m.tp()->expert_rank) + " of " +
                                      std::to_string(m.tp()->expert_size));
    m.etp_comm = std::make_unique<CommEpGroup>(b.dp->etp);
    eo.etp_comm = m.etp_comm.get();
  }
  // The distributed optimizer shards the experts over the expert data-parallel group.
  if (m.dp_mode == Model::Dp::distributed_optimizer) eo.pad_experts_to = b.dp->edp.size();
}

std::vector<float> ep_local(const Model& m, size_t i, const std::vector<float>& full) {
  return sdk::ep_slice(*m.ep(), i, full);
}

std::vector<float> ep_full(const Model& m, size_t i, std::span<const float> local) {
  if (!m.ep()->is_expert(i)) return std::vector<float>(local.begin(), local.end());
  // Rank r of the ep group holds block r: the gathered blocks are the full tensor in order.
  const int P = m.dp->ep_size();
  const int64_t n = int64_t(local.size());
  std::vector<float> full(size_t(n * P));
  FloatView in(const_cast<float*>(local.data()), n), out(full.data(), n * P);
  m.dp->ep.all_gather(*in, *out);
  if (int64_t(full.size()) != numel(m.ep()->full.params[i].shape))
    throw Error(RLH_E_INTERNAL, "expert parallelism: " + m.desc.params[i].name + " gathered to the wrong size");
  return full;
}

}  // namespace rlh::backend
