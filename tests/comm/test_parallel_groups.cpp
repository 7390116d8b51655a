// Rank groups (sdk/parallel_groups.hpp) against hand-computed Megatron layouts, against an
// independent brute-force construction over many sizes and orders, and their errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <set>

#include "rlhost/sdk/parallel_groups.hpp"
#include "rlhost/sdk/status.hpp"

namespace {

using rlh::sdk::Error;
using rlh::sdk::GroupKind;
using rlh::sdk::ParallelLayout;
using rlh::sdk::ParallelSizes;
using Groups = std::vector<std::vector<int>>;

ParallelSizes sizes(int64_t tp, int64_t cp, int64_t pp, int64_t ep = 1, int64_t etp = 0, const char* order = "tp-cp-ep-dp-pp") {
  ParallelSizes s;
  s.tp = tp;
  s.cp = cp;
  s.pp = pp;
  s.ep = ep;
  s.etp = etp;
  s.order = order;
  return s;
}

std::string error_of(const ParallelSizes& s, int64_t world) {
  try {
    rlh::sdk::make_parallel_layout(s, world);
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), RLH_E_INVALID_ARGUMENT);
    return e.what();
  }
  return "(no error)";
}

// World 16, tp 2, pp 2 (dp 4): rank = tp + 2 dp + 8 pp.
TEST(ParallelGroups, World16Tp2Pp2) {
  const ParallelLayout L = rlh::sdk::make_parallel_layout(sizes(2, 1, 2), 16);
  EXPECT_EQ(L.dp, 4);
  EXPECT_EQ(L.edp, 4);
  EXPECT_EQ(L.etp, 2);
  EXPECT_EQ(L.of(GroupKind::tp), (Groups{{0, 1}, {2, 3}, {4, 5}, {6, 7}, {8, 9}, {10, 11}, {12, 13}, {14, 15}}));
  EXPECT_EQ(L.of(GroupKind::dp), (Groups{{0, 2, 4, 6}, {1, 3, 5, 7}, {8, 10, 12, 14}, {9, 11, 13, 15}}));
  EXPECT_EQ(L.of(GroupKind::dp_cp), L.of(GroupKind::dp));
  EXPECT_EQ(L.of(GroupKind::pp), (Groups{{0, 8}, {1, 9}, {2, 10}, {3, 11}, {4, 12}, {5, 13}, {6, 14}, {7, 15}}));
  EXPECT_EQ(L.of(GroupKind::mp), (Groups{{0, 1, 8, 9}, {2, 3, 10, 11}, {4, 5, 12, 13}, {6, 7, 14, 15}}));
  EXPECT_EQ(L.of(GroupKind::tp_dp), (Groups{{0, 1, 2, 3, 4, 5, 6, 7}, {8, 9, 10, 11, 12, 13, 14, 15}}));
  EXPECT_EQ(L.of(GroupKind::embedding), L.of(GroupKind::pp));
  EXPECT_EQ(L.of(GroupKind::position_embedding), (Groups{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}}));
  // No expert parallelism: expert dp is dp, ep groups are single ranks.
  EXPECT_EQ(L.of(GroupKind::expert_dp), L.of(GroupKind::dp));
  EXPECT_EQ(L.of(GroupKind::ep).size(), 16u);

  const auto r11 = rlh::sdk::groups_of_rank(L, 11);  // tp 1, dp 1, pp 1
  EXPECT_EQ(r11.tp_rank, 1);
  EXPECT_EQ(r11.dp_rank, 1);
  EXPECT_EQ(r11.pp_rank, 1);
  EXPECT_EQ(r11.of(GroupKind::dp).index, 3);
  EXPECT_EQ(r11.of(GroupKind::dp).position, 1);
  EXPECT_EQ(r11.of(GroupKind::dp).ranks, (std::vector<int>{9, 11, 13, 15}));
  EXPECT_EQ(r11.of(GroupKind::tp).index, 5);
  EXPECT_EQ(r11.of(GroupKind::pp).ranks, (std::vector<int>{3, 11}));
}

