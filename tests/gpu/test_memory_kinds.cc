// MemoryKinds.*: what RegisterMemory accepts as each memory kind (core/memory_kinds.h), against
// the fake CUDA driver (tests/fakes/fake_cuda.cc), and what it answers with no driver at all.
// kCuda is checked through core::CheckMemoryKind directly (through the engine, with tcp taking
// CUDA memory: TcpDevice.EngineChecksCudaMemoryBeforeTcpSeesIt in test_tcp_device.cc); kHost is
// checked through the engine with the tcp transport, as a user reaches it.
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdlib>
#include <memory>
#include <string>

#include "core/cuda_driver.h"
#include "core/descriptor.h"
#include "core/memory_kinds.h"
#include "kvbridge/engine.h"
#include "tests/common/test_util.h"
#include "tests/gpu/fake_cuda_env.h"

namespace kvbridge {
namespace {

using testing::Buffer;
using testing::Fake;
using testing::LoopbackOptions;
using testing::Must;

#define EXPECT_HAS(s, sub) EXPECT_NE((s).find(sub), std::string::npos) << (s)

// A fake device allocation, freed at scope end.
struct DeviceMem {
  DeviceMem(int device, size_t len, bool managed = false)
      : p(static_cast<char*>(managed ? Fake().alloc_managed(device, len)
                                     : Fake().alloc(device, len))),
        len(len) {}
  ~DeviceMem() { Fake().free(p); }
  char* p;
  size_t len;
};

class MemoryKinds : public ::testing::Test {
 protected:
  void SetUp() override {
    if (testing::IsSelfChild()) GTEST_SKIP() << "runs in the parent only";
    ASSERT_TRUE(core::cuda::GetDriver().ok()) << core::cuda::GetDriver().status().ToString();
  }
  static Result<int> Check(const void* p, uint64_t len, MemoryKind kind, int device) {
    return core::CheckMemoryKind(p, len, kind, device);
  }
};

TEST_F(MemoryKinds, DriverIsTheFakeLoadedThroughDlsymNames) {
  const core::cuda::Driver* d = core::cuda::GetDriver().value();
  EXPECT_EQ(d->path, KVBTEST_FAKE_CUDA_PATH);
  EXPECT_EQ(d->version, 13000);
  EXPECT_EQ(d->ErrorName(1), "CUDA_ERROR_INVALID_VALUE (1)");
}

TEST_F(MemoryKinds, DeviceSpanInsideItsAllocationIsAcceptedWithItsDevice) {
  DeviceMem m(1, 1 << 20);
  EXPECT_EQ(Must(Check(m.p, m.len, MemoryKind::kCuda, 1)), 1);
  EXPECT_EQ(Must(Check(m.p + 4096, 8192, MemoryKind::kCuda, 1)), 1);  // an inner span
  EXPECT_EQ(Must(Check(m.p, m.len, MemoryKind::kCuda, -1)), 1);       // -1: the pointer's device
}

TEST_F(MemoryKinds, DeviceCheckRetriesWithAContextButHostCheckNeverMakesOne) {
  DeviceMem m(1, 65536);
  const int live = Fake().live_objects();
  Fake().pointer_needs_context(1);
  Result<int> cuda = Check(m.p, m.len, MemoryKind::kCuda, 1);   // retried with device 1 current
  Result<int> host = Check(m.p, m.len, MemoryKind::kHost, -1);  // no context: not detected
  Fake().pointer_needs_context(0);
  EXPECT_EQ(cuda.ok() ? cuda.value() : -100, 1) << cuda.status().ToString();
  EXPECT_TRUE(host.ok()) << host.status().ToString();
  EXPECT_EQ(Fake().live_objects(), live);  // the context taken for the retry was given back
}

TEST_F(MemoryKinds, DeviceSpanPastItsAllocationIsUnknownMemory) {
  DeviceMem m(0, 1 << 20);
  Result<int> r = Check(m.p + 4096, m.len, MemoryKind::kCuda, 0);  // 4 KiB past the end
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kUnknownMemory) << r.status().ToString();
  EXPECT_HAS(r.status().message(), "runs past its CUDA allocation");
  EXPECT_HAS(r.status().message(), "memory type DEVICE");  // the attributes found
  EXPECT_HAS(r.status().message(), "allocation [");
}

TEST_F(MemoryKinds, AnotherDevicesMemoryIsInvalidArgument) {
  DeviceMem m(1, 65536);
  Result<int> r = Check(m.p, m.len, MemoryKind::kCuda, 0);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status().ToString();
  EXPECT_HAS(r.status().message(), "memory of CUDA device 1, not of device_id 0");
}

TEST_F(MemoryKinds, ManagedMemoryIsUnknownMemory) {
  DeviceMem m(0, 65536, /*managed=*/true);
  Result<int> r = Check(m.p, m.len, MemoryKind::kCuda, 0);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kUnknownMemory) << r.status().ToString();
  EXPECT_HAS(r.status().message(), "managed");
  EXPECT_HAS(r.status().message(), "managed yes");
}

