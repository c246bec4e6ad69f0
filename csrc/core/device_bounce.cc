#include "core/device_bounce.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <mutex>
#include <string>
#include <utility>

#include "core/cuda_driver.h"
#include "core/memory_kinds.h"

namespace kvbridge::core {
namespace {

// Copies one fill (one half of the bounce buffer) holds at most: every copy records an event,
// and events are kept per half, so tiny spans cannot make thousands of them.
constexpr size_t kMaxChunksPerFill = 256;

std::string Where(const void* addr, uint64_t off, uint64_t len, int device) {
  char buf[96];
  std::snprintf(buf, sizeof buf, "[%p, +%llu) of CUDA device %d",
                static_cast<const void*>(static_cast<const char*>(addr) + off),
                static_cast<unsigned long long>(len), device);
  return buf;
}

}  // namespace

struct DeviceBounce::Impl {
  struct Device {
    std::unique_ptr<cuda::DeviceStream> stream;  // retains the device's primary context
    std::vector<cuda::CUevent> events[2];        // per half of the bounce buffer, one per copy
  };
  const cuda::Driver* d = nullptr;
  uint64_t bytes = 0;
  std::mutex mu;  // one Read at a time
  char* host = nullptr;
  int host_device = -1;           // whose primary context allocated `host`
  std::map<int, Device> devices;  // by ordinal; their primary contexts are retained

  // The device's stream (and the bounce buffer), made on first use. REQUIRES: mu held and the
  // device's context current.
  Result<Device*> Prepare(int ordinal) {
    if (auto it = devices.find(ordinal); it != devices.end()) return &it->second;
    const std::string what = "bounce buffer for CUDA device " + std::to_string(ordinal);
    Device dv;
    Result<std::unique_ptr<cuda::DeviceStream>> stream =
        cuda::DeviceStream::Create(*d, ordinal, what);
    if (!stream.ok()) return stream.status();
    dv.stream = std::move(stream).value();
    if (host == nullptr) {
      void* p = nullptr;
      KVB_RETURN_IF_ERROR(
          d->Check(d->cuMemHostAlloc(&p, bytes, cuda::kMemHostAllocPortable),
                   what + ": cuMemHostAlloc of " + std::to_string(bytes) + " bytes"));
      host = static_cast<char*>(p);
      host_device = ordinal;
    }
    return &devices.emplace(ordinal, std::move(dv)).first->second;
  }

