#include "bindings/call_safety.h"

#include <Python.h>
#include <pythread.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>

#include "bindings/gil.h"
#include "core/call_lock.h"

namespace py = pybind11;

namespace vllm_shm_arena {

namespace {

/// How long a wait for the call lock sleeps between checks for signal handlers.
constexpr int64_t kLockSliceNs = 20'000'000;

uint64_t this_thread_token() { return static_cast<uint64_t>(PyThread_get_thread_ident()); }

/// _C.CallLock: threading.Lock's interface (acquire, release, locked) over core CallLock,
/// plus hold(timeout, what), the guard a queue call holds it with.
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

/// What `with lock.hold(timeout, what):` holds: the lock taken in __enter__ and let go in
/// __exit__, both C, so nothing a signal handler raises can fall between the taking and the
/// with-block (CPython runs handlers between bytecodes, and a with-block's cleanup covers the
/// bytecode right after __enter__ returns).
class CallGuard {
 public:
  CallGuard(std::shared_ptr<PyCallLock> lock, double timeout_s, std::string what)
      : lock_(std::move(lock)), timeout_s_(timeout_s), what_(std::move(what)) {}

  void enter() {
    switch (lock_->take(timeout_s_)) {
      case CallLock::Result::kAcquired:
        held_ = true;
        return;
      case CallLock::Result::kHeldByCaller:
        throw std::runtime_error(
            "a call on this MessageQueue from inside another of its calls in the same thread "
            "(a signal handler?); the queue's calls do not nest");
      case CallLock::Result::kTimeout:
        break;
    }
    PyErr_SetString(PyExc_TimeoutError,
                    ("timed out waiting for another thread's " + what_ + " on this queue").c_str());
    throw py::error_already_set();
  }

  bool exit(const py::args&) {
    if (held_) {
      held_ = false;
      lock_->release();
    }
    return false;
  }

 private:
  std::shared_ptr<PyCallLock> lock_;
  double timeout_s_;
  std::string what_;
  bool held_ = false;
};

/// Sends `frames` as one message through `send` (called as send(sock, frame, flags): pyzmq's
/// C-level Socket.send, never the Python one, whose bytecode a handler could interrupt).
/// `first_flags` go with the first frame, `more` with every frame but the last. After each
/// frame the socket took, progress[0] is its count, in this same C call: whatever is raised,
/// in a frame's send or as this returns, progress says exactly how much went.
void send_frames(const py::object& send, const py::object& sock, const py::list& frames,
                 int first_flags, int more, const py::list& progress) {
  const size_t n = frames.size();
  if (progress.size() < 1) throw py::value_error("progress must have one item");
  progress[0] = 0;
  for (size_t i = 0; i < n; ++i) {
    int flags = (i + 1 < n) ? more : 0;
    if (i == 0) flags |= first_flags;
    send(sock, frames[i], flags);
    progress[0] = i + 1;
  }
}

/// Receives one whole message through `recv` (called as recv(sock, flags, False): pyzmq's
/// C-level Socket.recv, zero-copy Frames) -> the list of its frames. Call once the socket has a
/// message (ZeroMQ delivers a message's frames together, so `flags` (NOBLOCK) never leaves one
/// half read), and through call_store/call_append, so that the list reaches the caller's state
/// before any of its Python code runs.
py::list recv_frames(const py::object& recv, const py::object& sock, int flags) {
  py::list frames;
  for (;;) {
    py::object f = recv(sock, flags, false);
    frames.append(f);
    if (!f.attr("more").cast<bool>()) break;
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

/// sink.append(fn(*args)), likewise.
void call_append(const py::object& fn, const py::tuple& args, const py::object& sink) {
  py::object append = sink.attr("append");
  append(fn(*args));
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
      .def("held_by_caller", &PyCallLock::held_by_caller)
      // The guard of one call: `with lock.hold(timeout_s, "dequeue"):` (TimeoutError naming
      // `what` after timeout_s, < 0 without limit; RuntimeError for a nested call).
      .def(
          "hold",
          [](std::shared_ptr<PyCallLock> self, double timeout_s, std::string what) {
            return CallGuard(std::move(self), timeout_s, std::move(what));
          },
          py::arg("timeout_s"), py::arg("what"));
  py::class_<CallGuard>(m, "CallGuard")
      .def("__enter__", &CallGuard::enter)
      .def("__exit__", &CallGuard::exit);
  // One ZeroMQ message's frames through send(sock, frame, flags), progress[0] = frames taken.
  m.def("send_frames", &send_frames, py::arg("send"), py::arg("sock"), py::arg("frames"),
        py::arg("first_flags"), py::arg("more"), py::arg("progress"));
  // One ZeroMQ message's frames through recv(sock, flags, False) -> [Frame, ...].
  m.def("recv_frames", &recv_frames, py::arg("recv"), py::arg("sock"), py::arg("flags"));
  // container[key] = fn(*args) / sink.append(fn(*args)), each in one C call.
  m.def("call_store", &call_store, py::arg("container"), py::arg("key"), py::arg("fn"),
        py::arg("args"));
  m.def("call_append", &call_append, py::arg("fn"), py::arg("args"), py::arg("sink"));
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
