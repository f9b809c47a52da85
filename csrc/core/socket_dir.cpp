#include "core/socket_dir.h"

#include <fcntl.h>
#include <stdio.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>

#include "core/errors.h"
#include "core/shm_region.h"

namespace vllm_shm_arena {

namespace {

// Fresh names tried before giving up: a collision with 128 random bits means somebody is
// creating names in the directory, not bad luck.
constexpr int kNameAttempts = 16;
constexpr const char* kStagedToken = "token.new";

// A descriptor closed on scope exit unless released.
class Fd {
 public:
  explicit Fd(int fd = -1) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }
  int release() {
    int fd = fd_;
    fd_ = -1;
    return fd;
  }

 private:
  int fd_;
};

bool same_inode(const struct stat& a, const struct stat& b) {
  return a.st_dev == b.st_dev && a.st_ino == b.st_ino;
}

// Removes the entry `name` of `parent_fd` only if it still is the directory open as `dir_fd`
// (a directory renamed away and replaced is left alone). Returns 0 or an errno value.
int remove_dir_entry(int parent_fd, const std::string& name, int dir_fd) {
  struct stat mine, there;
  if (::fstat(dir_fd, &mine) != 0) return errno;
  if (::fstatat(parent_fd, name.c_str(), &there, AT_SYMLINK_NOFOLLOW) != 0) return errno;
  if (!same_inode(mine, there)) return ENOENT;  // our directory is no longer under that name
  if (::unlinkat(parent_fd, name.c_str(), AT_REMOVEDIR) != 0) return errno;
  return 0;
}

// Renames `from` to `to` inside `dir_fd` without replacing anything already named `to`.
int rename_noreplace(int dir_fd, const char* from, const char* to) {
  if (::renameat2(dir_fd, from, dir_fd, to, RENAME_NOREPLACE) == 0) return 0;
  if (errno != EINVAL) return errno;
  // A filesystem without renameat2 flags: link() refuses to replace as well.
  if (::linkat(dir_fd, from, dir_fd, to, 0) != 0) return errno;
  ::unlinkat(dir_fd, from, 0);
  return 0;
}

}  // namespace

