// Argument checks shared by COMM implementations (comm_mpi, comm_nccl): header-only, compiled
// into each plugin. Tensors must be contiguous (row-major strides), of a supported dtype, and
// agree in shape the way each collective requires; every failure is one line naming the call,
// the argument and what was wrong.
#pragma once

#include <cstdint>
#include <cstring>
#include <limits>
#include <string>

#include <nlohmann/json.hpp>

#include "rlhost/comm.h"
#include "rlhost/sdk/status.hpp"

namespace rlh::sdk::comm {

enum class DType { f32, f64, bf16, f16, i32, i64, u8, i8 };

inline const char* dtype_name(DType d) {
  switch (d) {
    case DType::f32: return "float32";
    case DType::f64: return "float64";
    case DType::bf16: return "bfloat16";
    case DType::f16: return "float16";
    case DType::i32: return "int32";
    case DType::i64: return "int64";
    case DType::u8: return "uint8";
    case DType::i8: return "int8";
  }
  return "?";
}

inline size_t dtype_bytes(DType d) {
  switch (d) {
    case DType::f64:
    case DType::i64: return 8;
    case DType::f32:
    case DType::i32: return 4;
    case DType::bf16:
    case DType::f16: return 2;
    case DType::u8:
    case DType::i8: return 1;
  }
  return 1;
}

inline bool is_float(DType d) { return d == DType::f32 || d == DType::f64 || d == DType::bf16 || d == DType::f16; }

inline const char* op_name(int32_t op) {
  switch (op) {
    case RLH_REDUCE_SUM: return "sum";
    case RLH_REDUCE_MAX: return "max";
    case RLH_REDUCE_MIN: return "min";
    case RLH_REDUCE_AVG: return "avg";
    default: return "?";
  }
}

inline std::string device_name(const rlh_device& d) {
  switch (d.device_type) {
    case RLH_DEVICE_CPU: return "cpu";
    case RLH_DEVICE_CUDA: return "cuda:" + std::to_string(d.device_id);
    case RLH_DEVICE_CUDA_HOST: return "cuda_host";
    case RLH_DEVICE_CUDA_MANAGED: return "cuda_managed:" + std::to_string(d.device_id);
    default: return "device type " + std::to_string(d.device_type);
  }
}

// Memory the host can read and write directly (no staging).
inline bool host_accessible(const rlh_device& d) {
  return d.device_type == RLH_DEVICE_CPU || d.device_type == RLH_DEVICE_CUDA_HOST;
}

// A checked view of one tensor argument.
struct View {
  void* data = nullptr;
  rlh_device device{};
  DType dtype = DType::f32;
  int64_t numel = 0;
  int64_t dim0 = 1;  // shape[0] (1 for a scalar)
  size_t bytes() const { return static_cast<size_t>(numel) * dtype_bytes(dtype); }
  std::string describe() const { return std::string(dtype_name(dtype)) + " x " + std::to_string(numel); }
};

// `call` and `arg` name the failure: "all_gather: out: ...".
inline View view_of(const rlh_tensor* t, const char* call, const char* arg) {
  auto fail = [&](const std::string& why) {
    throw Error(RLH_E_INVALID_ARGUMENT, std::string(call) + ": " + arg + ": " + why);
  };
  if (t == nullptr) fail("tensor is NULL");
  View v;
  const rlh_dtype dt = t->dtype;
  if (dt.lanes != 1) fail("vector dtypes (lanes " + std::to_string(dt.lanes) + ") are not supported");
  if (dt.code == RLH_DTYPE_FLOAT && dt.bits == 32) v.dtype = DType::f32;
  else if (dt.code == RLH_DTYPE_FLOAT && dt.bits == 64) v.dtype = DType::f64;
  else if (dt.code == RLH_DTYPE_FLOAT && dt.bits == 16) v.dtype = DType::f16;
  else if (dt.code == RLH_DTYPE_BFLOAT && dt.bits == 16) v.dtype = DType::bf16;
  else if (dt.code == RLH_DTYPE_INT && dt.bits == 32) v.dtype = DType::i32;
  else if (dt.code == RLH_DTYPE_INT && dt.bits == 64) v.dtype = DType::i64;
  else if (dt.code == RLH_DTYPE_INT && dt.bits == 8) v.dtype = DType::i8;
  else if (dt.code == RLH_DTYPE_UINT && dt.bits == 8) v.dtype = DType::u8;
  else
    fail("dtype (code " + std::to_string(dt.code) + ", " + std::to_string(dt.bits) +
         " bits) is not one of float32, float64, bfloat16, float16, int32, int64, int8, uint8");
  if (t->ndim < 0 || t->ndim > 16) fail("ndim " + std::to_string(t->ndim) + " is out of range");
  if (t->ndim > 0 && t->shape == nullptr) fail("shape is NULL");
  int64_t n = 1;
  for (int32_t i = 0; i < t->ndim; ++i) {
    const int64_t s = t->shape[i];
    if (s < 0) fail("shape[" + std::to_string(i) + "] = " + std::to_string(s) + " is negative");
    if (s != 0 && n > std::numeric_limits<int64_t>::max() / 16 / s) fail("too many elements");
    n *= s;
  }
  // Row-major contiguous: a dimension of size 1 may have any stride.
  if (t->ndim > 0 && t->strides != nullptr) {
    int64_t expect = 1;
    for (int32_t i = t->ndim - 1; i >= 0; --i) {
      if (t->shape[i] != 1 && t->strides[i] != expect)
        fail("not contiguous (stride[" + std::to_string(i) + "] = " + std::to_string(t->strides[i]) + ", expected " +
             std::to_string(expect) + ")");
      expect *= t->shape[i];
    }
  }
  if (n > 0 && t->data == nullptr) fail("data is NULL");
  v.data = static_cast<char*>(t->data) + t->byte_offset;
  v.device = t->device;
  v.numel = n;
  v.dim0 = t->ndim > 0 ? t->shape[0] : 1;
  return v;
}

inline void check_op(int32_t op, const char* call) {
  if (op < RLH_REDUCE_SUM || op > RLH_REDUCE_AVG)
    throw Error(RLH_E_INVALID_ARGUMENT, std::string(call) + ": reduction " + std::to_string(op) +
                                            " is not one of RLH_REDUCE_SUM, MAX, MIN, AVG");
}

inline void check_same_kind(const View& a, const View& b, const char* call) {
  if (a.dtype != b.dtype)
    throw Error(RLH_E_INVALID_ARGUMENT, std::string(call) + ": in is " + dtype_name(a.dtype) + " but out is " + dtype_name(b.dtype));
  if (a.device.device_type != b.device.device_type || a.device.device_id != b.device.device_id)
    throw Error(RLH_E_INVALID_ARGUMENT, std::string(call) + ": in is on " + device_name(a.device) + " but out is on " +
                                            device_name(b.device));
}

// True when the byte ranges overlap (in-place use is detected by the callers before this).
inline bool overlaps(const View& a, const View& b) {
  const auto* pa = static_cast<const char*>(a.data);
  const auto* pb = static_cast<const char*>(b.data);
  return a.bytes() > 0 && b.bytes() > 0 && pa < pb + b.bytes() && pb < pa + a.bytes();
}

// The timeout a communicator starts with: create()'s {"timeout_ms": N}, else the host's
// `rlhost.comm_timeout_s`, else `fallback_ms`. Throws INVALID_ARGUMENT naming a bad value.
inline int64_t initial_timeout_ms(const rlh_host_api* host, const nlohmann::json& create_cfg, int64_t fallback_ms) {
  if (create_cfg.is_object() && create_cfg.contains("timeout_ms")) {
    const auto& v = create_cfg["timeout_ms"];
    if (!v.is_number() || v.get<double>() <= 0)
      throw Error(RLH_E_INVALID_ARGUMENT, "communicator config timeout_ms must be a positive number, got " + v.dump());
    return static_cast<int64_t>(v.get<double>());
  }
  if (host != nullptr && host->config_get != nullptr) {
    std::string text;
    rlh_status* s = host->config_get(host->ctx, "rlhost.comm_timeout_s", write_to_string, &text);
    if (s == nullptr) {
      const auto v = nlohmann::json::parse(text, nullptr, false);
      if (!v.is_number() || !(v.get<double>() > 0) || v.get<double>() > 1e7)
        throw Error(RLH_E_INVALID_ARGUMENT, "config key 'rlhost.comm_timeout_s' must be a positive number of seconds, got " + text);
      return static_cast<int64_t>(v.get<double>() * 1000.0);
    }
    rlh_status_destroy(s);  // not set
  }
  return fallback_ms;
}

inline std::string seconds_text(int64_t ms) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g s", static_cast<double>(ms) / 1000.0);
  return buf;
}

// bfloat16 <-> float32 (round to nearest even; NaN kept quiet).
inline float bf16_to_f32(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

}  // namespace rlh::sdk::comm
