// Parsing a normalised math answer into an expression tree, and evaluating it in floating point.
//
// Grammar (whitespace between tokens is ignored):
//   expr    := term (('+' | '-') term)*
//   term    := unary (('*' | \cdot | \times | '/' | \div) unary | power)*   -- the last: implicit *
//   unary   := ('-' | '+') unary | power
//   power   := postfix ('^' exponent)?         exponent := sign? atom ('^' exponent)?
//   postfix := primary '%'*
//   primary := number | letters | \frac A B | \sqrt[n]? A | \pi | \infty | \greek | \sin-like
//              power | '(' expr ')' | '[' expr ']' | '{' expr '}'
// A \frac / \sqrt argument or an exponent is a {group} or a single atom (\frac12, 2^10, x^y).
// A run of letters is one variable per letter ("xy" = x*y), except pi, sqrt and the function
// names, as sympy's parser splits them.
#include <algorithm>
#include <cctype>
#include <cmath>

#include "math_internal.hpp"

namespace rlh::environments::math {
namespace {

struct Failed {};

// Sets n's height from its kids'; a tree past kMaxTreeHeight is not an expression we parse (a
// policy's 4 KB answer "xxxx...x" was a 4096-deep chain, which overflowed the stack in eval).
void set_height(Node& n) {
  for (const NodePtr& k : n.kids) n.height = std::max(n.height, k->height + 1);
  if (n.height > kMaxTreeHeight) throw Failed{};
}

NodePtr make(Node::Kind k, std::vector<NodePtr> kids = {}) {
  charge(1);
  auto n = std::make_shared<Node>();
  n->kind = k;
  n->kids = std::move(kids);
  set_height(*n);
  return n;
}

NodePtr make_number(Rational v) {
  auto n = std::make_shared<Node>();
  n->kind = Node::kNumber;
  n->number = std::move(v);
  return n;
}

NodePtr make_named(Node::Kind k, std::string name, std::vector<NodePtr> kids = {}) {
  auto n = std::make_shared<Node>();
  n->kind = k;
  n->name = std::move(name);
  n->kids = std::move(kids);
  set_height(*n);
  return n;
}

bool is_function(std::string_view n) {
  return n == "sin" || n == "cos" || n == "tan" || n == "ln" || n == "log" || n == "exp";
}

bool is_greek(std::string_view n) {
  static const char* const kGreek[] = {"alpha", "beta",  "gamma", "delta", "epsilon", "zeta",  "eta",  "theta",
                                       "iota",  "kappa", "lambda", "mu",   "nu",      "xi",    "rho",  "sigma",
                                       "tau",   "upsilon", "phi",  "chi",  "psi",     "omega", "varphi", "varepsilon"};
  for (const char* g : kGreek)
    if (n == g) return true;
  return false;
}

class Parser {
 public:
  explicit Parser(std::string_view s) : s_(s) {}

  NodePtr parse() {
    NodePtr e = expr();
    skip();
    if (i_ != s_.size()) throw Failed{};
    return e;
  }

 private:
  void skip() {
    while (i_ < s_.size() && std::isspace(static_cast<unsigned char>(s_[i_]))) ++i_;
  }
  bool peek(char c) {
    skip();
    return i_ < s_.size() && s_[i_] == c;
  }
  bool accept(char c) {
    if (!peek(c)) return false;
    ++i_;
    return true;
  }
  void expect(char c) {
    if (!accept(c)) throw Failed{};
  }
  // The command name at i_ (after '\'), without consuming it.
  std::string_view command_at(size_t at) const {
    if (at >= s_.size() || s_[at] != '\\') return {};
    size_t j = at + 1;
    while (j < s_.size() && std::isalpha(static_cast<unsigned char>(s_[j]))) ++j;
    return s_.substr(at + 1, j - at - 1);
  }
  bool accept_command(std::string_view name) {
    skip();
    if (command_at(i_) != name) return false;
    i_ += 1 + name.size();
    return true;
  }

