// Non-colocated generation (NeMo-RL's policy.generation.colocated.enabled: false) and the
// rollouts asynchronous GRPO sends ahead (grpo.async_grpo), over the host's communicator.
//
// Layout: the launched world (cluster.num_nodes x cluster.gpus_per_node ranks under mpirun) splits
// into T trainer ranks and M generator ranks; the LAST gpus_per_node x num_nodes ranks of
// policy.generation.colocated.resources generate, the ranks before them train (so world rank 0,
// which writes metrics and checkpoints, is a trainer). Once the backend names the trainers'
// layout (D data-parallel groups of g ranks: g = 1 without tensor, context or pipeline
// parallelism), each data-parallel group gets k = M / D generator ranks of its own:
//   k dividing g: the group's generate calls split into k parts (group_generation.hpp); the first
//     rank of every g / k of the group (a "client") sends its part to its generator rank, and the
//     group all-gathers the samples. k = g pairs every trainer rank with a generator rank (the
//     group's split as colocated); k = 1 gives the group one generator rank, fed by its first rank.
//   k a multiple of g: every rank of the group is a client with k / g generator ranks, and splits
//     each of its calls (its part of the group's) into contiguous parts, one per generator rank,
//     sent before any is received, so they generate at once.
//   M < D with D a multiple of M: every D / M groups share one generator rank, each group fed by
//     its first rank (as k = 1). The clients' calls are not collective (validation shares, empty
//     shares and multi-turn rounds differ between them), so the generator rank receives from
//     whichever client sends first (COMM 0.2's recv_any; refused with one line without it).
// Generator ranks are numbered by data-parallel rank, then place in the group. Parts keep their
// prompts' indices in the call, so the samples are those one generator draws. Any other M is
// refused with one line naming M, T, D and g (T and M not dividing one another already at the
// split, before the model loads).
//
// Tensor-parallel generators (policy.generation.vllm_cfg.tensor_parallel_size = G > 1): the M
// generator ranks form M / G generators of G consecutive ranks, and everything above counts
// generators instead of generator ranks. A client talks to its generator's first rank (its
// leader); the leader shares each message it receives (layout, request, refit, stop) with its
// group before acting on it, so every rank of the group acts on the client's messages in the
// client's order, runs the same generate calls (collective inside the generator) and joins the
// refit broadcast; the leader alone replies.
//
// Trainer ranks build the backend on a host whose world communicator is the trainers' group (the
// backend's data-parallel groups never include a generator rank). Trainer rank 0 tells every
// generator rank which trainer ranks are its clients (attach, after the model loaded); a generator
// rank then hears only from its clients. The trainers' generator is a GeneratorLink:
//   generate (clients only): the request (prompt ids, sampling settings, RNG keys; the header names
//     the weight version of the client's last refit) goes to the client's generator rank(s), which
//     run their own generator component; when the client waits for the samples it sends a fetch,
//     and the generator rank sends them back (tokens, logprobs, truncation, weight version) only
//     then, so it never blocks on a client that trains while another one waits. The trainer scores
//     them as a colocated one does. Sampling is keyed by (seed, step, prompt, sample), so the
//     samples are the colocated run's whatever order a shared generator rank serves its clients in.
//   A generator rank acts on each client's messages in that client's order; across clients it does
//     what can be done now (serve a request, answer a fetch) and waits for a refit until every
//     running client asked for it, so each request is served with the weights of the version its
//     header names (checked; the colocated run's order).
//   refit, resharding (the backend has BACKEND 0.5's visit_weight_pieces and rlhost.refit_reshard
//     is not false; weight_reshard.hpp): every trainer rank visits its own pieces (no gather) and
//     sends each generator rank exactly the intersection of its pieces with that rank's needs (its
//     tensor-parallel boxes, or every tensor whole), point to point; the plan is agreed once, at
//     the first refit, through trainer rank 0. A client announces the refit on the link
//     (kRefitPieces, queued like any message, so a shared generator rank starts it once every
//     client asked); needs and pieces travel on a communicator of their own (a split of the world
//     made at that first refit), so a shared generator rank's recv_any on the link never takes a
//     trainer's pieces, whether the trainer is a client of it or not.
//     A tensor-parallel generator's ranks receive only their pieces and keep no whole copy.
//   refit, broadcast (otherwise): every trainer visits the policy's weights (collective under
//     FSDP, and under tensor or pipeline parallelism, where the visit gathers each weight whole
//     from the ranks' pieces); trainer rank 0 broadcasts them, full weights, to
//     every generator rank in one group (trainer 0 and the generator ranks). The other trainers
//     only take part in the visit. Bytes and seconds are kept for the step's metrics.
//   announce (asynchronous GRPO): the next steps' requests (a client's part of them) are sent
//     before this step trains, max_trajectory_age_steps = k steps ahead, so the generator ranks
//     draw them with the weights in force when they reach them while the trainers train (step s
//     trains on rollouts k versions old once k steps have passed); the next generate call with
//     the front request takes its results. Any other request or a refit first receives what is
//     outstanding, so the order stays the client's order.
// A client ends its generator ranks with a stop message when it finishes, or fails (trainer rank 0
// stops every generator rank when it fails before attach); a generator rank returns once every
// client finished, stops at the first that failed, and waits for its clients' next message under
// the communicator's timeout (rlhost.comm_timeout_s), so it exits non-zero when they are gone.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "components.hpp"
#include "loop_ranks.hpp"
#include "rlhost/sdk/comm.hpp"
#include "rlhost/sdk/plugin.hpp"
#include "rollout.hpp"
#include "weight_reshard.hpp"

