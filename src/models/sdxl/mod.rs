//! The SDXL UNet, named by the original LDM checkpoint's keys (`sd_xl_base_1.0.safetensors`
//! under `model.diffusion_model.`). Shape letters: B batch, C latent channels, H x W latent
//! size, T text tokens.
//!
//! Architecture facts from Stability's reference (Stability-AI/generative-models, sgm
//! `modules/diffusionmodules/openaimodel.py`, `modules/attention.py`) and diffusers'
//! `UNet2DConditionModel`, whose math this follows exactly, including its handling of sizes
//! not divisible by 2^(levels - 1) (sgm's 2x upsampling fails there).

mod blocks;
mod config;
mod family;
mod keys;
mod unet;

pub use blocks::{
    interpolate_nearest, nearest_indices, Attention, Downsample, FeedForward, ResBlock,
    SpatialTransformer, TransformerBlock, Upsample,
};
pub use config::{SdxlConfig, Unit, UnitKind, ADDITION_TIME_EMBED_DIM, HEAD_CHANNELS, NUM_GROUPS};
pub use family::FAMILY;
pub use keys::{diffusers_map, map_key};
pub use unet::{InputBlock, Mlp, OutputBlock, ResLayer, Unet, MAX_PERIOD};

use super::family::{load_as, LoadOptions};
use crate::nn::{timestep_embedding, VarBuilder};
use crate::{DType, Device, Error, Result, Tensor};
use std::path::Path;

impl Unet {
    /// Loads the UNet from an SDXL single file (`model.diffusion_model.` keys) or a
    /// diffusers folder (`unet/` of a pipeline folder). Without `config`, a diffusers
    /// folder's config.json is read, or a single file's shapes give it (with SDXL's 64
    /// channels per head). Parameters come out frozen, in `dtype`, on `device`; for adapters
    /// and memory plans, use [`crate::models::load_as`] with [`LoadOptions`].
    pub fn load(
        path: impl AsRef<Path>,
        dtype: DType,
        device: &Device,
        config: Option<SdxlConfig>,
    ) -> Result<(Unet, VarBuilder)> {
        let l = load_as::<Unet>(path, &LoadOptions::new(dtype, device), config)?;
        Ok((*l.model, l.vb))
    }
}

/// The UNet's vector input y (B, P + N x `time_embed_dim`): pooled text embeddings
/// (B, P) followed by the sinusoidal embedding of each micro-conditioning number in
/// `time_ids` (B, N) (SDXL: original size, crop offset, target size; N = 6), cos first,
/// max period 10000, no shift (diffusers' text_time `add_time_proj` on `time_ids.flatten()`,
/// sgm's `ConcatTimestepEmbedderND`). The result is in `text_embeds`' dtype.
pub fn sdxl_vector(
    text_embeds: &Tensor,
    time_ids: &Tensor,
    time_embed_dim: usize,
) -> Result<Tensor> {
    let (td, id) = (text_embeds.dims(), time_ids.dims());
    if td.len() != 2 || id.len() != 2 || td[0] != id[0] {
        return Err(Error::ShapeMismatch {
            op: "sdxl_vector",
            lhs: text_embeds.shape().clone(),
            rhs: time_ids.shape().clone(),
        });
    }
    let ids = if time_ids.dtype().is_float() {
        time_ids.clone()
    } else {
        time_ids.to_dtype(DType::F32)?
    };
    let emb = timestep_embedding(
        &ids.flatten_all()?,
        time_embed_dim,
        MAX_PERIOD,
        true,
        0.0,
        1.0,
    )?
    .reshape((id[0], id[1] * time_embed_dim))?
    .to_dtype(text_embeds.dtype())?;
    Tensor::cat(&[text_embeds, &emb], 1)
}
