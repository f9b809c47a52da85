// Process-shared futex helpers on a 32-bit atomic that lives in MAP_SHARED memory.
//
// The operations deliberately leave out FUTEX_PRIVATE_FLAG: the kernel then keys the wait
// queue on the physical page rather than the (mm, address) pair, so a waiter in one process is
// woken by a wake in another process that maps the same page at any address.
#pragma once

#include <atomic>
#include <cstdint>

namespace vllm_shm_arena {

static_assert(std::atomic<uint32_t>::is_always_lock_free,
              "a futex word is read by the kernel as a plain u32, so the atomic must hold no lock");
static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t),
              "the kernel compares exactly 4 bytes at the futex address");
static_assert(alignof(std::atomic<uint32_t>) == alignof(uint32_t),
              "FUTEX_WAIT fails with EINVAL on a word that is not 4-byte aligned");

/// Sleeps while `*word == expected`, at most `timeout_ns` (< 0: no limit). Returns false on
/// timeout; true when woken or when the word no longer held `expected` (callers re-check their
/// condition either way: wake-ups may be spurious). Signals (EINTR) do not end the wait early.
bool futex_wait(std::atomic<uint32_t>* word, uint32_t expected, int64_t timeout_ns);

/// Wakes every thread, in any process, sleeping in futex_wait on `word`.
void futex_wake_all(std::atomic<uint32_t>* word);

}  // namespace vllm_shm_arena