// Megatron's own docstring example: 16 GPUs, tp 2, pp 4 -> 8 dp groups of 2.
TEST(ParallelGroups, MegatronDocstringExample) {
  const ParallelLayout L = rlh::sdk::make_parallel_layout(sizes(2, 1, 4), 16);
  EXPECT_EQ(L.of(GroupKind::dp), (Groups{{0, 2}, {1, 3}, {4, 6}, {5, 7}, {8, 10}, {9, 11}, {12, 14}, {13, 15}}));
  EXPECT_EQ(L.of(GroupKind::tp), (Groups{{0, 1}, {2, 3}, {4, 5}, {6, 7}, {8, 9}, {10, 11}, {12, 13}, {14, 15}}));
  EXPECT_EQ(L.of(GroupKind::pp), (Groups{{0, 4, 8, 12}, {1, 5, 9, 13}, {2, 6, 10, 14}, {3, 7, 11, 15}}));
  EXPECT_EQ(L.of(GroupKind::embedding), (Groups{{0, 12}, {1, 13}, {2, 14}, {3, 15}}));
  // A middle stage holds no embedding.
  const auto r4 = rlh::sdk::groups_of_rank(L, 4);
  EXPECT_FALSE(r4.of(GroupKind::embedding).member());
  EXPECT_EQ(r4.of(GroupKind::embedding).index, -1);
  EXPECT_TRUE(r4.of(GroupKind::embedding).ranks.empty());
  EXPECT_EQ(r4.pp_rank, 1);
}

// World 16, tp 2, cp 2, pp 2 (dp 2): rank = tp + 2 cp + 4 dp + 8 pp.
TEST(ParallelGroups, World16WithContextParallel) {
  const ParallelLayout L = rlh::sdk::make_parallel_layout(sizes(2, 2, 2), 16);
  EXPECT_EQ(L.dp, 2);
  EXPECT_EQ(L.of(GroupKind::cp), (Groups{{0, 2}, {1, 3}, {4, 6}, {5, 7}, {8, 10}, {9, 11}, {12, 14}, {13, 15}}));
  EXPECT_EQ(L.of(GroupKind::dp), (Groups{{0, 4}, {1, 5}, {2, 6}, {3, 7}, {8, 12}, {9, 13}, {10, 14}, {11, 15}}));
  EXPECT_EQ(L.of(GroupKind::dp_cp), (Groups{{0, 2, 4, 6}, {1, 3, 5, 7}, {8, 10, 12, 14}, {9, 11, 13, 15}}));
  EXPECT_EQ(L.of(GroupKind::tp_cp), (Groups{{0, 1, 2, 3}, {4, 5, 6, 7}, {8, 9, 10, 11}, {12, 13, 14, 15}}));
  EXPECT_EQ(L.of(GroupKind::tp_dp), (Groups{{0, 1, 4, 5}, {2, 3, 6, 7}, {8, 9, 12, 13}, {10, 11, 14, 15}}));
  EXPECT_EQ(L.of(GroupKind::tp_dp_cp), (Groups{{0, 1, 2, 3, 4, 5, 6, 7}, {8, 9, 10, 11, 12, 13, 14, 15}}));
  EXPECT_EQ(L.of(GroupKind::pp), (Groups{{0, 8}, {1, 9}, {2, 10}, {3, 11}, {4, 12}, {5, 13}, {6, 14}, {7, 15}}));
  const auto r6 = rlh::sdk::groups_of_rank(L, 6);  // tp 0, cp 1, dp 1, pp 0
  EXPECT_EQ(r6.tp_rank, 0);
  EXPECT_EQ(r6.cp_rank, 1);
  EXPECT_EQ(r6.dp_rank, 1);
  EXPECT_EQ(r6.pp_rank, 0);
  EXPECT_EQ(r6.of(GroupKind::dp_cp).position, 3);  // cp varies fastest inside dp_cp
  // Experts have no cp: edp = 16 / (2 x 1 x 2) = 4 and spans the cp ranks.
  EXPECT_EQ(L.edp, 4);
  EXPECT_EQ(L.of(GroupKind::expert_dp), L.of(GroupKind::dp_cp));
}

