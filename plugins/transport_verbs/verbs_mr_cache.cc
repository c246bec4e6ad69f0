#include "verbs_mr_cache.h"

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <iterator>
#include <string>
#include <vector>

namespace kvbridge::verbs {

namespace sdk = kvbridge::plugin::sdk;

struct MrRef::Entry {
  uint64_t addr = 0, len = 0;
  bool device = false;
  int device_id = -1;
  MrKeys keys;
  uint64_t refs = 0;
  bool active = true;  // in the index: handed out by Acquire
  bool idle = false;   // in idle_ (active and refs == 0), at idle_pos
  std::list<Entry*>::iterator idle_pos;
};

namespace {

// "[0x1000, 0x3000) (8192 bytes) of host memory" / "... of device 1 memory".
std::string Describe(uint64_t addr, uint64_t len, bool device, int device_id) {
  char buf[128];
  std::snprintf(buf, sizeof(buf), "[0x%" PRIx64 ", 0x%" PRIx64 ") (%" PRIu64 " bytes) of ", addr,
                addr + len, len);
  return buf + (device ? "device " + std::to_string(device_id) + " memory" : "host memory");
}

}  // namespace

const char* RegPathName(RegPath path) {
  switch (path) {
    case RegPath::kHost:
      return "host";
    case RegPath::kDmaBuf:
      return "dmabuf";
    case RegPath::kPeerMem:
      return "peermem";
    case RegPath::kHostStaging:
      return "host_staging";
  }
  return "unknown";
}

// ---- MrRef ----------------------------------------------------------------------------------

MrRef& MrRef::operator=(MrRef&& o) noexcept {
  if (this != &o) {
    Release();
    cache_ = std::exchange(o.cache_, nullptr);
    entry_ = std::exchange(o.entry_, nullptr);
  }
  return *this;
}

void MrRef::Release() {
  if (entry_ != nullptr) cache_->Release(std::exchange(entry_, nullptr));
  cache_ = nullptr;
}

// An Entry's range and keys never change once it is made, so they are read without the lock.
const MrKeys& MrRef::keys() const { return entry_->keys; }
uint64_t MrRef::addr() const { return entry_->addr; }
uint64_t MrRef::len() const { return entry_->len; }

// ---- MrCache --------------------------------------------------------------------------------

MrCache::MrCache(Registrar& registrar, MrCacheLimits limits)
    : registrar_(registrar), limits_([&] {
        if (limits.host_page == 0) limits.host_page = 1;
        if (limits.device_granularity == 0) limits.device_granularity = 1;
        return limits;
      }()) {}

MrCache::~MrCache() {
  for (auto& [e, owned] : all_) registrar_.Deregister(e->keys);
}

sdk::Result<MrRef> MrCache::Acquire(uint64_t addr, uint64_t len, bool device, int device_id) {
  if (!device) device_id = -1;
  if (addr == 0 || len == 0 || addr + len < addr) {
    return sdk::Status(KVB_ERR_INVALID_ARGUMENT, "MR cache: cannot register " +
                                                     Describe(addr, len, device, device_id) +
                                                     (addr == 0  ? ": address 0"
                                                      : len == 0 ? ": length 0"
                                                                 : ": past the end of memory"));
  }
  const uint64_t g = device ? limits_.device_granularity : limits_.host_page;
  uint64_t start = addr - addr % g;
  uint64_t end = addr + len;
  if (end % g != 0) {
    if (end + (g - end % g) < end) {
      return sdk::Status(KVB_ERR_INVALID_ARGUMENT, "MR cache: cannot register " +
                                                       Describe(addr, len, device, device_id) +
                                                       ": rounded out to " + std::to_string(g) +
                                                       " bytes it is past the end of memory");
    }
    end += g - end % g;
  }

  std::lock_guard<std::mutex> lock(mu_);
  Index& index = index_[{device, device_id}];
  // The MRs of one kind do not overlap: the only one that may cover the range, and the first
  // that may overlap it, is the last one starting at or before `start`.
  auto it = index.upper_bound(start);
  if (it != index.begin()) {
    Entry* prev = std::prev(it)->second;
    if (prev->addr + prev->len >= addr + len) {
      ++stats_.hits;
      if (prev->idle) {
        idle_.erase(prev->idle_pos);
        prev->idle = false;
      }
      ++prev->refs;
      return MrRef(this, prev);
    }
    if (prev->addr + prev->len > start) --it;
  }
  ++stats_.misses;
  std::vector<Entry*> overlapped;
  for (; it != index.end() && it->first < end; ++it) {
    Entry* e = it->second;
    overlapped.push_back(e);
    start = std::min(start, e->addr);
    end = std::max(end, e->addr + e->len);
  }

  sdk::Result<MrKeys> keys = registrar_.Register(start, end - start, device, device_id);
  if (!keys.ok()) {
    ++stats_.registration_failures;
    return sdk::Status(keys.status().code(), "MR cache: registering " +
                                                 Describe(start, end - start, device, device_id) +
                                                 " failed: " + keys.status().message());
  }
  for (Entry* e : overlapped) {
    ++stats_.superseded;
    Retire(e);
  }
  auto owned = std::make_unique<Entry>();
  Entry* e = owned.get();
  e->addr = start;
  e->len = end - start;
  e->device = device;
  e->device_id = device_id;
  e->keys = *keys;
  e->refs = 1;
  all_.emplace(e, std::move(owned));
  index.emplace(start, e);
  ++stats_.registrations[static_cast<size_t>(e->keys.path)];
  ++stats_.entries;
  stats_.bytes += e->len;
  Trim();
  if (OverLimit()) ++stats_.over_limit_acquires;
  return MrRef(this, e);
}

void MrCache::Invalidate(uint64_t addr, uint64_t len) {
  if (len == 0) return;
  const uint64_t end = addr + len < addr ? UINT64_MAX : addr + len;
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<Entry*> hit;
  for (auto& [kind, index] : index_) {
    auto it = index.upper_bound(addr);
    if (it != index.begin() && std::prev(it)->second->addr + std::prev(it)->second->len > addr) {
      --it;
    }
    for (; it != index.end() && it->first < end; ++it) hit.push_back(it->second);
  }
  for (Entry* e : hit) {
    ++stats_.invalidations;
    Retire(e);
  }
}

MrCacheStats MrCache::Stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void MrCache::Release(Entry* e) {
  std::lock_guard<std::mutex> lock(mu_);
  if (--e->refs != 0) return;
  if (!e->active) {
    Drop(e);
    return;
  }
  e->idle_pos = idle_.insert(idle_.end(), e);
  e->idle = true;
  Trim();
}

void MrCache::Retire(Entry* e) {
  index_[{e->device, e->device_id}].erase(e->addr);
  e->active = false;
  if (e->idle) {
    idle_.erase(e->idle_pos);
    e->idle = false;
  }
  if (e->refs == 0) Drop(e);
}

void MrCache::Drop(Entry* e) {
  registrar_.Deregister(e->keys);
  --stats_.entries;
  stats_.bytes -= e->len;
  all_.erase(e);
}

bool MrCache::OverLimit() const {
  return stats_.entries > limits_.max_entries || stats_.bytes > limits_.max_bytes;
}

void MrCache::Trim() {
  while (OverLimit() && !idle_.empty()) {
    ++stats_.evictions;
    Retire(idle_.front());
  }
}

}  // namespace kvbridge::verbs
