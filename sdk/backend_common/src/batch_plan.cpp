// ABI batches -> engine micro-batches: validation, grouping sequences into micro-batches (by
// count, by token budget in order, or first-fit-decreasing bins) and slicing the named fields.
#include "rlhost/backend_common/batch_plan.hpp"

#include <algorithm>
#include <climits>
#include <cstring>
#include <numeric>
#include <set>

#include "rlhost/sdk/status.hpp"

namespace rlh::backend {

using sdk::Error;

namespace {

bool host_accessible(const rlh_device& d) {
  return d.device_type == RLH_DEVICE_CPU || d.device_type == RLH_DEVICE_CUDA_HOST ||
         d.device_type == RLH_DEVICE_CUDA_MANAGED;
}

int64_t seq_len(const rlh_batch& b, int64_t s) { return b.seq_offsets[s + 1] - b.seq_offsets[s]; }

// A field is per token when its leading dimension is num_tokens, per sequence when it is
// num_seqs. When the two counts are equal the layout decides only if every sequence holds one
// token (then both readings slice alike); otherwise the field is ambiguous.
bool per_token(const rlh_batch& b, const rlh_named_tensor& f) {
  const int64_t lead = f.tensor.shape[0];
  if (lead == b.num_tokens && lead != b.num_seqs) return true;
  if (lead == b.num_seqs && lead != b.num_tokens) return false;
  for (int64_t s = 0; s < b.num_seqs; ++s)
    if (seq_len(b, s) != 1)
      throw Error(RLH_E_INVALID_ARGUMENT,
                  std::string("batch field '") + f.name + "': its leading dimension " +
                      std::to_string(lead) +
                      " equals both num_tokens and num_seqs, so it cannot be told per-token from "
                      "per-sequence");
  return true;
}

size_t element_bytes(const rlh_dtype& d) { return (size_t(d.bits) * d.lanes + 7) / 8; }

}  // namespace

void validate_batch(const rlh_batch* b, int64_t vocab, int64_t max_positions, bool may_be_empty) {
  if (b == nullptr) throw Error(RLH_E_INVALID_ARGUMENT, "batch is NULL");
  if (b->struct_size < RLH_STRUCT_SIZE(rlh_batch, constraints))
    throw Error(RLH_E_INVALID_ARGUMENT, "rlh_batch: struct_size " + std::to_string(b->struct_size) +
                                            " is smaller than the interface's first version");
  // A data-parallel rank's shard of a global batch may hold nothing (it still takes part).
  if (may_be_empty && b->num_seqs == 0 && b->num_tokens == 0) return;
  if (b->num_seqs < 1 || b->num_tokens < 1)
    throw Error(RLH_E_INVALID_ARGUMENT, "batch has " + std::to_string(b->num_seqs) + " sequences and " +
                                            std::to_string(b->num_tokens) + " tokens; both must be positive");
  if (b->num_tokens > INT32_MAX)
    throw Error(RLH_E_OUT_OF_RANGE, "batch has " + std::to_string(b->num_tokens) + " tokens (at most 2^31-1)");
  if (b->token_ids == nullptr || b->seq_offsets == nullptr)
    throw Error(RLH_E_INVALID_ARGUMENT, "batch: token_ids and seq_offsets must not be NULL");
  if (b->seq_offsets[0] != 0) throw Error(RLH_E_INVALID_ARGUMENT, "batch: seq_offsets[0] must be 0");
  for (int64_t s = 0; s < b->num_seqs; ++s)
    if (b->seq_offsets[s + 1] < b->seq_offsets[s])
      throw Error(RLH_E_INVALID_ARGUMENT, "batch: seq_offsets decrease at sequence " + std::to_string(s));
  if (b->seq_offsets[b->num_seqs] != b->num_tokens)
    throw Error(RLH_E_INVALID_ARGUMENT, "batch: seq_offsets end at " + std::to_string(b->seq_offsets[b->num_seqs]) +
                                            ", not at num_tokens = " + std::to_string(b->num_tokens));
  for (int64_t s = 0; s < b->num_seqs; ++s)
    for (int64_t t = b->seq_offsets[s]; t < b->seq_offsets[s + 1]; ++t)
      if (b->token_ids[t] < 0 || b->token_ids[t] >= vocab)
        throw Error(RLH_E_OUT_OF_RANGE, "token id " + std::to_string(b->token_ids[t]) + " at position " +
                                            std::to_string(t - b->seq_offsets[s]) + " of sequence " +
                                            std::to_string(s) + " is outside the vocabulary (size " +
                                            std::to_string(vocab) + ")");
  // Positions past the model's max_position_embeddings are outside what it was built for (its
  // RoPE scaling, its trained range): scoring them would print numbers without meaning.
  if (max_positions > 0)
    for (int64_t s = 0; s < b->num_seqs; ++s)
      if (seq_len(*b, s) > max_positions)
        throw Error(RLH_E_OUT_OF_RANGE, "sequence " + std::to_string(s) + " has " + std::to_string(seq_len(*b, s)) +
                                            " tokens, more than the model's max_position_embeddings (" +
                                            std::to_string(max_positions) + ")");
  if ((b->constraints & RLH_BATCH_KEEP_PAIRS) && b->num_seqs % 2 != 0)
    throw Error(RLH_E_INVALID_ARGUMENT, "batch: RLH_BATCH_KEEP_PAIRS needs an even number of sequences, got " +
                                            std::to_string(b->num_seqs));
  if (b->num_fields > 0 && b->fields == nullptr) throw Error(RLH_E_INVALID_ARGUMENT, "batch: fields is NULL");
  std::set<std::string> names;
  for (size_t i = 0; i < b->num_fields; ++i) {
    const rlh_named_tensor& f = b->fields[i];
    if (f.name == nullptr) throw Error(RLH_E_INVALID_ARGUMENT, "batch field " + std::to_string(i) + " has no name");
    const std::string name = f.name;
    if (!names.insert(name).second) throw Error(RLH_E_INVALID_ARGUMENT, "batch field '" + name + "' is given twice");
    const rlh_tensor& t = f.tensor;
    if (!host_accessible(t.device))
      throw Error(RLH_E_UNIMPLEMENTED, "batch field '" + name + "': this backend reads host memory, got device type " +
                                           std::to_string(t.device.device_type));
    if (t.ndim < 1 || t.shape == nullptr)
      throw Error(RLH_E_INVALID_ARGUMENT, "batch field '" + name + "': needs a leading dimension");
    if (t.shape[0] != b->num_tokens && t.shape[0] != b->num_seqs)
      throw Error(RLH_E_INVALID_ARGUMENT, "batch field '" + name + "': leading dimension " + std::to_string(t.shape[0]) +
                                              " is neither num_tokens (" + std::to_string(b->num_tokens) +
                                              ") nor num_seqs (" + std::to_string(b->num_seqs) + ")");
    if (t.dtype.bits % 8 != 0 || t.dtype.bits == 0 || t.dtype.lanes == 0)
      throw Error(RLH_E_INVALID_ARGUMENT, "batch field '" + name + "': sub-byte dtypes are not supported");
    int64_t n = 1;
    for (int d = 0; d < t.ndim; ++d) {
      if (t.shape[d] < 0) throw Error(RLH_E_INVALID_ARGUMENT, "batch field '" + name + "': negative dimension");
      n *= t.shape[d];
    }
    if (n > 0 && t.data == nullptr) throw Error(RLH_E_INVALID_ARGUMENT, "batch field '" + name + "': data is NULL");
    per_token(*b, f);  // throws when ambiguous
  }
}

std::vector<MicroBatchPlan> plan_microbatches(const rlh_batch& b, const PlanOptions& o) {
  const bool pairs = (b.constraints & RLH_BATCH_KEEP_PAIRS) != 0;
  const int64_t unit = pairs ? 2 : 1;
  const int64_t num_units = b.num_seqs / unit;
  auto unit_tokens = [&](int64_t u) {
    int64_t n = 0;
    for (int64_t k = 0; k < unit; ++k) n += seq_len(b, u * unit + k);
    return n;
  };
  std::vector<std::vector<int64_t>> groups;  // units per micro-batch
  if (o.max_seqs > 0) {
    const int64_t per = std::max<int64_t>(1, pairs ? o.max_seqs / 2 : o.max_seqs);
    for (int64_t u = 0; u < num_units; u += per) {
      groups.emplace_back();
      for (int64_t v = u; v < std::min(num_units, u + per); ++v) groups.back().push_back(v);
    }
  } else if (o.max_tokens > 0) {
    if (o.first_fit_decreasing) {
      std::vector<int64_t> order(static_cast<size_t>(num_units));
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(),
                       [&](int64_t x, int64_t y) { return unit_tokens(x) > unit_tokens(y); });
      std::vector<int64_t> load;
      for (int64_t u : order) {
        const int64_t n = unit_tokens(u);
        size_t bin = 0;
        while (bin < load.size() && load[bin] + n > o.max_tokens) ++bin;
        if (bin == load.size()) {
          groups.emplace_back();
          load.push_back(0);
        }
        groups[bin].push_back(u);
        load[bin] += n;
      }
      for (auto& g : groups) std::sort(g.begin(), g.end());  // batch order inside a bin
    } else {
      int64_t load = 0;
      for (int64_t u = 0; u < num_units; ++u) {
        const int64_t n = unit_tokens(u);
        if (groups.empty() || (load + n > o.max_tokens && !groups.back().empty())) {
          groups.emplace_back();
          load = 0;
        }
        groups.back().push_back(u);
        load += n;
      }
    }
  } else {
    groups.emplace_back(size_t(num_units));
    std::iota(groups.back().begin(), groups.back().end(), 0);
  }
  std::vector<MicroBatchPlan> out;
  for (const auto& g : groups) {
    MicroBatchPlan p;
    for (int64_t u : g)
      for (int64_t k = 0; k < unit; ++k) {
        p.seqs.push_back(u * unit + k);
        p.num_tokens += seq_len(b, u * unit + k);
      }
    if (p.num_tokens > 0) out.push_back(std::move(p));
  }
  return out;
}