// World 16, tp 2, pp 2, ep 2 (etp = tp): expert rank = etp + 2 ep + 4 edp + 8 pp, edp 2.
TEST(ParallelGroups, World16WithExpertParallel) {
  const ParallelLayout L = rlh::sdk::make_parallel_layout(sizes(2, 1, 2, 2), 16);
  EXPECT_EQ(L.dp, 4);
  EXPECT_EQ(L.edp, 2);
  EXPECT_EQ(L.of(GroupKind::ep), (Groups{{0, 2}, {1, 3}, {4, 6}, {5, 7}, {8, 10}, {9, 11}, {12, 14}, {13, 15}}));
  EXPECT_EQ(L.of(GroupKind::expert_dp), (Groups{{0, 4}, {1, 5}, {2, 6}, {3, 7}, {8, 12}, {9, 13}, {10, 14}, {11, 15}}));
  EXPECT_EQ(L.of(GroupKind::expert_tp), L.of(GroupKind::tp));
  EXPECT_EQ(L.of(GroupKind::expert_tp_ep), (Groups{{0, 1, 2, 3}, {4, 5, 6, 7}, {8, 9, 10, 11}, {12, 13, 14, 15}}));
  EXPECT_EQ(L.of(GroupKind::expert_tp_ep_pp), (Groups{{0, 1, 2, 3, 8, 9, 10, 11}, {4, 5, 6, 7, 12, 13, 14, 15}}));
  // The dense dp groups are unchanged by ep.
  EXPECT_EQ(L.of(GroupKind::dp), (Groups{{0, 2, 4, 6}, {1, 3, 5, 7}, {8, 10, 12, 14}, {9, 11, 13, 15}}));
  const auto r13 = rlh::sdk::groups_of_rank(L, 13);  // etp 1, ep 0, edp 1, pp 1
  EXPECT_EQ(r13.etp_rank, 1);
  EXPECT_EQ(r13.ep_rank, 0);
  EXPECT_EQ(r13.edp_rank, 1);
  EXPECT_EQ(r13.dp_rank, 2);
}

