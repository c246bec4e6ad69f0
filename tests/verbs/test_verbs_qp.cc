// verbs::RcConnection (plugins/transport_verbs/verbs_qp.h) over a FakeVerbs that keeps QP
// states (refusing illegal transitions and posts outside RTS, flushing like a NIC when a QP
// errs), records every call with its arguments, lets a test script completions, and fails a
// chosen call: the modify sequence for RoCE and InfiniBand, failed modifies, stale incarnations,
// bad paths, the outstanding bound, completions in and out of order, error completions and
// their mapping, flushes, failed posts and polls, deadlines and the progress timeout on a clock
// the test passes in, and Close.
#include <gtest/gtest.h>

#include <deque>
#include <map>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "verbs_api.h"
#include "verbs_qp.h"

namespace kvbridge::verbs {
namespace {

namespace sdk = kvbridge::plugin::sdk;

class FakeVerbs : public VerbsApi {
 public:
  enum class QpState { kReset, kInit, kRtr, kRts, kErr };

  struct Call {
    Call(std::string n = {}, uint32_t qp = 0) : name(std::move(n)), qp_num(qp) {}  // NOLINT
    std::string name;
    uint32_t qp_num = 0;
    uint32_t depth = 0;
    QpCaps caps;
    InitAttr init;
    RtrAttr rtr;
    RtsAttr rts;
    std::vector<SendWr> wrs;
  };

  struct Cq {
    std::deque<Completion> queue;
    int destroys = 0;
  };
  struct Qp {
    uint32_t qp_num = 0;
    Cq* cq = nullptr;
    QpState state = QpState::kReset;
    std::vector<uint64_t> pending;  // posted, no completion yet, in post order
    int destroys = 0;
  };

  // The next call named `name` fails with (code, message); a failed PostSend takes `accept`
  // work requests first.
  void FailNext(const std::string& name, kvb_status_t code, std::string message,
                size_t accept = 0) {
    fail_[name] = Fault{sdk::Status(code, std::move(message)), accept};
  }

  // Scripts the completion of wr_id. An error status other than a flush moves the QP to ERR and
  // flushes its other pending work requests after it, as a NIC does.
  void Complete(uint64_t wr_id, WcStatus status = WcStatus::kSuccess, uint32_t vendor = 0) {
    for (auto& qp : qps_) {
      for (size_t i = 0; i < qp.pending.size(); ++i) {
        if (qp.pending[i] != wr_id) continue;
        qp.pending.erase(qp.pending.begin() + static_cast<long>(i));
        qp.cq->queue.push_back(Completion{wr_id, status, vendor, WcOpcode::kOther, 0});
        if (status != WcStatus::kSuccess && status != WcStatus::kWrFlushErr) Flush(qp);
        return;
      }
    }
    ADD_FAILURE() << "Complete: wr_id " << wr_id << " is not pending";
  }
  // A completion for a wr_id nobody posted.
  void Stray(uint64_t wr_id) { qps_.front().cq->queue.push_back(Completion{wr_id}); }

  std::vector<std::string> Names() const {
    std::vector<std::string> out;
    for (const auto& c : calls) out.push_back(c.name);
    return out;
  }
  int Count(const std::string& name) const {
    int n = 0;
    for (const auto& c : calls) n += c.name == name;
    return n;
  }
  const Call* Last(const std::string& name) const {
    for (auto it = calls.rbegin(); it != calls.rend(); ++it) {
      if (it->name == name) return &*it;
    }
    return nullptr;
  }
  // Every wr_id posted (taken by the QP), in order.
  std::vector<uint64_t> Posted() const { return posted_; }
  Qp& qp(size_t i = 0) { return qps_.at(i); }
  Cq& cq(size_t i = 0) { return cqs_.at(i); }
  int polls = 0;

  std::vector<Call> calls;

