#include "core/stale_segments.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>

#include "core/arena_layout.h"
#include "core/errors.h"
#include "core/ring.h"
#include "core/socket_dir.h"

namespace vllm_shm_arena {

namespace {

SegmentReport unknown(SegmentReport r, std::string why) {
  r.writer = Liveness::kUnknown;
  r.why = std::move(why);
  return r;
}

}  // namespace

SegmentReport inspect_segment(const std::string& dir, const std::string& name) {
  SegmentReport r;
  r.name = name;
  if (name.empty() || name.find('/') != std::string::npos || name == "." || name == "..") {
    return unknown(r, "not a segment name");
  }
  const std::string path = dir + "/" + name;
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
  if (fd < 0) return unknown(r, errno_message("open", errno));
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    int err = errno;
    ::close(fd);
    return unknown(r, errno_message("fstat", err));
  }
  if (!S_ISREG(st.st_mode) || st.st_uid != ::geteuid()) {
    ::close(fd);
    return unknown(r, "not a regular file of this user");
  }
  unsigned char head[12] = {};
  ssize_t n = ::pread(fd, head, sizeof(head), 0);
  if (n != static_cast<ssize_t>(sizeof(head))) {
    ::close(fd);
    return unknown(r, "shorter than a header");
  }
  uint64_t magic = 0;
  uint32_t version = 0;
  std::memcpy(&magic, head, sizeof(magic));
  std::memcpy(&version, head + 8, sizeof(version));
  uint32_t want_version = 0;
  if (magic == kArenaMagic) {
    r.kind = "arena";
    want_version = kArenaLayoutVersion;
  } else if (magic == kRingMagic) {
    r.kind = "ring";
    want_version = kRingLayoutVersion;
  } else {
    ::close(fd);
    return unknown(r, "no arena or ring magic number");
  }
  if (version != want_version) {
    ::close(fd);
    return unknown(r, "layout version " + std::to_string(version) + ", this build reads " +
                          std::to_string(want_version));
  }
  r.writer = probe_token(fd, kWriterTokenByte);
  ::close(fd);
  if (r.writer == Liveness::kUnknown) r.why = "the kernel did not answer the liveness probe";
  return r;
}

