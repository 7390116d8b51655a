// Non-colocated generation and asynchronous GRPO's rollouts sent ahead (see generation_ranks.hpp).
#include "generation_ranks.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <optional>

#include <nlohmann/json.hpp>

#include "group_generation.hpp"
#include "loop_ranks.hpp"
#include "rlhost/sdk/status.hpp"
#include "weight_reshard.hpp"

namespace rlh::grpo {

using json = nlohmann::json;
using sdk::Error;

namespace {

// What a trainer sends its generator rank (the first word of a header).
// kLayout (trainer rank 0, once): the trainer ranks of the generator rank's clients.
// kFetch: the client waits for its oldest request's samples (the generator rank sends samples only
// to a client that waits for them, so a reply never blocks it while another client waits).
// kRefitPieces: a resharding refit (weight_reshard.hpp) of the version its 8 bytes hold.
enum Command : int64_t {
  kGenerate = 1, kRefit = 2, kStopDone = 3, kStopFailed = 4, kLayout = 5, kFetch = 6, kRefitPieces = 7
};

double since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// ---- the host a trainer's components see -------------------------------------------------------

// A copy of the host's service table whose world communicator is the trainers' group; every other
// slot forwards to the host's (its ctx names this object, the first member).
struct TrainerHostApi {
  rlh_host_api api{};
  const rlh_host_api* inner = nullptr;
  const rlh_comm_api* comm_api = nullptr;
  rlh_comm* comm = nullptr;
};

TrainerHostApi* of(rlh_host_ctx* c) { return reinterpret_cast<TrainerHostApi*>(c); }

void th_log(rlh_host_ctx* c, int32_t level, const char* msg, size_t len) {
  of(c)->inner->log(of(c)->inner->ctx, level, msg, len);
}
rlh_status* th_alloc(rlh_host_ctx* c, rlh_device d, size_t bytes, size_t alignment, void** out) {
  return of(c)->inner->alloc(of(c)->inner->ctx, d, bytes, alignment, out);
}
void th_free(rlh_host_ctx* c, rlh_device d, void* p) { of(c)->inner->free_memory(of(c)->inner->ctx, d, p); }
rlh_status* th_config_get(rlh_host_ctx* c, const char* path, rlh_write_fn write, void* user) {
  return of(c)->inner->config_get(of(c)->inner->ctx, path, write, user);
}
void th_metric(rlh_host_ctx* c, const char* name, double value, int64_t step) {
  of(c)->inner->metric(of(c)->inner->ctx, name, value, step);
}
rlh_status* th_find(rlh_host_ctx* c, int32_t kind, const char* name, const rlh_component_desc** out) {
  return of(c)->inner->find_component(of(c)->inner->ctx, kind, name, out);
}
rlh_status* th_get_comm(rlh_host_ctx* c, const rlh_comm_api** api, rlh_comm** comm) {
  *api = of(c)->comm_api;
  *comm = of(c)->comm;
  return nullptr;
}
uint8_t th_cancelled(rlh_host_ctx* c) { return of(c)->inner->is_cancelled(of(c)->inner->ctx); }
rlh_status* th_list(rlh_host_ctx* c, int32_t kind, rlh_write_fn write, void* user) {
  return of(c)->inner->list_components(of(c)->inner->ctx, kind, write, user);
}

void make_trainer_api(TrainerHostApi& t, const rlh_host_api* inner, const sdk::Comm& trainers) {
  t.inner = inner;
  t.comm_api = trainers.api();
  t.comm = trainers.get();
  t.api = *inner;  // struct_size, ABI version, make_status (no ctx)
  t.api.ctx = reinterpret_cast<rlh_host_ctx*>(&t);
  if (inner->log) t.api.log = th_log;
  if (inner->alloc) t.api.alloc = th_alloc;
  if (inner->free_memory) t.api.free_memory = th_free;
  if (inner->config_get) t.api.config_get = th_config_get;
  if (inner->metric) t.api.metric = th_metric;
  if (inner->find_component) t.api.find_component = th_find;
  t.api.get_comm = th_get_comm;
  if (inner->is_cancelled) t.api.is_cancelled = th_cancelled;
  if (RLH_HAS_FIELD(inner, rlh_host_api, list_components) && inner->list_components) t.api.list_components = th_list;
}

// ---- messages --------------------------------------------------------------------------------

template <typename T>
rlh_tensor view(T* p, const int64_t& n) {
  return sdk::host_tensor(p, sdk::dtype_of<T>(), std::span<const int64_t>(&n, 1));
}

// A header (command or status, byte count, weight version) and its bytes, to `peer` of the link.
// The version of a generate request is the client's last refit's: a generator rank serves it with
// those weights (several clients' requests and refits reach it in no fixed order).
constexpr int64_t kHeaderWords = 3;

void send_message(const sdk::Comm& c, int peer, int64_t word, const std::vector<uint8_t>& bytes, int64_t version = -1) {
  int64_t header[kHeaderWords] = {word, static_cast<int64_t>(bytes.size()), version};
  c.send(view(header, kHeaderWords), peer);
  const int64_t n = header[1];
  if (n > 0) c.send(view(const_cast<uint8_t*>(bytes.data()), n), peer);
}

// A message from `peer`, or (peer < 0) from whichever rank sends first (COMM 0.2's recv_any); its
// bytes follow from the same rank. Returns the first word; *from and *version when asked.
int64_t receive_message(const sdk::Comm& c, int peer, std::vector<uint8_t>& bytes, int* from = nullptr,
                        int64_t* version = nullptr) {
  int64_t header[kHeaderWords] = {0, 0, -1};
  if (peer >= 0) c.recv(view(header, kHeaderWords), peer);
  else peer = c.recv_any(view(header, kHeaderWords));
  if (header[1] < 0 || header[1] > (int64_t{1} << 40))
    throw Error(RLH_E_DATA_LOSS, "generation ranks: a message of " + std::to_string(header[1]) + " bytes from rank " +
                                     std::to_string(peer));
  bytes.resize(static_cast<size_t>(header[1]));
  const int64_t n = header[1];
  if (n > 0) c.recv(view(bytes.data(), n), peer);
  if (from != nullptr) *from = peer;
  if (version != nullptr) *version = header[2];
  return header[0];
}

// A generate request as bytes (CBOR): what the generator rank needs to make the same call.
std::vector<uint8_t> encode_request(const rlh_generate_args& a) {
  const rlh_sampling& s = *a.sampling;
  json j;
  j["ids"] = std::vector<int32_t>(a.prompt_ids, a.prompt_ids + a.prompt_offsets[a.num_prompts]);
  j["offsets"] = std::vector<int64_t>(a.prompt_offsets, a.prompt_offsets + a.num_prompts + 1);
  j["samples"] = a.samples_per_prompt;
  j["first"] = a.first_prompt_index;
  j["temperature"] = s.temperature;
  j["top_k"] = s.top_k;
  j["top_p"] = s.top_p;
  j["min_p"] = s.min_p;
  j["max_new_tokens"] = s.max_new_tokens;
  j["seed"] = s.seed;
  j["step"] = s.step;
  j["stop_ids"] = std::vector<int32_t>(s.stop_token_ids, s.stop_token_ids + s.num_stop_token_ids);
  std::vector<std::string> stops;
  for (size_t i = 0; i < s.num_stop_strings; ++i) stops.emplace_back(s.stop_strings[i]);
  j["stop_strings"] = stops;
  return json::to_cbor(j);
}

// The samples of one request (CBOR), in the order the generator delivered them.
struct SampleSink {
  json prompt = json::array(), sample = json::array(), ids = json::array(), logprobs = json::array(),
       truncated = json::array(), version = json::array();
};

rlh_status* sink_sample(void* user, const rlh_sample* s) {
  auto* k = static_cast<SampleSink*>(user);
  k->prompt.push_back(s->prompt_index);
  k->sample.push_back(s->sample_index);
  k->ids.push_back(std::vector<int32_t>(s->ids, s->ids + s->num_tokens));
  k->logprobs.push_back(std::vector<float>(s->logprobs, s->logprobs + s->num_tokens));
  k->truncated.push_back(s->truncated != 0);
  k->version.push_back(s->weight_version);
  return nullptr;
}

// Hands the samples of `bytes` to the loop's callback as the generator would.
// `offset`: the part's first prompt within the call it was cut from.
void deliver(const std::vector<uint8_t>& bytes, rlh_sample_fn fn, void* user, int peer_rank, int64_t offset) {
  json j;
  try {
    j = json::from_cbor(bytes);
  } catch (const json::exception& e) {
    throw Error(RLH_E_DATA_LOSS, "generator rank " + std::to_string(peer_rank) + ": unreadable samples: " + e.what());
  }
  const size_t n = j.at("prompt").size();
  for (size_t i = 0; i < n; ++i) {
    const std::vector<int32_t> ids = j["ids"][i].get<std::vector<int32_t>>();
    const std::vector<float> lp = j["logprobs"][i].get<std::vector<float>>();
    if (ids.size() != lp.size())
      throw Error(RLH_E_DATA_LOSS, "generator rank " + std::to_string(peer_rank) + ": a sample's tokens and logprobs differ in length");
    rlh_sample s{};
    s.struct_size = RLH_STRUCT_SIZE(rlh_sample, weight_version);
    s.prompt_index = j["prompt"][i].get<int64_t>() + offset;
    s.sample_index = j["sample"][i].get<int64_t>();
    s.ids = ids.data();
    s.logprobs = lp.data();
    s.num_tokens = static_cast<int64_t>(ids.size());
    s.truncated = j["truncated"][i].get<bool>() ? 1 : 0;
    s.weight_version = j["version"][i].get<int64_t>();
    sdk::check(fn(user, &s), "generator rank " + std::to_string(peer_rank));
  }
}

// The group's rank 0's message (command and bytes) on every rank of `c`; returns the command.
int64_t share_message(const sdk::Comm& c, int64_t cmd, std::vector<uint8_t>& bytes) {
  int64_t header[2] = {cmd, static_cast<int64_t>(bytes.size())};
  const int64_t two = 2;
  c.broadcast(view(header, two), 0);
  bytes.resize(static_cast<size_t>(header[1]));
  const int64_t n = header[1];
  if (n > 0) c.broadcast(view(bytes.data(), n), 0);
  return header[0];
}

std::string dtype_text(const rlh_dtype& d) {
  return std::to_string(d.code) + "," + std::to_string(d.bits) + "," + std::to_string(d.lanes);
}

// Broadcasts the weights' bytes from rank 0 of `c` into every rank's buffers, packed into
// pieces of at most kPiece bytes: one collective per piece rather than per weight (each costs a
// round of the group), and counts that fit MPI's int.
void broadcast_weights(const sdk::Comm& c, std::vector<Generator::StagedWeight>& ws) {
  constexpr size_t kPiece = size_t{1} << 30;
  const bool root = c.rank() == 0;
  std::vector<uint8_t> buf;
  size_t i = 0;
  while (i < ws.size()) {
    const size_t n = ws[i].num_bytes();
    if (n >= kPiece) {  // alone, in pieces, straight from (into) its own buffer
      auto* p = reinterpret_cast<uint8_t*>(ws[i].bytes.get());
      for (size_t off = 0; off < n; off += kPiece) {
        const int64_t m = static_cast<int64_t>(std::min(kPiece, n - off));
        c.broadcast(view(p + off, m), 0);
      }
      ++i;
      continue;
    }
    size_t j = i, total = 0;
    while (j < ws.size() && ws[j].num_bytes() < kPiece && total + ws[j].num_bytes() <= kPiece) total += ws[j++].num_bytes();
    buf.resize(total);
    size_t off = 0;
    if (root)
      for (size_t k = i; k < j; off += ws[k].num_bytes(), ++k) std::memcpy(buf.data() + off, ws[k].bytes.get(), ws[k].num_bytes());
    const int64_t m = static_cast<int64_t>(total);
    if (m > 0) c.broadcast(view(buf.data(), m), 0);
    off = 0;
    if (!root)
      for (size_t k = i; k < j; off += ws[k].num_bytes(), ++k) std::memcpy(ws[k].bytes.get(), buf.data() + off, ws[k].num_bytes());
    i = j;
  }
}

// A message of `n` bytes whose size both sides know, point to point, in pieces that fit MPI's int.
constexpr size_t kChunk = size_t{1} << 30;
void send_bytes(const sdk::Comm& c, int peer, const char* p, size_t n) {
  for (size_t off = 0; off < n; off += kChunk) {
    const int64_t m = static_cast<int64_t>(std::min(kChunk, n - off));
    c.send(view(reinterpret_cast<uint8_t*>(const_cast<char*>(p + off)), m), peer);
  }
}
void recv_bytes(const sdk::Comm& c, int peer, char* p, size_t n) {
  for (size_t off = 0; off < n; off += kChunk) {
    const int64_t m = static_cast<int64_t>(std::min(kChunk, n - off));
    c.recv(view(reinterpret_cast<uint8_t*>(p + off), m), peer);
  }
}

}  // namespace

// ---- the link's state --------------------------------------------------------------------------

struct GenerationRanks::Impl {
  sdk::Host host;
  sdk::Comm world;     // the host's (borrowed)
  sdk::Comm trainers;  // the trainer ranks (generator ranks: the generator ranks)
  sdk::Comm link;      // every rank, in world order: clients and generator ranks, point to point
  sdk::Comm refit;     // trainer 0 and every generator rank (rank 0: trainer 0); others: unused
  // The resharding refit's needs and pieces: every rank in world order, like the link, but a
  // communicator of its own, so no piece can ever match a shared generator rank's recv_any on the
  // link (which takes whatever a trainer sent it next). Split from the world at the first
  // resharding refit, by every rank there (trainers in make_plan, generator ranks in take_plan).
  sdk::Comm pieces;
  // Tensor-parallel generators (tp > 1): a generator rank's group of tp consecutive generator
  // ranks, one generator; its first rank (the "leader") hears from the client and shares.
  sdk::Comm share;
  TrainerHostApi trainer_api;
  int world_rank = 0, num_trainers = 0, num_generators = 0;
  int tp = 1;  // generator ranks per generator (policy.generation.vllm_cfg.tensor_parallel_size)
  // World rank of the leader of generator c (c in [0, num_generators / tp)).
  int leader(int c) const { return num_trainers + c * tp; }
  int num_units() const { return num_generators / tp; }
  std::string resources_text;  // names the generator ranks in errors
  // A client's generator ranks (world ranks, in the order its calls' parts go to them; empty: not
  // a client), a generator rank's clients (trainer ranks; several when data-parallel groups share it).
  std::vector<int> peers;
  std::vector<int> clients;
  int64_t version = -1;  // a trainer's last refit's weight version (its requests name it)
  bool attached = false;  // trainer rank 0 told the generator ranks their clients
  bool in_refit = false;  // this rank is in the refit group
  bool stopped = false;
  double refit_bytes = 0, refit_seconds = 0, refit_bytes_total = 0;
  // The resharding refit (rlhost.refit_reshard, on by default; used when the backend has
  // visit_weight_pieces): its plan, made at the first such refit on every trainer and generator rank.
  bool reshard = true;
  std::unique_ptr<ReshardPlan> plan;

