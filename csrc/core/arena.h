// The tensor arena's single-writer / N-reader protocol over one shared-memory region.
//
// Roles are separate classes: ArenaWriter (exactly one live process per arena) hands out
// allocations and recycles them; ArenaReader (one per reader rank) validates the stubs it is
// sent and releases what it no longer uses. The layout and the state machine of a slot are
// drawn in arena_layout.h; where space comes from is AllocationPolicy's business.
//
// The writer never blocks: when nothing is free, an allocation is too big, or the shm
// filesystem is full, allocate() declines (and counts why) so the caller can take another
// path. A reader the kernel says is dead (its liveness token is free, core/liveness.h) is
// treated as having released everything it held; one whose liveness is unknown still holds.
//
// Fork: each end remembers the process that built it. In a forked child the inherited copies
// are inert: destructors and the implicit paths (a tensor's deleter releasing a slot, a loan
// ending) do nothing, so a child can never release its parent's holds, unlink its parent's
// name or act as a second writer; explicit calls raise InvalidArgument.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/allocation_policy.h"
#include "core/arena_layout.h"
#include "core/liveness.h"
#include "core/shm_region.h"

namespace vllm_shm_arena {

/// How to build a new arena.
struct ArenaConfig {
  PolicyKind policy = PolicyKind::kFixedSlots;  ///< fixed slots, or variable-size packing
  uint32_t n_readers = 1;                       ///< reader ranks 0..n_readers-1
  uint32_t num_slots = 8;                       ///< fixed-slot policy: number of slots
  uint64_t slot_bytes = 256ull << 20;  ///< fixed-slot policy: bytes per slot (rounded up to 4 KiB)
  uint64_t arena_bytes = 2ull << 30;   ///< variable policy: data region bytes (4 KiB multiple)
  uint32_t max_slots = 1024;           ///< variable policy: live allocations at most
  /// A counted arena (arena_layout.h): a payload is sent to reader 0 any number of times and
  /// forwarded by it to the other readers; accept-once (false) lets each reader take it once.
  bool counted = false;
  std::string dir = ShmRegion::default_dir();  ///< where the shm name lives
  std::string prefix = "vsa_";                 ///< name prefix, followed by 128 random bits
};

/// A fast non-cryptographic checksum of a payload, never 0 (debug mode's slot check).
uint64_t payload_checksum(const uint8_t* p, uint64_t n);

/// Bytes the whole region needs for `cfg` (header, tables and data).
uint64_t arena_region_bytes(const ArenaConfig& cfg);

/// Writer-side counters. Monotonic except `in_use`.
struct WriterStats {
  uint64_t hits = 0;   ///< allocations published
  uint64_t bytes = 0;  ///< payload bytes published
  std::array<uint64_t, static_cast<size_t>(DeclineReason::kCount)> declined{};
  uint64_t cold_copies = 0;  ///< allocations into pages never written before
  uint64_t warm_copies = 0;  ///< allocations into pages written before
  uint64_t cold_bytes = 0;
  uint64_t warm_bytes = 0;
  uint64_t reclaimed = 0;         ///< slots recycled after every reader let go
  uint64_t dead_readers = 0;      ///< readers found dead (their holdings were reclaimed)
  uint64_t liveness_unknown = 0;  ///< liveness probes the kernel did not answer (kept alive)
  uint64_t aborted = 0;           ///< allocations given back unpublished
  uint64_t loans = 0;             ///< allocations lent to the writer to fill in place
  uint64_t loans_sent = 0;        ///< loans published without a copy
  uint64_t loans_returned = 0;    ///< loans dropped unsent (space given back)
  uint64_t sends = 0;             ///< counted arenas: stubs sent to reader 0 (publish counts one)
  uint64_t unsends = 0;           ///< counted arenas: sends taken back (the send failed)
  uint32_t in_use = 0;            ///< slots currently published or being filled
  uint64_t free_bytes = 0;        ///< variable policy: bytes free now
  uint64_t largest_free = 0;      ///< variable policy: largest free extent now
};

/// Where a pointer range falls inside an allocation a reader holds (ArenaReader::find_hold).
struct HoldRef {
  uint32_t slot = 0;
  uint64_t generation = 0;
  uint64_t offset = 0;  ///< of the range within the allocation
  uint64_t nbytes = 0;  ///< payload bytes of the allocation
};

/// Where a pointer range falls inside a loaned allocation.
struct LoanRef {
  uint32_t slot = 0;
  uint64_t generation = 0;
  uint64_t offset = 0;  ///< of the range within the allocation
  bool published = false;
};

/// What one reader holds, as the writer sees it.
struct ReaderHolding {
  uint32_t rank = 0;
  ReaderState state = ReaderState::kNeverAttached;
  uint32_t slots_held = 0;        ///< published slots this reader has not released
  uint64_t owed = 0;              ///< counted arenas: acquires it owes an ack, over those slots
  double oldest_age_seconds = 0;  ///< age of the oldest of them (0 if none)
};

/// A claimed allocation the writer is filling (before publish) or has published.
struct Allocation {
  uint32_t slot = 0;
  uint64_t generation = 0;
  uint8_t* data = nullptr;  ///< where to write the payload (writer's mapping)
  uint64_t nbytes = 0;
  bool cold = false;  ///< the pages had never been written by this writer
};

/// This process's own reads of published allocations outside the arena protocol (a socket
/// sending an allocation's bytes by reference), counted per slot. Process-local memory, never
/// shared: it outlives the writer, since the last SendHold may end on another thread (ZeroMQ's
/// I/O thread) after the writer is gone.
struct SendHoldTable {
  explicit SendHoldTable(uint32_t n_slots) : counts(n_slots) {}
  /// Live SendHolds per slot. Incremented by ArenaWriter::hold_for_send under the writer's
  /// mutex, decremented by ~SendHold on any thread.
  std::vector<std::atomic<uint32_t>> counts;
};

/// The bytes of one published allocation, held for a send by reference: while a SendHold
/// lives, the writer does not recycle its slot (even once every reader released it), and the
/// mapping stays valid (even once the writer is gone). Made by ArenaWriter::hold_for_send.
class SendHold {
 public:
  SendHold(std::shared_ptr<SendHoldTable> table, std::shared_ptr<ShmRegion> region, uint32_t slot,
           const uint8_t* data, uint64_t nbytes)
      : table_(std::move(table)),
        region_(std::move(region)),
        slot_(slot),
        data_(data),
        nbytes_(nbytes) {}
  ~SendHold();
  SendHold(const SendHold&) = delete;
  SendHold& operator=(const SendHold&) = delete;

