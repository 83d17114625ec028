//! The attempts store's lock: a word of shared memory that processes take and give back with atomic operations, and
//! sleep on in the kernel (a futex) when it stays taken. The spin lock the store had before yielded the CPU after 200
//! turns, which keeps a waiter runnable: with 8 backends on 2 CPUs, a holder that is preempted inside the lock waits
//! for a CPU among waiters that take turns yielding to each other, and `attempt()` at 8 clients spent a sixth of its
//! samples yielding (bench/results/profiles/issue-24.md). Asleep, a waiter is off the run queue until the holder gives
//! the lock back and wakes it. Drepper's mutex ("Futexes Are Tricky"): 0 free, 1 taken, 2 taken and slept on.

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

/// Sleeps while `word` holds `value` (returns at once if it does not; early on a signal: the caller looks again).
#[cfg(target_os = "linux")]
fn sleep(word: &AtomicU32, value: u32) {
    // SAFETY: FUTEX_WAIT reads the aligned u32 `word` points to and sleeps only while it holds `value`. Shared, not
    // FUTEX_PRIVATE_FLAG: the word is in memory every process of the server maps, and the waker is another process.
    unsafe {
        libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAIT, value, std::ptr::null::<libc::timespec>());
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

    #[pg_test]
    fn the_lock_excludes_and_wakes_every_sleeper() {
        // More threads than the machine has CPUs, each holding the lock across a yield now and then, so that waiters
        // run out of spins and sleep. Each increment is a read and a write apart: any two holders at once lose one.
        // The test ends only if every sleeper is woken.
        let (lock, counter, slept_on) = (Lock(AtomicU32::new(FREE)), AtomicU32::new(0), AtomicU32::new(0));
        let (threads, rounds) = (8, 20_000);
        std::thread::scope(|s| {
            for _ in 0..threads {
                s.spawn(|| {
                    for i in 0..rounds {
                        lock.acquire();
                        let seen = counter.load(Ordering::Relaxed);
                        if i % 64 == 0 {
                            std::thread::yield_now();
                        }
                        if lock.0.load(Ordering::Relaxed) == SLEPT_ON {
                            slept_on.fetch_add(1, Ordering::Relaxed);
                        }
                        counter.store(seen + 1, Ordering::Relaxed);
                        lock.release();
                    }
                });
            }
        });
        assert_eq!(counter.load(Ordering::Relaxed), threads * rounds, "increments lost: two holders at once");
        assert!(slept_on.load(Ordering::Relaxed) > 0, "no waiter ever slept: the test did not reach the futex");
        assert_eq!(lock.0.load(Ordering::Relaxed), FREE);
    }
}
