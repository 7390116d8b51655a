// Multi-turn rollouts: generation and environment steps alternate (see rollout.hpp).
#include <algorithm>
#include <chrono>

#include "rlhost/sdk/status.hpp"
#include "rollout.hpp"

namespace rlh::grpo {

using json = nlohmann::json;
using sdk::Error;

int64_t Response::generated_tokens() const {
  if (mask.empty()) return static_cast<int64_t>(ids.size());
  return static_cast<int64_t>(std::count(mask.begin(), mask.end(), uint8_t{1}));
}

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// One turn's output of one active sample.
struct TurnOut {
  std::vector<int32_t> ids;
  std::vector<float> logprobs;
  bool truncated = false;
  int64_t weight_version = INT64_MIN;
};

struct TurnCollect {
  std::vector<TurnOut>* out;
};

rlh_status* on_turn_sample(void* user, const rlh_sample* s) {
  auto* c = static_cast<TurnCollect*>(user);
  if (s->prompt_index < 0 || s->prompt_index >= static_cast<int64_t>(c->out->size()) || s->sample_index != 0)
    return sdk::make_local_status(RLH_E_OUT_OF_RANGE, "generator returned a sample outside the request");
  TurnOut& o = (*c->out)[static_cast<size_t>(s->prompt_index)];
  o.ids.assign(s->ids, s->ids + s->num_tokens);
  o.logprobs.assign(s->logprobs, s->logprobs + s->num_tokens);
  o.truncated = s->truncated != 0;
  o.weight_version = s->weight_version;
  return nullptr;
}

// The generator's RNG key of turn t's request: prompt index (first + position among the active
// samples) under the rollout's step key. Turn t's indices start at t * 2^40 past the rollout's
// first sample, so no two turns (and no two rollouts of one step, whose samples are disjoint
// ranges below 2^40) draw from the same streams.
constexpr int64_t kTurnStride = int64_t{1} << 40;

}  // namespace

