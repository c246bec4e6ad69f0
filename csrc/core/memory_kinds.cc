#include "core/memory_kinds.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "core/cuda_driver.h"

namespace kvbridge::core {
namespace {

std::string Hex(uint64_t v) {
  char buf[24];
  std::snprintf(buf, sizeof(buf), "0x%llx", static_cast<unsigned long long>(v));
  return buf;
}

std::string Span(uint64_t addr, uint64_t len) {
  return "[" + Hex(addr) + ", " + Hex(addr + len) + ")";
}

// What cuPointerGetAttributes said about one pointer.
struct PointerInfo {
  cuda::CUresult result = cuda::kSuccess;
  unsigned memory_type = 0;  // 0: the driver does not know the pointer
  unsigned managed = 0;
  int ordinal = -1;
  cuda::CUdeviceptr start = 0;
  size_t size = 0;

  bool known() const { return result == cuda::kSuccess && memory_type != 0; }
  std::string Describe(const cuda::Driver& d) const {
    if (result != cuda::kSuccess) return "cuPointerGetAttributes: " + d.ErrorName(result);
    const char* type = memory_type == cuda::kMemoryTypeHost      ? "HOST"
                       : memory_type == cuda::kMemoryTypeDevice  ? "DEVICE"
                       : memory_type == cuda::kMemoryTypeUnified ? "UNIFIED"
                       : memory_type == 0                        ? "none (unknown to CUDA)"
                                                                 : "other";
    std::string s = "memory type " + std::string(type) + " (" + std::to_string(memory_type) +
                    "), device " + std::to_string(ordinal) + ", managed " +
                    (managed ? "yes" : "no");
    if (size != 0) s += ", allocation " + Span(start, size);
    return s;
  }
};

PointerInfo QueryOnce(const cuda::Driver& d, uint64_t addr) {
  PointerInfo p;
  int attrs[] = {cuda::kAttrMemoryType, cuda::kAttrIsManaged, cuda::kAttrDeviceOrdinal,
                 cuda::kAttrRangeStartAddr, cuda::kAttrRangeSize};
  void* data[] = {&p.memory_type, &p.managed, &p.ordinal, &p.start, &p.size};
  p.result = d.cuPointerGetAttributes(5, attrs, data, static_cast<cuda::CUdeviceptr>(addr));
  return p;
}

// Some drivers answer INVALID_CONTEXT when no context is current on the calling thread: ask
// again with a primary context current, unless device_hint < -1 (retaining a primary context
// may create one, which costs device memory: a host registration must not do that).
PointerInfo Query(const cuda::Driver& d, uint64_t addr, int device_hint) {
  PointerInfo p = QueryOnce(d, addr);
  if (p.result != cuda::kErrorInvalidContext || device_hint < -1) return p;
  cuda::ScopedDeviceContext ctx(d, device_hint < 0 ? 0 : device_hint);
  return ctx.status().ok() ? QueryOnce(d, addr) : p;
}

Result<int> CheckCuda(uint64_t addr, uint64_t len, int device_id) {
  Result<const cuda::Driver*> driver = cuda::GetDriver();
  if (!driver.ok()) return driver.status().WithContext("RegisterMemory(kCuda)");
  const cuda::Driver& d = *driver.value();
  const std::string what = "RegisterMemory(kCuda) " + Span(addr, len);
  const PointerInfo p = Query(d, addr, device_id);
  if (p.result != cuda::kSuccess && p.result != cuda::kErrorInvalidValue) {
    return Status::IoError(what + ": " + p.Describe(d));
  }
  if (!p.known()) {
    return Status::UnknownMemory(what + ": not memory the CUDA driver knows (" + p.Describe(d) +
                                 "); register device memory from cuMemAlloc/cudaMalloc");
  }
  if (p.managed) {
    return Status::UnknownMemory(what + ": CUDA managed memory is not supported (" + p.Describe(d) +
                                 "); register device memory from cuMemAlloc");
  }
  if (p.memory_type != cuda::kMemoryTypeDevice) {
    return Status::UnknownMemory(what + ": not CUDA device memory (" + p.Describe(d) +
                                 "); register host memory with MemoryKind::kHost");
  }
  if (device_id >= 0 && p.ordinal != device_id) {
    return Status::InvalidArgument(what + ": memory of CUDA device " + std::to_string(p.ordinal) +
                                   ", not of device_id " + std::to_string(device_id) + " (" +
                                   p.Describe(d) + ")");
  }
  if (addr < p.start || addr + len > p.start + p.size) {
    return Status::UnknownMemory(what + ": runs past its CUDA allocation (" + p.Describe(d) +
                                 "); a region must lie inside one allocation");
  }
  return p.ordinal;
}

// OK when every page of [addr, addr+len) is mapped; UNKNOWN_MEMORY naming the first chunk of
// pages mincore calls unmapped (ENOMEM).
Status CheckMapped(uint64_t addr, uint64_t len) {
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  constexpr uint64_t kPagesPerCall = 1u << 16;  // a 64 KiB vector per call
  std::vector<unsigned char> vec(kPagesPerCall);
  const uint64_t first = addr & ~(page - 1);
  const uint64_t end = (addr + len + page - 1) & ~(page - 1);
  for (uint64_t at = first; at < end; at += kPagesPerCall * page) {
    const uint64_t n = std::min<uint64_t>(end - at, kPagesPerCall * page);
    if (mincore(reinterpret_cast<void*>(at), n, vec.data()) == 0) continue;
    const int err = errno;
    if (err == ENOMEM) {
      return Status::UnknownMemory("RegisterMemory(kHost) " + Span(addr, len) +
                                   ": not mapped host memory (mincore found unmapped pages in " +
                                   Span(at, n) + ")");
    }
    // EINVAL/EAGAIN and the like say nothing about the memory: leave it to the transports.
    return Status::OK();
  }
  return Status::OK();
}

}  // namespace

std::pair<MemoryKind, int> DetectMemoryKind(const void* addr) {
  if (const cuda::Driver* d = cuda::DriverIfPresent()) {
    // With a device hint of 0 an INVALID_CONTEXT answer is asked again with device 0's primary
    // context current: a process holding device pointers has contexts already.
    const PointerInfo p = Query(*d, reinterpret_cast<uint64_t>(addr), /*device_hint=*/0);
    if (p.known() && p.memory_type == cuda::kMemoryTypeDevice && !p.managed) {
      return {MemoryKind::kCuda, p.ordinal};
    }
  }
  return {MemoryKind::kHost, -1};
}

namespace {

Result<int> CheckHost(uint64_t addr, uint64_t len, int device_id) {
  if (const cuda::Driver* d = cuda::DriverIfPresent()) {
    const PointerInfo p = Query(*d, addr, /*device_hint=*/-2);  // never makes a context
    if (p.known() && p.memory_type == cuda::kMemoryTypeDevice && !p.managed) {
      return Status::InvalidArgument("RegisterMemory(kHost) " + Span(addr, len) +
                                     ": CUDA device memory; register with MemoryKind::kCuda (" +
                                     p.Describe(*d) + ")");
    }
  }
  KVB_RETURN_IF_ERROR(CheckMapped(addr, len));
  return device_id;
}

}  // namespace

Result<int> CheckMemoryKind(const void* addr, uint64_t len, MemoryKind kind, int device_id) {
  const auto a = reinterpret_cast<uint64_t>(addr);
  if (kind == MemoryKind::kCuda) return CheckCuda(a, len, device_id);
  return CheckHost(a, len, device_id);
}

}  // namespace kvbridge::core
