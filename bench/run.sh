#!/usr/bin/env bash
# Runs the same workloads, on this machine, one system at a time, against:
#   floor   the engine in-process, no gRPC, no batching (attnserve-bench --target inprocess)
#   off     attnserve --no-batching
#   on      attnserve (dynamic batching)
#   python  bench/baselines/python_server.py (grpcio + nn.MultiheadAttention)
# then prints one table with ratios against floor and python, and plots p99 latency against offered
# load (bench/out/p99_vs_load.png). Results: bench/out/results.jsonl. Takes ~7 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${ATTNSERVE_BUILD_DIR:-build}
out=bench/out
duration=${BENCH_DURATION:-5}
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
  # attnserve-bench has aborted a few times in gRPC ("ref_counted.h:183 prior > 0") at the end of a
  # W2 run, not reproduced under gdb; such a run is logged and measured again once.
  local tries
  for tries in 1 2; do
    "$build/attnserve-bench" --target "$target" --label "$system/$workload" --warmup 2 \
      --json "$out/results.jsonl" "$@" 2>"$out/bench.err" && return
    tail -2 "$out/bench.err" >>"$out/bench_failures.log"
    echo "bench: $system/$workload failed (try $tries), see $out/bench_failures.log" >&2
  done
  exit 1
}

# This VM's neighbours make single runs swing by +-20%: the workloads run in rounds that rotate
# through the systems, and the table reports each figure's median over the rounds.
rounds=${BENCH_ROUNDS:-3}
for round in $(seq "$rounds"); do
  for system in floor off on python; do
    start $system
    bench $system W1/r$round --duration "$duration" --callers 32 --lengths uniform:8:64
    bench $system W2/r$round --duration "$duration" --callers 32 --lengths uniform:16:512 --cross 0.5 --pool 48
    if [ $system = floor ]; then
      bench $system W3/r$round --duration "$duration" --callers 1 --lengths fixed:128 --workers 1
    else
      bench $system W3/r$round --duration "$duration" --callers 1 --lengths fixed:128
    fi
  done
done
for system in floor off on python; do
  start $system
  for rate in 200 500 900 1300 1700; do
    bench $system "open@$rate" --rate $rate --lengths uniform:8:64 --duration 4
  done
done
stop

/usr/bin/python3 - "$out/results.jsonl" <<'PY'
import json, sys
import statistics
rows = [json.loads(l) for l in open(sys.argv[1])]
def med(system, w, f):
    vals = [f(r) for r in rows if r["label"].startswith(f"{system}/{w}/r")]
    return statistics.median(vals), min(vals), max(vals)
tok = lambda r: r["tokens_per_s"]
rps = lambda r: r["requests_per_s"]
pct = lambda q: (lambda r: r["latency_ms"][q])
print()
print("medians over rounds; tokens/s range in brackets")
print(f"{'workload':8s} {'system':7s} {'req/s':>8s} {'tok/s':>9s} {'[min-max]':>15s} {'p50 ms':>8s} {'p90 ms':>8s} {'p99 ms':>8s} "
      f"{'tok/s vs floor':>15s} {'tok/s vs python':>16s} {'p99 vs python':>14s}")
summary = {}
for w in ["W1", "W2", "W3"]:
    f_tok = med("floor", w, tok)[0]
    p_tok, p_p99 = med("python", w, tok)[0], med("python", w, pct("p99"))[0]
    for s in ["floor", "off", "on", "python"]:
        t, lo, hi = med(s, w, tok)
        p50, p90, p99 = (med(s, w, pct(q))[0] for q in ("p50", "p90", "p99"))
        summary[(s, w)] = (t, p50, p99)
        print(f"{w:8s} {s:7s} {med(s, w, rps)[0]:8.1f} {t:9.0f} {f'[{lo:.0f}-{hi:.0f}]':>15s} {p50:8.2f} {p90:8.2f} {p99:8.2f} "
              f"{t/f_tok:15.2f} {t/p_tok:16.2f} {p99/p_p99:14.2f}")
errors = [r["label"] + " " + json.dumps(r["errors"]) for r in rows if r["errors"]]
print("errors:", errors or "none")
print()
print(f"W1 batching on / off tokens/s: {summary[('on','W1')][0]/summary[('off','W1')][0]:.2f}  (target >= 2)")
print(f"W1 on / python tokens/s: {summary[('on','W1')][0]/summary[('python','W1')][0]:.2f}  (target >= 3), "
      f"p99 {summary[('on','W1')][2]:.1f} vs {summary[('python','W1')][2]:.1f} ms")
print(f"W2 on / python tokens/s: {summary[('on','W2')][0]/summary[('python','W2')][0]:.2f}  (target >= 1.5), "
      f"p99 {summary[('on','W2')][2]:.1f} vs {summary[('python','W2')][2]:.1f} ms")
print(f"W3 on p50 / floor p50: {summary[('on','W3')][1]/summary[('floor','W3')][1]:.2f}  (target <= 1.3)")
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
