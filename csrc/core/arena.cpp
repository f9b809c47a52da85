#include "core/arena.h"

#include <algorithm>
#include <cstring>
#include <new>
#include <string>

#include <unistd.h>

#include "core/copy_pool.h"
#include "core/errors.h"

namespace vllm_shm_arena {

namespace {

using Clock = std::chrono::steady_clock;

uint64_t align_up(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

struct Offsets {
  uint64_t readers, slots, releases, releases_stride, forwards, data, data_bytes, total;
};

// Every product and sum below is bounded: n_readers <= 2^10, max_slots <= 2^20, entries of
// 16 B at most, data_bytes <= 2^44 (checked by every caller).
Offsets layout_for(uint32_t n_readers, uint32_t max_slots, uint64_t data_bytes, bool counted) {
  Offsets o;
  const uint64_t entry = counted ? sizeof(CountEntry) : sizeof(uint64_t);
  o.readers = kHeaderBytes;
  o.slots = align_up(o.readers + uint64_t{n_readers} * sizeof(ReaderEntry), kCacheLine);
  o.releases = align_up(o.slots + uint64_t{max_slots} * sizeof(SlotMeta), kCacheLine);
  o.releases_stride = align_up(uint64_t{max_slots} * entry, kCacheLine);
  o.forwards = o.releases + uint64_t{n_readers} * o.releases_stride;
  const uint64_t forwards_bytes = counted ? uint64_t{max_slots} * sizeof(CountEntry) : 0;
  o.data = align_up(o.forwards + forwards_bytes, kDataAlign);
  if (!counted) o.forwards = o.data;
  o.data_bytes = data_bytes;
  o.total = o.data + data_bytes;
  return o;
}

// Table addresses from the private, validated geometry: `rank` < n_readers and `slot` <
// max_slots (checked by every caller) keep them inside the mapping.
ReaderEntry* reader_entry(uint8_t* base, const ArenaGeometry& g, uint32_t rank) {
  return reinterpret_cast<ReaderEntry*>(base + g.readers_offset) + rank;
}
SlotMeta* slot_meta(uint8_t* base, const ArenaGeometry& g, uint32_t slot) {
  return reinterpret_cast<SlotMeta*>(base + g.slots_offset) + slot;
}
std::atomic<uint64_t>* released_gen(uint8_t* base, const ArenaGeometry& g, uint32_t rank,
                                    uint32_t slot) {
  return reinterpret_cast<std::atomic<uint64_t>*>(base + g.releases_offset +
                                                  uint64_t{rank} * g.releases_stride) +
         slot;
}
// Counted arenas: reader `rank`'s acked count of `slot`, and the slot's forwarded count.
CountEntry* acked_entry(uint8_t* base, const ArenaGeometry& g, uint32_t rank, uint32_t slot) {
  return reinterpret_cast<CountEntry*>(base + g.releases_offset +
                                       uint64_t{rank} * g.releases_stride) +
         slot;
}
CountEntry* forwarded_entry(uint8_t* base, const ArenaGeometry& g, uint32_t slot) {
  return reinterpret_cast<CountEntry*>(base + g.forwards_offset) + slot;
}

// A CountEntry's generation word while its one writer stores a new generation's count.
constexpr uint64_t kCountUpdating = ~uint64_t{0};

// What a CountEntry counts for generation `g` (arena_layout.h: the seqlock): its count; 0 when
// it holds another generation (its writer counted nothing of `g` yet); nullopt while its
// writer stores a new generation's count (or died doing so): cannot tell.
std::optional<uint64_t> count_for(const CountEntry* e, uint64_t g) {
  // SYNC POINT: acquire; pairs with the release store of the generation in store_count(): the
  // count stored before it is visible.
  const uint64_t g1 = e->generation.load(std::memory_order_acquire);
  if (g1 == kCountUpdating) return std::nullopt;
  if (g1 != g) return 0;
  // SYNC POINT: acquire; pairs with the release store of a same-generation count in
  // store_count(): what the entry's writer did before that store is visible.
  const uint64_t c = e->count.load(std::memory_order_acquire);
  // SYNC POINT: acquire fence; orders the count load before the re-check of the generation
  // (seqlock reader), pairing with the release fence in store_count().
  std::atomic_thread_fence(std::memory_order_acquire);
  // SYNC POINT: relaxed; ordered by the fence above.
  if (e->generation.load(std::memory_order_relaxed) != g) return std::nullopt;
  return c;
}

// The entry's own count for `g` as its one writer sees it (0 if it holds another generation).
uint64_t own_count(const CountEntry* e, uint64_t g) {
  // SYNC POINT: relaxed (both); the calling process is the entry's only writer.
  if (e->generation.load(std::memory_order_relaxed) != g) return 0;
  return e->count.load(std::memory_order_relaxed);
}

// Stores `count` as the entry's count for `g`; only the entry's one writer calls it.
void store_count(CountEntry* e, uint64_t g, uint64_t count) {
  // SYNC POINT: relaxed; the calling process is the entry's only writer.
  if (e->generation.load(std::memory_order_relaxed) == g) {
    // SYNC POINT: release; pairs with the acquire load of the count in count_for(): every
    // access to the slot's bytes before this store happens-before the writer recycles it.
    e->count.store(count, std::memory_order_release);
    return;
  }
  // A new generation, as a seqlock writer: mark, count, generation.
  // SYNC POINT: relaxed; ordered before the count by the release fence below.
  e->generation.store(kCountUpdating, std::memory_order_relaxed);
  // SYNC POINT: release fence; pairs with the acquire fence in count_for(): a reader that
  // loads the new count also sees the mark (or the new generation) on its re-check.
  std::atomic_thread_fence(std::memory_order_release);
  // SYNC POINT: relaxed; published by the release store of the generation below.
  e->count.store(count, std::memory_order_relaxed);
  // SYNC POINT: release; pairs with the acquire load of the generation in count_for().
  e->generation.store(g, std::memory_order_release);
}

// One slot's metadata, read once from shared memory and checked against the geometry:
// [offset, offset + capacity) lies in the data region and nbytes <= capacity. Overflow-safe:
// no sum is formed before its parts are bounded.
struct SlotCopy {
  uint64_t offset, capacity, nbytes, checksum;
};
bool read_slot(const uint8_t* base, const ArenaGeometry& g, uint32_t slot, SlotCopy* out) {
  const SlotMeta* m = reinterpret_cast<const SlotMeta*>(base + g.slots_offset) + slot;
  SlotCopy c{m->offset, m->capacity, m->nbytes, m->checksum};
  const uint64_t data_end = g.data_offset + g.data_bytes;  // == region_bytes (validated)
  if (c.offset < g.data_offset || c.offset > data_end || c.capacity > data_end - c.offset ||
      c.nbytes > c.capacity) {
    return false;
  }
  *out = c;
  return true;
}

pid_t this_pid() { return ::getpid(); }

void check_config(const ArenaConfig& cfg) {
  if (cfg.n_readers == 0 || cfg.n_readers > kMaxReaders) {
    throw InvalidArgument("n_readers must be in [1, " + std::to_string(kMaxReaders) + "], got " +
                          std::to_string(cfg.n_readers));
  }
  if (cfg.policy == PolicyKind::kVariable) {
    if (cfg.arena_bytes == 0 || cfg.arena_bytes > (1ull << 44)) {
      throw InvalidArgument("arena_bytes must be in [1, 2^44], got " +
                            std::to_string(cfg.arena_bytes));
    }
    if (cfg.max_slots == 0 || cfg.max_slots > kMaxSlots) {
      throw InvalidArgument("max_allocations must be in [1, " + std::to_string(kMaxSlots) +
                            "], got " + std::to_string(cfg.max_slots));
    }
    return;
  }
  if (cfg.policy != PolicyKind::kFixedSlots) {
    throw InvalidArgument("unknown allocation policy " +
                          std::to_string(static_cast<uint32_t>(cfg.policy)));
  }
  if (cfg.num_slots == 0 || cfg.num_slots > kMaxSlots) {
    throw InvalidArgument("num_slots must be in [1, " + std::to_string(kMaxSlots) + "], got " +
                          std::to_string(cfg.num_slots));
  }
  if (cfg.slot_bytes == 0 || cfg.slot_bytes > (1ull << 40)) {
    throw InvalidArgument("slot_bytes must be in [1, 2^40], got " + std::to_string(cfg.slot_bytes));
  }
}

// Slots and data bytes of a configuration.
std::pair<uint32_t, uint64_t> slots_and_data_bytes(const ArenaConfig& cfg) {
  if (cfg.policy == PolicyKind::kVariable) {
    return {cfg.max_slots, align_up(cfg.arena_bytes, kAllocAlign)};
  }
  uint64_t slot = align_up(cfg.slot_bytes, kAllocAlign);
  return {cfg.num_slots, slot * cfg.num_slots};
}

// Validates a header read from a segment someone else wrote and returns its geometry, read
// once. Every offset is checked against the real mapping size, with overflow-checked
// arithmetic, before anything is dereferenced through it.
ArenaGeometry validate_header(const ArenaHeader* h, uint64_t region_bytes,
                              const std::string& name) {
  auto bad = [&](const std::string& why) {
    return InvalidArgument("shared memory '" + name + "' is not a usable tensor arena: " + why);
  };
  // One plain copy of every field: later checks can't see a value changed under them.
  ArenaGeometry g;
  const uint64_t magic = h->magic;
  const uint32_t version = h->layout_version;
  const uint32_t policy = h->policy;
  g.region_bytes = h->region_bytes;
  g.n_readers = h->n_readers;
  g.max_slots = h->max_slots;
  g.readers_offset = h->readers_offset;
  g.slots_offset = h->slots_offset;
  g.releases_offset = h->releases_offset;
  g.releases_stride = h->releases_stride;
  g.data_offset = h->data_offset;
  g.data_bytes = h->data_bytes;
  g.slot_bytes = h->slot_bytes;
  const uint32_t counted = h->counted;
  const uint32_t reserved0 = h->reserved0;
  g.forwards_offset = h->forwards_offset;
  if (magic != kArenaMagic) throw bad("wrong magic number (a foreign or garbage segment)");
  if (version != kArenaLayoutVersion) {
    throw bad("layout version " + std::to_string(version) + ", this build reads " +
              std::to_string(kArenaLayoutVersion) + " (mixed package versions?)");
  }
  if (g.region_bytes != region_bytes) {
    throw bad("header says " + std::to_string(g.region_bytes) + " bytes but the segment has " +
              std::to_string(region_bytes) + " (truncated?)");
  }
  if (g.n_readers == 0 || g.n_readers > kMaxReaders || g.max_slots == 0 ||
      g.max_slots > kMaxSlots) {
    throw bad("reader or slot count out of range");
  }
  if (g.data_bytes == 0 || g.data_bytes > region_bytes) {
    throw bad("data region size out of range");
  }
  if (counted > 1 || reserved0 != 0) throw bad("unknown arena mode");
  g.counted = counted == 1;
  // n_readers and max_slots are bounded above, so the table sizes cannot overflow.
  Offsets o = layout_for(g.n_readers, g.max_slots, g.data_bytes, g.counted);
  if (g.readers_offset != o.readers || g.slots_offset != o.slots ||
      g.releases_offset != o.releases || g.releases_stride != o.releases_stride ||
      g.forwards_offset != o.forwards || g.data_offset != o.data || o.data > region_bytes ||
      g.data_bytes != region_bytes - o.data) {
    throw bad("table offsets do not match the sizes in the header");
  }
  if (policy == static_cast<uint32_t>(PolicyKind::kFixedSlots)) {
    g.policy = PolicyKind::kFixedSlots;
    if (g.slot_bytes == 0 || g.slot_bytes > g.data_bytes / g.max_slots ||
        g.slot_bytes * g.max_slots != g.data_bytes) {
      throw bad("slot size does not match the data region");
    }
  } else if (policy == static_cast<uint32_t>(PolicyKind::kVariable)) {
    g.policy = PolicyKind::kVariable;
    if (g.slot_bytes != 0 || g.data_bytes % kAllocAlign != 0) {
      throw bad("variable-size data region is malformed");
    }
  } else {
    throw bad("unknown allocation policy " + std::to_string(policy));
  }
  return g;
}

std::unique_ptr<AllocationPolicy> policy_for(const ArenaGeometry& g) {
  if (g.policy == PolicyKind::kVariable) {
    return std::make_unique<VariablePolicy>(g.max_slots, g.data_offset, g.data_bytes);
  }
  return std::make_unique<FixedSlotPolicy>(g.max_slots, g.slot_bytes, g.data_offset);
}

}  // namespace

uint64_t payload_checksum(const uint8_t* p, uint64_t n) {
  // Word-at-a-time multiply-xor: several GB/s, enough to notice any changed byte in debug runs.
  uint64_t h = 0x9E3779B97F4A7C15ull ^ n;
  uint64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t w;
    std::memcpy(&w, p + i, 8);
    h = (h ^ w) * 0x100000001B3ull;
    h ^= h >> 29;
  }
  for (; i < n; ++i) h = (h ^ p[i]) * 0x100000001B3ull;
  return h | 1;
}

uint64_t arena_region_bytes(const ArenaConfig& cfg) {
  check_config(cfg);
  auto [slots, data_bytes] = slots_and_data_bytes(cfg);
  return layout_for(cfg.n_readers, slots, data_bytes, cfg.counted).total;
}

// ---------------------------------------------------------------------------------------
// Writer

ArenaWriter::ArenaWriter(std::shared_ptr<ShmRegion> region, const ArenaGeometry& geo,
                         std::unique_ptr<LivenessToken> token)
    : region_(std::move(region)),
      geo_(geo),
      policy_(policy_for(geo)),
      token_(std::move(token)),
      owner_pid_(this_pid()) {
  uint32_t n = geo_.max_slots;
  placement_.resize(n);
  live_.resize(n);
  gen_.assign(n, 0);
  published_.assign(n, false);
  published_at_.resize(n);
  loan_hold_.assign(n, false);
  sent_.assign(n, 0);
  abandoned_.assign(n, false);
  send_holds_ = std::make_shared<SendHoldTable>(n);
  reserved_.assign((geo_.data_bytes + kDataAlign - 1) / kDataAlign, false);
  last_liveness_check_.resize(geo_.n_readers);
}

bool ArenaWriter::foreign() const { return this_pid() != owner_pid_; }

void ArenaWriter::require_owner(const char* what) const {
  if (foreign()) {
    throw InvalidArgument(std::string(what) + ": this arena writer belongs to pid " +
                          std::to_string(owner_pid_) + "; a forked child (pid " +
                          std::to_string(this_pid()) +
                          ") cannot use its parent's writer (create a new arena)");
  }
}

std::unique_ptr<ArenaWriter> ArenaWriter::create(const ArenaConfig& cfg) {
  check_config(cfg);
  auto [slots, data_bytes] = slots_and_data_bytes(cfg);
  Offsets o = layout_for(cfg.n_readers, slots, data_bytes, cfg.counted);
  std::unique_ptr<LivenessToken> token;
  ArenaGeometry geo;
  auto init = [&](ShmRegion& region) {
    // The writer's token first: from the moment the segment has its name (and a magic
    // number), its writer is provably alive.
    token = LivenessToken::take(region.path(), kWriterTokenByte, region.fd());
    // Reserve every byte of protocol metadata now, so no process ever faults an unbacked
    // page of the tables (SIGBUS on a full tmpfs); the data region is reserved block by
    // block before its first write.
    if (!region.reserve(0, o.data)) {
      throw ShmError("not enough shared memory in " + region.dir() + " for the arena's " +
                     std::to_string(o.data >> 10) +
                     " KiB of tables (the filesystem is full); free some space or enlarge it "
                     "(Docker: --shm-size; bare metal: mount -o remount,size=<N>G " +
                     region.dir() + ")");
    }
    // The tables are written before the name is handed to anyone, so plain stores suffice;
    // the atomics are constructed in place (the file is zero-filled, which is also their
    // zero value).
    auto* h = new (region.data()) ArenaHeader();
    h->layout_version = kArenaLayoutVersion;
    h->policy = static_cast<uint32_t>(cfg.policy);
    h->region_bytes = o.total;
    h->n_readers = cfg.n_readers;
    h->max_slots = slots;
    h->readers_offset = o.readers;
    h->slots_offset = o.slots;
    h->releases_offset = o.releases;
    h->releases_stride = o.releases_stride;
    h->data_offset = o.data;
    h->data_bytes = o.data_bytes;
    h->slot_bytes = cfg.policy == PolicyKind::kFixedSlots ? data_bytes / slots : 0;
    h->counted = cfg.counted ? 1 : 0;
    h->forwards_offset = o.forwards;
    // SYNC POINT: relaxed; only this process runs until the name is shared.
    h->writer_pid.store(static_cast<uint64_t>(this_pid()), std::memory_order_relaxed);
    // SYNC POINT: relaxed; information for a writer taking over after this one died (see
    // allocate_locked); the counter that decides is the writer's private next_generation_.
    h->next_generation.store(1, std::memory_order_relaxed);
    h->magic = kArenaMagic;  // last: a half-initialised header never validates
    geo = validate_header(h, region.size(), region.name());
  };
  auto region = ShmRegion::create(o.total, cfg.prefix, cfg.dir, init);
  return std::unique_ptr<ArenaWriter>(new ArenaWriter(std::move(region), geo, std::move(token)));
}

std::unique_ptr<ArenaWriter> ArenaWriter::attach(const std::string& name, const std::string& dir) {
  auto region = ShmRegion::attach(name, dir, kHeaderBytes);
  auto* h = reinterpret_cast<ArenaHeader*>(region->data());
  ArenaGeometry geo = validate_header(h, region->size(), name);
  if (geo.counted) {
    // The sends to reader 0 were counted in the dead writer's memory only.
    throw InvalidArgument("arena '" + name +
                          "' is a counted arena, whose writer cannot be taken over: create a "
                          "new arena");
  }
  std::unique_ptr<LivenessToken> token;
  try {
    token = LivenessToken::take(region->path(), kWriterTokenByte, region->fd());
  } catch (const TokenHeld&) {
    // SYNC POINT: relaxed; the pid is only quoted in the message.
    throw TokenHeld("arena '" + name + "' already has a live writer (pid " +
                    std::to_string(h->writer_pid.load(std::memory_order_relaxed)) +
                    "); an arena has exactly one writer");
  }
  // Generations continue above every one this arena may still show anywhere: the dead
  // writer's counter (read once; a hint only, any process could have rewritten it), every
  // published slot and every reader's release flag (an old flag equal to a new generation
  // would read as released at once). Values out of range are garbage and ignored. Decided
  // before this process claims anything, so a refused takeover leaves the arena as it was.
  uint8_t* base = region->data();
  // SYNC POINT: relaxed; the dead writer stored it relaxed and can store nothing more (we hold
  // its token); it only raises the lower bound.
  const uint64_t shared_next = h->next_generation.load(std::memory_order_relaxed);
  uint64_t highest = valid_generation(shared_next) ? shared_next - 1 : 0;
  for (uint32_t r = 0; r < geo.max_slots; ++r) {
    // SYNC POINT: relaxed; only the value is used, as a bound (the acquire load that pairs with
    // publish() is the one in the loop below).
    uint64_t g = slot_meta(base, geo, r)->published_gen.load(std::memory_order_relaxed);
    if (valid_generation(g)) highest = std::max(highest, g);
    for (uint32_t rank = 0; rank < geo.n_readers; ++rank) {
      // SYNC POINT: relaxed; only the value is used, as a bound. Live readers keep storing
      // generations the dead writer handed out, all at most the bound.
      uint64_t f = released_gen(base, geo, rank, r)->load(std::memory_order_relaxed);
      if (valid_generation(f)) highest = std::max(highest, f);
    }
  }
  if (highest >= kGenerationLimit - 1) {
    throw InvalidArgument("arena '" + name + "' has used up its generations (it shows generation " +
                          std::to_string(highest) + "; they stay below 2^44): create a new arena");
  }
  // SYNC POINT: release; pairs with nothing that decides anything (the pid is for messages);
  // the token taken above is what makes this process the writer.
  h->writer_pid.store(static_cast<uint64_t>(this_pid()), std::memory_order_release);
  std::unique_ptr<ArenaWriter> w(new ArenaWriter(region, geo, std::move(token)));
  w->next_generation_ = highest + 1;
  // SYNC POINT: relaxed; information for a later takeover (see allocate_locked).
  h->next_generation.store(w->next_generation_, std::memory_order_relaxed);
  // Rebuild the private bookkeeping: every published slot stays in use until its readers
  // let go, exactly as if this process had published it. A slot whose metadata does not fit
  // the geometry or collides with another, or whose generation is out of range, is skipped
  // (shared memory is untrusted input).
  for (uint32_t r = 0; r < geo.max_slots; ++r) {
    // SYNC POINT: acquire; pairs with the release store in the old writer's publish().
    uint64_t g = slot_meta(base, geo, r)->published_gen.load(std::memory_order_acquire);
    if (!valid_generation(g)) continue;
    SlotCopy c;
    if (!read_slot(base, geo, r, &c)) continue;
    Placement p{r, c.offset, c.capacity};
    if (!w->policy_->mark_used(p)) continue;
    w->placement_[r] = p;
    w->gen_[r] = g;
    w->published_[r] = true;
    w->published_at_[r] = Clock::now();
    w->in_use_.push_back(r);
  }
  return w;
}

ArenaWriter::~ArenaWriter() {
  // A forked child dropping its inherited copy must not remove its parent's name.
  if (!foreign()) region_->unlink();
}

void ArenaWriter::unlink() {
  if (!foreign()) region_->unlink();
}

uint64_t ArenaWriter::max_allocation() const { return policy_->max_allocation(); }

void ArenaWriter::count_decline(DeclineReason why) {
  std::lock_guard<std::mutex> lock(mu_);
  ++stats_.declined[static_cast<size_t>(why)];
}

std::optional<uint64_t> ArenaWriter::owed_by(uint32_t rank, uint32_t slot) const {
  if (rank == 0) return sent_[slot];
  // nullopt: reader 0 is storing its first forward now (or died doing so).
  return count_for(forwarded_entry(region_->data(), geo_, slot), gen_[slot]);
}

std::optional<uint64_t> ArenaWriter::acked_by(uint32_t rank, uint32_t slot, uint64_t gen) const {
  // The acquire loads in count_for pair with the release stores in store_count() (the
  // reader's acks): its last access to the bytes happens-before the writer reuses them.
  return count_for(acked_entry(region_->data(), geo_, rank, slot), gen);
}

bool ArenaWriter::reader_done(uint32_t rank, uint32_t slot, uint64_t gen,
                              std::optional<uint64_t> owed) const {
  if (!geo_.counted) {
    // SYNC POINT: acquire; pairs with the release store in ArenaReader::release(): the
    // reader's last access to the bytes happens-before the writer reuses them.
    return released_gen(region_->data(), geo_, rank, slot)->load(std::memory_order_acquire) == gen;
  }
  if (!owed) return false;
  const std::optional<uint64_t> acked = acked_by(rank, slot, gen);
  return acked && *acked == *owed;
}

bool ArenaWriter::reader_lets_go(uint32_t rank, uint32_t slot, uint64_t gen,
                                 std::optional<uint64_t> owed, bool check_liveness) {
  ReaderEntry* e = reader_entry(region_->data(), geo_, rank);
  // SYNC POINT: acquire; pairs with the release store of kDetached in ArenaReader::detach()
  // (everything the reader did before detaching happens-before we recycle).
  auto state = static_cast<ReaderState>(e->state.load(std::memory_order_acquire));
  if (state == ReaderState::kDetached || state == ReaderState::kDead) return true;
  if (reader_done(rank, slot, gen, owed)) return true;
  if (!check_liveness || state != ReaderState::kAttached) return false;
  auto now = Clock::now();
  if (now - last_liveness_check_[rank] < std::chrono::milliseconds(1)) return false;
  last_liveness_check_[rank] = now;
  // Through the mapping's descriptor: no file is opened, so running out of descriptors can't
  // turn into a "dead" verdict.
  Liveness v = probe_token(region_->fd(), reader_token_byte(rank));
  if (v == Liveness::kAlive) return false;
  if (v == Liveness::kUnknown) {
    ++stats_.liveness_unknown;  // cannot tell: alive
    return false;
  }
  uint32_t expected = static_cast<uint32_t>(ReaderState::kAttached);
  // SYNC POINT: acq_rel CAS; pairs with the release store of kDetached in detach() (a reader
  // that detached cleanly in the meantime stays detached) and with later acquire loads of
  // the state in this function. The dead process can no longer store anything: its token
  // was dropped by the kernel when its last descriptor closed, at exit.
  if (e->state.compare_exchange_strong(expected, static_cast<uint32_t>(ReaderState::kDead),
                                       std::memory_order_acq_rel)) {
    ++stats_.dead_readers;
  }
  return true;
}

size_t ArenaWriter::reclaim_locked(bool check_liveness) {
  size_t freed = 0;
  for (size_t i = 0; i < in_use_.size();) {
    uint32_t rec = in_use_[i];
    // SYNC POINT: acquire; pairs with the release decrement in ~SendHold: the last read of
    // the bytes by a send by reference happens-before the slot is recycled and rewritten.
    bool free = send_holds_->counts[rec].load(std::memory_order_acquire) == 0;
    // Given back unsent (abandoned_): no reader was ever told of it, so none needs to let go.
    if (free && !abandoned_[rec]) {
      free = published_[rec] && !loan_hold_[rec];
      // Counted: reader 0 first. Its acks pair with our acquire loads, and it stores every
      // forward before its ack, so once it let go the forwarded count read next is final.
      for (uint32_t r = 0; free && r < geo_.n_readers; ++r) {
        std::optional<uint64_t> owed;
        if (geo_.counted) owed = owed_by(r, rec);
        free = reader_lets_go(r, rec, gen_[rec], owed, check_liveness);
      }
    }
    if (!free) {
      ++i;
      continue;
    }
    in_use_[i] = in_use_.back();
    in_use_.pop_back();
    free_locked(rec);
    ++stats_.reclaimed;
    ++freed;
  }
  return freed;
}

size_t ArenaWriter::reclaim(bool check_liveness) {
  require_owner("reclaim");
  std::lock_guard<std::mutex> lock(mu_);
  return reclaim_locked(check_liveness);
}

void ArenaWriter::unpublish_locked(uint32_t rec) {
  // SYNC POINT: relaxed; the stub never left this process, so no reader can be looking.
  slot_meta(region_->data(), geo_, rec)->published_gen.store(0, std::memory_order_relaxed);
  published_[rec] = false;
}

void ArenaWriter::give_back_locked(uint32_t rec) {
  // SYNC POINT: relaxed; only whether to free now: reclaim's acquire load orders the reuse.
  if (send_holds_->counts[rec].load(std::memory_order_relaxed) != 0) {
    // A send by reference still reads the bytes (its socket took nothing, but the hold's
    // owner has not dropped it yet): unpublished now, freed by reclaim once the holds end.
    unpublish_locked(rec);
    abandoned_[rec] = true;
    return;
  }
  in_use_.erase(std::find(in_use_.begin(), in_use_.end(), rec));
  free_locked(rec);
}

void ArenaWriter::free_locked(uint32_t rec) {
  // SYNC POINT: relaxed; no reader can hold `rec` any more (all released or dead, or the
  // stub never left this process), and a reader that later validates a stale stub compares
  // against this 0 or a newer generation published with release.
  slot_meta(region_->data(), geo_, rec)->published_gen.store(0, std::memory_order_relaxed);
  gen_[rec] = 0;
  published_[rec] = false;
  sent_[rec] = 0;
  abandoned_[rec] = false;
  if (loan_hold_[rec]) {
    loan_hold_[rec] = false;
    loans_by_offset_.erase(placement_[rec].offset);
  }
  policy_->free(placement_[rec]);
}

bool ArenaWriter::reserve_blocks(uint64_t offset, uint64_t len, bool* cold) {
  // Pages are reserved in 2 MiB blocks of the data region, whatever the policy: a block is
  // fallocated once, before the first store into any byte of it.
  uint64_t data_off = geo_.data_offset;
  uint64_t first = (offset - data_off) / kDataAlign;
  uint64_t last = (offset + std::max<uint64_t>(len, 1) - 1 - data_off) / kDataAlign;
  *cold = false;
  for (uint64_t b = first; b <= last && b < reserved_.size(); ++b) {
    if (reserved_[b]) continue;
    uint64_t start = data_off + b * kDataAlign;
    uint64_t n = std::min<uint64_t>(kDataAlign, region_->size() - start);
    if (!region_->reserve(start, n)) return false;
    reserved_[b] = true;
    *cold = true;
  }
  return true;
}

std::optional<Allocation> ArenaWriter::allocate(uint64_t nbytes) {
  require_owner("allocate");
  std::lock_guard<std::mutex> lock(mu_);
  return allocate_locked(nbytes);
}

std::optional<Allocation> ArenaWriter::allocate_locked(uint64_t nbytes) {
  if (nbytes > policy_->max_allocation()) {
    ++stats_.declined[static_cast<size_t>(DeclineReason::kOversize)];
    return std::nullopt;
  }
  if (next_generation_ >= kGenerationLimit) {
    // Every generation a release token can carry is used up: no slot can be published again.
    ++stats_.declined[static_cast<size_t>(DeclineReason::kSlotTableFull)];
    return std::nullopt;
  }
  reclaim_locked(false);
  DeclineReason why = DeclineReason::kNoFreeSlot;
  std::optional<Placement> p = policy_->place(nbytes, &why);
  if (!p && why != DeclineReason::kOversize && reclaim_locked(true) > 0) {
    p = policy_->place(nbytes, &why);
  }
  if (!p) {
    ++stats_.declined[static_cast<size_t>(why)];
    return std::nullopt;
  }
  bool cold = false;
  if (!reserve_blocks(p->offset, p->capacity, &cold)) {
    policy_->free(*p);
    ++stats_.declined[static_cast<size_t>(DeclineReason::kNoSpace)];
    return std::nullopt;
  }
  // The counter is this process's own: a peer rewriting the shared copy cannot make a
  // generation repeat (reviving stale stubs) or jump out of range.
  uint64_t gen = next_generation_++;
  // SYNC POINT: relaxed; information only, for a writer taking over after this one died (it
  // reads it once, after taking the writer token, as a lower bound). Nothing reads it while
  // this writer lives, and this writer never reads it back.
  header()->next_generation.store(next_generation_, std::memory_order_relaxed);
  SlotMeta* m = slot_meta(region_->data(), geo_, p->slot);
  m->offset = p->offset;
  m->capacity = p->capacity;
  m->nbytes = nbytes;
  placement_[p->slot] = *p;
  gen_[p->slot] = gen;
  published_[p->slot] = false;
  in_use_.push_back(p->slot);
  live_[p->slot] = Allocation{p->slot, gen, region_->data() + p->offset, nbytes, cold};
  return live_[p->slot];
}

std::optional<Allocation> ArenaWriter::lend(uint64_t nbytes) {
  require_owner("lend");
  std::lock_guard<std::mutex> lock(mu_);
  std::optional<Allocation> a = allocate_locked(nbytes);
  if (!a) return a;
  loan_hold_[a->slot] = true;
  loans_by_offset_[placement_[a->slot].offset] = a->slot;
  ++stats_.loans;
  return a;
}

std::optional<LoanRef> ArenaWriter::find_loan(const void* p, uint64_t n) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (loans_by_offset_.empty()) return std::nullopt;
  const uint8_t* base = region_->data();
  const uint8_t* q = static_cast<const uint8_t*>(p);
  if (q < base || q >= base + region_->size()) return std::nullopt;
  uint64_t off = static_cast<uint64_t>(q - base);
  auto it = loans_by_offset_.upper_bound(off);
  if (it == loans_by_offset_.begin()) return std::nullopt;
  --it;
  uint32_t rec = it->second;
  const Allocation& a = live_[rec];
  if (off - it->first > a.nbytes || n > a.nbytes - (off - it->first)) return std::nullopt;
  return LoanRef{rec, a.generation, off - it->first, published_[rec]};
}

