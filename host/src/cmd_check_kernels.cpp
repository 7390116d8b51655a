// rlhost check-kernels: the SDK's conformance runner (rlhost/sdk/kernel_check.hpp) on kernel
// provider plugins, without rebuilding anything: a provider dropped into the plugin path (or
// named by path) is checked op by op, in every dtype it lists, on every device it runs on,
// against the reference provider, and a table op x dtype is printed.
//
//   rlhost check-kernels [--plugin NAME|PATH]... [--device cpu|cuda:N] [--op NAME]...
//                        [--reference NAME|PATH]
//
// Without --plugin every kernel provider on the plugin path but the reference is checked. The
// exit status is 1 when a case fails, the reference is missing, or nothing could be checked.
#include <boost/program_options.hpp>

#include <cstdio>
#include <filesystem>
#include <iostream>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli_common.hpp"
#include "commands.hpp"
#include "rlhost/host.h"
#include "rlhost/kernels.h"
#include "rlhost/sdk/kernel_check.hpp"
#include "rlhost/sdk/plugin.hpp"
#include "rlhost/sdk/status.hpp"

namespace po = boost::program_options;
namespace fs = std::filesystem;

namespace rlh::cli {
namespace {

using sdk::Error;

// The KERNELS components of the loaded plugin that `arg` (a name on the plugin path or a path)
// names.
std::vector<std::string> kernel_components_of(rlhost_t* host, const std::string& arg) {
  std::string text;
  sdk::check(rlhost_list_plugins(host, sdk::write_to_string, &text));
  const bool is_path = arg.find('/') != std::string::npos || arg.ends_with(".so");
  std::error_code ec;
  const std::string canon = is_path ? fs::weakly_canonical(arg, ec).string() : std::string();
  for (const auto& p : nlohmann::json::parse(text)) {
    if (!p.value("loaded", false) || !p.contains("components")) continue;
    const std::string path = p.value("path", std::string()), name = p.value("name", std::string());
    const std::string file = fs::path(path).filename().string();
    const bool match = is_path ? path == canon : (name == arg || file == "lib" + arg + ".so" || file == arg + ".so");
    if (!match) continue;
    std::vector<std::string> out;
    for (const auto& c : p["components"])
      if (c.value("kind", std::string()) == "kernels") out.push_back(c.value("name", std::string()));
    return out;
  }
  return {};
}

rlh_device parse_device(const std::string& d) {
  if (d == "cpu") return sdk::kCPU;
  if (d.rfind("cuda:", 0) == 0 && d.size() > 5 && d.size() < 9 && d.find_first_not_of("0123456789", 5) == std::string::npos)
    return sdk::cuda_device(std::stoi(d.substr(5)));
  throw Error(RLH_E_INVALID_ARGUMENT, "--device '" + d + "': expected cpu or cuda:N");
}

constexpr int kMaxCudaDevices = 16;

}  // namespace

int cmd_check_kernels(int argc, char** argv) {
  po::options_description opts("rlhost check-kernels options");
  opts.add_options()
      ("help,h", "show this help")
      ("plugin,p", po::value<std::vector<std::string>>()->composing(),
       "kernel provider plugin to check: a name on the plugin path or a .so path (default: every one on the path)")
      ("device", po::value<std::string>(), "check on this device only: cpu or cuda:N (default: the CPU and every CUDA device a provider runs on)")
      ("op", po::value<std::vector<std::string>>()->composing(), "check only this op (repeatable)")
      ("reference", po::value<std::string>()->default_value("kernels_cpu"),
       "the plugin holding the reference provider (its provider_info says \"reference\": true)")
      ("verbose,v", "log the providers' info messages");
  po::variables_map vm;
  po::store(po::command_line_parser(argc, argv).options(opts).run(), vm);
  po::notify(vm);
  if (vm.count("help")) {
    std::cout << "usage: rlhost check-kernels [--plugin NAME|PATH]... [--device cpu|cuda:N] [--op NAME]...\n\n"
                 "Runs every op a kernel provider lists, in every dtype it lists, on every device it runs on,\n"
                 "against the reference provider (kernels_cpu, in float64 where it offers it), and prints a\n"
                 "table op x dtype: pass (worst max|err|/max|ref|), FAIL (worst error; the case is named\n"
                 "below), not offered. Exits 1 when a case fails or the reference is missing.\n\n"
              << opts;
    return 0;
  }
  std::vector<rlh_device> devices;
  const bool device_given = vm.count("device") > 0;
  if (device_given) devices.push_back(parse_device(vm["device"].as<std::string>()));
  sdk::KernelCheckOptions copts;
  if (vm.count("op")) copts.ops = vm["op"].as<std::vector<std::string>>();

  CliHost h;
  rlhost_set_log_level(h.host, vm.count("verbose") ? RLH_LOG_INFO : RLH_LOG_WARN);
  const sdk::Host host(h.services());

  // The providers to check: those of the named plugins, else every one on the plugin path.
  std::vector<std::string> names;
  const std::vector<std::string> plugins =
      vm.count("plugin") ? vm["plugin"].as<std::vector<std::string>>() : std::vector<std::string>{};
  for (const std::string& p : plugins) {
    sdk::check(rlhost_load_plugin(h.host, p.c_str()), "--plugin " + p);
    const std::vector<std::string> comps = kernel_components_of(h.host, p);
    if (comps.empty()) throw Error(RLH_E_INVALID_ARGUMENT, "--plugin " + p + ": the plugin has no kernel provider");
    for (const std::string& c : comps)
      if (std::find(names.begin(), names.end(), c) == names.end()) names.push_back(c);
  }

  // The reference: the provider of the --reference plugin that says it is the reference.
  const std::string ref_arg = vm["reference"].as<std::string>();
  if (rlh_status* s = rlhost_load_plugin(h.host, ref_arg.c_str())) {
    sdk::StatusPtr owned(s);
    throw Error(RLH_E_NOT_FOUND, "no reference kernel provider: " + sdk::status_message(s));
  }
  std::unique_ptr<sdk::ReferenceKernels> ref;
  for (const std::string& c : kernel_components_of(h.host, ref_arg)) {
    const auto* api = host.find<rlh_kernels_api>(RLH_KIND_KERNELS, c.c_str(), RLH_STRUCT_SIZE(rlh_kernels_api, release_op));
    rlh_kernels* inst = nullptr;
    if (rlh_status* s = api->create(host.api(), sdk::kCPU, "{}", 2, &inst)) {
      rlh_status_destroy(s);
      continue;
    }
    auto r = std::make_unique<sdk::ReferenceKernels>(c, api, inst);
    const sdk::ProviderFacts f = sdk::provider_facts(api, inst);
    if (f.reference && !f.device_memory) {
      ref = std::move(r);
      break;
    }
  }
  if (!ref)
    throw Error(RLH_E_NOT_FOUND, "no reference kernel provider: plugin '" + ref_arg +
                                     "' has no kernel provider on the CPU whose provider_info says \"reference\": true");

  if (plugins.empty()) {  // every kernel provider on the plugin path (listing registers them)
    std::string listing;
    sdk::check(host.api()->list_components(host.api()->ctx, RLH_KIND_KERNELS, sdk::write_to_string, &listing));
    for (const auto& c : nlohmann::json::parse(listing)) {
      const std::string n = c.value("name", std::string());
      if (n != ref->name()) names.push_back(n);
    }
    if (names.empty()) throw Error(RLH_E_NOT_FOUND, "no usable kernel provider besides the reference on the plugin path (rlhost --list-plugins says why a plugin cannot run here)");
  }

  int checked = 0;
  std::vector<std::string> failed, errors;
  for (const std::string& name : names) {
    const auto* api = host.find<rlh_kernels_api>(RLH_KIND_KERNELS, name.c_str(), RLH_STRUCT_SIZE(rlh_kernels_api, release_op));
    std::vector<rlh_device> devs = devices;
    if (!device_given) {
      devs.push_back(sdk::kCPU);
      for (int i = 0; i < kMaxCudaDevices; ++i) devs.push_back(sdk::cuda_device(i));
    }
    int here = 0;
    std::vector<std::string> not_on;
    for (const rlh_device dev : devs) {
      const std::string where = sdk::device_name(dev);
      rlh_kernels* inst = nullptr;
      if (rlh_status* s = api->create(host.api(), dev, "{}", 2, &inst)) {
        sdk::StatusPtr owned(s);
        const bool refusal = s->code == RLH_E_UNIMPLEMENTED || s->code == RLH_E_UNAVAILABLE ||
                             (dev.device_type == RLH_DEVICE_CUDA && dev.device_id > 0);
        if (!refusal || device_given)
          errors.push_back(name + " on " + where + ": " + sdk::status_message(s));
        else
          not_on.push_back(where + " (" + sdk::status_message(s) + ")");
        if (dev.device_type == RLH_DEVICE_CUDA) break;  // devices are numbered from 0
        continue;
      }
      struct Destroy {
        const rlh_kernels_api* a;
        rlh_kernels* k;
        ~Destroy() { a->destroy(k); }
      } destroy{api, inst};
      const sdk::KernelCheckReport rep = sdk::check_kernels(*ref, name, api, inst, dev, copts);
      for (const std::string& op : copts.ops)
        if (rep.row(op) == nullptr)
          throw Error(RLH_E_INVALID_ARGUMENT, "--op " + op + ": no such op (" + name +
                                                  " does not list it and the conformance runner has no case for it)");
      std::cout << rep.table() << "\n";
      ++checked;
      ++here;
      if (rep.failed()) failed.push_back(name + " on " + where);
    }
    if (here == 0 && !device_given && errors.empty())
      errors.push_back(name + " runs on none of the devices tried: " + [&] {
        std::string s;
        for (const auto& n : not_on) s += (s.empty() ? "" : "; ") + n;
        return s;
      }());
  }
  for (size_t i = 0; i + 1 < errors.size(); ++i) std::cerr << "rlhost check-kernels: error: " << errors[i] << "\n";
  if (!errors.empty()) throw Error(RLH_E_FAILED_PRECONDITION, errors.back());
  if (!failed.empty()) {
    std::string s;
    for (const auto& f : failed) s += (s.empty() ? "" : ", ") + f;
    throw Error(RLH_E_FAILED_PRECONDITION, "kernel conformance failed: " + s + " (the FAIL lines above name each case)");
  }
  if (checked == 0) throw Error(RLH_E_FAILED_PRECONDITION, "nothing was checked");
  return 0;
}

}  // namespace rlh::cli