  struct Depth {  // bounds recursion on adversarial input
    int& d;
    explicit Depth(int& x) : d(x) {
      if (++d > 200) throw Failed{};
    }
    ~Depth() { --d; }
  };

  NodePtr expr() {
    Depth guard(depth_);
    NodePtr left = term();
    for (;;) {
      if (accept('+')) left = make(Node::kAdd, {left, term()});
      else if (accept('-')) left = make(Node::kSub, {left, term()});
      else return left;
    }
  }

  NodePtr term() {
    NodePtr left = unary();
    for (;;) {
      if (accept('*') || accept_command("cdot") || accept_command("times")) left = make(Node::kMul, {left, unary()});
      else if (accept('/') || accept_command("div")) left = make(Node::kDiv, {left, unary()});
      else if (starts_primary()) left = make(Node::kMul, {left, power()});
      else return left;
    }
  }

  NodePtr unary() {
    Depth guard(depth_);
    if (accept('-')) return make(Node::kNeg, {unary()});
    if (accept('+')) return unary();
    return power();
  }

  NodePtr power() {
    NodePtr base = postfix();
    if (accept('^')) return make(Node::kPow, {base, exponent()});
    return base;
  }

  NodePtr exponent() {
    Depth guard(depth_);
    if (accept('-')) return make(Node::kNeg, {exponent()});
    if (accept('+')) return exponent();
    NodePtr a = atom();
    if (accept('^')) return make(Node::kPow, {a, exponent()});
    return a;
  }

  NodePtr postfix() {
    NodePtr p = primary();
    while (accept('%')) p = make(Node::kPercent, {p});
    return p;
  }

  bool starts_primary() {
    skip();
    if (i_ >= s_.size()) return false;
    const char c = s_[i_];
    if (std::isdigit(static_cast<unsigned char>(c)) || std::isalpha(static_cast<unsigned char>(c)) || c == '(' ||
        c == '[' || c == '{')
      return true;
    if (c == '.' && i_ + 1 < s_.size() && std::isdigit(static_cast<unsigned char>(s_[i_ + 1]))) return true;
    const std::string_view cmd = command_at(i_);
    return cmd == "frac" || cmd == "sqrt" || cmd == "pi" || cmd == "infty" || is_greek(cmd) || is_function(cmd);
  }

  // A \frac / \sqrt argument or an exponent: {group}, or one digit/letter/command atom.
  NodePtr atom() {
    skip();
    if (i_ >= s_.size()) throw Failed{};
    const char c = s_[i_];
    if (c == '{') {
      ++i_;
      NodePtr e = expr();
      expect('}');
      return e;
    }
    if (c == '(' || c == '[' || c == '\\') return primary();
    if (std::isdigit(static_cast<unsigned char>(c)) || c == '.') return number();
    if (std::isalpha(static_cast<unsigned char>(c))) return letters();
    throw Failed{};
  }
  // \frac's arguments are single characters when unbraced (\frac12 = 1/2, \frac{12}{5}).
  NodePtr frac_argument() {
    skip();
    if (i_ < s_.size() && std::isdigit(static_cast<unsigned char>(s_[i_]))) {
      return make_number(Rational(s_[i_++] - '0'));
    }
    return atom();
  }

