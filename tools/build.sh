#!/usr/bin/env bash
# The two README commands:
#   tools/build.sh run    install dependencies, build, serve the demo model on 127.0.0.1:50051
#                         (metrics on 127.0.0.1:9464); extra arguments go to attnserve
#   tools/build.sh test   install dependencies, build, run every test (ctest)
# Both are idempotent: a second call installs nothing and rebuilds only what changed.
set -euo pipefail
cd "$(dirname "$0")/.."
verb=${1:-}
[ $# -gt 0 ] && shift
case "$verb" in
  run|test) ;;
  *) echo "usage: tools/build.sh run [attnserve flags...] | tools/build.sh test [ctest flags...]" >&2; exit 2 ;;
esac

bash tools/install-deps.sh
build=${ATTNSERVE_BUILD_DIR:-build}
if [ ! -f "$build/CMakeCache.txt" ]; then
  cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release
fi
cmake --build "$build" -j"$(nproc)"

if [ "$verb" = run ]; then
  exec "$build/attnserve" "$@"
fi
exec ctest --test-dir "$build" --output-on-failure -j2 "$@"
