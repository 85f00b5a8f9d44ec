#!/usr/bin/env bash
# The GPU checks that fit in two minutes of device time, on a build made HERE and carried there
# (bench/gpu_check.sh builds on the device: ~5.5 min with the build). Here (Debian 12):
#   tools/fetch_gpu_debs.sh                                        # .debs: gRPC, protobuf, ... (~34 MB)
#   PYTHON=build-torch2/venv/bin/python bench/gpu_check.sh --build-only   # build-cuda/, ~1 min warm
# There (the device tool's `run`, carry [".debs", "build-cuda/attnserve", "build-cuda/attnserve-bench"]):
#   bench/gpu_quick.sh                                             # ~100 s; writes $OUT/quick.log
# build-cuda here links LibTorch 2.11+cu130 from build-torch2/venv; the device's python3 holds the
# same torch, whose lib directory (and the CUDA wheels' beside it) this script puts on the library
# path. It runs: the conformance matrix on CUDA at bfloat16, float16 and float32 against float64;
# ragged small requests at bfloat16 (varlen launches); ragged long requests (E=1024, 16 heads,
# lengths 64-2048, 64 callers) in process at bfloat16 and float16 and through the server with the
# float32 and the 16-bit wires. It fails when a check fails or cuDNN's attention shows in the
# backend metric (it compiles a kernel per shape: bench/RESULTS.md "GPU, first run").
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-bench/out-gpu}
mkdir -p "$out"
prefix=/tmp/attnserve-deps
mkdir -p "$prefix"
for f in .debs/*.deb; do dpkg -x "$f" "$prefix"; done
# Rehearsal here: DEVICE=cpu TORCH_DIR=build-torch2/venv/lib/python3.11/site-packages/torch
# PATH=/usr/bin:$PATH bench/gpu_quick.sh (the varlen and backend checks then fail, as they must).
device=${DEVICE:-cuda}
torch=${TORCH_DIR:-$(python3 -c 'import torch, os; print(os.path.dirname(torch.__file__))')}
cuda_libs=$(find "$(dirname "$torch")/nvidia" -maxdepth 3 -name lib -type d 2>/dev/null | tr '\n' ':')
export LD_LIBRARY_PATH="$prefix/usr/lib/x86_64-linux-gnu:$torch/lib:$cuda_libs"
export PATH="$prefix/usr/bin:$PATH" PYTHONUNBUFFERED=1
exec > >(tee "$out/quick.log") 2>&1
failed=0
# Runs a check, shows the end of what it printed, and remembers a failure.
check() {
  local log rc
  log=$("$@" 2>&1)
  rc=$?
  tail -2 <<<"$log"
  [ $rc = 0 ] || { echo "FAIL (exit $rc): $*"; failed=1; }
}
nvidia-smi -L 2>/dev/null
for dtype in bfloat16 float16 float32; do
  check timeout 70 python3 tests/conformance/conformance.py build-cuda/attnserve --reference float64 \
    --server-args "--device $device --dtype $dtype" --tolerance 1e-2
done
check timeout 60 python3 tests/conformance/varlen_load.py build-cuda/attnserve \
  --server-args "--device $device --dtype bfloat16" --callers 64 --tolerance 1e-2 \
  --expect-backend flash_varlen
models=/tmp/quick-models
mkdir -p $models
python3 -c "import sys, torch; sys.path.insert(0, 'tools'); import export_model; torch.manual_seed(0); \
export_model.export(torch.nn.MultiheadAttention(1024, 16, batch_first=True), '$models/mha1024')"
args=(--model mha1024 --embed-dim 1024 --callers 64 --lengths uniform:64:2048 --pool 64 --duration 6
      --warmup 2)
for dtype in bfloat16 float16; do
  timeout 25 build-cuda/attnserve-bench --target inprocess --models $models --device $device --dtype $dtype \
    --workers 4 --label inprocess-$dtype "${args[@]}" 2> >(grep '^attnserve-bench:' >&2) || failed=1
done
port=50151
for dtype in bfloat16 float16; do
  build-cuda/attnserve --address 127.0.0.1:$port --metrics-address 127.0.0.1:9551 --models $models \
    --device $device --dtype $dtype --workers 4 >"$out/server-$dtype.log" 2>&1 &
  pid=$!
  for _ in $(seq 150); do grep -q serving "$out/server-$dtype.log" && break; sleep 0.2; done
  if ! grep -q serving "$out/server-$dtype.log"; then
    echo "FAIL: the server did not start at $dtype: $(tail -1 "$out/server-$dtype.log")"
    failed=1
    continue
  fi
  for wire in float32 $dtype; do
    timeout 25 build-cuda/attnserve-bench --target 127.0.0.1:$port --wire-dtype $wire \
      --label server-$dtype-wire-$wire "${args[@]}" 2>/dev/null
  done
  backends=$(LD_LIBRARY_PATH= curl -s http://127.0.0.1:9551/metrics | grep '^attnserve_attention_backend_total')
  echo "$backends"
  if grep -q cudnn <<<"$backends"; then echo "FAIL: cuDNN's attention is in use"; failed=1; fi
  kill -TERM $pid; wait $pid
  port=$((port + 1))
done
echo "gpu_quick: $([ $failed = 0 ] && echo passed || echo FAILED)"
exit $failed
