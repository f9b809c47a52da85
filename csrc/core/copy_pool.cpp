#include "core/copy_pool.h"

#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#if defined(__x86_64__)
#include <emmintrin.h>  // SSE2: baseline on x86-64, so no CPU dispatch is needed
#endif

namespace vllm_shm_arena {

namespace {

constexpr size_t kStripeAlign = 4096;
constexpr unsigned kMaxThreads = 8;
constexpr size_t kDefaultStreamMinBytes = size_t{32} << 20;

#if defined(__x86_64__)
// One 64-byte line from `src` to `dst` (64-byte aligned) with streaming stores.
inline void stream_line(uint8_t* dst, const uint8_t* src) {
  __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
  __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16));
  __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 32));
  __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 48));
  _mm_stream_si128(reinterpret_cast<__m128i*>(dst), a);
  _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 16), b);
  _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 32), c);
  _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 48), d);
}
#endif

// The text of a small procfs or cgroupfs file (at most 64 KiB), read with open/read: this is
// the first code a large copy runs, inside whatever process loaded the extension, so it uses
// no iostreams (their locale machinery belongs to whichever C++ runtime that process loaded
// first) and throws nothing.
bool read_text(const std::string& path, std::string* out) {
  constexpr size_t kMaxBytes = 64 << 10;
  int fd;
  do {
    fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) return false;
  out->clear();
  char buf[4096];
  bool ok = true;
  for (;;) {
    ssize_t n = ::read(fd, buf, sizeof buf);
    if (n > 0) {
      out->append(buf, static_cast<size_t>(n));
      if (out->size() > kMaxBytes) {
        ok = false;  // not a cgroup file
        break;
      }
    } else if (n == 0) {
      break;
    } else if (errno != EINTR) {
      ok = false;
      break;
    }
  }
  ::close(fd);
  return ok;
}

bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

// The whitespace-separated words of `text`.
std::vector<std::string_view> words(std::string_view text) {
  std::vector<std::string_view> out;
  size_t i = 0;
  while (i < text.size()) {
    while (i < text.size() && is_space(text[i])) ++i;
    size_t start = i;
    while (i < text.size() && !is_space(text[i])) ++i;
    if (i > start) out.push_back(text.substr(start, i - start));
  }
  return out;
}

// `text` split at each `sep` (empty pieces kept).
std::vector<std::string_view> split(std::string_view text, char sep) {
  std::vector<std::string_view> out;
  size_t start = 0;
  for (;;) {
    size_t at = text.find(sep, start);
    if (at == std::string_view::npos) {
      out.push_back(text.substr(start));
      return out;
    }
    out.push_back(text.substr(start, at - start));
    start = at + 1;
  }
}

// A whole decimal integer (an optional sign, then digits only) -> *value; false otherwise or
// out of range.
bool parse_int(std::string_view word, long long* value) {
  if (word.empty() || word.size() > 24) return false;
  char buf[32];
  std::memcpy(buf, word.data(), word.size());
  buf[word.size()] = '\0';
  char* end = nullptr;
  errno = 0;
  long long v = std::strtoll(buf, &end, 10);
  if (errno != 0 || end != buf + word.size() || end == buf) return false;
  *value = v;
  return true;
}

// The `n` whole decimal integers a cgroup file holds (whitespace around and between them) ->
// values[0, n); false for anything else ("max", a third word, a malformed file).
bool read_ints(const std::string& path, long long* values, size_t n) {
  std::string text;
  if (!read_text(path, &text)) return false;
  std::vector<std::string_view> w = words(text);
  if (w.size() != n) return false;
  for (size_t i = 0; i < n; ++i) {
    if (!parse_int(w[i], &values[i])) return false;
  }
  return true;
}

