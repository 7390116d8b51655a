// comm_nccl's communicators and collectives (nccl_comm.hpp).
//
// Bootstrap: every rank states whether it can run (NCCL loads, its GPU is there) and which GPU
// it has; rank 0 adds an ncclUniqueId. The statements are exchanged through the host's world
// communicator under mpirun / srun --mpi=pmix, or through a TCP rendezvous at MASTER_ADDR /
// MASTER_PORT for env launches (torchrun-style, plain srun), so every rank reaches the same
// answer: all can (ncclCommInitRankConfig), or none, with UNAVAILABLE naming the first rank
// that cannot and why, or the ranks that share a GPU (NCCL refuses two ranks on one GPU;
// comm_mpi stages through the host instead).
//
// Waits: NCCL communicators are nonblocking; a call is enqueued on the caller's stream, an
// event recorded after it, and the event and NCCL's async error polled until done or the
// deadline, when the communicator is aborted (ncclCommAbort) and the process's communicators
// refuse further calls. NCCL cannot say which peer is missing: the message says so.
#include "nccl_comm.hpp"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>
#include <numeric>
#include <thread>

#include "rlhost/sdk/comm_args.hpp"
#include "rlhost/sdk/launch_env.hpp"
#include "rlhost/sdk/rendezvous.hpp"
#include "rlhost/sdk/status.hpp"

