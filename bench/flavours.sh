#!/usr/bin/env bash
# Side by side in one run, per CPU class (bench/RESULTS.md's CPU table): the service on Debian's LibTorch 1.13 and
# on the 2.x flavour (PyPI torch 2.11), each in float32 and bfloat16 (bfloat16 with float32 and with
# bfloat16 on the wire), each beside its in-process floor (attnserve-bench --target inprocess: the
# engine without gRPC) and the Python server on the same PyTorch and dtype; and, from the engine
# bench in the same run, the bare product bound of the same shapes in each dtype. Workloads as in
# bench/run.sh: W1 (32 callers, self-attention, lengths 8-64) and W2 (32 callers, 16-512, half
# cross). Rounds rotate through the systems; the table gives each figure's median over the rounds.
#   bench/flavours.sh        (~12 min; needs both builds: tools/build.sh test builds them)
#   BENCH_ROUNDS=1 BENCH_DURATION=3 bench/flavours.sh     (~5 min)
# Results: bench/out-flavours/results.jsonl, bench/out-flavours/bound.json and the printed table.
set -euo pipefail
cd "$(dirname "$0")/.."
out=bench/out-flavours
duration=${BENCH_DURATION:-5}
rounds=${BENCH_ROUNDS:-2}
venv=$(tools/torch2-env.sh)
rm -rf "$out" && mkdir -p "$out"
cmake --build build -j"$(nproc)" --target attnserve attnserve_bench attnserve_engine_bench >/dev/null
cmake --build build-torch2 -j"$(nproc)" --target attnserve attnserve_bench >/dev/null
port=50081
pid=
stop() { if [ -n "$pid" ]; then kill -TERM "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; pid=; fi; }
trap stop EXIT
# system -> how it runs: "inprocess BENCH DTYPE" or "server CMD..."; its wire dtype from the name.
start() {  # system
  stop
  local flags=(--address 127.0.0.1:$port --metrics-address "" --http-address "") cmd
  case $1 in
    attnserve-1.13-f32) cmd=(build/attnserve "${flags[@]}") ;;
    attnserve-1.13-bf16*) cmd=(build/attnserve "${flags[@]}" --dtype bfloat16) ;;
    attnserve-2.11-f32) cmd=(build-torch2/attnserve "${flags[@]}") ;;
    attnserve-2.11-bf16*) cmd=(build-torch2/attnserve "${flags[@]}" --dtype bfloat16) ;;
    python-1.13-f32) cmd=(/usr/bin/python3 bench/baselines/python_server.py --port $port) ;;
    python-1.13-bf16*) cmd=(/usr/bin/python3 bench/baselines/python_server.py --port $port --dtype bfloat16) ;;
    python-2.11-f32) cmd=("$venv/bin/python" bench/baselines/python_server.py --port $port) ;;
    python-2.11-bf16*) cmd=("$venv/bin/python" bench/baselines/python_server.py --port $port --dtype bfloat16) ;;
  esac
  "${cmd[@]}" >"$out/server.log" 2>&1 &  # The server itself, so that stop() reaches it.
  pid=$!
  for _ in $(seq 150); do grep -q "serving" "$out/server.log" 2>/dev/null && return; sleep 0.2; done
  echo "flavours: $1 did not start" >&2; cat "$out/server.log" >&2; exit 1
}
# "-wire" systems send bfloat16 queries, keys and values and get bfloat16 answers.
systems=(inproc-1.13-f32 attnserve-1.13-f32 python-1.13-f32 inproc-2.11-f32 attnserve-2.11-f32 python-2.11-f32
         inproc-1.13-bf16 attnserve-1.13-bf16 python-1.13-bf16 inproc-1.13-bf16-wire attnserve-1.13-bf16-wire python-1.13-bf16-wire
         inproc-2.11-bf16 attnserve-2.11-bf16 python-2.11-bf16 inproc-2.11-bf16-wire attnserve-2.11-bf16-wire python-2.11-bf16-wire)
run() {  # system label-suffix bench-args...
  local system=$1 round=$2; shift 2
  local wire=float32 bench=build/attnserve-bench target=(--target 127.0.0.1:$port)
  case $system in *-wire) wire=bfloat16 ;; esac
  case $system in
    inproc-2.11-*) bench=build-torch2/attnserve-bench ;;
  esac
  case $system in
    inproc-*-f32) target=(--target inprocess) ;;
    inproc-*) target=(--target inprocess --dtype bfloat16) ;;
  esac
  "$bench" "${target[@]}" --wire-dtype "$wire" --warmup 2 --json "$out/results.jsonl" --duration "$duration" \
    --label "$system/W1/r$round" --callers 32 --lengths uniform:8:64 >/dev/null
  "$bench" "${target[@]}" --wire-dtype "$wire" --warmup 2 --json "$out/results.jsonl" --duration "$duration" \
    --label "$system/W2/r$round" --callers 32 --lengths uniform:16:512 --cross 0.5 --pool 48 >/dev/null
}
build/attnserve_engine_bench --benchmark_filter='ProductBound/W[12]' --benchmark_format=json >"$out/bound.json" 2>/dev/null
for round in $(seq "$rounds"); do
  for system in "${systems[@]}"; do
    case $system in inproc-*) stop ;; *) start "$system"; head -1 "$out/server.log" >>"$out/banners.txt" ;; esac
    run "$system" "$round"
  done
