#!/usr/bin/env bash
# The first request after start against the steady state of the same request, with the warm-up (the
# default) and without it (--no-warmup), side by side in one run:
#   bench/first_request.sh [ROUNDS] [-- attnserve flags...]     e.g. -- --device cuda --dtype bfloat16
# Each round starts a server, waits for its start-up line, sends one request with attnserve-cli
# (a new process and connection, as a user's first call), then 20 more of the same; it prints the
# first request's latency and server compute time beside the p50 of the rest, and their ratio.
# Environment: BUILD (build), REQUEST (attnserve-cli attend flags; default --batch 2 --query-len 128).
# Exits 1 when a warmed server's first request takes more than 2x the steady p50 (the goal).
set -uo pipefail
cd "$(dirname "$0")/.."
build=${BUILD:-build}
rounds=3
[ $# -gt 0 ] && [ "$1" != -- ] && { rounds=$1; shift; }
[ "${1:-}" = -- ] && shift
request=${REQUEST:---batch 2 --query-len 128}
port=50261
lscpu | grep -m1 "Model name" || true
python3 - <<'EOF' 2>/dev/null || true
import re
flags = open("/proc/cpuinfo").read()
print("CPU class:", "AMX" if "amx_tile" in flags else "AVX512-BF16" if "avx512_bf16" in flags else
      "AVX-512" if "avx512f" in flags else "AVX2 only")
EOF
# One round: prints "first_ms first_compute_ms p50_ms p50_compute_ms".
round() {
  local log=/tmp/first_request.$$.log
  "$build/attnserve" --address 127.0.0.1:$port --metrics-address "" --http-address "" "$@" >"$log" 2>&1 &
  local pid=$!
  for _ in $(seq 600); do grep -q "serving" "$log" && break; sleep 0.05; done
  local lines=()
  for _ in $(seq 21); do
    # shellcheck disable=SC2086
    lines+=("$("$build/attnserve-cli" --target 127.0.0.1:$port attend --model "${MODEL:-demo}" $request \
      2>&1 | grep -o 'latency [0-9.]* ms (server: queue [0-9.]* ms, compute [0-9.]* ms')")
  done
  kill -TERM $pid; wait $pid 2>/dev/null
  rm -f "$log"
  printf '%s\n' "${lines[@]}" | python3 -c '
import re, statistics, sys
rows = [tuple(map(float, re.findall(r"[0-9.]+", l)))[::2] for l in sys.stdin if l.strip()]
if len(rows) < 21: print("nan nan nan nan"); sys.exit()
rest = rows[1:]
print(*(f"{v:.2f}" for v in (rows[0][0], rows[0][1], statistics.median(r[0] for r in rest), statistics.median(r[1] for r in rest))))'
}
status=0
for mode in warm cold; do
  extra=()
  [ $mode = cold ] && extra=(--no-warmup)
  for r in $(seq "$rounds"); do
    read -r first fc p50 pc < <(round "$@" "${extra[@]}")
    ratio=$(python3 -c "print(f'{$first / $p50:.2f}')" 2>/dev/null || echo nan)
    echo "$mode round $r: first $first ms (compute $fc ms), steady p50 $p50 ms (compute $pc ms): first/p50 $ratio"
    if [ $mode = warm ] && ! python3 -c "import sys; sys.exit(0 if $ratio <= 2 else 1)" 2>/dev/null; then
      status=1
    fi
    port=$((port + 1))
  done
done
echo "first_request: $([ $status = 0 ] && echo "passed (warm first request within 2x the steady p50)" || echo FAILED)"
exit $status
