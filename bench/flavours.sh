#!/usr/bin/env bash
# Side by side in one run (issue "GPU through LibTorch 2.x", item 8): the service on Debian's
# LibTorch 1.13 (OpenBLAS) and on the 2.x flavour (PyPI torch 2.11: MKL, fused attention), each in
# float32 and bfloat16, each beside the Python baseline on the same PyTorch and dtype. Workloads as in
# bench/run.sh: W1 (32 callers, self-attention, lengths 8-64) and W2 (32 callers, 16-512, half cross).
# Rounds rotate through the systems; the table gives each figure's median over the rounds.
#   bench/flavours.sh        (~6 min; needs both builds: tools/build.sh test builds them)
# Results: bench/out-flavours/results.jsonl and the printed table.
set -euo pipefail
cd "$(dirname "$0")/.."
out=bench/out-flavours
duration=${BENCH_DURATION:-5}
rounds=${BENCH_ROUNDS:-2}
venv=$(tools/torch2-env.sh)
rm -rf "$out" && mkdir -p "$out"
cmake --build build -j"$(nproc)" --target attnserve attnserve_bench >/dev/null
cmake --build build-torch2/build -j"$(nproc)" --target attnserve >/dev/null
port=50081
pid=
stop() { if [ -n "$pid" ]; then kill -TERM "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; pid=; fi; }
trap stop EXIT
start() {  # system
  stop
  local flags=(--address 127.0.0.1:$port --metrics-address "") cmd
  case $1 in
    attnserve-1.13-f32) cmd=(build/attnserve "${flags[@]}") ;;
    attnserve-1.13-bf16) cmd=(build/attnserve "${flags[@]}" --dtype bfloat16) ;;
    attnserve-2.11-f32) cmd=(build-torch2/build/attnserve "${flags[@]}") ;;
    attnserve-2.11-bf16) cmd=(build-torch2/build/attnserve "${flags[@]}" --dtype bfloat16) ;;
    python-1.13-f32) cmd=(/usr/bin/python3 bench/baselines/python_server.py --port $port) ;;
    python-1.13-bf16) cmd=(/usr/bin/python3 bench/baselines/python_server.py --port $port --dtype bfloat16) ;;
    python-2.11-f32) cmd=("$venv/bin/python" bench/baselines/python_server.py --port $port) ;;
    python-2.11-bf16) cmd=("$venv/bin/python" bench/baselines/python_server.py --port $port --dtype bfloat16) ;;
  esac
  "${cmd[@]}" >"$out/server.log" 2>&1 &  # The server itself, so that stop() reaches it.
  pid=$!
  for _ in $(seq 150); do grep -q "serving" "$out/server.log" 2>/dev/null && return; sleep 0.2; done
  echo "flavours: $1 did not start" >&2; cat "$out/server.log" >&2; exit 1
}
systems=(attnserve-1.13-f32 python-1.13-f32 attnserve-2.11-f32 python-2.11-f32
         attnserve-1.13-bf16 python-1.13-bf16 attnserve-2.11-bf16 python-2.11-bf16)
for round in $(seq "$rounds"); do
  for system in "${systems[@]}"; do
    start "$system"
    head -1 "$out/server.log" >>"$out/banners.txt"
    build/attnserve-bench --target 127.0.0.1:$port --label "$system/W1/r$round" --warmup 2 --json "$out/results.jsonl" \
      --duration "$duration" --callers 32 --lengths uniform:8:64 >/dev/null
    build/attnserve-bench --target 127.0.0.1:$port --label "$system/W2/r$round" --warmup 2 --json "$out/results.jsonl" \
      --duration "$duration" --callers 32 --lengths uniform:16:512 --cross 0.5 --pool 48 >/dev/null
  done
done
stop
/usr/bin/python3 - "$out/results.jsonl" "${systems[@]}" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
systems = sys.argv[2:]
def med(system, w, key):
    vals = [r[key] if key != "p99" else r["latency_ms"]["p99"] for r in rows if r["label"].startswith(f"{system}/{w}/")]
    return statistics.median(vals)
print(f"{'system':22s} {'W1 tok/s':>10s} {'W1 p99 ms':>10s} {'W2 tok/s':>10s} {'W2 p99 ms':>10s}")
for s in systems:
    print(f"{s:22s} {med(s, 'W1', 'tokens_per_s'):10.0f} {med(s, 'W1', 'p99'):10.1f} "
          f"{med(s, 'W2', 'tokens_per_s'):10.0f} {med(s, 'W2', 'p99'):10.1f}")
def ratio(a, b, w):  # "-" where the denominator answered nothing in the run (too slow to finish one)
    d = med(b, w, 'tokens_per_s')
    return f"{med(a, w, 'tokens_per_s') / d:.2f}" if d else "-"
print("ratios (W1 / W2 tokens/s):")
for torch_v in ("1.13", "2.11"):
    for dt in ("f32", "bf16"):
        a, p = f"attnserve-{torch_v}-{dt}", f"python-{torch_v}-{dt}"
        print(f"  attnserve/python on {torch_v} {dt}: {ratio(a, p, 'W1')} / {ratio(a, p, 'W2')}")
for dt in ("f32", "bf16"):
    a, b = f"attnserve-2.11-{dt}", f"attnserve-1.13-{dt}"
    print(f"  attnserve 2.11/1.13 {dt}: {ratio(a, b, 'W1')} / {ratio(a, b, 'W2')}")
for v in ("1.13", "2.11"):
    a, b = f"attnserve-{v}-bf16", f"attnserve-{v}-f32"
    print(f"  attnserve bf16/f32 on {v}: {ratio(a, b, 'W1')} / {ratio(a, b, 'W2')}")
PY
