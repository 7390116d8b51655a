// Indexing a JSONL file: one pass in large chunks, recording where each non-blank line starts and
// validating it with nlohmann's SAX parser, which builds no values. Only the two keys the dataset
// needs are looked at (at the top level of each object), so memory stays at one LineRef per row.
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <functional>
#include <limits>

#include "rlhost/dataset_jsonl/jsonl_dataset.hpp"
#include "rlhost/sdk/json_input.hpp"
#include "rlhost/sdk/status.hpp"

namespace rlh::dataset_jsonl {
namespace {

using json = nlohmann::json;
using rlh::sdk::Error;

// What a top-level value is, for the two keys we check.
enum class Kind { kAbsent, kString, kNumber, kOther };

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::kString: return "a string";
    case Kind::kNumber: return "a number";
    case Kind::kOther: return "an object, array, boolean or null";
    default: return "absent";
  }
}

// Validates one line: a JSON object, noting the kinds of input_key and output_key.
class LineChecker {
 public:
  LineChecker(const std::string& in_key, const std::string& out_key) : in_key_(in_key), out_key_(out_key) {}

  bool null() { return value(Kind::kOther); }
  bool boolean(bool) { return value(Kind::kOther); }
  bool number_integer(json::number_integer_t) { return value(Kind::kNumber); }
  bool number_unsigned(json::number_unsigned_t) { return value(Kind::kNumber); }
  bool number_float(json::number_float_t, const json::string_t&) { return value(Kind::kNumber); }
  bool string(json::string_t&) { return value(Kind::kString); }
  bool binary(json::binary_t&) { return value(Kind::kOther); }
  bool start_object(std::size_t) {
    if (depth_ == 0) {
      ++depth_;
      return true;
    }
    value(Kind::kOther);
    return deeper();
  }
  bool end_object() {
    --depth_;
    return true;
  }
  bool start_array(std::size_t) {
    if (depth_ == 0) return top_level_not_object("an array");
    value(Kind::kOther);
    return deeper();
  }
  bool end_array() {
    --depth_;
    return true;
  }
  bool key(json::string_t& k) {
    if (depth_ == 1) pending_ = k == in_key_ ? 1 : (k == out_key_ ? 2 : 0);
    if (depth_ == 1 && k == in_key_ && k == out_key_) pending_ = 3;
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& ex) {
    // "[json.exception.parse_error.101] parse error at line 1, column 9: syntax error ..." ->
    // "syntax error ... (column 9)": the file's line number is ours, the column is useful.
    std::string what = ex.what();
    std::string column;
    if (auto c = what.find("column "); c != std::string::npos) {
      auto colon = what.find(": ", c);
      if (colon != std::string::npos) {
        column = what.substr(c, colon - c);
        what = what.substr(colon + 2);
      }
    }
    error_ = "invalid JSON: " + what + (column.empty() ? "" : " (" + column + ")");
    return false;
  }

  // Rows are handed on as JSON text and walked recursively by their readers: nesting is bounded
  // here, once, like every JSON input (rlhost/sdk/json_input.hpp).
  bool deeper() {
    if (++depth_ > sdk::kMaxJsonDepth) {
      error_ = "nested deeper than " + std::to_string(sdk::kMaxJsonDepth) + " levels";
      return false;
    }
    return true;
  }

  const std::string& error() const { return error_; }
  Kind input() const { return input_; }
  Kind output() const { return output_; }

 private:
  bool value(Kind k) {
    if (depth_ == 0) {
      return top_level_not_object(k == Kind::kString ? "a string" : k == Kind::kNumber ? "a number" : "a scalar");
    }
    if (depth_ == 1) {
      if (pending_ & 1) input_ = k;
      if (pending_ & 2) output_ = k;
      pending_ = 0;
    }
    return true;
  }
  bool top_level_not_object(const char* what) {
    error_ = std::string("the line is ") + what + ", not a JSON object (JSONL holds one object per line)";
    return false;
  }

