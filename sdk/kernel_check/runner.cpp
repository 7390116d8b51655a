// The conformance runner (rlhost/sdk/kernel_check.hpp): stages a case's operands for the provider
// under test and for the reference, runs both through the KERNELS ABI, and compares.
//
// Values live on the host as double. Before a call, every float buffer is rounded to the dtype
// each side gives it (a bf16 operand's values are bf16 numbers, an fp8 one's are scale x fp8
// numbers), so the reference, in float64, computes the same function of the same numbers and
// the difference is the provider's own error. A buffer is staged once per call, whatever number
// of operands name it, so aliasing is kept.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <set>
#include <stdexcept>

#include "cases.hpp"
#include "numeric.hpp"
#include "rlhost/sdk/kernel_check.hpp"

namespace rlh::sdk {

const std::vector<KernelVariant>& kernel_variants() {
  // Tolerances, max|err| / max|ref|, from the unit roundoff u of the narrowest format a provider
  // may round to: f32 (u = 6e-8) 1e-5 leaves room for float32 accumulation over the cases' few
  // hundred terms and transcendental functions; bf16 (u = 3.9e-3) 1e-2 is output rounding plus
  // one rounded intermediate (attention's P, a bf16 GEMM operand); fp8 e4m3 (u = 6.3e-2) 1e-1
  // and e5m2 (u = 1.25e-1) 2e-1 allow one intermediate at that precision (inputs are exact:
  // they were rounded before the reference saw them); f64 against a float64 reference 1e-10.
  static const std::vector<KernelVariant> v = {
      {"f32", "f32", kF32, kF32, kF32, false, false, 1e-5},
      {"bf16", "bf16", kBF16, kBF16, kBF16, false, false, 1e-2},
      {"bf16+f32", "bf16", kBF16, kBF16, kF32, false, true, 1e-2},
      {"f64", "f64", kF64, kF64, kF64, false, false, 1e-10},
      {"e4m3", "e4m3", kE4M3, kBF16, kF32, true, false, 1e-1},
      {"e5m2", "e5m2", kE5M2, kBF16, kF32, true, false, 2e-1},
      // bf16 activations x e4m3 weights (a decoding step's weight-only FP8 product): the codes
      // are exact inputs, so the error is bf16's (the dequantised weight, the output).
      {"bf16xe4m3", "e4m3", kBF16, kBF16, kF32, true, true, 1e-2, kE4M3},
  };
  return v;
}

std::string device_name(rlh_device d) {
  switch (d.device_type) {
    case RLH_DEVICE_CPU: return "cpu";
    case RLH_DEVICE_CUDA: return "cuda:" + std::to_string(d.device_id);
    case RLH_DEVICE_CUDA_HOST: return "cuda_host";
    case RLH_DEVICE_CUDA_MANAGED: return "cuda_managed:" + std::to_string(d.device_id);
    default: return "device(" + std::to_string(d.device_type) + ":" + std::to_string(d.device_id) + ")";
  }
}

ProviderFacts provider_facts(const rlh_kernels_api* api, rlh_kernels* instance) {
  ProviderFacts f;
  if (!RLH_HAS_FIELD(api, rlh_kernels_api, provider_info) || api->provider_info == nullptr) return f;
  std::string text;
  check(api->provider_info(instance, write_to_string, &text), "provider_info");
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
  if (!j.is_object()) throw Error(RLH_E_INVALID_ARGUMENT, "provider_info did not write a JSON object");
  f.reference = j.value("reference", false);
  f.device_memory = j.value("memory", std::string("host")) == "device";
  return f;
}

namespace kcheck {
namespace {

double dtype_tolerance(rlh_dtype d) {
  if (d == kF64) return 1e-10;
  if (d == kF32) return 1e-5;
  if (d.code == RLH_DTYPE_FLOAT8_E5M2) return 2e-1;
  if (d.code == RLH_DTYPE_FLOAT8_E4M3FN) return 1e-1;
  return 1e-2;  // bf16, f16
}

// ---------------------------------------------------------------------------------------------
// One side of a comparison: a provider instance and where its operands live.

struct Side {
  std::string name;
  const rlh_kernels_api* api = nullptr;
  rlh_kernels* inst = nullptr;
  rlh_device device{};
  bool device_memory = false;
};

// The dtypes one side gives each role.
struct Dtypes {
  rlh_dtype in, out, stat;
  bool scaled = false;
  rlh_dtype weight{};  // Role::weight inputs (bits 0: `in`)
};

rlh_dtype dtype_of(const Operand& o, bool input, const Dtypes& d) {
  switch (o.role) {
    case Role::i32: return kI32;
    case Role::f32: return kF32;
    case Role::f64: return kF64;
    case Role::bf16: return kBF16;
    case Role::stat: return d.stat;
    case Role::weight: return !input ? d.out : d.weight.bits ? d.weight : d.in;
    default: return input ? d.in : d.out;
  }
}

// A buffer of one side's memory, freed with it.
class Mem {
 public:
  Mem(const Side& s, size_t bytes) : s_(&s) {
    bytes = std::max<size_t>(bytes, 1);
    if (s.device_memory) {
      if (!RLH_HAS_FIELD(s.api, rlh_kernels_api, synchronize) || !s.api->memory_alloc || !s.api->memory_copy ||
          !s.api->memory_free || !s.api->synchronize)
        throw Error(RLH_E_UNIMPLEMENTED, "provider '" + s.name + "' says its memory is \"device\" but has no memory services");
      check(s.api->memory_alloc(s.inst, bytes, &p_), "memory_alloc of " + s.name);
    } else {
      p_ = std::aligned_alloc(256, (bytes + 255) / 256 * 256);
      if (!p_) throw Error(RLH_E_RESOURCE_EXHAUSTED, "host buffer");
    }
  }
  ~Mem() {
    if (!p_) return;
    if (s_->device_memory) s_->api->memory_free(s_->inst, p_);
    else std::free(p_);
  }
  Mem(const Mem&) = delete;
  Mem& operator=(const Mem&) = delete;
  void* get() const { return p_; }
  void upload(const void* src, size_t bytes) {
    if (s_->device_memory)
      check(s_->api->memory_copy(s_->inst, p_, src, bytes, RLH_COPY_HOST_TO_DEVICE, nullptr), "memory_copy to " + s_->name);
    else
      std::memcpy(p_, src, bytes);
  }
  void download(void* dst, size_t bytes) {
    if (s_->device_memory) {
      check(s_->api->memory_copy(s_->inst, dst, p_, bytes, RLH_COPY_DEVICE_TO_HOST, nullptr), "memory_copy from " + s_->name);
      check(s_->api->synchronize(s_->inst, nullptr), "synchronize of " + s_->name);
    } else {
      std::memcpy(dst, p_, bytes);
    }
  }

