# imfault: `make evidence` runs the scenarios and writes evidence/; `make test` runs everything.
CARGO    ?= cargo
# The harness runs target/debug/im-gateway, which must carry the fault points.
FEATURES := --features im-gateway/faults

.PHONY: setup build test evidence controls lint repro bench bench-quick clean

setup:
	@./scripts/setup.sh

build: setup
	$(CARGO) build --workspace --bins $(FEATURES)

lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets $(FEATURES) -- -D warnings
	$(CARGO) clippy -p im-gateway --all-targets -- -D warnings

test: build lint
	@echo "gateway unit tests without the faults feature (IM_FAULT must be refused):"
	$(CARGO) nextest run -p im-gateway --lib
	$(CARGO) nextest run --workspace $(FEATURES) --no-fail-fast

evidence: build
	./target/debug/evidence

# make controls: the negative controls. Builds the gateway with its deliberate bugs
# (--features faults,bugs) as target/debug/im-gateway-bugs, rebuilds the clean binary, then
# runs the suite against the clean gateway and each bug (RUNS=10 runs each) and writes
# evidence/controls/result.json (format: evidence/README.md).
RUNS ?= 10
controls: build
	$(CARGO) build -p im-gateway --bin im-gateway --features faults,bugs
	cp target/debug/im-gateway target/debug/im-gateway-bugs
	$(CARGO) build -p im-gateway --bin im-gateway $(FEATURES)
	touch target/debug/im-gateway
	./target/debug/controls --runs $(RUNS) $(if $(ONLY),--only $(ONLY))

# make repro FAULT='send.before_commit:halt'
repro: build
	./target/debug/repro '$(FAULT)'

# make bench: a load generator (bench/, imfault-bench) against the RELEASE gateway without
# fault points (send path, fan-out, sweep), and the debug build with fault points from
# `make build` for the lost-push repair part only. Writes evidence/bench/result.json
# (format: evidence/README.md). Exit status 1 when an acknowledged message was lost.
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
