// Subcommand table and the tokenize command.
#include "commands.hpp"

#include "cli_common.hpp"

#include <boost/program_options.hpp>

#include <cstring>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "rlhost/host.h"
#include "rlhost/sdk/json_input.hpp"
#include "rlhost/sdk/status.hpp"
#include "rlhost/tokenizer.h"

namespace po = boost::program_options;

namespace rlh::cli {
namespace {

using sdk::Error;

// A messages file is a conversation: 256 MiB is far past any context window.
constexpr uint64_t kMaxChatFileBytes = 256u << 20;

std::string read_text_file(const std::string& path, const char* what) {
  try {
    return sdk::read_input_file(path, kMaxChatFileBytes, what);
  } catch (const sdk::InputError& e) {
    throw Error(RLH_E_INVALID_ARGUMENT, e.what());
  }
}

void collect_ids(void* user, const void* data, size_t len) {
  auto* v = static_cast<std::vector<int32_t>*>(user);
  const auto* p = static_cast<const int32_t*>(data);
  v->insert(v->end(), p, p + len / sizeof(int32_t));
}

int cmd_tokenize(int argc, char** argv) {
  po::options_description opts("rlhost tokenize options");
  opts.add_options()
      ("help,h", "show this help")
      ("tokenizer,t", po::value<std::string>(), "tokenizer.json, a model folder, or a hub id in the local HF cache")
      ("text", po::value<std::string>(), "text to encode")
      ("decode", po::value<std::string>(), "comma-separated ids to decode")
      ("chat", po::value<std::string>(), "JSON file with a list of messages to render with the chat template")
      ("add-generation-prompt", "with --chat: end with the assistant turn's header")
      ("no-special", "encode without the post-processor's special tokens; decode skipping special tokens")
      ("json", "print JSON")
      ("plugin,p", po::value<std::vector<std::string>>()->composing(), "plugin providing the tokenizer (default tokenizer_hf)");
  po::variables_map vm;
  po::store(po::command_line_parser(argc, argv).options(opts).run(), vm);
  po::notify(vm);
  if (vm.count("help")) {
    std::cout << "usage: rlhost tokenize --tokenizer DIR_OR_FILE (--text TEXT | --decode 1,2,3 | --chat messages.json) [--json]\n\n" << opts;
    return 0;
  }
  if (!vm.count("tokenizer")) throw Error(RLH_E_INVALID_ARGUMENT, "tokenize: --tokenizer is required");
  int modes = int(vm.count("text")) + int(vm.count("decode")) + int(vm.count("chat"));
  if (modes != 1) throw Error(RLH_E_INVALID_ARGUMENT, "tokenize: give exactly one of --text, --decode, --chat");

  CliHost host;
  host.load(vm.count("plugin") ? vm["plugin"].as<std::vector<std::string>>() : std::vector<std::string>{}, "tokenizer_hf");
  const rlh_component_desc* d = host.find(RLH_KIND_TOKENIZER);
  const auto* api = static_cast<const rlh_tokenizer_api*>(d->api);
  rlh_tokenizer* tok = nullptr;
  sdk::check(api->create(host.services(), vm["tokenizer"].as<std::string>().c_str(), &tok));
  struct Guard { const rlh_tokenizer_api* a; rlh_tokenizer* t; ~Guard() { a->destroy(t); } } guard{api, tok};
  const bool json = vm.count("json") > 0;
  const bool special = vm.count("no-special") == 0;

  if (vm.count("text")) {
    const std::string text = vm["text"].as<std::string>();
    std::vector<int32_t> ids;
    sdk::check(api->encode(tok, text.data(), text.size(), special ? RLH_ENCODE_ADD_SPECIAL_TOKENS : 0, collect_ids, &ids));
    std::string decoded;
    sdk::check(api->decode(tok, ids.data(), ids.size(), 0, sdk::write_to_string, &decoded));
    if (json) {
      std::cout << nlohmann::json{{"ids", ids}, {"decoded", decoded}}.dump() << "\n";
    } else {
      for (size_t i = 0; i < ids.size(); ++i) std::cout << (i ? "," : "") << ids[i];
      std::cout << "\n";
    }
  } else if (vm.count("decode")) {
    std::vector<int32_t> ids = parse_ids(vm["decode"].as<std::string>(), "--decode");
    std::string text;
    sdk::check(api->decode(tok, ids.data(), ids.size(), special ? 0 : RLH_DECODE_SKIP_SPECIAL_TOKENS, sdk::write_to_string, &text));
    if (json) std::cout << nlohmann::json{{"ids", ids}, {"decoded", text}}.dump() << "\n";
    else std::cout << text << "\n";
  } else {
    const std::string path = vm["chat"].as<std::string>();
    std::string messages = read_text_file(path, "--chat file");
    try {
      const auto parsed = sdk::parse_json_input(messages, "--chat file '" + path + "'");
      if (!parsed.is_array()) throw Error(RLH_E_INVALID_ARGUMENT, "--chat file '" + path + "': expected a JSON list of messages");
    } catch (const sdk::InputError& e) {
      throw Error(RLH_E_INVALID_ARGUMENT, e.what());
    }
    std::string prompt;
    sdk::check(api->apply_chat_template(tok, messages.data(), messages.size(), vm.count("add-generation-prompt") ? 1 : 0,
                                        nullptr, 0, sdk::write_to_string, &prompt));
    if (json) {
      std::vector<int32_t> ids;
      sdk::check(api->encode(tok, prompt.data(), prompt.size(), 0, collect_ids, &ids));
      std::cout << nlohmann::json{{"prompt", prompt}, {"ids", ids}}.dump() << "\n";
    } else {
      std::cout << prompt;
      if (prompt.empty() || prompt.back() != '\n') std::cout << "\n";
    }
  }
  return 0;
}

struct Command {
  const char* name;
  int (*fn)(int, char**);
};
const Command kCommands[] = {
    {"tokenize", cmd_tokenize},
    {"logprobs", cmd_logprobs},
    {"generate", cmd_generate},
    {"check-kernels", cmd_check_kernels},
};

}  // namespace

bool is_command(const char* name) {
  for (const auto& c : kCommands)
    if (std::strcmp(c.name, name) == 0) return true;
  return false;
}

int run_command(int argc, char** argv) {
  for (const auto& c : kCommands) {
    if (std::strcmp(c.name, argv[0]) != 0) continue;
    try {
      return c.fn(argc, argv);
    } catch (const po::error& e) {
      std::cerr << "rlhost " << c.name << ": error: " << e.what() << " (see rlhost " << c.name << " --help)\n";
      return 2;
    } catch (const Error& e) {
      std::cerr << "rlhost " << c.name << ": error: " << e.what() << "\n";
      return e.code() == RLH_E_INVALID_ARGUMENT ? 2 : 1;
    } catch (const std::exception& e) {
      std::cerr << "rlhost " << c.name << ": error: " << e.what() << "\n";
      return 1;
    }
  }
  return 2;
}

}  // namespace rlh::cli