bool ArenaWriter::publish_loan(uint32_t slot, uint64_t generation) {
  require_owner("publish_loan");
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (slot >= gen_.size() || gen_[slot] != generation || !loan_hold_[slot]) {
      throw InvalidArgument("publish_loan: slot " + std::to_string(slot) + " generation " +
                            std::to_string(generation) + " is not a live loan");
    }
    if (published_[slot]) {
      if (!geo_.counted) return false;
      // Counted: one more send of the same bytes to reader 0.
      ++sent_[slot];
      ++stats_.sends;
      ++stats_.loans_sent;
      return true;
    }
    ++stats_.loans_sent;
  }
  publish(live_[slot]);
  return true;
}

void ArenaWriter::unsend(uint32_t slot, uint64_t generation) {
  require_owner("unsend");
  std::lock_guard<std::mutex> lock(mu_);
  if (!geo_.counted) throw InvalidArgument("unsend: arena '" + name() + "' is not counted");
  if (slot >= gen_.size() || gen_[slot] != generation || !published_[slot] || sent_[slot] == 0) {
    throw InvalidArgument("unsend: allocation (slot " + std::to_string(slot) + ", generation " +
                          std::to_string(generation) + ") has no send to take back");
  }
  take_back_send_locked(slot);
  if (loan_hold_[slot]) --stats_.loans_sent;
}

