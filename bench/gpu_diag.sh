#!/usr/bin/env bash
# A short GPU check of ragged long requests (after bench/gpu_check.sh --build-only built build-cuda):
# the in-process engine and the server at E=1024, 64 callers of lengths 64-2048, bfloat16, with
# the conformance and varlen checks at bfloat16 beside them.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-bench/out-gpu}; mkdir -p "$out"
lib=/tmp/attnserve-deps/usr/lib/x86_64-linux-gnu
export LD_LIBRARY_PATH=$lib PATH=/tmp/attnserve-deps/usr/bin:$PATH
models=/tmp/diag-models; mkdir -p $models
python3 - "$models" <<'PY'
import sys, torch
sys.path.insert(0, "tools")
import export_model
torch.manual_seed(0)
export_model.export(torch.nn.MultiheadAttention(1024, 16, batch_first=True), f"{sys.argv[1]}/mha1024")
PY
args=(--model mha1024 --embed-dim 1024 --callers 64 --lengths uniform:64:2048 --pool 64 --duration 10 --warmup 3)
build-cuda/attnserve-bench --target inprocess --models $models --device cuda --dtype bfloat16 --workers 4 \
  --label inprocess-bfloat16 "${args[@]}" 2>/dev/null
build-cuda/attnserve --address 127.0.0.1:50151 --metrics-address 127.0.0.1:9551 --models $models \
  --device cuda --dtype bfloat16 --workers 4 >$out/server.log 2>&1 &
pid=$!
for _ in $(seq 150); do grep -q serving $out/server.log && break; sleep 0.2; done
build-cuda/attnserve-bench --target 127.0.0.1:50151 --label attnserve-bfloat16 "${args[@]}" 2>/dev/null
LD_LIBRARY_PATH= curl -s http://127.0.0.1:9551/metrics | grep -E '^attnserve_attention_backend_total'
kill -TERM $pid; wait $pid
python3 tests/conformance/conformance.py build-cuda/attnserve --reference float64 \
  --server-args "--device cuda --dtype bfloat16" --tolerance 1e-2 2>&1 | tail -1
python3 tests/conformance/varlen_load.py build-cuda/attnserve --server-args "--device cuda --dtype bfloat16" \
  --callers 64 --tolerance 1e-2 --expect-backend flash_varlen 2>&1 | tail -5
