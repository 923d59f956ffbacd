# imfault: `make evidence` runs the scenarios and writes evidence/; `make test` runs everything.
CARGO    ?= cargo
# Where cargo puts what it builds: $CARGO_TARGET_DIR if set, else ./target.
TARGET   := $(or $(CARGO_TARGET_DIR),target)
# The harness runs target/debug/im-gateway, which must carry the fault points.
FEATURES := --features im-gateway/faults

.PHONY: setup build test test-archive test-shard test-containers shard-check evidence controls controls-join nemesis nemesis-join mutants fuzz up lint repro bench bench-quick clean report screenshots durability flake proof

setup:
	@./scripts/setup.sh

build: setup
	$(CARGO) build --workspace --bins $(FEATURES)

lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets $(FEATURES) -- -D warnings
	$(CARGO) clippy -p im-gateway --all-targets -- -D warnings
	$(CARGO) clippy -p im-gateway --all-targets --features faults,bugs -- -D warnings
	$(CARGO) clippy -p harness --all-targets --features container -- -D warnings

test: build lint
	@echo "gateway unit tests without the faults feature (IM_FAULT must be refused):"
	$(CARGO) nextest run -p im-gateway --lib
	$(CARGO) nextest run --workspace $(FEATURES) --no-fail-fast

# make test-archive: the suite's test binaries in one nextest archive
# (target/nextest/suite.tar.zst), to run its partitions on other machines of the same
# checkout path (a CI matrix) without building them there.
# make test-shard PARTITION=count:k/n [ARCHIVE=target/nextest/suite.tar.zst]: partition k of
# n (1-based, nextest's own `--partition`) of the suite `make test` runs, from the archive
# when ARCHIVE names one; its JUnit report goes to target/nextest/shard-k-of-n.xml.
# `scripts/test-join.sh FILE…` checks the shards' reports against one run: every test of
# the suite run once, and the pass and fail counts.
ARCHIVE ?=
test-archive: build
	$(CARGO) nextest archive --workspace $(FEATURES) --archive-file $(TARGET)/nextest/suite.tar.zst

test-shard: build
	NEXTEST_PROFILE=ci $(CARGO) nextest run $(if $(ARCHIVE),--archive-file $(ARCHIVE) --workspace-remap .,--workspace $(FEATURES)) --no-fail-fast --partition $(PARTITION); \
	  status=$$?; k=$$(echo '$(PARTITION)' | sed 's/.*://; s,/,-of-,'); \
	  cp $(TARGET)/nextest/ci/junit.xml $(TARGET)/nextest/shard-$$k.xml && exit $$status

# make shard-check [PARTS='suite nemesis controls mutants'] [OUT=path]: each sharded part run
# whole and as 2 shards joined by its merge command, at one commit; the joined record's
# verdicts and counts compared with the whole run's (scripts/shard-check.sh), into OUT
# (default target/shard-check/result.json). Exit 1 when a join differs from its whole run.
shard-check: build
	CARGO='$(CARGO)' TARGET='$(TARGET)' $(if $(PARTS),PARTS='$(PARTS)') $(if $(OUT),OUT='$(OUT)') ./scripts/shard-check.sh

# make flake RUNS=n [FILTER='nextest filter']: the whole suite of `make test` n times in a
# row (default 10), then every test that ever failed with the number of runs it failed in;
# target/flake/result.json and each run's log. Exit 1 when any test failed in any run.
flake: build
	CARGO='$(CARGO)' TARGET='$(TARGET)' RUNS='$(or $(RUNS),10)' FILTER='$(FILTER)' ./scripts/flake.sh

# make proof [PARTS='suite controls'] [PROOF_NEMESIS_SEEDS=100] [PROOF_NEMESIS_JOBS=7]: the whole proof at
# one commit (scripts/proof.sh: build, suite, im-06, controls, mutants since the last whole
# run, nemesis on 1 and 3 gateways, durability, bench, site), each part's seconds and verdict
# in evidence/proof/result.json. Refuses a tree with uncommitted changes outside evidence/.
proof: setup
	CARGO='$(CARGO)' TARGET='$(TARGET)' $(if $(PARTS),PARTS='$(PARTS)') ./scripts/proof.sh

# make test-containers: the crash scenarios with PostgreSQL in a container (IMFAULT_PG=container,
# testcontainers), from an image built here from Debian's packages. Installs docker.io and
# debootstrap when missing and starts dockerd; where no engine can run, SKIPPED with the reason
# (target/test-containers/result.json). Not part of `make test`: it needs root and a container
# engine, and takes a minute more the first time.
test-containers: build
	CARGO='$(CARGO)' TARGET='$(TARGET)' ./scripts/test-containers.sh

