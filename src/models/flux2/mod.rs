//! The FLUX.2 transformer (as FLUX.2 \[klein\] 4B / 9B use it), named by BFL's checkpoint keys
//! (`flux-2-klein-4b.safetensors`; ComfyUI's repackaged files hold the same keys under
//! `model.diffusion_model.`). Shape letters: B batch, C packed latent channels, L image tokens,
//! T text tokens, D hidden size, H heads, E head dim, M MLP width.
//!
//! Architecture facts from diffusers 0.42.1 (`models/transformers/transformer_flux2.py`,
//! `Flux2Transformer2DModel`; `pipelines/flux2/pipeline_flux2_klein.py`,
//! `Flux2KleinPipeline`) and BFL's `flux2` reference (`src/flux2/model.py`, `Flux2`), which
//! compute the same: double-stream blocks, then single-stream blocks; no biases anywhere;
//! SwiGLU MLPs; one modulation for every double block's image stream, one for their text
//! stream and one for every single block, computed once from the timestep (and guidance)
//! embedding; 4-axis RoPE (t, h, w, l) with theta 2000; QK RMSNorm; an adaLN final layer.
//! Text is the text encoder's hidden states (B, T, `context_in_dim`): Klein stacks three of
//! Qwen3's layers, so `context_in_dim` is 3 x Qwen3's width.

mod family;
mod keys;
mod model;

pub use family::{empirical_mu, schedule, FAMILY};
pub use keys::diffusers_map;
pub use model::{DoubleStreamBlock, FinalLayer, Flux2, SingleStreamBlock};

use super::checkpoint::{cfg_opt, cfg_usize, cfg_usize_list};
use super::family::{load_as, LoadOptions};
use crate::nn::VarBuilder;
use crate::{DType, Device, Error, Result, Tensor};
use std::path::Path;

/// RoPE base frequency of every FLUX.2 release (diffusers `Flux2Transformer2DModel`'s
/// `rope_theta` default, BFL `Flux2Params.theta`).
const ROPE_THETA: f64 = 2000.0;

/// LayerNorm and RMSNorm epsilon (diffusers `Flux2Transformer2DModel`'s `eps` default; BFL
/// `LastLayer`, `DoubleStreamBlock`: `nn.LayerNorm(..., eps=1e-6)`, `RMSNorm`: 1e-6).
const EPS: f64 = 1e-6;

/// Sinusoidal channels of the timestep and guidance embeddings (diffusers
/// `timestep_guidance_channels` default; BFL `MLPEmbedder(in_dim=256, ...)`).
const TIME_CHANNELS: usize = 256;

/// RoPE axes of every FLUX.2 release: (t, h, w, l), each a quarter of the head dim (BFL
/// `Flux2Params.axes_dim` = [32, 32, 32, 32] of head dim 128; diffusers `axes_dims_rope`).
const AXES: usize = 4;

/// FLUX.2's hyperparameters (BFL `Flux2Params`; diffusers `Flux2Transformer2DModel`'s config).
#[derive(Clone, Debug, PartialEq)]
pub struct Flux2Config {
    /// Packed latent channels C: the autoencoder's 32 channels x 2x2 patch = 128.
    pub in_channels: usize,
    /// Packed channels of the predicted velocity (as `in_channels`).
    pub out_channels: usize,
    /// Text token width (diffusers `joint_attention_dim`): 3 stacked Qwen3 layers.
    pub context_in_dim: usize,
    /// Width D of the token streams.
    pub hidden_size: usize,
    /// Attention heads H; `hidden_size / num_heads` is the head dim.
    pub num_heads: usize,
    /// Width of the SwiGLU MLPs' gated half as a multiple of `hidden_size` (3.0).
    pub mlp_ratio: f64,
    /// Double-stream blocks.
    pub depth: usize,
    /// Single-stream blocks.
    pub depth_single_blocks: usize,
    /// RoPE dims per position axis (t, h, w, l); each even, they sum to the head dim.
    pub axes_dim: Vec<usize>,
    /// RoPE base frequency (2000).
    pub theta: f64,
    /// Sinusoidal channels of the timestep (and guidance) embedding (256).
    pub time_channels: usize,
    /// Norm epsilon (1e-6).
    pub eps: f64,
    /// A guidance embedding (FLUX.2 \[dev\]); Klein has none.
    pub guidance_embed: bool,
}

