// CircuitBreaker: per-peer fail-fast gate.
//
// Closed: everything passes; `failure_threshold` consecutive failures open it. Open: nothing
// passes until the backoff has elapsed; then one probe passes (half-open). A successful probe
// closes it; a failed probe re-opens it with the backoff doubled (capped). A probe whose
// outcome never arrives frees the probe slot after `probe_timeout_ms`.
// Thread-safe.
#pragma once

#include <cstdint>
#include <mutex>

#include "kvbridge/engine.h"

namespace kvbridge::core {

class CircuitBreaker {
 public:
  struct Config {
    uint32_t failure_threshold = 3;  // 0 = never open
    uint32_t backoff_ms = 200;
    uint32_t max_backoff_ms = 5000;
    uint32_t probe_timeout_ms = 10000;
  };
  explicit CircuitBreaker(const Config& config) : config_(config) {}

  // True if a request may go to the peer now. In half-open state only the first caller gets
  // true (it is the probe).
  bool Allow(uint64_t now_ns);
  void RecordSuccess();
  void RecordFailure(uint64_t now_ns);

  BreakerState state(uint64_t now_ns) const;
  uint32_t consecutive_failures() const;
  // Nanoseconds until an open breaker lets a probe through (0 if not open).
  uint64_t retry_in_ns(uint64_t now_ns) const;

 private:
  const Config config_;
  mutable std::mutex mu_;
  BreakerState state_ = BreakerState::kClosed;
  uint32_t failures_ = 0;
  uint64_t backoff_ns_ = 0;
  uint64_t open_until_ns_ = 0;
  uint64_t probe_started_ns_ = 0;
  bool probe_in_flight_ = false;
};

}  // namespace kvbridge::core
