// The Python side of messages: the ring's two ends (_C.MessageRingWriter, _C.MessageRingReader, the
// RING_FLAG_* constants) and the arena blob a message too big for a chunk goes into. The
// segment, the protocol and the framing are the core's (core/message_ring.h, core/frames.h);
// this layer only takes Python buffers in and hands bytearrays out.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <optional>
#include <tuple>

#include "core/arena.h"

namespace vllm_shm_arena {

/// Defines RingWriter, RingReader and RING_FLAG_{OVERFLOW,NO_SPACE,BLOB} on `m`.
void bind_messages(pybind11::module_& m);

/// Packs a message too big for a ring chunk into one allocation of `writer` (the "blob" an
/// overflow marker names) -> (slot, generation, nbytes), or None when the arena declines or
/// the framed message is larger than `max_bytes`. Published when this returns: readers copy it
/// out with arena_read_frames and release it at once. _C.TensorArenaWriter.write_frames.
std::optional<std::tuple<uint32_t, uint64_t, uint64_t>> arena_write_frames(
    ArenaWriter& writer, const pybind11::list& frames, uint64_t max_bytes);

/// A blob's frames as bytearrays the caller owns; the allocation is released before this
/// returns, also when its framing is corrupt (ValueError). _C.TensorArenaReader.read_frames.
pybind11::list arena_read_frames(ArenaReader& reader, uint32_t slot, uint64_t generation,
                                 uint64_t nbytes);

}  // namespace vllm_shm_arena
