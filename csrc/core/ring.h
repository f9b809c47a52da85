// An ordered single-writer / N-reader ring of fixed-size chunks in a caller-provided block of
// shared memory: the engine -> worker broadcast path of the message queue.
//
// Every reader reads every chunk, in publish order. The writer reuses a chunk only after every
// reader it still counts has released the chunk's previous message. The caller maps the block
// (shm_open + mmap, or mmap(MAP_SHARED | MAP_ANONYMOUS) before fork) and hands the same bytes to
// ring_init (once, in the writer) and to RingWriter / RingReader (in each process). The message
// queue's ring, which owns a segment of its own and frames every message, is built on this one
// in core/message_ring.h.
//
// Shared-memory layout (every box starts on a 64-byte cache line; N = max_chunks, R = n_readers)
//
//   base +0    RingHeader, 4 cache lines
//              line 0  layout   magic | layout_version | n_readers | max_chunks |
//                               max_chunk_bytes | total_bytes       (immutable after ring_init)
//              line 1  control  writer (pid, messages only) | shutdown | dropped_readers
//              line 2  data     data_word | data_waiters   readers sleep here, publish wakes
//              line 3  space    space_word | space_waiter  the writer sleeps here, release wakes
//   +256       ReaderSlot[R], one cache line each, written only by its reader (and the writer
//              when it drops a dead reader): read_seq | identity | state
//   +256+64R   ChunkSlot[N], one cache line each, written only by the writer: seq | nbytes | flags
//   +...       payload[N], each round_up(max_chunk_bytes, 64) bytes
//
// Messages are numbered 1, 2, 3, ... (64-bit, never reused). Message s lives in chunk
// (s - 1) % N. ChunkSlot::seq holds the number of the message last published into the chunk;
// ReaderSlot::read_seq holds the number of the message the reader released last. Numbers rather
// than boolean "written"/"read" flags mean a flag left over from the chunk's previous lap can
// never be mistaken for the current one.
//
// Per-chunk state machine, for chunk c and the message s = c + 1 + k * N it holds next
//
//                      writer: acquire()                 writer: publish()
//   FREE(seq = s - N) ------------------> WRITING(s) ------------------------> PUBLISHED(s)
//        ^           every counted reader  (seq still s - N,  stores nbytes,     (seq = s)
//        |           has read_seq >= s - N  readers of s wait) flags, then seq       |
//        |                                                                           |
//        +------------- every counted reader released s (read_seq >= s) -------------+
//                       (the chunk is FREE for message s + N: s advances by N per lap)
//
//   A reader whose next message is s waits until chunk c's seq == s; seq > s would mean the
//   writer overwrote a message this reader never released, which only happens to a reader the
//   writer dropped as dead.
//
// Reader slot states: FREE (never attached) -> ATTACHED -> DETACHED (clean ~RingReader) or DEAD
// (the writer found the process gone: its liveness token, core/liveness.h, is free; a probe the
// kernel does not answer counts as alive). The writer counts FREE and ATTACHED readers: a reader
// that has not attached yet is waited for (until the writer's timeout) so it cannot miss the
// first messages; DETACHED and DEAD readers are never counted again, and a rank cannot be
// re-attached.
//
// Why the store order matters: the writer stores nbytes and flags and the payload with plain
// stores and then publishes seq with a release store, so a reader that loads seq == s with
// acquire sees the whole message. A reader finishes reading and then stores read_seq with
// release, so a writer that sees read_seq >= s with acquire can overwrite the chunk without
// racing with that read. Sleeping uses the Dekker pattern on both sides (waiter: announce, load
// the futex word, re-check, sleep; waker: store, then look for announced waiters), all seq_cst,
// so no wake-up is lost and the common no-waiter path costs no syscall and no shared RMW.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "core/liveness.h"

