#!/usr/bin/env bash
# Regenerates link/first-call.ld, the linker script that puts the code a connection's first call runs side by side.
#
# Why: a new backend maps pg_dedup.so's code page by page as it first runs it (fork does not copy the page tables of
# file mappings; a fault maps the 64 kB around it). Left where the linker puts it, the code of a first mark() is
# spread over the 2.4 MB of .text: 26 faults in pg_dedup.so per new connection, 2.1 MB of it mapped. Packed at the
# start of .text: 10 faults, 0.35-0.48 MB (bench/results/profiles/issue-22.md, stop 46).
#
# How: a release build for PostgreSQL 15, a throwaway cluster under callgrind, one connection per statement below
# (the calls an application makes first, the most common first), each backend counted from PostgresMain (a forked
# backend's profile would otherwise hold the postmaster's start too: _PG_init, the shared memory). Every function a
# backend ran in pg_dedup.so goes into the script in that order, first by its exact name, which places each instance
# of a generic function in builds like this one, then by its name without the hashes rustc puts in it (they change
# with the PostgreSQL major's features, the profile, pg_dedup's version and rustc's; the name does not): there a
# generic function's instances all come together, so the names of many instances go last.
#
# Run it after a change that moves the first call's code (a new step in mark(), a dependency's upgrade, a new
# version): `make package-test` fails when the packaged library's first mark() maps too much of its code. Needs
# valgrind (scripts/setup.sh installs it).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
major=15
bin=$("$here/scripts/pg.sh" pg_config_for $major | xargs dirname)
out=$here/link/first-call.ld
command -v valgrind >/dev/null || { echo "valgrind is not installed (scripts/setup.sh installs it)" >&2; exit 1; }

"$here/scripts/pg.sh" install_extension $major --release
lib=$("$bin/pg_config" --pkglibdir)/pg_dedup.so
dir=$(mktemp -d)
owner=()
# Under valgrind the server takes a while to stop: the directory goes only once it has.
trap '"${owner[@]}" "$bin/pg_ctl" -D "$dir/data" -m fast -t 300 -s stop 2>/dev/null || true; rm -rf "$dir"' EXIT
[ "$(id -u)" -eq 0 ] && owner=(runuser -u postgres --) && chown postgres: "$dir"
"${owner[@]}" "$bin/initdb" -D "$dir/data" -U postgres --auth=trust --no-sync >/dev/null
"${owner[@]}" valgrind --tool=callgrind --demangle=no --toggle-collect=PostgresMain \
  --callgrind-out-file="$dir/cg.%p" "$bin/postgres" -D "$dir/data" \
  -c listen_addresses='' -k "$dir" -c shared_preload_libraries=pg_dedup -c dedup.database=postgres >"$dir/log" 2>&1 &
server=$!
waited=0
until "$bin/pg_isready" -q -h "$dir"; do
  if ! kill -0 "$server" 2>/dev/null || [ $((waited += 1)) -gt 600 ]; then
    echo "the server did not start under valgrind:" >&2
    tail -20 "$dir/log" >&2
    exit 1
  fi
  sleep 1
done
sql() { "$bin/psql" -h "$dir" -U postgres -X -q -At -v ON_ERROR_STOP=1 "$@"; }
sql -c "CREATE EXTENSION pg_dedup" -c "SELECT dedup.create_inbox('named', '3 days')" \
  -c "SELECT dedup.mark('dup-' || g) FROM generate_series(1, 100) g" >/dev/null
"$here/scripts/pg.sh" wait_for_filter 300 "$bin/psql" -h "$dir" -U postgres

statements=(
  "SELECT dedup.mark('new-1', interval '3 days', 'named')"
  "SELECT dedup.mark('new-2')"
  "SELECT dedup.mark('dup-1')"
  "SELECT dedup.mark_many(array['new-3', 'new-4', 'dup-2'])"
  "SELECT dedup.seen('dup-3')"
  "BEGIN; SELECT * FROM dedup.claim('key-1'); SELECT dedup.complete('key-1', '{\"a\": 1}'); COMMIT"
  "SELECT dedup.attempt('message-1')"
  "SELECT dedup.forget('dup-4')"
  "SELECT dedup.advance('stream-1', 5)"
)
profiles=()
for statement in "${statements[@]}"; do
  pid=$(sql -c "SELECT pg_backend_pid()" -c "$statement")
  pid=${pid%%$'\n'*}
  # A backend writes its profile as it exits, just after its client has gone.
  while [ -d "/proc/$pid" ]; do sleep 0.2; done
  profiles+=("$dir/cg.$pid")
