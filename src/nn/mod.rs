//! Layers and parameters. Parameters are found by checkpoint key paths through a
//! `VarBuilder`, so model code mirrors the checkpoint (`vb.pp("img_attn").pp("qkv")`).
//! Layers are written from tensor ops and run on every backend.

pub mod adapter;
mod conv;
mod embeddings;
mod heads;
mod layers;
mod lora_merge;
mod params;
mod seed;

pub use crate::tensor::{scaled_dot_product_attention, CPU_COMPOSITE_SCORES};
pub use adapter::{
    kohya_name, Adapter, AdapterConfig, Adapters, BaseLayer, LayerShape, LokrSplit, Lora,
    LoraConfig,
};
pub use conv::{
    adaptive_avg_pool2d, avg_pool2d, conv2d, conv2d_banded, max_pool2d, pad2d, Conv2d,
    Conv2dConfig, COLUMN_BYTES,
};
pub use embeddings::{
    apply_rope, modulate, rope, timestep_embedding, EmbedNd, Modulation, ModulationOut,
};
pub use heads::{merge_heads, split_qkv};
pub use layers::{
    upsample_nearest2d, Activation, BatchPart, Dropout, Embedding, GroupNorm, LayerNorm, Linear,
    RmsNorm,
};
pub use lora_merge::LoraMerge;
pub use params::{KeyMap, KeySource, VarBuilder};
pub use seed::permutation;
pub(crate) use seed::{key_hash, mix64, GOLDEN};
