// The BPE model: see bpe.hpp.
#include "bpe.hpp"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <limits>

#include "unicode.hpp"

namespace rlh::tok {

namespace {

constexpr uint32_t kNoRank = std::numeric_limits<uint32_t>::max();
std::atomic<uint64_t> g_instances{1};
size_t g_heap_threshold = 48;

inline uint64_t mix(uint64_t x) {
  x ^= x >> 32;
  x *= 0xd6e8feb86659fd93ull;
  x ^= x >> 32;
  return x;
}

uint64_t hash_bytes(const char* p, size_t n) {
  uint64_t h = 0x9E3779B97F4A7C15ull ^ (n * 0xff51afd7ed558ccdull);
  while (n >= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    h = mix(h ^ w) * 0x9E3779B97F4A7C15ull;
    p += 8;
    n -= 8;
  }
  uint64_t w = 0;
  std::memcpy(&w, p, n);
  return mix(h ^ w ^ (static_cast<uint64_t>(n) << 56));
}

// Per-thread word cache: raw word bytes -> ids. Open addressing over an arena; cleared when
// full rather than evicting piecemeal (cheap, and a steady corpus refills it quickly).
class WordCache {
 public:
  static constexpr size_t kMaxWordLen = 256;  // like HF, long words are not cached
  static constexpr size_t kMaxEntries = 1 << 18;

  const int32_t* find(std::string_view w, uint64_t h, uint32_t& n) const {
    if (slots_.empty()) return nullptr;
    const size_t mask = slots_.size() - 1;
    for (size_t i = h & mask;; i = (i + 1) & mask) {
      const uint32_t e = slots_[i];
      if (e == 0) return nullptr;
      const Entry& en = entries_[e - 1];
      if (en.hash == h && en.klen == w.size() && std::memcmp(keys_.data() + en.koff, w.data(), w.size()) == 0) {
        n = en.vlen;
        return vals_.data() + en.voff;
      }
    }
  }

  void insert(std::string_view w, uint64_t h, const int32_t* ids, uint32_t n) {
    if (entries_.size() >= kMaxEntries) clear();
    if (slots_.empty()) slots_.assign(kMaxEntries * 2, 0);
    entries_.push_back({h, static_cast<uint32_t>(keys_.size()), static_cast<uint32_t>(w.size()),
                        static_cast<uint32_t>(vals_.size()), n});
    keys_.append(w);
    vals_.insert(vals_.end(), ids, ids + n);
    const size_t mask = slots_.size() - 1;
    size_t i = h & mask;
    while (slots_[i] != 0) i = (i + 1) & mask;
    slots_[i] = static_cast<uint32_t>(entries_.size());
  }

  void clear() {
    std::fill(slots_.begin(), slots_.end(), 0);
    entries_.clear();
    keys_.clear();
    vals_.clear();
  }

 private:
  struct Entry {
    uint64_t hash;
    uint32_t koff, klen, voff, vlen;
  };
  std::vector<uint32_t> slots_;
  std::vector<Entry> entries_;
  std::string keys_;
  std::vector<int32_t> vals_;
};

// A few caches per thread, keyed by model instance; the least recently used one is dropped.
WordCache& thread_cache(uint64_t instance) {
  struct Slot {
    uint64_t instance = 0;
    uint64_t used = 0;
    std::unique_ptr<WordCache> cache;
  };
  thread_local Slot slots[4];
  thread_local uint64_t clock = 0;
  ++clock;
  Slot* victim = &slots[0];
  for (Slot& s : slots) {
    if (s.instance == instance) {
      s.used = clock;
      return *s.cache;
    }
    if (s.used < victim->used) victim = &s;
  }
  victim->instance = instance;
  victim->used = clock;
  if (victim->cache) victim->cache->clear();
  else victim->cache = std::make_unique<WordCache>();
  return *victim->cache;
}

}  // namespace

size_t StringHash::operator()(std::string_view s) const noexcept { return hash_bytes(s.data(), s.size()); }

// (left id, right id) -> (rank, merged id), open addressing on 64-bit keys.
struct BpeModel::MergeTable {
  struct Slot {
    uint64_t key;
    uint32_t rank;
    int32_t id;
  };
  std::vector<Slot> slots;
  size_t mask = 0;
  static constexpr uint64_t kEmpty = ~0ull;

