#!/usr/bin/env bash
# make flake RUNS=n [FILTER='nextest filter'] [PARTITION=…]: the whole suite (`make test`'s
# nextest run) n times in a row, then every test that ever failed, with how many of the n
# runs it failed in. Writes target/flake/result.json:
#   {"runs": n, "git_commit": …, "git_dirty": …, "filter": …, "wall_s": [per run],
#    "runs_failed": k, "failed": {"<binary> <test>": count, …}}
# and each run's log as target/flake/run-i.log. Exit status 0 when no run failed, 1 when
# some test failed in some run, 2 when nextest could not run at all.
set -euo pipefail
cd "$(dirname "$0")/.."
CARGO=${CARGO:-cargo}
TARGET=${TARGET:-target}
RUNS=${RUNS:-10}
FEATURES=(--features im-gateway/faults)
case $RUNS in ''|*[!0-9]*|0) echo "flake: RUNS must be a positive integer, not '$RUNS'" >&2; exit 2 ;; esac
out=$TARGET/flake
rm -rf "$out"; mkdir -p "$out"
filter=()
[ -n "${FILTER:-}" ] && filter=(-E "$FILTER")
commit=$(git rev-parse HEAD)
dirty=false
[ -n "$(git status --porcelain -- . ':(exclude)evidence')" ] && dirty=true
walls=()
runs_failed=0
: > "$out/failures.txt"
for i in $(seq 1 "$RUNS"); do
  t0=$(date +%s)
  status=0
  "$CARGO" nextest run --workspace "${FEATURES[@]}" --no-fail-fast "${filter[@]}" \
    --status-level fail --final-status-level none > "$out/run-$i.log" 2>&1 || status=$?
  walls+=("$(( $(date +%s) - t0 ))")
  # nextest prints one line per failing test: `FAIL [ 1.234s] (n/m) <binary> <test>`
  # (TIMEOUT, SIGKILL, SIGSEGV, SIGABRT, LEAK-FAIL for other ends).
  fails=$(sed -nE 's/^ *(FAIL|TIMEOUT|SIGKILL|SIGSEGV|SIGABRT|ABORT|LEAK-FAIL) +\[[^]]*\] +(\([^)]*\) +)?//p' \
    "$out/run-$i.log" | sort -u)
  if [ "$status" != 0 ] && [ -z "$fails" ]; then
    echo "flake: run $i: nextest exited $status and no test failed: it could not run ($out/run-$i.log)" >&2
    exit 2
  fi
  if [ -n "$fails" ]; then
    runs_failed=$((runs_failed + 1))
    printf '%s\n' "$fails" >> "$out/failures.txt"
  fi
  echo "flake: run $i of $RUNS: $(printf '%s\n' "$fails" | grep -c . || true) failed, ${walls[-1]} s"
done
{
  printf '{\n  "runs": %s,\n  "git_commit": "%s",\n  "git_dirty": %s,\n' "$RUNS" "$commit" "$dirty"
  printf '  "filter": "%s",\n' "${FILTER:-}"
  printf '  "wall_s": [%s],\n' "$(IFS=,; echo "${walls[*]}")"
  printf '  "runs_failed": %s,\n  "failed": {' "$runs_failed"
  sep=""
  sort "$out/failures.txt" | uniq -c | sort -rn | while read -r n name; do
    printf '%s\n    "%s": %s' "$sep" "$name" "$n"
    sep=","
  done
  printf '\n  }\n}\n'
} > "$out/result.json"
echo "flake: $runs_failed of $RUNS runs had a failing test ($out/result.json)"
if [ -s "$out/failures.txt" ]; then
  echo "flake: tests that failed, with the number of runs they failed in:"
  sort "$out/failures.txt" | uniq -c | sort -rn
  exit 1
fi
