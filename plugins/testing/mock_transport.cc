// libkvb_transport_mock.so — transport "mock" (and libkvb_transport_mock_b.so, "mock_b", the same
// source built again; see KVB_MOCK_NAME below): an in-process loopback transport for the
// conformance suite and engine tests, with fault injection.
//
// Every live instance is entered in a process-global table under its node id; a peer's endpoint
// is "mock:<node_id>". post() queues the request on the instance's worker thread, which later
// copies between the local buffer and the peer instance's registered regions, so poll() sees
// IN_PROGRESS first, exactly like a network transport. The peer's identity is checked at
// delivery: no live instance with that node id -> PEER_UNREACHABLE; a live one with another
// incarnation -> STALE_PEER, and not one byte is copied.
//
// "mock.instance_caps" (a number) at create is what instance_caps (ABI 1.3) returns; unset, it
// returns every bit (the descriptor's caps stand).
// "mock.local_only=1" at create registers every region KVB_REG_LOCAL_ONLY (ABI 1.5; refused
// UNSUPPORTED on a host that takes no reg_flags), as the verbs transport does with CUDA memory
// it stages: the instance's own ops use such a region, a peer's delivery into it is refused
// NOT_REGISTERED.
//
// Faults (per initiating instance): config keys "mock.fail_code" (a number or a name such as
// PEER_UNREACHABLE), "mock.fail_count" (default -1 = forever) and "mock.delay_ms" at create, and
// at run time the exported kvb_mock_set_fault() / kvb_mock_post_count() below, which a test
// reaches with dlopen(path, RTLD_NOLOAD) + dlsym. BACKPRESSURE and INVALID_ARGUMENT faults fail
// post() itself (nothing queued); every other code fails the request at delivery time.
//
// Locks: Request::mu is taken first (then g_mu or a Node::mu, never both at once);
// kvb_transport::mu and q_mu are leaves. The host's on_complete runs under the request's own
// lock only, so a poll racing with completion waits for on_complete to return and never sees
// a half-finished request.
#include <time.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <queue>
#include <set>
#include <shared_mutex>
#include <string>
#include <thread>
#include <vector>

#include "kvbridge/plugin/transport.h"

// The transport's name, endpoint prefix ("<name>:<node_id>") and config-key prefix. Built a
// second time as "mock_b" (plugins/testing/CMakeLists.txt): another .so, so another process-global
// instance table and fault registry, and a second transport an engine can load next to "mock".
#ifndef KVB_MOCK_NAME
#define KVB_MOCK_NAME "mock"
#endif

