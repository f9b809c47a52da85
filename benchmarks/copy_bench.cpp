// The core's copy, without torch: plain memcpy into warm memory vs the arena writer's
// parallel copy into a warm slot and into a never-touched slot, for 8 / 64 / 256 MiB.
// Prints GB/s and ratios to memcpy (medians); never asserts. Built by tests/cpp/CMakeLists.txt
// as `copy_bench`; run with `make bench-copy`.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <vector>

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

}  // namespace

int main() {
  const int reps = 7;
  std::printf("%8s %12s %14s %14s %14s %10s %10s\n", "MiB", "memcpy GB/s", "parallel GB/s",
              "warm slot GB/s", "cold slot GB/s", "warm/memcpy", "cold/memcpy");
  for (uint64_t mib : {8, 64, 256}) {
    const uint64_t n = mib << 20;
    std::vector<uint8_t> src(n, 1), dst(n, 2);  // both touched: warm
    std::vector<double> t_memcpy, t_parallel, t_warm, t_cold;
    for (int i = 0; i < reps; ++i) {
      t_memcpy.push_back(time_s([&] { std::memcpy(dst.data(), src.data(), n); }));
      t_parallel.push_back(time_s([&] { parallel_copy(dst.data(), src.data(), n); }));
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
        if (!a) return 1;
        if (i > 0) t_warm.push_back(t);  // i == 0 is the cold first write
        r->release_unacquired(a->record, a->generation);
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
    double m = median(t_memcpy), p = median(t_parallel), wm = median(t_warm), c = median(t_cold);
    std::printf("%8llu %12.2f %14.2f %14.2f %14.2f %10.2f %10.2f\n",
                static_cast<unsigned long long>(mib), gbps(m), gbps(p), gbps(wm), gbps(c), m / wm,
                m / c);
  }
  CopyPoolStats s = copy_pool_stats();
  std::printf("copy pool: %u worker threads, %llu parallel copies\n", s.threads,
              static_cast<unsigned long long>(s.parallel_copies));
  return 0;
}