done
stop
flags=$(grep -o -w -E 'avx2|avx512f|avx512_bf16|amx_bf16|amx_tile' /proc/cpuinfo | sort -u | tr '\n' ' ')
/usr/bin/python3 - "$out" "$flags" "$(lscpu | sed -n 's/^Model name: *//p')" "$(nproc)" "${systems[@]}" <<'PY'
import json, statistics, sys
out, flags, model, cores, systems = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5:]
rows = [json.loads(l) for l in open(f"{out}/results.jsonl")]
# The engine bench measures one core; the machine's bound is every core's.
bound = {b["name"].split("/")[1] + "/" + b["name"].split("/")[2]: cores * b["FLOP/s"] / 1e12
         for b in json.load(open(f"{out}/bound.json"))["benchmarks"]}
cpu_class = rows[0]["cpu_class"]
def med(system, w, key):
    vals = [r["tflops"] if key == "tflops" else r[key] if key != "p99" else r["latency_ms"]["p99"]
            for r in rows if r["label"].startswith(f"{system}/{w}/")]
    return statistics.median(vals)
print(f"CPU class {cpu_class}: {model}; flags: {flags}")
print(f"bare product bound ({cores} cores x one core's, the engine's products, TFLOP/s as the engine's FLOPs count): "
      f"float32 W1 {bound['W1/F32']:.3f} W2 {bound['W2/F32']:.3f}; bfloat16 W1 {bound['W1/BF16']:.3f} W2 {bound['W2/BF16']:.3f}")
print(f"{'system':26s} {'W1 tok/s':>10s} {'W1 p99 ms':>10s} {'W1 TFLOP/s':>10s} {'W2 tok/s':>10s} {'W2 p99 ms':>10s} {'W2 TFLOP/s':>10s}")
for s in systems:
    print(f"{s:26s} {med(s, 'W1', 'tokens_per_s'):10.0f} {med(s, 'W1', 'p99'):10.1f} {med(s, 'W1', 'tflops'):10.3f} "
          f"{med(s, 'W2', 'tokens_per_s'):10.0f} {med(s, 'W2', 'p99'):10.1f} {med(s, 'W2', 'tflops'):10.3f}")
def ratio(a, b, w):  # "-" where the denominator answered nothing in the run (too slow to finish one)
    d = med(b, w, 'tokens_per_s')
    return f"{med(a, w, 'tokens_per_s') / d:.2f}" if d else "-"
print("ratios (W1 / W2 tokens/s):")
for v in ("1.13", "2.11"):
    a, b = f"attnserve-{v}-bf16", f"attnserve-{v}-f32"
    print(f"  attnserve bf16/f32 on {v}: {ratio(a, b, 'W1')} / {ratio(a, b, 'W2')}; "
          f"bf16 on the wire / f32: {ratio(a + '-wire', b, 'W1')} / {ratio(a + '-wire', b, 'W2')}")
for dt in ("f32", "bf16", "bf16-wire"):
    for v in ("1.13", "2.11"):
        a = f"attnserve-{v}-{dt}"
        best = {w: max((f"python-{pv}-{dt}" for pv in ("1.13", "2.11")), key=lambda p: med(p, w, 'tokens_per_s'))
                for w in ("W1", "W2")}
        print(f"  attnserve {v} {dt}: / in-process floor {ratio(a, f'inproc-{v}-{dt}', 'W1')} / "
              f"{ratio(a, f'inproc-{v}-{dt}', 'W2')}; / best Python ({best['W1']}, {best['W2']}) "
              f"{ratio(a, best['W1'], 'W1')} / {ratio(a, best['W2'], 'W2')}")
for v in ("1.13", "2.11"):
    for dt, b in (("bf16", "BF16"), ("bf16-wire", "BF16"), ("f32", "F32")):
        a = f"attnserve-{v}-{dt}"
        print(f"  attnserve {v} {dt}: share of the bare {b.lower()} product bound (TFLOP/s) "
              f"{med(a, 'W1', 'tflops') / bound['W1/' + b]:.2f} / {med(a, 'W2', 'tflops') / bound['W2/' + b]:.2f}")
PY
