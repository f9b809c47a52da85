// Arena slots as at::Tensors: the arena's two ends as Python sees them. The writer
// copies tensors in (or lends its memory as tensors) and returns (slot, generation); the reader
// builds zero-copy tensors over slots whose deleter ends the hold. Everything below these
// classes is the core's (core/arena.h, core/reader_lifetime.h) and knows no torch.
#pragma once

#include <Python.h>
#include <torch/extension.h>
#include <unistd.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "bindings/gil.h"
#include "core/arena.h"
#include "core/arena_layout.h"
#include "core/copy_pool.h"
#include "core/errors.h"
#include "core/liveness.h"
#include "core/reader_lifetime.h"

namespace vllm_shm_arena {

namespace py = pybind11;

// Why a tensor can't go into the arena as raw bytes, or nullopt if it can.
inline std::optional<DeclineReason> arena_unsuitable(const at::Tensor& t) {
  if (!t.defined() || t.device().type() != c10::DeviceType::CPU ||
      t.layout() != c10::Layout::Strided || t.is_quantized() || t.is_conj() || t.is_neg()) {
    return DeclineReason::kUnsupported;
  }
  if (!t.is_contiguous()) return DeclineReason::kNotContiguous;
  return std::nullopt;
}

/// A reader state's name: "never_attached", "attached", "detached" or "dead".
inline const char* reader_state_name(ReaderState s) {
  static constexpr const char* kStates[] = {"never_attached", "attached", "detached", "dead"};
  return kStates[static_cast<uint32_t>(s) & 3];
}

inline uint64_t tensor_nbytes(const at::Tensor& t) {
  return static_cast<uint64_t>(t.numel()) * static_cast<uint64_t>(t.element_size());
}

// Bytes of a (dtype, shape), checking every dimension and the product for overflow.
inline uint64_t checked_nbytes(at::ScalarType dtype, const std::vector<int64_t>& shape) {
  uint64_t n = c10::elementSize(dtype);
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] < 0) {
      throw InvalidArgument("shape[" + std::to_string(i) +
                            "] is negative: " + std::to_string(shape[i]));
    }
    uint64_t d = static_cast<uint64_t>(shape[i]);
    if (d != 0 && n > (uint64_t{1} << 62) / d) {
      throw InvalidArgument("shape " + c10::str(c10::IntArrayRef(shape)) + " is too large");
    }
    n *= d;
  }
  return n;
}

// The config for Python's arguments: `arena_bytes` > 0 selects variable-size packing.
inline ArenaConfig arena_config(uint32_t n_readers, uint32_t num_slots, uint64_t slot_bytes,
                                uint64_t arena_bytes, uint32_t max_allocations, bool counted) {
  ArenaConfig cfg;
  cfg.counted = counted;
  cfg.n_readers = n_readers;
  cfg.num_slots = num_slots;
  cfg.slot_bytes = slot_bytes;
  if (arena_bytes > 0) {
    cfg.policy = PolicyKind::kVariable;
    cfg.arena_bytes = arena_bytes;
    cfg.max_slots = max_allocations;
  }
  return cfg;
}

// ---------------------------------------------------------------------------------------
// Writer side

/// The arena's writer, as Python sees it: tensors in, (slot, generation) out.
class TensorArenaWriter : public std::enable_shared_from_this<TensorArenaWriter> {
 public:
  /// `arena_bytes` > 0 selects variable-size packing of that many bytes (`max_allocations`
  /// live allocations at most); otherwise `num_slots` fixed slots of `slot_bytes`.
  TensorArenaWriter(uint32_t n_readers, uint32_t num_slots, uint64_t slot_bytes,
                    const std::string& dir, uint64_t arena_bytes, uint32_t max_allocations,
                    bool counted) {
    ArenaConfig cfg =
        arena_config(n_readers, num_slots, slot_bytes, arena_bytes, max_allocations, counted);
    if (!dir.empty()) cfg.dir = dir;
    writer_ = ArenaWriter::create(cfg);
  }

  /// A tensor living in the arena, for the caller to fill in place; sending it costs no
  /// copy. None when the arena cannot lend that much now.
  std::optional<at::Tensor> empty(const std::vector<int64_t>& shape, at::ScalarType dtype) {
    uint64_t nbytes = checked_nbytes(dtype, shape);
    std::optional<Allocation> a = writer_->lend(nbytes);
    if (!a) return std::nullopt;
    auto self = shared_from_this();
    uint32_t rec = a->slot;
    uint64_t gen = a->generation;
    auto deleter = [self, rec, gen](void*) { self->writer_->end_loan(rec, gen); };
    try {
      return at::from_blob(a->data, shape, deleter, at::TensorOptions().dtype(dtype));
    } catch (...) {
      writer_->end_loan(rec, gen);
      throw;
    }
  }

