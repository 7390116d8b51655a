// The CUDA engine's weights and optimizer state in and out: whole tensors from and to host
// memory (load_parameters, save_parameters, adam_state, load_adam_state, gradients), the
// masters' device views for a colocated refit, and FP8 delayed scaling's histories. Without
// sharding they move between the host and the flat buffers; the distributed optimizer's moments
// through the (clear) gradient buffer, gathered; FSDP's everything unit by unit through the
// gradient staging (data_parallel.cpp), since no rank holds a whole buffer.
#include <algorithm>
#include <exception>
#include <stdexcept>
#include <utility>

#include "cuda_engine_impl.hpp"

namespace rlh::engine {

using cuda::check;
using cuda::numel;

// One tensor between host memory (desc shape, contiguous) and its place in a flat buffer.
void CudaEngine::Impl::upload(size_t i, float* base, const float* src, int64_t origin) {
  const cuda::ParamPlace& pl = place[i];
  float* at = base + (pl.off - origin);
  const size_t row = size_t(pl.piece) * sizeof(float);
  if (pl.pieces == 1)
    check(cudaMemcpyAsync(at, src, row, cudaMemcpyDefault, stream), "upload");
  else
    check(cudaMemcpy2DAsync(at, size_t(pl.stride) * sizeof(float), src, row, row,
                            size_t(pl.pieces), cudaMemcpyDefault, stream), "upload");
}

void CudaEngine::Impl::download_one(size_t i, const float* base, float* dst, int64_t origin) {
  const cuda::ParamPlace& pl = place[i];
  const float* at = base + (pl.off - origin);
  const size_t row = size_t(pl.piece) * sizeof(float);
  if (pl.pieces == 1)
    check(cudaMemcpy(dst, at, row, cudaMemcpyDefault), "download");
  else
    check(cudaMemcpy2D(dst, row, at, size_t(pl.stride) * sizeof(float), row,
                       size_t(pl.pieces), cudaMemcpyDefault), "download");
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
  if (m.fsdp()) {
    // Unit by unit through the stage (clear between steps): this rank keeps its block of the
    // masters (offloaded: in its host copy) and its bf16 cast, and the router's side copy.
    m.sync();
    m.release_units();
    float* st = m.gstage.get<float>();
    for (size_t u = 0; u < m.units.size(); ++u) {
      const Impl::Unit& U = m.units[u];
      check(cudaMemsetAsync(st, 0, size_t(U.block * m.dp_size) * 4, m.stream), "memset");
      for (size_t i : m.unit_params[u]) m.upload(i, st, tensors[i].data(), U.begin);
      m.kept_from_whole(st, U.begin, U.begin + U.block * m.dp_size);
      m.keep_block(u, m.master32());
      cuda::cast_to_bf16(st + int64_t(m.dp_rank) * U.block, m.master_bf16() + U.at, U.block, m.stream);
      m.sync();  // the next unit reuses the stage; the host vectors may go once this returns
    }
    // The summed gradients accumulate over micro-batches (reduce_layer): a skipped or
    // accumulate-only step before this load must not leak into the next one.
    check(cudaMemsetAsync(m.gshard.get(), 0, m.gshard.size(), m.stream), "memset");
    m.grads_clear = true;
    return;
  }
  if (m.masters_apart()) {
    // The whole weights staged in the gradient buffer (clear between steps): this rank keeps
    // its block of the masters (FSDP; offloaded: its host copy) and the router's side copy;
    // the bf16 copy is cast whole.
    m.sync();
    check(cudaMemsetAsync(m.grads.get(), 0, m.grads.size(), m.stream), "memset");
    for (size_t i = 0; i < tensors.size(); ++i) m.upload(i, m.grads.get<float>(), tensors[i].data());
    check(cudaMemcpyAsync(m.master32(), m.grads.get<float>(), m.master_bytes(), cudaMemcpyDefault, m.stream), "copy");
    m.kept_from_whole(m.grads.get<float>());
    cuda::cast_to_bf16(m.grads.get<float>(), m.w16.get(), m.total, m.stream);
    check(cudaMemsetAsync(m.grads.get(), 0, m.grads.size(), m.stream), "memset");
    m.grads_clear = true;
    m.sync();  // the host vectors may go once this returns
    return;
  }
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

std::vector<std::vector<float>> CudaEngine::Impl::download_units(const float* local) {
  // Every rank's blocks of each unit, gathered into the stage, downloaded from there.
  std::vector<std::vector<float>> out(desc.params.size());
  for (size_t u = 0; u < units.size(); ++u) {
    const float* st = stage_unit(u, local);
    sync();
    for (size_t i : unit_params[u]) {
      out[i].resize(size_t(numel(desc.params[i].shape)));
      download_one(i, st, out[i].data(), units[u].begin);
    }
  }
  return out;
}

std::vector<std::vector<float>> CudaEngine::save_parameters() const {
  Impl& m = *impl_;
  if (m.fsdp()) return m.download_units(m.master32());
  return m.download(m.master32());  // (offloaded: from its host copy)
}

void CudaEngine::visit_master_views(const std::function<void(size_t, const ParamView&)>& fn) const {
  Impl& m = *impl_;
  if (!m.fsdp()) {
    const std::vector<ParamView> views = master_views();
    for (size_t i = 0; i < views.size(); ++i) fn(i, views[i]);
    return;
  }
  // Unit by unit: its masters gathered into the stage, its parameters viewed there. A callback
  // that throws stops the views, not the gathers: the peers are in them, so this rank finishes
  // its part before it passes the error on.
  std::exception_ptr failed;
  for (size_t u = 0; u < m.units.size(); ++u) {
    const float* st = m.stage_unit(u, m.master32());
    m.sync();
    for (size_t i : m.unit_params[u]) {
      if (failed) break;
      const cuda::ParamPlace& pl = m.place[i];
      try {
        fn(i, {st + (pl.off - m.units[u].begin), pl.pieces, pl.piece, pl.pieces > 1 ? pl.stride : pl.piece});
      } catch (...) {
        failed = std::current_exception();
      }
    }
  }
  if (failed) std::rethrow_exception(failed);
}

std::vector<CudaEngine::ParamView> CudaEngine::master_views() const {
  Impl& m = *impl_;
  // FSDP or offload: the whole masters gathered (uploaded) into the gradient buffer, which the
  // next step (or zero_grad) clears before it accumulates.
  if (m.fsdp())
    throw std::logic_error("cuda engine: master_views under FSDP: no whole copy of the masters exists on a rank; "
                           "visit_master_views gathers them unit by unit");
  const float* base = m.master.get<float>();
  if (m.masters_apart()) {
    m.stage_masters_whole();
    m.grads_clear = false;
    base = m.grads.get<float>();
  }
  m.sync();
  std::vector<ParamView> out;
  out.reserve(m.place.size());
  for (const cuda::ParamPlace& pl : m.place)
    out.push_back({base + pl.off, pl.pieces, pl.piece, pl.pieces > 1 ? pl.stride : pl.piece});
  return out;
}

int CudaEngine::device_index() const { return impl_->opt.device; }
std::vector<std::vector<float>> CudaEngine::gradients() const {
  impl_->require_trainable("gradients");
  // FSDP: the summed gradients of the last step, gathered unit by unit (an applied update has
  // cleared them, as it clears the whole buffer without FSDP).
  if (impl_->fsdp()) return impl_->download_units(impl_->gshard.get<float>());
  // After an update in overwrite mode the buffer still holds that step's sums: an applied update
  // reads as cleared, as before.
  if (impl_->grads_stale) impl_->clear_grads();
  return impl_->download(impl_->grads.get<float>());
}
void CudaEngine::Impl::clear_grads() {
  cuda::DeviceBuffer& b = fsdp() ? gshard : grads;
  check(cudaMemsetAsync(b.get(), 0, b.size(), stream), "memset");
  grads_clear = true;
  grads_stale = false;
}
void CudaEngine::zero_grad() {
  impl_->require_trainable("zero_grad");
  impl_->clear_grads();
}

CudaEngine::AdamState CudaEngine::adam_state() const {
  impl_->require_trainable("adam_state");
  AdamState s;
  Impl& m = *impl_;
  s.step = m.steps;
  if (!m.sharded()) {
    s.exp_avg = m.download(m.moment_m());
    s.exp_avg_sq = m.download(m.moment_v());
    return s;
  }
  if (m.fsdp()) {
    s.exp_avg = m.download_units(m.moment_m());
    s.exp_avg_sq = m.download_units(m.moment_v());
    return s;
  }
  // Every rank's block, gathered into the (clear) gradient buffer, then downloaded from there.
  m.gather_moment(m.moment_m());
  s.exp_avg = m.download(m.grads.get<float>());
  m.gather_moment(m.moment_v());
  s.exp_avg_sq = m.download(m.grads.get<float>());
  check(cudaMemsetAsync(m.grads.get(), 0, m.grads.size(), m.stream), "memset");
  m.sync();
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
  if (!m.sharded()) {
    for (size_t i = 0; i < m.desc.params.size(); ++i) {
      m.upload(i, m.moment_m(), s.exp_avg[i].data());
      m.upload(i, m.moment_v(), s.exp_avg_sq[i].data());
    }
  } else if (m.fsdp()) {  // unit by unit through the stage, this rank's blocks kept
    float* st = m.gstage.get<float>();
    for (auto [part, local] : {std::pair{&s.exp_avg, m.moment_m()}, std::pair{&s.exp_avg_sq, m.moment_v()}})
      for (size_t u = 0; u < m.units.size(); ++u) {
        m.sync();  // the stage's previous unit is kept
        check(cudaMemsetAsync(st, 0, size_t(m.units[u].block * m.dp_size) * 4, m.stream), "memset");
        for (size_t i : m.unit_params[u]) m.upload(i, st, (*part)[i].data(), m.units[u].begin);
        m.keep_block(u, local);
      }
  } else {  // the full layout in the (clear) gradient buffer, this rank's block kept
    for (auto [part, shard] : {std::pair{&s.exp_avg, m.moment_m()}, std::pair{&s.exp_avg_sq, m.moment_v()}}) {
      m.sync();
      check(cudaMemsetAsync(m.grads.get(), 0, m.grads.size(), m.stream), "memset");
      for (size_t i = 0; i < m.desc.params.size(); ++i) m.upload(i, m.grads.get<float>(), (*part)[i].data());
      m.scatter_moment(shard);
    }
    check(cudaMemsetAsync(m.grads.get(), 0, m.grads.size(), m.stream), "memset");
  }
  m.sync();  // the host vectors may go once this returns
  m.steps = s.step;
}

std::string CudaEngine::fp8_state() const {
  Impl& m = *impl_;
  if (!m.fp8 || !m.fp8->delayed()) return {};
  m.sync();  // every queued quantisation in the histories
  return m.fp8->state();
}

void CudaEngine::load_fp8_state(const std::string& bytes) {
  Impl& m = *impl_;
  if (!m.fp8 || !m.fp8->delayed())
    throw std::invalid_argument("cuda engine: an FP8 delayed-scaling state given, but this engine does not run "
                                "fp8_recipe = delayed");
  m.sync();
  try {
    m.fp8->load_state(bytes);
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(std::string("cuda engine: ") + e.what());
  }
}

}  // namespace rlh::engine
