/* Hostile fixture: a plugin built for another ABI major (current major + 1, minor 0), with a
 * descriptor that otherwise looks like this major's. The host must refuse it with
 * RLH_E_ABI_MISMATCH and a message naming both versions ("ABI 1.0" and the host's "0.1"),
 * and must not call anything in it (the probe/init slots abort if called). */
#include <stdlib.h>

#include "rlhost/plugin.h"

static rlh_status* must_not_probe(const rlh_host_api* host, int32_t* score, rlh_write_fn w, void* u) {
  (void)host;
  (void)score;
  (void)w;
  (void)u;
  abort();
}
static rlh_status* must_not_init(const rlh_host_api* host) {
  (void)host;
  abort();
}

static const rlh_plugin_desc k_desc = {RLH_STRUCT_SIZE(rlh_plugin_desc, shutdown),
                                       RLH_ABI_VERSION_MAJOR + 1,
                                       0,
                                       "wrong_major",
                                       "1.0.0",
                                       "rlhost tests",
                                       NULL,
                                       "built for another ABI major",
                                       NULL,
                                       0,
                                       must_not_probe,
                                       must_not_init,
                                       NULL};

__attribute__((visibility("default"))) const rlh_plugin_desc* rlh_plugin_entry(uint32_t major, uint32_t minor);

const rlh_plugin_desc* rlh_plugin_entry(uint32_t major, uint32_t minor) {
  (void)major;
  (void)minor;
  return &k_desc;
}
