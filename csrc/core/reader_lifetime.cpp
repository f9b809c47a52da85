#include "core/reader_lifetime.h"

#include <unistd.h>

#include <string>
#include <utility>

#include "core/cuda_shim.h"
#include "core/errors.h"

namespace vllm_shm_arena {

namespace {

constexpr uint64_t kTokenSlotMask = (uint64_t{1} << kTokenSlotBits) - 1;

// Gives back the hold a release token stands for.
void release_by_token(ArenaReader& reader, uint64_t token) {
  const ReleaseRef ref = decode_release_token(token);
  reader.release(ref.slot, ref.generation);
}

}  // namespace

uint64_t encode_release_token(uint32_t slot, uint64_t generation) {
  if (slot > kTokenSlotMask || generation >= kTokenGenerationLimit) {
    throw InvalidArgument(
        "slot " + std::to_string(slot) + " generation " + std::to_string(generation) +
        " does not fit a release token (slot below 2^" + std::to_string(kTokenSlotBits) +
        ", generation below 2^" + std::to_string(64 - kTokenSlotBits) + ")");
  }
  return (generation << kTokenSlotBits) | slot;
}

ReleaseRef decode_release_token(uint64_t token) {
  ReleaseRef ref;
  ref.slot = static_cast<uint32_t>(token & kTokenSlotMask);
  ref.generation = token >> kTokenSlotBits;
  return ref;
}

// ---------------------------------------------------------------------------------------
// LingeringReaders

LingeringReaders& LingeringReaders::process() {
  static auto* registry = new LingeringReaders();  // never destroyed (see the declaration)
  return *registry;
}

void LingeringReaders::adopt(std::shared_ptr<ArenaReader> reader, std::unique_ptr<PinRegistry> pins,
                             std::shared_ptr<ReleaseGate> gate) {
  std::lock_guard<std::mutex> lock(mu_);
  entries_.push_back(Entry{std::move(reader), std::move(pins), std::move(gate)});
}

size_t LingeringReaders::poll() {
  std::vector<Entry> done;
  size_t released = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 0; i < entries_.size();) {
      Entry& e = entries_[i];
      ArenaReader* reader = e.reader.get();
      released += e.gate->poll([reader](uint64_t token) { release_by_token(*reader, token); });
      if (e.gate->pending() == 0) {
        done.push_back(std::move(e));
        entries_[i] = std::move(entries_.back());
        entries_.pop_back();
      } else {
        ++i;
      }
    }
  }
  // Outside the lock: unregistering and unmapping are slow. Unregister before the unmap.
  for (Entry& e : done) e.pins.reset();
  return released;
}

size_t LingeringReaders::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return entries_.size();
}

// ---------------------------------------------------------------------------------------
// The pin decision's chunk size

uint64_t pin_chunk_bytes(bool variable, uint64_t data_bytes, uint64_t slot_bytes,
                         uint64_t requested) {
  // One cudaMemcpyAsync cannot cross the boundary between two registrations (the driver
  // answers cudaErrorInvalidValue; benchmarks/results/gpu_probe_h200.txt), so a chunk must
  // hold whole allocations. By default the whole data region is one chunk, registered once
  // (the same file shows what a registration costs per GiB, by chunk size); fixed slots may
  // use a multiple of the slot size; variable-size allocations can be anywhere, so they
  // always use one chunk.
  if (variable || requested == 0 || requested >= data_bytes || slot_bytes == 0) {
    return data_bytes;
  }
  return (requested + slot_bytes - 1) / slot_bytes * slot_bytes;
}

// ---------------------------------------------------------------------------------------
// ReaderHolds

ReaderHolds::ReaderHolds(std::shared_ptr<ArenaReader> reader, uint64_t pin_chunk_bytes,
                         LingeringReaders* lingering)
    : reader_(std::move(reader)),
      pin_chunk_bytes_(pin_chunk_bytes),
      lingering_(lingering != nullptr ? lingering : &LingeringReaders::process()),
      owner_pid_(::getpid()) {
  if (reader_ == nullptr) throw InvalidArgument("ReaderHolds needs a reader");
}

ReaderHolds::~ReaderHolds() {
  if (foreign()) {
    // A forked child: CUDA objects of the parent's must not be touched (no unregister, no
    // event destroy), and the core reader already ignores the child. Leak them.
    static_cast<void>(pins_.release());
    if (gate_) new std::shared_ptr<ReleaseGate>(std::move(gate_));
    return;
  }
  if (gate_ && gate_->pending() > 0) {
    // Pinned views were freed but their DMA may not be over: keep everything alive.
    lingering_->adopt(reader_, std::move(pins_), gate_);
    return;
  }
  // Unregister before the mapping (owned by reader_) can go away.
  pins_.reset();
}

