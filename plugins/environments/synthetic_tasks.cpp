// The synthetic tasks: seeded generation, solving and scoring.
#include "rlhost/environments/synthetic_tasks.hpp"

#include <algorithm>
#include <cctype>
#include <vector>

#include "rlhost/sdk/status.hpp"

namespace rlh::environments {
namespace {

using json = nlohmann::json;
using rlh::sdk::Error;

// splitmix64: a generator fixed by its definition, so rows are the same on every platform
// (std distributions are not).
struct Rng {
  uint64_t s;
  uint64_t next() {
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  uint64_t below(uint64_t n) {  // uniform in [0, n), no modulo bias
    const uint64_t limit = UINT64_MAX - UINT64_MAX % n;
    for (;;)
      if (const uint64_t v = next(); v < limit) return v % n;
  }
  int64_t between(int64_t lo, int64_t hi) { return lo + static_cast<int64_t>(below(static_cast<uint64_t>(hi - lo + 1))); }
};

// Row `index`'s generator: seed, task and index mixed so neighbouring rows are unrelated.
Rng row_rng(const TaskConfig& c, uint64_t index) {
  Rng mix{c.seed ^ (static_cast<uint64_t>(c.kind) + 1) * 0xD1B54A32D192ED03ull};
  mix.s ^= mix.next() + index * 0x9E3779B97F4A7C15ull;
  return Rng{mix.next()};
}

std::string int128_text(__int128 v) {
  if (v == 0) return "0";
  const bool neg = v < 0;
  unsigned __int128 u = neg ? static_cast<unsigned __int128>(-(v + 1)) + 1 : static_cast<unsigned __int128>(v);
  std::string s;
  while (u > 0) {
    s.push_back(static_cast<char>('0' + static_cast<int>(u % 10)));
    u /= 10;
  }
  if (neg) s.push_back('-');
  std::reverse(s.begin(), s.end());
  return s;
}

std::string trim(std::string_view s) {
  size_t b = 0, e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  return std::string(s.substr(b, e - b));
}

std::vector<std::string> items_of(std::string_view s) {  // split on whitespace and commas
  std::vector<std::string> out;
  std::string cur;
  for (char c : s) {
    if (std::isspace(static_cast<unsigned char>(c)) || c == ',') {
      if (!cur.empty()) out.push_back(std::move(cur));
      cur.clear();
    } else {
      cur.push_back(c);
    }
  }
  if (!cur.empty()) out.push_back(std::move(cur));
  return out;
}

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? " " : "") + v[i];
  return s;
}

// Evaluates "a op b op c" (digits and + - *, * first).
std::optional<__int128> evaluate_arithmetic(std::string_view q) {
  std::vector<__int128> terms;  // summands after applying *
  __int128 cur = 0;
  char pending_add = '+';
  size_t i = 0;
  auto number = [&](__int128& out) {
    if (i >= q.size() || !std::isdigit(static_cast<unsigned char>(q[i]))) return false;
    out = 0;
    size_t digits = 0;
    while (i < q.size() && std::isdigit(static_cast<unsigned char>(q[i]))) {
      if (++digits > 18) return false;
      out = out * 10 + (q[i++] - '0');
    }
    return true;
  };
  if (!number(cur)) return std::nullopt;
  for (;;) {
    if (i >= q.size()) return std::nullopt;
    const char op = q[i++];
    if (op == '=' && i == q.size()) break;
    __int128 v;
    if (!number(v)) return std::nullopt;
    if (op == '*') {
      cur *= v;
    } else if (op == '+' || op == '-') {
      terms.push_back(pending_add == '+' ? cur : -cur);
      pending_add = op;
      cur = v;
    } else {
      return std::nullopt;
    }
  }
  terms.push_back(pending_add == '+' ? cur : -cur);
  __int128 sum = 0;
  for (auto t : terms) sum += t;
  return sum;
}

std::string resolve_alphabet(const TaskConfig& c) {
  const std::string a = c.alphabet.empty() ? (c.kind == TaskKind::kSort ? "digits" : "letters") : c.alphabet;
  if (a == "digits") return "0123456789";
  if (a == "letters") return "abcdefghijklmnopqrstuvwxyz";
  return a;
}

// Fraction of positions equal, over the longer length.
template <typename Seq>
double positional_match(const Seq& got, const Seq& want) {
  const size_t n = std::max(got.size(), want.size());
  if (n == 0) return 1.0;
  size_t same = 0;
  for (size_t i = 0; i < std::min(got.size(), want.size()); ++i) same += got[i] == want[i];
  return static_cast<double>(same) / static_cast<double>(n);
}

bool is_integer_literal(std::string_view s) {
  size_t i = (!s.empty() && s[0] == '-') ? 1 : 0;
  if (i >= s.size()) return false;
  for (; i < s.size(); ++i)
    if (!std::isdigit(static_cast<unsigned char>(s[i]))) return false;
  return true;
}

}  // namespace

