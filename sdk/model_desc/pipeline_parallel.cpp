// Pipeline parallelism's split of the layers, a stage's description and its program
// (pipeline_parallel.hpp).
#include "rlhost/sdk/pipeline_parallel.hpp"

#include <stdexcept>
#include <string>

namespace rlh::sdk {

namespace {
const std::string kFirst = "num_layers_in_first_pipeline_stage";
const std::string kLast = "num_layers_in_last_pipeline_stage";
const std::string kVirtual = "virtual_pipeline_model_parallel_size";

// Layers of each virtual stage (P x V of them, v = c P + s): Megatron's even split.
std::vector<int64_t> virtual_stage_layers(int64_t L, int64_t P, const PpSplit& split, const std::string& key) {
  const int64_t V = split.virtual_size;
  // The virtual key next to the pipeline's (policy.megatron_cfg.virtual_...).
  const size_t cut = key.rfind("pipeline_model_parallel_size");
  const std::string vkey = (cut == std::string::npos ? std::string() : key.substr(0, cut)) + kVirtual;
  const std::string at = vkey + " = " + std::to_string(V) + ": ";
  if (V < 1) throw std::invalid_argument(vkey + " must be at least 1, got " + std::to_string(V));
  if (V > 1 && P < 2) throw std::invalid_argument(at + "needs " + key + " > 1, got " + std::to_string(P));
  if (split.first > 0 || split.last > 0)
    throw std::invalid_argument(at + kFirst + " / " + kLast + " with interleaved virtual stages are not implemented");
  if (L % (P * V) != 0)
    throw std::invalid_argument(at + "the " + std::to_string(L) + " layers do not split into " + key + " x " + vkey +
                                " = " + std::to_string(P * V) + " model chunks");
  return std::vector<int64_t>(size_t(P * V), L / (P * V));
}
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
  if (size <= 1 && split.virtual_size == 1) return {};
  const std::string at = key + " = " + std::to_string(size) + ": ";
  try {
    if (split.virtual_size != 1) virtual_stage_layers(desc.num_layers, size, split, key);
    else pp_stage_layers(desc.num_layers, size, split, key);
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
  const int64_t V = split.virtual_size;
  L.virtual_size = V;
  // Per virtual stage its layers; virtual stage v is chunk v / size of rank v % size.
  const std::vector<int64_t> vlayers =
      V > 1 ? virtual_stage_layers(desc.num_layers, size, split, key) : pp_stage_layers(desc.num_layers, size, split, key);
  L.stage_layers.assign(size_t(size), 0);
  std::vector<int64_t> stage_of_layer(size_t(desc.num_layers), 0), local_layer(size_t(desc.num_layers), -1);
  TransformerDesc& loc = L.local;
  loc = desc;
  loc.params.clear();
  loc.layers.clear();
  for (int64_t v = 0, l = 0; v < size * V; ++v) {
    const int64_t s = v % size;
    L.stage_layers[size_t(s)] += vlayers[size_t(v)];
    if (s == rank) {
      PpLayout::Chunk c;
      c.local_begin = int64_t(loc.layers.size());
      c.count = vlayers[size_t(v)];
      c.global_begin = l;
      c.embed = v == 0;
      c.head = v == size * V - 1;
      L.chunks.push_back(c);
    }
    for (int64_t k = 0; k < vlayers[size_t(v)]; ++k, ++l) {
      stage_of_layer[size_t(l)] = s;
      if (s != rank) continue;
      local_layer[size_t(l)] = int64_t(loc.layers.size());
      loc.layers.push_back(desc.layers[size_t(l)]);
      loc.layers.back().index = local_layer[size_t(l)];
    }
  }
  L.layer_begin = L.chunks.front().global_begin;
  L.layer_count = int64_t(loc.layers.size());
  loc.num_layers = L.layer_count;
  const bool tied = desc.tie_word_embeddings;
  L.shares_embedding = tied && size > 1 && (L.first || L.last);
  // MoE routing columns: col[l] is layer l's first column in the whole record; each chunk's
  // layers are one run of them.
  std::vector<int64_t> col(size_t(desc.num_layers) + 1, 0);
  for (int64_t l = 0; l < desc.num_layers; ++l) {
    const LayerDesc& ld = desc.layers[size_t(l)];
    col[size_t(l) + 1] = col[size_t(l)] + (ld.mlp.kind == MlpKind::moe ? ld.mlp.moe.top_k : 0);
  }
  L.route_total = col.back();
  for (PpLayout::Chunk& c : L.chunks) {
    c.route_begin = col[size_t(c.global_begin)];
    c.route_count = col[size_t(c.global_begin + c.count)] - c.route_begin;
  }
  L.route_begin = L.chunks.front().route_begin;

  // Owners: a layer's tensors belong to its stage; the embedding to the first, the final norm
  // and the head to the last.
  L.owner.assign(desc.params.size(), 0);
  L.local_index.assign(desc.params.size(), -1);
  for (size_t i = 0; i < desc.params.size(); ++i) {
    const ParamDesc& p = desc.params[i];
    bool here = false;
    if (p.layer >= 0) {
      L.owner[i] = stage_of_layer.at(size_t(p.layer));
      here = local_layer.at(size_t(p.layer)) >= 0;
    } else if (p.role == ParamRole::embed) {
      L.owner[i] = 0;
      here = L.first || (L.last && tied);
    } else {
      L.owner[i] = size - 1;  // final norm, lm_head, a value head (score.weight)
      here = L.last;
    }
    if (!here) continue;
    ParamDesc q = p;
    if (q.layer >= 0) q.layer = local_layer[size_t(p.layer)];
    L.local_index[i] = int64_t(loc.params.size());
    L.full_index.push_back(int64_t(i));
    if (p.role == ParamRole::embed) L.embed_local = int64_t(loc.params.size());
    loc.params.push_back(std::move(q));
  }
  return L;
}

}  // namespace rlh::sdk