impl Flux2Config {
    /// FLUX.2 \[klein\] 4B: BFL `flux2/src/flux2/model.py` `Klein4BParams` (context_in_dim
    /// 7680 = 3 x Qwen3-4B's 2560, hidden 3072, 24 heads, 5 double and 20 single blocks,
    /// axes [32, 32, 32, 32], theta 2000, MLP ratio 3, no guidance embedding); the same sizes
    /// as `black-forest-labs/FLUX.2-klein-4B` `transformer/config.json` as public ports
    /// reproduce it (`num_layers` 5, `num_single_layers` 20, `num_attention_heads` 24,
    /// `attention_head_dim` 128, `joint_attention_dim` 7680, `in_channels` 128,
    /// `guidance_embeds` false).
    pub fn klein_4b() -> Self {
        Flux2Config {
            in_channels: 128,
            out_channels: 128,
            context_in_dim: 7680,
            hidden_size: 3072,
            num_heads: 24,
            mlp_ratio: 3.0,
            depth: 5,
            depth_single_blocks: 20,
            axes_dim: vec![32; AXES],
            theta: ROPE_THETA,
            time_channels: TIME_CHANNELS,
            eps: EPS,
            guidance_embed: false,
        }
    }

    /// FLUX.2 \[klein\] 9B: BFL `flux2/src/flux2/model.py` `Klein9BParams` (context_in_dim
    /// 12288 = 3 x Qwen3-8B's 4096, hidden 4096, 32 heads, 8 double and 24 single blocks,
    /// the rest as 4B); `black-forest-labs/FLUX.2-klein-9B`'s config.json as reproduced:
    /// `num_layers` 8, `num_single_layers` 24, `num_attention_heads` 32,
    /// `joint_attention_dim` 12288.
    pub fn klein_9b() -> Self {
        Flux2Config {
            context_in_dim: 12288,
            hidden_size: 4096,
            num_heads: 32,
            depth: 8,
            depth_single_blocks: 24,
            ..Self::klein_4b()
        }
    }

