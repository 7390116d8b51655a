// The multi-turn environments (multi_turn_games.hpp): the sliding puzzle (boards, moves, replay of
// earlier turns, the move limit), the calculator's tool calls and final answers, reveal; and the
// components through librlhost (observations through the callback, done flags, the puzzle
// dataset, one-line errors for bad config and metadata).
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "rlhost/dataset.h"
#include "rlhost/environment.h"
#include "rlhost/environments/multi_turn_games.hpp"
#include "rlhost/host.h"
#include "rlhost/sdk/status.hpp"

namespace {

using json = nlohmann::json;
using namespace rlh::environments;

json with_history(json meta, const std::vector<std::string>& responses) {
  json h = json::array();
  for (const auto& r : responses) h.push_back({{"response", r}, {"observation", "..."}});
  meta["rlh_history"] = h;
  return meta;
}

// The action that slides the tile at cell `to` (next to the empty space) into the empty space.
std::string action_towards(const Puzzle& p, int to) {
  return "<action>slide " + std::to_string(to / p.size + 1) + " " + std::to_string(to % p.size + 1) + "</action>";
}

}  // namespace

TEST(SlidingPuzzle, BoardsAreSeededSolvableWalks) {
  PuzzleConfig c;
  c.size = 3;
  c.shuffle_moves = 20;
  const Puzzle a = generate_puzzle(c, 7), b = generate_puzzle(c, 7), d = generate_puzzle(c, 8);
  EXPECT_EQ(a.grid, b.grid);
  EXPECT_NE(a.grid, d.grid);
  std::set<int> cells(a.grid.begin(), a.grid.end());
  EXPECT_EQ(cells.size(), 9u);
  c.shuffle_moves = 0;
  EXPECT_TRUE(generate_puzzle(c, 3).solved());
  const json row = puzzle_row(c, 3);
  EXPECT_NE(row["prompt"].get<std::string>().find("<action>"), std::string::npos);
  EXPECT_EQ(Puzzle::from_json(row["puzzle"], "t").grid, generate_puzzle(c, 3).grid);
}

TEST(SlidingPuzzle, ActionsMoveTilesLikeNemoRl) {
  Puzzle p;
  p.size = 2;
  p.grid = {1, 2, 0, 3};  // empty at row 2, column 1
  bool moved = false;
  EXPECT_EQ(p.apply("down", &moved), "Slid tile 1 into the empty space.");  // the tile above slides down
  EXPECT_TRUE(moved);
  EXPECT_EQ(p.grid, (std::vector<int>{0, 2, 1, 3}));
  EXPECT_EQ(p.apply("down", &moved), "Cannot slide down.");
  EXPECT_FALSE(moved);
  EXPECT_EQ(p.apply("slide 2 2", &moved), "Tile must be adjacent to the empty space.");
  EXPECT_EQ(p.apply("slide 9 1", &moved), "Invalid position. Row and column must be between 1 and 2.");
  EXPECT_EQ(p.apply("slide x", &moved), "Invalid input format. Use: slide row col");
  EXPECT_EQ(p.apply("jump", &moved).rfind("Unknown action", 0), 0u);
  p.apply("LEFT", &moved);  // the tile right of the empty space slides left
  EXPECT_EQ(p.grid, (std::vector<int>{2, 0, 1, 3}));
  EXPECT_EQ(p.render(),
            "  +------+\n"
            "1 | 2    |\n"
            "2 | 1  3 |\n"
            "  +------+\n"
            "    1  2 \n");
}

