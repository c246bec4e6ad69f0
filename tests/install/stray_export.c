/* A plugin that exports one symbol too many, built hidden like every plugin: the CTest test
 * Exports.CatchesStrayExport checks that tests/install/check_exports.sh names it. */
#include "kvbridge/plugin/abi.h"

KVB_PLUGIN_EXPORT const kvb_plugin_descriptor_t* kvb_plugin_query(uint16_t host_abi_major,
                                                                  uint16_t host_abi_minor) {
  (void)host_abi_major;
  (void)host_abi_minor;
  return NULL;
}

__attribute__((visibility("default"))) int kvbtest_stray_helper(int x) { return x + 1; }

int kvbtest_hidden_helper(int x) { return x - 1; } /* hidden: not reported */
