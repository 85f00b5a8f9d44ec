#!/usr/bin/env bash
# The LibTorch 2.x flavour's environment: a virtual environment holding PyPI's torch (its LibTorch,
# CUDA-enabled, with the CUDA runtime as nvidia-* packages) and the Python peers the tests use against
# it. Pinned; idempotent: a second call with the same pins returns at once. It is made once per
# machine, outside the clone (tools/shared-venv.sh: ~5 GB that a clean clone would otherwise
# install again), and build-torch2/venv (ignored by git) links to it.
#   tools/torch2-env.sh            # prints the venv's path
# torch 2.11.0 is the version on the GPU machines lent to this project (../shared/PLATFORM.md), so the
# build rehearsed here is the one bench/gpu_check.sh does there.
set -euo pipefail
cd "$(dirname "$0")/.."
pins=(torch==2.11.0 numpy==2.4.6 grpcio==1.85.1 grpcio-tools==1.85.1 protobuf==7.36.2
      "setuptools==80.9.0"  # torch 2.11 requires setuptools < 82; grpcio-tools would pull a newer one.
      h2==4.1.0             # Raw HTTP/2 in tests/integration/stop_test.py, as Debian's python3-h2.
      pytest==7.2.1         # The Python tests' runner, as Debian's python3-pytest.
      transformers==5.23.0) # Decoder layers' reference modules (tests/conformance/decoder_conformance.py).
source tools/shared-venv.sh
shared_venv torch2 "${pins[@]}"
shared_venv_install build-torch2/venv "" 'import torch, grpc, numpy, transformers' "${pins[@]}"
echo "$PWD/build-torch2/venv"
