// Tests of counted arenas (arena_layout.h): a payload sent to reader 0 many times and
// forwarded by it to the other readers is freed exactly when every send and every forward is
// acked, whoever lets go in whatever order; the rules that keep the counts honest; and
// randomized threaded and multi-process runs that check every byte a reader sees.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <deque>
#include <mutex>
#include <optional>
#include <random>
#include <thread>
#include <vector>

#include "catch_compat.hpp"
#include "core/arena.h"
#include "core/errors.h"
#include "test_util.hpp"

using namespace vllm_shm_arena;
using vsa_test::checksum;
using vsa_test::fill_pattern;

namespace {

ArenaConfig counted_config(uint32_t n_readers, uint32_t max_slots = 8,
                           uint64_t bytes = 8ull << 20) {
  ArenaConfig cfg;
  cfg.policy = PolicyKind::kVariable;
  cfg.counted = true;
  cfg.n_readers = n_readers;
  cfg.arena_bytes = bytes;
  cfg.max_slots = max_slots;
  return cfg;
}

// A loan of `n` bytes filled with pattern `seed`.
Allocation filled_loan(ArenaWriter& w, uint64_t n, uint64_t seed) {
  std::optional<Allocation> a = w.lend(n);
  REQUIRE(a.has_value());
  fill_pattern(a->data, n, seed);
  return *a;
}

// A loan of `n` bytes filled with pattern `seed`, sent `sends` times to reader 0, whose
// writer-side view is then dropped (only the readers hold it).
Allocation sent_loan(ArenaWriter& w, uint64_t n, uint64_t seed, int sends) {
  Allocation a = filled_loan(w, n, seed);
  for (int i = 0; i < sends; ++i) REQUIRE(w.publish_loan(a.slot, a.generation));
  w.end_loan(a.slot, a.generation);
  return a;
}

bool freed(ArenaWriter& w) {
  w.reclaim(false);
  return w.stats().in_use == 0;
}

// Reader `rank`'s acked entry of `slot` (what a peer process could scribble on).
CountEntry* acked_entry_of(ArenaWriter& w, uint32_t rank, uint32_t slot) {
  const ArenaGeometry& g = w.geometry();
  return reinterpret_cast<CountEntry*>(w.region()->data() + g.releases_offset +
                                       uint64_t{rank} * g.releases_stride) +
         slot;
}

}  // namespace

TEST_CASE("counted arena: freed once every send and every forward is acked, in any order",
          "[arena][counted]") {
  // Orders in which the last three holders let go: the writer's loan view, reader 0, a worker.
  const int orders[][3] = {{0, 1, 2}, {0, 2, 1}, {1, 0, 2}, {1, 2, 0}, {2, 0, 1}, {2, 1, 0}};
  for (const auto& order : orders) {
    DYNAMIC_SECTION("order " << order[0] << order[1] << order[2]) {
      auto w = ArenaWriter::create(counted_config(3));
      auto r0 = ArenaReader::attach(w->name(), 0);
      auto r1 = ArenaReader::attach(w->name(), 1);
      auto r2 = ArenaReader::attach(w->name(), 2);
      w->unlink();
      const uint64_t n = 100000;
      Allocation a = filled_loan(*w, n, 7);
      const uint64_t sum = checksum(a.data, n);
      // Three sends (a cached item used by three requests), each acquired by reader 0.
      for (int i = 0; i < 3; ++i) {
        REQUIRE(w->publish_loan(a.slot, a.generation));
        const uint8_t* p = r0->acquire(a.slot, a.generation, n);
        CHECK(checksum(p, n) == sum);
      }
      CHECK(w->stats().sends == 3);
      // Reader 0 forwards twice; each worker acquires each forward.
      r0->forward(a.slot, a.generation);
      r0->forward(a.slot, a.generation);
      for (auto* r : {r1.get(), r2.get()}) {
        for (int i = 0; i < 2; ++i) CHECK(checksum(r->acquire(a.slot, a.generation, n), n) == sum);
      }
      // Worker 1 lets go of everything early; reader 0 drops two of its three acquires.
      r1->release(a.slot, a.generation);
      r1->release(a.slot, a.generation);
      r0->release(a.slot, a.generation);
      r0->release(a.slot, a.generation);
      CHECK_FALSE(freed(*w));
      auto holdings = w->holdings();
      CHECK(holdings[0].slots_held == 1);
      CHECK(holdings[0].owed == 3);  // reader 0's hold acks its three acquires together
      CHECK(holdings[1].slots_held == 0);
      CHECK(holdings[2].owed == 2);
      for (int step : order) {
        CHECK_FALSE(freed(*w));
        if (step == 0) w->end_loan(a.slot, a.generation);
        if (step == 1) r0->release(a.slot, a.generation);
        if (step == 2) {
          r2->release(a.slot, a.generation);
          r2->release(a.slot, a.generation);
        }
      }
      CHECK(freed(*w));
      CHECK(w->stats().reclaimed == 1);
      // Each reader's own count of what it acked: its sends or forwards, once each.
      CHECK(r0->acked() == 3);
      CHECK(r1->acked() == 2);
      CHECK(r2->acked() == 2);
      // The slot is reusable, and the old stub is stale everywhere.
      CHECK_THROWS_AS(r0->acquire(a.slot, a.generation, n), InvalidArgument);
      Allocation b = filled_loan(*w, n, 8);
      CHECK(b.generation != a.generation);
      w->end_loan(b.slot, b.generation);
      CHECK(freed(*w));
    }
  }
}

