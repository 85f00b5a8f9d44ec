#!/usr/bin/env bash
# The tracing tests in their virtual environment (tools/python-env.sh tracing: OpenTelemetry's SDK,
# its OTLP exporter and protos, the attnserve package with its `tracing` extra), then the Open
# Inference Protocol's in tritonclient's (tools/oip-env.sh triton), with the collector run from
# the first.
#   tests/tracing/tracing_test.sh ATTNSERVE ATTNSERVE_CLI ATTNSERVE_BENCH JUNIT_DIR [pytest args]
set -euo pipefail
if [ $# -lt 4 ] || [ ! -d "$4" ]; then  # JUNIT_DIR: a folder that exists, not a pytest flag.
  echo "usage: $0 ATTNSERVE ATTNSERVE_CLI ATTNSERVE_BENCH JUNIT_DIR [pytest args]" >&2
  exit 2
fi
here=$(cd "$(dirname "$0")" && pwd)
tools="$here/../../tools"
venv=$("$tools/python-env.sh" tracing)
status=0
"$venv/bin/python" -m pytest "$here/tracing_test.py" -q --attnserve "$1" --cli "$2" --bench "$3" \
  --junitxml="$4/pytest-tracing.xml" "${@:5}" || status=1
oip=$("$tools/oip-env.sh" triton)
ATTNSERVE_TRACING_PYTHON="$venv/bin/python" "$oip/bin/python" -m pytest "$here/oip_tracing_test.py" -q \
  --attnserve "$1" --junitxml="$4/pytest-tracing_oip.xml" "${@:5}" || status=1
exit $status