void ArenaWriter::take_back_send_locked(uint32_t rec) {
  --sent_[rec];
  --stats_.sends;
  ++stats_.unsends;
}

void ArenaWriter::end_loan(uint32_t slot, uint64_t generation) {
  if (foreign()) return;  // a forked child's copy of a loan died: the loan is its parent's
  std::lock_guard<std::mutex> lock(mu_);
  if (slot >= gen_.size() || gen_[slot] != generation || !loan_hold_[slot]) return;
  loan_hold_[slot] = false;
  loans_by_offset_.erase(placement_[slot].offset);
  if (!published_[slot]) {
    // Never sent: nobody else can know of it. Give the space back at once, or once the send
    // holds of an aborted send end.
    ++stats_.loans_returned;
    give_back_locked(slot);
  }
}

void ArenaWriter::publish(const Allocation& a) {
  require_owner("publish");
  std::lock_guard<std::mutex> lock(mu_);
  if (a.slot >= gen_.size() || gen_[a.slot] != a.generation || published_[a.slot]) {
    throw InvalidArgument("publish: allocation (slot " + std::to_string(a.slot) + ", generation " +
                          std::to_string(a.generation) +
                          ") is not a pending allocation of this writer");
  }
  SlotMeta* m = slot_meta(region_->data(), geo_, a.slot);
  m->checksum =
      debug_checksum_ ? payload_checksum(region_->data() + placement_[a.slot].offset, a.nbytes) : 0;
  // Clear every reader's flag for this slot? Not needed: flags hold generations, and
  // generations never repeat, so an old flag can't match `a.generation`.
  // SYNC POINT: release; pairs with the acquire load of published_gen in
  // ArenaReader::acquire(): the payload bytes and offset/nbytes written before this store are
  // visible to a reader that sees the generation.
  m->published_gen.store(a.generation, std::memory_order_release);
  published_[a.slot] = true;
  if (geo_.counted) {
    sent_[a.slot] = 1;  // publishing is the first send to reader 0
    ++stats_.sends;
  }
  published_at_[a.slot] = Clock::now();
  ++stats_.hits;
  stats_.bytes += a.nbytes;
  if (a.cold) {
    ++stats_.cold_copies;
    stats_.cold_bytes += a.nbytes;
  } else {
    ++stats_.warm_copies;
    stats_.warm_bytes += a.nbytes;
  }
}

