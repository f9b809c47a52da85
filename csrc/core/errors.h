// Error kinds of the torch-free core. The bindings map each to a Python exception type:
//   InvalidArgument -> ValueError, OutOfRange -> IndexError, ShmError -> OSError/RuntimeError.
// The core never calls exit() or abort() on a recoverable condition.
#pragma once

#include <stdexcept>
#include <string>

namespace vllm_shm_arena {

/// A caller passed a bad value (wrong size, stale generation, foreign segment...).
class InvalidArgument : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

/// A caller passed an index outside the valid range (slot, reader rank...).
class OutOfRange : public std::out_of_range {
 public:
  using std::out_of_range::out_of_range;
};

/// The environment refused something (shm_open, mmap, /dev/shm too small...); the message
/// says what is wrong and how to fix it.
class ShmError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// "<what>: <strerror(err)> (errno N)".
std::string errno_message(const std::string& what, int err);

}  // namespace vllm_shm_arena
