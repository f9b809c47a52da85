// Tests for csrc/core/futex.cpp: timeouts, wake-ups across threads and across processes, EINTR.
#include "core/futex.h"

#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <new>
#include <thread>
#include <vector>

#include "catch_compat.hpp"
#include "core/errors.h"

using namespace vllm_shm_arena;

namespace {

using Clock = std::chrono::steady_clock;
constexpr int64_t kMs = 1000 * 1000;

int64_t elapsed_ms(Clock::time_point since) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - since).count();
}

void on_sigusr1(int) {}

}  // namespace

TEST_CASE("futex_wait times out while the word holds the expected value", "[futex]") {
  std::atomic<uint32_t> sut{5};
  const auto t0 = Clock::now();
  CHECK_FALSE(futex_wait(&sut, 5, 20 * kMs));
  const int64_t ms = elapsed_ms(t0);
  CHECK(ms >= 19);
  CHECK(ms < 2000);
  // A zero timeout polls.
  CHECK_FALSE(futex_wait(&sut, 5, 0));
}

TEST_CASE("futex_wait returns at once when the word differs", "[futex]") {
  std::atomic<uint32_t> sut{1};
  const auto t0 = Clock::now();
  CHECK(futex_wait(&sut, 0, 5000 * kMs));
  CHECK(elapsed_ms(t0) < 1000);
}

TEST_CASE("futex_wake_all wakes every waiting thread", "[futex]") {
  std::atomic<uint32_t> sut{0};
  constexpr int kWaiters = 3;
  std::atomic<int> woken{0};
  std::atomic<int> timed_out{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < kWaiters; ++i) {
    threads.emplace_back([&] {
      // Loop on the word: a wake may be spurious, and a waiter that starts late sees 1 at once.
      while (sut.load(std::memory_order_acquire) == 0) {
        if (!futex_wait(&sut, 0, 5000 * kMs)) {
          timed_out.fetch_add(1);
          return;
        }
      }
      woken.fetch_add(1);
    });
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  const auto t0 = Clock::now();
  sut.store(1, std::memory_order_release);
  futex_wake_all(&sut);
  for (auto& t : threads) t.join();
  CHECK(woken.load() == kWaiters);
  CHECK(timed_out.load() == 0);
  CHECK(elapsed_ms(t0) < 2000);
}

TEST_CASE("futex_wait with a negative timeout waits until woken", "[futex]") {
  std::atomic<uint32_t> sut{0};
  std::atomic<bool> returned{false};
  std::thread waiter([&] {
    while (sut.load(std::memory_order_acquire) == 0) futex_wait(&sut, 0, -1);
    returned.store(true);
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  CHECK_FALSE(returned.load());
  sut.store(1, std::memory_order_release);
  futex_wake_all(&sut);
  waiter.join();
  CHECK(returned.load());
}

TEST_CASE("futex_wait is not cut short by a signal (EINTR)", "[futex]") {
  struct sigaction sa{};
  struct sigaction old{};
  sa.sa_handler = on_sigusr1;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = 0;  // No SA_RESTART: the futex syscall returns EINTR.
  REQUIRE(sigaction(SIGUSR1, &sa, &old) == 0);
  std::atomic<uint32_t> sut{0};
  bool result = true;
  int64_t ms = 0;
  std::atomic<bool> started{false};
  std::thread waiter([&] {
    started.store(true);
    const auto t0 = Clock::now();
    result = futex_wait(&sut, 0, 200 * kMs);
    ms = elapsed_ms(t0);
  });
  while (!started.load()) std::this_thread::yield();
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  pthread_kill(waiter.native_handle(), SIGUSR1);
  waiter.join();
  sigaction(SIGUSR1, &old, nullptr);
  CHECK_FALSE(result);
  CHECK(ms >= 195);
}

TEST_CASE("futex_wake_all wakes a waiter in another process", "[futex]") {
  void* mem = mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  REQUIRE(mem != MAP_FAILED);
  auto* sut = new (mem) std::atomic<uint32_t>(0);
  auto* child_waiting = new (static_cast<char*>(mem) + 64) std::atomic<uint32_t>(0);
  std::fflush(nullptr);
  const pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    alarm(20);
    child_waiting->store(1);
    const auto t0 = Clock::now();
    // One wait, no loop: it must end by the parent's wake (true), not by the 5 s timeout.
    const bool woken = futex_wait(sut, 0, 5000 * kMs);
    _exit(woken && elapsed_ms(t0) < 3000 ? 0 : 1);
  }
  while (child_waiting->load() == 0) std::this_thread::yield();
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  sut->store(1, std::memory_order_release);
  futex_wake_all(sut);
  int status = 0;
  const auto t0 = Clock::now();
  pid_t r = 0;
  while ((r = waitpid(pid, &status, WNOHANG)) == 0 && elapsed_ms(t0) < 10000) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  if (r == 0) {
    kill(pid, SIGKILL);
    waitpid(pid, &status, 0);
  }
  munmap(mem, 4096);
  REQUIRE(r == pid);
  REQUIRE(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
}

TEST_CASE("futex helpers reject a null word", "[futex]") {
  CHECK_THROWS_AS(futex_wait(nullptr, 0, 0), InvalidArgument);
  CHECK_THROWS_AS(futex_wake_all(nullptr), InvalidArgument);
}
