// The OpenBLAS core-type decision, the loader's verification, and gemm on both backends
// against the naive oracle.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "rlhost/kernels_cpu/blas.hpp"
#include "rlhost/kernels_cpu/cpu_features.hpp"
#include "rlhost/kernels_cpu/kernels.hpp"

namespace rlh::kcpu {
namespace {

TEST(Blas, CoretypeChoiceFollowsCpuidAndRespectsTheUser) {
  std::string why;
  EXPECT_EQ(openblas_coretype_choice(nullptr, SimdLevel::avx512, &why), "SkylakeX");
  EXPECT_NE(why.find("unset"), std::string::npos);
  EXPECT_EQ(openblas_coretype_choice(nullptr, SimdLevel::avx2, &why), "Haswell");
  // The known-slow fallback is replaced when the CPU can do better...
  EXPECT_EQ(openblas_coretype_choice("Prescott", SimdLevel::avx512, &why), "SkylakeX");
  EXPECT_NE(why.find("known-slow"), std::string::npos);
  EXPECT_EQ(openblas_coretype_choice("PRESCOTT", SimdLevel::avx2, &why), "Haswell");
  // ...any other explicit setting is the user's call.
  EXPECT_EQ(openblas_coretype_choice("Haswell", SimdLevel::avx512, &why), "Haswell");
  EXPECT_NE(why.find("respected"), std::string::npos);
  EXPECT_EQ(openblas_coretype_choice("Zen", SimdLevel::avx2, &why), "Zen");
  EXPECT_EQ(openblas_coretype_choice("", SimdLevel::avx512, &why), "SkylakeX");
}

TEST(Blas, InfoIsConsistent) {
  const BlasInfo& b = blas_info();
  std::printf("cpu: %s\n%s\n", cpu_features_string().c_str(), blas_info_string().c_str());
  if (b.backend == GemmBackend::openblas) {
    EXPECT_TRUE(b.verified);
    EXPECT_TRUE(b.error.empty());
  } else {
    EXPECT_FALSE(b.error.empty()) << "the builtin kernel is used only with a reason";
  }
}

// Both backends (OpenBLAS when it loaded) against gemm_naive, every transpose case, odd sizes,
// strided operands, beta = 0 over NaN garbage, sizes large enough to be split over threads.
TEST(Blas, GemmMatchesNaiveOnEveryBackend) {
  std::vector<GemmBackend> backends = {GemmBackend::builtin};
  if (blas_info().backend == GemmBackend::openblas) backends.push_back(GemmBackend::openblas);
  const GemmBackend saved = gemm_backend();
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> U(-1, 1);
  const int64_t shapes[][3] = {{1, 1, 1}, {6, 32, 256}, {7, 33, 257}, {100, 70, 513}, {300, 260, 64}, {5, 3000, 40}};
  for (GemmBackend be : backends) {
    gemm_backend_set(be);
    ASSERT_EQ(gemm_backend(), be);
    for (auto& s : shapes)
      for (int t = 0; t < 4; ++t)
        for (float beta : {0.f, 0.25f}) {
          const int64_t M = s[0], N = s[1], K = s[2];
          const bool ta = t & 1, tb = t & 2;
          const int64_t lda = (ta ? M : K) + 2, ldb = (tb ? K : N) + 1, ldc = N + 3;
          std::vector<float> A((ta ? K : M) * lda), B((tb ? N : K) * ldb), C(M * ldc), R;
          for (auto& x : A) x = U(rng);
          for (auto& x : B) x = U(rng);
          for (auto& x : C) x = beta == 0.f ? NAN : U(rng);
          R = C;
          gemm<float>(ta, tb, M, N, K, 1.5f, A.data(), lda, B.data(), ldb, beta, C.data(), ldc);
          gemm_naive<float>(ta, tb, M, N, K, 1.5f, A.data(), lda, B.data(), ldb, beta, R.data(), ldc);
          double maxref = 0, maxerr = 0;
          for (int64_t i = 0; i < M; ++i)
            for (int64_t j = 0; j < N; ++j) {
              maxref = std::max(maxref, double(std::fabs(R[i * ldc + j])));
              const double e = std::fabs(double(C[i * ldc + j]) - R[i * ldc + j]);
              maxerr = std::isnan(e) ? INFINITY : std::max(maxerr, e);
            }
          EXPECT_LE(maxerr, 2e-6 * maxref + 1e-30)
              << (be == GemmBackend::openblas ? "openblas" : "builtin") << " M=" << M << " N=" << N
              << " K=" << K << " ta=" << ta << " tb=" << tb << " beta=" << beta;
          // Padding columns of C are never touched.
          if (beta != 0.f) {
            for (int64_t i = 0; i < M; ++i)
              for (int64_t j = N; j < ldc; ++j) EXPECT_EQ(C[i * ldc + j], R[i * ldc + j]);
          }
        }
  }
  gemm_backend_set(saved);
}

}  // namespace
}  // namespace rlh::kcpu
