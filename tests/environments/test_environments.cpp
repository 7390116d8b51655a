// The synthetic tasks (generation, exact and partial scores, configuration) and the environments
// plugin's ENVIRONMENT and DATASET components driven through librlhost.
#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "rlhost/dataset.h"
#include "rlhost/environment.h"
#include "rlhost/environments/synthetic_tasks.hpp"
#include "rlhost/host.h"
#include "rlhost/sdk/status.hpp"

using nlohmann::json;
using namespace rlh::environments;

namespace {

// An evaluator written independently of the plugin's: tokens first, then * folded, then + and -.
long long reference_arithmetic(const std::string& q) {
  std::vector<long long> nums;
  std::vector<char> ops;
  size_t i = 0;
  while (i < q.size() && q[i] != '=') {
    size_t used = 0;
    nums.push_back(std::stoll(q.substr(i), &used));
    i += used;
    if (q[i] != '=') ops.push_back(q[i++]);
  }
  std::vector<long long> vals{nums[0]};
  std::vector<char> adds;
  for (size_t k = 0; k < ops.size(); ++k) {
    if (ops[k] == '*') vals.back() *= nums[k + 1];
    else {
      adds.push_back(ops[k]);
      vals.push_back(nums[k + 1]);
    }
  }
  long long r = vals[0];
  for (size_t k = 0; k < adds.size(); ++k) r = adds[k] == '+' ? r + vals[k + 1] : r - vals[k + 1];
  return r;
}

TaskConfig config(TaskKind kind, const json& j = json::object()) { return TaskConfig::from_json(kind, j, "data.train"); }

std::string error_of(TaskKind kind, const json& j) {
  try {
    config(kind, j);
  } catch (const rlh::sdk::Error& e) {
    return e.what();
  }
  return "no error";
}

}  // namespace

TEST(SyntheticTasks, ArithmeticRowsAreCorrectAndFollowTheirSettings) {
  const auto cfg = config(TaskKind::kArithmetic, {{"seed", 5}, {"num_digits", 3}, {"num_operands", 3}, {"operators", "+*"}});
  std::set<std::string> distinct;
  for (uint64_t i = 0; i < 500; ++i) {
    const TaskExample ex = generate_task(cfg, i);
    ASSERT_EQ(ex.question.back(), '=');
    EXPECT_EQ(ex.answer, std::to_string(reference_arithmetic(ex.question))) << ex.question;
    EXPECT_EQ(ex.prompt, ex.question);  // the arithmetic prompt is the bare question by default
    EXPECT_EQ(ex.question.find('-'), std::string::npos);
    std::string digits;
    int operands = 0;
    for (char c : ex.question) {
      if (std::isdigit(static_cast<unsigned char>(c))) {
        digits += c;
      } else {
        EXPECT_EQ(digits.size(), 3u) << ex.question;
        EXPECT_NE(digits[0], '0') << ex.question;
        digits.clear();
        ++operands;
      }
    }
    EXPECT_EQ(operands, 3) << ex.question;
    distinct.insert(ex.question);
  }
  EXPECT_GT(distinct.size(), 490u);
  // Subtraction never goes negative unless asked to.
  const auto sub = config(TaskKind::kArithmetic, {{"operators", "-"}, {"num_digits", 1}});
  for (uint64_t i = 0; i < 300; ++i) EXPECT_GE(std::stoll(generate_task(sub, i).answer), 0);
  const auto neg = config(TaskKind::kArithmetic, {{"operators", "-"}, {"num_digits", 1}, {"allow_negative", true}});
  int negatives = 0;
  for (uint64_t i = 0; i < 300; ++i) negatives += std::stoll(generate_task(neg, i).answer) < 0;
  EXPECT_GT(negatives, 50);
}

