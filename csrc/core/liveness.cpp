#include "core/liveness.h"

#include <fcntl.h>
#include <pthread.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <vector>

namespace vllm_shm_arena {

namespace {

std::atomic<TokenSeamHook> g_seam{nullptr};

void seam(TokenSeam where, int fd) {
  TokenSeamHook hook = g_seam.load(std::memory_order_acquire);
  if (hook != nullptr) hook(where, fd);
}

// Every token descriptor of this process, so a forked child can close them all. A token's
// descriptor is opened, locked and registered, and later unregistered and closed, with the
// registry's mutex held, the one fork()'s prepare handler takes: a fork from another thread
// happens before the descriptor exists, after it is registered (the child closes it), or
// after it is closed, never in between. Closing outside the mutex would also let a fork's
// child close a descriptor number another thread had just been given again.
// The child handler runs in a single-threaded child right after fork: it only calls close()
// and resets the lock, both async-signal-safe.
class TokenFds {
 public:
  static TokenFds& instance() {
    static TokenFds* fds = [] {
      auto* p = new TokenFds();  // never destroyed: tokens may die during static destruction
      pthread_atfork([] { instance().lock_for_fork(); }, [] { instance().unlock(); },
                     [] { instance().close_all_in_child(); });
      return p;
    }();
    return *fds;
  }

  void lock() { pthread_mutex_lock(&mu_); }
  void unlock() { pthread_mutex_unlock(&mu_); }

  void lock_for_fork() {
    if (pthread_mutex_trylock(&mu_) == 0) return;
    seam(TokenSeam::kForkWaits, -1);  // a take or a close is under way: fork() waits for it
    pthread_mutex_lock(&mu_);
  }

  /// With the mutex held.
  void add_locked(int fd) { fds_.push_back(fd); }

  /// With the mutex held.
  void remove_locked(int fd) {
    auto it = std::find(fds_.begin(), fds_.end(), fd);
    if (it != fds_.end()) fds_.erase(it);
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

// Holds the registry's mutex for a scope.
class RegistryLock {
 public:
  explicit RegistryLock(TokenFds& registry) : registry_(registry) { registry_.lock(); }
  ~RegistryLock() { registry_.unlock(); }
  RegistryLock(const RegistryLock&) = delete;
  RegistryLock& operator=(const RegistryLock&) = delete;

 private:
  TokenFds& registry_;
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
  // Allocated first: once the descriptor is registered nothing may fail before the token owns
  // it. Until then the object holds no descriptor and its destructor does nothing.
  std::unique_ptr<LivenessToken> token(new LivenessToken(-1, byte));
  RegistryLock lock(registry);  // released before `token` is destroyed on an error
  int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) {
    int err = errno;
    throw ShmError(errno_message("cannot take the liveness token of " + path +
                                     " (a process that cannot prove it is alive must not "
                                     "take a role): open",
                                 err));
  }
  seam(TokenSeam::kOpened, fd);
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
  try {
    registry.add_locked(fd);
  } catch (...) {
    ::close(fd);  // out of memory: the role is not taken
    throw;
  }
  token->fd_ = fd;
  return token;
}

LivenessToken::~LivenessToken() {
  // In a forked child the fork handler already closed the descriptor, and its number may
  // belong to something else now.
  if (fd_ < 0 || ::getpid() != owner_pid_) return;
  TokenFds& registry = TokenFds::instance();
  RegistryLock lock(registry);
  registry.remove_locked(fd_);
  seam(TokenSeam::kClosing, fd_);
  ::close(fd_);  // the last descriptor of the description: the kernel drops the lock
}

void set_token_seam_for_testing(TokenSeamHook hook) {
  g_seam.store(hook, std::memory_order_release);
}

Liveness probe_token(int fd, uint64_t byte) {
  struct flock fl = byte_lock(F_WRLCK, byte);
  if (::fcntl(fd, F_OFD_GETLK, &fl) != 0) return Liveness::kUnknown;
  if (fl.l_type == F_UNLCK) return Liveness::kDead;
  return Liveness::kAlive;
}

}  // namespace vllm_shm_arena
