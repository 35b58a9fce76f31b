#!/usr/bin/env bash
# Installs the English training text of `moka train`, `moka coordcheck`, `moka lr-sweep` and the
# training tests: Debian's `fortunes` package (the fortune-mod cookie collection: quotations,
# jokes, definitions, literature; ~2.5 MB of plain text in /usr/share/games/fortunes).
# Idempotent: does nothing when the files are already there, so tests run offline afterwards.
set -euo pipefail
text_dir=/usr/share/games/fortunes
if [[ -f "$text_dir/fortunes" ]]; then
  echo "fetch_data: $text_dir already present"
  exit 0
fi
sudo_cmd=()
[[ $(id -u) -ne 0 ]] && sudo_cmd=(sudo)
"${sudo_cmd[@]}" apt-get update -qq
DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq fortunes >/dev/null
test -f "$text_dir/fortunes"
echo "fetch_data: installed $(du -sh "$text_dir" | cut -f1) of text in $text_dir"
