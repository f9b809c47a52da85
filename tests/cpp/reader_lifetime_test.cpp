// Tests of a reader's holds and how they end (reader_lifetime.cpp): the pin decision, gated and
// ungated releases, lingering readers, release tokens and the fork rules, against the fake
// CUDA runtime (tests/fake_cudart), which the shim loads through VLLM_SHM_ARENA_CUDART.
#include "core/reader_lifetime.h"

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "../fake_cudart/fake_cudart_control.hpp"
#include "catch_compat.hpp"
#include "core/cuda_shim.h"
#include "core/errors.h"
#include "core/settings.h"
#include "test_util.hpp"

using namespace vllm_shm_arena;
using vllm_shm_arena::testing::FakeCudart;
using vsa_test::ScopedEnv;

namespace {

constexpr uint64_t kMiB = uint64_t{1} << 20;
// A recognisable non-null stream handle; the fake never dereferences it.
void* const kStream = reinterpret_cast<void*>(0x5157);

ArenaConfig fixed_config(uint32_t n_readers, uint32_t num_slots, uint64_t slot_bytes) {
  ArenaConfig cfg;
  cfg.n_readers = n_readers;
  cfg.num_slots = num_slots;
  cfg.slot_bytes = slot_bytes;
  return cfg;
}

ArenaConfig variable_config(uint64_t arena_bytes, uint32_t max_slots) {
  ArenaConfig cfg;
  cfg.policy = PolicyKind::kVariable;
  cfg.arena_bytes = arena_bytes;
  cfg.max_slots = max_slots;
  return cfg;
}

// A writer, with its name unlinked once the readers are attached.
struct Arena {
  std::unique_ptr<ArenaWriter> writer;
  std::vector<uint8_t> buf;

  explicit Arena(const ArenaConfig& cfg) : writer(ArenaWriter::create(cfg)) {}
  std::shared_ptr<ArenaReader> attach(uint32_t rank) {
    return ArenaReader::attach(writer->name(), rank, writer->region()->dir());
  }
  // Publishes `n` bytes of a pattern; the test fails if the arena declines.
  Allocation write(uint64_t n, uint64_t tag = 1) {
    buf.resize(n);
    vsa_test::fill_pattern(buf.data(), n, tag);
    std::optional<Allocation> a = writer->write(buf.data(), n);
    REQUIRE(a.has_value());
    return *a;
  }
  uint32_t held_by(uint32_t rank) const { return writer->holdings().at(rank).slots_held; }
  ReaderState state_of(uint32_t rank) const { return writer->holdings().at(rank).state; }
};

// Points the shim at the fake runtime for a test, with the fake's state reset.
struct FakeRuntime {
  ScopedEnv env{settings::kCudartVar, FakeCudart::path()};
  const FakeCudart& fake = FakeCudart::get();
  FakeRuntime() { fake.reset(); }
  ~FakeRuntime() { fake.reset(); }
};

// Byte offset of `p` from the start of `holds`'s region.
uint64_t offset_of(const ReaderHolds& holds, const uint8_t* p) {
  return static_cast<uint64_t>(p - holds.core().region()->data());
}

}  // namespace

// --------------------------------------------------------------------------- release tokens

TEST_CASE("release tokens round-trip at their limits", "[reader_lifetime][token]") {
  const uint32_t max_slot = (uint32_t{1} << kTokenSlotBits) - 1;
  const uint64_t max_gen = kTokenGenerationLimit - 1;
  const std::vector<std::pair<uint32_t, uint64_t>> cases = {{0, 0},
                                                            {0, 1},
                                                            {1, 0},
                                                            {max_slot, 1},
                                                            {0, max_gen},
                                                            {max_slot, max_gen},
                                                            {12345, 1ull << 43},
                                                            {kMaxSlots - 1, kGenerationLimit - 1}};
  for (const auto& [slot, gen] : cases) {
    const uint64_t token = encode_release_token(slot, gen);
    const ReleaseRef ref = decode_release_token(token);
    INFO("slot " << slot << " generation " << gen);
    CHECK(ref.slot == slot);
    CHECK(ref.generation == gen);
  }
  CHECK(encode_release_token(max_slot, max_gen) == ~uint64_t{0});
  CHECK(kTokenGenerationLimit == uint64_t{1} << 44);
}

