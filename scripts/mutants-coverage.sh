#!/usr/bin/env bash
# The per-test coverage map of `make mutants` (scripts/mutants.sh runs this when the map is
# missing or was taken of another tree): which tests of nextest's `mutants` profile execute
# each line of the workspace's own code, the gateway's lines included although the gateway
# runs as a child process of the tests.
#
#   1. builds the workspace's crates with `-C instrument-coverage` (scripts/cov-rustc.sh;
#      dependencies are not instrumented) into their own target dir, $COV/target, so the
#      normal build is not disturbed;
#   2. runs the `mutants` profile there (every test, not fail-fast) with
#      scripts/mutants-cov-runner.sh as target runner: each test's processes, the gateways
#      it starts included, write their profiles under $COV/raw/<test binary>/<test>/;
#   3. per test: `llvm-profdata merge`, then `llvm-cov export -format=lcov` over the
#      gateway binary and the test's own binary, to $COV/lcov/;
#   4. `target/debug/mutants coverage-map` folds them into $COV/map.json (line -> tests).
#
# A test that fails here stops everything (exit 2): a map with a failing test would send
# mutants to a test that fails anyway. Env: COV (default target/mutants/cov), KEY (recorded
# in the map: scripts/mutants.sh passes a digest of the sources), CARGO.
set -euo pipefail
cd "$(dirname "$0")/.."
CARGO=${CARGO:-cargo}
COV=${COV:-target/mutants/cov}
COV=$(mkdir -p "$COV" && cd "$COV" && pwd)
sysroot=$(rustc --print sysroot)
tools=$(ls -d "$sysroot"/lib/rustlib/*/bin | head -1)
if [ ! -x "$tools/llvm-cov" ]; then
  echo "mutants-coverage: installing rustup's llvm-tools (llvm-profdata, llvm-cov)"
  rustup component add llvm-tools || exit 2
fi
triple=$(rustc -vV | sed -n 's/^host: //p')
runner_var=CARGO_TARGET_$(echo "$triple" | tr 'a-z-' 'A-Z_')_RUNNER
rm -rf "$COV/raw" "$COV/lcov"; mkdir -p "$COV/raw" "$COV/lcov" "$COV/build"

export CARGO_TARGET_DIR=$COV/target
export RUSTC_WORKSPACE_WRAPPER=$PWD/scripts/cov-rustc.sh
export LLVM_PROFILE_FILE=$COV/build/%p-%m.profraw # build scripts are instrumented too
pkgs=(-p im-gateway -p im-check -p harness -p scenarios --features im-gateway/faults)
t0=$(date +%s)
echo "mutants-coverage: building instrumented ($CARGO_TARGET_DIR)"
# Listing builds every test binary, and the gateway binary with them (cargo builds it for
# the gateway's integration tests).
"$CARGO" nextest list "${pkgs[@]}" --profile mutants --message-format json \
  > "$COV/tests.json" 2> "$COV/build.log" || { cat "$COV/build.log" >&2; exit 2; }
build_s=$(( $(date +%s) - t0 ))

echo "mutants-coverage: running every test of the mutants profile, instrumented"
t0=$(date +%s)
IMF_COV_RAW=$COV/raw env "$runner_var=$PWD/scripts/mutants-cov-runner.sh" \
  "$CARGO" nextest run "${pkgs[@]}" --profile mutants --no-fail-fast --test-threads 2 \
  > "$COV/run.log" 2>&1 || { echo "mutants-coverage: a test failed: $COV/run.log" >&2; exit 2; }
run_s=$(( $(date +%s) - t0 ))

echo "mutants-coverage: exporting each test's lines"
t0=$(date +%s)
gateway=$CARGO_TARGET_DIR/debug/im-gateway
export tools gateway COV CARGO_TARGET_DIR
find "$COV/raw" -mindepth 2 -maxdepth 2 -type d ! -path '*/.list*' -print0 |
  xargs -0 -P 2 -I{} bash -c '
    d=$1; bin=$(basename "$(dirname "$d")"); test=$(basename "$d")
    shopt -s nullglob; raws=("$d"/*.profraw)
    [ ${#raws[@]} -gt 0 ] || exit 0
    out=$COV/lcov/$bin/$test.lcov; mkdir -p "$(dirname "$out")"
    "$tools/llvm-profdata" merge -sparse "${raws[@]}" -o "$d/merged.profdata" &&
    "$tools/llvm-cov" export -format=lcov -skip-functions -instr-profile "$d/merged.profdata" \
      "$CARGO_TARGET_DIR/debug/deps/$bin" -object "$gateway" \
      -ignore-filename-regex="/(\.cargo|rustc|\.rustup)/" > "$out"' _ {} || exit 2
export_s=$(( $(date +%s) - t0 ))
LLVM_PROFILE_FILE= target/debug/mutants coverage-map --tests "$COV/tests.json" --lcov "$COV/lcov" --run-log "$COV/run.log" \
  --workspace "$PWD" --key "${KEY:-}" --build-s "$build_s" --run-s "$run_s" \
  --export-s "$export_s" --out "$COV/map.json" || exit 2
rm -rf "$COV/raw"
