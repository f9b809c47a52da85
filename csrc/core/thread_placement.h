// Keeps helper threads of this process (a ZeroMQ context's I/O threads) off the CPU the
// thread that wakes them runs on.
//
// Why: a socket send wakes ZeroMQ's I/O thread, which then copies the message into the
// kernel (a 25 MB TCP message: milliseconds of CPU). The scheduler places a woken thread
// beside its waker, so where no CPU is idle it lands on the sender's CPU and preempts it.
// Measured on 2 vCPUs with a local reader spinning on the other CPU: the by-reference TCP
// send took 0.08 ms of the writer's CPU and 0.77 ms of wall time, and the writer's whole
// enqueue of a 25 MB message 1.3-2.3x one memcpy of it (benchmarks/bench_remote_publish.py).
// With the I/O thread's mask leaving out the sender's CPU while the send wakes it, it is woken
// on another CPU and the sender keeps its own. Right after the send the mask is whole again:
// kept narrow, the thread could not use the sender's CPU once the sender sleeps (measured: the
// round trip to a remote reader 25-35 % longer), while a task already queued on a CPU of its
// mask is not moved when the mask widens.
//
//   ThreadPlacement(tids)  the threads to steer; each one's affinity mask at construction is
//                          the set of CPUs it may ever be given
//   keep_off_caller()      sets each thread's mask to its own set minus the calling thread's
//                          CPU (its whole set where that CPU is its only one)
//   release()              each thread's whole set again (after keep_off_caller; else a no-op)
//
// Nothing here fails the caller: a thread that exited or cannot be steered is dropped, and a
// host that cannot tell the caller's CPU changes nothing. A forked child never steers (the
// thread ids are its parent's threads). Not thread-safe: one thread at a time calls it (the
// writer's socket lock).
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <vector>

namespace vllm_shm_arena {

/// The ids of this process's threads whose name (/proc/self/task/<tid>/comm) starts with
/// `prefix`, in ascending order.
std::vector<pid_t> find_threads(const std::string& prefix);

class ThreadPlacement {
 public:
  explicit ThreadPlacement(const std::vector<pid_t>& tids);

  /// Steers the threads off the calling thread's CPU (see above).
  void keep_off_caller();
  /// Gives the threads their whole set again, if keep_off_caller narrowed it.
  void release();

  /// Threads still steered.
  size_t size() const { return threads_.size(); }
  /// The CPU the masks now leave out (-1: none, they are whole).
  int avoided_cpu() const { return avoided_; }
  /// Times keep_off_caller narrowed the masks.
  uint64_t moves() const { return moves_; }

 private:
  struct Thread {
    pid_t tid;
    std::vector<unsigned long> allowed;  // its mask at construction (a cpu_set_t's words)
  };
  // Sets each thread's mask to its set minus `cpu` (-1: its whole set); drops a thread it
  // cannot set.
  void apply(int cpu);

  std::vector<Thread> threads_;
  pid_t owner_pid_;
  int avoided_ = -1;
  uint64_t moves_ = 0;
};

}  // namespace vllm_shm_arena
