#!/usr/bin/env bash
# The benchmark's peer serving framework: Ray Serve (dynamic batching with @serve.batch, gRPC ingress)
# in a virtual environment in build-peers/venv (ignored by git), on top of Debian's Python and its
# python3-torch (the same PyTorch 1.13 as the default build and the Python baseline). Pinned;
# idempotent: a second call with the same pins returns at once.
#   tools/peer-env.sh            # prints the venv's path
set -euo pipefail
cd "$(dirname "$0")/.."
pins=("ray[serve]==2.60.0" grpcio==1.85.1 grpcio-tools==1.85.1 protobuf==7.36.2)
venv=build-peers/venv
stamp="$venv/.pins"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "${pins[*]}" ]; then
  echo "$PWD/$venv"
  exit 0
fi
[ -x "$venv/bin/python" ] || /usr/bin/python3 -m venv --system-site-packages "$venv"
"$venv/bin/pip" install -q "${pins[@]}" >&2
"$venv/bin/python" -c 'import ray.serve, grpc, grpc_tools, torch' >&2
echo "${pins[*]}" >"$stamp"
echo "$PWD/$venv"
