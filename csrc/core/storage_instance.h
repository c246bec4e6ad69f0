// StorageInstance: one instance of a storage plugin, and the only code that calls a storage
// plugin's ops table (kvb_storage_ops_t, kvbridge/plugin/storage.h) outside the loader.
//
// It owns the kvb_storage_t (destroy() in the destructor) and the host-services table handed to
// it, and turns every ABI status into a Status. Whether the plugin has the ABI 1.1 metadata ops
// (put_meta, for_each_meta) is decided here, once: has_meta(). The instance holds
// `library_owner` (the PluginHost), so the plugin's library stays mapped while it lives.
//
// Thread-safety: as the ABI's: every method may be called concurrently, except the destructor.
// The eviction callback runs on whatever thread the plugin evicts from (inside Put).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "core/export_internal.h"
#include "kvbridge/plugin/storage.h"
#include "kvbridge/status.h"

namespace kvbridge::core {

class HostServices;
struct PluginInfo;

struct StorageConfig {
  std::string node_id;
  uint64_t capacity_bytes = 0;
  std::string path;  // for file-backed plugins; "" = none (NULL to the plugin)
  // Called once per object the plugin evicts on its own (kvb_storage_params_t::on_evict); empty:
  // the plugin must not evict, and a put beyond capacity is NO_SPACE.
  std::function<void(std::string_view key)> on_evict;
  std::map<std::string, std::string> plugin_config;  // what config_get answers
  // When set, handed to the plugin instead of a HostServices built from plugin_config
  // (borrowed: must outlive the instance). For benchmarks and tests that watch the plugin's log.
  const kvb_host_services_t* services = nullptr;
  // Checked by PluginHost::CreateStorage before the plugin is created: the KVB_SCAP_* bits it
  // must declare, and whether it must have the ABI 1.1 metadata ops.
  uint64_t require_caps = 0;
  bool require_meta = false;
  // For plugin tests: the struct_size the params are handed with, to act as an older host
  // (e.g. ABI 1.0's, which ends at `path`; the bytes past it are garbage then). 0 or more than
  // this host's size: this host's.
  uint32_t params_struct_size = 0;
};

struct StorageUsage {
  uint64_t capacity_bytes = 0;
  uint64_t used_bytes = 0;
  uint64_t object_count = 0;
};

class KVBRIDGE_INTERNAL_API StorageInstance {
 public:
  using Visit = std::function<void(std::string_view key, uint64_t length)>;
  using VisitMeta =
      std::function<void(std::string_view key, uint64_t length, std::string_view meta)>;

  // Why `plugin` does not meet config.require_caps / require_meta ("does not offer a memory
  // pool", ...), or "" when it does.
  static std::string Unqualified(const PluginInfo& plugin, const StorageConfig& config);
  // Creates an instance of `plugin` (a loaded storage plugin). Errors: the plugin's create()
  // status and message.
  static Result<std::unique_ptr<StorageInstance>> Create(std::shared_ptr<const void> library_owner,
                                                         const PluginInfo& plugin,
                                                         const StorageConfig& config);
  ~StorageInstance();
  StorageInstance(const StorageInstance&) = delete;
  StorageInstance& operator=(const StorageInstance&) = delete;

  const std::string& name() const { return name_; }
  uint64_t caps() const { return caps_; }
  // The plugin's ops table holds put_meta/for_each_meta (ABI 1.1; they may still answer
  // UNSUPPORTED). Without them PutMeta/ForEachMeta are UNSUPPORTED and never reach the plugin.
  bool has_meta() const { return has_meta_; }

  Result<StorageUsage> Usage() const;

  // POOL: the whole segment (to register with the transports).
  struct Segment {
    void* addr = nullptr;
    uint64_t length = 0;
  };
  Result<Segment> GetSegment() const;
  Result<uint64_t> Alloc(uint64_t length);  // offset within the segment
  Status Free(uint64_t offset);

  // OBJECTS.
  Status Put(std::string_view key, std::span<const kvb_iovec_t> iov);
  Status PutMeta(std::string_view key, std::span<const kvb_iovec_t> iov, std::string_view meta);
  // Reads the object into iov. *length (optional) receives the object's size, also when iov is
  // too small (INVALID_ARGUMENT, nothing copied).
  Status Get(std::string_view key, std::span<const kvb_iovec_t> iov, uint64_t* length = nullptr);
  Status Remove(std::string_view key);
  Status ForEach(const Visit& visit);
  Status ForEachMeta(const VisitMeta& visit);

 private:
  StorageInstance() = default;
  static void OnEvict(void* user, const uint8_t* key, uint32_t key_len);
  Status Check(kvb_status_t st) const;

  std::shared_ptr<const void> library_owner_;
  std::unique_ptr<HostServices> services_;  // outlives inst_ (destroyed after it)
  std::function<void(std::string_view)> on_evict_;
  const kvb_storage_ops_t* ops_ = nullptr;
  kvb_storage_t* inst_ = nullptr;
  std::string name_;
  uint64_t caps_ = 0;
  bool has_meta_ = false;
};

}  // namespace kvbridge::core
