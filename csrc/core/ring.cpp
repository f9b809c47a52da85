#include "core/ring.h"

#include <sched.h>

#include <atomic>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <new>
#include <string>
#include <thread>
#include <type_traits>

#include <sched.h>
#include <unistd.h>
#include "core/copy_pool.h"  // usable_cpus
#include "core/errors.h"
#include "core/futex.h"

namespace vllm_shm_arena {

namespace detail {

constexpr size_t kCacheLine = 64;
using vllm_shm_arena::kRingLayoutVersion;
using vllm_shm_arena::kRingMagic;

static_assert(std::atomic<uint64_t>::is_always_lock_free,
              "64-bit atomics are shared between processes; a lock-based one would keep its lock "
              "in process-private memory");
static_assert(std::atomic<uint32_t>::is_always_lock_free,
              "32-bit atomics are shared between processes and used as futex words");
static_assert(sizeof(std::atomic<uint64_t>) == 8 && sizeof(std::atomic<uint32_t>) == 4,
              "the layout below is computed from the plain sizes");

enum ReaderState : uint32_t {
  kReaderFree = 0,      // Never attached; the writer waits for it.
  kReaderAttached = 1,  // Attached; the writer waits for it while its process lives.
  kReaderDetached = 2,  // Left cleanly; never counted again.
  kReaderDead = 3,      // Dropped by the writer because its process is gone; never counted again.
};

struct alignas(kCacheLine) RingHeader {
  // Line 0: immutable after ring_init; magic is stored last so attachers see the rest.
  std::atomic<uint64_t> magic{0};
  uint32_t layout_version = 0;
  uint32_t n_readers = 0;
  uint32_t max_chunks = 0;
  uint32_t reserved0 = 0;
  uint64_t max_chunk_bytes = 0;
  uint64_t total_bytes = 0;
  // Line 1: writer role and ring-wide state.
  alignas(kCacheLine) std::atomic<uint64_t> writer{0};  // pid of the writer, 0 = none (yet).
  std::atomic<uint32_t> shutdown{0};
  std::atomic<uint32_t> dropped_readers{0};
  // Line 2: readers sleep on data_word; the writer bumps it on publish when data_waiters > 0.
  alignas(kCacheLine) std::atomic<uint32_t> data_word{0};
  std::atomic<uint32_t> data_waiters{0};
  // Line 3: the writer sleeps on space_word; readers bump it on release when space_waiter != 0.
  alignas(kCacheLine) std::atomic<uint32_t> space_word{0};
  std::atomic<uint32_t> space_waiter{0};
};

struct alignas(kCacheLine) ReaderSlot {
  std::atomic<uint64_t> read_seq{0};  // Last message this reader released.
  std::atomic<uint64_t> identity{0};  // pid of the attached process (messages only), 0 = none.
  std::atomic<uint32_t> state{kReaderFree};
};

struct alignas(kCacheLine) ChunkSlot {
  std::atomic<uint64_t> seq{0};  // Last message published into this chunk; 0 = never.
  uint64_t nbytes = 0;           // Plain: written before seq (release), read after it (acquire).
  uint32_t flags = 0;
};

static_assert(sizeof(RingHeader) == 4 * kCacheLine,
              "the header is four cache lines so the immutable layout, the writer's control "
              "word and the two futex lines never share a line (no false sharing)");
static_assert(sizeof(ReaderSlot) == kCacheLine,
              "one line per reader: each reader stores read_seq on every release, and a shared "
              "line would bounce between the readers' cores");
static_assert(sizeof(ChunkSlot) == kCacheLine,
              "one line per chunk: the writer publishes chunk i+1 while readers poll chunk i");
static_assert(alignof(RingHeader) == kCacheLine && alignof(ReaderSlot) == kCacheLine &&
                  alignof(ChunkSlot) == kCacheLine,
              "the base is 64-byte aligned and every table starts on a line boundary");
static_assert(std::is_standard_layout<RingHeader>::value &&
                  std::is_standard_layout<ReaderSlot>::value &&
                  std::is_standard_layout<ChunkSlot>::value,
              "shared-memory structs must have one layout in every process");

}  // namespace detail

using detail::ChunkSlot;
using detail::kCacheLine;
using detail::ReaderSlot;
using detail::RingHeader;

namespace {

using Clock = std::chrono::steady_clock;

constexpr int64_t kLivenessCheckNs = 50 * 1000 * 1000;  // Writer checks lagging readers this often.
// A reader spins only this long after its last message (see RingReader in ring.h).
constexpr int64_t kBusyWindowNs = 50 * 1000 * 1000;
// A sched_yield that returns this late handed the CPU to a thread with work to do (one that
// only spins yields straight back, within microseconds; one that computes keeps the CPU for a
// scheduler slice, most of a millisecond or more): the CPU is wanted, so a reader that cedes
// (RingReader::set_cede_cpu) sleeps.
constexpr int64_t kCededYieldNs = 200 * 1000;
constexpr int64_t kWriterCheckNs = 100 * 1000 * 1000;  // A waiting reader probes the writer.
constexpr int64_t kMaxFiniteTimeoutNs = int64_t{1} << 60;

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch())
      .count();
}

