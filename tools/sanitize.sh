#!/usr/bin/env bash
# Runs the test binaries under sanitizers, each in its own build tree (-O1 -g1, CMakePresets.json):
#   build-asan: AddressSanitizer + UndefinedBehaviorSanitizer (leaks too): every room's unit tests
#               and the integration tests
#   build-tsan: ThreadSanitizer: the unit tests that run threads against each other (the list
#               below) and the integration tests (real server and clients). ignore_noninstrumented_modules=1: the
#               memcpy calls inside Debian's uninstrumented gRPC/protobuf/libstdc++ are not tracked,
#               since TSan cannot see those libraries' synchronization anyway; without it every
#               large message copy reported (then suppressed) a race per slice and the integration
#               tests ran ~100x slower (one stream test 290 s instead of 2 s). history_size=7
#               (the most; default 2): a report whose earlier access "failed to restore the stack"
#               cannot match the suppressions. At 4, the client stream's WritesDone tag, Set on one
#               gRPC callback thread and Run on another, escaped its suppression so in 2 of 20
#               ServerConcurrencyTest runs beside two CPU hogs; at 7, 0 of 13 (bench/RESULTS.md).
#   tools/sanitize.sh [asan|tsan]...     (default: both)
#   tools/sanitize.sh --build-only KIND  builds the tree's test binaries and stops (tools/build.sh
#                                        test builds every tree side by side before the stages)
#   tools/sanitize.sh --part units|integration [KIND]...
#                                        only the unit binaries, or only the two integration
#                                        binaries (tools/build.sh test runs the units beside ctest)
# Suppressions (tests/sanitizers/*.supp) cover third-party code only; each entry says why. Ends with
# "sanitizers: N passed, N failed".
set -euo pipefail
cd "$(dirname "$0")/.."
build_only= part=
[ "${1:-}" = --build-only ] && { build_only=1; shift; }
if [ "${1:-}" = --part ]; then
  part=${2:-}
  case "$part" in units|integration) ;; *) echo "tools/sanitize.sh: --part units|integration" >&2; exit 2 ;; esac
  shift 2
