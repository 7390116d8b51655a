// HF config.json -> TransformerDesc, one generic function over the architecture tables.
//
// Everything architecture-specific comes from the row (architecture_tables.cpp): which keys hold
// which hyper-parameter and their defaults, which layers slide or are MoE, and the weight names.
// This file only knows how HF *config layouts* work (rope_parameters vs rope_scaling, rope_type vs
// type, layer_types) and checks values, naming the offending key.
#include <cmath>
#include <fstream>
#include <limits>
#include <optional>
#include <sstream>
#include <stdexcept>

#include <nlohmann/json.hpp>

#include "architecture_tables.hpp"
#include "parameter_table.hpp"
#include "rlhost/model/llama_family.hpp"

#include "rlhost/sdk/hf_cache.hpp"
#include "rlhost/sdk/input_file.hpp"

namespace rlh::model {

using nlohmann::json;
using sdk::RopeKind;

namespace {

[[noreturn]] void fail(const std::string& what) { throw std::runtime_error("config: " + what); }

// Largest value accepted for a dimension; far above any real model, small enough that shape
// products stay inside int64 checks and hostile configs cannot ask for absurd tables.
constexpr int64_t kMaxDim = int64_t{1} << 26;
constexpr int64_t kMaxLayers = 4096;
constexpr int64_t kMaxExperts = 1 << 16;

// Typed access to a row's hyper-parameters: config value under the first present key, else the
// row's default, else the common default.
class Hparams {
 public:
  Hparams(const json& cfg, const ArchitectureRow& row) : cfg_(cfg), row_(row) {}

  // The config key a field was read from (for messages), or "<default>".
  std::string source(std::string_view field) const {
    const HparamRow& r = lookup(field);
    std::string_view keys = r.keys;
    while (!keys.empty()) {
      const auto bar = keys.find('|');
      const std::string key(keys.substr(0, bar));
      if (cfg_.contains(key)) return key;
      if (bar == std::string_view::npos) break;
      keys.remove_prefix(bar + 1);
    }
    return std::string(r.keys.empty() ? field : r.keys.substr(0, r.keys.find('|')));
  }

  json raw(std::string_view field) const {
    const HparamRow& r = lookup(field);
    std::string_view keys = r.keys;
    while (!keys.empty()) {
      const auto bar = keys.find('|');
      const std::string key(keys.substr(0, bar));
      auto it = cfg_.find(key);
      if (it != cfg_.end()) return *it;
      if (bar == std::string_view::npos) break;
      keys.remove_prefix(bar + 1);
    }
    if (r.default_json.empty())
      fail("missing required key '" + std::string(r.keys.substr(0, r.keys.find('|'))) + "'");
    return json::parse(r.default_json);
  }

  bool is_null(std::string_view field) const { return raw(field).is_null(); }

  int64_t integer(std::string_view field, int64_t lo, int64_t hi) const {
    const json v = raw(field);
    if (!v.is_number_integer())
      fail("'" + source(field) + "' must be an integer, got " + v.dump());
    const int64_t x = v.get<int64_t>();
    if (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX))
      fail("'" + source(field) + "' is out of range");
    if (x < lo || x > hi)
      fail("'" + source(field) + "' = " + std::to_string(x) + " is outside [" + std::to_string(lo) +
           ", " + std::to_string(hi) + "]");
    return x;
  }

  // Integer or null (null -> fallback).
  int64_t integer_or(std::string_view field, int64_t fallback, int64_t lo, int64_t hi) const {
    if (is_null(field)) return fallback;
    return integer(field, lo, hi);
  }

  double real(std::string_view field) const {
    const json v = raw(field);
    if (!v.is_number()) fail("'" + source(field) + "' must be a number, got " + v.dump());
    const double x = v.get<double>();
    if (!std::isfinite(x)) fail("'" + source(field) + "' must be finite");
    return x;
  }

  bool boolean(std::string_view field) const {
    const json v = raw(field);
    if (v.is_null()) return false;
    if (!v.is_boolean()) fail("'" + source(field) + "' must be true or false, got " + v.dump());
    return v.get<bool>();
  }

  std::string string(std::string_view field) const {
    const json v = raw(field);
    if (!v.is_string()) fail("'" + source(field) + "' must be a string, got " + v.dump());
    return v.get<std::string>();
  }

