// The Python side of messages: the ring's two ends (_C.MessageRingWriter, _C.MessageRingReader, the
// RING_FLAG_* constants) and the arena blob a message too big for a chunk goes into. The
// segment, the protocol and the framing are the core's (core/message_ring.h, core/frames.h);
// this layer only takes Python buffers in and hands bytearrays (or PoolFrames) out.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <tuple>

#include "core/arena.h"
#include "core/frame_pool.h"

namespace vllm_shm_arena {

/// A frame copied out into a warm buffer of the frame pool (frame_pool.h), read as a writable
/// buffer (tensors may alias it, keeping it alive); the buffer goes back to the pool with the
/// last reference. _C.PoolFrame.
class PoolFrame {
 public:
  PoolFrame(FrameBuffer* buf, size_t size) : buf_(buf), size_(size) {}
  /// A frame of `size` bytes in a buffer of the process pool (given back if the wrapper
  /// cannot be made). Any thread; no GIL needed.
  static std::shared_ptr<PoolFrame> take(size_t size) {
    FrameBuffer* buf = FramePool::process().take(size);
    try {
      return std::make_shared<PoolFrame>(buf, size);
    } catch (...) {
      FramePool::process().give_back(buf);
      throw;
    }
  }
  PoolFrame(const PoolFrame&) = delete;
  PoolFrame& operator=(const PoolFrame&) = delete;
  ~PoolFrame() { FramePool::process().give_back(buf_); }
  uint8_t* data() const { return buf_->data; }
  size_t size() const { return size_; }

 private:
  FrameBuffer* buf_;
  size_t size_;
};

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
