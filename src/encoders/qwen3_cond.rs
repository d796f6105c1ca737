//! How the pipelines condition on Qwen3: the chat prompt they wrap each caption in, how many
//! tokens they read, which hidden states they take and how they combine them into what the
//! transformer receives. [`QWEN3_FLUX2_KLEIN`] and [`QWEN3_Z_IMAGE`] hold diffusers 0.42.1's
//! choices as data; [`Qwen3Conditioning`] runs them.
//!
//! ```no_run
//! use flame::encoders::{Qwen3Encoder, Qwen3Tokenizer, Tokens, QWEN3_Z_IMAGE};
//! use flame::{DType, Device};
//!
//! let dev = Device::cuda(0)?;
//! let cond = &QWEN3_Z_IMAGE;
//! let tok = Qwen3Tokenizer::from_dir("Z-Image-Turbo/tokenizer", cond.max_len)?;
//! // Only the 35 layers hidden_states[-2] needs are loaded.
//! let (enc, _) = Qwen3Encoder::load("Z-Image-Turbo/text_encoder", DType::BF16, &dev,
//!                                   &cond.options())?;
//! let (ids, mask) = Tokens::batch(&[cond.tokens(&tok, "a photo of a cat")?], &dev)?;
//! let out = cond.encode(&enc, &ids, &mask)?;
//! let per_caption = cond.combine(&out)?; // PerCaption: one (L_i, 2560) per caption
//! # Ok::<(), flame::Error>(())
//! ```
//! Shape letters: B captions, L tokens, D Qwen3's width, k layers taken.

use super::qwen3::{Qwen3Encoder, Qwen3Options};
use super::tokenizer::{Qwen3Tokenizer, Tokens};
use crate::{Error, Result, Tensor};

/// The text Qwen3's chat template renders for one user message with the generation prompt:
/// what transformers' `tokenizer.apply_chat_template([{"role": "user", "content": caption}],
/// tokenize=False, add_generation_prompt=True, enable_thinking=thinking)` returns with the
/// template of Qwen3's tokenizer_config.json (FLAME renders no Jinja; for one user message
/// without tools or a system message the template's other branches add nothing):
///
/// `<|im_start|>user\n{caption}<|im_end|>\n<|im_start|>assistant\n`, followed, when
/// `thinking` is false, by the empty thinking block `<think>\n\n</think>\n\n` (the
/// template's `enable_thinking is defined and enable_thinking is false` branch).
///
/// The caption is inserted as written (no trimming, no escaping): special-token text in it
/// is read as those tokens, as transformers does.
pub fn chat_prompt(caption: &str, thinking: bool) -> String {
    let mut s = format!("<|im_start|>user\n{caption}<|im_end|>\n<|im_start|>assistant\n");
    if !thinking {
        s.push_str("<think>\n\n</think>\n\n");
    }
    s
}

/// How the hidden states taken become the transformer's text input.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Qwen3Combine {
    /// The states side by side on the feature dim, every position kept, padding included:
    /// (B, L, k D) (`torch.stack(states, dim=1)`, then permuted to (B, L, k, D) and
    /// reshaped: layer-major features).
    ConcatFeatures,
    /// The states (side by side when several) at each caption's tokens only, padding
    /// dropped: one (L_i, k D) per caption (`prompt_embeds[i][prompt_masks[i]]`).
    ValidTokens,
}

/// One pipeline's use of Qwen3 (module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Qwen3Conditioning {
    /// The pipeline, in messages.
    pub pipeline: &'static str,
    /// `enable_thinking` as the pipeline passes it to `apply_chat_template` ([`chat_prompt`]).
    pub thinking: bool,
    /// Tokens per caption (`max_sequence_length`): the chat prompt is cut to it and padded
    /// to it on the right (`padding="max_length"`, `truncation=True`).
    pub max_len: usize,
    /// The `hidden_states` indices taken (0 the embedding output, i the output of layer i,
    /// negative from the end), in order.
    pub layers: &'static [isize],
    /// How they are combined.
    pub combine: Qwen3Combine,
}

/// FLUX.2 \[klein\] (diffusers 0.42.1 pipelines/flux2/pipeline_flux2_klein.py,
/// `Flux2KleinPipeline._get_qwen3_prompt_embeds` and `encode_prompt`): the chat prompt with
/// `enable_thinking=False`, 512 tokens (`max_sequence_length`), `hidden_states` 9, 18 and 27
/// (`text_encoder_out_layers` default `(9, 18, 27)`) concatenated on features: (B, 512, 3 D),
/// padding positions included; the transformer gets them with no mask (and `txt_ids`, the
/// positions (0, 0, 0, l), which the model family makes).
pub const QWEN3_FLUX2_KLEIN: Qwen3Conditioning = Qwen3Conditioning {
    pipeline: "FLUX.2 [klein]",
    thinking: false,
    max_len: 512,
    layers: &[9, 18, 27],
    combine: Qwen3Combine::ConcatFeatures,
};

