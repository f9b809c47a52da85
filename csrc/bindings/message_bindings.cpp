#include "bindings/message_bindings.h"

#include <Python.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "bindings/gil.h"
#include "core/copy_pool.h"
#include "core/errors.h"
#include "core/frame_pool.h"
#include "core/frames.h"
#include "core/liveness.h"
#include "core/message_ring.h"
#include "core/ring.h"
#include "core/thread_placement.h"

namespace py = pybind11;

namespace vllm_shm_arena {

namespace {

// A Python timeout in seconds as the core's nanoseconds: < 0 (and anything too large to count
// in nanoseconds) waits without a limit.
int64_t timeout_ns(double seconds) {
  if (seconds < 0) return -1;
  const double ns = seconds * 1e9;
  if (!(ns < static_cast<double>(std::numeric_limits<int64_t>::max()))) return -1;
  return static_cast<int64_t>(ns);
}

/// The buffers of one message's frames, held for as long as their bytes are read.
class FrameViews {
 public:
  /// Room for `n` views up front: a Py_buffer is never moved once taken.
  explicit FrameViews(size_t n) { views_.reserve(n); }
  FrameViews(const FrameViews&) = delete;
  FrameViews& operator=(const FrameViews&) = delete;
  ~FrameViews() {
    for (Py_buffer& v : views_) PyBuffer_Release(&v);
  }

  /// Forgets the views without releasing them (for a thread that lost the GIL for good).
  void abandon() { views_.clear(); }

  /// Takes frame `index`'s buffer. A frame whose bytes are not one C-contiguous run (a
  /// strided or reversed memoryview) is refused: `buf`/`len` would name other bytes than the
  /// frame's, and a reversed view's `buf` points at its last element.
  const Py_buffer& add(py::handle frame, size_t index) {
    if (views_.size() == views_.capacity()) throw std::logic_error("FrameViews is full");
    Py_buffer v;
    if (PyObject_GetBuffer(frame.ptr(), &v, PyBUF_STRIDES) != 0) {
      PyErr_Clear();
      throw py::type_error("frame " + std::to_string(index) + " is not a buffer (got " +
                           std::string(Py_TYPE(frame.ptr())->tp_name) + ")");
    }
    if (!PyBuffer_IsContiguous(&v, 'C')) {
      PyBuffer_Release(&v);
      throw py::value_error("frame " + std::to_string(index) +
                            " is not a C-contiguous buffer (a strided or reversed view); pass "
                            "bytes(frame) or a contiguous copy");
    }
    views_.push_back(v);
    return views_.back();
  }

 private:
  std::vector<Py_buffer> views_;
};

/// The (pointer, length) of each of `frames`, whose buffers `views` holds.
FrameSpans frame_spans(const py::list& frames, FrameViews& views) {
  FrameSpans spans;
  spans.reserve(frames.size());
  for (size_t i = 0; i < frames.size(); ++i) {
    const Py_buffer& v = views.add(frames[i], i);
    spans.push_back(FrameSpan{static_cast<const uint8_t*>(v.buf), static_cast<uint64_t>(v.len)});
  }
  return spans;
}

/// The frames `spans` names (parsed by parse_frames, so each length is a checked private copy)
/// copied out into objects the caller owns for good: bytearrays, or PoolFrames from
/// kPooledFrameMinBytes on (a fresh allocation of that size would fault its pages in on the
/// copy). Called with the GIL held; the copies run without it.
py::list frames_copied_out(const FrameSpans& spans) {
  const size_t n = spans.size();
  PyObject* raw = PyList_New(static_cast<Py_ssize_t>(n));
  if (raw == nullptr) throw py::error_already_set();
  py::list out = py::reinterpret_steal<py::list>(raw);  // None until set
  std::vector<uint8_t*> dst(n, nullptr);
  std::vector<std::shared_ptr<PoolFrame>> pooled(n);
  for (size_t i = 0; i < n; ++i) {
    if (spans[i].len >= kPooledFrameMinBytes) continue;
    PyObject* ba = PyByteArray_FromStringAndSize(nullptr, static_cast<Py_ssize_t>(spans[i].len));
    if (ba == nullptr) throw py::error_already_set();
    PyList_SET_ITEM(out.ptr(), static_cast<Py_ssize_t>(i), ba);  // steals the reference
    dst[i] = reinterpret_cast<uint8_t*>(PyByteArray_AS_STRING(ba));
  }
  try {
    with_gated_nogil([&] {
      for (size_t i = 0; i < n; ++i) {
        if (spans[i].len < kPooledFrameMinBytes) continue;
        pooled[i] = PoolFrame::take(static_cast<size_t>(spans[i].len));
        dst[i] = pooled[i]->data();
      }
      for (size_t i = 0; i < n; ++i) {
        if (spans[i].len > 0) parallel_copy(dst[i], spans[i].data, spans[i].len);
      }
    });
  } catch (const ThreadExit&) {
    out.release();  // no GIL any more: leave the objects to the dying interpreter
    throw;          // (the pooled buffers go back as `pooled` unwinds: no Python in that)
  }
  for (size_t i = 0; i < n; ++i) {
    if (pooled[i]) out[i] = py::cast(pooled[i]);
  }
  return out;
}

/// _C.MessageRingWriter: the writer end of a ring in its own shm segment (core MessageRingWriter).
class PyMessageRingWriter {
 public:
  PyMessageRingWriter(uint32_t n_readers, uint32_t max_chunks, uint64_t max_chunk_bytes,
                      const std::string& dir)
      : core_(MessageRingWriter::create(n_readers, max_chunks, max_chunk_bytes,
                                        dir.empty() ? ShmRegion::default_dir() : dir)) {}

