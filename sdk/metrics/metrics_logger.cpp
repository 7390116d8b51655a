// The metrics logger: per-step rows fanned out to console, JSONL and TensorBoard sinks.
#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <cmath>
#include <cstring>
#include <ctime>

#include <nlohmann/json.hpp>

#include "rlhost/sdk/metrics.hpp"
#include "rlhost/sdk/status.hpp"

namespace rlh::sdk {
namespace {

namespace fs = std::filesystem;

double wall_now() {
  timespec t{};
  ::clock_gettime(CLOCK_REALTIME, &t);
  return static_cast<double>(t.tv_sec) + t.tv_nsec * 1e-9;
}

// "42s", "3m20s", "2h05m": short enough for a progress line.
std::string format_duration(double seconds) {
  if (!(seconds >= 0) || seconds > 1e9) return "--";
  const auto s = static_cast<int64_t>(std::llround(seconds));
  char buf[48];
  if (s < 60)
    std::snprintf(buf, sizeof(buf), "%" PRId64 "s", s);
  else if (s < 3600)
    std::snprintf(buf, sizeof(buf), "%" PRId64 "m%02" PRId64 "s", s / 60, s % 60);
  else
    std::snprintf(buf, sizeof(buf), "%" PRId64 "h%02" PRId64 "m", s / 3600, (s % 3600) / 60);
  return buf;
}

bool starts_with(std::string_view s, std::string_view p) { return s.substr(0, p.size()) == p; }

[[noreturn]] void config_error(std::string_view origin, const char* key, const char* expected,
                               const nlohmann::json& got) {
  throw Error(RLH_E_INVALID_ARGUMENT, std::string(origin) + "." + key + ": expected " + expected +
                                          ", got " + got.type_name() + " " + got.dump());
}

bool read_bool(const nlohmann::json& j, std::string_view origin, const char* key, bool def) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return def;
  if (!it->is_boolean()) config_error(origin, key, "true or false", *it);
  return it->get<bool>();
}

}  // namespace

const double* MetricsRow::find(std::string_view name) const {
  for (const auto& [n, v] : values)
    if (n == name) return &v;
  return nullptr;
}

// ---- console ---------------------------------------------------------------------------------

ConsoleSink::ConsoleSink(Options opts) : opts_(std::move(opts)) {}

std::string ConsoleSink::format_line(const MetricsRow& row, double now) {
  if (!first_) first_ = std::make_pair(row.step, now);
  std::string line = "[rlhost] step " + std::to_string(row.step);
  if (opts_.total_steps > 0) {
    char pct[32];
    std::snprintf(pct, sizeof(pct), " (%.1f%%)",
                  100.0 * static_cast<double>(row.step) / static_cast<double>(opts_.total_steps));
    line += "/" + std::to_string(opts_.total_steps) + pct;
    // Seconds per step: measured between rows once two were seen; before that the step's own
    // total_step_time timer when the algorithm logged it.
    double per_step = -1;
    if (row.step > first_->first)
      per_step = (now - first_->second) / static_cast<double>(row.step - first_->first);
    else if (const double* t = row.find(metric_names::kTimingTotalStep))
      per_step = *t;
    if (per_step >= 0)
      line += " | eta " + format_duration(per_step * static_cast<double>(
                                                          std::max<int64_t>(0, opts_.total_steps - row.step)));
    else
      line += " | eta --";
  }
  auto append = [&](const std::string& name, double v) {
    char buf[64];
    if (starts_with(name, "timing/"))
      std::snprintf(buf, sizeof(buf), "%.2fs", v);
    else
      std::snprintf(buf, sizeof(buf), "%.4g", v);
    line += " | " + name + " " + buf;
  };
  if (opts_.metrics.empty()) {
    for (const auto& [n, v] : row.values) append(n, v);
  } else {
    for (const auto& n : opts_.metrics)
      if (const double* v = row.find(n)) append(n, *v);
  }
  return line;
}

void ConsoleSink::write(const MetricsRow& row) {
  const std::string line = format_line(row, row.wall_time) + "\n";
  std::fwrite(line.data(), 1, line.size(), opts_.out);  // console output is best-effort
}

void ConsoleSink::flush() { std::fflush(opts_.out); }

// ---- JSONL -----------------------------------------------------------------------------------

JsonlSink::JsonlSink(const fs::path& file) : file_(file) {
  std::error_code ec;
  if (file.has_parent_path()) fs::create_directories(file.parent_path(), ec);
  if (ec)
    throw Error(RLH_E_UNAVAILABLE, file.parent_path().string() + ": cannot create folder: " + ec.message());
  f_ = std::fopen(file.c_str(), "ab");
  if (f_ == nullptr)
    throw Error(RLH_E_UNAVAILABLE, file.string() + ": cannot open for appending: " + std::strerror(errno));
}

JsonlSink::~JsonlSink() {
  if (f_ != nullptr) std::fclose(f_);
}