  // Trainer side of the plan (collective over the trainer ranks; trainer 0 also hears every
  // generator rank's needs and hands the table to them): see weight_reshard.hpp.
  void make_plan(const OwnPieces& own) {
    pieces = world.split(0, world_rank, "refit pieces");
    const std::string mine = to_json(own.boxes).dump();
    std::string text;
    if (world_rank == 0) {
      json table = {{"pieces", json::array({json::parse(mine)})}, {"needs", json::array()}};
      std::vector<uint8_t> bytes;
      for (int t = 1; t < num_trainers; ++t) {
        receive_message(trainers, t, bytes);
        table["pieces"].push_back(json::parse(bytes.begin(), bytes.end()));
      }
      for (int g = 0; g < num_generators; ++g) {
        const int64_t cmd = receive_message(pieces, num_trainers + g, bytes);
        if (cmd != kRefitPieces)
          throw Error(RLH_E_DATA_LOSS, "refit: generator rank " + std::to_string(num_trainers + g) + " sent message " +
                                           std::to_string(cmd) + " instead of its needs");
        table["needs"].push_back(json::parse(bytes.begin(), bytes.end()));
      }
      text = table.dump();
    } else {
      send_message(trainers, 0, kRefitPieces, std::vector<uint8_t>(mine.begin(), mine.end()));
    }
    text = broadcast_text(trainers, text);
    if (world_rank == 0) broadcast_text(refit, text);
    plan = std::make_unique<ReshardPlan>(json::parse(text));
  }