  const uint8_t* data() const { return data_; }
  uint64_t nbytes() const { return nbytes_; }
  uint32_t slot() const { return slot_; }

 private:
  std::shared_ptr<SendHoldTable> table_;
  std::shared_ptr<ShmRegion> region_;  // keeps the mapping while the bytes may be read
  uint32_t slot_;
  const uint8_t* data_;
  uint64_t nbytes_;
};

/// The single writer of an arena.
class ArenaWriter {
 public:
  /// Creates a new region sized for `cfg` after checking the shm directory has room.
  static std::unique_ptr<ArenaWriter> create(const ArenaConfig& cfg);
  /// Takes over an existing arena whose writer has died; its generations continue above every
  /// generation the segment shows (header, slots, release flags). Throws TokenHeld (an
  /// InvalidArgument) if the arena still has a live writer, InvalidArgument if no generation
  /// below 2^44 is left.
  static std::unique_ptr<ArenaWriter> attach(const std::string& name,
                                             const std::string& dir = ShmRegion::default_dir());
  /// Removes the shm name (if still there): the writer owns it. A writer that dies without
  /// running this leaves the name for ArenaWriter::attach to take over. In a forked child,
  /// does nothing.
  ~ArenaWriter();

  /// Claims space for `nbytes` (0 allowed), or declines (counted) with nullopt. Never blocks.
  /// Once the generations below 2^44 are used up every allocation declines (no_record).
  std::optional<Allocation> allocate(uint64_t nbytes);
  /// Makes a filled allocation visible to readers.
  void publish(const Allocation& a);
  /// Gives an unpublished — or published but never sent — allocation back at once. In a
  /// counted arena, a published allocation's last send is taken back (unsend) and, when
  /// none is left, given back as above. Only
  /// `slot` and `generation` of `a` are read; a stale pair is ignored, and giving one back twice
  /// is harmless (the second call finds nothing to undo).
  void abort(const Allocation& a);
  /// allocate + parallel copy of `src` + publish; nullopt when declined. `working_set`: the
  /// bytes this copy and those just before it (one message's) write, for the copy's choice of
  /// stores (parallel_copy); 0 means this copy alone.
  std::optional<Allocation> write(const void* src, uint64_t nbytes, uint64_t working_set = 0);
  /// Lends space for the caller to fill in place (no copy when it is sent). The allocation
  /// is held for the writer until end_loan(), even after readers released it, so the
  /// writer's view never aliases reused space.
  std::optional<Allocation> lend(uint64_t nbytes);
  /// The loan holding [p, p+n) entirely, if any.
  std::optional<LoanRef> find_loan(const void* p, uint64_t n) const;
  /// Publishes a loan for sending. False if it was already published (sent before): the
  /// caller must then send a copy, since readers may have released the first send. In a
  /// counted arena every call is one more send to reader 0 (always true).
  bool publish_loan(uint32_t slot, uint64_t generation);
  /// Counted arenas: takes back one send of published allocation (`slot`, `generation`)
  /// whose message did not go (reader 0 will never ack it). InvalidArgument on an
  /// accept-once arena, or when that allocation has no send to take back.
  void unsend(uint32_t slot, uint64_t generation);
  /// The writer's last view of a loan died: an unsent loan is freed, a sent one is left to
  /// its readers.
  void end_loan(uint32_t slot, uint64_t generation);
  /// Holds published allocation (`slot`, `generation`) for a send of its bytes by reference
  /// (the whole payload written, or the whole loan): see SendHold. InvalidArgument unless that
  /// allocation is published now. Any thread; several holds of one allocation may coexist.
  std::shared_ptr<SendHold> hold_for_send(uint32_t slot, uint64_t generation);
  /// Debug mode: checksum every payload at publish so readers can verify it at release
  /// (catches in-place writes by a reader, which the others would see).
  void set_debug_checksum(bool on) { debug_checksum_ = on; }
  /// Counts a decline decided above the core (too small, not contiguous, unsupported type).
  void count_decline(DeclineReason why);
  /// Recycles slots every reader let go of. With `check_liveness`, readers that block a
  /// slot are checked for death first. Returns the number recycled.
  size_t reclaim(bool check_liveness);

