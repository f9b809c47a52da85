// Warm buffers for large frames that leave this process's own allocations: a socket message's
// frames handed to ZeroMQ (which keeps them until every subscriber's copy is written) and the
// frames a reader copies out of the ring or a blob.
//
// Why: a fresh large allocation is paid for again in page faults at its first touch. glibc
// serves every allocation above its mmap threshold (32 MiB at most) with a fresh mapping, so
// copying a 200 MiB frame into a new allocation faulted in ~51,000 pages each time (~127 ms,
// against ~17 ms for a copy into memory already touched). A buffer of this pool is mapped
// and faulted in once, kept when given back, and handed out again warm.
//
//   take(n)       an idle buffer of capacity in [n, fit_limit(n)] (the smallest such), else a
//                 new mapping of n rounded up to kGranule
//   give_back(b)  idle again, stamped with the time; then every idle buffer beyond
//                 max_idle_bytes (the oldest first) and every buffer idle for longer than
//                 max_idle_age is unmapped
//
// Buffers in use are not bounded here: each one is a frame in flight, which the socket's
// high-water marks (or the ring) bound. The idle ones are bounded in bytes and in age, so a
// burst leaves nothing behind for long.
//
// Threads: take and give_back may run on any thread (ZeroMQ's I/O thread gives buffers back
// through zmq_free). One mutex guards the idle list; mmap and munmap run outside it.
//
// Fork: a pthread_atfork handler makes the mutex fresh in the child (another thread may have
// held it at fork) and unmaps the idle buffers there: they are the parent's, copy-on-write in
// the child, and reusing one would fault every page in again with a copy. A buffer the child
// inherited in use (a frame a tensor holds) is unmapped when given back there, never reused.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>

namespace vllm_shm_arena {

/// Frames from this size on go through the pool; smaller ones stay below glibc's mmap
/// threshold, where a fresh allocation comes from memory the heap has touched already.
inline constexpr size_t kPooledFrameMinBytes = size_t{1} << 20;

/// One buffer of a FramePool: `capacity` mapped bytes at `data`.
struct FrameBuffer {
  uint8_t* data = nullptr;
  size_t capacity = 0;
  std::chrono::steady_clock::time_point idle_since{};
  pid_t owner = 0;  ///< the process that mapped it (a forked child never reuses its parent's)
};

/// Counters of a FramePool.
struct FramePoolStats {
  uint64_t takes = 0;         ///< calls of take
  uint64_t warm_takes = 0;    ///< of which an idle buffer served
  uint64_t mapped = 0;        ///< buffers mapped
  uint64_t unmapped = 0;      ///< buffers unmapped (over the bounds)
  uint64_t idle_bytes = 0;    ///< bytes of the idle buffers now
  uint64_t in_use_bytes = 0;  ///< bytes of the buffers taken and not given back now
};

class FramePool {
 public:
  /// Capacities are multiples of this (the transparent huge page size on x86-64).
  static constexpr size_t kGranule = size_t{2} << 20;

  /// `max_idle_bytes`: idle buffers kept at most (0 keeps none); `max_idle_age`: an idle
  /// buffer older than this is unmapped at the next take or give_back.
  FramePool(uint64_t max_idle_bytes, std::chrono::milliseconds max_idle_age);
  ~FramePool();
  FramePool(const FramePool&) = delete;
  FramePool& operator=(const FramePool&) = delete;

  /// A buffer of at least `bytes` (> 0) bytes, owned by the caller until give_back.
  /// std::bad_alloc when the mapping fails.
  FrameBuffer* take(size_t bytes);

  /// Returns `b` (from take on this pool) for reuse, or unmaps it if the bounds say so.
  void give_back(FrameBuffer* b) noexcept;

  /// The largest capacity an idle buffer may have to serve a take of `bytes`: twice the
  /// request (a small frame does not pin a huge buffer), and at least one granule more.
  static size_t fit_limit(size_t bytes);

  void set_max_idle_bytes(uint64_t n);
  uint64_t max_idle_bytes() const;
  FramePoolStats stats() const;

  /// ZeroMQ's zmq_free_fn for a message whose data is a buffer of the process pool:
  /// `hint` is the FrameBuffer*; gives it back.
  static void zmq_free(void* data, void* hint) noexcept;

  /// The process-wide pool (never destroyed; bounds from the settings, see settings.h).
  static FramePool& process();

  /// Makes the mutex fresh (a forked child; see above). Not for other use.
  void reset_after_fork() noexcept;

 private:
  /// Unmaps idle buffers over the bounds; called with mu_ held, returns what to unmap.
  void collect_excess(std::multimap<size_t, FrameBuffer*>& out);
  static void unmap(FrameBuffer* b) noexcept;

  mutable std::mutex mu_;
  std::multimap<size_t, FrameBuffer*> idle_;  ///< by capacity
  uint64_t max_idle_bytes_;
  std::chrono::milliseconds max_idle_age_;
  FramePoolStats stats_;
  pid_t pid_;  // this process (set again in a forked child)
};

}  // namespace vllm_shm_arena