namespace rlh::comm_nccl {
namespace {

using Clock = std::chrono::steady_clock;
using sdk::Error;
using sdk::comm::DType;
using sdk::comm::View;

std::mutex g_mu;  // one call at a time in the process
bool g_failed = false;
std::string g_failure;
int g_world_rank = 0;

// ---- small helpers --------------------------------------------------------------------------

std::string cuda_text(cudaError_t e) { return cudaGetErrorString(e); }

void cuda_check(cudaError_t e, const std::string& what) {
  if (e == cudaSuccess) return;
  cudaGetLastError();
  throw Error(RLH_E_INTERNAL, "comm_nccl: " + what + ": " + cuda_text(e));
}

struct DeviceScope {
  int previous = -1;
  explicit DeviceScope(int device) {
    cudaGetDevice(&previous);
    if (previous != device) cuda_check(cudaSetDevice(device), "cudaSetDevice(" + std::to_string(device) + ")");
  }
  ~DeviceScope() {
    int now = -1;
    if (previous >= 0 && cudaGetDevice(&now) == cudaSuccess && now != previous) cudaSetDevice(previous);
  }
};

void nap(unsigned iter) {
  if (iter < 64) return;
  if (iter < 512) {
    std::this_thread::yield();
    return;
  }
  std::this_thread::sleep_for(std::chrono::microseconds(std::min<unsigned>(200, 10 + (iter - 512) / 8)));
}

bool cancelled(const rlh_comm& c) {
  const rlh_host_api* h = c.host;
  return h != nullptr && h->is_cancelled != nullptr && h->is_cancelled(h->ctx) != 0;
}

std::string describe_group(const rlh_comm& c) {
  std::string s = "'" + c.name + "' (" + std::to_string(c.size) + (c.size == 1 ? " rank" : " ranks") + " on cuda:" +
                  std::to_string(c.device);
  if (c.name != "world" && c.size <= 16) {
    s += ", world ranks ";
    for (int i = 0; i < c.size; ++i) s += (i ? ", " : "") + std::to_string(c.world_ranks[static_cast<size_t>(i)]);
  }
  return s + ")";
}

struct Call {
  rlh_comm& c;
  std::string what;
  Clock::time_point deadline;
};

std::string here(const Call& k) {
  return "comm_nccl: " + k.what + " on group " + describe_group(k.c) + " on rank " + std::to_string(g_world_rank);
}

[[noreturn]] void fail(Call& k, rlh_code code, const std::string& msg) {
  const Nccl* n = nccl();
  if (n != nullptr && k.c.comm != nullptr && !k.c.aborted) {
    n->CommAbort(k.c.comm);  // frees the communicator's kernels and peers' connections
    k.c.aborted = true;
  }
  if (!g_failed) {
    g_failed = true;
    g_failure = msg;
  }
  throw Error(code, msg);
}

Call begin(rlh_comm* c, const std::string& what) {
  if (c == nullptr) throw Error(RLH_E_INVALID_ARGUMENT, "comm_nccl: " + what + ": communicator is NULL");
  if (g_failed)
    throw Error(RLH_E_ABORTED, "comm_nccl: " + what + " on group " + describe_group(*c) +
                                   " refused: the communicators of this process are unusable after an earlier failure: " + g_failure);
  return Call{*c, what, Clock::now() + std::chrono::milliseconds(c->timeout_ms)};
}

// Waits until NCCL has left ncclInProgress for `comm` (a nonblocking init, split or enqueue).
void settle(Call& k, ncclComm_t comm, ncclResult_t r) {
  const Nccl* n = nccl();
  unsigned iter = 0;
  while (r == ncclInProgress) {
    if (Clock::now() >= k.deadline)
      fail(k, RLH_E_DEADLINE_EXCEEDED, here(k) + " timed out after " + sdk::comm::seconds_text(k.c.timeout_ms) +
                                           " while NCCL set it up (a rank did not join; NCCL cannot say which)");
    if (cancelled(k.c)) fail(k, RLH_E_CANCELLED, here(k) + " stopped: the job was cancelled (SIGINT or SIGTERM)");
    nap(iter++);
    n->CommGetAsyncError(comm, &r);
  }
  if (r != ncclSuccess) fail(k, RLH_E_ABORTED, here(k) + " failed: " + nccl_error(r, comm));
}

// Waits for everything enqueued on `stream` by the call.
void wait_stream(Call& k, cudaStream_t stream) {
  const Nccl* n = nccl();
  rlh_comm& c = k.c;
  cuda_check(cudaEventRecord(c.done, stream), "recording the completion event");
  unsigned iter = 0;
  while (true) {
    const cudaError_t q = cudaEventQuery(c.done);
    if (q == cudaSuccess) return;
    if (q != cudaErrorNotReady) {
      cudaGetLastError();
      fail(k, RLH_E_INTERNAL, here(k) + " failed on the device: " + cuda_text(q));
    }
    ncclResult_t st = ncclSuccess;
    n->CommGetAsyncError(c.comm, &st);
    if (st != ncclSuccess && st != ncclInProgress) fail(k, RLH_E_ABORTED, here(k) + " failed: " + nccl_error(st, c.comm));
    if (cancelled(c))
      fail(k, RLH_E_CANCELLED, here(k) + " stopped: the job was cancelled (SIGINT or SIGTERM; launchers send SIGTERM to every "
                                         "rank when one of them fails)");
    if (Clock::now() >= k.deadline)
      fail(k, RLH_E_DEADLINE_EXCEEDED, here(k) + " timed out after " + sdk::comm::seconds_text(c.timeout_ms) +
                                           ": a rank of the group did not arrive (NCCL cannot say which: the ranks that did "
                                           "print this line)");
    nap(iter++);
  }
}

ncclDataType_t nccl_type(DType d) {
  switch (d) {
    case DType::f32: return ncclFloat32;
    case DType::f64: return ncclFloat64;
    case DType::bf16: return ncclBfloat16;
    case DType::f16: return ncclFloat16;
    case DType::i32: return ncclInt32;
    case DType::i64: return ncclInt64;
    case DType::u8: return ncclUint8;
    case DType::i8: return ncclInt8;
  }
  return ncclUint8;
}

ncclRedOp_t nccl_op(int32_t op) {
  switch (op) {
    case RLH_REDUCE_MAX: return ncclMax;
    case RLH_REDUCE_MIN: return ncclMin;
    case RLH_REDUCE_AVG: return ncclAvg;
    default: return ncclSum;
  }
}

// Device memory for a tensor argument: its own when it lives on the communicator's GPU, else
// a scratch slot filled from the host (host tensors are staged through the device).
struct DeviceSide {
  void* ptr = nullptr;
  bool staged = false;
  void* host = nullptr;  // its pinned block when staged
  int slot = 0;
};

void* scratch(rlh_comm& c, int slot, size_t bytes) {
  if (c.scratch_bytes[slot] < bytes) {
    if (c.scratch[slot] != nullptr) cudaFree(c.scratch[slot]);
    c.scratch[slot] = nullptr;
    c.scratch_bytes[slot] = 0;
    const size_t want = std::max<size_t>(bytes, 1 << 20);
    cuda_check(cudaMalloc(&c.scratch[slot], want), "allocating " + std::to_string(want) + " bytes of device scratch");
    c.scratch_bytes[slot] = want;
  }
  return c.scratch[slot];
}

void check_device(const rlh_comm& c, const View& v, const char* call, const char* arg) {
  const int32_t t = v.device.device_type;
  if (sdk::comm::host_accessible(v.device)) return;
  if ((t == RLH_DEVICE_CUDA || t == RLH_DEVICE_CUDA_MANAGED) && v.device.device_id == c.device) return;
  throw Error(RLH_E_INVALID_ARGUMENT, std::string("comm_nccl: ") + call + ": " + arg + " is on " + sdk::comm::device_name(v.device) +
                                          ", but the communicator is on cuda:" + std::to_string(c.device));
}

// Host tensors travel through page-locked memory both ways. A copy between the device and
// pageable memory may block the calling thread until the stream reaches it, and behind a
// collective whose peer died that is forever (seen on two H200s: a rank killed mid-step left
// its peer stuck in the copy back, past every deadline and past SIGTERM). Copies to and from
// pinned memory are asynchronous, so the only wait is wait_stream's, bounded by the deadline.
void* pinned(rlh_comm& c, int slot, size_t bytes) {
  if (c.pinned_bytes[slot] < bytes) {
    if (c.pinned[slot] != nullptr) cudaFreeHost(c.pinned[slot]);
    c.pinned[slot] = nullptr;
    c.pinned_bytes[slot] = 0;
    const size_t want = std::max<size_t>(bytes, 1 << 20);
    cuda_check(cudaMallocHost(&c.pinned[slot], want), "allocating " + std::to_string(want) + " bytes of pinned staging");
    c.pinned_bytes[slot] = want;
  }
  return c.pinned[slot];
}

DeviceSide device_side(rlh_comm& c, const View& v, int slot, bool load, cudaStream_t s) {
  if (!sdk::comm::host_accessible(v.device)) return {v.data, false, nullptr, slot};
  void* d = scratch(c, slot, v.bytes());
  void* h = pinned(c, slot, v.bytes());
  // The previous call on this communicator waited for its stream, so the pinned block is free.
  if (load && v.bytes() > 0) {
    std::memcpy(h, v.data, v.bytes());
    cuda_check(cudaMemcpyAsync(d, h, v.bytes(), cudaMemcpyHostToDevice, s), "staging a host tensor");
  }
  return {d, true, h, slot};
}

// Enqueues the copy of a staged result into its pinned block; finish() moves it into the
// caller's tensor once wait_stream has seen the stream through.
void store_back(const View& v, const DeviceSide& d, cudaStream_t s) {
  if (d.staged && v.bytes() > 0)
    cuda_check(cudaMemcpyAsync(d.host, d.ptr, v.bytes(), cudaMemcpyDeviceToHost, s), "copying back to the host");
}

void finish(const View& v, const DeviceSide& d) {
  if (d.staged && v.bytes() > 0) std::memcpy(v.data, d.host, v.bytes());
}

std::string shape_text(const rlh_tensor* t) {
  std::string s = "[";
  for (int32_t i = 0; i < t->ndim; ++i) s += (i ? ", " : "") + std::to_string(t->shape[i]);
  return s + "]";
}

void check_gathered_shape(const rlh_tensor* small, const rlh_tensor* big, int size, const char* call, const char* sname,
                          const char* bname) {
  bool ok;
  if (small->ndim == 0) {
    ok = big->ndim == 1 && big->shape[0] == size;
  } else {
    ok = big->ndim == small->ndim && big->shape[0] == small->shape[0] * size;
    for (int32_t i = 1; ok && i < small->ndim; ++i) ok = big->shape[i] == small->shape[i];
  }
  if (!ok)
    throw Error(RLH_E_INVALID_ARGUMENT, std::string("comm_nccl: ") + call + ": " + bname + " has shape " + shape_text(big) +
                                            ", expected " + sname + "'s " + shape_text(small) +
                                            " with dim 0 times the group size " + std::to_string(size));
}

// ---- bootstrap --------------------------------------------------------------------------------

// What each rank states before NCCL starts (a plain byte blob; same layout on every rank).
struct Statement {
  uint8_t ok = 0;
  char reason[239] = {};
  uint8_t uuid[16] = {};
  ncclUniqueId id{};
};

Statement state_self(int device, bool make_id, std::string& why) {
  Statement s;
  auto refuse = [&](const std::string& r) {
    why = r;
    std::strncpy(s.reason, r.c_str(), sizeof s.reason - 1);
    return s;
  };
  std::string nccl_why;
  const Nccl* n = nccl(&nccl_why);
  if (n == nullptr) return refuse(nccl_why);
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count == 0) {
    cudaGetLastError();
    return refuse("no CUDA device (" + std::string(e != cudaSuccess ? cuda_text(e) : "none visible") + ")");
  }
  if (device >= count) return refuse("cuda:" + std::to_string(device) + " does not exist (" + std::to_string(count) + " visible)");
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, device) != cudaSuccess) {
    cudaGetLastError();
    return refuse("cannot read the properties of cuda:" + std::to_string(device));
  }
  std::memcpy(s.uuid, &prop.uuid, sizeof s.uuid);
  if (make_id) {
    const ncclResult_t r = n->GetUniqueId(&s.id);
    if (r != ncclSuccess) return refuse("ncclGetUniqueId failed: " + std::string(n->GetErrorString(r)));
  }
  s.ok = 1;
  return s;
}

