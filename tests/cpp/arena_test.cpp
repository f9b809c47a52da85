// Tests of the arena protocol (arena.cpp): round trips, release rules, exhaustion, faults,
// dead readers, and a randomized multi-process stress.
#include "core/arena.h"

#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <optional>
#include <random>
#include <thread>
#include <vector>

#include "catch_compat.hpp"
#include "core/errors.h"
#include "test_util.hpp"

using namespace vllm_shm_arena;
using vsa_test::checksum;
using vsa_test::fill_pattern;

namespace {

ArenaConfig small_config(uint32_t n_readers, uint32_t num_slots = 4, uint64_t slot = 1 << 20) {
  ArenaConfig cfg;
  cfg.n_readers = n_readers;
  cfg.num_slots = num_slots;
  cfg.slot_bytes = slot;
  return cfg;
}

uint64_t declined(const WriterStats& s, DeclineReason r) {
  return s.declined[static_cast<size_t>(r)];
}

bool name_exists(const ArenaWriter& w) {
  return ::access((w.region()->dir() + "/" + w.name()).c_str(), F_OK) == 0;
}

}  // namespace

TEST_CASE("byte-exact round trips at edge sizes", "[arena]") {
  const uint64_t slot = 64 << 10;
  auto sut = ArenaWriter::create(small_config(1, 2, slot));
  auto reader = ArenaReader::attach(sut->name(), 0, sut->region()->dir());
  sut->unlink();
  for (uint64_t n : {uint64_t{0}, uint64_t{1}, uint64_t{12345}, slot}) {
    std::vector<uint8_t> src(n);
    fill_pattern(src.data(), n, n);
    auto a = sut->write(src.data(), n);
    REQUIRE(a.has_value());
    const uint8_t* p = reader->acquire(a->slot, a->generation, n);
    REQUIRE(std::memcmp(p, src.data(), n) == 0);
    reader->release(a->slot, a->generation);
  }
  std::vector<uint8_t> big(slot + 1);
  REQUIRE_FALSE(sut->write(big.data(), big.size()).has_value());
  WriterStats s = sut->stats();
  CHECK(s.hits == 4);
  CHECK(s.bytes == 0 + 1 + 12345 + slot);
  CHECK(declined(s, DeclineReason::kOversize) == 1);
}

TEST_CASE("name is random, private and unlinkable while mapped", "[arena]") {
  auto a = ArenaWriter::create(small_config(1));
  auto b = ArenaWriter::create(small_config(1));
  CHECK(a->name() != b->name());
  CHECK(a->name().rfind("vsa_", 0) == 0);
  CHECK(a->name().size() == 4 + 32);
  struct stat st;
  REQUIRE(::stat((a->region()->dir() + "/" + a->name()).c_str(), &st) == 0);
  CHECK((st.st_mode & 0777) == 0600);
  a->unlink();
  b->unlink();
  CHECK_FALSE(name_exists(*a));
  // The mapping stays usable after unlink.
  uint8_t x = 7;
  CHECK(a->write(&x, 1).has_value());
}

TEST_CASE("no reuse until every reader releases", "[arena]") {
  for (uint32_t n : {1u, 2u, 4u, 8u}) {
    DYNAMIC_SECTION("readers=" << n) {
      auto sut = ArenaWriter::create(small_config(n, 1, 4096));
      std::vector<std::shared_ptr<ArenaReader>> readers;
      for (uint32_t r = 0; r < n; ++r) {
        readers.push_back(ArenaReader::attach(sut->name(), r, sut->region()->dir()));
      }
      sut->unlink();
      uint8_t v = 1;
      auto a = sut->write(&v, 1);
      REQUIRE(a);
      for (uint32_t r = 0; r < n; ++r) readers[r]->acquire(a->slot, a->generation, 1);
      for (uint32_t r = 0; r < n; ++r) {
        // Until the last reader lets go, the only slot stays taken.
        REQUIRE_FALSE(sut->write(&v, 1).has_value());
        readers[r]->release(a->slot, a->generation);
      }
      auto b = sut->write(&v, 1);
      REQUIRE(b.has_value());
      CHECK(b->generation > a->generation);
      CHECK(declined(sut->stats(), DeclineReason::kNoFreeSlot) == n);
    }
  }
}

TEST_CASE("a reader that acquires twice must release twice", "[arena]") {
  auto sut = ArenaWriter::create(small_config(1, 1, 4096));
  auto reader = ArenaReader::attach(sut->name(), 0, sut->region()->dir());
  sut->unlink();
  uint8_t v = 3;
  auto a = sut->write(&v, 1);
  reader->acquire(a->slot, a->generation, 1);
  reader->acquire(a->slot, a->generation, 1);
  reader->release(a->slot, a->generation);
  CHECK_FALSE(sut->write(&v, 1).has_value());
  reader->release(a->slot, a->generation);
  CHECK(sut->write(&v, 1).has_value());
}

TEST_CASE("exhaustion declines without blocking and prefers warm slots", "[arena]") {
  auto sut = ArenaWriter::create(small_config(1, 3, 2 << 20));
  auto reader = ArenaReader::attach(sut->name(), 0, sut->region()->dir());
  sut->unlink();
  std::vector<uint8_t> buf(2 << 20, 1);  // whole 2 MiB blocks: cold/warm is tracked per block
  std::vector<Allocation> held;
  for (int i = 0; i < 3; ++i) held.push_back(*sut->write(buf.data(), buf.size()));
  auto t0 = std::chrono::steady_clock::now();
  CHECK_FALSE(sut->write(buf.data(), buf.size()).has_value());
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(1));
  CHECK(declined(sut->stats(), DeclineReason::kNoFreeSlot) == 1);
  // Release the middle slot: the next allocation reuses exactly it (warm), not a cold one.
  reader->release_unacquired(held[1].slot, held[1].generation);
  auto again = sut->write(buf.data(), buf.size());
  REQUIRE(again);
  CHECK(again->slot == held[1].slot);
  WriterStats s = sut->stats();
  CHECK(s.cold_copies == 3);
  CHECK(s.warm_copies == 1);
}

TEST_CASE("abort gives an allocation back", "[arena]") {
  auto sut = ArenaWriter::create(small_config(1, 1, 4096));
  auto reader = ArenaReader::attach(sut->name(), 0, sut->region()->dir());
  sut->unlink();
  uint8_t v = 9;
  auto a = sut->write(&v, 1);
  REQUIRE(a);
  sut->abort(*a);
  CHECK_THROWS_AS(reader->acquire(a->slot, a->generation, 1), InvalidArgument);
  WriterStats s = sut->stats();
  CHECK(s.hits == 0);
  CHECK(s.aborted == 1);
  CHECK(s.in_use == 0);
  CHECK(sut->write(&v, 1).has_value());
}

TEST_CASE("bad stubs get typed errors", "[arena][faults]") {
  auto sut = ArenaWriter::create(small_config(2, 2, 4096));
  auto reader = ArenaReader::attach(sut->name(), 0, sut->region()->dir());
  uint8_t v = 5;
  auto a = sut->write(&v, 1);
  REQUIRE(a);
  SECTION("slot out of range") {
    CHECK_THROWS_AS(reader->acquire(2, a->generation, 1), OutOfRange);
    CHECK_THROWS_AS(reader->acquire(0xffffffffu, a->generation, 1), OutOfRange);
  }
  SECTION("stale or future generation") {
    CHECK_THROWS_AS(reader->acquire(a->slot, a->generation + 1, 1), InvalidArgument);
    CHECK_THROWS_AS(reader->acquire(a->slot, 0, 1), InvalidArgument);
  }
  SECTION("wrong nbytes") {
    CHECK_THROWS_AS(reader->acquire(a->slot, a->generation, 2), InvalidArgument);
    CHECK(reader->held() == 0);
  }
  SECTION("released twice by the same reader") {
    reader->acquire(a->slot, a->generation, 1);
    reader->release(a->slot, a->generation);
    CHECK_THROWS_AS(reader->acquire(a->slot, a->generation, 1), InvalidArgument);
  }
  SECTION("rank out of range and rank already held") {
    CHECK_THROWS_AS(ArenaReader::attach(sut->name(), 2, sut->region()->dir()), OutOfRange);
    CHECK_THROWS_AS(ArenaReader::attach(sut->name(), 0, sut->region()->dir()), InvalidArgument);
  }
  SECTION("unknown name") {
    CHECK_THROWS_AS(ArenaReader::attach("vsa_doesnotexist", 0, sut->region()->dir()), ShmError);
    CHECK_THROWS_AS(ArenaReader::attach("../etc/passwd", 0, sut->region()->dir()), InvalidArgument);
  }
  sut->unlink();
}

