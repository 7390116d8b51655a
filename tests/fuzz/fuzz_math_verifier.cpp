// Fuzzes the math environment's verifier as it meets a policy's output: the input is a
// response, NUL, a ground truth. Extraction, normalisation, parsing and exact/float comparison
// must end within the scoring budget (a hundredth of the default here, so an input costs
// milliseconds; the wall-clock backstop is off so the verdict is deterministic), and a response
// over budget never scores as correct. A crash, sanitizer report, timeout or OOM is a finding.
#include <cstddef>
#include <cstdint>
#include <string>

#include "rlhost/environments/math_answer.hpp"

using namespace rlh::environments;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string in(reinterpret_cast<const char*>(data), size);
  const size_t nul = in.find('\0');
  const std::string response = in.substr(0, nul);
  const std::string truth = nul == std::string::npos ? std::string("42") : in.substr(nul + 1);
  MathCompareOptions opts;
  opts.max_work = 500'000;  // ~2.5 ms of work in a release build; tests cover the default
  opts.max_seconds = 0;
  const MathVerdict v = score_math_response(response, truth, opts);
  if (v.over_budget && v.correct) __builtin_trap();
  (void)math_equal(truth, truth, opts);
  (void)describe_answer(truth, opts);
  return 0;
}
