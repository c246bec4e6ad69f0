#include "verbs_qp.h"

#include <cinttypes>
#include <cstdio>
#include <iterator>
#include <utility>

namespace kvbridge::verbs {

namespace sdk = kvbridge::plugin::sdk;

namespace {

std::string Hex(uint64_t v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "0x%" PRIx64, v);
  return buf;
}

bool IsZero(const Gid& g) {
  for (uint8_t b : g) {
    if (b != 0) return false;
  }
  return true;
}

}  // namespace

const char* RcStateName(RcState s) {
  switch (s) {
    case RcState::kReset:
      return "RESET";
    case RcState::kInit:
      return "INIT";
    case RcState::kRtr:
      return "RTR";
    case RcState::kRts:
      return "RTS";
    case RcState::kError:
      return "ERROR";
    case RcState::kClosed:
      return "CLOSED";
  }
  return "unknown";
}

kvb_status_t MapCompletionStatus(WcStatus s) {
  switch (s) {
    case WcStatus::kSuccess:
      return KVB_OK;
    case WcStatus::kRemAccessErr:
    case WcStatus::kLocProtErr:
    case WcStatus::kLocAccessErr:
      return KVB_ERR_NOT_REGISTERED;
    case WcStatus::kRetryExcErr:
    case WcStatus::kRnrRetryExcErr:
    case WcStatus::kRespTimeoutErr:
    case WcStatus::kWrFlushErr:
      return KVB_ERR_PEER_UNREACHABLE;
    case WcStatus::kLocLenErr:
      return KVB_ERR_INVALID_ARGUMENT;
    case WcStatus::kRemInvReqErr:
    case WcStatus::kBadRespErr:
    case WcStatus::kRemInvRdReqErr:
      return KVB_ERR_PROTOCOL;
    case WcStatus::kLocQpOpErr:
      return KVB_ERR_INTERNAL;
    default:
      return KVB_ERR_IO;
  }
}

// ---- creation ---------------------------------------------------------------------------------

sdk::Result<std::unique_ptr<RcConnection>> RcConnection::Create(VerbsApi& api, DeviceHandle dev,
                                                                PdHandle pd, PeerIncarnation peer,
                                                                const RcOptions& o) {
  const std::string who =
      "RC connection to " + peer.node_id + " incarnation " + std::to_string(peer.incarnation);
  auto bad = [&](const std::string& what) {
    return sdk::Status(KVB_ERR_INVALID_ARGUMENT, who + ": " + what);
  };
  if (o.max_outstanding == 0) return bad("max_outstanding is 0");
  if (o.max_sge == 0) return bad("max_sge is 0");
  if (o.poll_batch == 0) return bad("poll_batch is 0");
  if (o.local_psn > 0xffffff) return bad("local_psn " + Hex(o.local_psn) + " is over 24 bits");
  if (o.timeout > 31) return bad("timeout " + std::to_string(o.timeout) + " is over 31");
  if (o.retry_cnt > 7) return bad("retry_cnt " + std::to_string(o.retry_cnt) + " is over 7");
  if (o.rnr_retry > 7) return bad("rnr_retry " + std::to_string(o.rnr_retry) + " is over 7");

  auto cq = api.CreateCq(dev, o.max_outstanding);
  if (!cq.ok()) return sdk::Status(cq.status().code(), who + ": " + cq.status().message());
  auto qp = api.CreateRcQp(pd, *cq, QpCaps{o.max_outstanding, o.max_sge});
  if (!qp.ok()) {
    (void)api.DestroyCq(*cq);
    return sdk::Status(qp.status().code(), who + ": " + qp.status().message());
  }
  return std::unique_ptr<RcConnection>(new RcConnection(api, std::move(peer), o, *cq, *qp));
}

RcConnection::RcConnection(VerbsApi& api, PeerIncarnation peer, const RcOptions& options,
                           CqHandle cq, QpHandle qp)
    : api_(api),
      peer_(std::move(peer)),
      options_(options),
      cq_(cq),
      qp_(qp),
      wc_(options.poll_batch) {}

RcConnection::~RcConnection() { (void)Close(nullptr); }

std::string RcConnection::Describe() const {
  std::string s = "QP " + std::to_string(qp_.qp_num) + " -> " + peer_.node_id + " incarnation " +
                  std::to_string(peer_.incarnation);
  if (remote_qp_num_ != 0) s += " QP " + std::to_string(remote_qp_num_);
  return s;
}

