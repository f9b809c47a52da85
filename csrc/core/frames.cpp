#include "core/frames.h"

#include <cstring>
#include <limits>
#include <string>

#include "core/copy_pool.h"
#include "core/errors.h"

namespace vllm_shm_arena {

static_assert(kFrameCountBytes == 4 && kFrameLenBytes == 8,
              "the framing is [u32 count][u64 len x count]: both ends of every ring and arena "
              "read these widths");

uint64_t framed_size(const FrameSpans& frames) {
  constexpr uint64_t kMax = std::numeric_limits<uint64_t>::max();
  if (frames.size() > std::numeric_limits<uint32_t>::max()) {
    throw InvalidArgument("a message of " + std::to_string(frames.size()) +
                          " frames cannot be framed: the count holds at most " +
                          std::to_string(std::numeric_limits<uint32_t>::max()));
  }
  // At most 4 + 8 * (2^32 - 1) bytes: no overflow in 64 bits.
  uint64_t n = kFrameCountBytes + uint64_t{frames.size()} * kFrameLenBytes;
  for (size_t i = 0; i < frames.size(); ++i) {
    if (frames[i].len > kMax - n) {
      throw InvalidArgument("a message whose frames total more than 2^64 - 1 bytes cannot be " +
                            std::string("framed (frame ") + std::to_string(i) + " is " +
                            std::to_string(frames[i].len) + " bytes)");
    }
    n += frames[i].len;
  }
  return n;
}

void pack_frames(uint8_t* dst, const FrameSpans& frames) {
  uint8_t* p = dst;
  const uint32_t count = static_cast<uint32_t>(frames.size());  // framed_size checked the range
  std::memcpy(p, &count, sizeof(count));
  p += sizeof(count);
  for (const FrameSpan& f : frames) {
    std::memcpy(p, &f.len, sizeof(f.len));
    p += sizeof(f.len);
  }
  for (const FrameSpan& f : frames) {
    if (f.len > 0) parallel_copy(p, f.data, f.len, CopyTarget::kShared);
    p += f.len;
  }
}

FrameSpans parse_frames(const uint8_t* data, uint64_t nbytes) {
  FrameSpans frames;
  if (nbytes == 0) return frames;
  uint32_t count = 0;
  if (nbytes < sizeof(count)) throw InvalidArgument("packed message too short");
  std::memcpy(&count, data, sizeof(count));  // read once: the private copy decides from here
  // At most 4 + 8 * (2^32 - 1): no overflow in 64 bits, and checked before anything is sized by
  // the count.
  const uint64_t head = kFrameCountBytes + uint64_t{count} * kFrameLenBytes;
  if (head > nbytes) throw InvalidArgument("packed message header is corrupt");
  frames.reserve(count);
  const uint8_t* lens = data + kFrameCountBytes;
  const uint8_t* p = data + head;
  uint64_t left = nbytes - head;
  for (uint32_t i = 0; i < count; ++i) {
    uint64_t len = 0;
    std::memcpy(&len, lens + uint64_t{i} * kFrameLenBytes, sizeof(len));  // read once
    if (len > left) throw InvalidArgument("packed message frame overruns the message");
    frames.push_back(FrameSpan{p, len});
    p += len;
    left -= len;
  }
  return frames;
}

}  // namespace vllm_shm_arena
