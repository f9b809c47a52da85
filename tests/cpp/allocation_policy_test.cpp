// Tests of the allocation policies (allocation_policy.cpp).
#include "core/allocation_policy.h"

#include <algorithm>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "catch_compat.hpp"
#include "test_util.hpp"

using namespace vllm_shm_arena;

TEST_CASE("fixed slots reuse the most recently freed slot", "[policy]") {
  FixedSlotPolicy sut(3, 4096, 1 << 21);
  DeclineReason why;
  auto a = sut.place(10, &why), b = sut.place(10, &why), c = sut.place(10, &why);
  REQUIRE((a && b && c));
  CHECK(a->offset == (1u << 21));
  CHECK_FALSE(sut.place(1, &why));
  CHECK(why == DeclineReason::kNoFreeSlot);
  CHECK_FALSE(sut.place(4097, &why));
  CHECK(why == DeclineReason::kOversize);
  sut.free(*b);
  auto d = sut.place(1, &why);
  REQUIRE(d);
  CHECK(d->slot == b->slot);
}

TEST_CASE("variable packing: sizes, alignment, bounds", "[policy]") {
  const uint64_t base = 1 << 21, bytes = 64 << 20;
  VariablePolicy sut(4, base, bytes);
  DeclineReason why;
  auto a = sut.place(1, &why);
  REQUIRE(a);
  CHECK(a->capacity == 4096);
  CHECK(a->offset % 4096 == 0);
  auto b = sut.place(bytes - 4096, &why);  // exactly the rest
  REQUIRE(b);
  CHECK_FALSE(sut.place(1, &why));
  CHECK(why == DeclineReason::kNoFreeSlot);
  sut.free(*a);
  sut.free(*b);
  CHECK(sut.free_bytes() == bytes);
  CHECK(sut.largest_free_extent() == bytes);
  auto whole = sut.place(bytes, &why);
  REQUIRE(whole);
  sut.free(*whole);
  CHECK_FALSE(sut.place(bytes + 1, &why));
  CHECK(why == DeclineReason::kOversize);
  // The slot pool is the metadata bound.
  std::vector<Placement> held;
  for (int i = 0; i < 4; ++i) held.push_back(*sut.place(4096, &why));
  CHECK_FALSE(sut.place(4096, &why));
  CHECK(why == DeclineReason::kSlotTableFull);
}

TEST_CASE("variable packing: a burst of 25 x 16 MB fits a 512 MiB region", "[policy]") {
  VariablePolicy sut(64, 0, 512ull << 20);
  DeclineReason why;
  for (int i = 0; i < 25; ++i) REQUIRE(sut.place(16'000'000, &why));
}

TEST_CASE("variable packing never loses space under a long random workload", "[policy]") {
  const uint32_t seed = vsa_test::seed("policy fragmentation");
  std::mt19937_64 rng(seed);
  const uint64_t bytes = 256ull << 20;
  VariablePolicy sut(256, 1 << 21, bytes);
  std::vector<Placement> live;
  uint64_t placed = 0, declined = 0;
  for (int step = 0; step < 200000; ++step) {
    bool alloc = live.empty() || (rng() % 100) < 55;
    if (alloc) {
      // Mostly small, sometimes large: like messages with an image now and then.
      uint64_t n = (rng() % 10 == 0) ? (rng() % (64 << 20)) : (rng() % (1 << 20));
      DeclineReason why;
      auto p = sut.place(n, &why);
      if (p) {
        live.push_back(*p);
        ++placed;
      } else {
        ++declined;
      }
    } else {
      size_t i = rng() % live.size();
      sut.free(live[i]);
      live[i] = live.back();
      live.pop_back();
    }
    // Live extents never overlap.
    if (step % 5000 == 0) {
      auto sorted = live;
      std::sort(sorted.begin(), sorted.end(),
                [](const Placement& a, const Placement& b) { return a.offset < b.offset; });
      for (size_t i = 1; i < sorted.size(); ++i) {
        REQUIRE(sorted[i - 1].offset + sorted[i - 1].capacity <= sorted[i].offset);
      }
    }
  }
  INFO("placed " << placed << ", declined " << declined);
  for (auto& p : live) sut.free(p);
  // After everything is released the whole region is one free extent again.
  CHECK(sut.free_bytes() == bytes);
  CHECK(sut.largest_free_extent() == bytes);
}

TEST_CASE("mark_used carves a live allocation out of the free space", "[policy]") {
  VariablePolicy sut(8, 0, 1 << 20);
  sut.mark_used(Placement{3, 8192, 4096});
  CHECK(sut.free_bytes() == (1u << 20) - 4096);
  DeclineReason why;
  std::vector<Placement> got;
  while (auto p = sut.place(4096, &why)) got.push_back(*p);
  for (auto& p : got) {
    CHECK(p.slot != 3);
    CHECK(p.offset != 8192);
  }
}

TEST_CASE("every decline reason has its stats() name, in enum order", "[policy]") {
  const std::vector<std::string> want = {"too_small", "not_contiguous", "oversize", "no_free_slot",
                                         "no_space",  "unsupported",    "no_record"};
  REQUIRE(kDeclineReasonNames.size() == want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    CHECK(std::string(kDeclineReasonNames[i]) == want[i]);
    CHECK(std::string(decline_reason_name(static_cast<DeclineReason>(i))) == want[i]);
  }
  CHECK(std::string(decline_reason_name(DeclineReason::kSlotTableFull)) == "no_record");
  CHECK(std::string(decline_reason_name(DeclineReason::kCount)) == "unknown");
  CHECK(std::string(decline_reason_name(static_cast<DeclineReason>(1000))) == "unknown");
}
