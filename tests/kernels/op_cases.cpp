// The op cases (see op_cases.hpp). Each case = kernel calls at both precisions (one generic
// lambda), a float64 oracle written as the plain formula, and the ABI form of the call.
#include "op_cases.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <type_traits>

#include "rlhost/kernels_cpu/kernels.hpp"

namespace rlh::kcpu::testing {
namespace {

// The element type of a Bufs<T> argument inside a generic lambda.
template <class B>
using elem_t = std::decay_t<decltype(std::declval<B>()[0][0])>;

// Sets fwd32/fwd64 (and bwd32/bwd64) of a case from one generic lambda each.
template <class F>
void set_fwd(OpCase& c, F f) {
  c.fwd32 = f;
  c.fwd64 = f;
}
template <class F>
void set_bwd(OpCase& c, F f) {
  c.bwd32 = f;
  c.bwd64 = f;
}

// ---------------------------------------------------------------------------------------------
// gemm

OpCase gemm_case(bool ta, bool tb, int64_t M, int64_t N, int64_t K, double alpha, double beta,
                 int64_t pad) {
  OpCase c;
  c.name = "gemm ta=" + std::to_string(ta) + " tb=" + std::to_string(tb) + " M=" +
           std::to_string(M) + " N=" + std::to_string(N) + " K=" + std::to_string(K) +
           " beta=" + std::to_string(beta) + " pad=" + std::to_string(pad);
  const int64_t arows = ta ? K : M, acols = ta ? M : K, lda = acols + pad;
  const int64_t brows = tb ? N : K, bcols = tb ? K : N, ldb = bcols;
  c.in_sizes = {arows * lda, brows * ldb, M * N};
  c.in_grad = {true, true, true};
  c.in_scale = {1, 1, 1};
  c.out_sizes = {M * N};
  c.out_loss = {true};
  set_fwd(c, [=](const auto& in, auto& out) {
    using T = elem_t<decltype(in)>;
    out[0] = in[2];
    gemm<T>(ta, tb, M, N, K, T(alpha), in[0].data(), lda, in[1].data(), ldb, T(beta),
            out[0].data(), N);
  });
  // dA = alpha dC op(B)^T (or its transpose), dB = alpha op(A)^T dC (or its transpose),
  // dC0 = beta dC: the patterns the engine's linear layers use.
  set_bwd(c, [=](const auto& in, const auto&, const auto& dout, auto& din) {
    using T = elem_t<decltype(in)>;
    const T* A = in[0].data();
    const T* B = in[1].data();
    const T* dC = dout[0].data();
    const T a = T(alpha);
    if (!ta)
      gemm<T>(false, !tb, M, K, N, a, dC, N, B, ldb, T(0), din[0].data(), lda);
    else
      gemm<T>(tb, true, K, M, N, a, B, ldb, dC, N, T(0), din[0].data(), lda);
    if (!tb)
      gemm<T>(!ta, false, K, N, M, a, A, lda, dC, N, T(0), din[1].data(), ldb);
    else
      gemm<T>(true, ta, N, K, M, a, dC, N, A, lda, T(0), din[1].data(), ldb);
    for (int64_t i = 0; i < M * N; ++i) din[2][i] = T(beta) * dC[i];
  });
  c.ref64 = [=](const Bufs<double>& in, Bufs<double>& out) {
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) {
        double acc = 0;
        for (int64_t p = 0; p < K; ++p)
          acc += (ta ? in[0][p * lda + i] : in[0][i * lda + p]) *
                 (tb ? in[1][j * ldb + p] : in[1][p * ldb + j]);
        out[0][i * N + j] = alpha * acc + beta * in[2][i * N + j];
      }
  };
  c.fwd_tol = 1e-6;
  return c;
}

OpCase gemm_batched_case() {
  OpCase c;
  const int64_t batch = 3, M = 5, N = 6, K = 7;
  c.name = "gemm batched 3x[5x7 @ (6x7)^T]";
  c.in_sizes = {batch * M * K, batch * N * K};
  c.in_grad = {false, false};
  c.in_scale = {1, 1};
  c.out_sizes = {batch * M * N};
  c.out_loss = {true};
  set_fwd(c, [=](const auto& in, auto& out) {
    using T = elem_t<decltype(in)>;
    gemm_batched<T>(false, true, M, N, K, T(1), in[0].data(), K, M * K, in[1].data(), K, N * K,
                    T(0), out[0].data(), N, M * N, batch);
  });
  c.ref64 = [=](const Bufs<double>& in, Bufs<double>& out) {
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t i = 0; i < M; ++i)
        for (int64_t j = 0; j < N; ++j) {
          double acc = 0;
          for (int64_t p = 0; p < K; ++p)
            acc += in[0][b * M * K + i * K + p] * in[1][b * N * K + j * K + p];
          out[0][b * M * N + i * N + j] = acc;
        }
  };
  return c;
}

// ---------------------------------------------------------------------------------------------
// embedding

OpCase embedding_case() {
  OpCase c;
  const int64_t V = 11, C = 13;
  const std::vector<int32_t> ids = {3, 0, 10, 3, 3, 7, 1, 0, 5};
  const int64_t N = int64_t(ids.size());
  c.name = "embedding V=11 C=13 N=9 (repeated ids)";
  c.in_sizes = {V * C};
  c.in_grad = {true};
  c.in_scale = {1};
  c.out_sizes = {N * C};
  c.out_loss = {true};
  c.ints = {IntOperand{ids, {N}}};
  set_fwd(c, [=](const auto& in, auto& out) {
    using T = elem_t<decltype(in)>;
    embedding_fwd<T>(out[0].data(), ids.data(), in[0].data(), N, C, V);
  });
  set_bwd(c, [=](const auto&, const auto&, const auto& dout, auto& din) {
    using T = elem_t<decltype(dout)>;
    embedding_bwd<T>(din[0].data(), ids.data(), dout[0].data(), N, C, V);
  });
  c.ref64 = [=](const Bufs<double>& in, Bufs<double>& out) {
    for (int64_t n = 0; n < N; ++n)
      for (int64_t j = 0; j < C; ++j) out[0][n * C + j] = in[0][ids[n] * C + j];
  };
  return c;
}

// ---------------------------------------------------------------------------------------------
// rmsnorm

