#include "tests/tcp/tcp_test_util.h"

#include <arpa/inet.h>
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace kvbridge::tcp::test {
namespace {

uint64_t SplitMix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

const char* LevelName(int32_t level) {
  switch (level) {
    case KVB_LOG_DEBUG:
      return "DEBUG";
    case KVB_LOG_INFO:
      return "INFO";
    case KVB_LOG_WARN:
      return "WARN";
    default:
      return "ERROR";
  }
}

void OnComplete(void* user) {
  auto* p = static_cast<Pending*>(user);
  std::lock_guard<std::mutex> lock(p->mu);
  ++p->calls;
  p->completed_ns = NowNs();
  p->cv.notify_all();
}

}  // namespace

const kvb_plugin_descriptor_t* Descriptor() {
  static const kvb_plugin_descriptor_t* desc = [] {
    const char* path = KVBRIDGE_PLUGIN_BUILD_DIR "/libkvb_transport_tcp.so";
    void* lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      fprintf(stderr, "cannot load %s: %s\n", path, dlerror());
      abort();
    }
    auto query = reinterpret_cast<kvb_plugin_query_fn>(dlsym(lib, KVB_PLUGIN_QUERY_SYMBOL));
    if (query == nullptr) abort();
    const kvb_plugin_descriptor_t* d = query(KVB_ABI_MAJOR, KVB_ABI_MINOR);
    if (d == nullptr) abort();
    return d;  // never dlclose'd: instances may outlive a test's last reference
  }();
  return desc;
}

const kvb_transport_ops_t* Ops() {
  return static_cast<const kvb_transport_ops_t*>(Descriptor()->ops);
}

uint64_t NowNs() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
}

double MsSince(uint64_t start_ns) { return static_cast<double>(NowNs() - start_ns) / 1e6; }

TestHost::TestHost(std::string name, std::map<std::string, std::string> config,
                   core::auth::Identity identity)
    : name_(std::move(name)) {
  core_ = std::make_unique<core::HostServices>(
      std::move(config), std::move(identity),
      [this](int32_t level, const char* plugin, const char* msg) { Log(level, plugin, msg); });
}

void TestHost::Log(int32_t level, const char* plugin, const char* msg) {
  std::string line = std::string("[") + plugin + " " + LevelName(level) + " " + name_ + "] " + msg;
  if (level >= KVB_LOG_INFO) fprintf(stderr, "%s\n", line.c_str());
  std::lock_guard<std::mutex> lock(mu_);
  logs_.push_back(std::move(line));
  log_times_.push_back(NowNs());
}

bool TestHost::LogContains(const std::string& needle) const {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& l : logs_) {
    if (l.find(needle) != std::string::npos) return true;
  }
  return false;
}

std::vector<uint64_t> TestHost::LogTimes(const std::string& needle) const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<uint64_t> out;
  for (size_t i = 0; i < logs_.size(); ++i) {
    if (logs_[i].find(needle) != std::string::npos) out.push_back(log_times_[i]);
  }
  return out;
}

std::vector<std::string> TestHost::Logs() const {
  std::lock_guard<std::mutex> lock(mu_);
  return logs_;
}

Buffer::Buffer(size_t n) : p_(new uint8_t[n]()), n_(n) {}

void Buffer::Fill(uint64_t seed, size_t off, size_t len) {
  len = std::min(len, n_ - off);
  uint64_t word = 0;
  size_t word_index = SIZE_MAX;
  for (size_t abs = off; abs < off + len; ++abs) {
    if (abs / 8 != word_index) {
      word_index = abs / 8;
      word = SplitMix(seed * 0x100000001b3ull + word_index);
    }
    p_[abs] = static_cast<uint8_t>(word >> (8 * (abs % 8)));
  }
}

uint64_t Buffer::Checksum(size_t off, size_t len) const {
  len = std::min(len, n_ - off);
  uint64_t h = 0xcbf29ce484222325ull;
  for (size_t i = 0; i < len; ++i) h = (h ^ p_[off + i]) * 0x100000001b3ull;
  return h;
}

kvb_status_t Instance::TryCreate(const Options& opts, std::unique_ptr<Instance>* out,
                                 std::string* err) {
  std::unique_ptr<Instance> inst(new Instance());
  inst->opts_ = opts;
  inst->host_ = std::make_unique<TestHost>(
      opts.node_id, opts.config, core::auth::Identity{opts.node_id, opts.incarnation, opts.token});
  kvb_transport_params_t params{.struct_size = sizeof(kvb_transport_params_t),
                                .node_id = opts.node_id.c_str(),
                                .incarnation = opts.incarnation,
                                .listen = opts.listen.c_str(),
                                .cluster_token = nullptr};
  char buf[512] = {0};
  const kvb_status_t st =
      Ops()->create(inst->host_->services(), &params, &inst->t_, buf, sizeof(buf));
  if (err != nullptr) *err = buf;
  if (st == KVB_OK) *out = std::move(inst);
  return st;
}