// "/a/b/c" -> "/a/b/c", "/a/b", "/a", "" (the root itself). A quota set on any ancestor
// limits every cgroup below it.
std::vector<std::string> self_and_ancestors(std::string path) {
  while (path.size() > 1 && path.back() == '/') path.pop_back();
  if (path == "/") path.clear();
  std::vector<std::string> out;
  for (;;) {
    out.push_back(path);
    if (path.empty()) break;
    size_t slash = path.rfind('/');
    path = slash == std::string::npos ? std::string() : path.substr(0, slash);
  }
  return out;
}

// CPUs from one quota: floor(quota / period), at least 1; 0 when it is not a quota.
unsigned cpus_of_quota(long long quota, long long period) {
  if (quota <= 0 || period <= 0) return 0;
  return static_cast<unsigned>(std::max(1LL, quota / period));
}

// The tightest of two limits where 0 means "no limit".
unsigned tighter(unsigned a, unsigned b) {
  if (a == 0) return b;
  if (b == 0) return a;
  return std::min(a, b);
}

// CPUs in the calling thread's affinity mask (hardware_concurrency if it cannot be read).
unsigned affinity_cpus() {
  std::vector<unsigned long> mask = affinity_mask(0);
  if (mask.empty()) return std::max(1u, std::thread::hardware_concurrency());
  return static_cast<unsigned>(std::max<size_t>(1, mask_cpus(mask)));
}

unsigned system_cgroup_limit() {
  std::string self;
  if (!read_text("/proc/self/cgroup", &self)) return 0;
  return cgroup_cpu_limit("/sys/fs/cgroup", self);
}

// One copy in flight. Workers claim stripes with fetch_add on `next` and count finished
// stripes in `done`; the caller waits until done == stripes. Process-local memory only, so
// plain std::atomic (no shared-memory ordering contract).
struct Job {
  uint8_t* dst = nullptr;
  const uint8_t* src = nullptr;
  size_t n = 0;
  size_t stripe = 0;
  size_t stripes = 0;
  bool stream = false;
  std::atomic<size_t> next{0};
  std::atomic<size_t> done{0};
};

void copy_bytes(uint8_t* dst, const uint8_t* src, size_t n, bool stream) {
  if (stream) {
    stream_copy(dst, src, n);
  } else {
    std::memcpy(dst, src, n);
  }
}

uint64_t elapsed_ns(std::chrono::steady_clock::time_point t0) {
  const auto d = std::chrono::steady_clock::now() - t0;
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(d).count());
}

void run_stripes(Job* job) {
  for (;;) {
    size_t i = job->next.fetch_add(1, std::memory_order_relaxed);
    if (i >= job->stripes) return;
    size_t off = i * job->stripe;
    size_t len = std::min(job->stripe, job->n - off);
    copy_bytes(job->dst + off, job->src + off, len, job->stream);
    // release: publishes this stripe's bytes to the caller's acquire load of `done` (a
    // streamed stripe was fenced inside stream_copy, before this store).
    job->done.fetch_add(1, std::memory_order_release);
  }
}

class Pool {
 public:
  Pool() { reset_after_fork(); }

  void copy(void* dst, const void* src, size_t n, CopyTarget target, size_t working_set) {
    copies_.fetch_add(1, std::memory_order_relaxed);
    bytes_.fetch_add(n, std::memory_order_relaxed);
    size_t stream_min = stream_min_.load(std::memory_order_relaxed);
    bool stream = target == CopyTarget::kShared && stream_copy_supported() && stream_min != 0 &&
                  n > 0 && std::max(n, working_set) >= stream_min;
    if (stream) stream_copies_.fetch_add(1, std::memory_order_relaxed);
    // Size check first: small copies (most ring frames) never pay for the sizing syscall.
    if (n < min_parallel_.load(std::memory_order_relaxed)) {
      copy_bytes(static_cast<uint8_t*>(dst), static_cast<const uint8_t*>(src), n, stream);
      return;
    }
    const auto [fewer, more] = candidates();
    if (more <= 1) {
      copy_bytes(static_cast<uint8_t*>(dst), static_cast<const uint8_t*>(src), n, stream);
      return;
    }
    // Only one parallel copy at a time: the arena has one writer, and a second caller would
    // only compete for the same memory bandwidth. The chooser is used under this lock too
    // (a one-thread copy it chose holds it as well, so that its time is a fair sample).
    pthread_mutex_lock(&copy_mu_);
    const unsigned want = chooser_.choose(n, fewer, more);
    if (want <= 1) {
      const auto t0 = std::chrono::steady_clock::now();
      copy_bytes(static_cast<uint8_t*>(dst), static_cast<const uint8_t*>(src), n, stream);
      chooser_.record(n, want, elapsed_ns(t0));
      pthread_mutex_unlock(&copy_mu_);
      return;
    }
    const auto t0 = std::chrono::steady_clock::now();
    ensure_threads(want - 1);
    Job job;
    job.dst = static_cast<uint8_t*>(dst);
    job.src = static_cast<const uint8_t*>(src);
    job.n = n;
    job.stream = stream;
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
    chooser_.record(n, want, elapsed_ns(t0));
    pthread_mutex_unlock(&copy_mu_);
    parallel_.fetch_add(1, std::memory_order_relaxed);
    if (want > fewer) wide_.fetch_add(1, std::memory_order_relaxed);
  }