TEST_CASE("garbage, truncated and foreign segments are rejected", "[arena][faults]") {
  vsa_test::TempDir dir;
  auto write_file = [&](const std::string& name, const std::vector<uint8_t>& bytes) {
    std::ofstream(dir.path() + "/" + name, std::ios::binary)
        .write(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  };
  write_file("tiny", std::vector<uint8_t>(100, 0xab));
  write_file("garbage", std::vector<uint8_t>(1 << 16, 0xab));
  write_file("empty", {});
  CHECK_THROWS_AS(ArenaReader::attach("tiny", 0, dir.path()), InvalidArgument);
  CHECK_THROWS_AS(ArenaReader::attach("garbage", 0, dir.path()), InvalidArgument);
  CHECK_THROWS_AS(ArenaReader::attach("empty", 0, dir.path()), InvalidArgument);
  CHECK_THROWS_AS(ArenaWriter::attach("garbage", dir.path()), InvalidArgument);

  // A real arena, truncated behind the writer's back.
  ArenaConfig cfg = small_config(1, 2, 4096);
  cfg.dir = dir.path();
  auto w = ArenaWriter::create(cfg);
  REQUIRE(::truncate((dir.path() + "/" + w->name()).c_str(), 8192) == 0);
  try {
    ArenaReader::attach(w->name(), 0, dir.path());
    FAIL("attach to a truncated arena succeeded");
  } catch (const InvalidArgument& e) {
    CHECK(std::string(e.what()).find("truncated") != std::string::npos);
  }
}

TEST_CASE("a writer that goes away cleanly removes its name", "[arena]") {
  std::string path;
  {
    auto sut = ArenaWriter::create(small_config(1, 1, 4096));
    path = sut->region()->dir() + "/" + sut->name();
    REQUIRE(::access(path.c_str(), F_OK) == 0);
  }
  CHECK(::access(path.c_str(), F_OK) != 0);
}

TEST_CASE("abort keeps the counters consistent whatever the caller passes", "[arena]") {
  auto sut = ArenaWriter::create(small_config(1, 2, 4096));
  sut->unlink();
  std::vector<uint8_t> buf(100, 1);
  auto a = sut->write(buf.data(), buf.size());
  REQUIRE(a);
  Allocation stub;  // only slot and generation, as a caller across a language boundary has
  stub.slot = a->slot;
  stub.generation = a->generation;
  sut->abort(stub);
  WriterStats s = sut->stats();
  CHECK(s.hits == 0);
  CHECK(s.bytes == 0);
  CHECK(s.cold_copies == 0);
  CHECK(s.warm_copies == 0);
  CHECK(s.aborted == 1);
}

TEST_CASE("a second writer is refused while the first lives", "[arena][faults]") {
  auto sut = ArenaWriter::create(small_config(1, 2, 4096));
  try {
    ArenaWriter::attach(sut->name(), sut->region()->dir());
    FAIL("second writer attached");
  } catch (const InvalidArgument& e) {
    CHECK(std::string(e.what()).find("live writer") != std::string::npos);
  }
  sut->unlink();
}

TEST_CASE("a new writer takes over from a dead one and keeps published slots", "[arena]") {
  // The first writer lives in a child that publishes one slot and exits.
  int pipefd[2];
  REQUIRE(::pipe(pipefd) == 0);
  pid_t pid = ::fork();
  if (pid == 0) {
    int rc = 1;
    try {
      auto w = ArenaWriter::create(small_config(1, 2, 4096));
      uint8_t v = 42;
      auto a = w->write(&v, 1);
      char name[64] = {};
      std::snprintf(name, sizeof(name), "%s", w->name().c_str());
      uint64_t msg[2] = {a->slot, a->generation};
      rc = (::write(pipefd[1], name, sizeof(name)) == sizeof(name) &&
            ::write(pipefd[1], msg, sizeof(msg)) == sizeof(msg))
               ? 0
               : 1;
      ::_exit(rc);  // die like a crashed writer: no destructor, the name stays
    } catch (...) {
    }
    ::_exit(rc);
  }
  char name[64];
  uint64_t msg[2];
  REQUIRE(::read(pipefd[0], name, sizeof(name)) == sizeof(name));
  REQUIRE(::read(pipefd[0], msg, sizeof(msg)) == sizeof(msg));
  REQUIRE(vsa_test::exited_ok(vsa_test::wait_child(pid)));
  ::close(pipefd[0]);
  ::close(pipefd[1]);
  auto reader = ArenaReader::attach(name, 0);
  auto sut = ArenaWriter::attach(name);
  sut->unlink();
  const uint8_t* p = reader->acquire(static_cast<uint32_t>(msg[0]), msg[1], 1);
  CHECK(*p == 42);
  CHECK(sut->stats().in_use == 1);
  uint8_t v = 1;
  auto b = sut->write(&v, 1);
  REQUIRE(b);
  CHECK(b->slot != msg[0]);
  CHECK(b->generation > msg[1]);
}

TEST_CASE("too little shared memory fails at creation with a clear message", "[arena][faults]") {
  ArenaConfig cfg = small_config(1, 1 << 16, 1ull << 36);  // 4 PiB: more than any machine has
  try {
    ArenaWriter::create(cfg);
    FAIL("created a 4 PiB arena");
  } catch (const ShmError& e) {
    std::string msg = e.what();
    CHECK(msg.find("needs") != std::string::npos);
    CHECK(msg.find("free") != std::string::npos);
    CHECK(msg.find("--shm-size") != std::string::npos);
  }
  vsa_test::TempDir small(16 << 20);
  if (!small.mounted()) {
    WARN("skipping the small-tmpfs half: mounting a tmpfs needs root");
    return;
  }
  ArenaConfig c2 = small_config(1, 4, 8 << 20);  // 32 MiB in a 16 MiB tmpfs
  c2.dir = small.path();
  CHECK_THROWS_AS(ArenaWriter::create(c2), ShmError);
}

TEST_CASE("a full shm filesystem declines writes instead of SIGBUS", "[arena][faults]") {
  vsa_test::TempDir small(48 << 20);
  if (!small.mounted()) {
    VSA_SKIP("mounting a small tmpfs needs root (CAP_SYS_ADMIN)");
    return;
  }
  ArenaConfig cfg = small_config(1, 4, 8 << 20);  // ~34 MiB reserved lazily
  cfg.dir = small.path();
  auto sut = ArenaWriter::create(cfg);
  auto reader = ArenaReader::attach(sut->name(), 0, cfg.dir);
  sut->unlink();
  std::vector<uint8_t> buf(8 << 20);
  fill_pattern(buf.data(), buf.size(), 1);
  auto first = sut->write(buf.data(), buf.size());
  REQUIRE(first);
  // Someone else fills the tmpfs behind the arena's back.
  {
    int fd = ::open((cfg.dir + "/filler").c_str(), O_CREAT | O_RDWR, 0600);
    REQUIRE(fd >= 0);
    off_t want = 30 << 20;
    while (want > 0 && ::fallocate(fd, 0, 0, want) != 0) want -= 1 << 20;
    ::close(fd);
  }
  bool saw_no_space = false;
  for (int i = 0; i < 3; ++i) {
    auto a = sut->write(buf.data(), buf.size());
    if (!a) {
      saw_no_space = true;
      break;
    }
  }
  CHECK(saw_no_space);
  CHECK(declined(sut->stats(), DeclineReason::kNoSpace) >= 1);
  // The slot written before is intact.
  const uint8_t* p = reader->acquire(first->slot, first->generation, buf.size());
  CHECK(std::memcmp(p, buf.data(), buf.size()) == 0);
}

namespace {

// Forks a reader that attaches `rank`, acquires every slot listed in the pipe, reports
// "holding" and then sleeps until killed.
pid_t fork_holding_reader(const std::string& name, uint32_t rank, const Allocation& a,
                          int ready_fd) {
  pid_t pid = ::fork();
  if (pid == 0) {
    try {
      auto r = ArenaReader::attach(name, rank);
      r->acquire(a.slot, a.generation, a.nbytes);
      char c = 'h';
      if (::write(ready_fd, &c, 1) != 1) ::_exit(2);
      for (;;) ::pause();
    } catch (...) {
      ::_exit(3);
    }
  }
  return pid;
}

}  // namespace

TEST_CASE("a reader killed while holding slots does not leak them", "[arena][faults]") {
  for (bool reap : {true, false}) {
    DYNAMIC_SECTION((reap ? "reaped" : "zombie (not reaped)")) {
      auto sut = ArenaWriter::create(small_config(2, 1, 4096));
      auto other = ArenaReader::attach(sut->name(), 1);
      uint8_t v = 1;
      auto a = sut->write(&v, 1);
      REQUIRE(a);
      other->release_unacquired(a->slot, a->generation);
      int fds[2];
      REQUIRE(::pipe(fds) == 0);
      pid_t pid = fork_holding_reader(sut->name(), 0, *a, fds[1]);
      char c = 0;
      REQUIRE(::read(fds[0], &c, 1) == 1);
      ::close(fds[0]);
      ::close(fds[1]);
      CHECK_FALSE(sut->write(&v, 1).has_value());  // held by the live child
      REQUIRE(vsa_test::kill_child(pid, reap));    // reaped, or left a zombie
      std::optional<Allocation> b;
      for (int i = 0; i < 100 && !b; ++i) {
        b = sut->write(&v, 1);
        if (!b) std::this_thread::sleep_for(std::chrono::milliseconds(2));
      }
      CHECK(b.has_value());
      CHECK(sut->stats().dead_readers == 1);
      if (!reap) vsa_test::wait_child(pid);
      // The other reader still works with the recycled slot.
      if (b) CHECK(*other->acquire(b->slot, b->generation, 1) == 1);
      sut->unlink();
    }
  }
}

TEST_CASE("holdings report what each reader holds", "[arena]") {
  auto sut = ArenaWriter::create(small_config(2, 2, 4096));
  auto r0 = ArenaReader::attach(sut->name(), 0);
  sut->unlink();
  uint8_t v = 1;
  auto a = sut->write(&v, 1);
  auto h = sut->holdings();
  REQUIRE(h.size() == 2);
  CHECK(h[0].state == ReaderState::kAttached);
  CHECK(h[0].slots_held == 1);
  CHECK(h[1].state == ReaderState::kNeverAttached);
  CHECK(h[1].slots_held == 1);
  r0->release_unacquired(a->slot, a->generation);
  CHECK(sut->holdings()[0].slots_held == 0);
  r0->detach();
  CHECK(sut->holdings()[0].state == ReaderState::kDetached);
}

namespace {

// The multi-process stress both layouts run: `n_readers` forked readers receive (slot,
// generation, nbytes, checksum) stubs over pipes, verify the bytes, and release in random
// order while holding up to `max_hold - 1` slots each; the writer writes `n_writes`
// payloads whose sizes `size_of` draws, retrying (never blocking inside the arena) while
// readers hold everything. Returns how often the writer was declined.
int run_stress(ArenaWriter& sut, uint32_t n_readers, uint32_t seed, int n_writes, uint32_t max_hold,
               size_t max_bytes, const std::function<uint64_t(std::mt19937&)>& size_of) {
  struct Stub {
    uint64_t slot, generation, nbytes, sum;
  };
  std::vector<pid_t> pids;
  std::vector<int> wfds;
  for (uint32_t r = 0; r < n_readers; ++r) {
    int fds[2];
    REQUIRE(::pipe(fds) == 0);
    pid_t pid = ::fork();
    if (pid == 0) {
      ::close(fds[1]);
      int bad = 0;
      try {
        auto reader = ArenaReader::attach(sut.name(), r);
        std::mt19937 rng(seed + r);
        std::vector<Stub> held;
        Stub s;
        while (::read(fds[0], &s, sizeof(s)) == sizeof(s) && s.generation != 0) {
          const uint8_t* p = reader->acquire(static_cast<uint32_t>(s.slot), s.generation, s.nbytes);
          if (checksum(p, s.nbytes) != s.sum) ++bad;
          held.push_back(s);
          while (held.size() > rng() % max_hold) {
            size_t i = rng() % held.size();
            // A second acquire of a held slot, then both releases: the per-slot count.
            const uint8_t* q = reader->acquire(static_cast<uint32_t>(held[i].slot),
                                               held[i].generation, held[i].nbytes);
            if (checksum(q, held[i].nbytes) != held[i].sum) ++bad;
            reader->release(static_cast<uint32_t>(held[i].slot), held[i].generation);
            reader->release(static_cast<uint32_t>(held[i].slot), held[i].generation);
            held.erase(held.begin() + static_cast<long>(i));
          }
        }
        for (auto& h : held) reader->release(static_cast<uint32_t>(h.slot), h.generation);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "reader %u: %s\n", r, e.what());
        ::_exit(3);
      }
      ::_exit(bad == 0 ? 0 : 4);
    }
    ::close(fds[0]);
    pids.push_back(pid);
    wfds.push_back(fds[1]);
  }
  std::mt19937 rng(seed);
  std::vector<uint8_t> buf(max_bytes);
  int declines = 0;
  for (int i = 0; i < n_writes; ++i) {
    uint64_t n = size_of(rng);
    fill_pattern(buf.data(), n, static_cast<uint64_t>(i) + seed);
    std::optional<Allocation> a;
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (!(a = sut.write(buf.data(), n))) {
      ++declines;
      REQUIRE(std::chrono::steady_clock::now() < deadline);
      std::this_thread::yield();
    }
    Stub s{a->slot, a->generation, n, checksum(buf.data(), n)};
    for (int fd : wfds) REQUIRE(::write(fd, &s, sizeof(s)) == sizeof(s));
  }
  Stub done{0, 0, 0, 0};
  for (int fd : wfds) {
    REQUIRE(::write(fd, &done, sizeof(done)) == sizeof(done));
    ::close(fd);
  }
  for (pid_t pid : pids) CHECK(vsa_test::exited_ok(vsa_test::wait_child(pid, 60)));
  return declines;
}

}  // namespace