 private:
  const HparamRow& lookup(std::string_view field) const {
    for (const auto& r : row_.hparams)
      if (r.field == field) return r;
    for (const auto& r : common_hparams())
      if (r.field == field) return r;
    throw std::logic_error("architecture table: no hyper-parameter '" + std::string(field) + "'");
  }

  const json& cfg_;
  const ArchitectureRow& row_;
};

std::optional<int64_t> token_id(const json& v, const std::string& key) {
  if (v.is_null()) return std::nullopt;
  if (!v.is_number_integer()) fail("'" + key + "' must be an integer or null, got " + v.dump());
  return v.get<int64_t>();
}

// ---------------------------------------------------------------------------------------------
// RoPE

RopeKind rope_kind_from(const std::string& s, const std::string& where) {
  if (s == "default") return RopeKind::default_;
  if (s == "linear") return RopeKind::linear;
  if (s == "dynamic") return RopeKind::dynamic;
  if (s == "llama3") return RopeKind::llama3;
  if (s == "yarn") return RopeKind::yarn;
  if (s == "longrope") return RopeKind::longrope;
  fail(where + " has unsupported rope type '" + s + "'");
}

// rope_parameters (transformers >= 5) or rope_scaling + rope_theta (legacy), with rope_type or
// the older "type" key, resolved as HF's standardize_rope_params does. `layer_type` (Gemma-3's
// "full_attention" / "sliding_attention") picks that entry of per-layer-type rope_parameters;
// in the legacy layout, `theta` (when given) replaces rope_theta and the scaling is left out
// (Gemma-3's sliding layers: rope_local_base_freq, default RoPE).
sdk::RopeDesc parse_rope(const json& cfg, const Hparams& hp, int64_t rope_head_dim,
                         int64_t max_pos, const std::string& layer_type = {},
                         std::optional<double> theta = std::nullopt) {
  json rp = json::object();
  std::string where = "rope_scaling";
  if (auto it = cfg.find("rope_parameters"); it != cfg.end() && !it->is_null()) {
    if (!it->is_object()) fail("'rope_parameters' must be an object");
    rp = *it;
    where = "rope_parameters";
    bool per_type = false;
    for (const auto& [k, v] : rp.items()) per_type = per_type || v.is_object();
    if (per_type) {
      if (layer_type.empty()) fail("rope_parameters holds per-layer-type parameters, which this architecture does not use");
      auto t = rp.find(layer_type);
      if (t == rp.end() || !t->is_object()) fail("rope_parameters has no '" + layer_type + "' entry");
      where = "rope_parameters." + layer_type;
      rp = json(*t);
      theta.reset();
    }
  } else if (theta) {
    // legacy local layers: default RoPE at the given theta
  } else if (auto it2 = cfg.find("rope_scaling"); it2 != cfg.end() && !it2->is_null()) {
    if (!it2->is_object()) fail("'rope_scaling' must be an object");
    rp = *it2;
  }
  for (const auto& [k, v] : rp.items())
    if (v.is_object())
      fail(where + " holds per-layer-type parameters ('" + k + "'), which this family does not use");

  auto num = [&](const char* key) -> std::optional<double> {
    auto it = rp.find(key);
    if (it == rp.end() || it->is_null()) return std::nullopt;
    if (!it->is_number()) fail(where + "." + key + " must be a number, got " + it->dump());
    const double x = it->get<double>();
    if (!std::isfinite(x)) fail(where + "." + key + " must be finite");
    return x;
  };
  auto need = [&](const char* key, const std::string& kind) -> double {
    auto v = num(key);
    if (!v) fail(where + "." + key + " is required for rope type '" + kind + "'");
    return *v;
  };

  sdk::RopeDesc r;
  std::string type = "default";
  if (auto it = rp.find("rope_type"); it != rp.end() && !it->is_null()) {
    if (!it->is_string()) fail(where + ".rope_type must be a string");
    type = it->get<std::string>();
  } else if (auto it2 = rp.find("type"); it2 != rp.end() && !it2->is_null()) {
    if (!it2->is_string()) fail(where + ".type must be a string");
    type = it2->get<std::string>();
  }
  r.kind = rope_kind_from(type, where);

  if (auto t = num("rope_theta"))
    r.theta = *t;
  else
    r.theta = theta ? *theta : hp.real("rope_theta");
  if (!(r.theta > 1.0)) fail("rope_theta must be > 1, got " + std::to_string(r.theta));

  double prf = 1.0;
  if (auto p = num("partial_rotary_factor"))
    prf = *p;
  else
    prf = hp.real("partial_rotary_factor");
  if (!(prf > 0.0 && prf <= 1.0)) fail("partial_rotary_factor must be in (0, 1]");
  r.partial_rotary_factor = prf;
  r.rotary_dim = static_cast<int64_t>(static_cast<double>(rope_head_dim) * prf);  // HF: int()
  if (r.rotary_dim <= 0 || r.rotary_dim % 2 != 0)
    fail("rotary dimension " + std::to_string(r.rotary_dim) + " (head_dim " +
         std::to_string(rope_head_dim) + " x partial_rotary_factor) must be positive and even");
  r.layout = hp.boolean("rope_interleave") ? sdk::RopeLayout::interleaved : sdk::RopeLayout::half_split;
  r.max_position_embeddings = max_pos;

  // Pretraining context: a top-level original_max_position_embeddings wins (Phi-3 style), then
  // the rope dict, then max_position_embeddings.
  int64_t orig = max_pos;
  if (auto v = num("original_max_position_embeddings")) {
    if (!(*v >= 1.0 && *v <= 1e12)) fail(where + ".original_max_position_embeddings is out of range");
    orig = static_cast<int64_t>(*v);
  }
  if (auto it = cfg.find("original_max_position_embeddings"); it != cfg.end() && it->is_number_integer())
    orig = it->get<int64_t>();
  if (orig <= 0 || orig > kMaxDim * 64) fail(where + ".original_max_position_embeddings is out of range");

  switch (r.kind) {
    case RopeKind::none:
    case RopeKind::default_:
      break;
    case RopeKind::linear:
    case RopeKind::dynamic:
      r.factor = need("factor", type);
      break;
    case RopeKind::llama3:
      r.factor = need("factor", type);
      r.low_freq_factor = need("low_freq_factor", type);
      r.high_freq_factor = need("high_freq_factor", type);
      if (r.low_freq_factor == r.high_freq_factor)
        fail(where + " llama3 low_freq_factor must differ from high_freq_factor");
      r.original_max_position_embeddings = orig;
      break;
    case RopeKind::yarn:
    case RopeKind::longrope: {
      r.original_max_position_embeddings = orig;
      // HF: a missing factor is the context extension max / original.
      auto f = num("factor");
      r.factor = f ? *f : static_cast<double>(max_pos) / static_cast<double>(orig);
      if (auto a = num("attention_factor")) r.attention_factor = *a;
      if (r.kind == RopeKind::yarn) {
        r.beta_fast = num("beta_fast").value_or(32.0);
        r.beta_slow = num("beta_slow").value_or(1.0);
        if (auto m = num("mscale")) r.mscale = *m;
        if (auto m = num("mscale_all_dim")) r.mscale_all_dim = *m;
        if (auto it = rp.find("truncate"); it != rp.end() && !it->is_null()) {
          if (!it->is_boolean()) fail(where + ".truncate must be true or false");
          r.truncate = it->get<bool>();
        }
      } else {
        for (const char* key : {"short_factor", "long_factor"}) {
          auto it = rp.find(key);
          if (it == rp.end() || !it->is_array())
            fail(where + "." + key + " is required for rope type 'longrope'");
          if (static_cast<int64_t>(it->size()) != r.rotary_dim / 2)
            fail(where + "." + key + " has " + std::to_string(it->size()) + " entries, expected " +
                 std::to_string(r.rotary_dim / 2));
          auto& dst = std::string_view(key) == "short_factor" ? r.short_factor : r.long_factor;
          for (const auto& x : *it) {
            if (!x.is_number()) fail(where + "." + key + " entries must be numbers");
            dst.push_back(x.get<double>());
          }
        }
      }
      break;
    }
  }
  if (r.kind != RopeKind::default_ && r.kind != RopeKind::none && !(r.factor > 0.0))
    fail(where + ".factor must be positive");
  return r;
}

// ---------------------------------------------------------------------------------------------
// per-layer rules

std::vector<bool> sliding_layers(const json& cfg, const Hparams& hp, const ArchitectureRow& row,
                                 int64_t n_layers) {
  std::vector<bool> out(static_cast<size_t>(n_layers), false);
  if (row.honours_layer_types) {
    auto it = cfg.find("layer_types");
    if (it != cfg.end() && !it->is_null()) {
      if (!it->is_array() || static_cast<int64_t>(it->size()) != n_layers)
        fail("'layer_types' must list " + std::to_string(n_layers) + " entries");
      for (int64_t i = 0; i < n_layers; ++i) {
        const json& t = (*it)[static_cast<size_t>(i)];
        if (t == "sliding_attention")
          out[static_cast<size_t>(i)] = true;
        else if (t != "full_attention")
          fail("layer_types[" + std::to_string(i) + "] = " + t.dump() +
               " (expected \"full_attention\" or \"sliding_attention\")");
      }
      return out;
    }
  }
  const int64_t max_window_layers =
      row.sliding == SlidingRule::from_layer || row.sliding == SlidingRule::even_below_max
          ? hp.integer("max_window_layers", 0, std::numeric_limits<int64_t>::max())
          : 0;
  const int64_t pattern = row.sliding == SlidingRule::pattern ? hp.integer("sliding_pattern", 1, kMaxLayers) : 1;
  for (int64_t i = 0; i < n_layers; ++i) {
    bool s = false;
    switch (row.sliding) {
      case SlidingRule::none: s = false; break;
      case SlidingRule::all_layers: s = true; break;
      case SlidingRule::from_layer: s = i >= max_window_layers; break;
      case SlidingRule::even_below_max: s = (i % 2 == 0) && i < max_window_layers; break;
      case SlidingRule::pattern: s = (i + 1) % pattern != 0; break;
    }
    out[static_cast<size_t>(i)] = s;
  }
  return out;
}

std::vector<bool> moe_layers(const Hparams& hp, const ArchitectureRow& row, int64_t n_layers,
                             int64_t n_experts) {
  std::vector<bool> out(static_cast<size_t>(n_layers), false);
  if (row.moe == MoeRule::none || n_experts == 0) return out;
  std::vector<int64_t> mlp_only;
  int64_t step = 1, first_dense = 0, freq = 1;
  if (row.moe == MoeRule::sparse_step) {
    step = hp.integer("decoder_sparse_step", 1, kMaxLayers);
    const json v = hp.raw("mlp_only_layers");
    if (!v.is_null()) {
      if (!v.is_array()) fail("'mlp_only_layers' must be a list of layer indices");
      for (const auto& x : v) {
        if (!x.is_number_integer()) fail("'mlp_only_layers' must be a list of layer indices");
        mlp_only.push_back(x.get<int64_t>());
      }
    }
  } else if (row.moe == MoeRule::first_k_dense) {
    first_dense = hp.integer_or("first_k_dense_replace", 0, 0, kMaxLayers);
    freq = hp.integer_or("moe_layer_freq", 1, 1, kMaxLayers);
  }
  for (int64_t i = 0; i < n_layers; ++i) {
    bool m = false;
    switch (row.moe) {
      case MoeRule::none: m = false; break;
      case MoeRule::all_layers: m = true; break;
      case MoeRule::sparse_step:
        m = std::find(mlp_only.begin(), mlp_only.end(), i) == mlp_only.end() && (i + 1) % step == 0;
        break;
      case MoeRule::first_k_dense: m = i >= first_dense && i % freq == 0; break;
    }
    out[static_cast<size_t>(i)] = m;
  }
  return out;
}

double yarn_mscale(double scale, double mscale) {
  return scale <= 1.0 ? 1.0 : 0.1 * mscale * std::log(scale) + 1.0;
}

}  // namespace

