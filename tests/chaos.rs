//! Consumer chaos: `make demo`'s replay, with consumers that really die. Each run replays a few hundred payment
//! events, about 20% of them published twice, through an at-least-once broker (`replay::Broker`) to consumer
//! *processes* (tests/bin/chaos_consumer.rs: BEGIN; dedup.mark; the balance update when new; COMMIT; then the ack).
//! Some deliveries tell their consumer to SIGKILL itself at one of the four points (before mark, after mark, before
//! commit, after commit but before the ack), and a killer thread SIGKILLs a random consumer at random moments
//! besides, so kills land at points nobody chose too. A dead consumer's delivery goes back to the queue and a new
//! process takes its place. After each run: every balance is the exactly-once sum, the inbox holds one mark per
//! event and `seen()` knows them all, nothing is in flight, and no consumer or its backend is left.
//!
//! 20 runs, each on a fresh ledger and inbox, with its own seed; a failure names it, and `CHAOS_SEED=<seed>` replays
//! that run alone (same events, stream, crash points and kill thresholds; the exact moments of the kills differ).

use pg_dedup_harness::replay::{self, Broker, Crash, Event, Rng};
use pg_dedup_tests::*;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::ExitStatusExt;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::Duration;

const RUNS: u64 = 20;
const EVENTS: usize = 300;
const CONSUMERS: usize = 3;
const DUPLICATE_RATE: f64 = 0.2;
const CRASH_RATE: f64 = 0.04;
/// External kills per run, each after a random number of deliveries plus a random fraction of a transaction.
const KILLS: usize = 3;
const APP: &str = "chaos_consumer";

/// Counts over all runs.
#[derive(Default)]
struct Totals {
    deliveries: u64,
    duplicates: u64,
    events: u64,
    /// Consumers killed, by cause: the four crash points in `Crash::ALL` order, then the killer thread.
    deaths: [u64; 5],
}

/// One place consumers run in turn: the live one's pid (None between a death and its replacement), so that the
/// killer can shoot it, and whether it did.
#[derive(Default)]
struct Slot {
    pid: Mutex<Option<u32>>,
    shot: AtomicBool,
}

struct Consumer {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

/// How a delivery ended.
enum Outcome {
    Acked {
        new: bool,
    },
    /// The consumer died: at its crash point, or shot (None).
    Died(Option<Crash>),
}

impl Consumer {
    fn spawn(conn: &str, slot: &Slot) -> Consumer {
        let mut child = Command::new(env!("CARGO_BIN_EXE_chaos_consumer"))
            .arg(conn)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("start a consumer");
        *slot.pid.lock().unwrap() = Some(child.id());
        let (stdin, stdout) = (child.stdin.take().unwrap(), BufReader::new(child.stdout.take().unwrap()));
        Consumer { child, stdin, stdout }
    }

    fn deliver(&mut self, event: &Event, crash: Option<Crash>) -> Outcome {
        // A dead consumer shows as a failed write or a line cut short (no newline: end of file).
        let mut line = String::new();
        if self.stdin.write_all(format!("{}\n", event.to_line(crash)).as_bytes()).is_err()
            || self.stdout.read_line(&mut line).is_err()
            || !line.ends_with('\n')
        {
            return Outcome::Died(None);
        }
        match line.split_whitespace().collect::<Vec<_>>()[..] {
            ["ack", id, new] if id == event.id => Outcome::Acked { new: new == "new" },
            ["crash", point] => Outcome::Died(Some(Crash::from_name(point).expect("a crash point"))),
            _ => panic!("unexpected answer to {}: {line:?}", event.to_line(crash)),
        }
    }

    /// Reaps a consumer that died; it must have died of SIGKILL (a panic or an error exit is a failure).
    fn bury(mut self, slot: &Slot) {
        // Taken before reaping, so the killer never signals a pid that may have been reused.
        slot.pid.lock().unwrap().take();
        let status = self.child.wait().expect("wait for a consumer");
        assert_eq!(status.signal(), Some(libc::SIGKILL), "a consumer died otherwise than killed: {status}");
    }

