//! `make demo`: at-least-once delivery in, exactly-once effects out.
//!
//! Starts a throwaway Postgres with pg_dedup, then replays a stream of payment events through an in-process
//! broker that behaves like a real one: the producer publishes some events twice (a retry after a lost ack), and
//! consumers die at random points (before marking, after marking, before commit, after commit but before the
//! ack), so the broker redelivers whatever was not acknowledged. Each consumer applies an event with
//! `dedup.mark()` + a balance update in one transaction and acknowledges only after COMMIT. At the end the ledger
//! must equal the exactly-once total, whatever was delivered.
//!
//! With --rabbitmq the same stream goes through a real broker instead (replay::amqp): a throwaway RabbitMQ node on
//! loopback, a durable queue, persistent messages with publisher confirms, and consumers with their own AMQP and
//! Postgres connections that die the same way. RabbitMQ redelivers what they did not acknowledge.
//!
//! Options: --rabbitmq --events N (2000) --consumers N (4) --duplicate-rate F (0.2) --crash-rate F (0.05) --seed N

use pg_dedup_harness::rabbitmq::RabbitMq;
use pg_dedup_harness::replay::amqp::{self, Traffic};
use pg_dedup_harness::replay::{self, Broker, Crash, Event, Rng, Tally, ACCOUNTS};
use pg_dedup_harness::Cluster;
use std::io::Write;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

struct Options {
    rabbitmq: bool,
    events: usize,
    consumers: usize,
    duplicate_rate: f64,
    crash_rate: f64,
    seed: u64,
}

