// Tests of the stale-segment cleaner (stale_segments.cpp): only segments whose writer is
// provably dead are removed; live, foreign, garbage and other-version ones are kept.
#include "core/stale_segments.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <string>

#include "catch_compat.hpp"
#include "core/arena.h"
#include "core/socket_dir.h"
#include "test_util.hpp"

using namespace vllm_shm_arena;

namespace {

bool exists(const std::string& path) {
  struct stat st;
  return ::lstat(path.c_str(), &st) == 0;
}

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

namespace {

// A SocketDir created by a child that then dies without removing it (a crashed queue writer,
// its socket bound). Returns the directory's name.
std::string crashed_socket_dir(const std::string& dir) {
  int p[2];
  REQUIRE(::pipe(p) == 0);
  pid_t pid = ::fork();
  if (pid == 0) {
    auto sd = SocketDir::create(dir);
    int s = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    std::strncpy(a.sun_path, sd->socket_path().c_str(), sizeof(a.sun_path) - 1);
    if (s < 0 || ::bind(s, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) ::_exit(3);
    const std::string& n = sd->name();
    if (::write(p[1], n.data(), n.size()) != static_cast<ssize_t>(n.size())) ::_exit(2);
    ::_exit(0);  // no destructor runs: the directory stays, its token free
  }
  ::close(p[1]);
  char buf[256];
  ssize_t n = ::read(p[0], buf, sizeof(buf));
  ::close(p[0]);
  REQUIRE(vsa_test::exited_ok(vsa_test::wait_child(pid)));
  REQUIRE(n > 0);
  return std::string(buf, static_cast<size_t>(n));
}

void write_file(const std::string& path, const std::string& text) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  REQUIRE(fd >= 0);
  REQUIRE(::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size()));
  ::close(fd);
}

std::string read_file(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return "<missing>";
  char buf[256];
  ssize_t n = ::read(fd, buf, sizeof(buf));
  ::close(fd);
  return n < 0 ? "<unreadable>" : std::string(buf, static_cast<size_t>(n));
}

const SegmentReport* report_for(const std::vector<SegmentReport>& rs, const std::string& name) {
  for (const SegmentReport& r : rs) {
    if (r.name == name) return &r;
  }
  return nullptr;
}

}  // namespace

TEST_CASE("a live SocketDir is kept and a dead creator's is removed", "[stale][socket_dir]") {
  vsa_test::TempDir dir;
  auto live = SocketDir::create(dir.path());
  const std::string dead = crashed_socket_dir(dir.path());
  auto dry = remove_stale_segments(dir.path(), true);
  REQUIRE(dry.size() == 2);
  const SegmentReport* d = report_for(dry, dead);
  const SegmentReport* l = report_for(dry, live->name());
  REQUIRE(d != nullptr);
  REQUIRE(l != nullptr);
  CHECK(d->kind == "socket");
  CHECK(d->writer == Liveness::kDead);
  CHECK(l->kind == "socket");
  CHECK(l->writer == Liveness::kAlive);
  CHECK_FALSE(d->removed);
  CHECK(exists(dir.path() + "/" + dead + "/s"));
  auto real = remove_stale_segments(dir.path(), false);
  d = report_for(real, dead);
  l = report_for(real, live->name());
  REQUIRE(d != nullptr);
  REQUIRE(l != nullptr);
  INFO(d->why);
  CHECK(d->removed);
  CHECK_FALSE(exists(dir.path() + "/" + dead));
  CHECK_FALSE(l->removed);
  CHECK(exists(live->path() + "/token"));
}

TEST_CASE("socket-directory look-alikes that are not provably ours are kept",
          "[stale][socket_dir][faults]") {
  vsa_test::TempDir dir;
  const std::string base = dir.path() + "/";
  const std::string hex = "0123456789abcdef0123456789abcdef";
  // Another name under the prefix, holding somebody's notes.
  REQUIRE(::mkdir((base + "vsa_sock_notes").c_str(), 0700) == 0);
  write_file(base + "vsa_sock_notes/todo.txt", "keep me");
  // The right name and a free token, plus a file that is not ours to delete.
  const std::string extra = "vsa_sock_" + hex;
  REQUIRE(::mkdir((base + extra).c_str(), 0700) == 0);
  write_file(base + extra + "/token", "");
  write_file(base + extra + "/notes.txt", "keep me");
  // The right name, no token at all.
  const std::string no_token = "vsa_sock_" + std::string(32, 'e');
  REQUIRE(::mkdir((base + no_token).c_str(), 0700) == 0);
  // The right name and a free token that is a symlink.
  const std::string link_token = "vsa_sock_" + std::string(32, 'd');
  REQUIRE(::mkdir((base + link_token).c_str(), 0700) == 0);
  write_file(base + "elsewhere.txt", "keep me");
  REQUIRE(::symlink((base + "elsewhere.txt").c_str(), (base + link_token + "/token").c_str()) == 0);
  // The right name and a free token, but `s` is a regular file, not a socket.
  const std::string file_s = "vsa_sock_" + std::string(32, 'c');
  REQUIRE(::mkdir((base + file_s).c_str(), 0700) == 0);
  write_file(base + file_s + "/token", "");
  write_file(base + file_s + "/s", "keep me");
  // A symlink with the right name, to a directory that looks like a dead SocketDir.
  const std::string link = "vsa_sock_" + std::string(32, 'b');
  REQUIRE(::mkdir((base + "target").c_str(), 0700) == 0);
  write_file(base + "target/token", "");
  REQUIRE(::symlink((base + "target").c_str(), (base + link).c_str()) == 0);
  // A regular file with the right name.
  const std::string file = "vsa_sock_" + std::string(32, 'a');
  write_file(base + file, "keep me");

  auto reports = remove_stale_segments(dir.path(), false);
  CHECK(reports.size() == 7);
  for (const SegmentReport& r : reports) {
    INFO(r.name << ": " << liveness_name(r.writer) << " (" << r.why << ")");
    CHECK_FALSE(r.removed);
    CHECK(r.writer == Liveness::kUnknown);
    CHECK_FALSE(r.why.empty());
  }
  CHECK(read_file(base + "vsa_sock_notes/todo.txt") == "keep me");
  CHECK(read_file(base + extra + "/notes.txt") == "keep me");
  CHECK(exists(base + extra + "/token"));
  CHECK(exists(base + no_token));
  CHECK(read_file(base + "elsewhere.txt") == "keep me");
  CHECK(read_file(base + file_s + "/s") == "keep me");
  CHECK(exists(base + link));
  CHECK(exists(base + "target/token"));
  CHECK(read_file(base + file) == "keep me");
  const SegmentReport* r = report_for(reports, extra);
  REQUIRE(r != nullptr);
  CHECK(r->why.find("notes.txt") != std::string::npos);
}
