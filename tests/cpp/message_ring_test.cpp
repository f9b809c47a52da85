// Tests for csrc/core/message_ring.cpp: the ring in a segment of its own, as the message queue
// uses it. Creation and attach, framed messages and markers end to end, the reserved chunk,
// shutdown, a writer that dies, a forked child of the writer, a full shm filesystem (a tmpfs
// mounted for the test; skipped, saying why, where that is not allowed) and a corrupted chunk.
//
// Random frame lists come from a seed printed at the start of each test that uses them; set
// VSA_SEED to replay a failure. Forked children die with their parent (PR_SET_PDEATHSIG) or
// after 30 s (alarm), so no test can leave a process behind or hang.
#include "core/message_ring.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "catch_compat.hpp"
#include "core/errors.h"
#include "core/frames.h"
#include "core/ring.h"
#include "core/shm_region.h"
#include "test_util.hpp"

using namespace vllm_shm_arena;

namespace {

using Status = RingReader::Status;
constexpr int64_t kMs = 1000 * 1000;
constexpr int64_t kLongNs = 10000 * kMs;  // Generous: only reached when something is broken.

// A message's frames, owned; content is a function of (tag, frame index) so any reader can
// check it without being told what was sent.
struct Frames {
  std::vector<std::vector<uint8_t>> bytes;

  static Frames make(const std::vector<size_t>& sizes, uint64_t tag) {
    Frames f;
    for (size_t i = 0; i < sizes.size(); ++i) {
      f.bytes.emplace_back(sizes[i]);
      vsa_test::fill_pattern(f.bytes.back().data(), sizes[i], tag * 64 + i);
    }
    return f;
  }
  FrameSpans spans() const {
    FrameSpans out;
    for (const auto& b : bytes) out.push_back(FrameSpan{b.data(), b.size()});
    return out;
  }
};

// "" when `got` holds exactly `want`'s frames, else what differs.
std::string compare(const FrameSpans& got, const Frames& want) {
  if (got.size() != want.bytes.size()) {
    return std::to_string(got.size()) + " frames, expected " + std::to_string(want.bytes.size());
  }
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i].len != want.bytes[i].size()) return "frame " + std::to_string(i) + ": length";
    if (got[i].len > 0 && std::memcmp(got[i].data, want.bytes[i].data(), got[i].len) != 0) {
      return "frame " + std::to_string(i) + ": content";
    }
  }
  return "";
}

// Frame sizes of message `seq` in a randomized run.
std::vector<size_t> random_sizes(std::mt19937_64& rng, uint64_t max_total) {
  std::vector<size_t> sizes(rng() % 6);
  uint64_t left = max_total - 4 - 8 * sizes.size();
  for (size_t& s : sizes) {
    s = rng() % 3 == 0 ? 0 : static_cast<size_t>(rng() % (left / 2 + 1));
    left -= s;
  }
  return sizes;
}

bool exists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
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

// Forks `body` (its return value is the exit code; an exception is 99).
template <class F>
pid_t spawn(F&& body) {
  std::fflush(nullptr);
  const pid_t pid = ::fork();
  if (pid < 0) throw std::runtime_error("fork failed");
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    ::alarm(30);
    int rc = 99;
    try {
      rc = body();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "child %d: %s\n", static_cast<int>(::getpid()), e.what());
    } catch (...) {
    }
    std::fflush(nullptr);
    ::_exit(rc);
  }
  return pid;
}

}  // namespace