OpCase rmsnorm_case(int64_t N, int64_t C, double w_offset, int64_t ldx, int64_t ldy) {
  OpCase c;
  const double eps = 1e-5;
  c.name = "rmsnorm N=" + std::to_string(N) + " C=" + std::to_string(C) +
           " w_offset=" + std::to_string(w_offset) + " ldx=" + std::to_string(ldx) +
           " ldy=" + std::to_string(ldy);
  c.in_sizes = {N * ldx, C};
  c.in_grad = {true, true};
  c.in_scale = {1, 0.5};
  c.out_sizes = {N * ldy, N};
  c.out_loss = {true, false};
  set_fwd(c, [=](const auto& in, auto& out) {
    using T = elem_t<decltype(in)>;
    rmsnorm_fwd<T>(out[0].data(), ldy, out[1].data(), in[0].data(), ldx, in[1].data(), N, C,
                   T(eps), T(w_offset));
  });
  set_bwd(c, [=](const auto& in, const auto& out, const auto& dout, auto& din) {
    using T = elem_t<decltype(in)>;
    rmsnorm_bwd<T>(din[0].data(), ldx, din[1].data(), dout[0].data(), ldy, in[0].data(), ldx,
                   in[1].data(), out[1].data(), N, C, T(w_offset), false);
  });
  c.ref64 = [=](const Bufs<double>& in, Bufs<double>& out) {
    for (int64_t n = 0; n < N; ++n) {
      double ms = 0;
      for (int64_t j = 0; j < C; ++j) ms += in[0][n * ldx + j] * in[0][n * ldx + j];
      const double r = 1.0 / std::sqrt(ms / double(C) + eps);
      for (int64_t j = 0; j < C; ++j)
        out[0][n * ldy + j] = in[0][n * ldx + j] * r * (in[1][j] + w_offset);
    }
  };
  return c;
}

// ---------------------------------------------------------------------------------------------
// rope

OpCase rope_case(int64_t H, int64_t D, int64_t R, bool interleaved, double scale, int64_t ld) {
  OpCase c;
  const std::vector<int32_t> pos = {0, 1, 7, 100, 4095, 33};
  const int64_t N = int64_t(pos.size());
  std::vector<float> inv_freq(R / 2);
  for (int64_t i = 0; i < R / 2; ++i) inv_freq[i] = float(std::pow(10000.0, -2.0 * i / R));
  c.name = "rope H=" + std::to_string(H) + " D=" + std::to_string(D) + " R=" + std::to_string(R) +
           (interleaved ? " interleaved" : " half_split") + " scale=" + std::to_string(scale) +
           " ld=" + std::to_string(ld);
  c.in_sizes = {N * ld};
  c.in_grad = {true};
  c.in_scale = {1};
  c.out_sizes = {N * ld};
  c.out_loss = {true};
  c.ints = {IntOperand{pos, {N}}};
  set_fwd(c, [=](const auto& in, auto& out) {
    using T = elem_t<decltype(in)>;
    rope_fwd<T>(out[0].data(), ld, in[0].data(), ld, pos.data(), inv_freq.data(), N, H, D, R,
                scale, interleaved);
  });
  set_bwd(c, [=](const auto&, const auto&, const auto& dout, auto& din) {
    using T = elem_t<decltype(dout)>;
    rope_bwd<T>(din[0].data(), ld, dout[0].data(), ld, pos.data(), inv_freq.data(), N, H, D, R,
                scale, interleaved);
  });
  // Oracle: the rotation written per pair, angles formed as HF forms them (float32 product).
  c.ref64 = [=](const Bufs<double>& in, Bufs<double>& out) {
    for (int64_t n = 0; n < N; ++n)
      for (int64_t h = 0; h < H; ++h) {
        const double* x = in[0].data() + n * ld + h * D;
        double* y = out[0].data() + n * ld + h * D;
        for (int64_t d = 0; d < D; ++d) y[d] = x[d];
        for (int64_t i = 0; i < R / 2; ++i) {
          const double angle = double(inv_freq[i] * float(pos[n]));
          const double cs = std::cos(angle) * scale, sn = std::sin(angle) * scale;
          const int64_t a = interleaved ? 2 * i : i, b = interleaved ? 2 * i + 1 : i + R / 2;
          y[a] = x[a] * cs - x[b] * sn;
          y[b] = x[b] * cs + x[a] * sn;
        }
      }
  };
  return c;
}

// ---------------------------------------------------------------------------------------------
// attention

struct AttnShape {
  std::vector<int32_t> cu;
  int64_t Hq, Hkv, Dk, Dv, window;
  int64_t pad = 0;  // extra elements per token row of q/k/v/o (as when read out of fused qkv)
  double softcap = 0;  // Gemma-2's attn_logit_softcapping
};

OpCase attention_case(const AttnShape& a) {
  OpCase c;
  const int64_t S = int64_t(a.cu.size()) - 1, N = a.cu.back();
  const int64_t Hq = a.Hq, Hkv = a.Hkv, Dk = a.Dk, Dv = a.Dv, W = a.window;
  const int64_t ldq = Hq * Dk + a.pad, ldk = Hkv * Dk + a.pad, ldv = Hkv * Dv + a.pad,
                ldo = Hq * Dv + a.pad;
  const double scale = 1.0 / std::sqrt(double(Dk));
  const std::vector<int32_t> cu = a.cu;
  c.name = "attention S=" + std::to_string(S) + " N=" + std::to_string(N) +
           " Hq=" + std::to_string(Hq) + " Hkv=" + std::to_string(Hkv) +
           " Dk=" + std::to_string(Dk) + " Dv=" + std::to_string(Dv) +
           " window=" + std::to_string(W) + " pad=" + std::to_string(a.pad) +
           (a.softcap > 0 ? " softcap=" + std::to_string(a.softcap) : "");
  const double cap = a.softcap;
  c.in_sizes = {N * ldq, N * ldk, N * ldv};
  c.in_grad = {true, true, true};
  c.in_scale = {1.5, 1.5, 1};
  c.out_sizes = {N * ldo, Hq * N};
  c.out_loss = {true, false};
  c.ints = {IntOperand{cu, {S + 1}}};
  set_fwd(c, [=](const auto& in, auto& out) {
    using T = elem_t<decltype(in)>;
    attention_fwd<T>(out[0].data(), ldo, out[1].data(), in[0].data(), ldq, in[1].data(), ldk,
                     in[2].data(), ldv, cu.data(), S, N, Hq, Hkv, Dk, Dv, T(scale), W,
                     scratch_default(), T(cap));
  });
  set_bwd(c, [=](const auto& in, const auto& out, const auto& dout, auto& din) {
    using T = elem_t<decltype(in)>;
    attention_bwd<T>(din[0].data(), ldq, din[1].data(), ldk, din[2].data(), ldv, dout[0].data(),
                     ldo, in[0].data(), ldq, in[1].data(), ldk, in[2].data(), ldv, out[0].data(),
                     ldo, out[1].data(), cu.data(), S, N, Hq, Hkv, Dk, Dv, T(scale), W,
                     scratch_default(), T(cap));
  });
  // Oracle: the full masked score row per query, softmax, weighted sum.
  c.ref64 = [=](const Bufs<double>& in, Bufs<double>& out) {
    for (int64_t s = 0; s < S; ++s)
      for (int64_t h = 0; h < Hq; ++h) {
        const int64_t g = h / (Hq / Hkv);
        for (int64_t i = cu[s]; i < cu[s + 1]; ++i) {
          std::vector<double> p(N, 0.0);
          double mx = -INFINITY;
          for (int64_t j = cu[s]; j <= i; ++j) {
            if (W > 0 && i - j >= W) continue;
            double dot = 0;
            for (int64_t d = 0; d < Dk; ++d)
              dot += in[0][i * ldq + h * Dk + d] * in[1][j * ldk + g * Dk + d];
            p[j] = cap > 0 ? cap * std::tanh(dot * scale / cap) : dot * scale;
            mx = std::max(mx, p[j]);
          }
          double sum = 0;
          for (int64_t j = cu[s]; j <= i; ++j) {
            if (W > 0 && i - j >= W) {
              p[j] = 0;
              continue;
            }
            p[j] = std::exp(p[j] - mx);
            sum += p[j];
          }
          for (int64_t d = 0; d < Dv; ++d) {
            double acc = 0;
            for (int64_t j = cu[s]; j <= i; ++j) acc += p[j] / sum * in[2][j * ldv + g * Dv + d];
            out[0][i * ldo + h * Dv + d] = acc;
          }
        }
      }
  };
  return c;
}