  const std::string in_key_;  // copies: index_jsonl passes temporaries
  const std::string out_key_;
  int depth_ = 0;
  int pending_ = 0;  // bit 0: the value being read is input_key's, bit 1: output_key's
  Kind input_ = Kind::kAbsent, output_ = Kind::kAbsent;
  std::string error_;
};

bool blank(const char* p, size_t n) {
  for (size_t i = 0; i < n; ++i)
    if (p[i] != ' ' && p[i] != '\t' && p[i] != '\r') return false;
  return true;
}

}  // namespace

namespace {

// The line framing shared by both checks: `check(p, n, where)` throws for a bad line.
using LineFn = std::function<void(const char*, size_t, const std::string&)>;

std::vector<LineRef> index_lines(const std::string& path, const std::string& origin, const LineFn& check_text) {
  sdk::InputFd input;
  try {
    input = sdk::open_input_file(path, 0, origin + ".data_path:");  // regular files only, no size limit
  } catch (const sdk::InputError& e) {
    throw Error(RLH_E_NOT_FOUND, e.what());
  }
  const int fd = input.get();

  std::vector<LineRef> rows;
  std::vector<char> buf(4 << 20);
  std::string carry;          // a line that started in an earlier chunk
  uint64_t carry_offset = 0;  // its file offset
  uint64_t file_offset = 0;   // offset of buf[0]
  uint32_t line_no = 0;

  auto check_line = [&](const char* p, size_t n, uint64_t offset) {
    ++line_no;
    if (line_no == std::numeric_limits<uint32_t>::max())
      throw Error(RLH_E_OUT_OF_RANGE, path + ": more than 4294967294 lines");
    if (n > 0 && p[n - 1] == '\r') --n;  // CRLF files
    if (line_no == 1 && n >= 3 && std::memcmp(p, "\xEF\xBB\xBF", 3) == 0) {  // UTF-8 BOM
      p += 3;
      n -= 3;
      offset += 3;
    }
    if (blank(p, n)) return;
    if (n > std::numeric_limits<uint32_t>::max())
      throw Error(RLH_E_OUT_OF_RANGE, path + ":" + std::to_string(line_no) + ": line longer than 4 GiB");
    check_text(p, n, path + ":" + std::to_string(line_no) + ": ");
    rows.push_back({offset, static_cast<uint32_t>(n), line_no});
  };

  for (;;) {
    const ssize_t got = ::read(fd, buf.data(), buf.size());
    if (got < 0) {
      if (errno == EINTR) continue;
      throw Error(RLH_E_UNAVAILABLE, path + ": read failed: " + std::strerror(errno));
    }
    if (got == 0) break;
    const char* p = buf.data();
    const char* end = p + got;
    while (p < end) {
      const char* nl = static_cast<const char*>(std::memchr(p, '\n', static_cast<size_t>(end - p)));
      if (nl == nullptr) {  // the line continues in the next chunk
        if (carry.empty()) carry_offset = file_offset + static_cast<uint64_t>(p - buf.data());
        carry.append(p, end);
        break;
      }
      if (!carry.empty()) {
        carry.append(p, nl);
        check_line(carry.data(), carry.size(), carry_offset);
        carry.clear();
      } else {
        check_line(p, static_cast<size_t>(nl - p), file_offset + static_cast<uint64_t>(p - buf.data()));
      }
      p = nl + 1;
    }
    file_offset += static_cast<uint64_t>(got);
  }
  if (!carry.empty()) check_line(carry.data(), carry.size(), carry_offset);  // no final newline
  return rows;
}

// A line parsed whole and given to `check` (which returns "" or what is wrong): the SAX pass
// first, which bounds the nesting depth before a tree is built.
void check_parsed_line(const char* p, size_t n, const std::string& where,
                       const std::function<std::string(const nlohmann::ordered_json&)>& check) {
  LineChecker shape("", "");
  if (!json::sax_parse(p, p + n, &shape, json::input_format_t::json, true) || !shape.error().empty())
    throw Error(RLH_E_INVALID_ARGUMENT, where + (shape.error().empty() ? "invalid JSON" : shape.error()));
  nlohmann::ordered_json line;
  try {
    line = nlohmann::ordered_json::parse(p, p + n);
  } catch (const std::exception& e) {
    throw Error(RLH_E_INVALID_ARGUMENT, where + "invalid JSON: " + e.what());
  }
  if (std::string e = check(line); !e.empty()) throw Error(RLH_E_INVALID_ARGUMENT, where + e);
}

}  // namespace