void ArenaWriter::abort(const Allocation& stub) {
  if (foreign()) return;  // a cleanup path; nothing of a forked child's is in the arena
  std::lock_guard<std::mutex> lock(mu_);
  if (stub.slot >= gen_.size() || gen_[stub.slot] != stub.generation) return;  // recycled
  if (abandoned_[stub.slot]) return;  // given back already, waiting for its send holds
  // Counters come from what allocate() handed out, not from the caller's copy.
  const Allocation& a = live_[stub.slot];
  const bool was_published = published_[a.slot];
  if (geo_.counted && was_published) {
    if (sent_[a.slot] > 0) {
      take_back_send_locked(a.slot);
      if (loan_hold_[a.slot]) --stats_.loans_sent;
      // Sent before: only this send is taken back; reader 0 still owes the earlier ones.
      if (sent_[a.slot] > 0) return;
    }
    // Every send taken back (the loan counter with each): the publish is undone below.
  }
  if (was_published) {
    // Undo the publish counters: the allocation never reached anyone.
    --stats_.hits;
    stats_.bytes -= a.nbytes;
    if (a.cold) {
      --stats_.cold_copies;
      stats_.cold_bytes -= a.nbytes;
    } else {
      --stats_.warm_copies;
      stats_.warm_bytes -= a.nbytes;
    }
  }
  if (loan_hold_[a.slot]) {
    // Given back already (a caller may give one back twice: the queue's settle after the
    // pickler's own cleanup): nothing left to undo.
    if (!was_published) return;
    // An aborted send of a loan: the writer still holds its view; unpublish, keep the loan.
    unpublish_locked(a.slot);
    if (!geo_.counted) --stats_.loans_sent;  // counted: taken back with its sends above
    ++stats_.aborted;
    return;
  }
  ++stats_.aborted;
  give_back_locked(a.slot);
}

