// The master's SSD tier (MasterState::Impl, store/master_state_impl.h): demotion of cold DRAM
// replicas to a node's SSD segment past demote_high_watermark, promotion back to DRAM of SSD
// replicas read often, the moves' deadlines, and DemoteDone, the node's report of a move.
#include <algorithm>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "store/master_state_impl.h"

namespace kvbridge::store {

bool MasterState::Impl::Demotable(const Object& o, const Replica& r) const {
  if (o.state != ObjectState::kComplete || o.pinned) return false;
  for (const Replica& rr : o.replicas) {
    if (rr.state != ReplicaState::kComplete) return false;  // a copy is in flight
  }
  return r.segment->info.tier == Tier::kDram && r.demote_id == 0;
}

// On ACTIVE nodes with an SSD segment: DRAM segments above demote_high_watermark get their
// coldest replicas queued for demotion until demote_low_watermark (counting what is already
// on its way out), at most max_demotions_per_node pending per node.
void MasterState::Impl::ScheduleDemotions(uint64_t now_ns, TickSummary& sum) {
  for (auto& [id, n] : nodes) {
    if (n.state != NodeState::kActive) continue;    // a draining node moves data off instead
    if (now_ns < n.demote_not_before_ns) continue;  // its SSD failed lately
    Segment* ssd = SsdSegment(n);
    if (!ssd) continue;
    for (auto& [sid, s] : n.segments) {
      if (s.info.tier != Tier::kDram || n.demotions >= cfg.max_demotions_per_node) continue;
      const double cap = static_cast<double>(s.info.capacity);
      uint64_t leaving = 0;
      for (Object* o : s.residents) {
        if (o->replicas[ReplicaOn(*o, &n)].demote_id != 0) leaving += RoundUp(o->bytes());
      }
      const uint64_t used = s.alloc.used_bytes() - std::min(leaving, s.alloc.used_bytes());
      if (static_cast<double>(used) <= cfg.demote_high_watermark * cap) continue;
      const uint64_t low = static_cast<uint64_t>(cfg.demote_low_watermark * cap);
      uint64_t want = used - std::min(used, low);
      // A full SSD drops its coldest objects to make room (before the candidates are
      // collected: eviction erases objects).
      const double ssd_cap = static_cast<double>(ssd->info.capacity);
      const uint64_t ssd_low = static_cast<uint64_t>(cfg.low_watermark * ssd_cap);
      if (ssd->alloc.free_bytes() < want) {
        sum.objects_evicted += EvictUntil(
            *ssd,
            [&] { return ssd->alloc.free_bytes() >= want || ssd->alloc.used_bytes() <= ssd_low; },
            cfg.max_evictions_per_put, now_ns);
      }
      std::vector<Object*> cands;
      for (Object* o : s.residents) {
        if (Demotable(*o, o->replicas[ReplicaOn(*o, &n)])) cands.push_back(o);
      }
      std::sort(cands.begin(), cands.end(), [](const Object* a, const Object* b) {
        return std::pair(a->last_access_ns, a->key()) < std::pair(b->last_access_ns, b->key());
      });
      for (Object* o : cands) {
        if (want == 0 || n.demotions >= cfg.max_demotions_per_node) break;
        std::optional<uint64_t> off = ssd->alloc.Allocate(o->bytes());
        if (!off) break;  // the SSD is full of objects that cannot go yet
        Replica& r = o->replicas[ReplicaOn(*o, &n)];
        StartMove(r, ssd, *off);
        n.demotions++;
        n.demote_queue.emplace_back(o->key(), r.demote_id);
        want -= std::min(want, RoundUp(o->bytes()));
        ++sum.demotions_scheduled;
      }
    }
  }
}

// After promote_after_reads reads served from the SSD replica r (on node n) of o: queue its
// move back to n's DRAM, if n is ACTIVE, has a move slot, and its DRAM stays under
// demote_low_watermark with it (so the promoted object is not demoted right back).
void MasterState::Impl::MaybePromote(Object* o, Replica& r, uint64_t now_ns) {
  Node& n = *r.node;
  if (cfg.promote_after_reads == 0 || ++o->ssd_reads < cfg.promote_after_reads) return;
  if (!Placeable(n, now_ns) || now_ns < n.demote_not_before_ns ||
      n.demotions >= cfg.max_demotions_per_node || r.demote_id != 0 ||
      o->state != ObjectState::kComplete) {
    return;
  }
  for (const Replica& rr : o->replicas) {
    if (rr.state != ReplicaState::kComplete) return;  // a copy is in flight
  }
  Segment* dram = FitSegment(n, o->bytes(), false);
  if (!dram) return;
  const double low = cfg.demote_low_watermark * static_cast<double>(dram->info.capacity);
  if (static_cast<double>(dram->alloc.used_bytes() + RoundUp(o->bytes())) > low) return;
  std::optional<uint64_t> off = dram->alloc.Allocate(o->bytes());
  if (!off) return;
  MarkInflight(dram, *off, o->bytes(), now_ns);
  StartMove(r, dram, *off);
  n.demotions++;
  n.demote_queue.emplace_back(o->key(), r.demote_id);
  o->ssd_reads = 0;
}

// Moves handed out and not reported by their deadline are cancelled.
void MasterState::Impl::ExpireDemotions(uint64_t now_ns, TickSummary& sum) {
  for (auto& [id, n] : nodes) {
    if (n.demotions == 0) continue;
    for (auto& [sid, s] : n.segments) {
      for (Object* o : s.residents) {
        Replica& r = o->replicas[ReplicaOn(*o, &n)];
        if (r.demote_id != 0 && MoveOf(r).issued && MoveOf(r).deadline_ns <= now_ns) {
          CancelDemotion(r, o->bytes());
          ++sum.demotions_timed_out;
        }
      }
    }
  }
}

// ------------------------------------------------------------------ MasterState

Status MasterState::DemoteDone(const NodeIdentity& node, std::string_view key, uint64_t version,
                               uint64_t dest_replica_id, bool ok, uint64_t now_ns) {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);
  Status st;
  Impl::Node* n = m.FindNode(node, &st);
  if (!n && st.IsNotFound()) {
    // Not NOT_FOUND, which tells the node to drop its copy: after a master restart the node's
    // registration (with that copy in its inventory) may be on its way.
    return Status::Unavailable(st.message() + "; report the move again once registered");
  }
  if (!n) return st;
  Impl::Object* o = m.FindObject(key);
  // Asked again after an answer was lost on the way: a move already applied answers OK again,
  // or the node would drop the copy the master now lists.
  if (ok && o && o->version == version) {
    for (const Impl::Replica& r : o->replicas) {
      if (r.node == n && r.replica_id == dest_replica_id) return Status::OK();
    }
  }
  const int idx = o && o->version == version ? Impl::ReplicaOn(*o, n) : -1;
  if (idx < 0 || o->replicas[idx].demote_id == 0 || o->replicas[idx].demote_id != dest_replica_id) {
    return Status::NotFound("demotion of " + std::string(key) + " is no longer wanted");
  }
  Impl::Replica& r = o->replicas[idx];
  if (!ok) {
    m.CancelDemotion(r, o->bytes(), /*may_hold=*/false);
    n->demote_not_before_ns = now_ns + MsToNs(m.cfg.repair_backoff_ms);
    return Status::OK();
  }
  // The replica moves to its new range; the old one stays readable until the read leases end.
  Impl::Segment* old_segment = r.segment;
  const uint64_t old_offset = r.offset;
  std::optional<InventoryRecord> old_record;
  if (r.record_on_node) old_record = m.Record(*o, r);
  m.Unreside(o, r);
  const Impl::Move mv = m.MoveOf(r);
  r.segment = mv.segment;
  r.offset = mv.offset;
  r.replica_id = r.demote_id;
  r.record_on_node = true;
  r.resident_index = static_cast<uint32_t>(r.segment->residents.size());
  r.segment->residents.push_back(o);
  m.EndMove(r);
  n->demotions--;
  if (r.segment->info.tier == Tier::kSsd) {
    ++m.demotions_total;
  } else {
    ++m.promotions_total;
  }
  if (o->lease_expiry_ns > now_ns) {
    m.held.push_back(
        {n, old_segment, old_offset, o->bytes(), o->lease_expiry_ns, std::move(old_record)});
    n->held++;
  } else {
    m.FreeRange(n, old_segment, old_offset, o->bytes(), old_record);
  }
  return Status::OK();
}

}  // namespace kvbridge::store
