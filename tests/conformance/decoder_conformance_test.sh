#!/usr/bin/env bash
# decoder_conformance_test.py under the LibTorch 2.x environment's Python (tools/torch2-env.sh:
# transformers, pinned, with the torch it needs), against either flavour's attnserve.
#   tests/conformance/decoder_conformance_test.sh ATTNSERVE JUNIT_DIR NAME [pytest args]
# (the JUnit report: JUNIT_DIR/pytest-NAME.xml)
set -euo pipefail
if [ $# -lt 3 ] || [ ! -d "$2" ]; then  # JUNIT_DIR: a folder that exists, not a pytest flag.
  echo "usage: $0 ATTNSERVE JUNIT_DIR NAME [pytest args]" >&2
  exit 2
fi
here=$(cd "$(dirname "$0")" && pwd)
venv=$("$here/../../tools/torch2-env.sh")
exec "$venv/bin/python" -m pytest "$here/decoder_conformance_test.py" -q -p no:cacheprovider \
  --attnserve "$1" --junitxml="$2/pytest-$3.xml" "${@:4}"
