#!/usr/bin/env bash
# The two README commands:
#   tools/build.sh run    install dependencies, build, serve the demo model on 127.0.0.1:50051
#                         (metrics on 127.0.0.1:9464); extra arguments go to attnserve
#   tools/build.sh test   install dependencies, build, run every test: ctest with a bounded fuzz run
#                         (tools/fuzz.sh, 8 s a target) and the sanitizers' unit binaries
#                         (tools/sanitize.sh --part units) beside it, the attack test alone, the
#                         sanitizers' integration binaries, then the tests labelled torch again on the
#                         LibTorch 2.x flavour (stage torch2); extra arguments go to ctest (then the
#                         stages run one after another, the attack test within ctest's).
#                         ATTNSERVE_QUICK=1 runs the first ctest only.
# Configuration, builds and test selections are CMakePresets.json's (cmake --list-presets, ctest
# --list-presets: e.g. `ctest --preset unit` after a build); this script installs what they need,
# runs them in stages, and sums the stages up.
# Flavours (ATTNSERVE_FLAVOUR): `debian` (default): Debian's LibTorch 1.13, CPU, in build/;
# `torch2`: PyPI's torch 2.11 (LibTorch 2.x, CUDA-enabled, runs on the CPU here) from
# tools/torch2-env.sh, in build-torch2, its tests' Python peers from that environment.
#   ATTNSERVE_FLAVOUR=torch2 tools/build.sh run|test    serve with, or test only, the 2.x flavour
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
# The compiler cache (cmake/AttnserveCcache.cmake) lives outside the clone, so a later clean clone on
# this machine hits it; every build tree of every clone shares it. 5 GB holds many times the objects
# of all the trees (docs/tests.md, "The compiler cache and the shared environments").
export ATTNSERVE_CCACHE_DIR=${ATTNSERVE_CCACHE_DIR:-$HOME/.cache/attnserve/ccache}
export CCACHE_DIR=$ATTNSERVE_CCACHE_DIR  # For the ccache calls below; the builds' launcher names it too.
mkdir -p "$ATTNSERVE_CCACHE_DIR"
ccache_stats() { ccache --print-stats 2>/dev/null | awk '
  $1 ~ /^(direct_cache_hit|preprocessed_cache_hit)$/ {h += $2} $1 == "cache_miss" {m += $2}
  END {print h + 0, m + 0}'; }
if [ "$(ccache --get-config max_size)" != 5.0G ]; then
  ccache --max-size 5G >/dev/null
fi
read -r ccache_hits0 ccache_misses0 < <(ccache_stats)
ccache_report() {  # This command's compiles: hits, misses, the hit rate, the cache's size.
  local h m
  read -r h m < <(ccache_stats)
  h=$((h - ccache_hits0)) m=$((m - ccache_misses0))
  echo "ccache: $h hits, $m misses ($(( (h + m) > 0 ? 100 * h / (h + m) : 0 ))% hit rate) in $ATTNSERVE_CCACHE_DIR," \
    "$(ccache --print-stats | awk '$1 == "cache_size_kibibyte" {printf "%.0f MiB", $2 / 1024}') of $(ccache --get-config max_size)"
}
# Every compile's time, every tree's (cmake/compile-timer.sh); compile_report sums them up: where a
# cold run's compile time goes, for the next cut (docs/tests.md).
export ATTNSERVE_COMPILE_TIMES=$PWD/build/compile-times.log
mkdir -p build && : >"$ATTNSERVE_COMPILE_TIMES"
compile_report() {
  [ -s "$ATTNSERVE_COMPILE_TIMES" ] || return 0
  /usr/bin/python3 - "$ATTNSERVE_COMPILE_TIMES" "$PWD" <<'PY'
import collections, sys
rows = [l.split(" ", 2) for l in open(sys.argv[1]) if l.count(" ") >= 2]
rows = [(int(cpu) / 1000, int(wall) / 1000, path.strip().replace(sys.argv[2] + "/", ""))
        for cpu, wall, path in rows]
trees = collections.Counter()
for cpu, _, path in rows:
    trees[path.split("/", 1)[0]] += cpu
print(f"compiles: {len(rows)}, {sum(r[0] for r in rows):.0f} s of compiler CPU time: " +
      ", ".join(f"{t} {s:.0f} s" for t, s in trees.most_common()))
for cpu, wall, path in sorted(rows, reverse=True)[:12]:
    print(f"  {cpu:6.1f} s CPU ({wall:.1f} s wall)  {path}")
PY
}
flavour=${ATTNSERVE_FLAVOUR:-debian}
torch2_build=build-torch2
configure() {  # flavour: makes sure of the flavour's environment, configures once (CMakePresets.json), builds
  local f=$1
  case "$f" in
    debian) [ -f build/CMakeCache.txt ] || cmake --preset debian ;;
    torch2)
      ATTNSERVE_TORCH2_VENV=$(tools/torch2-env.sh)  # Returns at once when the pinned environment is there.
      ATTNSERVE_TORCH2_PREFIX=$("$ATTNSERVE_TORCH2_VENV/bin/python" -c 'import torch; print(torch.utils.cmake_prefix_path)')
      export ATTNSERVE_TORCH2_VENV ATTNSERVE_TORCH2_PREFIX
      [ -f "$torch2_build/CMakeCache.txt" ] || cmake --preset torch2 ;;
    *) echo "tools/build.sh: ATTNSERVE_FLAVOUR is debian or torch2, not '$f'" >&2; exit 2 ;;
  esac
  cmake --build --preset "$f" -j"${ATTNSERVE_BUILD_JOBS:-$(nproc)}"
}
build=build
[ "$flavour" = torch2 ] && build=$torch2_build
configure "$flavour"