bool ReaderHolds::foreign() const { return ::getpid() != owner_pid_; }

ReaderHolds::Hold ReaderHolds::acquire(uint32_t slot, uint64_t generation, uint64_t nbytes,
                                       uint64_t offset, bool dma, uint64_t stubs) {
  if (slot >= reader_->max_slots()) {
    throw OutOfRange("slot_idx " + std::to_string(slot) + " out of range [0, " +
                     std::to_string(reader_->max_slots()) + ") in arena '" + reader_->name() + "'");
  }
  const uint64_t limit = reader_->max_allocation();
  if (nbytes > limit) {
    throw InvalidArgument("nbytes " + std::to_string(nbytes) + " is larger than a slot (" +
                          std::to_string(limit) + " bytes)");
  }
  if (offset > limit) {
    throw InvalidArgument("offset " + std::to_string(offset) + " is beyond a slot (" +
                          std::to_string(limit) + " bytes)");
  }
  if (generation == 0) generation = reader_->published_generation(slot);
  encode_release_token(slot, generation);  // refused before anything is held
  Hold h;
  h.generation = generation;
  h.data = reader_->acquire(slot, generation, nbytes, offset, stubs);
  try {
    if (dma && nbytes > 0) h.gated = pin(h.data, nbytes);
  } catch (...) {
    reader_->release(slot, generation);  // the hold must not outlive a failed pin
    throw;
  }
  return h;
}

void ReaderHolds::freed(uint32_t slot, uint64_t generation, bool gated) noexcept {
  if (foreign()) return;  // a forked child's copy of a view: the hold is its parent's
  if (gated) {
    gate_->freed(encode_release_token(slot, generation));  // fits: acquire checked it
  } else {
    reader_->release(slot, generation);
  }
}

size_t ReaderHolds::flush_releases(void* stream) {
  if (foreign()) return 0;  // never CUDA for a parent's holds
  lingering_->poll();
  std::shared_ptr<ReleaseGate> gate;
  {
    std::lock_guard<std::mutex> lock(mu_);
    gate = gate_;
  }
  if (!gate) return 0;
  ArenaReader* reader = reader_.get();
  return gate->flush(stream, [reader](uint64_t token) { release_by_token(*reader, token); });
}

ReaderHoldsStats ReaderHolds::stats() const {
  ReaderHoldsStats s;
  s.held = reader_->held();
  s.checksum_mismatches = reader_->checksum_mismatches();
  s.acked = reader_->acked();
  std::lock_guard<std::mutex> lock(mu_);
  s.pin_no_space = pin_no_space_;
  s.pin_failed = pin_no_space_;
  if (pins_) {
    const PinStats p = pins_->stats();
    s.pinned_bytes = pins_->pinned_bytes();
    s.pin_failed = s.pin_failed || pins_->failed();
    s.pin_registrations = p.registrations;
    s.pin_seconds = p.register_seconds;
  }
  s.pending_releases = gate_ ? gate_->pending() : 0;
  return s;
}

bool ReaderHolds::is_pinned(uint64_t offset, uint64_t len) const {
  std::lock_guard<std::mutex> lock(mu_);
  return pins_ && pins_->is_pinned(reader_->region()->data() + offset, len);
}

bool ReaderHolds::pin(const uint8_t* p, uint64_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!pin_decided_) {
    std::shared_ptr<CudaRuntime> rt = CudaRuntime::find();
    if (!rt) {
      pin_decided_ = true;  // a context without a runtime we can see: stay unpinned
      return false;
    }
    const auto& region = reader_->region();
    // Pin only the data region (2 MiB aligned, running to the end of the region).
    const uint64_t data_off = reader_->data_offset();
    const uint64_t data_bytes = reader_->data_bytes();
    // cudaHostRegister faults in every page of the range; on a tmpfs too full to back them
    // that is a SIGBUS. Back them first (the writer reserves lazily, block by block): if the
    // filesystem cannot, stay unpinned, which only makes the H2D pageable.
    bool backed = false;
    try {
      backed = region->reserve(data_off, data_bytes);
    } catch (const ShmError&) {
      backed = false;
    }
    if (!backed) {
      pin_decided_ = true;
      pin_no_space_ = true;
      return false;
    }
    const uint64_t chunk = pin_chunk_bytes(reader_->variable(), data_bytes,
                                           reader_->max_allocation(), pin_chunk_bytes_);
    pins_ = std::make_unique<PinRegistry>(rt, region->data() + data_off, data_bytes, chunk);
    gate_ = std::make_shared<ReleaseGate>(rt);
    pin_decided_ = true;  // not before: a decision that threw is taken again next time
  }
  if (!pins_) return false;
  return pins_->ensure(p, n);
}

}  // namespace vllm_shm_arena
