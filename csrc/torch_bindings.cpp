// The module vllm_shm_arena._C. PYBIND11_MODULE below exports the arena, the stubs, the socket
// directory and the cleaner's helpers, and calls bind_messages and bind_call_safety for the rest;
// this file also holds the out-of-band rebuild (a tensor over a received buffer). Each exported
// class has its C++ name (the message ring's wrappers add only the Py prefix). What the names
// stand for lives beside this file, one job per file:
//   csrc/bindings/tensor_arena.h      allocation records as at::Tensors (TensorArenaWriter,
//                                     TensorArenaReader)
//   csrc/bindings/stubs.{h,cpp}       the pickled form of an arena tensor: C reducer, stub rebuild
//   csrc/bindings/message_bindings.*  the message ring and arena blobs (bound by bind_messages)
//   csrc/bindings/gil.h               calls without the GIL (why none re-takes it in a destructor)
//   csrc/bindings/call_safety.*       calls a signal handler's exception cannot split (bound by
//                                     bind_call_safety)
// and everything under them in csrc/core, which knows neither torch nor Python.
#include <Python.h>
#include <torch/extension.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "bindings/call_safety.h"
#include "bindings/gil.h"
#include "bindings/message_bindings.h"
#include "bindings/stubs.h"
#include "bindings/tensor_arena.h"
#include "core/allocation_policy.h"
#include "core/arena.h"
#include "core/copy_pool.h"
#include "core/cuda_shim.h"
#include "core/errors.h"
#include "core/frame_pool.h"
#include "core/shm_region.h"
#include "core/socket_dir.h"
#include "core/stale_segments.h"

#ifndef VSA_TORCH_VERSION
#define VSA_TORCH_VERSION "unknown"
#endif

namespace py = pybind11;

namespace vllm_shm_arena {

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

