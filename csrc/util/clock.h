// The one clock: monotonic nanoseconds, and Deadline built on it.
// Header-only; thread-safe (stateless).
#pragma once

#include <time.h>

#include <algorithm>
#include <cstdint>

namespace kvbridge::util {

inline uint64_t MonoNs() {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
}

inline uint64_t MsToNs(uint64_t ms) { return ms * 1000000ull; }

// An absolute point on MonoNs(); 0 means "no deadline".
class Deadline {
 public:
  Deadline() = default;
  explicit Deadline(uint64_t at_ns) : at_ns_(at_ns) {}
  static Deadline AfterMs(uint64_t ms) { return Deadline(MonoNs() + MsToNs(ms)); }
  uint64_t at_ns() const { return at_ns_; }
  bool none() const { return at_ns_ == 0; }
  bool expired(uint64_t now_ns = MonoNs()) const { return at_ns_ != 0 && now_ns >= at_ns_; }
  // Nanoseconds left (0 if expired); UINT64_MAX if none.
  uint64_t remaining_ns(uint64_t now_ns = MonoNs()) const {
    if (at_ns_ == 0) return UINT64_MAX;
    return at_ns_ > now_ns ? at_ns_ - now_ns : 0;
  }

 private:
  uint64_t at_ns_ = 0;
};

}  // namespace kvbridge::util
