// The BPE model (HF tokenizers/src/models/bpe): vocabulary, ranked merges, and the merge loop.
//
// merge loop: a word starts as one symbol per character (or per byte for byte-level input, or
// <0xNN> byte tokens / unk for characters missing from the vocabulary) and the adjacent pair with
// the lowest merge rank, leftmost on ties, is merged until no pair has a rank. Short words use a
// direct scan (cheaper than a heap below a few dozen symbols); long words use a binary heap with
// lazy invalidation, O(n log n), so very long words (no pre-tokenizer, long runs) stay fast and
// give exactly HF's result without chunking.
//
// cache: finished words are cached per thread (raw piece bytes -> ids), like HF's word cache.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "json_util.hpp"

namespace rlh::tok {

struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const noexcept;
};
using Vocab = std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>>;

class BpeModel {
 public:
  // `model` is the "model" object of tokenizer.json. Throws with the JSON path on bad content.
  BpeModel(const json& model, const JPath& p);
  ~BpeModel();

  // Appends the ids of one word. byte_level: `word` holds raw bytes and each byte first maps to
  // its GPT-2 printable character (the deferred ByteLevel pre-tokenizer step).
  void encode_word(std::string_view word, bool byte_level, std::vector<int32_t>& out) const;

  std::optional<int32_t> token_to_id(std::string_view tok) const;
  const std::string* id_to_token(int32_t id) const;
  size_t size() const { return vocab_.size(); }
  const Vocab& vocab() const { return vocab_; }

  // Test hook: forces the heap merge loop for every word size (0 restores the default).
  static void set_heap_threshold_for_tests(size_t n);

 private:
  struct MergeTable;
  void merge_word(std::string_view w, std::vector<int32_t>& out) const;
  void merge_symbols(std::vector<int32_t>& ids) const;
  uint32_t lookup(int32_t a, int32_t b, int32_t& new_id) const;

  Vocab vocab_;
  std::vector<const std::string*> id_to_tok_;  // dense ids
  std::unordered_map<int32_t, const std::string*> id_to_tok_sparse_;
  std::unique_ptr<MergeTable> merges_;
  std::optional<std::string> unk_token_;
  std::string prefix_, suffix_;
  bool fuse_unk_ = false, byte_fallback_ = false, ignore_merges_ = false;
  int32_t byte_fallback_ids_[256];
  int32_t byte_level_ids_[256];  // id of each byte's printable char; -1 if absent
  bool byte_level_complete_ = false;
  uint64_t instance_;  // identifies this model's per-thread cache
};

}  // namespace rlh::tok