std::unique_ptr<Instance> Instance::Create(const Options& opts) {
  std::unique_ptr<Instance> inst;
  std::string err;
  const kvb_status_t st = TryCreate(opts, &inst, &err);
  if (st != KVB_OK) ADD_FAILURE() << "create " << opts.node_id << ": " << st << " " << err;
  return inst;
}

Instance::~Instance() {
  if (t_ != nullptr) Ops()->destroy(t_);
}

std::string Instance::Endpoints() const {
  char buf[512];
  const int32_t n = Ops()->get_endpoints(t_, buf, sizeof(buf));
  return n < 0 ? std::string() : std::string(buf, static_cast<size_t>(n));
}

uint16_t Instance::Port() const {
  const std::string ep = Endpoints();
  const size_t colon = ep.find(':');
  const size_t comma = ep.find(',');
  return static_cast<uint16_t>(std::stoul(ep.substr(colon + 1, comma - colon - 1)));
}

uint64_t Instance::Register(void* addr, size_t len) {
  const uint64_t seg = next_segment_.fetch_add(1);
  kvb_region_t r{.struct_size = sizeof(kvb_region_t),
                 .mem_kind = KVB_MEM_HOST,
                 .segment_id = seg,
                 .addr = addr,
                 .length = len,
                 .device_id = -1,
                 .reg_flags = nullptr};
  uint8_t rkey[64];
  uint32_t rkey_len = 99;
  EXPECT_EQ(Ops()->register_memory(t_, &r, rkey, sizeof(rkey), &rkey_len), KVB_OK);
  EXPECT_EQ(rkey_len, 0u);
  return seg;
}

kvb_status_t Instance::Deregister(uint64_t segment) {
  return Ops()->deregister_memory(t_, segment);
}

kvb_tpeer_t* Instance::AddPeer(const Instance& other, const std::string& endpoints,
                               uint64_t incarnation, const std::string& node_id) {
  return AddPeerRaw(node_id.empty() ? other.opts_.node_id : node_id,
                    incarnation != 0 ? incarnation : other.opts_.incarnation,
                    endpoints.empty() ? other.Endpoints() : endpoints);
}

kvb_tpeer_t* Instance::AddPeerRaw(const std::string& node_id, uint64_t incarnation,
                                  const std::string& endpoints,
                                  std::vector<kvb_peer_segment_t> segments) {
  kvb_peer_info_t info{.struct_size = sizeof(kvb_peer_info_t),
                       .node_id = node_id.c_str(),
                       .incarnation = incarnation,
                       .endpoints = endpoints.c_str(),
                       .segments = segments.data(),
                       .num_segments = static_cast<uint32_t>(segments.size()),
                       .segment_size = sizeof(kvb_peer_segment_t)};
  kvb_tpeer_t* peer = nullptr;
  char err[256] = {0};
  const kvb_status_t st = Ops()->add_peer(t_, &info, &peer, err, sizeof(err));
  EXPECT_EQ(st, KVB_OK) << err;
  return peer;
}

void Instance::RemovePeer(kvb_tpeer_t* peer) { Ops()->remove_peer(t_, peer); }

kvb_transport_stats_t Instance::Stats() const {
  kvb_transport_stats_t s{};
  s.struct_size = sizeof(s);
  EXPECT_EQ(Ops()->get_stats(t_, &s), KVB_OK);
  return s;
}

kvb_xfer_op_t Instance::Op(uint32_t opcode, uint64_t local_segment, void* local, uint64_t len,
                           uint64_t remote_segment, uint64_t remote_offset) const {
  return kvb_xfer_op_t{.opcode = opcode,
                       .flags = 0,
                       .local_segment = local_segment,
                       .local_addr = local,
                       .length = len,
                       .remote_segment = remote_segment,
                       .remote_offset = remote_offset,
                       .crc = nullptr};
}

