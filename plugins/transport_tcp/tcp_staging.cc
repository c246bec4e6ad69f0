// The tcp transport: device staging (tcp_staging.h).
#include "tcp_staging.h"

#include "tcp_internal.h"

namespace kvbridge::tcp {

bool HasDeviceServices(const kvb_host_services_t* host) {
  return host != nullptr && KVB_HAS_FIELD(host, kvb_host_services_t, pinned_free) &&
         host->dev_stream_create != nullptr && host->dev_stream_destroy != nullptr &&
         host->dev_copy_async != nullptr && host->dev_copy_done != nullptr &&
         host->dev_copy_wait != nullptr && host->pinned_alloc != nullptr &&
         host->pinned_free != nullptr;
}

DevStaging::~DevStaging() {
  const kvb_host_services_t* h = t_->host();
  std::string err;
  for (auto& b : bufs_) {
    if (b.state == StagingBuffer::State::kCopyIn || b.state == StagingBuffer::State::kCopyOut) {
      (void)Wait(b.stream, b.ticket, &err);
    }
  }
  for (auto& [device, s] : streams_) h->dev_stream_destroy(h->host_ctx, s);  // waits too
  for (auto& b : bufs_) h->pinned_free(h->host_ctx, b.p);
  if (scratch_ != nullptr) h->pinned_free(h->host_ctx, scratch_);
}

kvb_status_t DevStaging::Init(std::string* err) {
  if (!bufs_.empty()) return KVB_OK;
  const kvb_host_services_t* h = t_->host();
  std::vector<StagingBuffer> bufs(count_);
  for (auto& b : bufs) {
    void* p = nullptr;
    const kvb_status_t st = h->pinned_alloc(h->host_ctx, buffer_bytes_, &p);
    if (st != KVB_OK || p == nullptr) {
      for (auto& done : bufs) {
        if (done.p != nullptr) h->pinned_free(h->host_ctx, done.p);
      }
      *err =
          Fmt("cannot allocate %u pinned staging buffers of %llu bytes (tcp.staging_buffers, "
              "tcp.staging_slice_bytes): pinned_alloc answered %d",
              count_, U(buffer_bytes_), st);
      return st == KVB_OK ? KVB_ERR_NO_SPACE : st;
    }
    b.p = static_cast<uint8_t*>(p);
  }
  bufs_ = std::move(bufs);
  return KVB_OK;
}

kvb_status_t DevStaging::StreamFor(int device, kvb_dev_stream_t** out, std::string* err) {
  for (auto& [d, s] : streams_) {
    if (d == device) {
      *out = s;
      return KVB_OK;
    }
  }
  const kvb_host_services_t* h = t_->host();
  char buf[512] = {};
  kvb_dev_stream_t* s = nullptr;
  const kvb_status_t st = h->dev_stream_create(h->host_ctx, device, &s, buf, sizeof(buf));
  if (st != KVB_OK) {
    *err = Fmt("cannot create a copy queue on device %d: %s", device, buf);
    return st;
  }
  streams_.emplace_back(device, s);
  *out = s;
  return KVB_OK;
}

kvb_status_t DevStaging::Copy(kvb_dev_stream_t* s, void* dst, const void* src, uint64_t len,
                              uint64_t* ticket, std::string* err) {
  const kvb_host_services_t* h = t_->host();
  char buf[512] = {};
  const kvb_status_t st =
      h->dev_copy_async(h->host_ctx, s, dst, src, len, ticket, buf, sizeof(buf));
  if (st != KVB_OK) {
    *err = buf;
  } else {
    t_->counters().device_bytes_staged.fetch_add(len, std::memory_order_relaxed);
  }
  return st;
}

kvb_status_t DevStaging::Done(kvb_dev_stream_t* s, uint64_t ticket, std::string* err) {
  const kvb_host_services_t* h = t_->host();
  char buf[512] = {};
  const kvb_status_t st = h->dev_copy_done(h->host_ctx, s, ticket, buf, sizeof(buf));
  if (st != KVB_OK && st != KVB_IN_PROGRESS) *err = buf;
  return st;
}

kvb_status_t DevStaging::Wait(kvb_dev_stream_t* s, uint64_t ticket, std::string* err) {
  const kvb_host_services_t* h = t_->host();
  bool logged = false;
  for (;;) {
    char buf[512] = {};
    const uint64_t deadline = t_->Now() + t_->config().progress_timeout_ms * kMsNs;
    const kvb_status_t st = h->dev_copy_wait(h->host_ctx, s, ticket, deadline, buf, sizeof(buf));
    if (st != KVB_ERR_DEADLINE_EXCEEDED) {
      if (st != KVB_OK) *err = buf;
      return st;
    }
    if (!logged) {
      t_->Log(KVB_LOG_WARN,
              "a device copy has not finished after %u ms; waiting for it before its staging "
              "buffer is reused or freed",
              t_->config().progress_timeout_ms);
      logged = true;
    }
  }
}

kvb_status_t DevStaging::Scratch(uint64_t len, uint8_t** out, std::string* err) {
  if (scratch_len_ < len) {
    const kvb_host_services_t* h = t_->host();
    if (scratch_ != nullptr) h->pinned_free(h->host_ctx, scratch_);
    scratch_ = nullptr;
    scratch_len_ = 0;
    void* p = nullptr;
    const kvb_status_t st = h->pinned_alloc(h->host_ctx, len, &p);
    if (st != KVB_OK || p == nullptr) {
      *err = Fmt("cannot allocate a pinned staging buffer of %llu bytes: pinned_alloc answered %d",
                 U(len), st);
      return st == KVB_OK ? KVB_ERR_NO_SPACE : st;
    }
    scratch_ = static_cast<uint8_t*>(p);
    scratch_len_ = len;
  }
  *out = scratch_;
  return KVB_OK;
}

int DevStaging::TakeFree(StagingBuffer::State as) {
  for (size_t i = 0; i < bufs_.size(); ++i) {
    if (bufs_[i].state == StagingBuffer::State::kFree) {
      bufs_[i].state = as;
      return static_cast<int>(i);
    }
  }
  return -1;
}

}  // namespace kvbridge::tcp
