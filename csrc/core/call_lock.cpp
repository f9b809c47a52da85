#include "core/call_lock.h"

#include <unistd.h>

#include <chrono>
#include <new>

namespace vllm_shm_arena {

CallLock::CallLock() : pid_(getpid()) {}

void CallLock::adopt_after_fork() {
  if (getpid() == pid_) return;
  // The parent's threads do not exist here: whatever they held (the lock, or the mutex for
  // the instant a method runs) is nobody's. A forked child runs one thread until it starts
  // others, so rebuilding in place is not raced.
  new (&mu_) std::mutex();
  new (&cv_) std::condition_variable();
  held_ = false;
  owner_ = 0;
  pid_ = getpid();
}

CallLock::Result CallLock::acquire(uint64_t owner, int64_t wait_ns) {
  adopt_after_fork();
  std::unique_lock<std::mutex> lock(mu_);
  if (held_ && owner_ == owner) return Result::kHeldByCaller;
  if (held_) {
    if (wait_ns == 0) return Result::kTimeout;
    auto free = [this] { return !held_; };
    if (wait_ns < 0) {
      cv_.wait(lock, free);
    } else if (!cv_.wait_for(lock, std::chrono::nanoseconds(wait_ns), free)) {
      return Result::kTimeout;
    }
  }
  held_ = true;
  owner_ = owner;
  return Result::kAcquired;
}

bool CallLock::release() {
  adopt_after_fork();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!held_) return false;
    held_ = false;
    owner_ = 0;
  }
  cv_.notify_one();
  return true;
}

bool CallLock::locked() {
  adopt_after_fork();
  std::lock_guard<std::mutex> lock(mu_);
  return held_;
}

uint64_t CallLock::owner() {
  adopt_after_fork();
  std::lock_guard<std::mutex> lock(mu_);
  return owner_;
}

}  // namespace vllm_shm_arena
