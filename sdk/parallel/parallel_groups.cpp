// Rank groups from parallel sizes (parallel_groups.hpp): Megatron-Core's rank ordering, written
// from its description (parallel_state.RankGenerator), checked by tests/comm/test_parallel_groups
// against hand-computed layouts and an independent loop-by-loop construction.
#include "rlhost/sdk/parallel_groups.hpp"

#include <algorithm>
#include <cctype>

#include "rlhost/sdk/status.hpp"

namespace rlh::sdk {
namespace {

// Bounds what a layout may allocate (every kind lists every rank): a world of 2^20 ranks is
// far beyond any job, and 20 kinds x 2^20 ints stay under 100 MB.
constexpr int64_t kMaxWorld = int64_t{1} << 20;

[[noreturn]] void fail(const std::string& msg) { throw Error(RLH_E_INVALID_ARGUMENT, "parallel sizes: " + msg); }

std::vector<std::string> split_order(const std::string& order) {
  std::vector<std::string> out;
  std::string cur;
  for (char c : order) {
    if (c == '-') {
      out.push_back(cur);
      cur.clear();
    } else {
      cur += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    }
  }
  out.push_back(cur);
  return out;
}

// One of Megatron's two generators: sizes by name, ordered by the order string.
struct Generator {
  std::vector<std::string> names;  // in order, first fastest
  std::vector<int64_t> sizes;

  std::vector<std::vector<int>> groups(std::initializer_list<const char*> varying) const {
    std::vector<bool> mask(names.size(), false);
    for (const char* v : varying)
      for (size_t i = 0; i < names.size(); ++i)
        if (names[i] == v) mask[i] = true;
    return masked_rank_groups(sizes, mask);
  }
};

Generator make_generator(const std::vector<std::string>& order, int64_t tp, int64_t cp, int64_t ep,
                         int64_t dp, int64_t pp) {
  Generator g;
  g.names = order;
  for (const std::string& n : order) {
    if (n == "tp") g.sizes.push_back(tp);
    else if (n == "cp") g.sizes.push_back(cp);
    else if (n == "ep") g.sizes.push_back(ep);
    else if (n == "dp") g.sizes.push_back(dp);
    else g.sizes.push_back(pp);
  }
  return g;
}

std::string list(const std::vector<int>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? "," : "") + std::to_string(v[i]);
  return s + "]";
}

// Splits each group of `base` (size n = shards x per-shard) into contiguous shard groups and
// strided replicate groups, as Megatron's hierarchical groups for partial distributed optimizers.
void split_replicas(const std::vector<std::vector<int>>& base, int64_t replicas,
                    std::vector<std::vector<int>>& shard, std::vector<std::vector<int>>& replicate) {
  for (const auto& g : base) {
    const size_t per = g.size() / static_cast<size_t>(replicas);
    for (int64_t r = 0; r < replicas; ++r)
      shard.emplace_back(g.begin() + static_cast<std::ptrdiff_t>(r * per),
                         g.begin() + static_cast<std::ptrdiff_t>((r + 1) * per));
    for (size_t j = 0; j < per; ++j) {
      std::vector<int> rep;
      for (int64_t r = 0; r < replicas; ++r) rep.push_back(g[r * per + j]);
      replicate.push_back(std::move(rep));
    }
  }
}

}  // namespace

const char* group_kind_name(GroupKind k) {
  switch (k) {
    case GroupKind::tp: return "tp";
    case GroupKind::cp: return "cp";
    case GroupKind::dp: return "dp";
    case GroupKind::dp_cp: return "dp_cp";
    case GroupKind::pp: return "pp";
    case GroupKind::mp: return "mp";
    case GroupKind::tp_cp: return "tp_cp";
    case GroupKind::tp_dp: return "tp_dp";
    case GroupKind::tp_dp_cp: return "tp_dp_cp";
    case GroupKind::embedding: return "embedding";
    case GroupKind::position_embedding: return "position_embedding";
    case GroupKind::dp_cp_shard: return "dp_cp_shard";
    case GroupKind::dp_cp_replicate: return "dp_cp_replicate";
    case GroupKind::ep: return "ep";
    case GroupKind::expert_tp: return "expert_tp";
    case GroupKind::expert_tp_ep: return "expert_tp_ep";
    case GroupKind::expert_tp_ep_pp: return "expert_tp_ep_pp";
    case GroupKind::expert_dp: return "expert_dp";
    case GroupKind::expert_dp_shard: return "expert_dp_shard";
    case GroupKind::expert_dp_replicate: return "expert_dp_replicate";
  }
  return "?";
}