SendHold::~SendHold() {
  // SYNC POINT: release; pairs with the acquire load in ArenaWriter::reclaim_locked(): every
  // read of the bytes through this hold happens-before the slot is recycled.
  table_->counts[slot_].fetch_sub(1, std::memory_order_release);
}

std::shared_ptr<SendHold> ArenaWriter::hold_for_send(uint32_t slot, uint64_t generation) {
  require_owner("hold_for_send");
  std::lock_guard<std::mutex> lock(mu_);
  if (slot >= gen_.size() || gen_[slot] != generation || !published_[slot]) {
    throw InvalidArgument("hold_for_send: allocation (slot " + std::to_string(slot) +
                          ", generation " + std::to_string(generation) +
                          ") is not published by this writer");
  }
  const Allocation& a = live_[slot];
  // SYNC POINT: relaxed; made under mu_, which reclaim holds while it reads the count, so
  // no recycle can fall between the check above and this increment.
  send_holds_->counts[slot].fetch_add(1, std::memory_order_relaxed);
  try {
    return std::make_shared<SendHold>(send_holds_, region_, slot, a.data, a.nbytes);
  } catch (...) {
    // SYNC POINT: relaxed; undoes the increment above under the same mutex.
    send_holds_->counts[slot].fetch_sub(1, std::memory_order_relaxed);
    throw;
  }
}

