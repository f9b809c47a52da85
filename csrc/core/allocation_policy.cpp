#include "core/allocation_policy.h"

#include <algorithm>
#include <string>

#include "core/errors.h"

namespace vllm_shm_arena {

const char* decline_reason_name(DeclineReason why) {
  const auto i = static_cast<size_t>(why);
  return i < kDeclineReasonNames.size() ? kDeclineReasonNames[i] : "unknown";
}

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
  if (p.slot >= in_stack_.size()) {
    throw OutOfRange("slot " + std::to_string(p.slot) + " out of range [0, " +
                     std::to_string(in_stack_.size()) + ")");
  }
  if (in_stack_[p.slot]) return;  // double free would corrupt the stack; ignore it
  in_stack_[p.slot] = true;
  free_stack_.push_back(p.slot);
}

bool FixedSlotPolicy::mark_used(const Placement& p) {
  if (p.slot >= in_stack_.size() || !in_stack_[p.slot]) return false;
  if (p.offset != data_offset_ + uint64_t{p.slot} * slot_bytes_ || p.capacity != slot_bytes_) {
    return false;
  }
  in_stack_[p.slot] = false;
  free_stack_.erase(std::find(free_stack_.begin(), free_stack_.end(), p.slot));
  return true;
}

}  // namespace vllm_shm_arena

namespace vllm_shm_arena {

namespace {
constexpr uint64_t kPage = 4096;
uint64_t round_page(uint64_t n) { return n == 0 ? kPage : (n + kPage - 1) / kPage * kPage; }
}  // namespace

VariablePolicy::VariablePolicy(uint32_t max_slots, uint64_t data_offset, uint64_t data_bytes)
    : data_offset_(data_offset), data_bytes_(data_bytes), slot_free_(max_slots, true) {
  for (uint32_t i = max_slots; i-- > 0;) free_slots_.push_back(i);
  insert_extent(data_offset, data_bytes);
}

void VariablePolicy::insert_extent(uint64_t off, uint64_t len) {
  if (len == 0) return;
  // Coalesce with the extent ending at `off` and the one starting at `off + len`.
  auto next = by_offset_.lower_bound(off);
  if (next != by_offset_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == off) {
      off = prev->first;
      len += prev->second;
      erase_extent(prev);
    }
  }
  next = by_offset_.find(off + len);
  if (next != by_offset_.end()) {
    len += next->second;
    erase_extent(next);
  }
  by_offset_.emplace(off, len);
  by_size_.emplace(len, off);
  free_bytes_ += len;
}

void VariablePolicy::erase_extent(std::map<uint64_t, uint64_t>::iterator it) {
  by_size_.erase({it->second, it->first});
  free_bytes_ -= it->second;
  by_offset_.erase(it);
}

uint64_t VariablePolicy::largest_free_extent() const {
  return by_size_.empty() ? 0 : by_size_.rbegin()->first;
}

std::optional<Placement> VariablePolicy::place(uint64_t nbytes, DeclineReason* why) {
  uint64_t cap = round_page(nbytes);
  if (nbytes > data_bytes_ || cap > data_bytes_) {
    *why = DeclineReason::kOversize;
    return std::nullopt;
  }
  if (free_slots_.empty()) {
    *why = DeclineReason::kSlotTableFull;
    return std::nullopt;
  }
  auto fit = by_size_.lower_bound({cap, 0});
  if (fit == by_size_.end()) {
    *why = DeclineReason::kNoFreeSlot;
    return std::nullopt;
  }
  uint64_t off = fit->second;
  uint64_t len = fit->first;
  erase_extent(by_offset_.find(off));
  if (len > cap) insert_extent(off + cap, len - cap);
  uint32_t rec = free_slots_.back();
  free_slots_.pop_back();
  slot_free_[rec] = false;
  return Placement{rec, off, cap};
}

void VariablePolicy::free(const Placement& p) {
  if (p.slot >= slot_free_.size()) {
    throw OutOfRange("slot " + std::to_string(p.slot) + " out of range [0, " +
                     std::to_string(slot_free_.size()) + ")");
  }
  if (slot_free_[p.slot]) return;  // double free: ignore rather than corrupt
  slot_free_[p.slot] = true;
  free_slots_.push_back(p.slot);
  insert_extent(p.offset, p.capacity);
}

bool VariablePolicy::mark_used(const Placement& p) {
  if (p.slot >= slot_free_.size() || !slot_free_[p.slot]) return false;
  if (p.capacity == 0 || p.offset < data_offset_ || p.offset - data_offset_ > data_bytes_ ||
      p.capacity > data_bytes_ - (p.offset - data_offset_)) {
    return false;
  }
  // Carve [offset, offset+capacity) out of the free extent holding it.
  auto it = by_offset_.upper_bound(p.offset);
  if (it == by_offset_.begin()) return false;
  --it;
  uint64_t off = it->first, len = it->second;
  if (p.offset + p.capacity > off + len) return false;  // not free: inconsistent metadata
  slot_free_[p.slot] = false;
  free_slots_.erase(std::find(free_slots_.begin(), free_slots_.end(), p.slot));
  erase_extent(it);
  insert_extent(off, p.offset - off);
  insert_extent(p.offset + p.capacity, off + len - (p.offset + p.capacity));
  return true;
}

}  // namespace vllm_shm_arena
