#include "tests/nccl/nccl_test_util.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include "tests/nccl/fake_nccl.h"

namespace kvbridge::nccl::test {

std::unique_ptr<Node> Node::Make(const Options& o, sdk::Status* err) {
  return MakeWith(o, fake::FakeNccl(), fake::FakeCuda(), err);
}

std::unique_ptr<Node> Node::MakeWith(const Options& o, const Nccl* nccl, const CudaOps* cuda,
                                     sdk::Status* err) {
  auto n = std::unique_ptr<Node>(new Node);
  n->o_ = o;
  Node* raw = n.get();
  n->host_ = std::make_unique<core::HostServices>(
      o.config, core::auth::Identity{o.node_id, o.incarnation, o.token},
      [raw, name = o.node_id](int32_t level, const char* plugin, const char* msg) {
        const std::string line =
            std::string("[") + plugin + " " + name + " L" + std::to_string(level) + "] " + msg;
        if (level >= KVB_LOG_WARN || getenv("KVBTEST_NCCL_DEBUG"))
          fprintf(stderr, "%s\n", line.c_str());
        std::lock_guard<std::mutex> lock(raw->mu_);
        raw->logs_.push_back(line);
      });
  kvb_transport_params_t params{};
  params.struct_size = sizeof(params);
  params.node_id = o.node_id.c_str();
  params.incarnation = o.incarnation;
  params.listen = o.listen.c_str();
  params.cluster_token = o.token.c_str();
  auto t =
      Transport::CreateWith(sdk::Host(n->host_->table(), Transport::kName), params, nccl, cuda);
  if (!t.ok()) {
    if (err != nullptr) *err = t.status();
    return nullptr;
  }
  n->t_ = std::move(t).value();
  return n;
}

Node::~Node() { t_.reset(); }

bool Node::LogContains(const std::string& needle) const {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& l : logs_) {
    if (l.find(needle) != std::string::npos) return true;
  }
  return false;
}

std::string Node::Logs() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::string out;
  for (const auto& l : logs_) out += l + "\n";
  return out;
}

uint64_t Node::NowNs() const { return host_->table()->now_ns(host_->table()->host_ctx); }

sdk::Status Node::Register(uint64_t segment, void* addr, uint64_t len, uint32_t mem_kind,
                           int32_t device) {
  kvb_region_t r{};
  r.struct_size = sizeof(r);
  r.mem_kind = mem_kind;
  r.segment_id = segment;
  r.addr = addr;
  r.length = len;
  r.device_id = device;
  uint8_t key[64];
  uint32_t key_len = 0;
  sdk::RkeyBuffer buf(key, sizeof(key), &key_len);
  sdk::Status st = t_->RegisterMemory(sdk::Region::From(&r), buf);
  if (st.ok()) segments_.emplace_back(segment, len);
  return st;
}

Peer* Node::AddPeer(const Node& other, std::vector<std::pair<uint64_t, uint64_t>> segments,
                    uint64_t incarnation) {
  if (segments.empty()) segments = other.segments_;
  std::vector<kvb_peer_segment_t> segs;
  for (auto [id, len] : segments) {
    kvb_peer_segment_t s{};
    s.struct_size = sizeof(s);
    s.mem_kind = KVB_MEM_CUDA;
    s.segment_id = id;
    s.length = len;
    segs.push_back(s);
  }
  const std::string ep = other.t_->Endpoints();
  kvb_peer_info_t info{};
  info.struct_size = sizeof(info);
  info.node_id = other.o_.node_id.c_str();
  info.incarnation = incarnation != 0 ? incarnation : other.o_.incarnation;
  info.endpoints = ep.c_str();
  info.segments = segs.data();
  info.num_segments = static_cast<uint32_t>(segs.size());
  info.segment_size = sizeof(kvb_peer_segment_t);
  auto p = t_->AddPeer(sdk::PeerInfo::From(&info));
  return p.ok() ? *p : nullptr;
}

sdk::Result<RequestHandle*> Node::Post(Peer* peer, uint32_t opcode, uint64_t local_segment,
                                       void* local, uint64_t len, uint64_t remote_segment,
                                       uint64_t remote_offset, uint64_t deadline_ms,
                                       uint64_t progress_ms) {
  kvb_xfer_op_t op{};
  op.opcode = opcode;
  op.local_segment = local_segment;
  op.local_addr = local;
  op.length = len;
  op.remote_segment = remote_segment;
  op.remote_offset = remote_offset;
  kvb_post_opts_t opts{};
  opts.struct_size = sizeof(opts);
  opts.deadline_ns = deadline_ms != 0 ? NowNs() + deadline_ms * 1000000 : 0;
  opts.progress_timeout_ns = progress_ms * 1000000;
  return t_->Post(peer, sdk::Ops(&op, 1, sizeof(op)), sdk::PostOptions::From(&opts));
}

Outcome Node::Wait(RequestHandle* req, int wait_ms) {
  Outcome out;
  const auto start = std::chrono::steady_clock::now();
  const RequestState& state = *req->req;  // the request's own op list (no ops table)
  out.op_status.assign(state.ops.size(), KVB_IN_PROGRESS);
  for (;;) {
    const sdk::Status st = t_->Poll(req, out.op_status);
    out.ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    if (st.code() != KVB_IN_PROGRESS || out.ms > wait_ms) {
      out.status = st.code();
      out.msg = st.message();
      return out;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

Outcome Node::Run(Peer* peer, uint32_t opcode, uint64_t local_segment, void* local, uint64_t len,
                  uint64_t remote_segment, uint64_t remote_offset, uint64_t deadline_ms,
                  uint64_t progress_ms, int wait_ms) {
  auto req = Post(peer, opcode, local_segment, local, len, remote_segment, remote_offset,
                  deadline_ms, progress_ms);
  if (!req.ok()) {
    Outcome o;
    o.status = req.status().code();
    o.msg = req.status().message();
    return o;
  }
  Outcome o = Wait(*req, wait_ms);
  if (o.status == KVB_IN_PROGRESS) t_->Cancel(*req);
  t_->Release(*req);
  return o;
}

kvb_transport_stats_t Node::Stats() {
  kvb_transport_stats_t s{};
  s.struct_size = sizeof(s);
  (void)t_->Stats(s);
  return s;
}

}  // namespace kvbridge::nccl::test