TEST_CASE("release tokens refuse what does not fit", "[reader_lifetime][token]") {
  const uint32_t slot_limit = uint32_t{1} << kTokenSlotBits;
  CHECK_THROWS_AS(encode_release_token(slot_limit, 1), InvalidArgument);
  CHECK_THROWS_AS(encode_release_token(~uint32_t{0}, 1), InvalidArgument);
  CHECK_THROWS_AS(encode_release_token(0, kTokenGenerationLimit), InvalidArgument);
  CHECK_THROWS_AS(encode_release_token(0, ~uint64_t{0}), InvalidArgument);
  try {
    encode_release_token(7, kTokenGenerationLimit);
    FAIL("a generation of 2^44 was encoded");
  } catch (const InvalidArgument& e) {
    CHECK(std::string(e.what()) ==
          "slot 7 generation 17592186044416 does not fit a release token (slot below 2^20, "
          "generation below 2^44)");
  }
}

TEST_CASE("acquire refuses a stub no token can carry before holding anything",
          "[reader_lifetime][token]") {
  Arena arena(fixed_config(1, 2, 64 << 10));
  ReaderHolds sut(arena.attach(0), 0);
  arena.writer->unlink();
  const Allocation a = arena.write(100);
  CHECK_THROWS_AS(sut.acquire(a.slot, kTokenGenerationLimit, 100, 0, false), InvalidArgument);
  CHECK_THROWS_AS(sut.acquire(a.slot, kTokenGenerationLimit + a.generation, 100, 0, false),
                  InvalidArgument);
  CHECK(sut.core().held() == 0);
  CHECK(arena.held_by(0) == 1);  // still published and unreleased: nothing was taken or given
  // The argument checks, each before anything is held, in the order the bindings raised them.
  CHECK_THROWS_AS(sut.acquire(2, a.generation, 100, 0, false), OutOfRange);
  CHECK_THROWS_AS(sut.acquire(a.slot, a.generation, (64 << 10) + 1, 0, false), InvalidArgument);
  CHECK_THROWS_AS(sut.acquire(a.slot, a.generation, 1, (64 << 10) + 1, false), InvalidArgument);
  CHECK(sut.core().held() == 0);
  // Generation 0: whatever the slot holds now.
  ReaderHolds::Hold h = sut.acquire(a.slot, 0, 100, 0, false);
  CHECK(h.generation == a.generation);
  CHECK(std::memcmp(h.data, arena.buf.data(), 100) == 0);
  sut.freed(a.slot, h.generation, h.gated);
  CHECK(sut.core().held() == 0);
}

// ------------------------------------------------------------------------ the pin decision

TEST_CASE("pin_chunk_bytes: whole slots for a fixed layout, one chunk otherwise",
          "[reader_lifetime][pin]") {
  const uint64_t slot = 4 * kMiB, data = 8 * slot;
  CHECK(pin_chunk_bytes(false, data, slot, 0) == data);     // default: one registration
  CHECK(pin_chunk_bytes(false, data, slot, 1) == slot);     // rounded up to a slot
  CHECK(pin_chunk_bytes(false, data, slot, slot) == slot);  // already whole
  CHECK(pin_chunk_bytes(false, data, slot, slot + 1) == 2 * slot);
  CHECK(pin_chunk_bytes(false, data, slot, 3 * slot - 7) == 3 * slot);
  CHECK(pin_chunk_bytes(false, data, slot, data - 1) == data);  // rounds to the region
  CHECK(pin_chunk_bytes(false, data, slot, data) == data);
  CHECK(pin_chunk_bytes(false, data, slot, ~uint64_t{0}) == data);  // no overflow
  CHECK(pin_chunk_bytes(true, data, data, 1) == data);  // variable: always the whole region
  CHECK(pin_chunk_bytes(true, data, data, slot) == data);
}

