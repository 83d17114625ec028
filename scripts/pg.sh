#!/usr/bin/env bash
# Shared by the Makefile's targets: where each supported PostgreSQL major lives, and installing pg_dedup into it.
set -euo pipefail
CACHE=${PG_DEDUP_CACHE:-/var/cache/pg_dedup}

pg_config_for() {
  case "$1" in
    15) echo /usr/lib/postgresql/15/bin/pg_config ;;
    *) echo "$CACHE/pg$1/bin/pg_config" ;;
  esac
}

# Builds pg_dedup for major $1 into the empty directory $2, laid out as it installs (absolute paths under $2: the
# library in that Postgres' pkglibdir, the control file and SQL scripts in its sharedir/extension). Extra arguments
# (e.g. --release; the default is a debug build) go to cargo pgrx package. Used by install_extension and by
# scripts/package.sh, so the packages hold exactly what a source install does.
# The staged files are the library, the current version's script and the upgrade scripts (sql/pg_dedup--A--B.sql);
# the install scripts of earlier releases (sql/releases/) are added, so `CREATE EXTENSION pg_dedup VERSION '0.1.0'`
# works (the upgrade test starts from each of them).
stage_extension() {
  local major=$1 stage=$2
  shift 2
  local here out arg args=()
  here=$(cd "$(dirname "$0")/.." && pwd)
  local profile=--debug # cargo pgrx package builds release unless told --debug
  for arg in "$@"; do
    if [ "$arg" = --release ]; then profile=--release; else args+=("$arg"); fi
  done
  [ "$profile" = --release ] && profile=
  if ! out=$(cargo pgrx package --pg-config "$(pg_config_for "$major")" --out-dir "$stage" --no-default-features \
      --features "pg$major" $profile ${args[@]+"${args[@]}"} 2>&1); then
    printf '%s\n' "$out" >&2
    return 1
  fi
  cp "$here"/sql/releases/pg_dedup--*.sql "$stage$("$(pg_config_for "$major")" --sharedir)/extension/"
}

# Builds pg_dedup for major $1 and installs it into that Postgres (its lib and share directories); extra arguments
# as for stage_extension.
# The build is staged, then each file is put in place by rename: a server running from the old library keeps its
# mapping of the old file instead of seeing it rewritten underneath it (which can crash it).
install_extension() {
  local major=$1 sudo=() stage file target
  shift
  [ "$(id -u)" -eq 0 ] || sudo=(sudo)
  stage=$(mktemp -d)
  trap 'rm -rf "$stage"' RETURN
  stage_extension "$major" "$stage" "$@" || return 1 # (not under set -e: the RETURN trap still cleans up)
  while IFS= read -r file; do
    target=${file#"$stage"}
    "${sudo[@]}" install -D -m "$(stat -c %a "$file")" "$file" "$target.new.$$"
    "${sudo[@]}" mv -f "$target.new.$$" "$target"
  done < <(find "$stage" -type f)
}

# Waits up to $1 seconds for the Bloom filter of the database that the psql command given after it connects to to
# be loaded: until then a mark() takes another road (an index probe first), so what a first call costs or runs is
# measured after it. Fails when the filter is not loaded by then.
wait_for_filter() {
  local seconds=$1
  shift
  for _ in $(seq "$seconds"); do
    [ "$("$@" -X -q -At -c "SELECT filter_state FROM dedup.filter_stats()")" = ready ] && return 0
    sleep 1
  done
  echo "pg_dedup's filter was not loaded after $seconds s" >&2
  return 1
}

# `cargo pgrx test` for major $1: the #[pg_test]s, one at a time (they share the server's filter), in a server pgrx
# starts. It installs a test build of the extension into that PostgreSQL: install_extension puts the real one back.
# As root, the server runs as `postgres` in a data directory of its own.
pgrx_test() {
  local major=$1 data="" args=()
  if [ "$(id -u)" -eq 0 ]; then
    data=$(mktemp -d /tmp/pg_dedup_pgrx.XXXXXX)
    chown postgres: "$data"
    args=(--runas postgres --pgdata "$data")
  fi
  local status=0
  RUST_TEST_THREADS=1 cargo pgrx test "pg$major" ${args[@]+"${args[@]}"} || status=$?
  [ -z "$data" ] || rm -rf "$data"
  return $status
}

"$@"
