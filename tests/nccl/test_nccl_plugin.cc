// libkvb_transport_nccl.so through the real plugin host: its probe answers with NCCL's and the
// CUDA driver's state here (UNAVAILABLE naming why on a machine without a GPU), an engine with
// default transports starts with the plugin in its plugin directory, and an engine that names
// ["nccl"] fails with that reason. Where the probe is OK (a GPU), the real NCCL and driver run:
// device memory from cuMemAlloc is registered, and with two GPUs bytes move between two
// instances. Those cases skip saying why elsewhere, and fail instead under
// KVBRIDGE_REQUIRE_GPU=1 (benchmarks/gpu_check.sh).
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "core/plugin_loader.h"
#include "kvbridge/engine.h"
#include "nccl_cuda.h"
#include "nccl_loader.h"
#include "tests/nccl/nccl_test_util.h"

namespace kvbridge::nccl::test {
namespace {

constexpr const char* kPlugin = KVBRIDGE_PLUGIN_BUILD_DIR "/libkvb_transport_nccl.so";

bool Contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

bool GpuRequired() {
  const char* v = std::getenv("KVBRIDGE_REQUIRE_GPU");
  return v != nullptr && std::strcmp(v, "1") == 0;
}

TEST(NcclPlugin, LoadsAndProbesThroughThePluginHost) {
  core::PluginRegistry reg;
  const core::PluginInfo& info = reg.LoadFile(kPlugin);
  EXPECT_EQ(info.name, "nccl");
  EXPECT_EQ(info.kind, KVB_PLUGIN_TRANSPORT);
  const sdk::Status here = [] {
    auto n = LoadNcclOnce();
    return n.ok() ? ProbeNccl(*n) : n.status();
  }();
  if (here.ok()) {
    EXPECT_EQ(info.state, core::PluginState::kLoaded) << info.reason;
    return;
  }
  ASSERT_EQ(info.state, core::PluginState::kUnavailable) << info.reason;
  EXPECT_TRUE(Contains(info.reason, "NCCL")) << info.reason;
  EXPECT_TRUE(Contains(info.reason, here.message())) << info.reason << " vs " << here.message();
  std::printf("nccl plugin here: %s\n", info.reason.c_str());
}

TEST(NcclPlugin, DefaultEngineStartsAndNamingNcclFailsClearly) {
  EngineOptions o;
  o.node_id = "nccl-plugin-test";
  o.plugin_path = KVBRIDGE_PLUGIN_BUILD_DIR;
  auto e = TransferEngine::Create(o);
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  e->reset();

  auto n = LoadNcclOnce();
  const sdk::Status here = n.ok() ? ProbeNccl(*n) : n.status();
  o.transports = {"nccl"};
  auto named = TransferEngine::Create(o);
  if (here.ok()) {
    EXPECT_TRUE(named.ok()) << named.status().ToString();
    return;
  }
  ASSERT_FALSE(named.ok());
  const std::string msg = named.status().ToString();
  EXPECT_TRUE(Contains(msg, "nccl")) << msg;
  EXPECT_TRUE(Contains(msg, here.message())) << msg;
}

// ---- the real NCCL and CUDA driver --------------------------------------------------------------

// The driver's allocation calls, looked up in the library CudaOps loaded.
struct DeviceMemory {
  int (*alloc)(uint64_t*, size_t) = nullptr;
  int (*free)(uint64_t) = nullptr;
  int (*htod)(uint64_t, const void*, size_t) = nullptr;
  int (*dtoh)(void*, uint64_t, size_t) = nullptr;
  int (*count)(int*) = nullptr;
  std::string why;
};

DeviceMemory Driver(const CudaOps& cuda) {
  DeviceMemory d;
  void* lib = dlopen(cuda.path.c_str(), RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
  if (lib == nullptr) {
    d.why = "cannot reopen " + cuda.path;
    return d;
  }
  d.alloc = reinterpret_cast<decltype(d.alloc)>(dlsym(lib, "cuMemAlloc_v2"));
  d.free = reinterpret_cast<decltype(d.free)>(dlsym(lib, "cuMemFree_v2"));
  d.htod = reinterpret_cast<decltype(d.htod)>(dlsym(lib, "cuMemcpyHtoD_v2"));
  d.dtoh = reinterpret_cast<decltype(d.dtoh)>(dlsym(lib, "cuMemcpyDtoH_v2"));
  d.count = reinterpret_cast<decltype(d.count)>(dlsym(lib, "cuDeviceGetCount"));
  if (!d.alloc || !d.free || !d.htod || !d.dtoh || !d.count) d.why = cuda.path + " lacks cuMem*";
  return d;
}

// The real tables, or why there are none (the test then skips, or fails under REQUIRE_GPU).
bool RealTables(const Nccl** nccl, const CudaOps** cuda, std::string* why) {
  auto n = LoadNcclOnce();
  sdk::Status st = n.ok() ? ProbeNccl(*n) : n.status();
  if (st.ok()) {
    auto c = LoadCudaOpsOnce();
    if (c.ok()) {
      *nccl = *n;
      *cuda = *c;
      return true;
    }
    st = c.status();
  }
  *why = st.message();
  return false;
}

#define KVB_NEED_GPU(why)                                                 \
  do {                                                                    \
    if (GpuRequired()) FAIL() << "KVBRIDGE_REQUIRE_GPU=1 but: " << (why); \
    GTEST_SKIP() << (why);                                                \
  } while (0)

TEST(NcclGpu, RegistersDeviceMemoryAndRefusesHostMemory) {
  const Nccl* nccl = nullptr;
  const CudaOps* cuda = nullptr;
  std::string why;
  if (!RealTables(&nccl, &cuda, &why)) KVB_NEED_GPU(why);
  DeviceMemory dm = Driver(*cuda);
  ASSERT_TRUE(dm.why.empty()) << dm.why;
  sdk::Status err;
  auto a = Node::MakeWith(Node::Options{}, nccl, cuda, &err);
  ASSERT_TRUE(a) << err.message();
  ASSERT_EQ(cuda->use_device(0), 0);
  uint64_t dev = 0;
  ASSERT_EQ(dm.alloc(&dev, 1 << 20), 0);
  EXPECT_TRUE(a->Register(1, reinterpret_cast<void*>(dev), 1 << 20).ok());
  std::vector<uint8_t> host(4096);
  EXPECT_EQ(a->Register(2, host.data(), host.size(), KVB_MEM_HOST, -1).code(), KVB_ERR_UNSUPPORTED);
  a.reset();
  dm.free(dev);
}

TEST(NcclGpu, WriteAndReadBetweenTwoGpus) {
  const Nccl* nccl = nullptr;
  const CudaOps* cuda = nullptr;
  std::string why;
  if (!RealTables(&nccl, &cuda, &why)) KVB_NEED_GPU(why);
  DeviceMemory dm = Driver(*cuda);
  ASSERT_TRUE(dm.why.empty()) << dm.why;
  int gpus = 0;
  ASSERT_EQ(dm.count(&gpus), 0);
  if (gpus < 2) {
    // NCCL refuses two ranks of one communicator on one GPU ("Duplicate GPU detected").
    GTEST_SKIP() << "needs two GPUs (this machine has " << gpus
                 << "): NCCL refuses two ranks of one communicator on one GPU";
  }
  constexpr size_t kLen = 8 << 20;
  uint64_t mem[2] = {0, 0};
  for (int d = 0; d < 2; ++d) {
    ASSERT_EQ(cuda->use_device(d), 0);
    ASSERT_EQ(dm.alloc(&mem[d], kLen), 0);
  }
  Node::Options ao, bo;
  ao.node_id = "gpu-a";
  bo.node_id = "gpu-b";
  bo.incarnation = 2;
  bo.config["nccl.device"] = "1";
  sdk::Status err;
  auto a = Node::MakeWith(ao, nccl, cuda, &err);
  ASSERT_TRUE(a) << err.message();
  auto b = Node::MakeWith(bo, nccl, cuda, &err);
  ASSERT_TRUE(b) << err.message();
  ASSERT_TRUE(a->Register(1, reinterpret_cast<void*>(mem[0]), kLen, KVB_MEM_CUDA, 0).ok());
  ASSERT_TRUE(b->Register(1, reinterpret_cast<void*>(mem[1]), kLen, KVB_MEM_CUDA, 1).ok());
  Peer* p = a->AddPeer(*b);
  ASSERT_NE(p, nullptr);
  std::vector<uint8_t> data(kLen), back(kLen);
  for (size_t i = 0; i < kLen; ++i) data[i] = static_cast<uint8_t>(i * 13 + 1);
  ASSERT_EQ(cuda->use_device(0), 0);
  ASSERT_EQ(dm.htod(mem[0], data.data(), kLen), 0);
  Outcome w = a->Run(p, KVB_OP_WRITE, 1, reinterpret_cast<void*>(mem[0]), kLen, 1, 0, 20000);
  ASSERT_EQ(w.status, KVB_OK) << w.msg;
  ASSERT_EQ(cuda->use_device(1), 0);
  ASSERT_EQ(dm.dtoh(back.data(), mem[1], kLen), 0);
  EXPECT_EQ(back, data);
  Outcome r =
      a->Run(p, KVB_OP_READ, 1, reinterpret_cast<void*>(mem[0] + 4096), kLen / 2, 1, 0, 20000);
  ASSERT_EQ(r.status, KVB_OK) << r.msg;
  ASSERT_EQ(cuda->use_device(0), 0);
  ASSERT_EQ(dm.dtoh(back.data(), mem[0] + 4096, kLen / 2), 0);
  EXPECT_EQ(std::memcmp(back.data(), data.data(), kLen / 2), 0);
  a.reset();
  b.reset();
  for (uint64_t m : mem) dm.free(m);
}

}  // namespace
}  // namespace kvbridge::nccl::test