  void set_threads(unsigned n) { requested_.store(n, std::memory_order_relaxed); }
  void set_readers(unsigned n) { readers_.store(n, std::memory_order_relaxed); }
  void set_min_parallel(size_t n) { min_parallel_.store(n, std::memory_order_relaxed); }
  void set_stream_min(size_t n) { stream_min_.store(n, std::memory_order_relaxed); }
  size_t stream_min() const { return stream_min_.load(std::memory_order_relaxed); }

  CopyPoolStats stats() {
    CopyPoolStats s;
    s.copies = copies_.load(std::memory_order_relaxed);
    s.parallel_copies = parallel_.load(std::memory_order_relaxed);
    s.wide_copies = wide_.load(std::memory_order_relaxed);
    s.bytes = bytes_.load(std::memory_order_relaxed);
    s.stream_copies = stream_copies_.load(std::memory_order_relaxed);
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
    wide_.store(0, std::memory_order_relaxed);
    chooser_ = ThreadCountChooser();  // the child measures for itself
    bytes_.store(0, std::memory_order_relaxed);
    stream_copies_.store(0, std::memory_order_relaxed);
    cgroup_limit_.store(kUnknown, std::memory_order_relaxed);  // the child may be moved
  }

  // The thread counts a large copy chooses between (ThreadCountChooser): {fewer, more}, the
  // same count twice when one was set. wide_copy_threads is never below auto_copy_threads.
  std::pair<unsigned, unsigned> candidates() {
    const unsigned r = requested_.load(std::memory_order_relaxed);
    if (r != 0) return {std::min(r, kMaxThreads), std::min(r, kMaxThreads)};
    const unsigned cpus = usable();
    return {auto_copy_threads(cpus, readers_.load(std::memory_order_relaxed)),
            wide_copy_threads(cpus)};
  }

  unsigned wanted_threads() { return candidates().first; }

  // The affinity mask is asked on every large copy (one syscall, nothing next to a copy of
  // megabytes) because a process may be pinned after start (vLLM's CPU workers bind their
  // threads); the cgroup quota costs file reads, so it is read once per process.
  unsigned usable() {
    unsigned limit = cgroup_limit_.load(std::memory_order_relaxed);
    if (limit == kUnknown) {
      limit = system_cgroup_limit();
      cgroup_limit_.store(limit, std::memory_order_relaxed);
    }
    unsigned aff = affinity_cpus();
    return limit == 0 ? aff : std::min(aff, limit);
  }

