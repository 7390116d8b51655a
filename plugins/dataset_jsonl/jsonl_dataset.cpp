// The jsonl dataset: configuration (one dataset or NeMo-RL's `data` section), the seeded
// train/validation split, prompt files, and rows read back by offset.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <sstream>

#include "rlhost/dataset_jsonl/jsonl_dataset.hpp"
#include "rlhost/sdk/input_file.hpp"
#include "rlhost/sdk/status.hpp"

namespace rlh::dataset_jsonl {
namespace {

using json = nlohmann::json;
using rlh::sdk::Error;

[[noreturn]] void bad(const std::string& origin, const char* key, const std::string& why, const json& v) {
  throw Error(RLH_E_INVALID_ARGUMENT, origin + "." + key + ": " + why + ", got " + v.dump());
}

// Applies the keys of `j` this dataset uses onto `s`; other keys (processor, env_name, ...) are
// the algorithm's.
void apply(JsonlSource& s, const json& j, const std::string& origin) {
  if (j.is_null()) return;
  if (!j.is_object()) throw Error(RLH_E_INVALID_ARGUMENT, origin + ": expected a mapping, got " + j.dump());
  auto str = [&](const char* key, std::string& out) {
    auto it = j.find(key);
    if (it == j.end() || it->is_null()) return;
    if (!it->is_string() || it->get<std::string>().empty()) bad(origin, key, "expected a non-empty string", *it);
    out = it->get<std::string>();
  };
  auto opt_str = [&](const char* key, std::optional<std::string>& out) {
    auto it = j.find(key);
    if (it == j.end()) return;
    if (it->is_null()) {
      out.reset();  // an explicit null overrides a default's file
      return;
    }
    if (!it->is_string() || it->get<std::string>().empty()) bad(origin, key, "expected a file path or null", *it);
    out = it->get<std::string>();
  };
  if (auto it = j.find("dataset_name"); it != j.end() && !it->is_null()) {
    // NeMo-RL loads local JSONL through its ResponseDataset; any other name is another dataset.
    const std::string n = it->is_string() ? it->get<std::string>() : "";
    if (n == "BinaryPreferenceDataset") s.format = RowFormat::kBinaryPreference;
    else if (n == "PreferenceDataset") s.format = RowFormat::kPreference;
    else if (n == "ResponseDataset" || n == "jsonl") s.format = RowFormat::kResponse;
    else
      bad(origin, "dataset_name",
          "the jsonl dataset reads 'ResponseDataset' (or 'jsonl'), 'BinaryPreferenceDataset' or 'PreferenceDataset' "
          "with a data_path",
          *it);
  }
  str("prompt_key", s.prompt_key);
  str("chosen_key", s.chosen_key);
  str("rejected_key", s.rejected_key);
  str("data_path", s.data_path);
  str("input_key", s.input_key);
  str("output_key", s.output_key);
  opt_str("prompt_file", s.prompt_file);
  opt_str("system_prompt_file", s.system_prompt_file);
  if (auto it = j.find("split_validation_size"); it != j.end() && !it->is_null()) {
    if (!it->is_number() || it->get<double>() < 0 || !std::isfinite(it->get<double>()))
      bad(origin, "split_validation_size", "expected a fraction in [0, 1) or a row count", *it);
    const double v = it->get<double>();
    if (v >= 1 && v != std::floor(v))
      bad(origin, "split_validation_size", "a value >= 1 is a row count and must be whole", *it);
    s.split_validation_size = v;
  }
  if (auto it = j.find("seed"); it != j.end() && !it->is_null()) {
    if (!it->is_number_integer()) bad(origin, "seed", "expected an integer", *it);
    s.seed = it->get<int64_t>();
  }
}

// splitmix64: a tiny, well-mixed generator whose output is fixed by its definition (unlike
// std::uniform_int_distribution, which differs between standard libraries).
struct SplitMix64 {
  uint64_t s;
  uint64_t next() {
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  // Uniform in [0, n) by rejection (no modulo bias).
  uint64_t below(uint64_t n) {
    const uint64_t limit = UINT64_MAX - UINT64_MAX % n;
    for (;;) {
      const uint64_t v = next();
      if (v < limit) return v % n;
    }
  }
};

std::string read_text_file(const std::string& path, const std::string& origin, const char* key) {
  try {
    return sdk::read_input_file(path, 64u << 20, origin + "." + key + ":");  // a prompt, not a corpus
  } catch (const sdk::InputError& e) {
    throw Error(RLH_E_NOT_FOUND, e.what());
  }
}

}  // namespace

JsonlConfig resolve_config(const json& config) {
  if (!config.is_object()) throw Error(RLH_E_INVALID_ARGUMENT, "jsonl dataset config: expected a JSON object, got " + config.dump());
  JsonlConfig out;
  Split split = Split::kAll;
  if (auto it = config.find("split"); it != config.end() && !it->is_null()) {
    const std::string v = it->is_string() ? it->get<std::string>() : "";
    if (v == "train") split = Split::kTrain;
    else if (v == "validation") split = Split::kValidation;
    else if (v == "all") split = Split::kAll;
    else throw Error(RLH_E_INVALID_ARGUMENT, "split: expected 'train', 'validation' or 'all', got " + it->dump());
  }
  out.split = split;

  const bool section = config.contains("train") && config["train"].is_object();
  if (!section) {
    apply(out.source, config, "dataset");
    out.source.origin = "dataset";
    out.holdout = split != Split::kAll && out.source.split_validation_size > 0;
    if (split == Split::kValidation && !out.holdout)
      throw Error(RLH_E_INVALID_ARGUMENT, "dataset.split_validation_size: the validation split needs rows held out (> 0)");
  } else {
    // NeMo-RL's data section: defaults first (the older data.prompt_file style, then
    // data.default), then the dataset's own keys.
    if (split == Split::kAll) split = out.split = Split::kTrain;
    JsonlSource base;
    for (const char* key : {"prompt_file", "system_prompt_file"})
      if (auto it = config.find(key); it != config.end()) apply(base, json{{key, *it}}, "data");
    if (auto it = config.find("default"); it != config.end()) apply(base, *it, "data.default");
    const json* val = nullptr;
    if (auto it = config.find("validation"); it != config.end() && it->is_object() && it->contains("data_path"))
      val = &*it;
    if (split == Split::kValidation && val != nullptr) {
      out.source = base;
      apply(out.source, *val, "data.validation");
      out.source.origin = "data.validation";
      out.source.split_validation_size = 0;  // the whole validation file
      out.split = Split::kAll;
    } else {
      out.source = base;
      apply(out.source, config["train"], "data.train");
      out.source.origin = "data.train";
      out.holdout = out.source.split_validation_size > 0;
      if (split == Split::kValidation && !out.holdout)
        throw Error(RLH_E_INVALID_ARGUMENT,
                    "data.validation: no validation data (set data.validation.data_path or data.train.split_validation_size)");
      if (!out.holdout) out.split = Split::kAll;
    }
  }
  if (out.source.data_path.empty())
    throw Error(RLH_E_INVALID_ARGUMENT, out.source.origin + ".data_path: missing (the JSONL file to read)");
  return out;
}

std::vector<uint32_t> split_rows(size_t n, double size, int64_t seed, bool validation, const std::string& origin) {
  size_t n_val = size < 1 ? static_cast<size_t>(std::ceil(size * static_cast<double>(n))) : static_cast<size_t>(size);
  if (n_val >= n)
    throw Error(RLH_E_INVALID_ARGUMENT, origin + ".split_validation_size: " + std::to_string(n_val) +
                                            " rows held out for validation leaves none of the " + std::to_string(n) +
                                            " rows for training");
  std::vector<uint32_t> perm(n);
  for (size_t i = 0; i < n; ++i) perm[i] = static_cast<uint32_t>(i);
  SplitMix64 rng{static_cast<uint64_t>(seed)};
  // Fisher-Yates; only the first n_val positions are needed to pick the validation rows.
  for (size_t i = 0; i < n_val; ++i) std::swap(perm[i], perm[i + rng.below(n - i)]);
  std::vector<uint32_t> out = validation ? std::vector<uint32_t>(perm.begin(), perm.begin() + static_cast<long>(n_val))
                                         : std::vector<uint32_t>(perm.begin() + static_cast<long>(n_val), perm.end());
  std::sort(out.begin(), out.end());  // file order within each side; the sampler shuffles
  return out;
}

void check_prompt_template(std::string_view t, const std::string& file) {
  int inputs = 0;
  for (size_t i = 0; i < t.size(); ++i) {
    if (t[i] == '{') {
      if (i + 1 < t.size() && t[i + 1] == '{') {
        ++i;
      } else if (t.substr(i, 2) == "{}") {
        ++inputs;
        ++i;
      } else if (t.substr(i, 3) == "{0}") {
        ++inputs;
        i += 2;
      } else {
        const size_t close = t.find('}', i);
        throw Error(RLH_E_INVALID_ARGUMENT,
                    file + ": unsupported placeholder '" + std::string(t.substr(i, close == std::string_view::npos ? 12 : close - i + 1)) +
                        "' at byte " + std::to_string(i) + " (the input is {}, braces are written {{ and }})");
      }
    } else if (t[i] == '}') {
      if (i + 1 < t.size() && t[i + 1] == '}') {
        ++i;
      } else {
        throw Error(RLH_E_INVALID_ARGUMENT, file + ": single '}' at byte " + std::to_string(i) + " (write }} for a brace)");
      }
    }
  }
  if (inputs == 0) throw Error(RLH_E_INVALID_ARGUMENT, file + ": no {} placeholder for the input");
}

std::string apply_prompt_template(std::string_view t, std::string_view input) {
  std::string out;
  out.reserve(t.size() + input.size());
  for (size_t i = 0; i < t.size(); ++i) {
    if (t.substr(i, 2) == "{{" || t.substr(i, 2) == "}}") {
      out.push_back(t[i]);
      ++i;
    } else if (t.substr(i, 2) == "{}") {
      out.append(input);
      ++i;
    } else if (t.substr(i, 3) == "{0}") {
      out.append(input);
      i += 2;
    } else {
      out.push_back(t[i]);
    }
  }
  return out;
}

JsonlDataset::JsonlDataset(const json& config) : cfg_(resolve_config(config)) {
  const JsonlSource& s = cfg_.source;
  if (s.format != RowFormat::kResponse) {
    // A preference row is a whole conversation pair: a prompt template or system prompt file
    // would have to be spliced into message lists, which NeMo-RL's preference datasets do not do.
    for (const auto* f : {&s.prompt_file, &s.system_prompt_file})
      if (*f)
        throw Error(RLH_E_INVALID_ARGUMENT, s.origin + (f == &s.prompt_file ? ".prompt_file" : ".system_prompt_file") +
                                                ": not used by preference datasets (put the text in the rows; set null)");
  }
  if (s.prompt_file) {
    prompt_ = read_text_file(*s.prompt_file, s.origin, "prompt_file");
    check_prompt_template(*prompt_, *s.prompt_file);
  }
  if (s.system_prompt_file) system_prompt_ = read_text_file(*s.system_prompt_file, s.origin, "system_prompt_file");
  if (s.format == RowFormat::kResponse) {
    rows_ = index_jsonl(s.data_path, s.input_key, s.output_key, s.origin, &messages_);
    if (messages_ && system_prompt_)
      throw Error(RLH_E_INVALID_ARGUMENT, s.origin + ".system_prompt_file: not used with a file of 'messages' "
                                                     "conversations (put a system message in the rows; set null)");
  } else {
    rows_ = index_jsonl(s.data_path, s.origin, [&](const nlohmann::ordered_json& line) {
      nlohmann::ordered_json out;
      return preference_row(s, line, out);
    });
  }
  if (rows_.empty()) throw Error(RLH_E_INVALID_ARGUMENT, s.data_path + ": no rows (" + s.origin + ".data_path)");
  if (cfg_.holdout) {
    const auto keep = split_rows(rows_.size(), s.split_validation_size, s.seed, cfg_.split == Split::kValidation, s.origin);
    std::vector<LineRef> picked;
    picked.reserve(keep.size());
    for (uint32_t i : keep) picked.push_back(rows_[i]);
    rows_ = std::move(picked);
  }
  try {
    fd_ = sdk::open_input_file(s.data_path, 0, s.origin + ".data_path:").release();
  } catch (const sdk::InputError& e) {
    throw Error(RLH_E_NOT_FOUND, e.what());
  }
}

JsonlDataset::~JsonlDataset() {
  if (fd_ >= 0) ::close(fd_);
}

std::string JsonlDataset::row_json(int64_t index) const {
  if (index < 0 || index >= size())
    throw Error(RLH_E_OUT_OF_RANGE, "jsonl dataset: row " + std::to_string(index) + " out of range [0, " +
                                        std::to_string(size()) + ")");
  const LineRef& r = rows_[static_cast<size_t>(index)];
  const JsonlSource& s = cfg_.source;
  const std::string where = s.data_path + ":" + std::to_string(r.line) + ": ";
  std::string line(r.length, '\0');
  size_t done = 0;
  while (done < r.length) {  // pread: no shared file position, so concurrent get()s are safe
    const ssize_t got = ::pread(fd_, line.data() + done, r.length - done, static_cast<off_t>(r.offset + done));
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0)
      throw Error(RLH_E_DATA_LOSS, where + (got < 0 ? std::string("read failed: ") + std::strerror(errno)
                                                    : std::string("file shrank since it was indexed")));
    done += static_cast<size_t>(got);
  }
  nlohmann::ordered_json row;
  try {
    row = nlohmann::ordered_json::parse(line);
  } catch (const std::exception& e) {
    throw Error(RLH_E_DATA_LOSS, where + "invalid JSON (the file changed since it was indexed?): " + e.what());
  }
  if (s.format != RowFormat::kResponse) {
    nlohmann::ordered_json out;
    if (std::string e = preference_row(s, row, out); !e.empty())
      throw Error(RLH_E_DATA_LOSS, where + "row changed since the file was indexed (" + e + ")");
    return out.dump(-1, ' ', false, nlohmann::json::error_handler_t::strict);
  }
  if (messages_) {
    if (!messages_row_error(row).empty()) throw Error(RLH_E_DATA_LOSS, where + "row changed since the file was indexed");
    if (prompt_)  // NeMo-RL's task prompt formats the first user message
      for (auto& m : row["messages"])
        if (m["role"] == "user") {
          m["content"] = apply_prompt_template(*prompt_, m["content"].get<std::string>());
          break;
        }
    return row.dump(-1, ' ', false, nlohmann::json::error_handler_t::strict);
  }
  if (!row.is_object() || !row.contains(s.input_key) || !row[s.input_key].is_string() || !row.contains(s.output_key))
    throw Error(RLH_E_DATA_LOSS, where + "row changed since the file was indexed");
  const std::string input = row[s.input_key].get<std::string>();
  const auto& out = row[s.output_key];
  // Numbers as Python's str() would print them for the common cases (42, 0.5), which is what
  // NeMo-RL's processors do with str(datum[output_key]).
  const std::string answer = out.is_string() ? out.get<std::string>() : out.dump();
  row["prompt"] = prompt_ ? apply_prompt_template(*prompt_, input) : input;
  row["answer"] = answer;
  if (system_prompt_) row["system_prompt"] = *system_prompt_;
  return row.dump(-1, ' ', false, nlohmann::json::error_handler_t::strict);
}

}  // namespace rlh::dataset_jsonl
