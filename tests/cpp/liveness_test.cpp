// Tests of the liveness primitive (liveness.cpp): a role's token is held exactly while the
// process that took it lives, whatever happens to its pid, its threads, /proc or its fds.
//
// Every forked child ends in _exit() and is reaped by vsa_test::wait_child (killed after its
// timeout), so no test leaves a process behind or hangs.
#include "core/liveness.h"

#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <cstring>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "catch_compat.hpp"
#include "core/errors.h"
#include "test_util.hpp"

using namespace vllm_shm_arena;

namespace {

// A file to hold tokens on, and a descriptor of it that holds none (to probe through).
struct TokenFileFixture {
  vsa_test::TempDir dir;
  std::string path = dir.path() + "/seg";
  int probe_fd = -1;
  TokenFileFixture() {
    probe_fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    REQUIRE(probe_fd >= 0);
  }
  ~TokenFileFixture() { ::close(probe_fd); }
};

// Reads one byte from `fd` (the child's "ready" signal); false on EOF or error.
bool wait_ready(int fd) {
  char c = 0;
  return ::read(fd, &c, 1) == 1;
}

}  // namespace

TEST_CASE("a token is alive while held and dead once released", "[liveness]") {
  TokenFileFixture f;
  CHECK(probe_token(f.probe_fd, 3) == Liveness::kDead);
  auto sut = LivenessToken::take(f.path, 3);
  CHECK(probe_token(f.probe_fd, 3) == Liveness::kAlive);
  CHECK(probe_token(f.probe_fd, 4) == Liveness::kDead);  // one byte per role
  sut.reset();
  CHECK(probe_token(f.probe_fd, 3) == Liveness::kDead);
}

TEST_CASE("two objects of one process cannot hold the same role", "[liveness]") {
  // Ranks run as threads of one process must be told apart: tokens belong to open file
  // descriptions, not to processes.
  TokenFileFixture f;
  auto sut = LivenessToken::take(f.path, 1);
  CHECK_THROWS_AS(LivenessToken::take(f.path, 1), TokenHeld);
  auto other = LivenessToken::take(f.path, 2);
  CHECK(probe_token(f.probe_fd, 1) == Liveness::kAlive);
  CHECK(probe_token(f.probe_fd, 2) == Liveness::kAlive);
}

