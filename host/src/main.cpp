// rlhost: the command line. Everything it does goes through librlhost's C API (rlhost/host.h),
// the same API embedders use.
//
//   rlhost --plugin megatron --plugin grpo --config my.yaml a.b=v ++c.d=w
//   rlhost --list-plugins [--json]
//   rlhost --print-config --config my.yaml [overrides]
//   rlhost tokenize | logprobs | generate | check-kernels ...   (subcommands, see --help)
#include <boost/program_options.hpp>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "commands.hpp"
#include "rlhost/host.h"
#include "rlhost/sdk/launch_env.hpp"
#include "rlhost/sdk/status.hpp"

namespace po = boost::program_options;

namespace {

rlhost_t* g_host = nullptr;

void on_signal(int) { rlhost_cancel(g_host); }

// "rlhost", or "rlhost rank 3" when a launcher started several ranks: whose error line it is.
const std::string& who() {
  static const std::string w = [] {
    try {
      const rlh::sdk::LaunchEnv e = rlh::sdk::detect_launch();
      if (e.size > 1) return "rlhost rank " + std::to_string(e.rank);
    } catch (const std::exception&) {  // the host reports a malformed launcher variable itself
    }
    return std::string("rlhost");
  }();
  return w;
}

// Prints a status as one line and returns the exit code for it.
int report(rlh_status* s) {
  if (s == nullptr) return 0;
  std::string msg = rlh::sdk::status_message(s);
  rlh_code code = s->code;
  rlh_status_destroy(s);
  // One write: the lines of several ranks share a terminal and must not interleave.
  const std::string line = who() + ": error: " + msg + "\n";
  std::fwrite(line.data(), 1, line.size(), stderr);
  std::fflush(stderr);
  return code == RLH_E_CANCELLED ? 130 : 1;
}

void print_plugin_table(const nlohmann::json& list) {
  for (const auto& p : list) {
    if (p.contains("error") && !p.contains("name")) {
      std::cout << "✗ " << p["path"].get<std::string>() << "\n    " << p["error"].get<std::string>() << "\n";
      continue;
    }
    bool ok = p.value("can_run", false);
    std::cout << (ok ? "✓ " : "✗ ") << p["name"].get<std::string>() << " " << p["version"].get<std::string>()
              << " (" << p["vendor"].get<std::string>() << ", ABI " << p["abi"].get<std::string>() << ")"
              << (p.value("loaded", false) ? " [loaded]" : "") << "\n    " << p["path"].get<std::string>() << "\n";
    if (p.contains("reason")) std::cout << "    " << (ok ? "note: " : "cannot run here: ") << p["reason"].get<std::string>() << "\n";
    for (const auto& c : p["components"]) {
      std::cout << "    " << c["kind"].get<std::string>() << " " << c["name"].get<std::string>() << " "
                << c["version"].get<std::string>() << " (interface " << c["interface"].get<std::string>() << ")";
      if (c.contains("architectures")) {
        std::cout << ":";
        for (const auto& a : c["architectures"]) std::cout << " " << a.get<std::string>();
      }
      if (c.contains("error")) std::cout << " — not usable: " << c["error"].get<std::string>();
      std::cout << "\n";
    }
  }
}

const char* kUsage =
    "usage: rlhost [--plugin NAME|PATH]... [--config FILE] [OVERRIDE]...\n"
    "       rlhost --list-plugins [--json]\n"
    "       rlhost --print-config --config FILE [OVERRIDE]...\n"
    "       rlhost COMMAND --help   (commands: tokenize, logprobs, generate, check-kernels)\n"
    "\n"
    "Runs an RL post-training job described by a NeMo-RL style YAML configuration.\n"
    "Overrides: a.b=v sets an existing key, ++a.b=v adds or sets, +a.b=v adds, ~a.b deletes.\n";

}  // namespace

