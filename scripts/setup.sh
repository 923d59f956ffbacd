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
if [ "$(id -u)" = 0 ] && ! id postgres >/dev/null 2>&1; then
  echo "setup: creating the postgres system user (PostgreSQL refuses to run as root)"
  useradd --system --home-dir /var/lib/postgresql --shell /usr/sbin/nologin postgres
fi
if ! cargo nextest --version >/dev/null 2>&1; then
  echo "setup: installing cargo-nextest from crates.io"
  cargo install cargo-nextest --locked
fi
