// See stubs.h. One C call per tensor on both sides instead of a Python check per field.
#include "bindings/stubs.h"

#include <Python.h>
#include <torch/csrc/autograd/python_variable.h>

#include <array>
#include <optional>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "core/errors.h"

namespace vllm_shm_arena {

namespace py = pybind11;

namespace {
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

}  // namespace

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
  // A queue message's stubs are counted once, by its frame 0 hold (hold_slots): the tensor
  // is one more view under it (counted arenas; accept-once ones ignore the count).
  return reader.get_tensor(static_cast<uint32_t>(*slot), *gen, *n, dtype, dims, cuda_context, *off,
                           /*stubs=*/0);
}

// ---------------------------------------------------------------------------------------
// The pickler's per-object check, as a C-level callable (see vllm_shm_arena/pickler.py for
// the Python reference it mirrors). Non-tensors return NotImplemented after one pointer
// comparison, which is what keeps pickling of tensor-free messages at full speed.

namespace {

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
  // Forwarding (a counted arena's reader 0 in this process, or none): a tensor lying in one of
  // its holds goes as a forward stub, counted with forward(), instead of being copied, while
  // every one of ranks 1..fwd_ranks is attached. `forwarded` gets (slot, generation) per
  // forward, like `diverted`.
  std::shared_ptr<TensorArenaReader> fwd;
  uint32_t fwd_ranks = 0;
  py::object fwd_name, rebuild_forwarded, forwarded;
};

// Whether every rank 1..fwd_ranks of the forwarding arena is attached now (a rank that is
// not could not resolve a forward stub; a dead one owes nothing and is never sent one).
bool forward_targets_attached(const ReducerState& st) {
  for (uint32_t r = 1; r <= st.fwd_ranks; ++r) {
    if (st.fwd->core().reader_state(r) != ReaderState::kAttached) return false;
  }
  return true;
}

// `t` (contiguous, CPU, a stub dtype) as a forward stub when it lies in one of the forwarding
// reader's holds and every target is attached: the (rebuild, args) tuple, counted with one
// forward and listed in `forwarded`; nullptr with no error set when it does not apply.
PyObject* forward_stub(ReducerState* st, const at::Tensor& t, const py::object& dtype_name) {
  auto hold = st->fwd->find_hold(t);
  if (!hold || !forward_targets_attached(*st)) return nullptr;
  auto [slot, gen, offset, alloc_bytes] = *hold;
  (void)alloc_bytes;
  st->fwd->forward(slot, gen);
  py::tuple key = py::make_tuple(slot, gen);
  if (PyList_Append(st->forwarded.ptr(), key.ptr()) != 0) {
    st->fwd->unforward(slot, gen);
    throw py::error_already_set();
  }
  py::tuple shape(t.dim());
  for (int64_t i = 0; i < t.dim(); ++i) shape[i] = py::int_(t.size(i));
  py::tuple args =
      py::make_tuple(st->fwd_name, slot, gen, tensor_nbytes(t), dtype_name, shape, offset);
  return py::make_tuple(st->rebuild_forwarded, args).release().ptr();
}

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
    if (st->fwd && dtype_name && tp == st->tensor_type.ptr() && t.is_contiguous()) {
      if (PyObject* stub = forward_stub(st, t, dtype_name)) return stub;
    }
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
          with_gated_nogil([&] { return st->writer->write_checked(t, working_set); });
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

}  // namespace

py::object make_reducer(std::shared_ptr<TensorArenaWriter> writer, py::object tensor_type,
                        py::object param_type, py::object rebuild_tensor, py::object rebuild_param,
                        py::dict dtype_names, uint64_t min_bytes, py::list diverted,
                        py::object forward) {
  auto st = std::make_unique<ReducerState>();
  if (!forward.is_none()) {
    auto [reader, ranks, name, rebuild, forwarded] =
        forward.cast<std::tuple<std::shared_ptr<TensorArenaReader>, uint32_t, py::object,
                                py::object, py::list>>();
    if (!reader) throw InvalidArgument("make_reducer: forward names no reader");
    st->fwd = std::move(reader);
    st->fwd_ranks = ranks;
    st->fwd_name = std::move(name);
    st->rebuild_forwarded = std::move(rebuild);
    st->forwarded = std::move(forwarded);
  }
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
