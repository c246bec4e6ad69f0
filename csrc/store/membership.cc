#include "store/membership.h"

#include <algorithm>

namespace kvbridge::store {

namespace {

constexpr uint64_t kNsPerMs = 1000000ull;

}  // namespace

const char* MemberEventName(MemberEvent::Kind kind) {
  switch (kind) {
    case MemberEvent::Kind::kJoined:
      return "JOINED";
    case MemberEvent::Kind::kDraining:
      return "DRAINING";
    case MemberEvent::Kind::kLeft:
      return "LEFT";
    case MemberEvent::Kind::kReplaced:
      return "REPLACED";
    case MemberEvent::Kind::kExpired:
      return "EXPIRED";
  }
  return "?";
}

Membership::Membership(const MembershipOptions& options)
    : options_(options), last_expire_ns_(options.start_ns) {}

void Membership::Emit(MemberEvent::Kind kind, const NodeIdentity& node, uint64_t now_ns,
                      uint64_t silent_ms) {
  events_.push_back({kind, node, now_ns, next_seq_++, silent_ms});
  ++version_;
}

Membership::Joined Membership::Join(const NodeRegistration& registration, uint64_t now_ns) {
  const NodeIdentity& id = registration.identity;
  Joined out;
  if (auto it = members_.find(id.node_id); it != members_.end()) {
    if (it->second.id().incarnation == id.incarnation) {
      out.kind = JoinKind::kAgain;
      return out;
    }
    out.kind = JoinKind::kReplaced;
    out.replaced = it->second.id();
    members_.erase(it);
    Emit(MemberEvent::Kind::kReplaced, out.replaced, now_ns);
  }
  Member& m = members_[id.node_id];
  m.registration = registration;
  m.state = registration.draining ? NodeState::kDraining : NodeState::kActive;
  m.joined_ns = now_ns;
  m.last_seen_ns = now_ns;
  Emit(MemberEvent::Kind::kJoined, id, now_ns);
  return out;
}

bool Membership::KeepAlive(const NodeIdentity& node, uint64_t now_ns) {
  auto it = members_.find(node.node_id);
  if (it == members_.end() || it->second.id().incarnation != node.incarnation) return false;
  it->second.last_seen_ns = std::max(it->second.last_seen_ns, now_ns);
  return true;
}

void Membership::Touch(const NodeIdentity& node, uint64_t now_ns) {
  std::lock_guard<std::mutex> lock(live_mu_);
  auto& seen = live_[node.node_id];
  if (seen.first != node.incarnation) seen = {node.incarnation, 0};
  seen.second = std::max(seen.second, now_ns);
}

bool Membership::SetDraining(const NodeIdentity& node, uint64_t now_ns) {
  auto it = members_.find(node.node_id);
  if (it == members_.end() || it->second.id().incarnation != node.incarnation ||
      it->second.state == NodeState::kDraining) {
    return false;
  }
  it->second.state = NodeState::kDraining;
  Emit(MemberEvent::Kind::kDraining, node, now_ns);
  return true;
}

bool Membership::Leave(const NodeIdentity& node, uint64_t now_ns) {
  auto it = members_.find(node.node_id);
  if (it == members_.end() || it->second.id().incarnation != node.incarnation) return false;
  members_.erase(it);
  Emit(MemberEvent::Kind::kLeft, node, now_ns);
  return true;
}

Membership::Expiry Membership::Expire(uint64_t now_ns) {
  Expiry out;
  {
    std::lock_guard<std::mutex> lock(live_mu_);
    for (auto& [id, m] : members_) {
      auto it = live_.find(id);
      if (it != live_.end() && it->second.first == m.id().incarnation) {
        m.last_seen_ns = std::max(m.last_seen_ns, it->second.second);
      }
    }
    // Records of ids that are not members (any caller can send a heartbeat naming anything)
    // are dropped here: the map stays as large as the membership between calls' worth of
    // heartbeats.
    for (auto it = live_.begin(); it != live_.end();) {
      it = members_.count(it->first) == 0 ? live_.erase(it) : std::next(it);
    }
  }
  if (last_expire_ns_ != 0 && now_ns > last_expire_ns_) {
    out.since_last_ms = (now_ns - last_expire_ns_) / kNsPerMs;
  }
  if (options_.pause_threshold_ms != 0 && last_expire_ns_ != 0 && now_ns > last_expire_ns_ &&
      now_ns - last_expire_ns_ > options_.pause_threshold_ms * kNsPerMs) {
    out.paused_ms = (now_ns - last_expire_ns_) / kNsPerMs;
    for (auto& [id, m] : members_) m.last_seen_ns = std::max(m.last_seen_ns, now_ns);
  }
  last_expire_ns_ = std::max(last_expire_ns_, now_ns);
  const uint64_t ttl = options_.ttl_ms * kNsPerMs;
  for (auto it = members_.begin(); it != members_.end();) {
    const Member& m = it->second;
    if (now_ns < m.last_seen_ns || now_ns - m.last_seen_ns < ttl) {
      ++it;
      continue;
    }
    const uint64_t silent_ms = (now_ns - m.last_seen_ns) / kNsPerMs;
    out.longest_silence_ms = std::max(out.longest_silence_ms, silent_ms);
    out.expired.push_back(m.id());
    Emit(MemberEvent::Kind::kExpired, m.id(), now_ns, silent_ms);
    it = members_.erase(it);
  }
  return out;
}

const Membership::Member* Membership::Find(const NodeIdentity& node) const {
  auto it = members_.find(node.node_id);
  if (it == members_.end() || it->second.id().incarnation != node.incarnation) return nullptr;
  return &it->second;
}

const Membership::Member* Membership::FindId(const std::string& node_id) const {
  auto it = members_.find(node_id);
  return it == members_.end() ? nullptr : &it->second;
}

NodeDirectory Membership::Directory(const std::vector<std::string>& node_ids) const {
  NodeDirectory dir;
  dir.directory_version = version_;
  auto add = [&](const Member& m) {
    dir.nodes.push_back(
        {m.id(), m.state, m.registration.engine_descriptor, m.registration.control_endpoint});
  };
  if (node_ids.empty()) {
    for (const auto& [id, m] : members_) add(m);
  } else {
    for (const std::string& id : node_ids) {
      if (auto it = members_.find(id); it != members_.end()) add(it->second);
    }
  }
  return dir;
}

std::vector<MemberEvent> Membership::TakeEvents() {
  std::vector<MemberEvent> out(std::make_move_iterator(events_.begin()),
                               std::make_move_iterator(events_.end()));
  events_.clear();
  return out;
}

size_t Membership::live_records() const {
  std::lock_guard<std::mutex> lock(live_mu_);
  return live_.size();
}

}  // namespace kvbridge::store