 private:
  static constexpr unsigned kUnknown = ~0u;

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
  std::atomic<unsigned> readers_{0};
  std::atomic<unsigned> cgroup_limit_{kUnknown};
  std::atomic<size_t> min_parallel_{size_t{4} << 20};
  std::atomic<uint64_t> copies_{0};
  std::atomic<uint64_t> parallel_{0};
  std::atomic<uint64_t> wide_{0};
  ThreadCountChooser chooser_;  // under copy_mu_
  std::atomic<uint64_t> bytes_{0};
  std::atomic<uint64_t> stream_copies_{0};
  std::atomic<size_t> stream_min_{kDefaultStreamMinBytes};
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

void parallel_copy(void* dst, const void* src, size_t n, CopyTarget target, size_t working_set) {
  pool_instance()->copy(dst, src, n, target, working_set);
}

bool stream_copy_supported() {
#if defined(__x86_64__)
  return true;
#else
  return false;
#endif
}

void stream_copy(void* dst_v, const void* src_v, size_t n) {
#if defined(__x86_64__)
  auto* dst = static_cast<uint8_t*>(dst_v);
  auto* src = static_cast<const uint8_t*>(src_v);
  // Head: up to the destination's next 64-byte boundary, with ordinary stores.
  size_t head = std::min(n, (64 - (reinterpret_cast<uintptr_t>(dst) & 63)) & 63);
  std::memcpy(dst, src, head);
  dst += head;
  src += head;
  n -= head;
  // Body: four 4 KiB pages at a time, one line from each in turn, which keeps four DRAM pages
  // streaming instead of one (this kept up with glibc's own non-temporal memcpy on large
  // copies, where a plain line-by-line loop fell behind).
  constexpr size_t kPage = 4096;
  constexpr size_t kBlock = 4 * kPage;
  size_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    for (size_t line = 0; line < kPage; line += 64) {
      for (size_t page = 0; page < kBlock; page += kPage) {
        stream_line(dst + i + page + line, src + i + page + line);
      }
    }
  }
  for (; i + 64 <= n; i += 64) stream_line(dst + i, src + i);
  std::memcpy(dst + i, src + i, n - i);
  // Streaming stores are weakly ordered: the fence makes them visible before any later store
  // of this thread (the release store that publishes the copy).
  _mm_sfence();
#else
  std::memcpy(dst_v, src_v, n);
#endif
}

void set_stream_min_bytes(size_t n) { pool_instance()->set_stream_min(n); }

size_t stream_min_bytes() { return pool_instance()->stream_min(); }
void set_copy_threads(unsigned n) { pool_instance()->set_threads(n); }
void set_copy_readers(unsigned n) { pool_instance()->set_readers(n); }
unsigned copy_threads() { return pool_instance()->wanted_threads(); }

unsigned usable_cpus() {
  unsigned aff = affinity_cpus();
  unsigned limit = system_cgroup_limit();
  return limit == 0 ? aff : std::min(aff, limit);
}

unsigned auto_copy_threads(unsigned usable, unsigned readers) {
  unsigned spare = usable > readers ? usable - readers : 1;
  return std::clamp(spare, 1u, kMaxThreads);
}

unsigned wide_copy_threads(unsigned usable) { return std::clamp(usable, 1u, kMaxThreads); }

size_t ThreadCountChooser::class_of(size_t n) {
  // floor(log2(n)) - 20: 0 for 1 MiB up to 2 MiB, ...; smaller copies share class 0.
  size_t log2 = 0;
  for (size_t v = n; v > 1; v >>= 1) ++log2;
  return std::min<size_t>(log2 > 20 ? log2 - 20 : 0, kClasses - 1);
}

unsigned ThreadCountChooser::choose(size_t n, unsigned fewer, unsigned more) {
  if (fewer >= more) return fewer;
  SizeClass& c = classes_[class_of(n)];
  if (c.fewer != fewer || c.more != more) c = SizeClass{fewer, more, {}, 0};  // new candidates
  const Arm& a = c.arms[0];
  const Arm& b = c.arms[1];
  if (a.samples < kTrials || b.samples < kTrials) return a.samples <= b.samples ? fewer : more;
  const bool more_faster = b.median() < a.median();
  if (++c.since_explore >= kExploreEvery) {
    c.since_explore = 0;
    return more_faster ? fewer : more;  // the other one, now and then
  }
  return more_faster ? more : fewer;
}