evidence: build
	$(TARGET)/debug/evidence

# make durability [DURABILITY_RUNS=3] [DURABILITY_JOBS=2] [ONLY_SETTINGS=off,on] [ONLY_TOPOLOGIES=…] [ONLY_FAULTS=…]: the
# durability-contract matrix (issue 21): synchronous_commit (off, local, remote_write, on,
# remote_apply) x topology (standalone, async-standby, sync-standby) x fault (pg-crash,
# power-cut, failover), DURABILITY_RUNS runs per cell under load, DURABILITY_JOBS runs at once; writes evidence/durability/result.json
# and prints the README's table. The only target that weakens durability on purpose.
DURABILITY_RUNS ?= 3
DURABILITY_JOBS ?= 2
durability: build
	$(TARGET)/debug/durability --runs $(DURABILITY_RUNS) --jobs $(DURABILITY_JOBS) $(if $(ONLY_SETTINGS),--settings $(ONLY_SETTINGS)) $(if $(ONLY_TOPOLOGIES),--topologies $(ONLY_TOPOLOGIES)) $(if $(ONLY_FAULTS),--faults $(ONLY_FAULTS))

# make report: the committed evidence as a static site in target/report/ (index.html and a
# page per part: checks, nemesis, controls, bench; plots as inline SVG, no script, no
# network), each part with the commit that wrote it and STALE when code changed since.
report: build
	$(TARGET)/debug/report

# make screenshots: the README's two screenshots of the site (docs/screenshots/), taken by
# headless chromium from what make report wrote.
screenshots: report
	TARGET='$(TARGET)' ./scripts/screenshots.sh

# make controls: the negative controls. Builds the gateway with its deliberate bugs
# (--features faults,bugs) as target/debug/im-gateway-bugs, rebuilds the clean binary, then
# runs each bug RUNS=10 times against just the tests that caught it in the last whole-suite
# run (recorded in evidence/controls/result.json; the whole suite only for a bug they no
# longer catch, or for every bug with WHOLE=1), those tests RUNS times against the clean
# gateway, then each bug under the nemesis (its recorded catching seed first, else seeds
# 1..NEMESIS_SEEDS, stopping at the first that catches it; 0 skips; NEMESIS_GATEWAYS=3
# gateways behind HAProxy, 1 for one), and writes evidence/controls/result.json (format:
# evidence/README.md). NEMESIS_ONLY=1 runs only the nemesis part and merges it into the
# existing file. SHARD=k/n runs every n-th bug from the k-th into
# target/controls/shard-k-of-n.json; `make controls-join SHARDS='f …'` joins the shards.
RUNS ?= 10
NEMESIS_SEEDS ?= 20
NEMESIS_GATEWAYS ?= 3
controls: build
	# --workspace: the features resolve as `make build`'s do, so only im-gateway recompiles.
	$(CARGO) build --workspace --bin im-gateway --features im-gateway/faults,im-gateway/bugs
	cp $(TARGET)/debug/im-gateway $(TARGET)/debug/im-gateway-bugs
	$(CARGO) build --workspace --bin im-gateway $(FEATURES)
	touch $(TARGET)/debug/im-gateway
	$(TARGET)/debug/controls --runs $(RUNS) --nemesis-seeds $(NEMESIS_SEEDS) --nemesis-gateways $(NEMESIS_GATEWAYS) $(if $(ONLY),--only $(ONLY)) $(if $(MERGE),--merge) $(if $(NEMESIS_ONLY),--nemesis-only) $(if $(WHOLE),--whole) $(if $(SHARD),--shard $(SHARD))

controls-join: build
	$(TARGET)/debug/controls --join $(SHARDS)

