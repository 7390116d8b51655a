// Packed layouts and the token-frame / output-frame alignment (see packing.hpp).
#include "rlhost/losses/packing.hpp"

#include <stdexcept>
#include <string>

namespace rlh::losses {

void validate(const Packing& p) {
  if (p.num_tokens < 0 || p.num_seqs < 0)
    throw std::invalid_argument("packed batch: negative num_tokens or num_seqs");
  if (p.seq_offsets == nullptr) throw std::invalid_argument("packed batch: seq_offsets is null");
  if (p.seq_offsets[0] != 0) throw std::invalid_argument("packed batch: seq_offsets[0] != 0");
  for (int64_t i = 0; i < p.num_seqs; ++i) {
    if (p.seq_offsets[i + 1] < p.seq_offsets[i])
      throw std::invalid_argument("packed batch: seq_offsets decrease at sequence " +
                                  std::to_string(i));
  }
  if (p.seq_offsets[p.num_seqs] != p.num_tokens)
    throw std::invalid_argument("packed batch: seq_offsets[num_seqs] = " +
                                std::to_string(p.seq_offsets[p.num_seqs]) + " != num_tokens = " +
                                std::to_string(p.num_tokens));
}

LossFrame make_loss_frame(const Packing& p) {
  validate(p);
  LossFrame f;
  f.seq_begin.resize(static_cast<size_t>(p.num_seqs) + 1);
  int64_t q = 0;
  for (int64_t i = 0; i < p.num_seqs; ++i) {
    f.seq_begin[i] = q;
    const int64_t b = p.seq_offsets[i], e = p.seq_offsets[i + 1];
    if (e - b >= 2) q += e - b - 1;
  }
  f.seq_begin[p.num_seqs] = q;
  f.out_index.resize(q);
  f.seq.resize(q);
  q = 0;
  for (int64_t i = 0; i < p.num_seqs; ++i) {
    for (int64_t t = p.seq_offsets[i]; t + 1 < p.seq_offsets[i + 1]; ++t, ++q) {
      f.out_index[q] = t;
      f.seq[q] = i;
    }
  }
  return f;
}

std::vector<double> gather_field(const LossFrame& f, const double* field) {
  std::vector<double> out(f.out_index.size());
  for (size_t q = 0; q < out.size(); ++q) out[q] = field[f.out_index[q] + 1];
  return out;
}

std::vector<double> gather_output(const LossFrame& f, const double* output) {
  std::vector<double> out(f.out_index.size());
  for (size_t q = 0; q < out.size(); ++q) out[q] = output[f.out_index[q]];
  return out;
}

void scatter_output(const LossFrame& f, std::span<const double> values, double* output,
                    int64_t num_tokens) {
  for (int64_t t = 0; t < num_tokens; ++t) output[t] = 0;
  for (size_t q = 0; q < f.out_index.size(); ++q) output[f.out_index[q]] = values[q];
}

std::vector<double> to_output_frame(const Packing& p, std::span<const double> token_aligned) {
  validate(p);
  if (static_cast<int64_t>(token_aligned.size()) != p.num_tokens)
    throw std::invalid_argument("to_output_frame: one value per token expected");
  std::vector<double> out(static_cast<size_t>(p.num_tokens), 0.0);
  for (int64_t i = 0; i < p.num_seqs; ++i)
    for (int64_t t = p.seq_offsets[i]; t + 1 < p.seq_offsets[i + 1]; ++t) out[t] = token_aligned[t + 1];
  return out;
}

std::vector<double> to_token_frame(const Packing& p, std::span<const double> output_frame) {
  validate(p);
  if (static_cast<int64_t>(output_frame.size()) != p.num_tokens)
    throw std::invalid_argument("to_token_frame: one value per token expected");
  std::vector<double> tok(static_cast<size_t>(p.num_tokens), 0.0);
  for (int64_t i = 0; i < p.num_seqs; ++i)
    for (int64_t t = p.seq_offsets[i]; t + 1 < p.seq_offsets[i + 1]; ++t) tok[t + 1] = output_frame[t];
  return tok;
}

ValidCounts valid_counts(const Packing& p, const double* token_mask, const double* sample_mask) {
  validate(p);
  ValidCounts c;
  for (int64_t i = 0; i < p.num_seqs; ++i) {
    c.seqs += sample_mask[i];
    double tm = 0;
    for (int64_t t = p.seq_offsets[i] + 1; t < p.seq_offsets[i + 1]; ++t) tm += token_mask[t];
    c.tokens += tm * sample_mask[i];
  }
  return c;
}

std::vector<double> broadcast_to_tokens(const Packing& p, std::span<const double> per_seq) {
  validate(p);
  if (static_cast<int64_t>(per_seq.size()) != p.num_seqs)
    throw std::invalid_argument("broadcast_to_tokens: one value per sequence expected");
  std::vector<double> out(p.num_tokens);
  for (int64_t i = 0; i < p.num_seqs; ++i)
    for (int64_t t = p.seq_offsets[i]; t < p.seq_offsets[i + 1]; ++t) out[t] = per_seq[i];
  return out;
}

}  // namespace rlh::losses