// A timeout_ns turned into a deadline; negative (or absurdly large) means none.
class Deadline {
 public:
  explicit Deadline(int64_t timeout_ns)
      : infinite_(timeout_ns < 0 || timeout_ns > kMaxFiniteTimeoutNs),
        end_ns_(infinite_ ? 0 : now_ns() + timeout_ns) {}
  // Nanoseconds left (0 when expired), or -1 without a deadline.
  int64_t remaining_ns() const {
    if (infinite_) return -1;
    const int64_t left = end_ns_ - now_ns();
    return left > 0 ? left : 0;
  }

 private:
  bool infinite_;
  int64_t end_ns_;
};

void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

uint64_t round_up(uint64_t v, uint64_t to) { return (v + to - 1) / to * to; }

std::string u64(uint64_t v) { return std::to_string(v); }

std::string hex64(uint64_t v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "0x%016" PRIx64, v);
  return buf;
}

void check_block(const void* base, size_t bytes, const char* fn) {
  if (base == nullptr) throw InvalidArgument(std::string(fn) + ": base must not be null");
  if (reinterpret_cast<uintptr_t>(base) % kCacheLine != 0) {
    throw InvalidArgument(std::string(fn) + ": base=" + hex64(reinterpret_cast<uintptr_t>(base)) +
                          " is not 64-byte aligned");
  }
  if (bytes < sizeof(RingHeader)) {
    throw InvalidArgument(std::string(fn) + ": bytes=" + u64(bytes) +
                          " is smaller than the ring header (" + u64(sizeof(RingHeader)) +
                          " bytes)");
  }
}

std::string describe(const RingConfig& c) {
  return "n_readers=" + u64(c.n_readers) + ", max_chunks=" + u64(c.max_chunks) +
         ", max_chunk_bytes=" + u64(c.max_chunk_bytes);
}

struct Tables {
  RingHeader* header;
  ReaderSlot* readers;
  ChunkSlot* chunks;
  uint8_t* payload;
  uint64_t stride;
};

Tables tables(void* base, const RingConfig& c) {
  auto* b = static_cast<uint8_t*>(base);
  Tables t;
  t.header = reinterpret_cast<RingHeader*>(b);
  t.readers = reinterpret_cast<ReaderSlot*>(b + sizeof(RingHeader));
  t.chunks =
      reinterpret_cast<ChunkSlot*>(b + sizeof(RingHeader) + sizeof(ReaderSlot) * c.n_readers);
  t.payload =
      b + sizeof(RingHeader) + sizeof(ReaderSlot) * c.n_readers + sizeof(ChunkSlot) * c.max_chunks;
  t.stride = round_up(c.max_chunk_bytes, kCacheLine);
  return t;
}

// Wakes whoever sleeps on `word` after bumping it, so a sleeper that loaded the old value
// either sees the new one in the kernel's check or is already queued and gets woken.
void bump_and_wake(std::atomic<uint32_t>* word) {
  // SYNC POINT: seq_cst RMW; pairs with the seq_cst load of the same word a sleeper makes
  // before re-checking its condition and calling futex_wait (the Dekker pattern in ring.h).
  word->fetch_add(1, std::memory_order_seq_cst);
  futex_wake_all(word);
}

}  // namespace

