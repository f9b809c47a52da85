// Where the writer places an allocation inside the arena's data region.
//
// The protocol (arena.h) only needs "a slot index, an offset and a capacity" for each
// allocation and "this one is free again" when readers let go; how space is found is this
// interface's business. FixedSlotPolicy is vLLM's own arena's layout (8 x 256 MiB); other
// policies (variable-size packing) plug in without touching the protocol or the layers above.
// Policies live in the writer process only and are not thread-safe: the arena has one writer.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <utility>
#include <vector>

namespace vllm_shm_arena {

/// Why the writer declined an allocation. Values index WriterStats::declined.
enum class DeclineReason : uint32_t {
  kTooSmall = 0,       ///< below the divert threshold (decided above the core)
  kNotContiguous = 1,  ///< not a dense strided buffer (decided above the core)
  kOversize = 2,       ///< larger than the policy's largest allocation
  kNoFreeSlot = 3,     ///< nothing free right now
  kNoSpace = 4,        ///< fallocate found the shm filesystem full
  kUnsupported = 5,    ///< a type the arena can't carry (conj/neg bits, quantized...)
  kSlotTableFull = 6,  ///< every slot of the table is in use (its stats key is "no_record")
  kCount = 7,
};

/// Each reason's name, in enum order: the keys of the writer's stats()["declined"], the
/// `reason` label of the declined metric, and Python's _C.DECLINE_REASONS.
inline constexpr std::array<const char*, static_cast<size_t>(DeclineReason::kCount)>
    kDeclineReasonNames = {"too_small", "not_contiguous", "oversize", "no_free_slot",
                           "no_space",  "unsupported",    "no_record"};
static_assert(kDeclineReasonNames.back() != nullptr,
              "every decline reason needs a name (a missing one would be a null stats() key)");

/// The name of `why` (kDeclineReasonNames); "unknown" for a value outside the enum.
const char* decline_reason_name(DeclineReason why);

/// A placed allocation: slot index, byte offset from the start of the region, capacity.
struct Placement {
  uint32_t slot = 0;
  uint64_t offset = 0;
  uint64_t capacity = 0;
};

/// Finds and frees space in the data region.
class AllocationPolicy {
 public:
  virtual ~AllocationPolicy() = default;
  /// Finds room for `nbytes`; on failure returns nullopt and sets `*why`.
  virtual std::optional<Placement> place(uint64_t nbytes, DeclineReason* why) = 0;
  /// Returns a placement to the free pool (after readers released it, or on abort).
  virtual void free(const Placement& p) = 0;
  /// The largest allocation place() can ever satisfy.
  virtual uint64_t max_allocation() const = 0;
  /// Marks a slot as in use (a writer taking over an arena rebuilds its state this way).
  /// False, and nothing changed, if `p` is not a free placement of this policy (the
  /// metadata it came from is inconsistent).
  virtual bool mark_used(const Placement& p) = 0;
};

/// N equal slots; slot i owns the i-th slot_bytes of the data region. Free slots are reused
/// most-recently-freed first, so the writer copies into pages that are already faulted in (and warm
/// in cache) instead of cycling through the whole region.
class FixedSlotPolicy : public AllocationPolicy {
 public:
  /// `data_offset` is where slot 0 starts in the region.
  FixedSlotPolicy(uint32_t num_slots, uint64_t slot_bytes, uint64_t data_offset);
  std::optional<Placement> place(uint64_t nbytes, DeclineReason* why) override;
  void free(const Placement& p) override;
  uint64_t max_allocation() const override { return slot_bytes_; }
  bool mark_used(const Placement& p) override;

 private:
  uint64_t slot_bytes_;
  uint64_t data_offset_;
  std::vector<uint32_t> free_stack_;  // top = most recently freed
  std::vector<bool> in_stack_;
};

}  // namespace vllm_shm_arena

namespace vllm_shm_arena {

/// Any size from 1 byte up to the whole data region, packed best-fit into free extents.
///
/// Free space is a set of extents kept two ways: by offset (to coalesce a freed extent with
/// its neighbours, so space released in any order comes back whole) and by (size, offset)
/// (to find the smallest extent that fits, which keeps large extents intact for large
/// tensors). Allocations are rounded up to 4 KiB. Slots are a fixed pool of `max_slots`;
/// when all are in use, place() declines with kSlotTableFull even if bytes are free.
class VariablePolicy : public AllocationPolicy {
 public:
  VariablePolicy(uint32_t max_slots, uint64_t data_offset, uint64_t data_bytes);
  std::optional<Placement> place(uint64_t nbytes, DeclineReason* why) override;
  void free(const Placement& p) override;
  uint64_t max_allocation() const override { return data_bytes_; }
  bool mark_used(const Placement& p) override;
  /// Bytes currently free, and the largest single extent (fragmentation = 1 - largest/free).
  uint64_t free_bytes() const { return free_bytes_; }
  uint64_t largest_free_extent() const;

 private:
  void insert_extent(uint64_t off, uint64_t len);
  void erase_extent(std::map<uint64_t, uint64_t>::iterator it);

  uint64_t data_offset_;
  uint64_t data_bytes_;
  uint64_t free_bytes_ = 0;
  std::map<uint64_t, uint64_t> by_offset_;           // offset -> length
  std::set<std::pair<uint64_t, uint64_t>> by_size_;  // (length, offset)
  std::vector<uint32_t> free_slots_;                 // top = most recently freed
  std::vector<bool> slot_free_;
};

}  // namespace vllm_shm_arena
