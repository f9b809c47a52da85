#include "core/cuda_shim.h"

#include <dlfcn.h>
#include <link.h>

#include <cstring>
#include <mutex>
#include <optional>
#include <type_traits>
#include <vector>

#include "core/errors.h"
#include "core/settings.h"

namespace vllm_shm_arena {

namespace {

// Process-wide, not thread-local: the Python side may ask from another thread than the one that
// called find(), and a lookup failure is a property of the process, not of a thread.
std::mutex g_error_mutex;
std::string g_last_error;

void set_last_error(std::string why) {
  std::lock_guard<std::mutex> lock(g_error_mutex);
  g_last_error = std::move(why);
}

bool is_cudart_basename(const char* path) {
  const char* slash = std::strrchr(path, '/');
  const char* base = slash == nullptr ? path : slash + 1;
  static constexpr char kPrefix[] = "libcudart.so";
  return std::strncmp(base, kPrefix, sizeof(kPrefix) - 1) == 0;
}

int collect_cudart(struct dl_phdr_info* info, size_t /*size*/, void* data) {
  if (info->dlpi_name != nullptr && info->dlpi_name[0] != '\0' &&
      is_cudart_basename(info->dlpi_name)) {
    static_cast<std::vector<std::string>*>(data)->emplace_back(info->dlpi_name);
  }
  return 0;
}

std::string dl_error() {
  const char* e = ::dlerror();
  return e == nullptr ? std::string("unknown dlopen error") : std::string(e);
}

}  // namespace

std::string CudaRuntime::last_error() {
  std::lock_guard<std::mutex> lock(g_error_mutex);
  return g_last_error;
}

std::shared_ptr<CudaRuntime> CudaRuntime::find() {
  std::optional<std::string> override_path;
  try {
    override_path = settings::cudart_path();
  } catch (const InvalidArgument& e) {
    set_last_error(e.what());  // a value that names no library: no runtime, as for a bad path
    return nullptr;
  }
  if (override_path) {
    auto rt = load_from(*override_path);
    if (rt == nullptr) {
      set_last_error(std::string(settings::kCudartVar) + "=" + *override_path + ": " +
                     last_error());
    }
    return rt;
  }
  std::vector<std::string> found;
  ::dl_iterate_phdr(collect_cudart, &found);
  if (found.empty()) {
    set_last_error(
        "no libcudart.so* is loaded in this process (initialize CUDA in torch first, or set "
        "VLLM_SHM_ARENA_CUDART to the runtime library's path)");
    return nullptr;
  }
  // Several runtimes in one process (torch's and another extension's) share the driver's
  // primary context, so pinning and events through any of them are valid for torch's streams;
  // the first in load order is normally torch's.
  std::string why;
  for (const std::string& path : found) {
    // RTLD_NOLOAD: take a reference on the copy already mapped; never map a second one.
    void* handle = ::dlopen(path.c_str(), RTLD_NOW | RTLD_NOLOAD);
    if (handle == nullptr) {
      why += (why.empty() ? "" : "; ") + path + ": " + dl_error();
      continue;
    }
    auto rt = resolve(handle, path);
    if (rt != nullptr) return rt;
    why += (why.empty() ? "" : "; ") + last_error();
  }
  set_last_error(why);
  return nullptr;
}

std::shared_ptr<CudaRuntime> CudaRuntime::load_from(const std::string& path) {
  void* handle = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    set_last_error("cannot open CUDA runtime " + path + ": " + dl_error());
    return nullptr;
  }
  return resolve(handle, path);
}

std::shared_ptr<CudaRuntime> CudaRuntime::resolve(void* handle, const std::string& path) {
  std::shared_ptr<CudaRuntime> rt(new CudaRuntime(handle, path));
  std::string missing;
  auto bind = [&](auto& fn, const char* name) {
    // The plain names, not the _ptsz ones the per-thread-default-stream headers map to: for
    // stream 0 they mean the legacy default stream, which is torch's default stream too.
    void* sym = ::dlsym(handle, name);
    if (sym == nullptr) {
      missing += (missing.empty() ? "" : ", ") + std::string(name);
      return;
    }
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(sym);
  };
  bind(rt->host_register, "cudaHostRegister");
  bind(rt->host_unregister, "cudaHostUnregister");
  bind(rt->event_create_with_flags, "cudaEventCreateWithFlags");
  bind(rt->event_record, "cudaEventRecord");
  bind(rt->event_query, "cudaEventQuery");
  bind(rt->event_destroy, "cudaEventDestroy");
  bind(rt->get_error_string, "cudaGetErrorString");
  bind(rt->get_last_error, "cudaGetLastError");
  if (!missing.empty()) {
    // rt's destructor dlcloses the handle.
    set_last_error(path + " is not a usable CUDA runtime: missing symbol(s) " + missing);
    return nullptr;
  }
  set_last_error("");
  return rt;
}

CudaRuntime::~CudaRuntime() {
  if (handle_ != nullptr) ::dlclose(handle_);
}

std::string CudaRuntime::error_string(CudaError err) const {
  const int code = static_cast<int>(err);
  const char* text = get_error_string != nullptr ? get_error_string(err) : nullptr;
  return std::string(text != nullptr ? text : "unknown CUDA error") + " (error " +
         std::to_string(code) + ")";
}

std::string CudaRuntime::describe(const std::string& what, CudaError err) const {
  return what + " failed: " + error_string(err);
}

}  // namespace vllm_shm_arena