TEST_CASE("without a CUDA runtime a reader is never pinned, and releases at once",
          "[reader_lifetime][pin]") {
  const FakeCudart& fake = FakeCudart::get();
  fake.reset();
  ScopedEnv env(settings::kCudartVar, nullptr);
  REQUIRE(CudaRuntime::find() == nullptr);  // the test binary links no libcudart
  Arena arena(fixed_config(1, 2, kMiB));
  ReaderHolds sut(arena.attach(0), 0);
  arena.writer->unlink();
  const Allocation a = arena.write(kMiB);
  ReaderHolds::Hold h = sut.acquire(a.slot, a.generation, kMiB, 0, /*dma=*/true);
  CHECK_FALSE(h.gated);
  ReaderHoldsStats s = sut.stats();
  CHECK(s.held == 1);
  CHECK(s.pinned_bytes == 0);
  CHECK_FALSE(s.pin_failed);  // nothing failed: there is nothing to pin with
  CHECK_FALSE(s.pin_no_space);
  CHECK(s.pending_releases == 0);
  sut.freed(a.slot, a.generation, h.gated);
  CHECK(sut.core().held() == 0);
  CHECK(arena.held_by(0) == 0);

  // The decision stands for the reader's lifetime, even once a runtime could be found.
  env.set(FakeCudart::path());
  const Allocation b = arena.write(kMiB, 2);
  h = sut.acquire(b.slot, b.generation, kMiB, 0, true);
  CHECK_FALSE(h.gated);
  sut.freed(b.slot, b.generation, h.gated);
  CHECK(sut.flush_releases(kStream) == 0);
  CHECK(fake.calls() == 0);
  CHECK_FALSE(sut.is_pinned(offset_of(sut, h.data), kMiB));
}

TEST_CASE("a reader without a CUDA context never looks for the runtime", "[reader_lifetime][pin]") {
  FakeRuntime rt;
  Arena arena(fixed_config(1, 2, kMiB));
  ReaderHolds sut(arena.attach(0), 0);
  arena.writer->unlink();
  const Allocation a = arena.write(kMiB);
  ReaderHolds::Hold h = sut.acquire(a.slot, a.generation, kMiB, 0, /*dma=*/false);
  CHECK_FALSE(h.gated);
  sut.freed(a.slot, a.generation, h.gated);
  CHECK(sut.core().held() == 0);
  CHECK(sut.flush_releases(kStream) == 0);
  CHECK(rt.fake.calls() == 0);
  // An empty range is not pinned either (nothing to copy).
  const Allocation b = arena.write(0, 2);
  h = sut.acquire(b.slot, b.generation, 0, 0, true);
  CHECK_FALSE(h.gated);
  sut.freed(b.slot, b.generation, h.gated);
  CHECK(rt.fake.calls() == 0);
}

TEST_CASE("fixed slots pin in chunks of whole slots", "[reader_lifetime][pin]") {
  FakeRuntime rt;
  Arena arena(fixed_config(1, 4, kMiB));
  // 1.5 MiB asked for: rounded up to two slots per registration.
  ReaderHolds sut(arena.attach(0), 3 * kMiB / 2);
  arena.writer->unlink();
  std::vector<Allocation> all;
  for (uint64_t i = 0; i < 4; ++i) all.push_back(arena.write(kMiB, i));
  std::vector<ReaderHolds::Hold> holds;
  for (const Allocation& a : all) holds.push_back(sut.acquire(a.slot, a.generation, kMiB, 0, true));
  for (const auto& h : holds) CHECK(h.gated);
  CHECK(rt.fake.register_calls() == 2);
  CHECK(rt.fake.registered_ranges() == 2);
  CHECK(rt.fake.registered_bytes() == 4 * kMiB);
  const uint8_t* data = sut.core().region()->data() + sut.core().data_offset();
  CHECK(rt.fake.register_count(data, 2 * kMiB) == 1);
  CHECK(rt.fake.register_count(data + 2 * kMiB, 2 * kMiB) == 1);
  CHECK(rt.fake.last_register_flags() == cuda_const::kHostRegisterPortable);
  ReaderHoldsStats s = sut.stats();
  CHECK(s.pinned_bytes == 4 * kMiB);
  CHECK(s.pin_registrations == 2);
  CHECK_FALSE(s.pin_failed);
  for (size_t i = 0; i < all.size(); ++i) sut.freed(all[i].slot, holds[i].generation, true);
  CHECK(sut.flush_releases(kStream) == 4);  // the fake's events complete at once
  CHECK(sut.core().held() == 0);
}

TEST_CASE("fixed slots pin the whole data region at once by default", "[reader_lifetime][pin]") {
  FakeRuntime rt;
  Arena arena(fixed_config(1, 3, kMiB));
  ReaderHolds sut(arena.attach(0), 0);
  arena.writer->unlink();
  const Allocation a = arena.write(kMiB);
  ReaderHolds::Hold h = sut.acquire(a.slot, a.generation, kMiB, 0, true);
  CHECK(h.gated);
  CHECK(rt.fake.register_calls() == 1);
  CHECK(rt.fake.registered_bytes() == 3 * kMiB);
  CHECK(sut.is_pinned(sut.core().data_offset(), 3 * kMiB));
  sut.freed(a.slot, h.generation, true);
  CHECK(sut.flush_releases(kStream) == 1);
}

