// Tests for csrc/core/frames.cpp: the framing every ring message and arena blob goes through.
// Round trips of 0, 1 and many frames (empty ones included), the size computation and its
// overflow check, and every way a framed message read from shared memory can be corrupt.
//
// Random frame counts and sizes come from a seed printed at the start of the test; set
// VSA_SEED to replay a failure.
#include "core/frames.h"

#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "catch_compat.hpp"
#include "core/errors.h"
#include "test_util.hpp"

using namespace vllm_shm_arena;

namespace {

// Owned frames and the spans over them.
struct Message {
  std::vector<std::vector<uint8_t>> frames;

  FrameSpans spans() const {
    FrameSpans out;
    for (const auto& f : frames) out.push_back(FrameSpan{f.data(), f.size()});
    return out;
  }
};

Message make_message(const std::vector<size_t>& sizes, uint64_t tag) {
  Message m;
  for (size_t i = 0; i < sizes.size(); ++i) {
    m.frames.emplace_back(sizes[i]);
    vsa_test::fill_pattern(m.frames.back().data(), sizes[i], tag * 1000 + i);
  }
  return m;
}

std::vector<uint8_t> pack(const Message& m) {
  FrameSpans spans = m.spans();
  std::vector<uint8_t> out(framed_size(spans));
  pack_frames(out.data(), spans);
  return out;
}

// The framing written by hand, field by field, as the header drawing in frames.h lays it out.
std::vector<uint8_t> hand_framed(uint32_t count, const std::vector<uint64_t>& lens,
                                 size_t payload_bytes) {
  std::vector<uint8_t> out(4 + 8 * lens.size() + payload_bytes, 0xAB);
  std::memcpy(out.data(), &count, 4);
  for (size_t i = 0; i < lens.size(); ++i) std::memcpy(out.data() + 4 + 8 * i, &lens[i], 8);
  return out;
}

void check_refused(const std::vector<uint8_t>& bytes, uint64_t nbytes, const std::string& text) {
  try {
    parse_frames(bytes.data(), nbytes);
    FAIL("a corrupt framing was accepted (expected '" << text << "')");
  } catch (const InvalidArgument& e) {
    CHECK(std::string(e.what()) == text);
  }
}

}  // namespace

TEST_CASE("framed messages of 0, 1 and many frames round-trip, empty frames included", "[frames]") {
  const std::vector<std::vector<size_t>> shapes = {
      {}, {0}, {1}, {5}, {0, 0, 0}, {7, 0, 13}, {0, 4096, 0, 1, 65537}, {3, 3, 3, 3, 3, 3, 3, 3},
  };
  uint64_t tag = 1;
  for (const auto& sizes : shapes) {
    Message sut = make_message(sizes, tag++);
    std::vector<uint8_t> packed = pack(sut);
    uint64_t expect = 4 + 8 * sizes.size();
    for (size_t s : sizes) expect += s;
    CHECK(packed.size() == expect);
    uint32_t count = 0;
    std::memcpy(&count, packed.data(), 4);
    CHECK(count == sizes.size());

    FrameSpans got = parse_frames(packed.data(), packed.size());
    REQUIRE(got.size() == sizes.size());
    const uint8_t* next = packed.data() + 4 + 8 * sizes.size();
    for (size_t i = 0; i < sizes.size(); ++i) {
      INFO("frame " << i << " of " << sizes.size());
      CHECK(got[i].len == sizes[i]);
      CHECK(got[i].data == next);  // spans into the caller's bytes, in order, no padding
      CHECK(std::memcmp(got[i].data, sut.frames[i].data(), sizes[i]) == 0);
      next += sizes[i];
    }
  }
}

TEST_CASE("randomized frame lists round-trip", "[frames]") {
  std::mt19937_64 rng(vsa_test::seed("frames_random"));
  for (int round = 0; round < 200; ++round) {
    std::vector<size_t> sizes(rng() % 17);
    for (size_t& s : sizes) s = rng() % 4 == 0 ? 0 : rng() % 3000;
    Message sut = make_message(sizes, round);
    std::vector<uint8_t> packed = pack(sut);
    FrameSpans got = parse_frames(packed.data(), packed.size());
    REQUIRE(got.size() == sizes.size());
    for (size_t i = 0; i < sizes.size(); ++i) {
      REQUIRE(got[i].len == sizes[i]);
      REQUIRE(std::memcmp(got[i].data, sut.frames[i].data(), sizes[i]) == 0);
    }
  }
}

