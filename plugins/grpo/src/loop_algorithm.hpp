// The ALGORITHM component's C entry points (rlhost/algorithm.h) for a loop class: `create`
// builds the loop from the host and the configuration text, `run` runs it, `destroy` frees it,
// each behind sdk::guard so an exception becomes a status. Shared by the plugins built from
// plugins/grpo (grpo, sft, dpo, rm: one .so each), which differ only in the loop they build.
//
//   std::unique_ptr<Loop> make(const rlh::sdk::Host&, const std::string& config_text);
//   constexpr char kName[] = "sft";
//   const rlh_algorithm_api* api = &rlh::grpo::LoopAlgorithm<SftLoop, make, kName>::api;
#pragma once

#include <memory>
#include <string>

#include "rlhost/algorithm.h"
#include "rlhost/sdk/plugin.hpp"

namespace rlh::grpo {

template <class Loop, std::unique_ptr<Loop> (*Make)(const sdk::Host&, const std::string&), const char* Name>
struct LoopAlgorithm {
  struct Instance {
    sdk::Host host;
    std::unique_ptr<Loop> loop;
  };

  static rlh_status* create(const rlh_host_api* host, const char* config, size_t len, rlh_algorithm** out) {
    return sdk::guard(host != nullptr ? host->make_status : nullptr, [&] {
      if (host == nullptr || out == nullptr || (config == nullptr && len > 0))
        throw sdk::Error(RLH_E_INVALID_ARGUMENT, std::string(Name) + ": create: NULL argument");
      auto a = std::make_unique<Instance>();
      a->host = sdk::Host(host);
      a->loop = Make(a->host, std::string(config != nullptr ? config : "", len));
      *out = reinterpret_cast<rlh_algorithm*>(a.release());
    });
  }
  static void destroy(rlh_algorithm* self) { delete reinterpret_cast<Instance*>(self); }
  static rlh_status* run(rlh_algorithm* self) {
    auto* a = reinterpret_cast<Instance*>(self);
    return sdk::guard(a->host.make_status(), [&] { a->loop->run(); });
  }

  static constexpr rlh_algorithm_api api = {RLH_STRUCT_SIZE(rlh_algorithm_api, run), create, destroy, run};
};

}  // namespace rlh::grpo
