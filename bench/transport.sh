#!/usr/bin/env bash
# Large tensors in and out on this machine, side by side in one run (bench/RESULTS.md):
#   the in-process engine, attnserve over gRPC with 1 and 4 connections, attnserve over shared
#   memory (--shared-memory), and attnserve-echo (the query's bytes answered back, no compute: what
#   loopback gRPC itself carries at these sizes) with 1 and 4 connections;
#   on "large" (lengths 1,024-4,096, float32, 4 callers), W1 (32 callers, 8-64) and W2 (32 callers,
#   16-512, half cross-attention). Prints each row and the ratios the goals name (tokens/s).
# Then the wire's floor (issue 66): the same bytes each way (16 KB, 256 KB, 2 MB) over a plain
#   loopback TCP connection and a Unix socket (attnserve-wire-floor), gRPC's echo with its own
#   defaults, attnserve-echo with attnserve's transport settings, and attnserve (the demo model, one
#   request of those bytes), each over TCP and the Unix socket, one caller and four; beside them the
#   in-process engine; and the server's CPU a request beyond its computation under W1.
#   bench/transport.sh [DURATION_S (5)] [floor]   floor: the wire's floor alone
#   SERVER_ARGS: more attnserve flags (e.g. --dtype bfloat16)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${ATTNSERVE_BUILD_DIR:-build}
duration=${1:-5}
only=${2:-}
out=bench/out-transport
rm -rf "$out" && mkdir -p "$out"
cmake --build "$build" -j"$(nproc)" --target attnserve attnserve_bench attnserve_echo \
  attnserve_wire_floor >/dev/null
pids=()
stop() { for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done; }
# shellcheck disable=SC2086
sock=$(mktemp -d)  # The Unix sockets' directory (0700), gone at the end.
trap 'stop; rm -rf "$sock"' EXIT
"$build/attnserve" --address 127.0.0.1:50181 --address "unix:$sock/attnserve.sock" \
  --metrics-address 127.0.0.1:50185 --http-address "" --allow-shared-memory ${SERVER_ARGS:-} >"$out/server.log" 2>&1 &
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
if [ -z "$only" ]; then
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
fi

# ---- The wire's floor (issue 66) ----------------------------------------------------------------
"$build/attnserve-wire-floor" serve --address tcp:127.0.0.1:50186 >"$out/floor-tcp.log" 2>&1 &
pids+=($!)
"$build/attnserve-wire-floor" serve --address "unix:$sock/floor.sock" >"$out/floor-unix.log" 2>&1 &
pids+=($!)
# gRPC's echo with its own defaults, and attnserve-echo with attnserve's transport settings (its
# reads of 2 MiB at first, its heap keeping message buffers), each on TCP and a Unix socket.
"$build/attnserve-echo" --address 127.0.0.1:50187 >"$out/echo-default.log" 2>&1 &
pids+=($!)
"$build/attnserve-echo" --address "unix:$sock/echo-default.sock" >"$out/echo-default-unix.log" 2>&1 &
pids+=($!)
tuned=(--grpc-arg grpc.experimental.tcp_read_chunk_size=2097152)
malloc_env=GLIBC_TUNABLES=glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=268435456
env "$malloc_env" "$build/attnserve-echo" --address 127.0.0.1:50188 "${tuned[@]}" >"$out/echo.log2" 2>&1 &
pids+=($!)
env "$malloc_env" "$build/attnserve-echo" --address "unix:$sock/echo.sock" "${tuned[@]}" \
  >"$out/echo-unix.log" 2>&1 &
pids+=($!)
sleep 1
seconds=$duration
for bytes in 16384 262144 2097152; do
  len=$((bytes / 2048))  # [1, len, 512] float32
  for callers in 1 4; do
    for where in tcp unix; do
      [ $where = tcp ] && at=tcp:127.0.0.1:50186 || at="unix:$sock/floor.sock"
      "$build/attnserve-wire-floor" ping --address "$at" --bytes $bytes --callers $callers \
        --rounds $((bytes > 1000000 ? 300 : 2000)) --label "floor/$where/$bytes/$callers" \
        --json "$out/floor.jsonl"
    done
    w=(--callers $callers --lengths fixed:$len --pool 8 --wire-dtype float32 --connections $callers)
    bench "echo-default/tcp/$bytes/$callers" 127.0.0.1:50187 "${w[@]}"
    bench "echo-default/unix/$bytes/$callers" "unix:$sock/echo-default.sock" "${w[@]}"
    bench "echo/tcp/$bytes/$callers" 127.0.0.1:50188 "${w[@]}"
    bench "echo/unix/$bytes/$callers" "unix:$sock/echo.sock" "${w[@]}"
    bench "attnserve/tcp/$bytes/$callers" 127.0.0.1:50181 "${w[@]}"
    bench "attnserve/unix/$bytes/$callers" "unix:$sock/attnserve.sock" "${w[@]}"
    bench "inprocess/$bytes/$callers" inprocess "${w[@]}" --workers "$(nproc)"
  done
