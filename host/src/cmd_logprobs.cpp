// rlhost logprobs: per-token log-probabilities of a text or an id sequence under a model, and
// their mean loss. It works only through components' ABI tables, as an embedder would: the
// backend (dtensor by default) loads the model — asking the host's MODEL component to describe
// its architecture — and computes the outputs; the tokenizer component encodes --text.
//
//   rlhost logprobs --model DIR_OR_HUB_ID (--text TEXT | --ids 5,17,42) [--backend NAME]
//                   [--device cpu|cuda|cuda:N|auto] [--precision float32|bfloat16] [--temperature T] [--json]
//
// --device and --precision are the backend's policy.device and policy.precision: on a GPU the
// megatron backend's CUDA engine scores in bf16 (the default backend there is megatron).
//
// Backend outputs are token-aligned (output t = log p(token t | tokens < t), 0 at t = 0); the
// printed token_logprobs[t] is log p(ids[t+1] | ids[..t]), i.e. output t+1, as NeMo-RL and HF
// references lay them out.
#include <boost/program_options.hpp>

#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli_common.hpp"
#include "commands.hpp"
#include "rlhost/backend.h"
#include "rlhost/host.h"
#include "rlhost/sdk/status.hpp"
#include "rlhost/tokenizer.h"

namespace po = boost::program_options;

namespace rlh::cli {
namespace {

using sdk::Error;

// Everything the command holds, released in reverse order (model, backend, tokenizer, host).
struct Session : CliHost {
  const rlh_tokenizer_api* tok_api = nullptr;
  rlh_tokenizer* tok = nullptr;
  const rlh_backend_api* be_api = nullptr;
  rlh_backend* backend = nullptr;
  rlh_model* model = nullptr;

