// Tokenizer: loads tokenizer.json (+ tokenizer_config.json) and runs the encode/decode pipeline.
//
// encode: added tokens (raw) -> normalizer -> added tokens (normalized) -> pre-tokenizer -> BPE
//         -> post-processor.   decode: ids -> token strings -> decoder chain -> text.
#include "rlhost/tokenizer/tokenizer.hpp"

#include <algorithm>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <unordered_map>
#include <unordered_set>

#include "added_tokens.hpp"
#include "bpe.hpp"
#include "decode.hpp"
#include "json_util.hpp"
#include "normalize.hpp"
#include "postprocess.hpp"
#include "pretokenize.hpp"
#include "rlhost/sdk/input_file.hpp"
#include "rlhost/sdk/hf_cache.hpp"
#include "rlhost/tokenizer/chat_template.hpp"
#include "unicode.hpp"

namespace rlh::tok {

struct Tokenizer::Impl {
  std::string name;  // file name used in messages
  std::unique_ptr<Normalizer> normalizer;
  std::unique_ptr<PreTokenizer> pre;
  std::unique_ptr<BpeModel> model;
  std::unique_ptr<PostProcessor> post;
  std::unique_ptr<PostProcessor> config_post;  // from add_bos_token/add_eos_token, overrides `post`
  std::unique_ptr<Decoder> decoder;
  std::vector<AddedToken> added;
  std::unordered_map<int32_t, size_t> added_by_id;
  Vocab added_by_content;
  AddedTokenMatcher raw_matcher, norm_matcher;
  TokenizerConfig config;

