// Who a process is, in a form that survives pid reuse and can be stored in shared memory.
//
// A pid alone is not an identity: after a reader dies its pid can be handed to an unrelated
// process, and a killed-but-unreaped child still answers kill(pid, 0). We store the pid
// together with the process start time (field 22 of /proc/<pid>/stat, in clock ticks since
// boot) and treat a process as alive only if a process with that pid exists, has the same
// start time, and is not in state Z (zombie) or X (dead).
#pragma once

#include <sys/types.h>

#include <cstdint>

namespace vllm_shm_arena {

/// A (pid, start time) pair packed into one 64-bit word so it can live in one lock-free
/// atomic: pid in the low 32 bits, the low 32 bits of the start time in the high half.
/// Zero means "nobody".
class ProcessIdentity {
 public:
  constexpr ProcessIdentity() = default;
  constexpr explicit ProcessIdentity(uint64_t packed) : packed_(packed) {}

  /// The identity of the calling process (cached per pid, so it is correct after fork).
  static ProcessIdentity self();
  /// The identity of `pid` now, or an empty identity if no such process exists.
  static ProcessIdentity of(pid_t pid);

  /// True when the process this identity names still runs (not exited, not a zombie, and its
  /// pid was not reused by another process).
  bool is_alive() const;

  pid_t pid() const { return static_cast<pid_t>(packed_ & 0xffffffffu); }
  uint64_t packed() const { return packed_; }
  bool empty() const { return packed_ == 0; }
  bool operator==(const ProcessIdentity& o) const { return packed_ == o.packed_; }
  bool operator!=(const ProcessIdentity& o) const { return packed_ != o.packed_; }

 private:
  uint64_t packed_ = 0;
};

}  // namespace vllm_shm_arena
