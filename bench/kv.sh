#!/usr/bin/env bash
# Keys and values kept on the server versus resent with every request, one run, side by
# side: attnserve-kv-bench's six modes against one attnserve (built-in demo model, E=512, H=8), then
# a second attnserve with a small --kv-budget-bytes for the eviction figures (server memory from
# /proc and the attnserve_kv_* metrics). Writes bench/out-kv/ (results.jsonl, decode.csv, the plot
# kv_decode.png) and prints the tables. Takes ~3 minutes here (KV_STEPS=2048, KV_REPEATS=3).
#   KV_STEPS  decode length (default 2048)   KV_REPEATS  decode repeats (3)   KV_CALLERS  (32)
#   KV_SPECULATIVE  tokens accepted in the speculative-decoding run (512)   KV_BEAM  beam-search steps (512)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${ATTNSERVE_BUILD_DIR:-build}
out=bench/out-kv
steps=${KV_STEPS:-2048}
repeats=${KV_REPEATS:-3}
callers=${KV_CALLERS:-32}
rm -rf "$out" && mkdir -p "$out"
cmake --build "$build" -j"$(nproc)" --target attnserve attnserve_kv_bench >/dev/null
command -v gnuplot >/dev/null || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends gnuplot-nox >/dev/null; }
command -v curl >/dev/null || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends curl >/dev/null; }
port=50081
metrics=50082
pid=
stop() { if [ -n "$pid" ]; then kill -TERM "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; pid=; fi; }
trap stop EXIT
start() {  # extra server flags...
  stop
  "$build/attnserve" --address 127.0.0.1:$port --metrics-address 127.0.0.1:$metrics --http-address "" "$@" >"$out/server.log" 2>&1 &
  pid=$!
  for _ in $(seq 100); do grep -q "serving" "$out/server.log" 2>/dev/null && return; sleep 0.2; done
  echo "kv.sh: attnserve did not start" >&2; cat "$out/server.log" >&2; exit 1
}
memory_kib() { awk -v k="$2" '$1 == k":" { print $2 }' "/proc/$1/status"; }
kv_metrics() { curl -s "http://127.0.0.1:$metrics/metrics" | grep -E '^attnserve_kv_(bytes|entries|ends_total)' | grep -v ' 0$' || true; }
bench() { "$build/attnserve-kv-bench" --target 127.0.0.1:$port --json "$out/results.jsonl" "$@"; }

start
bench decode --steps "$steps" --repeats "$repeats" --csv "$out/decode.csv"
echo
bench memory --memory-length 1024 --steps 256
echo
bench concurrent --callers "$callers" --steps 256
echo
bench concurrent --callers "$callers" --prompt 1024 --steps 64
echo
# Speculative decoding: 4-token drafts, a random accepted prefix each round (TruncateSession vs resend).
bench speculative --draft 4 --steps "${KV_SPECULATIVE:-512}"
echo
# Beam search: 4 beams, 512 steps (ForkSession vs resending vs re-prompting a session per beam).
bench beam --beams 4 --steps "${KV_BEAM:-512}"
echo
# What one ForkSession costs on a 2,048-token history (time, bytes, the fork's first step).
bench fork --prompt 2048 --repeats 20

# Eviction: a 64 MiB budget, 4 MiB memories (1,024 tokens, K and V at E=512 in float32), 200 of them.
budget=$((64 << 20))
start --kv-budget-bytes $budget --kv-max-entry-bytes $((16 << 20))
rss0=$(memory_kib "$pid" VmRSS)
echo
bench eviction --memory-length 1024 --memories 200
echo "  server memory: VmRSS $((rss0 / 1024)) MiB before, $(( $(memory_kib "$pid" VmRSS) / 1024 )) MiB after," \
     "peak (VmHWM) $(( $(memory_kib "$pid" VmHWM) / 1024 )) MiB; budget $((budget >> 20)) MiB; non-zero kv metrics:"
kv_metrics | sed 's/^/    /' | tee "$out/eviction_metrics.txt"
stop

gnuplot <<GP
set terminal pngcairo size 1100,480 noenhanced
set output "$out/kv_decode.png"
set datafile separator ","
set multiplot layout 1,2 title "Decoding one sequence, E=512, H=8, 2-core CPU: session step vs resending the prefix"
set xlabel "step T (tokens held)"
set logscale x 2
set logscale y
set grid
set key top left
set ylabel "per-step latency (ms), median of $repeats"
plot "$out/decode.csv" every ::1 using 1:3 with lines lw 1 title "resend prefix", \
     "" every ::1 using 1:2 with lines lw 1 title "session"
set ylabel "bytes on the wire per step (request + answer)"
plot "$out/decode.csv" every ::1 using 1:5 with lines lw 2 title "resend prefix", \
     "" every ::1 using 1:4 with lines lw 2 title "session"
unset multiplot
GP
echo "kv.sh: plot in $out/kv_decode.png, results in $out/results.jsonl"
