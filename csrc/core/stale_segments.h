// Finding and removing segments whose writer is provably gone (iceoryx2's
// remove_stale_resources, for this project's arenas and rings).
//
// Names are unlinked once every reader attached, so a healthy queue leaves nothing behind; a
// writer that crashes (or _exits) before that leaves its arena and ring files in the shm
// directory. A segment is removed only when all of these hold: its name has the project's
// prefix, it is a regular file of this user, it carries an arena's or a ring's magic number and
// the layout version of this build (the one with liveness tokens), and its writer's token is
// free. Anything else — no magic, another version, a file that cannot be opened or read — is
// "unknown" and kept. The remover takes the writer's token itself before unlinking, so a
// process taking the segment over at that moment is never robbed of its name.
//
// A queue's socket directory (`<prefix>sock_<hex>`, core/socket_dir.h) carries its own token
// and is judged on it alone: it is removed only when its name is exactly `<prefix>sock_` and
// 32 lowercase hex digits, it is a directory (never a symlink followed) of this user holding
// nothing but `token` (a regular file of this user) and optionally `s` (a socket of this
// user), and the token's writer byte is free. The cleaner takes that token before unlinking,
// and works through descriptors opened with O_NOFOLLOW. Any other `<prefix>sock_*` entry is
// kept and reported unknown, with the reason.
#pragma once

#include <string>
#include <vector>

#include "core/liveness.h"

namespace vllm_shm_arena {

/// What the cleaner found for one name.
struct SegmentReport {
  std::string name;
  /// "arena", "ring", "socket" (a name of a queue's socket directory), or "" (unrecognised)
  std::string kind;
  /// kDead: stale (removed unless dry run); kAlive: its writer lives; kUnknown: kept.
  Liveness writer = Liveness::kUnknown;
  bool removed = false;
  std::string why;  ///< for kUnknown: what was not as expected
};

/// Inspects one segment of `dir` (never maps it: reads its first bytes with pread).
SegmentReport inspect_segment(const std::string& dir, const std::string& name);

/// Inspects every name in `dir` that starts with `prefix` and removes the stale ones (none
/// with `dry_run`): segments whose writer's token is free, and socket directories whose
/// creator's token is free (see above). Throws ShmError if `dir` cannot be listed.
std::vector<SegmentReport> remove_stale_segments(const std::string& dir, bool dry_run,
                                                 const std::string& prefix = "vsa_");

}  // namespace vllm_shm_arena
