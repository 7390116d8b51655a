// The environments plugin: ENVIRONMENT components `math`, `arithmetic`, `sort`, `copy`, `reverse`,
// `reward_model` (reward_model_env.cpp: a trained reward model's score, on the host's backend) and
// DATASET components `synthetic_arithmetic`, `synthetic_sort`, `synthetic_copy`,
// `synthetic_reverse` (the synthetic tasks' seeded prompts), over rlh_environments_core; and the
// multi-turn ones of multi_turn_envs.cpp (`sliding_puzzle_game`, `calculator`, `reveal`).
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "rlhost/dataset.h"
#include "rlhost/environment.h"
#include "rlhost/environments/math_answer.hpp"
#include "multi_turn_components.hpp"
#include "rlhost/environments/synthetic_tasks.hpp"
#include "rlhost/sdk/json_input.hpp"
#include "rlhost/sdk/plugin.hpp"
#include "reward_model_env.hpp"

namespace {

using json = nlohmann::json;
using rlh::sdk::Error;
using namespace rlh::environments;

json parse_config(const char* text, size_t len, const std::string& origin) {
  if (text == nullptr || len == 0) return json::object();
  try {
    json j = json::parse(std::string(text, len));
    if (j.is_null()) return json::object();
    if (!j.is_object()) throw Error(RLH_E_INVALID_ARGUMENT, origin + ": expected a mapping, got " + j.dump());
    return j;
  } catch (const json::exception& e) {
    throw Error(RLH_E_INVALID_ARGUMENT, origin + ": config is not valid JSON: " + e.what());
  }
}

// ---- environments ----------------------------------------------------------------------------

// Responses scored past their budget are counted in this column: its name starts with "count/",
// so the GRPO loop logs the step's sum, not a mean (rlhost/environment.h).
constexpr const char* kBudgetCount = "count/score_budget_exceeded";

struct Environment {
  rlh::sdk::MakeStatusFn make = nullptr;
  rlh::sdk::Host host;
  std::string name;  // "math" or a task name
  bool is_math = false;
  TaskKind task = TaskKind::kArithmetic;
  std::string ground_truth_key = "ground_truth";  // NeMo-RL's math environment reads this key
  MathCompareOptions math;
  std::vector<std::string> produced;

  std::string origin() const { return "env." + name; }

  void configure(const json& cfg) {
    for (const auto& [key, v] : cfg.items()) {
      if (key == "num_workers") {
        // NeMo-RL's verifier worker pool; scoring here is in-process and thread-safe.
        if (!v.is_null() && !v.is_number_integer())
          throw Error(RLH_E_INVALID_ARGUMENT, origin() + ".num_workers: expected an integer, got " + v.dump());
      } else if (key == "ground_truth_key") {
        if (!v.is_string() || v.get<std::string>().empty())
          throw Error(RLH_E_INVALID_ARGUMENT, origin() + ".ground_truth_key: expected a key name, got " + v.dump());
        ground_truth_key = v.get<std::string>();
      } else if (is_math && key == "relative_tolerance") {
        if (!v.is_number() || !(v.get<double>() > 0) || v.get<double>() >= 1)
          throw Error(RLH_E_INVALID_ARGUMENT, origin() + ".relative_tolerance: expected a number in (0, 1), got " + v.dump());
        math.relative_tolerance = v.get<double>();
      } else if (key == "max_response_bytes" || (is_math && (key == "max_answer_bytes" || key == "max_score_work"))) {
        if (!v.is_number_integer() || v.get<int64_t>() < 1)
          throw Error(RLH_E_INVALID_ARGUMENT, origin() + "." + key + ": expected a positive integer, got " + v.dump());
        const auto n = v.get<uint64_t>();
        if (key == "max_response_bytes") math.max_response_bytes = n;
        else if (key == "max_answer_bytes") math.max_answer_bytes = n;
        else math.max_work = n;
      } else if (is_math && key == "max_score_seconds") {
        if (!v.is_number() || !(v.get<double>() >= 0))
          throw Error(RLH_E_INVALID_ARGUMENT, origin() + ".max_score_seconds: expected a number >= 0 (0: no limit), got " + v.dump());
        math.max_seconds = v.get<double>();
      } else if (is_math && key == "verifier_type") {
        // NeMo-RL selects math-verify, multiple-choice or DAPO graders by this; only math is here.
        if (!v.is_null() && v != "math")
          throw Error(RLH_E_INVALID_ARGUMENT,
                      origin() + ".verifier_type: only 'math' is implemented, got " + v.dump());
      } else {
        throw Error(RLH_E_INVALID_ARGUMENT, origin() + "." + key + ": unknown key");
      }
    }
    produced = is_math ? std::vector<std::string>{"reward", "reward/format", kBudgetCount}
                       : std::vector<std::string>{"reward", "reward/partial", "reward/format", kBudgetCount};
  }

