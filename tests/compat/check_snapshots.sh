#!/usr/bin/env bash
# Checks that every snapshot of old ABI headers (tests/compat/abi_*/, made by snapshot.sh)
# is still byte for byte the abi/include/ of the commit in its COMMIT file: the same files,
# the same bytes. Needs the checkout's git history; without it (no git, not a repository,
# or a shallow clone that lacks the commit) it says so and exits 77, which the test
# registers as "skipped". Usage: tests/compat/check_snapshots.sh [SOURCE_DIR]
set -uo pipefail
src=${1:-$(dirname "$0")/../..}
cd "$src" || exit 1
compat=tests/compat
skip() {
  echo "SKIPPED: $*; the snapshots in $compat cannot be compared with their commits here"
  exit 77
}
command -v git >/dev/null || skip "git is not installed"
git rev-parse --is-inside-work-tree >/dev/null 2>&1 || skip "$PWD is not a git checkout"

shopt -s nullglob
snapshots=("$compat"/abi_*/COMMIT)
if [[ ${#snapshots[@]} -eq 0 ]]; then
  echo "FAIL: no snapshots (no $compat/abi_*/COMMIT)"
  exit 1
fi
failed=0
for commit_file in "${snapshots[@]}"; do
  dir=$(dirname "$commit_file")
  bad=0
  commit=$(tr -d '[:space:]' <"$commit_file")
  if [[ ! $commit =~ ^[0-9a-f]{40}$ ]]; then
    echo "FAIL: $commit_file does not hold a full commit hash: '$commit'"
    failed=1
    continue
  fi
  if ! git cat-file -e "$commit^{commit}" 2>/dev/null; then
    shallow=$(git rev-parse --is-shallow-repository 2>/dev/null)
    [[ $shallow == true ]] && skip "the history is shallow and lacks commit $commit ($dir)"
    echo "FAIL: $dir names commit $commit, which this repository does not have"
    failed=1
    continue
  fi
  mapfile -t want < <(git ls-tree -r --name-only "$commit" -- abi/include/ |
    sed 's|^abi/include/||' | sort)
  mapfile -t have < <(cd "$dir/include" 2>/dev/null && find . -type f | sed 's|^\./||' | sort)
  if [[ "${want[*]}" != "${have[*]}" ]]; then
    echo "FAIL: $dir/include holds [${have[*]}] but $commit has [${want[*]}] under abi/include/"
    failed=1
    continue
  fi
  for f in "${want[@]}"; do
    if ! git show "$commit:abi/include/$f" | cmp -s - "$dir/include/$f"; then
      echo "FAIL: $dir/include/$f differs from abi/include/$f at $commit" \
        "(rerun tests/compat/snapshot.sh $commit $dir, or fix the commit in $commit_file)"
      bad=1
    fi
  done
  if [[ $bad -eq 0 ]]; then
    echo "ok: $dir matches $commit (${#want[@]} headers)"
  else
    failed=1
  fi
done
exit $failed
