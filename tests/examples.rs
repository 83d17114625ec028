//! The examples in examples/ run for real against a throwaway cluster, the way their READMEs say to run them:
//! - both consumers (Python with psycopg 3, Rust with tokio-postgres) read a stream with duplicates, a payload
//!   that is not JSON and an id over pg_dedup's limit, while a trigger makes some of their transactions fail as
//!   lost races do (serialization failure, deadlock): the ledger must equal the exactly-once total, each bad
//!   delivery must be dead-lettered, and the retries must have happened;
//! - the webhook answers 200 for a new event and for its duplicates, 400 for what can never succeed, 500 when the
//!   database fails (and then has marked nothing), with the effect applied once;
//! - usage.sql runs top to bottom with psql and prints exactly examples/usage.out; so does ingest/load.sql (a feed
//!   loaded twice into an attached table, statuses applied by version) with ingest/load.out.

use pg_dedup_harness::replay::{self, Event, Rng};
use pg_dedup_tests::*;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

const EXAMPLES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../examples");
/// Debian's Python with Debian's psycopg 3 (python3-psycopg, installed by scripts/setup.sh), whatever `python3`
/// on PATH is.
const PYTHON: &str = "/usr/bin/python3";
const EVENTS: usize = 300;

fn example(path: &str) -> PathBuf {
    Path::new(EXAMPLES).join(path)
}

/// The cluster's psql on `file`, stopping at the first error, as the examples' READMEs run it (from the file's
/// directory). Returns stdout.
fn psql(db: &str, file: &Path) -> String {
    let out = Command::new(cluster().bindir().join("psql"))
        .current_dir(file.parent().expect("a file in a directory"))
        .args(["-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", &cluster().conn_string(db, "postgres"), "-f"])
        .arg(file)
        .output()
        .expect("run psql");
    assert!(out.status.success(), "psql -f {} failed:\n{}", file.display(), String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).expect("psql prints UTF-8")
}

/// A fresh database with the examples' tables and inboxes (examples/schema.sql).
fn prepared_db(name: &str) -> postgres::Client {
    let client = db(name);
    psql(name, &example("schema.sql"));
    client
}

/// Kills a server example when the test ends, passed or not.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Every 7th balance update fails with a serialization failure and every 11th with a deadlock, as lost races do.
/// A sequence is not transactional, so the retry gets the next number and goes through; a consumer that retried
/// anything less than the whole transaction, mark included, would leave the ledger short.
const INJECT_FAULTS: &str = "
    CREATE SEQUENCE updates;
    CREATE FUNCTION inject_fault() RETURNS trigger LANGUAGE plpgsql AS $$
    DECLARE n bigint := nextval('updates');
    BEGIN
      IF n % 7 = 0 THEN RAISE EXCEPTION 'injected' USING ERRCODE = 'serialization_failure'; END IF;
      IF n % 11 = 0 THEN RAISE EXCEPTION 'injected' USING ERRCODE = 'deadlock_detected'; END IF;
      RETURN NEW;
    END $$;
    CREATE TRIGGER inject_fault BEFORE UPDATE ON accounts FOR EACH ROW EXECUTE FUNCTION inject_fault();";

