// Calls an asynchronous exception cannot split. Python runs a signal handler between two
// bytecodes, and whatever the handler raises (KeyboardInterrupt) lands there: after a C call
// returned but before its result was stored, or between two calls that must go together. The
// queue's calls keep their state consistent by doing each step that must not be split inside
// one C call:
//   _C.CallLock,       the call lock (core/call_lock.h), and fn(*args) run holding it, the
//   _C.call_locked     lock taken and let go in C, so a handler cannot leave it held
//   _C.send_frames     every frame of one ZeroMQ message, with the count the socket took
//                      recorded after each, in the same C call; libzmq called directly
//                      (pyzmq's calls run signal handlers after each frame); a
//   _C.SendHold        frame (an arena allocation) goes by reference, the rest copied
//   _C.recv_frames     every frame of one ZeroMQ message (stored through call_store/append),
//                      as _C.ZmqFrame buffers
//   _C.call_store,     fn(*args) stored into the caller's container (or appended to it) in
//   _C.call_append     the call that made it
//   _C.call_with       fn(*args) with an attribute set, restored in C
//   _C.move_items      a list's items moved to another list (a record handed over whole)
//   _C.nogil_gate_*    the exit hook's side of NoGilGate (bindings/gil.h)
#pragma once

#include <pybind11/pybind11.h>

namespace vllm_shm_arena {

/// Defines CallLock, call_locked, SendHold, send_frames, recv_frames, call_store, call_append,
/// call_with, move_items and the nogil_gate_* functions on `m`.
void bind_call_safety(pybind11::module_& m);

}  // namespace vllm_shm_arena
