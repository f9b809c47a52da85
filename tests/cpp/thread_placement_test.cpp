// Tests of ThreadPlacement (thread_placement.cpp): helper threads steered off the caller's CPU.
#include "core/thread_placement.h"

#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <thread>
#include <vector>

#include "catch_compat.hpp"

using namespace vllm_shm_arena;

namespace {

// A named thread that waits until told to stop; its id is known once it runs.
struct Helper {
  std::atomic<pid_t> tid{0};
  std::atomic<bool> stop{false};
  std::thread t;
  explicit Helper(const char* name) {
    t = std::thread([this, name] {
      pthread_setname_np(pthread_self(), name);
      tid.store(static_cast<pid_t>(syscall(SYS_gettid)));
      while (!stop.load()) usleep(1000);
    });
    while (tid.load() == 0) usleep(100);
  }
  ~Helper() {
    stop.store(true);
    t.join();
  }
};

std::vector<int> cpus_of(pid_t tid) {
  cpu_set_t set;
  CPU_ZERO(&set);
  REQUIRE(sched_getaffinity(tid, sizeof(set), &set) == 0);
  std::vector<int> cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &set)) cpus.push_back(c);
  }
  return cpus;
}

void pin_caller(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  REQUIRE(sched_setaffinity(0, sizeof(set), &set) == 0);
}

// The CPUs this thread may use -> `mine`; false (the test skipped) with fewer than two.
bool two_cpus(std::vector<int>* mine) {
  *mine = cpus_of(0);
  if (mine->size() >= 2) return true;
  VSA_SKIP("needs two CPUs");
  return false;
}

// Gives the calling thread its affinity mask back at scope exit, however the test ends
// (Catch2 runs the next test case on the same thread).
struct RestoreCallerMask {
  cpu_set_t saved;
  RestoreCallerMask() { REQUIRE(sched_getaffinity(0, sizeof(saved), &saved) == 0); }
  ~RestoreCallerMask() { sched_setaffinity(0, sizeof(saved), &saved); }
  void now() const { REQUIRE(sched_setaffinity(0, sizeof(saved), &saved) == 0); }
};

bool contains(const std::vector<int>& v, int x) {
  for (int c : v) {
    if (c == x) return true;
  }
  return false;
}

}  // namespace

TEST_CASE("find_threads finds this process's threads by name prefix", "[placement]") {
  Helper a("vsa-pl-a/IO/0");
  Helper b("vsa-pl-b/IO/0");
  std::vector<pid_t> found = find_threads("vsa-pl-a/");
  REQUIRE(found.size() == 1);
  CHECK(found[0] == a.tid.load());
  CHECK(find_threads("vsa-pl-").size() == 2);
  CHECK(find_threads("vsa-pl-c/").empty());
}

TEST_CASE("helper threads are kept off the caller's CPU, wherever it runs, until released",
          "[placement]") {
  std::vector<int> mine;
  if (!two_cpus(&mine)) return;
  Helper h("vsa-pl-steer");
  std::vector<int> before = cpus_of(h.tid.load());
  RestoreCallerMask restore;
  {
    ThreadPlacement p({h.tid.load()});
    REQUIRE(p.size() == 1);
    for (int round = 0; round < 2; ++round) {
      for (int cpu : {mine[0], mine[1]}) {
        pin_caller(cpu);
        p.keep_off_caller();
        CHECK(p.avoided_cpu() == cpu);
        std::vector<int> now = cpus_of(h.tid.load());
        CHECK_FALSE(contains(now, cpu));
        CHECK(now.size() == before.size() - 1);  // only that CPU was taken away
        p.release();
        CHECK(p.avoided_cpu() == -1);
        CHECK(cpus_of(h.tid.load()) == before);
      }
    }
    CHECK(p.moves() == 4);
    p.release();  // not narrowed: nothing to do
    CHECK(cpus_of(h.tid.load()) == before);
  }
}

TEST_CASE("a thread with one CPU keeps it; a gone thread is dropped", "[placement]") {
  std::vector<int> mine;
  if (!two_cpus(&mine)) return;
  RestoreCallerMask restore;
  Helper single("vsa-pl-single");
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(mine[0], &one);
  REQUIRE(sched_setaffinity(single.tid.load(), sizeof(one), &one) == 0);
  Helper steered("vsa-pl-kept");
  // A thread confined to one CPU is not steered at all (there is nowhere else for it).
  ThreadPlacement p({single.tid.load(), steered.tid.load()});
  CHECK(p.size() == 1);
  pin_caller(mine[0]);
  p.keep_off_caller();
  CHECK(cpus_of(single.tid.load()) == std::vector<int>{mine[0]});
  CHECK_FALSE(contains(cpus_of(steered.tid.load()), mine[0]));
  p.release();
  CHECK(contains(cpus_of(steered.tid.load()), mine[0]));
  // A thread that exited after construction: dropped at the next move, nothing thrown.
  restore.now();  // new threads inherit the caller's mask
  Helper other("vsa-pl-other");
  Helper* late = new Helper("vsa-pl-late");
  ThreadPlacement r({late->tid.load(), other.tid.load()});
  CHECK(r.size() == 2);
  delete late;
  pin_caller(mine[1]);
  r.keep_off_caller();
  CHECK(r.size() == 1);
  CHECK_FALSE(contains(cpus_of(other.tid.load()), mine[1]));
}

TEST_CASE("a forked child never steers its parent's threads", "[placement]") {
  std::vector<int> mine;
  if (!two_cpus(&mine)) return;
  Helper h("vsa-pl-fork");
  std::vector<int> before = cpus_of(h.tid.load());
  ThreadPlacement p({h.tid.load()});
  pid_t child = fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(mine[0], &set);
    sched_setaffinity(0, sizeof(set), &set);
    p.keep_off_caller();
    _exit(p.moves() == 0 ? 0 : 1);
  }
  int status = 0;
  REQUIRE(waitpid(child, &status, 0) == child);
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  CHECK(cpus_of(h.tid.load()) == before);
}