  /// Bytes of a message with these frame sizes once packed into a chunk.
  static uint64_t packed_bytes(const std::vector<uint64_t>& sizes) {
    FrameSpans lens(sizes.size());
    for (size_t i = 0; i < sizes.size(); ++i) lens[i].len = sizes[i];
    return framed_size(lens);
  }

  /// Packs `frames` into the next chunk and publishes it. Returns "ok", "timeout", or
  /// "no_space" (the shm filesystem could not back the chunk: an overflow marker was
  /// published instead, and the caller must send the message over the socket).
  std::string write(const py::list& frames, uint32_t flags, double timeout_s) {
    core_->require_owner("write");  // before the frames are looked at
    // Outlives the GIL-free part below: the views are released with the GIL held again.
    FrameViews views(frames.size());
    FrameSpans spans = frame_spans(frames, views);
    try {
      RingWriteStatus st =
          with_gated_nogil([&] { return core_->write(spans, flags, timeout_ns(timeout_s)); });
      switch (st) {
        case RingWriteStatus::kOk:
          return "ok";
        case RingWriteStatus::kTimeout:
          return "timeout";
        case RingWriteStatus::kNoSpace:
          return "no_space";
      }
      throw std::logic_error("unknown RingWriteStatus");
    } catch (const ThreadExit&) {
      views.abandon();  // no GIL any more: the buffers stay exported
      throw;
    }
  }

  /// Publishes an empty marker chunk (the message itself travels over the socket).
  bool write_marker(uint32_t flags, double timeout_s) {
    return with_gated_nogil([&] { return core_->write_marker(flags, timeout_ns(timeout_s)); });
  }

  /// Waits for the next chunk and holds it for the next write (see MessageRingWriter).
  bool reserve(double timeout_s) {
    core_->require_owner("reserve");
    if (core_->holds_reserved_chunk()) return true;  // no wait: keep the GIL
    return with_gated_nogil([&] { return core_->reserve(timeout_ns(timeout_s)); });
  }

  void shutdown() { core_->shutdown(); }
  void unlink() { core_->unlink(); }
  uint32_t dropped_readers() const { return core_->stats().dropped_readers; }
  uint64_t liveness_unknown() const { return core_->stats().liveness_unknown; }
  uint64_t published() const { return core_->stats().published; }
  std::string name() const { return core_->name(); }
  std::string dir() const { return core_->dir(); }

 private:
  std::unique_ptr<MessageRingWriter> core_;
};

/// _C.MessageRingReader: copies each message's frames out of the chunk and releases it at once, so
/// a message may be kept for as long as the caller likes.
class PyMessageRingReader {
 public:
  PyMessageRingReader(const std::string& name, uint32_t rank, const std::string& dir, bool cede_cpu)
      : core_(MessageRingReader::attach(name, rank, dir.empty() ? ShmRegion::default_dir() : dir)) {
    core_->set_cede_cpu(cede_cpu);
  }

  /// Waits up to `timeout_s` (< 0: forever) for the next message ->
  /// ("ok", flags, [bytearray...]) / ("timeout", 0, None) / ("shutdown", 0, None) /
  /// ("writer_dead", 0, None) once the writer's process is gone and its messages were read.
  py::tuple read(double timeout_s) {
    std::optional<py::tuple> got = take(timeout_s);
    if (!got) return py::make_tuple(last_status_, 0, py::none());
    return py::make_tuple("ok", (*got)[1], (*got)[2]);
  }

