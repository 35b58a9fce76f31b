#!/usr/bin/env bash
# Installs the English training text of `moka train`, `coordcheck`, `lr-sweep`, `lr-horizon` and
# the training tests. Idempotent: does nothing when the text is already there, so tests run
# offline afterwards.
#
# usage: fetch_data.sh [fortunes|gcide|all]      (default: fortunes)
#   fortunes  Debian's `fortunes` package (the fortune-mod cookie collection: quotations, jokes,
#             definitions, literature; ~2.5 MB in /usr/share/games/fortunes). CI and tests use it.
#   gcide     GCIDE, the GNU Collaborative International Dictionary of English (Webster's 1913
#             with additions; GPL-2+), from Debian's `dict-gcide` package, pinned below and
#             checked by sha256, turned into moka's record format by gcide_records.py: ~34 MB,
#             126k entries, in $MOKA_DATA_DIR/gcide/text (default ~/.cache/moka-data), with
#             COPYRIGHT and SOURCE beside text/. Train on it with
#             `--data ~/.cache/moka-data/gcide/text` (or MOKA_TEXT_DIR). Needs no root.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
what=${1:-fortunes}

sudo_cmd=()
[[ $(id -u) -ne 0 ]] && sudo_cmd=(sudo)

fetch_fortunes() {
  local text_dir=/usr/share/games/fortunes
  if [[ -f "$text_dir/fortunes" ]]; then
    echo "fetch_data: $text_dir already present"
    return
  fi
  "${sudo_cmd[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq fortunes >/dev/null
  test -f "$text_dir/fortunes"
  echo "fetch_data: installed $(du -sh "$text_dir" | cut -f1) of text in $text_dir"
}

gcide_version=0.48.5+nmu2
gcide_sha256=7b0af5cfde3cbdef5e9d6e78f92ec335ced7c2790f37a40f49bebc6f7347ac0f

fetch_gcide() {
  local dest=${MOKA_DATA_DIR:-$HOME/.cache/moka-data}/gcide
  if [[ -s "$dest/text/gcide" && "$(cat "$dest/SOURCE" 2>/dev/null)" == "dict-gcide $gcide_version" ]]; then
    echo "fetch_data: $dest already present"
    return
  fi
  local work
  work=$(mktemp -d)
  trap 'rm -rf "$work"' RETURN
  # apt-get download fetches the .deb as the _apt user when it can write there.
  chmod 777 "$work"
  if ! (cd "$work" && apt-get download -qq "dict-gcide=$gcide_version" 2>/dev/null); then
    "${sudo_cmd[@]}" apt-get update -qq
    (cd "$work" && apt-get download -qq "dict-gcide=$gcide_version") || {
      echo "fetch_data: Debian's dict-gcide $gcide_version cannot be downloaded (apt-cache policy dict-gcide" \
        "shows what the mirror has; update gcide_version and gcide_sha256 in $0 after checking it)" >&2
      exit 1
    }
  fi
  local deb=("$work"/dict-gcide_*.deb)
  echo "$gcide_sha256  ${deb[0]}" | sha256sum -c --quiet - || {
    echo "fetch_data: ${deb[0]} does not have the pinned sha256 $gcide_sha256" >&2
    exit 1
  }
  dpkg-deb -x "${deb[0]}" "$work/x"
  mkdir -p "$dest/text"
  python3 "$here/gcide_records.py" "$work/x/usr/share/dictd/gcide.index" "$work/x/usr/share/dictd/gcide.dict.dz" \
    "$dest/gcide.partial"
  cp "$work/x/usr/share/doc/dict-gcide/copyright" "$dest/COPYRIGHT"
  mv "$dest/gcide.partial" "$dest/text/gcide"
  echo "dict-gcide $gcide_version" >"$dest/SOURCE"
  echo "fetch_data: $(du -sh "$dest/text/gcide" | cut -f1) of GCIDE text in $dest/text"
}

case $what in
  fortunes) fetch_fortunes ;;
  gcide) fetch_gcide ;;
  all) fetch_fortunes && fetch_gcide ;;
  *) echo "usage: $0 [fortunes|gcide|all]" >&2; exit 2 ;;
esac