if [ "$verb" = run ]; then
  exec "$build/attnserve" "$@"
fi
# The trees the later stages test (the sanitizers', the fuzz targets', the LibTorch 2.x flavour's
# with its environment), built side by side before any test runs, each with -j$(nproc): a change in
# one file recompiles it once per tree, and those single compiles, run one tree after another, left
# a core idle (~1 min of a warm run); on a cold run the 2.x environment's download overlaps the
# compiles, and no core waits for the largest tree (at -j1 each, AddressSanitizer's tree compiled
# alone on one core for its last ~15 minutes: 1,602 s in all). A failure here is only said: the
# stage that needs the tree builds it again and fails.
# With the whole suite to run (no ctest arguments), the tests' Python environments and the
# container image are made here too: their downloads (pip, Debian's mirror inside the image) wait
# on the network while the compilers use the cores, instead of inside the tests (~2 minutes of a
# cold run's ctest stage); the tests then find them made and every image layer cached.
prebuild() {
  local logs pids=() names=(asan tsan fuzz torch2) i
  logs=$(mktemp -d)
  local start; start=$(date +%s)
  # (Giving AddressSanitizer's tree the cores first, the others niced, did not shorten it: 1,658 s
  # against 1,605 s cold; docs/tests.md.)
  tools/sanitize.sh --build-only asan >"$logs/asan" 2>&1 & pids+=($!)
  tools/sanitize.sh --build-only tsan >"$logs/tsan" 2>&1 & pids+=($!)
  tools/fuzz.sh --build-only >"$logs/fuzz" 2>&1 & pids+=($!)
  (configure torch2) >"$logs/torch2" 2>&1 & pids+=($!)
  if [ "$#" = 0 ]; then
    names+=(python-envs image)
    (for e in debian newest tracing; do tools/python-env.sh $e; done
     for e in triton kserve; do tools/oip-env.sh $e; done) >"$logs/python-envs" 2>&1 & pids+=($!)
    bash tests/container/container_test.sh --build-only >"$logs/image" 2>&1 & pids+=($!)
  fi
  for i in "${!pids[@]}"; do
    wait "${pids[$i]}" || { echo "build of ${names[$i]} failed (its stage builds it again):"; tail -20 "$logs/${names[$i]}"; }
  done
  rm -rf "$logs"
  echo "built the ${names[*]} side by side in $(( $(date +%s) - start )) s"
}
[ "$flavour" = torch2 ] || [ -n "${ATTNSERVE_QUICK:-}" ] || prebuild "$@"
# Every stage runs even when one fails; the last line sums them up.
# Every process the stages start carries this marker in its environment: tools/leftover_processes.py
# finds those still running at the end (a daemon a test left behind) and fails the run.
export ATTNSERVE_TEST_RUN="$$-$(date +%s%N)"
# JUnit reports of every stage, for the slowest tests at the end (tools/slowest_tests.py).
export ATTNSERVE_TIMING_DIR; ATTNSERVE_TIMING_DIR=$(mktemp -d)
# The tests' temporary files: every stage runs with TMPDIR set to a folder of this run's own (sticky
# and world-writable like /tmp: some tests drop to another uid), removed at the end; stage tempfiles
# fails naming whatever a test left in it (before, every run left its stubs, models and fixtures in
# /tmp: 6.4 GB over a day of runs on this machine).
tests_tmp=$(mktemp -d "${TMPDIR:-/tmp}/attnserve-tests.XXXXXX")
chmod 1777 "$tests_tmp"
trap 'rm -rf "$ATTNSERVE_TIMING_DIR" "$tests_tmp"' EXIT
touch "$ATTNSERVE_TIMING_DIR/.start"
run_start=$(date +%s)
passed=0 failed=0 skipped=0
summary=() timings=()
failures=""  # What failed, repeated just above the summary: CI keeps only the log's tail.
stage() {  # name, command...: counts ctest's JUnit report, or the stage's own "N passed, N failed".
  local name=$1; shift
  local log junit; log=$(mktemp) junit=$ATTNSERVE_TIMING_DIR/$name.xml
  local args=("$@") start; start=$(date +%s)
  [ "$1" = ctest ] && args+=(--output-junit "$junit")
  set +e
  TMPDIR=$tests_tmp "${args[@]}" 2>&1 | tee "$log"
  local rc=${PIPESTATUS[0]}
  set -e
  local p f s=0
  if [ "$1" = ctest ] && [ -s "$junit" ]; then
    # One test per ctest entry, a unit binary's gtest cases one each (tools/junit_counts.py).
    local tests_dir=build/tests
    [[ " ${args[*]} " == *" --preset torch2"* ]] && tests_dir=$torch2_build/tests
    read -r p f s < <(/usr/bin/python3 tools/junit_counts.py "$junit" "$tests_dir" "$ATTNSERVE_TIMING_DIR/.start" \
      || echo "0 1 0")
  else
    p=$(grep -oE '[0-9]+ passed, [0-9]+ failed' "$log" | tail -1 | grep -oE '^[0-9]+' || echo 0)
    f=$(grep -oE '[0-9]+ passed, [0-9]+ failed' "$log" | tail -1 | grep -oE '[0-9]+ failed' | grep -oE '[0-9]+' || echo 1)
  fi
  [ "$rc" -eq 0 ] || [ "$f" -gt 0 ] || f=1
  passed=$((passed + p)) failed=$((failed + f)) skipped=$((skipped + s))
  summary+=("$name $p/$((p + f))")
  [ "$s" = 0 ] || summary[-1]+=" ($s skipped)"
  echo "stage $name: $(( $(date +%s) - start )) s"
  timings+=("$name $(( $(date +%s) - start ))s")
  if [ "$f" -gt 0 ]; then
    failures+="--- $name: what failed"$'\n'
    failures+=$(grep -E 'FAILED|^FAIL |Failure$|Expected|Which is|Value of|ERROR: |WARNING: ThreadSanitizer|runtime error|Error|Timeout' "$log" | head -40 || true)$'\n'
  fi
  rm -f "$log"
}
# Every tracked C++ file as .clang-format lays it out (clang-format 14, Debian's): one line per file
# that differs, then "N passed, N failed" over the files. Checked 20 files a process, two at once
# (~2 s; a process per file took 10 s); each file alone only when a batch differs.
format_check() {
  local files=() bad=0 f
  mapfile -t files < <(git ls-files '*.cc' '*.h')
  if ! printf '%s\n' "${files[@]}" | xargs -P"$(nproc)" -n 20 clang-format --dry-run -Werror >/dev/null 2>&1; then
    for f in "${files[@]}"; do
      if ! clang-format --dry-run -Werror "$f" >/dev/null 2>&1; then
        echo "FAIL format: $f differs from .clang-format (fix: clang-format -i $f)"
        bad=$((bad + 1))
      fi
    done
    [ "$bad" -gt 0 ] || bad=1  # The batch failed on something no single file shows: say so.
  fi
  echo "format: $((${#files[@]} - bad)) passed, $bad failed"
}
# The 2.x flavour runs the tests whose outcome depends on LibTorch (ctest label torch); run alone
# (ATTNSERVE_FLAVOUR=torch2) it runs them all. docs/tests.md says which stage runs what.
torch2_stage() { stage torch2 ctest --preset "$1" "${@:2}"; }
# The whole suite's first ctest stage, with work that does not depend on time beside it: ctest's
# tests wait on servers, peers and stops for part of their time (1.6 of 2 cores busy over the
# stage). First the bounded fuzz run, one target at a time (bounded by time, not work: its stage of
# its own took ~50 s), then the sanitizers' unit binaries, one at a time (~190 s of CPU: the
# sanitizer stage then runs the two integration binaries only). Then the attack test alone, as it
# needs (tests/CMakeLists.txt).
ctest_beside_others() {
  local fuzz_log units_log jobs_file start
  fuzz_log=$(mktemp) units_log=$(mktemp) jobs_file=$(mktemp) start=$(date +%s)
  echo 1 >"$jobs_file"
  (ATTNSERVE_FUZZ_JOBS=1 TMPDIR=$tests_tmp tools/fuzz.sh >"$fuzz_log" 2>&1 || true
   echo "fuzz: ended $(( $(date +%s) - start )) s into ctest's stage" >>"$fuzz_log"
   ATTNSERVE_SANITIZE_JOBS_FILE=$jobs_file TMPDIR=$tests_tmp tools/sanitize.sh --part units \
     >"$units_log" 2>&1 || true
   echo "sanitizers: the unit binaries ended $(( $(date +%s) - start )) s into ctest's stage" \
     >>"$units_log") &
  local pid=$!
  stage ctest ctest --test-dir build --output-on-failure -j2 -E '^attack$'
  echo 2 >"$jobs_file"  # What is left of the unit binaries then runs two at a time.
  wait "$pid" || true
  stage fuzz cat "$fuzz_log"
  stage sanitizer-units cat "$units_log"
  rm -f "$fuzz_log" "$units_log" "$jobs_file"
  stage attack ctest --test-dir build --output-on-failure -R '^attack$'
}
if [ "$flavour" = torch2 ]; then
  torch2_stage torch2 "$@"
