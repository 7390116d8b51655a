// What the rlhost subcommands share: a host they own, token-id lists from the command line, and
// the tokenizer's write callback into an id vector.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "rlhost/host.h"
#include "rlhost/plugin.h"

namespace rlh::cli {

// Owns a librlhost instance for one command. A command's session derives from it and releases
// its components in its own destructor, before the host goes.
struct CliHost {
  rlhost_t* host = nullptr;
  CliHost();
  ~CliHost();
  CliHost(const CliHost&) = delete;
  CliHost& operator=(const CliHost&) = delete;
  const rlh_host_api* services() const { return rlhost_services(host); }
  // Loads `plugins`, or `fallback` when none were named.
  void load(const std::vector<std::string>& plugins, const char* fallback);
  // The component of `kind` (named, or the only/first one when name is null); throws if none.
  const rlh_component_desc* find(int32_t kind, const char* name = nullptr) const;
};

// "1, 2,3" -> {1, 2, 3}: non-negative int32 ids; errors name `flag`.
std::vector<int32_t> parse_ids(const std::string& text, const char* flag);

// rlh_write_fn appending int32 ids to the std::vector<int32_t> at `user`.
void append_ids(void* user, const void* data, size_t len);

}  // namespace rlh::cli
