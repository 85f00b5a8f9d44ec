#!/usr/bin/env bash
# One command for a GPU machine that has Python torch 2.x, CMake, ninja and nvcc but no apt and no
# network. Prepare here (Debian 12), then carry .debs:
#   tools/fetch_gpu_debs.sh            # bookworm .deb files of gRPC, protobuf, prometheus-cpp, ... (~25 MB)
# There (repository root):
#   bench/gpu_check.sh                 # writes bench/out-gpu/ (or $OUT/ when set)
#   bench/gpu_check.sh --build-only    # step 1 alone; rehearsed on the CPU machines against the
#                                      # LibTorch 2.x flavour: PYTHON=build-torch2/venv/bin/python
# It
#   1. unpacks .debs into a private prefix (never into /) and builds attnserve against the Python
#      torch's LibTorch (CUDA);
#   2. runs the PyTorch conformance matrix with the server on CUDA at float32, TF32, float16 and
#      bfloat16 against nn.MultiheadAttention in float64 on the CPU (tolerances 1e-5, 1e-3, 1e-2, 1e-2);
#      Then ragged small requests from 64 callers (tests/conformance/varlen_load.py): varlen
#      launches checked against float64 at bfloat16, float16 and float32.
#   3. measures the GPU's bf16 matmul peak, then runs the GPU benchmark (E=1024, 16 heads, lengths
#      64-2048, 64 callers) on the in-process engine and on attnserve, reporting attention TFLOP/s
#      against that peak; and small ragged requests (8-128 tokens) with --varlen-attention auto
#      vs off.
#   Also keys and values kept on the GPU: kv_conformance at float32 and bfloat16, and
#   attnserve-kv-bench (sessions and memories vs resending).
set -euo pipefail
cd "$(dirname "$0")/.."
debs=${ATTNSERVE_DEBS:-.debs}
out=${OUT:-bench/out-gpu}
prefix=/tmp/attnserve-deps
build=build-cuda
mkdir -p "$out" "$prefix"
log() { echo "gpu_check: $*" | tee -a "$out/summary.txt"; }
: >"$out/summary.txt"

