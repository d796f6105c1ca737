//! The tiny demo of examples/flux-tiny.toml: a Flux with random weights (fixed seed) and a
//! synthetic dataset, made on first use so the example needs no download.

use crate::models::flux::{Flux, FluxConfig};
use crate::nn::VarBuilder;
use crate::{DType, Device, Error, Result, Tensor};
use std::path::Path;

/// The tiny Flux of `create_if_missing = "flux-tiny"`: 4 latent channels, hidden 32, one
/// block of each kind, text width 32, pooled 16.
pub fn flux_tiny_config() -> FluxConfig {
    FluxConfig {
        in_channels: 16,
        out_channels: 16,
        vec_in_dim: 16,
        context_in_dim: 32,
        hidden_size: 32,
        mlp_ratio: 4.0,
        num_heads: 2,
        depth: 1,
        depth_single_blocks: 1,
        axes_dim: vec![4, 6, 6],
        theta: 10_000.0,
        qkv_bias: true,
        guidance_embed: true,
    }
}

/// [`flux_tiny_config`] as a diffusers `config.json` (what the loader reads: a single file's
/// shapes cannot give its RoPE axes).
pub fn flux_tiny_diffusers_config() -> serde_json::Value {
    let c = flux_tiny_config();
    serde_json::json!({
        "patch_size": 1,
        "in_channels": c.in_channels,
        "out_channels": c.out_channels,
        "num_layers": c.depth,
        "num_single_layers": c.depth_single_blocks,
        "attention_head_dim": c.hidden_size / c.num_heads,
        "num_attention_heads": c.num_heads,
        "joint_attention_dim": c.context_in_dim,
        "pooled_projection_dim": c.vec_in_dim,
        "guidance_embeds": c.guidance_embed,
        "axes_dims_rope": c.axes_dim,
    })
}

/// Seed of the tiny model's weights and of the synthetic data.
const TINY_SEED: u64 = 20_261_122;

fn create_dir(dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|source| Error::Io {
        path: dir.to_path_buf(),
        source,
    })
}

/// Writes the tiny Flux's weights (BFL keys) to `path`.
pub fn make_tiny_flux(path: &Path) -> Result<()> {
    let vb = VarBuilder::random(TINY_SEED, 0.08, DType::F32, &host_device()?);
    Flux::new(&vb, &flux_tiny_config())?;
    let params = vb.params()?;
    if let Some(dir) = path.parent() {
        create_dir(dir)?;
    }
    crate::safetensors::save(params.iter().map(|(k, t)| (k.as_str(), t)), path)
}

/// `n` synthetic samples for a model with `c` latent channels, `ctx` text width and
/// `pooled` pooled width: latents made of a few smooth patterns (something to learn),
/// random text features.
pub fn make_synthetic(dir: &Path, n: usize, (c, ctx, pooled): (usize, usize, usize)) -> Result<()> {
    let device = host_device()?;
    let tmp = dir.with_extension("tmp-synthetic");
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(|source| Error::Io {
            path: tmp.clone(),
            source,
        })?;
    }
    create_dir(&tmp)?;
    for i in 0..n {
        let k = (i % 4) as f32;
        let lat: Vec<f32> = (0..c * 8 * 8)
            .map(|j| {
                let (ch, y, x) = (j / 64, (j / 8) % 8, j % 8);
                ((x as f32 * (0.5 + k * 0.3) + ch as f32).sin() + (y as f32 * 0.7 - k).cos()) * 0.8
            })
            .collect();
        let seed = TINY_SEED ^ (i as u64 + 1);
        let sample = [
            ("latents", Tensor::from_vec(lat, (c, 8, 8), &device)?),
            (
                "context",
                Tensor::randn((6, ctx), DType::F32, &device, seed)?.affine(1.0, k as f64 * 0.2)?,
            ),
            (
                "pooled",
                Tensor::randn(pooled, DType::F32, &device, seed ^ 7)?,
            ),
        ];
        let p = tmp.join(format!("sample-{i:04}.safetensors"));
        crate::safetensors::save(sample.iter().map(|(k, t)| (*k, t)), p)?;
    }
    // The folder appears whole or not at all.
    std::fs::rename(&tmp, dir).map_err(|source| Error::Io {
        path: dir.to_path_buf(),
        source,
    })
}

/// The demo is made on the host: the CPU backend where built, else the GPU.
fn host_device() -> Result<Device> {
    #[cfg(feature = "cpu-ref")]
    {
        Ok(Device::Cpu)
    }
    #[cfg(not(feature = "cpu-ref"))]
    {
        #[cfg(feature = "cuda")]
        {
            Device::cuda(0)
        }
        #[cfg(not(feature = "cuda"))]
        {
            Err(Error::NoBackend("making the demo model"))
        }
    }
}
