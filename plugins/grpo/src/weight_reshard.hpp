// The resharding refit of non-colocated generation (NeMo-RL's nccl_reshard; generation_ranks.hpp
// runs it, docs/parallelism.md describes it): every trainer rank sends each generator rank
// exactly the intersection of its own weight pieces (BACKEND 0.5's visit_weight_pieces) with
// what that generator rank needs (its tensor-parallel box of every HF tensor, or every tensor
// whole), point to point; nothing is gathered.
//
// The plan is made once, at the first refit: every trainer rank's pieces (placements only) and
// every generator rank's needs meet at trainer rank 0, which hands the whole table to every
// rank; each side then derives the same transfers from it (segments in piece order, then need
// order), so only weight bytes move afterwards.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "components.hpp"
#include "rlhost/sdk/model_desc.hpp"
#include "rlhost/sdk/plugin.hpp"

namespace rlh::grpo {

// A box of an HF tensor: a trainer rank's piece or a generator rank's need.
struct WeightBox {
  std::string name;
  rlh_dtype dtype{};  // a piece's (the backend's); a need takes its pieces'
  std::vector<int64_t> global, offset, extent;
  size_t elem_bytes() const { return (size_t(dtype.bits) * dtype.lanes + 7) / 8; }
};

// This trainer rank's pieces to send (those marked RLH_PIECE_SENDER), copied row-major.
struct OwnPieces {
  std::vector<WeightBox> boxes;
  std::vector<std::vector<char>> data;
  int64_t version = -1;
};
OwnPieces collect_pieces(Backend& backend, rlh_model* model);

// A generator rank's needs: its tensor-parallel boxes of the model `desc` describes (the
// generator's own plan: sdk::make_tp_layout, sdk::tp_box, sdk::hf_box), rank `rank` of `size`.
// Size 1 needs every tensor whole: an empty list with whole = true.
struct Needs {
  bool whole = false;
  std::vector<WeightBox> boxes;
};
Needs tensor_parallel_needs(const sdk::TransformerDesc& desc, int size, int rank);
// The description of the model folder `dir` from the host's MODEL component (as the generator
// plugin makes it; `component` names one, empty: the one listing the config's architecture).
sdk::TransformerDesc describe_model(const sdk::Host& host, const std::string& dir, const std::string& component);

nlohmann::json to_json(const std::vector<WeightBox>& boxes);
nlohmann::json to_json(const Needs& needs);

class ReshardPlan {
 public:
  // From trainer rank 0's table: {"pieces": [per trainer rank], "needs": [per generator rank]}.
  // Whole needs become every piece's tensor whole; each need takes its pieces' dtype. Throws
  // naming a need no piece covers or whose shape differs from the pieces'.
  explicit ReshardPlan(const nlohmann::json& table);
  int trainers() const { return int(pieces_.size()); }
  int generators() const { return int(needs_.size()); }
  const std::vector<WeightBox>& needs(int g) const { return needs_[size_t(g)]; }
  // Bytes trainer t sends generator rank g.
  int64_t bytes(int t, int g) const;
  // What trainer t sends generator rank g, packed (its own pieces, in the plan's order).
  std::vector<char> pack(int t, int g, const OwnPieces& own) const;
  // Unpacks trainer t's message to generator rank g into `bufs` (one row-major buffer per need,
  // of the need's bytes, the caller's) and counts the elements written per need into `got`.
  void unpack(int t, int g, const std::vector<char>& bytes, const std::vector<char*>& bufs, std::vector<int64_t>& got) const;

 private:
  struct Segment {
    int piece = 0, need = 0;
    std::vector<int64_t> offset, extent;  // in the whole tensor
    size_t bytes = 0;
  };
  const std::vector<Segment>& segments(int t, int g) const { return segs_[size_t(t) * needs_.size() + size_t(g)]; }
  std::vector<std::vector<WeightBox>> pieces_, needs_;
  std::vector<std::vector<Segment>> segs_;  // [t * generators + g]
};

}  // namespace rlh::grpo
