//! Issue 25: the demo's Kafka mode (`make demo DEMO_ARGS=--kafka`, `replay::kafka`) at a small size, on both roads,
//! one record per transaction and in batches: 300 payment events, about 20% published twice, through a throwaway
//! Tansu broker to a group of four member processes (tests/bin/kafka_member.rs) that SIGKILL themselves at the
//! four crash points in turn, so the group rebalances and re-reads what was not finished. Afterwards:
//!
//! - road `ids` (mark(), offset committed after COMMIT): the ledger is the exactly-once one, one mark per event,
//!   and the group's committed offsets, as the broker has them, are at the end of every partition;
//! - road `offsets` (advance() of the partition's offset, no offset commits): the ledger holds every *record*
//!   once: the producer's retries are records of their own, which this road applies (docs/kafka.md), so the
//!   ledger exceeds the exactly-once one by exactly their amounts; the stored positions are at the end.
//!
//! Each run has a new seed (printed; `KAFKA_SEED=<seed>` replays its events, stream and crash chances). When
//! scripts/setup.sh did not install Tansu every test says so and passes, unless PG_DEDUP_REQUIRE_KAFKA=1 (CI).
//! The last test runs examples/kafka_consumer (Python, confluent-kafka) on both roads, killed once mid-stream.

use pg_dedup_harness::kafka::{self, Tansu};
use pg_dedup_harness::replay::kafka::{create_topic, produce, Program, Road, Run, Traffic, PARTITIONS};
use pg_dedup_harness::replay::{self, Event, Rng, Tally};
use pg_dedup_tests::*;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

/// Payment events per run, published by a producer that sends about a fifth of them twice.
const EVENTS: usize = 300;
const DUPLICATE_RATE: f64 = 0.2;
/// The group's size, as in the demo.
const MEMBERS: usize = 4;
/// Each road runs in two shapes side by side: (records per transaction, chance that a member dies in a
/// transaction), so about five deaths per run either way (each costs the group a rebalance, about 2 s). Either
/// run may kill none; both killing none (about 1 in 20,000) fails the road's test.
const SHAPES: [(usize, f64); 2] = [(1, 0.015), (10, 0.14)];

/// Are Tansu and the example's Python (scripts/setup.sh installs both) there? When not, says so once and the
/// tests skip, unless PG_DEDUP_REQUIRE_KAFKA=1 (CI), where a missing install fails.
fn installed() -> bool {
    static INSTALLED: OnceLock<bool> = OnceLock::new();
    *INSTALLED.get_or_init(|| {
        let missing: Vec<String> =
            [kafka::binary(), python()].into_iter().filter(|p| !p.exists()).map(|p| p.display().to_string()).collect();
        if missing.is_empty() {
            return true;
        }
        let why = format!("{} missing; scripts/setup.sh installs Tansu and confluent-kafka", missing.join(" and "));
        let required = std::env::var("PG_DEDUP_REQUIRE_KAFKA").is_ok_and(|v| v == "1");
        assert!(!required, "{why}");
        eprintln!("SKIPPED (tests/kafka.rs): {why}");
        false
    })
}

/// The Python that runs examples/kafka_consumer: a virtual environment with confluent-kafka.
fn python() -> std::path::PathBuf {
    kafka::install_dir().join("venv/bin/python")
}

/// A broker of its own for each test, or None (the test skips).
fn broker() -> Option<Tansu> {
    installed().then(Tansu::start)
}

fn seed() -> u64 {
    std::env::var("KAFKA_SEED").map_or_else(|_| Rng::new().u64(..), |s| s.parse().expect("KAFKA_SEED is a u64"))
}

