#include "ssd_io.h"

#include <sys/mman.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <deque>

#include "kvbridge/plugin/abi.h"

#if KVB_SSD_HAVE_URING
#include <liburing.h>
#endif

namespace kvbridge::ssd {

namespace {

constexpr size_t kMaxRings = 32;
constexpr unsigned kRingEntries = 2 * IoEngine::kMaxChunksPerOp;

std::string MiB(uint64_t n) {
  if (n % (1u << 20) == 0) return std::to_string(n >> 20) + " MiB";
  return std::to_string(n >> 10) + " KiB";
}

}  // namespace

#if KVB_SSD_HAVE_URING
struct IoEngine::Ring {
  io_uring ring{};
  bool live = false;   // io_uring_queue_init succeeded
  bool fixed = false;  // the staging buffers are registered with this ring
  ~Ring() {
    if (live) io_uring_queue_exit(&ring);
  }
};
#else
struct IoEngine::Ring {};
#endif

namespace {

// One chunk of an operation: its staging buffer, where in the file, how much is done.
struct ChunkSlot {
  int buffer = -1;  // -1 once given back
  uint64_t file_offset = 0;
  uint64_t length = 0;
  uint64_t done = 0;
  bool complete = false;
};

}  // namespace

bool IoEngine::Create(IoMode mode, uint64_t max_inflight_bytes, LogFn log,
                      std::unique_ptr<IoEngine>* out, std::string* err) {
  std::unique_ptr<IoEngine> e(new IoEngine());
  e->log_ = std::move(log);
  e->chunk_bytes_ = std::min<uint64_t>(kDefaultChunkBytes, max_inflight_bytes);
  const uint64_t count = std::max<uint64_t>(1, max_inflight_bytes / e->chunk_bytes_);
  e->pool_map_bytes_ = count * e->chunk_bytes_;
  void* p = mmap(nullptr, e->pool_map_bytes_, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
  if (p == MAP_FAILED) {
    *err = "cannot map " + MiB(e->pool_map_bytes_) + " of staging buffers: " + strerror(errno);
    return false;
  }
  e->pool_ = static_cast<uint8_t*>(p);
  for (uint64_t i = 0; i < count; ++i) {
    e->buffers_.push_back(e->pool_ + i * e->chunk_bytes_);
    e->free_buffers_.push_back(static_cast<int>(count - 1 - i));
  }
  // Rings are cheap and made on demand; the staging buffers are what bounds the I/O.
  e->max_rings_ = kMaxRings;

  if (mode == IoMode::kSync) {
    e->why_sync_ = "ssd.io=sync";
  } else {
#if KVB_SSD_HAVE_URING
    std::unique_ptr<Ring> first;
    std::string why;
    if (e->NewRing(&first, &why)) {
      e->uring_ = true;
      e->registered_ = first->fixed;
      e->free_rings_.push_back(first.get());
      e->rings_.push_back(std::move(first));
    } else if (mode == IoMode::kUring) {
      *err = "ssd.io=uring but io_uring is unavailable: " + why;
      return false;
    } else {
      e->why_sync_ = "io_uring is unavailable: " + why;
    }
#else
    if (mode == IoMode::kUring) {
      *err = "ssd.io=uring but this plugin was built without liburing";
      return false;
    }
    e->why_sync_ = "this plugin was built without liburing";
#endif
  }
  *out = std::move(e);
  return true;
}

IoEngine::~IoEngine() {
  rings_.clear();
  if (pool_ != nullptr) munmap(pool_, pool_map_bytes_);
}

std::string IoEngine::Describe() const {
  const std::string pool =
      std::to_string(buffers_.size()) + " staging buffers of " + MiB(chunk_bytes_);
  if (uring_) {
    return "io_uring, " + std::string(registered_ ? "registered " : "unregistered ") + pool;
  }
  return "pread/pwrite (" + why_sync_ + "), " + pool;
}

IoStats IoEngine::stats() const {
  IoStats s;
  s.peak_inflight_bytes = peak_inflight_bytes_.load(std::memory_order_relaxed);
  std::lock_guard<std::mutex> lk(const_cast<std::mutex&>(buf_mu_));
  s.buffer_waits = buffer_waits_;
  return s;
}

int IoEngine::AcquireBuffer(bool wait) {
  std::unique_lock<std::mutex> lk(buf_mu_);
  if (free_buffers_.empty()) {
    if (!wait) return -1;
    ++buffer_waits_;
    buf_cv_.wait(lk, [&] { return !free_buffers_.empty(); });
  }
  const int b = free_buffers_.back();
  free_buffers_.pop_back();
  return b;
}

void IoEngine::ReleaseBuffer(int index) {
  {
    std::lock_guard<std::mutex> lk(buf_mu_);
    free_buffers_.push_back(index);
  }
  buf_cv_.notify_one();
}

void IoEngine::AddInflight(uint64_t n) {
  const uint64_t now = inflight_bytes_.fetch_add(n, std::memory_order_relaxed) + n;
  uint64_t peak = peak_inflight_bytes_.load(std::memory_order_relaxed);
  while (now > peak && !peak_inflight_bytes_.compare_exchange_weak(peak, now)) {
  }
}

int IoEngine::Write(int fd, uint64_t offset, uint64_t length, WriteSource* src) {
  return uring_ ? WriteUring(fd, offset, length, src) : WriteSync(fd, offset, length, src);
}

int IoEngine::Read(int fd, uint64_t offset, uint64_t length, ReadSink* sink) {
  return uring_ ? ReadUring(fd, offset, length, sink) : ReadSync(fd, offset, length, sink);
}

// --- pread/pwrite ------------------------------------------------------------------------------

int ReadExact(int fd, void* buf, uint64_t n, uint64_t off) {
  auto* p = static_cast<uint8_t*>(buf);
  while (n > 0) {
    const ssize_t r = pread(fd, p, n, static_cast<off_t>(off));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return -errno;
    if (r == 0) return -EIO;
    p += r;
    off += static_cast<uint64_t>(r);
    n -= static_cast<uint64_t>(r);
  }
  return 0;
}

int WriteExact(int fd, const void* buf, uint64_t n, uint64_t off) {
  const auto* p = static_cast<const uint8_t*>(buf);
  while (n > 0) {
    const ssize_t w = pwrite(fd, p, n, static_cast<off_t>(off));
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) return -errno;
    if (w == 0) return -EIO;
    p += w;
    off += static_cast<uint64_t>(w);
    n -= static_cast<uint64_t>(w);
  }
  return 0;
}

int IoEngine::WriteSync(int fd, uint64_t offset, uint64_t length, WriteSource* src) {
  for (uint64_t pos = 0; pos < length;) {
    const uint64_t n = std::min(chunk_bytes_, length - pos);
    const int b = AcquireBuffer(true);
    src->Fill(buffers_[b], n);
    AddInflight(n);
    uint64_t done = 0;
    int rc = 0;
    while (done < n) {
      const ssize_t w = pwrite(fd, buffers_[b] + done, n - done, offset + pos + done);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) {
        rc = w < 0 ? -errno : -EIO;
        break;
      }
      done += static_cast<uint64_t>(w);
    }
    SubInflight(n);
    ReleaseBuffer(b);
    if (rc != 0) return rc;
    pos += n;
  }
  return 0;
}

