// libnccl.so.2 at run time (nccl_loader.hpp).
#include "nccl_loader.hpp"

#include <dlfcn.h>

#include <mutex>

namespace rlh::comm_nccl {
namespace {

struct Loaded {
  Nccl api;
  bool ok = false;
  std::string why;
};

template <typename F>
bool bind(void* lib, const char* name, F& slot, std::string& why) {
  slot = reinterpret_cast<F>(::dlsym(lib, name));
  if (slot == nullptr && why.empty()) why = std::string("libnccl.so.2 has no ") + name;
  return slot != nullptr;
}

Loaded load() {
  Loaded l;
  // Never closed: communicators may live until the process ends.
  void* lib = ::dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* e = ::dlerror();
    l.why = std::string("cannot load libnccl.so.2 (") + (e != nullptr ? e : "not found") + ")";
    return l;
  }
  Nccl& n = l.api;
  bool ok = true;
  ok &= bind(lib, "ncclGetVersion", n.GetVersion, l.why);
  ok &= bind(lib, "ncclGetUniqueId", n.GetUniqueId, l.why);
  ok &= bind(lib, "ncclCommInitRankConfig", n.CommInitRankConfig, l.why);
  ok &= bind(lib, "ncclCommSplit", n.CommSplit, l.why);
  ok &= bind(lib, "ncclCommFinalize", n.CommFinalize, l.why);
  ok &= bind(lib, "ncclCommDestroy", n.CommDestroy, l.why);
  ok &= bind(lib, "ncclCommAbort", n.CommAbort, l.why);
  ok &= bind(lib, "ncclCommGetAsyncError", n.CommGetAsyncError, l.why);
  ok &= bind(lib, "ncclGetErrorString", n.GetErrorString, l.why);
  ok &= bind(lib, "ncclAllReduce", n.AllReduce, l.why);
  ok &= bind(lib, "ncclAllGather", n.AllGather, l.why);
  ok &= bind(lib, "ncclReduceScatter", n.ReduceScatter, l.why);
  ok &= bind(lib, "ncclBroadcast", n.Broadcast, l.why);
  ok &= bind(lib, "ncclSend", n.Send, l.why);
  ok &= bind(lib, "ncclRecv", n.Recv, l.why);
  ok &= bind(lib, "ncclGroupStart", n.GroupStart, l.why);
  ok &= bind(lib, "ncclGroupEnd", n.GroupEnd, l.why);
  n.GetLastError = reinterpret_cast<const char* (*)(ncclComm_t)>(::dlsym(lib, "ncclGetLastError"));
  if (!ok) return l;
  if (n.GetVersion(&n.version) != ncclSuccess) {
    l.why = "ncclGetVersion failed";
    return l;
  }
  // 2.18: ncclCommSplit with nonblocking communicators (the timeouts rely on them).
  if (n.version < 21800) {
    l.why = "libnccl.so.2 is version " + std::to_string(n.version) + "; comm_nccl needs 2.18 or later";
    return l;
  }
  l.ok = true;
  return l;
}

}  // namespace

const Nccl* nccl(std::string* why) {
  static const Loaded l = load();
  if (!l.ok) {
    if (why != nullptr) *why = l.why;
    return nullptr;
  }
  return &l.api;
}

std::string nccl_error(ncclResult_t r, ncclComm_t comm) {
  const Nccl* n = nccl();
  if (n == nullptr) return "NCCL error " + std::to_string(static_cast<int>(r));
  std::string s = n->GetErrorString(r);
  if (n->GetLastError != nullptr) {
    const char* last = n->GetLastError(comm);
    if (last != nullptr && *last != '\0') s += " (" + std::string(last) + ")";
  }
  return s;
}

}  // namespace rlh::comm_nccl
