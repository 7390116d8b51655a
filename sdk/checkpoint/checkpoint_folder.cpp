// Checkpoint folders: the tmp_step_N -> step_N commit protocol, retention (NeMo-RL's
// remove_old_checkpoints), and finding checkpoints for resume.
//
// Crash safety rests on three rename(2)s, each atomic:
//   commit:     tmp_step_N (complete, manifest written last, all fsynced) -> step_N
//   replace:    an existing step_N is swapped with tmp_step_N in one renameat2(RENAME_EXCHANGE);
//               the old contents then go tmp_step_N -> old_step_N and are deleted
//   retention:  step_N -> removing_step_N, then deleted
// so a step_N/ is never partial. Leftovers are tmp_step_*, old_step_* and removing_step_*;
// clean_leftovers() removes them (and restores old_step_N when a non-atomic fallback replace
// died between its two renames, leaving no step_N).
#include <fcntl.h>
#include <stdio.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <fstream>
#include <limits>
#include <map>

#include "checkpoint_io.hpp"
#include "rlhost/sdk/checkpoint.hpp"
#include "rlhost/sdk/json_input.hpp"
#include "rlhost/sdk/status.hpp"

namespace rlh::sdk {
namespace fs = std::filesystem;

namespace {

constexpr const char* kTmpPrefix = "tmp_step_";
constexpr const char* kOldPrefix = "old_step_";
constexpr const char* kRemovingPrefix = "removing_step_";

std::string step_name(const char* prefix, int64_t step) { return prefix + std::to_string(step); }

[[noreturn]] void bad_config(std::string_view origin, const char* key, const std::string& why,
                             const nlohmann::json& v) {
  throw Error(RLH_E_INVALID_ARGUMENT, std::string(origin) + "." + key + ": " + why + ", got " + v.dump());
}

std::optional<int64_t> read_opt_int(const nlohmann::json& j, std::string_view origin, const char* key,
                                    int64_t min) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return std::nullopt;
  if (!it->is_number_integer() || it->get<int64_t>() < min)
    bad_config(origin, key, "expected an integer >= " + std::to_string(min) + " or null", *it);
  return it->get<int64_t>();
}

// NeMo-RL's convert_to_seconds: "DD:HH:MM:SS", four fields of decimal digits (none is bounded to
// its unit's range there either, so "00:00:90:00" is 90 minutes). nullopt when malformed.
std::optional<int64_t> parse_dhms(const std::string& s) {
  int64_t fields[4] = {0, 0, 0, 0};
  size_t at = 0;
  for (int f = 0; f < 4; ++f) {
    if (f > 0) {
      if (at >= s.size() || s[at] != ':') return std::nullopt;
      ++at;
    }
    const size_t begin = at;
    while (at < s.size() && s[at] >= '0' && s[at] <= '9' && at - begin < 9) fields[f] = fields[f] * 10 + (s[at++] - '0');
    if (at == begin || (at < s.size() && s[at] >= '0' && s[at] <= '9')) return std::nullopt;  // empty or > 9 digits
  }
  if (at != s.size()) return std::nullopt;
  return fields[0] * 86400 + fields[1] * 3600 + fields[2] * 60 + fields[3];
}

void remove_tree(const fs::path& p) {
  std::error_code ec;
  fs::remove_all(p, ec);
  if (ec) throw Error(RLH_E_UNAVAILABLE, p.string() + ": cannot remove: " + ec.message());
}

void rename_or_fail(const fs::path& from, const fs::path& to) {
  if (::rename(from.c_str(), to.c_str()) != 0)
    ckpt::io_fail(from, "cannot rename to " + to.string(), errno);
}

// The metric value used for ranking; missing or non-numeric sorts last, as NeMo-RL's
// .get(metric, -inf) / .get(metric, +inf).
double metric_of(const CheckpointInfo& c, const std::string& name, bool higher_is_better) {
  const double worst = higher_is_better ? -std::numeric_limits<double>::infinity()
                                        : std::numeric_limits<double>::infinity();
  if (name.empty() || !c.training_info.is_object()) return worst;
  auto it = c.training_info.find(name);
  if (it == c.training_info.end() || !it->is_number()) return worst;
  const double v = it->get<double>();
  return std::isnan(v) ? worst : v;
}

// True when a ranks before b: better metric first, and among equal metrics the newer step.
bool better(const CheckpointInfo& a, const CheckpointInfo& b, const std::string& metric, bool higher) {
  const double ma = metric_of(a, metric, higher), mb = metric_of(b, metric, higher);
  if (ma != mb) return higher ? ma > mb : ma < mb;
  return a.step > b.step;
}

// tmp -> final. An existing final (re-saving a step, e.g. after a resume) is swapped out in one
// renameat2(RENAME_EXCHANGE) and its old contents, now at tmp, go to old_dir and are deleted.
void publish(const fs::path& tmp, const fs::path& final_dir, const fs::path& old_dir) {
  if (::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, final_dir.c_str(), RENAME_NOREPLACE) == 0) return;
  int err = errno;
  if (err == EINVAL || err == ENOSYS) {  // no renameat2 flags on this filesystem
    if (!fs::exists(final_dir)) {
      rename_or_fail(tmp, final_dir);
      return;
    }
    err = EEXIST;
  }
  if (err != EEXIST) ckpt::io_fail(tmp, "cannot rename to " + final_dir.string(), err);
  remove_tree(old_dir);
  if (::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, final_dir.c_str(), RENAME_EXCHANGE) == 0) {
    rename_or_fail(tmp, old_dir);
  } else if (errno == EINVAL || errno == ENOSYS) {
    // Two renames; clean_leftovers() restores old_dir if we die between them.
    rename_or_fail(final_dir, old_dir);
    rename_or_fail(tmp, final_dir);
  } else {
    ckpt::io_fail(tmp, "cannot swap with " + final_dir.string(), errno);
  }
  ckpt::fsync_dir(final_dir.parent_path());
  remove_tree(old_dir);
}

}  // namespace

