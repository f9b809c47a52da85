// Tests of the stale-segment cleaner (stale_segments.cpp): only segments whose writer is
// provably dead are removed; live, foreign, garbage and other-version ones are kept.
#include "core/stale_segments.h"

#include <fcntl.h>
#include <unistd.h>

#include <cstring>
#include <string>

#include "catch_compat.hpp"
#include "core/arena.h"
#include "test_util.hpp"

using namespace vllm_shm_arena;

namespace {

bool exists(const std::string& path) { return ::access(path.c_str(), F_OK) == 0; }

// An arena created by a child that then dies without unlinking it. Returns its name.
std::string crashed_arena(const std::string& dir) {
  int p[2];
  REQUIRE(::pipe(p) == 0);
  pid_t pid = ::fork();
  if (pid == 0) {
    ArenaConfig cfg;
    cfg.n_readers = 1;
    cfg.num_slots = 1;
    cfg.slot_bytes = 4096;
    cfg.dir = dir;
    auto w = ArenaWriter::create(cfg);
    const std::string& n = w->name();
    if (::write(p[1], n.data(), n.size()) != static_cast<ssize_t>(n.size())) ::_exit(2);
    ::_exit(0);
  }
  ::close(p[1]);
  char buf[256];
  ssize_t n = ::read(p[0], buf, sizeof(buf));
  ::close(p[0]);
  REQUIRE(vsa_test::exited_ok(vsa_test::wait_child(pid)));
  REQUIRE(n > 0);
  return std::string(buf, static_cast<size_t>(n));
}

}  // namespace

TEST_CASE("a dead writer's arena is stale; dry run keeps it, a real run removes it", "[stale]") {
  vsa_test::TempDir dir;
  const std::string name = crashed_arena(dir.path());
  SegmentReport r = inspect_segment(dir.path(), name);
  CHECK(r.kind == "arena");
  CHECK(r.writer == Liveness::kDead);
  auto dry = remove_stale_segments(dir.path(), true);
  REQUIRE(dry.size() == 1);
  CHECK_FALSE(dry[0].removed);
  CHECK(exists(dir.path() + "/" + name));
  auto real = remove_stale_segments(dir.path(), false);
  REQUIRE(real.size() == 1);
  CHECK(real[0].removed);
  CHECK_FALSE(exists(dir.path() + "/" + name));
}

TEST_CASE("live, garbage and other-version segments are kept", "[stale]") {
  vsa_test::TempDir dir;
  ArenaConfig cfg;
  cfg.n_readers = 1;
  cfg.num_slots = 1;
  cfg.slot_bytes = 4096;
  cfg.dir = dir.path();
  auto live = ArenaWriter::create(cfg);
  const std::string old = crashed_arena(dir.path());
  {
    int fd = ::open((dir.path() + "/" + old).c_str(), O_RDWR);
    REQUIRE(fd >= 0);
    uint32_t v1 = 1;  // the layout before liveness tokens
    REQUIRE(::pwrite(fd, &v1, sizeof(v1), 8) == sizeof(v1));
    ::close(fd);
    fd = ::open((dir.path() + "/vsa_garbage").c_str(), O_RDWR | O_CREAT, 0600);
    REQUIRE(fd >= 0);
    REQUIRE(::ftruncate(fd, 8192) == 0);
    ::close(fd);
  }
  auto reports = remove_stale_segments(dir.path(), false);
  CHECK(reports.size() == 3);
  for (const SegmentReport& r : reports) {
    INFO(r.name << ": " << liveness_name(r.writer) << " " << r.why);
    CHECK_FALSE(r.removed);
    if (r.name == live->name()) CHECK(r.writer == Liveness::kAlive);
    if (r.name == old) CHECK(r.why.find("layout version 1") != std::string::npos);
    if (r.name == "vsa_garbage") CHECK(r.writer == Liveness::kUnknown);
  }
  CHECK_THROWS_AS(remove_stale_segments(dir.path() + "/missing", true), ShmError);
}