fi
kinds=("$@")
[ ${#kinds[@]} -gt 0 ] || kinds=(asan tsan)
supp="$PWD/tests/sanitizers"
passed=0 failed=0
jobs=${ATTNSERVE_SANITIZE_JOBS:-2}  # Binaries run at once (most run on one thread at a time).
# ATTNSERVE_SANITIZE_JOBS_FILE: a file whose number, when there is one, is that count, read before
# each binary starts (tools/build.sh raises it when the stage the pool runs beside has ended).
pool_jobs() {
  local f=${ATTNSERVE_SANITIZE_JOBS_FILE:-}
  if [ -n "$f" ] && [ -s "$f" ]; then cat "$f"; else echo "$jobs"; fi
}
run() {  # name, command...: in the background; its outcome is read by report
  local name=$1; shift
  # gtest's own report, for the run's slowest tests (tools/build.sh test).
  [ -z "${ATTNSERVE_TIMING_DIR:-}" ] || set -- "$@" --gtest_output="xml:$ATTNSERVE_TIMING_DIR/$name.xml"
  while [ "$(jobs -rp | wc -l)" -ge "$(pool_jobs)" ]; do
    if [ -n "${ATTNSERVE_SANITIZE_JOBS_FILE:-}" ]; then sleep 1; else wait -n || true; fi
  done
  # A temporary folder of its own (gtest's TempDir): the two kinds' integration suites run at once
  # and their tests' fixed folder names would meet. Removed when empty; a leftover stays for
  # tools/build.sh's tempfiles stage to name.
  local tmp=${TMPDIR:-/tmp}/sanitize-$name
  mkdir -p "$tmp"
  (
    start=$(date +%s)
    if TMPDIR=$tmp "$@" >"$log_dir/$name.log" 2>&1; then echo "ok $(( $(date +%s) - start ))"; else echo "FAILED"; fi >"$log_dir/$name.result"
    rmdir "$tmp" 2>/dev/null || true
  ) &
}
report() {  # name: once its run has ended
  local name=$1 result
  result=$(cat "$log_dir/$name.result" 2>/dev/null || echo FAILED)
  if [ "${result%% *}" = ok ]; then
    passed=$((passed + 1))
    echo "sanitizers: $name passed ($(grep -h -o '\[  PASSED  \] [0-9]* tests' "$log_dir/$name.log" | tail -1), ${result#ok } s)"
  else
    failed=$((failed + 1)); echo "sanitizers: $name FAILED"; grep -h -B2 -A30 -m3 -E 'ERROR: |WARNING: ThreadSanitizer|runtime error|FAILED' "$log_dir/$name.log" | head -80 || true
  fi
}
# One unit-test binary per room (tests/CMakeLists.txt): AddressSanitizer runs them all.
# ThreadSanitizer runs the tests that run threads against each other: the binaries of the rooms
# whose tests do (models: reloads under readers; trace: the exporter's thread; kv: four threads and a
# clock on one store; pipeline: the batcher's workers; grpc: the call counter; protocol: the OIP's
# sequences; process: the socket lingering), and the engine's tests with threads (their own binary,
# attnserve_engine_threads_tests: four threads on one model, helper threads, the host staging).
# BINARY:FILTER (gtest's filter) runs part of a binary.
# docs/tests.md, "Which stage runs what".
unit=(attnserve_engine_tests attnserve_engine_threads_tests attnserve_kv_tests attnserve_models_tests attnserve_pipeline_tests attnserve_process_tests
  attnserve_weights_tests attnserve_v1_tests attnserve_grpc_tests attnserve_protocol_tests attnserve_http_tests attnserve_trace_tests
  attnserve_core_tests attnserve_tenants_tests attnserve_shm_tests)
# Longest first (seconds under ThreadSanitizer on 2 cores: engine 39, kv 33, models 22, pipeline 15),
# so that no long binary starts last and runs alone: the stage took 120 s with the engine's last.
threaded=(attnserve_engine_threads_tests attnserve_kv_tests attnserve_models_tests
  attnserve_pipeline_tests attnserve_process_tests attnserve_grpc_tests attnserve_protocol_tests attnserve_trace_tests)
# Every kind's tree built first, then all their binaries in one pool of $jobs, the two integration
# suites (the longest: ~140-160 s each, against ~10-40 for the others) first: run kind by kind,
# each kind waited on its integration suite while its other lane idled (318 s for ~520 s of runs).
export ASAN_OPTIONS="detect_leaks=1:abort_on_error=0:detect_stack_use_after_return=0"
export LSAN_OPTIONS="suppressions=$supp/lsan.supp:print_suppressions=0"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:suppressions=$supp/ubsan.supp"
export TSAN_OPTIONS="suppressions=$supp/tsan.supp:halt_on_error=1:second_deadlock_stack=1:history_size=7:ignore_noninstrumented_modules=1"
first=() rest=()
for kind in "${kinds[@]}"; do
  case "$kind" in
    asan) targets=(attnserve_integration_tests "${unit[@]}") ;;
    tsan) targets=(attnserve_integration_tests "${threaded[@]}") ;;
    *) echo "usage: tools/sanitize.sh [--build-only | --part units|integration] [asan|tsan]..." >&2; exit 2 ;;
  esac
  build=build-$kind
  # CMakePresets.json's asan and tsan presets (ATTNSERVE_SANITIZE, no benchmarks). Always
  # configured (a second time costs seconds): building named targets in a tree configured before
  # they existed would stop at "No rule to make target".
  cmake --preset "$kind" >/dev/null
  cmake --build --preset "$kind" -j"${ATTNSERVE_BUILD_JOBS:-$(nproc)}" --target "${targets[@]%%:*}" >/dev/null
  mkdir -p "$build/logs"
  for t in "${targets[@]}"; do
    if [ "${t%%:*}" = attnserve_integration_tests ]; then
      [ "$part" = units ] || first+=("$kind:$t")
    else
      [ "$part" = integration ] || rest+=("$kind:$t")
    fi
  done
done
[ -z "$build_only" ] || exit 0
names=()
for kt in ${first[@]+"${first[@]}"} ${rest[@]+"${rest[@]}"}; do
  kind=${kt%%:*} t=${kt#*:}
  log_dir=build-$kind/logs
  bin=${t%%:*} filter=()
  [ "$bin" = "$t" ] || filter=(--gtest_filter="${t#*:}")
  rm -f "$log_dir/$kind-${bin#attnserve_}.result"
  run "$kind-${bin#attnserve_}" "build-$kind/tests/$bin" ${filter[@]+"${filter[@]}"}
  names+=("$kind-${bin#attnserve_}")
done
wait
for name in "${names[@]}"; do log_dir=build-${name%%-*}/logs report "$name"; done
echo "sanitizers: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