  // The expected answer of sample i: metadata[ground_truth_key], else metadata["answer"] (what
  // rlhost datasets resolve), else for a synthetic task the solution of metadata["question"].
  std::string expected(const rlh_env_sample& s, size_t i) const {
    const std::string where = origin() + ": sample " + std::to_string(i);
    json meta = json::object();
    if (s.metadata_json != nullptr && s.metadata_len > 0) {
      try {
        meta = rlh::sdk::parse_json_input(std::string_view(s.metadata_json, s.metadata_len), where + ": metadata");
      } catch (const rlh::sdk::InputError& e) {
        throw Error(RLH_E_INVALID_ARGUMENT, e.what());
      }
    }
    if (!meta.is_object()) throw Error(RLH_E_INVALID_ARGUMENT, where + ": metadata is not a JSON object");
    for (const std::string& key : {ground_truth_key, std::string("answer")}) {
      auto it = meta.find(key);
      if (it == meta.end() || it->is_null()) continue;
      if (it->is_string()) return it->get<std::string>();
      if (it->is_number()) return it->dump();
      throw Error(RLH_E_INVALID_ARGUMENT, where + ": metadata '" + key + "' must be a string or number, got " + it->dump());
    }
    if (!is_math) {
      auto q = meta.find("question");
      if (q != meta.end() && q->is_string()) {
        if (auto a = solve_task(task, q->get<std::string>())) return *a;
        throw Error(RLH_E_INVALID_ARGUMENT, where + ": metadata 'question' is not a " + name + " question: " + q->dump());
      }
    }
    throw Error(RLH_E_INVALID_ARGUMENT, where + ": metadata has no '" + ground_truth_key + "' (" + origin() +
                                            ".ground_truth_key) or 'answer'");
  }

