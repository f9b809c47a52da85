#include "core/release_gate.h"

#include <cstdio>
#include <utility>

namespace vllm_shm_arena {

namespace {

void log_to_stderr(const std::string& line) { std::fprintf(stderr, "%s\n", line.c_str()); }

bool is(CudaError err, int code) { return static_cast<int>(err) == code; }

}  // namespace

ReleaseGate::ReleaseGate(std::shared_ptr<CudaRuntime> rt)
    : rt_(std::move(rt)), logger_(log_to_stderr) {}

ReleaseGate::~ReleaseGate() {
  if (rt_ == nullptr) return;
  std::vector<CudaEvent> events = std::move(pool_);
  for (const Batch& b : recorded_) events.push_back(b.event);
  for (CudaEvent ev : events) {
    // Destroying an event whose work is still queued is allowed: the driver frees it later.
    CudaError err = rt_->event_destroy(ev);
    if (is(err, cuda_const::kSuccess)) continue;
    rt_->get_last_error();
    if (is(err, cuda_const::kErrorCudartUnloading)) return;
  }
}

void ReleaseGate::freed(uint64_t token) {
  std::lock_guard<std::mutex> lock(freed_mutex_);
  freed_.push_back(token);
  pending_.fetch_add(1, std::memory_order_relaxed);
}

std::string ReleaseGate::note_failure(Failure kind, const std::string& what, CudaError err,
                                      const char* consequence) {
  rt_->get_last_error();  // do not leave our failure for torch to report later
  if (reported_ & kind) return "";
  reported_ |= kind;
  return "vllm_shm_arena: " + rt_->describe(what, err) + "; " + consequence;
}

size_t ReleaseGate::flush(void* stream, const Release& release) {
  return flush_impl(stream, true, release);
}

size_t ReleaseGate::poll(const Release& release) { return flush_impl(nullptr, false, release); }

size_t ReleaseGate::flush_impl(void* stream, bool record, const Release& release) {
  std::vector<uint64_t> done;
  std::vector<std::string> lines;
  Logger logger;
  {
    std::lock_guard<std::mutex> lock(flush_mutex_);
    {
      std::lock_guard<std::mutex> freed_lock(freed_mutex_);
      if (unrecorded_.empty()) {
        unrecorded_.swap(freed_);
      } else {
        unrecorded_.insert(unrecorded_.end(), freed_.begin(), freed_.end());
        freed_.clear();
      }
    }

    if (rt_ == nullptr) {
      // No runtime in this process, so no DMA can be reading: nothing to wait for.
      done.swap(unrecorded_);
    } else {
      if (record && !unrecorded_.empty() && recorded_.size() < kMaxPendingEvents) {
        CudaEvent ev = nullptr;
        if (!pool_.empty()) {
          ev = pool_.back();
          pool_.pop_back();
        } else {
          CudaError err = rt_->event_create_with_flags(&ev, cuda_const::kEventDisableTiming);
          if (is(err, cuda_const::kSuccess)) {
            ++stats_.events_created;
          } else {
            ev = nullptr;
            ++stats_.record_failures;
            lines.push_back(note_failure(kCreateFailed, "cudaEventCreateWithFlags", err,
                                         "freed memory is held until an event can be recorded"));
          }
        }
        if (ev != nullptr) {
          CudaError err = rt_->event_record(ev, static_cast<CudaStream>(stream));
          if (is(err, cuda_const::kSuccess)) {
            ++stats_.records;
            recorded_.push_back(Batch{std::move(unrecorded_), ev});
            unrecorded_.clear();
          } else {
            // The tokens stay unrecorded: without an event behind them nothing proves the
            // copies are over. A later flush records them.
            pool_.push_back(ev);
            ++stats_.record_failures;
            lines.push_back(note_failure(kRecordFailed, "cudaEventRecord", err,
                                         "freed memory is held until an event can be recorded"));
          }
        }
      }

      for (auto it = recorded_.begin(); it != recorded_.end();) {
        CudaError err = rt_->event_query(it->event);
        if (is(err, cuda_const::kSuccess)) {
          done.insert(done.end(), it->tokens.begin(), it->tokens.end());
          pool_.push_back(it->event);
          it = recorded_.erase(it);
          continue;
        }
        if (is(err, cuda_const::kErrorNotReady)) {
          // "Not ready" also sets the runtime's last error; torch clears it the same way.
          rt_->get_last_error();
        } else {
          ++stats_.query_failures;
          lines.push_back(note_failure(kQueryFailed, "cudaEventQuery", err,
                                       "the memory it guards stays held (a failed query does not "
                                       "prove the copy is over)"));
        }
        ++it;
      }
    }
    stats_.released += done.size();
    if (!lines.empty()) logger = logger_;
  }
  // Subtract before calling back, so that a release callback that inspects pending() sees it.
  pending_.fetch_sub(done.size(), std::memory_order_relaxed);
  for (uint64_t token : done) release(token);
  if (logger) {
    for (const std::string& line : lines) {
      if (!line.empty()) logger(line);
    }
  }
  return done.size();
}

size_t ReleaseGate::drain_after_sync(const Release& release) {
  std::vector<uint64_t> done;
  {
    std::lock_guard<std::mutex> lock(flush_mutex_);
    for (Batch& b : recorded_) {
      done.insert(done.end(), b.tokens.begin(), b.tokens.end());
      pool_.push_back(b.event);
    }
    recorded_.clear();
    done.insert(done.end(), unrecorded_.begin(), unrecorded_.end());
    unrecorded_.clear();
    {
      std::lock_guard<std::mutex> freed_lock(freed_mutex_);
      done.insert(done.end(), freed_.begin(), freed_.end());
      freed_.clear();
    }
    stats_.released += done.size();
  }
  pending_.fetch_sub(done.size(), std::memory_order_relaxed);
  for (uint64_t token : done) release(token);
  return done.size();
}

size_t ReleaseGate::pending() const { return pending_.load(std::memory_order_relaxed); }

size_t ReleaseGate::pooled_events() const {
  std::lock_guard<std::mutex> lock(flush_mutex_);
  return pool_.size();
}

GateStats ReleaseGate::stats() const {
  std::lock_guard<std::mutex> lock(flush_mutex_);
  return stats_;
}

void ReleaseGate::set_logger(Logger logger) {
  std::lock_guard<std::mutex> lock(flush_mutex_);
  logger_ = logger ? std::move(logger) : Logger(log_to_stderr);
}

}  // namespace vllm_shm_arena
