// Registration checks by memory kind: before the engine registers [addr, addr+len) with its
// transports, CheckMemoryKind makes sure the memory is what the caller says. kCuda: the CUDA
// driver (core/cuda_driver.h) must know it as device memory of the device named, and the span
// must lie inside one allocation. kHost: not CUDA device memory (checked when this process has
// the driver) and mapped (mincore). A failure is a Status naming the address, the kind and what
// was found (UNKNOWN_MEMORY, INVALID_ARGUMENT, or UNAVAILABLE without a driver).
// Stateless free functions; thread-safe.
#pragma once

#include <cstdint>
#include <utility>

#include "core/export_internal.h"
#include "kvbridge/engine.h"
#include "kvbridge/status.h"

namespace kvbridge::core {

// The device id to keep with the region: for kCuda the pointer's device ordinal (device_id -1
// means "the pointer's"), for kHost device_id unchanged.
Result<int> CheckMemoryKind(const void* addr, uint64_t len, MemoryKind kind, int device_id);

// What MemoryKind::kDetect stands for at `addr`: {kCuda, its device ordinal} when the CUDA
// driver this process already has (cuda::DriverIfPresent: nothing is loaded for it) knows the
// address as device memory (not managed), else {kHost, -1}. Never fails; the registration
// that follows checks the range as usual. Exported KVBRIDGE_INTERNAL_API for
// libkvbridge_store.so (core/export_internal.h).
KVBRIDGE_INTERNAL_API std::pair<MemoryKind, int> DetectMemoryKind(const void* addr);

}  // namespace kvbridge::core