  void encode_segment(std::string_view seg, bool at_origin, std::vector<int32_t>& out) const;
  void model_pieces(std::string_view s, bool at_origin, std::vector<int32_t>& out) const;
  std::optional<int32_t> to_id(std::string_view tok) const {
    if (auto it = added_by_content.find(tok); it != added_by_content.end()) return it->second;
    return model->token_to_id(tok);
  }
  void rebuild_config_post();
};

namespace {

// Tokenizer files are at most tens of MB (the largest tokenizer.json on the Hub is ~35 MB), so
// 256 MiB is far above any; parsed, a JSON file takes several times its size in memory.
// only regular files are read (a FIFO named tokenizer.json would block forever).
constexpr uint64_t kMaxTokenizerFileBytes = 256u << 20;

std::string read_file(const std::filesystem::path& p) {
  return sdk::read_input_file(p.string(), kMaxTokenizerFileBytes, "tokenizer file");
}

}  // namespace

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

Tokenizer Tokenizer::from_json_string(std::string_view text, std::string_view name_sv) {
  auto impl = std::make_unique<Impl>();
  impl->name = std::string(name_sv);
  const json root = parse_json_text(text, impl->name);
  const JPath rp{impl->name, ""};
  if (!root.is_object()) rp.fail(std::string("expected an object, got ") + json_kind(root));
  if (auto v = opt_string(root, "version", rp); v && *v != "1.0") {
    rp.at("version").fail("unknown tokenizer version \"" + *v + "\"");
  }
  if (const json* tr = member(root, "truncation")) {
    (void)tr;  // truncation/padding only matter for batched HF calls; rlhost never truncates here
  }
  impl->normalizer = make_normalizer(root.value("normalizer", json()), rp.at("normalizer"));
  impl->pre = std::make_unique<PreTokenizer>(root.value("pre_tokenizer", json()), rp.at("pre_tokenizer"));
  impl->model = std::make_unique<BpeModel>(need(root, "model", rp), rp.at("model"));
  impl->post = make_post_processor(root.value("post_processor", json()), rp.at("post_processor"));
  impl->decoder = make_decoder(root.value("decoder", json()), rp.at("decoder"));

  // Added tokens: ids come from the model vocabulary when the content is there, else the next
  // free id after the vocabulary (HF ignores the "id" field except for a warning).
  if (const json* at = member(root, "added_tokens")) {
    const JPath ap = rp.at("added_tokens");
    if (!at->is_array()) ap.fail("expected an array");
    int32_t next_id = static_cast<int32_t>(impl->model->size());
    for (size_t i = 0; i < at->size(); ++i) {
      const json& e = (*at)[i];
      const JPath ep = ap.at(i);
      if (!e.is_object()) ep.fail("expected an object");
      AddedToken t;
      t.content = need_string(e, "content", ep);
      if (const json* id = member(e, "id")) need_uint(*id, ep.at("id"), 0x7FFFFFFF);
      t.single_word = opt_bool(e, "single_word", ep, false);
      t.lstrip = opt_bool(e, "lstrip", ep, false);
      t.rstrip = opt_bool(e, "rstrip", ep, false);
      t.special = opt_bool(e, "special", ep, false);
      t.normalized = opt_bool(e, "normalized", ep, !t.special);
      if (t.content.empty()) continue;
      if (auto known = impl->to_id(t.content)) t.id = *known;
      else t.id = next_id++;
      t.match_form = t.content;
      if (t.normalized && impl->normalizer) {
        bool o = true;
        impl->normalizer->normalize(t.match_form, o, normalized_cap(t.match_form.size()));
      }
      auto prev = impl->added_by_id.find(t.id);
      if (prev != impl->added_by_id.end()) {
        impl->added[prev->second] = t;  // same content again: its newest flags win
      } else {
        impl->added_by_id[t.id] = impl->added.size();
        impl->added.push_back(t);
      }
      impl->added_by_content[t.content] = t.id;
    }
  }
  impl->raw_matcher.build(impl->added, false);
  impl->norm_matcher.build(impl->added, true);
  return Tokenizer(std::move(impl));
}

Tokenizer Tokenizer::from_file(const std::filesystem::path& path) {
  return from_json_string(read_file(path), path.filename().string());
}

Tokenizer Tokenizer::from_dir(const std::filesystem::path& dir) {
  const auto tj = dir / "tokenizer.json";
  if (!std::filesystem::exists(tj)) {
    throw std::runtime_error(dir.string() + ": no tokenizer.json in this directory");
  }
  Tokenizer t = from_file(tj);
  const auto cfg = dir / "tokenizer_config.json";
  if (std::filesystem::exists(cfg)) t.apply_config_json(read_file(cfg), "tokenizer_config.json");
  const auto gen = dir / "generation_config.json";
  if (std::filesystem::exists(gen)) {
    const json g = parse_json_text(read_file(gen), "generation_config.json");
    const JPath gp{"generation_config.json", ""};
    if (const json* e = member(g, "eos_token_id")) {
      auto& ids = t.impl_->config.generation_eos_ids;
      if (e->is_array()) {
        for (size_t i = 0; i < e->size(); ++i) ids.push_back(static_cast<int32_t>(need_uint((*e)[i], gp.at("eos_token_id").at(i), 0x7FFFFFFF)));
      } else {
        ids.push_back(static_cast<int32_t>(need_uint(*e, gp.at("eos_token_id"), 0x7FFFFFFF)));
      }
    }
  }
  // Newer transformers save the default template as its own file.
  const auto jinja = dir / "chat_template.jinja";
  if (std::filesystem::exists(jinja)) {
    std::string src = read_file(jinja);
    auto& ts = t.impl_->config.chat_templates;
    bool replaced = false;
    for (auto& [n, s] : ts) if (n == "default") { s = src; replaced = true; }
    if (!replaced) ts.insert(ts.begin(), {"default", std::move(src)});
  }
  return t;
}

Tokenizer Tokenizer::from_pretrained(std::string_view spec) {
  const std::filesystem::path p(spec);
  std::error_code ec;
  if (std::filesystem::is_regular_file(p, ec)) return from_file(p);
  return from_dir(rlh::sdk::resolve_model_path(spec));
}

void Tokenizer::Impl::rebuild_config_post() {
  config_post.reset();
  if (!config.add_bos_token && !config.add_eos_token) return;
  std::vector<int32_t> pre, suf;
  if (config.add_bos_token.value_or(false) && config.bos_token) {
    auto id = to_id(*config.bos_token);
    if (!id) throw std::runtime_error(name + ": bos_token \"" + *config.bos_token + "\" is not in the vocabulary");
    pre.push_back(*id);
  }
  if (config.add_eos_token.value_or(false) && config.eos_token) {
    auto id = to_id(*config.eos_token);
    if (!id) throw std::runtime_error(name + ": eos_token \"" + *config.eos_token + "\" is not in the vocabulary");
    suf.push_back(*id);
  }
  config_post = make_bos_eos_processor(std::move(pre), std::move(suf));
}

void Tokenizer::apply_config_json(std::string_view text, std::string_view name_sv) {
  const std::string name(name_sv);
  const json root = parse_json_text(text, name);
  const JPath rp{name, ""};
  if (!root.is_object()) rp.fail(std::string("expected an object, got ") + json_kind(root));
  TokenizerConfig& c = impl_->config;
  // Special tokens appear as plain strings or as serialized AddedToken objects.
  auto tok = [&](const char* key) -> std::optional<std::string> {
    const json* v = member(root, key);
    if (!v) return std::nullopt;
    if (v->is_string()) return v->get<std::string>();
    if (v->is_object()) return need_string(*v, "content", rp.at(key));
    rp.at(key).fail("expected a string or {\"content\": ...}");
  };
  c.bos_token = tok("bos_token");
  c.eos_token = tok("eos_token");
  c.pad_token = tok("pad_token");
  c.unk_token = tok("unk_token");
  if (member(root, "add_bos_token")) c.add_bos_token = need_bool(root, "add_bos_token", rp);
  if (member(root, "add_eos_token")) c.add_eos_token = need_bool(root, "add_eos_token", rp);
  c.chat_templates.clear();
  if (const json* ct = member(root, "chat_template")) {
    const JPath cp = rp.at("chat_template");
    if (ct->is_string()) {
      c.chat_templates.emplace_back("default", ct->get<std::string>());
    } else if (ct->is_array()) {
      for (size_t i = 0; i < ct->size(); ++i) {
        const json& e = (*ct)[i];
        if (!e.is_object()) cp.at(i).fail("expected {\"name\": ..., \"template\": ...}");
        c.chat_templates.emplace_back(need_string(e, "name", cp.at(i)), need_string(e, "template", cp.at(i)));
      }
    } else {
      cp.fail("expected a string or a list of {\"name\", \"template\"}");
    }
  }
  impl_->rebuild_config_post();
}

// One piece of text between added tokens: normalize, split on normalized added tokens,
// pre-tokenize, run the model.
void Tokenizer::Impl::encode_segment(std::string_view seg, bool at_origin, std::vector<int32_t>& out) const {
  if (!normalizer) {
    if (norm_matcher.empty()) {
      model_pieces(seg, at_origin, out);
      return;
    }
    auto sink = [&](size_t b, size_t e, int32_t id) {
      if (id >= 0) out.push_back(id);
      else if (e > b) model_pieces(seg.substr(b, e - b), at_origin && b == 0, out);
    };
    norm_matcher.split(seg, added, SegmentSink(sink));
    return;
  }
  std::string s(seg);
  bool origin = at_origin;
  normalizer->normalize(s, origin, normalized_cap(s.size()));
  if (s.size() > normalized_cap(seg.size()))
    throw std::runtime_error("tokenizer normalizer: the normalized text grows past " +
                             std::to_string(normalized_cap(seg.size())) +
                             " bytes (16x the input); the tokenizer.json's normalizers multiply the text");
  if (s.empty()) return;
  auto sink = [&](size_t b, size_t e, int32_t id) {
    if (id >= 0) out.push_back(id);
    else if (e > b) model_pieces(std::string_view(s).substr(b, e - b), origin && b == 0, out);
  };
  norm_matcher.split(s, added, SegmentSink(sink));
}

void Tokenizer::Impl::model_pieces(std::string_view s, bool at_origin, std::vector<int32_t>& out) const {
  const bool bytes = pre->model_maps_bytes();
  auto word = [&](std::string_view w, bool) { model->encode_word(w, bytes, out); };
  pre->run(s, at_origin, PieceSink(word));
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool add_special_tokens) const {
  if (const size_t bad = uni::find_invalid(text); bad != std::string_view::npos) {
    throw std::invalid_argument("tokenizer: input is not valid UTF-8 (byte " + std::to_string(bad) + ")");
  }
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + 8);
  const Impl& im = *impl_;
  auto sink = [&](size_t b, size_t e, int32_t id) {
    if (id >= 0) out.push_back(id);
    else if (e > b) im.encode_segment(text.substr(b, e - b), b == 0, out);
  };
  im.raw_matcher.split(text, im.added, SegmentSink(sink));
  if (add_special_tokens) {
    if (im.config_post) im.config_post->process(out);
    else if (im.post) im.post->process(out);
  }
  return out;
}

