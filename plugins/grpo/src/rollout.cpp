// Rollouts: prompt order, prompt rendering, generation and scoring (see rollout.hpp).
#include "rollout.hpp"

#include <algorithm>
#include <chrono>
#include <numeric>

#include "rlhost/sdk/status.hpp"

namespace rlh::grpo {

using json = nlohmann::json;
using sdk::Error;

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// splitmix64, fixed by its definition so the order is the same on every platform.
uint64_t mix(uint64_t& s) {
  uint64_t z = (s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

}  // namespace

// ---- PromptOrder -------------------------------------------------------------------------------

PromptOrder::PromptOrder(int64_t size, uint64_t seed, bool shuffle)
    : size_(size), seed_(seed), shuffle_(shuffle) {
  build_order();
}

void PromptOrder::build_order() {
  order_.resize(static_cast<size_t>(size_));
  std::iota(order_.begin(), order_.end(), int64_t{0});
  if (!shuffle_) return;
  uint64_t s = seed_ ^ (0xA0761D6478BD642Full * static_cast<uint64_t>(epoch_ + 1));
  for (int64_t i = size_ - 1; i > 0; --i) {  // Fisher-Yates
    const uint64_t bound = static_cast<uint64_t>(i + 1);
    const uint64_t limit = UINT64_MAX - UINT64_MAX % bound;
    uint64_t v;
    do v = mix(s); while (v >= limit);
    std::swap(order_[static_cast<size_t>(i)], order_[static_cast<size_t>(v % bound)]);
  }
}

std::vector<int64_t> PromptOrder::next(int64_t n) {
  if (n > size_)
    throw Error(RLH_E_INVALID_ARGUMENT, "a batch of " + std::to_string(n) + " prompts is more than the " +
                                            std::to_string(size_) + " rows of the dataset");
  if (position_ + n > size_) {  // drop_last: the rest of this epoch is skipped
    ++epoch_;
    position_ = 0;
    build_order();
  }
  std::vector<int64_t> out(order_.begin() + position_, order_.begin() + position_ + n);
  position_ += n;
  return out;
}

json PromptOrder::state() const {
  return json{{"epoch", epoch_}, {"position", position_}, {"size", size_}, {"seed", seed_},
              {"shuffle", shuffle_}};
}

void PromptOrder::restore(const json& st, const std::string& origin) {
  try {
    if (st.at("size").get<int64_t>() != size_ || st.at("seed").get<uint64_t>() != seed_ ||
        st.at("shuffle").get<bool>() != shuffle_)
      throw Error(RLH_E_FAILED_PRECONDITION,
                  origin + ": the checkpoint's data order (size, seed, shuffle) " + st.dump() +
                      " differs from this configuration's; resuming would not continue the same run");
    // Both read before either is set: a checkpoint that fails here leaves this order as it was
    // (a resume then falls back to an older checkpoint).
    const int64_t epoch = st.at("epoch").get<int64_t>();
    const int64_t position = st.at("position").get<int64_t>();
    if (epoch < 0 || position < 0 || position > size_)
      throw Error(RLH_E_DATA_LOSS, origin + ": data position out of range: " + st.dump());
    epoch_ = epoch;
    position_ = position;
  } catch (const json::exception& e) {
    throw Error(RLH_E_DATA_LOSS, origin + ": malformed data position: " + e.what());
  }
  build_order();
}

// ---- prompts -----------------------------------------------------------------------------------

Prompt make_prompt(const Tokenizer& tok, PromptFormat format, const json& row, int64_t row_index,
                   int64_t max_input_seq_length, const std::string& origin) {
  Prompt p;
  p.row_index = row_index;
  p.row = row;
  auto it = row.find("prompt");
  if (it == row.end() || !it->is_string())
    throw Error(RLH_E_INVALID_ARGUMENT,
                origin + ": row " + std::to_string(row_index) + " has no string 'prompt'");
  const std::string prompt = it->get<std::string>();
  const auto sp = row.find("system_prompt");
  const bool system = sp != row.end() && sp->is_string();
  if (format == PromptFormat::kChatTemplate) {
    json messages = json::array();
    if (system) messages.push_back({{"role", "system"}, {"content", *sp}});
    messages.push_back({{"role", "user"}, {"content", prompt}});
    p.text = tok.apply_chat_template(messages, true);
  } else {
    // NeMo-RL's passthrough template (chat_template: null): the contents one after another.
    p.text = system ? sp->get<std::string>() + prompt : prompt;
  }
  // The template already holds any BOS it wants (NeMo-RL tokenizes its output without adding
  // special tokens).
  p.ids = tok.encode(p.text, false);
  if (p.ids.empty())
    throw Error(RLH_E_INVALID_ARGUMENT,
                origin + ": row " + std::to_string(row_index) + " has an empty prompt");
  if (static_cast<int64_t>(p.ids.size()) >= max_input_seq_length) {
    // NeMo-RL's math_hf_data_processor: a prompt of max_input_seq_length tokens or more keeps
    // its first min(4, max_input_seq_length) ("make smaller and mask out"), is still generated
    // from and scored, and its samples get loss multiplier 0.
    p.ids.resize(static_cast<size_t>(std::min<int64_t>(4, max_input_seq_length)));
    p.too_long = true;
  }
  return p;
}

// ---- generation and scoring --------------------------------------------------------------------

namespace {

struct Collect {
  Rollout* r;
  int64_t samples;
};

rlh_status* on_sample(void* user, const rlh_sample* s) {
  auto* c = static_cast<Collect*>(user);
  if (s->prompt_index < 0 || s->prompt_index >= static_cast<int64_t>(c->r->prompts.size()) ||
      s->sample_index < 0 || s->sample_index >= c->samples)
    return sdk::make_local_status(RLH_E_OUT_OF_RANGE, "generator returned a sample outside the request");
  Response& out = c->r->responses[static_cast<size_t>(s->prompt_index * c->samples + s->sample_index)];
  out.prompt = s->prompt_index;
  out.ids.assign(s->ids, s->ids + s->num_tokens);
  out.logprobs.assign(s->logprobs, s->logprobs + s->num_tokens);
  out.truncated = s->truncated != 0;
  out.weight_version = s->weight_version;
  return nullptr;
}

}  // namespace

int64_t response_room(const GenerationConfig& gcfg, int64_t max_total_sequence_length, const Prompt& prompt) {
  return std::min<int64_t>(gcfg.max_new_tokens,
                           gcfg.sequence_cap(max_total_sequence_length) - static_cast<int64_t>(prompt.ids.size()));
}

void cut_to_room(Response& resp, int64_t room) {
  if (static_cast<int64_t>(resp.ids.size()) <= room) return;
  // A prefix of an autoregressive sample is what a lower cap would have drawn (the RNG is keyed
  // per token), so the cut sample is exactly the one vLLM's per-sequence limit gives; it ended
  // at the limit, not at a stop.
  resp.ids.resize(static_cast<size_t>(room));
  resp.logprobs.resize(static_cast<size_t>(room));
  resp.truncated = true;
}

std::unique_ptr<GenerateRequest> make_generate_request(const Tokenizer& tok, const std::vector<Prompt>& prompts,
                                                       int64_t samples, const SamplingSettings& sampling,
                                                       const GenerationConfig& gcfg,
                                                       int64_t max_total_sequence_length, uint64_t seed,
                                                       int64_t step_key, int64_t first_prompt_index) {
  auto q = std::make_unique<GenerateRequest>();
  q->offsets = {0};
  int64_t longest = 0, shortest = INT64_MAX;
  for (const Prompt& p : prompts) {
    q->ids.insert(q->ids.end(), p.ids.begin(), p.ids.end());
    q->offsets.push_back(static_cast<int64_t>(q->ids.size()));
    longest = std::max<int64_t>(longest, static_cast<int64_t>(p.ids.size()));
    shortest = std::min<int64_t>(shortest, static_cast<int64_t>(p.ids.size()));
  }
  // vLLM ends each sequence when prompt + response reach max_model_len, so a short prompt has
  // more room than a long one. The request asks for the most room any prompt has and
  // response_room() cuts each sample to its own (cut_to_room): one call, whatever the generator.
  const int64_t cap = gcfg.sequence_cap(max_total_sequence_length);
  if (longest >= cap)
    throw Error(RLH_E_INVALID_ARGUMENT,
                std::string(gcfg.sequence_cap_key(max_total_sequence_length)) + ": " + std::to_string(cap) + " leaves no room to generate after a prompt of " + std::to_string(longest) +
                    " tokens (lower data.max_input_seq_length)");
  const int64_t max_new = prompts.empty() ? gcfg.max_new_tokens : std::min<int64_t>(gcfg.max_new_tokens, cap - shortest);

  q->stop_ids = tok.eos_token_ids();
  for (int32_t id : gcfg.stop_token_ids)
    if (std::find(q->stop_ids.begin(), q->stop_ids.end(), id) == q->stop_ids.end()) q->stop_ids.push_back(id);
  q->stop_strings = gcfg.stop_strings;
  for (const auto& s : q->stop_strings) q->stop_ptrs.push_back(s.c_str());

  rlh_sampling& sp = q->sampling;
  sp.struct_size = RLH_STRUCT_SIZE(rlh_sampling, num_stop_strings);
  sp.temperature = sampling.temperature;
  sp.top_k = sampling.top_k;
  sp.top_p = sampling.top_p;
  sp.min_p = sampling.min_p;
  sp.max_new_tokens = max_new;
  sp.seed = seed;
  sp.step = step_key;
  sp.stop_token_ids = q->stop_ids.data();
  sp.num_stop_token_ids = q->stop_ids.size();
  sp.stop_strings = q->stop_ptrs.data();
  sp.num_stop_strings = q->stop_ptrs.size();

  rlh_generate_args& args = q->args;
  args.struct_size = RLH_STRUCT_SIZE(rlh_generate_args, sampling);
  args.prompt_ids = q->ids.data();
  args.prompt_offsets = q->offsets.data();
  args.num_prompts = static_cast<int64_t>(prompts.size());
  args.samples_per_prompt = samples;
  args.first_prompt_index = first_prompt_index;
  args.sampling = &q->sampling;
  return q;
}

Rollout run_rollout(Generator& gen, const Tokenizer& tok, Environment& env,
                    std::vector<Prompt> prompts, int64_t samples, const SamplingSettings& sampling,
                    const GenerationConfig& gcfg, int64_t max_total_sequence_length, uint64_t seed,
                    int64_t step_key, int64_t first_prompt_index, RolloutTimes* times) {
  Rollout r;
  r.prompts = std::move(prompts);
  r.samples_per_prompt = samples;
  r.responses.resize(r.prompts.size() * static_cast<size_t>(samples));
  for (auto& resp : r.responses) resp.weight_version = INT64_MIN;
  const std::unique_ptr<GenerateRequest> q = make_generate_request(
      tok, r.prompts, samples, sampling, gcfg, max_total_sequence_length, seed, step_key, first_prompt_index);
  const rlh_generate_args& args = q->args;

  auto t0 = std::chrono::steady_clock::now();
  Collect c{&r, samples};
  gen.generate(args, on_sample, &c);
  for (Response& resp : r.responses) {
    if (resp.weight_version == INT64_MIN)
      throw Error(RLH_E_INTERNAL, "generator '" + gen.name() + "' did not return every sample");
    cut_to_room(resp, response_room(gcfg, max_total_sequence_length, r.prompts[static_cast<size_t>(resp.prompt)]));
  }
  if (times != nullptr) times->generation += seconds_since(t0);

  t0 = std::chrono::steady_clock::now();
  std::vector<std::string> metadata(r.prompts.size());
  for (size_t i = 0; i < r.prompts.size(); ++i) metadata[i] = r.prompts[i].row.dump();
  std::vector<rlh_env_sample> batch(r.responses.size());
  for (size_t i = 0; i < r.responses.size(); ++i) {
    Response& resp = r.responses[i];
    resp.text = tok.decode(resp.ids, true);
    const Prompt& p = r.prompts[static_cast<size_t>(resp.prompt)];
    rlh_env_sample& s = batch[i];
    s.struct_size = RLH_STRUCT_SIZE(rlh_env_sample, metadata_len);
    s.prompt = p.text.data();
    s.prompt_len = p.text.size();
    s.response = resp.text.data();
    s.response_len = resp.text.size();
    s.metadata_json = metadata[static_cast<size_t>(resp.prompt)].data();
    s.metadata_len = metadata[static_cast<size_t>(resp.prompt)].size();
  }
  std::vector<double> rewards;
  env.score(batch, rewards);
  const size_t nr = env.reward_names().size();
  for (size_t i = 0; i < r.responses.size(); ++i)
    r.responses[i].rewards.assign(rewards.begin() + static_cast<std::ptrdiff_t>(i * nr),
                                  rewards.begin() + static_cast<std::ptrdiff_t>((i + 1) * nr));
  if (times != nullptr) times->reward += seconds_since(t0);
  return r;
}

}  // namespace rlh::grpo