TEST_CASE("create, attach, write, read and shut down through the segment-owning ends",
          "[message_ring]") {
  const std::string dir = ShmRegion::default_dir();
  auto sut = MessageRingWriter::create(2, 4, 1 << 16, dir);
  CHECK(sut->name().rfind("vsa_ring_", 0) == 0);
  CHECK(sut->dir() == dir);
  CHECK(sut->config().n_readers == 2);
  CHECK(sut->config().max_chunks == 4);
  CHECK(sut->config().max_chunk_bytes == 1 << 16);
  auto r0 = MessageRingReader::attach(sut->name(), 0, dir);
  auto r1 = MessageRingReader::attach(sut->name(), 1, dir);
  CHECK(r1->rank() == 1);
  CHECK(r0->writer_liveness() == Liveness::kAlive);

  // 0, 1 and many frames, empty frames included, and a marker carrying only flags.
  const std::vector<std::vector<size_t>> shapes = {{}, {0}, {11}, {0, 300, 0, 7, 4000}};
  for (size_t i = 0; i < shapes.size(); ++i) {
    Frames f = Frames::make(shapes[i], i);
    REQUIRE(sut->write(f.spans(), static_cast<uint32_t>(i) << 8, kLongNs) == RingWriteStatus::kOk);
    for (auto* r : {r0.get(), r1.get()}) {
      RingMessage m = r->acquire(kLongNs);
      REQUIRE(m.status == Status::kOk);
      CHECK(m.flags == static_cast<uint32_t>(i) << 8);
      CHECK(compare(m.frames, f) == "");
      r->release();
    }
  }
  REQUIRE(sut->write_marker(kRingFlagOverflow | kRingFlagBlob, kLongNs));
  for (auto* r : {r0.get(), r1.get()}) {
    RingMessage m = r->acquire(kLongNs);
    REQUIRE(m.status == Status::kOk);
    CHECK(m.flags == (kRingFlagOverflow | kRingFlagBlob));
    CHECK(m.frames.empty());
    r->release();
    CHECK(r->consumed() == shapes.size() + 1);
  }
  CHECK(sut->stats().published == shapes.size() + 1);
  CHECK(sut->stats().dropped_readers == 0);
  CHECK(sut->stats().no_space == 0);

  // Nothing more: a timeout; then shutdown wakes the readers with kShutdown.
  CHECK(r0->acquire(0).status == Status::kTimeout);
  Status woken = Status::kOk;  // Catch2 assertions stay on the test's thread
  std::thread blocked([&] { woken = r1->acquire(kLongNs).status; });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  sut->shutdown();
  blocked.join();
  CHECK(woken == Status::kShutdown);
  CHECK(r0->acquire(kLongNs).status == Status::kShutdown);
  CHECK_THROWS_AS(sut->write({}, 0, 0), InvalidArgument);  // a shut-down ring takes nothing
}

TEST_CASE("the writer owns the name: destroying it unlinks, unlink() is idempotent",
          "[message_ring]") {
  const std::string dir = ShmRegion::default_dir();
  auto sut = MessageRingWriter::create(1, 2, 4096, dir);
  const std::string path = dir + "/" + sut->name();
  CHECK(exists(path));
  sut->unlink();
  CHECK_FALSE(exists(path));
  sut->unlink();
  CHECK_THROWS_AS(MessageRingReader::attach(sut->name(), 0, dir), ShmError);

  auto other = MessageRingWriter::create(1, 2, 4096, dir);
  const std::string other_path = dir + "/" + other->name();
  CHECK(exists(other_path));
  other.reset();
  CHECK_FALSE(exists(other_path));
}

TEST_CASE("bad shapes, names and ranks are typed errors", "[message_ring][faults]") {
  const std::string dir = ShmRegion::default_dir();
  CHECK_THROWS_AS(MessageRingWriter::create(0, 4, 4096, dir), InvalidArgument);
  CHECK_THROWS_AS(MessageRingWriter::create(1, 0, 4096, dir), InvalidArgument);
  CHECK_THROWS_AS(MessageRingWriter::create(1, 4, 0, dir), InvalidArgument);
  CHECK_THROWS_AS(MessageRingReader::attach("vsa_ring_00000000000000000000000000000000", 0, dir),
                  ShmError);
  auto sut = MessageRingWriter::create(2, 2, 4096, dir);
  CHECK_THROWS_AS(MessageRingReader::attach(sut->name(), 2, dir), OutOfRange);
  auto r0 = MessageRingReader::attach(sut->name(), 0, dir);
  CHECK_THROWS_AS(MessageRingReader::attach(sut->name(), 0, dir), InvalidArgument);  // taken
  // A segment that is not a ring.
  auto junk = ShmRegion::create(1 << 16, "vsa_ring_", dir);
  std::memset(junk->data(), 0x5A, 4096);
  CHECK(contains(
      thrown_message<InvalidArgument>([&] { MessageRingReader::attach(junk->name(), 0, dir); }),
      "not a ring"));
  junk->unlink();
}