std::optional<Allocation> ArenaWriter::write(const void* src, uint64_t nbytes,
                                             uint64_t working_set) {
  std::optional<Allocation> a = allocate(nbytes);
  if (!a) return a;
  if (nbytes > 0) parallel_copy(a->data, src, nbytes, CopyTarget::kShared, working_set);
  publish(*a);
  return a;
}

WriterStats ArenaWriter::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  WriterStats s = stats_;
  s.in_use = static_cast<uint32_t>(in_use_.size());
  if (auto* v = dynamic_cast<const VariablePolicy*>(policy_.get())) {
    s.free_bytes = v->free_bytes();
    s.largest_free = v->largest_free_extent();
  }
  return s;
}

namespace {
// Reader `rank`'s state in the arena at `base` (OutOfRange past n_readers).
ReaderState load_reader_state(uint8_t* base, const ArenaGeometry& geo, uint32_t rank) {
  if (rank >= geo.n_readers) {
    throw OutOfRange("reader rank " + std::to_string(rank) + " out of range [0, " +
                     std::to_string(geo.n_readers) + ")");
  }
  // SYNC POINT: acquire; pairs with the release stores of the state in ArenaReader::attach()
  // and detach(): a caller that sees ATTACHED sees the attach's stores before it.
  return static_cast<ReaderState>(
      reader_entry(base, geo, rank)->state.load(std::memory_order_acquire) & 3u);
}
}  // namespace

ReaderState ArenaWriter::reader_state(uint32_t rank) const {
  return load_reader_state(region_->data(), geo_, rank);
}

ReaderState ArenaReader::reader_state(uint32_t rank) const {
  return load_reader_state(region_->data(), geo_, rank);
}

std::vector<ReaderHolding> ArenaWriter::holdings() const {
  std::lock_guard<std::mutex> lock(mu_);
  uint8_t* base = region_->data();
  auto now = Clock::now();
  std::vector<ReaderHolding> out(geo_.n_readers);
  for (uint32_t r = 0; r < geo_.n_readers; ++r) {
    out[r].rank = r;
    // SYNC POINT: relaxed; a monitoring snapshot, nothing is recycled based on it.
    out[r].state = static_cast<ReaderState>(
        reader_entry(base, geo_, r)->state.load(std::memory_order_relaxed) & 3u);
    if (out[r].state == ReaderState::kDetached || out[r].state == ReaderState::kDead) continue;
    for (uint32_t rec : in_use_) {
      if (!published_[rec]) continue;
      std::optional<uint64_t> owed;
      if (geo_.counted) {
        owed = owed_by(r, rec);
        const uint64_t acked = acked_by(r, rec, gen_[rec]).value_or(0);
        if (owed) out[r].owed += *owed > acked ? *owed - acked : 0;
      }
      if (reader_done(r, rec, gen_[rec], owed)) continue;
      ++out[r].slots_held;
      double age = std::chrono::duration<double>(now - published_at_[rec]).count();
      out[r].oldest_age_seconds = std::max(out[r].oldest_age_seconds, age);
    }
  }
  return out;
}

// ---------------------------------------------------------------------------------------
// Reader

