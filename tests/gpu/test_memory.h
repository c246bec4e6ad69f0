// Test memory for the GPU tests (tests/gpu, tests/verbs' staging tests): host memory, or device
// memory that is the fake CUDA driver's (tests/fakes/fake_cuda.cc, guarded: kvbridge faults if
// it touches it on the CPU, the test reads and writes it through the fake's host view) or, with
// KVBTEST_REAL_CUDA=1, real device memory read and written with the driver's synchronous
// copies (benchmarks/gpu_check.sh). Links the static core (core/cuda_driver.h). Not
// synchronized: one test thread uses it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "core/cuda_driver.h"
#include "kvbridge/engine.h"
#include "tests/common/test_util.h"
#include "tests/gpu/fake_cuda_env.h"

namespace kvbridge::testing {

// KVBRIDGE_REQUIRE_GPU=1: a GPU test fails rather than skips without a usable driver.
bool GpuRequired();

// The real driver's allocation and synchronous copy calls, for KVBTEST_REAL_CUDA=1 (the engine
// loads the driver; these are looked up in the same library). nullptr with *why otherwise.
struct RealDriver {
  const core::cuda::Driver* d = nullptr;
  int devices = 0;
  core::cuda::CUresult (*alloc)(core::cuda::CUdeviceptr*, size_t) = nullptr;
  core::cuda::CUresult (*free)(core::cuda::CUdeviceptr) = nullptr;
  core::cuda::CUresult (*htod)(core::cuda::CUdeviceptr, const void*, size_t) = nullptr;
  core::cuda::CUresult (*dtoh)(void*, core::cuda::CUdeviceptr, size_t) = nullptr;
};
const RealDriver* Real(std::string* why);

// Host or device test memory (see the top of this file).
class TestMemory {
 public:
  TestMemory(MemoryKind kind, size_t len, int device = 0) : kind_(kind), n_(len), device_(device) {
    if (kind == MemoryKind::kHost) {
      host_ = std::make_unique<Buffer>(len);
      p_ = host_->data();
    } else if (!RealCuda()) {
      p_ = GuardedAlloc(device, len);
    } else {
      std::string why;
      const RealDriver* r = Real(&why);
      core::cuda::ScopedDeviceContext ctx(*r->d, device);
      core::cuda::CUdeviceptr dp = 0;
      if (r->alloc(&dp, len) != 0) std::abort();
      p_ = reinterpret_cast<uint8_t*>(dp);
    }
  }
  ~TestMemory() {
    if (kind_ == MemoryKind::kHost) return;
    if (!RealCuda()) {
      Fake().free(p_);
      return;
    }
    std::string why;
    const RealDriver* r = Real(&why);
    core::cuda::ScopedDeviceContext ctx(*r->d, device_);
    (void)r->free(reinterpret_cast<core::cuda::CUdeviceptr>(p_));
  }
  TestMemory(const TestMemory&) = delete;
  TestMemory& operator=(const TestMemory&) = delete;
  uint8_t* data() const { return p_; }
  size_t size() const { return n_; }
  MemoryKind kind() const { return kind_; }
  int device() const { return device_; }

  void Put(size_t off, const uint8_t* src, size_t n) {
    if (!Staged()) {
      std::memcpy(View() + off, src, n);
      return;
    }
    std::string why;
    const RealDriver* r = Real(&why);
    core::cuda::ScopedDeviceContext ctx(*r->d, device_);
    if (r->htod(reinterpret_cast<core::cuda::CUdeviceptr>(p_ + off), src, n) != 0) std::abort();
  }
  std::vector<uint8_t> Get(size_t off, size_t n) const {
    std::vector<uint8_t> out(n);
    if (!Staged()) {
      std::memcpy(out.data(), View() + off, n);
      return out;
    }
    std::string why;
    const RealDriver* r = Real(&why);
    core::cuda::ScopedDeviceContext ctx(*r->d, device_);
    if (r->dtoh(out.data(), reinterpret_cast<core::cuda::CUdeviceptr>(p_ + off), n) != 0) {
      std::abort();
    }
    return out;
  }
  // Bytes PatternByte(seed, 0 .. n) at [off, off + n).
  void Fill(uint64_t seed, size_t off, size_t n) {
    std::vector<uint8_t> b(n);
    for (size_t i = 0; i < n; ++i) b[i] = PatternByte(seed, i);
    Put(off, b.data(), n);
  }
  void Zero() {
    std::vector<uint8_t> z(n_, 0);
    Put(0, z.data(), n_);
  }
  // The first i in [0, n) where the byte at off + i is not PatternByte(seed, i); n if none.
  size_t FirstBad(uint64_t seed, size_t off, size_t n) const {
    const std::vector<uint8_t> b = Get(off, n);
    for (size_t i = 0; i < n; ++i) {
      if (b[i] != PatternByte(seed, i)) return i;
    }
    return n;
  }

 private:
  bool Staged() const { return kind_ == MemoryKind::kCuda && RealCuda(); }
  // Where the test touches the bytes: the fake's host view of its device memory.
  uint8_t* View() const {
    return kind_ == MemoryKind::kCuda ? static_cast<uint8_t*>(Fake().host_view(p_)) : p_;
  }
  MemoryKind kind_;
  size_t n_;
  int device_;
  std::unique_ptr<Buffer> host_;
  uint8_t* p_ = nullptr;
};

}  // namespace kvbridge::testing
