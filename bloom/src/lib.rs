//! A split-block Bloom filter ("SBBF", the layout of Parquet and Impala) over a slice of `AtomicU32`, so it can live
//! in memory shared by many processes and be read and written without locks.
//!
//! Each key touches exactly one 256-bit block (32 bytes, half a cache line): one cache miss per lookup. Inside the
//! block, each of the 8 words gets one bit, chosen by multiplying the key's hash with a per-word odd salt. One xxh3
//! hash per key: its high 32 bits pick the block, its low 32 bits the bits.
//!
//! The filter may answer "maybe" for a key it never saw (a false positive), never "no" for a key it saw: bits are
//! only ever set (`fetch_or`), except by `clear`, which the caller must only run on memory nobody trusts.

use std::sync::atomic::{AtomicU32, Ordering};

/// Words per block; each key sets one bit in each word.
pub const WORDS_PER_BLOCK: usize = 8;
/// Bytes per block.
pub const BLOCK_BYTES: usize = WORDS_PER_BLOCK * 4;
const SALT: [u32; WORDS_PER_BLOCK] =
    [0x47b6137b, 0x44974d91, 0x8824ad5b, 0xa2b7289d, 0x705495c7, 0x2df1424b, 0x9efc4947, 0x5c6bfb31];

/// How many keys ahead a batch prefetches (see `Filter::prefetch`): enough misses in flight to hide memory latency,
/// few enough that the blocks are still cached when their turn comes.
pub const PREFETCH_AHEAD: usize = 8;

/// Calls `f(i, hash)` for each hash in order, after prefetching in every filter of `filters` the block of the hash
/// `PREFETCH_AHEAD` places on.
pub fn for_each_prefetched(filters: &[&Filter<'_>], hashes: &[u64], mut f: impl FnMut(usize, u64)) {
    for (i, &hash) in hashes.iter().enumerate() {
        if let Some(&ahead) = hashes.get(i + PREFETCH_AHEAD) {
            filters.iter().for_each(|filter| filter.prefetch(ahead));
        }
        f(i, hash);
    }
}

/// The hash of a key: the id, seeded by its namespace (database and inbox), so equal ids in different inboxes are
/// different keys.
pub fn hash_key(namespace: u64, id: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64_with_seed(id, namespace)
}

/// A view of `blocks * WORDS_PER_BLOCK` words as a filter.
pub struct Filter<'a> {
    words: &'a [AtomicU32],
}

impl<'a> Filter<'a> {
    /// `words.len()` must be a non-zero multiple of `WORDS_PER_BLOCK`.
    pub fn new(words: &'a [AtomicU32]) -> Self {
        assert!(!words.is_empty() && words.len().is_multiple_of(WORDS_PER_BLOCK), "a filter is made of whole blocks");
        Filter { words }
    }

    pub fn blocks(&self) -> usize {
        self.words.len() / WORDS_PER_BLOCK
    }

    fn block(&self, hash: u64) -> &[AtomicU32] {
        // Multiply-shift maps the high half of the hash onto [0, blocks) without a division.
        let index = (((hash >> 32) * self.blocks() as u64) >> 32) as usize;
        &self.words[index * WORDS_PER_BLOCK..(index + 1) * WORDS_PER_BLOCK]
    }

    fn masks(hash: u64) -> [u32; WORDS_PER_BLOCK] {
        let low = hash as u32;
        SALT.map(|salt| 1u32 << (low.wrapping_mul(salt) >> 27))
    }

    pub fn insert(&self, hash: u64) {
        for (word, mask) in self.block(hash).iter().zip(Self::masks(hash)) {
            // Release: a process that later sees the row this key stands for also sees these bits.
            if word.load(Ordering::Relaxed) & mask != mask {
                word.fetch_or(mask, Ordering::Release);
            }
        }
    }