// ---------------------------------------------------------------------------------------------

MicroBatchData::MicroBatchData(const rlh_batch& b, MicroBatchPlan plan)
    : plan_(std::move(plan)), constraints_(b.constraints) {
  offsets64_.push_back(0);
  cu32_.push_back(0);
  for (int64_t s : plan_.seqs) {
    const int64_t begin = b.seq_offsets[s], len = seq_len(b, s);
    batch_begin_.push_back(begin);
    ids_.insert(ids_.end(), b.token_ids + begin, b.token_ids + begin + len);
    offsets64_.push_back(offsets64_.back() + len);
    cu32_.push_back(int32_t(offsets64_.back()));
  }
  // Fields: rows of per-token fields follow the tokens, rows of per-sequence fields the
  // sequences; each copy is contiguous and row-major whatever the source strides were.
  for (size_t i = 0; i < b.num_fields; ++i) {
    const rlh_named_tensor& src = b.fields[i];
    const rlh_tensor& t = src.tensor;
    const bool tok = per_token(b, src);
    Field f;
    f.name = src.name;
    f.dtype = t.dtype;
    f.shape.assign(t.shape, t.shape + t.ndim);
    f.shape[0] = tok ? int64_t(ids_.size()) : int64_t(plan_.seqs.size());
    int64_t inner = 1;
    for (int d = 1; d < t.ndim; ++d) inner *= t.shape[d];
    f.strides.assign(size_t(t.ndim), 1);
    for (int d = t.ndim - 2; d >= 0; --d) f.strides[d] = f.strides[d + 1] * f.shape[d + 1];
    const size_t esize = element_bytes(t.dtype);
    f.bytes.resize(size_t(f.shape[0] * inner) * esize);
    // Source strides (elements); NULL means row-major (DLPack < 1.2 producers).
    std::vector<int64_t> sstr(size_t(t.ndim), 1);
    if (t.strides != nullptr) {
      sstr.assign(t.strides, t.strides + t.ndim);
    } else {
      for (int d = t.ndim - 2; d >= 0; --d) sstr[d] = sstr[d + 1] * t.shape[d + 1];
    }
    bool inner_contiguous = true;
    for (int d = t.ndim - 1, expect = 1; d >= 1; --d) {
      if (t.shape[d] != 1 && sstr[d] != expect) inner_contiguous = false;
      expect *= int(t.shape[d]);
    }
    const auto* base = static_cast<const unsigned char*>(t.data) + t.byte_offset;
    int64_t dst_row = 0;
    auto copy_row = [&](int64_t src_row) {
      unsigned char* dst = f.bytes.data() + size_t(dst_row * inner) * esize;
      const unsigned char* row = base + src_row * sstr[0] * int64_t(esize);
      if (inner_contiguous) {
        std::memcpy(dst, row, size_t(inner) * esize);
      } else {
        for (int64_t e = 0; e < inner; ++e) {  // e as a row-major multi-index over dims 1..
          int64_t rem = e, off = 0;
          for (int d = t.ndim - 1; d >= 1; --d) {
            off += (rem % t.shape[d]) * sstr[d];
            rem /= t.shape[d];
          }
          std::memcpy(dst + size_t(e) * esize, row + off * int64_t(esize), esize);
        }
      }
      ++dst_row;
    };
    for (int64_t s : plan_.seqs) {
      if (tok) {
        for (int64_t r = b.seq_offsets[s]; r < b.seq_offsets[s + 1]; ++r) copy_row(r);
      } else {
        copy_row(s);
      }
    }
    fields_.push_back(std::move(f));
  }
}

