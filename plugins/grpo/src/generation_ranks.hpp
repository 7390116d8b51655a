// Non-colocated generation (NeMo-RL's policy.generation.colocated.enabled: false) and the
// rollouts asynchronous GRPO sends ahead (grpo.async_grpo), over the host's communicator.
//
// Layout: the launched world (cluster.num_nodes x cluster.gpus_per_node ranks under mpirun) splits
// into trainer ranks and generator ranks; the LAST gpus_per_node x num_nodes ranks of
// policy.generation.colocated.resources generate, the ranks before them train (so world rank 0,
// which writes metrics and checkpoints, is a trainer). Each trainer rank has one generator rank of
// its own (trainer t and generator T + t form a pair), so the generator ranks must be half the
// world; any other layout is refused at start with one line naming both sizes.
//
// Trainer ranks build the backend on a host whose world communicator is the trainers' group (the
// backend's data-parallel groups never include a generator rank). Their generator is a
// GeneratorLink to the pair's generator rank:
//   generate: the request (prompt ids, sampling settings, RNG keys) goes to the generator rank,
//     which runs its own generator component and sends the samples back (tokens, logprobs,
//     truncation, weight version); the trainer scores them as a colocated one does. Sampling is
//     keyed by (seed, step, prompt, sample), so the samples are the colocated run's.
//   refit: every trainer visits the policy's weights (the visit is collective under FSDP); trainer
//     rank 0 broadcasts them, full weights, to every generator rank in one group (trainer 0 and
//     the generator ranks). Bytes and seconds are kept for the step's metrics.
//   announce (asynchronous GRPO): the next step's requests are sent before this step trains, so
//     the generator ranks draw them with the weights of the step before while the trainers train
//     (1-step-off); the next generate call with the same request takes the results. Any other
//     request or a refit first receives what is outstanding, so the order stays the pair's order.
// The trainer ends its generator rank with a stop message when it finishes, or fails; a
// generator rank waits for its trainer's next message under the communicator's timeout
// (rlhost.comm_timeout_s), so it exits non-zero when its trainer is gone.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "components.hpp"
#include "rlhost/sdk/comm.hpp"
#include "rlhost/sdk/plugin.hpp"
#include "rollout.hpp"

namespace rlh::grpo {

class GenerationRanks {
 public:
  // Splits the launch's world (collective over every rank). `generator_ranks`: the resources'
  // gpus_per_node x num_nodes; `resources_text` names them in errors.
  static std::unique_ptr<GenerationRanks> create(const sdk::Host& host, int64_t generator_ranks,
                                                 const std::string& resources_text);
  ~GenerationRanks();
  GenerationRanks(const GenerationRanks&) = delete;
  GenerationRanks& operator=(const GenerationRanks&) = delete;

  bool is_generator() const { return generator_; }
  int trainers() const { return trainers_; }
  // The host the trainer's components see: the host's services with the trainers' group as its
  // world communicator.
  const sdk::Host& trainer_host() const { return trainer_host_; }

  // A trainer's generator: a link to its generator rank.
  std::unique_ptr<Generator> remote_generator(const std::string& name);
  // Asynchronous GRPO: sends `requests` ahead (in the order the loop will make them).
  void announce(std::vector<std::unique_ptr<GenerateRequest>> requests);
  // The last refit's broadcast (trainer rank 0; 0 elsewhere).
  double last_refit_bytes() const;
  double last_refit_seconds() const;
  // A trainer's end: tells its generator rank to stop, cleanly or after a failure (best effort).
  void finish();
  void abandon() noexcept;

  // A generator rank's life: serves its trainer's requests with `gen` until told to stop.
  // Returns when the trainer finished; throws when it failed or went silent.
  void serve(Generator& gen);

  struct Impl;

 private:
  GenerationRanks() = default;
  std::unique_ptr<Impl> impl_;
  bool generator_ = false;
  int trainers_ = 0;
  sdk::Host trainer_host_;
};

}  // namespace rlh::grpo
