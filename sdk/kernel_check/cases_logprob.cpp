// Cases of the fused logprob head (linear_logprob_fwd / _bwd): plain, tempered, chunked over the
// vocabulary, several targets per token (top-k distillation ids, repeats, absent targets), and
// the processed-logprob filters (top-k, top-p, both; a flat distribution whose top-p cut lies
// deep in the candidates).
#include <cstdio>
#include <string>

#include "cases.hpp"

namespace rlh::sdk::kcheck {
namespace {

struct Opts {
  double temperature = 1.0;
  int64_t top_k = 0;
  double top_p = 1.0;
  int64_t chunk_bytes = 0;
  double softcap = 0;  // Gemma-2's final_logit_softcapping (the attribute only when set)
};

Case logprob_case(const char* label, int64_t N, int64_t C, int64_t V, Opts o, bool want_entropy,
                  int64_t K = 1) {
  Case c;
  char b[160];
  std::snprintf(b, sizeof(b), " N=%lld C=%lld V=%lld K=%lld temperature=%g top_k=%lld top_p=%g chunk_bytes=%lld",
                (long long)N, (long long)C, (long long)V, (long long)K, o.temperature, (long long)o.top_k,
                o.top_p, (long long)o.chunk_bytes);
  c.name = std::string("linear_logprob ") + label + b + (want_entropy ? " entropy" : "") +
           (o.softcap > 0 ? " softcap=" + std::to_string(o.softcap) : "");
  // K targets per token: the first like a next token, the rest like distillation ids, with a
  // repeat (gradients add) and absent ones (-1: logprob 0, no gradient).
  std::vector<int32_t> target(size_t(N * K));
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k)
      target[size_t(n * K + k)] = int32_t(k == 0 ? (n * 37 + 11) % V : (n * 13 + k * 29 + 3) % V);
  target[size_t(1 * K)] = -1;
  if (N > 5) target[size_t(5 * K)] = -1;
  if (K > 2) {
    target[size_t(2 * K + 2)] = target[size_t(2 * K + 1)];
    target[size_t(3 * K + 1)] = -1;
  }
  const std::vector<int64_t> tshape = K == 1 ? std::vector<int64_t>{N} : std::vector<int64_t>{N, K};
  c.in_sizes = {N * C, V * C};
  c.in_scale = {1, 1};
  c.out_sizes = {N * K, N, N};  // logprob [N,K], lse, entropy
  c.ints = {IntBuf{target, tshape}};
  std::vector<Attr> attrs = {attr_d("temperature", o.temperature), attr_i("top_k", o.top_k),
                             attr_d("top_p", o.top_p), attr_i("chunk_bytes", o.chunk_bytes)};
  if (o.softcap > 0) attrs.push_back(attr_d("softcap", o.softcap));
  c.fwd = {"linear_logprob_fwd",
           {in(0, contiguous({N, C})), in(1, contiguous({V, C})), ints(0, tshape)},
           {out(0, contiguous(tshape)), out(1, contiguous({N}))},
           attrs,
           {},
           {}};
  if (want_entropy) c.fwd.outputs.push_back(out(2, contiguous({N})));
  c.bwd = {"linear_logprob_bwd",
           {in(0, contiguous({N, C})), in(1, contiguous({V, C})), ints(0, tshape), saved(1, contiguous({N})),
            gout(0, contiguous(tshape))},
           {gin(0, contiguous({N, C})), gin(1, contiguous({V, C}))},
           attrs,
           {},
           {1}};  // dW +=
  if (want_entropy) {
    c.bwd.inputs.push_back(saved(2, contiguous({N})));
    c.bwd.inputs.push_back(gout(2, contiguous({N})));
  }
  return c;
}

}  // namespace

void add_logprob_cases(std::vector<Case>& v) {
  Opts o;
  v.push_back(logprob_case("plain", 9, 12, 50, o, false));
  o.temperature = 0.7;
  o.chunk_bytes = 256;  // several vocabulary chunks and row blocks
  v.push_back(logprob_case("chunked", 9, 12, 50, o, true));
  o.temperature = 1.1;
  o.chunk_bytes = 1200;  // one token per block and several vocabulary chunks
  v.push_back(logprob_case("blocked", 9, 12, 600, o, true));
  v.push_back(logprob_case("at ids", 9, 12, 600, o, true, 4));  // top-k distillation targets
  o = Opts{};
  o.softcap = 1.5;  // Gemma-2's final soft-cap, small enough to bend the logits
  o.temperature = 0.8;
  o.chunk_bytes = 256;
  v.push_back(logprob_case("softcap", 9, 12, 50, o, true));
  o = Opts{};
  o.temperature = 0.9;
  o.top_k = 7;
  v.push_back(logprob_case("top_k", 9, 12, 50, o, true));
  o = Opts{};
  o.top_p = 0.8;
  v.push_back(logprob_case("top_p", 9, 12, 50, o, true));
  o.temperature = 1.3;
  o.top_k = 10;
  o.top_p = 0.9;
  o.chunk_bytes = 1024;
  v.push_back(logprob_case("top_k+top_p", 9, 12, 50, o, true));
  v.push_back(logprob_case("top_k+top_p at ids", 9, 12, 50, o, true, 3));
  o = Opts{};
  o.temperature = 4.0;  // flat: the top-p cut lies beyond the first slices of candidates
  o.top_p = 0.95;
  v.push_back(logprob_case("top_p wide", 9, 12, 600, o, true));
}

}  // namespace rlh::sdk::kcheck