size_t ring_bytes(const RingConfig& c) {
  if (c.n_readers == 0 || c.n_readers > kRingMaxReaders) {
    throw InvalidArgument("ring: n_readers=" + u64(c.n_readers) + " must be in [1, " +
                          u64(kRingMaxReaders) + "]");
  }
  if (c.max_chunks == 0 || c.max_chunks > kRingMaxChunks) {
    throw InvalidArgument("ring: max_chunks=" + u64(c.max_chunks) + " must be in [1, " +
                          u64(kRingMaxChunks) + "]");
  }
  if (c.max_chunk_bytes == 0 || c.max_chunk_bytes > kRingMaxChunkBytes) {
    throw InvalidArgument("ring: max_chunk_bytes=" + u64(c.max_chunk_bytes) + " must be in [1, " +
                          u64(kRingMaxChunkBytes) + "]");
  }
  // With the limits above the product stays below 2^61, so nothing overflows in 64 bits.
  const uint64_t total = sizeof(RingHeader) + uint64_t{sizeof(ReaderSlot)} * c.n_readers +
                         uint64_t{sizeof(ChunkSlot)} * c.max_chunks +
                         round_up(c.max_chunk_bytes, kCacheLine) * c.max_chunks;
  if (total > SIZE_MAX) {
    throw InvalidArgument("ring: " + describe(c) + " needs " + u64(total) +
                          " bytes, more than this platform can address");
  }
  return static_cast<size_t>(total);
}

size_t ring_metadata_bytes(const RingConfig& c) {
  ring_bytes(c);  // validates the shape
  return sizeof(RingHeader) + sizeof(ReaderSlot) * c.n_readers + sizeof(ChunkSlot) * c.max_chunks;
}

void ring_init(void* base, size_t bytes, const RingConfig& c) {
  check_block(base, bytes, "ring_init");
  const size_t need = ring_bytes(c);
  if (bytes < need) {
    throw InvalidArgument("ring_init: bytes=" + u64(bytes) + " is too small for " + describe(c) +
                          " (needs " + u64(need) + ")");
  }
  Tables t = tables(base, c);
  // Placement-new gives every atomic a defined initial value; payload bytes are left alone.
  auto* h = new (t.header) RingHeader();
  h->layout_version = detail::kRingLayoutVersion;
  h->n_readers = c.n_readers;
  h->max_chunks = c.max_chunks;
  h->max_chunk_bytes = c.max_chunk_bytes;
  h->total_bytes = need;
  for (uint32_t r = 0; r < c.n_readers; ++r) new (&t.readers[r]) ReaderSlot();
  for (uint32_t i = 0; i < c.max_chunks; ++i) new (&t.chunks[i]) ChunkSlot();
  // SYNC POINT: release; pairs with the acquire load of magic in ring_validate, so an attacher
  // that sees the magic also sees the sizes and zeroed tables stored above.
  h->magic.store(detail::kRingMagic, std::memory_order_release);
}

RingConfig ring_validate(const void* base, size_t bytes) {
  check_block(base, bytes, "ring_validate");
  const auto* h = static_cast<const RingHeader*>(base);
  // SYNC POINT: acquire; pairs with the release store of magic at the end of ring_init.
  const uint64_t magic = h->magic.load(std::memory_order_acquire);
  if (magic != detail::kRingMagic) {
    throw InvalidArgument("ring_validate: not a ring (magic " + hex64(magic) + ", expected " +
                          hex64(detail::kRingMagic) + "); was ring_init called on this block?");
  }
  if (h->layout_version != detail::kRingLayoutVersion) {
    throw InvalidArgument("ring_validate: layout_version=" + u64(h->layout_version) +
                          " but this build reads version " + u64(detail::kRingLayoutVersion) +
                          "; writer and readers must come from the same build");
  }
  RingConfig c;
  c.n_readers = h->n_readers;
  c.max_chunks = h->max_chunks;
  c.max_chunk_bytes = h->max_chunk_bytes;
  size_t need = 0;
  try {
    need = ring_bytes(c);
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(std::string("ring_validate: corrupt header: ") + e.what());
  }
  if (h->total_bytes != need) {
    throw InvalidArgument("ring_validate: corrupt header: total_bytes=" + u64(h->total_bytes) +
                          " but " + describe(c) + " needs " + u64(need));
  }
  if (bytes < need) {
    throw InvalidArgument("ring_validate: bytes=" + u64(bytes) + " is smaller than the ring (" +
                          u64(need) + " bytes for " + describe(c) + ")");
  }
  return c;
}

