// Tests of ShmRegion (shm_region.cpp).
#include "core/shm_region.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstring>

#include "catch_compat.hpp"
#include "core/errors.h"
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