TEST_CASE("a variable-size arena pins its data region as one chunk", "[reader_lifetime][pin]") {
  FakeRuntime rt;
  Arena arena(variable_config(8 * kMiB, 16));
  ReaderHolds sut(arena.attach(0), kMiB);  // a chunk size asked for, and ignored
  arena.writer->unlink();
  const Allocation a = arena.write(3 * kMiB);
  const Allocation b = arena.write(kMiB + 5, 2);
  ReaderHolds::Hold ha = sut.acquire(a.slot, a.generation, 3 * kMiB, 0, true);
  ReaderHolds::Hold hb = sut.acquire(b.slot, b.generation, kMiB + 5, 0, true);
  CHECK((ha.gated && hb.gated));
  CHECK(rt.fake.register_calls() == 1);
  CHECK(rt.fake.registered_ranges() == 1);
  CHECK(rt.fake.registered_bytes() == sut.core().data_bytes());
  CHECK(sut.core().data_bytes() == 8 * kMiB);
  sut.freed(a.slot, ha.generation, true);
  sut.freed(b.slot, hb.generation, true);
  CHECK(sut.flush_releases(kStream) == 2);
}

TEST_CASE("a failed registration leaves the reader unpinned, releasing at once",
          "[reader_lifetime][pin]") {
  FakeRuntime rt;
  rt.fake.fail_register(2);  // cudaErrorMemoryAllocation
  Arena arena(fixed_config(1, 2, kMiB));
  ReaderHolds sut(arena.attach(0), 0);
  arena.writer->unlink();
  for (uint64_t i = 0; i < 3; ++i) {
    const Allocation a = arena.write(kMiB, i);
    ReaderHolds::Hold h = sut.acquire(a.slot, a.generation, kMiB, 0, true);
    CHECK_FALSE(h.gated);
    sut.freed(a.slot, h.generation, h.gated);
    CHECK(sut.core().held() == 0);
  }
  CHECK(rt.fake.register_calls() == 1);  // tried once, never retried
  ReaderHoldsStats s = sut.stats();
  CHECK(s.pin_failed);
  CHECK_FALSE(s.pin_no_space);
  CHECK(s.pinned_bytes == 0);
}

TEST_CASE("a data region the shm filesystem cannot back is never pinned (pin_no_space)",
          "[reader_lifetime][pin][faults]") {
  vsa_test::TempDir small(16 << 20);
  if (!small.mounted()) {
    VSA_SKIP("mounting a small tmpfs needs root (CAP_SYS_ADMIN)");
    return;
  }
  FakeRuntime rt;
  ArenaConfig cfg = fixed_config(1, 2, 4 * kMiB);  // 8 MiB of data, backed lazily
  cfg.dir = small.path();
  Arena arena(cfg);
  ReaderHolds sut(arena.attach(0), 0);
  arena.writer->unlink();
  const Allocation a = arena.write(4 * kMiB);  // backs slot 0 only
  {
    // Someone else fills the rest of the tmpfs.
    int fd = ::open((small.path() + "/filler").c_str(), O_CREAT | O_RDWR, 0600);
    REQUIRE(fd >= 0);
    off_t want = 16 << 20;
    while (want > 0 && ::fallocate(fd, 0, 0, want) != 0) want -= 64 << 10;
    ::close(fd);
  }
  ReaderHolds::Hold h = sut.acquire(a.slot, a.generation, 4 * kMiB, 0, true);
  CHECK_FALSE(h.gated);
  CHECK(std::memcmp(h.data, arena.buf.data(), 4 * kMiB) == 0);
  ReaderHoldsStats s = sut.stats();
  CHECK(s.pin_no_space);
  CHECK(s.pin_failed);
  CHECK(s.pinned_bytes == 0);
  CHECK(rt.fake.register_calls() == 0);  // never asked to fault in unbacked pages
  sut.freed(a.slot, h.generation, h.gated);
  CHECK(arena.held_by(0) == 0);  // unpinned: released at once
  CHECK(arena.writer->reclaim(false) == 1);
}

// ------------------------------------------------------------------------------ releases