 private:
  const Side* s_;
  void* p_ = nullptr;
};

// ---------------------------------------------------------------------------------------------
// Host values of one case run.

using Key = std::pair<int, int>;  // (Src, index)
Key key_of(const Operand& o) { return {int(o.src), o.index}; }

struct Values {
  std::vector<std::vector<double>> in, out, din, dout, saved, consts;
  std::vector<std::vector<int32_t>> ints;
  std::map<Key, double> scales;  // fp8 buffers: the scale their values were rounded with

  const std::vector<double>& floats(Src s, int i) const {
    switch (s) {
      case Src::input: return in.at(size_t(i));
      case Src::output: return out.at(size_t(i));
      case Src::grad_input: return din.at(size_t(i));
      case Src::grad_output: return dout.at(size_t(i));
      case Src::saved: return saved.at(size_t(i));
      case Src::constant: return consts.at(size_t(i));
      case Src::ints: break;
    }
    throw std::logic_error("integer buffer read as float");
  }
  std::vector<double>& floats(Src s, int i) {
    return const_cast<std::vector<double>&>(static_cast<const Values*>(this)->floats(s, i));
  }
};

std::vector<int64_t> strides_of(const Layout& l) {
  if (!l.strides.empty()) return l.strides;
  std::vector<int64_t> st(l.shape.size(), 1);
  for (int d = int(st.size()) - 2; d >= 0; --d) st[size_t(d)] = st[size_t(d) + 1] * l.shape[size_t(d) + 1];
  return st;
}

// Elements of a buffer a layout covers.
std::vector<size_t> covered(const Layout& l) {
  const std::vector<int64_t> st = strides_of(l);
  int64_t total = 1;
  for (int64_t d : l.shape) total *= d;
  std::vector<size_t> out;
  out.reserve(size_t(total));
  std::vector<int64_t> idx(l.shape.size(), 0);
  for (int64_t n = 0; n < total; ++n) {
    int64_t off = l.offset;
    for (size_t d = 0; d < idx.size(); ++d) off += idx[d] * st[d];
    out.push_back(size_t(off));
    for (int d = int(idx.size()) - 1; d >= 0; --d) {
      if (++idx[size_t(d)] < l.shape[size_t(d)]) break;
      idx[size_t(d)] = 0;
    }
  }
  return out;
}

constexpr int32_t kIntPoison = -12345;  // never a valid id, expert, row or offset

std::vector<double> normal_values(std::mt19937_64& rng, size_t n, double scale, bool positive) {
  std::normal_distribution<double> N01(0.0, 1.0);
  std::vector<double> v(n);
  for (double& x : v) {
    x = N01(rng) * scale;
    if (positive) x = std::fabs(x);
  }
  return v;
}

Values draw_inputs(const Case& c, uint64_t seed) {
  std::mt19937_64 rng(seed);
  Values v;
  for (size_t i = 0; i < c.in_sizes.size(); ++i) {
    if (c.in_uniform[i]) {
      std::uniform_real_distribution<double> U01(0.0, 1.0);
      std::vector<double> u(size_t(c.in_sizes[i]));
      for (double& x : u) x = U01(rng);
      v.in.push_back(std::move(u));
    } else {
      v.in.push_back(normal_values(rng, size_t(c.in_sizes[i]), c.in_scale[i], c.in_positive[i]));
    }
  }
  for (const auto& k : c.consts) v.consts.emplace_back(k.begin(), k.end());
  for (const IntBuf& b : c.ints) v.ints.push_back(b.values);
  return v;
}

// Output buffers of `call` before it runs: in/out ones from their input, accumulated ones
// random, written ones NaN where the layout covers them (random around: those must survive).
void prepare_outputs(const Case& c, const Call& call, Values& v, std::mt19937_64& rng) {
  const bool fwd = &call == &c.fwd;
  auto& bufs = fwd ? v.out : v.din;
  const auto& sizes = fwd ? c.out_sizes : c.in_sizes;
  bufs.clear();
  for (int64_t n : sizes) bufs.push_back(normal_values(rng, size_t(n), 1.0, false));
  for (auto [from, to] : call.init_outputs) v.out.at(size_t(to)) = v.in.at(size_t(from));
  for (size_t pos = 0; pos < call.outputs.size(); ++pos) {
    const Operand& o = call.outputs[pos];
    const bool init = std::any_of(call.init_outputs.begin(), call.init_outputs.end(),
                                  [&](auto p) { return o.src == Src::output && p.second == o.index; });
    const bool acc = std::count(call.accumulate.begin(), call.accumulate.end(), int(pos)) > 0;
    if (o.src == Src::ints) {
      if (!c.ints_read)
        for (size_t e : covered(o.layout)) v.ints.at(size_t(o.index)).at(e) = kIntPoison;
      continue;
    }
    if (init || acc) continue;
    std::vector<double>& b = v.floats(o.src, o.index);
    for (size_t e : covered(o.layout)) b.at(e) = NAN;
  }
}

// Rounds every float buffer `call` reads or writes to the dtype each side gives it.
void round_for(const Call& call, const std::vector<const Dtypes*>& sides, Values& v) {
  for (int input = 1; input >= 0; --input)
    for (const Operand& o : input ? call.inputs : call.outputs) {
      if (o.src == Src::ints) continue;
      std::vector<double>& b = v.floats(o.src, o.index);
      for (const Dtypes* d : sides) {
        const rlh_dtype dt = dtype_of(o, input != 0, *d);
        double scale = 1.0;
        if (is_fp8(dt)) {
          double amax = 0;
          for (double x : b)
            if (std::isfinite(x)) amax = std::max(amax, std::fabs(x));
          scale = fp8_scale(dt, amax);
          v.scales[key_of(o)] = scale;
        }
        for (double& x : b) x = round_to(dt, x, scale);
      }
    }
}

// ---------------------------------------------------------------------------------------------
// Running one call on one side.

struct Outcome {
  enum { ran, refused, failed } state = ran;
  std::string message;
  Values got;  // the call's output buffers as written (others as given)
};

std::string status_text(rlh_status* s) { return s ? status_message(s) : std::string(); }

Outcome run_call(const Side& side, const Call& call, const Dtypes& dt, const Values& v) {
  Outcome r;
  r.got.out = v.out;  // where outputs can be: forward outputs, input gradients, integer buffers
  r.got.din = v.din;
  r.got.ints = v.ints;
  struct Staged {
    rlh_dtype dtype{};
    std::vector<unsigned char> bytes;  // as uploaded
    std::unique_ptr<Mem> mem;
    bool output = false;
    double scale = 1.0;
    std::vector<const Operand*> ops;
  };
  std::map<Key, Staged> bufs;
  auto stage = [&](const Operand& o, bool input) {
    Staged& s = bufs[key_of(o)];
    const rlh_dtype d = dtype_of(o, input, dt);
    if (!s.ops.empty() && !(s.dtype == d)) throw std::logic_error(call.op + ": one buffer with two dtypes");
    s.dtype = d;
    s.output = s.output || !input;
    s.ops.push_back(&o);
  };
  for (const Operand& o : call.inputs) stage(o, true);
  for (const Operand& o : call.outputs) stage(o, false);
  const Values& m = v;
  for (auto& [k, s] : bufs) {
    const Src src = Src(k.first);
    if (src == Src::ints) {
      const auto& iv = m.ints.at(size_t(k.second));
      s.bytes.resize(iv.size() * 4);
      std::memcpy(s.bytes.data(), iv.data(), s.bytes.size());
    } else {
      const auto& fv = m.floats(src, k.second);
      if (auto it = m.scales.find(k); it != m.scales.end() && is_fp8(s.dtype)) s.scale = it->second;
      s.bytes.resize(fv.size() * dtype_bytes(s.dtype));
      encode_values(s.dtype, fv.data(), fv.size(), s.bytes.data(), s.scale);
    }
    s.mem = std::make_unique<Mem>(side, s.bytes.size());
    s.mem->upload(s.bytes.data(), s.bytes.size());
  }
  // Tensors (shape/stride arrays kept alive here).
  std::vector<std::vector<int64_t>> shapes, strides;
  shapes.reserve(64);
  strides.reserve(64);
  std::vector<std::unique_ptr<Mem>> scale_mems;
  auto tensor = [&](const Operand& o, rlh_dtype d, void* base) {
    rlh_tensor t{};
    shapes.push_back(o.layout.shape);
    strides.push_back(strides_of(o.layout));
    t.data = base;
    t.device = side.device;
    t.ndim = int32_t(o.layout.shape.size());
    t.dtype = d;
    t.shape = shapes.back().data();
    t.strides = strides.back().data();
    t.byte_offset = uint64_t(o.layout.offset) * dtype_bytes(d);
    return t;
  };
  std::vector<rlh_tensor> ins, outs, scale_ts;
  std::vector<float> scale_vals;  // host sources of the scale uploads: alive until the copies end
  scale_vals.reserve(call.inputs.size());
  for (const Operand& o : call.inputs) {
    const Staged& s = bufs.at(key_of(o));
    ins.push_back(tensor(o, s.dtype, s.mem->get()));
    if (is_fp8(s.dtype)) {  // its dequantisation scale, appended after the inputs
      scale_vals.push_back(float(s.scale));
      scale_mems.push_back(std::make_unique<Mem>(side, 4));
      scale_mems.back()->upload(&scale_vals.back(), 4);
      static const Operand kScale{Src::constant, 0, contiguous({1}), Role::f32};
      scale_ts.push_back(tensor(kScale, kF32, scale_mems.back()->get()));
    }
  }
  ins.insert(ins.end(), scale_ts.begin(), scale_ts.end());
  for (const Operand& o : call.outputs) {
    const Staged& s = bufs.at(key_of(o));
    outs.push_back(tensor(o, s.dtype, s.mem->get()));
  }
  // Copies are only queued (memory_copy): their sources must outlive them.
  if (side.device_memory) check(side.api->synchronize(side.inst, nullptr), "synchronize of " + side.name);
  std::vector<rlh_named_value> attrs;
  for (const Attr& a : call.attrs)
    attrs.push_back(a.is_double ? attr_double(a.name.c_str(), a.d) : attr_int(a.name.c_str(), a.i));

  rlh_op_desc d{};
  d.struct_size = RLH_STRUCT_SIZE(rlh_op_desc, num_attrs);
  d.name = call.op.c_str();
  d.device = side.device;
  d.inputs = ins.data();
  d.num_inputs = ins.size();
  d.outputs = outs.data();
  d.num_outputs = outs.size();
  d.shapes_valid = 1;
  d.attrs = attrs.data();
  d.num_attrs = attrs.size();
  rlh_op* raw = nullptr;
  if (rlh_status* s = side.api->get_op(side.inst, &d, &raw)) {
    StatusPtr owned(s);
    r.state = s->code == RLH_E_UNIMPLEMENTED ? Outcome::refused : Outcome::failed;
    r.message = (r.state == Outcome::failed ? "resolve failed: " : "") + status_text(s);
    return r;
  }
  const Op op(side.api, raw, side.name, call.op);
  // batch_invariant = 1 is a requirement (docs/ops.md): a handle whose op_info does not promise
  // it is a refusal, as the registry treats it.
  if (KernelRegistry::needs_batch_invariance(attrs)) {
    rlh_op_info info{};
    info.struct_size = sizeof(rlh_op_info);
    if (rlh_status* s = side.api->op_info(raw, &info)) {
      StatusPtr owned(s);
      r.state = Outcome::failed;
      r.message = "op_info failed: " + status_text(s);
      return r;
    }
    if (!info.batch_invariant) {
      r.state = Outcome::refused;
      r.message = side.name + " " + call.op + ": batch_invariant = 1 asked, op_info does not promise it";
      return r;
    }
  }
  // Attributes were given at resolution: the contract makes them the call's defaults.
  rlh_op_call oc{};
  oc.struct_size = RLH_STRUCT_SIZE(rlh_op_call, workspace_bytes);
  oc.inputs = ins.data();
  oc.num_inputs = ins.size();
  oc.outputs = outs.data();
  oc.num_outputs = outs.size();
  try {
    const size_t ws = op.workspace_size(oc);
    std::unique_ptr<Mem> wmem;
    if (ws > 0) {
      wmem = std::make_unique<Mem>(side, ws);
      oc.workspace = wmem->get();
      oc.workspace_bytes = ws;
    }
    op.run(oc);
    if (side.device_memory) check(side.api->synchronize(side.inst, nullptr), "synchronize of " + side.name);
  } catch (const Error& e) {
    r.state = Outcome::failed;
    r.message = e.what();
    return r;
  }
  // Read the outputs back; nothing outside an output's layout may have changed.
  for (auto& [k, s] : bufs) {
    if (!s.output) continue;
    std::vector<unsigned char> back(s.bytes.size());
    s.mem->download(back.data(), back.size());
    std::vector<char> in_layout(s.bytes.size() / std::max<size_t>(dtype_bytes(s.dtype), 1), 0);
    for (const Operand* o : s.ops)
      for (size_t e : covered(o->layout)) in_layout.at(e) = 1;
    const size_t es = s.dtype == kI32 ? 4 : dtype_bytes(s.dtype);
    for (size_t e = 0; e < in_layout.size(); ++e)
      if (!in_layout[e] && std::memcmp(back.data() + e * es, s.bytes.data() + e * es, es) != 0) {
        r.state = Outcome::failed;
        r.message = "wrote outside an output's layout (element " + std::to_string(e) + ")";
        return r;
      }
    const Src src = Src(k.first);
    if (src == Src::ints) {
      std::memcpy(r.got.ints.at(size_t(k.second)).data(), back.data(), back.size());
    } else {
      std::vector<double>& fv = r.got.floats(src, k.second);
      decode_values(s.dtype, back.data(), fv.size(), fv.data(), s.scale);
    }
  }
  return r;
}

// ---------------------------------------------------------------------------------------------
// Comparing.

struct Diff {
  double err = 0;  // max|err| / max|ref| (inf: NaN/inf mismatch)
  std::string what;
};

Diff compare_floats(const std::vector<double>& got, const std::vector<double>& ref, const Layout& l) {
  Diff d;
  double maxref = 0, maxerr = 0;
  for (size_t e : covered(l)) {
    const double g = got[e], r = ref[e];
    if (std::isnan(r)) continue;  // the reference left it (an absent optional output)
    if (std::isnan(g)) {
      d.err = INFINITY;
      d.what = "NaN or unwritten at element " + std::to_string(e);
      return d;
    }
    if (std::isinf(r) || std::isinf(g)) {
      if (g != r) {
        d.err = INFINITY;
        d.what = "element " + std::to_string(e) + " is " + std::to_string(g) + ", reference " + std::to_string(r);
        return d;
      }
      continue;
    }
    maxref = std::max(maxref, std::fabs(r));
    maxerr = std::max(maxerr, std::fabs(g - r));
  }
  d.err = maxerr / std::max(maxref, 1e-30);
  return d;
}

// ---------------------------------------------------------------------------------------------
// One op of one provider.

struct Listing {
  std::map<std::string, std::set<std::string>> dtypes;  // op -> listed dtypes
  std::vector<std::string> order;
};

Listing list_ops(const Side& s) {
  std::string text;
  check(s.api->list_ops(s.inst, write_to_string, &text), "list_ops of " + s.name);
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
  if (!j.is_array()) throw Error(RLH_E_INVALID_ARGUMENT, "list_ops of '" + s.name + "' did not write a JSON array");
  Listing l;
  for (const auto& e : j) {
    if (!e.is_object() || !e.contains("name") || !e["name"].is_string())
      throw Error(RLH_E_INVALID_ARGUMENT, "list_ops of '" + s.name + "': an entry without a name: " + e.dump());
    const std::string name = e["name"];
    if (!l.dtypes.count(name)) l.order.push_back(name);
    auto& set = l.dtypes[name];
    if (e.contains("dtypes") && e["dtypes"].is_array())
      for (const auto& d : e["dtypes"])
        if (d.is_string()) set.insert(d.get<std::string>());
  }
  return l;
}

bool has_weights(const Call& call) {
  return std::any_of(call.inputs.begin(), call.inputs.end(), [](const Operand& o) { return o.role == Role::weight; });
}

Dtypes variant_dtypes(const KernelVariant& v) { return Dtypes{v.inputs, v.outputs, v.statistics, v.scaled, v.weights}; }

// Accumulates the results of one (op, variant) over its cases: the worst error among the
// failures when there is one, else among the passes.
struct CellBuilder {
  KernelCheckCell cell;
  int ref_failures = 0;
  std::string ref_message;
  bool failed = false;
  void record(double err, double tol, const std::string& where) {
    const bool bad = !(err <= tol);
    if (bad && !failed) {
      failed = true;
      cell.worst = err;
      cell.tolerance = tol;
      cell.where = where;
    } else if (bad == failed && (err > cell.worst || std::isnan(err))) {
      cell.worst = err;
      cell.tolerance = tol;
      cell.where = where;
    }
  }
  void fail(const std::string& where) { record(INFINITY, 0, where); }
};

struct Checker {
  const Side& prov;
  const Side& ref;
  const Listing& ref_ops;
  const std::vector<Case>& cases;

