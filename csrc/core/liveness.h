// Which processes hold a role in a shared-memory segment: the one liveness primitive of the
// core, used by the arena, the ring, the queue's writer-death check and the stale-name cleaner.
//
// A role (the writer, reader rank r) is held by an open-file-description lock (F_OFD_SETLK,
// a write lock on one byte of the segment's own file) on a dedicated file description:
//
//   byte 0       the writer              (kWriterTokenByte)
//   byte 1 + r   reader rank r           (reader_token_byte(r))
//
// Why this token and not a pid or /proc: the kernel drops the lock exactly when the last file
// descriptor of that description closes, i.e. when the holding process exits (before it is
// even reaped: a zombie holds no files). It needs no /proc, means the same thing in every pid
// namespace that shares the file, survives the main thread calling pthread_exit, and is taken
// per description, not per process, so ranks run as threads of one process are told apart.
// Pitfalls this avoids: classic F_SETLK locks belong to the process (any close() of the file
// drops them, and they are invisible to the same process); flock() is shared with forked
// children; a robust mutex belongs to a thread.
//
// Fork: the token's descriptor is O_CLOEXEC (an exec'd child never holds it) and a
// pthread_atfork child handler closes every token descriptor in the child, so a forked child
// never keeps its parent's role alive after the parent dies. A token is opened, locked and
// registered for that handler, and later unregistered and closed, under the mutex the fork's
// prepare handler takes, so a fork from another thread never lands between those steps:
//
//   take:     [ lock registry │ open │ OFD lock │ register │ unlock ]
//   release:  [ lock registry │ unregister │ close │ unlock ]
//   fork():   prepare waits for the registry ─▶ child closes every registered descriptor
//
// Probing asks the kernel (F_OFD_GETLK) through a descriptor of the same file that holds no
// lock on the probed byte: it opens nothing, so it works even when the prober has run out of
// file descriptors. Three answers: alive (the byte is locked), dead (no lock: positive evidence
// the holder is gone), unknown (the kernel did not answer). Only "dead" lets anyone reclaim or
// clean up; "unknown" is treated as alive.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>

#include "core/errors.h"

namespace vllm_shm_arena {

/// A probe's verdict. Only kDead permits reclaiming what the role held.
enum class Liveness : uint32_t { kAlive = 0, kDead = 1, kUnknown = 2 };

/// "alive", "dead" or "unknown".
const char* liveness_name(Liveness v);

/// Token byte of the writer role.
constexpr uint64_t kWriterTokenByte = 0;
/// Token byte of reader rank `rank`.
constexpr uint64_t reader_token_byte(uint32_t rank) { return 1 + uint64_t{rank}; }

/// The role is held by another open file description (a live process, or another object of
/// this process).
class TokenHeld : public InvalidArgument {
 public:
  using InvalidArgument::InvalidArgument;
};

/// A held role: an OFD write lock on one byte of a file, on a descriptor of its own.
class LivenessToken {
 public:
  /// Opens `path` anew and locks `byte`. `same_file_fd` (optional, >= 0) is a descriptor the
  /// caller already has of the file: the token checks it names the same inode, so a name
  /// replaced in between can never hand out a token on another file. Throws TokenHeld if
  /// another description holds the byte, ShmError if the token cannot be taken (no file
  /// descriptors left, no OFD lock support): a process that cannot prove it is alive must not
  /// take a role.
  static std::unique_ptr<LivenessToken> take(const std::string& path, uint64_t byte,
                                             int same_file_fd = -1);
  /// Releases the role, in the process that took it only (a forked child's inherited copy
  /// was already closed by the fork handler and is left alone).
  ~LivenessToken();
  LivenessToken(const LivenessToken&) = delete;
  LivenessToken& operator=(const LivenessToken&) = delete;

  uint64_t byte() const { return byte_; }
  /// The process that took the token.
  pid_t owner_pid() const { return owner_pid_; }

 private:
  LivenessToken(int fd, uint64_t byte);
  int fd_;
  uint64_t byte_;
  pid_t owner_pid_;
};

/// Points in a token's life where the test seam is called.
enum class TokenSeam : uint32_t {
  kOpened = 0,     ///< take(): the token's descriptor is open, not yet locked
  kClosing = 1,    ///< ~LivenessToken(): the descriptor is about to be closed
  kForkWaits = 2,  ///< fork()'s prepare handler waits for a token being taken or closed
};
/// A test's callback at a TokenSeam point, with the token's descriptor (-1 for kForkWaits).
using TokenSeamHook = void (*)(TokenSeam where, int fd);
/// Test seam: while `hook` is set it is called at every TokenSeam point (null, the default,
/// calls nothing). Never set outside tests.
void set_token_seam_for_testing(TokenSeamHook hook);

/// Whether the role at `byte` is held, asked through `fd` (a descriptor of the token file
/// that holds no lock on `byte`). Never opens a file, never blocks.
Liveness probe_token(int fd, uint64_t byte);

/// Where a segment's tokens live: its file (each token opens it anew) and a descriptor of it
/// that holds no token, to probe through.
struct TokenFile {
  std::string path;
  int probe_fd = -1;
};

/// Counts of verdicts other than alive, for stats(): every one is reported.
struct LivenessCounts {
  uint64_t dead = 0;     ///< probes that found a role's holder gone
  uint64_t unknown = 0;  ///< probes the kernel did not answer (the holder counted as alive)
};

}  // namespace vllm_shm_arena
