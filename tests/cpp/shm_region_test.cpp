// Tests of ShmRegion (shm_region.cpp).
#include "core/shm_region.h"

#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/inotify.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "catch_compat.hpp"
#include "core/errors.h"
#include "core/liveness.h"
#include "test_util.hpp"

using namespace vllm_shm_arena;

TEST_CASE("create, attach by name, share bytes, unlink", "[shm]") {
  vsa_test::TempDir dir;
  auto sut = ShmRegion::create(1 << 20, "vsa_test_", dir.path());
  CHECK(sut->size() == (1u << 20));
  CHECK(sut->name().rfind("vsa_test_", 0) == 0);
  auto other = ShmRegion::attach(sut->name(), dir.path());
  std::memcpy(sut->data() + 4096, "hello", 5);
  CHECK(std::memcmp(other->data() + 4096, "hello", 5) == 0);
  sut->unlink();
  sut->unlink();  // idempotent
  CHECK_THROWS_AS(ShmRegion::attach(sut->name(), dir.path()), ShmError);
  // Mappings outlive the name.
  std::memcpy(other->data(), "x", 1);
  CHECK(sut->data()[0] == 'x');
}

TEST_CASE("creation leaves pages lazy", "[shm]") {
  vsa_test::TempDir dir;
  auto sut = ShmRegion::create(256ull << 20, "vsa_test_", dir.path());
  struct stat st;
  REQUIRE(::stat((dir.path() + "/" + sut->name()).c_str(), &st) == 0);
  CHECK(st.st_size == (256ll << 20));
  CHECK(st.st_blocks * 512 < (1 << 20));  // nothing allocated yet
  REQUIRE(sut->reserve(0, 8 << 20));
  REQUIRE(::stat((dir.path() + "/" + sut->name()).c_str(), &st) == 0);
  CHECK(st.st_blocks * 512 >= (8 << 20));
  sut->unlink();
}

TEST_CASE("bad names and ranges are typed errors", "[shm][faults]") {
  CHECK_THROWS_AS(ShmRegion::attach("a/b"), InvalidArgument);
  CHECK_THROWS_AS(ShmRegion::attach(""), InvalidArgument);
  CHECK_THROWS_AS(ShmRegion::attach(".."), InvalidArgument);
  CHECK_THROWS_AS(ShmRegion::create(0), InvalidArgument);
  auto sut = ShmRegion::create(4096);
  sut->unlink();
  CHECK_THROWS_AS(sut->reserve(4096, 1), OutOfRange);
  CHECK_THROWS_AS(sut->reserve(1, ~0ull), OutOfRange);
}

TEST_CASE("free-space check names sizes and the fix", "[shm][faults]") {
  try {
    ShmRegion::check_free_space("/dev/shm", ~0ull >> 2);
    FAIL("no error for an impossible size");
  } catch (const ShmError& e) {
    std::string m = e.what();
    CHECK(m.find("/dev/shm") != std::string::npos);
    CHECK(m.find("--shm-size") != std::string::npos);
  }
  CHECK_THROWS_AS(ShmRegion::free_bytes("/nonexistent/dir"), ShmError);
}

TEST_CASE("reserve reports a full tmpfs as false", "[shm][faults]") {
  vsa_test::TempDir small(8 << 20);
  if (!small.mounted()) {
    VSA_SKIP("mounting a small tmpfs needs root (CAP_SYS_ADMIN)");
    return;
  }
  // Both pass the creation check (nothing is reserved yet); together they can't be backed.
  auto sut = ShmRegion::create(6 << 20, "vsa_test_", small.path());
  auto big = ShmRegion::create(6 << 20, "vsa_test_", small.path());
  CHECK(sut->reserve(0, 4 << 20));
  CHECK_FALSE(big->reserve(0, 5 << 20));
  sut->unlink();
  big->unlink();
}

