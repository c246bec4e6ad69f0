// A fake NCCL and CUDA driver for the nccl transport's tests: no GPU, one process. "Device"
// memory is host memory. Communicators rendezvous by unique id (two ranks); ncclSend/ncclRecv
// pair up per (communicator, direction) in the order issued and memcpy when both sides are
// there; an event is done once every call queued on its stream before it was recorded is done.
// Faults: sends that are accepted but never complete (they also block later calls in their
// direction, as a hung kernel blocks its stream), and asynchronous errors.
//
// Thread-safety: every entry point and control may be called from any thread (one mutex).
#pragma once

#include <cstdint>

#include "nccl_cuda.h"
#include "nccl_loader.h"

namespace kvbridge::nccl::fake {

// Tables whose entry points are the fake's. The same pair for every instance of a test.
const Nccl* FakeNccl();
const CudaOps* FakeCuda();

// The next `n` ncclSend calls never complete (and block their direction) until their
// communicator is aborted.
void HangNextSends(int n);
// The next ncclCommGetAsyncError on a ready communicator reports `err` (and keeps reporting it
// for that communicator).
void FailNextAsyncQuery(int err);
// The next `n` ncclSend/ncclRecv calls answer ncclInProgress, as a non-blocking communicator
// may: the call reaches its stream (and can pair) only after three more ncclCommGetAsyncError
// queries on its communicator, which answer ncclInProgress until then.
void SlowEnqueueNext(int n);
// FakeCuda's use_device fails with this CUresult (0: succeeds).
void SetUseDeviceResult(int r);
// Clears the faults above.
void ResetFaults();

struct Counts {
  uint64_t comms_created = 0;
  uint64_t comms_aborted = 0;
  uint64_t sends = 0;
  uint64_t recvs = 0;
  uint64_t bytes_copied = 0;
  // Calls made on a communicator after it was aborted or destroyed: must stay 0.
  uint64_t calls_after_abort = 0;
  // ncclSend/ncclRecv on a communicator still enqueueing an earlier call: must stay 0.
  uint64_t calls_while_enqueuing = 0;
  uint64_t live_events = 0;
  uint64_t live_streams = 0;
};
Counts GetCounts();

}  // namespace kvbridge::nccl::fake
