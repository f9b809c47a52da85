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

// Removes `dir`/`name`, a directory of sockets, and what is directly in it; never follows a
// link. True on success.
bool remove_socket_dir(const std::string& dir, const std::string& name, std::string* why) {
  int dfd = ::open((dir + "/" + name).c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (dfd < 0) {
    *why = errno_message("open", errno);
    return false;
  }
  struct stat st;
  if (::fstat(dfd, &st) != 0 || st.st_uid != ::geteuid()) {
    ::close(dfd);
    *why = "not a directory of this user";
    return false;
  }
  DIR* d = ::fdopendir(dfd);
  if (d == nullptr) {
    ::close(dfd);
    *why = errno_message("fdopendir", errno);
    return false;
  }
  while (struct dirent* e = ::readdir(d)) {
    if (std::strcmp(e->d_name, ".") == 0 || std::strcmp(e->d_name, "..") == 0) continue;
    ::unlinkat(::dirfd(d), e->d_name, 0);
  }
  ::closedir(d);
  if (::rmdir((dir + "/" + name).c_str()) != 0) {
    *why = errno_message("rmdir", errno);
    return false;
  }
  return true;
}

}  // namespace

std::vector<SegmentReport> remove_stale_segments(const std::string& dir, bool dry_run,
                                                 const std::string& prefix) {
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) throw ShmError(errno_message("listing " + dir, errno));
  std::vector<std::string> names, socket_dirs;
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
  // A queue's local socket directory, vsa_sock_<hex>, belongs to its ring vsa_ring_<hex>: it
  // goes when that ring is stale, or when the ring's name is gone (the directory outlived its
  // writer, which removes both once its readers joined).
  for (const std::string& name : socket_dirs) {
    const std::string ring = prefix + "ring_" + name.substr(sock_prefix.size());
    SegmentReport r;
    r.name = name;
    r.kind = "socket";
    bool ring_listed = false;
    for (const SegmentReport& o : out) {
      if (o.name != ring) continue;
      ring_listed = true;
      r.writer = o.writer;
      if (o.writer == Liveness::kDead && !dry_run && !o.removed) r.writer = Liveness::kUnknown;
    }
    if (!ring_listed) r.writer = Liveness::kDead;  // no ring of that name: nobody owns it
    if (r.writer == Liveness::kUnknown) r.why = "its ring's writer is not provably dead";
    if (r.writer == Liveness::kDead && !dry_run) r.removed = remove_socket_dir(dir, name, &r.why);
    out.push_back(std::move(r));
  }
  return out;
}

}  // namespace vllm_shm_arena
