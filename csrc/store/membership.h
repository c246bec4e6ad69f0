// Membership: which storage nodes are in the cluster, as the master sees them. A node joins
// with its registration, stays by keeping its lease alive (heartbeats within ttl_ms), and goes
// by leaving (deregistration), by a new incarnation of its id joining (a restart), or by its
// lease running out (Expire). Its directory entry (descriptor, control endpoint, ACTIVE or
// DRAINING) is what clients resolve replica locations with; every change bumps the directory's
// version. Knows nothing of objects: MasterState consumes its events (Watch) and keeps what it
// stores per node itself.
//
// Pure like MasterState: no I/O, no threads, no clock; every call takes now_ns.
//
// Thread-safety: Touch and live_records may be called from any thread at any time (a lock of
// their own, never held across anything else), so that a heartbeat never waits behind the
// caller's lock; every other method needs the caller's synchronization (MasterState's lock).
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "store/master_state.h"

namespace kvbridge::store {

struct MembershipOptions {
  // A member whose last sign of life (join, KeepAlive, Touch) is this old is expired.
  uint64_t ttl_ms = 3000;
  // Expire calls further apart than this mean the master itself was not running (a frozen
  // process, a paused VM) and heard nothing meanwhile through no fault of the members: every
  // lease starts over at that call instead of every member expiring at once. 0 = off.
  uint64_t pause_threshold_ms = 0;
  // When the master started, on Expire's clock: the first call's gap is measured from here.
  // 0 = the first call only sets the reference.
  uint64_t start_ns = 0;
};

// One change of membership, in the order they happened (Watch).
struct MemberEvent {
  enum class Kind : uint8_t {
    kJoined,    // a member joined (a new id, or a new incarnation after kReplaced)
    kDraining,  // a member is leaving: nothing new goes to it (SetDraining)
    kLeft,      // a member left on its own (Leave)
    kReplaced,  // a member left because a new incarnation of its id joined
    kExpired,   // a member's lease ran out (Expire)
  };
  Kind kind = Kind::kJoined;
  NodeIdentity node;
  uint64_t at_ns = 0;
  uint64_t seq = 0;        // increasing across all events, from 1
  uint64_t silent_ms = 0;  // kExpired: how long the member had been silent
};
const char* MemberEventName(MemberEvent::Kind kind);  // "JOINED", "DRAINING", ...

class Membership {
 public:
  struct Member {
    NodeRegistration registration;
    NodeState state = NodeState::kActive;  // kActive or kDraining
    uint64_t joined_ns = 0;
    uint64_t last_seen_ns = 0;  // the last sign of life folded in (Touch records: Expire)
    const NodeIdentity& id() const { return registration.identity; }
  };

  enum class JoinKind : uint8_t {
    kNew,       // the id was not a member
    kAgain,     // this incarnation is a member already: nothing changed, no event
    kReplaced,  // another incarnation held the id: it was replaced (kReplaced, then kJoined)
  };
  struct Joined {
    JoinKind kind = JoinKind::kNew;
    NodeIdentity replaced;  // kReplaced: the incarnation that left
  };

  struct Expiry {
    std::vector<NodeIdentity> expired;  // in id order; their kExpired events are queued
    uint64_t longest_silence_ms = 0;    // among them
    uint64_t since_last_ms = 0;         // since the previous Expire call (0 for the first)
    uint64_t paused_ms = 0;             // the gap when it exceeded pause_threshold_ms, else 0
  };

  explicit Membership(const MembershipOptions& options);

  // The registration's id joins (DRAINING when registration.draining). The caller validates
  // the registration first. State after kAgain is untouched (not even the lease).
  Joined Join(const NodeRegistration& registration, uint64_t now_ns);
  // A heartbeat under the caller's lock: the member's lease starts over. False (nothing done)
  // for an id that is not a member or another incarnation.
  bool KeepAlive(const NodeIdentity& node, uint64_t now_ns);
  // A heartbeat recorded without the caller's lock (see the header comment); Expire folds it
  // in. Unknown ids and other incarnations are dropped there.
  void Touch(const NodeIdentity& node, uint64_t now_ns);
  // The member is leaving (kDraining). False if it is not a member or already draining.
  bool SetDraining(const NodeIdentity& node, uint64_t now_ns);
  // The member leaves at once (kLeft). False if it is not a member.
  bool Leave(const NodeIdentity& node, uint64_t now_ns);
  // Folds in the Touch records, then expires every member silent for ttl_ms (kExpired each).
  Expiry Expire(uint64_t now_ns);

  // The member with exactly this identity, or null (the pointer lives until it leaves).
  const Member* Find(const NodeIdentity& node) const;
  // The member holding this id, whatever its incarnation, or null.
  const Member* FindId(const std::string& node_id) const;
  const std::map<std::string, Member>& members() const { return members_; }
  // The entries of these ids (every member when empty), with the directory's version.
  NodeDirectory Directory(const std::vector<std::string>& node_ids) const;
  // Bumped by every event; starts at 1.
  uint64_t version() const { return version_; }

  // Watch: the events since the last call, oldest first. The consumer applies them in order.
  std::vector<MemberEvent> TakeEvents();
  // Touch records held (for tests): Expire drops those of ids that are not members.
  size_t live_records() const;

 private:
  void Emit(MemberEvent::Kind kind, const NodeIdentity& node, uint64_t now_ns,
            uint64_t silent_ms = 0);

  const MembershipOptions options_;
  std::map<std::string, Member> members_;  // by node id: one incarnation each
  uint64_t version_ = 1;
  uint64_t last_expire_ns_ = 0;
  uint64_t next_seq_ = 1;
  std::deque<MemberEvent> events_;
  // Heartbeats recorded by Touch: node id -> (incarnation, last seen). Lock order: the
  // caller's lock, then live_mu_.
  mutable std::mutex live_mu_;
  std::unordered_map<std::string, std::pair<uint64_t, uint64_t>> live_;
};

}  // namespace kvbridge::store
