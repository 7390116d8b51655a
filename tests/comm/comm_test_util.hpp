// Helpers for the communicator tests: a host holding one COMM plugin, tensors of every dtype
// over byte buffers, and a gtest main that prints only rank 0's progress (every rank's
// failures keep their rank).
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

#include "rlhost/comm.h"
#include "rlhost/host.h"
#include "rlhost/sdk/comm_args.hpp"
#include "rlhost/sdk/status.hpp"

namespace commtest {

struct DT {
  const char* name;
  rlh_dtype dtype;
  size_t bytes;
  bool is_float;
};

inline const std::vector<DT>& all_dtypes() {
  static const std::vector<DT> v = {
      {"float32", {RLH_DTYPE_FLOAT, 32, 1}, 4, true},  {"float64", {RLH_DTYPE_FLOAT, 64, 1}, 8, true},
      {"bfloat16", {RLH_DTYPE_BFLOAT, 16, 1}, 2, true}, {"int32", {RLH_DTYPE_INT, 32, 1}, 4, false},
      {"int64", {RLH_DTYPE_INT, 64, 1}, 8, false},     {"uint8", {RLH_DTYPE_UINT, 8, 1}, 1, false},
      {"int8", {RLH_DTYPE_INT, 8, 1}, 1, false},       {"float16", {RLH_DTYPE_FLOAT, 16, 1}, 2, true},
  };
  return v;
}

// float16 bits for small exactly representable values (tests use integers and halves).
inline uint16_t f32_to_f16(float f) {
  if (f == 0.0f) return 0;
  const uint16_t sign = f < 0 ? 0x8000 : 0;
  f = std::fabs(f);
  int e = 0;
  const float m = std::frexp(f, &e);  // f = m * 2^e, m in [0.5, 1)
  const int exp16 = e - 1 + 15;
  const uint16_t mant = static_cast<uint16_t>(std::lround((m * 2.0f - 1.0f) * 1024.0f));
  return static_cast<uint16_t>(sign | (exp16 << 10) | mant);
}
inline float f16_to_f32(uint16_t h) {
  if ((h & 0x7fff) == 0) return 0.0f;
  const int exp16 = (h >> 10) & 0x1f;
  const float v = std::ldexp(1.0f + static_cast<float>(h & 0x3ff) / 1024.0f, exp16 - 15);
  return (h & 0x8000) ? -v : v;
}

inline void put(const DT& d, void* p, size_t i, double v) {
  char* b = static_cast<char*>(p) + i * d.bytes;
  const std::string n = d.name;
  if (n == "float32") { float x = static_cast<float>(v); std::memcpy(b, &x, 4); }
  else if (n == "float64") { std::memcpy(b, &v, 8); }
  else if (n == "bfloat16") { uint16_t x = rlh::sdk::comm::f32_to_bf16(static_cast<float>(v)); std::memcpy(b, &x, 2); }
  else if (n == "float16") { uint16_t x = f32_to_f16(static_cast<float>(v)); std::memcpy(b, &x, 2); }
  else if (n == "int32") { int32_t x = static_cast<int32_t>(v); std::memcpy(b, &x, 4); }
  else if (n == "int64") { int64_t x = static_cast<int64_t>(v); std::memcpy(b, &x, 8); }
  else if (n == "uint8") { uint8_t x = static_cast<uint8_t>(v); std::memcpy(b, &x, 1); }
  else { int8_t x = static_cast<int8_t>(v); std::memcpy(b, &x, 1); }
}

inline double get(const DT& d, const void* p, size_t i) {
  const char* b = static_cast<const char*>(p) + i * d.bytes;
  const std::string n = d.name;
  if (n == "float32") { float x; std::memcpy(&x, b, 4); return x; }
  if (n == "float64") { double x; std::memcpy(&x, b, 8); return x; }
  if (n == "bfloat16") { uint16_t x; std::memcpy(&x, b, 2); return rlh::sdk::comm::bf16_to_f32(x); }
  if (n == "float16") { uint16_t x; std::memcpy(&x, b, 2); return f16_to_f32(x); }
  if (n == "int32") { int32_t x; std::memcpy(&x, b, 4); return x; }
  if (n == "int64") { int64_t x; std::memcpy(&x, b, 8); return static_cast<double>(x); }
  if (n == "uint8") { uint8_t x; std::memcpy(&x, b, 1); return x; }
  int8_t x;
  std::memcpy(&x, b, 1);
  return x;
}

// A host tensor over its own bytes.
struct Tensor {
  DT d;
  std::vector<int64_t> shape, strides;
  std::vector<char> bytes;
  rlh_tensor t{};

  Tensor(const DT& dt, std::vector<int64_t> s) : d(dt), shape(std::move(s)) {
    int64_t n = 1;
    strides.resize(shape.size());
    for (size_t i = shape.size(); i-- > 0;) {
      strides[i] = n;
      n *= shape[i];
    }
    bytes.assign(static_cast<size_t>(n) * d.bytes + 1, 0);  // +1: never a NULL data pointer
    t.data = bytes.data();
    t.device = {RLH_DEVICE_CPU, 0};
    t.ndim = static_cast<int32_t>(shape.size());
    t.dtype = d.dtype;
    t.shape = shape.data();
    t.strides = strides.data();
  }
  Tensor(const Tensor&) = delete;
  size_t numel() const { return (bytes.size() - 1) / d.bytes; }
  void set(size_t i, double v) { put(d, bytes.data(), i, v); }
  double at(size_t i) const { return get(d, bytes.data(), i); }
  const rlh_tensor* p() const { return &t; }
};

// The status as "CODE: message" (empty for success), destroying it.
inline std::string outcome(rlh_status* s) {
  if (s == nullptr) return "";
  std::string m = std::string(rlh_code_name(s->code)) + ": " + rlh::sdk::status_message(s);
  rlh_status_destroy(s);
  return m;
}

// A host with `plugin` loaded and its world communicator.
struct World {
  rlhost_t* host = nullptr;
  const rlh_comm_api* api = nullptr;
  rlh_comm* comm = nullptr;

  void open(const char* plugin, const std::string& yaml) {
    rlh::sdk::check(rlhost_create(&host));
    rlh::sdk::check(rlhost_load_plugin(host, plugin));
    if (!yaml.empty()) rlh::sdk::check(rlhost_load_config_text(host, yaml.data(), yaml.size(), "test"));
    const rlh_host_api* h = rlhost_services(host);
    rlh::sdk::check(h->get_comm(h->ctx, &api, &comm), "get_comm");
  }
  int rank() const { return api->rank(comm); }
  int size() const { return api->size(comm); }
};

// Prints rank 0's progress as usual; other ranks print only their failures, prefixed.
class RankPrinter : public testing::EmptyTestEventListener {
 public:
  explicit RankPrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const testing::TestPartResult& r) override {
    if (r.failed())
      std::cerr << "[rank " << rank_ << "] " << (r.file_name() ? r.file_name() : "") << ":" << r.line_number() << ": "
                << r.summary() << std::endl;
  }

 private:
  int rank_;
};

inline void quiet_other_ranks() {
  const char* r = std::getenv("OMPI_COMM_WORLD_RANK");
  const int rank = r != nullptr ? std::atoi(r) : 0;
  if (rank == 0) return;
  auto& listeners = testing::UnitTest::GetInstance()->listeners();
  delete listeners.Release(listeners.default_result_printer());
  listeners.Append(new RankPrinter(rank));
}

}  // namespace commtest
