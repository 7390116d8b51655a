// The multi-turn environments' logic (see multi_turn_games.hpp).
#include "rlhost/environments/multi_turn_games.hpp"

#include <algorithm>
#include <cctype>

#include "math_internal.hpp"
#include "rlhost/environments/math_answer.hpp"
#include "rlhost/sdk/status.hpp"

namespace rlh::environments {
namespace {

using json = nlohmann::json;
using rlh::sdk::Error;

// splitmix64: fixed by its definition, so a row is the same on every platform.
struct Rng {
  uint64_t s;
  uint64_t next() {
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  uint64_t below(uint64_t n) {
    const uint64_t limit = UINT64_MAX - UINT64_MAX % n;
    for (;;)
      if (const uint64_t v = next(); v < limit) return v % n;
  }
};

std::string trim(std::string_view s) {
  size_t b = 0, e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  return std::string(s.substr(b, e - b));
}

std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

int int_key(const json& cfg, const char* key, int def, int lo, int hi, const std::string& origin) {
  auto it = cfg.find(key);
  if (it == cfg.end() || it->is_null()) return def;
  if (!it->is_number_integer() || it->get<int64_t>() < lo || it->get<int64_t>() > hi)
    throw Error(RLH_E_INVALID_ARGUMENT, origin + "." + key + ": expected an integer in [" + std::to_string(lo) +
                                            ", " + std::to_string(hi) + "], got " + it->dump());
  return static_cast<int>(it->get<int64_t>());
}

// The earlier turns' {"response", "observation"} from metadata["rlh_history"].
std::vector<std::string> history_responses(const json& metadata, const std::string& origin) {
  std::vector<std::string> out;
  auto it = metadata.find("rlh_history");
  if (it == metadata.end() || it->is_null()) return out;
  if (!it->is_array()) throw Error(RLH_E_INVALID_ARGUMENT, origin + ": metadata 'rlh_history' is not a list");
  for (const auto& turn : *it) {
    auto r = turn.is_object() ? turn.find("response") : turn.end();
    if (!turn.is_object() || r == turn.end() || !r->is_string())
      throw Error(RLH_E_INVALID_ARGUMENT, origin + ": metadata 'rlh_history' entry without a string 'response'");
    out.push_back(r->get<std::string>());
  }
  return out;
}

}  // namespace

// ---- sliding puzzle ---------------------------------------------------------------------------

PuzzleConfig PuzzleConfig::from_json(const json& cfg, const std::string& origin) {
  PuzzleConfig c;
  if (cfg.is_null()) return c;
  if (!cfg.is_object()) throw Error(RLH_E_INVALID_ARGUMENT, origin + ": expected a mapping, got " + cfg.dump());
  for (const auto& [key, v] : cfg.items()) {
    if (key == "game_config") {
      if (v.is_null()) continue;
      if (!v.is_object()) throw Error(RLH_E_INVALID_ARGUMENT, origin + ".game_config: expected a mapping, got " + v.dump());
      for (const auto& [k, _] : v.items())
        if (k != "size" && k != "shuffle_moves")
          throw Error(RLH_E_INVALID_ARGUMENT, origin + ".game_config." + k + ": unknown key (size, shuffle_moves)");
      c.size = int_key(v, "size", c.size, 2, 9, origin + ".game_config");
      c.shuffle_moves = int_key(v, "shuffle_moves", c.shuffle_moves, 0, 1000000, origin + ".game_config");
    } else if (key == "max_moves") {
      c.max_moves = int_key(cfg, "max_moves", c.max_moves, 1, 1000000, origin);
    } else if (key == "seed") {
      if (!v.is_number_integer()) throw Error(RLH_E_INVALID_ARGUMENT, origin + ".seed: expected an integer, got " + v.dump());
      c.seed = static_cast<uint64_t>(v.get<int64_t>());
    } else if (key == "rows") {
      c.rows = int_key(cfg, "rows", 10000, 1, 1 << 30, origin);
    } else if (key != "split" && key != "dataset_name") {
      throw Error(RLH_E_INVALID_ARGUMENT, origin + "." + key + ": unknown key (game_config, max_moves, seed, rows)");
    }
  }
  return c;
}

bool Puzzle::solved() const {
  for (size_t i = 0; i + 1 < grid.size(); ++i)
    if (grid[i] != static_cast<int>(i) + 1) return false;
  return !grid.empty() && grid.back() == 0;
}

std::string Puzzle::render() const {
  const int width = static_cast<int>(std::to_string(size * size - 1).size());
  std::string border = "  +" + std::string(static_cast<size_t>((width + 2) * size), '-') + "+\n";
  std::string out = border;
  for (int r = 0; r < size; ++r) {
    out += std::to_string(r + 1) + " |";
    for (int c = 0; c < size; ++c) {
      const int v = grid[static_cast<size_t>(r * size + c)];
      std::string cell = v == 0 ? "" : std::to_string(v);
      out += " " + std::string(static_cast<size_t>(width) - cell.size(), ' ') + cell + " ";
    }
    out += "|\n";
  }
  out += border + "   ";
  for (int c = 0; c < size; ++c) {
    std::string label = std::to_string(c + 1);
    out += " " + std::string(static_cast<size_t>(width) - label.size(), ' ') + label + " ";
  }
  return out + "\n";
}

std::string Puzzle::apply(std::string_view action_text, bool* moved) {
  *moved = false;
  const std::string action = lower(trim(action_text));
  const int empty = static_cast<int>(std::find(grid.begin(), grid.end(), 0) - grid.begin());
  const int er = empty / size, ec = empty % size;
  int r = -1, c = -1;
  if (action == "up") {
    r = er + 1, c = ec;  // the tile below the empty space slides up
  } else if (action == "down") {
    r = er - 1, c = ec;
  } else if (action == "left") {
    r = er, c = ec + 1;
  } else if (action == "right") {
    r = er, c = ec - 1;
  } else if (action.rfind("slide ", 0) == 0) {
    int rr = 0, cc = 0;
    char extra = 0;
    if (std::sscanf(action.c_str() + 6, "%d %d %c", &rr, &cc, &extra) != 2)
      return "Invalid input format. Use: slide row col";
    if (rr < 1 || rr > size || cc < 1 || cc > size)
      return "Invalid position. Row and column must be between 1 and " + std::to_string(size) + ".";
    if (std::abs(rr - 1 - er) + std::abs(cc - 1 - ec) != 1) return "Tile must be adjacent to the empty space.";
    r = rr - 1, c = cc - 1;
  } else {
    return "Unknown action. Use up, down, left, right, slide row col, or view.";
  }
  if (r < 0 || r >= size || c < 0 || c >= size) return "Cannot slide " + action + ".";
  const int tile = grid[static_cast<size_t>(r * size + c)];
  std::swap(grid[static_cast<size_t>(empty)], grid[static_cast<size_t>(r * size + c)]);
  *moved = true;
  return "Slid tile " + std::to_string(tile) + " into the empty space.";
}

Puzzle Puzzle::from_json(const json& j, const std::string& origin) {
  Puzzle p;
  if (!j.is_object() || !j.contains("size") || !j["size"].is_number_integer() || !j.contains("grid") ||
      !j["grid"].is_array())
    throw Error(RLH_E_INVALID_ARGUMENT, origin + ": metadata 'puzzle' is not {\"size\": n, \"grid\": [...]}");
  const int64_t n = j["size"].get<int64_t>();
  if (n < 2 || n > 9 || j["grid"].size() != static_cast<size_t>(n * n))
    throw Error(RLH_E_INVALID_ARGUMENT, origin + ": metadata 'puzzle' has size " + std::to_string(n) + " and " +
                                            std::to_string(j["grid"].size()) + " cells");
  p.size = static_cast<int>(n);
  std::vector<bool> seen(static_cast<size_t>(n * n), false);
  for (const auto& v : j["grid"]) {
    if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() >= n * n || seen[v.get<size_t>()])
      throw Error(RLH_E_INVALID_ARGUMENT, origin + ": metadata 'puzzle' grid is not a permutation of 0.." +
                                              std::to_string(n * n - 1));
    seen[v.get<size_t>()] = true;
    p.grid.push_back(static_cast<int>(v.get<int64_t>()));
  }
  return p;
}

json Puzzle::to_json() const { return json{{"size", size}, {"grid", grid}}; }

Puzzle generate_puzzle(const PuzzleConfig& cfg, uint64_t index) {
  Puzzle p;
  p.size = cfg.size;
  const int cells = cfg.size * cfg.size;
  for (int i = 0; i < cells; ++i) p.grid.push_back(i + 1 == cells ? 0 : i + 1);
  Rng mix{cfg.seed ^ 0x5EED5EED12345678ull};
  mix.s ^= mix.next() + index * 0x9E3779B97F4A7C15ull;
  Rng rng{mix.next()};
  int empty = cells - 1;
  // A random walk of the empty space (NeMo-RL's shuffle), so every board is solvable.
  for (int m = 0; m < cfg.shuffle_moves; ++m) {
    const int r = empty / cfg.size, c = empty % cfg.size;
    int options[4], k = 0;
    if (c + 1 < cfg.size) options[k++] = empty + 1;
    if (r + 1 < cfg.size) options[k++] = empty + cfg.size;
    if (c > 0) options[k++] = empty - 1;
    if (r > 0) options[k++] = empty - cfg.size;
    const int to = options[rng.below(static_cast<uint64_t>(k))];
    std::swap(p.grid[static_cast<size_t>(empty)], p.grid[static_cast<size_t>(to)]);
    empty = to;
  }
  return p;
}

json puzzle_row(const PuzzleConfig& cfg, uint64_t index) {
  const Puzzle p = generate_puzzle(cfg, index);
  const int n = cfg.size;
  std::string prompt =
      "Solve this " + std::to_string(n) + "x" + std::to_string(n) + " sliding puzzle: put the tiles 1 to " +
      std::to_string(n * n - 1) +
      " in order, row by row, with the empty space last. Each turn, give one action inside "
      "<action></action>: up, down, left or right slides the tile below, above, to the right of or to the "
      "left of the empty space into it; 'slide r c' slides the tile at row r, column c; 'view' shows the "
      "board. You have " +
      std::to_string(cfg.max_moves) + " moves.\n" + p.render();
  return json{{"prompt", prompt}, {"puzzle", p.to_json()}, {"max_moves", cfg.max_moves}, {"index", index}};
}

std::optional<std::string> parse_action(std::string_view text) {
  const std::string low = lower(text);
  const size_t start = low.rfind("<action>");
  if (start == std::string::npos) return std::nullopt;
  const size_t end = low.find("</action>", start + 8);
  if (end == std::string::npos) return std::nullopt;
  return trim(text.substr(start + 8, end - start - 8));
}

namespace {
TurnResult puzzle_turn(const json& metadata, std::string_view response, int max_moves);
}  // namespace

TurnResult sliding_puzzle_turn(const json& metadata, std::string_view response, int max_moves) {
  TurnResult t = puzzle_turn(metadata, response, max_moves);
  if (!t.done) t.stop_strings = {"</action>"};  // the next turn ends with its action, as in NeMo-RL
  return t;
}

namespace {
TurnResult puzzle_turn(const json& metadata, std::string_view response, int max_moves) {
  const std::string origin = "env.sliding_puzzle_game";
  if (!metadata.is_object() || !metadata.contains("puzzle"))
    throw Error(RLH_E_INVALID_ARGUMENT, origin + ": metadata has no 'puzzle' (rows come from the sliding_puzzle_game dataset)");
  Puzzle p = Puzzle::from_json(metadata["puzzle"], origin);
  if (auto m = metadata.find("max_moves"); m != metadata.end() && m->is_number_integer() && m->get<int64_t>() > 0)
    max_moves = static_cast<int>(std::min<int64_t>(m->get<int64_t>(), 1000000));
  // Replay: every earlier turn that named an action other than 'view' used a move.
  int moves = 0;
  for (const std::string& earlier : history_responses(metadata, origin)) {
    const auto a = parse_action(earlier);
    if (!a || lower(*a) == "view") continue;
    bool moved = false;
    p.apply(*a, &moved);
    ++moves;
  }
  TurnResult t;
  if (moves >= max_moves) {
    t.done = true;
    t.observation = "<error>Maximum moves (" + std::to_string(max_moves) + ") reached.</error>\n";
    return t;
  }
  const auto action = parse_action(response);
  if (!action) {
    t.observation = "<environment>\n" + p.render() +
                    "\nInvalid response format, no move made. Answer like this: <action>your_action</action>"
                    "</environment>\n";
    return t;
  }
  if (lower(*action) == "view") {
    t.observation = "<environment>\n" + p.render() + "\nViewing the board. No move made.</environment>\n";
    return t;
  }
  bool moved = false;
  std::string what = p.apply(*action, &moved);
  if (moved && p.solved()) {
    t.reward = 1;
    t.done = true;
    what = "Congratulations! You've solved the puzzle!";
  }
  t.observation = "<environment>\n" + what + "\n</environment>\n";
  return t;
}
}  // namespace

// ---- calculator -------------------------------------------------------------------------------

std::optional<std::string> calculate(std::string_view expression) {
  if (expression.size() > 4096) return std::nullopt;
  try {
    math::WorkBudget budget(5'000'000, 2.0);
    const auto tree = math::parse_expression(trim(expression));
    if (!tree) return std::nullopt;
    const auto value = math::eval_exact(*tree, false);
    if (!value || value->infinity != 0) return std::nullopt;
    if (value->terms.empty()) return std::string("0");
    if (value->terms.size() != 1) return std::nullopt;
    const auto& [mono, coef] = *value->terms.begin();
    if (!mono.vars.empty() || mono.pi != 0 || mono.radicand != 1) return std::nullopt;  // not rational
    const math::BigInt num = boost::multiprecision::numerator(coef), den = boost::multiprecision::denominator(coef);
    return den == 1 ? num.str() : num.str() + "/" + den.str();
  } catch (const math::OverBudget&) {
    return std::nullopt;
  }
}

std::optional<std::string> find_calc_call(std::string_view response) {
  const std::string low = lower(response);
  const size_t start = low.rfind("<calc>");
  if (start == std::string::npos) return std::nullopt;
  const size_t end = low.find("</calc>", start + 6);
  return std::string(response.substr(start + 6, end == std::string::npos ? std::string::npos : end - start - 6));
}

TurnResult calculator_turn(const json& metadata, std::string_view response, const std::string& ground_truth_key) {
  TurnResult t;
  if (const auto call = find_calc_call(response)) {
    const auto value = calculate(*call);
    t.observation = "<result>" + (value ? *value : std::string("error: not an arithmetic expression")) + "</result>";
    t.stop_strings = {"</calc>"};  // the next turn stops after its tool call
    return t;
  }
  auto it = metadata.is_object() ? metadata.find(ground_truth_key) : metadata.end();
  if (it == metadata.end() || !(it->is_string() || it->is_number()))
    throw Error(RLH_E_INVALID_ARGUMENT, "env.calculator: metadata has no '" + ground_truth_key + "' (the ground truth)");
  const std::string truth = it->is_string() ? it->get<std::string>() : it->dump();
  t.done = true;
  t.reward = score_math_response(response, truth).correct ? 1.0 : 0.0;
  return t;
}

// ---- reveal -----------------------------------------------------------------------------------

TurnResult reveal_turn(const json& metadata, std::string_view response, const std::string& answer_key) {
  auto it = metadata.is_object() ? metadata.find(answer_key) : metadata.end();
  if (it == metadata.end() || !it->is_string() || it->get<std::string>().empty())
    throw Error(RLH_E_INVALID_ARGUMENT, "env.reveal: metadata has no string '" + answer_key + "' (the hidden answer)");
  TurnResult t;
  if (trim(response) == trim(it->get<std::string>())) {
    t.reward = 1;
    t.done = true;
  } else {
    t.observation = it->get<std::string>();
  }
  return t;
}

}  // namespace rlh::environments
