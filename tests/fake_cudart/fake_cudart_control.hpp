// The fake runtime's control API, reached from C++ tests through dlsym on the same library the
// shim loads (see fake_cudart.c for what each function does).
#pragma once

#include <dlfcn.h>

#include <cstddef>
#include <stdexcept>
#include <string>
#include <type_traits>

namespace vllm_shm_arena::testing {

/// The control functions of libfakecudart.so, bound once per test process.
struct FakeCudart {
  /// The library's path, baked in by CMake.
  static const char* path() { return VSA_FAKE_CUDART_PATH; }

  /// Binds every control function; throws if the library or a symbol is missing.
  static const FakeCudart& get() {
    static const FakeCudart instance;
    return instance;
  }

  void (*reset)();
  long long (*calls)();
  long long (*register_calls)();
  long long (*unregister_calls)();
  long long (*register_count)(const void*, size_t);
  int (*is_registered)(const void*, size_t);
  size_t (*registered_bytes)();
  size_t (*registered_ranges)();
  unsigned (*last_register_flags)();
  void (*fail_register)(int);
  void (*set_register_delay_us)(int);
  void (*hold_events)(int);
  void (*complete_all)();
  int (*set_event_complete)(void*, int);
  void (*fail_event_record)(int);
  void (*fail_event_query)(int);
  long long (*live_events)();
  long long (*events_created)();
  long long (*event_records)();
  void* (*last_record_stream)();
  unsigned (*last_event_flags)();
  int (*peek_last_error)();

 private:
  FakeCudart() {
    // Same path, same loaded copy as the one CudaRuntime::load_from opens; never dlclosed.
    void* h = ::dlopen(path(), RTLD_NOW | RTLD_LOCAL);
    if (h == nullptr) throw std::runtime_error(std::string("dlopen fake cudart: ") + ::dlerror());
    auto bind = [h](auto& fn, const char* name) {
      void* sym = ::dlsym(h, name);
      if (sym == nullptr) throw std::runtime_error(std::string("missing ") + name);
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(sym);
    };
    bind(reset, "fake_cudart_reset");
    bind(calls, "fake_cudart_calls");
    bind(register_calls, "fake_cudart_register_calls");
    bind(unregister_calls, "fake_cudart_unregister_calls");
    bind(register_count, "fake_cudart_register_count");
    bind(is_registered, "fake_cudart_is_registered");
    bind(registered_bytes, "fake_cudart_registered_bytes");
    bind(registered_ranges, "fake_cudart_registered_ranges");
    bind(last_register_flags, "fake_cudart_last_register_flags");
    bind(fail_register, "fake_cudart_fail_register");
    bind(set_register_delay_us, "fake_cudart_set_register_delay_us");
    bind(hold_events, "fake_cudart_hold_events");
    bind(complete_all, "fake_cudart_complete_all");
    bind(set_event_complete, "fake_cudart_set_event_complete");
    bind(fail_event_record, "fake_cudart_fail_event_record");
    bind(fail_event_query, "fake_cudart_fail_event_query");
    bind(live_events, "fake_cudart_live_events");
    bind(events_created, "fake_cudart_events_created");
    bind(event_records, "fake_cudart_event_records");
    bind(last_record_stream, "fake_cudart_last_record_stream");
    bind(last_event_flags, "fake_cudart_last_event_flags");
    bind(peek_last_error, "fake_cudart_peek_last_error");
  }
};

}  // namespace vllm_shm_arena::testing
