# The compiler cache (Debian's ccache), shared by every build tree of every clone on the machine:
# the Release tree, the sanitizer trees, the fuzz targets, the LibTorch 2.x flavour and the image
# build (docker/Dockerfile, when given the cache); and the linker (mold, at the end). Included by the top CMakeLists.txt and by
# tests/fuzz/CMakeLists.txt with ROOT, the repository's root.
#
#   ATTNSERVE_CCACHE      ON (default when ccache is installed): compile through ccache
#   ATTNSERVE_CCACHE_DIR  the cache's folder, outside the clone so that a later clean clone hits it:
#                         $ATTNSERVE_CCACHE_DIR, else ~/.cache/attnserve/ccache (default)
#
# A clone's paths must not reach the hashes, or a new clone (CI clones anew) would miss everything:
# CCACHE_BASEDIR makes the paths under the root relative (every build tree lies under it, so a source
# and its object have the same relative path in every clone), and CCACHE_NOHASHDIR leaves the
# working directory out of the hash (it only names the folder in -g's debug information, which then
# may name the clone that filled the cache). Paths the tests need at run time are in one generated
# file (tests/lib/test_paths.h), not in every test's compile flags. include_file_mtime/ctime: the
# generated protobuf headers are written seconds before they are compiled; without the sloppiness
# ccache refuses its direct mode for every file including one of them. The locale variables, which
# ccache hashes (they change the compiler's messages), are unset: the image build has none, a shell
# has LANG=C.UTF-8, and each would miss the other's objects. Each compile goes through
# compile-timer.sh (beside this file), which records its time when ATTNSERVE_COMPILE_TIMES is set.
function(attnserve_use_ccache root)
  option(ATTNSERVE_CCACHE "Compile through ccache (cmake/AttnserveCcache.cmake)" ON)
  if(NOT ATTNSERVE_CCACHE OR CMAKE_CXX_COMPILER_LAUNCHER)
    return()
  endif()
  find_program(ATTNSERVE_CCACHE_PROGRAM ccache)
  if(NOT ATTNSERVE_CCACHE_PROGRAM)
    message(STATUS "attnserve: ccache not found, compiling without a cache")
    return()
  endif()
  if(DEFINED ENV{ATTNSERVE_CCACHE_DIR})
    set(default_dir $ENV{ATTNSERVE_CCACHE_DIR})
  else()
    set(default_dir $ENV{HOME}/.cache/attnserve/ccache)
  endif()
  set(ATTNSERVE_CCACHE_DIR ${default_dir} CACHE PATH "ccache's folder, shared by every clone")
  set(CMAKE_CXX_COMPILER_LAUNCHER ${CMAKE_COMMAND} -E env --unset=LANG --unset=LC_ALL --unset=LC_CTYPE
    --unset=LC_MESSAGES CCACHE_DIR=${ATTNSERVE_CCACHE_DIR}
    CCACHE_BASEDIR=${root} CCACHE_NOHASHDIR=true
    CCACHE_SLOPPINESS=include_file_mtime,include_file_ctime ${CMAKE_CURRENT_FUNCTION_LIST_DIR}/compile-timer.sh
    ${ATTNSERVE_CCACHE_PROGRAM} PARENT_SCOPE)
  message(STATUS "attnserve: compiling through ccache in ${ATTNSERVE_CCACHE_DIR}")
endfunction()

# The linker: mold (Debian's) when installed, ~10x faster than GNU ld on these binaries (a sanitizer
# tree's test binary links in 0.2-0.3 s instead of 2.6 s; a build tree links ~30 executables, and a
# one-line change relinks most of them). ATTNSERVE_LINKER: mold (default when found), or empty for the
# compiler's default.
function(attnserve_use_fast_linker)
  find_program(ATTNSERVE_MOLD_PROGRAM mold)
  set(default "")
  if(ATTNSERVE_MOLD_PROGRAM)
    set(default mold)
  endif()
  set(ATTNSERVE_LINKER "${default}" CACHE STRING "Linker for -fuse-ld= (mold by default when found)")
  if(ATTNSERVE_LINKER)
    add_link_options(-fuse-ld=${ATTNSERVE_LINKER})
    message(STATUS "attnserve: linking with ${ATTNSERVE_LINKER}")
  endif()
endfunction()
