// Preference rows (NeMo-RL's BinaryPreferenceDataset and PreferenceDataset) in the one form the
// preference algorithms read (see jsonl_dataset.hpp). Each line is checked when the file is
// indexed, so a bad row stops the run at start with its file and line, not at the step that
// happens to draw it.
#include <string>

#include "rlhost/dataset_jsonl/jsonl_dataset.hpp"

namespace rlh::dataset_jsonl {
namespace {

using ojson = nlohmann::ordered_json;

std::string kind(const ojson& v) {
  if (v.is_null()) return "null";
  if (v.is_string()) return "a string";
  if (v.is_number()) return "a number";
  if (v.is_boolean()) return "a boolean";
  if (v.is_array()) return "a list";
  return "a mapping";
}

// A chat message list: [{"role": str, "content": str}, ...], not empty.
std::string check_messages(const ojson& v, const std::string& what) {
  if (!v.is_array()) return what + " must be a list of messages, got " + kind(v);
  if (v.empty()) return what + " is an empty list of messages";
  for (size_t i = 0; i < v.size(); ++i) {
    const ojson& m = v[i];
    const std::string at = what + "[" + std::to_string(i) + "]";
    if (!m.is_object()) return at + " must be a message {role, content}, got " + kind(m);
    if (!m.contains("role") || !m["role"].is_string()) return at + ".role must be a string";
    if (!m.contains("content") || !m["content"].is_string()) return at + ".content must be a string";
  }
  return {};
}

// A string becomes one message of `role`; a list must be messages.
std::string to_messages(const ojson& v, const char* role, const std::string& what, ojson& out) {
  if (v.is_string()) {
    out = ojson::array({{{"role", role}, {"content", v.get<std::string>()}}});
    return {};
  }
  if (!v.is_array()) return what + " must be a string or a list of messages, got " + kind(v);
  if (std::string e = check_messages(v, what); !e.empty()) return e;
  out = v;
  return {};
}

}  // namespace

std::string preference_row(const JsonlSource& s, const ojson& line, ojson& out) {
  if (!line.is_object()) return "a row must be a JSON object, got " + kind(line);
  ojson context, chosen, rejected;
  if (s.format == RowFormat::kBinaryPreference) {
    for (const auto* k : {&s.prompt_key, &s.chosen_key, &s.rejected_key})
      if (!line.contains(*k)) {
        const char* which = k == &s.prompt_key ? "prompt_key" : k == &s.chosen_key ? "chosen_key" : "rejected_key";
        return "missing key '" + *k + "' (" + s.origin + "." + which + ")";
      }
    if (std::string e = to_messages(line[s.prompt_key], "user", "'" + s.prompt_key + "'", context); !e.empty()) return e;
    if (std::string e = to_messages(line[s.chosen_key], "assistant", "'" + s.chosen_key + "'", chosen); !e.empty()) return e;
    if (std::string e = to_messages(line[s.rejected_key], "assistant", "'" + s.rejected_key + "'", rejected); !e.empty())
      return e;
  } else {
    if (!line.contains("context")) return "missing key 'context' (a PreferenceDataset row)";
    if (std::string e = check_messages(line["context"], "'context'"); !e.empty()) return e;
    context = line["context"];
    if (!line.contains("completions") || !line["completions"].is_array())
      return "'completions' must be a list of two {rank, completion}";
    const ojson& c = line["completions"];
    // NeMo-RL's preference processor: exactly two completions, the lower rank is chosen, no ties.
    if (c.size() != 2) return "'completions' has " + std::to_string(c.size()) + " entries; DPO and RM rows have exactly 2";
    for (size_t i = 0; i < 2; ++i) {
      const std::string at = "'completions'[" + std::to_string(i) + "]";
      if (!c[i].is_object() || !c[i].contains("rank") || !c[i]["rank"].is_number())
        return at + ".rank must be a number";
      if (!c[i].contains("completion")) return at + ".completion is missing";
      if (std::string e = check_messages(c[i]["completion"], at + ".completion"); !e.empty()) return e;
    }
    const double r0 = c[0]["rank"].get<double>(), r1 = c[1]["rank"].get<double>();
    if (r0 == r1) return "'completions' ranks tie (" + c[0]["rank"].dump() + "); a pair needs a preferred completion";
    chosen = c[r0 < r1 ? 0 : 1]["completion"];
    rejected = c[r0 < r1 ? 1 : 0]["completion"];
  }
  out = line;
  out["context"] = std::move(context);
  out["completions"] = ojson::array({{{"rank", 0}, {"completion", std::move(chosen)}},
                                     {{"rank", 1}, {"completion", std::move(rejected)}}});
  return {};
}

}  // namespace rlh::dataset_jsonl