TEST(SlidingPuzzle, TurnsReplayTheHistoryAndEndWhenSolvedOrOutOfMoves) {
  const json meta = {{"puzzle", {{"size", 2}, {"grid", {1, 2, 0, 3}}}}, {"max_moves", 3}};
  // Turn 1: a wrong move (not solved), turn 2 undoes it, turn 3 solves.
  TurnResult t = sliding_puzzle_turn(meta, "I think <action>down</action>", 10);
  EXPECT_FALSE(t.done);
  EXPECT_EQ(t.stop_strings, std::vector<std::string>{"</action>"});
  EXPECT_EQ(t.reward, 0);
  EXPECT_NE(t.observation.find("Slid tile 1"), std::string::npos) << t.observation;
  t = sliding_puzzle_turn(with_history(meta, {"<action>down</action>"}), "<action>up</action>", 10);
  EXPECT_FALSE(t.done);
  t = sliding_puzzle_turn(with_history(meta, {"<action>down</action>", "<action>up</action>"}),
                          "<action>left</action>", 10);
  EXPECT_TRUE(t.done);
  EXPECT_EQ(t.reward, 1);
  EXPECT_NE(t.observation.find("solved"), std::string::npos);
  EXPECT_TRUE(t.stop_strings.empty());
  // No tags: the board again, no move used; view: no move used either.
  t = sliding_puzzle_turn(meta, "left", 10);
  EXPECT_FALSE(t.done);
  EXPECT_NE(t.observation.find("Invalid response format"), std::string::npos);
  t = sliding_puzzle_turn(with_history(meta, {"left", "<action>view</action>", "<action>down</action>"}),
                          "<action>up</action>", 10);
  EXPECT_FALSE(t.done) << "2 moves of 3 used";
  // The row's max_moves: 3 moves made, the 4th turn ends the episode with 0.
  t = sliding_puzzle_turn(with_history(meta, {"<action>down</action>", "<action>up</action>", "<action>down</action>"}),
                          "<action>up</action>", 10);
  EXPECT_TRUE(t.done);
  EXPECT_EQ(t.reward, 0);
  EXPECT_NE(t.observation.find("Maximum moves (3)"), std::string::npos);
  // Bad metadata: one line naming the environment.
  for (const json& bad : {json::object(), json{{"puzzle", {{"size", 2}, {"grid", {1, 1, 0, 3}}}}},
                          json{{"puzzle", {{"size", 2}, {"grid", {1, 2, 0, 3}}}}, {"rlh_history", 3}}}) {
    try {
      sliding_puzzle_turn(bad, "<action>up</action>", 10);
      ADD_FAILURE() << bad.dump();
    } catch (const rlh::sdk::Error& e) {
      EXPECT_EQ(std::string(e.what()).rfind("env.sliding_puzzle_game: ", 0), 0u) << e.what();
      EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos);
    }
  }
  EXPECT_EQ(parse_action("<ACTION> up </Action> then <action>left</action>"), std::optional<std::string>("left"));
  EXPECT_EQ(parse_action("<action>up"), std::nullopt);
}

TEST(SlidingPuzzle, AGreedySolverSolvesABoardThroughTurns) {
  // Undo the shuffle walk by breadth-first search, one turn per move, through the replay.
  PuzzleConfig c;
  c.size = 3;
  c.shuffle_moves = 12;
  const json row = puzzle_row(c, 1);
  Puzzle start = Puzzle::from_json(row["puzzle"], "t");
  std::map<std::vector<int>, std::vector<int>> seen{{start.grid, {}}};
  std::vector<Puzzle> frontier = {start};
  std::vector<int> path;
  bool found = start.solved();
  while (!found && !frontier.empty()) {
    std::vector<Puzzle> next;
    for (const Puzzle& p : frontier) {
      const int e = int(std::find(p.grid.begin(), p.grid.end(), 0) - p.grid.begin());
      for (int to : {e - 3, e + 3, e % 3 ? e - 1 : -1, e % 3 != 2 ? e + 1 : -1}) {
        if (to < 0 || to >= 9) continue;
        Puzzle q = p;
        std::swap(q.grid[size_t(e)], q.grid[size_t(to)]);
        if (seen.count(q.grid)) continue;
        seen[q.grid] = seen[p.grid];
        seen[q.grid].push_back(to);
        if (q.solved()) {
          found = true;
          path = seen[q.grid];
        }
        next.push_back(q);
      }
    }
    frontier = std::move(next);
  }
  ASSERT_TRUE(found);
  std::vector<std::string> history;
  Puzzle p = start;
  for (size_t k = 0; k < path.size(); ++k) {
    const std::string act = action_towards(p, path[k]);
    const TurnResult t = sliding_puzzle_turn(with_history(row, history), act, 40);
    bool moved = false;
    p.apply(*parse_action(act), &moved);
    ASSERT_TRUE(moved);
    EXPECT_EQ(t.done, k + 1 == path.size()) << k;
    EXPECT_EQ(t.reward, k + 1 == path.size() ? 1.0 : 0.0);
    history.push_back(act);
  }
}

