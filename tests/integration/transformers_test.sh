#!/usr/bin/env bash
# transformers_test.py under the LibTorch 2.x environment's Python (tools/torch2-env.sh: transformers,
# pinned, with the torch it needs), against either flavour's attnserve.
#   tests/integration/transformers_test.sh ATTNSERVE JUNIT_DIR [pytest args]
set -euo pipefail
if [ $# -lt 2 ] || [ ! -d "$2" ]; then  # JUNIT_DIR: a folder that exists, not a pytest flag.
  echo "usage: $0 ATTNSERVE JUNIT_DIR [pytest args]" >&2
  exit 2
fi
here=$(cd "$(dirname "$0")" && pwd)
venv=$("$here/../../tools/torch2-env.sh")
exec "$venv/bin/python" -m pytest "$here/transformers_test.py" -q -p no:cacheprovider \
  --attnserve "$1" --junitxml="$2/pytest-transformers.xml" "${@:3}"
