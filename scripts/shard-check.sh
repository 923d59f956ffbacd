#!/usr/bin/env bash
# make shard-check [OUT=path]: issue 41's "beyond one machine", proven on this one. Each
# sharded part runs once whole and once as 2 shards joined by its own merge command, at
# one commit, and the joined record's verdicts and counts are compared with the whole run's:
#   suite     `make test-shard PARTITION=count:1/1` (the whole suite) against count:1/2 and
#             count:2/2, joined by scripts/test-join.sh; compared: every test's outcome
#   nemesis   NEM_SEEDS seeds (default 8) on one gateway, whole against --shard 0/2 and
#             1/2 joined by `nemesis --join`; compared: the verdict, the run/pass/fail/error
#             counts, each seed's verdict and anomalies
#   controls  CTL_ONLY bugs (default no-dedup,seq-gap) CTL_RUNS times (default 2), whole
#             against --shard 0/2 and 1/2 joined by `controls --join`; compared: the summary
#             counts but its wall, each bug's result, mode, runs, caught runs and nemesis result
#   mutants   MUT_FILES (default gateway/src/limits.rs), whole against SHARD=0/2 and 1/2
#             (the second merging the first's outcome directory); compared: the verdict, the
#             totals and each mutant's outcome
# PARTS='suite nemesis' runs only those. Every record goes to target/shard-check/; the
# comparison to OUT (default target/shard-check/result.json, or evidence/shards/result.json
# from `make shard-check OUT=…`): per part the whole run's and the join's figures, `equal`,
# and the differences. Exit 0 when every part's join equals its whole run, 1 when one
# differs, 2 when a run could not be made.
set -euo pipefail
cd "$(dirname "$0")/.."
CARGO=${CARGO:-cargo}
TARGET=${TARGET:-target}
OUT=${OUT:-$TARGET/shard-check/result.json}
PARTS=${PARTS:-suite nemesis controls mutants}
NEM_SEEDS=${NEM_SEEDS:-8}
CTL_ONLY=${CTL_ONLY:-no-dedup,seq-gap}
CTL_RUNS=${CTL_RUNS:-2}
MUT_FILES=${MUT_FILES:-gateway/src/limits.rs}
dir=$TARGET/shard-check
mkdir -p "$dir"
commit=$(git rev-parse HEAD)
dirty=false
[ -n "$(git status --porcelain -- . ':(exclude)evidence')" ] && dirty=true
started=$(date -u +%Y-%m-%dT%H:%M:%SZ)
: > "$dir/parts.txt"; : > "$dir/walls.txt"
secs() { echo $(( $(date +%s) - $1 )); }

suite() {
  # A shard's nextest exits non-zero when a test fails: the comparison, not this, judges.
  make -s test-shard PARTITION=count:1/1 || true
  make -s test-shard PARTITION=count:1/2 || true
  make -s test-shard PARTITION=count:2/2 || true
  for f in 1-of-1 1-of-2 2-of-2; do cp "$TARGET/nextest/shard-$f.xml" "$dir/suite-$f.xml"; done
  # test-join: 0 all passed, 1 some failed, 2 the shards do not cover the suite once.
  join=0; CARGO=$CARGO ./scripts/test-join.sh "$dir/suite-1-of-2.xml" "$dir/suite-2-of-2.xml" \
    > "$dir/suite-join.txt" 2>&1 || join=$?
  cat "$dir/suite-join.txt"
  [ "$join" = 2 ] && return 2
  echo "suite $dir/suite-1-of-1.xml $dir/suite-1-of-2.xml $dir/suite-2-of-2.xml" >> "$dir/parts.txt"
}

nemesis() {
  local n=$TARGET/debug/nemesis
  "$n" --seeds "$NEM_SEEDS" --jobs 2 --gateways 1 --out "$dir/nem-whole" \
    --summary "$dir/nemesis-whole.json" || true
  for k in 0 1; do
    "$n" --seeds "$NEM_SEEDS" --jobs 2 --gateways 1 --shard "$k/2" --out "$dir/nem-$k" \
      --summary "$dir/nemesis-$k-of-2.json" || true
  done
  "$n" --join "$dir/nemesis-0-of-2.json" "$dir/nemesis-1-of-2.json" \
    --summary "$dir/nemesis-joined.json" || true
  for f in whole joined; do [ -s "$dir/nemesis-$f.json" ] || return 2; done
  echo "nemesis $dir/nemesis-whole.json $dir/nemesis-joined.json" >> "$dir/parts.txt"
}

