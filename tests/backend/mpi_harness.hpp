// What the backend tests run under `mpirun` share: the host's world communicator, a scope in
// which the process looks started alone (the one-rank reference), and a rank's contiguous share
// of a global batch's sequences.
#pragma once

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <unistd.h>

#include <filesystem>

#include "backend_harness.hpp"
#include "rlhost/comm.h"
#include "rlhost/sdk/safetensors.hpp"

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

// Sequences [S rank / size, S (rank + 1) / size) of g, as a batch of their own; `first_token`:
// where they start in g.
inline std::unique_ptr<Batch> shard_of(const Batch& g, int rank, int size, int64_t* first_token = nullptr) {
  const int64_t S = g.num_seqs();
  const int64_t s0 = S * rank / size, s1 = S * (rank + 1) / size;
  const auto& off = g.offsets();
  std::vector<int32_t> ids(g.ids().begin() + off[size_t(s0)], g.ids().begin() + off[size_t(s1)]);
  std::vector<int64_t> o;
  for (int64_t s = s0; s <= s1; ++s) o.push_back(off[size_t(s)] - off[size_t(s0)]);
  if (first_token != nullptr) *first_token = off[size_t(s0)];
  return std::make_unique<Batch>(std::move(ids), std::move(o));
}

// The test program's host (made in run_mpi_tests, destroyed before it returns: MPI finishes at
// exit, after it) and its world communicator.
inline std::unique_ptr<Host> g_mpi_host;
inline const Host& host() { return *g_mpi_host; }
inline const World& world() {
  static World w(host());
  return w;
}
inline std::string model_path(const std::string& name) { return fixtures_root() + "/" + name; }

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
inline Weights minus(const Weights& a, const Weights& b) {
  Weights d;
  for (const auto& [k, v] : a) {
    std::vector<float>& out = d[k];
    out.resize(v.size());
    for (size_t i = 0; i < v.size(); ++i) out[i] = v[i] - b.at(k)[i];
  }
  return d;
}

// Loading `model` (a fixture's name) on a megatron backend with `cfg` fails with `code` and one
// line containing `part`.
inline void expect_load_error(const nlohmann::json& cfg, const std::string& model, rlh_code code, const std::string& part) {
  Backend be(host(), "megatron", cfg);
  rlh_model* m = nullptr;
  expect_error(be.try_load(model_path(model), true, &m), code, part);
}

// Checkpoints across a parallel layout (megatron config `cfg`, this rank's shard `mine` of the
// global batch `g`) and one rank (`one`): a state saved under the layout is one rank's files
// (the fixture's tensors with full shapes); it loads on one rank into the same weights bitwise
// and continues there within fp32 tolerance (AdamW at `lr`); one rank's state loads back under
// the layout bitwise and continues bitwise. `tag` names the temporary folder.
inline void checkpoint_round_trip(const std::string& model, const nlohmann::json& cfg, const nlohmann::json& one, Batch& g,
                                  Batch& mine, double lr, const std::string& tag) {
  namespace fs = std::filesystem;
  const int R = world().rank();
  const int64_t g_tok = g.num_tokens(), g_seq = g.num_seqs();
  const fs::path root =
      world().broadcast((fs::temp_directory_path() / ("rlh_" + tag + "_" + std::to_string(::getpid()))).string());
  const fs::path dir = root / tag, again = root / "one";
  if (R == 0) {
    fs::remove_all(root);
    fs::create_directories(dir);
    fs::create_directories(again);
  }
  world().barrier();
  Weights saved, cont;
  std::vector<double> cont_loss;
  {
    Backend be(host(), "megatron", cfg);
    rlh_model* m = be.load(model, true);
    be.train(m, mine, g_tok, g_seq, nll_loss(), {});
    sdk::check(be.api()->save_state(be.raw(), m, dir.c_str()), "save_state under " + tag);
    saved = be.weights(m);
    for (int s = 0; s < 2; ++s) cont_loss.push_back(be.train(m, mine, g_tok, g_seq, nll_loss(), {}).r.loss);
    cont = be.weights(m);
  }
  {  // the files: the fixture's tensors, full shapes
    const auto f = sdk::st::File::open((dir / "model.safetensors").string());
    const auto fx = sdk::st::File::open(model + "/model.safetensors");
    EXPECT_EQ(f.tensors().size(), fx.tensors().size());
    for (const auto& t : fx.tensors()) EXPECT_EQ(f.at(t.name).shape, t.shape) << t.name;
  }
  {
    Alone alone;
    Backend be(host(), "megatron", one);
    rlh_model* m = be.load(model, true);
    sdk::check(be.api()->load_state(be.raw(), m, dir.c_str()), "load_state at one rank");
    EXPECT_TRUE(be.weights(m) == saved) << "loaded on one rank: not the weights saved under " << tag;
    if (R == 0) sdk::check(be.api()->save_state(be.raw(), m, again.c_str()), "save_state at one rank");
    for (int s = 0; s < 2; ++s) {
      const double loss = be.train(m, g, g_tok, g_seq, nll_loss(), {}).r.loss;
      EXPECT_NEAR(loss, cont_loss[size_t(s)], 2e-5 * std::fabs(cont_loss[size_t(s)])) << "step " << s;
    }
    const Weights w = be.weights(m);
    double worst = 0;
    for (const auto& [k, v] : cont)
      for (size_t i = 0; i < v.size(); ++i) worst = std::max(worst, std::fabs(double(w.at(k)[i]) - double(v[i])));
    EXPECT_LE(worst, 2 * 2 * lr);
  }
  world().barrier();
  {  // one rank's files back under the layout: bitwise the same weights, and the same continuation
    Backend be(host(), "megatron", cfg);
    rlh_model* m = be.load(model, true);
    sdk::check(be.api()->load_state(be.raw(), m, again.c_str()), "load_state under " + tag);
    EXPECT_TRUE(be.weights(m) == saved) << "one rank's state loaded under " << tag << ": not bitwise";
    for (int s = 0; s < 2; ++s)
      EXPECT_EQ(be.train(m, mine, g_tok, g_seq, nll_loss(), {}).r.loss, cont_loss[size_t(s)]) << "step " << s;
    EXPECT_TRUE(be.weights(m) == cont) << "resumed under " << tag << ": not bitwise";
  }
  world().barrier();
  if (R == 0) fs::remove_all(root);
}

}  // namespace rlh::test
