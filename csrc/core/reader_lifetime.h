// How the holds a reader rank hands out end: the rules between a view of arena memory (a
// tensor the bindings build over it) dying and its slot going back to the writer, with
// page-locking and the DMA that may still read pinned memory after the view is gone.
//
//   acquire(slot, gen, nbytes, offset, dma)            the view's deleter, on any thread
//     ArenaReader::acquire: the slot is held  --->   freed(slot, gen, gated)
//     dma: pin the data region on first use              gated = false: ArenaReader::release
//     -> Hold{data, generation, gated}                   gated = true:  ReleaseGate::freed(token)
//                                                                          |
//   flush_releases(stream), on the thread that copies:  records one event on `stream` for
//     every token freed since the last flush; each token is released once its event completed
//
//   ~ReaderHolds, gated releases still pending:
//     the core reader (rank, mapping), the PinRegistry and the ReleaseGate move to
//     LingeringReaders, which every later flush_releases (of any reader) polls; an entry whose
//     gate is empty is finished: unregister first, then unmap and give up the rank.
//
// The pin decision, on the first acquire with `dma` (the caller's word that a CUDA context
// exists; the runtime calls below would otherwise create one):
//   - no CUDA runtime found (CudaRuntime::find): never pinned, for this reader's lifetime;
//   - the data region is backed first (ShmRegion::reserve): cudaHostRegister faults in every
//     page, a SIGBUS on a tmpfs too full to back them. If it cannot be backed the reader stays
//     unpinned for good (pin_no_space), which only makes the host-to-device copy pageable;
//   - otherwise a PinRegistry over the data region in chunks of pin_chunk_bytes() and a
//     ReleaseGate on the same runtime; each acquire then pins the chunks it touches.
// A range that is not fully pinned (a registration failed) is released at once: no DMA reads
// pageable memory after the host copy returned.
//
// Fork: a forked child inherits this object, not its role. In the child freed() and
// flush_releases() do nothing and the destructor leaks the parent's registrations and events:
// the child makes no CUDA call on its parent's behalf and releases none of its holds (the core
// reader ignores the child already, ArenaReader::foreign()).
//
// Release tokens: a gated release waits in the gate as one 64-bit token, the slot in the low
// kTokenSlotBits bits and the generation above them. Both are checked on the way in, so no bit
// is ever lost: a truncated generation would release nothing, and the slot would never come
// back to the writer.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "core/arena.h"
#include "core/arena_layout.h"
#include "core/pin_registry.h"
#include "core/release_gate.h"

namespace vllm_shm_arena {

/// Bits of a release token that hold the slot; the generation takes the rest.
constexpr unsigned kTokenSlotBits = 20;
/// Generations a release token can carry: below 2^(64 - kTokenSlotBits).
constexpr uint64_t kTokenGenerationLimit = uint64_t{1} << (64 - kTokenSlotBits);
static_assert(kMaxSlots <= (uint64_t{1} << kTokenSlotBits),
              "every slot index must fit the slot bits of a release token");
static_assert(kGenerationLimit <= kTokenGenerationLimit,
              "every generation the writer hands out must fit a release token");

/// The (slot, generation) a release token stands for.
struct ReleaseRef {
  uint32_t slot = 0;
  uint64_t generation = 0;
};

/// The release token of (slot, generation). Throws InvalidArgument when the slot is not below
/// 2^kTokenSlotBits or the generation not below kTokenGenerationLimit.
uint64_t encode_release_token(uint32_t slot, uint64_t generation);
/// The (slot, generation) encode_release_token packed into `token`.
ReleaseRef decode_release_token(uint64_t token);

/// Where a dropped reader waits while pinned memory it handed out may still be read by a DMA:
/// its rank stays attached and its memory mapped and registered until every gated release's
/// event has completed. Tokens freed after the reader's last flush have no event to wait on
/// and are never released: such an entry lasts until the process exits, and the writer takes
/// the memory back from the dead rank. Thread-safe.
class LingeringReaders {
 public:
  /// The process's registry, which every ReaderHolds uses unless given another. Never
  /// destroyed: unregistering memory while CUDA unloads at exit would crash.
  static LingeringReaders& process();

  LingeringReaders() = default;
  /// Finishes every entry at once (unregister, unmap, detach): only for a registry whose
  /// runtime outlives it, i.e. not the process's.
  ~LingeringReaders() = default;
  LingeringReaders(const LingeringReaders&) = delete;
  LingeringReaders& operator=(const LingeringReaders&) = delete;

  /// Keeps a dropped reader's `reader`, `pins` and `gate` until `gate` has nothing pending.
  void adopt(std::shared_ptr<ArenaReader> reader, std::unique_ptr<PinRegistry> pins,
             std::shared_ptr<ReleaseGate> gate);
  /// Releases what lingering readers may release now, the tokens whose recorded event
  /// completed (never records one), and finishes the entries left with nothing pending.
  /// Returns how many tokens were released.
  size_t poll();
  /// Readers lingering now.
  size_t size() const;