TEST_CASE("randomized multi-process stress with checksums", "[arena][stress]") {
  const uint32_t seed = vsa_test::seed("arena stress");
  const uint64_t slot = 16 << 10;
  auto sut = ArenaWriter::create(small_config(3, 16, slot));
  // Three readers hold at most 5 slots each: 16 slots always leave one free in the end.
  int declines = run_stress(*sut, 3, seed, 10000, 6, slot,
                            [&](std::mt19937& rng) { return rng() % (slot + 1); });
  sut->reclaim(false);
  WriterStats s = sut->stats();
  CHECK(s.hits == 10000u);
  CHECK(s.in_use == 0);
  INFO("declines while readers held everything: " << declines);
  sut->unlink();
}

TEST_CASE("threads-in-one-process protocol variant (for ThreadSanitizer)", "[arena][threads]") {
  const uint32_t seed = vsa_test::seed("arena threads");
  const uint32_t n_readers = 3;
  const int n_writes = 3000;
  const uint64_t slot = 4096;
  auto sut = ArenaWriter::create(small_config(n_readers, 8, slot));
  std::vector<std::shared_ptr<ArenaReader>> readers;
  for (uint32_t r = 0; r < n_readers; ++r) readers.push_back(ArenaReader::attach(sut->name(), r));
  sut->unlink();
  struct Stub {
    uint32_t slot;
    uint64_t generation, nbytes, sum;
  };
  // Per-reader single-producer queues guarded by a mutex: the transport is not under test,
  // the arena's own synchronisation between writer copy and reader read is.
  std::vector<std::mutex> mus(n_readers);
  std::vector<std::vector<Stub>> queues(n_readers);
  std::atomic<bool> done{false};
  std::atomic<int> bad{0};
  std::vector<std::thread> threads;
  for (uint32_t r = 0; r < n_readers; ++r) {
    threads.emplace_back([&, r] {
      std::mt19937 rng(seed + r);
      for (;;) {
        std::vector<Stub> got;
        {
          std::lock_guard<std::mutex> lock(mus[r]);
          got.swap(queues[r]);
        }
        if (got.empty()) {
          if (done.load()) {
            std::lock_guard<std::mutex> lock(mus[r]);
            if (queues[r].empty()) return;
            continue;
          }
          std::this_thread::yield();
          continue;
        }
        std::shuffle(got.begin(), got.end(), rng);
        for (auto& s : got) {
          const uint8_t* p = readers[r]->acquire(s.slot, s.generation, s.nbytes);
          if (checksum(p, s.nbytes) != s.sum) ++bad;
          readers[r]->release(s.slot, s.generation);
        }
      }
    });
  }
  std::mt19937 rng(seed);
  std::vector<uint8_t> buf(slot);
  for (int i = 0; i < n_writes; ++i) {
    uint64_t n = 1 + rng() % slot;
    fill_pattern(buf.data(), n, static_cast<uint64_t>(i));
    std::optional<Allocation> a;
    while (!(a = sut->write(buf.data(), n))) std::this_thread::yield();
    Stub s{a->slot, a->generation, n, checksum(buf.data(), n)};
    for (uint32_t r = 0; r < n_readers; ++r) {
      std::lock_guard<std::mutex> lock(mus[r]);
      queues[r].push_back(s);
    }
  }
  done.store(true);
  for (auto& t : threads) t.join();
  CHECK(bad.load() == 0);
  CHECK(sut->stats().hits == static_cast<uint64_t>(n_writes));
}

