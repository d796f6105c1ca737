//! Helpers shared by the op test files: the tolerance table (`tolerance`), builders, loop
//! references.
#![allow(dead_code)]

use flame::{DType, Device, Result, Shape, Tensor};

pub type R = Result<()>;
pub type UnaryFn = fn(&Tensor) -> Result<Tensor>;
pub type BinaryFn = fn(&Tensor, &Tensor) -> Result<Tensor>;
pub type BinaryCase = (&'static str, BinaryFn, fn(f64, f64) -> f64);

pub const CPU: Device = Device::Cpu;
pub const FLOATS: [DType; 4] = [DType::F64, DType::F32, DType::BF16, DType::F16];
pub const ALL: [DType; 5] = [DType::F64, DType::F32, DType::BF16, DType::F16, DType::U32];

pub mod devices;
pub mod eight_bit;
pub mod gguf;
pub mod optim;
pub mod tolerance;

/// (atol, rtol) against an f64 reference, from the one tolerance table
/// (`tolerance::Against::F64`).
pub fn tol(dt: DType) -> (f64, f64) {
    tolerance::tolerance(tolerance::Against::F64, dt)
}

/// |got - want| <= atol + rtol * mag, where mag is |want| unless a larger magnitude (the sum of
/// |terms| of a dot product or a sum, where the rounding error scales with it) is given.
pub fn check_mag(what: &str, got: &Tensor, want: &[f64], mag: Option<&[f64]>, dt: DType) {
    assert_eq!(got.dtype(), dt, "{what}: dtype");
    let g = v(got);
    assert_eq!(g.len(), want.len(), "{what}: element count");
    let (atol, rtol) = tol(dt);
    for (i, (&x, &w)) in g.iter().zip(want).enumerate() {
        let m = mag.map_or(w.abs(), |m| m[i]);
        let ok = (x - w).abs() <= atol + rtol * m || (x.is_nan() && w.is_nan());
        assert!(ok, "{what} ({dt}): element {i} is {x}, want {w}");
    }
}

pub fn check(what: &str, got: &Tensor, want: &[f64], dt: DType) {
    check_mag(what, got, want, None, dt)
}

/// Asserts the elements of `t` are exactly `want`.
pub fn eq(t: &Tensor, want: &[f64]) {
    assert_eq!(v(t), want);
}

/// The elements as f64.
pub fn v(t: &Tensor) -> Vec<f64> {
    t.to_vec_f64().unwrap()
}

/// A tensor of `dt` from f64 values.
pub fn tt(vals: &[f64], shape: impl Into<Shape>, dt: DType) -> Tensor {
    let t = Tensor::from_slice(vals, shape, &CPU).unwrap();
    t.to_dtype(dt).unwrap()
}

pub fn randn(shape: impl Into<Shape>, dt: DType, seed: u64) -> Tensor {
    Tensor::randn(shape, dt, &CPU, seed).unwrap()
}

pub fn arange(lo: f64, hi: f64, dt: DType) -> Tensor {
    Tensor::arange(lo, hi, dt, &CPU).unwrap()
}

pub fn ids(vals: &[u32], shape: impl Into<Shape>) -> Tensor {
    Tensor::from_slice(vals, shape, &CPU).unwrap()
}

// ----- loop references ------------------------------------------------------------------------

pub fn unravel(mut i: usize, dims: &[usize]) -> Vec<usize> {
    let mut idx = vec![0; dims.len()];
    for d in (0..dims.len()).rev() {
        idx[d] = i % dims[d];
        i /= dims[d];
    }
    idx
}

pub fn ravel(idx: &[usize], dims: &[usize]) -> usize {
    idx.iter().zip(dims).fold(0, |acc, (&i, &d)| acc * d + i)
}

/// Numpy broadcasting of `f` over a (dims ad) and b (dims bd), by loops.
pub fn broadcast_ref(
    a: &[f64],
    ad: &[usize],
    b: &[f64],
    bd: &[usize],
    f: fn(f64, f64) -> f64,
) -> Vec<f64> {
    let rank = ad.len().max(bd.len());
    let pad = |d: &[usize]| [vec![1; rank - d.len()], d.to_vec()].concat();
    let (pa, pb) = (pad(ad), pad(bd));
    let out: Vec<usize> = pa.iter().zip(&pb).map(|(&x, &y)| x.max(y)).collect();
    // The index into an operand: 0 along its stretched (size-1) dims.
    let at = |idx: &[usize], d: &[usize]| {
        let i: Vec<usize> = idx.iter().zip(d).map(|(&i, &s)| i % s).collect();
        ravel(&i, d)
    };
    let n: usize = out.iter().product();
    (0..n)
        .map(|i| unravel(i, &out))
        .map(|idx| f(a[at(&idx, &pa)], b[at(&idx, &pb)]))
        .collect()
}

#[derive(Clone, Copy, PartialEq, Debug)]
pub enum Red {
    Sum,
    Max,
    Min,
    ArgMax,
    ArgMin,
}

/// Reduction over `red` (keepdim layout), by a loop in row-major order: the first extreme wins.
/// Also returns the sum of |x| of each output, the scale of a sum's rounding error.
pub fn reduce_ref(x: &[f64], dims: &[usize], red: &[usize], op: Red) -> (Vec<f64>, Vec<f64>) {
    let mut od = dims.to_vec();
    red.iter().for_each(|&d| od[d] = 1);
    let n: usize = od.iter().product();
    let mut acc: Vec<Option<(f64, usize)>> = vec![None; n];
    let mut mag = vec![0.0; n];
    for (i, &x) in x.iter().enumerate() {
        let mut idx = unravel(i, dims);
        let pos = idx[red[0]];
        red.iter().for_each(|&d| idx[d] = 0);
        let k = ravel(&idx, &od);
        mag[k] += x.abs();
        acc[k] = match (acc[k], op) {
            (None, _) => Some((x, pos)),
            (Some((s, p)), Red::Sum) => Some((s + x, p)),
            (Some((m, _)), Red::Max | Red::ArgMax) if x > m => Some((x, pos)),
            (Some((m, _)), Red::Min | Red::ArgMin) if x < m => Some((x, pos)),
            (keep, _) => keep,
        };
    }
    let arg = matches!(op, Red::ArgMax | Red::ArgMin);
    let out = acc
        .iter()
        .map(|a| a.map(|(x, p)| if arg { p as f64 } else { x }).unwrap());
    (out.collect(), mag)
}

/// (B, M, K) @ (B, K, N) by the naive triple loop; also the sums of |a b| per output.
pub fn matmul_ref(a: &[f64], b: &[f64], [bs, m, k, n]: [usize; 4]) -> (Vec<f64>, Vec<f64>) {
    let (mut out, mut mag) = (vec![0.0; bs * m * n], vec![0.0; bs * m * n]);
    for z in 0..bs {
        for i in 0..m {
            for j in 0..n {
                for p in 0..k {
                    let xy = a[(z * m + i) * k + p] * b[(z * k + p) * n + j];
                    out[(z * m + i) * n + j] += xy;
                    mag[(z * m + i) * n + j] += xy.abs();
                }
            }
        }
    }
    (out, mag)
}

/// erf by its Maclaurin series (accurate to ~1e-15 for |x| <= 2).
pub fn erf_ref(x: f64) -> f64 {
    let (mut term, mut sum) = (x, x);
    for n in 1..80 {
        term *= -x * x / n as f64;
        sum += term / (2 * n + 1) as f64;
    }
    sum * 2.0 / std::f64::consts::PI.sqrt()
}

pub struct Lcg(pub u64);

impl Lcg {
    pub fn next(&mut self, n: usize) -> usize {
        self.0 = self.0.wrapping_mul(6_364_136_223_846_793_005);
        self.0 = self.0.wrapping_add(1_442_695_040_888_963_407);
        ((self.0 >> 33) % n as u64) as usize
    }
}

/// A unique path in the temp dir, removed on drop.
pub struct TempFile(std::path::PathBuf);

impl TempFile {
    pub fn new(tag: &str) -> Self {
        use std::sync::atomic::{AtomicUsize, Ordering};
        static N: AtomicUsize = AtomicUsize::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        TempFile(std::env::temp_dir().join(format!(
            "flame-test-{}-{tag}-{n}.safetensors",
            std::process::id()
        )))
    }
    pub fn path(&self) -> &std::path::Path {
        &self.0
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// max |got - want| / max |want|, in f64 on the host (parity against a reference output).
pub fn rel_err(got: &Tensor, want: &Tensor) -> f64 {
    assert_eq!(got.dims(), want.dims(), "shapes");
    let (g, w) = (got.to_vec_f64().unwrap(), want.to_vec_f64().unwrap());
    let scale = w.iter().fold(0f64, |m, v| m.max(v.abs()));
    let err = g
        .iter()
        .zip(&w)
        .fold(0f64, |m, (a, b)| m.max((a - b).abs()));
    assert!(scale > 0.0, "an all-zero reference proves nothing");
    err / scale
}

/// Checks `got` against `want` within `tol` (`rel_err`), printing and returning the error.
pub fn check_rel(what: &str, got: &Tensor, want: &Tensor, tol: f64) -> f64 {
    let e = rel_err(got, want);
    println!("{what}: max rel err {e:.2e}");
    assert!(e <= tol, "{what}: error {e:e} > {tol:e}");
    e
}
