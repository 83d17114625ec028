//! The attempts store's lock: a word of shared memory that processes take and give back with atomic operations, and
//! sleep on in the kernel (a futex) when it stays taken. The spin lock the store had before yielded the CPU after 200
//! turns, which keeps a waiter runnable: with 8 backends on 2 CPUs, a holder that is preempted inside the lock waits
//! for a CPU among waiters that take turns yielding to each other, and under `attempt()` at 8 clients the backends
//! spent 16% of their samples yielding, half of `attempt()`'s (bench/results/profiles/issue-24.md, stop 52). Asleep,
//! a waiter is off the run queue until the holder gives the lock back and wakes it. Drepper's mutex ("Futexes Are
//! Tricky"), as Rust's own: 0 free, 1 taken, 2 taken and slept on.

use std::sync::atomic::{AtomicU32, Ordering};

const FREE: u32 = 0;
const TAKEN: u32 = 1;
/// Taken, and someone may be asleep on it: whoever gives it back wakes one sleeper.
const SLEPT_ON: u32 = 2;
/// Turns a process waiting for the lock spins before it sleeps: a holder keeps it for a probe and a few stores.
const SPINS: u32 = 200;

/// The lock, free when zeroed (as shared memory is when created).
#[repr(transparent)]
pub struct Lock(AtomicU32);

impl Lock {
    /// Takes the lock, spinning a while, then sleeping until it is given back.
    pub fn acquire(&self) {
        let word = &self.0;
        let take = || word.compare_exchange(FREE, TAKEN, Ordering::Acquire, Ordering::Relaxed).is_ok();
        if take() {
            return;
        }
        for _ in 0..SPINS {
            std::hint::spin_loop();
            if word.load(Ordering::Relaxed) == FREE && take() {
                return;
            }
        }
        // Marked slept on before each sleep, and kept so once taken (there may be other sleepers): a sleeper woken
        // by a release always marks it again, so a release never leaves a sleeper behind unwoken.
        while word.swap(SLEPT_ON, Ordering::Acquire) != FREE {
            sleep(word, SLEPT_ON);
        }
    }

    /// Gives the lock back, and wakes a sleeper if there may be one.
    pub fn release(&self) {
        if self.0.swap(FREE, Ordering::Release) == SLEPT_ON {
            wake_one(&self.0);
        }
    }
}

/// Sleeps while `word` holds `value`; returns at once if it does not, and may return early (a spurious wake): the
/// caller looks again. Should the kernel refuse the call (a sandbox without futexes), the CPU is given away instead.
#[cfg(target_os = "linux")]
fn sleep(word: &AtomicU32, value: u32) {
    // SAFETY: FUTEX_WAIT reads the aligned u32 `word` points to and sleeps only while it holds `value`. Shared, not
    // FUTEX_PRIVATE_FLAG: the word is in memory every process of the server maps, and the waker is another process.
    let slept = unsafe {
        libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAIT, value, std::ptr::null::<libc::timespec>())
    };
    if slept == 0 {
        #[cfg(any(test, feature = "pg_test"))]
        tests::SLEEPS.fetch_add(1, Ordering::Relaxed);
    } else if !matches!(std::io::Error::last_os_error().raw_os_error(), Some(libc::EAGAIN | libc::EINTR)) {
        std::thread::yield_now();
    }
}

/// Wakes one process sleeping on `word`, if any.
#[cfg(target_os = "linux")]
fn wake_one(word: &AtomicU32) {
    // SAFETY: FUTEX_WAKE only reads the address, to find who sleeps on it.
    unsafe {
        libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, 1);
    }
}

/// Without futexes, a waiter gives the CPU away and looks again.
#[cfg(not(target_os = "linux"))]
fn sleep(_: &AtomicU32, _: u32) {
    std::thread::yield_now();
}

#[cfg(not(target_os = "linux"))]
fn wake_one(_: &AtomicU32) {}

#[cfg(any(test, feature = "pg_test"))]
#[pgrx::pg_schema]
mod tests {
    use super::*;
    use pgrx::prelude::*;

    /// Sleeps on a lock that were woken, in this process.
    pub static SLEEPS: AtomicU32 = AtomicU32::new(0);

    #[pg_test]
    fn the_lock_excludes_and_wakes_every_sleeper() {
        // More threads than the machine has CPUs, each holding the lock across a yield or a short sleep now and
        // then, so that waiters run out of spins and sleep. Each increment is a read and a write apart: two holders
        // at once lose one. A sleeper never woken would hang the threads: they are not joined, but waited for until a
        // deadline, so that such a bug fails the test instead (its threads are left asleep in this backend).
        use std::sync::Arc;
        let (threads, rounds) = (8, 20_000);
        let lock = Arc::new(Lock(AtomicU32::new(FREE)));
        let (counter, done) = (Arc::new(AtomicU32::new(0)), Arc::new(AtomicU32::new(0)));
        let slept_before = SLEEPS.load(Ordering::Relaxed);
        for _ in 0..threads {
            let (lock, counter, done) = (lock.clone(), counter.clone(), done.clone());
            std::thread::spawn(move || {
                for i in 0..rounds {
                    lock.acquire();
                    let seen = counter.load(Ordering::Relaxed);
                    if i % 1000 == 0 {
                        std::thread::sleep(std::time::Duration::from_millis(1));
                    } else if i % 64 == 0 {
                        std::thread::yield_now();
                    }
                    counter.store(seen + 1, Ordering::Relaxed);
                    lock.release();
                }
                done.fetch_add(1, Ordering::Release);
            });
        }
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
        while done.load(Ordering::Acquire) < threads {
            assert!(std::time::Instant::now() < deadline, "threads still waiting for the lock: a sleeper never woken");
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert_eq!(counter.load(Ordering::Relaxed), threads * rounds, "increments lost: two holders at once");
        assert!(SLEEPS.load(Ordering::Relaxed) > slept_before, "no waiter was woken from a sleep on the futex");
        assert_eq!(lock.0.load(Ordering::Relaxed), FREE);
    }
}
