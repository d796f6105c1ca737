//! Flash attention throughput (bf16), forward and backward, at the Flux shape and at L = 1024,
//! 4096 and 16384 for head dims 64 and 128 (B * L = 16384 tokens, H * D = 2048, as
//! FlashAttention's own benchmark), non-causal and causal; peak memory of each forward +
//! backward. Run on the GPU machine; benches/torch_attention.py times PyTorch's SDPA on the
//! same inputs in the same call, the same way. FLOPs: forward 4 B H Lq Lk D, backward 2.5x
//! that, halved when causal.
//!
//! Timing: ROUNDS rounds over all rows, each row's forward and forward + backward timed over
//! ITERS launches per round; a row reports the median round. The rounds interleave the rows,
//! so that none is always timed after minutes of load (in a single pass over the rows the
//! last one read 10% slower than alone, on an H100 drawing ~650 W).
//! FLAME_BENCH_FILTER=text keeps the rows whose "L=.. D=.. causal=.." contains the text
//! (e.g. "L=16384 D=64 causal=false", one shape under a profiler); FLAME_BENCH_PROFILE=1
//! adds each row's kernels of three forward+backward passes (flame::profile) beside the wall
//! time of those passes, to tell kernel time from time the GPU waited.

mod common;

use flame::nn::scaled_dot_product_attention;
use flame::{DType, Device, Grads, Result, Tensor};

const ITERS: usize = 10;
const ROUNDS: usize = 5;

struct Row {
    name: &'static str,
    dims: (usize, usize, usize, usize),
    causal: bool,
    x: Vec<Tensor>,
    leaves: Vec<Tensor>,
    fwd: Vec<f64>,
    both: Vec<f64>,
    peak: u64,
}

impl Row {
    fn forward(&self) -> Result<()> {
        let x = &self.x;
        scaled_dot_product_attention(&x[0], &x[1], &x[2], None, self.causal, None).map(|_| ())
    }

    fn pass(&self) -> Result<()> {
        let l = &self.leaves;
        let y = scaled_dot_product_attention(&l[0], &l[1], &l[2], None, self.causal, None)?;
        let mut g = Grads::new();
        y.backward_with_grad(&self.x[3], &mut g, false)
    }
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> Result<()> {
    let dev = Device::cuda(0)?;
    let Device::Cuda(cuda) = &dev else {
        return Ok(());
    };
    let mut shapes = vec![("flux", 1, 24, 4608, 128)];
    for d in [128, 64] {
        for l in [1024, 4096, 16384] {
            shapes.push(("", 16384 / l, 2048 / d, l, d));
        }
    }
    let filter = std::env::var("FLAME_BENCH_FILTER").unwrap_or_default();
    let profile = std::env::var("FLAME_BENCH_PROFILE").is_ok_and(|v| v == "1");
    let mut rows = vec![];
    for (name, b, h, l, d) in shapes {
        for causal in [false, true] {
            if !format!("L={l} D={d} causal={causal}").contains(&filter) {
                continue;
            }
            let x: Vec<Tensor> = (0..4)
                .map(|i| Tensor::randn((b, h, l, d), DType::BF16, &dev, 10 + i))
                .collect::<Result<_>>()?;
            let leaves = x[..3]
                .iter()
                .map(|t| t.detach().requires_grad_())
                .collect::<Result<Vec<_>>>()?;
            rows.push(Row {
                name,
                dims: (b, h, l, d),
                causal,
                x,
                leaves,
                fwd: vec![],
                both: vec![],
                peak: 0,
            });
        }
    }
    for round in 0..ROUNDS {
        for row in &mut rows {
            row.fwd
                .push(common::time(cuda, 2, ITERS, || row.forward())?);
            cuda.synchronize()?;
            let base = cuda.memory().in_use;
            cuda.reset_peak_memory();
            row.both.push(common::time(cuda, 2, ITERS, || row.pass())?);
            if round == 0 {
                row.peak = cuda.memory().peak - base;
            }
        }
    }
    for row in &rows {
        let (b, h, l, d) = row.dims;
        let (name, causal) = (row.name, row.causal);
        let (fwd, both) = (median(&row.fwd), median(&row.both));
        let flops = 4.0 * (b * h * l * l * d) as f64 / if causal { 2.0 } else { 1.0 };
        let bwd = both - fwd;
        println!(
            "flame {name:<4} B={b:<2} H={h:<2} L={l:<5} D={d:<3} causal={:<5} fwd {:8.3} ms {:6.1} TFLOP/s | bwd {:8.3} ms {:6.1} TFLOP/s | fwd+bwd peak +{:.0} MiB",
            causal,
            fwd * 1e3,
            flops / fwd / 1e12,
            bwd * 1e3,
            2.5 * flops / bwd / 1e12,
            row.peak as f64 / 1048576.0
        );
        if profile {
            flame::profile::enable(true);
            let t = std::time::Instant::now();
            for _ in 0..3 {
                row.pass()?;
            }
            cuda.synchronize()?;
            let wall = t.elapsed().as_secs_f64() * 1e3 / 3.0;
            let p = flame::profile::report()?;
            flame::profile::enable(false);
            let sum: f64 = p.kernels.iter().map(|r| r.ms).sum::<f64>() / 3.0;
            println!("  profiled pass: wall {wall:.3} ms, kernels {sum:.3} ms");
            for r in &p.kernels {
                println!(
                    "    {:<40} {:8.3} ms x{}",
                    r.category,
                    r.ms / 3.0,
                    r.kernels / 3
                );
            }
        }
    }
    Ok(())
}