    /// Asks the CPU to start loading `hash`'s block without waiting for it. A batch calls this for the key
    /// `PREFETCH_AHEAD` places on before working on the current one, so its cache misses overlap instead of
    /// queueing (a filter sized for millions of keys is far bigger than the CPU cache: every key is a miss).
    pub fn prefetch(&self, hash: u64) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: a prefetch is only a hint; the address is inside the filter's words.
        unsafe {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
            _mm_prefetch::<_MM_HINT_T0>(self.block(hash).as_ptr() as *const i8)
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = hash;
    }

    /// False means "certainly never inserted" (since the last `clear`).
    pub fn may_contain(&self, hash: u64) -> bool {
        self.block(hash).iter().zip(Self::masks(hash)).all(|(word, mask)| word.load(Ordering::Acquire) & mask == mask)
    }

    /// Zeroes every word. Each word is swapped (read and written), not just overwritten: whoever set bits that the
    /// clear wipes out did so before the clear in a way the clearing thread observes, so everything that writer did
    /// before setting them (in pg_dedup: taking a transaction id) is visible to the clearing thread afterwards.
    pub fn clear(&self) {
        for word in self.words {
            word.swap(0, Ordering::AcqRel);
        }
    }

    /// (fraction of bits set, expected false-positive rate of a random absent key), from `sample` blocks spread
    /// evenly over the filter (all of them when `sample >= blocks`). The rate is exact for the sampled blocks: a
    /// random key lands in one block and is a false positive when its 8 bits happen to be set.
    pub fn fill_and_fpr(&self, sample: usize) -> (f64, f64) {
        let blocks = self.blocks();
        let sample = sample.clamp(1, blocks);
        let (mut bits, mut fpr) = (0u64, 0f64);
        for s in 0..sample {
            let b = s * blocks / sample;
            let block = &self.words[b * WORDS_PER_BLOCK..(b + 1) * WORDS_PER_BLOCK];
            let mut p = 1.0;
            for word in block {
                let ones = word.load(Ordering::Relaxed).count_ones();
                bits += ones as u64;
                p *= ones as f64 / 32.0;
            }
            fpr += p;
        }
        (bits as f64 / (sample * BLOCK_BYTES * 8) as f64, fpr / sample as f64)
    }
}

/// Expected false-positive rate of a filter of `blocks` blocks holding `keys` distinct keys: keys per block follow a
/// Poisson law; a block with j keys has each word's bit set with probability 1 - (31/32)^j.
pub fn expected_fpr(keys: u64, blocks: u64) -> f64 {
    if keys == 0 {
        return 0.0;
    }
    let lambda = keys as f64 / blocks as f64;
    let spread = 12.0 * lambda.sqrt() + 32.0;
    let (first, last) = ((lambda - spread).max(0.0) as u64, (lambda + spread).ceil() as u64);
    (first..=last)
        .map(|j| {
            // Poisson weight in log space: exp(-λ) underflows long before λ gets large.
            let poisson = (-lambda + j as f64 * lambda.ln() - ln_factorial(j)).exp();
            let word_bit = 1.0 - (31.0f64 / 32.0).powi(j as i32);
            poisson * word_bit.powi(WORDS_PER_BLOCK as i32)
        })
        .sum()
}

/// ln(n!) by Stirling's series (exact enough for a sizing estimate; exact for n = 0).
fn ln_factorial(n: u64) -> f64 {
    if n < 2 {
        return 0.0;
    }
    let n = n as f64;
    n * n.ln() - n + 0.5 * (2.0 * std::f64::consts::PI * n).ln() + 1.0 / (12.0 * n) - 1.0 / (360.0 * n.powi(3))
}

/// The fewest blocks that hold `capacity` keys at a false-positive rate of at most `fpr`.
pub fn blocks_for(capacity: u64, fpr: f64) -> u64 {
    let (mut low, mut high) = (1u64, 1u64);
    while expected_fpr(capacity, high) > fpr {
        high *= 2;
    }
    while low < high {
        let mid = low + (high - low) / 2;
        if expected_fpr(capacity, mid) > fpr {
            low = mid + 1;
        } else {
            high = mid;
        }
    }
    high
}

