// A private directory in the shared-memory directory for a queue's local ZeroMQ socket, whose
// name is never free while its creator lives and which the stale-name cleaner can prove
// abandoned.
//
// The shm directory (/dev/shm) is world-writable: any user may create any name in it. So the
// directory's name is fresh randomness that reveals nothing another name made public (a name
// derived from the ring's would let another user create it first), mkdir(2) refuses to reuse
// an existing entry (a fresh name is drawn instead), and the result is checked to be a real
// directory of this user with mode 0700 before anything is put in it:
//
//   <shm_dir>/                          world-writable, sticky
//     <prefix>sock_<32 random hex>/     mode 0700, this user's; the name stays taken until
//                                       remove(), so nobody can put their own directory there
//       token                           0600; byte 0 carries the creator's writer liveness
//                                       token (core/liveness.h) while the SocketDir lives
//       s                               the socket (bound by the queue); unlink_socket()
//                                       removes it once every local reader has connected
//
// Life of a SocketDir:
//
//   create   mkdir(0700)  ─EEXIST─▶ fresh name (bounded)
//            verify: a directory, this user's, 0700 (fstat of an O_NOFOLLOW descriptor)
//            token.new (O_EXCL) ─▶ lock byte 0 ─▶ rename to token
//   use      bind <dir>/s ... readers connect ... unlink_socket(): nobody else can connect;
//            the directory and token stay, so the name is never free
//   remove   unlink s, unlink token, rmdir, release the token (creating process only; a
//            forked child's copy does nothing)
//   crash    the kernel drops the lock when the creator exits: the token reads dead and the
//            cleaner (stale_segments.h) removes the directory
//
// The token file appears under its final name only once it is locked, so a cleaner can never
// find a free `token` in the directory of a creator that is still setting it up (it finds an
// empty directory, or one holding `token.new`, and keeps both). The cleaner removes a
// `<prefix>sock_*` entry only when the name has exactly this form, it is a directory of this
// user holding nothing but `token` (a regular file of this user) and optionally `s` (a
// socket), and the token is free.
#pragma once

#include <sys/types.h>

#include <memory>
#include <string>

#include "core/liveness.h"

namespace vllm_shm_arena {

/// Name of the token file inside a socket directory.
constexpr const char* kSocketDirTokenFile = "token";
/// Name of the socket inside a socket directory.
constexpr const char* kSocketDirSocketFile = "s";

/// True if `name` is exactly `<prefix>sock_` followed by 32 lowercase hex digits.
bool is_socket_dir_name(const std::string& name, const std::string& prefix = "vsa_");

/// A queue's socket directory: created fresh, held (liveness token) while this object lives,
/// removed by remove() or the destructor in the process that created it.
class SocketDir {
 public:
  /// Creates `<shm_dir>/<prefix>sock_<32 random hex>` (mode 0700) with its token taken.
  /// Throws InvalidArgument for a bad prefix or a socket path too long for a unix socket,
  /// ShmError if the directory cannot be made or verified (16 names in a row already taken,
  /// an unusable shm directory, no liveness token).
  static std::unique_ptr<SocketDir> create(const std::string& shm_dir,
                                           const std::string& prefix = "vsa_");
  /// remove(), in the creating process only; errors are swallowed here.
  ~SocketDir();
  SocketDir(const SocketDir&) = delete;
  SocketDir& operator=(const SocketDir&) = delete;

  /// The directory: `<shm_dir>/<prefix>sock_<hex>`.
  const std::string& path() const { return path_; }
  /// The directory's name inside the shm directory.
  const std::string& name() const { return name_; }
  /// Where the socket is bound: `<path()>/s`.
  std::string socket_path() const { return path_ + "/" + kSocketDirSocketFile; }
  /// Removes the socket `s` only (idempotent): nobody can connect any more, while the
  /// directory and its token keep the name taken. Throws ShmError if unlinking fails for a
  /// reason other than the socket being gone. A no-op after remove() or in a forked child.
  void unlink_socket();
  /// Unlinks `s` and `token`, removes the directory and releases the token (idempotent).
  /// Throws ShmError if the directory could not be removed (something else was put in it);
  /// the token is released either way. A no-op in a forked child.
  void remove();
  /// True once remove() ran.
  bool removed() const { return removed_; }
  /// The process that created the directory.
  pid_t owner_pid() const { return owner_pid_; }

 private:
  SocketDir(std::string name, std::string path, int parent_fd, int dir_fd,
            std::unique_ptr<LivenessToken> token);
  bool foreign() const;

  std::string name_;
  std::string path_;
  int parent_fd_;  // the shm directory
  int dir_fd_;     // this directory, opened O_NOFOLLOW and verified
  std::unique_ptr<LivenessToken> token_;
  pid_t owner_pid_;
  bool removed_ = false;
};

}  // namespace vllm_shm_arena
