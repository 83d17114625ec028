//! The replay through a Kafka-protocol broker (`make demo DEMO_ARGS=--kafka`, tests/kafka.rs): the producer
//! publishes the stream to a topic of [`PARTITIONS`] partitions (keyed by event id, acks from every replica, the
//! idempotent producer on), and a consumer group of member *processes* applies it with [`super::apply_as`] (or
//! [`super::apply_batch`]) on one of two roads:
//!
//! - [`Road::Ids`]: `dedup.mark()` of the event id in the transaction, and the partition's offset committed to
//!   Kafka after COMMIT. A member that dies before the offset commit leaves its records to be read again by the
//!   partition's next owner, which finds their marks.
//! - [`Road::Offsets`]: no offset commits at all. `dedup.advance('<topic>/<partition>', offset)` stores the
//!   offset in the transaction, and on every assignment the member seeks each partition to the stored position
//!   + 1. A re-read record is stale: `advance()` refuses it.
//!
//! A member dies like a crashed process because it is one: at its crash point it SIGKILLs itself (`super::die`),
//! so its Postgres socket closes mid-transaction and the group hears nothing from it. The broker drops it from the
//! group when its session times out (or at the rebalance its replacement's arrival starts), and its partitions
//! go to the survivors: a rebalance. Each place in the group starts a new member when its member dies, so the
//! group stays at its size. The members die at the four crash points in turn: after each death the run tells
//! every member the next point (a line on its stdin).

use super::{apply_as, apply_batch, die, Claim, Crash, Event, Rng, Tally};
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::{ClientContext, DefaultClientContext};
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, ConsumerContext};
use rdkafka::error::KafkaResult;
use rdkafka::message::Message;
use rdkafka::producer::{BaseProducer, BaseRecord, DeliveryResult, Producer, ProducerContext};
use rdkafka::types::RDKafkaRespErr;
use rdkafka::{Offset, TopicPartitionList};
use std::collections::HashSet;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::{ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

pub const TOPIC: &str = "payments";
/// More partitions than members, so that every rebalance moves some.
pub const PARTITIONS: i32 = 6;
pub const GROUP: &str = "ledger";
/// How long the broker waits for a silent member before dropping it from the group. Short, so that a killed
/// member's partitions move on quickly; Tansu holds each join for steps of one second until half of it has
/// passed, and a member waiting in a join sends no heartbeat, so below about a second members time each other out.
const SESSION_TIMEOUT_MS: u32 = 1500;
const HEARTBEAT_MS: u32 = 300;
/// A run in which no record is finished for this long is stuck: it fails rather than hang.
const STALL: Duration = Duration::from_secs(60);

/// How the group knows what it has applied.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Road {
    /// `dedup.mark()` of the event id, the offset committed to Kafka after COMMIT.
    Ids,
    /// `dedup.advance()` of the partition's offset in the transaction, no offset commits.
    Offsets,
}

impl Road {
    pub fn name(self) -> &'static str {
        match self {
            Road::Ids => "ids",
            Road::Offsets => "offsets",
        }
    }

    fn from_name(name: &str) -> Option<Road> {
        [Road::Ids, Road::Offsets].into_iter().find(|r| r.name() == name)
    }
}

/// The `advance()` key of a partition: `<topic>/<partition>`.
pub fn position_key(partition: i32) -> String {
    format!("{TOPIC}/{partition}")
}

/// What went through the broker, counted as it happens.
#[derive(Default)]
pub struct Traffic {
    /// Records the broker acknowledged.
    pub published: AtomicU64,
    /// Records handed to members, and those of them that some member had been handed before.
    pub delivered: AtomicU64,
    pub reread: AtomicU64,
    /// Times the group stopped to reassign its partitions (a member was joining or had its partitions revoked).
    pub rebalances: AtomicU64,
    /// Members killed, by crash point (in `Crash::ALL` order).
    pub deaths: [AtomicU64; 4],
    /// Offset commits the broker refused because the group had moved on (Road::Ids).
    pub refused_commits: AtomicU64,
    /// Transactions that committed, and the time members spent in them and in committing offsets.
    pub transactions: AtomicU64,
    pub transaction_micros: AtomicU64,
    pub offset_commit_micros: AtomicU64,
}

/// How to start a member process: a program whose `main` calls [`member_main`] with the arguments after these.
pub struct Program {
    pub path: PathBuf,
    pub args: Vec<String>,
}