kvb_status_t Instance::PostAsync(kvb_tpeer_t* peer, const std::vector<kvb_xfer_op_t>& ops,
                                 uint64_t deadline_ms, std::shared_ptr<Pending>* out,
                                 std::string* err, uint64_t progress_timeout_ms) {
  auto p = std::make_shared<Pending>();
  p->num_ops = static_cast<uint32_t>(ops.size());
  p->posted_ns = NowNs();
  kvb_post_opts_t opts{.struct_size = sizeof(kvb_post_opts_t),
                       .deadline_ns = deadline_ms ? p->posted_ns + deadline_ms * 1000000ull : 0,
                       .progress_timeout_ns = progress_timeout_ms * 1000000ull,
                       .on_complete = OnComplete,
                       .user = p.get()};
  char buf[512] = {0};
  const kvb_status_t st =
      Ops()->post(t_, peer, ops.data(), sizeof(kvb_xfer_op_t), static_cast<uint32_t>(ops.size()),
                  &opts, &p->req, buf, sizeof(buf));
  if (err != nullptr) *err = buf;
  if (st == KVB_OK) *out = p;
  return st;
}

Result Instance::Finish(const std::shared_ptr<Pending>& p, int timeout_ms) {
  Result r;
  {
    std::unique_lock<std::mutex> lock(p->mu);
    p->cv.wait_for(lock, std::chrono::milliseconds(timeout_ms), [&] { return p->calls > 0; });
    r.completions = p->calls;
  }
  r.op_status.assign(p->num_ops, -1);
  char buf[512] = {0};
  r.status = Ops()->poll(t_, p->req, r.op_status.data(), p->num_ops, buf, sizeof(buf));
  r.msg = buf;
  if (r.completions == 0) {
    ADD_FAILURE() << "request not final after " << timeout_ms << " ms";
    Ops()->cancel(t_, p->req);
  }
  {
    std::lock_guard<std::mutex> lock(p->mu);
    r.elapsed_ms = static_cast<double>(p->completed_ns - p->posted_ns) / 1e6;
  }
  Ops()->release(t_, p->req);
  return r;
}

Result Instance::Transfer(kvb_tpeer_t* peer, const std::vector<kvb_xfer_op_t>& ops,
                          uint64_t deadline_ms) {
  std::shared_ptr<Pending> p;
  std::string err;
  Result r;
  r.status = PostAsync(peer, ops, deadline_ms, &p, &err);
  if (r.status != KVB_OK) {
    r.msg = err;
    return r;
  }
  return Finish(p);
}

uint16_t DeadPort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  socklen_t len = sizeof(a);
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  close(fd);
  return ntohs(a.sin_port);
}

RawClient::RawClient(uint16_t port, const std::string& source) {
  fd_ = socket(AF_INET, SOCK_STREAM, 0);
  if (!source.empty()) {
    sockaddr_in from{};
    from.sin_family = AF_INET;
    inet_pton(AF_INET, source.c_str(), &from.sin_addr);
    if (bind(fd_, reinterpret_cast<sockaddr*>(&from), sizeof(from)) != 0) {
      close(fd_);
      fd_ = -1;
      return;
    }
  }
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    close(fd_);
    fd_ = -1;
  }
  int one = 1;
  if (fd_ >= 0) setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

RawClient::~RawClient() {
  if (fd_ >= 0) close(fd_);
}

bool RawClient::SendAll(const void* data, size_t len) {
  const auto* p = static_cast<const uint8_t*>(data);
  while (len > 0) {
    const ssize_t w = send(fd_, p, len, MSG_NOSIGNAL);
    if (w <= 0) return false;
    p += w;
    len -= static_cast<size_t>(w);
  }
  return true;
}

bool RawClient::RecvAll(void* buf, size_t len, int timeout_ms) {
  auto* p = static_cast<uint8_t*>(buf);
  const uint64_t end = NowNs() + static_cast<uint64_t>(timeout_ms) * 1000000ull;
  while (len > 0) {
    const uint64_t now = NowNs();
    if (now >= end) return false;
    pollfd pfd{fd_, POLLIN, 0};
    if (poll(&pfd, 1, static_cast<int>((end - now) / 1000000 + 1)) <= 0) continue;
    const ssize_t r = recv(fd_, p, len, 0);
    if (r <= 0) return false;
    p += r;
    len -= static_cast<size_t>(r);
  }
  return true;
}

bool RawClient::WaitClosed(int timeout_ms) {
  const uint64_t end = NowNs() + static_cast<uint64_t>(timeout_ms) * 1000000ull;
  uint8_t buf[4096];
  while (NowNs() < end) {
    pollfd pfd{fd_, POLLIN, 0};
    if (poll(&pfd, 1, 50) <= 0) continue;
    const ssize_t r = recv(fd_, buf, sizeof(buf), 0);
    if (r <= 0) return true;
  }
  return false;
}