namespace {

ArenaConfig variable_config(uint32_t n_readers, uint64_t bytes, uint32_t max_slots = 64) {
  ArenaConfig cfg;
  cfg.policy = PolicyKind::kVariable;
  cfg.n_readers = n_readers;
  cfg.arena_bytes = bytes;
  cfg.max_slots = max_slots;
  return cfg;
}

}  // namespace

TEST_CASE("variable arena: mixed sizes round-trip, whole region usable", "[arena][variable]") {
  const uint64_t bytes = 64 << 20;
  auto sut = ArenaWriter::create(variable_config(2, bytes));
  auto r0 = ArenaReader::attach(sut->name(), 0);
  auto r1 = ArenaReader::attach(sut->name(), 1);
  sut->unlink();
  CHECK(r0->variable());
  CHECK(r0->max_allocation() == bytes);
  std::vector<uint8_t> big(bytes);
  vsa_test::fill_pattern(big.data(), big.size(), 3);
  auto whole = sut->write(big.data(), big.size());  // one tensor as large as the region
  REQUIRE(whole);
  CHECK(std::memcmp(r1->acquire(whole->slot, whole->generation, bytes), big.data(), bytes) == 0);
  r1->release(whole->slot, whole->generation);
  CHECK_FALSE(sut->write(big.data(), 4096));  // r0 still holds it
  r0->release_unacquired(whole->slot, whole->generation);
  // 25 x 2 MB + odd sizes pack into the same region once it is free.
  std::vector<Allocation> got;
  for (int i = 0; i < 25; ++i) {
    auto a = sut->write(big.data(), 2'000'000 + i);
    REQUIRE(a);
    got.push_back(*a);
  }
  for (auto& a : got) {
    CHECK(checksum(r0->acquire(a.slot, a.generation, a.nbytes), a.nbytes) ==
          checksum(big.data(), a.nbytes));
  }
  WriterStats s = sut->stats();
  CHECK(s.hits == 26);
  CHECK(s.declined[static_cast<size_t>(DeclineReason::kNoFreeSlot)] == 1);
}

TEST_CASE("variable arena: slot bound is a counted decline", "[arena][variable]") {
  auto sut = ArenaWriter::create(variable_config(1, 1 << 20, 2));
  auto r = ArenaReader::attach(sut->name(), 0);
  sut->unlink();
  uint8_t v = 1;
  REQUIRE(sut->write(&v, 1));
  REQUIRE(sut->write(&v, 1));
  CHECK_FALSE(sut->write(&v, 1));
  CHECK(sut->stats().declined[static_cast<size_t>(DeclineReason::kSlotTableFull)] == 1);
}

TEST_CASE("variable arena: randomized multi-process stress, random release order",
          "[arena][variable][stress]") {
  const uint32_t seed = vsa_test::seed("variable stress");
  // Readers hold up to 7 slots each (21 distinct at worst, of up to 2 MiB): the region
  // must fit that, or the writer waits for releases that wait for the writer.
  const uint64_t bytes = 48 << 20;
  const size_t big = 2 << 20;
  auto sut = ArenaWriter::create(variable_config(3, bytes, 128));
  run_stress(*sut, 3, seed, 10000, 8, big, [&](std::mt19937& rng) {
    return (rng() % 20 == 0) ? rng() % big : rng() % 65536;  // mostly small, some large
  });
  sut->reclaim(false);
  WriterStats s = sut->stats();
  CHECK(s.in_use == 0);
  CHECK(s.free_bytes == bytes);  // nothing lost to fragmentation once all is released
  CHECK(s.largest_free == bytes);
  sut->unlink();
}