    /// Width E of one attention head: `hidden_size / num_heads` (128).
    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_heads.max(1)
    }

    /// Width M of the MLPs' hidden (gated) half: `hidden_size * mlp_ratio`, truncated
    /// (diffusers `Flux2FeedForward`: `int(dim * mult)`); their input projection has 2 M rows.
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

    /// Checks the sizes fit together: heads divide `hidden_size`, `axes_dim` is even and
    /// sums to the head dim, and the widths are positive.
    pub fn validate(&self) -> Result<()> {
        let bad = |msg: String| Err(Error::Config { path: None, msg });
        if self.num_heads == 0 || self.hidden_size % self.num_heads != 0 {
            return bad(format!(
                "flux2: hidden_size {} is not a multiple of num_heads {}",
                self.hidden_size, self.num_heads
            ));
        }
        let axes: usize = self.axes_dim.iter().sum();
        if axes != self.head_dim() || self.axes_dim.iter().any(|a| a % 2 != 0) {
            return bad(format!(
                "flux2: axes_dim {:?} must be even and sum to the head dim {}",
                self.axes_dim,
                self.head_dim()
            ));
        }
        let widths = [
            self.in_channels,
            self.out_channels,
            self.context_in_dim,
            self.mlp_hidden(),
            self.time_channels,
        ];
        let positive = |v: f64| v.is_finite() && v > 0.0;
        if widths.contains(&0) || !positive(self.theta) || !positive(self.eps) {
            return bad(format!(
                "flux2: every width, theta and eps must be positive and finite, got {self:?}"
            ));
        }
        Ok(())
    }

    /// From a diffusers `Flux2Transformer2DModel` config.json; absent keys take diffusers'
    /// defaults (`Flux2Transformer2DModel.__init__`: mlp_ratio 3.0, axes_dims_rope
    /// [32, 32, 32, 32], rope_theta 2000, eps 1e-6, timestep_guidance_channels 256,
    /// guidance_embeds true).
    pub fn from_diffusers(cfg: &serde_json::Value) -> Result<Self> {
        if cfg_opt(cfg, "patch_size").map_or(Some(1), |v| v.as_u64()) != Some(1) {
            return Err(Error::Config {
                path: None,
                msg: "flux2 config.json: only patch_size 1 (2x2 patches made outside the \
                      transformer) is supported"
                    .into(),
            });
        }
        let heads = cfg_usize(cfg, "num_attention_heads")?;
        let head_dim = cfg_usize(cfg, "attention_head_dim")?;
        let in_channels = cfg_usize(cfg, "in_channels")?;
        let float = |name: &str, default: f64| -> Result<f64> {
            match cfg_opt(cfg, name) {
                None => Ok(default),
                Some(v) => v.as_f64().ok_or_else(|| Error::Config {
                    path: None,
                    msg: format!("config.json: \"{name}\" = {v} is not a number"),
                }),
            }
        };
        let c = Flux2Config {
            in_channels,
            out_channels: cfg_opt(cfg, "out_channels")
                .and_then(|v| v.as_u64())
                .map_or(in_channels, |v| v as usize),
            context_in_dim: cfg_usize(cfg, "joint_attention_dim")?,
            hidden_size: heads * head_dim,
            num_heads: heads,
            mlp_ratio: float("mlp_ratio", 3.0)?,
            depth: cfg_usize(cfg, "num_layers")?,
            depth_single_blocks: cfg_usize(cfg, "num_single_layers")?,
            axes_dim: cfg_usize_list(cfg, "axes_dims_rope")?.unwrap_or_else(|| vec![32; AXES]),
            theta: float("rope_theta", ROPE_THETA)?,
            time_channels: match cfg_opt(cfg, "timestep_guidance_channels") {
                Some(_) => cfg_usize(cfg, "timestep_guidance_channels")?,
                None => TIME_CHANNELS,
            },
            eps: float("eps", EPS)?,
            guidance_embed: cfg_opt(cfg, "guidance_embeds")
                .and_then(|v| v.as_bool())
                .unwrap_or(true),
        };
        c.validate()?;
        Ok(c)
    }

    /// From the tensor shapes of a BFL single file: widths from the embedders, block counts
    /// from the keys present, the head dim from the QK-norm scale, the MLP width from a
    /// block's output projection. What shapes do not hold is FLUX.2's own: four equal RoPE
    /// axes (the head dim a multiple of 8), theta 2000, eps 1e-6 (module constants above);
    /// a checkpoint made otherwise needs its config.json (`LoadOptions::config`).
    pub fn from_single_file(vb: &VarBuilder) -> Result<Self> {
        let shape = |name: &str| {
            vb.shape_of(name).ok_or_else(|| Error::Param {
                key: name.to_string(),
                file: None,
                msg: "missing: is this a BFL FLUX.2 checkpoint?".into(),
            })
        };
        shape("single_stream_modulation.lin.weight")?;
        let img_in = shape("img_in.weight")?;
        let txt_in = shape("txt_in.weight")?;
        let time_in = shape("time_in.in_layer.weight")?;
        let out = shape("final_layer.linear.weight")?;
        let count = |block: &str, leaf: &str| {
            (0..)
                .take_while(|i| vb.contains(&format!("{block}.{i}.{leaf}")))
                .count()
        };
        let depth = count("double_blocks", "img_attn.qkv.weight");
        let depth_single_blocks = count("single_blocks", "linear2.weight");
        let (head_dim, mlp) = if depth > 0 {
            (
                shape("double_blocks.0.img_attn.norm.query_norm.scale")?[0],
                shape("double_blocks.0.img_mlp.2.weight")?[1],
            )
        } else {
            let l2 = shape("single_blocks.0.linear2.weight")?;
            (
                shape("single_blocks.0.norm.query_norm.scale")?[0],
                l2[1].saturating_sub(l2[0]),
            )
        };
        let hidden = img_in[0];
        if head_dim == 0 || head_dim % (2 * AXES) != 0 || hidden % head_dim != 0 {
            return Err(Error::Config {
                path: None,
                msg: format!(
                    "flux2: head dim {head_dim} of hidden {hidden} has no four even RoPE axes; \
                     give the model's config.json"
                ),
            });
        }
        let c = Flux2Config {
            in_channels: img_in[1],
            out_channels: out[0],
            context_in_dim: txt_in[1],
            hidden_size: hidden,
            num_heads: hidden / head_dim,
            mlp_ratio: mlp as f64 / hidden as f64,
            depth,
            depth_single_blocks,
            axes_dim: vec![head_dim / AXES; AXES],
            theta: ROPE_THETA,
            time_channels: time_in[1],
            eps: EPS,
            guidance_embed: vb.contains("guidance_in.in_layer.weight"),
        };
        c.validate()?;
        if c.mlp_hidden() != mlp {
            return Err(Error::Config {
                path: None,
                msg: format!("flux2: MLP width {mlp} is not a ratio of hidden {hidden}"),
            });
        }
        Ok(c)
    }
}

