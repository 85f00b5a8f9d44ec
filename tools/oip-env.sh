#!/usr/bin/env bash
# The Open Inference Protocol's own clients, unmodified from PyPI, for the OIP tests, each in a
# virtual environment linked from build-oip/ (ignored by git; made once per machine outside the clone,
# tools/shared-venv.sh). Pinned; idempotent: a second call with the same pins returns at once.
#   tools/oip-env.sh            # tritonclient[grpc,http] (gRPC and HTTP) with ml_dtypes for BF16, on top of Debian's
#                               # Python and its python3-torch (the reference nn.MultiheadAttention);
#                               # tritonclient needs protobuf >= 6 and grpcio >= 1.81, newer than Debian's
#   tools/oip-env.sh kserve     # KServe's Python SDK (InferenceGRPCClient), alone: it needs numpy 2,
#                               # which Debian's torch 1.13 cannot load, so no system packages
# Prints the venv's path.
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-triton}" in
  triton)
    pins=("tritonclient[grpc,http]==2.73.0" grpcio==1.81.1 grpcio-tools==1.81.1 protobuf==6.33.6 ml_dtypes==0.5.4)
    venv=build-oip/venv system=--system-site-packages check='import tritonclient.grpc, tritonclient.http, grpc_tools, ml_dtypes, torch' ;;
  kserve)
    pins=(kserve==0.21.0 grpcio==1.85.3 grpcio-tools==1.81.1 protobuf==6.33.6 numpy==2.4.6 pytest==7.2.1)
    venv=build-oip/venv-kserve system= check='import kserve, grpc_tools, numpy, pytest' ;;
  *) echo "tools/oip-env.sh: triton or kserve, not '$1'" >&2; exit 2 ;;
esac
source tools/shared-venv.sh
shared_venv "oip-${1:-triton}" $system "${pins[@]}"
shared_venv_install "$venv" "$system" "$check" "${pins[@]}"
echo "$PWD/$venv"