// ---------------------------------------------------------------------------------------------
// swiglu, bias, add

OpCase swiglu_case() {
  OpCase c;
  const int64_t N = 7, F = 19, ldg = F + 2, ldu = F, ldh = F;
  c.name = "swiglu N=7 F=19 ldg=21";
  c.in_sizes = {N * ldg, N * ldu};
  c.in_grad = {true, true};
  c.in_scale = {2, 1};
  c.out_sizes = {N * ldh};
  c.out_loss = {true};
  set_fwd(c, [=](const auto& in, auto& out) {
    using T = elem_t<decltype(in)>;
    swiglu_fwd<T>(out[0].data(), ldh, in[0].data(), ldg, in[1].data(), ldu, N, F);
  });
  set_bwd(c, [=](const auto& in, const auto&, const auto& dout, auto& din) {
    using T = elem_t<decltype(in)>;
    swiglu_bwd<T>(din[0].data(), ldg, din[1].data(), ldu, dout[0].data(), ldh, in[0].data(), ldg,
                  in[1].data(), ldu, N, F);
  });
  c.ref64 = [=](const Bufs<double>& in, Bufs<double>& out) {
    for (int64_t n = 0; n < N; ++n)
      for (int64_t f = 0; f < F; ++f) {
        const double g = in[0][n * ldg + f];
        out[0][n * ldh + f] = g / (1 + std::exp(-g)) * in[1][n * ldu + f];
      }
  };
  return c;
}

// geglu in its tanh (Gemma) and exact forms.
OpCase geglu_case(bool tanh_form) {
  OpCase c;
  const int64_t N = 6, F = 23, ldg = F + 3, ldu = F, ldh = F;
  c.name = std::string("geglu ") + (tanh_form ? "tanh" : "erf") + " N=6 F=23 ldg=26";
  c.in_sizes = {N * ldg, N * ldu};
  c.in_grad = {true, true};
  c.in_scale = {2, 1};
  c.out_sizes = {N * ldh};
  c.out_loss = {true};
  set_fwd(c, [=](const auto& in, auto& out) {
    using T = elem_t<decltype(in)>;
    geglu_fwd<T>(out[0].data(), ldh, in[0].data(), ldg, in[1].data(), ldu, N, F, tanh_form);
  });
  set_bwd(c, [=](const auto& in, const auto&, const auto& dout, auto& din) {
    using T = elem_t<decltype(in)>;
    geglu_bwd<T>(din[0].data(), ldg, din[1].data(), ldu, dout[0].data(), ldh, in[0].data(), ldg,
                 in[1].data(), ldu, N, F, tanh_form);
  });
  c.ref64 = [=](const Bufs<double>& in, Bufs<double>& out) {  // torch's formulas
    const double pi = 3.14159265358979323846;
    for (int64_t n = 0; n < N; ++n)
      for (int64_t f = 0; f < F; ++f) {
        const double g = in[0][n * ldg + f];
        const double gelu = tanh_form ? 0.5 * g * (1 + std::tanh(std::sqrt(2 / pi) * (g + 0.044715 * g * g * g)))
                                      : 0.5 * g * (1 + std::erf(g / std::sqrt(2.0)));
        out[0][n * ldh + f] = gelu * in[1][n * ldu + f];
      }
  };
  return c;
}

OpCase bias_case() {
  OpCase c;
  const int64_t N = 6, M = 21, ld = M + 3;
  c.name = "bias_add N=6 M=21 ld=24";
  c.in_sizes = {N * ld, M};
  c.in_grad = {true, true};
  c.in_scale = {1, 1};
  c.out_sizes = {N * ld};
  c.out_loss = {true};
  set_fwd(c, [=](const auto& in, auto& out) {
    using T = elem_t<decltype(in)>;
    out[0] = in[0];
    bias_add_fwd<T>(out[0].data(), ld, in[1].data(), N, M);
  });
  set_bwd(c, [=](const auto&, const auto&, const auto& dout, auto& din) {
    using T = elem_t<decltype(dout)>;
    din[0] = dout[0];  // y = y0 + b: the identity for y0, padding included
    bias_bwd<T>(din[1].data(), dout[0].data(), ld, N, M);
  });
  c.ref64 = [=](const Bufs<double>& in, Bufs<double>& out) {
    out[0] = in[0];
    for (int64_t n = 0; n < N; ++n)
      for (int64_t m = 0; m < M; ++m) out[0][n * ld + m] += in[1][m];
  };
  return c;
}

OpCase add_case() {
  OpCase c;
  const int64_t n = 1000;
  c.name = "add n=1000";
  c.in_sizes = {n, n};
  c.in_grad = {true, true};
  c.in_scale = {1, 1};
  c.out_sizes = {n};
  c.out_loss = {true};
  set_fwd(c, [=](const auto& in, auto& out) {
    using T = elem_t<decltype(in)>;
    add_fwd<T>(out[0].data(), in[0].data(), in[1].data(), n);
  });
  set_bwd(c, [=](const auto&, const auto&, const auto& dout, auto& din) {
    din[0] = dout[0];
    din[1] = dout[0];
  });
  c.ref64 = [=](const Bufs<double>& in, Bufs<double>& out) {
    for (int64_t i = 0; i < n; ++i) out[0][i] = in[0][i] + in[1][i];
  };
  return c;
}