    /// Closes stdin: the consumer must leave cleanly, unless the killer shot it while it waited (then true).
    fn finish(mut self, slot: &Slot) -> bool {
        slot.pid.lock().unwrap().take();
        drop(self.stdin);
        let status = self.child.wait().expect("wait for a consumer");
        let shot = slot.shot.swap(false, Ordering::SeqCst) && status.signal() == Some(libc::SIGKILL);
        assert!(shot || status.success(), "a consumer failed at the end: {status}");
        shot
    }
}

/// A consumer place: takes deliveries until the queue is empty, replacing its consumer whenever it dies.
fn consume(conn: &str, broker: &Broker, slot: &Slot, seed: u64, totals: &Mutex<Totals>) {
    let mut rng = Rng::with_seed(seed);
    let mut consumer: Option<Consumer> = None;
    while let Some(event) = broker.next() {
        let crash = Crash::pick(&mut rng, CRASH_RATE);
        let c = consumer.get_or_insert_with(|| Consumer::spawn(conn, slot));
        match c.deliver(&event, crash) {
            Outcome::Acked { new } => {
                broker.ack();
                totals.lock().unwrap().duplicates += u64::from(!new);
            }
            Outcome::Died(point) => {
                consumer.take().unwrap().bury(slot);
                // Killed by SIGKILL (bury checked that): by itself at its crash point, or else by the killer. One
                // that reports no point and was not shot means the answers are out of step with the deliveries.
                let shot = slot.shot.swap(false, Ordering::SeqCst);
                assert!(point.is_some() || shot, "a consumer died unshot without reporting a crash point");
                let cause = point.map_or(4, |p| Crash::ALL.iter().position(|&c| c == p).unwrap());
                totals.lock().unwrap().deaths[cause] += 1;
                broker.nack(event);
            }
        }
    }
    if consumer.is_some_and(|c| c.finish(slot)) {
        totals.lock().unwrap().deaths[4] += 1;
    }
}

/// SIGKILLs a random live consumer `KILLS` times: each after a random number of deliveries, plus up to 2 ms so
/// that it lands anywhere inside a transaction, not only between deliveries.
fn kill_randomly(broker: &Broker, slots: &[Slot], rng: &mut Rng, stream: usize, done: &AtomicBool) {
    let mut thresholds: Vec<u64> = (0..KILLS).map(|_| rng.u64(..stream as u64)).collect();
    thresholds.sort_unstable();
    for threshold in thresholds {
        while broker.delivered.load(Ordering::Relaxed) < threshold && !done.load(Ordering::Relaxed) {
            std::thread::sleep(Duration::from_millis(1));
        }
        std::thread::sleep(Duration::from_micros(rng.u64(..2000)));
        let slot = &slots[rng.usize(..slots.len())];
        let pid = slot.pid.lock().unwrap();
        if let Some(pid) = *pid {
            // Under the lock: the pid cannot be reaped (and reused) before the signal.
            // SAFETY: kill has no memory preconditions; pid is our live or unreaped child.
            assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGKILL) }, 0, "kill {pid}");
            slot.shot.store(true, Ordering::SeqCst);
        }
    }
}

