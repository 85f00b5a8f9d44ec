#!/usr/bin/env bash
# Runs an OIP client test in its client's virtual environment (tools/oip-env.sh, made on first use).
#   tests/integration/oip_test.sh PATH/TO/attnserve             # tritonclient: oip_test.py
#   tests/integration/oip_test.sh PATH/TO/attnserve kserve      # KServe's SDK: oip_kserve_test.py
#   tests/integration/oip_test.sh PATH/TO/attnserve http        # tritonclient.http, curl: oip_http_test.py
# Under pytest (tests/conftest.py); arguments after the client's name go to pytest (-k NAME, ...).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
client=${2:-triton}
venv=$("$here/../../tools/oip-env.sh" "$([ "$client" = http ] && echo triton || echo "$client")")
script=oip_test.py
[ "$client" = kserve ] && script=oip_kserve_test.py
[ "$client" = http ] && script=oip_http_test.py
exec "$venv/bin/python" -m pytest "$here/$script" -q --attnserve "$1" "${@:3}"
