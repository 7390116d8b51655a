/* rlhost C ABI: tokenizers and chat templates (RLH_KIND_TOKENIZER).
 *
 * An instance is created for one tokenizer (a HF tokenizer.json, found next to a model or given
 * as a file) and is immutable afterwards, so every call below is thread-safe.
 */
#ifndef RLHOST_TOKENIZER_H_
#define RLHOST_TOKENIZER_H_

#include "rlhost/plugin.h"

#ifdef __cplusplus
extern "C" {
#endif

#define RLH_TOKENIZER_API_VERSION_MAJOR 0
#define RLH_TOKENIZER_API_VERSION_MINOR 1

typedef struct rlh_tokenizer rlh_tokenizer;

#define RLH_ENCODE_ADD_SPECIAL_TOKENS (1ull << 0) /* run the post-processor (BOS/EOS) */
#define RLH_DECODE_SKIP_SPECIAL_TOKENS (1ull << 0)

typedef struct rlh_tokenizer_api {
  size_t struct_size;

  /* Loads a tokenizer. `path` is a tokenizer.json file, a model folder (tokenizer.json and
   * tokenizer_config.json inside) or a hub id found in the local HF cache. Errors name the file
   * and the field. */
  rlh_status* (*create)(const rlh_host_api* host, const char* path, rlh_tokenizer** out);
  void (*destroy)(rlh_tokenizer* self); /* NULL is a no-op */

  /* Encodes UTF-8 text. Writes the ids as int32_t values through `write` (byte length =
   * 4 * count; may be called several times). flags: RLH_ENCODE_*. */
  rlh_status* (*encode)(const rlh_tokenizer* self, const char* text, size_t len, uint64_t flags,
                        rlh_write_fn write, void* user);

  /* Decodes ids into UTF-8 text written through `write`. flags: RLH_DECODE_*. An id outside the
   * vocabulary is RLH_E_OUT_OF_RANGE naming it. */
  rlh_status* (*decode)(const rlh_tokenizer* self, const int32_t* ids, size_t count,
                        uint64_t flags, rlh_write_fn write, void* user);

  /* (optional; NULL = the tokenizer has no chat templates, callers report RLH_E_UNIMPLEMENTED)
   * Renders the chat template for `messages_json` (a JSON array of {"role", "content", ...}).
   * `extra_json` (may be NULL) is a JSON object of extra template variables (tools,
   * enable_thinking, ...). RLH_E_FAILED_PRECONDITION when the tokenizer has no chat template;
   * a template's raise_exception becomes RLH_E_INVALID_ARGUMENT with its message. */
  rlh_status* (*apply_chat_template)(const rlh_tokenizer* self, const char* messages_json,
                                     size_t messages_len, uint8_t add_generation_prompt,
                                     const char* extra_json, size_t extra_len,
                                     rlh_write_fn write, void* user);

  /* Writes a JSON object: {"vocab_size": n, "bos_token_id": id|null, "eos_token_ids": [..],
   * "pad_token_id": id|null, "has_chat_template": bool}, and optionally "eos_token_id": id|null
   * (the tokenizer's own EOS, without generation_config's stop ids; readers fall back to the
   * first of eos_token_ids when the key is absent). */
  rlh_status* (*info)(const rlh_tokenizer* self, rlh_write_fn write, void* user);

  /* Id of a token string, or -1 if absent. */
  int32_t (*token_to_id)(const rlh_tokenizer* self, const char* token, size_t len);
} rlh_tokenizer_api;

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* RLHOST_TOKENIZER_H_ */
