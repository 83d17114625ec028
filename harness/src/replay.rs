//! The at-least-once replay shared by `make demo` and the consumer chaos test (tests/chaos.rs): payment events, a
//! producer that publishes some of them twice, the inbox-pattern consumer step (`dedup.mark()` + a balance update
//! in one transaction), the points where a consumer can die, and the exactly-once check of the ledger. The demo's
//! consumers also count delivery attempts (`dedup.attempt()`) and park a poison event, one the ledger refuses on
//! every delivery, in a dead-letter table after [`MAX_ATTEMPTS`] ([`apply_or_park`]).
//!
//! Everything above [`Broker`] is independent of the broker; [`Broker`] is the in-memory one the demo uses by
//! default, [`amqp`] runs the same replay through a real RabbitMQ (`demo --rabbitmq`) and [`kafka`] through a
//! Kafka-protocol broker (`demo --kafka`).

use postgres::Client;
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// The random generator the functions below take, re-exported so that callers need no dependency of their own.
pub use fastrand::Rng;

pub mod amqp;
pub mod kafka;

/// Accounts in the ledger, numbered 1 to `ACCOUNTS`.
pub const ACCOUNTS: i32 = 20;

#[derive(Clone, Debug, PartialEq)]
pub struct Event {
    pub id: String,
    pub account: i32,
    pub amount: i64,
}

/// Where a consumer dies, if it dies while handling a delivery.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Crash {
    BeforeMark,
    AfterMark,
    BeforeCommit,
    AfterCommitBeforeAck,
}

impl Crash {
    pub const ALL: [Crash; 4] = [Crash::BeforeMark, Crash::AfterMark, Crash::BeforeCommit, Crash::AfterCommitBeforeAck];

    /// With probability `rate`, one of the four points, each as likely.
    pub fn pick(rng: &mut Rng, rate: f64) -> Option<Crash> {
        (rng.f64() < rate).then(|| Crash::ALL[rng.usize(..Crash::ALL.len())])
    }

    pub fn name(self) -> &'static str {
        match self {
            Crash::BeforeMark => "before-mark",
            Crash::AfterMark => "after-mark",
            Crash::BeforeCommit => "before-commit",
            Crash::AfterCommitBeforeAck => "after-commit",
        }
    }

    pub fn from_name(name: &str) -> Option<Crash> {
        Crash::ALL.into_iter().find(|c| c.name() == name)
    }
}

impl Event {
    /// A delivery as one line of text, `id account amount [crash point]`: how the chaos test feeds its consumer
    /// processes.
    pub fn to_line(&self, crash: Option<Crash>) -> String {
        let line = format!("{} {} {}", self.id, self.account, self.amount);
        match crash {
            Some(c) => format!("{line} {}", c.name()),
            None => line,
        }
    }

    /// The inverse of [`Event::to_line`]; None for anything else.
    pub fn from_line(line: &str) -> Option<(Event, Option<Crash>)> {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let crash = match fields.len() {
            3 => None,
            4 => Some(Crash::from_name(fields[3])?),
            _ => return None,
        };
        let (account, amount) = (fields[1].parse().ok()?, fields[2].parse().ok()?);
        Some((Event { id: fields[0].to_owned(), account, amount }, crash))
    }
}

/// `count` distinct payment events, `<prefix>-000000` upwards, on random accounts.
pub fn events(prefix: &str, count: usize, rng: &mut Rng) -> Vec<Event> {
    (0..count)
        .map(|i| Event { id: format!("{prefix}-{i:06}"), account: rng.i32(1..=ACCOUNTS), amount: rng.i64(1..=500) })
        .collect()
}

/// What the producer publishes: every event once, and each with probability `duplicate_rate` a second time at a
/// random later or earlier position (a retry after a lost publisher confirm).
pub fn publish(events: &[Event], duplicate_rate: f64, rng: &mut Rng) -> Vec<Event> {
    let mut stream = events.to_vec();
    for e in events {
        if rng.f64() < duplicate_rate {
            stream.insert(rng.usize(..=stream.len()), e.clone());
        }
    }
    stream
}

/// Failed deliveries of one event after which [`apply_or_park`] gives up on it and parks it.
pub const MAX_ATTEMPTS: i32 = 5;

