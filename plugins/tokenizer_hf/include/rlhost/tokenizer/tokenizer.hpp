// rlhost tokenizer: a native loader and encoder for Hugging Face `tokenizer.json` files.
//
// Supports the BPE model in its two common shapes: byte-level BPE (GPT-2, Llama-3, Qwen2) and
// SentencePiece-style BPE with byte fallback (Llama-2, Mistral), together with the normalizers,
// pre-tokenizers, post-processors and decoders those files use. Ids and decoded text are meant to
// be identical to HF `tokenizers`; docs/tokenizer.md lists what is covered and how it is tested.
//
// Errors: every malformed file or unsupported component throws std::runtime_error with a one-line
// message that names the file and the JSON field, e.g.
//   "tokenizer.json: model.merges[17]: expected \"a b\" or [a, b]".
// Thread safety: a loaded Tokenizer is immutable; encode/decode may run concurrently from many
// threads (the word cache is per thread).
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "rlhost/tokenizer/chat_template.hpp"

namespace rlh::tok {

// What tokenizer_config.json adds on top of tokenizer.json (all optional).
struct TokenizerConfig {
  std::optional<std::string> bos_token;  // "bos_token" (string or {"content": ...})
  std::optional<std::string> eos_token;
  std::optional<std::string> pad_token;
  std::optional<std::string> unk_token;
  std::optional<bool> add_bos_token;     // transformers' Llama/Gemma style flags
  std::optional<bool> add_eos_token;
  // chat_template: a single template, or named ones; "default" is the one used by default.
  std::vector<std::pair<std::string, std::string>> chat_templates;
  // generation_config.json "eos_token_id" (an id or a list: instruct models stop on several).
  std::vector<int32_t> generation_eos_ids;
};

class Tokenizer {
 public:
  // Reads a tokenizer.json file. Throws std::runtime_error on a bad file.
  static Tokenizer from_file(const std::filesystem::path& tokenizer_json);
  // Reads <dir>/tokenizer.json and, when present, <dir>/tokenizer_config.json,
  // <dir>/chat_template.jinja and <dir>/generation_config.json.
  static Tokenizer from_dir(const std::filesystem::path& dir);
  // A directory, a tokenizer.json file, or a hub id resolved in the local HF cache.
  static Tokenizer from_pretrained(std::string_view dir_file_or_hub_id);
  // From in-memory JSON text; `name` is used in error messages.
  static Tokenizer from_json_string(std::string_view json, std::string_view name = "tokenizer.json");

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  // Encodes UTF-8 text (invalid UTF-8 throws std::invalid_argument). add_special_tokens runs the
  // post-processor (BOS/EOS templates) and, for configs that ask for it, the
  // tokenizer_config.json add_bos_token/add_eos_token flags.
  std::vector<int32_t> encode(std::string_view text, bool add_special_tokens = true) const;
  // Decodes ids to text; unknown ids are skipped like HF does.
  std::string decode(std::span<const int32_t> ids, bool skip_special_tokens = false) const;

  std::optional<int32_t> token_to_id(std::string_view token) const;
  std::optional<std::string> id_to_token(int32_t id) const;
  // Number of distinct ids: model vocabulary plus added tokens that are not in it (HF's
  // get_vocab_size(with_added_tokens=true)).
  size_t vocab_size() const;
  bool is_special(int32_t id) const;

  std::optional<int32_t> bos_id() const;
  std::optional<int32_t> eos_id() const;
  std::optional<int32_t> pad_id() const;
  // Every id that ends generation: eos_id() plus generation_config.json's eos_token_id(s).
  std::vector<int32_t> eos_ids() const;
  std::optional<std::string> bos_token() const;
  std::optional<std::string> eos_token() const;

  const TokenizerConfig& config() const;
  // The chat template named `name` ("" picks "default" or the only one); nullopt if none.
  std::optional<ChatTemplate> chat_template(std::string_view name = "") const;

  // Applies tokenizer_config.json content (from_dir does this itself).
  void apply_config_json(std::string_view json_text, std::string_view name = "tokenizer_config.json");

  struct Impl;

 private:
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace rlh::tok