TEST_F(MemoryKinds, UnknownPointerIsUnknownMemoryEitherWayTheDriverAnswers) {
  Buffer host(65536);  // plain host memory the driver never saw
  Result<int> r = Check(host.data(), host.size(), MemoryKind::kCuda, 0);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kUnknownMemory) << r.status().ToString();
  EXPECT_HAS(r.status().message(), "CUDA_ERROR_INVALID_VALUE");
  EXPECT_HAS(r.status().message(), "not memory the CUDA driver knows");
  // The real cuPointerGetAttributes answers SUCCESS with memory type 0 for unknown pointers.
  Fake().unknown_as_success(1);
  r = Check(host.data(), host.size(), MemoryKind::kCuda, 0);
  Fake().unknown_as_success(0);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kUnknownMemory) << r.status().ToString();
  EXPECT_HAS(r.status().message(), "unknown to CUDA");
  EXPECT_HAS(r.status().message(), "not memory the CUDA driver knows");
}

TEST_F(MemoryKinds, PinnedHostPointerRegisteredAsCudaIsUnknownMemory) {
  // Host memory the driver knows (cuMemHostAlloc): type HOST, not device memory.
  void* pinned = nullptr;
  {
    const core::cuda::Driver* d = core::cuda::GetDriver().value();
    core::cuda::ScopedDeviceContext ctx(*d, 0);
    ASSERT_TRUE(ctx.status().ok());
    ASSERT_EQ(d->cuMemHostAlloc(&pinned, 8192, 0), 0);
  }
  Result<int> r = Check(pinned, 8192, MemoryKind::kCuda, 0);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kUnknownMemory) << r.status().ToString();
  EXPECT_HAS(r.status().message(), "not CUDA device memory");
  EXPECT_HAS(r.status().message(), "memory type HOST");
  // ... and it is fine as host memory.
  EXPECT_TRUE(Check(pinned, 8192, MemoryKind::kHost, -1).ok());
  EXPECT_EQ(core::cuda::GetDriver().value()->cuMemFreeHost(pinned), 0);
}

TEST_F(MemoryKinds, DevicePointerRegisteredAsHostIsRefusedByTheEngine) {
  auto e = Must(TransferEngine::Create(LoopbackOptions("tcp", "gpu-host-kind")));
  DeviceMem m(0, 65536);
  Result<SegmentId> r = e->RegisterMemory(m.p, m.len, MemoryKind::kHost);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status().ToString();
  EXPECT_HAS(r.status().message(), "CUDA device memory; register with MemoryKind::kCuda");
  // Host memory next to it registers fine (the check is per pointer, not a blanket refusal).
  Buffer host(65536);
  EXPECT_TRUE(e->RegisterMemory(host.data(), host.size()).ok());
}

// kDetect: device memory the driver knows is registered as kCuda of its device (the descriptor
// says so), anything else as host memory.
TEST_F(MemoryKinds, DetectRegistersEachAsWhatItIs) {
  DeviceMem m(1, 1 << 20);
  Buffer host(65536);
  EXPECT_EQ(core::DetectMemoryKind(m.p + 4096), std::make_pair(MemoryKind::kCuda, 1));
  EXPECT_EQ(core::DetectMemoryKind(host.data()), std::make_pair(MemoryKind::kHost, -1));
  auto e = Must(TransferEngine::Create(LoopbackOptions("tcp", "gpu-detect")));
  const SegmentId dev_seg = Must(e->RegisterMemory(m.p, m.len, MemoryKind::kDetect, 0));
  const SegmentId host_seg = Must(e->RegisterMemory(host.data(), host.size(), MemoryKind::kDetect));
  for (const auto& s : Must(core::DecodeDescriptor(e->LocalDescriptor())).segments) {
    if (s.id == dev_seg) {
      EXPECT_EQ(s.mem_kind, static_cast<uint32_t>(MemoryKind::kCuda));
      EXPECT_EQ(s.device_id, 1) << "the pointer's device, not the device_id passed";
    } else {
      EXPECT_EQ(s.id, host_seg);
      EXPECT_EQ(s.mem_kind, static_cast<uint32_t>(MemoryKind::kHost));
    }
  }
}

