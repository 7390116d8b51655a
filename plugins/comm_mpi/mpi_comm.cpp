// comm_mpi's collectives (mpi_comm.hpp). Each is a nonblocking MPI call (MPI_Iallreduce, ...)
// driven by MPI_Test until it completes or its deadline passes; a rank waiting answers its
// peers' queries meanwhile (mpi_runtime.cpp). On a timeout the rank asks every peer of the group
// where it is, names those that have not arrived, and poisons the process's communicators.
#include "mpi_comm.hpp"

#include <algorithm>
#include <array>
#include <climits>
#include <cstring>
#include <thread>

#include "device_staging.hpp"
#include "rlhost/sdk/comm_args.hpp"
#include "rlhost/sdk/status.hpp"

namespace rlh::comm_mpi {
namespace {

using sdk::Error;
using sdk::comm::DType;
using sdk::comm::View;

constexpr int kTagData = 0;
constexpr int kTagQuery = 1;  // as in mpi_runtime.cpp
constexpr int kTagReply = 2;
// Reductions and broadcasts larger than this many elements go in pieces (MPI counts are int).
constexpr int64_t kChunk = int64_t{1} << 30;

int g_world_rank = 0;

// One call in progress: what it is (for messages), on which group, until when.
struct Call {
  rlh_comm& c;
  Op op;
  std::string what;  // "all_reduce (sum, float32 x 1024)"
  Clock::time_point deadline;
};

std::string group_ranks_text(const std::vector<int>& world_ranks, const std::vector<int>& positions) {
  std::string s;
  for (size_t i = 0; i < positions.size() && i < 16; ++i)
    s += (i ? ", " : "") + std::to_string(world_ranks[static_cast<size_t>(positions[i])]);
  if (positions.size() > 16) s += " and " + std::to_string(positions.size() - 16) + " more";
  return s;
}

std::string here(const Call& k) {
  return "comm_mpi: " + k.what + " on group " + describe_group(k.c) + " on rank " + std::to_string(g_world_rank);
}

[[noreturn]] void fail(const Call&, rlh_code code, const std::string& msg) {
  set_failed(msg);
  throw Error(code, msg);
}

std::string mpi_error_text(int rc) {
  char buf[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(rc, buf, &len) != MPI_SUCCESS) return "MPI error " + std::to_string(rc);
  return std::string(buf, static_cast<size_t>(len));
}

void nap(unsigned iter) {
  if (iter < 64) return;  // a few tests back to back: small collectives finish here
  if (iter < 512) {
    std::this_thread::yield();
    return;
  }
  // Oversubscribed CPU ranks must not starve the peers they wait for.
  std::this_thread::sleep_for(std::chrono::microseconds(std::min<unsigned>(200, 10 + (iter - 512) / 8)));
}

bool cancelled(const rlh_comm& c) {
  const rlh_host_api* h = c.host;
  return h != nullptr && h->is_cancelled != nullptr && h->is_cancelled(h->ctx) != 0;
}

// Asks every peer of the group what it is doing and says who has not arrived at `k`.
std::string diagnose(const Call& k) {
  rlh_comm& c = k.c;
  const int n = c.size;
  // Pending requests may outlive this function (a dead peer never answers, and the process is
  // about to stop): their buffers are never freed. One diagnosis per process at most.
  auto* answers = new std::array<int64_t, 3>[static_cast<size_t>(n)];
  auto* query = new uint64_t[2]{c.calls, static_cast<uint64_t>(k.op)};
  std::vector<MPI_Request> rr(static_cast<size_t>(n), MPI_REQUEST_NULL), sr(static_cast<size_t>(n), MPI_REQUEST_NULL);
  std::vector<bool> got(static_cast<size_t>(n), false);
  for (int p = 0; p < n; ++p) {
    if (p == c.rank) continue;
    MPI_Irecv(answers[p].data(), 3, MPI_INT64_T, p, kTagReply, c.diag, &rr[static_cast<size_t>(p)]);
    MPI_Isend(query, 2, MPI_UINT64_T, p, kTagQuery, c.diag, &sr[static_cast<size_t>(p)]);
  }
  const int64_t grace_ms = std::clamp<int64_t>(c.timeout_ms / 4, 300, 3000);
  const auto until = Clock::now() + std::chrono::milliseconds(grace_ms);
  unsigned iter = 0;
  while (Clock::now() < until) {
    int pending = 0;
    for (int p = 0; p < n; ++p) {
      if (p == c.rank || got[static_cast<size_t>(p)]) continue;
      int flag = 0;
      if (MPI_Test(&rr[static_cast<size_t>(p)], &flag, MPI_STATUS_IGNORE) == MPI_SUCCESS && flag) got[static_cast<size_t>(p)] = true;
      else ++pending;
    }
    if (pending == 0) break;
    serve_queries();  // peers diagnosing at the same time ask us too
    nap(iter++);
  }
  std::vector<int> silent, same;
  std::vector<std::string> elsewhere;
  for (int p = 0; p < n; ++p) {
    if (p == c.rank) continue;
    const std::string who = "rank " + std::to_string(c.world_ranks[static_cast<size_t>(p)]);
    if (!got[static_cast<size_t>(p)]) {
      silent.push_back(p);
      continue;
    }
    const auto& a = answers[p];
    const auto calls = static_cast<uint64_t>(a[0]);
    if (a[1] == static_cast<int64_t>(k.op) && calls == c.calls) {
      same.push_back(p);
    } else if (a[1] >= 0) {
      elsewhere.push_back(who + " is in " + op_name(static_cast<Op>(a[1])) + " (call #" + std::to_string(calls) +
                          " on this group, this rank is at #" + std::to_string(c.calls) + ")");
    } else if (a[2] >= 0) {
      elsewhere.push_back(who + " is waiting in " + std::string(op_name(static_cast<Op>(a[2]))) + " on another group (after call #" +
                          std::to_string(calls) + " on this group)");
    } else {
      elsewhere.push_back(who + " is past call #" + std::to_string(calls) + " on this group and not in any call");
    }
  }
  std::string out;
  if (!silent.empty())
    out += (silent.size() == 1 ? "rank " : "ranks ") + group_ranks_text(c.world_ranks, silent) +
           (silent.size() == 1 ? " did not answer" : " did not answer") + " (dead, or busy outside the communicator)";
  for (const auto& e : elsewhere) out += (out.empty() ? "" : "; ") + e;
  if (out.empty()) out = "every rank had arrived; the transfer itself did not finish in time";
  else if (!same.empty()) out += "; the others had arrived";
  return out;
}

// Marks this rank as waiting in `k` (for the answers to peers' queries) while it lives.
struct Waiting {
  rlh_comm& c;
  explicit Waiting(Call& k) : c(k.c) {
    c.current = k.op;
    set_waiting(&c, k.op);
  }
  ~Waiting() {
    c.current = Op::none;
    set_waiting(nullptr, Op::none);
  }
  Waiting(const Waiting&) = delete;
  Waiting& operator=(const Waiting&) = delete;
};

// Between two polls of a wait: answers peers' queries, stops on cancellation, and past the
// deadline asks the peers where they are and fails naming them (without `diagnose_timeout`, when
// the group's twin does not exist yet, it fails without asking).
void between_polls(Call& k, unsigned& iter, bool diagnose_timeout) {
  rlh_comm& c = k.c;
  serve_queries();
  if (cancelled(c))
    fail(k, RLH_E_CANCELLED, here(k) + " stopped: the job was cancelled (SIGINT or SIGTERM; launchers send SIGTERM to every "
                                       "rank when one of them fails)");
  if (Clock::now() >= k.deadline) {
    const std::string who = diagnose_timeout ? diagnose(k) : "a rank did not arrive";
    fail(k, RLH_E_DEADLINE_EXCEEDED, here(k) + " timed out after " + sdk::comm::seconds_text(c.timeout_ms) + " (call #" +
                                         std::to_string(c.calls) + " on the group): " + who);
  }
  nap(iter++);
}

// Drives `reqs` to completion before the call's deadline.
void wait(Call& k, MPI_Request* reqs, int n, MPI_Status* statuses = nullptr, bool diagnose_timeout = true) {
  Waiting waiting(k);
  std::vector<MPI_Status> local(static_cast<size_t>(n));
  MPI_Status* st = statuses != nullptr ? statuses : local.data();
  unsigned iter = 0;
  while (true) {
    int flag = 0;
    const int rc = MPI_Testall(n, reqs, &flag, st);
    if (rc != MPI_SUCCESS) {
      int detail = rc;
      if (rc == MPI_ERR_IN_STATUS)
        for (int i = 0; i < n; ++i)
          if (st[i].MPI_ERROR != MPI_SUCCESS && st[i].MPI_ERROR != MPI_ERR_PENDING) detail = st[i].MPI_ERROR;
      fail(k, RLH_E_ABORTED, here(k) + " failed: " + mpi_error_text(detail));
    }
    if (flag) return;
    between_polls(k, iter, diagnose_timeout);
  }
}

// Waits until a data message from any rank of the group is there, before the call's deadline,
// and takes it off the matching queue (MPI_Improbe): only this caller can receive it then, and a
// timeout leaves no receive posted that could take a later message.
MPI_Message probe_any(Call& k, MPI_Status* st) {
  Waiting waiting(k);
  unsigned iter = 0;
  while (true) {
    int flag = 0;
    MPI_Message msg = MPI_MESSAGE_NULL;
    const int rc = MPI_Improbe(MPI_ANY_SOURCE, kTagData, k.c.comm, &flag, &msg, st);
    if (rc != MPI_SUCCESS) fail(k, RLH_E_ABORTED, here(k) + " failed: " + mpi_error_text(rc));
    if (flag) return msg;
    between_polls(k, iter, true);
  }
}

Call begin(rlh_comm* c, Op op, std::string what) {
  if (c == nullptr) throw Error(RLH_E_INVALID_ARGUMENT, std::string("comm_mpi: ") + op_name(op) + ": communicator is NULL");
  if (failed())
    throw Error(RLH_E_ABORTED, "comm_mpi: " + what + " on group " + describe_group(*c) +
                                   " refused: the communicators of this process are unusable after an earlier failure: " + failure());
  c->calls++;
  return Call{*c, op, std::move(what), Clock::now() + std::chrono::milliseconds(c->timeout_ms)};
}

MPI_Datatype mpi_type(DType d) {
  switch (d) {
    case DType::f32: return MPI_FLOAT;
    case DType::f64: return MPI_DOUBLE;
    case DType::i32: return MPI_INT32_T;
    case DType::i64: return MPI_INT64_T;
    case DType::u8: return MPI_UINT8_T;
    case DType::i8: return MPI_INT8_T;
    case DType::bf16:
    case DType::f16: return MPI_UINT16_T;  // moved as bits; reduced through float32
  }
  return MPI_BYTE;
}

MPI_Op mpi_op(int32_t op) {
  switch (op) {
    case RLH_REDUCE_MAX: return MPI_MAX;
    case RLH_REDUCE_MIN: return MPI_MIN;
    default: return MPI_SUM;  // sum, and avg (divided afterwards)
  }
}

void check_reducible(const View& v, const char* call) {
  if (v.dtype == DType::f16)
    throw Error(RLH_E_UNIMPLEMENTED, std::string("comm_mpi: ") + call +
                                         ": float16 reductions are not implemented (float32, float64, bfloat16 and the integer "
                                         "types are)");
}

void check_device(const View& v, const char* call, const char* arg) {
  const int32_t t = v.device.device_type;
  if (t != RLH_DEVICE_CPU && t != RLH_DEVICE_CUDA_HOST && t != RLH_DEVICE_CUDA && t != RLH_DEVICE_CUDA_MANAGED)
    throw Error(RLH_E_INVALID_ARGUMENT, std::string("comm_mpi: ") + call + ": " + arg + " is on " +
                                            sdk::comm::device_name(v.device) + ", which comm_mpi cannot reach");
}

void check_count(int64_t n, const char* call) {
  if (n > INT_MAX)
    throw Error(RLH_E_OUT_OF_RANGE, std::string("comm_mpi: ") + call + ": a per-rank block of " + std::to_string(n) +
                                        " elements exceeds MPI's int count");
}

// Host memory for a tensor argument: itself when the host can address it, else a staging slot
// (loaded from the device when `load`).
struct HostSide {
  void* ptr = nullptr;
  bool staged = false;
};

HostSide host_side(const View& v, int slot, bool load, void* stream, const char* call) {
  if (sdk::comm::host_accessible(v.device)) return {v.data, false};
  if (load) return {stage_from_device(slot, v.data, v.bytes(), v.device, stream, call), true};
  return {staging_buffer(slot, v.bytes(), call), true};
}

void store_back(const View& v, const HostSide& h, void* stream, const char* call) {
  if (h.staged) stage_to_device(v.data, h.ptr, v.bytes(), v.device, stream, call);
}

// Copy in -> out for a group of one.
void local_copy(const View& in, const View& out, void* stream, const char* call) {
  if (in.data == out.data || in.bytes() == 0) return;
  if (sdk::comm::host_accessible(in.device)) std::memmove(out.data, in.data, in.bytes());
  else copy_on_device(out.data, in.data, in.bytes(), in.device, stream, call);
}

template <typename T>
void divide(void* p, int64_t n, int size) {
  auto* x = static_cast<T*>(p);
  for (int64_t i = 0; i < n; ++i) x[i] = static_cast<T>(x[i] / static_cast<T>(size));
}

void divide_by(DType d, void* p, int64_t n, int size) {
  switch (d) {
    case DType::f32: divide<float>(p, n, size); break;
    case DType::f64: divide<double>(p, n, size); break;
    case DType::i32: divide<int32_t>(p, n, size); break;  // truncating, as NCCL's avg
    case DType::i64: divide<int64_t>(p, n, size); break;
    case DType::u8: divide<uint8_t>(p, n, size); break;
    case DType::i8: divide<int8_t>(p, n, size); break;
    default: break;
  }
}

std::vector<float>& float_scratch(int i, size_t n) {
  static std::vector<float> s[2];
  if (s[i].size() < n) s[i].resize(n);
  return s[i];
}

void to_f32(const void* bf16, float* out, int64_t n) {
  const auto* h = static_cast<const uint16_t*>(bf16);
  for (int64_t i = 0; i < n; ++i) out[i] = sdk::comm::bf16_to_f32(h[i]);
}
void from_f32(const float* in, void* bf16, int64_t n) {
  auto* h = static_cast<uint16_t*>(bf16);
  for (int64_t i = 0; i < n; ++i) h[i] = sdk::comm::f32_to_bf16(in[i]);
}

// In-place all-reduce of host memory, in pieces MPI can count.
void reduce_in_place(Call& k, void* p, int64_t n, DType d, int32_t op) {
  const size_t esize = d == DType::bf16 ? 4 : sdk::comm::dtype_bytes(d);
  const MPI_Datatype t = d == DType::bf16 ? MPI_FLOAT : mpi_type(d);
  for (int64_t off = 0; off < n; off += kChunk) {
    const int count = static_cast<int>(std::min(kChunk, n - off));
    MPI_Request req = MPI_REQUEST_NULL;
    const int rc = MPI_Iallreduce(MPI_IN_PLACE, static_cast<char*>(p) + static_cast<size_t>(off) * esize, count, t, mpi_op(op),
                                  k.c.comm, &req);
    if (rc != MPI_SUCCESS) fail(k, RLH_E_ABORTED, here(k) + " failed to start: " + mpi_error_text(rc));
    wait(k, &req, 1);
  }
}

std::string shape_text(const rlh_tensor* t) {
  std::string s = "[";
  for (int32_t i = 0; i < t->ndim; ++i) s += (i ? ", " : "") + std::to_string(t->shape[i]);
  return s + "]";
}

// out = concat over `size` ranks of in along dim 0 (a scalar in gives a [size] out).
void check_gathered_shape(const rlh_tensor* in, const rlh_tensor* out, int size, const char* call, const char* small,
                          const char* big) {
  bool ok;
  if (in->ndim == 0) {
    ok = out->ndim == 1 && out->shape[0] == size;
  } else {
    ok = out->ndim == in->ndim && out->shape[0] == in->shape[0] * size;
    for (int32_t i = 1; ok && i < in->ndim; ++i) ok = out->shape[i] == in->shape[i];
  }
  if (!ok)
    throw Error(RLH_E_INVALID_ARGUMENT, std::string("comm_mpi: ") + call + ": " + big + " has shape " + shape_text(out) +
                                            ", expected " + small + "'s " + shape_text(in) + " with dim 0 times the group size " +
                                            std::to_string(size));
}

}  // namespace

int world_rank() { return g_world_rank; }

std::string describe_group(const rlh_comm& c) {
  std::string s = "'" + c.name + "' (" + std::to_string(c.size) + (c.size == 1 ? " rank" : " ranks");
  if (c.name != "world" && c.size <= 16) {
    s += ": world ranks ";
    for (int i = 0; i < c.size; ++i) s += (i ? ", " : "") + std::to_string(c.world_ranks[static_cast<size_t>(i)]);
  }
  return s + ")";
}

rlh_comm* create_world(const rlh_host_api* host, const nlohmann::json& cfg) {
  if (!cfg.is_object()) throw Error(RLH_E_INVALID_ARGUMENT, "comm_mpi: create_world config must be a JSON object");
  for (const auto& [key, v] : cfg.items())
    if (key != "timeout_ms" && key != "device")
      throw Error(RLH_E_INVALID_ARGUMENT, "comm_mpi: unknown create_world config key '" + key + "' (known: timeout_ms, device)");
  const int64_t timeout = sdk::comm::initial_timeout_ms(host, cfg, kDefaultTimeoutMs);
  const sdk::LaunchEnv env = sdk::detect_launch();  // throws naming a malformed variable
  if (env.size > 1 && !env.mpi_runtime)
    throw Error(RLH_E_UNAVAILABLE, "comm_mpi: " + env.describe() +
                                       " started this rank without an MPI runtime (comm_mpi needs mpirun, or srun --mpi=pmix); "
                                       "comm_nccl meets its peers through MASTER_ADDR/MASTER_PORT instead");
  std::lock_guard<std::mutex> lk(mpi_lock());
  auto c = std::make_unique<rlh_comm>();
  c->host = host;
  c->name = "world";
  c->timeout_ms = c->default_timeout_ms = timeout;
  if (local_mode()) {
    c->world_ranks = {0};
    return c.release();
  }
  start_mpi(std::chrono::milliseconds(timeout));
  int size = 0, rank = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (size != env.size || rank != env.rank)
    throw Error(RLH_E_FAILED_PRECONDITION, "comm_mpi: " + env.describe() + " says this is rank " + std::to_string(env.rank) +
                                               " of " + std::to_string(env.size) + ", but MPI says rank " + std::to_string(rank) +
                                               " of " + std::to_string(size) +
                                               " (with srun, pass --mpi=pmix so that MPI joins the step's tasks)");
  g_world_rank = rank;
  c->rank = rank;
  c->size = size;
  for (int i = 0; i < size; ++i) c->world_ranks.push_back(i);
  MPI_Request reqs[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
  MPI_Comm_idup(MPI_COMM_WORLD, &c->comm, &reqs[0]);
  MPI_Comm_idup(MPI_COMM_WORLD, &c->diag, &reqs[1]);
  Call k{*c, Op::split, "creating the world communicator", Clock::now() + std::chrono::milliseconds(timeout)};
  wait(k, reqs, 2, nullptr, false);
  MPI_Comm_set_errhandler(c->comm, MPI_ERRORS_RETURN);
  MPI_Comm_set_errhandler(c->diag, MPI_ERRORS_RETURN);
  register_comm(c.get());
  return c.release();
}

rlh_comm* split(rlh_comm* c, int32_t color, int32_t key) {
  std::lock_guard<std::mutex> lk(mpi_lock());
  Call k = begin(c, Op::split, "split (color " + std::to_string(color) + ", key " + std::to_string(key) + ")");
  auto out = std::make_unique<rlh_comm>();
  out->host = c->host;
  out->name = c->name + ".split(" + std::to_string(color) + ")";
  out->timeout_ms = c->timeout_ms;
  out->default_timeout_ms = c->default_timeout_ms;
  if (c->comm == MPI_COMM_NULL) {
    if (color < 0) throw Error(RLH_E_INVALID_ARGUMENT, "comm_mpi: split: color " + std::to_string(color) + " is negative");
    out->world_ranks = c->world_ranks;
    return out.release();
  }
  // Everyone's (color, key) first, with the deadline: a rank that does not come is named, and
  // a bad color anywhere fails every rank alike instead of leaving the others in MPI_Comm_split.
  std::vector<int> all(static_cast<size_t>(2 * c->size));
  int mine[2] = {color, key};
  MPI_Request req = MPI_REQUEST_NULL;
  int rc = MPI_Iallgather(mine, 2, MPI_INT, all.data(), 2, MPI_INT, c->comm, &req);
  if (rc != MPI_SUCCESS) fail(k, RLH_E_ABORTED, here(k) + " failed to start: " + mpi_error_text(rc));
  wait(k, &req, 1);
  for (int p = 0; p < c->size; ++p)
    if (all[static_cast<size_t>(2 * p)] < 0)
      throw Error(RLH_E_INVALID_ARGUMENT, "comm_mpi: split on group " + describe_group(*c) + ": rank " +
                                              std::to_string(c->world_ranks[static_cast<size_t>(p)]) + " passed color " +
                                              std::to_string(all[static_cast<size_t>(2 * p)]) + " (colors must be >= 0)");
  rc = MPI_Comm_split(c->comm, color, key, &out->comm);
  if (rc != MPI_SUCCESS) fail(k, RLH_E_ABORTED, here(k) + " failed: " + mpi_error_text(rc));
  MPI_Comm_set_errhandler(out->comm, MPI_ERRORS_RETURN);
  MPI_Comm_rank(out->comm, &out->rank);
  MPI_Comm_size(out->comm, &out->size);
  MPI_Request dreq = MPI_REQUEST_NULL;
  MPI_Comm_idup(out->comm, &out->diag, &dreq);
  wait(k, &dreq, 1);
  MPI_Comm_set_errhandler(out->diag, MPI_ERRORS_RETURN);
  MPI_Group g_out, g_world;
  MPI_Comm_group(out->comm, &g_out);
  MPI_Comm_group(MPI_COMM_WORLD, &g_world);
  std::vector<int> pos(static_cast<size_t>(out->size));
  for (int i = 0; i < out->size; ++i) pos[static_cast<size_t>(i)] = i;
  out->world_ranks.resize(static_cast<size_t>(out->size));
  MPI_Group_translate_ranks(g_out, out->size, pos.data(), g_world, out->world_ranks.data());
  MPI_Group_free(&g_out);
  MPI_Group_free(&g_world);
  register_comm(out.get());
  return out.release();
}

void destroy(rlh_comm* c) {
  if (c == nullptr) return;
  std::lock_guard<std::mutex> lk(mpi_lock());
  unregister_comm(c);
  // After a failure, pending requests may still name these communicators: leave them be (the
  // process is on its way out).
  if (!failed() && !finished()) {
    if (c->comm != MPI_COMM_NULL) MPI_Comm_free(&c->comm);
    if (c->diag != MPI_COMM_NULL) MPI_Comm_free(&c->diag);
  }
  delete c;
}

void all_reduce(rlh_comm* c, const rlh_tensor* t, int32_t op, void* stream) {
  const View v = sdk::comm::view_of(t, "comm_mpi: all_reduce", "tensor");
  sdk::comm::check_op(op, "comm_mpi: all_reduce");
  check_reducible(v, "all_reduce");
  check_device(v, "all_reduce", "tensor");
  std::lock_guard<std::mutex> lk(mpi_lock());
  Call k = begin(c, Op::all_reduce, std::string("all_reduce (") + sdk::comm::op_name(op) + ", " + v.describe() + ")");
  if (c->comm == MPI_COMM_NULL || v.numel == 0) return;  // a group of one holds the result already
  const HostSide h = host_side(v, 0, true, stream, "all_reduce");
  if (v.dtype == DType::bf16) {
    auto& f = float_scratch(0, static_cast<size_t>(v.numel));
    to_f32(h.ptr, f.data(), v.numel);
    reduce_in_place(k, f.data(), v.numel, DType::bf16, op);
    if (op == RLH_REDUCE_AVG) divide_by(DType::f32, f.data(), v.numel, c->size);
    from_f32(f.data(), h.ptr, v.numel);
  } else {
    reduce_in_place(k, h.ptr, v.numel, v.dtype, op);
    if (op == RLH_REDUCE_AVG) divide_by(v.dtype, h.ptr, v.numel, c->size);
  }
  store_back(v, h, stream, "all_reduce");
}

void all_gather(rlh_comm* c, const rlh_tensor* in, const rlh_tensor* out, void* stream) {
  const View a = sdk::comm::view_of(in, "comm_mpi: all_gather", "in");
  const View b = sdk::comm::view_of(out, "comm_mpi: all_gather", "out");
  sdk::comm::check_same_kind(a, b, "comm_mpi: all_gather");
  check_device(a, "all_gather", "in");
  if (c == nullptr) throw Error(RLH_E_INVALID_ARGUMENT, "comm_mpi: all_gather: communicator is NULL");
  check_gathered_shape(in, out, c->size, "all_gather", "in", "out");
  check_count(a.numel, "all_gather");
  const bool in_place = static_cast<char*>(a.data) == static_cast<char*>(b.data) + static_cast<size_t>(c->rank) * a.bytes();
  if (!in_place && sdk::comm::overlaps(a, b))
    throw Error(RLH_E_INVALID_ARGUMENT, "comm_mpi: all_gather: in overlaps out other than as this rank's block");
  std::lock_guard<std::mutex> lk(mpi_lock());
  Call k = begin(c, Op::all_gather, "all_gather (" + a.describe() + " per rank)");
  if (c->comm == MPI_COMM_NULL) {
    local_copy(a, b, stream, "all_gather");
    return;
  }
  if (b.numel == 0) return;
  const HostSide hin = host_side(a, 0, true, stream, "all_gather");
  const HostSide hout = host_side(b, 1, false, stream, "all_gather");
  const bool mpi_in_place = in_place && !hin.staged;
  MPI_Request req = MPI_REQUEST_NULL;
  const int n = static_cast<int>(a.numel);
  const int rc = MPI_Iallgather(mpi_in_place ? MPI_IN_PLACE : hin.ptr, n, mpi_type(a.dtype), hout.ptr, n, mpi_type(a.dtype),
                                c->comm, &req);
  if (rc != MPI_SUCCESS) fail(k, RLH_E_ABORTED, here(k) + " failed to start: " + mpi_error_text(rc));
  wait(k, &req, 1);
  store_back(b, hout, stream, "all_gather");
}

void reduce_scatter(rlh_comm* c, const rlh_tensor* in, const rlh_tensor* out, int32_t op, void* stream) {
  const View a = sdk::comm::view_of(in, "comm_mpi: reduce_scatter", "in");
  const View b = sdk::comm::view_of(out, "comm_mpi: reduce_scatter", "out");
  sdk::comm::check_same_kind(a, b, "comm_mpi: reduce_scatter");
  sdk::comm::check_op(op, "comm_mpi: reduce_scatter");
  check_reducible(a, "reduce_scatter");
  check_device(a, "reduce_scatter", "in");
  if (c == nullptr) throw Error(RLH_E_INVALID_ARGUMENT, "comm_mpi: reduce_scatter: communicator is NULL");
  check_gathered_shape(out, in, c->size, "reduce_scatter", "out", "in");
  check_count(b.numel, "reduce_scatter");
  std::lock_guard<std::mutex> lk(mpi_lock());
  Call k = begin(c, Op::reduce_scatter, std::string("reduce_scatter (") + sdk::comm::op_name(op) + ", " + b.describe() + " per rank)");
  if (c->comm == MPI_COMM_NULL) {
    local_copy(a, b, stream, "reduce_scatter");
    return;
  }
  if (b.numel == 0) return;
  const HostSide hin = host_side(a, 0, true, stream, "reduce_scatter");
  HostSide hout = host_side(b, 1, false, stream, "reduce_scatter");
  const int n = static_cast<int>(b.numel);
  const void* send = hin.ptr;
  void* recv = hout.ptr;
  std::vector<char> copy;
  if (b.dtype == DType::bf16) {
    auto& fin = float_scratch(0, static_cast<size_t>(a.numel));
    auto& fout = float_scratch(1, static_cast<size_t>(b.numel));
    to_f32(hin.ptr, fin.data(), a.numel);
    send = fin.data();
    recv = fout.data();
  } else if (!hout.staged && sdk::comm::overlaps(a, b)) {
    copy.assign(static_cast<const char*>(hin.ptr), static_cast<const char*>(hin.ptr) + a.bytes());  // MPI wants them apart
    send = copy.data();
  }
  const MPI_Datatype t = b.dtype == DType::bf16 ? MPI_FLOAT : mpi_type(b.dtype);
  MPI_Request req = MPI_REQUEST_NULL;
  const int rc = MPI_Ireduce_scatter_block(send, recv, n, t, mpi_op(op), c->comm, &req);
  if (rc != MPI_SUCCESS) fail(k, RLH_E_ABORTED, here(k) + " failed to start: " + mpi_error_text(rc));
  wait(k, &req, 1);
  if (b.dtype == DType::bf16) {
    auto& fout = float_scratch(1, 0);
    if (op == RLH_REDUCE_AVG) divide_by(DType::f32, fout.data(), b.numel, c->size);
    from_f32(fout.data(), hout.ptr, b.numel);
  } else if (op == RLH_REDUCE_AVG) {
    divide_by(b.dtype, hout.ptr, b.numel, c->size);
  }
  store_back(b, hout, stream, "reduce_scatter");
}

void broadcast(rlh_comm* c, const rlh_tensor* t, int32_t root, void* stream) {
  const View v = sdk::comm::view_of(t, "comm_mpi: broadcast", "tensor");
  check_device(v, "broadcast", "tensor");
  if (c == nullptr) throw Error(RLH_E_INVALID_ARGUMENT, "comm_mpi: broadcast: communicator is NULL");
  if (root < 0 || root >= c->size)
    throw Error(RLH_E_INVALID_ARGUMENT, "comm_mpi: broadcast: root " + std::to_string(root) + " is not a rank of group " + describe_group(*c));
  std::lock_guard<std::mutex> lk(mpi_lock());
  Call k = begin(c, Op::broadcast, "broadcast (" + v.describe() + " from group rank " + std::to_string(root) + ")");
  if (c->comm == MPI_COMM_NULL || v.numel == 0) return;
  const HostSide h = host_side(v, 0, c->rank == root, stream, "broadcast");
  const size_t esize = sdk::comm::dtype_bytes(v.dtype);
  for (int64_t off = 0; off < v.numel; off += kChunk) {
    MPI_Request req = MPI_REQUEST_NULL;
    const int rc = MPI_Ibcast(static_cast<char*>(h.ptr) + static_cast<size_t>(off) * esize,
                              static_cast<int>(std::min(kChunk, v.numel - off)), mpi_type(v.dtype), root, c->comm, &req);
    if (rc != MPI_SUCCESS) fail(k, RLH_E_ABORTED, here(k) + " failed to start: " + mpi_error_text(rc));
    wait(k, &req, 1);
  }
  if (c->rank != root) store_back(v, h, stream, "broadcast");
}

void send(rlh_comm* c, const rlh_tensor* t, int32_t peer, void* stream) {
  const View v = sdk::comm::view_of(t, "comm_mpi: send", "tensor");
  check_device(v, "send", "tensor");
  if (c == nullptr) throw Error(RLH_E_INVALID_ARGUMENT, "comm_mpi: send: communicator is NULL");
  if (peer < 0 || peer >= c->size || peer == c->rank)
    throw Error(RLH_E_INVALID_ARGUMENT, "comm_mpi: send: peer " + std::to_string(peer) + " is not another rank of group " +
                                            describe_group(*c));
  check_count(v.numel, "send");
  std::lock_guard<std::mutex> lk(mpi_lock());
  Call k = begin(c, Op::send, "send (" + v.describe() + " to world rank " + std::to_string(c->world_ranks[static_cast<size_t>(peer)]) + ")");
  const HostSide h = host_side(v, 0, true, stream, "send");
  MPI_Request req = MPI_REQUEST_NULL;
  const int rc = MPI_Isend(h.ptr, static_cast<int>(v.numel), mpi_type(v.dtype), peer, kTagData, c->comm, &req);
  if (rc != MPI_SUCCESS) fail(k, RLH_E_ABORTED, here(k) + " failed to start: " + mpi_error_text(rc));
  wait(k, &req, 1);
}

void recv(rlh_comm* c, const rlh_tensor* t, int32_t peer, void* stream) {
  const View v = sdk::comm::view_of(t, "comm_mpi: recv", "tensor");
  check_device(v, "recv", "tensor");
  if (c == nullptr) throw Error(RLH_E_INVALID_ARGUMENT, "comm_mpi: recv: communicator is NULL");
  if (peer < 0 || peer >= c->size || peer == c->rank)
    throw Error(RLH_E_INVALID_ARGUMENT, "comm_mpi: recv: peer " + std::to_string(peer) + " is not another rank of group " +
                                            describe_group(*c));
  check_count(v.numel, "recv");
  std::lock_guard<std::mutex> lk(mpi_lock());
  Call k = begin(c, Op::recv, "recv (" + v.describe() + " from world rank " + std::to_string(c->world_ranks[static_cast<size_t>(peer)]) + ")");
  const HostSide h = host_side(v, 0, false, stream, "recv");
  MPI_Request req = MPI_REQUEST_NULL;
  const int rc = MPI_Irecv(h.ptr, static_cast<int>(v.numel), mpi_type(v.dtype), peer, kTagData, c->comm, &req);
  if (rc != MPI_SUCCESS) fail(k, RLH_E_ABORTED, here(k) + " failed to start: " + mpi_error_text(rc));
  MPI_Status st;
  wait(k, &req, 1, &st);
  int got = 0;
  MPI_Get_count(&st, mpi_type(v.dtype), &got);
  if (got != static_cast<int>(v.numel))  // the message was taken whole: nothing is left pending
    throw Error(RLH_E_INVALID_ARGUMENT, here(k) + ": the peer sent " + std::to_string(got) + " elements, this rank expected " +
                                            std::to_string(v.numel));
  store_back(v, h, stream, "recv");
}

void recv_any(rlh_comm* c, const rlh_tensor* t, int32_t* peer, void* stream) {
  const View v = sdk::comm::view_of(t, "comm_mpi: recv_any", "tensor");
  check_device(v, "recv_any", "tensor");
  if (c == nullptr) throw Error(RLH_E_INVALID_ARGUMENT, "comm_mpi: recv_any: communicator is NULL");
  if (peer == nullptr) throw Error(RLH_E_INVALID_ARGUMENT, "comm_mpi: recv_any: peer is NULL");
  *peer = -1;
  if (c->size < 2)
    throw Error(RLH_E_INVALID_ARGUMENT, "comm_mpi: recv_any: group " + describe_group(*c) + " has no other rank to receive from");
  check_count(v.numel, "recv_any");
  std::lock_guard<std::mutex> lk(mpi_lock());
  Call k = begin(c, Op::recv_any, "recv_any (" + v.describe() + " from any rank)");
  MPI_Status st;
  MPI_Message msg = probe_any(k, &st);
  const int from = st.MPI_SOURCE;
  const std::string sender = "world rank " + std::to_string(c->world_ranks[static_cast<size_t>(from)]);
  int got = 0;
  MPI_Get_count(&st, mpi_type(v.dtype), &got);
  if (got != static_cast<int>(v.numel)) {
    // Taken all the same (into scratch), so the sender's next message is the next one matched.
    int bytes = 0;
    MPI_Get_count(&st, MPI_BYTE, &bytes);
    std::vector<char> scratch(static_cast<size_t>(std::max(bytes, 1)));
    MPI_Request req = MPI_REQUEST_NULL;
    const int rc = MPI_Imrecv(scratch.data(), bytes, MPI_BYTE, &msg, &req);
    if (rc != MPI_SUCCESS) fail(k, RLH_E_ABORTED, here(k) + " failed to start: " + mpi_error_text(rc));
    wait(k, &req, 1);
    throw Error(RLH_E_INVALID_ARGUMENT, here(k) + ": " + sender + " sent " +
                                            (got == MPI_UNDEFINED ? std::to_string(bytes) + " bytes" : std::to_string(got) + " elements") +
                                            ", this rank expected " + std::to_string(v.numel));
  }
  const HostSide h = host_side(v, 0, false, stream, "recv_any");
  MPI_Request req = MPI_REQUEST_NULL;
  const int rc = MPI_Imrecv(h.ptr, static_cast<int>(v.numel), mpi_type(v.dtype), &msg, &req);
  if (rc != MPI_SUCCESS) fail(k, RLH_E_ABORTED, here(k) + " failed to start: " + mpi_error_text(rc));
  wait(k, &req, 1);
  store_back(v, h, stream, "recv_any");
  *peer = from;
}

void all_to_all(rlh_comm* c, const rlh_tensor* in, const rlh_tensor* out, void* stream) {
  const View a = sdk::comm::view_of(in, "comm_mpi: all_to_all", "in");
  const View b = sdk::comm::view_of(out, "comm_mpi: all_to_all", "out");
  sdk::comm::check_same_kind(a, b, "comm_mpi: all_to_all");
  check_device(a, "all_to_all", "in");
  if (c == nullptr) throw Error(RLH_E_INVALID_ARGUMENT, "comm_mpi: all_to_all: communicator is NULL");
  if (a.numel != b.numel || in->ndim < 1 || a.dim0 % c->size != 0 || b.dim0 != a.dim0)
    throw Error(RLH_E_INVALID_ARGUMENT, "comm_mpi: all_to_all: in " + shape_text(in) + " and out " + shape_text(out) +
                                            " must have the same shape with dim 0 divisible by the group size " +
                                            std::to_string(c->size));
  const int64_t block = a.numel / c->size;
  check_count(block, "all_to_all");
  if (a.data != b.data && sdk::comm::overlaps(a, b))
    throw Error(RLH_E_INVALID_ARGUMENT, "comm_mpi: all_to_all: in and out overlap");
  std::lock_guard<std::mutex> lk(mpi_lock());
  Call k = begin(c, Op::all_to_all, "all_to_all (" + a.describe() + ")");
  if (c->comm == MPI_COMM_NULL) {
    local_copy(a, b, stream, "all_to_all");
    return;
  }
  if (a.numel == 0) return;
  HostSide hin = host_side(a, 0, true, stream, "all_to_all");
  const HostSide hout = host_side(b, 1, false, stream, "all_to_all");
  std::vector<char> copy;
  if (hin.ptr == hout.ptr) {  // the same host memory: MPI wants them apart
    copy.assign(static_cast<const char*>(hin.ptr), static_cast<const char*>(hin.ptr) + a.bytes());
    hin.ptr = copy.data();
  }
  MPI_Request req = MPI_REQUEST_NULL;
  const int rc = MPI_Ialltoall(hin.ptr, static_cast<int>(block), mpi_type(a.dtype), hout.ptr, static_cast<int>(block),
                               mpi_type(a.dtype), c->comm, &req);
  if (rc != MPI_SUCCESS) fail(k, RLH_E_ABORTED, here(k) + " failed to start: " + mpi_error_text(rc));
  wait(k, &req, 1);
  store_back(b, hout, stream, "all_to_all");
}

void barrier(rlh_comm* c) {
  std::lock_guard<std::mutex> lk(mpi_lock());
  Call k = begin(c, Op::barrier, "barrier");
  if (c->comm == MPI_COMM_NULL) return;
  MPI_Request req = MPI_REQUEST_NULL;
  const int rc = MPI_Ibarrier(c->comm, &req);
  if (rc != MPI_SUCCESS) fail(k, RLH_E_ABORTED, here(k) + " failed to start: " + mpi_error_text(rc));
  wait(k, &req, 1);
}

}  // namespace rlh::comm_mpi
