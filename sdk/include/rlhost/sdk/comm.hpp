// The C++ view of a COMM component (comm.h) for engines and backends (static library
// rlh_parallel). Communicators reach code the way kernels do: from the host, never from a
// global. A backend asks for
//
//   sdk::Comm world = sdk::Comm::world(host);                 // host tensors (comm_mpi, ...)
//   sdk::Comm dev = sdk::make_device_comm(host, device, pin, "megatron");   // for a device
//   sdk::ParallelComms pc = sdk::make_parallel_comms(dev, sizes, {GroupKind::dp_cp, GroupKind::tp});
//   pc.of(GroupKind::dp_cp).reduce_scatter(grads, shard, RLH_REDUCE_AVG, stream);
//
// and hands the groups to its engine as arguments. Every call throws rlh::sdk::Error with the
// component's one-line message prefixed by the group's name ("dp_cp group: comm_mpi: ...").
// A failed call leaves the process's communicators unusable (comm.h): report it and stop.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "rlhost/comm.h"
#include "rlhost/sdk/parallel_groups.hpp"
#include "rlhost/sdk/plugin.hpp"

namespace rlh::sdk {

// A contiguous 0-d or 1-d host tensor over `data` (the shape stays the caller's).
rlh_tensor host_tensor(void* data, rlh_dtype dtype, std::span<const int64_t> shape);

template <typename T>
constexpr rlh_dtype dtype_of();
template <> constexpr rlh_dtype dtype_of<float>() { return {RLH_DTYPE_FLOAT, 32, 1}; }
template <> constexpr rlh_dtype dtype_of<double>() { return {RLH_DTYPE_FLOAT, 64, 1}; }
template <> constexpr rlh_dtype dtype_of<int32_t>() { return {RLH_DTYPE_INT, 32, 1}; }
template <> constexpr rlh_dtype dtype_of<int64_t>() { return {RLH_DTYPE_INT, 64, 1}; }
template <> constexpr rlh_dtype dtype_of<uint8_t>() { return {RLH_DTYPE_UINT, 8, 1}; }

class Comm {
 public:
  Comm() = default;
  // The host's world communicator (borrowed: the host destroys it at its end).
  static Comm world(const Host& host);
  // Owns `comm` (destroyed with the table's destroy); `name` prefixes its errors.
  static Comm adopt(const rlh_comm_api* api, rlh_comm* comm, std::string name);

  Comm(Comm&& o) noexcept { *this = std::move(o); }
  Comm& operator=(Comm&& o) noexcept;
  Comm(const Comm&) = delete;
  Comm& operator=(const Comm&) = delete;
  ~Comm() { reset(); }
  void reset();

  explicit operator bool() const { return comm_ != nullptr; }
  const rlh_comm_api* api() const { return api_; }
  rlh_comm* get() const { return comm_; }
  const std::string& name() const { return name_; }
  int rank() const;
  int size() const;

  // Collective over this group: ranks passing the same color form a group, ordered by key.
  Comm split(int color, int key, std::string name) const;

  void all_reduce(const rlh_tensor& t, int32_t op, void* stream = nullptr) const;
  void all_gather(const rlh_tensor& in, const rlh_tensor& out, void* stream = nullptr) const;
  void reduce_scatter(const rlh_tensor& in, const rlh_tensor& out, int32_t op, void* stream = nullptr) const;
  void broadcast(const rlh_tensor& t, int root, void* stream = nullptr) const;
  void send(const rlh_tensor& t, int peer, void* stream = nullptr) const;
  void recv(const rlh_tensor& t, int peer, void* stream = nullptr) const;
  // The next message any other rank of the group sent this rank (COMM 0.2's recv_any): returns
  // its sender's rank in the group. Throws Error(UNIMPLEMENTED) naming the component when it has
  // no such receive (a COMM 0.1 component, or comm_nccl).
  int recv_any(const rlh_tensor& t, void* stream = nullptr) const;
  // Whether the component offers recv_any (it may still answer UNIMPLEMENTED: comm_nccl does).
  bool has_recv_any() const;
  void all_to_all(const rlh_tensor& in, const rlh_tensor& out, void* stream = nullptr) const;
  void barrier() const;
  // The timeout of later calls on this group (0: the communicator's default).
  void set_timeout(std::chrono::milliseconds timeout) const;

  // Host vectors, for scalars and small bookkeeping (losses, token counts, flags).
  template <typename T>
  void all_reduce(std::span<T> data, int32_t op) const {
    const int64_t n = static_cast<int64_t>(data.size());
    all_reduce(host_tensor(data.data(), dtype_of<T>(), std::span<const int64_t>(&n, 1)), op);
  }
  template <typename T>
  void broadcast(std::span<T> data, int root) const {
    const int64_t n = static_cast<int64_t>(data.size());
    broadcast(host_tensor(data.data(), dtype_of<T>(), std::span<const int64_t>(&n, 1)), root);
  }

 private:
  void check(rlh_status* s) const;
  const rlh_comm_api* api_ = nullptr;
  rlh_comm* comm_ = nullptr;
  bool owned_ = false;
  std::string name_;
};

// The groups of `sizes` for this rank, split from `world` (every rank must call this with the
// same arguments: the splits are collective, made in the order of `kinds`). Kinds not asked
// for, and kinds this rank is not a member of (embedding groups of middle pipeline stages),
// stay empty Comms. Throws Error(INVALID_ARGUMENT) naming the sizes when they do not fit the
// world.
struct ParallelComms {
  ParallelLayout layout;
  RankGroups mine;
  std::array<Comm, kNumGroupKinds> comms;
  const Comm& of(GroupKind k) const { return comms[static_cast<int>(k)]; }
};
ParallelComms make_parallel_comms(const Comm& world, const ParallelSizes& sizes, const std::vector<GroupKind>& kinds);

// A new world communicator whose collectives take tensors on `device`, from the host's COMM
// components the way make_kernel_registry takes kernel providers: `pin` (a component name, ""
// for none) first and alone when given, else every usable component in score order; one whose
// create_world answers UNAVAILABLE or UNIMPLEMENTED (no GPU, several ranks on one GPU for NCCL,
// another device kind) makes way for the next. Collective over the world. `who` prefixes the
// log line naming the choice. Throws Error naming every refusal when none can.
Comm make_device_comm(const Host& host, rlh_device device, const std::string& pin, const std::string& who);

}  // namespace rlh::sdk
