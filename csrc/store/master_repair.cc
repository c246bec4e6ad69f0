// The master's re-replication (MasterState::Impl, store/master_state_impl.h): objects below
// their replica target, or with replicas on a draining node, get copy tasks (RepairOne) from a
// source node to a new one; TaskDone/FinishTask commit or fail them; ReportBadReplica and
// ReportUnreachableNode take readers' reports on replicas and nodes.
#include <algorithm>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "store/master_state_impl.h"

namespace kvbridge::store {

void MasterState::Impl::FailTask(std::map<uint64_t, Task>::iterator it, uint64_t now_ns) {
  Object* o = FindObject(it->second.key);
  const int idx = ReplicaWithTask(*o, it->first);
  const uint64_t hold = HoldUntil(*o, o->replicas[idx]);
  const std::string dest = it->second.dest->id().node_id;
  EraseTask(it);
  ReleaseReplica(o, idx, now_ns, hold);
  std::vector<std::string>& failed = o->Extra().failed_dests;
  if (std::find(failed.begin(), failed.end(), dest) == failed.end()) failed.push_back(dest);
  MarkRepair(o, now_ns, MsToNs(cfg.repair_backoff_ms));
}

// A COMPLETE replica to copy from: a DRAINING node's first (that is what drain means), then
// the node with the fewest tasks; null if every source is at max_tasks_per_node.
const MasterState::Impl::Replica* MasterState::Impl::ChooseSource(const Object& o) const {
  const Replica* best = nullptr;
  for (const Replica& r : o.replicas) {
    if (r.state != ReplicaState::kComplete) continue;
    if (r.node->source_tasks >= cfg.max_tasks_per_node) continue;
    // A replica being demoted may leave its range before a task's copy ends.
    if (r.demote_id != 0) continue;
    if (!best) {
      best = &r;
      continue;
    }
    const bool rd = r.node->state == NodeState::kDraining;
    const bool bd = best->node->state == NodeState::kDraining;
    if (rd != bd) {
      if (rd) best = &r;
      continue;
    }
    if (r.node->source_tasks < best->node->source_tasks) best = &r;
  }
  return best;
}

void MasterState::Impl::RepairOne(Object* o, uint64_t now_ns, TickSummary& summary) {
  size_t active = 0, inflight = 0, draining = 0;
  for (const Replica& r : o->replicas) {
    if (r.state != ReplicaState::kComplete) {
      ++inflight;
    } else if (r.node->state == NodeState::kDraining) {
      ++draining;
    } else {
      ++active;
    }
  }
  bool blocked = false;
  while (active + inflight < o->target) {
    const Replica* src = ChooseSource(*o);
    if (!src) break;  // sources busy: next tick
    const std::vector<std::string>* failed = o->extra ? &o->extra->failed_dests : nullptr;
    std::vector<Choice> dest = ChooseNodes(now_ns, o->bytes(), 1, o, failed, {}, true);
    if (dest.empty() && failed && !failed->empty()) {
      o->extra->failed_dests.clear();  // no other choice: retry the ones that failed
      dest = ChooseNodes(now_ns, o->bytes(), 1, o, nullptr, {}, true);
    }
    std::optional<uint64_t> off;
    if (!dest.empty()) off = dest[0].segment->alloc.Allocate(o->bytes());
    if (!off) {
      blocked = true;
      break;
    }
    CreateTask(o, *src, dest[0].node, dest[0].segment, *off, now_ns);
    ++inflight;
    ++summary.tasks_created;
  }
  if (inflight == 0 && draining > 0 && active > 0 && (active >= o->target || blocked)) {
    for (size_t i = o->replicas.size(); i-- > 0;) {
      if (o->replicas[i].node->state == NodeState::kDraining) DropReplica(o, i, now_ns);
    }
    draining = 0;
  }
  if (inflight == 0 && draining == 0 && active >= o->target) {
    UnmarkRepair(o);
  } else if (inflight == 0) {
    o->Extra().repair_not_before_ns = now_ns + MsToNs(cfg.repair_backoff_ms);
  }
}

void MasterState::Impl::CreateTask(Object* o, const Replica& src, Node* dest, Segment* segment,
                                   uint64_t offset, uint64_t now_ns) {
  MarkInflight(segment, offset, o->bytes(), now_ns);
  Task t;
  t.id = next_task_id++;
  t.key = o->key();
  t.version = o->version;
  t.source = src.node;
  t.source_segment = src.segment->info.segment_id;
  t.source_offset = src.offset;
  t.dest = dest;
  t.source->source_tasks++;
  t.source->task_queue.push_back(t.id);
  // AddReplica may reallocate o->replicas: src is not used past this point.
  AddReplica(o, dest, segment, offset, ReplicaState::kCopying).task_id = t.id;
  tasks.emplace(t.id, std::move(t));
}

// ------------------------------------------------------------------ placements (Place)

void MasterState::Impl::AdvancePlacement(Placement& p, uint64_t now_ns) {
  PlacementStatus& st = p.status;
  if (st.state != PlacementState::kProcessing) return;
  auto fail = [&](std::string why) {
    st.state = PlacementState::kFailed;
    st.message = std::move(why);
    st.updated_ns = now_ns;
  };
  Object* o = FindObject(p.key);
  if (o == nullptr || o->version != p.version) {
    return fail("the object was removed or replaced (version " + Num(p.version) + ")");
  }
  bool done = true;
  for (const std::string& id : p.targets) {
    auto n = nodes.find(id);
    const int idx = n == nodes.end() ? -1 : ReplicaOn(*o, &n->second);
    if (idx < 0) return fail("the copy to " + id + " failed (node gone, copy failed or evicted)");
    done = done && o->replicas[idx].state == ReplicaState::kComplete;
  }
  if (!done) return;
  if (!p.move_from.empty()) {
    auto n = nodes.find(p.move_from);
    if (n != nodes.end()) {
      if (const int idx = ReplicaOn(*o, &n->second); idx >= 0) {
        DropReplica(o, static_cast<size_t>(idx), now_ns);
      }
    }
  }
  st.state = PlacementState::kSuccess;
  st.updated_ns = now_ns;
}

Result<uint64_t> MasterState::Place(std::string_view key, const std::vector<std::string>& targets,
                                    const std::string& move_from, uint64_t now_ns) {
  Impl& m = *impl_;
  KVB_RETURN_IF_ERROR(m.CheckKey(key));
  if (targets.empty()) return Status::InvalidArgument("no target node to copy to");
  if (!move_from.empty() && targets.size() != 1) {
    return Status::InvalidArgument("a move has one target node, not " + Num(targets.size()));
  }
  for (size_t i = 0; i < targets.size(); ++i) {
    if (targets[i] == move_from) {
      return Status::InvalidArgument("a move from " + move_from + " to itself");
    }
    if (std::find(targets.begin(), targets.begin() + i, targets[i]) != targets.begin() + i) {
      return Status::InvalidArgument("target node " + targets[i] + " named twice");
    }
  }
  std::lock_guard<std::mutex> lock(m.mu);
  Impl::Object* o = m.FindObject(key);
  if (o == nullptr || o->state != ObjectState::kComplete) {
    return Status::NotFound("no complete object under this key");
  }
  auto active = [&](const std::string& id) -> Result<Impl::Node*> {
    auto n = m.nodes.find(id);
    if (n == m.nodes.end()) return Status::NotFound("node " + id + " is not registered");
    if (n->second.state != NodeState::kActive) {
      return Status::Unavailable("node " + id + " is not ACTIVE");
    }
    return &n->second;
  };
  if (!move_from.empty()) {
    auto n = m.nodes.find(move_from);
    const int idx = n == m.nodes.end() ? -1 : Impl::ReplicaOn(*o, &n->second);
    if (idx < 0 || o->replicas[idx].state != ReplicaState::kComplete) {
      return Status::NotFound("node " + move_from + " holds no complete replica to move");
    }
  }
  // Every target is checked, and has room, before any task is made.
  std::vector<std::pair<Impl::Node*, Impl::Segment*>> dests;
  for (const std::string& id : targets) {
    Result<Impl::Node*> found = active(id);
    if (!found.ok()) return found.status();
    Impl::Node* n = *found;
    if (Impl::ReplicaOn(*o, n) >= 0) continue;  // there already (or being copied there)
    Impl::Segment* s = m.FitSegment(*n, o->bytes(), /*repair=*/true);
    if (s == nullptr) {
      return Status::NoSpace("node " + id + " has no free range of " + Num(o->bytes()) + " bytes");
    }
    dests.emplace_back(n, s);
  }
  std::string source;
  for (const auto& [n, s] : dests) {
    const Impl::Replica* src = m.ChooseSource(*o);
    if (src == nullptr) {
      return Status::Unavailable("every node holding the object is busy with copies");
    }
    std::optional<uint64_t> off = s->alloc.Allocate(o->bytes());
    if (!off) return Status::NoSpace("allocation failed on " + n->id().node_id);
    if (source.empty()) source = src->node->id().node_id;
    m.CreateTask(o, *src, n, s, *off, now_ns);
  }
  const uint64_t id = m.next_placement_id++;
  Impl::Placement& p = m.placements[id];
  p.key = std::string(key);
  p.version = o->version;
  p.targets = targets;
  p.move_from = move_from;
  p.status.key = p.key;
  p.status.move = !move_from.empty();
  p.status.source = source;
  p.status.created_ns = p.status.updated_ns = now_ns;
  m.AdvancePlacement(p, now_ns);  // every target held it already: done at once
  // Forget the oldest finished placements beyond max_placements.
  for (auto it = m.placements.begin();
       m.placements.size() > m.cfg.max_placements && it != m.placements.end();) {
    if (it->second.status.state != PlacementState::kProcessing) {
      it = m.placements.erase(it);
    } else {
      ++it;
    }
  }
  return id;
}

Result<PlacementStatus> MasterState::QueryPlacement(uint64_t id, uint64_t now_ns) {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);
  auto it = m.placements.find(id);
  if (it == m.placements.end()) {
    return Status::NotFound("no placement task " + Num(id) +
                            " (unknown, forgotten, or handed out by a master before a restart)");
  }
  m.AdvancePlacement(it->second, now_ns);
  return it->second.status;
}