// ---------------------------------------------------------------------------------------------

std::vector<std::string> supported_architectures() {
  std::vector<std::string> out;
  for (const auto& r : architecture_rows()) out.emplace_back(r.architecture);
  return out;
}

bool is_supported_architecture(std::string_view architecture) {
  return find_architecture(architecture) != nullptr;
}

sdk::TransformerDesc describe(const json& cfg) {
  if (!cfg.is_object()) fail("config.json must hold a JSON object");
  auto archs = cfg.find("architectures");
  std::string arch;
  const ArchitectureRow* row = nullptr;
  if (archs == cfg.end() || archs->is_null()) {
    // Some configs carry only model_type: take the row of that model_type.
    auto mt = cfg.find("model_type");
    if (mt == cfg.end() || !mt->is_string()) fail("config has neither 'architectures' nor 'model_type'");
    for (const auto& r : architecture_rows())
      if (r.model_type == mt->get<std::string>()) {
        row = &r;
        break;
      }
    arch = row ? std::string(row->architecture) : "model_type " + mt->get<std::string>();
  } else {
    if (!archs->is_array() || archs->empty() || !(*archs)[0].is_string())
      fail("'architectures' must be a non-empty list of names");
    arch = (*archs)[0].get<std::string>();
    row = find_architecture(arch);
  }
  if (!row) {
    std::string names;
    for (const auto& r : architecture_rows()) names += (names.empty() ? "" : ", ") + std::string(r.architecture);
    fail("architecture '" + arch + "' is not supported by model_llama (supported: " + names + ")");
  }
  const Hparams hp(cfg, *row);
  // A quantized checkpoint (DeepSeek-V3's FP8: F8_E4M3 weights with 128x128 weight_scale_inv
  // blocks; GPTQ, AWQ, bitsandbytes, ...) is refused by name: its weights mean nothing without
  // the method's own dequantization, which rlhost does not implement.
  if (auto q = cfg.find("quantization_config"); q != cfg.end() && !q->is_null()) {
    std::string method = "unknown";
    std::string blocks;
    if (q->is_object()) {
      if (auto m = q->find("quant_method"); m != q->end() && m->is_string()) method = m->get<std::string>();
      if (auto b = q->find("weight_block_size"); b != q->end()) blocks = ", weight_block_size " + b->dump();
    }
    fail("'quantization_config' (quant_method '" + method + "'" + blocks +
         ") names a quantized checkpoint; rlhost does not dequantize one (an FP8 checkpoint needs its "
         "weight_scale_inv blocks applied): use the model's bf16/fp32 checkpoint");
  }

  sdk::TransformerDesc d;
  d.architecture = arch;
  d.model_type = std::string(row->model_type);
  if (auto mt = cfg.find("model_type"); mt != cfg.end() && mt->is_string()) d.model_type = mt->get<std::string>();
  d.vocab_size = hp.integer("vocab_size", 1, kMaxDim);
  d.hidden_size = hp.integer("hidden_size", 1, kMaxDim);
  d.num_layers = hp.integer("num_layers", 1, kMaxLayers);
  d.max_position_embeddings = hp.integer("max_position_embeddings", 1, kMaxDim * 64);
  d.rms_norm_eps = hp.real("rms_norm_eps");
  if (!(d.rms_norm_eps > 0.0)) fail("'rms_norm_eps' must be positive");
  d.tie_word_embeddings = hp.boolean("tie_word_embeddings");
  d.initializer_range = hp.is_null("initializer_range") ? 0.02 : hp.real("initializer_range");
  d.bos_token_id = token_id(hp.raw("bos_token_id"), "bos_token_id");
  d.pad_token_id = token_id(hp.raw("pad_token_id"), "pad_token_id");
  {
    const json eos = hp.raw("eos_token_id");
    if (eos.is_array()) {
      for (const auto& e : eos) {
        if (!e.is_number_integer()) fail("'eos_token_id' list entries must be integers");
        d.eos_token_ids.push_back(e.get<int64_t>());
      }
    } else if (auto id = token_id(eos, "eos_token_id")) {
      d.eos_token_ids.push_back(*id);
    }
  }
  {
    const json dt = hp.raw("torch_dtype");
    if (dt.is_string()) {
      auto parsed = sdk::st::dtype_from_torch_name(dt.get<std::string>());
      if (!parsed) fail("'" + hp.source("torch_dtype") + "' = " + dt.dump() + " is not a known dtype");
      d.torch_dtype = *parsed;
    } else if (!dt.is_null()) {
      fail("'" + hp.source("torch_dtype") + "' must be a string");
    }
  }
  // Gemma's norms multiply by (1 + w); its embedding rows are scaled by sqrt(hidden_size).
  const double norm_offset = row->gemma ? 1.0 : 0.0;
  d.final_norm = {sdk::NormKind::rmsnorm, d.rms_norm_eps, norm_offset};
  if (row->gemma) {
    d.embedding_scale = std::sqrt(static_cast<double>(d.hidden_size));
    d.final_logit_softcapping = hp.is_null("final_logit_softcapping") ? 0.0 : hp.real("final_logit_softcapping");
    if (d.final_logit_softcapping < 0) fail("'final_logit_softcapping' must be positive or null");
  }

  // Attention geometry shared by all layers.
  const int64_t heads = hp.integer("num_heads", 1, kMaxDim);
  const int64_t kv_heads = hp.integer_or("num_kv_heads", heads, 1, kMaxDim);
  if (heads % kv_heads != 0)
    fail("'num_attention_heads' (" + std::to_string(heads) + ") must be a multiple of 'num_key_value_heads' (" +
         std::to_string(kv_heads) + ")");
  sdk::AttentionDesc attn;
  attn.kind = row->attention;
  attn.num_heads = heads;
  int64_t rope_head_dim = 0;
  if (row->attention == sdk::AttentionKind::gqa) {
    if (hp.is_null("head_dim") && d.hidden_size % heads != 0)
      fail("'hidden_size' must be a multiple of 'num_attention_heads' when 'head_dim' is not given");
    attn.head_dim = hp.integer_or("head_dim", d.hidden_size / heads, 1, kMaxDim);
    attn.num_kv_heads = kv_heads;
    attn.q_bias = hp.boolean("q_bias");
    attn.k_bias = hp.boolean("k_bias");
    attn.v_bias = hp.boolean("v_bias");
    attn.o_bias = hp.boolean("o_bias");
    attn.qk_norm = row->qk_norm;
    attn.qk_norm_weight_offset = norm_offset;
    rope_head_dim = attn.head_dim;
  } else {
    attn.q_lora_rank = hp.integer_or("q_lora_rank", 0, 0, kMaxDim);
    attn.kv_lora_rank = hp.integer("kv_lora_rank", 1, kMaxDim);
    attn.qk_rope_head_dim = hp.integer("qk_rope_head_dim", 2, kMaxDim);
    attn.qk_nope_head_dim = hp.integer("qk_nope_head_dim", 0, kMaxDim);
    attn.v_head_dim = hp.integer("v_head_dim", 1, kMaxDim);
    attn.head_dim = attn.qk_nope_head_dim + attn.qk_rope_head_dim;
    attn.num_kv_heads = heads;  // MLA expands the latent into per-head keys and values
    if (hp.boolean("attention_bias"))
      fail("'attention_bias' = true is not supported for multi-head latent attention");
    rope_head_dim = attn.qk_rope_head_dim;
  }
  d.rope = parse_rope(cfg, hp, rope_head_dim, d.max_position_embeddings, row->local_rope ? "full_attention" : "");
  std::optional<sdk::RopeDesc> local_rope;  // Gemma-3's sliding layers
  if (row->local_rope)
    local_rope = parse_rope(cfg, hp, rope_head_dim, d.max_position_embeddings, "sliding_attention",
                            hp.real("rope_local_base_freq"));

  attn.softmax_scale = 1.0 / std::sqrt(static_cast<double>(attn.head_dim));
  if (row->gemma) {
    const double scalar = hp.is_null("query_pre_attn_scalar") ? double(attn.head_dim) : hp.real("query_pre_attn_scalar");
    if (!(scalar > 0)) fail("'query_pre_attn_scalar' must be positive");
    attn.softmax_scale = 1.0 / std::sqrt(scalar);
    attn.logit_softcapping = hp.is_null("attn_logit_softcapping") ? 0.0 : hp.real("attn_logit_softcapping");
    if (attn.logit_softcapping < 0) fail("'attn_logit_softcapping' must be positive or null");
  }
  if (row->attention == sdk::AttentionKind::mla && d.rope.kind != RopeKind::default_ &&
      d.rope.mscale_all_dim && *d.rope.mscale_all_dim != 0.0) {
    // HF DeepseekV3Attention: scaling *= mscale(factor, mscale_all_dim)^2.
    const double m = yarn_mscale(d.rope.factor, *d.rope.mscale_all_dim);
    attn.softmax_scale *= m * m;
  }

  // Sliding windows.
  int64_t window = 0;
  if (row->sliding != SlidingRule::none && hp.boolean("use_sliding_window")) {
    window = hp.integer_or("sliding_window", 0, 0, std::numeric_limits<int64_t>::max());
  }
  const std::vector<bool> sliding = sliding_layers(cfg, hp, *row, d.num_layers);

  // MLP / MoE.
  sdk::MlpDesc dense;
  dense.kind = sdk::MlpKind::dense;
  dense.hidden_act = hp.string("hidden_act");
  dense.bias = hp.boolean("mlp_bias");
  int64_t n_experts = 0;
  sdk::MoeDesc moe;
  if (row->moe != MoeRule::none) {
    n_experts = hp.integer_or("num_experts", 0, 0, kMaxExperts);
    if (n_experts > 0) {
      moe.num_experts = n_experts;
      moe.top_k = hp.integer("top_k", 1, n_experts);
      moe.expert_intermediate_size = hp.integer("moe_intermediate_size", 1, kMaxDim);
      moe.norm_topk_prob = row->moe_norm_topk_always || hp.boolean("norm_topk_prob");
      moe.scoring = row->moe_scoring;
      const int64_t n_shared = hp.integer_or("n_shared_experts", 0, 0, kMaxExperts);
      moe.shared_expert_intermediate_size =
          n_shared > 0 ? n_shared * moe.expert_intermediate_size
                       : hp.integer_or("shared_expert_intermediate_size", 0, 0, kMaxDim);
      moe.shared_expert_gate = row->shared_expert_gate && moe.shared_expert_intermediate_size > 0;
      moe.n_group = hp.integer_or("n_group", 1, 1, n_experts);
      moe.topk_group = hp.integer_or("topk_group", 1, 1, moe.n_group);
      if (n_experts % moe.n_group != 0) fail("'n_group' must divide the number of experts");
      if (moe.n_group > 1 && moe.top_k > moe.topk_group * (n_experts / moe.n_group))
        fail("'num_experts_per_tok' exceeds the experts left by topk_group");
      moe.routed_scaling_factor = hp.is_null("routed_scaling_factor") ? 1.0 : hp.real("routed_scaling_factor");
      moe.e_score_correction_bias = row->expert_score_bias;
      moe.router_aux_loss_coef = hp.is_null("router_aux_loss_coef") ? 0.0 : hp.real("router_aux_loss_coef");
    }
  }
  const std::vector<bool> is_moe = moe_layers(hp, *row, d.num_layers, n_experts);
  bool any_dense = false;
  for (bool m : is_moe) any_dense |= !m;
  if (any_dense) dense.intermediate_size = hp.integer("intermediate_size", 1, kMaxDim);

  for (int64_t i = 0; i < d.num_layers; ++i) {
    sdk::LayerDesc L;
    L.index = i;
    L.attn_norm = {sdk::NormKind::rmsnorm, d.rms_norm_eps, norm_offset};
    L.mlp_norm = L.attn_norm;
    if (row->sandwich_norms) {
      L.post_attn_norm = L.attn_norm;
      L.post_mlp_norm = L.attn_norm;
    }
    L.attention = attn;
    L.attention.sliding_window = sliding[static_cast<size_t>(i)] ? window : 0;
    if (local_rope && sliding[static_cast<size_t>(i)]) L.rope = local_rope;
    L.mlp = dense;
    if (is_moe[static_cast<size_t>(i)]) {
      L.mlp.kind = sdk::MlpKind::moe;
      L.mlp.intermediate_size = 0;
      L.mlp.moe = moe;
    }
    d.layers.push_back(std::move(L));
  }

  d.params = build_parameter_table(d, *row);
  return d;
}

