// The core's copy, without torch. Part 1: one thread vs N threads of the copy pool vs glibc
// memcpy at 1-256 MiB into a warm destination, while `readers` busy threads stream through
// memory on the other CPUs (the queue's readers copying the previous message out), for no
// readers and for every other usable CPU busy. Part 2: the arena writer's copy into a warm
// and a never-touched slot. Part 3: ordinary vs streaming stores (copy_pool.h) into shared
// memory, one thread, each copy followed by a second thread reading the bytes out (a
// reader's consume), for single tensors and for a 25 x 16 MiB burst. Prints GB/s and ratios
// (medians of interleaved repetitions); never asserts. torch's copy_ on the same sizes is
// benchmarks/bench_extension.py. Built by tests/cpp/CMakeLists.txt as `copy_bench`; run with `make
// bench-copy`.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <sys/mman.h>

#include "core/arena.h"
#include "core/copy_pool.h"

using namespace vllm_shm_arena;
using Clock = std::chrono::steady_clock;

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

template <typename F>
double time_s(F&& f) {
  auto t0 = Clock::now();
  f();
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Threads that read a private buffer larger than the last-level cache, over and over, until
// stopped: memory traffic and CPU time taken away from the copy, like a reader's consume.
class BusyReaders {
 public:
  explicit BusyReaders(unsigned n) {
    for (unsigned i = 0; i < n; ++i) {
      threads_.emplace_back([this] {
        std::vector<uint64_t> buf((64u << 20) / sizeof(uint64_t), 1);
        uint64_t sum = 0;
        while (!stop_.load(std::memory_order_relaxed)) {
          for (uint64_t x : buf) sum += x;
        }
        sink_.fetch_add(sum, std::memory_order_relaxed);  // keeps the loop from vanishing
      });
    }
  }
  ~BusyReaders() {
    stop_.store(true, std::memory_order_relaxed);
    for (auto& t : threads_) t.join();
  }

 private:
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> sink_{0};
  std::vector<std::thread> threads_;
};

void pool_vs_memcpy(unsigned readers, const std::vector<unsigned>& thread_counts, int reps) {
  std::printf("\n%u busy reader thread(s); automatic sizing would use %u copy thread(s)\n", readers,
              auto_copy_threads(usable_cpus(), readers));
  std::printf("%6s %12s", "MiB", "memcpy GB/s");
  for (unsigned t : thread_counts) std::printf("   %2u thr GB/s", t);
  for (unsigned t : thread_counts) {
    if (t > 1) std::printf("  %2u/1 thr", t);
  }
  std::printf("  1 thr/memcpy\n");
  BusyReaders busy(readers);
  set_min_parallel_bytes(0);  // measure the pool at every size, not only above its threshold
  for (uint64_t mib : {1, 4, 16, 64, 256}) {
    const uint64_t n = mib << 20;
    std::vector<uint8_t> src(n, 1), dst(n, 2);  // both touched: warm
    std::vector<double> t_memcpy;
    std::vector<std::vector<double>> t_pool(thread_counts.size());
    int r = mib >= 64 ? reps : reps * 3;  // small copies are quick: more samples
    for (int i = 0; i < r; ++i) {
      // Interleaved: the shared machine's noise hits every configuration alike.
      t_memcpy.push_back(time_s([&] { std::memcpy(dst.data(), src.data(), n); }));
      for (size_t k = 0; k < thread_counts.size(); ++k) {
        set_copy_threads(thread_counts[k]);
        t_pool[k].push_back(time_s([&] { parallel_copy(dst.data(), src.data(), n); }));
      }
    }
    auto gbps = [&](double s) { return n / s / 1e9; };
    double m = median(t_memcpy);
    std::vector<double> p;
    for (auto& v : t_pool) p.push_back(median(v));
    std::printf("%6llu %12.2f", static_cast<unsigned long long>(mib), gbps(m));
    for (double x : p) std::printf(" %12.2f", gbps(x));
    for (size_t k = 0; k < thread_counts.size(); ++k) {
      if (thread_counts[k] > 1) std::printf(" %9.2f", p[0] / p[k]);
    }
    std::printf(" %13.2f\n", m / p[0]);
  }
  set_copy_threads(0);
  set_min_parallel_bytes(4 << 20);
}

void arena_slots(int reps) {
  std::printf("\narena writer's copy (automatic thread count, no busy readers)\n");
  std::printf("%6s %12s %14s %14s %11s %11s\n", "MiB", "memcpy GB/s", "warm slot GB/s",
              "cold slot GB/s", "warm/memcpy", "cold/memcpy");
  for (uint64_t mib : {8, 64, 256}) {
    const uint64_t n = mib << 20;
    std::vector<uint8_t> src(n, 1), dst(n, 2);
    std::vector<double> t_memcpy, t_warm, t_cold;
    for (int i = 0; i < reps; ++i) {
      t_memcpy.push_back(time_s([&] { std::memcpy(dst.data(), src.data(), n); }));
    }
    {
      // One slot, one reader that lets go at once: every write after the first is warm.
      ArenaConfig cfg;
      cfg.n_readers = 1;
      cfg.num_slots = 1;
      cfg.slot_bytes = n;
      auto w = ArenaWriter::create(cfg);
      auto r = ArenaReader::attach(w->name(), 0, cfg.dir);
      w->unlink();
      for (int i = 0; i <= reps; ++i) {
        std::optional<Allocation> a;
        double t = time_s([&] { a = w->write(src.data(), n); });
        if (!a) return;
        if (i > 0) t_warm.push_back(t);  // i == 0 is the cold first write
        r->release_unacquired(a->slot, a->generation);
      }
    }
    for (int i = 0; i < reps; ++i) {
      // A fresh arena each time: the slot's pages have never been touched.
      ArenaConfig cfg;
      cfg.n_readers = 1;
      cfg.num_slots = 1;
      cfg.slot_bytes = n;
      auto w = ArenaWriter::create(cfg);
      w->unlink();
      t_cold.push_back(time_s([&] {
        if (!w->write(src.data(), n)) std::printf("cold write declined\n");
      }));
    }
    auto gbps = [&](double s) { return n / s / 1e9; };
    double m = median(t_memcpy), wm = median(t_warm), c = median(t_cold);
    std::printf("%6llu %12.2f %14.2f %14.2f %11.2f %11.2f\n", static_cast<unsigned long long>(mib),
                gbps(m), gbps(wm), gbps(c), m / wm, m / c);
  }
}

// Writes `count` buffers of `mib` MiB into MAP_SHARED memory with memcpy or stream_copy, then
// a second thread copies each out (a reader's consume); both timed, interleaved by repetition.
void stream_vs_memcpy(int reps) {
  std::printf(
      "\nordinary vs streaming stores into shared memory (1 thread), then a reader's copy out\n");
  std::printf("%12s %13s %13s %13s %13s %15s\n", "workload", "memcpy GB/s", "stream GB/s",
              "write m/s", "consume m/s", "write+consume");
  struct Case {
    uint64_t mib;
    int count;
  };
  for (Case c : {Case{8, 1}, Case{16, 1}, Case{64, 1}, Case{200, 1}, Case{16, 25}}) {
    const uint64_t n = c.mib << 20;
    std::vector<std::vector<uint8_t>> src(c.count, std::vector<uint8_t>(n, 1));
    std::vector<uint8_t*> dst;
    for (int k = 0; k < c.count; ++k) {
      void* p = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
      if (p == MAP_FAILED) return;
      std::memset(p, 2, n);  // warm, like a reused arena allocation
      dst.push_back(static_cast<uint8_t*>(p));
    }
    std::vector<uint8_t> out(n);
    std::vector<double> w[2], r[2];
    for (int i = 0; i < reps; ++i) {
      for (int mode = 0; mode < 2; ++mode) {
        w[mode].push_back(time_s([&] {
          for (int k = 0; k < c.count; ++k) {
            if (mode == 0) {
              std::memcpy(dst[k], src[k].data(), n);
            } else {
              stream_copy(dst[k], src[k].data(), n);
            }
          }
        }));
        r[mode].push_back(time_s([&] {
          std::thread t([&] {
            for (int k = 0; k < c.count; ++k) std::memcpy(out.data(), dst[k], n);
          });
          t.join();
        }));
      }
    }
    double wm = median(w[0]), ws = median(w[1]), rm = median(r[0]), rs = median(r[1]);
    std::string name = std::to_string(c.mib) + " MiB";
    if (c.count > 1) name = std::to_string(c.count) + "x" + name;
    double bytes = static_cast<double>(n) * c.count;
    std::printf("%12s %13.2f %13.2f %13.2f %13.2f %15.2f\n", name.c_str(), bytes / wm / 1e9,
                bytes / ws / 1e9, wm / ws, rm / rs, (wm + rm) / (ws + rs));
    for (uint8_t* p : dst) munmap(p, n);
  }
  if (!stream_copy_supported()) std::printf("(no streaming stores on this CPU: both are memcpy)\n");
}

}  // namespace

int main(int argc, char** argv) {
  const int reps = argc > 1 ? std::max(1, std::atoi(argv[1])) : 7;
  const unsigned usable = usable_cpus();
  std::printf("usable CPUs: %u (affinity mask and cgroup quota; hardware_concurrency %u)\n", usable,
              std::thread::hardware_concurrency());
  std::vector<unsigned> thread_counts = {1};
  for (unsigned t : {2u, 4u, 8u}) {
    if (t <= std::max(2u, usable)) thread_counts.push_back(t);
  }
  std::vector<unsigned> reader_counts = {0};
  if (usable > 1) {
    if (usable / 2 > 0 && usable / 2 != usable - 1) reader_counts.push_back(usable / 2);
    reader_counts.push_back(usable - 1);
  }
  for (unsigned readers : reader_counts) pool_vs_memcpy(readers, thread_counts, reps);
  arena_slots(reps);
  stream_vs_memcpy(reps);
  return 0;
}