controls() {
  # The bugs' binary, as `make controls` builds it.
  "$CARGO" build -q --workspace --bin im-gateway --features im-gateway/faults,im-gateway/bugs
  cp "$TARGET/debug/im-gateway" "$TARGET/debug/im-gateway-bugs"
  "$CARGO" build -q --workspace --bin im-gateway --features im-gateway/faults
  touch "$TARGET/debug/im-gateway"
  local c=("$TARGET/debug/controls" --runs "$CTL_RUNS" --only "$CTL_ONLY")
  "${c[@]}" --out "$dir/controls-whole.json" || true
  for k in 0 1; do "${c[@]}" --shard "$k/2" --out "$dir/controls-$k-of-2.json" || true; done
  "$TARGET/debug/controls" --join "$dir/controls-0-of-2.json" "$dir/controls-1-of-2.json" \
    --out "$dir/controls-joined.json" || true
  for f in whole joined; do [ -s "$dir/controls-$f.json" ] || return 2; done
  echo "controls $dir/controls-whole.json $dir/controls-joined.json" >> "$dir/parts.txt"
}

mutants() {
  local m=(env CARGO="$CARGO" TARGET="$TARGET" FILES="$MUT_FILES")
  "${m[@]}" OUT="$dir/mutants-whole.json" ./scripts/mutants.sh || true
  "${m[@]}" OUT="$dir/mutants-0-of-2.json" SHARD=0/2 ./scripts/mutants.sh || true
  rm -rf "$dir/mutants-run-0"; cp -a "$TARGET/mutants/run" "$dir/mutants-run-0"
  "${m[@]}" OUT="$dir/mutants-joined.json" SHARD=1/2 MERGE="$dir/mutants-run-0" \
    ./scripts/mutants.sh || true
  for f in whole joined; do [ -s "$dir/mutants-$f.json" ] || return 2; done
  echo "mutants $dir/mutants-whole.json $dir/mutants-joined.json" >> "$dir/parts.txt"
}

make -s build
status=0
for p in $PARTS; do
  case $p in suite|nemesis|controls|mutants) ;; *) echo "shard-check: no part '$p'" >&2; exit 2 ;; esac
  t0=$(date +%s)
  echo "shard-check: $p"
  "$p" || { echo "shard-check: $p: a run could not be made" >&2; exit 2; }
  echo "$p $(secs "$t0")" >> "$dir/walls.txt"
done

mkdir -p "$(dirname "$OUT")"
python3 - "$dir" "$OUT" "$commit" "$dirty" "$started" "$NEM_SEEDS" "$CTL_ONLY" "$CTL_RUNS" "$MUT_FILES" <<'PY' || status=$?
import json, re, sys
from datetime import datetime, timezone
d, out, commit, dirty, started, nem_seeds, ctl_only, ctl_runs, mut_files = sys.argv[1:]

def junit(*files):
    """Each test's outcome: {"classname name": "pass" | "fail" | "skip"}."""
    res = {}
    for f in files:
        text = open(f).read()
        for m in re.finditer(r'<testcase name="([^"]*)" classname="([^"]*)"[^>]*?(/>|>(.*?)</testcase>)', text, re.S):
            body = m.group(4) or ""
            key = f"{m.group(2)} {m.group(1)}"
            if key in res:
                res[key] = "ran twice"
                continue
            res[key] = "fail" if re.search(r"<(failure|error)", body) else "skip" if "<skipped" in body else "pass"
    return res

def count(outcomes):
    c = {}
    for v in outcomes.values():
        c[v] = c.get(v, 0) + 1
    return c

