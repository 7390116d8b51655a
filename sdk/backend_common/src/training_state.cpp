// save_state / load_state: a model's whole training state in one folder.
//
//   model.safetensors (or shards + index)  the weights, HF names and shapes. float32 (the default):
//                                           the master weights themselves, so a restored run
//                                           continues bit for bit (an HF loader casts them to its
//                                           dtype). With save_dtype bfloat16: a round-to-nearest-
//                                           even bf16 copy, for users to take elsewhere
//   master_weights/model.safetensors       with save_dtype bfloat16 only: the float32 master
//                                           weights, which load_state reads (never the bf16 copy).
//                                           A subfolder, so HF and vLLM, which read the top
//                                           folder's *.safetensors, see only the export
//   config.json, generation_config.json,   copied from the model's folder, so the folder is a
//   tokenizer files                         loadable HF checkpoint (load_model takes it too);
//                                           with bf16 weights config.json's torch_dtype (and dtype,
//                                           when present) says bfloat16
//   optimizer.safetensors                  trainable models: torch's state names per engine
//                                           parameter (exp_avg.*, exp_avg_sq.*, momentum_buffer.*)
//   fp8_state/rank_<r>.bin                 FP8 delayed scaling (fp8_recipe = delayed) only: each
//                                           rank's amax histories (the CUDA engine's fp8_state,
//                                           per rank since every rank quantises its own data)
//   rlhost_state.json                      step (= weights version), optimizer kind, backend,
//                                           where the master weights are; "fp8_state" (recipe,
//                                           history length, ranks) when those files are there.
//                                           A state without it (no delayed scaling, or written
//                                           before rlhost kept the histories) loads with fresh
//                                           histories, said in the log
#include <filesystem>
#include <fstream>
#include <sstream>

#include "backend_internal.hpp"
#include "rlhost/sdk/json_input.hpp"
#include "rlhost/sdk/model_weights.hpp"

namespace fs = std::filesystem;

