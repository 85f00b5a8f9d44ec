#!/usr/bin/env bash
# Installs attnserve's build, test and runtime dependencies from Debian's packages.
# Idempotent: when every package is already present it returns in well under a second, without apt.
set -euo pipefail

packages=(
  build-essential cmake pkg-config zlib1g-dev
  # The compiler cache every build tree shares, across clones, and the fast linker
  # (cmake/AttnserveCcache.cmake).
  ccache mold
  # Fuzzing (tools/fuzz.sh): clang with libFuzzer and its sanitizer runtimes; clang-format for the
  # layout check (tools/build.sh test, stage format).
  clang libclang-rt-14-dev clang-format
  # Function lengths for the structure check (tools/longest_functions.py, ctest function_lengths).
  universal-ctags
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  # grpc.health.v1's health.proto, compiled into the client library (Client::Health).
  grpc-proto
  libtorch-dev
  # oneDNN's headers: the engine calls the library LibTorch's CPU products run on (server/engine/onednn.h).
  # Its CMake config asks for OpenCL (Debian builds it with the OpenCL GPU runtime), which
  # libdnnl-dev only recommends.
  libdnnl-dev ocl-icd-opencl-dev
  # The fast BLAS must be named explicitly: libtorch only recommends one, and the reference BLAS
  # is ~40x slower. It must be thread-safe: the serial OpenBLAS gives wrong answers when two compute
  # threads multiply at once. docs/hardware.md "BLAS" has the measurements behind this choice.
  libopenblas0-pthread
  prometheus-cpp-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  libcli11-dev nlohmann-json3-dev
  # The Open Inference Protocol over HTTP (server/http/): libmicrohttpd serves it, simdjson reads
  # its JSON tensors (docs/benchmarks.md "HTTP library").
  libmicrohttpd-dev libsimdjson-dev libgnutls28-dev
  # Test peers: PyTorch itself (conformance), Python gRPC (client path), a real Prometheus and promtool.
  python3-torch python3-grpcio python3-grpc-tools python3-numpy
  # The Python tests' runner (tests/conftest.py).
  python3-pytest
  # HTTP/2 frames at chosen moments (RST_STREAM mid-upload, frames cut short): tests/integration/stop_test.py.
  python3-h2
  prometheus curl
  # Certificates made at test time (tests/integration/tls_test.py); the L7 gRPC proxy in front of
  # replicas (deploy/nginx, tests/integration/replicas_test.py).
  openssl nginx
  # The LibTorch 2.x flavour's virtual environment (tools/torch2-env.sh).
  python3-venv
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}\n' "$p" 2>/dev/null | grep -q '^install ok installed$' || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "install-deps: installing ${missing[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get -o DPkg::Lock::Timeout=600 update -q
  apt-get -o DPkg::Lock::Timeout=600 install -y -q --no-install-recommends "${missing[@]}"
  # Debian's nginx starts its default site on port 80 when installed; the tests run their own on
  # loopback, so the system one is stopped and not started at boot.
  if [[ " ${missing[*]} " == *" nginx "* ]]; then
    { invoke-rc.d nginx stop && update-rc.d nginx disable; } >/dev/null 2>&1 || true
  fi
fi
