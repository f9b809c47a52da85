#include "bindings/call_safety.h"

#include <Python.h>
#include <dlfcn.h>
#include <link.h>
#include <pythread.h>

#include <cerrno>
#include <cstring>
#include <type_traits>

#include <chrono>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>

#include "bindings/gil.h"
#include "bindings/message_bindings.h"
#include "core/arena.h"
#include "core/call_lock.h"
#include "core/copy_pool.h"
#include "core/frame_pool.h"

namespace py = pybind11;

namespace vllm_shm_arena {

namespace {

/// How long a wait for the call lock sleeps between checks for signal handlers.
constexpr int64_t kLockSliceNs = 20'000'000;

uint64_t this_thread_token() { return static_cast<uint64_t>(PyThread_get_thread_ident()); }

/// _C.CallLock: threading.Lock's interface (acquire, release, locked) over core CallLock; a
/// queue call holds it through call_locked.
class PyCallLock {
 public:
  /// Takes the lock (blocking: waiting up to `timeout` s, < 0 without limit) -> whether this
  /// thread took it. A wait runs signal handlers between slices (what they raise propagates,
  /// the lock not taken). False, without waiting, when this thread holds it already.
  bool acquire(bool blocking, double timeout) {
    return take(blocking ? timeout : 0.0) == CallLock::Result::kAcquired;
  }

  void release() {
    if (!core_.release()) throw std::runtime_error("release unlocked CallLock");
  }

  bool locked() { return core_.locked(); }

  /// Whether the calling thread holds it.
  bool held_by_caller() { return core_.owner() == this_thread_token(); }

  CallLock::Result take(double timeout_s) {
    const uint64_t me = this_thread_token();
    CallLock::Result r = core_.acquire(me, 0);
    if (r != CallLock::Result::kTimeout || timeout_s == 0.0) return r;
    const bool forever = timeout_s < 0;
    const auto deadline =
        std::chrono::steady_clock::now() +
        std::chrono::nanoseconds(forever ? 0 : static_cast<int64_t>(timeout_s * 1e9));
    for (;;) {
      int64_t slice = kLockSliceNs;
      if (!forever) {
        const int64_t left = std::chrono::duration_cast<std::chrono::nanoseconds>(
                                 deadline - std::chrono::steady_clock::now())
                                 .count();
        if (left <= 0) return CallLock::Result::kTimeout;
        slice = std::min(slice, left);
      }
      r = with_nogil([&] { return core_.acquire(me, slice); });
      if (r != CallLock::Result::kTimeout) return r;
      // Between slices: a signal handler's exception ends the wait, the lock not taken.
      if (PyErr_CheckSignals() != 0) throw py::error_already_set();
    }
  }

