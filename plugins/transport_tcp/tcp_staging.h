// The tcp transport's device staging (not installed, not part of any API): pinned bounce buffers
// and copy queues through which bytes of CUDA regions move between device memory and the socket.
// The host owns the CUDA driver; this only calls the ABI 1.2 device services
// (kvb_host_services_t: dev_stream_*, dev_copy_*, pinned_*). README.md "Device memory" says how
// lanes and server connections use it.
// Thread-safety: one DevStaging belongs to one thread (a lane or a server connection), as the
// host's streams are used by one thread at a time.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "kvbridge/plugin/abi.h"

namespace kvbridge::tcp {

class Transport;
struct Request;
struct Slice;

// True when `host` carries every device service (ABI >= 1.2 and none of them NULL).
bool HasDeviceServices(const kvb_host_services_t* host);

// One pinned bounce buffer and the copy that may be using it.
struct StagingBuffer {
  enum class State {
    kFree,
    kCopyIn,     // a device -> pinned copy for a WRITE slice is running
    kFilled,     // holds a WRITE slice's bytes, being sent
    kReceiving,  // a READ slice's payload is being received into it
    kCopyOut,    // a pinned -> device copy for a READ slice is running
  };
  uint8_t* p = nullptr;
  State state = State::kFree;
  kvb_dev_stream_t* stream = nullptr;
  uint64_t ticket = 0;
  // The request whose user memory the running copy touches (its in_user_mem is held for it).
  std::shared_ptr<Request> req;
  std::unique_ptr<Slice> read_slice;  // kCopyOut: the READ slice, ended when the copy is answered
  uint64_t entry_id = 0;              // kCopyIn/kFilled: the lane entry it stages (0: orphaned)
};

class DevStaging {
 public:
  DevStaging(const Transport* t, uint64_t buffer_bytes, uint32_t buffers)
      : t_(t), buffer_bytes_(buffer_bytes), count_(buffers) {}
  // Waits for every copy still queued (a bounce buffer is never freed under a copy), destroys
  // the streams, frees the buffers.
  ~DevStaging();
  DevStaging(const DevStaging&) = delete;
  DevStaging& operator=(const DevStaging&) = delete;

  // Allocates the ring of pinned buffers on first use. The host's error otherwise.
  kvb_status_t Init(std::string* err);
  // The copy queue for `device`, created on first use.
  kvb_status_t StreamFor(int device, kvb_dev_stream_t** out, std::string* err);
  kvb_status_t Copy(kvb_dev_stream_t* s, void* dst, const void* src, uint64_t len, uint64_t* ticket,
                    std::string* err);
  // Never blocks: IN_PROGRESS, OK, or the copy's error (IO naming the CUDA error).
  kvb_status_t Done(kvb_dev_stream_t* s, uint64_t ticket, std::string* err);
  // Blocks until the copy is answered (however long: its buffers cannot be reused before).
  kvb_status_t Wait(kvb_dev_stream_t* s, uint64_t ticket, std::string* err);
  // A pinned buffer of at least `len` bytes, kept (and grown) for the owner's later calls.
  kvb_status_t Scratch(uint64_t len, uint8_t** out, std::string* err);

  uint64_t buffer_bytes() const { return buffer_bytes_; }
  std::vector<StagingBuffer>& buffers() { return bufs_; }
  bool HasFree() const {
    for (const auto& b : bufs_) {
      if (b.state == StagingBuffer::State::kFree) return true;
    }
    return false;
  }
  // A free buffer's index, or -1.
  int TakeFree(StagingBuffer::State as);

 private:
  const Transport* const t_;
  const uint64_t buffer_bytes_;
  const uint32_t count_;
  std::vector<StagingBuffer> bufs_;
  std::vector<std::pair<int, kvb_dev_stream_t*>> streams_;
  uint8_t* scratch_ = nullptr;
  uint64_t scratch_len_ = 0;
};

}  // namespace kvbridge::tcp
