// libkvbtest_fake_cuda.so: a stand-in for libcuda.so.1 so that the engine's CUDA paths run on a
// machine without a GPU. Tests point KVBRIDGE_CUDA_DRIVER at it (core/cuda_driver.h).
//
// It exports the driver entry points core/cuda_driver.cc loads (by their dlsym names; there is
// no cuGetProcAddress, so the dlsym fallback is what runs) over host memory:
//  - "device allocations" are host memory it tracks, made by kvbtest_fake_cuda_alloc (or
//    _alloc_managed); cuPointerGetAttributes answers for them (type, device, range, managed)
//    and for pinned memory from cuMemHostAlloc (type HOST), and CUDA_ERROR_INVALID_VALUE for
//    any other pointer (or, after kvbtest_fake_cuda_unknown_as_success(1), SUCCESS with type 0,
//    as the real cuPointerGetAttributes does; after kvbtest_fake_cuda_pointer_needs_context(1),
//    CUDA_ERROR_INVALID_CONTEXT while no context is current);
//  - two devices; primary contexts must be current (push/pop per thread) for the calls that
//    need one in the real driver (stream, event, copy, host alloc), else INVALID_CONTEXT;
//  - each stream has a worker thread running its copies (memcpy) and event records in order,
//    with a configurable latency per copy, a stall switch that holds copies until cleared, and
//    error injection: the next copy fails with a given CUresult, which the next event recorded
//    on that stream reports (cuEventQuery/Synchronize), as a failed async copy does;
//  - a log of every copy (when it was queued, when it started and ended, addresses, result),
//    read with kvbtest_fake_cuda_copy_log, so tests can check the order of copies against
//    other events (tests/gpu/test_tcp_device.cc: staging overlaps copies with the wire);
//  - guarded device memory: after kvbtest_fake_cuda_set_guarded(1), each new device allocation
//    (not managed, not pinned) is a memfd mapped twice, PROT_NONE at the address handed out
//    and read-write at another that only the fake's copies (and kvbtest_fake_cuda_host_view,
//    for the tests' own checks) use. Whoever dereferences a "device pointer" on the CPU
//    then faults, as on a real GPU, instead of quietly reading host memory.
// Thread-safe: one mutex guards the tables; each stream has its own queue lock.
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

namespace {

using CUresult = int;
using CUdeviceptr = unsigned long long;  // NOLINT: the driver's type

constexpr CUresult kSuccess = 0;
constexpr CUresult kInvalidValue = 1;
constexpr CUresult kOutOfMemory = 2;
constexpr CUresult kInvalidDevice = 101;
constexpr CUresult kInvalidContext = 201;
constexpr CUresult kNotReady = 600;
constexpr int kDevices = 2;

struct Alloc {
  size_t size = 0;
  int device = -1;    // -1: pinned host memory
  unsigned type = 2;  // CU_MEMORYTYPE_DEVICE, or 1 (HOST) for pinned
  unsigned managed = 0;
  uintptr_t alias = 0;  // guarded: the read-write mapping of the same pages; 0 otherwise
  size_t mapped = 0;    // guarded: bytes of each mapping
};

struct Event {
  std::mutex mu;
  std::condition_variable cv;
  bool pending = false;
  CUresult error = kSuccess;
};

struct Op {
  bool copy = true;
  void* dst = nullptr;  // what memmove uses: the read-write alias of guarded memory
  const void* src = nullptr;
  size_t len = 0;
  bool to_host = false;  // from device memory to memory that is not
  Event* event = nullptr;
  size_t log_index = 0;
  uint64_t log_generation = 0;  // the log's generation when queued (a clear starts another)
};

// One copy as the log keeps it; the same layout as kvbridge::testing::FakeCopyRecord
// (tests/gpu/fake_cuda_env.h). Times are steady_clock nanoseconds (CLOCK_MONOTONIC).
struct CopyRecord {
  uint64_t queued_ns = 0;
  uint64_t start_ns = 0;
  uint64_t end_ns = 0;  // 0 while queued or running
  uint64_t dst = 0;
  uint64_t src = 0;
  uint64_t len = 0;
  int32_t error = 0;
  int32_t reserved = 0;
};

std::mutex g_log_mu;
std::vector<CopyRecord> g_log;
uint64_t g_log_generation = 0;

uint64_t NowNs() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::steady_clock::now().time_since_epoch())
                                   .count());
}

