// HF checkpoint <-> engine-layout float32 buffers, following the parameter table.
//
// Loading checks every HF source tensor against the description (present, shape, float dtype)
// before converting, so a wrong checkpoint fails with the file and tensor named instead of
// producing a model that silently computes garbage. Saving inverts the transforms and converts
// back to the recorded dtypes; float32 -> bf16/f16 rounding is exact for values that came from
// bf16/f16, so an unchanged model round-trips bit for bit.
#include <algorithm>
#include <cmath>
#include <functional>
#include <set>
#include <stdexcept>
#include <string>

#include "rlhost/sdk/model_weights.hpp"

namespace rlh::sdk {


namespace {

std::string shape_str(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? "," : "") + std::to_string(s[i]);
  return out + "]";
}

int64_t numel(const std::vector<int64_t>& s) {
  int64_t n = 1;
  for (int64_t d : s) {
    if (d < 0 || __builtin_mul_overflow(n, d, &n))
      throw std::runtime_error("model weights: invalid shape " + shape_str(s));
  }
  return n;
}

[[noreturn]] void fail_param(const ParamDesc& p, const std::string& what) {
  throw std::runtime_error("model weights: parameter '" + p.name + "': " + what);
}

// Calls fn(engine_offset, source_offset, count) for the contiguous runs that map HF source k of
// `p` into the engine tensor. Validates that the sources tile the engine tensor exactly.
void for_each_run(const ParamDesc& p, size_t k,
                  const std::function<void(int64_t, int64_t, int64_t)>& fn) {
  const auto& src = p.hf_shapes[k];
  switch (p.transform) {
    case ParamTransform::none:
      if (p.hf_names.size() != 1 || src != p.shape)
        fail_param(p, "transform none needs one source of the engine shape");
      fn(0, 0, numel(src));
      return;
    case ParamTransform::stack: {
      std::vector<int64_t> expect = {static_cast<int64_t>(p.hf_names.size())};
      expect.insert(expect.end(), src.begin(), src.end());
      if (expect != p.shape) fail_param(p, "stacked sources " + shape_str(src) + " do not form " + shape_str(p.shape));
      const int64_t n = numel(src);
      fn(static_cast<int64_t>(k) * n, 0, n);
      return;
    }
    case ParamTransform::concat: {
      const int64_t axis = p.axis;
      if (axis < 0 || axis >= static_cast<int64_t>(p.shape.size())) fail_param(p, "concat axis out of range");
      int64_t along = 0, before = 0;
      for (size_t j = 0; j < p.hf_shapes.size(); ++j) {
        const auto& s = p.hf_shapes[j];
        if (s.size() != p.shape.size()) fail_param(p, "concat source rank differs from the engine tensor");
        for (size_t a = 0; a < s.size(); ++a)
          if (static_cast<int64_t>(a) != axis && s[a] != p.shape[a])
            fail_param(p, "concat source " + shape_str(s) + " does not match " + shape_str(p.shape));
        if (j < k) before += s[static_cast<size_t>(axis)];
        along += s[static_cast<size_t>(axis)];
      }
      if (along != p.shape[static_cast<size_t>(axis)]) fail_param(p, "concat sources do not add up to the engine shape");
      int64_t outer = 1, rest = 1;
      for (int64_t a = 0; a < axis; ++a) outer *= p.shape[static_cast<size_t>(a)];
      for (size_t a = static_cast<size_t>(axis) + 1; a < p.shape.size(); ++a) rest *= p.shape[a];
      const int64_t src_inner = src[static_cast<size_t>(axis)] * rest;
      const int64_t dst_inner = along * rest;
      for (int64_t o = 0; o < outer; ++o) fn(o * dst_inner + before * rest, o * src_inner, src_inner);
      return;
    }
  }
  fail_param(p, "unknown transform");
}

}  // namespace