TEST_CASE("a token on a replaced name is refused", "[liveness][faults]") {
  TokenFileFixture f;
  const std::string other = f.dir.path() + "/other";
  int fd = ::open(other.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  REQUIRE(fd >= 0);
  CHECK_THROWS_AS(LivenessToken::take(f.path, 0, fd), ShmError);
  ::close(fd);
}

TEST_CASE("a probe the kernel cannot answer is unknown, never dead", "[liveness][faults]") {
  CHECK(probe_token(-1, 0) == Liveness::kUnknown);  // EBADF
  TokenFileFixture f;
  int ro = ::open(f.path.c_str(), O_RDONLY | O_CLOEXEC);
  REQUIRE(ro >= 0);
  ::close(ro);
  CHECK(probe_token(ro, 0) == Liveness::kUnknown);  // a closed descriptor
}

TEST_CASE("a killed holder is dead, reaped or not", "[liveness][faults]") {
  for (bool reap : {true, false}) {
    DYNAMIC_SECTION((reap ? "reaped" : "zombie (not reaped)")) {
      TokenFileFixture f;
      int p[2];
      REQUIRE(::pipe(p) == 0);
      pid_t pid = ::fork();
      if (pid == 0) {
        auto t = LivenessToken::take(f.path, 7);
        if (::write(p[1], "r", 1) != 1) ::_exit(2);
        for (;;) ::pause();
      }
      ::close(p[1]);
      REQUIRE(wait_ready(p[0]));
      ::close(p[0]);
      CHECK(probe_token(f.probe_fd, 7) == Liveness::kAlive);
      REQUIRE(vsa_test::kill_child(pid, reap));  // reaped, or left a zombie
      CHECK(probe_token(f.probe_fd, 7) == Liveness::kDead);
      if (!reap) vsa_test::wait_child(pid);
    }
  }
}

TEST_CASE("a forked child does not keep its parent's token alive", "[liveness][fork]") {
  // The holder forks a grandchild that outlives it: the holder's death must still read dead.
  TokenFileFixture f;
  int p[2], g[2];
  REQUIRE(::pipe(p) == 0);
  REQUIRE(::pipe(g) == 0);
  pid_t holder = ::fork();
  if (holder == 0) {
    ::close(p[0]);
    ::close(g[0]);
    auto t = LivenessToken::take(f.path, 5);
    pid_t grandchild = ::fork();
    if (grandchild == 0) {
      // The fork handler has closed the inherited descriptor by now (it runs inside fork());
      // destroying the inherited token must not release the parent's either.
      t.reset();
      if (::write(g[1], "g", 1) != 1) ::_exit(2);
      for (;;) ::pause();
    }
    if (::write(p[1], &grandchild, sizeof(grandchild)) != sizeof(grandchild)) ::_exit(2);
    for (;;) ::pause();
  }
  ::close(p[1]);
  ::close(g[1]);
  pid_t grandchild = 0;
  REQUIRE(::read(p[0], &grandchild, sizeof(grandchild)) == sizeof(grandchild));
  ::close(p[0]);
  // Between fork() and its child handler the grandchild briefly shares the descriptor (a
  // probe then says alive, the safe answer); wait until it is past that.
  char c = 0;
  REQUIRE(::read(g[0], &c, 1) == 1);
  ::close(g[0]);
  CHECK(probe_token(f.probe_fd, 5) == Liveness::kAlive);
  ::kill(holder, SIGKILL);
  vsa_test::wait_child(holder);
  // The grandchild still runs, yet the role is free: it never held the token.
  CHECK(::kill(grandchild, 0) == 0);
  CHECK(probe_token(f.probe_fd, 5) == Liveness::kDead);
  ::kill(grandchild, SIGKILL);  // orphaned: reaped by init, not by us
}

TEST_CASE("a holder whose main thread called pthread_exit is alive", "[liveness]") {
  TokenFileFixture f;
  int p[2];
  REQUIRE(::pipe(p) == 0);
  pid_t pid = ::fork();
  if (pid == 0) {
    static std::unique_ptr<LivenessToken> t;
    t = LivenessToken::take(f.path, 9);
    static int ready_fd = p[1];
    pthread_t th;
    pthread_create(
        &th, nullptr,
        [](void*) -> void* {
          ::usleep(50 * 1000);  // let the main thread exit first
          if (::write(ready_fd, "t", 1) != 1) ::_exit(2);
          for (;;) ::pause();
          return nullptr;
        },
        nullptr);
    // What pthread_exit does to the leader, without unwinding through the test framework's
    // handlers: the main thread ends (state Z), the process lives on in the other thread.
    ::syscall(SYS_exit, 0);
  }
  ::close(p[1]);
  REQUIRE(wait_ready(p[0]));
  ::close(p[0]);
  CHECK(probe_token(f.probe_fd, 9) == Liveness::kAlive);
  ::kill(pid, SIGKILL);
  vsa_test::wait_child(pid);
  CHECK(probe_token(f.probe_fd, 9) == Liveness::kDead);
}

TEST_CASE("a prober out of file descriptors still gets an answer", "[liveness][faults]") {
  TokenFileFixture f;
  auto held = LivenessToken::take(f.path, 2);
  pid_t pid = ::fork();
  if (pid == 0) {
    struct rlimit rl;
    ::getrlimit(RLIMIT_NOFILE, &rl);
    rl.rlim_cur = 64;
    ::setrlimit(RLIMIT_NOFILE, &rl);
    while (::dup(0) >= 0) {
    }
    if (errno != EMFILE) ::_exit(3);
    // Probing opens nothing: the verdicts are the real ones.
    if (probe_token(f.probe_fd, 2) != Liveness::kAlive) ::_exit(4);
    if (probe_token(f.probe_fd, 3) != Liveness::kDead) ::_exit(5);
    // Taking a token needs a descriptor: refused with a clear error, not a false success.
    try {
      LivenessToken::take(f.path, 3);
      ::_exit(6);
    } catch (const ShmError&) {
    }
    ::_exit(0);
  }
  CHECK(vsa_test::exited_ok(vsa_test::wait_child(pid)));
}

namespace {

// A fork requested from inside a token's take or close, run by another thread. Plain globals:
// the seam is a plain function pointer.
struct ForkWindow {
  std::mutex mu;
  std::condition_variable cv;
  enum State { kIdle, kRequested, kForkWaits, kForked, kDone, kQuit } state = kIdle;
  int fd = -1;        // the token descriptor at the seam
  pthread_t taker{};  // the thread whose seams request forks
  std::atomic<bool> armed{false};
  int leaks = 0;  // children that still had the token's descriptor
  int rounds = 0;
  int forks_waited = 0;  // rounds where fork() waited for the take or close to finish
};
ForkWindow g_window;

void fork_window_seam(TokenSeam where, int fd) {
  ForkWindow& w = g_window;
  if (!w.armed.load()) return;
  if (where == TokenSeam::kForkWaits) {
    // The forker thread, inside fork(): the registry is busy with a take or a close.
    std::lock_guard<std::mutex> lock(w.mu);
    if (w.state == ForkWindow::kRequested) {
      w.state = ForkWindow::kForkWaits;
      ++w.forks_waited;
      w.cv.notify_all();
    }
    return;
  }
  if (!pthread_equal(pthread_self(), w.taker)) return;
  // The taker, between the steps of a take or a close: have the other thread fork now and
  // wait until that fork has happened or is held off until this step is over.
  std::unique_lock<std::mutex> lock(w.mu);
  w.fd = fd;
  w.state = ForkWindow::kRequested;
  w.cv.notify_all();
  w.cv.wait(lock, [&] {
    return w.state == ForkWindow::kForked || w.state == ForkWindow::kForkWaits ||
           w.state == ForkWindow::kDone;
  });
}

void forker_loop(dev_t dev, ino_t ino) {
  ForkWindow& w = g_window;
  for (;;) {
    int fd;
    {
      std::unique_lock<std::mutex> lock(w.mu);
      w.cv.wait(lock,
                [&] { return w.state == ForkWindow::kRequested || w.state == ForkWindow::kQuit; });
      if (w.state == ForkWindow::kQuit) return;
      fd = w.fd;
    }
    pid_t pid = ::fork();
    if (pid == 0) {
      // Does this child still have the token's descriptor? Then it keeps the role alive.
      struct stat st;
      bool leaked = ::fstat(fd, &st) == 0 && st.st_dev == dev && st.st_ino == ino;
      ::_exit(leaked ? 1 : 0);
    }
    {
      std::lock_guard<std::mutex> lock(w.mu);
      if (w.state == ForkWindow::kRequested) w.state = ForkWindow::kForked;
      w.cv.notify_all();
    }
    int status = vsa_test::wait_child(pid);
    std::lock_guard<std::mutex> lock(w.mu);
    ++w.rounds;
    if (!vsa_test::exited_ok(status)) ++w.leaks;
    w.state = ForkWindow::kDone;
    w.cv.notify_all();
  }
}

struct SeamGuard {
  SeamGuard() { set_token_seam_for_testing(&fork_window_seam); }
  ~SeamGuard() {
    g_window.armed = false;
    set_token_seam_for_testing(nullptr);
  }
};

}  // namespace

TEST_CASE("a fork from another thread never inherits a token being taken or dropped",
          "[liveness][fork][threads]") {
  const uint32_t seed = vsa_test::seed("liveness_fork_window");
  std::mt19937 rng(seed);
  TokenFileFixture f;
  struct stat st;
  REQUIRE(::fstat(f.probe_fd, &st) == 0);
  ForkWindow& w = g_window;
  w.state = ForkWindow::kIdle;
  w.leaks = w.rounds = w.forks_waited = 0;
  w.taker = pthread_self();
  SeamGuard guard;
  std::thread forker(forker_loop, st.st_dev, st.st_ino);
  // Tokens on bytes 0..7, taken and dropped in a seeded order; every take and every drop
  // runs one fork from the other thread at its seam.
  std::vector<std::unique_ptr<LivenessToken>> held(8);
  const int kSteps = 64;
  for (int i = 0; i < kSteps; ++i) {
    size_t b = rng() % held.size();
    w.armed = true;
    if (held[b]) {
      held[b].reset();
    } else {
      held[b] = LivenessToken::take(f.path, b);
    }
    w.armed = false;
    std::unique_lock<std::mutex> lock(w.mu);
    w.cv.wait(lock, [&] { return w.state == ForkWindow::kDone; });
    w.state = ForkWindow::kIdle;
  }
  {
    std::lock_guard<std::mutex> lock(w.mu);
    w.state = ForkWindow::kQuit;
    w.cv.notify_all();
  }
  forker.join();
  INFO("seed " << seed << ": " << w.rounds << " forks, " << w.forks_waited
               << " held off by the registry");
  CHECK(w.rounds == kSteps);
  CHECK(w.leaks == 0);
  CHECK(w.forks_waited == kSteps);  // each fork really was requested inside a take or close
  // And from the outside: every role dropped reads dead, every role held alive.
  for (size_t b = 0; b < held.size(); ++b) {
    CHECK(probe_token(f.probe_fd, b) == (held[b] ? Liveness::kAlive : Liveness::kDead));
  }
}
