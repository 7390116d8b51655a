// Normalizers: see normalize.hpp. Each class mirrors one HF normalizer type.
#include "normalize.hpp"

#include <utf8proc.h>  // utf8proc_map: NFC/NFD/NFKC/NFKD

#include <cstdlib>
#include <vector>

#include "regex.hpp"
#include "unicode.hpp"

namespace rlh::tok {

namespace {

[[noreturn]] void grew_past(size_t cap) {
  throw std::runtime_error("tokenizer normalizer: the normalized text grows past " + std::to_string(cap) +
                           " bytes (16x the input); the tokenizer.json's normalizers multiply the text");
}
void check_cap(const std::string& s, size_t cap) {
  if (s.size() > cap) grew_past(cap);
}

// Applies f(cp, out) to every code point.
template <class F>
std::string map_chars(const std::string& s, F&& f) {
  std::string out;
  out.reserve(s.size());
  const char* p = s.data();
  const char* end = p + s.size();
  while (p < end) {
    char32_t c;
    p += uni::decode(p, end, c);
    f(c, out);
  }
  return out;
}

class SequenceNorm final : public Normalizer {
 public:
  std::vector<std::unique_ptr<Normalizer>> items;
  void normalize(std::string& s, bool& at_origin, size_t cap) const override {
    for (const auto& n : items) {
      n->normalize(s, at_origin, cap);
      check_cap(s, cap);
    }
  }
};

class UnicodeNorm final : public Normalizer {
 public:
  explicit UnicodeNorm(int options) : options_(options) {}
  void normalize(std::string& s, bool&, size_t cap) const override {
    if (s.empty()) return;
    bool ascii = true;
    for (const char c : s) if (static_cast<unsigned char>(c) >= 0x80) { ascii = false; break; }
    if (ascii) return;  // ASCII is invariant under every normalization form
    utf8proc_uint8_t* out = nullptr;
    const auto n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(s.data()),
                                static_cast<utf8proc_ssize_t>(s.size()), &out,
                                static_cast<utf8proc_option_t>(options_));
    if (n < 0) throw std::runtime_error(std::string("unicode normalization failed: ") + utf8proc_errmsg(n));
    s.assign(reinterpret_cast<char*>(out), static_cast<size_t>(n));
    std::free(out);
  }

 private:
  int options_;
};

class LowercaseNorm final : public Normalizer {
 public:
  void normalize(std::string& s, bool&, size_t cap) const override {
    s = map_chars(s, [](char32_t c, std::string& o) { uni::append_lower(o, c); });
  }
};

class StripNorm final : public Normalizer {
 public:
  StripNorm(bool l, bool r) : left_(l), right_(r) {}
  void normalize(std::string& s, bool& at_origin, size_t cap) const override {
    size_t b = 0, e = s.size();
    const char* base = s.data();
    if (left_) {
      while (b < e) {
        char32_t c;
        const int n = uni::decode(base + b, base + e, c);
        if (!uni::is_whitespace(c)) break;
        b += static_cast<size_t>(n);
      }
    }
    if (right_) {
      while (e > b) {
        size_t k = e - 1;
        while (k > b && (static_cast<unsigned char>(s[k]) & 0xC0) == 0x80) --k;
        char32_t c;
        uni::decode(base + k, base + e, c);
        if (!uni::is_whitespace(c)) break;
        e = k;
      }
    }
    if (b > 0 && b < s.size()) at_origin = false;
    s = s.substr(b, e - b);
  }

 private:
  bool left_, right_;
};

class StripAccentsNorm final : public Normalizer {
 public:
  void normalize(std::string& s, bool&, size_t cap) const override {
    s = map_chars(s, [](char32_t c, std::string& o) {
      if (!uni::is_combining_mark(c)) uni::append(o, c);
    });
  }
};

class ReplaceNorm final : public Normalizer {
 public:
  ReplaceNorm(std::unique_ptr<Regex> re, std::string content)
      : re_(std::move(re)), content_(std::move(content)) {}
  void normalize(std::string& s, bool& at_origin, size_t cap) const override {
    std::string out;
    size_t last = 0;
    bool any = false;
    re_->for_each_match(s, [&](size_t b, size_t e) {
      if (!any) { out.reserve(s.size()); any = true; }
      if (b == 0 && e > 0 && content_.empty()) at_origin = false;
      out.append(s, last, b - last);
      out += content_;
      if (out.size() > cap) grew_past(cap);
      last = e;
    });
    if (!any) return;
    out.append(s, last, std::string::npos);
    s.swap(out);
  }

 private:
  std::unique_ptr<Regex> re_;
  std::string content_;
};

class PrependNorm final : public Normalizer {
 public:
  explicit PrependNorm(std::string p) : prepend_(std::move(p)) {}
  void normalize(std::string& s, bool&, size_t cap) const override {
    if (!s.empty()) s.insert(0, prepend_);
  }