  explicit MergeTable(size_t n) {
    size_t cap = 16;
    while (cap < n * 2 + 16) cap <<= 1;
    slots.assign(cap, Slot{kEmpty, 0, 0});
    mask = cap - 1;
  }
  static uint64_t key(int32_t a, int32_t b) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
  }
  // Later duplicates overwrite earlier ones, as HF's HashMap collect does.
  void put(int32_t a, int32_t b, uint32_t rank, int32_t id) {
    const uint64_t k = key(a, b);
    for (size_t i = mix(k) & mask;; i = (i + 1) & mask) {
      if (slots[i].key == kEmpty || slots[i].key == k) {
        slots[i] = {k, rank, id};
        return;
      }
    }
  }
  uint32_t get(int32_t a, int32_t b, int32_t& id) const {
    const uint64_t k = key(a, b);
    for (size_t i = mix(k) & mask;; i = (i + 1) & mask) {
      const Slot& s = slots[i];
      if (s.key == k) {
        id = s.id;
        return s.rank;
      }
      if (s.key == kEmpty) return kNoRank;
    }
  }
};

void BpeModel::set_heap_threshold_for_tests(size_t n) { g_heap_threshold = n == 0 ? 48 : std::min<size_t>(n, 64); }

BpeModel::BpeModel(const json& m, const JPath& p) : instance_(g_instances.fetch_add(1)) {
  if (!m.is_object()) p.fail(std::string("expected an object, got ") + json_kind(m));
  if (auto type = opt_string(m, "type", p); type && *type != "BPE") {
    p.at("type").fail("model type \"" + *type + "\" is not supported (only BPE)");
  }
  if (const json* d = member(m, "dropout")) {
    if (!d->is_number()) p.at("dropout").fail("expected null or a number");
    const double v = d->get<double>();
    if (v < 0.0 || v > 1.0) p.at("dropout").fail("must be between 0 and 1");
    // Dropout is a training-time randomisation; inference tokenization ignores it (a value of
    // 0 is the same as null in HF).
  }
  unk_token_ = opt_string(m, "unk_token", p);
  prefix_ = opt_string(m, "continuing_subword_prefix", p).value_or("");
  suffix_ = opt_string(m, "end_of_word_suffix", p).value_or("");
  fuse_unk_ = opt_bool(m, "fuse_unk", p, false);
  byte_fallback_ = opt_bool(m, "byte_fallback", p, false);
  ignore_merges_ = opt_bool(m, "ignore_merges", p, false);

  const json& v = need(m, "vocab", p);
  const JPath vp = p.at("vocab");
  if (!v.is_object()) vp.fail(std::string("expected an object of token: id, got ") + json_kind(v));
  vocab_.reserve(v.size());
  int32_t max_id = -1;
  for (auto it = v.begin(); it != v.end(); ++it) {
    const auto id = static_cast<int32_t>(need_uint(it.value(), vp.at(it.key()), 0x7FFFFFFF));
    vocab_[it.key()] = id;
    max_id = std::max(max_id, id);
  }
  // Dense id table unless the ids are very sparse (then a hash map keeps memory bounded).
  const bool dense = max_id < static_cast<int32_t>(vocab_.size() * 4 + 1024);
  if (dense) id_to_tok_.assign(static_cast<size_t>(max_id + 1), nullptr);
  for (const auto& [tok, id] : vocab_) {
    if (dense) id_to_tok_[static_cast<size_t>(id)] = &tok;
    else id_to_tok_sparse_[id] = &tok;
  }

  const json& mg = need(m, "merges", p);
  const JPath mp = p.at("merges");
  if (!mg.is_array()) mp.fail(std::string("expected an array, got ") + json_kind(mg));
  merges_ = std::make_unique<MergeTable>(mg.size());
  std::string merged;
  for (size_t i = 0; i < mg.size(); ++i) {
    const json& e = mg[i];
    std::string a, b;
    if (e.is_string()) {
      const std::string& s = e.get_ref<const std::string&>();
      const size_t sp = s.find(' ');
      if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos) {
        mp.at(i).fail("expected \"a b\" or [a, b]");
      }
      a = s.substr(0, sp);
      b = s.substr(sp + 1);
    } else if (e.is_array() && e.size() == 2 && e[0].is_string() && e[1].is_string()) {
      a = e[0].get<std::string>();
      b = e[1].get<std::string>();
    } else {
      mp.at(i).fail("expected \"a b\" or [a, b]");
    }
    auto ia = vocab_.find(a), ib = vocab_.find(b);
    if (ia == vocab_.end()) mp.at(i).fail("token \"" + a + "\" is not in the vocabulary");
    if (ib == vocab_.end()) mp.at(i).fail("token \"" + b + "\" is not in the vocabulary");
    // The merged token drops the continuing-subword prefix of the right part.
    if (!prefix_.empty() && b.size() < prefix_.size()) {
      mp.at(i).fail("token \"" + b + "\" is shorter than continuing_subword_prefix");
    }
    merged = a;
    merged.append(b, prefix_.size(), std::string::npos);
    auto im = vocab_.find(merged);
    if (im == vocab_.end()) mp.at(i).fail("merged token \"" + merged + "\" is not in the vocabulary");
    merges_->put(ia->second, ib->second, static_cast<uint32_t>(i), im->second);
  }

  char name[8];
  for (int byte = 0; byte < 256; ++byte) {
    std::snprintf(name, sizeof(name), "<0x%02X>", byte);
    auto it = vocab_.find(std::string_view(name));
    byte_fallback_ids_[byte] = it == vocab_.end() ? -1 : it->second;
  }
  const auto& bl = uni::byte_level();
  byte_level_complete_ = prefix_.empty() && suffix_.empty();
  for (int byte = 0; byte < 256; ++byte) {
    auto it = vocab_.find(std::string_view(bl.byte_to_utf8[byte]));
    byte_level_ids_[byte] = it == vocab_.end() ? -1 : it->second;
  }
}

