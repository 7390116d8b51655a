// rlh_tiny_model: writes a small, randomly initialised Hugging Face Llama checkpoint with a
// character-level tokenizer, for the CPU demo and tests that must start from a model that has
// never seen the rewarded task.
//
//   rlh_tiny_model OUT_DIR [--hidden 64] [--layers 2] [--heads 4] [--kv-heads 2] [--ffn 176]
//                  [--alphabet "0123456789+-*= abc..."] [--seed 1] [--init-std 0.02]
//                  [--max-positions 64] [--experts E --top-k K]
//
// With --experts the MLP of every layer is a Mixtral-style mixture of E experts of width --ffn
// (MixtralForCausalLM; the router picks --top-k, default 2), for benchmarks of expert parallelism.
//
// OUT_DIR receives config.json (LlamaForCausalLM, float32), model.safetensors, tokenizer.json,
// tokenizer_config.json and generation_config.json. The weights follow transformers'
// LlamaPreTrainedModel._init_weights: every linear and embedding weight ~ N(0, init_std), norm
// weights 1, drawn from a splitmix64 stream fixed by --seed (the same files on every machine).
//
// The tokenizer is a BPE model without merges, so every character of the alphabet is one token
// (ids 3..), with <pad>=0, <s>=1, </s>=2 as special tokens and a Fuse decoder (tokens
// concatenate). Without merges or a pre-tokenizer, HF tokenizers and tokenizer_hf both split any
// text into its characters.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "rlhost/sdk/safetensors.hpp"

namespace {

using json = nlohmann::ordered_json;
namespace st = rlh::sdk::st;

struct Options {
  std::filesystem::path out;
  int64_t hidden = 64, layers = 2, heads = 4, kv_heads = 2, ffn = 176, max_positions = 64;
  int64_t experts = 0, top_k = 2;  // experts 0: a dense Llama
  std::string alphabet = "0123456789+-*= abcdefghijklmnopqrstuvwxyz";
  uint64_t seed = 1;
  double init_std = 0.02;
};

// splitmix64 + Box-Muller: a normal stream defined by its code, not by a library.
struct Normal {
  uint64_t s;
  uint64_t next() {
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  double uniform() { return (static_cast<double>(next() >> 11) + 0.5) * 0x1.0p-53; }  // (0, 1)
  double operator()() {
    const double u1 = uniform(), u2 = uniform();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2);
  }
};

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr,
               "rlh_tiny_model: %s\nusage: rlh_tiny_model OUT_DIR [--hidden N] [--layers N] "
               "[--heads N] [--kv-heads N] [--ffn N] [--alphabet CHARS] [--seed N] [--init-std X] "
               "[--max-positions N] [--experts E --top-k K]\n",
               why.c_str());
  std::exit(2);
}

int64_t positive(const std::string& flag, const std::string& v) {
  size_t used = 0;
  long long n = 0;
  try {
    n = std::stoll(v, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != v.size() || n <= 0) usage(flag + ": expected a positive integer, got '" + v + "'");
  return n;
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--", 0) != 0) {
      if (!o.out.empty()) usage("more than one output folder given");
      o.out = a;
      continue;
    }
    if (i + 1 >= argc) usage(a + " needs a value");
    const std::string v = argv[++i];
    if (a == "--hidden") o.hidden = positive(a, v);
    else if (a == "--layers") o.layers = positive(a, v);
    else if (a == "--heads") o.heads = positive(a, v);
    else if (a == "--kv-heads") o.kv_heads = positive(a, v);
    else if (a == "--ffn") o.ffn = positive(a, v);
    else if (a == "--max-positions") o.max_positions = positive(a, v);
    else if (a == "--seed") o.seed = static_cast<uint64_t>(positive(a, v));
    else if (a == "--experts") o.experts = positive(a, v);
    else if (a == "--top-k") o.top_k = positive(a, v);
    else if (a == "--alphabet") o.alphabet = v;
    else if (a == "--init-std") {
      try {
        o.init_std = std::stod(v);
      } catch (const std::exception&) {
        usage("--init-std: expected a number, got '" + v + "'");
      }
      if (!(o.init_std > 0)) usage("--init-std: expected a positive number");
    } else usage("unknown option " + a);
  }
  if (o.out.empty()) usage("no output folder given");
  if (o.hidden % o.heads != 0) usage("--hidden must be a multiple of --heads");
  if (o.heads % o.kv_heads != 0) usage("--heads must be a multiple of --kv-heads");
  if (o.experts > 0 && o.top_k > o.experts) usage("--top-k must be at most --experts");
  if (o.alphabet.empty()) usage("--alphabet is empty");
  for (size_t i = 0; i < o.alphabet.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(o.alphabet[i]);
    if (c < 0x20 || c >= 0x7f) usage("--alphabet: only printable ASCII characters");
    if (o.alphabet.find(o.alphabet[i]) != i) usage(std::string("--alphabet: '") + o.alphabet[i] + "' twice");
  }
  return o;
}

