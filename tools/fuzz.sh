#!/usr/bin/env bash
# Builds the libFuzzer targets (tests/fuzz, clang) and runs each one, bounded (kv_store: the
# key/value store and engine driven by operation sequences, tests/lib/kv_model_check.h):
#   tools/fuzz.sh                 8 s per target (what `tools/build.sh test` runs)
#   tools/fuzz.sh --seconds N     N s per target
#   tools/fuzz.sh --runs N        N executions per target (the long run: --runs 10000000)
#   tools/fuzz.sh --build-only     builds the targets and stops
#   tools/fuzz.sh ... TARGET...   only these targets (request safetensors config torch_archive kv_store scheduler tenants h2_inspector http_infer)
# New inputs go to a corpus per target outside the clone, ~/.cache/attnserve/fuzz/corpus-<target>
# (ATTNSERVE_FUZZ_HOME), seeded from tests/fuzz/corpus/<target>: every run on this machine, from any
# clone, starts where the last one stopped, so the 10 s of each test command add up instead of
# starting again from the seeds (a clean clone lost them when they lay in build-fuzz/). A crash
# leaves its input as build-fuzz/crash-* and fails the run. Targets run side by side, one a core. Prints executions and the corpus's size per
# target and ends with "fuzz: N passed, N failed".
set -euo pipefail
cd "$(dirname "$0")/.."
limit=(-max_total_time=8)
build_only=
case "${1:-}" in
  --build-only) build_only=1; shift ;;
  --seconds) limit=(-max_total_time="$2"); shift 2 ;;
  --runs) limit=(-runs="$2"); shift 2 ;;
esac
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(request safetensors config torch_archive kv_store scheduler tenants h2_inspector http_infer)
for t in "${targets[@]}"; do
  case "$t" in
    request|safetensors|config|torch_archive|kv_store|scheduler|tenants|h2_inspector|http_infer) ;;
    *) echo "usage: tools/fuzz.sh [--seconds N | --runs N] [TARGET...]" >&2; exit 2 ;;
  esac
done
build=build-fuzz
if [ ! -f "$build/CMakeCache.txt" ]; then
  cmake -S tests/fuzz -B "$build" -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
fi
cmake --build "$build" -j"${ATTNSERVE_BUILD_JOBS:-$(nproc)}" >/dev/null
[ -z "$build_only" ] || exit 0
corpora=${ATTNSERVE_FUZZ_HOME:-$HOME/.cache/attnserve/fuzz}
# Targets run side by side, one per core (each libFuzzer process is one thread): on 2 cores the
# seven targets' 8 s take ~32 s of wall time instead of ~60 s. ATTNSERVE_FUZZ_JOBS sets how many.
jobs=${ATTNSERVE_FUZZ_JOBS:-$(nproc)}
fuzz_one() {  # target: runs it; its log says how it went
  local t=$1 corpus=$corpora/corpus-$1 seeds=() max_len=65536
  mkdir -p "$corpus"
  [ -d "tests/fuzz/corpus/$t" ] && seeds=("$PWD/tests/fuzz/corpus/$t")
  # rss_limit bounds memory per input; max_len 64 KiB keeps archives and requests realistic; the
  # store's inputs are operation sequences (a few bytes each, at most 256 operations).
  [ "$t" = kv_store ] && max_len=1024
  [ "$t" = scheduler ] && max_len=4096
  [ "$t" = tenants ] && max_len=160
  # A corpus that has grown past 2,000 inputs (a long run's) is merged down to the inputs that add
  # coverage first: loading 5,005 inputs of the tenants target took all of its 8 s.
  if [ "$(find "$corpus" -type f | wc -l)" -gt "${ATTNSERVE_FUZZ_CORPUS_MAX:-2000}" ]; then
    rm -rf "$corpus.merged" && mkdir -p "$corpus.merged"
    (cd "$build" && ./fuzz_"$t" -merge=1 -rss_limit_mb=2048 -max_len=$max_len "$corpus.merged" "$corpus") \
      >"$build/fuzz_$t.merge.log" 2>&1 && rm -rf "$corpus" && mv "$corpus.merged" "$corpus"
  fi
  if (cd "$build" && ./fuzz_"$t" "${limit[@]}" -rss_limit_mb=2048 -max_len=$max_len -print_final_stats=1 \
        -artifact_prefix=./crash-"$t"- "$corpus" ${seeds[@]+"${seeds[@]}"}) >"$build/fuzz_$t.log" 2>&1; then
    echo ok >"$build/fuzz_$t.result"
  else
    echo FAILED >"$build/fuzz_$t.result"
  fi
}
for t in "${targets[@]}"; do
  rm -f "$build/fuzz_$t.result"
  while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n || true; done
  fuzz_one "$t" &
done
wait
passed=0 failed=0
for t in "${targets[@]}"; do
  log="$build/fuzz_$t.log"
  if [ "$(cat "$build/fuzz_$t.result" 2>/dev/null)" = ok ]; then
    passed=$((passed + 1))
    echo "fuzz $t: $(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$') executions, no crash" \
      "(corpus: $(find "$corpora/corpus-$t" -type f | wc -l) inputs in $corpora/corpus-$t)"
  else
    failed=$((failed + 1))
    echo "fuzz $t: FAILED"; tail -40 "$log"
  fi
done
echo "fuzz: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