// ---------------------------------------------------------------------------------------------
// linear_logprob

// vLLM's apply_top_k_top_p written out literally (ascending sort, cumulative sum, <= 1 - p),
// an oracle independent of the kernel's threshold formulation. Filtered entries become -inf.
void filter_literal(std::vector<double>& z, int64_t top_k, double top_p) {
  const int64_t V = int64_t(z.size());
  std::vector<int64_t> idx(V);
  std::iota(idx.begin(), idx.end(), 0);
  std::stable_sort(idx.begin(), idx.end(), [&](int64_t a, int64_t b) { return z[a] < z[b]; });
  std::vector<double> srt(V);
  for (int64_t i = 0; i < V; ++i) srt[i] = z[idx[i]];
  if (top_k > 0 && top_k < V) {
    const double kth = srt[V - top_k];
    for (auto& x : srt)
      if (x < kth) x = -INFINITY;
  }
  if (top_p < 1.0) {
    const double mx = srt[V - 1];
    double total = 0;
    for (double x : srt) total += std::exp(x - mx);
    double cum = 0;
    std::vector<bool> drop(V);
    for (int64_t i = 0; i < V; ++i) {
      cum += std::exp(srt[i] - mx) / total;
      drop[i] = cum <= 1 - top_p;
    }
    drop[V - 1] = false;
    for (int64_t i = 0; i < V; ++i)
      if (drop[i]) srt[i] = -INFINITY;
  }
  for (int64_t i = 0; i < V; ++i) z[idx[i]] = srt[i];
}

OpCase logprob_case(const char* label, int64_t N, int64_t C, int64_t V, LogprobOpts o,
                    bool want_entropy, int64_t K = 1) {
  OpCase c;
  c.name = std::string("linear_logprob ") + label + " N=" + std::to_string(N) +
           " C=" + std::to_string(C) + " V=" + std::to_string(V) + " K=" + std::to_string(K) +
           " temperature=" + std::to_string(o.temperature) + " top_k=" + std::to_string(o.top_k) +
           " top_p=" + std::to_string(o.top_p) + " chunk_bytes=" + std::to_string(o.chunk_bytes) +
           (o.softcap > 0 ? " softcap=" + std::to_string(o.softcap) : "") + (want_entropy ? " entropy" : "");
  // K targets per token (the first like a next token, the rest like distillation ids, with a
  // repeat and some absent ones).
  std::vector<int32_t> target(N * K);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k)
      target[n * K + k] = int32_t(k == 0 ? (n * 37 + 11) % V : (n * 13 + k * 29 + 3) % V);
  target[1 * K] = -1;
  if (N > 5) target[5 * K] = -1;
  if (K > 2) {
    target[2 * K + 2] = target[2 * K + 1];  // the same id twice: gradients add
    target[3 * K + 1] = -1;
  }
  const std::vector<int64_t> tshape = K == 1 ? std::vector<int64_t>{N} : std::vector<int64_t>{N, K};
  c.in_sizes = {N * C, V * C};
  c.in_grad = {true, true};
  c.in_scale = {1, 1};
  c.out_sizes = {N * K, N, N};  // logprob [N,K], lse, entropy
  c.out_loss = {true, false, want_entropy};
  c.ints = {IntOperand{target, tshape}};
  set_fwd(c, [=](const auto& in, auto& out) {
    using T = elem_t<decltype(in)>;
    linear_logprob_fwd<T>(out[0].data(), out[1].data(), want_entropy ? out[2].data() : nullptr,
                          in[0].data(), in[1].data(), target.data(), N, C, V, K, o,
                          scratch_default());
  });
  set_bwd(c, [=](const auto& in, const auto& out, const auto& dout, auto& din) {
    using T = elem_t<decltype(in)>;
    linear_logprob_bwd<T>(din[0].data(), din[1].data(), dout[0].data(),
                          want_entropy ? dout[2].data() : nullptr, in[0].data(), in[1].data(),
                          target.data(), out[1].data(), want_entropy ? out[2].data() : nullptr, N,
                          C, V, K, o, false, scratch_default());
  });
  c.ref64 = [=](const Bufs<double>& in, Bufs<double>& out) {
    for (int64_t n = 0; n < N; ++n) {
      std::vector<double> z(V);
      for (int64_t v = 0; v < V; ++v) {
        double acc = 0;
        for (int64_t k = 0; k < C; ++k) acc += in[0][n * C + k] * in[1][v * C + k];
        z[v] = (o.softcap > 0 ? o.softcap * std::tanh(acc / o.softcap) : acc) / o.temperature;
      }
      filter_literal(z, o.top_k, o.top_p);
      double mx = -INFINITY;
      for (double x : z) mx = std::max(mx, x);
      double sum = 0;
      for (double x : z) sum += std::exp(x - mx);
      const double lse = mx + std::log(sum);
      for (int64_t k = 0; k < K; ++k) {
        const int32_t t = target[n * K + k];
        out[0][n * K + k] = t < 0 ? 0.0 : z[t] - lse;
      }
      if (want_entropy) {
        double h = 0;
        for (double x : z)
          if (x > -INFINITY) h -= std::exp(x - lse) * (x - lse);
        out[2][n] = h;
      }
    }
  };
  c.fwd_tol = 5e-6;
  return c;
}

// ---------------------------------------------------------------------------------------------
// Optimizer ops (forward only: no gradient)

