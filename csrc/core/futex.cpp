#include "core/futex.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <climits>
#include <ctime>

#include "core/errors.h"

namespace vllm_shm_arena {

namespace {

constexpr int64_t kMaxFiniteTimeoutNs = int64_t{1} << 60;

long sys_futex(std::atomic<uint32_t>* word, int op, uint32_t val, const struct timespec* timeout) {
  return ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, val, timeout, nullptr, 0);
}

void check_word(const std::atomic<uint32_t>* word, const char* fn) {
  if (word == nullptr) throw InvalidArgument(std::string(fn) + ": word must not be null");
}

}  // namespace

bool futex_wait(std::atomic<uint32_t>* word, uint32_t expected, int64_t timeout_ns) {
  check_word(word, "futex_wait");
  using Clock = std::chrono::steady_clock;
  // Beyond ~30 years a timeout is "forever", and adding it to now() could overflow.
  if (timeout_ns > kMaxFiniteTimeoutNs) timeout_ns = -1;
  // FUTEX_WAIT takes a relative timeout, so keep an absolute deadline to restart after EINTR
  // without stretching the total wait.
  const Clock::time_point deadline =
      Clock::now() + std::chrono::nanoseconds(timeout_ns < 0 ? 0 : timeout_ns);
  while (true) {
    struct timespec ts;
    const struct timespec* tsp = nullptr;
    if (timeout_ns >= 0) {
      const int64_t left =
          std::chrono::duration_cast<std::chrono::nanoseconds>(deadline - Clock::now()).count();
      if (left <= 0) return false;
      ts.tv_sec = static_cast<time_t>(left / 1000000000);
      ts.tv_nsec = static_cast<long>(left % 1000000000);
      tsp = &ts;
    }
    if (sys_futex(word, FUTEX_WAIT, expected, tsp) == 0) return true;
    switch (errno) {
      case EAGAIN:  // The word no longer held `expected` when the kernel looked.
        return true;
      case ETIMEDOUT:
        return false;
      case EINTR:
        // SYNC POINT: relaxed; only decides whether to sleep again, the caller re-checks its
        // own condition with the orders it needs.
        if (word->load(std::memory_order_relaxed) != expected) return true;
        continue;
      default:
        throw ShmError(errno_message("futex(FUTEX_WAIT)", errno));
    }
  }
}

void futex_wake_all(std::atomic<uint32_t>* word) {
  check_word(word, "futex_wake_all");
  if (sys_futex(word, FUTEX_WAKE, static_cast<uint32_t>(INT_MAX), nullptr) < 0) {
    throw ShmError(errno_message("futex(FUTEX_WAKE)", errno));
  }
}

}  // namespace vllm_shm_arena