std::vector<std::vector<int>> masked_rank_groups(const std::vector<int64_t>& sizes, const std::vector<bool>& mask) {
  if (sizes.size() != mask.size()) throw Error(RLH_E_INVALID_ARGUMENT, "masked_rank_groups: sizes and mask differ in length");
  // Stride of dimension i: the product of the sizes before it (the first varies fastest).
  std::vector<int64_t> stride(sizes.size());
  int64_t world = 1;
  for (size_t i = 0; i < sizes.size(); ++i) {
    stride[i] = world;
    world *= sizes[i];
  }
  std::vector<size_t> in, out;  // dimensions varying inside a group, and across groups
  for (size_t i = 0; i < sizes.size(); ++i) (mask[i] ? in : out).push_back(i);
  int64_t group_size = 1;
  for (size_t i : in) group_size *= sizes[i];
  const int64_t num_groups = world / group_size;

  // The rank offset of a mixed-radix index over `dims` (the first fastest).
  auto offset = [&](int64_t index, const std::vector<size_t>& dims) {
    int64_t r = 0;
    for (size_t d : dims) {
      r += (index % sizes[d]) * stride[d];
      index /= sizes[d];
    }
    return r;
  };
  std::vector<std::vector<int>> groups(static_cast<size_t>(num_groups));
  for (int64_t g = 0; g < num_groups; ++g) {
    const int64_t base = offset(g, out);
    auto& ranks = groups[static_cast<size_t>(g)];
    ranks.reserve(static_cast<size_t>(group_size));
    for (int64_t p = 0; p < group_size; ++p) ranks.push_back(static_cast<int>(base + offset(p, in)));
  }
  return groups;
}

ParallelLayout make_parallel_layout(const ParallelSizes& s, int64_t world) {
  if (world < 1) fail("world size must be at least 1, got " + std::to_string(world));
  if (world > kMaxWorld) fail("world size " + std::to_string(world) + " exceeds the supported " + std::to_string(kMaxWorld));
  auto at_least_one = [](const char* name, int64_t v) {
    if (v < 1) fail(std::string(name) + " must be at least 1, got " + std::to_string(v));
    if (v > kMaxWorld) fail(std::string(name) + " = " + std::to_string(v) + " exceeds the supported world of " + std::to_string(kMaxWorld));
  };
  at_least_one("tp", s.tp);
  at_least_one("cp", s.cp);
  at_least_one("pp", s.pp);
  at_least_one("ep", s.ep);
  at_least_one("dp_replicate", s.dp_replicate);
  if (s.etp < 0) fail("etp must be at least 1 (or 0 for tp), got " + std::to_string(s.etp));
  if (s.dp < 0) fail("dp must be at least 1 (or 0 for world / (tp x cp x pp)), got " + std::to_string(s.dp));
  if (s.etp > kMaxWorld || s.dp > kMaxWorld) fail("etp or dp exceeds the supported world of " + std::to_string(kMaxWorld));

  ParallelLayout L;
  L.world_size = world;
  L.tp = s.tp;
  L.cp = s.cp;
  L.pp = s.pp;
  L.ep = s.ep;
  L.etp = s.etp == 0 ? s.tp : s.etp;
  L.dp_replicate = s.dp_replicate;

  const int64_t model = s.tp * s.cp * s.pp;  // each factor <= 2^20: no overflow in int64
  if (world % model != 0)
    fail("world size " + std::to_string(world) + " is not divisible by tp x cp x pp = " + std::to_string(s.tp) + " x " +
         std::to_string(s.cp) + " x " + std::to_string(s.pp) + " = " + std::to_string(model));
  L.dp = world / model;
  if (s.dp != 0 && s.dp != L.dp)
    fail("dp = " + std::to_string(s.dp) + " does not match world size " + std::to_string(world) + " / (tp x cp x pp = " +
         std::to_string(model) + ") = " + std::to_string(L.dp));
  const int64_t expert_model = L.etp * s.ep * s.pp;
  if (world % expert_model != 0)
    fail("world size " + std::to_string(world) + " is not divisible by etp x ep x pp = " + std::to_string(L.etp) + " x " +
         std::to_string(s.ep) + " x " + std::to_string(s.pp) + " = " + std::to_string(expert_model));
  L.edp = world / expert_model;

  // The order: a '-' separated permutation of tp, cp, ep, dp, pp; names left out must have size 1
  // (they are appended, as Megatron does).
  std::vector<std::string> order = split_order(s.order);
  const std::vector<std::pair<std::string, int64_t>> known = {
      {"tp", std::max(s.tp, L.etp)}, {"cp", s.cp}, {"ep", s.ep}, {"dp", std::max(L.dp, L.edp)}, {"pp", s.pp}};
  for (size_t i = 0; i < order.size(); ++i) {
    const bool ok = std::any_of(known.begin(), known.end(), [&](const auto& k) { return k.first == order[i]; });
    if (!ok) fail("order '" + s.order + "' names '" + order[i] + "'; it must be a '-' separated list of tp, cp, ep, dp, pp");
    if (std::find(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(i), order[i]) != order.begin() + static_cast<std::ptrdiff_t>(i))
      fail("order '" + s.order + "' names '" + order[i] + "' twice");
  }
  for (const auto& [name, size] : known) {
    if (std::find(order.begin(), order.end(), name) != order.end()) continue;
    if (size != 1) fail("order '" + s.order + "' leaves out " + name + ", whose size is " + std::to_string(size));
    order.push_back(name);
  }
  for (size_t i = 0; i < order.size(); ++i) L.order += (i ? "-" : "") + order[i];

  if (!L.order.ends_with("pp") && s.pp > 1 && L.edp != L.dp)
    fail("with order '" + L.order + "' (pp not last) and pp = " + std::to_string(s.pp) +
         ", the expert data parallel size edp = " + std::to_string(L.edp) + " must equal dp = " + std::to_string(L.dp));
  if ((L.dp * s.cp) % s.dp_replicate != 0)
    fail("dp_replicate = " + std::to_string(s.dp_replicate) + " does not divide dp x cp = " + std::to_string(L.dp) + " x " +
         std::to_string(s.cp));
  if (L.edp % s.dp_replicate != 0)
    fail("dp_replicate = " + std::to_string(s.dp_replicate) + " does not divide the expert data parallel size edp = " +
         std::to_string(L.edp) + " (world / (etp x ep x pp))");

  const Generator dense = make_generator(order, s.tp, s.cp, 1, L.dp, s.pp);
  const Generator expert = make_generator(order, L.etp, 1, s.ep, L.edp, s.pp);
  auto& G = L.groups;
  auto at = [&](GroupKind k) -> std::vector<std::vector<int>>& { return G[static_cast<int>(k)]; };
  at(GroupKind::tp) = dense.groups({"tp"});
  at(GroupKind::cp) = dense.groups({"cp"});
  at(GroupKind::dp) = dense.groups({"dp"});
  at(GroupKind::dp_cp) = dense.groups({"dp", "cp"});
  at(GroupKind::pp) = dense.groups({"pp"});
  at(GroupKind::mp) = dense.groups({"tp", "pp"});
  at(GroupKind::tp_cp) = dense.groups({"tp", "cp"});
  at(GroupKind::tp_dp) = dense.groups({"tp", "dp"});
  at(GroupKind::tp_dp_cp) = dense.groups({"tp", "dp", "cp"});
  for (const auto& p : at(GroupKind::pp)) {
    at(GroupKind::embedding).push_back(p.size() == 1 ? std::vector<int>{p.front()} : std::vector<int>{p.front(), p.back()});
    at(GroupKind::position_embedding).push_back({p.front()});
  }
  split_replicas(at(GroupKind::dp_cp), s.dp_replicate, at(GroupKind::dp_cp_shard), at(GroupKind::dp_cp_replicate));
  at(GroupKind::ep) = expert.groups({"ep"});
  at(GroupKind::expert_tp) = expert.groups({"tp"});
  at(GroupKind::expert_tp_ep) = expert.groups({"tp", "ep"});
  at(GroupKind::expert_tp_ep_pp) = expert.groups({"tp", "ep", "pp"});
  at(GroupKind::expert_dp) = expert.groups({"dp"});
  split_replicas(at(GroupKind::expert_dp), s.dp_replicate, at(GroupKind::expert_dp_shard), at(GroupKind::expert_dp_replicate));

  // Megatron requires the dense and the expert layout to agree on the pipeline stages.
  const auto expert_pp = expert.groups({"pp"});
  if (expert_pp != at(GroupKind::pp)) {
    const auto& a = at(GroupKind::pp).front();
    const auto& b = expert_pp.front();
    fail("with order '" + L.order + "', the dense layout (tp " + std::to_string(s.tp) + ", cp " + std::to_string(s.cp) +
         ", dp " + std::to_string(L.dp) + ") and the expert layout (etp " + std::to_string(L.etp) + ", ep " +
         std::to_string(s.ep) + ", edp " + std::to_string(L.edp) + ") give different pipeline groups (" + list(a) +
         " against " + list(b) + ")");
  }
  return L;
}

