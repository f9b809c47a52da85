// Lazy page-locking of one mapped range, in fixed-size chunks.
//
// Why lazily and in chunks: cudaHostRegister of a whole multi-GB arena at attach time costs
// time in proportion to its size (benchmarks/results/gpu_probe_h200.txt and
// benchmarks/results/gpu/gpu_h2d.json record it per GiB) and pins memory nobody may ever copy
// from. Registering the chunks a copy touches, on first touch, spreads the cost and pins only
// what is used. The chunk size is a property of the registry, not of the arena's slot layout,
// so a variable-size allocator above can keep using it unchanged.
//
//   base                                                              base + length
//   |<-- chunk 0 -->|<-- chunk 1 -->|<-- chunk 2 -->| ... |<- last (clipped) ->|
//          state per chunk: Unregistered -> Registering -> Registered
//                                                      \-> Failed (never retried)
//
// After the first failed registration the registry stops registering (the causes seen in
// practice, a sandboxed kernel, a memlock limit or an exhausted pinned pool, are properties of
// the process, so retrying chunk after chunk would only add a failing driver call per chunk);
// chunks already registered stay pinned and usable. ensure() then answers false for any range
// that is not fully pinned and the caller copies from pageable memory.
//
// A copy from pinned memory must stay inside one chunk (see contiguous_bytes()): the driver
// treats each registration as its own allocation and refuses a copy that spans two.
//
// Whether a CUDA context exists is the caller's decision: ensure() calls cudaHostRegister, which
// would create the primary context, so the owner calls it only once torch has one.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include "core/cuda_shim.h"

namespace vllm_shm_arena {

/// Counters of one PinRegistry, for logs and benchmarks.
struct PinStats {
  /// Successful cudaHostRegister calls.
  uint64_t registrations = 0;
  /// Failed cudaHostRegister calls (at most one: the first failure stops registration).
  uint64_t failures = 0;
  /// Wall-clock seconds spent inside cudaHostRegister, failed calls included.
  double register_seconds = 0.0;
  /// Bytes currently registered.
  size_t pinned_bytes = 0;
};

/// Page-locks chunks of [base, base + length) on demand. Thread-safe. The owner destroys it
/// before unmapping the range, because the destructor unregisters every registered chunk.
class PinRegistry {
 public:
  /// Receives one human-readable line (the first registration failure).
  using Logger = std::function<void(const std::string&)>;
  /// The default chunk size; a GPU benchmark may choose another.
  static constexpr size_t kDefaultChunkBytes = size_t{64} << 20;

  /// Tracks [base, base + length). `base` and `chunk_bytes` must be multiples of the page size
  /// (two chunks must never share a page: the driver refuses to register a page twice). A null
  /// `rt` makes a registry that never pins (ensure() returns false), for processes without CUDA.
  /// Throws InvalidArgument on a misaligned base, a zero length or a bad chunk size.
  PinRegistry(std::shared_ptr<CudaRuntime> rt, void* base, size_t length,
              size_t chunk_bytes = kDefaultChunkBytes);
  /// Unregisters every registered chunk.
  ~PinRegistry();
  PinRegistry(const PinRegistry&) = delete;
  PinRegistry& operator=(const PinRegistry&) = delete;

  /// Registers every not-yet-registered chunk that overlaps [ptr, ptr + len), each exactly once
  /// across all threads, and waits for chunks another thread is registering. True when the whole
  /// range is pinned afterwards (also for len == 0). Throws InvalidArgument if the range is not
  /// inside the mapping.
  bool ensure(const void* ptr, size_t len);
  /// True when every chunk overlapping [ptr, ptr + len) is registered. Never registers.
  bool is_pinned(const void* ptr, size_t len) const;
  /// Bytes from `ptr` to the end of its chunk, at most `len`. One cudaMemcpyAsync must not cross
  /// a chunk boundary: the driver rejects a copy whose host range spans two cudaHostRegister
  /// ranges with cudaErrorInvalidValue (seen on H200 / CUDA 13:
  /// benchmarks/results/gpu_probe_h200.txt), so copy code splits a range into pieces of this
  /// size. Throws InvalidArgument like ensure().
  size_t contiguous_bytes(const void* ptr, size_t len) const;
  /// Bytes currently registered.
  size_t pinned_bytes() const;
  /// A snapshot of the counters.
  PinStats stats() const;
  /// True once a registration failed; no chunk is registered after that.
  bool failed() const;
  /// Replaces the logger (default: one line to stderr). Not called while a lock is held.
  void set_logger(Logger logger);

  /// The chunk size in bytes.
  size_t chunk_bytes() const { return chunk_bytes_; }
  /// The number of chunks (the last may be shorter than chunk_bytes()).
  size_t num_chunks() const { return num_chunks_; }

 private:
  enum State : uint8_t { kUnregistered = 0, kRegistering = 1, kRegistered = 2, kFailed = 3 };

  // Chunk indices [first, last] overlapping the range; throws if it is outside the mapping.
  void chunk_span(const void* ptr, size_t len, size_t* first, size_t* last) const;
  char* chunk_ptr(size_t i) const { return base_ + i * chunk_bytes_; }
  size_t chunk_len(size_t i) const;
  bool all_registered(size_t first, size_t last) const;

  const std::shared_ptr<CudaRuntime> rt_;
  char* const base_;
  const size_t length_;
  const size_t chunk_bytes_;
  const size_t num_chunks_;
  // Written under mutex_, read lock-free by the fast path of ensure()/is_pinned().
  std::unique_ptr<std::atomic<uint8_t>[]> state_;

  mutable std::mutex mutex_;
  std::condition_variable settled_;  // a chunk left kRegistering
  bool failed_ = false;              // guarded by mutex_
  bool reported_ = false;            // guarded by mutex_
  PinStats stats_;                   // guarded by mutex_
  Logger logger_;                    // guarded by mutex_
};

}  // namespace vllm_shm_arena