bool is_socket_dir_name(const std::string& name, const std::string& prefix) {
  const std::string head = prefix + "sock_";
  if (name.size() != head.size() + 32 || name.compare(0, head.size(), head) != 0) return false;
  for (size_t i = head.size(); i < name.size(); ++i) {
    const char c = name[i];
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

SocketDir::SocketDir(std::string name, std::string path, int parent_fd, int dir_fd,
                     std::unique_ptr<LivenessToken> token)
    : name_(std::move(name)),
      path_(std::move(path)),
      parent_fd_(parent_fd),
      dir_fd_(dir_fd),
      token_(std::move(token)),
      owner_pid_(::getpid()) {}

std::unique_ptr<SocketDir> SocketDir::create(const std::string& shm_dir,
                                             const std::string& prefix) {
  if (prefix.find('/') != std::string::npos || prefix == "." || prefix == "..") {
    throw InvalidArgument("socket directory prefix '" + prefix + "' must not contain '/'");
  }
  if (shm_dir.empty()) throw InvalidArgument("shm_dir must not be empty");
  // <shm_dir>/<prefix>sock_<32 hex>/s must fit a unix socket address with its NUL.
  const size_t socket_len = shm_dir.size() + 1 + prefix.size() + 5 + 32 + 2;
  if (socket_len >= sizeof(sockaddr_un{}.sun_path)) {
    throw InvalidArgument("shm_dir '" + shm_dir + "' is too long for a unix socket path (" +
                          std::to_string(socket_len) + " bytes with the socket's name, at most " +
                          std::to_string(sizeof(sockaddr_un{}.sun_path) - 1) + ")");
  }
  Fd parent(::open(shm_dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (parent.get() < 0) {
    throw ShmError(errno_message("opening the shm directory " + shm_dir, errno) +
                   "; is it mounted and a directory?");
  }
  std::string name;
  bool made = false;
  for (int attempt = 0; attempt < kNameAttempts && !made; ++attempt) {
    name = prefix + "sock_" + random_name_hex();
    if (::mkdirat(parent.get(), name.c_str(), 0700) == 0) {
      made = true;
    } else if (errno != EEXIST) {
      throw ShmError(errno_message("creating the socket directory " + shm_dir + "/" + name, errno));
    }
  }
  if (!made) {
    throw ShmError("no free socket directory name in " + shm_dir + " after " +
                   std::to_string(kNameAttempts) +
                   " fresh random names: each already existed (another process is creating "
                   "names there)");
  }
  const std::string path = shm_dir + "/" + name;
  Fd dir(::openat(parent.get(), name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  if (dir.get() < 0) {
    // Not our directory any more (renamed or replaced by this user): leave whatever is there.
    throw ShmError(errno_message("opening the socket directory " + path, errno));
  }
  std::unique_ptr<LivenessToken> token;
  bool staged_made = false;
  try {
    struct stat st;
    if (::fstat(dir.get(), &st) != 0) throw ShmError(errno_message("fstat " + path, errno));
    if (!S_ISDIR(st.st_mode) || st.st_uid != ::geteuid()) {
      throw ShmError("socket directory " + path + " is not a directory of uid " +
                     std::to_string(::geteuid()) + " after mkdir (replaced?)");
    }
    // mkdir's mode passes through the umask, which can only take bits away; put back what
    // the owner needs on the directory we just made (verified ours above).
    if ((st.st_mode & 07777) != 0700 &&
        (::fchmod(dir.get(), 0700) != 0 || ::fstat(dir.get(), &st) != 0 ||
         (st.st_mode & 07777) != 0700)) {
      throw ShmError("socket directory " + path + " does not have mode 0700");
    }
    // The token is locked under a staging name and only then renamed to `token`: a cleaner
    // that finds `token` finds it held.
    Fd staged(::openat(dir.get(), kStagedToken, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC,
                       0600));
    if (staged.get() < 0) {
      throw ShmError(errno_message("creating " + path + "/" + kStagedToken, errno));
    }
    staged_made = true;
    token = LivenessToken::take(path + "/" + kStagedToken, kWriterTokenByte, staged.get());
    int err = rename_noreplace(dir.get(), kStagedToken, kSocketDirTokenFile);
    if (err != 0) {
      throw ShmError(errno_message("naming the token of the socket directory " + path, err));
    }
  } catch (...) {
    // Only what this call made goes; `token` is never ours here (the rename is the last step).
    if (staged_made) ::unlinkat(dir.get(), kStagedToken, 0);
    remove_dir_entry(parent.get(), name, dir.get());
    token.reset();
    throw;
  }
  int parent_fd = parent.release();
  int dir_fd = dir.release();
  return std::unique_ptr<SocketDir>(new SocketDir(name, path, parent_fd, dir_fd, std::move(token)));
}

bool SocketDir::foreign() const { return ::getpid() != owner_pid_; }

void SocketDir::unlink_socket() {
  if (removed_ || foreign()) return;
  if (::unlinkat(dir_fd_, kSocketDirSocketFile, 0) != 0 && errno != ENOENT) {
    throw ShmError(errno_message("unlinking the socket " + socket_path(), errno));
  }
}

void SocketDir::remove() {
  if (removed_ || foreign()) return;
  removed_ = true;
  ::unlinkat(dir_fd_, kSocketDirSocketFile, 0);  // ENOENT: never bound or already unlinked
  ::unlinkat(dir_fd_, kSocketDirTokenFile, 0);
  // The token is held until the directory is gone: a cleaner never sees it free before.
  int err = remove_dir_entry(parent_fd_, name_, dir_fd_);
  token_.reset();
  if (err != 0 && err != ENOENT) {
    throw ShmError(
        errno_message("removing the socket directory " + path_, err) +
        (err == ENOTEMPTY ? " (something other than the socket and token is in it)" : ""));
  }
}

SocketDir::~SocketDir() {
  try {
    remove();
  } catch (const ShmError&) {
    // Nothing to tell from a destructor; the cleaner keeps such a directory (it is not empty).
  }
  ::close(dir_fd_);
  ::close(parent_fd_);
}

}  // namespace vllm_shm_arena
