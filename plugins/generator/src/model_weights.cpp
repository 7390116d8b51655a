// Where the generator's weights live (Weights: views of a trainer's buffers through refit, or an
// owned arena).
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <new>
#include <optional>
#include <sys/mman.h>
#include <string>

#include "rlhost/engine/engine.hpp"  // layer_param_order
#include "rlhost/generator/model.hpp"
#include "rlhost/sdk/safetensors.hpp"
#include "rlhost/sdk/status.hpp"

namespace rlh::gen {

using sdk::Error;
using sdk::ParamRole;
using sdk::ParamTransform;

namespace {

int64_t numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string shape_str(const int64_t* s, int nd) {
  std::string out = "[";
  for (int i = 0; i < nd; ++i) out += (i ? "," : "") + std::to_string(s[i]);
  return out + "]";
}


// Calls fn(engine offset, piece offset, count) for the contiguous runs of piece k of p inside the
// engine tensor (the inverse of the parameter table's transform; see model_desc.hpp).
template <class Fn>
void piece_runs(const sdk::ParamDesc& p, size_t k, Fn&& fn) {
  const std::vector<int64_t>& src = p.hf_shapes[k];
  switch (p.transform) {
    case ParamTransform::none:
      fn(int64_t(0), int64_t(0), numel(src));
      return;
    case ParamTransform::stack: {
      const int64_t n = numel(src);
      fn(int64_t(k) * n, int64_t(0), n);
      return;
    }
    case ParamTransform::concat: {
      const size_t axis = size_t(p.axis);
      int64_t before = 0, along = 0, outer = 1, rest = 1;
      for (size_t j = 0; j < p.hf_shapes.size(); ++j) {
        if (j < k) before += p.hf_shapes[j][axis];
        along += p.hf_shapes[j][axis];
      }
      for (size_t a = 0; a < axis; ++a) outer *= p.shape[a];
      for (size_t a = axis + 1; a < p.shape.size(); ++a) rest *= p.shape[a];
      const int64_t inner = src[axis] * rest;
      for (int64_t o = 0; o < outer; ++o) fn(o * along * rest + before * rest, o * inner, inner);
      return;
    }
  }
}

std::optional<sdk::st::DType> float_dtype(const rlh_dtype& d) {
  if (d.lanes != 1) return std::nullopt;
  if (d.code == RLH_DTYPE_FLOAT && d.bits == 32) return sdk::st::DType::F32;
  if (d.code == RLH_DTYPE_FLOAT && d.bits == 16) return sdk::st::DType::F16;
  if (d.code == RLH_DTYPE_FLOAT && d.bits == 64) return sdk::st::DType::F64;
  if (d.code == RLH_DTYPE_BFLOAT && d.bits == 16) return sdk::st::DType::BF16;
  return std::nullopt;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Weights

Weights::Weights(const sdk::TransformerDesc& desc) : desc_(desc) {
  const size_t n = desc.params.size();
  ptr_.assign(n, nullptr);
  piece_.resize(n);
  alias_.resize(n);
  got_.resize(n);
  got_on_device_.resize(n);
  on_device_.assign(n, 0);
  short_.assign(n, 0);
  for (size_t i = 0; i < n; ++i) {
    const sdk::ParamDesc& p = desc.params[i];
    if (p.hf_names.empty() || p.hf_names.size() != p.hf_shapes.size())
      throw Error(RLH_E_INVALID_ARGUMENT, "generator: parameter " + p.name + " needs one HF shape per HF name");
    int64_t pieces = 0;
    for (const auto& hs : p.hf_shapes) pieces += numel(hs);
    short_[i] = pieces < numel(p.shape) ? 1 : 0;
    alias_[i].assign(p.hf_names.size(), nullptr);
    piece_[i].assign(p.hf_names.size(), nullptr);
    got_[i].assign(p.hf_names.size(), 0);
    got_on_device_[i].assign(p.hf_names.size(), 0);
    pieces_total_ += int64_t(p.hf_names.size());
    for (size_t k = 0; k < p.hf_names.size(); ++k) by_name_.push_back({p.hf_names[k], Piece{i, k}});
  }
  std::sort(by_name_.begin(), by_name_.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  for (size_t i = 1; i < by_name_.size(); ++i)
    if (by_name_[i].first == by_name_[i - 1].first)
      throw Error(RLH_E_INVALID_ARGUMENT, "generator: HF tensor " + by_name_[i].first + " feeds two parameters");

  // Arena offsets in the engine's order; parameters of roles outside the lists go last.
  arena_off_.assign(n, -1);
  int64_t at = 0;
  auto place = [&](int64_t layer, ParamRole role) {
    const sdk::ParamDesc* p = desc.find_param(layer, role);
    if (!p) return;
    const size_t i = size_t(p - desc.params.data());
    if (arena_off_[i] >= 0) return;
    arena_off_[i] = at;
    at += (numel(p->shape) + 15) / 16 * 16;  // 64-byte aligned starts
  };
  for (int64_t l = 0; l < desc.num_layers; ++l)
    // the engine's storage order (engine.hpp), so views of a colocated engine line up
    for (ParamRole r : engine::layer_param_order()) place(l, r);
  for (ParamRole r : engine::global_param_order()) place(-1, r);
  for (size_t i = 0; i < n; ++i)
    if (arena_off_[i] < 0) {
      arena_off_[i] = at;
      at += (numel(desc.params[i].shape) + 15) / 16 * 16;
    }
  arena_floats_ = at;
  // q|k|v and gate|up must stay adjacent for the fused products: no padding between them.
  // (Their sizes are multiples of 16 floats in practice; when not, the model falls back to
  // separate products because the pointers are then not adjacent.)
}

Weights::~Weights() { std::free(arena_); }

void Weights::ensure_arena() {
  if (arena_) return;
  // Decoding streams every weight once per step: on 2 MiB pages (transparent huge pages, asked
  // for with madvise, which is the common system default) the walk through hundreds of MiB
  // costs far fewer TLB misses (measured: a [32000, 768] GEMV from DRAM ~30% faster).
  constexpr size_t kHuge = size_t(2) << 20;
  const size_t bytes = std::max(kHuge, (size_t(arena_floats_) * sizeof(float) + kHuge - 1) / kHuge * kHuge);
  arena_ = static_cast<float*>(std::aligned_alloc(kHuge, bytes));
  if (!arena_) throw std::bad_alloc();
  // A padded vocabulary block's padding rows are never written: they stay zero, as tp_slice
  // leaves them (the executors drop their logits).
  if (std::find(short_.begin(), short_.end(), uint8_t(1)) != short_.end()) std::memset(arena_, 0, bytes);
  madvise(arena_, bytes, MADV_HUGEPAGE);  // advice only: without THP it changes nothing
}

int64_t Weights::owned_bytes() const { return arena_ ? arena_floats_ * int64_t(sizeof(float)) : 0; }

void Weights::load(const std::vector<std::vector<float>>& tensors, int64_t version) {
  if (tensors.size() != desc_.params.size())
    throw Error(RLH_E_INVALID_ARGUMENT, "generator: " + std::to_string(tensors.size()) + " tensors given for " +
                                            std::to_string(desc_.params.size()) + " parameters");
  for (size_t i = 0; i < tensors.size(); ++i)
    if (int64_t(tensors[i].size()) != numel(desc_.params[i].shape))
      throw Error(RLH_E_INVALID_ARGUMENT, "generator: parameter " + desc_.params[i].name + " has the wrong size");
  ensure_arena();
  for (size_t i = 0; i < tensors.size(); ++i) {
    float* dst = arena_ + arena_off_[i];
    std::memcpy(dst, tensors[i].data(), tensors[i].size() * sizeof(float));
    ptr_[i] = dst;
    set_pieces(i, dst);
    std::fill(alias_[i].begin(), alias_[i].end(), nullptr);
    std::fill(got_[i].begin(), got_[i].end(), uint8_t(0));
    on_device_[i] = 0;
  }
  pending_version_ = -1;
  pending_received_ = 0;
  version_ = version;
  complete_ = true;
  ++serial_;
}

void Weights::update(int64_t version, std::span<const rlh_named_tensor> weights, bool may_alias) {
  if (version < 0) throw Error(RLH_E_INVALID_ARGUMENT, "update_weights: version must be >= 0");
  if (version != pending_version_) {  // a new set begins; nothing of it has arrived yet
    pending_version_ = version;
    pending_received_ = 0;
    for (auto& g : got_) std::fill(g.begin(), g.end(), uint8_t(0));
    for (auto& g : got_on_device_) std::fill(g.begin(), g.end(), uint8_t(0));
    for (auto& a : alias_) std::fill(a.begin(), a.end(), nullptr);
  }
  // Device copies must have read their sources before this returns, also when it throws.
  struct Flush {
    DeviceWeightSink* sink = nullptr;
    ~Flush() {
      if (sink) try { sink->flush(); } catch (...) {}
    }
  } pending_copies;
  for (const rlh_named_tensor& w : weights) {
    if (!w.name) throw Error(RLH_E_INVALID_ARGUMENT, "update_weights: a tensor without a name");
    const std::string name = w.name;
    auto it = std::lower_bound(by_name_.begin(), by_name_.end(), name,
                               [](const auto& e, const std::string& n) { return e.first < n; });
    if (it == by_name_.end() || it->first != name)
      throw Error(RLH_E_INVALID_ARGUMENT, "update_weights: '" + name + "' is not a weight of this " +
                                              desc_.architecture + " model");
    const Piece pc = it->second;
    const sdk::ParamDesc& p = desc_.params[pc.param];
    const std::vector<int64_t>& want = p.hf_shapes[pc.index];
    const rlh_tensor& t = w.tensor;
    const std::string where = "update_weights: '" + name + "': ";
    const bool on_host = t.device.device_type == RLH_DEVICE_CPU;
    if (!on_host && (!sink_ || sink_->device().device_type != t.device.device_type ||
                     sink_->device().device_id != t.device.device_id))
      throw Error(RLH_E_INVALID_ARGUMENT, where + "in the memory of device type " + std::to_string(t.device.device_type) +
                                              " id " + std::to_string(t.device.device_id) +
                                              ", which this generator does not read (send host memory)");
    if (t.ndim != int32_t(want.size()) || !std::equal(want.begin(), want.end(), t.shape))
      throw Error(RLH_E_INVALID_ARGUMENT, where + "shape " + shape_str(t.shape, t.ndim) + ", expected " +
                                              shape_str(want.data(), int(want.size())));
    const std::optional<sdk::st::DType> dt = float_dtype(t.dtype);
    if (!dt) throw Error(RLH_E_INVALID_ARGUMENT, where + "not a float tensor");
    const std::byte* data = static_cast<const std::byte*>(t.data) + t.byte_offset;
    if (!data) throw Error(RLH_E_INVALID_ARGUMENT, where + "no data");
    if (!on_host) {
      // Runs in the engine tensor, their starts in the source through its strides; each run
      // must be contiguous there (a row-major piece, or a block of a fused tensor).
      std::vector<WeightRun> runs;
      bool ok = true;
      piece_runs(p, pc.index, [&](int64_t d, int64_t s, int64_t n) {
        int64_t off = 0, rest = s, span = 1, run_ok = 1;
        for (int dim = t.ndim - 1; dim >= 0; --dim) {
          const int64_t stride = t.strides ? t.strides[dim] : span;
          off += (rest % t.shape[dim]) * stride;
          rest /= t.shape[dim];
          if (span < n && t.shape[dim] != 1 && stride != span) run_ok = 0;
          span *= t.shape[dim];
        }
        ok = ok && run_ok;
        runs.push_back({d, off, n});
      });
      if (!ok) throw Error(RLH_E_INVALID_ARGUMENT, where + "device tensor strides that are not row-major within a run");
      pending_copies.sink = sink_;
      sink_->put(pc.param, t.dtype, data, runs);
      alias_[pc.param][pc.index] = nullptr;
      got_on_device_[pc.param][pc.index] = 1;
    } else {
      bool contiguous = true;
      int64_t stride = 1;
      for (int d = t.ndim - 1; d >= 0; --d) {
        if (t.shape[d] != 1 && t.strides && t.strides[d] != stride) contiguous = false;
        stride *= t.shape[d];
      }
      if (!contiguous) throw Error(RLH_E_INVALID_ARGUMENT, where + "strided tensors are not supported; send it contiguous");
      if (may_alias && *dt == sdk::st::DType::F32 && !short_[pc.param]) {
        alias_[pc.param][pc.index] = reinterpret_cast<const float*>(data);  // a view, no copy
      } else {
        ensure_arena();
        float* dst = arena_ + arena_off_[pc.param];
        const size_t esize = sdk::st::dtype_size(*dt);
        piece_runs(p, pc.index, [&](int64_t d, int64_t s, int64_t n) {
          sdk::st::convert_to_f32(*dt, data + size_t(s) * esize, size_t(n), dst + d);
        });
        alias_[pc.param][pc.index] = nullptr;
      }
      got_on_device_[pc.param][pc.index] = 0;
    }
    if (!got_[pc.param][pc.index]) {
      got_[pc.param][pc.index] = 1;
      ++pending_received_;
    }
  }
  if (pending_copies.sink) {
    pending_copies.sink = nullptr;
    sink_->flush();  // errors reach the caller
  }
  if (pending_received_ == pieces_total_) finalize();
}

// Piece pointers of a parameter whose whole engine tensor is at `whole`.
void Weights::set_pieces(size_t i, const float* whole) {
  const sdk::ParamDesc& p = desc_.params[i];
  const int64_t n = numel(p.hf_shapes[0]);
  for (size_t k = 0; k < piece_[i].size(); ++k)
    piece_[i][k] = p.transform == ParamTransform::stack ? whole + int64_t(k) * n : (k == 0 ? whole : nullptr);
}

void Weights::finalize() {
  // A parameter comes whole in device memory or whole in host memory: the executor keeps one
  // copy of it, on the device or on the host.
  for (size_t i = 0; i < desc_.params.size(); ++i) {
    const auto& g = got_on_device_[i];
    const size_t on = size_t(std::count(g.begin(), g.end(), uint8_t(1)));
    if (on != 0 && on != g.size())
      throw Error(RLH_E_INVALID_ARGUMENT, "update_weights: parameter " + desc_.params[i].name +
                                              " came partly in device memory and partly in host memory");
  }
  for (size_t i = 0; i < desc_.params.size(); ++i) {
    const sdk::ParamDesc& p = desc_.params[i];
    const auto& al = alias_[i];
    on_device_[i] = got_on_device_[i][0];
    if (on_device_[i]) {
      ptr_[i] = nullptr;
      std::fill(piece_[i].begin(), piece_[i].end(), nullptr);
      continue;
    }
    // One view of the whole engine tensor when the pieces are views laid out as the engine lays
    // them out (one piece, or stacked slabs back to back).
    bool whole = al[0] != nullptr && p.transform != ParamTransform::concat;
    if (whole && p.transform == ParamTransform::stack) {
      const int64_t n = numel(p.hf_shapes[0]);
      for (size_t k = 1; k < al.size(); ++k) whole = whole && al[k] == al[0] + int64_t(k) * n;
    }
    if (whole) {
      ptr_[i] = al[0];
      set_pieces(i, al[0]);
      continue;
    }
    // Stacked pieces (experts) are used one by one, so views stay views wherever they lie; the
    // pieces that were converted are in the arena already.
    if (p.transform == ParamTransform::stack) {
      const int64_t n = numel(p.hf_shapes[0]);
      bool all_owned = true;
      for (size_t k = 0; k < al.size(); ++k) {
        all_owned = all_owned && !al[k];
        piece_[i][k] = al[k] ? al[k] : arena_ + arena_off_[i] + int64_t(k) * n;
      }
      ptr_[i] = all_owned ? arena_ + arena_off_[i] : nullptr;
      continue;
    }
    // Concatenated pieces (fused projections): the views are copied into the engine tensor.
    ensure_arena();
    float* dst = arena_ + arena_off_[i];
    for (size_t k = 0; k < al.size(); ++k)
      if (al[k])
        piece_runs(p, k, [&](int64_t d, int64_t s, int64_t n) {
          std::memcpy(dst + d, al[k] + s, size_t(n) * sizeof(float));
        });
    ptr_[i] = dst;
    set_pieces(i, dst);
  }
  version_ = pending_version_;
  pending_version_ = -1;
  pending_received_ = 0;
  complete_ = true;
  ++serial_;
}

const std::vector<int64_t>* Weights::hf_shape(const std::string& name) const {
  auto it = std::lower_bound(by_name_.begin(), by_name_.end(), name,
                             [](const auto& e, const std::string& n) { return e.first < n; });
  if (it == by_name_.end() || it->first != name) return nullptr;
  return &desc_.params[it->second.param].hf_shapes[it->second.index];
}

void Weights::release() {
  std::free(arena_);
  arena_ = nullptr;
  std::fill(ptr_.begin(), ptr_.end(), nullptr);
  for (auto& p : piece_) std::fill(p.begin(), p.end(), nullptr);
  for (auto& a : alias_) std::fill(a.begin(), a.end(), nullptr);
  for (auto& g : got_) std::fill(g.begin(), g.end(), uint8_t(0));
  for (auto& g : got_on_device_) std::fill(g.begin(), g.end(), uint8_t(0));
  std::fill(on_device_.begin(), on_device_.end(), uint8_t(0));
  pending_version_ = -1;
  pending_received_ = 0;
  version_ = -1;
  complete_ = false;
  ++serial_;
}

void Weights::require_complete() const {
  if (pending_received_ > 0)
    throw Error(RLH_E_FAILED_PRECONDITION, "generator: weights of version " + std::to_string(pending_version_) +
                                               " are incomplete: " + std::to_string(pending_received_) + " of " +
                                               std::to_string(pieces_total_) + " tensors received");
  if (!complete_)
    throw Error(RLH_E_FAILED_PRECONDITION,
                "generator: no weights yet (created with load_format 'dummy': install them with update_weights)");
}

}  // namespace rlh::gen