std::string as_blob(const Statement& s) { return std::string(reinterpret_cast<const char*>(&s), sizeof s); }

// Everyone's statement through the host's world communicator (host tensors of bytes).
std::vector<Statement> exchange_over_host(const rlh_host_api* host, const Statement& mine, int size, int64_t timeout_ms) {
  if (host == nullptr || host->get_comm == nullptr)
    throw Error(RLH_E_UNAVAILABLE, "comm_nccl: the host has no world communicator to bootstrap over");
  const rlh_comm_api* api = nullptr;
  rlh_comm* world = nullptr;
  rlh_status* s = host->get_comm(host->ctx, &api, &world);
  if (s != nullptr) {
    sdk::StatusPtr owned(s);
    throw Error(RLH_E_UNAVAILABLE, "comm_nccl: bootstrapping over the host's world communicator: " + sdk::status_message(s));
  }
  if (api->size(world) != size)
    throw Error(RLH_E_FAILED_PRECONDITION, "comm_nccl: the host's world communicator has " + std::to_string(api->size(world)) +
                                               " ranks, the launcher started " + std::to_string(size));
  std::vector<Statement> all(static_cast<size_t>(size));
  int64_t in_shape = sizeof(Statement), out_shape = static_cast<int64_t>(sizeof(Statement)) * size, stride = 1;
  rlh_tensor in{}, out{};
  in.data = const_cast<Statement*>(&mine);
  in.device = out.device = {RLH_DEVICE_CPU, 0};
  in.ndim = out.ndim = 1;
  in.dtype = out.dtype = {RLH_DTYPE_UINT, 8, 1};
  in.shape = &in_shape;
  out.shape = &out_shape;
  in.strides = out.strides = &stride;
  out.data = all.data();
  (void)timeout_ms;  // the world communicator applies its own timeout
  sdk::check(api->all_gather(world, &in, &out, nullptr), "comm_nccl: bootstrap over the host's world communicator");
  return all;
}