const char* task_name(TaskKind k) {
  switch (k) {
    case TaskKind::kArithmetic: return "arithmetic";
    case TaskKind::kSort: return "sort";
    case TaskKind::kCopy: return "copy";
    case TaskKind::kReverse: return "reverse";
  }
  return "?";
}

TaskConfig TaskConfig::from_json(TaskKind kind, const json& j, const std::string& origin) {
  TaskConfig c;
  c.kind = kind;
  c.prompt_template = kind == TaskKind::kArithmetic ? "{}" : std::string(task_name(kind)) + " {} =";
  if (j.is_null()) return c;
  if (!j.is_object()) throw Error(RLH_E_INVALID_ARGUMENT, origin + ": expected a mapping, got " + j.dump());
  auto bad = [&](const std::string& key, const std::string& why, const json& v) {
    throw Error(RLH_E_INVALID_ARGUMENT, origin + "." + key + ": " + why + ", got " + v.dump());
  };
  auto int_in = [&](const std::string& key, const json& v, int64_t lo, int64_t hi) {
    if (!v.is_number_integer() || v.get<int64_t>() < lo || v.get<int64_t>() > hi)
      bad(key, "expected an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]", v);
    return v.get<int64_t>();
  };
  const bool arith = kind == TaskKind::kArithmetic;
  for (const auto& [key, v] : j.items()) {
    if (v.is_null()) continue;
    if (key == "dataset_name" || key == "split") {
      continue;  // chosen by the caller (which component, train or validation)
    } else if (key == "seed") {
      if (!v.is_number_integer()) bad(key, "expected an integer", v);
      c.seed = static_cast<uint64_t>(v.get<int64_t>());
    } else if (key == "size") {
      c.size = int_in(key, v, 1, int64_t{1} << 40);
    } else if (key == "prompt_template") {
      if (!v.is_string() || v.get<std::string>().find("{}") == std::string::npos)
        bad(key, "expected a string containing {} for the question", v);
      c.prompt_template = v.get<std::string>();
    } else if (arith && key == "num_digits") {
      c.num_digits = static_cast<int>(int_in(key, v, 1, 9));
    } else if (arith && key == "num_operands") {
      c.num_operands = static_cast<int>(int_in(key, v, 2, 4));
    } else if (arith && key == "operators") {
      const std::string ops = v.is_string() ? v.get<std::string>() : "";
      if (ops.empty() || ops.find_first_not_of("+-*") != std::string::npos)
        bad(key, "expected a non-empty string of + - *", v);
      c.operators = ops;
    } else if (arith && key == "allow_negative") {
      if (!v.is_boolean()) bad(key, "expected true or false", v);
      c.allow_negative = v.get<bool>();
    } else if (!arith && key == "min_length") {
      c.min_length = static_cast<int>(int_in(key, v, 1, 4096));
    } else if (!arith && key == "max_length") {
      c.max_length = static_cast<int>(int_in(key, v, 1, 4096));
    } else if (!arith && key == "alphabet") {
      const std::string a = v.is_string() ? v.get<std::string>() : "";
      bool ok = a == "digits" || a == "letters";
      if (!ok && a.size() >= 2) {
        ok = true;
        for (char ch : a) ok &= ch > ' ' && ch < 127 && ch != ',';
      }
      if (!ok) bad(key, "expected 'digits', 'letters' or at least two printable ASCII characters (no comma)", v);
      c.alphabet = a;
    } else {
      throw Error(RLH_E_INVALID_ARGUMENT, origin + "." + key + ": unknown key for the " + task_name(kind) + " task");
    }
  }
  if (!arith && c.min_length > c.max_length)
    throw Error(RLH_E_INVALID_ARGUMENT, origin + ".min_length: " + std::to_string(c.min_length) +
                                            " is more than max_length " + std::to_string(c.max_length));
  return c;
}

