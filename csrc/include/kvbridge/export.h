// KVBRIDGE_API: marks what libkvbridge.so and libkvbridge_store.so export.
//
// Both are compiled with -fvisibility=hidden and -fvisibility-inlines-hidden, so a class or
// function is visible to programs linking them only when its declaration carries KVBRIDGE_API.
// Everything under kvbridge/ that is not header-only carries it (Status, EngineOptions,
// TransferEngine, PeerId in libkvbridge.so; StoreClient, StorageNode, MasterServer,
// EmbeddedCluster, the *Options and QueryClusterStatus in libkvbridge_store.so); nothing else
// is exported, bar the KVBRIDGE_INTERNAL_API entry points of csrc/core/export_internal.h. The
// CTest tests Exports.Library and Exports.StoreLibrary (tests/install/check_exports.sh) fail
// when a library exports a symbol outside its allow-list.
//
// The plugin ABI (kvbridge/plugin/*.h) needs no macro: a plugin exports kvb_plugin_query
// itself (KVB_PLUGIN_EXPORT in kvbridge/plugin/abi.h).
#pragma once

// C++11 attribute syntax, so that it combines with others: class [[nodiscard]] KVBRIDGE_API X.
#if defined(__GNUC__) || defined(__clang__)
#define KVBRIDGE_API [[gnu::visibility("default")]]
#define KVBRIDGE_HIDDEN [[gnu::visibility("hidden")]]
#else
#define KVBRIDGE_API
#define KVBRIDGE_HIDDEN
#endif