TEST(SyntheticTasks, RowsArePureFunctionsOfSeedAndIndex) {
  for (TaskKind k : {TaskKind::kArithmetic, TaskKind::kSort, TaskKind::kCopy, TaskKind::kReverse}) {
    const auto a = config(k, {{"seed", 11}, {"size", 10}}), b = config(k, {{"seed", 11}, {"size", 1000}}),
               c = config(k, {{"seed", 12}});
    int differ = 0;
    for (uint64_t i = 0; i < 10; ++i) {
      EXPECT_EQ(task_row(a, i), task_row(b, i));
      differ += task_row(a, i)["question"] != task_row(c, i)["question"];
    }
    EXPECT_GE(differ, 7) << task_name(k);
    // Reading out of order gives the same rows.
    EXPECT_EQ(task_row(b, 7), task_row(a, 7));
  }
}

TEST(SyntheticTasks, SequenceTasksRespectLengthAndAlphabet) {
  const auto sort = config(TaskKind::kSort, {{"min_length", 4}, {"max_length", 6}, {"alphabet", "letters"}, {"seed", 2}});
  const auto copy = config(TaskKind::kCopy, {{"min_length", 5}, {"max_length", 5}, {"alphabet", "xyz"}});
  const auto rev = config(TaskKind::kReverse, {{"prompt_template", "Reverse this: {}\nAnswer:"}});
  std::set<size_t> lengths;
  for (uint64_t i = 0; i < 200; ++i) {
    const auto s = generate_task(sort, i);
    std::vector<std::string> items;
    for (size_t p = 0; p < s.question.size(); p += 2) items.emplace_back(1, s.question[p]);
    lengths.insert(items.size());
    for (const auto& it : items) EXPECT_TRUE(std::islower(static_cast<unsigned char>(it[0]))) << s.question;
    std::sort(items.begin(), items.end());
    std::string want;
    for (const auto& it : items) want += (want.empty() ? "" : " ") + it;
    EXPECT_EQ(s.answer, want);
    EXPECT_EQ(s.prompt, "sort " + s.question + " =");

    const auto c = generate_task(copy, i);
    EXPECT_EQ(c.question.size(), 5u);
    EXPECT_EQ(c.question.find_first_not_of("xyz"), std::string::npos);
    EXPECT_EQ(c.answer, c.question);

    const auto r = generate_task(rev, i);
    EXPECT_EQ(r.answer, std::string(r.question.rbegin(), r.question.rend()));
    EXPECT_EQ(r.prompt, "Reverse this: " + r.question + "\nAnswer:");
  }
  EXPECT_EQ(lengths, (std::set<size_t>{4, 5, 6}));
}

TEST(SyntheticTasks, ScoresAreExactWithPartialAndFormatCredit) {
  auto s = score_task(TaskKind::kArithmetic, " 19\n", "19");
  EXPECT_EQ(s.exact, 1);
  EXPECT_EQ(s.partial, 1);
  s = score_task(TaskKind::kArithmetic, "18", "19");
  EXPECT_EQ(s.exact, 0);
  EXPECT_DOUBLE_EQ(s.partial, 0.5);  // the tens digit is right
  EXPECT_EQ(s.format, 1);
  s = score_task(TaskKind::kArithmetic, "19.0", "19");
  EXPECT_EQ(s.exact + s.partial + s.format, 0);
  s = score_task(TaskKind::kSort, "1 3 9 4", "1 3 4 9");
  EXPECT_EQ(s.exact, 0);
  EXPECT_DOUBLE_EQ(s.partial, 0.5);
  EXPECT_EQ(s.format, 1);  // a permutation of the input
  EXPECT_EQ(score_task(TaskKind::kSort, "1,3, 4  9", "1 3 4 9").exact, 1);
  s = score_task(TaskKind::kReverse, "abcx", "abcd");
  EXPECT_DOUBLE_EQ(s.partial, 0.75);
  EXPECT_EQ(s.format, 1);
  EXPECT_EQ(score_task(TaskKind::kCopy, "abc", "abcd").format, 0);
  EXPECT_EQ(solve_task(TaskKind::kArithmetic, "12+7*2="), "26");
  EXPECT_EQ(solve_task(TaskKind::kArithmetic, "12+x="), std::nullopt);
}

