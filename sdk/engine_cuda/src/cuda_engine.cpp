// The CUDA engine: state, memory plan, the layer program's steps forward and backward, the head
// and the optimizer step, one op call per step as in the CPU engine (sdk/engine/src/forward.cpp,
// backward.cpp), whose math, program and output alignment it follows; the difference is where
// things live and in which precision (cuda_engine.hpp). Every op is the registry's
// (device_ops.hpp).
//
// Dimension letters: N tokens of the micro-batch, S sequences, C hidden size, V vocabulary,
// L layers, Hq / Hkv heads, D head dim, F MLP width, R rotary dims.
#include "rlhost/engine_cuda/cuda_engine.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>

#include "cuda_engine_impl.hpp"

namespace rlh::engine {

using sdk::ParamRole;
using sdk::StepOp;
using cuda::check;
using cuda::numel;
using bf16 = cuda::bf16;

namespace {

// Roles that follow the previous one without padding (they are read as one matrix).
bool joins_previous(ParamRole r) {
  return r == ParamRole::k || r == ParamRole::v || r == ParamRole::up ||
         r == ParamRole::shared_expert_up;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Setup

CudaEngine::Impl::Impl(sdk::TransformerDesc d, CudaEngineOptions o)
    : desc(std::move(d)), opt(o) {
  describe();  // validates before touching the device
  int count = 0;
  check(cudaGetDeviceCount(&count), "no CUDA device");
  if (opt.device < 0 || opt.device >= count)
    throw std::runtime_error("cuda engine: device " + std::to_string(opt.device) +
                             " does not exist (" + std::to_string(count) + " visible)");
  check(cudaSetDevice(opt.device), "cudaSetDevice");
  cudaDeviceProp p{};
  check(cudaGetDeviceProperties(&p, opt.device), "cudaGetDeviceProperties");
  if (p.major != 9)
    throw std::runtime_error("cuda engine: built for sm_90a (Hopper); device " +
                             std::to_string(opt.device) + " is " + p.name);
  if (opt.kernels == nullptr)
    throw std::invalid_argument("cuda engine: no kernels given (CudaEngineOptions::kernels: a registry for the device)");
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  ops = std::make_unique<cuda::DeviceOps>(*opt.kernels, opt.device, stream);
  if (opt.batch_invariant) {
    if (opt.fp8.enabled)
      throw std::invalid_argument("cuda engine: batch_invariant with FP8 linears is not supported (the FP8 products "
                                  "pick their kernels by shape)");
    invariant_ops = std::make_unique<cuda::DeviceOps>(*opt.kernels, opt.device, stream);
    invariant_ops->set_batch_invariant_gemm(true);
  }
  carve_params();
  if (opt.fp8.enabled) {
    // The recomputed forward would quantise each input again, advancing its amax history a
    // second time and scaling it otherwise than the forward did (TransformerEngine restores the
    // forward's scales for a recompute; the provider's handles have no such mode).
    if (opt.fp8.delayed && opt.recompute == Recompute::full)
      throw std::invalid_argument("cuda engine: fp8_recipe = delayed with full activation recompute is not supported "
                                  "(the recomputed forward would advance the amax histories again); use selective "
                                  "recompute or none");
    // An FP8 provider's cuBLASLt products ask for 32 MiB of workspace; given none per call, a
    // provider takes it from the stream-ordered pool for every product, and that pool hands its
    // memory back at each host wait.
    op_workspace = cuda::DeviceBuffer(counters, size_t(32) << 20);
    ops->set_workspace(op_workspace.get(), op_workspace.size());
    fp8 = std::make_unique<cuda::Fp8Linears>(*ops, counters, opt.fp8, L);
    if (opt.fp8.delayed) fp8->add_sites(fp8_sites(false), fp8_sites(true));
  }
  for (const sdk::RopeTable& t : prog.ropes) {
    const std::vector<double> f = sdk::rope_inv_freq(t.rope, t.rotary_dim);
    std::vector<float> f32(f.begin(), f.end());
    Rope r;
    r.inv_freq = cuda::DeviceBuffer(counters, f32.size() * sizeof(float));
    check(cudaMemcpy(r.inv_freq.get(), f32.data(), f32.size() * sizeof(float), cudaMemcpyHostToDevice),
          "inv_freq upload");
    r.R = t.rotary_dim;
    r.scale = t.scale;
    r.interleaved = t.interleaved;
    ropes.push_back(std::move(r));
  }
  scalars = cuda::DeviceBuffer(counters, 256);
  if (opt.max_tokens > 0) plan(opt.max_tokens, opt.trainable);
}

// Delayed scaling's quantisation sites, as run_step names them: each FP8 layer's linear steps
// by their first weight (inputs), or each group of adjacent weights by its first (gradients).
std::vector<int64_t> CudaEngine::Impl::fp8_sites(bool groups) const {
  std::vector<int64_t> out;
  for (int64_t l = 0; l < L; ++l) {
    if (!fp8->layer_in_fp8(l)) continue;
    for (const sdk::LayerStep& st : prog.layers[size_t(l)].steps) {
      if (st.op != StepOp::linear || st.weights.empty()) continue;
      if (!groups) {
        out.push_back(int64_t(st.weights[0]));
        continue;
      }
      const int64_t K = st.in.width;
      for (size_t i = 0; i < st.weights.size();) {
        size_t j = i + 1;
        int64_t rows = desc.params[size_t(st.weights[i])].shape[0];
        while (j < st.weights.size() && place[size_t(st.weights[j])].off == place[size_t(st.weights[i])].off + rows * K) {
          rows += desc.params[size_t(st.weights[j])].shape[0];
          ++j;
        }
        out.push_back(int64_t(st.weights[i]));
        i = j;
      }
    }
  }
  return out;
}

CudaEngine::Impl::~Impl() {
  if (stream) cudaStreamSynchronize(stream);
  if (cstream) cudaStreamSynchronize(cstream);
  for (cudaEvent_t e : {ev_ready[0], ev_ready[1], ev_free[0], ev_free[1], ev_gdone[0], ev_gdone[1], ev_rsdone[0],
                        ev_rsdone[1], ev_root, ev_compute, ev_comm})
    if (e) cudaEventDestroy(e);
  if (cstream) cudaStreamDestroy(cstream);
  fp8.reset();
  ops.reset();
  if (stream) cudaStreamDestroy(stream);
}

// What this path executes: the program's one answer, then the MoE and MLA layers' readings.
void CudaEngine::Impl::describe() {
  tp_check();  // tensor parallelism: this rank's description from here on
  try {
    prog = sdk::build_program(desc);
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(std::string("cuda engine: ") + e.what());
  }
  sdk::ExecutorCaps caps;
  caps.name = "cuda engine";
  caps.activations = {"silu", "gelu_tanh", "gelu"};
  caps.moe = caps.mla = true;
  caps.value_head = true;  // a critic's or reward model's score(final_norm(x_L))
  caps.attention_dv_differs = true;  // MLA's attention
  // Gemma-2's soft-capping: the registry's attention and head ops take it as an attribute.
  caps.attention_softcap = caps.logit_softcap = true;
  if (const std::string why = sdk::unsupported(prog, caps); !why.empty()) throw std::invalid_argument(why);
  C = prog.hidden;
  V = prog.vocab;
  L = int64_t(prog.layers.size());
  tp_check_program();
  shapes.assign(size_t(L), LayerShape{});
  for (int64_t l = 0; l < L; ++l)
    for (const sdk::LayerStep& st : prog.layers[size_t(l)].steps) {
      if (st.op == StepOp::moe) describe_moe_layer(desc.layers[size_t(l)], st, shapes[size_t(l)]);
      if (st.op == StepOp::mla) describe_mla_layer(desc.layers[size_t(l)], st, shapes[size_t(l)]);
    }
}

// Offsets of every tensor in one flat buffer; groups start 64 elements apart (256-byte aligned
// in fp32, 128 in bf16, as cuBLASLt and the vector paths want), fused groups (q|k|v, gate|up)
// without a gap so the program's linear steps run them as one GEMM.
void CudaEngine::Impl::carve_params() {
  const size_t n = desc.params.size();
  place.assign(n, cuda::ParamPlace{});
  int64_t at = 0;
  int64_t prev_end = -1;
  int64_t gu_base = -1;  // the current layer's interleaved expert gate|up
  auto put = [&](int64_t layer, ParamRole role) -> int64_t {
    const sdk::ParamDesc* p = desc.find_param(layer, role);
    if (!p) {
      if (joins_previous(role)) prev_end = -1;
      return -1;
    }
    const size_t i = size_t(p - desc.params.data());
    cuda::ParamPlace& pl = place[i];
    if (role == ParamRole::expert_gate || role == ParamRole::expert_up) {
      // [E, Fe, C] each, interleaved per expert: expert e's gate at base + 2 e Fe C, its up
      // Fe C after it. The gate comes first in layer_param_order() and reserves both.
      const LayerShape& s = shapes[size_t(layer)];
      if (role == ParamRole::expert_gate) {
        at = (at + 63) / 64 * 64;
        gu_base = at;
        at += 2 * s.E * s.Fe * C;
      } else if (gu_base < 0) {
        throw std::logic_error("cuda engine: expert up without its gate");
      }
      pl.off = gu_base + (role == ParamRole::expert_up ? s.Fe * C : 0);
      pl.pieces = s.E;
      pl.piece = s.Fe * C;
      pl.stride = 2 * s.Fe * C;
      prev_end = -1;
      return pl.off;
    }
    if (!(joins_previous(role) && prev_end == at)) at = (at + 63) / 64 * 64;
    pl.off = at;
    pl.piece = numel(p->shape);
    at += pl.piece;
    prev_end = at;
    return pl.off;
  };
  // FSDP: the dp_size blocks of each unit (a layer, then the global tensors) tile it, so the
  // unit ends padded to dp_size blocks (data_parallel.cpp). Units start at 128-element
  // multiples and blocks are 128-element multiples in every mode, so a bf16 weight's address in
  // a staging slot agrees with its address in a whole buffer modulo 256 bytes: the GEMM
  // provider's plan (chosen by alignment up to 256 bytes) and so its bits are the same whether
  // the weights are sharded or not.
  if (opt.dp != nullptr) {
    dp_size = opt.dp->size();
    dp_rank = opt.dp->rank();
    if (dp_size < 1 || dp_rank < 0 || dp_rank >= dp_size)
      throw std::invalid_argument("cuda engine: data-parallel rank " + std::to_string(dp_rank) + " of " +
                                  std::to_string(dp_size));
  }
  units.clear();
  int64_t local_elems = 0;
  const auto start_unit = [&] {
    at = (at + 127) / 128 * 128;
    prev_end = -1;
    units.push_back({at, 0, 0});
  };
  const auto end_unit = [&] {
    Unit& u = units.back();
    const int64_t n = (at + 127) / 128 * 128 - u.begin;
    u.block = fsdp() ? std::max<int64_t>(128, ((n + dp_size - 1) / dp_size + 127) / 128 * 128) : n;
    u.at = local_elems;
    local_elems += u.block;
    at = u.begin + (fsdp() ? u.block * dp_size : n);
  };
  lo.assign(size_t(L), LayerOffsets{});
  for (int64_t l = 0; l < L; ++l) {
    LayerOffsets& o = lo[size_t(l)];
    gu_base = -1;
    start_unit();
    for (ParamRole r : layer_param_order()) {  // the CPU engine's (engine.hpp)
      const int64_t off = put(l, r);
      switch (r) {
        case ParamRole::q: o.wq = off; break;
        case ParamRole::router: o.router = off; break;
        case ParamRole::router_bias: o.router_b = off; break;
        case ParamRole::expert_score_bias: o.score_bias = off; break;
        case ParamRole::expert_gate: o.we_gu = off; break;
        case ParamRole::expert_down: o.we_down = off; break;
        case ParamRole::shared_expert_gate_proj: o.ws_gu = off; break;
        case ParamRole::shared_expert_up:
          if (off >= 0 && off != o.ws_gu + shapes[size_t(l)].Fs * C)
            throw std::logic_error("cuda engine: shared expert gate/up not adjacent");
          break;
        case ParamRole::shared_expert_down: o.ws_down = off; break;
        case ParamRole::shared_expert_gate: o.ws_gate = off; break;
        case ParamRole::q_a: o.q_a = off; break;
        case ParamRole::q_a_norm: o.q_a_norm = off; break;
        case ParamRole::q_b: o.q_b = off; break;
        case ParamRole::kv_a: o.kv_a = off; break;
        case ParamRole::kv_a_norm: o.kv_a_norm = off; break;
        case ParamRole::kv_b: o.kv_b = off; break;
        default: break;
      }
    }
    end_unit();
  }
  start_unit();
  for (ParamRole r : global_param_order()) put(-1, r);
  end_unit();
  for (size_t i = 0; i < n; ++i)
    if (place[i].off < 0)
      cuda::unsupported("parameter " + desc.params[i].name + " (role " + sdk::to_string(desc.params[i].role) + ")");
  total = (at + 63) / 64 * 64;
  // The distributed optimizer cuts the flat storage into dp_size equal blocks (64-element
  // aligned, the last ones padded with zeros): the collectives move whole blocks. FSDP's
  // blocks are per unit (above): this rank's `block` elements are all of its units' blocks.
  int64_t padded = total;
  if (opt.shard_masters && !sharded())
    throw std::invalid_argument("cuda engine: sharded master weights (FSDP) need a data-parallel group and the "
                                "sharded optimizer");
  if (opt.dp_replicate != nullptr && !opt.shard_masters)
    throw std::invalid_argument("cuda engine: a replicate group (HSDP) needs sharded master weights (FSDP)");
  if (fsdp()) {
    block = local_elems;
    shard_lo = 0;
    if (opt.fp8.enabled)  // its weight cache is keyed by where a weight lives: one staging slot for every layer
      throw std::invalid_argument("cuda engine: FP8 linears with FSDP's gathered weights are not supported");
  } else if (sharded() && opt.trainable) {
    block = ((total + dp_size - 1) / dp_size + 63) / 64 * 64;
    shard_lo = block * dp_rank;
    padded = block * dp_size;
  }
  const size_t f32 = size_t(padded) * sizeof(float);
  if (offload() && opt.dp != nullptr && !fsdp())
    throw std::invalid_argument(std::string("cuda engine: offloading the optimizer state runs on one rank or under FSDP, not "
                                            "with ") + (sharded() ? "the distributed optimizer" : "DDP"));
  // FSDP: the masters are this rank's blocks (each unit's at a 64-element multiple, as its flat
  // place is, so the AdamW kernels see the same pointer alignments as without sharding).
  const size_t master_b = fsdp() ? size_t(block) * sizeof(float) : f32;
  const size_t moments = sharded() ? size_t(block) * sizeof(float) : f32;
  master = cuda::DeviceBuffer(counters, offload() ? 0 : master_b);
  if (masters_apart()) plan_kept();
  if (opt.trainable) {
    if (!fsdp()) grads = cuda::DeviceBuffer(counters, f32);  // FSDP: per unit, in gstage
    if (offload()) {
      carve_offload(master_b, moments);
    } else {
      adam_m = cuda::DeviceBuffer(counters, moments);
      adam_v = cuda::DeviceBuffer(counters, moments);
    }
    if (sharded()) {
      gshard = cuda::DeviceBuffer(counters, moments);
      check(cudaMemsetAsync(gshard.get(), 0, gshard.size(), stream), "memset");
    }
  }
  w16 = cuda::DeviceBuffer(counters, size_t(fsdp() ? block : padded) * sizeof(bf16));
  if (fsdp()) plan_units();
  for (cuda::DeviceBuffer* b : {&master, &grads, &adam_m, &adam_v, &kept32})
    if (b->size() > 0) check(cudaMemsetAsync(b->get(), 0, b->size(), stream), "memset");
  check(cudaMemsetAsync(w16.get(), 0, w16.size(), stream), "memset");
}

std::vector<CudaEngine::Impl::Range> CudaEngine::Impl::storage_ranges() const {
  std::vector<Range> out;
  for (size_t i = 0; i < desc.params.size(); ++i) {
    const sdk::ParamDesc& p = desc.params[i];
    if (desc.tie_word_embeddings && p.role == ParamRole::lm_head) continue;
    if (p.role == ParamRole::expert_up) continue;  // inside its gate's range
    const cuda::ParamPlace& pl = place[i];
    if (p.role == ParamRole::expert_gate) {
      // gate and up alike for the optimizer: both [E, Fe, C] of one layer
      const sdk::ParamDesc* up = desc.find_param(p.layer, ParamRole::expert_up);
      if (!up || up->trainable != p.trainable)
        throw std::logic_error("cuda engine: expert gate and up must both be trainable or not");
      out.push_back({pl.off, pl.pieces * pl.stride, i});
      continue;
    }
    out.push_back({pl.off, pl.piece, i});
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Memory plan: one activation block for micro-batches of up to N tokens. Training keeps every
// layer's program values and statistics (selective recompute: all but the recomputable ones,
// which one layer at a time rebuilds into `rebuilt`; full recompute: only the layer inputs, each
// layer re-running into the shared set); forward only runs every layer in one shared set with two
// residual buffers in turn.

namespace {

// Bytes (Carver rounding included) of one layer's storage roots but the residual stream's (its
// input and output) and of its statistics, in acts_of's order; or, for `rebuilt`, of its
// recomputable roots alone (selective recompute keeps them apart).
size_t layer_bytes(const sdk::LayerProgram& lp, int64_t N, bool rebuilt) {
  cuda::Carver c{nullptr};
  const int out_root = lp.root(lp.output);
  for (size_t v = 1; v < lp.values.size(); ++v) {
    const sdk::LayerValue& x = lp.values[v];
    if (x.storage >= 0 || int(v) == out_root || (rebuilt && !x.recomputable)) continue;
    c.take<bf16>(N * x.width);
  }
  if (!rebuilt)
    for (int64_t rows : lp.stat_rows) c.take<float>(N * rows);
  return c.at;
}

}  // namespace

cuda::LayerActs CudaEngine::Impl::acts_of(int64_t l) {
  const sdk::LayerProgram& lp = prog.layers[size_t(l)];
  const int64_t N = planned_tokens;
  const bool selective = rebuilt != nullptr;
  LayerActs a;
  if (acts_per_layer) {
    a = acts[size_t(l)];
  } else {
    // carve this layer's view of the shared block, as layer_bytes counted it
    a.v.assign(lp.values.size(), nullptr);
    cuda::Carver c{shared};
    const int out_root = lp.root(lp.output);
    for (size_t v = 1; v < lp.values.size(); ++v)
      if (lp.values[v].storage < 0 && int(v) != out_root) a.v[v] = c.take<bf16>(N * lp.values[v].width);
    for (int64_t rows : lp.stat_rows) a.stat.push_back(c.take<float>(N * rows));
  }
  if (selective) {  // the recomputable values, rebuilt before each layer's backward
    cuda::Carver c{rebuilt};
    const int out_root = lp.root(lp.output);
    for (size_t v = 1; v < lp.values.size(); ++v)
      if (lp.values[v].storage < 0 && int(v) != out_root && lp.values[v].recomputable)
        a.v[v] = c.take<bf16>(N * lp.values[v].width);
  }
  const int out_root = lp.root(lp.output);
  const bool keep_inputs = planned_train;
  a.v[0] = xs[keep_inputs ? size_t(l) : size_t(l % 2)];
  a.v[size_t(out_root)] = xs[keep_inputs ? size_t(l + 1) : size_t((l + 1) % 2)];
  for (size_t v = 1; v < lp.values.size(); ++v)
    if (lp.values[v].storage >= 0) a.v[v] = a.v[size_t(lp.root(int(v)))];
  return a;
}

void CudaEngine::Impl::plan(int64_t N, bool train) {
  if (N <= planned_tokens && (planned_train || !train)) return;
  N = std::max(N, planned_tokens);
  train = train || planned_train;
  const bool full = train && opt.recompute == Recompute::full;
  const bool selective = train && opt.recompute == Recompute::selective;
  auto carve = [&](char* base) {
    cuda::Carver c{base};
    const bool per_layer = train && !full;
    acts_per_layer = per_layer;
    acts.clear();
    xs.assign(size_t(train ? L + 1 : 2), nullptr);
    for (bf16*& x : xs) x = c.take<bf16>(N * C);
    // The head's logits from forward to backward, when they fit the budget (rows padded to 16
    // bytes for the GEMM's C).
    ld_head_cache = (V + 3) / 4 * 4;
    // (Tensor parallelism: its own head backward recomputes its tiles, tensor_parallel.cpp.)
    const bool keep = train && !tp_on && N * ld_head_cache * 4 <= opt.head_logits_cache_bytes;
    head_cache = keep ? c.take<float>(N * ld_head_cache) : nullptr;
    // Packing for head norms over slices, as wide as the widest such input.
    int64_t pack_width = 0;
    for (const sdk::LayerProgram& lp : prog.layers)
      for (const sdk::LayerStep& st : lp.steps)
        if (st.op == StepOp::head_norm) pack_width = std::max(pack_width, st.in.width);
    pack = pack_width ? c.take<bf16>(N * pack_width) : nullptr;
    dpack = pack_width && train ? c.take<bf16>(N * pack_width) : nullptr;
    if (per_layer) {
      for (const sdk::LayerProgram& lp : prog.layers) {
        LayerActs a;
        a.v.assign(lp.values.size(), nullptr);
        const int out_root = lp.root(lp.output);
        for (size_t v = 1; v < lp.values.size(); ++v) {
          const sdk::LayerValue& x = lp.values[v];
          if (x.storage >= 0 || int(v) == out_root || (selective && x.recomputable)) continue;
          a.v[v] = c.take<bf16>(N * x.width);
        }
        for (int64_t rows : lp.stat_rows) a.stat.push_back(c.take<float>(N * rows));
        acts.push_back(std::move(a));
      }
      shared = nullptr;
    } else {
      size_t worst = 0;
      for (const sdk::LayerProgram& lp : prog.layers) worst = std::max(worst, layer_bytes(lp, N, false));
      shared = c.take<char>(int64_t(worst));
    }
    if (selective) {
      size_t worst = 0;
      for (const sdk::LayerProgram& lp : prog.layers) worst = std::max(worst, layer_bytes(lp, N, true));
      rebuilt = c.take<char>(int64_t(worst));
    } else {
      rebuilt = nullptr;
    }
    carve_moe(c, N, per_layer, train);  // MoE layers' routed activations and scratch
    carve_mla(c, N, per_layer, train);  // MLA layers' latents and scratch
    carve_tp(c, N, train);              // tensor parallelism's fp32 partial sums and head scratch
    xn = c.take<bf16>(N * C);
    rstd = c.take<float>(N);
    lp = c.take<float>(N);
    lse = c.take<float>(N);
    ent = c.take<float>(N);
    dlp = c.take<float>(N);
    dent = c.take<float>(N);
    val = c.take<float>(N);
    dval = c.take<float>(N);
    dval16 = c.take<bf16>(N);
    ids = c.take<int32_t>(N);
    pos = c.take<int32_t>(N);
    target = c.take<int32_t>(N);
    cu = c.take<int32_t>(N + 1);
    route = c.take<int32_t>(N * route_width);
    gbuf.clear();
    if (train) {
      dxn = c.take<bf16>(N * C);
      for (int64_t w : prog.grad_widths) gbuf.push_back(c.take<bf16>(N * w));
    } else {
      dxn = nullptr;
    }
    return c.at;
  };
  const size_t bytes = carve(nullptr);
  check(cudaStreamSynchronize(stream), "re-plan");  // the old block may still be in use
  ++counters.syncs;
  act_block = cuda::DeviceBuffer();
  act_block = cuda::DeviceBuffer(counters, bytes);
  planned_tokens = N;  // acts_of carves views for this N
  planned_train = train;
  carve(act_block.get<char>());
  if (moe_layers > 0) {  // the shared expert's gate as a one-expert route: rows n, expert 0
    cuda::iota_i32(moe_x.srow, N, stream);
    check(cudaMemsetAsync(moe_x.szero, 0, size_t(N) * 4, stream), "memset");
  }
  // pinned staging: 3 x [N] + [N+1] int32, 6 x [N] float, one scalar pair
  pinned = cuda::PinnedBuffer(size_t(4 * N + 1) * 4 + size_t(6 * N) * 4 + 64 +
                              size_t(N * route_width) * 4);
  h_ids = pinned.get<int32_t>();
  h_pos = h_ids + N;
  h_target = h_pos + N;
  h_cu = h_target + N;
  h_lp = reinterpret_cast<float*>(h_cu + N + 1);
  h_ent = h_lp + N;
  h_dlp = h_ent + N;
  h_dent = h_dlp + N;
  h_val = h_dent + N;
  h_dval = h_val + N;
  h_scalar = h_dval + N;
  h_route = reinterpret_cast<int32_t*>(h_scalar + 16);  // after the 64 scalar bytes
}

// ---------------------------------------------------------------------------------------------
// Batches and alignment (NeMo-RL's: output t is about token t; kernel row t predicts t+1)

void CudaEngine::Impl::prepare_batch(const MicroBatch& mb) {
  const int64_t N = mb.num_tokens(), S = mb.num_sequences();
  if (S < 1 || N == 0 || mb.cu_seqlens[0] != 0 || mb.cu_seqlens[size_t(S)] != N)
    throw std::invalid_argument(
        "cuda engine: a micro-batch needs tokens and cu_seqlens running from 0 to their number");
  // A step without host waits between micro-batches stages each one apart (batch_stage):
  // reusing the shared staging could overwrite what an earlier upload has not read yet.
  int32_t* s_ids = batch_stage ? batch_stage : h_ids;
  int32_t* s_pos = batch_stage ? batch_stage + N : h_pos;
  int32_t* s_target = batch_stage ? batch_stage + 2 * N : h_target;
  int32_t* s_cu = batch_stage ? batch_stage + 3 * N : h_cu;
  for (int64_t s = 0; s < S; ++s) {
    const int32_t b = mb.cu_seqlens[size_t(s)], e = mb.cu_seqlens[size_t(s) + 1];
    if (e < b) throw std::invalid_argument("cuda engine: cu_seqlens must not decrease");
    for (int32_t t = b; t < e; ++t) {
      const int32_t id = mb.input_ids[size_t(t)];
      if (id < 0 || id >= (tp_on ? Vall : V))
        throw std::invalid_argument("cuda engine: token id " + std::to_string(id) +
                                    " outside the vocabulary");
      s_pos[t] = t - b;
      s_target[t] = t + 1 < e ? mb.input_ids[size_t(t) + 1] : -1;
    }
  }
  std::memcpy(s_ids, mb.input_ids.data(), size_t(N) * 4);
  std::memcpy(s_cu, mb.cu_seqlens.data(), size_t(S + 1) * 4);
  // from pinned staging: asynchronous, ordered before the kernels that read them
  check(cudaMemcpyAsync(ids, s_ids, size_t(N) * 4, cudaMemcpyHostToDevice, stream), "upload");
  check(cudaMemcpyAsync(pos, s_pos, size_t(N) * 4, cudaMemcpyHostToDevice, stream), "upload");
  check(cudaMemcpyAsync(target, s_target, size_t(N) * 4, cudaMemcpyHostToDevice, stream), "upload");
  check(cudaMemcpyAsync(cu, s_cu, size_t(S + 1) * 4, cudaMemcpyHostToDevice, stream), "upload");
}


// ---------------------------------------------------------------------------------------------
// Forward: the program's steps (sdk/layer_program.hpp says what each does)

void CudaEngine::Impl::rope(int t, bf16* y, int64_t ldy, const bf16* x, int64_t ldx, int64_t H, int64_t D,
                            int64_t N, bool inverse) {
  const Rope& r = ropes[size_t(t)];
  ops->rope(y, ldy, x, ldx, pos, r.inv_freq.get<float>(), N, H, D, r.R, r.scale, r.interleaved, inverse);
}

namespace {

struct ColsPtr {
  bf16* p;
  int64_t ld;
};
ColsPtr cols_of(const cuda::LayerActs& a, const sdk::LayerProgram& lp, const sdk::Cols& c) {
  return {a.v[size_t(c.value)] + c.col, lp.values[size_t(c.value)].width};
}

// The bf16 of a scale as HF's bf16 model rounds it (Gemma's embedding normaliser:
// torch.tensor(sqrt(hidden)).to(bfloat16)), round to nearest even.
double bf16_rounded(double x) {
  const float f = float(x);
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  float r;
  std::memcpy(&r, &u, 4);
  return double(r);
}

// An attention step's operands: q, k, v, o in their values (rows of the value's width apart),
// lse its statistic.
cuda::DeviceOps::Attention attention_of(const sdk::LayerStep& st, const cuda::LayerActs& a,
                                        const sdk::LayerProgram& lp, int64_t N, int64_t S, const int32_t* cu) {
  const ColsPtr q = cols_of(a, lp, st.in), k = cols_of(a, lp, st.in2), v = cols_of(a, lp, st.in3),
                o = cols_of(a, lp, st.out);
  cuda::DeviceOps::Attention at;
  at.N = N;
  at.S = S;
  at.Hq = st.hq;
  at.Hkv = st.hkv;
  at.Dk = st.dk;
  at.Dv = st.dv;
  at.window = st.window;
  at.scale = st.scale;
  at.softcap = st.softcap;
  at.cu = cu;
  at.q = q.p;
  at.ldq = q.ld;
  at.k = k.p;
  at.ldk = k.ld;
  at.v = v.p;
  at.ldv = v.ld;
  at.o = o.p;
  at.ldo = o.ld;
  at.lse = a.stat[size_t(st.stat)];
  return at;
}

}  // namespace

void CudaEngine::Impl::run_step(int64_t l, const sdk::LayerStep& st, const MicroBatch& mb, LayerActs& a,
                                bool recompute) {
  const sdk::LayerProgram& lp = prog.layers[size_t(l)];
  const int64_t N = mb.num_tokens(), S = mb.num_sequences();
  const ColsPtr in = st.in.valid() ? cols_of(a, lp, st.in) : ColsPtr{nullptr, 0};
  const ColsPtr out = st.out.valid() ? cols_of(a, lp, st.out) : ColsPtr{nullptr, 0};
  switch (st.op) {
    case StepOp::norm:
      ops->rmsnorm_fwd(out.p, out.ld, a.stat[size_t(st.stat)], in.p, in.ld, wp(st.weights[0]), N, st.in.width,
                       st.eps, st.offset);
      break;
    case StepOp::head_norm: {
      // One launch over N x heads rows of head_dim: the output is a whole contiguous value; an
      // input that is a slice of a wider one (q or k inside q|k|v) is packed first.
      const bf16* x = in.p;
      if (in.ld != st.in.width) {
        copy_cols(pack, st.in.width, in.p, in.ld, N, st.in.width);
        x = pack;
      }
      ops->rmsnorm_fwd(out.p, st.head_dim, a.stat[size_t(st.stat)], x, st.head_dim, wp(st.weights[0]),
                       N * st.heads, st.head_dim, st.eps, st.offset);
      break;
    }
    case StepOp::linear: {
      // Fused weights adjacent in storage run as one GEMM; otherwise one per piece. An FP8
      // layer quantises the input once for all its groups.
      const int64_t K = st.in.width;
      const bool f8_layer = fp8 && fp8->layer_in_fp8(l);
      const bool f8 = f8_layer && fp8->input(in.p, in.ld, N, K, int64_t(st.weights[0]));
      int64_t row = 0;
      for (size_t i = 0; i < st.weights.size();) {
        size_t j = i + 1;
        int64_t rows = desc.params[size_t(st.weights[i])].shape[0];
        while (j < st.weights.size() &&
               place[size_t(st.weights[j])].off == place[size_t(st.weights[i])].off + rows * K) {
          rows += desc.params[size_t(st.weights[j])].shape[0];
          ++j;
        }
        if (st.tp_reduce_out) {  // row-parallel: this rank's partial sum in fp32 (its rows `total` apart)
          ops->gemm(false, true, N, rows, K, in.p, in.ld, wp(st.weights[i]), K, 0, tp32 + row, st.out.width, true);
        } else if (f8 && fp8->fits_group(rows, out.ld)) {
          fp8->forward(wp(st.weights[i]), rows, out.p + row, out.ld);
        } else {
          if (f8_layer) fp8->count_bf16();
          ops->gemm(false, true, N, rows, K, in.p, in.ld, wp(st.weights[i]), K, 0, out.p + row, out.ld, false);
        }
        row += rows;
        i = j;
      }
      if (st.tp_reduce_out) {  // the group's sum, rounded to bf16 once; the bias after it
        if (row != st.out.width) throw std::logic_error("cuda engine: a row-parallel linear writes part of its value");
        tp_sum(tp32, N * row);
        cuda::tp_store_bf16(out.p, out.ld, tp32, N, row, false, stream);
      }
      row = 0;
      for (size_t i = 0; i < st.weights.size(); ++i) {
        const int64_t rows = desc.params[size_t(st.weights[i])].shape[0];
        if (st.biases[i] >= 0) ops->bias_add(false, out.p + row, out.ld, wp(st.biases[i]), N, rows);
        row += rows;
      }
      break;
    }
    case StepOp::rope:
      rope(st.table, in.p, in.ld, in.p, in.ld, st.heads, st.head_dim, N, false);
      break;
    case StepOp::attention:
      attention_forward(attention_of(st, a, lp, N, S, cu));
      break;
    case StepOp::glu:
      ops->glu_fwd(st.act, out.p, out.ld, in.p, in.ld, N, st.out.width);
      break;
    case StepOp::add: {
      const ColsPtr b = cols_of(a, lp, st.in2);  // whole values: contiguous N x width
      ops->add(out.p, in.p, b.p, N * st.out.width);
      break;
    }
    case StepOp::moe:
      forward_moe(l, mb, in.p, out.p, recompute);
      break;
    case StepOp::mla:
      forward_mla(l, mb, in.p, cols_of(a, lp, st.out2).p, out.p, a.stat[size_t(st.stat)]);
      break;
  }
}

// A linear whose whole output only the residual add after it reads (o and down in a dense
// layer; sdk::product_then_residual_add): the add can be the product's epilogue, r read as the
// GEMM's C (gemm_add_fwd with round_product = 0: one pass over the residual stream and one launch
// less each). Not for products run apart (several weight groups, biases, tensor-parallel sums,
// FP8). Opt-in (RLH_CUDA_RESIDUAL_EPILOGUE=1): on an H100 it moved the 1B step by less than the
// run-to-run spread, and its rounding (once, where the generator's decoding products round the
// product first) widened the trainer-generator logprob gap (the MLA test model's mean |dlp| from
// ~1e-3 to 2-4e-2: docs/engine_cuda.md).
bool CudaEngine::Impl::residual_product(int64_t l, size_t i) const {
  static const bool on = [] {
    const char* e = std::getenv("RLH_CUDA_RESIDUAL_EPILOGUE");
    return e && std::string(e) == "1";
  }();
  const sdk::LayerProgram& lp = prog.layers[size_t(l)];
  if (!on || !sdk::product_then_residual_add(lp, i)) return false;
  const sdk::LayerStep& st = lp.steps[i];
  return st.weights.size() == 1 && st.biases[0] < 0 && !st.tp_reduce_out && !(fp8 && fp8->layer_in_fp8(l)) &&
         desc.params[size_t(st.weights[0])].shape[0] == st.out.width;
}

void CudaEngine::Impl::forward_layer(int64_t l, const MicroBatch& mb, LayerActs& a, bool recompute,
                                     bool only_cheap) {
  const sdk::LayerProgram& lp = prog.layers[size_t(l)];
  auto skipped = [&](const sdk::LayerStep& st) {
    // Inside the backward only what it reads is rebuilt: values it keeps and the statistics it
    // reads; the final add and the output itself are not.
    return recompute && st.op != StepOp::moe && st.stat < 0 && !lp.values[size_t(lp.root(st.out.value))].saved;
  };
  for (size_t i = 0; i < lp.steps.size(); ++i) {
    const sdk::LayerStep& st = lp.steps[i];
    const sdk::LayerValue& out = lp.values[size_t(st.out.value)];
    if (only_cheap) {  // selective recompute: the norm and activation outputs, with their stats
      if (out.recomputable) run_step(l, st, mb, a, true);
      continue;
    }
    if (skipped(st)) continue;
    if (residual_product(l, i) && !skipped(lp.steps[i + 1])) {
      const sdk::LayerStep& nx = lp.steps[i + 1];
      const ColsPtr x = cols_of(a, lp, st.in), y = cols_of(a, lp, nx.out);
      const ColsPtr r = cols_of(a, lp, nx.in.value == st.out.value ? nx.in2 : nx.in);
      if (ops->gemm_add(y.p, r.p, x.p, x.ld, wp(st.weights[0]), mb.num_tokens(), st.out.width, st.in.width,
                        false)) {
        ++i;
        continue;
      }
    }
    run_step(l, st, mb, a, recompute);
  }
}

cuda::DeviceOps::Logprob CudaEngine::Impl::head_args(const OutputRequest& req, int64_t N, bool cache) const {
  cuda::DeviceOps::Logprob h;
  h.N = N;
  h.C = C;
  h.V = V;
  h.h = xn;
  h.W = wp(prog.head);
  h.target = target;
  h.temperature = req.temperature;
  h.softcap = prog.logit_softcap;
  // Wide tiles: the head's GEMMs run at their best from about 512 MiB of fp32 logits per tile
  // (measured on the H200: +4 % on a 1B training step over 32 MiB).
  h.chunk_bytes = opt.logprob_chunk_bytes > 0 ? opt.logprob_chunk_bytes : int64_t(512) << 20;
  if (cache && head_cache != nullptr) {
    h.cache = head_cache;
    h.ld_cache = ld_head_cache;
  }
  h.logprob = lp;
  h.lse = lse;
  h.entropy = req.entropy ? ent : nullptr;
  return h;
}

void CudaEngine::Impl::check_request(const OutputRequest& req) const {
  if (req.processed_logprob) cuda::unsupported("processed (top-k/top-p) logprobs");
  if (req.logprob_at_ids) cuda::unsupported("logprob_at_ids");
  if (tp_on && req.logits)
    throw std::invalid_argument("cuda engine: tensor parallelism with the logits output is not supported (no rank holds "
                                "the whole vocabulary)");
  if (!(req.temperature > 0)) throw std::invalid_argument("cuda engine: temperature must be > 0");
}

void CudaEngine::Impl::forward(const MicroBatch& mb, const OutputRequest& req, bool train) {
  check_request(req);
  const int64_t N = mb.num_tokens();
  if (mb.cu_seqlens.empty() || N == 0) throw std::invalid_argument("cuda engine: empty micro-batch");
  plan(N, train);
  prepare_batch(mb);
  // The deterministic mode's forward-only calls: the invariant ops in `ops` for this call.
  struct Det {
    Impl& m;
    bool on, swap;
    Det(Impl& i, bool o) : m(i), on(o), swap(o && i.opt.invariant_parts.gemm) {
      if (!on) return;
      m.det_ops = m.invariant_ops.get();
      if (swap) std::swap(m.ops, m.invariant_ops);
      m.det_on = true;
    }
    ~Det() {
      if (!on) return;
      if (swap) std::swap(m.ops, m.invariant_ops);
      m.det_on = false;
      m.det_ops = nullptr;
    }
  } det{*this, opt.batch_invariant && !train};
  if (det_on && opt.invariant_parts.attention) det_prepare(mb);
  prepare_routing(mb, req);
  if (fsdp()) hold_global();  // held until the public call ends (training: the step)
  if (tp_on)
    tp_embedding_fwd(N);
  else
    ops->embedding_fwd(xs[0], ids, wp(prog.embed), N, C, V);
  if (prog.embed_scale != 1) {  // Gemma: the embedding rows times sqrt(hidden), as bf16 holds it
    const double s = bf16_rounded(prog.embed_scale);
    ops->scale(xs[0], N * C, s);
  }
  for (int64_t l = 0; l < L; ++l) {
    if (fsdp()) hold_layer(l);
    LayerActs a = acts_of(l);
    forward_layer(l, mb, a, false);
    if (fsdp()) layer_forward_end(l);
  }
  bf16* xL = xs[planned_train ? size_t(L) : size_t(L % 2)];
  ops->rmsnorm_fwd(xn, C, rstd, xL, C, wp(prog.final_norm), N, C, prog.final_eps, prog.final_offset);
  if ((req.logprob || req.entropy) && tp_on)
    tp_head_fwd(req, N);
  else if ((req.logprob || req.entropy) && det_on && opt.invariant_parts.head)
    det_head(req, N);
  else if (req.logprob || req.entropy)
    ops->logprob_fwd(head_args(req, N, train));
  if (req.value) {  // val [N] = xn [N, C] score [1, C]^T: one scalar per position, no shift
    if (prog.value_head < 0)
      throw std::invalid_argument("cuda engine: a value output was requested but the model has no value head (score.weight)");
    ops->gemm(false, true, N, 1, C, xn, C, wp(prog.value_head), C, 0, val, 1, true);
  }
}

// ---------------------------------------------------------------------------------------------
// Backward: the program's steps in reverse. gbuf[0] carries d loss / d residual stream from the
// head down to the embedding; the other gradient buffers are written by the first step that
// produces them and accumulated by the rest, as the program planned.

void CudaEngine::Impl::backward_layer(int64_t l, const MicroBatch& mb, LayerActs& a) {
  const sdk::LayerProgram& lp = prog.layers[size_t(l)];
  const int64_t N = mb.num_tokens(), S = mb.num_sequences();
  auto val = [&](const sdk::Cols& c) { return cols_of(a, lp, c); };
  auto grad = [&](const sdk::Cols& c) {
    const sdk::LayerValue& v = lp.values[size_t(c.value)];
    return ColsPtr{gbuf[size_t(v.grad)] + c.col, v.width};
  };
  for (auto it = lp.steps.rbegin(); it != lp.steps.rend(); ++it) {
    const sdk::LayerStep& st = *it;
    switch (st.op) {
      case StepOp::add:
        break;  // both operands take the output's gradient buffer as it is
      case StepOp::norm: {
        const ColsPtr x = val(st.in), dy = grad(st.out), dx = grad(st.in);
        ops->rmsnorm_bwd(dx.p, dx.ld, gp(st.weights[0]), dy.p, dy.ld, x.p, x.ld, wp(st.weights[0]),
                         a.stat[size_t(st.stat)], N, st.in.width, st.offset, st.accumulate);
        break;
      }
      case StepOp::head_norm: {
        // d(normed) is contiguous ([N heads, head_dim] rows); the input slice is packed again and
        // the input gradient lands in its slice by a strided copy (the program writes it, never
        // adds: it is the first gradient of those columns).
        const ColsPtr x = val(st.in), dy = grad(st.out), dx = grad(st.in);
        if (st.accumulate) throw std::logic_error("cuda engine: a head norm's input gradient must be written");
        const bool packed = x.ld != st.in.width;
        if (packed) copy_cols(pack, st.in.width, x.p, x.ld, N, st.in.width);
        bf16* dst = dx.ld != st.in.width ? dpack : dx.p;
        ops->rmsnorm_bwd(dst, st.head_dim, gp(st.weights[0]), dy.p, st.head_dim, packed ? pack : x.p, st.head_dim,
                         wp(st.weights[0]), a.stat[size_t(st.stat)], N * st.heads, st.head_dim, st.offset, false);
        if (dst == dpack) copy_cols(dx.p, dx.ld, dpack, st.in.width, N, st.in.width);
        break;
      }
      case StepOp::linear: {
        const ColsPtr x = val(st.in), dy = grad(st.out), dx = grad(st.in);
        const int64_t K = st.in.width;
        int64_t row = 0;
        for (size_t i = 0; i < st.weights.size(); ++i) {
          const int64_t rows = desc.params[size_t(st.weights[i])].shape[0];
          if (st.biases[i] >= 0) ops->bias_bwd(false, gp(st.biases[i]), dy.p + row, dy.ld, N, rows);
          row += rows;
        }
        // dX (+)= dY W over the fused rows (one GEMM when adjacent), dW += dY^T X per group,
        // accumulated in fp32 by the GEMM (bf16 operands, fp32 C, beta 1).
        // An FP8 layer runs each product in FP8 where its shape fits (X^T quantised once for
        // the step's weight gradients), in bf16 otherwise.
        const bool f8 = fp8 && fp8->layer_in_fp8(l);
        const bool f8_dw = f8 && fp8->input_t(x.p, x.ld, N, K, int64_t(st.weights[0]));
        row = 0;
        bool first = true;
        for (size_t i = 0; i < st.weights.size();) {
          size_t j = i + 1;
          int64_t rows = desc.params[size_t(st.weights[i])].shape[0];
          while (j < st.weights.size() &&
                 place[size_t(st.weights[j])].off == place[size_t(st.weights[i])].off + rows * K) {
            rows += desc.params[size_t(st.weights[j])].shape[0];
            ++j;
          }
          const double beta = (st.accumulate || !first) ? 1 : 0;
          const int64_t site = int64_t(st.weights[i]);  // the group's gradient site (delayed scaling)
          if (st.tp_reduce_din) {  // column-parallel: this rank's part of dX, summed below in fp32
            ops->gemm(false, false, N, K, rows, dy.p + row, dy.ld, wp(st.weights[i]), K, first ? 0 : 1, tp32, K, true);
          } else if (!(f8 && fp8->backward_dx(dy.p + row, dy.ld, N, rows, K, wp(st.weights[i]), beta, dx.p, dx.ld, site))) {
            if (f8) fp8->count_bf16();
            ops->gemm(false, false, N, K, rows, dy.p + row, dy.ld, wp(st.weights[i]), K, beta, dx.p, dx.ld, false);
          }
          if (!(f8_dw && fp8->backward_dw(dy.p + row, dy.ld, N, rows, K, gp(st.weights[i]), site))) {
            if (f8) fp8->count_bf16();
            ops->gemm(true, false, rows, K, N, dy.p + row, dy.ld, x.p, x.ld, dw_beta(st, i, j), gp(st.weights[i]), K,
                      true);
          }
          first = false;
          row += rows;
          i = j;
        }
        if (st.tp_reduce_din) {
          tp_sum(tp32, N * K);
          cuda::tp_store_bf16(dx.p, dx.ld, tp32, N, K, st.accumulate, stream);
        }
        break;
      }
      case StepOp::rope: {
        const ColsPtr d = grad(st.in);  // the transposed rotation, in place
        rope(st.table, d.p, d.ld, d.p, d.ld, st.heads, st.head_dim, N, true);
        break;
      }
      case StepOp::attention: {
        const ColsPtr dq = grad(st.in), dk = grad(st.in2), dv = grad(st.in3), dout = grad(st.out);
        ops->attention_bwd(attention_of(st, a, lp, N, S, cu), dout.p, dout.ld, dq.p, dq.ld, dk.p, dk.ld, dv.p, dv.ld);
        break;
      }
      case StepOp::glu: {
        const ColsPtr gu = val(st.in), dh = grad(st.out), dgu = grad(st.in);
        ops->glu_bwd(st.act, dgu.p, dgu.ld, dh.p, dh.ld, gu.p, gu.ld, N, st.out.width);
        break;
      }
      case StepOp::moe:
        backward_moe(l, mb, val(st.in).p, grad(st.out).p, grad(st.in).p, st.accumulate);
        break;
      case StepOp::mla:
        backward_mla(l, mb, val(st.in).p, val(st.out2).p, val(st.out).p, a.stat[size_t(st.stat)], grad(st.out).p,
                     grad(st.in).p, st.accumulate);
        break;
    }
  }
}

// Output gradients are in dlp / dent (kernel alignment, device).
void CudaEngine::Impl::backward(const MicroBatch& mb, const OutputRequest& req) {
  const int64_t N = mb.num_tokens();
  bf16* dres = gbuf[0];
  const bool head = req.logprob || req.entropy;
  if (head && tp_on)
    tp_head_bwd(req, N);
  else if (head)
    ops->logprob_bwd(head_args(req, N, true), dlp, req.entropy ? dent : nullptr, dxn, gp(prog.head), false);
  if (req.value) {  // d xn (+)= dval score; d score += dval^T xn (bf16 operands, f32 gradient)
    cuda::cast_to_bf16(dval, dval16, N, stream);
    ops->gemm(false, false, N, C, 1, dval16, 1, wp(prog.value_head), C, head ? 1 : 0, dxn, C, false);
    ops->gemm(true, false, 1, C, N, dval16, 1, xn, C, 1, gp(prog.value_head), C, true);
  }
  ops->rmsnorm_bwd(dres, C, gp(prog.final_norm), dxn, C, xs[size_t(L)], C, wp(prog.final_norm), rstd, N, C,
                   prog.final_offset, false);  // dres = d x_L
  for (int64_t l = L - 1; l >= 0; --l) {
    if (fsdp()) layer_backward_begin(l);
    LayerActs a = acts_of(l);
    if (opt.recompute == Recompute::full)
      forward_layer(l, mb, a, true);  // the layer's activations again, from its kept input
    else if (opt.recompute == Recompute::selective)
      forward_layer(l, mb, a, true, true);  // its norms and activation products
    backward_layer(l, mb, a);
    if (fsdp()) layer_backward_end(l);
  }
  if (fsdp()) backward_units_end();
  if (prog.embed_scale != 1) ops->scale(dres, N * C, bf16_rounded(prog.embed_scale));
  if (tp_on)
    tp_embedding_bwd(dres, N);
  else
    ops->embedding_bwd(gp(prog.embed), ids, dres, N, C, V);
}

// ---------------------------------------------------------------------------------------------
// Optimizer

double CudaEngine::Impl::grad_norm() {
  // Tensor parallelism: two sums, the cut tensors' (summed over the group) and the replicated
  // ones' (identical on every rank, so the group's sum is T times one rank's: TpPiece::norm_weight
  // 1/T counts them once), as the CPU engine's grad_sumsq weighs them.
  cuda::DeviceList x[2];
  const float* g0 = sharded() ? gshard.get<float>() : grads.get<float>();
  for (const Piece& p : optimizer_pieces()) {
    const int k = tp_on && opt.tp->pieces[p.param].norm_weight != 1 ? 1 : 0;
    x[k].n.push_back(p.n);
    x[k].p.push_back(const_cast<float*>(g0) + p.local);
  }
  for (int k = 0; k < (tp_on ? 2 : 1); ++k) {
    if (x[k].n.empty()) {  // a sharded rank whose block holds no updated parameter (of the kind)
      check(cudaMemsetAsync(scalars.get<float>() + k, 0, sizeof(float), stream), "memset");
    } else {
      ops->sumsq(x[k], scalars.get<float>() + k);
    }
  }
  // Sharded: every rank's sums of squares, summed (before the one wait); then over tp.
  const int64_t sums = tp_on ? 2 : 1;
  if (sharded())
    dp_timed(2 * 4 * sums * (dp_size - 1) / dp_size, [&] { opt.dp->all_reduce_sum(scalars.get<float>(), sums, stream); });
  if (tp_on) tp_sum(scalars.get<float>(), 2);
  check(cudaMemcpyAsync(h_scalar, scalars.get(), size_t(sums) * sizeof(float), cudaMemcpyDeviceToHost, stream),
        "download");
  sync();
  if (!tp_on) return std::sqrt(double(h_scalar[0]));
  return std::sqrt(double(h_scalar[0]) + double(h_scalar[1]) / double(tp_size));
}

void CudaEngine::Impl::adamw_pieces(const std::vector<Piece>& pieces, float* P0, float* M0, float* V0,
                                    int64_t origin, int64_t lo, int64_t hi, const StepOptions& so, double clip) {
  const OptimizerOptions& o = opt.optimizer;
  const bool shard = sharded();
  // Two lists: with and without weight decay (Megatron leaves 1-D tensors out).
  for (int decay = 0; decay < 2; ++decay) {
    cuda::DeviceList P, G, M, Vv, P16;
    for (const Piece& p : pieces) {
      const sdk::ParamDesc& pd = desc.params[p.param];
      const bool d = o.decay_1d_params || pd.shape.size() >= 2;
      if (d != bool(decay)) continue;
      const int64_t a = std::max(p.local, lo), b = std::min(p.local + p.n, hi);
      if (a >= b) continue;
      const int64_t skip = a - p.local;  // elements of the piece before [lo, hi)
      for (cuda::DeviceList* l : {&P, &G, &M, &Vv, &P16}) l->n.push_back(b - a);
      // The masters: this rank's block (FSDP) or its offloaded copy are indexed locally, the
      // distributed optimizer's whole buffer by the flat offset.
      P.p.push_back(P0 + ((masters_apart() ? p.local : p.flat) + skip - origin));
      G.p.push_back((shard ? gshard.get<float>() : grads.get<float>()) + p.local + skip);
      M.p.push_back(M0 + (a - origin));
      Vv.p.push_back(V0 + (a - origin));
      P16.p.push_back(master_bf16() + (fsdp() ? p.local : p.flat) + skip);  // FSDP: this rank's bf16 blocks
    }
    if (P.n.empty()) continue;
    cuda::DeviceOps::AdamW w;
    w.lr = so.lr;
    w.beta1 = o.beta1;
    w.beta2 = o.beta2;
    w.eps = o.eps;
    w.weight_decay = decay ? o.weight_decay : 0.0;
    w.step = steps;
    w.grad_scale = clip;
    // The pass that reads g clears it for the next step, unless the next step overwrites it.
    w.zero_grad = !grad_overwrite_ok();
    ops->adamw_bf16(P, G, M, Vv, P16, w);  // the bf16 working copy refreshed in the same pass
  }
}

void CudaEngine::Impl::optimizer_step(const StepOptions& so, double clip) {
  ++steps;
  const std::vector<Piece> pieces = optimizer_pieces();
  if (offload()) {
    offloaded_update(pieces, so, clip);
  } else {
    adamw_pieces(pieces, master.get<float>(), adam_m.get<float>(), adam_v.get<float>(), 0, 0,
                 std::numeric_limits<int64_t>::max(), so, clip);
  }
  if (sharded()) gather_weights();
  else if (offload()) kept_from_whole(h_master.get<float>());  // the router's side copy follows
  grads_stale = grad_overwrite_ok();
  grads_clear = !grads_stale;
}

// RLH_CUDA_GRAD_OVERWRITE=0 clears the gradients in AdamW's pass as before (the A/B).
bool CudaEngine::Impl::grad_overwrite_ok() const {
  static const bool on = [] {
    const char* e = std::getenv("RLH_CUDA_GRAD_OVERWRITE");
    return !(e && std::string(e) == "0");
  }();
  return on && opt.trainable && opt.dp == nullptr && !tp_on && !offload() && !masters_apart();
}

void CudaEngine::Impl::plan_overwrite() {
  if (!overwritten.empty() || !cleared.empty()) return;
  std::vector<char> over(desc.params.size(), 0);
  for (int64_t l = 0; l < L; ++l) {
    if (fp8 && fp8->layer_in_fp8(l)) continue;  // FP8's weight-gradient products accumulate
    for (const sdk::LayerStep& st : prog.layers[size_t(l)].steps)
      if (st.op == StepOp::linear)
        for (int w : st.weights) over[size_t(w)] = 1;
  }
  std::vector<std::pair<int64_t, int64_t>> rest;
  for (size_t i = 0; i < desc.params.size(); ++i) {
    if (over[i]) {
      overwritten.push_back(int64_t(i));
      continue;
    }
    const cuda::ParamPlace& pl = place[i];
    if (pl.off < 0) continue;
    const int64_t n = pl.pieces > 1 ? (pl.pieces - 1) * pl.stride + pl.piece : numel(desc.params[i].shape);
    rest.emplace_back(pl.off, n);
  }
  std::sort(rest.begin(), rest.end());
  for (const auto& [off, n] : rest) {  // ranges that touch or overlap become one memset
    if (!cleared.empty() && off <= cleared.back().first + cleared.back().second)
      cleared.back().second = std::max(cleared.back().second, off + n - cleared.back().first);
    else
      cleared.emplace_back(off, n);
  }
}

// A step after an overwrite-mode update: the accumulated-only gradients cleared, the linear
// weights' marked fresh (their first product writes them).
void CudaEngine::Impl::begin_overwrite_step() {
  plan_overwrite();
  for (const auto& [off, n] : cleared)
    check(cudaMemsetAsync(grads.get<float>() + off, 0, size_t(n) * 4, stream), "memset");
  grad_fresh.assign(desc.params.size(), 0);
  for (int64_t p : overwritten) grad_fresh[size_t(p)] = 1;
  grads_stale = false;
}

// After the step's backwards: a linear weight no backward reached holds last step's gradient.
void CudaEngine::Impl::end_overwrite_backward() {
  for (size_t p = 0; p < grad_fresh.size(); ++p)
    if (grad_fresh[p]) {
      check(cudaMemsetAsync(gp(int64_t(p)), 0, size_t(numel(desc.params[p].shape)) * 4, stream), "memset");
      grad_fresh[p] = 0;
    }
}

double CudaEngine::Impl::dw_beta(const sdk::LayerStep& st, size_t i, size_t j) {
  if (grad_fresh.empty()) return 1;
  const char fresh = grad_fresh[size_t(st.weights[i])];
  for (size_t k = i; k < j; ++k) {
    if (grad_fresh[size_t(st.weights[k])] != fresh)
      throw std::logic_error("cuda engine: the weights of one gradient product were written apart");
    grad_fresh[size_t(st.weights[k])] = 0;
  }
  return fresh ? 0 : 1;
}

// ---------------------------------------------------------------------------------------------
// CudaEngine

CudaEngine::CudaEngine(sdk::TransformerDesc desc, CudaEngineOptions options)
    : impl_(std::make_unique<Impl>(std::move(desc), options)) {}
CudaEngine::~CudaEngine() = default;

const sdk::TransformerDesc& CudaEngine::desc() const { return impl_->desc; }
size_t CudaEngine::num_params() const { return impl_->desc.params.size(); }
int64_t CudaEngine::num_elements() const {
  int64_t n = 0;
  for (const auto& p : impl_->desc.params) n += numel(p.shape);
  return n;
}
int64_t CudaEngine::step() const { return impl_->steps; }
int64_t CudaEngine::routing_width() const { return impl_->route_width; }
CudaEngineStats CudaEngine::stats() const {
  const Impl& m = *impl_;
  CudaEngineStats st{m.counters.allocations, m.counters.bytes, m.counters.syncs, m.dp_bytes, m.dp_seconds};
  st.tp_bytes = m.tp_bytes;
  st.tp_seconds = m.tp_seconds;
  for (const cuda::DeviceBuffer* b : {&m.master, &m.adam_m, &m.adam_v, &m.gshard, &m.kept32, &m.ostage})
    st.state_bytes += int64_t(b->size());
  for (const cuda::PinnedBuffer* b : {&m.h_master, &m.h_adam_m, &m.h_adam_v}) st.host_state_bytes += int64_t(b->size());
  st.weight_bytes = int64_t(m.w16.size());
  st.grad_bytes = int64_t(m.grads.size());
  st.weight_stage_bytes = int64_t(m.wstage.size());
  st.grad_stage_bytes = int64_t(m.gstage.size() + m.gred.size());
  if (m.fp8) {
    st.fp8_gemms = m.fp8->stats().fp8_gemms;
    st.fp8_layer_bf16_gemms = m.fp8->stats().bf16_gemms;
  }
  return st;
}
std::string CudaEngine::device_name() const {
  cudaDeviceProp p{};
  cudaGetDeviceProperties(&p, impl_->opt.device);
  return p.name;
}

void CudaEngine::set_optimizer_options(const OptimizerOptions& o) { impl_->opt.optimizer = o; }

void CudaEngine::idle_forward(const OutputRequest& req) {
  Impl& m = *impl_;
  m.check_request(req);  // refused here as on the peers with data, before anyone gathers
  if (!m.fsdp()) return;  // nothing to meet: the weights are whole
  m.release_units();
  struct Release {
    Impl& m;
    ~Release() { m.release_units(false); }
  } release{m};
  m.idle_microbatch(false);
}

Outputs CudaEngine::forward(const MicroBatch& mb, const OutputRequest& req) {
  Impl& m = *impl_;
  if (m.fp8) m.fp8->new_call();  // the weights may have changed since the last call
  m.release_units();  // (an earlier call that threw may have left some marked held)
  struct Release {  // FSDP: this call's gathered units go with it
    Impl& m;
    ~Release() { m.release_units(false); }
  } release{m};
  m.forward(mb, req, false);
  const int64_t N = mb.num_tokens();
  Outputs out;
  cuda::DeviceBuffer logits;
  if (req.logits) {  // [N, V] f32: for tests on small vocabularies
    logits = cuda::DeviceBuffer(m.counters, size_t(N * m.V) * sizeof(float));
    m.ops->gemm(false, true, N, m.V, m.C, m.xn, m.C, m.wp(m.prog.head), m.C, 0, logits.get(), m.V, true);
  }
  if (req.logprob)
    check(cudaMemcpyAsync(m.h_lp, m.lp, size_t(N) * 4, cudaMemcpyDeviceToHost, m.stream), "download");
  if (req.entropy)
    check(cudaMemcpyAsync(m.h_ent, m.ent, size_t(N) * 4, cudaMemcpyDeviceToHost, m.stream), "download");
  if (req.value) check(cudaMemcpyAsync(m.h_val, m.val, size_t(N) * 4, cudaMemcpyDeviceToHost, m.stream), "download");
  if (m.record_active)
    check(cudaMemcpyAsync(m.h_route, m.route, size_t(N * m.route_width) * 4,
                          cudaMemcpyDeviceToHost, m.stream), "download");
  if (req.logits) {
    out.logits.resize(size_t(N * m.V));
    check(cudaMemcpyAsync(out.logits.data(), logits.get(), logits.size(), cudaMemcpyDeviceToHost,
                          m.stream), "download");
  }
  m.sync();
  if (req.logprob) {
    out.logprob.resize(size_t(N));
    shift_to_outputs(m.h_lp, 1, out.logprob.data(), 1, 1, mb.cu_seqlens);
  }
  if (req.entropy) {
    out.entropy.resize(size_t(N));
    shift_to_outputs(m.h_ent, 1, out.entropy.data(), 1, 1, mb.cu_seqlens);
  }
  if (req.value) out.value.assign(m.h_val, m.h_val + N);
  if (req.logits && m.prog.logit_softcap != 0) {  // the final cap, as the CPU engine's logits have it
    const double c = m.prog.logit_softcap;
    for (float& z : out.logits) z = float(c * std::tanh(double(z) / c));
  }
  if (req.routed_experts) {
    out.routing_width = m.route_width;
    out.routed_experts.assign(m.h_route, m.h_route + N * m.route_width);
  }
  return out;
}

StepResult CudaEngine::train_step(std::span<const MicroBatch> mbs, const StepOptions& so,
                                  const LossFn& loss_fn) {
  return step(mbs, so, &loss_fn, nullptr);
}

StepResult CudaEngine::train_step(std::span<const MicroBatch> mbs, const StepOptions& so, const DeviceLoss& loss) {
  const OutputRequest& req = so.outputs;
  if (!req.logprob || req.entropy || req.value || req.processed_logprob || req.logprob_at_ids)
    throw std::invalid_argument("cuda engine: a loss on the device reads the logprob output alone");
  if (!loss.run) throw std::invalid_argument("cuda engine: a device loss without a function");
  if (loss.slots < 0) throw std::invalid_argument("cuda engine: a device loss with a negative slot count");
  return step(mbs, so, nullptr, &loss);
}

StepResult CudaEngine::step(std::span<const MicroBatch> mbs, const StepOptions& so, const LossFn* host_loss,
                            const DeviceLoss* dev) {
  Impl& m = *impl_;
  const OutputRequest& req = so.outputs;
  m.require_trainable("train_step");
  if (m.fp8) m.fp8->new_call(true);
  if (!req.logprob && !req.entropy && !req.value)
    throw std::invalid_argument("cuda engine: a train step needs logprob, entropy or value outputs");
  if (req.logits) throw std::invalid_argument("cuda engine: logits are a forward-only output");
  if (mbs.empty() && m.opt.dp == nullptr) throw std::invalid_argument("cuda engine: a train step needs micro-batches");
  int64_t biggest = 0;
  for (const MicroBatch& mb : mbs) biggest = std::max(biggest, mb.num_tokens());
  // A data-parallel rank without data only reduces: it needs no activations, only the pinned
  // staging a plan carves (the norm comes down through it).
  if (!mbs.empty()) m.plan(biggest, true);
  else if (m.planned_tokens == 0) m.plan(1, false);
  if (m.grads_stale && m.grad_overwrite_ok())
    m.begin_overwrite_step();
  else if (!m.grads_clear)
    zero_grad();
  m.grads_clear = false;
  m.release_units();
  struct Release {  // FSDP: the step's gathered units go with it (their weights are updated)
    Impl& m;
    ~Release() { m.release_units(false); }
  } release{m};
  if (m.fsdp()) m.open_root_grads();  // the root's gradients, summed over the micro-batches
  // FSDP: how many micro-batches the group runs (its owner's count, or asked here before any
  // unit's collective, so the ask itself meets on every rank).
  const int64_t group_mbs = !m.fsdp()                   ? 0
                            : so.group_microbatches > 0 ? so.group_microbatches
                                                        : m.group_count(int64_t(mbs.size()));
  StepResult r;
  // MoE auxiliary losses: normalised by the global counts (this step's when not given), as
  // the CPU engine; their values are summed on the device and read with the gradient norm.
  const MoeNormCounts moe_counts = moe_norm_counts(mbs, so);
  m.moe_tokens = moe_counts.tokens;
  m.moe_seqs = moe_counts.sequences;
  if (m.moe_layers > 0)
    check(cudaMemsetAsync(m.moe_stats(), 0, 3 * sizeof(double), m.stream), "memset");
  struct TrainFlag {  // the losses belong to train steps only, whatever leaves this scope
    bool& f;
    explicit TrainFlag(bool& b) : f(b) { f = true; }
    ~TrainFlag() { f = false; }
  } train_flag(m.moe_train);
  std::vector<float> lp, ent, dlp, dent, val, dval;
  // A loss on the device: one block for the token-aligned logprob and gradient, the loss
  // scalar, the kept slots and the inputs (uploaded now, once, from pinned staging).
  float *d_lp = nullptr, *d_dlp = nullptr, *d_loss = nullptr, *d_slots = nullptr, *d_inputs = nullptr;
  float* h_slots = nullptr;
  int32_t* batch_stage = nullptr;
  struct StageReset {  // forward() and friends stage in the shared buffers again after the step
    int32_t*& p;
    ~StageReset() { p = nullptr; }
  } stage_reset{m.batch_stage};
  if (dev != nullptr) {
    if (req.routed_experts || !req.replay_routing_field.empty())
      throw std::invalid_argument("cuda engine: a loss on the device does not take the MoE routing record or replay");
    const size_t n_in = dev->inputs.size(), n_slots = size_t(dev->slots);
    const size_t floats = 2 * size_t(std::max<int64_t>(biggest, 1)) + 64 + n_slots + n_in;
    size_t stage = 0;  // every micro-batch's ids, positions, targets and offsets (int32)
    for (const MicroBatch& mb : mbs) stage += size_t(3 * mb.num_tokens() + mb.num_sequences() + 1);
    const size_t pinned_bytes = (n_in + n_slots + stage) * 4;
    if (m.loss_block.size() < floats * 4) m.loss_block = cuda::DeviceBuffer(m.counters, floats * 4);
    if (m.loss_pinned.size() < pinned_bytes) m.loss_pinned = cuda::PinnedBuffer(pinned_bytes);
    float* base = m.loss_block.get<float>();
    d_lp = base;
    d_dlp = d_lp + std::max<int64_t>(biggest, 1);
    d_loss = d_dlp + std::max<int64_t>(biggest, 1);
    d_slots = d_loss + 64;  // the loss scalar has 256 bytes of its own
    d_inputs = d_slots + n_slots;
    float* h_in = m.loss_pinned.get<float>();
    h_slots = h_in + n_in;
    batch_stage = reinterpret_cast<int32_t*>(h_slots + n_slots);
    if (n_in > 0) {
      // The previous step's upload from this staging finished before its gradient-norm wait.
      std::memcpy(h_in, dev->inputs.data(), n_in * 4);
      check(cudaMemcpyAsync(d_inputs, h_in, n_in * 4, cudaMemcpyHostToDevice, m.stream), "upload");
    }
    if (n_slots > 0) check(cudaMemsetAsync(d_slots, 0, n_slots * 4, m.stream), "memset");
  }
  for (size_t i = 0; i < mbs.size(); ++i) {
    const MicroBatch& mb = mbs[i];
    const int64_t N = mb.num_tokens();
    m.batch_stage = batch_stage;
    m.forward(mb, req, true);
    if (batch_stage != nullptr) batch_stage += 3 * N + mb.num_sequences() + 1;
    if (dev != nullptr) {
      // The loss runs on the device: outputs token-aligned there, its gradient shifted back.
      const int64_t S = int64_t(mb.cu_seqlens.size()) - 1;
      cuda::shift_to_outputs_device(m.lp, d_lp, m.cu, S, N, m.stream);
      check(cudaMemsetAsync(d_dlp, 0, size_t(N) * 4, m.stream), "memset");
      check(cudaMemsetAsync(d_loss, 0, 4, m.stream), "memset");
      DeviceLossViews v;
      v.logprob = d_lp;
      v.dlogprob = d_dlp;
      v.loss = d_loss;
      v.cu_seqlens = m.cu;
      v.inputs = d_inputs;
      v.stream = m.stream;
      const int64_t slots = dev->slots;
      v.keep = [&m, d_slots, slots](const float* value, int64_t slot) {
        if (slot < 0 || slot >= slots)
          throw std::out_of_range("cuda engine: device loss slot " + std::to_string(slot) + " outside [0, " +
                                  std::to_string(slots) + ")");
        check(cudaMemcpyAsync(d_slots + slot, value, 4, cudaMemcpyDeviceToDevice, m.stream), "keep");
      };
      const LossContext ctx{&mb, int64_t(i), int64_t(mbs.size()), so.global_tokens, so.global_sequences};
      dev->run(ctx, v);
      cuda::shift_to_kernel_device(d_dlp, m.dlp, m.cu, S, N, m.stream);
      m.backward(mb, req);
      r.tokens += N;
      continue;
    }
    if (req.logprob)
      check(cudaMemcpyAsync(m.h_lp, m.lp, size_t(N) * 4, cudaMemcpyDeviceToHost, m.stream), "download");
    if (req.entropy)
      check(cudaMemcpyAsync(m.h_ent, m.ent, size_t(N) * 4, cudaMemcpyDeviceToHost, m.stream), "download");
    if (req.value)
      check(cudaMemcpyAsync(m.h_val, m.val, size_t(N) * 4, cudaMemcpyDeviceToHost, m.stream), "download");
    if (m.record_active)  // the routing record comes with the outputs' wait
      check(cudaMemcpyAsync(m.h_route, m.route, size_t(N * m.route_width) * 4,
                            cudaMemcpyDeviceToHost, m.stream), "download");
    m.sync();  // the callback runs on the host
    if (req.routed_experts)
      r.routed_experts.emplace_back(m.h_route, m.h_route + (m.record_active ? N * m.route_width : 0));
    OutputViews ov;
    OutputGrads og;
    if (req.logprob) {
      lp.assign(size_t(N), 0.f);
      dlp.assign(size_t(N), 0.f);
      shift_to_outputs(m.h_lp, 1, lp.data(), 1, 1, mb.cu_seqlens);
      ov.logprob = lp;
      og.logprob = dlp;
    }
    if (req.entropy) {
      ent.assign(size_t(N), 0.f);
      dent.assign(size_t(N), 0.f);
      shift_to_outputs(m.h_ent, 1, ent.data(), 1, 1, mb.cu_seqlens);
      ov.entropy = ent;
      og.entropy = dent;
    }
    if (req.value) {  // already in output alignment: position t's score
      val.assign(m.h_val, m.h_val + N);
      dval.assign(size_t(N), 0.f);
      ov.value = val;
      og.value = dval;
    }
    LossContext ctx{&mb, int64_t(i), int64_t(mbs.size()), so.global_tokens, so.global_sequences};
    const LossResult lr = (*host_loss)(ctx, ov, og);
    r.loss += lr.loss;
    accumulate_metrics(r.metrics, lr.metrics);
    // The previous micro-batch's uploads from these buffers finished before the sync above.
    if (req.logprob) {
      shift_to_kernel(dlp.data(), 1, m.h_dlp, 1, 1, mb.cu_seqlens);
      check(cudaMemcpyAsync(m.dlp, m.h_dlp, size_t(N) * 4, cudaMemcpyHostToDevice, m.stream), "upload");
    } else {
      check(cudaMemsetAsync(m.dlp, 0, size_t(N) * 4, m.stream), "memset");
    }
    if (req.entropy) {
      shift_to_kernel(dent.data(), 1, m.h_dent, 1, 1, mb.cu_seqlens);
      check(cudaMemcpyAsync(m.dent, m.h_dent, size_t(N) * 4, cudaMemcpyHostToDevice, m.stream), "upload");
    }
    if (req.value) {
      std::memcpy(m.h_dval, dval.data(), size_t(N) * 4);
      check(cudaMemcpyAsync(m.dval, m.h_dval, size_t(N) * 4, cudaMemcpyHostToDevice, m.stream), "upload");
    }
    m.backward(mb, req);
    r.tokens += N;
  }
  // FSDP: a rank with fewer micro-batches than its peers meets their per-unit collectives.
  for (int64_t k = int64_t(mbs.size()); k < group_mbs; ++k) m.idle_microbatch(true);
  m.end_overwrite_backward();
  m.tp_sync_grads();  // before the data-parallel reduction: the q/k norms' summed over the tp group
  if (m.opt.dp != nullptr) m.sync_gradients();
  double moe_vals[3] = {0, 0, 0};  // aux, z, max load: downloaded before grad_norm's wait
  if (m.moe_layers > 0)
    check(cudaMemcpyAsync(m.h_scalar + 4, m.moe_stats(), sizeof(moe_vals), cudaMemcpyDeviceToHost,
                          m.stream), "download");
  if (dev != nullptr && dev->slots > 0)  // the device loss's scalars come down with the norm
    check(cudaMemcpyAsync(h_slots, d_slots, size_t(dev->slots) * 4, cudaMemcpyDeviceToHost, m.stream), "download");
  r.grad_norm = m.grad_norm();
  if (dev != nullptr && dev->kept != nullptr) dev->kept->assign(h_slots, h_slots + dev->slots);
  if (m.moe_layers > 0) {
    std::memcpy(moe_vals, m.h_scalar + 4, sizeof(moe_vals));
    const MoeOptions& mo = m.opt.moe;
    if (mo.aux_loss_coef != 0 && mo.load_balancing != MoeOptions::LoadBalancing::none)
      r.metrics.emplace_back("moe/aux_loss", moe_vals[0]);
    if (mo.z_loss_coef != 0) r.metrics.emplace_back("moe/z_loss", moe_vals[1]);
    r.metrics.emplace_back("moe/max_expert_load", moe_vals[2]);
  }
  const double max_norm = m.opt.optimizer.max_grad_norm;
  r.clip_coef = max_norm > 0 ? std::min(1.0, max_norm / (r.grad_norm + 1e-6)) : 1.0;
  if (!std::isfinite(r.grad_norm)) {
    r.skipped = true;  // never apply a non-finite update
  } else if (so.apply_optimizer) {
    m.optimizer_step(so, r.clip_coef);
  }
  r.step = m.steps;
  return r;
}

bool cuda_engine_available(std::string* why, int device) {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count == 0) {
    if (why) *why = std::string("no CUDA device: ") + (e != cudaSuccess ? cudaGetErrorString(e) : "none visible");
    return false;
  }
  if (device < 0 || device >= count) {
    if (why) *why = "CUDA device " + std::to_string(device) + " does not exist (" + std::to_string(count) + " visible)";
    return false;
  }
  cudaDeviceProp p{};
  if (cudaGetDeviceProperties(&p, device) != cudaSuccess || p.major != 9) {
    if (why) *why = "the CUDA engine is built for sm_90a; device " + std::to_string(device) + " is " + p.name;
    return false;
  }
  return true;
}

}  // namespace rlh::engine