  /// A snapshot of the counters.
  WriterStats stats() const;
  /// Per reader: state, slots held and the age of the oldest.
  std::vector<ReaderHolding> holdings() const;
  /// Reader `rank`'s state now (OutOfRange past n_readers); one load, no walk of the slots.
  ReaderState reader_state(uint32_t rank) const;
  /// The largest payload one allocation can hold.
  uint64_t max_allocation() const;

  const std::string& name() const { return region_->name(); }
  uint32_t n_readers() const { return geo_.n_readers; }
  uint32_t max_slots() const { return geo_.max_slots; }
  bool counted() const { return geo_.counted; }
  const ArenaGeometry& geometry() const { return geo_; }
  const std::shared_ptr<ShmRegion>& region() const { return region_; }
  /// Removes the shm name (mappings stay valid); readers can no longer attach. A no-op in a
  /// forked child (the name is its parent's).
  void unlink();
  /// True in a process other than the one that built this writer (a forked child).
  bool foreign() const;

 private:
  ArenaWriter(std::shared_ptr<ShmRegion> region, const ArenaGeometry& geo,
              std::unique_ptr<LivenessToken> token);
  ArenaHeader* header() const { return reinterpret_cast<ArenaHeader*>(region_->data()); }
  void require_owner(const char* what) const;
  size_t reclaim_locked(bool check_liveness);
  std::optional<Allocation> allocate_locked(uint64_t nbytes);
  bool reserve_blocks(uint64_t offset, uint64_t len, bool* cold);
  void free_locked(uint32_t slot);
  /// Slot `slot`'s generation is no longer published (its stub never left this process).
  void unpublish_locked(uint32_t slot);
  /// An allocation no reader was ever told of: freed now, or, while send holds still read
  /// it, unpublished now and freed by reclaim once they end (abandoned_).
  void give_back_locked(uint32_t slot);
  /// Whether reader `rank` no longer holds (`slot`, `gen`): detached, dead (checked when
  /// `check_liveness`), or done with it. Accept-once: released it; counted: acked `owed`
  /// acquires (nullopt: the count it owes cannot be read now, so it holds).
  bool reader_lets_go(uint32_t rank, uint32_t slot, uint64_t gen, std::optional<uint64_t> owed,
                      bool check_liveness);
  /// Whether reader `rank` is done with (`slot`, `gen`), from its own entry alone.
  bool reader_done(uint32_t rank, uint32_t slot, uint64_t gen, std::optional<uint64_t> owed) const;
  /// Counted arenas: the acquires reader `rank` owes for `slot` (reader 0: what was sent;
  /// the others: what reader 0 forwarded), nullopt when the forwarded count is mid-update.
  std::optional<uint64_t> owed_by(uint32_t rank, uint32_t slot) const;
  /// Counted arenas: the stubs of (`slot`, `gen`) reader `rank` acked (nullopt: mid-update).
  std::optional<uint64_t> acked_by(uint32_t rank, uint32_t slot, uint64_t gen) const;
  /// Counted arenas: one send of `slot` taken back (sent_ and the counters; `slot` has one).
  void take_back_send_locked(uint32_t slot);