TEST_CASE("a gated release waits for its event; an ungated one goes at once",
          "[reader_lifetime][gate]") {
  FakeRuntime rt;
  rt.fake.hold_events(1);
  Arena arena(fixed_config(1, 2, kMiB));
  ReaderHolds sut(arena.attach(0), 0);
  arena.writer->unlink();
  const Allocation a = arena.write(kMiB);
  ReaderHolds::Hold h = sut.acquire(a.slot, a.generation, kMiB, 0, true);
  REQUIRE(h.gated);
  const long long calls = rt.fake.calls();
  sut.freed(a.slot, h.generation, true);
  CHECK(rt.fake.calls() == calls);  // freed() never calls CUDA
  CHECK(sut.stats().pending_releases == 1);
  CHECK(sut.core().held() == 1);
  CHECK(arena.held_by(0) == 1);

  CHECK(sut.flush_releases(kStream) == 0);  // event recorded, still "running"
  CHECK(rt.fake.last_record_stream() == kStream);
  CHECK(sut.core().held() == 1);
  CHECK(arena.writer->reclaim(false) == 0);
  CHECK(sut.flush_releases(kStream) == 0);

  rt.fake.complete_all();
  CHECK(sut.flush_releases(kStream) == 1);
  CHECK(sut.stats().pending_releases == 0);
  CHECK(sut.core().held() == 0);
  CHECK(arena.held_by(0) == 0);
  CHECK(arena.writer->reclaim(false) == 1);

  // The same reader, a hold taken without a context: released by freed() itself.
  const Allocation b = arena.write(kMiB, 2);
  ReaderHolds::Hold u = sut.acquire(b.slot, b.generation, kMiB, 0, false);
  CHECK_FALSE(u.gated);
  sut.freed(b.slot, u.generation, false);
  CHECK(sut.core().held() == 0);
  CHECK(arena.held_by(0) == 0);
  CHECK(sut.stats().pending_releases == 0);
}

TEST_CASE("a reader dropped with pending gated releases lingers until a later poll",
          "[reader_lifetime][lingering]") {
  FakeRuntime rt;
  rt.fake.hold_events(1);
  Arena arena(fixed_config(2, 2, kMiB));
  LingeringReaders lingering;  // outlives every reader that may linger in it
  auto sut = std::make_unique<ReaderHolds>(arena.attach(0), 0, &lingering);
  ReaderHolds other(arena.attach(1), 0, &lingering);
  arena.writer->unlink();
  const Allocation a = arena.write(kMiB);
  ReaderHolds::Hold h = sut->acquire(a.slot, a.generation, kMiB, 0, true);
  REQUIRE(h.gated);
  const uint8_t* data = h.data;
  sut->freed(a.slot, h.generation, true);
  CHECK(sut->flush_releases(kStream) == 0);  // recorded, pending

  sut.reset();  // the reader is dropped while the DMA may still read the slot
  CHECK(lingering.size() == 1);
  CHECK(arena.state_of(0) == ReaderState::kAttached);  // the rank stays
  CHECK(arena.held_by(0) == 1);
  CHECK(rt.fake.is_registered(data, kMiB) == 1);  // the memory stays registered
  CHECK(lingering.poll() == 0);                   // still running
  CHECK(other.flush_releases(kStream) == 0);
  CHECK(lingering.size() == 1);

  rt.fake.complete_all();
  CHECK(other.flush_releases(kStream) == 0);  // another reader's flush finishes it
  CHECK(lingering.size() == 0);
  CHECK(arena.held_by(0) == 0);
  CHECK(arena.state_of(0) == ReaderState::kDetached);
  CHECK(rt.fake.is_registered(data, kMiB) == 0);
  CHECK(rt.fake.registered_bytes() == 0);
}

TEST_CASE("a dropped reader's releases freed after its last flush are never released",
          "[reader_lifetime][lingering]") {
  FakeRuntime rt;
  Arena arena(fixed_config(1, 2, kMiB));
  LingeringReaders lingering;
  auto sut = std::make_unique<ReaderHolds>(arena.attach(0), 0, &lingering);
  arena.writer->unlink();
  const Allocation a = arena.write(kMiB);
  ReaderHolds::Hold h = sut->acquire(a.slot, a.generation, kMiB, 0, true);
  REQUIRE(h.gated);
  sut->freed(a.slot, h.generation, true);  // freed, no flush: no event behind it
  sut.reset();
  CHECK(lingering.size() == 1);
  rt.fake.complete_all();
  for (int i = 0; i < 3; ++i) CHECK(lingering.poll() == 0);  // no stream is known to record on
  CHECK(lingering.size() == 1);
  CHECK(arena.held_by(0) == 1);
  CHECK(rt.fake.event_records() == 0);
}