/// One run; returns how many members were killed (None: skipped).
fn replay_through_kafka(road: Road, batch: usize, crash_rate: f64) -> Option<u64> {
    let tansu = broker()?;
    let name = format!("kafka_{}_{batch}", road.name());
    let mut admin = preloaded_server().fresh_db(&name);
    replay::prepare(&mut admin).unwrap();
    let seed = seed();
    let _seed = SeedOnFailure("the Kafka replay", "KAFKA_SEED", seed);
    let mut rng = Rng::with_seed(seed);
    let events = replay::events(&name, EVENTS, &mut rng);
    let stream = replay::publish(&events, DUPLICATE_RATE, &mut rng);
    let (traffic, tally) = (Traffic::default(), Tally::default());
    let postgres = format!("{} application_name={name}", preloaded_server().conn_string(&name, "postgres"));
    let program = Program { path: env!("CARGO_BIN_EXE_kafka_member").into(), args: vec![] };
    let bootstrap = tansu.bootstrap();
    let run = Run {
        road,
        program: &program,
        members: MEMBERS,
        batch,
        crash_rate,
        seed,
        bootstrap: &bootstrap,
        postgres: &postgres,
        stream: &stream,
    };
    let left = run.run(&traffic, &tally);

    let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
    let (applied, duplicates, crashes) = (load(&tally.applied), load(&tally.duplicates), load(&tally.crashes));
    let deaths = traffic.deaths.each_ref().map(load);
    let (delivered, reread) = (load(&traffic.delivered), load(&traffic.reread));
    let counts = format!(
        "seed {seed}, road {}, batch {batch}: published {}, delivered {delivered}, re-read {reread}, rebalances {}, \
         refused offset commits {}, applied {applied}, duplicates {duplicates}, {crashes} killed ({deaths:?} at \
         before mark/after mark/before commit/after commit), left {left}",
        road.name(),
        load(&traffic.published),
        load(&traffic.rebalances),
        load(&traffic.refused_commits),
    );
    assert_eq!(load(&traffic.published), stream.len() as u64, "every record acknowledged; {counts}");
    assert_eq!(left, 0, "records past what the group finished; {counts}");
    assert_eq!(deaths.iter().sum::<u64>(), crashes, "each death reported its point; {counts}");
    match road {
        Road::Ids => {
            let ledger = replay::check_ledger(&mut admin, &events).unwrap();
            let (total, expected, mismatched) = (ledger.total, ledger.expected_total, &ledger.mismatched);
            assert!(ledger.ok(), "{counts}\nledger {total} (exactly once: {expected}): {mismatched:?}");
            assert_eq!(count(&mut admin, "dedup.inbox_payments"), EVENTS as i64, "one mark per event; {counts}");
            assert_eq!(applied, EVENTS as u64, "each event applied once; {counts}");
            // Whatever a member died with was not committed, so its partition's next owner read it again.
            assert!(reread >= crashes, "fewer records re-read than members killed; {counts}");
            assert!(duplicates >= (stream.len() - EVENTS) as u64, "a producer retry was applied; {counts}");
        }
        Road::Offsets => {
            // Once per record: the retries are records, at offsets of their own.
            let ledger = replay::check_ledger(&mut admin, &stream).unwrap();
            let (total, expected, mismatched) = (ledger.total, ledger.expected_total, &ledger.mismatched);
            assert!(ledger.ok(), "{counts}\nledger {total} (once per record: {expected}): {mismatched:?}");
            let once_per_event: i64 = events.iter().map(|e| e.amount).sum();
            let retries: i64 = stream.iter().map(|e| e.amount).sum::<i64>() - once_per_event;
            assert_eq!(ledger.total - once_per_event, retries, "the ledger is over by the retries' amounts; {counts}");
            assert_eq!(count(&mut admin, "dedup.positions"), PARTITIONS as i64, "a position per partition; {counts}");
            assert_eq!(count(&mut admin, "dedup.inbox_payments"), 0, "this road marks nothing; {counts}");
            assert_eq!(applied, stream.len() as u64, "each record applied once; {counts}");
            // A member killed after COMMIT had stored its position: the next owner starts after it.
            assert!(reread >= crashes - deaths[3], "fewer records re-read than members killed before COMMIT; {counts}");
        }
    }
    // Every delivery was finished (applied or dropped) or died with its member.
    assert!(delivered >= applied + duplicates, "{counts}");
    // The killed members' sessions leave as soon as their backends read the closed socket.
    eventually("the members' backends are gone", || {
        let sql = "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1";
        admin.query_one(sql, &[&name]).unwrap().get::<_, i64>(0) == 0
    });
    println!("{counts}: ledger exact");
    Some(crashes)
}

/// Runs `run` for each of `items` side by side, each in a thread of its own (with a broker and a database of its
/// own), and returns what each returned; any one's failure fails the test with its panic.
fn side_by_side<T: Send, R: Send>(items: impl IntoIterator<Item = T>, run: impl Fn(T) -> R + Sync) -> Vec<R> {
    let run = &run;
    std::thread::scope(|s| {
        let runs: Vec<_> = items.into_iter().map(|item| s.spawn(move || run(item))).collect();
        runs.into_iter().map(|handle| handle.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic))).collect()
    })
}

