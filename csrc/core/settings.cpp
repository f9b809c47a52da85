#include "core/settings.h"

#include <climits>
#include <cstdlib>
#include <cstring>

#include "core/errors.h"

namespace vllm_shm_arena::settings {

namespace {

// The value of `var` if set and non-empty, checked to fit a path (PATH_MAX counts the NUL).
std::optional<std::string> path_value(const char* var) {
  const char* v = std::getenv(var);
  if (v == nullptr || v[0] == '\0') return std::nullopt;
  const size_t len = std::strlen(v);
  if (len >= PATH_MAX) {
    throw InvalidArgument(std::string(var) + " is " + std::to_string(len) +
                          " bytes long, which no path can be (PATH_MAX is " +
                          std::to_string(PATH_MAX) + " bytes with its terminator); set it to a " +
                          "path or unset it");
  }
  return std::string(v, len);
}

}  // namespace

std::string shm_dir() { return path_value(kShmDirVar).value_or(kDefaultShmDir); }

std::optional<std::string> cudart_path() { return path_value(kCudartVar); }

}  // namespace vllm_shm_arena::settings