# 1. Dependencies from .deb files, and the build.
ls "$debs"/*.deb >/dev/null 2>&1 || { echo "gpu_check: no .deb files in $debs (run tools/fetch_gpu_debs.sh on Debian first)" >&2; exit 2; }
for f in "$debs"/*.deb; do dpkg -x "$f" "$prefix"; done
lib="$prefix/usr/lib/x86_64-linux-gnu"
export PATH="$prefix/usr/bin:$PATH" LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# pkg-config names libraries as -lNAME with -L/usr/...: the linker finds them in the prefix.
export LIBRARY_PATH="$lib${LIBRARY_PATH:+:$LIBRARY_PATH}"
python=${PYTHON:-python3}
torch_prefix=$("$python" -c 'import torch; print(torch.utils.cmake_prefix_path)')
log "$("$python" -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda, "on",
  torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU")')"
start=$(date +%s)
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DATTNSERVE_BUILD_TESTS=OFF \
  -DCMAKE_PREFIX_PATH="$torch_prefix;$prefix/usr" -DProtobuf_PROTOC_EXECUTABLE="$prefix/usr/bin/protoc" \
  -DCMAKE_CUDA_ARCHITECTURES=90 >"$out/cmake.log" 2>&1 || { tail -40 "$out/cmake.log"; exit 1; }
grep "attnserve: LibTorch" "$out/cmake.log" | tee -a "$out/summary.txt"
cmake --build "$build" -j"$(nproc)" >"$out/build.log" 2>&1 || { grep -B2 -A12 "error" "$out/build.log" | head -80; exit 1; }
log "build: $(( $(date +%s) - start )) s"
if [ "${1:-}" = --build-only ]; then exit 0; fi

# 2. Conformance on CUDA at each dtype against a float64 CPU reference.
status=0
run_conformance() {  # name, server flags, tolerance
  log "conformance $1 (attnserve $2, tolerance $3)"
  if "$python" tests/conformance/conformance.py "$build/attnserve" --reference float64 \
       --server-args "$2" --tolerance "$3" >"$out/conformance_$1.txt" 2>&1; then
    tail -1 "$out/conformance_$1.txt" | tee -a "$out/summary.txt"
  else
    status=1; tail -25 "$out/conformance_$1.txt" | tee -a "$out/summary.txt"
  fi
}
run_conformance float32 "--device cuda --dtype float32" 1e-5
run_conformance tf32 "--device cuda --dtype float32 --tf32" 1e-3
run_conformance float16 "--device cuda --dtype float16" 1e-2
run_conformance bfloat16 "--device cuda --dtype bfloat16" 1e-2
# Ragged small requests from 64 concurrent callers, packed into varlen launches: every answer
# against float64, and the kernel that ran (flash's varlen form for 16-bit, memory-efficient's
# for float32).
run_varlen() {  # name, server flags, tolerance, expected backend
  log "varlen load $1 (attnserve $2, tolerance $3, expecting $4)"
  if "$python" tests/conformance/varlen_load.py "$build/attnserve" --server-args "$2" --callers 64 \
       --tolerance "$3" --expect-backend "$4" >"$out/varlen_$1.txt" 2>&1; then
    tail -5 "$out/varlen_$1.txt" | tee -a "$out/summary.txt"
  else
    status=1; tail -25 "$out/varlen_$1.txt" | tee -a "$out/summary.txt"
  fi
}
run_varlen bfloat16 "--device cuda --dtype bfloat16" 1e-2 flash_varlen
run_varlen float16 "--device cuda --dtype float16" 1e-2 flash_varlen
run_varlen float32 "--device cuda --dtype float32" 1e-5 efficient_varlen
# Keys and values kept on the GPU: sessions and memories against nn.MultiheadAttention.
run_kv() {  # name, server flags, tolerance
  log "kv conformance $1 (attnserve $2, tolerance $3)"
  if "$python" tests/conformance/kv_conformance.py "$build/attnserve" --server-args "$2" --tolerance "$3" \
       >"$out/kv_$1.txt" 2>&1; then
    tail -1 "$out/kv_$1.txt" | tee -a "$out/summary.txt"
  else
    status=1; tail -25 "$out/kv_$1.txt" | tee -a "$out/summary.txt"
  fi
}
run_kv float32 "--device cuda --dtype float32" 1e-5
run_kv bfloat16 "--device cuda --dtype bfloat16" 3e-2  # CPU bfloat16 here: worst 2.0e-2

# 3. Peak, model, benchmark.
peak=$("$python" - <<'PY'
import torch
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16); b = torch.randn_like(a)
for _ in range(3): a @ b
torch.cuda.synchronize(); s, e = torch.cuda.Event(True), torch.cuda.Event(True); s.record()
for _ in range(10): a @ b
e.record(); torch.cuda.synchronize()
print(f"{2 * 8192**3 * 10 / (s.elapsed_time(e) / 1e3) / 1e12:.0f}")
PY
)
log "bf16 matmul peak (8192^3, mean of 10): $peak TFLOP/s"
models=$(mktemp -d)
"$python" - "$models" <<'PY'
import sys, torch
sys.path.insert(0, "tools")
import export_model
torch.manual_seed(0)
export_model.export(torch.nn.MultiheadAttention(1024, 16, batch_first=True), f"{sys.argv[1]}/mha1024")
PY
bench_args=(--model mha1024 --embed-dim 1024 --callers 64 --lengths uniform:64:2048 --pool 64 --duration 10 --warmup 3)
for dtype in bfloat16 float16; do
  "$build/attnserve-bench" --target inprocess --models "$models" --device cuda --dtype $dtype --workers 4 \
    --label "inprocess-$dtype" --json "$out/gpu_bench.jsonl" "${bench_args[@]}" 2>/dev/null | tee -a "$out/summary.txt"
  "$build/attnserve" --address 127.0.0.1:50151 --metrics-address 127.0.0.1:9551 --http-address "" --models "$models" \
    --device cuda --dtype $dtype --workers 4 >"$out/server_$dtype.log" 2>&1 &
  pid=$!
  for _ in $(seq 150); do grep -q serving "$out/server_$dtype.log" && break; sleep 0.2; done
  "$build/attnserve-bench" --target 127.0.0.1:50151 --label "attnserve-$dtype" --json "$out/gpu_bench.jsonl" \
    "${bench_args[@]}" 2>/dev/null | tee -a "$out/summary.txt"
  LD_LIBRARY_PATH= curl -s http://127.0.0.1:9551/metrics >"$out/metrics_$dtype.txt" || true
  grep -E '^attnserve_(attention_backend_total|device_memory_bytes|achieved_flops)' "$out/metrics_$dtype.txt" \
    | tee -a "$out/summary.txt" || true
  # cuDNN's attention compiles a kernel per new shape at run time: ragged lengths stall on it.
  if grep -q 'backend="cudnn"' "$out/metrics_$dtype.txt"; then
    status=1; log "FAIL: requests of ragged lengths ran cuDNN's runtime-compiled attention"
  fi
  kill -TERM $pid; wait $pid || true
done
# Varlen vs per-request attention on small ragged requests (8-128 tokens, packed 1024 tokens a
# batch): the same server flags but --varlen-attention.
for varlen in auto off; do
  "$build/attnserve" --address 127.0.0.1:50151 --metrics-address 127.0.0.1:9551 --http-address "" --models "$models" \
    --device cuda --dtype bfloat16 --workers 4 --varlen-attention $varlen >"$out/server_varlen_$varlen.log" 2>&1 &
  pid=$!
  for _ in $(seq 150); do grep -q serving "$out/server_varlen_$varlen.log" && break; sleep 0.2; done
  "$build/attnserve-bench" --target 127.0.0.1:50151 --label "small-varlen-$varlen" --json "$out/gpu_bench.jsonl" \
    --model mha1024 --embed-dim 1024 --callers 64 --lengths uniform:8:128 --pool 64 --duration 10 --warmup 3 \
    2>/dev/null | tee -a "$out/summary.txt"
  LD_LIBRARY_PATH= curl -s http://127.0.0.1:9551/metrics | grep -E '^attnserve_attention_backend_total' | tee -a "$out/summary.txt" || true
  kill -TERM $pid; wait $pid || true
done
# Sessions and memories vs resending (demo model, E=512, H=8) on the GPU, as bench/kv.sh on the CPU.
"$build/attnserve" --address 127.0.0.1:50151 --metrics-address "" --http-address "" --device cuda >"$out/server_kv.log" 2>&1 &
pid=$!
for _ in $(seq 150); do grep -q serving "$out/server_kv.log" && break; sleep 0.2; done
kv=("$build/attnserve-kv-bench" --target 127.0.0.1:50151 --json "$out/kv_bench.jsonl")
{ "${kv[@]}" decode --steps 2048 --repeats 1 --csv "$out/kv_decode.csv"; "${kv[@]}" memory --steps 256
  "${kv[@]}" concurrent --callers 32 --steps 256; } 2>/dev/null | tee -a "$out/summary.txt" || status=1
kill -TERM $pid; wait $pid || true
"$python" - "$out/gpu_bench.jsonl" "$peak" <<'PY' | tee -a "$out/summary.txt"
import json, sys
peak = float(sys.argv[2])
for l in open(sys.argv[1]):
    r = json.loads(l)
    print(f"{r['label']:22s} {r['tflops']:7.1f} TFLOP/s = {100 * r['tflops'] / peak:5.1f}% of bf16 peak, "
          f"{r['requests_per_s']:8.1f} req/s, p50 {r['latency_ms']['p50']:.1f} ms, p99 {r['latency_ms']['p99']:.1f} ms")
PY
exit $status
