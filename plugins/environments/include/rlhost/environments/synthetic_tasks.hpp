// Synthetic tasks with exact rewards, for demos and tests that need data without files:
//   arithmetic  "12+7="          -> "19"        (num_digits, num_operands, operators)
//   sort        "sort 3 9 1 4 =" -> "1 3 4 9"   (min_length, max_length, alphabet)
//   copy        "copy qzxa ="    -> "qzxa"
//   reverse     "reverse qzxa =" -> "axzq"
// Row `index` of a task's dataset is a pure function of (task, seed, index), so any row can be
// read in any order, a larger `size` only appends rows, and resuming reproduces the data.
//
// Scores (each in [0, 1]):
//   reward          1 when the response (surrounding whitespace removed) is the answer, else 0
//   reward/partial  the fraction of answer positions (digits right-aligned for arithmetic, items
//                   for sort, characters otherwise) the response gets right
//   reward/format   1 when the response has the answer's shape: an integer; a permutation of the
//                   input items; a string of the input's length
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

namespace rlh::environments {

enum class TaskKind { kArithmetic, kSort, kCopy, kReverse };

const char* task_name(TaskKind k);  // "arithmetic", "sort", "copy", "reverse"

// A task's generator settings (the dataset component's config).
struct TaskConfig {
  TaskKind kind = TaskKind::kArithmetic;
  uint64_t seed = 42;
  int64_t size = 1000;
  // arithmetic
  int num_digits = 2;      // each operand has exactly this many digits (1: 0-9)
  int num_operands = 2;    // 2-4
  std::string operators = "+-*";
  bool allow_negative = false;  // false: expressions with a negative result are redrawn
  // sort, copy, reverse
  int min_length = 3;
  int max_length = 8;
  std::string alphabet;  // "digits", "letters", or the characters themselves; default per task
  // The prompt around the question; "{}" is the question.
  std::string prompt_template = "{}";

  // Reads a config object; a bad key is an error "<origin>.<key>: ...", an unknown key too.
  static TaskConfig from_json(TaskKind kind, const nlohmann::json& j, const std::string& origin);
};

struct TaskExample {
  std::string question;  // "12+7="
  std::string prompt;    // the question through prompt_template
  std::string answer;    // "19"
};

TaskExample generate_task(const TaskConfig& cfg, uint64_t index);
// The dataset row: {"task", "index", "question", "prompt", "answer"}.
nlohmann::json task_row(const TaskConfig& cfg, uint64_t index);

// The answer to a question this task generates, or nullopt when it is not one.
std::optional<std::string> solve_task(TaskKind kind, std::string_view question);

struct TaskScore {
  double exact = 0, partial = 0, format = 0;
};
TaskScore score_task(TaskKind kind, std::string_view response, std::string_view answer);

}  // namespace rlh::environments
