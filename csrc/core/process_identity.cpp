#include "core/process_identity.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "core/errors.h"

namespace vllm_shm_arena {

std::string errno_message(const std::string& what, int err) {
  return what + ": " + std::strerror(err) + " (errno " + std::to_string(err) + ")";
}

namespace {

// Reads state and start time of `pid` from /proc/<pid>/stat. Returns false if the process
// does not exist. The comm field may contain spaces and parentheses, so parse after the last
// ')'.
bool read_stat(pid_t pid, char* state, unsigned long long* start_time) {
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%d/stat", static_cast<int>(pid));
  int fd = ::open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  char buf[1024];
  ssize_t n = ::read(fd, buf, sizeof(buf) - 1);
  ::close(fd);
  if (n <= 0) return false;
  buf[n] = '\0';
  const char* p = std::strrchr(buf, ')');
  if (p == nullptr) return false;
  // After ") " come: state(3) ppid(4) ... starttime(22). Field 3 is the first after ')'.
  ++p;
  while (*p == ' ') ++p;
  *state = *p;
  int field = 3;
  while (*p != '\0' && field < 22) {
    if (*p == ' ') {
      ++field;
      while (*(p + 1) == ' ') ++p;
    }
    ++p;
  }
  if (field != 22) return false;
  *start_time = std::strtoull(p, nullptr, 10);
  return true;
}

uint64_t pack(pid_t pid, unsigned long long start_time) {
  // +1 keeps a process that started at tick 0 distinguishable from "nobody".
  return (static_cast<uint64_t>(static_cast<uint32_t>(start_time + 1)) << 32) |
         static_cast<uint32_t>(pid);
}

}  // namespace

ProcessIdentity ProcessIdentity::of(pid_t pid) {
  char state = 0;
  unsigned long long start = 0;
  if (!read_stat(pid, &state, &start)) return ProcessIdentity();
  return ProcessIdentity(pack(pid, start));
}

ProcessIdentity ProcessIdentity::self() {
  static thread_local pid_t cached_pid = 0;
  static thread_local uint64_t cached = 0;
  pid_t pid = ::getpid();
  if (pid != cached_pid) {
    cached = ProcessIdentity::of(pid).packed();
    cached_pid = pid;
  }
  return ProcessIdentity(cached);
}

bool ProcessIdentity::is_alive() const {
  if (empty()) return false;
  if (::kill(pid(), 0) != 0 && errno == ESRCH) return false;
  char state = 0;
  unsigned long long start = 0;
  if (!read_stat(pid(), &state, &start)) return false;
  if (state == 'Z' || state == 'X' || state == 'x') return false;
  return pack(pid(), start) == packed_;
}

}  // namespace vllm_shm_arena
