#!/usr/bin/env bash
# Builds docker/Dockerfile, runs the image, and asks it from the host with attnserve-cli:
# health (SERVING), an attend request, a non-root user, the image's own HEALTHCHECK, and a
# graceful stop (exit 0). Without a Docker engine it uses podman itself (../shared/tools/container-env.sh),
# never podman's Docker-compatible socket service, a daemon that would outlive the test. The image
# build reads and fills the compiler cache the host's builds share (cmake/AttnserveCcache.cmake)
# when the engine is podman (a build volume; docker build has none).
# usage: container_test.sh PATH/TO/attnserve-cli   (run from the repository root)
#        container_test.sh --build-only                the image alone (tools/build.sh builds it while
#                                                      it compiles the other trees; the test's own build
#                                                      then finds every layer cached)
set -euo pipefail
cli=$1
image=localhost/attnserve:test
name=attnserve-test-$$
port=$((20000 + $$ % 10000)); metrics=$((port + 1))

engine=docker
build_args=()
if ! docker info >/dev/null 2>&1; then
  eval "$(../shared/tools/container-env.sh)"
  engine=podman
  ccache_dir=${ATTNSERVE_CCACHE_DIR:-$HOME/.cache/attnserve/ccache}
  mkdir -p "$ccache_dir"
  # --format docker: an OCI image (podman's default) has no HEALTHCHECK.
  build_args=(--format docker --volume "$ccache_dir:/ccache")
fi
docker() { command "$engine" "$@"; }
passed=0; failed=0
check() { if eval "$2"; then echo "ok   $1"; passed=$((passed+1)); else echo "FAIL $1"; failed=$((failed+1)); fi; }
cleanup() { docker rm -f "$name" >/dev/null 2>&1 || true; }
trap cleanup EXIT

start=$(date +%s)
docker build -q "${build_args[@]}" -f docker/Dockerfile -t "$image" . >/dev/null
echo "container: image built in $(( $(date +%s) - start )) s ($(docker image inspect "$image" --format '{{.Size}}' | awk '{printf "%.0f MiB", $1/1048576}'))"
[ "$cli" = --build-only ] && exit 0

# Host networking: this machine's container runtime has no port publishing to rely on.
docker run -d --name "$name" --network host -e "ATTNSERVE_TARGET=127.0.0.1:$port" "$image" \
  attnserve --address "127.0.0.1:$port" --metrics-address "127.0.0.1:$metrics" --http-address "" >/dev/null
for _ in $(seq 120); do
  "$cli" --target "127.0.0.1:$port" --deadline-ms 1000 health >/dev/null 2>&1 && break
  sleep 0.5
done
check "health is SERVING" '"$cli" --target 127.0.0.1:$port health | grep -qx SERVING'
out=$("$cli" --target "127.0.0.1:$port" attend --model demo --batch 2 --query-len 16 --weights avg)
echo "$out"
check "attend answers [2, 16, 512]" 'grep -q "output \[2, 16, 512\], weights \[2, 16, 16\]" <<<"$out"'
metrics_text=$(curl -s "http://127.0.0.1:$metrics/metrics" 2>&1 || true)
check "metrics served" 'grep -q "attnserve_requests_total{code=\"OK\"" <<<"$metrics_text"'
if ! grep -q "attnserve_requests_total{code=\"OK\"" <<<"$metrics_text"; then  # Say what came instead.
  echo "metrics on :$metrics answered: $(head -c 600 <<<"$metrics_text")"
  docker logs "$name" 2>&1 | tail -5
fi
check "runs as non-root" '[ "$(docker exec "$name" id -u)" != 0 ]'
check "default command serves the demo on 0.0.0.0" \
  '[ "$(docker image inspect "$image" --format "{{json .Config.Cmd}}")" = "[\"attnserve\",\"--address\",\"0.0.0.0:50051\",\"--http-address\",\"0.0.0.0:8000\",\"--metrics-address\",\"0.0.0.0:9464\"]" ]'
check "image HEALTHCHECK uses attnserve-cli" \
  '$engine image inspect "$image" --format "{{json .Config.Healthcheck}}" | grep -q attnserve-cli'
if [ $engine = podman ]; then
  check "image HEALTHCHECK passes" 'podman healthcheck run "$name"'
else
  check "image HEALTHCHECK passes" 'for _ in $(seq 60); do [ "$(docker inspect "$name" --format "{{.State.Health.Status}}")" = healthy ] && break; sleep 1; done; [ "$(docker inspect "$name" --format "{{.State.Health.Status}}")" = healthy ]'
fi
docker stop -t 30 "$name" >/dev/null
check "SIGTERM stops it with exit 0" '[ "$(docker inspect "$name" --format "{{.State.ExitCode}}")" = 0 ]'
# The image holds only attnserve's shared-library closure: the PyTorch conformance matrix through a
# server inside it, in float32 and bfloat16 (oneDNN's paths), shows nothing it loads is missing.
wrapper=$(bash tests/container/in_image_wrapper.sh "$engine" "$image")
check "conformance through the image, float32" \
  '/usr/bin/python3 tests/conformance/conformance.py "$wrapper" | tail -1 | grep -qE "^conformance: [0-9]+ passed, 0 failed"'
check "conformance through the image, bfloat16" \
  '/usr/bin/python3 tests/conformance/conformance.py "$wrapper" --server-args "--dtype bfloat16" --reference float64 --tolerance 2e-2 --weights-tolerance 1e-2 --random 300 --seed 1 | tail -1 | grep -qE "^conformance: [0-9]+ passed, 0 failed"'
rm -f "$wrapper"

# deploy/k8s: the manifests' structure, and the Deployment run with `podman kube play` on this image.
if [ $engine = podman ]; then
  check "deploy/k8s (tests/container/k8s_test.py)" \
    'ATTNSERVE_CONTAINER_ENGINE=podman /usr/bin/python3 tests/container/k8s_test.py "$image" "$cli" "$(dirname "$cli")/attnserve"'
else
  echo "SKIP deploy/k8s (tests/container/k8s_test.py): needs podman kube play; run it by hand"
fi
echo "container_test: $passed passed, $failed failed"
[ "$failed" = 0 ]
