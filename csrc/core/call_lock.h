// CallLock: the lock that serialises one queue end's calls, and knows which thread holds it.
//
// A call of a queue end (enqueue, dequeue, the handshake) runs under its end's lock. Two
// things a plain mutex cannot tell are needed around it:
//   * who holds it: a call made from inside another call of the same thread (a signal handler
//     that runs while the call waits) must fail at once, not deadlock and not run the
//     single-threaded ring ends twice at the same time;
//   * whether the holder is this process's: a child forked while another thread held the lock
//     inherits it held by a thread that does not exist there, so the child takes it afresh.
// Waits are bounded slices chosen by the caller, who checks for its own interruptions (the
// bindings: Python's signal handlers) between them.
#pragma once

#include <sys/types.h>

#include <condition_variable>
#include <cstdint>
#include <mutex>

namespace vllm_shm_arena {

class CallLock {
 public:
  enum class Result {
    kAcquired,      ///< the caller holds it now
    kTimeout,       ///< another holder kept it for the whole wait
    kHeldByCaller,  ///< `owner` holds it already (a call from inside a call)
  };

  CallLock();
  CallLock(const CallLock&) = delete;
  CallLock& operator=(const CallLock&) = delete;

  /// Takes the lock for `owner` (a nonzero token naming the calling thread), waiting at most
  /// `wait_ns` (0: no wait; < 0: no limit).
  Result acquire(uint64_t owner, int64_t wait_ns);
  /// Lets go of it; false when it was not held.
  bool release();
  /// Whether some thread of this process holds it.
  bool locked();
  /// The holder's token, 0 when free.
  uint64_t owner();

 private:
  /// In a forked child: the parent's state is not this process's (called with nothing held).
  void adopt_after_fork();

  pid_t pid_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool held_ = false;   // guarded by mu_
  uint64_t owner_ = 0;  // guarded by mu_
};

}  // namespace vllm_shm_arena