std::vector<Statement> exchange_over_tcp(const sdk::LaunchEnv& env, const Statement& mine, int64_t timeout_ms) {
  if (env.master_addr.empty() || env.master_port == 0)
    throw Error(RLH_E_UNAVAILABLE, "comm_nccl: " + env.describe() + " without MASTER_ADDR and MASTER_PORT: no address to meet at");
  sdk::RendezvousOptions o;
  o.addr = env.master_addr;
  o.port = env.master_port;
  o.rank = env.rank;
  o.size = env.size;
  o.timeout = std::chrono::milliseconds(timeout_ms);
  o.tag = "comm_nccl world";
  const std::vector<std::string> blobs = sdk::rendezvous_all_gather(o, as_blob(mine));
  std::vector<Statement> all(blobs.size());
  for (size_t r = 0; r < blobs.size(); ++r) {
    if (blobs[r].size() != sizeof(Statement))
      throw Error(RLH_E_FAILED_PRECONDITION, "comm_nccl: rank " + std::to_string(r) + " sent a statement of another build");
    std::memcpy(&all[r], blobs[r].data(), sizeof(Statement));
  }
  return all;
}

rlh_comm* make_comm(const rlh_host_api* host, int device, int rank, int size, const ncclUniqueId& id, int64_t timeout) {
  const Nccl* n = nccl();
  auto c = std::make_unique<rlh_comm>();
  c->host = host;
  c->device = device;
  c->name = "world";
  c->rank = rank;
  c->size = size;
  c->timeout_ms = c->default_timeout_ms = timeout;
  c->world_ranks.resize(static_cast<size_t>(size));
  std::iota(c->world_ranks.begin(), c->world_ranks.end(), 0);
  DeviceScope scope(device);
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = 0;
  Call k{*c, "creating the world communicator", Clock::now() + std::chrono::milliseconds(timeout)};
  const ncclResult_t r = n->CommInitRankConfig(&c->comm, size, id, rank, &cfg);
  settle(k, c->comm, r);
  cuda_check(cudaEventCreateWithFlags(&c->done, cudaEventDisableTiming), "creating an event");
  return c.release();
}

}  // namespace

std::string unavailable_reason() {
  std::string why;
  if (nccl(&why) == nullptr) return why;
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count == 0) {
    cudaGetLastError();
    return "no CUDA device (" + std::string(e != cudaSuccess ? cuda_text(e) : "none visible") + ")";
  }
  return "";
}

