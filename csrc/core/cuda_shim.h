// The CUDA runtime, resolved at run time from the copy the process already has loaded.
//
// Why no link-time dependency: the extension must import on machines without CUDA, and it must
// use the very libcudart torch uses (torch wheels ship their own, loaded RTLD_LOCAL), so that
// pinned ranges and events belong to the same runtime as torch's streams. We therefore never
// link libcudart; find() walks the loaded objects with dl_iterate_phdr and re-opens the one it
// finds with RTLD_NOLOAD, which cannot load anything new.
//
// The shim never creates a CUDA context and never decides whether one exists: it only resolves
// symbols. Calling any function here may create the primary context, so callers only do so once
// torch.cuda.is_initialized() says a context already exists.
//
// Types come from cuda_runtime_api.h when the build found it (VSA_HAVE_CUDA_HEADERS), otherwise
// from the minimal declarations below, which have the same ABI: cudaError_t is a 32-bit enum,
// streams and events are opaque pointers.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#if defined(VSA_HAVE_CUDA_HEADERS) && VSA_HAVE_CUDA_HEADERS
#include <cuda_runtime_api.h>
#endif

namespace vllm_shm_arena {

#if defined(VSA_HAVE_CUDA_HEADERS) && VSA_HAVE_CUDA_HEADERS
/// The runtime's error code type.
using CudaError = cudaError_t;
/// An opaque stream handle (the same value as torch's `cudaStream_t`).
using CudaStream = cudaStream_t;
/// An opaque event handle.
using CudaEvent = cudaEvent_t;
// Function pointer types, taken from the toolkit's own declarations.
/// The type of cudaHostRegister.
using CudaHostRegisterFn = decltype(&::cudaHostRegister);
/// The type of cudaHostUnregister.
using CudaHostUnregisterFn = decltype(&::cudaHostUnregister);
/// The type of cudaEventCreateWithFlags.
using CudaEventCreateWithFlagsFn = decltype(&::cudaEventCreateWithFlags);
/// The type of cudaEventRecord.
using CudaEventRecordFn = decltype(&::cudaEventRecord);
/// The type of cudaEventQuery.
using CudaEventQueryFn = decltype(&::cudaEventQuery);
/// The type of cudaEventDestroy.
using CudaEventDestroyFn = decltype(&::cudaEventDestroy);
/// The type of cudaGetErrorString.
using CudaGetErrorStringFn = decltype(&::cudaGetErrorString);
/// The type of cudaGetLastError.
using CudaGetLastErrorFn = decltype(&::cudaGetLastError);
#else
/// The runtime's error code type (same ABI as `enum cudaError`: a 32-bit enum).
enum CudaError : int {};
/// An opaque stream handle (the same value as torch's `cudaStream_t`).
using CudaStream = struct CUstream_st*;
/// An opaque event handle.
using CudaEvent = struct CUevent_st*;
// Function pointer types with the same ABI as the toolkit's declarations.
/// The type of cudaHostRegister.
using CudaHostRegisterFn = CudaError (*)(void*, size_t, unsigned int);
/// The type of cudaHostUnregister.
using CudaHostUnregisterFn = CudaError (*)(void*);
/// The type of cudaEventCreateWithFlags.
using CudaEventCreateWithFlagsFn = CudaError (*)(CudaEvent*, unsigned int);
/// The type of cudaEventRecord.
using CudaEventRecordFn = CudaError (*)(CudaEvent, CudaStream);
/// The type of cudaEventQuery.
using CudaEventQueryFn = CudaError (*)(CudaEvent);
/// The type of cudaEventDestroy.
using CudaEventDestroyFn = CudaError (*)(CudaEvent);
/// The type of cudaGetErrorString.
using CudaGetErrorStringFn = const char* (*)(CudaError);
/// The type of cudaGetLastError.
using CudaGetLastErrorFn = CudaError (*)();
#endif

/// The few runtime constants the core uses, valid with or without the toolkit headers.
namespace cuda_const {
/// cudaSuccess.
constexpr int kSuccess = 0;
/// cudaErrorCudartUnloading: the runtime is being torn down at process exit.
constexpr int kErrorCudartUnloading = 4;
/// cudaErrorNotReady: an event or stream query found work still running (not a failure).
constexpr int kErrorNotReady = 600;
/// cudaHostRegisterPortable: the pinning is visible to every CUDA context of the process.
constexpr unsigned int kHostRegisterPortable = 1;
/// cudaEventDisableTiming: the cheapest event kind, enough for completion queries.
constexpr unsigned int kEventDisableTiming = 2;
}  // namespace cuda_const

#if defined(VSA_HAVE_CUDA_HEADERS) && VSA_HAVE_CUDA_HEADERS
static_assert(cuda_const::kSuccess == cudaSuccess, "local constant must match the toolkit");
static_assert(cuda_const::kErrorCudartUnloading == cudaErrorCudartUnloading,
              "local constant must match the toolkit");
static_assert(cuda_const::kErrorNotReady == cudaErrorNotReady,
              "local constant must match the toolkit");
static_assert(cuda_const::kHostRegisterPortable == cudaHostRegisterPortable,
              "local constant must match the toolkit");
static_assert(cuda_const::kEventDisableTiming == cudaEventDisableTiming,
              "local constant must match the toolkit");
#endif
static_assert(sizeof(CudaError) == 4, "cudaError_t is passed and returned as a 32-bit value");

/// Function pointers into one libcudart. Every pointer is non-null in a constructed object; the
/// library stays mapped for as long as any shared_ptr to it lives.
class CudaRuntime {
 public:
  /// The libcudart this process already has loaded, or nullptr if there is none (then
  /// last_error() says why). When the environment variable VLLM_SHM_ARENA_CUDART names a path
  /// (settings::cudart_path()), that library is loaded instead (tests point it at a fake
  /// runtime); a value refused by that check is reported like a path that does not load.
  /// Never loads a real runtime that is not already there and never creates a CUDA context.
  static std::shared_ptr<CudaRuntime> find();
  /// Opens the runtime library at `path` (dlopen RTLD_NOW | RTLD_LOCAL) and resolves its
  /// symbols; nullptr if it cannot be opened or lacks a symbol (then last_error() says why).
  static std::shared_ptr<CudaRuntime> load_from(const std::string& path);
  /// Why the most recent find()/load_from() in this process returned nullptr ("" after a
  /// success).
  static std::string last_error();

