// KVBRIDGE_INTERNAL_API: the few kvbridge::core entry points libkvbridge.so exports for
// kvbridge's own shared libraries (libkvbridge_store.so, the Python extension), which must
// use the library's single copy of them: PluginHost's per-process plugin cache, above all
// (one scan per process, shared by the engine and the storage node), and the CUDA driver, loaded
// once per process (DeviceBounce, which the store client reads CUDA buffers with). They are not
// API: their headers are not installed and they change without notice. Everything else under
// csrc/core stays hidden; tests and tools that need more of it link the static kvbridge_core
// instead (csrc/CMakeLists.txt). The exported-symbols test names each of them in its allow-list
// (tests/install/check_exports.sh).
#pragma once

#include "kvbridge/export.h"

#define KVBRIDGE_INTERNAL_API KVBRIDGE_API