BpeModel::~BpeModel() = default;

std::optional<int32_t> BpeModel::token_to_id(std::string_view tok) const {
  auto it = vocab_.find(tok);
  if (it == vocab_.end()) return std::nullopt;
  return it->second;
}

const std::string* BpeModel::id_to_token(int32_t id) const {
  if (id < 0) return nullptr;
  if (!id_to_tok_.empty() || id_to_tok_sparse_.empty()) {
    return static_cast<size_t>(id) < id_to_tok_.size() ? id_to_tok_[static_cast<size_t>(id)] : nullptr;
  }
  auto it = id_to_tok_sparse_.find(id);
  return it == id_to_tok_sparse_.end() ? nullptr : it->second;
}

uint32_t BpeModel::lookup(int32_t a, int32_t b, int32_t& new_id) const { return merges_->get(a, b, new_id); }

void BpeModel::merge_symbols(std::vector<int32_t>& ids) const {
  const size_t n = ids.size();
  if (n < 2) return;
  if (n < g_heap_threshold) {
    // Direct scan: ranks[i] is the rank of (ids[i], ids[i+1]).
    uint32_t ranks[64];
    int32_t news[64];
    size_t len = n;
    for (size_t i = 0; i + 1 < len; ++i) ranks[i] = lookup(ids[i], ids[i + 1], news[i]);
    for (;;) {
      uint32_t best = kNoRank;
      size_t at = 0;
      for (size_t i = 0; i + 1 < len; ++i) {
        if (ranks[i] < best) { best = ranks[i]; at = i; }
      }
      if (best == kNoRank) break;
      ids[at] = news[at];
      for (size_t i = at + 1; i + 1 < len; ++i) {
        ids[i] = ids[i + 1];
        ranks[i] = ranks[i + 1];
        news[i] = news[i + 1];
      }
      --len;
      if (at > 0) ranks[at - 1] = lookup(ids[at - 1], ids[at], news[at - 1]);
      if (at + 1 < len) ranks[at] = lookup(ids[at], ids[at + 1], news[at]);
    }
    ids.resize(len);
    return;
  }

  // Heap of (rank, position) with lazy invalidation, as in HF's Word::merge_all.
  struct Sym {
    int32_t id;
    int32_t prev, next;
    bool alive;
  };
  struct Cand {
    uint32_t rank;
    uint32_t pos;
    int32_t new_id;
    bool operator>(const Cand& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::vector<Sym> sy(n);
  std::vector<Cand> heap;
  heap.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    sy[i] = {ids[i], static_cast<int32_t>(i) - 1, i + 1 < n ? static_cast<int32_t>(i + 1) : -1, true};
  }
  for (size_t i = 0; i + 1 < n; ++i) {
    int32_t nid;
    const uint32_t r = lookup(ids[i], ids[i + 1], nid);
    if (r != kNoRank) heap.push_back({r, static_cast<uint32_t>(i), nid});
  }
  auto cmp = [](const Cand& a, const Cand& b) { return a > b; };
  std::make_heap(heap.begin(), heap.end(), cmp);
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), cmp);
    const Cand top = heap.back();
    heap.pop_back();
    Sym& cur = sy[top.pos];
    if (!cur.alive || cur.next < 0) continue;
    Sym& right = sy[static_cast<size_t>(cur.next)];
    int32_t nid;
    if (lookup(cur.id, right.id, nid) == kNoRank || nid != top.new_id) continue;  // stale
    cur.id = top.new_id;
    right.alive = false;
    cur.next = right.next;
    if (cur.next >= 0) sy[static_cast<size_t>(cur.next)].prev = static_cast<int32_t>(top.pos);
    if (cur.prev >= 0) {
      const uint32_t r = lookup(sy[static_cast<size_t>(cur.prev)].id, cur.id, nid);
      if (r != kNoRank) {
        heap.push_back({r, static_cast<uint32_t>(cur.prev), nid});
        std::push_heap(heap.begin(), heap.end(), cmp);
      }
    }
    if (cur.next >= 0) {
      const uint32_t r = lookup(cur.id, sy[static_cast<size_t>(cur.next)].id, nid);
      if (r != kNoRank) {
        heap.push_back({r, top.pos, nid});
        std::push_heap(heap.begin(), heap.end(), cmp);
      }
    }
  }
  ids.clear();
  for (const Sym& s : sy) if (s.alive) ids.push_back(s.id);
}