TEST_CASE("variable arena: a dead reader's allocations come back", "[arena][variable][faults]") {
  auto sut = ArenaWriter::create(variable_config(1, 1 << 20));
  std::vector<uint8_t> buf(1 << 20, 7);
  auto a = sut->write(buf.data(), buf.size());
  REQUIRE(a);
  int fds[2];
  REQUIRE(::pipe(fds) == 0);
  pid_t pid = fork_holding_reader(sut->name(), 0, *a, fds[1]);
  char c;
  REQUIRE(::read(fds[0], &c, 1) == 1);
  CHECK_FALSE(sut->write(buf.data(), 4096));
  ::kill(pid, SIGKILL);
  vsa_test::wait_child(pid);
  std::optional<Allocation> b;
  for (int i = 0; i < 100 && !b; ++i) {
    b = sut->write(buf.data(), buf.size());
    if (!b) std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  CHECK(b.has_value());
  ::close(fds[0]);
  ::close(fds[1]);
  sut->unlink();
}

TEST_CASE("loans: fill in place, send without a copy, lifetime rules", "[arena][loan]") {
  auto sut = ArenaWriter::create(variable_config(1, 4 << 20));
  auto r = ArenaReader::attach(sut->name(), 0);
  sut->unlink();
  SECTION("dropped unsent gives the space back") {
    auto a = sut->lend(3 << 20);
    REQUIRE(a);
    CHECK_FALSE(sut->lend(2 << 20));  // 3 of 4 MiB lent
    sut->end_loan(a->slot, a->generation);
    CHECK(sut->lend(4 << 20).has_value());
    CHECK(sut->stats().loans_returned == 1);
  }
  SECTION("sent once: readers see the bytes; the writer's view keeps the space") {
    auto a = sut->lend(1 << 20);
    REQUIRE(a);
    std::memset(a->data, 0x42, 1 << 20);
    auto ref = sut->find_loan(a->data + 4096, 8192);  // a contiguous view inside it
    REQUIRE(ref);
    CHECK(ref->offset == 4096);
    CHECK_FALSE(ref->published);
    REQUIRE(sut->publish_loan(ref->slot, ref->generation));
    const uint8_t* p = r->acquire(ref->slot, ref->generation, 8192, 4096);
    CHECK(p - r->region()->data() == a->data - sut->region()->data() + 4096);
    CHECK(p[0] == 0x42);
    r->release(ref->slot, ref->generation);
    sut->reclaim(false);
    CHECK(sut->stats().in_use == 1);  // readers let go, but the writer's view is alive
    // A second send of the same loan is refused (the caller copies instead).
    CHECK_FALSE(sut->publish_loan(ref->slot, ref->generation));
    sut->end_loan(ref->slot, ref->generation);
    sut->reclaim(false);
    CHECK(sut->stats().in_use == 0);
    CHECK(sut->stats().loans_sent == 1);
  }
  SECTION("ranges outside any loan are not loans") {
    auto a = sut->lend(8192);
    REQUIRE(a);
    CHECK_FALSE(sut->find_loan(a->data + 4096, 8192));  // runs past the end
    uint8_t local[16];
    CHECK_FALSE(sut->find_loan(local, 16));
  }
}

TEST_CASE("debug checksums catch a payload changed before release", "[arena]") {
  auto sut = ArenaWriter::create(small_config(2, 2, 1 << 20));
  auto r0 = ArenaReader::attach(sut->name(), 0);
  auto r1 = ArenaReader::attach(sut->name(), 1);
  sut->unlink();
  sut->set_debug_checksum(true);
  std::vector<uint8_t> buf(1 << 20, 9);
  auto a = sut->write(buf.data(), buf.size());
  REQUIRE(a);
  r0->acquire(a->slot, a->generation, buf.size());
  uint8_t* p = const_cast<uint8_t*>(r1->acquire(a->slot, a->generation, buf.size()));
  r0->release(a->slot, a->generation);
  CHECK(r0->checksum_mismatches() == 0);
  p[12345] ^= 1;  // reader 1 writes in place
  r1->release(a->slot, a->generation);
  CHECK(r1->checksum_mismatches() == 1);
  sut->set_debug_checksum(false);
  auto b = sut->write(buf.data(), buf.size());
  r1->acquire(b->slot, b->generation, buf.size());
  r1->release(b->slot, b->generation);
  CHECK(r1->checksum_mismatches() == 1);  // off: not checked
}

// ---------------------------------------------------------------------------------------
// Safety: a live reader's slot is never recycled, whatever the writer can or cannot see of
// it; nothing in shared memory can move a process outside its mappings.

namespace {

// One slot, one reader: the writer can write again only after recycling what the reader holds.
ArenaConfig one_slot(const std::string& dir) {
  ArenaConfig cfg = small_config(1, 1, 4096);
  cfg.dir = dir;
  return cfg;
}

// The byte the holding tests publish and attach_and_hold checks.
constexpr uint8_t kHeldByte = 7;

// Publishes kHeldByte in the writer's (one) slot: what the holding tests' readers hold.
std::optional<Allocation> write_held_byte(ArenaWriter& w) {
  uint8_t v = kHeldByte;
  return w.write(&v, 1);
}

// Tries a write for about `ms` milliseconds (liveness is probed at most once a millisecond).
std::optional<Allocation> write_within(ArenaWriter& w, int ms) {
  uint8_t v = 9;
  for (int i = 0; i < ms; ++i) {
    auto a = w.write(&v, 1);
    if (a) return a;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return std::nullopt;
}

// The reader's side of the holding tests: attach `name` as rank 0, acquire `a`, check its byte,
// say 'h' on `ready_fd`. Returns false on any failure.
bool attach_and_hold(const std::string& name, const std::string& dir, const Allocation& a,
                     int ready_fd, std::shared_ptr<ArenaReader>* out) {
  try {
    auto r = ArenaReader::attach(name, 0, dir);
    const uint8_t* p = r->acquire(a.slot, a.generation, a.nbytes);
    if (a.nbytes > 0 && *p != kHeldByte) return false;
    *out = r;
    return ::write(ready_fd, "h", 1) == 1;
  } catch (...) {
    return false;
  }
}

// Forks a reader that attaches `name` as rank 0, holds `a` and sleeps until killed; returns
// its pid once it holds, or -1.
pid_t spawn_holder(const std::string& name, const std::string& dir, const Allocation& a) {
  int p[2];
  if (::pipe(p) != 0) return -1;
  pid_t r = ::fork();
  if (r == 0) {
    ::close(p[0]);
    std::shared_ptr<ArenaReader> held;
    if (!attach_and_hold(name, dir, a, p[1], &held)) ::_exit(3);
    for (;;) ::pause();
  }
  ::close(p[1]);
  char c;
  bool ok = ::read(p[0], &c, 1) == 1;
  ::close(p[0]);
  if (!ok) {
    ::kill(r, SIGKILL);
    ::waitpid(r, nullptr, 0);
    return -1;
  }
  return r;
}

// Runs `body` as pid 1 of a new pid namespace (and mount namespace: with a fresh /proc of its
// own when `own_proc`, else the parent's /proc). Returns {middle, inner} pids as this process
// sees them, or {-1, -1} when this process may not create namespaces.
std::pair<pid_t, pid_t> spawn_in_pid_namespace(bool own_proc, const std::function<void()>& body) {
  int p[2];
  if (::pipe(p) != 0) return {-1, -1};
  pid_t middle = ::fork();
  if (middle == 0) {
    ::close(p[0]);
    if (!vsa_test::enter_namespaces(CLONE_NEWPID | CLONE_NEWNS)) ::_exit(77);
    pid_t inner = ::fork();
    if (inner == 0) {
      ::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr);
      if (own_proc && ::mount("proc", "/proc", "proc", 0, nullptr) != 0) ::_exit(78);
      body();
      ::_exit(0);
    }
    if (::write(p[1], &inner, sizeof(inner)) != sizeof(inner)) ::_exit(2);
    int st = 0;
    ::waitpid(inner, &st, 0);
    ::_exit(0);
  }
  ::close(p[1]);
  pid_t inner = -1;
  if (::read(p[0], &inner, sizeof(inner)) != sizeof(inner)) {
    ::close(p[0]);
    vsa_test::wait_child(middle);
    return {-1, -1};
  }
  ::close(p[0]);
  return {middle, inner};
}

}  // namespace

TEST_CASE("a writer out of file descriptors never declares a live reader dead",
          "[arena][liveness][faults]") {
  vsa_test::TempDir dir;
  pid_t w = ::fork();
  if (w == 0) {
    auto sut = ArenaWriter::create(one_slot(dir.path()));
    auto a = write_held_byte(*sut);
    if (!a) ::_exit(2);
    pid_t r = spawn_holder(sut->name(), dir.path(), *a);
    if (r < 0) ::_exit(4);
    struct rlimit rl;
    ::getrlimit(RLIMIT_NOFILE, &rl);
    rl.rlim_cur = 64;
    ::setrlimit(RLIMIT_NOFILE, &rl);
    while (::dup(0) >= 0) {
    }
    // The reader lives: its slot must not be recycled, EMFILE or not.
    int rc = write_within(*sut, 20) ? 5 : 0;
    if (sut->stats().dead_readers != 0) rc = 6;
    ::kill(r, SIGKILL);
    ::waitpid(r, nullptr, 0);
    ::_exit(rc);
  }
  int st = vsa_test::wait_child(w);
  CHECK(vsa_test::exited_ok(st));
  INFO("writer child status " << st);
}

TEST_CASE("a reader whose main thread exited keeps its slots", "[arena][liveness]") {
  vsa_test::TempDir dir;
  auto sut = ArenaWriter::create(one_slot(dir.path()));
  auto a = write_held_byte(*sut);
  REQUIRE(a);
  int p[2];
  REQUIRE(::pipe(p) == 0);
  pid_t r = ::fork();
  if (r == 0) {
    static std::shared_ptr<ArenaReader> held;
    if (!attach_and_hold(sut->name(), dir.path(), *a, p[1], &held)) ::_exit(3);
    pthread_t th;
    pthread_create(
        &th, nullptr,
        [](void*) -> void* {
          for (;;) ::pause();
          return nullptr;
        },
        nullptr);
    ::syscall(SYS_exit, 0);  // the leader ends (state Z) like pthread_exit; the process lives
  }
  char c;
  REQUIRE(::read(p[0], &c, 1) == 1);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));  // let the leader exit
  CHECK_FALSE(write_within(*sut, 20).has_value());
  CHECK(sut->stats().dead_readers == 0);
  ::kill(r, SIGKILL);
  vsa_test::wait_child(r);
  CHECK(write_within(*sut, 200).has_value());
  CHECK(sut->stats().dead_readers == 1);
  ::close(p[0]);
  ::close(p[1]);
}

TEST_CASE("readers in another pid namespace: alive while they live, reclaimed once dead",
          "[arena][liveness][namespaces]") {
  for (bool own_proc : {true, false}) {
    DYNAMIC_SECTION((own_proc ? "reader with its own /proc" : "reader with the host's /proc")) {
      vsa_test::TempDir dir;
      auto sut = ArenaWriter::create(one_slot(dir.path()));
      auto a = write_held_byte(*sut);
      REQUIRE(a);
      int p[2];
      REQUIRE(::pipe(p) == 0);
      std::string name = sut->name(), path = dir.path();
      Allocation alloc = *a;
      auto [middle, inner] = spawn_in_pid_namespace(own_proc, [&] {
        std::shared_ptr<ArenaReader> held;
        if (!attach_and_hold(name, path, alloc, p[1], &held)) ::_exit(3);
        for (;;) ::pause();
      });
      if (middle < 0) {
        VSA_SKIP("creating a pid namespace needs root or unprivileged user namespaces");
        continue;
      }
      char c;
      REQUIRE(::read(p[0], &c, 1) == 1);
      CHECK_FALSE(write_within(*sut, 20).has_value());  // alive: never recycled
      CHECK(sut->stats().dead_readers == 0);
      ::kill(inner, SIGKILL);
      vsa_test::wait_child(middle);
      CHECK(write_within(*sut, 200).has_value());  // dead: reclaimed
      CHECK(sut->stats().dead_readers == 1);
      ::close(p[0]);
      ::close(p[1]);
    }
  }
}

