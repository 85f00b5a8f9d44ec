#pragma once

// Paths the tests need at run time, written by tests/CMakeLists.txt into one generated file of the
// build tree (test_paths.cc). Kept out of every test's compile flags so that the compiler cache
// (cmake/AttnserveCcache.cmake) hits them from a clone in another folder.

namespace attnserve::test_paths {

/// tests/data in the source tree.
extern const char* const kTestDataDir;
/// The repository's root.
extern const char* const kSourceDir;
/// The attnserve binary of this build tree.
extern const char* const kServerBinary;

}  // namespace attnserve::test_paths
