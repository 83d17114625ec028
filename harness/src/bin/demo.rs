//! `make demo`: at-least-once delivery in, exactly-once effects out.
//!
//! Starts a throwaway Postgres with pg_dedup, then replays a stream of payment events through an in-process
//! broker that behaves like a real one: the producer publishes some events twice (a retry after a lost ack), and
//! consumers die at random points (before marking, after marking, before commit, after commit but before the
//! ack), so the broker redelivers whatever was not acknowledged. Each consumer applies an event with
//! `dedup.mark()` + a balance update in one transaction and acknowledges only after COMMIT. At the end the ledger
//! must equal the exactly-once total, whatever was delivered.
//!
//! One event is poison: the ledger refuses it on every delivery, so its transaction rolls back every time. The
//! consumers count each delivery with `dedup.attempt()`, which the rollback does not undo, and after
//! `replay::MAX_ATTEMPTS` failed attempts park it in `dead_letters` inside their transaction (not with --kafka).
//!
//! With --rabbitmq the same stream goes through a real broker instead (replay::amqp): a throwaway RabbitMQ node on
//! loopback, a durable queue, persistent messages with publisher confirms, and consumers with their own AMQP and
//! Postgres connections that die the same way. RabbitMQ redelivers what they did not acknowledge.
//!
//! With --kafka it goes through a Kafka-protocol broker (replay::kafka): a throwaway Tansu on loopback, a topic of
//! six partitions, and a consumer group whose members are processes (this program again, `--kafka-member`) that
//! kill themselves at the four points; each place in the group starts a new member, so the group rebalances. The
//! members commit a partition's offset after COMMIT, or with --offsets commit none and keep the offsets with
//! `dedup.advance()` in the same transaction instead. --batch N applies up to N records per transaction.
//!
//! Options: --rabbitmq | --kafka [--offsets] [--batch N (1)], --events N (2000) --consumers N (4)
//! --duplicate-rate F (0.2; 0 with --offsets) --crash-rate F (0.05; 0.003 with --kafka) --seed N

use pg_dedup_harness::kafka::Tansu;
use pg_dedup_harness::rabbitmq::RabbitMq;
use pg_dedup_harness::replay::amqp::{self, Traffic};
use pg_dedup_harness::replay::kafka::{self, Road};
use pg_dedup_harness::replay::{self, Broker, Crash, Event, Outcome, Rng, Tally, ACCOUNTS};
use pg_dedup_harness::Cluster;
use std::io::Write;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Which broker the stream goes through.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Through {
    Memory,
    RabbitMq,
    Kafka(Road),
}

struct Options {
    through: Through,
    /// Records per transaction (--kafka).
    batch: usize,
    events: usize,
    consumers: usize,
    duplicate_rate: f64,
    crash_rate: f64,
    seed: u64,
}