// HF BPE::merge_word: initial symbols (with prefix/suffix, byte fallback, unk fusing) + merges.
void BpeModel::merge_word(std::string_view w, std::vector<int32_t>& out) const {
  std::vector<int32_t> syms;
  syms.reserve(w.size());
  int32_t unk_id = -1;
  bool unk_pending = false;
  int32_t unk_vocab_id = -1;
  bool unk_missing = false;
  if (unk_token_) {
    auto it = vocab_.find(*unk_token_);
    if (it != vocab_.end()) unk_vocab_id = it->second;
    else unk_missing = true;
  }
  std::string s;
  const char* p = w.data();
  const char* end = p + w.size();
  const char* start = p;
  while (p < end) {
    const int n = uni::seq_len(static_cast<unsigned char>(*p));
    const bool first = p == start;
    const bool last = p + n >= end;
    s.assign(p, static_cast<size_t>(std::min<ptrdiff_t>(n, end - p)));
    if (!first && !prefix_.empty()) s.insert(0, prefix_);
    if (last && !suffix_.empty()) s += suffix_;
    p += n;
    auto it = vocab_.find(s);
    if (it != vocab_.end()) {
      if (unk_pending) { syms.push_back(unk_id); unk_pending = false; }
      syms.push_back(it->second);
      continue;
    }
    if (byte_fallback_) {
      bool all = true;
      for (const char c : s) if (byte_fallback_ids_[static_cast<unsigned char>(c)] < 0) { all = false; break; }
      if (all) {
        for (const char c : s) syms.push_back(byte_fallback_ids_[static_cast<unsigned char>(c)]);
        continue;
      }
    }
    if (unk_missing) {
      // Like HF: a configured unk token that is not in the vocabulary fails when needed.
      throw std::runtime_error("tokenizer: model.unk_token \"" + *unk_token_ + "\" is not in the vocabulary");
    }
    if (unk_vocab_id >= 0) {
      if (unk_pending && !fuse_unk_) syms.push_back(unk_id);
      unk_id = unk_vocab_id;
      unk_pending = true;
    }
  }
  if (unk_pending) syms.push_back(unk_id);
  merge_symbols(syms);
  out.insert(out.end(), syms.begin(), syms.end());
}

void BpeModel::encode_word(std::string_view word, bool byte_level, std::vector<int32_t>& out) const {
  if (word.empty()) return;
  const bool cacheable = word.size() < WordCache::kMaxWordLen;
  uint64_t h = 0;
  WordCache* cache = nullptr;
  if (cacheable) {
    h = hash_bytes(word.data(), word.size());
    cache = &thread_cache(instance_);
    uint32_t n;
    if (const int32_t* hit = cache->find(word, h, n)) {
      out.insert(out.end(), hit, hit + n);
      return;
    }
  }
  const size_t before = out.size();
  std::string mapped;
  std::string_view w = word;
  if (byte_level) {
    uni::append_byte_level(mapped, word);
    w = mapped;
  }
  bool done = false;
  if (ignore_merges_) {
    auto it = vocab_.find(w);
    if (it != vocab_.end()) {
      out.push_back(it->second);
      done = true;
    }
  }
  if (!done && byte_level && byte_level_complete_) {
    // Fast start: each byte is its own symbol; no prefix/suffix/unk handling is needed.
    std::vector<int32_t> syms(word.size());
    bool ok = true;
    for (size_t i = 0; i < word.size(); ++i) {
      syms[i] = byte_level_ids_[static_cast<unsigned char>(word[i])];
      if (syms[i] < 0) { ok = false; break; }
    }
    if (ok) {
      merge_symbols(syms);
      out.insert(out.end(), syms.begin(), syms.end());
      done = true;
    }
  }
  if (!done) merge_word(w, out);
  if (cache) cache->insert(word, h, out.data() + before, static_cast<uint32_t>(out.size() - before));
}

}  // namespace rlh::tok