  // The reference's dtypes for an op: float64 where it lists it, else float32.
  Dtypes ref_dtypes(const std::string& op) const {
    auto it = ref_ops.dtypes.find(op);
    const bool f64 = it != ref_ops.dtypes.end() && it->second.count("f64");
    const rlh_dtype d = f64 ? kF64 : kF32;
    return Dtypes{d, d, d, false};
  }

  // Runs `call` on both sides from `v` (rounded here for both) and compares its outputs; the
  // provider's outcome when it ran and passed.
  std::optional<Outcome> compare_call(const Case& c, const Call& call, const Dtypes& pd, double var_tol, Values& v,
                                      CellBuilder& b) {
    const Dtypes rd = ref_dtypes(call.op);
    round_for(call, {&pd, &rd}, v);
    Outcome want = run_call(ref, call, rd, v);
    if (want.state != Outcome::ran) {
      ++b.ref_failures;
      if (b.ref_message.empty()) b.ref_message = want.message;
      return std::nullopt;
    }
    Outcome got = run_call(prov, call, pd, v);
    if (got.state == Outcome::refused) {
      if (b.cell.refused_cases++ == 0) b.cell.note = got.message;
      return std::nullopt;
    }
    ++b.cell.calls;
    if (got.state == Outcome::failed) {
      b.fail("case '" + c.name + "': " + got.message);
      return std::nullopt;
    }
    const bool failed_before = b.failed;
    for (size_t pos = 0; pos < call.outputs.size(); ++pos) {
      const Operand& o = call.outputs[pos];
      const std::string where = "case '" + c.name + "', output " + std::to_string(pos);
      if (o.src == Src::ints) {
        const auto& g = got.got.ints.at(size_t(o.index));
        const auto& w = want.got.ints.at(size_t(o.index));
        std::string mismatch;
        for (size_t e : covered(o.layout))
          if (g[e] != w[e]) {
            mismatch = " (integer): element " + std::to_string(e) + " is " + std::to_string(g[e]) +
                       ", reference " + std::to_string(w[e]);
            break;
          }
        if (mismatch.empty()) b.record(0, 0, where);
        else b.fail(where + mismatch);
        continue;
      }
      const Diff d = compare_floats(got.got.floats(o.src, o.index), want.got.floats(o.src, o.index), o.layout);
      const double tol = std::max({dtype_tolerance(dtype_of(o, false, pd)), dtype_tolerance(dtype_of(o, false, rd)), var_tol});
      b.record(d.err, tol, where + (d.what.empty() ? "" : ": " + d.what));
    }
    if (b.failed && !failed_before) return std::nullopt;
    return got;
  }