TEST_CASE("a reader dropped with nothing pending unregisters and detaches at once",
          "[reader_lifetime][lingering]") {
  FakeRuntime rt;
  Arena arena(fixed_config(1, 2, kMiB));
  LingeringReaders lingering;
  auto sut = std::make_unique<ReaderHolds>(arena.attach(0), 0, &lingering);
  arena.writer->unlink();
  const Allocation a = arena.write(kMiB);
  ReaderHolds::Hold h = sut->acquire(a.slot, a.generation, kMiB, 0, true);
  REQUIRE(h.gated);
  sut->freed(a.slot, h.generation, true);
  CHECK(sut->flush_releases(kStream) == 1);
  sut.reset();
  CHECK(lingering.size() == 0);
  CHECK(rt.fake.registered_bytes() == 0);
  CHECK(rt.fake.live_events() == 0);
  CHECK(arena.state_of(0) == ReaderState::kDetached);
}

// ---------------------------------------------------------------------------------- fork

TEST_CASE("a forked child touches nothing of its parent's holds, pins or events",
          "[reader_lifetime][fork]") {
  FakeRuntime rt;
  rt.fake.hold_events(1);
  Arena arena(fixed_config(1, 4, kMiB));
  LingeringReaders lingering;
  auto sut = std::make_unique<ReaderHolds>(arena.attach(0), 0, &lingering);
  arena.writer->unlink();
  const Allocation a = arena.write(kMiB, 1);
  const Allocation b = arena.write(kMiB, 2);
  const Allocation c = arena.write(kMiB, 3);
  ReaderHolds::Hold ha = sut->acquire(a.slot, a.generation, kMiB, 0, true);
  ReaderHolds::Hold hb = sut->acquire(b.slot, b.generation, kMiB, 0, true);
  ReaderHolds::Hold hc = sut->acquire(c.slot, c.generation, kMiB, 0, false);
  REQUIRE((ha.gated && hb.gated && !hc.gated));
  sut->freed(a.slot, ha.generation, true);  // pending in the parent, no event yet

  pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    int bad = 0;
    const long long calls = rt.fake.calls();
    sut->freed(b.slot, hb.generation, true);   // the child's copy of a pinned view dies
    sut->freed(c.slot, hc.generation, false);  // and of an unpinned one
    if (sut->stats().pending_releases != 1) bad |= 1;
    if (sut->core().held() != 3) bad |= 2;
    if (sut->flush_releases(kStream) != 0) bad |= 4;
    if (rt.fake.calls() != calls) bad |= 8;
    if (!sut->foreign()) bad |= 16;
    sut.reset();  // pending releases, but the child's drop lingers nothing and unregisters nothing
    if (lingering.size() != 0) bad |= 32;
    if (rt.fake.calls() != calls) bad |= 64;
    if (rt.fake.registered_bytes() != 4 * kMiB) bad |= 128;
    ::_exit(bad);
  }
  int status = vsa_test::wait_child(pid);
  REQUIRE(status >= 0);
  INFO("child exit status " << (WIFEXITED(status) ? WEXITSTATUS(status) : -1));
  CHECK(vsa_test::exited_ok(status));

  // The parent's state is as it was: three holds, one release pending, the region registered.
  CHECK(sut->core().held() == 3);
  CHECK(arena.held_by(0) == 3);
  CHECK(arena.state_of(0) == ReaderState::kAttached);
  CHECK(sut->stats().pending_releases == 1);
  CHECK(rt.fake.is_registered(hb.data, kMiB) == 1);
  sut->freed(b.slot, hb.generation, true);
  sut->freed(c.slot, hc.generation, false);
  CHECK(sut->flush_releases(kStream) == 0);
  rt.fake.complete_all();
  CHECK(sut->flush_releases(kStream) == 2);
  CHECK(sut->core().held() == 0);
  CHECK(arena.held_by(0) == 0);
}

// ------------------------------------------------------------------------------- threads

