// The master's node table (MasterState::Impl, store/master_state_impl.h): what it does when
// membership (store/membership.h: joins, leases, leaving, the directory) changes
// (ApplyMemberEvents), registration with an inventory (LoadInventory rebuilds objects from it
// after a master restart), heartbeats, frees delivered until acknowledged, drain, dropping a
// node (DropNode), and the notes kept on departed nodes (Departed, CapDeparted).
#include <algorithm>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "store/master_state_impl.h"

namespace kvbridge::store {

namespace {

constexpr size_t kDeadNodesKept = 32;

}  // namespace

// When nothing the master handed out may still read or write the node's memory: leases of
// the objects on it, writers' deadlines (plus late_write_margin_ms) of ranges being written,
// held ranges, promotions into its DRAM.
uint64_t MasterState::Impl::ReuseHorizon(const Node* n) const {
  uint64_t h = 0;
  for (const auto& [sid, s] : n->segments) {
    for (const Object* o : s.residents) {
      const Replica& r = o->replicas[ReplicaOn(*o, n)];
      h = std::max(h, HoldUntil(*o, r));
      if (r.demote_id != 0) {
        const Move& mv = MoveOf(r);
        if (mv.issued && mv.segment->info.tier == Tier::kDram) {
          h = std::max(h, mv.deadline_ns + MsToNs(cfg.task_timeout_ms));
        }
      }
    }
  }
  for (const Held& held_range : held) {
    if (held_range.node == n) h = std::max(h, held_range.release_at_ns);
  }
  return h;
}

// Drops a node: its tasks, held ranges and replicas; objects left without a COMPLETE
// replica are removed, the others queued for re-replication.
void MasterState::Impl::DropNode(Node* n, uint64_t now_ns, bool expired) {
  const uint64_t reuse_after_ns = ReuseHorizon(n);
  for (auto it = tasks.begin(); it != tasks.end();) {
    Task& t = it->second;
    if (t.dest != n && t.source != n) {
      ++it;
      continue;
    }
    Object* o = FindObject(t.key);
    const int idx = ReplicaWithTask(*o, t.id);
    if (t.dest == n) {
      o->replicas[idx].task_id = 0;  // detached below with the node's other replicas
      t.source->source_tasks--;
      it = tasks.erase(it);
    } else {
      // A source declared dead may only be cut off: it may write until the task deadline
      // (and its bytes land up to late_write_margin_ms later).
      const uint64_t hold =
          t.state == TaskState::kIssued ? t.deadline_ns + MsToNs(cfg.late_write_margin_ms) : 0;
      it = tasks.erase(it);
      ReleaseReplica(o, idx, now_ns, hold);
      MarkRepair(o, now_ns);
    }
  }
  // Every record the node may still hold, for when it comes back (departed).
  Departed& gone = departed[n->id().node_id];
  gone = Departed{};
  gone.since_ns = now_ns;
  gone.incarnation = n->id().incarnation;
  gone.reuse_after_ns = reuse_after_ns;
  for (const auto& [seq, rec] : n->frees) gone.Note(Departed::KeyHash(rec.key), rec.version, false);
  std::vector<Object*> affected;
  for (auto& [sid, s] : n->segments)
    affected.insert(affected.end(), s.residents.begin(), s.residents.end());
  for (Object* o : affected) {
    const size_t idx = ReplicaOn(*o, n);
    const bool recorded = o->replicas[idx].record_on_node;
    const uint64_t version = o->version;
    const uint64_t key_hash = Departed::KeyHash(o->key());
    DetachReplica(o, idx);
    bool left_with_it = false;
    if (o->state == ObjectState::kComplete) {
      if (CompleteReplicas(*o) == 0) {
        EraseObject(o, now_ns);
        left_with_it = true;
      } else {
        MarkRepair(o, now_ns);
      }
    } else if (o->replicas.empty()) {
      EraseObject(o, now_ns);  // a put that lost every replica
      ++revokes_total;
    }
    if (recorded) gone.Note(key_hash, version, left_with_it);
  }

  // Last: detaching above may have held ranges of this node (cancelled promotions).
  for (const Held& h : held) {
    if (h.node == n && h.record) {
      gone.Note(Departed::KeyHash(h.record->key), h.record->version, false);
    }
  }
  gone.Seal();
  CapDeparted();
  RebuildDepartedFilter();
  std::erase_if(held, [n](const Held& h) { return h.node == n; });
  if (expired) {
    NodeStats dead;
    dead.identity = n->id();
    dead.state = NodeState::kDead;
    dead.last_heartbeat_ns = now_ns;
    for (auto& [sid, s] : n->segments) dead.capacity += s.info.capacity;
    dead_nodes.push_front(std::move(dead));
    if (dead_nodes.size() > kDeadNodesKept) dead_nodes.pop_back();
    ++nodes_expired_total;
  }
  const std::string id = n->id().node_id;  // (n is the entry erased)
  nodes.erase(id);
}

// Membership changed (Join, SetDraining, Leave, Expire): the node table follows, event by
// event in order. Called under `mu` right after each change, so that a node is in `nodes`
// exactly while it is a member.
void MasterState::Impl::ApplyMemberEvents(uint64_t now_ns) {
  for (const MemberEvent& ev : members.TakeEvents()) {
    switch (ev.kind) {
      case MemberEvent::Kind::kJoined: {
        const Membership::Member* member = members.Find(ev.node);
        if (member == nullptr) break;  // gone again by a later event
        Node& n = nodes[ev.node.node_id];
        n.identity = ev.node;
        n.state = member->state;
        if (n.state == NodeState::kDraining) {
          n.drain_deadline_ns = now_ns + MsToNs(cfg.drain_timeout_ms);
        }
        for (const SegmentInfo& s : member->registration.segments) {
          n.segments.try_emplace(s.segment_id, s, cfg.alignment);
        }
        break;
      }
      case MemberEvent::Kind::kDraining: {
        Node* n = FindNodeExact(ev.node);
        if (n == nullptr) break;
        n->state = NodeState::kDraining;
        n->drain_deadline_ns = now_ns + MsToNs(cfg.drain_timeout_ms);
        for (auto& [sid, s] : n->segments) {
          for (Object* o : s.residents) MarkRepair(o, now_ns);
        }
        break;
      }
      case MemberEvent::Kind::kLeft:
      case MemberEvent::Kind::kReplaced:
      case MemberEvent::Kind::kExpired:
        if (Node* n = FindNodeExact(ev.node)) {
          DropNode(n, now_ns, /*expired=*/ev.kind == MemberEvent::Kind::kExpired);
        }
        break;
    }
  }
}

bool MasterState::Impl::DrainDone(const Node& n, uint64_t now_ns) const {
  return n.state == NodeState::kDraining &&
         (n.drained || (n.replicas == 0 && n.held == 0) || now_ns >= n.drain_deadline_ns);
}

// Past cfg.max_departed_nodes notes or cfg.max_departed_copies copies, drops the oldest notes
// (the newest too, if it alone holds more than the copy cap) down to 7/8 of both caps, so that
// a stream of nodes leaving pays the sort once per eighth of the cap, not on every one.
void MasterState::Impl::CapDeparted() {
  uint64_t copies = 0;
  for (const auto& [id, d] : departed) copies += d.copies.size();
  if (departed.size() <= cfg.max_departed_nodes && copies <= cfg.max_departed_copies) return;
  const size_t keep_nodes = cfg.max_departed_nodes - cfg.max_departed_nodes / 8;
  const uint64_t keep_copies = cfg.max_departed_copies - cfg.max_departed_copies / 8;
  std::vector<std::pair<uint64_t, const std::string*>> by_age;  // (since_ns, node id)
  by_age.reserve(departed.size());
  for (const auto& [id, d] : departed) by_age.emplace_back(d.since_ns, &id);
  std::sort(by_age.begin(), by_age.end(), [](const auto& a, const auto& b) {
    return std::tie(a.first, *a.second) < std::tie(b.first, *b.second);
  });
  std::vector<std::string> victims;
  size_t left = departed.size();
  for (const auto& [since, id] : by_age) {
    if (left <= keep_nodes && copies <= keep_copies) break;
    const Departed& d = departed.at(*id);
    copies -= d.copies.size();
    departed_dropped_reuse_after_ns = std::max(departed_dropped_reuse_after_ns, d.reuse_after_ns);
    victims.push_back(*id);
    --left;
  }
  for (const std::string& id : victims) departed.erase(id);
  departed_dropped_total += victims.size();
}

// A new put or a remove of `key`: no copy of an older version a departed node holds may come
// back with it.
namespace {
// The filter's two bit positions of a key hash (of `bits`, a power of two).
std::pair<uint64_t, uint64_t> FilterBits(uint64_t h, uint64_t bits) {
  const uint64_t second = (h >> 32 | h << 32) * 0x9E3779B97F4A7C15ull;
  return {h & (bits - 1), second >> 7 & (bits - 1)};
}
}  // namespace

void MasterState::Impl::RebuildDepartedFilter() {
  uint64_t copies = 0;
  for (const auto& [id, d] : departed) copies += d.copies.size();
  departed_filter.clear();
  if (copies == 0) return;
  uint64_t bits = 64;
  while (bits < copies * 16) bits <<= 1;
  departed_filter.assign(bits / 64, 0);
  for (const auto& [id, d] : departed) {
    for (const DepartedCopy& c : d.copies) {
      const auto [a, b] = FilterBits(c.key_hash, bits);
      departed_filter[a / 64] |= uint64_t{1} << (a % 64);
      departed_filter[b / 64] |= uint64_t{1} << (b % 64);
    }
  }
}

bool MasterState::Impl::MayBeDeparted(uint64_t key_hash) const {
  if (departed_filter.empty()) return false;
  const auto [a, b] = FilterBits(key_hash, departed_filter.size() * 64);
  return (departed_filter[a / 64] >> (a % 64) & 1) != 0 &&
         (departed_filter[b / 64] >> (b % 64) & 1) != 0;
}

void MasterState::Impl::ForgetDepartedCopies(std::string_view key) {
  const uint64_t h = Departed::KeyHash(key);
  if (!MayBeDeparted(h)) return;
  for (auto& [id, d] : departed) d.Forget(h);
}

// Rebuilds objects from a registering node's records; see RegisterNode.
void MasterState::Impl::LoadInventory(Node& n, const std::vector<InventoryRecord>& inventory,
                                      uint64_t now_ns, RegisterReply& reply) {
  // 1. Well-formed records only; every version and replica id seen moves the counters.
  std::vector<size_t> cand;
  std::vector<uint64_t> bytes(inventory.size(), 0);
  for (size_t i = 0; i < inventory.size(); ++i) {
    const InventoryRecord& rec = inventory[i];
    if (!CheckKey(rec.key).ok() || !CheckSizes(rec.sizes, &bytes[i]).ok() || rec.version == 0 ||
        rec.replica_id == 0 || !n.segments.count(rec.segment_id)) {
      reply.frees.push_back(rec);
      continue;
    }
    next_version = std::max(next_version, rec.version + 1);
    next_replica_id = std::max(next_replica_id, rec.replica_id + 1);
    cand.push_back(i);
  }
  auto newer_version = [&](size_t a, size_t b) {
    return std::tie(inventory[a].version, inventory[a].replica_id) >
           std::tie(inventory[b].version, inventory[b].replica_id);
  };
  // 2. One record per key on this node: its newest version.
  std::stable_sort(cand.begin(), cand.end(), newer_version);
  std::set<std::string_view> seen;
  std::vector<size_t> keep;
  for (size_t i : cand) {
    if (seen.insert(inventory[i].key).second) {
      keep.push_back(i);
    } else {
      reply.frees.push_back(inventory[i]);
    }
  }
  // 3. Overlapping ranges: the later allocation holds the bytes.
  std::stable_sort(keep.begin(), keep.end(), [&](size_t a, size_t b) {
    return inventory[a].replica_id > inventory[b].replica_id;
  });
  std::vector<size_t> placed;
  for (size_t i : keep) {
    const InventoryRecord& rec = inventory[i];
    if (n.segments.at(rec.segment_id).alloc.Reserve(rec.offset, bytes[i])) {
      placed.push_back(i);
    } else {
      reply.frees.push_back(rec);
    }
  }
  // 4. Against the table, newest versions first. A node id that left before (departed):
  // a copy of an object that stayed on other nodes and is gone now (removed, evicted, put
  // again) is freed; one of an object that left with it comes back.
  const auto dep = departed.find(n.id().node_id);
  std::stable_sort(placed.begin(), placed.end(), newer_version);
  for (size_t i : placed) {
    const InventoryRecord& rec = inventory[i];
    Segment* seg = &n.segments.at(rec.segment_id);
    const uint32_t target = std::clamp<uint32_t>(rec.replica_num, 1, cfg.max_replicas);
    // An overwrite in flight of this version is not complete: its record is refused, as a
    // pending put's is.
    Object* o = FindPut(rec.key, rec.version);
    bool accept;
    if (!o) {
      accept = true;
      if (dep != departed.end()) {
        if (const DepartedCopy* c = dep->second.Find(rec.key, rec.version)) {
          accept = c->comes_back;
        }
      }
    } else if (o->version > rec.version) {
      accept = false;
    } else if (o->version == rec.version) {
      size_t active = 0;
      for (const Replica& r : o->replicas) active += r.node->state == NodeState::kActive;
      // A draining node's copy is kept until the drain has moved it.
      accept = o->state == ObjectState::kComplete && std::ranges::equal(o->sizes(), rec.sizes) &&
               o->checksum == rec.checksum && ReplicaOn(*o, &n) < 0 &&
               (n.state == NodeState::kDraining || active < std::max(o->target, target));
    } else {
      EraseObject(o, now_ns);  // this record's version wins
      o = nullptr;
      accept = true;
    }
    if (!accept) {
      seg->alloc.Free(rec.offset, bytes[i]);
      reply.frees.push_back(rec);
      continue;
    }
    if (!o) {
      o = Object::New(rec.key, rec.sizes);
      o->version = rec.version;
      o->checksum = rec.checksum;
      o->state = ObjectState::kComplete;
      o->target = target;
      o->last_access_ns = now_ns;
      // Pins come back with the records: a soft pin for one TTL from now.
      o->pinned = rec.hard_pin;
      o->SoftPinFor(MsToNs(rec.soft_pin_ttl_ms), now_ns);
      InsertObject(o);
      // Let the other nodes re-register before judging the replica count.
      MarkRepair(o, now_ns, MsToNs(cfg.node_ttl_ms));
    }
    o->target = std::max(o->target, target);
    AddReplica(o, &n, seg, rec.offset, ReplicaState::kComplete, rec.replica_id).record_on_node =
        true;
    reply.records_accepted++;
  }
}

// ------------------------------------------------------------------ MasterState

Result<RegisterReply> MasterState::RegisterNode(const NodeRegistration& registration,
                                                const std::vector<InventoryRecord>& inventory,
                                                uint64_t now_ns) {
  Impl& m = *impl_;
  const NodeIdentity& id = registration.identity;
  if (id.node_id.empty()) return Status::InvalidArgument("node id is empty");
  if (registration.segments.empty()) {
    return Status::InvalidArgument("node " + id.node_id + " registers no segments");
  }
  std::set<uint64_t> seg_ids;
  for (const SegmentInfo& s : registration.segments) {
    if (s.capacity == 0) {
      return Status::InvalidArgument("segment " + Num(s.segment_id) + " has capacity 0");
    }
    if (!seg_ids.insert(s.segment_id).second) {
      return Status::InvalidArgument("segment id " + Num(s.segment_id) + " appears twice");
    }
  }
  std::lock_guard<std::mutex> lock(m.mu);
  // A new incarnation of a registered id replaces it: the old one is dropped as if dead
  // (kReplaced), then the new one gets its node entry (kJoined).
  if (m.members.Join(registration, now_ns).kind == Membership::JoinKind::kAgain) {
    return Status::AlreadyExists(ToString(id) + " is registered already");
  }
  m.ApplyMemberEvents(now_ns);
  Impl::Node& n = m.nodes.at(id.node_id);
  RegisterReply reply;
  reply.heartbeat_interval_ms = std::max<uint64_t>(1, m.cfg.node_ttl_ms / 3);
  // The same incarnation coming back (it expired, or the master restarted): writers and readers
  // of its previous registration may still be at its memory. This master knows how long when
  // it dropped that registration itself; otherwise (a new master) it assumes the worst any
  // predecessor could have handed out (restart_hold_until_ns).
  if (auto dep = m.departed.find(id.node_id);
      dep != m.departed.end() && dep->second.incarnation == id.incarnation) {
    n.no_alloc_before_ns = dep->second.reuse_after_ns;
  } else if (registration.registered_before && m.cfg.inflight_authoritative) {
    // An elected leader's predecessor published where its writers could still write: only
    // those chunks wait (ReserveInherited, after the inventory is in), the rest takes data now.
    n.no_alloc_before_ns = m.departed_dropped_reuse_after_ns;
  } else if (registration.registered_before) {
    // Its note may have been dropped by the caps (CapDeparted): wait as long as any dropped one.
    n.no_alloc_before_ns = std::max(m.cfg.restart_hold_until_ns, m.departed_dropped_reuse_after_ns);
  }
  if (n.no_alloc_before_ns > now_ns) {
    reply.no_alloc_ms = (n.no_alloc_before_ns - now_ns + kNsPerMs - 1) / kNsPerMs;
  }
  m.LoadInventory(n, inventory, now_ns, reply);
  if (registration.registered_before && m.cfg.inflight_authoritative) m.ReserveInherited(n, now_ns);
  // Queued, and delivered (the first max_frees_per_reply in this reply, the rest with `more`)
  // until acknowledged: a lost reply loses none of them.
  std::vector<InventoryRecord> rejected;
  rejected.swap(reply.frees);
  for (const InventoryRecord& rec : rejected) m.QueueFree(&n, rec);
  reply.more = m.TakeFrees(&n, 0, &reply.frees, &reply.free_seqs);
  if (m.departed.erase(id.node_id) > 0) {  // used up: what it holds now is in the table or freed
    m.RebuildDepartedFilter();
  }
  if (n.state == NodeState::kDraining) {
    for (auto& [sid, s] : n.segments) {
      for (Impl::Object* o : s.residents) {
        if (!m.repair_keys.contains(o->key())) m.MarkRepair(o, now_ns);
      }
    }
  }
  return reply;
}

Result<NodeCommands> MasterState::Heartbeat(const NodeIdentity& node, uint64_t frees_acked,
                                            uint64_t now_ns) {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);
  Status st;
  Impl::Node* n = m.FindNode(node, &st);
  if (!n) return st;
  m.members.KeepAlive(node, now_ns);
  NodeCommands cmds;
  cmds.more = m.TakeFrees(n, frees_acked, &cmds.frees, &cmds.free_seqs);
  while (!n->task_queue.empty() && cmds.tasks.size() < m.cfg.max_tasks_per_reply) {
    const uint64_t tid = n->task_queue.front();
    n->task_queue.pop_front();
    auto it = m.tasks.find(tid);
    if (it == m.tasks.end() || it->second.state != Impl::TaskState::kQueued) continue;
    it->second.state = Impl::TaskState::kIssued;
    it->second.deadline_ns = now_ns + MsToNs(m.cfg.task_timeout_ms);
    cmds.tasks.push_back(m.TaskView(it->second));
  }
  while (!n->demote_queue.empty() && cmds.demotions.size() < m.cfg.max_demotions_per_reply) {
    auto [key, demote_id] = std::move(n->demote_queue.front());
    n->demote_queue.pop_front();
    Impl::Object* o = m.FindObject(key);
    const int idx = o ? Impl::ReplicaOn(*o, n) : -1;
    if (idx < 0) continue;
    Impl::Replica& r = o->replicas[idx];
    if (r.demote_id == 0 || r.demote_id != demote_id || m.MoveOf(r).issued) continue;
    Impl::Move& mv = m.MoveOf(r);
    mv.issued = true;
    mv.deadline_ns = now_ns + MsToNs(m.cfg.task_timeout_ms);
    Demotion d;
    d.source = m.Record(*o, r);
    d.dest = d.source;
    d.dest.segment_id = mv.segment->info.segment_id;
    d.dest.offset = mv.offset;
    d.dest.replica_id = r.demote_id;
    d.deadline_ns = mv.deadline_ns;
    cmds.demotions.push_back(std::move(d));
  }
  // (Stale entries left in a queue make `more` true once too many: the next reply skips them.)
  cmds.more = cmds.more || !n->task_queue.empty() || !n->demote_queue.empty();
  cmds.drained = m.DrainDone(*n, now_ns);
  return cmds;
}

