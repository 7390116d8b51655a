// comm_mpi's collectives on CPU ranks, against references each rank computes locally from the
// inputs every rank is known to hold. Runs under `mpirun -np N` (ctest: N = 2 and 4) and alone
// (a world of one without MPI). Every collective, every dtype, every reduction; in-place
// forms; split groups; argument errors that name what is wrong.
#include <algorithm>
#include <numeric>

#include "comm_test_util.hpp"

namespace {

using commtest::all_dtypes;
using commtest::DT;
using commtest::outcome;
using commtest::Tensor;

commtest::World g_world;

const rlh_comm_api& A() { return *g_world.api; }
rlh_comm* W() { return g_world.comm; }

// Rank r's input element i: small values that every dtype holds exactly (and whose sums of up
// to 4 ranks too), different per rank and per element.
double input(const DT& d, int r, size_t i) {
  if (d.is_float) return (r + 1) * 0.5 + static_cast<double>(i % 8) * 0.25 - 1.0;
  if (std::string(d.name) == "uint8") return static_cast<double>(r + i % 5);
  return static_cast<double>(r * 3 - static_cast<int>(i % 7));
}

double reduce(int32_t op, const DT& d, int size, size_t i) {
  double acc = input(d, 0, i);
  for (int r = 1; r < size; ++r) {
    const double x = input(d, r, i);
    acc = op == RLH_REDUCE_MAX ? std::max(acc, x) : op == RLH_REDUCE_MIN ? std::min(acc, x) : acc + x;
  }
  if (op == RLH_REDUCE_AVG) acc = d.is_float ? acc / size : std::trunc(acc / size);
  return acc;
}

bool reducible(const DT& d) { return std::string(d.name) != "float16"; }

TEST(CommMpi, WorldMatchesTheLauncher) {
  const char* size = std::getenv("OMPI_COMM_WORLD_SIZE");
  const char* rank = std::getenv("OMPI_COMM_WORLD_RANK");
  EXPECT_EQ(g_world.size(), size != nullptr ? std::atoi(size) : 1);
  EXPECT_EQ(g_world.rank(), rank != nullptr ? std::atoi(rank) : 0);
}

TEST(CommMpi, AllReduceEveryDtypeAndOp) {
  const int R = g_world.rank(), N = g_world.size();
  for (const DT& d : all_dtypes()) {
    if (!reducible(d)) continue;
    for (int32_t op : {RLH_REDUCE_SUM, RLH_REDUCE_MAX, RLH_REDUCE_MIN, RLH_REDUCE_AVG}) {
      Tensor t(d, {3, 5});
      for (size_t i = 0; i < t.numel(); ++i) t.set(i, input(d, R, i));
      ASSERT_EQ(outcome(A().all_reduce(W(), t.p(), op, nullptr)), "") << d.name << " " << op;
      for (size_t i = 0; i < t.numel(); ++i)
        ASSERT_EQ(t.at(i), reduce(op, d, N, i)) << d.name << " op " << op << " element " << i;
    }
  }
}

TEST(CommMpi, Float16ReductionIsRefusedButMoved) {
  const DT& f16 = all_dtypes().back();
  Tensor t(f16, {4});
  const std::string s = outcome(A().all_reduce(W(), t.p(), RLH_REDUCE_SUM, nullptr));
  EXPECT_NE(s.find("UNIMPLEMENTED"), std::string::npos) << s;
  EXPECT_NE(s.find("float16 reductions are not implemented"), std::string::npos) << s;
  const int N = g_world.size(), R = g_world.rank();
  Tensor in(f16, {2}), out(f16, {2 * static_cast<int64_t>(N)});
  in.set(0, R + 0.5);
  in.set(1, -R);
  ASSERT_EQ(outcome(A().all_gather(W(), in.p(), out.p(), nullptr)), "");
  for (int r = 0; r < N; ++r) {
    EXPECT_EQ(out.at(2 * static_cast<size_t>(r)), r + 0.5);
    EXPECT_EQ(out.at(2 * static_cast<size_t>(r) + 1), -r);
  }
}

TEST(CommMpi, AllGatherEveryDtype) {
  const int R = g_world.rank(), N = g_world.size();
  for (const DT& d : all_dtypes()) {
    Tensor in(d, {2, 3}), out(d, {2 * static_cast<int64_t>(N), 3});
    for (size_t i = 0; i < in.numel(); ++i) in.set(i, input(d, R, i));
    ASSERT_EQ(outcome(A().all_gather(W(), in.p(), out.p(), nullptr)), "") << d.name;
    for (int r = 0; r < N; ++r)
      for (size_t i = 0; i < in.numel(); ++i) ASSERT_EQ(out.at(r * in.numel() + i), input(d, r, i)) << d.name;
  }
}

TEST(CommMpi, AllGatherInPlace) {
  const int R = g_world.rank(), N = g_world.size();
  const DT& d = all_dtypes()[0];
  Tensor out(d, {4 * static_cast<int64_t>(N)});
  for (size_t i = 0; i < 4; ++i) out.set(4 * static_cast<size_t>(R) + i, input(d, R, i));
  // `in` is this rank's block of `out`.
  int64_t shape = 4, stride = 1;
  rlh_tensor in = out.t;
  in.data = out.bytes.data() + 4 * static_cast<size_t>(R) * d.bytes;
  in.shape = &shape;
  in.strides = &stride;
  ASSERT_EQ(outcome(A().all_gather(W(), &in, out.p(), nullptr)), "");
  for (int r = 0; r < N; ++r)
    for (size_t i = 0; i < 4; ++i) ASSERT_EQ(out.at(4 * static_cast<size_t>(r) + i), input(d, r, i));
}

TEST(CommMpi, ReduceScatterEveryDtypeAndOp) {
  const int R = g_world.rank(), N = g_world.size();
  for (const DT& d : all_dtypes()) {
    if (!reducible(d)) continue;
    for (int32_t op : {RLH_REDUCE_SUM, RLH_REDUCE_MAX, RLH_REDUCE_MIN, RLH_REDUCE_AVG}) {
      Tensor in(d, {3 * static_cast<int64_t>(N), 2}), out(d, {3, 2});
      for (size_t i = 0; i < in.numel(); ++i) in.set(i, input(d, R, i));
      ASSERT_EQ(outcome(A().reduce_scatter(W(), in.p(), out.p(), op, nullptr)), "") << d.name;
      for (size_t i = 0; i < out.numel(); ++i)
        ASSERT_EQ(out.at(i), reduce(op, d, N, R * out.numel() + i)) << d.name << " op " << op << " element " << i;
    }
  }
}

TEST(CommMpi, BroadcastFromEveryRoot) {
  const int R = g_world.rank(), N = g_world.size();
  for (const DT& d : all_dtypes()) {
    for (int root = 0; root < N; ++root) {
      Tensor t(d, {7});
      for (size_t i = 0; i < t.numel(); ++i) t.set(i, input(d, R, i));
      ASSERT_EQ(outcome(A().broadcast(W(), t.p(), root, nullptr)), "") << d.name;
      for (size_t i = 0; i < t.numel(); ++i) ASSERT_EQ(t.at(i), input(d, root, i)) << d.name << " root " << root;
    }
  }
}

TEST(CommMpi, SendRecvRing) {
  const int R = g_world.rank(), N = g_world.size();
  if (N == 1) GTEST_SKIP() << "send/recv need two ranks (a rank cannot send to itself)";
  for (const DT& d : all_dtypes()) {
    Tensor out(d, {5}), in(d, {5});
    for (size_t i = 0; i < out.numel(); ++i) out.set(i, input(d, R, i));
    const int next = (R + 1) % N, prev = (R + N - 1) % N;
    // Even ranks send first, odd ranks receive first: no cycle of waiting sends.
    if (R % 2 == 0) {
      ASSERT_EQ(outcome(A().send(W(), out.p(), next, nullptr)), "");
      ASSERT_EQ(outcome(A().recv(W(), in.p(), prev, nullptr)), "");
    } else {
      ASSERT_EQ(outcome(A().recv(W(), in.p(), prev, nullptr)), "");
      ASSERT_EQ(outcome(A().send(W(), out.p(), next, nullptr)), "");
    }
    for (size_t i = 0; i < in.numel(); ++i) ASSERT_EQ(in.at(i), input(d, prev, i)) << d.name;
  }
}

// COMM 0.2's recv_any: rank 0 serves every other rank, each sending whenever it likes. Every
// message arrives once, each sender's in its order, and a message of the wrong count is taken and
// named without disturbing the next one.
TEST(CommMpi, RecvAnyFromEverySender) {
  const int R = g_world.rank(), N = g_world.size();
  ASSERT_TRUE(RLH_HAS_FIELD(&A(), rlh_comm_api, recv_any) && A().recv_any != nullptr);
  const DT& i64 = all_dtypes()[4];
  ASSERT_EQ(std::string(i64.name), "int64");
  Tensor t(i64, {3});
  int32_t peer = 7;
  if (N == 1) {
    const std::string s = outcome(A().recv_any(W(), t.p(), &peer, nullptr));
    EXPECT_NE(s.find("INVALID_ARGUMENT: comm_mpi: recv_any: group 'world' (1 rank) has no other rank to receive from"),
              std::string::npos)
        << s;
    EXPECT_EQ(peer, -1);
    return;
  }
  constexpr int kEach = 3;
  if (R != 0) {
    for (int i = 0; i < kEach; ++i) {
      for (size_t j = 0; j < 3; ++j) t.set(j, R * 100 + i * 10 + static_cast<int>(j));
      ASSERT_EQ(outcome(A().send(W(), t.p(), 0, nullptr)), "");
    }
    Tensor wrong(i64, {5});
    ASSERT_EQ(outcome(A().send(W(), wrong.p(), 0, nullptr)), "");
    t.set(0, -R);
    ASSERT_EQ(outcome(A().send(W(), t.p(), 0, nullptr)), "");
  } else {
    // The senders race each other, so one sender's wrong or last message may come before another
    // sender's first: each sender's messages are followed in its own order (kEach good ones, the
    // 5-element one refused by count and naming the sender, then its last one intact).
    std::vector<int> next(static_cast<size_t>(N), 0);  // each sender's next message number
    for (int m = 0; m < (kEach + 2) * (N - 1); ++m) {
      peer = -1;
      const std::string s = outcome(A().recv_any(W(), t.p(), &peer, nullptr));
      int from = peer;
      if (!s.empty()) {
        EXPECT_NE(s.find("INVALID_ARGUMENT: comm_mpi: recv_any (int64 x 3 from any rank) on group 'world'"), std::string::npos) << s;
        EXPECT_NE(s.find(" sent 5 elements, this rank expected 3"), std::string::npos) << s;
        const size_t at = s.find(": world rank ");
        ASSERT_NE(at, std::string::npos) << s;
        from = std::atoi(s.c_str() + at + 13);
      }
      ASSERT_TRUE(from >= 1 && from < N) << from << " " << s;
      const int i = next[static_cast<size_t>(from)]++;
      if (i < kEach) {
        ASSERT_EQ(s, "") << "rank " << from << "'s message " << i;
        for (size_t j = 0; j < 3; ++j) ASSERT_EQ(t.at(j), from * 100 + i * 10 + static_cast<int>(j)) << "from " << from;
      } else if (i == kEach) {
        EXPECT_NE(s, "") << "rank " << from << "'s 5-element message was taken as 3";
      } else {
        ASSERT_EQ(i, kEach + 1) << "rank " << from << " sent more than " << kEach + 2;
        EXPECT_EQ(s, "") << "rank " << from << "'s last message";
        EXPECT_EQ(t.at(0), -from);
      }
    }
    for (int p = 1; p < N; ++p) EXPECT_EQ(next[static_cast<size_t>(p)], kEach + 2) << p;
    EXPECT_NE(outcome(A().recv_any(W(), t.p(), nullptr, nullptr)).find("recv_any: peer is NULL"), std::string::npos);
  }
  // Nothing is left pending: the world is in step.
  EXPECT_EQ(outcome(A().barrier(W())), "");
}

TEST(CommMpi, AllToAllEveryDtype) {
  const int R = g_world.rank(), N = g_world.size();
  for (const DT& d : all_dtypes()) {
    // Block j of rank r's input (2 rows of 3) is tagged with (r, j).
    Tensor in(d, {2 * static_cast<int64_t>(N), 3}), out(d, {2 * static_cast<int64_t>(N), 3});
    for (int j = 0; j < N; ++j)
      for (size_t i = 0; i < 6; ++i) in.set(6 * static_cast<size_t>(j) + i, input(d, R, i) + j % 2);
    ASSERT_EQ(outcome(A().all_to_all(W(), in.p(), out.p(), nullptr)), "") << d.name;
    // Block j of the output came from rank j, which sent its block R.
    for (int j = 0; j < N; ++j)
      for (size_t i = 0; i < 6; ++i) ASSERT_EQ(out.at(6 * static_cast<size_t>(j) + i), input(d, j, i) + R % 2) << d.name;
  }
}

TEST(CommMpi, BarrierAndEmptyTensors) {
  EXPECT_EQ(outcome(A().barrier(W())), "");
  const DT& d = all_dtypes()[0];
  Tensor e(d, {0, 4}), e2(d, {0, 4});
  EXPECT_EQ(outcome(A().all_reduce(W(), e.p(), RLH_REDUCE_SUM, nullptr)), "");
  EXPECT_EQ(outcome(A().all_gather(W(), e.p(), e2.p(), nullptr)), "");
  EXPECT_EQ(outcome(A().broadcast(W(), e.p(), 0, nullptr)), "");
}

TEST(CommMpi, SplitEvenOddWithReversedKeys) {
  const int R = g_world.rank(), N = g_world.size();
  rlh_comm* sub = nullptr;
  // Ranks with the same parity form a group, ordered by descending world rank.
  ASSERT_EQ(outcome(A().split(W(), R % 2, N - R, &sub)), "");
  ASSERT_NE(sub, nullptr);
  std::vector<int> members;
  for (int r = N - 1; r >= 0; --r)
    if (r % 2 == R % 2) members.push_back(r);
  EXPECT_EQ(A().size(sub), static_cast<int>(members.size()));
  EXPECT_EQ(A().rank(sub), static_cast<int>(std::find(members.begin(), members.end(), R) - members.begin()));
  const DT& d = all_dtypes()[3];  // int32
  Tensor t(d, {1});
  t.set(0, R);
  ASSERT_EQ(outcome(A().all_reduce(sub, t.p(), RLH_REDUCE_SUM, nullptr)), "");
  EXPECT_EQ(t.at(0), std::accumulate(members.begin(), members.end(), 0));
  // Gather order follows the group's ranks.
  Tensor g(d, {static_cast<int64_t>(members.size())});
  t.set(0, R);
  ASSERT_EQ(outcome(A().all_gather(sub, t.p(), g.p(), nullptr)), "");
  for (size_t i = 0; i < members.size(); ++i) EXPECT_EQ(g.at(i), members[i]);
  // A split of the split: every rank alone.
  rlh_comm* solo = nullptr;
  ASSERT_EQ(outcome(A().split(sub, A().rank(sub), 0, &solo)), "");
  EXPECT_EQ(A().size(solo), 1);
  EXPECT_EQ(A().rank(solo), 0);
  t.set(0, 5);
  ASSERT_EQ(outcome(A().all_reduce(solo, t.p(), RLH_REDUCE_AVG, nullptr)), "");
  EXPECT_EQ(t.at(0), 5);
  A().destroy(solo);
  A().destroy(sub);
  // The world still works after its splits are gone.
  EXPECT_EQ(outcome(A().barrier(W())), "");
}

TEST(CommMpi, NegativeColorFailsEveryRankAlike) {
  const int R = g_world.rank(), N = g_world.size();
  rlh_comm* sub = nullptr;
  const std::string s = outcome(A().split(W(), R == N - 1 ? -1 : 0, 0, &sub));
  EXPECT_EQ(sub, nullptr);
  EXPECT_NE(s.find("INVALID_ARGUMENT"), std::string::npos) << s;
  if (N > 1) {
    EXPECT_NE(s.find("rank " + std::to_string(N - 1) + " passed color -1"), std::string::npos) << s;
  }
  EXPECT_EQ(outcome(A().barrier(W())), "");  // nothing left pending
}

TEST(CommMpi, ArgumentErrorsNameTheArgument) {
  const DT& f = all_dtypes()[0];
  const int N = g_world.size();
  Tensor a(f, {4}), wrong(f, {4 * static_cast<int64_t>(N) + 1});
  std::string s = outcome(A().all_gather(W(), a.p(), wrong.p(), nullptr));
  EXPECT_NE(s.find("all_gather: out has shape [" + std::to_string(4 * N + 1) + "], expected in's [4] with dim 0 times the group size"),
            std::string::npos)
      << s;
  s = outcome(A().all_reduce(W(), a.p(), 7, nullptr));
  EXPECT_NE(s.find("reduction 7 is not one of"), std::string::npos) << s;
  s = outcome(A().broadcast(W(), a.p(), N, nullptr));
  EXPECT_NE(s.find("broadcast: root " + std::to_string(N) + " is not a rank of group 'world'"), std::string::npos) << s;
  s = outcome(A().send(W(), a.p(), g_world.rank(), nullptr));
  EXPECT_NE(s.find("is not another rank of group"), std::string::npos) << s;
  Tensor strided(f, {2, 2});
  strided.strides = {1, 2};
  s = outcome(A().all_reduce(W(), strided.p(), RLH_REDUCE_SUM, nullptr));
  EXPECT_NE(s.find("tensor: not contiguous"), std::string::npos) << s;
  Tensor i32(all_dtypes()[3], {4 * static_cast<int64_t>(N)});
  s = outcome(A().all_gather(W(), a.p(), i32.p(), nullptr));
  EXPECT_NE(s.find("in is float32 but out is int32"), std::string::npos) << s;
  rlh_tensor odd = a.t;
  odd.dtype = {RLH_DTYPE_COMPLEX, 64, 1};
  s = outcome(A().all_reduce(W(), &odd, RLH_REDUCE_SUM, nullptr));
  EXPECT_NE(s.find("is not one of float32"), std::string::npos) << s;
  rlh_tensor gpu = a.t;
  gpu.device = {RLH_DEVICE_CUDA, 0};
  s = outcome(A().all_reduce(W(), &gpu, RLH_REDUCE_SUM, nullptr));
#ifndef RLH_TEST_HAVE_CUDA
  // Built without CUDA, a device tensor is refused before any rank enters the collective.
  if (N > 1) {
    EXPECT_NE(s.find("built without the CUDA toolkit"), std::string::npos) << s;
  }
#endif
  // Nothing above entered a collective on one rank only: the world is still in step.
  EXPECT_EQ(outcome(A().barrier(W())), "");
}

TEST(CommMpi, TimeoutIsSettable) {
  A().set_timeout_ms(W(), 5000);
  EXPECT_EQ(outcome(A().barrier(W())), "");
  A().set_timeout_ms(W(), 0);  // back to the default
  EXPECT_EQ(outcome(A().barrier(W())), "");
}

}  // namespace

int main(int argc, char** argv) {
  testing::InitGoogleTest(&argc, argv);
  commtest::quiet_other_ranks();
  try {
    g_world.open(COMM_MPI_PLUGIN, "rlhost:\n  comm_timeout_s: 20\n");
  } catch (const std::exception& e) {
    std::cerr << "test_comm_mpi: " << e.what() << "\n";
    return 1;
  }
  const int rc = RUN_ALL_TESTS();
  // The host destroys the world; MPI is finished at exit (after a bounded barrier).
  rlhost_destroy(g_world.host);
  return rc;
}