TEST_CASE("a message larger than a chunk is refused and publishes nothing", "[message_ring]") {
  const std::string dir = ShmRegion::default_dir();
  auto sut = MessageRingWriter::create(1, 2, 64, dir);
  auto reader = MessageRingReader::attach(sut->name(), 0, dir);
  Frames fits = Frames::make({64 - 4 - 8}, 1);  // exactly one chunk
  Frames big = Frames::make({64 - 4 - 8 + 1}, 2);
  const std::string msg =
      thrown_message<InvalidArgument>([&] { sut->write(big.spans(), 0, kLongNs); });
  CHECK(msg == "message of 65 bytes does not fit a ring chunk of 64");
  CHECK(sut->stats().published == 0);
  REQUIRE(sut->write(fits.spans(), 3, kLongNs) == RingWriteStatus::kOk);
  RingMessage m = reader->acquire(kLongNs);
  REQUIRE(m.status == Status::kOk);
  CHECK(compare(m.frames, fits) == "");
  reader->release();
  // A size that would overflow is refused by framed_size before any chunk is taken.
  FrameSpans huge = {FrameSpan{nullptr, ~uint64_t{0}}};
  CHECK_THROWS_AS(sut->write(huge, 0, kLongNs), InvalidArgument);
  CHECK(sut->stats().published == 1);
}

TEST_CASE("reserve() holds the next chunk: the write after it never waits", "[message_ring]") {
  const std::string dir = ShmRegion::default_dir();
  auto sut = MessageRingWriter::create(1, 1, 256, dir);
  auto reader = MessageRingReader::attach(sut->name(), 0, dir);
  Frames f = Frames::make({10, 20}, 5);

  REQUIRE(sut->reserve(kLongNs));
  CHECK(sut->holds_reserved_chunk());
  CHECK(sut->reserve(0));  // already held: true at once, still one chunk
  // A failed write keeps the reservation.
  Frames big = Frames::make({300}, 6);
  CHECK_THROWS_AS(sut->write(big.spans(), 0, 0), InvalidArgument);
  CHECK(sut->holds_reserved_chunk());
  CHECK(sut->write(f.spans(), 1, 0) == RingWriteStatus::kOk);  // timeout 0: uses the held chunk
  CHECK_FALSE(sut->holds_reserved_chunk());

  // The one chunk is unread now: nothing can be reserved, a write or marker times out.
  CHECK_FALSE(sut->reserve(0));
  CHECK_FALSE(sut->reserve(5 * kMs));
  CHECK(sut->write(f.spans(), 2, 0) == RingWriteStatus::kTimeout);
  CHECK_FALSE(sut->write_marker(7, 0));
  CHECK(sut->stats().published == 1);

  // Reserved while the reader still holds the chunk, taken once it lets go; the marker
  // written into it does not wait.
  Status held = Status::kTimeout;
  std::thread releaser([&] {
    held = reader->acquire(kLongNs).status;
    if (held != Status::kOk) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    reader->release();
  });
  const bool reserved = sut->reserve(kLongNs);
  releaser.join();
  REQUIRE(held == Status::kOk);
  CHECK(reserved);
  CHECK(sut->write_marker(kRingFlagOverflow, 0));
  RingMessage m = reader->acquire(kLongNs);
  REQUIRE(m.status == Status::kOk);
  CHECK(m.flags == kRingFlagOverflow);
  CHECK(m.frames.empty());
  reader->release();
}

