// Tests of the frame pool (frame_pool.cpp): a given-back buffer serves the next take of a
// size it fits (and not one far smaller), the idle bounds in bytes and age, buffers given
// back from other threads, and a forked child using the pool its parent's thread held.
#include "core/frame_pool.h"

#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "catch_compat.hpp"

using vllm_shm_arena::FrameBuffer;
using vllm_shm_arena::FramePool;
using namespace std::chrono_literals;

namespace {
constexpr size_t MiB = size_t{1} << 20;
}

TEST_CASE("a buffer given back serves the next take it fits, warm", "[frame_pool]") {
  FramePool sut(64 * MiB, 60s);
  FrameBuffer* a = sut.take(3 * MiB);
  REQUIRE(a->capacity >= 3 * MiB);
  CHECK(a->capacity % FramePool::kGranule == 0);
  std::memset(a->data, 0xab, 3 * MiB);  // every byte writable
  uint8_t* data = a->data;
  sut.give_back(a);
  CHECK(sut.stats().idle_bytes == a->capacity);
  FrameBuffer* b = sut.take(3 * MiB - 100);
  CHECK(b->data == data);  // the same mapping again
  CHECK(b->data[0] == 0xab);
  auto s = sut.stats();
  CHECK(s.takes == 2);
  CHECK(s.warm_takes == 1);
  CHECK(s.mapped == 1);
  CHECK(s.idle_bytes == 0);
  CHECK(s.in_use_bytes == b->capacity);
  sut.give_back(b);
}

TEST_CASE("a small take does not pin a large idle buffer", "[frame_pool]") {
  FramePool sut(256 * MiB, 60s);
  FrameBuffer* big = sut.take(64 * MiB);
  sut.give_back(big);
  FrameBuffer* small = sut.take(MiB);
  CHECK(small->capacity == FramePool::kGranule);  // a new buffer, not the 64 MiB one
  CHECK(sut.stats().idle_bytes == 64 * MiB);
  CHECK(FramePool::fit_limit(MiB) == MiB + FramePool::kGranule);
  CHECK(FramePool::fit_limit(64 * MiB) == 128 * MiB);
  sut.give_back(small);
}

TEST_CASE("idle buffers beyond the byte bound go, the oldest first", "[frame_pool]") {
  FramePool sut(8 * MiB, 60s);
  FrameBuffer* a = sut.take(4 * MiB);
  FrameBuffer* b = sut.take(4 * MiB);
  FrameBuffer* c = sut.take(4 * MiB);
  uint8_t* b_data = b->data;
  uint8_t* c_data = c->data;
  sut.give_back(a);
  std::this_thread::sleep_for(2ms);  // distinct idle times (the order is what is tested)
  sut.give_back(b);
  std::this_thread::sleep_for(2ms);
  sut.give_back(c);  // 12 MiB idle > 8: a, the oldest, goes
  auto s = sut.stats();
  CHECK(s.idle_bytes == 8 * MiB);
  CHECK(s.unmapped == 1);
  FrameBuffer* x = sut.take(4 * MiB);
  FrameBuffer* y = sut.take(4 * MiB);
  CHECK(((x->data == b_data && y->data == c_data) || (x->data == c_data && y->data == b_data)));
  sut.give_back(x);
  sut.give_back(y);
  sut.set_max_idle_bytes(0);
  CHECK(sut.stats().idle_bytes == 0);
  CHECK(sut.max_idle_bytes() == 0);
}

TEST_CASE("an idle buffer older than the age bound is unmapped", "[frame_pool]") {
  FramePool sut(64 * MiB, 20ms);
  sut.give_back(sut.take(MiB));
  CHECK(sut.stats().idle_bytes == FramePool::kGranule);
  std::this_thread::sleep_for(40ms);
  FrameBuffer* b = sut.take(32 * MiB);  // any call collects what aged
  CHECK(sut.stats().idle_bytes == 0);
  CHECK(sut.stats().unmapped == 1);
  sut.give_back(b);
}

TEST_CASE("buffers given back from other threads", "[frame_pool][threads]") {
  FramePool sut(512 * MiB, 60s);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&sut, t] {
      for (int i = 0; i < 200; ++i) {
        FrameBuffer* b = sut.take(MiB + static_cast<size_t>((t * 7 + i) % 5) * MiB);
        b->data[0] = static_cast<uint8_t>(i);
        b->data[b->capacity - 1] = static_cast<uint8_t>(t);
        std::thread giver([&sut, b] { sut.give_back(b); });
        giver.join();
      }
    });
  }
  for (auto& th : threads) th.join();
  auto s = sut.stats();
  CHECK(s.takes == 800);
  CHECK(s.in_use_bytes == 0);
  CHECK(s.warm_takes > 0);
  CHECK(s.idle_bytes <= 512 * MiB);
}

TEST_CASE("a forked child uses the pool whatever the parent's threads held", "[frame_pool]") {
  FramePool& sut = FramePool::process();
  FrameBuffer* held = sut.take(MiB);
  std::atomic<bool> stop{false};
  std::thread churn([&] {
    while (!stop.load()) sut.give_back(sut.take(MiB));
  });
  pid_t pid = fork();
  if (pid == 0) {
    FrameBuffer* b = FramePool::process().take(2 * MiB);
    b->data[0] = 1;
    FramePool::process().give_back(b);
    _exit(0);
  }
  int status = 0;
  REQUIRE(waitpid(pid, &status, 0) == pid);
  stop = true;
  churn.join();
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  sut.give_back(held);
}

TEST_CASE("a forked child never reuses its parent's buffers (copy-on-write there)",
          "[frame_pool]") {
  FramePool& sut = FramePool::process();
  sut.give_back(sut.take(3 * MiB));  // idle in the parent
  FrameBuffer* held = sut.take(5 * MiB);
  held->data[0] = 7;
  REQUIRE(sut.stats().idle_bytes > 0);
  pid_t pid = fork();
  if (pid == 0) {
    FramePool& pool = FramePool::process();
    vllm_shm_arena::FramePoolStats s = pool.stats();
    if (s.idle_bytes != 0) _exit(1);
    FrameBuffer* b = pool.take(3 * MiB);  // a new mapping, not the parent's idle buffer
    if (pool.stats().mapped != s.mapped + 1) _exit(2);
    pool.give_back(b);
    if (pool.stats().idle_bytes == 0) _exit(3);  // this child's own buffer is kept
    const uint64_t unmapped = pool.stats().unmapped;
    pool.give_back(held);  // inherited in use: unmapped, not kept
    if (pool.stats().unmapped != unmapped + 1) _exit(4);
    _exit(0);
  }
  int status = 0;
  REQUIRE(waitpid(pid, &status, 0) == pid);
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  CHECK(held->data[0] == 7);  // the parent's buffer is untouched
  sut.give_back(held);
}
