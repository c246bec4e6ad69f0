// MasterState (store/master_state.h): configuration checks, creation, the periodic Tick, Stats,
// Snapshot and CheckInvariants, and the replica bookkeeping every part uses (adding, detaching,
// holding and freeing replicas). The private state is MasterState::Impl
// (store/master_state_impl.h); the rest of the master is in master_placement.cc,
// master_nodes.cc, master_tiers.cc, master_repair.cc and master_puts.cc.
#include "store/master_state.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "store/master_state_impl.h"

namespace kvbridge::store {

const char* NodeStateName(NodeState s) {
  switch (s) {
    case NodeState::kActive:
      return "ACTIVE";
    case NodeState::kDraining:
      return "DRAINING";
    case NodeState::kDead:
      return "DEAD";
  }
  return "UNKNOWN";
}

std::string ToString(const NodeIdentity& id) {
  char inc[17];
  snprintf(inc, sizeof(inc), "%016llx", static_cast<unsigned long long>(id.incarnation));
  return id.node_id + "#" + inc;
}

Status MasterConfig::Validate() const {
  auto bad = [](const std::string& what) {
    return Status::InvalidArgument("MasterConfig: " + what);
  };
  if (node_ttl_ms == 0) return bad("node_ttl_ms must be > 0");
  if (lease_ms == 0) return bad("lease_ms must be > 0");
  if (put_timeout_ms == 0) return bad("put_timeout_ms must be > 0");
  if (task_timeout_ms == 0) return bad("task_timeout_ms must be > 0");
  if (max_replicas == 0) return bad("max_replicas must be > 0");
  if (min_replicas == 0 || min_replicas > max_replicas) {
    return bad("min_replicas (" + Num(min_replicas) + ") must be in 1..max_replicas (" +
               Num(max_replicas) + ")");
  }
  if (!(low_watermark > 0 && low_watermark <= high_watermark && high_watermark <= 1)) {
    return bad("watermarks must satisfy 0 < low_watermark <= high_watermark <= 1");
  }
  if (!(max_put_fill >= 0 && max_put_fill <= 1)) {
    return bad("max_put_fill must be 0 (= high_watermark) or a fraction up to 1");
  }
  if (alignment == 0 || (alignment & (alignment - 1)) != 0) {
    return bad("alignment must be a power of two");
  }
  if (max_key_bytes == 0) return bad("max_key_bytes must be > 0");
  if (max_buffers == 0) return bad("max_buffers must be > 0");
  if (max_object_bytes == 0 || max_object_bytes > (1ull << 62)) {
    return bad("max_object_bytes must be in 1..2^62");
  }
  if (eviction_sample_size == 0) return bad("eviction_sample_size must be > 0");
  if (!(demote_low_watermark > 0 && demote_low_watermark <= demote_high_watermark &&
        demote_high_watermark <= 1)) {
    return bad(
        "demote watermarks must satisfy 0 < demote_low_watermark <= "
        "demote_high_watermark <= 1");
  }
  if (max_demotions_per_node == 0) return bad("max_demotions_per_node must be > 0");
  if (max_tasks_per_node == 0) return bad("max_tasks_per_node must be > 0");
  if (max_frees_per_reply == 0) return bad("max_frees_per_reply must be > 0");
  if (max_tasks_per_reply == 0) return bad("max_tasks_per_reply must be > 0");
  if (max_demotions_per_reply == 0) return bad("max_demotions_per_reply must be > 0");
  if (health_half_life_ms == 0) return bad("health_half_life_ms must be > 0");
  return Status::OK();
}

// replica_id 0 = a new allocation: the next id.
MasterState::Impl::Replica& MasterState::Impl::AddReplica(Object* o, Node* n, Segment* s,
                                                          uint64_t offset, ReplicaState state,
                                                          uint64_t replica_id) {
  Replica r;
  r.node = n;
  r.segment = s;
  r.offset = offset;
  r.replica_id = replica_id != 0 ? replica_id : next_replica_id++;
  r.state = state;
  r.resident_index = static_cast<uint32_t>(s->residents.size());
  s->residents.push_back(o);
  n->replicas++;
  o->replicas.push_back(r);
  return o->replicas.back();
}

// Forgets the replica without touching its space (the caller frees, holds, or the node is
// going away with its allocators).
// Releases the SSD range of a pending demotion (the node's late report then gets NOT_FOUND
// and deletes its copy).
// An issued move whose target is DRAM (a promotion) may still be written by its node until
// its deadline: that range is held until then, never reused earlier. (An SSD target is the
// plugin's business: the node deletes its copy when DemoteDone answers NOT_FOUND.)
// `length` is the object's; may_hold = false frees the range at once in any case.
void MasterState::Impl::CancelDemotion(Replica& r, uint64_t length, bool may_hold) {
  if (r.demote_id == 0) return;
  const Move mv = MoveOf(r);
  if (mv.issued && mv.segment->info.tier == Tier::kDram && may_hold) {
    held.push_back({r.node, mv.segment, mv.offset, length,
                    mv.deadline_ns + MsToNs(cfg.task_timeout_ms), std::nullopt});
    r.node->held++;
  } else {
    mv.segment->alloc.Free(mv.offset, length);
  }
  EndMove(r);
  r.node->demotions--;
}

MasterState::Impl::Segment* MasterState::Impl::SsdSegment(Node& n) {
  for (auto& [sid, s] : n.segments) {
    if (s.info.tier == Tier::kSsd) return &s;
  }
  return nullptr;
}

// Takes the replica out of its segment's residents (its index fixed up in the object moved
// into its slot); the replica itself stays.
void MasterState::Impl::Unreside(Object* o, Replica& r) {
  auto& v = r.segment->residents;
  const size_t i = r.resident_index;
  Object* moved = v.back();
  v[i] = moved;
  v.pop_back();
  if (moved != o) {
    for (Replica& mr : moved->replicas) {
      if (mr.segment == r.segment) {
        mr.resident_index = static_cast<uint32_t>(i);
        break;
      }
    }
  }
}

void MasterState::Impl::DetachReplica(Object* o, size_t idx) {
  CancelDemotion(o->replicas[idx], o->bytes());
  Replica& r = o->replicas[idx];
  Unreside(o, r);
  r.node->replicas--;
  o->replicas.erase(o->replicas.begin() + static_cast<std::ptrdiff_t>(idx));
}

// When the space of this replica may be reused: after the object's lease if readers may be
// on it; if a writer may still be writing, after the writer's deadline plus
// late_write_margin_ms, whether it reported failure, was revoked or is late: a writer that
// gave up (or was given up on) may still have bytes on their way. A replica whose write
// completed (COMMITTING: the writer's transfer was acknowledged) has no writer left.
uint64_t MasterState::Impl::HoldUntil(const Object& o, const Replica& r) const {
  const uint64_t margin = MsToNs(cfg.late_write_margin_ms);
  uint64_t h = 0;
  if (r.state == ReplicaState::kComplete) h = o.lease_expiry_ns;
  if (r.state == ReplicaState::kWriting) h = std::max(h, o.put_deadline_ns() + margin);
  if (r.state == ReplicaState::kCopying && r.task_id != 0) {
    auto t = tasks.find(r.task_id);
    if (t != tasks.end() && t->second.state == TaskState::kIssued) {
      h = std::max(h, t->second.deadline_ns + margin);
    }
  }
  return h;
}

void MasterState::Impl::FreeRange(Node* n, Segment* s, uint64_t offset, uint64_t length,
                                  const std::optional<InventoryRecord>& rec) {
  s->alloc.Free(offset, length);
  if (rec) QueueFree(n, *rec);
}

// Detaches the replica and frees its space now, or holds it until hold_until_ns.
void MasterState::Impl::ReleaseReplica(Object* o, size_t idx, uint64_t now_ns,
                                       uint64_t hold_until_ns) {
  const Replica r = o->replicas[idx];
  std::optional<InventoryRecord> rec;
  if (r.record_on_node) rec = Record(*o, r);
  DetachReplica(o, idx);
  if (hold_until_ns > now_ns) {
    held.push_back({r.node, r.segment, r.offset, o->bytes(), hold_until_ns, std::move(rec)});
    r.node->held++;
  } else {
    FreeRange(r.node, r.segment, r.offset, o->bytes(), rec);
  }
}

void MasterState::Impl::EraseTask(std::map<uint64_t, Task>::iterator it) {
  it->second.source->source_tasks--;
  tasks.erase(it);
}

// Drops a replica (cancelling its task, if it is a task's destination).
void MasterState::Impl::DropReplica(Object* o, size_t idx, uint64_t now_ns) {
  const uint64_t hold = HoldUntil(*o, o->replicas[idx]);
  if (uint64_t tid = o->replicas[idx].task_id; tid != 0) {
    auto t = tasks.find(tid);
    if (t != tasks.end()) EraseTask(t);
  }
  ReleaseReplica(o, idx, now_ns, hold);
}

void MasterState::Impl::EraseObject(Object* o, uint64_t now_ns) {
  while (!o->replicas.empty()) DropReplica(o, o->replicas.size() - 1, now_ns);
  if (auto p = pending_keys.find(o->key()); p != pending_keys.end()) pending_keys.erase(p);
  if (auto r = repair_keys.find(o->key()); r != repair_keys.end()) repair_keys.erase(r);
  RemoveFromTable(o);
  Object::Delete(o);
}

// ------------------------------------------------------------------ MasterState

MasterState::MasterState(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
MasterState::~MasterState() = default;

Result<std::unique_ptr<MasterState>> MasterState::Create(const MasterConfig& config) {
  KVB_RETURN_IF_ERROR(config.Validate());
  auto impl = std::make_unique<Impl>(config);
  return std::unique_ptr<MasterState>(new MasterState(std::move(impl)));
}

const MasterConfig& MasterState::config() const { return impl_->cfg; }

TickSummary MasterState::Tick(uint64_t now_ns) {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);
  TickSummary sum;

  // Silent nodes (heartbeats that arrived while this lock was busy were recorded by Touch):
  // membership expires them, and each is dropped as its kExpired event is applied.
  const Membership::Expiry expiry = m.members.Expire(now_ns);
  sum.since_last_tick_ms = expiry.since_last_ms;
  sum.paused_ms = expiry.paused_ms;
  sum.expired_silence_ms = expiry.longest_silence_ms;
  const size_t notes_expired = std::erase_if(m.departed, [&](const auto& d) {
    return now_ns >= d.second.since_ns &&
           now_ns - d.second.since_ns >= MsToNs(m.cfg.departed_ttl_ms);
  });
  if (notes_expired > 0) m.RebuildDepartedFilter();
  m.ApplyMemberEvents(now_ns);
  sum.nodes_expired = expiry.expired.size();

  // Overdue puts (also those whose put end stalled in its commit phase).
  std::vector<Impl::Object*> overdue;
  for (const std::string& key : m.pending_keys) {
    Impl::Object* o = m.FindObject(key);
    if (o->put_deadline_ns() <= now_ns) overdue.push_back(o);
  }
  for (Impl::Object* o : overdue) m.EraseObject(o, now_ns);
  sum.puts_revoked = overdue.size();
  m.revokes_total += overdue.size();

  // Tasks not reported (or not committed) in time.
  std::vector<uint64_t> late;
  for (const auto& [tid, t] : m.tasks) {
    if (t.state != Impl::TaskState::kQueued && t.deadline_ns <= now_ns) late.push_back(tid);
  }
  for (uint64_t tid : late) m.FailTask(m.tasks.find(tid), now_ns);
  sum.tasks_timed_out = late.size();

  // Held space whose lease or writer deadline passed.
  std::erase_if(m.held, [&](const Impl::Held& h) {
    if (h.release_at_ns > now_ns) return false;
    m.FreeRange(h.node, h.segment, h.offset, h.length, h.record);
    h.node->held--;
    ++sum.ranges_released;
    return true;
  });

  // Demotions: late ones cancelled, new ones queued.
  m.ExpireDemotions(now_ns, sum);
  m.ScheduleDemotions(now_ns, sum);

  // Segments above the high watermark (DRAM of a node with an SSD tier is demoted instead;
  // only puts that find no room evict there).
  for (auto& [id, n] : m.nodes) {
    const bool tiered = n.state == NodeState::kActive && Impl::SsdSegment(n) != nullptr;
    for (auto& [sid, s] : n.segments) {
      if (tiered && s.info.tier == Tier::kDram) continue;
      const double cap = static_cast<double>(s.info.capacity);
      if (static_cast<double>(s.alloc.used_bytes()) <= m.cfg.high_watermark * cap) continue;
      const double low = m.cfg.low_watermark * cap;
      sum.objects_evicted += m.EvictUntil(
          s, [&] { return static_cast<double>(s.alloc.used_bytes()) <= low; }, SIZE_MAX, now_ns);
    }
  }

  // Re-replication and drains.
  const std::vector<std::string> keys(m.repair_keys.begin(), m.repair_keys.end());
  for (const std::string& key : keys) {
    Impl::Object* o = m.FindObject(key);
    if (!o || o->state != ObjectState::kComplete) {
      // Gone, or a put: its put end re-queues it if needed.
      if (o) {
        m.UnmarkRepair(o);
      } else {
        m.repair_keys.erase(key);
      }
      continue;
    }
    if (now_ns < o->repair_not_before_ns()) continue;
    m.RepairOne(o, now_ns, sum);
  }
  for (auto& [id, n] : m.nodes) {
    if (!n.drained && m.DrainDone(n, now_ns)) {
      n.drained = true;
      ++sum.drains_finished;
    }
  }

  // Health counters decay.
  if (m.last_decay_ns == 0 || now_ns < m.last_decay_ns) m.last_decay_ns = now_ns;
  const uint64_t elapsed = now_ns - m.last_decay_ns;
  if (elapsed >= MsToNs(100)) {
    const double f = std::exp2(-static_cast<double>(elapsed) /
                               static_cast<double>(MsToNs(m.cfg.health_half_life_ms)));
    for (auto& [id, n] : m.nodes) {
      n.reads *= f;
      n.bad_reports *= f;
    }
    m.last_decay_ns = now_ns;
  }
  // Placements (Place) whose copies have ended: a move drops its source replica here.
  for (auto& [id, p] : m.placements) m.AdvancePlacement(p, now_ns);
  return sum;
}

std::vector<InflightMap> MasterState::InflightToPublish(uint64_t now_ns, bool growth_only) const {
  const Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);
  std::vector<InflightMap> out;
  if (!m.cfg.track_inflight || (growth_only && !m.inflight_grown)) return out;
  for (const auto& [id, n] : m.nodes) {
    InflightMap map;
    bool changed = false;
    for (const auto& [sid, seg] : n.segments) {
      if (seg.info.tier != Tier::kDram) continue;
      uint64_t bits = 0;
      for (size_t c = 0; c < seg.chunk_until_ns.size(); ++c) {
        if (seg.chunk_until_ns[c] > now_ns) bits |= uint64_t{1} << c;
      }
      changed |= bits != seg.published_chunks;
      map.segments.push_back({sid, seg.chunk_bytes, bits});
    }
    if (!changed) continue;
    map.node_id = id;
    map.incarnation = n.id().incarnation;
    out.push_back(std::move(map));
  }
  return out;
}

