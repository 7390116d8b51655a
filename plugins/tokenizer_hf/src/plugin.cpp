// The tokenizer_hf plugin: the RLH_KIND_TOKENIZER component over rlh_tokenizer (see
// abi/include/rlhost/tokenizer.h). Every entry point converts C++ exceptions to rlh_status.
#include <nlohmann/json.hpp>  // messages / extra variables / info

#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "rlhost/sdk/json_input.hpp"
#include "rlhost/sdk/plugin.hpp"
#include "rlhost/tokenizer.h"
#include "rlhost/tokenizer/chat_template.hpp"
#include "rlhost/tokenizer/tokenizer.hpp"

namespace {

using rlh::sdk::Error;

struct Instance {
  rlh::sdk::Host host;
  rlh::tok::Tokenizer tok;
  std::optional<rlh::tok::ChatTemplate> chat;
};

rlh::sdk::MakeStatusFn make_of(const rlh_tokenizer* self) {
  return self ? reinterpret_cast<const Instance*>(self)->host.make_status() : nullptr;
}

rlh_status* create(const rlh_host_api* host, const char* path, rlh_tokenizer** out) {
  return rlh::sdk::guard(host ? host->make_status : nullptr, [&] {
    if (!out) throw Error(RLH_E_INVALID_ARGUMENT, "tokenizer create: out is NULL");
    *out = nullptr;
    if (!path || !*path) throw Error(RLH_E_INVALID_ARGUMENT, "tokenizer create: empty path");
    std::error_code ec;
    const bool exists = std::filesystem::exists(path, ec);
    std::optional<rlh::tok::Tokenizer> tok;
    try {
      tok.emplace(rlh::tok::Tokenizer::from_pretrained(path));
    } catch (const std::runtime_error& e) {
      // A path that names nothing (and no cached hub id) is NOT_FOUND; a bad file is invalid.
      throw Error(exists ? RLH_E_INVALID_ARGUMENT : RLH_E_NOT_FOUND, e.what());
    }
    auto inst = std::unique_ptr<Instance>(new Instance{rlh::sdk::Host(host), std::move(*tok), std::nullopt});
    try {
      inst->chat = inst->tok.chat_template();
    } catch (const std::runtime_error& e) {
      throw Error(RLH_E_INVALID_ARGUMENT, std::string(path) + ": " + e.what());
    }
    *out = reinterpret_cast<rlh_tokenizer*>(inst.release());
  });
}

void destroy(rlh_tokenizer* self) { delete reinterpret_cast<Instance*>(self); }

rlh_status* encode(const rlh_tokenizer* self, const char* text, size_t len, uint64_t flags, rlh_write_fn write,
                   void* user) {
  return rlh::sdk::guard(make_of(self), [&] {
    if (!self || !write || (!text && len)) throw Error(RLH_E_INVALID_ARGUMENT, "encode: NULL argument");
    const auto& inst = *reinterpret_cast<const Instance*>(self);
    const auto ids = inst.tok.encode(std::string_view(text ? text : "", len), (flags & RLH_ENCODE_ADD_SPECIAL_TOKENS) != 0);
    write(user, ids.data(), ids.size() * sizeof(int32_t));
  });
}

rlh_status* decode(const rlh_tokenizer* self, const int32_t* ids, size_t count, uint64_t flags, rlh_write_fn write,
                   void* user) {
  return rlh::sdk::guard(make_of(self), [&] {
    if (!self || !write || (!ids && count)) throw Error(RLH_E_INVALID_ARGUMENT, "decode: NULL argument");
    const auto& inst = *reinterpret_cast<const Instance*>(self);
    for (size_t i = 0; i < count; ++i) {
      if (!inst.tok.id_to_token(ids[i])) {
        throw Error(RLH_E_OUT_OF_RANGE, "decode: id " + std::to_string(ids[i]) + " at position " + std::to_string(i) +
                                            " is not in the vocabulary");
      }
    }
    const std::string text = inst.tok.decode(std::span<const int32_t>(ids, count), (flags & RLH_DECODE_SKIP_SPECIAL_TOKENS) != 0);
    write(user, text.data(), text.size());
  });
}

nlohmann::json parse_arg(const char* p, size_t len, const char* what) {
  try {
    return rlh::sdk::parse_json_input(std::string_view(p, len), std::string("apply_chat_template: ") + what);
  } catch (const rlh::sdk::InputError& e) {
    throw Error(RLH_E_INVALID_ARGUMENT, e.what());
  }
}

rlh_status* apply_chat_template(const rlh_tokenizer* self, const char* messages_json, size_t messages_len,
                                uint8_t add_generation_prompt, const char* extra_json, size_t extra_len,
                                rlh_write_fn write, void* user) {
  return rlh::sdk::guard(make_of(self), [&] {
    if (!self || !write || !messages_json) throw Error(RLH_E_INVALID_ARGUMENT, "apply_chat_template: NULL argument");
    const auto& inst = *reinterpret_cast<const Instance*>(self);
    if (!inst.chat) throw Error(RLH_E_FAILED_PRECONDITION, "apply_chat_template: this tokenizer has no chat template");
    const auto messages = parse_arg(messages_json, messages_len, "messages");
    if (!messages.is_array()) throw Error(RLH_E_INVALID_ARGUMENT, "apply_chat_template: messages must be a JSON array");
    nlohmann::json extra = nlohmann::json::object();
    if (extra_json && extra_len) {
      extra = parse_arg(extra_json, extra_len, "extra variables");
      if (!extra.is_object()) throw Error(RLH_E_INVALID_ARGUMENT, "apply_chat_template: extra variables must be a JSON object");
    }
    std::string text;
    try {
      text = inst.chat->render(messages, add_generation_prompt != 0, extra);
    } catch (const std::runtime_error& e) {
      throw Error(RLH_E_INVALID_ARGUMENT, e.what());
    }
    write(user, text.data(), text.size());
  });
}

rlh_status* info(const rlh_tokenizer* self, rlh_write_fn write, void* user) {
  return rlh::sdk::guard(make_of(self), [&] {
    if (!self || !write) throw Error(RLH_E_INVALID_ARGUMENT, "info: NULL argument");
    const auto& inst = *reinterpret_cast<const Instance*>(self);
    nlohmann::json j;
    j["vocab_size"] = inst.tok.vocab_size();
    j["bos_token_id"] = inst.tok.bos_id() ? nlohmann::json(*inst.tok.bos_id()) : nlohmann::json(nullptr);
    j["eos_token_ids"] = inst.tok.eos_ids();
    // The tokenizer's own eos_token (tokenizer_config.json), which data processors append to a
    // training row; eos_token_ids adds generation_config.json's stop ids.
    j["eos_token_id"] = inst.tok.eos_id() ? nlohmann::json(*inst.tok.eos_id()) : nlohmann::json(nullptr);
    j["pad_token_id"] = inst.tok.pad_id() ? nlohmann::json(*inst.tok.pad_id()) : nlohmann::json(nullptr);
    j["has_chat_template"] = inst.chat.has_value();
    const std::string s = j.dump();
    write(user, s.data(), s.size());
  });
}

int32_t token_to_id(const rlh_tokenizer* self, const char* token, size_t len) {
  if (!self || (!token && len)) return -1;
  try {
    const auto id = reinterpret_cast<const Instance*>(self)->tok.token_to_id(std::string_view(token ? token : "", len));
    return id ? *id : -1;
  } catch (...) {
    return -1;
  }
}

const rlh_tokenizer_api kApi = {
    RLH_STRUCT_SIZE(rlh_tokenizer_api, token_to_id), create, destroy, encode, decode, apply_chat_template, info,
    token_to_id,
};
const rlh_component_desc kTokenizer = rlh::sdk::component_desc(
    RLH_KIND_TOKENIZER, "hf", "0.1.0", RLH_TOKENIZER_API_VERSION_MAJOR, RLH_TOKENIZER_API_VERSION_MINOR, &kApi,
    "Hugging Face tokenizer.json (BPE: byte-level and SentencePiece-style) with Jinja chat templates");
const rlh_component_desc* const kComponents[] = {&kTokenizer};

}  // namespace

RLH_DEFINE_PLUGIN(rlh::sdk::plugin_desc("tokenizer_hf", "0.1.0", "rlhost", kComponents,
                                        "native Hugging Face tokenizers and chat templates"))
