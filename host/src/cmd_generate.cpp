// rlhost generate: sample continuations of prompts with a GENERATOR component (the native CPU
// generator by default), through the components' ABI tables only, as an embedder would: the
// generator loads and describes the model (through the host's MODEL component), the tokenizer
// component encodes --prompt, renders --chat and decodes the output.
//
//   rlhost generate --model DIR_OR_HUB_ID (--prompt TEXT | --prompt-ids 1,2,3)... [--chat]
//                   [--temperature T] [--top-p P] [--top-k K] [--min-p P] [--seed S]
//                   [--max-new-tokens N] [--stop STR]... [--stop-id ID]... [--ignore-eos]
//                   [--n N] [--device cpu|cuda|cuda:N] [--precision float32|bfloat16] [--json]
//
// --device and --precision say where and how to sample: the native generator runs on the CPU in
// float32, or on a CUDA device (Hopper) in bfloat16 with fp32 logits (its "device" config key);
// another precision on either is refused by name.
//
// --json prints one line per sample: {"ids": prompt + new tokens, "logprobs": one per id, 0 for
// the prompt tokens (NeMo-RL's generation_logprobs layout) then the processed logprob of each
// new token, "num_prompt_tokens", "prompt_index", "sample_index", "truncated", "weight_version",
// and "text" (the new tokens decoded) when a tokenizer is there}.
// The model's EOS ids (generation_config.json, config.json and the tokenizer) stop a sample
// unless --ignore-eos.
#include <boost/program_options.hpp>

#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli_common.hpp"
#include "commands.hpp"
#include "model_eos.hpp"
#include "rlhost/generator.h"
#include "rlhost/host.h"
#include "rlhost/sdk/json_input.hpp"
#include "rlhost/sdk/status.hpp"
#include "rlhost/tokenizer.h"

namespace po = boost::program_options;

namespace rlh::cli {
namespace {

using sdk::Error;
using json = nlohmann::json;

// Everything the command holds, released in reverse order.
struct Session : CliHost {
  const rlh_tokenizer_api* tok_api = nullptr;
  rlh_tokenizer* tok = nullptr;
  const rlh_generator_api* gen_api = nullptr;
  rlh_generator* gen = nullptr;

