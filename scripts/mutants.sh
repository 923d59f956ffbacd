#!/usr/bin/env bash
# make mutants: mutation testing of the gateway and the harness's delivery core. cargo-mutants
# (https://mutants.rs) generates the mutants; each mutant runs only the tests of nextest's
# `mutants` profile (.config/nextest.toml) that execute the lines it changes, as measured by
# a per-test coverage map. Writes evidence/mutants/result.json (format: evidence/README.md).
#
#   SHARD=k/n     run only shard k (0-based) of n, round-robin over the mutant list less the
#                 equivalent mutants; run the other shards elsewhere and merge their outcome
#                 directories with MERGE (below)
#   IN_DIFF=REV   only mutants in code changed since git revision REV (a change under review)
#   FILES='g …'   the --file globs to mutate (default: the files of issue 18, below)
#   ALL=1         every file: gateway/src/*.rs, the delivery core and the checker
#   MERGE='d …'   also read these outcome directories (shards run elsewhere: their
#                 target/mutants/run; cargo-mutants' mutants.out of older runs also reads)
#   OUT=path      where the evidence goes (default evidence/mutants/result.json)
#   NO_SCHEMATA=1 build and run every mutant alone (its diff applied), without the one
#                 schema build (step 3); slower, for comparing the two
#
# Steps:
#   1. `cargo mutants --list --json --diff`: the mutants, with their diffs.
#   2. The coverage map, target/mutants/cov/map.json (scripts/mutants-coverage.sh: an
#      instrumented build and run of every test of the profile, each test's lines, the
#      gateway's as a child process included). Taken again only when the sources differ
#      from those it was taken of (a digest of their contents, below). That run
#      is also the baseline: a test that fails on the unmutated tree stops everything, or
#      every mutant it is selected for would count as caught.
#   3. `target/debug/mutants run`: first one schema build in a scratch copy of the sources
#      with its own target dir kept warm (target/mutants/scratch): every mutant written into
#      its file behind a switch read from IMFAULT_MUTANT, every test binary built once (a
#      mutant a build error is blamed on is taken out; log/schemata.log says which). Each
#      mutant it holds runs its selected tests with IMFAULT_MUTANT naming it, nothing built.
#      The others run alone afterwards, the sources written back: per mutant,
#      the diff applied, only the test
#      binaries of the selected tests built. Either way the tests run (fail-fast, one retry) in two
#      stages: first the likeliest catchers (at most 6: the tests that caught a mutant of
#      the same function, then of the same file, then any, each quickest first), the rest
#      only when none of those failed; the file restored. A mutant those tests miss gets a second chance: the other tests that
#      reach its function, built and run the same way (line coverage can count a decision
#      on another line than the mutant's). A mutant no test reaches is built (so that
#      unviable ones are told apart) and counted `missed` with the note "no test reaches it".
#   4. `target/debug/mutants report`: the judgement and the evidence.
#
# The run tests a copy of the tree taken when it starts, and its evidence names the commit
# (and dirtiness) of that moment: edit the tree during a run and the report, which reads the
# equivalent list and the source lines of the tree as it is at the end, may disagree with it.
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
EVERYTHING="gateway/src/*.rs harness/src/client/delivery.rs check/src/*.rs check/src/history/*.rs"
if [ -n "${ALL:-}" ]; then FILES=${FILES:-$EVERYTHING}; else FILES=${FILES:-$FOCUS}; fi

if ! "$CARGO" mutants --version 2>/dev/null | grep -qx "cargo-mutants $VERSION"; then
  echo "mutants: installing cargo-mutants $VERSION from crates.io"
  "$CARGO" install --locked cargo-mutants --version "$VERSION" || exit 2
fi

# The commit the run tests and whether the tree differs from it, taken now: the scratch
# tree is copied from the tree as it is at the start, so a commit made during the run must
# not be named in its evidence.
commit=$(git rev-parse HEAD)
if [ -n "$(git status --porcelain)" ]; then dirty=true; else dirty=false; fi

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
"$CARGO" mutants --list --json --diff "${args[@]}" > "$work/list.json" || exit 2
echo "mutants: $(grep -c '"name"' "$work/list.json" || true) mutants listed (equivalent ones will not run)"

# A cold target dir for the coverage build and the scratch one: seeded from the normal
# build's (a copy, reflinked where the file system can), so the dependencies, which both
# build exactly as it does, are not compiled again.
for d in "$TARGET/mutants/cov/target" "$TARGET/mutants/scratch/target"; do
  if [ ! -d "$d/debug" ] && [ -d "$TARGET/debug" ]; then
    mkdir -p "$d"; cp -a --reflink=auto "$TARGET/debug" "$d/" || exit 2
  fi
done

cov=$TARGET/mutants/cov
# The map's key: a digest of every source file that can change what a test executes (not
# the docs, the evidence, the equivalent list or this runner's own code), and of the
# scripts that take the map (which packages' tests it holds).
key=$( { git ls-files -z -co --exclude-standard -- . ':(exclude)evidence' ':(exclude)scripts' \
  ':(exclude)*.md' ':(exclude)mutants' ':(exclude)scenarios/src/bin/mutants'
  printf '%s\0' scripts/mutants-coverage.sh scripts/cov-rustc.sh scripts/mutants-cov-runner.sh; } |
  xargs -0 -r sha256sum 2>/dev/null | sha256sum | cut -c1-16)
if [ -f "$cov/map.json" ] && [ "$(cat "$cov/key" 2>/dev/null)" = "$key" ]; then
  echo "mutants: reusing the coverage map $cov/map.json (taken of this tree)"
else
  rm -f "$cov/key"
  COV=$cov KEY=$key CARGO=$CARGO ./scripts/mutants-coverage.sh || exit 2
  echo "$key" > "$cov/key"
fi

started=$(date -u +%Y-%m-%dT%H:%M:%SZ)
status=0
"$TARGET/debug/mutants" run --list "$work/list.json" --map "$cov/map.json" \
  --equivalent mutants/equivalent.txt --scratch "$TARGET/mutants/scratch" --out "$work" \
  --cargo "$CARGO" ${SHARD:+--shard "$SHARD"} ${NO_SCHEMATA:+--no-schemata} || status=$?
case $status in 0) ;; 1) echo "mutants: some mutants could not be judged (Failure; see $work/log)" >&2 ;;
  *) echo "mutants: mutants run exited $status" >&2; exit 2 ;; esac

outcomes=(--outcomes "$work")
for d in ${MERGE:-}; do outcomes+=(--outcomes "$d"); done
files=(); for f in $FILES; do files+=(--file "$f"); done
"$TARGET/debug/mutants" report --list "$work/list.json" --equivalent mutants/equivalent.txt \
  "${outcomes[@]}" --out "$OUT" "${files[@]}" ${SHARD:+--shard "$SHARD"} \
  ${IN_DIFF:+--in-diff "$IN_DIFF"} --coverage-map "$cov/map.json" \
  --started-at "$started" --tool "$("$CARGO" mutants --version)" \
  --commit "$commit" --dirty "$dirty"
