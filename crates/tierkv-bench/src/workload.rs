//! Key and request generators: LevelDB db_bench and YCSB.
//!
//! - db_bench keys are the decimal key number zero-padded to `--key-size` bytes
//!   (`%016d` for the default 16), drawn sequentially (`fillseq`) or uniformly (`fillrandom`,
//!   `readrandom`, …).
//! - YCSB keys are `"user" + fnv64(keynum)` (CoreWorkload's hashed inserts), and requests
//!   pick key numbers with YCSB's generators: [`Zipfian`] (Gray et al., "Quickly Generating
//!   Billion-Record Synthetic Databases", as YCSB's `ZipfianGenerator`), [`ScrambledZipfian`]
//!   (zipfian over a 10^10 item space, FNV-hashed into the key range, θ = 0.99), and
//!   [`Latest`] (zipfian distance back from the newest inserted key). Scan lengths for
//!   workload E are uniform in 1..=100.

use rand::rngs::SmallRng;
use rand::Rng;

/// YCSB's default zipfian constant.
pub const ZIPFIAN_THETA: f64 = 0.99;

const FNV_OFFSET_BASIS_64: u64 = 0xCBF2_9CE4_8422_2325;
const FNV_PRIME_64: u64 = 1_099_511_628_211;

/// YCSB's `Utils.fnvhash64`: FNV-1a over the 8 little-end octets, as a non-negative long.
pub fn fnv64(mut v: u64) -> u64 {
    let mut h = FNV_OFFSET_BASIS_64;
    for _ in 0..8 {
        h ^= v & 0xff;
        h = h.wrapping_mul(FNV_PRIME_64);
        v >>= 8;
    }
    (h as i64).unsigned_abs()
}

/// db_bench key `n`: decimal, zero-padded (or truncated on the left) to `size` bytes.
pub fn db_bench_key(n: u64, size: usize) -> Vec<u8> {
    let s = format!("{n:0size$}");
    let b = s.into_bytes();
    let cut = b.len().saturating_sub(size);
    b.get(cut..).map(<[u8]>::to_vec).unwrap_or_default()
}

/// YCSB key for key number `n` (hashed inserts): `user<fnv64(n)>`.
pub fn ycsb_key(n: u64) -> Vec<u8> {
    format!("user{}", fnv64(n)).into_bytes()
}

/// zeta(n, θ) = Σ_{i=1..n} 1 / i^θ.
pub fn zeta(n: u64, theta: f64) -> f64 {
    (1..=n).map(|i| 1.0 / (i as f64).powf(theta)).sum()
}

/// YCSB's `ZipfianGenerator`: item `i` of `[0, items)` with probability ∝ 1/(i+1)^θ.
#[derive(Debug, Clone)]
pub struct Zipfian {
    items: u64,
    theta: f64,
    alpha: f64,
    zetan: f64,
    eta: f64,
    half_pow_theta: f64,
}

impl Zipfian {
    /// Over `items` items with constant `theta` (computes zeta: O(items)).
    pub fn new(items: u64, theta: f64) -> Self {
        Self::with_zetan(items, theta, zeta(items, theta))
    }

    /// With a precomputed zeta(items, θ).
    pub fn with_zetan(items: u64, theta: f64, zetan: f64) -> Self {
        let zeta2 = zeta(2, theta);
        let alpha = 1.0 / (1.0 - theta);
        let eta = (1.0 - (2.0 / items as f64).powf(1.0 - theta)) / (1.0 - zeta2 / zetan);
        Zipfian { items, theta, alpha, zetan, eta, half_pow_theta: 0.5f64.powf(theta) }
    }

    /// Grow the item count, updating zeta incrementally (YCSB does the same for `latest`).
    pub fn grow_to(&mut self, items: u64) {
        if items <= self.items {
            return;
        }
        let extra: f64 = (self.items + 1..=items).map(|i| 1.0 / (i as f64).powf(self.theta)).sum();
        *self = Self::with_zetan(items, self.theta, self.zetan + extra);
    }