  ~Session() {
    if (model != nullptr) be_api->unload_model(backend, model);
    if (backend != nullptr) be_api->destroy(backend);
    if (tok != nullptr) tok_api->destroy(tok);
  }
};

}  // namespace

int cmd_logprobs(int argc, char** argv) {
  po::options_description opts("rlhost logprobs options");
  opts.add_options()
      ("help,h", "show this help")
      ("model,m", po::value<std::string>(), "HF model folder, or a hub id in the local HF cache")
      ("text", po::value<std::string>(), "text to score (tokenized with the tokenizer next to the model)")
      ("ids", po::value<std::string>(), "comma-separated token ids to score")
      ("backend,b", po::value<std::string>(), "backend plugin: dtensor or megatron (default: dtensor on the CPU, "
                                                "megatron with --device cuda)")
      ("device", po::value<std::string>()->default_value("cpu"),
       "where the model runs: cpu, cuda, cuda:N or auto (the backend's policy.device)")
      ("precision", po::value<std::string>()->default_value("float32"),
       "float32 or bfloat16 (the backend's policy.precision; the CPU engine computes in float32)")
      ("temperature", po::value<double>()->default_value(1.0), "divide the logits by T before the softmax")
      ("no-special", "with --text: encode without the tokenizer's special tokens (BOS)")
      ("json", "print {\"ids\", \"token_logprobs\", \"loss\"} as JSON")
      ("verbose,v", "log the components' info messages")
      ("plugin,p", po::value<std::vector<std::string>>()->composing(),
       "extra plugin to load first (another model family, kernel provider or tokenizer)");
  po::variables_map vm;
  po::store(po::command_line_parser(argc, argv).options(opts).run(), vm);
  po::notify(vm);
  if (vm.count("help")) {
    std::cout << "usage: rlhost logprobs --model DIR_OR_HUB_ID (--text TEXT | --ids 5,17,42) [--backend dtensor|megatron]"
                 " [--device cpu|cuda] [--precision float32|bfloat16] [--temperature T] [--json]\n\n"
                 "Prints log p(ids[t+1] | ids[..t]) for every position and their negated mean (the loss).\n\n"
              << opts;
    return 0;
  }
  if (!vm.count("model")) throw Error(RLH_E_INVALID_ARGUMENT, "--model is required");
  if (int(vm.count("text")) + int(vm.count("ids")) != 1)
    throw Error(RLH_E_INVALID_ARGUMENT, "give exactly one of --text and --ids");
  const double temperature = vm["temperature"].as<double>();
  if (!(temperature > 0) || !std::isfinite(temperature))
    throw Error(RLH_E_INVALID_ARGUMENT, "--temperature must be a positive number");
  const std::string model_path = vm["model"].as<std::string>();
  const std::string device = vm["device"].as<std::string>(), precision = vm["precision"].as<std::string>();
  const std::string backend_name =
      vm.count("backend") ? vm["backend"].as<std::string>() : (device.rfind("cuda", 0) == 0 ? "megatron" : "dtensor");
  // The backend's config section: what a job's `policy` section says about the device.
  const std::string backend_config = nlohmann::json{{"device", device}, {"precision", precision}}.dump();
  const bool json_out = vm.count("json") > 0;

  Session s;
  rlhost_set_log_level(s.host, vm.count("verbose") ? RLH_LOG_INFO : RLH_LOG_WARN);
  if (vm.count("plugin"))
    for (const auto& p : vm["plugin"].as<std::vector<std::string>>()) sdk::check(rlhost_load_plugin(s.host, p.c_str()));
  sdk::check(rlhost_load_plugin(s.host, "model_llama"));
  sdk::check(rlhost_load_plugin(s.host, backend_name.c_str()), "--backend " + backend_name);
  // Kernels through the registry when the provider is there; the backend falls back to its
  // linked reference kernels otherwise, so a missing kernels_cpu is no error.
  if (rlh_status* st = rlhost_load_plugin(s.host, "kernels_cpu")) rlh_status_destroy(st);

  std::vector<int32_t> ids;
  if (vm.count("ids")) {
    ids = parse_ids(vm["ids"].as<std::string>(), "--ids");
  } else {
    sdk::check(rlhost_load_plugin(s.host, "tokenizer_hf"));
    const rlh_component_desc* d = s.find(RLH_KIND_TOKENIZER, nullptr);
    s.tok_api = static_cast<const rlh_tokenizer_api*>(d->api);
    sdk::check(s.tok_api->create(s.services(), model_path.c_str(), &s.tok), "tokenizer of " + model_path);
    const std::string text = vm["text"].as<std::string>();
    sdk::check(s.tok_api->encode(s.tok, text.data(), text.size(),
                                 vm.count("no-special") ? 0 : RLH_ENCODE_ADD_SPECIAL_TOKENS, append_ids, &ids));
  }
  if (ids.size() < 2)
    throw Error(RLH_E_INVALID_ARGUMENT, "at least two tokens are needed (the first one is not predicted); got " +
                                            std::to_string(ids.size()));

  const rlh_component_desc* bd = s.find(RLH_KIND_BACKEND, backend_name.c_str());
  s.be_api = static_cast<const rlh_backend_api*>(bd->api);
  if (s.be_api == nullptr || s.be_api->struct_size < RLH_STRUCT_SIZE(rlh_backend_api, forward))
    throw Error(RLH_E_ABI_MISMATCH, "backend '" + backend_name + "' has an interface table older than this command needs");
  sdk::check(s.be_api->create(s.services(), backend_config.data(), backend_config.size(), &s.backend),
             "backend '" + backend_name + "'");
  rlh_model_args margs{};
  margs.struct_size = RLH_STRUCT_SIZE(rlh_model_args, config_len);
  margs.role = "policy";
  margs.path = model_path.c_str();
  sdk::check(s.be_api->load_model(s.backend, &margs, &s.model));

  // One sequence, one raw-logprob output at the temperature.
  const int64_t T = int64_t(ids.size());
  const std::vector<int64_t> offsets = {0, T};
  rlh_batch batch{};
  batch.struct_size = RLH_STRUCT_SIZE(rlh_batch, constraints);
  batch.num_tokens = T;
  batch.num_seqs = 1;
  batch.token_ids = ids.data();
  batch.seq_offsets = offsets.data();
  rlh_output_spec spec{};
  spec.struct_size = RLH_STRUCT_SIZE(rlh_output_spec, ids_field);
  spec.kind = RLH_OUTPUT_LOGPROB_RAW;
  spec.name = "logprobs";
  spec.temperature = temperature;
  spec.top_p = 1.0;
  std::vector<float> out(size_t(T), 0.0f);
  int64_t shape[1] = {T}, strides[1] = {1};
  rlh_tensor out_t{};
  out_t.data = out.data();
  out_t.device = rlh_device{RLH_DEVICE_CPU, 0};
  out_t.ndim = 1;
  out_t.dtype = rlh_dtype{RLH_DTYPE_FLOAT, 32, 1};
  out_t.shape = shape;
  out_t.strides = strides;
  rlh_forward_args fargs{};
  fargs.struct_size = RLH_STRUCT_SIZE(rlh_forward_args, micro_batch_tokens);
  fargs.batch = &batch;
  fargs.specs = &spec;
  fargs.num_outputs = 1;
  fargs.outputs = &out_t;
  sdk::check(s.be_api->forward(s.backend, s.model, &fargs));

  // Shift from the token-aligned output to "entry t predicts ids[t+1]". A non-finite logprob
  // (the model overflowed) is an error: printed, it would be a null loss and exit 0.
  std::vector<double> token_lp;
  double sum = 0;
  for (int64_t t = 1; t < T; ++t) {
    if (!std::isfinite(out[size_t(t)]))
      throw Error(RLH_E_DATA_LOSS, "the model's logprob of token " + std::to_string(t) + " (id " +
                                       std::to_string(ids[size_t(t)]) + ") is " +
                                       (std::isnan(out[size_t(t)]) ? "NaN" : "infinite") +
                                       ": its activations overflowed; no loss is printed");
    token_lp.push_back(out[size_t(t)]);
    sum -= out[size_t(t)];
  }
  const double loss = sum / double(T - 1);

  if (json_out) {
    std::cout << nlohmann::json{{"ids", ids}, {"token_logprobs", token_lp}, {"loss", loss}}.dump() << "\n";
    return 0;
  }
  std::printf("%8s %8s  %-20s %12s\n", "position", "id", "token", "logprob");
  for (int64_t t = 1; t < T; ++t) {
    std::string piece;
    if (s.tok != nullptr) {
      std::string text;
      rlh_status* st = s.tok_api->decode(s.tok, &ids[size_t(t)], 1, 0, sdk::write_to_string, &text);
      if (st == nullptr) piece = nlohmann::json(text).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
      rlh_status_destroy(st);
    }
    std::printf("%8lld %8d  %-20s %12.6f\n", static_cast<long long>(t), ids[size_t(t)], piece.c_str(),
                token_lp[size_t(t - 1)]);
  }
  std::printf("mean loss over %lld predicted tokens: %.6f (temperature %g, backend %s, device %s, %s)\n",
              static_cast<long long>(T - 1), loss, temperature, backend_name.c_str(), device.c_str(), precision.c_str());
  return 0;
}

}  // namespace rlh::cli