/// One replay: which road, how members start and behave, where they connect, and what is published.
pub struct Run<'a> {
    pub road: Road,
    pub program: &'a Program,
    pub members: usize,
    /// Records a member applies per transaction, at most (1: one transaction per record).
    pub batch: usize,
    /// The chance that a member dies in a transaction, and the seed of those chances.
    pub crash_rate: f64,
    pub seed: u64,
    /// The broker's `bootstrap.servers` and the Postgres connection string of the ledger's database.
    pub bootstrap: &'a str,
    pub postgres: &'a str,
    pub stream: &'a [Event],
}

/// What a place in the group learns from its member's lines.
struct Group {
    /// The next offset of each partition once everything is published, and how far members have finished (offset
    /// committed, or position stored).
    end: Option<Vec<i64>>,
    finished_to: Vec<i64>,
    delivered: HashSet<(i32, i64)>,
    /// The records of each place's last transaction, (partition, offset): finished once their offsets commit.
    applied: Vec<Vec<(usize, i64)>>,
    /// The places whose member has no assignment yet (joining) or had it revoked: a rebalance is under way.
    unassigned: HashSet<usize>,
    /// The members' stdin: the crash point to die at is written there, and it is closed to tell them to leave.
    stdins: Vec<Option<ChildStdin>>,
    /// The crash point of the next death (an index into `Crash::ALL`).
    point: usize,
    done: bool,
    progress: Instant,
}

impl Group {
    fn all_finished(&self) -> bool {
        self.end.as_ref().is_some_and(|end| end.iter().zip(&self.finished_to).all(|(e, f)| f >= e))
    }

    /// The records of `place`'s last transaction are finished (their offsets committed, or positions stored).
    fn finish(&mut self, place: usize) {
        for (partition, offset) in std::mem::take(&mut self.applied[place]) {
            self.finished_to[partition] = self.finished_to[partition].max(offset + 1);
        }
        self.progress = Instant::now();
    }

    /// Tells the members where the next of them is to die.
    fn next_point(&mut self) {
        self.point = (self.point + 1) % Crash::ALL.len();
        let line = format!("{}\n", Crash::ALL[self.point].name());
        // A member that cannot read it is dying: its place notices.
        self.stdins.iter_mut().flatten().for_each(|stdin| drop(stdin.write_all(line.as_bytes())));
    }

    /// Sends every member away (it leaves the group cleanly and exits) and lets no new one start.
    fn dismiss(&mut self) {
        self.done = true;
        self.stdins.iter_mut().for_each(|s| drop(s.take()));
    }
}