TaskExample generate_task(const TaskConfig& c, uint64_t index) {
  Rng rng = row_rng(c, index);
  TaskExample ex;
  if (c.kind == TaskKind::kArithmetic) {
    const int64_t lo = c.num_digits == 1 ? 0 : [&] {
      int64_t p = 1;
      for (int i = 1; i < c.num_digits; ++i) p *= 10;
      return p;
    }();
    const int64_t hi = c.num_digits == 1 ? 9 : lo * 10 - 1;
    // Redraw while the result is negative (bounded; all-'+' expressions end the search).
    for (int attempt = 0;; ++attempt) {
      std::string q = std::to_string(rng.between(lo, hi));
      for (int k = 1; k < c.num_operands; ++k) {
        const char op = attempt < 64 ? c.operators[rng.below(c.operators.size())] : '+';
        q += op;
        q += std::to_string(rng.between(lo, hi));
      }
      q += "=";
      const __int128 v = *evaluate_arithmetic(q);
      if (v >= 0 || c.allow_negative || attempt >= 64) {
        ex.question = q;
        ex.answer = int128_text(v);
        break;
      }
    }
  } else {
    const std::string alphabet = resolve_alphabet(c);
    const int64_t len = rng.between(c.min_length, c.max_length);
    std::vector<std::string> items;
    for (int64_t i = 0; i < len; ++i) items.emplace_back(1, alphabet[rng.below(alphabet.size())]);
    if (c.kind == TaskKind::kSort) {
      ex.question = join(items);
      std::sort(items.begin(), items.end());
      ex.answer = join(items);
    } else {
      for (const auto& s : items) ex.question += s;
      ex.answer = ex.question;
      if (c.kind == TaskKind::kReverse) std::reverse(ex.answer.begin(), ex.answer.end());
    }
  }
  ex.prompt = c.prompt_template;
  ex.prompt.replace(ex.prompt.find("{}"), 2, ex.question);
  return ex;
}

json task_row(const TaskConfig& c, uint64_t index) {
  const TaskExample ex = generate_task(c, index);
  json row = json::object();
  row["task"] = task_name(c.kind);
  row["index"] = index;
  row["question"] = ex.question;
  row["prompt"] = ex.prompt;
  row["answer"] = ex.answer;
  return row;
}

std::optional<std::string> solve_task(TaskKind kind, std::string_view question) {
  switch (kind) {
    case TaskKind::kArithmetic: {
      const auto v = evaluate_arithmetic(trim(question));
      if (!v) return std::nullopt;
      return int128_text(*v);
    }
    case TaskKind::kSort: {
      auto items = items_of(question);
      if (items.empty()) return std::nullopt;
      std::sort(items.begin(), items.end());
      return join(items);
    }
    case TaskKind::kCopy: return trim(question);
    case TaskKind::kReverse: {
      std::string s = trim(question);
      std::reverse(s.begin(), s.end());
      return s;
    }
  }
  return std::nullopt;
}

TaskScore score_task(TaskKind kind, std::string_view response, std::string_view answer) {
  TaskScore s;
  const std::string got = trim(response), want = trim(answer);
  switch (kind) {
    case TaskKind::kArithmetic: {
      s.exact = got == want ? 1 : 0;
      s.format = is_integer_literal(got) ? 1 : 0;
      // Digits compared from the right (units with units), the sign as one more position.
      std::string g(got.rbegin(), got.rend()), w(want.rbegin(), want.rend());
      s.partial = s.format != 0 ? positional_match(g, w) : 0;
      break;
    }
    case TaskKind::kSort: {
      const auto g = items_of(got), w = items_of(want);
      s.exact = g == w ? 1 : 0;
      s.partial = positional_match(g, w);
      auto gs = g, ws = w;
      std::sort(gs.begin(), gs.end());
      std::sort(ws.begin(), ws.end());
      s.format = gs == ws ? 1 : 0;
      break;
    }
    case TaskKind::kCopy:
    case TaskKind::kReverse:
      s.exact = got == want ? 1 : 0;
      s.partial = positional_match(got, want);
      s.format = got.size() == want.size() ? 1 : 0;
      break;
  }
  return s;
}

}  // namespace rlh::environments