ReplicationTask MasterState::Impl::TaskView(const Task& t) const {
  const Object& o = *FindObject(t.key);
  const Replica& dest = o.replicas[ReplicaWithTask(o, t.id)];
  ReplicationTask v;
  v.task_id = t.id;
  v.key = t.key;
  v.version = t.version;
  v.checksum = o.checksum;
  v.source = {t.source->id(), t.source_segment, t.source_offset, o.bytes(),
              t.source->segments.at(t.source_segment).info.tier};
  v.dest = Location(o, dest);
  v.dest_descriptor = Registration(*t.dest).engine_descriptor;
  v.dest_control_endpoint = Registration(*t.dest).control_endpoint;
  v.deadline_ns = t.deadline_ns;
  return v;
}

// ------------------------------------------------------------------ MasterState

Status MasterState::ReportBadReplica(std::string_view key, uint64_t version,
                                     const NodeIdentity& node, uint64_t now_ns, uint64_t segment_id,
                                     uint64_t offset) {
  Impl& m = *impl_;
  KVB_RETURN_IF_ERROR(m.CheckKey(key));
  std::lock_guard<std::mutex> lock(m.mu);
  Impl::Object* o = m.FindObject(key);
  if (!o || o->version != version || o->state != ObjectState::kComplete) {
    return Status::NotFound("no complete object of this key and version");
  }
  Impl::Node* n = m.FindNodeExact(node);
  const int idx = n ? Impl::ReplicaOn(*o, n) : -1;
  if (idx < 0 || o->replicas[idx].state != ReplicaState::kComplete) {
    return Status::NotFound("no complete replica on " + ToString(node));
  }
  if (segment_id != 0 && (o->replicas[idx].segment->info.segment_id != segment_id ||
                          o->replicas[idx].offset != offset)) {
    return Status::NotFound("the replica on " + ToString(node) + " has moved since");
  }
  n->bad_reports += 1;
  ++m.bad_replicas_total;
  std::vector<std::string>& failed = o->Extra().failed_dests;
  if (std::find(failed.begin(), failed.end(), node.node_id) == failed.end()) {
    failed.push_back(node.node_id);  // not the first choice for its new copy
  }
  // Copies reading from the bad replica are cancelled (their destinations freed later).
  std::vector<uint64_t> cancel;
  for (const auto& r : o->replicas) {
    if (r.task_id != 0 && m.tasks.at(r.task_id).source == n) cancel.push_back(r.task_id);
  }
  for (uint64_t tid : cancel) m.DropReplica(o, Impl::ReplicaWithTask(*o, tid), now_ns);
  m.DropReplica(o, Impl::ReplicaOn(*o, n), now_ns);
  if (Impl::CompleteReplicas(*o) == 0) {
    m.EraseObject(o, now_ns);
  } else {
    m.MarkRepair(o, now_ns);
  }
  return Status::OK();
}

