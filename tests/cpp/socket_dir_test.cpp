// Tests of SocketDir (socket_dir.cpp): a fresh 0700 directory per object, never one somebody
// else made, its name kept taken (token held) until remove(), and a forked child's copy inert.
#include "core/socket_dir.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <string>
#include <vector>

#include "catch_compat.hpp"
#include "core/errors.h"
#include "core/shm_region.h"
#include "test_util.hpp"

using namespace vllm_shm_arena;

namespace {

bool exists(const std::string& path) {
  struct stat st;
  return ::lstat(path.c_str(), &st) == 0;
}

std::vector<std::string> entries(const std::string& dir) {
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

// A descriptor of the directory's token file, to probe through (holds no lock).
int open_token(const SocketDir& sd) {
  return ::open((sd.path() + "/" + kSocketDirTokenFile).c_str(), O_RDONLY | O_CLOEXEC);
}

// Scripted names for random_name_hex(): the test knows which names create() will try.
std::vector<std::string> g_script;
std::atomic<size_t> g_next{0};
std::string scripted() {
  size_t i = g_next.fetch_add(1);
  return g_script[std::min(i, g_script.size() - 1)];
}
struct ScriptedNames {
  explicit ScriptedNames(std::vector<std::string> names) {
    g_script = std::move(names);
    g_next = 0;
    set_random_name_source_for_testing(&scripted);
  }
  ~ScriptedNames() { set_random_name_source_for_testing(nullptr); }
};

std::string hex_of(char c) { return std::string(32, c); }

// Binds a unix socket at `path` (what the queue's ZeroMQ socket does); closes the descriptor.
bool bind_socket(const std::string& path) {
  int s = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (s < 0) return false;
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  std::strncpy(a.sun_path, path.c_str(), sizeof(a.sun_path) - 1);
  bool ok = ::bind(s, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
  ::close(s);
  return ok;
}

}  // namespace

TEST_CASE("each SocketDir is a fresh 0700 directory of this user with its token held",
          "[socket_dir]") {
  vsa_test::TempDir dir;
  auto sut = SocketDir::create(dir.path());
  auto other = SocketDir::create(dir.path());
  CHECK(sut->path() != other->path());
  CHECK(is_socket_dir_name(sut->name()));
  CHECK(sut->path() == dir.path() + "/" + sut->name());
  CHECK(sut->socket_path() == sut->path() + "/s");
  struct stat st;
  REQUIRE(::lstat(sut->path().c_str(), &st) == 0);
  CHECK(S_ISDIR(st.st_mode));
  CHECK((st.st_mode & 07777) == 0700);
  CHECK(st.st_uid == ::geteuid());
  CHECK(entries(sut->path()) == std::vector<std::string>{"token"});
  REQUIRE(::lstat((sut->path() + "/token").c_str(), &st) == 0);
  CHECK(S_ISREG(st.st_mode));
  CHECK((st.st_mode & 07777) == 0600);
  int fd = open_token(*sut);
  REQUIRE(fd >= 0);
  CHECK(probe_token(fd, kWriterTokenByte) == Liveness::kAlive);
  ::close(fd);
}

TEST_CASE("names somebody else made are never used", "[socket_dir][faults]") {
  vsa_test::TempDir dir;
  const std::string a = dir.path() + "/vsa_sock_" + hex_of('a');  // a directory, mode 0777
  const std::string b = dir.path() + "/vsa_sock_" + hex_of('b');  // a symlink to a directory
  const std::string c = dir.path() + "/vsa_sock_" + hex_of('c');  // a regular file
  const std::string target = dir.path() + "/target";
  REQUIRE(::mkdir(a.c_str(), 0777) == 0);
  REQUIRE(::chmod(a.c_str(), 0777) == 0);
  REQUIRE(::mkdir(target.c_str(), 0755) == 0);
  REQUIRE(::symlink(target.c_str(), b.c_str()) == 0);
  int fd = ::open(c.c_str(), O_WRONLY | O_CREAT | O_EXCL, 0644);
  REQUIRE(fd >= 0);
  REQUIRE(::write(fd, "mine", 4) == 4);
  ::close(fd);
  SECTION("the first fresh name wins") {
    ScriptedNames names({hex_of('a'), hex_of('b'), hex_of('c'), hex_of('d')});
    auto sut = SocketDir::create(dir.path());
    CHECK(sut->name() == "vsa_sock_" + hex_of('d'));
    CHECK(g_next.load() == 4);
  }
  SECTION("every name taken: a clear error after a bounded number of tries") {
    ScriptedNames names({hex_of('a')});
    try {
      SocketDir::create(dir.path());
      FAIL("no error although every name was taken");
    } catch (const ShmError& e) {
      CHECK(std::string(e.what()).find("16 fresh random names") != std::string::npos);
    }
    CHECK(g_next.load() == 16);
  }
  // The squatters are exactly as they were.
  struct stat st;
  REQUIRE(::lstat(a.c_str(), &st) == 0);
  CHECK(S_ISDIR(st.st_mode));
  CHECK((st.st_mode & 07777) == 0777);
  CHECK(entries(a).empty());
  REQUIRE(::lstat(b.c_str(), &st) == 0);
  CHECK(S_ISLNK(st.st_mode));
  CHECK(entries(target).empty());
  REQUIRE(::lstat(c.c_str(), &st) == 0);
  CHECK(S_ISREG(st.st_mode));
  CHECK(st.st_size == 4);
  std::vector<std::string> left = entries(dir.path());
  left.erase(std::remove_if(left.begin(), left.end(),
                            [](const std::string& n) { return n == "vsa_sock_" + hex_of('d'); }),
             left.end());
  CHECK(left.size() == 4);  // the three squatters and the target, nothing else
}

TEST_CASE("unlink_socket frees nothing but the socket; remove is idempotent", "[socket_dir]") {
  vsa_test::TempDir dir;
  auto sut = SocketDir::create(dir.path());
  REQUIRE(bind_socket(sut->socket_path()));
  CHECK(entries(sut->path()) == std::vector<std::string>{"s", "token"});
  int fd = open_token(*sut);
  REQUIRE(fd >= 0);
  sut->unlink_socket();
  sut->unlink_socket();  // idempotent
  CHECK(entries(sut->path()) == std::vector<std::string>{"token"});
  CHECK(probe_token(fd, kWriterTokenByte) == Liveness::kAlive);  // the name stays taken
  const std::string path = sut->path();
  sut->remove();
  CHECK(sut->removed());
  CHECK_FALSE(exists(path));
  CHECK(probe_token(fd, kWriterTokenByte) == Liveness::kDead);
  sut->remove();  // idempotent
  sut->unlink_socket();
  sut.reset();
  CHECK(entries(dir.path()).empty());
  ::close(fd);
}

TEST_CASE("destroying a SocketDir removes it", "[socket_dir]") {
  vsa_test::TempDir dir;
  {
    auto sut = SocketDir::create(dir.path());
    REQUIRE(bind_socket(sut->socket_path()));
  }
  CHECK(entries(dir.path()).empty());
}

TEST_CASE("a forked child's copy of a SocketDir removes nothing", "[socket_dir][fork]") {
  vsa_test::TempDir dir;
  auto sut = SocketDir::create(dir.path());
  REQUIRE(bind_socket(sut->socket_path()));
  pid_t pid = ::fork();
  if (pid == 0) {
    sut->unlink_socket();
    sut->remove();
    sut.reset();
    ::_exit(0);
  }
  REQUIRE(vsa_test::exited_ok(vsa_test::wait_child(pid)));
  CHECK(entries(sut->path()) == std::vector<std::string>{"s", "token"});
  int fd = open_token(*sut);
  REQUIRE(fd >= 0);
  CHECK(probe_token(fd, kWriterTokenByte) == Liveness::kAlive);
  ::close(fd);
}

TEST_CASE("bad arguments to SocketDir::create are typed errors", "[socket_dir][faults]") {
  vsa_test::TempDir dir;
  CHECK_THROWS_AS(SocketDir::create(dir.path(), "a/b"), InvalidArgument);
  CHECK_THROWS_AS(SocketDir::create(""), InvalidArgument);
  CHECK_THROWS_AS(SocketDir::create("/" + std::string(100, 'x')), InvalidArgument);
  CHECK_THROWS_AS(SocketDir::create(dir.path() + "/missing"), ShmError);
  CHECK(is_socket_dir_name("vsa_sock_" + hex_of('0')));
  CHECK_FALSE(is_socket_dir_name("vsa_sock_" + hex_of('A')));
  CHECK_FALSE(is_socket_dir_name("vsa_sock_notes"));
  CHECK_FALSE(is_socket_dir_name("vsa_sock_" + hex_of('0') + "0"));
  CHECK(entries(dir.path()).empty());
}
