// The C++ <-> Python surface of vllm_shm_arena._C. Everything below the bindings lives in
// csrc/core and knows no torch; this file turns allocation records into at::Tensors and back.
// The exported functions are listed, one line each, in PYBIND11_MODULE at the bottom; those of
// the message ring (RingWriter, RingReader, RING_FLAG_*) are listed the same way by
// bind_messages in csrc/bindings/message_bindings.cpp, which knows no torch. Every call that
// releases the GIL goes through with_nogil (csrc/bindings/gil.h: why none re-takes the GIL in
// a destructor).
#include <Python.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/extension.h>
#include <unistd.h>

#include <array>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "bindings/gil.h"
#include "bindings/message_bindings.h"
#include "core/arena.h"
#include "core/arena_layout.h"
#include "core/copy_pool.h"
#include "core/cuda_shim.h"
#include "core/errors.h"
#include "core/liveness.h"
#include "core/reader_lifetime.h"
#include "core/socket_dir.h"
#include "core/stale_segments.h"

#ifndef VSA_TORCH_VERSION
#define VSA_TORCH_VERSION "unknown"
#endif

namespace py = pybind11;

namespace vllm_shm_arena {

namespace {

// Why a tensor can't go into the arena as raw bytes, or nullopt if it can.
std::optional<DeclineReason> arena_unsuitable(const at::Tensor& t) {
  if (!t.defined() || t.device().type() != c10::DeviceType::CPU ||
      t.layout() != c10::Layout::Strided || t.is_quantized() || t.is_conj() || t.is_neg()) {
    return DeclineReason::kUnsupported;
  }
  if (!t.is_contiguous()) return DeclineReason::kNotContiguous;
  return std::nullopt;
}

uint64_t tensor_nbytes(const at::Tensor& t) {
  return static_cast<uint64_t>(t.numel()) * static_cast<uint64_t>(t.element_size());
}

// Bytes of a (dtype, shape), checking every dimension and the product for overflow.
uint64_t checked_nbytes(at::ScalarType dtype, const std::vector<int64_t>& shape) {
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
ArenaConfig arena_config(uint32_t n_readers, uint32_t num_slots, uint64_t slot_bytes,
                         uint64_t arena_bytes, uint32_t max_allocations) {
  ArenaConfig cfg;
  cfg.n_readers = n_readers;
  cfg.num_slots = num_slots;
  cfg.slot_bytes = slot_bytes;
  if (arena_bytes > 0) {
    cfg.policy = PolicyKind::kVariable;
    cfg.arena_bytes = arena_bytes;
    cfg.max_records = max_allocations;
  }
  return cfg;
}

}  // namespace

// ---------------------------------------------------------------------------------------
// Writer side

/// The arena's writer, as Python sees it: tensors in, (slot, generation) out.
class TensorArenaWriter : public std::enable_shared_from_this<TensorArenaWriter> {
 public:
  /// `arena_bytes` > 0 selects variable-size packing of that many bytes (`max_allocations`
  /// live allocations at most); otherwise `num_slots` fixed slots of `slot_bytes`.
  TensorArenaWriter(uint32_t n_readers, uint32_t num_slots, uint64_t slot_bytes,
                    const std::string& dir, uint64_t arena_bytes, uint32_t max_allocations) {
    ArenaConfig cfg = arena_config(n_readers, num_slots, slot_bytes, arena_bytes, max_allocations);
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
    uint32_t rec = a->record;
    uint64_t gen = a->generation;
    auto deleter = [self, rec, gen](void*) { self->writer_->end_loan(rec, gen); };
    try {
      return at::from_blob(a->data, shape, deleter, at::TensorOptions().dtype(dtype));
    } catch (...) {
      writer_->end_loan(rec, gen);
      throw;
    }
  }

  /// If [t's bytes] lie in a loan not sent yet, publishes it -> (slot, generation, offset).
  std::optional<std::tuple<uint32_t, uint64_t, uint64_t>> send_loan(const at::Tensor& t) {
    std::optional<LoanRef> ref = writer_->find_loan(t.data_ptr(), tensor_nbytes(t));
    if (!ref || ref->published) return std::nullopt;
    if (!writer_->publish_loan(ref->record, ref->generation)) return std::nullopt;
    return std::make_tuple(ref->record, ref->generation, ref->offset);
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
    return std::make_tuple(a->record, a->generation);
  }

