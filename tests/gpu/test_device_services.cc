// DeviceServices.*: the ABI 1.2 device services of kvb_host_services_t (dev_stream_*,
// dev_copy_*, pinned_*; core/host_services.cc) through the table a plugin gets, against the fake
// CUDA driver (tests/fakes/fake_cuda.cc): copies with tickets, done/wait, deadlines, errors.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "core/host_services.h"
#include "kvbridge/plugin/sdk/common.hpp"
#include "tests/gpu/fake_cuda_env.h"
#include "util/clock.h"

namespace kvbridge {
namespace {

using testing::Fake;

#define EXPECT_HAS(s, sub) EXPECT_NE(std::string(s).find(sub), std::string::npos) << (s)

constexpr uint64_t kMs = 1000000;

class DeviceServices : public ::testing::Test {
 protected:
  void SetUp() override {
    if (testing::IsSelfChild()) GTEST_SKIP() << "runs in the parent only";
    live_before_ = Fake().live_objects();
    ASSERT_EQ(t_->dev_stream_create(t_->host_ctx, 0, &s_, err_, sizeof(err_)), KVB_OK) << err_;
  }
  void TearDown() override {
    if (s_ == nullptr) return;
    Fake().set_stall(0);
    Fake().set_latency_us(0);
    t_->dev_stream_destroy(t_->host_ctx, s_);
    // Every stream, event and primary-context reference was given back.
    EXPECT_EQ(Fake().live_objects(), live_before_);
  }
  kvb_status_t Copy(void* dst, const void* src, uint64_t len, uint64_t* ticket) {
    return t_->dev_copy_async(t_->host_ctx, s_, dst, src, len, ticket, err_, sizeof(err_));
  }
  kvb_status_t Done(uint64_t ticket) {
    return t_->dev_copy_done(t_->host_ctx, s_, ticket, err_, sizeof(err_));
  }
  kvb_status_t Wait(uint64_t ticket, uint64_t deadline_ns) {
    return t_->dev_copy_wait(t_->host_ctx, s_, ticket, deadline_ns, err_, sizeof(err_));
  }

