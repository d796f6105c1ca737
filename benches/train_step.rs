//! One full-size Flux-dev LoRA training step at 1024² (4096 image + 512 text tokens, batch 1,
//! bf16, random base weights, rank-16 LoRA on every Linear of the 57 blocks): flow-matching
//! forward, backward and the AdamW update, timed after a warm-up, with peak GPU memory.
//!
//! Arguments pick the memory plan: `--checkpoint none|all|every:N`, `--stream N` (N blocks'
//! weights kept in host memory, spread evenly over the 57 blocks, fetched `--prefetch K`
//! blocks ahead); `FLAME_GPU_MEMORY_LIMIT` caps FLAME's device memory. The line printed
//! has FLAME's peak, the driver's view of the device memory in use, host peak RSS and the
//! bytes streamed.

mod common;

use flame::autograd::Keep;
use flame::models::flux::{self, Flux, FluxConfig};
use flame::nn::{Adapters, LoraConfig, VarBuilder};
use flame::optim::{AdamConfig, AdamW, AdamW8bit, AdamW8bitConfig, Optimizer};
use flame::stream::{BlockExec, BlockStreamer, Checkpointing};
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
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arg = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1).cloned())
    };
    let checkpointing = match arg("--checkpoint").as_deref() {
        None | Some("none") => Checkpointing::Off,
        Some("all") => Checkpointing::All,
        Some(s) => match s.strip_prefix("every:").and_then(|n| n.parse().ok()) {
            Some(n) => Checkpointing::Every(n),
            None => panic!("--checkpoint none|all|every:N, got {s}"),
        },
    };
    let n_stream: usize = arg("--stream").map_or(0, |s| s.parse().expect("--stream N"));
    let prefetch: usize = arg("--prefetch").map_or(1, |s| s.parse().expect("--prefetch K"));
    let cfg = FluxConfig::dev();
    let prefixes = cfg.block_prefixes();
    let streamed: Vec<String> = (0..n_stream)
        .map(|k| prefixes[k * prefixes.len() / n_stream.max(1)].clone())
        .collect();
    let flag = |name: &str| args.iter().any(|a| a == name);
    let fp8 = flag("--fp8");
    let mut vb = VarBuilder::random(1, 0.02, DType::BF16, &dev)
        .with_fp8(fp8)?
        .with_adapters(adapters.clone())?;
    let streamer = if streamed.is_empty() {
        None
    } else {
        let s = BlockStreamer::new(&dev, streamed, prefetch);
        vb = vb.with_streamer(s.clone())?;
        Some(s)
    };
    let mut model = Flux::new(&vb, &cfg)?;
    model.exec = BlockExec {
        checkpointing,
        streamer: streamer.clone(),
        keep: Keep {
            attention: flag("--keep-attention"),
        },
    };
    let params = adapters.params()?;
    let n_params: usize = params.iter().map(|(_, t)| t.elem_count()).sum();
    let adam = AdamConfig {
        lr: 1e-4,
        ..Default::default()
    };
    let adam8bit = flag("--adam8bit");
    let mut opt: Box<dyn Optimizer> = if adam8bit {
        Box::new(AdamW8bit::new(
            params,
            AdamW8bitConfig {
                adam,
                ..Default::default()
            },
        )?)
    } else {
        Box::new(AdamW::new(params, adam)?)
    };
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
    let first = step()?;
    cuda.synchronize()?;
    cuda.reset_peak_memory();
    let mut losses = vec![first];
    let ms = common::time(cuda, 0, 3, &mut || {
        losses.push(step()?);
        Ok(())
    })? * 1e3;
    println!("losses: {losses:?}");
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    let weights: u64 = vb
        .params()?
        .iter()
        .map(|(_, t)| (t.elem_count() * t.dtype().size_in_bytes()) as u64)
        .sum();
    let (streamed_gib, per_step) = match &streamer {
        Some(s) => {
            let r = s.report()?;
            (gib(r.host_bytes), gib(r.uploaded_bytes) / 4.0)
        }
        None => (0.0, 0.0),
    };
    println!(
        "flame flux-dev LoRA step (rank 16, {:.1} M adapter params, checkpoint {checkpointing:?}, keep {:?}, base {}, {}, {n_stream} blocks streamed ({streamed_gib:.2} GiB, prefetch {prefetch}), cap {}): {ms:.1} ms | base weights {:.2} GiB | peak {:.2} GiB | device in use (driver) {:.2} GiB | host peak RSS {:.2} GiB | streamed {per_step:.2} GiB/step",
        n_params as f64 / 1e6,
        model.exec.keep,
        if fp8 { "fp8" } else { "bf16" },
        if adam8bit { "AdamW8bit" } else { "AdamW" },
        std::env::var("FLAME_GPU_MEMORY_LIMIT").map_or("none".to_string(), |b| format!("{:.1} GiB", b.parse::<f64>().unwrap_or(0.0) / (1u64 << 30) as f64)),
        gib(weights),
        gib(cuda.memory().peak),
        gib(cuda.device_memory_used()?),
        peak_rss_gib(),
    );
    Ok(())
}

/// The process's peak resident set (VmHWM) in GiB, 0 where /proc is not there.
fn peak_rss_gib() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
        })
        .map_or(0.0, |kb| kb / (1 << 20) as f64)
}
