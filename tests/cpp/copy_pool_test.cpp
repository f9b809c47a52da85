// Tests of the parallel copy (copy_pool.cpp), including fork safety.
#include "core/copy_pool.h"

#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
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
