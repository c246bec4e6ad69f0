// kvbridge::verbs::MrCache: the memory-region cache of the verbs transport. Registering memory
// with the NIC (ibv_reg_mr, ibv_reg_dmabuf_mr) pins pages and costs milliseconds, so the
// transport registers a range once and hands out reference-counted MrRefs to it for every op
// that touches it. The registration itself is done by a Registrar (the ibverbs one tries
// dma-buf, then nvidia-peermem for device memory; tests use a fake), so this
// file needs neither libibverbs nor a device.
//
// Rules:
// - Acquire(addr, len, device, device_id) hands out an MR of the same kind (host memory, or the
//   memory of CUDA device `device_id`; device_id is ignored for host memory) that covers
//   [addr, addr+len). A miss registers the range rounded out to host_page (host memory) or
//   device_granularity (device memory); a hit never registers.
// - The MRs handed out for one kind never overlap: a miss whose rounded range overlaps cached
//   MRs without being covered by one registers the union of the range and those MRs, and the
//   overlapped MRs are superseded: no longer handed out, deregistered once unused (at once when
//   unused already).
// - Invalidate(addr, len) (the user deregisters or frees that memory) stops every MR of any kind
//   that overlaps the range from being handed out, at once; each is deregistered when its last
//   MrRef is released (at once when unused). A later Acquire there registers anew.
// - Capacity: after a miss, and when an MR becomes unused, while the registered MRs exceed
//   max_entries or max_bytes the least recently used unused MR is evicted (deregistered). An MR
//   in use is never evicted: when every MR is in use Acquire still succeeds over the limit and
//   Stats().over_limit_acquires counts it. Superseded and invalidated MRs still held count
//   towards the limits until released.
// - The Registrar's Deregister is only ever called for an MR no MrRef refers to (or from the
//   destructor).
//
// Thread-safety: every member of MrCache may be called from any thread; one mutex guards the
// cache, and the Registrar's Register and Deregister are called with it held (so they are never
// called concurrently by one cache, and must not call back into it). An MrRef is used by one
// thread at a time (it may be moved to and released on another). MrRefs must not outlive their
// cache: the destructor deregisters every MR left, in use or not.
#pragma once

#include <array>
#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <utility>

#include "kvbridge/plugin/sdk/common.hpp"

namespace kvbridge::verbs {

// How a region was made reachable by the NIC.
enum class RegPath {
  kHost,         // host memory, ibv_reg_mr
  kDmaBuf,       // GPU memory by dma-buf, ibv_reg_dmabuf_mr
  kPeerMem,      // GPU memory by nvidia-peermem, ibv_reg_mr on the device pointer
  kHostStaging,  // GPU memory the NIC cannot reach, staged through registered host buffers
                 // (counted by the transport; never a Registrar's answer)
};
inline constexpr size_t kRegPathCount = 4;

// "host", "dmabuf", "peermem", "host_staging".
const char* RegPathName(RegPath path);

// What one registration produced. `handle` is the Registrar's own (its ibv_mr*, say).
struct MrKeys {
  uint32_t lkey = 0, rkey = 0;
  RegPath path = RegPath::kHost;
  uint64_t handle = 0;
};

class Registrar {
 public:
  virtual ~Registrar() = default;
  // Registers [addr, addr+len) of host memory (device false) or of CUDA device `device_id`. The
  // error names what failed (the paths tried, for device memory); the cache adds the range.
  virtual plugin::sdk::Result<MrKeys> Register(uint64_t addr, uint64_t len, bool device,
                                               int device_id) = 0;
  // Undoes one Register that succeeded. Called once per registration.
  virtual void Deregister(const MrKeys& keys) = 0;
};

struct MrCacheLimits {
  uint64_t max_bytes = UINT64_MAX;      // registered bytes kept (MRs in use may exceed it)
  uint64_t max_entries = 1024;          // registered MRs kept (likewise)
  uint64_t host_page = 4096;            // host ranges are rounded out to multiples of this
  uint64_t device_granularity = 65536;  // device ranges likewise (GPU pages: 64 KiB)
};

struct MrCacheStats {
  uint64_t hits = 0;    // Acquires served by a cached MR
  uint64_t misses = 0;  // Acquires that registered (successfully or not)
  std::array<uint64_t, kRegPathCount> registrations{};  // successful ones, by RegPath
  uint64_t registration_failures = 0;
  uint64_t superseded = 0;           // MRs replaced by one registered over their union
  uint64_t invalidations = 0;        // MRs invalidated (each counted once)
  uint64_t evictions = 0;            // unused MRs deregistered for capacity
  uint64_t entries = 0;              // MRs registered now (in use, cached, or awaiting release)
  uint64_t bytes = 0;                // their bytes
  uint64_t over_limit_acquires = 0;  // misses that left the cache over a limit (all in use)

