//! A consumer process for tests/chaos.rs: `chaos_consumer CONNSTRING`.
//!
//! Reads deliveries from stdin, one per line (`id account amount [crash point]`, see `replay::Event::to_line`),
//! applies each the inbox way (`replay::apply`: BEGIN; dedup.mark; the balance update when new; COMMIT) and only
//! then prints `ack <id> new|dup`. At a delivery's crash point it prints `crash <point>` (so the test knows where
//! it died) and kills itself with SIGKILL: no rollback, no Terminate message, no exit handlers, like a real crash.
//! It leaves with status 0 when stdin closes; any other way out than these two is a bug the test reports.

use pg_dedup_harness::postgres::{Client, NoTls};
use pg_dedup_harness::replay::{self, die, Crash, Event};
use std::io::BufRead;

fn main() {
    let conn = std::env::args().nth(1).expect("usage: chaos_consumer CONNSTRING");
    let mut db = Client::connect(&conn, NoTls).expect("connect");
    for line in std::io::stdin().lock().lines() {
        let line = line.expect("read stdin");
        let (event, crash) = Event::from_line(&line).unwrap_or_else(|| panic!("not a delivery: {line:?}"));
        let new = replay::apply(&mut db, &event, |point| {
            if crash == Some(point) {
                die(point)
            }
            false
        })
        .expect("told never to stop");
        if crash == Some(Crash::AfterCommitBeforeAck) {
            die(Crash::AfterCommitBeforeAck)
        }
        println!("ack {} {}", event.id, if new { "new" } else { "dup" });
    }
}