rlh_comm* create_world(const rlh_host_api* host, const nlohmann::json& cfg) {
  if (!cfg.is_object()) throw Error(RLH_E_INVALID_ARGUMENT, "comm_nccl: create_world config must be a JSON object");
  for (const auto& [key, v] : cfg.items())
    if (key != "timeout_ms" && key != "device")
      throw Error(RLH_E_INVALID_ARGUMENT, "comm_nccl: unknown create_world config key '" + key + "' (known: timeout_ms, device)");
  const int64_t timeout = sdk::comm::initial_timeout_ms(host, cfg, kDefaultTimeoutMs);
  const sdk::LaunchEnv env = sdk::detect_launch();
  int device = -1;
  if (cfg.contains("device")) {
    const std::string d = cfg["device"].is_string() ? cfg["device"].get<std::string>() : cfg["device"].dump();
    if (d == "cpu") throw Error(RLH_E_UNIMPLEMENTED, "comm_nccl: communicators for host tensors on cpu are comm_mpi's");
    if (d.rfind("cuda:", 0) != 0 || d.size() < 6 || d.size() > 9 || d.find_first_not_of("0123456789", 5) != std::string::npos)
      throw Error(RLH_E_INVALID_ARGUMENT, "comm_nccl: device '" + d + "' is not cuda:N");
    device = std::stoi(d.substr(5));
  }
  const bool env_launch = env.launcher == sdk::Launcher::env || (env.launcher == sdk::Launcher::srun && !env.mpi_runtime);
  // Under an MPI launch the world is the MPI communicator's, and comm_nccl bootstraps over it:
  // it serves the device communicators backends ask for, never the host's world itself.
  if (env.size > 1 && !env_launch && !cfg.contains("device"))
    throw Error(RLH_E_UNAVAILABLE, "comm_nccl: under " + env.describe() +
                                       " the world communicator is an MPI one; comm_nccl makes device communicators over it "
                                       "(sdk::make_device_comm)");
  if (device < 0) {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
      cudaGetLastError();
      count = 1;  // the statement below reports the missing device
    }
    device = sdk::local_device(count, env);  // as the backends place their models
  }
  std::lock_guard<std::mutex> lk(g_mu);
  if (g_failed) throw Error(RLH_E_ABORTED, "comm_nccl: refused after an earlier failure: " + g_failure);
  g_world_rank = env.rank;
  std::string why;
  const Statement mine = state_self(device, env.rank == 0, why);
  std::vector<Statement> all;
  if (env.size == 1) {
    if (!mine.ok) throw Error(RLH_E_UNAVAILABLE, "comm_nccl: " + why);
    all = {mine};
  } else if (env_launch) {
    all = exchange_over_tcp(env, mine, timeout);
  } else {
    all = exchange_over_host(host, mine, env.size, timeout);
  }
  // The same verdict on every rank: the first that cannot, or two on one GPU.
  for (size_t r = 0; r < all.size(); ++r)
    if (!all[r].ok)
      throw Error(RLH_E_UNAVAILABLE, "comm_nccl cannot run on rank " + std::to_string(r) + ": " +
                                         std::string(all[r].reason, strnlen(all[r].reason, sizeof all[r].reason)));
  for (size_t a = 0; a < all.size(); ++a)
    for (size_t b = a + 1; b < all.size(); ++b)
      if (std::memcmp(all[a].uuid, all[b].uuid, sizeof all[a].uuid) == 0)
        throw Error(RLH_E_UNAVAILABLE, "comm_nccl: ranks " + std::to_string(a) + " and " + std::to_string(b) +
                                           " are on the same GPU, which NCCL refuses (comm_mpi stages device tensors through "
                                           "the host for several ranks on one GPU)");
  return make_comm(host, device, env.rank, env.size, all[0].id, timeout);
}