int32_t RawClient::Handshake(const std::string& my_node, uint64_t my_incarnation,
                             const std::string& expect_node, uint64_t expect_incarnation,
                             const std::string& token) {
  auth::Hello h;
  h.flags = token.empty() ? 0 : auth::kHelloFlagAuth;
  h.client_node_id = my_node;
  h.client_incarnation = my_incarnation;
  h.expected_node_id = expect_node;
  h.expected_incarnation = expect_incarnation;
  auth::RandomNonce(&h.client_nonce);
  const std::string bytes = auth::EncodeHello(h);
  if (!SendAll(bytes.data(), bytes.size())) return -1;
  uint8_t buf[auth::kHelloReplyFixedBytes + auth::kMaxNodeIdBytes];
  if (!RecvAll(buf, auth::kHelloReplyFixedBytes)) return -1;
  auth::HelloReply rep;
  auth::ParseResult pr = auth::DecodeHelloReply(buf, auth::kHelloReplyFixedBytes, &rep);
  if (pr.result == auth::Parse::kNeedMore) {
    if (!RecvAll(buf + auth::kHelloReplyFixedBytes, pr.bytes - auth::kHelloReplyFixedBytes)) {
      return -1;
    }
    pr = auth::DecodeHelloReply(buf, pr.bytes, &rep);
  }
  if (pr.result != auth::Parse::kOk) return -1;
  if (rep.status != KVB_OK || token.empty()) return rep.status;
  const auth::Transcript tr{h.client_node_id,       h.client_incarnation, rep.server_node_id,
                            rep.server_incarnation, h.expected_node_id,   h.expected_incarnation,
                            h.client_nonce,         rep.server_nonce,     rep.status};
  if (!auth::VerifyProof(token, auth::ProofLabel("tcp"), auth::Role::kServer, tr, rep.server_proof))
    return -2;
  auth::ClientProof cp;
  auth::ComputeProof(token, auth::ProofLabel("tcp"), auth::Role::kClient, tr, &cp.proof);
  uint8_t pb[auth::kClientProofBytes];
  auth::EncodeClientProof(cp, pb);
  uint8_t db[auth::kAuthDoneBytes];
  if (!SendAll(pb, sizeof(pb)) || !RecvAll(db, sizeof(db))) return -1;
  auth::AuthDone done;
  if (!auth::DecodeAuthDone(db, sizeof(db), &done)) return -1;
  return done.status;
}

bool RawClient::SendRequest(const wire::RequestHeader& h, const void* payload) {
  uint8_t hb[wire::kRequestHeaderBytes];
  wire::EncodeRequestHeader(h, hb);
  if (!SendAll(hb, sizeof(hb))) return false;
  return payload == nullptr || SendAll(payload, static_cast<size_t>(h.length));
}

bool RawClient::RecvResponse(wire::ResponseHeader* h, int timeout_ms) {
  uint8_t rb[wire::kResponseHeaderBytes];
  if (!RecvAll(rb, sizeof(rb), timeout_ms)) return false;
  return wire::DecodeResponseHeader(rb, sizeof(rb), h);
}

SilentServer::SilentServer(bool accept, bool answer_handshake, std::string node_id,
                           uint64_t incarnation) {
  listen_fd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(listen_fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  listen(listen_fd_, 64);
  socklen_t len = sizeof(a);
  getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&a), &len);
  port_ = ntohs(a.sin_port);
  if (!accept) return;
  thread_ = std::thread([this, answer_handshake, node_id, incarnation] {
    while (!stop_.load()) {
      pollfd pfd{listen_fd_, POLLIN, 0};
      if (poll(&pfd, 1, 20) <= 0) continue;
      const int fd = ::accept(listen_fd_, nullptr, nullptr);
      if (fd < 0) continue;
      conns_.push_back(fd);
      if (!answer_handshake) continue;
      uint8_t buf[auth::kHelloFixedBytes + 2 * auth::kMaxNodeIdBytes];
      size_t have = 0, need = auth::kHelloFixedBytes;
      auth::Hello hello;
      bool ok = false;
      while (true) {
        while (have < need) {
          const ssize_t r = recv(fd, buf + have, need - have, 0);
          if (r <= 0) break;
          have += static_cast<size_t>(r);
        }
        if (have < need) break;
        const auth::ParseResult pr = auth::DecodeHello(buf, have, &hello);
        if (pr.result == auth::Parse::kOk) {
          ok = true;
          break;
        }
        if (pr.result != auth::Parse::kNeedMore) break;
        need = pr.bytes;
      }
      if (!ok) continue;
      auth::HelloReply rep;
      rep.server_node_id = node_id;
      rep.server_incarnation = incarnation;
      const std::string bytes = auth::EncodeHelloReply(rep);
      (void)!send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL);
      // From here on: read nothing, answer nothing.
    }
  });
}

SilentServer::~SilentServer() {
  stop_.store(true);
  if (thread_.joinable()) thread_.join();
  for (int fd : conns_) close(fd);
  close(listen_fd_);
}

}  // namespace kvbridge::tcp::test