  std::shared_ptr<ShmRegion> region_;
  ArenaGeometry geo_;  // validated once; never re-read from shared memory
  std::unique_ptr<AllocationPolicy> policy_;
  std::unique_ptr<LivenessToken> token_;  // the writer role, held while this object lives
  pid_t owner_pid_;
  mutable std::mutex mu_;  // one writer process, but Python may call it from several threads
  // Writer-private bookkeeping, indexed by slot.
  std::vector<Placement> placement_;
  std::vector<Allocation> live_;  // the allocation handed out for each slot
  std::vector<uint64_t> gen_;     // generation of the live allocation, 0 = free
  std::vector<bool> published_;
  std::vector<std::chrono::steady_clock::time_point> published_at_;
  std::vector<bool> loan_hold_;  // a writer-side view of a loan is alive
  std::vector<uint64_t> sent_;   // counted arenas: sends of the live allocation to reader 0
  // Aborted while send holds were alive: freed by reclaim once they end, whatever readers do
  // (none was ever sent this allocation).
  std::vector<bool> abandoned_;
  std::shared_ptr<SendHoldTable> send_holds_;
  std::vector<bool> reserved_;  // per 2 MiB block of data: fallocated (warm after a write)
  std::map<uint64_t, uint32_t> loans_by_offset_;  // live loans: offset -> slot
  std::vector<uint32_t> in_use_;                  // slots with gen_ != 0
  std::vector<std::chrono::steady_clock::time_point> last_liveness_check_;
  WriterStats stats_;
  bool debug_checksum_ = false;
  // The next generation to hand out: private, so shared memory can never make one repeat.
  // The header's next_generation is a copy for a writer taking over (read once, validated).
  uint64_t next_generation_ = 1;
};

/// One reader rank of an arena. Thread-safe: tensors may be freed on any thread.
class ArenaReader {
 public:
  /// Attaches to `name` as reader `rank`. Validates the header (a garbage, truncated or
  /// foreign segment is rejected), takes the rank's liveness token and refuses a rank another
  /// live process (or object) holds, or a token this process cannot take.
  /// `check`, if given, sees the validated geometry before the rank is claimed and may throw
  /// (a handle that names another arena must fail without touching the rank).
  static std::shared_ptr<ArenaReader> attach(
      const std::string& name, uint32_t rank, const std::string& dir = ShmRegion::default_dir(),
      const std::function<void(const ArenaGeometry&)>& check = {});
  ~ArenaReader();

