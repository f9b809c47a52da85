// The environment variables the core reads, each with its meaning, default and check, in one
// place: nothing else in csrc calls getenv.
//
//   variable                 meaning                                       unset or empty
//   VLLM_SHM_ARENA_SHM_DIR   the directory shared-memory names live in     /dev/shm
//   VLLM_SHM_ARENA_CUDART    a CUDA runtime library to load instead of     look for the one the
//                            the one the process has loaded (tests point   process has loaded
//                            it at a fake runtime)                         (cuda_shim.h)
//
// Each accessor reads its variable at every call, never a cached copy: a process may change
// one between calls (tests do, and Python's os.environ writes through to the C environment).
// Unset and empty mean the same thing, the default. Any other value is used as given, except
// one that can never name a path (PATH_MAX bytes or longer), which is refused with
// InvalidArgument naming the variable, where it would otherwise fail later, in an open or a
// dlopen, with an error that does not say where the path came from.
#pragma once

#include <optional>
#include <string>

namespace vllm_shm_arena::settings {

/// The shm directory's variable.
inline constexpr char kShmDirVar[] = "VLLM_SHM_ARENA_SHM_DIR";
/// The CUDA runtime override's variable.
inline constexpr char kCudartVar[] = "VLLM_SHM_ARENA_CUDART";
/// Where shared-memory names live when kShmDirVar is unset or empty.
inline constexpr char kDefaultShmDir[] = "/dev/shm";

/// $VLLM_SHM_ARENA_SHM_DIR, or /dev/shm when it is unset or empty. Throws InvalidArgument
/// (naming the variable) when the value is too long to be a path.
std::string shm_dir();

/// $VLLM_SHM_ARENA_CUDART: the runtime library to load (a path, or a file name dlopen
/// searches for), or nullopt when it is unset or empty. Throws InvalidArgument (naming the
/// variable) when the value is too long to be a path.
std::optional<std::string> cudart_path();

}  // namespace vllm_shm_arena::settings
