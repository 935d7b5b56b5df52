#!/usr/bin/env bash
# What one device call would copy (the tool's limit: 64 MiB for the tracked files, the untracked files git does not
# ignore, and the carried paths), and a way to leave bench/results/ (the raw device outputs, ~16 MiB of the ~19 MiB
# tracked tree since session 16) out of the copy for a call that needs the room (LIBERO: .libero-slim's 48.8 MiB
# plus mujoco's wheel and .gl).
#
#   bash bench/device/carry_size.sh [PATH ...]   # the copy's size with these carried paths (e.g. .whl-lite .gl)
#   bash bench/device/carry_size.sh --hide       # bench/results/ out of the index and ignored: the copy leaves it out
#   bash bench/device/carry_size.sh --show       # back as it was (run it right after the call; never commit between)
#
# --hide only changes the index and .git/info/exclude; the files stay on disk. While hidden, `git status` shows
# bench/results/ as deleted: --show undoes that (git reset -- bench/results).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
EXCL=.git/info/exclude
NOTE='# carry_size.sh --hide (undo: bash bench/device/carry_size.sh --show)'
LINE='/bench/results/'
case "${1:-}" in
  --hide)
    git diff --cached --quiet -- bench/results || { echo "bench/results has staged changes: commit them first" >&2; exit 1; }
    git rm -r -q --cached bench/results
    grep -qxF "$LINE" "$EXCL" 2>/dev/null || printf '%s\n%s\n' "$NOTE" "$LINE" >> "$EXCL"
    echo "bench/results/ hidden from the device copy; run: bash bench/device/carry_size.sh --show after the call";;
  --show)
    if [ -f "$EXCL" ]; then grep -vxF -e "$LINE" -e "$NOTE" "$EXCL" > "$EXCL.tmp" || true; mv "$EXCL.tmp" "$EXCL"; fi
    git reset -q -- bench/results
    echo "bench/results/ tracked again";;
  *)
    files=$(git ls-files -z --cached --others --exclude-standard | xargs -0 -r du -cb 2>/dev/null | tail -1 | cut -f1)
    carried=0
    for p in "$@"; do carried=$((carried + $(du -sb "$p" | cut -f1))); done
    total=$((files + carried))
    awk -v f="$files" -v c="$carried" -v t="$total" 'BEGIN {
      printf "tree %.1f MiB + carried %.1f MiB = %.1f MiB of 64 (%s)\n", f/2^20, c/2^20, t/2^20,
             (t <= 64*2^20 ? "fits" : "too large") }';;
esac
