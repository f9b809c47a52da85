#include "core/liveness.h"

#include <fcntl.h>
#include <pthread.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <vector>

namespace vllm_shm_arena {

namespace {

// Every token descriptor of this process, so a forked child can close them all. The child
// handler runs in a single-threaded child right after fork: it only calls close() and resets
// the lock, both async-signal-safe.
class TokenFds {
 public:
  static TokenFds& instance() {
    static TokenFds* fds = [] {
      auto* p = new TokenFds();  // never destroyed: tokens may die during static destruction
      pthread_atfork([] { pthread_mutex_lock(&instance().mu_); },
                     [] { pthread_mutex_unlock(&instance().mu_); },
                     [] { instance().close_all_in_child(); });
      return p;
    }();
    return *fds;
  }

  void add(int fd) {
    pthread_mutex_lock(&mu_);
    fds_.push_back(fd);
    pthread_mutex_unlock(&mu_);
  }

  void remove(int fd) {
    pthread_mutex_lock(&mu_);
    auto it = std::find(fds_.begin(), fds_.end(), fd);
    if (it != fds_.end()) fds_.erase(it);
    pthread_mutex_unlock(&mu_);
  }

 private:
  TokenFds() { fds_.reserve(16); }

  void close_all_in_child() {
    for (int fd : fds_) ::close(fd);
    fds_.clear();
    pthread_mutex_init(&mu_, nullptr);
  }

  pthread_mutex_t mu_ = PTHREAD_MUTEX_INITIALIZER;
  std::vector<int> fds_;
};

struct flock byte_lock(short type, uint64_t byte) {
  struct flock fl = {};
  fl.l_type = type;
  fl.l_whence = SEEK_SET;
  fl.l_start = static_cast<off_t>(byte);
  fl.l_len = 1;
  fl.l_pid = 0;  // F_OFD_* require 0
  return fl;
}

}  // namespace

const char* liveness_name(Liveness v) {
  switch (v) {
    case Liveness::kAlive:
      return "alive";
    case Liveness::kDead:
      return "dead";
    case Liveness::kUnknown:
      return "unknown";
  }
  return "unknown";
}

LivenessToken::LivenessToken(int fd, uint64_t byte)
    : fd_(fd), byte_(byte), owner_pid_(::getpid()) {}

std::unique_ptr<LivenessToken> LivenessToken::take(const std::string& path, uint64_t byte,
                                                   int same_file_fd) {
  TokenFds& registry = TokenFds::instance();
  int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) {
    int err = errno;
    throw ShmError(errno_message("cannot take the liveness token of " + path +
                                     " (a process that cannot prove it is alive must not "
                                     "take a role): open",
                                 err));
  }
  if (same_file_fd >= 0) {
    struct stat a, b;
    if (::fstat(fd, &a) != 0 || ::fstat(same_file_fd, &b) != 0 || a.st_dev != b.st_dev ||
        a.st_ino != b.st_ino) {
      ::close(fd);
      throw ShmError("the liveness token of " + path +
                     " names another file than the mapped segment (the name was replaced)");
    }
  }
  struct flock fl = byte_lock(F_WRLCK, byte);
  if (::fcntl(fd, F_OFD_SETLK, &fl) != 0) {
    int err = errno;
    ::close(fd);
    if (err == EAGAIN || err == EACCES) {
      throw TokenHeld("role byte " + std::to_string(byte) + " of " + path +
                      " is held by a live process (or another object of this one)");
    }
    throw ShmError(
        errno_message("cannot take the liveness token of " + path + ": fcntl(F_OFD_SETLK)", err) +
        "; open-file-description locks need Linux 3.15 or later");
  }
  registry.add(fd);
  return std::unique_ptr<LivenessToken>(new LivenessToken(fd, byte));
}

LivenessToken::~LivenessToken() {
  // In a forked child the fork handler already closed the descriptor, and its number may
  // belong to something else now.
  if (::getpid() != owner_pid_) return;
  TokenFds::instance().remove(fd_);
  ::close(fd_);  // the last descriptor of the description: the kernel drops the lock
}

Liveness probe_token(int fd, uint64_t byte) {
  struct flock fl = byte_lock(F_WRLCK, byte);
  if (::fcntl(fd, F_OFD_GETLK, &fl) != 0) return Liveness::kUnknown;
  if (fl.l_type == F_UNLCK) return Liveness::kDead;
  return Liveness::kAlive;
}

}  // namespace vllm_shm_arena
