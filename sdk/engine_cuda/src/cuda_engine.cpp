// The CUDA engine: state, memory plan, forward, backward and the optimizer step, one launcher
// call per line as in the CPU engine (sdk/engine/src/forward.cpp, backward.cpp), whose math and
// output alignment it follows; the difference is where things live and in which precision
// (cuda_engine.hpp).
//
// Dimension letters: N tokens of the micro-batch, S sequences, C hidden size, V vocabulary,
// L layers, Hq / Hkv heads, D head dim, F MLP width, Wqkv = (Hq + 2 Hkv) D, R rotary dims.
#include "rlhost/engine_cuda/cuda_engine.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>

#include "cuda_engine_impl.hpp"

namespace rlh::engine {

using sdk::ParamRole;
using cuda::check;
using cuda::numel;
using cuda::unsupported;
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
  dev.device = opt.device;
  dev.sm_count = p.multiProcessorCount;
  dev.cc_major = p.major;
  dev.cc_minor = p.minor;
  dev.smem_optin = p.sharedMemPerBlockOptin;
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  gemm_engine = kc::gemm_engine_create(dev);
  arena = std::make_unique<cuda::Arena>(counters, stream);
  carve_params();
  if (R > 0) {
    const std::vector<double> f = sdk::rope_inv_freq(desc.rope, R);
    std::vector<float> f32(f.begin(), f.end());
    inv_freq = cuda::DeviceBuffer(counters, f32.size() * sizeof(float));
    check(cudaMemcpy(inv_freq.get(), f32.data(), f32.size() * sizeof(float),
                     cudaMemcpyHostToDevice), "inv_freq upload");
  }
  scalars = cuda::DeviceBuffer(counters, 256);
  if (opt.max_tokens > 0) plan(opt.max_tokens, opt.trainable);
}

CudaEngine::Impl::~Impl() {
  if (stream) cudaStreamSynchronize(stream);
  if (gemm_engine) kc::gemm_engine_destroy(gemm_engine);
  arena.reset();
  if (stream) cudaStreamDestroy(stream);
}

// What this path executes; the same description fields as the CPU engine's model.cpp.
void CudaEngine::Impl::describe() {
  C = desc.hidden_size;
  V = desc.vocab_size;
  L = desc.num_layers;
  if (C <= 0 || V <= 0 || L < 0 || int64_t(desc.layers.size()) != L)
    throw std::invalid_argument("cuda engine: inconsistent model description");
  if (desc.final_norm.kind != sdk::NormKind::rmsnorm) unsupported("final norm kind");
  for (const sdk::LayerDesc& ld : desc.layers) {
    const auto& a = ld.attention;
    const std::string at = "layer " + std::to_string(ld.index) + ": ";
    if (a.kind != sdk::AttentionKind::gqa && a.kind != sdk::AttentionKind::mla)
      unsupported(at + "attention kind " + sdk::to_string(a.kind));
    if (ld.mlp.kind != sdk::MlpKind::dense && ld.mlp.kind != sdk::MlpKind::moe)
      unsupported(at + "MLP kind " + sdk::to_string(ld.mlp.kind));
    if (ld.mlp.hidden_act != "silu") unsupported(at + "hidden_act " + ld.mlp.hidden_act);
    if (ld.attn_norm.kind != sdk::NormKind::rmsnorm || ld.mlp_norm.kind != sdk::NormKind::rmsnorm)
      unsupported(at + "norm kind");
    if (a.num_heads <= 0 || a.num_kv_heads <= 0 || a.num_heads % a.num_kv_heads || a.head_dim <= 0)
      throw std::invalid_argument("cuda engine: " + at + "bad head counts");
    LayerShape s;
    static_cast<LayerBasics&>(s) = layer_basics(desc, ld);
    s.Wqkv = (s.Hq + 2 * s.Hkv) * s.D;
    if (a.kind == sdk::AttentionKind::mla) describe_mla_layer(ld, s);  // sets D, Wqkv (mla_layer.cpp)
    if (ld.mlp.kind == sdk::MlpKind::moe) describe_moe_layer(ld, s);  // sets F = 0
    shapes.push_back(s);
    maxW = std::max(maxW, s.Wqkv);
    maxHD = std::max(maxHD, s.Hq * s.D);
    maxF = std::max(maxF, s.F);
    maxQK = std::max(maxQK, (s.Hq + s.Hkv) * s.D);
    maxH = std::max(maxH, s.Hq);
  }
  if (desc.rope.kind != sdk::RopeKind::none && L > 0) {
    if (desc.rope.kind == sdk::RopeKind::dynamic || desc.rope.kind == sdk::RopeKind::longrope)
      unsupported(std::string("RoPE kind ") + sdk::to_string(desc.rope.kind) +
                  " (its frequencies depend on the sequence length)");
    R = desc.rope.rotary_dim > 0 ? desc.rope.rotary_dim : shapes[0].D;
    for (const LayerShape& s : shapes)
      if (s.use_rope && R > s.D) throw std::invalid_argument("cuda engine: rotary dims exceed head_dim");
    rope_scale = sdk::rope_attention_scaling(desc.rope);
    rope_interleaved = desc.rope.layout == sdk::RopeLayout::interleaved;
  }
}

