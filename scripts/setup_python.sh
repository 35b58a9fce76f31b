#!/usr/bin/env bash
# Installs the Python environment of the moka package's build and tests (torch, nanobind,
# scikit-build-core, pytest, ruff; pinned in python/requirements-dev.txt) into a venv kept outside
# the clone, so that later runs on this machine reuse it: $MOKA_VENV, default ~/.cache/moka-venv.
# uv (from PyPI) does the install: ~20 s for torch's 3 GB on a fresh machine, ~2 s from its cache.
# Idempotent: a venv whose recorded requirements match the file is left as it is.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
requirements="$repo/python/requirements-dev.txt"
venv=${MOKA_VENV:-$HOME/.cache/moka-venv}
uv_version=0.13.9
stamp="$venv/moka-requirements.sha256"
want=$( (echo "uv==$uv_version"; cat "$requirements") | sha256sum | cut -d' ' -f1)
if [[ -x "$venv/bin/python" && -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  echo "setup_python: $venv is up to date"
  exit 0
fi
# Debian splits venv support and the headers an extension builds against from python3.
if command -v dpkg >/dev/null; then
  missing=()
  for p in python3-venv python3-dev; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  if ((${#missing[@]})); then
    sudo_cmd=()
    [[ $(id -u) -ne 0 ]] && sudo_cmd=(sudo)
    "${sudo_cmd[@]}" apt-get update -qq
    DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq "${missing[@]}" >/dev/null
  fi
fi
start=$SECONDS
[[ -x "$venv/bin/python" ]] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q "uv==$uv_version"
"$venv/bin/uv" pip install -q --python "$venv/bin/python" -r "$requirements"
echo "$want" >"$stamp"
echo "setup_python: installed $requirements into $venv in $((SECONDS - start)) s"
