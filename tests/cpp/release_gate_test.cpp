#include "core/release_gate.h"

#include <algorithm>
#include <string>
#include <thread>
#include <vector>

#include "../fake_cudart/fake_cudart_control.hpp"
#include "catch_compat.hpp"

using vllm_shm_arena::CudaRuntime;
using vllm_shm_arena::ReleaseGate;
using vllm_shm_arena::testing::FakeCudart;

namespace {

std::shared_ptr<CudaRuntime> fake_runtime() {
  FakeCudart::get().reset();
  auto rt = CudaRuntime::load_from(FakeCudart::path());
  REQUIRE(rt != nullptr);
  return rt;
}

// A recognisable non-null stream handle; the fake never dereferences it.
void* const kStream = reinterpret_cast<void*>(0x5157);

// Collects released tokens.
struct Released {
  std::vector<uint64_t> tokens;
  ReleaseGate::Release fn() {
    return [this](uint64_t t) { tokens.push_back(t); };
  }
};

}  // namespace

TEST_CASE("ReleaseGate: freed() never calls the runtime, from any thread", "[gate]") {
  const FakeCudart& fake = FakeCudart::get();
  auto rt = fake_runtime();
  ReleaseGate sut(rt);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&sut, t] {
      for (uint64_t i = 0; i < 1000; ++i) sut.freed(t * 1000 + i);
    });
  }
  for (auto& th : threads) th.join();
  CHECK(fake.calls() == 0);
  CHECK(sut.pending() == 4000);

  Released out;
  CHECK(sut.flush(kStream, out.fn()) == 4000);
  std::sort(out.tokens.begin(), out.tokens.end());
  CHECK(std::adjacent_find(out.tokens.begin(), out.tokens.end()) == out.tokens.end());
  CHECK(out.tokens.size() == 4000);
  CHECK(sut.pending() == 0);
}

TEST_CASE("ReleaseGate holds a token while its event is pending and releases it after", "[gate]") {
  const FakeCudart& fake = FakeCudart::get();
  auto rt = fake_runtime();
  fake.hold_events(1);
  ReleaseGate sut(rt);
  Released out;

  sut.freed(7);
  CHECK(sut.flush(kStream, out.fn()) == 0);
  CHECK(fake.last_record_stream() == kStream);
  CHECK(fake.last_event_flags() == vllm_shm_arena::cuda_const::kEventDisableTiming);
  CHECK(sut.pending() == 1);
  CHECK(fake.peek_last_error() == 0);  // "not ready" is not left for torch to find

  CHECK(sut.flush(kStream, out.fn()) == 0);  // still running
  CHECK(out.tokens.empty());

  fake.complete_all();
  CHECK(sut.flush(kStream, out.fn()) == 1);
  CHECK(out.tokens == std::vector<uint64_t>{7});
  CHECK(sut.pending() == 0);
  CHECK(sut.stats().released == 1);
}

TEST_CASE("ReleaseGate: an event covers the tokens freed before it, not after", "[gate]") {
  const FakeCudart& fake = FakeCudart::get();
  auto rt = fake_runtime();
  fake.hold_events(1);
  ReleaseGate sut(rt);
  Released out;

  sut.freed(1);
  sut.freed(2);
  CHECK(sut.flush(kStream, out.fn()) == 0);  // one event for both
  CHECK(fake.event_records() == 1);
  fake.complete_all();  // the copies before the first event are done...
  sut.freed(3);         // ...but 3 was freed after it, so its copy may still run
  CHECK(sut.flush(kStream, out.fn()) == 2);
  CHECK(out.tokens == std::vector<uint64_t>{1, 2});
  CHECK(sut.pending() == 1);

  fake.complete_all();
  CHECK(sut.flush(kStream, out.fn()) == 1);
  CHECK(out.tokens == std::vector<uint64_t>{1, 2, 3});
}