 private:
  struct Entry {
    std::shared_ptr<ArenaReader> reader;
    std::unique_ptr<PinRegistry> pins;  // declared after reader: destroyed (unregistered) first
    std::shared_ptr<ReleaseGate> gate;
  };
  mutable std::mutex mu_;
  std::vector<Entry> entries_;  // guarded by mu_
};

/// The pin decision's chunk size: `requested` (pin_chunk_bytes; 0 = the whole data region)
/// rounded up to whole slots for a fixed-slot layout, the whole data region for a
/// variable-size one (an allocation may lie anywhere, and one cudaMemcpyAsync cannot cross
/// the boundary between two registrations), or when `requested` covers the region anyway.
uint64_t pin_chunk_bytes(bool variable, uint64_t data_bytes, uint64_t slot_bytes,
                         uint64_t requested);

/// A reader's counters and pin state (the Python reader's stats()).
struct ReaderHoldsStats {
  size_t held = 0;                   ///< slots acquired and not yet released
  uint64_t checksum_mismatches = 0;  ///< debug mode: releases whose payload had changed
  uint64_t acked = 0;                ///< counted arenas: stubs acked so far
  size_t pinned_bytes = 0;           ///< bytes of the data region page-locked now
  bool pin_failed = false;           ///< a registration failed, or pin_no_space
  bool pin_no_space = false;         ///< the data region could not be backed for pinning
  uint64_t pin_registrations = 0;    ///< successful cudaHostRegister calls
  double pin_seconds = 0.0;          ///< time spent in cudaHostRegister
  size_t pending_releases = 0;       ///< gated releases freed, waiting for their event
};

/// One reader rank's holds and how each ends (see the drawing above). Thread-safe: holds are
/// freed on whatever thread drops the last view.
class ReaderHolds {
 public:
  /// Takes over `reader` (attached in this process). `pin_chunk_bytes`: see
  /// pin_chunk_bytes(). `lingering`: where this reader goes if dropped with gated releases
  /// pending (null: LingeringReaders::process()); it must outlive this object.
  ReaderHolds(std::shared_ptr<ArenaReader> reader, uint64_t pin_chunk_bytes,
              LingeringReaders* lingering = nullptr);
  /// Unregisters and lets the core reader go, or hands both to the lingering registry while
  /// gated releases are pending; in a forked child leaks the parent's CUDA objects instead.
  ~ReaderHolds();
  ReaderHolds(const ReaderHolds&) = delete;
  ReaderHolds& operator=(const ReaderHolds&) = delete;

  /// A held range and how its release must go.
  struct Hold {
    const uint8_t* data = nullptr;  ///< the range's first byte
    uint64_t generation = 0;        ///< the generation held (resolved when 0 was asked for)
    bool gated = false;             ///< pinned: the release waits for a DMA event
  };

  /// Holds [offset, offset + nbytes) of (slot, generation) for a view; generation 0 = the one
  /// published in `slot` now. With `dma` (a CUDA context exists) the range is pinned first,
  /// when the pin decision allows. Refused before anything is held: `slot` out of range
  /// (OutOfRange), `nbytes` or `offset` beyond one allocation, a (slot, generation) no release
  /// token can carry (InvalidArgument); then ArenaReader::acquire's checks. Every Hold needs
  /// one freed() with its slot, generation and gated. `stubs`: ArenaReader::acquire's (a
  /// counted arena's stubs this hold stands for).
  Hold acquire(uint32_t slot, uint64_t generation, uint64_t nbytes, uint64_t offset, bool dma,
               uint64_t stubs = 1);
  /// The last view of a Hold died: releases it now (`gated` false), or once the event a later
  /// flush_releases records has completed (`gated` true). Never calls CUDA, never throws;
  /// a no-op in a forked child (the hold is its parent's).
  void freed(uint32_t slot, uint64_t generation, bool gated) noexcept;
  /// Polls the lingering readers, then records an event on `stream` (a cudaStream_t, the one
  /// the copies ran on) for this reader's freed gated releases and releases those whose event
  /// completed. Returns how many of this reader's were released; 0 in a forked child.
  size_t flush_releases(void* stream);

  /// A snapshot of the counters.
  ReaderHoldsStats stats() const;
  /// Whether [offset, offset + len) of the region (from its base) is page-locked.
  bool is_pinned(uint64_t offset, uint64_t len) const;
  /// True in a process other than the one that built this object (a forked child).
  bool foreign() const;

  /// The core reader (for callers that copy out of an allocation and release it at once).
  ArenaReader& core() { return *reader_; }
  const ArenaReader& core() const { return *reader_; }

 private:
  // The pin decision (first call) and the pinning of [p, p + n); true when the range is
  // pinned, so that its release must wait for the DMA.
  bool pin(const uint8_t* p, uint64_t n);

  std::shared_ptr<ArenaReader> reader_;
  const uint64_t pin_chunk_bytes_;
  LingeringReaders* const lingering_;
  const pid_t owner_pid_;
  mutable std::mutex mu_;
  bool pin_decided_ = false;   // guarded by mu_: the pin decision was taken
  bool pin_no_space_ = false;  // guarded by mu_: the data region could not be backed
  // Set once, under mu_, by the pin decision; read by freed() without the lock, which is safe:
  // a gated Hold exists only after the write, and reaching its freed() orders it after.
  std::shared_ptr<ReleaseGate> gate_;
  std::unique_ptr<PinRegistry> pins_;  // declared after reader_: destroyed (unregistered) first
};

}  // namespace vllm_shm_arena
