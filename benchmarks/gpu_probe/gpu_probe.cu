// Torch-free probe: can a CUDA process page-lock POSIX shared memory that another process
// writes, DMA from it, and hand it back only after the DMA is over? And what does it buy?
//
//   parent (writer, never touches CUDA)           child (reader, owns the CUDA context)
//   shm_open + fallocate + fill(seed 1)
//   fork  ------------------------------------->  shm_open + mmap
//                                                 cudaHostRegister(Portable) in chunks, timed
//                                                 memcpyAsync H2D 200 MB, cudaEventRecord
//                                                 poll cudaEventQuery until done
//   wait for "DONE" on the pipe  <--------------  write "DONE"
//   overwrite the segment (seed 2)
//   write "REWRITTEN"  ------------------------>  verify GPU bytes == seed 1 (kernel)
//                                                 verify shm bytes == seed 2 (shared mapping)
//                                                 H2D bandwidth table, optional core check
//
// A failing CUDA call is printed as a result and the probe carries on; it never aborts.
#include <cuda_runtime.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/utsname.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#ifdef VSA_PROBE_WITH_CORE
#include "core/cuda_shim.h"
#include "core/pin_registry.h"
#include "core/release_gate.h"
#endif

namespace {

constexpr size_t kMiB = size_t{1} << 20;
constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Prints a failed call and returns false, so the probe can report and continue.
bool ok(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return true;
  std::printf("  CUDA ERROR: %s -> %s (%d: %s)\n", what, cudaGetErrorName(err),
              static_cast<int>(err), cudaGetErrorString(err));
  cudaGetLastError();
  return false;
}
#define CK(call) ok((call), #call)

__host__ __device__ inline uint8_t pattern(uint64_t i, uint8_t seed) {
  return static_cast<uint8_t>((i * 0x9E3779B97F4A7C15ull) >> 56) ^ seed;
}

__global__ void count_mismatches(const uint8_t* d, size_t n, uint8_t seed,
                                 unsigned long long* bad) {
  unsigned long long local = 0;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    if (d[i] != pattern(i, seed)) ++local;
  }
  if (local != 0) atomicAdd(bad, local);
}

void fill(uint8_t* p, size_t n, uint8_t seed) {
  for (size_t i = 0; i < n; ++i) p[i] = pattern(i, seed);
}

bool write_msg(int fd, const char* msg) {
  const size_t n = std::strlen(msg);
  return ::write(fd, msg, n) == static_cast<ssize_t>(n);
}

// Waits up to `timeout_ms` for `expect` on `fd`.
bool wait_msg(int fd, const char* expect, int timeout_ms) {
  std::string got;
  const double deadline = now_s() + timeout_ms / 1000.0;
  while (got.find(expect) == std::string::npos) {
    const int left = static_cast<int>((deadline - now_s()) * 1000);
    if (left <= 0) return false;
    struct pollfd pfd = {fd, POLLIN, 0};
    if (::poll(&pfd, 1, left) <= 0) return false;
    char buf[64];
    const ssize_t r = ::read(fd, buf, sizeof(buf));
    if (r <= 0) return false;
    got.append(buf, static_cast<size_t>(r));
  }
  return true;
}

std::string first_line(const char* path) {
  FILE* f = std::fopen(path, "r");
  if (f == nullptr) return std::string("(cannot read ") + path + ")";
  char buf[512] = {0};
  if (std::fgets(buf, sizeof(buf), f) == nullptr) buf[0] = '\0';
  std::fclose(f);
  std::string s(buf);
  while (!s.empty() && (s.back() == '\n' || s.back() == '\r')) s.pop_back();
  return s;
}