TEST_CASE("ReleaseGate pools its events", "[gate]") {
  const FakeCudart& fake = FakeCudart::get();
  auto rt = fake_runtime();
  Released out;

  SECTION("a stream that keeps up reuses one event") {
    {
      ReleaseGate sut(rt);
      for (uint64_t i = 0; i < 100; ++i) {
        sut.freed(i);
        CHECK(sut.flush(kStream, out.fn()) == 1);
      }
      CHECK(fake.events_created() == 1);
      CHECK(fake.live_events() == 1);
      CHECK(sut.pooled_events() == 1);
    }
    CHECK(fake.live_events() == 0);
  }
  SECTION("events freed by completion are reused") {
    fake.hold_events(1);
    ReleaseGate sut(rt);
    for (uint64_t i = 0; i < 10; ++i) {
      sut.freed(i);
      sut.flush(kStream, out.fn());
    }
    CHECK(fake.events_created() == 10);
    fake.complete_all();
    CHECK(sut.flush(kStream, out.fn()) == 10);
    CHECK(sut.pooled_events() == 10);
    for (uint64_t i = 10; i < 20; ++i) {
      sut.freed(i);
      sut.flush(kStream, out.fn());
    }
    CHECK(fake.events_created() == 10);
  }
  SECTION("a stalled stream cannot make the pool grow without bound") {
    fake.hold_events(1);
    ReleaseGate sut(rt);
    const uint64_t n = ReleaseGate::kMaxPendingEvents + 6;
    for (uint64_t i = 0; i < n; ++i) {
      sut.freed(i);
      CHECK(sut.flush(kStream, out.fn()) == 0);
    }
    CHECK(fake.events_created() == static_cast<long long>(ReleaseGate::kMaxPendingEvents));
    CHECK(sut.pending() == n);
    fake.hold_events(0);
    fake.complete_all();
    size_t released = 0;
    for (int i = 0; i < 3 && released < n; ++i) released += sut.flush(kStream, out.fn());
    CHECK(released == n);
    CHECK(fake.events_created() == static_cast<long long>(ReleaseGate::kMaxPendingEvents));
  }
}

TEST_CASE("ReleaseGate: a failed record keeps the tokens until a later record succeeds", "[gate]") {
  const FakeCudart& fake = FakeCudart::get();
  auto rt = fake_runtime();
  ReleaseGate sut(rt);
  std::vector<std::string> log;
  sut.set_logger([&](const std::string& line) { log.push_back(line); });
  Released out;

  fake.fail_event_record(1);
  sut.freed(5);
  CHECK(sut.flush(kStream, out.fn()) == 0);
  sut.freed(6);
  CHECK(sut.flush(kStream, out.fn()) == 0);
  CHECK(sut.pending() == 2);
  REQUIRE(log.size() == 1);
  CHECK(log[0].find("cudaEventRecord failed") != std::string::npos);
  CHECK(fake.peek_last_error() == 0);
  CHECK(sut.stats().record_failures == 2);

  fake.fail_event_record(0);
  CHECK(sut.flush(kStream, out.fn()) == 2);
  CHECK(out.tokens == std::vector<uint64_t>{5, 6});
  CHECK(fake.events_created() == 1);  // the event of the failed records was kept and reused
  CHECK(log.size() == 1);
}

TEST_CASE("ReleaseGate: a failed query does not release; drain_after_sync() does", "[gate]") {
  const FakeCudart& fake = FakeCudart::get();
  auto rt = fake_runtime();
  fake.hold_events(1);
  ReleaseGate sut(rt);
  std::vector<std::string> log;
  sut.set_logger([&](const std::string& line) { log.push_back(line); });
  Released out;

  sut.freed(1);
  CHECK(sut.flush(kStream, out.fn()) == 0);
  fake.fail_event_query(700);  // cudaErrorIllegalAddress: the context is broken
  fake.complete_all();
  CHECK(sut.flush(kStream, out.fn()) == 0);
  CHECK(sut.flush(kStream, out.fn()) == 0);
  CHECK(sut.pending() == 1);
  REQUIRE(log.size() == 1);
  CHECK(log[0].find("cudaEventQuery failed") != std::string::npos);
  CHECK(log[0].find("(error 700)") != std::string::npos);
  CHECK(fake.peek_last_error() == 0);

  sut.freed(2);
  sut.freed(3);
  CHECK(sut.drain_after_sync(out.fn()) == 3);
  std::sort(out.tokens.begin(), out.tokens.end());
  CHECK(out.tokens == std::vector<uint64_t>{1, 2, 3});
  CHECK(sut.pending() == 0);
}

TEST_CASE("ReleaseGate destroys every event it created", "[gate]") {
  const FakeCudart& fake = FakeCudart::get();
  auto rt = fake_runtime();
  const long long live_before = fake.live_events();
  fake.hold_events(1);
  {
    ReleaseGate sut(rt);
    Released out;
    for (uint64_t i = 0; i < 3; ++i) {
      sut.freed(i);
      sut.flush(kStream, out.fn());
    }
    fake.complete_all();
    sut.flush(kStream, out.fn());  // three events back in the pool
    sut.freed(9);
    sut.flush(kStream, out.fn());  // one still pending at destruction
    CHECK(fake.live_events() == live_before + 3);
  }
  CHECK(fake.live_events() == live_before);
}

TEST_CASE("ReleaseGate without a runtime releases at the next flush", "[gate]") {
  ReleaseGate sut(nullptr);
  Released out;
  sut.freed(4);
  CHECK(sut.pending() == 1);
  CHECK(sut.flush(nullptr, out.fn()) == 1);
  CHECK(out.tokens == std::vector<uint64_t>{4});
}