std::string RcConnection::DescribeOp(const RdmaOp& op, uint64_t wr_id) {
  const bool read = op.opcode == WrOpcode::kRdmaRead;
  return std::string(read ? "RDMA READ" : "RDMA WRITE") + " of " + std::to_string(op.length) +
         " bytes (wr_id " + std::to_string(wr_id) + ", remote " + Hex(op.remote_addr) + " rkey " +
         Hex(op.rkey) + ", local " + Hex(op.local_addr) + " lkey " + Hex(op.lkey) + ")";
}

// ---- Connect ----------------------------------------------------------------------------------

sdk::Status RcConnection::Connect(const LocalPortInfo& local, const RemoteQpInfo& remote) {
  if (state_ != RcState::kReset) {
    return sdk::Status(KVB_ERR_INTERNAL, Describe() + ": Connect in state " + RcStateName(state_) +
                                             " (only from RESET)");
  }
  if (remote.node_id != peer_.node_id || remote.incarnation != peer_.incarnation) {
    return sdk::Status(KVB_ERR_STALE_PEER,
                       Describe() + ": the remote QP info is for " + remote.node_id +
                           " incarnation " + std::to_string(remote.incarnation) +
                           ", not the incarnation this connection was made for (a restarted "
                           "peer's QP numbers and rkeys are never used)");
  }
  auto bad = [&](const std::string& what) {
    return sdk::Status(KVB_ERR_INVALID_ARGUMENT, Describe() + ": cannot connect: " + what);
  };
  if (remote.qp_num == 0 || remote.qp_num > 0xffffff) {
    return bad("remote QP number " + std::to_string(remote.qp_num) + " is not a QP number");
  }
  if (remote.psn > 0xffffff) return bad("remote PSN " + Hex(remote.psn) + " is over 24 bits");
  if (!ValidMtu(local.active_mtu)) {
    return bad("local port " + std::to_string(local.port) + " MTU " +
               std::to_string(local.active_mtu) + " is not 256..4096");
  }
  if (!ValidMtu(remote.mtu)) {
    return bad("remote MTU " + std::to_string(remote.mtu) + " is not 256..4096");
  }
  if (local.ethernet && IsZero(remote.gid)) {
    return bad("the local port is RoCE and the remote QP info has no GID");
  }
  if (!local.ethernet && remote.lid == 0) {
    return bad("the local port is InfiniBand and the remote QP info has no LID");
  }

  remote_qp_num_ = remote.qp_num;
  auto failed = [&](const sdk::Status& st) {
    sdk::Status first(
        st.code(), Describe() + ": connect failed in " + RcStateName(state_) + ": " + st.message());
    Fail(first);
    return first;
  };

  InitAttr init;
  init.port = local.port;
  init.pkey_index = options_.pkey_index;
  init.access = kAccessLocalWrite | kAccessRemoteRead | kAccessRemoteWrite;
  if (auto st = api_.ModifyQpToInit(qp_, init); !st.ok()) return failed(st);
  state_ = RcState::kInit;

  RtrAttr rtr;
  rtr.dest_qp_num = remote.qp_num;
  rtr.rq_psn = remote.psn;
  rtr.path_mtu = local.active_mtu < remote.mtu ? local.active_mtu : remote.mtu;
  rtr.max_dest_rd_atomic = options_.max_dest_rd_atomic;
  rtr.min_rnr_timer = options_.min_rnr_timer;
  rtr.path.port = local.port;
  rtr.path.sl = options_.sl;
  if (local.ethernet) {
    rtr.path.global = true;
    rtr.path.dgid = remote.gid;
    rtr.path.sgid_index = local.gid_index;
    rtr.path.hop_limit = options_.hop_limit;
    rtr.path.traffic_class = options_.traffic_class;
  } else {
    rtr.path.global = false;
    rtr.path.dlid = remote.lid;
  }
  if (auto st = api_.ModifyQpToRtr(qp_, rtr); !st.ok()) return failed(st);
  state_ = RcState::kRtr;

  RtsAttr rts;
  rts.sq_psn = options_.local_psn;
  rts.timeout = options_.timeout;
  rts.retry_cnt = options_.retry_cnt;
  rts.rnr_retry = options_.rnr_retry;
  rts.max_rd_atomic = options_.max_rd_atomic;
  if (auto st = api_.ModifyQpToRts(qp_, rts); !st.ok()) return failed(st);
  state_ = RcState::kRts;
  return {};
}

