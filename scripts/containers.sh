#!/bin/sh
# The container backend's set-up (`make test-containers`, IMFAULT_PG=container).
#
#   scripts/containers.sh engine        install docker.io when no engine answers, start dockerd
#   scripts/containers.sh image [MAJOR] build imfault/postgres:MAJOR (default 15) once, from
#                                       Debian's packages: debootstrap + docker import (no pull)
#   scripts/containers.sh setup [MAJOR] both
#
# Exit status 3 means "no container engine can run here" (the reason is on stderr, last
# line): `make test-containers` records it as SKIPPED instead of failing or hiding it.
set -eu

MAJOR=${2:-15}
IMAGE=${IMFAULT_PG_IMAGE:-imfault/postgres:$MAJOR}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}

say() { echo "containers: $*" >&2; }
skip() { say "SKIP: $*"; exit 3; }

as_root() {
    if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else return 1; fi
}

engine_answers() { docker info >/dev/null 2>&1; }

engine() {
    if engine_answers; then
        return 0
    fi
    if ! command -v dockerd >/dev/null 2>&1; then
        say "no docker engine: installing Debian's docker.io"
        as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q docker.io >/dev/null \
            || skip "apt-get install docker.io failed (no root, or no package registry)"
    fi
    if ! engine_answers; then
        say "starting dockerd (published ports bound to 127.0.0.1; log: /tmp/imfault-dockerd.log)"
        # Not through systemd: CI machines and containers often have none.
        as_root sh -c 'nohup dockerd --ip 127.0.0.1 >/tmp/imfault-dockerd.log 2>&1 &' \
            || skip "cannot start dockerd (not root and no sudo)"
        i=0
        while ! engine_answers; do
            i=$((i + 1))
            if [ "$i" -gt 150 ]; then
                tail -5 /tmp/imfault-dockerd.log >&2 || true
                skip "dockerd did not answer within 30 s (see /tmp/imfault-dockerd.log)"
            fi
            sleep 0.2
        done
    fi
    say "engine: $(docker version --format 'server {{.Server.Version}} (API {{.Server.APIVersion}})' 2>/dev/null)"
}

# The Debian suite that ships postgresql-MAJOR.
suite_for() {
    case "$1" in
        13) echo bullseye ;;
        15) echo bookworm ;;
        17) echo trixie ;;
        *) echo "containers: no Debian suite known to ship postgresql-$1 (13, 15, 17)" >&2; exit 2 ;;
    esac
}

image() {
    if docker image inspect "$IMAGE" >/dev/null 2>&1; then
        say "image $IMAGE present"
        return 0
    fi
    suite=$(suite_for "$MAJOR")
    if ! command -v debootstrap >/dev/null 2>&1; then
        as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q debootstrap >/dev/null \
            || skip "apt-get install debootstrap failed"
    fi
    dir=$(mktemp -d /tmp/imfault-pg-image.XXXXXX)
    trap 'rm -rf "$dir"' EXIT
    say "building $IMAGE: debootstrap $suite with postgresql-$MAJOR (about a minute)"
    as_root debootstrap --variant=minbase --include="postgresql-$MAJOR" "$suite" "$dir/root" "$MIRROR" \
        >"$dir/debootstrap.log" 2>&1 || { tail -20 "$dir/debootstrap.log" >&2; skip "debootstrap failed"; }
    # The entry point: initdb on first start, then the postmaster as PID 1, so that
    # `docker kill` is a crash of the whole server. Trust only the docker network
    # (`samenet`: the host reaches it through docker's proxy); published ports are bound to
    # 127.0.0.1 by the dockerd this script starts.
    cat >"$dir/root/usr/local/bin/imfault-pg" <<'EOF'
#!/bin/sh
set -eu
BIN=$(ls -d /usr/lib/postgresql/*/bin | tail -1)
PGDATA=${PGDATA:-/var/lib/postgresql/data}
if [ ! -s "$PGDATA/PG_VERSION" ]; then
    "$BIN/initdb" -D "$PGDATA" -U postgres --auth=trust -E UTF8 --locale=C >/dev/null
    echo "host all all samenet trust" >>"$PGDATA/pg_hba.conf"
fi
exec "$BIN/postgres" -D "$PGDATA" -c listen_addresses='*' "$@"
EOF
    chmod 755 "$dir/root/usr/local/bin/imfault-pg"
    as_root tar -C "$dir/root" -c . | docker import \
        --change 'USER postgres' \
        --change 'ENV PGDATA=/var/lib/postgresql/data' \
        --change 'EXPOSE 5432' \
        --change 'ENTRYPOINT ["/usr/local/bin/imfault-pg"]' \
        - "$IMAGE" >/dev/null
    say "image $IMAGE built: $(docker image inspect --format '{{.Size}}' "$IMAGE") bytes"
}

case "${1:-}" in
    engine) engine ;;
    image) engine; image ;;
    setup) engine; image ;;
    *) echo "usage: scripts/containers.sh engine|image [MAJOR]|setup [MAJOR]" >&2; exit 2 ;;
esac