TEST_CASE("counted arena: a send or a forward made while a reader acks holds the slot",
          "[arena][counted]") {
  auto w = ArenaWriter::create(counted_config(2));
  auto r0 = ArenaReader::attach(w->name(), 0);
  auto r1 = ArenaReader::attach(w->name(), 1);
  w->unlink();
  Allocation a = sent_loan(*w, 4096, 1, 2);
  r0->acquire(a.slot, a.generation, 4096);
  r0->forward(a.slot, a.generation);
  r1->acquire(a.slot, a.generation, 4096);
  r1->release(a.slot, a.generation);  // the worker acked everything forwarded so far
  CHECK(w->holdings()[1].owed == 0);
  // Reader 0 takes the second send while its first hold lives and forwards it: the worker
  // owes again, though it had acked everything a moment ago.
  r0->acquire(a.slot, a.generation, 4096);
  r0->forward(a.slot, a.generation);
  r0->release(a.slot, a.generation);
  CHECK_FALSE(freed(*w));  // reader 0 still holds one acquire
  r0->release(a.slot, a.generation);
  CHECK(w->holdings()[0].owed == 0);
  CHECK(w->holdings()[1].owed == 1);
  CHECK_FALSE(freed(*w));  // the second forward is owed
  r1->acquire(a.slot, a.generation, 4096);
  r1->release(a.slot, a.generation);
  CHECK(freed(*w));
}

