//! The Z-Image transformer (Z-Image 6B, base and Turbo: one architecture), named by the
//! original single-file keys that diffusers' `convert_z_image_transformer_checkpoint_to_diffusers`
//! reads (`layers.N.attention.qkv`, `x_embedder`, `final_layer`, ...; ComfyUI's files add the
//! `model.diffusion_model.` prefix). Shape letters: B batch, L image tokens, T caption tokens,
//! D hidden (`dim`), H heads, E head dim (D = H E), A the adaLN width (min(D, 256)).
//!
//! Architecture facts from diffusers 0.42.1 `transformer_z_image.py`
//! (`ZImageTransformer2DModel`, `ZImageTransformerBlock`, `FinalLayer`, `RopeEmbedder`,
//! `TimestepEmbedder`) and `pipeline_z_image.py` (`ZImagePipeline`: how the model is called).
//!
//! diffusers' model takes a list of per-sample latents (C, 1, H, W) and a list of per-sample
//! caption features (T_i, cap_feat_dim), the caption's tokens only. FLAME batches equal-sized
//! latents (B, C, H, W) with captions right-padded to a common length T and a mask (B, T) of
//! 1 for a caption's tokens; [`ZImage::forward`] computes for every sample what diffusers
//! computes for that sample's unpadded caption (see `model.rs` for the sequence layout).

mod family;
mod keys;
mod model;

pub use family::FAMILY;
pub use keys::{diffusers_map, map_key};
pub use model::{patchify, unpatchify, ZImage, ZImageBlock};

use super::checkpoint::{cfg_opt, cfg_usize, cfg_usize_list};
use super::family::{load_as, LoadOptions};
use crate::nn::VarBuilder;
use crate::{DType, Device, Error, Result};
use std::path::Path;

/// Width of the adaLN conditioning: `min(dim, ADALN_EMBED_DIM)` (diffusers
/// `transformer_z_image.py`, `ADALN_EMBED_DIM = 256`).
pub const ADALN_EMBED_DIM: usize = 256;
/// Token sequences (image and caption, each) are padded to a multiple of this with the
/// learned pad tokens (`transformer_z_image.py`, `SEQ_MULTI_OF = 32`, `_pad_with_ids`).
pub const SEQ_MULTI_OF: usize = 32;
/// The timestep MLP's hidden width (`ZImageTransformer2DModel.__init__`:
/// `TimestepEmbedder(min(dim, ADALN_EMBED_DIM), mid_size=1024)`).
pub const T_MID: usize = 1024;
/// Sinusoidal channels of the timestep embedding (`TimestepEmbedder`,
/// `frequency_embedding_size=256`).
pub const T_FREQ: usize = 256;

/// Z-Image's hyperparameters (diffusers `ZImageTransformer2DModel` config.json keys).
#[derive(Clone, Debug, PartialEq)]
pub struct ZImageConfig {
    /// Spatial patch size (`all_patch_size`, one entry: 2).
    pub patch_size: usize,
    /// Temporal patch size (`all_f_patch_size`, one entry: 1; images have one frame).
    pub f_patch_size: usize,
    /// Latent channels (16), also the output channels.
    pub in_channels: usize,
    /// Hidden width D (`dim`, 3840).
    pub dim: usize,
    /// Main (single-stream) layers (`n_layers`, 30).
    pub n_layers: usize,
    /// Noise-refiner and context-refiner layers, each (`n_refiner_layers`, 2).
    pub n_refiner_layers: usize,
    /// Attention heads (`n_heads`, 30); diffusers' attention has as many key/value heads.
    pub n_heads: usize,
    /// Epsilon of the blocks' and the caption embedder's RMSNorms (`norm_eps`, 1e-5).
    pub norm_eps: f64,
    /// Whether queries and keys are RMS-normed over the head dim (`qk_norm`, true).
    pub qk_norm: bool,
    /// Width of the text encoder's hidden states (`cap_feat_dim`, 2560: Qwen3-4B).
    pub cap_feat_dim: usize,
    /// RoPE base (`rope_theta`, 256).
    pub rope_theta: f64,
    /// The timestep's factor before its sinusoidal embedding (`t_scale`, 1000).
    pub t_scale: f64,
    /// RoPE dims per position axis (frame, row, column); they sum to the head dim.
    pub axes_dims: Vec<usize>,
    /// Positions per axis diffusers' RoPE table holds (`axes_lens`); a position at or past
    /// its axis' length is outside the model's domain.
    pub axes_lens: Vec<usize>,
}