struct Stream;

std::mutex g_mu;
std::map<uintptr_t, Alloc> g_allocs;
std::atomic<uint32_t> g_latency_us{0};
std::atomic<bool> g_stall{false};
std::atomic<CUresult> g_fail_next_copy{kSuccess};
std::atomic<CUresult> g_fail_next_copy_to_host{kSuccess};
std::atomic<bool> g_guarded{false};
std::atomic<int> g_guarded_live{0};
std::atomic<bool> g_unknown_as_success{false};
std::atomic<bool> g_pointer_needs_context{false};
std::atomic<uint64_t> g_copies{0};
std::atomic<int> g_init_calls{0};
std::atomic<int> g_live_streams{0};
std::atomic<int> g_live_events{0};
std::atomic<int> g_primary_retained{0};
thread_local std::vector<int> t_ctx_stack;  // device ordinals of the contexts pushed

// Fake context handles: (device + 1) as a pointer.
void* CtxOf(int device) { return reinterpret_cast<void*>(static_cast<uintptr_t>(device + 1)); }
bool HasContext() { return !t_ctx_stack.empty(); }

struct Stream {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Op> ops;
  bool closing = false;
  CUresult error = kSuccess;  // of copies since the last event
  std::thread worker;

  Stream() : worker([this] { Run(); }) {}

  void Push(Op op) {
    std::lock_guard<std::mutex> lock(mu);
    ops.push_back(op);
    cv.notify_all();
  }

  void Run() {
    for (;;) {
      Op op;
      {
        std::unique_lock<std::mutex> lock(mu);
        cv.wait(lock, [&] { return closing || !ops.empty(); });
        if (ops.empty()) return;
        op = ops.front();
        ops.pop_front();
      }
      if (op.copy) {
        {
          std::lock_guard<std::mutex> lock(g_log_mu);
          if (op.log_generation == g_log_generation) g_log[op.log_index].start_ns = NowNs();
        }
        if (uint32_t us = g_latency_us.load())
          std::this_thread::sleep_for(std::chrono::microseconds(us));
        while (g_stall.load()) std::this_thread::sleep_for(std::chrono::microseconds(200));
        CUresult fail = g_fail_next_copy.exchange(kSuccess);
        if (fail == kSuccess && op.to_host) fail = g_fail_next_copy_to_host.exchange(kSuccess);
        if (fail != kSuccess) {
          error = fail;
        } else {
          std::memmove(op.dst, op.src, op.len);
          g_copies.fetch_add(1);
        }
        std::lock_guard<std::mutex> lock(g_log_mu);
        if (op.log_generation == g_log_generation) {
          g_log[op.log_index].end_ns = NowNs();
          g_log[op.log_index].error = fail;
        }
      } else {
        std::lock_guard<std::mutex> lock(op.event->mu);
        op.event->pending = false;
        op.event->error = error;
        error = kSuccess;
        op.event->cv.notify_all();
      }
    }
  }

  ~Stream() {
    {
      std::lock_guard<std::mutex> lock(mu);
      closing = true;
      cv.notify_all();
    }
    worker.join();  // runs what is queued first, as cuStreamDestroy lets queued work finish
  }
};

const Alloc* Find(uintptr_t p, uintptr_t* start) {
  auto it = g_allocs.upper_bound(p);
  if (it == g_allocs.begin()) return nullptr;
  --it;
  if (p >= it->first + it->second.size) return nullptr;
  *start = it->first;
  return &it->second;
}

