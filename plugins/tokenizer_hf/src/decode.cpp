// Decoders: see decode.hpp. Each class mirrors one HF decoder type.
#include "decode.hpp"

#include <algorithm>

#include "regex.hpp"
#include "unicode.hpp"

namespace rlh::tok {

std::unique_ptr<Regex> make_split_pattern(const json& o, const JPath& p);  // normalize.cpp

namespace {

std::vector<char32_t> to_cps(const std::string& s) {
  std::vector<char32_t> v;
  v.reserve(s.size());
  const char* p = s.data();
  const char* e = p + s.size();
  while (p < e) {
    char32_t c;
    p += uni::decode(p, e, c);
    v.push_back(c);
  }
  return v;
}

class SequenceDec final : public Decoder {
 public:
  std::vector<std::unique_ptr<Decoder>> items;
  void decode_chain(std::vector<std::string>& t) const override {
    for (const auto& d : items) d->decode_chain(t);
  }
};

// Printable characters back to bytes; a token with a character outside the alphabet keeps its
// own UTF-8 bytes. All tokens become one string, invalid UTF-8 replaced by U+FFFD.
class ByteLevelDec final : public Decoder {
 public:
  void decode_chain(std::vector<std::string>& t) const override {
    const auto& tab = uni::byte_level();
    std::string bytes;
    for (const std::string& tok : t) {
      const size_t mark = bytes.size();
      const char* p = tok.data();
      const char* e = p + tok.size();
      bool ok = true;
      while (p < e) {
        char32_t c;
        p += uni::decode(p, e, c);
        if (c >= 512 || tab.cp_to_byte[c] < 0) { ok = false; break; }
        bytes.push_back(static_cast<char>(tab.cp_to_byte[c]));
      }
      if (!ok) {
        bytes.resize(mark);
        bytes += tok;
      }
    }
    t.assign(1, uni::lossy(bytes));
  }
};

class MetaspaceDec final : public Decoder {
 public:
  MetaspaceDec(char32_t rep, bool prepend) : rep_(uni::to_utf8(rep)), prepend_(prepend) {}
  void decode_chain(std::vector<std::string>& t) const override {
    for (size_t i = 0; i < t.size(); ++i) {
      std::string out;
      size_t k = 0;
      const std::string& s = t[i];
      while (k < s.size()) {
        if (s.compare(k, rep_.size(), rep_) == 0) {
          if (!(i == 0 && prepend_)) out.push_back(' ');
          k += rep_.size();
        } else {
          out.push_back(s[k++]);
        }
      }
      t[i].swap(out);
    }
  }

 private:
  std::string rep_;
  bool prepend_;
};

class ReplaceDec final : public Decoder {
 public:
  ReplaceDec(std::unique_ptr<Regex> re, std::string content) : re_(std::move(re)), content_(std::move(content)) {}
  void decode_chain(std::vector<std::string>& t) const override {
    for (std::string& s : t) {
      std::string out;
      size_t last = 0;
      re_->for_each_match(s, [&](size_t b, size_t e) {
        out.append(s, last, b - last);
        out += content_;
        last = e;
      });
      out.append(s, last, std::string::npos);
      s.swap(out);
    }
  }