  // Generator rank's side: its needs to trainer 0, the table back.
  void take_plan(const Needs& needs) {
    pieces = world.split(0, world_rank, "refit pieces");
    const std::string text = to_json(needs).dump();
    send_message(pieces, 0, kRefitPieces, std::vector<uint8_t>(text.begin(), text.end()));
    plan = std::make_unique<ReshardPlan>(json::parse(broadcast_text(refit, std::string())));
  }

  // One call's part on one generator rank: sent, and its samples once received.
  struct Part {
    int peer = -1;
    int64_t offset = 0;  // its first prompt within the call
    std::vector<uint8_t> result;
    bool received = false;
  };
  // Requests sent ahead, oldest first (the whole call's bytes, to match the call that takes them).
  struct Pending {
    std::vector<uint8_t> request;
    std::vector<Part> parts;
  };
  std::deque<Pending> pending;

  std::vector<uint8_t> receive_result(int peer) {
    std::vector<uint8_t> bytes;
    send_message(link, peer, kFetch, {});  // this rank now waits for the samples
    const int64_t status = receive_message(link, peer, bytes);
    if (status != 0)
      throw Error(static_cast<rlh_code>(status),
                  "generator rank " + std::to_string(peer) + ": " + std::string(bytes.begin(), bytes.end()));
    return bytes;
  }