TEST_CASE("a corrupted framing in a chunk is refused and the chunk released",
          "[message_ring][faults]") {
  const std::string dir = ShmRegion::default_dir();
  auto sut = MessageRingWriter::create(1, 1, 4096, dir);
  auto reader = MessageRingReader::attach(sut->name(), 0, dir);
  // The payload starts right after the tables (ring.h's drawing), chunk 0 first.
  uint8_t* chunk0 = sut->region()->data() + ring_metadata_bytes(sut->config());

  struct Case {
    uint32_t count;
    uint64_t len;
    const char* error;
  };
  const Case cases[] = {
      {0xFFFFFFFFu, 0, "packed message header is corrupt"},  // huge count: head past the end
      {1, 1ull << 40, "packed message frame overruns the message"},
      {1, ~uint64_t{0}, "packed message frame overruns the message"},
  };
  uint64_t seq = 0;
  for (const Case& c : cases) {
    Frames f = Frames::make({100}, 7);
    REQUIRE(sut->write(f.spans(), 0, kLongNs) == RingWriteStatus::kOk);
    ++seq;
    // Another process mapping the segment rewrites the framing before the reader looks.
    std::memcpy(chunk0, &c.count, 4);
    std::memcpy(chunk0 + 4, &c.len, 8);
    CHECK(thrown_message<InvalidArgument>([&] { reader->acquire(kLongNs); }) == c.error);
    CHECK(reader->consumed() == seq);  // released: the writer may reuse the chunk
  }
  Frames f = Frames::make({1, 2, 3}, 8);
  REQUIRE(sut->write(f.spans(), 0, 0) == RingWriteStatus::kOk);
  RingMessage m = reader->acquire(kLongNs);
  REQUIRE(m.status == Status::kOk);
  CHECK(compare(m.frames, f) == "");
  reader->release();
}

TEST_CASE("a writer killed mid-stream: its messages are read, then writer_dead",
          "[message_ring][liveness]") {
  const std::string dir = ShmRegion::default_dir();
  int to_parent[2];
  int to_child[2];
  REQUIRE(::pipe(to_parent) == 0);
  REQUIRE(::pipe(to_child) == 0);
  const pid_t child = spawn([&] {
    ::close(to_parent[0]);
    ::close(to_child[1]);
    auto w = MessageRingWriter::create(1, 4, 4096, dir);
    const std::string name = w->name();
    if (::write(to_parent[1], name.data(), name.size()) != static_cast<ssize_t>(name.size())) {
      return 2;
    }
    char go;
    if (::read(to_child[0], &go, 1) != 1) return 3;  // the reader has attached
    for (uint64_t i = 0; i < 3; ++i) {
      Frames f = Frames::make({i * 10, 5}, 100 + i);
      if (w->write(f.spans(), static_cast<uint32_t>(i), kLongNs) != RingWriteStatus::kOk) return 4;
    }
    if (::write(to_parent[1], "w", 1) != 1) return 5;
    for (;;) ::pause();  // killed with everything held: no destructor runs
  });
  ::close(to_parent[1]);  // a child that fails early closes the pipe: no read blocks for good
  ::close(to_child[0]);
  char name_buf[128] = {};
  REQUIRE(::read(to_parent[0], name_buf, sizeof(name_buf) - 1) > 0);
  const std::string name = name_buf;
  auto reader = MessageRingReader::attach(name, 0, dir);
  REQUIRE(::write(to_child[1], "g", 1) == 1);
  char done;
  REQUIRE(::read(to_parent[0], &done, 1) == 1);
  CHECK(reader->writer_liveness() == Liveness::kAlive);
  REQUIRE(vsa_test::kill_child(child, /*reap=*/true));

  for (uint64_t i = 0; i < 3; ++i) {
    RingMessage m = reader->acquire(kLongNs);
    REQUIRE(m.status == Status::kOk);
    CHECK(m.flags == i);
    CHECK(compare(m.frames, Frames::make({i * 10, 5}, 100 + i)) == "");
    reader->release();
  }
  CHECK(reader->acquire(kLongNs).status == Status::kWriterDead);
  CHECK(reader->writer_liveness() == Liveness::kDead);
  CHECK(exists(dir + "/" + name));  // a killed writer leaves its name (for the stale cleaner)
  ShmRegion::attach(name, dir)->unlink();
  ::close(to_parent[0]);
  ::close(to_child[1]);
}

