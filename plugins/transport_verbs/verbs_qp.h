// kvbridge::verbs::RcConnection: one RC queue pair from this process to one remote NIC of one
// peer incarnation, over a VerbsApi (verbs_api.h): its state machine, the RDMA WRITE/READ work
// requests posted on it, their completions, deadlines and progress timeout. The verbs transport
// owns one per (local rail, remote NIC, peer incarnation); this file knows nothing of peers'
// descriptors, rails or requests beyond the ops it is given.
//
// State machine (Create makes a CQ of max_outstanding entries and an RC QP in RESET):
//
//   kReset --Connect--> kInit --> kRtr --> kRts    (Connect drives all three ibv_modify_qp)
//     |                   |         |        |
//     |   a modify fails  +---------+        |  an error completion, a failed post or CQ poll,
//     +-----------------------------> kError <--  a deadline passed, the progress timeout
//                                                 (the QP is moved to ERR: evicted)
//   any state --Close--> kClosed  (the QP and the CQ destroyed, once)
//
// - Connect refuses, with STALE_PEER and nothing modified (the state stays kReset), a
//   RemoteQpInfo whose (node_id, incarnation) is not the one the connection was created for: a
//   restarted peer's QP numbers and rkeys are never used. It refuses a path it cannot use (a
//   RoCE port without the remote GID, InfiniBand without the remote LID, an MTU that is not
//   256..4096) with INVALID_ARGUMENT, likewise before any modify. A failed modify moves the
//   connection to kError, its message naming the call.
// - Post works only in kRts. It checks every op, then the bound: when the ops already
//   outstanding plus the new ones would exceed max_outstanding it returns BACKPRESSURE and posts
//   nothing. Every work request is signaled and has its own wr_id (1, 2, 3, ... in post order),
//   which maps back to its op.
// - Poll(now_ns) consumes completions: a successful one ends its op OK (in whatever order they
//   come). The first error (an error completion, ibv_post_send or ibv_poll_cq failing, an op
//   past its deadline, no completion for progress_timeout_ns while work is outstanding) ends
//   the op it concerns with the mapped code and moves the connection to kError: the QP is moved
//   to ERR, every other outstanding op ends at once with the first error's code (flushed, its
//   message saying so), and the connection never posts again: the owner makes a new one. Flush
//   completions that arrive later are consumed and ignored.
// - Error completions map (MapCompletionStatus) as:
//     IBV_WC_REM_ACCESS_ERR                       -> NOT_REGISTERED: the transport checks every
//         remote range against the peer's registered segments before posting, so the NIC
//         refusing it means the remote region is no longer registered under that rkey
//     IBV_WC_LOC_PROT_ERR, IBV_WC_LOC_ACCESS_ERR  -> NOT_REGISTERED (local memory not in the MR
//         of its lkey)
//     IBV_WC_RETRY_EXC_ERR, IBV_WC_RNR_RETRY_EXC_ERR, IBV_WC_RESP_TIMEOUT_ERR
//                                                 -> PEER_UNREACHABLE
//     IBV_WC_WR_FLUSH_ERR as the first error      -> PEER_UNREACHABLE (the QP left RTS)
//     IBV_WC_LOC_LEN_ERR                          -> INVALID_ARGUMENT
//     IBV_WC_REM_INV_REQ_ERR, IBV_WC_BAD_RESP_ERR, IBV_WC_REM_INV_RD_REQ_ERR -> PROTOCOL
//     IBV_WC_LOC_QP_OP_ERR                        -> INTERNAL
//     the rest (REM_OP, REM_ABORT, FATAL, GENERAL, ...) -> IO
//   each message naming the op, the QP pair, the peer incarnation, ibv_wc_status_str and the
//   vendor error.
// - Deadlines: an op whose deadline_ns passes before its completion ends DEADLINE_EXCEEDED at
//   the next Poll. An RC work request cannot be withdrawn, and the NIC would otherwise keep
//   touching the op's memory after the op was reported final, so this too moves the connection
//   to kError (the first error) and flushes the other outstanding ops. A completion that has
//   arrived counts even when Poll runs after the deadline (the bytes moved).
// - Progress timeout (progress_timeout_ns, 0 = none): the clock starts when work is posted on
//   an idle connection and restarts at every completion; when it runs out with work
//   outstanding, every outstanding op ends PROGRESS_TIMEOUT and the connection moves to kError.
// - Memory: an op ended by an error (a flushed one, one past its deadline or the progress
//   timeout) may still be touched by the NIC until the QP is destroyed (the connection does not
//   report the flush completions): the owner keeps that op's memory registered, and a READ's
//   local buffer unused, until it has closed the connection.
// - Close destroys the QP and then the CQ, exactly once (the destructor closes when Close was
//   not called); ops still outstanding end CANCELLED.
//
// Times (now_ns, deadlines) are the caller's monotonic nanoseconds; nothing here reads a clock
// or sleeps.
//
// Thread-safety: none. A connection is owned and used by one progress thread; the VerbsApi it
// uses must outlive it.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kvbridge/plugin/sdk/common.hpp"
#include "verbs_api.h"

