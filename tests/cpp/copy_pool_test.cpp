// Tests of the parallel copy (copy_pool.cpp), including fork safety.
#include "core/copy_pool.h"

#include <sched.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "catch_compat.hpp"
#include "test_util.hpp"

using namespace vllm_shm_arena;

TEST_CASE("parallel copy is byte-exact at awkward sizes", "[copy]") {
  set_min_parallel_bytes(1 << 16);
  set_copy_threads(4);
  for (size_t n : {size_t{0}, size_t{1}, size_t{4095}, size_t{65536}, size_t{(1 << 20) + 17},
                   size_t{9 << 20}}) {
    std::vector<uint8_t> src(n + 3), dst(n + 3, 0);
    vsa_test::fill_pattern(src.data(), src.size(), n);
    // Misaligned on both sides on purpose.
    parallel_copy(dst.data() + 1, src.data() + 2, n);
    CHECK(std::memcmp(dst.data() + 1, src.data() + 2, n) == 0);
    CHECK(dst[0] == 0);
  }
  CopyPoolStats s = copy_pool_stats();
  CHECK(s.parallel_copies >= 2);
  CHECK(s.threads == 3);
  set_copy_threads(0);
  set_min_parallel_bytes(4 << 20);
}

TEST_CASE("streaming copy is byte-exact at every alignment and tail", "[copy]") {
  // Sizes around the 64-byte line and the 16 KiB four-page block; offsets put the destination
  // at every alignment of a line, the source independently misaligned.
  for (size_t n : {size_t{0}, size_t{1}, size_t{63}, size_t{64}, size_t{65}, size_t{4095},
                   size_t{16384}, size_t{16384 + 64 + 7}, size_t{(1 << 20) + 4093}}) {
    for (size_t dst_off : {size_t{0}, size_t{1}, size_t{17}, size_t{63}}) {
      size_t src_off = (dst_off * 7 + 3) % 64;
      std::vector<uint8_t> src(n + 128), dst(n + 128, 0xA5);
      vsa_test::fill_pattern(src.data(), src.size(), n + dst_off);
      stream_copy(dst.data() + dst_off, src.data() + src_off, n);
      INFO("n=" << n << " dst_off=" << dst_off << " src_off=" << src_off);
      CHECK(std::memcmp(dst.data() + dst_off, src.data() + src_off, n) == 0);
      // Nothing written outside [dst_off, dst_off + n).
      CHECK(std::all_of(dst.begin(), dst.begin() + dst_off, [](uint8_t b) { return b == 0xA5; }));
      CHECK(std::all_of(dst.begin() + dst_off + n, dst.end(), [](uint8_t b) { return b == 0xA5; }));
    }
  }
}

TEST_CASE("copies into shared memory stream from the working-set threshold up, local never",
          "[copy]") {
  size_t saved = stream_min_bytes();
  set_stream_min_bytes(size_t{1} << 20);
  for (unsigned threads : {1u, 3u}) {
    set_copy_threads(threads);
    set_min_parallel_bytes(1 << 16);
    std::vector<uint8_t> src((2 << 20) + 5), dst(src.size() + 1);
    vsa_test::fill_pattern(src.data(), src.size(), threads);
    uint64_t before = copy_pool_stats().stream_copies;
    parallel_copy(dst.data() + 1, src.data(), src.size(), CopyTarget::kShared);
    CHECK(std::memcmp(dst.data() + 1, src.data(), src.size()) == 0);
    uint64_t want = stream_copy_supported() ? 1 : 0;
    CHECK(copy_pool_stats().stream_copies - before == want);
    // Below the threshold, or local, or with streaming off: ordinary stores.
    parallel_copy(dst.data(), src.data(), (1 << 20) - 1, CopyTarget::kShared);
    parallel_copy(dst.data(), src.data(), src.size(), CopyTarget::kLocal);
    set_stream_min_bytes(0);
    parallel_copy(dst.data(), src.data(), src.size(), CopyTarget::kShared);
    CHECK(std::memcmp(dst.data(), src.data(), src.size()) == 0);
    CHECK(copy_pool_stats().stream_copies - before == want);
    set_stream_min_bytes(size_t{1} << 20);
    // A small copy streams when the message's working set (it and the copies before it)
    // reaches the threshold.
    std::fill(dst.begin(), dst.end(), 0);
    parallel_copy(dst.data(), src.data(), 1000, CopyTarget::kShared, size_t{1} << 20);
    CHECK(std::memcmp(dst.data(), src.data(), 1000) == 0);
    CHECK(copy_pool_stats().stream_copies - before == 2 * want);
  }
  set_stream_min_bytes(saved);
  set_copy_threads(0);
  set_min_parallel_bytes(4 << 20);
}