// ---------------------------------------------------------------------------------------------
// RingWriter

RingWriter::RingWriter(void* base, size_t bytes, const TokenFile& tokens,
                       std::unique_ptr<LivenessToken> token)
    : config_(ring_validate(base, bytes)),
      tokens_(tokens),
      token_(std::move(token)),
      owner_pid_(::getpid()) {
  Tables t = tables(base, config_);
  header_ = t.header;
  readers_ = t.readers;
  chunks_ = t.chunks;
  payload_ = t.payload;
  stride_ = t.stride;
  if (!token_) {
    try {
      token_ = LivenessToken::take(tokens_.path, kWriterTokenByte, tokens_.probe_fd);
    } catch (const TokenHeld&) {
      // SYNC POINT: relaxed; the pid is only quoted in the message.
      const uint64_t holder = header_->writer.load(std::memory_order_relaxed);
      throw TokenHeld("RingWriter: the writer role is already held by pid " +
                      std::to_string(holder) +
                      (holder == static_cast<uint64_t>(owner_pid_) ? " (this process)" : "") +
                      "; a ring has exactly one writer");
    }
  }
  // SYNC POINT: acq_rel exchange; the acquire half pairs with the release CAS in a previous
  // ~RingWriter (a writer that died published with seq_cst stores and can store no more), so
  // the chunk seqs read below are the last ones published. Holding the token makes us the
  // writer; the pid is for messages and tells readers a writer has attached.
  header_->writer.exchange(static_cast<uint64_t>(owner_pid_), std::memory_order_acq_rel);
  // Resume numbering after the last published message (a fresh ring has none: all seqs are 0).
  uint64_t last = 0;
  for (uint32_t i = 0; i < config_.max_chunks; ++i) {
    // SYNC POINT: relaxed; ordered after the acquire exchange above.
    const uint64_t s = chunks_[i].seq.load(std::memory_order_relaxed);
    if (s > last) last = s;
  }
  next_seq_ = last + 1;
}

RingWriter::~RingWriter() {
  // A forked child that inherited this object must not give away its parent's role (its copy
  // of the token's descriptor was closed at fork).
  if (::getpid() != owner_pid_) return;
  uint64_t expected = static_cast<uint64_t>(owner_pid_);
  // SYNC POINT: release CAS; pairs with the acquire half of the exchange in the next
  // RingWriter's constructor, handing over the seqs this writer published.
  header_->writer.compare_exchange_strong(expected, 0, std::memory_order_release,
                                          std::memory_order_relaxed);
  token_.reset();
}

bool RingWriter::all_released(uint64_t need) const {
  if (need == 0) return true;
  for (uint32_t r = 0; r < config_.n_readers; ++r) {
    // SYNC POINT: seq_cst; pairs with the seq_cst stores of state in RingReader's constructor
    // and destructor (a detaching reader stores DETACHED, then looks for space_waiter).
    const uint32_t st = readers_[r].state.load(std::memory_order_seq_cst);
    if (st == detail::kReaderDetached || st == detail::kReaderDead) continue;
    // SYNC POINT: seq_cst (acquire at least); pairs with the seq_cst store of read_seq in
    // RingReader::release: the reader's reads of the chunk happen before we overwrite it, and
    // with the space_waiter store in acquire() no wake-up is lost.
    if (readers_[r].read_seq.load(std::memory_order_seq_cst) < need) return false;
  }
  return true;
}

