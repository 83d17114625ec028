#!/usr/bin/env bash
# Install artifacts for pg_dedup (`make package`, `make package-test`):
#   scripts/package.sh build MAJOR...  release build per major, into dist/ (PG_DEDUP_DIST): a tarball for every major,
#                                      and a .deb for each major whose PostgreSQL is Debian's own package
#   scripts/package.sh test MAJOR      installs that .deb with dpkg -i, uses it in a fresh cluster, removes it with
#                                      dpkg -r, and leaves the machine's pg_dedup files as they were before
# A .deb only for Debian's PostgreSQL (15 on Debian 12): it installs into /usr/lib/postgresql/15 and depends on
# postgresql-15, which any Debian 12 machine can satisfy. PostgreSQL 13 and 18 are built from source here, into a
# prefix that exists only on this machine, so a .deb for them would install into nowhere useful; their tarball
# holds the same files, to copy into any PostgreSQL of that major (see INSTALL in it).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
DIST=${PG_DEDUP_DIST:-$here/dist}
MAINTAINER='pg_dedup maintainers <maintainers@users.noreply.a-seed-4848ff18.example>'
ARCH=$(dpkg --print-architecture)

log() { printf '[package] %s\n' "$*" >&2; }
die() { log "FAILED: $*"; exit 1; }
as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }
pg_config_for() { "$here/scripts/pg.sh" pg_config_for "$1"; }
VERSION=$(python3 -c 'import tomllib,sys; print(tomllib.load(open(sys.argv[1],"rb"))["package"]["version"])' \
  "$here/Cargo.toml")
deb_name() { echo "postgresql-$1-pg-dedup"; }
deb_file() { echo "$DIST/$(deb_name "$1")_$VERSION-1_$ARCH.deb"; }

# META.json (PGXN) is valid, has the keys PGXN requires, and its versions, the built control file's default_version
# ($1) and Cargo.toml's agree: one version everywhere a user or PGXN reads it.
check_versions() {
  python3 - "$here/META.json" "$1" "$VERSION" <<'EOF' || die "versions out of step (see above)"
import json, re, sys
meta, control, cargo = json.load(open(sys.argv[1])), open(sys.argv[2]).read(), sys.argv[3]
missing = {"name", "abstract", "version", "maintainer", "license", "provides", "meta-spec"} - meta.keys()
assert not missing, f"META.json lacks {missing}"
found = {"META.json version": meta["version"], "META.json provides": meta["provides"]["pg_dedup"]["version"],
         "pg_dedup.control": re.search(r"^default_version = '(.*)'", control, re.M).group(1)}
wrong = {k: v for k, v in found.items() if v != cargo}
assert not wrong, f"Cargo.toml says {cargo}, but {wrong}"
EOF
}

# Libraries the .so needs, as Debian dependencies (libc6 (>= 2.x), libgcc-s1): dpkg-shlibdeps wants a debian/
# directory, so it runs in a throwaway one. Postgres' own symbols are left unresolved (the server provides them).
shlib_depends() {
  local d
  d=$(mktemp -d)
  mkdir "$d/debian"
  printf 'Source: pg-dedup\n\nPackage: pg-dedup\nArchitecture: any\n' >"$d/debian/control"
  (cd "$d" && dpkg-shlibdeps -O "$1" 2>/dev/null) | sed -n 's/^shlibs:Depends=//p'
  rm -rf "$d"
}

