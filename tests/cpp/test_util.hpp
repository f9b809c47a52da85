// Helpers shared by the core's Catch2 tests: seeds, forked children with timeouts, tmpfs.
#pragma once

#include <sched.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>

namespace vsa_test {

/// The test's random seed: $VSA_SEED if set, else fresh. Always printed so a failure replays.
inline uint32_t seed(const char* test_name) {
  const char* env = std::getenv("VSA_SEED");
  uint32_t s = env != nullptr ? static_cast<uint32_t>(std::strtoul(env, nullptr, 10))
                              : std::random_device{}();
  std::printf("[%s] seed=%u (replay with VSA_SEED=%u)\n", test_name, s, s);
  std::fflush(stdout);
  return s;
}

/// Waits for `pid` up to `timeout_s`; kills it if it overstays. Returns the wait status, or
/// -1 on timeout.
inline int wait_child(pid_t pid, double timeout_s = 30.0) {
  auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  int status = 0;
  while (std::chrono::steady_clock::now() < deadline) {
    pid_t r = ::waitpid(pid, &status, WNOHANG);
    if (r == pid) return status;
    if (r < 0) return -2;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  ::kill(pid, SIGKILL);
  ::waitpid(pid, &status, 0);
  return -1;
}

/// SIGKILLs `pid`, then reaps it (`reap`) or waits until it is a zombie without reaping it
/// (the caller reaps it later with wait_child). False if that wait failed.
inline bool kill_child(pid_t pid, bool reap) {
  ::kill(pid, SIGKILL);
  if (reap) return wait_child(pid) != -1;
  siginfo_t info;
  std::memset(&info, 0, sizeof(info));
  return ::waitid(P_PID, pid, &info, WEXITED | WNOWAIT) == 0;
}

/// True if a child's wait status says it exited with code 0.
inline bool exited_ok(int status) {
  return status >= 0 && WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

/// A private directory, optionally a tmpfs of `size_bytes` (needs root; `mounted` says
/// whether that worked). Removed on destruction.
class TempDir {
 public:
  explicit TempDir(uint64_t tmpfs_bytes = 0) {
    char tmpl[] = "/tmp/vsa_test_XXXXXX";
    char* p = ::mkdtemp(tmpl);
    if (p != nullptr) path_ = p;
    if (tmpfs_bytes > 0 && !path_.empty()) {
      std::string opts = "size=" + std::to_string(tmpfs_bytes) + ",mode=0700";
      mounted_ = ::mount("tmpfs", path_.c_str(), "tmpfs", 0, opts.c_str()) == 0;
    }
  }
  ~TempDir() {
    if (path_.empty()) return;
    if (mounted_) ::umount2(path_.c_str(), MNT_DETACH);
    std::string cmd = "rm -rf '" + path_ + "'";
    if (std::system(cmd.c_str()) != 0) {
    }
  }
  const std::string& path() const { return path_; }
  bool mounted() const { return mounted_; }

 private:
  std::string path_;
  bool mounted_ = false;
};

/// Enters new namespaces (`flags`: CLONE_NEWPID, CLONE_NEWNS...) as root, or, failing that,
/// inside a new user namespace mapping this user to root (what `unshare --user
/// --map-root-user` does). Call in a forked child only. False if neither is allowed.
inline bool enter_namespaces(int flags) {
  if (::unshare(flags) == 0) return true;
  const uid_t uid = ::geteuid();
  const gid_t gid = ::getegid();
  if (::unshare(flags | CLONE_NEWUSER) != 0) return false;
  auto put = [](const char* path, const std::string& text) {
    FILE* f = std::fopen(path, "w");
    if (f == nullptr) return false;
    bool ok = std::fputs(text.c_str(), f) >= 0;
    return std::fclose(f) == 0 && ok;
  };
  put("/proc/self/setgroups", "deny");
  return put("/proc/self/uid_map", "0 " + std::to_string(uid) + " 1") &&
         put("/proc/self/gid_map", "0 " + std::to_string(gid) + " 1");
}

/// Sets (or, with nullptr, unsets) an environment variable for a scope; restores it after.
/// Not for tests that run threads while it changes (setenv is not thread-safe).
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    const char* old = std::getenv(name);
    had_ = old != nullptr;
    if (had_) old_ = old;
    set(value);
  }
  ~ScopedEnv() { set(had_ ? old_.c_str() : nullptr); }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;
  /// Changes the value again (nullptr: unset).
  void set(const char* value) {
    if (value != nullptr) {
      ::setenv(name_.c_str(), value, 1);
    } else {
      ::unsetenv(name_.c_str());
    }
  }

 private:
  std::string name_;
  bool had_ = false;
  std::string old_;
};

/// A cheap, position-dependent fill so any misplaced or stale byte shows up.
inline void fill_pattern(uint8_t* p, size_t n, uint64_t tag) {
  uint64_t x = tag * 0x9E3779B97F4A7C15ull + 1;
  for (size_t i = 0; i < n; ++i) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    p[i] = static_cast<uint8_t>(x);
  }
}

/// FNV-1a over a buffer.
inline uint64_t checksum(const uint8_t* p, size_t n) {
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

}  // namespace vsa_test
