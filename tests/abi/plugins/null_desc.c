/* Hostile fixture: the entry exists but returns NULL (a plugin that cannot describe itself to a
 * host of this ABI version). The host must refuse it with RLH_E_ABI_MISMATCH naming the file. */
#include "rlhost/plugin.h"

__attribute__((visibility("default"))) const rlh_plugin_desc* rlh_plugin_entry(uint32_t major, uint32_t minor);

const rlh_plugin_desc* rlh_plugin_entry(uint32_t major, uint32_t minor) {
  (void)major;
  (void)minor;
  return NULL;
}
