// The framing of one message: a list of frames (a pickle stream and its out-of-band buffers)
// packed into one run of bytes, the same in a ring chunk (core/message_ring.h) and in an arena
// blob (a message too big for a chunk, packed into one arena allocation).
//
//   +0                 u32 count                      number of frames (may be 0)
//   +4                 u64 len[count]                 each frame's length, in frame order
//   +4 + 8 * count     frame 0's bytes, frame 1's bytes, ...   (no padding between them)
//
// All integers are in host byte order (every end of a ring or an arena is on one host). A
// payload of zero bytes (not even a count) is a message without frames: what a marker chunk
// carries.
//
// Reading: the packed bytes are shared memory that another process may rewrite at any time,
// so parse_frames reads the count and each length exactly once into private memory and checks
// each against what is left before using it; the spans it returns are only (pointer, length)
// pairs into the caller's bytes, whose lengths can no longer change under the caller.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace vllm_shm_arena {

/// One frame's bytes: `len` bytes at `data` (data may be null when len is 0, or when only the
/// length matters, as for framed_size).
struct FrameSpan {
  const uint8_t* data = nullptr;
  uint64_t len = 0;
};

/// A message's frames, in order.
using FrameSpans = std::vector<FrameSpan>;

/// Bytes of the count field that starts every framed message.
constexpr uint64_t kFrameCountBytes = sizeof(uint32_t);
/// Bytes of each frame's length field.
constexpr uint64_t kFrameLenBytes = sizeof(uint64_t);

/// The one computation of a framed message's size: count, lengths and every frame's bytes.
/// Throws InvalidArgument when there are more frames than the u32 count holds, or when the sum
/// would not fit in 64 bits (a wrapped size would let pack_frames write past its buffer).
uint64_t framed_size(const FrameSpans& frames);

/// Packs `frames` into `dst`, which must hold framed_size(frames) bytes, copying each frame
/// with parallel_copy as into shared memory (CopyTarget::kShared). Needs no Python and takes no
/// lock: callable without the GIL.
void pack_frames(uint8_t* dst, const FrameSpans& frames);

/// Parses the framed message in [data, data + nbytes): the frames as spans into those bytes.
/// The count and each length are read once and checked against what is left; bytes after the
/// last frame are ignored. Throws InvalidArgument ("packed message too short", "... header is
/// corrupt", "... frame overruns the message"). nbytes == 0 is a message without frames.
FrameSpans parse_frames(const uint8_t* data, uint64_t nbytes);

}  // namespace vllm_shm_arena