void RingWriter::drop_dead_readers(uint64_t need) {
  for (uint32_t r = 0; r < config_.n_readers; ++r) {
    ReaderSlot& slot = readers_[r];
    // SYNC POINT: acquire; pairs with the seq_cst store of ATTACHED in RingReader's constructor,
    // which follows the store of identity, so identity below is the attached process.
    uint32_t st = slot.state.load(std::memory_order_acquire);
    // A FREE reader has no process to check yet: it is waited for until the caller's timeout.
    if (st != detail::kReaderAttached) continue;
    // SYNC POINT: acquire; pairs with the release store of read_seq in RingReader::release.
    if (slot.read_seq.load(std::memory_order_acquire) >= need) continue;
    // Through the mapping's descriptor: opens nothing, so an exhausted descriptor table cannot
    // turn into a "dead" verdict.
    const Liveness v = probe_token(tokens_.probe_fd, reader_token_byte(r));
    if (v == Liveness::kAlive) continue;
    if (v == Liveness::kUnknown) {
      ++liveness_unknown_;  // cannot tell: alive
      continue;
    }
    // SYNC POINT: seq_cst CAS; races with the reader's own ATTACHED -> DETACHED CAS in
    // ~RingReader (a dying reader's last act) so the rank is retired exactly once.
    if (slot.state.compare_exchange_strong(st, detail::kReaderDead, std::memory_order_seq_cst)) {
      // SYNC POINT: relaxed RMW; a statistics counter, ordered by nothing.
      header_->dropped_readers.fetch_add(1, std::memory_order_relaxed);
    }
  }
}

uint8_t* RingWriter::acquire(int64_t timeout_ns) {
  if (acquired_) {
    throw InvalidArgument("RingWriter::acquire: chunk for message " + u64(next_seq_) +
                          " is already acquired; publish() it first");
  }
  // SYNC POINT: relaxed; only this writer stores shutdown.
  if (header_->shutdown.load(std::memory_order_relaxed) != 0) {
    throw InvalidArgument("RingWriter::acquire: the ring was shut down");
  }
  const uint64_t s = next_seq_;
  // Every counted reader must have released the chunk's previous message, s - max_chunks.
  const uint64_t need = s > config_.max_chunks ? s - config_.max_chunks : 0;
  const Deadline deadline(timeout_ns);
  bool free = all_released(need);
  bool announced = false;
  while (!free) {
    const int64_t now = now_ns();
    if (now - last_liveness_check_ns_ >= kLivenessCheckNs) {
      last_liveness_check_ns_ = now;
      drop_dead_readers(need);
      free = all_released(need);
      continue;
    }
    int64_t left = deadline.remaining_ns();
    if (left == 0) break;
    if (!announced) {
      // SYNC POINT: seq_cst; pairs with the seq_cst load of space_waiter in
      // RingReader::release/~RingReader: either the reader sees this and bumps space_word, or
      // our re-check in all_released() sees its read_seq/state store.
      header_->space_waiter.store(1, std::memory_order_seq_cst);
      announced = true;
    }
    // SYNC POINT: seq_cst; pairs with the seq_cst fetch_add in bump_and_wake (from release).
    const uint32_t word = header_->space_word.load(std::memory_order_seq_cst);
    if ((free = all_released(need))) break;
    // Sleep no longer than until the next liveness check is due.
    const int64_t until_check = last_liveness_check_ns_ + kLivenessCheckNs - now;
    if (left < 0 || left > until_check) left = until_check > 0 ? until_check : 1;
    futex_wait(&header_->space_word, word, left);
    free = all_released(need);
  }
  if (announced) {
    // SYNC POINT: relaxed; a stale 1 only costs a reader a spurious wake-up.
    header_->space_waiter.store(0, std::memory_order_relaxed);
  }
  if (!free) return nullptr;
  acquired_ = true;
  return payload_ + stride_ * ((s - 1) % config_.max_chunks);
}

void RingWriter::publish(uint64_t nbytes, uint32_t flags) {
  if (!acquired_) {
    throw InvalidArgument(
        "RingWriter::publish: no chunk acquired (acquire() returned nullptr or "
        "was not called)");
  }
  if (nbytes > config_.max_chunk_bytes) {
    throw InvalidArgument("RingWriter::publish: nbytes=" + u64(nbytes) +
                          " exceeds max_chunk_bytes=" + u64(config_.max_chunk_bytes));
  }
  const uint64_t s = next_seq_;
  ChunkSlot& chunk = chunks_[(s - 1) % config_.max_chunks];
  chunk.nbytes = nbytes;
  chunk.flags = flags;
  // SYNC POINT: seq_cst (release at least); pairs with the acquire/seq_cst loads of chunk.seq in
  // RingReader::acquire: a reader that sees s sees nbytes, flags and the payload. seq_cst also
  // orders it before our data_waiters load below (Dekker with the reader's fetch_add).
  chunk.seq.store(s, std::memory_order_seq_cst);
  acquired_ = false;
  ++next_seq_;
  // SYNC POINT: seq_cst; pairs with the seq_cst fetch_add of data_waiters in
  // RingReader::acquire: a reader that announced itself before our store above is woken.
  if (header_->data_waiters.load(std::memory_order_seq_cst) != 0) {
    bump_and_wake(&header_->data_word);
  }
}

