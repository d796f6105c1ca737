//! Flux (dev and schnell), named by BFL's checkpoint keys (`flux1-dev.safetensors`).
//! Shape letters: B batch, L image tokens, T text tokens, D hidden size, H heads.
//!
//! Architecture facts from BFL's reference code (black-forest-labs/flux, `model.py`,
//! `modules/layers.py`) and diffusers' `FluxTransformer2DModel`, which computes the same.

mod family;
mod keys;
mod model;

pub use crate::models::common::MlpEmbedder;
pub use family::FAMILY;
pub use keys::diffusers_map;
pub use model::{DoubleStreamBlock, Flux, SingleStreamBlock};

use super::checkpoint::{cfg_opt, cfg_usize, cfg_usize_list};
use super::family::{load_as, LoadOptions};
use crate::nn::VarBuilder;
use crate::{DType, Device, Error, Result, Tensor};
use std::path::Path;

/// Flux's hyperparameters (BFL `FluxParams`).
#[derive(Clone, Debug, PartialEq)]
pub struct FluxConfig {
    /// Packed latent channels: 16 latent channels x 2x2 patch = 64.
    pub in_channels: usize,
    /// Packed channels of the predicted velocity (64, as `in_channels`).
    pub out_channels: usize,
    /// Pooled text (CLIP-L) width.
    pub vec_in_dim: usize,
    /// Text token (T5-XXL) width.
    pub context_in_dim: usize,
    /// Width D of the token streams (3072).
    pub hidden_size: usize,
    /// MLP hidden width as a multiple of `hidden_size` (4.0).
    pub mlp_ratio: f64,
    /// Attention heads H (24); `hidden_size / num_heads` is the head dim.
    pub num_heads: usize,
    /// Double-stream blocks.
    pub depth: usize,
    /// Single-stream blocks.
    pub depth_single_blocks: usize,
    /// RoPE dims per position axis; they sum to the head dim.
    pub axes_dim: Vec<usize>,
    /// RoPE base frequency (10 000).
    pub theta: f64,
    /// Whether the QKV projections have a bias.
    pub qkv_bias: bool,
    /// dev has a guidance embedding; schnell does not.
    pub guidance_embed: bool,
}

impl FluxConfig {
    /// FLUX.1-dev (BFL `configs["flux-dev"]`).
    pub fn dev() -> Self {
        FluxConfig {
            in_channels: 64,
            out_channels: 64,
            vec_in_dim: 768,
            context_in_dim: 4096,
            hidden_size: 3072,
            mlp_ratio: 4.0,
            num_heads: 24,
            depth: 19,
            depth_single_blocks: 38,
            axes_dim: vec![16, 56, 56],
            theta: 10_000.0,
            qkv_bias: true,
            guidance_embed: true,
        }
    }

    /// FLUX.1-schnell: dev without the guidance embedding.
    pub fn schnell() -> Self {
        FluxConfig {
            guidance_embed: false,
            ..Self::dev()
        }
    }

    /// Width of one attention head: `hidden_size / num_heads` (128).
    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_heads
    }

    /// Hidden width of the blocks' MLPs: `hidden_size * mlp_ratio`, truncated.
    pub fn mlp_hidden(&self) -> usize {
        (self.hidden_size as f64 * self.mlp_ratio) as usize
    }

    /// The blocks' key prefixes in execution order (what `BlockExec` and `BlockStreamer`
    /// name them by): `double_blocks.0..depth`, then `single_blocks.0..depth_single_blocks`.
    pub fn block_prefixes(&self) -> Vec<String> {
        (0..self.depth)
            .map(|i| format!("double_blocks.{i}"))
            .chain((0..self.depth_single_blocks).map(|i| format!("single_blocks.{i}")))
            .collect()
    }

    /// Checks the sizes fit together: heads divide `hidden_size`, and `axes_dim` is even
    /// and sums to the head dim.
    pub fn validate(&self) -> Result<()> {
        let bad = |msg: String| Err(Error::Config { path: None, msg });
        if self.num_heads == 0 || self.hidden_size % self.num_heads != 0 {
            return bad(format!(
                "flux: hidden_size {} is not a multiple of num_heads {}",
                self.hidden_size, self.num_heads
            ));
        }
        let axes: usize = self.axes_dim.iter().sum();
        if axes != self.head_dim() || self.axes_dim.iter().any(|a| a % 2 != 0) {
            return bad(format!(
                "flux: axes_dim {:?} must be even and sum to the head dim {}",
                self.axes_dim,
                self.head_dim()
            ));
        }
        Ok(())
    }

    /// From a diffusers `FluxTransformer2DModel` config.json.
    pub fn from_diffusers(cfg: &serde_json::Value) -> Result<Self> {
        let heads = cfg_usize(cfg, "num_attention_heads")?;
        let head_dim = cfg_usize(cfg, "attention_head_dim")?;
        let in_channels = cfg_usize(cfg, "in_channels")?;
        if cfg_opt(cfg, "patch_size").and_then(|v| v.as_u64()) != Some(1) {
            return Err(Error::Config {
                path: None,
                msg: "flux config.json: only patch_size 1 (2x2 packing outside the \
                      transformer) is supported"
                    .into(),
            });
        }
        let axes_dim = cfg_usize_list(cfg, "axes_dims_rope")?.unwrap_or_else(|| vec![16, 56, 56]);
        let c = FluxConfig {
            in_channels,
            out_channels: cfg_opt(cfg, "out_channels")
                .and_then(|v| v.as_u64())
                .map_or(in_channels, |v| v as usize),
            vec_in_dim: cfg_usize(cfg, "pooled_projection_dim")?,
            context_in_dim: cfg_usize(cfg, "joint_attention_dim")?,
            hidden_size: heads * head_dim,
            mlp_ratio: 4.0,
            num_heads: heads,
            depth: cfg_usize(cfg, "num_layers")?,
            depth_single_blocks: cfg_usize(cfg, "num_single_layers")?,
            axes_dim,
            theta: 10_000.0,
            qkv_bias: true,
            guidance_embed: cfg_opt(cfg, "guidance_embeds")
                .and_then(|v| v.as_bool())
                .unwrap_or(false),
        };
        c.validate()?;
        Ok(c)
    }

    /// From the tensor shapes of a BFL single file: widths from the embedders, block counts
    /// from the keys present, the head dim from the QK-norm scale. RoPE axes split the head
    /// dim as BFL does for 128 (16, 56, 56); other head dims must be configured explicitly.
    pub fn from_single_file(vb: &VarBuilder) -> Result<Self> {
        let shape = |name: &str| {
            vb.shape_of(name).ok_or_else(|| Error::Param {
                key: name.to_string(),
                file: None,
                msg: "missing: is this a BFL Flux checkpoint?".into(),
            })
        };
        let img_in = shape("img_in.weight")?;
        let txt_in = shape("txt_in.weight")?;
        let vec_in = shape("vector_in.in_layer.weight")?;
        let out = shape("final_layer.linear.weight")?;
        let head_dim = shape("double_blocks.0.img_attn.norm.query_norm.scale")?[0];
        let mlp = shape("double_blocks.0.img_mlp.0.weight")?[0];
        let hidden = img_in[0];
        let count = |block: &str, leaf: &str| {
            (0..)
                .take_while(|i| vb.contains(&format!("{block}.{i}.{leaf}")))
                .count()
        };
        if head_dim != 128 {
            return Err(Error::Config {
                path: None,
                msg: format!(
                    "flux: head dim {head_dim} has no known RoPE axes split; pass a FluxConfig"
                ),
            });
        }
        let c = FluxConfig {
            in_channels: img_in[1],
            out_channels: out[0],
            vec_in_dim: vec_in[1],
            context_in_dim: txt_in[1],
            hidden_size: hidden,
            mlp_ratio: mlp as f64 / hidden as f64,
            num_heads: hidden / head_dim,
            depth: count("double_blocks", "img_mod.lin.weight"),
            depth_single_blocks: count("single_blocks", "linear2.weight"),
            axes_dim: vec![16, 56, 56],
            theta: 10_000.0,
            qkv_bias: vb.contains("double_blocks.0.img_attn.qkv.bias"),
            guidance_embed: vb.contains("guidance_in.in_layer.weight"),
        };
        c.validate()?;
        Ok(c)
    }
}