impl ZImageConfig {
    /// The released Z-Image 6B transformer (Z-Image and Z-Image-Turbo share it): the
    /// defaults of diffusers 0.42.1 `ZImageTransformer2DModel.__init__`
    /// (`transformer_z_image.py`), which the single-file converter's key names
    /// (`all_x_embedder.2-1`, `convert_z_image_transformer_checkpoint_to_diffusers`) and
    /// the pipeline's Qwen3 width (`cap_feat_dim` 2560) agree with. The repositories'
    /// own config.json files were not available to compare with.
    pub fn z_image_6b() -> Self {
        ZImageConfig {
            patch_size: 2,
            f_patch_size: 1,
            in_channels: 16,
            dim: 3840,
            n_layers: 30,
            n_refiner_layers: 2,
            n_heads: 30,
            norm_eps: 1e-5,
            qk_norm: true,
            cap_feat_dim: 2560,
            rope_theta: 256.0,
            t_scale: 1000.0,
            axes_dims: vec![32, 48, 48],
            axes_lens: vec![1024, 512, 512],
        }
    }

    /// Width of one attention head: `dim / n_heads` (128).
    pub fn head_dim(&self) -> usize {
        self.dim / self.n_heads.max(1)
    }

    /// Width of the adaLN conditioning A: `min(dim, 256)`.
    pub fn adaln_dim(&self) -> usize {
        self.dim.min(ADALN_EMBED_DIM)
    }

    /// The SwiGLU hidden width: `int(dim / 3 * 8)` (`ZImageTransformerBlock`), 10240.
    pub fn ffn_hidden(&self) -> usize {
        (self.dim as f64 / 3.0 * 8.0) as usize
    }

    /// Channels of one patch token: `f_patch * patch² * in_channels`.
    pub fn patch_channels(&self) -> usize {
        self.f_patch_size * self.patch_size * self.patch_size * self.in_channels
    }

    /// diffusers' key of the one patch size (`"2-1"`, `all_x_embedder` / `all_final_layer`).
    pub fn patch_key(&self) -> String {
        format!("{}-{}", self.patch_size, self.f_patch_size)
    }

    /// The blocks' key prefixes in execution order (what `BlockExec` and `BlockStreamer`
    /// name them by): `noise_refiner.*`, `context_refiner.*`, then `layers.*`.
    pub fn block_prefixes(&self) -> Vec<String> {
        let n = self.n_refiner_layers;
        (0..n)
            .map(|i| format!("noise_refiner.{i}"))
            .chain((0..n).map(|i| format!("context_refiner.{i}")))
            .chain((0..self.n_layers).map(|i| format!("layers.{i}")))
            .collect()
    }

    /// Checks the sizes fit together: heads divide `dim`, `axes_dims` are even and sum to
    /// the head dim with a length per axis, the patch is one frame.
    pub fn validate(&self) -> Result<()> {
        let bad = |msg: String| Err(Error::Config { path: None, msg });
        if self.n_heads == 0 || self.dim % self.n_heads != 0 {
            return bad(format!(
                "zimage: dim {} is not a multiple of n_heads {}",
                self.dim, self.n_heads
            ));
        }
        let axes: usize = self.axes_dims.iter().sum();
        if self.axes_dims.len() != 3
            || axes != self.head_dim()
            || self.axes_dims.iter().any(|a| a % 2 != 0)
        {
            return bad(format!(
                "zimage: axes_dims {:?} must be three even dims summing to the head dim {}",
                self.axes_dims,
                self.head_dim()
            ));
        }
        if self.axes_lens.len() != 3 || self.axes_lens.iter().any(|&l| l < 2) {
            return bad(format!(
                "zimage: axes_lens {:?} must be three lengths of 2 or more",
                self.axes_lens
            ));
        }
        if self.patch_size == 0 || self.f_patch_size != 1 {
            return bad(format!(
                "zimage: patch {}x{}x{}: images take an f_patch_size of 1 and a positive \
                 patch_size",
                self.f_patch_size, self.patch_size, self.patch_size
            ));
        }
        Ok(())
    }

