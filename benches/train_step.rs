//! One full-size Flux-dev LoRA training step at 1024² (4096 image + 512 text tokens, batch 1,
//! bf16, random base weights, rank-16 LoRA on every Linear of the 57 blocks): flow-matching
//! forward, backward and the AdamW update, timed after a warm-up, with peak GPU memory.

mod common;

use flame::models::flux::{self, Flux, FluxConfig};
use flame::nn::{Adapters, LoraConfig, VarBuilder};
use flame::optim::{AdamConfig, AdamW, Optimizer};
use flame::train::{flow_matching, weighted_mse, TimestepSampling};
use flame::{DType, Device, Grads, Result, Tensor};

fn main() -> Result<()> {
    let dev = Device::cuda(0)?;
    let Device::Cuda(cuda) = &dev else {
        return Ok(());
    };
    let adapters = Adapters::new(LoraConfig {
        rank: 16,
        alpha: 16.0,
        dropout: 0.0,
        targets: vec!["double_blocks.*".into(), "single_blocks.*".into()],
        seed: 0,
    })?;
    let vb = VarBuilder::random(1, 0.02, DType::BF16, &dev).with_adapters(adapters.clone())?;
    let cfg = FluxConfig::dev();
    let model = Flux::new(&vb, &cfg)?;
    let params = adapters.params()?;
    let n_params: usize = params.iter().map(|(_, t)| t.elem_count()).sum();
    let mut opt = AdamW::new(
        params,
        AdamConfig {
            lr: 1e-4,
            ..Default::default()
        },
    )?;
    let x0 = Tensor::randn((1, 16, 128, 128), DType::BF16, &dev, 10)?;
    let txt = Tensor::randn((1, 512, 4096), DType::BF16, &dev, 11)?;
    let y = Tensor::randn((1, 768), DType::BF16, &dev, 12)?;
    let (img_ids, txt_ids) = (flux::image_ids(64, 64, &dev)?, flux::text_ids(512, &dev)?);
    let g = Tensor::full(1.0, 1, DType::F32, &dev)?;
    let sampling = TimestepSampling::FluxShift {
        mean: 0.0,
        std: 1.0,
    };
    let mut seed = 100;
    let mut step = || -> Result<f64> {
        seed += 1;
        let noise = Tensor::randn((1, 16, 128, 128), DType::BF16, &dev, seed)?;
        let t = sampling.sample(1, 4096, seed, &dev)?;
        let (xt, target) = flow_matching(&x0, &noise, &t)?;
        let out = model.forward(
            &flux::pack_latents(&xt)?,
            &img_ids,
            &txt,
            &txt_ids,
            &t,
            &y,
            Some(&g),
        )?;
        let loss = weighted_mse(&flux::unpack_latents(&out, 64, 64)?, &target, None)?;
        let mut grads = Grads::new();
        loss.backward_into(&mut grads)?;
        opt.step(&grads)?;
        loss.to_scalar_f64()
    };
    step()?;
    cuda.synchronize()?;
    cuda.reset_peak_memory();
    let ms = common::time(cuda, 0, 3, &mut step)? * 1e3;
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    let weights: u64 = vb
        .params()?
        .iter()
        .map(|(_, t)| (t.elem_count() * 2) as u64)
        .sum();
    println!(
        "flame flux-dev LoRA step (rank 16, {:.1} M adapter params): {ms:.1} ms | base weights {:.2} GiB | peak {:.2} GiB",
        n_params as f64 / 1e6,
        gib(weights),
        gib(cuda.memory().peak)
    );
    Ok(())
}