  // At least n events for `half` of the device. REQUIRES: as Prepare.
  Status Events(Device& dv, int half, size_t n) {
    auto& evs = dv.events[half];
    while (evs.size() < n) {
      cuda::CUevent ev = nullptr;
      KVB_RETURN_IF_ERROR(d->Check(d->cuEventCreate(&ev, cuda::kEventDisableTiming),
                                   "bounce buffer: cuEventCreate"));
      evs.push_back(ev);
    }
    return Status::OK();
  }
};

DeviceBounce::DeviceBounce(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Result<std::unique_ptr<DeviceBounce>> DeviceBounce::Create(uint64_t bounce_bytes) {
  if (bounce_bytes < 8192) {
    return Status::InvalidArgument("DeviceBounce: a bounce buffer of " +
                                   std::to_string(bounce_bytes) + " bytes is under 8 KiB");
  }
  Result<const cuda::Driver*> d = cuda::GetDriver();
  if (!d.ok()) return d.status();
  auto impl = std::make_unique<Impl>();
  impl->d = d.value();
  impl->bytes = bounce_bytes & ~uint64_t{1};  // two equal halves
  return std::unique_ptr<DeviceBounce>(new DeviceBounce(std::move(impl)));
}

DeviceBounce::~DeviceBounce() {
  Impl& im = *impl_;
  const cuda::Driver& d = *im.d;
  // Read leaves no copy in flight, so the streams are idle. The events and the bounce buffer go
  // first, while the streams still hold their primary contexts; the streams last.
  for (auto& [ordinal, dv] : im.devices) {
    cuda::ScopedDeviceContext ctx(d, ordinal);
    for (auto& evs : dv.events) {
      for (cuda::CUevent ev : evs) (void)d.cuEventDestroy(ev);
    }
  }
  if (im.host != nullptr) {
    cuda::ScopedDeviceContext ctx(d, im.host_device);
    (void)d.cuMemFreeHost(im.host);
  }
  im.devices.clear();
}

uint64_t DeviceBounce::bounce_bytes() const { return impl_->bytes; }

Result<int> DeviceBounce::DeviceOf(const void* addr, uint64_t len) {
  return CheckMemoryKind(addr, len, MemoryKind::kCuda, -1);
}

std::vector<Status> DeviceBounce::Read(std::span<const Span> spans, const ChunkFn& fn) {
  Impl& im = *impl_;
  const cuda::Driver& d = *im.d;
  std::vector<Status> status(spans.size());
  std::vector<bool> failed(spans.size(), false);
  auto fail = [&](size_t s, const Status& st) {
    if (failed[s]) return;
    failed[s] = true;
    status[s] = st;
  };
  std::lock_guard<std::mutex> lock(im.mu);
  const uint64_t half_bytes = im.bytes / 2;

  // A fill: consecutive host spans (handed over as they are), or up to one half of the bounce
  // buffer of one device's bytes, copied there back to back.
  struct Chunk {
    size_t span;
    uint64_t off;  // in the span
    uint64_t len;
    uint64_t at;  // in the bounce buffer
    bool issued = false;
  };
  struct Fill {
    int device = -1;  // -1: host spans
    Impl::Device* dv = nullptr;
    int half = 0;
    std::vector<Chunk> chunks;
  };
  size_t next_span = 0;
  uint64_t next_off = 0;
  int next_half = 0;
  // Plans the next fill and starts its copies; false when nothing is left.
  auto start = [&](Fill& f) -> bool {
    while (next_span < spans.size() && (next_off >= spans[next_span].len || failed[next_span])) {
      ++next_span;
      next_off = 0;
    }
    if (next_span == spans.size()) return false;
    f.chunks.clear();
    f.dv = nullptr;
    f.device = std::max(spans[next_span].device, -1);
    if (f.device < 0) {
      for (; next_span < spans.size() && spans[next_span].device < 0; ++next_span) {
        if (spans[next_span].len > 0) f.chunks.push_back({next_span, 0, spans[next_span].len, 0});
      }
      next_off = 0;
      return true;
    }
    f.half = next_half;
    next_half ^= 1;
    uint64_t used = 0;
    while (used < half_bytes && f.chunks.size() < kMaxChunksPerFill && next_span < spans.size() &&
           spans[next_span].device == f.device) {
      const Span& s = spans[next_span];
      if (!failed[next_span] && next_off < s.len) {
        const uint64_t n = std::min(s.len - next_off, half_bytes - used);
        f.chunks.push_back({next_span, next_off, n, f.half * half_bytes + used});
        used += n;
        next_off += n;
        if (next_off < s.len) continue;
      }
      ++next_span;
      next_off = 0;
    }
    cuda::ScopedDeviceContext ctx(d, f.device);
    Status st = ctx.status();
    if (st.ok()) {
      Result<Impl::Device*> dv = im.Prepare(f.device);
      if (dv.ok()) {
        f.dv = dv.value();
        st = im.Events(*f.dv, f.half, f.chunks.size());
      } else {
        st = dv.status();
      }
    }
    if (!st.ok()) {
      f.dv = nullptr;
      for (const Chunk& c : f.chunks) {
        const Span& s = spans[c.span];
        fail(c.span, st.WithContext("reading " + Where(s.addr, 0, s.len, s.device)));
      }
      return true;
    }
    for (size_t k = 0; k < f.chunks.size(); ++k) {
      Chunk& c = f.chunks[k];
      const Span& s = spans[c.span];
      const std::string what =
          "copying " + Where(s.addr, c.off, c.len, s.device) + " to the pinned bounce buffer";
      Status cs = d.Check(d.cuMemcpyAsync(reinterpret_cast<cuda::CUdeviceptr>(im.host + c.at),
                                          reinterpret_cast<cuda::CUdeviceptr>(s.addr) + c.off,
                                          c.len, f.dv->stream->get()),
                          what + ": cuMemcpyAsync");
      if (cs.ok())
        cs = d.Check(d.cuEventRecord(f.dv->events[f.half][k], f.dv->stream->get()), what);
      if (!cs.ok()) {
        fail(c.span, cs);
        continue;
      }
      c.issued = true;
    }
    return true;
  };
  // Waits for the fill's copies, one event each, and hands their bytes to fn.
  auto finish = [&](Fill& f) {
    if (f.device < 0) {
      for (const Chunk& c : f.chunks) {
        fn(c.span, static_cast<const char*>(spans[c.span].addr), c.len);
      }
      return;
    }
    if (f.dv == nullptr) return;  // nothing was issued
    cuda::ScopedDeviceContext ctx(d, f.device);
    for (size_t k = 0; k < f.chunks.size(); ++k) {
      const Chunk& c = f.chunks[k];
      if (!c.issued) continue;
      const Span& s = spans[c.span];
      const Status st = d.Check(
          d.cuEventSynchronize(f.dv->events[f.half][k]),
          "copying " + Where(s.addr, c.off, c.len, s.device) + " to the pinned bounce buffer");
      if (!st.ok()) {
        fail(c.span, st);
        continue;
      }
      if (!failed[c.span]) fn(c.span, im.host + c.at, c.len);
    }
  };
  // Double buffering: the next fill's copies run while fn looks at this one's bytes.
  Fill fills[2];
  int cur = 0;
  bool have = start(fills[0]);
  while (have) {
    const bool next = start(fills[cur ^ 1]);
    finish(fills[cur]);
    cur ^= 1;
    have = next;
  }
  return status;
}

}  // namespace kvbridge::core