/// The information-theoretic optimum of any Bloom filter: 1.44 · log2(1/p) bits per key.
pub fn optimal_bits_per_key(fpr: f64) -> f64 {
    std::f64::consts::LOG2_E * (1.0 / fpr).log2()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashSet;

    fn words(blocks: usize) -> Vec<AtomicU32> {
        (0..blocks * WORDS_PER_BLOCK).map(|_| AtomicU32::new(0)).collect()
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// Never a false negative, whatever the keys, namespaces and sizes.
        #[test]
        fn every_inserted_key_is_found(
            keys in proptest::collection::vec((any::<u64>(), proptest::collection::vec(any::<u8>(), 0..64)), 1..400),
            blocks in 1usize..64,
        ) {
            let memory = words(blocks);
            let filter = Filter::new(&memory);
            for (ns, id) in &keys {
                filter.insert(hash_key(*ns, id));
            }
            for (ns, id) in &keys {
                prop_assert!(filter.may_contain(hash_key(*ns, id)));
            }
        }
    }

    /// A filter sized for n keys at rate p, filled with n keys, answers "maybe" for absent keys at most 1.2 p of the
    /// time (measured on 200,000 absent keys, for several targets).
    #[test]
    fn measured_false_positive_rate_is_within_1_2_of_the_target() {
        for (capacity, target) in [(20_000u64, 0.01), (20_000, 0.001), (50_000, 0.05)] {
            let memory = words(blocks_for(capacity, target) as usize);
            let filter = Filter::new(&memory);
            for i in 0..capacity {
                filter.insert(hash_key(7, format!("present-{i}").as_bytes()));
            }
            let trials = 200_000;
            let hits =
                (0..trials).filter(|i| filter.may_contain(hash_key(7, format!("absent-{i}").as_bytes()))).count();
            let measured = hits as f64 / trials as f64;
            assert!(measured <= 1.2 * target, "target {target}: measured {measured}");
            let (_, estimated) = filter.fill_and_fpr(usize::MAX);
            assert!((estimated - measured).abs() <= 0.3 * target + 0.0005, "estimate {estimated} vs {measured}");
        }
    }

    #[test]
    fn namespaces_separate_equal_ids() {
        let memory = words(1024);
        let filter = Filter::new(&memory);
        filter.insert(hash_key(1, b"same-id"));
        let misses = (2..2000u64).filter(|ns| !filter.may_contain(hash_key(*ns, b"same-id"))).count();
        assert!(misses > 1900, "other namespaces should mostly be certainly-new, got {misses} of 1998");
    }

    #[test]
    fn a_prefetched_batch_visits_every_key_once_in_order() {
        let memory = words(64);
        let filter = Filter::new(&memory);
        for n in [0, 1, PREFETCH_AHEAD, PREFETCH_AHEAD + 1, 100] {
            let hashes: Vec<u64> = (0..n as u64).map(|i| hash_key(7, &i.to_le_bytes())).collect();
            let mut seen = Vec::new();
            for_each_prefetched(&[&filter, &filter], &hashes, |i, hash| seen.push((i, hash)));
            assert_eq!(seen, hashes.iter().copied().enumerate().collect::<Vec<_>>());
        }
    }

    #[test]
    fn clear_forgets_everything() {
        let memory = words(16);
        let filter = Filter::new(&memory);
        let keys: HashSet<u64> = (0..100u64).map(|i| hash_key(0, &i.to_le_bytes())).collect();
        keys.iter().for_each(|k| filter.insert(*k));
        filter.clear();
        assert!(keys.iter().all(|k| !filter.may_contain(*k)));
        assert_eq!(filter.fill_and_fpr(16), (0.0, 0.0));
    }

    #[test]
    fn sizing_is_close_to_the_known_split_block_cost() {
        // Split-block filters pay a little over the optimum: about 10.5-11.5 bits per key at 1%.
        let bits_per_key = blocks_for(1_000_000, 0.01) as f64 * 256.0 / 1e6;
        assert!(bits_per_key > optimal_bits_per_key(0.01) && bits_per_key < 12.0, "{bits_per_key}");
    }
}
