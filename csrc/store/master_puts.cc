// The master's data-plane operations on objects (MasterState::Impl, store/master_state_impl.h):
// puts in two phases (PutStart allocates, BeginPutEnd/FinishPutEnd commit the inventory records
// on the nodes, PutRevoke gives up), GetReplicas (which grants read leases), Exists, Remove and
// RemoveAll.
#include <algorithm>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "store/key_pattern.h"
#include "store/master_state_impl.h"

namespace kvbridge::store {

Result<PutAllocation> MasterState::Impl::AllocateObject(const PutItem& item, uint64_t bytes,
                                                        const PutOptions& options, uint64_t now_ns,
                                                        const Object* replaces) {
  const size_t count = options.replica_num;
  std::vector<Choice> picks =
      ChooseNodes(now_ns, bytes, count, nullptr, nullptr, options.client_node_id);
  if (picks.size() < count) {
    MakeRoom(bytes, count, options.client_node_id, now_ns);
    picks = ChooseNodes(now_ns, bytes, count, nullptr, nullptr, options.client_node_id);
  }
  size_t active = 0, waiting = 0;
  for (const auto& [id, n] : nodes) {
    active += n.state == NodeState::kActive;
    waiting += n.state == NodeState::kActive && !Placeable(n, now_ns);
  }
  if (picks.size() < count) {
    return Status::NoSpace(
        "need " + Num(count) + " ACTIVE nodes with a free range of " + Num(RoundUp(bytes)) +
        " bytes; " + Num(picks.size()) + " of " + Num(active) +
        " ACTIVE nodes have one, even after eviction" +
        (waiting == 0 ? std::string()
                      : " (" + Num(waiting) +
                            " registered again and take no new data until writes and leases "
                            "of their previous registration have run out)"));
  }
  std::vector<uint64_t> offsets;
  for (const Choice& c : picks) {
    std::optional<uint64_t> off = c.segment->alloc.Allocate(bytes);
    if (!off) {
      for (size_t i = 0; i < offsets.size(); ++i) {
        picks[i].segment->alloc.Free(offsets[i], bytes);
      }
      return Status::NoSpace("allocation failed on " + c.node->id().node_id);
    }
    offsets.push_back(*off);
    MarkInflight(c.segment, *off, bytes, now_ns);
  }
  Object* o = Object::New(item.key, item.sizes);
  o->version = next_version++;
  o->state = ObjectState::kPending;
  o->target = options.replica_num;
  // Pins: a hard pin stays with every later version; a soft pin per PutOptions::soft_pin.
  o->pinned = options.pinned || (replaces != nullptr && replaces->pinned);
  if (options.soft_pin == SoftPin::kEnable) {
    o->SoftPinFor(
        MsToNs(options.soft_pin_ttl_ms != 0 ? options.soft_pin_ttl_ms : cfg.soft_pin_ttl_ms),
        now_ns);
  } else if (options.soft_pin == SoftPin::kPreserve && replaces != nullptr &&
             replaces->soft_pinned(now_ns)) {
    o->Extra().soft_pin_ttl_ns = replaces->soft_pin_ttl_ns();
    o->extra->soft_pin_until_ns = replaces->extra->soft_pin_until_ns;  // its deadline, as is
  }
  o->Extra().put_deadline_ns = now_ns + MsToNs(cfg.put_timeout_ms);
  o->last_access_ns = now_ns;
  InsertObject(o);
  pending_keys.insert(item.key);
  PutAllocation a;
  a.version = o->version;
  a.deadline_ns = o->put_deadline_ns();
  for (size_t i = 0; i < picks.size(); ++i) {
    Replica& r = AddReplica(o, picks[i].node, picks[i].segment, offsets[i], ReplicaState::kWriting);
    a.replicas.push_back(Location(*o, r));
  }
  o->Extra().put_layout = a.replicas;
  return a;
}

Status MasterState::Impl::BeginPutEndOne(const PutEndItem& item, uint64_t now_ns, PutEndPlan& plan,
                                         std::map<std::string, size_t>& commit_index) {
  KVB_RETURN_IF_ERROR(CheckKey(item.key));
  Object* o = FindPut(item.key, item.version);
  if (!o) return Status::NotFound("no such object: never put, revoked or timed out");
  if (o->version != item.version) {
    return Status::NotFound("version " + Num(item.version) + " is gone; the key now has " +
                            Num(o->version));
  }
  if (o->state == ObjectState::kComplete) return Status::AlreadyExists("already complete");
  if (o->state == ObjectState::kCommitting) {
    return Status::Unavailable("another put end of this version is in flight");
  }
  // A PENDING object has its put layout (set by AllocateObject, dropped when complete).
  const std::vector<ReplicaLocation>& layout = o->Extra().put_layout;
  if (item.replica_ok.size() != layout.size()) {
    return Status::InvalidArgument(Num(item.replica_ok.size()) + " replica flags for " +
                                   Num(layout.size()) + " replicas");
  }
  size_t written = 0;
  for (size_t i = 0; i < layout.size(); ++i) {
    const ReplicaLocation& want = layout[i];
    int idx = -1;
    for (size_t j = 0; j < o->replicas.size(); ++j) {
      const Replica& r = o->replicas[j];
      if (r.state == ReplicaState::kWriting && r.node->id() == want.node &&
          r.segment->info.segment_id == want.segment_id && r.offset == want.offset) {
        idx = static_cast<int>(j);
        break;
      }
    }
    if (idx < 0) continue;  // lost with its node
    if (!item.replica_ok[i]) {
      DropReplica(o, idx, now_ns);
      continue;
    }
    o->replicas[idx].state = ReplicaState::kCommitting;
    o->replicas[idx].record_on_node = true;
    ++written;
  }
  if (written < cfg.min_replicas) {
    const size_t total = layout.size();
    EraseObject(o, now_ns);
    ++revokes_total;
    return Status::Unavailable(Num(written) + " of " + Num(total) +
                               " replicas written; min_replicas is " + Num(cfg.min_replicas) +
                               "; put revoked");
  }
  o->checksum = item.checksum;
  o->state = ObjectState::kCommitting;
  o->Extra().put_deadline_ns = now_ns + MsToNs(cfg.put_timeout_ms);
  for (const Replica& r : o->replicas) {
    if (r.state != ReplicaState::kCommitting) continue;
    auto [it, inserted] = commit_index.try_emplace(r.node->id().node_id, plan.commits.size());
    if (inserted) {
      NodeCommit c;
      c.node = r.node->id();
      c.control_endpoint = Registration(*r.node).control_endpoint;
      plan.commits.push_back(std::move(c));
    }
    plan.commits[it->second].records.push_back(Record(*o, r));
  }
  return Status::OK();
}

Status MasterState::Impl::FinishPutEndOne(const KeyVersion& kv,
                                          const std::vector<CommitEntry>& entries,
                                          uint64_t now_ns) {
  Object* o = FindPut(kv.key, kv.version);
  if (!o || o->version != kv.version || o->state != ObjectState::kCommitting) {
    for (const CommitEntry& e : entries) {
      if (e.commit->ok) QueueFreeIfRegistered(e.commit->node, *e.record);
    }
    return Status::NotFound(
        "revoked while its inventory was being committed (put timeout, node death or a newer "
        "version)");
  }
  size_t complete = 0;
  for (const CommitEntry& e : entries) {
    int idx = -1;
    for (size_t j = 0; j < o->replicas.size(); ++j) {
      const Replica& r = o->replicas[j];
      if (r.state == ReplicaState::kCommitting && r.node->id() == e.commit->node &&
          r.segment->info.segment_id == e.record->segment_id && r.offset == e.record->offset) {
        idx = static_cast<int>(j);
        break;
      }
    }
    if (idx < 0) {
      if (e.commit->ok) QueueFreeIfRegistered(e.commit->node, *e.record);
      continue;
    }
    if (e.commit->ok) {
      o->replicas[idx].state = ReplicaState::kComplete;
      ++complete;
    } else {
      DropReplica(o, idx, now_ns);  // the node may have it: freed there
    }
  }
  for (size_t j = o->replicas.size(); j-- > 0;) {
    if (o->replicas[j].state != ReplicaState::kComplete) DropReplica(o, j, now_ns);
  }
  if (complete < cfg.min_replicas) {
    EraseObject(o, now_ns);
    ++revokes_total;
    return Status::Unavailable(Num(complete) + " replicas committed; min_replicas is " +
                               Num(cfg.min_replicas) + "; put revoked");
  }
  if (o->key() != kv.key) SwapInOverwrite(o, now_ns);
  o->state = ObjectState::kComplete;
  if (o->extra) {
    o->extra->put_layout = {};  // its memory too
    o->extra->put_deadline_ns = 0;
    o->TrimExtra();
  }
  o->last_access_ns = now_ns;
  if (auto p = pending_keys.find(o->key()); p != pending_keys.end()) pending_keys.erase(p);
  if (NeedsRepair(*o)) MarkRepair(o, now_ns);
  return Status::OK();
}

// An overwrite's new version `w` (under its OverwriteKey) takes the key's place in the table in
// one step: readers asking from now on get its replicas. The old version leaves as a removed
// object does: its ranges are held until the read leases granted on it end (a reader that got
// them before keeps reading the old bytes), then freed on the nodes.
void MasterState::Impl::SwapInOverwrite(Object* w, uint64_t now_ns) {
  const std::string table_key(w->key());
  const std::string key(PublicKey(table_key));
  RemoveFromTable(w);
  pending_keys.erase(table_key);
  UnmarkRepair(w);
  if (Object* old = FindObject(key)) EraseObject(old, now_ns);
  w->DropKeyPrefix(table_key.size() - key.size());
  InsertObject(w);
}

// ------------------------------------------------------------------ MasterState

std::vector<Result<PutAllocation>> MasterState::PutStart(const std::vector<PutItem>& items,
                                                         const PutOptions& options,
                                                         uint64_t now_ns) {
  Impl& m = *impl_;
  std::vector<Result<PutAllocation>> out;
  out.reserve(items.size());
  Status batch;
  if (options.replica_num == 0 || options.replica_num > m.cfg.max_replicas) {
    batch =
        Status::InvalidArgument("replica_num " + Num(options.replica_num) +
                                " is outside 1..max_replicas (" + Num(m.cfg.max_replicas) + ")");
  } else if (options.replica_num < m.cfg.min_replicas) {
    batch = Status::InvalidArgument("replica_num " + Num(options.replica_num) +
                                    " is below min_replicas (" + Num(m.cfg.min_replicas) +
                                    "): such a put could never complete");
  } else if (options.soft_pin_ttl_ms != 0 && options.soft_pin != SoftPin::kEnable) {
    batch = Status::InvalidArgument("soft_pin_ttl_ms " + Num(options.soft_pin_ttl_ms) +
                                    " given without enabling the soft pin");
  }
  std::unordered_map<std::string_view, size_t> seen;
  for (const PutItem& item : items) seen[item.key]++;

  std::lock_guard<std::mutex> lock(m.mu);
  for (const PutItem& item : items) {
    if (!batch.ok()) {
      out.push_back(batch);
      continue;
    }
    Status st = m.CheckKey(item.key);
    uint64_t bytes = 0;
    if (st.ok()) st = m.CheckSizes(item.sizes, &bytes);
    if (st.ok() && seen[item.key] > 1) {
      st = Status::InvalidArgument("key appears " + Num(seen[item.key]) + " times in the batch");
    }
    const Impl::Object* o = st.ok() ? m.FindObject(item.key) : nullptr;
    const Impl::Object* w = st.ok() ? m.FindOverwrite(item.key) : nullptr;
    if (!st.ok()) {
    } else if (options.overwrite && (w || (o && o->state != ObjectState::kComplete))) {
      // One new version at a time: the caller tries again once this one ended or timed out.
      st = Status::Unavailable((w ? "an overwrite" : "a put") +
                               std::string(" of this key is in progress (version ") +
                               Num((w ? w : o)->version) + ")");
    } else if (!options.overwrite && (o || w)) {
      st = Status::AlreadyExists(o && o->state == ObjectState::kComplete
                                     ? "object exists (version " + Num(o->version) + ")"
                                     : "object is being written (version " +
                                           Num((o ? o : w)->version) + ")");
    }
    if (!st.ok()) {
      out.push_back(std::move(st));
      continue;
    }
    if (!m.departed.empty()) m.ForgetDepartedCopies(item.key);  // a new version from here on
    if (o) {  // an overwrite of a complete object: written beside it
      out.push_back(
          m.AllocateObject({Impl::OverwriteKey(item.key), item.sizes}, bytes, options, now_ns, o));
    } else {
      out.push_back(m.AllocateObject(item, bytes, options, now_ns));
    }
  }
  return out;
}

PutEndPlan MasterState::BeginPutEnd(const std::vector<PutEndItem>& items, uint64_t now_ns) {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);
  PutEndPlan plan;
  std::map<std::string, size_t> commit_index;
  for (const PutEndItem& item : items) {
    plan.items.push_back({item.key, item.version});
    plan.early.push_back(m.BeginPutEndOne(item, now_ns, plan, commit_index));
  }
  return plan;
}

