// The C++ view of a COMM component (comm.hpp).
#include "rlhost/sdk/comm.hpp"

#include <nlohmann/json.hpp>

namespace rlh::sdk {

rlh_tensor host_tensor(void* data, rlh_dtype dtype, std::span<const int64_t> shape) {
  static const int64_t kUnitStride = 1;
  if (shape.size() > 1) throw Error(RLH_E_INVALID_ARGUMENT, "host_tensor: only 0-d and 1-d views (pass strides for more)");
  rlh_tensor t{};
  t.data = data;
  t.device = {RLH_DEVICE_CPU, 0};
  t.ndim = static_cast<int32_t>(shape.size());
  t.dtype = dtype;
  t.shape = const_cast<int64_t*>(shape.data());
  t.strides = shape.size() == 1 ? const_cast<int64_t*>(&kUnitStride) : nullptr;
  t.byte_offset = 0;
  return t;
}

Comm Comm::world(const Host& host) {
  const rlh_host_api* h = host.api();
  if (h == nullptr || h->get_comm == nullptr) throw Error(RLH_E_FAILED_PRECONDITION, "the host has no communicator service");
  Comm c;
  rlh::sdk::check(h->get_comm(h->ctx, &c.api_, &c.comm_), "world communicator");
  c.owned_ = false;
  c.name_ = "world";
  return c;
}

Comm Comm::adopt(const rlh_comm_api* api, rlh_comm* comm, std::string name) {
  Comm c;
  c.api_ = api;
  c.comm_ = comm;
  c.owned_ = true;
  c.name_ = std::move(name);
  return c;
}

Comm& Comm::operator=(Comm&& o) noexcept {
  if (this != &o) {
    reset();
    api_ = o.api_;
    comm_ = o.comm_;
    owned_ = o.owned_;
    name_ = std::move(o.name_);
    o.api_ = nullptr;
    o.comm_ = nullptr;
    o.owned_ = false;
  }
  return *this;
}

void Comm::reset() {
  if (owned_ && comm_ != nullptr && api_ != nullptr) api_->destroy(comm_);
  comm_ = nullptr;
  owned_ = false;
}

void Comm::check(rlh_status* s) const {
  if (s != nullptr) rlh::sdk::check(s, name_ + " group");
}

int Comm::rank() const { return api_->rank(comm_); }
int Comm::size() const { return api_->size(comm_); }

Comm Comm::split(int color, int key, std::string name) const {
  rlh_comm* out = nullptr;
  check(api_->split(comm_, color, key, &out));
  return adopt(api_, out, std::move(name));
}

void Comm::all_reduce(const rlh_tensor& t, int32_t op, void* stream) const { check(api_->all_reduce(comm_, &t, op, stream)); }
void Comm::all_gather(const rlh_tensor& in, const rlh_tensor& out, void* stream) const {
  check(api_->all_gather(comm_, &in, &out, stream));
}
void Comm::reduce_scatter(const rlh_tensor& in, const rlh_tensor& out, int32_t op, void* stream) const {
  check(api_->reduce_scatter(comm_, &in, &out, op, stream));
}
void Comm::broadcast(const rlh_tensor& t, int root, void* stream) const { check(api_->broadcast(comm_, &t, root, stream)); }
void Comm::send(const rlh_tensor& t, int peer, void* stream) const { check(api_->send(comm_, &t, peer, stream)); }
void Comm::recv(const rlh_tensor& t, int peer, void* stream) const { check(api_->recv(comm_, &t, peer, stream)); }
bool Comm::has_recv_any() const {
  return api_ != nullptr && RLH_HAS_FIELD(api_, rlh_comm_api, recv_any) && api_->recv_any != nullptr;
}
int Comm::recv_any(const rlh_tensor& t, void* stream) const {
  if (!has_recv_any())
    throw Error(RLH_E_UNIMPLEMENTED, name_ + " group: its communicator component predates COMM 0.2 and cannot receive from any "
                                             "rank (no recv_any)");
  int32_t peer = -1;
  check(api_->recv_any(comm_, &t, &peer, stream));
  return peer;
}
void Comm::all_to_all(const rlh_tensor& in, const rlh_tensor& out, void* stream) const {
  check(api_->all_to_all(comm_, &in, &out, stream));
}
void Comm::barrier() const { check(api_->barrier(comm_)); }
void Comm::set_timeout(std::chrono::milliseconds timeout) const { api_->set_timeout_ms(comm_, timeout.count()); }

ParallelComms make_parallel_comms(const Comm& world, const ParallelSizes& sizes, const std::vector<GroupKind>& kinds) {
  ParallelComms pc;
  pc.layout = make_parallel_layout(sizes, world.size());
  pc.mine = groups_of_rank(pc.layout, world.rank());
  for (GroupKind k : kinds) {
    const RankGroup& g = pc.mine.of(k);
    // Ranks outside every group of the kind take one color past the last group, and drop the
    // communicator they get: every rank makes the same split calls in the same order.
    const int color = g.member() ? g.index : static_cast<int>(pc.layout.of(k).size());
    const int key = g.member() ? g.position : world.rank();
    Comm c = world.split(color, key, group_kind_name(k));
    if (g.member()) pc.comms[static_cast<int>(k)] = std::move(c);
  }
  return pc;
}

Comm make_device_comm(const Host& host, rlh_device device, const std::string& pin, const std::string& who) {
  const rlh_host_api* h = host.api();
  if (h == nullptr || !RLH_HAS_FIELD(h, rlh_host_api, list_components) || h->list_components == nullptr)
    throw Error(RLH_E_ABI_MISMATCH, who + ": the host cannot list communicators (it predates ABI 0.2)");
  std::vector<std::string> names;
  if (!pin.empty()) {
    names.push_back(pin);
  } else {
    std::string listing;
    rlh::sdk::check(h->list_components(h->ctx, RLH_KIND_COMM, write_to_string, &listing), who + ": listing communicators");
    const nlohmann::json list = nlohmann::json::parse(listing, nullptr, false);
    if (!list.is_array()) throw Error(RLH_E_INTERNAL, "list_components did not write a JSON array");
    for (const auto& c : list) names.push_back(c.value("name", std::string()));
  }
  std::string dev;
  switch (device.device_type) {
    case RLH_DEVICE_CPU: dev = "cpu"; break;
    case RLH_DEVICE_CUDA: dev = "cuda:" + std::to_string(device.device_id); break;
    default: throw Error(RLH_E_INVALID_ARGUMENT, who + ": no communicator for device type " + std::to_string(device.device_type));
  }
  const std::string config = nlohmann::json{{"device", dev}}.dump();
  std::string refusals;
  for (const std::string& name : names) {
    const rlh_comm_api* api = host.find<rlh_comm_api>(RLH_KIND_COMM, name.c_str(), RLH_STRUCT_SIZE(rlh_comm_api, set_timeout_ms));
    rlh_comm* comm = nullptr;
    rlh_status* s = api->create_world(h, config.data(), config.size(), &comm);
    if (s == nullptr) {
      host.info(who + ": communicator for " + dev + ": " + name);
      return Comm::adopt(api, comm, "world@" + dev);
    }
    StatusPtr owned(s);
    const std::string why = status_message(s);
    if (!pin.empty() || (s->code != RLH_E_UNAVAILABLE && s->code != RLH_E_UNIMPLEMENTED))
      throw Error(s->code, who + ": communicator '" + name + "' for " + dev + ": " + why);
    refusals += (refusals.empty() ? "" : "; ") + name + ": " + why;
  }
  throw Error(RLH_E_UNAVAILABLE, who + ": no communicator can serve " + dev +
                                     (refusals.empty() ? std::string(" (none is loaded)") : " (" + refusals + ")"));
}

}  // namespace rlh::sdk
