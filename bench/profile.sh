#!/usr/bin/env bash
# Where a batch's time goes: perf samples grouped by what runs them, then the oneDNN
# kernels ONEDNN_VERBOSE saw, with their time.
#   bench/profile.sh engine 'Batched/W1/BF16'          # the engine bench alone, one benchmark
#   bench/profile.sh service bfloat16 bfloat16 W1      # attnserve --dtype D under attnserve-bench,
#                                                      # queries on the wire in WIRE; W1 or W2
# Groups: products (oneDNN's JIT kernels), oneDNN dispatch (libdnnl: primitive descriptors, memory
# objects), LibTorch ops (libtorch_cpu/libc10: softmax, masks, conversions, copies, dispatch), exp
# (libsleef, the softmax's), BLAS (OpenBLAS/MKL), allocator and copies (libc), transport (gRPC,
# protobuf, abseil), load generator (attnserve-bench, service only), kernel, other. Needs perf
# (linux-perf) and root or perf_event_paranoid <= 0. Output under bench/out-profile/.
set -euo pipefail
cd "$(dirname "$0")/.."
out=bench/out-profile
mkdir -p "$out"
mode=${1:?usage: bench/profile.sh engine FILTER | service DTYPE WIRE W1|W2}
cmake --build build -j"$(nproc)" --target attnserve attnserve_bench attnserve_engine_bench >/dev/null
group() {  # perf.data -> share by group
  perf report -i "$1" --no-children --sort comm,dso -g none --percent-limit 0 2>/dev/null | awk '
    /^#/ || !/%/ { next }
    { pct = $1; sub(/%/, "", pct); comm = $2; dso = $3
      g = "other"
      if (comm == "attnserve-bench" && dso != "[JIT]") g = "load generator (attnserve-bench)"
      else if (dso == "[JIT]") g = "products (oneDNN JIT kernels)"
      else if (dso ~ /libdnnl/) g = "oneDNN dispatch (libdnnl)"
      else if (dso ~ /libtorch|libc10/) g = "LibTorch ops (softmax, masks, conversions, dispatch)"
      else if (dso ~ /libsleef/) g = "exp (libsleef, softmax)"
      else if (dso ~ /openblas|mkl|libblas/) g = "BLAS"
      else if (dso ~ /libc\.so|libstdc|ld-linux/) g = "allocator, copies (libc)"
      else if (dso ~ /grpc|protobuf|absl|libgpr|libaddress|libupb|libssl|libcrypto/) g = "transport (gRPC, protobuf)"
      else if (dso ~ /kernel/) g = "kernel (scheduling, sockets, page faults)"
      else if (dso ~ /attnserve/) g = "attnserve itself"
      share[g] += pct }
    END { for (g in share) printf "%6.1f%%  %s\n", share[g], g }' | sort -rn
}
kernels() {  # verbose log -> time by primitive and layout
  grep '^onednn_verbose,exec' "$1" | awk -F, '{
      k = $4 " " $5 " " $7; gsub(/::blocked/, "", k); t[k] += $NF; n[k]++ }
    END { for (k in t) printf "%9.1f ms %7d  %s\n", t[k], n[k], k }' | sort -rn | head -12
}
if [ "$mode" = engine ]; then
  filter=${2:-Batched/W1/BF16}
  perf record -q -g -o "$out/perf.data" -- build/attnserve_engine_bench --benchmark_filter="$filter" \
    --benchmark_min_time=3 >"$out/bench.txt" 2>/dev/null
  grep -E '^(cpu_class|onednn|One|Bat|Pro)' "$out/bench.txt"
  group "$out/perf.data"
  echo "oneDNN kernels (ONEDNN_VERBOSE, 0.3 s of the same benchmark):"
  ONEDNN_VERBOSE=1 build/attnserve_engine_bench --benchmark_filter="$filter" --benchmark_min_time=0.3 \
    >"$out/verbose.txt" 2>&1 || true
  kernels "$out/verbose.txt"
  exit 0
fi
dtype=${2:?dtype}; wire=${3:?wire dtype}; w=${4:?W1 or W2}
args=(--callers 32 --lengths uniform:8:64)
[ "$w" = W2 ] && args=(--callers 32 --lengths uniform:16:512 --cross 0.5 --pool 48)
port=50089
pid=
stop() { if [ -n "$pid" ]; then kill -TERM "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; pid=; fi; }
trap stop EXIT
serve() {  # extra env...
  env "$@" build/attnserve --address 127.0.0.1:$port --metrics-address "" --http-address "" --dtype "$dtype" >"$out/server.log" 2>&1 &
  pid=$!
  for _ in $(seq 100); do grep -q serving "$out/server.log" 2>/dev/null && return; sleep 0.1; done
  echo "profile: the server did not start" >&2; cat "$out/server.log" >&2; exit 1
}
serve
build/attnserve-bench --target 127.0.0.1:$port --wire-dtype "$wire" --duration 8 --warmup 1 "${args[@]}" \
  >"$out/bench.txt" 2>/dev/null &
load=$!
sleep 3
perf record -q -a -g -o "$out/perf.data" -- sleep 4 >/dev/null 2>&1
wait "$load"
tail -1 "$out/bench.txt"
group "$out/perf.data"
stop
echo "oneDNN kernels (ONEDNN_VERBOSE, the server under 2 s of the same load):"
serve ONEDNN_VERBOSE=1
build/attnserve-bench --target 127.0.0.1:$port --wire-dtype "$wire" --duration 2 --warmup 0.5 "${args[@]}" >/dev/null 2>&1
stop
kernels "$out/server.log"