impl Run<'_> {
    /// Creates the topic, starts the members, publishes the stream and waits until every record is finished; then
    /// returns how many records lie beyond what the group has finished, as the broker (Road::Ids: the group's
    /// committed offsets) or the database (Road::Offsets: the stored positions) says. 0 unless a record was lost.
    pub fn run(&self, traffic: &Traffic, tally: &Tally) -> i64 {
        create_topic(self.bootstrap);
        let group = Mutex::new(Group {
            end: None,
            finished_to: vec![0; PARTITIONS as usize],
            delivered: HashSet::new(),
            applied: vec![Vec::new(); self.members],
            unassigned: HashSet::new(),
            stdins: (0..self.members).map(|_| None).collect(),
            point: 0,
            done: self.stream.is_empty(),
            progress: Instant::now(),
        });
        let changed = Condvar::new();
        std::thread::scope(|s| {
            /// However the run ends (a panic included), the members are told to leave, so the places return.
            struct Dismiss<'a>(&'a Mutex<Group>);
            impl Drop for Dismiss<'_> {
                fn drop(&mut self) {
                    self.0.lock().unwrap_or_else(|e| e.into_inner()).dismiss();
                }
            }
            let _dismiss = Dismiss(&group);
            let places: Vec<_> = (0..self.members)
                .map(|place| {
                    let (group, changed) = (&group, &changed);
                    s.spawn(move || self.place(place, group, changed, traffic, tally))
                })
                .collect();
            let end = produce(self.bootstrap, self.stream, |e| e.to_line(None));
            traffic.published.store(self.stream.len() as u64, Ordering::Relaxed);
            let mut g = group.lock().unwrap();
            g.end = Some(end);
            while !g.done && !g.all_finished() {
                let (finished, end) = (&g.finished_to, g.end.as_ref().unwrap());
                assert!(
                    g.progress.elapsed() < STALL,
                    "no record finished in {STALL:?}: partitions at {finished:?} of {end:?}"
                );
                g = changed.wait_timeout(g, Duration::from_secs(1)).unwrap().0;
            }
            g.dismiss();
            drop(g);
            for place in places {
                if let Err(panic) = place.join() {
                    std::panic::resume_unwind(panic);
                }
            }
        });
        let end = group.into_inner().unwrap().end.expect("the end offsets");
        let finished = match self.road {
            Road::Ids => committed_offsets(self.bootstrap),
            Road::Offsets => stored_positions(self.postgres),
        };
        end.iter().zip(&finished).map(|(e, f)| (e - f).max(0)).sum()
    }

    /// A place in the group: starts a member, follows its lines, and starts another when it dies, until the group
    /// is dismissed.
    fn place(&self, place: usize, group: &Mutex<Group>, changed: &Condvar, traffic: &Traffic, tally: &Tally) {
        let mut rng = Rng::with_seed(self.seed.wrapping_add(place as u64));
        loop {
            let mut child = Command::new(&self.program.path)
                .args(&self.program.args)
                .args([self.bootstrap, self.postgres, self.road.name()])
                .args([self.batch.to_string(), self.crash_rate.to_string(), rng.u64(..).to_string()])
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("start a group member");
            {
                let mut g = group.lock().unwrap();
                let mut stdin = child.stdin.take().unwrap();
                g.applied[place].clear();
                if !g.done {
                    let _ = stdin.write_all(format!("{}\n", Crash::ALL[g.point].name()).as_bytes());
                    g.stdins[place] = Some(stdin);
                    note_unassigned(&mut g, place, traffic);
                }
            }
            let mut stderr = child.stderr.take().unwrap();
            let errors = std::thread::spawn(move || {
                let mut text = String::new();
                let _ = stderr.read_to_string(&mut text);
                text
            });
            for line in BufReader::new(child.stdout.take().unwrap()).lines() {
                let line = line.expect("read a member's line");
                self.follow(place, &line, group, changed, traffic, tally);
            }
            let status = child.wait().expect("wait for a member");
            let errors = errors.join().unwrap_or_default();
            let mut g = group.lock().unwrap();
            g.unassigned.remove(&place);
            g.stdins[place] = None;
            if status.signal() == Some(libc::SIGKILL) {
                // Its last line said where (`crash <point>`, counted in follow()).
                tally.crashes.fetch_add(1, Ordering::Relaxed);
                if g.done {
                    return;
                }
                g.next_point();
                continue;
            }
            assert!(status.success() && g.done, "a group member failed ({status}):\n{errors}");
            return;
        }
    }

    /// One line of a member (see [`member_main`]).
    fn follow(
        &self,
        place: usize,
        line: &str,
        group: &Mutex<Group>,
        changed: &Condvar,
        traffic: &Traffic,
        tally: &Tally,
    ) {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let mut g = group.lock().unwrap();
        match fields[..] {
            ["assigned", ..] => {
                g.unassigned.remove(&place);
            }
            ["revoked"] => note_unassigned(&mut g, place, traffic),
            ["delivered", partition, offset] => {
                traffic.delivered.fetch_add(1, Ordering::Relaxed);
                if !g.delivered.insert((number(partition), number(offset))) {
                    traffic.reread.fetch_add(1, Ordering::Relaxed);
                }
            }
            ["crash", point] => {
                let point = Crash::from_name(point).expect("a crash point");
                let i = Crash::ALL.iter().position(|&c| c == point).unwrap();
                traffic.deaths[i].fetch_add(1, Ordering::Relaxed);
            }
            ["applied", transaction_us, ref records @ ..] => {
                traffic.transactions.fetch_add(1, Ordering::Relaxed);
                traffic.transaction_micros.fetch_add(number(transaction_us), Ordering::Relaxed);
                g.applied[place].clear();
                for record in records {
                    let mut parts = record.split(':');
                    let (partition, offset) = (number(parts.next().unwrap()), number(parts.next().unwrap()));
                    let counter = if parts.next() == Some("new") { &tally.applied } else { &tally.duplicates };
                    counter.fetch_add(1, Ordering::Relaxed);
                    g.applied[place].push((partition, offset));
                }
                // On Road::Offsets the COMMIT stored the positions: the records are finished, even if the member
                // dies before its `finished` line (its partitions' next owner starts after them).
                if self.road == Road::Offsets {
                    g.finish(place);
                    changed.notify_all();
                }
            }
            ["finished", commit_us, committed] => {
                traffic.offset_commit_micros.fetch_add(number(commit_us), Ordering::Relaxed);
                if committed != "committed" {
                    traffic.refused_commits.fetch_add(1, Ordering::Relaxed);
                    return;
                }
                g.finish(place);
                changed.notify_all();
            }
            _ => panic!("unexpected line from a group member: {line:?}"),
        }
    }
}