int IoEngine::ReadSync(int fd, uint64_t offset, uint64_t length, ReadSink* sink) {
  for (uint64_t pos = 0; pos < length;) {
    const uint64_t n = std::min(chunk_bytes_, length - pos);
    const int b = AcquireBuffer(true);
    AddInflight(n);
    uint64_t done = 0;
    int rc = 0;
    while (done < n) {
      const ssize_t r = pread(fd, buffers_[b] + done, n - done, offset + pos + done);
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) {
        rc = r < 0 ? -errno : -EIO;  // 0: the file ends inside the range
        break;
      }
      done += static_cast<uint64_t>(r);
    }
    SubInflight(n);
    if (rc == 0 && !sink->Consume(buffers_[b], n)) rc = kStopped;
    ReleaseBuffer(b);
    if (rc != 0) return rc;
    pos += n;
  }
  return 0;
}

// --- io_uring ----------------------------------------------------------------------------------

#if KVB_SSD_HAVE_URING

bool IoEngine::NewRing(std::unique_ptr<Ring>* out, std::string* err) {
  auto r = std::make_unique<Ring>();
  const int rc = io_uring_queue_init(kRingEntries, &r->ring, 0);
  if (rc < 0) {
    *err = std::string("io_uring_queue_init: ") + strerror(-rc);
    return false;
  }
  r->live = true;
  // Registration is tried on the first ring; if it failed there, later rings do not try.
  if (rings_.empty() || registered_) {
    std::vector<iovec> iov(buffers_.size());
    for (size_t i = 0; i < buffers_.size(); ++i) iov[i] = {buffers_[i], chunk_bytes_};
    const int reg =
        io_uring_register_buffers(&r->ring, iov.data(), static_cast<unsigned>(iov.size()));
    if (reg == 0) {
      r->fixed = true;
    } else if (rings_.empty() && log_) {
      log_(KVB_LOG_WARN, std::string("io_uring_register_buffers failed (") + strerror(-reg) +
                             "); using io_uring with unregistered staging buffers");
    }
  }
  *out = std::move(r);
  return true;
}

