// Deciding whether two math answers are the same: shape (single value, tuple or interval, set,
// text), then values exactly where possible, else by a relative tolerance.
#include <cctype>
#include <cmath>

#include "math_internal.hpp"
#include "rlhost/environments/math_answer.hpp"

namespace rlh::environments {
namespace {

using math::NodePtr;

struct Answer {
  enum Kind { kExpr, kTuple, kSet, kText } kind = kText;
  char open = 0, close = 0;  // tuple brackets; 0 when written bare ("1, 2")
  std::vector<NodePtr> items;
  std::string text;  // kText: the case-folded form
  bool percent = false;
};

// Splits at commas outside any brackets.
std::vector<std::string> split_top_level(std::string_view s) {
  std::vector<std::string> parts;
  int depth = 0;
  size_t start = 0;
  for (size_t i = 0; i < s.size(); ++i) {
    const char c = s[i];
    if (c == '(' || c == '[' || c == '{') ++depth;
    else if (c == ')' || c == ']' || c == '}') --depth;
    else if (c == ',' && depth == 0) {
      parts.emplace_back(s.substr(start, i - start));
      start = i + 1;
    }
  }
  parts.emplace_back(s.substr(start));
  return parts;
}

// True when the bracket at s[0] closes at the last character ("(1,2)" but not "(1)+(2)").
bool outer_brackets_enclose(std::string_view s) {
  int depth = 0;
  for (size_t i = 0; i < s.size(); ++i) {
    const char c = s[i];
    if (c == '(' || c == '[' || c == '{') ++depth;
    else if (c == ')' || c == ']' || c == '}') {
      if (--depth == 0) return i == s.size() - 1;
    }
  }
  return false;
}

// Words ("yes", "Monday", "no solution") compare as text, not as products of letters; pi is a
// number however it is written.
bool is_word_answer(const std::string& s) {
  // ^[A-Za-z ]*[A-Za-z]{2,}[A-Za-z ]*$ scanned by hand: std::regex recurses once per character
  // and a 30 KB answer of letters overflowed the stack.
  bool two_letters = false;
  for (size_t i = 0; i < s.size(); ++i) {
    const bool alpha = std::isalpha(static_cast<unsigned char>(s[i])) != 0;
    if (!alpha && s[i] != ' ') return false;
    two_letters |= alpha && i > 0 && std::isalpha(static_cast<unsigned char>(s[i - 1])) != 0;
  }
  if (!two_letters) return false;
  std::string folded;
  for (char c : s)
    if (c != ' ') folded.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(c))));
  return folded != "pi";
}

Answer parse_answer(std::string_view raw) {
  Answer a;
  const std::string s = math::drop_thousands_separators(math::normalize_latex(raw));
  a.text = math::normalize_text(raw);
  if (s.empty() || is_word_answer(s)) return a;
  std::vector<std::string> parts;
  if (s.size() >= 4 && s.compare(0, 2, "\\{") == 0 && s.compare(s.size() - 2, 2, "\\}") == 0) {
    a.kind = Answer::kSet;
    parts = split_top_level(std::string_view(s).substr(2, s.size() - 4));
  } else {
    parts = split_top_level(s);
    if (parts.size() > 1) {
      a.kind = Answer::kTuple;
    } else if ((s.front() == '(' || s.front() == '[') && (s.back() == ')' || s.back() == ']') &&
               outer_brackets_enclose(s)) {
      auto inner = split_top_level(std::string_view(s).substr(1, s.size() - 2));
      if (inner.size() > 1) {
        a.kind = Answer::kTuple;
        a.open = s.front();
        a.close = s.back();
        parts = std::move(inner);
      }
    }
    if (a.kind != Answer::kTuple) a.kind = Answer::kExpr;
  }
  for (const auto& p : parts) {
    auto node = math::parse_expression(p);
    if (!node) {
      a.kind = Answer::kText;
      a.items.clear();
      return a;
    }
    a.percent |= math::contains_percent(*node);
    a.items.push_back(*node);
  }
  return a;
}

bool values_equal(const NodePtr& x, bool px, const NodePtr& y, bool py, const MathCompareOptions& opts) {
  math::charge(1);
  // The same expression written the same way is the same value, even where neither exact
  // arithmetic nor floats can hold it (10^{10^{10}}) -- unless it has no value at all (1/0).
  if (px == py && math::same_tree(x, y)) return math::eval_float(x, 0, px).has_value();
  const auto ex = math::eval_exact(x, px), ey = math::eval_exact(y, py);
  if (ex && ey) return *ex == *ey;
  for (int point = 0; point < 3; ++point) {
    const auto fx = math::eval_float(x, point, px), fy = math::eval_float(y, point, py);
    // Infinities and overflow are only decided exactly.
    if (!fx || !fy || !std::isfinite(*fx) || !std::isfinite(*fy)) return false;
    const long double diff = std::fabs(*fx - *fy);
    if (diff > opts.relative_tolerance * std::max(std::fabs(*fx), std::fabs(*fy))) return false;
  }
  return true;
}

