// Generation split over a model-parallel group (see group_generation.hpp).
#include "group_generation.hpp"

#include <exception>
#include <string>
#include <vector>

#include "byte_wire.hpp"
#include "token_balance.hpp"

namespace rlh::grpo {

using sdk::Error;

namespace {

// A part's samples as bytes (byte_wire.hpp): a status byte (1 ok, 0 failed + the message), then
// per sample its indices (prompt index within the whole call), lengths, flags and arrays.
struct Collect {
  ByteWriter w;
  int64_t count = 0;
  int64_t offset = 0;  // this part's first prompt within the call
};

rlh_status* collect_sample(void* user, const rlh_sample* s) {
  auto* c = static_cast<Collect*>(user);
  c->w.i64(s->prompt_index + c->offset);
  c->w.i64(s->sample_index);
  c->w.i64(s->num_tokens);
  c->w.i64(s->truncated);
  c->w.i64(s->weight_version);
  c->w.raw(s->ids, static_cast<size_t>(s->num_tokens) * sizeof(int32_t));
  c->w.raw(s->logprobs, static_cast<size_t>(s->num_tokens) * sizeof(float));
  ++c->count;
  return nullptr;
}

}  // namespace

GroupPart part_of_call(const rlh_generate_args& args, int size, int rank, int parts, rlh_generate_args* out,
                       std::vector<int64_t>* offsets, bool whole_runs) {
  GroupPart p;
  const int stride = size / parts;
  if (rank % stride != 0) {
    if (!whole_runs) return p;  // not the first rank of its part's run: generates nothing
    p.echo = true;              // makes the run's call too; its samples are the first rank's
  }
  const int64_t j = rank / stride, n = args.num_prompts;
  p.begin = n * j / parts;
  p.end = n * (j + 1) / parts;
  if (out != nullptr && p.end > p.begin) {
    // The prompts [begin, end), their offsets rebased, under their indices in the call.
    offsets->resize(static_cast<size_t>(p.end - p.begin + 1));
    for (int64_t i = p.begin; i <= p.end; ++i)
      (*offsets)[size_t(i - p.begin)] = args.prompt_offsets[i] - args.prompt_offsets[p.begin];
    *out = args;
    out->prompt_ids = args.prompt_ids + args.prompt_offsets[p.begin];
    out->prompt_offsets = offsets->data();
    out->num_prompts = p.end - p.begin;
    out->first_prompt_index = args.first_prompt_index + p.begin;
  }
  return p;
}

void generate_over_group(const sdk::Comm& group, int parts, Generator& gen, const rlh_generate_args& args,
                         rlh_sample_fn fn, void* user, bool whole_runs) {
  const int64_t r = group.rank();
  Collect c;
  std::vector<uint8_t> mine;
  try {
    rlh_generate_args part{};
    std::vector<int64_t> offsets;
    const GroupPart p = part_of_call(args, group.size(), group.rank(), parts, &part, &offsets, whole_runs);
    c.offset = p.begin;
    if (p.end > p.begin) {
      if (!p.echo) {
        gen.generate_here(part, collect_sample, &c);
      } else {
        Collect dropped;  // the run's first rank gathers the same samples
        gen.generate_here(part, collect_sample, &dropped);
      }
    }
    ByteWriter head;
    const uint8_t ok = 1;
    head.raw(&ok, 1);
    head.i64(c.count);
    mine = std::move(head.out);
    mine.insert(mine.end(), c.w.out.begin(), c.w.out.end());
  } catch (const std::exception& e) {
    // The others are waiting in the gather below: tell them (code and message), so every rank
    // fails alike instead of at the gather's deadline.
    ByteWriter fail;
    const uint8_t ok = 0;
    fail.raw(&ok, 1);
    const auto* err = dynamic_cast<const Error*>(&e);
    fail.i64(err != nullptr ? static_cast<int64_t>(err->code()) : static_cast<int64_t>(RLH_E_INTERNAL));
    const std::string what = e.what();
    fail.raw(what.data(), what.size());
    mine = std::move(fail.out);
  }
  const std::vector<std::vector<uint8_t>> gathered = all_gather_bytes(group, mine);
  for (size_t p = 0; p < gathered.size(); ++p) {
    if (!gathered[p].empty() && gathered[p][0] == 1) continue;
    if (gathered[p].size() < 1 + sizeof(int64_t))
      throw Error(RLH_E_INTERNAL, "generation on rank " + std::to_string(p) + " of the model-parallel group: no answer");
    ByteReader rd{gathered[p], "generation over the model-parallel group: rank " + std::to_string(p) + "'s part", 1};
    const auto code = static_cast<rlh_code>(rd.s64());
    const std::string what(gathered[p].begin() + 1 + sizeof(int64_t), gathered[p].end());
    // This rank's own error as it was; another's with its place in the group.
    throw Error(code, int64_t(p) == r ? what : "rank " + std::to_string(p) + " of the model-parallel group: " + what);
  }
  std::vector<int32_t> ids;
  std::vector<float> logprobs;
  for (const std::vector<uint8_t>& part : gathered) {
    ByteReader rd{part, "generation over the model-parallel group: a part", 1};
    const int64_t count = rd.i64();
    for (int64_t k = 0; k < count; ++k) {
      rlh_sample s{};
      s.struct_size = RLH_STRUCT_SIZE(rlh_sample, weight_version);
      s.prompt_index = rd.i64();
      s.sample_index = rd.i64();
      s.num_tokens = rd.i64();
      s.truncated = static_cast<uint8_t>(rd.i64());
      s.weight_version = rd.s64();
      if (s.num_tokens < 0 || static_cast<size_t>(s.num_tokens) > part.size())
        throw Error(RLH_E_INTERNAL, "generation over the model-parallel group: a sample's length is corrupt");
      ids.resize(static_cast<size_t>(s.num_tokens));
      logprobs.resize(static_cast<size_t>(s.num_tokens));
      rd.raw(ids.data(), ids.size() * sizeof(int32_t));
      rd.raw(logprobs.data(), logprobs.size() * sizeof(float));
      s.ids = ids.data();
      s.logprobs = logprobs.data();
      sdk::check(fn(user, &s), "generator '" + gen.name() + "'");
    }
  }
}

void split_generation_over(const sdk::Host& host, Generator& gen, const sdk::Comm& group, int parts,
                           bool whole_runs) {
  if (!group || group.size() <= 1) return;
  if (parts == 0) parts = group.size();
  if (parts < 1 || group.size() % parts != 0)
    throw Error(RLH_E_INTERNAL, "generation over the model-parallel group: " + std::to_string(parts) +
                                    " parts do not divide its " + std::to_string(group.size()) + " ranks");
  if (group.rank() == 0)
    host.info("generation: the " + std::to_string(group.size()) + " ranks of each model-parallel group split every "
              "generate call's prompts into " + std::to_string(parts) + " part" + (parts == 1 ? "" : "s") +
              " and all-gather the samples" +
              (whole_runs ? " (each part by a tensor-parallel generator over " + std::to_string(group.size() / parts) +
                                " ranks)"
                          : std::string()));
  const sdk::Comm* g = &group;
  gen.set_split([g, parts, whole_runs](Generator& self, const rlh_generate_args& args, rlh_sample_fn fn, void* user) {
    generate_over_group(*g, parts, self, args, fn, user, whole_runs);
  });
}

}  // namespace rlh::grpo