  ~CudaRuntime();
  CudaRuntime(const CudaRuntime&) = delete;
  CudaRuntime& operator=(const CudaRuntime&) = delete;

  /// The file the symbols were resolved from.
  const std::string& path() const { return path_; }
  /// "<runtime's description> (error N)" for `err`; safe to call with any value.
  std::string error_string(CudaError err) const;
  /// "<what> failed: <error_string(err)>".
  std::string describe(const std::string& what, CudaError err) const;

  /// cudaHostRegister.
  CudaHostRegisterFn host_register = nullptr;
  /// cudaHostUnregister.
  CudaHostUnregisterFn host_unregister = nullptr;
  /// cudaEventCreateWithFlags.
  CudaEventCreateWithFlagsFn event_create_with_flags = nullptr;
  /// cudaEventRecord.
  CudaEventRecordFn event_record = nullptr;
  /// cudaEventQuery.
  CudaEventQueryFn event_query = nullptr;
  /// cudaEventDestroy.
  CudaEventDestroyFn event_destroy = nullptr;
  /// cudaGetErrorString.
  CudaGetErrorStringFn get_error_string = nullptr;
  /// cudaGetLastError. Needed because a failed call (and a query answering "not ready") leaves
  /// the runtime's per-thread last error set, and torch reports that later as the failure of an
  /// unrelated kernel launch; callers clear it after every such result.
  CudaGetLastErrorFn get_last_error = nullptr;

 private:
  CudaRuntime(void* handle, std::string path) : handle_(handle), path_(std::move(path)) {}
  static std::shared_ptr<CudaRuntime> resolve(void* handle, const std::string& path);

  void* handle_ = nullptr;
  std::string path_;
};

}  // namespace vllm_shm_arena