IoEngine::Ring* IoEngine::AcquireRing(int* err) {
  std::unique_lock<std::mutex> lk(ring_mu_);
  for (;;) {
    if (!free_rings_.empty()) {
      Ring* r = free_rings_.back();
      free_rings_.pop_back();
      return r;
    }
    if (rings_.size() < max_rings_) {
      std::unique_ptr<Ring> r;
      std::string why;
      if (NewRing(&r, &why)) {
        rings_.push_back(std::move(r));
        return rings_.back().get();
      }
      max_rings_ = rings_.size();  // the kernel says no more; share the ones there are
      if (rings_.empty()) {
        *err = -ENOMEM;
        return nullptr;
      }
      if (log_) {
        log_(KVB_LOG_WARN, "cannot set up another io_uring (" + why + "); sharing " +
                               std::to_string(rings_.size()));
      }
    }
    ring_cv_.wait(lk);
  }
}

void IoEngine::ReleaseRing(Ring* r, bool broken) {
  {
    std::lock_guard<std::mutex> lk(ring_mu_);
    if (broken) {
      // A failed submission may have left entries in its queue: replace it, never reuse it.
      for (auto it = rings_.begin(); it != rings_.end(); ++it) {
        if (it->get() == r) {
          rings_.erase(it);
          break;
        }
      }
      if (max_rings_ == 0) max_rings_ = 1;
    } else {
      free_rings_.push_back(r);
    }
  }
  ring_cv_.notify_one();
}

int IoEngine::WriteUring(int fd, uint64_t offset, uint64_t length, WriteSource* src) {
  return RunUring(fd, offset, length, src, nullptr);
}

int IoEngine::ReadUring(int fd, uint64_t offset, uint64_t length, ReadSink* sink) {
  return RunUring(fd, offset, length, nullptr, sink);
}

