// Event-gated release of memory that an asynchronous pinned DMA may still be reading.
//
// A tensor that views arena memory can be freed (its deleter runs) while a non_blocking copy
// from it is still queued on a CUDA stream; handing the slot back to the writer at that moment
// would let the writer overwrite bytes the DMA has not read yet. The gate delays the release:
//
//   deleter (any thread)        flush(stream) (the copying thread)
//   freed(token) --> [freed] --> take an event from the pool, record it on `stream`
//                                [pending: (tokens, event)] --> cudaEventQuery
//                                     success   -> release(token) for each, event back to pool
//                                     not ready -> stay pending until a later flush
//
// One event covers every token freed since the previous flush: they were all freed before the
// record, so the stream reaching the event means every copy queued on it before the frees is
// done. That also bounds event creation by the number of flushes still pending, not by tokens.
// The event must be recorded on the stream the copies ran on; that is the caller's contract.
//
// Failures, safety first:
//  - cudaEventCreateWithFlags / cudaEventRecord fails: the tokens stay unrecorded and are
//    recorded by a later flush; nothing is released without an event behind it.
//  - cudaEventQuery fails with anything but "not ready": the batch stays pending. A failed query
//    cannot tell us that the DMA is over, and releasing early corrupts another reader's data.
//    The cost is bounded: such errors mean the process's CUDA context is broken, which ends the
//    process, and the writer reclaims a dead reader's memory. A caller who knows no copy can
//    still run (after synchronizing the device) may call drain_after_sync().
// Each kind of failure is logged once per gate. After any failure the runtime's last error is
// cleared, so torch does not later report it as the failure of an unrelated launch.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/cuda_shim.h"

namespace vllm_shm_arena {

/// Counters of one ReleaseGate, for tests and logs.
struct GateStats {
  /// Events created over the gate's lifetime (pooled ones are reused, not counted again).
  uint64_t events_created = 0;
  /// Successful cudaEventRecord calls (one per flush that had freed tokens).
  uint64_t records = 0;
  /// Failed cudaEventCreateWithFlags / cudaEventRecord calls.
  uint64_t record_failures = 0;
  /// cudaEventQuery calls that failed with something other than "not ready".
  uint64_t query_failures = 0;
  /// Tokens handed to a release callback.
  uint64_t released = 0;
};

/// Delays releasing freed tokens until a CUDA event recorded after the free has completed.
class ReleaseGate {
 public:
  /// Hands one token back to its owner. Must not throw and must not call flush().
  using Release = std::function<void(uint64_t)>;
  /// Receives one human-readable line per kind of failure.
  using Logger = std::function<void(const std::string&)>;
  /// At most this many recorded events wait at once; further tokens wait unrecorded for the
  /// next flush, so a stalled stream cannot make the pool grow without bound.
  static constexpr size_t kMaxPendingEvents = 64;

  /// A null `rt` means this process has no CUDA runtime, hence no DMA: flush() releases every
  /// freed token at once.
  explicit ReleaseGate(std::shared_ptr<CudaRuntime> rt);
  /// Destroys every event (tokens still pending are never released). Skips CUDA entirely
  /// without a runtime, and stops once the runtime reports it is unloading at process exit.
  ~ReleaseGate();
  ReleaseGate(const ReleaseGate&) = delete;
  ReleaseGate& operator=(const ReleaseGate&) = delete;

  /// Notes that `token`'s memory is no longer referenced by the host. Thread-safe, cheap, never
  /// calls CUDA: it runs in tensor deleters, on any thread, even one with no CUDA context.
  void freed(uint64_t token);
  /// Records one event on `stream` (a cudaStream_t) covering every token freed since the last
  /// flush, then polls every pending event without blocking and calls `release` for the tokens
  /// whose event completed (outside the gate's locks). Returns how many tokens were released.
  size_t flush(void* stream, const Release& release);
  /// Polls the events already recorded, without recording one, and releases the tokens whose
  /// event completed (a dropped reader's leftovers: no stream is known to record on, so tokens
  /// freed since the last flush stay held). Returns how many tokens were released.
  size_t poll(const Release& release);
  /// Releases every token freed so far without looking at events. Only for a caller that knows
  /// no copy from these tokens can still run (it synchronized the device, or CUDA is gone).
  size_t drain_after_sync(const Release& release);
  /// Tokens freed but not yet released.
  size_t pending() const;
  /// Events currently in the pool, ready for reuse.
  size_t pooled_events() const;
  /// A snapshot of the counters.
  GateStats stats() const;
  /// Replaces the logger (default: one line to stderr). Not called while a lock is held.
  void set_logger(Logger logger);

 private:
  struct Batch {
    std::vector<uint64_t> tokens;
    CudaEvent event;
  };
  enum Failure : unsigned { kCreateFailed = 1, kRecordFailed = 2, kQueryFailed = 4 };

  size_t flush_impl(void* stream, bool record, const Release& release);
  // Called with flush_mutex_ held; returns the line to log ("" if this kind was logged before).
  std::string note_failure(Failure kind, const std::string& what, CudaError err,
                           const char* consequence);

  const std::shared_ptr<CudaRuntime> rt_;
  std::atomic<size_t> pending_{0};

  std::mutex freed_mutex_;
  std::vector<uint64_t> freed_;  // guarded by freed_mutex_

  mutable std::mutex flush_mutex_;
  std::vector<uint64_t> unrecorded_;  // guarded by flush_mutex_: freed, no event recorded yet
  std::deque<Batch> recorded_;        // guarded by flush_mutex_, in record order
  std::vector<CudaEvent> pool_;       // guarded by flush_mutex_
  GateStats stats_;                   // guarded by flush_mutex_
  unsigned reported_ = 0;             // guarded by flush_mutex_: Failure bits already logged
  Logger logger_;                     // guarded by flush_mutex_
};

}  // namespace vllm_shm_arena