ArenaReader::ArenaReader(std::shared_ptr<ShmRegion> region, const ArenaGeometry& geo, uint32_t rank,
                         std::unique_ptr<LivenessToken> token)
    : region_(std::move(region)),
      geo_(geo),
      rank_(rank),
      token_(std::move(token)),
      owner_pid_(this_pid()) {}

bool ArenaReader::foreign() const { return this_pid() != owner_pid_; }

std::shared_ptr<ArenaReader> ArenaReader::attach(
    const std::string& name, uint32_t rank, const std::string& dir,
    const std::function<void(const ArenaGeometry&)>& check) {
  auto region = ShmRegion::attach(name, dir, kHeaderBytes);
  auto* h = reinterpret_cast<ArenaHeader*>(region->data());
  ArenaGeometry geo = validate_header(h, region->size(), name);
  if (check) check(geo);
  if (rank >= geo.n_readers) {
    throw OutOfRange("reader_rank " + std::to_string(rank) + " out of range [0, " +
                     std::to_string(geo.n_readers) + ") for arena '" + name + "'");
  }
  uint8_t* base = region->data();
  ReaderEntry* e = reader_entry(base, geo, rank);
  // The rank's token decides who holds the rank: taking it fails while any live process (or
  // another object of this one) holds it, and succeeds once the holder is gone.
  std::unique_ptr<LivenessToken> token;
  try {
    token = LivenessToken::take(region->path(), reader_token_byte(rank), region->fd());
  } catch (const TokenHeld&) {
    // SYNC POINT: relaxed; the pid is only quoted in the message.
    throw TokenHeld("reader rank " + std::to_string(rank) + " of arena '" + name +
                    "' is already attached by a live process (pid " +
                    std::to_string(e->pid.load(std::memory_order_relaxed)) + ")");
  }
  // SYNC POINT: acquire; pairs with the release stores of the state in detach() and the
  // writer's DEAD CAS: an earlier holder of this rank is gone (we hold its token now).
  auto prev = static_cast<ReaderState>(e->state.load(std::memory_order_acquire));
  if (prev != ReaderState::kNeverAttached && geo.counted) {
    // What the earlier holder owed (acquires it never acked) is unknown to a newcomer.
    throw InvalidArgument("reader rank " + std::to_string(rank) + " of counted arena '" + name +
                          "' was attached before; the ranks of a counted arena attach once");
  }
  if (prev != ReaderState::kNeverAttached) {
    // A replacement reader starts with nothing held: mark every slot published so far as
    // released by this rank, so the writer does not wait for messages the old process took
    // with it.
    for (uint32_t r = 0; r < geo.max_slots; ++r) {
      // SYNC POINT: acquire; pairs with the release store in ArenaWriter::publish().
      uint64_t g = slot_meta(base, geo, r)->published_gen.load(std::memory_order_acquire);
      // SYNC POINT: release; pairs with the writer's acquire load in reader_lets_go().
      if (valid_generation(g))
        released_gen(base, geo, rank, r)->store(g, std::memory_order_release);
    }
  }
  // SYNC POINT: relaxed; the pid is for messages, ordered before the state store below.
  e->pid.store(static_cast<uint64_t>(this_pid()), std::memory_order_relaxed);
  // SYNC POINT: release; pairs with the writer's acquire load of the state in
  // reader_lets_go(): the releases stored above are visible before it sees ATTACHED.
  e->state.store(static_cast<uint32_t>(ReaderState::kAttached), std::memory_order_release);
  return std::shared_ptr<ArenaReader>(
      new ArenaReader(std::move(region), geo, rank, std::move(token)));
}

ArenaReader::~ArenaReader() { detach(); }

uint64_t ArenaReader::max_allocation() const {
  return variable() ? geo_.data_bytes : geo_.slot_bytes;
}

Liveness ArenaReader::writer_liveness() const {
  return probe_token(region_->fd(), kWriterTokenByte);
}

uint64_t ArenaReader::published_generation(uint32_t slot) const {
  if (slot >= geo_.max_slots) {
    throw OutOfRange("slot " + std::to_string(slot) + " out of range [0, " +
                     std::to_string(geo_.max_slots) + ")");
  }
  // SYNC POINT: acquire; pairs with the release store in ArenaWriter::publish().
  uint64_t g =
      slot_meta(region_->data(), geo_, slot)->published_gen.load(std::memory_order_acquire);
  return valid_generation(g) ? g : 0;  // out of range: garbage, never a publication
}

const uint8_t* ArenaReader::acquire(uint32_t slot, uint64_t generation, uint64_t nbytes,
                                    uint64_t offset, uint64_t stubs) {
  if (slot >= geo_.max_slots) {
    throw OutOfRange("slot " + std::to_string(slot) + " out of range [0, " +
                     std::to_string(geo_.max_slots) + ") in arena '" + name() + "'");
  }
  if (foreign()) {
    throw InvalidArgument("arena '" + name() + "' reader rank " + std::to_string(rank_) +
                          " belongs to pid " + std::to_string(owner_pid_) +
                          "; a forked child cannot read through its parent's reader");
  }
  if (!valid_generation(generation)) {
    throw InvalidArgument("generation " + std::to_string(generation) + " for slot " +
                          std::to_string(slot) + " is out of range [1, 2^44)");
  }
  uint8_t* base = region_->data();
  std::lock_guard<std::mutex> lock(mu_);
  if (detached_) throw InvalidArgument("arena '" + name() + "' reader is closed");
  auto it = holds_.find(slot);
  if (it != holds_.end()) {
    // Already held by this process: the writer can't have recycled it (accept-once: this
    // reader has not released it; counted: the acquires it holds are not acked yet).
    if (it->second.generation != generation) {
      throw InvalidArgument("stale stub for slot " + std::to_string(slot) + ": generation " +
                            std::to_string(generation) + ", slot holds generation " +
                            std::to_string(it->second.generation));
    }
  } else {
    if (geo_.counted && stubs == 0) {
      // A view that counts no stub is safe only under a hold that counted one: nothing else
      // keeps the writer from recycling the slot.
      throw InvalidArgument("slot " + std::to_string(slot) + " generation " +
                            std::to_string(generation) +
                            " is not held: a counted arena's first acquire must count its stub");
    }
    SlotMeta* m = slot_meta(base, geo_, slot);
    // SYNC POINT: acquire; pairs with the release store in ArenaWriter::publish(), making the
    // payload and the slot's offset / capacity / nbytes visible.
    uint64_t g = m->published_gen.load(std::memory_order_acquire);
    if (g != generation || generation == 0) {
      throw InvalidArgument("stale stub for slot " + std::to_string(slot) + ": generation " +
                            std::to_string(generation) + ", slot holds generation " +
                            std::to_string(g) + " (already recycled or never published)");
    }
    // SYNC POINT: relaxed; this reader is the only writer of its own flag. (Counted arenas
    // take a stub any number of times: each one sent is owed until acked.)
    if (!geo_.counted &&
        released_gen(base, geo_, rank_, slot)->load(std::memory_order_relaxed) == generation) {
      throw InvalidArgument("slot " + std::to_string(slot) + " generation " +
                            std::to_string(generation) + " was already released by reader " +
                            std::to_string(rank_));
    }
    // Read once, validate the copy, and keep using only the copy for as long as it is held.
    SlotCopy c;
    if (!read_slot(base, geo_, slot, &c)) {
      throw InvalidArgument("slot " + std::to_string(slot) + " metadata is corrupt");
    }
    it = holds_.emplace(slot, Hold{generation, 0, c.offset, c.nbytes, c.checksum, 0}).first;
    holds_by_offset_[c.offset] = slot;
  }
  const Hold& hold = it->second;
  const bool fits = offset <= hold.nbytes && nbytes <= hold.nbytes - offset;
  if (!fits || hold.stubs > UINT64_MAX - stubs) {
    const uint64_t written = hold.nbytes;
    if (it->second.count == 0) {
      holds_by_offset_.erase(hold.offset);
      holds_.erase(it);
    }
    if (fits) throw InvalidArgument("slot " + std::to_string(slot) + ": stub count overflow");
    throw InvalidArgument("nbytes " + std::to_string(nbytes) + " at offset " +
                          std::to_string(offset) + " does not fit the " + std::to_string(written) +
                          " bytes written to slot " + std::to_string(slot));
  }
  ++it->second.count;
  it->second.stubs += stubs;
  return base + hold.offset + offset;
}

