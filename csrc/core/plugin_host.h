// PluginHost: the one set of loaded plugins of a process, per plugin search path.
//
// Acquire(dirs) returns the host for that list of directories: the first call scans and
// dlopens them (PluginRegistry::Scan), later calls with the same list (after canonicalising
// each directory and dropping repeats) get the same host for as long as anyone holds it (a weak
// cache). So the transfer engine, the storage node and its SSD tier of one process share one
// scan. The host creates plugin instances (TransportInstance, StorageInstance); each instance
// holds the host, so the plugin libraries stay mapped until the last instance is destroyed.
//
// Thread-safety: Acquire may be called from any thread (the cache is locked; a scan happens
// under that lock, once). A host is read-only after Acquire returns; Create* are thread-safe.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/export_internal.h"
#include "core/plugin_loader.h"
#include "core/storage_instance.h"
#include "core/transport_instance.h"
#include "kvbridge/status.h"

namespace kvbridge::core {

class KVBRIDGE_INTERNAL_API PluginHost : public std::enable_shared_from_this<PluginHost> {
 public:
  // The host for `dirs` (searched in order; see PluginRegistry::Scan), scanning them if no
  // live host has the same canonical list.
  static std::shared_ptr<PluginHost> Acquire(const std::vector<std::string>& dirs);
  // How many scans hosts have done in this process (for tests: one per distinct path list in
  // use at a time).
  static uint64_t ScanCount();

  PluginHost(const PluginHost&) = delete;
  PluginHost& operator=(const PluginHost&) = delete;
  ~PluginHost();

  const PluginRegistry& registry() const { return registry_; }
  // The directories scanned, as given (repeats dropped), for messages.
  const std::vector<std::string>& dirs() const { return dirs_; }

  // An instance of `plugin` (a loaded transport of this host's registry). Errors carry the
  // plugin's create() message, in context "transport 'tcp' (<path>) failed to start".
  Result<std::unique_ptr<TransportInstance>> CreateTransport(const PluginInfo& plugin,
                                                             const TransportConfig& config);
  // The storage plugin `name`, checked against config.require_caps / require_meta before it is
  // created: UNAVAILABLE ("storage plugin 'x': does not offer a memory pool", or the registry's
  // reason when there is no such usable plugin) when it does not qualify.
  Result<std::unique_ptr<StorageInstance>> CreateStorage(const std::string& name,
                                                         const StorageConfig& config);
  Result<std::unique_ptr<StorageInstance>> CreateStorage(const PluginInfo& plugin,
                                                         const StorageConfig& config);

 private:
  PluginHost() = default;

  PluginRegistry registry_;
  std::vector<std::string> dirs_;
};

}  // namespace kvbridge::core
