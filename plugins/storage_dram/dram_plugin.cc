// The dram plugin's ABI glue, on the plugin SDK (kvbridge/plugin/sdk/storage.hpp): a POOL-only
// class over DramPool. The SDK derives the caps (POOL) from the members, points the OBJECTS
// slots (ABI 1.1's put_meta and for_each_meta among them) to the ABI's stubs, and catches at
// every entry so no C++ exception crosses the ABI.
#include <memory>
#include <string>
#include <utility>

#include "dram_pool.h"
#include "kvbridge/plugin/sdk/storage.hpp"

namespace {

namespace sdk = kvbridge::plugin::sdk;
using kvbridge::dram::DramPool;

class DramPlugin {
 public:
  static constexpr const char* kName = "dram";
  static constexpr const char* kVersion = "0.1.0";

  static sdk::Result<std::unique_ptr<DramPlugin>> Create(sdk::Host host,
                                                         const sdk::StorageParams& params) {
    std::unique_ptr<DramPool> pool;
    std::string msg;
    const kvb_status_t st = DramPool::Create(host.raw(), params.raw, &pool, &msg);
    if (st != KVB_OK) return sdk::Status(st, std::move(msg));
    return std::make_unique<DramPlugin>(std::move(pool));
  }

  explicit DramPlugin(std::unique_ptr<DramPool> pool) : pool_(std::move(pool)) {}

  sdk::Status Usage(kvb_storage_usage_t& out) { return pool_->Usage(&out); }
  sdk::Result<sdk::Segment> Segment() {
    return sdk::Segment{pool_->segment(), pool_->segment_bytes()};
  }
  sdk::Result<uint64_t> Alloc(uint64_t length) {
    uint64_t offset = 0;
    const kvb_status_t st = pool_->Alloc(length, &offset);
    if (st != KVB_OK) return sdk::Status(st);
    return offset;
  }
  sdk::Status Free(uint64_t offset) { return pool_->Free(offset); }

 private:
  std::unique_ptr<DramPool> pool_;
};

}  // namespace

KVB_STORAGE_PLUGIN(DramPlugin)
