#include "core/copy_pool.h"

#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <thread>
#include <vector>

namespace vllm_shm_arena {

namespace {

constexpr size_t kStripeAlign = 4096;
constexpr unsigned kMaxThreads = 8;

// One copy in flight. Workers claim stripes with fetch_add on `next` and count finished
// stripes in `done`; the caller waits until done == stripes. Process-local memory only, so
// plain std::atomic (no shared-memory ordering contract).
struct Job {
  uint8_t* dst = nullptr;
  const uint8_t* src = nullptr;
  size_t n = 0;
  size_t stripe = 0;
  size_t stripes = 0;
  std::atomic<size_t> next{0};
  std::atomic<size_t> done{0};
};

void run_stripes(Job* job) {
  for (;;) {
    size_t i = job->next.fetch_add(1, std::memory_order_relaxed);
    if (i >= job->stripes) return;
    size_t off = i * job->stripe;
    size_t len = std::min(job->stripe, job->n - off);
    std::memcpy(job->dst + off, job->src + off, len);
    // release: publishes this stripe's bytes to the caller's acquire load of `done`.
    job->done.fetch_add(1, std::memory_order_release);
  }
}

class Pool {
 public:
  Pool() { reset_after_fork(); }

  void copy(void* dst, const void* src, size_t n) {
    copies_.fetch_add(1, std::memory_order_relaxed);
    bytes_.fetch_add(n, std::memory_order_relaxed);
    unsigned want = wanted_threads();
    if (n < min_parallel_.load(std::memory_order_relaxed) || want <= 1) {
      std::memcpy(dst, src, n);
      return;
    }
    // Only one parallel copy at a time: the arena has one writer, and a second caller would
    // only compete for the same memory bandwidth.
    pthread_mutex_lock(&copy_mu_);
    ensure_threads(want - 1);
    Job job;
    job.dst = static_cast<uint8_t*>(dst);
    job.src = static_cast<const uint8_t*>(src);
    job.n = n;
    size_t per = (n + want - 1) / want;
    job.stripe = (per + kStripeAlign - 1) / kStripeAlign * kStripeAlign;
    job.stripes = (n + job.stripe - 1) / job.stripe;
    pthread_mutex_lock(&mu_);
    job_ = &job;
    ++job_seq_;
    pthread_cond_broadcast(&cv_);
    pthread_mutex_unlock(&mu_);
    run_stripes(&job);
    // acquire: pairs with the release fetch_add in run_stripes, so every stripe is visible.
    while (job.done.load(std::memory_order_acquire) < job.stripes) {
      std::this_thread::yield();
    }
    pthread_mutex_lock(&mu_);
    job_ = nullptr;
    // Workers that woke late must not touch `job` (on our stack) after we return.
    while (busy_ > 0) pthread_cond_wait(&idle_cv_, &mu_);
    pthread_mutex_unlock(&mu_);
    pthread_mutex_unlock(&copy_mu_);
    parallel_.fetch_add(1, std::memory_order_relaxed);
  }

  void set_threads(unsigned n) { requested_.store(n, std::memory_order_relaxed); }
  void set_min_parallel(size_t n) { min_parallel_.store(n, std::memory_order_relaxed); }

  CopyPoolStats stats() {
    CopyPoolStats s;
    s.copies = copies_.load(std::memory_order_relaxed);
    s.parallel_copies = parallel_.load(std::memory_order_relaxed);
    s.bytes = bytes_.load(std::memory_order_relaxed);
    pthread_mutex_lock(&mu_);
    s.threads = static_cast<uint32_t>(threads_.size());
    pthread_mutex_unlock(&mu_);
    return s;
  }

  // pthread_atfork hooks: hold both locks across fork so the child never inherits them
  // mid-update, then give the child a pool with no threads.
  void before_fork() {
    pthread_mutex_lock(&copy_mu_);
    pthread_mutex_lock(&mu_);
  }
  void after_fork_parent() {
    pthread_mutex_unlock(&mu_);
    pthread_mutex_unlock(&copy_mu_);
  }
  void reset_after_fork() {
    pthread_mutex_init(&copy_mu_, nullptr);
    pthread_mutex_init(&mu_, nullptr);
    pthread_cond_init(&cv_, nullptr);
    pthread_cond_init(&idle_cv_, nullptr);
    threads_.clear();  // The threads do not exist in the child; just forget them.
    job_ = nullptr;
    job_seq_ = 0;
    busy_ = 0;
    copies_.store(0, std::memory_order_relaxed);
    parallel_.store(0, std::memory_order_relaxed);
    bytes_.store(0, std::memory_order_relaxed);
  }

 private:
  unsigned wanted_threads() const {
    unsigned r = requested_.load(std::memory_order_relaxed);
    if (r == 0) {
      r = std::max(1u, std::thread::hardware_concurrency());
    }
    return std::min(r, kMaxThreads);
  }

  // Called with copy_mu_ held.
  void ensure_threads(unsigned n) {
    pthread_mutex_lock(&mu_);
    while (threads_.size() < n) {
      pthread_t t;
      if (pthread_create(&t, nullptr, &Pool::worker_main, this) != 0) break;
      pthread_detach(t);
      threads_.push_back(t);
    }
    pthread_mutex_unlock(&mu_);
  }

  static void* worker_main(void* arg) {
    static_cast<Pool*>(arg)->worker_loop();
    return nullptr;
  }

  void worker_loop() {
    uint64_t seen = 0;
    pthread_mutex_lock(&mu_);
    seen = job_seq_;
    for (;;) {
      while (job_seq_ == seen) pthread_cond_wait(&cv_, &mu_);
      seen = job_seq_;
      Job* job = job_;
      if (job == nullptr) continue;
      ++busy_;
      pthread_mutex_unlock(&mu_);
      run_stripes(job);
      pthread_mutex_lock(&mu_);
      if (--busy_ == 0) pthread_cond_broadcast(&idle_cv_);
    }
  }

  pthread_mutex_t copy_mu_;
  pthread_mutex_t mu_;
  pthread_cond_t cv_;
  pthread_cond_t idle_cv_;
  std::vector<pthread_t> threads_;
  Job* job_ = nullptr;
  uint64_t job_seq_ = 0;
  int busy_ = 0;
  std::atomic<unsigned> requested_{0};
  std::atomic<size_t> min_parallel_{size_t{4} << 20};
  std::atomic<uint64_t> copies_{0};
  std::atomic<uint64_t> parallel_{0};
  std::atomic<uint64_t> bytes_{0};
};

Pool* pool_instance() {
  static Pool* pool = [] {
    Pool* p = new Pool();  // Never deleted: see the header comment on exit and fork.
    pthread_atfork([] { pool_instance()->before_fork(); },
                   [] { pool_instance()->after_fork_parent(); },
                   [] { pool_instance()->reset_after_fork(); });
    return p;
  }();
  return pool;
}

}  // namespace

void parallel_copy(void* dst, const void* src, size_t n) { pool_instance()->copy(dst, src, n); }
void set_copy_threads(unsigned n) { pool_instance()->set_threads(n); }
void set_min_parallel_bytes(size_t n) { pool_instance()->set_min_parallel(n); }
CopyPoolStats copy_pool_stats() { return pool_instance()->stats(); }

}  // namespace vllm_shm_arena