    /// Number of items.
    pub fn items(&self) -> u64 {
        self.items
    }

    /// Next item in `[0, items)`; 0 is the most popular.
    pub fn next(&self, rng: &mut SmallRng) -> u64 {
        let u: f64 = rng.random();
        let uz = u * self.zetan;
        if uz < 1.0 {
            return 0;
        }
        if uz < 1.0 + self.half_pow_theta {
            return 1.min(self.items.saturating_sub(1));
        }
        let v = (self.items as f64 * (self.eta * u - self.eta + 1.0).powf(self.alpha)) as u64;
        v.min(self.items.saturating_sub(1))
    }
}

/// YCSB's `ScrambledZipfianGenerator`: zipfian popularity, scattered over the key range.
#[derive(Debug, Clone)]
pub struct ScrambledZipfian {
    items: u64,
    gen: Zipfian,
}

/// YCSB's item space for scrambled zipfian, and its precomputed zeta at θ = 0.99.
const SCRAMBLED_ITEM_COUNT: u64 = 10_000_000_000;
const SCRAMBLED_ZETAN: f64 = 26.469_028_201_783_02;

impl ScrambledZipfian {
    /// Over `[0, items)`, θ = 0.99.
    pub fn new(items: u64) -> Self {
        ScrambledZipfian { items, gen: Zipfian::with_zetan(SCRAMBLED_ITEM_COUNT, ZIPFIAN_THETA, SCRAMBLED_ZETAN) }
    }

    /// Next key number in `[0, items)`.
    pub fn next(&self, rng: &mut SmallRng) -> u64 {
        fnv64(self.gen.next(rng)) % self.items.max(1)
    }
}

/// YCSB's `SkewedLatestGenerator`: recently inserted keys are the most popular.
#[derive(Debug, Clone)]
pub struct Latest {
    gen: Zipfian,
}

impl Latest {
    /// With `inserted` keys so far.
    pub fn new(inserted: u64) -> Self {
        Latest { gen: Zipfian::new(inserted.max(1), ZIPFIAN_THETA) }
    }

    /// Record that the key count grew to `inserted`.
    pub fn grow_to(&mut self, inserted: u64) {
        self.gen.grow_to(inserted);
    }

    /// Next key number: the newest key minus a zipfian distance.
    pub fn next(&self, rng: &mut SmallRng) -> u64 {
        let newest = self.gen.items() - 1;
        newest - self.gen.next(rng).min(newest)
    }
}

