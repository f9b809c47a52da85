// Tests of the environment settings (settings.cpp) and of the two readers of them.
#include "core/settings.h"

#include <climits>
#include <string>

#include "../fake_cudart/fake_cudart_control.hpp"
#include "catch_compat.hpp"
#include "core/cuda_shim.h"
#include "core/errors.h"
#include "core/shm_region.h"
#include "test_util.hpp"

using namespace vllm_shm_arena;
using vllm_shm_arena::testing::FakeCudart;
using vsa_test::ScopedEnv;

namespace {

// A value no path can be: PATH_MAX bytes before the terminator.
std::string too_long() { return "/" + std::string(PATH_MAX - 1, 'd'); }

// The message of the InvalidArgument `f` throws ("" if it throws none).
template <typename F>
std::string refusal(F f) {
  try {
    f();
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("shm_dir: the variable's value, /dev/shm when unset or empty", "[settings]") {
  ScopedEnv env(settings::kShmDirVar, nullptr);
  CHECK(settings::shm_dir() == "/dev/shm");
  CHECK(ShmRegion::default_dir() == "/dev/shm");
  env.set("");
  CHECK(settings::shm_dir() == "/dev/shm");
  env.set("/tmp/some dir");
  CHECK(settings::shm_dir() == "/tmp/some dir");
  CHECK(ShmRegion::default_dir() == "/tmp/some dir");
  env.set("relative/dir");  // used as given, as before (resolved from the working directory)
  CHECK(settings::shm_dir() == "relative/dir");
  std::string longest = "/" + std::string(PATH_MAX - 2, 'd');  // PATH_MAX - 1 bytes: a path
  env.set(longest.c_str());
  CHECK(settings::shm_dir() == longest);
}

TEST_CASE("shm_dir refuses a value no path can be, naming the variable", "[settings]") {
  const std::string value = too_long();
  ScopedEnv env(settings::kShmDirVar, value.c_str());
  std::string why = refusal([] { settings::shm_dir(); });
  CHECK(why.find("VLLM_SHM_ARENA_SHM_DIR") != std::string::npos);
  CHECK(why.find(std::to_string(value.size()) + " bytes") != std::string::npos);
  CHECK(refusal([] { ShmRegion::default_dir(); }) == why);
}

TEST_CASE("cudart_path: the variable's value, nullopt when unset or empty", "[settings]") {
  ScopedEnv env(settings::kCudartVar, nullptr);
  CHECK_FALSE(settings::cudart_path().has_value());
  env.set("");
  CHECK_FALSE(settings::cudart_path().has_value());
  env.set("libcudart.so.12");  // a bare name: dlopen searches for it
  REQUIRE(settings::cudart_path().has_value());
  CHECK(*settings::cudart_path() == "libcudart.so.12");
  env.set(FakeCudart::path());
  CHECK(settings::cudart_path() == std::optional<std::string>(FakeCudart::path()));
}

TEST_CASE("a refused VLLM_SHM_ARENA_CUDART reads as no runtime, and says why", "[settings]") {
  const std::string value = too_long();
  ScopedEnv env(settings::kCudartVar, value.c_str());
  CHECK(refusal([] { settings::cudart_path(); }).find("VLLM_SHM_ARENA_CUDART") !=
        std::string::npos);
  FakeCudart::get().reset();
  CHECK(CudaRuntime::find() == nullptr);  // never throws: the reader stays unpinned
  CHECK(CudaRuntime::last_error().find("VLLM_SHM_ARENA_CUDART") != std::string::npos);
  CHECK(FakeCudart::get().calls() == 0);
  env.set(FakeCudart::path());
  CHECK(CudaRuntime::find() != nullptr);
}
