// Tests of ProcessIdentity (process_identity.cpp): pid reuse and zombies.
#include "core/process_identity.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>

#include "catch_compat.hpp"
#include "test_util.hpp"

using namespace vllm_shm_arena;

TEST_CASE("self is alive, nobody is not", "[identity]") {
  ProcessIdentity sut = ProcessIdentity::self();
  CHECK_FALSE(sut.empty());
  CHECK(sut.pid() == ::getpid());
  CHECK(sut.is_alive());
  CHECK_FALSE(ProcessIdentity().is_alive());
}

TEST_CASE("a killed child is dead before and after it is reaped", "[identity]") {
  pid_t pid = ::fork();
  if (pid == 0) {
    for (;;) ::pause();
  }
  ProcessIdentity sut = ProcessIdentity::of(pid);
  REQUIRE(sut.is_alive());
  ::kill(pid, SIGKILL);
  siginfo_t info;
  std::memset(&info, 0, sizeof(info));
  REQUIRE(::waitid(P_PID, pid, &info, WEXITED | WNOWAIT) == 0);
  CHECK(::kill(pid, 0) == 0);   // a zombie still answers kill(pid, 0)...
  CHECK_FALSE(sut.is_alive());  // ...but is not alive
  vsa_test::wait_child(pid);
  CHECK_FALSE(sut.is_alive());
}

TEST_CASE("a different start time under the same pid is another process", "[identity]") {
  ProcessIdentity me = ProcessIdentity::self();
  // Same pid, start time off by one: what a reused pid looks like.
  ProcessIdentity sut(me.packed() + (1ull << 32));
  CHECK_FALSE(sut.is_alive());
}