TEST_CASE("a forked child can copy in parallel and exit without hanging", "[copy][fork]") {
  set_min_parallel_bytes(1 << 16);
  set_copy_threads(3);
  std::vector<uint8_t> src(8 << 20), dst(8 << 20);
  vsa_test::fill_pattern(src.data(), src.size(), 7);
  parallel_copy(dst.data(), src.data(), src.size());  // parent's pool now has threads
  REQUIRE(copy_pool_stats().threads > 0);
  pid_t pid = ::fork();
  if (pid == 0) {
    std::vector<uint8_t> d2(8 << 20);
    parallel_copy(d2.data(), src.data(), src.size());
    bool ok = std::memcmp(d2.data(), src.data(), src.size()) == 0 &&
              copy_pool_stats().parallel_copies == 1;
    std::exit(ok ? 0 : 1);  // exit(), not _exit(): run atexit handlers, must not hang
  }
  CHECK(vsa_test::exited_ok(vsa_test::wait_child(pid, 20)));
  // The parent's pool still works after the fork.
  std::fill(dst.begin(), dst.end(), 0);
  parallel_copy(dst.data(), src.data(), src.size());
  CHECK(std::memcmp(dst.data(), src.data(), src.size()) == 0);
  set_copy_threads(0);
  set_min_parallel_bytes(4 << 20);
}

TEST_CASE("automatic sizing uses one thread when the affinity mask allows one CPU",
          "[copy][fork]") {
  // In a child, so narrowing the affinity mask leaves the test runner alone.
  pid_t pid = ::fork();
  if (pid == 0) {
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(sched_getcpu() >= 0 ? sched_getcpu() : 0, &one);
    if (sched_setaffinity(0, sizeof(one), &one) != 0) std::_Exit(2);
    set_copy_threads(0);
    set_min_parallel_bytes(1 << 16);
    std::vector<uint8_t> src(8 << 20), dst(8 << 20);
    vsa_test::fill_pattern(src.data(), src.size(), 3);
    parallel_copy(dst.data(), src.data(), src.size());
    CopyPoolStats s = copy_pool_stats();
    bool ok = std::memcmp(dst.data(), src.data(), src.size()) == 0 && s.threads == 0 &&
              s.parallel_copies == 0;
    if (!ok)
      std::printf("one usable CPU: %u worker threads, %llu parallel copies\n", s.threads,
                  static_cast<unsigned long long>(s.parallel_copies));
    std::fflush(stdout);
    std::_Exit(ok ? 0 : 1);
  }
  CHECK(vsa_test::exited_ok(vsa_test::wait_child(pid, 20)));
}

namespace {

// Writes `text` to root/rel, creating the folders on the way.
void put(const std::string& root, const std::string& rel, const std::string& text) {
  size_t slash = rel.rfind('/');
  std::string dir = slash == std::string::npos ? root : root + "/" + rel.substr(0, slash);
  std::string cmd = "mkdir -p '" + dir + "'";
  REQUIRE(std::system(cmd.c_str()) == 0);
  FILE* f = std::fopen((root + "/" + rel).c_str(), "w");
  REQUIRE(f != nullptr);
  std::fputs(text.c_str(), f);
  std::fclose(f);
}

}  // namespace

