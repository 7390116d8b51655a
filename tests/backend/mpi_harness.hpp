// What the backend tests run under `mpirun` share: the host's world communicator, a scope in
// which the process looks started alone (the one-rank reference), and a rank's contiguous share
// of a global batch's sequences.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "backend_harness.hpp"
#include "rlhost/backend.h"
#include "rlhost/comm.h"

namespace rlh::test {

// The host's world communicator (comm_mpi under mpirun).
struct World {
  const rlh_comm_api* api = nullptr;
  rlh_comm* comm = nullptr;
  explicit World(const Host& host) {
    const rlh_host_api* h = host.services();
    sdk::check(h->get_comm(h->ctx, &api, &comm), "world");
  }
  int rank() const { return api->rank(comm); }
  int size() const { return api->size(comm); }
  // Rank 0's string on every rank.
  std::string broadcast(std::string s) const {
    int64_t n = int64_t(s.size());
    rlh_tensor t{};
    int64_t one = 1, stride = 1;
    t.data = &n;
    t.device = {RLH_DEVICE_CPU, 0};
    t.ndim = 1;
    t.dtype = {RLH_DTYPE_INT, 64, 1};
    t.shape = &one;
    t.strides = &stride;
    sdk::check(api->broadcast(comm, &t, 0, nullptr));
    s.resize(size_t(n));
    int64_t len = n;
    t.data = s.data();
    t.dtype = {RLH_DTYPE_UINT, 8, 1};
    t.shape = &len;
    if (n > 0) sdk::check(api->broadcast(comm, &t, 0, nullptr));
    return s;
  }
  void barrier() const { sdk::check(api->barrier(comm)); }
  // The largest of every rank's value, on every rank.
  int64_t max(int64_t v) const {
    int64_t one = 1, stride = 1;
    rlh_tensor t{};
    t.data = &v;
    t.device = {RLH_DEVICE_CPU, 0};
    t.ndim = 1;
    t.dtype = {RLH_DTYPE_INT, 64, 1};
    t.shape = &one;
    t.strides = &stride;
    sdk::check(api->all_reduce(comm, &t, RLH_REDUCE_MAX, nullptr));
    return v;
  }
};
// While alive, this process looks started without a launcher: a backend loading a model then
// sees one rank (the reference).
struct Alone {
  std::string saved;
  bool had = false;
  Alone() {
    if (const char* v = std::getenv("OMPI_COMM_WORLD_SIZE")) {
      had = true;
      saved = v;
    }
    ::unsetenv("OMPI_COMM_WORLD_SIZE");
  }
  ~Alone() {
    if (had) ::setenv("OMPI_COMM_WORLD_SIZE", saved.c_str(), 1);
  }
};

// The data-parallel tests' global batch (the same on every rank): the first `num_seqs` of 12
// sequences of uneven lengths over a vocabulary of 512.
inline const std::vector<int64_t> kDpLengths = {9, 14, 3, 11, 17, 6, 2, 12, 8, 5, 15, 7};
inline std::unique_ptr<Batch> dp_global_batch(size_t num_seqs = kDpLengths.size()) {
  return random_batch(std::vector<int64_t>(kDpLengths.begin(), kDpLengths.begin() + int64_t(num_seqs)), 512, 23);
}

// Sequences [s0, s1) of g, as a batch of their own; `first_token`: where they start in g.
inline std::unique_ptr<Batch> sequences(const Batch& g, int64_t s0, int64_t s1, int64_t* first_token = nullptr) {
  const auto& off = g.offsets();
  std::vector<int32_t> ids(g.ids().begin() + off[size_t(s0)], g.ids().begin() + off[size_t(s1)]);
  std::vector<int64_t> o;
  for (int64_t s = s0; s <= s1; ++s) o.push_back(off[size_t(s)] - off[size_t(s0)]);
  if (first_token != nullptr) *first_token = off[size_t(s0)];
  return std::make_unique<Batch>(std::move(ids), std::move(o));
}

// Every sequence of g where `all`, else none (an empty batch): a rank with the whole batch and
// idle ones.
inline std::unique_ptr<Batch> all_or_none(const Batch& g, bool all) { return sequences(g, 0, all ? g.num_seqs() : 0); }

// Sequences [S rank / size, S (rank + 1) / size) of g (S of them), as sequences() gives them.
inline std::unique_ptr<Batch> shard_of(const Batch& g, int rank, int size, int64_t* first_token = nullptr) {
  const int64_t S = g.num_seqs();
  return sequences(g, S * rank / size, S * (rank + 1) / size, first_token);
}

// The test program's host (made in run_mpi_tests, destroyed before it returns: MPI finishes at
// exit, after it) and its world communicator.
inline std::unique_ptr<Host> g_mpi_host;
inline const Host& host() { return *g_mpi_host; }
inline const World& world() {
  static World w(host());
  return w;
}
// An empty folder every rank names alike (rank 0's temporary path; rank 0 makes it), for a
// checkpoint the ranks write together.
inline std::filesystem::path shared_scratch_dir(const std::string& prefix) {
  const std::filesystem::path dir = world().broadcast(
      (std::filesystem::temp_directory_path() / (prefix + "_" + std::to_string(::getpid()))).string());
  if (world().rank() == 0) {
    std::filesystem::remove_all(dir);
    std::filesystem::create_directories(dir);
  }
  world().barrier();
  return dir;
}

// Element sums over the world, in place (host floats).
inline void sum_over_world(std::vector<float>& v) {
  int64_t n = int64_t(v.size()), stride = 1;
  rlh_tensor t{};
  t.data = v.data();
  t.device = {RLH_DEVICE_CPU, 0};
  t.ndim = 1;
  t.dtype = {RLH_DTYPE_FLOAT, 32, 1};
  t.shape = &n;
  t.strides = &stride;
  if (n > 0) rlh::sdk::check(world().api->all_reduce(world().comm, &t, RLH_REDUCE_SUM, nullptr), "all_reduce");
}

// A weight piece (visit_weight_pieces) against the whole tensor it is part of (row-major in its
// global shape): the number of its elements that differ bitwise; when the piece's rank sends it
// (RLH_PIECE_SENDER), 1 added at each of its elements in `cover` (sized like `whole`), so summed
// over the world every element is 1.
inline int64_t compare_piece(const rlh_weight_piece& p, const std::vector<float>& whole, std::vector<float>& cover) {
  const rlh_tensor& t = *p.data;
  const int nd = t.ndim;
  std::vector<int64_t> gs(size_t(std::max(nd, 1)), 1);
  for (int d = nd - 2; d >= 0; --d) gs[size_t(d)] = gs[size_t(d) + 1] * p.global_shape[d + 1];
  int64_t n = 1;
  for (int d = 0; d < nd; ++d) n *= t.shape[d];
  cover.resize(whole.size(), 0.f);
  int64_t bad = 0;
  for (int64_t e = 0; e < n; ++e) {
    int64_t rest = e, src = 0, dst = 0;
    for (int d = nd - 1; d >= 0; --d) {
      const int64_t i = rest % t.shape[d];
      rest /= t.shape[d];
      src += i * t.strides[d];
      dst += (p.offset[d] + i) * gs[size_t(d)];
    }
    const float got = static_cast<const float*>(t.data)[src];
    if (std::memcmp(&got, &whole[size_t(dst)], sizeof got) != 0) ++bad;
    if (p.flags & RLH_PIECE_SENDER) cover[size_t(dst)] += 1.f;
  }
  return bad;
}

// A fixture by name, or a model folder by absolute path (one a test wrote).
inline std::string model_path(const std::string& name) {
  return !name.empty() && name[0] == '/' ? name : fixtures_root() + "/" + name;
}

// gtest's main for an mpirun test: ranks other than 0 print only their failures; the host with
// `plugins`, then the world, on every rank alike.
inline int run_mpi_tests(int argc, char** argv, const std::vector<std::string>& plugins) {
  ::testing::InitGoogleTest(&argc, argv);
  const char* r = std::getenv("OMPI_COMM_WORLD_RANK");
  if (r != nullptr && std::atoi(r) != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
  }
  g_mpi_host = std::make_unique<Host>(plugins);
  world();
  const int rc = RUN_ALL_TESTS();
  g_mpi_host.reset();
  return rc;
}

// A parameterised case's label as a gtest name (non-alphanumerics become '_').
inline std::string test_name(std::string s) {
  for (char& ch : s)
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  return s;
}

// The batching both mpirun backend tests run: packed micro-batches of 24 tokens, or 2 sequences
// per train micro-batch and 3 per logprob one.
inline void set_batching(nlohmann::json& cfg, bool packing) {
  if (packing)
    cfg["sequence_packing"] = {{"enabled", true}, {"train_mb_tokens", 24}, {"logprob_mb_tokens", 24},
                               {"algorithm", "modified_first_fit_decreasing"}};
  else
    cfg["train_micro_batch_size"] = 2, cfg["logprob_batch_size"] = 3;
}

// Weights by HF name; max |a - b| over every weight relative to max |b|; a - b.
using Weights = std::map<std::string, std::vector<float>>;
inline double max_rel_diff(const Weights& a, const Weights& b) {
  double num = 0, den = 0;
  for (const auto& [k, v] : b) {
    const auto& w = a.at(k);
    EXPECT_EQ(w.size(), v.size()) << k;
    for (size_t i = 0; i < v.size() && i < w.size(); ++i) {
      num = std::max(num, std::fabs(double(w[i]) - double(v[i])));
      den = std::max(den, std::fabs(double(v[i])));
    }
  }
  return num / std::max(den, 1e-30);
}
// max |a[i] - b[first + i]| over a: a rank's outputs against the reference's from its first
// token (b must reach that far); max_abs_diff: two outputs of the same tokens (the same length).
inline double max_abs_diff_at(const std::vector<float>& a, const std::vector<float>& b, size_t first) {
  EXPECT_LE(first + a.size(), b.size()) << "the reference's outputs end before the rank's";
  double d = 0;
  for (size_t i = 0; i < a.size() && first + i < b.size(); ++i) d = std::max(d, std::fabs(double(a[i]) - double(b[first + i])));
  return d;
}
inline double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  return max_abs_diff_at(a, b, 0);
}
inline Weights minus(const Weights& a, const Weights& b) {
  Weights d;
  for (const auto& [k, v] : a) {
    std::vector<float>& out = d[k];
    out.resize(v.size());
    for (size_t i = 0; i < v.size(); ++i) out[i] = v[i] - b.at(k)[i];
  }
  return d;
}

}  // namespace rlh::test
