// The multi-turn ENVIRONMENT components `sliding_puzzle_game`, `calculator` and `reveal`, and the
// DATASET component `sliding_puzzle_game` (seeded boards), over multi_turn_games.hpp. Registered
// by environments_plugin.cpp (multi_turn_components.hpp).
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "multi_turn_components.hpp"
#include "rlhost/dataset.h"
#include "rlhost/environment.h"
#include "rlhost/environments/multi_turn_games.hpp"
#include "rlhost/sdk/plugin.hpp"

namespace rlh::environments {
namespace {

using json = nlohmann::json;
using rlh::sdk::Error;

enum class Game { kPuzzle, kCalculator, kReveal };

constexpr const char* game_name(Game g) {
  return g == Game::kPuzzle ? "sliding_puzzle_game" : g == Game::kCalculator ? "calculator" : "reveal";
}

json parse_object(const char* text, size_t len, const std::string& origin) {
  if (text == nullptr || len == 0) return json::object();
  json j = json::parse(std::string_view(text, len), nullptr, false);
  if (j.is_discarded()) throw Error(RLH_E_INVALID_ARGUMENT, origin + ": config is not valid JSON");
  if (j.is_null()) return json::object();
  if (!j.is_object()) throw Error(RLH_E_INVALID_ARGUMENT, origin + ": expected a mapping, got " + j.dump());
  return j;
}

std::string string_key(const json& cfg, const char* key, std::string def, const std::string& origin) {
  auto it = cfg.find(key);
  if (it == cfg.end() || it->is_null()) return def;
  if (!it->is_string() || it->get<std::string>().empty())
    throw Error(RLH_E_INVALID_ARGUMENT, origin + "." + key + ": expected a key name, got " + it->dump());
  return it->get<std::string>();
}

struct GameEnv {
  rlh::sdk::MakeStatusFn make = nullptr;
  Game game = Game::kReveal;
  PuzzleConfig puzzle;
  std::string key;  // the row's ground truth / hidden answer key
  std::string origin() const { return std::string("env.") + game_name(game); }
};

template <Game G>
rlh_status* env_create(const rlh_host_api* host, const char* config_json, size_t config_len, rlh_environment** out) {
  const rlh::sdk::MakeStatusFn make = host != nullptr ? host->make_status : nullptr;
  return rlh::sdk::guard(make, [&] {
    auto env = std::make_unique<GameEnv>();
    env->make = make;
    env->game = G;
    if (out == nullptr) throw Error(RLH_E_INVALID_ARGUMENT, env->origin() + ": create: out is NULL");
    const json cfg = parse_object(config_json, config_len, env->origin());
    for (const auto& [k, v] : cfg.items()) {
      // num_workers: NeMo-RL's Ray worker count; turns are scored in-process here.
      const bool known = k == "num_workers" || (G == Game::kPuzzle && k == "cfg") ||
                         (G == Game::kCalculator && k == "ground_truth_key") || (G == Game::kReveal && k == "answer_key");
      if (!known) throw Error(RLH_E_INVALID_ARGUMENT, env->origin() + "." + k + ": unknown key");
    }
    if (G == Game::kPuzzle) env->puzzle = PuzzleConfig::from_json(cfg.value("cfg", json::object()), env->origin() + ".cfg");
    if (G == Game::kCalculator) env->key = string_key(cfg, "ground_truth_key", "ground_truth", env->origin());
    if (G == Game::kReveal) env->key = string_key(cfg, "answer_key", "answer", env->origin());
    *out = reinterpret_cast<rlh_environment*>(env.release());
  });
}

void env_destroy(rlh_environment* self) { delete reinterpret_cast<GameEnv*>(self); }

rlh_status* env_reward_names(rlh_environment* self, rlh_write_fn write, void* user) {
  auto* env = reinterpret_cast<GameEnv*>(self);
  return rlh::sdk::guard(env->make, [&] { write(user, "[\"reward\"]", 10); });
}

rlh_status* env_score(rlh_environment* self, const rlh_env_sample* samples, size_t n, rlh_env_result* result) {
  auto* env = reinterpret_cast<GameEnv*>(self);
  return rlh::sdk::guard(env->make, [&] {
    if (result == nullptr || !RLH_HAS_FIELD(result, rlh_env_result, done))
      throw Error(RLH_E_INVALID_ARGUMENT, env->origin() + ": score: result is NULL or too old");
    if (n > 0 && (samples == nullptr || result->done == nullptr || (result->num_rewards > 0 && result->rewards == nullptr)))
      throw Error(RLH_E_INVALID_ARGUMENT, env->origin() + ": score: samples, rewards or done is NULL");
    for (size_t r = 0; r < result->num_rewards; ++r) {
      const char* want = result->reward_names != nullptr ? result->reward_names[r] : nullptr;
      if (want == nullptr || std::string(want) != "reward")
        throw Error(RLH_E_INVALID_ARGUMENT, env->origin() + ": unknown reward '" + (want ? want : "(null)") +
                                                "' (this environment produces [\"reward\"])");
    }
    const bool observe = RLH_HAS_FIELD(result, rlh_env_result, user) && result->observation != nullptr;
    const bool stops = RLH_HAS_FIELD(result, rlh_env_result, stop_strings) && result->stop_strings != nullptr;
    for (size_t i = 0; i < n; ++i) {
      const rlh_env_sample& s = samples[i];
      const std::string where = env->origin() + ": sample " + std::to_string(i);
      json meta = json::object();
      if (s.metadata_json != nullptr && s.metadata_len > 0) {
        meta = json::parse(std::string_view(s.metadata_json, s.metadata_len), nullptr, false);
        if (meta.is_discarded() || !meta.is_object())
          throw Error(RLH_E_INVALID_ARGUMENT, where + ": metadata is not a JSON object");
      }
      const std::string_view response(s.response != nullptr ? s.response : "", s.response != nullptr ? s.response_len : 0);
      TurnResult t;
      try {
        t = env->game == Game::kPuzzle       ? sliding_puzzle_turn(meta, response, env->puzzle.max_moves)
            : env->game == Game::kCalculator ? calculator_turn(meta, response, env->key)
                                             : reveal_turn(meta, response, env->key);
      } catch (const Error& e) {
        throw Error(e.code(), where + ": " + e.what());
      }
      for (size_t r = 0; r < result->num_rewards; ++r) result->rewards[i * result->num_rewards + r] = t.reward;
      result->done[i] = t.done ? 1 : 0;
      if (observe && !t.observation.empty()) result->observation(result->user, i, t.observation.data(), t.observation.size());
      if (stops && !t.stop_strings.empty()) {
        std::vector<const char*> p;
        std::vector<size_t> len;
        for (const auto& st : t.stop_strings) {
          p.push_back(st.data());
          len.push_back(st.size());
        }
        result->stop_strings(result->user, i, p.data(), len.data(), p.size());
      }
    }
  });
}

template <Game G>
constexpr rlh_environment_api env_api() {
  return {RLH_STRUCT_SIZE(rlh_environment_api, score), env_create<G>, env_destroy, env_reward_names, env_score};
}

// ---- the puzzle dataset -----------------------------------------------------------------------

struct PuzzleData {
  rlh::sdk::MakeStatusFn make = nullptr;
  PuzzleConfig cfg;
};

rlh_status* ds_create(const rlh_host_api* host, const char* config_json, size_t config_len, rlh_dataset** out) {
  const rlh::sdk::MakeStatusFn make = host != nullptr ? host->make_status : nullptr;
  return rlh::sdk::guard(make, [&] {
    auto ds = std::make_unique<PuzzleData>();
    ds->make = make;
    if (out == nullptr) throw Error(RLH_E_INVALID_ARGUMENT, "sliding_puzzle_game: create: out is NULL");
    json cfg = parse_object(config_json, config_len, "sliding_puzzle_game");
    std::string origin = "sliding_puzzle_game";
    if (auto s = cfg.find("split"); s != cfg.end() && s->is_string()) origin = "data." + s->get<std::string>();
    // From the environment's section (NeMo-RL's env.sliding_puzzle_game.cfg, which its example
    // script generates the prompts from) or from a data section naming this dataset.
    if (auto c = cfg.find("cfg"); c != cfg.end()) {
      origin = "env.sliding_puzzle_game.cfg";
      json inner = *c;
      cfg = inner.is_object() ? inner : json::object();
    }
    if (auto n = cfg.find("dataset_name"); n != cfg.end() && !n->is_null() && *n != "sliding_puzzle_game")
      throw Error(RLH_E_INVALID_ARGUMENT, origin + ".dataset_name: " + n->dump() + " is not sliding_puzzle_game");
    ds->cfg = PuzzleConfig::from_json(cfg, origin);
    *out = reinterpret_cast<rlh_dataset*>(ds.release());
  });
}

void ds_destroy(rlh_dataset* self) { delete reinterpret_cast<PuzzleData*>(self); }

int64_t ds_size(const rlh_dataset* self) { return reinterpret_cast<const PuzzleData*>(self)->cfg.rows; }

rlh_status* ds_get(const rlh_dataset* self, int64_t index, rlh_write_fn write, void* user) {
  const auto* ds = reinterpret_cast<const PuzzleData*>(self);
  return rlh::sdk::guard(ds->make, [&] {
    if (index < 0 || index >= ds->cfg.rows)
      throw Error(RLH_E_OUT_OF_RANGE, "sliding_puzzle_game: row " + std::to_string(index) + " out of range [0, " +
                                          std::to_string(ds->cfg.rows) + ")");
    const std::string row = puzzle_row(ds->cfg, static_cast<uint64_t>(index)).dump();
    write(user, row.data(), row.size());
  });
}

constexpr rlh_environment_api kPuzzleApi = env_api<Game::kPuzzle>();
constexpr rlh_environment_api kCalculatorApi = env_api<Game::kCalculator>();
constexpr rlh_environment_api kRevealApi = env_api<Game::kReveal>();
constexpr rlh_dataset_api kPuzzleDataApi = {RLH_STRUCT_SIZE(rlh_dataset_api, get), ds_create, ds_destroy, ds_size,
                                            ds_get};

const char* const kPuzzleKeys[] = {"env.sliding_puzzle_game.*", nullptr};
const char* const kCalculatorKeys[] = {"env.calculator.*", nullptr};
const char* const kRevealKeys[] = {"env.reveal.*", nullptr};
const char* const kPuzzleDataKeys[] = {"data.train.game_config.*", "data.train.max_moves", "data.train.rows",
                                       "data.validation.game_config.*", "data.validation.max_moves",
                                       "data.validation.rows", nullptr};

}  // namespace

const rlh_component_desc kSlidingPuzzleEnv = rlh::sdk::component_desc(
    RLH_KIND_ENVIRONMENT, "sliding_puzzle_game", "0.1.0", RLH_ENVIRONMENT_API_VERSION_MAJOR,
    RLH_ENVIRONMENT_API_VERSION_MINOR, &kPuzzleApi, "multi-turn sliding puzzle (<action></action> moves), reward 1 when solved",
    kPuzzleKeys);
const rlh_component_desc kCalculatorEnv = rlh::sdk::component_desc(
    RLH_KIND_ENVIRONMENT, "calculator", "0.1.0", RLH_ENVIRONMENT_API_VERSION_MAJOR, RLH_ENVIRONMENT_API_VERSION_MINOR,
    &kCalculatorApi, "multi-turn tool calls: <calc>expr</calc> answered with <result>value</result>, then the math answer",
    kCalculatorKeys);
const rlh_component_desc kRevealEnv = rlh::sdk::component_desc(
    RLH_KIND_ENVIRONMENT, "reveal", "0.1.0", RLH_ENVIRONMENT_API_VERSION_MAJOR, RLH_ENVIRONMENT_API_VERSION_MINOR,
    &kRevealApi, "multi-turn synthetic: guess the hidden answer; a wrong guess reveals it", kRevealKeys);
const rlh_component_desc kSlidingPuzzleData = rlh::sdk::component_desc(
    RLH_KIND_DATASET, "sliding_puzzle_game", "0.1.0", RLH_DATASET_API_VERSION_MAJOR, RLH_DATASET_API_VERSION_MINOR,
    &kPuzzleDataApi, "seeded sliding-puzzle boards", kPuzzleDataKeys);

}  // namespace rlh::environments