  ~Session() {
    if (gen != nullptr) gen_api->destroy(gen);
    if (tok != nullptr) tok_api->destroy(tok);
  }
  std::string decode(const int32_t* ids, size_t n) const {
    std::string text;
    sdk::check(tok_api->decode(tok, ids, n, RLH_DECODE_SKIP_SPECIAL_TOKENS, sdk::write_to_string, &text));
    return text;
  }
};

struct Result {
  std::vector<int32_t> ids;
  std::vector<float> logprobs;
  bool truncated = false;
  int64_t version = 0;
};

rlh_status* collect(void* user, const rlh_sample* s) {
  auto* out = static_cast<std::map<std::pair<int64_t, int64_t>, Result>*>(user);
  Result r;
  r.ids.assign(s->ids, s->ids + s->num_tokens);
  r.logprobs.assign(s->logprobs, s->logprobs + s->num_tokens);
  r.truncated = s->truncated != 0;
  r.version = s->weight_version;
  (*out)[{s->prompt_index, s->sample_index}] = std::move(r);
  return nullptr;
}

}  // namespace

int cmd_generate(int argc, char** argv) {
  po::options_description opts("rlhost generate options");
  opts.add_options()
      ("help,h", "show this help")
      ("model,m", po::value<std::string>(), "HF model folder, or a hub id in the local HF cache")
      ("prompt", po::value<std::vector<std::string>>()->composing(), "prompt text (repeat for a batch)")
      ("prompt-ids", po::value<std::vector<std::string>>()->composing(), "comma-separated prompt token ids (repeatable)")
      ("chat", "render each --prompt as a user message with the tokenizer's chat template")
      ("temperature", po::value<double>()->default_value(1.0), "sampling temperature; 0 = greedy")
      ("top-p", po::value<double>()->default_value(1.0), "nucleus sampling mass in (0, 1]; 1 = off")
      ("top-k", po::value<int64_t>()->default_value(0), "keep the k most likely tokens; 0 = off")
      ("min-p", po::value<double>()->default_value(0.0), "drop tokens below min_p * p_max; 0 = off")
      ("seed", po::value<uint64_t>()->default_value(0), "random seed (with prompt and sample index: the draw)")
      ("max-new-tokens", po::value<int64_t>()->default_value(64), "new tokens per sample at most")
      ("stop", po::value<std::vector<std::string>>()->composing(), "stop string (repeatable), matched on decoded text")
      ("stop-id", po::value<std::vector<int32_t>>()->composing(), "stop token id (repeatable)")
      ("ignore-eos", "do not stop at the model's EOS token ids")
      ("n", po::value<int64_t>()->default_value(1), "samples per prompt")
      ("device", po::value<std::string>()->default_value("cpu"), "where to sample: cpu, cuda or cuda:N")
      ("precision", po::value<std::string>()->default_value(""), "float32 on the CPU, bfloat16 on a GPU (the default: the device's)")
      ("json", "print one JSON line per sample: {\"ids\", \"logprobs\", ...}")
      ("tokenizer,t", po::value<std::string>(), "tokenizer.json or folder (default: the model folder)")
      ("generator,g", po::value<std::string>(), "GENERATOR component name (default: the best loaded; 'native')")
      ("generator-config", po::value<std::string>()->default_value("{}"),
       "the generator's config section as JSON, e.g. '{\"kv_cache_bytes\": 268435456}'")
      ("verbose,v", "log the components' info messages")
      ("plugin,p", po::value<std::vector<std::string>>()->composing(),
       "extra plugin to load first (another generator, model family or tokenizer)");
  po::variables_map vm;
  po::store(po::command_line_parser(argc, argv).options(opts).run(), vm);
  po::notify(vm);
  if (vm.count("help")) {
    std::cout << "usage: rlhost generate --model DIR_OR_HUB_ID (--prompt TEXT | --prompt-ids 1,2,3)... [--chat]\n"
                 "                       [--temperature T] [--top-p P] [--top-k K] [--min-p P] [--seed S]\n"
                 "                       [--max-new-tokens N] [--stop STR]... [--n N] [--json]\n\n"
                 "Samples continuations; --json prints {\"ids\": prompt + new ids, \"logprobs\": 0 for the prompt,\n"
                 "then the processed logprob of each new token} per sample.\n\n"
              << opts;
    return 0;
  }
  if (!vm.count("model")) throw Error(RLH_E_INVALID_ARGUMENT, "--model is required");
  const std::string device = vm["device"].as<std::string>();
  const bool on_gpu = device.rfind("cuda", 0) == 0;
  if (device != "cpu" && device != "auto" && !on_gpu)
    throw Error(RLH_E_INVALID_ARGUMENT, "--device '" + device + "': expected cpu, cuda or cuda:N");
  std::string precision = vm["precision"].as<std::string>();
  if (precision.empty()) precision = on_gpu ? "bfloat16" : "float32";
  if (precision == "fp32") precision = "float32";
  if (precision == "bf16") precision = "bfloat16";
  if (precision != "float32" && precision != "bfloat16" && precision != "float16" && precision != "fp16" &&
      precision != "fp8")
    throw Error(RLH_E_INVALID_ARGUMENT, "--precision '" + precision + "': expected float32 or bfloat16");
  if (!on_gpu && precision != "float32")
    throw Error(RLH_E_UNIMPLEMENTED, "generate --precision " + precision +
                                         ": the native generator samples in float32 on the CPU (bfloat16 with --device cuda)");
  if (on_gpu && precision != "bfloat16")
    throw Error(RLH_E_UNIMPLEMENTED, "generate --device " + device + " --precision " + precision +
                                         ": the GPU generator samples in bfloat16 (fp32 logits); use --precision bfloat16");
  const bool text_prompts = vm.count("prompt") > 0, id_prompts = vm.count("prompt-ids") > 0;
  if (text_prompts == id_prompts) throw Error(RLH_E_INVALID_ARGUMENT, "give --prompt or --prompt-ids (not both)");
  if (vm.count("chat") && !text_prompts) throw Error(RLH_E_INVALID_ARGUMENT, "--chat renders --prompt text");
  const std::string model_path = vm["model"].as<std::string>();
  const int64_t n = vm["n"].as<int64_t>();
  if (n < 1) throw Error(RLH_E_INVALID_ARGUMENT, "--n must be >= 1");
  const std::vector<std::string> stops = vm.count("stop") ? vm["stop"].as<std::vector<std::string>>() : std::vector<std::string>{};
  const bool json_out = vm.count("json") > 0;
  std::string gen_config = vm["generator-config"].as<std::string>();
  try {
    if (!sdk::parse_json_input(gen_config, "--generator-config").is_object())
      throw Error(RLH_E_INVALID_ARGUMENT, "--generator-config must be a JSON object");
  } catch (const sdk::InputError& e) {
    throw Error(RLH_E_INVALID_ARGUMENT, e.what());
  }

  Session s;
  rlhost_set_log_level(s.host, vm.count("verbose") ? RLH_LOG_INFO : RLH_LOG_WARN);
  if (vm.count("plugin"))
    for (const auto& p : vm["plugin"].as<std::vector<std::string>>()) sdk::check(rlhost_load_plugin(s.host, p.c_str()));
  sdk::check(rlhost_load_plugin(s.host, "model_llama"));
  sdk::check(rlhost_load_plugin(s.host, "generator"));
  sdk::check(rlhost_load_plugin(s.host, "tokenizer_hf"));

  // The tokenizer: required for text in or stop strings, used for text out when it is there.
  const bool need_tok = text_prompts || !stops.empty();
  const std::string tok_path = vm.count("tokenizer") ? vm["tokenizer"].as<std::string>() : model_path;
  {
    const rlh_component_desc* d = s.find(RLH_KIND_TOKENIZER, nullptr);
    s.tok_api = static_cast<const rlh_tokenizer_api*>(d->api);
    rlh_status* st = s.tok_api->create(s.services(), tok_path.c_str(), &s.tok);
    if (st != nullptr) {
      if (need_tok || vm.count("tokenizer")) sdk::check(st, "tokenizer of " + tok_path);
      rlh_status_destroy(st);  // ids in, ids out: no tokenizer needed
      s.tok = nullptr;
    }
  }

  std::vector<std::vector<int32_t>> prompts;
  if (id_prompts) {
    for (const auto& p : vm["prompt-ids"].as<std::vector<std::string>>()) prompts.push_back(parse_ids(p, "--prompt-ids"));
  } else {
    for (const auto& text : vm["prompt"].as<std::vector<std::string>>()) {
      std::vector<int32_t> ids;
      if (vm.count("chat")) {
        if (s.tok_api->apply_chat_template == nullptr)
          throw Error(RLH_E_UNIMPLEMENTED, "--chat: the tokenizer component has no chat templates");
        const std::string messages = json::array({{{"role", "user"}, {"content", text}}}).dump();
        std::string rendered;
        sdk::check(s.tok_api->apply_chat_template(s.tok, messages.data(), messages.size(), 1, nullptr, 0,
                                                  sdk::write_to_string, &rendered),
                   "--chat");
        // The template writes the special tokens itself (HF apply_chat_template(tokenize=True)).
        sdk::check(s.tok_api->encode(s.tok, rendered.data(), rendered.size(), 0, append_ids, &ids));
      } else {
        sdk::check(s.tok_api->encode(s.tok, text.data(), text.size(), RLH_ENCODE_ADD_SPECIAL_TOKENS, append_ids, &ids));
      }
      if (ids.empty()) throw Error(RLH_E_INVALID_ARGUMENT, "--prompt '" + text + "' encodes to no tokens");
      prompts.push_back(std::move(ids));
    }
  }

  std::set<int32_t> stop_ids;
  if (vm.count("stop-id"))
    for (int32_t id : vm["stop-id"].as<std::vector<int32_t>>()) {
      if (id < 0) throw Error(RLH_E_INVALID_ARGUMENT, "--stop-id: " + std::to_string(id) + " is negative");
      stop_ids.insert(id);
    }
  if (!vm.count("ignore-eos")) {
    const std::set<int32_t> eos = host::model_eos_ids(model_path, s.tok_api, s.tok);
    stop_ids.insert(eos.begin(), eos.end());
  }

  const rlh_component_desc* gd =
      s.find(RLH_KIND_GENERATOR, vm.count("generator") ? vm["generator"].as<std::string>().c_str() : nullptr);
  s.gen_api = static_cast<const rlh_generator_api*>(gd->api);
  if (s.gen_api == nullptr || s.gen_api->struct_size < RLH_STRUCT_SIZE(rlh_generator_api, generate))
    throw Error(RLH_E_ABI_MISMATCH, std::string("generator '") + gd->name + "' has an interface table older than this command needs");
  {
    json c = json::parse(gen_config);
    if (!tok_path.empty() && vm.count("tokenizer") && !c.contains("tokenizer"))
      c["tokenizer"] = tok_path;  // stop strings decode with the same tokenizer
    if (on_gpu && !c.contains("device")) c["device"] = device;
    gen_config = c.dump();
  }
  sdk::check(s.gen_api->create(s.services(), model_path.c_str(), gen_config.data(), gen_config.size(), &s.gen),
             std::string("generator '") + gd->name + "'");

  std::vector<int32_t> flat;
  std::vector<int64_t> offsets = {0};
  for (const auto& p : prompts) {
    flat.insert(flat.end(), p.begin(), p.end());
    offsets.push_back(int64_t(flat.size()));
  }
  const std::vector<int32_t> stop_list(stop_ids.begin(), stop_ids.end());
  std::vector<const char*> stop_ptrs;
  for (const auto& st : stops) stop_ptrs.push_back(st.c_str());
  rlh_sampling sp{};
  sp.struct_size = RLH_STRUCT_SIZE(rlh_sampling, num_stop_strings);
  sp.temperature = vm["temperature"].as<double>();
  sp.top_k = int32_t(std::max<int64_t>(INT32_MIN, std::min<int64_t>(INT32_MAX, vm["top-k"].as<int64_t>())));
  sp.top_p = vm["top-p"].as<double>();
  sp.min_p = vm["min-p"].as<double>();
  sp.max_new_tokens = vm["max-new-tokens"].as<int64_t>();
  sp.seed = vm["seed"].as<uint64_t>();
  sp.stop_token_ids = stop_list.data();
  sp.num_stop_token_ids = stop_list.size();
  sp.stop_strings = stop_ptrs.data();
  sp.num_stop_strings = stop_ptrs.size();
  rlh_generate_args args{};
  args.struct_size = RLH_STRUCT_SIZE(rlh_generate_args, sampling);
  args.prompt_ids = flat.data();
  args.prompt_offsets = offsets.data();
  args.num_prompts = int64_t(prompts.size());
  args.samples_per_prompt = n;
  args.sampling = &sp;
  std::map<std::pair<int64_t, int64_t>, Result> results;
  sdk::check(s.gen_api->generate(s.gen, &args, collect, &results));

  for (const auto& [key, r] : results)
    for (size_t t = 0; t < r.logprobs.size(); ++t)
      if (!std::isfinite(r.logprobs[t]))
        throw Error(RLH_E_DATA_LOSS, "prompt " + std::to_string(key.first) + ", sample " + std::to_string(key.second) +
                                         ": the logprob of new token " + std::to_string(t) +
                                         " is not finite: the model's activations overflowed");
  const bool many = results.size() > 1;
  for (const auto& [key, r] : results) {
    const std::vector<int32_t>& prompt = prompts[size_t(key.first)];
    if (json_out) {
      json j;
      std::vector<int32_t> ids = prompt;
      ids.insert(ids.end(), r.ids.begin(), r.ids.end());
      std::vector<float> lps(prompt.size(), 0.0f);
      lps.insert(lps.end(), r.logprobs.begin(), r.logprobs.end());
      j["ids"] = ids;
      j["logprobs"] = lps;
      j["num_prompt_tokens"] = prompt.size();
      j["prompt_index"] = key.first;
      j["sample_index"] = key.second;
      j["truncated"] = r.truncated;
      j["weight_version"] = r.version;
      if (s.tok != nullptr) j["text"] = s.decode(r.ids.data(), r.ids.size());
      std::cout << j.dump(-1, ' ', false, json::error_handler_t::replace) << "\n";
      continue;
    }
    if (many) std::cout << "== prompt " << key.first << ", sample " << key.second << " ==\n";
    if (s.tok != nullptr) {
      std::cout << s.decode(r.ids.data(), r.ids.size()) << "\n";
    } else {
      for (size_t i = 0; i < r.ids.size(); ++i) std::cout << (i ? "," : "") << r.ids[i];
      std::cout << "\n";
    }
  }
  return 0;
}

}  // namespace rlh::cli