// ---- configuration ---------------------------------------------------------------------------

CheckpointConfig CheckpointConfig::from_json(const nlohmann::json& j, std::string_view origin) {
  CheckpointConfig c;
  if (j.is_null()) return c;
  if (!j.is_object())
    throw Error(RLH_E_INVALID_ARGUMENT, std::string(origin) + ": expected a mapping, got " + j.dump());
  auto read_bool = [&](const char* key, bool def) {
    auto it = j.find(key);
    if (it == j.end() || it->is_null()) return def;
    if (!it->is_boolean()) bad_config(origin, key, "expected true or false", *it);
    return it->get<bool>();
  };
  c.enabled = read_bool("enabled", c.enabled);
  c.higher_is_better = read_bool("higher_is_better", c.higher_is_better);
  if (auto it = j.find("checkpoint_dir"); it != j.end() && !it->is_null()) {
    if (!it->is_string() || it->get<std::string>().empty())
      bad_config(origin, "checkpoint_dir", "expected a folder path", *it);
    c.checkpoint_dir = it->get<std::string>();
  }
  if (auto it = j.find("metric_name"); it != j.end() && !it->is_null()) {
    if (!it->is_string()) bad_config(origin, "metric_name", "expected a string or null", *it);
    c.metric_name = it->get<std::string>();
    // NeMo-RL asserts the prefix says which metrics (validation or training) the name is from.
    if (c.metric_name.rfind("val:", 0) != 0 && c.metric_name.rfind("train:", 0) != 0)
      bad_config(origin, "metric_name", "must start with 'val:' or 'train:' (e.g. 'val:accuracy')", *it);
  }
  c.keep_top_k = read_opt_int(j, origin, "keep_top_k", 0);
  c.ft_keep_latest_k = read_opt_int(j, origin, "ft_keep_latest_k", 0);
  if (auto p = read_opt_int(j, origin, "save_period", 1)) c.save_period = *p;
  c.ft_save_period = read_opt_int(j, origin, "ft_save_period", 1);
  if (auto it = j.find("checkpoint_must_save_by"); it != j.end() && !it->is_null()) {
    std::optional<int64_t> s;
    if (it->is_string()) s = parse_dhms(it->get<std::string>());
    if (!s) bad_config(origin, "checkpoint_must_save_by", "expected \"DD:HH:MM:SS\" (e.g. \"00:03:45:00\") or null", *it);
    c.must_save_by_s = *s;
  }
  return c;
}