void ThreadCountChooser::record(size_t n, unsigned threads, uint64_t ns) {
  SizeClass& c = classes_[class_of(n)];
  if (c.fewer == c.more || n == 0) return;
  Arm* arm = threads == c.fewer ? &c.arms[0] : threads == c.more ? &c.arms[1] : nullptr;
  if (arm == nullptr) return;
  arm->recent[arm->next] = static_cast<double>(ns) / static_cast<double>(n);
  arm->next = (arm->next + 1) % kWindow;
  if (arm->samples < kWindow) arm->samples++;
}

double ThreadCountChooser::Arm::median() const {
  const unsigned k = samples;
  if (k == 0) return 0;
  double v[kWindow];
  std::copy(recent, recent + k, v);
  std::nth_element(v, v + k / 2, v + k);
  return v[k / 2];
}

unsigned cgroup_cpu_limit(const std::string& cgroup_root, const std::string& proc_self_cgroup) {
  // No iostreams and nothing thrown on this path (see read_text); a malformed file is no quota.
  unsigned limit = 0;
  for (std::string_view line : split(proc_self_cgroup, '\n')) {
    // hierarchy-id:controller-list:path
    size_t a = line.find(':');
    size_t b = a == std::string_view::npos ? a : line.find(':', a + 1);
    if (b == std::string_view::npos) continue;
    const std::string_view controllers = line.substr(a + 1, b - a - 1);
    const std::string path(line.substr(b + 1));
    if (controllers.empty()) {
      // cgroup v2: "max 100000" or "150000 100000" in cpu.max.
      for (const std::string& dir : self_and_ancestors(path)) {
        long long quota_period[2] = {0, 0};
        if (!read_ints(cgroup_root + dir + "/cpu.max", quota_period, 2)) continue;
        limit = tighter(limit, cpus_of_quota(quota_period[0], quota_period[1]));
      }
      continue;
    }
    // cgroup v1: the line whose controller list holds "cpu" (e.g. "cpu,cpuacct"), mounted
    // as <root>/cpu,cpuacct with <root>/cpu beside it on most distributions.
    bool has_cpu = false;
    for (std::string_view name : split(controllers, ',')) has_cpu = has_cpu || name == "cpu";
    if (!has_cpu) continue;
    for (const std::string& mount : {std::string(controllers), std::string("cpu")}) {
      for (const std::string& dir : self_and_ancestors(path)) {
        const std::string base = cgroup_root + "/" + mount + dir;
        long long quota = 0;
        long long period = 0;
        if (!read_ints(base + "/cpu.cfs_quota_us", &quota, 1) ||
            !read_ints(base + "/cpu.cfs_period_us", &period, 1)) {
          continue;
        }
        limit = tighter(limit, cpus_of_quota(quota, period));
      }
      if (mount == "cpu") break;
    }
  }
  return limit;
}
void set_min_parallel_bytes(size_t n) { pool_instance()->set_min_parallel(n); }
CopyPoolStats copy_pool_stats() { return pool_instance()->stats(); }

std::vector<unsigned long> affinity_mask(pid_t tid) {
  constexpr size_t kBitsPerWord = sizeof(unsigned long) * CHAR_BIT;
  for (size_t ncpu = CPU_SETSIZE; ncpu <= (size_t{1} << 16); ncpu *= 2) {
    std::vector<unsigned long> words(ncpu / kBitsPerWord, 0);
    size_t bytes = words.size() * sizeof(unsigned long);
    if (sched_getaffinity(tid, bytes, reinterpret_cast<cpu_set_t*>(words.data())) == 0) {
      return words;
    }
    if (errno != EINVAL) break;  // EINVAL: the kernel's mask is larger than ours; retry
  }
  return {};
}

size_t mask_cpus(const std::vector<unsigned long>& mask) {
  size_t n = 0;
  for (unsigned long w : mask) n += static_cast<size_t>(__builtin_popcountl(w));
  return n;
}

}  // namespace vllm_shm_arena