/// Feeds a consumer `EVENTS` payment events, about 30% of them delivered twice, plus two deliveries that can never
/// succeed, and checks what it did.
fn check_consumer(consumer: &mut Command, name: &str) {
    let mut client = prepared_db(name);
    client.batch_execute(INJECT_FAULTS).expect("install the fault trigger");
    let mut rng = Rng::with_seed(7);
    let events = replay::events(name, EVENTS, &mut rng);
    let stream = replay::publish(&events, 0.3, &mut rng);
    let json = |e: &Event| format!(r#"{{"id": "{}", "account": {}, "amount": {}}}"#, e.id, e.account, e.amount);
    let mut input: Vec<String> = stream.iter().map(json).collect();
    let too_long = Event { id: "x".repeat(3000), account: 1, amount: 1 };
    input.insert(input.len() / 3, json(&too_long));
    input.insert(input.len() / 2, "not json".to_owned());

    let mut child = consumer
        .env("DATABASE_URL", cluster().conn_string(name, "postgres"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("start the {name} consumer: {e}"));
    let mut stdin = child.stdin.take().unwrap();
    // From another thread: the consumer's output must be read while it runs, or a full pipe would stall both.
    let writer = std::thread::spawn(move || stdin.write_all((input.join("\n") + "\n").as_bytes()));
    let out = child.wait_with_output().expect("wait for the consumer");
    writer.join().unwrap().expect("write the stream");
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    let hint = "(the Python ones need Debian's python3-psycopg: scripts/setup.sh installs it)";
    assert!(out.status.success(), "the {name} consumer failed {hint}:\n{stderr}");

    let outcomes = |kind: &str| stdout.lines().filter(|l| l.split(' ').next() == Some(kind)).count();
    let (new, dup, dead) = (outcomes("new"), outcomes("dup"), outcomes("dead"));
    let retries = stderr.lines().filter(|l| l.starts_with("retry ")).count();
    println!(
        "{name}: {} deliveries: {new} new, {dup} duplicates, {dead} dead-lettered, {retries} retries",
        stream.len() + 2
    );
    // The guarantee first: each event's amount in the ledger once. Then that the consumer's own report agrees.
    let ledger = replay::check_ledger(&mut client, &events).expect("read the ledger");
    assert!(ledger.ok(), "ledger {} != exactly-once {}: {:?}", ledger.total, ledger.expected_total, ledger.mismatched);
    assert_eq!((new, dup, dead), (events.len(), stream.len() - events.len(), 2), "outcomes:\n{stdout}");
    assert!(stdout.contains("54000"), "the long id was not dead-lettered by its SQLSTATE:\n{stdout}");
    assert!(retries > 0, "no transaction was retried (is the fault trigger there?):\n{stderr}");
    assert_eq!(count(&mut client, "dedup.inbox_payments"), events.len() as i64);
}

#[test]
fn python_consumer() {
    let mut python = Command::new(PYTHON);
    python.arg(example("python_consumer/consumer.py"));
    check_consumer(&mut python, "python_consumer");
}

/// Builds examples/rust_consumer (a workspace member of its own, as a user would build it) and returns its binary.
fn build_rust_consumer() -> PathBuf {
    // This test binary is <target>/<profile>/deps/examples-<hash>; cargo puts the example in <target>/<profile>.
    let profile_dir = std::env::current_exe().unwrap().parent().unwrap().parent().unwrap().to_owned();
    let mut cargo = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned()));
    cargo.args(["build", "-q", "-p", "pg_dedup_rust_consumer"]).current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/.."));
    if profile_dir.ends_with("release") {
        cargo.arg("--release");
    }
    let built = cargo.status().expect("run cargo build");
    assert!(built.success(), "cargo build -p pg_dedup_rust_consumer failed");
    profile_dir.join("pg_dedup_rust_consumer")
}

#[test]
fn rust_consumer() {
    check_consumer(&mut Command::new(build_rust_consumer()), "rust_consumer");
}

/// One HTTP/1.1 POST to the webhook; returns the status code and the body.
fn post(port: u16, headers: &[(&str, &str)], body: &str) -> (u16, String) {
    let (status, _, body) = post_to(port, "/webhook", headers, body);
    (status, body)
}

/// One HTTP/1.1 POST to `path`; returns the status code, the response's head and its body.
fn post_to(port: u16, path: &str, headers: &[(&str, &str)], body: &str) -> (u16, String, String) {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).expect("connect to the webhook");
    let mut request = format!("POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n");
    for (name, value) in headers {
        request.push_str(&format!("{name}: {value}\r\n"));
    }
    request.push_str(&format!("Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}", body.len()));
    stream.write_all(request.as_bytes()).unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).expect("read the response");
    let status = response.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap_or_else(|| panic!("{response:?}"));
    let (head, body) = response.split_once("\r\n\r\n").unwrap_or_default();
    (status, head.to_owned(), body.to_owned())
}

