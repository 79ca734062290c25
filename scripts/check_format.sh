#!/usr/bin/env bash
# Checks that every C source and header tracked by git is formatted as the checked-in
# .clang-format says (clang-format 14, Debian 12's). Lists the files that are not, with the
# first lines that differ, and exits 1; `scripts/check_format.sh --fix` formats them in place.
set -euo pipefail
cd "$(dirname "$0")/.."
cf=$(command -v clang-format-14 || command -v clang-format || true)
if [ -z "$cf" ]; then
  echo "check_format: clang-format-14 is not installed (scripts/install-deps.sh installs it)" >&2
  exit 1
fi
mapfile -t files < <(git ls-files '*.c' '*.h' '*.inc' | grep -v '^fuzz/corpus/')
if [ "${1:-}" = "--fix" ]; then
  "$cf" -i "${files[@]}"
  exit 0
fi
bad=0
for f in "${files[@]}"; do
  if ! "$cf" "$f" | cmp -s - "$f"; then
    echo "check_format: $f is not formatted (scripts/check_format.sh --fix):"
    "$cf" "$f" | diff "$f" - | head -8 | sed 's/^/    /'
    bad=$((bad + 1))
  fi
done
if [ "$bad" -gt 0 ]; then
  echo "check_format: $bad of ${#files[@]} files need formatting" >&2
  exit 1
fi
echo "check_format: ${#files[@]} files formatted as .clang-format says"