fn run(cluster: &Cluster, admin: &mut pg_dedup_harness::postgres::Client, seed: u64, totals: &Mutex<Totals>) {
    let _seed = SeedOnFailure("consumer chaos", "CHAOS_SEED", seed);
    // A fresh ledger and inbox per run.
    admin
        .batch_execute(
            "DROP TABLE IF EXISTS accounts, dead_letters;
             SELECT dedup.drop_inbox(name) FROM dedup.inboxes WHERE name = 'payments';",
        )
        .unwrap();
    replay::prepare(admin).unwrap();
    let mut rng = Rng::with_seed(seed);
    // Ids new in every run, so that the filter answers "certainly new" as it does in production.
    let events = replay::events(&format!("pay{seed:x}"), EVENTS, &mut rng);
    let stream = replay::publish(&events, DUPLICATE_RATE, &mut rng);
    let stream_len = stream.len();
    let broker = Broker::with(stream);
    let slots: Vec<Slot> = (0..CONSUMERS).map(|_| Slot::default()).collect();
    let conn = format!("{} application_name={APP}", cluster.conn_string("chaos", "postgres"));
    let done = AtomicBool::new(false);
    std::thread::scope(|s| {
        let (broker, slots, done) = (&broker, &slots, &done);
        let mut killer_rng = Rng::with_seed(rng.u64(..));
        let killer = s.spawn(move || kill_randomly(broker, slots, &mut killer_rng, stream_len, done));
        let places: Vec<_> = slots
            .iter()
            .map(|slot| {
                let (conn, seed) = (&conn, rng.u64(..));
                s.spawn(move || consume(conn, broker, slot, seed, totals))
            })
            .collect();
        let results: Vec<_> = places.into_iter().map(|p| p.join()).collect();
        done.store(true, Ordering::Relaxed);
        killer.join().expect("the killer failed");
        for r in results {
            if let Err(panic) = r {
                std::panic::resume_unwind(panic);
            }
        }
    });

    let ledger = replay::check_ledger(admin, &events).unwrap();
    assert!(
        ledger.ok(),
        "ledger total {} (exactly once: {}); (account, balance, exactly-once balance) that differ: {:?}",
        ledger.total,
        ledger.expected_total,
        ledger.mismatched
    );
    assert_eq!(count(admin, "dedup.inbox_payments"), EVENTS as i64, "one mark per distinct event");
    let ids: Vec<&str> = events.iter().map(|e| e.id.as_str()).collect();
    let seen: i64 = admin
        .query_one("SELECT count(*) FROM unnest($1::text[]) id WHERE dedup.seen(id, 'payments')", &[&ids])
        .unwrap()
        .get(0);
    assert_eq!(seen, EVENTS as i64, "every event is seen()");
    assert!(broker.queue.lock().unwrap().is_empty(), "deliveries left in the queue");
    assert_eq!(broker.in_flight(), 0, "deliveries neither acknowledged nor put back");
    assert_eq!(broker.acked.load(Ordering::Relaxed), stream_len as u64, "every published message acknowledged once");
    // The consumers were reaped by their places; their backends leave as soon as they read the closed socket
    // (and roll back whatever a killed one had open).
    eventually("the killed consumers' backends are gone", || {
        let sql = "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1";
        admin.query_one(sql, &[&APP]).unwrap().get::<_, i64>(0) == 0
    });
    let mut t = totals.lock().unwrap();
    t.deliveries += broker.delivered.load(Ordering::Relaxed);
    t.events += EVENTS as u64;
}

#[test]
fn consumers_killed_anywhere_leave_an_exactly_once_ledger() {
    let cluster = preloaded("chaos", &[]);
    let mut admin = cluster.fresh_db("chaos");
    let replay_one: Option<u64> = std::env::var("CHAOS_SEED").ok().map(|s| s.parse().expect("CHAOS_SEED is a u64"));
    // New seeds in every test run explore new interleavings; the summary names them, a failure names its own.
    let seeds = match replay_one {
        Some(seed) => seed..=seed,
        None => {
            let first = Rng::new().u64(..u64::MAX - RUNS);
            first..=first + RUNS - 1
        }
    };
    let totals = Mutex::new(Totals::default());
    for seed in seeds.clone() {
        run(&cluster, &mut admin, seed, &totals);
    }
    let t = totals.into_inner().unwrap();
    let (runs, first, last, d) = (seeds.clone().count(), seeds.start(), seeds.end(), t.deaths);
    println!(
        "{runs} runs (seeds {first} to {last}), {} events, {} deliveries, {} duplicates dropped, \
         {} consumers killed ({}/{}/{}/{} before mark/after mark/before commit/after commit, {} at random moments): \
         ledger exact in every run",
        t.events,
        t.deliveries,
        t.duplicates,
        d.iter().sum::<u64>(),
        d[0],
        d[1],
        d[2],
        d[3],
        d[4]
    );
    if replay_one.is_none() {
        assert!(d.iter().all(|&n| n > 0), "every crash point and the killer struck at least once: {d:?}");
    }
}
