//! Full-size models, forward and forward + backward at 1024² (batch 1, bf16), with random
//! weights (no downloads on the GPU machine): Flux-dev (4096 image + 512 text tokens),
//! SD3.5-large (4096 image + 333 text tokens) and the SDXL UNet (128² latents, 77 tokens).
//! Weights are frozen and the backward runs to the input latents, as in adapter training.
//! benches/torch_models.py does the same with diffusers in the same call.
//! Usage: models [flux|sd35|sdxl]... (all when none is named).

mod common;

use flame::cuda::CudaDevice;
use flame::models::flux::{self, Flux, FluxConfig};
use flame::models::sd3::{Sd3, Sd3Config};
use flame::models::sdxl::{SdxlConfig, Unet};
use flame::nn::VarBuilder;
use flame::{DType, Device, Grads, Result, Tensor};

const DT: DType = DType::BF16;
/// Weight std: small enough that 57 random Flux blocks stay finite in bf16.
const STD: f64 = 0.02;

fn randn(shape: &[usize], seed: u64, dev: &Device) -> Result<Tensor> {
    Tensor::randn(shape.to_vec(), DT, dev, seed)
}

/// Times `f` (forward) and `f` + backward to the leaves; prints ms and peak memory.
fn report(
    name: &str,
    cuda: &CudaDevice,
    weights: u64,
    f: impl Fn() -> Result<Tensor>,
) -> Result<()> {
    let fwd = common::time(cuda, 1, 3, || {
        let _g = flame::no_grad();
        f()
    })?;
    cuda.synchronize()?;
    cuda.reset_peak_memory();
    let both = common::time(cuda, 1, 3, || {
        let y = f()?;
        let dy = y.ones_like()?;
        let mut g = Grads::new();
        y.backward_with_grad(&dy, &mut g, false)?;
        Ok(g)
    })?;
    let peak = cuda.memory().peak;
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    println!(
        "flame {name:<6} fwd {:8.1} ms | fwd+bwd {:8.1} ms | weights {:6.2} GiB | peak {:6.2} GiB",
        fwd * 1e3,
        both * 1e3,
        gib(weights),
        gib(peak)
    );
    Ok(())
}

fn weights_bytes(vb: &VarBuilder) -> Result<u64> {
    Ok(vb
        .params()?
        .iter()
        .map(|(_, t)| (t.elem_count() * t.dtype().size_in_bytes()) as u64)
        .sum())
}

fn main() -> Result<()> {
    let dev = Device::cuda(0)?;
    let Device::Cuda(cuda) = &dev else {
        return Ok(());
    };
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let want = |m: &str| args.is_empty() || args.iter().any(|a| a == m);
    if want("flux") {
        let vb = VarBuilder::random(1, STD, DT, &dev);
        let model = Flux::new(&vb, &FluxConfig::dev())?;
        let w = weights_bytes(&vb)?;
        let latents = randn(&[1, 16, 128, 128], 10, &dev)?;
        let img = flux::pack_latents(&latents)?.requires_grad_()?;
        let img_ids = flux::image_ids(64, 64, &dev)?;
        let txt = randn(&[1, 512, 4096], 11, &dev)?;
        let txt_ids = flux::text_ids(512, &dev)?;
        let y = randn(&[1, 768], 12, &dev)?;
        let t = Tensor::from_slice(&[0.7f32], 1, &dev)?;
        let g = Tensor::from_slice(&[3.5f32], 1, &dev)?;
        report("flux", cuda, w, || {
            model.forward(&img, &img_ids, &txt, &txt_ids, &t, &y, Some(&g))
        })?;
    }
    if want("sd35") {
        let vb = VarBuilder::random(2, STD, DT, &dev);
        let model = Sd3::new(&vb, &Sd3Config::large())?;
        let w = weights_bytes(&vb)?;
        let x = randn(&[1, 16, 128, 128], 20, &dev)?.requires_grad_()?;
        let ctx = randn(&[1, 333, 4096], 21, &dev)?;
        let y = randn(&[1, 2048], 22, &dev)?;
        let t = Tensor::from_slice(&[700f32], 1, &dev)?;
        report("sd35", cuda, w, || model.forward(&x, &t, &ctx, &y))?;
    }
    if want("sdxl") {
        let vb = VarBuilder::random(3, STD, DT, &dev);
        let cfg = SdxlConfig::base();
        let model = Unet::new(&vb, &cfg)?;
        let w = weights_bytes(&vb)?;
        let x = randn(&[1, 4, 128, 128], 30, &dev)?.requires_grad_()?;
        let ctx = randn(&[1, 77, 2048], 31, &dev)?;
        let y = randn(&[1, 2816], 32, &dev)?;
        let t = Tensor::from_slice(&[700f32], 1, &dev)?;
        report("sdxl", cuda, w, || model.forward(&x, &t, &ctx, &y))?;
    }
    Ok(())
}
