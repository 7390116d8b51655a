// The resharding refit's pieces, needs and plan (weight_reshard.hpp).
#include "weight_reshard.hpp"

#include <algorithm>
#include <cstring>
#include <map>

#include "rlhost/model.h"
#include "rlhost/sdk/describe_model.hpp"
#include "rlhost/sdk/input_file.hpp"
#include "rlhost/sdk/status.hpp"
#include "rlhost/sdk/tensor_parallel.hpp"
#include "rlhost/sdk/weight_pieces.hpp"

namespace rlh::grpo {

using json = nlohmann::json;
using sdk::Error;

namespace {

rlh_status* keep_piece_or_throw(void* user, const rlh_weight_piece* p) {
  auto* own = static_cast<OwnPieces*>(user);
  if (p == nullptr || p->hf_name == nullptr || p->data == nullptr || p->global_shape == nullptr || p->offset == nullptr)
    return sdk::make_local_status(RLH_E_INVALID_ARGUMENT, "refit: a weight piece without a name, data or placement");
  if (!(p->flags & RLH_PIECE_SENDER)) return nullptr;  // another rank sends this copy
  const rlh_tensor& t = *p->data;
  if (t.device.device_type != RLH_DEVICE_CPU)
    return sdk::make_local_status(RLH_E_INVALID_ARGUMENT, std::string("refit: piece of ") + p->hf_name + " is not in host memory");
  WeightBox b;
  b.name = p->hf_name;
  b.dtype = t.dtype;
  b.global.assign(p->global_shape, p->global_shape + t.ndim);
  b.offset.assign(p->offset, p->offset + t.ndim);
  b.extent.assign(t.shape, t.shape + t.ndim);
  for (int d = 0; d < t.ndim; ++d)
    if (b.offset[size_t(d)] < 0 || b.extent[size_t(d)] < 0 || b.offset[size_t(d)] + b.extent[size_t(d)] > b.global[size_t(d)])
      return sdk::make_local_status(RLH_E_INVALID_ARGUMENT, "refit: piece of " + b.name + " lies outside the tensor");
  const size_t es = b.elem_bytes();
  std::vector<char> data(size_t(sdk::box_elems(b.extent)) * es);
  const std::vector<int64_t> dst = sdk::row_major_strides(b.extent);
  const std::vector<int64_t> src = t.strides != nullptr ? std::vector<int64_t>(t.strides, t.strides + t.ndim) : dst;
  if (!data.empty())
    sdk::copy_box(static_cast<const char*>(t.data) + t.byte_offset, src.data(), data.data(), dst.data(), b.extent.data(),
                  t.ndim, es);
  own->boxes.push_back(std::move(b));
  own->data.push_back(std::move(data));
  return nullptr;
}

rlh_status* keep_piece(void* user, const rlh_weight_piece* p) {
  try {
    return keep_piece_or_throw(user, p);
  } catch (const std::exception& e) {
    return sdk::make_local_status(RLH_E_INTERNAL, std::string("refit: keeping a weight piece: ") + e.what());
  }
}

std::string dtype_text(const rlh_dtype& d) {
  return std::to_string(d.code) + "," + std::to_string(d.bits) + "," + std::to_string(d.lanes);
}

rlh_dtype dtype_of(const std::string& s, const std::string& name) {
  unsigned code = 0, bits = 0, lanes = 0;
  if (std::sscanf(s.c_str(), "%u,%u,%u", &code, &bits, &lanes) != 3 || bits == 0 || lanes == 0)
    throw Error(RLH_E_DATA_LOSS, "refit plan: weight '" + name + "' has dtype '" + s + "'");
  return rlh_dtype{uint8_t(code), uint8_t(bits), uint16_t(lanes)};
}

std::vector<WeightBox> boxes_of(const json& j) {
  std::vector<WeightBox> out;
  for (const json& e : j) {
    WeightBox b;
    b.name = e.at("name").get<std::string>();
    if (e.contains("dtype")) b.dtype = dtype_of(e.at("dtype").get<std::string>(), b.name);
    if (e.contains("global")) b.global = e.at("global").get<std::vector<int64_t>>();
    b.offset = e.at("offset").get<std::vector<int64_t>>();
    b.extent = e.at("extent").get<std::vector<int64_t>>();
    if (b.offset.size() != b.extent.size())
      throw Error(RLH_E_DATA_LOSS, "refit plan: weight '" + b.name + "' has a box of mixed ranks");
    out.push_back(std::move(b));
  }
  return out;
}

}  // namespace

OwnPieces collect_pieces(Backend& backend, rlh_model* model) {
  OwnPieces own;
  own.version = backend.visit_weight_pieces(model, keep_piece, &own);
  return own;
}

Needs tensor_parallel_needs(const sdk::TransformerDesc& desc, int size, int rank) {
  Needs n;
  if (size <= 1) {
    n.whole = true;
    return n;
  }
  sdk::TpLayout L;
  try {
    L = sdk::make_tp_layout(desc, size, rank, "policy.generation.vllm_cfg.tensor_parallel_size");
  } catch (const std::invalid_argument& e) {
    throw Error(RLH_E_UNIMPLEMENTED, std::string("refit: ") + e.what());
  }
  for (size_t i = 0; i < desc.params.size(); ++i) {
    const sdk::ParamDesc& p = desc.params[i];
    const sdk::EngineBox box = sdk::tp_box(L, i);
    for (size_t k = 0; k < p.hf_names.size(); ++k) {
      const sdk::HfBox h = sdk::hf_box(p, k, box);
      if (!h.present) continue;
      n.boxes.push_back(WeightBox{p.hf_names[k], {}, p.hf_shapes[k], h.offset, h.extent});
    }
  }
  return n;
}

sdk::TransformerDesc describe_model(const sdk::Host& host, const std::string& dir, const std::string& component) {
  return sdk::describe_model_folder(host, dir, component, "refit");
}

json to_json(const std::vector<WeightBox>& boxes) {
  json a = json::array();
  for (const WeightBox& b : boxes) {
    json e = {{"name", b.name}, {"global", b.global}, {"offset", b.offset}, {"extent", b.extent}};
    if (b.dtype.bits != 0) e["dtype"] = dtype_text(b.dtype);
    a.push_back(std::move(e));
  }
  return a;
}

json to_json(const Needs& needs) { return json{{"whole", needs.whole}, {"boxes", to_json(needs.boxes)}}; }

ReshardPlan::ReshardPlan(const json& table) {
  for (const json& t : table.at("pieces")) pieces_.push_back(boxes_of(t));
  // Every tensor's dtype and shape from its pieces (the first one that names it).
  std::map<std::string, const WeightBox*> first;
  std::vector<const WeightBox*> order;
  for (const auto& ps : pieces_)
    for (const WeightBox& b : ps)
      if (first.emplace(b.name, &b).second) order.push_back(&b);
  for (const json& n : table.at("needs")) {
    std::vector<WeightBox> boxes;
    if (n.at("whole").get<bool>()) {
      for (const WeightBox* b : order)
        boxes.push_back(WeightBox{b->name, b->dtype, b->global, std::vector<int64_t>(b->global.size(), 0), b->global});
    } else {
      boxes = boxes_of(n.at("boxes"));
      for (WeightBox& b : boxes) {
        auto it = first.find(b.name);
        if (it == first.end())
          throw Error(RLH_E_FAILED_PRECONDITION, "refit: generator rank " + std::to_string(needs_.size()) + " needs " + b.name +
                                                     ", which no trainer rank holds");
        if (it->second->global != b.global)
          throw Error(RLH_E_FAILED_PRECONDITION, "refit: " + b.name + ": the generator's shape differs from the trainer's");
        b.dtype = it->second->dtype;
      }
    }
    needs_.push_back(std::move(boxes));
  }
  // The segments of every (trainer, generator) pair, in piece order, then need order.
  segs_.resize(pieces_.size() * needs_.size());
  for (size_t g = 0; g < needs_.size(); ++g) {
    std::multimap<std::string, int> need_of;
    for (size_t n = 0; n < needs_[g].size(); ++n) need_of.emplace(needs_[g][n].name, int(n));
    std::vector<int64_t> covered(needs_[g].size(), 0);
    for (size_t t = 0; t < pieces_.size(); ++t)
      for (size_t p = 0; p < pieces_[t].size(); ++p) {
        const WeightBox& pc = pieces_[t][p];
        auto [lo, hi] = need_of.equal_range(pc.name);
        for (auto it = lo; it != hi; ++it) {
          const WeightBox& nd = needs_[g][size_t(it->second)];
          Segment s;
          s.piece = int(p);
          s.need = it->second;
          if (!sdk::intersect_boxes(pc.offset, pc.extent, nd.offset, nd.extent, s.offset, s.extent)) continue;
          const int64_t n = sdk::box_elems(s.extent);
          s.bytes = size_t(n) * pc.elem_bytes();
          covered[size_t(it->second)] += n;
          segs_[t * needs_.size() + g].push_back(std::move(s));
        }
      }
    for (size_t n = 0; n < needs_[g].size(); ++n)
      if (covered[n] != sdk::box_elems(needs_[g][n].extent))
        throw Error(RLH_E_FAILED_PRECONDITION, "refit: the trainer ranks' pieces cover " + std::to_string(covered[n]) + " of the " +
                                                   std::to_string(sdk::box_elems(needs_[g][n].extent)) + " elements of " +
                                                   needs_[g][n].name + " that generator rank " + std::to_string(g) + " needs");
  }
}

int64_t ReshardPlan::bytes(int t, int g) const {
  int64_t n = 0;
  for (const Segment& s : segments(t, g)) n += int64_t(s.bytes);
  return n;
}

std::vector<char> ReshardPlan::pack(int t, int g, const OwnPieces& own) const {
  if (own.boxes.size() != pieces_[size_t(t)].size())
    throw Error(RLH_E_INTERNAL, "refit: trainer rank " + std::to_string(t) + " visited " + std::to_string(own.boxes.size()) +
                                    " pieces, the plan has " + std::to_string(pieces_[size_t(t)].size()));
  std::vector<char> out(size_t(bytes(t, g)));
  size_t at = 0;
  for (const Segment& s : segments(t, g)) {
    const WeightBox& pc = own.boxes[size_t(s.piece)];
    const WeightBox& planned = pieces_[size_t(t)][size_t(s.piece)];
    if (pc.name != planned.name || pc.offset != planned.offset || pc.extent != planned.extent)
      throw Error(RLH_E_INTERNAL, "refit: the piece of " + pc.name + " moved since the plan was made");
    const size_t es = pc.elem_bytes();
    const std::vector<int64_t> src = sdk::row_major_strides(pc.extent), dst = sdk::row_major_strides(s.extent);
    int64_t first = 0;
    for (size_t d = 0; d < src.size(); ++d) first += (s.offset[d] - pc.offset[d]) * src[d];
    sdk::copy_box(own.data[size_t(s.piece)].data() + size_t(first) * es, src.data(), out.data() + at, dst.data(), s.extent.data(),
                  int(s.extent.size()), es);
    at += s.bytes;
  }
  return out;
}

void ReshardPlan::unpack(int t, int g, const std::vector<char>& bytes, const std::vector<char*>& bufs,
                         std::vector<int64_t>& got) const {
  if (int64_t(bytes.size()) != this->bytes(t, g))
    throw Error(RLH_E_DATA_LOSS, "refit: trainer rank " + std::to_string(t) + " sent " + std::to_string(bytes.size()) + " bytes, " +
                                     std::to_string(this->bytes(t, g)) + " expected");
  size_t at = 0;
  for (const Segment& s : segments(t, g)) {
    const WeightBox& nd = needs_[size_t(g)][size_t(s.need)];
    const size_t es = nd.elem_bytes();
    const std::vector<int64_t> src = sdk::row_major_strides(s.extent), dst = sdk::row_major_strides(nd.extent);
    int64_t first = 0;
    for (size_t d = 0; d < dst.size(); ++d) first += (s.offset[d] - nd.offset[d]) * dst[d];
    sdk::copy_box(bytes.data() + at, src.data(), bufs[size_t(s.need)] + size_t(first) * es, dst.data(), s.extent.data(),
                  int(s.extent.size()), es);
    got[size_t(s.need)] += sdk::box_elems(s.extent);
    at += s.bytes;
  }
}

}  // namespace rlh::grpo