namespace {

constexpr const char* kEndpointPrefix = KVB_MOCK_NAME ":";

// What other instances see of one instance: its identity and its registered memory.
struct Node {
  std::string node_id;
  uint64_t incarnation = 0;
  std::shared_mutex mu;  // guards alive and regions; deliveries hold it shared while copying
  bool alive = true;
  std::map<uint64_t, kvb_region_t> regions;
  std::set<uint64_t> local_only;  // segments peers may not reach (mock.local_only)
  std::atomic<uint64_t> frames_rejected{0};
};

struct Request {
  std::mutex mu;
  std::vector<kvb_xfer_op_t> ops;
  std::vector<kvb_status_t> op_status;  // IN_PROGRESS until final
  kvb_status_t status = KVB_IN_PROGRESS;
  std::string error;
  bool final = false;
  uint64_t queued_bytes = 0;
  uint64_t deadline_ns = 0;
  void (*on_complete)(void*) = nullptr;
  void* user = nullptr;
  uint64_t peer_serial = 0;
  kvb_status_t partial_code = KVB_OK;  // a partial fault: ops from first_failing_op fail with it
  uint32_t first_failing_op = 0;
  std::string peer_node;
  uint64_t peer_incarnation = 0;
};

// What the worker does when an event fires.
enum class Outcome { kDeliver, kFail, kProgressTimeout, kDeadline };

struct Event {
  uint64_t fire_ns;
  uint64_t seq;
  Outcome outcome;
  kvb_status_t fail_code;
  std::shared_ptr<Request> req;
  bool operator>(const Event& o) const {
    return fire_ns != o.fire_ns ? fire_ns > o.fire_ns : seq > o.seq;
  }
};

struct Fault {
  kvb_status_t code = KVB_OK;
  int32_t count = 0;  // -1 = forever
  uint32_t delay_ms = 0;
  // > 0: a partial fault (kvb_mock_set_partial_fault): ops before this index are delivered,
  // the rest of the request fails with `code`.
  uint32_t first_failing_op = 0;
};

uint64_t MonoNs() {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
}

const char* const kCodeNames[KVB_STATUS_CODE_COUNT] = {
    "OK",
    "IN_PROGRESS",
    "INVALID_ARGUMENT",
    "NOT_FOUND",
    "ALREADY_EXISTS",
    "NOT_REGISTERED",
    "OUT_OF_BOUNDS",
    "STALE_PEER",
    "PEER_UNREACHABLE",
    "DEADLINE_EXCEEDED",
    "PROGRESS_TIMEOUT",
    "BACKPRESSURE",
    "CANCELLED",
    "PROTOCOL",
    "UNAUTHENTICATED",
    "UNSUPPORTED",
    "UNAVAILABLE",
    "NO_SPACE",
    "IO_ERROR",
    "INTERNAL",
    "PERMISSION_DENIED",
    "UNKNOWN_MEMORY",
};

const char* CodeName(kvb_status_t code) {
  return code >= 0 && code < KVB_STATUS_CODE_COUNT ? kCodeNames[code] : "UNKNOWN";
}

// "9" or "DEADLINE_EXCEEDED" (kvbridge::StatusCodeName spelling, KVB_ERR_ prefix allowed);
// -1 when unparseable.
kvb_status_t ParseCode(const std::string& text) {
  char* end = nullptr;
  long n = std::strtol(text.c_str(), &end, 10);
  if (!text.empty() && *end == '\0') return n >= 0 && n < KVB_STATUS_CODE_COUNT ? n : -1;
  std::string name = text.rfind("KVB_ERR_", 0) == 0 ? text.substr(8) : text;
  for (int i = 0; i < KVB_STATUS_CODE_COUNT; ++i) {
    if (name == kCodeNames[i]) return i;
  }
  return -1;
}

}  // namespace

struct kvb_tpeer {
  uint64_t serial = 0;
  std::string target;  // node id of the instance the endpoint names
  uint64_t incarnation = 0;
};

struct kvb_treq {
  std::shared_ptr<Request> req;
};

struct kvb_transport {
  const kvb_host_services_t* host = nullptr;
  std::shared_ptr<Node> self;
  uint64_t instance_caps = ~uint64_t{0};
  bool local_only = false;  // mock.local_only

  std::mutex mu;  // guards everything below up to the worker section
  Fault fault;
  uint64_t posts = 0;
  uint64_t next_peer_serial = 1;
  std::set<kvb_tpeer*> peers;
  std::map<kvb_treq*, std::shared_ptr<Request>> live;  // handed out, not yet released

  std::atomic<uint64_t> bytes_written{0};
  std::atomic<uint64_t> bytes_read{0};
  std::atomic<uint64_t> queued_bytes{0};

  std::mutex q_mu;
  std::condition_variable q_cv;
  std::priority_queue<Event, std::vector<Event>, std::greater<Event>> queue;
  uint64_t next_seq = 0;
  bool stopping = false;
  std::thread worker;

  uint64_t Now() const {
    return host != nullptr && host->now_ns != nullptr ? host->now_ns(host->host_ctx) : MonoNs();
  }
};

