#!/usr/bin/env bash
# Runs the same workloads, on this machine, one system at a time, against:
#   floor   the engine in-process, no gRPC, no batching (attnserve-bench --target inprocess)
#   off     attnserve --no-batching
#   on      attnserve (dynamic batching)
#   python  bench/baselines/python_server.py (grpcio + nn.MultiheadAttention)
# then prints one table with ratios against floor and python, and plots p99 latency against offered
# load (bench/out/p99_vs_load.png). Results: bench/out/results.jsonl. Takes ~6 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${ATTNSERVE_BUILD_DIR:-build}
out=bench/out
duration=${BENCH_DURATION:-8}
rm -rf "$out" && mkdir -p "$out"
cmake --build "$build" -j"$(nproc)" --target attnserve attnserve_bench >/dev/null
command -v gnuplot >/dev/null || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends gnuplot-nox >/dev/null; }
port=50071
pid=

stop() { if [ -n "$pid" ]; then kill -TERM "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; pid=; fi; }
trap stop EXIT
start() {  # system
  stop
  case $1 in
    floor) return ;;
    off) "$build/attnserve" --address 127.0.0.1:$port --metrics-address "" --no-batching >"$out/server.log" 2>&1 & pid=$! ;;
    on) "$build/attnserve" --address 127.0.0.1:$port --metrics-address "" >"$out/server.log" 2>&1 & pid=$! ;;
    python) /usr/bin/python3 bench/baselines/python_server.py --port $port >"$out/server.log" 2>&1 & pid=$! ;;
  esac
  for _ in $(seq 100); do grep -qE "serving" "$out/server.log" 2>/dev/null && return; sleep 0.2; done
  echo "bench: $1 did not start" >&2; cat "$out/server.log" >&2; exit 1
}
bench() {  # system workload args...
  local system=$1 workload=$2; shift 2
  local target=127.0.0.1:$port
  [ "$system" = floor ] && target=inprocess
  "$build/attnserve-bench" --target "$target" --label "$system/$workload" --warmup 2 \
    --json "$out/results.jsonl" "$@" 2>"$out/bench.err" || { cat "$out/bench.err" >&2; exit 1; }
}

for system in floor off on python; do
  start $system
  bench $system W1 --duration "$duration" --callers 32 --lengths uniform:8:64
  bench $system W2 --duration "$duration" --callers 32 --lengths uniform:16:512 --cross 0.5 --pool 48
  if [ $system = floor ]; then
    bench $system W3 --duration "$duration" --callers 1 --lengths fixed:128 --workers 1
  else
    bench $system W3 --duration "$duration" --callers 1 --lengths fixed:128
  fi
  for rate in 200 400 700 1000 1300 1600; do
    bench $system "open@$rate" --rate $rate --lengths uniform:8:64 --duration 5
  done
done
stop

/usr/bin/python3 - "$out/results.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
by = {r["label"]: r for r in rows}
print()
print(f"{'workload':8s} {'system':7s} {'req/s':>8s} {'tok/s':>9s} {'p50 ms':>8s} {'p90 ms':>8s} {'p99 ms':>8s} "
      f"{'tok/s vs floor':>15s} {'tok/s vs python':>16s} {'p99 vs python':>14s} errors")
for w in ["W1", "W2", "W3"]:
    f, p = by[f"floor/{w}"], by[f"python/{w}"]
    for s in ["floor", "off", "on", "python"]:
        r = by[f"{s}/{w}"]
        l = r["latency_ms"]
        print(f"{w:8s} {s:7s} {r['requests_per_s']:8.1f} {r['tokens_per_s']:9.0f} {l['p50']:8.2f} {l['p90']:8.2f} "
              f"{l['p99']:8.2f} {r['tokens_per_s']/f['tokens_per_s']:15.2f} {r['tokens_per_s']/p['tokens_per_s']:16.2f} "
              f"{l['p99']/p['latency_ms']['p99']:14.2f} {r['errors'] or ''}")
print()
w3 = by["on/W3"]["latency_ms"]["p50"] / by["floor/W3"]["latency_ms"]["p50"]
print(f"W1 batching on / off tokens/s: {by['on/W1']['tokens_per_s']/by['off/W1']['tokens_per_s']:.2f}")
print(f"W1 on / python tokens/s: {by['on/W1']['tokens_per_s']/by['python/W1']['tokens_per_s']:.2f}")
print(f"W2 on / python tokens/s: {by['on/W2']['tokens_per_s']/by['python/W2']['tokens_per_s']:.2f}")
print(f"W3 on p50 / floor p50: {w3:.2f}")
with open(sys.argv[1].replace("results.jsonl", "open_loop.dat"), "w") as f:
    for s in ["floor", "off", "on", "python"]:
        f.write(f"# {s}\n")
        for r in rows:
            if r["label"].startswith(s + "/open@"):
                f.write(f"{r['rate']} {r['requests_per_s']} {r['latency_ms']['p99']}\n")
        f.write("\n\n")
PY

gnuplot <<GP
set terminal pngcairo size 900,560 noenhanced
set output "$out/p99_vs_load.png"
set title "p99 latency vs offered load (W1 lengths 8-64, E=512, 8 heads, 2-core CPU)"
set xlabel "offered load (requests/s)"
set ylabel "p99 latency (ms)"
set logscale y
set key top left
set grid
plot for [i=0:3] "$out/open_loop.dat" index i using 1:3 with linespoints lw 2 title word("floor attnserve-no-batching attnserve-batching python-baseline", i+1)
GP
echo "bench: plot in $out/p99_vs_load.png"
