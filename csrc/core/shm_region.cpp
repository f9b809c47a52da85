#include "core/shm_region.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>

#include "core/errors.h"
#include "core/settings.h"

namespace vllm_shm_arena {

namespace {

std::string human_bytes(uint64_t b) {
  char buf[64];
  const double gib = 1024.0 * 1024.0 * 1024.0;
  if (b >= (1ull << 30)) {
    std::snprintf(buf, sizeof(buf), "%.2f GiB", b / gib);
  } else {
    std::snprintf(buf, sizeof(buf), "%.1f MiB", b / (1024.0 * 1024.0));
  }
  return buf;
}

// A name is a single path component: no '/', no "..", not empty, reasonably short.
void check_name(const std::string& name) {
  if (name.empty() || name.size() > 200 || name.find('/') != std::string::npos || name == "." ||
      name == "..") {
    throw InvalidArgument("shared-memory name '" + name +
                          "' is not a valid segment name (one path component, no '/')");
  }
}

std::atomic<RandomNameSource> g_random_name_source{nullptr};

std::string random_hex128() {
  unsigned char raw[16];
  size_t got = 0;
  while (got < sizeof(raw)) {
    ssize_t n = ::getrandom(raw + got, sizeof(raw) - got, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw ShmError(errno_message("getrandom", errno));
    }
    got += static_cast<size_t>(n);
  }
  static const char* kHex = "0123456789abcdef";
  std::string out;
  for (unsigned char c : raw) {
    out.push_back(kHex[c >> 4]);
    out.push_back(kHex[c & 15]);
  }
  return out;
}

}  // namespace

std::string random_name_hex() {
  RandomNameSource source = g_random_name_source.load(std::memory_order_acquire);
  return source != nullptr ? source() : random_hex128();
}

void set_random_name_source_for_testing(RandomNameSource source) {
  g_random_name_source.store(source, std::memory_order_release);
}

std::string ShmRegion::default_dir() { return settings::shm_dir(); }

uint64_t ShmRegion::free_bytes(const std::string& dir) {
  struct statvfs st;
  if (::statvfs(dir.c_str(), &st) != 0) {
    throw ShmError(errno_message("statvfs(" + dir + ")", errno) +
                   "; is the shared-memory directory mounted?");
  }
  return static_cast<uint64_t>(st.f_bavail) * static_cast<uint64_t>(st.f_frsize);
}

void ShmRegion::check_free_space(const std::string& dir, uint64_t bytes) {
  uint64_t free = free_bytes(dir);
  if (free < bytes) {
    throw ShmError("not enough shared memory in " + dir +
                   ": the segment (arena or message ring) needs " + human_bytes(bytes) +
                   " but only " + human_bytes(free) +
                   " is free. Enlarge it (Docker: --shm-size=" + std::to_string((bytes >> 30) + 2) +
                   "g; Kubernetes: an emptyDir with medium: Memory mounted at /dev/shm; "
                   "bare metal: mount -o remount,size=<N>G " +
                   dir + ") or use fewer/smaller slots.");
  }
}

ShmRegion::ShmRegion(std::string name, std::string dir, int fd, uint8_t* base, uint64_t size)
    : name_(std::move(name)), dir_(std::move(dir)), fd_(fd), base_(base), size_(size) {}

namespace {

// Fresh names tried before giving up: with 128 random bits a taken name means somebody is
// creating names in the directory, not bad luck.
constexpr int kNameAttempts = 16;

ShmError no_free_name(const std::string& dir, const std::string& what) {
  return ShmError("no free name for " + what + " in " + dir + " after " +
                  std::to_string(kNameAttempts) +
                  " fresh random names: each already existed (another process is creating "
                  "names there)");
}

// Gives the file at `tmp_path` the name `<prefix><fresh random hex>` in `dir`, never replacing
// an existing name: a taken name is skipped for a fresh one. Returns the new name.
std::string publish_name(const std::string& dir, const std::string& tmp_path,
                         const std::string& prefix) {
  for (int attempt = 0; attempt < kNameAttempts; ++attempt) {
    std::string final_name = prefix + random_name_hex();
    std::string final_path = dir + "/" + final_name;
    if (::renameat2(AT_FDCWD, tmp_path.c_str(), AT_FDCWD, final_path.c_str(), RENAME_NOREPLACE) ==
        0) {
      return final_name;
    }
    int err = errno;
    if (err == EINVAL) {
      // A filesystem without renameat2 flags: link() refuses to replace as well.
      if (::link(tmp_path.c_str(), final_path.c_str()) == 0) {
        ::unlink(tmp_path.c_str());
        return final_name;
      }
      err = errno;
    }
    if (err != EEXIST) throw ShmError(errno_message("naming shared memory " + final_path, err));
  }
  throw no_free_name(dir, "a shared-memory segment");
}

}  // namespace

std::shared_ptr<ShmRegion> ShmRegion::create(uint64_t bytes, const std::string& prefix,
                                             const std::string& dir,
                                             const std::function<void(ShmRegion&)>& init) {
  if (bytes == 0) throw InvalidArgument("shared-memory size must be > 0, got 0");
  check_name(prefix + "x");
  check_free_space(dir, bytes);
  // The temporary and the final name draw their random bits independently: a user watching
  // the directory learns nothing about the final name from the temporary one.
  std::string tmp_name, path;
  int fd = -1;
  for (int attempt = 0; attempt < kNameAttempts && fd < 0; ++attempt) {
    tmp_name = prefix + "tmp_" + random_name_hex();
    path = dir + "/" + tmp_name;
    fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (fd < 0 && errno != EEXIST) {
      throw ShmError(errno_message("creating shared memory " + path, errno));
    }
  }
  if (fd < 0) throw no_free_name(dir, "a temporary shared-memory file");
  // From here every failure removes the temporary name, which O_EXCL made ours.
  if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    int err = errno;
    ::close(fd);
    ::unlink(path.c_str());
    throw ShmError(errno_message("sizing shared memory " + path, err));
  }
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    int err = errno;
    ::close(fd);
    ::unlink(path.c_str());
    throw ShmError(errno_message("mapping shared memory " + path, err));
  }
  std::shared_ptr<ShmRegion> region(
      new ShmRegion(tmp_name, dir, fd, static_cast<uint8_t*>(p), bytes));
  try {
    if (init) init(*region);
    region->name_ = publish_name(dir, path, prefix);
  } catch (...) {
    region->unlink();  // still the temporary name: publish_name renames last or not at all
    throw;
  }
  return region;
}

