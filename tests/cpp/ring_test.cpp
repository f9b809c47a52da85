// Tests for csrc/core/ring.cpp: ordering across forked readers and threads, blocking and
// timeouts, shutdown, dead readers (reaped and zombie), rank/role exclusivity, validation.
//
// Random message sizes come from a seed printed at the start of each test; set VSA_SEED to
// replay a failure. Every forked child ends in _exit() and dies with its parent
// (PR_SET_PDEATHSIG) or after 30 s (alarm), so no test can leave a process behind or hang.
#include "core/ring.h"
#include "core/copy_pool.h"

#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <fstream>
#include <memory>
#include <new>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "catch_compat.hpp"
#include "core/errors.h"
#include "test_util.hpp"

using namespace vllm_shm_arena;

namespace {

using Clock = std::chrono::steady_clock;
using Status = RingReader::Status;
constexpr int64_t kMs = 1000 * 1000;
constexpr int64_t kLongNs = 10000 * kMs;  // Generous: only reached when something is broken.

RingConfig ring_config(uint32_t n_readers, uint32_t max_chunks, uint64_t max_chunk_bytes) {
  RingConfig config;
  config.n_readers = n_readers;
  config.max_chunks = max_chunks;
  config.max_chunk_bytes = max_chunk_bytes;
  return config;
}

int64_t elapsed_ms(Clock::time_point since) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - since).count();
}

uint64_t seed_for_test() {
  uint64_t seed = 0;
  if (const char* env = std::getenv("VSA_SEED")) {
    seed = std::strtoull(env, nullptr, 0);
  } else {
    seed = (uint64_t{std::random_device{}()} << 32) ^ std::random_device{}();
  }
  std::printf("ring_test: seed=%llu (replay with VSA_SEED=%llu)\n",
              static_cast<unsigned long long>(seed), static_cast<unsigned long long>(seed));
  std::fflush(stdout);
  return seed;
}

uint64_t mix(uint64_t x) {  // splitmix64 finaliser
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// The message with sequence number `seq` is fully determined by (seed, seq), so readers in other
// processes can check it without being told what was sent.
uint64_t message_size(uint64_t seed, uint64_t seq, uint64_t max_bytes) {
  return mix(seed ^ (seq * 0x100000001b3ull)) % (max_bytes + 1);
}
uint32_t message_flags(uint64_t seq) { return static_cast<uint32_t>(seq * 2654435761u); }
void fill_message(uint64_t seed, uint64_t seq, uint8_t* p, uint64_t n) {
  const uint64_t h = mix(seed + seq);
  for (uint64_t i = 0; i < n; i += 8) {
    const uint64_t w = mix(h + i);
    std::memcpy(p + i, &w, n - i < 8 ? n - i : 8);
  }
}
// Returns an empty string when the message matches, else what is wrong.
std::string check_message(uint64_t seed, uint64_t seq, uint64_t max_bytes, const uint8_t* p,
                          uint64_t n, uint32_t flags) {
  const uint64_t want = message_size(seed, seq, max_bytes);
  if (n != want) {
    return "message " + std::to_string(seq) + ": nbytes " + std::to_string(n) +
           " != " + std::to_string(want);
  }
  if (flags != message_flags(seq)) return "message " + std::to_string(seq) + ": flags differ";
  const uint64_t h = mix(seed + seq);
  for (uint64_t i = 0; i < n; i += 8) {
    const uint64_t w = mix(h + i);
    if (std::memcmp(p + i, &w, n - i < 8 ? n - i : 8) != 0) {
      return "message " + std::to_string(seq) + ": content differs at byte " + std::to_string(i);
    }
  }
  return "";
}

// A MAP_SHARED | MAP_ANONYMOUS block holding a ring, plus one spare page for test flags.
// A ring in a file of a private directory, mapped shared: forked children see the same
// bytes, and the file carries the roles' liveness tokens.
class SharedRing {
 public:
  explicit SharedRing(const RingConfig& config) : ring_bytes_(ring_bytes(config)) {
    map_bytes_ = ring_bytes_ + 4096;
    path_ = dir_.path() + "/ring";
    fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd_ < 0 || ::ftruncate(fd_, static_cast<off_t>(map_bytes_)) != 0) {
      throw std::runtime_error("cannot create " + path_);
    }
    base_ = mmap(nullptr, map_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
    if (base_ == MAP_FAILED) throw std::runtime_error("mmap failed");
    ring_init(base_, ring_bytes_, config);
    flags_ = reinterpret_cast<std::atomic<uint32_t>*>(static_cast<uint8_t*>(base_) + ring_bytes_);
    for (int i = 0; i < 16; ++i) new (&flags_[i]) std::atomic<uint32_t>(0);
  }
  ~SharedRing() {
    munmap(base_, map_bytes_);
    ::close(fd_);
  }
  SharedRing(const SharedRing&) = delete;
  SharedRing& operator=(const SharedRing&) = delete;

  void* base() const { return base_; }
  size_t bytes() const { return ring_bytes_; }
  TokenFile tokens() const { return TokenFile{path_, fd_}; }
  // Test-private shared flags, zero-initialised, outside the ring.
  std::atomic<uint32_t>& flag(int i) { return flags_[i]; }

 private:
  vsa_test::TempDir dir_;
  std::string path_;
  int fd_ = -1;
  size_t ring_bytes_;
  size_t map_bytes_;
  void* base_;
  std::atomic<uint32_t>* flags_;
};

// Forked children of one test: killed and reaped when the test ends, whatever way it ends.
class Children {
 public:
  ~Children() {
    for (pid_t pid : pids_) {
      kill(pid, SIGKILL);
      waitpid(pid, nullptr, 0);
    }
  }

  // Runs `body` in a child; its return value is the exit code, an exception is exit code 99.
  template <class F>
  pid_t spawn(F&& body) {
    std::fflush(nullptr);
    const pid_t pid = fork();
    if (pid < 0) throw std::runtime_error("fork failed");
    if (pid == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      alarm(30);
      int rc = 99;
      try {
        rc = body();
      } catch (const std::exception& e) {
        std::fprintf(stderr, "child %d: %s\n", static_cast<int>(getpid()), e.what());
      } catch (...) {
      }
      std::fflush(nullptr);
      _exit(rc);
    }
    pids_.push_back(pid);
    return pid;
  }

  // Waits for `pid` to exit; returns its exit code, or -1 if it timed out (then it is killed)
  // or died from a signal.
  int wait_exit(pid_t pid, int64_t timeout_ms) {
    const auto t0 = Clock::now();
    int status = 0;
    pid_t r = 0;
    while ((r = waitpid(pid, &status, WNOHANG)) == 0 && elapsed_ms(t0) < timeout_ms) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    if (r == 0) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
    }
    forget(pid);
    if (r != pid || !WIFEXITED(status)) return -1;
    return WEXITSTATUS(status);
  }

  void reap(pid_t pid) {
    waitpid(pid, nullptr, 0);
    forget(pid);
  }

 private:
  void forget(pid_t pid) {
    for (auto it = pids_.begin(); it != pids_.end(); ++it) {
      if (*it == pid) {
        pids_.erase(it);
        return;
      }
    }
  }
  std::vector<pid_t> pids_;
};