rlh_comm* split(rlh_comm* c, int32_t color, int32_t key) {
  std::lock_guard<std::mutex> lk(g_mu);
  Call k = begin(c, "split (color " + std::to_string(color) + ", key " + std::to_string(key) + ")");
  const Nccl* n = nccl();
  DeviceScope scope(c->device);
  // Everyone's (color, key) first, through the communicator itself: a bad color anywhere fails
  // every rank alike, and the new group's world ranks are known.
  int32_t* d = static_cast<int32_t*>(scratch(*c, 0, sizeof(int32_t) * 2 * (static_cast<size_t>(c->size) + 1)));
  const int32_t mine[2] = {color, key};
  cuda_check(cudaMemcpy(d + 2 * c->size, mine, sizeof mine, cudaMemcpyHostToDevice), "staging the split's color");
  settle(k, c->comm, n->AllGather(d + 2 * c->size, d, 2, ncclInt32, c->comm, cudaStreamLegacy));
  wait_stream(k, cudaStreamLegacy);
  std::vector<int32_t> all(static_cast<size_t>(2 * c->size));
  cuda_check(cudaMemcpy(all.data(), d, sizeof(int32_t) * all.size(), cudaMemcpyDeviceToHost), "reading the colors");
  for (int p = 0; p < c->size; ++p)
    if (all[static_cast<size_t>(2 * p)] < 0)
      throw Error(RLH_E_INVALID_ARGUMENT, "comm_nccl: split on group " + describe_group(*c) + ": rank " +
                                              std::to_string(c->world_ranks[static_cast<size_t>(p)]) + " passed color " +
                                              std::to_string(all[static_cast<size_t>(2 * p)]) + " (colors must be >= 0)");
  std::vector<int> members;
  for (int p = 0; p < c->size; ++p)
    if (all[static_cast<size_t>(2 * p)] == color) members.push_back(p);
  std::stable_sort(members.begin(), members.end(),
                   [&](int a, int b) { return all[static_cast<size_t>(2 * a + 1)] < all[static_cast<size_t>(2 * b + 1)]; });
  auto out = std::make_unique<rlh_comm>();
  out->host = c->host;
  out->device = c->device;
  out->name = c->name + ".split(" + std::to_string(color) + ")";
  out->size = static_cast<int>(members.size());
  out->rank = static_cast<int>(std::find(members.begin(), members.end(), c->rank) - members.begin());
  for (int p : members) out->world_ranks.push_back(c->world_ranks[static_cast<size_t>(p)]);
  out->timeout_ms = c->timeout_ms;
  out->default_timeout_ms = c->default_timeout_ms;
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = 0;
  // A nonblocking split hands the new handle over when NCCL's asynchronous init job ends (an
  // atomic store through the pointer given), not at return: the pointer is the heap object's
  // own field, so a late store never lands in a dead stack frame. Until the handle is there only
  // the deadline and the parent's state can be watched; if the deadline passes first, `out`
  // stays allocated (the job still owns the pointer) and the process's communicators are marked
  // failed.
  out->comm = nullptr;
  const ncclResult_t r = n->CommSplit(c->comm, color, key, &out->comm, &cfg);
  if (r != ncclSuccess && r != ncclInProgress) fail(k, RLH_E_ABORTED, here(k) + " failed: " + nccl_error(r, c->comm));
  unsigned iter = 0;
  while (__atomic_load_n(&out->comm, __ATOMIC_ACQUIRE) == nullptr) {
    ncclResult_t pe = ncclSuccess;
    n->CommGetAsyncError(c->comm, &pe);
    if (pe != ncclSuccess && pe != ncclInProgress) {
      out.release();
      fail(k, RLH_E_ABORTED, here(k) + " failed: " + nccl_error(pe, c->comm));
    }
    if (Clock::now() >= k.deadline) {
      out.release();
      fail(k, RLH_E_DEADLINE_EXCEEDED, here(k) + " timed out after " + sdk::comm::seconds_text(c->timeout_ms) +
                                           " while NCCL set the new group up (a rank did not join; NCCL cannot say which)");
    }
    nap(iter++);
  }
  Call k2{*out, k.what, k.deadline};
  settle(k2, out->comm, ncclInProgress);
  cuda_check(cudaEventCreateWithFlags(&out->done, cudaEventDisableTiming), "creating an event");
  return out.release();
}

void destroy(rlh_comm* c) {
  if (c == nullptr) return;
  std::lock_guard<std::mutex> lk(g_mu);
  const Nccl* n = nccl();
  {
    DeviceScope scope(c->device);
    if (n != nullptr && c->comm != nullptr && !c->aborted) {
      bool clean = !g_failed;
      if (clean) {
        // Finalize waits for the peers' last operations; bounded like any call.
        ncclResult_t r = n->CommFinalize(c->comm);
        const auto until = Clock::now() + std::chrono::milliseconds(c->timeout_ms);
        unsigned iter = 0;
        while (r == ncclInProgress && Clock::now() < until) {
          nap(iter++);
          n->CommGetAsyncError(c->comm, &r);
        }
        clean = r == ncclSuccess;
      }
      if (clean) n->CommDestroy(c->comm);
      else n->CommAbort(c->comm);
    }
    for (void* s : c->scratch)
      if (s != nullptr) cudaFree(s);
    for (void* h : c->pinned)
      if (h != nullptr) cudaFreeHost(h);
    if (c->done != nullptr) cudaEventDestroy(c->done);
  }
  delete c;
}

void all_reduce(rlh_comm* c, const rlh_tensor* t, int32_t op, void* stream) {
  const View v = sdk::comm::view_of(t, "comm_nccl: all_reduce", "tensor");
  sdk::comm::check_op(op, "comm_nccl: all_reduce");
  if (c == nullptr) throw Error(RLH_E_INVALID_ARGUMENT, "comm_nccl: all_reduce: communicator is NULL");
  check_device(*c, v, "all_reduce", "tensor");
  std::lock_guard<std::mutex> lk(g_mu);
  Call k = begin(c, std::string("all_reduce (") + sdk::comm::op_name(op) + ", " + v.describe() + ")");
  if (v.numel == 0) return;
  DeviceScope scope(c->device);
  const auto s = static_cast<cudaStream_t>(stream);
  const DeviceSide d = device_side(*c, v, 0, true, s);
  settle(k, c->comm, nccl()->AllReduce(d.ptr, d.ptr, static_cast<size_t>(v.numel), nccl_type(v.dtype), nccl_op(op), c->comm, s));
  store_back(v, d, s);
  wait_stream(k, s);
  finish(v, d);
}