  /// If [t's bytes] lie in a loan not sent yet (counted arenas: any live loan, each call one
  /// more send), publishes it -> (slot, generation, offset).
  std::optional<std::tuple<uint32_t, uint64_t, uint64_t>> send_loan(const at::Tensor& t) {
    std::optional<LoanRef> ref = writer_->find_loan(t.data_ptr(), tensor_nbytes(t));
    if (!ref || (ref->published && !writer_->counted())) return std::nullopt;
    if (!writer_->publish_loan(ref->slot, ref->generation)) return std::nullopt;
    return std::make_tuple(ref->slot, ref->generation, ref->offset);
  }

  /// Copies a suitable tensor into a free slot (GIL released during the copy).
  std::optional<std::tuple<uint32_t, uint64_t>> write_tensor(const at::Tensor& t) {
    if (auto why = arena_unsuitable(t)) {
      writer_->count_decline(*why);
      return std::nullopt;
    }
    return write_checked(t);
  }

  /// write_tensor for a tensor already known to be suitable; callable without the GIL.
  /// `working_set`: ArenaWriter::write's (what this message has copied so far, plus this).
  std::optional<std::tuple<uint32_t, uint64_t>> write_checked(const at::Tensor& t,
                                                              uint64_t working_set = 0) {
    std::optional<Allocation> a = writer_->write(t.data_ptr(), tensor_nbytes(t), working_set);
    if (!a) return std::nullopt;
    return std::make_tuple(a->slot, a->generation);
  }

  void count_decline(DeclineReason why) { writer_->count_decline(why); }
  void unsend(uint32_t slot, uint64_t generation) { writer_->unsend(slot, generation); }
  bool counted() const { return writer_->counted(); }
  void set_debug_checksum(bool on) { writer_->set_debug_checksum(on); }
  void abort(uint32_t slot, uint64_t generation) {
    Allocation a;
    a.slot = slot;
    a.generation = generation;
    writer_->abort(a);
  }

  py::dict stats() const {
    WriterStats s = writer_->stats();
    py::dict declined;
    for (size_t i = 0; i < kDeclineReasonNames.size(); ++i) {
      declined[kDeclineReasonNames[i]] = s.declined[i];
    }
    py::dict d;
    d["hits"] = s.hits;
    d["bytes"] = s.bytes;
    d["declined"] = declined;
    d["cold_copies"] = s.cold_copies;
    d["warm_copies"] = s.warm_copies;
    d["cold_bytes"] = s.cold_bytes;
    d["warm_bytes"] = s.warm_bytes;
    d["reclaimed"] = s.reclaimed;
    d["dead_readers"] = s.dead_readers;
    d["liveness_unknown"] = s.liveness_unknown;
    d["aborted"] = s.aborted;
    d["loans"] = s.loans;
    d["loans_sent"] = s.loans_sent;
    d["loans_returned"] = s.loans_returned;
    d["sends"] = s.sends;
    d["unsends"] = s.unsends;
    d["in_use"] = s.in_use;
    d["free_bytes"] = s.free_bytes;
    d["largest_free"] = s.largest_free;
    d["num_slots"] = writer_->max_slots();
    d["slot_bytes"] = writer_->max_allocation();
    return d;
  }

  /// Reader `rank`'s state: "never_attached", "attached", "detached" or "dead".
  std::string reader_state(uint32_t rank) const {
    return reader_state_name(writer_->reader_state(rank));
  }

  py::list holdings() const {
    py::list out;
    for (const ReaderHolding& h : writer_->holdings()) {
      py::dict d;
      d["rank"] = h.rank;
      d["state"] = reader_state_name(h.state);
      d["slots_held"] = h.slots_held;
      d["owed"] = h.owed;
      d["oldest_age_s"] = h.oldest_age_seconds;
      out.append(d);
    }
    return out;
  }

  size_t reclaim(bool check_liveness) { return writer_->reclaim(check_liveness); }
  std::string name() const { return writer_->name(); }
  std::string dir() const { return writer_->region()->dir(); }
  uint64_t max_allocation() const { return writer_->max_allocation(); }
  /// The core writer (for the message framing, which packs into an allocation).
  ArenaWriter& core() { return *writer_; }
  uint32_t n_readers() const { return writer_->n_readers(); }
  void unlink() { writer_->unlink(); }

 private:
  std::unique_ptr<ArenaWriter> writer_;
};

// ---------------------------------------------------------------------------------------
// Reader side

