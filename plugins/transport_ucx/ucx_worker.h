// kvbridge::ucx::Worker: the ucp_context, the ucp_worker and the one thread that drives them.
//
// The thread loops: run queued commands, ucp_worker_progress, serve hellos, issue queued slices
// of every peer (endpoint creation, hello, rkey unpack, put/get, flush), check timers
// (deadlines, progress timeouts, hello timeouts), spin for ucx.spin_us while UCX work is in
// flight, then epoll on the command eventfd and the pidfds of same-host peers for at most
// ucx.idle_poll_ms (the context has no UCP_FEATURE_WAKEUP: in UCX 1.13 it would drop cma).
//
// Thread-safety: Run/RunSync may be called from any thread; everything else is called only on
// the progress thread (from commands), and the members it touches are that thread's alone.
#pragma once

#include <ucp/api/ucp.h>

#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <queue>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "ucx_transport.h"

namespace kvbridge::ucx {

struct Record;

// One endpoint to one peer incarnation. Progress-thread-only.
struct Endpoint {
  enum class State { kHello, kReady, kClosing };
  ucp_ep_h ep = nullptr;
  Peer* peer = nullptr;    // null once the endpoint is closing (the peer may be gone)
  bool peer_mode = false;  // UCP_ERR_HANDLING_MODE_PEER (else NONE)
  State state = State::kHello;
  kvb_auth_t* auth = nullptr;
  uint64_t session = 0;
  uint64_t hello_deadline_ns = 0;
  uint64_t segments_version = 0;
  struct Key {
    ucp_rkey_h rkey = nullptr;
    uint64_t base = 0;
  };
  std::unordered_map<uint64_t, Key> rkeys;
  // The target's answer per segment: it grants RMA while the segment is registered there, and
  // revokes the grant before its deregister_memory returns.
  enum class Grant { kAsked, kGranted, kRefused };
  std::unordered_map<uint64_t, Grant> grants;
  std::unordered_set<uint64_t> revoking;  // to acknowledge once no RMA on them is in flight
  std::unordered_set<Record*> records;    // UCX operations not yet completed
  std::vector<SlicePtr> unflushed;        // puts issued since the last flush
  uint64_t inflight_bytes = 0;
  uint64_t last_progress_ns = 0;
  uint64_t progress_timeout_ns = 0;  // smallest of the issued slices' requests
  ucs_status_t error = UCS_OK;       // set by the PEER-mode error handler
  int pidfd = -1;                    // NONE mode: the peer process (a dup of the peer's)
  void* close_req = nullptr;         // ucp_ep_close_nbx's request while closing
  bool close_started = false;
  // Closing in PEER mode: force-closed once its operations ended, or at this time (0: at once).
  uint64_t force_at_ns = 0;
  // PEER mode: requests cancelled (or past their deadline) whose RMA on this endpoint is left
  // to finish, until drain_until_ns; then the endpoint is force-closed (Worker::Abort).
  std::vector<std::shared_ptr<Request>> draining;
  uint64_t drain_until_ns = 0;
  // A target's own endpoint to a grant holder, made to send it revocations (not to a peer of
  // ours; no hello, no RMA): the revocations in progress that sent on it, and the holder's
  // process when it is on this host (0 otherwise).
  uint32_t back_users = 0;
  int back_pid = 0;
};

class Worker {
 public:
  static kvb_status_t Create(Transport* t, std::unique_ptr<Worker>* out, std::string* err);
  // Stops the thread, fails what is left CANCELLED, closes endpoints, frees UCX.
  ~Worker();

  const std::string& address() const { return address_; }
  // The context's memory types (ucp_context_query, read once in Init; immutable after).
  uint64_t memory_types() const { return memory_types_; }

  // Runs fn on the progress thread (Run: queued; RunSync: returns once it ran).
  void Run(std::function<void()> fn);
  void RunSync(std::function<void()> fn);