TEST(SyntheticTasks, BadSettingsNameTheKey) {
  EXPECT_EQ(error_of(TaskKind::kArithmetic, {{"num_digits", 0}}), "data.train.num_digits: expected an integer in [1, 9], got 0");
  EXPECT_EQ(error_of(TaskKind::kArithmetic, {{"operators", "+/"}}),
            "data.train.operators: expected a non-empty string of + - *, got \"+/\"");
  EXPECT_EQ(error_of(TaskKind::kArithmetic, {{"min_length", 3}}), "data.train.min_length: unknown key for the arithmetic task");
  EXPECT_EQ(error_of(TaskKind::kSort, {{"min_length", 5}, {"max_length", 2}}),
            "data.train.min_length: 5 is more than max_length 2");
  EXPECT_EQ(error_of(TaskKind::kCopy, {{"alphabet", "a"}}),
            "data.train.alphabet: expected 'digits', 'letters' or at least two printable ASCII characters (no comma), got \"a\"");
  EXPECT_EQ(error_of(TaskKind::kCopy, {{"prompt_template", "no placeholder"}}),
            "data.train.prompt_template: expected a string containing {} for the question, got \"no placeholder\"");
  EXPECT_EQ(error_of(TaskKind::kSort, {{"size", 0}}), "data.train.size: expected an integer in [1, 1099511627776], got 0");
}

// ---- through the plugin ----------------------------------------------------------------------

namespace {

struct Plugin {
  rlhost_t* h = nullptr;
  const rlh_host_api* services = nullptr;
  Plugin() {
    rlh::sdk::check(rlhost_create(&h));
    rlh::sdk::check(rlhost_load_plugin(h, RLH_ENVIRONMENTS_PLUGIN));
    services = rlhost_services(h);
  }
  ~Plugin() { rlhost_destroy(h); }
  const rlh_component_desc* find(int32_t kind, const char* name) const {
    const rlh_component_desc* d = nullptr;
    rlh::sdk::check(services->find_component(services->ctx, kind, name, &d));
    return d;
  }
};

struct EnvHandle {
  const rlh_environment_api* api;
  rlh_environment* env = nullptr;
  EnvHandle(const Plugin& p, const char* name, const json& cfg = json::object()) {
    api = static_cast<const rlh_environment_api*>(p.find(RLH_KIND_ENVIRONMENT, name)->api);
    const std::string text = cfg.dump();
    rlh::sdk::check(api->create(p.services, text.data(), text.size(), &env));
  }
  ~EnvHandle() { api->destroy(env); }
  // Scores (response, metadata) pairs for `names`; throws the status as an Error.
  std::vector<double> score(const std::vector<std::pair<std::string, json>>& batch, std::vector<const char*> names) {
    std::vector<std::string> meta;
    for (const auto& b : batch) meta.push_back(b.second.dump());
    std::vector<rlh_env_sample> samples(batch.size());
    for (size_t i = 0; i < batch.size(); ++i) {
      samples[i] = {RLH_STRUCT_SIZE(rlh_env_sample, metadata_len), "", 0, batch[i].first.data(), batch[i].first.size(),
                    meta[i].data(), meta[i].size()};
    }
    std::vector<double> rewards(batch.size() * names.size(), -1);
    std::vector<uint8_t> done(batch.size(), 0);
    rlh_env_result result{RLH_STRUCT_SIZE(rlh_env_result, user), names.size(), names.data(), rewards.data(), done.data(),
                          nullptr, nullptr};
    rlh::sdk::check(api->score(env, samples.data(), samples.size(), &result));
    for (uint8_t d : done) EXPECT_EQ(d, 1);
    return rewards;
  }
};

std::string status_error(rlh_status* s) {
  if (s == nullptr) return "no error";
  std::string m = rlh::sdk::status_message(s);
  rlh_status_destroy(s);
  return m;
}

}  // namespace

TEST(EnvironmentsPlugin, DescribesItsComponentsAndKeys) {
  Plugin p;
  for (const char* name : {"math", "arithmetic", "sort", "copy", "reverse"}) {
    const auto* d = p.find(RLH_KIND_ENVIRONMENT, name);
    ASSERT_NE(d->config_keys, nullptr);
    EXPECT_EQ(std::string(d->config_keys[0]), std::string("env.") + name + ".*");
  }
  for (const char* name : {"synthetic_arithmetic", "synthetic_sort", "synthetic_copy", "synthetic_reverse"})
    EXPECT_EQ(p.find(RLH_KIND_DATASET, name)->kind, RLH_KIND_DATASET);
  EnvHandle math(p, "math");
  std::string names;
  rlh::sdk::check(math.api->reward_names(math.env, rlh::sdk::write_to_string, &names));
  EXPECT_EQ(names, R"(["reward","reward/format","count/score_budget_exceeded"])");
}