done
# The server's CPU a request beyond its computation, under W1 (32 callers, 8-64 tokens): its CPU
# seconds over the requests it answered, less the in-process engine's (the bench's own process,
# load generator included) under the same load through the same batcher.
cpu_of() { awk '{print ($14 + $15) / '"$(getconf CLK_TCK)"'}' "/proc/$1/stat"; }
server_pid=${pids[0]}
before=$(cpu_of "$server_pid")
bench "cpu/attnserve/W1" 127.0.0.1:50181 --callers 32 --lengths uniform:8:64 --connections 4
after=$(cpu_of "$server_pid")
echo "{\"label\": \"cpu/attnserve/W1\", \"cpu_s\": $(echo "$after - $before" | bc -l)}" >>"$out/cpu.jsonl"
/usr/bin/time -f '{"label": "cpu/inprocess/W1", "cpu_s": %U + %S}' -a -o "$out/cpu.time" \
  "$build/attnserve-bench" --target inprocess --callers 32 --lengths uniform:8:64 --batching \
  --workers "$(nproc)" --duration "$duration" --warmup 2 --label cpu/inprocess/W1 \
  --json "$out/results.jsonl" >/dev/null 2>&1
/usr/bin/python3 - "$out" "$duration" <<'PY'
import json, re, sys
out, duration = sys.argv[1], float(sys.argv[2])
rows = {}
for f in ("results.jsonl", "floor.jsonl"):
    for line in open(f"{out}/{f}"):
        r = json.loads(line)
        rows[r["label"]] = r
def p50(label):
    r = rows.get(label)
    if r is None:
        return float("nan")
    return r["p50_ms"] if "p50_ms" in r else r["latency_ms"]["p50"]
print("\nThe wire's floor: p50 ms of one round trip, the bytes each way (callers: concurrent, a "
      "connection each)")
cols = ["floor/tcp", "floor/unix", "echo-default/tcp", "echo-default/unix", "echo/tcp", "echo/unix",
        "attnserve/tcp", "attnserve/unix", "inprocess"]
print(f"{'bytes':>8} {'callers':>7} " + " ".join(f"{c:>17}" for c in cols))
for b in (16384, 262144, 2097152):
    for c in (1, 4):
        print(f"{b:>8} {c:>7} " + " ".join(f"{p50(f'{k}/{b}/{c}'):17.3f}" for k in cols))
goals = [("attnserve-echo 2 MB / TCP floor (1 caller)", p50("echo/tcp/2097152/1") / p50("floor/tcp/2097152/1"), "<= 2"),
         ("attnserve-echo 2 MB / Unix floor (1 caller)", p50("echo/unix/2097152/1") / p50("floor/unix/2097152/1"), "<= 1.5"),
         ("gRPC defaults' echo 2 MB / TCP floor", p50("echo-default/tcp/2097152/1") / p50("floor/tcp/2097152/1"), ""),
         ("attnserve 256 KB (W3) - in-process, ms", p50("attnserve/tcp/262144/1") - p50("inprocess/262144/1"), "<= 0.3"),
         ("attnserve 256 KB over the Unix socket - in-process, ms", p50("attnserve/unix/262144/1") - p50("inprocess/262144/1"), "")]
cpu = {}
for line in open(f"{out}/cpu.jsonl"):
    r = json.loads(line)
    cpu[r["label"]] = r["cpu_s"]
t = open(f"{out}/cpu.time").read()
m = re.search(r'"cpu_s": ([\d.]+) \+ ([\d.]+)', t)
if m:
    cpu["cpu/inprocess/W1"] = float(m.group(1)) + float(m.group(2))
# Requests over the warm-up and the measure alike (the CPU counts both), at the measured rate.
served = rows.get("cpu/attnserve/W1", {}).get("requests_per_s", 0) * (duration + 2)
inproc = rows.get("cpu/inprocess/W1", {}).get("requests_per_s", 0) * (duration + 2)
if served and inproc and "cpu/inprocess/W1" in cpu:
    beyond = cpu["cpu/attnserve/W1"] / served - cpu["cpu/inprocess/W1"] / inproc
    goals.append(("server CPU a request beyond compute under W1, us", beyond * 1e6, "<= 100"))
for name, v, goal in goals:
    print(f"{name:58s} {v:8.3f}  {goal}")
PY
