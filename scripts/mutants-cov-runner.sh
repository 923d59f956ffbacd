#!/usr/bin/env bash
# nextest's target runner for the per-test coverage run of `make mutants`
# (scripts/mutants-coverage.sh sets CARGO_TARGET_<triple>_RUNNER to this file): nextest runs
# every test as `RUNNER <test binary> --exact <name> --nocapture`, so this sees which test a
# process is and points LLVM_PROFILE_FILE at a directory of that test's own. The harness
# hands the variable on to every gateway the test starts (harness::util::inherit_allowed),
# so the gateway's lines count for the test that ran it. `%c` is LLVM's continuous mode:
# counters live in the mapped file, so a gateway killed with SIGKILL (every gateway is, on
# drop) or ended by `_exit` (a `halt` fault) still leaves its profile.
set -eu
bin=$1
shift
name='' prev=''
for a in "$@"; do
  [ "$prev" = --exact ] && name=$a
  prev=$a
done
if [ -n "$name" ]; then
  dir=$IMF_COV_RAW/$(basename "$bin")/$(printf '%s' "$name" | tr '/' '%')
else
  dir=$IMF_COV_RAW/.list # listing the tests (`--list`): not a test
fi
mkdir -p "$dir"
export LLVM_PROFILE_FILE="$dir/%p-%m%c.profraw"
exec "$bin" "$@"
