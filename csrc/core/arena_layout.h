// Shared-memory layout of the tensor arena and the state machine of its allocation slots.
//
//  offset 0            +---------------------------------------------------------------+
//                      | ArenaHeader (one 4 KiB page): magic, layout version, sizes,   |
//                      | offsets, policy parameters, writer identity                   |
//  readers_offset      +---------------------------------------------------------------+
//                      | ReaderEntry[n_readers], 64 B each: identity, state            |
//  slots_offset      +---------------------------------------------------------------+
//                      | SlotMeta[max_slots], 64 B each (written by the writer):   |
//                      |   offset, capacity, nbytes, published_gen                     |
//  releases_offset     +---------------------------------------------------------------+
//                      | reader 0: released_gen[max_slots]  (padded to 64 B)         |
//                      | reader 1: released_gen[max_slots]  (padded to 64 B)         |
//                      | ...      each reader writes only its own block: no false      |
//                      |          sharing between readers                              |
//                      | (counted arenas: CountEntry acked[max_slots] per reader)      |
//  forwards_offset     +---------------------------------------------------------------+
//                      | counted arenas only: CountEntry forwarded[max_slots], written |
//                      | by reader 0 (the holder); empty in accept-once arenas         |
//  data_offset (2 MiB) +---------------------------------------------------------------+
//                      | data: allocations handed out by the writer's policy           |
//                      | (fixed slots: slot i at i * slot_bytes)                       |
//                      +---------------------------------------------------------------+
//
// Slot states. Generations start at 1, stay below 2^44 (kGenerationLimit) and never repeat
// within an arena, so a flag left over from an earlier use can never be mistaken for a release
// of the current one. The writer counts them in its own memory: the header's next_generation
// is only a copy for a writer taking over, which continues above every generation the segment
// shows. Any generation read from shared memory outside [1, 2^44) is garbage and ignored.
//
//   FREE ──writer: claim, fill offset/capacity/nbytes, copy bytes──▶ FILLING
//   FILLING ──writer: published_gen.store(g, release)──▶ PUBLISHED(g)
//   FILLING ──writer: abort (stub never left the process)──▶ FREE
//   PUBLISHED(g) ──reader r: released_gen[r].store(g, release)──▶ (r done)
//   PUBLISHED(g) ──writer sees, for every reader r, released_gen[r] == g (acquire), or r
//                  DETACHED, or r DEAD──▶ FREE (published_gen.store(0))
//
// FREE and FILLING differ only in the writer's private bookkeeping: the writer is the only
// process that moves a slot out of FREE, so no other process needs to see the difference.
// A reader accepts a stub (slot, g) only while published_gen == g and its own
// released_gen != g. The writer cannot recycle the slot before this reader releases it (or
// is found dead), so a slot a live reader validated stays valid until that reader lets go.
//
// Reader states: NEVER_ATTACHED ─attach─▶ ATTACHED ─close─▶ DETACHED
//                                         ATTACHED ─writer finds the process dead─▶ DEAD
// A NEVER_ATTACHED reader still counts as holding every published slot: its messages may
// be queued for it already. DETACHED and DEAD readers hold nothing.
//
// Counted arenas (ArenaConfig::counted, the header's `counted` word). The accept-once rules
// above let each reader take a stub once. A counted arena is for a payload sent many times
// (a cached image: every request that uses it sends it again) and passed on by its first
// reader: reader 0 (the holder) is sent stubs by the writer and forwards them to readers
// 1..n-1. Counts, each tied to the slot's generation:
//   sent          writer-private: the stubs of (slot, g) the writer sent to reader 0
//                 (publish_loan counts one per call, unsend takes one back);
//   forwarded     CountEntry per slot, written by reader 0 only, while it holds (slot, g):
//                 the stubs it passed on (each worker is sent every one of them);
//   acked[r]      CountEntry per reader and slot, written by reader r only: the acquires of
//                 (slot, g) it let go of (a hold's acquires are acked together when its last
//                 view dies; a stub it failed to unpickle is acked unacquired).
// A reader may acquire (slot, g) any number of times while g is published. The writer frees
// the slot iff the writer's own view (a loan) is gone and
//   reader 0 lets go:   DETACHED or DEAD, or acked[0] == sent;
//   reader r >= 1:      DETACHED or DEAD, or acked[r] == forwarded (a NEVER_ATTACHED reader
//                       owes what was forwarded: its messages may be queued for it).
// Order: reader 0 stores a forward before its own ack (release), and the writer loads
// acked[0] (acquire) before forwarded, so once acked[0] == sent no forward is missed. A
// legitimate stub is always owed when its reader gets it (counted before it was sent), so
// the slot cannot be freed under an acquire of it. Ranks of a counted arena attach once (a
// replacement cannot know what its predecessor owed) and its writer cannot be taken over
// (the sent counts are private); both are refused.
//
// A CountEntry is a (generation, count) pair in two words, written by one process as a
// seqlock: a new generation stores gen = 0, then the count, then gen = g (release); a reader
// of it loads gen (acquire), the count, then gen again after an acquire fence, and uses the
// count only if both loads gave g. A count of the same generation only grows (acked, a
// forward) or shrinks by an unforward, stored with release.
//
// Liveness (core/liveness.h): each role holds an open-file-description lock on one byte of
// this segment's file, the writer byte 0, reader r byte 1 + r. The writer takes its lock
// before the segment gets its final name; a reader takes its own before it stores ATTACHED.
// "Found dead" means the kernel says that byte is unlocked; a probe the kernel does not answer
// is "unknown" and counts as alive. The pids stored below are for messages only: they mean
// nothing across pid namespaces and decide nothing.
//
// Untrusted input: every process that maps the segment can write all of it. Geometry is read
// and validated once, at create/attach, and kept in process-private memory (ArenaGeometry);
// a slot's offset/capacity/nbytes are read once per acquire into locals and checked there.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

