# imfault: `make evidence` runs the scenarios and writes evidence/; `make test` runs everything.
CARGO    ?= cargo
# The harness runs target/debug/im-gateway, which must carry the fault points.
FEATURES := --features im-gateway/faults

.PHONY: setup build test evidence lint repro bench bench-quick clean

setup:
	@./scripts/setup.sh

build: setup
	$(CARGO) build --workspace --bins $(FEATURES)

lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets $(FEATURES) -- -D warnings

test: build lint
	$(CARGO) nextest run --workspace $(FEATURES) --no-fail-fast

evidence: build
	./target/debug/evidence

# make repro FAULT='send.before_commit:halt'
repro: build
	./target/debug/repro '$(FAULT)'

clean:
	$(CARGO) clean