engine::MicroBatch MicroBatchData::engine_view() const {
  engine::MicroBatch mb;
  mb.input_ids = ids_;
  mb.cu_seqlens = cu32_;
  for (const Field& f : fields_) {
    rlh_tensor t{};
    t.data = const_cast<unsigned char*>(f.bytes.data());
    t.device = rlh_device{RLH_DEVICE_CPU, 0};
    t.ndim = int32_t(f.shape.size());
    t.dtype = f.dtype;
    t.shape = const_cast<int64_t*>(f.shape.data());
    t.strides = const_cast<int64_t*>(f.strides.data());
    mb.fields.push_back(rlh_named_tensor{f.name.c_str(), t});
  }
  return mb;
}

const rlh_batch& MicroBatchData::abi_batch() {
  named_ = engine_view().fields;
  abi_ = rlh_batch{};
  abi_.struct_size = RLH_STRUCT_SIZE(rlh_batch, constraints);
  abi_.num_tokens = int64_t(ids_.size());
  abi_.num_seqs = int64_t(plan_.seqs.size());
  abi_.token_ids = ids_.data();
  abi_.seq_offsets = offsets64_.data();
  abi_.fields = named_.data();
  abi_.num_fields = named_.size();
  abi_.constraints = constraints_;
  return abi_;
}

}  // namespace rlh::backend
