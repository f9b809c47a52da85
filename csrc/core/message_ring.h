// The message queue's ring in a shared-memory segment of its own: the ring protocol of
// core/ring.h (which runs over any caller-provided block) with the segment around it, and every
// message framed by core/frames.h.
//
// Roles are separate classes, like the arena's: MessageRingWriter::create makes the segment and
// is its one writer; MessageRingReader::attach maps it by name as one reader rank.
//
// Creation (the writer's process)                        Attaching (each reader)
//
//   ShmRegion::create("vsa_ring_", dir), under a temporary name:
//     1. take the writer's LivenessToken                ShmRegion::attach(name, dir)
//     2. reserve (fallocate) the tables: header,        ring_validate: the geometry is
//        reader and chunk slots                           copied and checked once
//     3. ring_init                                      RingReader: rank r's token
//   rename to the final name: nobody finds a ring
//   whose writer is not provably alive, and no process
//   ever stores into an unbacked page of the tables
//   (SIGBUS on a full tmpfs); RingWriter with the token
//
// One message, writer side:
//
//   reserve(t)   optional: wait up to t for the next chunk and hold it (the queue takes the
//                ring's back-pressure before it commits anything of a message elsewhere)
//   write(frames, flags, t)
//                size = framed_size(frames); over max_chunk_bytes: InvalidArgument
//                the held chunk, else wait up to t for the next one    (none: kTimeout)
//                back the chunk's first `size` bytes, once per chunk and high-water size:
//                  ENOSPC: publish an empty marker, kRingFlagOverflow | kRingFlagNoSpace,
//                          and return kNoSpace: the caller sends the message on its socket
//                pack_frames into the chunk, publish(size, flags)                     (kOk)
//   write_marker(flags, t)
//                an empty chunk carrying only flags (the message travels elsewhere)
//
// Reader side: acquire(t) waits for the next message and parses its framing (a corrupt one is
// released and refused with InvalidArgument); the spans stay valid until release().
//
// Fork: the writer records the process that created it. In a forked child its inherited copy
// is inert: the destructor and unlink() leave the parent's name alone, and reserve, write,
// write_marker and shutdown throw InvalidArgument (a child cannot write into its parent's
// queue). The ring's RingWriter and RingReader and the liveness tokens follow the same rule.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/frames.h"
#include "core/liveness.h"
#include "core/ring.h"
#include "core/shm_region.h"

namespace vllm_shm_arena {

/// With kRingFlagOverflow: set by MessageRingWriter::write on the marker it publishes when the
/// shm filesystem could not back the chunk (the message goes on the socket).
constexpr uint32_t kRingFlagNoSpace = 1u << 1;
/// With kRingFlagOverflow: the marker's frames name an arena blob holding the message (set by
/// the queue, not by the ring).
constexpr uint32_t kRingFlagBlob = 1u << 2;
static_assert((kRingFlagOverflow & kRingFlagNoSpace) == 0 &&
                  ((kRingFlagOverflow | kRingFlagNoSpace) & kRingFlagBlob) == 0,
              "each flag is one bit of its own: readers test them one by one");

/// What MessageRingWriter::write did with a message.
enum class RingWriteStatus {
  kOk,       ///< packed into a chunk and published
  kTimeout,  ///< no chunk came free in time; nothing was published
  kNoSpace,  ///< the chunk could not be backed: a no-space marker was published instead
};

/// Counters of one ring writer.
struct MessageRingWriterStats {
  uint64_t published = 0;         ///< chunks published (messages and markers)
  uint32_t dropped_readers = 0;   ///< readers the ring dropped as dead (by any writer, ever)
  uint64_t liveness_unknown = 0;  ///< probes of lagging readers the kernel did not answer
  uint64_t no_space = 0;          ///< writes that became no-space markers
};

/// The single writer of a message ring, owning its segment. Not thread-safe: one thread (or
/// callers serialised by a lock) drives it.
class MessageRingWriter {
 public:
  /// Creates a ring of `max_chunks` chunks of `max_chunk_bytes` for `n_readers` readers in a
  /// new segment in `dir`. Throws InvalidArgument for a bad shape (ring_bytes), ShmError when
  /// the segment or its tables cannot be made (a full filesystem says how to make room).
  static std::unique_ptr<MessageRingWriter> create(
      uint32_t n_readers, uint32_t max_chunks, uint64_t max_chunk_bytes,
      const std::string& dir = ShmRegion::default_dir());
  /// Removes the ring's name if nobody did yet: the writer owns it. Never in a forked child.
  ~MessageRingWriter();
  MessageRingWriter(const MessageRingWriter&) = delete;
  MessageRingWriter& operator=(const MessageRingWriter&) = delete;

