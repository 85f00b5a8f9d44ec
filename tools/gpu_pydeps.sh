#!/usr/bin/env bash
# The Python packages bench/gpu_quick.sh's decoder conformance needs beyond the device's python3
# (which has torch, numpy and grpcio): transformers, pinned in tools/torch2-env.sh's environment,
# with only the model families the check builds (llama, mistral, qwen2, qwen3; ~120 MB less), and
# what it imports. Copied from that environment into a folder (a PYTHONPATH entry) and packed as
# build-cuda/pydeps.tar.gz (~8 MB: the device tool's carry holds 64 MiB, .debs and the binaries 47):
#   tools/gpu_pydeps.sh [ARCHIVE]       # ARCHIVE defaults to build-cuda/pydeps.tar.gz
set -euo pipefail
cd "$(dirname "$0")/.."
archive=${1:-build-cuda/pydeps.tar.gz}
dest=$(mktemp -d)/pydeps
trap 'rm -rf "$(dirname "$dest")"' EXIT
venv=$(tools/torch2-env.sh)
sp=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
mkdir "$dest"
for p in transformers huggingface_hub safetensors regex yaml _yaml packaging tqdm httpx2 httpcore2 h11 h2 hpack hyperframe anyio idna truststore typer click shellingham annotated_doc typing_inspection; do
  cp -a "$sp/$p" "$dest/"
  cp -a "$sp/$p"-*.dist-info "$dest/" 2>/dev/null || true
done
cp -a "$sp"/PyYAML-*.dist-info "$sp"/pyyaml-*.dist-info "$dest/" 2>/dev/null || true
# regex's one compiled module is built for one Python (3.11 here); the device's python3 may be
# another. Its wheels for the others (the same release, from PyPI) give their modules, which sit
# side by side in regex/ (each Python loads the one named for its own ABI).
regex=$(sed -n 's/^Version: //p' "$sp"/regex-*.dist-info/METADATA)
for v in 3.10 3.12 3.13 3.14; do
  "$venv/bin/pip" download -q --no-deps --only-binary=:all: --python-version "$v" \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
    -d "$(dirname "$dest")/wheels" "regex==$regex" 2>/dev/null || echo "gpu_pydeps: no regex $regex wheel for Python $v"
done
"$venv/bin/python" - "$(dirname "$dest")/wheels" "$dest/regex" <<'PY'
import glob, os, sys, zipfile
for wheel in glob.glob(os.path.join(sys.argv[1], "regex-*.whl")):
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            if name.startswith("regex/_regex.") and name.endswith(".so"):
                with open(os.path.join(sys.argv[2], os.path.basename(name)), "wb") as f:
                    f.write(z.read(name))
PY
keep="llama mistral qwen2 qwen3 auto"
for m in "$dest"/transformers/models/*/; do
  n=$(basename "$m")
  [[ " $keep " == *" $n "* ]] || rm -rf "$m"
done
find "$dest" -name __pycache__ -type d -prune -exec rm -rf {} +
tar -C "$(dirname "$dest")" -czf "$archive" pydeps
echo "$archive: $(du -sh "$dest" | cut -f1) unpacked, $(du -sh "$archive" | cut -f1) packed"