impl Flux2 {
    /// Loads FLUX.2 from a BFL single file (with or without ComfyUI's
    /// `model.diffusion_model.` prefix) or a diffusers folder (`transformer/` of a pipeline
    /// folder). Without `config`, a diffusers folder's config.json is read, or a single
    /// file's shapes give it. Parameters come out frozen, in `dtype`, on `device`; for
    /// adapters and memory plans, use [`crate::models::load_as`] with [`LoadOptions`].
    pub fn load(
        path: impl AsRef<Path>,
        dtype: DType,
        device: &Device,
        config: Option<Flux2Config>,
    ) -> Result<(Flux2, VarBuilder)> {
        let l = load_as::<Flux2>(path, &LoadOptions::new(dtype, device), config)?;
        Ok((*l.model, l.vb))
    }
}

/// The autoencoder's latents (B, c, H, W) as 2x2 patches (B, 4c, H/2, W/2), channel-major
/// inside a patch (diffusers `Flux2KleinPipeline._patchify_latents`: view (B, c, H/2, 2, W/2,
/// 2), permute (0, 1, 3, 5, 2, 4)). The pipeline then normalizes them with the autoencoder's
/// BatchNorm statistics; the transformer's latents are those normalized patches.
pub fn patchify_latents(latents: &Tensor) -> Result<Tensor> {
    let d = latents.dims();
    if d.len() != 4 || d[2] % 2 != 0 || d[3] % 2 != 0 {
        return Err(Error::invalid(
            "flux2 patchify_latents",
            "needs (B, C, H, W) with even H and W",
            latents.shape(),
        ));
    }
    let (b, c, h, w) = (d[0], d[1], d[2] / 2, d[3] / 2);
    latents
        .reshape(vec![b, c, h, 2, w, 2])?
        .permute(&[0, 1, 3, 5, 2, 4])?
        .reshape((b, c * 4, h, w))
}

/// The inverse of [`patchify_latents`]: (B, 4c, h, w) -> (B, c, 2h, 2w) (diffusers
/// `Flux2KleinPipeline._unpatchify_latents`).
pub fn unpatchify_latents(patches: &Tensor) -> Result<Tensor> {
    let d = patches.dims();
    if d.len() != 4 || d[1] % 4 != 0 {
        return Err(Error::invalid(
            "flux2 unpatchify_latents",
            "needs (B, 4c, h, w)",
            patches.shape(),
        ));
    }
    let (b, c, h, w) = (d[0], d[1] / 4, d[2], d[3]);
    patches
        .reshape(vec![b, c, 2, 2, h, w])?
        .permute(&[0, 1, 4, 2, 5, 3])?
        .reshape((b, c, h * 2, w * 2))
}

/// Patched latents (B, C, h, w) as tokens (B, h*w, C), row-major (diffusers
/// `Flux2KleinPipeline._pack_latents`: reshape (B, C, h*w), permute (0, 2, 1)).
pub fn pack_latents(latents: &Tensor) -> Result<Tensor> {
    let d = latents.dims();
    if d.len() != 4 {
        return Err(Error::invalid(
            "flux2 pack_latents",
            "needs (B, C, h, w)",
            latents.shape(),
        ));
    }
    latents
        .reshape((d[0], d[1], d[2] * d[3]))?
        .permute(&[0, 2, 1])?
        .contiguous()
}

