// A thin C++ layer over cuDNN's backend (graph) descriptors: owned descriptors, 4-D tensors with
// unique ids, the pointwise / matmul / reduction / reshape operations attention is made of, the
// operation graph, the execution plan (heuristics mode A, the first engine config that
// finalizes, or the fastest of several when the caller times them) and its execution with a
// variant pack. Every cuDNN call goes through the function
// table of cudnn_lib.hpp; a failing call throws CudnnError naming the step.
#pragma once

#include <cudnn_graph.h>

#include <array>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "cudnn_lib.hpp"

namespace rlh::kcudnn {

class CudnnError : public std::runtime_error {
 public:
  CudnnError(cudnnStatus_t s, const std::string& what) : std::runtime_error(what), status_(s) {}
  cudnnStatus_t status() const { return status_; }

 private:
  cudnnStatus_t status_;
};

// Throws CudnnError "<what>: <status and cuDNN's last message>" unless s is success.
void cudnn_check(cudnnStatus_t s, const std::string& what);

// One backend descriptor, destroyed with its owner (move-only).
class Desc {
 public:
  Desc() = default;
  explicit Desc(cudnnBackendDescriptorType_t type);
  Desc(Desc&& o) noexcept : d_(o.d_) { o.d_ = nullptr; }
  Desc& operator=(Desc&& o) noexcept;
  Desc(const Desc&) = delete;
  Desc& operator=(const Desc&) = delete;
  ~Desc();

  cudnnBackendDescriptor_t get() const { return d_; }
  Desc& set(cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type, int64_t count,
            const void* values, const char* what);
  Desc& set_desc(cudnnBackendAttributeName_t name, cudnnBackendDescriptor_t d, const char* what) {
    return set(name, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &d, what);
  }
  Desc& finalize(const char* what);

 private:
  cudnnBackendDescriptor_t d_ = nullptr;
};

using Dims = std::array<int64_t, 4>;

// A tensor of a graph: its descriptor (owned by the graph), unique id, dims and strides.
struct TensorRef {
  cudnnBackendDescriptor_t desc = nullptr;
  int64_t uid = 0;
  Dims dims{}, strides{};
  cudnnDataType_t dtype = CUDNN_DATA_FLOAT;
};

class Graph {
 public:
  // A tensor; `ragged` (a [B+1, 1, 1, 1] int64 offsets tensor of this graph) makes it a packed
  // (THD) tensor whose batch b starts `ragged[b]` elements after its pointer.
  TensorRef tensor(cudnnDataType_t dt, Dims dims, Dims strides, bool is_virtual, const TensorRef* ragged = nullptr);
  // A float scalar passed by value (a host pointer in the variant pack).
  TensorRef scalar(cudnnDataType_t dt = CUDNN_DATA_FLOAT);

  // y = mode(x[, b[, t]]) into a new virtual tensor with x's dims (the broadcast of the inputs)
  // and the strides of the input that has those dims. `axis` only for GEN_INDEX.
  TensorRef pointwise(cudnnPointwiseMode_t mode, const TensorRef& x, const TensorRef* b, const TensorRef* t,
                      cudnnDataType_t out_dt, cudnnDataType_t compute = CUDNN_DATA_FLOAT, int64_t axis = -1);
  // The same into a given (usually non-virtual) tensor.
  void pointwise_into(cudnnPointwiseMode_t mode, const TensorRef& x, const TensorRef* b, const TensorRef* t,
                      const TensorRef& y, cudnnDataType_t compute = CUDNN_DATA_FLOAT, int64_t axis = -1);
  // c = a @ b (batched over dims 0 and 1, b's head dim may divide a's: GQA); the optional
  // [B, 1, 1, 1] int32 tensors override M, N and K per batch (variable sequence lengths).
  void matmul(const TensorRef& a, const TensorRef& b, const TensorRef& c, const TensorRef* m_override,
              const TensorRef* n_override, const TensorRef* k_override);
  // y = reduce(x) over the dims where y is smaller (size 1, or a divisor: summing GQA heads).
  void reduction(cudnnReduceTensorOp_t op, const TensorRef& x, const TensorRef& y);
  // A view of x with other dims/strides (a transpose), into a new virtual tensor (packed with
  // x's ragged offsets when given).
  TensorRef reshape(const TensorRef& x, Dims dims, Dims strides, cudnnDataType_t dt, const TensorRef* ragged = nullptr);

  // Finalizes the operation graph on `handle`, asks heuristics mode A for engine configs and
  // builds the first one that finalizes. Throws CudnnError (status NOT_SUPPORTED when no
  // config builds) with every config's reason. With max_candidates > 1 it also keeps up to that
  // many further configs that finalize (mode A's, then mode B's), none less deterministic than
  // the first, for a caller that times them (choose()); the workspace is then the largest one's.
  void build_plan(const CudnnLib& lib, cudnnHandle_t handle, int max_candidates = 1);
  const Desc& plan() const { return cands_[chosen_].plan; }
  const Desc& candidate(size_t i) const { return cands_[i].plan; }
  size_t candidates() const { return cands_.size(); }
  // Keeps candidate i alone (its workspace from now on).
  void choose(size_t i);
  size_t num_operations() const { return ops_.size(); }
  int64_t workspace_bytes() const { return workspace_; }
  // Numerical notes of the chosen engine include NONDETERMINISTIC.
  bool nondeterministic() const { return cands_.empty() ? false : cands_[chosen_].nondeterministic; }

 private:
  Desc& keep(Desc d) {
    keep_.push_back(std::move(d));
    return keep_.back();
  }
  std::vector<Desc> keep_;  // tensors, operation settings, operations: alive with the plan
  std::vector<cudnnBackendDescriptor_t> ops_;
  int64_t next_uid_ = 1;
  Desc op_graph_;
  struct Candidate {
    Desc plan;
    int64_t workspace = 0;
    bool nondeterministic = false;
  };
  std::vector<Candidate> cands_;  // [chosen_] runs
  size_t chosen_ = 0;
  int64_t workspace_ = 0;
};

// Runs a plan: uids[i] is bound to ptrs[i] (device pointers; host pointers for by-value
// scalars), with `workspace` (at least the plan's workspace_bytes) on the handle's stream.
void execute_plan(const CudnnLib& lib, cudnnHandle_t handle, const Desc& plan, const std::vector<int64_t>& uids,
                  const std::vector<void*>& ptrs, void* workspace);

}  // namespace rlh::kcudnn
