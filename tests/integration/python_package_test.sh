#!/usr/bin/env bash
# The attnserve Python package: its wheel's contents, then python_package_test.py in each of its
# environments (tools/python-env.sh), on fixtures made with Debian's torch.
#   tests/integration/python_package_test.sh PATH/TO/attnserve
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
tools="$here/../../tools"
fixtures=$(mktemp -d)
trap 'rm -rf "$fixtures"' EXIT
/usr/bin/python3 "$here/python_package_fixtures.py" "$fixtures"
wheel=$("$tools/python-env.sh" wheel)
/usr/bin/python3 - "$wheel" <<'PY'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
meta = zipfile.ZipFile(sys.argv[1]).read(next(n for n in names if n.endswith("METADATA"))).decode()
requires = [l for l in meta.splitlines() if l.startswith("Requires-Dist:")]
stubs = {"attnserve/v1/attention_pb2.py", "attnserve/v1/attention_pb2_grpc.py", "attnserve/service-config.json"}
hard = [r for r in requires if "extra ==" not in r]
ok = stubs <= set(names) and not any("torch" in r or "ml_dtypes" in r for r in hard)
print(("ok  " if ok else "FAIL") + " wheel: stubs and service configs present; requires only " + ", ".join(hard))
sys.exit(0 if ok else 1)
PY
for flavour in debian newest; do
  venv=$("$tools/python-env.sh" "$flavour")
  "$venv/bin/python" -m pytest "$here/python_package_test.py" -q --attnserve "$1" --package-fixtures "$fixtures"
done
