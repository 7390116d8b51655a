// Rollouts as bytes (see rollout_wire.hpp).
#include "rollout_wire.hpp"

#include "byte_wire.hpp"
#include "token_balance.hpp"

namespace rlh::grpo {

std::vector<uint8_t> serialize_rollout(const Rollout& r) {
  ByteWriter w;
  w.i64(r.samples_per_prompt);
  w.i64(static_cast<int64_t>(r.prompts.size()));
  for (const Prompt& p : r.prompts) {
    w.i64(p.row_index);
    w.str(p.row.dump());
    w.str(p.text);
    w.vec(p.ids);
    w.i64(p.too_long ? 1 : 0);
  }
  w.i64(static_cast<int64_t>(r.responses.size()));
  for (const Response& s : r.responses) {
    w.i64(s.prompt);
    w.vec(s.ids);
    w.vec(s.logprobs);
    w.i64(s.truncated ? 1 : 0);
    w.i64(s.weight_version + 1);  // -1 (unknown) travels as 0: the reader rejects negatives
    w.str(s.text);
    w.vec(s.rewards);
    w.vec(s.mask);
    w.i64(s.turns);
    w.i64(s.terminated ? 1 : 0);
  }
  return std::move(w.out);
}

Rollout deserialize_rollout(std::span<const uint8_t> bytes, const std::string& from) {
  ByteReader rd{bytes, "rollout from " + from};
  Rollout r;
  r.samples_per_prompt = rd.i64();
  const int64_t np = rd.i64();
  rd.fits(np, 5 * sizeof(int64_t));  // a prompt takes at least its five counts
  r.prompts.resize(static_cast<size_t>(np));
  for (Prompt& p : r.prompts) {
    p.row_index = rd.i64();
    const std::string row = rd.str();
    p.row = nlohmann::json::parse(row, nullptr, false);
    if (p.row.is_discarded()) rd.fail("malformed (a prompt's row is not JSON)");
    p.text = rd.str();
    p.ids = rd.vec<int32_t>();
    p.too_long = rd.i64() != 0;
  }
  const int64_t ns = rd.i64();
  rd.fits(ns, 10 * sizeof(int64_t));
  r.responses.resize(static_cast<size_t>(ns));
  for (Response& s : r.responses) {
    s.prompt = rd.i64();
    if (s.prompt >= np) rd.fail("malformed (a response's prompt index is out of range)");
    s.ids = rd.vec<int32_t>();
    s.logprobs = rd.vec<float>();
    s.truncated = rd.i64() != 0;
    s.weight_version = rd.i64() - 1;
    s.text = rd.str();
    s.rewards = rd.vec<double>();
    s.mask = rd.vec<uint8_t>();
    s.turns = rd.i64();
    s.terminated = rd.i64() != 0;
  }
  if (rd.at != bytes.size()) rd.fail("malformed (bytes left after the last response)");
  return r;
}

Rollout merge_rollouts(std::vector<Rollout> parts) {
  Rollout out = std::move(parts.front());
  for (size_t k = 1; k < parts.size(); ++k) {
    const int64_t base = static_cast<int64_t>(out.prompts.size());
    for (Prompt& p : parts[k].prompts) out.prompts.push_back(std::move(p));
    for (Response& r : parts[k].responses) {
      r.prompt += base;
      out.responses.push_back(std::move(r));
    }
  }
  return out;
}

Rollout all_gather_rollout(const sdk::Comm& c, const Rollout& mine) {
  const std::vector<std::vector<uint8_t>> all = all_gather_bytes(c, serialize_rollout(mine));
  std::vector<Rollout> parts;
  for (size_t k = 0; k < all.size(); ++k) {
    parts.push_back(deserialize_rollout(all[k], "rank " + std::to_string(k)));
    if (parts.back().samples_per_prompt != mine.samples_per_prompt)
      throw sdk::Error(RLH_E_INTERNAL, "rollout from rank " + std::to_string(k) + ": " +
                                           std::to_string(parts.back().samples_per_prompt) +
                                           " samples per prompt, this rank has " + std::to_string(mine.samples_per_prompt));
  }
  return merge_rollouts(std::move(parts));
}

}  // namespace rlh::grpo
