// Internal pieces of the math answer checker: the normaliser, the expression tree, the exact
// canonical values and the float evaluator.
#pragma once

#include <boost/multiprecision/cpp_int.hpp>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace rlh::environments::math {

// ---- the work budget of one scoring (math_budget.cpp) ---------------------------------------

// A response is the policy's output: whatever it holds, scoring it must end in bounded time and
// memory. Every step of extraction, normalisation, parsing and evaluation charges units here
// (about one unit per byte scanned or per machine word of big-number arithmetic); past the
// limit, or past the wall-clock backstop, OverBudget is thrown and the answer scores as wrong.
struct OverBudget {
  std::string what;
};

class WorkBudget {
 public:
  // Installs itself for this thread (nested budgets: the innermost counts).
  WorkBudget(uint64_t max_units, double max_seconds);
  ~WorkBudget();
  WorkBudget(const WorkBudget&) = delete;
  WorkBudget& operator=(const WorkBudget&) = delete;
  uint64_t used() const { return used_; }

 private:
  friend void charge(uint64_t units);
  uint64_t max_units_, used_ = 0, next_clock_check_;
  double max_seconds_;
  int64_t start_ns_;
  WorkBudget* prev_;
};

// Charges the budget installed on this thread (none: nothing is counted).
void charge(uint64_t units);

using Rational = boost::multiprecision::cpp_rational;
using BigInt = boost::multiprecision::cpp_int;

// ---- normalisation (math_latex_normalize.cpp) ------------------------------------------------

// String-level clean-up before parsing (see math_answer.hpp for the list).
std::string normalize_latex(std::string_view raw);
// "1,234,567.5" -> "1234567.5" when the whole string is a thousands-separated number.
std::string drop_thousands_separators(const std::string& s);
// Lower-cased, whitespace and \text{} wrappers removed: the form non-math answers compare in.
std::string normalize_text(std::string_view raw);

// ---- expression tree (math_expression.cpp) ---------------------------------------------------

struct Node;
using NodePtr = std::shared_ptr<const Node>;

struct Node {
  enum Kind { kNumber, kVar, kPi, kInf, kAdd, kSub, kMul, kDiv, kNeg, kPow, kRoot, kFunc, kPercent };
  Kind kind;
  Rational number;   // kNumber
  std::string name;  // kVar, kFunc
  std::vector<NodePtr> kids;  // operands; kRoot: {index, radicand}
  int height = 1;             // 1 + the tallest kid's: the depth of every recursion over the tree
};

// The tallest tree the parser builds. Loops build left-deep chains ("xxxx" = ((x*x)*x)*x,
// "1+1+1"), so the parser's own recursion bound does not bound the tree; the evaluators,
// comparisons and the tree's destructor recurse once per level.
constexpr int kMaxTreeHeight = 512;

// Parses one expression (no top-level commas). nullopt when it is not one we understand.
std::optional<NodePtr> parse_expression(std::string_view s);
// True when two trees are the same expression, node for node.
bool same_tree(const NodePtr& a, const NodePtr& b);
bool contains_percent(const NodePtr& n);

// Float value, variables set from `point` (0, 1, 2: three fixed assignments). `percent`
// says whether x% means x/100 (true) or x (false). nullopt for a domain error.
std::optional<long double> eval_float(const NodePtr& n, int point, bool percent);

// ---- exact values (math_exact_value.cpp) -----------------------------------------------------

// A product of variables (sorted, exponents != 0), pi^k and sqrt(radicand), radicand square-free.
struct Monomial {
  std::vector<std::pair<std::string, int>> vars;
  int pi = 0;
  uint64_t radicand = 1;
  bool operator<(const Monomial& o) const;
  bool operator==(const Monomial& o) const;
};

// A canonical sum of rational multiples of monomials (no zero coefficients), or +-infinity.
struct Exact {
  std::map<Monomial, Rational> terms;
  int infinity = 0;  // +1 / -1: the value is +-infinity (terms empty)
  bool operator==(const Exact& o) const { return infinity == o.infinity && terms == o.terms; }
  std::string to_string() const;
};

// The canonical value, or nullopt outside the exact class (then floats decide).
std::optional<Exact> eval_exact(const NodePtr& n, bool percent);

}  // namespace rlh::environments::math