LoadResult load_weights_f32(TransformerDesc& desc, const st::Checkpoint& ckpt, const LoadOptions& options) {
  LoadResult out;
  std::set<std::string> used;
  out.tensors.reserve(desc.params.size());
  for (auto& p : desc.params) {
    if (p.hf_names.empty() || p.hf_names.size() != p.hf_shapes.size())
      fail_param(p, "needs one HF shape per HF name");
    std::vector<float> buf(static_cast<size_t>(numel(p.shape)));
    std::optional<st::DType> found;
    for (size_t k = 0; k < p.hf_names.size(); ++k) {
      const std::string& hf = p.hf_names[k];
      const auto ref = ckpt.find(hf);
      if (!ref.info)
        throw std::runtime_error("model weights: " + ckpt.path() + ": missing tensor '" + hf + "' (" +
                                 sdk::to_string(p.role) +
                                 (p.layer >= 0 ? ", layer " + std::to_string(p.layer) : std::string()) +
                                 ", needed by " + desc.architecture + ")");
      const st::TensorInfo& t = *ref.info;
      const std::string where = "model weights: " + ref.file->path() + ": tensor '" + hf + "': ";
      if (t.shape != p.hf_shapes[k])
        throw std::runtime_error(where + "shape " + shape_str(t.shape) + " but the " + desc.architecture +
                                 " config expects " + shape_str(p.hf_shapes[k]));
      if (!st::dtype_is_float(t.dtype))
        throw std::runtime_error(where + "dtype " + std::string(st::dtype_name(t.dtype)) + " is not a float type");
      if (t.dtype == st::DType::F8_E4M3 || t.dtype == st::DType::F8_E5M2)
        throw std::runtime_error(where + "FP8 weights need their scale tensors, which this loader does not apply");
      if (found && *found != t.dtype)
        throw std::runtime_error(where + "dtype " + std::string(st::dtype_name(t.dtype)) +
                                 " differs from the other sources of '" + p.name + "'");
      found = t.dtype;
      if (t.dtype != p.dtype && options.dtype_policy == DtypePolicy::strict)
        throw std::runtime_error(where + "dtype " + std::string(st::dtype_name(t.dtype)) +
                                 " but the description expects " + std::string(st::dtype_name(p.dtype)));
      const auto bytes = ref.file->data(t);
      const size_t esize = st::dtype_size(t.dtype);
      for_each_run(p, k, [&](int64_t dst, int64_t src, int64_t count) {
        st::convert_to_f32(t.dtype, bytes.data() + static_cast<size_t>(src) * esize, static_cast<size_t>(count),
                           buf.data() + dst);
      });
      used.insert(hf);
    }
    p.dtype = *found;
    // A NaN or infinite weight makes every output it touches NaN: logprobs print null, losses
    // train on nothing, a resume copies it forward. It is an error naming the tensor.
    for (size_t i = 0; i < buf.size(); ++i)
      if (!std::isfinite(buf[i])) {
        std::string names;
        for (const auto& hf : p.hf_names) names += (names.empty() ? "" : ", ") + hf;
        throw std::runtime_error("model weights: " + ckpt.path() + ": tensor '" + names + "' holds a non-finite value (" +
                                 (std::isnan(buf[i]) ? "NaN" : "inf") + ") at element " + std::to_string(i) +
                                 "; non-finite weights are refused");
      }
    out.tensors.push_back(std::move(buf));
  }
  for (const auto& name : ckpt.names()) {
    if (used.count(name)) continue;
    if (!options.allow_unused) {
      const auto ref = ckpt.find(name);
      throw std::runtime_error("model weights: " + ref.file->path() + ": tensor '" + name +
                               "' is not a parameter of " + desc.architecture);
    }
    out.unused.push_back(name);
  }
  return out;
}

std::vector<std::string> save_weights_hf(const TransformerDesc& desc,
                                         const std::vector<std::vector<float>>& tensors,
                                         const std::string& dir, const SaveOptions& options) {
  if (tensors.size() != desc.params.size())
    throw std::runtime_error("model weights: " + std::to_string(tensors.size()) + " tensors given for " +
                             std::to_string(desc.params.size()) + " parameters");
  // Converted bytes must outlive the WriteTensor spans; one buffer per HF tensor.
  std::vector<std::vector<std::byte>> storage;
  std::vector<st::WriteTensor> out;
  size_t n_hf = 0;
  for (const auto& p : desc.params) n_hf += p.hf_names.size();
  storage.reserve(n_hf + options.passthrough_names.size());
  for (size_t i = 0; i < desc.params.size(); ++i) {
    const ParamDesc& p = desc.params[i];
    if (static_cast<int64_t>(tensors[i].size()) != numel(p.shape))
      fail_param(p, std::to_string(tensors[i].size()) + " values given, shape " + shape_str(p.shape) + " needs " +
                        std::to_string(numel(p.shape)));
    if (p.hf_names.empty() || p.hf_names.size() != p.hf_shapes.size())
      fail_param(p, "needs one HF shape per HF name");
    const size_t esize = st::dtype_size(p.dtype);
    for (size_t k = 0; k < p.hf_names.size(); ++k) {
      std::vector<std::byte> bytes(static_cast<size_t>(numel(p.hf_shapes[k])) * esize);
      for_each_run(p, k, [&](int64_t dst, int64_t src, int64_t count) {
        st::convert_from_f32(p.dtype, tensors[i].data() + dst, static_cast<size_t>(count),
                             bytes.data() + static_cast<size_t>(src) * esize);
      });
      storage.push_back(std::move(bytes));
      out.push_back({p.hf_names[k], p.dtype, p.hf_shapes[k], {storage.back().data(), storage.back().size()}});
    }
  }
  if (!options.passthrough_names.empty()) {
    if (!options.passthrough)
      throw std::runtime_error("model weights: passthrough_names given without a passthrough checkpoint");
    for (const auto& name : options.passthrough_names) {
      const auto ref = options.passthrough->at(name);
      out.push_back({name, ref.info->dtype, ref.info->shape, ref.file->data(*ref.info)});
    }
  }
  return st::write_checkpoint(dir, std::move(out), options.files);
}

}  // namespace rlh::sdk
