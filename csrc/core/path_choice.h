// Path choice: over which of a peer's paths (one per transport both sides speak, in local
// preference order) one op goes. A pure function of what the engine knows when it posts; the
// engine (csrc/core/engine.cc) builds one PathView per path and op, and tests table-test it
// (tests/unit/test_multipath.cc, PathChoice.*). docs/transfer-engine.md "Several transports per
// peer" describes the rules.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvbridge/status.h"

namespace kvbridge::core {

// What path choice sees of one path, for one op.
struct PathView {
  std::string_view transport;
  bool remote_registered = false;  // the remote segment lists a key entry for this transport
  bool local_registered = false;   // the op's local region is registered with this transport
  bool kinds_served = false;       // ServesKinds(...) for the op's local and remote memory
  // The op touches CUDA memory (either end) and this path moves it without host staging
  // (KVB_TCAP_CUDA_DIRECT): such paths are tried first.
  bool device_direct = false;
  bool breaker_refuses = false;       // the path's breaker is open (its backoff not over)
  uint32_t consecutive_failures = 0;  // for the message when it refuses
  uint64_t retry_in_ms = 0;           // likewise: time to the breaker's next probe
};

// Whether a transport whose instance caps are `caps` moves bytes between local memory of
// `local_kind` and remote memory of `remote_kind` (kvb_mem_kind_t values): each end's kind
// needs its cap, KVB_TCAP_HOST_MEM for host memory and KVB_TCAP_CUDA_MEM for device memory
// (the tcp transport stages device bytes through pinned buffers). The peer's caps for that
// transport are taken to be these: descriptors do not carry them.
bool ServesKinds(uint64_t caps, uint32_t local_kind, uint32_t remote_kind);

struct PathChoice {
  // Eligible paths, as indices into the input, in the order to try: those whose breaker admits
  // (device_direct ones first, otherwise in input order), then those whose breaker refuses
  // (likewise).
  std::vector<uint32_t> order;
  uint32_t admitting = 0;  // how many leading entries of `order` have a breaker that admits
  // OK when some eligible path admits; PEER_UNREACHABLE when every eligible path's breaker
  // refuses (CircuitOpenMessage); UNSUPPORTED when none is eligible, naming why for each path.
  Status status;
};

// `peer` names the peer in messages ("node@0123...").
PathChoice ChoosePaths(std::span<const PathView> paths, std::string_view peer);

// "circuit open for peer P after N consecutive failures; next probe in M ms" for one path (the
// message of a single-transport engine), or "circuit open for peer P on every path: mock after
// N consecutive failures, next probe in M ms; mock_b after ..." for several. `refusing` lists
// the paths to name (indices into `paths`).
std::string CircuitOpenMessage(std::span<const PathView> paths, std::span<const uint32_t> refusing,
                               std::string_view peer);

}  // namespace kvbridge::core
