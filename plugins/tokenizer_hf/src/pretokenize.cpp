// Pre-tokenizers: see pretokenize.hpp. Each class mirrors one HF pre-tokenizer type.
#include "pretokenize.hpp"

#include <algorithm>
#include <string>

#include "regex.hpp"
#include "unicode.hpp"

namespace rlh::tok {

void PieceBudget::spend(size_t n) {
  if (n > left_)
    throw std::runtime_error("tokenizer pre-tokenizer: the pre-tokenized text grows past " + std::to_string(cap_) +
                             " bytes (16x the input); the tokenizer.json's pre-tokenizers multiply the text");
  left_ -= n;
}

namespace {

// A run of the input and whether it matched the split pattern.
struct Seg {
  size_t b, e;
  bool m;
};

// HF NormalizedString::split: merges segments per behavior, drops empty pieces.
void emit_split(std::string_view s, std::vector<Seg>& segs, SplitBehavior bh, bool at_origin,
                const PieceSink& next) {
  auto out = [&](size_t b, size_t e) {
    if (e > b) next(s.substr(b, e - b), at_origin && b == 0);
  };
  switch (bh) {
    case SplitBehavior::Isolated:
      for (const Seg& g : segs) out(g.b, g.e);
      return;
    case SplitBehavior::Removed:
      for (const Seg& g : segs) if (!g.m) out(g.b, g.e);
      return;
    case SplitBehavior::Contiguous: {
      std::vector<Seg> acc;
      bool prev = false;
      for (const Seg& g : segs) {
        if (g.m == prev && !acc.empty()) acc.back().e = g.e;
        else acc.push_back({g.b, g.e, false});
        prev = g.m;
      }
      for (const Seg& g : acc) out(g.b, g.e);
      return;
    }
    case SplitBehavior::MergedWithPrevious: {
      std::vector<Seg> acc;
      bool prev = false;
      for (const Seg& g : segs) {
        if (g.m && !prev && !acc.empty()) acc.back().e = g.e;
        else acc.push_back({g.b, g.e, false});
        prev = g.m;
      }
      for (const Seg& g : acc) out(g.b, g.e);
      return;
    }
    case SplitBehavior::MergedWithNext: {
      std::vector<Seg> acc;
      bool prev = false;
      for (size_t k = segs.size(); k-- > 0;) {
        const Seg& g = segs[k];
        if (g.m && !prev && !acc.empty()) acc.back().b = g.b;
        else acc.push_back({g.b, g.e, false});
        prev = g.m;
      }
      for (size_t k = acc.size(); k-- > 0;) out(acc[k].b, acc[k].e);
      return;
    }
  }
}

// Segments of `s` where every character satisfying `pred` is its own match.
template <class Pred>
std::vector<Seg> char_segments(std::string_view s, Pred&& pred) {
  std::vector<Seg> segs;
  size_t last = 0, i = 0;
  const char* base = s.data();
  while (i < s.size()) {
    char32_t c;
    const int n = uni::decode(base + i, base + s.size(), c);
    if (pred(c)) {
      if (last < i) segs.push_back({last, i, false});
      segs.push_back({i, i + n, true});
      last = i + n;
    }
    i += n;
  }
  if (last < s.size()) segs.push_back({last, s.size(), false});
  return segs;
}

std::vector<Seg> regex_segments(std::string_view s, const Regex& re, bool invert) {
  std::vector<Seg> segs;
  size_t prev = 0;
  re.for_each_match(s, [&](size_t b, size_t e) {
    if (prev != b) segs.push_back({prev, b, invert});
    segs.push_back({b, e, !invert});
    prev = e;
  });
  if (prev != s.size()) segs.push_back({prev, s.size(), invert});
  return segs;
}

class SplitStep final : public PreTokenizeStep {
 public:
  SplitStep(std::unique_ptr<Regex> re, SplitBehavior bh, bool invert)
      : re_(std::move(re)), bh_(bh), invert_(invert) {}
  void run(std::string_view s, bool at_origin, const PieceSink& next, PieceBudget& budget) const override {
    if (bh_ == SplitBehavior::Isolated) {
      // Hot path (Llama-3, Qwen2): every gap and every match is a piece; stream them.
      size_t prev = 0;
      re_->for_each_match(s, [&](size_t b, size_t e) {
        if (prev != b) next(s.substr(prev, b - prev), at_origin && prev == 0);
        if (e > b) next(s.substr(b, e - b), at_origin && b == 0);
        prev = e;
      });
      if (prev < s.size()) next(s.substr(prev), at_origin && prev == 0);
      return;
    }
    auto segs = regex_segments(s, *re_, invert_);
    emit_split(s, segs, bh_, at_origin, next);
  }