std::shared_ptr<ShmRegion> ShmRegion::attach(const std::string& name, const std::string& dir,
                                             uint64_t min_bytes) {
  check_name(name);
  std::string path = dir + "/" + name;
  int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) {
    int err = errno;
    throw ShmError(errno_message("attaching shared memory '" + name + "' (" + path + ")", err) +
                   (err == ENOENT ? "; the writer is gone or already unlinked it" : ""));
  }
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    int err = errno;
    ::close(fd);
    throw ShmError(errno_message("fstat " + path, err));
  }
  if (st.st_uid != ::geteuid()) {
    ::close(fd);
    throw InvalidArgument("shared memory '" + name + "' (" + path + ") belongs to uid " +
                          std::to_string(st.st_uid) + ", not to this process's uid " +
                          std::to_string(::geteuid()) + "; refusing to trust it");
  }
  uint64_t bytes = static_cast<uint64_t>(st.st_size);
  if (bytes == 0 || bytes < min_bytes) {
    ::close(fd);
    throw InvalidArgument("shared memory '" + name + "' is " + std::to_string(bytes) +
                          " bytes, smaller than the " + std::to_string(min_bytes) +
                          " bytes its header needs: not an arena, or truncated");
  }
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    int err = errno;
    ::close(fd);
    throw ShmError(errno_message("mapping shared memory " + path, err));
  }
  return std::shared_ptr<ShmRegion>(new ShmRegion(name, dir, fd, static_cast<uint8_t*>(p), bytes));
}

ShmRegion::~ShmRegion() {
  if (base_ != nullptr) ::munmap(base_, size_);
  if (fd_ >= 0) ::close(fd_);
}

void ShmRegion::unlink() {
  if (unlinked_) return;
  unlinked_ = true;
  std::string path = dir_ + "/" + name_;
  ::unlink(path.c_str());  // ENOENT is fine: someone else already removed the name.
}

bool ShmRegion::reserve(uint64_t offset, uint64_t len) {
  if (len == 0) return true;
  if (offset > size_ || len > size_ - offset) {
    throw OutOfRange("reserve range [" + std::to_string(offset) + ", +" + std::to_string(len) +
                     ") is outside the " + std::to_string(size_) + "-byte region");
  }
  int rc;
  do {
    rc = ::fallocate(fd_, 0, static_cast<off_t>(offset), static_cast<off_t>(len));
  } while (rc != 0 && errno == EINTR);
  if (rc == 0) return true;
  if (errno == ENOSPC || errno == EFBIG || errno == ENOMEM) return false;
  if (errno == EOPNOTSUPP) {
    // A filesystem without fallocate: fall back to a free-space estimate, which can race
    // with other users but still turns the common case into a decline instead of SIGBUS.
    return free_bytes(dir_) >= len;
  }
  throw ShmError(errno_message("fallocate on shared memory " + name_, errno));
}

}  // namespace vllm_shm_arena
