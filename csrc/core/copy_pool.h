// A memcpy that splits large copies across a small persistent thread pool.
//
// One memcpy saturates a core, not the memory system; a few threads each copying a
// page-aligned stripe get closer to memory bandwidth. Threads are created once, on first use,
// and reused (creating threads per call costs more than a small copy). Below
// `min_parallel_bytes` a single memcpy on the calling thread wins and is used instead.
//
// Sizing: the automatic count starts from the CPUs this process may really use (its affinity
// mask, capped by a cgroup CPU quota; not hardware_concurrency(), which counts every CPU of the
// host), clamped to [1, 8]. Whether the queue's local readers' CPUs should help is measured,
// not assumed: a reader that copies the previous message out, or computes, loses what a helper
// takes, while a reader waiting for this very message has nothing better to do with its CPU,
// and hosts differ in whether a second core speeds a copy up at all (copy_bench.txt,
// copy_threads_ab*.md in benchmarks/results). ThreadCountChooser tries both counts, with and
// without the readers' CPUs, and keeps the faster one per copy size.
//
// Streaming stores: a copy into shared memory (`CopyTarget::kShared`: the arena's data region
// and the ring's chunks, which other processes read next) uses non-temporal stores on x86-64
// once its working set (the copy, plus what the same message wrote just before it) reaches
// stream_min_bytes(), 32 MiB by default. An ordinary store first reads the destination line
// into the cache (read-for-ownership), so a copy whose destination is not in the cache moves
// three bytes per byte copied; a streaming store writes the line without reading it. A
// single tensor below the threshold, written to the same warm allocation message after
// message, stays in the cache, where ordinary stores are the better choice; larger messages,
// and bursts of such tensors, do not fit it. glibc's memcpy streams by itself only above a
// threshold derived from the last-level cache, well above ours. The measurements behind the
// threshold are benchmarks/results/stream_ab.md (delivery and consume in the broadcast) and
// benchmarks/results/copy_bench.txt (`make bench-copy`). Other architectures use memcpy.
// Copies into process-local memory (a reader copying out) never stream: whoever asked for
// them reads the bytes next.
//
// Fork safety: a child forked from a process that owns the pool has none of its threads. A
// pthread_atfork child handler resets the pool to "no threads", so the child restarts them
// lazily on its first parallel copy, and exits without waiting on threads that don't exist.
// The pool is never destroyed (a deliberate leak): at exit its idle threads are simply
// terminated, so exit can't hang on a join.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace vllm_shm_arena {

/// Counters of the process-wide copy pool (monotonic since process start or fork).
struct CopyPoolStats {
  uint64_t copies = 0;           ///< calls of parallel_copy
  uint64_t parallel_copies = 0;  ///< calls that used more than one thread
  uint64_t wide_copies = 0;      ///< calls that also used the readers' CPUs (ThreadCountChooser)
  uint64_t bytes = 0;            ///< bytes copied
  uint64_t stream_copies = 0;    ///< calls that used streaming stores
  uint32_t threads = 0;          ///< worker threads currently running in this process
};

/// Where a copy's bytes go: memory this process reads next, or shared memory that other
/// processes read next (eligible for streaming stores, see above).
enum class CopyTarget { kLocal, kShared };

/// Copies `n` bytes from `src` to `dst` (non-overlapping), using the pool when it pays. Every
/// byte is visible to other threads and processes once it returns (streaming stores are
/// fenced), so a release store after it publishes them. `working_set`: for a kShared copy,
/// the bytes it and the copies just before it for the same message write (0: `n`); the copy
/// streams when the larger of the two reaches stream_min_bytes().
void parallel_copy(void* dst, const void* src, size_t n, CopyTarget target = CopyTarget::kLocal,
                   size_t working_set = 0);

/// Copies with streaming (non-temporal) stores on x86-64, memcpy elsewhere; any alignment,
/// ends with a store fence. What parallel_copy uses for large kShared copies; exposed for
/// tests and the copy benchmark.
void stream_copy(void* dst, const void* src, size_t n);

/// True where stream_copy really uses streaming stores (x86-64).
bool stream_copy_supported();