    /// From a diffusers `ZImageTransformer2DModel` config.json; keys it lacks take
    /// diffusers' defaults ([`Self::z_image_6b`]). One patch size only; no SigLIP branch
    /// (Z-Image-Omni).
    pub fn from_diffusers(cfg: &serde_json::Value) -> Result<Self> {
        let d = Self::z_image_6b();
        let bad = |msg: String| Error::Config { path: None, msg };
        let usize_or = |name: &str, default: usize| -> Result<usize> {
            match cfg_opt(cfg, name) {
                Some(_) => cfg_usize(cfg, name),
                None => Ok(default),
            }
        };
        let f64_or = |name: &str, default: f64| -> Result<f64> {
            match cfg_opt(cfg, name) {
                Some(v) => v
                    .as_f64()
                    .ok_or_else(|| bad(format!("zimage config.json: {name} must be a number"))),
                None => Ok(default),
            }
        };
        let one = |name: &str, default: usize| -> Result<usize> {
            match cfg_usize_list(cfg, name)? {
                None => Ok(default),
                Some(v) if v.len() == 1 => Ok(v[0]),
                Some(v) => Err(bad(format!(
                    "zimage config.json: {name} {v:?}: only one patch size is supported"
                ))),
            }
        };
        if cfg_opt(cfg, "siglip_feat_dim").is_some_and(|v| !v.is_null()) {
            return Err(bad(
                "zimage config.json: siglip_feat_dim is set (Z-Image-Omni); only the \
                 text-to-image transformer is supported"
                    .into(),
            ));
        }
        let n_heads = usize_or("n_heads", d.n_heads)?;
        let n_kv_heads = usize_or("n_kv_heads", n_heads)?;
        if n_kv_heads != n_heads {
            // diffusers' `ZImageTransformerBlock` builds its attention with `heads=n_heads`
            // for keys and values too; a different n_kv_heads has no weights of its own.
            return Err(bad(format!(
                "zimage config.json: n_kv_heads {n_kv_heads} differs from n_heads {n_heads}"
            )));
        }
        let c = ZImageConfig {
            patch_size: one("all_patch_size", d.patch_size)?,
            f_patch_size: one("all_f_patch_size", d.f_patch_size)?,
            in_channels: usize_or("in_channels", d.in_channels)?,
            dim: usize_or("dim", d.dim)?,
            n_layers: usize_or("n_layers", d.n_layers)?,
            n_refiner_layers: usize_or("n_refiner_layers", d.n_refiner_layers)?,
            n_heads,
            norm_eps: f64_or("norm_eps", d.norm_eps)?,
            qk_norm: cfg_opt(cfg, "qk_norm")
                .and_then(|v| v.as_bool())
                .unwrap_or(d.qk_norm),
            cap_feat_dim: usize_or("cap_feat_dim", d.cap_feat_dim)?,
            rope_theta: f64_or("rope_theta", d.rope_theta)?,
            t_scale: f64_or("t_scale", d.t_scale)?,
            axes_dims: cfg_usize_list(cfg, "axes_dims")?.unwrap_or(d.axes_dims),
            axes_lens: cfg_usize_list(cfg, "axes_lens")?.unwrap_or(d.axes_lens),
        };
        c.validate()?;
        Ok(c)
    }

    /// From the tensor shapes of an original single file: widths from the embedders, the
    /// head dim from the QK-norm weight, layer counts from the keys present. The patch is
    /// 2x2x1 (the converter names it `2-1` whatever the shapes); `norm_eps`, `rope_theta`,
    /// `t_scale` and `axes_lens` are not in the shapes and take the released values; RoPE
    /// axes split a head dim of 128 as the released model does ([32, 48, 48]); other head
    /// dims, or a model without QK norms, need a config.
    pub fn from_single_file(vb: &VarBuilder) -> Result<Self> {
        let shape = |name: &str| {
            vb.shape_of(name).ok_or_else(|| Error::Param {
                key: name.to_string(),
                file: None,
                msg: "missing: is this a Z-Image checkpoint?".into(),
            })
        };
        let d = Self::z_image_6b();
        let x_in = shape("x_embedder.weight")?;
        let cap = shape("cap_embedder.1.weight")?;
        let dim = x_in[0];
        let patch = d.patch_size * d.patch_size * d.f_patch_size;
        if x_in[1] % patch != 0 {
            return Err(Error::Param {
                key: "x_embedder.weight".into(),
                file: None,
                msg: format!("shape {x_in:?}: inputs are not 2x2 patches"),
            });
        }
        let head_dim = match vb.shape_of("layers.0.attention.q_norm.weight") {
            Some(s) => s[0],
            None => {
                return Err(Error::Config {
                    path: None,
                    msg: "zimage: a single file without QK norms does not say its head \
                          count; pass a config"
                        .into(),
                })
            }
        };
        if head_dim != 128 {
            return Err(Error::Config {
                path: None,
                msg: format!(
                    "zimage: head dim {head_dim} has no known RoPE axes split; pass a config"
                ),
            });
        }
        let count = |block: &str| {
            (0..)
                .take_while(|i| vb.contains(&format!("{block}.{i}.attention_norm1.weight")))
                .count()
        };
        let c = ZImageConfig {
            in_channels: x_in[1] / patch,
            dim,
            n_layers: count("layers"),
            n_refiner_layers: count("noise_refiner"),
            n_heads: dim / head_dim,
            qk_norm: true,
            cap_feat_dim: cap[1],
            ..d
        };
        c.validate()?;
        Ok(c)
    }
}

impl ZImage {
    /// Loads the transformer from an original single file or a diffusers folder
    /// (`transformer/` of a pipeline folder). Without `config`, a diffusers folder's
    /// config.json is read, or a single file's shapes give it. Parameters come out frozen,
    /// in `dtype`, on `device`; for adapters and memory plans, use
    /// [`crate::models::load_as`] with [`LoadOptions`].
    pub fn load(
        path: impl AsRef<Path>,
        dtype: DType,
        device: &Device,
        config: Option<ZImageConfig>,
    ) -> Result<(ZImage, VarBuilder)> {
        let l = load_as::<ZImage>(path, &LoadOptions::new(dtype, device), config)?;
        Ok((*l.model, l.vb))
    }
}
