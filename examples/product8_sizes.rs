//! Where 8-bit products pay: the forward and the input gradient of one frozen Linear (no
//! bias, bf16 activations) timed with its weight in bf16 and with FP8 and int8 products, over
//! the products' sizes of SDXL, SD3.5 and Flux-dev at 1024² (tokens x in x out). An 8-bit
//! product adds a quantization pass over its input (and, for int8, a scaling pass over its
//! sums): below some size those passes and their launches cost more than the faster GEMM
//! saves. Needs a GPU.
//!
//!     cargo run --release --features cuda --example product8_sizes -- --reps 50

#![cfg_attr(not(feature = "cuda"), allow(unused))]

use anyhow::Context;
use argh::FromArgs;
use flame::backend::fp8::Code8;
use flame::nn::{Linear, VarBuilder};
use flame::{DType, Device, Tensor};
use std::collections::HashMap;
use std::time::Instant;

#[derive(FromArgs)]
/// Time a frozen Linear's forward and input gradient with bf16, FP8 and int8 products.
struct Args {
    /// timed repetitions of each (after five untimed)
    #[argh(option, default = "50")]
    reps: usize,
}

/// (tokens, in, out) of the models' Linears at 1024², smallest first.
const SIZES: &[(usize, usize, usize)] = &[
    (77, 2048, 640),
    (1024, 1280, 1280),
    (4096, 640, 640),
    (512, 3072, 3072),
    (1024, 1280, 10240),
    (1024, 5120, 1280),
    (4096, 640, 5120),
    (4096, 2560, 640),
    (4429, 2432, 2432),
    (4096, 3072, 3072),
    (4096, 3072, 9216),
    (4608, 3072, 21504),
    (4608, 15360, 3072),
];

#[cfg(not(feature = "cuda"))]
fn main() -> anyhow::Result<()> {
    anyhow::bail!("product8_sizes needs the cuda feature and a GPU")
}

#[cfg(feature = "cuda")]
fn main() -> anyhow::Result<()> {
    let args: Args = argh::from_env();
    let dev = Device::cuda(0).context("a GPU")?;
    let Device::Cuda(cuda) = &dev else {
        anyhow::bail!("not a CUDA device");
    };
    println!("tokens x in x out | GMAC | bf16 ms | fp8 ms (x of bf16) | int8 ms (x of bf16)");
    for &(rows, inp, out) in SIZES {
        let mut times = vec![];
        for code in [None, Some(Code8::E4m3), Some(Code8::Int8)] {
            let mut w = HashMap::new();
            w.insert(
                "l.weight".to_string(),
                Tensor::randn_normal(
                    0.0,
                    (1.0 / inp as f64).sqrt(),
                    (out, inp),
                    DType::F32,
                    &dev,
                    1,
                )?,
            );
            let vb = VarBuilder::from_tensors(w, DType::BF16, &dev);
            let vb = match code {
                Some(c) => vb.with_products(Some(c))?,
                None => vb,
            };
            let lin = Linear::new(&vb.pp("l"), inp, out, false)?;
            let x = Tensor::randn((rows, inp), DType::BF16, &dev, 2)?.requires_grad_()?;
            let dy = Tensor::randn((rows, out), DType::BF16, &dev, 3)?;
            let step = || -> anyhow::Result<()> {
                let y = lin.forward(&x)?;
                let g = y.mul(&dy)?.sum_all()?.backward()?;
                g.get(&x).context("no input gradient")?;
                Ok(())
            };
            for _ in 0..5 {
                step()?;
            }
            cuda.synchronize()?;
            let t = Instant::now();
            for _ in 0..args.reps {
                step()?;
            }
            cuda.synchronize()?;
            times.push(t.elapsed().as_secs_f64() * 1e3 / args.reps as f64);
        }
        let gmac = (rows * inp * out) as f64 / 1e9;
        println!(
            "{rows} x {inp} x {out} | {gmac:.1} | {:.3} | {:.3} ({:.2}) | {:.3} ({:.2})",
            times[0],
            times[1],
            times[1] / times[0],
            times[2],
            times[2] / times[0]
        );
    }
    Ok(())
}