namespace rlh::grpo {

class GenerationRanks {
 public:
  // Splits the launch's world (collective over every rank). `generator_ranks`: the resources'
  // gpus_per_node x num_nodes; `resources_text` names them in errors; `tensor_parallel_size`:
  // generator ranks per generator (policy.generation.vllm_cfg.tensor_parallel_size).
  static std::unique_ptr<GenerationRanks> create(const sdk::Host& host, int64_t generator_ranks,
                                                 const std::string& resources_text, int64_t tensor_parallel_size = 1);
  ~GenerationRanks();
  GenerationRanks(const GenerationRanks&) = delete;
  GenerationRanks& operator=(const GenerationRanks&) = delete;

  bool is_generator() const { return generator_; }
  int trainers() const { return trainers_; }
  // The host this rank's components see: the host's services with the trainers' group (on a
  // generator rank: the generator ranks' group) as its world communicator.
  const sdk::Host& trainer_host() const { return trainer_host_; }

  // A trainer's layout from the backend (`ranks` after follow_backend): which trainer ranks send
  // to which generator rank. Collective over the trainer ranks; refuses a layout the generator
  // ranks do not fit (the same line on every trainer rank).
  void attach(const sdk::Host& host, const LoopRanks& ranks);
  // How many parts a model-parallel group's generate calls split into (its clients).
  int parts_per_group() const { return parts_; }
  // This trainer rank sends requests to a generator rank of its own.
  bool is_client() const;

  // A trainer's generator: a link to its generator ranks (a non-client trainer only refits).
  std::unique_ptr<Generator> remote_generator(const std::string& name);
  // Asynchronous GRPO: sends `requests` ahead (in the order the loop will make them; a client's
  // parts, none elsewhere).
  void announce(const std::vector<const rlh_generate_args*>& requests);
  // The last refit's bytes (trainer rank 0; 0 elsewhere): what one generator rank received (the
  // most any did), and what all of them did together. The broadcast sends every generator rank
  // the whole weights; the resharding refit each rank its pieces.
  double last_refit_bytes() const;
  double last_refit_bytes_total() const;
  // rlhost.refit_reshard: false keeps the gathered broadcast even where the backend has
  // visit_weight_pieces (every trainer rank calls it alike, before the first refit).
  void set_reshard(bool on);
  double last_refit_seconds() const;
  // A trainer's end: a client tells its generator ranks to stop, cleanly or after a failure (best effort).
  void finish();
  void abandon() noexcept;

  // A generator rank's life: serves its clients' requests with `gen` until told to stop.
  // Returns when the trainer finished; throws when it failed or went silent. `needs`: this
  // rank's part of the weights (its tensor-parallel boxes), asked once, at the first resharding refit.
  void serve(Generator& gen, const std::function<Needs()>& needs);

  struct Impl;

 private:
  GenerationRanks() = default;
  std::unique_ptr<Impl> impl_;
  bool generator_ = false;
  int trainers_ = 0;
  int parts_ = 1;
  sdk::Host trainer_host_;
};

}  // namespace rlh::grpo