  // ---- Called on the progress thread only (from commands). ----
  // `cuda`: the memory is CUDA device memory (mapped with UCS_MEMORY_TYPE_CUDA).
  kvb_status_t MapMemory(void* addr, uint64_t length, bool cuda, ucp_mem_h* memh, std::string* rkey,
                         std::string* err);
  // Serves grants for the segment until Revoke.
  void Published(uint64_t segment_id);
  // Stops granting the segment, revokes the grants peers hold and waits for their
  // acknowledgements (at most the progress timeout), then unmaps once no outstanding UCX
  // operation uses local memory inside [base, base + length); `done` runs then.
  void Revoke(uint64_t segment_id, ucp_mem_h memh, uint8_t* base, uint64_t length,
              std::function<void()> done);
  void UnmapWhenIdle(ucp_mem_h memh, uint8_t* base, uint64_t length, std::function<void()> done);
  void AddPeer(Peer* peer);
  // Fails the peer's requests CANCELLED, closes its endpoint and stops watching it. Returns
  // those requests: the caller waits until UCX holds none of their memory (in_ucx == 0).
  std::vector<std::shared_ptr<Request>> RemovePeer(Peer* peer);
  // The same incarnation published another worker address (update_peer): the endpoint is
  // closed (its slices go back to the queue) and the next post connects to the new address.
  // Returns the pidfd that was replaced (the caller closes it).
  int Readdress(Peer* peer, PeerAddress address, bool same_host, int pidfd, bool exited);
  struct Prefailed {
    SlicePtr slice;
    kvb_status_t code;
    std::string msg;
  };
  // Queues a request's slices; the prefailed ones (refused before any I/O) end here.
  void Enqueue(Peer* peer, std::vector<SlicePtr> slices, std::vector<Prefailed> prefailed);
  // The request became final (cancel, deadline): drop its queued slices and, when UCX still
  // holds its memory on a PEER-mode endpoint, force-close that endpoint: at once, or, for a
  // peer that is moving bytes, unless its operations finish within ucx.cancel_drain_ms.
  void Abort(const std::shared_ptr<Request>& req);
  // True once no closing endpoint has an operation in flight (the transport's destructor waits
  // for it, bounded, before the worker goes). Progress thread only: call through RunSync.
  bool ClosingIdle() const;

 private:
  explicit Worker(Transport* t) : t_(t) {}
  kvb_status_t Init(std::string* err);
  void Loop();
  bool DrainCommands();
  void Pump(Peer& peer);
  bool StartEndpoint(Peer& peer);
  void HelloStep(Endpoint& ep, const uint8_t* in, uint32_t in_len, kvb_status_t remote_status);
  bool SendAm(ucp_ep_h ep, Endpoint* owner, uint32_t kind, uint64_t session, kvb_status_t status,
              const uint8_t* data, uint32_t len, bool reply_flag);
  bool Issue(Endpoint& ep, const SlicePtr& s);
  void Flush(Endpoint& ep);
  void OnDone(Record* rec, ucs_status_t status);
  void Timers(uint64_t now);
  // Force-closes the endpoints whose cancelled RMA did not drain in time (see Abort).
  void DrainTimers(uint64_t now);
  // Fails every slice queued for the peer with code.
  void FailQueue(Peer& peer, kvb_status_t code, const std::string& msg);
  // Takes the endpoint away from its peer. Slices it still holds fail with `code` (or, when
  // requeue is true, go back to the front of the peer's queue for a fresh endpoint). `gentle`
  // (remove_peer, destroy: nothing is wrong with the peer): a PEER-mode endpoint that is up
  // flushes its puts and is force-closed only once its operations ended, or after
  // ucx.cancel_drain_ms, so that the peer's UCX is not cut off in mid-reply (see Abort).
  void CloseEndpoint(Peer& peer, kvb_status_t code, const std::string& msg, bool requeue,
                     bool gentle = false);
  void ReapClosing();
  void ServeHello(ucp_ep_h reply_ep, uint64_t session, const std::string& msg);
  struct AmMessage;
  void HandleAm(const AmMessage& m);
  void AckRevokes(Endpoint& ep);
  struct Grantee;
  // The endpoint revocations to `g` go over: this worker's own, to the address its grant request
  // carried, kept in back_eps_ for later ones. Null, with *gone set, when `g` is a process of
  // this host that has exited (it can touch nothing any more); null without when its address
  // is unknown or unusable (it is left to the progress timeout).
  Endpoint* BackEndpoint(const Grantee& g, bool* gone);
  // Closes the back endpoints no revocation uses whose holder is gone: UCX's error handler
  // fired (PEER mode), or its process on this host exited. A live holder's is kept: UCX may
  // have matched it with the endpoint UCX made for the holder's own connection to us, and
  // closing it would close that connection under the holder's RMA.
  void SweepBackEndpoints();
  // Into closing_. PEER mode: force-closed now, or by ReapClosing once idle or at
  // ep->force_at_ns when that is set. NONE mode: closed by ReapClosing once idle.
  void Retire(std::unique_ptr<Endpoint> ep);
  void CheckPeerExited(Peer& peer);
  // The endpoint's peer process is gone: its RMA stops counting as touching request memory.
  void DetachRecords(Endpoint& ep);
  void DestroyEndpoint(std::unique_ptr<Endpoint>& ep);
  bool Busy() const;