// Expert tensor parallel size other than tp: world 8, tp 2, ep 4, etp 1.
TEST(ParallelGroups, ExpertTensorParallelDiffersFromTp) {
  const ParallelLayout L = rlh::sdk::make_parallel_layout(sizes(2, 1, 1, 4, 1), 8);
  EXPECT_EQ(L.dp, 4);
  EXPECT_EQ(L.edp, 2);
  EXPECT_EQ(L.of(GroupKind::dp), (Groups{{0, 2, 4, 6}, {1, 3, 5, 7}}));
  EXPECT_EQ(L.of(GroupKind::ep), (Groups{{0, 1, 2, 3}, {4, 5, 6, 7}}));
  EXPECT_EQ(L.of(GroupKind::expert_dp), (Groups{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
  EXPECT_EQ(L.of(GroupKind::expert_tp).size(), 8u);
}

// Another order: tp-pp-dp puts pp before dp (rank = tp + 2 pp + 4 dp).
TEST(ParallelGroups, OrderTpPpDp) {
  const ParallelLayout L = rlh::sdk::make_parallel_layout(sizes(2, 1, 2, 1, 0, "tp-pp-dp"), 8);
  EXPECT_EQ(L.order, "tp-pp-dp-cp-ep");
  EXPECT_EQ(L.of(GroupKind::pp), (Groups{{0, 2}, {1, 3}, {4, 6}, {5, 7}}));
  EXPECT_EQ(L.of(GroupKind::dp), (Groups{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
  EXPECT_EQ(L.of(GroupKind::tp), (Groups{{0, 1}, {2, 3}, {4, 5}, {6, 7}}));
}

// dp_replicate (Megatron's num_distributed_optimizer_instances, FSDP2's HSDP replicas).
TEST(ParallelGroups, ShardAndReplicateGroups) {
  ParallelSizes s;
  s.dp_replicate = 2;
  const ParallelLayout L = rlh::sdk::make_parallel_layout(s, 8);
  EXPECT_EQ(L.of(GroupKind::dp_cp_shard), (Groups{{0, 1, 2, 3}, {4, 5, 6, 7}}));
  EXPECT_EQ(L.of(GroupKind::dp_cp_replicate), (Groups{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
  EXPECT_EQ(L.of(GroupKind::expert_dp_shard), L.of(GroupKind::dp_cp_shard));
  // With tp 2 on 8 ranks: dp_cp groups {0,2,4,6} and {1,3,5,7}, each split in two replicas.
  s.tp = 2;
  const ParallelLayout M = rlh::sdk::make_parallel_layout(s, 8);
  EXPECT_EQ(M.of(GroupKind::dp_cp_shard), (Groups{{0, 2}, {4, 6}, {1, 3}, {5, 7}}));
  EXPECT_EQ(M.of(GroupKind::dp_cp_replicate), (Groups{{0, 4}, {2, 6}, {1, 5}, {3, 7}}));
}

TEST(ParallelGroups, SingleRank) {
  const ParallelLayout L = rlh::sdk::make_parallel_layout(ParallelSizes{}, 1);
  for (int k = 0; k < rlh::sdk::kNumGroupKinds; ++k) EXPECT_EQ(L.groups[k], (Groups{{0}})) << k;
  const auto r = rlh::sdk::groups_of_rank(L, 0);
  for (int k = 0; k < rlh::sdk::kNumGroupKinds; ++k) {
    EXPECT_EQ(r.groups[k].index, 0);
    EXPECT_EQ(r.groups[k].position, 0);
  }
}

// ---- An independent construction: a rank's coordinates by mixed radix over the order, and a
// group = the ranks that agree on every coordinate outside the group's dimensions, ascending;
// groups sorted by their first rank.
Groups brute_force(const std::vector<std::string>& order, const std::map<std::string, int64_t>& size, int64_t world,
                   const std::set<std::string>& varying) {
  std::map<std::vector<int64_t>, std::vector<int>> by_key;
  for (int r = 0; r < world; ++r) {
    int64_t rest = r;
    std::vector<int64_t> key;
    for (const auto& name : order) {
      const int64_t c = rest % size.at(name);
      rest /= size.at(name);
      if (!varying.count(name)) key.push_back(c);
    }
    by_key[key].push_back(r);
  }
  Groups out;
  for (auto& [k, g] : by_key) out.push_back(g);
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<std::string> names_of(const std::string& order) {
  std::vector<std::string> out;
  size_t start = 0;
  while (true) {
    size_t dash = order.find('-', start);
    out.push_back(order.substr(start, dash - start));
    if (dash == std::string::npos) break;
    start = dash + 1;
  }
  return out;
}

TEST(ParallelGroups, MatchesBruteForceOverManyLayouts) {
  struct Case {
    int64_t world, tp, cp, pp, ep, etp;
    const char* order;
  };
  // Sizes from Megatron's own rank-generator tests (nodes x 8 GPUs) and small odd ones.
  const Case cases[] = {
      {1, 1, 1, 1, 1, 0, "tp-cp-ep-dp-pp"},  {8, 8, 1, 1, 1, 0, "tp-cp-ep-dp-pp"},   {8, 2, 1, 2, 1, 0, "tp-cp-ep-dp-pp"},
      {8, 2, 1, 4, 1, 0, "tp-cp-ep-dp-pp"},  {24, 8, 1, 3, 1, 0, "tp-cp-ep-dp-pp"},  {32, 2, 1, 4, 1, 0, "tp-cp-ep-dp-pp"},
      {64, 2, 1, 1, 4, 0, "tp-cp-ep-dp-pp"}, {64, 2, 2, 2, 4, 0, "tp-cp-ep-dp-pp"},  {64, 2, 4, 1, 8, 0, "tp-cp-ep-dp-pp"},
      {64, 2, 2, 2, 8, 0, "tp-cp-ep-dp-pp"}, {128, 4, 1, 8, 4, 0, "tp-cp-ep-dp-pp"}, {128, 4, 4, 8, 1, 0, "tp-cp-ep-dp-pp"},
      {512, 4, 8, 2, 8, 0, "tp-cp-ep-dp-pp"}, {12, 3, 1, 2, 2, 1, "tp-cp-ep-dp-pp"}, {18, 3, 3, 1, 1, 0, "tp-cp-ep-dp-pp"},
      {16, 2, 1, 2, 1, 0, "tp-cp-pp-ep-dp"}, {16, 2, 2, 2, 2, 2, "pp-tp-cp-ep-dp"},     {12, 2, 1, 3, 1, 0, "pp-tp-dp"},
      {16, 2, 1, 2, 2, 1, "tp-ep-dp-pp"},    {32, 4, 2, 2, 2, 2, "tp-cp-ep-dp-pp"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE("world " + std::to_string(c.world) + " tp " + std::to_string(c.tp) + " cp " + std::to_string(c.cp) + " pp " +
                 std::to_string(c.pp) + " ep " + std::to_string(c.ep) + " etp " + std::to_string(c.etp) + " " + c.order);
    const ParallelLayout L = rlh::sdk::make_parallel_layout(sizes(c.tp, c.cp, c.pp, c.ep, c.etp, c.order), c.world);
    const auto order = names_of(L.order);
    const std::map<std::string, int64_t> dense = {{"tp", L.tp}, {"cp", L.cp}, {"ep", 1}, {"dp", L.dp}, {"pp", L.pp}};
    const std::map<std::string, int64_t> expert = {{"tp", L.etp}, {"cp", 1}, {"ep", L.ep}, {"dp", L.edp}, {"pp", L.pp}};
    EXPECT_EQ(L.of(GroupKind::tp), brute_force(order, dense, c.world, {"tp"}));
    EXPECT_EQ(L.of(GroupKind::cp), brute_force(order, dense, c.world, {"cp"}));
    EXPECT_EQ(L.of(GroupKind::dp), brute_force(order, dense, c.world, {"dp"}));
    EXPECT_EQ(L.of(GroupKind::dp_cp), brute_force(order, dense, c.world, {"dp", "cp"}));
    EXPECT_EQ(L.of(GroupKind::pp), brute_force(order, dense, c.world, {"pp"}));
    EXPECT_EQ(L.of(GroupKind::mp), brute_force(order, dense, c.world, {"tp", "pp"}));
    EXPECT_EQ(L.of(GroupKind::tp_cp), brute_force(order, dense, c.world, {"tp", "cp"}));
    EXPECT_EQ(L.of(GroupKind::tp_dp), brute_force(order, dense, c.world, {"tp", "dp"}));
    EXPECT_EQ(L.of(GroupKind::tp_dp_cp), brute_force(order, dense, c.world, {"tp", "dp", "cp"}));
    EXPECT_EQ(L.of(GroupKind::ep), brute_force(order, expert, c.world, {"ep"}));
    EXPECT_EQ(L.of(GroupKind::expert_tp), brute_force(order, expert, c.world, {"tp"}));
    EXPECT_EQ(L.of(GroupKind::expert_tp_ep), brute_force(order, expert, c.world, {"tp", "ep"}));
    EXPECT_EQ(L.of(GroupKind::expert_tp_ep_pp), brute_force(order, expert, c.world, {"tp", "ep", "pp"}));
    EXPECT_EQ(L.of(GroupKind::expert_dp), brute_force(order, expert, c.world, {"dp"}));
    // Every kind but the embedding ones partitions the world, and a rank's own groups agree.
    for (int k = 0; k < rlh::sdk::kNumGroupKinds; ++k) {
      const auto kind = static_cast<GroupKind>(k);
      if (kind == GroupKind::embedding || kind == GroupKind::position_embedding) continue;
      std::vector<int> seen(static_cast<size_t>(c.world), 0);
      for (const auto& g : L.groups[k])
        for (int r : g) seen[static_cast<size_t>(r)]++;
      EXPECT_EQ(std::count(seen.begin(), seen.end(), 1), c.world) << rlh::sdk::group_kind_name(kind);
    }
    for (int r = 0; r < c.world; r += std::max<int64_t>(1, c.world / 7)) {
      const auto mine = rlh::sdk::groups_of_rank(L, r);
      for (int k = 0; k < rlh::sdk::kNumGroupKinds; ++k) {
        const auto& rg = mine.groups[k];
        if (!rg.member()) continue;
        EXPECT_EQ(L.groups[k][static_cast<size_t>(rg.index)], rg.ranks);
        EXPECT_EQ(rg.ranks[static_cast<size_t>(rg.position)], r);
      }
    }
  }
}

TEST(ParallelGroups, ErrorsNameTheSizes) {
  EXPECT_EQ(error_of(sizes(2, 1, 2), 6), "parallel sizes: world size 6 is not divisible by tp x cp x pp = 2 x 1 x 2 = 4");
  ParallelSizes s = sizes(2, 1, 2);
  s.dp = 3;
  EXPECT_EQ(error_of(s, 16), "parallel sizes: dp = 3 does not match world size 16 / (tp x cp x pp = 4) = 4");
  EXPECT_EQ(error_of(sizes(2, 1, 1, 3), 8), "parallel sizes: world size 8 is not divisible by etp x ep x pp = 2 x 3 x 1 = 6");
  EXPECT_NE(error_of(sizes(0, 1, 1), 8).find("tp must be at least 1, got 0"), std::string::npos);
  EXPECT_NE(error_of(sizes(1, 1, -2), 8).find("pp must be at least 1, got -2"), std::string::npos);
  EXPECT_NE(error_of(sizes(1, 1, 1), 0).find("world size must be at least 1, got 0"), std::string::npos);
  EXPECT_NE(error_of(sizes(1, 1, 1), int64_t{1} << 40).find("exceeds the supported"), std::string::npos);
  EXPECT_NE(error_of(sizes(1, 1, 1, 1, -1), 8).find("etp must be at least 1"), std::string::npos);
  EXPECT_EQ(error_of(sizes(1, 1, 1, 1, 0, "tp-xx-dp"), 8),
            "parallel sizes: order 'tp-xx-dp' names 'xx'; it must be a '-' separated list of tp, cp, ep, dp, pp");
  EXPECT_EQ(error_of(sizes(1, 1, 1, 1, 0, "tp-dp-tp"), 8), "parallel sizes: order 'tp-dp-tp' names 'tp' twice");
  EXPECT_EQ(error_of(sizes(1, 1, 1, 2, 0, "tp-dp-pp"), 8), "parallel sizes: order 'tp-dp-pp' leaves out ep, whose size is 2");
  EXPECT_EQ(error_of(sizes(2, 1, 2, 1, 1, "tp-cp-pp-ep-dp"), 8),
            "parallel sizes: with order 'tp-cp-pp-ep-dp' (pp not last) and pp = 2, the expert data parallel size edp = 4 must "
            "equal dp = 2");
  s = ParallelSizes{};
  s.dp_replicate = 3;
  EXPECT_EQ(error_of(s, 8), "parallel sizes: dp_replicate = 3 does not divide dp x cp = 8 x 1");
  s.dp_replicate = 4;
  s.ep = 4;
  EXPECT_EQ(error_of(s, 8),
            "parallel sizes: dp_replicate = 4 does not divide the expert data parallel size edp = 2 (world / (etp x ep x pp))");
  // pp not last, equal data parallel sizes (2), but the stages differ: pp's stride is tp x dp = 4
  // in the dense layout and etp x edp = 2 in the expert one.
  EXPECT_EQ(error_of(sizes(2, 1, 2, 2, 1, "tp-dp-pp-cp-ep"), 8),
            "parallel sizes: with order 'tp-dp-pp-cp-ep', the dense layout (tp 2, cp 1, dp 2) and the expert layout (etp 1, ep 2, "
            "edp 2) give different pipeline groups ([0,4] against [0,2])");
  const ParallelLayout L = rlh::sdk::make_parallel_layout(sizes(2, 1, 1), 4);
  try {
    rlh::sdk::groups_of_rank(L, 4);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "rank 4 is outside the world of 4");
  }
}

}  // namespace