TEST_CASE("without /proc readers stay alive and a second writer is refused",
          "[arena][liveness][namespaces]") {
  vsa_test::TempDir dir;
  pid_t w = ::fork();
  if (w == 0) {
    if (!vsa_test::enter_namespaces(CLONE_NEWNS)) ::_exit(77);
    ::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr);
    if (::umount2("/proc", MNT_DETACH) != 0) ::_exit(77);
    if (::access("/proc/self/stat", F_OK) == 0) ::_exit(77);
    auto sut = ArenaWriter::create(one_slot(dir.path()));
    auto a = write_held_byte(*sut);
    if (!a) ::_exit(2);
    pid_t r = spawn_holder(sut->name(), dir.path(), *a);
    if (r < 0) ::_exit(4);
    int rc = 0;
    if (write_within(*sut, 20)) rc = 5;  // a live reader declared dead
    try {
      ArenaWriter::attach(sut->name(), dir.path());
      rc = 6;  // a second writer admitted while the first lives
    } catch (const TokenHeld&) {
    }
    ::kill(r, SIGKILL);
    ::waitpid(r, nullptr, 0);
    if (rc == 0 && !write_within(*sut, 200)) rc = 7;  // a dead reader never reclaimed
    ::_exit(rc);
  }
  int st = vsa_test::wait_child(w);
  if (WIFEXITED(st) && WEXITSTATUS(st) == 77) {
    VSA_SKIP("unmounting /proc in a private mount namespace needs root");
    return;
  }
  INFO("child status " << st);
  CHECK(vsa_test::exited_ok(st));
}

TEST_CASE("a forked child never releases its parent's holds", "[arena][fork]") {
  vsa_test::TempDir dir;
  auto sut = ArenaWriter::create(one_slot(dir.path()));
  auto reader = ArenaReader::attach(sut->name(), 0, dir.path());
  std::vector<uint8_t> src(4096, 7);
  auto a = sut->write(src.data(), src.size());
  REQUIRE(a);
  const uint8_t* p = reader->acquire(a->slot, a->generation, src.size());
  pid_t child = ::fork();
  if (child == 0) {
    // What the child's copies do when they die: release, detach, destroy.
    reader->release(a->slot, a->generation);
    reader->detach();
    reader.reset();
    ::_exit(0);
  }
  REQUIRE(vsa_test::exited_ok(vsa_test::wait_child(child)));
  CHECK_FALSE(write_within(*sut, 20).has_value());  // still held by this process
  CHECK(std::memcmp(p, src.data(), src.size()) == 0);
  reader->release(a->slot, a->generation);
  CHECK(write_within(*sut, 20).has_value());
}

TEST_CASE("a forked child of the writer neither unlinks its name nor writes", "[arena][fork]") {
  vsa_test::TempDir dir;
  auto sut = ArenaWriter::create(small_config(1, 2, 4096));
  pid_t child = ::fork();
  if (child == 0) {
    int rc = 0;
    uint8_t v = 1;
    try {
      sut->write(&v, 1);
      rc = 1;
    } catch (const InvalidArgument&) {
    }
    sut->unlink();
    sut.reset();
    ::_exit(rc);
  }
  CHECK(vsa_test::exited_ok(vsa_test::wait_child(child)));
  CHECK(name_exists(*sut));
  uint8_t v = 1;
  CHECK(sut->write(&v, 1).has_value());
}

TEST_CASE("tables are reserved at creation: a full tmpfs never raises SIGBUS", "[arena][faults]") {
  vsa_test::TempDir small(16 << 20);
  if (!small.mounted()) {
    VSA_SKIP("mounting a small tmpfs needs root (CAP_SYS_ADMIN)");
    return;
  }
  // Tables span many pages: 1024 slots x 64 B, 4 readers' release blocks of 8 KiB.
  ArenaConfig cfg = variable_config(4, 8 << 20, 1024);
  cfg.dir = small.path();
  auto sut = ArenaWriter::create(cfg);
  {
    int fd = ::open((cfg.dir + "/filler").c_str(), O_CREAT | O_RDWR, 0600);
    REQUIRE(fd >= 0);
    off_t want = 16 << 20;
    while (want > 0 && ::fallocate(fd, 0, 0, want) != 0) want -= 64 << 10;
    ::close(fd);
  }
  pid_t child = ::fork();
  if (child == 0) {
    std::vector<std::shared_ptr<ArenaReader>> readers;
    for (uint32_t r = 0; r < 4; ++r)
      readers.push_back(ArenaReader::attach(sut->name(), r, cfg.dir));
    for (uint32_t rec = 0; rec < 1024; rec += 97) {
      for (auto& r : readers) r->release_unacquired(rec, 1);
    }
    ::_exit(0);
  }
  int st = vsa_test::wait_child(child);
  INFO("reader child status " << st << (WIFSIGNALED(st) ? " (killed by a signal)" : ""));
  CHECK(vsa_test::exited_ok(st));
  uint8_t v = 1;
  std::optional<Allocation> a;
  CHECK_NOTHROW(a = sut->write(&v, 1));  // a counted decline (no space), or a write
  if (!a) CHECK(declined(sut->stats(), DeclineReason::kNoSpace) >= 1);
}

namespace {

SlotMeta* meta_of(ArenaWriter& w, uint32_t slot) {
  auto* h = reinterpret_cast<ArenaHeader*>(w.region()->data());
  return reinterpret_cast<SlotMeta*>(w.region()->data() + h->slots_offset) + slot;
}

// Runs `f` in a child; its exit status (crashes show as signals instead of exit 0).
int in_child(const std::function<int()>& f) {
  pid_t pid = ::fork();
  if (pid == 0) {
    int rc = 10;
    try {
      rc = f();
    } catch (...) {
      rc = 11;
    }
    ::_exit(rc);
  }
  return vsa_test::wait_child(pid);
}

}  // namespace

TEST_CASE("corrupted shared memory gives typed errors, never an access outside the mapping",
          "[arena][faults]") {
  vsa_test::TempDir dir;
  ArenaConfig cfg = small_config(1, 2, 8192);
  cfg.dir = dir.path();
  auto sut = ArenaWriter::create(cfg);
  auto reader = ArenaReader::attach(sut->name(), 0, dir.path());
  std::vector<uint8_t> src(8192, 7);
  auto a = sut->write(src.data(), src.size());
  REQUIRE(a);
  auto* h = reinterpret_cast<ArenaHeader*>(sut->region()->data());
  SlotMeta* m = meta_of(*sut, a->slot);

  SECTION("an offset past the end of the region (the bound check must not wrap)") {
    m->offset = h->region_bytes + 4096;
    m->capacity = 4096;
    m->nbytes = 16;
    CHECK_THROWS_AS(reader->acquire(a->slot, a->generation, 16), InvalidArgument);
  }
  SECTION("a header rewritten after attach is never re-read") {
    // (Run in this process: a forked child may not use its parent's reader. Before the
    // geometry was kept privately, this crashed the test binary.)
    h->max_slots = kMaxSlots;
    h->slots_offset = 1ull << 40;
    h->releases_offset = 1ull << 41;
    h->data_offset = 1ull << 42;
    const uint8_t* p = reader->acquire(a->slot, a->generation, src.size());
    CHECK(std::memcmp(p, src.data(), src.size()) == 0);
    reader->release(a->slot, a->generation);
    CHECK_THROWS_AS(reader->acquire(5000, 1, 1), OutOfRange);
  }
  SECTION("a held slot keeps the metadata it was validated with") {
    reader->acquire(a->slot, a->generation, 16);
    m->nbytes = 1ull << 40;
    m->offset = 0;
    CHECK_THROWS_AS(reader->acquire(a->slot, a->generation, 1 << 20), InvalidArgument);
    const uint8_t* p = reader->acquire(a->slot, a->generation, src.size());
    CHECK(std::memcmp(p, src.data(), src.size()) == 0);
  }
  SECTION("debug checksums at release use the held copy") {
    sut->set_debug_checksum(true);
    auto b = sut->write(src.data(), src.size());
    REQUIRE(b);
    SlotMeta* mb = meta_of(*sut, b->slot);
    reader->acquire(b->slot, b->generation, src.size());
    mb->offset = 1ull << 50;
    mb->nbytes = 1ull << 40;
    reader->release(b->slot, b->generation);
    CHECK(reader->checksum_mismatches() == 0);
  }
}

