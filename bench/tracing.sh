#!/usr/bin/env bash
# Tracing's cost, side by side in one run: the same attnserve with tracing off (no --trace-endpoint),
# on but sampling nothing (--trace-rate 0, callers send no traceparent), and every call traced
# (--trace-rate 1: five spans a request plus the batches', exported to a live collector), on
# bench/run.sh's W1 (32 callers, L 8-64) and W3 (one caller, L=128), the three alternating every
# round. The collector is tests/tracing/otlp_receiver.py (opentelemetry-proto, decoding and
# counting every span), in tools/python-env.sh's tracing environment. Prints each round and the
# median ratios against "off" (tokens/s, p50, p99), and the spans the collector took.
#   bench/tracing.sh [ROUNDS (3)]
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
build=${ATTNSERVE_BUILD_DIR:-build}
duration=${BENCH_DURATION:-5}
out=bench/out-tracing
rm -rf "$out" && mkdir -p "$out"
cmake --build "$build" -j"$(nproc)" --target attnserve attnserve_bench >/dev/null
venv=$(tools/python-env.sh tracing)
"$venv/bin/python" tests/tracing/otlp_receiver.py --port-file "$out/collector.port" --count-only \
  >"$out/collector.log" 2>&1 &
collector=$!
port=50074
pid=
stop() { if [ -n "$pid" ]; then kill -TERM "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; pid=; fi; }
trap 'stop; kill $collector 2>/dev/null || true' EXIT
for _ in $(seq 100); do [ -f "$out/collector.port" ] && break; sleep 0.1; done
endpoint=127.0.0.1:$(cat "$out/collector.port")
for round in $(seq "$rounds"); do
  for which in off rate0 rate1; do
    flags=()
    [ "$which" = rate0 ] && flags=(--trace-endpoint "$endpoint" --trace-rate 0)
    [ "$which" = rate1 ] && flags=(--trace-endpoint "$endpoint" --trace-rate 1)
    "$build/attnserve" --address 127.0.0.1:$port --metrics-address 127.0.0.1:9474 --http-address "" ${flags[@]+"${flags[@]}"} \
      >"$out/server.log" 2>&1 & pid=$!
    for _ in $(seq 300); do grep -q serving "$out/server.log" 2>/dev/null && break; sleep 0.2; done
    "$build/attnserve-bench" --target 127.0.0.1:$port --label "$which/W1/r$round" --warmup 2 \
      --json "$out/results.jsonl" --duration "$duration" --callers 32 --lengths uniform:8:64 >/dev/null
    "$build/attnserve-bench" --target 127.0.0.1:$port --label "$which/W3/r$round" --warmup 2 \
      --json "$out/results.jsonl" --duration "$duration" --callers 1 --lengths fixed:128 >/dev/null
    curl -s http://127.0.0.1:9474/metrics | grep -E '^attnserve_trace_spans_(exported|dropped)_total' \
      | sed "s|^|$which r$round: |" >>"$out/spans.txt" || true
    stop
  done
done
cat "$out/spans.txt"
/usr/bin/python3 - "$out/results.jsonl" <<'PY'
import json, statistics, sys
by = {}
for l in open(sys.argv[1]):
    r = json.loads(l)
    which, workload, rnd = r["label"].split("/")
    by.setdefault(workload, {}).setdefault(rnd, {})[which] = r
print(f"{'workload':8} {'round':6} {'off tok/s':>10} {'rate0/off':>9} {'rate1/off':>9} "
      f"{'p50 r0/off':>10} {'p50 r1/off':>10} {'p99 r1/off':>10}")
for workload, rounds in by.items():
    cols = {k: [] for k in ("r0", "r1", "p50r0", "p50r1", "p99r1")}
    for rnd, runs in sorted(rounds.items()):
        off, r0, r1 = runs["off"], runs["rate0"], runs["rate1"]
        row = (r0["tokens_per_s"] / off["tokens_per_s"], r1["tokens_per_s"] / off["tokens_per_s"],
               r0["latency_ms"]["p50"] / off["latency_ms"]["p50"], r1["latency_ms"]["p50"] / off["latency_ms"]["p50"],
               r1["latency_ms"]["p99"] / off["latency_ms"]["p99"])
        for k, v in zip(cols, row):
            cols[k].append(v)
        print(f"{workload:8} {rnd:6} {off['tokens_per_s']:10.0f} " + " ".join(f"{v:9.3f}" for v in row[:2]) +
              " " + " ".join(f"{v:10.3f}" for v in row[2:]))
    med = [statistics.median(cols[k]) for k in cols]
    print(f"{workload:8} {'median':6} {'':10} " + " ".join(f"{v:9.3f}" for v in med[:2]) + " " +
          " ".join(f"{v:10.3f}" for v in med[2:]))
PY