namespace kvbridge::verbs {

enum class RcState { kReset, kInit, kRtr, kRts, kError, kClosed };

// "RESET", "INIT", "RTR", "RTS", "ERROR", "CLOSED".
const char* RcStateName(RcState s);

// The peer incarnation a connection is made for.
struct PeerIncarnation {
  std::string node_id;
  uint64_t incarnation = 0;
};

// This side of the path: the port the QP uses and what it is (from QueryPort / QueryGid).
struct LocalPortInfo {
  uint8_t port = 1;
  bool ethernet = false;    // RoCE: the path is by GID; else InfiniBand by LID
  uint16_t lid = 0;         // InfiniBand
  Gid gid{};                // RoCE: the local GID at gid_index (advertised to the peer)
  uint8_t gid_index = 0;    // RoCE: the source GID index (sgid_index)
  uint32_t active_mtu = 0;  // bytes
};

// What the peer's descriptor says about its QP for this connection.
struct RemoteQpInfo {
  std::string node_id;
  uint64_t incarnation = 0;
  uint32_t qp_num = 0;
  uint32_t psn = 0;  // the remote QP's send PSN (24 bits): this QP's receive PSN
  uint16_t lid = 0;  // InfiniBand
  Gid gid{};         // RoCE
  uint32_t mtu = 0;  // the remote port's active MTU, bytes
};

struct RcOptions {
  uint32_t max_outstanding = 128;    // work requests posted and not ended; also SQ and CQ depth
  uint32_t max_sge = 1;              // asked for at QP creation (the ops use one each)
  uint32_t local_psn = 0;            // this QP's send PSN (24 bits), advertised to the peer
  uint64_t progress_timeout_ns = 0;  // 0 = none
  uint32_t poll_batch = 32;          // completions asked for per ibv_poll_cq
  // ibv_modify_qp attributes; max_rd_atomic / max_dest_rd_atomic must not exceed the device's
  // max_qp_rd_atom / max_qp_init_rd_atom (the owner clamps them).
  uint8_t timeout = 14;  // 4.096 us * 2^14 = 67 ms per try
  uint8_t retry_cnt = 7;
  uint8_t rnr_retry = 7;
  uint8_t min_rnr_timer = 12;
  uint8_t max_rd_atomic = 16;
  uint8_t max_dest_rd_atomic = 16;
  uint8_t hop_limit = 64;  // RoCE / GRH
  uint8_t traffic_class = 0;
  uint8_t sl = 0;
  uint16_t pkey_index = 0;
};

// One RDMA op: one work request of `length` bytes between local memory (in the MR of lkey) and
// the remote memory at remote_addr (in the MR of rkey).
struct RdmaOp {
  uint64_t cookie = 0;  // the owner's, handed back with the op's end
  WrOpcode opcode = WrOpcode::kRdmaWrite;
  uint64_t local_addr = 0;
  uint32_t lkey = 0;
  uint64_t remote_addr = 0;
  uint32_t rkey = 0;
  uint32_t length = 0;       // 1 .. kMaxOpLength
  uint64_t deadline_ns = 0;  // absolute, the caller's clock; 0 = none
};

// RC messages are at most 2^31 bytes.
inline constexpr uint32_t kMaxOpLength = 1u << 31;

// How one op ended.
struct OpEnd {
  uint64_t cookie = 0;
  uint64_t wr_id = 0;
  plugin::sdk::Status status;  // OK, or why it failed
  bool flushed = false;  // failed because another op failed first (it may be retried elsewhere)
};

// The code an error completion maps to (see the header comment); OK for kSuccess.
kvb_status_t MapCompletionStatus(WcStatus s);

class RcConnection {
 public:
  // Creates the CQ (max_outstanding entries) and the RC QP (in RESET) on `dev` / `pd` for the
  // incarnation `peer`. INVALID_ARGUMENT for options out of range (max_outstanding or max_sge
  // 0, local_psn over 24 bits, timeout over 31, retry_cnt or rnr_retry over 7, poll_batch 0);
  // a failed create returns its error and leaves nothing created.
  static plugin::sdk::Result<std::unique_ptr<RcConnection>> Create(VerbsApi& api, DeviceHandle dev,
                                                                   PdHandle pd,
                                                                   PeerIncarnation peer,
                                                                   const RcOptions& options);
  ~RcConnection();
  RcConnection(const RcConnection&) = delete;
  RcConnection& operator=(const RcConnection&) = delete;

