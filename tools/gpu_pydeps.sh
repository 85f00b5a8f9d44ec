#!/usr/bin/env bash
# The Python packages bench/gpu_quick.sh's decoder conformance needs beyond the device's python3
# (which has torch, numpy and grpcio): transformers, pinned in tools/torch2-env.sh's environment,
# with only the model families the check builds (llama, mistral, qwen2, qwen3; ~120 MB less), and
# what it imports. Copied from that environment into a folder (a PYTHONPATH entry) and packed as
# build-cuda/pydeps.tar.gz (~6 MB: the device tool's carry holds 64 MiB, .debs and the binaries 47):
#   tools/gpu_pydeps.sh [ARCHIVE]       # ARCHIVE defaults to build-cuda/pydeps.tar.gz
set -euo pipefail
cd "$(dirname "$0")/.."
archive=${1:-build-cuda/pydeps.tar.gz}
dest=$(mktemp -d)/pydeps
trap 'rm -rf "$(dirname "$dest")"' EXIT
venv=$(tools/torch2-env.sh)
sp=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
rm -rf "$dest"
mkdir -p "$dest"
for p in transformers huggingface_hub safetensors regex yaml _yaml packaging tqdm httpx2 httpcore2 h11 h2 hpack hyperframe anyio idna truststore typer click shellingham annotated_doc typing_inspection; do
  cp -a "$sp/$p" "$dest/"
  cp -a "$sp/$p"-*.dist-info "$dest/" 2>/dev/null || true
done
cp -a "$sp"/PyYAML-*.dist-info "$sp"/pyyaml-*.dist-info "$dest/" 2>/dev/null || true
keep="llama mistral qwen2 qwen3 auto"
for m in "$dest"/transformers/models/*/; do
  n=$(basename "$m")
  [[ " $keep " == *" $n "* ]] || rm -rf "$m"
done
find "$dest" -name __pycache__ -type d -prune -exec rm -rf {} +
tar -C "$(dirname "$dest")" -czf "$archive" pydeps
echo "$archive: $(du -sh "$dest" | cut -f1) unpacked, $(du -sh "$archive" | cut -f1) packed"