TEST_CASE("a takeover over corrupted slots stays inside the mapping", "[arena][faults]") {
  vsa_test::TempDir dir;
  int p[2];
  REQUIRE(::pipe(p) == 0);
  pid_t old_writer = ::fork();
  if (old_writer == 0) {
    ArenaConfig cfg = variable_config(1, 1 << 20, 8);
    cfg.dir = dir.path();
    auto w = ArenaWriter::create(cfg);
    uint8_t v = 1;
    for (int i = 0; i < 3; ++i) w->write(&v, 1);
    SlotMeta* m0 = meta_of(*w, 0);
    m0->offset = ~0ull - 100;  // wraps if added to anything
    m0->capacity = 1ull << 30;
    SlotMeta* m1 = meta_of(*w, 1);
    m1->capacity = 1ull << 40;  // runs past the region
    std::string name = w->name();
    if (::write(p[1], name.data(), name.size()) != static_cast<ssize_t>(name.size())) ::_exit(2);
    ::_exit(0);  // dies as the writer: the name stays for a takeover
  }
  ::close(p[1]);
  char buf[256];
  ssize_t n = ::read(p[0], buf, sizeof(buf));
  ::close(p[0]);
  REQUIRE(n > 0);
  std::string name(buf, static_cast<size_t>(n));
  REQUIRE(vsa_test::exited_ok(vsa_test::wait_child(old_writer)));
  int st = in_child([&] {
    auto w = ArenaWriter::attach(name, dir.path());
    std::vector<uint8_t> big(512 << 10, 3);
    for (int i = 0; i < 20; ++i) {
      auto a = w->write(big.data(), big.size());
      if (a) w->abort(*a);
    }
    return w->stats().in_use <= 1 ? 0 : 1;  // only the intact slot 2 is still published
  });
  INFO("takeover child status " << st);
  CHECK(vsa_test::exited_ok(st));
  ::unlink((dir.path() + "/" + name).c_str());
}

TEST_CASE("a segment of another user is refused at attach", "[arena][faults]") {
  if (::geteuid() != 0) {
    VSA_SKIP("chown to another uid needs root");
    return;
  }
  vsa_test::TempDir dir;
  ArenaConfig cfg = small_config(1, 1, 4096);
  cfg.dir = dir.path();
  auto sut = ArenaWriter::create(cfg);
  REQUIRE(::chown((dir.path() + "/" + sut->name()).c_str(), 65534, 65534) == 0);
  try {
    ArenaReader::attach(sut->name(), 0, dir.path());
    FAIL("attached a segment owned by uid 65534");
  } catch (const InvalidArgument& e) {
    CHECK(std::string(e.what()).find("uid 65534") != std::string::npos);
  }
}

namespace {

ArenaHeader* header_of(ArenaWriter& w) {
  return reinterpret_cast<ArenaHeader*>(w.region()->data());
}

// Reader `rank`'s release flag for `slot`, through any mapping of the segment.
std::atomic<uint64_t>* release_flag(uint8_t* base, uint32_t rank, uint32_t slot) {
  auto* h = reinterpret_cast<ArenaHeader*>(base);
  return reinterpret_cast<std::atomic<uint64_t>*>(base + h->releases_offset +
                                                  uint64_t{rank} * h->releases_stride) +
         slot;
}

SlotMeta* slot_at(uint8_t* base, uint32_t slot) {
  auto* h = reinterpret_cast<ArenaHeader*>(base);
  return reinterpret_cast<SlotMeta*>(base + h->slots_offset) + slot;
}

// A writer in a child publishes `writes` one-byte slots (none released) and dies as a
// crashed writer would. Returns the arena's name; `gens` gets the generations handed out.
std::string crashed_writer(const std::string& dir, int writes, std::vector<uint64_t>* gens) {
  int p[2];
  REQUIRE(::pipe(p) == 0);
  pid_t pid = ::fork();
  if (pid == 0) {
    ArenaConfig cfg = small_config(1, 4, 4096);
    cfg.dir = dir;
    auto w = ArenaWriter::create(cfg);
    char name[64] = {};
    std::snprintf(name, sizeof(name), "%s", w->name().c_str());
    if (::write(p[1], name, sizeof(name)) != sizeof(name)) ::_exit(2);
    uint8_t v = 9;
    for (int i = 0; i < writes; ++i) {
      auto a = w->write(&v, 1);
      uint64_t g = a ? a->generation : 0;
      if (::write(p[1], &g, sizeof(g)) != sizeof(g)) ::_exit(2);
    }
    ::_exit(0);  // no destructor: the name stays for a takeover
  }
  ::close(p[1]);
  char name[64];
  REQUIRE(::read(p[0], name, sizeof(name)) == sizeof(name));
  for (int i = 0; i < writes; ++i) {
    uint64_t g = 0;
    REQUIRE(::read(p[0], &g, sizeof(g)) == sizeof(g));
    gens->push_back(g);
  }
  ::close(p[0]);
  REQUIRE(vsa_test::exited_ok(vsa_test::wait_child(pid)));
  return name;
}

}  // namespace

TEST_CASE("a peer rewriting the shared generation counter changes nothing the writer hands out",
          "[arena][faults]") {
  vsa_test::TempDir dir;
  ArenaConfig cfg = small_config(1, 1, 4096);
  cfg.dir = dir.path();
  auto sut = ArenaWriter::create(cfg);
  auto reader = ArenaReader::attach(sut->name(), 0, dir.path());
  ArenaHeader* h = header_of(*sut);
  uint8_t v = 1;
  std::vector<uint64_t> gens;
  // One slot: every write reuses it once the reader let go, so a repeated generation would
  // make the previous stub valid again.
  for (uint64_t peer : {uint64_t{1}, uint64_t{0}, uint64_t{1} << 60, uint64_t{1}, ~uint64_t{0}}) {
    auto a = sut->write(&v, 1);
    REQUIRE(a);
    gens.push_back(a->generation);
    reader->acquire(a->slot, a->generation, 1);
    reader->release(a->slot, a->generation);
    h->next_generation.store(peer);  // the peer's write
  }
  auto last = sut->write(&v, 1);
  REQUIRE(last);
  gens.push_back(last->generation);
  for (size_t i = 0; i < gens.size(); ++i) CHECK(gens[i] == i + 1);
  // The stub of the previous use of the slot stays stale.
  CHECK_THROWS_AS(reader->acquire(last->slot, gens[gens.size() - 2], 1), InvalidArgument);
  CHECK(reader->acquire(last->slot, last->generation, 1) != nullptr);
  reader->release(last->slot, last->generation);
}

TEST_CASE("a takeover continues above every generation any slot or release flag shows",
          "[arena][faults]") {
  vsa_test::TempDir dir;
  std::vector<uint64_t> gens;
  const std::string name = crashed_writer(dir.path(), 3, &gens);
  REQUIRE(gens == std::vector<uint64_t>{1, 2, 3});
  auto peer = ShmRegion::attach(name, dir.path());
  uint8_t* base = peer->data();
  auto* h = reinterpret_cast<ArenaHeader*>(base);
  // The writer taking over hands out `floor` + 1 first.
  auto takes_over_above = [&](uint64_t floor) {
    auto sut = ArenaWriter::attach(name, dir.path());
    sut->unlink();
    uint8_t v = 2;
    auto a = sut->write(&v, 1);
    REQUIRE(a);
    CHECK(a->generation == floor + 1);
    CHECK(a->generation < kGenerationLimit);
  };
  SECTION("the shared counter lowered") {
    h->next_generation.store(1);
    takes_over_above(3);
  }
  SECTION("the shared counter pushed out of range") {
    h->next_generation.store(1ull << 60);
    takes_over_above(3);
  }
  SECTION("a freed slot's release flag above every published generation") {
    slot_at(base, 3)->published_gen.store(0);
    release_flag(base, 0, 3)->store(1000);
    h->next_generation.store(2);
    takes_over_above(1000);
  }
  SECTION("a live slot above the shared counter") {
    slot_at(base, 2)->published_gen.store(5000);
    h->next_generation.store(4);
    takes_over_above(5000);
  }
}