  /// Waits up to `timeout_ns` (< 0: no limit) for the next chunk to be free and holds it for
  /// the next write or write_marker, which then never waits. True once a chunk is held (also
  /// when one already was), false on timeout.
  bool reserve(int64_t timeout_ns);
  /// Whether reserve() holds a chunk that no write has used yet.
  bool holds_reserved_chunk() const { return reserved_chunk_ != nullptr; }
  /// Packs `frames` into the next chunk (the reserved one, or one waited for up to
  /// `timeout_ns`) and publishes it with `flags`; see the drawing above. Throws
  /// InvalidArgument when the framed message is larger than a chunk (nothing is published and
  /// a reserved chunk stays reserved). `frames` must stay readable until this returns.
  RingWriteStatus write(const FrameSpans& frames, uint32_t flags, int64_t timeout_ns);
  /// Publishes an empty chunk carrying only `flags`; false on timeout.
  bool write_marker(uint32_t flags, int64_t timeout_ns);
  /// Tells every reader no more messages come and wakes the blocked ones. Idempotent.
  void shutdown();
  /// Removes the ring's name (mappings stay valid; readers can no longer attach). A no-op in a
  /// forked child.
  void unlink();

  /// Throws InvalidArgument in a process other than the creator's (a forked child), naming
  /// `what` (the Python-visible call, e.g. "write") and the owner's pid.
  void require_owner(const char* what) const;
  /// True in a process other than the one that created this writer (a forked child).
  bool foreign() const;

  MessageRingWriterStats stats() const;
  const RingConfig& config() const { return writer_->config(); }
  const std::string& name() const { return region_->name(); }
  const std::string& dir() const { return region_->dir(); }
  const std::shared_ptr<ShmRegion>& region() const { return region_; }

 private:
  MessageRingWriter(std::shared_ptr<ShmRegion> region, std::unique_ptr<LivenessToken> token);
  /// The reserved chunk, or one acquired within `timeout_ns`; nullptr on timeout.
  uint8_t* take_chunk(int64_t timeout_ns);
  /// Backs the first `nbytes` of the chunk at `chunk` for the next message; false on ENOSPC.
  bool back_chunk(uint8_t* chunk, uint64_t nbytes);

  pid_t owner_pid_;
  std::shared_ptr<ShmRegion> region_;
  std::unique_ptr<RingWriter> writer_;  // declared after region_: gives the role back first
  uint8_t* reserved_chunk_ = nullptr;   // acquired by reserve(), not yet published
  std::vector<uint64_t> backed_;        // bytes of each chunk already backed by fallocate
  uint64_t no_space_ = 0;
};

/// One message as a reader acquired it.
struct RingMessage {
  RingReader::Status status = RingReader::Status::kTimeout;
  uint32_t flags = 0;  ///< kOk only
  FrameSpans frames;   ///< kOk only: spans into the chunk, valid until release()
};

/// One reader rank of a message ring. Not thread-safe: one thread drives it.
class MessageRingReader {
 public:
  /// Maps ring `name` in `dir`, validates it and attaches as reader `rank`. Throws ShmError if
  /// there is no such segment, InvalidArgument if it is not a ring or the rank is taken,
  /// OutOfRange for a rank outside the ring.
  static std::unique_ptr<MessageRingReader> attach(
      const std::string& name, uint32_t rank, const std::string& dir = ShmRegion::default_dir());
  MessageRingReader(const MessageRingReader&) = delete;
  MessageRingReader& operator=(const MessageRingReader&) = delete;

  /// Waits up to `timeout_ns` (< 0: no limit) for the next message. On kOk the chunk is held
  /// until release() and the frames are parsed (parse_frames); a corrupt framing releases the
  /// chunk and throws InvalidArgument. Otherwise kTimeout, kShutdown (after every published
  /// message was read) or kWriterDead (likewise, once the writer's process is gone).
  RingMessage acquire(int64_t timeout_ns);
  /// Hands the message of the last kOk acquire back to the writer.
  void release();

  uint32_t rank() const { return reader_->rank(); }
  /// Messages released so far.
  uint64_t consumed() const { return reader_->consumed(); }
  const RingWaitStats& wait_stats() const { return reader_->wait_stats(); }
  /// RingReader::set_cede_cpu.
  void set_cede_cpu(bool cede) { reader_->set_cede_cpu(cede); }
  bool cede_cpu() const { return reader_->cede_cpu(); }
  const RingConfig& config() const { return reader_->config(); }
  /// Whether the ring's writer is alive: kDead only once a writer attached and its token is
  /// free.
  Liveness writer_liveness() const { return reader_->writer_liveness(); }

 private:
  MessageRingReader(std::shared_ptr<ShmRegion> region, uint32_t rank);

  std::shared_ptr<ShmRegion> region_;
  std::unique_ptr<RingReader> reader_;  // declared after region_: detaches before the unmap
};

}  // namespace vllm_shm_arena
