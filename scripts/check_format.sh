#!/usr/bin/env bash
# Checks that every C++/CUDA source under git (*.cpp, *.hpp, *.cu, *.cuh, *.h) is laid out as
# .clang-format says; exits 1 listing the files that differ. `scripts/check_format.sh --fix`
# rewrites them in place instead. .ci/run runs the check before the build (~3 s for all files).
# The layout is clang-format 14's: another major version formats some lines differently. The
# binary: $CLANG_FORMAT if set, else the venv's pinned one (python/requirements-dev.txt, installed
# by scripts/setup_python.sh), else clang-format-14 or clang-format on PATH. The version used is
# printed, with a warning when it is not 14.
set -euo pipefail
cd "$(dirname "$0")/.."
fix=0
case ${1:-} in
  --fix) fix=1 ;;
  "") ;;
  *) echo "usage: scripts/check_format.sh [--fix]" >&2; exit 2 ;;
esac
cf=${CLANG_FORMAT:-}
if [[ -z $cf ]]; then
  for c in "${MOKA_VENV:-$HOME/.cache/moka-venv}/bin/clang-format" clang-format-14 clang-format; do
    if command -v "$c" >/dev/null; then cf=$c; break; fi
  done
fi
if [[ -z $cf ]] || ! command -v "$cf" >/dev/null; then
  echo "check_format: clang-format not found: run scripts/setup_python.sh (pins clang-format 14.0.6 in" \
    "the venv), or apt-get install clang-format-14, or set CLANG_FORMAT" >&2
  exit 1
fi
version=$("$cf" --version)
echo "check_format: $version ($(command -v "$cf"))"
if [[ ! $version =~ version\ 14\. ]]; then
  echo "check_format: warning: .clang-format is tuned for clang-format 14; this one may lay out some lines" \
    "differently" >&2
fi
mapfile -d '' files < <(git ls-files -z -- '*.cpp' '*.hpp' '*.cu' '*.cuh' '*.h')
if ((${#files[@]} == 0)); then
  echo "check_format: no C++/CUDA files under git" >&2
  exit 1
fi
if ((fix)); then
  printf '%s\0' "${files[@]}" | xargs -0 -n 16 -P "$(nproc 2>/dev/null || echo 2)" "$cf" -i --style=file
  echo "check_format: formatted ${#files[@]} files with .clang-format; review and commit the changes"
  exit 0
fi
# --dry-run --Werror prints "FILE:LINE:COL: error: code should be clang-formatted" for each
# difference, followed by the source line and a caret line; anything else is a failure (an
# unreadable .clang-format, a file it cannot open). One process, so that messages do not interleave.
status=0
report=$("$cf" --dry-run --Werror --style=file "${files[@]}" 2>&1) || status=$?
bad=$(awk 'skip > 0 { skip--; next }
  /: error: code should be clang-formatted/ { sub(/:[0-9]+:[0-9]+: error: .*/, ""); print; skip = 2 }' <<<"$report" | sort -u)
other=$(awk 'skip > 0 { skip--; next }
  /: error: code should be clang-formatted/ { skip = 2; next }
  /: error: / { if (!seen[$0]++) print; skip = 2; next }
  NF && !seen[$0]++ { print }' <<<"$report")
if [[ -n $other ]] || { ((status != 0)) && [[ -z $bad ]]; }; then
  if [[ -n $other ]]; then echo "$other" >&2; fi
  echo "check_format: $cf failed (exit status $status; see above)" >&2
  exit 1
fi
if [[ -n $bad ]]; then
  echo "check_format: $(wc -l <<<"$bad") of ${#files[@]} files differ from .clang-format's layout:" >&2
  sed 's/^/  /' <<<"$bad" >&2
  echo "check_format: to fix: scripts/check_format.sh --fix (rewrites them in place), then review and commit" >&2
  exit 1
fi
echo "check_format: all ${#files[@]} C++/CUDA files match .clang-format"