namespace rlh::backend {

using sdk::Error;
using json = nlohmann::json;

namespace {

constexpr const char* kStateFile = "rlhost_state.json";
constexpr const char* kOptimizerFile = "optimizer.safetensors";
constexpr const char* kFormat = "rlhost-backend-state";
constexpr const char* kMasterDir = "master_weights";
constexpr const char* kFp8Dir = "fp8_state";

// Files next to the weights that make the folder an HF checkpoint a tokenizer can use too.
constexpr const char* kSideFiles[] = {"config.json",          "generation_config.json", "tokenizer.json",
                                      "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                                      "vocab.json",            "merges.txt",             "chat_template.jinja"};

void write_text_atomically(const fs::path& path, const std::string& text) {
  const fs::path tmp = path.string() + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out << text;
    out.flush();
    if (!out) throw Error(RLH_E_UNAVAILABLE, "cannot write '" + tmp.string() + "'");
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  if (ec) throw Error(RLH_E_UNAVAILABLE, "cannot rename '" + tmp.string() + "': " + ec.message());
}

// A device model's AdamW state in the CPU optimizer's layout (Optimizer::state): exp_avg.* then
// exp_avg_sq.* over the trainable parameters in description order, nothing before the first
// update. So a state saved on either path loads on the other.
struct DeviceOptimizerState {
  DeviceEngine::AdamState adam;
  std::vector<Optimizer::StateTensor> tensors;
};

std::vector<size_t> trainable_params(const Model& m) {
  std::vector<size_t> out;
  for (size_t i = 0; i < m.desc.params.size(); ++i)
    if (!without_update(m, m.desc.params[i])) out.push_back(i);
  return out;
}

void view_adam_state(const Model& m, DeviceOptimizerState& s) {
  s.tensors.clear();
  if (s.adam.step == 0) return;
  for (auto [prefix, part] : {std::pair{"exp_avg", &s.adam.exp_avg}, std::pair{"exp_avg_sq", &s.adam.exp_avg_sq}})
    for (size_t i : trainable_params(m))
      s.tensors.push_back({std::string(prefix) + "." + m.desc.params[i].name, m.desc.params[i].shape, (*part)[i]});
}

// FP8 delayed scaling: this rank's amax histories into fp8_state/rank_<r>.bin (nothing when the
// model keeps none), and what rlhost_state.json says of them (null: none).
json write_fp8_state(const Model& m, const std::string& dir) {
  if (!m.device || !m.config.fp8.enabled || !m.config.fp8.delayed) return json(nullptr);
  const std::string bytes = m.device->fp8_state();
  const int64_t rank = m.dp ? m.dp->all.rank() : 0, ranks = m.dp ? m.dp->all.size() : 1;
  const fs::path folder = fs::path(dir) / kFp8Dir;
  std::error_code ec;
  fs::create_directories(folder, ec);
  if (ec) throw Error(RLH_E_UNAVAILABLE, "save_state: cannot create '" + folder.string() + "': " + ec.message());
  write_text_atomically(folder / ("rank_" + std::to_string(rank) + ".bin"), bytes);
  return json{{"recipe", "delayed"},
              {"amax_history_len", m.config.fp8.amax_history_len},
              {"ranks", ranks},
              {"folder", kFp8Dir}};
}

}  // namespace

namespace {

// The folder's files from a full state: one rank's own, or under data parallelism rank 0's
// gathered copy, so a state saved at any data-parallel size is the same files. `weights` is
// released once written (the optimizer's moments that follow may be as large again).
// `saved_by`: data-parallel runs name their size there.
void write_state_files(Model& m, const std::string& dir, std::vector<std::vector<float>>& weights,
                       const std::vector<Optimizer::StateTensor>& moments, const json& saved_by,
                       const json& fp8 = json(nullptr)) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec))
    throw Error(RLH_E_NOT_FOUND, "save_state: folder '" + dir + "' does not exist (the caller creates it)");
  try {
    const bool bf16 = m.config.save_dtype == "bfloat16";
    sdk::TransformerDesc f32 = m.desc;
    for (auto& p : f32.params) p.dtype = sdk::st::DType::F32;
    // Tensors that are no parameter pass through as they were found, in both files.
    sdk::SaveOptions so;
    so.passthrough = &m.checkpoint;
    so.passthrough_names = m.passthrough;
    if (bf16) {
      fs::create_directories(fs::path(dir) / kMasterDir);
      sdk::save_weights_hf(f32, weights, (fs::path(dir) / kMasterDir).string(), so);
      sdk::TransformerDesc b16 = m.desc;
      for (auto& p : b16.params) p.dtype = sdk::st::DType::BF16;  // save_weights_hf rounds to nearest even
      sdk::save_weights_hf(b16, weights, dir, so);
    } else {
      sdk::save_weights_hf(f32, weights, dir, so);
    }
    weights.clear();
    weights.shrink_to_fit();

    if (!fs::equivalent(fs::path(m.dir), fs::path(dir), ec))
      for (const char* name : kSideFiles)
        if (fs::is_regular_file(fs::path(m.dir) / name, ec))
          fs::copy_file(fs::path(m.dir) / name, fs::path(dir) / name, fs::copy_options::overwrite_existing);
    if (has_value_head(m)) {
      // A value model saves as HF's *ForSequenceClassification with one label (score.weight), so
      // AutoModelForSequenceClassification loads it; a stored lm_head is an unused tensor there.
      const fs::path cfg_path = fs::path(dir) / "config.json";
      std::ifstream cin(cfg_path);
      nlohmann::ordered_json cfg = nlohmann::ordered_json::parse(cin);
      std::string lm = m.desc.architecture;
      if (const std::string tail = "ForCausalLM"; lm.size() > tail.size() && lm.ends_with(tail))
        lm.resize(lm.size() - tail.size());
      cfg["architectures"] = {lm + "ForSequenceClassification"};
      cfg["num_labels"] = 1;
      cfg["id2label"] = {{"0", "LABEL_0"}};
      cfg["label2id"] = {{"LABEL_0", 0}};
      write_text_atomically(cfg_path, cfg.dump(2) + "\n");
    }
    if (bf16) {
      // HF loads a checkpoint in config.json's dtype (torch_dtype, "dtype" since transformers
      // 4.56): say what the files hold. Key order is kept (ordered_json).
      const fs::path cfg_path = fs::path(dir) / "config.json";
      std::ifstream cin(cfg_path);
      nlohmann::ordered_json cfg = nlohmann::ordered_json::parse(cin);
      cfg["torch_dtype"] = "bfloat16";
      if (cfg.contains("dtype")) cfg["dtype"] = "bfloat16";
      write_text_atomically(cfg_path, cfg.dump(2) + "\n");
    }

    json state = {{"format", kFormat},
                  {"format_version", 1},
                  {"backend", m.owner->flavor->name},
                  {"role", m.role},
                  {"architecture", m.desc.architecture},
                  {"step", m.version()},
                  {"optimizer", m.trainable ? json(to_string(m.config.optimizer->kind)) : json(nullptr)},
                  {"weights_dtype", m.config.save_dtype}};
    if (bf16) state["master_weights"] = kMasterDir;
    if (!saved_by.is_null()) state["saved_by"] = saved_by;
    if (!fp8.is_null()) state["fp8_state"] = fp8;
    if (m.trainable) {
      std::vector<sdk::st::WriteTensor> tensors;
      for (const Optimizer::StateTensor& t : moments)
        tensors.push_back({t.name, sdk::st::DType::F32, t.shape,
                           std::as_bytes(std::span<const float>(t.data.data(), t.data.size()))});
      sdk::st::write_file((fs::path(dir) / kOptimizerFile).string(), tensors,
                          {{"format", "rlhost-optimizer"},
                           {"optimizer", to_string(m.config.optimizer->kind)},
                           {"step", std::to_string(m.version())}});
    }
    write_text_atomically(fs::path(dir) / kStateFile, state.dump(2) + "\n");
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    throw Error(RLH_E_UNAVAILABLE, "save_state into '" + dir + "': " + e.what());
  }
}

