// TensorBoard event files, written natively.
//
// An event file is a sequence of TFRecords (uint64 length, masked CRC32C of the length bytes,
// payload, masked CRC32C of the payload), each payload one serialized tensorflow.Event. Only the
// handful of protobuf fields TensorBoard needs for scalars are encoded, by hand:
//   Event   { double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5; }
//   Summary { repeated Value value = 1; }
//   Value   { string tag = 1; float simple_value = 2; }
// Fields at their proto3 default (step 0) are omitted, as protobuf serializers do.
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <ctime>

#include "rlhost/sdk/crc32c.hpp"
#include "rlhost/sdk/metrics.hpp"
#include "rlhost/sdk/status.hpp"

namespace rlh::sdk {
namespace {

namespace fs = std::filesystem;

// Protobuf wire types.
constexpr uint32_t kVarint = 0;
constexpr uint32_t kFixed64 = 1;
constexpr uint32_t kLengthDelimited = 2;
constexpr uint32_t kFixed32 = 5;

void put_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7F) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}

void put_key(std::string& out, uint32_t field, uint32_t wire_type) {
  put_varint(out, (static_cast<uint64_t>(field) << 3) | wire_type);
}

void put_fixed(std::string& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
}

void put_double(std::string& out, uint32_t field, double v) {
  uint64_t bits;
  std::memcpy(&bits, &v, 8);
  put_key(out, field, kFixed64);
  put_fixed(out, bits, 8);
}

void put_float(std::string& out, uint32_t field, float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  put_key(out, field, kFixed32);
  put_fixed(out, bits, 4);
}

void put_bytes(std::string& out, uint32_t field, std::string_view bytes) {
  put_key(out, field, kLengthDelimited);
  put_varint(out, bytes.size());
  out.append(bytes);
}

// int64 is a plain varint of the two's-complement value (negative steps take 10 bytes).
void put_int64(std::string& out, uint32_t field, int64_t v) {
  if (v == 0) return;
  put_key(out, field, kVarint);
  put_varint(out, static_cast<uint64_t>(v));
}

std::string host_name() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof(buf) - 1) != 0 || buf[0] == '\0') return "localhost";
  return buf;
}

[[noreturn]] void io_error(const fs::path& file, const char* what, int err) {
  throw Error(RLH_E_UNAVAILABLE, file.string() + ": " + what + ": " + std::strerror(err));
}

}  // namespace

namespace tfevents {

std::string frame_record(std::string_view data) {
  std::string out;
  out.reserve(data.size() + 16);
  put_fixed(out, data.size(), 8);
  put_fixed(out, crc32c_mask(crc32c(out.data(), 8)), 4);
  out.append(data);
  put_fixed(out, crc32c_mask(crc32c(data)), 4);
  return out;
}

std::string encode_file_version_event(double wall_time) {
  std::string ev;
  put_double(ev, 1, wall_time);
  put_bytes(ev, 3, "brain.Event:2");
  return ev;
}

std::string encode_scalars_event(double wall_time, int64_t step,
                                 const std::vector<std::pair<std::string, double>>& values) {
  std::string summary;
  for (const auto& [tag, v] : values) {
    std::string value;
    put_bytes(value, 1, tag);
    put_float(value, 2, static_cast<float>(v));
    put_bytes(summary, 1, value);
  }
  std::string ev;
  put_double(ev, 1, wall_time);
  put_int64(ev, 2, step);
  put_bytes(ev, 5, summary);
  return ev;
}

}  // namespace tfevents

TensorBoardSink::TensorBoardSink(const fs::path& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw Error(RLH_E_UNAVAILABLE, dir.string() + ": cannot create folder: " + ec.message());
  timespec now{};
  ::clock_gettime(CLOCK_REALTIME, &now);
  const std::string base = "events.out.tfevents." + std::to_string(now.tv_sec) + "." + host_name();
  // Two writers started in the same second on one host would collide; "x" (O_EXCL) makes the
  // second pick the next suffix instead of interleaving records in one file.
  for (int attempt = 0; f_ == nullptr; ++attempt) {
    file_ = dir / (attempt == 0 ? base : base + "." + std::to_string(attempt));
    f_ = std::fopen(file_.c_str(), "wbx");
    if (f_ == nullptr && (errno != EEXIST || attempt > 1000)) io_error(file_, "cannot create", errno);
  }
  append_record(tfevents::encode_file_version_event(now.tv_sec + now.tv_nsec * 1e-9));
  flush();
}

TensorBoardSink::~TensorBoardSink() {
  if (f_ != nullptr) std::fclose(f_);
}

void TensorBoardSink::append_record(const std::string& payload) {
  const std::string rec = tfevents::frame_record(payload);
  if (std::fwrite(rec.data(), 1, rec.size(), f_) != rec.size()) io_error(file_, "write failed", errno);
}

void TensorBoardSink::write(const MetricsRow& row) {
  append_record(tfevents::encode_scalars_event(row.wall_time, row.step, row.values));
  flush();
}

void TensorBoardSink::flush() {
  if (f_ != nullptr && std::fflush(f_) != 0) io_error(file_, "flush failed", errno);
}

}  // namespace rlh::sdk