// Guarded device memory: one memfd, PROT_NONE at the address returned, read-write at *alias.
void* MapGuarded(size_t bytes, uintptr_t* alias) {
  const int fd = memfd_create("kvbtest-fake-cuda", MFD_CLOEXEC);
  if (fd < 0) return nullptr;
  void* none = MAP_FAILED;
  void* rw = MAP_FAILED;
  if (ftruncate(fd, static_cast<off_t>(bytes)) == 0) {
    none = mmap(nullptr, bytes, PROT_NONE, MAP_SHARED, fd, 0);
    rw = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  }
  close(fd);  // the mappings keep the pages
  if (none == MAP_FAILED || rw == MAP_FAILED) {
    if (none != MAP_FAILED) munmap(none, bytes);
    if (rw != MAP_FAILED) munmap(rw, bytes);
    return nullptr;
  }
  *alias = reinterpret_cast<uintptr_t>(rw);
  return none;
}

void* Track(size_t len, Alloc a) {
  const size_t bytes = (len + 4095) & ~size_t{4095};
  void* p = nullptr;
  if (g_guarded.load() && a.type == 2 && a.managed == 0) {
    p = MapGuarded(bytes, &a.alias);
    a.mapped = bytes;
  } else {
    p = std::aligned_alloc(4096, bytes);
  }
  if (p == nullptr) return nullptr;
  if (a.alias != 0) g_guarded_live.fetch_add(1);
  a.size = len;
  std::lock_guard<std::mutex> lock(g_mu);
  g_allocs[reinterpret_cast<uintptr_t>(p)] = a;
  return p;
}

// Forgets an allocation and gives its memory back; false for a pointer that is not one.
bool Release(void* p) {
  Alloc a;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    auto it = g_allocs.find(reinterpret_cast<uintptr_t>(p));
    if (it == g_allocs.end()) return false;
    a = it->second;
    g_allocs.erase(it);
  }
  if (a.alias == 0) {
    std::free(p);
    return true;
  }
  munmap(p, a.mapped);
  munmap(reinterpret_cast<void*>(a.alias), a.mapped);
  g_guarded_live.fetch_sub(1);
  return true;
}

// Where the CPU may touch the bytes at p: the read-write alias of guarded memory, else p.
void* HostView(uintptr_t p) {
  if (g_guarded_live.load() == 0) return reinterpret_cast<void*>(p);
  std::lock_guard<std::mutex> lock(g_mu);
  uintptr_t start = 0;
  const Alloc* a = Find(p, &start);
  if (a == nullptr || a->alias == 0) return reinterpret_cast<void*>(p);
  return reinterpret_cast<void*>(a->alias + (p - start));
}

bool IsDeviceMemory(uintptr_t p) {
  std::lock_guard<std::mutex> lock(g_mu);
  uintptr_t start = 0;
  const Alloc* a = Find(p, &start);
  return a != nullptr && a->type == 2;
}

}  // namespace

