/* Hostile fixture: a well-formed plugin linked against libgone.so, which is not there at run
 * time, so dlopen fails ("libgone.so: cannot open shared object file"). The host must report the
 * file and the missing library, list it with that reason, and keep running. */
#include "rlhost/plugin.h"

int rlh_test_gone_value(void);

static rlh_status* dep_init(const rlh_host_api* host) {
  static const char msg[] = "missing_dep: libgone.so answered wrongly";
  if (rlh_test_gone_value() == 42) return NULL;
  return host->make_status(RLH_E_INTERNAL, msg, sizeof msg - 1);
}

static const rlh_plugin_desc k_desc = {RLH_STRUCT_SIZE(rlh_plugin_desc, shutdown),
                                       RLH_ABI_VERSION_MAJOR,
                                       RLH_ABI_VERSION_MINOR,
                                       "missing_dep",
                                       "1.0.0",
                                       "rlhost tests",
                                       NULL,
                                       "needs libgone.so",
                                       NULL,
                                       0,
                                       NULL,
                                       dep_init,
                                       NULL};

__attribute__((visibility("default"))) const rlh_plugin_desc* rlh_plugin_entry(uint32_t major, uint32_t minor);

const rlh_plugin_desc* rlh_plugin_entry(uint32_t major, uint32_t minor) {
  (void)major;
  (void)minor;
  return &k_desc;
}