 private:
  std::unique_ptr<Regex> re_;
  std::string content_;
};

int hexval(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// <0xNN> tokens are gathered into bytes; a run that is not valid UTF-8 becomes one U+FFFD per
// byte (HF's rule, not the lossy one).
class ByteFallbackDec final : public Decoder {
 public:
  void decode_chain(std::vector<std::string>& t) const override {
    std::vector<std::string> out;
    out.reserve(t.size());
    std::string bytes;
    size_t nbytes = 0;
    auto flush = [&] {
      if (nbytes == 0) return;
      if (uni::find_invalid(bytes) == std::string_view::npos) out.push_back(bytes);
      else for (size_t i = 0; i < nbytes; ++i) out.emplace_back("\xEF\xBF\xBD");
      bytes.clear();
      nbytes = 0;
    };
    for (std::string& tok : t) {
      int v = -1;
      if (tok.size() == 6 && tok.compare(0, 3, "<0x") == 0 && tok[5] == '>') {
        // Rust's u8::from_str_radix accepts an optional leading '+'.
        const int h = hexval(tok[3]), l = hexval(tok[4]);
        if (h >= 0 && l >= 0) v = h * 16 + l;
        else if (tok[3] == '+' && l >= 0) v = l;
      }
      if (v >= 0) {
        bytes.push_back(static_cast<char>(v));
        ++nbytes;
      } else {
        flush();
        out.push_back(std::move(tok));
      }
    }
    flush();
    t.swap(out);
  }
};

class FuseDec final : public Decoder {
 public:
  void decode_chain(std::vector<std::string>& t) const override {
    std::string all;
    for (const auto& s : t) all += s;
    t.assign(1, std::move(all));
  }
};

class StripDec final : public Decoder {
 public:
  StripDec(char32_t c, size_t start, size_t stop) : c_(c), start_(start), stop_(stop) {}
  void decode_chain(std::vector<std::string>& t) const override {
    for (std::string& s : t) {
      const auto cps = to_cps(s);
      size_t b = 0;
      for (size_t i = 0; i < std::min(start_, cps.size()) && cps[i] == c_; ++i) b = i + 1;
      size_t e = cps.size();
      for (size_t i = 0; i < std::min(stop_, cps.size()) && cps[cps.size() - i - 1] == c_; ++i) e = cps.size() - i - 1;
      std::string out;
      for (size_t i = b; i < e; ++i) uni::append(out, cps[i]);
      s.swap(out);
    }
  }

 private:
  char32_t c_;
  size_t start_, stop_;
};

class BpeDec final : public Decoder {
 public:
  explicit BpeDec(std::string suffix) : suffix_(std::move(suffix)) {}
  void decode_chain(std::vector<std::string>& t) const override {
    for (size_t i = 0; i < t.size(); ++i) {
      if (suffix_.empty()) continue;
      const std::string rep = i + 1 == t.size() ? "" : " ";
      std::string out;
      size_t k = 0, f;
      while ((f = t[i].find(suffix_, k)) != std::string::npos) {
        out.append(t[i], k, f - k);
        out += rep;
        k = f + suffix_.size();
      }
      out.append(t[i], k, std::string::npos);
      t[i].swap(out);
    }
  }

 private:
  std::string suffix_;
};

// HF WordPiece decoder: "##" continuations glue on, others get a leading space; optional cleanup
// of spaces before punctuation and common English contractions.
class WordPieceDec final : public Decoder {
 public:
  WordPieceDec(std::string prefix, bool cleanup) : prefix_(std::move(prefix)), cleanup_(cleanup) {}
  static void replace_all(std::string& s, const std::string& a, const std::string& b) {
    size_t k = 0;
    while ((k = s.find(a, k)) != std::string::npos) {
      s.replace(k, a.size(), b);
      k += b.size();
    }
  }
  void decode_chain(std::vector<std::string>& t) const override {
    for (size_t i = 0; i < t.size(); ++i) {
      if (i != 0) {
        if (t[i].compare(0, prefix_.size(), prefix_) == 0) t[i].erase(0, prefix_.size());
        else t[i].insert(0, " ");
      }
      if (cleanup_) {
        for (const char* a : {" .", " ?", " !", " ,"}) replace_all(t[i], a, std::string(a + 1));
        replace_all(t[i], " ' ", "'");
        replace_all(t[i], " n't", "n't");
        replace_all(t[i], " 'm", "'m");
        replace_all(t[i], " do not", " don't");
        replace_all(t[i], " 's", "'s");
        replace_all(t[i], " 've", "'ve");
        replace_all(t[i], " 're", "'re");
      }
    }
  }

 private:
  std::string prefix_;
  bool cleanup_;
};

}  // namespace

std::unique_ptr<Decoder> make_decoder(const json& j, const JPath& p, int depth) {
  if (j.is_null()) return nullptr;
  if (depth > 32) p.fail("decoders nested too deeply");
  if (!j.is_object()) p.fail(std::string("expected an object, got ") + json_kind(j));
  const std::string type = need_string(j, "type", p);
  if (type == "Sequence") {
    auto seq = std::make_unique<SequenceDec>();
    const json& items = need(j, "decoders", p);
    if (!items.is_array()) p.at("decoders").fail("expected an array");
    for (size_t i = 0; i < items.size(); ++i) {
      if (auto d = make_decoder(items[i], p.at("decoders").at(i), depth + 1)) seq->items.push_back(std::move(d));
    }
    return seq;
  }
  if (type == "ByteLevel") return std::make_unique<ByteLevelDec>();
  if (type == "Metaspace") {
    const char32_t rep = member(j, "replacement") ? need_char(j, "replacement", p) : U'\u2581';
    bool prepend = true;
    if (auto ps = opt_string(j, "prepend_scheme", p)) prepend = *ps != "never";
    if (member(j, "add_prefix_space") && !opt_bool(j, "add_prefix_space", p, true)) prepend = false;
    return std::make_unique<MetaspaceDec>(rep, prepend);
  }
  if (type == "Replace") return std::make_unique<ReplaceDec>(make_split_pattern(j, p), need_string(j, "content", p));
  if (type == "ByteFallback") return std::make_unique<ByteFallbackDec>();
  if (type == "Fuse") return std::make_unique<FuseDec>();
  if (type == "Strip") {
    const json* st = member(j, "start");
    const json* sp = member(j, "stop");
    return std::make_unique<StripDec>(need_char(j, "content", p),
                                      st ? need_uint(*st, p.at("start"), 1u << 30) : 0,
                                      sp ? need_uint(*sp, p.at("stop"), 1u << 30) : 0);
  }
  if (type == "BPEDecoder") return std::make_unique<BpeDec>(opt_string(j, "suffix", p).value_or("</w>"));
  if (type == "WordPiece") {
    return std::make_unique<WordPieceDec>(opt_string(j, "prefix", p).value_or("##"), opt_bool(j, "cleanup", p, true));
  }
  p.at("type").fail("unknown or unsupported decoder type \"" + type + "\"");
}

}  // namespace rlh::tok
