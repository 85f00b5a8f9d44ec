#!/usr/bin/env bash
# Large tensors in and out on this machine, side by side in one run (bench/RESULTS.md):
#   the in-process engine, attnserve over gRPC with 1 and 4 connections, attnserve over shared
#   memory (--shared-memory), and attnserve-echo (the query's bytes answered back, no compute: what
#   loopback gRPC itself carries at these sizes) with 1 and 4 connections;
#   on "large" (lengths 1,024-4,096, float32, 4 callers), W1 (32 callers, 8-64) and W2 (32 callers,
#   16-512, half cross-attention). Prints each row and the ratios the goals name (tokens/s).
#   bench/transport.sh [DURATION_S (5)]        SERVER_ARGS: more attnserve flags (e.g. --dtype bfloat16)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${ATTNSERVE_BUILD_DIR:-build}
duration=${1:-5}
out=bench/out-transport
rm -rf "$out" && mkdir -p "$out"
cmake --build "$build" -j"$(nproc)" --target attnserve attnserve_bench attnserve_echo >/dev/null
pids=()
stop() { for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done; }
trap stop EXIT
# shellcheck disable=SC2086
"$build/attnserve" --address 127.0.0.1:50181 --metrics-address "" --allow-shared-memory ${SERVER_ARGS:-} \
  >"$out/server.log" 2>&1 &
pids+=($!)
"$build/attnserve-echo" --address 127.0.0.1:50182 >"$out/echo.log" 2>&1 &
pids+=($!)
for _ in $(seq 300); do grep -q serving "$out/server.log" && grep -q serving "$out/echo.log" && break; sleep 0.2; done
lscpu | grep -m1 "Model name" || true
bench() {  # label target args... (the run lasts $seconds)
  local label=$1 target=$2; shift 2
  "$build/attnserve-bench" --target "$target" --label "$label" --duration "${seconds:-$duration}" \
    --warmup 2 --json "$out/results.jsonl" "$@" 2>/dev/null
}
large=(--callers 4 --lengths uniform:1024:4096 --pool 16)
# Large requests take ~0.2-1 s each here: three times as long a run, so that enough of them count.
seconds=$((3 * duration))
w1=(--callers 32 --lengths uniform:8:64)
w2=(--callers 32 --lengths uniform:16:512 --cross 0.5)
bench large/inprocess inprocess "${large[@]}" --workers "$(nproc)"
bench large/shm 127.0.0.1:50181 "${large[@]}" --shared-memory
for c in 1 4; do
  bench "large/grpc-$c" 127.0.0.1:50181 "${large[@]}" --connections $c
done
seconds=$duration
for c in 1 4; do bench "large/echo-$c" 127.0.0.1:50182 "${large[@]}" --connections $c; done
for c in 1 4; do
  bench "W1/grpc-$c" 127.0.0.1:50181 "${w1[@]}" --connections $c
  bench "W1/echo-$c" 127.0.0.1:50182 "${w1[@]}" --connections $c
  bench "W2/grpc-$c" 127.0.0.1:50181 "${w2[@]}" --connections $c
done
/usr/bin/python3 - "$out/results.jsonl" <<'PY'
import json, sys
rows = {}
for line in open(sys.argv[1]):
    r = json.loads(line)
    rows[r["label"]] = r
# Tokens a second: the pool's requests differ in length, so tokens count the work done.
rate = lambda l: rows[l]["tokens_per_s"] if l in rows else float("nan")
print()
for name, a, b, goal in [
        ("large: shared memory / in-process engine", "large/shm", "large/inprocess", ">= 0.95"),
        ("large: gRPC 4 connections / 1", "large/grpc-4", "large/grpc-1", ""),
        ("large: gRPC (4 connections) / echo (4)", "large/grpc-4", "large/echo-4", ""),
        ("large: echo 4 connections / 1", "large/echo-4", "large/echo-1", ""),
        ("W1: 4 connections / 1", "W1/grpc-4", "W1/grpc-1", ">= 1 within noise"),
        ("W2: 4 connections / 1", "W2/grpc-4", "W2/grpc-1", ">= 1 within noise"),
        ("W1: gRPC / echo (4 connections)", "W1/grpc-4", "W1/echo-4", "")]:
    print(f"{name:44s} {rate(a) / rate(b):6.3f}  ({rate(a):9.0f} / {rate(b):9.0f} tokens/s)  {goal}")
PY