/// A member without partitions: when it is the first, a rebalance begins.
fn note_unassigned(g: &mut Group, place: usize, traffic: &Traffic) {
    if g.unassigned.is_empty() {
        traffic.rebalances.fetch_add(1, Ordering::Relaxed);
    }
    g.unassigned.insert(place);
}

fn number<T: std::str::FromStr>(field: &str) -> T {
    field.parse().unwrap_or_else(|_| panic!("not a number in a member's line: {field:?}"))
}

/// Creates the topic, [`PARTITIONS`] partitions (a broker of one: one replica).
pub fn create_topic(bootstrap: &str) {
    let admin: AdminClient<DefaultClientContext> =
        ClientConfig::new().set("bootstrap.servers", bootstrap).create().expect("a Kafka admin client");
    let topic = NewTopic::new(TOPIC, PARTITIONS, TopicReplication::Fixed(1));
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a tokio runtime");
    let results = runtime.block_on(admin.create_topics([&topic], &AdminOptions::new())).expect("create the topic");
    for result in results {
        result.unwrap_or_else(|(topic, e)| panic!("create topic {topic}: {e}"));
    }
}

/// Counts the records the broker acknowledged and keeps the end offset of each partition.
#[derive(Default)]
struct Deliveries {
    acknowledged: AtomicU64,
    end: Mutex<Vec<i64>>,
    failed: Mutex<Option<String>>,
}

impl ClientContext for Deliveries {}

impl ProducerContext for Deliveries {
    type DeliveryOpaque = ();

    fn delivery(&self, result: &DeliveryResult<'_>, _: ()) {
        match result {
            Ok(record) => {
                self.acknowledged.fetch_add(1, Ordering::Relaxed);
                let mut end = self.end.lock().unwrap();
                let partition = record.partition() as usize;
                end[partition] = end[partition].max(record.offset() + 1);
            }
            Err((e, _)) => *self.failed.lock().unwrap() = Some(e.to_string()),
        }
    }
}

/// The producer: each record keyed by its event id (so a retry lands in the event's partition), acknowledged by
/// every in-sync replica, with the idempotent producer on (the broker drops the client library's own resends).
/// The stream's retries are the application's: records of their own, which no producer setting removes. Each
/// record's value is `payload(event)`. Returns once the broker acknowledged every record, with the end offset of
/// each partition.
pub fn produce(bootstrap: &str, stream: &[Event], payload: impl Fn(&Event) -> String) -> Vec<i64> {
    let context = Deliveries { end: Mutex::new(vec![0; PARTITIONS as usize]), ..Default::default() };
    let producer: BaseProducer<Deliveries> = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("acks", "all")
        .set("enable.idempotence", "true")
        .set("linger.ms", "5")
        .create_with_context(context)
        .expect("a Kafka producer");
    for event in stream {
        let payload = payload(event);
        let mut record = BaseRecord::to(TOPIC).key(event.id.as_str()).payload(payload.as_str());
        loop {
            match producer.send(record) {
                Ok(()) => break,
                // The local queue is full: serve delivery reports, then try again.
                Err((_, back)) => {
                    record = back;
                    producer.poll(Duration::from_millis(10));
                }
            }
        }
        producer.poll(Duration::ZERO);
    }
    producer.flush(Duration::from_secs(60)).expect("flush the producer");
    let context = producer.context();
    if let Some(e) = context.failed.lock().unwrap().take() {
        panic!("the broker refused a record: {e}");
    }
    assert_eq!(context.acknowledged.load(Ordering::Relaxed), stream.len() as u64, "records acknowledged");
    let end = context.end.lock().unwrap().clone();
    end
}

/// The group's committed offset of each partition (0 where none), as the broker has it.
fn committed_offsets(bootstrap: &str) -> Vec<i64> {
    let consumer: BaseConsumer =
        ClientConfig::new().set("bootstrap.servers", bootstrap).set("group.id", GROUP).create().expect("a consumer");
    let mut partitions = TopicPartitionList::new();
    for p in 0..PARTITIONS {
        partitions.add_partition(TOPIC, p);
    }
    let committed = consumer.committed_offsets(partitions, Duration::from_secs(10)).expect("the committed offsets");
    (0..PARTITIONS)
        .map(|p| match committed.find_partition(TOPIC, p).map(|e| e.offset()) {
            Some(Offset::Offset(o)) => o,
            _ => 0,
        })
        .collect()
}

