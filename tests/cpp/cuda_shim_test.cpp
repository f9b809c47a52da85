#include "core/cuda_shim.h"

#include <dlfcn.h>
#include <link.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>

#include "../fake_cudart/fake_cudart_control.hpp"
#include "catch_compat.hpp"

using vllm_shm_arena::CudaError;
using vllm_shm_arena::CudaRuntime;
using vllm_shm_arena::testing::FakeCudart;

namespace {

int count_cudart(struct dl_phdr_info* info, size_t, void* data) {
  const char* name = info->dlpi_name == nullptr ? "" : info->dlpi_name;
  const char* slash = std::strrchr(name, '/');
  const char* base = slash == nullptr ? name : slash + 1;
  if (std::strncmp(base, "libcudart.so", 12) == 0) ++*static_cast<int*>(data);
  return 0;
}

int loaded_cudarts() {
  int n = 0;
  ::dl_iterate_phdr(count_cudart, &n);
  return n;
}

// Restores VLLM_SHM_ARENA_CUDART when a test that changed it ends.
class EnvGuard {
 public:
  EnvGuard() {
    const char* v = std::getenv(kName);
    had_ = v != nullptr;
    if (had_) old_ = v;
  }
  ~EnvGuard() {
    if (had_) {
      ::setenv(kName, old_.c_str(), 1);
    } else {
      ::unsetenv(kName);
    }
  }
  static constexpr const char* kName = "VLLM_SHM_ARENA_CUDART";

 private:
  bool had_ = false;
  std::string old_;
};

// Runs `body` in a forked child so that what it loads never reaches this process; returns the
// child's exit status (0 = every check passed).
template <typename F>
int in_child(F body) {
  pid_t pid = ::fork();
  if (pid == 0) ::_exit(body());
  int status = 0;
  ::waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

}  // namespace

TEST_CASE("find() returns nullptr when no libcudart is loaded, without calling any runtime",
          "[cuda_shim]") {
  const FakeCudart& fake = FakeCudart::get();
  EnvGuard env;
  ::unsetenv(EnvGuard::kName);
  REQUIRE(loaded_cudarts() == 0);  // the test binary must not link the real runtime
  fake.reset();

  auto sut = CudaRuntime::find();

  CHECK(sut == nullptr);
  CHECK(CudaRuntime::last_error().find("no libcudart.so") != std::string::npos);
  CHECK(CudaRuntime::last_error().find("VLLM_SHM_ARENA_CUDART") != std::string::npos);
  CHECK(fake.calls() == 0);
  CHECK(loaded_cudarts() == 0);  // find() must never load one
}

TEST_CASE("load_from() resolves every entry point of the fake runtime", "[cuda_shim]") {
  const FakeCudart& fake = FakeCudart::get();
  fake.reset();

  auto sut = CudaRuntime::load_from(FakeCudart::path());

  REQUIRE(sut != nullptr);
  CHECK(CudaRuntime::last_error().empty());
  CHECK(sut->path() == FakeCudart::path());
  CHECK(sut->host_register != nullptr);
  CHECK(sut->host_unregister != nullptr);
  CHECK(sut->event_create_with_flags != nullptr);
  CHECK(sut->event_record != nullptr);
  CHECK(sut->event_query != nullptr);
  CHECK(sut->event_destroy != nullptr);
  CHECK(sut->get_error_string != nullptr);
  CHECK(sut->get_last_error != nullptr);
  CHECK(fake.calls() == 0);  // resolving symbols calls nothing

  // The pointers reach the fake: an unregister of unknown memory fails and sets the last error.
  int x = 0;
  CudaError err = sut->host_unregister(&x);
  CHECK(static_cast<int>(err) == 713);
  CHECK(sut->error_string(err).find("(error 713)") != std::string::npos);
  CHECK(sut->describe("cudaHostUnregister", err).rfind("cudaHostUnregister failed: ", 0) == 0);
  CHECK(static_cast<int>(sut->get_last_error()) == 713);
  CHECK(static_cast<int>(sut->get_last_error()) == 0);
}

TEST_CASE("find() honours VLLM_SHM_ARENA_CUDART", "[cuda_shim]") {
  EnvGuard env;

  SECTION("a valid path loads that runtime") {
    ::setenv(EnvGuard::kName, FakeCudart::path(), 1);
    auto sut = CudaRuntime::find();
    REQUIRE(sut != nullptr);
    CHECK(sut->path() == FakeCudart::path());
  }
  SECTION("a bad path gives nullptr and names the variable") {
    ::setenv(EnvGuard::kName, "/nonexistent/libcudart.so.99", 1);
    auto sut = CudaRuntime::find();
    CHECK(sut == nullptr);
    CHECK(CudaRuntime::last_error().find("VLLM_SHM_ARENA_CUDART=/nonexistent/libcudart.so.99") !=
          std::string::npos);
  }
}

TEST_CASE("load_from() reports a missing file or missing symbols instead of crashing",
          "[cuda_shim]") {
  SECTION("missing file") {
    auto sut = CudaRuntime::load_from("/nonexistent/libfoo.so");
    CHECK(sut == nullptr);
    CHECK(CudaRuntime::last_error().find("/nonexistent/libfoo.so") != std::string::npos);
  }
  SECTION("a library that is not a CUDA runtime") {
    auto sut = CudaRuntime::load_from("libm.so.6");
    CHECK(sut == nullptr);
    CHECK(CudaRuntime::last_error().find("missing symbol(s) cudaHostRegister") !=
          std::string::npos);
    CHECK(CudaRuntime::last_error().find("cudaGetLastError") != std::string::npos);
  }
}

TEST_CASE("find() picks up a libcudart.so* the process already loaded", "[cuda_shim]") {
  // A copy of the fake named like the real runtime, loaded in a child so this process stays
  // free of anything called libcudart.
  char dir[] = "/tmp/vsa_cuda_shim_XXXXXX";
  REQUIRE(::mkdtemp(dir) != nullptr);
  const std::string copy = std::string(dir) + "/libcudart.so.99";
  {
    std::ifstream src(FakeCudart::path(), std::ios::binary);
    std::ofstream dst(copy, std::ios::binary);
    dst << src.rdbuf();
  }

  int rc = in_child([&] {
    ::unsetenv(EnvGuard::kName);
    if (CudaRuntime::find() != nullptr) return 1;  // nothing loaded yet
    void* h = ::dlopen(copy.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (h == nullptr) return 2;
    auto sut = CudaRuntime::find();
    if (sut == nullptr) return 3;
    if (sut->path() != copy) return 4;
    // It is the loaded copy (whose counters we read through `h`), not a fresh load.
    auto calls = reinterpret_cast<long long (*)()>(::dlsym(h, "fake_cudart_calls"));
    if (calls == nullptr) return 5;
    const long long before = calls();
    sut->get_last_error();
    if (calls() != before + 1) return 6;
    return 0;
  });

  ::unlink(copy.c_str());
  ::rmdir(dir);
  CHECK(rc == 0);
}