  NodePtr number() {
    const size_t start = i_;
    BigInt mantissa = 0;
    int frac_digits = 0;
    bool any = false, dot = false;
    while (i_ < s_.size()) {
      const char c = s_[i_];
      if (std::isdigit(static_cast<unsigned char>(c))) {
        charge(1 + (i_ - start) / 16);  // the mantissa grows a word per 19 digits: n^2 / 19 in all
        mantissa = mantissa * 10 + (c - '0');
        if (dot) ++frac_digits;
        any = true;
      } else if (c == '.' && !dot && i_ + 1 < s_.size() && std::isdigit(static_cast<unsigned char>(s_[i_ + 1]))) {
        dot = true;
      } else if (c == '.' && !dot && any) {
        dot = true;  // "5." is 5
      } else {
        break;
      }
      ++i_;
    }
    if (!any) {
      i_ = start;
      throw Failed{};
    }
    // Scientific notation only when the e is followed by digits: 2e3 = 2000, but 2e is 2*e.
    long exp10 = 0;
    if (i_ < s_.size() && (s_[i_] == 'e' || s_[i_] == 'E')) {
      size_t j = i_ + 1;
      int sign = 1;
      if (j < s_.size() && (s_[j] == '+' || s_[j] == '-')) sign = s_[j++] == '-' ? -1 : 1;
      if (j < s_.size() && std::isdigit(static_cast<unsigned char>(s_[j]))) {
        long e = 0;
        while (j < s_.size() && std::isdigit(static_cast<unsigned char>(s_[j]))) {
          e = e * 10 + (s_[j++] - '0');
          if (e > 100000) throw Failed{};
        }
        exp10 = sign * e;
        i_ = j;
      }
    }
    exp10 -= frac_digits;
    if (exp10 > 4000 || exp10 < -4000) throw Failed{};
    charge(static_cast<uint64_t>(std::labs(exp10)) / 16 + 1);  // 10^|exp10|, a few words per 16 digits
    BigInt scale = boost::multiprecision::pow(BigInt(10), static_cast<unsigned>(std::labs(exp10)));
    return make_number(exp10 >= 0 ? Rational(mantissa * scale) : Rational(mantissa, scale));
  }

  // A run of letters: a known name, else one variable per letter.
  NodePtr letters() {
    size_t j = i_;
    while (j < s_.size() && std::isalpha(static_cast<unsigned char>(s_[j]))) ++j;
    const std::string_view run = s_.substr(i_, j - i_);
    for (std::string_view name : {"sqrt", "pi", "sin", "cos", "tan", "ln", "log", "exp"}) {
      if (run == name) {  // "sqrt(2)", "pi", "sin(x)"; other runs split ("pir" = p*i*r)
        i_ += name.size();
        if (name == "pi") return make(Node::kPi);
        if (name == "sqrt") return make(Node::kRoot, {make_number(2), function_argument()});
        return make_named(Node::kFunc, std::string(name), {function_argument()});
      }
    }
    return make_named(Node::kVar, std::string(1, s_[i_++]));
  }

  NodePtr function_argument() {
    skip();
    if (i_ < s_.size() && (s_[i_] == '(' || s_[i_] == '{' || s_[i_] == '[')) return primary();
    return power();
  }

  NodePtr group(char close) {
    ++i_;
    NodePtr e = expr();
    expect(close);
    return e;
  }

  NodePtr primary() {
    Depth guard(depth_);
    skip();
    if (i_ >= s_.size()) throw Failed{};
    const char c = s_[i_];
    if (c == '(') return group(')');
    if (c == '[') return group(']');
    if (c == '{') return group('}');
    if (std::isdigit(static_cast<unsigned char>(c)) || c == '.') return number();
    if (std::isalpha(static_cast<unsigned char>(c))) return letters();
    if (c != '\\') throw Failed{};
    const std::string cmd(command_at(i_));
    if (cmd.empty()) throw Failed{};
    i_ += 1 + cmd.size();
    if (cmd == "frac") {
      NodePtr num = frac_argument();
      NodePtr den = frac_argument();
      return make(Node::kDiv, {num, den});
    }
    if (cmd == "sqrt") {
      NodePtr index = make_number(2);
      if (accept('[')) {
        index = expr();
        expect(']');
      }
      return make(Node::kRoot, {index, frac_argument()});
    }
    if (cmd == "pi") return make(Node::kPi);
    if (cmd == "infty") return make(Node::kInf);
    if (is_greek(cmd)) return make_named(Node::kVar, cmd);
    if (is_function(cmd)) return make_named(Node::kFunc, cmd, {function_argument()});
    throw Failed{};
  }

