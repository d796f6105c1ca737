//! Counter-based random numbers: Philox4x32-10 (Salmon, Moraes, Dror, Shaw, "Parallel Random
//! Numbers: As Easy as 1, 2, 3", SC 2011). Element i of a tensor is a function of (seed, i)
//! only, so generation parallelises freely and the CUDA kernels reproduce the CPU's numbers.
//!
//! Layout of the stream: the counter for element i is (i / 4 as u64, 0), the key is the seed;
//! lane i % 4 of the 4 outputs is element i's u32. Uniform: `((x >> 8) + 0.5) * 2^-24`, in
//! (0, 1). Normal: Box-Muller on lanes (0, 1) and (2, 3): `r = sqrt(-2 ln u_a)`, lanes get
//! `r cos(2 pi u_b)` and `r sin(2 pi u_b)`.

use rayon::prelude::*;

// Multipliers and Weyl increments of Philox4x32 (Random123, philox.h; same as cuRAND).
const M0: u32 = 0xD251_1F53;
const M1: u32 = 0xCD9E_8D57;
const W0: u32 = 0x9E37_79B9;
const W1: u32 = 0xBB67_AE85;

/// One Philox4x32-10 block: four random u32 from a 128-bit counter and a 64-bit key.
pub fn philox4x32_10(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let (mut c, mut k) = (counter, key);
    for round in 0..10 {
        if round > 0 {
            k = [k[0].wrapping_add(W0), k[1].wrapping_add(W1)];
        }
        let p0 = (M0 as u64) * (c[0] as u64);
        let p1 = (M1 as u64) * (c[2] as u64);
        let (hi0, lo0) = ((p0 >> 32) as u32, p0 as u32);
        let (hi1, lo1) = ((p1 >> 32) as u32, p1 as u32);
        c = [hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0];
    }
    c
}

fn block(seed: u64, b: u64) -> [u32; 4] {
    philox4x32_10(
        [b as u32, (b >> 32) as u32, 0, 0],
        [seed as u32, (seed >> 32) as u32],
    )
}

/// Uniform in (0, 1) with 24 random bits.
#[inline]
pub fn to_unit(x: u32) -> f64 {
    ((x >> 8) as f64 + 0.5) * (1.0 / 16_777_216.0)
}

fn generate(n: usize, seed: u64, f: impl Fn([u32; 4]) -> [f64; 4] + Sync) -> Vec<f64> {
    let mut out = vec![0f64; n];
    out.par_chunks_mut(4096).enumerate().for_each(|(c, chunk)| {
        let first = c * 4096;
        for (j, quad) in chunk.chunks_mut(4).enumerate() {
            let v = f(block(seed, ((first / 4) + j) as u64));
            quad.copy_from_slice(&v[..quad.len()]);
        }
    });
    out
}

/// `n` values uniform in `[lo, hi)` for `seed` (element i depends on (seed, i) only).
pub fn uniform(n: usize, seed: u64, lo: f64, hi: f64) -> Vec<f64> {
    generate(n, seed, |x| x.map(|u| lo + (hi - lo) * to_unit(u)))
}

/// `n` values from Normal(`mean`, `std`) for `seed`, by Box-Muller as described above.
pub fn normal(n: usize, seed: u64, mean: f64, std: f64) -> Vec<f64> {
    generate(n, seed, |x| {
        let u = x.map(to_unit);
        let (r0, r1) = ((-2.0 * u[0].ln()).sqrt(), (-2.0 * u[2].ln()).sqrt());
        let (t0, t1) = (std::f64::consts::TAU * u[1], std::f64::consts::TAU * u[3]);
        [r0 * t0.cos(), r0 * t0.sin(), r1 * t1.cos(), r1 * t1.sin()].map(|z| mean + std * z)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn philox_known_answer() {
        // Known-answer vectors of Philox4x32-10 from Random123's kat_vectors.
        assert_eq!(
            philox4x32_10([0, 0, 0, 0], [0, 0]),
            [0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8]
        );
        assert_eq!(
            philox4x32_10([0xffffffff; 4], [0xffffffff; 2]),
            [0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd]
        );
        assert_eq!(
            philox4x32_10(
                [0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344],
                [0xa4093822, 0x299f31d0]
            ),
            [0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1]
        );
    }

    #[test]
    fn moments_and_independence_of_split() {
        let n = 200_001;
        let z = normal(n, 7, 0.0, 1.0);
        let mean = z.iter().sum::<f64>() / n as f64;
        let var = z.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n as f64;
        assert!(
            mean.abs() < 0.01 && (var - 1.0).abs() < 0.01,
            "mean {mean} var {var}"
        );
        // A prefix is the same numbers whatever the length (counter-based).
        assert_eq!(&normal(13, 7, 0.0, 1.0)[..], &z[..13]);
        let u = uniform(n, 3, -2.0, 5.0);
        assert!(u.iter().all(|&x| (-2.0..5.0).contains(&x)));
        let m = u.iter().sum::<f64>() / n as f64;
        assert!((m - 1.5).abs() < 0.02, "uniform mean {m}");
    }
}