 private:
  CallLock core_;
};

/// Runs fn(*args) holding `lock`: taken (waiting up to `timeout_s`, < 0 without limit,
/// TimeoutError naming `what`; RuntimeError for a nested call of the same thread) and let go
/// here, in C, whatever fn returns or raises. No bytecode of the caller's runs between the
/// taking and fn, or between fn's end and the letting go, so no exception a signal handler
/// raises can leave the lock held (a with-block cannot promise that: its __exit__ is called by
/// bytecodes of the caller's after the block's last one).
py::object call_locked(PyCallLock& lock, double timeout_s, const std::string& what,
                       const py::object& fn, const py::tuple& args) {
  switch (lock.take(timeout_s)) {
    case CallLock::Result::kAcquired:
      break;
    case CallLock::Result::kHeldByCaller:
      throw std::runtime_error(
          "a call on this MessageQueue from inside another of its calls in the same thread (a "
          "signal handler?); the queue's calls do not nest");
    case CallLock::Result::kTimeout:
      PyErr_SetString(
          PyExc_TimeoutError,
          ("timed out waiting for another thread's " + what + " on this queue").c_str());
      throw py::error_already_set();
  }
  py::object out;
  try {
    out = fn(*args);
  } catch (...) {
    lock.release();
    throw;
  }
  lock.release();
  return out;
}

// ---------------------------------------------------------------------------------------
// libzmq, called directly. pyzmq's send and receive run the process's signal handlers after
// every call (its _check_rc calls PyErr_CheckSignals, success or not), so what a handler raises
// there hides whether a frame went or came: a message could be half sent, or a received frame
// dropped. The queue's sends and receives call libzmq itself (the library pyzmq loaded, found
// among the process's loaded objects) and run no handler: a signal that arrives meanwhile is
// handled by the caller's next bytecode, after this call has recorded what it did.

struct ZmqMsg {
  unsigned char _[64];  // zmq_msg_t: 64 bytes, opaque (zmq.h)
};

struct ZmqApi {
  int (*msg_init)(ZmqMsg*) = nullptr;
  int (*msg_recv)(ZmqMsg*, void*, int) = nullptr;
  int (*msg_close)(ZmqMsg*) = nullptr;
  void* (*msg_data)(ZmqMsg*) = nullptr;
  size_t (*msg_size)(const ZmqMsg*) = nullptr;
  int (*msg_more)(const ZmqMsg*) = nullptr;
  int (*send)(void*, const void*, size_t, int) = nullptr;
  int (*msg_init_data)(ZmqMsg*, void*, size_t, void (*)(void*, void*), void*) = nullptr;
  int (*msg_send)(ZmqMsg*, void*, int) = nullptr;
  int (*errno_)() = nullptr;
};

int find_libzmq(struct dl_phdr_info* info, size_t, void* out) {
  if (info->dlpi_name != nullptr && std::strstr(info->dlpi_name, "libzmq") != nullptr) {
    *static_cast<std::string*>(out) = info->dlpi_name;
    return 1;
  }
  return 0;
}

const ZmqApi& zmq_api() {
  static const ZmqApi api = [] {
    std::string path;
    dl_iterate_phdr(find_libzmq, &path);
    void* h = path.empty() ? RTLD_DEFAULT : dlopen(path.c_str(), RTLD_NOW | RTLD_NOLOAD);
    if (h == nullptr) h = RTLD_DEFAULT;
    ZmqApi a;
    auto sym = [&](auto& fp, const char* name) {
      fp = reinterpret_cast<std::remove_reference_t<decltype(fp)>>(dlsym(h, name));
      if (fp == nullptr) {
        throw std::runtime_error(std::string("vllm_shm_arena: libzmq's ") + name +
                                 " not found in this process (import zmq first)");
      }
    };
    sym(a.msg_init, "zmq_msg_init");
    sym(a.msg_recv, "zmq_msg_recv");
    sym(a.msg_close, "zmq_msg_close");
    sym(a.msg_data, "zmq_msg_data");
    sym(a.msg_size, "zmq_msg_size");
    sym(a.msg_more, "zmq_msg_more");
    sym(a.send, "zmq_send");
    sym(a.msg_init_data, "zmq_msg_init_data");
    sym(a.msg_send, "zmq_msg_send");
    sym(a.errno_, "zmq_errno");
    return a;
  }();
  return api;
}

/// pyzmq's exception for libzmq error `err` (zmq.Again for EAGAIN), set as the Python error.
[[noreturn]] void raise_zmq_error(int err) {
  py::module_ zmq = py::module_::import("zmq");
  py::object cls = zmq.attr(err == EAGAIN ? "Again" : "ZMQError");
  PyErr_SetObject(cls.ptr(), cls(err).ptr());
  throw py::error_already_set();
}

/// A received frame: the libzmq message, read as a writable buffer (tensors may alias it,
/// keeping it alive), closed when the last view is gone.
class ZmqFrame {
 public:
  ZmqFrame() = default;
  ZmqFrame(const ZmqFrame&) = delete;
  ZmqFrame& operator=(const ZmqFrame&) = delete;
  ~ZmqFrame() {
    if (open_) zmq_api().msg_close(&msg_);
  }
  ZmqMsg* msg() { return &msg_; }
  void opened() { open_ = true; }
  uint8_t* data() { return static_cast<uint8_t*>(zmq_api().msg_data(&msg_)); }
  size_t size() const { return zmq_api().msg_size(&msg_); }
  /// A memoryview of the frame (pyzmq's Frame.buffer).
  py::memoryview buffer(py::object self) {
    PyObject* mv = PyMemoryView_FromObject(self.ptr());
    if (mv == nullptr) throw py::error_already_set();
    return py::reinterpret_steal<py::memoryview>(mv);
  }

