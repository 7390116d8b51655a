// Math answers: extracting the final answer from a response and deciding whether it equals the
// ground truth (rlh_environments_core; the `math` environment scores with these).
//
// Extraction, first that applies:
//   1. the last \boxed{...} (or \fbox{...}), nested braces matched; an unclosed one (a truncated
//      response) is skipped in favour of an earlier closed one;
//   2. the last "the answer is X" / "final answer: X" (case-insensitive), X up to the line end;
//   3. the last number in the response.
//
// Equivalence. Both sides are normalised (math delimiters $ \( \[, \left \right, spacing
// commands, \dfrac/\tfrac, degrees, \text{...} units, "x = ...", thousands separators, Unicode
// minus/times/pi/sqrt) and parsed: numbers (integers, decimals, scientific notation), fractions
// (a/b, \frac, \frac12), + - * / ^, \sqrt and \sqrt[n], \pi, \infty, single-letter variables,
// implicit multiplication; tuples and intervals (compared element by element, in order, with
// their brackets), sets \{...\} (in any order), percentages.
//   - Exact first: each side becomes a canonical sum of rational coefficient x monomial x
//     pi^k x sqrt(m), m square-free. This decides integers, decimals, fractions, surds and pi
//     exactly (0.5 == 1/2, sqrt(12) == 2 sqrt(3), 3.14 != pi), and polynomials in the variables.
//   - Else (division by a sum, transcendental functions, huge powers) a relative tolerance on
//     float values, at three fixed points for the variables.
//   - A percentage matches its value with or without the sign when only one side has one
//     ("25%" == "25" == "0.25"); with both, the numbers are compared.
//   - What does not parse (words, \text{yes}) compares as text: case-folded, spaces removed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace rlh::environments {

enum class AnswerSource { kNone, kBoxed, kAnswerIs, kLastNumber };

struct ExtractedAnswer {
  std::string text;  // as written in the response (empty when source is kNone)
  AnswerSource source = AnswerSource::kNone;
};

ExtractedAnswer extract_answer(std::string_view response);

struct MathCompareOptions {
  double relative_tolerance = 1e-9;  // for values not decided exactly
  // The scoring budget. The response is the policy's output and may be anything; scoring it
  // ends within these bounds, and an answer that needs more scores as wrong (MathVerdict says
  // so). Real answers need well under 1% of the work budget and milliseconds.
  size_t max_response_bytes = 4u << 20;  // a longer response is not read
  size_t max_answer_bytes = 64u << 10;   // a longer extracted answer (or truth) is not compared
  uint64_t max_work = 50'000'000;        // ~1 unit per byte scanned or per word of big-number work
  double max_seconds = 10;               // wall-clock backstop; 0 = none
};

// True when `candidate` and `ground_truth` (answer strings, e.g. from extract_answer and the
// dataset) denote the same answer. False, too, when deciding it exceeds the budget.
bool math_equal(std::string_view candidate, std::string_view ground_truth,
                const MathCompareOptions& opts = {});

// The math environment's verdict on one response.
struct MathVerdict {
  bool correct = false;      // the extracted answer equals the ground truth
  bool boxed = false;        // the answer came from \boxed{} (reward/format)
  bool over_budget = false;  // scoring ran out of its budget: scored as wrong
  std::string why;           // which limit, when over_budget
};

// Extracts the answer from `response` and compares it with `ground_truth` (unwrapped from
// \boxed{} when it is wrapped), all within opts' budget.
MathVerdict score_math_response(std::string_view response, std::string_view ground_truth,
                                const MathCompareOptions& opts = {});

// The normalised, parsed form of an answer as text ("exact: 1/2", "tuple (1/2, sqrt(3))",
// "float: 0.693147", "text: monday"), for logs and tests; within opts' work budget like scoring
// ("over budget: <why>" past it: (1+x+y+z)^{64} expands to ~48,000 big terms).
std::string describe_answer(std::string_view answer, const MathCompareOptions& opts = {});

}  // namespace rlh::environments
