#!/usr/bin/env bash
# Idempotent toolchain setup for pg_dedup: every entry point (make demo, make test, .ci/run) calls it first.
# When everything is in place it only checks and returns in a second or two.
#
# It installs:
#   - Debian packages: PostgreSQL 15 server + headers, libclang (pgrx's bindgen), sudo, build tools, and Redis
#     (server + redis-benchmark: `make bench` compares mark() with Redis `SET NX EX`), valgrind (`make bench`
#     counts server instructions per call with callgrind), and RabbitMQ (the demo's
#     broker mode and tests/rabbitmq.rs run a throwaway node of their own on other ports; the system service that
#     Debian starts, where systemd runs, is left alone: it does not get in their way);
#   - cargo-pgrx 0.18.1 (0.19 needs a newer rustc than this machine has);
#   - PostgreSQL 13 and 18 built from Debian *source* packages into $PG_DEDUP_CACHE (no Debian 12 binaries exist);
#   - `cargo pgrx init` pointed at the three pg_configs.
# The cache lives outside the checkout and outside /root, because the unprivileged server user must read it.
set -euo pipefail

CACHE=${PG_DEDUP_CACHE:-/var/cache/pg_dedup}
PGRX_VERSION=0.18.1
PG15_CONFIG=/usr/lib/postgresql/15/bin/pg_config
# Majors built from source: Debian suite that still carries the source package.
declare -A SOURCE_SUITE=([13]=bullseye [18]=sid)

log() { printf '[setup] %s\n' "$*" >&2; }
as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

apt_packages=(postgresql-15 postgresql-server-dev-15 libclang-dev clang sudo build-essential pkg-config
  flex bison libreadline-dev zlib1g-dev libssl-dev bzip2 ca-certificates redis-server redis-tools python3-psycopg valgrind
  rabbitmq-server)

install_apt_packages() {
  local missing=()
  for p in "${apt_packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return
  log "installing Debian packages: ${missing[*]}"
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

install_cargo_pgrx() {
  if cargo pgrx --version 2>/dev/null | grep -q " $PGRX_VERSION\$"; then return; fi
  log "installing cargo-pgrx $PGRX_VERSION (about 15 minutes on 2 cores, once)"
  cargo install cargo-pgrx --version "$PGRX_VERSION" --locked --force
}

prepare_cache() {
  if [ ! -d "$CACHE" ] || [ ! -w "$CACHE" ]; then
    as_root mkdir -p "$CACHE"
    as_root chown "$(id -u):$(id -g)" "$CACHE"
  fi
  chmod 755 "$CACHE"
}

# Builds PostgreSQL $1 from the upstream tarball inside Debian's source package, into $CACHE/pg$1.
build_postgres() {
  local major=$1 prefix="$CACHE/pg$1" work="$CACHE/src-pg$1"
  [ -f "$prefix/.built" ] && return
  log "building PostgreSQL $major from source into $prefix (a few minutes, once)"
  rm -rf "$work" "$prefix"
  mkdir -p "$work/lists/partial"
  local uri
  uri=$(grep -h '^URIs:' /etc/apt/sources.list.d/*.sources 2>/dev/null | head -1 | awk '{print $2}')
  uri=${uri:-http://deb.debian.org/debian}
  printf 'deb-src [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] %s %s main\n' \
    "$uri" "${SOURCE_SUITE[$major]}" > "$work/sources.list"
  local o=(-o "Dir::Etc::SourceList=$work/sources.list" -o Dir::Etc::SourceParts=/nonexistent
           -o "Dir::State::Lists=$work/lists" -o Debug::NoLocking=1)
  apt-get "${o[@]}" update -qq
  (cd "$work" && apt-get "${o[@]}" source --download-only -qq "postgresql-$major")
  tar -C "$work" -xjf "$work"/postgresql-"$major"_*.orig.tar.bz2
  local srcdir
  srcdir=$(find "$work" -maxdepth 1 -type d -name "postgresql-$major*" | head -1)
  (cd "$srcdir" && ./configure --prefix="$prefix" --without-icu --with-openssl --enable-debug >/dev/null \
     && make -s -j"$(nproc)" >/dev/null && make -s install >/dev/null)
  chmod -R a+rX "$prefix"
  touch "$prefix/.built"
  rm -rf "$work"
}

pgrx_init() {
  local cfg="${PGRX_HOME:-$HOME/.pgrx}/config.toml" want=(13 15 18) ok=1
  for v in "${want[@]}"; do grep -q "^pg$v = \"$(pg_config_for "$v")\"" "$cfg" 2>/dev/null || ok=0; done
  [ $ok -eq 1 ] && return
  log "cargo pgrx init (pg13, pg15, pg18)"
  cargo pgrx init --pg13 "$(pg_config_for 13)" --pg15 "$(pg_config_for 15)" --pg18 "$(pg_config_for 18)" >/dev/null
}

pg_config_for() { if [ "$1" = 15 ]; then echo "$PG15_CONFIG"; else echo "$CACHE/pg$1/bin/pg_config"; fi; }

install_apt_packages
install_cargo_pgrx
prepare_cache
for v in 13 18; do build_postgres "$v"; done
pgrx_init
log "ready (cache: $CACHE)"
