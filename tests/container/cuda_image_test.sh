#!/usr/bin/env bash
# The CUDA image (docker/Dockerfile.cuda, Debian base, CUDA from PyPI's torch wheels), built with
# tools/cuda-image.sh and run on this GPU-less machine with --device cpu: the PyTorch conformance matrix
# (tests/conformance/conformance.py, float64 reference) through a server inside the image, in float32
# and bfloat16; the start-up line names LibTorch 2.11 built with CUDA; the image's default command
# (--device cuda) refuses clearly on a host without a GPU; non-root; the image's size.
# Too slow for every CI run (a cold build takes ~10 min and moves ~4 GB): one documented command,
#   bash tests/container/cuda_image_test.sh      (from the repository root)
set -euo pipefail
cd "$(dirname "$0")/../.."
tag=$(tools/cuda-image.sh)
engine=docker
if ! docker info >/dev/null 2>&1; then
  # podman itself: the docker CLI through podman's socket reports exit code 0 for `run --rm`.
  eval "$(../shared/tools/container-env.sh)"
  engine=podman
fi
passed=0; failed=0
check() { if eval "$2"; then echo "ok   $1"; passed=$((passed+1)); else echo "FAIL $1"; failed=$((failed+1)); fi; }

# conformance.py starts "the binary": this stand-in runs the image's attnserve (in_image_wrapper.sh).
wrapper=$(bash tests/container/in_image_wrapper.sh "$engine" "$tag")
trap 'rm -f "$wrapper"' EXIT

for dtype in float32 bfloat16; do
  # float32: conformance.py's own tolerances (1e-5; 1e-3 where the wire is float16).
  tol=(); [ $dtype = bfloat16 ] && tol=(--tolerance 2e-2)
  log=$(mktemp)
  set +e
  /usr/bin/python3 tests/conformance/conformance.py "$wrapper" --server-args "--device cpu --dtype $dtype" \
    --reference float64 "${tol[@]}" | tee "$log"
  rc=${PIPESTATUS[0]}
  set -e
  check "conformance in the image, --device cpu --dtype $dtype ${tol[*]}" \
    '[ $rc = 0 ] && grep -qE "^conformance: [0-9]+ passed, 0 failed" "$log"'
  check "it ran LibTorch 2.11 built with CUDA ($dtype)" \
    'grep -q "LibTorch 2.11.0 (built with CUDA, no GPU seen)" "$log"'
  rm -f "$log"
done

set +e
out=$($engine run --rm --no-healthcheck --network host "$tag" 2>&1); rc=$?
set -e
echo "default command without a GPU: exit $rc: $out"
check "default command (--device cuda) without a GPU exits 2 naming --device cpu" \
  '[ $rc = 2 ] && grep -q "\-\-device cuda: CUDA is not available.*use --device cpu" <<<"$out"'
check "runs as non-root" '[ "$($engine run --rm --no-healthcheck "$tag" id -u)" != 0 ]'
echo "cuda image: $($engine image inspect "$tag" --format '{{.Size}}' | awk '{printf "%.0f MiB", $1/1048576}')"
echo "cuda_image_test: $passed passed, $failed failed"
[ "$failed" = 0 ]
