// Catch2 v2 (Debian 12) and v3 (Debian 13) expose different headers; tests include this one.
#pragma once
#if __has_include(<catch2/catch_all.hpp>)
#include <catch2/catch_all.hpp>
#define VSA_CATCH_V3 1
#else
#include <catch2/catch.hpp>
#define VSA_CATCH_V3 0
#endif
