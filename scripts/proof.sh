#!/usr/bin/env bash
# make proof: the whole proof at one commit (issue 41). On a committed tree (it refuses a
# dirty one: evidence from it would name a commit that does not hold its code), in order:
#
#   build       make build, the controls' bugs build, the release bench build
#   suite       the whole suite of `make test` (the gateway's unit tests without the fault
#               points, then the workspace with them), the im-06 checks' records kept
#   im-06       evidence/im-06/result.json from those records (nothing run again)
#   controls    make controls (targeted: each bug against its recorded catchers)
#   mutants     make mutants ALL=1 IN_DIFF=<the last whole mutation run's commit>, when there
#               is one on record (evidence/mutants/result.json with no shard and no in_diff);
#               NOT_RUN with the reason otherwise
#   nemesis-1   make nemesis SEEDS=$NEMESIS_SEEDS GATEWAYS=1
#   nemesis-3   make nemesis SEEDS=$NEMESIS_SEEDS GATEWAYS=3
#   durability  make durability (and, once every part ran, the README's durability table
#               written again from it: commit it with the evidence)
#   bench       make bench
#   site        make report, and no page STALE but the proof's own (written after it)
#
# Each part's seconds and verdict (PASS, FAIL, NOT_RUN with its reason) and the total go to
# evidence/proof/result.json; each part's output to target/proof/<part>.log. A failing part
# does not stop the later ones (each is evidence of its own), but the exit status is 1 when
# any part failed, 0 when none did. PARTS='suite controls' runs only those (the result then
# says which were skipped, and the site is judged on what is committed).
set -uo pipefail
cd "$(dirname "$0")/.."
CARGO=${CARGO:-cargo}
TARGET=${TARGET:-target}
NEMESIS_SEEDS=${PROOF_NEMESIS_SEEDS:-100}
NEMESIS_JOBS=${PROOF_NEMESIS_JOBS:-7}
ALL_PARTS="build suite im-06 controls mutants nemesis-1 nemesis-3 durability bench site"
PARTS=${PARTS:-$ALL_PARTS}
for p in $PARTS; do
  case " $ALL_PARTS " in *" $p "*) ;; *) echo "proof: unknown part '$p' (parts: $ALL_PARTS)" >&2; exit 2 ;; esac
done

if [ -n "$(git status --porcelain -- . ':(exclude)evidence')" ]; then
  echo "proof: the tree differs from HEAD (git status, evidence/ aside): commit first;" >&2
  echo "       evidence must name a commit that holds the code it ran" >&2
  git status --short -- . ':(exclude)evidence' | head -20 >&2
  exit 2
fi
commit=$(git rev-parse HEAD)
logs=$TARGET/proof
rm -rf "$logs"; mkdir -p "$logs"
records=$(pwd)/$logs/records
t_all=$(date +%s)
rows=()
failed=0

# part NAME COMMAND…: runs it, logs it, records its seconds and verdict.
part() {
  local name=$1; shift
  if [[ " $PARTS " != *" $name "* ]]; then
    rows+=("{\"part\": \"$name\", \"verdict\": \"NOT_RUN\", \"seconds\": 0, \"reason\": \"not in PARTS\"}")
    return
  fi
  echo "proof: $name ($(date -u +%H:%M:%S))"
  local t0 status
  t0=$(date +%s)
  "$@" > "$logs/$name.log" 2>&1
  status=$?
  local s=$(( $(date +%s) - t0 ))
  local verdict=PASS
  if [ "$status" != 0 ]; then verdict=FAIL; failed=1; fi
  echo "proof: $name: $verdict in $s s ($logs/$name.log)"
  rows+=("{\"part\": \"$name\", \"verdict\": \"$verdict\", \"seconds\": $s, \"exit_status\": $status, \"log\": \"$logs/$name.log\"}")
}

# not_run NAME REASON
not_run() {
  echo "proof: $1: NOT_RUN: $2"
  rows+=("{\"part\": \"$1\", \"verdict\": \"NOT_RUN\", \"seconds\": 0, \"reason\": \"$2\"}")
}