  static ucs_status_t OnAm(void* arg, const void* header, size_t header_length, void* data,
                           size_t length, const ucp_am_recv_param_t* param);
  static void OnSend(void* request, ucs_status_t status, void* user);
  static void OnEpError(void* arg, ucp_ep_h ep, ucs_status_t status);

  Transport* t_;
  const Config* cfg_ = nullptr;
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  std::string address_;
  uint64_t memory_types_ = 0;  // UCS_BIT(ucs_memory_type_t) of what the context supports
  int cmdfd_ = -1;             // eventfd: commands queued
  int epfd_ = -1;
  std::thread thread_;

  std::mutex cmd_mu_;
  std::vector<std::function<void()>> cmds_;
  bool stopping_ = false;

  // Progress-thread-only.
  bool stop_ = false;
  Completions done_;
  std::unordered_set<Peer*> peers_;
  std::vector<std::unique_ptr<Endpoint>> closing_;
  std::unordered_map<uint64_t, Endpoint*> sessions_;  // our endpoints by session id
  struct InboundHello {
    kvb_auth_t* auth = nullptr;
    uint64_t expires_ns = 0;
  };
  std::map<std::pair<uintptr_t, uint64_t>, InboundHello> inbound_;  // by (reply ep, session)
  // Who holds a grant: the session of its endpoint (unique across initiators: each worker
  // starts its counter at a random 64-bit value), and where to reach it later, as its grant
  // request said (its endpoints text and error mode; empty from a peer that did not say). A
  // reply endpoint is never kept: UCX frees the endpoints it made for a peer's connection when
  // that connection fails, with no callback to say so.
  struct Grantee {
    uint64_t session;
    bool peer_mode;
    std::string endpoints;
    bool operator<(const Grantee& o) const { return session < o.session; }
  };
  std::map<uint64_t, std::set<Grantee>> published_;  // registered segments and who holds grants
  // This worker's own endpoints to grant holders, by (endpoints text, PEER mode).
  std::map<std::pair<std::string, bool>, std::unique_ptr<Endpoint>> back_eps_;
  struct Revocation {
    uint64_t segment;
    ucp_mem_h memh;
    uint8_t* base;
    uint64_t length;
    std::set<uint64_t> waiting;  // sessions not yet acknowledged
    uint64_t deadline_ns;
    std::function<void()> done;
    std::vector<Endpoint*> back;  // the back endpoints it sent on (released when it ends)
  };
  std::vector<Revocation> revocations_;
  struct AmMessage {
    uint32_t kind;
    ucp_ep_h reply_ep;
    uint64_t session;
    kvb_status_t status;
    std::string data;
  };
  std::vector<AmMessage> am_in_;
  struct Unmap {
    ucp_mem_h memh;
    uint8_t* base;
    uint64_t length;
    std::function<void()> done;
  };
  std::vector<Unmap> unmaps_;
  struct DeadlineEntry {
    uint64_t at;
    std::weak_ptr<Request> req;
    Peer* peer;
    bool operator>(const DeadlineEntry& o) const { return at > o.at; }
  };
  std::priority_queue<DeadlineEntry, std::vector<DeadlineEntry>, std::greater<>> deadlines_;
  uint64_t next_session_ = 0;
  uint32_t hellos_ = 0;  // endpoints in the hello state
  uint64_t next_liveness_ns_ = 0;
  uint64_t next_back_sweep_ns_ = 0;
  uint64_t last_activity_ns_ = 0;  // when progress, a command or a completion last did something
  uint32_t records_ = 0;           // all outstanding UCX operations
};

}  // namespace kvbridge::ucx