TEST_CASE("a forked child of the writer cannot write and leaves name and role alone",
          "[message_ring][fork]") {
  const std::string dir = ShmRegion::default_dir();
  auto sut = MessageRingWriter::create(1, 2, 4096, dir);
  auto reader = MessageRingReader::attach(sut->name(), 0, dir);
  const std::string path = dir + "/" + sut->name();
  REQUIRE(sut->reserve(kLongNs));  // the parent's reserved chunk is not the child's either
  pid_t child = spawn([&] {
    if (!sut->foreign()) return 2;
    Frames f = Frames::make({8}, 1);
    const std::string why = thrown_message<InvalidArgument>([&] { sut->write(f.spans(), 0, 0); });
    if (!contains(why, "RingWriter.write: this ring writer belongs to pid " +
                           std::to_string(::getppid()))) {
      return 3;
    }
    if (!contains(why, "a forked child cannot use its parent's queue")) return 4;
    // Every call that would act as the writer is refused, each naming itself.
    const std::string reserve = thrown_message<InvalidArgument>([&] { sut->reserve(0); });
    const std::string marker = thrown_message<InvalidArgument>([&] { sut->write_marker(0, 0); });
    const std::string shutdown = thrown_message<InvalidArgument>([&] { sut->shutdown(); });
    if (!contains(reserve, "RingWriter.reserve: this ring writer belongs to pid")) return 5;
    if (!contains(marker, "RingWriter.write_marker: this ring writer belongs to pid")) return 6;
    if (!contains(shutdown, "RingWriter.shutdown: this ring writer belongs to pid")) return 7;
    sut->unlink();  // a no-op here
    sut.reset();    // the inherited copy dies: neither the name nor the role go with it
    if (!exists(path)) return 8;
    return 0;
  });
  int st = vsa_test::wait_child(child);
  INFO("child status " << st);
  CHECK(vsa_test::exited_ok(st));
  CHECK(exists(path));
  CHECK_FALSE(sut->foreign());
  CHECK(reader->writer_liveness() == Liveness::kAlive);
  Frames f = Frames::make({3, 0, 9}, 2);
  CHECK(sut->write(f.spans(), 4, 0) == RingWriteStatus::kOk);
  RingMessage m = reader->acquire(kLongNs);
  REQUIRE(m.status == Status::kOk);
  CHECK(m.flags == 4);
  CHECK(compare(m.frames, f) == "");
  reader->release();
  CHECK(reader->acquire(0).status == Status::kTimeout);  // the child published nothing
}

TEST_CASE("a full shm filesystem: a chunk that cannot be backed becomes a no-space marker",
          "[message_ring][faults]") {
  vsa_test::TempDir small(8 << 20);
  if (!small.mounted()) {
    VSA_SKIP("mounting a small tmpfs needs root (CAP_SYS_ADMIN)");
    return;
  }
  const std::string dir = small.path();
  auto sut = MessageRingWriter::create(2, 2, 2 << 20, dir);  // ~4 MiB, reserved lazily
  auto r0 = MessageRingReader::attach(sut->name(), 0, dir);
  Frames small_msg = Frames::make({100}, 1);
  REQUIRE(sut->write(small_msg.spans(), 0, kLongNs) == RingWriteStatus::kOk);  // chunk 0
  // Someone else fills the tmpfs behind the ring's back.
  const std::string filler = dir + "/filler";
  {
    int fd = ::open(filler.c_str(), O_CREAT | O_RDWR, 0600);
    REQUIRE(fd >= 0);
    off_t want = 8 << 20;
    while (want > 0 && ::fallocate(fd, 0, 0, want) != 0) want -= 64 << 10;
    ::close(fd);
  }
  // The tables were backed at creation: a reader attaching now stores into them safely.
  auto r1 = MessageRingReader::attach(sut->name(), 1, dir);
  Frames big = Frames::make({1 << 20, 3}, 2);
  CHECK(sut->write(big.spans(), 9, kLongNs) == RingWriteStatus::kNoSpace);  // chunk 1
  CHECK(sut->stats().no_space == 1);
  for (auto* r : {r0.get(), r1.get()}) {  // r1 attached late but still reads from message 1
    RingMessage m = r->acquire(kLongNs);
    REQUIRE(m.status == Status::kOk);
    CHECK(compare(m.frames, small_msg) == "");  // written before the filesystem filled
    r->release();
    m = r->acquire(kLongNs);
    REQUIRE(m.status == Status::kOk);
    CHECK(m.flags == (kRingFlagOverflow | kRingFlagNoSpace));  // not the caller's flags
    CHECK(m.frames.empty());
    r->release();
  }
  // A chunk already backed for this size is written without asking the filesystem again.
  Frames again = Frames::make({50}, 3);
  CHECK(sut->write(again.spans(), 1, kLongNs) == RingWriteStatus::kOk);  // chunk 0
  // Room again: the next big message is backed and delivered.
  REQUIRE(::unlink(filler.c_str()) == 0);
  CHECK(sut->write(big.spans(), 9, kLongNs) == RingWriteStatus::kOk);  // chunk 1
  for (auto* r : {r0.get(), r1.get()}) {
    RingMessage m = r->acquire(kLongNs);
    REQUIRE(m.status == Status::kOk);
    CHECK(compare(m.frames, again) == "");
    r->release();
    m = r->acquire(kLongNs);
    REQUIRE(m.status == Status::kOk);
    CHECK(m.flags == 9);
    CHECK(compare(m.frames, big) == "");
    r->release();
  }
  CHECK(sut->stats().no_space == 1);
  sut->unlink();
}