 private:
  std::unique_ptr<Regex> re_;
  SplitBehavior bh_;
  bool invert_;
};

const Regex& gpt2_regex() {
  static const Regex re(R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)", false);
  return re;
}

class ByteLevelStep final : public PreTokenizeStep {
 public:
  ByteLevelStep(bool add_prefix_space, bool use_regex) : prefix_(add_prefix_space), regex_(use_regex) {}
  bool defer = false;  // the model applies the byte remap
  void run(std::string_view s, bool at_origin, const PieceSink& next, PieceBudget& budget) const override {
    std::string tmp;
    if (prefix_ && (s.empty() || s[0] != ' ')) {
      budget.spend(s.size() + 1);
      tmp.reserve(s.size() + 1);
      tmp.push_back(' ');
      tmp.append(s);
      s = tmp;
    }
    auto piece = [&](std::string_view w, bool o) {
      if (defer) {
        next(w, o);
      } else {
        budget.spend(2 * w.size());  // at most 2 bytes per byte
        std::string mapped;
        uni::append_byte_level(mapped, w);
        next(mapped, o);
      }
    };
    if (!regex_) {
      if (!s.empty()) piece(s, at_origin);
      return;
    }
    size_t prev = 0;
    gpt2_regex().for_each_match(s, [&](size_t b, size_t e) {
      if (prev != b) piece(s.substr(prev, b - prev), at_origin && prev == 0);
      if (e > b) piece(s.substr(b, e - b), at_origin && b == 0);
      prev = e;
    });
    if (prev < s.size()) piece(s.substr(prev), at_origin && prev == 0);
  }

 private:
  bool prefix_, regex_;
};

enum class Prepend { Always, First, Never };

class MetaspaceStep final : public PreTokenizeStep {
 public:
  MetaspaceStep(char32_t rep, Prepend scheme, bool split)
      : rep_(rep), rep_utf8_(uni::to_utf8(rep)), scheme_(scheme), split_(split) {}
  void run(std::string_view s, bool at_origin, const PieceSink& next, PieceBudget& budget) const override {
    size_t spaces = 0;
    for (const char c : s) spaces += c == ' ';
    budget.spend(s.size() + (spaces + 1) * rep_utf8_.size());
    std::string t;
    t.reserve(s.size() + 8);
    for (const char c : s) {
      if (c == ' ') t += rep_utf8_;
      else t.push_back(c);
    }
    const bool starts = t.compare(0, rep_utf8_.size(), rep_utf8_) == 0;
    if (!starts && (scheme_ == Prepend::Always || (scheme_ == Prepend::First && at_origin))) {
      t.insert(0, rep_utf8_);
    }
    if (!split_) {
      if (!t.empty()) next(t, at_origin);
      return;
    }
    auto segs = char_segments(t, [&](char32_t c) { return c == rep_; });
    emit_split(t, segs, SplitBehavior::MergedWithNext, at_origin, next);
  }

