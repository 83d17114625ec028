//! Hostile input, at random: ids of random characters and lengths, random intervals (negative, zero, huge,
//! infinite where the server has them), random inbox names (quotes, semicolons, unicode, case, length) and random
//! `max_rows`, thrown at every function. Each call must either work or raise a `dedup:` ERROR with a hint; a failed
//! call must leave nothing behind; the server must never crash. The seed is printed (set FUZZ_SEED to replay).

use pg_dedup_harness::postgres::{types::ToSql, Client};
use pg_dedup_tests::*;

/// xorshift64*: small, seedable, good enough to pick inputs.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn pick<'a, T>(&mut self, xs: &'a [T]) -> &'a T {
        &xs[self.below(xs.len() as u64) as usize]
    }

    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

/// Text of random length, from alphabets chosen to hit the edges: SQL metacharacters, multi-byte letters, emoji,
/// control characters (not NUL, which no text value can hold).
fn text(rng: &mut Rng, max_chars: u64) -> String {
    const ALPHABETS: &[&str] =
        &["abcxyz_019", "'\";--/*\\$ %()", "éüßñØ日本語", "🙂🚀𝄞", "\t\n\r\u{1}\u{7f}", "ABCdef"];
    let len = match rng.below(10) {
        0 => 0,
        1 => 2040 + rng.below(20), // around the 2 KiB id limit
        _ => rng.below(max_chars + 1),
    };
    let alphabets: Vec<Vec<char>> = (0..2).map(|_| rng.pick(ALPHABETS).chars().collect()).collect();
    (0..len)
        .map(|_| {
            let alphabet = &alphabets[rng.below(alphabets.len() as u64) as usize];
            *rng.pick(alphabet)
        })
        .collect()
}

fn inbox_name(rng: &mut Rng) -> String {
    match rng.below(4) {
        0 | 1 => "default".into(),
        2 => format!("fz_{}", rng.below(5)),
        _ => text(rng, 60),
    }
}

fn interval(rng: &mut Rng) -> String {
    const UNITS: &[&str] = &["microseconds", "seconds", "minutes", "hours", "days", "months", "years"];
    match rng.below(8) {
        0 => (*rng.pick(&["infinity", "-infinity", "0", "1 day -25 hours", "178000000 years"])).into(),
        1..=4 => format!("{} {}", 1 + rng.below(1000), rng.pick(&["seconds", "hours", "days"])),
        _ => {
            let n = rng.next() as i64 >> rng.below(64);
            format!("{n} {}", rng.pick(UNITS))
        }
    }
}

/// Which inboxes exist and how many rows each holds: a failed call must not change it.
fn state(c: &mut Client) -> Vec<(String, i64)> {
    let inboxes: Vec<(String, String)> = c
        .query("SELECT name, relation::text FROM dedup.inboxes ORDER BY name", &[])
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    inboxes.into_iter().map(|(name, table)| (name, count(c, &table))).collect()
}

#[test]
fn random_hostile_calls_work_or_fail_cleanly_and_leave_nothing_behind() {
    let seed: u64 = std::env::var("FUZZ_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64 | 1
    });
    println!("FUZZ_SEED={seed}");
    let mut rng = Rng(seed);
    let mut c = db("fuzz");
    let started = postmaster_started(&mut c);
    let (mut worked, mut refused) = (0, 0);
    for call in 0..1500 {
        // An interval the server cannot even parse is not pg_dedup's input: draw another.
        let ttl = loop {
            let candidate = interval(&mut rng);
            if c.query_one("SELECT $1::text::interval", &[&candidate]).is_ok() {
                break candidate;
            }
        };
        let (id, inbox) = (text(&mut rng, 40), inbox_name(&mut rng));
        let ids: Vec<Option<String>> =
            (0..rng.below(30)).map(|_| (!rng.chance(3)).then(|| text(&mut rng, 20))).collect();
        let max_rows = (rng.next() as i64) >> rng.below(64);
        let null_ttl = rng.chance(20);
        let ttl_arg = if null_ttl { None } else { Some(ttl.clone()) };
        let (sql, args): (&str, Vec<&(dyn ToSql + Sync)>) = match rng.below(8) {
            0 | 1 => ("SELECT dedup.mark($1, $2::text::interval, $3)::text", vec![&id, &ttl_arg, &inbox]),
            2 => {
                ("SELECT count(*)::text FROM dedup.mark_many($1, $2::text::interval, $3)", vec![&ids, &ttl_arg, &inbox])
            }
            3 => ("SELECT dedup.seen($1, $2)::text", vec![&id, &inbox]),
            4 => ("SELECT dedup.forget($1, $2)::text", vec![&id, &inbox]),
            5 => ("SELECT dedup.create_inbox($1, $2::text::interval)::text", vec![&inbox, &ttl_arg]),
            6 => ("SELECT dedup.purge($1, $2)::text", vec![&inbox, &max_rows]),
            _ => ("SELECT dedup.drop_inbox($1)::text", vec![&inbox]),
        };
        let before = state(&mut c);
        match c.query_one(sql, &args) {
            Ok(_) => worked += 1,
            Err(err) => {
                refused += 1;
                let db = err.as_db_error().unwrap_or_else(|| panic!("call {call} ({sql}): not a server error: {err}"));
                assert!(
                    db.message().starts_with("dedup: ") && db.hint().is_some_and(|h| !h.is_empty()),
                    "call {call} ({sql}, id {id:?}, ttl {ttl_arg:?}, inbox {inbox:?}): not a clear dedup error: {} {}",
                    db.code().code(),
                    db.message()
                );
                assert_eq!(state(&mut c), before, "call {call} ({sql}) failed but changed the inboxes");
            }
        }
    }
    println!("{worked} calls worked, {refused} were refused with a dedup error");
    assert!(worked > 100 && refused > 100, "the inputs should exercise both outcomes: {worked} / {refused}");
    assert_eq!(postmaster_started(&mut c), started, "the server restarted: a backend crashed");
}