namespace {

std::vector<std::string> dir_entries(const std::string& dir) {
  std::vector<std::string> out;
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return out;
  while (struct dirent* e = ::readdir(d)) {
    if (std::strcmp(e->d_name, ".") != 0 && std::strcmp(e->d_name, "..") != 0) {
      out.push_back(e->d_name);
    }
  }
  ::closedir(d);
  std::sort(out.begin(), out.end());
  return out;
}

// Every run of 32 lowercase hex digits in `name`.
std::vector<std::string> hex_runs(const std::string& name) {
  std::vector<std::string> out;
  size_t run = 0;
  for (size_t i = 0; i <= name.size(); ++i) {
    const bool hex = i < name.size() && std::isxdigit(static_cast<unsigned char>(name[i])) &&
                     !std::isupper(static_cast<unsigned char>(name[i]));
    if (hex) {
      ++run;
      continue;
    }
    if (run >= 32) out.push_back(name.substr(i - 32, 32));
    run = 0;
  }
  return out;
}

// What a squatter writes into each name it takes.
constexpr char kSquat[] = "squatter";

// Creates `path` as a squatter's file unless it exists. True if it made it.
bool squat(const std::string& path) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) return false;
  bool ok = ::write(fd, kSquat, sizeof(kSquat)) == static_cast<ssize_t>(sizeof(kSquat));
  ::close(fd);
  return ok;
}

bool is_squatters(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) return false;
  char buf[sizeof(kSquat) + 1] = {};
  ssize_t n = ::read(fd, buf, sizeof(buf));
  ::close(fd);
  return n == static_cast<ssize_t>(sizeof(kSquat)) && std::memcmp(buf, kSquat, n) == 0;
}

// Takes, for every name in `dir` starting with `prefix`, each name `prefix` + <a 32-hex run of
// it>: what a user watching the directory can derive from what it sees. Returns how many.
int squat_derived_names(const std::string& dir, const std::string& prefix) {
  int made = 0;
  for (const std::string& n : dir_entries(dir)) {
    if (n.compare(0, prefix.size(), prefix) != 0) continue;
    for (const std::string& hex : hex_runs(n)) made += squat(dir + "/" + prefix + hex) ? 1 : 0;
  }
  return made;
}

// Scripted names for random_name_hex().
std::vector<std::string> g_script;
std::atomic<size_t> g_drawn{0};
std::string scripted() {
  size_t i = g_drawn.fetch_add(1);
  return g_script[std::min(i, g_script.size() - 1)];
}
struct ScriptedNames {
  explicit ScriptedNames(std::vector<std::string> names) {
    g_script = std::move(names);
    g_drawn = 0;
    set_random_name_source_for_testing(&scripted);
  }
  ~ScriptedNames() { set_random_name_source_for_testing(nullptr); }
};

std::string hex_of(char c) { return std::string(32, c); }

// The region's name refers to the region's own file.
bool names_its_file(const ShmRegion& r) {
  struct stat a, b;
  return ::fstat(r.fd(), &a) == 0 && ::lstat(r.path().c_str(), &b) == 0 && a.st_dev == b.st_dev &&
         a.st_ino == b.st_ino;
}

}  // namespace

TEST_CASE("a squatter who sees the temporary name cannot take the final one", "[shm][faults]") {
  vsa_test::TempDir dir;
  int squatted = 0;
  // The worst moment: the temporary file exists (init runs on it) and the squatter has already
  // taken every name it could derive from what the directory shows.
  auto sut = ShmRegion::create(1 << 20, "vsa_test_", dir.path(), [&](ShmRegion&) {
    squatted = squat_derived_names(dir.path(), "vsa_test_");
  });
  CHECK(squatted >= 1);
  CHECK(names_its_file(*sut));
  CHECK_FALSE(is_squatters(sut->path()));
  int squatters = 0;
  for (const std::string& n : dir_entries(dir.path())) {
    if (n == sut->name()) continue;
    CHECK(is_squatters(dir.path() + "/" + n));  // untouched, and no temporary file left
    ++squatters;
  }
  CHECK(squatters == squatted);
}