/// A poison event: a payment the ledger refuses on every delivery, since it would take account 1 below zero
/// (the `CHECK` of `accounts`). Its consumer's transaction fails each time, and the broker redelivers it.
pub fn poison(prefix: &str) -> Event {
    Event { id: format!("{prefix}-poison"), account: 1, amount: -1_000_000_000 }
}

/// Creates the ledger (`accounts`, every balance 0 and never below), the table where consumers park what they
/// give up on (`dead_letters`) and the inbox `payments` in the connected database.
pub fn prepare(db: &mut Client) -> Result<(), postgres::Error> {
    db.batch_execute(&format!(
        "CREATE TABLE accounts (id int PRIMARY KEY, balance bigint NOT NULL DEFAULT 0 CHECK (balance >= 0));
         INSERT INTO accounts (id) SELECT generate_series(1, {ACCOUNTS});
         CREATE TABLE dead_letters (id text PRIMARY KEY, account int NOT NULL, amount bigint NOT NULL,
                                    attempts int NOT NULL, parked_at timestamptz NOT NULL DEFAULT now());
         SELECT dedup.create_inbox('payments', '1 day');"
    ))
}

/// The events parked in `dead_letters`, with the attempt that parked each, by id.
pub fn parked(db: &mut Client) -> Result<Vec<(String, i32)>, postgres::Error> {
    let rows = db.query("SELECT id, attempts FROM dead_letters ORDER BY id", &[])?;
    Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
}

/// The consumer's statements, shared by [`apply`] and its async twin in [`amqp`].
pub mod sql {
    /// Claims the event id in the inbox `payments`: true the first time it is seen.
    pub const MARK: &str = "SELECT dedup.mark($1, NULL, 'payments')";
    /// Counts a delivery attempt of the event id: 1 the first time, and kept when the transaction rolls back.
    pub const ATTEMPT: &str = "SELECT dedup.attempt($1, 'payments')";
    /// Parks an event ($1 id, $2 account, $3 amount, $4 the attempt that gave up) instead of applying it.
    pub const PARK: &str = "INSERT INTO dead_letters (id, account, amount, attempts) VALUES ($1, $2, $3, $4)";
    /// Applies a payment ($1 account, $2 amount): run only when the mark was new.
    pub const CREDIT: &str = "UPDATE accounts SET balance = balance + $2 WHERE id = $1";
    /// Claims a batch's ids ($1 text[]): returns those seen for the first time, each once.
    pub const MARK_MANY: &str = "SELECT dedup.mark_many($1, NULL, 'payments')";
    /// Moves position key $1 forward to $2: true when $2 is beyond the stored position.
    pub const ADVANCE: &str = "SELECT dedup.advance($1, $2, 'payments')";
    /// Locks a batch's accounts ($1 int[]) in the order of their ids. Two batches that update the same accounts
    /// in different orders deadlock; locked in one order, the second waits for the first.
    pub const LOCK_ACCOUNTS: &str = "SELECT id FROM accounts WHERE id = ANY($1) ORDER BY id FOR UPDATE";
    /// Applies a batch of payments ($1 accounts, $2 amounts) in one statement: summed per account first, since
    /// UPDATE ... FROM applies only one of several source rows that match the same account.
    pub const CREDIT_MANY: &str = "UPDATE accounts a SET balance = a.balance + d.amount \
         FROM (SELECT account, sum(amount)::bigint AS amount FROM unnest($1::int[], $2::bigint[]) AS t(account, amount) \
               GROUP BY account) d \
         WHERE a.id = d.account";
}

/// What [`apply_or_park`] did with a delivery it got to the end of.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// New, and applied: committed.
    Applied,
    /// Marked before: dropped, committed.
    Duplicate,
    /// New, but it had failed [`MAX_ATTEMPTS`] times: marked and parked in `dead_letters` instead, committed.
    Parked,
    /// New, and the ledger refused it: rolled back, for the broker to deliver again.
    Failed,
}