void ArenaReader::release(uint32_t slot, uint64_t generation) {
  // A forked child dropping its inherited copy of a tensor: the hold is its parent's.
  if (foreign()) return;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = holds_.find(slot);
  if (it == holds_.end() || it->second.generation != generation) return;
  if (--it->second.count > 0) return;
  Hold hold = it->second;
  holds_.erase(it);
  holds_by_offset_.erase(hold.offset);
  if (hold.checksum != 0 &&
      payload_checksum(region_->data() + hold.offset, hold.nbytes) != hold.checksum) {
    mismatches_.fetch_add(1, std::memory_order_relaxed);
  }
  if (geo_.counted) {
    // Every stub this hold stood for acked at once (store_count's release store pairs with
    // the writer's acquire loads in reader_done()).
    CountEntry* e = acked_entry(region_->data(), geo_, rank_, slot);
    store_count(e, generation, own_count(e, generation) + hold.stubs);
    acked_.fetch_add(hold.stubs, std::memory_order_relaxed);
    return;
  }
  // SYNC POINT: release; pairs with the writer's acquire load in reader_done(): every read of
  // the slot by this process happens-before the writer recycles it.
  released_gen(region_->data(), geo_, rank_, slot)->store(generation, std::memory_order_release);
}

void ArenaReader::release_unacquired(uint32_t slot, uint64_t generation) {
  if (slot >= geo_.max_slots || !valid_generation(generation) || foreign()) return;
  uint8_t* base = region_->data();
  std::lock_guard<std::mutex> lock(mu_);
  // Accept-once: acquired after all, release() will handle it. Counted: the holds' acquires
  // are acked by release(); this stub is one more, acked now.
  if (!geo_.counted && holds_.count(slot) != 0) return;
  // SYNC POINT: acquire; pairs with the release store in ArenaWriter::publish().
  if (slot_meta(base, geo_, slot)->published_gen.load(std::memory_order_acquire) != generation) {
    return;
  }
  if (geo_.counted) {
    CountEntry* e = acked_entry(base, geo_, rank_, slot);
    store_count(e, generation, own_count(e, generation) + 1);  // release: see store_count
    acked_.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  // SYNC POINT: release; pairs with the writer's acquire load in reader_done().
  released_gen(base, geo_, rank_, slot)->store(generation, std::memory_order_release);
}

void ArenaReader::require_forwarder(const char* what, uint32_t slot, uint64_t generation) const {
  if (!geo_.counted || rank_ != 0) {
    throw InvalidArgument(std::string(what) + ": only reader 0 of a counted arena forwards");
  }
  if (foreign()) {
    throw InvalidArgument(std::string(what) + ": a forked child cannot forward its parent's holds");
  }
  if (detached_) throw InvalidArgument(std::string(what) + ": the reader is closed");
  auto it = holds_.find(slot);
  if (it == holds_.end() || it->second.generation != generation) {
    throw InvalidArgument(std::string(what) + ": slot " + std::to_string(slot) + " generation " +
                          std::to_string(generation) + " is not held by this reader");
  }
}

void ArenaReader::forward(uint32_t slot, uint64_t generation) {
  std::lock_guard<std::mutex> lock(mu_);
  require_forwarder("forward", slot, generation);
  CountEntry* e = forwarded_entry(region_->data(), geo_, slot);
  const uint64_t n = own_count(e, generation);
  if (n == UINT64_MAX)
    throw InvalidArgument("forward: the count of slot " + std::to_string(slot) + " would overflow");
  // Stored while this reader holds the slot, before its ack (release): the writer reads it
  // only after seeing that ack (reader 0 first, in reclaim).
  store_count(e, generation, n + 1);
}

void ArenaReader::unforward(uint32_t slot, uint64_t generation) {
  std::lock_guard<std::mutex> lock(mu_);
  require_forwarder("unforward", slot, generation);
  CountEntry* e = forwarded_entry(region_->data(), geo_, slot);
  const uint64_t n = own_count(e, generation);
  if (n == 0) {
    throw InvalidArgument("unforward: slot " + std::to_string(slot) + " generation " +
                          std::to_string(generation) + " has no forward to take back");
  }
  store_count(e, generation, n - 1);
}

std::optional<HoldRef> ArenaReader::find_hold(const void* p, uint64_t n) const {
  const uint8_t* base = region_->data();
  const uint8_t* q = static_cast<const uint8_t*>(p);
  if (q < base || q >= base + region_->size()) return std::nullopt;
  const uint64_t off = static_cast<uint64_t>(q - base);
  std::lock_guard<std::mutex> lock(mu_);
  auto it = holds_by_offset_.upper_bound(off);
  if (it == holds_by_offset_.begin()) return std::nullopt;
  --it;
  const Hold& h = holds_.at(it->second);
  const uint64_t within = off - it->first;
  if (within > h.nbytes || n > h.nbytes - within) return std::nullopt;
  return HoldRef{it->second, h.generation, within, h.nbytes};
}

size_t ArenaReader::held() const {
  std::lock_guard<std::mutex> lock(mu_);
  return holds_.size();
}

void ArenaReader::detach() {
  // A forked child must not detach its parent's rank (nor close the token: the fork handler
  // already closed the child's copy of its descriptor).
  if (foreign()) return;
  std::lock_guard<std::mutex> lock(mu_);
  if (detached_) return;
  detached_ = true;
  ReaderEntry* e = reader_entry(region_->data(), geo_, rank_);
  // SYNC POINT: release; pairs with the writer's acquire load of the state in
  // reader_lets_go(): our last reads of any slot happen-before it recycles them. We hold the
  // rank's token, so no replacement reader can own the rank while we store this.
  e->state.store(static_cast<uint32_t>(ReaderState::kDetached), std::memory_order_release);
  token_.reset();  // the rank is free for a replacement
}

}  // namespace vllm_shm_arena