/// The inverse of [`pack_latents`]: tokens (B, h*w, C) -> (B, C, h, w) (what
/// `Flux2KleinPipeline._unpack_latents_with_ids` does for the ids of [`image_ids`]).
pub fn unpack_latents(tokens: &Tensor, h: usize, w: usize) -> Result<Tensor> {
    let d = tokens.dims();
    if d.len() != 3 || d[1] != h * w {
        return Err(Error::invalid(
            "flux2 unpack_latents",
            format!("needs (B, {h}*{w}, C) tokens"),
            tokens.shape(),
        ));
    }
    tokens.permute(&[0, 2, 1])?.reshape((d[0], d[2], h, w))
}

/// Position ids of an h x w token grid (h*w, 4): (t, h, w, l) = (0, row, col, 0), as
/// `Flux2KleinPipeline._prepare_latent_ids` makes them (`cartesian_prod`, row-major).
pub fn image_ids(h: usize, w: usize, device: &Device) -> Result<Tensor> {
    let ids: Vec<f32> = (0..h * w)
        .flat_map(|i| [0.0, (i / w) as f32, (i % w) as f32, 0.0])
        .collect();
    Tensor::from_vec(ids, (h * w, AXES), device)
}

/// The time coordinate that sets reference images apart: reference i's tokens have
/// t = scale + scale * i (diffusers 0.42.1 `Flux2KleinPipeline._prepare_image_ids`,
/// `scale: int = 10`; the image being made has t = 0).
pub const REFERENCE_TIME_SCALE: usize = 10;

/// Position ids of reference latents of (h_i, w_i) token grids, in order: (sum h_i w_i, 4),
/// reference i's (t, h, w, l) = (10 + 10 i, row, col, 0), row-major
/// (`Flux2KleinPipeline._prepare_image_ids`: `cartesian_prod(t, arange(h), arange(w),
/// arange(1))` per reference, concatenated).
pub fn reference_ids(sizes: &[(usize, usize)], device: &Device) -> Result<Tensor> {
    let mut ids: Vec<f32> = vec![];
    for (i, &(h, w)) in sizes.iter().enumerate() {
        let t = (REFERENCE_TIME_SCALE + REFERENCE_TIME_SCALE * i) as f32;
        ids.extend((0..h * w).flat_map(|k| [t, (k / w) as f32, (k % w) as f32, 0.0]));
    }
    let n = ids.len() / AXES;
    Tensor::from_vec(ids, (n, AXES), device)
}

/// Reference latents, each (B, C, h_i, w_i) (the autoencoder's normalized 2x2 patches, as the
/// image's own latents), as the transformer takes them: every reference packed one token a
/// position and concatenated in order, (B, sum h_i w_i, C), with their ids from
/// [`reference_ids`] (`Flux2KleinPipeline.prepare_image_latents`: `_pack_latents` each,
/// `torch.cat(packed_latents, dim=0)`). `None` for no references. References of one call
/// share their batch and channels; their sizes are free.
pub fn reference_tokens(refs: &[Tensor]) -> Result<Option<(Tensor, Tensor)>> {
    let Some(first) = refs.first() else {
        return Ok(None);
    };
    let mut sizes = vec![];
    let mut packed = vec![];
    for r in refs {
        let d = r.dims();
        if d.len() != 4 || d[0] != first.dims()[0] || d[1] != first.dims()[1] {
            return Err(Error::ShapeMismatch {
                op: "flux2 reference_tokens: references (B, C, h, w) of one batch and width",
                lhs: r.shape().clone(),
                rhs: first.shape().clone(),
            });
        }
        sizes.push((d[2], d[3]));
        packed.push(pack_latents(r)?);
    }
    let tokens = Tensor::cat(&packed.iter().collect::<Vec<_>>(), 1)?;
    Ok(Some((tokens, reference_ids(&sizes, first.device())?)))
}

/// Position ids of T text tokens (T, 4): (0, 0, 0, token index), as
/// `Flux2KleinPipeline._prepare_text_ids` makes them.
pub fn text_ids(t: usize, device: &Device) -> Result<Tensor> {
    let ids: Vec<f32> = (0..t).flat_map(|i| [0.0, 0.0, 0.0, i as f32]).collect();
    Tensor::from_vec(ids, (t, AXES), device)
}