Rollout run_multi_turn_rollout(Generator& gen, const Tokenizer& tok, Environment& env,
                               std::vector<Prompt> prompts, int64_t samples, const SamplingSettings& sampling,
                               const GenerationConfig& gcfg, int64_t max_total_sequence_length,
                               int64_t max_turns, uint64_t seed, int64_t step_key, int64_t first_prompt_index,
                               RolloutTimes* times) {
  if (max_turns <= 1)
    return run_rollout(gen, tok, env, std::move(prompts), samples, sampling, gcfg, max_total_sequence_length, seed,
                       step_key, first_prompt_index, times);
  Rollout r;
  r.prompts = std::move(prompts);
  r.samples_per_prompt = samples;
  const size_t n = r.prompts.size() * static_cast<size_t>(samples);
  r.responses.resize(n);
  const size_t num_rewards = env.reward_names().size();
  for (size_t i = 0; i < n; ++i) {
    Response& resp = r.responses[i];
    resp.prompt = static_cast<int64_t>(i / static_cast<size_t>(samples));
    resp.turns = 0;
    resp.terminated = false;
    resp.weight_version = INT64_MIN;
    resp.rewards.assign(num_rewards, 0.0);
  }
  // A sequence ends at vLLM's max_model_len when one below max_total_sequence_length is set:
  // generation and observations alike, so no turn's prompt passes it.
  const std::string cap_key = gcfg.sequence_cap_key(max_total_sequence_length);
  max_total_sequence_length = gcfg.sequence_cap(max_total_sequence_length);
  int64_t longest = 0;
  for (const Prompt& p : r.prompts) longest = std::max<int64_t>(longest, static_cast<int64_t>(p.ids.size()));
  if (max_total_sequence_length - longest <= 0)
    throw Error(RLH_E_INVALID_ARGUMENT,
                cap_key + ": " + std::to_string(max_total_sequence_length) + " leaves no room to generate after a prompt of " +
                    std::to_string(longest) + " tokens (lower data.max_input_seq_length)");

  std::vector<int32_t> stop_ids = tok.eos_token_ids();
  for (int32_t id : gcfg.stop_token_ids)
    if (std::find(stop_ids.begin(), stop_ids.end(), id) == stop_ids.end()) stop_ids.push_back(id);
  std::vector<const char*> stop_strings;
  for (const auto& s : gcfg.stop_strings) stop_strings.push_back(s.c_str());

  std::vector<std::string> rows(r.prompts.size());
  for (size_t p = 0; p < r.prompts.size(); ++p) rows[p] = r.prompts[p].row.dump();
  std::vector<json> history(n, json::array());
  std::vector<std::vector<std::string>> extra_stops(n);  // the environment's, for the next turn
  std::vector<size_t> active(n);
  for (size_t i = 0; i < n; ++i) active[i] = i;
  const int64_t first_sample = first_prompt_index * samples;
  auto length_of = [&](size_t i) {
    return static_cast<int64_t>(r.prompts[static_cast<size_t>(r.responses[i].prompt)].ids.size() +
                                r.responses[i].ids.size());
  };

  for (int64_t turn = 0; turn < max_turns && !active.empty(); ++turn) {
    // ---- generation: each active sample's ids so far are its prompt. Samples are grouped by
    // their stop strings (the run's plus what the environment gave for this turn), one request
    // per group; within the turn they are ordered by group, and a sample's RNG key is its place
    // in that order, so the draw is a pure function of the rollout's inputs.
    std::stable_sort(active.begin(), active.end(),
                     [&](size_t x, size_t y) { return extra_stops[x] < extra_stops[y]; });
    std::vector<TurnOut> outs(active.size());
    auto t0 = std::chrono::steady_clock::now();
    for (size_t g0 = 0; g0 < active.size();) {
      size_t g1 = g0 + 1;
      while (g1 < active.size() && extra_stops[active[g1]] == extra_stops[active[g0]]) ++g1;
      std::vector<int32_t> ids;
      std::vector<int64_t> offsets = {0};
      int64_t room = 0;  // the most any sample of the group may still add
      for (size_t k = g0; k < g1; ++k) {
        const size_t i = active[k];
        const Prompt& p = r.prompts[static_cast<size_t>(r.responses[i].prompt)];
        ids.insert(ids.end(), p.ids.begin(), p.ids.end());
        ids.insert(ids.end(), r.responses[i].ids.begin(), r.responses[i].ids.end());
        offsets.push_back(static_cast<int64_t>(ids.size()));
        room = std::max(room, max_total_sequence_length - length_of(i));
      }
      std::vector<const char*> stops = stop_strings;
      for (const std::string& e : extra_stops[active[g0]])
        if (std::find(gcfg.stop_strings.begin(), gcfg.stop_strings.end(), e) == gcfg.stop_strings.end())
          stops.push_back(e.c_str());
      // One request for the group; samples with less room are cut to theirs afterwards. A prefix
      // of an autoregressive sample is what a smaller max_new_tokens would have drawn (the RNG is
      // keyed per token), so the cut samples are exact.
      rlh_sampling sp{};
      sp.struct_size = RLH_STRUCT_SIZE(rlh_sampling, num_stop_strings);
      sp.temperature = sampling.temperature;
      sp.top_k = sampling.top_k;
      sp.top_p = sampling.top_p;
      sp.min_p = sampling.min_p;
      sp.max_new_tokens = std::min<int64_t>(gcfg.max_new_tokens, room);
      sp.seed = seed;
      sp.step = step_key;
      sp.stop_token_ids = stop_ids.data();
      sp.num_stop_token_ids = stop_ids.size();
      sp.stop_strings = stops.data();
      sp.num_stop_strings = stops.size();
      rlh_generate_args args{};
      args.struct_size = RLH_STRUCT_SIZE(rlh_generate_args, sampling);
      args.prompt_ids = ids.data();
      args.prompt_offsets = offsets.data();
      args.num_prompts = static_cast<int64_t>(g1 - g0);
      args.samples_per_prompt = 1;
      args.first_prompt_index = turn * kTurnStride + first_sample + static_cast<int64_t>(g0);
      args.sampling = &sp;
      std::vector<TurnOut> group(g1 - g0);
      TurnCollect c{&group};
      gen.generate(args, on_turn_sample, &c);
      for (size_t k = g0; k < g1; ++k) outs[k] = std::move(group[k - g0]);
      g0 = g1;
    }
    for (const TurnOut& o : outs)
      if (o.weight_version == INT64_MIN)
        throw Error(RLH_E_INTERNAL, "generator '" + gen.name() + "' did not return every sample");
    if (times != nullptr) times->generation += seconds_since(t0);

    // ---- the environment's step on this turn's responses
    t0 = std::chrono::steady_clock::now();
    std::vector<std::string> texts(active.size()), metadata(active.size());
    std::vector<uint8_t> cut(active.size(), 0);
    for (size_t k = 0; k < active.size(); ++k) {
      Response& resp = r.responses[active[k]];
      TurnOut& o = outs[k];
      const int64_t left = max_total_sequence_length - length_of(active[k]);
      if (static_cast<int64_t>(o.ids.size()) >= left) {
        // The sequence is full: what fits is kept, the sample ends after this turn's step.
        o.ids.resize(static_cast<size_t>(left));
        o.logprobs.resize(static_cast<size_t>(left));
        cut[k] = 1;
      }
      resp.ids.insert(resp.ids.end(), o.ids.begin(), o.ids.end());
      resp.logprobs.insert(resp.logprobs.end(), o.logprobs.begin(), o.logprobs.end());
      resp.mask.insert(resp.mask.end(), o.ids.size(), uint8_t{1});
      resp.truncated = resp.truncated || o.truncated || cut[k] != 0;
      resp.weight_version = o.weight_version;
      texts[k] = tok.decode(o.ids, true);
      json meta = r.prompts[static_cast<size_t>(resp.prompt)].row;
      if (!meta.is_object()) meta = json::object();
      meta["rlh_history"] = history[active[k]];
      metadata[k] = meta.dump();
    }
    std::vector<rlh_env_sample> batch(active.size());
    for (size_t k = 0; k < active.size(); ++k) {
      const Prompt& p = r.prompts[static_cast<size_t>(r.responses[active[k]].prompt)];
      rlh_env_sample& s = batch[k];
      s.struct_size = RLH_STRUCT_SIZE(rlh_env_sample, metadata_len);
      s.prompt = p.text.data();
      s.prompt_len = p.text.size();
      s.response = texts[k].data();
      s.response_len = texts[k].size();
      s.metadata_json = metadata[k].data();
      s.metadata_len = metadata[k].size();
    }
    Environment::Step step;
    env.step(batch, step);

    // ---- rewards summed over turns (NeMo-RL's total_reward); observations appended untrained
    std::vector<size_t> next;
    for (size_t k = 0; k < active.size(); ++k) {
      const size_t i = active[k];
      Response& resp = r.responses[i];
      for (size_t q = 0; q < num_rewards; ++q) resp.rewards[q] += step.rewards[k * num_rewards + q];
      ++resp.turns;
      std::vector<int32_t> obs;
      if (!step.observations[k].empty()) obs = tok.encode(step.observations[k], false);
      const int64_t left = max_total_sequence_length - length_of(i);
      bool stop = cut[k] != 0;
      if (static_cast<int64_t>(obs.size()) >= left) {
        // NeMo-RL: an observation that reaches the length limit is cut to fit and ends the sample.
        obs.resize(static_cast<size_t>(std::max<int64_t>(left, 0)));
        resp.truncated = true;
        stop = true;
      }
      resp.ids.insert(resp.ids.end(), obs.begin(), obs.end());
      resp.logprobs.insert(resp.logprobs.end(), obs.size(), 0.0f);
      resp.mask.insert(resp.mask.end(), obs.size(), uint8_t{0});
      resp.text += texts[k];
      resp.text += step.observations[k];
      history[i].push_back({{"response", texts[k]}, {"observation", step.observations[k]}});
      // NeMo-RL replaces a sample's stop strings with the environment's each turn (none: the run's).
      extra_stops[i] = step.stop_strings[k].value_or(std::vector<std::string>{});
      if (step.done[k] != 0)
        resp.terminated = true;
      else if (!stop)
        next.push_back(i);
    }
    active = std::move(next);
    if (times != nullptr) times->reward += seconds_since(t0);
  }
  return r;
}

}  // namespace rlh::grpo