fn parse_options() -> Options {
    let mut o = Options {
        through: Through::Memory,
        batch: 1,
        events: 2000,
        consumers: 4,
        duplicate_rate: 0.2,
        crash_rate: 0.05,
        seed: 42,
    };
    let (mut duplicate_rate, mut crash_rate, mut offsets) = (None, None, false);
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        match flag.as_str() {
            "--rabbitmq" => o.through = Through::RabbitMq,
            "--kafka" => o.through = Through::Kafka(Road::Ids),
            "--offsets" => offsets = true,
            _ => {
                let value = args.next().unwrap_or_else(|| usage(&format!("missing value for {flag}")));
                let (flag, value) = (flag.as_str(), value.as_str());
                match flag {
                    "--events" => o.events = parse(flag, value),
                    "--consumers" => o.consumers = parse(flag, value),
                    "--duplicate-rate" => duplicate_rate = Some(parse(flag, value)),
                    "--crash-rate" => crash_rate = Some(parse(flag, value)),
                    "--seed" => o.seed = parse(flag, value),
                    "--batch" => o.batch = parse(flag, value),
                    _ => usage(&format!("unknown option {flag}")),
                }
            }
        }
    }
    if offsets {
        if o.through != Through::Kafka(Road::Ids) {
            usage("--offsets is a road of --kafka");
        }
        o.through = Through::Kafka(Road::Offsets);
        // Positions recognise a record read again, not an event published twice: a producer's retry is a record
        // of its own, at an offset of its own, which this road applies (docs/kafka.md).
        if duplicate_rate.is_some_and(|r| r > 0.0) {
            usage("--offsets deduplicates by offset, and a producer retry is a new record: use --duplicate-rate 0");
        }
        o.duplicate_rate = 0.0;
    }
    if o.batch != 1 && !matches!(o.through, Through::Kafka(_)) {
        usage("--batch is an option of --kafka");
    }
    o.duplicate_rate = duplicate_rate.unwrap_or(o.duplicate_rate);
    // A member killed in a Kafka group costs a rebalance, about two seconds in which the group applies nothing.
    let default_crash_rate = if matches!(o.through, Through::Kafka(_)) { 0.003 } else { 0.05 };
    o.crash_rate = crash_rate.unwrap_or(default_crash_rate);
    if o.consumers == 0
        || o.batch == 0
        || !(0.0..1.0).contains(&o.duplicate_rate)
        || !(0.0..1.0).contains(&o.crash_rate)
    {
        usage("need at least one consumer, batches of at least one, and rates in [0, 1)");
    }
    o
}

fn parse<T: std::str::FromStr>(flag: &str, value: &str) -> T {
    value.parse().unwrap_or_else(|_| usage(&format!("bad value for {flag}: {value}")))
}

fn usage(problem: &str) -> ! {
    eprintln!("demo: {problem}");
    eprintln!(
        "usage: demo [--rabbitmq | --kafka [--offsets] [--batch N]] [--events N] [--consumers N] [--duplicate-rate F] \
         [--crash-rate F] [--seed N]"
    );
    std::process::exit(2)
}

