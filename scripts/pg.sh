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

# Builds pg_dedup for major $1 and installs it into that Postgres (its lib and share directories); extra arguments
# (e.g. --release) go to cargo pgrx install.
# cargo pgrx installs the current version's script and the upgrade scripts (sql/pg_dedup--A--B.sql); the install
# scripts of earlier releases (sql/releases/) are copied too, so `CREATE EXTENSION pg_dedup VERSION '0.1.0'` works
# (the upgrade test starts from each of them).
install_extension() {
  local major=$1 sudo=()
  shift
  [ "$(id -u)" -eq 0 ] || sudo=(sudo)
  local out
  if ! out=$(cargo pgrx install ${sudo:+--sudo} --pg-config "$(pg_config_for "$major")" --no-default-features \
      --features "pg$major" "$@" 2>&1); then
    printf '%s\n' "$out" >&2
    return 1
  fi
  local here
  here=$(cd "$(dirname "$0")/.." && pwd)
  "${sudo[@]}" cp "$here"/sql/releases/pg_dedup--*.sql "$("$(pg_config_for "$major")" --sharedir)/extension/"
}

"$@"