fn payment(id: &str, account: i32, amount: i64) -> String {
    format!(r#"{{"id": "{id}", "type": "payment.succeeded", "data": {{"account": {account}, "amount": {amount}}}}}"#)
}

#[test]
fn webhook() {
    let mut client = prepared_db("webhook");
    let server = Command::new(PYTHON)
        .arg(example("webhook/webhook.py"))
        .args(["--port", "0"])
        .env("DATABASE_URL", cluster().conn_string("webhook", "postgres"))
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start the webhook");
    let mut server = Running(server);
    // It prints its address once it listens: "listening on http://127.0.0.1:PORT/webhook".
    let mut line = String::new();
    BufReader::new(server.0.stdout.take().unwrap()).read_line(&mut line).expect("read the address");
    let port: u16 = line
        .rsplit(':')
        .next()
        .and_then(|p| p.trim_end_matches("/webhook\n").parse().ok())
        .unwrap_or_else(|| panic!("no address printed (is python3-psycopg installed?): {line:?}"));

    let processed = (200, r#"{"status": "processed"}"#.to_owned());
    let duplicate = (200, r#"{"status": "duplicate"}"#.to_owned());
    assert_eq!(post(port, &[], &payment("evt_1", 1, 100)), processed);
    assert_eq!(post(port, &[], &payment("evt_1", 1, 100)), duplicate, "a retry of the same event");
    // The id from a header (Standard Webhooks' webhook-id) instead of the body.
    let no_body_id = r#"{"type": "payment.succeeded", "data": {"account": 1, "amount": 100}}"#;
    assert_eq!(post(port, &[("webhook-id", "evt_1")], no_body_id), duplicate);
    // Other event types are marked too, so their retries are answered at once.
    let created = r#"{"id": "evt_2", "type": "customer.created", "data": {}}"#;
    assert_eq!(post(port, &[], created), processed);
    assert_eq!(post(port, &[], created), duplicate);

    // What can never succeed: 400, and nothing marked.
    for bad in [
        "not json",
        r#"{"type": "x"}"#,
        payment(&"x".repeat(3000), 1, 1).as_str(),
        r#"{"id": "evt_3", "type": "payment.succeeded"}"#,
    ] {
        let (status, body) = post(port, &[], bad);
        assert_eq!(status, 400, "{bad:.60}: {body}");
    }

    // The database fails mid-transaction (the business table is gone): 500, and the mark went with the rollback,
    // so the provider's retry, once the table is back, is processed.
    client.batch_execute("ALTER TABLE accounts RENAME TO accounts_away").unwrap();
    assert_eq!(post(port, &[], &payment("evt_4", 2, 50)).0, 500);
    let seen: bool = client.query_one("SELECT dedup.seen('evt_4', 'webhooks')", &[]).unwrap().get(0);
    assert!(!seen, "a failed delivery left its mark behind");
    client.batch_execute("ALTER TABLE accounts_away RENAME TO accounts").unwrap();
    assert_eq!(post(port, &[], &payment("evt_4", 2, 50)), processed);
    assert_eq!(post(port, &[], &payment("evt_4", 2, 50)), duplicate);

    let balances: Vec<(i32, i64)> = client
        .query("SELECT id, balance FROM accounts WHERE balance <> 0 ORDER BY id", &[])
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(balances, [(1, 100), (2, 50)], "each payment applied exactly once");
    assert_eq!(count(&mut client, "dedup.inbox_webhooks"), 3, "evt_1, evt_2 and evt_4 marked");

    // The idempotent API: a client retries POST /charges with its Idempotency-Key.
    let charge = r#"{"account": 5, "amount": 30}"#;
    let (status, head, first) = post_to(port, "/charges", &[("Idempotency-Key", "k1")], charge);
    assert_eq!((status, first.as_str()), (201, r#"{"account": 5, "charged": 30, "balance": 30}"#));
    assert!(!head.contains("Idempotent-Replayed"));
    let (status, head, again) =
        post_to(port, "/charges", &[("Idempotency-Key", "k1")], r#"{"amount": 30, "account": 5}"#);
    assert_eq!((status, again.as_str()), (201, first.as_str()), "a retry gets the stored response");
    assert!(head.contains("Idempotent-Replayed: true"), "{head}");
    let (status, _, _) = post_to(port, "/charges", &[("Idempotency-Key", "k1")], r#"{"account": 5, "amount": 31}"#);
    assert_eq!(status, 422, "the key came back with another request");
    // While another request holds the key: 409 at once.
    let mut holder = connect("webhook");
    holder.batch_execute("BEGIN; SELECT dedup.claim('k2', NULL, NULL, 'idempotency_keys')").unwrap();
    let (status, _, _) = post_to(port, "/charges", &[("Idempotency-Key", "k2")], charge);
    assert_eq!(status, 409);
    holder.batch_execute("ROLLBACK").unwrap();
    assert_eq!(post_to(port, "/charges", &[("Idempotency-Key", "k2")], charge).0, 201, "released: processed");
    assert_eq!(post_to(port, "/charges", &[], charge).0, 400, "no key");
    let balance: i64 = client.query_one("SELECT balance FROM accounts WHERE id = 5", &[]).unwrap().get(0);
    assert_eq!(balance, 60, "k1 and k2 charged once each");
}

/// Runs examples/`script` in a fresh database and compares what it prints with examples/`expected`.
fn prints_what_it_says(db_name: &str, script: &str, expected: &str) {
    db(db_name);
    let output = psql(db_name, &example(script));
    let wanted = std::fs::read_to_string(example(expected)).unwrap_or_else(|e| panic!("read examples/{expected}: {e}"));
    if output != wanted {
        // After an intended change, this file is the new expected output.
        let actual = std::env::temp_dir().join(format!("pg_dedup_{db_name}.out"));
        std::fs::write(&actual, &output).unwrap();
        panic!(
            "examples/{script} printed something else than {expected}: see `diff examples/{expected} {}`",
            actual.display()
        );
    }
}

#[test]
fn usage_sql() {
    prints_what_it_says("usage_sql", "usage.sql", "usage.out");
}

/// The ingest example: a feed loaded twice with `\copy` into an attached table, and statuses applied by version.
#[test]
fn ingest_load_sql() {
    prints_what_it_says("ingest_load", "ingest/load.sql", "ingest/load.out");
}