// ---- a checkpoint being written --------------------------------------------------------------

PendingCheckpoint::PendingCheckpoint(CheckpointManager* mgr, int64_t step, fs::path tmp)
    : mgr_(mgr), step_(step), tmp_(std::move(tmp)) {}

PendingCheckpoint::PendingCheckpoint(PendingCheckpoint&& o) noexcept
    : mgr_(o.mgr_), step_(o.step_), tmp_(std::move(o.tmp_)), recorded_(std::move(o.recorded_)), done_(o.done_) {
  o.done_ = true;
}

PendingCheckpoint::~PendingCheckpoint() {
  if (done_) return;
  // Abandoned (an exception while saving): a tmp_step_N is never resumed from, so removing it
  // now only saves disk space. Best-effort; clean_leftovers() catches what this misses.
  std::error_code ec;
  fs::remove_all(tmp_, ec);
}

fs::path PendingCheckpoint::path_for(std::string_view rel) {
  if (!ckpt::is_safe_relative(rel) || rel == kCheckpointManifest)
    throw Error(RLH_E_INVALID_ARGUMENT, "checkpoint step " + std::to_string(step_) + ": bad file path '" +
                                            std::string(rel) + "' (relative, inside the folder, not the manifest)");
  fs::path p = tmp_ / fs::path(std::string(rel));
  const std::string key = fs::path(std::string(rel)).lexically_normal().generic_string();
  std::erase_if(recorded_, [&](const auto& r) { return r.first == key; });
  std::error_code ec;
  fs::create_directories(p.parent_path(), ec);
  if (ec) throw Error(RLH_E_UNAVAILABLE, p.parent_path().string() + ": cannot create folder: " + ec.message());
  return p;
}

void PendingCheckpoint::write_file(std::string_view rel, const void* data, size_t size) {
  const fs::path p = path_for(rel);
  const uint32_t crc = ckpt::write_file_synced(p, data, size);
  const Recorded rec{size, crc};
  const std::string key = fs::path(std::string(rel)).lexically_normal().generic_string();
  for (auto& [k, r] : recorded_)
    if (k == key) {
      r = rec;
      return;
    }
  recorded_.emplace_back(key, rec);
}