  /// Like read, but a message read goes straight into `sink` as sink.append({"seq": its
  /// number in the ring (from 1), "flags": ..., "frames": [...]}) before this returns its
  /// status: no Python code runs between the chunk's release and the message's arrival in the
  /// caller's hands, so an exception a signal handler raises as the call returns cannot lose
  /// it.
  std::string read_into(double timeout_s, const py::object& sink) {
    py::object append = sink.attr("append");  // before the read: a bad sink costs nothing
    std::optional<py::tuple> got = take(timeout_s);
    if (!got) return last_status_;
    py::dict entry;
    entry["seq"] = (*got)[0];
    entry["flags"] = (*got)[1];
    entry["frames"] = (*got)[2];
    append(entry);
    return "ok";
  }

  uint32_t rank() const { return core_->rank(); }
  uint64_t consumed() const { return core_->consumed(); }
  bool cede_cpu() const { return core_->cede_cpu(); }
  py::dict wait_stats() const {
    const RingWaitStats& w = core_->wait_stats();
    py::dict d;
    d["ready"] = w.ready;
    d["spun"] = w.spun;
    d["slept"] = w.slept;
    d["ceded"] = w.ceded;
    d["spin_s"] = static_cast<double>(w.spin_ns) * 1e-9;
    return d;
  }
  /// "alive", "dead" or "unknown": the ring writer's liveness token.
  std::string writer_liveness() const { return liveness_name(core_->writer_liveness()); }

 private:
  /// The next message as (seq, flags, frames) with its chunk released, or nullopt and the
  /// status in last_status_.
  std::optional<py::tuple> take(double timeout_s) {
    const int64_t ns = timeout_ns(timeout_s);
    RingMessage m = with_gated_nogil([&] { return core_->acquire(ns); });
    switch (m.status) {
      case RingReader::Status::kOk:
        break;
      case RingReader::Status::kTimeout:
        last_status_ = "timeout";
        return std::nullopt;
      case RingReader::Status::kShutdown:
        last_status_ = "shutdown";
        return std::nullopt;
      case RingReader::Status::kWriterDead:
        last_status_ = "writer_dead";
        return std::nullopt;
    }
    py::list frames;
    try {
      frames = frames_copied_out(m.frames);
    } catch (const ThreadExit&) {
      frames.release();  // no GIL any more: leave the object to the dying interpreter
      core_->release();
      throw;
    } catch (...) {
      core_->release();
      throw;
    }
    core_->release();
    return py::make_tuple(core_->consumed(), m.flags, frames);
  }

