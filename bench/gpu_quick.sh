#!/usr/bin/env bash
# Every GPU goal in one run of ~3 minutes of device time, on a build made HERE and carried there
# (bench/gpu_check.sh builds on the device and measures more: ~6 min with the build). Here (Debian 12):
#   tools/fetch_gpu_debs.sh                                        # .debs: gRPC, protobuf, ... (~34 MB)
#   PYTHON=build-torch2/venv/bin/python bench/gpu_check.sh --build-only   # build-cuda/, ~1 min warm
# There (the device tool's `run`, carry [".debs", "build-cuda/attnserve", "build-cuda/attnserve-bench",
# "build-cuda/attnserve-cli", "build-cuda/attnserve-echo"]):
#   bench/gpu_quick.sh                                             # writes $OUT/quick.log, quick.jsonl
# build-cuda links LibTorch 2.11+cu130 from build-torch2/venv; the device's python3 holds the same
# torch, whose lib directory (and the CUDA wheels' beside it) this script puts on the library path.
# Checks, each printed as a ratio against its goal; the script fails when any is missed:
#   conformance vs float64 on CUDA at bfloat16, float16 and float32 (18/18 each); ragged small
#   requests from 64 callers in varlen launches (flash_varlen), every answer checked;
#   E=1024, 16 heads, lengths 64-2048, 64 callers, bfloat16 with the bfloat16 wire:
#     the engine in process behind the server's batcher >= 0.5x the copy bound (pinned host<->device
#     bandwidth measured in the same run, both ways at once, over the workload's bytes);
#     attnserve >= 3x the Python peer (bench/baselines/python_server.py on the same GPU, same dtype
#     and wire, same weights); attnserve over gRPC (bfloat16 wire, 4 connections) >= 0.8x
#     attnserve-echo at the same bytes (the transport's own bound) and >= 3x 593 req/s (2026-11-26);
#     attnserve over shared memory (--shared-memory) >= 0.8x the engine in process;
#   small ragged requests (8-128 tokens, float32 wire) through attnserve >= 2,997 req/s (2026-11-26);
#   no cuDNN attention (it compiles a kernel per shape); the first request after start within 2x the
#   steady p50 of the same request (bench/first_request.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-bench/out-gpu}
mkdir -p "$out"
prefix=/tmp/attnserve-deps
mkdir -p "$prefix"
for f in .debs/*.deb; do dpkg -x "$f" "$prefix"; done
# Rehearsal here: DEVICE=cpu TORCH_DIR=build-torch2/venv/lib/python3.11/site-packages/torch
# PATH=/usr/bin:$PATH bench/gpu_quick.sh (the varlen, copy-bound and backend checks then fail, as
# they must: there is no GPU).
device=${DEVICE:-cuda}
torch=${TORCH_DIR:-$(python3 -c 'import torch, os; print(os.path.dirname(torch.__file__))')}
cuda_libs=$(find "$(dirname "$torch")/nvidia" -maxdepth 3 -name lib -type d 2>/dev/null | tr '\n' ':')
export LD_LIBRARY_PATH="$prefix/usr/lib/x86_64-linux-gnu:$torch/lib:$cuda_libs"
export PATH="$prefix/usr/bin:$PATH" PYTHONUNBUFFERED=1
exec > >(tee "$out/quick.log") 2>&1
jsonl="$out/quick.jsonl"
: >"$jsonl"
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
large=(--model mha1024 --embed-dim 1024 --callers 64 --lengths uniform:64:2048 --pool 64 --duration 6
       --warmup 2 --json "$jsonl")
bench=build-cuda/attnserve-bench
timeout 40 $bench --target inprocess --batching --models $models --device $device --dtype bfloat16 \
  --wire-dtype bfloat16 --label engine "${large[@]}" 2> >(grep '^attnserve-bench:' >&2) || failed=1
port=50151
# Starts a server (attnserve or the Python peer: the rest of the command line) on $port; waits for it.
serve() {
  local log=$out/server-$port.log
  "$@" >"$log" 2>&1 &
  pid=$!
  for _ in $(seq 300); do grep -q "serving" "$log" && return 0; sleep 0.2; done
  echo "FAIL: did not start: $* ($(tail -1 "$log"))"
  failed=1
  return 1
}
stop() { kill -TERM "$pid" 2>/dev/null; wait "$pid" 2>/dev/null; port=$((port + 1)); }
if serve build-cuda/attnserve --address 127.0.0.1:$port --metrics-address 127.0.0.1:9551 \
     --models $models --device $device --dtype bfloat16 --allow-shared-memory; then
  timeout 25 $bench --target 127.0.0.1:$port --wire-dtype bfloat16 --label attnserve "${large[@]}" 2>/dev/null
  timeout 25 $bench --target 127.0.0.1:$port --wire-dtype bfloat16 --shared-memory --label shm \
    "${large[@]}" 2>/dev/null
  timeout 25 $bench --target 127.0.0.1:$port --model mha1024 --embed-dim 1024 --callers 64 \
    --lengths uniform:8:128 --pool 64 --duration 6 --warmup 2 --wire-dtype float32 --label small \
    --json "$jsonl" 2>/dev/null
  backends=$(LD_LIBRARY_PATH= curl -s http://127.0.0.1:9551/metrics | grep -E '^attnserve_(attention_backend_total|staging)')
  echo "$backends"
  if grep -q cudnn <<<"$backends"; then echo "FAIL: cuDNN's attention is in use"; failed=1; fi
  stop
fi
if serve build-cuda/attnserve-echo --address 127.0.0.1:$port; then
  timeout 25 $bench --target 127.0.0.1:$port --wire-dtype bfloat16 --label echo "${large[@]}" 2>/dev/null
  stop
fi
if serve python3 bench/baselines/python_server.py --port $port --device $device --dtype bfloat16 \
     --model-dir $models/mha1024 --workers 16; then
  timeout 25 $bench --target 127.0.0.1:$port --wire-dtype bfloat16 --label python "${large[@]}" 2>/dev/null
  stop
fi
BUILD=build-cuda MODEL=mha1024 check bench/first_request.sh 2 -- --models $models --device $device \
  --dtype bfloat16
python3 - "$jsonl" <<'PY' || failed=1
import json, sys
rows = {}
for line in open(sys.argv[1]):
    r = json.loads(line)
    rows[r["label"]] = r
def rate(label):
    return rows[label]["requests_per_s"] if label in rows else 0.0
goals = []
engine = rows.get("engine", {})
bound = engine.get("copy", {})
if bound:
    print(f"copy bound: pinned host->device {bound['to_device_gbps']:.1f} GB/s, device->host "
          f"{bound['to_host_gbps']:.1f}, each way at once {bound['both_gbps']:.1f}; "
          f"{bound['bytes_in'] / 1e6:.2f} MB in, {bound['bytes_out'] / 1e6:.2f} MB out a request: "
          f"{bound['bound_requests_per_s']:.0f} req/s")
goals.append(("engine / copy bound", bound.get("of_bound", 0.0), 0.5))
goals.append(("attnserve / python peer (bf16, bf16 wire)", rate("attnserve") / max(rate("python"), 1e-9), 3.0))
goals.append(("small ragged req/s / 2,997", rate("small") / 2997, 1.0))
goals.append(("attnserve over shared memory / engine", rate("shm") / max(rate("engine"), 1e-9), 0.8))
goals.append(("attnserve gRPC / echo bound (bf16 wire)", rate("attnserve") / max(rate("echo"), 1e-9), 0.8))
goals.append(("attnserve gRPC / 593 req/s (2026-11-26)", rate("attnserve") / 593, 3.0))
bad = 0
for name, value, goal in goals:
    ok = value >= goal
    bad += not ok
    print(f"{name:44s} {value:8.2f}  goal >= {goal:.2f}  {'ok' if ok else 'MISSED'}")
sys.exit(1 if bad else 0)
PY
echo "gpu_quick: $([ $failed = 0 ] && echo passed || echo FAILED)"
exit $failed
