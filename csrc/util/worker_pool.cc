#include "util/worker_pool.h"

#include <sched.h>

#include <algorithm>

namespace kvbridge::util {

WorkerPool::WorkerPool(unsigned threads) : threads_(std::max(threads, 1u)) {}

WorkerPool::~WorkerPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  for (auto& t : helpers_) t.join();
}

unsigned WorkerPool::DefaultThreads() {
  cpu_set_t set;
  unsigned cpus = 0;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) cpus = static_cast<unsigned>(CPU_COUNT(&set));
  if (cpus == 0) cpus = std::thread::hardware_concurrency();
  return std::clamp(cpus, 1u, 4u);
}

void WorkerPool::Run(size_t n, const std::function<void(size_t)>& fn) {
  std::unique_lock<std::mutex> run(run_mu_, std::defer_lock);
  if (threads_ == 1 || n < 2 || !run.try_lock()) {
    for (size_t i = 0; i < n; ++i) fn(i);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    while (helpers_.size() + 1 < threads_) helpers_.emplace_back([this] { Helper(); });
    fn_ = &fn;
    n_ = n;
    ++job_;
    next_.store(0, std::memory_order_relaxed);
  }
  work_cv_.notify_all();
  for (size_t i; (i = next_.fetch_add(1, std::memory_order_relaxed)) < n;) fn(i);
  // Close the job: a helper that wakes from now on finds nothing to join; wait for those in it.
  std::unique_lock<std::mutex> lock(mu_);
  fn_ = nullptr;
  done_cv_.wait(lock, [&] { return active_ == 0; });
}

void WorkerPool::Helper() {
  uint64_t joined = 0;
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    work_cv_.wait(lock, [&] { return stop_ || (fn_ != nullptr && job_ != joined); });
    if (stop_) return;
    joined = job_;
    const std::function<void(size_t)>* fn = fn_;
    const size_t n = n_;
    ++active_;
    lock.unlock();
    for (size_t i; (i = next_.fetch_add(1, std::memory_order_relaxed)) < n;) (*fn)(i);
    lock.lock();
    if (--active_ == 0) done_cv_.notify_all();
  }
}

}  // namespace kvbridge::util
