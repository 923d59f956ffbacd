#!/bin/sh
# `make test-containers`: the crash scenarios on the container backend (IMFAULT_PG=container).
# Sets up what is missing (scripts/containers.sh: docker.io, dockerd, the image built from
# Debian's packages), runs the im-06 crash checks that need no machine-local server (not the
# power cut: LazyFS; not the failovers: standbys) plus the backend's own test, and writes
# $TARGET/test-containers/result.json. No engine here: status SKIPPED with the reason, exit 0,
# said on the terminal; never silent.
set -u
CARGO=${CARGO:-cargo}
TARGET=${TARGET:-target}
OUT="$TARGET/test-containers"
IMAGE=${IMFAULT_PG_IMAGE:-imfault/postgres:15}
FILTER='(binary(im06) & !test(/power_loss|failover/)) | (package(harness) & test(container))'
mkdir -p "$OUT"
started=$(date -u +%Y-%m-%dT%H:%M:%SZ)
t0=$(date +%s)

json_str() { printf '%s' "$1" | sed -e 's/\\/\\\\/g' -e 's/"/\\"/g' | tr '\n' ' '; }
write() { # status reason nextest_exit
    cat >"$OUT/result.json" <<JSON
{
  "status": "$1",
  "reason": "$(json_str "$2")",
  "backend": "container",
  "image": "$(json_str "$IMAGE")",
  "engine": "$(json_str "$(docker version --format '{{.Server.Version}} (API {{.Server.APIVersion}})' 2>/dev/null || echo none)")",
  "filter": "$(json_str "$FILTER")",
  "started_at": "$started",
  "duration_s": $(($(date +%s) - t0)),
  "nextest_exit": $3
}
JSON
    echo "test-containers: $1${2:+: $2} ($OUT/result.json)"
}

scripts/containers.sh setup 2>"$OUT/setup.log"
rc=$?
cat "$OUT/setup.log" >&2
if [ "$rc" = 3 ]; then
    write SKIPPED "$(tail -1 "$OUT/setup.log" | sed 's/^containers: SKIP: //')" null
    exit 0
elif [ "$rc" != 0 ]; then
    write FAIL "scripts/containers.sh setup exited $rc" null
    exit "$rc"
fi
IMFAULT_PG=container IMFAULT_PG_IMAGE="$IMAGE" $CARGO nextest run --workspace \
    --features im-gateway/faults,harness/container --no-fail-fast -E "$FILTER"
rc=$?
if [ "$rc" = 0 ]; then write PASS "" 0; else write FAIL "nextest exited $rc" "$rc"; fi
exit "$rc"
