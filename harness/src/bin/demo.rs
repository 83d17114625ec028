//! `make demo`: at-least-once delivery in, exactly-once effects out.
//!
//! Starts a throwaway Postgres with pg_dedup, then replays a stream of payment events through an in-process
//! broker that behaves like a real one: the producer publishes some events twice (a retry after a lost ack), and
//! consumers die at random points (before marking, after marking, before commit, after commit but before the
//! ack), so the broker redelivers whatever was not acknowledged. Each consumer applies an event with
//! `dedup.mark()` + a balance update in one transaction and acknowledges only after COMMIT. At the end the ledger
//! must equal the exactly-once total, whatever was delivered.
//!
//! Options: --events N (2000) --consumers N (4) --duplicate-rate F (0.2) --crash-rate F (0.05) --seed N

use pg_dedup_harness::replay::{self, Broker, Crash, Rng, Tally, ACCOUNTS};
use pg_dedup_harness::Cluster;
use std::io::Write;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

struct Options {
    events: usize,
    consumers: usize,
    duplicate_rate: f64,
    crash_rate: f64,
    seed: u64,
}

fn parse_options() -> Options {
    let mut o = Options { events: 2000, consumers: 4, duplicate_rate: 0.2, crash_rate: 0.05, seed: 42 };
    let args: Vec<String> = std::env::args().skip(1).collect();
    for pair in args.chunks(2) {
        let (flag, value) = match pair {
            [flag, value] => (flag.as_str(), value.as_str()),
            _ => usage(&format!("missing value for {}", pair[0])),
        };
        match flag {
            "--events" => o.events = parse(flag, value),
            "--consumers" => o.consumers = parse(flag, value),
            "--duplicate-rate" => o.duplicate_rate = parse(flag, value),
            "--crash-rate" => o.crash_rate = parse(flag, value),
            "--seed" => o.seed = parse(flag, value),
            _ => usage(&format!("unknown option {flag}")),
        }
    }
    if o.consumers == 0 || !(0.0..1.0).contains(&o.duplicate_rate) || !(0.0..1.0).contains(&o.crash_rate) {
        usage("need at least one consumer, and rates in [0, 1)");
    }
    o
}

fn parse<T: std::str::FromStr>(flag: &str, value: &str) -> T {
    value.parse().unwrap_or_else(|_| usage(&format!("bad value for {flag}: {value}")))
}

fn usage(problem: &str) -> ! {
    eprintln!("demo: {problem}");
    eprintln!("usage: demo [--events N] [--consumers N] [--duplicate-rate F] [--crash-rate F] [--seed N]");
    std::process::exit(2)
}

fn consumer(cluster: &Cluster, broker: &Broker, tally: &Tally, crash_rate: f64, seed: u64) {
    let mut rng = Rng::with_seed(seed);
    let mut db = cluster.connect("demo");
    while let Some(event) = broker.next() {
        let crash = Crash::pick(&mut rng, crash_rate);
        let outcome = replay::apply(&mut db, &event, |point| crash == Some(point));
        if let Ok(new) = outcome {
            let counter = if new { &tally.applied } else { &tally.duplicates };
            counter.fetch_add(1, Ordering::Relaxed);
        }
        if outcome.is_ok() && crash != Some(Crash::AfterCommitBeforeAck) {
            broker.ack();
        } else {
            // The process "dies": dropping the connection mid-transaction makes the server roll it back.
            tally.crashes.fetch_add(1, Ordering::Relaxed);
            db = cluster.connect("demo");
            broker.nack(event);
        }
    }
}

