//! The replay through a real broker (`make demo DEMO_ARGS=--rabbitmq`, tests/rabbitmq.rs): the producer publishes
//! the stream to a durable queue as persistent messages and waits for the broker's publisher confirms; consumers
//! take deliveries with a small prefetch, apply each the inbox way over tokio-postgres (the statements of
//! [`super::apply_or_park`]: a poison event is parked after [`super::MAX_ATTEMPTS`]) and acknowledge only after
//! COMMIT; a delivery the ledger refused is rejected back into the queue.
//!
//! Each consumer lives like a process: its own AMQP connection and Postgres connection. When it dies at a crash
//! point its Postgres socket closes mid-transaction (the server rolls the transaction back) and its AMQP connection
//! goes away without acknowledging: RabbitMQ puts every delivery it had not acknowledged back in the queue, flagged
//! `redelivered`, and a new consumer takes its place.

use super::{sql, Crash, Event, Outcome, Rng, Tally};
use futures_util::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicPublishOptions, BasicQosOptions, ConfirmSelectOptions,
    QueueDeclareOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tokio::sync::watch;

pub const QUEUE: &str = "payments";
/// Deliveries a consumer may hold unacknowledged: small, so that a dying consumer gives back little.
pub const PREFETCH: u16 = 8;
/// Messages published between waits for their confirms.
const CONFIRM_BATCH: usize = 100;
/// A run that acknowledges nothing for this long is stuck: it fails rather than hang.
const STALL: Duration = Duration::from_secs(60);

/// What went through the broker, counted by the producer and the consumers as it happens.
#[derive(Default)]
pub struct Traffic {
    /// Messages the broker confirmed.
    pub published: AtomicU64,
    /// Deliveries consumers took, and those of them RabbitMQ flagged `redelivered`.
    pub delivered: AtomicU64,
    pub redelivered: AtomicU64,
    pub acked: AtomicU64,
}

/// One replay: where to connect, what to publish, and how the consumers behave.
pub struct Run<'a> {
    /// The broker's URL (`RabbitMq::url`) and the Postgres connection string of the ledger's database.
    pub amqp: &'a str,
    pub postgres: &'a str,
    pub stream: &'a [Event],
    pub consumers: usize,
    pub crash_rate: f64,
    pub seed: u64,
}

impl Run<'_> {
    /// Publishes the stream and consumes it until every message is acknowledged and the consumers are gone, then
    /// returns the number of messages left in the queue (0 unless an acknowledgement went missing).
    pub fn run(&self, traffic: &Traffic, tally: &Tally) -> u32 {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a tokio runtime");
        runtime.block_on(async {
            let producer = Connection::connect(self.amqp, ConnectionProperties::default()).await.expect("connect");
            let channel = producer.create_channel().await.expect("open a channel");
            // Durable: the queue, and the persistent messages in it, survive a broker restart.
            let durable = QueueDeclareOptions { durable: true, ..Default::default() };
            channel.queue_declare(QUEUE.into(), durable, FieldTable::default()).await.expect("declare the queue");
            let (done, _) = watch::channel(self.stream.is_empty());
            let consumers =
                (0..self.consumers as u64).map(|n| self.consume(self.seed.wrapping_add(n), traffic, tally, &done));
            tokio::join!(
                publish(&channel, self.stream, traffic),
                futures_util::future::join_all(consumers),
                watch_for_stall(traffic, &done),
            );
            let passive = QueueDeclareOptions { passive: true, ..Default::default() };
            let queue = channel.queue_declare(QUEUE.into(), passive, FieldTable::default()).await.expect("queue");
            producer.close(200, "done".into()).await.expect("close the producer's connection");
            queue.message_count()
        })
    }

    /// A consumer, reborn after each death, until every message is acknowledged.
    async fn consume(&self, seed: u64, traffic: &Traffic, tally: &Tally, done: &watch::Sender<bool>) {
        let mut rng = Rng::with_seed(seed);
        let mut finished = done.subscribe();
        loop {
            let amqp = Connection::connect(self.amqp, ConnectionProperties::default()).await.expect("connect");
            let channel = amqp.create_channel().await.expect("open a channel");
            channel.basic_qos(PREFETCH, BasicQosOptions::default()).await.expect("basic.qos");
            // Manual acknowledgement (no_ack false): a delivery stays the consumer's until it acknowledges it.
            let options = BasicConsumeOptions::default();
            let mut deliveries =
                channel.basic_consume(QUEUE.into(), "".into(), options, FieldTable::default()).await.expect("consume");
            let (db, connection) =
                tokio_postgres::connect(self.postgres, tokio_postgres::NoTls).await.expect("connect to Postgres");
            let db_socket = tokio::spawn(connection);
            loop {
                let delivery = tokio::select! {
                    next = deliveries.next() => next.expect("the broker cancelled the consumer").expect("a delivery"),
                    _ = finished.wait_for(|&all_acked| all_acked) => {
                        amqp.close(200, "done".into()).await.expect("close a consumer's connection");
                        return;
                    }
                };
                traffic.delivered.fetch_add(1, Ordering::Relaxed);
                if delivery.redelivered {
                    traffic.redelivered.fetch_add(1, Ordering::Relaxed);
                }
                let body = std::str::from_utf8(&delivery.data).ok();
                let (event, _) = body.and_then(Event::from_line).expect("a payment event");
                let crash = Crash::pick(&mut rng, self.crash_rate);
                let outcome = apply_or_park(&db, &event, crash).await;
                if let Ok(outcome) = outcome {
                    tally.count(outcome);
                }
                if outcome == Ok(Outcome::Failed) {
                    // Rolled back: back into the queue, flagged `redelivered`, for another try.
                    let requeue = BasicNackOptions { requeue: true, ..Default::default() };
                    delivery.nack(requeue).await.expect("basic.nack");
                } else if outcome.is_ok() && crash != Some(Crash::AfterCommitBeforeAck) {
                    delivery.ack(BasicAckOptions::default()).await.expect("basic.ack");
                    if traffic.acked.fetch_add(1, Ordering::Relaxed) + 1 == self.stream.len() as u64 {
                        done.send_replace(true);
                    }
                } else {
                    // Dies: the Postgres socket closes mid-transaction, then the AMQP connection, with nothing
                    // acknowledged. (A clean Connection.Close: lapin cannot cut its socket. To RabbitMQ it is the
                    // same as a crash: a consumer gone with deliveries unacknowledged, which it requeues.)
                    tally.crashes.fetch_add(1, Ordering::Relaxed);
                    db_socket.abort();
                    let _ = db_socket.await;
                    amqp.close(200, "consumer died".into()).await.expect("close a dead consumer's connection");
                    break;
                }
            }
        }
    }
}

