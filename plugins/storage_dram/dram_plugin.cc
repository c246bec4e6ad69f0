// The dram plugin's ABI glue: the descriptor, the ops table (POOL only; the OBJECTS slots, ABI
// 1.1's put_meta and for_each_meta among them, point to stubs), and a catch at every entry so no
// C++ exception crosses the ABI.
#include <exception>
#include <memory>
#include <string>
#include <utility>

#include "dram_pool.h"
#include "guard.h"
#include "kvbridge/plugin/storage.h"

namespace {

using kvbridge::dram::DramPool;

DramPool* D(kvb_storage_t* s) { return reinterpret_cast<DramPool*>(s); }

constexpr const char* kPlugin = "dram";

template <typename Fn>
kvb_status_t Guard(Fn&& fn, char* err = nullptr, uint32_t err_len = 0) {
  return kvbridge::plugin::Guard(kPlugin, std::forward<Fn>(fn), err, err_len);
}

kvb_status_t Create(const kvb_host_services_t* host, const kvb_storage_params_t* params,
                    kvb_storage_t** out, char* err, uint32_t err_len) {
  return kvbridge::plugin::CreateStorage<DramPool>(kPlugin, host, params, out, err, err_len);
}

void Destroy(kvb_storage_t* s) {
  try {
    delete D(s);
  } catch (...) {
  }
}

kvb_status_t Usage(kvb_storage_t* s, kvb_storage_usage_t* out) {
  return Guard([&] { return D(s)->Usage(out); });
}

kvb_status_t GetSegment(kvb_storage_t* s, void** addr, uint64_t* length) {
  if (addr == nullptr || length == nullptr) return KVB_ERR_INVALID_ARGUMENT;
  *addr = D(s)->segment();
  *length = D(s)->segment_bytes();
  return KVB_OK;
}

kvb_status_t Alloc(kvb_storage_t* s, uint64_t length, uint64_t* offset) {
  return Guard([&] { return D(s)->Alloc(length, offset); });
}

kvb_status_t Free(kvb_storage_t* s, uint64_t offset) {
  return Guard([&] { return D(s)->Free(offset); });
}

// OBJECTS is not offered (the caps say POOL only); the slots still point somewhere.
kvb_status_t Probe(char* reason, uint32_t reason_len) {
  kvb_copy_message(reason, reason_len, "");
  return KVB_OK;
}

const kvb_storage_ops_t kOps = {
    .struct_size = sizeof(kvb_storage_ops_t),
    .create = Create,
    .destroy = Destroy,
    .usage = Usage,
    .get_segment = GetSegment,
    .alloc = Alloc,
    .free = Free,
    .put = kvb_storage_put_unsupported,
    .get = kvb_storage_get_unsupported,
    .remove = kvb_storage_remove_unsupported,
    .for_each = kvb_storage_for_each_unsupported,
    .put_meta = kvb_storage_put_meta_unsupported,
    .for_each_meta = kvb_storage_for_each_meta_unsupported,
};

const kvb_plugin_descriptor_t kDescriptor = {
    .struct_size = sizeof(kvb_plugin_descriptor_t),
    .abi_major = KVB_ABI_MAJOR,
    .abi_minor = KVB_ABI_MINOR,
    .name = "dram",
    .version = "0.1.0",
    .kind = KVB_PLUGIN_STORAGE,
    .reserved = 0,
    .caps = KVB_SCAP_POOL,
    .probe = Probe,
    .ops = &kOps,
};

}  // namespace

extern "C" KVB_PLUGIN_EXPORT const kvb_plugin_descriptor_t* kvb_plugin_query(
    uint16_t host_abi_major, uint16_t host_abi_minor) {
  (void)host_abi_minor;
  return host_abi_major == KVB_ABI_MAJOR ? &kDescriptor : nullptr;
}