void MasterState::InflightPublished(const std::vector<InflightMap>& maps, uint64_t now_ns) {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);
  for (const InflightMap& map : maps) {
    auto it = m.nodes.find(map.node_id);
    if (it == m.nodes.end() || it->second.id().incarnation != map.incarnation) continue;
    for (const InflightMap::Segment& ps : map.segments) {
      auto seg = it->second.segments.find(ps.segment_id);
      if (seg != it->second.segments.end()) seg->second.published_chunks = ps.chunks;
    }
  }
  // Chunks marked meanwhile that these maps lack are still to publish.
  m.inflight_grown = false;
  for (const auto& [id, n] : m.nodes) {
    for (const auto& [sid, seg] : n.segments) {
      for (size_t c = 0; c < seg.chunk_until_ns.size(); ++c) {
        m.inflight_grown |= seg.chunk_until_ns[c] > now_ns && (seg.published_chunks >> c & 1) == 0;
      }
    }
  }
}

MasterStats MasterState::Stats() const {
  const Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);
  MasterStats st;
  for (const auto& [id, n] : m.nodes) {
    NodeStats ns;
    ns.identity = n.id();
    ns.state = n.state;
    ns.drained = n.drained;
    ns.replicas = n.replicas;
    ns.last_heartbeat_ns = m.members.Find(n.id())->last_seen_ns;
    for (const auto& [sid, s] : n.segments) {
      if (s.info.tier == Tier::kDram) {
        ns.capacity += s.info.capacity;
        ns.used += s.alloc.used_bytes();
      } else {
        ns.ssd_capacity += s.info.capacity;
        ns.ssd_used += s.alloc.used_bytes();
        st.ssd_replicas += s.residents.size();
      }
      ns.segments.push_back(
          {sid, s.info.tier, s.info.capacity, s.alloc.used_bytes(), s.residents.size()});
    }
    st.nodes.push_back(std::move(ns));
  }
  for (const NodeStats& d : m.dead_nodes) st.nodes.push_back(d);
  for (const Impl::Object* o : m.objects) {
    if (o->state != ObjectState::kComplete) continue;
    ++st.objects;
    st.bytes += o->bytes();
    st.replica_bytes += o->bytes() * Impl::CompleteReplicas(*o);
  }
  st.pending = m.pending_keys.size();
  for (const Impl::Held& h : m.held) st.held_bytes += m.RoundUp(h.length);
  st.tasks_in_flight = m.tasks.size();
  st.under_replicated = m.repair_keys.size();
  for (const std::string& key : m.repair_keys) {
    const Impl::Object* o = m.FindObject(key);
    if (!o) continue;  // dropped at the next pass
    const uint64_t since = o->repair_since_ns();
    if (st.oldest_repair_ns == 0 || since < st.oldest_repair_ns) st.oldest_repair_ns = since;
  }
  st.next_version = m.next_version;
  st.directory_version = m.members.version();
  st.evictions_total = m.evictions_total;
  st.revokes_total = m.revokes_total;
  st.nodes_expired_total = m.nodes_expired_total;
  st.bad_replicas_total = m.bad_replicas_total;
  st.unreachable_reports_total = m.unreachable_reports_total;
  st.demotions_total = m.demotions_total;
  st.promotions_total = m.promotions_total;
  for (const auto& [id, n] : m.nodes) st.demotions_in_flight += n.demotions;
  st.departed_nodes = m.departed.size();
  for (const auto& [id, d] : m.departed) st.departed_copies += d.copies.size();
  st.departed_dropped_total = m.departed_dropped_total;
  return st;
}