TEST_CASE(
    "counted arena: a worker that never attached owes every forward; detached or dead "
    "ones owe nothing",
    "[arena][counted][faults]") {
  auto w = ArenaWriter::create(counted_config(3));
  auto r0 = ArenaReader::attach(w->name(), 0);
  auto r1 = ArenaReader::attach(w->name(), 1);
  // Rank 2 never attaches (its messages may be queued for it).
  Allocation a = sent_loan(*w, 4096, 2, 1);
  r0->acquire(a.slot, a.generation, 4096);
  r0->forward(a.slot, a.generation);
  r0->release(a.slot, a.generation);
  r1->acquire(a.slot, a.generation, 4096);
  r1->release(a.slot, a.generation);
  CHECK_FALSE(freed(*w));  // rank 2 owes its forward
  CHECK(w->holdings()[2].slots_held == 1);

  SECTION("it attaches and acks") {
    auto r2 = ArenaReader::attach(w->name(), 2);
    r2->release_unacquired(a.slot, a.generation);  // a message it could not unpickle
    CHECK(freed(*w));
  }
  SECTION("it attaches and detaches holding the slot") {
    auto r2 = ArenaReader::attach(w->name(), 2);
    r2->acquire(a.slot, a.generation, 4096);
    r2->detach();
    CHECK(freed(*w));
  }
  SECTION("it attaches in a process that dies holding the slot") {
    int fds[2];
    REQUIRE(::pipe(fds) == 0);
    pid_t pid = ::fork();
    if (pid == 0) {
      auto r2 = ArenaReader::attach(w->name(), 2);
      r2->acquire(a.slot, a.generation, 4096);
      char c = 1;
      if (::write(fds[1], &c, 1) != 1) ::_exit(2);
      ::pause();
      ::_exit(0);
    }
    char c = 0;
    REQUIRE(::read(fds[0], &c, 1) == 1);
    CHECK_FALSE(w->reclaim(true));  // alive: it holds
    REQUIRE(vsa_test::kill_child(pid, true));
    bool ok = false;
    for (int i = 0; i < 200 && !ok; ++i) {
      ok = w->reclaim(true) == 1;
      if (!ok) std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    CHECK(ok);
    CHECK(w->stats().dead_readers == 1);
    ::close(fds[0]);
    ::close(fds[1]);
  }
  w->unlink();
}

TEST_CASE("counted arena: reader 0 detached or dead owes nothing, its forwards are still owed",
          "[arena][counted][faults]") {
  auto w = ArenaWriter::create(counted_config(2));
  auto r0 = ArenaReader::attach(w->name(), 0);
  auto r1 = ArenaReader::attach(w->name(), 1);
  w->unlink();
  Allocation a = sent_loan(*w, 4096, 3, 2);
  r0->acquire(a.slot, a.generation, 4096);
  r0->forward(a.slot, a.generation);
  r0->detach();  // holding one acquire of two sends
  CHECK_THROWS_AS(r0->forward(a.slot, a.generation), InvalidArgument);  // closed
  CHECK_FALSE(freed(*w));  // the worker owes the forward
  r1->acquire(a.slot, a.generation, 4096);
  r1->release(a.slot, a.generation);
  CHECK(freed(*w));
}

TEST_CASE("counted arena: only reader 0, holding the slot, forwards", "[arena][counted][faults]") {
  auto w = ArenaWriter::create(counted_config(2));
  auto r0 = ArenaReader::attach(w->name(), 0);
  auto r1 = ArenaReader::attach(w->name(), 1);
  w->unlink();
  Allocation a = filled_loan(*w, 4096, 4);
  REQUIRE(w->publish_loan(a.slot, a.generation));
  CHECK_THROWS_AS(r0->forward(a.slot, a.generation), InvalidArgument);  // not held
  r0->acquire(a.slot, a.generation, 4096);
  CHECK_THROWS_AS(r0->forward(a.slot, a.generation + 1), InvalidArgument);  // stale
  CHECK_THROWS_AS(r0->unforward(a.slot, a.generation), InvalidArgument);    // none to undo
  CHECK_THROWS_AS(r1->forward(a.slot, a.generation), InvalidArgument);      // not reader 0
  r0->forward(a.slot, a.generation);
  r0->unforward(a.slot, a.generation);  // its message did not go
  CHECK(w->holdings()[1].owed == 0);

  SECTION("an accept-once arena has neither forwards nor unsends") {
    ArenaConfig cfg = counted_config(2);
    cfg.counted = false;
    auto once = ArenaWriter::create(cfg);
    auto o0 = ArenaReader::attach(once->name(), 0);
    once->unlink();
    Allocation b = filled_loan(*once, 4096, 5);
    REQUIRE(once->publish_loan(b.slot, b.generation));
    CHECK_FALSE(once->publish_loan(b.slot, b.generation));  // sent once only
    o0->acquire(b.slot, b.generation, 4096);
    CHECK_THROWS_AS(o0->forward(b.slot, b.generation), InvalidArgument);
    CHECK_THROWS_AS(once->unsend(b.slot, b.generation), InvalidArgument);
    CHECK_FALSE(once->counted());
  }
}

TEST_CASE("counted arena: a send that did not go is taken back", "[arena][counted]") {
  auto w = ArenaWriter::create(counted_config(1));
  auto r0 = ArenaReader::attach(w->name(), 0);
  w->unlink();
  Allocation a = filled_loan(*w, 4096, 6);
  REQUIRE(w->publish_loan(a.slot, a.generation));
  REQUIRE(w->publish_loan(a.slot, a.generation));
  REQUIRE(w->publish_loan(a.slot, a.generation));
  w->unsend(a.slot, a.generation);  // the third message failed
  w->abort(a);                      // so did the second (the pickler's give-back)
  CHECK(w->stats().sends == 1);
  CHECK(w->stats().unsends == 2);
  w->end_loan(a.slot, a.generation);
  CHECK_FALSE(freed(*w));  // reader 0 owes the first
  r0->acquire(a.slot, a.generation, 4096);
  r0->release(a.slot, a.generation);
  CHECK(freed(*w));
  CHECK_THROWS_AS(w->unsend(a.slot, a.generation), InvalidArgument);  // recycled

  SECTION("the only send taken back: nothing owed, freed with the loan") {
    Allocation b = filled_loan(*w, 4096, 7);
    REQUIRE(w->publish_loan(b.slot, b.generation));
    w->unsend(b.slot, b.generation);
    CHECK_THROWS_AS(w->unsend(b.slot, b.generation), InvalidArgument);  // none left
    const WriterStats before = w->stats();
    w->abort(b);  // the pickler's give-back after the queue's unsend: counted once, not twice
    CHECK(w->stats().sends == before.sends);
    CHECK(w->stats().loans_sent == before.loans_sent);
    CHECK(w->stats().unsends == before.unsends);
    CHECK_FALSE(freed(*w));  // the loan view lives
    w->end_loan(b.slot, b.generation);
    CHECK(freed(*w));
  }
}

TEST_CASE("counted arena: a stub reader 0 failed to unpickle is acked once, held or not",
          "[arena][counted]") {
  auto w = ArenaWriter::create(counted_config(1));
  auto r0 = ArenaReader::attach(w->name(), 0);
  w->unlink();
  Allocation a = sent_loan(*w, 4096, 8, 2);
  r0->acquire(a.slot, a.generation, 4096);       // the first message
  r0->release_unacquired(a.slot, a.generation);  // the second could not be unpickled
  CHECK_FALSE(freed(*w));                        // the first is still held
  CHECK(r0->acked() == 1);
  r0->release(a.slot, a.generation);
  CHECK(freed(*w));
  CHECK(r0->acked() == 2);
  r0->release_unacquired(a.slot, a.generation);  // stale: nothing happens
  CHECK(w->stats().in_use == 0);
  CHECK(r0->acked() == 2);
}

TEST_CASE("counted arena: find_hold names the allocation a pointer lies in", "[arena][counted]") {
  auto w = ArenaWriter::create(counted_config(1));
  auto r0 = ArenaReader::attach(w->name(), 0);
  w->unlink();
  Allocation a = filled_loan(*w, 10000, 9);
  Allocation b = filled_loan(*w, 5000, 10);
  REQUIRE(w->publish_loan(a.slot, a.generation));
  REQUIRE(w->publish_loan(b.slot, b.generation));
  const uint8_t* pa = r0->acquire(a.slot, a.generation, 10000);
  const uint8_t* pb = r0->acquire(b.slot, b.generation, 5000);
  auto h = r0->find_hold(pa + 100, 9900);
  REQUIRE(h.has_value());
  CHECK(h->slot == a.slot);
  CHECK(h->generation == a.generation);
  CHECK(h->offset == 100);
  CHECK(h->nbytes == 10000);
  CHECK_FALSE(r0->find_hold(pa + 100, 9901).has_value());  // runs past the payload
  CHECK(r0->find_hold(pb, 5000)->slot == b.slot);
  uint8_t outside = 0;
  CHECK_FALSE(r0->find_hold(&outside, 1).has_value());
  r0->release(b.slot, b.generation);
  CHECK_FALSE(r0->find_hold(pb, 1).has_value());  // no longer held
  r0->release(a.slot, a.generation);
}

TEST_CASE("counted arena: ranks attach once, the writer cannot be taken over",
          "[arena][counted][faults]") {
  auto w = ArenaWriter::create(counted_config(2));
  auto r1 = ArenaReader::attach(w->name(), 1);
  r1->detach();
  r1.reset();
  CHECK_THROWS_AS(ArenaReader::attach(w->name(), 1), InvalidArgument);
  CHECK_NOTHROW(ArenaReader::attach(w->name(), 0));
  try {
    ArenaWriter::attach(w->name());
    FAIL("a counted arena's writer was taken over");
  } catch (const InvalidArgument& e) {
    CHECK(std::string(e.what()).find("counted arena") != std::string::npos);
  }
  w->unlink();
}

namespace {

// One multimodal item as vLLM moves it, for the scripted test below: the API server's loan
// (its sender cache entry), sends to the engine core (reader 0), the engine core's holds (its
// cache entry and requests), forwards to the workers and their tensors.
struct ScriptedItem {
  Allocation a;
  uint64_t sum = 0;
  bool loan = true;          // the API server's cache entry
  int r0_pending = 0;        // sends the engine core has not decoded yet
  int r0_holds = 0;          // its live acquires (the cache entry, requests)
  std::vector<int> pending;  // per worker: forwards not yet dequeued
  std::vector<int> holds;    // per worker: live acquires (its tensors, H2D in flight)
  bool owed_by_anyone() const {
    if (loan || r0_pending > 0 || r0_holds > 0) return true;
    for (size_t i = 0; i < pending.size(); ++i) {
      if (pending[i] > 0 || holds[i] > 0) return true;
    }
    return false;
  }
};

}  // namespace

TEST_CASE(
    "counted arena: a scripted engine core (hits, n > 1, preemption, resume, encoder-input "
    "replays) frees an item exactly when its last holder lets go",
    "[arena][counted]") {
  // Every way vLLM uses an item again is one more forward from the engine core's hold, never
  // a copy: an LRU hit, the second sample of n = 2, a preempted request resumed (the V2 model
  // runner sends its inputs again), 0.33's encoder-input replay. The script interleaves those
  // with the workers dequeuing, dropping tensors one by one or all at once (preemption),
  // failing to unpickle, messages that did not go, more sends (n > 1), and the evictions at
  // both ends; after every event the slot must be in use exactly while someone holds or owes
  // it, and every acquire must see the item's bytes.
  const uint32_t seed = vsa_test::seed("scripted engine core");
  std::mt19937_64 rng(seed);
  constexpr uint32_t kWorkers = 2;
  auto w = ArenaWriter::create(counted_config(1 + kWorkers));
  auto r0 = ArenaReader::attach(w->name(), 0);
  std::vector<std::shared_ptr<ArenaReader>> workers;
  for (uint32_t i = 0; i < kWorkers; ++i) workers.push_back(ArenaReader::attach(w->name(), 1 + i));
  w->unlink();
  auto pick = [&](int n) { return static_cast<int>(rng() % static_cast<uint64_t>(n)); };
  uint64_t forwards = 0, sends = 0, events = 0;
  for (int round = 0; round < 200; ++round) {
    const uint64_t n = 4096 + rng() % 60000;
    ScriptedItem it;
    it.a = filled_loan(*w, n, seed + round);
    it.sum = checksum(it.a.data, n);
    it.pending.assign(kWorkers, 0);
    it.holds.assign(kWorkers, 0);
    const uint64_t lent = w->stats().loans;
    REQUIRE(w->publish_loan(it.a.slot, it.a.generation));  // the miss that filled the loan
    it.r0_pending = 1;
    ++sends;
    while (it.owed_by_anyone()) {
      ++events;
      const uint32_t s = it.a.slot;
      const uint64_t g = it.a.generation;
      const int k = pick(100);
      const int wk = pick(kWorkers);
      ArenaReader& worker = *workers[static_cast<size_t>(wk)];
      if (k < 8 && it.loan) {  // the same loan sent again (n > 1, a request using it anew)
        REQUIRE(w->publish_loan(s, g));
        ++it.r0_pending;
        ++sends;
      } else if (k < 22 && it.r0_pending > 0) {  // the engine core decodes a send
        CHECK(checksum(r0->acquire(s, g, n), n) == it.sum);
        --it.r0_pending;
        ++it.r0_holds;
      } else if (k < 40 && it.r0_holds > 0) {  // a step forwards it once or twice
        const int times = 1 + pick(2);
        for (int i = 0; i < times; ++i) r0->forward(s, g);
        if (pick(10) == 0) {  // the message did not go: its forwards come back
          for (int i = 0; i < times; ++i) r0->unforward(s, g);
        } else {
          for (auto& p : it.pending) p += times;
          forwards += static_cast<uint64_t>(times);
        }
      } else if (k < 55 && it.pending[wk] > 0) {  // a worker dequeues one
        CHECK(checksum(worker.acquire(s, g, n), n) == it.sum);
        --it.pending[wk];
        ++it.holds[wk];
      } else if (k < 58 && it.pending[wk] > 0) {  // a message it failed to unpickle
        worker.release_unacquired(s, g);
        --it.pending[wk];
      } else if (k < 70 && it.holds[wk] > 0) {  // one of its tensors dies (its H2D is done)
        worker.release(s, g);
        --it.holds[wk];
      } else if (k < 73) {  // preemption: every worker drops the request's tensors
        for (uint32_t i = 0; i < kWorkers; ++i) {
          for (; it.holds[i] > 0; --it.holds[i]) workers[i]->release(s, g);
        }
      } else if (k < 80 && it.r0_holds > 0) {  // a request ends, or the cache evicts
        r0->release(s, g);
        --it.r0_holds;
        if (it.r0_holds == 0) {  // nothing holds it in the engine core: no forward possible
          CHECK_THROWS_AS(r0->forward(s, g), InvalidArgument);
        }
      } else if (k < 84 && it.loan) {  // the API server's cache evicts it
        w->end_loan(s, g);
        it.loan = false;
      } else {
        continue;
      }
      const bool owed = it.owed_by_anyone();
      INFO("round " << round << " event " << k << " seed " << seed);
      REQUIRE(freed(*w) == !owed);
    }
    CHECK_THROWS_AS(r0->acquire(it.a.slot, it.a.generation, n), InvalidArgument);  // stale
    CHECK(w->stats().loans == lent);  // used again and again, never lent or copied again
  }
  CHECK(w->stats().sends == sends);
  std::printf("[scripted engine core] %llu events, %llu sends, %llu forwards\n",
              static_cast<unsigned long long>(events), static_cast<unsigned long long>(sends),
              static_cast<unsigned long long>(forwards));
}

TEST_CASE("counted arena: a count mid-update or of another generation never frees early",
          "[arena][counted][faults]") {
  auto w = ArenaWriter::create(counted_config(2));
  auto r0 = ArenaReader::attach(w->name(), 0);
  auto r1 = ArenaReader::attach(w->name(), 1);
  w->unlink();
  Allocation a = sent_loan(*w, 4096, 11, 1);
  r0->acquire(a.slot, a.generation, 4096);
  r0->forward(a.slot, a.generation);
  r0->release(a.slot, a.generation);
  CountEntry* e = acked_entry_of(*w, 1, a.slot);
  // A peer scribbles worker 1's entry: a count for another generation, then a count frozen
  // mid-update (its writer died between the two words). Neither is an ack.
  e->generation.store(a.generation + 1);
  e->count.store(1);
  CHECK_FALSE(freed(*w));
  e->generation.store(~uint64_t{0});
  CHECK_FALSE(freed(*w));
  e->generation.store(0);
  e->count.store(0);
  r1->acquire(a.slot, a.generation, 4096);
  r1->release(a.slot, a.generation);
  CHECK(freed(*w));
}

TEST_CASE("counted arena: a corrupt mode word is rejected at attach", "[arena][counted][faults]") {
  auto w = ArenaWriter::create(counted_config(1));
  auto* h = reinterpret_cast<ArenaHeader*>(w->region()->data());
  h->counted = 2;
  CHECK_THROWS_AS(ArenaReader::attach(w->name(), 0), InvalidArgument);
  h->counted = 0;  // an accept-once header over a counted layout: the offsets disagree
  CHECK_THROWS_AS(ArenaReader::attach(w->name(), 0), InvalidArgument);
  h->counted = 1;
  CHECK_NOTHROW(ArenaReader::attach(w->name(), 0));
  w->unlink();
}

namespace {

// One stub on its way: (slot, generation, bytes, checksum of the bytes).
struct Stub {
  uint32_t slot;
  uint64_t generation, nbytes, sum;
};

// A mutex-guarded FIFO: the transport is not under test, the arena's counts are.
struct Channel {
  std::mutex mu;
  std::deque<Stub> q;
  void push(const Stub& s) {
    std::lock_guard<std::mutex> lock(mu);
    q.push_back(s);
  }
  std::optional<Stub> pop() {
    std::lock_guard<std::mutex> lock(mu);
    if (q.empty()) return std::nullopt;
    Stub s = q.front();
    q.pop_front();
    return s;
  }
};

}  // namespace

TEST_CASE("counted arena: threads send, forward and ack at random (for ThreadSanitizer)",
          "[arena][counted][threads]") {
  const uint32_t seed = vsa_test::seed("counted arena threads");
  const uint32_t n_workers = 2;
  const int n_items = 1500;
  const uint64_t max_bytes = 8192;
  auto w = ArenaWriter::create(counted_config(1 + n_workers, 16, 1 << 20));
  auto r0 = ArenaReader::attach(w->name(), 0);
  std::vector<std::shared_ptr<ArenaReader>> workers;
  for (uint32_t r = 1; r <= n_workers; ++r) workers.push_back(ArenaReader::attach(w->name(), r));
  w->unlink();
  Channel to_holder;
  std::vector<Channel> to_worker(n_workers);
  std::atomic<bool> writer_done{false}, holder_done{false};
  std::atomic<int> bad{0};
  std::atomic<uint64_t> forwards{0};
  // Reader 0: acquires each stub, keeps some holds for a while (a cache), forwards at random.
  std::thread holder([&] {
    std::mt19937 rng(seed + 1);
    std::vector<Stub> kept;
    for (;;) {
      std::optional<Stub> s = to_holder.pop();
      if (!s) {
        if (writer_done.load()) break;
        std::this_thread::yield();
        continue;
      }
      const uint8_t* p = r0->acquire(s->slot, s->generation, s->nbytes);
      if (checksum(p, s->nbytes) != s->sum) ++bad;
      for (uint32_t k = rng() % 3; k > 0; --k) {
        r0->forward(s->slot, s->generation);
        forwards.fetch_add(1);
        for (auto& c : to_worker) c.push(*s);
      }
      kept.push_back(*s);
      while (kept.size() > rng() % 6) {
        size_t i = rng() % kept.size();
        r0->release(kept[i].slot, kept[i].generation);
        kept.erase(kept.begin() + static_cast<std::ptrdiff_t>(i));
      }
    }
    for (auto& k : kept) r0->release(k.slot, k.generation);
    holder_done.store(true);
  });
  std::vector<std::thread> threads;
  for (uint32_t r = 0; r < n_workers; ++r) {
    threads.emplace_back([&, r] {
      for (;;) {
        std::optional<Stub> s = to_worker[r].pop();
        if (!s) {
          if (holder_done.load()) {
            if (!(s = to_worker[r].pop())) return;
          } else {
            std::this_thread::yield();
            continue;
          }
        }
        const uint8_t* p = workers[r]->acquire(s->slot, s->generation, s->nbytes);
        if (checksum(p, s->nbytes) != s->sum) ++bad;
        workers[r]->release(s->slot, s->generation);
      }
    });
  }
  // The writer: each item is a loan filled once and sent 1-3 times (cache hits).
  std::mt19937 rng(seed);
  for (int i = 0; i < n_items; ++i) {
    const uint64_t n = 1 + rng() % max_bytes;
    std::optional<Allocation> a;
    // Bounded: slots that never come back (a counting bug) fail the test, never hang it.
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (!(a = w->lend(n)) && std::chrono::steady_clock::now() < give_up) {
      std::this_thread::yield();
    }
    if (!a) {
      writer_done.store(true);
      holder.join();
      for (auto& t : threads) t.join();
      FAIL("no slot came back within 20 s (item " << i << ")");
    }
    fill_pattern(a->data, n, static_cast<uint64_t>(i));
    const Stub s{a->slot, a->generation, n, checksum(a->data, n)};
    for (uint32_t k = 1 + rng() % 3; k > 0; --k) {
      REQUIRE(w->publish_loan(a->slot, a->generation));
      to_holder.push(s);
    }
    w->end_loan(a->slot, a->generation);
  }
  writer_done.store(true);
  holder.join();
  for (auto& t : threads) t.join();
  CHECK(bad.load() == 0);
  CHECK(freed(*w));  // every send and forward acked: nothing left
  std::printf("[counted arena threads] %d items, %llu forwards\n", n_items,
              static_cast<unsigned long long>(forwards.load()));
}

TEST_CASE("counted arena: processes send, forward and ack at random, bytes checked",
          "[arena][counted][stress]") {
  const uint32_t seed = vsa_test::seed("counted arena processes");
  const int n_items = 400;
  const uint64_t max_bytes = 64 << 10;
  auto w = ArenaWriter::create(counted_config(3, 8, 1 << 20));
  // Pipes carry stubs: writer -> reader 0 -> workers 1 and 2 (each gets every forward).
  // After its input ends, each child acks what it kept, says so on `done` and stays attached
  // until `go` closes, so the slots must come back by their counts, not by a detach.
  int to0[2], to1[2], to2[2], done[2], go[2];
  REQUIRE(::pipe(to0) == 0);
  REQUIRE(::pipe(to1) == 0);
  REQUIRE(::pipe(to2) == 0);
  REQUIRE(::pipe(done) == 0);
  REQUIRE(::pipe(go) == 0);
  auto child = [&](uint32_t rank) -> pid_t {
    pid_t pid = ::fork();
    if (pid != 0) return pid;
    int rc = 0;
    try {
      auto r = ArenaReader::attach(w->name(), rank);
      std::mt19937 rng(seed + rank);
      const int in = rank == 0 ? to0[0] : rank == 1 ? to1[0] : to2[0];
      ::close(to0[1]);
      if (rank != 0) {
        ::close(to1[1]);
        ::close(to2[1]);
      }
      std::vector<Stub> kept;
      Stub s;
      while (::read(in, &s, sizeof(s)) == static_cast<ssize_t>(sizeof(s))) {
        const uint8_t* p = r->acquire(s.slot, s.generation, s.nbytes);
        if (checksum(p, s.nbytes) != s.sum) rc = 3;
        if (rank == 0) {
          for (uint32_t k = rng() % 3; k > 0; --k) {
            r->forward(s.slot, s.generation);
            if (::write(to1[1], &s, sizeof(s)) != static_cast<ssize_t>(sizeof(s)) ||
                ::write(to2[1], &s, sizeof(s)) != static_cast<ssize_t>(sizeof(s))) {
              rc = 4;
            }
          }
        }
        kept.push_back(s);
        while (kept.size() > rng() % 4) {
          size_t i = rng() % kept.size();
          r->release(kept[i].slot, kept[i].generation);
          kept.erase(kept.begin() + static_cast<std::ptrdiff_t>(i));
        }
      }
      for (auto& k : kept) r->release(k.slot, k.generation);
      if (rank == 0) {
        ::close(to1[1]);  // the workers' input ends
        ::close(to2[1]);
      }
      ::close(go[1]);
      const char c = 1;
      if (::write(done[1], &c, 1) != 1) rc = 6;
      char x;
      while (::read(go[0], &x, 1) > 0) {
      }
    } catch (...) {
      rc = 5;
    }
    ::_exit(rc);
  };
  pid_t p0 = child(0);
  ::close(to0[0]);
  ::close(to1[1]);
  ::close(to2[1]);
  pid_t p1 = child(1);
  pid_t p2 = child(2);
  ::close(to1[0]);
  ::close(to2[0]);
  std::mt19937 rng(seed);
  bool wrote_all = true;
  for (int i = 0; i < n_items && wrote_all; ++i) {
    const uint64_t n = 1 + rng() % max_bytes;
    std::optional<Allocation> a;
    for (int tries = 0; !a && tries < 20000; ++tries) {
      a = w->lend(n);
      if (!a) std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    if (!a) {
      wrote_all = false;
      break;
    }
    fill_pattern(a->data, n, static_cast<uint64_t>(i) ^ seed);
    const Stub s{a->slot, a->generation, n, checksum(a->data, n)};
    for (uint32_t k = 1 + rng() % 3; k > 0; --k) {
      REQUIRE(w->publish_loan(a->slot, a->generation));
      REQUIRE(::write(to0[1], &s, sizeof(s)) == static_cast<ssize_t>(sizeof(s)));
    }
    w->end_loan(a->slot, a->generation);
  }
  ::close(to0[1]);
  CHECK(wrote_all);
  ::close(done[1]);
  ::close(go[0]);
  int ready = 0;
  char c;
  while (ready < 3 && ::read(done[0], &c, 1) == 1) ++ready;
  CHECK(ready == 3);
  // Every child is still attached and alive here: only the counts can free the slots.
  CHECK(freed(*w));
  for (uint32_t r = 0; r < 3; ++r) CHECK(w->holdings()[r].state == ReaderState::kAttached);
  ::close(go[1]);
  ::close(done[0]);
  for (pid_t p : {p0, p1, p2}) CHECK(vsa_test::exited_ok(vsa_test::wait_child(p, 60)));
  w->unlink();
}

TEST_CASE("counted arena: a view that counts no stub needs a hold that counted one",
          "[arena][counted]") {
  auto w = ArenaWriter::create(counted_config(1));
  auto r0 = ArenaReader::attach(w->name(), 0);
  w->unlink();
  Allocation a = sent_loan(*w, 8192, 12, 1);
  // A message's stub held once (its frame 0 listing), then two tensors over parts of it.
  CHECK_THROWS_AS(r0->acquire(a.slot, a.generation, 4096, 0, 0), InvalidArgument);
  CHECK(r0->held() == 0);  // the refused acquire left nothing behind
  r0->acquire(a.slot, a.generation, 0, 0, 1);
  r0->acquire(a.slot, a.generation, 4096, 0, 0);
  r0->acquire(a.slot, a.generation, 4096, 4096, 0);
  r0->release(a.slot, a.generation);
  r0->release(a.slot, a.generation);
  CHECK_FALSE(freed(*w));
  r0->release(a.slot, a.generation);  // three views, one stub: acked 1 == sent 1
  CHECK(freed(*w));
}

TEST_CASE("counted arena: reader 0 sees the other ranks' states as the writer does",
          "[arena][counted]") {
  // Reader 0 forwards only while every worker rank is attached (the queue's reducer asks it).
  auto w = ArenaWriter::create(counted_config(3));
  auto r0 = ArenaReader::attach(w->name(), 0);
  CHECK(r0->reader_state(1) == ReaderState::kNeverAttached);
  auto r1 = ArenaReader::attach(w->name(), 1);
  CHECK(r0->reader_state(1) == ReaderState::kAttached);
  CHECK(r0->reader_state(2) == ReaderState::kNeverAttached);
  r1->detach();
  CHECK(r0->reader_state(1) == ReaderState::kDetached);
  for (uint32_t rank = 0; rank < 3; ++rank) {
    CHECK(r0->reader_state(rank) == w->reader_state(rank));
  }
  CHECK_THROWS_AS(r0->reader_state(3), OutOfRange);
  w->unlink();
}
