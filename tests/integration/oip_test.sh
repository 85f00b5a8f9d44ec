#!/usr/bin/env bash
# Runs oip_test.py with tritonclient from tools/oip-env.sh's virtual environment (made on first use).
#   tests/integration/oip_test.sh PATH/TO/attnserve
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
venv=$("$here/../../tools/oip-env.sh")
exec "$venv/bin/python" "$here/oip_test.py" "$1"