OpCase adamw_case(int64_t n, bool zero_grad) {
  OpCase c;
  AdamWOpts o;
  o.lr = 1e-2;
  o.beta1 = 0.9;
  o.beta2 = 0.95;
  o.eps = 1e-8;
  o.weight_decay = 0.1;
  o.step = 3;
  o.grad_scale = 0.5;
  o.zero_grad = zero_grad;
  c.name = "adamw n=" + std::to_string(n) + (zero_grad ? " zero_grad" : "");
  c.in_sizes = {n, n, n, n};  // p, g, m, v
  c.in_grad = {false, false, false, false};
  c.in_scale = {1, 1, 0.1, 0.01};
  c.in_positive = {false, false, false, true};
  c.out_sizes = {n, n, n, n};
  c.out_loss = {true, true, true, true};
  // The kernel is float only; the double "kernel" is the oracle itself.
  auto oracle = [=](const Bufs<double>& in, Bufs<double>& out) {
    const double bc1 = 1 - std::pow(o.beta1, double(o.step)), bc2 = 1 - std::pow(o.beta2, double(o.step));
    for (int64_t i = 0; i < n; ++i) {
      const double g = in[1][i] * o.grad_scale;
      const double m = o.beta1 * in[2][i] + (1 - o.beta1) * g;
      const double v = o.beta2 * in[3][i] + (1 - o.beta2) * g * g;
      double p = in[0][i] * (1 - o.lr * o.weight_decay);
      p -= o.lr / bc1 * m / (std::sqrt(v) / std::sqrt(bc2) + o.eps);
      out[0][i] = p;
      out[1][i] = zero_grad ? 0.0 : in[1][i];
      out[2][i] = m;
      out[3][i] = v;
    }
  };
  c.fwd32 = [=](const Bufs<float>& in, Bufs<float>& out) {
    out = in;
    adamw(out[0].data(), out[1].data(), out[2].data(), out[3].data(), n, o);
  };
  c.fwd64 = oracle;
  c.ref64 = oracle;
  c.fwd_tol = 1e-6;
  return c;
}

OpCase sumsq_case() {
  OpCase c;
  const int64_t n = 300001;
  c.name = "sumsq n=300001";
  c.in_sizes = {n};
  c.in_grad = {false};
  c.in_scale = {1};
  c.out_sizes = {1};
  c.out_loss = {true};
  c.fwd32 = [=](const Bufs<float>& in, Bufs<float>& out) { out[0][0] = float(sumsq(in[0].data(), n)); };
  c.ref64 = [=](const Bufs<double>& in, Bufs<double>& out) {
    double acc = 0;
    for (double x : in[0]) acc += x * x;
    out[0][0] = acc;
  };
  c.fwd64 = c.ref64;
  return c;
}

OpCase scale_case() {
  OpCase c;
  const int64_t n = 777;
  c.name = "scale n=777";
  c.in_sizes = {n};
  c.in_grad = {false};
  c.in_scale = {1};
  c.out_sizes = {n};
  c.out_loss = {true};
  c.fwd32 = [=](const Bufs<float>& in, Bufs<float>& out) {
    out[0] = in[0];
    scale(out[0].data(), n, 0.37f);
  };
  c.ref64 = [=](const Bufs<double>& in, Bufs<double>& out) {
    for (int64_t i = 0; i < n; ++i) out[0][i] = in[0][i] * double(0.37f);
  };
  c.fwd64 = c.ref64;
  return c;
}

// ---------------------------------------------------------------------------------------------
// MoE: router, permute / unpermute, grouped gemm

// The router written out: scores, HF's group mask (masked experts compete with 0), the choice by
// a full sort (descending, lower index first), the weights. replay: experts given.
void router_oracle(const double* z, const double* bias, int64_t E, int64_t K, const RouterOpts& o,
                   const int32_t* replay, double* w, int32_t* ex, double* p, double* lse) {
  double mx = -INFINITY;
  for (int64_t e = 0; e < E; ++e) mx = std::max(mx, z[e]);
  double sum = 0;
  for (int64_t e = 0; e < E; ++e) sum += std::exp(z[e] - mx);
  *lse = mx + std::log(sum);
  for (int64_t e = 0; e < E; ++e)
    p[e] = o.scoring == 0 ? std::exp(z[e] - mx) / sum : 1 / (1 + std::exp(-z[e]));
  if (replay) {
    std::copy(replay, replay + K, ex);
  } else {
    std::vector<double> sel(E);
    for (int64_t e = 0; e < E; ++e) sel[e] = p[e] + (bias ? bias[e] : 0.0);
    if (o.n_group > 1) {
      const int64_t gs = E / o.n_group;
      std::vector<double> gscore(o.n_group);
      for (int64_t g = 0; g < o.n_group; ++g) {
        std::vector<double> v(sel.begin() + g * gs, sel.begin() + (g + 1) * gs);
        std::sort(v.begin(), v.end(), std::greater<double>());
        gscore[g] = v[0] + (gs > 1 ? v[1] : 0.0);
      }
      std::vector<int64_t> gi(o.n_group);
      std::iota(gi.begin(), gi.end(), 0);
      std::stable_sort(gi.begin(), gi.end(), [&](int64_t a, int64_t b) { return gscore[a] > gscore[b]; });
      for (int64_t r = o.topk_group; r < o.n_group; ++r)
        for (int64_t e = gi[r] * gs; e < (gi[r] + 1) * gs; ++e) sel[e] = 0.0;
    }
    std::vector<int64_t> idx(E);
    std::iota(idx.begin(), idx.end(), 0);
    std::stable_sort(idx.begin(), idx.end(), [&](int64_t a, int64_t b) { return sel[a] > sel[b]; });
    for (int64_t j = 0; j < K; ++j) ex[j] = int32_t(idx[j]);
  }
  double s = 0;
  for (int64_t j = 0; j < K; ++j) s += p[ex[j]];
  const double den = o.norm_topk_prob ? (o.scoring == 1 ? s + 1e-20 : s) : 1.0;
  for (int64_t j = 0; j < K; ++j) w[j] = p[ex[j]] / den * o.scaling_factor;
}