 private:
  char32_t rep_;
  std::string rep_utf8_;
  Prepend scheme_;
  bool split_;
};

// Splits on single characters that satisfy a predicate (Punctuation, Digits, WhitespaceSplit...).
template <class Pred>
class CharSplitStep final : public PreTokenizeStep {
 public:
  CharSplitStep(Pred pred, SplitBehavior bh) : pred_(pred), bh_(bh) {}
  void run(std::string_view s, bool at_origin, const PieceSink& next, PieceBudget& budget) const override {
    auto segs = char_segments(s, pred_);
    emit_split(s, segs, bh_, at_origin, next);
  }

 private:
  Pred pred_;
  SplitBehavior bh_;
};
template <class Pred>
std::unique_ptr<PreTokenizeStep> char_split(Pred p, SplitBehavior bh) {
  return std::make_unique<CharSplitStep<Pred>>(p, bh);
}

// HF Whitespace: the matches of \w+|[^\w\s]+ (Rust's Unicode \w and \s).
class WhitespaceStep final : public PreTokenizeStep {
 public:
  void run(std::string_view s, bool at_origin, const PieceSink& next, PieceBudget& budget) const override {
    size_t i = 0, start = 0;
    int cls = 0;  // 0 space, 1 word, 2 other
    const char* base = s.data();
    while (i < s.size()) {
      char32_t c;
      const int n = uni::decode(base + i, base + s.size(), c);
      const int k = uni::is_word(c) ? 1 : uni::is_whitespace(c) ? 0 : 2;
      if (k != cls) {
        if (cls != 0 && i > start) next(s.substr(start, i - start), at_origin && start == 0);
        start = i;
        cls = k;
      }
      i += n;
    }
    if (cls != 0 && i > start) next(s.substr(start, i - start), at_origin && start == 0);
  }
};

class FixedLengthStep final : public PreTokenizeStep {
 public:
  explicit FixedLengthStep(size_t n) : n_(n) {}
  void run(std::string_view s, bool at_origin, const PieceSink& next, PieceBudget& budget) const override {
    size_t i = 0;
    while (i < s.size()) {
      size_t j = i;
      for (size_t k = 0; k < n_ && j < s.size(); ++k) j += uni::seq_len(static_cast<unsigned char>(s[j]));
      j = std::min(j, s.size());
      next(s.substr(i, j - i), at_origin && i == 0);
      i = j;
    }
  }

