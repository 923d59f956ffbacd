#!/usr/bin/env bash
# make mutants: mutation testing of the gateway and the harness's delivery core with
# cargo-mutants (https://mutants.rs), every mutant judged by nextest's `mutants` profile
# (.config/nextest.toml). Writes evidence/mutants/result.json (format: evidence/README.md).
#
#   SHARD=k/n     run only shard k (0-based) of n, round-robin over the mutant list; run the
#                 other shards elsewhere and merge their mutants.out with MERGE (below)
#   IN_DIFF=REV   only mutants in code changed since git revision REV (a change under review)
#   FILES='g …'   the --file globs to mutate (default: the files of issue 18, below)
#   ALL=1         every file: gateway/src/*.rs, the delivery core and the checker
#   MERGE='d …'   also read these mutants.out directories (shards run elsewhere)
#   OUT=path      where the evidence goes (default evidence/mutants/result.json)
#
# cargo-mutants tests a copy of the tree (sources only; it builds its own target/ there),
# taken when it starts: edit the tree during a run and the report, which reads the
# equivalent list and the source lines of the tree as it is then, may disagree with it.
#
# Exit status: 0 PASS, 1 FAIL (a missed mutant outside mutants/equivalent.txt, or a kill
# rate below 0.9), 2 when a step could not run.
set -euo pipefail
cd "$(dirname "$0")/.."
CARGO=${CARGO:-cargo}
TARGET=${TARGET:-target}
VERSION=27.1.0
OUT=${OUT:-evidence/mutants/result.json}
FOCUS="gateway/src/store.rs gateway/src/fanout.rs gateway/src/sweep.rs gateway/src/changes.rs
gateway/src/hub.rs gateway/src/conn.rs gateway/src/server.rs gateway/src/limits.rs
harness/src/client/delivery.rs"
EVERYTHING="gateway/src/*.rs harness/src/client/delivery.rs harness/src/checker.rs"
if [ -n "${ALL:-}" ]; then FILES=${FILES:-$EVERYTHING}; else FILES=${FILES:-$FOCUS}; fi

if ! "$CARGO" mutants --version 2>/dev/null | grep -qx "cargo-mutants $VERSION"; then
  echo "mutants: installing cargo-mutants $VERSION from crates.io"
  "$CARGO" install --locked cargo-mutants --version "$VERSION" || exit 2
fi

work=$TARGET/mutants/run
rm -rf "$work"; mkdir -p "$work"
args=(--workspace)
for f in $FILES; do args+=(-f "$f"); done
if [ -n "${IN_DIFF:-}" ]; then
  git diff "$IN_DIFF" > "$work/in.diff" || exit 2
  args+=(--in-diff "$work/in.diff")
fi
# The whole list (every shard): the report marks other shards' mutants `not_run` until
# their outcomes are merged in.
"$CARGO" mutants --list --json "${args[@]}" > "$work/list.json" || exit 2
[ -n "${SHARD:-}" ] && args+=(--shard "$SHARD" --sharding round-robin)
exclude=$("$TARGET/debug/mutants" exclude --list "$work/list.json" --equivalent mutants/equivalent.txt) || exit 2
[ -n "$exclude" ] && args+=(--exclude-re "$exclude")
echo "mutants: $(grep -c '"name"' "$work/list.json" || true) mutants listed (equivalent ones will not run)"

# The unmutated tree must pass the profile first, or every mutant would count as caught.
export NEXTEST_PROFILE=mutants
echo "mutants: baseline (the mutants test profile on the unmutated tree)"
t0=$(date +%s)
"$CARGO" nextest run -p im-gateway -p harness -p scenarios --features im-gateway/faults \
  > "$work/baseline.log" 2>&1 || { echo "mutants: the baseline failed: $work/baseline.log" >&2; exit 2; }
baseline_s=$(( $(date +%s) - t0 ))
timeout=$(( baseline_s * 3 > 120 ? baseline_s * 3 : 120 ))
echo "mutants: baseline passed in ${baseline_s} s; test timeout ${timeout} s a mutant"

started=$(date -u +%Y-%m-%dT%H:%M:%SZ)
t0=$(date +%s)
status=0
"$CARGO" mutants "${args[@]}" --baseline skip --timeout "$timeout" --copy-target false \
  -o "$work" || status=$?
wall_s=$(( $(date +%s) - t0 ))
# cargo-mutants: 0 all caught, 2 missed, 3 timeouts; anything else is a failure to run.
case $status in 0|2|3) ;; *) echo "mutants: cargo mutants exited $status" >&2; exit 2 ;; esac

outcomes=(--outcomes "$work/mutants.out")
for d in ${MERGE:-}; do outcomes+=(--outcomes "$d"); done
files=(); for f in $FILES; do files+=(--file "$f"); done
"$TARGET/debug/mutants" report --list "$work/list.json" --equivalent mutants/equivalent.txt \
  "${outcomes[@]}" --out "$OUT" "${files[@]}" ${SHARD:+--shard "$SHARD"} \
  ${IN_DIFF:+--in-diff "$IN_DIFF"} --baseline-s "$baseline_s" --wall-s "$wall_s" \
  --started-at "$started" --tool "$("$CARGO" mutants --version)"
