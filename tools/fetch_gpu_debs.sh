#!/usr/bin/env bash
# Downloads, on this Debian 12 machine, the bookworm amd64 .deb files that bench/gpu_check.sh unpacks
# on a GPU machine that has Python torch, CMake and nvcc but no apt and no network: gRPC, protobuf
# (with protoc and both gRPC plugins), prometheus-cpp, CLI11, nlohmann-json, Google Benchmark, oneDNN and
# their library closure, minus the C/C++ runtime the GPU machine already has (newer there).
# usage: tools/fetch_gpu_debs.sh [DIR=.debs]
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.debs}
want=(libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler prometheus-cpp-dev
      libcli11-dev nlohmann-json3-dev grpc-proto libbenchmark-dev libssl-dev zlib1g-dev libdnnl-dev
      ocl-icd-opencl-dev)
# Present (and newer) on the GPU machine: unpacking bookworm's copies there could shadow them.
skip='^(libc6|libc6-dev|libc-dev-bin|libgcc-s1|libstdc\+\+6|libstdc\+\+-12-dev|libgcc-12-dev|gcc-12-base|linux-libc-dev|libcrypt1|libcrypt-dev|libnsl2|libnsl-dev|libtirpc.*|rpcsvc-proto|debconf|dpkg|perl.*|tar|.*:i386)$'
[ -f /var/lib/apt/lists/lock ] || apt-get update -q
mapfile -t pkgs < <(apt-cache depends --recurse --no-recommends --no-suggests --no-conflicts \
  --no-breaks --no-replaces --no-enhances "${want[@]}" | grep -E '^[a-z0-9]' | sort -u | grep -vE "$skip")
mkdir -p "$dir"
(cd "$dir" && apt-get download "${pkgs[@]}" >/dev/null)
echo "fetch_gpu_debs: ${#pkgs[@]} packages, $(du -sh "$dir" | cut -f1) in $dir"