Result<NodeCommands> MasterState::UnackedFrees(const NodeIdentity& node) {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);
  Status st;
  Impl::Node* n = m.FindNode(node, &st);
  if (!n) return st;
  NodeCommands cmds;
  cmds.more = m.TakeFrees(n, 0, &cmds.frees, &cmds.free_seqs);
  return cmds;
}

Status MasterState::StartDrain(const NodeIdentity& node, uint64_t now_ns) {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);
  Status st;
  Impl::Node* n = m.FindNode(node, &st);
  if (!n) return st;
  if (n->state == NodeState::kDraining) return Status::OK();
  m.members.SetDraining(node, now_ns);
  m.ApplyMemberEvents(now_ns);  // its data is moved off
  return Status::OK();
}

Status MasterState::Deregister(const NodeIdentity& node, uint64_t now_ns) {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);
  Status st;
  Impl::Node* n = m.FindNode(node, &st);
  if (!n) return st;
  m.members.Leave(node, now_ns);
  m.ApplyMemberEvents(now_ns);  // dropped, as a death without the TTL wait
  return Status::OK();
}

NodeDirectory MasterState::GetNodeDirectory(const std::vector<std::string>& node_ids) const {
  const Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);
  return m.members.Directory(node_ids);
}

size_t MasterState::liveness_records() const { return impl_->members.live_records(); }