TEST_CASE("a payload of zero bytes is a message without frames; trailing bytes are ignored",
          "[frames]") {
  CHECK(parse_frames(nullptr, 0).empty());
  std::vector<uint8_t> packed = pack(make_message({3, 2}, 9));
  packed.push_back(0x55);  // bytes after the last frame are not part of any frame
  FrameSpans got = parse_frames(packed.data(), packed.size());
  REQUIRE(got.size() == 2);
  CHECK(got[0].len == 3);
  CHECK(got[1].len == 2);
}

TEST_CASE("framed_size counts the count, every length and every frame's bytes", "[frames]") {
  CHECK(framed_size({}) == 4);
  CHECK(framed_size({FrameSpan{nullptr, 0}}) == 12);
  CHECK(framed_size({FrameSpan{nullptr, 10}, FrameSpan{nullptr, 0}, FrameSpan{nullptr, 5}}) ==
        4 + 24 + 15);
  // The largest size that still fits in 64 bits is accepted as it is.
  const uint64_t max = std::numeric_limits<uint64_t>::max();
  CHECK(framed_size({FrameSpan{nullptr, max - 12}}) == max);
}

TEST_CASE("a framed size that would overflow 64 bits is an error, never a wrapped size",
          "[frames][faults]") {
  const uint64_t max = std::numeric_limits<uint64_t>::max();
  // One frame too large for the head plus its bytes.
  CHECK_THROWS_AS(framed_size({FrameSpan{nullptr, max - 11}}), InvalidArgument);
  CHECK_THROWS_AS(framed_size({FrameSpan{nullptr, max}}), InvalidArgument);
  // Frames that fit one by one but not together (their sum would wrap to a small number).
  const uint64_t half = uint64_t{1} << 63;
  try {
    framed_size({FrameSpan{nullptr, 1}, FrameSpan{nullptr, half}, FrameSpan{nullptr, half}});
    FAIL("an overflowing sum was accepted");
  } catch (const InvalidArgument& e) {
    CHECK(std::string(e.what()).find("frame 2") != std::string::npos);
  }
}

TEST_CASE("every corrupt framing is refused with its own error", "[frames][faults]") {
  SECTION("shorter than the count") {
    std::vector<uint8_t> bytes = {1, 0, 0, 0};
    for (uint64_t n = 1; n < 4; ++n) check_refused(bytes, n, "packed message too short");
  }
  SECTION("a count whose lengths run past the message") {
    // Count 2 but room for only one length.
    check_refused(hand_framed(2, {0}, 0), 12, "packed message header is corrupt");
    // Count 1 and a length field cut short.
    check_refused(hand_framed(1, {0}, 0), 11, "packed message header is corrupt");
  }
  SECTION("a huge count whose head alone is larger than any message") {
    // 4 + 8 * (2^32 - 1) bytes of head: refused before anything is sized by the count.
    std::vector<uint8_t> bytes = hand_framed(0xFFFFFFFFu, {1, 2, 3}, 64);
    check_refused(bytes, bytes.size(), "packed message header is corrupt");
    bytes = hand_framed(1u << 30, {}, 0);
    check_refused(bytes, bytes.size(), "packed message header is corrupt");
  }
  SECTION("a frame length that overruns the message") {
    // The first frame claims one byte more than there is.
    std::vector<uint8_t> bytes = hand_framed(1, {9}, 8);
    check_refused(bytes, bytes.size(), "packed message frame overruns the message");
    // Each frame fits on its own but the second runs past what the first left.
    bytes = hand_framed(2, {6, 6}, 10);
    check_refused(bytes, bytes.size(), "packed message frame overruns the message");
    // A length that would wrap any offset it is added to.
    bytes = hand_framed(2, {1, std::numeric_limits<uint64_t>::max()}, 4);
    check_refused(bytes, bytes.size(), "packed message frame overruns the message");
  }
  SECTION("a message cut short by the caller's nbytes") {
    std::vector<uint8_t> packed = pack(make_message({100, 50}, 3));
    for (uint64_t n :
         {uint64_t{3}, uint64_t{4 + 8}, uint64_t{4 + 16 + 99}, uint64_t{packed.size() - 1}}) {
      INFO("nbytes " << n);
      CHECK_THROWS_AS(parse_frames(packed.data(), n), InvalidArgument);
    }
  }
}
