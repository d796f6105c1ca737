//! Layers and parameters. Parameters are found by checkpoint key paths through a
//! `VarBuilder`, so model code mirrors the checkpoint (`vb.pp("img_attn").pp("qkv")`).
//! Layers are written from tensor ops and run on every backend.

pub mod adapter;
mod conv;
mod dropout;
mod embeddings;
mod functional;
mod heads;
mod keys;
mod layers;
mod lora_merge;
mod packed;
mod params;
mod scaled_fp8;
mod seed;

pub use crate::tensor::{scaled_dot_product_attention, CPU_COMPOSITE_SCORES};
pub use adapter::{
    kohya_name, Adapter, AdapterBlock, AdapterConfig, Adapters, BaseLayer, LayerShape, LokrSplit,
    Lora, LoraConfig,
};
pub use conv::{Conv2d, Conv2dConfig};
pub use dropout::{BatchPart, Dropout};
pub use embeddings::{
    apply_rope, modulate, modulate_into, rope, timestep_embedding, EmbedNd, Modulation,
    ModulationOut,
};
pub use functional::{
    adaptive_avg_pool2d, avg_pool2d, conv2d, conv2d_banded, max_pool2d, pad2d, COLUMN_BYTES,
};
pub use heads::{merge_heads, split_qkv, split_qkv_rest};
pub use keys::{KeyMap, KeySource};
pub use layers::{
    upsample_nearest2d, Activation, Embedding, GroupNorm, LayerNorm, Linear, RmsNorm,
};
pub use lora_merge::{is_text_encoder_name, LoraMerge};
pub(crate) use packed::eight_bit_widths;
pub use packed::{products_pay, Fp8Kept, Packing, ProductRows};
pub use params::{HostWeights, VarBuilder};
pub use seed::permutation;
pub(crate) use seed::{key_hash, mix64, GOLDEN};