/// Both shapes of `road`; between them they must have killed members.
fn both_shapes(road: Road) {
    let runs = side_by_side(SHAPES, |(batch, crash_rate)| replay_through_kafka(road, batch, crash_rate));
    if let Some(killed) = runs.into_iter().sum::<Option<u64>>() {
        assert!(killed > 0, "road {}: no member was killed in either run", road.name());
    }
}

/// mark() (mark_many() in batches) and the offset commit after COMMIT: `make demo DEMO_ARGS=--kafka`.
#[test]
fn ids_road() {
    both_shapes(Road::Ids);
}

/// advance() (twice per partition of a batch), no offset commits, a seek to position() + 1 on every assignment.
#[test]
fn offsets_road() {
    both_shapes(Road::Offsets);
}

/// examples/kafka_consumer (Python, confluent-kafka, psycopg) on one road: half the stream, a SIGKILL while it
/// applies it, the other half, a new consumer process, then SIGTERM. The ledger must be exact (ids: once per
/// event; offsets: once per record) and the consumer must leave cleanly when told to.
fn example_consumer(road: Road) {
    let Some(tansu) = broker() else { return };
    let python = python();
    let name = format!("kafka_example_{}", road.name());
    let mut admin = preloaded_server().fresh_db(&name);
    replay::prepare(&mut admin).unwrap();
    // Slow enough per update that the kill lands while it is applying, not after.
    admin
        .batch_execute(
            "CREATE FUNCTION slow() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN PERFORM pg_sleep(0.003); RETURN NEW; END $$;
             CREATE TRIGGER slow BEFORE UPDATE ON accounts FOR EACH ROW EXECUTE FUNCTION slow();",
        )
        .unwrap();
    let seed = seed();
    let _seed = SeedOnFailure("the Kafka replay", "KAFKA_SEED", seed);
    let mut rng = Rng::with_seed(seed);
    let events = replay::events(&name, EVENTS, &mut rng);
    let stream = replay::publish(&events, DUPLICATE_RATE, &mut rng);
    let json = |e: &Event| format!(r#"{{"id": "{}", "account": {}, "amount": {}}}"#, e.id, e.account, e.amount);
    let bootstrap = tansu.bootstrap();
    create_topic(&bootstrap);
    let start = || {
        let mut consumer = Command::new(&python)
            .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/kafka_consumer/consumer.py"))
            .args(["--bootstrap", &bootstrap, "--road", road.name(), "--batch", "10", "--session-timeout-ms", "1500"])
            .env("DATABASE_URL", preloaded_server().conn_string(&name, "postgres"))
            .stdout(Stdio::piped())
            .spawn()
            .expect("start examples/kafka_consumer/consumer.py");
        // Its lines, through a channel: a consumer that never prints must fail the test, not hang it.
        let (tx, lines) = std::sync::mpsc::channel();
        let stdout = BufReader::new(consumer.stdout.take().unwrap());
        std::thread::spawn(move || stdout.lines().map_while(Result::ok).try_for_each(|line| tx.send(line)));
        (consumer, lines)
    };
    let (half, rest) = stream.split_at(stream.len() / 2);
    produce(&bootstrap, half, json);
    let (mut first, lines) = start();
    // Killed after its third transaction, with most of the half still to apply.
    for _ in 0..3 {
        let line = lines.recv_timeout(Duration::from_secs(60)).expect("a transaction of the consumer in a minute");
        assert!(line.starts_with("applied "), "{line}");
    }
    first.kill().unwrap();
    first.wait().unwrap();
    produce(&bootstrap, rest, json);
    let (mut second, _lines) = start();
    let target = match road {
        Road::Ids => &events,
        Road::Offsets => &stream,
    };
    eventually("the example's ledger is exact", || replay::check_ledger(&mut admin, target).unwrap().ok());
    // SAFETY: kill has no memory preconditions; the pid is our unreaped child.
    unsafe { libc::kill(second.id() as i32, libc::SIGTERM) };
    let status = second.wait().unwrap();
    assert!(status.success(), "the example did not leave cleanly on SIGTERM: {status}");
    let marks = count(&mut admin, "dedup.inbox_payments");
    assert_eq!(marks, if road == Road::Ids { EVENTS as i64 } else { 0 }, "marks of road {}", road.name());
    println!("examples/kafka_consumer, road {}: seed {seed}, killed once, ledger exact", road.name());
}

/// examples/kafka_consumer on both roads at once.
#[test]
fn example_consumer_on_both_roads() {
    side_by_side([Road::Ids, Road::Offsets], example_consumer);
}