MasterSnapshot MasterState::Snapshot() const {
  const Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);
  MasterSnapshot snap;
  snap.alignment = m.cfg.alignment;
  for (const Impl::Object* o : m.objects) {
    MasterSnapshot::Object so;
    so.key = o->key();
    so.version = o->version;
    so.state = o->state;
    so.sizes = o->SizesVector();
    so.checksum = o->checksum;
    so.target_replicas = o->target;
    so.pinned = o->pinned;
    so.lease_expiry_ns = o->lease_expiry_ns;
    for (const Impl::Replica& r : o->replicas) {
      so.replicas.push_back({m.Location(*o, r), r.state, r.task_id, r.replica_id, std::nullopt});
      if (r.demote_id != 0) {
        const Impl::Move& mv = m.MoveOf(r);
        so.replicas.back().demote_to =
            ReplicaLocation{r.node->id(), mv.segment->info.segment_id, mv.offset, o->bytes(),
                            mv.segment->info.tier};
      }
    }
    snap.objects.push_back(std::move(so));
  }
  std::sort(snap.objects.begin(), snap.objects.end(),
            [](const auto& a, const auto& b) { return a.key < b.key; });
  for (const Impl::Held& h : m.held) {
    snap.held.push_back(
        {{h.node->id(), h.segment->info.segment_id, h.offset, h.length, h.segment->info.tier},
         h.release_at_ns});
  }
  for (const auto& [id, n] : m.nodes) {
    for (const auto& [sid, s] : n.segments) {
      snap.segments.push_back({n.id(), n.state, sid, s.info.capacity, s.alloc.used_bytes(),
                               s.alloc.allocation_count()});
    }
  }
  for (const auto& [tid, t] : m.tasks) {
    snap.tasks.push_back(
        {tid, t.key, t.version, t.source->id(), t.dest->id(), t.state != Impl::TaskState::kQueued});
  }
  return snap;
}

