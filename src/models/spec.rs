//! What a family's pipeline is made of: its text encoders' slots and how their outputs
//! become the model's text inputs, its autoencoder's latent scaling, and its sampler. Each
//! family declares one [`PipelineSpec`] in its own `family.rs`; `pipeline.rs` loads and runs
//! what it names.

use crate::diffusion::{Prediction, Schedule};
use crate::encoders::{BuiltinTokenizer, ClipOutput, Qwen3Conditioning, Qwen3Output, VaeKind};
use crate::{Error, Result, Tensor};

/// The architecture of a text encoder.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TextEncoderKind {
    /// A CLIP text transformer (OpenAI's L/14 or OpenCLIP's bigG).
    Clip,
    /// The T5 v1.1 encoder.
    T5,
    /// Qwen3 as a conditioning encoder (FLUX.2 \[klein\], Z-Image), used as the conditioning
    /// says: its chat prompt, the hidden states taken (only the layers they need are loaded)
    /// and how the family combines them (`crate::encoders::QWEN3_FLUX2_KLEIN`,
    /// `QWEN3_Z_IMAGE`). The slot's `max_len` should be the conditioning's.
    Qwen3(&'static Qwen3Conditioning),
}

/// One text encoder of a family's conditioning.
#[derive(Clone, Copy, Debug)]
pub struct EncoderSlot {
    /// Its name in messages ("clip_l", "clip_g", "t5").
    pub name: &'static str,
    /// Its architecture.
    pub kind: TextEncoderKind,
    /// The prefix of its adapters' names in kohya's layout: sd-scripts' `lora_te1` (CLIP-L)
    /// and `lora_te2` (bigG) for SDXL and SD3 (networks/lora.py, lora_sd3.py), `lora_te3` for
    /// T5 (lora_flux.py, lora_sd3.py: `LORA_PREFIX_TEXT_ENCODER_T5 = "lora_te3"`); for Qwen3,
    /// the only encoder of its families, `lora_te_model`: networks/lora.py's `lora_te` of a
    /// lone encoder before the `model.` of transformers' `Qwen3ForCausalLM` module names,
    /// which FLAME's layer paths (`layers.N...`) leave out (no trainer writes Qwen3 adapters
    /// to copy a name from; the PEFT layout is the one to exchange).
    pub kohya: &'static str,
    /// Its folder in a diffusers pipeline (`text_encoder`, `text_encoder_2`, ...): also its
    /// adapters' prefix in the PEFT layout, as diffusers' `load_lora_weights` reads them.
    pub folder: &'static str,
    /// Its tokenizer's folder in a diffusers pipeline (`tokenizer`, `tokenizer_2`, ...).
    pub tokenizer: &'static str,
    /// The tokenizer shipped with FLAME that stands for that folder when none is given or
    /// found (feature `vocab`): the same vocabulary and configuration.
    pub builtin: BuiltinTokenizer,
    /// Its key prefix inside the family's all-in-one single file, if such files hold it.
    pub single_file_prefix: Option<&'static str>,
    /// Tokens per caption (CLIP 77; T5 256 or 512; Qwen3 512).
    pub max_len: usize,
    /// Tokens per caption when the model has no guidance input (FLUX.1 schnell: 256).
    pub max_len_unguided: usize,
}

impl EncoderSlot {
    /// Whether the built-in tokenizer `b` is one for this slot's architecture.
    pub fn builtin_fits(&self, b: BuiltinTokenizer) -> bool {
        matches!(
            (self.kind, b),
            (
                TextEncoderKind::Clip,
                BuiltinTokenizer::ClipL | BuiltinTokenizer::ClipG
            ) | (TextEncoderKind::T5, BuiltinTokenizer::T5)
                | (TextEncoderKind::Qwen3(_), BuiltinTokenizer::Qwen3)
        )
    }

    /// Tokens per caption for a model with (`guided`) or without a guidance input; a T5
    /// slot takes `t5_tokens` instead when it is not 0.
    pub fn len(&self, guided: bool, t5_tokens: usize) -> usize {
        match (self.kind, guided) {
            (TextEncoderKind::T5, _) if t5_tokens > 0 => t5_tokens,
            (_, true) => self.max_len,
            (_, false) => self.max_len_unguided,
        }
    }
}

/// One text encoder's output for a batch of captions.
#[derive(Clone, Debug)]
pub enum TextOutput {
    /// A CLIP's hidden states, pooled and projected outputs.
    Clip(ClipOutput),
    /// T5's last hidden state (B, L, D).
    T5(Tensor),
    /// Qwen3's hidden states the slot's conditioning takes, with the captions' padding mask
    /// (`Qwen3Conditioning::combine` makes the transformer's input of them).
    Qwen3(Qwen3Output),
}

/// A pipeline's error: a config error without a file.
pub(super) fn pipeline_err(msg: String) -> Error {
    Error::Config { path: None, msg }
}

impl TextOutput {
    /// The CLIP output, or an error naming `slot`.
    pub fn clip(&self, slot: &str) -> Result<&ClipOutput> {
        match self {
            TextOutput::Clip(c) => Ok(c),
            TextOutput::T5(_) | TextOutput::Qwen3(_) => {
                Err(pipeline_err(format!("{slot}: expected a CLIP output")))
            }
        }
    }

    /// The T5 hidden state, or an error naming `slot`.
    pub fn t5(&self, slot: &str) -> Result<&Tensor> {
        match self {
            TextOutput::T5(t) => Ok(t),
            TextOutput::Clip(_) | TextOutput::Qwen3(_) => {
                Err(pipeline_err(format!("{slot}: expected a T5 output")))
            }
        }
    }

    /// The Qwen3 hidden states and mask, or an error naming `slot`.
    pub fn qwen3(&self, slot: &str) -> Result<&Qwen3Output> {
        match self {
            TextOutput::Qwen3(q) => Ok(q),
            TextOutput::Clip(_) | TextOutput::T5(_) => {
                Err(pipeline_err(format!("{slot}: expected a Qwen3 output")))
            }
        }
    }
}

/// Tensors by name.
pub type Named = Vec<(String, Tensor)>;

/// The inputs of a sampler a family builds ([`PipelineSpec::schedule`]).
#[derive(Clone, Copy, Debug)]
pub struct SampleSetup {
    /// Denoising steps.
    pub steps: usize,
    /// Latent height and width.
    pub latent_hw: (usize, usize),
    /// Whether the model takes a guidance input (FLUX.1 dev) or not (schnell).
    pub guided: bool,
    /// What a DDPM model predicts.
    pub prediction: Prediction,
}

/// A family's pipeline around the model (module docs).
pub struct PipelineSpec {
    /// Its text encoders, in the order their outputs reach `combine`.
    pub text: &'static [EncoderSlot],
    /// The encoders' outputs (one per slot) to the model's text inputs, by input name
    /// (`context`, `pooled`), each with its batch dim.
    pub combine: fn(&[TextOutput]) -> Result<Named>,
    /// Its autoencoder's latent scaling.
    pub vae: VaeKind,
    /// The autoencoder's key prefix inside the family's all-in-one single file, if any.
    pub vae_single_file_prefix: Option<&'static str>,
    /// Its sampler, as the diffusers pipeline sets it up by default.
    pub schedule: fn(&SampleSetup) -> Result<Box<dyn Schedule>>,
}