bool answers_equal(const Answer& a, bool pa, const Answer& b, bool pb, const MathCompareOptions& opts) {
  if (a.kind == Answer::kText || b.kind == Answer::kText)
    return a.kind == b.kind && !a.text.empty() && a.text == b.text;
  if (a.kind != b.kind || a.items.size() != b.items.size()) return false;
  if (a.kind == Answer::kTuple && a.open != 0 && b.open != 0 && (a.open != b.open || a.close != b.close))
    return false;  // (1, 2] is not [1, 2]
  if (a.kind == Answer::kSet) {
    std::vector<bool> used(b.items.size(), false);
    for (const auto& x : a.items) {
      bool found = false;
      for (size_t j = 0; j < b.items.size() && !found; ++j)
        if (!used[j] && values_equal(x, pa, b.items[j], pb, opts)) used[j] = found = true;
      if (!found) return false;
    }
    return true;
  }
  for (size_t i = 0; i < a.items.size(); ++i)
    if (!values_equal(a.items[i], pa, b.items[i], pb, opts)) return false;
  return true;
}

}  // namespace

namespace {

bool compare_answers(std::string_view candidate, std::string_view ground_truth, const MathCompareOptions& opts) {
  if (candidate.size() > opts.max_answer_bytes || ground_truth.size() > opts.max_answer_bytes)
    throw math::OverBudget{"an answer longer than " + std::to_string(opts.max_answer_bytes) + " bytes"};
  const Answer a = parse_answer(candidate), b = parse_answer(ground_truth);
  // A percent sign on one side only may or may not mean /100 ("25%" vs "0.25" or "25"); on both
  // sides the numbers are compared as written.
  if (a.percent && !b.percent)
    return answers_equal(a, true, b, false, opts) || answers_equal(a, false, b, false, opts);
  if (b.percent && !a.percent)
    return answers_equal(a, false, b, true, opts) || answers_equal(a, false, b, false, opts);
  return answers_equal(a, false, b, false, opts);
}

}  // namespace

bool math_equal(std::string_view candidate, std::string_view ground_truth, const MathCompareOptions& opts) {
  try {
    math::WorkBudget budget(opts.max_work, opts.max_seconds);
    return compare_answers(candidate, ground_truth, opts);
  } catch (const math::OverBudget&) {
    return false;
  }
}

MathVerdict score_math_response(std::string_view response, std::string_view ground_truth,
                                const MathCompareOptions& opts) {
  MathVerdict v;
  try {
    math::WorkBudget budget(opts.max_work, opts.max_seconds);
    if (response.size() > opts.max_response_bytes)
      throw math::OverBudget{"a response longer than " + std::to_string(opts.max_response_bytes) + " bytes"};
    // A ground truth given as \boxed{...} (NeMo-RL wraps it so) is unwrapped first.
    std::string truth(ground_truth);
    if (truth.find("\\boxed") != std::string::npos) truth = extract_answer(truth).text;
    const ExtractedAnswer got = extract_answer(response);
    v.boxed = got.source == AnswerSource::kBoxed;
    v.correct = got.source != AnswerSource::kNone && compare_answers(got.text, truth, opts);
  } catch (const math::OverBudget& e) {
    v.correct = v.boxed = false;  // nothing about it counts
    v.over_budget = true;
    v.why = e.what;
  } catch (const std::bad_alloc&) {
    v.correct = v.boxed = false;
    v.over_budget = true;
    v.why = "out of memory";
  }
  return v;
}

namespace {

std::string describe_parsed(std::string_view answer) {
  const Answer a = parse_answer(answer);
  if (a.kind == Answer::kText) return "text: " + a.text;
  auto item = [&](const NodePtr& n) {
    if (auto e = math::eval_exact(n, false)) return e->to_string();
    if (auto f = math::eval_float(n, 0, false)) {
      char buf[64];
      std::snprintf(buf, sizeof(buf), "~%.12Lg", *f);
      return std::string(buf);
    }
    return std::string("undefined");
  };
  if (a.kind == Answer::kExpr) return (math::eval_exact(a.items[0], false) ? "exact: " : "float: ") + item(a.items[0]);
  std::string out = a.kind == Answer::kSet ? "set {" : std::string("tuple ") + (a.open ? a.open : '(');
  for (size_t i = 0; i < a.items.size(); ++i) out += (i ? ", " : "") + item(a.items[i]);
  out += a.kind == Answer::kSet ? '}' : (a.close ? a.close : ')');
  return out;
}

}  // namespace

std::string describe_answer(std::string_view answer, const MathCompareOptions& opts) {
  try {
    math::WorkBudget budget(opts.max_work, opts.max_seconds);
    if (answer.size() > opts.max_answer_bytes)
      throw math::OverBudget{"an answer longer than " + std::to_string(opts.max_answer_bytes) + " bytes"};
    return describe_parsed(answer);
  } catch (const math::OverBudget& e) {
    return "over budget: " + e.what;
  }
}

}  // namespace rlh::environments