  // ---- VerbsApi ----
  sdk::Result<DeviceHandle> OpenDevice(const std::string& name) override {
    Record({"OpenDevice"});
    if (auto f = Take("OpenDevice")) return *f;
    return DeviceHandle{this};
  }
  sdk::Status CloseDevice(DeviceHandle) override { return Simple("CloseDevice"); }
  sdk::Result<PdHandle> AllocPd(DeviceHandle) override {
    Record({"AllocPd"});
    if (auto f = Take("AllocPd")) return *f;
    return PdHandle{this};
  }
  sdk::Status DeallocPd(PdHandle) override { return Simple("DeallocPd"); }
  sdk::Result<CqHandle> CreateCq(DeviceHandle, uint32_t depth) override {
    Call c{"CreateCq"};
    c.depth = depth;
    Record(c);
    if (auto f = Take("CreateCq")) return *f;
    cqs_.emplace_back();
    return CqHandle{&cqs_.back()};
  }
  sdk::Status DestroyCq(CqHandle cq) override {
    Record({"DestroyCq"});
    ++static_cast<Cq*>(cq.impl)->destroys;
    if (auto f = Take("DestroyCq")) return *f;
    return {};
  }
  sdk::Result<QpHandle> CreateRcQp(PdHandle, CqHandle cq, const QpCaps& caps) override {
    Call c{"CreateRcQp"};
    c.caps = caps;
    Record(c);
    if (auto f = Take("CreateRcQp")) return *f;
    qps_.emplace_back();
    Qp& qp = qps_.back();
    qp.qp_num = 100 + static_cast<uint32_t>(qps_.size());
    qp.cq = static_cast<Cq*>(cq.impl);
    return QpHandle{qp.qp_num, &qp};
  }
  sdk::Status ModifyQpToInit(QpHandle h, const InitAttr& a) override {
    Call c{"ModifyQpToInit", h.qp_num};
    c.init = a;
    return Transition(c, h, QpState::kReset, QpState::kInit);
  }
  sdk::Status ModifyQpToRtr(QpHandle h, const RtrAttr& a) override {
    Call c{"ModifyQpToRtr", h.qp_num};
    c.rtr = a;
    return Transition(c, h, QpState::kInit, QpState::kRtr);
  }
  sdk::Status ModifyQpToRts(QpHandle h, const RtsAttr& a) override {
    Call c{"ModifyQpToRts", h.qp_num};
    c.rts = a;
    return Transition(c, h, QpState::kRtr, QpState::kRts);
  }
  sdk::Status ModifyQpToErr(QpHandle h) override {
    Record({"ModifyQpToErr", h.qp_num});
    if (auto f = Take("ModifyQpToErr")) return *f;
    Qp& qp = *static_cast<Qp*>(h.impl);
    qp.state = QpState::kErr;
    Flush(qp);
    return {};
  }
  sdk::Status DestroyQp(QpHandle h) override {
    Record({"DestroyQp", h.qp_num});
    ++static_cast<Qp*>(h.impl)->destroys;
    if (auto f = Take("DestroyQp")) return *f;
    return {};
  }
  sdk::Status PostSend(QpHandle h, std::span<const SendWr> wrs, size_t* accepted) override {
    Call c{"PostSend", h.qp_num};
    c.wrs.assign(wrs.begin(), wrs.end());
    Record(c);
    *accepted = 0;
    Qp& qp = *static_cast<Qp*>(h.impl);
    auto it = fail_.find("PostSend");
    if (it != fail_.end()) {
      const Fault f = it->second;
      fail_.erase(it);
      for (size_t i = 0; i < f.accept && i < wrs.size(); ++i) Take(qp, wrs[i]);
      *accepted = f.accept;
      return f.status;
    }
    if (qp.state != QpState::kRts) {
      return sdk::Status(KVB_ERR_INVALID_ARGUMENT, "ibv_post_send: QP not in RTS (fake)");
    }
    for (const SendWr& w : wrs) Take(qp, w);
    *accepted = wrs.size();
    return {};
  }
  sdk::Result<size_t> PollCq(CqHandle h, std::span<Completion> out) override {
    ++polls;
    if (auto f = Take("PollCq")) return *f;
    Cq& cq = *static_cast<Cq*>(h.impl);
    size_t n = 0;
    while (n < out.size() && !cq.queue.empty()) {
      out[n++] = cq.queue.front();
      cq.queue.pop_front();
    }
    return n;
  }
  sdk::Result<PortAttr> QueryPort(DeviceHandle, uint8_t port) override {
    Record({"QueryPort"});
    if (auto f = Take("QueryPort")) return *f;
    return PortAttr{PortState::kActive, 7, 4096, false, 16};
  }
  sdk::Result<Gid> QueryGid(DeviceHandle, uint8_t, int) override {
    Record({"QueryGid"});
    if (auto f = Take("QueryGid")) return *f;
    return Gid{};
  }

 private:
  struct Fault {
    sdk::Status status;
    size_t accept = 0;
  };

  void Record(Call c) { calls.push_back(std::move(c)); }
  std::optional<sdk::Status> Take(const std::string& name) {
    auto it = fail_.find(name);
    if (it == fail_.end()) return std::nullopt;
    sdk::Status st = it->second.status;
    fail_.erase(it);
    return st;
  }
  void Take(Qp& qp, const SendWr& w) {
    qp.pending.push_back(w.wr_id);
    posted_.push_back(w.wr_id);
  }
  sdk::Status Simple(const std::string& name) {
    Record({name});
    if (auto f = Take(name)) return *f;
    return {};
  }
  sdk::Status Transition(Call c, QpHandle h, QpState from, QpState to) {
    const std::string name = c.name;
    Record(std::move(c));
    if (auto f = Take(name)) return *f;
    Qp& qp = *static_cast<Qp*>(h.impl);
    if (qp.state != from) {
      return sdk::Status(KVB_ERR_INVALID_ARGUMENT, name + ": illegal transition (fake)");
    }
    qp.state = to;
    return {};
  }
  void Flush(Qp& qp) {
    qp.state = QpState::kErr;
    for (uint64_t id : qp.pending) {
      qp.cq->queue.push_back(Completion{id, WcStatus::kWrFlushErr, 0, WcOpcode::kOther, 0});
    }
    qp.pending.clear();
  }

