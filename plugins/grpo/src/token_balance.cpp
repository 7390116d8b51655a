// Token balancing across data-parallel ranks (see token_balance.hpp).
#include "token_balance.hpp"

#include <algorithm>
#include <cstring>
#include <numeric>

#include "byte_wire.hpp"
#include "rlhost/sdk/plugin.hpp"

namespace rlh::grpo {

int64_t RankAssignment::max_tokens() const { return tokens.empty() ? 0 : *std::max_element(tokens.begin(), tokens.end()); }
int64_t RankAssignment::min_tokens() const { return tokens.empty() ? 0 : *std::min_element(tokens.begin(), tokens.end()); }

RankAssignment assign_longest_first(std::span<const int64_t> lengths, int ranks) {
  RankAssignment a;
  a.owner.assign(lengths.size(), 0);
  a.tokens.assign(static_cast<size_t>(ranks), 0);
  std::vector<size_t> order(lengths.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](size_t x, size_t y) { return lengths[x] > lengths[y]; });
  for (size_t i : order) {
    const auto least = static_cast<int>(std::min_element(a.tokens.begin(), a.tokens.end()) - a.tokens.begin());
    a.owner[i] = least;
    a.tokens[static_cast<size_t>(least)] += lengths[i];
  }
  return a;
}

RankAssignment assign_contiguous(std::span<const int64_t> lengths, std::span<const int64_t> counts) {
  RankAssignment a;
  a.owner.reserve(lengths.size());
  a.tokens.assign(counts.size(), 0);
  size_t i = 0;
  for (size_t r = 0; r < counts.size(); ++r)
    for (int64_t k = 0; k < counts[r] && i < lengths.size(); ++k, ++i) {
      a.owner.push_back(static_cast<int>(r));
      a.tokens[r] += lengths[i];
    }
  if (i != lengths.size()) throw std::logic_error("assign_contiguous: the counts do not cover the sequences");
  return a;
}

RankAssignment assign_balanced(std::span<const int64_t> lengths, std::span<const int64_t> counts) {
  RankAssignment lpt = assign_longest_first(lengths, static_cast<int>(counts.size()));
  RankAssignment plain = assign_contiguous(lengths, counts);
  return plain.max_tokens() < lpt.max_tokens() ? plain : lpt;
}

// ---- the batch as bytes: int64 header, offsets, tokens, then per field: name, frame, data ----


std::vector<uint8_t> serialize_batch(const PackedBatch& b) {
  ByteWriter w;
  const auto fields = b.field_names();
  w.i64(b.num_seqs());
  w.i64(b.num_tokens());
  w.i64(static_cast<int64_t>(fields.size()));
  w.raw(b.offsets().data(), b.offsets().size() * sizeof(int64_t));
  w.raw(b.tokens().data(), b.tokens().size() * sizeof(int32_t));
  for (const auto& [name, frame] : fields) {
    const std::vector<float>& data = *b.find(name);
    w.i64(static_cast<int64_t>(name.size()));
    w.raw(name.data(), name.size());
    w.i64(frame == PackedBatch::Frame::kToken ? 0 : 1);
    w.i64(static_cast<int64_t>(data.size()));
    w.raw(data.data(), data.size() * sizeof(float));
  }
  return std::move(w.out);
}

PackedBatch deserialize_batch(std::span<const uint8_t> bytes, const std::string& from) {
  ByteReader r{bytes, "token balancing: " + from + "'s batch"};
  const int64_t seqs = r.i64(), tokens = r.i64(), nfields = r.i64();
  // Each count is bounded by the bytes left before anything is allocated for it.
  auto fits = [&](int64_t n, size_t each) { r.fits(n, each); };
  fits(seqs + 1, sizeof(int64_t));
  std::vector<int64_t> offsets(static_cast<size_t>(seqs + 1));
  r.raw(offsets.data(), offsets.size() * sizeof(int64_t));
  fits(tokens, sizeof(int32_t));
  std::vector<int32_t> ids(static_cast<size_t>(tokens));
  r.raw(ids.data(), ids.size() * sizeof(int32_t));
  PackedBatch b;
  for (int64_t i = 0; i < seqs; ++i) {
    if (offsets[i] > offsets[i + 1] || offsets[i + 1] > tokens)
      throw sdk::Error(RLH_E_INTERNAL, "token balancing: " + from + "'s batch offsets are malformed");
    b.add_sequence(std::span<const int32_t>(ids.data() + offsets[i], ids.data() + offsets[i + 1]));
  }
  for (int64_t f = 0; f < nfields; ++f) {
    const int64_t len = r.i64();
    fits(len, 1);
    std::string name(static_cast<size_t>(len), '\0');
    r.raw(name.data(), name.size());
    const auto frame = r.i64() == 0 ? PackedBatch::Frame::kToken : PackedBatch::Frame::kSequence;
    const int64_t n = r.i64();
    std::vector<float>& data = b.field(name, frame);
    if (n != static_cast<int64_t>(data.size()))
      throw sdk::Error(RLH_E_INTERNAL, "token balancing: " + from + "'s field " + name + " has the wrong length");
    r.raw(data.data(), data.size() * sizeof(float));
  }
  return b;
}

