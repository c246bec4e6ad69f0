// The ssd plugin's ABI glue, on the plugin SDK (kvbridge/plugin/sdk/storage.hpp): an OBJECTS
// class over SsdStore. Put with metadata makes ABI 1.1's put_meta and for_each_meta real; the
// SDK derives the caps (OBJECTS, and PERSISTENT from kPersistent), points the POOL slots to the
// ABI's stubs, and catches at every entry so no C++ exception crosses the ABI.
//
// Probe: nothing to check. Without io_uring the store falls back to pread/pwrite, and a missing
// liburing makes dlopen fail before probe could run.
#include <memory>
#include <string>
#include <utility>

#include "kvbridge/plugin/sdk/storage.hpp"
#include "ssd_store.h"

namespace {

namespace sdk = kvbridge::plugin::sdk;
using kvbridge::ssd::SsdStore;

class SsdPlugin {
 public:
  static constexpr const char* kName = "ssd";
  static constexpr const char* kVersion = "0.1.0";
  static constexpr bool kPersistent = true;

  static sdk::Result<std::unique_ptr<SsdPlugin>> Create(sdk::Host host,
                                                        const sdk::StorageParams& params) {
    std::unique_ptr<SsdStore> store;
    std::string msg;
    const kvb_status_t st = SsdStore::Create(host.raw(), params.raw, &store, &msg);
    if (st != KVB_OK) return sdk::Status(st, std::move(msg));
    return std::make_unique<SsdPlugin>(std::move(store));
  }

  explicit SsdPlugin(std::unique_ptr<SsdStore> store) : store_(std::move(store)) {}

  sdk::Status Usage(kvb_storage_usage_t& out) { return store_->Usage(&out); }
  sdk::Status Put(sdk::Bytes key, sdk::IoVecs iov, sdk::Bytes meta) {
    return store_->Put(sdk::AsStringView(key), iov.data(), Count(iov), sdk::AsStringView(meta));
  }
  sdk::Status Get(sdk::Bytes key, sdk::IoVecs iov, uint64_t& length) {
    return store_->Get(sdk::AsStringView(key), iov.data(), Count(iov), &length);
  }
  sdk::Status Remove(sdk::Bytes key) { return store_->Remove(sdk::AsStringView(key)); }
  sdk::Status ForEach(const sdk::ObjectVisitor& visit) {
    return store_->ForEach(visit.visit_fn(), visit.visit_meta_fn(), visit.user());
  }

 private:
  static uint32_t Count(sdk::IoVecs iov) { return static_cast<uint32_t>(iov.size()); }

  std::unique_ptr<SsdStore> store_;
};

}  // namespace

KVB_STORAGE_PLUGIN(SsdPlugin)