TEST_CASE("cgroup v2 cpu.max: the tightest quota of the cgroup and its ancestors", "[copy]") {
  vsa_test::TempDir root;
  REQUIRE_FALSE(root.path().empty());
  const std::string self = "0::/kubepods/pod1/ctr\n";
  CHECK(cgroup_cpu_limit(root.path(), self) == 0);  // no files: no quota
  put(root.path(), "kubepods/pod1/ctr/cpu.max", "max 100000\n");
  CHECK(cgroup_cpu_limit(root.path(), self) == 0);  // "max": no quota
  put(root.path(), "kubepods/pod1/ctr/cpu.max", "350000 100000\n");
  CHECK(cgroup_cpu_limit(root.path(), self) == 3);  // 3.5 CPUs: three whole ones
  put(root.path(), "kubepods/pod1/cpu.max", "200000 100000\n");
  CHECK(cgroup_cpu_limit(root.path(), self) == 2);  // the parent's quota is tighter
  put(root.path(), "kubepods/pod1/cpu.max", "50000 100000\n");
  CHECK(cgroup_cpu_limit(root.path(), self) == 1);  // half a CPU still runs one thread
  put(root.path(), "kubepods/pod1/cpu.max", "garbage\n");
  CHECK(cgroup_cpu_limit(root.path(), self) == 3);                 // a malformed file is no quota
  put(root.path(), "kubepods/pod1/cpu.max", "  200000\t 100000");  // spacing, no newline
  CHECK(cgroup_cpu_limit(root.path(), self) == 2);
  put(root.path(), "kubepods/pod1/cpu.max", "99999999999999999999999 100000\n");
  CHECK(cgroup_cpu_limit(root.path(), self) == 3);  // out of range: no quota
  put(root.path(), "kubepods/pod1/cpu.max", "200000 100000 7\n");
  CHECK(cgroup_cpu_limit(root.path(), self) == 3);  // a third word: not cpu.max's shape
  put(root.path(), "kubepods/pod1/cpu.max", "2e5 100000\n");
  CHECK(cgroup_cpu_limit(root.path(), self) == 3);  // not a whole decimal number
  // A container whose own cgroup is mounted as the root (path not under it).
  vsa_test::TempDir ns;
  put(ns.path(), "cpu.max", "400000 100000\n");
  CHECK(cgroup_cpu_limit(ns.path(), "0::/docker/abc\n") == 4);
}

TEST_CASE("cgroup v1 cfs quota under the cpu controller's mount", "[copy]") {
  vsa_test::TempDir root;
  REQUIRE_FALSE(root.path().empty());
  const std::string self =
      "12:memory:/job\n4:cpu,cpuacct:/job/task\n1:name=systemd:/job/task\n0::/job/task\n";
  put(root.path(), "cpu,cpuacct/job/task/cpu.cfs_quota_us", "-1\n");
  put(root.path(), "cpu,cpuacct/job/task/cpu.cfs_period_us", "100000\n");
  CHECK(cgroup_cpu_limit(root.path(), self) == 0);  // -1: no quota
  put(root.path(), "cpu,cpuacct/job/cpu.cfs_quota_us", "600000\n");
  put(root.path(), "cpu,cpuacct/job/cpu.cfs_period_us", "100000\n");
  CHECK(cgroup_cpu_limit(root.path(), self) == 6);
  // Only a "cpu" mount (the usual symlink) holds the files.
  vsa_test::TempDir cpu_only;
  put(cpu_only.path(), "cpu/job/task/cpu.cfs_quota_us", "250000\n");
  put(cpu_only.path(), "cpu/job/task/cpu.cfs_period_us", "100000\n");
  CHECK(cgroup_cpu_limit(cpu_only.path(), self) == 2);
  // A memory-only line is not the cpu controller.
  CHECK(cgroup_cpu_limit(cpu_only.path(), "12:memory:/job/task\n") == 0);
  // No trailing newline in either file or in /proc/self/cgroup's text; a malformed quota.
  put(cpu_only.path(), "cpu/job/task/cpu.cfs_quota_us", "300000");
  put(cpu_only.path(), "cpu/job/task/cpu.cfs_period_us", "100000");
  CHECK(cgroup_cpu_limit(cpu_only.path(), "4:cpu:/job/task") == 3);
  put(cpu_only.path(), "cpu/job/task/cpu.cfs_quota_us", "300000 1\n");
  CHECK(cgroup_cpu_limit(cpu_only.path(), self) == 0);
}