  std::deque<Cq> cqs_;
  std::deque<Qp> qps_;
  std::map<std::string, Fault> fail_;
  std::vector<uint64_t> posted_;
};

const Gid kRemoteGid = {0xfe, 0x80, 0,    0,    0,    0,    0,    0,
                        0x02, 0x11, 0x22, 0xff, 0xfe, 0x33, 0x44, 0x55};
const Gid kLocalGid = {0xfe, 0x80, 0,    0,    0,    0,    0,    0,
                       0x02, 0x66, 0x77, 0xff, 0xfe, 0x88, 0x99, 0xaa};

LocalPortInfo RocePort() {
  LocalPortInfo l;
  l.port = 2;
  l.ethernet = true;
  l.gid = kLocalGid;
  l.gid_index = 3;
  l.active_mtu = 4096;
  return l;
}

LocalPortInfo IbPort() {
  LocalPortInfo l;
  l.port = 1;
  l.ethernet = false;
  l.lid = 11;
  l.active_mtu = 2048;
  return l;
}

RemoteQpInfo Remote(uint64_t incarnation = 7) {
  RemoteQpInfo r;
  r.node_id = "node-b";
  r.incarnation = incarnation;
  r.qp_num = 0x1234;
  r.psn = 0xabcde;
  r.lid = 42;
  r.gid = kRemoteGid;
  r.mtu = 1024;
  return r;
}

RdmaOp Op(uint64_t cookie, WrOpcode opcode = WrOpcode::kRdmaWrite, uint64_t deadline = 0) {
  RdmaOp op;
  op.cookie = cookie;
  op.opcode = opcode;
  op.local_addr = 0x10000 + cookie * 0x1000;
  op.lkey = 0x11;
  op.remote_addr = 0x900000 + cookie * 0x1000;
  op.rkey = 0x22;
  op.length = 4096;
  op.deadline_ns = deadline;
  return op;
}

class RcTest : public ::testing::Test {
 protected:
  std::unique_ptr<RcConnection> Make(RcOptions o = Options()) {
    auto made = RcConnection::Create(fake_, DeviceHandle{&fake_}, PdHandle{&fake_},
                                     PeerIncarnation{"node-b", 7}, o);
    EXPECT_TRUE(made.ok()) << made.status().message();
    return made.ok() ? std::move(*made) : nullptr;
  }
  std::unique_ptr<RcConnection> Connected(RcOptions o = Options()) {
    auto c = Make(o);
    if (c == nullptr) return nullptr;
    const sdk::Status st = c->Connect(RocePort(), Remote());
    EXPECT_TRUE(st.ok()) << st.message();
    return c;
  }
  static RcOptions Options() {
    RcOptions o;
    o.max_outstanding = 4;
    o.max_sge = 2;
    o.local_psn = 0x54321;
    o.timeout = 15;
    o.retry_cnt = 6;
    o.rnr_retry = 5;
    o.max_rd_atomic = 8;
    o.max_dest_rd_atomic = 9;
    o.poll_batch = 2;  // small, so Poll loops over several ibv_poll_cq
    return o;
  }
  std::vector<OpEnd> Poll(RcConnection& c, uint64_t now) {
    std::vector<OpEnd> out;
    const size_t n = c.Poll(now, &out);
    EXPECT_EQ(n, out.size());
    return out;
  }
  // Posts `ops` and expects OK; returns the wr_ids they got.
  std::vector<uint64_t> PostOk(RcConnection& c, std::vector<RdmaOp> ops, uint64_t now = 0) {
    const size_t before = fake_.Posted().size();
    size_t accepted = 99;
    const sdk::Status st = c.Post(ops, now, &accepted);
    EXPECT_TRUE(st.ok()) << st.message();
    EXPECT_EQ(accepted, ops.size());
    const auto all = fake_.Posted();
    return std::vector<uint64_t>(all.begin() + static_cast<long>(before), all.end());
  }

  FakeVerbs fake_;
};

// ---- the modify sequence ----------------------------------------------------------------------

TEST_F(RcTest, RoceConnectDrivesInitRtrRtsWithGidPath) {
  auto c = Make();
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->state(), RcState::kReset);
  EXPECT_EQ(c->qp_num(), fake_.qp().qp_num);
  EXPECT_EQ(c->local_psn(), 0x54321u);
  ASSERT_TRUE(c->Connect(RocePort(), Remote()).ok());
  EXPECT_EQ(c->state(), RcState::kRts);
  EXPECT_EQ(fake_.qp().state, FakeVerbs::QpState::kRts);
  EXPECT_EQ(fake_.Names(), (std::vector<std::string>{"CreateCq", "CreateRcQp", "ModifyQpToInit",
                                                     "ModifyQpToRtr", "ModifyQpToRts"}));
  EXPECT_EQ(fake_.Last("CreateCq")->depth, 4u);
  EXPECT_EQ(fake_.Last("CreateRcQp")->caps.max_send_wr, 4u);
  EXPECT_EQ(fake_.Last("CreateRcQp")->caps.max_send_sge, 2u);

  const InitAttr& init = fake_.Last("ModifyQpToInit")->init;
  EXPECT_EQ(init.port, 2);
  EXPECT_EQ(init.access, kAccessLocalWrite | kAccessRemoteRead | kAccessRemoteWrite);

  const RtrAttr& rtr = fake_.Last("ModifyQpToRtr")->rtr;
  EXPECT_EQ(rtr.dest_qp_num, 0x1234u);
  EXPECT_EQ(rtr.rq_psn, 0xabcdeu);
  EXPECT_TRUE(rtr.path.global);
  EXPECT_EQ(rtr.path.dgid, kRemoteGid);
  EXPECT_EQ(rtr.path.sgid_index, 3);
  EXPECT_EQ(rtr.path.port, 2);
  EXPECT_EQ(rtr.path.dlid, 0);
  EXPECT_EQ(rtr.path_mtu, 1024u);  // min(local 4096, remote 1024)
  EXPECT_EQ(rtr.max_dest_rd_atomic, 9);