namespace {

std::mutex g_mu;
std::map<std::string, kvb_transport*> g_instances;  // live instances by node id

std::shared_ptr<Node> FindNode(const std::string& node_id) {
  std::lock_guard<std::mutex> lk(g_mu);
  auto it = g_instances.find(node_id);
  return it == g_instances.end() ? nullptr : it->second->self;
}

// Makes `r` final. REQUIRES: r->mu held and !r->final. Codes for unfinished ops come from
// `code` unless `per_op` is given.
void Finish(kvb_transport* t, Request* r, kvb_status_t code, const std::string& error,
            const std::vector<kvb_status_t>* per_op = nullptr) {
  r->op_status = per_op ? *per_op : std::vector<kvb_status_t>(r->ops.size(), code);
  r->status = KVB_OK;
  for (kvb_status_t s : r->op_status) {
    if (s != KVB_OK) {
      r->status = s;
      break;
    }
  }
  r->error = r->status == KVB_OK ? "" : error;
  r->final = true;
  t->queued_bytes.fetch_sub(r->queued_bytes);
  if (r->on_complete != nullptr) r->on_complete(r->user);
}

// Copies every op of `r` to/from the peer node. REQUIRES: r->mu held.
void Deliver(kvb_transport* t, Request* r) {
  std::shared_ptr<Node> peer = FindNode(r->peer_node);
  std::vector<kvb_status_t> codes(r->ops.size(), KVB_OK);
  std::string error;
  uint64_t written = 0, read = 0;
  if (peer == nullptr) {
    codes.assign(codes.size(), KVB_ERR_PEER_UNREACHABLE);
    error = KVB_MOCK_NAME ": no live instance with node id '" + r->peer_node + "'";
  } else {
    std::shared_lock<std::shared_mutex> lk(peer->mu);
    if (!peer->alive) {
      codes.assign(codes.size(), KVB_ERR_PEER_UNREACHABLE);
      error = KVB_MOCK_NAME ": peer '" + r->peer_node + "' is shutting down";
    } else if (peer->incarnation != r->peer_incarnation) {
      codes.assign(codes.size(), KVB_ERR_STALE_PEER);
      error = KVB_MOCK_NAME ": peer '" + r->peer_node + "' is incarnation " +
              std::to_string(peer->incarnation) + ", request was for " +
              std::to_string(r->peer_incarnation);
    } else {
      for (size_t i = 0; i < r->ops.size(); ++i) {
        const kvb_xfer_op_t& op = r->ops[i];
        if (r->partial_code != KVB_OK && i >= r->first_failing_op) {
          codes[i] = r->partial_code;
          if (error.empty()) {
            error = std::string(KVB_MOCK_NAME ": injected fault ") + CodeName(r->partial_code) +
                    " from op " + std::to_string(r->first_failing_op);
          }
          continue;
        }
        auto it = peer->regions.find(op.remote_segment);
        if (it == peer->regions.end() || peer->local_only.count(op.remote_segment) != 0) {
          codes[i] = KVB_ERR_NOT_REGISTERED;
        } else if (op.remote_offset > it->second.length ||
                   op.length > it->second.length - op.remote_offset) {
          codes[i] = KVB_ERR_OUT_OF_BOUNDS;
        }
        if (codes[i] != KVB_OK) {
          peer->frames_rejected.fetch_add(1);
          if (error.empty()) {
            error = KVB_MOCK_NAME ": op " + std::to_string(i) + ": remote segment " +
                    std::to_string(op.remote_segment) + " [" + std::to_string(op.remote_offset) +
                    ", +" + std::to_string(op.length) + ") " +
                    (codes[i] == KVB_ERR_NOT_REGISTERED ? "is not registered" : "is out of bounds");
          }
          continue;
        }
        auto* remote = static_cast<uint8_t*>(it->second.addr) + op.remote_offset;
        if (op.opcode == KVB_OP_WRITE) {
          std::memmove(remote, op.local_addr, op.length);
          written += op.length;
        } else {
          std::memmove(op.local_addr, remote, op.length);
          read += op.length;
        }
      }
    }
  }
  t->bytes_written.fetch_add(written);
  t->bytes_read.fetch_add(read);
  Finish(t, r, KVB_OK, error, &codes);
}

void Execute(kvb_transport* t, const Event& ev) {
  Request* r = ev.req.get();
  std::lock_guard<std::mutex> lk(r->mu);
  if (r->final) return;  // cancelled meanwhile
  if (ev.outcome == Outcome::kDeadline || (r->deadline_ns != 0 && t->Now() >= r->deadline_ns)) {
    Finish(t, r, KVB_ERR_DEADLINE_EXCEEDED, KVB_MOCK_NAME ": deadline passed before delivery");
  } else if (ev.outcome == Outcome::kProgressTimeout) {
    Finish(t, r, KVB_ERR_PROGRESS_TIMEOUT,
           KVB_MOCK_NAME ": no progress within the progress timeout");
  } else if (ev.outcome == Outcome::kFail) {
    Finish(t, r, ev.fail_code,
           std::string(KVB_MOCK_NAME ": injected fault ") + CodeName(ev.fail_code));
  } else {
    Deliver(t, r);
  }
}

void WorkerLoop(kvb_transport* t) {
  std::unique_lock<std::mutex> lk(t->q_mu);
  while (!t->stopping) {
    if (t->queue.empty()) {
      t->q_cv.wait(lk);
      continue;
    }
    uint64_t now = t->Now();
    if (t->queue.top().fire_ns > now) {
      t->q_cv.wait_for(lk, std::chrono::nanoseconds(t->queue.top().fire_ns - now));
      continue;
    }
    Event ev = t->queue.top();
    t->queue.pop();
    lk.unlock();
    Execute(t, ev);
    ev.req.reset();
    lk.lock();
  }
}

void CancelRequest(kvb_transport* t, Request* r) {
  std::lock_guard<std::mutex> lk(r->mu);
  if (r->final) return;
  Finish(t, r, KVB_ERR_CANCELLED, KVB_MOCK_NAME ": cancelled");
}

// Cancels every live request (of one peer, or all when peer_serial is 0).
void CancelLive(kvb_transport* t, uint64_t peer_serial) {
  std::vector<std::shared_ptr<Request>> victims;
  {
    std::lock_guard<std::mutex> lk(t->mu);
    for (auto& [handle, req] : t->live) {
      if (peer_serial == 0 || req->peer_serial == peer_serial) victims.push_back(req);
    }
  }
  for (auto& r : victims) CancelRequest(t, r.get());
}

std::string ConfigString(const kvb_host_services_t* host, const char* key) {
  if (host == nullptr || host->config_get == nullptr) return "";
  char buf[128];
  int32_t n = host->config_get(host->host_ctx, key, buf, sizeof(buf));
  return n >= 0 ? std::string(buf, static_cast<size_t>(n)) : "";
}

kvb_status_t MockCreate(const kvb_host_services_t* host, const kvb_transport_params_t* params,
                        kvb_transport_t** out, char* err, uint32_t err_len) {
  if (params == nullptr || out == nullptr || params->node_id == nullptr ||
      params->node_id[0] == '\0') {
    kvb_copy_message(err, err_len, KVB_MOCK_NAME ": params with a non-empty node_id are required");
    return KVB_ERR_INVALID_ARGUMENT;
  }
  try {
    Fault fault;
    std::string code = ConfigString(host, KVB_MOCK_NAME ".fail_code");
    if (!code.empty()) {
      fault.code = ParseCode(code);
      if (fault.code < 0) {
        kvb_copy_message(err, err_len,
                         (KVB_MOCK_NAME ": bad mock.fail_code '" + code + "'").c_str());
        return KVB_ERR_INVALID_ARGUMENT;
      }
      std::string count = ConfigString(host, KVB_MOCK_NAME ".fail_count");
      fault.count = count.empty() ? -1 : std::atoi(count.c_str());
    }
    std::string delay = ConfigString(host, KVB_MOCK_NAME ".delay_ms");
    if (!delay.empty())
      fault.delay_ms = static_cast<uint32_t>(std::strtoul(delay.c_str(), nullptr, 10));

    auto t = std::make_unique<kvb_transport>();
    t->host = host;
    t->fault = fault;
    std::string caps = ConfigString(host, KVB_MOCK_NAME ".instance_caps");
    if (!caps.empty()) t->instance_caps = std::strtoull(caps.c_str(), nullptr, 0);
    t->local_only = ConfigString(host, KVB_MOCK_NAME ".local_only") == "1";
    t->self = std::make_shared<Node>();
    t->self->node_id = params->node_id;
    t->self->incarnation = params->incarnation;
    {
      std::lock_guard<std::mutex> lk(g_mu);
      if (g_instances.count(params->node_id) != 0) {
        kvb_copy_message(err, err_len,
                         (KVB_MOCK_NAME ": node id '" + std::string(params->node_id) +
                          "' already has a live mock instance in this process")
                             .c_str());
        return KVB_ERR_ALREADY_EXISTS;
      }
      g_instances[params->node_id] = t.get();
    }
    kvb_transport* raw = t.get();
    raw->worker = std::thread(WorkerLoop, raw);
    *out = t.release();
    return KVB_OK;
  } catch (...) {
    kvb_copy_message(err, err_len, KVB_MOCK_NAME ": out of memory");
    return KVB_ERR_INTERNAL;
  }
}

void MockDestroy(kvb_transport_t* t) {
  if (t == nullptr) return;
  {
    std::lock_guard<std::mutex> lk(g_mu);
    auto it = g_instances.find(t->self->node_id);
    if (it != g_instances.end() && it->second == t) g_instances.erase(it);
  }
  {
    // Waits for deliveries from other instances into our memory to finish.
    std::unique_lock<std::shared_mutex> lk(t->self->mu);
    t->self->alive = false;
    t->self->regions.clear();
    t->self->local_only.clear();
  }
  CancelLive(t, 0);
  {
    std::lock_guard<std::mutex> lk(t->q_mu);
    t->stopping = true;
  }
  t->q_cv.notify_all();
  t->worker.join();
  for (kvb_tpeer* p : t->peers) delete p;
  for (auto& [handle, req] : t->live) delete handle;
  delete t;
}

int32_t MockGetEndpoints(kvb_transport_t* t, char* buf, uint32_t buf_len) {
  std::string ep = kEndpointPrefix + t->self->node_id;
  if (buf == nullptr || ep.size() + 1 > buf_len) return -2;
  std::memcpy(buf, ep.c_str(), ep.size() + 1);
  return static_cast<int32_t>(ep.size());
}

kvb_status_t MockRegisterMemory(kvb_transport_t* t, const kvb_region_t* region, uint8_t* rkey,
                                uint32_t rkey_cap, uint32_t* rkey_len) {
  if (region == nullptr || region->addr == nullptr || region->length == 0) {
    return KVB_ERR_INVALID_ARGUMENT;
  }
  if (region->mem_kind != KVB_MEM_HOST) return KVB_ERR_UNSUPPORTED;
  const bool has_flags =
      region->struct_size >= offsetof(kvb_region_t, reg_flags) + sizeof(region->reg_flags) &&
      region->reg_flags != nullptr;
  if (t->local_only && !has_flags) return KVB_ERR_UNSUPPORTED;
  try {
    std::unique_lock<std::shared_mutex> lk(t->self->mu);
    if (!t->self->regions.emplace(region->segment_id, *region).second) {
      return KVB_ERR_ALREADY_EXISTS;
    }
    if (t->local_only) {
      t->self->local_only.insert(region->segment_id);
      *region->reg_flags |= KVB_REG_LOCAL_ONLY;
    }
  } catch (...) {
    return KVB_ERR_INTERNAL;
  }
  if (rkey_len != nullptr) *rkey_len = 0;
  return KVB_OK;
}

kvb_status_t MockDeregisterMemory(kvb_transport_t* t, uint64_t segment_id) {
  std::unique_lock<std::shared_mutex> lk(t->self->mu);
  t->self->local_only.erase(segment_id);
  return t->self->regions.erase(segment_id) != 0 ? KVB_OK : KVB_ERR_NOT_FOUND;
}

// The node id an endpoint list names: the first "mock:<id>" entry, or the peer's node id when
// the list is empty. Empty string when malformed.
std::string TargetOf(const kvb_peer_info_t* info) {
  std::string eps = info->endpoints ? info->endpoints : "";
  if (eps.empty()) return info->node_id;
  std::string first = eps.substr(0, eps.find(','));
  if (first.rfind(kEndpointPrefix, 0) != 0) return "";
  return first.substr(std::strlen(kEndpointPrefix));
}

kvb_status_t MockAddPeer(kvb_transport_t* t, const kvb_peer_info_t* info, kvb_tpeer_t** out,
                         char* err, uint32_t err_len) {
  if (info == nullptr || out == nullptr || info->node_id == nullptr || info->node_id[0] == '\0') {
    kvb_copy_message(err, err_len, KVB_MOCK_NAME ": peer info with a node id is required");
    return KVB_ERR_INVALID_ARGUMENT;
  }
  try {
    std::string target = TargetOf(info);
    if (target.empty()) {
      kvb_copy_message(err, err_len,
                       (KVB_MOCK_NAME ": endpoint '" + std::string(info->endpoints) +
                        "' is not of the form mock:<node_id>")
                           .c_str());
      return KVB_ERR_INVALID_ARGUMENT;
    }
    std::lock_guard<std::mutex> lk(t->mu);
    auto* peer = new kvb_tpeer{t->next_peer_serial++, target, info->incarnation};
    t->peers.insert(peer);
    *out = peer;
    return KVB_OK;
  } catch (...) {
    kvb_copy_message(err, err_len, KVB_MOCK_NAME ": out of memory");
    return KVB_ERR_INTERNAL;
  }
}

kvb_status_t MockUpdatePeer(kvb_transport_t* t, kvb_tpeer_t* peer, const kvb_peer_info_t* info,
                            char* err, uint32_t err_len) {
  if (peer == nullptr || info == nullptr || info->node_id == nullptr) {
    kvb_copy_message(err, err_len, KVB_MOCK_NAME ": update_peer: null peer or info");
    return KVB_ERR_INVALID_ARGUMENT;
  }
  if (info->incarnation != peer->incarnation) {
    kvb_copy_message(err, err_len,
                     KVB_MOCK_NAME ": update_peer: another incarnation (use add_peer)");
    return KVB_ERR_INVALID_ARGUMENT;
  }
  try {
    std::string target = TargetOf(info);
    if (target.empty()) return KVB_ERR_INVALID_ARGUMENT;
    std::lock_guard<std::mutex> lk(t->mu);
    peer->target = target;
    return KVB_OK;
  } catch (...) {
    return KVB_ERR_INTERNAL;
  }
}

void MockRemovePeer(kvb_transport_t* t, kvb_tpeer_t* peer) {
  if (peer == nullptr) return;
  CancelLive(t, peer->serial);
  {
    std::lock_guard<std::mutex> lk(t->mu);
    t->peers.erase(peer);
  }
  delete peer;
}

kvb_status_t MockPost(kvb_transport_t* t, kvb_tpeer_t* peer, const kvb_xfer_op_t* ops,
                      uint32_t op_size, uint32_t count, const kvb_post_opts_t* opts,
                      kvb_treq_t** out, char* err, uint32_t err_len) {
  Fault fault;
  kvb_tpeer peer_copy;
  {
    std::lock_guard<std::mutex> lk(t->mu);
    ++t->posts;
    if (peer == nullptr || t->peers.count(peer) == 0) {
      kvb_copy_message(err, err_len, KVB_MOCK_NAME ": unknown peer handle");
      return KVB_ERR_INVALID_ARGUMENT;
    }
    peer_copy = *peer;
    fault = t->fault;
  }
  if (ops == nullptr || count == 0 || op_size < KVB_XFER_OP_SIZE_1_0 || out == nullptr) {
    kvb_copy_message(err, err_len, KVB_MOCK_NAME ": post needs at least one op and an out pointer");
    return KVB_ERR_INVALID_ARGUMENT;
  }
  try {
    auto req = std::make_shared<Request>();
    req->ops.resize(count);
    const auto* bytes = reinterpret_cast<const uint8_t*>(ops);
    {
      std::shared_lock<std::shared_mutex> lk(t->self->mu);
      for (uint32_t i = 0; i < count; ++i) {
        kvb_xfer_op_t& op = req->ops[i];  // fields past op_size (an older host) stay 0
        std::memcpy(&op, bytes + static_cast<size_t>(i) * op_size,
                    std::min<size_t>(op_size, sizeof(op)));
        if ((op.opcode != KVB_OP_READ && op.opcode != KVB_OP_WRITE) || op.length == 0 ||
            op.local_addr == nullptr) {
          kvb_copy_message(err, err_len,
                           (KVB_MOCK_NAME ": op " + std::to_string(i) +
                            " needs a READ/WRITE opcode, a local address and a length")
                               .c_str());
          return KVB_ERR_INVALID_ARGUMENT;
        }
        auto it = t->self->regions.find(op.local_segment);
        bool inside = it != t->self->regions.end();
        if (inside) {
          auto base = reinterpret_cast<uintptr_t>(it->second.addr);
          auto local = reinterpret_cast<uintptr_t>(op.local_addr);
          inside = local >= base && local - base <= it->second.length &&
                   op.length <= it->second.length - (local - base);
        }
        if (!inside) {
          kvb_copy_message(err, err_len,
                           (KVB_MOCK_NAME ": op " + std::to_string(i) +
                            ": local memory is not inside registered segment " +
                            std::to_string(op.local_segment))
                               .c_str());
          return KVB_ERR_NOT_REGISTERED;
        }
        req->queued_bytes += op.length;
      }
    }

    kvb_status_t injected = KVB_OK;
    if (fault.code != KVB_OK && fault.count != 0) {
      injected = fault.code;
      std::lock_guard<std::mutex> lk(t->mu);
      if (t->fault.count > 0) --t->fault.count;
    }
    if ((injected == KVB_ERR_BACKPRESSURE || injected == KVB_ERR_INVALID_ARGUMENT) &&
        fault.first_failing_op == 0) {
      kvb_copy_message(
          err, err_len,
          (std::string(KVB_MOCK_NAME ": injected fault ") + CodeName(injected)).c_str());
      return injected;
    }

    if (injected != KVB_OK && fault.first_failing_op > 0) {
      req->partial_code = injected;
      req->first_failing_op = fault.first_failing_op;
      injected = KVB_OK;  // delivered, with the ops from first_failing_op failed
    }
    const uint64_t now = t->Now();
    req->op_status.assign(count, KVB_IN_PROGRESS);
    req->peer_serial = peer_copy.serial;
    req->peer_node = peer_copy.target;
    req->peer_incarnation = peer_copy.incarnation;
    uint64_t progress_ns = 0;
    if (opts != nullptr) {
      req->deadline_ns = opts->deadline_ns;
      req->on_complete = opts->on_complete;
      req->user = opts->user;
      progress_ns = opts->progress_timeout_ns;
    }
    // The mock moves no bytes while it delays a request, so a delay longer than the progress
    // timeout reads as a frozen peer; a deadline that comes first wins.
    Event ev{now + static_cast<uint64_t>(fault.delay_ms) * 1000000ull, 0,
             injected == KVB_OK ? Outcome::kDeliver : Outcome::kFail, injected, req};
    if (progress_ns != 0 && now + progress_ns < ev.fire_ns) {
      ev.fire_ns = now + progress_ns;
      ev.outcome = Outcome::kProgressTimeout;
    }
    if (req->deadline_ns != 0 && req->deadline_ns < ev.fire_ns) {
      ev.fire_ns = req->deadline_ns;
      ev.outcome = Outcome::kDeadline;
    }

    auto handle = std::make_unique<kvb_treq>(kvb_treq{req});
    {
      std::lock_guard<std::mutex> lk(t->mu);
      t->live.emplace(handle.get(), req);
    }
    t->queued_bytes.fetch_add(req->queued_bytes);
    {
      std::lock_guard<std::mutex> lk(t->q_mu);
      ev.seq = t->next_seq++;
      t->queue.push(std::move(ev));
    }
    t->q_cv.notify_one();
    *out = handle.release();
    return KVB_OK;
  } catch (...) {
    kvb_copy_message(err, err_len, KVB_MOCK_NAME ": out of memory");
    return KVB_ERR_INTERNAL;
  }
}

kvb_status_t MockPoll(kvb_transport_t* t, kvb_treq_t* handle, kvb_status_t* op_status,
                      uint32_t op_status_len, char* err, uint32_t err_len) {
  if (handle == nullptr) return KVB_ERR_INVALID_ARGUMENT;
  Request* r = handle->req.get();
  std::lock_guard<std::mutex> lk(r->mu);
  for (uint32_t i = 0; op_status != nullptr && i < op_status_len && i < r->op_status.size(); ++i) {
    op_status[i] = r->op_status[i];
  }
  if (!r->final) return KVB_IN_PROGRESS;
  if (r->status != KVB_OK) kvb_copy_message(err, err_len, r->error.c_str());
  return r->status;
}

void MockCancel(kvb_transport_t* t, kvb_treq_t* handle) {
  if (handle != nullptr) CancelRequest(t, handle->req.get());
}

void MockRelease(kvb_transport_t* t, kvb_treq_t* handle) {
  if (handle == nullptr) return;
  CancelRequest(t, handle->req.get());  // no-op when final, as REQUIRED; safe when not
  {
    std::lock_guard<std::mutex> lk(t->mu);
    t->live.erase(handle);
  }
  delete handle;
}

uint64_t MockInstanceCaps(kvb_transport_t* t) { return t->instance_caps; }

kvb_status_t MockGetStats(kvb_transport_t* t, kvb_transport_stats_t* stats) {
  if (stats == nullptr || stats->struct_size < sizeof(uint32_t)) return KVB_ERR_INVALID_ARGUMENT;
  kvb_transport_stats_t s{};
  s.struct_size = stats->struct_size;
  s.bytes_written = t->bytes_written.load();
  s.bytes_read = t->bytes_read.load();
  s.frames_rejected = t->self->frames_rejected.load();
  s.queued_bytes = t->queued_bytes.load();
  // Only the fields the caller's struct has room for.
  std::memcpy(stats, &s, stats->struct_size < sizeof(s) ? stats->struct_size : sizeof(s));
  return KVB_OK;
}

kvb_status_t MockProbe(char* reason, uint32_t reason_len) {
  kvb_copy_message(reason, reason_len, "");
  return KVB_OK;
}

const kvb_transport_ops_t kOps = {
    .struct_size = sizeof(kvb_transport_ops_t),
    .create = MockCreate,
    .destroy = MockDestroy,
    .get_endpoints = MockGetEndpoints,
    .register_memory = MockRegisterMemory,
    .deregister_memory = MockDeregisterMemory,
    .add_peer = MockAddPeer,
    .update_peer = MockUpdatePeer,
    .remove_peer = MockRemovePeer,
    .post = MockPost,
    .poll = MockPoll,
    .cancel = MockCancel,
    .release = MockRelease,
    .get_stats = MockGetStats,
    .instance_caps = MockInstanceCaps,
};

const kvb_plugin_descriptor_t kDescriptor = {
    .struct_size = sizeof(kvb_plugin_descriptor_t),
    .abi_major = KVB_ABI_MAJOR,
    .abi_minor = KVB_ABI_MINOR,
    .name = KVB_MOCK_NAME,
    .version = "0.1.0",
    .kind = KVB_PLUGIN_TRANSPORT,
    .reserved = 0,
    .caps = KVB_TCAP_READ | KVB_TCAP_WRITE | KVB_TCAP_HOST_MEM | KVB_TCAP_STATS,
    .probe = MockProbe,
    .ops = &kOps,
};

}  // namespace