impl Outcome {
    /// What to do with a delivery once its attempt number and its mark are known: the one decision of
    /// [`apply_or_park`] and its async twin in [`amqp`]. The mark is taken first, so that an event already
    /// processed is never parked, and a parked one is parked once.
    pub fn decide(attempt: i32, new: bool) -> Outcome {
        match (new, attempt > MAX_ATTEMPTS) {
            (false, _) => Outcome::Duplicate,
            (true, true) => Outcome::Parked,
            (true, false) => Outcome::Applied,
        }
    }

    /// The outcome of the business write that failed with `error`: [`Outcome::Failed`] when the ledger refused
    /// it (a poison event); any other error is a bug of the replay.
    pub fn refused(error: &postgres::Error) -> Outcome {
        match error.code() {
            Some(&postgres::error::SqlState::CHECK_VIOLATION) => Outcome::Failed,
            _ => panic!("the business write failed: {error}"),
        }
    }
}

/// What tells a consumer that a delivery is new.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Claim<'a> {
    /// Its event id, marked in the inbox: `dedup.mark()`, or `dedup.mark_many()` in a batch.
    Id,
    /// Its position in an ordered stream, such as a Kafka partition's offset: `dedup.advance(key, offset)`. The
    /// offsets of one key come in increasing order, as a partition's do.
    Position { key: &'a str, offset: i64 },
}

/// The consumer's work for one delivery, the inbox way: BEGIN; `dedup.mark()`; the balance update only when the
/// mark was new; COMMIT. Returns whether the event was new. Before each of the first three crash points it asks
/// `dies_at(point)`; on `true` it stops right there and returns `Err(point)`, leaving the transaction open for
/// the caller to abandon. The fourth point, after COMMIT but before the ack, lies between this and the caller's
/// ack. Errors from the server panic: in this replay they are bugs.
pub fn apply(db: &mut Client, event: &Event, dies_at: impl FnMut(Crash) -> bool) -> Result<bool, Crash> {
    apply_as(db, event, Claim::Id, dies_at)
}

/// [`apply`] with the delivery claimed as `claim` says: by its id (`mark()`) or its position (`advance()`).
pub fn apply_as(
    db: &mut Client,
    event: &Event,
    claim: Claim,
    dies_at: impl FnMut(Crash) -> bool,
) -> Result<bool, Crash> {
    transaction(
        db,
        dies_at,
        |db| {
            let row = match claim {
                Claim::Id => db.query_one(sql::MARK, &[&event.id]),
                Claim::Position { key, offset } => db.query_one(sql::ADVANCE, &[&key, &offset]),
            };
            row.expect("claim the delivery").get(0)
        },
        |db, new| {
            if new {
                db.execute(sql::CREDIT, &[&event.account, &event.amount]).expect("update balance");
            }
            Ok(new)
        },
    )
    .map(|done| done.expect("errors panic above"))
}

/// [`apply`] as a consumer that gives up on poison: BEGIN; `dedup.attempt()` (counted even if this transaction
/// rolls back); `dedup.mark()`; then, for a new event, the balance update, or after [`MAX_ATTEMPTS`] failed
/// deliveries a row in `dead_letters` instead; COMMIT. A business write the ledger refuses rolls back
/// ([`Outcome::Failed`]); the crash points are those of [`apply`].
pub fn apply_or_park(db: &mut Client, event: &Event, dies_at: impl FnMut(Crash) -> bool) -> Result<Outcome, Crash> {
    let done = transaction(
        db,
        dies_at,
        |db| {
            let attempt: i32 = db.query_one(sql::ATTEMPT, &[&event.id]).expect("count the attempt").get(0);
            let new: bool = db.query_one(sql::MARK, &[&event.id]).expect("mark").get(0);
            (attempt, Outcome::decide(attempt, new))
        },
        |db, (attempt, outcome)| {
            match outcome {
                Outcome::Applied => db.execute(sql::CREDIT, &[&event.account, &event.amount])?,
                Outcome::Parked => db.execute(sql::PARK, &[&event.id, &event.account, &event.amount, &attempt])?,
                _ => 0,
            };
            Ok(outcome)
        },
    )?;
    Ok(done.unwrap_or_else(|error| Outcome::refused(&error)))
}