fn parse_options() -> Options {
    let mut o =
        Options { rabbitmq: false, events: 2000, consumers: 4, duplicate_rate: 0.2, crash_rate: 0.05, seed: 42 };
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        if flag == "--rabbitmq" {
            o.rabbitmq = true;
            continue;
        }
        let value = args.next().unwrap_or_else(|| usage(&format!("missing value for {flag}")));
        let (flag, value) = (flag.as_str(), value.as_str());
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
    eprintln!("usage: demo [--rabbitmq] [--events N] [--consumers N] [--duplicate-rate F] [--crash-rate F] [--seed N]");
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

/// What a replay did, for the summary.
struct Replayed {
    published: u64,
    delivered: u64,
    redelivered: u64,
    seconds: f64,
    /// Messages still in the broker at the end: none, if every delivery was acknowledged.
    left: u64,
}

fn main() {
    let o = parse_options();
    let through = if o.rabbitmq { " through RabbitMQ" } else { "" };
    println!(
        "pg_dedup demo{through}: {} payment events, {} consumers, {:.0}% producer retries, {:.0}% consumer crashes",
        o.events,
        o.consumers,
        o.duplicate_rate * 100.0,
        o.crash_rate * 100.0
    );
    let started = Instant::now();
    // RabbitMQ boots (in a few seconds) while Postgres starts. The node is stopped and removed when dropped: at
    // the end, or when anything below fails.
    let (cluster, mut admin, postgres_took, node) = std::thread::scope(|s| {
        let node = o.rabbitmq.then(|| s.spawn(|| (RabbitMq::start(), started.elapsed())));
        // The full product: preloaded, so the shared Bloom filter and the purge worker run too.
        let cluster = Cluster::start(&["shared_preload_libraries = 'pg_dedup'", "dedup.database = 'demo'"]);
        let mut admin = cluster.fresh_db("demo");
        replay::prepare(&mut admin).expect("prepare the demo database");
        let postgres_took = started.elapsed();
        (cluster, admin, postgres_took, node.map(|n| n.join().expect("start RabbitMQ")))
    });
    println!(
        "  throwaway PostgreSQL {} started in {:.1}s (pg_dedup installed, inbox 'payments')",
        cluster.major,
        postgres_took.as_secs_f64()
    );
    let node = node.map(|(node, took)| {
        println!(
            "  throwaway RabbitMQ node started in {:.1}s (127.0.0.1:{}; durable queue '{}', prefetch {})",
            took.as_secs_f64(),
            node.port,
            amqp::QUEUE,
            amqp::PREFETCH
        );
        node
    });

    // The producer: every event once, some of them twice (a retry after a lost publisher confirm).
    let mut rng = Rng::with_seed(o.seed);
    let events = replay::events("payment", o.events, &mut rng);
    let stream = replay::publish(&events, o.duplicate_rate, &mut rng);
    let tally = Tally::default();
    let replayed = match &node {
        Some(node) => through_rabbitmq(&o, &cluster, node, &stream, &tally),
        None => in_memory(&o, &cluster, stream, &tally),
    };
    println!();

    let ledger = replay::check_ledger(&mut admin, &events).expect("read the ledger");
    let marks: i64 = admin.query_one("SELECT count(*) FROM dedup.inbox_payments", &[]).unwrap().get(0);
    let filter = admin
        .query_one("SELECT lookups, certainly_new, filter_state FROM dedup.stats WHERE inbox = 'payments'", &[])
        .unwrap();
    let (lookups, certainly_new, filter_state): (i64, i64, String) = (filter.get(0), filter.get(1), filter.get(2));

    let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
    let Replayed { published, delivered, redelivered, seconds, left } = replayed;
    let crashes = load(&tally.crashes);
    let (confirmed, redelivered_note) = if node.is_some() {
        // A dying consumer gives back every delivery it holds unacknowledged, not only the one it was applying.
        let held = format!("flagged by RabbitMQ: what {crashes} crashed consumers held, up to {} each", amqp::PREFETCH);
        (", each confirmed", held)
    } else {
        ("", format!("after {crashes} consumer crashes"))
    };
    println!();
    let retries = published - o.events as u64;
    println!("  {:<22}{:>10}  ({} events + {retries} producer retries{confirmed})", "published", published, o.events);
    println!("  {:<22}{:>10}", "delivered", delivered);
    println!("  {:<22}{:>10}  ({redelivered_note})", "redelivered", redelivered);
    println!("  {:<22}{:>10}", "duplicates dropped", load(&tally.duplicates));
    println!("  {:<22}{:>10}  ({} marks in dedup.inbox_payments)", "applied", load(&tally.applied), marks);
    println!("  {:<22}{:>10}  in {seconds:.1}s ({:.0} deliveries/s)", "", "", delivered as f64 / seconds);
    println!(
        "  {:<22}{:>10}  lookups, {certainly_new} answered \"certainly new\" without the index (filter {filter_state})",
        "Bloom filter", lookups
    );
    if node.is_some() {
        println!("  {:<22}{:>10}  messages (each delivery acknowledged after its COMMIT)", "left in the queue", left);
    }
    println!();
    let ok = ledger.ok() && load(&tally.applied) == o.events as u64 && left == 0;
    if ok {
        println!("  OK: ledger total {} equals the exactly-once total; all {ACCOUNTS} balances match.", ledger.total);
    } else {
        println!(
            "  FAILED: ledger total {}, exactly-once total {}, {} balances differ, {} events applied of {}, {} left",
            ledger.total,
            ledger.expected_total,
            ledger.mismatched.len(),
            load(&tally.applied),
            o.events,
            left
        );
    }
    drop(admin);
    let rabbitmq = if node.is_some() { " and RabbitMQ node" } else { "" };
    drop(node);
    cluster.destroy();
    println!("  throwaway cluster{rabbitmq} stopped and removed.");
    if !ok {
        std::process::exit(1);
    }
}

/// The in-process broker: consumer threads take deliveries from `replay::Broker`.
fn in_memory(o: &Options, cluster: &Cluster, stream: Vec<Event>, tally: &Tally) -> Replayed {
    let broker = Broker::with(stream);
    let replay = Instant::now();
    let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
    let line = || {
        let queued = broker.queue.lock().unwrap().len() as u64;
        progress_line(&[
            ("delivered", load(&broker.delivered), 6),
            ("duplicates dropped", load(&tally.duplicates), 5),
            ("applied", load(&tally.applied), 6),
            ("crashes", load(&tally.crashes), 4),
            ("queued", queued, 6),
        ])
    };
    with_progress(line, || {
        std::thread::scope(|s| {
            let workers: Vec<_> = (0..o.consumers)
                .map(|c| {
                    let (broker, seed) = (&broker, o.seed + 1 + c as u64);
                    s.spawn(move || consumer(cluster, broker, tally, o.crash_rate, seed))
                })
                .collect();
            for w in workers {
                w.join().expect("a consumer thread failed");
            }
        })
    });
    let left = broker.queue.lock().unwrap().len() as u64;
    Replayed {
        published: load(&broker.published),
        delivered: load(&broker.delivered),
        redelivered: load(&broker.redelivered),
        seconds: replay.elapsed().as_secs_f64(),
        left,
    }
}

/// The real broker: RabbitMQ, a producer and consumer connections (replay::amqp).
fn through_rabbitmq(o: &Options, cluster: &Cluster, node: &RabbitMq, stream: &[Event], tally: &Tally) -> Replayed {
    let traffic = Traffic::default();
    let (url, postgres) = (node.url(), cluster.conn_string("demo", "postgres"));
    let (consumers, crash_rate, seed) = (o.consumers, o.crash_rate, o.seed.wrapping_add(1));
    let run = amqp::Run { amqp: &url, postgres: &postgres, stream, consumers, crash_rate, seed };
    let replay = Instant::now();
    let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
    let line = || {
        progress_line(&[
            ("delivered", load(&traffic.delivered), 6),
            ("redelivered", load(&traffic.redelivered), 5),
            ("duplicates dropped", load(&tally.duplicates), 5),
            ("applied", load(&tally.applied), 6),
            ("crashes", load(&tally.crashes), 4),
        ])
    };
    let left = with_progress(line, || run.run(&traffic, tally));
    Replayed {
        published: load(&traffic.published),
        delivered: load(&traffic.delivered),
        redelivered: load(&traffic.redelivered),
        seconds: replay.elapsed().as_secs_f64(),
        left: left.into(),
    }
}

/// Runs `work` while a thread redraws the progress line every 200 ms, then draws it a last time.
fn with_progress<R>(line: impl Fn() -> String + Sync, work: impl FnOnce() -> R) -> R {
    /// Stops the redrawing however `work` ends: a panic must not leave the scope waiting for it.
    struct Stop<'a>(&'a AtomicBool);
    impl Drop for Stop<'_> {
        fn drop(&mut self) {
            self.0.store(true, Ordering::Relaxed);
        }
    }
    let done = AtomicBool::new(false);
    let result = std::thread::scope(|s| {
        s.spawn(|| {
            while !done.load(Ordering::Relaxed) {
                show(&line());
                std::thread::sleep(Duration::from_millis(200));
            }
        });
        let _stop = Stop(&done);
        work()
    });
    show(&line());
    result
}

/// `name value` pairs, each value right-aligned in its width, on one line redrawn in place.
fn progress_line(fields: &[(&str, u64, usize)]) -> String {
    let fields: Vec<String> = fields.iter().map(|(name, value, width)| format!("{name} {value:>width$}")).collect();
    format!("\r  {}", fields.join("   "))
}

fn show(line: &str) {
    print!("{line}");
    let _ = std::io::stdout().flush();
}