  // Sends a call to this client's generator ranks: contiguous parts of its prompts, one per rank
  // (under their indices in the call, so the samples are those one generator draws); the first
  // rank gets the call even when it has no prompts.
  std::vector<Part> send_parts(const rlh_generate_args& args) {
    if (peers.empty())
      throw Error(RLH_E_INTERNAL, "trainer rank " + std::to_string(world_rank) +
                                      " generates, but has no generator rank (not the first rank of a generation part)");
    const int n = static_cast<int>(peers.size());
    std::vector<Part> parts;
    for (int i = 0; i < n; ++i) {
      rlh_generate_args piece = args;
      std::vector<int64_t> offsets;
      const GroupPart p = part_of_call(args, n, i, n, &piece, &offsets);
      if (p.end == p.begin && i > 0) continue;
      send_message(link, peers[size_t(i)], kGenerate, encode_request(piece), version);
      Part part;
      part.peer = peers[size_t(i)];
      part.offset = p.end > p.begin ? p.begin : 0;
      parts.push_back(std::move(part));
    }
    return parts;
  }

  void receive_parts(std::vector<Part>& parts) {
    for (Part& p : parts)
      if (!p.received) {
        p.result = receive_result(p.peer);
        p.received = true;
      }
  }

  // Receives every outstanding result (kept for the calls they were sent for).
  void drain() {
    for (Pending& p : pending) receive_parts(p.parts);
  }
};

namespace {

// A generator rank's (leader's) view of its clients: their messages not yet acted on, each
// client's in its order, and the next thing to do. Across clients it does whatever can be done
// now: serve a request (its samples kept until the client fetches them), answer a fetch, note a
// stop. A refit waits until every client still running has asked for it: a client asks after its
// last request for the old weights (its messages keep their order), so those are served first and
// none for the new weights before. Only when nothing can be done does it wait for a message, from
// whichever client sends first (the link's recv_any; its own recv with one client). Samples go
// only to a client that fetches them, so a reply never blocks this rank while a client trains and
// another one waits.
class ClientQueues {
 public:
  struct Action {
    int64_t cmd = 0;  // kGenerate, kRefit, kStopDone or kStopFailed
    std::vector<uint8_t> bytes;
    int client = -1;  // kGenerate: whose request (an index into clients)
  };

  explicit ClientQueues(GenerationRanks::Impl& r) : r_(r) {}

  // The weight version now installed: a request naming another one is answered with an error.
  int64_t installed = -1;

  Action next() {
    for (;;) {
      if (!r_.attached) {
        // Trainer rank 0 names this rank's clients once the trainers' layout is known (attach).
        Message m = receive(0);
        if (m.cmd == kLayout) {
          name_clients(m.bytes);
          continue;
        }
        if (m.cmd == kStopDone || m.cmd == kStopFailed) return Action{m.cmd, std::move(m.bytes), -1};
        throw Error(RLH_E_DATA_LOSS, who() + ": message " + std::to_string(m.cmd) +
                                         " from trainer rank 0 before it named this rank's clients");
      }
      if (std::optional<Action> a = act()) return std::move(*a);
      bool all_done = true, all_refit = true;
      int64_t refit = 0;  // kRefit or kRefitPieces: every running client asks the same way
      for (const Client& c : clients_) {
        if (c.done) continue;
        all_done = false;
        const int64_t front = c.queue.empty() ? 0 : c.queue.front().cmd;
        if (front != kRefit && front != kRefitPieces) all_refit = false;
        else if (refit != 0 && front != refit)
          throw Error(RLH_E_DATA_LOSS, who() + ": its clients asked for a broadcast and a resharding refit at once");
        else refit = front;
      }
      if (all_done) return Action{kStopDone, {}, -1};
      if (all_refit) {
        std::vector<uint8_t> bytes;  // a resharding refit's version (the same from every client)
        for (Client& c : clients_)
          if (!c.done) {
            bytes = std::move(c.queue.front().bytes);
            c.queue.pop_front();
          }
        return Action{refit, std::move(bytes), -1};
      }
      int from = -1;
      Message m = receive(clients_.size() == 1 ? r_.clients[0] : -1, &from);
      const auto it = std::find(r_.clients.begin(), r_.clients.end(), from);
      if (it == r_.clients.end())
        throw Error(RLH_E_DATA_LOSS, who() + ": message " + std::to_string(m.cmd) + " from rank " + std::to_string(from) +
                                         ", which is not one of its clients");
      Client& c = clients_[static_cast<size_t>(it - r_.clients.begin())];
      if (c.done)
        throw Error(RLH_E_DATA_LOSS, who() + ": message " + std::to_string(m.cmd) + " from trainer rank " + std::to_string(from) +
                                         " after it stopped");
      c.queue.push_back(std::move(m));
    }
  }

  // The samples of a request `next` returned (status 0), or its failure, kept for the fetch.
  void reply(int client, int64_t status, std::vector<uint8_t> bytes) {
    clients_[static_cast<size_t>(client)].replies.push_back(Message{status, -1, std::move(bytes)});
  }

 private:
  struct Message {
    int64_t cmd = 0, version = -1;
    std::vector<uint8_t> bytes;
  };
  struct Client {
    std::deque<Message> queue;    // received, not yet acted on
    std::deque<Message> replies;  // served, not yet fetched (status, bytes)
    bool done = false;
  };

  std::string who() const { return "generator rank " + std::to_string(r_.world_rank); }

  Message receive(int peer, int* from = nullptr) {
    Message m;
    m.cmd = receive_message(r_.link, peer, m.bytes, from, &m.version);
    return m;
  }

  void name_clients(const std::vector<uint8_t>& bytes) {
    std::vector<int64_t> named(bytes.size() / sizeof(int64_t));
    if (named.empty() || bytes.size() != named.size() * sizeof(int64_t))
      throw Error(RLH_E_DATA_LOSS, who() + ": trainer rank 0 named its clients in " + std::to_string(bytes.size()) + " bytes");
    std::memcpy(named.data(), bytes.data(), bytes.size());
    for (int64_t t : named) {
      if (t < 0 || t >= r_.num_trainers)
        throw Error(RLH_E_DATA_LOSS, who() + ": trainer rank 0 named client " + std::to_string(t) + " of " +
                                         std::to_string(r_.num_trainers) + " trainer ranks");
      r_.clients.push_back(static_cast<int>(t));
    }
    clients_.assign(r_.clients.size(), Client{});
    r_.attached = true;
  }

