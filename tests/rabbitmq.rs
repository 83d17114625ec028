//! The demo's broker mode (`make demo DEMO_ARGS=--rabbitmq`, `replay::amqp`) at a small size: 300 payment events,
//! about 20% published twice, through a throwaway RabbitMQ node to consumers that die at the four crash points
//! (each with its Postgres transaction open or just committed, and its deliveries unacknowledged), so that RabbitMQ
//! redelivers what they held. One more event is poison (the ledger refuses it): its consumers count its attempts
//! with `dedup.attempt()` and park it in `dead_letters` after `MAX_ATTEMPTS`. Afterwards: the poison is parked
//! once, after at least that many attempts, the ledger is the exactly-once one of the others, the inbox holds one
//! mark per event,
//! every published message was acknowledged and none is left in the queue, the counts add up, no consumer session
//! is left in Postgres, and once the node is dropped none of its processes (the Erlang VM, its epmd) or files are.

use pg_dedup_harness::rabbitmq::RabbitMq;
use pg_dedup_harness::replay::amqp::{Run, Traffic};
use pg_dedup_harness::replay::{self, Rng, Tally, MAX_ATTEMPTS};
use pg_dedup_tests::*;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

const EVENTS: usize = 300;
const CONSUMERS: usize = 3;
const DUPLICATE_RATE: f64 = 0.2;
/// Higher than the demo's 5%, so that a short run still has a few dozen crashes.
const CRASH_RATE: f64 = 0.1;
const APP: &str = "broker_consumer";

#[test]
fn consumers_dying_on_a_real_broker_leave_an_exactly_once_ledger() {
    let cluster = preloaded("broker", &[]);
    let mut admin = cluster.fresh_db("broker");
    replay::prepare(&mut admin).unwrap();
    let node = RabbitMq::start();
    // A new seed in every test run; the failure messages name it.
    let seed = Rng::new().u64(..);
    let mut rng = Rng::with_seed(seed);
    let events = replay::events("broker", EVENTS, &mut rng);
    let mut stream = replay::publish(&events, DUPLICATE_RATE, &mut rng);
    let poison = replay::poison("broker");
    stream.insert(rng.usize(..=stream.len()), poison.clone());
    let (traffic, tally) = (Traffic::default(), Tally::default());
    let postgres = format!("{} application_name={APP}", cluster.conn_string("broker", "postgres"));
    let url = node.url();
    let run =
        Run { amqp: &url, postgres: &postgres, stream: &stream, consumers: CONSUMERS, crash_rate: CRASH_RATE, seed };
    let left = run.run(&traffic, &tally);

    let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
    let (published, delivered, redelivered, acked) =
        (load(&traffic.published), load(&traffic.delivered), load(&traffic.redelivered), load(&traffic.acked));
    let (applied, duplicates, crashes) = (load(&tally.applied), load(&tally.duplicates), load(&tally.crashes));
    let (failed, parked) = (load(&tally.failed), load(&tally.parked));
    let counts = format!(
        "seed {seed}: published {published}, delivered {delivered}, redelivered {redelivered}, acked {acked}, \
         applied {applied}, duplicates {duplicates}, crashes {crashes}, refused {failed}, parked {parked}, left {left}"
    );
    // The poison: parked once, by the first delivery counted beyond MAX_ATTEMPTS (each of the earlier ones was
    // refused by the ledger or died), and counted that far in dedup.attempts although every one rolled back.
    let dead = replay::parked(&mut admin).unwrap();
    assert_eq!(dead.len(), 1, "parked: {dead:?}; {counts}");
    let (parked_id, parked_at) = &dead[0];
    assert_eq!(*parked_id, poison.id, "{counts}");
    assert!(*parked_at > MAX_ATTEMPTS, "parked at attempt {parked_at}; {counts}");
    assert!(failed >= 1 && failed <= MAX_ATTEMPTS as u64, "{counts}");
    assert_eq!(parked, 1, "{counts}");
    let attempts: i32 = admin
        .query_one("SELECT attempts FROM dedup.attempts WHERE inbox = 'payments' AND id = $1", &[&poison.id])
        .unwrap()
        .get(0);
    assert!(attempts >= *parked_at, "dedup.attempts says {attempts} for the poison; {counts}");
    let ledger = replay::check_ledger(&mut admin, &events).unwrap();
    assert!(
        ledger.ok(),
        "{counts}\nledger total {} (exactly once: {}); (account, balance, exactly-once balance) that differ: {:?}",
        ledger.total,
        ledger.expected_total,
        ledger.mismatched
    );
    assert_eq!(
        count(&mut admin, "dedup.inbox_payments"),
        EVENTS as i64 + 1,
        "one mark per event and the poison; {counts}"
    );
    assert_eq!(applied, EVENTS as u64, "each event applied once; {counts}");
    assert_eq!(left, 0, "messages left in the queue; {counts}");
    assert_eq!(published, stream.len() as u64, "every message confirmed; {counts}");
    assert_eq!(acked, published, "every message acknowledged once; {counts}");
    // Every delivery a consumer took was acknowledged, rejected back into the queue, or its consumer died with it.
    assert_eq!(delivered, acked + failed + crashes, "{counts}");
    assert!(crashes > 0, "the chaos switch killed no consumer; {counts}");
    // A dead consumer's delivery comes back flagged (with whatever else it held: the prefetch).
    assert!(redelivered >= crashes, "fewer redeliveries than crashes; {counts}");
    assert!(duplicates >= published - EVENTS as u64 - 1, "a producer retry was applied twice; {counts}");
    // The dead consumers' sessions leave as soon as their backends read the closed socket.
    eventually("the consumers' backends are gone", || {
        let sql = "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1";
        admin.query_one(sql, &[&APP]).unwrap().get::<_, i64>(0) == 0
    });

    let dir = node.dir().to_owned();
    drop(node);
    assert!(!dir.exists(), "the node's directory {} is left", dir.display());
    // Erlang's helper processes may outlive the node by a moment.
    eventually("the node's processes are gone", || processes_in(&dir).is_empty());
    println!("{counts}: ledger exact, queue empty, node gone");
}

/// The processes working in `dir` (the node's script, Erlang VM and epmd all do) or naming it in their arguments.
fn processes_in(dir: &Path) -> Vec<String> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let proc = entry.path();
        if !entry.file_name().to_string_lossy().bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        // A directory removed under a live process reads as "<path> (deleted)": compare the text.
        let cwd = std::fs::read_link(proc.join("cwd")).unwrap_or_default();
        let cmdline = std::fs::read(proc.join("cmdline")).unwrap_or_default();
        let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        let dir = dir.to_string_lossy();
        if cwd.to_string_lossy().starts_with(&*dir) || cmdline.contains(&*dir) {
            found.push(format!("{}: {cmdline}", entry.file_name().to_string_lossy()));
        }
    }
    found
}
