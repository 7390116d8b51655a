/* Hostile fixture: a shared library that is not an rlhost plugin. It defines a function with a
 * name close to the entry's, but exports nothing (the plugin version script hides everything
 * that is not rlh_plugin_entry). The host must refuse it, naming the file and the missing
 * symbol, and keep running. */
#include "rlhost/plugin.h"

const rlh_plugin_desc* rlh_plugin_entry_v2(uint32_t major, uint32_t minor);

const rlh_plugin_desc* rlh_plugin_entry_v2(uint32_t major, uint32_t minor) {
  (void)major;
  (void)minor;
  return NULL;
}
