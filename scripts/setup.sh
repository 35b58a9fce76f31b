#!/usr/bin/env bash
# Installs what moka's build and tests need on a Debian machine (idempotent); --tests adds the
# Python test environment. The CUDA backend's CUTLASS headers are fetched by CMake into each
# build directory (scripts/fetch_cutlass.sh).
set -euo pipefail
packages=(cmake ninja-build g++ git python3 python3-pip python3-matplotlib unzip libgtest-dev libcli11-dev nlohmann-json3-dev libssl-dev)
missing=()
for p in "${packages[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if ((${#missing[@]})); then
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}"
fi
# nvcc lives outside PATH on some machines; CMake finds it through PATH or CUDACXX.
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
  echo "setup: nvcc found at /usr/local/cuda/bin (add it to PATH to build the CUDA backend)"
fi
# The English text `moka train` and the training tests use.
bash "$(dirname "$0")/fetch_data.sh"
# With --tests: the venv (outside the clone) the Python package's tests run with (torch,
# nanobind, pytest; 3 GB), which `moka bench` alone does not need.
if [[ ${1:-} == --tests ]]; then
  bash "$(dirname "$0")/setup_python.sh"
fi