fn consumer(cluster: &Cluster, broker: &Broker, tally: &Tally, crash_rate: f64, seed: u64) {
    let mut rng = Rng::with_seed(seed);
    let mut db = cluster.connect("demo");
    while let Some(event) = broker.next() {
        let crash = Crash::pick(&mut rng, crash_rate);
        let outcome = replay::apply_or_park(&mut db, &event, |point| crash == Some(point));
        if let Ok(outcome) = outcome {
            tally.count(outcome);
        }
        if outcome == Ok(Outcome::Failed) {
            // Rolled back: the consumer lives on, and the broker delivers the event again.
            broker.nack(event);
        } else if outcome.is_ok() && crash != Some(Crash::AfterCommitBeforeAck) {
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
    /// Messages still in the broker at the end (Kafka: records beyond what the group finished): none, if every
    /// delivery was acknowledged.
    left: u64,
    /// Kafka's own figures, printed after the common ones.
    kafka: Option<KafkaFigures>,
}

struct KafkaFigures {
    rebalances: u64,
    deaths: [u64; 4],
    refused_commits: u64,
    transactions: u64,
    transaction_micros: u64,
    offset_commit_micros: u64,
}

fn main() {
    // The demo is its own Kafka group member: `demo --kafka-member ...` is one member process (replay::kafka).
    if std::env::args().nth(1).as_deref() == Some("--kafka-member") {
        kafka::member_main(std::env::args().skip(2));
        return;
    }
    let o = parse_options();
    let through = match o.through {
        Through::Memory => String::new(),
        Through::RabbitMq => " through RabbitMQ".to_owned(),
        Through::Kafka(road) => {
            let batch =
                if o.batch > 1 { format!(", up to {} records per transaction", o.batch) } else { String::new() };
            match road {
                Road::Ids => format!(" through Kafka (ids marked, offsets committed after COMMIT{batch})"),
                Road::Offsets => format!(" through Kafka (offsets kept by dedup.advance(), none committed{batch})"),
            }
        }
    };
    println!(
        "pg_dedup demo{through}: {} payment events, {} consumers, {:.0}% producer retries, {:.1}% consumer crashes",
        o.events,
        o.consumers,
        o.duplicate_rate * 100.0,
        o.crash_rate * 100.0
    );
    let started = Instant::now();
    // The broker boots (RabbitMQ in a few seconds, Tansu at once) while Postgres starts. It is stopped and removed
    // when dropped: at the end, or when anything below fails.
    let (cluster, mut admin, postgres_took, node, tansu) = std::thread::scope(|s| {
        let node = (o.through == Through::RabbitMq).then(|| s.spawn(|| (RabbitMq::start(), started.elapsed())));
        let tansu = matches!(o.through, Through::Kafka(_)).then(|| s.spawn(|| (Tansu::start(), started.elapsed())));
        // The full product: preloaded, so the shared Bloom filter and the purge worker run too.
        let cluster = Cluster::start(&["shared_preload_libraries = 'pg_dedup'", "dedup.database = 'demo'"]);
        let mut admin = cluster.fresh_db("demo");
        replay::prepare(&mut admin).expect("prepare the demo database");
        let postgres_took = started.elapsed();
        let node = node.map(|n| n.join().expect("start RabbitMQ"));
        (cluster, admin, postgres_took, node, tansu.map(|t| t.join().expect("start Tansu")))
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
    let tansu = tansu.map(|(tansu, took)| {
        println!(
            "  throwaway Kafka broker ({}) started in {:.1}s (127.0.0.1:{}; topic '{}' of {} partitions, group '{}')",
            Tansu::version(),
            took.as_secs_f64(),
            tansu.port,
            kafka::TOPIC,
            kafka::PARTITIONS,
            kafka::GROUP
        );
        tansu
    });

    // The producer: every event once, some of them twice (a retry after a lost publisher confirm).
    let mut rng = Rng::with_seed(o.seed);
    let events = replay::events("payment", o.events, &mut rng);
    let mut stream = replay::publish(&events, o.duplicate_rate, &mut rng);
    // The poison event, somewhere in the stream (the Kafka members apply without counting attempts: docs/kafka.md).
    let poison = (!matches!(o.through, Through::Kafka(_))).then(|| replay::poison("payment"));
    if let Some(poison) = &poison {
        stream.insert(rng.usize(..=stream.len()), poison.clone());
    }
    let tally = Tally::default();
    let replayed = match (&node, &tansu) {
        (Some(node), _) => through_rabbitmq(&o, &cluster, node, &stream, &tally),
        (_, Some(tansu)) => through_kafka(&o, &cluster, tansu, &stream, &tally),
        _ => in_memory(&o, &cluster, stream, &tally),
    };
    println!();

    // Parked events were given up on, never applied: the exactly-once ledger is that of the others.
    let parked = replay::parked(&mut admin).expect("read dead_letters");
    let good_parked = parked.iter().filter(|(id, _)| poison.as_ref().is_none_or(|p| p.id != *id)).count();
    let kept: Vec<Event> = events.iter().filter(|e| parked.iter().all(|(id, _)| *id != e.id)).cloned().collect();
    let ledger = replay::check_ledger(&mut admin, &kept).expect("read the ledger");
    let marks: i64 = admin.query_one("SELECT count(*) FROM dedup.inbox_payments", &[]).unwrap().get(0);
    let positions: i64 = admin.query_one("SELECT count(*) FROM dedup.positions", &[]).unwrap().get(0);
    let filter = admin
        .query_one("SELECT lookups, certainly_new, filter_state FROM dedup.stats WHERE inbox = 'payments'", &[])
        .unwrap();
    let (lookups, certainly_new, filter_state): (i64, i64, String) = (filter.get(0), filter.get(1), filter.get(2));

    let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
    let Replayed { published, delivered, redelivered, seconds, left, kafka: figures } = replayed;
    let crashes = load(&tally.crashes);
    let retries = published - o.events as u64 - poison.iter().count() as u64;
    let row = |name: &str, value: u64, note: &str| {
        let note = if note.is_empty() { String::new() } else { format!("  ({note})") };
        println!("  {name:<22}{value:>10}{note}");
    };
    println!();
    let confirmed = match o.through {
        Through::Memory => "",
        Through::RabbitMq => ", each confirmed",
        Through::Kafka(_) => ", each acknowledged by the broker",
    };
    let poisoned = if poison.is_some() { " + 1 poison event" } else { "" };
    row("published", published, &format!("{} events{poisoned} + {retries} producer retries{confirmed}", o.events));
    row("delivered", delivered, "");
    match (&figures, o.through) {
        (Some(k), Through::Kafka(road)) => {
            let d = k.deaths;
            let why = format!(
                "records the group read again, after {crashes} members were killed: \
                 {}/{}/{}/{} before mark/after mark/before commit/after commit",
                d[0], d[1], d[2], d[3]
            );
            row("re-read", redelivered, &why);
            row(
                "rebalances",
                k.rebalances,
                &format!("the group stopped to reassign its {} partitions", kafka::PARTITIONS),
            );
            if road == Road::Ids {
                row("offset commits refused", k.refused_commits, "the group had rebalanced: their records are re-read");
            }
        }
        _ => {
            let note = match o.through {
                // A dying consumer gives back every delivery it holds unacknowledged, not only the one it was
                // applying.
                Through::RabbitMq => {
                    format!("flagged by RabbitMQ: what {crashes} crashed consumers held, up to {} each", amqp::PREFETCH)
                }
                _ => format!("after {crashes} consumer crashes"),
            };
            let failed = load(&tally.failed);
            let note = if failed > 0 { format!("{note}, and {failed} deliveries the ledger refused") } else { note };
            row("redelivered", redelivered, &note);
        }
    }
    if o.through == Through::Kafka(Road::Offsets) {
        row("stale records skipped", load(&tally.duplicates), "advance() refused them: their offsets were stored");
        let note = format!("{positions} positions in dedup.positions, one per partition");
        row("applied", load(&tally.applied), &note);
    } else {
        row("duplicates dropped", load(&tally.duplicates), "");
        row("applied", load(&tally.applied), &format!("{marks} marks in dedup.inbox_payments"));
    }
    if poison.is_some() {
        // The attempts before the one that parked it: MAX_ATTEMPTS, unless a consumer died on the way.
        let tries: Vec<String> = parked.iter().map(|(_, attempt)| (attempt - 1).to_string()).collect();
        println!(
            "  {:<22}{:>10} parked after {} attempts  (in dead_letters; dedup.attempt() counts across rollbacks)",
            "poison",
            parked.len(),
            if tries.is_empty() { "?".to_owned() } else { tries.join("/") }
        );
    }
    println!("  {:<22}{:>10}  in {seconds:.1}s ({:.0} deliveries/s)", "", "", delivered as f64 / seconds);
    if let Some(k) = &figures {
        let per = |micros: u64| micros as f64 / k.transactions.max(1) as f64 / 1000.0;
        let records = load(&tally.applied) + load(&tally.duplicates);
        let offset_commits = match o.through {
            Through::Kafka(Road::Ids) => format!(", then {:.2} ms committing offsets", per(k.offset_commit_micros)),
            _ => ", no offset commit".to_owned(),
        };
        println!(
            "  {:<22}{:>10}  transactions of {:.1} records on average: {:.2} ms each from BEGIN to COMMIT{offset_commits}",
            "per transaction",
            k.transactions,
            records as f64 / k.transactions.max(1) as f64,
            per(k.transaction_micros)
        );
    }
    if o.through != Through::Kafka(Road::Offsets) {
        println!(
            "  {:<22}{:>10}  lookups, {certainly_new} answered \"certainly new\" without the index (filter {filter_state})",
            "Bloom filter", lookups
        );
    }
    match o.through {
        Through::RabbitMq => row("left in the queue", left, "messages; each delivery acknowledged after its COMMIT"),
        Through::Kafka(Road::Ids) => {
            row("left unfinished", left, "records past the group's committed offsets, as the broker has them")
        }
        Through::Kafka(Road::Offsets) => {
            row("left unfinished", left, "records past the stored positions, as dedup.position() has them")
        }
        Through::Memory => {}
    }
    println!();
    // Every event applied once but those parked, and the poison parked (a good event is parked only if its
    // consumers died MAX_ATTEMPTS times on it: possible at high crash rates, and then not applied, as it should).
    let poison_parked = poison.as_ref().is_none_or(|p| parked.iter().any(|(id, _)| *id == p.id));
    let ok = ledger.ok() && load(&tally.applied) == (o.events - good_parked) as u64 && left == 0 && poison_parked;
    if ok {
        println!("  OK: ledger total {} equals the exactly-once total; all {ACCOUNTS} balances match.", ledger.total);
    } else {
        println!(
            "  FAILED: ledger total {}, exactly-once total {}, {} balances differ, {} events applied of {}, {} left, \
             poison parked: {poison_parked}",
            ledger.total,
            ledger.expected_total,
            ledger.mismatched.len(),
            load(&tally.applied),
            o.events - good_parked,
            left
        );
    }
    drop(admin);
    let broker = match o.through {
        Through::Memory => "",
        Through::RabbitMq => " and RabbitMQ node",
        Through::Kafka(_) => " and Kafka broker",
    };
    drop(node);
    drop(tansu);
    cluster.destroy();
    println!("  throwaway cluster{broker} stopped and removed.");
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
            ("parked", load(&tally.parked), 1),
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
        kafka: None,
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
            ("parked", load(&tally.parked), 1),
        ])
    };
    let left = with_progress(line, || run.run(&traffic, tally));
    Replayed {
        published: load(&traffic.published),
        delivered: load(&traffic.delivered),
        redelivered: load(&traffic.redelivered),
        seconds: replay.elapsed().as_secs_f64(),
        left: left.into(),
        kafka: None,
    }
}

/// The Kafka-protocol broker: a producer, and a group of member processes (replay::kafka), this program again.
fn through_kafka(o: &Options, cluster: &Cluster, tansu: &Tansu, stream: &[Event], tally: &Tally) -> Replayed {
    let Through::Kafka(road) = o.through else { unreachable!("through_kafka without --kafka") };
    let (bootstrap, postgres) = (tansu.bootstrap(), cluster.conn_string("demo", "postgres"));
    let program = kafka::Program {
        path: std::env::current_exe().expect("the demo's own path"),
        args: vec!["--kafka-member".to_owned()],
    };
    let (members, batch, crash_rate, seed) = (o.consumers, o.batch, o.crash_rate, o.seed.wrapping_add(1));
    let run = kafka::Run {
        road,
        program: &program,
        members,
        batch,
        crash_rate,
        seed,
        bootstrap: &bootstrap,
        postgres: &postgres,
        stream,
    };
    let t = kafka::Traffic::default();
    let started = Instant::now();
    let names = ["delivered", "re-read", "rebalances", "dropped", "applied", "crashes"];
    let counters = [&t.delivered, &t.reread, &t.rebalances, &tally.duplicates, &tally.applied, &tally.crashes];
    let left = with_progress(
        || progress_line(&names.into_iter().zip(counters).map(|(name, c)| (name, count(c), 5)).collect::<Vec<_>>()),
        || run.run(&t, tally),
    );
    let kafka = KafkaFigures {
        rebalances: count(&t.rebalances),
        deaths: t.deaths.each_ref().map(count),
        refused_commits: count(&t.refused_commits),
        transactions: count(&t.transactions),
        transaction_micros: count(&t.transaction_micros),
        offset_commit_micros: count(&t.offset_commit_micros),
    };
    let (published, delivered, redelivered) = (count(&t.published), count(&t.delivered), count(&t.reread));
    let seconds = started.elapsed().as_secs_f64();
    Replayed { published, delivered, redelivered, seconds, left: left as u64, kafka: Some(kafka) }
}

fn count(counter: &AtomicU64) -> u64 {
    counter.load(Ordering::Relaxed)
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
