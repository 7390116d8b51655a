// The `jsonl` dataset: NeMo-RL's ResponseDataset over a local JSONL file (rlh_dataset_jsonl_core,
// wrapped by the dataset_jsonl plugin).
//
// Configuration (the component's config_json), either one dataset:
//   {"data_path": "train.jsonl", "input_key": "problem", "output_key": "expected_answer",
//    "prompt_file": "prompts/cot.txt", "system_prompt_file": null,
//    "split_validation_size": 0.05, "seed": 42, "split": "train"}
// or NeMo-RL's whole `data` section plus "split" ("train" or "validation"):
//   {"train": {...}, "validation": {...} | null, "default": {...}, "split": "validation"}
// where data.default (and the older data.prompt_file / data.system_prompt_file) fill what
// data.train / data.validation leave out. The validation split is data.validation's file when it
// has one, else the rows split_validation_size holds out of the train file.
//
// Rows come out as JSON objects: the line's own fields, plus
//   "prompt":        the input, through the prompt file's "{}" when one is given
//   "answer":        the output field as a string
//   "system_prompt": the system prompt file's text, when one is given
// Chat templating is left to the algorithm (through the tokenizer component).
// A file whose first row has "messages" is, as NeMo-RL's ResponseDataset takes such a file, a
// file of conversations: every row must hold "messages", a non-empty list of {"role": string,
// "content": string} (multimodal content lists and tool calls are refused by line), and comes out
// as the line itself, the prompt file's "{}" applied to the first user message's content
// (NeMo-RL's get_formatted_message_log); a system prompt file is refused for such a file (the
// conversation holds its own system message).
//
// Preference rows (DPO, RM): with dataset_name BinaryPreferenceDataset (keys prompt_key,
// chosen_key, rejected_key; defaults prompt/chosen/rejected; each a string or a message list) or
// PreferenceDataset ({"context": [messages], "completions": [{rank, completion}] x 2}), a row
// comes out as the line's own fields plus NeMo-RL's PreferenceDataset form with the preferred
// completion first:
//   "context":     [messages]            (a string prompt is one user message)
//   "completions": [{"rank": 0, "completion": [chosen messages]},
//                   {"rank": 1, "completion": [rejected messages]}]
// Every line is checked when the file is indexed (data.jsonl:4: 'chosen' must be a string or a
// list of messages, got a number).
//
// The file is indexed once (line offsets, each line validated with a SAX parse that builds
// nothing), and rows are read back with pread, so memory is ~16 bytes per row whatever the file
// size. Every bad input is an error naming file and line or the config key:
//   data.jsonl:17: invalid JSON: syntax error while parsing object ... at column 9
//   data.jsonl:4: missing key 'problem' (data.train.input_key)
#pragma once

#include <functional>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

namespace rlh::dataset_jsonl {

enum class RowFormat { kResponse, kBinaryPreference, kPreference };

// One dataset after defaults are applied.
struct JsonlSource {
  RowFormat format = RowFormat::kResponse;  // from dataset_name
  std::string origin = "dataset";  // config path for messages: "data.train", "data.validation"
  std::string data_path;
  std::string input_key = "input";   // NeMo-RL ResponseDataset's defaults
  std::string output_key = "output";
  std::string prompt_key = "prompt";  // BinaryPreferenceDataset's defaults
  std::string chosen_key = "chosen";
  std::string rejected_key = "rejected";
  std::optional<std::string> prompt_file;
  std::optional<std::string> system_prompt_file;
  double split_validation_size = 0;  // a fraction in (0, 1), or a row count >= 1
  int64_t seed = 42;
};

enum class Split { kTrain, kValidation, kAll };

struct JsonlConfig {
  JsonlSource source;
  Split split = Split::kAll;
  // True when the rows are one side of split_validation_size's split of source's file.
  bool holdout = false;
};

// Resolves either configuration form; a bad key is an error naming it.
JsonlConfig resolve_config(const nlohmann::json& config);

// A line of the file: where it is and its 1-based number (for messages).
struct LineRef {
  uint64_t offset;
  uint32_t length;
  uint32_t line;
};

// Indexes `path`: each non-blank line must be a JSON object holding `input_key` (a string) and
// `output_key` (a string or number). `origin` names the config section in messages. With
// `messages` given, a file whose first row has a top-level "messages" key is indexed as
// conversations instead (each row checked by messages_row_error) and *messages is set.
std::vector<LineRef> index_jsonl(const std::string& path, const std::string& input_key,
                                 const std::string& output_key, const std::string& origin,
                                 bool* messages = nullptr);
// What is wrong with a conversation row ("" when nothing): "messages" must be a non-empty list of
// objects with string "role" and "content".
std::string messages_row_error(const nlohmann::ordered_json& line);
// Indexes `path` checking each non-blank line with `check` (the parsed line; returns "" or what
// is wrong, which becomes "path:line: what").
std::vector<LineRef> index_jsonl(const std::string& path, const std::string& origin,
                                 const std::function<std::string(const nlohmann::ordered_json&)>& check);

// A preference line of `s`'s format as the row described above; returns "" or what is wrong.
std::string preference_row(const JsonlSource& s, const nlohmann::ordered_json& line, nlohmann::ordered_json& out);

// Which of `n` rows are held out: ceil(size * n) rows for a fraction, `size` rows for a count
// (as HF datasets' train_test_split), chosen by a seeded shuffle. Returns the validation side
// (`validation` true) or the train side, in file order.
std::vector<uint32_t> split_rows(size_t n, double size, int64_t seed, bool validation,
                                 const std::string& origin);

// A prompt template in NeMo-RL's Python str.format style: "{}" (or "{0}") is the input, "{{"
// and "}}" are braces. check_prompt_template throws naming `file` for anything else.
void check_prompt_template(std::string_view tmpl, const std::string& file);
std::string apply_prompt_template(std::string_view tmpl, std::string_view input);

class JsonlDataset {
 public:
  explicit JsonlDataset(const nlohmann::json& config);
  ~JsonlDataset();
  JsonlDataset(const JsonlDataset&) = delete;
  JsonlDataset& operator=(const JsonlDataset&) = delete;

  int64_t size() const { return static_cast<int64_t>(rows_.size()); }
  // Row `index` as a JSON object (see the top of this file). Thread-safe.
  std::string row_json(int64_t index) const;
  const JsonlConfig& config() const { return cfg_; }

 private:
  JsonlConfig cfg_;
  int fd_ = -1;
  std::vector<LineRef> rows_;
  bool messages_ = false;  // a file of conversations (see the top)
  std::optional<std::string> prompt_;
  std::optional<std::string> system_prompt_;
};

}  // namespace rlh::dataset_jsonl