TEST_CASE("automatic thread count: usable CPUs minus readers, clamped to [1, 8]", "[copy]") {
  CHECK(auto_copy_threads(2, 1) == 1);  // the development machine at TP=1
  CHECK(auto_copy_threads(2, 4) == 1);  // more readers than CPUs
  CHECK(auto_copy_threads(1, 0) == 1);
  CHECK(auto_copy_threads(16, 4) == 8);
  CHECK(auto_copy_threads(8, 4) == 4);
  CHECK(auto_copy_threads(64, 0) == 8);
  CHECK(usable_cpus() >= 1);
  CHECK(usable_cpus() <= std::max(1u, std::thread::hardware_concurrency()));
}

TEST_CASE("the widest automatic count: every usable CPU, clamped to [1, 8]", "[copy]") {
  CHECK(wide_copy_threads(2) == 2);
  CHECK(wide_copy_threads(0) == 1);
  CHECK(wide_copy_threads(64) == 8);
}

namespace {

constexpr size_t kMiB = size_t{1} << 20;

// Runs `copies` choices for copies of `n` bytes, each recorded as taking `ns_per_byte(count)`
// per byte; returns how many used `more`.
template <typename Cost>
int run_chooser(ThreadCountChooser& c, size_t n, unsigned fewer, unsigned more, int copies,
                Cost ns_per_byte) {
  int wide = 0;
  for (int i = 0; i < copies; ++i) {
    unsigned t = c.choose(n, fewer, more);
    REQUIRE((t == fewer || t == more));
    wide += t == more;
    c.record(n, t, static_cast<uint64_t>(ns_per_byte(t) * static_cast<double>(n)));
  }
  return wide;
}

}  // namespace