RankGroups groups_of_rank(const ParallelLayout& L, int rank) {
  if (rank < 0 || rank >= L.world_size)
    throw Error(RLH_E_INVALID_ARGUMENT, "rank " + std::to_string(rank) + " is outside the world of " + std::to_string(L.world_size));
  RankGroups out;
  out.rank = rank;
  for (int k = 0; k < kNumGroupKinds; ++k) {
    RankGroup& rg = out.groups[k];
    rg.kind = static_cast<GroupKind>(k);
    const auto& groups = L.groups[k];
    for (size_t g = 0; g < groups.size() && rg.index < 0; ++g) {
      const auto it = std::find(groups[g].begin(), groups[g].end(), rank);
      if (it == groups[g].end()) continue;
      rg.index = static_cast<int>(g);
      rg.position = static_cast<int>(it - groups[g].begin());
      rg.ranks = groups[g];
    }
  }
  out.tp_rank = out.of(GroupKind::tp).position;
  out.cp_rank = out.of(GroupKind::cp).position;
  out.dp_rank = out.of(GroupKind::dp).position;
  out.pp_rank = out.of(GroupKind::pp).position;
  out.etp_rank = out.of(GroupKind::expert_tp).position;
  out.ep_rank = out.of(GroupKind::ep).position;
  out.edp_rank = out.of(GroupKind::expert_dp).position;
  return out;
}

}  // namespace rlh::sdk
