// The ssd plugin's ABI glue: the descriptor, the ops table (OBJECTS with ABI 1.1's put_meta and
// for_each_meta; the POOL slots point to stubs), and a catch at every entry so no C++ exception
// crosses the ABI.
#include <exception>
#include <memory>
#include <string>
#include <string_view>
#include <utility>

#include "guard.h"
#include "kvbridge/plugin/storage.h"
#include "ssd_store.h"

namespace {

using kvbridge::ssd::SsdStore;

SsdStore* S(kvb_storage_t* s) { return reinterpret_cast<SsdStore*>(s); }

std::string_view Bytes(const uint8_t* p, uint32_t n) {
  return {reinterpret_cast<const char*>(p), p == nullptr ? 0 : n};
}

constexpr const char* kPlugin = "ssd";

template <typename Fn>
kvb_status_t Guard(Fn&& fn, char* err = nullptr, uint32_t err_len = 0) {
  return kvbridge::plugin::Guard(kPlugin, std::forward<Fn>(fn), err, err_len);
}

kvb_status_t Create(const kvb_host_services_t* host, const kvb_storage_params_t* params,
                    kvb_storage_t** out, char* err, uint32_t err_len) {
  return kvbridge::plugin::CreateStorage<SsdStore>(kPlugin, host, params, out, err, err_len);
}

void Destroy(kvb_storage_t* s) {
  try {
    delete S(s);
  } catch (...) {
  }
}

kvb_status_t Usage(kvb_storage_t* s, kvb_storage_usage_t* out) {
  return Guard([&] { return S(s)->Usage(out); });
}

kvb_status_t Put(kvb_storage_t* s, const uint8_t* key, uint32_t key_len, const kvb_iovec_t* iov,
                 uint32_t iov_count) {
  if (key == nullptr) return KVB_ERR_INVALID_ARGUMENT;
  return Guard([&] { return S(s)->Put(Bytes(key, key_len), iov, iov_count, {}); });
}

kvb_status_t PutMeta(kvb_storage_t* s, const uint8_t* key, uint32_t key_len, const kvb_iovec_t* iov,
                     uint32_t iov_count, const uint8_t* meta, uint32_t meta_len) {
  if (key == nullptr || (meta == nullptr && meta_len != 0)) return KVB_ERR_INVALID_ARGUMENT;
  return Guard(
      [&] { return S(s)->Put(Bytes(key, key_len), iov, iov_count, Bytes(meta, meta_len)); });
}

kvb_status_t Get(kvb_storage_t* s, const uint8_t* key, uint32_t key_len, const kvb_iovec_t* iov,
                 uint32_t iov_count, uint64_t* length) {
  if (key == nullptr) return KVB_ERR_INVALID_ARGUMENT;
  return Guard([&] { return S(s)->Get(Bytes(key, key_len), iov, iov_count, length); });
}

kvb_status_t Remove(kvb_storage_t* s, const uint8_t* key, uint32_t key_len) {
  if (key == nullptr) return KVB_ERR_INVALID_ARGUMENT;
  return Guard([&] { return S(s)->Remove(Bytes(key, key_len)); });
}

kvb_status_t ForEach(kvb_storage_t* s, kvb_storage_visit_fn visit, void* user) {
  if (visit == nullptr) return KVB_ERR_INVALID_ARGUMENT;
  return Guard([&] { return S(s)->ForEach(visit, nullptr, user); });
}

kvb_status_t ForEachMeta(kvb_storage_t* s, kvb_storage_visit_meta_fn visit, void* user) {
  if (visit == nullptr) return KVB_ERR_INVALID_ARGUMENT;
  return Guard([&] { return S(s)->ForEach(nullptr, visit, user); });
}

// Nothing to check: without io_uring the plugin falls back to pread/pwrite, and a missing
// liburing makes dlopen fail before this runs.
kvb_status_t Probe(char* reason, uint32_t reason_len) {
  kvb_copy_message(reason, reason_len, "");
  return KVB_OK;
}

const kvb_storage_ops_t kOps = {
    .struct_size = sizeof(kvb_storage_ops_t),
    .create = Create,
    .destroy = Destroy,
    .usage = Usage,
    .get_segment = kvb_storage_get_segment_unsupported,
    .alloc = kvb_storage_alloc_unsupported,
    .free = kvb_storage_free_unsupported,
    .put = Put,
    .get = Get,
    .remove = Remove,
    .for_each = ForEach,
    .put_meta = PutMeta,
    .for_each_meta = ForEachMeta,
};

const kvb_plugin_descriptor_t kDescriptor = {
    .struct_size = sizeof(kvb_plugin_descriptor_t),
    .abi_major = KVB_ABI_MAJOR,
    .abi_minor = KVB_ABI_MINOR,
    .name = "ssd",
    .version = "0.1.0",
    .kind = KVB_PLUGIN_STORAGE,
    .reserved = 0,
    .caps = KVB_SCAP_OBJECTS | KVB_SCAP_PERSISTENT,
    .probe = Probe,
    .ops = &kOps,
};

}  // namespace

extern "C" KVB_PLUGIN_EXPORT const kvb_plugin_descriptor_t* kvb_plugin_query(
    uint16_t host_abi_major, uint16_t host_abi_minor) {
  (void)host_abi_minor;
  return host_abi_major == KVB_ABI_MAJOR ? &kDescriptor : nullptr;
}
