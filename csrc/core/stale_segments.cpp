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

std::vector<SegmentReport> remove_stale_segments(const std::string& dir, bool dry_run,
                                                 const std::string& prefix) {
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) throw ShmError(errno_message("listing " + dir, errno));
  std::vector<std::string> names;
  while (struct dirent* e = ::readdir(d)) {
    std::string name = e->d_name;
    if (name.compare(0, prefix.size(), prefix) == 0) names.push_back(name);
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
  return out;
}

}  // namespace vllm_shm_arena
