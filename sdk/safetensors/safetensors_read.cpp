// Reading safetensors files and sharded checkpoints, with strict validation.
//
// Layout of a file: 8-byte little-endian header length N, N bytes of JSON header, then the data
// section. The header maps tensor names to {"dtype", "shape", "data_offsets": [begin, end]}
// (offsets relative to the data section) plus an optional "__metadata__" string map.
//
// We refuse anything the reference implementation refuses (offsets that do not tile the data
// section exactly, sizes that do not match dtype x shape) and also duplicate keys, which JSON
// parsers otherwise resolve silently, so a damaged or hostile file can never make us read the
// wrong bytes.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>
#include <stdexcept>

#include <nlohmann/json.hpp>

#include "rlhost/sdk/input_file.hpp"
#include "rlhost/sdk/safetensors.hpp"

namespace rlh::sdk::st {

namespace fs = std::filesystem;
using ojson = nlohmann::ordered_json;

namespace {

[[noreturn]] void fail(const std::string& label, const std::string& what) {
  throw std::runtime_error("safetensors: " + label + ": " + what);
}

[[noreturn]] void fail_tensor(const std::string& label, const std::string& tensor,
                              const std::string& what) {
  throw std::runtime_error("safetensors: " + label + ": tensor '" + tensor + "': " + what);
}

// Cheap pre-scan so the parser never sees nesting deeper than kMaxJsonDepth.
void check_depth(std::string_view text, const std::string& label) {
  int depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\')
        ++i;
      else if (c == '"')
        in_string = false;
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      if (++depth > kMaxJsonDepth)
        fail(label, "JSON nested deeper than " + std::to_string(kMaxJsonDepth) + " levels");
    } else if (c == '}' || c == ']') {
      --depth;
    }
  }
}

uint64_t read_u64_le(const std::byte* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(p[i]);
  return v;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// strict JSON

ojson parse_json_strict(std::string_view text, const std::string& label) {
  check_depth(text, label);
  // One set of seen keys per open object; the callback sees keys in document order.
  std::vector<std::set<std::string>> open_objects;
  auto cb = [&](int /*depth*/, ojson::parse_event_t event, ojson& parsed) -> bool {
    switch (event) {
      case ojson::parse_event_t::object_start:
        open_objects.emplace_back();
        break;
      case ojson::parse_event_t::object_end:
        if (!open_objects.empty()) open_objects.pop_back();
        break;
      case ojson::parse_event_t::key: {
        const auto& key = parsed.get_ref<const std::string&>();
        if (!open_objects.empty() && !open_objects.back().insert(key).second)
          fail(label, "duplicate key '" + key + "' in JSON");
        break;
      }
      default:
        break;
    }
    return true;
  };
  try {
    return ojson::parse(text.begin(), text.end(), cb, /*allow_exceptions=*/true);
  } catch (const ojson::exception& e) {
    // nlohmann messages are one line; keep only what follows its "[json.exception...]" tag.
    std::string msg = e.what();
    if (auto pos = msg.find("] "); pos != std::string::npos) msg = msg.substr(pos + 2);
    fail(label, "invalid JSON: " + msg);
  }
}

// ---------------------------------------------------------------------------------------------
// File

uint64_t TensorInfo::numel() const {
  uint64_t n = 1;
  for (int64_t d : shape) n *= static_cast<uint64_t>(d);
  return n;
}

// Owns the bytes of a file: an mmap, or a vector for from_bytes.
struct File::Storage {
  void* map = nullptr;
  size_t map_size = 0;
  std::vector<std::byte> owned;
  ~Storage() {
    if (map) munmap(map, map_size);
  }
};

File File::open(const std::string& path) {
  File f;
  f.path_ = path;
  // Opened without blocking and checked to be a regular file before anything is mapped: a FIFO
  // or /dev/zero named model.safetensors is refused instead of hanging or mapping a device.
  uint64_t file_size = 0;
  InputFd fd;
  try {
    fd = open_input_file(path, 0, "safetensors file", &file_size);
  } catch (const InputError& e) {
    throw std::runtime_error(e.what());
  }
  auto storage = std::make_shared<Storage>();
  const size_t size = static_cast<size_t>(file_size);
  if (size > 0) {
    void* m = mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd.get(), 0);
    if (m == MAP_FAILED) fail(path, std::string("cannot mmap: ") + std::strerror(errno));
    storage->map = m;
    storage->map_size = size;
  }
  fd.reset();  // the mapping stays valid
  f.storage_ = storage;
  f.parse({static_cast<const std::byte*>(storage->map), size});
  return f;
}

