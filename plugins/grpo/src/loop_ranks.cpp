// The data-parallel ranks of a training loop (see loop_ranks.hpp).
#include "loop_ranks.hpp"

#include <filesystem>

#include "rlhost/sdk/launch_env.hpp"

namespace rlh::grpo {

using sdk::Error;

LoopRanks LoopRanks::of_launch(const sdk::Host& host) {
  LoopRanks r;
  // Without a launcher there is no world communicator to ask (one rank).
  if (sdk::detect_launch().size <= 1) return r;
  r.world = sdk::Comm::world(host);
  r.size = r.world_size = r.world.size();
  r.rank = r.world_rank = r.world.rank();
  return r;
}

void LoopRanks::follow_backend(const sdk::Host& host, Backend& backend, rlh_model* model) {
  if (world_size <= 1) return;
  const std::optional<std::pair<int, int>> layout = backend.data_parallel(model);
  if (!layout) return;  // a backend before BACKEND 0.3: every rank is data-parallel
  const auto [r, n] = *layout;
  if (world_size % n != 0)
    throw Error(RLH_E_INTERNAL, "backend " + backend.name() + ": " + std::to_string(n) +
                                    " data-parallel ranks do not divide the " + std::to_string(world_size) +
                                    " launched ranks");
  // The ranks sharing this data-parallel rank form its model-parallel group; the ranks at the
  // same place of every group are the data-parallel ranks this one sums with. Ordered by world
  // rank, which is the backends' order (Megatron's: dp varies slower than tp and cp, faster than pp).
  group = world.split(r, world_rank, "loop model-parallel group");
  dp = world.split(group.rank(), world_rank, "loop data-parallel group");
  if (group.size() != world_size / n || dp.size() != n || dp.rank() != r)
    throw Error(RLH_E_INTERNAL, "backend " + backend.name() + ": world rank " + std::to_string(world_rank) +
                                    " is data-parallel rank " + std::to_string(r) + " of " + std::to_string(n) +
                                    ", but the loop's groups put it at " + std::to_string(dp.rank()) + " of " +
                                    std::to_string(dp.size()) + " (groups of " + std::to_string(group.size()) + ")");
  rank = r;
  size = n;
  if (group.size() > 1 && writer())
    host.info(std::to_string(n) + " data-parallel rank" + (n == 1 ? "" : "s") + ", model-parallel groups of " +
              std::to_string(group.size()) + " (from backend " + backend.name() + "): each group trains on one share");
}

std::vector<int64_t> LoopRanks::share(const std::vector<int64_t>& rows) const {
  const auto n = static_cast<int64_t>(rows.size());
  return {rows.begin() + begin_of(n), rows.begin() + end_of(n)};
}

void sum_over(const sdk::Comm& c, std::vector<double>& v) {
  if (c && c.size() > 1 && !v.empty()) c.all_reduce(std::span<double>(v), RLH_REDUCE_SUM);
}

void LoopRanks::sum(std::vector<double>& v) const { sum_over(sums(), v); }

ValidCounts LoopRanks::sum(const ValidCounts& mine) const {
  std::vector<double> c = {mine.tokens, mine.seqs};
  sum(c);
  return {c[0], c[1]};
}

std::string broadcast_text(const sdk::Comm& c, const std::string& text) {
  if (!c || c.size() <= 1) return text;
  int64_t n[1] = {static_cast<int64_t>(text.size())};
  c.broadcast(std::span<int64_t>(n, 1), 0);
  std::vector<uint8_t> bytes(text.begin(), text.end());
  bytes.resize(static_cast<size_t>(n[0]));
  if (n[0] > 0) c.broadcast(std::span<uint8_t>(bytes), 0);
  return std::string(bytes.begin(), bytes.end());
}

std::string LoopRanks::broadcast_text(const std::string& text) const { return grpo::broadcast_text(world, text); }

std::optional<sdk::PendingCheckpoint> begin_policy_checkpoint(const LoopRanks& ranks, sdk::CheckpointManager& ckpt,
                                                              int64_t step, Backend& backend, rlh_model* policy,
                                                              const std::string& tokenizer_name,
                                                              const std::string& model_dir) {
  std::optional<sdk::PendingCheckpoint> owned;
  if (ranks.writer()) owned.emplace(ckpt.begin(step));
  const std::filesystem::path dir = ranks.broadcast_text(owned ? owned->dir().string() : std::string());
  save_policy_folder(backend, policy, (dir / "policy").string(), tokenizer_name, model_dir, ranks.writer());
  return owned;
}

bool SaveSchedule::after_step(const LoopRanks& ranks, const sdk::Host& host, const sdk::CheckpointManager* ckpt,
                              int64_t step, bool last, bool forced) {
  deadline_.mark_step();
  out_of_time_ = deadline_.armed() && ranks.rank0(deadline_.due());
  return ckpt != nullptr && (ckpt->is_save_step(step) || last || forced || out_of_time_) &&
         may_save_checkpoint(host, *ckpt, step);
}

bool LoopRanks::rank0(bool mine) const {
  if (world_size <= 1) return mine;
  int64_t v[1] = {mine ? 1 : 0};
  world.broadcast(std::span<int64_t>(v, 1), 0);
  return v[0] != 0;
}

void LoopRanks::barrier() const {
  if (world_size > 1) world.barrier();
}

}  // namespace rlh::grpo
