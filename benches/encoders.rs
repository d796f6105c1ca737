//! Full-size text encoders and the Flux autoencoder, bf16 on the GPU, from the random weights
//! benches/torch_encoders.py saves (the same files, so both sides load what users' files
//! hold): T5-XXL on 512 tokens, CLIP-L and bigG on 77, the VAE's encode of a 1024² image and
//! decode of 128² latents. Load time, then 2 warm-up and 5 timed runs; peak memory per model
//! (weights included), as the Python twin measures it in the same call.
//! Usage: encoders DIR (holding text_encoder/, text_encoder_g/, text_encoder_2/, vae/; a
//! pipeline's folder without text_encoder_g/ skips bigG).

mod common;

use flame::encoders::{AutoencoderKl, ClipTextModel, T5Encoder};
use flame::{DType, Device, Result, Tensor};
use std::time::Instant;

const GIB: f64 = (1u64 << 30) as f64;

fn ids(n: usize, vocab: u32, last: Option<u32>, seed: u64, dev: &Device) -> Result<Tensor> {
    let mut state = seed;
    let mut v: Vec<u32> = (0..n)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 33) % vocab as u64) as u32
        })
        .collect();
    if let (Some(l), Some(x)) = (last, v.last_mut()) {
        *x = l;
    }
    Tensor::from_vec(v, (1, n), dev)
}

fn main() -> Result<()> {
    let dir = std::path::PathBuf::from(std::env::args().nth(1).unwrap_or_else(|| ".".into()));
    let dev = Device::cuda(0)?;
    let Device::Cuda(cuda) = &dev else {
        return Ok(());
    };
    let dt = DType::BF16;
    let report = |name: &str, load_s: f64, weights: u64, f: &dyn Fn() -> Result<Tensor>| {
        cuda.synchronize()?;
        cuda.reset_peak_memory();
        let s = common::time(cuda, 2, 5, || {
            let _g = flame::no_grad();
            f()
        })?;
        println!(
            "flame {name:<12} {:8.1} ms | weights {:6.2} GiB | peak {:6.2} GiB | load {load_s:.1} s",
            s * 1e3,
            weights as f64 / GIB,
            cuda.memory().peak as f64 / GIB
        );
        Ok::<(), flame::Error>(())
    };
    let bytes = |vb: &flame::nn::VarBuilder| -> Result<u64> {
        Ok(vb
            .params()?
            .iter()
            .map(|(_, t)| (t.elem_count() * t.dtype().size_in_bytes()) as u64)
            .sum())
    };
    let ids77 = ids(77, 49406, Some(49407), 1, &dev)?;
    for (name, folder) in [("clip_l", "text_encoder"), ("clip_g", "text_encoder_g")] {
        if !dir.join(folder).exists() {
            // A pipeline's folder (Flux-dev's has no bigG).
            println!(
                "flame {name}: no {folder}/ under {}, skipped",
                dir.display()
            );
            continue;
        }
        let t = Instant::now();
        let (m, vb) = ClipTextModel::load(dir.join(folder), None, dt, &dev, None)?;
        cuda.synchronize()?;
        let load = t.elapsed().as_secs_f64();
        report(name, load, bytes(&vb)?, &|| {
            Ok(m.forward(&ids77, None)?.penultimate)
        })?;
    }
    {
        let t = Instant::now();
        let (m, vb) = T5Encoder::load(dir.join("text_encoder_2"), None, dt, &dev, None)?;
        cuda.synchronize()?;
        let load = t.elapsed().as_secs_f64();
        let ids512 = ids(512, 32000, None, 2, &dev)?;
        report("t5xxl", load, bytes(&vb)?, &|| m.forward(&ids512, None))?;
        let want = m
            .forward(&ids512, None)?
            .to_dtype(DType::F32)?
            .to_vec::<f32>()?;
        drop((m, vb));
        // Its blocks streamed from page-locked host memory, two ahead: as the loaders stream
        // it (uncoded), then with the weights coded for the link as a training step's
        // streamer codes them. A load's time, its first pass's (the blocks packed at its
        // first fetch), what the streamer's host work took, and dropping the encoder (its
        // page-locked memory freed).
        for coded in [false, true] {
            let t = Instant::now();
            let (m, vb) =
                T5Encoder::load_streamed(dir.join("text_encoder_2"), None, dt, &dev, None, 2)?;
            let Some(streamer) = m.exec().streamer.clone() else {
                return Err(flame::Error::Stream(
                    "the streamed T5 has no streamer".into(),
                ));
            };
            streamer.set_wire_code(coded)?;
            cuda.synchronize()?;
            let load = t.elapsed().as_secs_f64();
            let t = Instant::now();
            {
                let _g = flame::no_grad();
                m.forward(&ids512, None)?;
            }
            cuda.synchronize()?;
            let first = t.elapsed().as_secs_f64();
            let r = streamer.report()?;
            let name = if coded { "t5xxl coded" } else { "t5xxl stream" };
            report(name, load, bytes(&vb)?, &|| m.forward(&ids512, None))?;
            let same = m
                .forward(&ids512, None)?
                .to_dtype(DType::F32)?
                .to_vec::<f32>()?
                == want;
            let t = Instant::now();
            drop((m, vb, streamer));
            let dropped = t.elapsed().as_secs_f64();
            println!(
                "flame {name}: first pass {first:.2} s; weights into host memory {:.2} s, \
                 packed {:.2} s ({:.2} GiB held, {:.2} GiB on the link a pass); dropped in \
                 {dropped:.2} s; output equals resident: {same}",
                r.adopt_us as f64 / 1e6,
                r.seal_us as f64 / 1e6,
                r.host_bytes as f64 / GIB,
                r.uploaded_bytes as f64 / GIB / r.forwards.max(1) as f64,
            );
        }
    }
    let t = Instant::now();
    let (vae, vb) = AutoencoderKl::load(dir.join("vae"), None, None, dt, &dev, None)?;
    cuda.synchronize()?;
    let load = t.elapsed().as_secs_f64();
    let img = Tensor::rand((1, 3, 1024, 1024), DType::F32, &dev, 3)?
        .affine(2.0, -1.0)?
        .to_dtype(dt)?;
    let w = bytes(&vb)?;
    report("vae encode", load, w, &|| Ok(vae.encode(&img)?.mean))?;
    let z = {
        let _g = flame::no_grad();
        vae.encode(&img)?.mean
    };
    report("vae decode", 0.0, w, &|| vae.decode(&z))?;
    // Tiled (512-pixel tiles): the memory a small card would need.
    let mut tiled = vae.clone();
    tiled.tiling = Some(flame::encoders::VaeTiling::new(512));
    report("vae enc tile", 0.0, w, &|| Ok(tiled.encode(&img)?.mean))?;
    report("vae dec tile", 0.0, w, &|| tiled.decode(&z))?;
    Ok(())
}