void PendingCheckpoint::write_training_info(const nlohmann::json& info) {
  if (!info.is_object())
    throw Error(RLH_E_INVALID_ARGUMENT, "checkpoint step " + std::to_string(step_) +
                                            ": training_info must be a JSON object, got " + info.type_name());
  write_file("training_info.json", info.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
}

void PendingCheckpoint::write_config_yaml(std::string_view yaml) { write_file("config.yaml", yaml); }

fs::path PendingCheckpoint::commit() {
  if (done_) throw Error(RLH_E_FAILED_PRECONDITION, "checkpoint step " + std::to_string(step_) + ": already committed");
  if (!fs::exists(tmp_ / "training_info.json"))
    throw Error(RLH_E_FAILED_PRECONDITION, "checkpoint step " + std::to_string(step_) +
                                               ": training_info.json was not written (" + tmp_.string() + ")");
  // 1. Every file: checksum (recorded at write time, or read now) and fsync; folders deepest
  //    first so each entry is durable before the folder naming it.
  std::vector<ckpt::ManifestEntry> entries;
  std::vector<fs::path> dirs;
  std::error_code ec;
  for (auto it = fs::recursive_directory_iterator(tmp_, ec); !ec && it != fs::recursive_directory_iterator();
       it.increment(ec)) {
    const fs::path& p = it->path();
    const auto st = it->symlink_status(ec);
    if (ec) break;
    const std::string rel = p.lexically_relative(tmp_).generic_string();
    if (fs::is_directory(st)) {
      dirs.push_back(p);
    } else if (fs::is_regular_file(st)) {
      if (rel == kCheckpointManifest) continue;  // a stale one is overwritten below
      ckpt::ManifestEntry e{rel, 0, 0};
      auto rec = std::find_if(recorded_.begin(), recorded_.end(), [&](const auto& r) { return r.first == rel; });
      if (rec != recorded_.end() && fs::file_size(p) == rec->second.size) {
        e.size = rec->second.size;
        e.crc32c = rec->second.crc;
      } else {
        e.crc32c = ckpt::checksum_file(p, &e.size, /*sync=*/true);
      }
      entries.push_back(std::move(e));
    } else {
      throw Error(RLH_E_INVALID_ARGUMENT, p.string() + ": not a regular file or folder (symlinks and special "
                                                       "files cannot be checkpointed)");
    }
  }
  if (ec) throw Error(RLH_E_UNAVAILABLE, tmp_.string() + ": cannot list: " + ec.message());
  std::sort(entries.begin(), entries.end(), [](const auto& a, const auto& b) { return a.path < b.path; });
  std::sort(dirs.begin(), dirs.end(), [](const fs::path& a, const fs::path& b) {
    return std::distance(a.begin(), a.end()) > std::distance(b.begin(), b.end());
  });
  for (const auto& d : dirs) ckpt::fsync_dir(d);
  // 2. The manifest last: its presence is what makes the folder a complete checkpoint.
  ckpt::write_manifest(tmp_, step_, entries);
  ckpt::fsync_dir(tmp_);
  // 3. Publish.
  const fs::path root = mgr_->config().checkpoint_dir;
  const fs::path final_dir = root / step_name("step_", step_);
  publish(tmp_, final_dir, root / step_name(kOldPrefix, step_));
  ckpt::fsync_dir(root);
  done_ = true;
  // 4. Retention, after the new checkpoint is safely in place.
  mgr_->remove_old_checkpoints();
  return final_dir;
}

// ---- the manager -----------------------------------------------------------------------------

CheckpointManager::CheckpointManager(CheckpointConfig cfg) : cfg_(std::move(cfg)) {}

bool CheckpointManager::is_periodic(int64_t step) const { return step % cfg_.save_period == 0; }

bool CheckpointManager::is_save_step(int64_t step) const {
  return is_periodic(step) || (cfg_.ft_save_period && step % *cfg_.ft_save_period == 0);
}

bool CheckpointManager::may_write(int64_t step, std::string* why) const {
  if (std::find(protected_.begin(), protected_.end(), step) == protected_.end()) return true;
  if (why != nullptr)
    *why = (cfg_.checkpoint_dir / step_name("step_", step)).string() + " is newer than the checkpoint this run resumed from (" +
           (resumed_step_ >= 0 ? "step_" + std::to_string(resumed_step_) : std::string("none")) +
           ") and is kept as it is, not overwritten";
  return false;
}

std::optional<CheckpointInfo> CheckpointManager::resume(const std::function<void(const CheckpointInfo&)>& load,
                                                        std::vector<std::string>* skipped, bool* load_failed) {
  std::vector<std::string> local;
  std::vector<std::string>& notes = skipped != nullptr ? *skipped : local;
  // Every step_<N>/ folder there now, whether it verifies or not.
  std::vector<int64_t> present;
  std::error_code ec;
  if (fs::is_directory(cfg_.checkpoint_dir, ec))
    for (auto it = fs::directory_iterator(cfg_.checkpoint_dir, ec); !ec && it != fs::directory_iterator();
         it.increment(ec))
      if (const int64_t n = ckpt::parse_step_name(it->path().filename().string(), "step_"); n >= 0) present.push_back(n);
  std::optional<CheckpointInfo> loaded;
  auto candidates = list(VerifyLevel::kSizes, &notes);
  for (auto c = candidates.rbegin(); c != candidates.rend() && !loaded; ++c) {
    const VerifyResult v = verify_checkpoint(c->dir, VerifyLevel::kChecksums);
    if (!v.ok) {
      notes.push_back(c->dir.string() + ": " + v.error);
      continue;
    }
    try {
      load(*c);
      loaded = *c;
    } catch (const Error& e) {
      // Damaged content falls back to the checkpoint before; anything else (a checkpoint of
      // another model or configuration) would fail the same way for every one: it stops.
      if (e.code() != RLH_E_DATA_LOSS) throw;
      if (load_failed != nullptr) *load_failed = true;
      notes.push_back(c->dir.string() + ": " + e.what());
    } catch (const std::exception& e) {
      if (load_failed != nullptr) *load_failed = true;
      notes.push_back(c->dir.string() + ": " + e.what());
    }
  }
  resumed_step_ = loaded ? loaded->step : -1;
  protected_.clear();
  for (int64_t n : present)
    if (n > resumed_step_) protected_.push_back(n);
  return loaded;
}

PendingCheckpoint CheckpointManager::begin(int64_t step) {
  if (step < 0) throw Error(RLH_E_INVALID_ARGUMENT, "checkpoint step must be >= 0, got " + std::to_string(step));
  if (std::string why; !may_write(step, &why)) throw Error(RLH_E_ALREADY_EXISTS, "checkpoint: " + why);
  std::error_code ec;
  fs::create_directories(cfg_.checkpoint_dir, ec);
  if (ec) throw Error(RLH_E_UNAVAILABLE, cfg_.checkpoint_dir.string() + ": cannot create folder: " + ec.message());
  const fs::path tmp = cfg_.checkpoint_dir / step_name(kTmpPrefix, step);
  remove_tree(tmp);  // a stale one from an interrupted save of the same step
  if (::mkdir(tmp.c_str(), 0755) != 0) ckpt::io_fail(tmp, "cannot create folder", errno);
  return PendingCheckpoint(this, step, tmp);
}

std::vector<CheckpointInfo> CheckpointManager::list(VerifyLevel level, std::vector<std::string>* skipped) const {
  std::vector<CheckpointInfo> out;
  std::error_code ec;
  if (!fs::is_directory(cfg_.checkpoint_dir, ec)) return out;
  for (auto it = fs::directory_iterator(cfg_.checkpoint_dir, ec); !ec && it != fs::directory_iterator();
       it.increment(ec)) {
    const std::string name = it->path().filename().string();
    const int64_t step = ckpt::parse_step_name(name, "step_");
    if (step < 0 || !it->is_directory()) continue;
    const VerifyResult v = verify_checkpoint(it->path(), level);
    if (!v.ok) {
      if (skipped != nullptr) skipped->push_back(it->path().string() + ": " + v.error);
      continue;
    }
    CheckpointInfo info{step, it->path(), nullptr};
    try {
      info.training_info =
          read_json_file((it->path() / "training_info.json").string(), ckpt::kMaxManifestBytes, "checkpoint file");
    } catch (const InputError& e) {
      if (skipped != nullptr) skipped->push_back(e.what());
      continue;
    }
    out.push_back(std::move(info));
  }
  if (ec) throw Error(RLH_E_UNAVAILABLE, cfg_.checkpoint_dir.string() + ": cannot list: " + ec.message());
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.step < b.step; });
  return out;
}