void RingWriter::shutdown() {
  // SYNC POINT: seq_cst; pairs with the seq_cst load of shutdown a reader makes after loading
  // data_word and before sleeping; the unconditional bump below then wakes it.
  header_->shutdown.store(1, std::memory_order_seq_cst);
  bump_and_wake(&header_->data_word);
}

uint32_t RingWriter::dropped_readers() const {
  // SYNC POINT: relaxed; a statistics counter.
  return header_->dropped_readers.load(std::memory_order_relaxed);
}

// ---------------------------------------------------------------------------------------------
// RingReader

RingReader::RingReader(void* base, size_t bytes, uint32_t rank, const TokenFile& tokens)
    : config_(ring_validate(base, bytes)), tokens_(tokens), owner_pid_(::getpid()), rank_(rank) {
  if (rank >= config_.n_readers) {
    throw OutOfRange("RingReader: rank=" + u64(rank) +
                     " is out of range for n_readers=" + u64(config_.n_readers));
  }
  Tables t = tables(base, config_);
  header_ = t.header;
  slot_ = &t.readers[rank];
  chunks_ = t.chunks;
  payload_ = t.payload;
  stride_ = t.stride;
  // Spinning only pays with a CPU to spare for every reader and the writer: the CPUs this
  // process may use (affinity mask, cgroup quota), not every CPU of the host.
  spin_pause_ = usable_cpus() > config_.n_readers + 1;

  const uint64_t me = static_cast<uint64_t>(owner_pid_);
  try {
    token_ = LivenessToken::take(tokens_.path, reader_token_byte(rank), tokens_.probe_fd);
  } catch (const TokenHeld&) {
    // SYNC POINT: relaxed; the pid is only quoted in the message.
    const uint64_t holder = slot_->identity.load(std::memory_order_relaxed);
    throw TokenHeld("RingReader: rank=" + u64(rank) + " already has a live reader (pid " +
                    u64(holder) + (holder == me ? ", this process" : "") +
                    "); each rank attaches once per ring");
  }
  uint64_t holder = 0;
  // SYNC POINT: acq_rel CAS; claims the rank exactly once across all processes (pairs with
  // itself in an earlier RingReader of this rank); the writer reads state, not the pid.
  if (!slot_->identity.compare_exchange_strong(holder, me, std::memory_order_acq_rel)) {
    // SYNC POINT: acquire; pairs with the state stores of the rank's earlier reader/writer.
    const uint32_t st = slot_->state.load(std::memory_order_acquire);
    std::string why = st == detail::kReaderDetached
                          ? "was used by pid " + u64(holder) + " and detached"
                          : "was used by pid " + u64(holder) + ", which is gone";
    throw InvalidArgument("RingReader: rank=" + u64(rank) + " " + why +
                          "; each rank attaches once per ring");
  }
  // SYNC POINT: relaxed; this reader is the only one that stores its read_seq, and only
  // ring_init wrote it before (published by the acquire in ring_validate).
  last_seq_ = slot_->read_seq.load(std::memory_order_relaxed);
  // SYNC POINT: seq_cst (release at least); pairs with the acquire load of state in
  // RingWriter::drop_dead_readers: our token is held before the writer can see ATTACHED.
  slot_->state.store(detail::kReaderAttached, std::memory_order_seq_cst);
}

RingReader::~RingReader() {
  // A forked child that inherited this object must not detach its parent's rank.
  if (::getpid() != owner_pid_) return;
  uint32_t st = detail::kReaderAttached;
  // SYNC POINT: seq_cst CAS; races with the writer's ATTACHED -> DEAD CAS in drop_dead_readers
  // and pairs with the seq_cst state load in RingWriter::all_released (Dekker with space_waiter).
  slot_->state.compare_exchange_strong(st, detail::kReaderDetached, std::memory_order_seq_cst);
  // SYNC POINT: seq_cst; pairs with the seq_cst store of space_waiter in RingWriter::acquire.
  if (header_->space_waiter.load(std::memory_order_seq_cst) != 0) {
    try {
      bump_and_wake(&header_->space_word);
    } catch (...) {
      // A destructor must not throw; the writer re-checks at least every 50 ms anyway.
    }
  }
}

