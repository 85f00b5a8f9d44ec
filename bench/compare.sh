#!/usr/bin/env bash
# Two attnserve binaries side by side on bench/run.sh's W1 (32 callers, L 8-64) and W3 (one caller,
# L=128), the batching server on default flags, alternating OLD and NEW every round so that both see
# the same machine; prints each round and the median NEW / OLD ratios (tokens/s, p50, p99).
#   bench/compare.sh OLD_ATTNSERVE NEW_ATTNSERVE [ROUNDS (3)]
# For a change that should not move speed (a refactor): ratios within the rounds' own spread.
# SERVER_ARGS: more flags for both servers (e.g. "--dtype bfloat16"); BENCH_ARGS: more for the
# load (e.g. "--wire-dtype bfloat16"). WITH_W2=1 adds W2 (32 callers, L 16-512, half
# cross-attention), the workload where attention's own products outweigh the projections.
set -euo pipefail
cd "$(dirname "$0")/.."
old=$1 new=$2 rounds=${3:-3}
build=${ATTNSERVE_BUILD_DIR:-build}
duration=${BENCH_DURATION:-5}
out=bench/out-compare
rm -rf "$out" && mkdir -p "$out"
cmake --build "$build" -j"$(nproc)" --target attnserve_bench >/dev/null
port=50073
pid=
stop() { if [ -n "$pid" ]; then kill -TERM "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; pid=; fi; }
trap stop EXIT
for round in $(seq "$rounds"); do
  for which in old new; do
    binary=$old; [ "$which" = new ] && binary=$new
    # shellcheck disable=SC2086
    # A binary from before the HTTP port has no --http-address.
    http=(); "$binary" --help 2>/dev/null | grep -q -- --http-address && http=(--http-address "")
    "$binary" --address 127.0.0.1:$port --metrics-address "" "${http[@]}" ${SERVER_ARGS:-} >"$out/server.log" 2>&1 & pid=$!
    for _ in $(seq 300); do grep -q serving "$out/server.log" 2>/dev/null && break; sleep 0.2; done
    "$build/attnserve-bench" --target 127.0.0.1:$port --label "$which/W1/r$round" --warmup 2 \
      --json "$out/results.jsonl" --duration "$duration" --callers 32 --lengths uniform:8:64 ${BENCH_ARGS:-} >/dev/null
    "$build/attnserve-bench" --target 127.0.0.1:$port --label "$which/W3/r$round" --warmup 2 \
      --json "$out/results.jsonl" --duration "$duration" --callers 1 --lengths fixed:128 ${BENCH_ARGS:-} >/dev/null
    if [ -n "${WITH_W2:-}" ]; then
      "$build/attnserve-bench" --target 127.0.0.1:$port --label "$which/W2/r$round" --warmup 2 \
        --json "$out/results.jsonl" --duration "$duration" --callers 32 --lengths uniform:16:512 \
        --cross 0.5 --pool 48 ${BENCH_ARGS:-} >/dev/null
    fi
    stop
  done
done
/usr/bin/python3 - "$out/results.jsonl" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
by = {}
for r in rows:
    which, workload, rnd = r["label"].split("/")
    by.setdefault(workload, {}).setdefault(rnd, {})[which] = r
print(f"{'workload':8} {'round':5} {'old tok/s':>10} {'new tok/s':>10} {'new/old':>8} {'p50 new/old':>11} {'p99 new/old':>11}")
for workload, rounds in by.items():
    ratios = {"tok": [], "p50": [], "p99": []}
    for rnd, pair in sorted(rounds.items()):
        o, n = pair["old"], pair["new"]
        t = n["tokens_per_s"] / o["tokens_per_s"]
        p50 = n["latency_ms"]["p50"] / o["latency_ms"]["p50"]
        p99 = n["latency_ms"]["p99"] / o["latency_ms"]["p99"]
        for k, v in zip(ratios, (t, p50, p99)):
            ratios[k].append(v)
        print(f"{workload:8} {rnd:5} {o['tokens_per_s']:10.0f} {n['tokens_per_s']:10.0f} {t:8.3f} "
              f"{p50:11.3f} {p99:11.3f}")
    print(f"{workload:8} {'median':5} {'':10} {'':10} {statistics.median(ratios['tok']):8.3f} "
          f"{statistics.median(ratios['p50']):11.3f} {statistics.median(ratios['p99']):11.3f}")
PY