// Offsets of every tensor in one flat buffer; groups start 64 elements apart (256-byte aligned
// in fp32, 128 in bf16, as cuBLASLt and the vector paths want).
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
      if (p->shape != std::vector<int64_t>{s.E, s.Fe, C})
        throw std::invalid_argument("cuda engine: parameter " + p->name + " has an unexpected shape");
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
  lo.assign(size_t(L), LayerOffsets{});
  for (int64_t l = 0; l < L; ++l) {
    LayerOffsets& o = lo[size_t(l)];
    const LayerShape& s = shapes[size_t(l)];
    gu_base = -1;
    for (ParamRole r : layer_param_order()) {  // the CPU engine's (engine.hpp)
      const int64_t off = put(l, r);
      switch (r) {
        case ParamRole::attn_norm: o.attn_norm = off; break;
        case ParamRole::q: o.wqkv = off; break;
        case ParamRole::k:  // (an MLA layer has no k and v: its keys and values come from kv_b)
          if (!s.mla && off != o.wqkv + s.Hq * s.D * C)
            throw std::logic_error("cuda engine: q/k not adjacent");
          break;
        case ParamRole::v:
          if (!s.mla && off != o.wqkv + (s.Hq + s.Hkv) * s.D * C)
            throw std::logic_error("cuda engine: k/v not adjacent");
          break;
        case ParamRole::q_bias: o.bq = off; break;
        case ParamRole::k_bias: o.bk = off; break;
        case ParamRole::v_bias: o.bv = off; break;
        case ParamRole::q_norm: o.q_norm = off; break;
        case ParamRole::k_norm: o.k_norm = off; break;
        case ParamRole::o: o.wo = off; break;
        case ParamRole::o_bias: o.bo = off; break;
        case ParamRole::mlp_norm: o.mlp_norm = off; break;
        case ParamRole::gate: o.wgu = off; break;
        case ParamRole::up:
          if (off != o.wgu + s.F * C) throw std::logic_error("cuda engine: gate/up not adjacent");
          break;
        case ParamRole::gate_bias: o.bgate = off; break;
        case ParamRole::up_bias: o.bup = off; break;
        case ParamRole::down: o.wdown = off; break;
        case ParamRole::down_bias: o.bdown = off; break;
        case ParamRole::router: o.router = off; break;
        case ParamRole::router_bias: o.router_b = off; break;
        case ParamRole::expert_score_bias: o.score_bias = off; break;
        case ParamRole::expert_gate: o.we_gu = off; break;
        case ParamRole::expert_up:
          if (off >= 0 && off != o.we_gu + s.Fe * C)
            throw std::logic_error("cuda engine: expert gate/up not interleaved");
          break;
        case ParamRole::expert_down: o.we_down = off; break;
        case ParamRole::shared_expert_gate_proj: o.ws_gu = off; break;
        case ParamRole::shared_expert_up:
          if (off >= 0 && off != o.ws_gu + s.Fs * C)
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
    const bool attn_ok =
        s.mla ? o.attn_norm >= 0 && o.wo >= 0 && o.mlp_norm >= 0 && o.kv_a >= 0 &&
                    o.kv_a_norm >= 0 && o.kv_b >= 0 &&
                    (s.rq > 0 ? o.q_a >= 0 && o.q_a_norm >= 0 && o.q_b >= 0 : o.wqkv >= 0)
              : o.attn_norm >= 0 && o.wqkv >= 0 && o.wo >= 0 && o.mlp_norm >= 0 &&
                    (!s.qk_norm || (o.q_norm >= 0 && o.k_norm >= 0));
    const bool mlp_ok =
        s.moe ? o.router >= 0 && o.we_gu >= 0 && o.we_down >= 0 &&
                    (!s.router_bias || o.router_b >= 0) && (!s.score_bias || o.score_bias >= 0) &&
                    (s.Fs == 0 || (o.ws_gu >= 0 && o.ws_down >= 0)) &&
                    (!s.shared_gate || o.ws_gate >= 0)
              : o.wgu >= 0 && o.wdown >= 0;
    if (!attn_ok || !mlp_ok)
      throw std::invalid_argument("cuda engine: layer " + std::to_string(l) + " misses a parameter");
    if (s.mla) check_mla_params(l);
  }
  off_embed = put(-1, ParamRole::embed);
  off_final_norm = put(-1, ParamRole::final_norm);
  off_head = desc.tie_word_embeddings ? off_embed : put(-1, ParamRole::lm_head);
  if (off_embed < 0 || off_final_norm < 0 || off_head < 0)
    throw std::invalid_argument("cuda engine: the model misses its embedding, final norm or head");
  for (size_t i = 0; i < n; ++i)
    if (place[i].off < 0)
      unsupported("parameter " + desc.params[i].name + " (role " +
                  sdk::to_string(desc.params[i].role) + ")");
  total = (at + 63) / 64 * 64;
  const size_t f32 = size_t(total) * sizeof(float);
  master = cuda::DeviceBuffer(counters, f32);
  if (opt.trainable) {
    grads = cuda::DeviceBuffer(counters, f32);
    adam_m = cuda::DeviceBuffer(counters, f32);
    adam_v = cuda::DeviceBuffer(counters, f32);
  }
  w16 = cuda::DeviceBuffer(counters, size_t(total) * sizeof(bf16));
  for (cuda::DeviceBuffer* b : {&master, &grads, &adam_m, &adam_v})
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

// One tensor between host memory (desc shape, contiguous) and its place in a flat buffer.
void CudaEngine::Impl::upload(size_t i, float* base, const float* src) {
  const cuda::ParamPlace& pl = place[i];
  const size_t row = size_t(pl.piece) * sizeof(float);
  if (pl.pieces == 1)
    check(cudaMemcpyAsync(base + pl.off, src, row, cudaMemcpyHostToDevice, stream), "upload");
  else
    check(cudaMemcpy2DAsync(base + pl.off, size_t(pl.stride) * sizeof(float), src, row, row,
                            size_t(pl.pieces), cudaMemcpyHostToDevice, stream), "upload");
}

void CudaEngine::Impl::download_one(size_t i, const float* base, float* dst) {
  const cuda::ParamPlace& pl = place[i];
  const size_t row = size_t(pl.piece) * sizeof(float);
  if (pl.pieces == 1)
    check(cudaMemcpy(dst, base + pl.off, row, cudaMemcpyDeviceToHost), "download");
  else
    check(cudaMemcpy2D(dst, row, base + pl.off, size_t(pl.stride) * sizeof(float), row,
                       size_t(pl.pieces), cudaMemcpyDeviceToHost), "download");
}

// One activation block for micro-batches of up to N tokens; training keeps every layer's set,
// forward-only one set and two residual buffers.
void CudaEngine::Impl::plan(int64_t N, bool train) {
  if (N <= planned_tokens && (planned_train || !train)) return;
  N = std::max(N, planned_tokens);
  train = train || planned_train;
  const bool full = train && opt.recompute == Recompute::full;
  const bool selective = train && opt.recompute == Recompute::selective;
  auto carve = [&](char* base) {
    cuda::Carver c{base};
    // Per-layer sets for training without full recompute; otherwise one set for all layers,
    // sized for the widest.
    const bool per_layer = train && !full;
    const int64_t sets = per_layer ? L : 1;
    acts.assign(size_t(sets), LayerActs{});
    acts_per_layer = per_layer;
    xs.assign(size_t(train ? L + 1 : 2), nullptr);
    for (bf16*& x : xs) x = c.take<bf16>(N * C);
    xr = full ? c.take<bf16>(N * C) : nullptr;
    // The head's logits from forward to backward, when they fit the budget (rows padded to 16
    // bytes for the GEMM's C).
    ld_head_cache = (V + 3) / 4 * 4;
    const bool keep = train && N * ld_head_cache * 4 <= opt.head_logits_cache_bytes;
    head_cache = keep ? c.take<float>(N * ld_head_cache) : nullptr;
    bool any_qk_norm = false;
    for (const LayerShape& s : shapes) any_qk_norm = any_qk_norm || s.qk_norm;
    qk_in = any_qk_norm ? c.take<bf16>(N * maxQK) : nullptr;
    for (int64_t l = 0; l < sets; ++l) {
      const LayerShape& s = shapes[size_t(l)];
      LayerActs& a = acts[size_t(l)];
      const int64_t W = per_layer ? s.Wqkv : maxW, HD = per_layer ? s.Hq * s.D : maxHD,
                    F = per_layer ? s.F : maxF, QK = per_layer ? (s.Hq + s.Hkv) * s.D : maxQK,
                    H = per_layer ? s.Hq : maxH;
      if (!selective) a.xn1 = c.take<bf16>(N * C);
      a.rstd1 = c.take<float>(N);
      a.qkv = c.take<bf16>(N * W);
      if (per_layer ? s.qk_norm : true) {
        a.qk = c.take<bf16>(N * QK);
        a.rstd_q = c.take<float>(H * N);
        a.rstd_k = c.take<float>(H * N);
      }
      a.att = c.take<bf16>(N * HD);
      a.lse = c.take<float>(H * N);
      a.h = c.take<bf16>(N * C);
      if (!selective) a.xn2 = c.take<bf16>(N * C);
      a.rstd2 = c.take<float>(N);
      a.gu = c.take<bf16>(N * 2 * F);
      if (!selective) a.a = c.take<bf16>(N * F);
    }
    // (an MoE layer's F is 0: its gu and a are empty; its MLP block keeps MoeActs instead)
    carve_moe(c, N, per_layer, train);  // MoE layers' routed activations and scratch
    carve_mla(c, N, per_layer, train);  // MLA layers' latents and scratch
    if (selective) {  // what backward recomputes, one layer at a time
      bf16* xn1 = c.take<bf16>(N * C);
      bf16* xn2 = c.take<bf16>(N * C);
      bf16* act = c.take<bf16>(N * maxF);
      for (LayerActs& a : acts) {
        a.xn1 = xn1;
        a.xn2 = xn2;
        a.a = act;
      }
    }
    xn = c.take<bf16>(N * C);
    rstd = c.take<float>(N);
    lp = c.take<float>(N);
    lse = c.take<float>(N);
    ent = c.take<float>(N);
    dlp = c.take<float>(N);
    dent = c.take<float>(N);
    ids = c.take<int32_t>(N);
    pos = c.take<int32_t>(N);
    target = c.take<int32_t>(N);
    cu = c.take<int32_t>(N + 1);
    err = c.take<int>(1);
    route = c.take<int32_t>(N * route_width);
    if (train) {
      dres = c.take<bf16>(N * C);
      dxn = c.take<bf16>(N * C);
      dqkv = c.take<bf16>(N * maxW);
      dqk = c.take<bf16>(N * maxQK);
      datt = c.take<bf16>(N * maxHD);
      dgu = c.take<bf16>(N * 2 * maxF);
      da = c.take<bf16>(N * maxF);
    } else {
      dres = dxn = dqkv = dqk = datt = dgu = da = nullptr;
    }
    return c.at;
  };
  const size_t bytes = carve(nullptr);
  check(cudaStreamSynchronize(stream), "re-plan");  // the old block may still be in use
  ++counters.syncs;
  act_block = cuda::DeviceBuffer();
  act_block = cuda::DeviceBuffer(counters, bytes);
  carve(act_block.get<char>());
  check(cudaMemsetAsync(err, 0, sizeof(int), stream), "memset");
  if (moe_layers > 0) {  // the shared expert's gate as a one-expert route: rows n, expert 0
    cuda::iota_i32(moe_x.srow, N, stream);
    check(cudaMemsetAsync(moe_x.szero, 0, size_t(N) * 4, stream), "memset");
  }
  // pinned staging: 3 x [N] + [N+1] int32, 4 x [N] float, one scalar pair
  pinned = cuda::PinnedBuffer(size_t(4 * N + 1) * 4 + size_t(4 * N) * 4 + 64 +
                              size_t(N * route_width) * 4);
  h_ids = pinned.get<int32_t>();
  h_pos = h_ids + N;
  h_target = h_pos + N;
  h_cu = h_target + N;
  h_lp = reinterpret_cast<float*>(h_cu + N + 1);
  h_ent = h_lp + N;
  h_dlp = h_ent + N;
  h_dent = h_dlp + N;
  h_scalar = h_dent + N;
  h_route = reinterpret_cast<int32_t*>(h_scalar + 16);  // after the 64 scalar bytes
  planned_tokens = N;
  planned_train = train;
}

// ---------------------------------------------------------------------------------------------
// Batches and alignment (NeMo-RL's: output t is about token t; kernel row t predicts t+1)

void CudaEngine::Impl::prepare_batch(const MicroBatch& mb) {
  const int64_t N = mb.num_tokens(), S = mb.num_sequences();
  if (S < 1 || N == 0 || mb.cu_seqlens[0] != 0 || mb.cu_seqlens[size_t(S)] != N)
    throw std::invalid_argument(
        "cuda engine: a micro-batch needs tokens and cu_seqlens running from 0 to their number");
  for (int64_t s = 0; s < S; ++s) {
    const int32_t b = mb.cu_seqlens[size_t(s)], e = mb.cu_seqlens[size_t(s) + 1];
    if (e < b) throw std::invalid_argument("cuda engine: cu_seqlens must not decrease");
    for (int32_t t = b; t < e; ++t) {
      const int32_t id = mb.input_ids[size_t(t)];
      if (id < 0 || id >= V)
        throw std::invalid_argument("cuda engine: token id " + std::to_string(id) +
                                    " outside the vocabulary");
      h_pos[t] = t - b;
      h_target[t] = t + 1 < e ? mb.input_ids[size_t(t) + 1] : -1;
    }
  }
  std::memcpy(h_ids, mb.input_ids.data(), size_t(N) * 4);
  std::memcpy(h_cu, mb.cu_seqlens.data(), size_t(S + 1) * 4);
  // from pinned staging: asynchronous, ordered before the kernels that read them
  check(cudaMemcpyAsync(ids, h_ids, size_t(N) * 4, cudaMemcpyHostToDevice, stream), "upload");
  check(cudaMemcpyAsync(pos, h_pos, size_t(N) * 4, cudaMemcpyHostToDevice, stream), "upload");
  check(cudaMemcpyAsync(target, h_target, size_t(N) * 4, cudaMemcpyHostToDevice, stream), "upload");
  check(cudaMemcpyAsync(cu, h_cu, size_t(S + 1) * 4, cudaMemcpyHostToDevice, stream), "upload");
}


// ---------------------------------------------------------------------------------------------
// Forward

void CudaEngine::Impl::rope(bf16* x, int64_t ld, int64_t H, int64_t D, int64_t N, bool inverse) {
  kc::rope(kc::DType::bf16, x, ld, x, ld, pos, inv_freq.get<float>(), N, H, D, R, rope_scale,
           rope_interleaved, inverse, stream);
}

void CudaEngine::Impl::forward_layer(int64_t l, const MicroBatch& mb, LayerActs& a, bf16* x_out,
                                     bool recompute) {
  const LayerShape& s = shapes[size_t(l)];
  const LayerOffsets& p = lo[size_t(l)];
  const int64_t N = mb.num_tokens(), S = mb.num_sequences();
  const int64_t Hq = s.Hq, Hkv = s.Hkv, D = s.D, Wqkv = s.Wqkv, F = s.F;
  const auto bf = kc::DType::bf16;
  bf16* q = a.qkv;
  bf16* k = a.qkv + Hq * D;
  bf16* v = a.qkv + (Hq + Hkv) * D;
  int64_t ldq = Wqkv, ldk = Wqkv;

  kc::rmsnorm_fwd(bf, a.xn1, C, {a.rstd1, false}, a.x, C, w(p.attn_norm), N, C, s.eps_attn,
                  s.off_attn, stream);                                                  // xn1
  if (s.mla) {
    forward_mla(l, mb, a);  // h = x + o(mla(xn1)) (mla_layer.cpp)
  } else {
  gemm(false, true, N, Wqkv, C, a.xn1, C, w(p.wqkv), C, 0, a.qkv, Wqkv, false);        // qkv
  if (p.bq >= 0) kc::bias_add_fwd(bf, q, Wqkv, w(p.bq), N, Hq * D, stream);
  if (p.bk >= 0) kc::bias_add_fwd(bf, k, Wqkv, w(p.bk), N, Hkv * D, stream);
  if (p.bv >= 0) kc::bias_add_fwd(bf, v, Wqkv, w(p.bv), N, Hkv * D, stream);
  if (s.qk_norm) {  // per head over D: each of q, k as N x H rows of D, one launch each
    pack_qk(s, a.qkv, N);
    const bf16 *qin = qk_in, *kin = qk_in + N * Hq * D;
    q = a.qk;
    k = a.qk + N * Hq * D;
    kc::rmsnorm_fwd(bf, q, D, {a.rstd_q, false}, qin, D, w(p.q_norm), N * Hq, D, s.eps_attn, 0.f,
                    stream);
    kc::rmsnorm_fwd(bf, k, D, {a.rstd_k, false}, kin, D, w(p.k_norm), N * Hkv, D, s.eps_attn, 0.f,
                    stream);
    ldq = Hq * D;
    ldk = Hkv * D;
  }
  if (s.use_rope) {
    rope(q, ldq, Hq, D, N, false);
    rope(k, ldk, Hkv, D, N, false);
  }
  const kc::AttnArgs at = attn_args(s, a, N, S);
  kc::attention_fwd(at, dev, stream);                                                   // att
  gemm(false, true, N, C, Hq * D, a.att, Hq * D, w(p.wo), Hq * D, 0, a.h, C, false);    // o
  if (p.bo >= 0) kc::bias_add_fwd(bf, a.h, C, w(p.bo), N, C, stream);
  kc::add_fwd(bf, a.h, a.x, a.h, N * C, stream);                                       // h
  }
  kc::rmsnorm_fwd(bf, a.xn2, C, {a.rstd2, false}, a.h, C, w(p.mlp_norm), N, C, s.eps_mlp,
                  s.off_mlp, stream);                                                  // xn2
  if (s.moe) {  // mixture of experts (moe_layer.cpp)
    forward_moe(l, mb, a, x_out, recompute);
    return;
  }
  gemm(false, true, N, 2 * F, C, a.xn2, C, w(p.wgu), C, 0, a.gu, 2 * F, false);        // gu
  if (p.bgate >= 0) kc::bias_add_fwd(bf, a.gu, 2 * F, w(p.bgate), N, F, stream);
  if (p.bup >= 0) kc::bias_add_fwd(bf, a.gu + F, 2 * F, w(p.bup), N, F, stream);
  kc::swiglu_fwd(bf, a.a, F, a.gu, 2 * F, a.gu + F, 2 * F, N, F, stream);              // a
  gemm(false, true, N, C, F, a.a, F, w(p.wdown), F, 0, x_out, C, false);               // down
  if (p.bdown >= 0) kc::bias_add_fwd(bf, x_out, C, w(p.bdown), N, C, stream);
  kc::add_fwd(bf, x_out, a.h, x_out, N * C, stream);                                   // out
}

// A layer's attention operands as the forward leaves them: q|k roped in qkv, or normed and
// roped in qk (Qwen3's q/k norms); v in qkv; output and lse in the layer's activations.
kc::AttnArgs CudaEngine::Impl::attn_args(const LayerShape& s, const LayerActs& a, int64_t N,
                                         int64_t S) const {
  kc::AttnArgs at;
  at.t = kc::DType::bf16;
  at.N = N;
  at.S = S;
  at.Hq = s.Hq;
  at.Hkv = s.Hkv;
  at.Dk = at.Dv = s.D;
  at.window = s.window;
  at.scale = s.scale;
  at.cu = cu;
  at.q = s.qk_norm ? a.qk : a.qkv;
  at.ldq = s.qk_norm ? s.Hq * s.D : s.Wqkv;
  at.k = s.qk_norm ? a.qk + N * s.Hq * s.D : a.qkv + s.Hq * s.D;
  at.ldk = s.qk_norm ? s.Hkv * s.D : s.Wqkv;
  at.v = a.qkv + (s.Hq + s.Hkv) * s.D;
  at.ldv = s.Wqkv;
  at.o = a.att;
  at.ldo = s.Hq * s.D;
  at.lse = {a.lse, false};
  return at;
}

kc::LogprobArgs CudaEngine::Impl::head_args(const OutputRequest& req, int64_t N, bool cache) const {
  kc::LogprobArgs h;
  h.t = kc::DType::bf16;
  h.N = N;
  h.C = C;
  h.V = V;
  h.K = 1;
  h.h = xn;
  h.W = w(off_head);
  h.target = target;
  h.temperature = req.temperature;
  // Wide tiles: the head's GEMMs run at their best from about 512 MiB of fp32 logits per tile
  // (measured on the H200: +4 % on a 1B training step over 32 MiB).
  h.chunk_bytes = opt.logprob_chunk_bytes > 0 ? opt.logprob_chunk_bytes : int64_t(512) << 20;
  if (cache && head_cache != nullptr) {
    h.logits_cache = head_cache;
    h.ld_cache = ld_head_cache;
  }
  h.logprob = {lp, false};
  h.lse = {lse, false};
  if (req.entropy) h.entropy = {ent, false};
  h.err = err;
  return h;
}

void CudaEngine::Impl::forward(const MicroBatch& mb, const OutputRequest& req, bool train) {
  if (req.processed_logprob) unsupported("processed (top-k/top-p) logprobs");
  if (req.logprob_at_ids) unsupported("logprob_at_ids");
  if (!(req.temperature > 0)) throw std::invalid_argument("cuda engine: temperature must be > 0");
  const int64_t N = mb.num_tokens();
  if (mb.cu_seqlens.empty() || N == 0) throw std::invalid_argument("cuda engine: empty micro-batch");
  plan(N, train);
  prepare_batch(mb);
  prepare_routing(mb, req);
  // A training plan keeps every layer's input (a forward-only call uses it as it is); a
  // forward-only plan has two residual buffers in turn.
  const bool keep_inputs = planned_train;
  kc::embedding_fwd(kc::DType::bf16, xs[0], ids, w(off_embed), N, C, V, err, stream);
  for (int64_t l = 0; l < L; ++l) {
    LayerActs& a = acts[acts_per_layer ? size_t(l) : 0];
    a.x = xs[keep_inputs ? size_t(l) : size_t(l % 2)];
    forward_layer(l, mb, a, xs[keep_inputs ? size_t(l + 1) : size_t((l + 1) % 2)], false);
  }
  bf16* xL = xs[keep_inputs ? size_t(L) : size_t(L % 2)];
  kc::rmsnorm_fwd(kc::DType::bf16, xn, C, {rstd, false}, xL, C, w(off_final_norm), N, C,
                  float(desc.final_norm.eps), float(desc.final_norm.weight_offset), stream);
  if (req.logprob || req.entropy)
    kc::linear_logprob_fwd(gemm_engine, head_args(req, N, train), ws(), stream);
}

// ---------------------------------------------------------------------------------------------
// Backward (dres: d loss / d residual stream, from the head down to the embedding)

void CudaEngine::Impl::backward_layer(int64_t l, const MicroBatch& mb, LayerActs& a) {
  const LayerShape& s = shapes[size_t(l)];
  const LayerOffsets& p = lo[size_t(l)];
  const int64_t N = mb.num_tokens(), S = mb.num_sequences();
  const int64_t Hq = s.Hq, Hkv = s.Hkv, D = s.D, Wqkv = s.Wqkv, F = s.F;
  const auto bf = kc::DType::bf16;
  auto& ws_ = *arena;

  // MLP: out = h + down(swiglu(gate, up)(mlp_norm(h))), or the MoE block (moe_layer.cpp)
  if (s.moe) {
    backward_moe(l, mb, a);
  } else {
  if (p.bdown >= 0) kc::bias_bwd(bf, {g(p.bdown), false}, dres, C, N, C, ws_.rewind(), stream);
  gemm(false, false, N, F, C, dres, C, w(p.wdown), F, 0, da, F, false);                 // da
  gemm(true, false, C, F, N, dres, C, a.a, F, 1, g(p.wdown), F, true);                  // dW_down
  kc::swiglu_bwd(bf, dgu, 2 * F, dgu + F, 2 * F, da, F, a.gu, 2 * F, a.gu + F, 2 * F, N, F,
                 stream);                                                               // dgu
  if (p.bgate >= 0) kc::bias_bwd(bf, {g(p.bgate), false}, dgu, 2 * F, N, F, ws_.rewind(), stream);
  if (p.bup >= 0) kc::bias_bwd(bf, {g(p.bup), false}, dgu + F, 2 * F, N, F, ws_.rewind(), stream);
  gemm(false, false, N, C, 2 * F, dgu, 2 * F, w(p.wgu), C, 0, dxn, C, false);           // dxn2
  gemm(true, false, 2 * F, C, N, dgu, 2 * F, a.xn2, C, 1, g(p.wgu), C, true);           // dW_gu
  kc::rmsnorm_bwd(bf, dres, C, {g(p.mlp_norm), false}, dxn, C, a.h, C, w(p.mlp_norm),
                  {a.rstd2, false}, N, C, s.off_mlp, true, ws_.rewind(), stream);        // dres = dh
  }

  if (s.mla) {  // multi-head latent attention (mla_layer.cpp)
    backward_mla(l, mb, a);
    return;
  }
  // Attention: h = x + o_proj(attention(rope(qk_norm(qkv(attn_norm(x))))))
  if (p.bo >= 0) kc::bias_bwd(bf, {g(p.bo), false}, dres, C, N, C, ws_.rewind(), stream);
  gemm(false, false, N, Hq * D, C, dres, C, w(p.wo), Hq * D, 0, datt, Hq * D, false);   // datt
  gemm(true, false, C, Hq * D, N, dres, C, a.att, Hq * D, 1, g(p.wo), Hq * D, true);    // dW_o
  // d(q|k) as the attention saw them: in qkv's slots, or in dqk's two blocks (qk_norm) before
  // the norms
  bf16* dq = s.qk_norm ? dqk : dqkv;
  bf16* dk = s.qk_norm ? dqk + N * Hq * D : dqkv + Hq * D;
  const int64_t lddq = s.qk_norm ? Hq * D : Wqkv, lddk = s.qk_norm ? Hkv * D : Wqkv;
  kc::AttnArgs at = attn_args(s, a, N, S);
  at.dout = datt;
  at.lddo = Hq * D;
  at.dq = dq;
  at.lddq = lddq;
  at.dk = dk;
  at.lddk = lddk;
  at.dv = dqkv + (Hq + Hkv) * D;
  at.lddv = Wqkv;
  kc::attention_bwd(at, dev, ws_.rewind(), stream);                                     // dq dk dv
  if (s.use_rope) {
    rope(dq, lddq, Hq, D, N, true);  // the transposed rotation, in place
    rope(dk, lddk, Hkv, D, N, true);
  }
  if (s.qk_norm) {  // d(normed) in dqk -> d(projected) in dqkv's q|k slots, through datt (free
                    // once the attention backward has read it)
    pack_qk(s, a.qkv, N);  // the norms' inputs (qkv's q|k slots still hold them)
    kc::rmsnorm_bwd(bf, datt, D, {g(p.q_norm), false}, dq, D, qk_in, D, w(p.q_norm),
                    {a.rstd_q, false}, N * Hq, D, 0.f, false, ws_.rewind(), stream);
    copy_cols(dqkv, Wqkv, datt, Hq * D, N, Hq * D);
    kc::rmsnorm_bwd(bf, datt, D, {g(p.k_norm), false}, dk, D, qk_in + N * Hq * D, D,
                    w(p.k_norm), {a.rstd_k, false}, N * Hkv, D, 0.f, false, ws_.rewind(), stream);
    copy_cols(dqkv + Hq * D, Wqkv, datt, Hkv * D, N, Hkv * D);
  }
  if (p.bq >= 0) kc::bias_bwd(bf, {g(p.bq), false}, dqkv, Wqkv, N, Hq * D, ws_.rewind(), stream);
  if (p.bk >= 0)
    kc::bias_bwd(bf, {g(p.bk), false}, dqkv + Hq * D, Wqkv, N, Hkv * D, ws_.rewind(), stream);
  if (p.bv >= 0)
    kc::bias_bwd(bf, {g(p.bv), false}, dqkv + (Hq + Hkv) * D, Wqkv, N, Hkv * D, ws_.rewind(),
                 stream);
  gemm(false, false, N, C, Wqkv, dqkv, Wqkv, w(p.wqkv), C, 0, dxn, C, false);           // dxn1
  gemm(true, false, Wqkv, C, N, dqkv, Wqkv, a.xn1, C, 1, g(p.wqkv), C, true);           // dW_qkv
  kc::rmsnorm_bwd(bf, dres, C, {g(p.attn_norm), false}, dxn, C, a.x, C, w(p.attn_norm),
                  {a.rstd1, false}, N, C, s.off_attn, true, ws_.rewind(), stream);       // dres = dx
}

// Selective recompute: the two norms' outputs (from the kept layer input and h, with the same
// statistics) and the SwiGLU product (from the kept gate|up GEMM output).
void CudaEngine::Impl::recompute_selective(int64_t l, const MicroBatch& mb, LayerActs& a) {
  const LayerShape& s = shapes[size_t(l)];
  const LayerOffsets& p = lo[size_t(l)];
  const int64_t N = mb.num_tokens(), F = s.F;
  const auto bf = kc::DType::bf16;
  kc::rmsnorm_fwd(bf, a.xn1, C, {a.rstd1, false}, a.x, C, w(p.attn_norm), N, C, s.eps_attn,
                  s.off_attn, stream);
  kc::rmsnorm_fwd(bf, a.xn2, C, {a.rstd2, false}, a.h, C, w(p.mlp_norm), N, C, s.eps_mlp,
                  s.off_mlp, stream);
  if (!s.moe) kc::swiglu_fwd(bf, a.a, F, a.gu, 2 * F, a.gu + F, 2 * F, N, F, stream);
}

// Output gradients are in dlp / dent (kernel alignment, device).
void CudaEngine::Impl::backward(const MicroBatch& mb, const OutputRequest& req) {
  const int64_t N = mb.num_tokens();
  kc::LogprobArgs h = head_args(req, N, true);
  h.dlogprob = {dlp, false};
  if (req.entropy) h.dentropy = {dent, false};
  h.dh = dxn;
  h.dW = {g(off_head), false};
  h.accumulate = false;
  kc::linear_logprob_bwd(gemm_engine, h, ws(), stream);                                // dxn, dW
  kc::rmsnorm_bwd(kc::DType::bf16, dres, C, {g(off_final_norm), false}, dxn, C, xs[size_t(L)], C,
                  w(off_final_norm), {rstd, false}, N, C, float(desc.final_norm.weight_offset),
                  false, ws(), stream);                                                // dres
  for (int64_t l = L - 1; l >= 0; --l) {
    LayerActs& a = acts[acts_per_layer ? size_t(l) : 0];
    a.x = xs[size_t(l)];
    if (opt.recompute == Recompute::full)
      forward_layer(l, mb, a, xr, true);  // the layer's activations again, from its kept input
    else if (opt.recompute == Recompute::selective)
      recompute_selective(l, mb, a);
    backward_layer(l, mb, a);
  }
  kc::embedding_bwd(kc::DType::bf16, {g(off_embed), false}, ids, dres, N, C, V, err, ws(),
                    stream);
}

// ---------------------------------------------------------------------------------------------
// Optimizer

double CudaEngine::Impl::grad_norm() {
  std::vector<int64_t> n;
  std::vector<void*> p;
  for (const Range& r : storage_ranges()) {
    const sdk::ParamDesc& pd = desc.params[r.param];
    if (!pd.trainable || router_frozen(pd.role)) continue;  // a frozen router is a buffer
    n.push_back(r.n);
    p.push_back(grads.get<float>() + r.off);
  }
  kc::TensorList t;
  t.n = n.data();
  t.p = p.data();
  t.count = n.size();
  kc::sumsq(t, scalars.get<float>(), ws(), stream);
  check(cudaMemcpyAsync(h_scalar, scalars.get(), sizeof(float), cudaMemcpyDeviceToHost, stream),
        "download");
  sync();
  return std::sqrt(double(h_scalar[0]));
}

void CudaEngine::Impl::optimizer_step(const StepOptions& so, double clip) {
  ++steps;
  const OptimizerOptions& o = opt.optimizer;
  // Two lists: with and without weight decay (Megatron leaves 1-D tensors out).
  const std::vector<Range> ranges = storage_ranges();
  for (int decay = 0; decay < 2; ++decay) {
    std::vector<int64_t> n;
    std::vector<void*> P, G, M, Vv, P16;
    for (const Range& r : ranges) {
      const sdk::ParamDesc& pd = desc.params[r.param];
      if (!pd.trainable || router_frozen(pd.role)) continue;
      const bool d = o.decay_1d_params || pd.shape.size() >= 2;
      if (d != bool(decay)) continue;
      n.push_back(r.n);
      P.push_back(master.get<float>() + r.off);
      G.push_back(grads.get<float>() + r.off);
      M.push_back(adam_m.get<float>() + r.off);
      Vv.push_back(adam_v.get<float>() + r.off);
      P16.push_back(master_bf16() + r.off);
    }
    if (n.empty()) continue;
    auto list = [&](std::vector<void*>& v) {
      kc::TensorList t;
      t.n = n.data();
      t.p = v.data();
      t.count = n.size();
      return t;
    };
    kc::AdamWArgs a;
    a.lr = so.lr;
    a.beta1 = o.beta1;
    a.beta2 = o.beta2;
    a.eps = o.eps;
    a.weight_decay = decay ? o.weight_decay : 0.0;
    a.step = steps;
    a.grad_scale = clip;
    a.zero_grad = true;  // the pass that reads g clears it for the next step
    kc::TensorList copy = list(P16);  // the bf16 working copy, refreshed in the same pass
    const std::unique_ptr<bool[]> is16(new bool[n.size()]);
    std::fill(is16.get(), is16.get() + n.size(), true);
    copy.bf16 = is16.get();
    a.p_bf16 = &copy;
    kc::adamw(list(P), list(G), list(M), list(Vv), a, ws(), stream);
  }
  grads_clear = true;
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
  return {impl_->counters.allocations, impl_->counters.bytes, impl_->counters.syncs};
}
std::string CudaEngine::device_name() const {
  cudaDeviceProp p{};
  cudaGetDeviceProperties(&p, impl_->opt.device);
  return p.name;
}

void CudaEngine::load_parameters(const std::vector<std::vector<float>>& tensors) {
  Impl& m = *impl_;
  if (tensors.size() != m.desc.params.size())
    throw std::invalid_argument("cuda engine: load_parameters got " + std::to_string(tensors.size()) +
                                " tensors for " + std::to_string(m.desc.params.size()) + " parameters");
  for (size_t i = 0; i < tensors.size(); ++i)
    if (int64_t(tensors[i].size()) != numel(m.desc.params[i].shape))
      throw std::invalid_argument("cuda engine: parameter " + m.desc.params[i].name + " has " +
                                  std::to_string(tensors[i].size()) + " values, expected " +
                                  std::to_string(numel(m.desc.params[i].shape)));
  for (size_t i = 0; i < tensors.size(); ++i) m.upload(i, m.master.get<float>(), tensors[i].data());
  cuda::cast_to_bf16(m.master.get<float>(), m.w16.get(), m.total, m.stream);
  m.sync();
}

std::vector<std::vector<float>> CudaEngine::Impl::download(const float* base) {
  std::vector<std::vector<float>> out;
  sync();
  for (size_t i = 0; i < desc.params.size(); ++i) {
    std::vector<float> t(size_t(numel(desc.params[i].shape)));
    download_one(i, base, t.data());
    out.push_back(std::move(t));
  }
  return out;
}

std::vector<std::vector<float>> CudaEngine::save_parameters() const {
  return impl_->download(impl_->master.get<float>());
}
std::vector<std::vector<float>> CudaEngine::gradients() const {
  impl_->require_trainable("gradients");
  return impl_->download(impl_->grads.get<float>());
}
void CudaEngine::zero_grad() {
  impl_->require_trainable("zero_grad");
  check(cudaMemsetAsync(impl_->grads.get(), 0, impl_->grads.size(), impl_->stream), "memset");
  impl_->grads_clear = true;
}

CudaEngine::AdamState CudaEngine::adam_state() const {
  impl_->require_trainable("adam_state");
  AdamState s;
  s.step = impl_->steps;
  s.exp_avg = impl_->download(impl_->adam_m.get<float>());
  s.exp_avg_sq = impl_->download(impl_->adam_v.get<float>());
  return s;
}

void CudaEngine::load_adam_state(const AdamState& s) {
  Impl& m = *impl_;
  m.require_trainable("load_adam_state");
  if (s.step < 0) throw std::invalid_argument("cuda engine: a negative optimizer step");
  for (const auto* part : {&s.exp_avg, &s.exp_avg_sq}) {
    if (part->size() != m.desc.params.size())
      throw std::invalid_argument("cuda engine: optimizer state has " + std::to_string(part->size()) +
                                  " tensors for " + std::to_string(m.desc.params.size()) + " parameters");
    for (size_t i = 0; i < part->size(); ++i)
      if (int64_t((*part)[i].size()) != numel(m.desc.params[i].shape))
        throw std::invalid_argument("cuda engine: optimizer state of " + m.desc.params[i].name +
                                    " has the wrong size");
  }
  for (size_t i = 0; i < m.desc.params.size(); ++i) {
    m.upload(i, m.adam_m.get<float>(), s.exp_avg[i].data());
    m.upload(i, m.adam_v.get<float>(), s.exp_avg_sq[i].data());
  }
  m.sync();  // the host vectors may go once this returns
  m.steps = s.step;
}

void CudaEngine::set_optimizer_options(const OptimizerOptions& o) { impl_->opt.optimizer = o; }

Outputs CudaEngine::forward(const MicroBatch& mb, const OutputRequest& req) {
  Impl& m = *impl_;
  m.forward(mb, req, false);
  const int64_t N = mb.num_tokens();
  Outputs out;
  cuda::DeviceBuffer logits;
  if (req.logits) {  // [N, V] f32: for tests on small vocabularies
    logits = cuda::DeviceBuffer(m.counters, size_t(N * m.V) * sizeof(float));
    m.gemm(false, true, N, m.V, m.C, m.xn, m.C, m.w(m.off_head), m.C, 0, logits.get(), m.V, true);
  }
  if (req.logprob)
    check(cudaMemcpyAsync(m.h_lp, m.lp, size_t(N) * 4, cudaMemcpyDeviceToHost, m.stream), "download");
  if (req.entropy)
    check(cudaMemcpyAsync(m.h_ent, m.ent, size_t(N) * 4, cudaMemcpyDeviceToHost, m.stream), "download");
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
  if (req.routed_experts) {
    out.routing_width = m.route_width;
    out.routed_experts.assign(m.h_route, m.h_route + N * m.route_width);
  }
  return out;
}

StepResult CudaEngine::train_step(std::span<const MicroBatch> mbs, const StepOptions& so,
                                  const LossFn& loss_fn) {
  Impl& m = *impl_;
  const OutputRequest& req = so.outputs;
  m.require_trainable("train_step");
  if (!req.logprob && !req.entropy)
    throw std::invalid_argument("cuda engine: a train step needs logprob or entropy outputs");
  if (req.logits) throw std::invalid_argument("cuda engine: logits are a forward-only output");
  if (mbs.empty()) throw std::invalid_argument("cuda engine: a train step needs micro-batches");
  int64_t biggest = 0;
  for (const MicroBatch& mb : mbs) biggest = std::max(biggest, mb.num_tokens());
  m.plan(biggest, true);
  if (!m.grads_clear) zero_grad();
  m.grads_clear = false;
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
  std::vector<float> lp, ent, dlp, dent;
  for (size_t i = 0; i < mbs.size(); ++i) {
    const MicroBatch& mb = mbs[i];
    const int64_t N = mb.num_tokens();
    m.forward(mb, req, true);
    if (req.logprob)
      check(cudaMemcpyAsync(m.h_lp, m.lp, size_t(N) * 4, cudaMemcpyDeviceToHost, m.stream), "download");
    if (req.entropy)
      check(cudaMemcpyAsync(m.h_ent, m.ent, size_t(N) * 4, cudaMemcpyDeviceToHost, m.stream), "download");
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
    LossContext ctx{&mb, int64_t(i), int64_t(mbs.size()), so.global_tokens, so.global_sequences};
    const LossResult lr = loss_fn(ctx, ov, og);
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
    m.backward(mb, req);
    r.tokens += N;
  }
  double moe_vals[3] = {0, 0, 0};  // aux, z, max load: downloaded before grad_norm's wait
  if (m.moe_layers > 0)
    check(cudaMemcpyAsync(m.h_scalar + 4, m.moe_stats(), sizeof(moe_vals), cudaMemcpyDeviceToHost,
                          m.stream), "download");
  r.grad_norm = m.grad_norm();
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
