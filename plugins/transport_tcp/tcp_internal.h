// Internals of the tcp transport shared by its source files (not installed, not part of any
// API): the request/slice/peer state, the Lane class, and the socket helpers every role uses.
//   tcp_io.cc        socket helpers, the host handshake loop, config, log limiter, token bucket
//   tcp_lane.cc      Lane: one outbound connection to one peer incarnation
//   tcp_server.cc    accept loop, inbound handshake, serving requests
//   tcp_requests.cc  post/poll/cancel, slices, lanes per peer, the housekeeper
//   tcp_transport.cc lifecycle, memory registration, peers
//   tcp_staging.cc   pinned bounce buffers and copy queues for CUDA regions (tcp_staging.h)
// Thread-safety: as stated on each type; the helpers are reentrant.
#pragma once

#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "tcp_staging.h"
#include "tcp_transport.h"
#include "tcp_wire.h"
#include "util/host_port.h"

namespace kvbridge::tcp {

constexpr uint64_t kMsNs = 1000000;
constexpr size_t kScratchBytes = 64 * 1024;
constexpr int kMaxIov = 64;

// ---------------------------------------------------------------------------------------------
// Internal types.

struct OpState {
  uint16_t opcode = 0;
  uint64_t length = 0;
  uint32_t total_slices = 0;
  uint32_t ended_slices = 0;
  kvb_status_t error = KVB_OK;            // the first slice error, kept as the op's result
  kvb_status_t status = KVB_IN_PROGRESS;  // what poll reports: final once every slice ended
  std::string msg;
  // An op that asked for its checksum (KVB_XOP_CRC32C): the host's slot, written once every
  // slice ended OK having taken its CRC (crc_whole), and the slices' CRCs until then.
  kvb_op_crc_t* crc_out = nullptr;
  bool crc_whole = true;
  uint64_t slice_bytes = 0;          // every slice's length but the last's
  std::vector<uint32_t> slice_crcs;  // by slice index, when the op has more than one
  uint32_t crc = 0;                  // the only slice's otherwise
};

// One posted request. Final once every slice has ended, or at once on cancel; after that no
// thread enters its local memory (in_user_mem counts threads inside it right now).
struct Request {
  std::mutex mu;
  std::condition_variable cv;
  Peer* peer = nullptr;  // valid while !final: RemovePeer finalizes before freeing the peer
  std::vector<OpState> ops;
  uint64_t outstanding_slices = 0;
  uint64_t charged_bytes = 0;   // counted in the peer's queued bytes until final
  uint64_t charged_slices = 0;  // counted in the peer's queued slices until final
  void (*on_complete)(void*) = nullptr;
  void* user = nullptr;
  bool final = false;
  uint32_t in_user_mem = 0;
};

// A piece of one op, at most slice_bytes long; the unit that lanes send.
struct Slice {
  std::shared_ptr<Request> req;
  uint32_t op = 0;
  uint16_t opcode = 0;
  uint8_t* local = nullptr;
  uint64_t segment = 0;
  uint64_t offset = 0;
  uint64_t length = 0;
  uint64_t deadline_ns = 0;
  uint64_t progress_timeout_ns = 0;
  uint64_t posted_ns = 0;
  int device = -1;         // >= 0: `local` is device memory of this CUDA device (staged)
  bool ended = false;      // under req->mu
  uint32_t index = 0;      // within its op
  bool want_crc = false;   // its op asked for the CRC-32C of its bytes (host memory)
  bool crc_taken = false;  // `crc` holds the CRC-32C of every byte of it, as they moved
  uint32_t crc = 0;
};

struct Peer {
  std::string node_id;
  uint64_t incarnation = 0;
  std::mutex mu;
  std::condition_variable cv;  // signalled when a lane leaves `lanes`
  std::vector<std::string> endpoints;
  size_t preferred = 0;  // the endpoint that last worked
  std::unordered_map<uint64_t, uint64_t> segment_lengths;
  std::deque<std::unique_ptr<Slice>> queue;
  std::vector<std::unique_ptr<Lane>> lanes;  // connecting or established; <= lanes_per_peer
  uint32_t connecting = 0;
  uint64_t no_connect_before_ns = 0;
  bool removing = false;
  std::vector<std::shared_ptr<Request>> live;  // may hold final ones until pruned
  size_t prune_live_at = 64;
  std::atomic<uint64_t> queued_bytes{0};
  std::atomic<uint64_t> queued_slices{0};  // of requests posted and not yet final
  LogLimiter connect_log;
};

// ---------------------------------------------------------------------------------------------
// Socket helpers (tcp_io.cc).

std::string Fmt(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
inline unsigned long long U(uint64_t v) { return static_cast<unsigned long long>(v); }
using util::SplitHostPort;  // "host:port" or "[v6]:port" (util/host_port.h)
std::string ErrnoText(int e);
std::string Trim(std::string_view s);
std::vector<std::string> SplitList(const std::string& s);
std::string AddrText(const sockaddr_storage& ss);
// The IP address of a peer, without the port: what per-source limits count.
std::string SourceText(const sockaddr_storage& ss);
void SetSocketOptions(int fd);

enum class Io { kOk, kTimeout, kClosed, kError, kWoken };

const char* IoText(Io io);
std::string IoError(Io io, int err);

// Bounds for a blocking-style exchange on a nonblocking socket: an absolute deadline, a
// progress timeout (restarted by every byte) and an eventfd that aborts the wait.
struct Limits {
  uint64_t deadline_ns = 0;
  uint64_t progress_ns = 0;
  int wake_fd = -1;
};

// Milliseconds poll may wait, or -1 when the limits have passed.
int WaitBudgetMs(const Transport& t, const Limits& lim, uint64_t last_progress_ns);
Io WaitFd(int fd, short events, int timeout_ms, int wake_fd, int* err);
// `before_wait`, when given, runs each time the socket has no more bytes and the call is about
// to wait for them; a failure it returns ends the call.
Io RecvAll(const Transport& t, int fd, void* buf, size_t len, const Limits& lim, int* err,
           const std::function<Io()>& before_wait = nullptr);
// Sends every byte the iovecs describe (the array is consumed).
Io SendAllV(const Transport& t, int fd, iovec* iov, int count, const Limits& lim, int* err);
Io SendAll(const Transport& t, int fd, const void* data, size_t len, const Limits& lim, int* err);

struct HandshakeResult {
  kvb_status_t code = KVB_OK;
  std::string why;  // the host's reason when code is an error
  Io io = Io::kOk;  // not kOk: the socket failed (code is PEER_UNREACHABLE)
  int err = 0;      // errno behind io
};

// Runs the host's peer handshake (ABI 1.2 auth services) on a connected socket: the host makes
// and judges the messages, this only carries them. A client steps first with no input.
HandshakeResult RunHandshake(const Transport& t, int fd, int32_t role,
                             const std::string& expect_node, uint64_t expect_incarnation,
                             const Limits& lim);

bool LoadConfig(const kvb_host_services_t* host, Config* out, std::string* err);

// ---------------------------------------------------------------------------------------------
// Lane: one outbound connection to one peer incarnation, driven by one thread.

class Lane {
 public:
  Lane(Transport* t, Peer* peer, int wake_fd) : t_(t), peer_(peer), wake_fd_(wake_fd) {}
  ~Lane() {
    if (wake_fd_ >= 0) close(wake_fd_);
  }

  void Run();
  void Wake() {
    const uint64_t one = 1;
    (void)!write(wake_fd_, &one, sizeof(one));
  }
  void Stop() {
    stop_.store(true);
    Wake();
  }

  std::thread thread;
  bool established = false;  // under peer->mu
  std::atomic<uint32_t> inflight_count{0};

 private:
  enum class Exit { kIdle, kStop, kFail, kRequeue };
  struct Outcome {
    Exit exit = Exit::kFail;
    kvb_status_t code = KVB_OK;
    std::string msg;
  };
  struct Entry {
    std::unique_ptr<Slice> s;
    uint64_t id = 0;
    uint8_t hdr[wire::kRequestHeaderBytes];
    uint64_t sent = 0;       // frame bytes (header + WRITE payload) already sent
    bool abandoned = false;  // ended or request final: its local memory is off limits
    int staging = -1;        // device slice: its bounce buffer (DevStaging) once it has one
    uint32_t crc = 0;        // when the slice wants it: the CRC-32C of its payload moved so far
    uint64_t frame_bytes() const {
      return wire::kRequestHeaderBytes + (s->opcode == KVB_OP_WRITE ? s->length : 0);
    }
  };

  bool Connect(kvb_status_t* code, std::string* msg);
  int Dial(const std::string& ep, uint64_t deadline_ns, std::string* why);
  kvb_status_t Handshake(int fd, const std::string& ep, uint64_t deadline_ns, std::string* why);
  void OnConnectFailed(kvb_status_t code, const std::string& msg);
  Outcome Serve();
  bool SendSome(uint64_t now, Outcome* out);
  bool RecvSome(uint64_t now, Outcome* out, Completions* done);
  void CompleteFront(kvb_status_t code, const std::string& msg, Completions* done);
  void Teardown(const Outcome& o);
  // Device slices (tcp_staging.h): bounce buffers for the WRITE entries next in line, copies
  // polled without blocking, a READ's payload handed to its pinned -> device copy.
  bool StagingReady(Slice& s, Completions* done);
  void StageWrites(Completions* done);
  void PollCopies(uint64_t now, Completions* done);
  // A READ slice's staging -> device copy answered `st`: the slice ends with it.
  void EndCopyOut(StagingBuffer& b, kvb_status_t st, const std::string& why, Completions* done);
  bool CopiesRunning() const;
  void FreeStaging(Entry& e);
  void FinishStagedRead(Completions* done);
  void DrainCopies(Completions* done);
  uint64_t ProgressTimeoutNs() const;
  std::string Name() const {
    return Fmt("'%s' incarnation %#llx at %s", peer_->node_id.c_str(), U(peer_->incarnation),
               endpoint_.c_str());
  }

  static bool Live(Slice& s) {
    std::lock_guard<std::mutex> lock(s.req->mu);
    return !s.ended && !s.req->final;
  }
  static bool Wanted(Slice& s) {
    std::lock_guard<std::mutex> lock(s.req->mu);
    return !s.ended && !s.req->final && s.req->ops[s.op].error == KVB_OK;
  }
  static bool EnterUserMem(Slice& s) {
    std::lock_guard<std::mutex> lock(s.req->mu);
    if (s.ended || s.req->final) return false;
    ++s.req->in_user_mem;
    return true;
  }
  static void ExitUserMem(Slice& s) { ExitUserMem(*s.req); }
  static void ExitUserMem(Request& r) {
    std::lock_guard<std::mutex> lock(r.mu);
    if (--r.in_user_mem == 0) r.cv.notify_all();
  }

  Transport* const t_;
  Peer* const peer_;
  const int wake_fd_;
  int fd_ = -1;
  std::atomic<bool> stop_{false};
  std::string endpoint_;
  std::deque<Entry> inflight_;  // send order == response order
  size_t send_idx_ = 0;         // first entry not completely sent
  uint8_t rhdr_[wire::kResponseHeaderBytes];
  size_t rhdr_got_ = 0;
  bool in_payload_ = false;  // receiving the front entry's READ payload
  uint64_t payload_got_ = 0;
  uint64_t next_id_ = 1;
  uint64_t last_progress_ns_ = 0;
  uint64_t idle_since_ns_ = 0;
  std::unique_ptr<uint8_t[]> scratch_;
  std::unique_ptr<DevStaging> dev_;  // made on the first device slice
  uint32_t write_buffers_ = 0;       // bounce buffers held by WRITE entries (kCopyIn, kFilled)
  bool wait_buffer_ = false;         // a READ payload waits for a free bounce buffer
};

}  // namespace kvbridge::tcp
