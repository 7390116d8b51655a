// Where a rank's part of an engine parameter lies in the HF tensors the parameter is made of, as
// boxes (an offset and an extent per dimension), and the box arithmetic a resharding refit needs:
// BACKEND 0.5's visit_weight_pieces names each rank's pieces this way, and the non-colocated
// GRPO refit sends each generator rank exactly the intersection of a trainer rank's piece with
// what that rank needs (NeMo-RL's nccl_reshard; docs/parallelism.md).
//
// Why boxes: every cut the engines make (tensor parallelism's rows, columns and vocabulary
// blocks, expert parallelism's blocks of experts, the stacking of experts and the concatenation
// of fused projections) keeps a rank's part of an HF tensor rectangular, so a box names it
// exactly and two boxes intersect in a box. FSDP's flat shards are not rectangular, but each is a
// few boxes (flat_range_boxes).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "rlhost/sdk/model_desc.hpp"
#include "rlhost/sdk/tensor_parallel.hpp"

namespace rlh::sdk {

// A rank's part of an engine parameter: [lo[d], lo[d] + count[d]) of the whole engine tensor
// (desc shape) in every dimension d, stored row-major with `stored` elements per dimension
// (stored[d] > count[d] only for a padded vocabulary block, whose extra rows are padding).
struct EngineBox {
  std::vector<int64_t> lo, count, stored;
};
// The whole tensor of p.
EngineBox whole_box(const ParamDesc& p);
// Tensor parallelism's part of parameter i on layout L's rank (L.full.params[i]).
EngineBox tp_box(const TpLayout& L, size_t i);

// The elements [begin, end) of a row-major tensor of `shape` as boxes, in storage order: FSDP
// shards the flat storage across tensor boundaries, and a flat range of a tensor is a partial
// first row, whole rows and a partial last row, each partial row the same cut one dimension in
// (at most 2 * ndim - 1 boxes). Each box's `stored` is `shape`: its elements lie where they do in
// the whole tensor's storage, which the range's storage is a contiguous part of. Throws on a
// range outside the tensor.
std::vector<EngineBox> flat_range_boxes(const std::vector<int64_t>& shape, int64_t begin, int64_t end);

// HF piece k of parameter p as far as `box` holds it: the box of the HF tensor (offset and
// extent per HF dimension, over p.hf_shapes[k]) and where it lies in the box's storage (its first
// element `at` and the strides per HF dimension, in elements). present: the box holds some of it.
struct HfBox {
  bool present = false;
  std::vector<int64_t> offset, extent, strides;
  int64_t at = 0;
};
HfBox hf_box(const ParamDesc& p, size_t k, const EngineBox& box);

// The intersection of boxes a and b of one tensor (offsets and extents of equal length) into
// (offset, extent); false when it is empty.
bool intersect_boxes(const std::vector<int64_t>& a_offset, const std::vector<int64_t>& a_extent,
                     const std::vector<int64_t>& b_offset, const std::vector<int64_t>& b_extent,
                     std::vector<int64_t>& offset, std::vector<int64_t>& extent);
// Elements of a box.
int64_t box_elems(const std::vector<int64_t>& extent);
// Row-major strides (in elements) of a shape.
std::vector<int64_t> row_major_strides(const std::vector<int64_t>& shape);

// Copies an `extent` box of elements of `esize` bytes from `src` (strides in elements) to `dst`
// (strides in elements), the innermost dimension with one memcpy where both are contiguous.
void copy_box(const void* src, const int64_t* src_strides, void* dst, const int64_t* dst_strides,
              const int64_t* extent, int ndim, size_t esize);

}  // namespace rlh::sdk
