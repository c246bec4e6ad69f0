// PluginRegistry: finds plugin libraries, checks them against the ABI and keeps them loaded.
//
// A plugin file is any "libkvb_*.so" in a searched directory. For each file the registry
// records one PluginInfo: loaded (usable), refused (wrong ABI major, missing query symbol,
// NULL ops slot, capability flags that do not match the slots, unknown kind...) or
// unavailable (its probe, or dlopen of its system dependency, failed). Refusals and
// unavailability are logged with the file path and the reason; they never abort the scan.
//
// Thread-safety: Scan/LoadFile are not synchronized; after construction the registry is
// read-only and may be shared. Loaded libraries stay mapped for the registry's lifetime.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/export_internal.h"
#include "kvbridge/plugin/abi.h"
#include "kvbridge/plugin/storage.h"
#include "kvbridge/plugin/transport.h"
#include "kvbridge/status.h"

namespace kvbridge::core {

enum class PluginState { kLoaded, kRefused, kUnavailable };

struct PluginInfo {
  std::string path;
  std::string name;  // from the descriptor; empty if refused before it could be read
  int32_t kind = 0;  // kvb_plugin_kind_t
  uint64_t caps = 0;
  std::string version;
  PluginState state = PluginState::kRefused;
  std::string reason;  // why refused / unavailable; empty when loaded
  const kvb_plugin_descriptor_t* descriptor = nullptr;  // non-null only when kLoaded

  const kvb_transport_ops_t* transport_ops() const;  // null unless a loaded transport
  const kvb_storage_ops_t* storage_ops() const;      // null unless a loaded storage plugin
};

// True when a transport ops table is long enough to hold the ABI 1.3 slot instance_caps (never
// read from a shorter table: the instance then has its descriptor's caps).
bool TransportHasInstanceCaps(const kvb_transport_ops_t& ops);

// True when a storage ops table is long enough to hold the ABI 1.1 slots put_meta and
// for_each_meta. A 1.0 plugin's table is not, and the host must treat both as unsupported (never
// read them); a 1.1 table may still point them to the KVB_ERR_UNSUPPORTED stubs.
bool StorageHasMetaOps(const kvb_storage_ops_t& ops);

// Checks a descriptor against this host's ABI: major version, struct sizes, kind, name, caps
// vs. slots, no NULL slot. `path` only names the file in the message. OK, or INVALID_ARGUMENT
// whose message says what is wrong (e.g. "libkvb_x.so: ABI major 2, host speaks 1").
Status ValidateDescriptor(const kvb_plugin_descriptor_t* desc, const std::string& path);

class PluginRegistry {
 public:
  PluginRegistry() = default;
  ~PluginRegistry();
  PluginRegistry(PluginRegistry&&) noexcept;
  PluginRegistry& operator=(PluginRegistry&&) noexcept;
  PluginRegistry(const PluginRegistry&) = delete;
  PluginRegistry& operator=(const PluginRegistry&) = delete;

  // The directories searched by default, in order: `extra` (':'-separated), then
  // $KVBRIDGE_PLUGIN_PATH (':'-separated), then the build tree's plugin directory (only for a
  // library in the build tree with no installed plugin directory next to it), then the install
  // directories "<libdir>/plugins" and "<libdir>/kvbridge/plugins", <libdir> being where the
  // module holding the loader is (libkvbridge.so, or a program linking kvbridge_core).
  // Nonexistent ones are kept (Scan skips them silently).
  KVBRIDGE_INTERNAL_API static std::vector<std::string> DefaultSearchPath(const std::string& extra);

  // Loads every libkvb_*.so in `dirs` (sorted by file name within a directory). When two files
  // carry the same (kind, name), the first one found wins and the later one is refused with
  // reason "duplicate of <path>" (only a loaded plugin shadows later ones). A file reached
  // twice through another directory name or a symlink is loaded once.
  void Scan(const std::vector<std::string>& dirs);
  // Loads one file; returns its info (also appended to plugins()).
  const PluginInfo& LoadFile(const std::string& path);

  const std::vector<PluginInfo>& plugins() const { return plugins_; }
  // The loaded plugin of that kind and name, or null. `why_not` (optional) receives the reason
  // when a refused/unavailable plugin of that name exists, or "no plugin named X found in
  // <dirs>" when none does. A file that failed before its name could be read is matched by
  // the naming convention "libkvb_<kind>_<name>.so" (kind: transport | storage).
  const PluginInfo* Find(int32_t kind, const std::string& name,
                         std::string* why_not = nullptr) const;
  // All loaded plugins of a kind, in scan order.
  std::vector<const PluginInfo*> Loaded(int32_t kind) const;

 private:
  std::vector<PluginInfo> plugins_;
  std::vector<void*> handles_;
  std::vector<std::string> searched_;
};

}  // namespace kvbridge::core