  const RtsAttr& rts = fake_.Last("ModifyQpToRts")->rts;
  EXPECT_EQ(rts.sq_psn, 0x54321u);
  EXPECT_EQ(rts.timeout, 15);
  EXPECT_EQ(rts.retry_cnt, 6);
  EXPECT_EQ(rts.rnr_retry, 5);
  EXPECT_EQ(rts.max_rd_atomic, 8);
  for (const auto& call : fake_.calls) {
    if (call.name.rfind("Modify", 0) == 0) {
      EXPECT_EQ(call.qp_num, c->qp_num()) << call.name;
    }
  }
}

TEST_F(RcTest, InfiniBandConnectUsesLidPathWithoutGrh) {
  auto c = Make();
  ASSERT_NE(c, nullptr);
  RemoteQpInfo r = Remote();
  r.mtu = 4096;
  ASSERT_TRUE(c->Connect(IbPort(), r).ok());
  EXPECT_EQ(c->state(), RcState::kRts);
  const RtrAttr& rtr = fake_.Last("ModifyQpToRtr")->rtr;
  EXPECT_FALSE(rtr.path.global);
  EXPECT_EQ(rtr.path.dlid, 42);
  EXPECT_EQ(rtr.path.dgid, Gid{});
  EXPECT_EQ(rtr.path.port, 1);
  EXPECT_EQ(rtr.path_mtu, 2048u);  // min(local 2048, remote 4096)
  EXPECT_EQ(fake_.Last("ModifyQpToInit")->init.port, 1);
}

class FailedModifyTest : public RcTest, public ::testing::WithParamInterface<const char*> {};

TEST_P(FailedModifyTest, LeavesErrorNamingTheCall) {
  const std::string which = GetParam();  // "INIT", "RTR" or "RTS"
  auto c = Make();
  ASSERT_NE(c, nullptr);
  fake_.FailNext("ModifyQpTo" + std::string(which == "INIT"  ? "Init"
                                            : which == "RTR" ? "Rtr"
                                                             : "Rts"),
                 KVB_ERR_INVALID_ARGUMENT,
                 "ibv_modify_qp(" + which + ") on QP 101: Invalid argument");
  const sdk::Status st = c->Connect(RocePort(), Remote());
  EXPECT_EQ(st.code(), KVB_ERR_INVALID_ARGUMENT);
  EXPECT_NE(st.message().find("ibv_modify_qp(" + which + ")"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("node-b incarnation 7"), std::string::npos) << st.message();
  EXPECT_EQ(c->state(), RcState::kError);
  EXPECT_EQ(c->first_error().message(), st.message());
  EXPECT_EQ(fake_.Count("ModifyQpToErr"), 1);
  EXPECT_EQ(fake_.qp().state, FakeVerbs::QpState::kErr);
  // The modifies after the failed one were not attempted.
  EXPECT_EQ(fake_.Count("ModifyQpToRts"), which == "RTS" ? 1 : 0);
  // Evicted: never posts.
  const RdmaOp op = Op(1);
  const sdk::Status post = c->Post({&op, 1}, 0);
  EXPECT_EQ(post.code(), KVB_ERR_PEER_UNREACHABLE);
  EXPECT_EQ(fake_.Count("PostSend"), 0);
  EXPECT_EQ(c->Connect(RocePort(), Remote()).code(), KVB_ERR_INTERNAL);
}

INSTANTIATE_TEST_SUITE_P(EachModify, FailedModifyTest, ::testing::Values("INIT", "RTR", "RTS"));

TEST_F(RcTest, StaleIncarnationIsRefusedBeforeAnyModify) {
  auto c = Make();
  ASSERT_NE(c, nullptr);
  const sdk::Status st = c->Connect(RocePort(), Remote(/*incarnation=*/8));
  EXPECT_EQ(st.code(), KVB_ERR_STALE_PEER);
  EXPECT_NE(st.message().find("incarnation 8"), std::string::npos) << st.message();
  RemoteQpInfo other = Remote();
  other.node_id = "node-c";
  EXPECT_EQ(c->Connect(RocePort(), other).code(), KVB_ERR_STALE_PEER);
  EXPECT_EQ(fake_.Names(), (std::vector<std::string>{"CreateCq", "CreateRcQp"}));
  EXPECT_EQ(c->state(), RcState::kReset);
  EXPECT_EQ(fake_.qp().state, FakeVerbs::QpState::kReset);
  // Nothing can be posted on it either.
  const RdmaOp op = Op(1);
  EXPECT_EQ(c->Post({&op, 1}, 0).code(), KVB_ERR_INTERNAL);
  EXPECT_EQ(fake_.Count("PostSend"), 0);
  // The incarnation it was made for still connects.
  EXPECT_TRUE(c->Connect(RocePort(), Remote()).ok());
}

TEST_F(RcTest, UnusablePathIsRefusedBeforeAnyModify) {
  auto c = Make();
  ASSERT_NE(c, nullptr);
  RemoteQpInfo no_gid = Remote();
  no_gid.gid = Gid{};
  EXPECT_EQ(c->Connect(RocePort(), no_gid).code(), KVB_ERR_INVALID_ARGUMENT);
  RemoteQpInfo no_lid = Remote();
  no_lid.lid = 0;
  EXPECT_EQ(c->Connect(IbPort(), no_lid).code(), KVB_ERR_INVALID_ARGUMENT);
  RemoteQpInfo bad_mtu = Remote();
  bad_mtu.mtu = 1500;
  EXPECT_EQ(c->Connect(RocePort(), bad_mtu).code(), KVB_ERR_INVALID_ARGUMENT);
  RemoteQpInfo bad_psn = Remote();
  bad_psn.psn = 1u << 24;
  EXPECT_EQ(c->Connect(RocePort(), bad_psn).code(), KVB_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(fake_.Count("ModifyQpToInit"), 0);
  EXPECT_EQ(c->state(), RcState::kReset);
}

TEST_F(RcTest, CreateRefusesBadOptionsAndCleansUpAFailedQp) {
  RcOptions o = Options();
  o.max_outstanding = 0;
  EXPECT_EQ(RcConnection::Create(fake_, {}, {}, {"node-b", 7}, o).status().code(),
            KVB_ERR_INVALID_ARGUMENT);
  o = Options();
  o.local_psn = 1u << 24;
  EXPECT_EQ(RcConnection::Create(fake_, {}, {}, {"node-b", 7}, o).status().code(),
            KVB_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(fake_.calls.empty());

  fake_.FailNext("CreateRcQp", KVB_ERR_NO_SPACE, "ibv_create_qp(RC, ...): Cannot allocate memory");
  auto made = RcConnection::Create(fake_, {}, {}, {"node-b", 7}, Options());
  EXPECT_EQ(made.status().code(), KVB_ERR_NO_SPACE);
  EXPECT_NE(made.status().message().find("ibv_create_qp"), std::string::npos);
  EXPECT_EQ(fake_.Names(), (std::vector<std::string>{"CreateCq", "CreateRcQp", "DestroyCq"}));
  EXPECT_EQ(fake_.cq().destroys, 1);
}

// ---- posting ----------------------------------------------------------------------------------

TEST_F(RcTest, PostSignalsEveryWorkRequestWithItsOwnWrId) {
  auto c = Connected();
  ASSERT_NE(c, nullptr);
  const auto ids = PostOk(*c, {Op(1, WrOpcode::kRdmaWrite), Op(2, WrOpcode::kRdmaRead)});
  ASSERT_EQ(ids.size(), 2u);
  EXPECT_NE(ids[0], ids[1]);
  const auto& wrs = fake_.Last("PostSend")->wrs;
  ASSERT_EQ(wrs.size(), 2u);
  EXPECT_EQ(wrs[0].opcode, WrOpcode::kRdmaWrite);
  EXPECT_EQ(wrs[1].opcode, WrOpcode::kRdmaRead);
  for (size_t i = 0; i < 2; ++i) {
    const RdmaOp op = Op(i + 1);
    EXPECT_TRUE(wrs[i].signaled);
    EXPECT_EQ(wrs[i].local_addr, op.local_addr);
    EXPECT_EQ(wrs[i].lkey, op.lkey);
    EXPECT_EQ(wrs[i].remote_addr, op.remote_addr);
    EXPECT_EQ(wrs[i].rkey, op.rkey);
    EXPECT_EQ(wrs[i].length, op.length);
  }
  EXPECT_EQ(c->outstanding(), 2u);
}

TEST_F(RcTest, PostBeyondMaxOutstandingIsBackpressureWithNothingPosted) {
  auto c = Connected();  // max_outstanding 4
  ASSERT_NE(c, nullptr);
  const auto ids = PostOk(*c, {Op(1), Op(2), Op(3)});
  const std::vector<RdmaOp> two = {Op(4), Op(5)};
  size_t accepted = 99;
  const sdk::Status st = c->Post(two, 0, &accepted);
  EXPECT_EQ(st.code(), KVB_ERR_BACKPRESSURE);
  EXPECT_NE(st.message().find("max_outstanding 4"), std::string::npos) << st.message();
  EXPECT_EQ(accepted, 0u);
  EXPECT_EQ(fake_.Count("PostSend"), 1);
  EXPECT_EQ(c->outstanding(), 3u);
  EXPECT_EQ(c->state(), RcState::kRts);

  PostOk(*c, {Op(4)});  // exactly to the bound
  const RdmaOp fifth = Op(5);
  EXPECT_EQ(c->Post({&fifth, 1}, 0).code(), KVB_ERR_BACKPRESSURE);
  EXPECT_EQ(fake_.Count("PostSend"), 2);

  fake_.Complete(ids[0]);
  EXPECT_EQ(Poll(*c, 1).size(), 1u);
  PostOk(*c, {Op(5)});  // room again
  EXPECT_EQ(c->outstanding(), 4u);
}

TEST_F(RcTest, MalformedOpOrWrongStateIsRefusedWithNothingPosted) {
  auto c = Make();
  ASSERT_NE(c, nullptr);
  const RdmaOp ok = Op(1);
  EXPECT_EQ(c->Post({&ok, 1}, 0).code(), KVB_ERR_INTERNAL);  // not connected
  ASSERT_TRUE(c->Connect(RocePort(), Remote()).ok());
  RdmaOp zero = Op(2);
  zero.length = 0;
  const std::vector<RdmaOp> batch = {ok, zero};
  const sdk::Status st = c->Post(batch, 0);
  EXPECT_EQ(st.code(), KVB_ERR_INVALID_ARGUMENT);
  EXPECT_NE(st.message().find("op 1: length is 0"), std::string::npos) << st.message();
  EXPECT_EQ(fake_.Count("PostSend"), 0);
  EXPECT_EQ(c->outstanding(), 0u);
  EXPECT_EQ(c->state(), RcState::kRts);
}

// ---- completions ------------------------------------------------------------------------------

TEST_F(RcTest, CompletionsInOrderEndOpsOk) {
  auto c = Connected();
  ASSERT_NE(c, nullptr);
  const auto ids = PostOk(*c, {Op(1), Op(2), Op(3)});
  EXPECT_TRUE(Poll(*c, 10).empty());
  for (uint64_t id : ids) fake_.Complete(id);
  const auto ended = Poll(*c, 20);  // poll_batch 2: two ibv_poll_cq rounds
  ASSERT_EQ(ended.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(ended[i].cookie, i + 1);
    EXPECT_EQ(ended[i].wr_id, ids[i]);
    EXPECT_TRUE(ended[i].status.ok()) << ended[i].status.message();
    EXPECT_FALSE(ended[i].flushed);
  }
  EXPECT_EQ(c->outstanding(), 0u);
  EXPECT_TRUE(Poll(*c, 30).empty());
  EXPECT_EQ(c->state(), RcState::kRts);
}

TEST_F(RcTest, CompletionsOutOfOrderEndTheirOwnOps) {
  auto c = Connected();
  ASSERT_NE(c, nullptr);
  const auto ids = PostOk(*c, {Op(1), Op(2), Op(3)});
  fake_.Complete(ids[2]);
  auto ended = Poll(*c, 10);
  ASSERT_EQ(ended.size(), 1u);
  EXPECT_EQ(ended[0].cookie, 3u);
  EXPECT_EQ(c->outstanding(), 2u);
  fake_.Complete(ids[0]);
  fake_.Complete(ids[1]);
  ended = Poll(*c, 20);
  ASSERT_EQ(ended.size(), 2u);
  EXPECT_EQ(ended[0].cookie, 1u);
  EXPECT_EQ(ended[1].cookie, 2u);
  EXPECT_TRUE(ended[0].status.ok() && ended[1].status.ok());
}

TEST_F(RcTest, ErrorCompletionFailsItsOpFlushesTheRestAndEvicts) {
  auto c = Connected();
  ASSERT_NE(c, nullptr);
  const auto ids = PostOk(*c, {Op(1), Op(2), Op(3), Op(4)});
  fake_.Complete(ids[0]);
  // The NIC fails op 2, moves the QP to ERR and flushes 3 and 4 after it.
  fake_.Complete(ids[1], WcStatus::kRemAccessErr, 0x88);
  const auto ended = Poll(*c, 10);
  ASSERT_EQ(ended.size(), 4u);
  EXPECT_EQ(ended[0].cookie, 1u);
  EXPECT_TRUE(ended[0].status.ok());
  EXPECT_EQ(ended[1].cookie, 2u);
  EXPECT_EQ(ended[1].status.code(), KVB_ERR_NOT_REGISTERED);
  EXPECT_FALSE(ended[1].flushed);
  const std::string& msg = ended[1].status.message();
  EXPECT_NE(msg.find("remote access error"), std::string::npos) << msg;
  EXPECT_NE(msg.find("vendor error 0x88"), std::string::npos) << msg;
  EXPECT_NE(msg.find("RDMA WRITE of 4096 bytes"), std::string::npos) << msg;
  EXPECT_NE(msg.find("node-b incarnation 7 QP 4660"), std::string::npos) << msg;
  for (size_t i = 2; i < 4; ++i) {
    EXPECT_EQ(ended[i].cookie, i + 1);
    EXPECT_EQ(ended[i].status.code(), KVB_ERR_NOT_REGISTERED) << "flushed with the first error";
    EXPECT_TRUE(ended[i].flushed);
    EXPECT_NE(ended[i].status.message().find("flushed"), std::string::npos);
  }
  EXPECT_EQ(c->state(), RcState::kError);
  EXPECT_EQ(c->first_error().code(), KVB_ERR_NOT_REGISTERED);
  EXPECT_EQ(fake_.Count("ModifyQpToErr"), 1);
  EXPECT_EQ(c->outstanding(), 0u);
  // Later flushes and polls report nothing twice; posts are refused.
  EXPECT_TRUE(Poll(*c, 20).empty());
  const RdmaOp op = Op(5);
  const sdk::Status st = c->Post({&op, 1}, 30);
  EXPECT_EQ(st.code(), KVB_ERR_PEER_UNREACHABLE);
  EXPECT_NE(st.message().find("remote access error"), std::string::npos) << st.message();
  EXPECT_EQ(fake_.Count("PostSend"), 1);
}

struct Mapping {
  WcStatus status;
  kvb_status_t code;
};

void PrintTo(const Mapping& m, std::ostream* os) {
  *os << WcStatusString(m.status) << " -> " << m.code;
}

class CompletionMappingTest : public RcTest, public ::testing::WithParamInterface<Mapping> {};

TEST_P(CompletionMappingTest, ErrorCompletionMapsToItsCode) {
  auto c = Connected();
  ASSERT_NE(c, nullptr);
  const auto ids = PostOk(*c, {Op(1), Op(2)});
  fake_.Complete(ids[0], GetParam().status);
  const auto ended = Poll(*c, 10);
  ASSERT_EQ(ended.size(), 2u);
  EXPECT_EQ(ended[0].status.code(), GetParam().code) << ended[0].status.message();
  EXPECT_NE(ended[0].status.message().find(WcStatusString(GetParam().status)), std::string::npos);
  EXPECT_EQ(ended[1].status.code(), GetParam().code);
  EXPECT_TRUE(ended[1].flushed);
  EXPECT_EQ(c->state(), RcState::kError);
  EXPECT_EQ(MapCompletionStatus(GetParam().status), GetParam().code);
}

INSTANTIATE_TEST_SUITE_P(
    Statuses, CompletionMappingTest,
    ::testing::Values(Mapping{WcStatus::kRemAccessErr, KVB_ERR_NOT_REGISTERED},
                      Mapping{WcStatus::kLocProtErr, KVB_ERR_NOT_REGISTERED},
                      Mapping{WcStatus::kRetryExcErr, KVB_ERR_PEER_UNREACHABLE},
                      Mapping{WcStatus::kRnrRetryExcErr, KVB_ERR_PEER_UNREACHABLE},
                      Mapping{WcStatus::kWrFlushErr, KVB_ERR_PEER_UNREACHABLE},
                      Mapping{WcStatus::kRemInvReqErr, KVB_ERR_PROTOCOL},
                      Mapping{WcStatus::kLocLenErr, KVB_ERR_INVALID_ARGUMENT},
                      Mapping{WcStatus::kRemOpErr, KVB_ERR_IO},
                      Mapping{WcStatus::kGeneralErr, KVB_ERR_IO}));

TEST_F(RcTest, RetryExceededIsPeerUnreachable) {
  auto c = Connected();
  ASSERT_NE(c, nullptr);
  const auto ids = PostOk(*c, {Op(1, WrOpcode::kRdmaRead)});
  fake_.Complete(ids[0], WcStatus::kRetryExcErr);
  const auto ended = Poll(*c, 10);
  ASSERT_EQ(ended.size(), 1u);
  EXPECT_EQ(ended[0].status.code(), KVB_ERR_PEER_UNREACHABLE);
  EXPECT_NE(ended[0].status.message().find("transport retry counter exceeded"), std::string::npos);
  EXPECT_NE(ended[0].status.message().find("RDMA READ"), std::string::npos);
}

TEST_F(RcTest, FailedPostEvictsAndReportsOnlyWhatTheQpTook) {
  auto c = Connected();
  ASSERT_NE(c, nullptr);
  fake_.FailNext("PostSend", KVB_ERR_NO_SPACE, "ibv_post_send on QP 101: Cannot allocate memory",
                 /*accept=*/1);
  const std::vector<RdmaOp> ops = {Op(1), Op(2), Op(3)};
  size_t accepted = 99;
  const sdk::Status st = c->Post(ops, 5, &accepted);
  EXPECT_EQ(st.code(), KVB_ERR_NO_SPACE);
  EXPECT_NE(st.message().find("ibv_post_send"), std::string::npos) << st.message();
  EXPECT_EQ(accepted, 1u);
  EXPECT_EQ(c->state(), RcState::kError);
  EXPECT_EQ(fake_.Count("ModifyQpToErr"), 1);
  const auto ended = Poll(*c, 6);
  ASSERT_EQ(ended.size(), 1u);  // op 1 (taken); ops 2 and 3 were never posted
  EXPECT_EQ(ended[0].cookie, 1u);
  EXPECT_EQ(ended[0].status.code(), KVB_ERR_NO_SPACE);
  EXPECT_TRUE(Poll(*c, 7).empty());
}

TEST_F(RcTest, FailedPollEvicts) {
  auto c = Connected();
  ASSERT_NE(c, nullptr);
  PostOk(*c, {Op(1)});
  fake_.FailNext("PollCq", KVB_ERR_IO, "ibv_poll_cq: failed (returned -1)");
  const auto ended = Poll(*c, 10);
  ASSERT_EQ(ended.size(), 1u);
  EXPECT_EQ(ended[0].status.code(), KVB_ERR_IO);
  EXPECT_NE(ended[0].status.message().find("ibv_poll_cq"), std::string::npos);
  EXPECT_EQ(c->state(), RcState::kError);
}

TEST_F(RcTest, CompletionForUnknownWrIdEvicts) {
  auto c = Connected();
  ASSERT_NE(c, nullptr);
  PostOk(*c, {Op(1)});
  fake_.Stray(999);
  const auto ended = Poll(*c, 10);
  ASSERT_EQ(ended.size(), 1u);
  EXPECT_EQ(ended[0].status.code(), KVB_ERR_INTERNAL);
  EXPECT_NE(c->first_error().message().find("wr_id 999"), std::string::npos);
}

// ---- deadlines and the progress timeout -------------------------------------------------------

TEST_F(RcTest, ProgressTimeoutFailsEveryOutstandingOp) {
  RcOptions o = Options();
  o.progress_timeout_ns = 1000;
  auto c = Connected(o);
  ASSERT_NE(c, nullptr);
  // Idle: no work outstanding, no timeout however long.
  EXPECT_TRUE(Poll(*c, 1'000'000).empty());
  EXPECT_EQ(c->state(), RcState::kRts);

  const auto ids = PostOk(*c, {Op(1), Op(2), Op(3)}, /*now=*/2'000'000);
  EXPECT_TRUE(Poll(*c, 2'000'999).empty());
  fake_.Complete(ids[0]);
  ASSERT_EQ(Poll(*c, 2'000'500).size(), 1u);  // a completion restarts the clock at 2'000'500
  EXPECT_TRUE(Poll(*c, 2'001'499).empty());
  EXPECT_EQ(c->state(), RcState::kRts);
  const auto ended = Poll(*c, 2'001'500);
  ASSERT_EQ(ended.size(), 2u);
  for (const auto& e : ended) {
    EXPECT_EQ(e.status.code(), KVB_ERR_PROGRESS_TIMEOUT) << e.status.message();
    EXPECT_FALSE(e.flushed);
    EXPECT_NE(e.status.message().find("no completion for 1000 ns"), std::string::npos)
        << e.status.message();
  }
  EXPECT_EQ(c->state(), RcState::kError);
  EXPECT_EQ(c->first_error().code(), KVB_ERR_PROGRESS_TIMEOUT);
  EXPECT_EQ(fake_.Count("ModifyQpToErr"), 1);
  // The flushes the fake generated for 2 and 3 are consumed silently.
  EXPECT_TRUE(Poll(*c, 2'002'000).empty());
  EXPECT_TRUE(fake_.cq().queue.empty());
}

TEST_F(RcTest, DeadlineFailsItsOpAndFlushesTheOthers) {
  auto c = Connected();
  ASSERT_NE(c, nullptr);
  const auto ids = PostOk(*c,
                          {Op(1, WrOpcode::kRdmaRead, /*deadline=*/5000), Op(2),
                           Op(3, WrOpcode::kRdmaWrite, /*deadline=*/9000)},
                          /*now=*/100);
  EXPECT_TRUE(Poll(*c, 4999).empty());
  const auto ended = Poll(*c, 5000);
  ASSERT_EQ(ended.size(), 3u);
  EXPECT_EQ(ended[0].cookie, 1u);
  EXPECT_EQ(ended[0].status.code(), KVB_ERR_DEADLINE_EXCEEDED);
  EXPECT_FALSE(ended[0].flushed);
  EXPECT_NE(ended[0].status.message().find("passed its deadline"), std::string::npos);
  for (size_t i = 1; i < 3; ++i) {
    EXPECT_EQ(ended[i].status.code(), KVB_ERR_DEADLINE_EXCEEDED);
    EXPECT_TRUE(ended[i].flushed) << "op " << ended[i].cookie << " had its own deadline ahead";
  }
  EXPECT_EQ(c->state(), RcState::kError);
  EXPECT_EQ(fake_.qp().state, FakeVerbs::QpState::kErr);
}

TEST_F(RcTest, CompletionThatArrivedBeforeTheDeadlineCountsWhenPolledLate) {
  auto c = Connected();
  ASSERT_NE(c, nullptr);
  const auto ids = PostOk(*c, {Op(1, WrOpcode::kRdmaWrite, /*deadline=*/5000)}, 100);
  fake_.Complete(ids[0]);
  const auto ended = Poll(*c, 9000);
  ASSERT_EQ(ended.size(), 1u);
  EXPECT_TRUE(ended[0].status.ok()) << ended[0].status.message();
  EXPECT_EQ(c->state(), RcState::kRts);
}

// ---- Close ------------------------------------------------------------------------------------

TEST_F(RcTest, CloseDestroysTheQpOnceAndCancelsWhatIsOutstanding) {
  auto c = Connected();
  ASSERT_NE(c, nullptr);
  PostOk(*c, {Op(1), Op(2)});
  std::vector<OpEnd> ended;
  EXPECT_TRUE(c->Close(&ended).ok());
  EXPECT_EQ(c->state(), RcState::kClosed);
  ASSERT_EQ(ended.size(), 2u);
  for (const auto& e : ended) EXPECT_EQ(e.status.code(), KVB_ERR_CANCELLED);
  EXPECT_EQ(fake_.qp().destroys, 1);
  EXPECT_EQ(fake_.cq().destroys, 1);
  const auto names = fake_.Names();
  ASSERT_GE(names.size(), 2u);
  EXPECT_EQ(names[names.size() - 2], "DestroyQp");  // the QP before its CQ
  EXPECT_EQ(names.back(), "DestroyCq");
  EXPECT_TRUE(c->Close(&ended).ok());
  const RdmaOp op = Op(3);
  EXPECT_EQ(c->Post({&op, 1}, 0).code(), KVB_ERR_CANCELLED);
  EXPECT_TRUE(Poll(*c, 1).empty());
  c.reset();
  EXPECT_EQ(fake_.qp().destroys, 1);
  EXPECT_EQ(fake_.cq().destroys, 1);
  EXPECT_EQ(fake_.Count("PostSend"), 1);
}

TEST_F(RcTest, DestructorClosesOnceAfterEviction) {
  auto c = Connected();
  ASSERT_NE(c, nullptr);
  const auto ids = PostOk(*c, {Op(1)});
  fake_.Complete(ids[0], WcStatus::kRetryExcErr);
  ASSERT_EQ(Poll(*c, 1).size(), 1u);
  c.reset();
  EXPECT_EQ(fake_.qp().destroys, 1);
  EXPECT_EQ(fake_.cq().destroys, 1);
}

TEST_F(RcTest, CloseReportsADestroyFailureNamingTheCall) {
  auto c = Connected();
  ASSERT_NE(c, nullptr);
  fake_.FailNext("DestroyQp", KVB_ERR_IO, "ibv_destroy_qp on QP 101: Device or resource busy");
  const sdk::Status st = c->Close();
  EXPECT_EQ(st.code(), KVB_ERR_IO);
  EXPECT_NE(st.message().find("ibv_destroy_qp"), std::string::npos);
  EXPECT_EQ(c->state(), RcState::kClosed);
  EXPECT_EQ(fake_.cq().destroys, 1);
  c.reset();
  EXPECT_EQ(fake_.qp().destroys, 1);
}

TEST(WcStatusString, MatchesLibibverbsWording) {
  EXPECT_STREQ(WcStatusString(WcStatus::kSuccess), "success");
  EXPECT_STREQ(WcStatusString(WcStatus::kWrFlushErr), "Work Request Flushed Error");
  EXPECT_STREQ(WcStatusString(WcStatus::kRemAccessErr), "remote access error");
  EXPECT_STREQ(WcStatusString(WcStatus::kTmRndvIncomplete), "TM software rendezvous");
  EXPECT_STREQ(WcStatusString(static_cast<WcStatus>(99)), "unknown");
}

}  // namespace
}  // namespace kvbridge::verbs
