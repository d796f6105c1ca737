//! The diffusion models, named by their original checkpoints' keys: Flux (BFL), SD3.5
//! (Stability's MMDiT) and the SDXL UNet (LDM). Each loads from the single file users
//! download or from a diffusers folder, whose keys a per-model map turns into the original
//! ones (fused q/k/v projections are concatenated at load time).

pub mod checkpoint;
pub(crate) mod common;
pub mod family;
pub mod flux;
pub mod pipeline;
pub mod sd3;
pub mod sdxl;

pub use checkpoint::{Checkpoint, Format, CONFIG_METADATA};
pub use family::{
    family, load, load_as, profile_as, profile_config, DiffusionModel, Family, Input, LoadOptions,
    Loaded, MemoryPlan, ModelSpec, Objective, RunShape, Size, FAMILIES, OFFLOAD_MIN_BYTES,
};
pub use pipeline::{
    load_vae, EncoderSlot, Located, PipelineSpec, SampleSetup, Sources, TextConditioner,
    TextEncoderKind, TextOptions, TextOutput,
};
