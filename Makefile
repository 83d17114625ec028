# pg_dedup — the two commands of the quick start, and their parts.
#   make demo    the main job: a live at-least-once replay on a throwaway local Postgres
#                (DEMO_ARGS=--rabbitmq: the same replay through a real RabbitMQ, a throwaway node on loopback)
#                (DEMO_ARGS=--kafka: through a throwaway Tansu, a Kafka-protocol broker, to a consumer group; --offsets)
#   make test    the whole suite on every supported major (PG_VERSIONS=15 make test to narrow)
#   make test-long  the long reliability runs (the full-size race storm, 30 minutes of steady load)
#   make bench   benchmarks against baselines measured in the same run (BENCH_QUICK=1 for a short run)
#   make package  install artifacts in dist/: a tarball per major, a .deb for Debian's PostgreSQL 15
#   make lint    formatting (cargo fmt --check) and clippy with warnings as errors, as CI runs them
# Both run scripts/setup.sh first: it installs what is missing (apt packages, cargo-pgrx, PostgreSQL 13 and 18
# built from source) and does nothing when everything is in place.

# Exported: tests/pg_upgrade.rs upgrades from each major listed (so tested and installed) before the current one.
export PG_VERSIONS ?= 13 15 18
DEMO_PG ?= 15
export PG_DEDUP_CACHE ?= /var/cache/pg_dedup
# Compiled dependencies are shared by every checkout (and CI's fresh clones), so only the first build is slow.
export CARGO_TARGET_DIR ?= $(PG_DEDUP_CACHE)/target
# rustup installs cargo (and cargo-pgrx) here; CI's environment may not have it on PATH.
export PATH := $(HOME)/.cargo/bin:$(PATH)

# The long reliability runs, about 35 minutes per major: the race storm at full size, 16 sessions x 200,000 calls
# (about 5 minutes), and 30 minutes of steady load (tests/load.rs: 2,000 marks/s, 5 s TTL, the worker purging).
test-long: export STORM_MARKS = 200000
test-long: export LOAD_SECONDS = 1800
test-long: TESTS = --test storm --test load
test-long: PGRX_TESTS = 0
test-long: test

.PHONY: setup demo test test-long install bench package package-test lint
setup:
	@scripts/setup.sh

# Clippy for the default feature (PostgreSQL 15), as for an editor's cargo check, and for the extension on the oldest
# and newest majors too: their `cfg` arms (ports.rs, shmem.rs) are compiled only there.
lint: setup
	@cargo fmt --all --check
	@cargo clippy -q --workspace --all-targets -- -D warnings
	@for v in 13 18; do cargo clippy -q -p pg_dedup --all-targets --no-default-features --features pg$$v,pg_test -- -D warnings || exit 1; done

install: setup
	@for v in $(PG_VERSIONS); do echo "== installing pg_dedup into PostgreSQL $$v"; scripts/pg.sh install_extension $$v || exit 1; done

demo: setup
	@scripts/pg.sh install_extension $(DEMO_PG)
	@PG_CONFIG=$$(scripts/pg.sh pg_config_for $(DEMO_PG)) cargo run -q -p pg_dedup_harness --bin demo -- $(DEMO_ARGS)

# For each major: `cargo pgrx test` (the #[pg_test]s beside the code, in a server pgrx starts), then the integration
# tests against real servers (tests/). PGRX_TESTS=0 skips the former, INTEGRATION_TESTS=0 the latter.
export PGRX_TESTS ?= 1
export INTEGRATION_TESTS ?= 1
test: setup
	@echo "== the Bloom filter itself (property tests, no server), and the benchmark's own logic"
	@cargo test -q -p pg_dedup_bloom -p pg_dedup_bench
	@for v in $(PG_VERSIONS); do \
	  if [ "$(PGRX_TESTS)" = 1 ]; then \
	    echo "== PostgreSQL $$v: cargo pgrx test"; \
	    scripts/pg.sh pgrx_test $$v || exit 1; \
	  fi; \
	  if [ "$(INTEGRATION_TESTS)" = 1 ]; then \
	    echo "== PostgreSQL $$v: integration tests"; \
	    scripts/pg.sh install_extension $$v || exit 1; \
	    PG_CONFIG=$$(scripts/pg.sh pg_config_for $$v) cargo test -q -p pg_dedup_tests $(TESTS) -- --test-threads=4 --nocapture || exit 1; \
	  fi; \
	done

# Benchmarks (optimised build of the extension) against hand-written SQL, pg_test_fsync and Redis; BENCH_QUICK=1 for
# a short run (about 4 minutes; the full run takes about 100), BENCH_ONLY=clients,growth for some sections only,
# BENCH_ROUNDS=15 for more alternating rounds than the mode's.
# The Citus section runs on PostgreSQL $(CITUS_PG), where scripts/setup.sh builds Citus (skipped when it did not).
CITUS_PG ?= 18
bench: setup
	@scripts/pg.sh install_extension $(DEMO_PG) --release
	@scripts/pg.sh install_extension $(CITUS_PG) --release
	@PG_CONFIG=$$(scripts/pg.sh pg_config_for $(DEMO_PG)) CITUS_PG_CONFIG=$$(scripts/pg.sh pg_config_for $(CITUS_PG)) \
	  cargo run -q --release -p pg_dedup_bench --bin bench

# Release builds packaged for users (scripts/package.sh): a tarball per major in PG_VERSIONS and a .deb for each that
# is Debian's own PostgreSQL (15). package-test installs the .deb with dpkg -i, uses it in a fresh cluster, removes it
# with dpkg -r and puts back the files it replaced; CI runs it after `make test`.
package: setup
	@scripts/package.sh build $(PG_VERSIONS)

package-test: setup
	@scripts/package.sh build 15
	@scripts/package.sh test 15