// Outputs: weights [N,K], probs [N,E], lse [N]; experts int32 [N,K] is ints[0]. lse enters the
// loss (as a router z-loss does) with softmax scoring.
OpCase router_case(const std::string& label, int64_t N, int64_t E, int64_t K, int64_t pad,
                   RouterOpts o, bool with_bias) {
  OpCase c;
  const int64_t ldl = E + pad;
  const bool softmax = o.scoring == 0;
  c.name = "moe_router " + label + " N=" + std::to_string(N) + " E=" + std::to_string(E) +
           " K=" + std::to_string(K) + " ldl=" + std::to_string(ldl);
  c.in_sizes = {N * ldl};
  c.in_grad = {true};
  c.in_scale = {1.5};
  if (with_bias) {  // selection only: no gradient
    c.in_sizes.push_back(E);
    c.in_grad.push_back(false);
    c.in_scale.push_back(0.1);
  }
  c.out_sizes = {N * K, N * E, N};
  c.out_loss = {true, true, softmax};
  std::vector<int32_t> given(N * K, 0);
  if (o.replay)  // distinct experts per row
    for (int64_t n = 0; n < N; ++n)
      for (int64_t k = 0; k < K; ++k) given[n * K + k] = int32_t((n * 3 + k) % E);
  c.ints = {IntOperand{given, {N, K}}};
  const std::vector<int64_t> out_sizes = c.out_sizes;
  auto fwd = [=](const auto& in, auto& out, std::vector<int32_t>& ex) {
    using T = elem_t<decltype(in)>;
    ex = given;
    moe_router_fwd<T>(out[0].data(), ex.data(), out[1].data(), out[2].data(), in[0].data(), ldl,
                      with_bias ? in[1].data() : nullptr, N, E, K, o);
  };
  set_fwd(c, [=](const auto& in, auto& out) {
    std::vector<int32_t> ex;
    fwd(in, out, ex);
  });
  set_bwd(c, [=](const auto& in, const auto& out, const auto& dout, auto& din) {
    using T = elem_t<decltype(in)>;
    Bufs<T> tmp;
    for (int64_t n : out_sizes) tmp.emplace_back(size_t(n), T(0));
    std::vector<int32_t> ex;
    fwd(in, tmp, ex);  // the choice the forward made
    moe_router_bwd<T>(din[0].data(), ldl, dout[0].data(), out[1].data(), ex.data(),
                      dout[1].data(), softmax ? dout[2].data() : nullptr, N, E, K, o);
  });
  auto oracle = [=](const Bufs<double>& in, Bufs<double>& out, std::vector<int32_t>& ex) {
    ex.assign(size_t(N * K), 0);
    for (int64_t n = 0; n < N; ++n)
      router_oracle(in[0].data() + n * ldl, with_bias ? in[1].data() : nullptr, E, K, o,
                    o.replay ? given.data() + n * K : nullptr, out[0].data() + n * K,
                    ex.data() + n * K, out[1].data() + n * E, &out[2][n]);
  };
  c.ref64 = [=](const Bufs<double>& in, Bufs<double>& out) {
    std::vector<int32_t> ex;
    oracle(in, out, ex);
  };
  c.ref_ints64 = [=](const Bufs<double>& in, std::vector<IntOperand>& ints) {
    Bufs<double> tmp;
    for (int64_t n : out_sizes) tmp.emplace_back(size_t(n), 0.0);
    oracle(in, tmp, ints[0].values);
  };
  c.fwd_ints32 = [=](const Bufs<float>& in, std::vector<IntOperand>& ints) {
    Bufs<float> tmp;
    for (int64_t n : out_sizes) tmp.emplace_back(size_t(n), 0.f);
    fwd(in, tmp, ints[0].values);
  };
  return c;
}

// The expert-sorted rows written out: expert by expert, pairs in (n, k) order.
void rows_literal(const std::vector<int32_t>& experts, int64_t N, int64_t K, int64_t E,
                  std::vector<int32_t>& row, std::vector<int32_t>& offsets) {
  row.assign(size_t(N * K), -1);
  offsets.assign(size_t(E + 1), 0);
  int32_t r = 0;
  for (int64_t e = 0; e < E; ++e) {
    offsets[e] = r;
    for (int64_t i = 0; i < N * K; ++i)
      if (experts[i] == e) row[i] = r++;
  }
  offsets[E] = r;
}

// A fixed choice: K distinct experts per row, never expert `skip` (an expert with no rows).
std::vector<int32_t> some_experts(int64_t N, int64_t K, int64_t E, int64_t skip) {
  std::vector<int32_t> others;
  for (int32_t e = 0; e < E; ++e)
    if (e != skip) others.push_back(e);
  const int64_t m = int64_t(others.size());
  std::vector<int32_t> ex(N * K);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k)  // descending runs from a row-dependent start
      ex[n * K + k] = others[size_t(((n * 7 + n / 3) % m + m - k) % m)];
  return ex;
}

OpCase permute_case(int64_t N, int64_t K, int64_t E, int64_t C, int64_t pad) {
  OpCase c;
  const int64_t ldx = C + pad;
  const std::vector<int32_t> experts = some_experts(N, K, E, E / 2);
  c.name = "moe_permute N=" + std::to_string(N) + " K=" + std::to_string(K) +
           " E=" + std::to_string(E) + " C=" + std::to_string(C) + " ldx=" + std::to_string(ldx);
  c.in_sizes = {N * ldx};
  c.in_grad = {true};
  c.in_scale = {1};
  c.out_sizes = {N * K * C};
  c.out_loss = {true};
  c.ints = {IntOperand{experts, {N, K}}, IntOperand{std::vector<int32_t>(N * K, 0), {N, K}},
            IntOperand{std::vector<int32_t>(E + 1, 0), {E + 1}}};
  set_fwd(c, [=](const auto& in, auto& out) {
    using T = elem_t<decltype(in)>;
    std::vector<int32_t> row(N * K), off(E + 1);
    moe_permute_fwd<T>(out[0].data(), C, row.data(), off.data(), in[0].data(), ldx, experts.data(),
                       N, K, C, E);
  });
  set_bwd(c, [=](const auto&, const auto&, const auto& dout, auto& din) {
    using T = elem_t<decltype(dout)>;
    std::vector<int32_t> row(N * K), off(E + 1);
    moe_permute_index(row.data(), off.data(), experts.data(), N, K, E);
    moe_permute_bwd<T>(din[0].data(), ldx, dout[0].data(), C, row.data(), N, K, C, false);
  });
  c.ref64 = [=](const Bufs<double>& in, Bufs<double>& out) {
    std::vector<int32_t> row, off;
    rows_literal(experts, N, K, E, row, off);
    for (int64_t i = 0; i < N * K; ++i)
      for (int64_t j = 0; j < C; ++j) out[0][row[i] * C + j] = in[0][(i / K) * ldx + j];
  };
  c.ref_ints64 = [=](const Bufs<double>&, std::vector<IntOperand>& ints) {
    rows_literal(experts, N, K, E, ints[1].values, ints[2].values);
  };
  c.fwd_ints32 = [=](const Bufs<float>&, std::vector<IntOperand>& ints) {
    moe_permute_index(ints[1].values.data(), ints[2].values.data(), experts.data(), N, K, E);
  };
  return c;
}

