// Calls without the GIL, for every bindings file of vllm_shm_arena._C.
//
// CPython (3.11 to 3.13) ends a thread other than the finalizing one that takes the GIL back
// once finalization has begun: PyEval_RestoreThread calls pthread_exit, which unwinds the
// thread's stack with an exception no handler may swallow. Met in a noexcept frame, such as the
// destructor of py::gil_scoped_release, it aborts the whole process ("terminate called without
// an active exception"). So no call in the bindings re-takes the GIL in a destructor: with_nogil
// runs the GIL-free work and takes the GIL back in ordinary control flow, where that unwind
// passes up through these frames and pybind11's dispatcher (which rethrows it) and ends only the
// thread. A thread whose work comes back after finalization has begun does not ask for the GIL
// at all and parks instead (what CPython 3.14 does to such threads itself): nothing of it
// unwinds, so nothing it holds is destroyed without the GIL while the interpreter is torn down.
#pragma once

#include <Python.h>
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <exception>
#include <optional>
#include <stdexcept>
#include <type_traits>
#include <utility>
#if defined(__GLIBCXX__)
#include <cxxabi.h>
#endif

namespace vllm_shm_arena {

#if defined(__GLIBCXX__)
/// The exception pthread_exit unwinds a thread with (catch only to clean up, then rethrow).
using ThreadExit = abi::__forced_unwind;
#else
struct ThreadExit {};  // no forced unwind to recognise here: never thrown
#endif

/// Whether the interpreter has begun finalizing. With the GIL held, true only on the thread
/// doing it: every other one is stopped before it can hold the GIL again.
inline bool interpreter_finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing() != 0;
#else
  return _Py_IsFinalizing() != 0;
#endif
}

/// Blocks this thread until the process exits, taking no signal (the others get them).
[[noreturn]] inline void park_thread_for_good() {
  sigset_t all;
  sigfillset(&all);
  pthread_sigmask(SIG_BLOCK, &all, nullptr);
  for (;;) pause();
}

/// Takes the GIL back after GIL-free work; `finalizer`: this thread was the finalizing one.
/// Not noexcept, and never called from a destructor: CPython may end the thread inside
/// PyEval_RestoreThread if finalization begins while it waits.
inline void take_gil_back(PyThreadState* saved, bool finalizer) {
  if (!finalizer && interpreter_finalizing()) park_thread_for_good();
  PyEval_RestoreThread(saved);
}

/// Runs `f` (which must not touch Python) with the GIL released, and returns what it returns
/// or rethrows what it threw, with the GIL held again. Callers holding Python references in
/// frames above must drop them unreleased on ThreadExit (the thread no longer has the GIL).
template <class F>
auto with_nogil(F&& f) -> std::invoke_result_t<F&> {
  using R = std::invoke_result_t<F&>;
  const bool finalizer = interpreter_finalizing();
  PyThreadState* saved = PyEval_SaveThread();
  std::exception_ptr error;
  if constexpr (std::is_void_v<R>) {
    try {
      f();
    } catch (const ThreadExit&) {
      throw;  // this thread ends here, without the GIL
    } catch (...) {
      error = std::current_exception();
    }
    take_gil_back(saved, finalizer);
    if (error) std::rethrow_exception(error);
  } else {
    std::optional<R> out;
    try {
      out.emplace(f());
    } catch (const ThreadExit&) {
      throw;  // this thread ends here, without the GIL
    } catch (...) {
      error = std::current_exception();
    }
    take_gil_back(saved, finalizer);
    if (error) std::rethrow_exception(error);
    return std::move(*out);
  }
}

/// The queue's GIL-free waits and copies (ring reads and writes, arena copies), counted so that
/// the exit hook can let no new one start and wait a bounded time for threads to leave theirs
/// (mq/lifecycle.py's shutdown_at_exit): queues are then shut down cleanly, their sockets
/// drained, rather than abandoned mid-call. Counted here, in C++, because a Python context
/// manager around the call can be interrupted between its count and its call (a signal
/// handler raising there leaves the count wrong for good); and reset in a forked child, which
/// does not have the parent's threads that were inside one.
class NoGilGate {
 public:
  static NoGilGate& instance() {
    static NoGilGate* gate = [] {
      auto* g = new NoGilGate();  // never destroyed: threads may use it during exit
      pthread_atfork(nullptr, nullptr, [] { instance().inside_.store(0); });
      return g;
    }();
    return *gate;
  }

  /// Before a call: std::runtime_error once closed (the interpreter is exiting).
  void enter() {
    if (closed_.load(std::memory_order_acquire)) {
      throw std::runtime_error("MessageQueue was shut down (the interpreter is exiting)");
    }
    inside_.fetch_add(1, std::memory_order_acq_rel);
  }
  void leave() noexcept { inside_.fetch_sub(1, std::memory_order_acq_rel); }
  int inside() const noexcept { return inside_.load(std::memory_order_acquire); }
  void close() noexcept { closed_.store(true, std::memory_order_release); }
  bool closed() const noexcept { return closed_.load(std::memory_order_acquire); }
  /// Reopens it (tests).
  void reopen() noexcept { closed_.store(false, std::memory_order_release); }

 private:
  NoGilGate() = default;
  std::atomic<int> inside_{0};
  std::atomic<bool> closed_{false};
};

/// with_nogil for the queue's waits and copies: counted by NoGilGate, refused once it closed.
/// The count drops before the GIL is taken back, so the exit hook sees the thread leave as
/// soon as its work is done.
template <class F>
auto with_gated_nogil(F&& f) -> std::invoke_result_t<F&> {
  NoGilGate& gate = NoGilGate::instance();
  gate.enter();
  struct Leave {
    NoGilGate& gate;
    ~Leave() { gate.leave(); }
  };
  return with_nogil([&]() -> std::invoke_result_t<F&> {
    Leave leave{gate};
    return f();
  });
}

}  // namespace vllm_shm_arena