  // Scores of one sample, in `produced` order. A response past the scoring budget scores 0 and
  // counts 1 in kBudgetCount; `why` receives the limit it hit.
  std::vector<double> score_one(const rlh_env_sample& s, size_t i, std::string* why) const {
    const std::string truth = expected(s, i);
    const std::string_view response(s.response != nullptr ? s.response : "", s.response != nullptr ? s.response_len : 0);
    if (is_math) {
      const MathVerdict v = score_math_response(response, truth, math);
      if (v.over_budget) *why = v.why;
      return {v.correct ? 1.0 : 0.0, v.boxed ? 1.0 : 0.0, v.over_budget ? 1.0 : 0.0};
    }
    // The synthetic scorers are linear in the response; its length is the whole budget.
    if (response.size() > math.max_response_bytes) {
      *why = "a response longer than " + std::to_string(math.max_response_bytes) + " bytes";
      return {0, 0, 0, 1};
    }
    const TaskScore t = score_task(task, response, truth);
    return {t.exact, t.partial, t.format, 0};
  }
};

template <bool IsMath, TaskKind Kind>
rlh_status* env_create(const rlh_host_api* host, const char* config_json, size_t config_len, rlh_environment** out) {
  const rlh::sdk::MakeStatusFn make = host != nullptr ? host->make_status : nullptr;
  return rlh::sdk::guard(make, [&] {
    auto env = std::make_unique<Environment>();
    env->make = make;
    env->is_math = IsMath;
    env->task = Kind;
    env->name = IsMath ? "math" : task_name(Kind);
    env->host = rlh::sdk::Host(host);
    if (out == nullptr) throw Error(RLH_E_INVALID_ARGUMENT, env->origin() + ": create: out is NULL");
    env->configure(parse_config(config_json, config_len, env->origin()));
    *out = reinterpret_cast<rlh_environment*>(env.release());
  });
}

void env_destroy(rlh_environment* self) { delete reinterpret_cast<Environment*>(self); }

rlh_status* env_reward_names(rlh_environment* self, rlh_write_fn write, void* user) {
  auto* env = reinterpret_cast<Environment*>(self);
  return rlh::sdk::guard(env->make, [&] {
    const std::string names = json(env->produced).dump();
    write(user, names.data(), names.size());
  });
}

rlh_status* env_score(rlh_environment* self, const rlh_env_sample* samples, size_t n, rlh_env_result* result) {
  auto* env = reinterpret_cast<Environment*>(self);
  return rlh::sdk::guard(env->make, [&] {
    if (result == nullptr || !RLH_HAS_FIELD(result, rlh_env_result, done))
      throw Error(RLH_E_INVALID_ARGUMENT, env->origin() + ": score: result is NULL or too old");
    if (n > 0 && (samples == nullptr || result->done == nullptr || (result->num_rewards > 0 && result->rewards == nullptr)))
      throw Error(RLH_E_INVALID_ARGUMENT, env->origin() + ": score: samples, rewards or done is NULL");
    // Which produced reward goes to each requested column.
    std::vector<size_t> column(result->num_rewards);
    for (size_t r = 0; r < result->num_rewards; ++r) {
      const char* want = result->reward_names != nullptr ? result->reward_names[r] : nullptr;
      size_t k = 0;
      while (k < env->produced.size() && (want == nullptr || env->produced[k] != want)) ++k;
      if (k == env->produced.size())
        throw Error(RLH_E_INVALID_ARGUMENT, env->origin() + ": unknown reward '" + (want ? want : "(null)") +
                                                "' (this environment produces " + json(env->produced).dump() + ")");
      column[r] = k;
    }
    size_t over = 0;
    std::string why;
    for (size_t i = 0; i < n; ++i) {
      std::string w;
      const std::vector<double> scores = env->score_one(samples[i], i, &w);
      if (!w.empty()) {
        ++over;
        why = w;
      }
      for (size_t r = 0; r < result->num_rewards; ++r) result->rewards[i * result->num_rewards + r] = scores[column[r]];
      result->done[i] = 1;  // single-turn
    }
    // The run goes on: the responses scored 0; one warning per batch says how many and why.
    if (over > 0)
      env->host.warn(env->origin() + ": " + std::to_string(over) + " of " + std::to_string(n) +
                     " responses exceeded the scoring budget and scored 0 (" + why + ")");
  });
}

template <bool IsMath, TaskKind Kind>
constexpr rlh_environment_api env_api() {
  return {RLH_STRUCT_SIZE(rlh_environment_api, score), env_create<IsMath, Kind>, env_destroy, env_reward_names,
          env_score};
}

// ---- synthetic datasets ----------------------------------------------------------------------

struct Dataset {
  rlh::sdk::MakeStatusFn make = nullptr;
  TaskConfig cfg;
};

template <TaskKind Kind>
rlh_status* ds_create(const rlh_host_api* host, const char* config_json, size_t config_len, rlh_dataset** out) {
  const rlh::sdk::MakeStatusFn make = host != nullptr ? host->make_status : nullptr;
  return rlh::sdk::guard(make, [&] {
    auto ds = std::make_unique<Dataset>();
    ds->make = make;
    const std::string component = std::string("synthetic_") + task_name(Kind);
    if (out == nullptr) throw Error(RLH_E_INVALID_ARGUMENT, component + ": create: out is NULL");
    json cfg = parse_config(config_json, config_len, component);
    // Messages name the data section the algorithm took the config from, when it says.
    std::string origin = component;
    if (auto s = cfg.find("split"); s != cfg.end() && s->is_string()) origin = "data." + s->get<std::string>();
    if (auto n = cfg.find("dataset_name"); n != cfg.end() && !n->is_null() && *n != component)
      throw Error(RLH_E_INVALID_ARGUMENT, origin + ".dataset_name: " + n->dump() + " is not " + component);
    ds->cfg = TaskConfig::from_json(Kind, cfg, origin);
    *out = reinterpret_cast<rlh_dataset*>(ds.release());
  });
}

void ds_destroy(rlh_dataset* self) { delete reinterpret_cast<Dataset*>(self); }

int64_t ds_size(const rlh_dataset* self) { return reinterpret_cast<const Dataset*>(self)->cfg.size; }

rlh_status* ds_get(const rlh_dataset* self, int64_t index, rlh_write_fn write, void* user) {
  const auto* ds = reinterpret_cast<const Dataset*>(self);
  return rlh::sdk::guard(ds->make, [&] {
    if (index < 0 || index >= ds->cfg.size)
      throw Error(RLH_E_OUT_OF_RANGE, std::string("synthetic_") + task_name(ds->cfg.kind) + ": row " +
                                          std::to_string(index) + " out of range [0, " + std::to_string(ds->cfg.size) + ")");
    const std::string row = task_row(ds->cfg, static_cast<uint64_t>(index)).dump();
    write(user, row.data(), row.size());
  });
}

template <TaskKind Kind>
constexpr rlh_dataset_api ds_api() {
  return {RLH_STRUCT_SIZE(rlh_dataset_api, get), ds_create<Kind>, ds_destroy, ds_size, ds_get};
}

// ---- descriptors -----------------------------------------------------------------------------

constexpr rlh_environment_api kMathApi = env_api<true, TaskKind::kArithmetic>();
constexpr rlh_environment_api kArithmeticApi = env_api<false, TaskKind::kArithmetic>();
constexpr rlh_environment_api kSortApi = env_api<false, TaskKind::kSort>();
constexpr rlh_environment_api kCopyApi = env_api<false, TaskKind::kCopy>();
constexpr rlh_environment_api kReverseApi = env_api<false, TaskKind::kReverse>();
constexpr rlh_dataset_api kArithmeticData = ds_api<TaskKind::kArithmetic>();
constexpr rlh_dataset_api kSortData = ds_api<TaskKind::kSort>();
constexpr rlh_dataset_api kCopyData = ds_api<TaskKind::kCopy>();
constexpr rlh_dataset_api kReverseData = ds_api<TaskKind::kReverse>();

const char* const kMathKeys[] = {"env.math.*", nullptr};
const char* const kArithmeticKeys[] = {"env.arithmetic.*", nullptr};
const char* const kSortKeys[] = {"env.sort.*", nullptr};
const char* const kCopyKeys[] = {"env.copy.*", nullptr};
const char* const kReverseKeys[] = {"env.reverse.*", nullptr};
const char* const kRewardModelKeys[] = {"env.reward_model.*", nullptr};
// The synthetic datasets read these keys of NeMo-RL's data.train / data.validation sections
// (data.train.dataset_name: synthetic_arithmetic, ...).
#define RLH_SYNTH_KEYS(section) \
  "data." section ".dataset_name", "data." section ".seed", "data." section ".size", "data." section ".prompt_template"
const char* const kArithmeticDataKeys[] = {
    RLH_SYNTH_KEYS("train"), RLH_SYNTH_KEYS("validation"), "data.train.num_digits", "data.train.num_operands",
    "data.train.operators", "data.train.allow_negative", "data.validation.num_digits", "data.validation.num_operands",
    "data.validation.operators", "data.validation.allow_negative", nullptr};
const char* const kSequenceDataKeys[] = {
    RLH_SYNTH_KEYS("train"), RLH_SYNTH_KEYS("validation"), "data.train.min_length", "data.train.max_length",
    "data.train.alphabet", "data.validation.min_length", "data.validation.max_length", "data.validation.alphabet",
    nullptr};
#undef RLH_SYNTH_KEYS

#define RLH_ENV(var, name, api, keys, text)                                                                   \
  const rlh_component_desc var = rlh::sdk::component_desc(RLH_KIND_ENVIRONMENT, name, "0.1.0",                 \
                                                          RLH_ENVIRONMENT_API_VERSION_MAJOR,                   \
                                                          RLH_ENVIRONMENT_API_VERSION_MINOR, &api, text, keys)
#define RLH_DATA(var, name, api, keys, text)                                                                   \
  const rlh_component_desc var = rlh::sdk::component_desc(RLH_KIND_DATASET, name, "0.1.0",                     \
                                                          RLH_DATASET_API_VERSION_MAJOR,                       \
                                                          RLH_DATASET_API_VERSION_MINOR, &api, text, keys)
RLH_ENV(kMath, "math", kMathApi, kMathKeys, "final answer (\\boxed, 'the answer is', last number) equal to the ground truth");
RLH_ENV(kArithmetic, "arithmetic", kArithmeticApi, kArithmeticKeys, "exact integer answer to '12+7='");
RLH_ENV(kSort, "sort", kSortApi, kSortKeys, "the input characters, sorted");
RLH_ENV(kCopy, "copy", kCopyApi, kCopyKeys, "the input string, repeated");
RLH_ENV(kReverse, "reverse", kReverseApi, kReverseKeys, "the input string, reversed");
RLH_ENV(kRewardModel, "reward_model", rlh::environments::kRewardModelEnvApi, kRewardModelKeys,
        "a trained reward model's score of prompt + response (its value at the last token)");
RLH_DATA(kArithmeticDs, "synthetic_arithmetic", kArithmeticData, kArithmeticDataKeys, "seeded arithmetic prompts");
RLH_DATA(kSortDs, "synthetic_sort", kSortData, kSequenceDataKeys, "seeded sort prompts");
RLH_DATA(kCopyDs, "synthetic_copy", kCopyData, kSequenceDataKeys, "seeded copy prompts");
RLH_DATA(kReverseDs, "synthetic_reverse", kReverseData, kSequenceDataKeys, "seeded reverse prompts");
#undef RLH_ENV
#undef RLH_DATA

const rlh_component_desc* const kComponents[] = {&kMath, &kArithmetic, &kSort, &kCopy, &kReverse, &kRewardModel,
                                                 &kArithmeticDs, &kSortDs, &kCopyDs, &kReverseDs,
                                                 // multi-turn (multi_turn_envs.cpp)
                                                 &kSlidingPuzzleEnv, &kCalculatorEnv, &kRevealEnv,
                                                 &kSlidingPuzzleData};

}  // namespace

RLH_DEFINE_PLUGIN(rlh::sdk::plugin_desc("environments", "0.1.0", "rlhost", kComponents,
                                        "math answers and synthetic tasks with exact rewards, their datasets, "
                                        "and reward-model scores"))