double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Copies [src, src+n) to dev in pieces that never cross a multiple of `piece` (counted from
// src, which is where each registration starts), or in one copy when piece == 0.
bool copy_h2d(void* dev, const void* src, size_t n, cudaStream_t stream, size_t piece) {
  if (piece == 0) piece = n;
  for (size_t off = 0; off < n; off += piece) {
    if (!CK(cudaMemcpyAsync(static_cast<char*>(dev) + off, static_cast<const char*>(src) + off,
                            std::min(piece, n - off), cudaMemcpyHostToDevice, stream))) {
      return false;
    }
  }
  return true;
}

// Median H2D bandwidth in GB/s (1e9 bytes/s) of `reps` timed copies after one warm-up.
double h2d_gbps(void* dev, const void* src, size_t n, cudaStream_t stream, int reps,
                size_t piece = 0) {
  cudaEvent_t a = nullptr;
  cudaEvent_t b = nullptr;
  if (!CK(cudaEventCreate(&a)) || !CK(cudaEventCreate(&b))) return -1.0;
  std::vector<double> rates;
  for (int r = -1; r < reps; ++r) {
    if (!CK(cudaEventRecord(a, stream))) break;
    if (!copy_h2d(dev, src, n, stream, piece)) break;
    if (!CK(cudaEventRecord(b, stream))) break;
    if (!CK(cudaEventSynchronize(b))) break;
    float ms = 0.0f;
    if (!CK(cudaEventElapsedTime(&ms, a, b))) break;
    if (r >= 0 && ms > 0.0f) rates.push_back(static_cast<double>(n) / (ms * 1e-3) / 1e9);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return rates.empty() ? -1.0 : median(rates);
}

struct RegResult {
  bool ok = false;
  double register_ms = 0.0;
  double unregister_ms = 0.0;
  size_t chunks = 0;
};

// Registers [p, p+n) in `chunk`-byte pieces; unregisters them again unless `keep`.
RegResult register_chunks(uint8_t* p, size_t n, size_t chunk, bool keep) {
  RegResult r;
  std::vector<uint8_t*> done;
  const double t0 = now_s();
  for (size_t off = 0; off < n; off += chunk) {
    const size_t len = std::min(chunk, n - off);
    cudaError_t err = cudaHostRegister(p + off, len, cudaHostRegisterPortable);
    if (err != cudaSuccess) {
      std::printf("  cudaHostRegister(%p, %zu, Portable) FAILED: %s (%d: %s)\n",
                  static_cast<void*>(p + off), len, cudaGetErrorName(err), static_cast<int>(err),
                  cudaGetErrorString(err));
      cudaGetLastError();
      for (uint8_t* q : done) cudaHostUnregister(q);
      return r;
    }
    done.push_back(p + off);
  }
  r.register_ms = (now_s() - t0) * 1e3;
  r.chunks = done.size();
  r.ok = true;
  if (!keep) {
    const double t1 = now_s();
    for (uint8_t* q : done) CK(cudaHostUnregister(q));
    r.unregister_ms = (now_s() - t1) * 1e3;
  }
  return r;
}

int run_reader(const char* name, size_t seg, int to_parent, int from_parent) {
  int failures = 0;
  const int fd = ::shm_open(name, O_RDWR, 0);
  if (fd < 0) {
    std::printf("child: shm_open(%s) failed: %s\n", name, std::strerror(errno));
    return 2;
  }
  void* m = ::mmap(nullptr, seg, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  if (m == MAP_FAILED) {
    std::printf("child: mmap failed: %s\n", std::strerror(errno));
    return 2;
  }
  auto* shm = static_cast<uint8_t*>(m);

  std::printf("\n== CUDA (reader process %d) ==\n", static_cast<int>(::getpid()));
  const double tc = now_s();
  if (!CK(cudaSetDevice(0)) || !CK(cudaFree(nullptr))) {
    write_msg(to_parent, "DONE");
    return 3;
  }
  std::printf("  context creation           %.1f ms\n", (now_s() - tc) * 1e3);
  cudaDeviceProp prop{};
  int drv = 0;
  int rtv = 0;
  CK(cudaGetDeviceProperties(&prop, 0));
  CK(cudaDriverGetVersion(&drv));
  CK(cudaRuntimeGetVersion(&rtv));
  std::printf("  GPU                        %s (sm_%d%d, %.1f GiB)\n", prop.name, prop.major,
              prop.minor, static_cast<double>(prop.totalGlobalMem) / kGiB);
  std::printf("  CUDA driver API / runtime  %d / %d\n", drv, rtv);

  std::printf("\n== cudaHostRegister(Portable) of the %zu MiB shm segment, by chunk size ==\n",
              seg / kMiB);
  std::printf("  %10s %8s %12s %12s %14s\n", "chunk", "chunks", "register ms", "ms per GiB",
              "unregister ms");
  bool can_register = true;
  const size_t chunk_sizes[] = {2 * kMiB, 16 * kMiB, 64 * kMiB, 256 * kMiB};
  for (size_t chunk : chunk_sizes) {
    chunk = std::min(chunk, seg);
    RegResult r = register_chunks(shm, seg, chunk, /*keep=*/false);
    if (!r.ok) {
      std::printf("  RESULT: cudaHostRegister of shared memory does not work here\n");
      can_register = false;
      break;
    }
    std::printf("  %7zu MiB %8zu %12.2f %12.2f %14.2f\n", chunk / kMiB, r.chunks, r.register_ms,
                r.register_ms / (static_cast<double>(seg) / kGiB), r.unregister_ms);
  }
  bool registered = false;
  if (can_register) {
    RegResult r = register_chunks(shm, seg, std::min(64 * kMiB, seg), /*keep=*/true);
    registered = r.ok;
    std::printf("  kept registered with 64 MiB chunks: %s (%.2f ms)\n", r.ok ? "yes" : "NO",
                r.register_ms);
  }

  // The handoff: DMA from the shared segment, event, tell the writer, writer reuses the memory.
  const size_t n = std::min(200 * kMiB, seg);
  std::printf("\n== async H2D from %s shm (%zu MiB), event-gated handoff to the writer ==\n",
              registered ? "registered" : "PAGEABLE", n / kMiB);
  cudaStream_t stream = nullptr;
  uint8_t* dev = nullptr;
  unsigned long long* bad = nullptr;
  cudaEvent_t ev = nullptr;
  CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  if (!CK(cudaMalloc(&dev, n)) || !CK(cudaMalloc(&bad, sizeof(*bad)))) {
    write_msg(to_parent, "DONE");
    return 3;
  }
  CK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  // One copy per registration: a copy spanning two registrations fails (tested below).
  const size_t chunk = std::min(64 * kMiB, seg);
  const double t0 = now_s();
  const bool copied = copy_h2d(dev, shm, n, stream, registered ? chunk : 0);
  failures += !copied;
  const double enqueue_ms = (now_s() - t0) * 1e3;
  CK(cudaEventRecord(ev, stream));
  long polls = 0;
  cudaError_t q;
  while ((q = cudaEventQuery(ev)) == cudaErrorNotReady) ++polls;
  cudaGetLastError();  // "not ready" sets the last error
  const double done_ms = (now_s() - t0) * 1e3;
  std::printf(
      "  memcpyAsync returned after %.2f ms; event complete after %.2f ms (%ld polls, %s)\n",
      enqueue_ms, done_ms, polls, cudaGetErrorName(q));
  std::printf(
      "  (a memcpyAsync that returns only when the copy is done means the source was "
      "treated as pageable)\n");
  write_msg(to_parent, "DONE");
  const bool rewritten = wait_msg(from_parent, "REWRITTEN", 60000);
  std::printf("  writer reused the memory after the event: %s\n",
              rewritten ? "yes" : "NO (timeout)");

  CK(cudaMemset(bad, 0, sizeof(*bad)));
  count_mismatches<<<1024, 256, 0, stream>>>(dev, n, 1, bad);
  CK(cudaGetLastError());
  unsigned long long host_bad = ~0ull;
  CK(cudaMemcpyAsync(&host_bad, bad, sizeof(host_bad), cudaMemcpyDeviceToHost, stream));
  CK(cudaStreamSynchronize(stream));
  std::printf("  GPU bytes match what the writer wrote before the handoff: %s (%llu mismatches)\n",
              host_bad == 0 ? "PASS" : "FAIL", host_bad);
  failures += host_bad != 0;
  size_t stale = 0;
  for (size_t i = 0; i < seg; i += 4099) stale += shm[i] != pattern(i, 2);
  std::printf("  reader sees the writer's rewrite through the shared mapping: %s\n",
              stale == 0 ? "PASS" : "FAIL");
  failures += stale != 0 || !rewritten;

  if (registered) {
    std::printf("\n== one cudaMemcpyAsync vs the boundary between two registrations ==\n");
    cudaError_t inside =
        cudaMemcpyAsync(dev, shm + chunk - 2 * kMiB, 2 * kMiB, cudaMemcpyHostToDevice, stream);
    cudaGetLastError();
    cudaError_t across =
        cudaMemcpyAsync(dev, shm + chunk - kMiB, 2 * kMiB, cudaMemcpyHostToDevice, stream);
    cudaGetLastError();
    CK(cudaStreamSynchronize(stream));
    std::printf("  2 MiB ending at the boundary: %s; 2 MiB across it: %s\n",
                cudaGetErrorName(inside), cudaGetErrorName(across));
    std::printf("  => %s\n", across == cudaSuccess
                                 ? "copies may span registrations"
                                 : "copies must be split at registration (chunk) boundaries");
  }

  std::printf("\n== H2D bandwidth, GB/s (1e9 B/s), median of 7 after 1 warm-up ==\n");
  uint8_t* pinned = nullptr;
  if (!CK(cudaMallocHost(&pinned, n))) pinned = nullptr;
  if (pinned != nullptr) std::memset(pinned, 1, n);
  auto* pageable = static_cast<uint8_t*>(std::malloc(n));
  if (pageable != nullptr) std::memset(pageable, 1, n);
  const size_t sizes[] = {8 * kMiB, 64 * kMiB, 200 * kMiB};
  struct Row {
    size_t size;
    double shm_reg, shm_one, malloc_host, malloc_pageable, shm_pageable;
  };
  std::vector<Row> rows;
  for (size_t s : sizes) {
    s = std::min(s, n);
    Row row{s, -1, -1, -1, -1, -1};
    if (registered) row.shm_reg = h2d_gbps(dev, shm, s, stream, 7, chunk);
    if (pinned != nullptr) row.malloc_host = h2d_gbps(dev, pinned, s, stream, 7);
    if (pageable != nullptr) row.malloc_pageable = h2d_gbps(dev, pageable, s, stream, 7);
    rows.push_back(row);
  }
  if (registered) {
    for (size_t off = 0; off < seg; off += chunk) CK(cudaHostUnregister(shm + off));
    // The same segment as one registration, copied in one piece.
    if (CK(cudaHostRegister(shm, seg, cudaHostRegisterPortable))) {
      for (Row& row : rows) row.shm_one = h2d_gbps(dev, shm, row.size, stream, 7);
      CK(cudaHostUnregister(shm));
    }
  }
  for (Row& row : rows) row.shm_pageable = h2d_gbps(dev, shm, row.size, stream, 7);
  std::printf(
      "  shm 64M-reg: 64 MiB registrations, one copy per chunk; shm 1-reg: one "
      "registration, one copy\n");
  std::printf("  %8s %12s %12s %15s %15s %13s\n", "size", "shm 64M-reg", "shm 1-reg",
              "cudaMallocHost", "malloc pageable", "shm pageable");
  auto cell = [](double v) {
    static char buf[8][32];
    static int k = 0;
    char* b = buf[k++ % 8];
    if (v < 0) {
      std::snprintf(b, 32, "n/a");
    } else {
      std::snprintf(b, 32, "%.2f", v);
    }
    return b;
  };
  for (const Row& row : rows) {
    std::printf("  %5zu MB %12s %12s %15s %15s %13s\n", row.size / kMiB, cell(row.shm_reg),
                cell(row.shm_one), cell(row.malloc_host), cell(row.malloc_pageable),
                cell(row.shm_pageable));
  }

#ifdef VSA_PROBE_WITH_CORE
  std::printf("\n== the core's shim against the real runtime ==\n");
  {
    using namespace vllm_shm_arena;
    auto rt = CudaRuntime::find();
    std::printf("  CudaRuntime::find(): %s\n",
                rt ? rt->path().c_str() : ("nullptr: " + CudaRuntime::last_error()).c_str());
    failures += rt == nullptr;
    if (rt != nullptr) {
      {
        PinRegistry reg(rt, shm, seg, 64 * kMiB);
        const double tr = now_s();
        const bool pinned_all = reg.ensure(shm, n);
        std::printf("  PinRegistry::ensure(%zu MiB): %s in %.2f ms, pinned %zu MiB\n", n / kMiB,
                    pinned_all ? "pinned" : "NOT pinned", (now_s() - tr) * 1e3,
                    reg.pinned_bytes() / kMiB);
        failures += can_register && !pinned_all;
        if (pinned_all) {
          std::printf("  H2D through the registry's pinning: %.2f GB/s\n",
                      h2d_gbps(dev, shm, n, stream, 3, reg.chunk_bytes()));
        }
        ReleaseGate gate(rt);
        size_t released = 0;
        auto rel = [&](uint64_t) { ++released; };
        for (size_t off = 0, piece = 0; off < n; off += piece) {
          piece = reg.contiguous_bytes(shm + off, n - off);
          CK(cudaMemcpyAsync(dev + off, shm + off, piece, cudaMemcpyHostToDevice, stream));
        }
        gate.freed(42);
        const size_t first = gate.flush(stream, rel);
        CK(cudaStreamSynchronize(stream));
        const size_t second = gate.flush(stream, rel);
        std::printf("  ReleaseGate: released %zu while the copy ran, %zu after sync, pending %zu\n",
                    first, second, gate.pending());
        failures += (first + second) != 1 || gate.pending() != 0;
        const cudaError_t last = cudaGetLastError();
        std::printf("  runtime last error after the gate: %s\n", cudaGetErrorName(last));
        failures += last != cudaSuccess;
      }  // the registry unregisters here, before the segment is unmapped
    }
  }
#endif

  cudaFreeHost(pinned);
  std::free(pageable);
  cudaFree(dev);
  cudaFree(bad);
  cudaEventDestroy(ev);
  cudaStreamDestroy(stream);
  ::munmap(shm, seg);
  return failures == 0 ? 0 : 1;
}

}  // namespace

int main() {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  // A reader that gave up early closes its pipe; the writer must survive writing to it.
  ::signal(SIGPIPE, SIG_IGN);
  struct utsname u{};
  ::uname(&u);
  std::printf("== host ==\n");
  std::printf("  uname -r                   %s\n", u.release);
  std::printf("  NVIDIA driver              %s\n",
              first_line("/proc/driver/nvidia/version").c_str());
  struct rlimit ml{};
  ::getrlimit(RLIMIT_MEMLOCK, &ml);
  if (ml.rlim_cur == RLIM_INFINITY) {
    std::printf("  RLIMIT_MEMLOCK             unlimited\n");
  } else {
    std::printf("  RLIMIT_MEMLOCK             %llu KiB\n",
                static_cast<unsigned long long>(ml.rlim_cur / 1024));
  }
  struct statvfs sv{};
  size_t shm_free = 0;
  if (::statvfs("/dev/shm", &sv) == 0) shm_free = static_cast<size_t>(sv.f_bavail) * sv.f_frsize;
  std::printf("  /dev/shm free              %zu MiB\n", shm_free / kMiB);

  // A small /dev/shm (docker's default is 64 MiB) would SIGBUS on first touch; shrink instead.
  size_t seg = 256 * kMiB;
  char name[64];
  std::snprintf(name, sizeof(name), "/vsa_gpu_probe_%d", static_cast<int>(::getpid()));
  int fd = ::shm_open(name, O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) {
    std::printf("RESULT: shm_open failed: %s\n", std::strerror(errno));
    return 1;
  }
  while (seg >= 16 * kMiB) {
    if (::ftruncate(fd, static_cast<off_t>(seg)) == 0 &&
        ::posix_fallocate(fd, 0, static_cast<off_t>(seg)) == 0) {
      break;
    }
    std::printf("  cannot back %zu MiB of shm, trying half\n", seg / kMiB);
    seg /= 2;
  }
  if (seg < 16 * kMiB) {
    std::printf("RESULT: /dev/shm too small for the probe\n");
    ::shm_unlink(name);
    return 1;
  }
  void* m = ::mmap(nullptr, seg, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  if (m == MAP_FAILED) {
    std::printf("RESULT: mmap failed: %s\n", std::strerror(errno));
    ::shm_unlink(name);
    return 1;
  }
  auto* shm = static_cast<uint8_t*>(m);
  fill(shm, seg, 1);
  std::printf("  shm segment                %s, %zu MiB, filled by the writer (pid %d)\n", name,
              seg / kMiB, static_cast<int>(::getpid()));

  int c2p[2];
  int p2c[2];
  if (::pipe(c2p) != 0 || ::pipe(p2c) != 0) {
    std::printf("RESULT: pipe failed: %s\n", std::strerror(errno));
    ::shm_unlink(name);
    return 1;
  }
  std::fflush(stdout);
  const pid_t child = ::fork();
  if (child == 0) {
    ::close(c2p[0]);
    ::close(p2c[1]);
    const int rc = run_reader(name, seg, c2p[1], p2c[0]);
    std::fflush(stdout);
    ::_exit(rc);
  }
  ::close(c2p[1]);
  ::close(p2c[0]);

  // The writer touches the memory again only after the reader says its DMA event completed.
  const bool done = wait_msg(c2p[0], "DONE", 180000);
  if (done) {
    fill(shm, seg, 2);
    write_msg(p2c[1], "REWRITTEN");
  } else {
    std::printf("writer: no DONE from the reader within 180 s\n");
  }
  int status = 0;
  ::waitpid(child, &status, 0);
  ::munmap(shm, seg);
  ::shm_unlink(name);
  const bool pass = done && WIFEXITED(status) && WEXITSTATUS(status) == 0;
  if (WIFSIGNALED(status)) std::printf("reader killed by signal %d\n", WTERMSIG(status));
  std::printf("\nRESULT: %s (reader exit %d)\n", pass ? "PASS" : "FAIL",
              WIFEXITED(status) ? WEXITSTATUS(status) : -1);
  return pass ? 0 : 1;
}