else
  stage format format_check
  if [ -z "${ATTNSERVE_QUICK:-}" ] && [ $# = 0 ]; then
    ctest_beside_others
    stage sanitizers tools/sanitize.sh --part integration
  else
    stage ctest ctest --test-dir build --output-on-failure -j2 "$@"
    [ -n "${ATTNSERVE_QUICK:-}" ] || stage sanitizers tools/sanitize.sh
  fi
  if [ -z "${ATTNSERVE_QUICK:-}" ]; then
    [ $# = 0 ] || stage fuzz tools/fuzz.sh
    configure torch2
    torch2_stage torch2-torch "$@"
  fi
fi
stage processes /usr/bin/python3 tools/leftover_processes.py "$ATTNSERVE_TEST_RUN" $$
# What the tests left in their TMPDIR, each named (its prefix names the test that made it). Caches
# kept there by design are not counted: pytest's pytest-of-USER (its last three runs' folders) and
# PyTorch 2.x's torchinductor_USER.
leftover_tempfiles() {
  local left=() f
  mapfile -t left < <(find "$tests_tmp" -mindepth 1 -maxdepth 1 ! -name 'pytest-of-*' ! -name 'torchinductor_*' \
    -printf '%f\n' | sort)
  for f in "${left[@]}"; do
    echo "FAIL tempfiles: $f ($(du -sh "$tests_tmp/$f" | cut -f1)) left in the tests' TMPDIR"
  done
  echo "tempfiles: $(( ${#left[@]} == 0 )) passed, $(( ${#left[@]} > 0 )) failed"
}
stage tempfiles leftover_tempfiles
# ctest's reports, the sanitizers' gtest reports, and the reports of the pytest files and gtest
# binaries ctest ran whole (written this run).
mapfile -t inner < <(find build/tests "$torch2_build/tests" -maxdepth 1 \( -name 'pytest-*.xml' -o \
  -name 'gtest-*.xml' \) -newer "$ATTNSERVE_TIMING_DIR/.start" 2>/dev/null)
/usr/bin/python3 tools/slowest_tests.py -n 20 --over 30 "$ATTNSERVE_TIMING_DIR"/*.xml ${inner[@]+"${inner[@]}"} || true
ccache_report
compile_report
[ -z "$failures" ] || printf '%s' "$failures"
echo "stages: ${summary[*]}"
echo "times: ${timings[*]}, total $(( $(date +%s) - run_start ))s"
echo "attnserve: $passed passed, $failed failed, $skipped skipped"
[ "$failed" -eq 0 ]
