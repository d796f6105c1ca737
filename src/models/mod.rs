//! The diffusion models, named by their original checkpoints' keys: Flux (BFL), SD3.5
//! (Stability's MMDiT) and the SDXL UNet (LDM); the FLUX.2 transformer (BFL) is built, its
//! family not yet registered (its pipeline is not in FLAME). Each loads from the single file users
//! download or from a diffusers folder, whose keys a per-model map turns into the original
//! ones (fused q/k/v projections are concatenated at load time).

use crate::{Error, Result};
use std::path::Path;

pub mod checkpoint;
pub(crate) mod common;
pub mod discover;
pub mod family;
pub mod flux;
pub mod flux2;
pub mod pipeline;
pub mod sd3;
pub mod sdxl;
pub mod spec;
pub mod zimage;

pub use checkpoint::{Checkpoint, Format, CONFIG_METADATA};
pub use discover::{discover, Discovery};
pub use family::{
    fp8_products_refusal, load_as, products_refusal, profile_as, profile_config, with_run_rows,
    DiffusionModel, Family, Input, LoadOptions, Loaded, ModelSpec, Objective, RunShape, Size,
};
pub use pipeline::{
    input_sources, load_vae, stand_in, step_distilled, tokenizer_lines, EncoderSlot, Located,
    PipelineSpec, SampleSetup, SlotUse, Sources, TextConditioner, TextEncoderKind, TextOptions,
    TextOutput, TokenizerSource,
};

/// Every registered family. A new model is a folder under `src/models` implementing
/// [`ModelSpec`] and [`DiffusionModel`], and one line here.
pub static FAMILIES: &[&Family] = &[
    &flux::FAMILY,
    &sd3::FAMILY,
    &sdxl::FAMILY,
    &flux2::FAMILY,
    &zimage::FAMILY,
];

/// The family named `name`, or an error listing the known ones.
pub fn family(name: &str) -> Result<&'static Family> {
    FAMILIES
        .iter()
        .copied()
        .find(|f| f.name == name)
        .ok_or_else(|| Error::Config {
            path: None,
            msg: format!(
                "unknown model family \"{name}\": known are {}",
                FAMILIES
                    .iter()
                    .map(|f| f.name)
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        })
}

/// Loads a model of family `name` from `path` (see [`load_as`]).
pub fn load(
    name: &str,
    path: impl AsRef<Path>,
    opts: &LoadOptions,
) -> Result<Loaded<dyn DiffusionModel>> {
    family(name)?.load(path, opts)
}