 private:
  ZmqMsg msg_{};
  bool open_ = false;
};

namespace {

/// Sends `len` bytes at `src` as one frame of a message on `sock`, copied: into a warm buffer
/// of the frame pool from kPooledFrameMinBytes on (ZeroMQ gives it back through zmq_free once
/// every subscriber's copy is written), else by zmq_send's own copy. -1 with `*err` set when
/// the socket did not take it; an interrupted frame is retried unless `first` (nothing of
/// the message went: the caller may raise).
int send_one(const ZmqApi& z, void* sock, const void* src, size_t len, int flags, bool first,
             int* err) {
  int rc = -1;
  if (len < kPooledFrameMinBytes) {
    for (;;) {
      rc = z.send(sock, src, len, flags);
      if (rc >= 0) return rc;
      *err = z.errno_();
      if (*err != EINTR || first) return rc;  // a first frame interrupted: nothing went
    }
  }
  with_nogil([&] {
    FrameBuffer* buf = FramePool::process().take(len);
    parallel_copy(buf->data, src, len);
    ZmqMsg msg;
    z.msg_init_data(&msg, buf->data, len, &FramePool::zmq_free, buf);
    for (;;) {
      rc = z.msg_send(&msg, sock, flags);
      if (rc >= 0) return;
      *err = z.errno_();
      if (*err != EINTR || first) break;
    }
    z.msg_close(&msg);  // not sent: the buffer goes back to the pool
  });
  return rc;
}

/// ZeroMQ's zmq_free_fn for a frame sent by reference from an arena allocation: `hint` is a
/// heap copy of the frame's std::shared_ptr<SendHold>; the hold ends with the last of them.
void free_held(void* /*data*/, void* hint) noexcept {
  delete static_cast<std::shared_ptr<SendHold>*>(hint);
}

/// Sends `len` bytes of `hold` from `off` as one frame of a message on `sock`, by reference:
/// ZeroMQ reads the arena allocation itself, which the hold keeps from being recycled until
/// ZeroMQ lets go of the frame (free_held). -1 with `*err` set when the socket did not take
/// it; an interrupted frame is retried unless `first` (nothing of the message went).
int send_held(const ZmqApi& z, void* sock, const std::shared_ptr<SendHold>& hold, size_t off,
              size_t len, int flags, bool first, int* err) {
  auto* hint = new std::shared_ptr<SendHold>(hold);
  ZmqMsg msg;
  auto* data = const_cast<uint8_t*>(hold->data()) + off;  // ZeroMQ's signature; only read
  if (z.msg_init_data(&msg, data, len, &free_held, hint) != 0) {
    *err = z.errno_();
    delete hint;  // ZeroMQ took nothing
    return -1;
  }
  int rc = -1;
  for (;;) {
    rc = z.msg_send(&msg, sock, flags);
    if (rc >= 0) return rc;
    *err = z.errno_();
    if (*err != EINTR || first) break;
  }
  z.msg_close(&msg);  // not sent: the hold's copy goes at once
  return rc;
}

}  // namespace

/// Sends `frames` as one message on the libzmq socket `handle` (pyzmq's Socket.underlying),
/// copied, except a _C.SendHold frame (an arena allocation's bytes), which goes by reference
/// (send_held). `first_flags` go with the first frame, `more` with every frame but the last. An
/// out-of-band buffer (frame 2 on) longer than `split_above` goes as frames of `part_bytes`
/// (> 0), the last one shorter (protocol.py's split table says so to the reader). After each frame
/// the socket took whole (all its parts), progress[0] is its count, in this same C call: whatever
/// this raises, progress says exactly how much went. The first frame may fail (zmq.Again:
/// nothing went); a later one is retried through EINTR, so a message never stops half-way
/// for a signal.
void send_frames(uintptr_t handle, const py::list& frames, int first_flags, int more,
                 const py::list& progress, uint64_t part_bytes, uint64_t split_above) {
  const ZmqApi& z = zmq_api();
  void* sock = reinterpret_cast<void*>(handle);
  if (sock == nullptr) raise_zmq_error(ENOTSOCK);
  if (progress.size() < 1) throw py::value_error("progress must have one item");
  if (part_bytes == 0) throw py::value_error("part_bytes must be > 0");
  progress[0] = 0;
  const size_t n = frames.size();
  for (size_t i = 0; i < n; ++i) {
    // Frame i as parts of `part` bytes (one part unless split); `send(off, chunk, flags)`
    // sends one part -> libzmq's rc, `err` set when < 0.
    int err = 0;
    auto send_parts = [&](size_t len, auto&& send) {
      const size_t part = (i >= 2 && len > split_above) ? static_cast<size_t>(part_bytes) : len;
      size_t off = 0;
      int rc = 0;
      do {
        const size_t chunk = std::min(part, len - off);
        const bool last_part = off + chunk == len;
        int flags = (i + 1 < n || !last_part) ? more : 0;
        if (i == 0) flags |= first_flags;
        rc = send(off, chunk, flags);
        if (rc < 0) break;
        off += chunk;
      } while (off < len);
      return rc;
    };
    int rc;
    if (py::isinstance<SendHold>(frames[i])) {
      // An arena allocation's bytes, sent by reference (see send_held).
      auto hold = frames[i].cast<std::shared_ptr<SendHold>>();
      rc = send_parts(static_cast<size_t>(hold->nbytes()), [&](size_t off, size_t chunk, int f) {
        return chunk == 0 ? send_one(z, sock, hold->data(), 0, f, i == 0, &err)
                          : send_held(z, sock, hold, off, chunk, f, i == 0, &err);
      });
    } else {
      Py_buffer view;
      if (PyObject_GetBuffer(frames[i].ptr(), &view, PyBUF_SIMPLE) != 0)
        throw py::error_already_set();
      const auto* p = static_cast<const uint8_t*>(view.buf);
      try {
        rc = send_parts(static_cast<size_t>(view.len), [&](size_t off, size_t chunk, int f) {
          return send_one(z, sock, p + off, chunk, f, i == 0, &err);
        });
      } catch (...) {
        PyBuffer_Release(&view);
        throw;
      }
      PyBuffer_Release(&view);
    }
    if (rc < 0) raise_zmq_error(err);
    progress[0] = i + 1;
  }
}

/// The parts of one split buffer (protocol.py's split table), joined into one warm buffer of
/// the frame pool (GIL released for the copy).
std::shared_ptr<PoolFrame> join_frames(const py::list& parts) {
  std::vector<Py_buffer> views;
  views.reserve(parts.size());
  auto release = [&] {
    for (Py_buffer& v : views) PyBuffer_Release(&v);
  };
  size_t total = 0;
  try {
    for (const py::handle& h : parts) {
      Py_buffer v;
      if (PyObject_GetBuffer(h.ptr(), &v, PyBUF_SIMPLE) != 0) throw py::error_already_set();
      views.push_back(v);
      const size_t len = static_cast<size_t>(v.len);
      if (total + len < total) throw py::value_error("join_frames: parts overflow a size");
      total += len;
    }
    if (total == 0) throw py::value_error("join_frames: nothing to join");
    std::shared_ptr<PoolFrame> out;
    with_nogil([&] {
      out = PoolFrame::take(total);
      size_t off = 0;
      for (const Py_buffer& v : views) {
        parallel_copy(out->data() + off, v.buf, static_cast<size_t>(v.len));
        off += static_cast<size_t>(v.len);
      }
    });
    release();
    return out;
  } catch (...) {
    release();
    throw;
  }
}

/// Receives one whole message from the libzmq socket `handle` -> [ZmqFrame, ...]. Call once
/// the socket has a message (ZeroMQ delivers a message's frames together, so `flags`
/// (NOBLOCK) never leaves one half read), and through call_store/call_append, so that the
/// list reaches the caller's state before any of its Python code runs.
py::list recv_frames(uintptr_t handle, int flags) {
  const ZmqApi& z = zmq_api();
  void* sock = reinterpret_cast<void*>(handle);
  if (sock == nullptr) raise_zmq_error(ENOTSOCK);
  py::list frames;
  for (;;) {
    auto f = std::make_shared<ZmqFrame>();
    z.msg_init(f->msg());
    f->opened();
    int rc;
    for (;;) {
      rc = z.msg_recv(f->msg(), sock, flags);
      if (rc >= 0 || z.errno_() != EINTR || frames.size() == 0) break;
    }
    if (rc < 0) {
      if (frames.size() == 0) raise_zmq_error(z.errno_());
      throw std::runtime_error("libzmq failed a message's later frame");  // never: see above
    }
    const bool has_more = z.msg_more(f->msg()) != 0;
    frames.append(py::cast(f));
    if (!has_more) break;
  }
  return frames;
}

/// container[key] = fn(*args), the store in this same C call: a result that must not be
/// dropped (a message read, a blob copied out and released) reaches the caller's state before
/// any Python code of the caller runs again.
void call_store(const py::object& container, const py::object& key, const py::object& fn,
                const py::tuple& args) {
  py::object result = fn(*args);
  container[key] = result;
}

/// fn(*args) with target.name set to `value`, the previous value (or its absence) restored
/// here, in C, whatever fn does: a with-block's __exit__ could be cut short by a signal
/// handler's exception before it restores anything.
py::object call_with(const py::object& target, const py::str& name, const py::object& value,
                     const py::object& fn, const py::tuple& args) {
  const bool had = py::hasattr(target, name);
  py::object prev = had ? target.attr(name) : py::none();
  target.attr(name) = value;
  auto restore = [&] {
    if (had) {
      target.attr(name) = prev;
    } else if (PyObject_DelAttr(target.ptr(), name.ptr()) != 0) {
      PyErr_Clear();
    }
  };
  py::object out;
  try {
    out = fn(*args);
  } catch (py::error_already_set& e) {
    e.restore();  // keep fn's exception while restoring
    PyObject *type, *val, *tb;
    PyErr_Fetch(&type, &val, &tb);
    restore();
    PyErr_Restore(type, val, tb);
    throw py::error_already_set();
  } catch (...) {
    restore();
    throw;
  }
  restore();
  return out;
}

/// sink.append(fn(*args)), likewise.
void call_append(const py::object& fn, const py::tuple& args, const py::object& sink) {
  py::object append = sink.attr("append");
  append(fn(*args));
}

/// Moves every item of the list `src` to the end of the list `dst` (src left empty).
void move_items(const py::list& src, const py::list& dst) {
  const Py_ssize_t n = PyList_GET_SIZE(src.ptr());
  if (PyList_SetSlice(dst.ptr(), PyList_GET_SIZE(dst.ptr()), PyList_GET_SIZE(dst.ptr()),
                      src.ptr()) != 0 ||
      PyList_SetSlice(src.ptr(), 0, n, nullptr) != 0) {
    throw py::error_already_set();
  }
}

}  // namespace

void bind_call_safety(py::module_& m) {
  py::class_<PyCallLock, std::shared_ptr<PyCallLock>>(m, "CallLock")
      .def(py::init<>())
      // threading.Lock's acquire: True when this thread took it (never when it holds it).
      .def("acquire", &PyCallLock::acquire, py::arg("blocking") = true, py::arg("timeout") = -1.0)
      .def("release", &PyCallLock::release)
      .def("locked", &PyCallLock::locked)
      // Whether the calling thread holds it.
      .def("held_by_caller", &PyCallLock::held_by_caller);
  // fn(*args) with the lock held, taken and let go in C (TimeoutError naming `what` after
  // timeout_s, < 0 without limit; RuntimeError for a nested call).
  m.def("call_locked", &call_locked, py::arg("lock"), py::arg("timeout_s"), py::arg("what"),
        py::arg("fn"), py::arg("args"));
  // A received frame: a writable buffer over the libzmq message (.buffer: a memoryview).
  py::class_<ZmqFrame, std::shared_ptr<ZmqFrame>>(m, "ZmqFrame", py::buffer_protocol())
      .def_buffer([](ZmqFrame& f) {
        return py::buffer_info(f.data(), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(f.size())}, {1}, /*readonly=*/false);
      })
      .def_property_readonly("buffer",
                             [](py::object self) { return self.cast<ZmqFrame&>().buffer(self); })
      .def("__len__", &ZmqFrame::size);
  // An arena allocation held for a send by reference (TensorArenaWriter.hold_for_send): a
  // read-only buffer over its bytes; send_frames sends it without a copy.
  py::class_<SendHold, std::shared_ptr<SendHold>>(m, "SendHold", py::buffer_protocol())
      .def_buffer([](SendHold& h) {
        return py::buffer_info(const_cast<uint8_t*>(h.data()), 1,
                               py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(h.nbytes())}, {1}, /*readonly=*/true);
      })
      .def("__len__", &SendHold::nbytes);
  // One message's frames on libzmq socket `handle` (Socket.underlying), progress[0] = taken.
  m.def("send_frames", &send_frames, py::arg("handle"), py::arg("frames"), py::arg("first_flags"),
        py::arg("more"), py::arg("progress"), py::arg("part_bytes"), py::arg("split_above"));
  // A split buffer's parts joined into one frame-pool buffer -> PoolFrame.
  m.def("join_frames", &join_frames, py::arg("parts"));
  // One message's frames from libzmq socket `handle` -> [ZmqFrame, ...].
  m.def("recv_frames", &recv_frames, py::arg("handle"), py::arg("flags"));
  // container[key] = fn(*args) / sink.append(fn(*args)), each in one C call.
  m.def("call_store", &call_store, py::arg("container"), py::arg("key"), py::arg("fn"),
        py::arg("args"));
  m.def("call_append", &call_append, py::arg("fn"), py::arg("args"), py::arg("sink"));
  // Every item of list `src` moved to the end of list `dst`, in one call.
  m.def("move_items", &move_items, py::arg("src"), py::arg("dst"));
  // fn(*args) with target.name = value, the previous value restored in C.
  m.def("call_with", &call_with, py::arg("target"), py::arg("name"), py::arg("value"),
        py::arg("fn"), py::arg("args"));
  // The exit hook's side of the GIL-free calls' gate: let none start from now on, then wait up
  // to timeout_s (GIL released) for threads inside one -> how many are still inside.
  m.def(
      "nogil_gate_close_and_wait",
      [](double timeout_s) {
        NoGilGate& gate = NoGilGate::instance();
        gate.close();
        const auto deadline = std::chrono::steady_clock::now() +
                              std::chrono::nanoseconds(static_cast<int64_t>(timeout_s * 1e9));
        return with_nogil([&] {
          while (gate.inside() > 0 && std::chrono::steady_clock::now() < deadline) {
            std::this_thread::sleep_for(std::chrono::milliseconds(1));
          }
          return gate.inside();
        });
      },
      py::arg("timeout_s"));
  // Threads inside a gated GIL-free call now.
  m.def("nogil_gate_inside", [] { return NoGilGate::instance().inside(); });
  // Opens the gate again (tests).
  m.def("nogil_gate_reopen", [] { NoGilGate::instance().reopen(); });
}

}  // namespace vllm_shm_arena
