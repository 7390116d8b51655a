// The work budget of one scoring (see math_internal.hpp).
#include <chrono>

#include "math_internal.hpp"

namespace rlh::environments::math {
namespace {

thread_local WorkBudget* t_budget = nullptr;

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// The clock is read once per this many units (a few milliseconds of work), so the check costs
// nothing measurable.
constexpr uint64_t kClockEvery = 1u << 20;

}  // namespace

WorkBudget::WorkBudget(uint64_t max_units, double max_seconds)
    : max_units_(max_units), next_clock_check_(kClockEvery), max_seconds_(max_seconds), start_ns_(now_ns()),
      prev_(t_budget) {
  t_budget = this;
}

WorkBudget::~WorkBudget() { t_budget = prev_; }

void charge(uint64_t units) {
  WorkBudget* b = t_budget;
  if (b == nullptr) return;
  b->used_ += units;
  if (b->used_ > b->max_units_)
    throw OverBudget{"scoring needs more than " + std::to_string(b->max_units_) + " work units"};
  if (b->used_ >= b->next_clock_check_) {
    b->next_clock_check_ = b->used_ + kClockEvery;
    if (b->max_seconds_ > 0 && static_cast<double>(now_ns() - b->start_ns_) * 1e-9 > b->max_seconds_)
      throw OverBudget{"scoring takes longer than " + std::to_string(b->max_seconds_) + " s"};
  }
}

}  // namespace rlh::environments::math
