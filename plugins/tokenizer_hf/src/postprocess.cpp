// Post-processors: see postprocess.hpp.
#include "postprocess.hpp"

#include <map>
#include <string>

namespace rlh::tok {

namespace {

// prefix + ids + suffix (TemplateProcessing reduced to a single-sequence template, and Bert /
// Roberta which are fixed templates).
class WrapPP final : public PostProcessor {
 public:
  WrapPP(std::vector<int32_t> pre, std::vector<int32_t> post) : pre_(std::move(pre)), post_(std::move(post)) {}
  void process(std::vector<int32_t>& ids) const override {
    ids.insert(ids.begin(), pre_.begin(), pre_.end());
    ids.insert(ids.end(), post_.begin(), post_.end());
  }

 private:
  std::vector<int32_t> pre_, post_;
};

class SequencePP final : public PostProcessor {
 public:
  std::vector<std::unique_ptr<PostProcessor>> items;
  void process(std::vector<int32_t>& ids) const override {
    for (const auto& p : items) p->process(ids);
  }
};

class NoopPP final : public PostProcessor {
 public:
  void process(std::vector<int32_t>&) const override {}
};

// ["[CLS]", 101]
int32_t token_pair_id(const json& o, std::string_view key, const JPath& p) {
  const json& v = need(o, key, p);
  if (!v.is_array() || v.size() != 2 || !v[0].is_string()) p.at(key).fail("expected [token, id]");
  return static_cast<int32_t>(need_uint(v[1], p.at(key).at(1), 0x7FFFFFFF));
}

struct Piece {
  bool is_seq = false;
  std::string name;  // special token name, or "A"/"B"
};

// "$A", "$B:1", "$0", "[CLS]", "[CLS]:0"
Piece parse_piece_string(const std::string& s, const JPath& p) {
  std::string body = s;
  const auto colon = s.rfind(':');
  if (colon != std::string::npos && colon + 1 < s.size() &&
      s.find_first_not_of("0123456789", colon + 1) == std::string::npos) {
    body = s.substr(0, colon);
  }
  if (!body.empty() && body[0] == '$') {
    const std::string id = body.substr(1);
    if (id.empty() || id == "A" || id == "a") return {true, "A"};
    if (id == "B" || id == "b") return {true, "B"};
    if (id.find_first_not_of("0123456789") == std::string::npos) return {true, "A"};  // "$0": A with type id 0
    p.fail("bad template piece \"" + s + "\"");
  }
  return {false, body};
}

std::vector<Piece> parse_template(const json& t, const JPath& p) {
  std::vector<Piece> out;
  if (t.is_string()) {
    const std::string& s = t.get_ref<const std::string&>();
    size_t k = 0;
    while (k < s.size()) {
      const size_t e = s.find(' ', k);
      const std::string w = s.substr(k, e == std::string::npos ? std::string::npos : e - k);
      if (!w.empty()) out.push_back(parse_piece_string(w, p));
      if (e == std::string::npos) break;
      k = e + 1;
    }
    return out;
  }
  if (!t.is_array()) p.fail("expected a list of template pieces");
  for (size_t i = 0; i < t.size(); ++i) {
    const json& e = t[i];
    const JPath ep = p.at(i);
    if (e.is_string()) {
      out.push_back(parse_piece_string(e.get<std::string>(), ep));
    } else if (e.is_object() && e.contains("Sequence")) {
      const std::string id = need_string(e["Sequence"], "id", ep.at("Sequence"));
      if (id != "A" && id != "B") ep.at("Sequence").at("id").fail("expected \"A\" or \"B\"");
      out.push_back({true, id});
    } else if (e.is_object() && e.contains("SpecialToken")) {
      out.push_back({false, need_string(e["SpecialToken"], "id", ep.at("SpecialToken"))});
    } else {
      ep.fail("expected {\"Sequence\": ...} or {\"SpecialToken\": ...}");
    }
  }
  return out;
}

}  // namespace

std::unique_ptr<PostProcessor> make_bos_eos_processor(std::vector<int32_t> prefix, std::vector<int32_t> suffix) {
  return std::make_unique<WrapPP>(std::move(prefix), std::move(suffix));
}

std::unique_ptr<PostProcessor> make_post_processor(const json& j, const JPath& p, int depth) {
  if (j.is_null()) return nullptr;
  if (depth > 32) p.fail("post-processors nested too deeply");
  if (!j.is_object()) p.fail(std::string("expected an object, got ") + json_kind(j));
  const std::string type = need_string(j, "type", p);
  if (type == "Sequence") {
    auto seq = std::make_unique<SequencePP>();
    const json& items = need(j, "processors", p);
    if (!items.is_array()) p.at("processors").fail("expected an array");
    for (size_t i = 0; i < items.size(); ++i) {
      if (auto pp = make_post_processor(items[i], p.at("processors").at(i), depth + 1)) seq->items.push_back(std::move(pp));
    }
    return seq;
  }
  if (type == "ByteLevel") return std::make_unique<NoopPP>();
  if (type == "BertProcessing" || type == "RobertaProcessing") {
    return std::make_unique<WrapPP>(std::vector<int32_t>{token_pair_id(j, "cls", p)},
                                    std::vector<int32_t>{token_pair_id(j, "sep", p)});
  }
  if (type == "TemplateProcessing") {
    // special_tokens: {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}
    std::map<std::string, std::vector<int32_t>> specials;
    if (const json* st = member(j, "special_tokens")) {
      const JPath sp = p.at("special_tokens");
      if (!st->is_object()) sp.fail("expected an object");
      for (auto it = st->begin(); it != st->end(); ++it) {
        const JPath ip = sp.at(it.key());
        const json& ids = need(it.value(), "ids", ip);
        if (!ids.is_array()) ip.at("ids").fail("expected an array of ids");
        std::vector<int32_t> v;
        for (size_t k = 0; k < ids.size(); ++k) v.push_back(static_cast<int32_t>(need_uint(ids[k], ip.at("ids").at(k), 0x7FFFFFFF)));
        specials[it.key()] = std::move(v);
      }
    }
    const json* single = member(j, "single");
    std::vector<Piece> pieces = single ? parse_template(*single, p.at("single")) : std::vector<Piece>{{true, "A"}};
    std::vector<int32_t> pre, post;
    bool seen_a = false;
    for (const Piece& pc : pieces) {
      if (pc.is_seq) {
        if (pc.name == "B") p.at("single").fail("single-sequence template uses $B");
        if (seen_a) p.at("single").fail("template uses $A twice");
        seen_a = true;
        continue;
      }
      auto it = specials.find(pc.name);
      if (it == specials.end()) p.at("single").fail("special token \"" + pc.name + "\" is not in special_tokens");
      auto& dst = seen_a ? post : pre;
      dst.insert(dst.end(), it->second.begin(), it->second.end());
    }
    if (!seen_a) p.at("single").fail("template has no $A");
    return std::make_unique<WrapPP>(std::move(pre), std::move(post));
  }
  p.at("type").fail("unknown post-processor type \"" + type + "\"");
}

}  // namespace rlh::tok
