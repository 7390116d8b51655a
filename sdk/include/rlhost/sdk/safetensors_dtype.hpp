// Element types of tensors as safetensors names them ("F32", "BF16", ...).
//
// Kept apart from safetensors.hpp so the model description (model_desc.hpp) can name a
// checkpoint dtype without pulling in file I/O. Names, sizes and the order of the enum follow the
// safetensors format specification; append new values at the end only (the enum crosses JSON by
// name, never by number, but keep it stable anyway).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

namespace rlh::sdk::st {

enum class DType : uint8_t {
  BOOL,
  U8,
  I8,
  F8_E5M2,
  F8_E4M3,
  I16,
  U16,
  F16,
  BF16,
  I32,
  U32,
  F32,
  F64,
  I64,
  U64,
};

// The safetensors spelling of a dtype ("BF16").
constexpr std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::BOOL: return "BOOL";
    case DType::U8: return "U8";
    case DType::I8: return "I8";
    case DType::F8_E5M2: return "F8_E5M2";
    case DType::F8_E4M3: return "F8_E4M3";
    case DType::I16: return "I16";
    case DType::U16: return "U16";
    case DType::F16: return "F16";
    case DType::BF16: return "BF16";
    case DType::I32: return "I32";
    case DType::U32: return "U32";
    case DType::F32: return "F32";
    case DType::F64: return "F64";
    case DType::I64: return "I64";
    case DType::U64: return "U64";
  }
  return "?";
}

// Parses a safetensors dtype name; nullopt for anything else (callers turn that into an error
// naming the file and tensor).
constexpr std::optional<DType> dtype_from_name(std::string_view s) {
  constexpr DType all[] = {DType::BOOL, DType::U8,  DType::I8,   DType::F8_E5M2, DType::F8_E4M3,
                           DType::I16,  DType::U16, DType::F16,  DType::BF16,    DType::I32,
                           DType::U32,  DType::F32, DType::F64,  DType::I64,     DType::U64};
  for (DType t : all)
    if (dtype_name(t) == s) return t;
  return std::nullopt;
}

// Bytes per element.
constexpr size_t dtype_size(DType t) {
  switch (t) {
    case DType::BOOL:
    case DType::U8:
    case DType::I8:
    case DType::F8_E5M2:
    case DType::F8_E4M3: return 1;
    case DType::I16:
    case DType::U16:
    case DType::F16:
    case DType::BF16: return 2;
    case DType::I32:
    case DType::U32:
    case DType::F32: return 4;
    case DType::F64:
    case DType::I64:
    case DType::U64: return 8;
  }
  return 0;
}

constexpr bool dtype_is_float(DType t) {
  return t == DType::F8_E5M2 || t == DType::F8_E4M3 || t == DType::F16 || t == DType::BF16 ||
         t == DType::F32 || t == DType::F64;
}

// HF config spelling ("bfloat16", "float32", "float16") -> dtype; nullopt if unknown.
constexpr std::optional<DType> dtype_from_torch_name(std::string_view s) {
  if (s == "float32" || s == "float") return DType::F32;
  if (s == "bfloat16") return DType::BF16;
  if (s == "float16" || s == "half") return DType::F16;
  if (s == "float64" || s == "double") return DType::F64;
  if (s == "float8_e4m3fn") return DType::F8_E4M3;
  if (s == "float8_e5m2") return DType::F8_E5M2;
  return std::nullopt;
}

// A training config's dtype setting as NeMo-RL's YAML spells it: torch's names with or without
// "torch." (Automodel's gate_precision, Megatron-Core's optimizer state dtypes) or Megatron's
// short fp32 / fp64 / bf16 / fp16; nullopt if unknown.
constexpr std::optional<DType> dtype_from_config_name(std::string_view s) {
  if (s.starts_with("torch.")) s.remove_prefix(6);
  if (s == "fp32") return DType::F32;
  if (s == "fp64") return DType::F64;
  if (s == "bf16") return DType::BF16;
  if (s == "fp16") return DType::F16;
  return dtype_from_torch_name(s);
}

}  // namespace rlh::sdk::st