TEST_CASE("a shm filesystem too small for the ring fails at creation with the fix",
          "[message_ring][faults]") {
  vsa_test::TempDir small(1 << 20);
  if (!small.mounted()) {
    VSA_SKIP("mounting a small tmpfs needs root (CAP_SYS_ADMIN)");
    return;
  }
  const std::string msg = thrown_message<ShmError>(
      [&] { MessageRingWriter::create(1, 4, 1 << 20, small.path()); });  // 4 MiB in 1 MiB
  CHECK(contains(msg, "not enough shared memory in " + small.path()));
  CHECK(contains(msg, "--shm-size"));
}

TEST_CASE("reader threads each see every framed message in order", "[message_ring][threads]") {
  const uint64_t seed = vsa_test::seed("message_ring_threads");
  const std::string dir = ShmRegion::default_dir();
  constexpr uint32_t kReaders = 3;
  constexpr uint64_t kMessages = 400;
  constexpr uint64_t kChunkBytes = 3 << 20;  // some frames large enough for a parallel copy
  auto sut = MessageRingWriter::create(kReaders, 4, kChunkBytes, dir);
  std::vector<std::unique_ptr<MessageRingReader>> readers;
  for (uint32_t r = 0; r < kReaders; ++r)
    readers.push_back(MessageRingReader::attach(sut->name(), r, dir));

  // Every thread derives message i's frame sizes from the same seed.
  auto sizes_of = [seed, kChunkBytes](uint64_t i) {
    std::mt19937_64 rng(seed ^ (i * 0x9E3779B97F4A7C15ull));
    return random_sizes(rng, i % 50 == 7 ? kChunkBytes : 8192);
  };
  std::vector<std::string> problems(kReaders);
  std::vector<std::thread> threads;
  for (uint32_t r = 0; r < kReaders; ++r) {
    threads.emplace_back([&, r] {
      MessageRingReader& reader = *readers[r];
      for (uint64_t i = 0; i < kMessages; ++i) {
        RingMessage m = reader.acquire(kLongNs);
        if (m.status != Status::kOk) {
          problems[r] = "message " + std::to_string(i) + ": status " +
                        std::to_string(static_cast<int>(m.status));
          return;
        }
        std::string why = compare(m.frames, Frames::make(sizes_of(i), i));
        if (m.flags != static_cast<uint32_t>(i)) why += " flags";
        reader.release();
        if (!why.empty()) {
          problems[r] = "message " + std::to_string(i) + ": " + why;
          return;
        }
      }
      if (reader.acquire(kLongNs).status != Status::kShutdown) problems[r] = "no shutdown";
    });
  }
  std::string writer_problem;  // no assertion before the join: a throw would skip it
  for (uint64_t i = 0; i < kMessages && writer_problem.empty(); ++i) {
    Frames f = Frames::make(sizes_of(i), i);
    if (i % 3 == 0 && !sut->reserve(kLongNs)) writer_problem = "reserve timed out";
    if (sut->write(f.spans(), static_cast<uint32_t>(i), kLongNs) != RingWriteStatus::kOk) {
      writer_problem = "write " + std::to_string(i) + " failed";
    }
  }
  sut->shutdown();
  for (auto& t : threads) t.join();
  CHECK(writer_problem == "");
  for (uint32_t r = 0; r < kReaders; ++r) {
    INFO("reader " << r);
    CHECK(problems[r] == "");
  }
  CHECK(sut->stats().published == kMessages);
}