/// Slots a reader holds without a view (TensorArenaReader::hold_slots); released when it dies.
struct SlotHolds {
  explicit SlotHolds(std::shared_ptr<ReaderHolds> h) : holds(std::move(h)) {}
  SlotHolds(const SlotHolds&) = delete;
  SlotHolds& operator=(const SlotHolds&) = delete;
  ~SlotHolds() {
    for (const auto& [slot, generation] : held) holds->freed(slot, generation, /*gated=*/false);
  }
  std::shared_ptr<ReaderHolds> holds;
  std::vector<std::pair<uint32_t, uint64_t>> held;
};

/// One reader rank: builds zero-copy tensors over slots and releases them when the last
/// view dies (after the DMA that reads them, when the memory is pinned). How each hold ends,
/// pinning included, is the core's ReaderHolds (core/reader_lifetime.h); this class adds the
/// tensors and the checks that need torch.
class TensorArenaReader {
 public:
  /// `expect`: (n_readers, num_slots, slot_bytes, policy, counted) from the caller's handle,
  /// checked against the header before the rank is claimed; None skips the check.
  TensorArenaReader(const std::string& name, uint32_t rank, const std::string& dir,
                    uint64_t pin_chunk_bytes, const py::object& expect)
      : holds_(std::make_shared<ReaderHolds>(
            ArenaReader::attach(name, rank, dir.empty() ? ShmRegion::default_dir() : dir,
                                geometry_check(name, expect)),
            pin_chunk_bytes)) {}

  /// A check of the validated geometry against (n_readers, num_slots, slot_bytes, policy,
  /// counted).
  static std::function<void(const ArenaGeometry&)> geometry_check(const std::string& name,
                                                                  const py::object& expect) {
    if (expect.is_none()) return {};
    auto t = expect.cast<std::tuple<uint32_t, uint32_t, uint64_t, std::string, bool>>();
    return [name, t](const ArenaGeometry& g) {
      uint64_t slot = g.policy == PolicyKind::kVariable ? g.data_bytes : g.slot_bytes;
      std::string policy = g.policy == PolicyKind::kVariable ? "variable" : "fixed";
      std::string diff;
      auto cmp = [&diff](const char* what, const std::string& want, const std::string& got) {
        if (want != got) {
          diff +=
              std::string(diff.empty() ? "" : ", ") + what + ": handle " + want + ", arena " + got;
        }
      };
      cmp("n_readers", std::to_string(std::get<0>(t)), std::to_string(g.n_readers));
      cmp("num_slots", std::to_string(std::get<1>(t)), std::to_string(g.max_slots));
      cmp("slot_bytes", std::to_string(std::get<2>(t)), std::to_string(slot));
      cmp("policy", std::get<3>(t), policy);
      cmp("counted", std::get<4>(t) ? "yes" : "no", g.counted ? "yes" : "no");
      if (!diff.empty()) {
        throw InvalidArgument("arena handle does not match shared memory '" + name + "' (" + diff +
                              ")");
      }
    };
  }

  /// A tensor whose storage is the slot; zero bytes copied. `stubs`: in a counted arena, the
  /// stubs this view stands for (ArenaReader::acquire).
  at::Tensor get_tensor(uint32_t slot, uint64_t generation, uint64_t nbytes, at::ScalarType dtype,
                        const std::vector<int64_t>& shape, bool cuda_context, uint64_t offset,
                        uint64_t stubs = 1) {
    uint64_t expect = checked_nbytes(dtype, shape);
    if (expect != nbytes) {
      throw InvalidArgument("nbytes " + std::to_string(nbytes) + " does not match shape " +
                            c10::str(c10::IntArrayRef(shape)) + " x itemsize " +
                            std::to_string(c10::elementSize(dtype)) + " = " +
                            std::to_string(expect));
    }
    const ReaderHolds::Hold h =
        holds_->acquire(slot, generation, nbytes, offset, cuda_context, stubs);
    auto deleter = [holds = holds_, slot, gen = h.generation, gated = h.gated](void*) {
      holds->freed(slot, gen, gated);
    };
    auto options = at::TensorOptions().dtype(dtype).device(at::kCPU);
    try {
      return at::from_blob(const_cast<uint8_t*>(h.data), shape, deleter, options);
    } catch (...) {
      holds_->freed(slot, h.generation, /*gated=*/false);  // no view existed: no DMA either
      throw;
    }
  }

