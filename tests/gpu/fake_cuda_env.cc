#include "tests/gpu/fake_cuda_env.h"

#include <dlfcn.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "tests/common/run_self.h"

namespace kvbridge::testing {

bool RealCuda() {
  const char* v = std::getenv("KVBTEST_REAL_CUDA");
  return v != nullptr && v[0] == '1';
}

namespace {

constexpr const char* kChildMarker = "KVBTEST_GPU_SELF_CHILD";

// Before main, so before anything can load the driver.
const bool g_env_set = [] {
  if (std::getenv(kChildMarker) == nullptr && !RealCuda())
    setenv("KVBRIDGE_CUDA_DRIVER", KVBTEST_FAKE_CUDA_PATH, 1);
  return true;
}();

template <typename Fn>
void Sym(void* lib, const char* name, Fn* out) {
  *out = reinterpret_cast<Fn>(dlsym(lib, name));
  if (*out == nullptr) {
    std::fprintf(stderr, "fake CUDA driver %s lacks %s\n", KVBTEST_FAKE_CUDA_PATH, name);
    std::abort();
  }
}

}  // namespace

const FakeCuda& Fake() {
  static const FakeCuda fake = [] {
    void* lib = dlopen(KVBTEST_FAKE_CUDA_PATH, RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      std::fprintf(stderr, "cannot open the fake CUDA driver: %s\n", dlerror());
      std::abort();
    }
    FakeCuda f{};
    Sym(lib, "kvbtest_fake_cuda_alloc", &f.alloc);
    Sym(lib, "kvbtest_fake_cuda_alloc_managed", &f.alloc_managed);
    Sym(lib, "kvbtest_fake_cuda_free", &f.free);
    Sym(lib, "kvbtest_fake_cuda_set_latency_us", &f.set_latency_us);
    Sym(lib, "kvbtest_fake_cuda_set_stall", &f.set_stall);
    Sym(lib, "kvbtest_fake_cuda_fail_next_copy", &f.fail_next_copy);
    Sym(lib, "kvbtest_fake_cuda_fail_next_copy_to_host", &f.fail_next_copy_to_host);
    Sym(lib, "kvbtest_fake_cuda_set_guarded", &f.set_guarded);
    Sym(lib, "kvbtest_fake_cuda_host_view", &f.host_view);
    Sym(lib, "kvbtest_fake_cuda_unknown_as_success", &f.unknown_as_success);
    Sym(lib, "kvbtest_fake_cuda_pointer_needs_context", &f.pointer_needs_context);
    Sym(lib, "kvbtest_fake_cuda_copies", &f.copies);
    Sym(lib, "kvbtest_fake_cuda_live_objects", &f.live_objects);
    Sym(lib, "kvbtest_fake_cuda_copy_log", &f.copy_log);
    Sym(lib, "kvbtest_fake_cuda_clear_copy_log", &f.clear_copy_log);
    return f;
  }();
  return fake;
}

bool IsSelfChild() { return testing::IsSelfChild(kChildMarker); }

int RunSelf(const std::string& test, const std::vector<std::pair<std::string, const char*>>& set,
            std::string* out) {
  return testing::RunSelf(kChildMarker, test, set, out);
}

uint8_t* GuardedAlloc(int device, size_t len) {
  Fake().set_guarded(1);
  auto* p = static_cast<uint8_t*>(Fake().alloc(device, len));
  Fake().set_guarded(0);
  if (p == nullptr) std::abort();
  return p;
}

FakeDeviceMemory::FakeDeviceMemory(size_t len, int device)
    : p_(GuardedAlloc(device, len)), view_(static_cast<uint8_t*>(Fake().host_view(p_))), n_(len) {
  if (view_ == p_) std::abort();  // not guarded: the fake is too old for these tests
}

FakeDeviceMemory::~FakeDeviceMemory() { Fake().free(p_); }

}  // namespace kvbridge::testing