 private:
  size_t n_;
};

}  // namespace

SplitBehavior parse_behavior(const json& o, std::string_view key, const JPath& p, SplitBehavior dflt) {
  const json* v = member(o, key);
  if (!v) return dflt;
  if (!v->is_string()) p.at(key).fail("expected a string");
  const std::string& b = v->get_ref<const std::string&>();
  if (b == "Removed") return SplitBehavior::Removed;
  if (b == "Isolated") return SplitBehavior::Isolated;
  if (b == "MergedWithPrevious") return SplitBehavior::MergedWithPrevious;
  if (b == "MergedWithNext") return SplitBehavior::MergedWithNext;
  if (b == "Contiguous") return SplitBehavior::Contiguous;
  p.at(key).fail("unknown split behavior \"" + b + "\"");
}

PreTokenizer::PreTokenizer(const json& j, const JPath& p) {
  if (!j.is_null()) add(j, p, 0);
  if (!steps_.empty()) {
    if (auto* bl = dynamic_cast<ByteLevelStep*>(steps_.back().get())) {
      bl->defer = true;
      model_maps_bytes_ = true;
    }
  }
}

PreTokenizer::~PreTokenizer() = default;

void PreTokenizer::add(const json& j, const JPath& p, int depth) {
  if (depth > 32) p.fail("pre-tokenizers nested too deeply");
  if (steps_.size() >= kMaxSteps) p.fail("more than " + std::to_string(kMaxSteps) + " pre-tokenizer steps");
  if (!j.is_object()) p.fail(std::string("expected an object, got ") + json_kind(j));
  const std::string type = need_string(j, "type", p);
  if (type == "Sequence") {
    const json& items = need(j, "pretokenizers", p);
    if (!items.is_array()) p.at("pretokenizers").fail("expected an array");
    for (size_t i = 0; i < items.size(); ++i) {
      if (!items[i].is_null()) add(items[i], p.at("pretokenizers").at(i), depth + 1);
    }
  } else if (type == "Split") {
    const SplitBehavior bh = parse_behavior(j, "behavior", p, SplitBehavior::Isolated);
    steps_.push_back(std::make_unique<SplitStep>(make_split_pattern(j, p), bh, opt_bool(j, "invert", p, false)));
  } else if (type == "ByteLevel") {
    steps_.push_back(std::make_unique<ByteLevelStep>(opt_bool(j, "add_prefix_space", p, true),
                                                     opt_bool(j, "use_regex", p, true)));
  } else if (type == "Metaspace") {
    const char32_t rep = member(j, "replacement") ? need_char(j, "replacement", p) : U'\u2581';
    Prepend scheme = Prepend::Always;
    if (auto ps = opt_string(j, "prepend_scheme", p)) {
      if (*ps == "always") scheme = Prepend::Always;
      else if (*ps == "first") scheme = Prepend::First;
      else if (*ps == "never") scheme = Prepend::Never;
      else p.at("prepend_scheme").fail("expected \"always\", \"first\" or \"never\", got \"" + *ps + "\"");
    }
    if (member(j, "add_prefix_space") && !opt_bool(j, "add_prefix_space", p, true)) {
      // Legacy field: add_prefix_space=false means never (HF rejects a contradicting scheme).
      if (member(j, "prepend_scheme") && scheme != Prepend::Never) {
        p.at("add_prefix_space").fail("add_prefix_space does not match declared prepend_scheme");
      }
      scheme = Prepend::Never;
    }
    steps_.push_back(std::make_unique<MetaspaceStep>(rep, scheme, opt_bool(j, "split", p, true)));
  } else if (type == "Whitespace") {
    steps_.push_back(std::make_unique<WhitespaceStep>());
  } else if (type == "WhitespaceSplit") {
    steps_.push_back(char_split([](char32_t c) { return uni::is_whitespace(c); }, SplitBehavior::Removed));
  } else if (type == "Punctuation") {
    steps_.push_back(char_split([](char32_t c) { return uni::is_punctuation(c); },
                                parse_behavior(j, "behavior", p, SplitBehavior::Isolated)));
  } else if (type == "Digits") {
    steps_.push_back(char_split([](char32_t c) { return uni::is_numeric(c); },
                                opt_bool(j, "individual_digits", p, false) ? SplitBehavior::Isolated
                                                                          : SplitBehavior::Contiguous));
  } else if (type == "BertPreTokenizer") {
    steps_.push_back(char_split([](char32_t c) { return uni::is_whitespace(c); }, SplitBehavior::Removed));
    steps_.push_back(char_split([](char32_t c) { return uni::is_punctuation(c); }, SplitBehavior::Isolated));
  } else if (type == "CharDelimiterSplit") {
    const char32_t d = need_char(j, "delimiter", p);
    steps_.push_back(char_split([d](char32_t c) { return c == d; }, SplitBehavior::Removed));
  } else if (type == "FixedLength") {
    const json* l = member(j, "length");
    const size_t n = l ? need_uint(*l, p.at("length"), 1u << 20) : 5;
    if (n == 0) p.at("length").fail("must be positive");
    steps_.push_back(std::make_unique<FixedLengthStep>(n));
  } else {
    p.at("type").fail("unknown or unsupported pre-tokenizer type \"" + type + "\"");
  }
}

void PreTokenizer::run_from(size_t i, std::string_view s, bool at_origin, const PieceSink& sink,
                            PieceBudget& budget) const {
  if (i == steps_.size()) {
    sink(s, at_origin);
    return;
  }
  auto next = [&](std::string_view piece, bool o) { run_from(i + 1, piece, o, sink, budget); };
  steps_[i]->run(s, at_origin, PieceSink(next), budget);
}

}  // namespace rlh::tok
