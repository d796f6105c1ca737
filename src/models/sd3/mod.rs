//! Stable Diffusion 3.5 (large and medium): the MMDiT, named by Stability's single-file keys
//! (`sd3.5_large.safetensors` under `model.diffusion_model.`). Shape letters: B batch,
//! C latent channels, L image tokens, T text tokens, D hidden, H heads.
//!
//! Architecture facts from Stability's reference (Stability-AI/sd3.5, `mmditx.py`) and
//! diffusers' `SD3Transformer2DModel`, which computes the same.

mod family;
mod keys;
mod model;

pub use family::FAMILY;
pub use keys::diffusers_map;
pub use model::{JointBlock, Sd3};

use super::checkpoint::{cfg_opt, cfg_usize, cfg_usize_list};
use super::family::{load_as, LoadOptions};
use crate::nn::VarBuilder;
use crate::{DType, Device, Error, Result};
use std::path::Path;

/// The MMDiT's hyperparameters.
#[derive(Clone, Debug, PartialEq)]
pub struct Sd3Config {
    /// Side of the square latent patches that become tokens (2).
    pub patch_size: usize,
    /// Latent channels C in (16).
    pub in_channels: usize,
    /// Latent channels of the predicted velocity (16).
    pub out_channels: usize,
    /// Joint blocks; the last one's context stream is pre-only.
    pub depth: usize,
    /// Width D of the token streams (64 per head).
    pub hidden_size: usize,
    /// Attention heads H.
    pub num_heads: usize,
    /// Text token width (T5-XXL / CLIP features padded to 4096).
    pub context_dim: usize,
    /// Pooled text width (CLIP-L + CLIP-G = 2048).
    pub pooled_dim: usize,
    /// The stored position table is `pos_embed_max_size`² patches, cropped at the centre.
    pub pos_embed_max_size: usize,
    /// RMSNorm on queries and keys (SD3.5).
    pub qk_norm: bool,
    /// Blocks whose image stream has a second, image-only attention (MMDiT-X, SD3.5 medium).
    pub dual_attention_layers: Vec<usize>,
    /// MLP hidden width as a multiple of `hidden_size` (4.0).
    pub mlp_ratio: f64,
}

impl Sd3Config {
    /// SD3.5 large (diffusers `stabilityai/stable-diffusion-3.5-large/transformer/config.json`).
    pub fn large() -> Self {
        Sd3Config {
            patch_size: 2,
            in_channels: 16,
            out_channels: 16,
            depth: 38,
            hidden_size: 38 * 64,
            num_heads: 38,
            context_dim: 4096,
            pooled_dim: 2048,
            pos_embed_max_size: 192,
            qk_norm: true,
            dual_attention_layers: vec![],
            mlp_ratio: 4.0,
        }
    }

    /// SD3.5 medium: MMDiT-X with dual attention in blocks 0..=12
    /// (`stable-diffusion-3.5-medium/transformer/config.json`).
    pub fn medium() -> Self {
        Sd3Config {
            depth: 24,
            hidden_size: 24 * 64,
            num_heads: 24,
            pos_embed_max_size: 384,
            dual_attention_layers: (0..=12).collect(),
            ..Self::large()
        }
    }