extern "C" {

KVB_PLUGIN_EXPORT const kvb_plugin_descriptor_t* kvb_plugin_query(uint16_t host_abi_major,
                                                                  uint16_t host_abi_minor) {
  return host_abi_major == KVB_ABI_MAJOR ? &kDescriptor : nullptr;
}

// The next `count` posts from instance `node_id` fail with `code` (count -1 = forever; code 0
// clears), and every request it posts is delayed by `delay_ms`. KVB_OK, or KVB_ERR_NOT_FOUND
// when no live instance has that node id.
KVB_PLUGIN_EXPORT int32_t kvb_mock_set_fault(const char* node_id, int32_t code, int32_t count,
                                             uint32_t delay_ms) {
  if (node_id == nullptr) return KVB_ERR_INVALID_ARGUMENT;
  std::lock_guard<std::mutex> lk(g_mu);
  auto it = g_instances.find(node_id);
  if (it == g_instances.end()) return KVB_ERR_NOT_FOUND;
  std::lock_guard<std::mutex> lk2(it->second->mu);
  it->second->fault = Fault{code, code == KVB_OK ? 0 : count, delay_ms};
  return KVB_OK;
}

// Like kvb_mock_set_fault (no delay), but each faulted request delivers its ops before index
// `first_failing_op` and fails the rest with `code` (at delivery; BACKPRESSURE and
// INVALID_ARGUMENT included): a request that partly succeeded.
KVB_PLUGIN_EXPORT int32_t kvb_mock_set_partial_fault(const char* node_id, int32_t code,
                                                     int32_t count, uint32_t first_failing_op) {
  if (node_id == nullptr) return KVB_ERR_INVALID_ARGUMENT;
  std::lock_guard<std::mutex> lk(g_mu);
  auto it = g_instances.find(node_id);
  if (it == g_instances.end()) return KVB_ERR_NOT_FOUND;
  std::lock_guard<std::mutex> lk2(it->second->mu);
  it->second->fault = Fault{code, code == KVB_OK ? 0 : count, 0, first_failing_op};
  return KVB_OK;
}

// Calls of post() that reached instance `node_id` (including refused ones); UINT64_MAX when no
// live instance has that node id.
KVB_PLUGIN_EXPORT uint64_t kvb_mock_post_count(const char* node_id) {
  if (node_id == nullptr) return UINT64_MAX;
  std::lock_guard<std::mutex> lk(g_mu);
  auto it = g_instances.find(node_id);
  if (it == g_instances.end()) return UINT64_MAX;
  std::lock_guard<std::mutex> lk2(it->second->mu);
  return it->second->posts;
}

}  // extern "C"
