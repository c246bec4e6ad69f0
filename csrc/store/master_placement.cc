// The master's placement (MasterState::Impl, store/master_state_impl.h): which nodes and DRAM
// segments take a new replica (ChooseNodes, FitSegment, the watermarks), and eviction of the
// least recently used objects to make room for a put (PickVictim, MakeRoom; EvictUntil is a
// template in the header, as the SSD tier evicts with it too).
#include <algorithm>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "store/master_state_impl.h"

namespace kvbridge::store {

// Bytes puts may fill a segment to (max_put_fill, by default the high watermark); the rest is
// headroom that re-replication and drains may use, so repairs still find room in a full
// cluster. Eviction brings a segment down to the low watermark.
uint64_t MasterState::Impl::HighLimit(const Segment& s) const {
  const double fill = cfg.max_put_fill > 0 ? cfg.max_put_fill : cfg.high_watermark;
  return static_cast<uint64_t>(fill * static_cast<double>(s.info.capacity));
}
uint64_t MasterState::Impl::LowLimit(const Segment& s) const {
  return static_cast<uint64_t>(cfg.low_watermark * static_cast<double>(s.info.capacity));
}

// The DRAM segment of n with the most free bytes among those with a free range for `bytes`;
// for a put (not a repair) the segment must also stay within HighLimit.
MasterState::Impl::Segment* MasterState::Impl::FitSegment(Node& n, uint64_t bytes, bool repair) {
  const uint64_t need = RoundUp(bytes);
  Segment* best = nullptr;
  for (auto& [sid, s] : n.segments) {
    if (s.info.tier != Tier::kDram || s.alloc.largest_free() < need) continue;
    if (!repair && s.alloc.used_bytes() + need > HighLimit(s)) continue;
    if (!best || s.alloc.free_bytes() > best->alloc.free_bytes()) best = &s;
  }
  return best;
}

// ACTIVE and not in its no-allocation window (a node back from expiry or a master restart
// whose memory may still be written by writers of its previous registration).
bool MasterState::Impl::Placeable(const Node& n, uint64_t now_ns) {
  return n.state == NodeState::kActive && now_ns >= n.no_alloc_before_ns;
}

// Up to `count` placeable nodes that can hold `bytes`, most free space first; `holder`
// excludes nodes already holding a replica of it, `avoid` node ids to skip.
std::vector<MasterState::Impl::Choice> MasterState::Impl::ChooseNodes(
    uint64_t now_ns, uint64_t bytes, size_t count, const Object* holder,
    const std::vector<std::string>* avoid, std::string_view preferred, bool repair) {
  struct Cand {
    Choice c;
    bool preferred;
    bool suspect;  // readers recently reported bad replicas there (dying, not yet expired)
    uint64_t free;
  };
  std::vector<Cand> cands;
  for (auto& [id, n] : nodes) {
    if (!Placeable(n, now_ns)) continue;
    if (holder && ReplicaOn(*holder, &n) >= 0) continue;
    if (avoid && std::find(avoid->begin(), avoid->end(), id) != avoid->end()) continue;
    Segment* s = FitSegment(n, bytes, repair);
    if (!s) continue;
    // bad_reports decays with health_half_life_ms: >= 0.5 means a report within about one
    // half-life.
    cands.push_back({{&n, s},
                     !preferred.empty() && id == preferred,
                     n.bad_reports >= 0.5,
                     s->alloc.free_bytes()});
  }
  std::sort(cands.begin(), cands.end(), [](const Cand& a, const Cand& b) {
    if (a.suspect != b.suspect) return b.suspect;
    if (a.preferred != b.preferred) return a.preferred;
    if (a.free != b.free) return a.free > b.free;
    return a.c.node->id().node_id < b.c.node->id().node_id;
  });
  std::vector<Choice> out;
  for (size_t i = 0; i < cands.size() && i < count; ++i) out.push_back(cands[i].c);
  return out;
}

bool MasterState::Impl::Evictable(const Object& o, uint64_t now_ns) const {
  if (o.state != ObjectState::kComplete || o.pinned || o.lease_expiry_ns > now_ns) return false;
  for (const Replica& r : o.replicas) {
    if (r.state != ReplicaState::kComplete) return false;  // a copy is in flight
  }
  return true;
}

// The least recently used evictable object among a sample of the segment's residents (all of
// them when the sample finds none, or only soft-pinned ones), or null. A soft-pinned object
// goes only when no other object of the segment can.
MasterState::Impl::Object* MasterState::Impl::PickVictim(Segment& s, uint64_t now_ns) {
  const auto& v = s.residents;
  Object* best = nullptr;
  bool best_pinned = false;
  auto consider = [&](Object* o) {
    if (!Evictable(*o, now_ns)) return;
    const bool pinned = o->soft_pinned(now_ns);
    if (!best || (best_pinned && !pinned) ||
        (pinned == best_pinned && o->last_access_ns < best->last_access_ns)) {
      best = o;
      best_pinned = pinned;
    }
  };
  if (v.size() > cfg.eviction_sample_size) {
    std::uniform_int_distribution<size_t> pick(0, v.size() - 1);
    for (uint32_t i = 0; i < cfg.eviction_sample_size; ++i) consider(v[pick(rng)]);
  }
  if (!best || best_pinned) {
    for (Object* o : v) consider(o);
  }
  return best;
}

// Evicts on ACTIVE nodes that cannot hold `bytes` until `count` nodes can (or the budget of
// evictions is spent).
void MasterState::Impl::MakeRoom(uint64_t bytes, size_t count, std::string_view preferred,
                                 uint64_t now_ns) {
  const size_t have = ChooseNodes(now_ns, bytes, count, nullptr, nullptr, preferred).size();
  if (have >= count) return;
  size_t need = count - have;
  const uint64_t rb = RoundUp(bytes);
  std::vector<Segment*> cands;
  for (auto& [id, n] : nodes) {
    if (!Placeable(n, now_ns) || FitSegment(n, bytes, false)) continue;
    Segment* best = nullptr;
    for (auto& [sid, s] : n.segments) {
      if (s.info.tier != Tier::kDram || HighLimit(s) < rb) continue;
      if (!best || s.alloc.free_bytes() > best->alloc.free_bytes()) best = &s;
    }
    if (best) cands.push_back(best);
  }
  std::stable_sort(cands.begin(), cands.end(), [](const Segment* a, const Segment* b) {
    return a->alloc.free_bytes() > b->alloc.free_bytes();
  });
  // Evict down to the low watermark (not just enough for this object), so the next puts find
  // room without evicting one object each.
  size_t budget = cfg.max_evictions_per_put;
  for (Segment* s : cands) {
    if (need == 0 || budget == 0) break;
    budget -= EvictUntil(
        *s,
        [&] { return s->alloc.largest_free() >= rb && s->alloc.used_bytes() + rb <= LowLimit(*s); },
        budget, now_ns);
    if (s->alloc.largest_free() >= rb && s->alloc.used_bytes() + rb <= HighLimit(*s)) --need;
  }
}

}  // namespace kvbridge::store
