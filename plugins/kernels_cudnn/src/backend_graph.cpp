// cuDNN backend descriptors, operations, plans (backend_graph.hpp).
#include "backend_graph.hpp"

#include <algorithm>

namespace rlh::kcudnn {

void cudnn_check(cudnnStatus_t s, const std::string& what) {
  if (s != CUDNN_STATUS_SUCCESS) throw CudnnError(s, what + ": " + cudnn_lib().error(s));
}

Desc::Desc(cudnnBackendDescriptorType_t type) {
  cudnn_check(cudnn_lib().BackendCreateDescriptor(type, &d_), "creating a backend descriptor");
}

Desc& Desc::operator=(Desc&& o) noexcept {
  if (this != &o) {
    if (d_) cudnn_lib().BackendDestroyDescriptor(d_);
    d_ = o.d_;
    o.d_ = nullptr;
  }
  return *this;
}

Desc::~Desc() {
  if (d_) cudnn_lib().BackendDestroyDescriptor(d_);
}

Desc& Desc::set(cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type, int64_t count,
                const void* values, const char* what) {
  cudnn_check(cudnn_lib().BackendSetAttribute(d_, name, type, count, values),
              std::string("setting ") + what + " (attribute " + std::to_string(int(name)) + ")");
  return *this;
}

Desc& Desc::finalize(const char* what) {
  cudnn_check(cudnn_lib().BackendFinalize(d_), std::string("finalizing ") + what);
  return *this;
}

// ---------------------------------------------------------------------------------------------

TensorRef Graph::tensor(cudnnDataType_t dt, Dims dims, Dims strides, bool is_virtual, const TensorRef* ragged) {
  TensorRef t;
  t.uid = next_uid_++;
  t.dims = dims;
  t.strides = strides;
  t.dtype = dt;
  Desc d(CUDNN_BACKEND_TENSOR_DESCRIPTOR);
  const int64_t align = 16;  // tensor-core engines want 16-byte aligned operands
  d.set(CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &dt, "tensor data type")
      .set(CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 4, dims.data(), "tensor dims")
      .set(CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 4, strides.data(), "tensor strides")
      .set(CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &t.uid, "tensor uid")
      .set(CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &align, "tensor alignment");
  if (is_virtual) {
    const bool v = true;
    d.set(CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &v, "tensor is_virtual");
  }
  if (ragged) d.set_desc(CUDNN_ATTR_TENSOR_RAGGED_OFFSET_DESC, ragged->desc, "tensor ragged offsets");
  d.finalize("a tensor");
  t.desc = keep(std::move(d)).get();
  return t;
}

TensorRef Graph::scalar(cudnnDataType_t dt) {
  TensorRef t;
  t.uid = next_uid_++;
  t.dims = {1, 1, 1, 1};
  t.strides = {1, 1, 1, 1};
  t.dtype = dt;
  Desc d(CUDNN_BACKEND_TENSOR_DESCRIPTOR);
  const int64_t align = 16;
  const bool by_value = true;
  d.set(CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &dt, "scalar data type")
      .set(CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 4, t.dims.data(), "scalar dims")
      .set(CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 4, t.strides.data(), "scalar strides")
      .set(CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &t.uid, "scalar uid")
      .set(CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &align, "scalar alignment")
      .set(CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &by_value, "scalar by value")
      .finalize("a scalar");
  t.desc = keep(std::move(d)).get();
  return t;
}

TensorRef Graph::pointwise(cudnnPointwiseMode_t mode, const TensorRef& x, const TensorRef* b, const TensorRef* t,
                           cudnnDataType_t out_dt, cudnnDataType_t compute, int64_t axis) {
  // Output dims: the broadcast of the inputs; strides: those of an input with the same dims.
  Dims dims = x.dims;
  for (const TensorRef* in : {b, t})
    if (in)
      for (int i = 0; i < 4; ++i) dims[size_t(i)] = std::max(dims[size_t(i)], in->dims[size_t(i)]);
  Dims strides = x.strides;
  for (const TensorRef* in : {&x, b, t})
    if (in && in->dims == dims) {
      strides = in->strides;
      break;
    }
  const TensorRef y = tensor(out_dt, dims, strides, true);
  pointwise_into(mode, x, b, t, y, compute, axis);
  return y;
}

void Graph::pointwise_into(cudnnPointwiseMode_t mode, const TensorRef& x, const TensorRef* b, const TensorRef* t,
                           const TensorRef& y, cudnnDataType_t compute, int64_t axis) {
  Desc pw(CUDNN_BACKEND_POINTWISE_DESCRIPTOR);
  pw.set(CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode, "pointwise mode")
      .set(CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &compute, "pointwise precision");
  if (mode == CUDNN_POINTWISE_GEN_INDEX)
    pw.set(CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, 1, &axis, "pointwise axis");
  pw.finalize("a pointwise descriptor");
  const cudnnBackendDescriptor_t pwd = keep(std::move(pw)).get();
  Desc op(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR);
  const float one = 1.0f;
  op.set_desc(CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, pwd, "pointwise op descriptor")
      .set_desc(CUDNN_ATTR_OPERATION_POINTWISE_XDESC, x.desc, "pointwise x")
      .set_desc(CUDNN_ATTR_OPERATION_POINTWISE_YDESC, y.desc, "pointwise y");
  if (b) op.set_desc(CUDNN_ATTR_OPERATION_POINTWISE_BDESC, b->desc, "pointwise b");
  if (t) op.set_desc(CUDNN_ATTR_OPERATION_POINTWISE_TDESC, t->desc, "pointwise t");
  op.set(CUDNN_ATTR_OPERATION_POINTWISE_ALPHA1, CUDNN_TYPE_FLOAT, 1, &one, "pointwise alpha1")
      .set(CUDNN_ATTR_OPERATION_POINTWISE_ALPHA2, CUDNN_TYPE_FLOAT, 1, &one, "pointwise alpha2")
      .finalize("a pointwise operation");
  ops_.push_back(keep(std::move(op)).get());
}

void Graph::matmul(const TensorRef& a, const TensorRef& b, const TensorRef& c, const TensorRef* m_override,
                   const TensorRef* n_override, const TensorRef* k_override) {
  Desc mm(CUDNN_BACKEND_MATMUL_DESCRIPTOR);
  const cudnnDataType_t compute = CUDNN_DATA_FLOAT;
  mm.set(CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &compute, "matmul precision")
      .finalize("a matmul descriptor");
  const cudnnBackendDescriptor_t mmd = keep(std::move(mm)).get();
  Desc op(CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR);
  op.set_desc(CUDNN_ATTR_OPERATION_MATMUL_ADESC, a.desc, "matmul a")
      .set_desc(CUDNN_ATTR_OPERATION_MATMUL_BDESC, b.desc, "matmul b")
      .set_desc(CUDNN_ATTR_OPERATION_MATMUL_CDESC, c.desc, "matmul c")
      .set_desc(CUDNN_ATTR_OPERATION_MATMUL_DESC, mmd, "matmul descriptor");
  if (m_override) op.set_desc(CUDNN_ATTR_OPERATION_MATMUL_GEMM_M_OVERRIDE_DESC, m_override->desc, "matmul M override");
  if (n_override) op.set_desc(CUDNN_ATTR_OPERATION_MATMUL_GEMM_N_OVERRIDE_DESC, n_override->desc, "matmul N override");
  if (k_override) op.set_desc(CUDNN_ATTR_OPERATION_MATMUL_GEMM_K_OVERRIDE_DESC, k_override->desc, "matmul K override");
  op.finalize("a matmul operation");
  ops_.push_back(keep(std::move(op)).get());
}

void Graph::reduction(cudnnReduceTensorOp_t rop, const TensorRef& x, const TensorRef& y) {
  Desc r(CUDNN_BACKEND_REDUCTION_DESCRIPTOR);
  const cudnnDataType_t compute = CUDNN_DATA_FLOAT;
  r.set(CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &rop, "reduction operator")
      .set(CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &compute, "reduction precision")
      .finalize("a reduction descriptor");
  const cudnnBackendDescriptor_t rd = keep(std::move(r)).get();
  Desc op(CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR);
  op.set_desc(CUDNN_ATTR_OPERATION_REDUCTION_XDESC, x.desc, "reduction x")
      .set_desc(CUDNN_ATTR_OPERATION_REDUCTION_YDESC, y.desc, "reduction y")
      .set_desc(CUDNN_ATTR_OPERATION_REDUCTION_DESC, rd, "reduction descriptor")
      .finalize("a reduction operation");
  ops_.push_back(keep(std::move(op)).get());
}

TensorRef Graph::reshape(const TensorRef& x, Dims dims, Dims strides, cudnnDataType_t dt, const TensorRef* ragged) {
  const TensorRef y = tensor(dt, dims, strides, true, ragged);
  Desc op(CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR);
  op.set_desc(CUDNN_ATTR_OPERATION_RESHAPE_XDESC, x.desc, "reshape x")
      .set_desc(CUDNN_ATTR_OPERATION_RESHAPE_YDESC, y.desc, "reshape y")
      .finalize("a reshape operation");
  ops_.push_back(keep(std::move(op)).get());
  return y;
}

// The handle attributes of the operation graph and the plan are marked deprecated in cuDNN 9's
// headers (device properties replace them) but are still how a graph learns its device.
void Graph::build_plan(const CudnnLib& lib, cudnnHandle_t handle, int max_candidates) {
  op_graph_ = Desc(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR);
  op_graph_.set(CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, int64_t(ops_.size()), ops_.data(),
                "operation graph ops")
      .set(CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle, "operation graph handle")
      .finalize("the operation graph");
  cands_.clear();
  chosen_ = 0;
  workspace_ = 0;
  std::string reasons;
  int64_t tried = 0;
  // Mode A's configs in its order; mode B's after them only when several are wanted.
  for (const cudnnBackendHeurMode_t mode : {CUDNN_HEUR_MODE_A, CUDNN_HEUR_MODE_B}) {
    if (mode == CUDNN_HEUR_MODE_B && (max_candidates <= 1 || int(cands_.size()) >= max_candidates)) break;
    Desc heur(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR);
    const cudnnBackendDescriptor_t g = op_graph_.get();
    heur.set(CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &g, "heuristics graph")
        .set(CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode, "heuristics mode");
    if (mode == CUDNN_HEUR_MODE_B) {  // a further list is optional: a runtime without mode B has mode A's
      if (lib.BackendFinalize(heur.get()) != CUDNN_STATUS_SUCCESS) break;
    } else {
      heur.finalize("the engine heuristics");
    }
    int64_t count = 0;
    cudnn_check(lib.BackendGetAttribute(heur.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, 0,
                                        &count, nullptr),
                "counting engine configs");
    if (count <= 0) continue;
    std::vector<Desc> cfgs;
    std::vector<cudnnBackendDescriptor_t> raw;
    for (int64_t i = 0; i < count; ++i) {
      cfgs.emplace_back(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR);
      raw.push_back(cfgs.back().get());
    }
    int64_t got = 0;
    cudnn_check(lib.BackendGetAttribute(heur.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR,
                                        count, &got, raw.data()),
                "reading engine configs");
    for (int64_t i = 0; i < std::min(got, count) && int(cands_.size()) < std::max(max_candidates, 1); ++i) {
      ++tried;
      Desc plan(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR);
      const cudnnBackendDescriptor_t cfg = raw[size_t(i)];
      plan.set(CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &cfg, "plan engine config");
      // Older runtimes read the handle from the plan; newer ones from the graph (ignored there).
      lib.BackendSetAttribute(plan.get(), CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle);
      const cudnnStatus_t st = lib.BackendFinalize(plan.get());
      if (st != CUDNN_STATUS_SUCCESS) {
        if (cands_.empty())
          reasons += (reasons.empty() ? "" : "; ") + std::string("config ") + std::to_string(i) + ": " + lib.error(st);
        continue;
      }
      int64_t n = 0, ws = 0;
      cudnn_check(lib.BackendGetAttribute(plan.get(), CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64, 1,
                                          &n, &ws),
                  "reading the plan's workspace size");
      // The engine's numerical notes (determinism is reported in op_info).
      bool nondet = false;
      Desc engine(CUDNN_BACKEND_ENGINE_DESCRIPTOR);
      cudnnBackendDescriptor_t e = engine.get();
      if (lib.BackendGetAttribute(cfg, CUDNN_ATTR_ENGINECFG_ENGINE, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &n, &e) ==
          CUDNN_STATUS_SUCCESS) {
        cudnnBackendNumericalNote_t notes[32];
        int64_t nn = 0;
        if (lib.BackendGetAttribute(e, CUDNN_ATTR_ENGINE_NUMERICAL_NOTE, CUDNN_TYPE_NUMERICAL_NOTE, 32, &nn, notes) ==
            CUDNN_STATUS_SUCCESS)
          for (int64_t k = 0; k < std::min<int64_t>(nn, 32); ++k)
            nondet = nondet || notes[k] == CUDNN_NUMERICAL_NOTE_NONDETERMINISTIC;
      }
      if (!cands_.empty() && nondet && !cands_[0].nondeterministic) continue;  // never less deterministic
      cands_.push_back(Candidate{std::move(plan), std::max<int64_t>(ws, 0), nondet});
      workspace_ = std::max(workspace_, cands_.back().workspace);
    }
  }
  if (!cands_.empty()) return;
  throw CudnnError(CUDNN_STATUS_NOT_SUPPORTED,
                   "no engine config of cuDNN " + lib.version_string() + " builds this graph (" +
                       std::to_string(tried) + " tried: " + reasons + ")");
}

void Graph::choose(size_t i) {
  if (i >= cands_.size()) throw std::logic_error("cuDNN graph: no such candidate plan");
  Candidate c = std::move(cands_[i]);
  cands_.clear();
  cands_.push_back(std::move(c));
  chosen_ = 0;
  workspace_ = cands_[0].workspace;
}

void execute_plan(const CudnnLib& lib, cudnnHandle_t handle, const Desc& plan, const std::vector<int64_t>& uids,
                  const std::vector<void*>& ptrs, void* workspace) {
  Desc vp(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR);
  vp.set(CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, int64_t(uids.size()), uids.data(), "variant pack uids")
      .set(CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, int64_t(ptrs.size()), ptrs.data(),
           "variant pack pointers")
      .set(CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &workspace, "variant pack workspace")
      .finalize("the variant pack");
  cudnn_check(lib.BackendExecute(handle, plan.get(), vp.get()), "executing the plan");
}

}  // namespace rlh::kcudnn
