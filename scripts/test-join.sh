#!/usr/bin/env bash
# scripts/test-join.sh SHARD.xml… : the JUnit reports of `make test-shard PARTITION=count:k/n`
# (every k of one n) joined and checked against the suite as one run would run it: each test
# of `cargo nextest list` (the workspace with the fault points, as `make test`) run in exactly
# one shard, and the pass and fail counts of the join. Prints the joined counts; exit 0 when
# every test ran once and passed, 1 when some failed, 2 when the shards do not cover the
# suite once.
set -euo pipefail
cd "$(dirname "$0")/.."
CARGO=${CARGO:-cargo}
[ $# -ge 1 ] || { echo "usage: $0 SHARD.xml…" >&2; exit 2; }
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
# Each <testcase name=… classname=…>: "classname name", and whether it holds a <failure>/<error>.
for f in "$@"; do
  sed -n 's/.*<testcase name="\([^"]*\)" classname="\([^"]*\)".*/\2 \1/p' "$f"
done | sort > "$tmp/ran"
fails=0
for f in "$@"; do
  n=$(grep -cE '<(failure|error)' "$f" || true)
  fails=$((fails + n))
done
"$CARGO" nextest list --workspace --features im-gateway/faults --message-format json 2>/dev/null |
  python3 -c '
import json, sys
d = json.load(sys.stdin)
for bid, s in d["rust-suites"].items():
    for name, case in s["testcases"].items():
        if case.get("filter-match", {}).get("status") == "matches":
            print(bid, name)
' | sort > "$tmp/suite"
ran=$(wc -l < "$tmp/ran"); suite=$(wc -l < "$tmp/suite"); unique=$(sort -u "$tmp/ran" | wc -l)
echo "test-join: $# shard(s): $ran test runs, $unique distinct; the suite has $suite; $fails failed"
if [ "$ran" != "$unique" ]; then echo "test-join: some test ran in two shards:" >&2; uniq -d "$tmp/ran" >&2; exit 2; fi
if ! diff -q "$tmp/ran" "$tmp/suite" >/dev/null; then
  echo "test-join: the shards do not cover the suite once (< ran only, > in the suite only):" >&2
  diff "$tmp/ran" "$tmp/suite" | head -20 >&2
  exit 2
fi
[ "$fails" = 0 ]
