// A memcpy that splits large copies across a small persistent thread pool.
//
// One memcpy saturates a core, not the memory system; a few threads each copying a
// page-aligned stripe get closer to memory bandwidth. Threads are created once, on first use,
// and reused (creating threads per call costs more than a small copy). Below
// `min_parallel_bytes` a single memcpy on the calling thread wins and is used instead.
//
// Fork safety: a child forked from a process that owns the pool has none of its threads. A
// pthread_atfork child handler resets the pool to "no threads", so the child restarts them
// lazily on its first parallel copy, and exits without waiting on threads that don't exist.
// The pool is never destroyed (a deliberate leak): at exit its idle threads are simply
// terminated, so exit can't hang on a join.
#pragma once

#include <cstddef>
#include <cstdint>

namespace vllm_shm_arena {

/// Counters of the process-wide copy pool (monotonic since process start or fork).
struct CopyPoolStats {
  uint64_t copies = 0;           ///< calls of parallel_copy
  uint64_t parallel_copies = 0;  ///< calls that used more than one thread
  uint64_t bytes = 0;            ///< bytes copied
  uint32_t threads = 0;          ///< worker threads currently running in this process
};

/// Copies `n` bytes from `src` to `dst` (non-overlapping), using the pool when it pays.
void parallel_copy(void* dst, const void* src, size_t n);

/// Sets how many threads (caller included) a copy may use; 0 = automatic
/// (min(hardware threads, 8)). Takes effect on the next copy.
void set_copy_threads(unsigned n);

/// Sets the size below which a copy runs as one memcpy on the calling thread.
void set_min_parallel_bytes(size_t n);

/// The pool's counters.
CopyPoolStats copy_pool_stats();

}  // namespace vllm_shm_arena