  /// Holds (slot, generation) pairs (a message's slots, frame 0) without a view: the slots
  /// stay this reader's, whatever becomes of the tensors an unpickling builds over them, until
  /// the returned object dies. A reader takes them before it unpickles a message, so that an
  /// unpickling a signal handler's exception cut short can run again (its tensors' releases
  /// do not give the slots back). All or nothing: a pair that cannot be held releases those
  /// taken and raises.
  std::shared_ptr<SlotHolds> hold_slots(const std::vector<std::pair<uint32_t, uint64_t>>& pairs) {
    auto out = std::make_shared<SlotHolds>(holds_);
    for (const auto& [slot, generation] : pairs) {
      holds_->acquire(slot, generation, 0, 0, /*dma=*/false);
      out->held.emplace_back(slot, generation);
    }
    return out;
  }

  /// Releases slots whose tensors died and whose DMA (if pinned) has completed.
  size_t flush_releases(uintptr_t stream) {
    return holds_->flush_releases(reinterpret_cast<void*>(stream));
  }

  /// The core reader (for the message framing, which copies out of an allocation).
  ArenaReader& core() { return holds_->core(); }

  void release_unacquired(uint32_t slot, uint64_t generation) {
    core().release_unacquired(slot, generation);
  }

  /// Counted arenas, reader 0: one more (or one fewer) forward of a held allocation.
  void forward(uint32_t slot, uint64_t generation) { core().forward(slot, generation); }
  void unforward(uint32_t slot, uint64_t generation) { core().unforward(slot, generation); }
  /// Takes back every forward `forwarded` lists ((slot, generation) pairs), removing each from
  /// the list as it is taken back: the list stays the record of what is still counted, so a
  /// second call takes back nothing twice. All in one C call (no signal handler between).
  void unforward_all(const py::list& forwarded) {
    while (PyList_GET_SIZE(forwarded.ptr()) > 0) {
      const Py_ssize_t last = PyList_GET_SIZE(forwarded.ptr()) - 1;
      auto [slot, generation] =
          py::cast<std::pair<uint32_t, uint64_t>>(PyList_GET_ITEM(forwarded.ptr(), last));
      if (PyList_SetSlice(forwarded.ptr(), last, last + 1, nullptr) != 0) {
        throw py::error_already_set();
      }
      core().unforward(slot, generation);
    }
  }

  /// The held allocation `t`'s bytes lie in -> (slot, generation, offset, nbytes), or None.
  std::optional<std::tuple<uint32_t, uint64_t, uint64_t, uint64_t>> find_hold(
      const at::Tensor& t) const {
    if (!t.defined() || t.device().type() != c10::DeviceType::CPU || !t.is_contiguous()) {
      return std::nullopt;
    }
    std::optional<HoldRef> h = reader().find_hold(t.data_ptr(), tensor_nbytes(t));
    if (!h) return std::nullopt;
    return std::make_tuple(h->slot, h->generation, h->offset, h->nbytes);
  }
  bool counted() const { return reader().counted(); }
  /// Reader `rank`'s state, as the writer sees it (see TensorArenaWriter::reader_state).
  std::string reader_state(uint32_t rank) const {
    return reader_state_name(reader().reader_state(rank));
  }

  py::dict stats() const {
    const ReaderHoldsStats s = holds_->stats();
    py::dict d;
    d["held"] = s.held;
    d["checksum_mismatches"] = s.checksum_mismatches;
    d["rank"] = reader().rank();
    d["acked"] = s.acked;
    d["pinned_bytes"] = s.pinned_bytes;
    d["pin_failed"] = s.pin_failed;
    d["pin_no_space"] = s.pin_no_space;
    d["pin_registrations"] = s.pin_registrations;
    d["pin_seconds"] = s.pin_seconds;
    d["pending_releases"] = s.pending_releases;
    return d;
  }

  bool is_pinned(uint64_t offset, uint64_t len) const { return holds_->is_pinned(offset, len); }

  std::string name() const { return reader().name(); }
  uint32_t rank() const { return reader().rank(); }
  uint32_t num_slots() const { return reader().max_slots(); }
  uint64_t slot_bytes() const { return reader().max_allocation(); }
  /// The arena's handle geometry as this reader validated it: (n_readers, num_slots,
  /// slot_bytes, policy).
  py::tuple geometry() const {
    const ArenaGeometry& g = reader().geometry();
    return py::make_tuple(g.n_readers, g.max_slots, reader().max_allocation(),
                          g.policy == PolicyKind::kVariable ? "variable" : "fixed");
  }
  std::string writer_liveness() const { return liveness_name(reader().writer_liveness()); }
  // No detach(): the rank is given up only when the core reader dies, which every tensor
  // handed out (and every gated release) keeps alive. Detaching earlier would let the writer
  // recycle memory those tensors still view.

 private:
  const ArenaReader& reader() const { return holds_->core(); }

  std::shared_ptr<ReaderHolds> holds_;  // shared with every tensor's deleter
};

}  // namespace vllm_shm_arena