// ---- Post -------------------------------------------------------------------------------------

sdk::Status RcConnection::Post(std::span<const RdmaOp> ops, uint64_t now_ns, size_t* accepted) {
  if (accepted != nullptr) *accepted = 0;
  switch (state_) {
    case RcState::kRts:
      break;
    case RcState::kError:
      return sdk::Status(KVB_ERR_PEER_UNREACHABLE,
                         Describe() + ": evicted after: " + first_error_.message());
    case RcState::kClosed:
      return sdk::Status(KVB_ERR_CANCELLED, Describe() + ": closed");
    default:
      return sdk::Status(KVB_ERR_INTERNAL, Describe() + ": Post in state " + RcStateName(state_) +
                                               " (not connected)");
  }
  for (size_t i = 0; i < ops.size(); ++i) {
    const RdmaOp& op = ops[i];
    const char* what = op.length == 0             ? "length is 0"
                       : op.length > kMaxOpLength ? "length is over 2^31"
                       : op.local_addr == 0       ? "local_addr is 0"
                       : (op.opcode != WrOpcode::kRdmaRead && op.opcode != WrOpcode::kRdmaWrite)
                           ? "opcode is neither READ nor WRITE"
                           : nullptr;
    if (what != nullptr) {
      return sdk::Status(KVB_ERR_INVALID_ARGUMENT, Describe() + ": op " + std::to_string(i) + ": " +
                                                       what + ": " + DescribeOp(op, 0));
    }
  }
  if (ops.empty()) return {};
  if (ops.size() > options_.max_outstanding - outstanding_.size()) {
    return sdk::Status(KVB_ERR_BACKPRESSURE, Describe() + ": " + std::to_string(ops.size()) +
                                                 " ops with " +
                                                 std::to_string(outstanding_.size()) +
                                                 " outstanding would pass max_outstanding " +
                                                 std::to_string(options_.max_outstanding));
  }

  std::vector<SendWr> wrs(ops.size());
  for (size_t i = 0; i < ops.size(); ++i) {
    const RdmaOp& op = ops[i];
    wrs[i] = SendWr{op.opcode, op.local_addr, op.lkey,         op.remote_addr,
                    op.rkey,   op.length,     next_wr_id_ + i, /*signaled=*/true};
  }
  size_t took = 0;
  const sdk::Status st = api_.PostSend(qp_, wrs, &took);
  if (took > ops.size()) took = ops.size();
  if (outstanding_.empty() && took > 0) last_progress_ns_ = now_ns;
  for (size_t i = 0; i < took; ++i) outstanding_.emplace(wrs[i].wr_id, Pending{ops[i]});
  next_wr_id_ += ops.size();
  if (accepted != nullptr) *accepted = took;
  if (st.ok()) return {};

  sdk::Status first(st.code(), Describe() + ": posting " + std::to_string(ops.size()) +
                                   " work requests failed (" + std::to_string(took) +
                                   " taken): " + st.message());
  Fail(first);
  return first;
}

// ---- Poll -------------------------------------------------------------------------------------

void RcConnection::End(std::map<uint64_t, Pending>::iterator it, sdk::Status st) {
  ended_.push_back(OpEnd{it->second.op.cookie, it->first, std::move(st), false});
  outstanding_.erase(it);
}

void RcConnection::Fail(sdk::Status first) {
  if (state_ == RcState::kError || state_ == RcState::kClosed) return;
  state_ = RcState::kError;
  std::string note;
  if (auto st = api_.ModifyQpToErr(qp_); !st.ok())
    note = " (moving the QP to ERR: " + st.message() + ")";
  first_error_ = sdk::Status(first.code(), first.message() + note);
  for (const auto& [wr_id, p] : outstanding_) {
    ended_.push_back(OpEnd{p.op.cookie, wr_id,
                           sdk::Status(first_error_.code(), "flushed: " + DescribeOp(p.op, wr_id) +
                                                                " ended by the connection's first "
                                                                "error: " +
                                                                first_error_.message()),
                           true});
  }
  outstanding_.clear();
}