std::vector<std::vector<uint8_t>> all_gather_bytes(const sdk::Comm& c, const std::vector<uint8_t>& mine) {
  const int n = c.size();
  // Every rank's length, then the bytes padded to the longest.
  std::vector<int64_t> lens(static_cast<size_t>(n), 0);
  lens[static_cast<size_t>(c.rank())] = static_cast<int64_t>(mine.size());
  c.all_reduce(std::span<int64_t>(lens), RLH_REDUCE_SUM);
  const int64_t most = std::max<int64_t>(1, *std::max_element(lens.begin(), lens.end()));
  std::vector<uint8_t> padded(static_cast<size_t>(most), 0), all(static_cast<size_t>(most) * static_cast<size_t>(n));
  std::copy(mine.begin(), mine.end(), padded.begin());
  const int64_t n_in = most, n_out = most * n;
  c.all_gather(sdk::host_tensor(padded.data(), sdk::dtype_of<uint8_t>(), std::span<const int64_t>(&n_in, 1)),
               sdk::host_tensor(all.data(), sdk::dtype_of<uint8_t>(), std::span<const int64_t>(&n_out, 1)));
  std::vector<std::vector<uint8_t>> out(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) {
    const auto* p = all.data() + static_cast<size_t>(r) * static_cast<size_t>(most);
    out[static_cast<size_t>(r)].assign(p, p + lens[static_cast<size_t>(r)]);
  }
  return out;
}

BalancedBatch balance_tokens(const sdk::Comm& c, const PackedBatch& mine, int64_t chunk_seqs) {
  const int n = c.size();
  std::vector<PackedBatch> parts;
  {
    const std::vector<std::vector<uint8_t>> all = all_gather_bytes(c, serialize_batch(mine));
    for (int r = 0; r < n; ++r)
      parts.push_back(deserialize_batch(all[static_cast<size_t>(r)], "rank " + std::to_string(r)));
  }
  const int64_t chunks = (mine.num_seqs() + chunk_seqs - 1) / chunk_seqs;
  for (int r = 0; r < n; ++r)
    if ((parts[static_cast<size_t>(r)].num_seqs() + chunk_seqs - 1) / chunk_seqs != chunks)
      throw sdk::Error(RLH_E_INTERNAL, "token balancing: rank " + std::to_string(r) +
                                           " holds a different number of global batches than rank " +
                                           std::to_string(c.rank()));
  std::vector<const PackedBatch*> views;
  for (const PackedBatch& p : parts) views.push_back(&p);
  BalancedBatch out;
  std::vector<int64_t> tokens(static_cast<size_t>(n), 0), plain(static_cast<size_t>(n), 0);
  std::vector<std::pair<size_t, int64_t>> picks;
  for (int64_t k = 0; k < chunks; ++k) {
    // The chunk's sequences in global order: rank 0's share, rank 1's, ...
    std::vector<std::pair<size_t, int64_t>> seqs;
    std::vector<int64_t> lengths, counts;
    for (int r = 0; r < n; ++r) {
      const PackedBatch& p = parts[static_cast<size_t>(r)];
      const int64_t lo = k * chunk_seqs, hi = std::min(p.num_seqs(), lo + chunk_seqs);
      counts.push_back(hi - lo);
      for (int64_t i = lo; i < hi; ++i) {
        seqs.emplace_back(static_cast<size_t>(r), i);
        lengths.push_back(p.offsets()[i + 1] - p.offsets()[i]);
      }
    }
    const RankAssignment a = assign_balanced(lengths, counts);
    const RankAssignment p = assign_contiguous(lengths, counts);
    for (int r = 0; r < n; ++r) {
      tokens[static_cast<size_t>(r)] += a.tokens[static_cast<size_t>(r)];
      plain[static_cast<size_t>(r)] += p.tokens[static_cast<size_t>(r)];
    }
    out.bounds.push_back(static_cast<int64_t>(picks.size()));
    for (size_t i = 0; i < seqs.size(); ++i)
      if (a.owner[i] == c.rank()) picks.push_back(seqs[i]);
  }
  out.bounds.push_back(static_cast<int64_t>(picks.size()));
  out.batch = PackedBatch::select(views, picks);
  out.max_tokens = *std::max_element(tokens.begin(), tokens.end());
  out.min_tokens = *std::min_element(tokens.begin(), tokens.end());
  out.plain_max_tokens = *std::max_element(plain.begin(), plain.end());
  out.plain_min_tokens = *std::min_element(plain.begin(), plain.end());
  return out;
}

}  // namespace rlh::grpo
