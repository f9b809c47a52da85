#include "core/thread_placement.h"

#include "core/copy_pool.h"

#include <dirent.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace vllm_shm_arena {
namespace {

constexpr size_t kBitsPerWord = sizeof(unsigned long) * CHAR_BIT;

bool has_cpu(const std::vector<unsigned long>& words, size_t cpu) {
  size_t w = cpu / kBitsPerWord;
  return w < words.size() && ((words[w] >> (cpu % kBitsPerWord)) & 1UL) != 0;
}

}  // namespace

std::vector<pid_t> find_threads(const std::string& prefix) {
  std::vector<pid_t> found;
  DIR* dir = opendir("/proc/self/task");
  if (dir == nullptr) return found;
  while (dirent* e = readdir(dir)) {
    char* end = nullptr;
    long tid = std::strtol(e->d_name, &end, 10);
    if (end == e->d_name || *end != '\0' || tid <= 0) continue;  // ".", ".."
    char path[64];
    std::snprintf(path, sizeof(path), "/proc/self/task/%ld/comm", tid);
    FILE* f = std::fopen(path, "re");
    if (f == nullptr) continue;  // the thread exited meanwhile
    char name[64] = {0};
    bool got = std::fgets(name, sizeof(name), f) != nullptr;
    std::fclose(f);
    if (got && std::strncmp(name, prefix.c_str(), prefix.size()) == 0) {
      found.push_back(static_cast<pid_t>(tid));
    }
  }
  closedir(dir);
  std::sort(found.begin(), found.end());
  return found;
}

ThreadPlacement::ThreadPlacement(const std::vector<pid_t>& tids) : owner_pid_(getpid()) {
  for (pid_t tid : tids) {
    std::vector<unsigned long> allowed = affinity_mask(tid);
    if (mask_cpus(allowed) > 1) threads_.push_back({tid, std::move(allowed)});
  }
}

void ThreadPlacement::keep_off_caller() {
  if (threads_.empty() || getpid() != owner_pid_) return;
  int cpu = sched_getcpu();
  if (cpu < 0) return;
  avoided_ = cpu;
  ++moves_;
  apply(cpu);
}

void ThreadPlacement::release() {
  if (avoided_ < 0 || getpid() != owner_pid_) return;
  avoided_ = -1;
  apply(-1);
}

void ThreadPlacement::apply(int cpu) {
  std::vector<unsigned long> mask;
  for (auto it = threads_.begin(); it != threads_.end();) {
    mask = it->allowed;
    auto ucpu = static_cast<size_t>(cpu);
    // (Every thread kept has more than one CPU: taking one out leaves it some.)
    if (cpu >= 0 && has_cpu(mask, ucpu)) {
      mask[ucpu / kBitsPerWord] &= ~(1UL << (ucpu % kBitsPerWord));
    }
    size_t bytes = mask.size() * sizeof(unsigned long);
    if (sched_setaffinity(it->tid, bytes, reinterpret_cast<const cpu_set_t*>(mask.data())) != 0) {
      it = threads_.erase(it);  // exited, or not ours to steer: leave it be from now on
    } else {
      ++it;
    }
  }
}

}  // namespace vllm_shm_arena
