# Sourced by the CLI checks that need a shell around moka (train_cli_checks.sh,
# result_file_checks.sh): runs the check in a scratch directory removed on exit, and defines
# fail MESSAGE (prints it and the last command's output, out.txt, and exits 1) and $small (the
# training options of a quick run on a small part of the corpus).
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
fail() {
  echo "FAIL: $*"
  cat out.txt 2>/dev/null || true
  exit 1
}
# shellcheck disable=SC2034  # used by the scripts that source this one
small="--max-bytes 50000 --threads 1"
