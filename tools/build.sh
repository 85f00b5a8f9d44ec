#!/usr/bin/env bash
# The two README commands:
#   tools/build.sh run    install dependencies, build, serve the demo model on 127.0.0.1:50051
#                         (metrics on 127.0.0.1:9464); extra arguments go to attnserve
#   tools/build.sh test   install dependencies, build, run every test: ctest, then the sanitizer runs
#                         (tools/sanitize.sh) and a bounded fuzz run (tools/fuzz.sh, 30 s a target);
#                         extra arguments go to ctest. ATTNSERVE_QUICK=1 runs ctest only.
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
# Every stage runs even when one fails; the last line sums them up.
passed=0 failed=0
summary=()
stage() {  # name, command...: counts the stage's own "N passed, N failed" or ctest's tally.
  local name=$1; shift
  local log; log=$(mktemp)
  set +e
  "$@" 2>&1 | tee "$log"
  local rc=${PIPESTATUS[0]}
  set -e
  local p f
  if grep -qE '^[0-9]+% tests passed, [0-9]+ tests failed out of [0-9]+' "$log"; then
    f=$(grep -oE '[0-9]+ tests failed out of' "$log" | tail -1 | grep -oE '^[0-9]+')
    p=$(( $(grep -oE 'out of [0-9]+' "$log" | tail -1 | grep -oE '[0-9]+$') - f ))
  else
    p=$(grep -oE '[0-9]+ passed, [0-9]+ failed' "$log" | tail -1 | grep -oE '^[0-9]+' || echo 0)
    f=$(grep -oE '[0-9]+ passed, [0-9]+ failed' "$log" | tail -1 | grep -oE '[0-9]+ failed' | grep -oE '[0-9]+' || echo 1)
  fi
  [ "$rc" -eq 0 ] || [ "$f" -gt 0 ] || f=1
  passed=$((passed + p)) failed=$((failed + f))
  summary+=("$name $p/$((p + f))")
  rm -f "$log"
}
stage ctest ctest --test-dir "$build" --output-on-failure -j2 "$@"
if [ -z "${ATTNSERVE_QUICK:-}" ]; then
  stage sanitizers tools/sanitize.sh
  stage fuzz tools/fuzz.sh
fi
echo "stages: ${summary[*]}"
echo "attnserve: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