namespace vllm_shm_arena {

/// Shape of a ring, fixed by ring_init.
struct RingConfig {
  uint32_t n_readers = 0;        ///< Reader ranks 0..n_readers-1; every one reads every chunk.
  uint32_t max_chunks = 0;       ///< Messages in flight before the writer waits for readers.
  uint64_t max_chunk_bytes = 0;  ///< Largest message that fits in one chunk.
};

/// A ring's first 12 bytes: this magic number, then the u32 layout version (what the
/// stale-segment cleaner recognises a ring by).
constexpr uint64_t kRingMagic = 0x474e49525f415356ull;  // "VSA_RING" in little-endian bytes.
constexpr uint32_t kRingLayoutVersion = 2;              // 2: liveness tokens replace pids

/// Flag bits the ring carries for the caller, uninterpreted (the queue's others are in
/// core/message_ring.h).
constexpr uint32_t kRingFlagOverflow = 1u << 0;  ///< The payload did not fit; it is on the socket.

/// Upper limits ring_bytes accepts, so the layout size cannot overflow.
constexpr uint32_t kRingMaxReaders = 4096;
constexpr uint32_t kRingMaxChunks = 1u << 20;
constexpr uint64_t kRingMaxChunkBytes = uint64_t{1} << 40;

/// Bytes a block must have to hold a ring of this shape. Throws InvalidArgument on a zero or
/// too-large field.
size_t ring_bytes(const RingConfig& config);

/// Bytes at the start of the block that hold the ring's tables (header, reader and chunk
/// slots): what a creator must back (fallocate) before ring_init touches it.
size_t ring_metadata_bytes(const RingConfig& config);

/// Lays out a fresh ring in [base, base + bytes): no writer, no reader attached, no message.
/// Call once, before any RingWriter / RingReader attaches. `base` must be 64-byte aligned.
void ring_init(void* base, size_t bytes, const RingConfig& config);

/// Checks that [base, base + bytes) holds a ring made by ring_init (magic, layout version,
/// sizes) and returns its shape. Throws InvalidArgument naming what does not match.
RingConfig ring_validate(const void* base, size_t bytes);

namespace detail {
struct RingHeader;
struct ReaderSlot;
struct ChunkSlot;
}  // namespace detail

/// The single writer of a ring. Not thread-safe: one thread drives it.
class RingWriter {
 public:
  /// Attaches to a ring and claims the writer role by its liveness token in `tokens` (or uses
  /// `token`, already taken by the caller, e.g. before the segment was named). Throws
  /// InvalidArgument if the block is not a ring, TokenHeld if another live process (or object)
  /// holds the role; takes over from a dead writer.
  RingWriter(void* base, size_t bytes, const TokenFile& tokens,
             std::unique_ptr<LivenessToken> token = nullptr);
  /// Gives the writer role back (does not shut the ring down). In a forked child, does nothing.
  ~RingWriter();
  RingWriter(const RingWriter&) = delete;
  RingWriter& operator=(const RingWriter&) = delete;

  /// Waits until the next chunk in order is free (released by every counted reader) and returns
  /// its payload, max_chunk_bytes long; nullptr after `timeout_ns` (< 0: no limit). Readers
  /// found dead while waiting are dropped for good. Throws InvalidArgument if a chunk is
  /// already acquired or the ring was shut down.
  uint8_t* acquire(int64_t timeout_ns);
  /// Makes the acquired chunk, `nbytes` long, visible to readers together with `flags`.
  void publish(uint64_t nbytes, uint32_t flags);
  /// Tells every reader no more messages come and wakes the blocked ones. Idempotent.
  void shutdown();

  /// Readers this ring has dropped as dead (by any writer, ever).
  uint32_t dropped_readers() const;
  /// Liveness probes of lagging readers the kernel did not answer (those readers were kept).
  uint64_t liveness_unknown() const { return liveness_unknown_; }
  /// Messages published so far (the sequence number of the last one).
  uint64_t published() const { return next_seq_ - 1; }
  const RingConfig& config() const { return config_; }

 private:
  bool all_released(uint64_t need) const;
  void drop_dead_readers(uint64_t need);

