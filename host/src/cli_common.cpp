#include "cli_common.hpp"

#include <cerrno>
#include <climits>
#include <cstdlib>
#include <sstream>

#include "rlhost/sdk/status.hpp"

namespace rlh::cli {

CliHost::CliHost() { sdk::check(rlhost_create(&host)); }
CliHost::~CliHost() { rlhost_destroy(host); }

void CliHost::load(const std::vector<std::string>& plugins, const char* fallback) {
  if (plugins.empty()) sdk::check(rlhost_load_plugin(host, fallback));
  for (const auto& p : plugins) sdk::check(rlhost_load_plugin(host, p.c_str()));
}

const rlh_component_desc* CliHost::find(int32_t kind, const char* name) const {
  const rlh_host_api* s = services();
  const rlh_component_desc* d = nullptr;
  sdk::check(s->find_component(s->ctx, kind, name, &d));
  return d;
}

std::vector<int32_t> parse_ids(const std::string& text, const char* flag) {
  using sdk::Error;
  std::vector<int32_t> ids;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    const size_t b = item.find_first_not_of(" \t"), e = item.find_last_not_of(" \t");
    if (b == std::string::npos) throw Error(RLH_E_INVALID_ARGUMENT, std::string(flag) + ": empty id in '" + text + "'");
    item = item.substr(b, e - b + 1);
    char* end = nullptr;
    errno = 0;
    const long long v = std::strtoll(item.c_str(), &end, 10);
    if (end == item.c_str() || *end != '\0' || errno != 0 || v < 0 || v > INT32_MAX)
      throw Error(RLH_E_INVALID_ARGUMENT, std::string(flag) + ": '" + item + "' is not a token id (a non-negative integer)");
    ids.push_back(static_cast<int32_t>(v));
  }
  if (ids.empty()) throw Error(RLH_E_INVALID_ARGUMENT, std::string(flag) + ": no ids given");
  return ids;
}

void append_ids(void* user, const void* data, size_t len) {
  auto* v = static_cast<std::vector<int32_t>*>(user);
  const auto* p = static_cast<const int32_t*>(data);
  v->insert(v->end(), p, p + len / sizeof(int32_t));
}

}  // namespace rlh::cli