std::string Tokenizer::decode(std::span<const int32_t> ids, bool skip_special_tokens) const {
  const Impl& im = *impl_;
  std::vector<std::string> toks;
  toks.reserve(ids.size());
  for (const int32_t id : ids) {
    auto a = im.added_by_id.find(id);
    if (a != im.added_by_id.end()) {
      const AddedToken& t = im.added[a->second];
      if (skip_special_tokens && t.special) continue;
      // Normalized added tokens decode from their normalized form (HF's normalized cache).
      toks.push_back(t.normalized ? t.match_form : t.content);
      continue;
    }
    const std::string* t = im.model->id_to_token(id);
    if (!t) continue;  // unknown ids are dropped, as HF does
    if (skip_special_tokens) {
      // HF skips by content: a model token whose text equals a special added token is skipped.
      auto c = im.added_by_content.find(*t);
      if (c != im.added_by_content.end() && im.added[im.added_by_id.at(c->second)].special) continue;
    }
    toks.push_back(*t);
  }
  if (!im.decoder) {
    std::string out;
    for (size_t i = 0; i < toks.size(); ++i) {
      if (i) out.push_back(' ');
      out += toks[i];
    }
    return out;
  }
  im.decoder->decode_chain(toks);
  std::string out;
  for (const auto& t : toks) out += t;
  return out;
}