/// kShared copies whose working set is at least `n` bytes stream; 0 turns streaming off.
/// Process-wide.
void set_stream_min_bytes(size_t n);

/// The current streaming threshold (0: off).
size_t stream_min_bytes();

/// Sets how many threads (caller included) a copy may use; 0 = automatic (auto_copy_threads
/// or wide_copy_threads of usable_cpus(), as ThreadCountChooser measures). Takes effect on
/// the next copy.
void set_copy_threads(unsigned n);

/// Tells the automatic sizing how many local readers share this host's CPUs with the copy
/// (the queue's writer passes its n_local_reader). Process-wide; the last call wins.
void set_copy_readers(unsigned n);

/// Threads (caller included) a copy of at least min_parallel_bytes uses now: the count set,
/// or with automatic sizing the CPUs the local readers leave over (auto_copy_threads); such a
/// copy may also use the readers' CPUs (ThreadCountChooser, counted in wide_copies).
unsigned copy_threads();

/// Thread `tid`'s sched_getaffinity mask (0: the calling thread's) as the words of a
/// cpu_set_t sized for the kernel's mask (read whole on hosts with more than CPU_SETSIZE
/// CPUs); empty when it cannot be read.
std::vector<unsigned long> affinity_mask(pid_t tid);
/// CPUs set in a mask from affinity_mask.
size_t mask_cpus(const std::vector<unsigned long>& mask);

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

/// The most threads an automatic copy may use: every usable CPU, clamped to [1, 8].
unsigned wide_copy_threads(unsigned usable);

/// Chooses, for each large copy with automatic sizing, between two thread counts by measuring
/// them: `fewer` (auto_copy_threads: the CPUs the local readers leave over) and `more`
/// (wide_copy_threads: the readers' CPUs too). Whether helpers on the readers' CPUs speed a
/// copy up depends on the host's memory system (whether one core already saturates it) and on
/// what the readers do meanwhile (wait for the next message, or compute), which no fixed rule
/// knows: on one 2-vCPU host two threads delivered 64 and 200 MiB messages 1.45-1.83x sooner,
/// on another 0.77-1.14x (benchmarks/results/copy_threads_ab*.md). The copy's own
/// time shows it. Per size class (a power of two from 1 MiB) it keeps each count's last
/// kWindow times per byte and compares their medians (one copy slowed by a preemption does
/// not turn the choice): it tries each count kTrials times, then takes the faster one and
/// tries the other once in kExploreEvery copies, so that a change in what the readers do is
/// seen. The readers' side is not measured: a helper that takes a computing reader's
/// CPU costs that reader the helper's share of the copy, and the copy ends sooner by as much.
/// Not thread-safe (the pool calls it under its copy lock).
class ThreadCountChooser {
 public:
  static constexpr unsigned kTrials = 2;
  static constexpr unsigned kExploreEvery = 8;
  static constexpr unsigned kClasses = 12;  ///< 1 MiB, 2 MiB, ... 2 GiB and above
  static constexpr unsigned kWindow = 5;    ///< samples per count whose median decides

  /// The thread count the next copy of `n` bytes uses (`fewer` when the two are equal).
  unsigned choose(size_t n, unsigned fewer, unsigned more);
  /// A copy of `n` bytes with `threads` took `ns` nanoseconds (counts other than the class's
  /// current `fewer` and `more` are ignored).
  void record(size_t n, unsigned threads, uint64_t ns);

 private:
  struct Arm {
    uint32_t samples = 0;         ///< recorded so far, at most kWindow
    uint32_t next = 0;            ///< where the next one goes in `recent`
    double recent[kWindow] = {};  ///< the last `samples`, ns per byte (a ring)
    double median() const;
  };
  struct SizeClass {
    unsigned fewer = 0;
    unsigned more = 0;
    Arm arms[2];  // [0]: fewer, [1]: more
    uint32_t since_explore = 0;
  };
  static size_t class_of(size_t n);
  SizeClass classes_[kClasses];
};

/// Sets the size below which a copy runs as one memcpy on the calling thread.
void set_min_parallel_bytes(size_t n);

/// The pool's counters.
CopyPoolStats copy_pool_stats();

}  // namespace vllm_shm_arena
