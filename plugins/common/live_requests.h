// The requests a transport instance handed to its host and the host has not released yet. The
// ABI's destroy frees everything the instance created, requests the host never released
// included (docs/plugin-abi.md, "Memory and lifetimes"): a transport keeps its handles here, and
// the set deletes what is left when it goes. Declare it as the transport's first member, so that
// it goes last, after the destructor failed and finished every request and stopped the threads
// that could touch one.
//
// Thread-safety: Adopt and Free may be called concurrently from any thread.
#pragma once

#include <memory>
#include <mutex>
#include <unordered_set>

namespace kvbridge::plugin {

template <typename T>
class LiveRequests {
 public:
  LiveRequests() = default;
  LiveRequests(const LiveRequests&) = delete;
  LiveRequests& operator=(const LiveRequests&) = delete;
  ~LiveRequests() {
    for (T* r : live_) delete r;
  }

  // Keeps `r` until Free (or the set's end); returns the pointer handed to the host.
  T* Adopt(std::unique_ptr<T> r) {
    std::lock_guard<std::mutex> lock(mu_);
    live_.insert(r.get());
    return r.release();
  }

  // Deletes `r`. A pointer this set does not hold (released twice, or never this instance's) is
  // left alone: deleting it again would corrupt the heap; the caller's bug stays the caller's.
  void Free(T* r) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (live_.erase(r) == 0) return;
    }
    delete r;
  }

 private:
  std::mutex mu_;
  std::unordered_set<T*> live_;
};

}  // namespace kvbridge::plugin