  // A batch-invariant op: the rows of the prefix call must equal the full call's bit for bit.
  void check_prefix(const Case& c, const Dtypes& pd, const Values& v, const Outcome& full, CellBuilder& b) {
    Outcome pre = run_call(prov, c.fwd_prefix, pd, v);
    const std::string where = "case '" + c.name + "', fewer rows";
    if (pre.state != Outcome::ran) {
      b.fail(where + ": " + (pre.state == Outcome::refused ? "refused: " : "") + pre.message);
      return;
    }
    for (size_t pos = 0; pos < c.fwd_prefix.outputs.size(); ++pos) {
      const Operand& o = c.fwd_prefix.outputs[pos];
      if (o.src == Src::ints) continue;
      const auto& a = pre.got.floats(o.src, o.index);
      const auto& f = full.got.floats(o.src, o.index);
      for (size_t e : covered(o.layout))
        if (!(a[e] == f[e] || (std::isnan(a[e]) && std::isnan(f[e])))) {
          b.fail(where + ", output " + std::to_string(pos) + ": element " + std::to_string(e) +
                 " differs from the full call's (batch_invariant = 1 promises rows that do not depend on the others)");
          return;
        }
    }
  }

  // Every case of `op` in variant `var`.
  KernelCheckCell check(const std::string& op, const KernelVariant& var) {
    CellBuilder b;
    const Dtypes pd = variant_dtypes(var);
    for (size_t ci = 0; ci < cases.size(); ++ci) {
      const Case& c = cases[ci];
      const bool fwd = c.fwd.op == op, bwd = c.bwd.op == op;
      if (!fwd && !bwd) continue;
      if (var.weights.bits && !has_weights(fwd ? c.fwd : c.bwd)) continue;  // a weight-only variant's cases
      try {
        std::mt19937_64 rng(0x5eed0000u + ci);
        Values v = draw_inputs(c, rng());
        if (fwd) {
          prepare_outputs(c, c.fwd, v, rng);
          const std::optional<Outcome> full = compare_call(c, c.fwd, pd, var.tolerance, v, b);
          if (full && !c.fwd_prefix.op.empty()) check_prefix(c, pd, v, *full, b);
          continue;
        }
        // The backward reads the reference's forward (saved outputs, integer outputs) of the
        // inputs as the backward call gives them to the provider.
        const Dtypes rf = ref_dtypes(c.fwd.op);
        Call inputs_only = c.bwd;
        inputs_only.outputs.clear();
        std::erase_if(inputs_only.inputs, [](const Operand& o) { return o.src != Src::input; });
        round_for(inputs_only, {&pd}, v);
        prepare_outputs(c, c.fwd, v, rng);
        round_for(c.fwd, {&rf}, v);
        Outcome f = run_call(ref, c.fwd, rf, v);
        if (f.state != Outcome::ran) {
          ++b.ref_failures;
          if (b.ref_message.empty()) b.ref_message = "forward " + c.fwd.op + ": " + f.message;
          continue;
        }
        v.saved = f.got.out;
        v.ints = f.got.ints;
        v.dout.clear();
        for (int64_t n : c.out_sizes) v.dout.push_back(normal_values(rng, size_t(n), 1.0, false));
        prepare_outputs(c, c.bwd, v, rng);
        compare_call(c, c.bwd, pd, var.tolerance, v, b);
      } catch (const std::exception& e) {  // a staging failure (memory services) of either side
        ++b.cell.calls;
        b.fail("case '" + c.name + "': " + e.what());
      }
    }
    KernelCheckCell& cell = b.cell;
    if (b.failed) cell.state = KernelCheckCell::fail;
    else if (cell.calls > 0) cell.state = KernelCheckCell::pass;
    else if (b.ref_failures > 0 && cell.refused_cases == 0) {
      cell.state = KernelCheckCell::no_reference;
      cell.note = ref.name + ": " + b.ref_message;
    } else cell.state = KernelCheckCell::refused;
    return cell;
  }
};

// Whether `op`'s calls have operands that are statistics (bf16+f32 differs from bf16).
bool has_statistics(const std::vector<Case>& cases, const std::string& op) {
  for (const Case& c : cases)
    for (const Call* call : {&c.fwd, &c.bwd})
      if (call->op == op)
        for (const auto* list : {&call->inputs, &call->outputs})
          for (const Operand& o : *list)
            if (o.role == Role::stat) return true;
  return false;
}

}  // namespace
}  // namespace kcheck

// ---------------------------------------------------------------------------------------------

ReferenceKernels::~ReferenceKernels() {
  if (api_ && instance_) api_->destroy(instance_);
}

std::unique_ptr<ReferenceKernels> ReferenceKernels::find(const Host& host) {
  const rlh_host_api* api = host.api();
  if (api == nullptr || !RLH_HAS_FIELD(api, rlh_host_api, list_components) || api->list_components == nullptr)
    throw Error(RLH_E_ABI_MISMATCH, "the host cannot list kernel providers (it predates ABI 0.2)");
  std::string listing;
  check(api->list_components(api->ctx, RLH_KIND_KERNELS, write_to_string, &listing), "listing kernel providers");
  const nlohmann::json list = nlohmann::json::parse(listing, nullptr, false);
  if (!list.is_array()) throw Error(RLH_E_INTERNAL, "list_components did not write a JSON array");
  for (const nlohmann::json& c : list) {
    const std::string name = c.value("name", std::string());
    const rlh_kernels_api* k = nullptr;
    try {
      k = host.find<rlh_kernels_api>(RLH_KIND_KERNELS, name.c_str(), RLH_STRUCT_SIZE(rlh_kernels_api, release_op));
    } catch (const Error&) {
      continue;
    }
    rlh_kernels* inst = nullptr;
    if (rlh_status* s = k->create(api, kCPU, "{}", 2, &inst)) {
      rlh_status_destroy(s);
      continue;
    }
    auto ref = std::make_unique<ReferenceKernels>(name, k, inst);
    try {
      if (provider_facts(k, inst).reference && !provider_facts(k, inst).device_memory) return ref;
    } catch (const Error&) {
    }
  }
  return nullptr;
}

std::vector<std::string> kernel_check_ops() {
  std::vector<std::string> ops;
  for (const kcheck::Case& c : kcheck::all_cases())
    for (const std::string* op : {&c.fwd.op, &c.bwd.op})
      if (!op->empty() && std::find(ops.begin(), ops.end(), *op) == ops.end()) ops.push_back(*op);
  return ops;
}

KernelCheckReport check_kernels(const ReferenceKernels& reference, const std::string& name,
                                const rlh_kernels_api* api, rlh_kernels* instance, rlh_device device,
                                const KernelCheckOptions& opts) {
  using namespace kcheck;
  KernelCheckReport rep;
  rep.provider = name;
  rep.reference = reference.name();
  rep.device = device_name(device);
  const ProviderFacts facts = provider_facts(api, instance);
  const Side prov{name, api, instance, device, facts.device_memory};
  const Side ref{reference.name(), reference.api(), reference.instance(), kCPU, false};
  const Listing listed = list_ops(prov);
  const Listing ref_listed = list_ops(ref);
  const std::vector<Case> cases = all_cases();
  std::vector<std::string> ops = kernel_check_ops();
  for (const std::string& op : listed.order)
    if (std::find(ops.begin(), ops.end(), op) == ops.end()) ops.push_back(op);
  Checker checker{prov, ref, ref_listed, cases};
  const auto& variants = kernel_variants();
  for (const std::string& op : ops) {
    if (!opts.ops.empty() && std::find(opts.ops.begin(), opts.ops.end(), op) == opts.ops.end()) continue;
    KernelCheckRow row;
    row.op = op;
    const auto lit = listed.dtypes.find(op);
    row.listed = lit != listed.dtypes.end();
    const bool has_case = std::any_of(cases.begin(), cases.end(), [&](const Case& c) { return c.fwd.op == op || c.bwd.op == op; });
    const bool stats = has_statistics(cases, op);
    for (const KernelVariant& v : variants) {
      KernelCheckCell cell;
      const bool named = row.listed && lit->second.count(v.name);
      const bool probed = row.listed && v.probed && lit->second.count(v.family);
      if (!named && !probed) {
        cell.state = KernelCheckCell::not_offered;
      } else if (!has_case) {
        cell.state = KernelCheckCell::no_case;
      } else if (!named && !stats) {
        cell.state = KernelCheckCell::same;
      } else {
        cell = checker.check(op, v);
        if (!named && cell.state == KernelCheckCell::refused) cell.state = KernelCheckCell::not_offered;
      }
      row.cells.push_back(cell);
    }
    // A provider that lists `bf16` but takes its statistics only in float32 (cuDNN's attention:
    // lse) refuses every bf16 case and passes bf16+f32: it offers the family in that form, and
    // its bf16 column is "not offered", not "unverified".
    for (size_t i = 0; i < variants.size() && i < row.cells.size(); ++i) {
      if (!variants[i].probed || row.cells[i].state != KernelCheckCell::pass) continue;
      for (size_t j = 0; j < variants.size() && j < row.cells.size(); ++j)
        if (std::string(variants[j].name) == variants[i].family && row.cells[j].state == KernelCheckCell::refused)
          row.cells[j].state = KernelCheckCell::not_offered;
    }
    rep.rows.push_back(std::move(row));
  }
  return rep;
}

}  // namespace rlh::sdk