TEST(EnvironmentsPlugin, MathScoresABatchInTheRequestedRewardOrder) {
  Plugin p;
  EnvHandle math(p, "math", {{"num_workers", 8}});
  const json half = {{"ground_truth", "\\frac{1}{2}"}};
  auto r = math.score({{"so the result is \\boxed{0.5}", half},
                       {"The answer is 1/2.", half},
                       {"I think \\boxed{\\frac{1}{3}}", half},
                       {"no idea", half},
                       {"\\boxed{(1, 2)}", {{"ground_truth", "\\boxed{\\left(1,2\\right)}"}}},  // boxed truth
                       {"\\boxed{42}", {{"answer", 42}}}},                                       // rlhost rows
                      {"reward/format", "reward"});
  EXPECT_EQ(r, (std::vector<double>{1, 1, 0, 1, 1, 0, 0, 0, 1, 1, 1, 1}));

  EnvHandle keyed(p, "math", {{"ground_truth_key", "expected_answer"}});
  EXPECT_EQ(keyed.score({{"\\boxed{7}", {{"expected_answer", "7"}, {"ground_truth", "8"}}}}, {"reward"}),
            std::vector<double>{1});
}

TEST(EnvironmentsPlugin, BadInputsAreOneLineErrors) {
  Plugin p;
  EnvHandle math(p, "math");
  try {
    math.score({{"\\boxed{1}", {{"question", "?"}}}}, {"reward"});
    ADD_FAILURE();
  } catch (const rlh::sdk::Error& e) {
    EXPECT_STREQ(e.what(), "env.math: sample 0: metadata has no 'ground_truth' (env.math.ground_truth_key) or 'answer'");
  }
  try {
    math.score({{"1", {{"ground_truth", "1"}}}}, {"reward/partial"});
    ADD_FAILURE();
  } catch (const rlh::sdk::Error& e) {
    EXPECT_STREQ(e.what(), "env.math: unknown reward 'reward/partial' (this environment produces "
                           "[\"reward\",\"reward/format\",\"count/score_budget_exceeded\"])");
  }
  const auto* api = static_cast<const rlh_environment_api*>(p.find(RLH_KIND_ENVIRONMENT, "math")->api);
  rlh_environment* env = nullptr;
  auto create_error = [&](const std::string& cfg) { return status_error(api->create(p.services, cfg.data(), cfg.size(), &env)); };
  EXPECT_EQ(create_error(R"({"relative_tolerence": 1e-6})"), "env.math.relative_tolerence: unknown key");
  EXPECT_EQ(create_error(R"({"relative_tolerance": 2})"), "env.math.relative_tolerance: expected a number in (0, 1), got 2");
  EXPECT_EQ(create_error(R"({"verifier_type": "english_multichoice"})"),
            "env.math.verifier_type: only 'math' is implemented, got \"english_multichoice\"");
  EXPECT_EQ(create_error("{oops").rfind("env.math: config is not valid JSON: ", 0), 0u);
  EnvHandle arith(p, "arithmetic");
  rlh_env_sample bad{RLH_STRUCT_SIZE(rlh_env_sample, metadata_len), "", 0, "3", 1, "[1]", 3};
  double reward = 0;
  uint8_t done = 0;
  const char* reward_name = "reward";
  rlh_env_result result{RLH_STRUCT_SIZE(rlh_env_result, user), 1, &reward_name, &reward, &done, nullptr, nullptr};
  EXPECT_EQ(status_error(arith.api->score(arith.env, &bad, 1, &result)), "env.arithmetic: sample 0: metadata is not a JSON object");
}