std::optional<CheckpointInfo> CheckpointManager::latest(VerifyLevel level) const {
  auto all = list(level);
  if (all.empty()) return std::nullopt;
  return std::move(all.back());
}

std::optional<CheckpointInfo> CheckpointManager::best(VerifyLevel level) const {
  auto all = list(level);
  if (all.empty()) return std::nullopt;
  std::vector<CheckpointInfo> with_metric;
  for (auto& c : all)
    if (!cfg_.metric_name.empty() && c.training_info.is_object() && c.training_info.contains(cfg_.metric_name) &&
        c.training_info[cfg_.metric_name].is_number())
      with_metric.push_back(c);
  if (with_metric.empty()) return std::move(all.back());
  return *std::min_element(with_metric.begin(), with_metric.end(), [&](const auto& a, const auto& b) {
    return better(a, b, cfg_.metric_name, cfg_.higher_is_better);
  });
}

size_t CheckpointManager::clean_leftovers() const {
  size_t removed = 0;
  std::error_code ec;
  if (!fs::is_directory(cfg_.checkpoint_dir, ec)) return 0;
  std::vector<fs::path> entries;
  for (auto it = fs::directory_iterator(cfg_.checkpoint_dir, ec); !ec && it != fs::directory_iterator();
       it.increment(ec))
    entries.push_back(it->path());
  if (ec) throw Error(RLH_E_UNAVAILABLE, cfg_.checkpoint_dir.string() + ": cannot list: " + ec.message());
  bool renamed = false;
  for (const auto& p : entries) {
    const std::string name = p.filename().string();
    if (ckpt::parse_step_name(name, kTmpPrefix) >= 0 || ckpt::parse_step_name(name, kRemovingPrefix) >= 0) {
      remove_tree(p);
      ++removed;
    } else if (const int64_t step = ckpt::parse_step_name(name, kOldPrefix); step >= 0) {
      const fs::path live = cfg_.checkpoint_dir / step_name("step_", step);
      if (!fs::exists(live) && verify_checkpoint(p, VerifyLevel::kSizes).ok) {
        rename_or_fail(p, live);  // the fallback replace died between its renames
        renamed = true;
      } else {
        remove_tree(p);
        ++removed;
      }
    }
  }
  if (removed > 0 || renamed) ckpt::fsync_dir(cfg_.checkpoint_dir);
  return removed;
}