  core::HostServices host_{{}};
  const kvb_host_services_t* t_ = host_.table();
  kvb_dev_stream_t* s_ = nullptr;
  char err_[512] = {};
  int live_before_ = 0;
};

TEST_F(DeviceServices, TableCarriesThemInAbi12) {
  EXPECT_TRUE(KVB_HAS_FIELD(t_, kvb_host_services_t, pinned_free));
  EXPECT_EQ(KVB_STATUS_CODE_COUNT, 22);
  EXPECT_EQ(KVB_ERR_UNKNOWN_MEMORY, 21);
}

TEST_F(DeviceServices, HostToDeviceAndBackWithTickets) {
  constexpr size_t kLen = 1 << 20;
  char* dev = static_cast<char*>(Fake().alloc(0, kLen));
  std::vector<char> src(kLen), back(kLen, 0);
  for (size_t i = 0; i < kLen; ++i) src[i] = static_cast<char>(i * 131 + 7);
  Fake().set_latency_us(2000);  // so the first answer is IN_PROGRESS
  uint64_t h2d = 0, d2h = 0;
  ASSERT_EQ(Copy(dev, src.data(), kLen, &h2d), KVB_OK) << err_;
  ASSERT_EQ(Copy(back.data(), dev, kLen, &d2h), KVB_OK) << err_;  // same stream: after h2d
  EXPECT_NE(h2d, d2h);
  EXPECT_EQ(Done(h2d), KVB_IN_PROGRESS);
  EXPECT_EQ(Wait(d2h, util::MonoNs() + 5000 * kMs), KVB_OK) << err_;
  EXPECT_EQ(Done(h2d), KVB_OK) << err_;  // ran before d2h on the stream
  EXPECT_EQ(std::memcmp(src.data(), back.data(), kLen), 0);
  // An answered ticket is retired.
  EXPECT_EQ(Done(h2d), KVB_ERR_NOT_FOUND);
  EXPECT_HAS(err_, "not pending");
  Fake().free(dev);
}

TEST_F(DeviceServices, StalledCopyEndsDeadlineExceededAtItsDeadline) {
  char* dev = static_cast<char*>(Fake().alloc(0, 4096));
  std::vector<char> src(4096, 'x');
  Fake().set_stall(1);
  uint64_t ticket = 0;
  ASSERT_EQ(Copy(dev, src.data(), src.size(), &ticket), KVB_OK) << err_;
  const uint64_t start = util::MonoNs();
  EXPECT_EQ(Wait(ticket, start + 50 * kMs), KVB_ERR_DEADLINE_EXCEEDED);
  const uint64_t took = util::MonoNs() - start;
  EXPECT_GE(took, 50 * kMs);
  EXPECT_LT(took, 1000 * kMs);  // at its deadline, not whenever the copy ends
  EXPECT_HAS(err_, "not done by its deadline");
  // The ticket stays valid; once the device moves again the copy completes.
  EXPECT_EQ(Done(ticket), KVB_IN_PROGRESS);
  Fake().set_stall(0);
  EXPECT_EQ(Wait(ticket, util::MonoNs() + 5000 * kMs), KVB_OK) << err_;
  EXPECT_EQ(dev[4095], 'x');
  Fake().free(dev);
}

TEST_F(DeviceServices, CopyErrorIsIoErrorNamingTheCudaError) {
  char* dev = static_cast<char*>(Fake().alloc(0, 4096));
  std::vector<char> src(4096, 'y');
  Fake().fail_next_copy(700);  // CUDA_ERROR_ILLEGAL_ADDRESS, reported asynchronously
  uint64_t ticket = 0;
  ASSERT_EQ(Copy(dev, src.data(), src.size(), &ticket), KVB_OK) << err_;
  EXPECT_EQ(Wait(ticket, util::MonoNs() + 5000 * kMs), KVB_ERR_IO);
  EXPECT_HAS(err_, "CUDA_ERROR_ILLEGAL_ADDRESS");
  EXPECT_HAS(err_, "device 0");
  // The error belonged to that copy: the next one succeeds.
  ASSERT_EQ(Copy(dev, src.data(), src.size(), &ticket), KVB_OK) << err_;
  EXPECT_EQ(Wait(ticket, util::MonoNs() + 5000 * kMs), KVB_OK) << err_;
  EXPECT_EQ(dev[0], 'y');
  Fake().free(dev);
}

TEST_F(DeviceServices, BadArgumentsAreNamed) {
  uint64_t ticket = 0;
  char buf[16];
  EXPECT_EQ(Copy(nullptr, buf, 16, &ticket), KVB_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(Copy(buf, buf, 0, &ticket), KVB_ERR_INVALID_ARGUMENT);
  EXPECT_HAS(err_, "len > 0");
  kvb_dev_stream_t* other = nullptr;
  EXPECT_EQ(t_->dev_stream_create(t_->host_ctx, 7, &other, err_, sizeof(err_)), KVB_ERR_IO);
  EXPECT_HAS(err_, "CUDA_ERROR_INVALID_DEVICE");
  EXPECT_EQ(other, nullptr);
}

TEST_F(DeviceServices, PinnedAllocAndFree) {
  void* p = nullptr;
  ASSERT_EQ(t_->pinned_alloc(t_->host_ctx, 1 << 16, &p), KVB_OK);
  ASSERT_NE(p, nullptr);
  std::memset(p, 0xab, 1 << 16);  // host-accessible
  // Pinned memory is a valid copy source.
  char* dev = static_cast<char*>(Fake().alloc(1, 1 << 16));
  kvb_dev_stream_t* s1 = nullptr;
  ASSERT_EQ(t_->dev_stream_create(t_->host_ctx, 1, &s1, err_, sizeof(err_)), KVB_OK) << err_;
  uint64_t ticket = 0;
  ASSERT_EQ(t_->dev_copy_async(t_->host_ctx, s1, dev, p, 1 << 16, &ticket, err_, sizeof(err_)),
            KVB_OK);
  EXPECT_EQ(
      t_->dev_copy_wait(t_->host_ctx, s1, ticket, util::MonoNs() + 5000 * kMs, err_, sizeof(err_)),
      KVB_OK)
      << err_;
  EXPECT_EQ(static_cast<unsigned char>(dev[100]), 0xab);
  t_->dev_stream_destroy(t_->host_ctx, s1);
  t_->pinned_free(t_->host_ctx, p);
  EXPECT_EQ(t_->pinned_alloc(t_->host_ctx, 0, &p), KVB_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(p, nullptr);
  Fake().free(dev);
}

// The SDK's thin wrappers (sdk::Host::CreateDevStream / PinnedAlloc, sdk::DevStream) over the
// same table, and UNSUPPORTED naming the service on a host table that ends before them (1.1/1.2
// hosts without device services).
TEST_F(DeviceServices, SdkWrappersCopyAndRefuseOnAnOlderHost) {
  namespace sdk = kvbridge::plugin::sdk;
  sdk::Host host(t_, "sdktest");
  auto stream = host.CreateDevStream(0);
  ASSERT_TRUE(stream.ok()) << stream.status().message();
  auto pinned = host.PinnedAlloc(4096);
  ASSERT_TRUE(pinned.ok()) << pinned.status().message();
  std::memset(*pinned, 'p', 4096);
  char* dev = static_cast<char*>(Fake().alloc(0, 4096));
  auto ticket = stream->CopyAsync(dev, *pinned, 4096);
  ASSERT_TRUE(ticket.ok()) << ticket.status().message();
  EXPECT_TRUE(stream->Wait(*ticket, host.NowNs() + 5000 * kMs).ok());
  EXPECT_EQ(dev[4095], 'p');
  Fake().fail_next_copy(700);
  ticket = stream->CopyAsync(*pinned, dev, 4096);
  ASSERT_TRUE(ticket.ok());
  sdk::Status failed = stream->Wait(*ticket, host.NowNs() + 5000 * kMs);
  EXPECT_EQ(failed.code(), KVB_ERR_IO);
  EXPECT_HAS(failed.message(), "CUDA_ERROR_ILLEGAL_ADDRESS");
  host.PinnedFree(*pinned);
  Fake().free(dev);

  kvb_host_services_t older = *t_;
  older.struct_size = offsetof(kvb_host_services_t, dev_stream_create);  // ends after auth_end
  sdk::Host old_host(&older, "sdktest");
  auto refused = old_host.CreateDevStream(0);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), KVB_ERR_UNSUPPORTED);
  EXPECT_HAS(refused.status().message(), "dev_stream_create");
  EXPECT_EQ(old_host.PinnedAlloc(4096).status().code(), KVB_ERR_UNSUPPORTED);
}

// Runs as a child of MemoryKinds.NoDriverIsUnavailableNamingTheLibrary (test_memory_kinds.cc),
// in a process without a loadable driver.
TEST(DeviceServicesNoDriverChild, AllAnswerUnavailable) {
  if (!testing::IsSelfChild()) GTEST_SKIP() << "runs as a child of MemoryKinds.NoDriver...";
  const char* expect = std::getenv("KVBTEST_EXPECT_LIBRARY");
  ASSERT_NE(expect, nullptr);
  core::HostServices host({});
  const kvb_host_services_t* t = host.table();
  char err[512] = {};
  kvb_dev_stream_t* s = nullptr;
  EXPECT_EQ(t->dev_stream_create(t->host_ctx, 0, &s, err, sizeof(err)), KVB_ERR_UNAVAILABLE);
  EXPECT_HAS(err, std::string("dev_stream_create: no CUDA driver (") + expect + ")");
  char buf[16];
  uint64_t ticket = 0;
  EXPECT_EQ(t->dev_copy_async(t->host_ctx, s, buf, buf, 16, &ticket, err, sizeof(err)),
            KVB_ERR_UNAVAILABLE);
  EXPECT_HAS(err, "no CUDA driver");
  EXPECT_EQ(t->dev_copy_done(t->host_ctx, s, 1, err, sizeof(err)), KVB_ERR_UNAVAILABLE);
  EXPECT_EQ(t->dev_copy_wait(t->host_ctx, s, 1, 0, err, sizeof(err)), KVB_ERR_UNAVAILABLE);
  void* p = reinterpret_cast<void*>(1);
  EXPECT_EQ(t->pinned_alloc(t->host_ctx, 4096, &p), KVB_ERR_UNAVAILABLE);
  EXPECT_EQ(p, nullptr);
}

}  // namespace
}  // namespace kvbridge