/// Scan length for YCSB workload E: uniform in `1..=max` (max 100 in YCSB).
pub fn scan_len(rng: &mut SmallRng, max: u64) -> u64 {
    rng.random_range(1..=max.max(1))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn db_bench_and_ycsb_key_formats() {
        assert_eq!(db_bench_key(42, 16), b"0000000000000042");
        assert_eq!(db_bench_key(123_456, 4), b"3456", "truncated on the left like db_bench's %016d at smaller sizes");
        // The first key of every YCSB load (keynum 0, hashed inserts).
        assert_eq!(ycsb_key(0), b"user6284781860667377211");
        assert!(ycsb_key(7).starts_with(b"user"));
        assert_ne!(ycsb_key(7), ycsb_key(8));
    }

    #[test]
    fn zipfian_matches_ycsb_generator() {
        // Gray et al.'s generator (YCSB's) is exact for items 0 and 1 and follows the zipfian
        // CDF approximately beyond; check both, and the mass of the head.
        let n = 1000u64;
        let z = Zipfian::new(n, ZIPFIAN_THETA);
        let zetan = zeta(n, ZIPFIAN_THETA);
        let mut rng = SmallRng::seed_from_u64(1);
        let draws = 400_000u64;
        let mut counts = vec![0u64; n as usize];
        for _ in 0..draws {
            counts[z.next(&mut rng) as usize] += 1;
        }
        let freq = |i: usize| counts[i] as f64 / draws as f64;
        for i in 0..2usize {
            let p = 1.0 / ((i + 1) as f64).powf(ZIPFIAN_THETA) / zetan;
            assert!((freq(i) - p).abs() / p < 0.03, "item {i}: frequency {:.5}, expected {p:.5}", freq(i));
        }
        // Head mass: the 10% most popular items carry zeta(100)/zeta(1000) of the requests.
        let head = counts[..100].iter().sum::<u64>() as f64 / draws as f64;
        let want = zeta(100, ZIPFIAN_THETA) / zetan;
        assert!((head - want).abs() < 0.03, "top 10% mass {head:.3}, zipfian {want:.3}");
        // Popularity decreases with rank (compare decades to smooth noise).
        let decade = |a: usize| counts[a..a + 10].iter().sum::<u64>();
        assert!(decade(0) > decade(10) && decade(10) > decade(100) && decade(100) > decade(900));
    }

    #[test]
    fn scrambled_zipfian_is_skewed_and_scattered() {
        let n = 10_000u64;
        let z = ScrambledZipfian::new(n);
        let mut rng = SmallRng::seed_from_u64(2);
        let mut counts = vec![0u64; n as usize];
        for _ in 0..200_000 {
            let k = z.next(&mut rng);
            assert!(k < n);
            counts[k as usize] += 1;
        }
        let mut sorted = counts.clone();
        sorted.sort_unstable_by(|a, b| b.cmp(a));
        let top1: u64 = sorted[..(n / 100) as usize].iter().sum();
        // Expected ≈ zeta(100)/zeta(10^10) ≈ 19.6% plus hash collisions; uniform would be 1%.
        assert!(top1 > 200_000 * 15 / 100, "hottest 1% of keys got {top1} of 200000");
        // Scattered: the hottest key is not key 0 and the hot keys are spread over the range.
        let hottest = counts.iter().enumerate().max_by_key(|(_, c)| **c).map(|(i, _)| i).unwrap_or(0);
        assert_ne!(hottest, 0);
        let hot: Vec<usize> = counts.iter().enumerate().filter(|(_, c)| **c >= sorted[9]).map(|(i, _)| i).collect();
        let spread = hot.iter().max().unwrap_or(&0) - hot.iter().min().unwrap_or(&0);
        assert!(spread > (n / 4) as usize, "top-10 keys spread over {spread} of {n}");
    }

    #[test]
    fn latest_favours_new_keys_and_follows_inserts() {
        let mut l = Latest::new(10_000);
        let mut rng = SmallRng::seed_from_u64(3);
        let draws = 100_000;
        let recent = (0..draws).filter(|_| l.next(&mut rng) >= 9_900).count();
        // The newest 1% of keys: P = zeta(100)/zeta(10000) ≈ 0.55 at θ = 0.99.
        let p = zeta(100, ZIPFIAN_THETA) / zeta(10_000, ZIPFIAN_THETA);
        let got = recent as f64 / draws as f64;
        assert!((got - p).abs() < 0.02, "newest 1%: {got:.3}, expected {p:.3}");
        l.grow_to(20_000);
        assert!((0..1000).all(|_| l.next(&mut rng) < 20_000));
        let newest = (0..draws).filter(|_| l.next(&mut rng) == 19_999).count() as f64 / draws as f64;
        let p0 = 1.0 / zeta(20_000, ZIPFIAN_THETA);
        assert!((newest - p0).abs() / p0 < 0.1, "newest key after growth: {newest:.4}, expected {p0:.4}");
    }

    #[test]
    fn scan_lengths_are_uniform_1_to_100() {
        let mut rng = SmallRng::seed_from_u64(4);
        let v: Vec<u64> = (0..100_000).map(|_| scan_len(&mut rng, 100)).collect();
        assert_eq!(v.iter().min(), Some(&1));
        assert_eq!(v.iter().max(), Some(&100));
        let mean = v.iter().sum::<u64>() as f64 / v.len() as f64;
        assert!((mean - 50.5).abs() < 0.5, "mean {mean}");
    }
}