/// [`apply`] for a batch of deliveries in one transaction: every claim first (one `mark_many()` for the ids, the
/// positions as [`claim_positions`] says), then one update for all the new payments. Returns which deliveries
/// were new, in order; the crash points are those of [`apply`], once for the whole batch.
pub fn apply_batch(
    db: &mut Client,
    batch: &[(&Event, Claim)],
    dies_at: impl FnMut(Crash) -> bool,
) -> Result<Vec<bool>, Crash> {
    transaction(
        db,
        dies_at,
        |db| {
            let mut new = vec![false; batch.len()];
            let ids: Vec<&str> = batch.iter().filter(|(_, c)| *c == Claim::Id).map(|(e, _)| e.id.as_str()).collect();
            if !ids.is_empty() {
                let rows = db.query(sql::MARK_MANY, &[&ids]).expect("mark_many");
                let mut fresh: HashSet<String> = rows.iter().map(|r| r.get(0)).collect();
                for (i, (event, claim)) in batch.iter().enumerate() {
                    // remove(): only the first occurrence of an id repeated inside the batch is new.
                    new[i] = *claim == Claim::Id && fresh.remove(&event.id);
                }
            }
            claim_positions(db, batch, &mut new);
            new
        },
        |db, new| {
            let (accounts, amounts): (Vec<i32>, Vec<i64>) =
                batch.iter().zip(&new).filter(|(_, &n)| n).map(|((e, _), _)| (e.account, e.amount)).unzip();
            if !accounts.is_empty() {
                db.execute(sql::LOCK_ACCOUNTS, &[&accounts]).expect("lock the accounts");
                db.execute(sql::CREDIT_MANY, &[&accounts, &amounts]).expect("update balances");
            }
            Ok(new)
        },
    )
    .map(|done| done.expect("errors panic above"))
}

/// Claims the batch's positions, key by key in sorted order (so that two consumers claiming the same keys cannot
/// deadlock): `advance()` of each offset in order until one moves the key forward.
/// That one is new, and so is every later offset of the key in the batch, since the stored position lies below
/// it and the row lock that `advance()` now holds keeps every other consumer waiting; a last `advance()` stores
/// the key's last offset. Normally the first offset is ahead: two calls per key and batch, whatever its size.
fn claim_positions(db: &mut Client, batch: &[(&Event, Claim)], new: &mut [bool]) {
    let mut keys: Vec<&str> = Vec::new();
    for (_, claim) in batch {
        if let Claim::Position { key, .. } = claim {
            if !keys.contains(key) {
                keys.push(key);
            }
        }
    }
    let mut advance =
        |key: &str, offset: i64| -> bool { db.query_one(sql::ADVANCE, &[&key, &offset]).expect("advance").get(0) };
    keys.sort_unstable();
    for key in keys {
        let offsets: Vec<(usize, i64)> = batch
            .iter()
            .enumerate()
            .filter_map(|(i, (_, claim))| match claim {
                Claim::Position { key: k, offset } if *k == key => Some((i, *offset)),
                _ => None,
            })
            .collect();
        let Some(first_new) = offsets.iter().position(|&(_, offset)| advance(key, offset)) else { continue };
        for &(i, _) in &offsets[first_new..] {
            new[i] = true;
        }
        let (last, ahead) = (offsets[offsets.len() - 1].1, offsets[first_new].1);
        if last > ahead {
            assert!(advance(key, last), "advance({key}, {last}) under our own row lock was refused");
        }
    }
}

/// BEGIN; `claim`; `credit` with what it claimed; COMMIT; with the crash points of [`apply`] between. When
/// `credit` fails, ROLLBACK instead, and its error is the result.
fn transaction<T, R>(
    db: &mut Client,
    mut dies_at: impl FnMut(Crash) -> bool,
    claim: impl FnOnce(&mut Client) -> T,
    credit: impl FnOnce(&mut Client, T) -> Result<R, postgres::Error>,
) -> Result<Result<R, postgres::Error>, Crash> {
    let mut point = |p| if dies_at(p) { Err(p) } else { Ok(()) };
    point(Crash::BeforeMark)?;
    db.batch_execute("BEGIN").expect("BEGIN");
    let claimed = claim(db);
    point(Crash::AfterMark)?;
    let done = credit(db, claimed);
    if done.is_err() {
        db.batch_execute("ROLLBACK").expect("ROLLBACK");
        return Ok(done);
    }
    point(Crash::BeforeCommit)?;
    db.batch_execute("COMMIT").expect("COMMIT");
    Ok(done)
}