namespace {

// A descriptor closed on scope exit.
struct Fd {
  int fd;
  explicit Fd(int f) : fd(f) {}
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
};

bool same_inode(const struct stat& a, const struct stat& b) {
  return a.st_dev == b.st_dev && a.st_ino == b.st_ino;
}

// Inspects `name` of the shm directory open as `parent_fd` as a SocketDir
// (core/socket_dir.h) and, unless `dry_run`, removes it when it is provably one whose
// creator is gone. Every step works relative to descriptors opened with O_NOFOLLOW, so a
// rename or a symlink swapped in between can never point it at anything else.
SegmentReport clean_socket_dir(const std::string& dir, int parent_fd, const std::string& name,
                               const std::string& prefix, bool dry_run) {
  SegmentReport r;
  r.name = name;
  if (!is_socket_dir_name(name, prefix)) {
    return unknown(r, "not a socket directory name (" + prefix + "sock_ and 32 lowercase hex)");
  }
  r.kind = "socket";
  struct stat st;
  if (::fstatat(parent_fd, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) {
    return unknown(r, errno_message("lstat", errno));
  }
  if (!S_ISDIR(st.st_mode)) return unknown(r, "not a directory (symlinks are not followed)");
  if (st.st_uid != ::geteuid()) return unknown(r, "a directory of another user");
  Fd dfd(::openat(parent_fd, name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  if (dfd.fd < 0) return unknown(r, errno_message("open", errno));
  struct stat dst;
  if (::fstat(dfd.fd, &dst) != 0) return unknown(r, errno_message("fstat", errno));
  if (!same_inode(st, dst) || !S_ISDIR(dst.st_mode) || dst.st_uid != ::geteuid()) {
    return unknown(r, "replaced while being inspected");
  }
  // Nothing but the token and the socket: anything else is somebody's, and stays.
  bool has_token = false, has_socket = false;
  {
    int lfd = ::dup(dfd.fd);
    DIR* d = lfd < 0 ? nullptr : ::fdopendir(lfd);
    if (d == nullptr) {
      int err = errno;
      if (lfd >= 0) ::close(lfd);
      return unknown(r, errno_message("listing", err));
    }
    std::string other;
    while (struct dirent* e = ::readdir(d)) {
      if (std::strcmp(e->d_name, ".") == 0 || std::strcmp(e->d_name, "..") == 0) continue;
      if (std::strcmp(e->d_name, kSocketDirTokenFile) == 0) {
        has_token = true;
      } else if (std::strcmp(e->d_name, kSocketDirSocketFile) == 0) {
        has_socket = true;
      } else if (other.empty()) {
        other = e->d_name;
      }
    }
    ::closedir(d);
    if (!other.empty()) return unknown(r, "holds '" + other + "', not only token and s");
  }
  if (!has_token) return unknown(r, "no token file (being created, or not a SocketDir)");
  if (has_socket) {
    struct stat sst;
    if (::fstatat(dfd.fd, kSocketDirSocketFile, &sst, AT_SYMLINK_NOFOLLOW) != 0) {
      return unknown(r, errno_message("lstat s", errno));
    }
    if (!S_ISSOCK(sst.st_mode) || sst.st_uid != ::geteuid()) {
      return unknown(r, "s is not a socket of this user");
    }
  }
  Fd tfd(::openat(dfd.fd, kSocketDirTokenFile,
                  O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY | O_CLOEXEC));
  if (tfd.fd < 0) return unknown(r, errno_message("open token", errno));
  struct stat tst;
  if (::fstat(tfd.fd, &tst) != 0) return unknown(r, errno_message("fstat token", errno));
  if (!S_ISREG(tst.st_mode) || tst.st_uid != ::geteuid()) {
    return unknown(r, "token is not a regular file of this user");
  }
  r.writer = probe_token(tfd.fd, kWriterTokenByte);
  if (r.writer == Liveness::kUnknown) r.why = "the kernel did not answer the liveness probe";
  if (r.writer != Liveness::kDead || dry_run) return r;
  // Hold the creator's role while removing, as for segments: the token is the same file
  // (same_file_fd), so a directory renamed in between cannot lend us another one's token.
  try {
    const std::string token_path = dir + "/" + name + "/" + kSocketDirTokenFile;
    auto token = LivenessToken::take(token_path, kWriterTokenByte, tfd.fd);
    if (has_socket) ::unlinkat(dfd.fd, kSocketDirSocketFile, 0);
    ::unlinkat(dfd.fd, kSocketDirTokenFile, 0);
    struct stat now;
    if (::fstatat(parent_fd, name.c_str(), &now, AT_SYMLINK_NOFOLLOW) != 0 ||
        !same_inode(now, dst)) {
      r.why = "renamed while being removed";
    } else if (::unlinkat(parent_fd, name.c_str(), AT_REMOVEDIR) == 0) {
      r.removed = true;
    } else {
      r.why = errno_message("rmdir", errno);
    }
  } catch (const TokenHeld&) {
    r.writer = Liveness::kAlive;
  } catch (const ShmError& e) {
    r.writer = Liveness::kUnknown;
    r.why = e.what();
  }
  return r;
}

}  // namespace

std::vector<SegmentReport> remove_stale_segments(const std::string& dir, bool dry_run,
                                                 const std::string& prefix) {
  Fd parent(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (parent.fd < 0) throw ShmError(errno_message("listing " + dir, errno));
  std::vector<std::string> names, socket_dirs;
  {
    int lfd = ::dup(parent.fd);
    DIR* d = lfd < 0 ? nullptr : ::fdopendir(lfd);
    if (d == nullptr) {
      int err = errno;
      if (lfd >= 0) ::close(lfd);
      throw ShmError(errno_message("listing " + dir, err));
    }
    const std::string sock_prefix = prefix + "sock_";
    while (struct dirent* e = ::readdir(d)) {
      std::string name = e->d_name;
      if (name.compare(0, sock_prefix.size(), sock_prefix) == 0) {
        socket_dirs.push_back(name);
      } else if (name.compare(0, prefix.size(), prefix) == 0) {
        names.push_back(name);
      }
    }
    ::closedir(d);
  }
  std::vector<SegmentReport> out;
  for (const std::string& name : names) {
    SegmentReport r = inspect_segment(dir, name);
    if (r.writer == Liveness::kDead && !dry_run) {
      // Hold the writer's role while removing the name: a process that takes the segment over
      // right now either got the token first (we keep the name) or never finds the name.
      try {
        auto token = LivenessToken::take(dir + "/" + name, kWriterTokenByte);
        r.removed = ::unlink((dir + "/" + name).c_str()) == 0;
        if (!r.removed) r.why = errno_message("unlink", errno);
      } catch (const TokenHeld&) {
        r.writer = Liveness::kAlive;  // taken over in the meantime
      } catch (const ShmError& e) {
        r.writer = Liveness::kUnknown;
        r.why = e.what();
      }
    }
    out.push_back(std::move(r));
  }
  // Socket directories stand on their own token (core/socket_dir.h), whatever rings exist.
  for (const std::string& name : socket_dirs) {
    out.push_back(clean_socket_dir(dir, parent.fd, name, prefix, dry_run));
  }
  return out;
}

}  // namespace vllm_shm_arena
