// rlhost SDK: checkpoint folders (static library rlh_checkpoint), NeMo-RL's `checkpointing`.
//
// Layout, as NeMo-RL's nemo_rl/utils/checkpoint.py:
//   <checkpoint_dir>/step_<N>/{training_info.json, config.yaml, policy/..., checkpoint_manifest.json}
// A checkpoint is written into tmp_step_<N>/, then committed: every file fsynced, a manifest
// listing every file with its size and CRC32C written last, the folder fsynced, renamed to
// step_<N>/ in one rename(2), and the parent fsynced. So a step_<N>/ either exists complete or not
// at all, whatever moment the writer dies; leftovers (tmp_step_*, old_step_*) are cleaned on the
// next start. Retention removes a checkpoint by first renaming it to old_step_<N>/, so a crash
// mid-deletion never leaves a partial step_<N>/.
//
//   rlh::sdk::CheckpointManager ckpt(rlh::sdk::CheckpointConfig::from_json(section));
//   if (auto last = ckpt.latest()) resume_from(last->dir, last->training_info);
//   ...
//   auto pending = ckpt.begin(step);
//   pending.write_training_info({{"step", step}, {"val:accuracy", acc}});
//   pending.write_config_yaml(resolved_yaml);
//   save_weights(pending.path_for("policy/weights"));   // any writer, any process
//   fs::path dir = pending.commit();                     // step_<N>/, then keep_top_k
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace rlh::sdk {

// NeMo-RL's `checkpointing` section (the keys the folder logic uses).
struct CheckpointConfig {
  bool enabled = true;
  std::filesystem::path checkpoint_dir = "results/grpo";
  // "val:<name>" or "train:<name>": the training_info.json key ranking checkpoints; empty = none
  // (keep_top_k then keeps the most recent).
  std::string metric_name;
  bool higher_is_better = true;
  std::optional<int64_t> keep_top_k;       // null: keep every periodic checkpoint
  int64_t save_period = 10;
  std::optional<int64_t> ft_keep_latest_k;  // also keep the k most recent (crash recovery)
  // Also save every ft_save_period steps (NeMo-RL's fault-tolerance saves). These are not
  // periodic for retention: ft_keep_latest_k keeps them, or being the latest. null: none.
  std::optional<int64_t> ft_save_period;
  // checkpoint_must_save_by, "DD:HH:MM:SS" in the config: the wall-clock budget in seconds from
  // the training loop's start (SaveDeadline). null: none.
  std::optional<int64_t> must_save_by_s;

  // Reads the section (JSON object). Keys it does not use (model_save_format, save_optimizer...)
  // belong to the algorithm and backend; a used key with a bad value is an error naming
  // `origin`.key and the value.
  static CheckpointConfig from_json(const nlohmann::json& section,
                                    std::string_view origin = "checkpointing");
};

inline constexpr const char* kCheckpointManifest = "checkpoint_manifest.json";

// How deeply a checkpoint is checked: sizes (cheap: stat only) or sizes and CRC32C (reads every
// byte).
enum class VerifyLevel { kSizes, kChecksums };

struct VerifyResult {
  bool ok = false;
  std::string error;  // first problem found: "<dir>/policy/x.bin: size 10, manifest says 12"
  size_t files = 0;
  uint64_t bytes = 0;
};

// Checks that `dir` holds a manifest and every file it lists, with the listed size (and CRC32C),
// and that the step numbers agree: the manifest's, the folder's (step_<N>) and training_info.json's
// "step" when it has one. The manifest and training_info.json are read as untrusted input
// (regular files, 64 MiB, JSON nesting bounded).
VerifyResult verify_checkpoint(const std::filesystem::path& dir,
                               VerifyLevel level = VerifyLevel::kChecksums);

// Parses a manifest's text (named `label` in errors) and checks its structure: format, version,
// step, and every entry (relative path inside the folder, size, CRC32C as 8 hex digits). Returns
// the first problem as one line, empty when it is well formed. Entries are appended to `files`
// when given. (verify_checkpoint's first half; fuzzed on its own.)
struct ManifestFile {
  std::string path;
  uint64_t size = 0;
  uint32_t crc32c = 0;
};
std::string parse_manifest(std::string_view text, const std::string& label, int64_t* step = nullptr,
                           std::vector<ManifestFile>* files = nullptr);

// A committed checkpoint.
struct CheckpointInfo {
  int64_t step = 0;
  std::filesystem::path dir;
  nlohmann::json training_info;  // training_info.json
};

// A tmp_step_<N>/ being written. Move-only; destroying it uncommitted removes the folder.
class PendingCheckpoint {
 public:
  PendingCheckpoint(PendingCheckpoint&& o) noexcept;
  PendingCheckpoint& operator=(PendingCheckpoint&&) = delete;
  PendingCheckpoint(const PendingCheckpoint&) = delete;
  ~PendingCheckpoint();

  int64_t step() const { return step_; }
  const std::filesystem::path& dir() const { return tmp_; }

  // `rel` under the folder, with its parent folders created. `rel` must stay inside (no "..",
  // not absolute). Files written there by other code or processes are included at commit (read,
  // checksummed and fsynced then).
  std::filesystem::path path_for(std::string_view rel);
  // Writes a whole file and fsyncs it.
  void write_file(std::string_view rel, const void* data, size_t size);
  void write_file(std::string_view rel, std::string_view text) {
    write_file(rel, text.data(), text.size());
  }
  // training_info.json: the step's state and metrics ("val:accuracy" etc. for keep_top_k).
  void write_training_info(const nlohmann::json& info);
  // config.yaml: the resolved configuration, as the caller renders it.
  void write_config_yaml(std::string_view yaml);

  // Makes the checkpoint durable and visible as step_<N>/ (replacing an existing step_<N>/
  // atomically), then applies retention. Returns the step_<N>/ path. training_info.json must
  // have been written.
  std::filesystem::path commit();

 private:
  friend class CheckpointManager;
  struct Recorded {
    uint64_t size;
    uint32_t crc;
  };
  PendingCheckpoint(class CheckpointManager* mgr, int64_t step, std::filesystem::path tmp);
  CheckpointManager* mgr_;
  int64_t step_;
  std::filesystem::path tmp_;
  // Files written through write_file: checksummed and fsynced already, not read again at commit
  // (unless path_for hands their path out again, since the caller may then rewrite them).
  std::vector<std::pair<std::string, Recorded>> recorded_;
  bool done_ = false;
};

class CheckpointManager {
 public:
  explicit CheckpointManager(CheckpointConfig cfg);
  const CheckpointConfig& config() const { return cfg_; }

  // NeMo-RL saves when step % save_period == 0 (the caller also saves at the end).
  bool is_periodic(int64_t step) const;
  // Whether step is saved on its number: periodic, or a multiple of ft_save_period (the caller
  // also saves at the end and when a SaveDeadline is due).
  bool is_save_step(int64_t step) const;

  // Starts tmp_step_<N>/ (removing a stale one first). The checkpoint folder is created.
  PendingCheckpoint begin(int64_t step);

  // Committed checkpoints (step_<N>/ passing verification at `level`), by ascending step.
  // step_<N>/ folders failing it (foreign, or damaged after commit) are skipped, never deleted;
  // `skipped` receives "<dir>: <reason>" for each when given.
  std::vector<CheckpointInfo> list(VerifyLevel level = VerifyLevel::kSizes,
                                   std::vector<std::string>* skipped = nullptr) const;
  // The newest complete checkpoint, for resume.
  std::optional<CheckpointInfo> latest(VerifyLevel level = VerifyLevel::kSizes) const;
  // The best by metric_name (ties: the newer); checkpoints without the metric are ignored, and
  // when none has it, the latest (NeMo-RL's get_best_checkpoint_path).
  std::optional<CheckpointInfo> best(VerifyLevel level = VerifyLevel::kSizes) const;

  // Resume with fallback. Tries the committed checkpoints from the newest down: each is
  // verified with checksums and step agreement, then handed to `load`; one that fails either
  // (load throws rlh::sdk::Error with RLH_E_DATA_LOSS, or any other std::exception) is skipped,
  // its reason ("<dir>: <problem>") appended to `skipped`, and the one before it is tried. An
  // Error with another code (a checkpoint of another model or configuration: every one would
  // fail the same way) propagates. Returns the checkpoint loaded, or nullopt when none could be.
  //
  // From then on this manager never writes over or removes a step_<N>/ that existed at resume
  // time with N above the step loaded (-1 when none): those are newer than the state the run
  // continues from, so replacing them would lose data (a skipped checkpoint stays for a person
  // to look at). may_write() says whether a step can be saved; begin() refuses one that cannot.
  //
  // `load` must leave the job in the state of the checkpoint it loads or throw; when it throws
  // after changing the job's state, `*load_failed` is set so the caller can stop instead of
  // training on from a half-loaded state when no older checkpoint loads either.
  std::optional<CheckpointInfo> resume(const std::function<void(const CheckpointInfo&)>& load,
                                       std::vector<std::string>* skipped, bool* load_failed = nullptr);
  // Whether checkpoint `step` may be written (false for a newer step_<N>/ protected by resume()),
  // with the reason in *why.
  bool may_write(int64_t step, std::string* why = nullptr) const;

  // Removes leftovers of interrupted writes and deletions: tmp_step_*/ and old_step_*/.
  // Returns how many folders were removed.
  size_t clean_leftovers() const;

  // NeMo-RL's remove_old_checkpoints: keeps the latest, the keep_top_k best periodic ones (all
  // periodic ones when keep_top_k is null), and the ft_keep_latest_k most recent; removes the rest.
  // Returns the removed steps.
  std::vector<int64_t> remove_old_checkpoints() const;

 private:
  CheckpointConfig cfg_;
  int64_t resumed_step_ = -1;     // the step resume() loaded (-1: none)
  std::vector<int64_t> protected_;  // step_<N>/ newer than it, present at resume time
};

// NeMo-RL's TimeoutChecker(checkpointing.checkpoint_must_save_by, fit_last_save_time=True), which
// its training loops start as they begin: after each step, due() says whether the time since the
// start plus the mean step time so far reaches the budget, so that the next step would pass it.
// The loop then saves a checkpoint (when checkpointing is enabled) and stops, as a job ahead of
// its scheduler's time limit must. due() answers true once.
class SaveDeadline {
 public:
  using Now = std::function<double()>;  // monotonic seconds; empty: steady_clock
  explicit SaveDeadline(std::optional<int64_t> budget_s, Now now = {});
  // A step ended: the time since the previous mark (or the start) counts as one step's.
  void mark_step();
  bool due();
  bool armed() const { return budget_s_.has_value(); }

 private:
  std::optional<int64_t> budget_s_;
  Now now_;
  double start_ = 0, previous_ = 0, steps_time_ = 0;
  int64_t steps_ = 0;
  bool fired_ = false;
};

}  // namespace rlh::sdk