build() {
  [ $# -gt 0 ] || die "usage: $0 build MAJOR..."
  local major
  mkdir -p "$DIST"
  WORK=$(mktemp -d)
  trap 'rm -rf "$WORK"' EXIT
  for major in "$@"; do build_one "$major"; done
  ls -l "$DIST"
}

build_one() {
  local major=$1 pg_config stage lib ext work name
  pg_config=$(pg_config_for "$major")
  lib=$("$pg_config" --pkglibdir)
  ext=$("$pg_config" --sharedir)/extension
  work=$WORK/pg$major
  stage=$work/stage
  log "building pg_dedup $VERSION for PostgreSQL $major (release)"
  "$here/scripts/pg.sh" stage_extension "$major" "$stage" --release
  check_versions "$stage$ext/pg_dedup.control"
  [ -z "$(find "$stage" -type f -not -path "$stage$lib/*" -not -path "$stage$ext/*")" ] \
    || die "staged files outside $lib and $ext: the packages below would miss them"
  # Like Debian's dh_strip: the symbols Postgres looks up (_PG_init, Pg_magic_func, pg_finfo_*) are dynamic and stay.
  strip --strip-unneeded --remove-section=.comment --remove-section=.note "$stage$lib/pg_dedup.so"
  chmod 755 "$stage$lib/pg_dedup.so"
  chmod 644 "$stage$ext"/*

  name=pg_dedup-$VERSION-pg$major-$ARCH
  mkdir -p "$work/$name"
  cp -a "$stage$lib" "$work/$name/lib"
  cp -a "$stage$ext" "$work/$name/extension"
  cat >"$work/$name/INSTALL" <<EOF
pg_dedup $VERSION for PostgreSQL $major ($ARCH). Install into the PostgreSQL whose pg_config is first on PATH:
  install -m 755 lib/pg_dedup.so "\$(pg_config --pkglibdir)/"
  install -m 644 extension/* "\$(pg_config --sharedir)/extension/"
then, in each database: CREATE EXTENSION pg_dedup;   (or ALTER EXTENSION pg_dedup UPDATE; to upgrade)
EOF
  tar --owner=0 --group=0 --numeric-owner -C "$work" -czf "$DIST/$name.tar.gz" "$name"

  if dpkg -S "$pg_config" >/dev/null 2>&1 && [ "$lib" = "/usr/lib/postgresql/$major/lib" ]; then
    build_deb "$major" "$stage"
  else
    log "no .deb for PostgreSQL $major: it is not Debian's package here ($pg_config); the tarball has its files"
  fi
}

build_deb() {
  local major=$1 root=$2 pkg doc
  pkg=$(deb_name "$major")
  doc=$root/usr/share/doc/$pkg
  mkdir -p "$root/DEBIAN" "$doc"
  # The license text, indented as a machine-readable copyright file wants it (blank lines as " .").
  {
    printf 'Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/\nUpstream-Name: pg_dedup\n\n'
    printf 'Files: *\nCopyright: 2026, the pg_dedup maintainers\nLicense: PostgreSQL\n'
    sed -e '1,/^Copyright/d' "$here/LICENSE" | sed -e '1{/^$/d;}' -e 's/^$/./' -e 's/^/ /'
  } >"$doc/copyright"
  # Debian policy (and lintian) want a changelog in every non-native package; one entry, this build.
  printf '%s (%s-1) unstable; urgency=medium\n\n  * pg_dedup %s, built by scripts/package.sh.\n\n -- %s  %s\n' \
    "$pkg" "$VERSION" "$VERSION" "$MAINTAINER" "$(date -R)" | gzip -9n >"$doc/changelog.Debian.gz"
  find "$root" -type d -exec chmod 755 {} +
  chmod 644 "$doc"/*
  local libs
  libs=$(shlib_depends "$root/usr/lib/postgresql/$major/lib/pg_dedup.so")
  [ -n "$libs" ] || die "dpkg-shlibdeps found no library dependencies for pg_dedup.so"
  cat >"$root/DEBIAN/control" <<EOF
Package: $pkg
Version: $VERSION-1
Architecture: $ARCH
Maintainer: $MAINTAINER
Installed-Size: $(du -sk --exclude=DEBIAN "$root" | cut -f1)
Depends: postgresql-$major, $libs
Section: database
Priority: optional
Description: message deduplication (inbox pattern) for PostgreSQL $major
 pg_dedup records the ids of processed messages inside the caller's
 transaction (dedup.mark), so a redelivered message is recognised and
 skipped: the idempotent consumer, with expiry, a shared-memory Bloom
 filter and a background purge worker.
EOF
  (cd "$root" && find usr -type f -exec md5sum {} + | sort -k2) >"$root/DEBIAN/md5sums"
  chmod 644 "$root/DEBIAN/control" "$root/DEBIAN/md5sums"
  dpkg-deb --root-owner-group -Zxz --build "$root" "$(deb_file "$major")" >/dev/null
}

# The files a package of major $1 must install: the library, the control file, the current version's script, every
# upgrade script and every earlier release's install script, from the sources (not from the package under test).
expected_files() {
  local lib=/usr/lib/postgresql/$1/lib ext=/usr/share/postgresql/$1/extension f
  printf '%s\n' "$lib/pg_dedup.so" "$ext/pg_dedup.control" "$ext/pg_dedup--$VERSION.sql"
  for f in "$here"/sql/pg_dedup--*--*.sql "$here"/sql/releases/pg_dedup--*.sql; do echo "$ext/${f##*/}"; done
}

# Installs the .deb of major $1 for real, checks it, removes it. Files it would overwrite (a source install, like
# the one `make test` leaves) are saved first and put back, by rename, once the package is gone.
test_deb() {
  local major=${1:?usage: $0 test MAJOR} deb pkg files f tmp
  deb=$(deb_file "$major")
  pkg=$(deb_name "$major")
  [ -f "$deb" ] || die "$deb not found: run scripts/package.sh build $major first"
  if dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q ' installed$'; then
    die "$pkg is installed already; this test removes it at the end, so remove it first (dpkg -r $pkg)"
  fi
  tmp=$(mktemp -d)
  chmod 755 "$tmp"
  files=$(dpkg-deb -c "$deb" | awk '$1 !~ /^d/ {print substr($6, 2)}')
  for f in $files; do
    if [ -e "$f" ]; then mkdir -p "$tmp/saved${f%/*}" && cp -a "$f" "$tmp/saved$f"; fi
  done
  # Runs on success and failure alike: nothing of the test stays installed, the saved files come back.
  trap "cleanup_test '$pkg' '$tmp' '$major'" EXIT

  log "dpkg -i $deb"
  as_root dpkg -i "$deb" >/dev/null
  local listed missing=()
  listed=$(dpkg -L "$pkg")
  for f in $(expected_files "$major"); do grep -qx "$f" <<<"$listed" || missing+=("$f"); done
  [ ${#missing[@]} -eq 0 ] || die "dpkg -L $pkg lacks: ${missing[*]}"
  as_root dpkg --verify "$pkg" || die "dpkg --verify $pkg: installed files differ from the package's md5sums"

  use_installed_extension "$major" "$tmp"

  log "dpkg -r $pkg"
  as_root dpkg -r "$pkg" >/dev/null
  for f in $files; do [ ! -e "$f" ] || die "dpkg -r left $f behind"; done
  log "OK: $pkg installs $(wc -w <<<"$files") files ($(grep -c '\.sql$' <<<"$files") SQL scripts), CREATE EXTENSION" \
    "and the update from every earlier release work, dpkg -r removes every file"
}

# A fresh cluster of Debian's PostgreSQL $1 with pg_dedup preloaded (so the library's _PG_init, shared memory and
# workers run from the packaged file): CREATE EXTENSION, and CREATE EXTENSION VERSION <each earlier release> +
# ALTER EXTENSION UPDATE, keeping a mark made before the update.
use_installed_extension() {
  local major=$1 dir=$2 bin=/usr/lib/postgresql/$1/bin owner=() release v
  [ "$(id -u)" -eq 0 ] && owner=(runuser -u postgres --) && chown postgres: "$dir"
  "${owner[@]}" "$bin/initdb" -D "$dir/data" -U postgres --auth=trust --no-sync -E UTF8 >/dev/null
  "${owner[@]}" "$bin/pg_ctl" -D "$dir/data" -l "$dir/log" -w -s start \
    -o "-c listen_addresses='' -k $dir -c shared_preload_libraries=pg_dedup -c dedup.database=postgres"
  # One transaction per statement, so the second mark() sees the first one committed.
  sql() {
    local db=$1 s args=()
    shift
    for s; do args+=(-c "$s"); done
    PGOPTIONS='-c client_min_messages=warning' \
      "$bin/psql" -h "$dir" -U postgres -d "$db" -X -q -At -v ON_ERROR_STOP=1 "${args[@]}"
  }
  [ "$(sql postgres "CREATE EXTENSION pg_dedup" \
       "SELECT extversion FROM pg_extension WHERE extname = 'pg_dedup'" \
       "SELECT dedup.mark('m1')" "SELECT dedup.mark('m1')")" = "$VERSION
t
f" ] || die "CREATE EXTENSION pg_dedup: wrong version or mark() result"
  for release in "$here"/sql/releases/pg_dedup--*.sql; do
    v=${release##*--}
    v=${v%.sql}
    sql postgres "CREATE DATABASE from_$(tr . _ <<<"$v")"
    [ "$(sql "from_$(tr . _ <<<"$v")" "CREATE EXTENSION pg_dedup VERSION '$v'" "SELECT dedup.mark('m1')" \
         "ALTER EXTENSION pg_dedup UPDATE" "SELECT extversion FROM pg_extension WHERE extname = 'pg_dedup'" \
         "SELECT dedup.mark('m1')")" = "t
$VERSION
f" ] || die "CREATE EXTENSION pg_dedup VERSION '$v' + ALTER EXTENSION UPDATE: wrong version, or the mark was lost"
    log "from $v: ALTER EXTENSION pg_dedup UPDATE reached $VERSION, the mark survived"
  done
  first_call_layout "$major" "$dir"
  "${owner[@]}" "$bin/pg_ctl" -D "$dir/data" -w -s stop
}

# link/first-call.ld holds in the packaged library: a new connection whose first call is mark() has mapped at most
# FIRST_CALL_KB of pg_dedup.so's code (the Rss of its executable mapping). Left where the linker puts it, that code
# maps 2.1 MB; with the script, 0.35-0.48 MB when scripts/first-call-layout.sh last regenerated it.
FIRST_CALL_KB=1024
first_call_layout() {
  local bin=/usr/lib/postgresql/$1/bin dir=$2 out kb
  local psql=("$bin/psql" -h "$dir" -U postgres -d postgres)
  "$here/scripts/pg.sh" wait_for_filter 60 "${psql[@]}" || die "pg_dedup's filter was not loaded"
  # psql's shell escape reads the backend's mapping while the connection is open: its pid and the awk program
  # (the Rss of the executable mapping of pg_dedup.so in smaps) reach the shell through the environment.
  local awk='/^[0-9a-f]+-[0-9a-f]+ / { code = ($2 ~ /x/ && $6 ~ /\/pg_dedup\.so$/) } code && /^Rss:/ { print $2; exit }'
  out=$(FIRST_CALL_AWK=$awk "${psql[@]}" -X -q -At -v ON_ERROR_STOP=1 <<'SQL'
SELECT pg_backend_pid() AS pid \gset
SELECT dedup.mark('first-call');
\setenv FIRST_CALL_PID :pid
\! awk "$FIRST_CALL_AWK" "/proc/$FIRST_CALL_PID/smaps"
SQL
  ) || die "a new connection's first mark() failed"
  kb=${out##*$'\n'}
  [[ $kb =~ ^[0-9]+$ ]] && [ "$kb" -le "$FIRST_CALL_KB" ] ||
    die "a new connection's first mark() mapped ${kb:-?} kB of pg_dedup.so's code (at most $FIRST_CALL_KB):" \
      "run scripts/first-call-layout.sh"
  log "a new connection's first mark() mapped $kb kB of pg_dedup.so's code (at most $FIRST_CALL_KB)"
}

cleanup_test() {
  local status=$? pkg=$1 tmp=$2 major=$3 f
  if [ "$status" -ne 0 ] && [ -f "$tmp/log" ]; then log "the server's log:"; tail -20 "$tmp/log" >&2; fi
  [ -f "$tmp/data/postmaster.pid" ] && as_root runuser -u "$(stat -c %U "$tmp/data")" -- \
    "/usr/lib/postgresql/$major/bin/pg_ctl" -D "$tmp/data" -m immediate -s stop || true
  if dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q ' installed$'; then as_root dpkg -r "$pkg" >/dev/null; fi
  if [ -d "$tmp/saved" ]; then
    while IFS= read -r f; do
      # One failed file must not keep the others from being put back.
      as_root install -D -m "$(stat -c %a "$f")" "$f" "${f#"$tmp/saved"}.new.$$" &&
        as_root mv -f "${f#"$tmp/saved"}.new.$$" "${f#"$tmp/saved"}" || log "could not put back ${f#"$tmp/saved"}"
    done < <(find "$tmp/saved" -type f)
    log "put back the pg_dedup files that were installed before the test"
  fi
  as_root rm -rf "$tmp"
}

case "${1:-}" in
  build) shift; build "$@" ;;
  test) shift; test_deb "$@" ;;
  *) die "usage: $0 build MAJOR... | test MAJOR" ;;
esac