  std::unique_ptr<MessageRingReader> core_;
  const char* last_status_ = "timeout";
};

}  // namespace

std::optional<std::tuple<uint32_t, uint64_t, uint64_t>> arena_write_frames(ArenaWriter& writer,
                                                                           const py::list& frames,
                                                                           uint64_t max_bytes) {
  FrameViews views(frames.size());
  FrameSpans spans = frame_spans(frames, views);
  const uint64_t total = framed_size(spans);
  if (total > max_bytes) return std::nullopt;
  try {
    return with_gated_nogil([&]() -> std::optional<std::tuple<uint32_t, uint64_t, uint64_t>> {
      std::optional<Allocation> a = writer.allocate(total);
      if (!a) return std::nullopt;
      pack_frames(a->data, spans);
      writer.publish(*a);
      return std::make_tuple(a->slot, a->generation, total);
    });
  } catch (const ThreadExit&) {
    views.abandon();  // no GIL any more: the buffers stay exported
    throw;
  }
}

py::list arena_read_frames(ArenaReader& reader, uint32_t slot, uint64_t generation,
                           uint64_t nbytes) {
  if (slot >= reader.max_slots()) {
    throw OutOfRange("blob slot " + std::to_string(slot) + " out of range [0, " +
                     std::to_string(reader.max_slots()) + ")");
  }
  const uint8_t* p = reader.acquire(slot, generation, nbytes, 0);
  py::list frames;
  try {
    frames = frames_copied_out(parse_frames(p, nbytes));
  } catch (const ThreadExit&) {
    frames.release();  // no GIL any more: leave the object to the dying interpreter
    reader.release(slot, generation);
    throw;
  } catch (...) {
    reader.release(slot, generation);
    throw;
  }
  reader.release(slot, generation);
  return frames;
}

void bind_messages(py::module_& m) {
  // A frame copied out into the frame pool: a writable buffer; len() is its size.
  py::class_<PoolFrame, std::shared_ptr<PoolFrame>>(m, "PoolFrame", py::buffer_protocol())
      .def_buffer([](PoolFrame& f) {
        return py::buffer_info(f.data(), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(f.size())}, {1}, /*readonly=*/false);
      })
      .def("__len__", &PoolFrame::size);
  py::class_<PyMessageRingWriter, std::shared_ptr<PyMessageRingWriter>>(m, "MessageRingWriter")
      // Creates the ring's shm region: n_readers x max_chunks x max_chunk_bytes.
      .def(py::init<uint32_t, uint32_t, uint64_t, const std::string&>(), py::arg("n_readers"),
           py::arg("max_chunks"), py::arg("max_chunk_bytes"), py::arg("dir") = "")
      // Packs frames into the next chunk -> "ok" | "timeout" | "no_space".
      .def("write", &PyMessageRingWriter::write, py::arg("frames"), py::arg("flags"),
           py::arg("timeout_s"))
      // Publishes an empty chunk carrying only flags (message on the socket).
      .def("write_marker", &PyMessageRingWriter::write_marker, py::arg("flags"),
           py::arg("timeout_s"))
      // Waits for the next chunk and holds it for the next write (True), or times out (False).
      .def("reserve", &PyMessageRingWriter::reserve, py::arg("timeout_s"))
      // Bytes a message with these frame sizes takes in a chunk.
      .def_static("packed_bytes", &PyMessageRingWriter::packed_bytes)
      // Wakes every blocked reader, which then sees "shutdown".
      .def("shutdown", &PyMessageRingWriter::shutdown)
      .def("unlink", &PyMessageRingWriter::unlink)
      .def("dropped_readers", &PyMessageRingWriter::dropped_readers)
      // Liveness probes of lagging readers the kernel did not answer (kept as alive).
      .def("liveness_unknown", &PyMessageRingWriter::liveness_unknown)
      .def("published", &PyMessageRingWriter::published)
      .def_property_readonly("name", &PyMessageRingWriter::name)
      .def_property_readonly("dir", &PyMessageRingWriter::dir);
  m.attr("RING_FLAG_OVERFLOW") = kRingFlagOverflow;
  m.attr("RING_FLAG_NO_SPACE") = kRingFlagNoSpace;
  // With RING_FLAG_OVERFLOW: the message is an arena blob the marker's frames name (not on
  // the socket).
  m.attr("RING_FLAG_BLOB") = kRingFlagBlob;

  py::class_<PyMessageRingReader, std::shared_ptr<PyMessageRingReader>>(m, "MessageRingReader")
      // Attaches reader `rank` of ring `name`; cede_cpu: RingReader::set_cede_cpu.
      .def(py::init<const std::string&, uint32_t, const std::string&, bool>(), py::arg("name"),
           py::arg("rank"), py::arg("dir") = "", py::arg("cede_cpu") = false)
      // Next message -> (status, flags, frames as bytearrays), chunk released at once.
      .def("read", &PyMessageRingReader::read, py::arg("timeout_s"))
      // Next message appended to sink as {"seq", "flags", "frames"} -> status ("ok", ...).
      .def("read_into", &PyMessageRingReader::read_into, py::arg("timeout_s"), py::arg("sink"))
      .def("consumed", &PyMessageRingReader::consumed)
      .def_property_readonly("cede_cpu", &PyMessageRingReader::cede_cpu)
      // How its waits ended: {"ready", "spun", "slept", "ceded", "spin_s"} (ring.h,
      // RingWaitStats).
      .def("wait_stats", &PyMessageRingReader::wait_stats)
      // "alive" | "dead" | "unknown": the ring writer's liveness token.
      .def("writer_liveness", &PyMessageRingReader::writer_liveness)
      .def_property_readonly("rank", &PyMessageRingReader::rank);

  // Threads of this process whose name starts with a prefix (a ZeroMQ context's I/O threads),
  // kept off the CPU of the thread that sends (core/thread_placement.h).
  m.def("find_threads", &find_threads, py::arg("prefix"));
  py::class_<ThreadPlacement, std::shared_ptr<ThreadPlacement>>(m, "ThreadPlacement")
      .def(py::init<const std::vector<pid_t>&>(), py::arg("tids"))
      // Each thread's mask minus the caller's CPU; release() makes it whole again.
      .def("keep_off_caller", &ThreadPlacement::keep_off_caller)
      .def("release", &ThreadPlacement::release)
      .def("__len__", &ThreadPlacement::size)
      .def_property_readonly("avoided_cpu", &ThreadPlacement::avoided_cpu)
      .def_property_readonly("moves", &ThreadPlacement::moves);
}

}  // namespace vllm_shm_arena