TEST_CASE("a squatter watching the directory with inotify never stops a creation",
          "[shm][faults][fork]") {
  vsa_test::TempDir dir;
  const std::string prefix = "vsa_test_";
  int ready[2], stop[2];
  REQUIRE(::pipe(ready) == 0);
  REQUIRE(::pipe(stop) == 0);
  pid_t pid = ::fork();
  if (pid == 0) {
    ::close(ready[0]);
    ::close(stop[1]);
    int in = ::inotify_init1(IN_CLOEXEC);
    if (in < 0 || ::inotify_add_watch(in, dir.path().c_str(), IN_CREATE | IN_MOVED_TO) < 0) {
      ::_exit(3);
    }
    if (::write(ready[1], "r", 1) != 1) ::_exit(2);
    alignas(struct inotify_event) char buf[8192];
    for (;;) {
      struct pollfd fds[2] = {{in, POLLIN, 0}, {stop[0], POLLIN, 0}};
      if (::poll(fds, 2, -1) < 0) ::_exit(4);
      if (fds[1].revents != 0) ::_exit(0);  // the parent closed its end: done
      ssize_t n = ::read(in, buf, sizeof(buf));
      for (ssize_t off = 0; off < n;) {
        auto* ev = reinterpret_cast<struct inotify_event*>(buf + off);
        std::string name = ev->len > 0 ? std::string(ev->name) : std::string();
        if (name.compare(0, prefix.size(), prefix) == 0) {
          for (const std::string& hex : hex_runs(name)) squat(dir.path() + "/" + prefix + hex);
        }
        off += static_cast<ssize_t>(sizeof(struct inotify_event) + ev->len);
      }
    }
  }
  ::close(ready[1]);
  ::close(stop[0]);
  char c = 0;
  REQUIRE(::read(ready[0], &c, 1) == 1);
  ::close(ready[0]);
  std::vector<std::shared_ptr<ShmRegion>> made;
  int failures = 0;
  for (int i = 0; i < 20; ++i) {
    try {
      // As the arena does: the token first, then the tables reserved, then the name.
      std::unique_ptr<LivenessToken> token;
      made.push_back(ShmRegion::create(1 << 20, prefix, dir.path(), [&](ShmRegion& r) {
        token = LivenessToken::take(r.path(), kWriterTokenByte, r.fd());
        REQUIRE(r.reserve(0, 1 << 20));
      }));
    } catch (const ShmError& e) {
      INFO(e.what());
      ++failures;
    }
  }
  ::close(stop[1]);
  REQUIRE(vsa_test::exited_ok(vsa_test::wait_child(pid)));
  CHECK(failures == 0);
  for (const auto& r : made) {
    CHECK(names_its_file(*r));
    CHECK_FALSE(is_squatters(r->path()));
  }
  for (const std::string& n : dir_entries(dir.path())) {
    bool ours = false;
    for (const auto& r : made) ours = ours || r->name() == n;
    if (!ours) CHECK(is_squatters(dir.path() + "/" + n));  // no temporary file left behind
  }
}

TEST_CASE("taken names are skipped with fresh random bits, a bounded number of times",
          "[shm][faults]") {
  vsa_test::TempDir dir;
  const std::string base = dir.path() + "/vsa_test_";
  SECTION("a taken temporary name and taken final names") {
    REQUIRE(squat(base + "tmp_" + hex_of('a')));
    REQUIRE(squat(base + hex_of('b')));
    REQUIRE(squat(base + hex_of('c')));
    ScriptedNames names({hex_of('a'), hex_of('b'), hex_of('c'), hex_of('d'), hex_of('e')});
    auto sut = ShmRegion::create(4096, "vsa_test_", dir.path());
    CHECK(names_its_file(*sut));
    CHECK_FALSE(is_squatters(sut->path()));
    CHECK(dir_entries(dir.path()).size() == 4);  // three squatters and the region
    for (char h : {'a', 'b', 'c'}) {
      const std::string n = h == 'a' ? base + "tmp_" + hex_of(h) : base + hex_of(h);
      CHECK(is_squatters(n));
    }
  }
  SECTION("every final name taken: a clear error, the temporary file removed") {
    REQUIRE(squat(base + hex_of('b')));
    ScriptedNames names({hex_of('b')});  // the temporary name is free, every final one taken
    try {
      ShmRegion::create(4096, "vsa_test_", dir.path());
      FAIL("no error although every final name was taken");
    } catch (const ShmError& e) {
      CHECK(std::string(e.what()).find("16 fresh random names") != std::string::npos);
    }
    CHECK(g_drawn.load() == 17);  // one temporary name, 16 final ones
    CHECK(dir_entries(dir.path()) == std::vector<std::string>{"vsa_test_" + hex_of('b')});
    CHECK(is_squatters(base + hex_of('b')));
  }
  SECTION("init failing leaves nothing behind") {
    CHECK_THROWS_AS(ShmRegion::create(4096, "vsa_test_", dir.path(),
                                      [](ShmRegion&) { throw ShmError("init failed"); }),
                    ShmError);
    CHECK(dir_entries(dir.path()).empty());
  }
}
