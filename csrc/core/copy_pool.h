// A memcpy that splits large copies across a small persistent thread pool.
//
// One memcpy saturates a core, not the memory system; a few threads each copying a
// page-aligned stripe get closer to memory bandwidth. Threads are created once, on first use,
// and reused (creating threads per call costs more than a small copy). Below
// `min_parallel_bytes` a single memcpy on the calling thread wins and is used instead.
//
// Sizing: extra threads only pay on CPUs nobody else needs. The automatic count starts from
// the CPUs this process may really use (its affinity mask, capped by a cgroup CPU quota; not
// hardware_concurrency(), which counts every CPU of the host), takes away the queue's local
// readers (they copy the same message out at the same time), and is clamped to [1, 8]. On
// the 2-core development machine that leaves one thread: two copy threads competing with the
// readers were slower than one (benchmarks/results/copy_bench.txt).
//
// Fork safety: a child forked from a process that owns the pool has none of its threads. A
// pthread_atfork child handler resets the pool to "no threads", so the child restarts them
// lazily on its first parallel copy, and exits without waiting on threads that don't exist.
// The pool is never destroyed (a deliberate leak): at exit its idle threads are simply
// terminated, so exit can't hang on a join.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

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
/// (auto_copy_threads(usable_cpus(), readers)). Takes effect on the next copy.
void set_copy_threads(unsigned n);

/// Tells the automatic sizing how many local readers share this host's CPUs with the copy
/// (the queue's writer passes its n_local_reader). Process-wide; the last call wins.
void set_copy_readers(unsigned n);

/// Threads (caller included) a copy of at least min_parallel_bytes would use now.
unsigned copy_threads();

/// CPUs this process may run on: the calling thread's sched_getaffinity mask, capped by the
/// cgroup CPU quota (cgroup_cpu_limit under /sys/fs/cgroup). At least 1.
unsigned usable_cpus();

/// CPUs a cgroup CPU quota grants (quota / period rounded down, at least 1), or 0 when no
/// quota applies. `proc_self_cgroup` is the text of /proc/self/cgroup; the quota is read
/// under `cgroup_root` from the v2 `cpu.max` or the v1 `cpu.cfs_quota_us` and
/// `cpu.cfs_period_us` of that cgroup and of each ancestor (the tightest wins). Missing or
/// unreadable files mean no quota there.
unsigned cgroup_cpu_limit(const std::string& cgroup_root, const std::string& proc_self_cgroup);

/// The automatic thread count for `usable` CPUs of which `readers` are busy with the local
/// readers: the CPUs left over, clamped to [1, 8].
unsigned auto_copy_threads(unsigned usable, unsigned readers);

/// Sets the size below which a copy runs as one memcpy on the calling thread.
void set_min_parallel_bytes(size_t n);

/// The pool's counters.
CopyPoolStats copy_pool_stats();

}  // namespace vllm_shm_arena