/// The next offset of each partition after its stored position, as the database has it.
fn stored_positions(postgres: &str) -> Vec<i64> {
    let mut db = postgres::Client::connect(postgres, postgres::NoTls).expect("connect to Postgres");
    (0..PARTITIONS)
        .map(|p| {
            let row = db.query_one("SELECT dedup.position($1, 'payments')", &[&position_key(p)]).expect("position()");
            row.get::<_, Option<i64>>(0).map_or(0, |position| position + 1)
        })
        .collect()
}

/// A member's view of rebalances: on Road::Offsets it starts each assigned partition after its stored position.
struct Member {
    road: Road,
    db: Mutex<postgres::Client>,
}

impl ClientContext for Member {}

impl ConsumerContext for Member {
    /// The eager protocol's two events: every partition revoked, then the new assignment (taken as it is on
    /// Road::Ids, where it starts at the group's committed offsets; on Road::Offsets each partition starts at
    /// `dedup.position() + 1`, or at the beginning when it has none).
    fn rebalance(&self, consumer: &BaseConsumer<Self>, event: RDKafkaRespErr, partitions: &mut TopicPartitionList) {
        if event != RDKafkaRespErr::RD_KAFKA_RESP_ERR__ASSIGN_PARTITIONS {
            consumer.unassign().expect("unassign");
            println!("revoked");
            return;
        }
        if self.road == Road::Offsets {
            let mut db = self.db.lock().unwrap();
            for p in 0..PARTITIONS {
                if partitions.find_partition(TOPIC, p).is_some() {
                    let row = db.query_one("SELECT dedup.position($1, 'payments')", &[&position_key(p)]).unwrap();
                    let start = row.get::<_, Option<i64>>(0).map_or(Offset::Beginning, |o| Offset::Offset(o + 1));
                    partitions.set_partition_offset(TOPIC, p, start).expect("set a start offset");
                }
            }
        }
        consumer.assign(partitions).expect("assign");
        let assigned: Vec<String> = partitions.elements().iter().map(|e| e.partition().to_string()).collect();
        println!("assigned {}", assigned.join(","));
    }
}