void RcConnection::Drain(uint64_t now_ns) {
  while (true) {
    auto n = api_.PollCq(cq_, wc_);
    if (!n.ok()) {
      if (state_ == RcState::kRts) {
        Fail(sdk::Status(n.status().code(), Describe() + ": " + n.status().message()));
      }
      return;
    }
    for (size_t i = 0; i < *n && i < wc_.size(); ++i) {
      const Completion& c = wc_[i];
      auto it = outstanding_.find(c.wr_id);
      if (it == outstanding_.end()) {
        // A flush of an op already ended by the connection's error: expected in kError.
        if (state_ == RcState::kRts) {
          Fail(sdk::Status(KVB_ERR_INTERNAL, Describe() + ": a completion (" +
                                                 WcStatusString(c.status) + ") for wr_id " +
                                                 std::to_string(c.wr_id) +
                                                 ", which is not outstanding"));
        }
        continue;
      }
      if (c.status == WcStatus::kSuccess) {
        last_progress_ns_ = now_ns;
        End(it, sdk::Status());
        continue;
      }
      char vendor[32];
      std::snprintf(vendor, sizeof(vendor), "0x%x", c.vendor_err);
      sdk::Status st(MapCompletionStatus(c.status),
                     Describe() + ": " + DescribeOp(it->second.op, it->first) +
                         " failed: " + WcStatusString(c.status) + " (IBV_WC status " +
                         std::to_string(static_cast<uint32_t>(c.status)) + ", vendor error " +
                         vendor + ")");
      End(it, st);
      Fail(std::move(st));
    }
    if (*n < wc_.size()) return;
  }
}

void RcConnection::CheckTimers(uint64_t now_ns) {
  if (state_ != RcState::kRts || outstanding_.empty()) return;
  const bool stalled = options_.progress_timeout_ns != 0 && now_ns >= last_progress_ns_ &&
                       now_ns - last_progress_ns_ >= options_.progress_timeout_ns;
  sdk::Status first;
  for (auto it = outstanding_.begin(); it != outstanding_.end();) {
    const RdmaOp& op = it->second.op;
    if (op.deadline_ns == 0 || now_ns < op.deadline_ns) {
      ++it;
      continue;
    }
    sdk::Status st(KVB_ERR_DEADLINE_EXCEEDED,
                   Describe() + ": " + DescribeOp(op, it->first) + " passed its deadline (" +
                       std::to_string(now_ns - op.deadline_ns) + " ns ago) without completing");
    if (first.ok()) first = st;
    auto next = std::next(it);
    End(it, std::move(st));
    it = next;
  }
  if (stalled && !outstanding_.empty()) {
    sdk::Status st(KVB_ERR_PROGRESS_TIMEOUT,
                   Describe() + ": no completion for " +
                       std::to_string(now_ns - last_progress_ns_) + " ns (progress timeout " +
                       std::to_string(options_.progress_timeout_ns) + " ns) with " +
                       std::to_string(outstanding_.size()) + " work requests outstanding");
    if (first.ok()) first = st;
    for (auto it = outstanding_.begin(); it != outstanding_.end();) {
      auto next = std::next(it);
      End(it, sdk::Status(st.code(), st.message() + ": " + DescribeOp(it->second.op, it->first)));
      it = next;
    }
  }
  if (!first.ok()) Fail(std::move(first));
}

size_t RcConnection::Poll(uint64_t now_ns, std::vector<OpEnd>* ended) {
  if (state_ == RcState::kRts || state_ == RcState::kError) Drain(now_ns);
  CheckTimers(now_ns);
  const size_t n = ended_.size();
  if (ended != nullptr) {
    for (auto& e : ended_) ended->push_back(std::move(e));
  }
  ended_.clear();
  return n;
}

// ---- Close ------------------------------------------------------------------------------------

sdk::Status RcConnection::Close(std::vector<OpEnd>* ended) {
  if (state_ == RcState::kClosed) return {};
  sdk::Status result;
  if (auto st = api_.DestroyQp(qp_); !st.ok()) {
    result = sdk::Status(st.code(), Describe() + ": close: " + st.message());
  }
  if (auto st = api_.DestroyCq(cq_); !st.ok() && result.ok()) {
    result = sdk::Status(st.code(), Describe() + ": close: " + st.message());
  }
  state_ = RcState::kClosed;
  for (auto it = outstanding_.begin(); it != outstanding_.end();) {
    auto next = std::next(it);
    End(it,
        sdk::Status(KVB_ERR_CANCELLED, Describe() + ": closed with " +
                                           DescribeOp(it->second.op, it->first) + " outstanding"));
    it = next;
  }
  if (ended != nullptr) {
    for (auto& e : ended_) ended->push_back(std::move(e));
  }
  ended_.clear();
  return result;
}

}  // namespace kvbridge::verbs
