#include "core/path_choice.h"

#include <algorithm>

#include "kvbridge/plugin/transport.h"

namespace kvbridge::core {

bool ServesKinds(uint64_t caps, uint32_t local_kind, uint32_t remote_kind) {
  auto serves = [caps](uint32_t kind) {
    return kind == KVB_MEM_HOST   ? (caps & KVB_TCAP_HOST_MEM) != 0
           : kind == KVB_MEM_CUDA ? (caps & KVB_TCAP_CUDA_MEM) != 0
                                  : false;
  };
  // The remote end is served by the peer's instance of the same transport, which registered the
  // segment (so it takes that kind); the peer's caps (descriptor v3) add nothing to that.
  return serves(local_kind) && serves(remote_kind);
}

std::string CircuitOpenMessage(std::span<const PathView> paths, std::span<const uint32_t> refusing,
                               std::string_view peer) {
  auto one = [&](const PathView& p, const char* sep) {
    return "after " + std::to_string(p.consecutive_failures) + " consecutive failures" + sep +
           "next probe in " + std::to_string(p.retry_in_ms) + " ms";
  };
  std::string msg = "circuit open for peer " + std::string(peer);
  if (refusing.size() == 1) return msg + " " + one(paths[refusing[0]], "; ");
  msg += " on every path:";
  for (size_t k = 0; k < refusing.size(); ++k) {
    const PathView& p = paths[refusing[k]];
    msg += (k == 0 ? " " : "; ") + std::string(p.transport) + " " + one(p, ", ");
  }
  return msg;
}

PathChoice ChoosePaths(std::span<const PathView> paths, std::string_view peer) {
  PathChoice c;
  std::vector<uint32_t> refusing;
  std::string why;
  for (uint32_t i = 0; i < paths.size(); ++i) {
    const PathView& p = paths[i];
    const char* reason = !p.remote_registered  ? "the remote segment has no key for it"
                         : !p.local_registered ? "the local region is not registered with it"
                         : !p.kinds_served     ? "it does not serve these memory kinds"
                                               : nullptr;
    if (reason != nullptr) {
      why += (why.empty() ? "" : "; ") + std::string(p.transport) + ": " + reason;
    } else if (p.breaker_refuses) {
      refusing.push_back(i);
    } else {
      c.order.push_back(i);
    }
  }
  // Device memory goes over a path that moves it directly before one that stages it in host
  // memory; otherwise the input (local preference) order stands.
  auto direct_first = [&](std::vector<uint32_t>& v) {
    std::stable_partition(v.begin(), v.end(), [&](uint32_t i) { return paths[i].device_direct; });
  };
  direct_first(c.order);
  direct_first(refusing);
  c.admitting = static_cast<uint32_t>(c.order.size());
  c.order.insert(c.order.end(), refusing.begin(), refusing.end());
  if (c.order.empty()) {
    c.status = Status::Unsupported("no path to peer " + std::string(peer) + " serves the op" +
                                   (why.empty() ? " (the peer has no path)" : ": " + why));
  } else if (c.admitting == 0) {
    c.status = Status::PeerUnreachable(CircuitOpenMessage(paths, refusing, peer));
  }
  return c;
}

}  // namespace kvbridge::core