/// A consumer process dies at `point`: it prints `crash <point>` (so whoever runs it knows where) and kills
/// itself with SIGKILL: no rollback, no goodbye to the broker or the database, no exit handlers, like a real crash.
pub fn die(point: Crash) -> ! {
    // stdout is line-buffered: the line is in the pipe before the signal.
    println!("crash {}", point.name());
    // SAFETY: raising a signal has no preconditions; SIGKILL ends the process here.
    unsafe { libc::raise(libc::SIGKILL) };
    unreachable!("SIGKILL returned")
}

/// The ledger compared with the exactly-once effect of `events` (each applied once).
pub struct LedgerCheck {
    pub total: i64,
    pub expected_total: i64,
    /// (account, balance, exactly-once balance) of every account that differs.
    pub mismatched: Vec<(i32, i64, i64)>,
}

impl LedgerCheck {
    pub fn ok(&self) -> bool {
        self.total == self.expected_total && self.mismatched.is_empty()
    }
}

pub fn check_ledger(db: &mut Client, events: &[Event]) -> Result<LedgerCheck, postgres::Error> {
    let mut expected: HashMap<i32, i64> = HashMap::new();
    for e in events {
        *expected.entry(e.account).or_default() += e.amount;
    }
    let mut mismatched = Vec::new();
    for row in db.query("SELECT id, balance FROM accounts ORDER BY id", &[])? {
        let (account, balance): (i32, i64) = (row.get(0), row.get(1));
        let want = expected.get(&account).copied().unwrap_or(0);
        if balance != want {
            mismatched.push((account, balance, want));
        }
    }
    let total: i64 = db.query_one("SELECT coalesce(sum(balance), 0)::bigint FROM accounts", &[])?.get(0);
    Ok(LedgerCheck { total, expected_total: events.iter().map(|e| e.amount).sum(), mismatched })
}

/// An in-memory at-least-once broker: a delivery leaves the queue when it is handed out and comes back unless the
/// consumer acknowledges it.
#[derive(Default)]
pub struct Broker {
    pub queue: Mutex<VecDeque<Event>>,
    pub published: AtomicU64,
    pub delivered: AtomicU64,
    pub redelivered: AtomicU64,
    pub acked: AtomicU64,
}

impl Broker {
    /// A broker holding `stream`, in order.
    pub fn with(stream: Vec<Event>) -> Broker {
        let broker = Broker::default();
        broker.published.store(stream.len() as u64, Ordering::Relaxed);
        broker.queue.lock().unwrap().extend(stream);
        broker
    }

    pub fn next(&self) -> Option<Event> {
        let event = self.queue.lock().unwrap().pop_front();
        if event.is_some() {
            self.delivered.fetch_add(1, Ordering::Relaxed);
        }
        event
    }

    /// Puts back a delivery that was not acknowledged, at the end of the queue.
    pub fn nack(&self, event: Event) {
        self.redelivered.fetch_add(1, Ordering::Relaxed);
        self.queue.lock().unwrap().push_back(event);
    }

    pub fn ack(&self) {
        self.acked.fetch_add(1, Ordering::Relaxed);
    }

    /// Deliveries handed out and neither acknowledged nor put back yet (exact once the consumers are idle).
    pub fn in_flight(&self) -> i64 {
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed) as i64;
        load(&self.delivered) - load(&self.acked) - load(&self.redelivered)
    }
}

/// What consumers saw: events applied, duplicates dropped, crashes; and with [`apply_or_park`] deliveries the
/// ledger refused and events parked.
#[derive(Default)]
pub struct Tally {
    pub duplicates: AtomicU64,
    pub applied: AtomicU64,
    pub crashes: AtomicU64,
    pub failed: AtomicU64,
    pub parked: AtomicU64,
}

impl Tally {
    /// Counts a delivery [`apply_or_park`] got to the end of.
    pub fn count(&self, outcome: Outcome) {
        let counter = match outcome {
            Outcome::Applied => &self.applied,
            Outcome::Duplicate => &self.duplicates,
            Outcome::Parked => &self.parked,
            Outcome::Failed => &self.failed,
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }
}