// Data parallel: the state in full (gathers are collective), written by rank 0 in the same
// files as one rank writes; every rank then learns whether rank 0 succeeded.
void save_state_dp(Model& m, const std::string& dir) {
  const bool writer = m.dp->all.rank() == 0;  // world rank 0 (data- and tensor-parallel rank 0)
  std::vector<std::vector<float>> params;
  std::vector<std::vector<float>> storage;
  std::vector<Optimizer::StateTensor> moments;
  DeviceOptimizerState device_state;
  if (m.device) {
    // Every rank holds the whole masters (under FSDP their blocks, gathered: collective; under
    // tensor parallelism its pieces, gathered over the tp group: collective); a sharded
    // optimizer's moments are gathered (collective: every rank asks), and under tensor
    // parallelism their pieces too.
    if (writer || m.dp_mode == Model::Dp::fsdp || m.tp()) params = device_parameters(m);
    if (m.trainable) {
      device_state.adam = device_adam_state(m);
      if (writer) {
        view_adam_state(m, device_state);
        moments = device_state.tensors;
      }
    }
  } else {
    params = dp_full_parameters(m, writer);
    moments = dp_full_optimizer_state(m, writer, storage);
  }
  int32_t ok[1] = {1};
  std::string error;
  rlh_code code = RLH_OK;
  // Every rank writes its own FP8 histories first; the state file (rank 0's, last) names them
  // only when every rank's are written.
  json fp8;
  try {
    fp8 = write_fp8_state(m, dir);
  } catch (const Error& e) {
    ok[0] = 0;
    error = e.what();
    code = e.code();
  } catch (const std::exception& e) {
    ok[0] = 0;
    error = std::string("save_state into '") + dir + "': FP8 state: " + e.what();
    code = RLH_E_UNAVAILABLE;
  }
  const int32_t mine = ok[0];
  m.dp->all.all_reduce(std::span<int32_t>(ok, 1), RLH_REDUCE_MIN);
  if (!mine) throw Error(code, error);
  if (!ok[0]) throw Error(RLH_E_ABORTED, "save_state into '" + dir + "': another rank could not write its FP8 state (its error names why)");
  if (writer) {
    try {
      json layout = {{"data_parallel_size", m.dp->size()}};
      if (m.tp()) layout["tensor_model_parallel_size"] = m.dp->tp_size();
      if (m.ep()) layout["expert_model_parallel_size"] = m.dp->ep_size();
      if (m.ep() && m.tp()) layout["expert_tensor_parallel_size"] = m.tp()->expert_size;
      if (m.pp()) layout["pipeline_model_parallel_size"] = m.dp->pp_size();
      write_state_files(m, dir, params, moments, layout, fp8);
    } catch (const Error& e) {
      ok[0] = 0;
      error = e.what();
      code = e.code();
    }
  }
  m.dp->all.broadcast(std::span<int32_t>(ok, 1), 0);
  if (writer && !ok[0]) throw Error(code, error);
  if (!ok[0]) throw Error(RLH_E_ABORTED, "save_state into '" + dir + "': rank 0, which writes the files, failed (its error names why)");
}

}  // namespace