// y = y0 + sum_k w yp[row] (the accumulate form); inputs yp [N*K,C], weights [N,K], y0 [N,ldy].
OpCase unpermute_case(int64_t N, int64_t K, int64_t E, int64_t C, int64_t pad) {
  OpCase c;
  const int64_t ldy = C + pad;
  std::vector<int32_t> row, off;
  rows_literal(some_experts(N, K, E, 1), N, K, E, row, off);
  c.name = "moe_unpermute N=" + std::to_string(N) + " K=" + std::to_string(K) +
           " C=" + std::to_string(C) + " ldy=" + std::to_string(ldy) + " accumulate";
  c.in_sizes = {N * K * C, N * K, N * ldy};
  c.in_grad = {true, true, true};
  c.in_scale = {1, 0.5, 1};
  c.out_sizes = {N * ldy};
  c.out_loss = {true};
  c.ints = {IntOperand{row, {N, K}}};
  set_fwd(c, [=](const auto& in, auto& out) {
    using T = elem_t<decltype(in)>;
    out[0] = in[2];
    moe_unpermute_fwd<T>(out[0].data(), ldy, in[0].data(), C, row.data(), in[1].data(), N, K, C,
                         true);
  });
  set_bwd(c, [=](const auto& in, const auto&, const auto& dout, auto& din) {
    using T = elem_t<decltype(in)>;
    moe_unpermute_bwd<T>(din[0].data(), C, din[1].data(), dout[0].data(), ldy, in[0].data(), C,
                         row.data(), in[1].data(), N, K, C);
    din[2] = dout[0];  // y0 passes through
  });
  c.ref64 = [=](const Bufs<double>& in, Bufs<double>& out) {
    out[0] = in[2];
    for (int64_t n = 0; n < N; ++n)
      for (int64_t k = 0; k < K; ++k)
        for (int64_t j = 0; j < C; ++j)
          out[0][n * ldy + j] += in[1][n * K + k] * in[0][row[n * K + k] * C + j];
  };
  return c;
}

// trans_a = false: C [T,N] = alpha A [T,K] op(B_g) + beta C0, B [G,K,N] or [G,N,K] (trans_b).
// trans_a = true:  C_g [M,N] = alpha A_g^T B_g + beta C0_g, A [T,M], B [T,N].
OpCase grouped_gemm_case(bool ta, bool tb, std::vector<int32_t> offsets, int64_t M, int64_t N,
                         int64_t K, double alpha, double beta, int64_t pad) {
  OpCase c;
  const int64_t G = int64_t(offsets.size()) - 1, T = offsets.back();
  c.name = "grouped_gemm ta=" + std::to_string(ta) + " tb=" + std::to_string(tb) +
           " G=" + std::to_string(G) + " T=" + std::to_string(T) + " M=" + std::to_string(M) +
           " N=" + std::to_string(N) + " K=" + std::to_string(K) + " alpha=" +
           std::to_string(alpha) + " beta=" + std::to_string(beta) + " pad=" + std::to_string(pad);
  c.ints = {IntOperand{offsets, {G + 1}}};
  const std::vector<int32_t> o = offsets;
  c.in_grad = {true, true, true};
  c.in_scale = {1, 1, 1};
  c.out_loss = {true};
  if (!ta) {
    const int64_t lda = K + pad, ldb = tb ? K : N;
    c.in_sizes = {T * lda, G * K * N, T * N};
    c.out_sizes = {T * N};
    set_fwd(c, [=](const auto& in, auto& out) {
      using F = elem_t<decltype(in)>;
      out[0] = in[2];
      grouped_gemm<F>(false, tb, G, o.data(), T, N, K, F(alpha), in[0].data(), lda, in[1].data(),
                      ldb, K * N, F(beta), out[0].data(), N, 0);
    });
    set_bwd(c, [=](const auto& in, const auto&, const auto& dout, auto& din) {
      using F = elem_t<decltype(in)>;
      const F* dC = dout[0].data();
      // dA = alpha dC op(B_g)^T;  d op(B_g) = alpha A_g^T dC_g
      if (!tb) {
        grouped_gemm<F>(false, true, G, o.data(), T, K, N, F(alpha), dC, N, in[1].data(), N,
                        K * N, F(0), din[0].data(), lda, 0);
        grouped_gemm<F>(true, false, G, o.data(), K, N, 0, F(alpha), in[0].data(), lda, dC, N, 0,
                        F(0), din[1].data(), N, K * N);
      } else {
        grouped_gemm<F>(false, false, G, o.data(), T, K, N, F(alpha), dC, N, in[1].data(), K,
                        K * N, F(0), din[0].data(), lda, 0);
        grouped_gemm<F>(true, false, G, o.data(), N, K, 0, F(alpha), dC, N, in[0].data(), lda, 0,
                        F(0), din[1].data(), K, K * N);
      }
      for (int64_t i = 0; i < T * N; ++i) din[2][i] = F(beta) * dC[i];
    });
    c.ref64 = [=](const Bufs<double>& in, Bufs<double>& out) {
      for (int64_t g = 0; g < G; ++g)
        for (int64_t r = o[g]; r < o[g + 1]; ++r)
          for (int64_t j = 0; j < N; ++j) {
            double acc = 0;
            for (int64_t p = 0; p < K; ++p)
              acc += in[0][r * lda + p] *
                     (tb ? in[1][g * K * N + j * K + p] : in[1][g * K * N + p * N + j]);
            out[0][r * N + j] = alpha * acc + beta * in[2][r * N + j];
          }
    };
  } else {
    const int64_t lda = M + pad;
    c.in_sizes = {T * lda, T * N, G * M * N};
    c.out_sizes = {G * M * N};
    set_fwd(c, [=](const auto& in, auto& out) {
      using F = elem_t<decltype(in)>;
      out[0] = in[2];
      grouped_gemm<F>(true, false, G, o.data(), M, N, 0, F(alpha), in[0].data(), lda,
                      in[1].data(), N, 0, F(beta), out[0].data(), N, M * N);
    });
    set_bwd(c, [=](const auto& in, const auto&, const auto& dout, auto& din) {
      using F = elem_t<decltype(in)>;
      const F* dC = dout[0].data();
      // dA_g = alpha B_g dC_g^T, dB_g = alpha A_g dC_g: row-grouped, dC_g as the group matrix
      grouped_gemm<F>(false, true, G, o.data(), T, M, N, F(alpha), in[1].data(), N, dC, N, M * N,
                      F(0), din[0].data(), lda, 0);
      grouped_gemm<F>(false, false, G, o.data(), T, N, M, F(alpha), in[0].data(), lda, dC, N,
                      M * N, F(0), din[1].data(), N, 0);
      for (int64_t i = 0; i < G * M * N; ++i) din[2][i] = F(beta) * dC[i];
    });
    c.ref64 = [=](const Bufs<double>& in, Bufs<double>& out) {
      for (int64_t g = 0; g < G; ++g)
        for (int64_t i = 0; i < M; ++i)
          for (int64_t j = 0; j < N; ++j) {
            double acc = 0;
            for (int64_t r = o[g]; r < o[g + 1]; ++r) acc += in[0][r * lda + i] * in[1][r * N + j];
            out[0][g * M * N + i * N + j] = alpha * acc + beta * in[2][g * M * N + i * N + j];
          }
    };
  }
  return c;
}

}  // namespace

