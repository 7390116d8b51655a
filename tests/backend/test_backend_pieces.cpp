// BACKEND 0.5's visit_weight_pieces on CPU ranks under mpirun (label comm): for every layout the
// CPU engine runs (one rank, TP 2, PP 2 with a tied embedding, EP 2, TP 2 with stacked experts,
// dtensor FSDP over 2 and 4 ranks (stacked experts on 4), HSDP 2 x 2, CP 2, and TP 2 x PP 2 and
// TP 4 x EP 2 x ETP 2 on 4 ranks), each rank's pieces hold exactly the gathered weight's values at
// their placement, the pieces marked RLH_PIECE_SENDER cover every element of every weight exactly
// once over the ranks, and a second visit names the same placements (what a resharding refit
// exchanges once). An FSDP rank's pieces are its own flat shard, ungathered (the boxes
// flat_range_boxes makes).
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <map>
#include <string>
#include <vector>

#include "backend_harness.hpp"
#include "mpi_harness.hpp"
#include "rlhost/sdk/weight_pieces.hpp"

namespace rlh::test {
namespace {

using json = nlohmann::json;

struct Case {
  std::string name, backend, model;
  json config;
  int ranks;  // the world size the case runs on
};

std::vector<Case> cases() {
  const json moe = {{"moe_router_load_balancing_type", "aux_loss"}, {"moe_aux_loss_coeff", 0.01}};
  json ep2 = moe, tp2moe = moe, etp = moe;
  ep2["expert_model_parallel_size"] = 2;
  tp2moe["tensor_model_parallel_size"] = 2;
  // Expert tensor parallelism between 1 and tp: each expert cut in 2 blocks over an etp group of
  // the 4 tp ranks, the experts split over ep 2.
  etp["tensor_model_parallel_size"] = 4;
  etp["expert_model_parallel_size"] = 2;
  etp["expert_tensor_parallel_size"] = 2;
  etp["sequence_parallel"] = true;
  return {
      {"one_rank", "megatron", "llama-tiny", json::object(), 1},
      {"tp2", "megatron", "llama-tiny", {{"megatron_cfg", {{"tensor_model_parallel_size", 2}}}}, 2},
      {"tp2_experts", "megatron", "qwen3-moe-tiny", {{"megatron_cfg", tp2moe}}, 2},
      {"pp2_tied", "megatron", "qwen3-tiny", {{"megatron_cfg", {{"pipeline_model_parallel_size", 2}}}}, 2},
      {"ep2", "megatron", "qwen3-moe-tiny", {{"megatron_cfg", ep2}}, 2},
      {"fsdp2", "dtensor", "llama-tiny", json::object(), 2},
      {"fsdp4", "dtensor", "qwen3-moe-tiny", json::object(), 4},
      {"hsdp2x2", "dtensor", "llama-tiny", {{"dtensor_cfg", {{"dp_replicate_size", 2}}}}, 4},
      {"ddp2_distopt", "megatron", "llama-tiny",
       {{"megatron_cfg",
         {{"optimizer",
           {{"optimizer", "sgd"}, {"lr", 1.0}, {"sgd_momentum", 0.0}, {"weight_decay", 0.0}, {"clip_grad", 0.0},
            {"use_distributed_optimizer", true}}}}}},
       2},
      {"cp2", "megatron", "llama-tiny", {{"megatron_cfg", {{"context_parallel_size", 2}}}}, 2},
      {"tp2_pp2", "megatron", "llama-tiny",
       {{"megatron_cfg", {{"tensor_model_parallel_size", 2}, {"pipeline_model_parallel_size", 2}}}}, 4},
      {"tp4_ep2_etp2", "megatron", "qwen3-moe-tiny", {{"megatron_cfg", etp}}, 4},
  };
}

struct Placement {
  std::string name;
  std::vector<int64_t> global, offset, extent;
  uint32_t flags = 0;
  bool operator==(const Placement&) const = default;
};

struct Visit {
  std::map<std::string, std::vector<float>>* whole = nullptr;
  std::map<std::string, std::vector<int64_t>>* shapes = nullptr;
  std::map<std::string, std::vector<float>>* cover = nullptr;
  std::vector<Placement> seen;
  std::vector<std::string> errors;
};

rlh_status* on_piece(void* user, const rlh_weight_piece* p) {
  auto* v = static_cast<Visit*>(user);
  const rlh_tensor& t = *p->data;
  Placement pl{p->hf_name, {p->global_shape, p->global_shape + t.ndim}, {p->offset, p->offset + t.ndim},
               {t.shape, t.shape + t.ndim}, p->flags};
  v->seen.push_back(pl);
  auto w = v->whole->find(pl.name);
  if (w == v->whole->end()) {
    v->errors.push_back(pl.name + ": not a weight visit_weights names");
    return nullptr;
  }
  if ((*v->shapes)[pl.name] != pl.global) {
    v->errors.push_back(pl.name + ": global shape differs from visit_weights'");
    return nullptr;
  }
  // Every element of the piece against the whole tensor at its place.
  const int64_t bad = compare_piece(*p, w->second, (*v->cover)[pl.name]);
  if (bad > 0) v->errors.push_back(pl.name + ": " + std::to_string(bad) + " elements differ from the gathered weight");
  return nullptr;
}

// A flat range of a row-major tensor as boxes (how an FSDP rank names its shard of a tensor):
// the boxes' elements, box by box in row-major order, are the range's, in order, for every range
// of a few shapes; at most 2 * ndim - 1 boxes.
TEST(FlatRangeBoxes, AreTheRangeInOrder) {
  for (const std::vector<int64_t>& shape : std::vector<std::vector<int64_t>>{{}, {7}, {3, 4}, {2, 3, 5}, {2, 1, 3, 2}}) {
    const int64_t n = sdk::box_elems(shape);
    const std::vector<int64_t> st = sdk::row_major_strides(shape);
    for (int64_t b = 0; b <= n; ++b)
      for (int64_t e = b; e <= n; ++e) {
        std::vector<int64_t> got;
        const std::vector<sdk::EngineBox> boxes = sdk::flat_range_boxes(shape, b, e);
        for (const sdk::EngineBox& box : boxes) {
          ASSERT_EQ(box.stored, shape);
          const int64_t m = sdk::box_elems(box.count);
          ASSERT_GT(m, 0) << "an empty box";
          for (int64_t k = 0; k < m; ++k) {
            int64_t rest = k, flat = 0;
            for (size_t d = shape.size(); d-- > 0;) {
              flat += (box.lo[d] + rest % box.count[d]) * st[d];
              rest /= box.count[d];
            }
            got.push_back(flat);
          }
        }
        std::vector<int64_t> want;
        for (int64_t f = b; f < e; ++f) want.push_back(f);
        EXPECT_EQ(got, want) << "shape of " << shape.size() << " dims, range [" << b << ", " << e << ")";
        EXPECT_LE(boxes.size(), std::max<size_t>(1, 2 * shape.size() - 1));
      }
  }
  EXPECT_THROW(sdk::flat_range_boxes({3, 4}, 5, 13), std::invalid_argument);
  EXPECT_THROW(sdk::flat_range_boxes({3, 4}, 6, 5), std::invalid_argument);
}

TEST(WeightPieces, TileEveryWeightOnceAndMatchTheGatheredWeights) {
  const int N = world().size();
  int ran = 0;
  for (const Case& c : cases()) {
    if (c.ranks != N) continue;
    ++ran;
    SCOPED_TRACE(c.name);
    Backend be(host(), c.backend.c_str(), c.config);
    rlh_model* m = be.load(model_path(c.model), true);
    ASSERT_TRUE(RLH_HAS_FIELD(be.api(), rlh_backend_api, visit_weight_pieces) && be.api()->visit_weight_pieces);
    std::map<std::string, std::vector<float>> whole = be.weights(m);  // gathered, on every rank
    std::map<std::string, std::vector<int64_t>> shapes;
    sdk::check(be.api()->visit_weights(
                   be.raw(), m,
                   [](void* u, const char* name, const rlh_tensor* t) -> rlh_status* {
                     (*static_cast<std::map<std::string, std::vector<int64_t>>*>(u))[name].assign(t->shape, t->shape + t->ndim);
                     return nullptr;
                   },
                   &shapes, nullptr),
               "visit_weights");
    std::map<std::string, std::vector<float>> cover;
    for (const auto& [name, w] : whole) cover[name].assign(w.size(), 0.f);
    Visit first{&whole, &shapes, &cover, {}, {}};
    int64_t version = -1;
    sdk::check(be.api()->visit_weight_pieces(be.raw(), m, on_piece, &first, &version), "visit_weight_pieces");
    EXPECT_EQ(version, 0);
    for (const std::string& e : first.errors) ADD_FAILURE() << "rank " << world().rank() << ": " << e;
    // The placements do not change from call to call.
    std::map<std::string, std::vector<float>> cover2;
    Visit second{&whole, &shapes, &cover2, {}, {}};
    sdk::check(be.api()->visit_weight_pieces(be.raw(), m, on_piece, &second, nullptr), "visit_weight_pieces");
    EXPECT_TRUE(first.seen == second.seen);
    // Over the world, the senders' pieces cover every element once.
    for (auto& [name, cv] : cover) {
      sum_over_world(cv);
      int64_t off = 0;
      for (float x : cv) off += x != 1.f;
      EXPECT_EQ(off, 0) << name << ": elements not covered exactly once by the senders' pieces";
    }
    // No gather: under model parallelism every rank holds less than the whole model (a slice, a
    // stage, a block of experts); replicas (one rank, DP, CP) hold all of it.
    int64_t held = 0, sent = 0, all = 0;
    for (const Placement& p : first.seen) {
      held += sdk::box_elems(p.extent);
      if (p.flags & RLH_PIECE_SENDER) sent += sdk::box_elems(p.extent);
    }
    for (const auto& [name, w] : whole) all += int64_t(w.size());
    const bool replica = c.name == "one_rank" || c.name == "ddp2_distopt" || c.name == "cp2";
    if (c.backend == "dtensor") {
      // FSDP: exactly this rank's flat shard, as it lies. Each unit is cut into S equal blocks
      // (the last ones short), so a rank holds all / S elements give or take S per unit (fewer
      // units than HF tensors); HSDP's replicas of a shard send half of it each.
      const int S = c.name == "hsdp2x2" ? N / 2 : N;
      const int64_t slack = int64_t(whole.size()) * S;
      EXPECT_LE(std::abs(held - all / S), slack) << "rank " << world().rank() << " holds " << held << " of " << all
                                                 << " elements: not its 1/" << S << " shard";
      if (S == N) EXPECT_EQ(sent, held) << "rank " << world().rank() << ": FSDP without replicas sends all it holds";
      else EXPECT_LT(sent, held) << "rank " << world().rank() << ": HSDP replicas share the sending";
    } else if (replica) {
      EXPECT_EQ(held, all) << "rank " << world().rank();
    } else {
      EXPECT_LT(held, all) << "rank " << world().rank();
    }
  }
  if (ran == 0) GTEST_SKIP() << "no layout for " << N << " ranks";
}

}  // namespace
}  // namespace rlh::test

int main(int argc, char** argv) {
  return rlh::test::run_mpi_tests(argc, argv, {"model_llama", "kernels_cpu", "megatron", "dtensor", "comm_mpi"});
}