  // Acts on the clients' first messages until one is a request to serve (returned) or none can be
  // acted on alone; clients waiting for samples (a fetch queued) first.
  std::optional<Action> act() {
    for (bool progressed = true; progressed;) {
      progressed = false;
      std::vector<size_t> order;
      for (int pass = 0; pass < 2; ++pass)
        for (size_t i = 0; i < clients_.size(); ++i) {
          const auto& q = clients_[i].queue;
          const bool waiting = std::any_of(q.begin(), q.end(), [](const Message& m) { return m.cmd == kFetch; });
          if (!q.empty() && waiting == (pass == 0)) order.push_back(i);
        }
      for (size_t i : order) {
        Client& c = clients_[i];
        Message& m = c.queue.front();
        if (m.cmd == kRefit || m.cmd == kRefitPieces) continue;  // waits for the others (next)
        if (m.cmd == kStopFailed) return Action{kStopFailed, std::move(m.bytes), static_cast<int>(i)};
        if (m.cmd == kGenerate && m.version != installed) {
          const std::string e = "a request for the weights of version " + std::to_string(m.version) + " reached " + who() +
                                ", which holds version " + std::to_string(installed);
          reply(static_cast<int>(i), RLH_E_INTERNAL, std::vector<uint8_t>(e.begin(), e.end()));
          c.queue.pop_front();
          progressed = true;
          break;
        }
        if (m.cmd == kGenerate) {
          Action a{kGenerate, std::move(m.bytes), static_cast<int>(i)};
          c.queue.pop_front();
          return a;
        }
        if (m.cmd == kFetch) {
          if (c.replies.empty())
            throw Error(RLH_E_DATA_LOSS, who() + ": trainer rank " + std::to_string(r_.clients[i]) +
                                             " fetched samples of no request");
          send_message(r_.link, r_.clients[i], c.replies.front().cmd, c.replies.front().bytes);
          c.replies.pop_front();
        } else if (m.cmd == kStopDone) {
          c.done = true;
        } else {
          throw Error(RLH_E_DATA_LOSS, who() + ": unknown message " + std::to_string(m.cmd) + " from trainer rank " +
                                           std::to_string(r_.clients[i]));
        }
        c.queue.pop_front();
        progressed = true;
        break;
      }
    }
    return std::nullopt;
  }

  GenerationRanks::Impl& r_;
  std::vector<Client> clients_;
};

}  // namespace

class RemoteLink : public GeneratorLink {
 public:
  explicit RemoteLink(GenerationRanks::Impl& r) : r_(r) {}

  void generate(const rlh_generate_args& args, rlh_sample_fn fn, void* user) override {
    std::vector<uint8_t> req = encode_request(args);
    std::vector<GenerationRanks::Impl::Part> parts;
    if (!r_.pending.empty() && r_.pending.front().request == req) {
      parts = std::move(r_.pending.front().parts);
      r_.pending.pop_front();
    } else {
      r_.drain();  // results sent ahead come first on the link
      parts = r_.send_parts(args);
    }
    r_.receive_parts(parts);
    for (const auto& p : parts) deliver(p.result, fn, user, p.peer, p.offset);
  }

  int64_t refit_from(Backend& backend, rlh_model* model) override {
    if (r_.reshard && backend.has_weight_pieces()) return refit_pieces(backend, model);
    r_.drain();
    // A client's generator ranks join trainer 0's broadcast below.
    for (int peer : r_.peers) send_message(r_.link, peer, kRefit, {});
    int64_t version = -1;
    if (!r_.in_refit) {
      // Trainer ranks other than 0 take part in the visit (collective under FSDP and model
      // parallelism: their pieces go into each whole weight) and keep nothing.
      r_.version = backend.visit_weights(model, [](void*, const char*, const rlh_tensor*) -> rlh_status* { return nullptr; },
                                         nullptr);
      return r_.version;
    }
    std::vector<Generator::StagedWeight> staged = Generator::stage_on_host(backend, model, &version);
    const auto t0 = std::chrono::steady_clock::now();
    // Trainer 0: the names, dtypes and shapes, then each weight, to every generator rank.
    json meta = {{"version", version}, {"weights", json::array()}};
    double bytes = 0;
    for (const auto& w : staged) {
      meta["weights"].push_back({{"name", w.name}, {"dtype", dtype_text(w.dtype)}, {"shape", w.shape}});
      bytes += static_cast<double>(w.num_bytes());
    }
    broadcast_text(r_.refit, meta.dump());
    broadcast_weights(r_.refit, staged);
    r_.refit_bytes = r_.refit_bytes_total = bytes;
    r_.refit_seconds = since(t0);
    r_.version = version;
    return version;
  }

  // Every trainer rank's own pieces straight to the generator ranks that need them.
  int64_t refit_pieces(Backend& backend, rlh_model* model) {
    r_.drain();
    const OwnPieces own = collect_pieces(backend, model);  // collective where the backend gathers (FSDP)
    std::vector<uint8_t> v(sizeof own.version);
    std::memcpy(v.data(), &own.version, sizeof own.version);
    for (int peer : r_.peers) send_message(r_.link, peer, kRefitPieces, v);
    const auto t0 = std::chrono::steady_clock::now();
    const bool first = !r_.plan;
    if (first) r_.make_plan(own);
    const ReshardPlan& plan = *r_.plan;
    const int t = r_.world_rank;
    // In generator order: a generator rank receives in trainer order, so no pair waits on a cycle.
    int64_t sent = 0;
    int to = 0;
    for (int g = 0; g < plan.generators(); ++g) {
      if (plan.bytes(t, g) == 0) continue;
      const std::vector<char> bytes = plan.pack(t, g, own);
      send_bytes(r_.pieces, r_.num_trainers + g, bytes.data(), bytes.size());
      sent += static_cast<int64_t>(bytes.size());
      ++to;
    }
    // What this rank holds and sends (an FSDP rank: its own shard, for every generator rank that
    // needs it), once: the tests check no rank sends more than it holds.
    if (first) {
      int64_t held = 0;
      for (const std::vector<char>& d : own.data) held += static_cast<int64_t>(d.size());
      r_.host.info("refit: trainer rank " + std::to_string(t) + " sends its " + std::to_string(own.boxes.size()) +
                   " weight pieces (" + std::to_string(held) + " bytes) as " + std::to_string(sent) + " bytes to " +
                   std::to_string(to) + " generator rank" + (to == 1 ? "" : "s") + " point to point");
    }
    // Bytes the generator rank that receives most takes in, and all of them together.
    double most = 0, total = 0;
    for (int g = 0; g < plan.generators(); ++g) {
      double in = 0;
      for (int s = 0; s < plan.trainers(); ++s) in += static_cast<double>(plan.bytes(s, g));
      most = std::max(most, in);
      total += in;
    }
    r_.refit_bytes = most;
    r_.refit_bytes_total = total;
    r_.refit_seconds = since(t0);
    r_.version = own.version;
    return own.version;
  }

