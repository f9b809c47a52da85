// Catch2 v2 (Debian 12) and v3 (Debian 13) expose different headers; tests include this one.
#pragma once
#if __has_include(<catch2/catch_all.hpp>)
#include <catch2/catch_all.hpp>
#define VSA_CATCH_V3 1
#else
#include <catch2/catch.hpp>
#define VSA_CATCH_V3 0
#endif

#include <cstdio>

/// Skips the rest of a test case with a reason that `make test` prints: a WARN for Catch2's
/// report and a "SKIPPED" line on stdout, so skips are visible even when everything passes.
#define VSA_SKIP(reason)                                                                     \
  do {                                                                                       \
    WARN(reason);                                                                            \
    std::printf("SKIPPED: %s: %s\n", Catch::getResultCapture().getCurrentTestName().c_str(), \
                reason);                                                                     \
    std::fflush(stdout);                                                                     \
  } while (0)
