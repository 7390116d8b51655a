// The block pool of the paged KV cache (layout and lifetime in kv_cache.hpp).
#include "rlhost/generator/kv_cache.hpp"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <new>
#include <stdexcept>
#include <string>

namespace rlh::gen {

KvLayout KvLayout::make(int64_t block_size, std::vector<int64_t> kv_heads, std::vector<int64_t> head_dim,
                        std::vector<int64_t> value_dim, bool keys_transposed, int64_t elem_bytes) {
  if (block_size < 1) throw std::invalid_argument("kv cache: block_size must be >= 1");
  if (elem_bytes != 1 && elem_bytes != 2 && elem_bytes != 4) throw std::invalid_argument("kv cache: elements of 1, 2 or 4 bytes");
  if (value_dim.empty()) value_dim = head_dim;
  if (kv_heads.size() != head_dim.size() || value_dim.size() != head_dim.size())
    throw std::invalid_argument("kv cache: one (heads, key dim, value dim) per layer");
  KvLayout l;
  l.block_size = block_size;
  l.kv_heads = std::move(kv_heads);
  l.head_dim = std::move(head_dim);
  l.value_dim = std::move(value_dim);
  int64_t at = 0;
  for (size_t i = 0; i < l.kv_heads.size(); ++i) {
    if (l.kv_heads[i] < 1 || l.head_dim[i] < 1 || l.value_dim[i] < 1)
      throw std::invalid_argument("kv cache: empty layer");
    l.offset.push_back(at);
    at += l.kv_heads[i] * block_size * (l.head_dim[i] + l.value_dim[i]);
  }
  // Round blocks up to 64 bytes (a host cache line) so no two blocks share one.
  const int64_t line = 64 / elem_bytes;
  l.block_elems = (at + line - 1) / line * line;
  l.keys_transposed = keys_transposed;
  l.elem_bytes = elem_bytes;
  return l;
}

PoolAllocator PoolAllocator::aligned_heap() {
  PoolAllocator a;
  a.allocate = [](size_t bytes) {
    void* p = std::aligned_alloc(64, std::max<size_t>(64, (bytes + 63) / 64 * 64));
    if (!p) throw std::bad_alloc();
    return p;
  };
  a.deallocate = [](void* p, size_t) { std::free(p); };
  return a;
}

KvCache::KvCache(KvLayout layout, int64_t budget_bytes, PoolAllocator alloc)
    : layout_(std::move(layout)), alloc_(std::move(alloc)) {
  if (layout_.block_elems <= 0) throw std::invalid_argument("kv cache: a model without layers has no cache");
  num_blocks_ = budget_bytes / layout_.block_bytes();
  if (num_blocks_ < 1)
    throw std::invalid_argument("kv cache: the budget of " + std::to_string(budget_bytes) +
                                " bytes holds no block of " + std::to_string(layout_.block_bytes()) + " bytes");
  if (num_blocks_ > INT32_MAX) num_blocks_ = INT32_MAX;
  pool_bytes_ = size_t(num_blocks_) * size_t(layout_.block_bytes());
  pool_ = alloc_.allocate(pool_bytes_);
  free_.resize(size_t(num_blocks_));
  refs_.assign(size_t(num_blocks_), 0);
  // Block 0 on top of the stack: low addresses first.
  for (int64_t i = 0; i < num_blocks_; ++i) free_[size_t(i)] = int32_t(num_blocks_ - 1 - i);
}

KvCache::~KvCache() {
  if (pool_) alloc_.deallocate(pool_, pool_bytes_);
}

int32_t KvCache::allocate() {
  if (free_.empty()) return -1;
  const int32_t b = free_.back();
  free_.pop_back();
  refs_[size_t(b)] = 1;
  peak_used_ = std::max(peak_used_, num_blocks_ - int64_t(free_.size()));
  return b;
}

void KvCache::share(int32_t block) {
  if (block < 0 || block >= num_blocks_ || refs_[size_t(block)] <= 0)
    throw std::logic_error("kv cache: sharing a block that is not in use");
  ++refs_[size_t(block)];
}

void KvCache::release(int32_t block) {
  if (block < 0 || block >= num_blocks_ || refs_[size_t(block)] <= 0)
    throw std::logic_error("kv cache: releasing a block that is not in use");
  if (--refs_[size_t(block)] == 0) free_.push_back(block);
}


}  // namespace rlh::gen