  std::string_view s_;
  size_t i_ = 0;
  int depth_ = 0;
};

// Fixed, distinct values for variables at each evaluation point, away from 0 and 1 so that
// coincidences (x^2 == x) do not pass.
long double variable_value(const std::string& name, int point) {
  uint64_t h = 1469598103934665603ull;
  for (char c : name) h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ull;
  h ^= static_cast<uint64_t>(point + 1) * 0x9E3779B97F4A7C15ull;
  h ^= h >> 31;
  h *= 0xBF58476D1CE4E5B9ull;
  h ^= h >> 29;
  return 1.25L + static_cast<long double>(h % 1000003) / 1000003.0L * 1.5L;
}

}  // namespace

std::optional<NodePtr> parse_expression(std::string_view s) {
  // Answers are short; the bound keeps the tree (and the recursive evaluators over it) shallow
  // enough for any stack whatever the input.
  if (s.size() > 4096) return std::nullopt;
  charge(s.size());
  try {
    return Parser(s).parse();
  } catch (const Failed&) {
    return std::nullopt;
  }
}

bool same_tree(const NodePtr& a, const NodePtr& b) {
  charge(1);
  if (a == b) return true;
  if (a->kind != b->kind || a->name != b->name || a->kids.size() != b->kids.size()) return false;
  if (a->kind == Node::kNumber && a->number != b->number) return false;
  for (size_t i = 0; i < a->kids.size(); ++i)
    if (!same_tree(a->kids[i], b->kids[i])) return false;
  return true;
}

bool contains_percent(const NodePtr& n) {
  if (n->kind == Node::kPercent) return true;
  for (const auto& k : n->kids)
    if (contains_percent(k)) return true;
  return false;
}

std::optional<long double> eval_float(const NodePtr& n, int point, bool percent) {
  charge(1);
  auto sub = [&](size_t i) { return eval_float(n->kids[i], point, percent); };
  std::optional<long double> a, b;
  if (!n->kids.empty() && !(a = sub(0))) return std::nullopt;
  if (n->kids.size() > 1 && !(b = sub(1))) return std::nullopt;
  long double r = 0;
  switch (n->kind) {
    case Node::kNumber: r = n->number.convert_to<long double>(); break;
    case Node::kVar: r = variable_value(n->name, point); break;
    case Node::kPi: r = 3.141592653589793238462643383279502884L; break;
    case Node::kInf: r = INFINITY; break;
    case Node::kAdd: r = *a + *b; break;
    case Node::kSub: r = *a - *b; break;
    case Node::kMul: r = *a * *b; break;
    case Node::kDiv:
      if (*b == 0) return std::nullopt;
      r = *a / *b;
      break;
    case Node::kNeg: r = -*a; break;
    case Node::kPow: r = std::pow(*a, *b); break;
    case Node::kRoot: {
      // A real odd root of a negative number (\sqrt[3]{-8} = -2).
      const long double idx = *a;
      if (*b < 0 && std::fmod(idx, 2.0L) == 1.0L) r = -std::pow(-*b, 1.0L / idx);
      else r = std::pow(*b, 1.0L / idx);
      break;
    }
    case Node::kFunc:
      if (n->name == "sin") r = std::sin(*a);
      else if (n->name == "cos") r = std::cos(*a);
      else if (n->name == "tan") r = std::tan(*a);
      else if (n->name == "exp") r = std::exp(*a);
      else r = *a > 0 ? std::log(*a) : NAN;  // ln, log: natural, as sympy's log
      break;
    case Node::kPercent: r = percent ? *a / 100 : *a; break;
  }
  if (std::isnan(r)) return std::nullopt;
  return r;
}

}  // namespace rlh::environments::math