 private:
  GenerationRanks::Impl& r_;
};

std::unique_ptr<GenerationRanks> GenerationRanks::create(const sdk::Host& host, int64_t generator_ranks,
                                                         const std::string& resources_text, int64_t tensor_parallel_size) {
  std::unique_ptr<GenerationRanks> g(new GenerationRanks());
  g->impl_ = std::make_unique<Impl>();
  Impl& r = *g->impl_;
  r.host = host;
  r.world = sdk::Comm::world(host);
  const int W = r.world.size();
  const std::string sizes = resources_text + " = " + std::to_string(generator_ranks) + " generator ranks, but " +
                            std::to_string(W) + " ranks were launched";
  if (generator_ranks >= W)
    throw Error(RLH_E_INVALID_ARGUMENT, sizes + ": at least one rank must train (the last " +
                                            std::to_string(generator_ranks) + " generate)");
  const int T = W - static_cast<int>(generator_ranks);
  const int64_t tp = tensor_parallel_size;
  if (tp < 1 || generator_ranks % tp != 0)
    throw Error(RLH_E_INVALID_ARGUMENT, "policy.generation.vllm_cfg.tensor_parallel_size = " + std::to_string(tp) +
                                            " does not divide the " + std::to_string(generator_ranks) + " generator ranks (" +
                                            resources_text + ")");
  // Every data-parallel group gets the same number of generators, fed by a run of its ranks or
  // feeding each rank several (attach): whatever the layout, one count divides the other.
  const int64_t units = generator_ranks / tp;
  if (T % units != 0 && units % T != 0)
    throw Error(RLH_E_INVALID_ARGUMENT,
                sizes + ": the " + std::to_string(T) + " trainer ranks and the " +
                    (tp > 1 ? std::to_string(units) + " tensor-parallel generators (" + std::to_string(tp) + " ranks each)"
                            : std::to_string(generator_ranks) + " generator ranks") +
                    " must divide one another (launch " + std::to_string(T + T * tp) +
                    " ranks for one generator per trainer rank)");
  g->trainers_ = T;
  r.num_trainers = T;
  r.num_generators = static_cast<int>(generator_ranks);
  r.tp = static_cast<int>(tp);
  r.resources_text = resources_text;
  r.world_rank = r.world.rank();
  g->generator_ = r.world_rank >= T;
  // Collective over the world, in this order on every rank.
  r.trainers = r.world.split(g->generator_ ? 1 : 0, r.world_rank, g->generator_ ? "generator ranks" : "trainer ranks");
  r.link = r.world.split(0, r.world_rank, "generation link");
  r.in_refit = g->generator_ || r.world_rank == 0;
  r.refit = r.world.split(r.in_refit ? 0 : 1, r.world_rank, "refit");
  // Either side's components see its own group as the world: the trainers' backend, the generator
  // ranks' generator (which splits its tensor-parallel groups from it).
  make_trainer_api(r.trainer_api, host.api(), r.trainers);
  g->trainer_host_ = sdk::Host(&r.trainer_api.api);
  if (g->generator_ && r.tp > 1) {
    const int i = r.world_rank - T;  // collective over the generator ranks
    r.share = r.trainers.split(i / r.tp, i, "tensor-parallel generator " + std::to_string(i / r.tp));
  }
  return g;
}

GenerationRanks::~GenerationRanks() = default;

bool GenerationRanks::is_client() const { return !generator_ && !impl_->peers.empty(); }

void GenerationRanks::attach(const sdk::Host& host, const LoopRanks& ranks) {
  Impl& r = *impl_;
  // M: generators (groups of tp generator ranks under tensor parallelism), each served by its leader.
  const int M = r.num_units(), T = r.num_trainers, D = ranks.size, g = ranks.group_size();
  // k = M / D generator ranks per data-parallel group: k dividing g (every g / k ranks of the
  // group share one), or a multiple of g (each rank of the group has k / g of its own). Fewer
  // generators than groups: every D / M groups share one, each fed by its first rank.
  const int k = M % D == 0 ? M / D : 0;
  const int groups_per = k == 0 && D % M == 0 ? D / M : 1;  // data-parallel groups per generator
  const std::string layout = r.resources_text + " = " + std::to_string(M) +
                             (r.tp > 1 ? " tensor-parallel generators" : " generator ranks") + " for " + std::to_string(T) +
                             " trainer ranks in " + std::to_string(D) + " data-parallel group" + (D == 1 ? "" : "s") + " of " +
                             std::to_string(g) + " rank" + (g == 1 ? "" : "s");
  if (groups_per == 1 && (k == 0 || (g % k != 0 && k % g != 0))) {
    std::string fits;
    for (int j = 1; j < D; ++j)
      if (D % j == 0) fits += std::to_string(j) + ", ";
    for (int j = 1; j < g; ++j)
      if (g % j == 0) fits += std::to_string(D * j) + ", ";
    throw Error(RLH_E_UNIMPLEMENTED,
                layout + ": each group needs the same number of generator ranks, dividing its ranks or a multiple of them, "
                         "or the groups an equal share of one (generator ranks that fit: " + fits + "a multiple of " +
                    std::to_string(T) + ")");
  }
  // Groups sharing a generator rank send whenever their calls come (validation shares, empty
  // shares and multi-turn rounds differ between them): it must receive from whichever asks first.
  if (groups_per > 1 && !r.link.has_recv_any())
    throw Error(RLH_E_UNIMPLEMENTED, layout + ": " + std::to_string(groups_per) +
                                         " data-parallel groups would share each generator rank, which needs a communicator "
                                         "that receives from any rank (COMM 0.2 recv_any); the world communicator's component "
                                         "has none (rlhost.comm; comm_mpi has it)");
  const int share = k == 0 ? g : k <= g ? g / k : 1;  // trainer ranks per client (a group's run of them)
  const int per = k <= g ? 1 : k / g;                 // generator ranks per client
  parts_ = k == 0 ? 1 : k <= g ? k : g;
  const int place = ranks.group ? ranks.group.rank() : 0;
  // This rank's first generator rank (its number among the generator ranks), or -1.
  int64_t first = -1;
  if (place % share == 0)
    first = k == 0 ? int64_t(ranks.rank) / groups_per : int64_t(ranks.rank) * k + int64_t(place / share) * per;
  std::vector<int64_t> all(static_cast<size_t>(T), -1);  // every trainer rank's, in trainer order
  if (T > 1) {
    const int64_t one = 1, n = T;
    r.trainers.all_gather(view(const_cast<int64_t*>(&first), one), view(all.data(), n));
  } else {
    all[0] = first;
  }
  std::vector<std::vector<int64_t>> clients_of(static_cast<size_t>(M));
  for (int t = 0; t < T; ++t)
    for (int64_t c = all[size_t(t)]; c >= 0 && c < all[size_t(t)] + per && c < M; ++c) clients_of[size_t(c)].push_back(t);
  for (int c = 0; c < M; ++c)
    if (clients_of[size_t(c)].empty())
      throw Error(RLH_E_INTERNAL, "non-colocated generation: no trainer rank feeds generator rank " + std::to_string(r.leader(c)));
  if (first >= 0)
    for (int i = 0; i < per; ++i) r.peers.push_back(r.leader(static_cast<int>(first) + i));
  if (r.world_rank == 0) {
    for (int c = 0; c < M; ++c) {
      const std::vector<int64_t>& who = clients_of[size_t(c)];
      std::vector<uint8_t> bytes(who.size() * sizeof(int64_t));
      std::memcpy(bytes.data(), who.data(), bytes.size());
      send_message(r.link, r.leader(c), kLayout, bytes);
    }
    if (M != T)
      host.info("non-colocated generation: " + std::to_string(M) + " generator rank" + (M == 1 ? "" : "s") + " for " +
                std::to_string(D) + " data-parallel group" + (D == 1 ? "" : "s") + " of " + std::to_string(g) +
                " trainer rank" + (g == 1 ? "" : "s") + ": " +
                (groups_per > 1 ? "every " + std::to_string(groups_per) + " groups share one, fed by their first ranks"
                 : share > 1    ? "every " + std::to_string(share) + " ranks of a group share one"
                                : "each trainer rank splits its calls over " + std::to_string(per)));
  }
  r.attached = true;
}

std::unique_ptr<Generator> GenerationRanks::remote_generator(const std::string& name) {
  return std::make_unique<Generator>(name, std::make_unique<RemoteLink>(*impl_));
}

void GenerationRanks::announce(const std::vector<const rlh_generate_args*>& requests) {
  Impl& r = *impl_;
  // Requests of later steps queue behind those already sent (max_trajectory_age_steps > 1); a
  // generate call takes the front one when it matches.
  for (const rlh_generate_args* q : requests) {
    Impl::Pending p;
    p.request = encode_request(*q);
    p.parts = r.send_parts(*q);
    r.pending.push_back(std::move(p));
  }
}

double GenerationRanks::last_refit_bytes() const { return impl_->refit_bytes; }
double GenerationRanks::last_refit_bytes_total() const { return impl_->refit_bytes_total; }
void GenerationRanks::set_reshard(bool on) { impl_->reshard = on; }
double GenerationRanks::last_refit_seconds() const { return impl_->refit_seconds; }

void GenerationRanks::finish() {
  Impl& r = *impl_;
  if (generator_ || r.stopped) return;
  r.drain();
  r.pending.clear();
  r.stopped = true;
  if (r.attached) {
    for (int peer : r.peers) send_message(r.link, peer, kStopDone, {});
  } else if (r.world_rank == 0) {  // the generator ranks still wait for trainer 0's layout
    for (int c = 0; c < r.num_units(); ++c) send_message(r.link, r.leader(c), kStopDone, {});
  }
}

void GenerationRanks::abandon() noexcept {
  Impl& r = *impl_;
  if (generator_ || r.stopped) return;
  r.stopped = true;
  try {
    const std::string why = "its trainer (rank " + std::to_string(r.world_rank) + ") stopped with an error";
    const std::vector<uint8_t> bytes(why.begin(), why.end());
    if (r.attached) {
      for (int peer : r.peers) send_message(r.link, peer, kStopFailed, bytes);
    } else if (r.world_rank == 0) {  // before attach every generator rank waits for trainer 0
      for (int c = 0; c < r.num_units(); ++c) send_message(r.link, r.leader(c), kStopFailed, bytes);
    }
  } catch (...) {
    // The link may be what failed; the generator rank then stops on its timeout.
  }
}

void GenerationRanks::serve(Generator& gen, const std::function<Needs()>& needs) {
  Impl& r = *impl_;
  ClientQueues queues(r);
  // A tensor-parallel generator's leader hears from the clients and shares each action with its
  // group, which acts on it alike (the generator's steps are collective over the group); the
  // leader alone answers the clients.
  const bool leader = !r.share || r.share.rank() == 0;
  for (;;) {
    ClientQueues::Action action;
    if (leader) action = queues.next();
    int64_t cmd = action.cmd;
    std::vector<uint8_t>& bytes = action.bytes;
    if (r.share) cmd = share_message(r.share, cmd, bytes);
    if (cmd == kStopDone) return;
    if (cmd == kStopFailed)
      throw Error(RLH_E_ABORTED, "generator rank " + std::to_string(r.world_rank) + ": " +
                                     std::string(bytes.begin(), bytes.end()));
    if (cmd == kRefit) {
      // Trainer 0's weights, broadcast to every generator rank.
      const json meta = json::parse(broadcast_text(r.refit, std::string()));
      std::vector<Generator::StagedWeight> staged;
      for (const json& m : meta.at("weights")) {
        Generator::StagedWeight w;
        w.name = m.at("name").get<std::string>();
        w.shape = m.at("shape").get<std::vector<int64_t>>();
        const std::string d = m.at("dtype").get<std::string>();
        unsigned code = 0, bits = 0, lanes = 0;
        if (std::sscanf(d.c_str(), "%u,%u,%u", &code, &bits, &lanes) != 3)
          throw Error(RLH_E_DATA_LOSS, "refit: weight '" + w.name + "' has dtype '" + d + "'");
        w.dtype = rlh_dtype{static_cast<uint8_t>(code), static_cast<uint8_t>(bits), static_cast<uint16_t>(lanes)};
        w.bytes.reset(new char[w.num_bytes()]);
        staged.push_back(std::move(w));
      }
      broadcast_weights(r.refit, staged);
      queues.installed = meta.at("version").get<int64_t>();
      gen.install(std::move(staged), queues.installed);
      continue;
    }
    if (cmd == kRefitPieces) {
      // This rank's pieces from every trainer rank that holds some (weight_reshard.hpp).
      int64_t version = -1;
      if (bytes.size() != sizeof version)
        throw Error(RLH_E_DATA_LOSS, "generator rank " + std::to_string(r.world_rank) + ": a refit without its version");
      std::memcpy(&version, bytes.data(), sizeof version);
      const bool first = !r.plan;
      if (first) r.take_plan(needs());
      const ReshardPlan& plan = *r.plan;
      const int g = r.world_rank - r.num_trainers;
      std::vector<Generator::StagedWeight> staged;
      std::vector<char*> bufs;
      for (const WeightBox& n : plan.needs(g)) {
        Generator::StagedWeight w;
        w.name = n.name;
        w.dtype = n.dtype;
        w.shape = n.extent;
        w.bytes.reset(new char[w.num_bytes()]);
        bufs.push_back(w.bytes.get());
        staged.push_back(std::move(w));
      }
      std::vector<int64_t> got(staged.size(), 0);
      std::vector<char> in;
      int64_t received = 0, from = 0;
      for (int t = 0; t < plan.trainers(); ++t) {
        const int64_t n = plan.bytes(t, g);
        if (n == 0) continue;
        in.resize(static_cast<size_t>(n));
        recv_bytes(r.pieces, t, in.data(), in.size());
        plan.unpack(t, g, in, bufs, got);
        received += n;
        ++from;
      }
      for (size_t i = 0; i < staged.size(); ++i)
        if (got[i] * static_cast<int64_t>(plan.needs(g)[i].elem_bytes()) != static_cast<int64_t>(staged[i].num_bytes()))
          throw Error(RLH_E_DATA_LOSS, "generator rank " + std::to_string(r.world_rank) + ": refit: " + staged[i].name +
                                           " arrived incomplete");
      if (first)
        r.host.info("refit: generator rank " + std::to_string(r.world_rank) + " receives its " + std::to_string(staged.size()) +
                    " weight pieces, " + std::to_string(received) + " bytes, from " + std::to_string(from) + " trainer rank" +
                    (from == 1 ? "" : "s") + " point to point");
      queues.installed = version;
      gen.install(std::move(staged), version);
      continue;
    }
    if (cmd != kGenerate)
      throw Error(RLH_E_DATA_LOSS, "generator rank " + std::to_string(r.world_rank) + ": unknown action " + std::to_string(cmd));
    // A failed generation goes back to the trainer as its status; this rank keeps serving (the
    // trainer stops it).
    std::vector<uint8_t> reply;
    int64_t status = 0;
    try {
      const json j = json::from_cbor(bytes);
      const std::vector<int32_t> ids = j.at("ids").get<std::vector<int32_t>>();
      const std::vector<int64_t> offsets = j.at("offsets").get<std::vector<int64_t>>();
      const std::vector<int32_t> stop_ids = j.at("stop_ids").get<std::vector<int32_t>>();
      const std::vector<std::string> stops = j.at("stop_strings").get<std::vector<std::string>>();
      std::vector<const char*> stop_ptrs;
      for (const auto& s : stops) stop_ptrs.push_back(s.c_str());
      rlh_sampling sp{};
      sp.struct_size = RLH_STRUCT_SIZE(rlh_sampling, num_stop_strings);
      sp.temperature = j.at("temperature").get<double>();
      sp.top_k = j.at("top_k").get<int32_t>();
      sp.top_p = j.at("top_p").get<double>();
      sp.min_p = j.at("min_p").get<double>();
      sp.max_new_tokens = j.at("max_new_tokens").get<int64_t>();
      sp.seed = j.at("seed").get<uint64_t>();
      sp.step = j.at("step").get<int64_t>();
      sp.stop_token_ids = stop_ids.data();
      sp.num_stop_token_ids = stop_ids.size();
      sp.stop_strings = stop_ptrs.data();
      sp.num_stop_strings = stop_ptrs.size();
      rlh_generate_args a{};
      a.struct_size = RLH_STRUCT_SIZE(rlh_generate_args, sampling);
      a.prompt_ids = ids.data();
      a.prompt_offsets = offsets.data();
      a.num_prompts = static_cast<int64_t>(offsets.size()) - 1;
      a.samples_per_prompt = j.at("samples").get<int64_t>();
      a.first_prompt_index = j.at("first").get<int64_t>();
      a.sampling = &sp;
      if (a.num_prompts < 0 || offsets.back() != static_cast<int64_t>(ids.size()))
        throw Error(RLH_E_DATA_LOSS, "a request whose prompt offsets do not match its tokens");
      SampleSink sink;
      gen.generate(a, sink_sample, &sink);
      reply = json::to_cbor(json{{"prompt", sink.prompt}, {"sample", sink.sample}, {"ids", sink.ids},
                                 {"logprobs", sink.logprobs}, {"truncated", sink.truncated}, {"version", sink.version}});
    } catch (const Error& e) {
      status = e.code();
      const std::string m = e.what();
      reply.assign(m.begin(), m.end());
    } catch (const std::exception& e) {
      status = RLH_E_INTERNAL;
      const std::string m = e.what();
      reply.assign(m.begin(), m.end());
    }
    if (leader) queues.reply(action.client, status, std::move(reply));
  }
}

}  // namespace rlh::grpo
