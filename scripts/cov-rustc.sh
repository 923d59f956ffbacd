#!/usr/bin/env bash
# RUSTC_WORKSPACE_WRAPPER of the coverage build (scripts/mutants-coverage.sh): only the
# workspace's own crates are instrumented; dependencies stay plain, so the tests run
# closer to their normal speed (several check time bounds) and the profiles stay small.
# Counter relocation is what lets continuous mode (`%c`, scripts/mutants-cov-runner.sh)
# work on Linux.
exec "$@" -C instrument-coverage -C llvm-args=-runtime-counter-relocation