void write_text(const std::filesystem::path& p, const std::string& text) {
  std::ofstream f(p, std::ios::binary);
  f << text;
  if (!f) throw std::runtime_error(p.string() + ": cannot write");
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  try {
    std::filesystem::create_directories(o.out);
    const int64_t specials = 3;  // <pad>, <s>, </s>
    const int64_t n_tokens = specials + static_cast<int64_t>(o.alphabet.size());
    const int64_t vocab = (n_tokens + 15) / 16 * 16;  // padded like real vocabularies
    const int64_t head_dim = o.hidden / o.heads;

    json config = {{"architectures", {"LlamaForCausalLM"}},
                   {"model_type", "llama"},
                   {"attention_bias", false},
                   {"attention_dropout", 0.0},
                   {"bos_token_id", 1},
                   {"eos_token_id", 2},
                   {"pad_token_id", 0},
                   {"head_dim", head_dim},
                   {"hidden_act", "silu"},
                   {"hidden_size", o.hidden},
                   {"initializer_range", o.init_std},
                   {"intermediate_size", o.ffn},
                   {"max_position_embeddings", o.max_positions},
                   {"mlp_bias", false},
                   {"num_attention_heads", o.heads},
                   {"num_hidden_layers", o.layers},
                   {"num_key_value_heads", o.kv_heads},
                   {"rms_norm_eps", 1e-5},
                   {"rope_theta", 10000.0},
                   {"rope_scaling", nullptr},
                   {"tie_word_embeddings", false},
                   {"torch_dtype", "float32"},
                   {"use_cache", true},
                   {"vocab_size", vocab}};
    if (o.experts > 0) {
      config["architectures"] = {"MixtralForCausalLM"};
      config["model_type"] = "mixtral";
      config["num_local_experts"] = o.experts;
      config["num_experts_per_tok"] = o.top_k;
      config["router_aux_loss_coef"] = 0.0;
      config.erase("mlp_bias");
    }
    write_text(o.out / "config.json", config.dump(2) + "\n");
    write_text(o.out / "generation_config.json",
               json{{"bos_token_id", 1}, {"eos_token_id", 2}, {"pad_token_id", 0}}.dump(2) + "\n");

    // Weights, in HF's names and shapes.
    Normal rng{o.seed * 0x9E3779B97F4A7C15ull + 0x632BE59BD9B4E019ull};
    std::vector<std::pair<std::string, std::vector<int64_t>>> shapes;
    shapes.push_back({"model.embed_tokens.weight", {vocab, o.hidden}});
    for (int64_t l = 0; l < o.layers; ++l) {
      const std::string p = "model.layers." + std::to_string(l) + ".";
      shapes.push_back({p + "input_layernorm.weight", {o.hidden}});
      shapes.push_back({p + "self_attn.q_proj.weight", {o.heads * head_dim, o.hidden}});
      shapes.push_back({p + "self_attn.k_proj.weight", {o.kv_heads * head_dim, o.hidden}});
      shapes.push_back({p + "self_attn.v_proj.weight", {o.kv_heads * head_dim, o.hidden}});
      shapes.push_back({p + "self_attn.o_proj.weight", {o.hidden, o.heads * head_dim}});
      shapes.push_back({p + "post_attention_layernorm.weight", {o.hidden}});
      if (o.experts > 0) {
        shapes.push_back({p + "block_sparse_moe.gate.weight", {o.experts, o.hidden}});
        for (int64_t e = 0; e < o.experts; ++e) {
          const std::string x = p + "block_sparse_moe.experts." + std::to_string(e) + ".";
          shapes.push_back({x + "w1.weight", {o.ffn, o.hidden}});
          shapes.push_back({x + "w2.weight", {o.hidden, o.ffn}});
          shapes.push_back({x + "w3.weight", {o.ffn, o.hidden}});
        }
        continue;
      }
      shapes.push_back({p + "mlp.gate_proj.weight", {o.ffn, o.hidden}});
      shapes.push_back({p + "mlp.up_proj.weight", {o.ffn, o.hidden}});
      shapes.push_back({p + "mlp.down_proj.weight", {o.hidden, o.ffn}});
    }
    shapes.push_back({"model.norm.weight", {o.hidden}});
    shapes.push_back({"lm_head.weight", {vocab, o.hidden}});

    std::vector<std::vector<float>> data;
    std::vector<st::WriteTensor> tensors;
    data.reserve(shapes.size());
    for (const auto& [name, shape] : shapes) {
      int64_t n = 1;
      for (int64_t d : shape) n *= d;
      std::vector<float> v(static_cast<size_t>(n));
      const bool norm = shape.size() == 1;
      for (float& x : v) x = norm ? 1.0f : static_cast<float>(o.init_std * rng());
      data.push_back(std::move(v));
      st::WriteTensor t;
      t.name = name;
      t.dtype = st::DType::F32;
      t.shape = shape;
      t.data = std::as_bytes(std::span<const float>(data.back()));
      tensors.push_back(std::move(t));
    }
    st::sort_tensors_like_hf(tensors);
    st::write_file((o.out / "model.safetensors").string(), tensors);

    // Character-level tokenizer.
    json vocab_map = json::object();
    const char* special_names[] = {"<pad>", "<s>", "</s>"};
    json added = json::array();
    for (int64_t i = 0; i < specials; ++i) {
      vocab_map[special_names[i]] = i;
      added.push_back({{"id", i}, {"content", special_names[i]}, {"single_word", false},
                       {"lstrip", false}, {"rstrip", false}, {"normalized", false},
                       {"special", true}});
    }
    for (size_t i = 0; i < o.alphabet.size(); ++i)
      vocab_map[std::string(1, o.alphabet[i])] = specials + static_cast<int64_t>(i);
    json tokenizer = {{"version", "1.0"},
                      {"truncation", nullptr},
                      {"padding", nullptr},
                      {"added_tokens", added},
                      {"normalizer", nullptr},
                      {"pre_tokenizer", nullptr},
                      {"post_processor", nullptr},
                      {"decoder", {{"type", "Fuse"}}},
                      {"model",
                       {{"type", "BPE"},
                        {"dropout", nullptr},
                        {"unk_token", nullptr},
                        {"continuing_subword_prefix", nullptr},
                        {"end_of_word_suffix", nullptr},
                        {"fuse_unk", false},
                        {"byte_fallback", false},
                        {"ignore_merges", false},
                        {"vocab", vocab_map},
                        {"merges", json::array()}}}};
    write_text(o.out / "tokenizer.json", tokenizer.dump(2) + "\n");
    write_text(o.out / "tokenizer_config.json",
               json{{"bos_token", "<s>"},
                    {"eos_token", "</s>"},
                    {"pad_token", "<pad>"},
                    {"model_max_length", o.max_positions},
                    {"tokenizer_class", "PreTrainedTokenizerFast"}}
                       .dump(2) + "\n");

    int64_t params = 0;
    for (const auto& v : data) params += static_cast<int64_t>(v.size());
    std::printf("rlh_tiny_model: %s: %s d%lld x %lld layers, vocabulary %lld (%lld used), %lld parameters, seed %llu\n",
                o.out.string().c_str(), o.experts > 0 ? "Mixtral" : "Llama", static_cast<long long>(o.hidden),
                static_cast<long long>(o.layers), static_cast<long long>(vocab),
                static_cast<long long>(n_tokens), static_cast<long long>(params),
                static_cast<unsigned long long>(o.seed));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rlh_tiny_model: %s\n", e.what());
    return 1;
  }
  return 0;
}