 private:
  std::string prepend_;
};

class ByteLevelNorm final : public Normalizer {
 public:
  void normalize(std::string& s, bool&, size_t cap) const override {
    std::string out;
    uni::append_byte_level(out, s);
    s.swap(out);
  }
};

class NmtNorm final : public Normalizer {
 public:
  void normalize(std::string& s, bool&, size_t cap) const override {
    s = map_chars(s, [](char32_t c, std::string& o) {
      if ((c >= 0x1 && c <= 0x8) || c == 0xB || (c >= 0xE && c <= 0x1F) || c == 0x7F || c == 0x8F ||
          c == 0x9F) {
        return;
      }
      const bool space = c == 0x9 || c == 0xA || c == 0xC || c == 0xD || c == 0x1680 ||
                         (c >= 0x200B && c <= 0x200F) || c == 0x2028 || c == 0x2029 ||
                         c == 0x2581 || c == 0xFEFF || c == 0xFFFD;
      uni::append(o, space ? U' ' : c);
    });
  }
};

class BertNorm final : public Normalizer {
 public:
  bool clean_text = true, chinese = true, strip_accents = true, lowercase = true;
  void normalize(std::string& s, bool&, size_t cap) const override {
    if (clean_text) {
      s = map_chars(s, [](char32_t c, std::string& o) {
        const bool ctl = !(c == '\t' || c == '\n' || c == '\r') &&
                         (utf8proc_category(static_cast<utf8proc_int32_t>(c)) >= UTF8PROC_CATEGORY_CC ||
                          utf8proc_category(static_cast<utf8proc_int32_t>(c)) == UTF8PROC_CATEGORY_CN);
        if (c == 0 || c == 0xFFFD || ctl) return;
        uni::append(o, uni::is_whitespace(c) ? U' ' : c);
      });
    }
    if (chinese) {
      s = map_chars(s, [](char32_t c, std::string& o) {
        if (uni::is_cjk(c)) { o.push_back(' '); uni::append(o, c); o.push_back(' '); }
        else uni::append(o, c);
      });
    }
    if (strip_accents) {
      bool dummy = true;
      UnicodeNorm(UTF8PROC_STABLE | UTF8PROC_DECOMPOSE).normalize(s, dummy, cap);
      s = map_chars(s, [](char32_t c, std::string& o) {
        if (utf8proc_category(static_cast<utf8proc_int32_t>(c)) != UTF8PROC_CATEGORY_MN) uni::append(o, c);
      });
    }
    if (lowercase) {
      bool dummy2 = true;
      LowercaseNorm().normalize(s, dummy2, cap);
    }
  }
};

// {"String": "..."} or {"Regex": "..."} as used by Replace and Split.
std::unique_ptr<Regex> make_pattern(const json& o, const JPath& p) {
  const json& pat = need(o, "pattern", p);
  const JPath pp = p.at("pattern");
  if (!pat.is_object() || pat.size() != 1) pp.fail("expected {\"String\": ...} or {\"Regex\": ...}");
  const bool literal = pat.contains("String");
  if (!literal && !pat.contains("Regex")) pp.fail("expected {\"String\": ...} or {\"Regex\": ...}");
  const std::string s = need_string(pat, literal ? "String" : "Regex", pp);
  try {
    return std::make_unique<Regex>(s, literal);
  } catch (const std::runtime_error& e) {
    pp.at(literal ? "String" : "Regex").fail(e.what());
  }
}

}  // namespace

std::unique_ptr<Regex> make_split_pattern(const json& o, const JPath& p) { return make_pattern(o, p); }

std::unique_ptr<Normalizer> make_normalizer(const json& j, const JPath& p, int depth) {
  if (j.is_null()) return nullptr;
  if (depth > 32) p.fail("normalizers nested too deeply");
  if (!j.is_object()) p.fail(std::string("expected an object, got ") + json_kind(j));
  const std::string type = need_string(j, "type", p);
  if (type == "Sequence") {
    auto seq = std::make_unique<SequenceNorm>();
    const json& items = need(j, "normalizers", p);
    if (!items.is_array()) p.at("normalizers").fail("expected an array");
    for (size_t i = 0; i < items.size(); ++i) {
      auto n = make_normalizer(items[i], p.at("normalizers").at(i), depth + 1);
      if (n) seq->items.push_back(std::move(n));
    }
    return seq;
  }
  if (type == "NFC") return std::make_unique<UnicodeNorm>(UTF8PROC_STABLE | UTF8PROC_COMPOSE);
  if (type == "NFD") return std::make_unique<UnicodeNorm>(UTF8PROC_STABLE | UTF8PROC_DECOMPOSE);
  if (type == "NFKC") return std::make_unique<UnicodeNorm>(UTF8PROC_STABLE | UTF8PROC_COMPOSE | UTF8PROC_COMPAT);
  if (type == "NFKD") return std::make_unique<UnicodeNorm>(UTF8PROC_STABLE | UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT);
  if (type == "Lowercase") return std::make_unique<LowercaseNorm>();
  if (type == "Strip") {
    return std::make_unique<StripNorm>(opt_bool(j, "strip_left", p, true), opt_bool(j, "strip_right", p, true));
  }
  if (type == "StripAccents") return std::make_unique<StripAccentsNorm>();
  if (type == "Replace") {
    return std::make_unique<ReplaceNorm>(make_pattern(j, p), need_string(j, "content", p));
  }
  if (type == "Prepend") return std::make_unique<PrependNorm>(need_string(j, "prepend", p));
  if (type == "ByteLevel") return std::make_unique<ByteLevelNorm>();
  if (type == "Nmt") return std::make_unique<NmtNorm>();
  if (type == "BertNormalizer") {
    auto b = std::make_unique<BertNorm>();
    b->clean_text = opt_bool(j, "clean_text", p, true);
    b->chinese = opt_bool(j, "handle_chinese_chars", p, true);
    b->lowercase = opt_bool(j, "lowercase", p, true);
    b->strip_accents = opt_bool(j, "strip_accents", p, b->lowercase);
    return b;
  }
  if (type == "Precompiled") {
    // An empty charsmap (some converted BPE files carry one) normalizes nothing.
    const json* cm = member(j, "precompiled_charsmap");
    if (!cm || (cm->is_string() && cm->get_ref<const std::string&>().empty())) {
      return std::make_unique<SequenceNorm>();
    }
    p.at("type").fail("normalizer \"Precompiled\" (SentencePiece charsmap) is not supported");
  }
  p.at("type").fail("unknown normalizer type \"" + type + "\"");
}

}  // namespace rlh::tok