std::vector<Status> MasterState::FinishPutEnd(const PutEndPlan& plan, uint64_t now_ns) {
  Impl& m = *impl_;
  std::map<std::pair<std::string_view, uint64_t>, std::vector<Impl::CommitEntry>> by_key;
  for (const NodeCommit& c : plan.commits) {
    for (const InventoryRecord& r : c.records) by_key[{r.key, r.version}].push_back({&c, &r});
  }
  static const std::vector<Impl::CommitEntry> kNone;
  std::lock_guard<std::mutex> lock(m.mu);
  std::vector<Status> out;
  out.reserve(plan.items.size());
  for (size_t i = 0; i < plan.items.size(); ++i) {
    const Status early = i < plan.early.size() ? plan.early[i] : Status::Internal("bad plan");
    if (!early.ok()) {
      out.push_back(early);
      continue;
    }
    const KeyVersion& kv = plan.items[i];
    auto it = by_key.find({kv.key, kv.version});
    out.push_back(m.FinishPutEndOne(kv, it == by_key.end() ? kNone : it->second, now_ns));
  }
  return out;
}

std::vector<Status> MasterState::PutRevoke(const std::vector<KeyVersion>& items, uint64_t now_ns) {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);
  std::vector<Status> out;
  out.reserve(items.size());
  for (const KeyVersion& kv : items) {
    Status st = m.CheckKey(kv.key);
    Impl::Object* o = st.ok() ? m.FindPut(kv.key, kv.version) : nullptr;
    if (!st.ok()) {
    } else if (!o || o->version != kv.version) {
      st = Status::NotFound("no pending put of this key and version");
    } else if (o->state == ObjectState::kComplete) {
      st = Status::AlreadyExists("object is complete; use Remove");
    } else if (o->state == ObjectState::kCommitting) {
      st = Status::Unavailable("its put end is in flight");
    } else {
      m.EraseObject(o, now_ns);
      ++m.revokes_total;
    }
    out.push_back(std::move(st));
  }
  return out;
}

