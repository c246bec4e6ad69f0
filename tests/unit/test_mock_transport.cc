// The mock transport (plugins/testing/mock_transport.cc) driven through the raw plugin ABI:
// the engine and conformance tests rely on it behaving like a real transport, so its
// asynchrony, bounds checks, identity checks, deadlines, cancel and fault hooks are pinned here.
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "core/host_services.h"
#include "core/plugin_loader.h"
#include "util/clock.h"

namespace kvbridge::core {
namespace {

using Clock = std::chrono::steady_clock;
using SetFaultFn = int32_t (*)(const char*, int32_t, int32_t, uint32_t);
using PostCountFn = uint64_t (*)(const char*);

const std::string kMockPath =
    std::string(KVBRIDGE_TEST_PLUGIN_BUILD_DIR) + "/libkvb_transport_mock.so";

void CountCompletion(void* user) { static_cast<std::atomic<int>*>(user)->fetch_add(1); }

// One mock instance with one registered region.
struct Instance {
  std::string node_id;
  uint64_t incarnation = 0;
  std::unique_ptr<HostServices> host;
  kvb_transport_t* t = nullptr;
  std::vector<uint8_t> mem;
};

class MockTransportTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const PluginInfo& info = registry_.LoadFile(kMockPath);
    ASSERT_EQ(info.state, PluginState::kLoaded) << info.reason;
    ops_ = info.transport_ops();
    void* h = dlopen(kMockPath.c_str(), RTLD_NOW | RTLD_NOLOAD);
    ASSERT_NE(h, nullptr);
    set_fault_ = reinterpret_cast<SetFaultFn>(dlsym(h, "kvb_mock_set_fault"));
    post_count_ = reinterpret_cast<PostCountFn>(dlsym(h, "kvb_mock_post_count"));
    dlclose(h);  // drops only the reference NOLOAD added
    ASSERT_NE(set_fault_, nullptr);
    ASSERT_NE(post_count_, nullptr);
    a_ = Create("mt-a", 11);
    b_ = Create("mt-b", 22);
    ASSERT_NE(a_, nullptr);
    ASSERT_NE(b_, nullptr);
    peer_b_ = AddPeer(*a_, *b_);
    ASSERT_NE(peer_b_, nullptr);
  }
  void TearDown() override {
    for (auto& inst : instances_) {
      if (inst->t != nullptr) ops_->destroy(inst->t);
    }
  }

  Instance* Create(const std::string& node_id, uint64_t incarnation,
                   std::map<std::string, std::string> config = {}) {
    auto inst = std::make_unique<Instance>();
    inst->node_id = node_id;
    inst->incarnation = incarnation;
    inst->host = std::make_unique<HostServices>(std::move(config));
    inst->mem.assign(1 << 16, 0);
    kvb_transport_params_t params{sizeof(params), inst->node_id.c_str(), incarnation, nullptr,
                                  nullptr};
    char err[256] = "";
    if (ops_->create(inst->host->table(), &params, &inst->t, err, sizeof(err)) != KVB_OK) {
      ADD_FAILURE() << "create failed: " << err;
      return nullptr;
    }
    kvb_region_t region{sizeof(region), KVB_MEM_HOST, 1, inst->mem.data(), inst->mem.size(), -1};
    uint32_t rkey_len = 0;
    EXPECT_EQ(ops_->register_memory(inst->t, &region, nullptr, 0, &rkey_len), KVB_OK);
    instances_.push_back(std::move(inst));
    return instances_.back().get();
  }
  void Destroy(Instance* inst) {
    ops_->destroy(inst->t);
    inst->t = nullptr;
  }
  kvb_tpeer_t* AddPeer(Instance& from, Instance& to) {
    char ep[128];
    EXPECT_GT(ops_->get_endpoints(to.t, ep, sizeof(ep)), 0);
    kvb_peer_info_t info{sizeof(info), to.node_id.c_str(), to.incarnation, ep, nullptr, 0,
                         sizeof(kvb_peer_segment_t)};
    kvb_tpeer_t* peer = nullptr;
    char err[256] = "";
    EXPECT_EQ(ops_->add_peer(from.t, &info, &peer, err, sizeof(err)), KVB_OK) << err;
    return peer;
  }