void all_gather(rlh_comm* c, const rlh_tensor* in, const rlh_tensor* out, void* stream) {
  const View a = sdk::comm::view_of(in, "comm_nccl: all_gather", "in");
  const View b = sdk::comm::view_of(out, "comm_nccl: all_gather", "out");
  sdk::comm::check_same_kind(a, b, "comm_nccl: all_gather");
  if (c == nullptr) throw Error(RLH_E_INVALID_ARGUMENT, "comm_nccl: all_gather: communicator is NULL");
  check_device(*c, a, "all_gather", "in");
  check_gathered_shape(in, out, c->size, "all_gather", "in", "out");
  std::lock_guard<std::mutex> lk(g_mu);
  Call k = begin(c, "all_gather (" + a.describe() + " per rank)");
  if (b.numel == 0) return;
  DeviceScope scope(c->device);
  const auto s = static_cast<cudaStream_t>(stream);
  const DeviceSide din = device_side(*c, a, 0, true, s);
  const DeviceSide dout = device_side(*c, b, 1, false, s);
  settle(k, c->comm, nccl()->AllGather(din.ptr, dout.ptr, static_cast<size_t>(a.numel), nccl_type(a.dtype), c->comm, s));
  store_back(b, dout, s);
  wait_stream(k, s);
  finish(b, dout);
}

void reduce_scatter(rlh_comm* c, const rlh_tensor* in, const rlh_tensor* out, int32_t op, void* stream) {
  const View a = sdk::comm::view_of(in, "comm_nccl: reduce_scatter", "in");
  const View b = sdk::comm::view_of(out, "comm_nccl: reduce_scatter", "out");
  sdk::comm::check_same_kind(a, b, "comm_nccl: reduce_scatter");
  sdk::comm::check_op(op, "comm_nccl: reduce_scatter");
  if (c == nullptr) throw Error(RLH_E_INVALID_ARGUMENT, "comm_nccl: reduce_scatter: communicator is NULL");
  check_device(*c, a, "reduce_scatter", "in");
  check_gathered_shape(out, in, c->size, "reduce_scatter", "out", "in");
  std::lock_guard<std::mutex> lk(g_mu);
  Call k = begin(c, std::string("reduce_scatter (") + sdk::comm::op_name(op) + ", " + b.describe() + " per rank)");
  if (b.numel == 0) return;
  DeviceScope scope(c->device);
  const auto s = static_cast<cudaStream_t>(stream);
  const DeviceSide din = device_side(*c, a, 0, true, s);
  const DeviceSide dout = device_side(*c, b, 1, false, s);
  settle(k, c->comm, nccl()->ReduceScatter(din.ptr, dout.ptr, static_cast<size_t>(b.numel), nccl_type(b.dtype), nccl_op(op), c->comm, s));
  store_back(b, dout, s);
  wait_stream(k, s);
  finish(b, dout);
}

void broadcast(rlh_comm* c, const rlh_tensor* t, int32_t root, void* stream) {
  const View v = sdk::comm::view_of(t, "comm_nccl: broadcast", "tensor");
  if (c == nullptr) throw Error(RLH_E_INVALID_ARGUMENT, "comm_nccl: broadcast: communicator is NULL");
  check_device(*c, v, "broadcast", "tensor");
  if (root < 0 || root >= c->size)
    throw Error(RLH_E_INVALID_ARGUMENT, "comm_nccl: broadcast: root " + std::to_string(root) + " is not a rank of group " + describe_group(*c));
  std::lock_guard<std::mutex> lk(g_mu);
  Call k = begin(c, "broadcast (" + v.describe() + " from group rank " + std::to_string(root) + ")");
  if (v.numel == 0) return;
  DeviceScope scope(c->device);
  const auto s = static_cast<cudaStream_t>(stream);
  const DeviceSide d = device_side(*c, v, 0, c->rank == root, s);
  settle(k, c->comm, nccl()->Broadcast(d.ptr, d.ptr, static_cast<size_t>(v.numel), nccl_type(v.dtype), root, c->comm, s));
  if (c->rank != root) store_back(v, d, s);
  wait_stream(k, s);
  if (c->rank != root) finish(v, d);
}

