//! Flash attention throughput (bf16), forward and backward, at the Flux shape and at L = 1024,
//! 4096 and 16384 for head dims 64 and 128 (B * L = 16384 tokens, H * D = 2048, as
//! FlashAttention's own benchmark), non-causal and causal; peak memory at L = 16384. Run on
//! the GPU machine; benches/torch_attention.py times PyTorch's SDPA on the same inputs in the
//! same call. FLOPs: forward 4 B H Lq Lk D, backward 2.5x that, halved when causal.
//! FLAME_BENCH_FILTER=text keeps the rows whose "L=.. D=.. causal=.." contains the text
//! (e.g. "L=16384 D=64 causal=false", one shape under a profiler); FLAME_BENCH_PROFILE=1
//! adds each row's kernels of three forward+backward passes (flame::profile) beside the wall
//! time of those passes, to tell kernel time from time the GPU waited.

mod common;

use flame::nn::scaled_dot_product_attention;
use flame::{DType, Device, Grads, Result, Tensor};

const ITERS: usize = 10;

fn time<R>(dev: &flame::cuda::CudaDevice, f: impl FnMut() -> Result<R>) -> Result<f64> {
    common::time(dev, 2, ITERS, f)
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
            let fwd = time(cuda, || {
                scaled_dot_product_attention(&x[0], &x[1], &x[2], None, causal, None).map(|_| ())
            })?;
            cuda.synchronize()?;
            let base = cuda.memory().in_use;
            cuda.reset_peak_memory();
            let pass = || {
                let y = scaled_dot_product_attention(
                    &leaves[0], &leaves[1], &leaves[2], None, causal, None,
                )?;
                let mut g = Grads::new();
                y.backward_with_grad(&x[3], &mut g, false)
            };
            let both = time(cuda, pass)?;
            let peak = cuda.memory().peak - base;
            if profile {
                flame::profile::enable(true);
                let t = std::time::Instant::now();
                for _ in 0..3 {
                    pass()?;
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
            let flops = 4.0 * (b * h * l * l * d) as f64 / if causal { 2.0 } else { 1.0 };
            let bwd = both - fwd;
            println!(
                "flame {name:<4} B={b:<2} H={h:<2} L={l:<5} D={d:<3} causal={:<5} fwd {:8.3} ms {:6.1} TFLOP/s | bwd {:8.3} ms {:6.1} TFLOP/s | fwd+bwd peak +{:.0} MiB",
                causal,
                fwd * 1e3,
                flops / fwd / 1e12,
                bwd * 1e3,
                2.5 * flops / bwd / 1e12,
                peak as f64 / 1048576.0
            );
        }
    }
    Ok(())
}