impl Flux {
    /// Loads Flux from a BFL single file or a diffusers folder (`transformer/` of a pipeline
    /// folder). Without `config`, a diffusers folder's config.json is read, or a single
    /// file's shapes give it. Parameters come out frozen, in `dtype`, on `device`; for
    /// adapters and memory plans, use [`crate::models::load_as`] with [`LoadOptions`].
    pub fn load(
        path: impl AsRef<Path>,
        dtype: DType,
        device: &Device,
        config: Option<FluxConfig>,
    ) -> Result<(Flux, VarBuilder)> {
        let l = load_as::<Flux>(path, &LoadOptions::new(dtype, device), config)?;
        Ok((*l.model, l.vb))
    }
}

/// 2x2 patches of latents (B, C, H, W) as tokens (B, H/2 * W/2, 4C), channel-major inside a
/// token (diffusers' `FluxPipeline._pack_latents`, BFL's `rearrange "b c (h ph) (w pw) ->
/// b (h w) (c ph pw)"`).
pub fn pack_latents(latents: &Tensor) -> Result<Tensor> {
    let d = latents.dims();
    if d.len() != 4 || d[2] % 2 != 0 || d[3] % 2 != 0 {
        return Err(Error::invalid(
            "flux pack_latents",
            "needs (B, C, H, W) with even H and W",
            latents.shape(),
        ));
    }
    let (b, c, h, w) = (d[0], d[1], d[2] / 2, d[3] / 2);
    latents
        .reshape(vec![b, c, h, 2, w, 2])?
        .permute(&[0, 2, 4, 1, 3, 5])?
        .reshape((b, h * w, c * 4))
}

/// The inverse of [`pack_latents`]: tokens (B, h*w, 4C) -> latents (B, C, 2h, 2w).
pub fn unpack_latents(tokens: &Tensor, h: usize, w: usize) -> Result<Tensor> {
    let d = tokens.dims();
    if d.len() != 3 || d[1] != h * w || d[2] % 4 != 0 {
        return Err(Error::invalid(
            "flux unpack_latents",
            format!("needs (B, {h}*{w}, 4C) tokens"),
            tokens.shape(),
        ));
    }
    let (b, c) = (d[0], d[2] / 4);
    tokens
        .reshape(vec![b, h, w, c, 2, 2])?
        .permute(&[0, 3, 1, 4, 2, 5])?
        .reshape((b, c, h * 2, w * 2))
}

/// Position ids of an h x w token grid (h*w, 3): (0, row, col), as FluxPipeline makes them.
pub fn image_ids(h: usize, w: usize, device: &Device) -> Result<Tensor> {
    let ids: Vec<f32> = (0..h * w)
        .flat_map(|i| [0.0, (i / w) as f32, (i % w) as f32])
        .collect();
    Tensor::from_vec(ids, (h * w, 3), device)
}

/// Position ids of T text tokens: zeros (T, 3).
pub fn text_ids(t: usize, device: &Device) -> Result<Tensor> {
    Tensor::zeros((t, 3), DType::F32, device)
}