void send(rlh_comm* c, const rlh_tensor* t, int32_t peer, void* stream) {
  const View v = sdk::comm::view_of(t, "comm_nccl: send", "tensor");
  if (c == nullptr) throw Error(RLH_E_INVALID_ARGUMENT, "comm_nccl: send: communicator is NULL");
  check_device(*c, v, "send", "tensor");
  if (peer < 0 || peer >= c->size || peer == c->rank)
    throw Error(RLH_E_INVALID_ARGUMENT, "comm_nccl: send: peer " + std::to_string(peer) + " is not another rank of group " + describe_group(*c));
  std::lock_guard<std::mutex> lk(g_mu);
  Call k = begin(c, "send (" + v.describe() + " to world rank " + std::to_string(c->world_ranks[static_cast<size_t>(peer)]) + ")");
  DeviceScope scope(c->device);
  const auto s = static_cast<cudaStream_t>(stream);
  const DeviceSide d = device_side(*c, v, 0, true, s);
  settle(k, c->comm, nccl()->Send(d.ptr, static_cast<size_t>(v.numel), nccl_type(v.dtype), peer, c->comm, s));
  wait_stream(k, s);
}

void recv(rlh_comm* c, const rlh_tensor* t, int32_t peer, void* stream) {
  const View v = sdk::comm::view_of(t, "comm_nccl: recv", "tensor");
  if (c == nullptr) throw Error(RLH_E_INVALID_ARGUMENT, "comm_nccl: recv: communicator is NULL");
  check_device(*c, v, "recv", "tensor");
  if (peer < 0 || peer >= c->size || peer == c->rank)
    throw Error(RLH_E_INVALID_ARGUMENT, "comm_nccl: recv: peer " + std::to_string(peer) + " is not another rank of group " + describe_group(*c));
  std::lock_guard<std::mutex> lk(g_mu);
  Call k = begin(c, "recv (" + v.describe() + " from world rank " + std::to_string(c->world_ranks[static_cast<size_t>(peer)]) + ")");
  DeviceScope scope(c->device);
  const auto s = static_cast<cudaStream_t>(stream);
  const DeviceSide d = device_side(*c, v, 0, false, s);
  settle(k, c->comm, nccl()->Recv(d.ptr, static_cast<size_t>(v.numel), nccl_type(v.dtype), peer, c->comm, s));
  store_back(v, d, s);
  wait_stream(k, s);
  finish(v, d);
}

void all_to_all(rlh_comm* c, const rlh_tensor* in, const rlh_tensor* out, void* stream) {
  const View a = sdk::comm::view_of(in, "comm_nccl: all_to_all", "in");
  const View b = sdk::comm::view_of(out, "comm_nccl: all_to_all", "out");
  sdk::comm::check_same_kind(a, b, "comm_nccl: all_to_all");
  if (c == nullptr) throw Error(RLH_E_INVALID_ARGUMENT, "comm_nccl: all_to_all: communicator is NULL");
  check_device(*c, a, "all_to_all", "in");
  if (a.numel != b.numel || in->ndim < 1 || a.dim0 % c->size != 0 || b.dim0 != a.dim0)
    throw Error(RLH_E_INVALID_ARGUMENT, "comm_nccl: all_to_all: in " + shape_text(in) + " and out " + shape_text(out) +
                                            " must have the same shape with dim 0 divisible by the group size " + std::to_string(c->size));
  if (sdk::comm::overlaps(a, b)) throw Error(RLH_E_INVALID_ARGUMENT, "comm_nccl: all_to_all: in and out overlap");
  std::lock_guard<std::mutex> lk(g_mu);
  Call k = begin(c, "all_to_all (" + a.describe() + ")");
  if (a.numel == 0) return;
  DeviceScope scope(c->device);
  const auto s = static_cast<cudaStream_t>(stream);
  const DeviceSide din = device_side(*c, a, 0, true, s);
  const DeviceSide dout = device_side(*c, b, 1, false, s);
  const Nccl* n = nccl();
  const size_t block = static_cast<size_t>(a.numel / c->size);
  const size_t bytes = block * sdk::comm::dtype_bytes(a.dtype);
  n->GroupStart();
  for (int p = 0; p < c->size; ++p) {
    n->Send(static_cast<char*>(din.ptr) + p * bytes, block, nccl_type(a.dtype), p, c->comm, s);
    n->Recv(static_cast<char*>(dout.ptr) + p * bytes, block, nccl_type(a.dtype), p, c->comm, s);
  }
  settle(k, c->comm, n->GroupEnd());
  store_back(b, dout, s);
  wait_stream(k, s);
  finish(b, dout);
}

void barrier(rlh_comm* c) {
  std::lock_guard<std::mutex> lk(g_mu);
  Call k = begin(c, "barrier");
  DeviceScope scope(c->device);
  void* d = scratch(*c, 0, sizeof(int32_t));
  settle(k, c->comm, nccl()->AllReduce(d, d, 1, ncclInt32, ncclSum, c->comm, cudaStreamLegacy));
  wait_stream(k, cudaStreamLegacy);
}

void set_timeout(rlh_comm* c, int64_t ms) {
  if (c == nullptr) return;
  std::lock_guard<std::mutex> lk(g_mu);
  c->timeout_ms = ms > 0 ? ms : c->default_timeout_ms;
}

}  // namespace rlh::comm_nccl
