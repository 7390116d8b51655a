/* Fixture: everything optional left NULL. The plugin has no probe, init or shutdown, no license,
 * description or config keys; its tokenizer leaves apply_chat_template NULL (no chat template)
 * and its kernels provider leaves the optional state_save/state_load NULL. The host must load,
 * list (probe NULL = can run, score 1), initialise (init NULL = nothing to do) and shut it down
 * (shutdown NULL) without calling a NULL slot. */
#include <stddef.h>

#include "rlhost/kernels.h"
#include "rlhost/plugin.h"
#include "rlhost/tokenizer.h"

struct rlh_tokenizer {
  int unused;
};
static struct rlh_tokenizer g_tok;

static rlh_status* tok_create(const rlh_host_api* host, const char* path, rlh_tokenizer** out) {
  (void)host;
  (void)path;
  *out = &g_tok;
  return NULL;
}
static void tok_destroy(rlh_tokenizer* self) { (void)self; }
/* Byte-level: one id per byte. */
static rlh_status* tok_encode(const rlh_tokenizer* self, const char* text, size_t len, uint64_t flags,
                              rlh_write_fn write, void* user) {
  size_t i;
  (void)self;
  (void)flags;
  for (i = 0; i < len; ++i) {
    int32_t id = (unsigned char)text[i];
    write(user, &id, sizeof id);
  }
  return NULL;
}
static rlh_status* tok_decode(const rlh_tokenizer* self, const int32_t* ids, size_t count, uint64_t flags,
                              rlh_write_fn write, void* user) {
  size_t i;
  (void)self;
  (void)flags;
  for (i = 0; i < count; ++i) {
    char c = (char)ids[i];
    write(user, &c, 1);
  }
  return NULL;
}
static rlh_status* tok_info(const rlh_tokenizer* self, rlh_write_fn write, void* user) {
  static const char k_info[] =
      "{\"vocab_size\": 256, \"bos_token_id\": null, \"eos_token_ids\": [], \"pad_token_id\": null, "
      "\"has_chat_template\": false}";
  (void)self;
  write(user, k_info, sizeof k_info - 1);
  return NULL;
}
static int32_t tok_token_to_id(const rlh_tokenizer* self, const char* token, size_t len) {
  (void)self;
  return len == 1 ? (int32_t)(unsigned char)token[0] : -1;
}

static const rlh_tokenizer_api k_tok_api = {RLH_STRUCT_SIZE(rlh_tokenizer_api, token_to_id),
                                            tok_create,
                                            tok_destroy,
                                            tok_encode,
                                            tok_decode,
                                            NULL, /* apply_chat_template: not implemented */
                                            tok_info,
                                            tok_token_to_id};

static const rlh_kernels_api k_kernels_api = {RLH_STRUCT_SIZE(rlh_kernels_api, state_load),
                                              NULL, /* create: this provider has no instances */
                                              NULL,
                                              NULL,
                                              NULL,
                                              NULL,
                                              NULL,
                                              NULL,
                                              NULL, /* state_save: optional */
                                              NULL, /* state_load: optional */
                                              /* KERNELS 0.2 slots, outside struct_size: a 0.1 table */
                                              NULL, NULL, NULL, NULL, NULL, NULL};

static const rlh_component_desc k_tok = {RLH_STRUCT_SIZE(rlh_component_desc, config_keys),
                                         RLH_KIND_TOKENIZER,
                                         0,
                                         "null_slots_bytes",
                                         "1.0.0",
                                         RLH_TOKENIZER_API_VERSION_MAJOR,
                                         RLH_TOKENIZER_API_VERSION_MINOR,
                                         &k_tok_api,
                                         NULL,
                                         NULL};

static const rlh_component_desc k_kernels = {RLH_STRUCT_SIZE(rlh_component_desc, config_keys),
                                             RLH_KIND_KERNELS,
                                             0,
                                             "null_slots_kernels",
                                             "1.0.0",
                                             RLH_KERNELS_API_VERSION_MAJOR,
                                             RLH_KERNELS_API_VERSION_MINOR,
                                             &k_kernels_api,
                                             NULL,
                                             NULL};

static const rlh_component_desc* const k_components[] = {&k_tok, &k_kernels};

static const rlh_plugin_desc k_desc = {RLH_STRUCT_SIZE(rlh_plugin_desc, shutdown),
                                       RLH_ABI_VERSION_MAJOR,
                                       RLH_ABI_VERSION_MINOR,
                                       "null_slots",
                                       "1.0.0",
                                       "rlhost tests",
                                       NULL, /* license */
                                       NULL, /* description */
                                       k_components,
                                       2,
                                       NULL, /* probe */
                                       NULL, /* init */
                                       NULL /* shutdown */};

__attribute__((visibility("default"))) const rlh_plugin_desc* rlh_plugin_entry(uint32_t major, uint32_t minor);

const rlh_plugin_desc* rlh_plugin_entry(uint32_t major, uint32_t minor) {
  (void)major;
  (void)minor;
  return &k_desc;
}
