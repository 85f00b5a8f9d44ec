#!/usr/bin/env bash
# The Open Inference Protocol's own clients, unmodified from PyPI, for the OIP tests: tritonclient
# (gRPC) with ml_dtypes for BF16, in a virtual environment in build-oip/venv (ignored by git) on top
# of Debian's Python and its python3-torch (the reference nn.MultiheadAttention). tritonclient needs
# protobuf >= 6 and grpcio >= 1.81, newer than Debian's, so they are pinned here too. Idempotent: a
# second call with the same pins returns at once.
#   tools/oip-env.sh            # prints the venv's path
set -euo pipefail
cd "$(dirname "$0")/.."
pins=("tritonclient[grpc]==2.73.0" grpcio==1.81.1 grpcio-tools==1.81.1 protobuf==6.33.6 ml_dtypes==0.5.4)
venv=build-oip/venv
stamp="$venv/.pins"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "${pins[*]}" ]; then
  echo "$PWD/$venv"
  exit 0
fi
[ -x "$venv/bin/python" ] || /usr/bin/python3 -m venv --system-site-packages "$venv"
"$venv/bin/pip" install -q "${pins[@]}" >&2
"$venv/bin/python" -c 'import tritonclient.grpc, grpc_tools, ml_dtypes, torch' >&2
echo "${pins[*]}" >"$stamp"
echo "$PWD/$venv"
