// Multi-turn environments: each turn the policy's response is judged and answered with a reward,
// a done flag and an observation text the next turn's prompt continues with.
//
// The environments are stateless: a turn's state is replayed from the dataset row (metadata) and
// the earlier turns' texts, which the GRPO loop hands over in metadata["rlh_history"] as a list of
// {"response", "observation"} (rlhost/environment.h). So any turn can be scored from its inputs
// alone, on any thread, and a resumed run replays the same states.
//
//   sliding_puzzle_game  NeMo-RL's sliding-puzzle game: the row holds a shuffled n x n board; each
//                        turn names one action in <action></action> (up, down, left, right: the
//                        tile below / above / right of / left of the empty space slides into it;
//                        "slide r c": the tile at row r, column c, 1-based; view). Reward 1 when a
//                        move solves the board (done); after max_moves moves the episode ends with 0.
//   calculator           a tool-call environment: a response holding <calc>EXPR</calc> (the closing
//                        tag may be cut off by a stop string) is a tool call, answered with
//                        <result>VALUE</result> (exact rational arithmetic); a response without one
//                        is the final answer, scored like the math environment against the row's
//                        ground truth (reward 1 or 0, done).
//   reveal               a synthetic task only a multi-turn policy can learn: the response must be
//                        the row's hidden answer; a wrong guess is answered by the answer itself
//                        (the observation) and the episode goes on; a right one scores 1 (done).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

namespace rlh::environments {

// One turn's verdict.
struct TurnResult {
  double reward = 0;
  bool done = false;
  std::string observation;
  std::vector<std::string> stop_strings;  // for the next turn (NeMo-RL's next_stop_strings)
};

// ---- sliding puzzle ---------------------------------------------------------------------------

// NeMo-RL's env.sliding_puzzle_game.cfg: {game_config: {size, shuffle_moves}, max_moves}, and the
// puzzle dataset's own seed and size (rows).
struct PuzzleConfig {
  int size = 4;             // the board is size x size (2..9)
  int shuffle_moves = 100;  // random moves of the empty space away from the solved board
  int max_moves = 40;       // moves per episode (NeMo-RL's max_moves)
  uint64_t seed = 42;
  int64_t rows = 10000;
  // Reads the environment's cfg mapping (unknown keys are errors "<origin>.<key>: ...").
  static PuzzleConfig from_json(const nlohmann::json& cfg, const std::string& origin);
};

struct Puzzle {
  int size = 0;
  std::vector<int> grid;  // row-major, 0 = the empty space
  bool solved() const;
  // The board as text: rows numbered, columns labelled, the empty space blank.
  std::string render() const;
  // Applies one action; says what happened. `moved` is set when a tile moved.
  std::string apply(std::string_view action, bool* moved);
  static Puzzle from_json(const nlohmann::json& j, const std::string& origin);
  nlohmann::json to_json() const;
};

// Row `index` of the puzzle dataset: a pure function of (config, index).
Puzzle generate_puzzle(const PuzzleConfig& cfg, uint64_t index);
// {"prompt", "puzzle": {"size", "grid"}, "max_moves", "index"}.
nlohmann::json puzzle_row(const PuzzleConfig& cfg, uint64_t index);
// The last <action>...</action> in `text` (tags case-insensitive), trimmed; nullopt without one.
std::optional<std::string> parse_action(std::string_view text);
// One turn: the row's board replayed through the earlier turns' actions, then this response's.
TurnResult sliding_puzzle_turn(const nlohmann::json& metadata, std::string_view response, int max_moves);

// ---- calculator -------------------------------------------------------------------------------

// The exact value of an arithmetic expression (+ - * / ^, parentheses, decimals) as "12",
// "-3/4"; nullopt when it is not one or has no finite rational value (division by zero).
std::optional<std::string> calculate(std::string_view expression);
// The last tool call in `response`: the text after the last <calc> up to </calc> or the end.
std::optional<std::string> find_calc_call(std::string_view response);
TurnResult calculator_turn(const nlohmann::json& metadata, std::string_view response,
                           const std::string& ground_truth_key);

// ---- reveal -----------------------------------------------------------------------------------

TurnResult reveal_turn(const nlohmann::json& metadata, std::string_view response, const std::string& answer_key);

}  // namespace rlh::environments