std::vector<OpCase> all_op_cases() {
  std::vector<OpCase> v;
  for (int t = 0; t < 4; ++t) {
    v.push_back(gemm_case(t & 1, t & 2, 7, 9, 11, 0.7, 0.0, 0));
    v.push_back(gemm_case(t & 1, t & 2, 13, 5, 8, 1.0, 0.5, 3));
  }
  v.push_back(gemm_case(false, true, 70, 45, 300, 1.0, 0.0, 0));  // threaded split, BLAS
  v.push_back(gemm_case(true, false, 40, 96, 130, 1.0, 1.0, 0));
  v.push_back(gemm_batched_case());
  v.push_back(embedding_case());
  v.push_back(rmsnorm_case(5, 37, 0.0, 37, 37));
  v.push_back(rmsnorm_case(6, 40, 1.0, 43, 45));
  v.push_back(rope_case(3, 16, 16, false, 1.0, 48));
  v.push_back(rope_case(2, 16, 8, true, 1.3, 40));
  v.push_back(rope_case(2, 12, 8, false, 0.9, 24));
  v.push_back(attention_case({{0, 37}, 4, 2, 8, 8, 0}));
  v.push_back(attention_case({{0, 5, 5, 30, 31}, 4, 1, 8, 6, 0}));          // packed, MQA, Dv != Dk
  v.push_back(attention_case({{0, 40, 67}, 2, 2, 8, 8, 7, 5}));             // window, strided
  v.push_back(attention_case({{0, 300}, 2, 1, 4, 4, 0}));                   // several tiles
  v.push_back(attention_case({{0, 17, 317}, 4, 2, 4, 4, 100}));             // window across tiles
  v.push_back(attention_case({{0, 40, 67}, 2, 2, 8, 8, 7, 5, 1.5}));        // soft-capped, window, strided
  v.push_back(attention_case({{0, 300}, 2, 1, 4, 4, 0, 0, 2.0}));           // soft-capped, several tiles
  v.push_back(swiglu_case());
  v.push_back(geglu_case(true));
  v.push_back(geglu_case(false));
  v.push_back(bias_case());
  v.push_back(add_case());
  LogprobOpts o;
  v.push_back(logprob_case("plain", 9, 12, 50, o, false));
  o.temperature = 0.7;
  o.chunk_bytes = 256;  // several vocab chunks and row blocks
  v.push_back(logprob_case("chunked", 9, 12, 50, o, true));
  o.temperature = 1.1;
  o.chunk_bytes = 1200;  // one token per block and several vocabulary chunks
  v.push_back(logprob_case("blocked", 9, 12, 600, o, true));
  v.push_back(logprob_case("at ids", 9, 12, 600, o, true, 4));  // top-k distillation targets
  o = LogprobOpts{};
  o.temperature = 0.9;
  o.top_k = 7;
  v.push_back(logprob_case("top_k", 9, 12, 50, o, true));
  o = LogprobOpts{};
  o.top_p = 0.8;
  v.push_back(logprob_case("top_p", 9, 12, 50, o, true));
  o.temperature = 1.3;
  o.top_k = 10;
  o.top_p = 0.9;
  o.chunk_bytes = 1024;
  v.push_back(logprob_case("top_k+top_p", 9, 12, 50, o, true));
  v.push_back(logprob_case("top_k+top_p at ids", 9, 12, 50, o, true, 3));
  o = LogprobOpts{};
  o.softcap = 1.5;  // Gemma-2's final soft-cap (small, so tanh bends the logits)
  v.push_back(logprob_case("softcap", 9, 12, 50, o, true));
  o.temperature = 0.8;
  o.chunk_bytes = 256;
  v.push_back(logprob_case("softcap chunked", 9, 12, 50, o, true));
  o.top_k = 7;
  v.push_back(logprob_case("softcap top_k", 9, 12, 50, o, true));
  o = LogprobOpts{};
  o.temperature = 4.0;  // flat: the top-p cut lies beyond the first slices of candidates
  o.top_p = 0.95;
  v.push_back(logprob_case("top_p wide", 9, 12, 600, o, true));
  RouterOpts ro;  // Qwen2-MoE: softmax, no renormalisation
  v.push_back(router_case("softmax", 11, 8, 2, 3, ro, false));
  ro.norm_topk_prob = true;  // Mixtral, Qwen3-MoE
  v.push_back(router_case("softmax norm", 9, 6, 3, 0, ro, false));
  v.push_back(router_case("softmax norm threads", 700, 16, 4, 0, ro, false));
  ro.replay = true;  // routing replay: the experts are given
  v.push_back(router_case("softmax norm replay", 7, 8, 2, 1, ro, false));
  ro = RouterOpts{};  // DeepSeek-V3: sigmoid, selection bias, group-limited, scaled
  ro.scoring = 1;
  ro.norm_topk_prob = true;
  ro.scaling_factor = 2.5;
  ro.n_group = 4;
  ro.topk_group = 2;
  v.push_back(router_case("sigmoid groups bias", 9, 8, 3, 2, ro, true));
  ro = RouterOpts{};  // one expert, sigmoid: Qwen2-MoE's shared-expert gate
  ro.scoring = 1;
  v.push_back(router_case("sigmoid gate", 13, 1, 1, 0, ro, false));
  v.push_back(permute_case(7, 2, 5, 6, 3));
  v.push_back(permute_case(300, 4, 9, 64, 0));  // threaded
  v.push_back(unpermute_case(7, 2, 5, 6, 2));
  v.push_back(unpermute_case(300, 4, 9, 64, 0));
  v.push_back(grouped_gemm_case(false, true, {0, 5, 5, 17, 30}, 0, 9, 12, 1.0, 0.0, 3));
  v.push_back(grouped_gemm_case(false, false, {0, 0, 70, 150}, 0, 33, 20, 0.5, 1.0, 0));
  v.push_back(grouped_gemm_case(true, false, {0, 9, 9, 40}, 13, 7, 0, 1.0, 0.5, 2));
  v.push_back(grouped_gemm_case(true, false, {0, 100, 130}, 70, 11, 0, 1.0, 0.0, 0));
  // groups (ta = 0) and C_g rows (ta = 1) beyond one 256-row task
  v.push_back(grouped_gemm_case(false, true, {0, 600, 610}, 0, 5, 8, 1.0, 0.0, 1));
  v.push_back(grouped_gemm_case(true, false, {0, 20, 50}, 300, 4, 0, 1.0, 1.0, 0));
  v.push_back(adamw_case(1000, false));
  v.push_back(adamw_case(200003, true));
  v.push_back(sumsq_case());
  v.push_back(scale_case());
  return v;
}

}  // namespace rlh::kcpu::testing