void JsonlSink::write(const MetricsRow& row) {
  nlohmann::ordered_json j;
  j["step"] = row.step;
  for (const auto& [n, v] : row.values) {
    if (n == "step") continue;  // the row's own key wins
    if (std::isfinite(v))
      j[n] = v;
    else
      j[n] = nullptr;
  }
  const std::string line = j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
  if (std::fwrite(line.data(), 1, line.size(), f_) != line.size())
    throw Error(RLH_E_UNAVAILABLE, file_.string() + ": write failed: " + std::strerror(errno));
  flush();  // one line per step: cheap, and a crash loses nothing already logged
}

void JsonlSink::flush() {
  if (f_ != nullptr && std::fflush(f_) != 0)
    throw Error(RLH_E_UNAVAILABLE, file_.string() + ": flush failed: " + std::strerror(errno));
}

// ---- configuration ---------------------------------------------------------------------------

MetricsConfig MetricsConfig::from_logger_json(const nlohmann::json& logger, std::string_view origin) {
  MetricsConfig c;
  if (logger.is_null()) return c;
  if (!logger.is_object())
    throw Error(RLH_E_INVALID_ARGUMENT, std::string(origin) + ": expected a mapping, got " + logger.type_name());
  if (auto it = logger.find("log_dir"); it != logger.end() && !it->is_null()) {
    if (!it->is_string()) config_error(origin, "log_dir", "a path string", *it);
    c.log_dir = it->get<std::string>();
  }
  c.tensorboard = read_bool(logger, origin, "tensorboard_enabled", c.tensorboard);
  c.jsonl = read_bool(logger, origin, "jsonl_enabled", c.jsonl);
  c.console = read_bool(logger, origin, "console_enabled", c.console);
  if (auto it = logger.find("console_metrics"); it != logger.end() && !it->is_null()) {
    if (!it->is_array()) config_error(origin, "console_metrics", "a list of metric names", *it);
    c.console_metrics.clear();
    for (const auto& m : *it) {
      if (!m.is_string()) config_error(origin, "console_metrics", "a list of metric names", *it);
      c.console_metrics.push_back(m.get<std::string>());
    }
  }
  return c;
}

// ---- logger ----------------------------------------------------------------------------------

MetricsLogger::MetricsLogger(const MetricsConfig& cfg) {
  if (cfg.console)
    add_sink(std::make_unique<ConsoleSink>(
        ConsoleSink::Options{cfg.total_steps, cfg.console_metrics, cfg.console_out}));
  if (cfg.jsonl) add_sink(std::make_unique<JsonlSink>(cfg.log_dir / "metrics.jsonl"));
  // NeMo-RL puts TensorBoard's files in <log_dir>/tensorboard.
  if (cfg.tensorboard) add_sink(std::make_unique<TensorBoardSink>(cfg.log_dir / "tensorboard"));
}

MetricsLogger::~MetricsLogger() {
  try {
    flush();
  } catch (...) {
    // A destructor cannot report; flush() explicitly to see write errors.
  }
}

void MetricsLogger::add_sink(std::unique_ptr<MetricsSink> sink) {
  std::lock_guard<std::mutex> lock(mu_);
  sinks_.push_back(std::move(sink));
}

void MetricsLogger::emit_locked() {
  if (!pending_) return;
  MetricsRow row = std::move(*pending_);
  pending_.reset();
  row.wall_time = wall_now();
  for (auto& s : sinks_) s->write(row);
}

void MetricsLogger::log(std::string_view name, double value, int64_t step) {
  std::lock_guard<std::mutex> lock(mu_);
  if (pending_ && pending_->step != step) emit_locked();
  if (!pending_) {
    pending_.emplace();
    pending_->step = step;
  }
  for (auto& [n, v] : pending_->values)
    if (n == name) {
      v = value;
      return;
    }
  pending_->values.emplace_back(std::string(name), value);
}

void MetricsLogger::log(const std::map<std::string, double>& metrics, int64_t step,
                        std::string_view prefix) {
  for (const auto& [k, v] : metrics)
    log(prefix.empty() ? k : std::string(prefix) + "/" + k, v, step);
}

void MetricsLogger::step_finished(int64_t step) {
  std::lock_guard<std::mutex> lock(mu_);
  if (pending_ && pending_->step == step) emit_locked();
}

void MetricsLogger::flush() {
  std::lock_guard<std::mutex> lock(mu_);
  emit_locked();
  for (auto& s : sinks_) s->flush();
}

std::vector<fs::path> MetricsLogger::files() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<fs::path> out;
  for (const auto& s : sinks_) {
    if (auto* j = dynamic_cast<const JsonlSink*>(s.get())) out.push_back(j->file());
    if (auto* t = dynamic_cast<const TensorBoardSink*>(s.get())) out.push_back(t->file());
  }
  return out;
}

}  // namespace rlh::sdk