/// The async twin of [`super::apply_or_park`]: the same statements, decision and crash points. A crash returns
/// with the transaction open, for the caller to abandon with its connection.
async fn apply_or_park(db: &tokio_postgres::Client, event: &Event, crash: Option<Crash>) -> Result<Outcome, Crash> {
    let point = |p| if crash == Some(p) { Err(p) } else { Ok(()) };
    point(Crash::BeforeMark)?;
    db.batch_execute("BEGIN").await.expect("BEGIN");
    let attempt: i32 = db.query_one(sql::ATTEMPT, &[&event.id]).await.expect("count the attempt").get(0);
    let new: bool = db.query_one(sql::MARK, &[&event.id]).await.expect("mark").get(0);
    let outcome = Outcome::decide(attempt, new);
    point(Crash::AfterMark)?;
    let written = match outcome {
        Outcome::Applied => db.execute(sql::CREDIT, &[&event.account, &event.amount]).await,
        Outcome::Parked => db.execute(sql::PARK, &[&event.id, &event.account, &event.amount, &attempt]).await,
        _ => Ok(0),
    };
    if let Err(error) = written {
        db.batch_execute("ROLLBACK").await.expect("ROLLBACK");
        return Ok(Outcome::refused(&error));
    }
    point(Crash::BeforeCommit)?;
    db.batch_execute("COMMIT").await.expect("COMMIT");
    Ok(outcome)
}

/// The producer: each message persistent, with the event id as its message id, and counted as published once
/// the broker confirms it (publisher confirms: the broker has it, on disk for a persistent message).
async fn publish(channel: &Channel, stream: &[Event], traffic: &Traffic) {
    channel.confirm_select(ConfirmSelectOptions::default()).await.expect("confirm.select");
    for batch in stream.chunks(CONFIRM_BATCH) {
        let mut confirms = Vec::with_capacity(batch.len());
        for event in batch {
            let properties = BasicProperties::default().with_delivery_mode(2).with_message_id(event.id.as_str().into());
            let body = event.to_line(None);
            let options = BasicPublishOptions::default();
            let publish = channel.basic_publish("".into(), QUEUE.into(), options, body.as_bytes(), properties);
            confirms.push(publish.await.expect("publish"));
        }
        for confirm in confirms {
            assert!(confirm.await.expect("a publisher confirm").is_ack(), "the broker refused a message");
            traffic.published.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Ends when every message is acknowledged; fails the run if acknowledgements stop for `STALL`.
async fn watch_for_stall(traffic: &Traffic, done: &watch::Sender<bool>) {
    let mut finished = done.subscribe();
    let mut acked = traffic.acked.load(Ordering::Relaxed);
    loop {
        if tokio::time::timeout(STALL, finished.wait_for(|&all_acked| all_acked)).await.is_ok() {
            return;
        }
        let now = traffic.acked.load(Ordering::Relaxed);
        assert!(now > acked, "no acknowledgement in {STALL:?}: {now} of the stream acknowledged");
        acked = now;
    }
}
