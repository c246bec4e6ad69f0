// The verbs transport tests' shared fixture: Node (one verbs::Transport over the test's
// LoopbackFabric, with the real TCP side channel on loopback and the real host services,
// core::HostServices with an auth::Identity), NodeSpec, and VerbsTransportTest, which makes
// nodes, registers memory, hands one node's descriptor to another and posts and waits.
// test_verbs_transport.cc and test_verbs_staging.cc (host staging, with the fake CUDA driver)
// use it. Not synchronized beyond what Node says.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "core/host_services.h"
#include "tests/verbs/loopback_fabric.h"
#include "verbs_transport.h"

namespace kvbridge::verbs::testing {

namespace sdk = kvbridge::plugin::sdk;

#define EXPECT_HAS(haystack, needle) \
  EXPECT_NE(std::string(haystack).find(needle), std::string::npos) << (haystack)

inline uint64_t NowNs() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::steady_clock::now().time_since_epoch())
                                   .count());
}

// True once pred() holds, asking for up to 2 s.
template <typename Pred>
bool Eventually(Pred pred) {
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  while (!pred()) {
    if (std::chrono::steady_clock::now() > give_up) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

struct Node {
  std::string node_id;
  uint64_t incarnation = 0;
  std::unique_ptr<FakeSysfsTree> sysfs;
  std::unique_ptr<core::HostServices> host;
  std::unique_ptr<Transport> t;
  std::map<uint64_t, std::pair<uint64_t, std::vector<uint8_t>>> segments;  // id -> length, rkey
  std::set<uint64_t> local_only;  // registered KVB_REG_LOCAL_ONLY: not in the descriptor
  std::mutex log_mu;
  std::vector<std::string> logs;

  // The transport logs while it shuts down: it goes before the log it writes to.
  ~Node() { t.reset(); }

  bool Logged(const std::string& needle) {
    std::lock_guard<std::mutex> lock(log_mu);
    for (const auto& l : logs) {
      if (l.find(needle) != std::string::npos) return true;
    }
    return false;
  }
  std::string AllLogs() {
    std::lock_guard<std::mutex> lock(log_mu);
    std::string s;
    for (const auto& l : logs) s += l + "\n";
    return s;
  }
};

struct NodeSpec {
  std::string node_id{};
  uint64_t incarnation = 1;
  std::vector<std::string> devices{};
  std::string token{};
  std::map<std::string, std::string> config{};
  std::string listen = "127.0.0.1:0";
  std::vector<int> numa{};  // per device
  std::function<Location(uint64_t, bool, int)> locate{};
};

class VerbsTransportTest : public ::testing::Test {
 protected:
  std::unique_ptr<Node> Make(const NodeSpec& spec, sdk::Status* why = nullptr,
                             bool must_work = true) {
    for (const auto& d : spec.devices) {
      if (!added_.count(d)) {
        fabric_.AddDevice(d);
        added_.insert(d);
      }
    }
    auto n = std::make_unique<Node>();
    n->node_id = spec.node_id;
    n->incarnation = spec.incarnation;
    n->sysfs = std::make_unique<FakeSysfsTree>(spec.devices, spec.numa);
    Node* raw = n.get();
    n->host = std::make_unique<core::HostServices>(
        spec.config, core::auth::Identity{spec.node_id, spec.incarnation, spec.token},
        [raw](int32_t, const char*, const char* msg) {
          std::lock_guard<std::mutex> lock(raw->log_mu);
          raw->logs.emplace_back(msg);
        });
    Fabric f;
    f.api = &fabric_;
    f.sysfs_root = n->sysfs->root();
    f.make_registrar = [this](const std::string& d, DeviceHandle, PdHandle) {
      return fabric_.MakeRegistrar(d);
    };
    f.locate = spec.locate;
    kvb_transport_params_t params{sizeof(params), spec.node_id.c_str(), spec.incarnation,
                                  spec.listen.c_str(), spec.token.c_str()};
    auto t = Transport::Create(sdk::Host(n->host->table(), "verbs"), params, std::move(f));
    if (!t.ok()) {
      if (why != nullptr) *why = t.status();
      if (must_work) ADD_FAILURE_AT(__FILE__, __LINE__) << t.status().message();
      return nullptr;
    }
    n->t = std::move(*t);
    return n;
  }

  static void Register(Node& n, uint64_t seg, void* addr, uint64_t len) {
    const sdk::Status st = TryRegister(n, seg, addr, len, KVB_MEM_HOST, -1);
    ASSERT_TRUE(st.ok()) << st.message();
  }
  // As the engine does: the key goes into the node's descriptor (n.segments) unless the
  // transport registered the region KVB_REG_LOCAL_ONLY (then n.local_only lists it).
  static sdk::Status TryRegister(Node& n, uint64_t seg, void* addr, uint64_t len, uint32_t kind,
                                 int device) {
    uint32_t flags = 0;
    kvb_region_t r{sizeof(r), kind, seg, addr, len, device, &flags};
    std::vector<uint8_t> key(1024);
    uint32_t key_len = 0;
    sdk::RkeyBuffer buf(key.data(), static_cast<uint32_t>(key.size()), &key_len);
    const sdk::Status st = n.t->RegisterMemory(sdk::Region::From(&r), buf);
    if (!st.ok()) return st;
    key.resize(key_len);
    if ((flags & KVB_REG_LOCAL_ONLY) != 0) {
      n.local_only.insert(seg);
    } else {
      n.segments[seg] = {len, key};
    }
    return st;
  }

  // What `to` would find in the descriptor of `of`.
  static kvb_peer_info_t Info(Node& of, std::string* endpoints,
                              std::vector<kvb_peer_segment_t>* segs) {
    *endpoints = of.t->Endpoints();
    segs->clear();
    for (const auto& [id, s] : of.segments) {
      segs->push_back(kvb_peer_segment_t{sizeof(kvb_peer_segment_t), KVB_MEM_HOST, id, s.first,
                                         s.second.data(), static_cast<uint32_t>(s.second.size())});
    }
    return kvb_peer_info_t{
        sizeof(kvb_peer_info_t),   of.node_id.c_str(), of.incarnation,
        endpoints->c_str(),        segs->data(),       static_cast<uint32_t>(segs->size()),
        sizeof(kvb_peer_segment_t)};
  }

  static Peer* AddPeer(Node& to, Node& of) {
    std::string ep;
    std::vector<kvb_peer_segment_t> segs;
    const kvb_peer_info_t info = Info(of, &ep, &segs);
    auto p = to.t->AddPeer(sdk::PeerInfo::From(&info));
    EXPECT_TRUE(p.ok()) << p.status().message();
    return p.ok() ? *p : nullptr;
  }

  static sdk::Status UpdatePeer(Node& to, Peer* peer, Node& of) {
    std::string ep;
    std::vector<kvb_peer_segment_t> segs;
    const kvb_peer_info_t info = Info(of, &ep, &segs);
    return to.t->UpdatePeer(peer, sdk::PeerInfo::From(&info));
  }

  static kvb_xfer_op_t Op(uint32_t opcode, uint64_t local_seg, void* local, uint64_t len,
                          uint64_t remote_seg, uint64_t remote_off) {
    return kvb_xfer_op_t{opcode, 0, local_seg, local, len, remote_seg, remote_off, nullptr};
  }

  // Posts and polls until final; the post's own error when it refused.
  static sdk::Status Transfer(Node& n, Peer* peer, const std::vector<kvb_xfer_op_t>& ops,
                              uint64_t deadline_ns = 0, uint64_t progress_timeout_ns = 0) {
    Request* r = nullptr;
    auto st = Post(n, peer, ops, deadline_ns, progress_timeout_ns, &r);
    if (!st.ok()) return st;
    return Wait(n, r);
  }

  static sdk::Status Post(Node& n, Peer* peer, const std::vector<kvb_xfer_op_t>& ops,
                          uint64_t deadline_ns, uint64_t progress_timeout_ns, Request** out) {
    kvb_post_opts_t opts{sizeof(opts), deadline_ns, progress_timeout_ns, nullptr, nullptr};
    auto r = n.t->Post(
        peer, sdk::Ops(ops.data(), static_cast<uint32_t>(ops.size()), sizeof(kvb_xfer_op_t)),
        sdk::PostOptions::From(&opts));
    if (!r.ok()) return r.status();
    *out = *r;
    return {};
  }

  static sdk::Status Wait(Node& n, Request* r) {
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (true) {
      sdk::Status st = n.t->Poll(r, {});
      if (st.code() != KVB_IN_PROGRESS) {
        n.t->Release(r);
        return st;
      }
      if (std::chrono::steady_clock::now() > give_up) {
        n.t->Cancel(r);
        n.t->Release(r);
        return sdk::Status(KVB_ERR_INTERNAL, "test: still in progress after 20 s");
      }
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }

  static std::vector<uint8_t> Pattern(size_t len, uint8_t seed) {
    std::vector<uint8_t> v(len);
    for (size_t i = 0; i < len; ++i) v[i] = static_cast<uint8_t>(i * 31 + seed + (i >> 12));
    return v;
  }

  LoopbackFabric fabric_;
  std::set<std::string> added_;
};

}  // namespace kvbridge::verbs::testing