  uint64_t registered(RegPath p) const { return registrations[static_cast<size_t>(p)]; }
};

class MrCache;

// A reference to one cached MR, released on destruction (or Release()). Movable, not copyable.
// addr() and len() are the registered range, which covers the one asked for.
class MrRef {
 public:
  MrRef() = default;
  MrRef(MrRef&& o) noexcept
      : cache_(std::exchange(o.cache_, nullptr)), entry_(std::exchange(o.entry_, nullptr)) {}
  MrRef& operator=(MrRef&& o) noexcept;
  MrRef(const MrRef&) = delete;
  MrRef& operator=(const MrRef&) = delete;
  ~MrRef() { Release(); }

  explicit operator bool() const { return entry_ != nullptr; }
  void Release();

  // Valid only while the MrRef holds an MR.
  const MrKeys& keys() const;
  uint32_t lkey() const { return keys().lkey; }
  uint32_t rkey() const { return keys().rkey; }
  RegPath path() const { return keys().path; }
  uint64_t addr() const;
  uint64_t len() const;

 private:
  friend class MrCache;
  struct Entry;
  MrRef(MrCache* cache, Entry* entry) : cache_(cache), entry_(entry) {}

  MrCache* cache_ = nullptr;
  Entry* entry_ = nullptr;
};

class MrCache {
 public:
  // A limit of 0 for host_page or device_granularity is taken as 1 (no rounding).
  MrCache(Registrar& registrar, MrCacheLimits limits);
  ~MrCache();
  MrCache(const MrCache&) = delete;
  MrCache& operator=(const MrCache&) = delete;

  // An MR covering [addr, addr+len) of host memory or of device `device_id`.
  // INVALID_ARGUMENT for addr 0, len 0 or a range past the end of the address space; a failed
  // registration returns the Registrar's code, its message prefixed with the range and kind,
  // and caches nothing.
  plugin::sdk::Result<MrRef> Acquire(uint64_t addr, uint64_t len, bool device, int device_id);

  // The memory [addr, addr+len) is going away: see the header comment. len 0 does nothing.
  void Invalidate(uint64_t addr, uint64_t len);

  MrCacheStats Stats() const;

 private:
  friend class MrRef;
  using Entry = MrRef::Entry;
  using Kind = std::pair<bool, int>;         // (device, device_id), device_id -1 for host memory
  using Index = std::map<uint64_t, Entry*>;  // start address -> active MR, per kind

  void Release(Entry* e);
  // Stops handing `e` out; deregisters it when unused.
  void Retire(Entry* e);
  void Drop(Entry* e);
  bool OverLimit() const;
  void Trim();

  Registrar& registrar_;
  const MrCacheLimits limits_;
  mutable std::mutex mu_;
  std::map<Kind, Index> index_;                             // MRs handed out
  std::unordered_map<Entry*, std::unique_ptr<Entry>> all_;  // every registered MR
  std::list<Entry*> idle_;  // active MRs without references, least recently used first
  MrCacheStats stats_;
};

}  // namespace kvbridge::verbs
