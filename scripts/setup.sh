#!/usr/bin/env bash
# One-time machine set-up for `make test` / `make evidence`: PostgreSQL server programs
# (initdb, postgres) and cargo-nextest. Idempotent; prints what it does.
set -euo pipefail

pg_bin=""
for d in /usr/lib/postgresql/*/bin; do
  [ -x "$d/initdb" ] && [ -x "$d/postgres" ] && pg_bin="$d"
done
if [ -z "$pg_bin" ] && ! command -v initdb >/dev/null 2>&1; then
  if [ "$(id -u)" != 0 ]; then
    echo "setup: PostgreSQL server programs are missing; install them (Debian: apt-get install -y postgresql)" >&2
    exit 1
  fi
  echo "setup: installing PostgreSQL server programs (apt-get install -y postgresql)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  # policy-rc.d keeps the package from starting a system cluster we do not use
  printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; chmod +x /usr/sbin/policy-rc.d
  apt-get install -y -qq postgresql >/dev/null
  rm -f /usr/sbin/policy-rc.d
fi
# pg_auto_failover (check 06-failover-pg-auto-failover): pg_autoctl and the monitor's
# extension, for the major the harness runs (the newest /usr/lib/postgresql/*/bin).
# Without them that check records NOT_RUN with the reason; it never passes silently.
pg_bin=""
for d in /usr/lib/postgresql/*/bin; do
  [ -x "$d/initdb" ] && [ -x "$d/postgres" ] && pg_bin="$d"
done
if [ -n "$pg_bin" ]; then
  pg_major="$(basename "$(dirname "$pg_bin")")"
  paf_control="$("$pg_bin/pg_config" --sharedir)/extension/pgautofailover.control"
  if { ! command -v pg_autoctl >/dev/null 2>&1 && [ ! -x "$pg_bin/pg_autoctl" ]; } \
     || [ ! -f "$paf_control" ]; then
    if [ "$(id -u)" = 0 ]; then
      echo "setup: installing pg_auto_failover (apt-get install -y postgresql-$pg_major-auto-failover)"
      export DEBIAN_FRONTEND=noninteractive
      apt-get update -qq
      apt-get install -y -qq "postgresql-$pg_major-auto-failover" >/dev/null
    else
      echo "setup: pg_auto_failover is missing (Debian: apt-get install -y postgresql-$pg_major-auto-failover); 06-failover-pg-auto-failover will be NOT_RUN" >&2
    fi
  fi
fi
if [ "$(id -u)" = 0 ] && ! id postgres >/dev/null 2>&1; then
  echo "setup: creating the postgres system user (PostgreSQL refuses to run as root)"
  useradd --system --home-dir /var/lib/postgresql --shell /usr/sbin/nologin postgres
fi
# chromium opens the evidence site in the browser test (scenarios/tests/site.rs); haproxy
# is the load balancer in front of several gateways (scenarios/tests/balancer.rs). Without
# them those tests say SKIPPED with the reason.
missing=""
command -v chromium >/dev/null 2>&1 || missing="$missing chromium"
[ -x /usr/sbin/haproxy ] || command -v haproxy >/dev/null 2>&1 || missing="$missing haproxy"
if [ -n "$missing" ]; then
  if [ "$(id -u)" = 0 ]; then
    echo "setup: installing$missing (apt-get install -y$missing)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq || true
    # shellcheck disable=SC2086
    apt-get install -y -qq $missing >/dev/null || echo "setup:$missing could not be installed; their tests will be SKIPPED" >&2
  else
    echo "setup:$missing missing (Debian: apt-get install -y$missing); their tests will be SKIPPED" >&2
  fi
fi
# .config/nextest.toml requires 0.9.91 (test priorities): an older one is replaced.
nextest_ok() {
  local v
  v=$(cargo nextest --version 2>/dev/null | sed -n 's/^cargo-nextest \([0-9.]*\).*/\1/p' | head -1)
  [ -n "$v" ] && [ "$(printf '%s\n%s\n' 0.9.91 "$v" | sort -V | head -1)" = 0.9.91 ]
}
if ! nextest_ok; then
  echo "setup: installing cargo-nextest (0.9.91 or newer) from crates.io"
  cargo install cargo-nextest --locked
fi
