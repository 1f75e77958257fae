#pragma once

// TORCHMHA_API marks what libtorchmha exports: the public classes and functions of the headers in
// include/torchmha. The library is built with hidden visibility (CMakeLists.txt), so everything
// else, the private core in csrc/core included, stays internal to it.

#if defined(_WIN32)
#if defined(TORCHMHA_BUILDING_LIBRARY)
#define TORCHMHA_API __declspec(dllexport)
#else
#define TORCHMHA_API __declspec(dllimport)
#endif
#else
#define TORCHMHA_API __attribute__((visibility("default")))
#endif
