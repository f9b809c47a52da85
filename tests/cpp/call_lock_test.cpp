// Tests of the call lock (call_lock.cpp): one holder at a time, a holder's own second
// acquire refused instead of deadlocking, bounded waits, and a forked child taking afresh a
// lock its parent's thread held.
#include "core/call_lock.h"

#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "catch_compat.hpp"
#include "test_util.hpp"

using vllm_shm_arena::CallLock;
using Result = CallLock::Result;

TEST_CASE("one holder at a time; the holder's second acquire is refused", "[call_lock]") {
  CallLock sut;
  REQUIRE(sut.acquire(1, 0) == Result::kAcquired);
  CHECK(sut.locked());
  CHECK(sut.owner() == 1);
  CHECK(sut.acquire(1, -1) == Result::kHeldByCaller);  // never waits for itself
  CHECK(sut.acquire(2, 0) == Result::kTimeout);
  auto t0 = std::chrono::steady_clock::now();
  CHECK(sut.acquire(2, 50'000'000) == Result::kTimeout);
  CHECK(std::chrono::steady_clock::now() - t0 >= std::chrono::milliseconds(40));
  CHECK(sut.release());
  CHECK_FALSE(sut.release());
  CHECK_FALSE(sut.locked());
  CHECK(sut.owner() == 0);
  CHECK(sut.acquire(2, 0) == Result::kAcquired);
}

TEST_CASE("a waiter takes the lock as soon as the holder lets go", "[call_lock][threads]") {
  CallLock sut;
  REQUIRE(sut.acquire(1, 0) == Result::kAcquired);
  std::atomic<bool> got{false};
  std::thread waiter([&] {
    got = sut.acquire(2, -1) == Result::kAcquired;
    sut.release();
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  CHECK_FALSE(got.load());
  sut.release();
  waiter.join();
  CHECK(got.load());
  CHECK_FALSE(sut.locked());
}

TEST_CASE("threads serialised by the lock never overlap", "[call_lock][threads]") {
  CallLock sut;
  std::atomic<int> inside{0};
  std::atomic<int> overlaps{0};
  std::vector<std::thread> ts;
  for (uint64_t id = 1; id <= 4; ++id) {
    ts.emplace_back([&, id] {
      for (int i = 0; i < 2000; ++i) {
        while (sut.acquire(id, 1'000'000) != Result::kAcquired) {
        }
        if (inside.fetch_add(1) != 0) overlaps.fetch_add(1);
        inside.fetch_sub(1);
        sut.release();
      }
    });
  }
  for (auto& t : ts) t.join();
  CHECK(overlaps.load() == 0);
  CHECK_FALSE(sut.locked());
}

TEST_CASE("a forked child takes afresh a lock its parent's thread held", "[call_lock][fork]") {
  CallLock sut;
  REQUIRE(sut.acquire(7, 0) == Result::kAcquired);  // a thread the child will not have
  pid_t pid = fork();
  if (pid == 0) {
    bool ok = !sut.locked() && sut.acquire(1, 0) == Result::kAcquired && sut.release();
    _exit(ok ? 0 : 1);
  }
  REQUIRE(pid > 0);
  CHECK(vsa_test::wait_child(pid, 10) == 0);
  CHECK(sut.locked());  // the parent's state is its own
  CHECK(sut.owner() == 7);
}