  RingConfig config_;
  detail::RingHeader* header_;
  detail::ReaderSlot* readers_;
  detail::ChunkSlot* chunks_;
  uint8_t* payload_;
  uint64_t stride_;
  TokenFile tokens_;
  std::unique_ptr<LivenessToken> token_;  // the writer role
  pid_t owner_pid_;
  uint64_t next_seq_ = 1;
  bool acquired_ = false;
  int64_t last_liveness_check_ns_ = 0;
  uint64_t liveness_unknown_ = 0;
};

/// How a RingReader's waits for a message ended (counts since it attached).
struct RingWaitStats {
  uint64_t ready = 0;    ///< the message was there at once
  uint64_t spun = 0;     ///< it came while the reader spun (pause, then sched_yield)
  uint64_t slept = 0;    ///< the reader slept on the futex at least once
  uint64_t spin_ns = 0;  ///< time spent spinning, all waits
  uint64_t ceded = 0;    ///< spins cut short: a sched_yield found another thread computing
};

/// One reader rank of a ring. Not thread-safe: one thread drives it.
///
/// Waiting: within kBusyWindowNs (50 ms) of its last message (messages are flowing) a reader
/// spins before it sleeps on the futex, since a futex wake-up (tens of microseconds on a VM)
/// is the largest cost of a small message; an idle queue sleeps at once. It spins with pause
/// where every reader and the writer can each have a CPU with one to spare (usable_cpus() >
/// readers + 1, the CPUs this process may use), else with sched_yield, which hands the CPU
/// to the writer or a busy reader whenever one is runnable (measured on 2 CPUs: TP=2 and 4
/// deliver a tensor-free message sooner than sleeping readers, benchmarks/bench_vs_vllm.py).
/// A reader that cedes its CPU (set_cede_cpu) also ends the spin and sleeps once a
/// sched_yield returns late (kCededYieldNs, 200 us: another thread computed on this CPU
/// meanwhile): the scheduler gives a spinner its share of a CPU whether it yields or not, so
/// spinning beside a computing thread (an engine core waiting out its workers' step on the
/// workers' CPUs) takes that share from the computation. Not the default: a sleeping reader
/// must be woken, and a woken thread tends to take its waker's CPU, so the writer pays for it
/// (measured: a broadcast writer's enqueue on a step that starts an image's encoder, on 2
/// CPUs, from 0.3 ms to about 1 ms); right for a queue whose writer waits once it has written
/// (a worker's replies to the engine core).
class RingReader {
 public:
  enum class Status { kOk, kTimeout, kShutdown, kWriterDead };

  /// Attaches as reader `rank`, taking the rank's liveness token in `tokens` for dead-reader
  /// detection. Throws OutOfRange for a bad rank, InvalidArgument if the block is not a ring
  /// or the rank is or was taken (ranks are never re-attached; TokenHeld while a live process
  /// holds it), ShmError if this process cannot take its token.
  RingReader(void* base, size_t bytes, uint32_t rank, const TokenFile& tokens);
  /// Detaches: the writer stops waiting for this rank. In a forked child, does nothing.
  ~RingReader();
  RingReader(const RingReader&) = delete;
  RingReader& operator=(const RingReader&) = delete;

  /// Waits for the next message in order, at most `timeout_ns` (< 0: no limit). On kOk the
  /// message stays valid until release(). After shutdown() the messages already published are
  /// still delivered, then kShutdown. While waiting, the writer's token is probed about every
  /// 100 ms: once a writer has attached and the kernel says it is gone, kWriterDead (messages
  /// it published are still delivered first). Throws ShmError if the writer dropped this
  /// reader or a chunk's length is corrupt.
  Status acquire(int64_t timeout_ns, const uint8_t** data, uint64_t* nbytes, uint32_t* flags);
  /// Hands the message from the last successful acquire back to the writer.
  void release();

  uint32_t rank() const { return rank_; }
  /// Messages released so far (the sequence number of the last one).
  uint64_t consumed() const { return last_seq_; }
  const RingConfig& config() const { return config_; }
  /// Whether the writer is alive: kDead only once a writer attached and its token is free.
  Liveness writer_liveness() const;
  const RingWaitStats& wait_stats() const { return wait_stats_; }
  /// Whether a spin ends as soon as another thread computes on this CPU (see the class
  /// comment). Off by default.
  void set_cede_cpu(bool cede) { cede_cpu_ = cede; }
  bool cede_cpu() const { return cede_cpu_; }

 private:
  [[noreturn]] void throw_overrun(uint64_t found) const;

  RingConfig config_;
  detail::RingHeader* header_;
  detail::ReaderSlot* slot_;
  detail::ChunkSlot* chunks_;
  const uint8_t* payload_;
  uint64_t stride_;
  TokenFile tokens_;
  std::unique_ptr<LivenessToken> token_;  // this rank
  pid_t owner_pid_;
  uint32_t rank_;
  bool spin_pause_;  // a CPU to spare for every reader and the writer: pause, not sched_yield
  bool cede_cpu_ = false;
  int64_t last_read_ns_ = 0;
  RingWaitStats wait_stats_;
  uint64_t last_seq_ = 0;
  bool acquired_ = false;
};

}  // namespace vllm_shm_arena
