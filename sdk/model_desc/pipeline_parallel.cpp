// Pipeline parallelism's split of the layers, a stage's description and its program
// (pipeline_parallel.hpp).
#include "rlhost/sdk/pipeline_parallel.hpp"

#include <stdexcept>
#include <string>

namespace rlh::sdk {

namespace {
const std::string kFirst = "num_layers_in_first_pipeline_stage";
const std::string kLast = "num_layers_in_last_pipeline_stage";
}  // namespace

std::vector<int64_t> pp_stage_layers(int64_t L, int64_t P, const PpSplit& split, const std::string& key) {
  const std::string at = key + " = " + std::to_string(P) + ": ";
  if (P < 1) throw std::invalid_argument(key + " must be at least 1, got " + std::to_string(P));
  if (split.first < 0 || split.last < 0)
    throw std::invalid_argument(at + kFirst + " and " + kLast + " must not be negative");
  std::vector<int64_t> n(size_t(P), 0);
  if (P == 1) {
    // A one-stage pipeline holds every layer; Megatron ignores the first/last counts there.
    n[0] = L;
    return n;
  }
  // The stages without a given count share the rest evenly (Megatron's uneven split).
  int64_t rest = L, free = P;
  if (split.first > 0) rest -= split.first, --free, n[0] = split.first;
  if (split.last > 0) rest -= split.last, --free, n[size_t(P) - 1] = split.last;
  const std::string counts = std::to_string(L) + " layers" + (split.first > 0 ? ", " + kFirst + " = " + std::to_string(split.first) : "") +
                             (split.last > 0 ? ", " + kLast + " = " + std::to_string(split.last) : "");
  if (rest < 0 || (free == 0 && rest != 0) || (free > 0 && (rest % free != 0 || rest / free == 0)))
    throw std::invalid_argument(at + "the layers do not split over the stages (" + counts + ": " +
                                (free > 0 ? std::to_string(rest) + " left for " + std::to_string(free) + " stages"
                                          : std::to_string(rest) + " left over") +
                                ")");
  for (int64_t s = 0; s < P; ++s)
    if (n[size_t(s)] == 0) n[size_t(s)] = rest / free;
  return n;
}

std::string pp_unsupported(const TransformerDesc& desc, int64_t size, const PpSplit& split, const std::string& key) {
  if (size <= 1) return {};
  const std::string at = key + " = " + std::to_string(size) + ": ";
  try {
    pp_stage_layers(desc.num_layers, size, split, key);
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return {};
}

PpLayout make_pp_layout(const TransformerDesc& desc, int64_t size, int64_t rank, const PpSplit& split,
                        const std::string& key) {
  if (const std::string why = pp_unsupported(desc, size, split, key); !why.empty()) throw std::invalid_argument(why);
  if (rank < 0 || rank >= size)
    throw std::invalid_argument("pipeline stage " + std::to_string(rank) + " of " + std::to_string(size));
  PpLayout L;
  L.size = size;
  L.rank = rank;
  L.first = rank == 0;
  L.last = rank == size - 1;
  L.stage_layers = pp_stage_layers(desc.num_layers, size, split, key);
  for (int64_t s = 0; s < rank; ++s) L.layer_begin += L.stage_layers[size_t(s)];
  L.layer_count = L.stage_layers[size_t(rank)];
  const int64_t end = L.layer_begin + L.layer_count;
  const bool tied = desc.tie_word_embeddings;
  L.shares_embedding = tied && size > 1 && (L.first || L.last);

  // Owners: a layer's tensors belong to its stage; the embedding to the first, the final norm
  // and the head to the last.
  std::vector<int64_t> stage_of_layer(size_t(desc.num_layers), 0);
  for (int64_t s = 0, l = 0; s < size; ++s)
    for (int64_t k = 0; k < L.stage_layers[size_t(s)]; ++k) stage_of_layer[size_t(l++)] = s;
  L.owner.assign(desc.params.size(), 0);
  L.local_index.assign(desc.params.size(), -1);
  TransformerDesc& loc = L.local;
  loc = desc;
  loc.params.clear();
  loc.layers.assign(desc.layers.begin() + L.layer_begin, desc.layers.begin() + end);
  for (size_t k = 0; k < loc.layers.size(); ++k) loc.layers[k].index = int64_t(k);
  for (int64_t l = 0; l < desc.num_layers; ++l) {
    const LayerDesc& ld = desc.layers[size_t(l)];
    if (ld.mlp.kind != MlpKind::moe) continue;
    if (l < L.layer_begin) L.route_begin += ld.mlp.moe.top_k;
    L.route_total += ld.mlp.moe.top_k;
  }
  loc.num_layers = L.layer_count;
  for (size_t i = 0; i < desc.params.size(); ++i) {
    const ParamDesc& p = desc.params[i];
    bool here = false;
    if (p.layer >= 0) {
      L.owner[i] = stage_of_layer.at(size_t(p.layer));
      here = p.layer >= L.layer_begin && p.layer < end;
    } else if (p.role == ParamRole::embed) {
      L.owner[i] = 0;
      here = L.first || (L.last && tied);
    } else {
      L.owner[i] = size - 1;  // final norm, lm_head, a value head (score.weight)
      here = L.last;
    }
    if (!here) continue;
    ParamDesc q = p;
    if (q.layer >= 0) q.layer -= L.layer_begin;
    L.local_index[i] = int64_t(loc.params.size());
    L.full_index.push_back(int64_t(i));
    if (p.role == ParamRole::embed) L.embed_local = int64_t(loc.params.size());
    loc.params.push_back(std::move(q));
  }
  return L;
}

}  // namespace rlh::sdk