Status MasterState::CheckInvariants() const {
  const Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);
  auto fail = [](const std::string& what) { return Status::Internal("invariant: " + what); };
  // The node table follows membership: the same identities, in the same state.
  if (m.nodes.size() != m.members.members().size()) {
    return fail(Num(m.nodes.size()) + " nodes but " + Num(m.members.members().size()) + " members");
  }
  for (const auto& [id, n] : m.nodes) {
    const Membership::Member* member = m.members.Find(n.id());
    if (member == nullptr) return fail(ToString(n.id()) + " is a node but not a member");
    if (member->state != n.state) {
      return fail(ToString(n.id()) + " is " + NodeStateName(n.state) + " but its member is " +
                  NodeStateName(member->state));
    }
  }
  // The departed filter has every departed copy (a miss would let a put skip the copy it must
  // forget, and an old version come back with its node).
  for (const auto& [id, d] : m.departed) {
    for (const Impl::DepartedCopy& c : d.copies) {
      if (!m.MayBeDeparted(c.key_hash))
        return fail("a copy of departed " + id + " is not in the filter");
    }
  }
  size_t moves_seen = 0;  // pending moves found on replicas
  for (const auto& [id, n] : m.nodes) {
    size_t replicas = 0, held = 0, source_tasks = 0;
    for (const auto& [sid, s] : n.segments) {
      uint64_t used = 0;
      size_t allocs = 0;
      // Every range the segment's holders know of: allocated (no free byte), and no two of
      // them overlapping (the allocator keeps no record per allocation to compare against).
      std::vector<std::pair<uint64_t, uint64_t>> ranges;
      for (size_t i = 0; i < s.residents.size(); ++i) {
        const Impl::Object* o = s.residents[i];
        const int idx = Impl::ReplicaOn(*o, &n);
        if (idx < 0)
          return fail(std::string(o->key()) + " is resident on " + id + " without a replica there");
        const Impl::Replica& r = o->replicas[idx];
        if (r.segment != &s || r.resident_index != i) {
          return fail(std::string(o->key()) + ": resident index of its replica on " + id +
                      " is wrong");
        }
        if (!s.alloc.IsAllocated(r.offset, o->bytes())) {
          return fail(std::string(o->key()) + ": replica on " + id + " at " + Num(r.offset) +
                      " does not match an allocation");
        }
        ranges.emplace_back(r.offset, m.RoundUp(o->bytes()));
        used += m.RoundUp(o->bytes());
        ++allocs;
      }
      for (const auto& [sid2, s2] : n.segments) {
        for (const Impl::Object* o : s2.residents) {
          const Impl::Replica& r = o->replicas[Impl::ReplicaOn(*o, &n)];
          if (r.demote_id == 0 || m.MoveOf(r).segment != &s) continue;
          const uint64_t offset = m.MoveOf(r).offset;
          if (!s.alloc.IsAllocated(offset, o->bytes())) {
            return fail(std::string(o->key()) + ": demotion range on " + id + " is not allocated");
          }
          ranges.emplace_back(offset, m.RoundUp(o->bytes()));
          ++moves_seen;
          used += m.RoundUp(o->bytes());
          ++allocs;
        }
      }
      for (const Impl::Held& h : m.held) {
        if (h.segment != &s) continue;
        if (!s.alloc.IsAllocated(h.offset, h.length)) {
          return fail("held range at " + Num(h.offset) + " on " + id + " is not allocated");
        }
        ranges.emplace_back(h.offset, m.RoundUp(h.length));
        used += m.RoundUp(h.length);
        ++allocs;
        ++held;
      }
      std::sort(ranges.begin(), ranges.end());
      for (size_t i = 1; i < ranges.size(); ++i) {
        if (ranges[i - 1].first + ranges[i - 1].second > ranges[i].first) {
          return fail("segment " + Num(sid) + " of " + id + ": ranges at " +
                      Num(ranges[i - 1].first) + " and " + Num(ranges[i].first) + " overlap");
        }
      }
      if (used != s.alloc.used_bytes() || allocs != s.alloc.allocation_count()) {
        return fail("segment " + Num(sid) + " of " + id + ": allocator holds " +
                    Num(s.alloc.used_bytes()) + " bytes in " + Num(s.alloc.allocation_count()) +
                    " ranges; replicas and held ranges account for " + Num(used) + " in " +
                    Num(allocs));
      }
      replicas += s.residents.size();
    }
    for (const auto& [tid, t] : m.tasks) source_tasks += t.source == &n;
    if (replicas != n.replicas || held != n.held || source_tasks != n.source_tasks) {
      return fail("counters of " + id + " are off");
    }
  }
  if (moves_seen != m.moves.size()) {
    return fail(Num(m.moves.size()) + " moves recorded, " + Num(moves_seen) + " on replicas");
  }
  size_t pending = 0;
  for (const Impl::Object* o : m.objects) {
    const std::string key(o->key());
    std::set<const Impl::Node*> holders;
    size_t complete = 0;
    for (const Impl::Replica& r : o->replicas) {
      auto nit = m.nodes.find(r.node->id().node_id);
      if (nit == m.nodes.end() || &nit->second != r.node) {
        return fail(key + " has a replica on an unregistered node");
      }
      if (!holders.insert(r.node).second) return fail(key + " has two replicas on one node");
      complete += r.state == ReplicaState::kComplete;
      if (r.task_id != 0) {
        auto t = m.tasks.find(r.task_id);
        if (t == m.tasks.end() || t->second.dest != r.node || t->second.key != key) {
          return fail(key + ": replica names a task that does not match");
        }
      } else if (r.state == ReplicaState::kCopying) {
        return fail(key + ": a copying replica without a task");
      }
      if (o->state == ObjectState::kComplete && r.state == ReplicaState::kWriting) {
        return fail(key + ": complete object with a replica being written");
      }
    }
    if (o->state == ObjectState::kComplete && complete == 0) {
      return fail(key + " is complete without a complete replica");
    }
    if (o->state != ObjectState::kComplete) {
      ++pending;
      if (!m.pending_keys.count(key)) return fail(key + " is pending but not indexed");
    }
  }
  if (pending != m.pending_keys.size()) return fail("pending index is off");
  size_t overwrites = 0;
  for (const Impl::Object* o : m.objects) {
    overwrites += o->key().starts_with(Impl::kOverwritePrefix);
  }
  if (overwrites != m.overwrites_in_table) return fail("overwrite count is off");
  for (const auto& [tid, t] : m.tasks) {
    const Impl::Object* o = m.FindObject(t.key);
    if (!o || o->version != t.version || Impl::ReplicaWithTask(*o, tid) < 0) {
      return fail("task " + Num(tid) + " has no destination replica");
    }
    const int src = Impl::ReplicaOn(*o, t.source);
    if (src < 0 || o->replicas[src].state != ReplicaState::kComplete) {
      return fail("task " + Num(tid) + " has no complete source replica");
    }
  }
  return Status::OK();
}

}  // namespace kvbridge::store
