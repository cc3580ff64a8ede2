#!/usr/bin/env bash
# Copies the ABI headers (abi/include/**) exactly as they were at a commit into DIR/include,
# and records the commit in DIR/COMMIT, so plugins can be built against an old minor's
# headers. Usage: tests/compat/snapshot.sh COMMIT DIR   (run from anywhere in the checkout)
# check_snapshots.sh verifies later that each snapshot still matches its commit.
set -euo pipefail
if [[ $# -ne 2 ]]; then
  echo "usage: $0 COMMIT DIR" >&2
  exit 2
fi
commit=$(git rev-parse --verify --quiet "$1^{commit}") || {
  echo "$0: '$1' is not a commit in this checkout" >&2
  exit 1
}
dir=$2
mapfile -t files < <(git ls-tree -r --name-only "$commit" -- abi/include/)
if [[ ${#files[@]} -eq 0 ]]; then
  echo "$0: commit $commit has no files under abi/include/" >&2
  exit 1
fi
rm -rf "$dir/include"
for f in "${files[@]}"; do
  out="$dir/include/${f#abi/include/}"
  mkdir -p "$(dirname "$out")"
  git show "$commit:$f" >"$out"
done
echo "$commit" >"$dir/COMMIT"
echo "$dir: ${#files[@]} headers from $commit"