Liveness RingReader::writer_liveness() const {
  // SYNC POINT: acquire; pairs with the acq_rel exchange in RingWriter's constructor. 0 means
  // no writer ever attached (or one gave the role back cleanly): nothing to declare dead.
  if (header_->writer.load(std::memory_order_acquire) == 0) return Liveness::kAlive;
  return probe_token(tokens_.probe_fd, kWriterTokenByte);
}

void RingReader::throw_overrun(uint64_t found) const {
  // SYNC POINT: relaxed; diagnostic only.
  const bool dropped = slot_->state.load(std::memory_order_relaxed) == detail::kReaderDead;
  throw ShmError("RingReader: rank=" + u64(rank_) + " expected message " + u64(last_seq_ + 1) +
                 " but the chunk holds message " + u64(found) +
                 (dropped ? ": the writer dropped this reader as dead"
                          : ": the writer overwrote an unread chunk (shared memory corrupted?)"));
}

RingReader::Status RingReader::acquire(int64_t timeout_ns, const uint8_t** data, uint64_t* nbytes,
                                       uint32_t* flags) {
  if (data == nullptr || nbytes == nullptr || flags == nullptr) {
    throw InvalidArgument("RingReader::acquire: data, nbytes and flags must not be null");
  }
  if (acquired_) {
    throw InvalidArgument("RingReader::acquire: message " + u64(last_seq_ + 1) +
                          " is still acquired; release() it first");
  }
  const uint64_t next = last_seq_ + 1;
  const uint64_t index = (next - 1) % config_.max_chunks;
  ChunkSlot& chunk = chunks_[index];
  // True when message `next` is in the chunk. The load is seq_cst on the sleeping path (the
  // re-check of the Dekker pattern) and acquire elsewhere.
  auto ready = [&](std::memory_order order) {
    // SYNC POINT: acquire / seq_cst; pairs with the seq_cst store of chunk.seq in
    // RingWriter::publish: seeing `next` makes nbytes, flags and the payload visible.
    const uint64_t s = chunk.seq.load(order);
    if (s > next) throw_overrun(s);
    return s == next;
  };

  Status status = Status::kOk;
  if (ready(std::memory_order_acquire)) {
    ++wait_stats_.ready;
  } else {
    const Deadline deadline(timeout_ns);
    bool slept = false;
    const int64_t start = now_ns();
    int64_t spin_end = last_read_ns_ + kBusyWindowNs;
    if (start < spin_end) {
      // Until the busy window closes, the deadline passes or the writer shuts the ring.
      const int64_t left = deadline.remaining_ns();
      if (left >= 0 && start + left < spin_end) spin_end = start + left;
      int64_t now = start;
      for (uint32_t i = 1; now < spin_end && !ready(std::memory_order_acquire); ++i) {
        if (spin_pause_) {
          cpu_relax();
        } else {
          sched_yield();  // the CPU goes to whoever needs it (the writer, a busy reader)
          if (cede_cpu_) {
            // Only a spinning neighbour gave it back at once: a late return means a thread
            // computed on this CPU meanwhile, and spinning on would take CPU time from it (the
            // scheduler shares a CPU between runnable threads, yielding or not).
            const int64_t after = now_ns();
            const bool ceded = after - now >= kCededYieldNs;
            now = after;
            if (ceded) {
              ++wait_stats_.ceded;
              break;
            }
          }
        }
        if (i % 64 == 0) {
          // SYNC POINT: relaxed; only ends the spin early, the loop below re-reads it with
          // acquire before acting on it.
          if (header_->shutdown.load(std::memory_order_relaxed) != 0) break;
          if (spin_pause_ || !cede_cpu_) now = now_ns();  // a ceding yield reads it every turn
        }
      }
      wait_stats_.spin_ns += static_cast<uint64_t>(now_ns() - start);
    }
    // The first check is due at once (callers wait in short slices), then every 100 ms.
    int64_t next_writer_check = now_ns();
    while (!ready(std::memory_order_acquire)) {
      // SYNC POINT: acquire; pairs with the seq_cst store of shutdown in RingWriter::shutdown,
      // which follows every publish, so the ready() re-check below sees the last message.
      if (header_->shutdown.load(std::memory_order_acquire) != 0) {
        if (!ready(std::memory_order_acquire)) status = Status::kShutdown;
        break;
      }
      int64_t left = deadline.remaining_ns();
      if (left == 0) {
        status = Status::kTimeout;
        break;
      }
      const int64_t now = now_ns();
      if (now >= next_writer_check) {
        next_writer_check = now + kWriterCheckNs;
        // A dead writer's last message is already visible (its stores happened before it
        // died), so re-check once before reporting it.
        if (writer_liveness() == Liveness::kDead) {
          if (!ready(std::memory_order_acquire)) status = Status::kWriterDead;
          break;
        }
      }
      // Sleep no longer than until the next writer check is due.
      const int64_t until_check = next_writer_check - now;
      if (left < 0 || left > until_check) left = until_check > 0 ? until_check : 1;
      // SYNC POINT: seq_cst RMW; pairs with the seq_cst load of data_waiters in
      // RingWriter::publish: either the writer sees us and bumps data_word, or our seq_cst
      // re-check below sees its seq store.
      header_->data_waiters.fetch_add(1, std::memory_order_seq_cst);
      // SYNC POINT: seq_cst; pairs with the seq_cst fetch_add in bump_and_wake (publish or
      // shutdown): a bump after this load makes futex_wait return at once.
      const uint32_t word = header_->data_word.load(std::memory_order_seq_cst);
      // SYNC POINT: seq_cst (the load inside ready) and seq_cst here; pair with the seq_cst
      // stores of chunk.seq in publish and of shutdown in RingWriter::shutdown.
      const bool go = ready(std::memory_order_seq_cst) ||
                      header_->shutdown.load(std::memory_order_seq_cst) != 0;
      try {
        if (!go) {
          slept = true;
          futex_wait(&header_->data_word, word, left);
        }
      } catch (...) {
        // SYNC POINT: relaxed RMW; undoes the announcement above, no data is published by it.
        header_->data_waiters.fetch_sub(1, std::memory_order_relaxed);
        throw;
      }
      // SYNC POINT: relaxed RMW; a stale count only costs the writer a spurious wake.
      header_->data_waiters.fetch_sub(1, std::memory_order_relaxed);
    }
    if (status == Status::kOk) ++(slept ? wait_stats_.slept : wait_stats_.spun);
  }
  if (status != Status::kOk) return status;
  last_read_ns_ = now_ns();
  // Read once and checked against the private copy of the geometry: a corrupted length must
  // never send the caller past the chunk (and the mapping).
  const uint64_t n = chunk.nbytes;
  if (n > config_.max_chunk_bytes) {
    throw ShmError("RingReader: rank=" + u64(rank_) + " message " + u64(next) + " claims " +
                   u64(n) + " bytes, more than a chunk holds (" + u64(config_.max_chunk_bytes) +
                   "): the ring's shared memory is corrupt");
  }
  *data = payload_ + stride_ * index;
  *nbytes = n;
  *flags = chunk.flags;
  acquired_ = true;
  return Status::kOk;
}

void RingReader::release() {
  if (!acquired_) {
    throw InvalidArgument("RingReader::release: rank=" + u64(rank_) +
                          " holds no message (acquire() did not return kOk)");
  }
  ++last_seq_;
  acquired_ = false;
  // SYNC POINT: seq_cst (release at least); pairs with the seq_cst load of read_seq in
  // RingWriter::all_released: our reads of the chunk happen before the writer reuses it, and
  // (Dekker with space_waiter) the writer either sees this store or we see its announcement.
  slot_->read_seq.store(last_seq_, std::memory_order_seq_cst);
  // SYNC POINT: seq_cst; pairs with the seq_cst store of space_waiter in RingWriter::acquire.
  if (header_->space_waiter.load(std::memory_order_seq_cst) != 0) {
    bump_and_wake(&header_->space_word);
  }
}

}  // namespace vllm_shm_arena