  /// Validates a stub and pins the slot for this reader: slot in range, generation
  /// published, not yet released by this reader, [offset, offset+nbytes) inside what was
  /// written. Returns the address of that range. Every acquire needs one release.
  /// Counted arenas: `stubs` is how many stubs this reader was sent that the acquire stands
  /// for (acked together when the hold ends): 1 for a stub resolved on its own, 0 for one
  /// more view under a hold that counted the stub already (InvalidArgument without one).
  /// Accept-once arenas ignore it.
  const uint8_t* acquire(uint32_t slot, uint64_t generation, uint64_t nbytes, uint64_t offset = 0,
                         uint64_t stubs = 1);
  /// Drops one acquire; the last one tells the writer this reader is done with the slot.
  /// A no-op in a forked child: the hold is its parent's.
  void release(uint32_t slot, uint64_t generation);
  /// Releases a slot this reader was sent but never acquired (a message it failed to
  /// unpickle). A no-op if it is already released or was recycled (stale generation). In a
  /// counted arena, acks that one stub (whatever this reader holds of the slot).
  void release_unacquired(uint32_t slot, uint64_t generation);
  /// Counted arenas, reader 0 only, while it holds (`slot`, `generation`): one more stub of
  /// it passed on to the other readers (each owes one more ack). InvalidArgument otherwise.
  void forward(uint32_t slot, uint64_t generation);
  /// Takes back one forward whose message did not go; the same conditions as forward, and
  /// InvalidArgument when nothing was forwarded.
  void unforward(uint32_t slot, uint64_t generation);
  /// The allocation this reader holds that contains [p, p+n) entirely, if any.
  std::optional<HoldRef> find_hold(const void* p, uint64_t n) const;
  /// The generation currently published in `slot` (0 if none).
  uint64_t published_generation(uint32_t slot) const;
  /// Reader `rank`'s state now, as the writer's reader_state sees it (OutOfRange past
  /// n_readers): reader 0 of a counted arena forwards only to ranks that are attached.
  ReaderState reader_state(uint32_t rank) const;
  /// Marks this rank detached: the writer stops waiting for it. Called by the destructor. A
  /// no-op in a forked child.
  void detach();
  /// Whether the arena's writer is alive (its token held), dead, or unknown.
  Liveness writer_liveness() const;
  /// True in a process other than the one that attached (a forked child).
  bool foreign() const;

  uint32_t rank() const { return rank_; }
  bool counted() const { return geo_.counted; }
  uint32_t max_slots() const { return geo_.max_slots; }
  uint64_t max_allocation() const;
  /// Start (from the region's base) and size of the data region.
  uint64_t data_offset() const { return geo_.data_offset; }
  uint64_t data_bytes() const { return geo_.data_bytes; }
  /// True for a variable-size arena (any allocation may span the whole data region).
  bool variable() const { return geo_.policy == PolicyKind::kVariable; }
  const ArenaGeometry& geometry() const { return geo_; }
  const std::string& name() const { return region_->name(); }
  const std::shared_ptr<ShmRegion>& region() const { return region_; }
  /// Slots this reader currently holds (acquired and not yet released).
  size_t held() const;
  /// Debug mode: releases whose payload no longer matched the writer's checksum.
  uint64_t checksum_mismatches() const { return mismatches_.load(std::memory_order_relaxed); }
  /// Counted arenas: the stubs this reader acked so far (holds that ended, stubs released
  /// unacquired), whatever became of the slots since.
  uint64_t acked() const { return acked_.load(std::memory_order_relaxed); }

 private:
  ArenaReader(std::shared_ptr<ShmRegion> region, const ArenaGeometry& geo, uint32_t rank,
              std::unique_ptr<LivenessToken> token);
  ArenaHeader* header() const { return reinterpret_cast<ArenaHeader*>(region_->data()); }

  std::shared_ptr<ShmRegion> region_;
  ArenaGeometry geo_;  // validated once; never re-read from shared memory
  uint32_t rank_;
  std::unique_ptr<LivenessToken> token_;  // this rank, held until detach
  pid_t owner_pid_;
  bool detached_ = false;
  mutable std::mutex mu_;
  // A held slot keeps the copy of its metadata taken (and validated) at its first acquire.
  struct Hold {
    uint64_t generation;
    uint32_t count;     // acquires not yet released
    uint64_t offset;    // of the allocation, from the region's base
    uint64_t nbytes;    // payload bytes written
    uint64_t checksum;  // debug mode's checksum at publish, 0 = none
    uint64_t stubs;     // counted arenas: stubs its acquires stood for (acked together)
  };
  /// Checks (under mu_) that this is reader 0 of a counted arena holding (slot, generation).
  void require_forwarder(const char* what, uint32_t slot, uint64_t generation) const;
  std::unordered_map<uint32_t, Hold> holds_;
  std::map<uint64_t, uint32_t> holds_by_offset_;  // held allocations: offset -> slot
  std::atomic<uint64_t> mismatches_{0};           // process-local counter, not shared memory
  std::atomic<uint64_t> acked_{0};                // process-local counter, not shared memory
};

}  // namespace vllm_shm_arena