  py::class_<TensorArenaWriter, std::shared_ptr<TensorArenaWriter>>(m, "TensorArenaWriter")
      // Creates the region (checking free space in `dir`, "" = default /dev/shm).
      // `counted`: a counted arena (core/arena_layout.h), sent many times and forwarded.
      .def(py::init<uint32_t, uint32_t, uint64_t, const std::string&, uint64_t, uint32_t, bool>(),
           py::arg("n_readers"), py::arg("num_slots"), py::arg("slot_bytes"), py::arg("dir") = "",
           py::arg("arena_bytes") = 0, py::arg("max_allocations") = 1024,
           py::arg("counted") = false)
      // A tensor lent from the arena (filled in place, sent without a copy), or None.
      .def("empty", &TensorArenaWriter::empty, py::arg("shape"), py::arg("dtype"))
      // Publishes an unsent loan holding this tensor -> (slot, generation, offset), or None.
      .def("send_loan", &TensorArenaWriter::send_loan, py::arg("tensor"))
      // Copies a tensor into a free slot -> (slot, generation), or None when declined.
      .def(
          "write_tensor",
          [](TensorArenaWriter& w, const at::Tensor& t) {
            return with_gated_nogil([&] { return w.write_tensor(t); });
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
      // Holds published allocation (slot, generation) for a send of its bytes by reference
      // -> SendHold (a read-only buffer); the slot is not recycled while it lives.
      .def(
          "hold_for_send",
          [](TensorArenaWriter& w, uint32_t slot, uint64_t generation) {
            return w.core().hold_for_send(slot, generation);
          },
          py::arg("slot"), py::arg("generation"))
      // Gives back an allocation whose stub never left this process.
      .def("abort", &TensorArenaWriter::abort, py::arg("slot"), py::arg("generation"))
      // Counted arenas: takes back one send whose message did not go.
      .def("unsend", &TensorArenaWriter::unsend, py::arg("slot"), py::arg("generation"))
      .def_property_readonly("counted", &TensorArenaWriter::counted)
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
      // One reader's state ("never_attached", "attached", "detached", "dead"); no walk.
      .def("reader_state", &TensorArenaWriter::reader_state, py::arg("rank"))
      // Removes the shm name; mappings stay valid.
      .def("unlink", &TensorArenaWriter::unlink)
      .def_property_readonly("name", &TensorArenaWriter::name)
      .def_property_readonly("dir", &TensorArenaWriter::dir)
      .def_property_readonly("slot_bytes", &TensorArenaWriter::max_allocation)
      .def_property_readonly("n_readers", &TensorArenaWriter::n_readers);

  // What ArenaReader.hold_slots returns: its slots are released when it dies.
  py::class_<SlotHolds, std::shared_ptr<SlotHolds>>(m, "SlotHolds");
  py::class_<TensorArenaReader, std::shared_ptr<TensorArenaReader>>(m, "TensorArenaReader")
      // Attaches reader `rank` of arena `name`; pins lazily, the whole data region at once
      // (pin_chunk_bytes 0) or in chunks of whole slots.
      .def(py::init<const std::string&, uint32_t, const std::string&, uint64_t, py::object>(),
           py::arg("name"), py::arg("rank"), py::arg("dir") = "", py::arg("pin_chunk_bytes") = 0,
           py::arg("expect") = py::none())
      // Zero-copy tensor over a slot; generation 0 = whatever the slot holds now.
      // Counted arenas: `stubs` is how many stubs the view stands for (0: one more view under a
      // hold that counted its stub).
      .def("get_tensor", &TensorArenaReader::get_tensor, py::arg("slot"), py::arg("generation"),
           py::arg("nbytes"), py::arg("dtype"), py::arg("shape"), py::arg("cuda_context"),
           py::arg("offset") = 0, py::arg("stubs") = 1)
      // An arena stub's fields, checked, -> its tensor (what _rebuild_arena_tensor calls).
      .def("rebuild", &rebuild_stub, py::arg("slot_idx"), py::arg("generation"), py::arg("nbytes"),
           py::arg("dtype_str"), py::arg("shape"), py::arg("offset"), py::arg("cuda_context"))
      // Releases freed slots whose DMA completed; `stream` is a cudaStream_t as an int.
      .def(
          "flush_releases",
          [](TensorArenaReader& r, uintptr_t stream) {
            return with_gated_nogil([&] { return r.flush_releases(stream); });
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
      // Holds a message's (slot, generation) pairs until the returned object dies.
      .def("hold_slots", &TensorArenaReader::hold_slots, py::arg("pairs"))
      // Releases a slot named in a message this reader failed to unpickle.
      .def("release_unacquired", &TensorArenaReader::release_unacquired, py::arg("slot"),
           py::arg("generation"))
      // Counted arenas, reader 0: one more / one fewer forward of a held allocation.
      .def("forward", &TensorArenaReader::forward, py::arg("slot"), py::arg("generation"))
      .def("unforward", &TensorArenaReader::unforward, py::arg("slot"), py::arg("generation"))
      // Every forward a list records taken back, each removed from the list as it goes.
      .def("unforward_all", &TensorArenaReader::unforward_all, py::arg("forwarded"))
      // The held allocation a contiguous CPU tensor lies in -> (slot, generation, offset,
      // nbytes), or None.
      .def("find_hold", &TensorArenaReader::find_hold, py::arg("tensor"))
      .def_property_readonly("counted", &TensorArenaReader::counted)
      // Reader `rank`'s state: "never_attached" | "attached" | "detached" | "dead".
      .def("reader_state", &TensorArenaReader::reader_state, py::arg("rank"))
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
  // The call lock, whole-message socket sends and receives, the exit gate:
  // csrc/bindings/call_safety.cpp.
  bind_call_safety(m);

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
    d["wide_copies"] = s.wide_copies;
    d["stream_copies"] = s.stream_copies;
    d["bytes"] = s.bytes;
    d["threads"] = s.threads;
    return d;
  });
  // The frame pool (frame_pool.h): warm buffers for large socket frames and frames copied out.
  m.def("frame_pool_stats", [] {
    FramePoolStats s = FramePool::process().stats();
    py::dict d;
    d["takes"] = s.takes;
    d["warm_takes"] = s.warm_takes;
    d["mapped"] = s.mapped;
    d["unmapped"] = s.unmapped;
    d["idle_bytes"] = s.idle_bytes;
    d["in_use_bytes"] = s.in_use_bytes;
    d["max_idle_bytes"] = FramePool::process().max_idle_bytes();
    return d;
  });
  // Idle bytes the frame pool keeps at most (0: none).
  m.def(
      "set_frame_pool_max_idle_bytes",
      [](uint64_t n) { FramePool::process().set_max_idle_bytes(n); }, py::arg("n"));
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
         uint32_t max_allocations, bool counted) {
        return arena_region_bytes(
            arena_config(n_readers, num_slots, slot_bytes, arena_bytes, max_allocations, counted));
      },
      py::arg("n_readers"), py::arg("num_slots"), py::arg("slot_bytes"), py::arg("arena_bytes") = 0,
      py::arg("max_allocations") = 1024, py::arg("counted") = false);
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
