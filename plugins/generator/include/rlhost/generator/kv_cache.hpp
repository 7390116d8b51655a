// Paged KV cache: a pool of fixed-size blocks under a byte budget, and the block tables that
// give each sequence its blocks (vLLM's PagedAttention layout).
//
// A block holds `block_size` consecutive token positions of one sequence for every layer:
//   block b, layer l:  K [Hkv_l][Dk_l][block_size]  then  V [Hkv_l][block_size][Dv_l]
// Keys and values may differ in width (MLA: Dk = qk_nope + qk_rope, Dv = v_head_dim).
// Heads outermost, so one (query row, kv head) pair of the attention reads contiguous memory.
// On the host keys are stored transposed: the scores of a whole block are then block_size-wide
// vector FMAs over d (q[d] broadcast), with no horizontal sum per key; values stay row-major, as
// the output accumulates whole value rows. A GPU's attention reads keys row-major
// (K [Hkv_l][block_size][Dk_l]: a warp's lanes read one key's dims side by side), and its
// elements are bf16: the layout says which (keys_transposed, elem_bytes), offsets count elements.
// Position p of a sequence lives in block table[p / block_size], slot p % block_size.
//
// Blocks are reference-counted: the samples of one prompt share the blocks that hold only prompt
// tokens (the scheduler's prefix sharing); a block returns to the pool when its last holder
// releases it. Shared blocks are never written again: a sequence writes only positions at or
// after its own first uncomputed token, which lie in blocks of its own.
//
// Memory: on the host the pool is one allocation of the whole budget, made when a generate()
// call starts and freed when it returns, so between rollouts a colocated trainer has the memory
// back (the CPU form of vLLM's sleep/wake of the KV cache). Pages are touched only when a block
// is first written, and freed blocks are reused last-in first-out, so the resident size follows
// the peak number of blocks in use, not the budget. A device executor hands the pool its own
// memory (PoolAllocator).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <vector>

namespace rlh::gen {

struct KvLayout {
  int64_t block_size = 16;
  std::vector<int64_t> kv_heads, head_dim;  // per layer: heads, key width Dk
  std::vector<int64_t> value_dim;           // per layer: value width Dv
  std::vector<int64_t> offset;              // per layer: elements from the block start to its K
  int64_t block_elems = 0;                  // elements per block, all layers, K and V
  bool keys_transposed = true;              // K [Hkv][Dk][bs] (host) or [Hkv][bs][Dk] (GPU)
  int64_t elem_bytes = 4;                   // float32 (host), bf16 (GPU) or FP8 e4m3 (kv_cache_dtype fp8)

  // The layout for layers with these (Hkv, Dk, Dv); value_dim empty = Dv equal to Dk;
  // block_size >= 1.
  static KvLayout make(int64_t block_size, std::vector<int64_t> kv_heads, std::vector<int64_t> head_dim,
                       std::vector<int64_t> value_dim = {}, bool keys_transposed = true, int64_t elem_bytes = 4);
  int64_t block_bytes() const { return block_elems * elem_bytes; }
};

// Memory for the pool: the host's allocation service in the plugin, aligned_alloc otherwise.
struct PoolAllocator {
  std::function<void*(size_t)> allocate;        // 64-byte aligned; throws on failure
  std::function<void(void*, size_t)> deallocate;
  static PoolAllocator aligned_heap();
};

class KvCache {
 public:
  // Holds budget_bytes / block_bytes blocks (at least one).
  KvCache(KvLayout layout, int64_t budget_bytes, PoolAllocator alloc = PoolAllocator::aligned_heap());
  ~KvCache();
  KvCache(const KvCache&) = delete;
  KvCache& operator=(const KvCache&) = delete;

  const KvLayout& layout() const { return layout_; }
  int64_t num_blocks() const { return num_blocks_; }
  int64_t num_free() const { return int64_t(free_.size()); }
  int64_t peak_used() const { return peak_used_; }

  // A free block id (one reference), or -1 when the pool is exhausted.
  int32_t allocate();
  // Another reference to a block in use.
  void share(int32_t block);
  // Drops a reference; the block is free again after the last one.
  void release(int32_t block);

  // Keys of `layer` in `block`: [Hkv][Dk][block_size]; values: [Hkv][block_size][Dv] (a
  // float32 layout; pool() and the layout's offsets otherwise).
  float* keys(int32_t block, int64_t layer) {
    return static_cast<float*>(pool_) + int64_t(block) * layout_.block_elems + layout_.offset[size_t(layer)];
  }
  float* values(int32_t block, int64_t layer) {
    return keys(block, layer) +
           layout_.kv_heads[size_t(layer)] * layout_.block_size * layout_.head_dim[size_t(layer)];
  }
  // The same as bytes, for any element size (an FP8 cache's codes).
  uint8_t* keys_bytes(int32_t block, int64_t layer) {
    return static_cast<uint8_t*>(pool_) +
           (int64_t(block) * layout_.block_elems + layout_.offset[size_t(layer)]) * layout_.elem_bytes;
  }
  uint8_t* values_bytes(int32_t block, int64_t layer) {
    return keys_bytes(block, layer) + layout_.kv_heads[size_t(layer)] * layout_.block_size *
                                          layout_.head_dim[size_t(layer)] * layout_.elem_bytes;
  }
  void* pool() const { return pool_; }

 private:
  KvLayout layout_;
  PoolAllocator alloc_;
  int64_t num_blocks_ = 0;
  size_t pool_bytes_ = 0;
  void* pool_ = nullptr;
  std::vector<int32_t> free_;  // a stack: the most recently freed block is handed out first
  std::vector<int32_t> refs_;  // references per block (0 = free)
  int64_t peak_used_ = 0;
};

// A row of a step: one token of one sequence at position `pos`.
struct CacheRow {
  const int32_t* blocks = nullptr;  // the sequence's block table
  int32_t pos = 0;                  // the row's position in its sequence
};

}  // namespace rlh::gen
