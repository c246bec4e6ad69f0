// DeviceBounce: CUDA device memory read for the CPU through a pinned host bounce buffer, for
// code that must look at device bytes (the store client's CRC-32C of pieces in CUDA buffers,
// store/store_client.cc) without the CPU ever dereferencing a device pointer.
//
// Read() takes a list of spans, host or device, and hands every byte to a callback, span after
// span in list order and each span's bytes in order. Device spans are copied (cuMemcpyAsync on a
// non-blocking stream of their device) into one half of the bounce buffer, packed back to back,
// while the callback looks at the other half: one device-to-host copy per byte, overlapped with
// the caller's work. Host spans are handed over as they are, in their turn. Each copy records
// its own event, so a failed copy fails only the span it belongs to.
//
// Memory: bounce_bytes of pinned host memory (cuMemHostAlloc, portable), allocated at the first
// Read that has a device span, plus one stream and a few events per device read from; all
// released by the destructor. One Read at a time per object (the others wait on a mutex).
// Exported KVBRIDGE_INTERNAL_API for libkvbridge_store.so (core/export_internal.h).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "core/export_internal.h"
#include "kvbridge/status.h"

namespace kvbridge::core {

class KVBRIDGE_INTERNAL_API DeviceBounce {
 public:
  struct Span {
    const void* addr = nullptr;
    uint64_t len = 0;
    int device = -1;  // the CUDA device whose memory it is; < 0: host memory
  };
  // fn(span index, host bytes, length): the next bytes of that span.
  using ChunkFn = std::function<void(size_t span, const char* data, uint64_t len)>;

  // UNAVAILABLE (the driver loader's message) without a CUDA driver; INVALID_ARGUMENT for
  // bounce_bytes under 8 KiB.
  static Result<std::unique_ptr<DeviceBounce>> Create(uint64_t bounce_bytes);
  ~DeviceBounce();
  DeviceBounce(const DeviceBounce&) = delete;
  DeviceBounce& operator=(const DeviceBounce&) = delete;

  // The CUDA device of [addr, addr+len): core/memory_kinds.h's check of kCuda memory (device
  // memory inside one allocation), with its errors.
  static Result<int> DeviceOf(const void* addr, uint64_t len);

  // Hands every byte of `spans` to fn (see above). Returns one status per span: OK once fn saw
  // all of it, else IO_ERROR naming the span, its device and the CUDA error of the copy that
  // failed (fn then saw only part of it, and sees nothing more of it). No copy is in flight
  // when Read returns.
  std::vector<Status> Read(std::span<const Span> spans, const ChunkFn& fn);

  uint64_t bounce_bytes() const;

 private:
  struct Impl;
  explicit DeviceBounce(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvbridge::core