TEST(Calculator, ExactArithmeticAndToolCalls) {
  EXPECT_EQ(calculate("12*(3+4)"), std::optional<std::string>("84"));
  EXPECT_EQ(calculate("7/2"), std::optional<std::string>("7/2"));
  EXPECT_EQ(calculate("-0.5*4"), std::optional<std::string>("-2"));
  EXPECT_EQ(calculate("123456789*987654321"), std::optional<std::string>("121932631112635269"));
  EXPECT_EQ(calculate("1/0"), std::nullopt);
  EXPECT_EQ(calculate("sqrt(2)"), std::nullopt);
  EXPECT_EQ(calculate("x+1"), std::nullopt);
  EXPECT_EQ(calculate("rm -rf /"), std::nullopt);
  EXPECT_EQ(calculate(std::string(5000, '1')), std::nullopt);
  EXPECT_EQ(calculate("2^100000000"), std::nullopt) << "past the work budget";

  const json meta = {{"ground_truth", "408"}};
  TurnResult t = calculator_turn(meta, "Let me compute <calc>12*34</calc>", "ground_truth");
  EXPECT_FALSE(t.done);
  EXPECT_EQ(t.observation, "<result>408</result>");
  EXPECT_EQ(t.stop_strings, std::vector<std::string>{"</calc>"});
  t = calculator_turn(meta, "<calc>12*34", "ground_truth");  // cut by a stop string "</calc>"
  EXPECT_EQ(t.observation, "<result>408</result>");
  t = calculator_turn(meta, "<calc>12*</calc>", "ground_truth");
  EXPECT_EQ(t.observation, "<result>error: not an arithmetic expression</result>");
  t = calculator_turn(meta, "The answer is \\boxed{408}", "ground_truth");
  EXPECT_TRUE(t.done);
  EXPECT_EQ(t.reward, 1);
  t = calculator_turn(meta, "The answer is \\boxed{407}", "ground_truth");
  EXPECT_TRUE(t.done);
  EXPECT_EQ(t.reward, 0);
  EXPECT_THROW(calculator_turn(json::object(), "42", "ground_truth"), rlh::sdk::Error);
}

TEST(Reveal, AWrongGuessRevealsTheAnswer) {
  const json meta = {{"answer", "7"}};
  TurnResult t = reveal_turn(meta, "3", "answer");
  EXPECT_FALSE(t.done);
  EXPECT_EQ(t.reward, 0);
  EXPECT_EQ(t.observation, "7");
  t = reveal_turn(meta, " 7\n", "answer");
  EXPECT_TRUE(t.done);
  EXPECT_EQ(t.reward, 1);
  EXPECT_TRUE(t.observation.empty());
  EXPECT_THROW(reveal_turn(json::object(), "7", "answer"), rlh::sdk::Error);
}

// ---- through the plugin ----------------------------------------------------------------------

namespace {

struct Loaded {
  rlhost_t* h = nullptr;
  const rlh_host_api* services = nullptr;
  Loaded() {
    rlh::sdk::check(rlhost_create(&h));
    rlh::sdk::check(rlhost_load_plugin(h, RLH_ENVIRONMENTS_PLUGIN));
    services = rlhost_services(h);
  }
  ~Loaded() { rlhost_destroy(h); }
  const void* api(int32_t kind, const char* name) const {
    const rlh_component_desc* d = nullptr;
    rlh::sdk::check(services->find_component(services->ctx, kind, name, &d));
    return d->api;
  }
};

struct Obs {
  std::vector<std::string> text;
  std::vector<std::vector<std::string>> stops = std::vector<std::vector<std::string>>(2);
};

std::string message(rlh_status* s) {
  if (s == nullptr) return "";
  std::string m = rlh::sdk::status_message(s);
  rlh_status_destroy(s);
  return m;
}

}  // namespace

