#include "core/storage_instance.h"

#include <cstring>
#include <utility>

#include "core/host_services.h"
#include "core/plugin_loader.h"

namespace kvbridge::core {
namespace {

constexpr uint32_t kErrLen = 512;

const uint8_t* KeyBytes(std::string_view key) {
  return reinterpret_cast<const uint8_t*>(key.data());
}

std::string_view KeyView(const uint8_t* key, uint32_t key_len) {
  return {reinterpret_cast<const char*>(key), key_len};
}

}  // namespace

std::string StorageInstance::Unqualified(const PluginInfo& plugin, const StorageConfig& config) {
  const kvb_storage_ops_t* ops = plugin.storage_ops();
  if (ops == nullptr) return "is not a loaded storage plugin";
  if ((config.require_caps & KVB_SCAP_POOL) != 0 && (plugin.caps & KVB_SCAP_POOL) == 0) {
    return "does not offer a memory pool";
  }
  const bool objects_missing =
      (config.require_caps & KVB_SCAP_OBJECTS) != 0 && (plugin.caps & KVB_SCAP_OBJECTS) == 0;
  if (config.require_meta && (objects_missing || !StorageHasMetaOps(*ops))) {
    return "does not store keyed objects with metadata (ABI 1.1)";
  }
  if (objects_missing) return "does not store keyed objects";
  if ((config.require_caps & KVB_SCAP_PERSISTENT) != 0 &&
      (plugin.caps & KVB_SCAP_PERSISTENT) == 0) {
    return "does not keep objects across restarts";
  }
  return "";
}

Result<std::unique_ptr<StorageInstance>> StorageInstance::Create(
    std::shared_ptr<const void> library_owner, const PluginInfo& plugin,
    const StorageConfig& config) {
  const kvb_storage_ops_t* ops = plugin.storage_ops();
  if (ops == nullptr) {
    return Status::InvalidArgument("'" + plugin.name + "' (" + plugin.path +
                                   ") is not a loaded storage plugin");
  }
  std::unique_ptr<StorageInstance> s(new StorageInstance());
  s->library_owner_ = std::move(library_owner);
  s->ops_ = ops;
  s->name_ = plugin.name;
  s->caps_ = plugin.caps;
  s->has_meta_ = StorageHasMetaOps(*ops);
  s->on_evict_ = config.on_evict;
  const kvb_host_services_t* services = config.services;
  if (services == nullptr) {
    s->services_ = std::make_unique<HostServices>(config.plugin_config);
    services = s->services_->table();
  }
  kvb_storage_params_t params{.struct_size = sizeof(kvb_storage_params_t),
                              .node_id = config.node_id.c_str(),
                              .capacity_bytes = config.capacity_bytes,
                              .path = config.path.empty() ? nullptr : config.path.c_str(),
                              .on_evict = s->on_evict_ ? &StorageInstance::OnEvict : nullptr,
                              .on_evict_user = s->on_evict_ ? s.get() : nullptr};
  if (config.params_struct_size != 0 && config.params_struct_size < sizeof(params)) {
    // As an older host: what lies beyond struct_size is garbage the plugin must not read.
    params.struct_size = config.params_struct_size;
    std::memset(reinterpret_cast<char*>(&params) + params.struct_size, 0xab,
                sizeof(params) - params.struct_size);
  }
  char err[kErrLen] = {0};
  kvb_status_t st = ops->create(services, &params, &s->inst_, err, kErrLen);
  err[kErrLen - 1] = '\0';  // a plugin that did not terminate its message
  if (st != KVB_OK) {
    s->inst_ = nullptr;
    return Status::FromAbi(st, err).WithContext("storage plugin '" + plugin.name + "'");
  }
  return s;
}

StorageInstance::~StorageInstance() {
  if (inst_ != nullptr) ops_->destroy(inst_);
}

void StorageInstance::OnEvict(void* user, const uint8_t* key, uint32_t key_len) {
  static_cast<StorageInstance*>(user)->on_evict_(KeyView(key, key_len));
}

// The plugin's code; storage ops write no message, so callers add context (WithContext).
Status StorageInstance::Check(kvb_status_t st) const { return Status::FromAbi(st, {}); }

Result<StorageUsage> StorageInstance::Usage() const {
  kvb_storage_usage_t u{};
  u.struct_size = sizeof(u);
  KVB_RETURN_IF_ERROR(Check(ops_->usage(inst_, &u)));
  return StorageUsage{u.capacity_bytes, u.used_bytes, u.object_count};
}

Result<StorageInstance::Segment> StorageInstance::GetSegment() const {
  Segment seg;
  KVB_RETURN_IF_ERROR(Check(ops_->get_segment(inst_, &seg.addr, &seg.length)));
  return seg;
}

Result<uint64_t> StorageInstance::Alloc(uint64_t length) {
  uint64_t offset = 0;
  KVB_RETURN_IF_ERROR(Check(ops_->alloc(inst_, length, &offset)));
  return offset;
}

Status StorageInstance::Free(uint64_t offset) { return Check(ops_->free(inst_, offset)); }

Status StorageInstance::Put(std::string_view key, std::span<const kvb_iovec_t> iov) {
  return Check(ops_->put(inst_, KeyBytes(key), static_cast<uint32_t>(key.size()), iov.data(),
                         static_cast<uint32_t>(iov.size())));
}

Status StorageInstance::PutMeta(std::string_view key, std::span<const kvb_iovec_t> iov,
                                std::string_view meta) {
  if (!has_meta_) {
    return Status::Unsupported("storage plugin '" + name_ +
                               "' is ABI 1.0: it cannot store metadata with an object");
  }
  return Check(ops_->put_meta(inst_, KeyBytes(key), static_cast<uint32_t>(key.size()), iov.data(),
                              static_cast<uint32_t>(iov.size()),
                              reinterpret_cast<const uint8_t*>(meta.data()),
                              static_cast<uint32_t>(meta.size())));
}

Status StorageInstance::Get(std::string_view key, std::span<const kvb_iovec_t> iov,
                            uint64_t* length) {
  uint64_t len = 0;
  Status st = Check(ops_->get(inst_, KeyBytes(key), static_cast<uint32_t>(key.size()), iov.data(),
                              static_cast<uint32_t>(iov.size()), &len));
  if (length != nullptr) *length = len;
  return st;
}

Status StorageInstance::Remove(std::string_view key) {
  return Check(ops_->remove(inst_, KeyBytes(key), static_cast<uint32_t>(key.size())));
}

Status StorageInstance::ForEach(const Visit& visit) {
  auto tramp = [](void* user, const uint8_t* key, uint32_t key_len, uint64_t length) {
    (*static_cast<const Visit*>(user))(KeyView(key, key_len), length);
  };
  return Check(ops_->for_each(inst_, tramp, const_cast<Visit*>(&visit)));
}

Status StorageInstance::ForEachMeta(const VisitMeta& visit) {
  if (!has_meta_) {
    return Status::Unsupported("storage plugin '" + name_ +
                               "' is ABI 1.0: it keeps no metadata with objects");
  }
  auto tramp = [](void* user, const uint8_t* key, uint32_t key_len, uint64_t length,
                  const uint8_t* meta, uint32_t meta_len) {
    (*static_cast<const VisitMeta*>(user))(
        KeyView(key, key_len), length,
        std::string_view(reinterpret_cast<const char*>(meta), meta_len));
  };
  return Check(ops_->for_each_meta(inst_, tramp, const_cast<VisitMeta*>(&visit)));
}

}  // namespace kvbridge::core