sdk::TransformerDesc describe_json_text(std::string_view config_json, const std::string& label) {
  const auto parsed = sdk::st::parse_json_strict(config_json, label);
  // describe() reads through nlohmann::json; key order does not matter there.
  return describe(json::parse(parsed.dump()));
}

sdk::TransformerDesc describe_model_dir(const std::string& model_dir) {
  const std::string path = model_dir + "/config.json";
  const std::string text = sdk::read_input_file(path, 64u << 20, "model config");  // regular files only
  try {
    return describe_json_text(text, path);
  } catch (const std::runtime_error& e) {
    const std::string msg = e.what();
    if (msg.find(path) != std::string::npos) throw;
    throw std::runtime_error(path + ": " + msg);
  }
}

std::string resolve_model_dir(const std::string& dir_or_hub_id) {
  return sdk::resolve_model_path(dir_or_hub_id).string();
}

LoadedModel load_model(const std::string& dir_or_hub_id, const sdk::LoadOptions& options) {
  LoadedModel m;
  m.dir = resolve_model_dir(dir_or_hub_id);
  m.desc = describe_model_dir(m.dir);
  m.checkpoint = sdk::st::Checkpoint::open(m.dir);
  m.weights = sdk::load_weights_f32(m.desc, m.checkpoint, options);
  return m;
}

}  // namespace rlh::model
