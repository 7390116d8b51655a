// What the C API's source files share: the object behind rlhost_t, the handles it owns (the
// component handles of ABI 0.4), and the exception-to-status wrapper.
#pragma once

#include <cstring>
#include <set>
#include <string>

#include "config.hpp"
#include "host.hpp"
#include "rlhost/host.h"
#include "rlhost/sdk/status.hpp"

// A component handle (rlhost_tokenizer_t, rlhost_model_t, rlhost_generator_t) registers with its
// host, so rlhost_destroy can close what the caller left open before the plugins go.
struct rlhost_handle {
  rlhost_t* owner = nullptr;
  explicit rlhost_handle(rlhost_t* h);
  virtual ~rlhost_handle();
  rlhost_handle(const rlhost_handle&) = delete;
  rlhost_handle& operator=(const rlhost_handle&) = delete;
};

struct rlhost_t {
  rlh::host::Host host;
  std::set<rlhost_handle*> handles;
  rlhost_t() = default;
  ~rlhost_t() {
    while (!handles.empty()) delete *handles.begin();  // each removes itself
  }
};

inline rlhost_handle::rlhost_handle(rlhost_t* h) : owner(h) { owner->handles.insert(this); }
inline rlhost_handle::~rlhost_handle() { owner->handles.erase(this); }

namespace rlh::capi {

// Like sdk::guard, plus ConfigError -> INVALID_ARGUMENT, with librlhost-owned statuses.
template <typename Fn>
rlh_status* call(Fn&& fn) noexcept {
  try {
    fn();
    return nullptr;
  } catch (const rlh::host::ConfigError& e) {
    return rlh::sdk::make_local_status(RLH_E_INVALID_ARGUMENT, e.what());
  } catch (...) {
    return rlh::sdk::guard(nullptr, [] { throw; });
  }
}

inline rlh_status* invalid(const char* what) { return rlh::sdk::make_local_status(RLH_E_INVALID_ARGUMENT, what); }

}  // namespace rlh::capi