  // kReset -> kRts (see the header comment). INTERNAL when not in kReset.
  plugin::sdk::Status Connect(const LocalPortInfo& local, const RemoteQpInfo& remote);

  // Posts every op, or none: INTERNAL before Connect, PEER_UNREACHABLE once evicted (naming the
  // first error), CANCELLED once closed, INVALID_ARGUMENT for a malformed op (length 0 or over
  // kMaxOpLength, local_addr 0), BACKPRESSURE past max_outstanding; then *accepted is 0 and no
  // op will be reported by Poll. When ibv_post_send itself fails the connection moves to
  // kError and Post returns that error: ops[0, *accepted) were taken by the QP anyway and Poll
  // reports them (failed); the rest were not posted. `accepted` may be null.
  plugin::sdk::Status Post(std::span<const RdmaOp> ops, uint64_t now_ns,
                           size_t* accepted = nullptr);

  // Consumes completions and checks deadlines and the progress timeout at now_ns; appends every
  // op that ended to *ended and returns how many. Every op Post accepted ends exactly once,
  // here or in Close.
  size_t Poll(uint64_t now_ns, std::vector<OpEnd>* ended);

  // Destroys the QP, then the CQ (once; later calls do nothing and return OK). Ops still
  // outstanding, or ended and not yet returned by Poll, are appended to *ended (CANCELLED for
  // the outstanding ones; may be null). Returns the first destroy error, naming the call; the
  // connection is kClosed either way.
  plugin::sdk::Status Close(std::vector<OpEnd>* ended = nullptr);

  RcState state() const { return state_; }
  // The error that moved the connection to kError (OK otherwise).
  const plugin::sdk::Status& first_error() const { return first_error_; }
  uint32_t qp_num() const { return qp_.qp_num; }
  uint32_t local_psn() const { return options_.local_psn; }
  const PeerIncarnation& peer() const { return peer_; }
  size_t outstanding() const { return outstanding_.size(); }

 private:
  struct Pending {
    RdmaOp op;
  };

  RcConnection(VerbsApi& api, PeerIncarnation peer, const RcOptions& options, CqHandle cq,
               QpHandle qp);

  // "QP 17 -> node-b incarnation 7 QP 99" (the remote QP once connected).
  std::string Describe() const;
  // "RDMA READ of 4096 bytes (wr_id 3, remote 0x1000 rkey 0x5, local 0x2000 lkey 0x6)".
  static std::string DescribeOp(const RdmaOp& op, uint64_t wr_id);
  // Ends one outstanding op with `st` (not flushed).
  void End(std::map<uint64_t, Pending>::iterator it, plugin::sdk::Status st);
  // Records `first` as the first error, moves the QP to ERR and ends every op still
  // outstanding, flushed, with first's code.
  void Fail(plugin::sdk::Status first);
  void Drain(uint64_t now_ns);
  void CheckTimers(uint64_t now_ns);

  VerbsApi& api_;
  const PeerIncarnation peer_;
  const RcOptions options_;
  CqHandle cq_;
  QpHandle qp_;
  RcState state_ = RcState::kReset;
  plugin::sdk::Status first_error_;
  uint32_t remote_qp_num_ = 0;
  uint64_t next_wr_id_ = 1;
  std::map<uint64_t, Pending> outstanding_;  // wr_id -> op, in post order
  std::vector<OpEnd> ended_;                 // ended outside Poll, returned by the next Poll
  uint64_t last_progress_ns_ = 0;            // the progress clock's start
  std::vector<Completion> wc_;               // Poll's buffer, poll_batch entries
};

}  // namespace kvbridge::verbs
