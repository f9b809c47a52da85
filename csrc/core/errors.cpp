#include "core/errors.h"

#include <cstring>

namespace vllm_shm_arena {

std::string errno_message(const std::string& what, int err) {
  return what + ": " + std::strerror(err) + " (errno " + std::to_string(err) + ")";
}

}  // namespace vllm_shm_arena
