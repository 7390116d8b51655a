// Boxes of HF tensors (weight_pieces.hpp).
#include "rlhost/sdk/weight_pieces.hpp"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

namespace rlh::sdk {

std::vector<int64_t> row_major_strides(const std::vector<int64_t>& shape) {
  std::vector<int64_t> s(shape.size(), 1);
  for (size_t d = shape.size(); d-- > 1;) s[d - 1] = s[d] * shape[d];
  return s;
}

int64_t box_elems(const std::vector<int64_t>& extent) {
  int64_t n = 1;
  for (int64_t e : extent) n *= e;
  return n;
}

EngineBox whole_box(const ParamDesc& p) {
  EngineBox b;
  b.lo.assign(p.shape.size(), 0);
  b.count = b.stored = p.shape;
  return b;
}

EngineBox tp_box(const TpLayout& L, size_t i) {
  EngineBox b = whole_box(L.full.params.at(i));
  const TpPiece& pc = L.pieces.at(i);
  const size_t a = size_t(pc.axis);
  if (a >= b.lo.size()) throw std::invalid_argument("tp_box: parameter " + L.full.params[i].name + " has no axis " + std::to_string(a));
  b.lo[a] = pc.begin;
  b.count[a] = pc.count;
  b.stored[a] = pc.extent;
  return b;
}

namespace {

// [begin, end) of the tensor `shape[d:]` at the index `lo[:d]` (fixed, count 1) into `out`.
void flat_boxes(const std::vector<int64_t>& shape, size_t d, int64_t begin, int64_t end, std::vector<int64_t>& lo,
                std::vector<EngineBox>& out) {
  if (begin >= end) return;
  const size_t nd = shape.size();
  EngineBox b;
  b.stored = shape;
  if (d == nd) {  // one element (a scalar's, or the innermost index fixed)
    b.lo = lo;
    b.count.assign(nd, 1);
    out.push_back(std::move(b));
    return;
  }
  int64_t inner = 1;  // elements of one index of dimension d
  for (size_t k = d + 1; k < nd; ++k) inner *= shape[k];
  int64_t first = begin / inner, last = (end - 1) / inner;  // indices of dimension d touched
  if (first == last) {                                      // within one index: one dimension in
    lo[d] = first;
    flat_boxes(shape, d + 1, begin - first * inner, end - first * inner, lo, out);
    lo[d] = 0;
    return;
  }
  if (begin % inner != 0) {  // the partial first row
    lo[d] = first;
    flat_boxes(shape, d + 1, begin % inner, inner, lo, out);
    ++first;
  }
  const bool partial_last = end % inner != 0;
  const int64_t whole_end = partial_last ? last : last + 1;
  if (first < whole_end) {  // whole rows
    b.lo = lo;
    b.count.assign(nd, 1);
    b.lo[d] = first;
    b.count[d] = whole_end - first;
    for (size_t k = d + 1; k < nd; ++k) b.count[k] = shape[k];
    out.push_back(std::move(b));
  }
  if (partial_last) {  // the partial last row
    lo[d] = last;
    flat_boxes(shape, d + 1, 0, end % inner, lo, out);
  }
  lo[d] = 0;
}

}  // namespace

std::vector<EngineBox> flat_range_boxes(const std::vector<int64_t>& shape, int64_t begin, int64_t end) {
  int64_t n = 1;
  for (int64_t e : shape) {
    if (e < 0) throw std::invalid_argument("flat_range_boxes: a negative extent");
    n *= e;
  }
  if (begin < 0 || end > n || begin > end)
    throw std::invalid_argument("flat_range_boxes: range [" + std::to_string(begin) + ", " + std::to_string(end) +
                                ") outside a tensor of " + std::to_string(n) + " elements");
  std::vector<EngineBox> out;
  std::vector<int64_t> lo(shape.size(), 0);
  flat_boxes(shape, 0, begin, end, lo, out);
  return out;
}

HfBox hf_box(const ParamDesc& p, size_t k, const EngineBox& box) {
  if (k >= p.hf_shapes.size()) throw std::invalid_argument("hf_box: parameter " + p.name + " has no HF piece " + std::to_string(k));
  const size_t nd = p.shape.size();
  if (box.lo.size() != nd || box.count.size() != nd || box.stored.size() != nd)
    throw std::invalid_argument("hf_box: a box of the wrong rank for parameter " + p.name);
  const std::vector<int64_t> st = row_major_strides(box.stored);
  HfBox h;
  switch (p.transform) {
    case ParamTransform::none:
      h.offset = box.lo;
      h.extent = box.count;
      h.strides = st;
      break;
    case ParamTransform::stack: {  // engine [K, hf...]: piece k is index k of axis 0
      const int64_t kk = int64_t(k);
      if (kk < box.lo[0] || kk >= box.lo[0] + box.count[0]) return h;
      h.at = (kk - box.lo[0]) * st[0];
      h.offset.assign(box.lo.begin() + 1, box.lo.end());
      h.extent.assign(box.count.begin() + 1, box.count.end());
      h.strides.assign(st.begin() + 1, st.end());
      break;
    }
    case ParamTransform::concat: {  // piece k is [before, before + len) along the axis
      const size_t c = size_t(p.axis);
      int64_t before = 0;
      for (size_t j = 0; j < k; ++j) before += p.hf_shapes[j][c];
      const int64_t len = p.hf_shapes[k][c];
      const int64_t b = std::max(box.lo[c], before), e = std::min(box.lo[c] + box.count[c], before + len);
      if (b >= e) return h;
      h.offset = box.lo;
      h.extent = box.count;
      h.strides = st;
      h.offset[c] = b - before;
      h.extent[c] = e - b;
      h.at = (b - box.lo[c]) * st[c];
      break;
    }
  }
  if (h.extent.size() != p.hf_shapes[k].size())
    throw std::invalid_argument("hf_box: parameter " + p.name + ": HF piece " + p.hf_names[k] + " does not match its engine shape");
  h.present = box_elems(h.extent) > 0;
  return h;
}

bool intersect_boxes(const std::vector<int64_t>& ao, const std::vector<int64_t>& ae, const std::vector<int64_t>& bo,
                     const std::vector<int64_t>& be, std::vector<int64_t>& offset, std::vector<int64_t>& extent) {
  if (ao.size() != ae.size() || bo.size() != be.size() || ao.size() != bo.size())
    throw std::invalid_argument("intersect_boxes: boxes of different ranks");
  offset.assign(ao.size(), 0);
  extent.assign(ao.size(), 0);
  for (size_t d = 0; d < ao.size(); ++d) {
    const int64_t b = std::max(ao[d], bo[d]), e = std::min(ao[d] + ae[d], bo[d] + be[d]);
    if (b >= e) return false;
    offset[d] = b;
    extent[d] = e - b;
  }
  return true;
}

void copy_box(const void* src, const int64_t* ss, void* dst, const int64_t* ds, const int64_t* extent, int nd,
              size_t esize) {
  if (nd == 0) {
    std::memcpy(dst, src, esize);
    return;
  }
  const auto* s = static_cast<const unsigned char*>(src);
  auto* d = static_cast<unsigned char*>(dst);
  if (nd == 1) {
    if (ss[0] == 1 && ds[0] == 1) {
      std::memcpy(d, s, size_t(extent[0]) * esize);
      return;
    }
    for (int64_t i = 0; i < extent[0]; ++i) std::memcpy(d + size_t(i * ds[0]) * esize, s + size_t(i * ss[0]) * esize, esize);
    return;
  }
  for (int64_t i = 0; i < extent[0]; ++i)
    copy_box(s + size_t(i * ss[0]) * esize, ss + 1, d + size_t(i * ds[0]) * esize, ds + 1, extent + 1, nd - 1, esize);
}

}  // namespace rlh::sdk