fn main() {
    let o = parse_options();
    println!("pg_dedup demo: {} payment events, {} consumers, {:.0}% producer retries, {:.0}% consumer crashes",
        o.events, o.consumers, o.duplicate_rate * 100.0, o.crash_rate * 100.0);
    let started = Instant::now();
    // The full product: preloaded, so the shared Bloom filter and the purge worker run too.
    let cluster = Cluster::start(&["shared_preload_libraries = 'pg_dedup'", "dedup.database = 'demo'"]);
    let mut admin = cluster.fresh_db("demo");
    replay::prepare(&mut admin).expect("prepare the demo database");
    println!("  throwaway PostgreSQL {} started in {:.1}s (pg_dedup installed, inbox 'payments')",
        cluster.major, started.elapsed().as_secs_f64());

    // The producer: every event once, some of them twice (a retry after a lost publisher confirm).
    let mut rng = Rng::with_seed(o.seed);
    let events = replay::events("payment", o.events, &mut rng);
    let broker = Broker::with(replay::publish(&events, o.duplicate_rate, &mut rng));
    let tally = Tally::default();
    let done = AtomicBool::new(false);

    let replay = Instant::now();
    std::thread::scope(|s| {
        let workers: Vec<_> = (0..o.consumers)
            .map(|c| {
                let (cluster, broker, tally) = (&cluster, &broker, &tally);
                s.spawn(move || consumer(cluster, broker, tally, o.crash_rate, o.seed + 1 + c as u64))
            })
            .collect();
        s.spawn(|| {
            while !done.load(Ordering::Relaxed) {
                progress(&broker, &tally);
                std::thread::sleep(Duration::from_millis(200));
            }
        });
        for w in workers {
            w.join().expect("a consumer thread failed");
        }
        done.store(true, Ordering::Relaxed);
    });
    progress(&broker, &tally);
    let seconds = replay.elapsed().as_secs_f64();
    println!();

    let ledger = replay::check_ledger(&mut admin, &events).expect("read the ledger");
    let marks: i64 = admin.query_one("SELECT count(*) FROM dedup.inbox_payments", &[]).unwrap().get(0);
    let filter = admin
        .query_one("SELECT lookups, certainly_new, filter_state FROM dedup.stats WHERE inbox = 'payments'", &[])
        .unwrap();
    let (lookups, certainly_new, filter_state): (i64, i64, String) = (filter.get(0), filter.get(1), filter.get(2));

    let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
    let published = load(&broker.published);
    println!();
    println!("  {:<22}{:>10}  ({} events + {} producer retries)", "published", published, o.events, published - o.events as u64);
    println!("  {:<22}{:>10}", "delivered", load(&broker.delivered));
    println!("  {:<22}{:>10}  (after {} consumer crashes)", "redelivered", load(&broker.redelivered), load(&tally.crashes));
    println!("  {:<22}{:>10}", "duplicates dropped", load(&tally.duplicates));
    println!("  {:<22}{:>10}  ({} marks in dedup.inbox_payments)", "applied", load(&tally.applied), marks);
    println!("  {:<22}{:>10}  in {seconds:.1}s ({:.0} deliveries/s)", "", "", load(&broker.delivered) as f64 / seconds);
    println!(
        "  {:<22}{:>10}  lookups, {certainly_new} answered \"certainly new\" without the index (filter {filter_state})",
        "Bloom filter", lookups
    );
    println!();
    let ok = ledger.ok() && load(&tally.applied) == o.events as u64;
    if ok {
        println!("  OK: ledger total {} equals the exactly-once total; all {ACCOUNTS} balances match.", ledger.total);
    } else {
        println!("  FAILED: ledger total {}, exactly-once total {}, {} balances differ, {} events applied of {}",
            ledger.total, ledger.expected_total, ledger.mismatched.len(), load(&tally.applied), o.events);
    }
    drop(admin);
    cluster.destroy();
    println!("  throwaway cluster stopped and removed.");
    if !ok {
        std::process::exit(1);
    }
}

fn progress(broker: &Broker, tally: &Tally) {
    let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
    print!(
        "\r  delivered {:>6}   duplicates dropped {:>5}   applied {:>6}   crashes {:>4}   queued {:>6}",
        load(&broker.delivered),
        load(&tally.duplicates),
        load(&tally.applied),
        load(&tally.crashes),
        broker.queue.lock().unwrap().len()
    );
    let _ = std::io::stdout().flush();
}
