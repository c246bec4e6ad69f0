// The fake CUDA driver as the tests see it: this binary points KVBRIDGE_CUDA_DRIVER at
// libkvbtest_fake_cuda.so before main (unless it runs as a child of itself, which keeps the
// environment its parent gave it), and Fake() opens the same library to reach its test-only
// controls (tests/fakes/fake_cuda.cc). RunSelf runs one test of this binary in a fresh process,
// for what the once-per-process driver load cannot show in this one (no driver at all).
// Not synchronized: tests use it from their own thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace kvbridge::testing {

// One copy in the fake driver's log (its CopyRecord): steady_clock nanoseconds (end_ns 0 while
// queued or running), addresses, and the CUresult it ended with.
struct FakeCopyRecord {
  uint64_t queued_ns;
  uint64_t start_ns;
  uint64_t end_ns;
  uint64_t dst;
  uint64_t src;
  uint64_t len;
  int32_t error;
  int32_t reserved;
};

struct FakeCuda {
  void* (*alloc)(int device, size_t len);
  void* (*alloc_managed)(int device, size_t len);
  void (*free)(void* p);
  void (*set_latency_us)(uint32_t us);
  void (*set_stall)(int on);
  void (*fail_next_copy)(int cuda_error);
  // The next device-to-host copy fails (copies the other way are not counted).
  void (*fail_next_copy_to_host)(int cuda_error);
  // 1: device allocations made from now on fault on any CPU access (tests/fakes/fake_cuda.cc);
  // read and write their bytes through host_view(p) then.
  void (*set_guarded)(int on);
  void* (*host_view)(void* p);
  void (*unknown_as_success)(int on);
  void (*pointer_needs_context)(int on);
  uint64_t (*copies)();
  int (*live_objects)();
  // Every copy queued since the last clear, in queue order: fills up to max, returns the count.
  size_t (*copy_log)(FakeCopyRecord* out, size_t max);
  void (*clear_copy_log)();
};

// The controls of the fake driver (dlopened once; aborts the test binary if it is missing).
const FakeCuda& Fake();

// KVBTEST_REAL_CUDA=1: the real driver (libcuda.so.1, or KVBRIDGE_CUDA_DRIVER) is left in
// place and the tests that can run on it use real device memory (benchmarks/gpu_check.sh,
// stage tcp-device); Fake() must not be used then.
bool RealCuda();

// True in a child started by RunSelf.
bool IsSelfChild();

// Runs this binary with --gtest_filter=`test` and the environment changed by `set` (value
// nullptr: unset); returns its exit status (0: the test passed) and appends its output to *out.
int RunSelf(const std::string& test, const std::vector<std::pair<std::string, const char*>>& set,
            std::string* out);

// Fake device memory in the fake driver's guarded mode: faults on any CPU access (aborts the
// test binary if the fake cannot allocate it).
uint8_t* GuardedAlloc(int device, size_t len);

// Guarded fake device memory as an object: data() is what kvbridge gets and faults on any CPU
// access; the test reads and writes the same bytes through view(). Freed on destruction.
class FakeDeviceMemory {
 public:
  explicit FakeDeviceMemory(size_t len, int device = 0);
  ~FakeDeviceMemory();
  FakeDeviceMemory(const FakeDeviceMemory&) = delete;
  FakeDeviceMemory& operator=(const FakeDeviceMemory&) = delete;
  uint8_t* data() const { return p_; }
  uint8_t* view() const { return view_; }
  size_t size() const { return n_; }

 private:
  uint8_t* p_;
  uint8_t* view_;
  size_t n_;
};

}  // namespace kvbridge::testing