void save_state(Model& m, const std::string& dir) {
  if (m.dp != nullptr) return save_state_dp(m, dir);
  std::error_code ec;
  if (!fs::is_directory(dir, ec))
    throw Error(RLH_E_NOT_FOUND, "save_state: folder '" + dir + "' does not exist (the caller creates it)");
  std::vector<std::vector<float>> weights;
  DeviceOptimizerState device_state;
  json fp8;
  try {
    fp8 = write_fp8_state(m, dir);
    weights = m.device ? device_parameters(m) : m.engine->save_parameters();
    if (m.trainable && m.device) {
      device_state.adam = device_adam_state(m);
      view_adam_state(m, device_state);
    }
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    throw Error(RLH_E_UNAVAILABLE, "save_state into '" + dir + "': " + e.what());
  }
  write_state_files(m, dir, weights,
                    !m.trainable ? std::vector<Optimizer::StateTensor>{}
                    : m.device   ? device_state.tensors
                                 : m.optimizer->state(),
                    json(nullptr), fp8);
}

namespace {
void load_state_here(Model& m, const std::string& dir);
}  // namespace

void load_state(Model& m, const std::string& dir) {
  if (m.dp == nullptr) return load_state_here(m, dir);
  // Every rank reads the files; all stop alike when any cannot.
  int32_t ok[1] = {1};
  try {
    load_state_here(m, dir);
  } catch (...) {
    ok[0] = 0;
    m.dp->all.all_reduce(std::span<int32_t>(ok, 1), RLH_REDUCE_MIN);
    throw;
  }
  m.dp->all.all_reduce(std::span<int32_t>(ok, 1), RLH_REDUCE_MIN);
  if (!ok[0]) throw Error(RLH_E_ABORTED, "load_state from '" + dir + "': another rank could not load it (its error names why)");
}

