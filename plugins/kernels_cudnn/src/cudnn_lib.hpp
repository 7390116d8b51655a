// libcudnn.so.9 loaded at run time (dlopen), never linked: the plugin loads, lists its ops and
// probes on a machine without cuDNN or a GPU, and on the GPU machine cuDNN comes from wherever
// it is installed (the Python wheel nvidia-cudnn-cu13 keeps it in site-packages/nvidia/cudnn/lib,
// which no loader path names). Only the handful of functions of the backend (graph) API that the
// provider calls are resolved; the types and enums come from cudnn_graph.h at build time.
#pragma once

#include <cudnn_graph.h>

#include <string>
#include <vector>

namespace rlh::kcudnn {

struct CudnnLib {
  std::string path;     // the file that was loaded
  size_t version = 0;   // cudnnGetVersion(): 9xxyy, e.g. 91900 for 9.19.0
  size_t (*GetVersion)() = nullptr;
  const char* (*GetErrorString)(cudnnStatus_t) = nullptr;
  void (*GetLastErrorString)(char*, size_t) = nullptr;  // optional (9.0+)
  cudnnStatus_t (*Create)(cudnnHandle_t*) = nullptr;
  cudnnStatus_t (*Destroy)(cudnnHandle_t) = nullptr;
  cudnnStatus_t (*SetStream)(cudnnHandle_t, cudaStream_t) = nullptr;
  cudnnStatus_t (*BackendCreateDescriptor)(cudnnBackendDescriptorType_t, cudnnBackendDescriptor_t*) = nullptr;
  cudnnStatus_t (*BackendDestroyDescriptor)(cudnnBackendDescriptor_t) = nullptr;
  cudnnStatus_t (*BackendFinalize)(cudnnBackendDescriptor_t) = nullptr;
  cudnnStatus_t (*BackendSetAttribute)(cudnnBackendDescriptor_t, cudnnBackendAttributeName_t,
                                       cudnnBackendAttributeType_t, int64_t, const void*) = nullptr;
  cudnnStatus_t (*BackendGetAttribute)(cudnnBackendDescriptor_t const, cudnnBackendAttributeName_t,
                                       cudnnBackendAttributeType_t, int64_t, int64_t*, void*) = nullptr;
  cudnnStatus_t (*BackendExecute)(cudnnHandle_t, cudnnBackendDescriptor_t, cudnnBackendDescriptor_t) = nullptr;

  // "9.19.0"
  std::string version_string() const;
  // "CUDNN_STATUS_...: <last error message>"
  std::string error(cudnnStatus_t s) const;
};

// The oldest runtime the provider builds graphs for: ragged (packed) softmax statistics and
// max_total_seq_len-sized backward scratch arrived in 9.6 (docs/kernels_cudnn.md).
constexpr size_t kMinCudnnVersion = 90600;

// Where the provider looks for libcudnn.so.9, in order (docs/kernels_cudnn.md): $RLH_CUDNN_LIB
// (a file or a folder), the default loader path, each folder of $LD_LIBRARY_PATH,
// /usr/local/cuda/lib64, then the site-packages/nvidia/cudnn/lib folders of the Python
// installations it can guess (system, ~/.local, pyenv, conda, $VIRTUAL_ENV, $CONDA_PREFIX).
std::vector<std::string> cudnn_candidates();

// Loads cuDNN once per process (thread-safe) and returns it; throws std::runtime_error with a
// one-line reason (every place tried) when none loads, lacks a function or is older than
// kMinCudnnVersion.
const CudnnLib& cudnn_lib();

}  // namespace rlh::kcudnn
