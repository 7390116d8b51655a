// rlhost C++ SDK: status objects and exception translation.
//
// Header-only and compiled into each plugin (never exported), so it carries no ABI of its own.
// C++ code inside a plugin throws rlh::sdk::Error (or any std::exception); every function that a
// C table points at wraps its body in rlh::sdk::guard(), which turns exceptions into rlh_status*
// (exceptions must never cross the C boundary). Calls the other way — a plugin calling the host
// or another plugin — return rlh_status*, which rlh::sdk::check() turns back into an exception.
#pragma once

#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <new>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

#include "rlhost/core.h"

namespace rlh::sdk {

// An error with a status code. what() is the one-line message.
class Error : public std::runtime_error {
 public:
  Error(rlh_code code, const std::string& message) : std::runtime_error(message), code_(code) {}
  rlh_code code() const noexcept { return code_; }

 private:
  rlh_code code_;
};

// A status allocated by this module (malloc/free), used when no host is at hand (entry, probe
// in tests) — the host's make_status is preferred since host-made statuses outlive plugins.
inline rlh_status* make_local_status(rlh_code code, std::string_view msg) noexcept {
  if (code == RLH_OK) return nullptr;
  // One block: the struct followed by the message bytes.
  auto* s = static_cast<rlh_status*>(std::malloc(sizeof(rlh_status) + msg.size() + 1));
  if (s == nullptr) return nullptr;  // out of memory: nothing better to return
  char* text = reinterpret_cast<char*>(s + 1);
  std::memcpy(text, msg.data(), msg.size());
  text[msg.size()] = '\0';
  s->struct_size = RLH_STRUCT_SIZE(rlh_status, destroy);
  s->code = code;
  s->reserved0 = 0;
  s->message = text;
  s->message_len = msg.size();
  s->destroy = [](rlh_status* self) { std::free(self); };
  return s;
}

// Owns a status.
struct StatusDeleter {
  void operator()(rlh_status* s) const noexcept { rlh_status_destroy(s); }
};
using StatusPtr = std::unique_ptr<rlh_status, StatusDeleter>;

inline std::string status_message(const rlh_status* s) {
  if (s == nullptr) return {};
  if (s->message == nullptr) return rlh_code_name(s->code);
  return std::string(s->message, s->message_len);
}

// Throws Error if `s` is an error, destroying it either way. `context` prefixes the message.
inline void check(rlh_status* s, std::string_view context = {}) {
  if (s == nullptr) return;
  StatusPtr owned(s);
  std::string msg = status_message(s);
  if (!context.empty()) msg = std::string(context) + ": " + msg;
  throw Error(s->code, msg);
}

// Status factory: the host's when given (statuses outlive the plugin), else a local one.
using MakeStatusFn = rlh_status* (*)(rlh_code, const char*, size_t);

inline rlh_status* to_status(MakeStatusFn make, rlh_code code, std::string_view msg) noexcept {
  if (make != nullptr) return make(code, msg.data(), msg.size());
  return make_local_status(code, msg);
}

// Runs `fn` and converts any exception into a status: the trampoline every C entry point of a
// C++ plugin goes through. `fn` returns void or rlh_status*.
template <typename Fn>
rlh_status* guard(MakeStatusFn make, Fn&& fn) noexcept {
  try {
    if constexpr (std::is_same_v<decltype(fn()), rlh_status*>) {
      return fn();
    } else {
      fn();
      return nullptr;
    }
  } catch (const Error& e) {
    return to_status(make, e.code(), e.what());
  } catch (const std::bad_alloc&) {
    return to_status(make, RLH_E_RESOURCE_EXHAUSTED, "out of memory");
  } catch (const std::invalid_argument& e) {
    return to_status(make, RLH_E_INVALID_ARGUMENT, e.what());
  } catch (const std::out_of_range& e) {
    return to_status(make, RLH_E_OUT_OF_RANGE, e.what());
  } catch (const std::exception& e) {
    return to_status(make, RLH_E_INTERNAL, e.what());
  } catch (...) {
    return to_status(make, RLH_E_INTERNAL, "unknown C++ exception");
  }
}

// rlh_write_fn that appends to a std::string passed as `user`.
inline void write_to_string(void* user, const void* data, size_t len) {
  static_cast<std::string*>(user)->append(static_cast<const char*>(data), len);
}

}  // namespace rlh::sdk