TEST_CASE("the thread-count chooser keeps the faster count and still tries the other", "[copy]") {
  SECTION("more threads faster: nearly every copy uses them") {
    ThreadCountChooser c;
    int wide = run_chooser(c, 64 * kMiB, 1, 2, 80, [](unsigned t) { return t == 2 ? 0.05 : 0.1; });
    // Two trials each, then one copy in kExploreEvery goes to the slower count.
    CHECK(wide >= 80 - 2 - 80 / static_cast<int>(ThreadCountChooser::kExploreEvery));
    CHECK(wide < 80);
  }
  SECTION("fewer threads faster: nearly every copy uses fewer") {
    ThreadCountChooser c;
    int wide = run_chooser(c, 64 * kMiB, 1, 2, 80, [](unsigned t) { return t == 2 ? 0.2 : 0.1; });
    CHECK(wide <= 2 + 80 / static_cast<int>(ThreadCountChooser::kExploreEvery));
    CHECK(wide >= 2);
  }
  SECTION("when the costs swap, the choice follows within a few explorations") {
    ThreadCountChooser c;
    run_chooser(c, 64 * kMiB, 1, 2, 40, [](unsigned t) { return t == 2 ? 0.05 : 0.1; });
    run_chooser(c, 64 * kMiB, 1, 2, 80, [](unsigned t) { return t == 2 ? 0.3 : 0.1; });
    // Settled on fewer: the last kExploreEvery choices hold at most one wide copy.
    int wide = run_chooser(c, 64 * kMiB, 1, 2, static_cast<int>(ThreadCountChooser::kExploreEvery),
                           [](unsigned t) { return t == 2 ? 0.3 : 0.1; });
    CHECK(wide <= 1);
  }
  SECTION("one slow copy (a preemption) does not turn the choice") {
    ThreadCountChooser c;
    run_chooser(c, 64 * kMiB, 1, 2, 40, [](unsigned t) { return t == 2 ? 0.05 : 0.1; });
    // The next copy with more threads is 10x slower once; then the costs are as before.
    bool slowed = false;
    int wide = run_chooser(c, 64 * kMiB, 1, 2, 40, [&](unsigned t) {
      if (t == 2 && !slowed) {
        slowed = true;
        return 0.5;
      }
      return t == 2 ? 0.05 : 0.1;
    });
    CHECK(wide >= 40 - 40 / static_cast<int>(ThreadCountChooser::kExploreEvery) - 1);
  }
  SECTION("size classes are measured apart") {
    ThreadCountChooser c;
    // Large copies gain from the second thread, small ones lose.
    auto cost_large = [](unsigned t) { return t == 2 ? 0.05 : 0.1; };
    auto cost_small = [](unsigned t) { return t == 2 ? 0.2 : 0.1; };
    int wide_large = 0;
    int wide_small = 0;
    for (int i = 0; i < 40; ++i) {
      wide_large += run_chooser(c, 200 * kMiB, 1, 2, 1, cost_large);
      wide_small += run_chooser(c, 4 * kMiB, 1, 2, 1, cost_small);
    }
    CHECK(wide_large >= 30);
    CHECK(wide_small <= 10);
  }
  SECTION("equal counts: no choice, nothing measured") {
    ThreadCountChooser c;
    CHECK(c.choose(64 * kMiB, 2, 2) == 2);
    CHECK(c.choose(64 * kMiB, 3, 1) == 3);  // fewer >= more: fewer
    c.record(64 * kMiB, 2, 1);              // ignored
    CHECK(run_chooser(c, 64 * kMiB, 1, 2, 4, [](unsigned) { return 0.1; }) == 2);  // 2 trials
  }
  SECTION("new candidates start the measuring again") {
    ThreadCountChooser c;
    run_chooser(c, 64 * kMiB, 1, 2, 40, [](unsigned t) { return t == 2 ? 0.2 : 0.1; });
    // Readers went away: fewer is now 2 and more 4; both are tried before either is kept.
    int wide = run_chooser(c, 64 * kMiB, 2, 4, 4, [](unsigned t) { return t == 4 ? 0.2 : 0.1; });
    CHECK(wide == 2);
  }
}

TEST_CASE("automatic sizing copies with the readers' CPUs when that measured faster", "[copy]") {
  // Wiring, not speed: with readers on every CPU, a large copy still uses the wider count for
  // its trials (counted in wide_copies), and the bytes are right whichever count is used.
  if (usable_cpus() < 2) {
    VSA_SKIP("one usable CPU: there is no wider count to try");
    return;
  }
  set_copy_threads(0);
  set_copy_readers(usable_cpus());
  const size_t n = 8 * kMiB;
  std::vector<uint8_t> src(n), dst(n);
  for (size_t i = 0; i < n; ++i) src[i] = static_cast<uint8_t>(i * 7 + 3);
  uint64_t wide0 = copy_pool_stats().wide_copies;
  // Whatever the chooser measured before (other tests share the process's pool), at least
  // two of these copies use the wider count: its trials, or one exploration in kExploreEvery.
  for (int i = 0; i < 2 * static_cast<int>(ThreadCountChooser::kExploreEvery); ++i) {
    std::fill(dst.begin(), dst.end(), 0);
    parallel_copy(dst.data(), src.data(), n);
    REQUIRE(dst == src);
  }
  CHECK(copy_pool_stats().wide_copies - wide0 >= 2);
  set_copy_readers(0);
}

TEST_CASE("the readers hint lowers the automatic count; an explicit count wins", "[copy]") {
  set_copy_threads(0);
  set_copy_readers(0);
  unsigned alone = copy_threads();
  CHECK(alone == auto_copy_threads(usable_cpus(), 0));
  set_copy_readers(usable_cpus());
  CHECK(copy_threads() == 1);  // every usable CPU has a reader on it
  set_copy_threads(3);
  CHECK(copy_threads() == 3);
  set_copy_threads(0);
  set_copy_readers(0);
  CHECK(copy_threads() == alone);
}
