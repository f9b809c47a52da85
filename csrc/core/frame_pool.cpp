#include "frame_pool.h"

#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>

#include <new>
#include <vector>

namespace vllm_shm_arena {

namespace {

size_t round_up(size_t n) {
  const size_t g = FramePool::kGranule;
  if (n > SIZE_MAX - (g - 1)) throw std::bad_alloc();
  return (n + g - 1) / g * g;
}

}  // namespace

FramePool::FramePool(uint64_t max_idle_bytes, std::chrono::milliseconds max_idle_age)
    : max_idle_bytes_(max_idle_bytes), max_idle_age_(max_idle_age), pid_(getpid()) {}

FramePool::~FramePool() {
  for (auto& [cap, b] : idle_) unmap(b);
}

size_t FramePool::fit_limit(size_t bytes) {
  const size_t twice = bytes > SIZE_MAX / 2 ? SIZE_MAX : bytes * 2;
  const size_t plus = bytes > SIZE_MAX - kGranule ? SIZE_MAX : bytes + kGranule;
  return twice > plus ? twice : plus;
}

FrameBuffer* FramePool::take(size_t bytes) {
  if (bytes == 0) bytes = 1;
  std::multimap<size_t, FrameBuffer*> excess;
  FrameBuffer* found = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.takes++;
    auto it = idle_.lower_bound(bytes);
    if (it != idle_.end() && it->first <= fit_limit(bytes)) {
      found = it->second;
      idle_.erase(it);
      stats_.warm_takes++;
      stats_.idle_bytes -= found->capacity;
      stats_.in_use_bytes += found->capacity;
    }
    collect_excess(excess);
  }
  for (auto& [cap, b] : excess) unmap(b);
  if (found != nullptr) return found;

  const size_t cap = round_up(bytes);
  void* p = mmap(nullptr, cap, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw std::bad_alloc();
  // No MADV_HUGEPAGE: where the kernel's THP defrag is "madvise" (a common default) that
  // advice makes the first touch compact memory synchronously (measured: 1.5 s for a 200 MiB
  // buffer, against ~0.13 s of ordinary faults), and a buffer is faulted in once anyway.
  auto* b = new (std::nothrow) FrameBuffer;
  if (b == nullptr) {
    munmap(p, cap);
    throw std::bad_alloc();
  }
  b->data = static_cast<uint8_t*>(p);
  b->capacity = cap;
  std::lock_guard<std::mutex> lock(mu_);
  b->owner = pid_;
  stats_.mapped++;
  stats_.in_use_bytes += cap;
  return b;
}

void FramePool::give_back(FrameBuffer* b) noexcept {
  if (b == nullptr) return;
  std::multimap<size_t, FrameBuffer*> excess;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.in_use_bytes -= b->capacity;
    if (b->owner != pid_) {
      // Mapped before a fork, in the parent: here its pages are copy-on-write, so reusing
      // it would fault each one in again with a copy. Unmapped instead.
      stats_.unmapped++;
      excess.emplace(b->capacity, b);
    } else {
      b->idle_since = std::chrono::steady_clock::now();
      idle_.emplace(b->capacity, b);
      stats_.idle_bytes += b->capacity;
    }
    collect_excess(excess);
  }
  for (auto& [cap, e] : excess) unmap(e);
}

void FramePool::collect_excess(std::multimap<size_t, FrameBuffer*>& out) {
  const auto now = std::chrono::steady_clock::now();
  for (auto it = idle_.begin(); it != idle_.end();) {
    if (now - it->second->idle_since > max_idle_age_) {
      stats_.idle_bytes -= it->first;
      stats_.unmapped++;
      out.emplace(it->first, it->second);
      it = idle_.erase(it);
    } else {
      ++it;
    }
  }
  while (stats_.idle_bytes > max_idle_bytes_ && !idle_.empty()) {
    auto oldest = idle_.begin();
    for (auto it = idle_.begin(); it != idle_.end(); ++it) {
      if (it->second->idle_since < oldest->second->idle_since) oldest = it;
    }
    stats_.idle_bytes -= oldest->first;
    stats_.unmapped++;
    out.emplace(oldest->first, oldest->second);
    idle_.erase(oldest);
  }
}

void FramePool::unmap(FrameBuffer* b) noexcept {
  munmap(b->data, b->capacity);
  delete b;
}

void FramePool::set_max_idle_bytes(uint64_t n) {
  std::multimap<size_t, FrameBuffer*> excess;
  {
    std::lock_guard<std::mutex> lock(mu_);
    max_idle_bytes_ = n;
    collect_excess(excess);
  }
  for (auto& [cap, b] : excess) unmap(b);
}

uint64_t FramePool::max_idle_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return max_idle_bytes_;
}

FramePoolStats FramePool::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void FramePool::zmq_free(void* /*data*/, void* hint) noexcept {
  process().give_back(static_cast<FrameBuffer*>(hint));
}

void FramePool::reset_after_fork() noexcept {
  // The mutex may be held by a thread that does not exist here: a fresh one in its place
  // (std::mutex has a constexpr constructor and, on this platform, nothing to destroy).
  new (&mu_) std::mutex();
  pid_ = getpid();
  // The idle buffers are the parent's, copy-on-write here: reusing one would fault every
  // page in again with a copy. Unmapped (this child's view of them only).
  for (auto& [cap, b] : idle_) {
    stats_.unmapped++;
    unmap(b);
  }
  idle_.clear();
  stats_.idle_bytes = 0;
}

FramePool& FramePool::process() {
  // Never destroyed: ZeroMQ's I/O thread may give a buffer back during exit.
  static FramePool* pool = [] {
    auto* p = new FramePool(uint64_t{512} << 20, std::chrono::seconds(10));
    pthread_atfork(nullptr, nullptr, [] { process().reset_after_fork(); });
    return p;
  }();
  return *pool;
}

}  // namespace vllm_shm_arena