  // Posts one op from a_ to b_'s region (local segment 1 of a_).
  kvb_status_t Post(uint32_t opcode, size_t local_off, size_t len, uint64_t remote_off,
                    kvb_treq_t** req, uint64_t deadline_ns = 0, uint64_t progress_ns = 0,
                    uint64_t remote_segment = 1) {
    kvb_xfer_op_t op{opcode, 0, 1, a_->mem.data() + local_off, len, remote_segment, remote_off};
    kvb_post_opts_t opts{sizeof(opts), deadline_ns, progress_ns, CountCompletion, &completions_};
    return ops_->post(a_->t, peer_b_, &op, sizeof(op), 1, &opts, req, err_, sizeof(err_));
  }
  // Polls until final (at most 5 s); returns the final code.
  kvb_status_t Wait(kvb_treq_t* req, kvb_status_t* op_status = nullptr) {
    auto until = Clock::now() + std::chrono::seconds(5);
    kvb_status_t st;
    while ((st = ops_->poll(a_->t, req, op_status, 1, err_, sizeof(err_))) == KVB_IN_PROGRESS &&
           Clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return st;
  }
  kvb_status_t PostAndWait(uint32_t opcode, size_t local_off, size_t len, uint64_t remote_off,
                           uint64_t remote_segment = 1) {
    kvb_treq_t* req = nullptr;
    kvb_status_t st = Post(opcode, local_off, len, remote_off, &req, 0, 0, remote_segment);
    if (st != KVB_OK) return st;
    st = Wait(req);
    ops_->release(a_->t, req);
    return st;
  }

  PluginRegistry registry_;
  const kvb_transport_ops_t* ops_ = nullptr;
  SetFaultFn set_fault_ = nullptr;
  PostCountFn post_count_ = nullptr;
  std::vector<std::unique_ptr<Instance>> instances_;
  Instance* a_ = nullptr;
  Instance* b_ = nullptr;
  kvb_tpeer_t* peer_b_ = nullptr;
  std::atomic<int> completions_{0};
  char err_[256] = "";
};

TEST_F(MockTransportTest, WriteAndReadAreAsynchronousAndCompleteOnce) {
  for (size_t i = 0; i < 4096; ++i) a_->mem[i] = static_cast<uint8_t>(i * 7);
  ASSERT_EQ(set_fault_("mt-a", KVB_OK, 0, /*delay_ms=*/50), KVB_OK);
  kvb_treq_t* req = nullptr;
  ASSERT_EQ(Post(KVB_OP_WRITE, 0, 4096, 100, &req), KVB_OK) << err_;
  kvb_status_t op_st = KVB_OK;
  EXPECT_EQ(ops_->poll(a_->t, req, &op_st, 1, err_, sizeof(err_)), KVB_IN_PROGRESS);
  EXPECT_EQ(op_st, KVB_IN_PROGRESS);
  EXPECT_EQ(Wait(req, &op_st), KVB_OK) << err_;
  EXPECT_EQ(op_st, KVB_OK);
  EXPECT_EQ(completions_.load(), 1);
  ops_->release(a_->t, req);
  EXPECT_EQ(0, std::memcmp(b_->mem.data() + 100, a_->mem.data(), 4096));
  EXPECT_EQ(b_->mem[99], 0);
  EXPECT_EQ(b_->mem[4196], 0);

  ASSERT_EQ(set_fault_("mt-a", KVB_OK, 0, 0), KVB_OK);
  EXPECT_EQ(PostAndWait(KVB_OP_READ, 8192, 4096, 100), KVB_OK) << err_;
  EXPECT_EQ(0, std::memcmp(a_->mem.data() + 8192, a_->mem.data(), 4096));
  EXPECT_EQ(completions_.load(), 2);

  kvb_transport_stats_t stats{};
  stats.struct_size = sizeof(stats);
  ASSERT_EQ(ops_->get_stats(a_->t, &stats), KVB_OK);
  EXPECT_EQ(stats.bytes_written, 4096u);
  EXPECT_EQ(stats.bytes_read, 4096u);
  EXPECT_EQ(stats.queued_bytes, 0u);
}

TEST_F(MockTransportTest, EndpointsNameTheNode) {
  char ep[64];
  EXPECT_EQ(ops_->get_endpoints(b_->t, ep, sizeof(ep)), 9);
  EXPECT_STREQ(ep, "mock:mt-b");
  EXPECT_EQ(ops_->get_endpoints(b_->t, ep, 4), -2);
}

TEST_F(MockTransportTest, RemoteBoundsAreChecked) {
  const uint64_t size = b_->mem.size();
  EXPECT_EQ(PostAndWait(KVB_OP_WRITE, 0, 16, 0, /*remote_segment=*/9), KVB_ERR_NOT_REGISTERED);
  EXPECT_NE(std::string(err_).find("not registered"), std::string::npos) << err_;
  EXPECT_EQ(PostAndWait(KVB_OP_WRITE, 0, 16, size - 8), KVB_ERR_OUT_OF_BOUNDS);
  EXPECT_EQ(PostAndWait(KVB_OP_READ, 0, 16, UINT64_MAX - 4), KVB_ERR_OUT_OF_BOUNDS);
  EXPECT_EQ(PostAndWait(KVB_OP_WRITE, 0, 16, size - 16), KVB_OK);
  kvb_transport_stats_t stats{};
  stats.struct_size = sizeof(stats);
  ASSERT_EQ(ops_->get_stats(b_->t, &stats), KVB_OK);
  EXPECT_EQ(stats.frames_rejected, 3u);
  ASSERT_EQ(ops_->deregister_memory(b_->t, 1), KVB_OK);
  EXPECT_EQ(ops_->deregister_memory(b_->t, 1), KVB_ERR_NOT_FOUND);
  EXPECT_EQ(PostAndWait(KVB_OP_WRITE, 0, 16, 0), KVB_ERR_NOT_REGISTERED);
}

TEST_F(MockTransportTest, BadPostsQueueNothing) {
  kvb_treq_t* req = nullptr;
  std::vector<uint8_t> unregistered(64);
  kvb_xfer_op_t op{KVB_OP_WRITE, 0, 1, unregistered.data(), 64, 1, 0};
  EXPECT_EQ(ops_->post(a_->t, peer_b_, &op, sizeof(op), 1, nullptr, &req, err_, sizeof(err_)),
            KVB_ERR_NOT_REGISTERED);
  EXPECT_EQ(req, nullptr);
  // Runs past the end of the local region.
  EXPECT_EQ(Post(KVB_OP_WRITE, a_->mem.size() - 8, 16, 0, &req), KVB_ERR_NOT_REGISTERED);
  EXPECT_EQ(Post(KVB_OP_WRITE, 0, 0, 0, &req), KVB_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(Post(7, 0, 16, 0, &req), KVB_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(req, nullptr);
  EXPECT_EQ(completions_.load(), 0);
}

TEST_F(MockTransportTest, ReplacedIncarnationIsStaleAndUntouched) {
  Destroy(b_);
  Instance* b2 = Create("mt-b", 23);
  ASSERT_NE(b2, nullptr);
  EXPECT_EQ(PostAndWait(KVB_OP_WRITE, 0, 64, 0), KVB_ERR_STALE_PEER);
  EXPECT_NE(std::string(err_).find("incarnation 23"), std::string::npos) << err_;
  for (uint8_t byte : b2->mem) ASSERT_EQ(byte, 0);
  Destroy(b2);
  EXPECT_EQ(PostAndWait(KVB_OP_WRITE, 0, 64, 0), KVB_ERR_PEER_UNREACHABLE);
}

TEST_F(MockTransportTest, SecondLiveInstanceWithSameNodeIdIsRefused) {
  HostServices host(std::map<std::string, std::string>{});
  kvb_transport_params_t params{sizeof(params), "mt-b", 99, nullptr, nullptr};
  kvb_transport_t* t = nullptr;
  char err[256] = "";
  EXPECT_EQ(ops_->create(host.table(), &params, &t, err, sizeof(err)), KVB_ERR_ALREADY_EXISTS);
  EXPECT_EQ(t, nullptr);
}

TEST_F(MockTransportTest, DeadlineEndsADelayedRequest) {
  ASSERT_EQ(set_fault_("mt-a", KVB_OK, 0, /*delay_ms=*/2000), KVB_OK);
  kvb_treq_t* req = nullptr;
  auto t0 = Clock::now();
  ASSERT_EQ(Post(KVB_OP_WRITE, 0, 64, 0, &req, util::MonoNs() + util::MsToNs(100)), KVB_OK);
  EXPECT_EQ(Wait(req), KVB_ERR_DEADLINE_EXCEEDED);
  double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  EXPECT_GE(ms, 95);
  EXPECT_LT(ms, 1000);
  EXPECT_EQ(completions_.load(), 1);
  ops_->release(a_->t, req);
}

TEST_F(MockTransportTest, DelayLongerThanProgressTimeoutIsAFrozenPeer) {
  ASSERT_EQ(set_fault_("mt-a", KVB_OK, 0, /*delay_ms=*/2000), KVB_OK);
  kvb_treq_t* req = nullptr;
  ASSERT_EQ(
      Post(KVB_OP_WRITE, 0, 64, 0, &req, util::MonoNs() + util::MsToNs(1500), util::MsToNs(50)),
      KVB_OK);
  EXPECT_EQ(Wait(req), KVB_ERR_PROGRESS_TIMEOUT);
  ops_->release(a_->t, req);
}

TEST_F(MockTransportTest, CancelIsFinalAtOnceAndTouchesNothingAfter) {
  for (size_t i = 0; i < 64; ++i) a_->mem[i] = 0xee;
  ASSERT_EQ(set_fault_("mt-a", KVB_OK, 0, /*delay_ms=*/100), KVB_OK);
  kvb_treq_t* req = nullptr;
  ASSERT_EQ(Post(KVB_OP_WRITE, 0, 64, 0, &req), KVB_OK);
  ops_->cancel(a_->t, req);
  ops_->cancel(a_->t, req);  // idempotent
  kvb_status_t op_st = KVB_OK;
  EXPECT_EQ(ops_->poll(a_->t, req, &op_st, 1, err_, sizeof(err_)), KVB_ERR_CANCELLED);
  EXPECT_EQ(op_st, KVB_ERR_CANCELLED);
  EXPECT_EQ(completions_.load(), 1);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_EQ(b_->mem[0], 0) << "a cancelled write landed";
  EXPECT_EQ(completions_.load(), 1);
  ops_->release(a_->t, req);
}

TEST_F(MockTransportTest, RemovePeerAndDestroyCancelOutstanding) {
  ASSERT_EQ(set_fault_("mt-a", KVB_OK, 0, /*delay_ms=*/5000), KVB_OK);
  kvb_treq_t* r1 = nullptr;
  kvb_treq_t* r2 = nullptr;
  ASSERT_EQ(Post(KVB_OP_WRITE, 0, 64, 0, &r1), KVB_OK);
  ops_->remove_peer(a_->t, peer_b_);
  EXPECT_EQ(ops_->poll(a_->t, r1, nullptr, 0, err_, sizeof(err_)), KVB_ERR_CANCELLED);
  ops_->release(a_->t, r1);
  peer_b_ = AddPeer(*a_, *b_);
  ASSERT_EQ(Post(KVB_OP_WRITE, 0, 64, 0, &r2), KVB_OK);
  auto t0 = Clock::now();
  Destroy(a_);  // r2 is cancelled and freed with the instance
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(2)) << "destroy waited for a delayed request";
  EXPECT_EQ(completions_.load(), 2);
}

TEST_F(MockTransportTest, RunTimeFaultsFailTheNextPostsAndAreCounted) {
  const uint64_t before = post_count_("mt-a");
  ASSERT_EQ(set_fault_("mt-a", KVB_ERR_PEER_UNREACHABLE, 2, 0), KVB_OK);
  EXPECT_EQ(PostAndWait(KVB_OP_WRITE, 0, 64, 0), KVB_ERR_PEER_UNREACHABLE);
  EXPECT_NE(std::string(err_).find("injected"), std::string::npos) << err_;
  EXPECT_EQ(PostAndWait(KVB_OP_WRITE, 0, 64, 0), KVB_ERR_PEER_UNREACHABLE);
  EXPECT_EQ(PostAndWait(KVB_OP_WRITE, 0, 64, 0), KVB_OK);
  EXPECT_EQ(post_count_("mt-a"), before + 3);

  // Queue-bound errors fail post() itself: nothing queued, no completion.
  ASSERT_EQ(set_fault_("mt-a", KVB_ERR_BACKPRESSURE, -1, 0), KVB_OK);
  const int completions = completions_.load();
  kvb_treq_t* req = nullptr;
  EXPECT_EQ(Post(KVB_OP_WRITE, 0, 64, 0, &req), KVB_ERR_BACKPRESSURE);
  EXPECT_EQ(Post(KVB_OP_WRITE, 0, 64, 0, &req), KVB_ERR_BACKPRESSURE);
  EXPECT_EQ(req, nullptr);
  EXPECT_EQ(completions_.load(), completions);
  EXPECT_EQ(post_count_("mt-a"), before + 5);

  EXPECT_EQ(set_fault_("nobody", KVB_ERR_IO, 1, 0), KVB_ERR_NOT_FOUND);
  EXPECT_EQ(post_count_("nobody"), UINT64_MAX);
}

TEST_F(MockTransportTest, FaultsFromConfigAtCreate) {
  Instance* c = Create("mt-c", 33, {{"mock.fail_code", "STALE_PEER"}, {"mock.fail_count", "1"}});
  ASSERT_NE(c, nullptr);
  kvb_tpeer_t* peer = AddPeer(*c, *b_);
  kvb_xfer_op_t op{KVB_OP_WRITE, 0, 1, c->mem.data(), 64, 1, 0};
  for (kvb_status_t want : {KVB_ERR_STALE_PEER, KVB_OK}) {
    kvb_treq_t* req = nullptr;
    ASSERT_EQ(ops_->post(c->t, peer, &op, sizeof(op), 1, nullptr, &req, err_, sizeof(err_)),
              KVB_OK);
    auto until = Clock::now() + std::chrono::seconds(5);
    kvb_status_t st;
    while ((st = ops_->poll(c->t, req, nullptr, 0, err_, sizeof(err_))) == KVB_IN_PROGRESS &&
           Clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    EXPECT_EQ(st, want);
    ops_->release(c->t, req);
  }
  HostServices bad(std::map<std::string, std::string>{{"mock.fail_code", "NOT_A_CODE"}});
  kvb_transport_params_t params{sizeof(params), "mt-bad", 1, nullptr, nullptr};
  kvb_transport_t* t = nullptr;
  char err[256] = "";
  EXPECT_EQ(ops_->create(bad.table(), &params, &t, err, sizeof(err)), KVB_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(err).find("mock.fail_code"), std::string::npos) << err;
}

TEST_F(MockTransportTest, ConcurrentPostsFromManyThreads) {
  constexpr int kThreads = 4, kPerThread = 200;
  std::vector<std::thread> threads;
  std::atomic<int> ok{0};
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kPerThread; ++i) {
        kvb_xfer_op_t op{KVB_OP_WRITE,
                         0,
                         1,
                         a_->mem.data() + t * 1024,
                         1024,
                         1,
                         static_cast<uint64_t>(t) * 1024};
        kvb_treq_t* req = nullptr;
        char err[128];
        if (ops_->post(a_->t, peer_b_, &op, sizeof(op), 1, nullptr, &req, err, sizeof(err)) !=
            KVB_OK) {
          continue;
        }
        kvb_status_t st;
        while ((st = ops_->poll(a_->t, req, nullptr, 0, err, sizeof(err))) == KVB_IN_PROGRESS) {
          std::this_thread::yield();
        }
        if (st == KVB_OK) ok.fetch_add(1);
        ops_->release(a_->t, req);
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(ok.load(), kThreads * kPerThread);
}

}  // namespace
}  // namespace kvbridge::core
