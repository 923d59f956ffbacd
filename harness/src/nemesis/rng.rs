//! The nemesis's random source: SplitMix64, defined here, so its sequence is fixed forever,
//! unlike a library generator whose algorithm may change between versions. The schedule
//! generator and every fault package draw from it.
//!
//! Must not: be seeded from anything else than the seed it is given.

/// SplitMix64 (Steele, Lea, Flood 2014): tiny, fast, and fixed: the schedule format relies
/// on its exact sequence.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `lo..=hi` (inclusive); `lo` when `hi <= lo`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        if hi <= lo {
            return lo;
        }
        lo + self.next_u64() % (hi - lo + 1)
    }

    /// True with probability `num / den`.
    pub fn chance(&mut self, num: u64, den: u64) -> bool {
        self.next_u64() % den < num
    }

    pub fn pick<'a, T>(&mut self, xs: &'a [T]) -> &'a T {
        &xs[self.range(0, xs.len() as u64 - 1) as usize]
    }

    /// A sub-generator for one purpose, so adding draws to one part of the schedule does
    /// not shift another part.
    pub fn fork(&mut self, salt: u64) -> Rng {
        Rng::new(self.next_u64() ^ salt.wrapping_mul(0x2545_F491_4F6C_DD1D))
    }
}