/// A group member's process: `<program> BOOTSTRAP POSTGRES ROAD BATCH CRASH_RATE SEED`. It joins the group,
/// applies what it is given, `BATCH` records at most per transaction, and with probability `CRASH_RATE` per
/// transaction dies at the crash point last named on its stdin (one name a line). It leaves the group and exits
/// when its stdin closes. Its lines on stdout:
///
/// - `assigned P,P,...` and `revoked`: the rebalance events;
/// - `delivered P O`: the record at offset O of partition P was handed to it;
/// - `applied TRANSACTION_US P:O:new|dup ...`: a transaction committed (in that many microseconds), with whether
///   each record was new;
/// - `finished COMMIT_US committed|refused`: then its offsets were committed to the broker, or refused (Road::Ids;
///   Road::Offsets has none to commit and says `committed` at once);
/// - `crash POINT`: its last line.
pub fn member_main(args: impl Iterator<Item = String>) {
    let args: Vec<String> = args.collect();
    let usage = "usage: BOOTSTRAP POSTGRES ROAD BATCH CRASH_RATE SEED";
    let [bootstrap, postgres, road, batch, crash_rate, seed] = &args[..] else { panic!("{usage}") };
    let road = Road::from_name(road).expect(usage);
    let (batch, crash_rate): (usize, f64) = (batch.parse().expect(usage), crash_rate.parse().expect(usage));
    let mut rng = Rng::with_seed(seed.parse().expect(usage));
    let db = postgres::Client::connect(postgres, postgres::NoTls).expect("connect to Postgres");
    let consumer: BaseConsumer<Member> = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", GROUP)
        .set("enable.auto.commit", "false")
        .set("auto.offset.reset", "earliest")
        .set("session.timeout.ms", SESSION_TIMEOUT_MS.to_string())
        .set("heartbeat.interval.ms", HEARTBEAT_MS.to_string())
        // The eager protocol: a rebalance revokes every partition, then assigns anew.
        .set("partition.assignment.strategy", "range")
        .create_with_context(Member { road, db: Mutex::new(db) })
        .expect("a Kafka consumer");
    consumer.subscribe(&[TOPIC]).expect("subscribe");
    let (leave, point) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicUsize::new(NO_POINT)));
    let (stdin_closed, told) = (leave.clone(), point.clone());
    std::thread::spawn(move || {
        for line in std::io::stdin().lock().lines().map_while(Result::ok) {
            let named = Crash::ALL.iter().position(|c| c.name() == line).expect("a crash point on stdin");
            told.store(named, Ordering::Relaxed);
        }
        stdin_closed.store(true, Ordering::Relaxed);
    });
    while !leave.load(Ordering::Relaxed) {
        let records = poll_batch(&consumer, batch);
        if records.is_empty() {
            continue;
        }
        for (partition, offset, _) in &records {
            println!("delivered {partition} {offset}");
        }
        let point = Crash::ALL.get(point.load(Ordering::Relaxed)).copied();
        let dies = rng.f64() < crash_rate && point.is_some();
        let point = point.unwrap_or(Crash::BeforeMark);
        let dies_at = |p: Crash| {
            if dies && p == point {
                die(p)
            }
            false
        };
        let keys: Vec<String> = records.iter().map(|(partition, _, _)| position_key(*partition)).collect();
        let claims: Vec<(&Event, Claim)> = records
            .iter()
            .zip(&keys)
            .map(|((_, offset, event), key)| match road {
                Road::Ids => (event, Claim::Id),
                Road::Offsets => (event, Claim::Position { key, offset: *offset }),
            })
            .collect();
        let started = Instant::now();
        let new = {
            let mut db = consumer.context().db.lock().unwrap();
            if batch == 1 {
                vec![apply_as(&mut db, claims[0].0, claims[0].1, dies_at).expect("told never to stop")]
            } else {
                apply_batch(&mut db, &claims, dies_at).expect("told never to stop")
            }
        };
        let transaction_us = started.elapsed().as_micros();
        let outcomes: Vec<String> = records
            .iter()
            .zip(new)
            .map(|((partition, offset, _), new)| format!("{partition}:{offset}:{}", if new { "new" } else { "dup" }))
            .collect();
        println!("applied {transaction_us} {}", outcomes.join(" "));
        if dies && point == Crash::AfterCommitBeforeAck {
            die(point)
        }
        let started = Instant::now();
        let committed = road == Road::Offsets || commit_offsets(&consumer, &records).is_ok();
        let commit_us = started.elapsed().as_micros();
        println!("finished {commit_us} {}", if committed { "committed" } else { "refused" });
    }
    // Dropping the consumer closes it: it leaves the group, so the others rebalance at once.
    drop(consumer);
}

/// A member told no crash point yet does not die.
const NO_POINT: usize = usize::MAX;

/// Up to `batch` records: waits for the first (up to 100 ms, serving rebalances meanwhile), then takes what the
/// client has already fetched. Each as (partition, offset, event).
fn poll_batch(consumer: &BaseConsumer<Member>, batch: usize) -> Vec<(i32, i64, Event)> {
    let mut records = Vec::new();
    let mut wait = Duration::from_millis(100);
    while records.len() < batch {
        let Some(polled) = consumer.poll(wait) else { break };
        // A broker error (a connection reset during a rebalance, say) is the client's to recover from: apply what
        // we have.
        let Ok(message) = polled else { break };
        let body = message.payload().and_then(|p| std::str::from_utf8(p).ok());
        let (event, _) = body.and_then(Event::from_line).expect("a payment event");
        records.push((message.partition(), message.offset(), event));
        wait = Duration::ZERO;
    }
    records
}

/// Commits, for each partition of the batch, the offset after its last record (Road::Ids). The broker refuses it
/// when the group has rebalanced since this member's generation began: the records are then read again by the
/// partition's new owner, which finds their marks.
fn commit_offsets(consumer: &BaseConsumer<Member>, records: &[(i32, i64, Event)]) -> KafkaResult<()> {
    let mut offsets = TopicPartitionList::new();
    for (partition, offset, _) in records {
        // Records of a partition come in order: the last one's offset stays.
        let next = Offset::Offset(offset + 1);
        if offsets.find_partition(TOPIC, *partition).is_some() {
            offsets.set_partition_offset(TOPIC, *partition, next)?;
        } else {
            offsets.add_partition_offset(TOPIC, *partition, next)?;
        }
    }
    consumer.commit(&offsets, CommitMode::Sync)
}