# make nemesis [SEEDS=20] [SEED=n] [DURATION=ms] [JOBS=n] [GATEWAYS=1..3] [SHARD=k/n] (SEED given on the
# command line or in the environment runs that one seed; the fuzz target's default SEED does
# not count): seeded random fault schedules over a live workload on the real gateway and
# throwaway clusters (issue 10), judged by the checker, JOBS at once (each in its own
# process, cluster and gateway); SHARD=k/n runs every n-th seed from the k-th, to spread a
# series over machines. A failing seed keeps its artefacts under target/nemesis/seed-N/ and
# is shrunk to minimal.json (a shard's summary goes to target/nemesis/shard-k-of-n-gateways-G.json,
# never evidence/: `make nemesis-join` makes the shards one). GATEWAYS=2 or 3 runs that many gateways behind HAProxy (each
# gateway fault hits one of them). Writes evidence/nemesis/result.json (GATEWAYS=1) or
# evidence/nemesis/gateways-N.json (format: evidence/README.md). `target/debug/nemesis --help` for replay (--replay FILE) and the rest.
SEEDS ?= 20
JOBS ?= 7
GATEWAYS ?= 1
nemesis: build
	$(TARGET)/debug/nemesis $(if $(filter-out file default undefined,$(origin SEED)),--seed $(SEED),--seeds $(SEEDS)) $(if $(DURATION),--duration $(DURATION)) --jobs $(JOBS) --gateways $(GATEWAYS) $(if $(SHARD),--shard $(SHARD)) --shrink --out $(TARGET)/nemesis --summary $(if $(SHARD),$(TARGET)/nemesis/shard-$(subst /,-of-,$(SHARD))-gateways-$(GATEWAYS).json,evidence/nemesis/$(NEMESIS_FILE))

# make nemesis-join SHARDS='f …' [GATEWAYS=n]: the summaries of `make nemesis SHARD=k/n` runs
# (one per k, all at one commit) joined into the summary an unsharded series writes.
NEMESIS_FILE = $(if $(filter 1,$(GATEWAYS)),result.json,gateways-$(GATEWAYS).json)
nemesis-join: build
	$(TARGET)/debug/nemesis --join $(SHARDS) --summary evidence/nemesis/$(NEMESIS_FILE)

# make mutants [SHARD=k/n] [IN_DIFF=rev] [FILES='glob …'] [ALL=1] [MERGE='dir …']: mutation
# testing of the gateway and the harness's delivery core: cargo-mutants (installed from
# crates.io when missing) generates the mutants, each runs the tests of nextest's `mutants`
# profile that a per-test coverage map says execute its lines; writes
# evidence/mutants/result.json (format: evidence/README.md). scripts/mutants.sh says more.
mutants: build
	CARGO='$(CARGO)' TARGET='$(TARGET)' ./scripts/mutants.sh

# make fuzz: the frame parser fuzzed with 10 million generated inputs (release build,
# seeded: SEED=n repeats a run), then the real gateway's connection state machine over the
# wire with 100,000 frames. `make test` runs a short pass of both.
SEED ?= 1
fuzz: build
	$(CARGO) run --release -q -p imfault-fuzz -- --seed $(SEED) --inputs 10000000
	IMFAULT_FUZZ_FRAMES=100000 IMFAULT_FUZZ_SEED=$(SEED) $(CARGO) nextest run --workspace $(FEATURES) -E 'binary(fuzz_wire)' --no-capture

# make up: a throwaway cluster and the gateway, provisioned (alice/a1, bob/b1, c1), with one
# example exchange printed; runs until Ctrl-C.
up: build
	$(TARGET)/debug/up

# make repro FAULT='send.before_commit:halt' [KEEP=1]: one send under that fault, printed as
# JSON, judged by the checker; the last line is the verdict (exit 0 held, 1 broken, 2 usage).
# The work directory is removed unless KEEP=1 (then its path is printed).
repro: build
	$(TARGET)/debug/repro $(if $(KEEP),--keep) '$(FAULT)'

# make bench: a load generator (bench/, imfault-bench) against the RELEASE gateway without
# fault points (send path, fan-out, sweep, two gateways against one), and the debug build
# with fault points from `make build` for the lost-push repair part only; under 5 minutes.
# Writes evidence/bench/result.json (format: evidence/README.md): `data_integrity` (nothing
# acknowledged lost or doubled, every lost push repaired), `targets_met` (performance
# targets, never the exit status) and the flat `metrics` the targets are among. Exit
# status 1 when data_integrity is FAIL or a part did not run; `imfault-bench --help`.
BENCH_BUILD := $(CARGO) build --release -p im-gateway -p imfault-bench

bench: build
	$(BENCH_BUILD)
	$(CARGO) run --release -q -p imfault-bench -- --mode full --out evidence/bench/result.json

# The same instrument with small sizes (under a minute), written to target/bench/quick.json
# (never the committed result). A smoke check of the instrument, not a timing assertion.
bench-quick: build
	$(BENCH_BUILD)
	$(CARGO) run --release -q -p imfault-bench -- --mode quick --out target/bench/quick.json

clean:
	$(CARGO) clean
