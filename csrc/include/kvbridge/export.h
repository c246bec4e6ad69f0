// KVBRIDGE_API: marks what libkvbridge.so exports.
//
// libkvbridge.so is compiled with -fvisibility=hidden and -fvisibility-inlines-hidden, so a
// class or function is visible to programs linking the library only when its declaration
// carries KVBRIDGE_API. Everything under kvbridge/ that is not header-only (Status,
// EngineOptions, TransferEngine, PeerId, ...) carries it; nothing else in the library is
// exported. The CTest test Install.ExportedSymbols (tests/install/check_exports.cmake) fails
// when the library exports a symbol outside its allow-list.
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