std::vector<Result<ReplicaSet>> MasterState::GetReplicas(const std::vector<std::string>& keys,
                                                         std::string_view client_node_id,
                                                         uint64_t now_ns, bool sizes_only) {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);
  std::vector<Result<ReplicaSet>> out;
  out.reserve(keys.size());
  for (const std::string& key : keys) {
    Status st = m.CheckKey(key);
    if (!st.ok()) {
      out.push_back(std::move(st));
      continue;
    }
    Impl::Object* o = m.FindObject(key);
    if (!o || o->state != ObjectState::kComplete || Impl::CompleteReplicas(*o) == 0) {
      out.push_back(Status::NotFound(o ? "object is being written" : "no such object"));
      continue;
    }
    std::vector<const Impl::Replica*> reps;
    for (const Impl::Replica& r : o->replicas) {
      if (r.state == ReplicaState::kComplete) reps.push_back(&r);
    }
    auto rank = [&](const Impl::Replica* r) {
      const Impl::Node& n = *r->node;
      // DRAM before SSD (an SSD replica is read through its node), then the client's own
      // node, healthy and lightly loaded nodes first.
      return std::make_tuple(r->segment->info.tier != Tier::kDram, n.id().node_id != client_node_id,
                             n.state != NodeState::kActive, n.bad_reports, n.reads, n.id().node_id);
    };
    std::sort(reps.begin(), reps.end(),
              [&](const Impl::Replica* a, const Impl::Replica* b) { return rank(a) < rank(b); });
    if (!sizes_only) {
      reps.front()->node->reads += 1;
      o->lease_expiry_ns = std::max(o->lease_expiry_ns, now_ns + MsToNs(m.cfg.lease_ms));
      o->last_access_ns = now_ns;
      if (const uint64_t ttl = o->soft_pin_ttl_ns(); ttl != 0) o->SoftPinFor(ttl, now_ns);
      if (reps.front()->segment->info.tier == Tier::kSsd) {
        m.MaybePromote(o, o->replicas[Impl::ReplicaOn(*o, reps.front()->node)], now_ns);
      }
    }
    ReplicaSet rs;
    rs.version = o->version;
    rs.sizes = o->SizesVector();
    rs.checksum = o->checksum;
    rs.lease_expiry_ns = o->lease_expiry_ns;
    for (const Impl::Replica* r : reps) rs.replicas.push_back(m.Location(*o, *r));
    out.push_back(std::move(rs));
  }
  return out;
}