Status MasterState::ReportUnreachableNode(const NodeIdentity& node, uint64_t /*now_ns*/) {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);
  Impl::Node* n = m.FindNodeExact(node);
  if (!n) return Status::NotFound("no node " + ToString(node));
  n->bad_reports += 1;
  ++m.unreachable_reports_total;
  return Status::OK();
}

Result<TaskCommitPlan> MasterState::TaskDone(uint64_t task_id, const NodeIdentity& source, bool ok,
                                             uint64_t now_ns) {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);
  auto it = m.tasks.find(task_id);
  if (it == m.tasks.end()) return Status::NotFound("task " + Num(task_id) + " is not running");
  Impl::Task& t = it->second;
  if (!(t.source->id() == source)) {
    return Status::StalePeer("task " + Num(task_id) + " belongs to " + ToString(t.source->id()));
  }
  if (t.state == Impl::TaskState::kCommitting) {
    return Status::Unavailable("task " + Num(task_id) + " was reported already");
  }
  TaskCommitPlan plan;
  plan.task_id = task_id;
  if (!ok) {
    m.FailTask(it, now_ns);
    return plan;
  }
  Impl::Object* o = m.FindObject(t.key);
  Impl::Replica& r = o->replicas[Impl::ReplicaWithTask(*o, task_id)];
  r.state = ReplicaState::kCommitting;
  r.record_on_node = true;
  t.state = Impl::TaskState::kCommitting;
  t.deadline_ns = now_ns + MsToNs(m.cfg.task_timeout_ms);
  NodeCommit c;
  c.node = t.dest->id();
  c.control_endpoint = m.Registration(*t.dest).control_endpoint;
  c.records.push_back(m.Record(*o, r));
  plan.commits.push_back(std::move(c));
  return plan;
}

Status MasterState::FinishTask(const TaskCommitPlan& plan, uint64_t now_ns) {
  if (plan.commits.empty()) return Status::OK();
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);
  const NodeCommit& c = plan.commits.front();
  auto it = m.tasks.find(plan.task_id);
  if (it == m.tasks.end() || it->second.state != Impl::TaskState::kCommitting) {
    if (c.ok) {
      for (const InventoryRecord& r : c.records) m.QueueFreeIfRegistered(c.node, r);
    }
    return Status::NotFound("task " + Num(plan.task_id) + " was cancelled while committing");
  }
  if (!c.ok) {
    m.FailTask(it, now_ns);
    return Status::Unavailable("commit to " + ToString(c.node) + " failed; retried later");
  }
  Impl::Object* o = m.FindObject(it->second.key);
  Impl::Replica& r = o->replicas[Impl::ReplicaWithTask(*o, plan.task_id)];
  r.state = ReplicaState::kComplete;
  r.task_id = 0;
  m.EraseTask(it);
  if (o->extra) {
    o->extra->failed_dests.clear();
    o->TrimExtra();
  }
  if (m.NeedsRepair(*o)) m.MarkRepair(o, now_ns);
  return Status::OK();
}

}  // namespace kvbridge::store
