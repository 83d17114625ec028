//! An idempotent payment consumer with pg_dedup and tokio-postgres (the same consumer as ../python_consumer).
//!
//! Reads payment events as JSON lines on stdin, `{"id": "pay-1", "account": 3, "amount": 120}`, and adds each
//! amount to its account's balance exactly once, however often the event is delivered. Stdin stands in for the
//! broker: replace the read loop and `ack` with your client's receive and acknowledge calls (rdkafka offset commit,
//! lapin `basic_ack`, SQS `DeleteMessage`). Everything between them stays the same.
//!
//! Prints one line per delivery: `new ID`, `dup ID` or `dead PAYLOAD REASON`; retries go to stderr.
//!
//! ```sh
//! DATABASE_URL="host=/var/run/postgresql dbname=shop user=app" cargo run -p pg_dedup_rust_consumer < events.jsonl
//! ```

use serde::Deserialize;
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio_postgres::error::SqlState;
use tokio_postgres::{Client, NoTls};

const INBOX: &str = "payments";
const MAX_ATTEMPTS: u32 = 5;

#[derive(Deserialize)]
struct Event {
    id: String,
    account: i32,
    amount: i64,
}

/// A delivery that can never succeed: park it, acknowledge it, go on.
struct DeadLetter(String);

/// The broker acknowledgement. It runs only after COMMIT: a crash before it means a redelivery, which the inbox
/// answers as a duplicate. Acknowledging before COMMIT would lose the event if the transaction then failed.
fn ack(outcome: &str) {
    println!("{outcome}");
}

/// One transaction: the mark and the business write commit together, or neither does.
async fn apply(db: &mut Client, event: &Event) -> Result<bool, tokio_postgres::Error> {
    let tx = db.transaction().await?;
    // NULL ttl: the inbox's default (1 day for 'payments', see ../schema.sql).
    let new: bool = tx.query_one("SELECT dedup.mark($1, NULL, $2)", &[&event.id, &INBOX]).await?.get(0);
    if new {
        tx.execute("UPDATE accounts SET balance = balance + $2 WHERE id = $1", &[&event.account, &event.amount])
            .await?;
    }
    tx.commit().await?;
    Ok(new)
}

/// A serialization failure or a deadlock: the transaction lost a race and can be run again.
fn lost_race(e: &tokio_postgres::Error) -> bool {
    matches!(e.code(), Some(&SqlState::T_R_SERIALIZATION_FAILURE | &SqlState::T_R_DEADLOCK_DETECTED))
}

/// Ok(Ok(new)) when applied (or a duplicate), Ok(Err(..)) to dead-letter, Err to stop without acknowledging.
async fn handle(db: &mut Client, line: &str) -> Result<Result<(String, bool), DeadLetter>, tokio_postgres::Error> {
    let event: Event = match serde_json::from_str(line) {
        Ok(event) => event,
        Err(e) => return Ok(Err(DeadLetter(format!("bad payload: {e}")))),
    };
    let mut attempt = 1;
    loop {
        match apply(db, &event).await {
            Ok(new) => return Ok(Ok((event.id, new))),
            // Lost a race (serialization failure, deadlock): the whole transaction again, mark included; the
            // failed one was rolled back, mark and all.
            Err(e) if attempt < MAX_ATTEMPTS && lost_race(&e) => {
                eprintln!("retry {} {}", event.id, e.code().unwrap().code());
                let backoff = 10u64 << attempt;
                tokio::time::sleep(Duration::from_millis(fastrand::u64(0..backoff))).await;
                attempt += 1;
            }
            Err(e) => {
                // dedup's own errors are about the input (too long or empty id, ...): retrying cannot help.
                if let Some(db_error) = e.as_db_error().filter(|d| d.message().starts_with("dedup:")) {
                    let reason = format!("{} {}", db_error.code().code(), db_error.message());
                    return Ok(Err(DeadLetter(reason)));
                }
                // Anything else (the database is down, a bug): stop without acknowledging; the broker redelivers.
                return Err(e);
            }
        }
    }
}

async fn run() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("DATABASE_URL").map_err(|_| "set DATABASE_URL (a libpq conninfo or URL)")?;
    let (mut db, connection) = tokio_postgres::connect(&url, NoTls).await?;
    // tokio-postgres: the connection object does the socket I/O and must be polled by a task of its own.
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            eprintln!("connection lost: {e}");
        }
    });
    let mut lines = BufReader::new(tokio::io::stdin()).lines();
    while let Some(line) = lines.next_line().await? {
        if line.trim().is_empty() {
            continue;
        }
        let outcome = match handle(&mut db, &line).await? {
            Ok((id, new)) => format!("{} {id}", if new { "new" } else { "dup" }),
            // A real consumer publishes the message to a dead-letter queue here, then acknowledges it.
            Err(DeadLetter(reason)) => format!("dead {} {reason}", line.chars().take(40).collect::<String>()),
        };
        ack(&outcome);
    }
    Ok(())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // One thread is plenty for one consumer; with tokio's "macros" feature this is `#[tokio::main]`.
    tokio::runtime::Builder::new_current_thread().enable_all().build()?.block_on(run())
}