std::vector<bool> MasterState::Exists(const std::vector<std::string>& keys) const {
  const Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);
  std::vector<bool> out;
  out.reserve(keys.size());
  for (const std::string& key : keys) {
    const Impl::Object* o = m.FindObject(key);
    out.push_back(o && o->state == ObjectState::kComplete);
  }
  return out;
}

Status MasterState::Remove(std::string_view key, uint64_t now_ns) {
  Impl& m = *impl_;
  KVB_RETURN_IF_ERROR(m.CheckKey(key));
  std::lock_guard<std::mutex> lock(m.mu);
  Impl::Object* o = m.FindObject(key);
  m.ForgetDepartedCopies(key);  // even if absent here: a departed node may hold it
  if (!o) return Status::NotFound("no such object");
  if (o->state != ObjectState::kComplete) {
    return Status::Unavailable("a put of this key is in progress");
  }
  m.EraseObject(o, now_ns);
  return Status::OK();
}

Result<size_t> MasterState::RemoveByRegex(std::string_view pattern, uint64_t now_ns) {
  Result<KeyPattern> re = KeyPattern::Compile(pattern);
  if (!re.ok()) return re.status();
  std::vector<std::string> keys;
  {
    const Impl& m = *impl_;
    std::lock_guard<std::mutex> lock(m.mu);
    keys.reserve(m.objects.size());
    for (const Impl::Object* o : m.objects) {
      if (o->state == ObjectState::kComplete) keys.emplace_back(o->key());
    }
  }
  size_t removed = 0;
  for (const std::string& key : keys) {
    if (re->Matches(key) && Remove(key, now_ns).ok()) ++removed;
  }
  return removed;
}

size_t MasterState::RemoveAll(uint64_t now_ns) {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);
  std::vector<Impl::Object*> victims;
  for (Impl::Object* o : m.objects) {
    if (o->state == ObjectState::kComplete) victims.push_back(o);
  }
  for (Impl::Object* o : victims) m.EraseObject(o, now_ns);
  for (auto& [id, d] : m.departed) {
    for (Impl::DepartedCopy& c : d.copies) c.comes_back = false;
  }
  return victims.size();
}

}  // namespace kvbridge::store
