// rlhost SDK: the metrics logger (static library rlh_metrics).
//
// Scalars are recorded by name and step and grouped into one row per step; each finished row goes
// to every sink: a console progress line, a JSONL file (one object per step) and TensorBoard
// event files written natively (TFRecord framing with masked CRC32C, Event/Summary protobufs
// encoded by hand, no protobuf library).
//
//   rlh::sdk::MetricsConfig cfg = rlh::sdk::MetricsConfig::from_logger_json(logger_section);
//   cfg.total_steps = 100;
//   rlh::sdk::MetricsLogger log(cfg);
//   log.log("train/loss", 0.25, 1);
//   log.log(timings, 1, "timing/train");   // {"generation": 1.2} -> "timing/train/generation"
//   log.step_finished(1);                  // emits step 1 to every sink
//
// Metric names follow NeMo-RL (nemo_rl/algorithms/grpo.py logs with these prefixes); the names
// below are the ones its GRPO loop produces, so dashboards compare directly.
#pragma once

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace rlh::sdk {

namespace metric_names {
// train/<name>: the policy's train() results and rollout statistics.
inline constexpr const char* kTrainLoss = "train/loss";
inline constexpr const char* kTrainReward = "train/reward";
inline constexpr const char* kTrainGradNorm = "train/grad_norm";
inline constexpr const char* kTrainLr = "train/lr";
inline constexpr const char* kTrainGenKlError = "train/gen_kl_error";
inline constexpr const char* kTrainTokenMultProbError = "train/token_mult_prob_error";
inline constexpr const char* kTrainMeanGenTokens = "train/mean_gen_tokens_per_sample";
// validation/<name>.
inline constexpr const char* kValidationAccuracy = "validation/accuracy";
inline constexpr const char* kValidationAvgLength = "validation/avg_length";
// timing/train/<timer> (grpo.py's timer.time("...") blocks, summed per step, in seconds).
inline constexpr const char* kTimingTotalStep = "timing/train/total_step_time";
inline constexpr const char* kTimingDataProcessing = "timing/train/data_processing";
inline constexpr const char* kTimingPrepareForGeneration = "timing/train/prepare_for_generation/total";
inline constexpr const char* kTimingGeneration = "timing/train/generation";
inline constexpr const char* kTimingRewardCalculation = "timing/train/reward_calculation";
inline constexpr const char* kTimingLogprobPrep = "timing/train/logprob_inference_prep";
inline constexpr const char* kTimingLogprobs = "timing/train/policy_and_reference_logprobs";
inline constexpr const char* kTimingAdvantages = "timing/train/advantage_calculation";
inline constexpr const char* kTimingTrainingPrep = "timing/train/training_prep";
inline constexpr const char* kTimingPolicyTraining = "timing/train/policy_training";
inline constexpr const char* kTimingCheckpointing = "timing/train/checkpointing";
inline constexpr const char* kTimingValidation = "timing/validation/total_validation_time";
}  // namespace metric_names

// The scalars of one step, in the order they were first recorded.
struct MetricsRow {
  int64_t step = 0;
  double wall_time = 0;  // seconds since the Unix epoch when the row was finished
  std::vector<std::pair<std::string, double>> values;
  const double* find(std::string_view name) const;
};

// A destination for finished rows. Called with the logger's lock held, one row at a time.
class MetricsSink {
 public:
  virtual ~MetricsSink() = default;
  virtual void write(const MetricsRow& row) = 0;
  virtual void flush() {}
};

// One progress line per step:
//   [rlhost] step 12/100 (12.0%) | eta 3m20s | train/loss 0.1234 | train/reward 0.56 | ...
// The ETA extrapolates the mean wall time per step since the first row this sink saw.
class ConsoleSink : public MetricsSink {
 public:
  struct Options {
    int64_t total_steps = 0;           // 0: unknown, no percentage or ETA
    std::vector<std::string> metrics;  // shown when present, in this order; empty: all
    std::FILE* out = stdout;           // not owned
  };
  explicit ConsoleSink(Options opts);
  void write(const MetricsRow& row) override;
  void flush() override;
  // The line write() prints for `row` at wall time `now` (no newline); exposed for tests.
  std::string format_line(const MetricsRow& row, double now);

 private:
  Options opts_;
  std::optional<std::pair<int64_t, double>> first_;  // (step, wall time) of the first row
};

// One JSON object per line: {"step": n, "train/loss": ..., ...}. Non-finite values are written
// as null (JSON has no NaN).
class JsonlSink : public MetricsSink {
 public:
  // Appends to `file` (created with its folder when missing).
  explicit JsonlSink(const std::filesystem::path& file);
  ~JsonlSink() override;
  void write(const MetricsRow& row) override;
  void flush() override;
  const std::filesystem::path& file() const { return file_; }

 private:
  std::filesystem::path file_;
  std::FILE* f_ = nullptr;
};

// TensorBoard event file `events.out.tfevents.<unix time>.<hostname>` in `dir` (created when
// missing; a numeric suffix is added if that name is taken). The first record is the
// file_version "brain.Event:2" event; each row becomes one Event{wall_time, step,
// Summary{value{tag, simple_value}...}} record, flushed at once so TensorBoard sees it live.
class TensorBoardSink : public MetricsSink {
 public:
  explicit TensorBoardSink(const std::filesystem::path& dir);
  ~TensorBoardSink() override;
  void write(const MetricsRow& row) override;
  void flush() override;
  const std::filesystem::path& file() const { return file_; }

 private:
  void append_record(const std::string& payload);
  std::filesystem::path file_;
  std::FILE* f_ = nullptr;
};

// The wire format pieces, for other writers and for tests.
namespace tfevents {
// TFRecord framing: uint64 LE length, masked CRC32C of those 8 bytes, data, masked CRC32C of data.
std::string frame_record(std::string_view data);
// Event{wall_time, step, file_version: "brain.Event:2"}.
std::string encode_file_version_event(double wall_time);
// Event{wall_time, step, summary{value{tag, simple_value}...}} (simple_value is a float32).
std::string encode_scalars_event(double wall_time, int64_t step,
                                 const std::vector<std::pair<std::string, double>>& values);
}  // namespace tfevents

// The logger's settings, mostly NeMo-RL's `logger` section.
struct MetricsConfig {
  std::filesystem::path log_dir = "logs";  // logger.log_dir
  bool console = true;                     // logger.console_enabled (rlhost)
  bool jsonl = true;                       // logger.jsonl_enabled (rlhost): <log_dir>/metrics.jsonl
  bool tensorboard = false;                // logger.tensorboard_enabled: <log_dir>/tensorboard/
  std::vector<std::string> console_metrics = {
      metric_names::kTrainLoss, metric_names::kTrainReward, metric_names::kValidationAccuracy,
      metric_names::kTimingTotalStep, metric_names::kTimingGeneration,
      metric_names::kTimingPolicyTraining};  // logger.console_metrics (rlhost)
  int64_t total_steps = 0;                   // for the progress line; set by the algorithm
  std::FILE* console_out = stdout;

  // Reads a `logger` section (JSON object). Unknown keys are left to the host's key check; a
  // known key of the wrong type is an error naming `origin`.key.
  static MetricsConfig from_logger_json(const nlohmann::json& logger,
                                        std::string_view origin = "logger");
};

// Groups scalars into per-step rows and fans them out. Thread-safe.
class MetricsLogger {
 public:
  MetricsLogger() = default;
  // Builds the sinks `cfg` enables (creating folders and files; errors throw rlh::sdk::Error).
  explicit MetricsLogger(const MetricsConfig& cfg);
  ~MetricsLogger();  // emits the pending row, flushes
  MetricsLogger(const MetricsLogger&) = delete;
  MetricsLogger& operator=(const MetricsLogger&) = delete;

  void add_sink(std::unique_ptr<MetricsSink> sink);

  // Records `name` at `step`. A different step than the pending row's first emits that row.
  // The same name twice in one step keeps the last value.
  void log(std::string_view name, double value, int64_t step);
  // Records each entry as "<prefix>/<key>" (just "<key>" when prefix is empty), NeMo-RL's
  // logger.log_metrics(metrics, step, prefix).
  void log(const std::map<std::string, double>& metrics, int64_t step, std::string_view prefix);
  // Emits the pending row if it is `step` (NeMo-RL's step_finished=True).
  void step_finished(int64_t step);
  // Emits the pending row and flushes every sink.
  void flush();

  // The sinks' files, for messages ("metrics: logs/metrics.jsonl").
  std::vector<std::filesystem::path> files() const;

 private:
  void emit_locked();
  mutable std::mutex mu_;
  std::vector<std::unique_ptr<MetricsSink>> sinks_;
  std::optional<MetricsRow> pending_;
};

}  // namespace rlh::sdk
