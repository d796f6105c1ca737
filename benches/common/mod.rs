//! Timing shared by the Rust benches (benches/torch_timing.py is the PyTorch side's twin):
//! `warmup` launches, a synchronize, then the mean over `iters` launches.

use flame::Result;
use std::time::Instant;

pub fn time<R>(
    dev: &flame::cuda::CudaDevice,
    warmup: usize,
    iters: usize,
    mut f: impl FnMut() -> Result<R>,
) -> Result<f64> {
    for _ in 0..warmup {
        f()?;
    }
    dev.synchronize()?;
    let t = Instant::now();
    for _ in 0..iters {
        f()?;
    }
    dev.synchronize()?;
    Ok(t.elapsed().as_secs_f64() / iters as f64)
}