build() {
  # The bugs' binary, then the clean one back; --workspace resolves features as `make
  # build` does, so only im-gateway recompiles (not tokio, sqlx and 21 more).
  make build &&
    "$CARGO" build --workspace --bin im-gateway --features im-gateway/faults,im-gateway/bugs &&
    cp "$TARGET/debug/im-gateway" "$TARGET/debug/im-gateway-bugs" &&
    "$CARGO" build --workspace --bin im-gateway --features im-gateway/faults &&
    touch "$TARGET/debug/im-gateway" &&
    "$CARGO" build --release -p im-gateway -p imfault-bench
}

suite() {
  rm -rf "$records"; mkdir -p "$records"
  "$CARGO" nextest run -p im-gateway --lib &&
    IMFAULT_EVIDENCE_DIR=$records "$CARGO" nextest run --workspace --features im-gateway/faults --no-fail-fast
}

# The last whole mutation run on record: every file, no shard, no in-diff.
whole_mutants_commit() {
  grep -q '"shard": null' evidence/mutants/result.json 2>/dev/null &&
    grep -q '"in_diff": null' evidence/mutants/result.json &&
    sed -n 's/^  "commit": "\([0-9a-f]*\)".*/\1/p' evidence/mutants/result.json | head -1
}

# The site, judged on every page but the proof's own: that record is the one this run
# writes last (the old one, of an earlier commit, is STALE until then). The site is made
# again once it is written, so target/report ends current.
site() {
  make report | tee "$logs/site.out" && ! grep -v '^  Proof ' "$logs/site.out" | grep -q STALE
}

part build build
part suite suite
part im-06 "$TARGET/debug/evidence" --records "$records"
part controls make controls
since=$(whole_mutants_commit || true)
if [[ " $PARTS " == *" mutants "* ]] && [ -z "$since" ]; then
  not_run mutants "no whole mutation run on record (evidence/mutants/result.json is a shard or an in-diff run): run make mutants ALL=1 once, commit it, then proof runs the mutants in the diff since it"
else
  part mutants make mutants ALL=1 IN_DIFF="$since" OUT=evidence/mutants/in-diff.json
fi
part nemesis-1 make nemesis SEEDS="$NEMESIS_SEEDS" JOBS="$NEMESIS_JOBS" GATEWAYS=1
part nemesis-3 make nemesis SEEDS="$NEMESIS_SEEDS" JOBS="$NEMESIS_JOBS" GATEWAYS=3
part durability make durability
part bench make bench
part site site

# The README's durability table is the committed matrix's (a test holds them equal):
# written again from the new one, to be committed with the evidence.
if [[ " $PARTS " == *" durability "* ]]; then
  "$TARGET/debug/durability" --table > "$logs/durability-table.md" &&
    python3 - "$logs/durability-table.md" <<'PY'
import sys
table = open(sys.argv[1]).read()
s = open("README.md").read()
head, rest = s.split("<!-- durability-table -->\n", 1)
_, tail = rest.split("<!-- /durability-table -->", 1)
open("README.md", "w").write(head + "<!-- durability-table -->\n" + table + "<!-- /durability-table -->" + tail)
PY
  echo "proof: the README's durability table rewritten from evidence/durability/result.json (commit it with the evidence)"
fi

total=$(( $(date +%s) - t_all ))
mkdir -p evidence/proof
out=evidence/proof/result.json
{
  printf '{\n  "schema_version": 1,\n  "generated_by": "make proof (scripts/proof.sh)",\n'
  printf '  "git_commit": "%s",\n  "git_dirty": false,\n' "$commit"
  printf '  "generated_at": "%s",\n  "host_cores": %s,\n' "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$(nproc)"
  printf '  "parts_run": "%s",\n' "$PARTS"
  printf '  "verdict": "%s",\n' "$([ $failed = 0 ] && echo PASS || echo FAIL)"
  printf '  "total_s": %s,\n  "parts": [\n' "$total"
  n=${#rows[@]}
  for i in "${!rows[@]}"; do
    printf '    %s%s\n' "${rows[$i]}" "$([ "$i" -lt $((n - 1)) ] && echo ,)"
  done
  printf '  ]\n}\n'
} > "$out"
if [[ " $PARTS " == *" site "* ]]; then
  make report > "$logs/site-final.out" 2>&1 || echo "proof: make report after the record failed ($logs/site-final.out)" >&2
fi
echo "proof: $( [ $failed = 0 ] && echo PASS || echo FAIL ) in $total s: $out"
exit $failed
