#include "core/pin_registry.h"

#include <unistd.h>

#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <vector>

#include "core/errors.h"

namespace vllm_shm_arena {

namespace {

size_t page_size() {
  static const size_t kPage = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  return kPage;
}

void log_to_stderr(const std::string& line) { std::fprintf(stderr, "%s\n", line.c_str()); }

std::string hex(const void* p) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%p", p);
  return buf;
}

}  // namespace

PinRegistry::PinRegistry(std::shared_ptr<CudaRuntime> rt, void* base, size_t length,
                         size_t chunk_bytes)
    : rt_(std::move(rt)),
      base_(static_cast<char*>(base)),
      length_(length),
      chunk_bytes_(chunk_bytes),
      num_chunks_(chunk_bytes == 0 ? 0 : (length + chunk_bytes - 1) / chunk_bytes),
      logger_(log_to_stderr) {
  if (base == nullptr || reinterpret_cast<uintptr_t>(base) % page_size() != 0) {
    throw InvalidArgument("PinRegistry: base " + hex(base) + " must be a non-null multiple of " +
                          "the page size (" + std::to_string(page_size()) + ")");
  }
  if (length == 0) throw InvalidArgument("PinRegistry: length must be > 0");
  if (chunk_bytes == 0 || chunk_bytes % page_size() != 0) {
    throw InvalidArgument("PinRegistry: chunk_bytes " + std::to_string(chunk_bytes) +
                          " must be a positive multiple of the page size (" +
                          std::to_string(page_size()) + ")");
  }
  state_.reset(new std::atomic<uint8_t>[num_chunks_]);
  for (size_t i = 0; i < num_chunks_; ++i)
    state_[i].store(kUnregistered, std::memory_order_relaxed);
}

PinRegistry::~PinRegistry() {
  if (rt_ == nullptr) return;
  // The owner guarantees no ensure() runs concurrently with destruction.
  for (size_t i = 0; i < num_chunks_; ++i) {
    if (state_[i].load(std::memory_order_relaxed) != kRegistered) continue;
    CudaError err = rt_->host_unregister(chunk_ptr(i));
    if (static_cast<int>(err) == cuda_const::kSuccess) continue;
    rt_->get_last_error();  // do not leave our failure for torch to report later
    // At process exit the runtime refuses every call; the pinning dies with the process.
    if (static_cast<int>(err) == cuda_const::kErrorCudartUnloading) return;
  }
}

size_t PinRegistry::chunk_len(size_t i) const {
  const size_t start = i * chunk_bytes_;
  return length_ - start < chunk_bytes_ ? length_ - start : chunk_bytes_;
}

void PinRegistry::chunk_span(const void* ptr, size_t len, size_t* first, size_t* last) const {
  const char* p = static_cast<const char*>(ptr);
  if (p < base_ || static_cast<size_t>(p - base_) > length_ ||
      len > length_ - static_cast<size_t>(p - base_)) {
    throw InvalidArgument("PinRegistry: range [" + hex(ptr) + ", +" + std::to_string(len) +
                          ") is not inside the mapping [" + hex(base_) + ", +" +
                          std::to_string(length_) + ")");
  }
  const size_t offset = static_cast<size_t>(p - base_);
  *first = offset / chunk_bytes_;
  *last = (offset + len - 1) / chunk_bytes_;
}

bool PinRegistry::all_registered(size_t first, size_t last) const {
  for (size_t i = first; i <= last; ++i) {
    // SYNC POINT: acquire, pairs with the release store after cudaHostRegister in ensure(), so
    // a caller that sees kRegistered may start a DMA from the chunk.
    if (state_[i].load(std::memory_order_acquire) != kRegistered) return false;
  }
  return true;
}

bool PinRegistry::ensure(const void* ptr, size_t len) {
  if (len == 0) return true;
  size_t first = 0;
  size_t last = 0;
  chunk_span(ptr, len, &first, &last);
  if (all_registered(first, last)) return true;
  if (rt_ == nullptr) return false;

  // Claim under the lock so that each chunk is registered by exactly one thread; register
  // outside it so that threads touching different chunks do not wait for each other.
  std::vector<size_t> mine;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!failed_) {
      for (size_t i = first; i <= last; ++i) {
        if (state_[i].load(std::memory_order_relaxed) == kUnregistered) {
          state_[i].store(kRegistering, std::memory_order_relaxed);
          mine.push_back(i);
        }
      }
    }
  }

  std::string report;
  Logger logger;
  for (size_t k = 0; k < mine.size(); ++k) {
    const size_t i = mine[k];
    const auto t0 = std::chrono::steady_clock::now();
    CudaError err =
        rt_->host_register(chunk_ptr(i), chunk_len(i), cuda_const::kHostRegisterPortable);
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const bool ok = static_cast<int>(err) == cuda_const::kSuccess;
    if (!ok) rt_->get_last_error();  // do not leave our failure for torch to report later

    std::lock_guard<std::mutex> lock(mutex_);
    stats_.register_seconds += seconds;
    if (ok) {
      ++stats_.registrations;
      stats_.pinned_bytes += chunk_len(i);
      // SYNC POINT: release, pairs with the acquire load in all_registered().
      state_[i].store(kRegistered, std::memory_order_release);
    } else {
      ++stats_.failures;
      failed_ = true;
      state_[i].store(kFailed, std::memory_order_release);
      // The chunks this thread claimed but has not reached are given back unregistered: no one
      // will claim them again now that failed_ is set.
      for (size_t j = k + 1; j < mine.size(); ++j) {
        state_[mine[j]].store(kUnregistered, std::memory_order_release);
      }
      if (!reported_) {
        reported_ = true;
        report = "vllm_shm_arena: " +
                 rt_->describe("cudaHostRegister(" + hex(chunk_ptr(i)) + ", " +
                                   std::to_string(chunk_len(i)) + " bytes, chunk " +
                                   std::to_string(i) + " of " + std::to_string(num_chunks_) + ")",
                               err) +
                 "; pinning is disabled for this mapping and copies from it use pageable memory";
        logger = logger_;
      }
      settled_.notify_all();
      break;
    }
    settled_.notify_all();
  }
  if (!report.empty() && logger) logger(report);

  // Chunks another thread claimed are still kRegistering; their outcome decides our answer.
  std::unique_lock<std::mutex> lock(mutex_);
  settled_.wait(lock, [&] {
    for (size_t i = first; i <= last; ++i) {
      if (state_[i].load(std::memory_order_relaxed) == kRegistering) return false;
    }
    return true;
  });
  return all_registered(first, last);
}

bool PinRegistry::is_pinned(const void* ptr, size_t len) const {
  if (len == 0) return true;
  size_t first = 0;
  size_t last = 0;
  chunk_span(ptr, len, &first, &last);
  return all_registered(first, last);
}

size_t PinRegistry::contiguous_bytes(const void* ptr, size_t len) const {
  if (len == 0) return 0;
  size_t first = 0;
  size_t last = 0;
  chunk_span(ptr, len, &first, &last);
  const size_t offset = static_cast<size_t>(static_cast<const char*>(ptr) - base_);
  const size_t to_end = chunk_bytes_ - offset % chunk_bytes_;
  return len < to_end ? len : to_end;
}

size_t PinRegistry::pinned_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stats_.pinned_bytes;
}

PinStats PinRegistry::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stats_;
}

bool PinRegistry::failed() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return failed_;
}

void PinRegistry::set_logger(Logger logger) {
  std::lock_guard<std::mutex> lock(mutex_);
  logger_ = logger ? std::move(logger) : Logger(log_to_stderr);
}

}  // namespace vllm_shm_arena