/// Z-Image (diffusers 0.42.1 pipelines/z_image/pipeline_z_image.py,
/// `ZImagePipeline._encode_prompt`): the chat prompt with `enable_thinking=True` (no
/// thinking block), 512 tokens (`max_sequence_length`), `hidden_states[-2]` (the output of
/// the next-to-last layer, not normed), each caption's valid tokens only: a list of
/// (L_i, D), the transformer pads them itself.
pub const QWEN3_Z_IMAGE: Qwen3Conditioning = Qwen3Conditioning {
    pipeline: "Z-Image",
    thinking: true,
    max_len: 512,
    layers: &[-2],
    combine: Qwen3Combine::ValidTokens,
};

/// The hidden states a pipeline takes for a batch of captions, with its padding mask.
#[derive(Clone, Debug)]
pub struct Qwen3Output {
    /// `hidden_states[i]` for each of [`Qwen3Conditioning::layers`], each (B, L, D).
    pub hidden: Vec<Tensor>,
    /// (B, L) u32: 1 over each caption's tokens, 0 over the padding.
    pub mask: Tensor,
}

/// What the transformer receives.
#[derive(Clone, Debug)]
pub enum Qwen3Context {
    /// (B, L, k D): every position (FLUX.2 \[klein\]).
    Padded(Tensor),
    /// One (L_i, k D) per caption, its tokens only (Z-Image).
    PerCaption(Vec<Tensor>),
}

impl Qwen3Conditioning {
    /// The caption's chat prompt ([`chat_prompt`] with [`thinking`](Self::thinking)).
    pub fn prompt(&self, caption: &str) -> String {
        chat_prompt(caption, self.thinking)
    }

    /// The caption's tokens: its chat prompt through `tok` (whose length the pipeline's
    /// [`max_len`](Self::max_len) should be).
    pub fn tokens(&self, tok: &Qwen3Tokenizer, caption: &str) -> Result<Tokens> {
        tok.encode(&self.prompt(caption))
    }

    /// Load options that build only the layers this pipeline's hidden states need.
    pub fn options(&self) -> Qwen3Options {
        Qwen3Options {
            hidden_states: self.layers.to_vec(),
            ..Qwen3Options::default()
        }
    }

    /// The hidden states taken for ids (B, L) u32 and their padding mask (B, L), as the
    /// pipeline runs the encoder (with the tokenizer's mask).
    pub fn encode(&self, enc: &Qwen3Encoder, ids: &Tensor, mask: &Tensor) -> Result<Qwen3Output> {
        Ok(Qwen3Output {
            hidden: enc.hidden_states(ids, Some(mask), self.layers)?,
            mask: mask.clone(),
        })
    }

    /// The transformer's text input from `out` ([`Qwen3Combine`]).
    pub fn combine(&self, out: &Qwen3Output) -> Result<Qwen3Context> {
        let parts: Vec<&Tensor> = out.hidden.iter().collect();
        if parts.is_empty() {
            return Err(Error::Config {
                path: None,
                msg: format!("{}: no Qwen3 hidden states to combine", self.pipeline),
            });
        }
        let x = Tensor::cat(&parts, 2)?; // (B, L, k D)
        match self.combine {
            Qwen3Combine::ConcatFeatures => Ok(Qwen3Context::Padded(x)),
            Qwen3Combine::ValidTokens => {
                let (b, l) = (x.dims()[0], x.dims()[1]);
                if out.mask.dims() != [b, l] {
                    return Err(Error::ShapeMismatch {
                        op: "Qwen3Conditioning::combine mask",
                        lhs: x.shape().clone(),
                        rhs: out.mask.shape().clone(),
                    });
                }
                let mask = out.mask.to_vec_f64()?;
                let rows = mask
                    .chunks(l)
                    .enumerate()
                    .map(|(i, m)| {
                        let keep: Vec<u32> =
                            (0..l as u32).filter(|&j| m[j as usize] != 0.0).collect();
                        let n = keep.len();
                        let keep = Tensor::from_vec(keep, n, x.device())?;
                        x.narrow(0, i, 1)?.squeeze(0)?.index_select(&keep, 0)
                    })
                    .collect::<Result<Vec<_>>>()?;
                Ok(Qwen3Context::PerCaption(rows))
            }
        }
    }
}
