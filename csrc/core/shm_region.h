// A POSIX shared-memory segment: created by one process, attached by name by others.
//
// On Linux shm_open(3) is open(2) on a file under /dev/shm, so the region opens files in a
// directory that defaults to /dev/shm and can be pointed elsewhere (VLLM_SHM_ARENA_SHM_DIR, or
// the `dir` argument) — tests use that to run against a small tmpfs.
//
// Pages stay lazy: creation only sizes the file (ftruncate), nothing is touched. Before a
// writer first fills a range it calls reserve(), which fallocate()s the pages: on a full
// tmpfs that fails with ENOSPC and the caller declines, where a plain store into a sparse
// page would have raised SIGBUS.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

namespace vllm_shm_arena {

/// 32 lowercase hex digits of fresh randomness (128 bits from getrandom(2)): the random part of
/// every name the core creates in the shm directory. Throws ShmError if getrandom fails.
std::string random_name_hex();

/// A replacement for random_name_hex()'s randomness, for tests that must know the next names.
using RandomNameSource = std::string (*)();
/// Test seam: while `source` is set, random_name_hex() returns its result (null, the default,
/// restores getrandom). Never set outside tests.
void set_random_name_source_for_testing(RandomNameSource source);

/// One mapped shared-memory segment. Unmapped (and its fd closed) on destruction; the name is
/// removed only by unlink(), after which existing mappings stay valid.
class ShmRegion {
 public:
  /// The directory shared-memory names live in: $VLLM_SHM_ARENA_SHM_DIR or /dev/shm
  /// (settings::shm_dir(), which says how the value is checked).
  static std::string default_dir();

  /// Throws ShmError unless `dir` has at least `bytes` free, saying how much is needed, how
  /// much is free, and how to make room.
  static void check_free_space(const std::string& dir, uint64_t bytes);

  /// Bytes free in `dir` for an unprivileged writer (statvfs f_bavail).
  static uint64_t free_bytes(const std::string& dir);

  /// Creates a new segment named `<prefix><32 random hex digits>` (128 bits), mode 0600,
  /// sized to `bytes`, and maps it read-write. It is created (O_CREAT|O_EXCL|O_NOFOLLOW) under
  /// a temporary name `<prefix>tmp_<other random hex>`, `init` runs on it (take the writer's
  /// liveness token, reserve and write the tables), and only then is it renamed to its final
  /// name: nobody can find a segment whose writer has not yet taken its token. The two names
  /// share no bits, and the rename never replaces (RENAME_NOREPLACE, or link()): a name
  /// somebody else made first is skipped for a fresh one, 16 times at most, then ShmError.
  /// If anything fails after the temporary file exists, it is removed.
  static std::shared_ptr<ShmRegion> create(
      uint64_t bytes, const std::string& prefix = "vsa_", const std::string& dir = default_dir(),
      const std::function<void(ShmRegion&)>& init = std::function<void(ShmRegion&)>());

  /// Maps an existing segment by name. Throws ShmError if it does not exist or can't be
  /// mapped, InvalidArgument if the name is malformed, the segment is smaller than
  /// `min_bytes`, or it belongs to another user (every process that maps a segment can
  /// corrupt it, so only our own user's segments are trusted that far).
  static std::shared_ptr<ShmRegion> attach(const std::string& name,
                                           const std::string& dir = default_dir(),
                                           uint64_t min_bytes = 0);

  ~ShmRegion();
  ShmRegion(const ShmRegion&) = delete;
  ShmRegion& operator=(const ShmRegion&) = delete;

  /// Removes the name from the directory; idempotent. Mappings stay valid.
  void unlink();

  /// Allocates the backing pages of [offset, offset+len) with fallocate(2). Returns false if
  /// the filesystem has no room (ENOSPC); throws ShmError on any other failure.
  bool reserve(uint64_t offset, uint64_t len);

  uint8_t* data() const { return base_; }
  uint64_t size() const { return size_; }
  const std::string& name() const { return name_; }
  const std::string& dir() const { return dir_; }
  /// dir/name: where liveness tokens open the file.
  std::string path() const { return dir_ + "/" + name_; }
  /// The mapping's descriptor. It never holds a liveness token, so it is the one to probe
  /// tokens through.
  int fd() const { return fd_; }
  bool unlinked() const { return unlinked_; }

 private:
  ShmRegion(std::string name, std::string dir, int fd, uint8_t* base, uint64_t size);

  std::string name_;
  std::string dir_;
  int fd_ = -1;
  uint8_t* base_ = nullptr;
  uint64_t size_ = 0;
  bool unlinked_ = false;
};

}  // namespace vllm_shm_arena