File File::from_bytes(std::vector<std::byte> bytes, const std::string& label) {
  File f;
  f.path_ = label;
  auto storage = std::make_shared<Storage>();
  storage->owned = std::move(bytes);
  f.storage_ = storage;
  f.parse({storage->owned.data(), storage->owned.size()});
  return f;
}

void File::parse(std::span<const std::byte> bytes) {
  const std::string& label = path_;
  if (bytes.size() < 8)
    fail(label, "truncated: " + std::to_string(bytes.size()) +
                    " bytes, shorter than the 8-byte header length");
  const uint64_t n = read_u64_le(bytes.data());
  if (n > kMaxHeaderBytes)
    fail(label, "header length " + std::to_string(n) + " exceeds the " +
                    std::to_string(kMaxHeaderBytes) + "-byte limit");
  if (n > bytes.size() - 8)
    fail(label, "header length " + std::to_string(n) + " is longer than the file (" +
                    std::to_string(bytes.size()) + " bytes)");
  header_size_ = n;
  data_ = bytes.data() + 8 + n;
  data_size_ = bytes.size() - 8 - n;

  const std::string_view text(reinterpret_cast<const char*>(bytes.data() + 8), n);
  const ojson header = parse_json_strict(text, label + " (header)");
  if (!header.is_object()) fail(label, "header is not a JSON object");

  tensors_.clear();
  metadata_.clear();
  for (const auto& [key, value] : header.items()) {
    if (key == "__metadata__") {
      if (!value.is_object()) fail(label, "__metadata__ is not an object");
      for (const auto& [mk, mv] : value.items()) {
        if (!mv.is_string()) fail(label, "__metadata__ value of '" + mk + "' is not a string");
        metadata_.emplace_back(mk, mv.get<std::string>());
      }
      continue;
    }
    if (!value.is_object()) fail_tensor(label, key, "entry is not an object");
    TensorInfo t;
    t.name = key;
    auto dt = value.find("dtype");
    if (dt == value.end() || !dt->is_string()) fail_tensor(label, key, "missing dtype");
    auto parsed = dtype_from_name(dt->get_ref<const std::string&>());
    if (!parsed) fail_tensor(label, key, "unknown dtype '" + dt->get<std::string>() + "'");
    t.dtype = *parsed;

    auto sh = value.find("shape");
    if (sh == value.end() || !sh->is_array()) fail_tensor(label, key, "missing shape");
    uint64_t numel = 1;
    for (const auto& d : *sh) {
      if (!d.is_number_unsigned() ||
          d.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
        fail_tensor(label, key, "shape entries must be non-negative integers");
      const uint64_t dim = d.get<uint64_t>();
      if (dim != 0 && numel > std::numeric_limits<uint64_t>::max() / dim)
        fail_tensor(label, key, "shape overflows");
      numel *= dim;
      t.shape.push_back(static_cast<int64_t>(dim));
    }
    const uint64_t esize = dtype_size(t.dtype);
    if (numel > std::numeric_limits<uint64_t>::max() / esize) fail_tensor(label, key, "shape overflows");

    auto off = value.find("data_offsets");
    if (off == value.end() || !off->is_array() || off->size() != 2 || !(*off)[0].is_number_unsigned() ||
        !(*off)[1].is_number_unsigned())
      fail_tensor(label, key, "data_offsets must be two non-negative integers");
    t.begin = (*off)[0].get<uint64_t>();
    t.end = (*off)[1].get<uint64_t>();
    if (t.end < t.begin)
      fail_tensor(label, key, "data_offsets [" + std::to_string(t.begin) + ", " +
                                  std::to_string(t.end) + "] end before begin");
    if (t.end > data_size_)
      fail_tensor(label, key, "data_offsets end " + std::to_string(t.end) +
                                  " is past the data section (" + std::to_string(data_size_) +
                                  " bytes; file truncated?)");
    if (t.end - t.begin != numel * esize)
      fail_tensor(label, key, "data_offsets span " + std::to_string(t.end - t.begin) +
                                  " bytes but " + std::string(dtype_name(t.dtype)) + " shape needs " +
                                  std::to_string(numel * esize));
    for (auto it = value.begin(); it != value.end(); ++it)
      if (it.key() != "dtype" && it.key() != "shape" && it.key() != "data_offsets")
        fail_tensor(label, key, "unexpected field '" + it.key() + "'");
    tensors_.push_back(std::move(t));
  }

  // The tensors must tile [0, data_size) exactly: no overlap, no hole, nothing left over.
  std::vector<size_t> by_offset(tensors_.size());
  for (size_t i = 0; i < by_offset.size(); ++i) by_offset[i] = i;
  std::stable_sort(by_offset.begin(), by_offset.end(), [&](size_t a, size_t b) {
    return std::pair(tensors_[a].begin, tensors_[a].end) < std::pair(tensors_[b].begin, tensors_[b].end);
  });
  uint64_t cursor = 0;
  for (size_t i : by_offset) {
    const TensorInfo& t = tensors_[i];
    if (t.begin < cursor) fail_tensor(label, t.name, "data overlaps another tensor");
    if (t.begin > cursor)
      fail_tensor(label, t.name, "gap in the data section before offset " + std::to_string(t.begin));
    cursor = t.end;
  }
  if (cursor != data_size_)
    fail(label, "data section has " + std::to_string(data_size_) + " bytes but tensors cover " +
                    std::to_string(cursor));

  sorted_by_name_.resize(tensors_.size());
  for (size_t i = 0; i < tensors_.size(); ++i) sorted_by_name_[i] = i;
  std::sort(sorted_by_name_.begin(), sorted_by_name_.end(),
            [&](size_t a, size_t b) { return tensors_[a].name < tensors_[b].name; });
}

const TensorInfo* File::find(std::string_view name) const {
  auto it = std::lower_bound(sorted_by_name_.begin(), sorted_by_name_.end(), name,
                             [&](size_t i, std::string_view n) { return tensors_[i].name < n; });
  if (it == sorted_by_name_.end() || tensors_[*it].name != name) return nullptr;
  return &tensors_[*it];
}

const TensorInfo& File::at(std::string_view name) const {
  const TensorInfo* t = find(name);
  if (!t) fail(path_, "no tensor '" + std::string(name) + "'");
  return *t;
}

std::span<const std::byte> File::data(const TensorInfo& t) const {
  return {data_ + t.begin, static_cast<size_t>(t.end - t.begin)};
}

std::vector<float> File::read_f32(std::string_view name) const {
  const TensorInfo& t = at(name);
  std::vector<float> out(static_cast<size_t>(t.numel()));
  convert_to_f32(t.dtype, data(t).data(), out.size(), out.data());
  return out;
}

std::vector<double> File::read_f64(std::string_view name) const {
  const TensorInfo& t = at(name);
  std::vector<double> out(static_cast<size_t>(t.numel()));
  convert_to_f64(t.dtype, data(t).data(), out.size(), out.data());
  return out;
}

// ---------------------------------------------------------------------------------------------
// Checkpoint

namespace {

std::string read_text_file(const std::string& path) {
  try {
    return read_input_file(path, 256u << 20, "safetensors index");  // regular files only
  } catch (const InputError& e) {
    throw std::runtime_error(e.what());
  }
}

// A shard name from an index must stay inside the checkpoint folder.
bool safe_relative(const std::string& name) {
  if (name.empty() || name.front() == '/') return false;
  for (const auto& part : fs::path(name))
    if (part == "..") return false;
  return true;
}

}  // namespace

Checkpoint Checkpoint::open(const std::string& path) {
  Checkpoint c;
  c.path_ = path;
  std::error_code ec;
  std::string index_path;
  std::string single_path;
  if (fs::is_directory(path, ec)) {
    const fs::path dir(path);
    if (fs::exists(dir / "model.safetensors.index.json", ec)) {
      index_path = (dir / "model.safetensors.index.json").string();
    } else if (fs::exists(dir / "model.safetensors", ec)) {
      single_path = (dir / "model.safetensors").string();
    } else {
      // Other prefixes (e.g. "consolidated"): accept exactly one index, else exactly one file.
      std::vector<std::string> indexes, files;
      for (const auto& e : fs::directory_iterator(dir, ec)) {
        const std::string fname = e.path().filename().string();
        if (fname.ends_with(".safetensors.index.json")) indexes.push_back(e.path().string());
        else if (fname.ends_with(".safetensors")) files.push_back(e.path().string());
      }
      if (indexes.size() == 1) index_path = indexes[0];
      else if (indexes.empty() && files.size() == 1) single_path = files[0];
      else
        throw std::runtime_error("safetensors: " + path +
                                 ": no model.safetensors or model.safetensors.index.json" +
                                 (indexes.size() + files.size() > 1 ? " (and several other candidates)" : ""));
    }
  } else if (path.ends_with(".json")) {
    index_path = path;
  } else {
    single_path = path;
  }

  if (!single_path.empty()) {
    c.files_.push_back(File::open(single_path));
    for (const auto& t : c.files_[0].tensors()) c.names_.push_back(t.name);
  } else {
    c.sharded_ = true;
    const ojson index = parse_json_strict(read_text_file(index_path), index_path);
    if (!index.is_object()) fail(index_path, "index is not a JSON object");
    auto wm = index.find("weight_map");
    if (wm == index.end() || !wm->is_object()) fail(index_path, "index has no weight_map object");
    const fs::path dir = fs::path(index_path).parent_path();
    std::vector<std::string> shard_names;
    std::vector<size_t> file_of_tensor;
    for (const auto& [tensor, shard] : wm->items()) {
      if (!shard.is_string()) fail_tensor(index_path, tensor, "weight_map value is not a string");
      const auto& sname = shard.get_ref<const std::string&>();
      if (!safe_relative(sname))
        fail_tensor(index_path, tensor, "shard name '" + sname + "' leaves the checkpoint folder");
      auto it = std::find(shard_names.begin(), shard_names.end(), sname);
      if (it == shard_names.end()) {
        const std::string shard_path = (dir / sname).string();
        if (!fs::exists(shard_path, ec))
          fail_tensor(index_path, tensor, "shard file " + shard_path + " does not exist");
        shard_names.push_back(sname);
        c.files_.push_back(File::open(shard_path));
        it = shard_names.end() - 1;
      }
      c.names_.push_back(tensor);
      file_of_tensor.push_back(static_cast<size_t>(it - shard_names.begin()));
    }
    // Every tensor the index names must be in its shard.
    for (size_t i = 0; i < c.names_.size(); ++i) {
      const File& f = c.files_[file_of_tensor[i]];
      const TensorInfo* t = f.find(c.names_[i]);
      if (!t)
        fail_tensor(index_path, c.names_[i], "index places it in " + f.path() + " which does not hold it");
      c.index_.push_back({c.names_[i], file_of_tensor[i], static_cast<size_t>(t - f.tensors().data())});
    }
  }
  if (!c.sharded_) {
    const File& f = c.files_[0];
    for (size_t i = 0; i < f.tensors().size(); ++i) c.index_.push_back({f.tensors()[i].name, 0, i});
  }
  std::sort(c.index_.begin(), c.index_.end(),
            [](const Entry& a, const Entry& b) { return a.name < b.name; });
  return c;
}

Checkpoint::Ref Checkpoint::find(std::string_view name) const {
  auto it = std::lower_bound(index_.begin(), index_.end(), name,
                             [](const Entry& e, std::string_view n) { return e.name < n; });
  if (it == index_.end() || it->name != name) return {};
  const File& f = files_[it->file];
  return {&f, &f.tensors()[it->tensor]};
}

Checkpoint::Ref Checkpoint::at(std::string_view name) const {
  Ref r = find(name);
  if (!r.info) fail(path_, "missing tensor '" + std::string(name) + "'");
  return r;
}

std::vector<float> Checkpoint::read_f32(std::string_view name) const {
  Ref r = at(name);
  return r.file->read_f32(name);
}

std::vector<double> Checkpoint::read_f64(std::string_view name) const {
  Ref r = at(name);
  return r.file->read_f64(name);
}

}  // namespace rlh::sdk::st