TEST_F(MemoryKinds, UnmappedHostRangeIsUnknownMemory) {
  auto e = Must(TransferEngine::Create(LoopbackOptions("tcp", "gpu-unmapped")));
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  auto* p = static_cast<char*>(
      mmap(nullptr, 3 * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  ASSERT_NE(p, MAP_FAILED);
  ASSERT_EQ(munmap(p + page, page), 0);  // a hole in the middle
  Result<SegmentId> r = e->RegisterMemory(p, 3 * page);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kUnknownMemory) << r.status().ToString();
  EXPECT_HAS(r.status().message(), "not mapped host memory");
  // The mapped first page alone is fine.
  EXPECT_TRUE(e->RegisterMemory(p, page).ok());
  munmap(p, page);
  munmap(p + 2 * page, page);
}

// The child half of MemoryKinds.NoDriverIsUnavailableNamingTheLibrary (with
// DeviceServicesNoDriverChild.*): runs only when started by it, in a
// process whose KVBRIDGE_CUDA_DRIVER names no loadable library.
TEST(MemoryKindsNoDriverChild, CudaIsUnavailableHostStillWorks) {
  if (!testing::IsSelfChild()) GTEST_SKIP() << "runs as a child of NoDriverIsUnavailable...";
  const char* expect = std::getenv("KVBTEST_EXPECT_LIBRARY");
  ASSERT_NE(expect, nullptr);
  Buffer host(65536);
  Result<int> r = core::CheckMemoryKind(host.data(), host.size(), MemoryKind::kCuda, 0);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kUnavailable) << r.status().ToString();
  EXPECT_HAS(r.status().message(), std::string("no CUDA driver (") + expect + "): ");
  // The same cached answer each time.
  EXPECT_EQ(core::CheckMemoryKind(host.data(), 4096, MemoryKind::kCuda, -1).status().message(),
            r.status().message());
  // Host memory needs no driver; kDetect without one is host memory.
  auto e = Must(TransferEngine::Create(LoopbackOptions("tcp", "gpu-nodriver")));
  EXPECT_TRUE(e->RegisterMemory(host.data(), host.size()).ok());
  Buffer other(65536);
  EXPECT_EQ(core::DetectMemoryKind(other.data()), std::make_pair(MemoryKind::kHost, -1));
  EXPECT_TRUE(e->RegisterMemory(other.data(), other.size(), MemoryKind::kDetect).ok());
}

TEST_F(MemoryKinds, NoDriverIsUnavailableNamingTheLibrary) {
  // A driver path that does not exist.
  std::string out;
  const char* missing = "/nonexistent/libcuda-missing.so.1";
  EXPECT_EQ(testing::RunSelf(
                "*NoDriverChild.*",
                {{"KVBRIDGE_CUDA_DRIVER", missing}, {"KVBTEST_EXPECT_LIBRARY", missing}}, &out),
            0)
      << out;
  EXPECT_HAS(out, "[       OK ] MemoryKindsNoDriverChild.CudaIsUnavailableHostStillWorks");
  EXPECT_HAS(out, "[       OK ] DeviceServicesNoDriverChild.AllAnswerUnavailable");
  // No variable: libcuda.so.1, absent on a machine without the CUDA driver.
  if (void* real = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL)) {
    dlclose(real);
    GTEST_SKIP() << "this machine has libcuda.so.1; the default-library half needs it absent";
  }
  out.clear();
  EXPECT_EQ(
      testing::RunSelf(
          "*NoDriverChild.*",
          {{"KVBRIDGE_CUDA_DRIVER", nullptr}, {"KVBTEST_EXPECT_LIBRARY", "libcuda.so.1"}}, &out),
      0)
      << out;
  EXPECT_HAS(out, "[       OK ] MemoryKindsNoDriverChild.CudaIsUnavailableHostStillWorks");
  EXPECT_HAS(out, "[       OK ] DeviceServicesNoDriverChild.AllAnswerUnavailable");
}

}  // namespace
}  // namespace kvbridge
