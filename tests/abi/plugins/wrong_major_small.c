/* Hostile fixture: a plugin of another ABI major whose descriptor is laid out differently. Across
 * majors only the leading {struct_size, abi_major, abi_minor} is stable (as DLPack keeps its
 * version first), so this descriptor is exactly those three fields (16 bytes, struct_size 16).
 * The host must read nothing else: it must report the major mismatch naming both versions
 * (not a "struct_size too small" error, which would send the user looking for the wrong fix), and
 * under ASan any read past the 16 bytes is a global-buffer-overflow. */
#include <stddef.h>
#include <stdint.h>

#include "rlhost/plugin.h"

struct other_major_desc {
  size_t struct_size;
  uint32_t abi_major;
  uint32_t abi_minor;
};

static const struct other_major_desc k_desc = {sizeof(struct other_major_desc), RLH_ABI_VERSION_MAJOR + 1, 0};

__attribute__((visibility("default"))) const rlh_plugin_desc* rlh_plugin_entry(uint32_t major, uint32_t minor);

const rlh_plugin_desc* rlh_plugin_entry(uint32_t major, uint32_t minor) {
  (void)major;
  (void)minor;
  return (const rlh_plugin_desc*)(const void*)&k_desc;
}