TEST(MultiTurnPlugin, ObservationsAndDoneThroughTheAbi) {
  Loaded l;
  const auto* api = static_cast<const rlh_environment_api*>(l.api(RLH_KIND_ENVIRONMENT, "sliding_puzzle_game"));
  const std::string cfg = R"({"cfg": {"game_config": {"size": 2, "shuffle_moves": 1}, "max_moves": 5}})";
  rlh_environment* env = nullptr;
  ASSERT_EQ(message(api->create(l.services, cfg.data(), cfg.size(), &env)), "");
  const std::string meta = json{{"puzzle", {{"size", 2}, {"grid", {1, 2, 3, 0}}}}}.dump();
  const std::string meta2 = json{{"puzzle", {{"size", 2}, {"grid", {1, 2, 0, 3}}}}}.dump();
  const std::vector<std::string> responses = {"<action>view</action>", "<action>left</action>"};
  std::vector<rlh_env_sample> s(2);
  s[0] = {RLH_STRUCT_SIZE(rlh_env_sample, metadata_len), "", 0, responses[0].data(), responses[0].size(), meta.data(), meta.size()};
  s[1] = {RLH_STRUCT_SIZE(rlh_env_sample, metadata_len), "", 0, responses[1].data(), responses[1].size(), meta2.data(), meta2.size()};
  const char* names[] = {"reward"};
  double rewards[2] = {-1, -1};
  uint8_t done[2] = {9, 9};
  Obs obs;
  obs.text.resize(2);
  rlh_env_result r{RLH_STRUCT_SIZE(rlh_env_result, stop_strings), 1, names, rewards, done,
                   [](void* u, size_t i, const char* t, size_t n) { static_cast<Obs*>(u)->text[i].assign(t, n); }, &obs,
                   [](void* u, size_t i, const char* const* s, const size_t* len, size_t count) {
                     for (size_t k = 0; k < count; ++k) static_cast<Obs*>(u)->stops[i].emplace_back(s[k], len[k]);
                   }};
  ASSERT_EQ(message(api->score(env, s.data(), 2, &r)), "");
  EXPECT_EQ(done[0], 0);
  EXPECT_EQ(rewards[0], 0);
  EXPECT_NE(obs.text[0].find("Viewing the board"), std::string::npos);
  EXPECT_EQ(obs.stops[0], std::vector<std::string>{"</action>"});
  EXPECT_EQ(done[1], 1);
  EXPECT_EQ(rewards[1], 1);
  EXPECT_TRUE(obs.stops[1].empty());
  // A caller of ENVIRONMENT 0.1 (no stop_strings field) gets the same, without stop strings.
  obs.stops[0].clear();
  rlh_env_result old = r;
  old.struct_size = RLH_STRUCT_SIZE(rlh_env_result, user);
  old.stop_strings = nullptr;
  ASSERT_EQ(message(api->score(env, s.data(), 2, &old)), "");
  EXPECT_TRUE(obs.stops[0].empty());
  EXPECT_EQ(done[0], 0);
  // Metadata that is not JSON: one line naming the environment and the sample.
  const std::string broken = "{not json";
  s[1].metadata_json = broken.data();
  s[1].metadata_len = broken.size();
  const std::string m = message(api->score(env, s.data(), 2, &r));
  EXPECT_EQ(m, "env.sliding_puzzle_game: sample 1: metadata is not a JSON object");
  api->destroy(env);
  // Bad configuration: one line naming the key.
  for (const auto& [bad, want] : std::vector<std::pair<std::string, std::string>>{
           {R"({"cfg": {"game_config": {"size": 1}}})", "env.sliding_puzzle_game.cfg.game_config.size: expected an integer in [2, 9], got 1"},
           {R"({"cfg": {"max_move": 3}})", "env.sliding_puzzle_game.cfg.max_move: unknown key (game_config, max_moves, seed, rows)"},
           {R"({"colour": 1})", "env.sliding_puzzle_game.colour: unknown key"}}) {
    rlh_environment* e = nullptr;
    EXPECT_EQ(message(api->create(l.services, bad.data(), bad.size(), &e)), want);
  }
  for (const char* name : {"calculator", "reveal"}) {
    const auto* a = static_cast<const rlh_environment_api*>(l.api(RLH_KIND_ENVIRONMENT, name));
    rlh_environment* e = nullptr;
    ASSERT_EQ(message(a->create(l.services, "{}", 2, &e)), "") << name;
    std::string names_json;
    ASSERT_EQ(message(a->reward_names(e, rlh::sdk::write_to_string, &names_json)), "");
    EXPECT_EQ(names_json, "[\"reward\"]");
    a->destroy(e);
  }
}

TEST(MultiTurnPlugin, ThePuzzleDatasetFromTheEnvironmentsConfig) {
  Loaded l;
  const auto* api = static_cast<const rlh_dataset_api*>(l.api(RLH_KIND_DATASET, "sliding_puzzle_game"));
  const std::string cfg = R"({"cfg": {"game_config": {"size": 3, "shuffle_moves": 10}, "max_moves": 30}, "split": "train"})";
  rlh_dataset* ds = nullptr;
  ASSERT_EQ(message(api->create(l.services, cfg.data(), cfg.size(), &ds)), "");
  EXPECT_EQ(api->size(ds), 10000);
  std::string row;
  ASSERT_EQ(message(api->get(ds, 4, rlh::sdk::write_to_string, &row)), "");
  const json j = json::parse(row);
  EXPECT_EQ(j["max_moves"], 30);
  EXPECT_EQ(j["puzzle"]["size"], 3);
  EXPECT_NE(j["prompt"].get<std::string>().find("3x3"), std::string::npos);
  std::string none;
  EXPECT_NE(message(api->get(ds, 10000, rlh::sdk::write_to_string, &none)).find("out of range"), std::string::npos);
  api->destroy(ds);
}
