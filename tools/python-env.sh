#!/usr/bin/env bash
# The attnserve Python package (client/python) installed into a virtual environment linked from
# build-py/ (ignored by git; made once per machine and package sources outside the clone,
# tools/shared-venv.sh), for its tests and the benchmark. Pinned; idempotent: a second call with the
# same pins and the same package sources returns at once.
#   tools/python-env.sh debian   # on Debian's own grpcio 1.51, protobuf 4.21, numpy and torch 1.13
#                                # (system site packages; the package's dependencies are all met there)
#   tools/python-env.sh newest   # a clean environment with the newest grpcio and protobuf, numpy 2 and
#                                # ml_dtypes; no torch (it is optional)
#   tools/python-env.sh tracing  # newest, plus OpenTelemetry's API, SDK, OTLP exporter and protos (the
#                                # tracing tests' client and receiver); the package with its extra
#   tools/python-env.sh wheel    # builds the wheel into build-py/dist/ (prints its path)
# Prints the venv's path.
set -euo pipefail
cd "$(dirname "$0")/.."
sources=$(cat client/python/pyproject.toml client/python/setup.py client/python/attnserve/*.py \
  client/python/attnserve/v1/*.py proto/attnserve/v1/attention.proto deploy/grpc/*.json | sha256sum | cut -c1-16)
case "${1:-debian}" in
  debian) pins=() venv=build-py/debian system=--system-site-packages check='import attnserve, torch, grpc; assert grpc.__version__.startswith("1.51")' ;;
  newest) pins=(grpcio==1.85.3 protobuf==6.33.6 numpy==2.4.6 ml_dtypes==0.5.4 pytest==7.2.1) venv=build-py/newest system=
          check='import attnserve, ml_dtypes, grpc, pytest; assert grpc.__version__ == "1.85.3"' ;;
  tracing) pins=(grpcio==1.85.3 protobuf==6.33.6 numpy==2.4.6 ml_dtypes==0.5.4 pytest==7.2.1
                opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-proto==1.45.2
                opentelemetry-exporter-otlp-proto-grpc==1.45.2) venv=build-py/tracing system= extra=[tracing]
          check='import attnserve, grpc, opentelemetry.sdk, opentelemetry.proto.collector.trace.v1.trace_service_pb2_grpc' ;;
  wheel)
    rm -rf build-py/dist client/python/build  # setuptools builds in the tree: no stale modules.
    /usr/bin/python3 -m pip wheel -q --no-deps -w build-py/dist client/python >&2
    ls "$PWD"/build-py/dist/attnserve-*.whl
    exit 0 ;;
  *) echo "tools/python-env.sh: debian, newest or wheel, not '$1'" >&2; exit 2 ;;
esac
source tools/shared-venv.sh
shared_venv "py-${1:-debian}" $system ${pins[@]+"${pins[@]}"} "package=$sources"
[ "$venv_fresh" = 0 ] || rm -rf client/python/build  # setuptools builds in the tree: no stale modules.
shared_venv_install "$venv" "$system" "$check" ${pins[@]+"${pins[@]}"} "./client/python${extra:-}"
echo "$PWD/$venv"