// Without `mu`: Membership::Touch takes only its own lock.
void MasterState::Touch(const NodeIdentity& node, uint64_t now_ns) {
  impl_->members.Touch(node, now_ns);
}

// Keeps new data off the chunks of n that the predecessor leader published (its writers may
// still be writing there) until restart_hold_until_ns: their free space is held, and stays in
// this leader's own published map as long, for a successor should this leader die meanwhile.
void MasterState::Impl::ReserveInherited(Node& n, uint64_t now_ns) {
  if (now_ns >= cfg.restart_hold_until_ns) return;
  for (const InflightMap& map : cfg.inherited_inflight) {
    if (map.node_id != n.id().node_id || map.incarnation != n.id().incarnation) continue;
    for (const InflightMap::Segment& ps : map.segments) {
      auto it = n.segments.find(ps.segment_id);
      if (it == n.segments.end() || it->second.info.tier != Tier::kDram || ps.chunk_bytes == 0) {
        continue;
      }
      Segment& seg = it->second;
      for (uint64_t c = 0; c < 64; ++c) {
        if ((ps.chunks >> c & 1) == 0) continue;
        for (const auto& [off, len] :
             seg.alloc.ReserveFreeWithin(c * ps.chunk_bytes, ps.chunk_bytes)) {
          held.push_back({&n, &seg, off, len, cfg.restart_hold_until_ns, std::nullopt});
          n.held++;
          for (uint64_t k = off / seg.chunk_bytes; k <= (off + len - 1) / seg.chunk_bytes && k < 64;
               ++k) {
            seg.chunk_until_ns[k] = std::max(seg.chunk_until_ns[k], cfg.restart_hold_until_ns);
          }
        }
      }
    }
  }
}

}  // namespace kvbridge::store
