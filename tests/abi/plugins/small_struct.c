/* Hostile fixture: a descriptor of this major whose struct_size is too small to contain the
 * `components` field (it stops after `description`), as a truncated or corrupt plugin would be.
 * The object really is that small, so under ASan a host that reads `components` anyway hits a
 * global-buffer-overflow. The host must refuse it with RLH_E_ABI_MISMATCH naming struct_size. */
#include <stddef.h>
#include <stdint.h>

#include "rlhost/plugin.h"

struct truncated_desc {
  size_t struct_size;
  uint32_t abi_major;
  uint32_t abi_minor;
  const char* name;
  const char* version;
  const char* vendor;
  const char* license;
  const char* description;
};

static const struct truncated_desc k_desc = {sizeof(struct truncated_desc), RLH_ABI_VERSION_MAJOR,
                                             RLH_ABI_VERSION_MINOR, "small_struct", "1.0.0",
                                             "rlhost tests", NULL, "descriptor without components"};

/* The prefix must really end before `components`. */
typedef char small_struct_check[sizeof(struct truncated_desc) <= offsetof(rlh_plugin_desc, components) ? 1 : -1];

__attribute__((visibility("default"))) const rlh_plugin_desc* rlh_plugin_entry(uint32_t major, uint32_t minor);

const rlh_plugin_desc* rlh_plugin_entry(uint32_t major, uint32_t minor) {
  (void)major;
  (void)minor;
  return (const rlh_plugin_desc*)(const void*)&k_desc;
}