// Issue 18: a response past the scoring budget scores 0, is counted in
// count/score_budget_exceeded, gets one warning per batch, and the batch's other responses are
// scored as usual (the run goes on).
TEST(EnvironmentsPlugin, ResponsesPastTheScoringBudgetScoreZeroAndAreCounted) {
  Plugin p;
  EnvHandle math(p, "math", {{"max_score_work", 20000}, {"max_response_bytes", 100000}});
  const json truth = {{"ground_truth", std::string(3000, '7')}};
  testing::internal::CaptureStderr();
  auto r = math.score({{"\\boxed{" + std::string(3000, '7') + "}", truth},  // too much work
                       {"\\boxed{7}", {{"ground_truth", "7"}}},
                       {std::string(200000, ' ') + "\\boxed{7}", {{"ground_truth", "7"}}}},  // too long
                      {"reward", "count/score_budget_exceeded", "reward/format"});
  const std::string log = testing::internal::GetCapturedStderr();
  EXPECT_EQ(r, (std::vector<double>{0, 1, 0, 1, 0, 1, 0, 1, 0}));
  EXPECT_NE(log.find("env.math: 2 of 3 responses exceeded the scoring budget and scored 0"), std::string::npos) << log;
  EnvHandle copy(p, "copy", {{"max_response_bytes", 10}});
  r = copy.score({{"abc", {{"answer", "abc"}}}, {std::string(11, 'a'), {{"answer", "abc"}}}},
                 {"reward", "count/score_budget_exceeded"});
  EXPECT_EQ(r, (std::vector<double>{1, 0, 0, 1}));
  const auto* api = static_cast<const rlh_environment_api*>(p.find(RLH_KIND_ENVIRONMENT, "math")->api);
  rlh_environment* env = nullptr;
  const std::string bad = R"({"max_score_work": 0})";
  EXPECT_EQ(status_error(api->create(p.services, bad.data(), bad.size(), &env)),
            "env.math.max_score_work: expected a positive integer, got 0");
}

TEST(EnvironmentsPlugin, SyntheticDatasetRowsScoreThroughTheirEnvironments) {
  Plugin p;
  for (const char* task : {"arithmetic", "sort", "copy", "reverse"}) {
    const std::string ds_name = std::string("synthetic_") + task;
    const auto* dapi = static_cast<const rlh_dataset_api*>(p.find(RLH_KIND_DATASET, ds_name.c_str())->api);
    const std::string cfg = json{{"dataset_name", ds_name}, {"seed", 9}, {"size", 25}, {"split", "train"}}.dump();
    rlh_dataset* ds = nullptr;
    rlh::sdk::check(dapi->create(p.services, cfg.data(), cfg.size(), &ds));
    ASSERT_EQ(dapi->size(ds), 25);
    EnvHandle env(p, task);
    std::vector<std::pair<std::string, json>> batch;
    for (int64_t i = 0; i < 25; ++i) {
      std::string text;
      rlh::sdk::check(dapi->get(ds, i, rlh::sdk::write_to_string, &text));
      const json row = json::parse(text);
      EXPECT_EQ(row["task"], task);
      EXPECT_EQ(row["index"], i);
      batch.emplace_back(row["answer"].get<std::string>(), row);          // right
      batch.emplace_back(row["answer"].get<std::string>() + "0", row);    // wrong
      json question_only = {{"question", row["question"]}};                // answer solved from the question
      batch.emplace_back(row["answer"].get<std::string>(), question_only);
    }
    const auto r = env.score(batch, {"reward"});
    for (size_t i = 0; i < batch.size(); ++i) EXPECT_EQ(r[i], i % 3 == 1 ? 0.0 : 1.0) << task << " sample " << i;
    std::string out;
    rlh_status* s = dapi->get(ds, 25, rlh::sdk::write_to_string, &out);
    EXPECT_EQ(status_error(s), ds_name + ": row 25 out of range [0, 25)");
    dapi->destroy(ds);

    const std::string wrong = json{{"dataset_name", "synthetic_other"}, {"split", "validation"}}.dump();
    EXPECT_EQ(status_error(dapi->create(p.services, wrong.data(), wrong.size(), &ds)),
              "data.validation.dataset_name: \"synthetic_other\" is not " + ds_name);
  }
}
