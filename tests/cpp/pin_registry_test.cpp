#include "core/pin_registry.h"

#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "../fake_cudart/fake_cudart_control.hpp"
#include "catch_compat.hpp"
#include "core/errors.h"

using vllm_shm_arena::CudaRuntime;
using vllm_shm_arena::InvalidArgument;
using vllm_shm_arena::PinRegistry;
using vllm_shm_arena::testing::FakeCudart;

namespace {

const size_t kPage = static_cast<size_t>(::sysconf(_SC_PAGESIZE));

// An address range that is never touched: the fake runtime does not read memory, so a
// PROT_NONE reservation is enough and costs nothing.
class Reservation {
 public:
  explicit Reservation(size_t len) : len_(len) {
    void* p = ::mmap(nullptr, len, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    REQUIRE(p != MAP_FAILED);
    base_ = static_cast<char*>(p);
  }
  ~Reservation() { ::munmap(base_, len_); }
  char* base() const { return base_; }
  size_t len() const { return len_; }

 private:
  char* base_ = nullptr;
  size_t len_ = 0;
};

std::shared_ptr<CudaRuntime> fake_runtime() {
  FakeCudart::get().reset();
  auto rt = CudaRuntime::load_from(FakeCudart::path());
  REQUIRE(rt != nullptr);
  return rt;
}

}  // namespace

TEST_CASE("PinRegistry registers each chunk lazily and once, with the portable flag", "[pin]") {
  const FakeCudart& fake = FakeCudart::get();
  auto rt = fake_runtime();
  const size_t chunk = 16 * kPage;
  // Three full chunks and a last one clipped to five pages.
  Reservation mem(3 * chunk + 5 * kPage);
  char* base = mem.base();
  PinRegistry sut(rt, base, mem.len(), chunk);
  REQUIRE(sut.num_chunks() == 4);
  CHECK(fake.calls() == 0);  // construction registers nothing

  SECTION("one byte pins its chunk only") {
    CHECK(sut.ensure(base + 3, 1));
    CHECK(fake.register_calls() == 1);
    CHECK(fake.register_count(base, chunk) == 1);
    CHECK(fake.last_register_flags() == vllm_shm_arena::cuda_const::kHostRegisterPortable);
    CHECK(sut.is_pinned(base, chunk));
    CHECK_FALSE(sut.is_pinned(base, chunk + 1));
    CHECK(sut.pinned_bytes() == chunk);

    CHECK(sut.ensure(base + 100, 200));
    CHECK(sut.ensure(base, chunk));
    CHECK(fake.register_calls() == 1);  // already pinned: no new call
  }
  SECTION("a range across a chunk boundary pins both chunks, exactly") {
    CHECK(sut.ensure(base + chunk - 10, 20));
    CHECK(fake.register_calls() == 2);
    CHECK(fake.register_count(base, chunk) == 1);
    CHECK(fake.register_count(base + chunk, chunk) == 1);
    CHECK(fake.registered_ranges() == 2);
    CHECK_FALSE(fake.is_registered(base + 2 * chunk, 1));
  }
  SECTION("the last chunk is clipped to the mapping's end") {
    CHECK(sut.ensure(base + mem.len() - 1, 1));
    CHECK(fake.register_count(base + 3 * chunk, 5 * kPage) == 1);
    CHECK(fake.registered_bytes() == 5 * kPage);
  }
  SECTION("the whole mapping") {
    CHECK(sut.ensure(base, mem.len()));
    CHECK(fake.register_calls() == 4);
    CHECK(fake.is_registered(base, mem.len()));
    CHECK(fake.registered_bytes() == mem.len());
    CHECK(sut.pinned_bytes() == mem.len());
    CHECK(sut.stats().registrations == 4);
    CHECK(sut.stats().failures == 0);
    CHECK(sut.stats().register_seconds >= 0.0);
  }
  SECTION("contiguous_bytes() splits a range at chunk boundaries") {
    CHECK(sut.contiguous_bytes(base, 10) == 10);
    CHECK(sut.contiguous_bytes(base, mem.len()) == chunk);
    CHECK(sut.contiguous_bytes(base + chunk - 10, 20) == 10);
    CHECK(sut.contiguous_bytes(base + 3 * chunk + 1, 5 * kPage - 1) == 5 * kPage - 1);
    CHECK(sut.contiguous_bytes(base + 7, 0) == 0);
    CHECK_THROWS_AS(sut.contiguous_bytes(base + mem.len(), 1), InvalidArgument);
    size_t pieces = 0;
    for (size_t off = 5, left = mem.len() - 5; left > 0; ++pieces) {
      const size_t n = sut.contiguous_bytes(base + off, left);
      off += n;
      left -= n;
    }
    CHECK(pieces == 4);
    CHECK(fake.calls() == 0);
  }
  SECTION("an empty range needs nothing") {
    CHECK(sut.ensure(base + 5, 0));
    CHECK(fake.calls() == 0);
  }
  SECTION("a range outside the mapping is the caller's mistake") {
    CHECK_THROWS_AS(sut.ensure(base + mem.len() - 1, 2), InvalidArgument);
    CHECK_THROWS_AS(sut.ensure(base - 1, 1), InvalidArgument);
    CHECK_THROWS_AS(sut.is_pinned(base + mem.len() + 1, 1), InvalidArgument);
    CHECK(fake.calls() == 0);
  }
}

TEST_CASE("PinRegistry rejects a layout that would share a page between chunks", "[pin]") {
  auto rt = fake_runtime();
  Reservation mem(4 * kPage);
  CHECK_THROWS_AS(PinRegistry(rt, mem.base() + 8, 2 * kPage, kPage), InvalidArgument);
  CHECK_THROWS_AS(PinRegistry(rt, mem.base(), 2 * kPage, kPage + 1), InvalidArgument);
  CHECK_THROWS_AS(PinRegistry(rt, mem.base(), 2 * kPage, 0), InvalidArgument);
  CHECK_THROWS_AS(PinRegistry(rt, mem.base(), 0, kPage), InvalidArgument);
  CHECK_NOTHROW(PinRegistry(rt, mem.base(), 2 * kPage + 1, kPage));
}

TEST_CASE("PinRegistry unregisters every registered chunk when destroyed", "[pin]") {
  const FakeCudart& fake = FakeCudart::get();
  auto rt = fake_runtime();
  const size_t chunk = 4 * kPage;
  Reservation mem(5 * chunk);
  {
    PinRegistry sut(rt, mem.base(), mem.len(), chunk);
    REQUIRE(sut.ensure(mem.base() + chunk, 2 * chunk));
    REQUIRE(sut.ensure(mem.base() + 4 * chunk, 1));
    REQUIRE(fake.registered_ranges() == 3);
  }
  CHECK(fake.unregister_calls() == 3);
  CHECK(fake.registered_ranges() == 0);
  CHECK(fake.peek_last_error() == 0);
}

TEST_CASE(
    "PinRegistry: a failed registration is logged once, never retried, and leaves the "
    "registry working unpinned",
    "[pin]") {
  const FakeCudart& fake = FakeCudart::get();
  auto rt = fake_runtime();
  const size_t chunk = 4 * kPage;
  Reservation mem(4 * chunk);
  char* base = mem.base();
  std::vector<std::string> log;
  {
    PinRegistry sut(rt, base, mem.len(), chunk);
    sut.set_logger([&](const std::string& line) { log.push_back(line); });
    REQUIRE(sut.ensure(base, 1));  // chunk 0 pinned before the failure

    fake.fail_register(2);  // cudaErrorMemoryAllocation
    CHECK_FALSE(sut.ensure(base + chunk, 2 * chunk));
    const long long calls_after_failure = fake.register_calls();
    CHECK(calls_after_failure == 2);  // chunk 2 was never tried after chunk 1 failed
    CHECK(sut.failed());
    REQUIRE(log.size() == 1);
    CHECK(log[0].find("cudaHostRegister") != std::string::npos);
    CHECK(log[0].find("out of memory (error 2)") != std::string::npos);
    CHECK(fake.peek_last_error() == 0);  // the failure is not left for torch to find

    fake.fail_register(0);  // even once registration would work again, it is not retried
    CHECK_FALSE(sut.ensure(base + chunk, 1));
    CHECK_FALSE(sut.ensure(base + 3 * chunk, 1));
    CHECK(fake.register_calls() == calls_after_failure);
    CHECK(log.size() == 1);
    CHECK(sut.stats().failures == 1);
    CHECK(sut.stats().registrations == 1);

    CHECK(sut.ensure(base + 10, 10));  // what was pinned before stays pinned
    CHECK(sut.pinned_bytes() == chunk);
  }
  CHECK(fake.unregister_calls() == 1);
  CHECK(fake.registered_ranges() == 0);
}

TEST_CASE("PinRegistry without a runtime never pins", "[pin]") {
  Reservation mem(4 * kPage);
  PinRegistry sut(nullptr, mem.base(), mem.len(), kPage);
  CHECK_FALSE(sut.ensure(mem.base(), 1));
  CHECK_FALSE(sut.is_pinned(mem.base(), 1));
  CHECK(sut.pinned_bytes() == 0);
}

TEST_CASE("PinRegistry: concurrent ensure() registers each chunk exactly once", "[pin]") {
  const FakeCudart& fake = FakeCudart::get();
  auto rt = fake_runtime();
  const size_t chunk = 2 * kPage;
  const size_t chunks = 24;
  Reservation mem(chunks * chunk - kPage);  // the last chunk is clipped too
  PinRegistry sut(rt, mem.base(), mem.len(), chunk);
  fake.set_register_delay_us(200);  // keep registrations in flight while others arrive

  const unsigned seed = std::random_device{}();
  INFO("seed " << seed);
  constexpr int kThreads = 4;
  std::atomic<int> ready{0};
  std::atomic<int> false_answers{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(seed + t);
      ready.fetch_add(1);
      while (ready.load() < kThreads) {
      }
      for (int i = 0; i < 40; ++i) {
        const size_t off = rng() % mem.len();
        const size_t len = 1 + rng() % (mem.len() - off);
        if (!sut.ensure(mem.base() + off, len)) false_answers.fetch_add(1);
      }
      if (!sut.ensure(mem.base(), mem.len())) false_answers.fetch_add(1);
    });
  }
  for (auto& th : threads) th.join();
  fake.set_register_delay_us(0);

  CHECK(false_answers.load() == 0);
  CHECK(fake.register_calls() == static_cast<long long>(chunks));
  for (size_t i = 0; i < chunks; ++i) {
    const size_t len = i + 1 < chunks ? chunk : chunk - kPage;
    INFO("chunk " << i);
    CHECK(fake.register_count(mem.base() + i * chunk, len) == 1);
  }
  CHECK(sut.pinned_bytes() == mem.len());
}
