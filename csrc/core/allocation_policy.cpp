#include "core/allocation_policy.h"

#include <algorithm>
#include <string>

#include "core/errors.h"

namespace vllm_shm_arena {

FixedSlotPolicy::FixedSlotPolicy(uint32_t num_slots, uint64_t slot_bytes, uint64_t data_offset)
    : slot_bytes_(slot_bytes), data_offset_(data_offset), in_stack_(num_slots, true) {
  // Slot 0 on top first: a fresh arena fills from the front.
  for (uint32_t i = num_slots; i-- > 0;) free_stack_.push_back(i);
}

std::optional<Placement> FixedSlotPolicy::place(uint64_t nbytes, DeclineReason* why) {
  if (nbytes > slot_bytes_) {
    *why = DeclineReason::kOversize;
    return std::nullopt;
  }
  if (free_stack_.empty()) {
    *why = DeclineReason::kNoFreeSlot;
    return std::nullopt;
  }
  uint32_t slot = free_stack_.back();
  free_stack_.pop_back();
  in_stack_[slot] = false;
  return Placement{slot, data_offset_ + uint64_t{slot} * slot_bytes_, slot_bytes_};
}

void FixedSlotPolicy::free(const Placement& p) {
  if (p.record >= in_stack_.size()) {
    throw OutOfRange("slot " + std::to_string(p.record) + " out of range [0, " +
                     std::to_string(in_stack_.size()) + ")");
  }
  if (in_stack_[p.record]) return;  // double free would corrupt the stack; ignore it
  in_stack_[p.record] = true;
  free_stack_.push_back(p.record);
}

void FixedSlotPolicy::mark_used(const Placement& p) {
  if (p.record >= in_stack_.size() || !in_stack_[p.record]) return;
  in_stack_[p.record] = false;
  free_stack_.erase(std::find(free_stack_.begin(), free_stack_.end(), p.record));
}

}  // namespace vllm_shm_arena