TEST_CASE("generations stay below 2^44", "[arena][faults]") {
  vsa_test::TempDir dir;
  std::vector<uint64_t> gens;
  const std::string name = crashed_writer(dir.path(), 2, &gens);
  auto peer = ShmRegion::attach(name, dir.path());
  SECTION("the last generation is handed out, then every allocation declines") {
    slot_at(peer->data(), 1)->published_gen.store(kGenerationLimit - 2);
    auto sut = ArenaWriter::attach(name, dir.path());
    sut->unlink();
    uint8_t v = 3;
    auto a = sut->write(&v, 1);
    REQUIRE(a);
    CHECK(a->generation == kGenerationLimit - 1);
    CHECK_FALSE(sut->write(&v, 1).has_value());
    CHECK_FALSE(sut->lend(1).has_value());
    CHECK(declined(sut->stats(), DeclineReason::kSlotTableFull) == 2);
  }
  SECTION("a takeover with no generation left is refused") {
    slot_at(peer->data(), 1)->published_gen.store(kGenerationLimit - 1);
    CHECK_THROWS_AS(ArenaWriter::attach(name, dir.path()), InvalidArgument);
    CHECK(::access((dir.path() + "/" + name).c_str(), F_OK) == 0);  // left as it was
    CHECK(probe_token(peer->fd(), kWriterTokenByte) == Liveness::kDead);
  }
  SECTION("readers never accept a generation out of range, whatever shared memory says") {
    auto reader = ArenaReader::attach(name, 0, dir.path());
    slot_at(peer->data(), 1)->published_gen.store(1ull << 60);
    CHECK(reader->published_generation(1) == 0);
    CHECK_THROWS_AS(reader->acquire(1, 1ull << 60, 1), InvalidArgument);
    reader->release_unacquired(1, 1ull << 60);  // a no-op
    CHECK(release_flag(peer->data(), 0, 1)->load() == 0);
    // A writer taking over ignores the garbage generation: the slot is not in use.
    auto sut = ArenaWriter::attach(name, dir.path());
    sut->unlink();
    uint8_t v = 4;
    auto a = sut->write(&v, 1);
    REQUIRE(a);
    CHECK(a->generation == gens.back() + 1);
  }
  ::unlink((dir.path() + "/" + name).c_str());
}

TEST_CASE("send holds: a slot is not recycled while a send by reference reads it",
          "[arena][send_hold]") {
  auto sut = ArenaWriter::create(small_config(1, 1, 4096));
  auto reader = ArenaReader::attach(sut->name(), 0, sut->region()->dir());
  sut->unlink();
  std::vector<uint8_t> src(4096);
  fill_pattern(src.data(), src.size(), 7);
  SECTION("readers done, hold alive: no reuse until the hold ends") {
    auto a = sut->write(src.data(), src.size());
    REQUIRE(a);
    std::shared_ptr<SendHold> h = sut->hold_for_send(a->slot, a->generation);
    CHECK(h->nbytes() == 4096);
    CHECK(std::memcmp(h->data(), src.data(), src.size()) == 0);
    auto second = sut->hold_for_send(a->slot, a->generation);  // holds may coexist
    reader->release_unacquired(a->slot, a->generation);
    CHECK_FALSE(sut->write(src.data(), 1).has_value());
    h.reset();
    CHECK_FALSE(sut->write(src.data(), 1).has_value());  // the second still reads
    second.reset();
    auto b = sut->write(src.data(), 1);
    REQUIRE(b);
    CHECK(b->slot == a->slot);
  }
  SECTION("a hold ending first leaves the readers' rule in force") {
    auto a = sut->write(src.data(), src.size());
    REQUIRE(a);
    sut->hold_for_send(a->slot, a->generation).reset();
    CHECK_FALSE(sut->write(src.data(), 1).has_value());
    reader->release_unacquired(a->slot, a->generation);
    CHECK(sut->write(src.data(), 1).has_value());
  }
  SECTION("only a published allocation of this writer can be held") {
    auto a = sut->write(src.data(), src.size());
    REQUIRE(a);
    CHECK_THROWS_AS(sut->hold_for_send(a->slot, a->generation + 1), InvalidArgument);
    CHECK_THROWS_AS(sut->hold_for_send(a->slot + 1, a->generation), InvalidArgument);
    CHECK_THROWS_AS(sut->hold_for_send(UINT32_MAX, a->generation), InvalidArgument);
    sut->abort(*a);
    CHECK_THROWS_AS(sut->hold_for_send(a->slot, a->generation), InvalidArgument);
  }
  SECTION("an abort while held: unpublished at once, freed once the hold ends") {
    auto a = sut->write(src.data(), src.size());
    REQUIRE(a);
    auto h = sut->hold_for_send(a->slot, a->generation);
    sut->abort(*a);
    sut->abort(*a);  // twice is harmless
    CHECK_THROWS_AS(reader->acquire(a->slot, a->generation, 1), InvalidArgument);
    WriterStats s = sut->stats();
    CHECK(s.hits == 0);
    CHECK(s.aborted == 1);
    CHECK(s.in_use == 1);
    CHECK_FALSE(sut->write(src.data(), 1).has_value());
    CHECK(std::memcmp(h->data(), src.data(), src.size()) == 0);  // still the bytes sent
    h.reset();
    CHECK(sut->write(src.data(), 1).has_value());  // no reader ever owed it
  }
  SECTION("a hold outlives its writer: the mapping stays valid") {
    auto a = sut->write(src.data(), src.size());
    REQUIRE(a);
    auto h = sut->hold_for_send(a->slot, a->generation);
    reader.reset();
    sut.reset();
    CHECK(std::memcmp(h->data(), src.data(), src.size()) == 0);
    h.reset();
  }
}

TEST_CASE("send holds on a loan: an unsent loan dropped while held is freed after the hold",
          "[arena][send_hold][loan]") {
  auto sut = ArenaWriter::create(variable_config(1, 4 << 20));
  auto r = ArenaReader::attach(sut->name(), 0);
  sut->unlink();
  auto a = sut->lend(2 << 20);
  REQUIRE(a);
  REQUIRE(sut->publish_loan(a->slot, a->generation));
  auto h = sut->hold_for_send(a->slot, a->generation);
  CHECK(h->nbytes() == (2u << 20));
  sut->abort(*a);  // the send was given back: unpublished, still the writer's loan
  sut->end_loan(a->slot, a->generation);
  CHECK(sut->stats().in_use == 1);  // the hold still reads it
  CHECK_FALSE(sut->lend(3 << 20).has_value());
  h.reset();
  CHECK(sut->lend(4 << 20).has_value());
}

TEST_CASE("send holds from many threads while the writer recycles (for ThreadSanitizer)",
          "[arena][send_hold][threads]") {
  auto sut = ArenaWriter::create(small_config(1, 4, 4096));
  auto reader = ArenaReader::attach(sut->name(), 0, sut->region()->dir());
  sut->unlink();
  std::vector<uint8_t> src(4096);
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> wrong{0};  // bytes the I/O thread saw changed under a hold
  std::mutex mu;
  std::vector<std::pair<std::shared_ptr<SendHold>, uint8_t>> queue;  // what a socket holds
  std::thread io([&] {  // the socket's I/O thread: reads each held payload, then drops it
    for (;;) {
      std::vector<std::pair<std::shared_ptr<SendHold>, uint8_t>> batch;
      bool last = stop.load();
      {
        std::lock_guard<std::mutex> lock(mu);
        batch.swap(queue);
      }
      if (last && batch.empty()) break;
      for (auto& [h, v] : batch) {
        for (uint64_t i = 0; i < h->nbytes(); ++i) wrong += h->data()[i] != v;
      }
      std::this_thread::yield();
    }
  });
  uint64_t sent = 0;
  for (int i = 0; i < 2000; ++i) {
    uint8_t v = static_cast<uint8_t>(i);
    std::memset(src.data(), v, src.size());
    auto a = sut->write(src.data(), src.size());
    if (!a) continue;  // every slot still held: the writer declines, never blocks
    ++sent;
    {
      std::lock_guard<std::mutex> lock(mu);
      queue.emplace_back(sut->hold_for_send(a->slot, a->generation), v);
    }
    reader->release_unacquired(a->slot, a->generation);
  }
  stop.store(true);
  io.join();
  CHECK(sent > 0);
  CHECK(wrong.load() == 0);
  sut->reclaim(false);
  CHECK(sut->stats().in_use == 0);
}