// Keeps up to kMaxChunksPerOp chunks in flight on one ring. A write asks `src` for each chunk as
// it is issued and frees its buffer on completion; a read hands chunks to `sink` in file order as
// they complete, then frees them.
int IoEngine::RunUring(int fd, uint64_t offset, uint64_t length, WriteSource* src, ReadSink* sink) {
  const bool write = src != nullptr;
  int err = 0;
  Ring* r = AcquireRing(&err);
  if (r == nullptr) return err;
  auto prep = [&](ChunkSlot* s) {
    io_uring_sqe* sqe = io_uring_get_sqe(&r->ring);  // never null: <= kMaxChunksPerOp queued
    uint8_t* p = buffers_[s->buffer] + s->done;
    const auto n = static_cast<unsigned>(s->length - s->done);
    const uint64_t off = s->file_offset + s->done;
    if (write) {
      r->fixed ? io_uring_prep_write_fixed(sqe, fd, p, n, off, s->buffer)
               : io_uring_prep_write(sqe, fd, p, n, off);
    } else {
      r->fixed ? io_uring_prep_read_fixed(sqe, fd, p, n, off, s->buffer)
               : io_uring_prep_read(sqe, fd, p, n, off);
    }
    io_uring_sqe_set_data(sqe, s);
  };
  auto give_back = [&](ChunkSlot* s) {
    if (s->buffer >= 0) ReleaseBuffer(s->buffer);
    s->buffer = -1;
  };

  std::deque<ChunkSlot> slots;     // issue order; deque keeps element addresses stable
  std::vector<ChunkSlot*> queued;  // prepared, not yet submitted
  uint64_t pos = 0;
  int inflight = 0;
  bool stopped = false, broken = false;
  for (;;) {
    while (err == 0 && !stopped && pos < length && inflight < kMaxChunksPerOp) {
      const int b = AcquireBuffer(inflight == 0);
      if (b < 0) break;
      ChunkSlot& s = slots.emplace_back();
      s.buffer = b;
      s.file_offset = offset + pos;
      s.length = std::min(chunk_bytes_, length - pos);
      if (write) src->Fill(buffers_[b], s.length);
      AddInflight(s.length);
      prep(&s);
      queued.push_back(&s);
      pos += s.length;
      ++inflight;
    }
    if (!queued.empty()) {
      int rc;
      do {
        rc = io_uring_submit(&r->ring);
      } while (rc == -EINTR);
      if (rc >= 0) {
        queued.clear();
      } else if ((rc == -EAGAIN || rc == -EBUSY) && inflight > static_cast<int>(queued.size())) {
        // Short of kernel resources: reap a completion first, then submit again.
      } else {
        broken = true;
        if (err == 0) err = rc;
        for (ChunkSlot* s : queued) {
          s->complete = true;
          SubInflight(s->length);
          give_back(s);
          --inflight;
        }
        queued.clear();
      }
    }
    if (inflight == 0) break;
    io_uring_cqe* cqe = nullptr;
    const int rc = io_uring_wait_cqe(&r->ring, &cqe);
    if (rc == -EINTR) continue;
    if (rc < 0) {
      // Cannot reap: the kernel may still use the buffers, so they are not given back.
      ReleaseRing(r, true);
      return rc;
    }
    auto* s = static_cast<ChunkSlot*>(io_uring_cqe_get_data(cqe));
    const int res = cqe->res;
    io_uring_cqe_seen(&r->ring, cqe);
    if (err == 0 && ((res > 0 && static_cast<uint64_t>(res) < s->length - s->done) ||
                     res == -EINTR || res == -EAGAIN)) {
      if (res > 0) s->done += static_cast<uint64_t>(res);  // short transfer: issue the rest
      prep(s);
      queued.push_back(s);
      continue;
    }
    if (err == 0 && res <= 0) err = res < 0 ? res : -EIO;  // 0: the file ends inside the range
    s->complete = true;
    SubInflight(s->length);
    --inflight;
    if (write) give_back(s);
    while (!slots.empty() && slots.front().complete) {
      ChunkSlot& f = slots.front();
      if (!write && f.buffer >= 0 && err == 0 && !stopped &&
          !sink->Consume(buffers_[f.buffer], f.length)) {
        stopped = true;
      }
      give_back(&f);
      slots.pop_front();
    }
  }
  for (ChunkSlot& s : slots) give_back(&s);
  ReleaseRing(r, broken);
  if (err != 0) return err;
  return stopped ? kStopped : 0;
}

#else  // !KVB_SSD_HAVE_URING

bool IoEngine::NewRing(std::unique_ptr<Ring>*, std::string* err) {
  *err = "built without liburing";
  return false;
}
IoEngine::Ring* IoEngine::AcquireRing(int* err) {
  *err = -ENOSYS;
  return nullptr;
}
void IoEngine::ReleaseRing(Ring*, bool) {}
int IoEngine::WriteUring(int, uint64_t, uint64_t, WriteSource*) { return -ENOSYS; }
int IoEngine::ReadUring(int, uint64_t, uint64_t, ReadSink*) { return -ENOSYS; }
int IoEngine::RunUring(int, uint64_t, uint64_t, WriteSource*, ReadSink*) { return -ENOSYS; }

#endif

}  // namespace kvbridge::ssd
