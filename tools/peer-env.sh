#!/usr/bin/env bash
# The benchmark's peer serving frameworks, each in its own virtual environment under build-peers/
# (ignored by git). Pinned; idempotent: a second call with the same pins returns at once.
#   tools/peer-env.sh [ray]     # build-peers/venv: Ray Serve (dynamic batching with @serve.batch, gRPC
#                               # ingress) on top of Debian's Python and its python3-torch (the same
#                               # PyTorch 1.13 as the default build and the Python baseline)
#   tools/peer-env.sh kserve    # build-peers/venv-kserve: KServe's Python model server (kserve.Model,
#                               # Open Inference Protocol over gRPC)
#   tools/peer-env.sh mlserver  # build-peers/venv-mlserver: Seldon MLServer (mlserver.MLModel, Open
#                               # Inference Protocol over gRPC)
# KServe 0.21 needs numpy 2, which Debian's torch 1.13 cannot load, so those two venvs take no system
# packages and hold PyPI's torch 2.11.0 (the pin of tools/torch2-env.sh, so pip's cache serves it).
# MLServer 1.7.1's workers fail with uvloop 0.22 or later, hence uvloop 0.21.0.
# Prints the venv's path.
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-ray}" in
  ray)
    pins=("ray[serve]==2.60.0" grpcio==1.85.1 grpcio-tools==1.85.1 protobuf==7.36.2)
    venv=build-peers/venv system=--system-site-packages check='import ray.serve, grpc, grpc_tools, torch' ;;
  kserve)
    # grpcio, grpcio-tools and protobuf as kserve 0.21.0 resolves them (and tools/oip-env.sh kserve pins
    # them); torch 2.11 requires setuptools < 82.
    pins=(kserve==0.21.0 torch==2.11.0 numpy==2.4.6 grpcio==1.85.3 grpcio-tools==1.81.1 protobuf==6.33.6
          setuptools==80.9.0)
    venv=build-peers/venv-kserve system= check='import kserve, torch, numpy, grpc' ;;
  mlserver)
    pins=(mlserver==1.7.1 uvloop==0.21.0 torch==2.11.0 numpy==2.4.6 grpcio==1.85.3 protobuf==6.33.6
          setuptools==80.9.0)
    venv=build-peers/venv-mlserver system= check='import mlserver, mlserver.codecs, uvloop, torch, numpy, grpc' ;;
  *) echo "tools/peer-env.sh: ray, kserve or mlserver, not '$1'" >&2; exit 2 ;;
esac
stamp="$venv/.pins"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "${pins[*]}" ]; then
  echo "$PWD/$venv"
  exit 0
fi
[ -x "$venv/bin/python" ] || /usr/bin/python3 -m venv $system "$venv"
"$venv/bin/pip" install -q "${pins[@]}" >&2
"$venv/bin/python" -c "$check" >&2
echo "${pins[*]}" >"$stamp"
echo "$PWD/$venv"