int main(int argc, char** argv) {
  // Subcommands are dispatched before the main option parser: each has its own options.
  if (argc > 1 && argv[1][0] != '-' && rlh::cli::is_command(argv[1])) return rlh::cli::run_command(argc - 1, argv + 1);

  po::options_description opts("options");
  opts.add_options()
      ("help,h", "show this help")
      ("version", "print versions")
      ("plugin,p", po::value<std::vector<std::string>>()->composing(), "load a plugin: a name on the plugin path, or a .so path")
      ("plugin-dir", po::value<std::vector<std::string>>()->composing(), "add a folder to the plugin path")
      ("config,c", po::value<std::string>(), "YAML configuration file (NeMo-RL layout, defaults: chains)")
      ("list-plugins", "list every plugin found and loaded, with its components and whether it can run here")
      ("json", "with --list-plugins: print JSON")
      ("print-config", "print the fully resolved configuration as YAML and exit")
      ("check-config", "check the configuration as a run does at start (JSON report of accepted, unused "
                       "and refused NeMo-RL settings) and exit; non-zero when a run would refuse it")
      ("log-level", po::value<std::string>()->default_value("info"), "trace, debug, info, warning or error");
  po::options_description hidden;
  hidden.add_options()("override", po::value<std::vector<std::string>>(), "");
  po::options_description all;
  all.add(opts).add(hidden);
  po::positional_options_description pos;
  pos.add("override", -1);

  po::variables_map vm;
  try {
    po::store(po::command_line_parser(argc, argv).options(all).positional(pos).run(), vm);
    po::notify(vm);
  } catch (const po::error& e) {
    std::cerr << "rlhost: error: " << e.what() << " (see rlhost --help)\n";
    return 2;
  }
  if (vm.count("help")) {
    std::cout << kUsage << "\n" << opts;
    return 0;
  }
  if (vm.count("version")) {
    uint32_t major = 0, minor = 0;
    rlhost_abi_version(&major, &minor);
    std::cout << "rlhost " << RLHOST_VERSION << " (plugin ABI " << major << "." << minor << ")\n";
    return 0;
  }

  int32_t level = RLH_LOG_INFO;
  const std::string lv = vm["log-level"].as<std::string>();
  if (lv == "trace") level = RLH_LOG_TRACE;
  else if (lv == "debug") level = RLH_LOG_DEBUG;
  else if (lv == "info") level = RLH_LOG_INFO;
  else if (lv == "warning" || lv == "warn") level = RLH_LOG_WARN;
  else if (lv == "error") level = RLH_LOG_ERROR;
  else {
    std::cerr << "rlhost: error: --log-level '" << lv << "' is not one of trace, debug, info, warning, error\n";
    return 2;
  }

  std::vector<std::string> overrides;
  if (vm.count("override")) overrides = vm["override"].as<std::vector<std::string>>();
  for (const auto& o : overrides) {
    if (o.find('=') == std::string::npos && o.rfind("~", 0) != 0) {
      std::cerr << "rlhost: error: unexpected argument '" << o << "' (overrides look like a.b=v; see rlhost --help)\n";
      return 2;
    }
  }

  rlhost_t* host = nullptr;
  if (int rc = report(rlhost_create(&host))) return rc;
  g_host = host;
  rlhost_set_log_level(host, level);
  std::signal(SIGINT, on_signal);
  std::signal(SIGTERM, on_signal);

  int rc = 0;
  auto finish = [&](int code) {
    g_host = nullptr;
    rlhost_destroy(host);
    // A failed run leaves at once: exit handlers may wait on the other ranks (comm_mpi meets
    // them before MPI_Finalize at a clean exit), and a failed rank must not. Everything the host
    // writes is flushed by rlhost_destroy; the launcher sees the non-zero exit and stops the job.
    if (code != 0) {
      std::fflush(nullptr);
      std::_Exit(code);
    }
    return code;
  };

  if (vm.count("plugin-dir"))
    for (const auto& d : vm["plugin-dir"].as<std::vector<std::string>>())
      if ((rc = report(rlhost_add_plugin_dir(host, d.c_str())))) return finish(rc);

  std::vector<std::string> plugins;
  if (vm.count("plugin")) plugins = vm["plugin"].as<std::vector<std::string>>();
  const bool listing = vm.count("list-plugins") > 0;
  rlh_status* load_failure = nullptr;  // while listing: the first --plugin that failed to load
  for (const auto& p : plugins) {
    rlh_status* s = rlhost_load_plugin(host, p.c_str());
    // While listing, a plugin that fails to load is shown with its reason; the exit code says so
    // after the listing, so scripts notice.
    if (s != nullptr && listing) {
      if (load_failure == nullptr) load_failure = s;
      else rlh_status_destroy(s);
      continue;
    }
    if ((rc = report(s))) return finish(rc);
  }

  if (listing) {
    std::string text;
    if ((rc = report(rlhost_list_plugins(host, rlh::sdk::write_to_string, &text)))) {
      rlh_status_destroy(load_failure);
      return finish(rc);
    }
    if (vm.count("json")) std::cout << text << "\n";
    else print_plugin_table(nlohmann::json::parse(text));
    std::cout << std::flush;
    return finish(report(load_failure));
  }

  if (!vm.count("config")) {
    std::cerr << "rlhost: error: no --config given (try examples/configs/grpo_math_1B.yaml, or rlhost --help)\n";
    return finish(2);
  }
  if ((rc = report(rlhost_load_config(host, vm["config"].as<std::string>().c_str())))) return finish(rc);
  for (const auto& o : overrides)
    if ((rc = report(rlhost_apply_override(host, o.c_str())))) return finish(rc);

  if (vm.count("check-config")) {
    std::string text;
    rlh_status* s = rlhost_check_config(host, rlh::sdk::write_to_string, &text);
    if (!text.empty()) std::cout << nlohmann::json::parse(text).dump(2) << "\n";
    return finish(report(s));
  }
  if (vm.count("print-config")) {
    std::string text;
    if ((rc = report(rlhost_resolve_config(host, rlh::sdk::write_to_string, &text)))) return finish(rc);
    std::cout << text;
    return finish(0);
  }
  return finish(report(rlhost_run(host)));
}
