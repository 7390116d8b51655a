// comm_nccl on one rank (label gpu): every collective on device tensors of every dtype NCCL
// takes, host tensors staged through the device, a split, argument errors, and a call that
// passes its deadline (the communicator is aborted, later calls are refused by name). Without
// NCCL or a GPU every test skips with the plugin's reason; the refusal itself is checked.
//
// The deadline test poisons the process's communicators (as any failure does): it runs last.
#include <cuda_runtime_api.h>

#include <chrono>
#include <iostream>
#include <thread>

#include "comm_test_util.hpp"

namespace {

using commtest::all_dtypes;
using commtest::DT;
using commtest::outcome;
using commtest::Tensor;

struct Env {
  rlhost_t* host = nullptr;
  const rlh_comm_api* api = nullptr;
  rlh_comm* comm = nullptr;
  std::string why;  // non-empty: comm_nccl cannot run here
};

// The plugin: $RLH_COMM_NCCL_PLUGIN, else $RLH_TEST_PLUGIN_DIR/libcomm_nccl.so (the device
// scripts carry binaries away from the build tree), else the build's.
std::string plugin_path() {
  if (const char* p = std::getenv("RLH_COMM_NCCL_PLUGIN")) return p;
  if (const char* d = std::getenv("RLH_TEST_PLUGIN_DIR")) return std::string(d) + "/libcomm_nccl.so";
  return COMM_NCCL_PLUGIN;
}

Env& env() {
  static Env e = [] {
    Env x;
    rlh::sdk::check(rlhost_create(&x.host));
    rlh::sdk::check(rlhost_load_plugin(x.host, plugin_path().c_str()));
    const std::string yaml = "rlhost:\n  comm: comm_nccl\n  comm_timeout_s: 20\n";
    rlh::sdk::check(rlhost_load_config_text(x.host, yaml.data(), yaml.size(), "test"));
    const rlh_host_api* h = rlhost_services(x.host);
    rlh_status* s = h->get_comm(h->ctx, &x.api, &x.comm);
    if (s != nullptr) {
      x.why = outcome(s);
      x.comm = nullptr;
    }
    return x;
  }();
  return e;
}

#define NEED_NCCL()                                                      \
  do {                                                                   \
    if (!env().why.empty()) GTEST_SKIP() << "comm_nccl: " << env().why; \
  } while (0)

const rlh_comm_api& A() { return *env().api; }
rlh_comm* W() { return env().comm; }

// A device copy of a host tensor (same shape, dtype, strides), with the bytes back on request.
struct DeviceTensor {
  const Tensor& host;
  void* ptr = nullptr;
  rlh_tensor t{};
  explicit DeviceTensor(const Tensor& h) : host(h) {
    EXPECT_EQ(cudaMalloc(&ptr, h.bytes.size()), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(ptr, h.bytes.data(), h.bytes.size(), cudaMemcpyHostToDevice), cudaSuccess);
    t = h.t;
    t.data = ptr;
    t.device = {RLH_DEVICE_CUDA, 0};
  }
  ~DeviceTensor() { cudaFree(ptr); }
  void read_into(Tensor& h) const {
    EXPECT_EQ(cudaMemcpy(h.bytes.data(), ptr, h.bytes.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  }
  const rlh_tensor* p() const { return &t; }
};

double input(const DT& d, size_t i) {
  if (d.is_float) return 0.5 + static_cast<double>(i % 8) * 0.25 - 1.0;
  return static_cast<double>(i % 5) + 1;
}

TEST(CommNccl, RefusalNamesTheReasonWhereItCannotRun) {
  if (env().why.empty()) GTEST_SKIP() << "comm_nccl runs here (the refusal is for machines without NCCL or a GPU)";
  // One line, UNAVAILABLE, saying what is missing.
  EXPECT_NE(env().why.find("UNAVAILABLE"), std::string::npos) << env().why;
  EXPECT_EQ(env().why.find('\n'), std::string::npos) << env().why;
  EXPECT_TRUE(env().why.find("CUDA") != std::string::npos || env().why.find("libnccl") != std::string::npos ||
              env().why.find("GPU") != std::string::npos)
      << env().why;
}

TEST(CommNccl, WorldOfOneOnTheGpu) {
  NEED_NCCL();
  EXPECT_EQ(A().size(W()), 1);
  EXPECT_EQ(A().rank(W()), 0);
  EXPECT_EQ(outcome(A().barrier(W())), "");
}

TEST(CommNccl, EveryCollectiveOnDeviceTensors) {
  NEED_NCCL();
  for (const DT& d : all_dtypes()) {  // float16 too: NCCL reduces it natively
    Tensor h(d, {3, 4});
    for (size_t i = 0; i < h.numel(); ++i) h.set(i, input(d, i));
    for (int32_t op : {RLH_REDUCE_SUM, RLH_REDUCE_MAX, RLH_REDUCE_MIN, RLH_REDUCE_AVG}) {
      DeviceTensor t(h);
      ASSERT_EQ(outcome(A().all_reduce(W(), t.p(), op, nullptr)), "") << d.name << " op " << op;
      Tensor back(d, {3, 4});
      t.read_into(back);
      for (size_t i = 0; i < h.numel(); ++i) ASSERT_EQ(back.at(i), h.at(i)) << d.name << " op " << op;
    }
    Tensor zeros(d, {3, 4});
    DeviceTensor in(h), out(zeros);
    ASSERT_EQ(outcome(A().all_gather(W(), in.p(), out.p(), nullptr)), "") << d.name;
    Tensor back(d, {3, 4});
    out.read_into(back);
    for (size_t i = 0; i < h.numel(); ++i) ASSERT_EQ(back.at(i), h.at(i)) << d.name;
    DeviceTensor rs_out(zeros);
    ASSERT_EQ(outcome(A().reduce_scatter(W(), in.p(), rs_out.p(), RLH_REDUCE_SUM, nullptr)), "") << d.name;
    rs_out.read_into(back);
    for (size_t i = 0; i < h.numel(); ++i) ASSERT_EQ(back.at(i), h.at(i)) << d.name;
    DeviceTensor b(h);
    ASSERT_EQ(outcome(A().broadcast(W(), b.p(), 0, nullptr)), "") << d.name;
    b.read_into(back);
    for (size_t i = 0; i < h.numel(); ++i) ASSERT_EQ(back.at(i), h.at(i)) << d.name;
    DeviceTensor a2a(zeros);
    ASSERT_EQ(outcome(A().all_to_all(W(), in.p(), a2a.p(), nullptr)), "") << d.name;
    a2a.read_into(back);
    for (size_t i = 0; i < h.numel(); ++i) ASSERT_EQ(back.at(i), h.at(i)) << d.name;
  }
}

TEST(CommNccl, HostTensorsAreStagedThroughTheDevice) {
  NEED_NCCL();
  const DT& f32 = all_dtypes()[0];
  Tensor t(f32, {1000});
  for (size_t i = 0; i < t.numel(); ++i) t.set(i, input(f32, i));
  ASSERT_EQ(outcome(A().all_reduce(W(), t.p(), RLH_REDUCE_SUM, nullptr)), "");
  for (size_t i = 0; i < t.numel(); ++i) ASSERT_EQ(t.at(i), input(f32, i));
  Tensor out(f32, {1000});
  ASSERT_EQ(outcome(A().all_gather(W(), t.p(), out.p(), nullptr)), "");
  for (size_t i = 0; i < t.numel(); ++i) ASSERT_EQ(out.at(i), input(f32, i));
}

TEST(CommNccl, OnTheCallersStream) {
  NEED_NCCL();
  cudaStream_t s = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  const DT& f32 = all_dtypes()[0];
  Tensor h(f32, {1 << 16});
  for (size_t i = 0; i < h.numel(); ++i) h.set(i, input(f32, i));
  DeviceTensor t(h);
  ASSERT_EQ(outcome(A().all_reduce(W(), t.p(), RLH_REDUCE_MAX, s)), "");
  Tensor back(f32, {1 << 16});
  t.read_into(back);
  for (size_t i = 0; i < h.numel(); ++i) ASSERT_EQ(back.at(i), h.at(i));
  cudaStreamDestroy(s);
}

TEST(CommNccl, SplitGivesAGroupOfOne) {
  NEED_NCCL();
  rlh_comm* sub = nullptr;
  ASSERT_EQ(outcome(A().split(W(), 3, 0, &sub)), "");
  ASSERT_NE(sub, nullptr);
  EXPECT_EQ(A().size(sub), 1);
  EXPECT_EQ(A().rank(sub), 0);
  const DT& f32 = all_dtypes()[0];
  Tensor h(f32, {8});
  for (size_t i = 0; i < 8; ++i) h.set(i, double(i));
  DeviceTensor t(h);
  EXPECT_EQ(outcome(A().all_reduce(sub, t.p(), RLH_REDUCE_SUM, nullptr)), "");
  A().destroy(sub);
  // A negative color is refused by name on every rank alike.
  rlh_comm* bad = nullptr;
  const std::string s = outcome(A().split(W(), -2, 0, &bad));
  EXPECT_NE(s.find("INVALID_ARGUMENT"), std::string::npos) << s;
  EXPECT_NE(s.find("color -2"), std::string::npos) << s;
}

TEST(CommNccl, ArgumentErrorsNameWhatIsWrong) {
  NEED_NCCL();
  const DT& f32 = all_dtypes()[0];
  Tensor in(f32, {4}), out(f32, {5});
  DeviceTensor din(in), dout(out);
  std::string s = outcome(A().all_gather(W(), din.p(), dout.p(), nullptr));
  EXPECT_NE(s.find("INVALID_ARGUMENT"), std::string::npos) << s;
  EXPECT_NE(s.find("all_gather"), std::string::npos) << s;
  s = outcome(A().broadcast(W(), din.p(), 1, nullptr));
  EXPECT_NE(s.find("root 1 is not a rank"), std::string::npos) << s;
  s = outcome(A().send(W(), din.p(), 0, nullptr));
  EXPECT_NE(s.find("peer 0 is not another rank"), std::string::npos) << s;
  int count = 0;
  cudaGetDeviceCount(&count);
  rlh_tensor elsewhere = *din.p();
  elsewhere.device = {RLH_DEVICE_CUDA, count};  // a GPU the communicator is not on
  s = outcome(A().all_reduce(W(), &elsewhere, RLH_REDUCE_SUM, nullptr));
  EXPECT_NE(s.find("but the communicator is on cuda:0"), std::string::npos) << s;
  // COMM 0.2's recv_any: the slot is there and says NCCL has no receive from any source.
  ASSERT_TRUE(RLH_HAS_FIELD(&A(), rlh_comm_api, recv_any) && A().recv_any != nullptr);
  int32_t peer = 5;
  s = outcome(A().recv_any(W(), din.p(), &peer, nullptr));
  EXPECT_NE(s.find("UNIMPLEMENTED: comm_nccl: recv_any: NCCL has no receive from any source"), std::string::npos) << s;
  EXPECT_EQ(peer, -1);
}

// Last: a deadline passed aborts the communicator and poisons the process's communicators. One
// rank has no peer to miss, so the stream is held by a host function past the deadline instead.
void CUDART_CB sleep_on_stream(void*) { std::this_thread::sleep_for(std::chrono::milliseconds(2000)); }

TEST(CommNccl, ZzDeadlineAbortsAndLaterCallsAreRefused) {
  NEED_NCCL();
  cudaStream_t s = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  const DT& f32 = all_dtypes()[0];
  Tensor h(f32, {64});
  DeviceTensor t(h);
  ASSERT_EQ(cudaLaunchHostFunc(s, sleep_on_stream, nullptr), cudaSuccess);
  A().set_timeout_ms(W(), 200);
  const auto t0 = std::chrono::steady_clock::now();
  const std::string r = outcome(A().all_reduce(W(), t.p(), RLH_REDUCE_SUM, s));
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_NE(r.find("DEADLINE_EXCEEDED"), std::string::npos) << r;
  EXPECT_NE(r.find("timed out after 0.2 s"), std::string::npos) << r;
  EXPECT_EQ(r.find('\n'), std::string::npos) << r;
  // Bounded: the deadline, plus whatever ncclCommAbort waits for on the device (at most the
  // 2 s the stream is held).
  EXPECT_LT(waited, 10.0);
  RecordProperty("seconds_to_fail", std::to_string(waited));
  std::cout << "deadline of 0.2 s: the call returned after " << waited << " s\n";
  cudaStreamSynchronize(s);
  const std::string later = outcome(A().barrier(W()));
  EXPECT_NE(later.find("ABORTED"), std::string::npos) << later;
  EXPECT_NE(later.find("unusable after an earlier failure"), std::string::npos) << later;
  cudaStreamDestroy(s);
}

}  // namespace