def suite(whole, s1, s2):
    a, b = junit(whole), junit(s1, s2)
    diffs = [f"{k}: whole {a.get(k)}, joined {b.get(k)}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    return {"whole": {"tests": len(a), **count(a)}, "joined": {"tests": len(b), **count(b)}, "differences": diffs}

def nemesis(whole, joined):
    a, b = json.load(open(whole)), json.load(open(joined))
    keys = ["verdict", "runs", "pass", "fail", "error", "generator", "options", "anomalies_by_kind"]
    diffs = [f"{k}: whole {a.get(k)!r}, joined {b.get(k)!r}" for k in keys if a.get(k) != b.get(k)]
    per = lambda s: {r["seed"]: (r["verdict"], sorted(r.get("anomalies") or {})) for r in s["per_run"]}
    pa, pb = per(a), per(b)
    diffs += [f"seed {k}: whole {pa.get(k)}, joined {pb.get(k)}" for k in sorted(set(pa) | set(pb)) if pa.get(k) != pb.get(k)]
    fig = lambda s: {k: s.get(k) for k in ["verdict", "runs", "pass", "fail", "error", "wall_s", "git_commit"]} | {"shards": [x.get("shard") for x in s.get("shards") or []]}
    return {"whole": fig(a), "joined": fig(b), "differences": diffs}

def controls(whole, joined):
    a, b = json.load(open(whole)), json.load(open(joined))
    sa = {k: v for k, v in a["summary"].items() if k != "wall_ms"}
    sb = {k: v for k, v in b["summary"].items() if k != "wall_ms"}
    diffs = [f"summary.{k}: whole {sa.get(k)!r}, joined {sb.get(k)!r}" for k in sorted(set(sa) | set(sb)) if sa.get(k) != sb.get(k)]
    per = lambda r: {c["bug"]: (c["result"], c["mode"], c["runs"], c["caught_runs"], (c.get("nemesis") or {}).get("result")) for c in r["controls"]}
    pa, pb = per(a), per(b)
    diffs += [f"{k}: whole {pa.get(k)}, joined {pb.get(k)}" for k in sorted(set(pa) | set(pb)) if pa.get(k) != pb.get(k)]
    fig = lambda r: {"summary": r["summary"], "bugs": {k: dict(zip(["result", "mode", "runs", "caught_runs", "nemesis"], v)) for k, v in per(r).items()},
                     "git_commit": r["environment"].get("git_commit"), "shards": [s.get("shard") for s in r["environment"].get("shards") or []]}
    return {"whole": fig(a), "joined": fig(b), "differences": diffs}

def mutants(whole, joined):
    a, b = json.load(open(whole)), json.load(open(joined))
    diffs = [f"{k}: whole {a.get(k)!r}, joined {b.get(k)!r}" for k in ["verdict", "totals", "per_file"] if a.get(k) != b.get(k)]
    lists = ["missed", "timeout"]
    for k in lists:
        na = sorted(m.get("name", str(m)) if isinstance(m, dict) else str(m) for m in a.get(k) or [])
        nb = sorted(m.get("name", str(m)) if isinstance(m, dict) else str(m) for m in b.get(k) or [])
        if na != nb:
            diffs.append(f"{k}: whole {na}, joined {nb}")
    fig = lambda r: {k: r.get(k) for k in ["verdict", "totals", "commit", "shard"]}
    return {"whole": fig(a), "joined": fig(b), "differences": diffs}

walls = dict(l.split() for l in open(f"{d}/walls.txt"))
parts = {}
for line in open(f"{d}/parts.txt"):
    name, *files = line.split()
    r = globals()[name](*files)
    r["equal"] = not r["differences"]
    r["wall_s"] = int(walls.get(name, 0))
    parts[name] = r
doc = {
    "schema_version": 1,
    "generated_by": "make shard-check (scripts/shard-check.sh)",
    "git_commit": commit,
    "git_dirty": dirty == "true",
    "started_at": started,
    "generated_at": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    "shards": 2,
    "settings": {"nemesis_seeds": int(nem_seeds), "nemesis_gateways": 1, "controls_only": ctl_only.split(","),
                 "controls_runs": int(ctl_runs), "mutants_files": mut_files.split()},
    "verdict": "EQUAL" if parts and all(p["equal"] for p in parts.values()) else "DIFFERENT",
    "parts": parts,
}
json.dump(doc, open(out, "w"), indent=2)
open(out, "a").write("\n")
for k, p in parts.items():
    print(f"shard-check: {k}: {'equal' if p['equal'] else 'DIFFERENT'} ({p['wall_s']} s)" + "".join(f"\n  {x}" for x in p["differences"][:10]))
print(f"shard-check: {doc['verdict']}: {out}")
sys.exit(0 if doc["verdict"] == "EQUAL" else 1)
PY
exit $status