std::optional<int32_t> Tokenizer::token_to_id(std::string_view token) const { return impl_->to_id(token); }

std::optional<std::string> Tokenizer::id_to_token(int32_t id) const {
  if (auto a = impl_->added_by_id.find(id); a != impl_->added_by_id.end()) return impl_->added[a->second].content;
  if (const std::string* t = impl_->model->id_to_token(id)) return *t;
  return std::nullopt;
}

size_t Tokenizer::vocab_size() const {
  size_t n = impl_->model->size();
  for (const auto& t : impl_->added) if (!impl_->model->token_to_id(t.content)) ++n;
  return n;
}

bool Tokenizer::is_special(int32_t id) const {
  auto a = impl_->added_by_id.find(id);
  return a != impl_->added_by_id.end() && impl_->added[a->second].special;
}

const TokenizerConfig& Tokenizer::config() const { return impl_->config; }

std::optional<std::string> Tokenizer::bos_token() const { return impl_->config.bos_token; }
std::optional<std::string> Tokenizer::eos_token() const { return impl_->config.eos_token; }

std::optional<int32_t> Tokenizer::bos_id() const {
  return impl_->config.bos_token ? impl_->to_id(*impl_->config.bos_token) : std::nullopt;
}
std::optional<int32_t> Tokenizer::eos_id() const {
  return impl_->config.eos_token ? impl_->to_id(*impl_->config.eos_token) : std::nullopt;
}
std::optional<int32_t> Tokenizer::pad_id() const {
  return impl_->config.pad_token ? impl_->to_id(*impl_->config.pad_token) : std::nullopt;
}

std::vector<int32_t> Tokenizer::eos_ids() const {
  std::vector<int32_t> ids;
  if (auto e = eos_id()) ids.push_back(*e);
  for (const int32_t id : impl_->config.generation_eos_ids) {
    if (std::find(ids.begin(), ids.end(), id) == ids.end()) ids.push_back(id);
  }
  return ids;
}

std::optional<ChatTemplate> Tokenizer::chat_template(std::string_view name) const {
  const auto& ts = impl_->config.chat_templates;
  const std::string* src = nullptr;
  const std::string want = name.empty() ? "default" : std::string(name);
  for (const auto& [n, s] : ts) if (n == want) src = &s;
  if (!src && name.empty() && ts.size() == 1) src = &ts[0].second;
  if (!src) {
    if (!name.empty()) throw std::runtime_error("tokenizer: no chat template named \"" + std::string(name) + "\"");
    return std::nullopt;
  }
  nlohmann::json defaults = nlohmann::json::object();
  const auto& c = impl_->config;
  auto put = [&](const char* k, const std::optional<std::string>& v) {
    if (v) defaults[k] = *v;
  };
  put("bos_token", c.bos_token);
  put("eos_token", c.eos_token);
  put("pad_token", c.pad_token);
  put("unk_token", c.unk_token);
  return ChatTemplate(*src, std::move(defaults));
}

}  // namespace rlh::tok