extern "C" {

// ---- test-only controls ----------------------------------------------------------------------
__attribute__((visibility("default"))) void* kvbtest_fake_cuda_alloc(int device, size_t len) {
  if (device < 0 || device >= kDevices || len == 0) return nullptr;
  return Track(len, Alloc{0, device, 2, 0});
}
__attribute__((visibility("default"))) void* kvbtest_fake_cuda_alloc_managed(int device,
                                                                             size_t len) {
  if (device < 0 || device >= kDevices || len == 0) return nullptr;
  return Track(len, Alloc{0, device, 2, 1});
}
__attribute__((visibility("default"))) void kvbtest_fake_cuda_free(void* p) {
  if (p != nullptr) (void)Release(p);
}
// 1: device allocations made from now on are guarded (see the top of this file); 0: plain host
// memory again (the default).
__attribute__((visibility("default"))) void kvbtest_fake_cuda_set_guarded(int on) {
  g_guarded = on != 0;
}
// Where a test reads and writes the bytes of fake device memory at p (p itself unless guarded).
__attribute__((visibility("default"))) void* kvbtest_fake_cuda_host_view(void* p) {
  return HostView(reinterpret_cast<uintptr_t>(p));
}
__attribute__((visibility("default"))) void kvbtest_fake_cuda_set_latency_us(uint32_t us) {
  g_latency_us = us;
}
__attribute__((visibility("default"))) void kvbtest_fake_cuda_set_stall(int on) {
  g_stall = on != 0;
}
__attribute__((visibility("default"))) void kvbtest_fake_cuda_fail_next_copy(int cuda_error) {
  g_fail_next_copy = cuda_error;
}
// As fail_next_copy, for the next copy from device memory to memory that is not (device to
// host): copies the other way go through untouched.
__attribute__((visibility("default"))) void kvbtest_fake_cuda_fail_next_copy_to_host(
    int cuda_error) {
  g_fail_next_copy_to_host = cuda_error;
}
__attribute__((visibility("default"))) void kvbtest_fake_cuda_unknown_as_success(int on) {
  g_unknown_as_success = on != 0;
}
// cuPointerGetAttributes answers CUDA_ERROR_INVALID_CONTEXT without a current context (as some
// drivers do).
__attribute__((visibility("default"))) void kvbtest_fake_cuda_pointer_needs_context(int on) {
  g_pointer_needs_context = on != 0;
}
__attribute__((visibility("default"))) uint64_t kvbtest_fake_cuda_copies() {
  return g_copies.load();
}
__attribute__((visibility("default"))) int kvbtest_fake_cuda_init_calls() {
  return g_init_calls.load();
}
// Copies logged since the last clear (every cuMemcpyAsync, in the order queued): copies up to
// `max` records into out and returns how many there are in all.
__attribute__((visibility("default"))) size_t kvbtest_fake_cuda_copy_log(CopyRecord* out,
                                                                         size_t max) {
  std::lock_guard<std::mutex> lock(g_log_mu);
  for (size_t i = 0; i < max && i < g_log.size(); ++i) out[i] = g_log[i];
  return g_log.size();
}
// Forgets the log. Copies still queued then are no longer recorded.
__attribute__((visibility("default"))) void kvbtest_fake_cuda_clear_copy_log() {
  std::lock_guard<std::mutex> lock(g_log_mu);
  g_log.clear();
  ++g_log_generation;
}
// Streams, events and primary-context references not yet given back (leak checks).
__attribute__((visibility("default"))) int kvbtest_fake_cuda_live_objects() {
  return g_live_streams.load() + g_live_events.load() + g_primary_retained.load();
}

// ---- the driver API --------------------------------------------------------------------------
__attribute__((visibility("default"))) CUresult cuInit(unsigned flags) {
  g_init_calls.fetch_add(1);
  return flags == 0 ? kSuccess : kInvalidValue;
}
__attribute__((visibility("default"))) CUresult cuDriverGetVersion(int* v) {
  if (v == nullptr) return kInvalidValue;
  *v = 13000;
  return kSuccess;
}
__attribute__((visibility("default"))) CUresult cuDeviceGetCount(int* n) {
  if (n == nullptr) return kInvalidValue;
  *n = kDevices;
  return kSuccess;
}
__attribute__((visibility("default"))) CUresult cuDeviceGet(int* dev, int ordinal) {
  if (dev == nullptr) return kInvalidValue;
  if (ordinal < 0 || ordinal >= kDevices) return kInvalidDevice;
  *dev = ordinal;
  return kSuccess;
}
__attribute__((visibility("default"))) CUresult cuGetErrorName(CUresult r, const char** name) {
  if (name == nullptr) return kInvalidValue;
  switch (r) {
    case 0:
      *name = "CUDA_SUCCESS";
      return kSuccess;
    case 1:
      *name = "CUDA_ERROR_INVALID_VALUE";
      return kSuccess;
    case 2:
      *name = "CUDA_ERROR_OUT_OF_MEMORY";
      return kSuccess;
    case 101:
      *name = "CUDA_ERROR_INVALID_DEVICE";
      return kSuccess;
    case 201:
      *name = "CUDA_ERROR_INVALID_CONTEXT";
      return kSuccess;
    case 600:
      *name = "CUDA_ERROR_NOT_READY";
      return kSuccess;
    case 700:
      *name = "CUDA_ERROR_ILLEGAL_ADDRESS";
      return kSuccess;
    case 999:
      *name = "CUDA_ERROR_UNKNOWN";
      return kSuccess;
    default:
      *name = nullptr;
      return kInvalidValue;
  }
}
__attribute__((visibility("default"))) CUresult cuPointerGetAttributes(unsigned n, int* attrs,
                                                                       void** data,
                                                                       CUdeviceptr ptr) {
  if (attrs == nullptr || data == nullptr) return kInvalidValue;
  if (g_pointer_needs_context.load() && !HasContext()) return kInvalidContext;
  std::lock_guard<std::mutex> lock(g_mu);
  uintptr_t start = 0;
  const Alloc* a = Find(static_cast<uintptr_t>(ptr), &start);
  if (a == nullptr && !g_unknown_as_success.load()) return kInvalidValue;
  for (unsigned i = 0; i < n; ++i) {
    switch (attrs[i]) {
      case 2:
        *static_cast<unsigned*>(data[i]) = a ? a->type : 0;
        break;
      case 8:
        *static_cast<unsigned*>(data[i]) = a ? a->managed : 0;
        break;
      case 9:
        *static_cast<int*>(data[i]) = a ? (a->device < 0 ? 0 : a->device) : -2;
        break;
      case 11:
        *static_cast<CUdeviceptr*>(data[i]) = a ? start : 0;
        break;
      case 12:
        *static_cast<size_t*>(data[i]) = a ? a->size : 0;
        break;
      default:
        return kInvalidValue;
    }
  }
  return kSuccess;
}
__attribute__((visibility("default"))) CUresult cuDevicePrimaryCtxRetain(void** ctx, int dev) {
  if (ctx == nullptr) return kInvalidValue;
  if (dev < 0 || dev >= kDevices) return kInvalidDevice;
  *ctx = CtxOf(dev);
  g_primary_retained.fetch_add(1);
  return kSuccess;
}
__attribute__((visibility("default"))) CUresult cuDevicePrimaryCtxRelease_v2(int dev) {
  if (dev < 0 || dev >= kDevices) return kInvalidDevice;
  g_primary_retained.fetch_sub(1);
  return kSuccess;
}
__attribute__((visibility("default"))) CUresult cuCtxPushCurrent_v2(void* ctx) {
  const auto v = reinterpret_cast<uintptr_t>(ctx);
  if (v < 1 || v > kDevices) return kInvalidContext;
  t_ctx_stack.push_back(static_cast<int>(v - 1));
  return kSuccess;
}
__attribute__((visibility("default"))) CUresult cuCtxPopCurrent_v2(void** ctx) {
  if (t_ctx_stack.empty()) return kInvalidContext;
  if (ctx != nullptr) *ctx = CtxOf(t_ctx_stack.back());
  t_ctx_stack.pop_back();
  return kSuccess;
}
__attribute__((visibility("default"))) CUresult cuStreamCreate(void** s, unsigned) {
  if (s == nullptr) return kInvalidValue;
  if (!HasContext()) return kInvalidContext;
  *s = new Stream;
  g_live_streams.fetch_add(1);
  return kSuccess;
}
__attribute__((visibility("default"))) CUresult cuStreamDestroy_v2(void* s) {
  if (s == nullptr) return kInvalidValue;
  delete static_cast<Stream*>(s);
  g_live_streams.fetch_sub(1);
  return kSuccess;
}
__attribute__((visibility("default"))) CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src,
                                                              size_t len, void* s) {
  if (!HasContext()) return kInvalidContext;
  if (s == nullptr || dst == 0 || src == 0) return kInvalidValue;
  Op op{true, HostView(dst), HostView(src), len, IsDeviceMemory(src) && !IsDeviceMemory(dst)};
  {
    std::lock_guard<std::mutex> lock(g_log_mu);
    op.log_index = g_log.size();
    op.log_generation = g_log_generation;
    CopyRecord r;
    r.queued_ns = NowNs();
    r.dst = dst;
    r.src = src;
    r.len = len;
    g_log.push_back(r);
  }
  static_cast<Stream*>(s)->Push(op);
  return kSuccess;
}
__attribute__((visibility("default"))) CUresult cuEventCreate(void** e, unsigned) {
  if (e == nullptr) return kInvalidValue;
  if (!HasContext()) return kInvalidContext;
  *e = new Event;
  g_live_events.fetch_add(1);
  return kSuccess;
}
__attribute__((visibility("default"))) CUresult cuEventRecord(void* e, void* s) {
  if (e == nullptr || s == nullptr) return kInvalidValue;
  auto* ev = static_cast<Event*>(e);
  {
    std::lock_guard<std::mutex> lock(ev->mu);
    ev->pending = true;
  }
  static_cast<Stream*>(s)->Push(Op{false, nullptr, nullptr, 0, false, ev});
  return kSuccess;
}
__attribute__((visibility("default"))) CUresult cuEventQuery(void* e) {
  if (e == nullptr) return kInvalidValue;
  auto* ev = static_cast<Event*>(e);
  std::lock_guard<std::mutex> lock(ev->mu);
  return ev->pending ? kNotReady : ev->error;
}
__attribute__((visibility("default"))) CUresult cuEventSynchronize(void* e) {
  if (e == nullptr) return kInvalidValue;
  auto* ev = static_cast<Event*>(e);
  std::unique_lock<std::mutex> lock(ev->mu);
  ev->cv.wait(lock, [&] { return !ev->pending; });
  return ev->error;
}
__attribute__((visibility("default"))) CUresult cuEventDestroy_v2(void* e) {
  if (e == nullptr) return kInvalidValue;
  delete static_cast<Event*>(e);
  g_live_events.fetch_sub(1);
  return kSuccess;
}
// Allocation and synchronous copies as a test on a real GPU makes them (tests/gpu/
// test_tcp_device.cc with KVBTEST_REAL_CUDA=1), so that mode can run against this fake too.
__attribute__((visibility("default"))) CUresult cuMemAlloc_v2(CUdeviceptr* dp, size_t len) {
  if (dp == nullptr || len == 0) return kInvalidValue;
  if (!HasContext()) return kInvalidContext;
  void* p = Track(len, Alloc{0, t_ctx_stack.back(), 2, 0});
  *dp = reinterpret_cast<CUdeviceptr>(p);
  return p != nullptr ? kSuccess : kOutOfMemory;
}
__attribute__((visibility("default"))) CUresult cuMemFree_v2(CUdeviceptr dp) {
  return Release(reinterpret_cast<void*>(dp)) ? kSuccess : kInvalidValue;
}
__attribute__((visibility("default"))) CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void* src,
                                                                size_t len) {
  if (!HasContext()) return kInvalidContext;
  std::memcpy(HostView(dst), src, len);
  return kSuccess;
}
__attribute__((visibility("default"))) CUresult cuMemcpyDtoH_v2(void* dst, CUdeviceptr src,
                                                                size_t len) {
  if (!HasContext()) return kInvalidContext;
  std::memcpy(dst, HostView(src), len);
  return kSuccess;
}
__attribute__((visibility("default"))) CUresult cuMemHostAlloc(void** p, size_t len, unsigned) {
  if (p == nullptr || len == 0) return kInvalidValue;
  if (!HasContext()) return kInvalidContext;
  *p = Track(len, Alloc{0, -1, 1, 0});
  return *p != nullptr ? kSuccess : kOutOfMemory;
}
__attribute__((visibility("default"))) CUresult cuMemFreeHost(void* p) {
  return p != nullptr && Release(p) ? kSuccess : kInvalidValue;
}

}  // extern "C"