std::vector<int64_t> CheckpointManager::remove_old_checkpoints() const {
  std::vector<int64_t> removed;
  if (!cfg_.keep_top_k && !cfg_.ft_keep_latest_k) return removed;  // NeMo-RL: keep everything
  auto history = list(VerifyLevel::kSizes);
  // Checkpoints newer than the one resumed from are neither counted nor removed (resume()).
  std::erase_if(history, [&](const CheckpointInfo& c) { return !may_write(c.step); });
  if (history.empty()) return removed;
  std::map<int64_t, bool> keep;
  keep[history.back().step] = true;  // the latest is always protected
  std::vector<CheckpointInfo> periodic;
  for (const auto& c : history)
    if (is_periodic(c.step)) periodic.push_back(c);
  if (cfg_.keep_top_k) {
    // Without a metric: recency. With one: the metric, ties to the newer step.
    std::sort(periodic.begin(), periodic.end(), [&](const auto& a, const auto& b) {
      if (cfg_.metric_name.empty()) return a.step > b.step;
      return better(a, b, cfg_.metric_name, cfg_.higher_is_better);
    });
    for (size_t i = 0; i < periodic.size() && i < static_cast<size_t>(*cfg_.keep_top_k); ++i)
      keep[periodic[i].step] = true;
  } else {
    for (const auto& c : periodic) keep[c.step] = true;
  }
  if (cfg_.ft_keep_latest_k)
    for (size_t i = 0; i < history.size() && i < static_cast<size_t>(*cfg_.ft_keep_latest_k); ++i)
      keep[history[history.size() - 1 - i].step] = true;
  for (const auto& c : history) {
    if (keep.count(c.step) != 0) continue;
    // Out of step_N's name first, so a crash mid-deletion leaves a leftover, not a partial step_N.
    const fs::path doomed = cfg_.checkpoint_dir / step_name(kRemovingPrefix, c.step);
    remove_tree(doomed);
    rename_or_fail(c.dir, doomed);
    ckpt::fsync_dir(cfg_.checkpoint_dir);
    remove_tree(doomed);
    removed.push_back(c.step);
  }
  return removed;
}

// ---- the save deadline -----------------------------------------------------------------------

SaveDeadline::SaveDeadline(std::optional<int64_t> budget_s, Now now) : budget_s_(budget_s), now_(std::move(now)) {
  if (!now_)
    now_ = [] { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); };
  start_ = previous_ = now_();
}

void SaveDeadline::mark_step() {
  const double t = now_();
  steps_time_ += t - previous_;
  previous_ = t;
  ++steps_;
}

bool SaveDeadline::due() {
  if (!budget_s_ || fired_) return false;
  const double elapsed = now_() - start_;
  const double mean_step = steps_ > 0 ? steps_time_ / double(steps_) : 0.0;
  fired_ = elapsed + mean_step >= double(*budget_s_);
  return fired_;
}

}  // namespace rlh::sdk
