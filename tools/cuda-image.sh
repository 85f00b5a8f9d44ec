#!/usr/bin/env bash
# Builds docker/Dockerfile.cuda, the CUDA image on a Debian base, with no network inside the build:
#  1. the host's pip fills a wheel cache, build-cuda-image/wheels (pinned below; pip's own cache makes a
#     second call cheap), because container builds here cannot be assumed to reach PyPI;
#  2. the build context, build-cuda-image/context, gets the sources the Dockerfile copies and those
#     wheels (hard links where possible);
#  3. docker (or podman via ../shared/tools/container-env.sh when no Docker engine answers) builds it.
#   tools/cuda-image.sh [TAG]          # default localhost/attnserve:cuda; prints the tag and size
# Idempotent: the wheel cache is kept, and the engine's layer cache reuses every unchanged step.
set -euo pipefail
cd "$(dirname "$0")/.."
tag=${1:-localhost/attnserve:cuda}
# torch 2.11.0 is the flavour's pin (tools/torch2-env.sh); nvcc & co. are the CUDA 13.0 compiler its
# CMake config asks for (enable_language(CUDA)), from PyPI rather than an NVIDIA image.
pins=(torch==2.11.0 nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-crt==13.0.88
      nvidia-cuda-cccl==13.0.85)
out=build-cuda-image
mkdir -p "$out/wheels"
if [ ! -f "$out/wheels/.pins" ] || [ "$(cat "$out/wheels/.pins")" != "${pins[*]}" ]; then
  # The image's Python is Debian bookworm's 3.11 on x86-64, as is this host's: the wheels pip picks here
  # are the ones the image installs. pip from a small venv (Debian's python3 may lack pip).
  [ -x "$out/pip-venv/bin/pip" ] || /usr/bin/python3 -m venv "$out/pip-venv"
  "$out/pip-venv/bin/pip" download -q --only-binary=:all: -d "$out/wheels" "${pins[@]}" >&2
  echo "${pins[*]}" >"$out/wheels/.pins"
fi

ctx=$out/context
rm -rf "$ctx"
mkdir -p "$ctx/wheels"
cp -a CMakeLists.txt cmake proto include client server "$ctx/"
cp -al "$out"/wheels/*.whl "$ctx/wheels/" 2>/dev/null || cp -a "$out"/wheels/*.whl "$ctx/wheels/"
printf '%s\n' "${pins[@]}" >"$ctx/requirements.txt"

if ! docker info >/dev/null 2>&1; then
  eval "$(../shared/tools/container-env.sh --docker)"
fi
start=$(date +%s)
docker build -q -f docker/Dockerfile.cuda -t "$tag" "$ctx" >/dev/null
size=$(docker image inspect "$tag" --format '{{.Size}}' | awk '{printf "%.0f MiB", $1/1048576}')
echo "cuda-image: $tag built in $(( $(date +%s) - start )) s ($size)" >&2
echo "$tag"