namespace vllm_shm_arena {

constexpr uint64_t kArenaMagic = 0x414e455241415356ull;  // "VSAARENA" little-endian
// 2: liveness tokens replace pid identities; 3: counted arenas (the `counted` and
// `forwards_offset` header words).
constexpr uint32_t kArenaLayoutVersion = 3;
constexpr uint64_t kHeaderBytes = 4096;
constexpr uint64_t kCacheLine = 64;
constexpr uint64_t kDataAlign = 2ull << 20;  // 2 MiB: huge-page friendly where tmpfs has them.
constexpr uint64_t kAllocAlign = 4096;       // every allocation starts on a page.
constexpr uint32_t kMaxReaders = 1024;
constexpr uint32_t kMaxSlots = 1u << 20;
/// Generations stay below 2^44 (exclusive): a release token packs (generation << 20) | slot
/// into 64 bits. A writer that reaches it declines every allocation.
constexpr uint64_t kGenerationLimit = 1ull << 44;
static_assert(kMaxSlots <= (1u << 20) && kGenerationLimit <= (1ull << (64 - 20)),
              "a generation and a slot index must fit one 64-bit release token");

/// Whether a generation (a stub's, or one read from shared memory) can be a real one.
constexpr bool valid_generation(uint64_t g) { return g != 0 && g < kGenerationLimit; }

enum class PolicyKind : uint32_t { kFixedSlots = 1, kVariable = 2 };

enum class ReaderState : uint32_t { kNeverAttached = 0, kAttached = 1, kDetached = 2, kDead = 3 };

static_assert(std::atomic<uint64_t>::is_always_lock_free,
              "shared-memory protocol words must be lock-free to work across processes");
static_assert(std::atomic<uint32_t>::is_always_lock_free,
              "shared-memory protocol words must be lock-free to work across processes");
static_assert(sizeof(std::atomic<uint64_t>) == 8 && alignof(std::atomic<uint64_t>) == 8,
              "an atomic word must have the layout of the plain word other processes map");

/// Page 0 of the region. Written once by the creating writer before the name is shared,
/// except `writer_pid`, which a new writer stores when it takes over from a dead one.
struct ArenaHeader {
  uint64_t magic;
  uint32_t layout_version;
  uint32_t policy;  // PolicyKind
  uint64_t region_bytes;
  uint32_t n_readers;
  uint32_t max_slots;
  uint64_t readers_offset;
  uint64_t slots_offset;
  uint64_t releases_offset;
  uint64_t releases_stride;  // bytes between two readers' released_gen blocks
  uint64_t data_offset;
  uint64_t data_bytes;
  uint64_t slot_bytes;               // fixed-slot policy: bytes per slot (0 for other policies)
  std::atomic<uint64_t> writer_pid;  // pid of the writer (messages only; the token decides)
  // The writer's next generation, for a takeover only (the live writer never reads it).
  std::atomic<uint64_t> next_generation;
  uint32_t counted;          // 1: a counted arena (see above), 0: accept-once
  uint32_t reserved0;        // 0
  uint64_t forwards_offset;  // counted: CountEntry forwarded[max_slots]; accept-once: == data
};
static_assert(sizeof(ArenaHeader) <= kHeaderBytes, "the header must fit its 4 KiB page");

/// One reader's slot in the reader table; 64 B so readers attaching never share a line.
struct alignas(kCacheLine) ReaderEntry {
  std::atomic<uint64_t> pid;    // pid of the attached reader (messages only), 0 if none
  std::atomic<uint32_t> state;  // ReaderState
};
static_assert(sizeof(ReaderEntry) == kCacheLine, "one reader entry per cache line");

/// The validated shape of an arena: copied out of the header once (create or attach) into
/// process-private memory and never re-read, so a process that scribbles over the header later
/// cannot move another process's tables outside its mapping.
struct ArenaGeometry {
  PolicyKind policy = PolicyKind::kFixedSlots;
  uint64_t region_bytes = 0;
  uint32_t n_readers = 0;
  uint32_t max_slots = 0;
  uint64_t readers_offset = 0;
  uint64_t slots_offset = 0;
  uint64_t releases_offset = 0;
  uint64_t releases_stride = 0;
  uint64_t data_offset = 0;
  uint64_t data_bytes = 0;
  uint64_t slot_bytes = 0;
  bool counted = false;
  uint64_t forwards_offset = 0;
};

/// A (generation, count) pair, written by one process only as a seqlock (see above): a
/// counted arena's acked and forwarded counts.
struct CountEntry {
  std::atomic<uint64_t> generation;  // 0 while a new generation's count is being stored
  std::atomic<uint64_t> count;
};
static_assert(sizeof(CountEntry) == 16, "two words, no padding");

/// One allocation slot; only the writer stores to it.
struct alignas(kCacheLine) SlotMeta {
  uint64_t offset;                      // from the start of the region
  uint64_t capacity;                    // bytes reserved for this allocation
  uint64_t nbytes;                      // payload bytes written
  std::atomic<uint64_t> published_gen;  // 0 = not published
  uint64_t checksum;  // debug mode: payload_checksum() at publish, 0 = not computed
};
static_assert(sizeof(SlotMeta) == kCacheLine,
              "slots are a cache line each so the writer's stores don't share lines");

}  // namespace vllm_shm_arena