bool wait_flag(std::atomic<uint32_t>& f, uint32_t value, int64_t timeout_ms) {
  const auto t0 = Clock::now();
  while (f.load(std::memory_order_acquire) != value) {
    if (elapsed_ms(t0) > timeout_ms) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  return true;
}

char proc_state(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  std::getline(in, line);
  const size_t p = line.rfind(')');
  return p == std::string::npos || p + 2 >= line.size() ? '?' : line[p + 2];
}

template <class E, class F>
std::string thrown_message(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  return "<nothing thrown>";
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

// Reads `count` messages as `rank` and checks each, then expects kShutdown. Returns "" or the
// first problem.
std::string read_and_check(SharedRing& shm, uint32_t rank, uint64_t seed, uint64_t count) {
  RingReader reader(shm.base(), shm.bytes(), rank, shm.tokens());
  const uint64_t max_bytes = reader.config().max_chunk_bytes;
  for (uint64_t seq = 1; seq <= count; ++seq) {
    const uint8_t* data = nullptr;
    uint64_t n = 0;
    uint32_t flags = 0;
    const Status st = reader.acquire(kLongNs, &data, &n, &flags);
    if (st != Status::kOk) {
      return "rank " + std::to_string(rank) + ": acquire of message " + std::to_string(seq) +
             " returned status " + std::to_string(static_cast<int>(st));
    }
    std::string err = check_message(seed, seq, max_bytes, data, n, flags);
    if (!err.empty()) return "rank " + std::to_string(rank) + ": " + err;
    reader.release();
  }
  const uint8_t* data = nullptr;
  uint64_t n = 0;
  uint32_t flags = 0;
  if (reader.acquire(kLongNs, &data, &n, &flags) != Status::kShutdown) {
    return "rank " + std::to_string(rank) + ": no kShutdown after the last message";
  }
  return "";
}

// Writes `count` messages in order, then shuts down. Returns "" or the first problem.
std::string write_all(RingWriter& sut, uint64_t seed, uint64_t count) {
  const uint64_t max_bytes = sut.config().max_chunk_bytes;
  for (uint64_t seq = 1; seq <= count; ++seq) {
    uint8_t* p = sut.acquire(kLongNs);
    if (p == nullptr) return "writer: acquire for message " + std::to_string(seq) + " timed out";
    const uint64_t n = message_size(seed, seq, max_bytes);
    fill_message(seed, seq, p, n);
    sut.publish(n, message_flags(seq));
  }
  sut.shutdown();
  return "";
}

}  // namespace

TEST_CASE("ring delivers 10,000 random-size messages in order to forked readers", "[ring]") {
  const uint32_t n_readers = GENERATE(1u, 2u, 4u);
  const uint64_t seed = seed_for_test();
  INFO("seed=" << seed << " n_readers=" << n_readers);
  constexpr uint64_t kMessages = 10000;
  RingConfig config = ring_config(n_readers, 8, 4096);
  SharedRing shm(config);
  Children children;
  std::vector<pid_t> pids;
  const auto t0 = Clock::now();
  for (uint32_t r = 0; r < n_readers; ++r) {
    pids.push_back(children.spawn([&, r] {
      const std::string err = read_and_check(shm, r, seed, kMessages);
      if (err.empty()) return 0;
      std::fprintf(stderr, "%s\n", err.c_str());
      return 1;
    }));
  }
  RingWriter sut(shm.base(), shm.bytes(), shm.tokens());
  const std::string err = write_all(sut, seed, kMessages);
  REQUIRE(err.empty());
  for (pid_t pid : pids) CHECK(children.wait_exit(pid, 20000) == 0);
  CHECK(sut.dropped_readers() == 0);
  CHECK(sut.published() == kMessages);
  std::printf("ring_test: %llu messages to %u forked readers in %lld ms\n",
              static_cast<unsigned long long>(kMessages), n_readers,
              static_cast<long long>(elapsed_ms(t0)));
}

TEST_CASE("ring delivers in order to reader threads of one process", "[ring][threads]") {
  const uint32_t max_chunks = GENERATE(2u, 16u);
  const uint64_t seed = seed_for_test();
  INFO("seed=" << seed << " max_chunks=" << max_chunks);
  constexpr uint32_t kReaders = 3;
  constexpr uint64_t kMessages = 3000;
  RingConfig config = ring_config(kReaders, max_chunks, 512);
  SharedRing shm(config);
  RingWriter sut(shm.base(), shm.bytes(), shm.tokens());
  std::vector<std::string> errors(kReaders);
  std::vector<std::thread> threads;
  for (uint32_t r = 0; r < kReaders; ++r) {
    threads.emplace_back([&, r] {
      try {
        errors[r] = read_and_check(shm, r, seed, kMessages);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  std::string writer_error;
  try {
    writer_error = write_all(sut, seed, kMessages);
  } catch (const std::exception& e) {
    writer_error = e.what();
  }
  if (!writer_error.empty()) sut.shutdown();  // Unblocks the readers so join() returns.
  for (auto& t : threads) t.join();
  CHECK(writer_error == "");
  for (uint32_t r = 0; r < kReaders; ++r) CHECK(errors[r] == "");
  CHECK(sut.dropped_readers() == 0);
}

TEST_CASE("ring writer blocks while every chunk is unread and times out cleanly", "[ring]") {
  RingConfig config = ring_config(1, 4, 64);
  SharedRing shm(config);
  RingWriter sut(shm.base(), shm.bytes(), shm.tokens());
  RingReader reader(shm.base(), shm.bytes(), 0, shm.tokens());
  for (uint32_t i = 0; i < config.max_chunks; ++i) {
    REQUIRE(sut.acquire(0) != nullptr);
    sut.publish(8, 0);
  }
  const auto t0 = Clock::now();
  CHECK(sut.acquire(30 * kMs) == nullptr);
  const int64_t ms = elapsed_ms(t0);
  CHECK(ms >= 29);
  CHECK(ms < 2000);
  CHECK(sut.acquire(0) == nullptr);
  // Timing out left nothing acquired: publish has nothing to publish.
  CHECK_THROWS_AS(sut.publish(8, 0), InvalidArgument);
  CHECK(sut.dropped_readers() == 0);  // The reader is alive: it was not dropped.

  // One release frees exactly the oldest chunk.
  const uint8_t* data = nullptr;
  uint64_t n = 0;
  uint32_t flags = 0;
  REQUIRE(reader.acquire(0, &data, &n, &flags) == Status::kOk);
  reader.release();
  REQUIRE(sut.acquire(0) != nullptr);
  sut.publish(8, 0);
  CHECK(sut.acquire(0) == nullptr);
}

TEST_CASE("ring writer blocked on a full ring is woken by a release in another process", "[ring]") {
  RingConfig config = ring_config(1, 2, 64);
  SharedRing shm(config);
  RingWriter sut(shm.base(), shm.bytes(), shm.tokens());
  Children children;
  const pid_t pid = children.spawn([&] {
    RingReader reader(shm.base(), shm.bytes(), 0, shm.tokens());
    shm.flag(0).store(1);
    wait_flag(shm.flag(1), 1, 10000);  // The writer is about to block.
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    const uint8_t* data = nullptr;
    uint64_t n = 0;
    uint32_t flags = 0;
    if (reader.acquire(kLongNs, &data, &n, &flags) != Status::kOk) return 1;
    reader.release();
    return 0;
  });
  REQUIRE(wait_flag(shm.flag(0), 1, 10000));
  for (int i = 0; i < 2; ++i) {
    REQUIRE(sut.acquire(0) != nullptr);
    sut.publish(1, 0);
  }
  shm.flag(1).store(1);
  const auto t0 = Clock::now();
  CHECK(sut.acquire(5000 * kMs) != nullptr);
  const int64_t ms = elapsed_ms(t0);
  CHECK(ms >= 90);   // It really waited for the reader...
  CHECK(ms < 3000);  // ...and was woken, not timed out.
  CHECK(children.wait_exit(pid, 10000) == 0);
}

TEST_CASE("ring writer waits for a reader that never attached", "[ring]") {
  RingConfig config = ring_config(2, 2, 64);
  SharedRing shm(config);
  RingWriter sut(shm.base(), shm.bytes(), shm.tokens());
  RingReader reader0(shm.base(), shm.bytes(), 0, shm.tokens());
  const uint8_t* data = nullptr;
  uint64_t n = 0;
  uint32_t flags = 0;
  for (uint32_t i = 0; i < config.max_chunks; ++i) {
    REQUIRE(sut.acquire(0) != nullptr);
    sut.publish(8, 0);
    REQUIRE(reader0.acquire(0, &data, &n, &flags) == Status::kOk);
    reader0.release();
  }
  // Long enough for the writer's liveness check to run: rank 1 has no process to find dead.
  CHECK(sut.acquire(120 * kMs) == nullptr);
  CHECK(sut.dropped_readers() == 0);
  // The late reader still gets the first message.
  RingReader reader1(shm.base(), shm.bytes(), 1, shm.tokens());
  REQUIRE(reader1.acquire(0, &data, &n, &flags) == Status::kOk);
  CHECK(reader1.consumed() == 0);
  reader1.release();
  CHECK(reader1.consumed() == 1);
  CHECK(sut.acquire(0) != nullptr);
}

TEST_CASE("ring writer stops waiting for a reader that detached", "[ring]") {
  RingConfig config = ring_config(2, 2, 64);
  SharedRing shm(config);
  RingWriter sut(shm.base(), shm.bytes(), shm.tokens());
  RingReader reader0(shm.base(), shm.bytes(), 0, shm.tokens());
  {
    RingReader reader1(shm.base(), shm.bytes(), 1, shm.tokens());
  }
  const uint8_t* data = nullptr;
  uint64_t n = 0;
  uint32_t flags = 0;
  for (int i = 0; i < 10; ++i) {
    REQUIRE(sut.acquire(0) != nullptr);
    sut.publish(8, 0);
    REQUIRE(reader0.acquire(0, &data, &n, &flags) == Status::kOk);
    reader0.release();
  }
  CHECK(sut.dropped_readers() == 0);
}

TEST_CASE("ring reader times out on an empty ring", "[ring]") {
  RingConfig config = ring_config(1, 4, 64);
  SharedRing shm(config);
  RingReader sut(shm.base(), shm.bytes(), 0, shm.tokens());
  const uint8_t* data = nullptr;
  uint64_t n = 0;
  uint32_t flags = 0;
  CHECK(sut.acquire(0, &data, &n, &flags) == Status::kTimeout);
  const auto t0 = Clock::now();
  CHECK(sut.acquire(25 * kMs, &data, &n, &flags) == Status::kTimeout);
  const int64_t ms = elapsed_ms(t0);
  CHECK(ms >= 24);
  CHECK(ms < 2000);
  // A timeout holds nothing: there is nothing to release.
  CHECK_THROWS_AS(sut.release(), InvalidArgument);

  RingWriter writer(shm.base(), shm.bytes(), shm.tokens());
  uint8_t* p = writer.acquire(0);
  REQUIRE(p != nullptr);
  std::memcpy(p, "hello", 5);
  writer.publish(5, kRingFlagOverflow);
  REQUIRE(sut.acquire(0, &data, &n, &flags) == Status::kOk);
  CHECK(n == 5);
  CHECK(flags == kRingFlagOverflow);
  CHECK(std::memcmp(data, "hello", 5) == 0);
  sut.release();
}

TEST_CASE("ring reader spins only while messages flow", "[ring]") {
  RingConfig config = ring_config(1, 4, 64);
  SharedRing shm(config);
  RingWriter writer(shm.base(), shm.bytes(), shm.tokens());
  RingReader sut(shm.base(), shm.bytes(), 0, shm.tokens());
  const uint8_t* data = nullptr;
  uint64_t n = 0;
  uint32_t flags = 0;
  // No message yet: the busy window is closed, the wait sleeps without spinning.
  CHECK(sut.acquire(5 * kMs, &data, &n, &flags) == Status::kTimeout);
  CHECK(sut.wait_stats().spin_ns == 0);

  REQUIRE(writer.acquire(0) != nullptr);
  writer.publish(1, 0);
  REQUIRE(sut.acquire(0, &data, &n, &flags) == Status::kOk);
  sut.release();
  CHECK(sut.wait_stats().ready == 1);

  // Right after a message: a message published 2 ms into the wait is caught spinning.
  std::thread publisher([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    REQUIRE(writer.acquire(kLongNs) != nullptr);
    writer.publish(1, 0);
  });
  REQUIRE(sut.acquire(kLongNs, &data, &n, &flags) == Status::kOk);
  sut.release();
  publisher.join();
  const RingWaitStats after = sut.wait_stats();
  CHECK(after.spun == 1);
  CHECK(after.slept == 0);
  CHECK(after.spin_ns > 0);

  // Idle for longer than the busy window: the next wait sleeps at once again.
  std::this_thread::sleep_for(std::chrono::milliseconds(60));
  CHECK(sut.acquire(5 * kMs, &data, &n, &flags) == Status::kTimeout);
  CHECK(sut.wait_stats().spin_ns == after.spin_ns);
}

namespace {

/// Pins the calling thread to one CPU for its lifetime, then restores its mask.
class PinnedToCpu {
 public:
  explicit PinnedToCpu(int cpu) {
    REQUIRE(sched_getaffinity(0, sizeof(saved_), &saved_) == 0);
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(cpu, &one);
    REQUIRE(sched_setaffinity(0, sizeof(one), &one) == 0);
  }
  ~PinnedToCpu() { sched_setaffinity(0, sizeof(saved_), &saved_); }
  PinnedToCpu(const PinnedToCpu&) = delete;
  PinnedToCpu& operator=(const PinnedToCpu&) = delete;

 private:
  cpu_set_t saved_;
};

}  // namespace

TEST_CASE("a ceding ring reader sleeps instead of spinning beside a thread that computes",
          "[ring]") {
  // The reader and a thread that never blocks share one CPU: the reader's sched_yield hands
  // the CPU to it for a whole scheduler slice. A reader that cedes then sleeps on the futex
  // rather than keep taking its share of that CPU until the message comes; one that does not
  // (the default) spins on until the message.
  const bool cede = GENERATE(true, false);
  CAPTURE(cede);
  const int cpu = sched_getcpu();
  REQUIRE(cpu >= 0);
  PinnedToCpu pinned(cpu);
  std::atomic<bool> stop{false};
  std::atomic<bool> computing{false};
  std::thread hog([&] {
    PinnedToCpu also(cpu);
    computing.store(true);
    volatile uint64_t sink = 0;
    while (!stop.load(std::memory_order_relaxed)) sink = sink + 1;
  });
  while (!computing.load()) std::this_thread::yield();

  RingConfig config = ring_config(1, 4, 64);
  SharedRing shm(config);
  RingWriter writer(shm.base(), shm.bytes(), shm.tokens());
  RingReader sut(shm.base(), shm.bytes(), 0, shm.tokens());  // one usable CPU: sched_yield
  sut.set_cede_cpu(cede);
  const uint8_t* data = nullptr;
  uint64_t n = 0;
  uint32_t flags = 0;
  REQUIRE(writer.acquire(0) != nullptr);
  writer.publish(1, 0);
  REQUIRE(sut.acquire(0, &data, &n, &flags) == Status::kOk);  // opens the busy window
  sut.release();

  // 10 ms: several scheduler slices of the busy thread, and well inside the 50 ms busy
  // window, so the reader that does not cede still catches the message spinning.
  std::thread publisher([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    REQUIRE(writer.acquire(kLongNs) != nullptr);
    writer.publish(1, 0);
  });
  const Status got = sut.acquire(kLongNs, &data, &n, &flags);
  publisher.join();
  stop.store(true);
  hog.join();
  REQUIRE(got == Status::kOk);
  sut.release();
  const RingWaitStats stats = sut.wait_stats();
  CHECK(stats.ceded == (cede ? 1 : 0));
  CHECK(stats.slept == (cede ? 1 : 0));
  CHECK(stats.spun == (cede ? 0 : 1));
}

TEST_CASE("ring shutdown wakes a reader blocked in another process", "[ring]") {
  RingConfig config = ring_config(1, 4, 64);
  SharedRing shm(config);
  RingWriter sut(shm.base(), shm.bytes(), shm.tokens());
  Children children;
  const pid_t pid = children.spawn([&] {
    RingReader reader(shm.base(), shm.bytes(), 0, shm.tokens());
    const uint8_t* data = nullptr;
    uint64_t n = 0;
    uint32_t flags = 0;
    shm.flag(0).store(1);
    const auto t0 = Clock::now();
    const Status st = reader.acquire(kLongNs, &data, &n, &flags);
    if (st == Status::kOk) return 1;
    if (st == Status::kTimeout) return 2;
    return elapsed_ms(t0) < 5000 ? 0 : 3;
  });
  REQUIRE(wait_flag(shm.flag(0), 1, 10000));
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // Let it reach futex_wait.
  const auto t0 = Clock::now();
  sut.shutdown();
  CHECK(children.wait_exit(pid, 10000) == 0);
  CHECK(elapsed_ms(t0) < 3000);
}

TEST_CASE("ring shutdown delivers messages already published, then kShutdown", "[ring]") {
  RingConfig config = ring_config(1, 4, 64);
  SharedRing shm(config);
  RingWriter sut(shm.base(), shm.bytes(), shm.tokens());
  RingReader reader(shm.base(), shm.bytes(), 0, shm.tokens());
  for (int i = 0; i < 2; ++i) {
    REQUIRE(sut.acquire(0) != nullptr);
    sut.publish(1, 0);
  }
  sut.shutdown();
  sut.shutdown();  // Idempotent.
  CHECK_THROWS_AS(sut.acquire(0), InvalidArgument);
  const uint8_t* data = nullptr;
  uint64_t n = 0;
  uint32_t flags = 0;
  for (int i = 0; i < 2; ++i) {
    REQUIRE(reader.acquire(0, &data, &n, &flags) == Status::kOk);
    reader.release();
  }
  CHECK(reader.acquire(kLongNs, &data, &n, &flags) == Status::kShutdown);
}

TEST_CASE("ring writer drops a SIGKILLed reader and carries on", "[ring]") {
  // reap: the parent waitpid()s the dead reader; zombie: it does not yet, so the pid still
  // exists (state Z) and only the identity check can tell it is dead.
  const bool reap = GENERATE(true, false);
  INFO((reap ? "reaped" : "zombie"));
  RingConfig config = ring_config(2, 4, 64);
  SharedRing shm(config);
  RingWriter sut(shm.base(), shm.bytes(), shm.tokens());
  RingReader reader0(shm.base(), shm.bytes(), 0, shm.tokens());
  Children children;
  const pid_t victim = children.spawn([&] {
    RingReader reader(shm.base(), shm.bytes(), 1, shm.tokens());
    const uint8_t* data = nullptr;
    uint64_t n = 0;
    uint32_t flags = 0;
    shm.flag(0).store(1);
    // Blocks in futex_wait until the first message, then holds it and never releases.
    if (reader.acquire(kLongNs, &data, &n, &flags) != Status::kOk) return 1;
    shm.flag(1).store(1);
    pause();
    return 0;
  });
  REQUIRE(wait_flag(shm.flag(0), 1, 10000));
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  const uint8_t* data = nullptr;
  uint64_t n = 0;
  uint32_t flags = 0;
  for (uint32_t i = 0; i < config.max_chunks; ++i) {
    REQUIRE(sut.acquire(0) != nullptr);
    sut.publish(8, 0);
    REQUIRE(reader0.acquire(0, &data, &n, &flags) == Status::kOk);
    reader0.release();
  }
  REQUIRE(wait_flag(shm.flag(1), 1, 10000));
  // The victim is alive and holds message 1: the writer must wait for it.
  CHECK(sut.acquire(80 * kMs) == nullptr);
  CHECK(sut.dropped_readers() == 0);

  REQUIRE(kill(victim, SIGKILL) == 0);
  if (reap) {
    children.reap(victim);
  } else {
    const auto t0 = Clock::now();
    while (proc_state(victim) != 'Z' && elapsed_ms(t0) < 5000) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    REQUIRE(proc_state(victim) == 'Z');
  }
  const auto t0 = Clock::now();
  REQUIRE(sut.acquire(5000 * kMs) != nullptr);
  CHECK(elapsed_ms(t0) < 1000);  // Found within about one liveness-check period (50 ms).
  CHECK(sut.dropped_readers() == 1);
  sut.publish(8, 0);
  // The surviving reader keeps going past many laps of the ring without the writer stalling.
  for (int i = 0; i < 20; ++i) {
    REQUIRE(reader0.acquire(0, &data, &n, &flags) == Status::kOk);
    reader0.release();
    REQUIRE(sut.acquire(0) != nullptr);
    sut.publish(8, 0);
  }
  CHECK(sut.dropped_readers() == 1);
  // The dead rank cannot be taken over.
  CHECK(contains(thrown_message<InvalidArgument>(
                     [&] { RingReader again(shm.base(), shm.bytes(), 1, shm.tokens()); }),
                 "rank=1"));
}

TEST_CASE("ring rank and writer role are exclusive", "[ring]") {
  RingConfig config = ring_config(2, 4, 64);
  SharedRing shm(config);
  auto sut = std::make_unique<RingReader>(shm.base(), shm.bytes(), 0, shm.tokens());

  SECTION("a second reader on the same rank in this process throws") {
    const std::string msg = thrown_message<InvalidArgument>(
        [&] { RingReader again(shm.base(), shm.bytes(), 0, shm.tokens()); });
    CHECK(contains(msg, "rank=0"));
    CHECK(contains(msg, "live reader"));
  }
  SECTION("a second reader on the same rank in another process throws") {
    Children children;
    const pid_t pid = children.spawn([&] {
      try {
        RingReader again(shm.base(), shm.bytes(), 0, shm.tokens());
      } catch (const InvalidArgument&) {
        // Another rank is still free for this process.
        RingReader other(shm.base(), shm.bytes(), 1, shm.tokens());
        return 0;
      }
      return 1;
    });
    CHECK(children.wait_exit(pid, 10000) == 0);
  }
  SECTION("a detached rank is not re-attached") {
    sut.reset();
    CHECK(contains(thrown_message<InvalidArgument>(
                       [&] { RingReader again(shm.base(), shm.bytes(), 0, shm.tokens()); }),
                   "detached"));
  }
  SECTION("a rank outside n_readers throws OutOfRange") {
    CHECK(contains(
        thrown_message<OutOfRange>([&] { RingReader r(shm.base(), shm.bytes(), 2, shm.tokens()); }),
        "rank=2"));
  }
  SECTION("a second writer throws; the role is free again after the first is gone") {
    auto writer = std::make_unique<RingWriter>(shm.base(), shm.bytes(), shm.tokens());
    CHECK(contains(thrown_message<InvalidArgument>(
                       [&] { RingWriter again(shm.base(), shm.bytes(), shm.tokens()); }),
                   "writer role"));
    REQUIRE(writer->acquire(0) != nullptr);
    writer->publish(1, 0);
    writer.reset();
    RingWriter next(shm.base(), shm.bytes(), shm.tokens());
    CHECK(next.published() == 1);  // Numbering resumes after the last published message.
  }
  SECTION("a writer takes over from a dead writer") {
    Children children;
    const pid_t pid = children.spawn([&] {
      RingWriter writer(shm.base(), shm.bytes(), shm.tokens());
      for (int i = 0; i < 3; ++i) {
        if (writer.acquire(0) == nullptr) return 1;
        writer.publish(1, 0);
      }
      _exit(0);  // Dies holding the role: no destructor gives it back.
    });
    REQUIRE(children.wait_exit(pid, 10000) == 0);
    RingWriter writer(shm.base(), shm.bytes(), shm.tokens());
    CHECK(writer.published() == 3);
  }
}

TEST_CASE("ring misuse is reported, not crashed on", "[ring]") {
  RingConfig config = ring_config(1, 2, 64);
  SharedRing shm(config);
  RingWriter sut(shm.base(), shm.bytes(), shm.tokens());
  RingReader reader(shm.base(), shm.bytes(), 0, shm.tokens());
  const uint8_t* data = nullptr;
  uint64_t n = 0;
  uint32_t flags = 0;

  CHECK_THROWS_AS(sut.publish(1, 0), InvalidArgument);
  REQUIRE(sut.acquire(0) != nullptr);
  CHECK_THROWS_AS(sut.acquire(0), InvalidArgument);
  CHECK(contains(thrown_message<InvalidArgument>([&] { sut.publish(65, 0); }), "nbytes=65"));
  sut.publish(64, 0);

  CHECK_THROWS_AS(reader.acquire(0, nullptr, &n, &flags), InvalidArgument);
  REQUIRE(reader.acquire(0, &data, &n, &flags) == Status::kOk);
  CHECK(n == 64);
  CHECK_THROWS_AS(reader.acquire(0, &data, &n, &flags), InvalidArgument);
  reader.release();
  CHECK_THROWS_AS(reader.release(), InvalidArgument);
}

TEST_CASE("ring_validate rejects garbage and too-small blocks", "[ring]") {
  RingConfig config = ring_config(2, 4, 100);
  SharedRing shm(config);

  const RingConfig got = ring_validate(shm.base(), shm.bytes());
  CHECK(got.n_readers == 2);
  CHECK(got.max_chunks == 4);
  CHECK(got.max_chunk_bytes == 100);

  SECTION("too small for the header") {
    CHECK(contains(thrown_message<InvalidArgument>([&] { ring_validate(shm.base(), 100); }),
                   "bytes=100"));
  }
  SECTION("smaller than the layout the header describes") {
    const size_t small = shm.bytes() - 1;
    CHECK(contains(thrown_message<InvalidArgument>([&] { ring_validate(shm.base(), small); }),
                   "bytes=" + std::to_string(small)));
    CHECK_THROWS_AS(RingReader(shm.base(), small, 0, shm.tokens()), InvalidArgument);
    CHECK_THROWS_AS(RingWriter(shm.base(), small, shm.tokens()), InvalidArgument);
  }
  SECTION("random bytes") {
    const uint64_t seed = seed_for_test();
    INFO("seed=" << seed);
    std::mt19937_64 rng(seed);
    auto* p = static_cast<uint8_t*>(shm.base());
    for (size_t i = 0; i < shm.bytes(); ++i) p[i] = static_cast<uint8_t>(rng());
    CHECK(contains(thrown_message<InvalidArgument>([&] { ring_validate(shm.base(), shm.bytes()); }),
                   "not a ring"));
    CHECK_THROWS_AS(RingReader(shm.base(), shm.bytes(), 0, shm.tokens()), InvalidArgument);
  }
  SECTION("a zeroed block") {
    std::memset(shm.base(), 0, shm.bytes());
    CHECK(contains(thrown_message<InvalidArgument>([&] { ring_validate(shm.base(), shm.bytes()); }),
                   "not a ring"));
  }
  SECTION("a layout version from another build") {
    // layout_version is the u32 after the 8-byte magic.
    const uint32_t other = 999;
    std::memcpy(static_cast<uint8_t*>(shm.base()) + 8, &other, sizeof(other));
    CHECK(contains(thrown_message<InvalidArgument>([&] { ring_validate(shm.base(), shm.bytes()); }),
                   "layout_version=999"));
  }
  SECTION("a corrupt size field") {
    const uint32_t zero = 0;  // n_readers follows layout_version.
    std::memcpy(static_cast<uint8_t*>(shm.base()) + 12, &zero, sizeof(zero));
    CHECK(contains(thrown_message<InvalidArgument>([&] { ring_validate(shm.base(), shm.bytes()); }),
                   "n_readers=0"));
  }
  SECTION("a null or misaligned base") {
    CHECK_THROWS_AS(ring_validate(nullptr, shm.bytes()), InvalidArgument);
    CHECK(contains(thrown_message<InvalidArgument>([&] {
                     ring_validate(static_cast<uint8_t*>(shm.base()) + 8, shm.bytes() - 8);
                   }),
                   "aligned"));
  }
}

TEST_CASE("ring_bytes and ring_init reject bad shapes", "[ring]") {
  RingConfig ok;
  ok.n_readers = 2;
  ok.max_chunks = 4;
  ok.max_chunk_bytes = 100;
  // Header (256) + 2 reader lines + 4 chunk lines + 4 payloads rounded up to 128.
  CHECK(ring_bytes(ok) == 256 + 2 * 64 + 4 * 64 + 4 * 128);

  RingConfig bad = ok;
  bad.n_readers = 0;
  CHECK(contains(thrown_message<InvalidArgument>([&] { ring_bytes(bad); }), "n_readers=0"));
  bad = ok;
  bad.max_chunks = 0;
  CHECK(contains(thrown_message<InvalidArgument>([&] { ring_bytes(bad); }), "max_chunks=0"));
  bad = ok;
  bad.max_chunk_bytes = kRingMaxChunkBytes + 1;
  CHECK(contains(thrown_message<InvalidArgument>([&] { ring_bytes(bad); }),
                 "max_chunk_bytes=" + std::to_string(kRingMaxChunkBytes + 1)));

  SharedRing shm(ok);
  CHECK(contains(
      thrown_message<InvalidArgument>([&] { ring_init(shm.base(), ring_bytes(ok) - 1, ok); }),
      "too small"));
  CHECK_THROWS_AS(ring_init(nullptr, ring_bytes(ok), ok), InvalidArgument);
}

TEST_CASE("ring reader gets a typed error for a corrupted chunk length", "[ring][faults]") {
  RingConfig config = ring_config(1, 2, 64);
  SharedRing shm(config);
  RingWriter writer(shm.base(), shm.bytes(), shm.tokens());
  RingReader sut(shm.base(), shm.bytes(), 0, shm.tokens());
  REQUIRE(writer.acquire(0) != nullptr);
  writer.publish(8, 0);
  // ChunkSlot 0 (seq, then nbytes) follows the 256-byte header and one reader slot.
  auto* nbytes = reinterpret_cast<uint64_t*>(static_cast<uint8_t*>(shm.base()) + 256 + 64 + 8);
  REQUIRE(*nbytes == 8);
  *nbytes = uint64_t{1} << 40;  // another process scribbled over the chunk table
  const uint8_t* data = nullptr;
  uint64_t n = 0;
  uint32_t flags = 0;
  CHECK(contains(thrown_message<ShmError>([&] { sut.acquire(0, &data, &n, &flags); }), "corrupt"));
}

TEST_CASE("ring reader notices a dead writer", "[ring][liveness]") {
  RingConfig config = ring_config(1, 4, 64);
  SharedRing shm(config);
  RingReader sut(shm.base(), shm.bytes(), 0, shm.tokens());
  const uint8_t* data = nullptr;
  uint64_t n = 0;
  uint32_t flags = 0;
  // No writer has attached yet: waiting is not an error.
  CHECK(sut.acquire(150 * kMs, &data, &n, &flags) == Status::kTimeout);
  Children children;
  const pid_t pid = children.spawn([&] {
    RingWriter writer(shm.base(), shm.bytes(), shm.tokens());
    if (writer.acquire(0) == nullptr) return 1;
    writer.publish(3, 7);
    _exit(0);  // dies holding the role, without shutdown
  });
  REQUIRE(children.wait_exit(pid, 10000) == 0);
  // Its message is still delivered; then the death is reported well before the timeout.
  REQUIRE(sut.acquire(kLongNs, &data, &n, &flags) == Status::kOk);
  CHECK(n == 3);
  sut.release();
  const auto t0 = Clock::now();
  CHECK(sut.acquire(kLongNs, &data, &n, &flags) == Status::kWriterDead);
  CHECK(elapsed_ms(t0) < 5000);
  std::printf("ring_test: dead writer noticed in %lld ms\n",
              static_cast<long long>(elapsed_ms(t0)));
}