    /// Width of one attention head: `hidden_size / num_heads` (64).
    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_heads
    }

    /// Hidden width of the blocks' MLPs: `hidden_size * mlp_ratio`, truncated.
    pub fn mlp_hidden(&self) -> usize {
        (self.hidden_size as f64 * self.mlp_ratio) as usize
    }

    /// The blocks' key prefixes in execution order: `joint_blocks.0..depth`.
    pub fn block_prefixes(&self) -> Vec<String> {
        (0..self.depth)
            .map(|i| format!("joint_blocks.{i}"))
            .collect()
    }

    /// Checks the sizes fit together: heads divide `hidden_size`, `depth` and `patch_size`
    /// are positive, and every dual-attention layer is a block.
    pub fn validate(&self) -> Result<()> {
        let bad = |msg: String| Err(Error::Config { path: None, msg });
        if self.num_heads == 0 || self.hidden_size % self.num_heads != 0 {
            return bad(format!(
                "sd3: hidden_size {} is not a multiple of num_heads {}",
                self.hidden_size, self.num_heads
            ));
        }
        if self.depth == 0 || self.patch_size == 0 {
            return bad("sd3: depth and patch_size must be positive".into());
        }
        if let Some(&i) = self
            .dual_attention_layers
            .iter()
            .find(|&&i| i >= self.depth)
        {
            return bad(format!(
                "sd3: dual attention layer {i} >= depth {}",
                self.depth
            ));
        }
        Ok(())
    }

    /// From a diffusers `SD3Transformer2DModel` config.json.
    pub fn from_diffusers(cfg: &serde_json::Value) -> Result<Self> {
        let bad = |msg: String| Error::Config { path: None, msg };
        let heads = cfg_usize(cfg, "num_attention_heads")?;
        let hidden = heads * cfg_usize(cfg, "attention_head_dim")?;
        let caption = cfg_usize(cfg, "caption_projection_dim")?;
        if caption != hidden {
            return Err(bad(format!(
                "sd3 config.json: caption_projection_dim {caption} differs from the hidden \
                 size {hidden} (heads x head dim)"
            )));
        }
        let qk_norm = match cfg_opt(cfg, "qk_norm").map(|v| v.as_str()) {
            None => false,
            Some(Some("rms_norm")) => true,
            Some(other) => {
                return Err(bad(format!(
                    "sd3 config.json: qk_norm {other:?} is not supported (only \"rms_norm\")"
                )))
            }
        };
        let dual = cfg_usize_list(cfg, "dual_attention_layers")?.unwrap_or_default();
        let in_channels = cfg_usize(cfg, "in_channels")?;
        let c = Sd3Config {
            patch_size: cfg_usize(cfg, "patch_size")?,
            in_channels,
            out_channels: cfg_opt(cfg, "out_channels")
                .and_then(|v| v.as_u64())
                .map_or(in_channels, |v| v as usize),
            depth: cfg_usize(cfg, "num_layers")?,
            hidden_size: hidden,
            num_heads: heads,
            context_dim: cfg_usize(cfg, "joint_attention_dim")?,
            pooled_dim: cfg_usize(cfg, "pooled_projection_dim")?,
            pos_embed_max_size: cfg_usize(cfg, "pos_embed_max_size")?,
            qk_norm,
            dual_attention_layers: dual,
            mlp_ratio: 4.0,
        };
        c.validate()?;
        Ok(c)
    }

    /// From the tensor shapes of a single file (read through `vb`, prefix already applied):
    /// widths from the embedders, depth and dual-attention blocks from the keys present, the
    /// head dim from the QK-norm weight (64, as every SD3 model, without QK norm).
    pub fn from_single_file(vb: &VarBuilder) -> Result<Self> {
        let shape = |name: &str| {
            vb.shape_of(name).ok_or_else(|| Error::Param {
                key: name.to_string(),
                file: None,
                msg: "missing: is this an SD3 checkpoint?".into(),
            })
        };
        let patch = shape("x_embedder.proj.weight")?;
        let (hidden, p) = (patch[0], patch[2]);
        let pos = shape("pos_embed")?;
        let side = (pos[1] as f64).sqrt().round() as usize;
        if side * side != pos[1] {
            return Err(Error::Config {
                path: None,
                msg: format!("sd3: pos_embed has {} positions, not a square", pos[1]),
            });
        }
        let depth = (0..)
            .take_while(|i| vb.contains(&format!("joint_blocks.{i}.x_block.attn.qkv.weight")))
            .count();
        let qk_norm = vb.contains("joint_blocks.0.x_block.attn.ln_q.weight");
        let head_dim = if qk_norm {
            shape("joint_blocks.0.x_block.attn.ln_q.weight")?[0]
        } else {
            64
        };
        let out = shape("final_layer.linear.weight")?[0];
        let mlp = shape("joint_blocks.0.x_block.mlp.fc1.weight")?[0];
        let c = Sd3Config {
            patch_size: p,
            in_channels: patch[1],
            out_channels: out / (p * p),
            depth,
            hidden_size: hidden,
            num_heads: hidden / head_dim,
            context_dim: shape("context_embedder.weight")?[1],
            pooled_dim: shape("y_embedder.mlp.0.weight")?[1],
            pos_embed_max_size: side,
            qk_norm,
            dual_attention_layers: (0..depth)
                .filter(|i| vb.contains(&format!("joint_blocks.{i}.x_block.attn2.qkv.weight")))
                .collect(),
            mlp_ratio: mlp as f64 / hidden as f64,
        };
        c.validate()?;
        Ok(c)
    }
}

impl Sd3 {
    /// Loads SD3.5 from a single file (`model.diffusion_model.` keys, with or without the text
    /// encoders and VAE beside them) or a diffusers folder (`transformer/` of a pipeline).
    /// Without `config`, a diffusers folder's config.json is read, or the single file's
    /// shapes give it. Parameters come out frozen, in `dtype`, on `device`; `pos_embed` is a
    /// fixed table and stays frozen under `set_trainable` callers that skip it. For adapters
    /// and memory plans, use [`crate::models::load_as`] with [`LoadOptions`].
    pub fn load(
        path: impl AsRef<Path>,
        dtype: DType,
        device: &Device,
        config: Option<Sd3Config>,
    ) -> Result<(Sd3, VarBuilder)> {
        let l = load_as::<Sd3>(path, &LoadOptions::new(dtype, device), config)?;
        Ok((*l.model, l.vb))
    }
}