namespace {

// FP8 delayed scaling's histories (write_fp8_state), by what the state and the model say:
// both keep them: this rank's file is loaded (another history length is refused, naming the
// key); the state has none, or was saved at another number of ranks (the histories are per
// rank): they start fresh, said in the log; the model keeps none: the saved ones are left
// unused, said in the log.
void load_fp8_state(Model& m, const std::string& dir, const json& state) {
  const bool want = m.device && m.config.fp8.enabled && m.config.fp8.delayed;
  const bool has = state.contains("fp8_state") && state["fp8_state"].is_object();
  const std::string who = std::string(m.owner->flavor->name) + ": load_state from '" + dir + "': ";
  if (!has && !want) return;
  if (!want) {
    m.owner->host.info(who + "the state holds FP8 delayed-scaling amax histories, which this run does not use "
                             "(policy.megatron_cfg.fp8_cfg.fp8_recipe is not delayed): left unused");
    return;
  }
  if (!has) {
    m.owner->host.info(who + "no FP8 amax histories (saved without fp8_recipe = delayed, or by an rlhost that did "
                             "not keep them): delayed scaling starts with fresh histories");
    return;
  }
  const json& f = state["fp8_state"];
  const fs::path state_path = fs::path(dir) / kStateFile;
  if (!f.contains("amax_history_len") || !f["amax_history_len"].is_number_integer() || !f.contains("ranks") ||
      !f["ranks"].is_number_integer() || !f.contains("folder") || f["folder"] != kFp8Dir)
    throw Error(RLH_E_DATA_LOSS, state_path.string() + ": fp8_state must hold amax_history_len, ranks and folder \"" +
                                     kFp8Dir + "\"");
  const int64_t len = f["amax_history_len"].get<int64_t>();
  if (len != m.config.fp8.amax_history_len)
    throw Error(RLH_E_FAILED_PRECONDITION,
                "load_state: '" + dir + "' holds FP8 amax histories of " + std::to_string(len) +
                    " entries, this run's policy.megatron_cfg.fp8_cfg.fp8_amax_history_len is " +
                    std::to_string(m.config.fp8.amax_history_len) + " (set it to " + std::to_string(len) +
                    " to resume)");
  const int64_t ranks = m.dp ? m.dp->all.size() : 1, rank = m.dp ? m.dp->all.rank() : 0;
  if (f["ranks"].get<int64_t>() != ranks) {
    m.owner->host.info(who + "FP8 amax histories saved by " + std::to_string(f["ranks"].get<int64_t>()) +
                       " ranks, this run has " + std::to_string(ranks) + ": delayed scaling starts with fresh histories");
    return;
  }
  const fs::path file = fs::path(dir) / kFp8Dir / ("rank_" + std::to_string(rank) + ".bin");
  std::ifstream in(file, std::ios::binary);
  if (!in) throw Error(RLH_E_DATA_LOSS, "load_state: '" + file.string() + "' is missing (" + kStateFile + " names it)");
  std::ostringstream bytes;
  bytes << in.rdbuf();
  try {
    m.device->load_fp8_state(bytes.str());
  } catch (const std::invalid_argument& e) {
    throw Error(RLH_E_FAILED_PRECONDITION, "load_state: '" + file.string() + "': " + e.what());
  }
}

void load_state_here(Model& m, const std::string& dir) {
  const fs::path state_path = fs::path(dir) / kStateFile;
  if (!sdk::input_exists(state_path.string()))
    throw Error(RLH_E_NOT_FOUND, "load_state: '" + dir + "' has no " + kStateFile + " (not a folder save_state wrote)");
  json state;
  try {
    state = sdk::read_json_file(state_path.string(), 1u << 20, "backend state");
  } catch (const sdk::InputError& e) {
    throw Error(RLH_E_DATA_LOSS, e.what());
  }
  // (json::value() throws a type_error when the key holds another type: the file is untrusted.)
  if (!state.is_object() || !state.contains("format") || state["format"] != kFormat || !state.contains("step") ||
      !state["step"].is_number_integer() || state["step"].get<int64_t>() < 0)
    throw Error(RLH_E_DATA_LOSS, state_path.string() + ": not an rlhost backend state (format/step)");
  const int64_t step = state["step"].get<int64_t>();
  const std::string arch = state.contains("architecture") && state["architecture"].is_string()
                               ? state["architecture"].get<std::string>()
                               : std::string("(no architecture)");
  if (arch != m.desc.architecture)
    throw Error(RLH_E_FAILED_PRECONDITION, "load_state: '" + dir + "' holds a " + arch + " state, the model is " +
                                               m.desc.architecture);

  // The float32 masters: the folder itself, or the subfolder named when the HF weights beside
  // them were written in another dtype. Only the name save_state writes is taken (no path
  // leaves the folder).
  fs::path weights_dir = dir;
  if (state.contains("master_weights")) {
    if (state["master_weights"] != kMasterDir)
      throw Error(RLH_E_DATA_LOSS, state_path.string() + ": master_weights must be \"" + kMasterDir + "\", got " +
                                       state["master_weights"].dump());
    weights_dir /= kMasterDir;
  }
  try {
    sdk::st::Checkpoint ckpt = sdk::st::Checkpoint::open(weights_dir.string());
    sdk::TransformerDesc desc = m.desc;  // the file's dtypes are adopted by the copy only
    sdk::LoadOptions lo;
    if (weights_dir != fs::path(dir)) {  // masters beside an export are float32, nothing else
      for (auto& p : desc.params) p.dtype = sdk::st::DType::F32;
      lo.dtype_policy = sdk::DtypePolicy::strict;
    }
    sdk::LoadResult w = sdk::load_weights_f32(desc, ckpt, lo);
    if (m.device)
      device_load_parameters(m, w.tensors);  // this rank's pieces under tensor parallelism
    else if (m.dp != nullptr)
      dp_load_parameters(m, w.tensors);  // this rank's shards of the full tensors
    else
      m.engine->load_parameters(w.tensors);
    m.checkpoint = std::move(ckpt);
    m.passthrough = std::move(w.unused);
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    throw Error(RLH_E_DATA_LOSS, "load_state from '" + dir + "': " + e.what());
  }
  load_fp8_state(m, dir, state);

  if (!m.trainable) {
    m.loaded_version = step;
    return;
  }
  const std::string kind = to_string(m.config.optimizer->kind);
  if (!state.contains("optimizer") || !state["optimizer"].is_string())
    throw Error(RLH_E_FAILED_PRECONDITION, "load_state: '" + dir + "' has no optimizer state (saved from a frozen model)");
  if (state["optimizer"].get<std::string>() != kind)
    throw Error(RLH_E_FAILED_PRECONDITION, "load_state: '" + dir + "' holds " + state["optimizer"].get<std::string>() +
                                               " state, the model's optimizer is " + kind);
  try {
    const sdk::st::File f = sdk::st::File::open((fs::path(dir) / kOptimizerFile).string());
    // The optimizer's step must be the state's: files from two different saves do not resume.
    for (const auto& [key, value] : f.metadata())
      if (key == "step" && value != std::to_string(step))
        throw Error(RLH_E_DATA_LOSS, f.path() + ": optimizer state of step " + value + ", but " + kStateFile +
                                         " says step " + std::to_string(step));
    if (m.device) {
      // Moments start from zeros (a state saved before the first update has none).
      DeviceOptimizerState s;
      for (const sdk::ParamDesc& p : m.desc.params) {
        int64_t n = 1;
        for (int64_t d : p.shape) n *= d;
        s.adam.exp_avg.emplace_back(size_t(n), 0.0f);
        s.adam.exp_avg_sq.emplace_back(size_t(n), 0.0f);
      }
      s.adam.step = f.tensors().empty() ? 0 : 1;  // lists the tensors to read
      view_adam_state(m, s);
      if (f.tensors().size() != s.tensors.size())
        throw Error(RLH_E_DATA_LOSS, f.path() + ": " + std::to_string(f.tensors().size()) +
                                         " tensors, the model needs " + std::to_string(s.tensors.size()));
      for (const Optimizer::StateTensor& t : s.tensors) {
        const sdk::st::TensorInfo& info = f.at(t.name);
        if (info.shape != t.shape || info.dtype != sdk::st::DType::F32)
          throw Error(RLH_E_DATA_LOSS, f.path() + ": tensor '" + t.name + "' has the wrong shape or dtype");
        const std::vector<float> v = f.read_f32(t.name);
        std::copy(v.begin(), v.end(), t.data.begin());
      }
      s.adam.step = step;
      device_load_adam_state(m, s.adam);
      return;
    }
    if (m.dp != nullptr) {
      // Full moments from the file, per parameter, into this rank's shards: a state saved at
      // any data-parallel size (or by one rank) loads at this one.
      std::vector<std::vector<float>> first, second;
      if (!f.tensors().empty()) {
        const bool adam = m.config.optimizer->kind == OptimizerKind::adamw;
        first.resize(m.desc.params.size());
        if (adam) second.resize(m.desc.params.size());
        size_t expected = 0;
        for (size_t i = 0; i < m.desc.params.size(); ++i) {
          const sdk::ParamDesc& p = m.desc.params[i];
          if (without_update(m, p)) continue;
          for (auto [prefix, into] : {std::pair{adam ? "exp_avg" : "momentum_buffer", &first}, std::pair{"exp_avg_sq", &second}}) {
            if (into->empty()) continue;
            const std::string name = std::string(prefix) + "." + p.name;
            const sdk::st::TensorInfo& info = f.at(name);
            if (info.shape != p.shape || info.dtype != sdk::st::DType::F32)
              throw Error(RLH_E_DATA_LOSS, f.path() + ": tensor '" + name + "' has the wrong shape or dtype");
            (*into)[i] = f.read_f32(name);
            ++expected;
          }
        }
        if (f.tensors().size() != expected)
          throw Error(RLH_E_DATA_LOSS, f.path() + ": " + std::to_string(f.tensors().size()) + " tensors, the model needs " +
                                           std::to_string(expected));
      }
      dp_load_optimizer(m, first, second, step);
      return;
    }
    // A fresh optimizer (no moments yet) restarts from zeros, whatever this one holds.
    m.optimizer = make_optimizer(m);
    if (!f.tensors().empty()) {
      m.optimizer->allocate_state();
      const auto want = m.optimizer->state();
      if (want.size() != f.tensors().size())
        throw Error(RLH_E_DATA_LOSS, f.path() + ": " + std::to_string(f.tensors().size()) + " tensors, the model needs " +
                                         std::to_string(want.size()));
      for (const Optimizer::StateTensor& t : want) {
        const sdk::st::TensorInfo& info = f.at(t.name);
        if (info.shape != t.shape || info.dtype != sdk::st::DType::F32)
          throw Error(RLH_E_DATA_LOSS, f.path() + ": tensor '" + t.name + "' has the wrong shape or dtype");
        const std::vector<float> v = f.read_f32(t.name);
        std::copy(v.begin(), v.end(), t.data.begin());
      }
    }
    m.optimizer->set_steps(step);
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    throw Error(RLH_E_DATA_LOSS, "load_state from '" + dir + "': " + e.what());
  }
}

}  // namespace

}  // namespace rlh::backend