done
python3 - "$lib" "$out" "${profiles[@]}" <<'PY'
import collections, re, subprocess, sys

lib, out, profiles = sys.argv[1], sys.argv[2], sys.argv[3:]


def unhashed(name):
    """The name as a pattern that holds in every build: rustc's hashes and LTO's suffix as wildcards."""
    name = re.sub(r"\.\d+$", ".*", name)  # a local symbol LTO renamed: "name.1234"
    name = re.sub(r"17h[0-9a-f]{16}E(?=$|\.)", "17h*", name)  # a legacy name's hash: "...17h0123456789abcdefE"
    return re.sub(r"Cs[0-9A-Za-z]+_", "Cs*_", name)  # a v0 name's crate disambiguators: "Cs1a2B3c_"


def ran_in_library(profile):
    """The functions of pg_dedup.so a callgrind profile has costs for, in the order the file names them."""
    names, objects, current, ran = {}, {}, None, []
    for line in open(profile, errors="replace"):
        m = re.match(r"^(c?ob|c?fn)=\((\d+)\)(?: (.*))?$", line.rstrip("\n"))
        if not m:
            continue
        kind, key, name = m.groups()
        table = objects if kind.endswith("ob") else names
        if name is not None:
            table[key] = name
        if kind == "ob":
            current = objects[key]
        elif kind == "fn" and current is not None and current.endswith("/pg_dedup.so"):
            ran.append(names[key])
    return ran

instances = collections.Counter()
symbols = subprocess.run(["nm", "--defined-only", lib], capture_output=True, text=True, check=True).stdout
for line in symbols.split("\n"):
    fields = line.split()
    if len(fields) == 3 and fields[1] in "tTwW":
        instances[unhashed(fields[2])] += 1
ran = []
for profile in profiles:
    for name in ran_in_library(profile):
        # LLVM merges the identical pg_finfo_* functions into one, under any of their names: the first line takes
        # them all. Code without a symbol (0x...: the C runtime's) is not in a section of its own.
        if name not in ran and not name.startswith(("pg_finfo_", "0x")):
            ran.append(name)
# Names the exact lines already hold in every build (a C function's) need no second line.
order = []
for name in map(unhashed, ran):
    if name not in order and name not in ran:
        order.append(name)
few = [n for n in order if instances[n] <= 3]
many = [n for n in order if instances[n] > 3]
# Every backend runs pgrx's fork handler as it starts, before PostgresMain: it goes first, beside the first call's code.
fork_handler = "_ZN11pgrx_pg_sys10submodules12thread_check18init_active_thread14clear_in_child17h*"
# First the exact names, which place each instance in the order it ran, in builds like this one (PostgreSQL 15,
# release: what make bench measures and Debian's PostgreSQL runs); then the patterns, for the other majors and
# profiles, where the instances of a generic function come together, after the others.
lines = ["    *(.text.pg_finfo_*)", f"    *(.text.{fork_handler})"] + [
    # A function LLVM deems cold (a lazy initialisation, a vector's growth) is in .text.unlikely.<name>.
    f"    *(.text.{p} .text.unlikely.{p})"
    for p in ran + few + many
]
if len(ran) < 100:
    sys.exit(f"only {len(ran)} functions of pg_dedup.so ran: the profiles are incomplete, {out} is left as it was")
with open(out, "w") as f:
    f.write(
        "/* Generated by scripts/first-call-layout.sh: the functions a connection's first calls run in pg_dedup.so,\n"
        "   mark()'s first, at the start of .text, so that a new backend maps them with few page faults. INSERT\n"
        "   keeps the linker's default layout for the rest; every other function follows in .text (still one\n"
        "   section of that name: valgrind names only the functions in .text). */\n"
        "SECTIONS\n{\n  .text :\n  {\n" + "\n".join(lines) + "\n  }\n}\nINSERT AFTER .eh_frame;\n"
    )
print(f"{out}: {len(ran)} functions; {len(few)} names of few instances, {len(many)} of many", file=sys.stderr)
PY