TEST_CASE("holds taken and freed on many threads, flushed on another",
          "[reader_lifetime][threads]") {
  const uint32_t seed = vsa_test::seed("reader_lifetime threads");
  FakeRuntime rt;
  rt.fake.set_register_delay_us(2000);  // widens the race for the first pin decision
  const uint32_t num_slots = 16;
  const uint64_t slot = 64 << 10;
  Arena arena(fixed_config(1, num_slots, slot));
  LingeringReaders lingering;
  ReaderHolds sut(arena.attach(0), 0, &lingering);
  arena.writer->unlink();

  // Every thread holds each slot it is given once, checks the bytes, frees it gated or not.
  struct Work {
    Allocation a;
    uint64_t sum;
  };
  std::mutex mu;
  std::vector<Work> queue;
  std::atomic<bool> done{false};
  std::atomic<int> bad{0};
  std::atomic<int> gated{0};
  std::atomic<int> consumed{0};
  const int n_threads = 4;
  const int n_writes = 400;
  std::vector<std::thread> threads;
  for (int t = 0; t < n_threads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(seed + t);
      for (;;) {
        std::optional<Work> w;
        {
          std::lock_guard<std::mutex> lock(mu);
          if (!queue.empty()) {
            w = queue.back();
            queue.pop_back();
          }
        }
        if (!w) {
          if (done.load()) return;
          std::this_thread::yield();
          continue;
        }
        const bool dma = rng() % 4 != 0;
        ReaderHolds::Hold h = sut.acquire(w->a.slot, w->a.generation, w->a.nbytes, 0, dma);
        if (vsa_test::checksum(h.data, w->a.nbytes) != w->sum) ++bad;
        if (h.gated) ++gated;
        if (h.gated != dma) ++bad;
        sut.freed(w->a.slot, h.generation, h.gated);
        ++consumed;
      }
    });
  }
  std::thread flusher([&] {
    while (!done.load() || sut.stats().pending_releases > 0) {
      sut.flush_releases(kStream);
      std::this_thread::yield();
    }
  });

  std::mt19937 rng(seed);
  std::vector<uint8_t> buf(slot);
  for (int i = 0; i < n_writes; ++i) {
    const uint64_t n = 1 + rng() % slot;
    vsa_test::fill_pattern(buf.data(), n, static_cast<uint64_t>(i));
    std::optional<Allocation> a;
    while (!(a = arena.writer->write(buf.data(), n))) std::this_thread::yield();
    std::lock_guard<std::mutex> lock(mu);
    queue.push_back(Work{*a, vsa_test::checksum(buf.data(), n)});
  }
  for (;;) {
    std::lock_guard<std::mutex> lock(mu);
    if (queue.empty()) break;
  }
  while (consumed.load() < n_writes) std::this_thread::yield();
  done = true;
  for (auto& th : threads) th.join();
  flusher.join();

  CHECK(bad.load() == 0);
  CHECK(gated.load() > 0);
  CHECK(rt.fake.register_calls() == 1);  // one pin decision, one registration of the region
  CHECK(sut.stats().pending_releases == 0);
  CHECK(sut.core().held() == 0);
  CHECK(arena.held_by(0) == 0);
}

TEST_CASE("a reader dropped on one thread while another's flushes poll the lingering ones",
          "[reader_lifetime][lingering][threads]") {
  FakeRuntime rt;
  rt.fake.hold_events(1);
  Arena arena(fixed_config(2, 2, kMiB));
  LingeringReaders lingering;
  auto dropped = std::make_unique<ReaderHolds>(arena.attach(0), 0, &lingering);
  ReaderHolds other(arena.attach(1), 0, &lingering);
  arena.writer->unlink();
  const Allocation a = arena.write(kMiB);
  ReaderHolds::Hold h = dropped->acquire(a.slot, a.generation, kMiB, 0, true);
  REQUIRE(h.gated);
  dropped->freed(a.slot, h.generation, true);
  CHECK(dropped->flush_releases(kStream) == 0);

  std::atomic<bool> stop{false};
  std::thread poller([&] {
    while (!stop.load()) {
      other.flush_releases(kStream);
      std::this_thread::yield();
    }
  });
  std::thread dropper([&] { dropped.reset(); });
  dropper.join();
  rt.fake.complete_all();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (std::chrono::steady_clock::now() < deadline && arena.held_by(0) != 0) {
    std::this_thread::yield();
  }
  stop = true;
  poller.join();
  CHECK(arena.held_by(0) == 0);
  CHECK(lingering.size() == 0);
  CHECK(rt.fake.registered_bytes() == 0);
}
