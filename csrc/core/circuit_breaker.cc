#include "core/circuit_breaker.h"

#include <algorithm>

#include "util/clock.h"

namespace kvbridge::core {

bool CircuitBreaker::Allow(uint64_t now_ns) {
  std::lock_guard<std::mutex> lock(mu_);
  switch (state_) {
    case BreakerState::kClosed:
      return true;
    case BreakerState::kOpen:
      if (now_ns < open_until_ns_) return false;
      state_ = BreakerState::kHalfOpen;
      probe_in_flight_ = true;
      probe_started_ns_ = now_ns;
      return true;
    case BreakerState::kHalfOpen:
      if (probe_in_flight_ && now_ns < probe_started_ns_ + util::MsToNs(config_.probe_timeout_ms)) {
        return false;
      }
      probe_in_flight_ = true;
      probe_started_ns_ = now_ns;
      return true;
  }
  return true;
}

void CircuitBreaker::RecordSuccess() {
  std::lock_guard<std::mutex> lock(mu_);
  state_ = BreakerState::kClosed;
  failures_ = 0;
  backoff_ns_ = 0;
  probe_in_flight_ = false;
}

void CircuitBreaker::RecordFailure(uint64_t now_ns) {
  std::lock_guard<std::mutex> lock(mu_);
  ++failures_;
  if (config_.failure_threshold == 0) return;
  const uint64_t first = util::MsToNs(config_.backoff_ms);
  const uint64_t cap = std::max(first, util::MsToNs(config_.max_backoff_ms));
  if (state_ == BreakerState::kHalfOpen) {
    backoff_ns_ = std::min(cap, std::max(first, backoff_ns_ * 2));
  } else if (state_ == BreakerState::kClosed && failures_ >= config_.failure_threshold) {
    backoff_ns_ = first;
  } else {
    return;  // already open: a late failure of a batch submitted before it opened
  }
  state_ = BreakerState::kOpen;
  open_until_ns_ = now_ns + backoff_ns_;
  probe_in_flight_ = false;
}

BreakerState CircuitBreaker::state(uint64_t now_ns) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (state_ == BreakerState::kOpen && now_ns >= open_until_ns_) return BreakerState::kHalfOpen;
  return state_;
}

uint32_t CircuitBreaker::consecutive_failures() const {
  std::lock_guard<std::mutex> lock(mu_);
  return failures_;
}

uint64_t CircuitBreaker::retry_in_ns(uint64_t now_ns) const {
  std::lock_guard<std::mutex> lock(mu_);
  return state_ == BreakerState::kOpen && open_until_ns_ > now_ns ? open_until_ns_ - now_ns : 0;
}

}  // namespace kvbridge::core