std::string messages_row_error(const nlohmann::ordered_json& line) {
  if (!line.is_object()) return "expected a JSON object";
  auto it = line.find("messages");
  if (it == line.end()) return "missing key 'messages' (the file's first row has it: every row of a conversation file must)";
  if (!it->is_array() || it->empty()) return "'messages' must be a non-empty list of {role, content} objects";
  // (The sft plugin's bound: each message renders the conversation up to it.)
  constexpr size_t kMaxMessages = 1024;
  if (it->size() > kMaxMessages)
    return "'messages' has " + std::to_string(it->size()) + " messages, more than the " + std::to_string(kMaxMessages) +
           " a conversation row takes";
  for (size_t i = 0; i < it->size(); ++i) {
    const auto& m = (*it)[i];
    const std::string at = "messages[" + std::to_string(i) + "]";
    if (!m.is_object()) return at + " must be an object with string 'role' and 'content'";
    if (!m.contains("role") || !m["role"].is_string()) return at + ".role must be a string";
    if (!m.contains("content") || !m["content"].is_string())
      return at + ".content must be a string (multimodal content lists are not supported)";
    if (m.contains("tool_calls") && !m["tool_calls"].is_null())
      return at + ": tool calls are not supported in training conversations";
  }
  return "";
}

std::vector<LineRef> index_jsonl(const std::string& path, const std::string& input_key,
                                 const std::string& output_key, const std::string& origin, bool* messages) {
  // NeMo-RL's ResponseDataset takes a file with a "messages" column as conversations; the first
  // row decides here (a SAX peek that builds nothing).
  enum class Layout { kUndecided, kFields, kMessages } layout = messages ? Layout::kUndecided : Layout::kFields;
  return index_lines(path, origin, [&](const char* p, size_t n, const std::string& where) {
    if (layout == Layout::kUndecided) {
      LineChecker peek("messages", "messages");
      const bool ok = json::sax_parse(p, p + n, &peek, json::input_format_t::json, true);
      layout = ok && peek.error().empty() && peek.input() != Kind::kAbsent ? Layout::kMessages : Layout::kFields;
      *messages = layout == Layout::kMessages;
    }
    if (layout == Layout::kMessages) return check_parsed_line(p, n, where, messages_row_error);
    LineChecker check(input_key, output_key);
    const bool ok = json::sax_parse(p, p + n, &check, json::input_format_t::json, true);
    if (!ok || !check.error().empty())
      throw Error(RLH_E_INVALID_ARGUMENT, where + (check.error().empty() ? "invalid JSON" : check.error()));
    if (check.input() == Kind::kAbsent)
      throw Error(RLH_E_INVALID_ARGUMENT, where + "missing key '" + input_key + "' (" + origin + ".input_key)");
    if (check.output() == Kind::kAbsent)
      throw Error(RLH_E_INVALID_ARGUMENT, where + "missing key '" + output_key + "' (" + origin + ".output_key)");
    if (check.input() != Kind::kString)
      throw Error(RLH_E_INVALID_ARGUMENT, where + "key '" + input_key + "' (" + origin + ".input_key) must be a string, got " +
                                              kind_name(check.input()));
    if (check.output() != Kind::kString && check.output() != Kind::kNumber)
      throw Error(RLH_E_INVALID_ARGUMENT, where + "key '" + output_key + "' (" + origin +
                                              ".output_key) must be a string or number, got " + kind_name(check.output()));
  });
}

std::vector<LineRef> index_jsonl(const std::string& path, const std::string& origin,
                                 const std::function<std::string(const nlohmann::ordered_json&)>& check) {
  return index_lines(path, origin, [&](const char* p, size_t n, const std::string& where) {
    check_parsed_line(p, n, where, check);
  });
}

}  // namespace rlh::dataset_jsonl