  void count_decline(DeclineReason why) { writer_->count_decline(why); }
  void set_debug_checksum(bool on) { writer_->set_debug_checksum(on); }
  void abort(uint32_t slot, uint64_t generation) {
    Allocation a;
    a.record = slot;
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
    d["in_use"] = s.in_use;
    d["free_bytes"] = s.free_bytes;
    d["largest_free"] = s.largest_free;
    d["num_slots"] = writer_->max_records();
    d["slot_bytes"] = writer_->max_allocation();
    return d;
  }

  py::list holdings() const {
    static const char* kStates[] = {"never_attached", "attached", "detached", "dead"};
    py::list out;
    for (const ReaderHolding& h : writer_->holdings()) {
      py::dict d;
      d["rank"] = h.rank;
      d["state"] = kStates[static_cast<uint32_t>(h.state) & 3];
      d["slots_held"] = h.records_held;
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

/// One reader rank: builds zero-copy tensors over slots and releases them when the last
/// view dies (after the DMA that reads them, when the memory is pinned). How each hold ends,
/// pinning included, is the core's ReaderHolds (core/reader_lifetime.h); this class adds the
/// tensors and the checks that need torch.
class TensorArenaReader {
 public:
  /// `expect`: (n_readers, num_slots, slot_bytes, policy) from the caller's handle, checked
  /// against the header before the rank is claimed; None skips the check.
  TensorArenaReader(const std::string& name, uint32_t rank, const std::string& dir,
                    uint64_t pin_chunk_bytes, const py::object& expect)
      : holds_(std::make_shared<ReaderHolds>(
            ArenaReader::attach(name, rank, dir.empty() ? ShmRegion::default_dir() : dir,
                                geometry_check(name, expect)),
            pin_chunk_bytes)) {}

  /// A check of the validated geometry against (n_readers, num_slots, slot_bytes, policy).
  static std::function<void(const ArenaGeometry&)> geometry_check(const std::string& name,
                                                                  const py::object& expect) {
    if (expect.is_none()) return {};
    auto t = expect.cast<std::tuple<uint32_t, uint32_t, uint64_t, std::string>>();
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
      cmp("num_slots", std::to_string(std::get<1>(t)), std::to_string(g.max_records));
      cmp("slot_bytes", std::to_string(std::get<2>(t)), std::to_string(slot));
      cmp("policy", std::get<3>(t), policy);
      if (!diff.empty()) {
        throw InvalidArgument("arena handle does not match shared memory '" + name + "' (" + diff +
                              ")");
      }
    };
  }

  /// A tensor whose storage is the slot; zero bytes copied.
  at::Tensor get_tensor(uint32_t slot, uint64_t generation, uint64_t nbytes, at::ScalarType dtype,
                        const std::vector<int64_t>& shape, bool cuda_context, uint64_t offset) {
    uint64_t expect = checked_nbytes(dtype, shape);
    if (expect != nbytes) {
      throw InvalidArgument("nbytes " + std::to_string(nbytes) + " does not match shape " +
                            c10::str(c10::IntArrayRef(shape)) + " x itemsize " +
                            std::to_string(c10::elementSize(dtype)) + " = " +
                            std::to_string(expect));
    }
    const ReaderHolds::Hold h = holds_->acquire(slot, generation, nbytes, offset, cuda_context);
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

  /// Releases slots whose tensors died and whose DMA (if pinned) has completed.
  size_t flush_releases(uintptr_t stream) {
    return holds_->flush_releases(reinterpret_cast<void*>(stream));
  }

  /// The core reader (for the message framing, which copies out of an allocation).
  ArenaReader& core() { return holds_->core(); }

  void release_unacquired(uint32_t slot, uint64_t generation) {
    core().release_unacquired(slot, generation);
  }

  py::dict stats() const {
    const ReaderHoldsStats s = holds_->stats();
    py::dict d;
    d["held"] = s.held;
    d["checksum_mismatches"] = s.checksum_mismatches;
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
  uint32_t num_slots() const { return reader().max_records(); }
  uint64_t slot_bytes() const { return reader().max_allocation(); }
  /// The arena's handle geometry as this reader validated it: (n_readers, num_slots,
  /// slot_bytes, policy).
  py::tuple geometry() const {
    const ArenaGeometry& g = reader().geometry();
    return py::make_tuple(g.n_readers, g.max_records, reader().max_allocation(),
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

// ---------------------------------------------------------------------------------------
// Out-of-band rebuild: a tensor over a received buffer (zero-copy when it is writable).

at::Tensor tensor_from_buffer(py::object buffer, at::ScalarType dtype,
                              const std::vector<int64_t>& shape) {
  auto view = std::make_unique<Py_buffer>();
  // Writable first: a tensor aliasing a read-only buffer (bytes) would let an in-place op
  // change an immutable object. Such buffers are copied once below instead.
  bool writable = PyObject_GetBuffer(buffer.ptr(), view.get(), PyBUF_WRITABLE) == 0;
  if (!writable) {
    PyErr_Clear();
    if (PyObject_GetBuffer(buffer.ptr(), view.get(), PyBUF_SIMPLE) != 0) {
      throw py::error_already_set();
    }
  }
  uint64_t expect = checked_nbytes(dtype, shape);
  if (static_cast<uint64_t>(view->len) != expect) {
    uint64_t got = static_cast<uint64_t>(view->len);
    PyBuffer_Release(view.get());
    throw InvalidArgument("buffer has " + std::to_string(got) + " bytes, shape " +
                          c10::str(c10::IntArrayRef(shape)) + " needs " + std::to_string(expect));
  }
  if (!writable) {
    at::Tensor out;
    try {
      out = at::empty(shape, at::TensorOptions().dtype(dtype));
    } catch (...) {
      PyBuffer_Release(view.get());
      throw;
    }
    if (expect > 0) with_nogil([&] { parallel_copy(out.data_ptr(), view->buf, expect); });
    PyBuffer_Release(view.get());
    return out;
  }
  void* data = view->buf;
  Py_buffer* raw = view.release();
  auto deleter = [raw](void*) {
    // Interpreter finalizing or gone: leak. Taking the GIL now could end this thread inside
    // this noexcept frame (see with_nogil).
    if (!Py_IsInitialized() || interpreter_finalizing()) return;
    py::gil_scoped_acquire gil;
    PyBuffer_Release(raw);
    delete raw;
  };
  return at::from_blob(data, shape, deleter, at::TensorOptions().dtype(dtype));
}

// ---------------------------------------------------------------------------------------
// Unpickling an arena stub (vllm_shm_arena.arena._rebuild_arena_tensor): the stub's fields
// come from the message, so each is checked here before it means anything, with the errors a
// malformed stub has always raised; then the dtype string is looked up and the tensor built.
// One C call per tensor instead of a Python check per field.

std::string repr_of(py::handle h) {
  PyObject* r = PyObject_Repr(h.ptr());
  if (r == nullptr) {
    PyErr_Clear();
    return "<unprintable>";
  }
  py::object owned = py::reinterpret_steal<py::object>(r);
  return py::cast<std::string>(owned);
}

// A stub field that must be a Python int (not a bool) >= 0, below `limit`: its value, or
// nullopt when it is >= limit (the caller words that error). Anything else is malformed.
std::optional<uint64_t> stub_uint(py::handle v, const char* what, uint64_t limit) {
  if (!PyLong_Check(v.ptr()) || PyBool_Check(v.ptr())) {
    throw InvalidArgument(std::string("malformed arena stub: ") + what + "=" + repr_of(v));
  }
  int overflow = 0;
  long long x = PyLong_AsLongLongAndOverflow(v.ptr(), &overflow);
  if (x == -1 && PyErr_Occurred()) throw py::error_already_set();
  if (overflow < 0 || (overflow == 0 && x < 0)) {
    throw InvalidArgument(std::string("malformed arena stub: ") + what + "=" + repr_of(v));
  }
  if (overflow > 0 || static_cast<uint64_t>(x) >= limit) return std::nullopt;
  return static_cast<uint64_t>(x);
}

/// Stub dtype strings ("bfloat16") -> dtypes, registered once by the package at import.
std::unordered_map<std::string, at::ScalarType>& stub_dtypes() {
  static auto* table = new std::unordered_map<std::string, at::ScalarType>();
  return *table;
}

void register_stub_dtypes(const py::dict& by_name) {
  auto& table = stub_dtypes();
  table.clear();
  for (auto item : by_name) {
    table[py::cast<std::string>(item.first)] = py::cast<at::ScalarType>(item.second);
  }
}

at::Tensor rebuild_stub(TensorArenaReader& reader, py::handle slot_idx, py::handle generation,
                        py::handle nbytes, py::handle dtype_str, py::handle shape,
                        py::handle offset, bool cuda_context) {
  std::optional<uint64_t> slot = stub_uint(slot_idx, "slot_idx", uint64_t{1} << 32);
  std::optional<uint64_t> gen = stub_uint(generation, "generation", uint64_t{1} << 63);
  std::optional<uint64_t> n = stub_uint(nbytes, "nbytes", uint64_t{1} << 62);
  if (!slot) {
    throw OutOfRange("malformed arena stub: slot_idx " + py::cast<std::string>(py::str(slot_idx)) +
                     " out of range");
  }
  // Generations start at 1: a stub never carries 0, and 0 must not mean "whatever the slot
  // holds now", which would skip the stale-stub check.
  if (!gen || *gen == 0) {
    throw InvalidArgument("malformed arena stub: generation=" + repr_of(generation));
  }
  if (!n) {
    throw InvalidArgument("malformed arena stub: nbytes=" + repr_of(nbytes) + " is too large");
  }
  PyObject* sh = shape.ptr();
  if (!PyTuple_Check(sh) && !PyList_Check(sh)) {
    throw InvalidArgument("malformed arena stub: shape=" + repr_of(shape));
  }
  py::object seq = py::reinterpret_steal<py::object>(PySequence_Fast(sh, "shape"));
  if (!seq) throw py::error_already_set();
  Py_ssize_t ndim = PySequence_Fast_GET_SIZE(seq.ptr());
  PyObject** items = PySequence_Fast_ITEMS(seq.ptr());
  std::vector<int64_t> dims(static_cast<size_t>(ndim));
  bool negative = false;
  for (Py_ssize_t i = 0; i < ndim; ++i) {
    if (!PyLong_Check(items[i]) || PyBool_Check(items[i])) {
      throw InvalidArgument("malformed arena stub: shape=" + repr_of(shape));
    }
    int overflow = 0;
    long long d = PyLong_AsLongLongAndOverflow(items[i], &overflow);
    if (d == -1 && PyErr_Occurred()) throw py::error_already_set();
    if (overflow != 0) {
      throw InvalidArgument("malformed arena stub: dimension " + repr_of(items[i]) +
                            " in shape is too large");
    }
    negative = negative || d < 0;
    dims[static_cast<size_t>(i)] = d;
  }
  if (negative) {
    throw InvalidArgument("malformed arena stub: negative dimension in shape " +
                          repr_of(py::tuple(seq)));
  }
  std::optional<uint64_t> off = stub_uint(offset, "offset", uint64_t{1} << 62);
  if (!off) throw InvalidArgument("malformed arena stub: offset=" + repr_of(offset));
  at::ScalarType dtype;
  {
    Py_ssize_t len = 0;
    const char* name =
        PyUnicode_Check(dtype_str.ptr()) ? PyUnicode_AsUTF8AndSize(dtype_str.ptr(), &len) : nullptr;
    if (name == nullptr) PyErr_Clear();
    auto& table = stub_dtypes();
    auto it = name == nullptr ? table.end() : table.find(std::string(name, len));
    if (it == table.end()) {
      throw InvalidArgument("unknown dtype string " + repr_of(dtype_str) + " in an arena stub");
    }
    dtype = it->second;
  }
  return reader.get_tensor(static_cast<uint32_t>(*slot), *gen, *n, dtype, dims, cuda_context, *off);
}

// ---------------------------------------------------------------------------------------
// The pickler's per-object check, as a C-level callable (see vllm_shm_arena/pickler.py for
// the Python reference it mirrors). Non-tensors return NotImplemented after one pointer
// comparison, which is what keeps pickling of tensor-free messages at full speed.

struct ReducerState {
  std::shared_ptr<TensorArenaWriter> writer;
  py::object tensor_type, param_type;
  py::object rebuild_tensor, rebuild_param;
  py::object arena_name;
  py::object diverted;  // a list; (slot, generation) appended per diversion
  // Bytes this dump has copied into the arena so far (the copies' working set). A dump starts
  // with `diverted` empty (the pickler clears it), which is where this restarts from zero.
  uint64_t dump_copied = 0;
  std::array<py::object, static_cast<size_t>(at::ScalarType::NumOptions)> dtype_names;
  uint64_t min_bytes = 0;
};

PyObject* reducer_call(PyObject* capsule, PyObject* obj) {
  auto* st = static_cast<ReducerState*>(PyCapsule_GetPointer(capsule, "vsa.reducer"));
  if (st == nullptr) return nullptr;
  PyObject* tp = reinterpret_cast<PyObject*>(Py_TYPE(obj));
  PyObject* rebuild;
  if (tp == st->tensor_type.ptr()) {
    rebuild = st->rebuild_tensor.ptr();
  } else if (tp == st->param_type.ptr()) {
    rebuild = st->rebuild_param.ptr();
  } else {
    Py_RETURN_NOTIMPLEMENTED;
  }
  try {
    const at::Tensor& t = THPVariable_Unpack(obj);
    if (t.device().type() != c10::DeviceType::CPU || t.layout() != c10::Layout::Strided) {
      Py_RETURN_NOTIMPLEMENTED;  // not host bytes: the out-of-band path decides
    }
    uint64_t nbytes = tensor_nbytes(t);
    if (PyList_GET_SIZE(st->diverted.ptr()) == 0) st->dump_copied = 0;  // a new dump
    const py::object& dtype_name = st->dtype_names[static_cast<size_t>(t.scalar_type())];
    // A loaned tensor (or a contiguous view of one) not sent yet goes as it is, whatever its
    // size: it is in the arena already, so sending it costs no copy.
    uint32_t slot;
    uint64_t gen, offset = 0;
    std::optional<std::tuple<uint32_t, uint64_t, uint64_t>> loan;
    if (dtype_name && t.is_contiguous()) loan = st->writer->send_loan(t);
    if (loan) {
      std::tie(slot, gen, offset) = *loan;
    } else {
      if (nbytes < st->min_bytes) {
        st->writer->count_decline(DeclineReason::kTooSmall);
        Py_RETURN_NOTIMPLEMENTED;
      }
      if (t.requires_grad()) {
        st->writer->count_decline(DeclineReason::kUnsupported);
        Py_RETURN_NOTIMPLEMENTED;
      }
      if (auto why = arena_unsuitable(t)) {
        st->writer->count_decline(*why);
        Py_RETURN_NOTIMPLEMENTED;
      }
      if (!dtype_name) {
        st->writer->count_decline(DeclineReason::kUnsupported);
        Py_RETURN_NOTIMPLEMENTED;
      }
      uint64_t working_set = st->dump_copied + nbytes;
      std::optional<std::tuple<uint32_t, uint64_t>> res =
          with_nogil([&] { return st->writer->write_checked(t, working_set); });
      if (!res) Py_RETURN_NOTIMPLEMENTED;
      st->dump_copied = working_set;
      std::tie(slot, gen) = *res;
    }
    py::tuple key = py::make_tuple(slot, gen);
    if (PyList_Append(st->diverted.ptr(), key.ptr()) != 0) {
      st->writer->abort(slot, gen);
      return nullptr;
    }
    py::tuple shape(t.dim());
    for (int64_t i = 0; i < t.dim(); ++i) shape[i] = py::int_(t.size(i));
    py::tuple args;
    if (offset == 0) {
      args = py::make_tuple(st->arena_name, slot, gen, nbytes, dtype_name, shape);
    } else {
      args = py::make_tuple(st->arena_name, slot, gen, nbytes, dtype_name, shape, offset);
    }
    return py::make_tuple(py::reinterpret_borrow<py::object>(rebuild), args).release().ptr();
  } catch (py::error_already_set& e) {
    e.restore();
    return nullptr;
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}

PyMethodDef kReducerDef = {"reducer_override", reducer_call, METH_O,
                           "C-level _ArenaPickler.reducer_override"};

py::object make_reducer(std::shared_ptr<TensorArenaWriter> writer, py::object tensor_type,
                        py::object param_type, py::object rebuild_tensor, py::object rebuild_param,
                        py::dict dtype_names, uint64_t min_bytes, py::list diverted) {
  auto st = std::make_unique<ReducerState>();
  st->writer = std::move(writer);
  st->tensor_type = tensor_type;
  st->param_type = param_type;
  st->rebuild_tensor = rebuild_tensor;
  st->rebuild_param = rebuild_param;
  st->arena_name = py::str(st->writer->name());
  st->diverted = diverted;
  st->min_bytes = min_bytes;
  for (auto item : dtype_names) {
    auto dtype = item.first.cast<at::ScalarType>();
    st->dtype_names[static_cast<size_t>(dtype)] = py::reinterpret_borrow<py::object>(item.second);
  }
  PyObject* cap = PyCapsule_New(st.get(), "vsa.reducer", [](PyObject* c) {
    delete static_cast<ReducerState*>(PyCapsule_GetPointer(c, "vsa.reducer"));
  });
  if (cap == nullptr) throw py::error_already_set();
  st.release();
  py::object capsule = py::reinterpret_steal<py::object>(cap);
  PyObject* fn = PyCFunction_New(&kReducerDef, capsule.ptr());
  if (fn == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(fn);
}

}  // namespace vllm_shm_arena

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace vllm_shm_arena;
  m.doc() = "vllm_shm_arena._C: shared-memory tensor arena (torch-free core + bindings)";

  // Core errors: caller mistakes become ValueError/IndexError, environment problems OSError.
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const ShmError& e) {
      PyErr_SetString(PyExc_OSError, e.what());
    }
  });

  // The torch version this build was compiled against (checked by the package at import).
  m.attr("TORCH_VERSION") = VSA_TORCH_VERSION;
  // The writer's decline reasons in enum order: the keys of its stats()["declined"].
  m.attr("DECLINE_REASONS") = py::tuple(
      py::cast(std::vector<std::string>(kDeclineReasonNames.begin(), kDeclineReasonNames.end())));

  py::class_<TensorArenaWriter, std::shared_ptr<TensorArenaWriter>>(m, "ArenaWriter")
      // Creates the region (checking free space in `dir`, "" = default /dev/shm).
      .def(py::init<uint32_t, uint32_t, uint64_t, const std::string&, uint64_t, uint32_t>(),
           py::arg("n_readers"), py::arg("num_slots"), py::arg("slot_bytes"), py::arg("dir") = "",
           py::arg("arena_bytes") = 0, py::arg("max_allocations") = 1024)
      // A tensor lent from the arena (filled in place, sent without a copy), or None.
      .def("empty", &TensorArenaWriter::empty, py::arg("shape"), py::arg("dtype"))
      // Publishes an unsent loan holding this tensor -> (slot, generation, offset), or None.
      .def("send_loan", &TensorArenaWriter::send_loan, py::arg("tensor"))
      // Copies a tensor into a free slot -> (slot, generation), or None when declined.
      .def(
          "write_tensor",
          [](TensorArenaWriter& w, const at::Tensor& t) {
            return with_nogil([&] { return w.write_tensor(t); });
          },
          py::arg("tensor"))
      // Packs a message's frames into one allocation (a blob) -> (slot, generation, nbytes) or
      // None (declined, or over max_bytes); published on return (csrc/bindings/).
      .def(
          "write_frames",
          [](TensorArenaWriter& w, const py::list& frames, uint64_t max_bytes) {
            return arena_write_frames(w.core(), frames, max_bytes);
          },
          py::arg("frames"), py::arg("max_bytes"))
      // Gives back an allocation whose stub never left this process.
      .def("abort", &TensorArenaWriter::abort, py::arg("slot"), py::arg("generation"))
      // Counts a decline decided in Python, by stats() key.
      .def("count_decline",
           [](TensorArenaWriter& w, const std::string& key) {
             for (size_t i = 0; i < kDeclineReasonNames.size(); ++i) {
               if (key == kDeclineReasonNames[i]) {
                 return w.count_decline(static_cast<DeclineReason>(i));
               }
             }
             throw InvalidArgument("unknown decline reason '" + key + "'");
           })
      // Debug: checksum payloads at publish; readers verify at release (stats mismatches).
      .def("set_debug_checksum", &TensorArenaWriter::set_debug_checksum, py::arg("on"))
      // Recycles slots every reader released (checking liveness of blockers if asked).
      .def("reclaim", &TensorArenaWriter::reclaim, py::arg("check_liveness") = false)
      // Counters: hits, bytes, declined{...}, cold/warm copies, reclaimed, dead_readers...
      .def("stats", &TensorArenaWriter::stats)
      // Per reader: state, slots held, age of the oldest.
      .def("holdings", &TensorArenaWriter::holdings)
      // Removes the shm name; mappings stay valid.
      .def("unlink", &TensorArenaWriter::unlink)
      .def_property_readonly("name", &TensorArenaWriter::name)
      .def_property_readonly("dir", &TensorArenaWriter::dir)
      .def_property_readonly("slot_bytes", &TensorArenaWriter::max_allocation)
      .def_property_readonly("n_readers", &TensorArenaWriter::n_readers);

  py::class_<TensorArenaReader, std::shared_ptr<TensorArenaReader>>(m, "ArenaReader")
      // Attaches reader `rank` of arena `name`; pins lazily, the whole data region at once
      // (pin_chunk_bytes 0) or in chunks of whole slots.
      .def(py::init<const std::string&, uint32_t, const std::string&, uint64_t, py::object>(),
           py::arg("name"), py::arg("rank"), py::arg("dir") = "", py::arg("pin_chunk_bytes") = 0,
           py::arg("expect") = py::none())
      // Zero-copy tensor over a slot; generation 0 = whatever the slot holds now.
      .def("get_tensor", &TensorArenaReader::get_tensor, py::arg("slot"), py::arg("generation"),
           py::arg("nbytes"), py::arg("dtype"), py::arg("shape"), py::arg("cuda_context"),
           py::arg("offset") = 0)
      // An arena stub's fields, checked, -> its tensor (what _rebuild_arena_tensor calls).
      .def("rebuild", &rebuild_stub, py::arg("slot_idx"), py::arg("generation"), py::arg("nbytes"),
           py::arg("dtype_str"), py::arg("shape"), py::arg("offset"), py::arg("cuda_context"))
      // Releases freed slots whose DMA completed; `stream` is a cudaStream_t as an int.
      .def(
          "flush_releases",
          [](TensorArenaReader& r, uintptr_t stream) {
            return with_nogil([&] { return r.flush_releases(stream); });
          },
          py::arg("stream") = 0)
      // A blob's frames copied out as bytearrays; the allocation is released on return
      // (csrc/bindings/).
      .def(
          "read_frames",
          [](TensorArenaReader& r, uint32_t slot, uint64_t generation, uint64_t nbytes) {
            return arena_read_frames(r.core(), slot, generation, nbytes);
          },
          py::arg("slot"), py::arg("generation"), py::arg("nbytes"))
      // Releases a slot named in a message this reader failed to unpickle.
      .def("release_unacquired", &TensorArenaReader::release_unacquired, py::arg("slot"),
           py::arg("generation"))
      // held, pinned_bytes, pending_releases, pin statistics.
      .def("stats", &TensorArenaReader::stats)
      // Whether [offset, offset+len) of the region is page-locked.
      .def("is_pinned", &TensorArenaReader::is_pinned)
      // (n_readers, num_slots, slot_bytes, policy) from the validated header.
      .def("geometry", &TensorArenaReader::geometry)
      // "alive" | "dead" | "unknown": the arena writer's liveness token.
      .def("writer_liveness", &TensorArenaReader::writer_liveness)
      .def_property_readonly("name", &TensorArenaReader::name)
      .def_property_readonly("rank", &TensorArenaReader::rank)
      .def_property_readonly("num_slots", &TensorArenaReader::num_slots)
      .def_property_readonly("slot_bytes", &TensorArenaReader::slot_bytes);

  // The message ring (RingWriter, RingReader, RING_FLAG_*): csrc/bindings/message_bindings.cpp.
  bind_messages(m);

  // A queue's local-socket directory in the shm directory ("" = the default): fresh 0700,
  // its name held by a liveness token until remove() (core/socket_dir.h).
  py::class_<SocketDir>(m, "SocketDir")
      .def(py::init([](const std::string& shm_dir) {
             return SocketDir::create(shm_dir.empty() ? ShmRegion::default_dir() : shm_dir);
           }),
           py::arg("shm_dir") = "")
      // Removes the socket only: nobody else can connect; the name stays taken.
      .def("unlink_socket", &SocketDir::unlink_socket)
      // Removes socket, token and directory, releasing the token (idempotent).
      .def("remove", &SocketDir::remove)
      .def_property_readonly("path", &SocketDir::path)
      .def_property_readonly("socket_path", &SocketDir::socket_path);

  // Tensor over a Python buffer: zero-copy over a writable one (a received ZeroMQ frame),
  // which it keeps alive; a read-only one (bytes) is copied once.
  m.def("tensor_from_buffer", &tensor_from_buffer, py::arg("buffer"), py::arg("dtype"),
        py::arg("shape"));
  // The C-level reducer_override installed on _ArenaPickler instances.
  m.def("make_reducer", &make_reducer);
  // The stub dtype strings readers accept (arena.py's _DTYPE_BY_NAME), registered at import.
  m.def("register_stub_dtypes", &register_stub_dtypes, py::arg("by_name"));
  // The parallel copy (for benchmarks and tests): dst/src are tensors, whole bytes.
  // shared=True copies as into shared memory (streaming stores from stream_min_bytes()).
  m.def(
      "parallel_copy",
      [](at::Tensor& dst, const at::Tensor& src, bool shared) {
        TORCH_CHECK_VALUE(dst.is_contiguous() && src.is_contiguous(), "tensors must be contiguous");
        TORCH_CHECK_VALUE(dst.nbytes() >= src.nbytes(), "dst is smaller than src");
        with_nogil([&] {
          parallel_copy(dst.data_ptr(), src.data_ptr(), src.nbytes(),
                        shared ? CopyTarget::kShared : CopyTarget::kLocal);
        });
      },
      py::arg("dst"), py::arg("src"), py::arg("shared") = false);
  // Copies into shared memory stream once a message has written n bytes (0: never).
  m.def("set_stream_min_bytes", &set_stream_min_bytes, py::arg("n"));
  m.def("stream_min_bytes", &stream_min_bytes);
  m.def("stream_copy_supported", &stream_copy_supported);
  m.def("copy_pool_stats", [] {
    CopyPoolStats s = copy_pool_stats();
    py::dict d;
    d["copies"] = s.copies;
    d["parallel_copies"] = s.parallel_copies;
    d["stream_copies"] = s.stream_copies;
    d["bytes"] = s.bytes;
    d["threads"] = s.threads;
    return d;
  });
  // Threads a copy may use (0 = automatic) and the size below which one memcpy is used.
  m.def("set_copy_threads", &set_copy_threads);
  // The queue's local readers, taken from the usable CPUs by the automatic thread count.
  m.def("set_copy_readers", &set_copy_readers, py::arg("n"));
  // Threads (caller included) the next large copy will use.
  m.def("copy_threads", &copy_threads);
  m.def("set_min_parallel_bytes", &set_min_parallel_bytes);
  // Bytes free in a shm directory, and the check that raises when too few are.
  m.def("shm_free_bytes", &ShmRegion::free_bytes);
  m.def("check_shm_free_space", &ShmRegion::check_free_space);
  m.def("default_shm_dir", &ShmRegion::default_dir);
  // Bytes a whole arena region needs (header, tables and slots).
  m.def(
      "arena_region_bytes",
      [](uint32_t n_readers, uint32_t num_slots, uint64_t slot_bytes, uint64_t arena_bytes,
         uint32_t max_allocations) {
        return arena_region_bytes(
            arena_config(n_readers, num_slots, slot_bytes, arena_bytes, max_allocations));
      },
      py::arg("n_readers"), py::arg("num_slots"), py::arg("slot_bytes"), py::arg("arena_bytes") = 0,
      py::arg("max_allocations") = 1024);
  // Removes stale arena/ring segments (writer provably dead) -> [(name, kind, writer, removed,
  // why)]; with dry_run nothing is removed.
  m.def(
      "remove_stale_segments",
      [](const std::string& dir, bool dry_run) {
        std::vector<SegmentReport> reports =
            with_nogil([&] { return remove_stale_segments(dir, dry_run); });
        py::list out;
        for (const SegmentReport& r : reports) {
          out.append(py::make_tuple(r.name, r.kind, liveness_name(r.writer), r.removed, r.why));
        }
        return out;
      },
      py::arg("dir"), py::arg("dry_run") = false);
  // Whether the process has a CUDA runtime loaded that the shim can use (never loads one).
  m.def("cuda_runtime_found", [] { return CudaRuntime::find() != nullptr; });
}
