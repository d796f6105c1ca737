//! Text encoders and their tokenizers: captions to the embeddings the diffusion models are
//! conditioned on. [`ClipTokenizer`], [`T5Tokenizer`] and [`Qwen3Tokenizer`] turn text into
//! fixed-length ids; [`ClipTextModel`] (OpenAI's CLIP-L, OpenCLIP's bigG), [`T5Encoder`] (T5
//! v1.1 XXL) and [`Qwen3Encoder`] (Qwen3-4B / 8B, FLUX.2 \[klein\]'s and Z-Image's) turn ids
//! into hidden states; [`Qwen3Conditioning`] holds how those two pipelines prompt Qwen3 and
//! combine its states. [`AutoencoderKl`] (the `vae` module) turns images into the latents
//! the models train on and back.
//!
//! Weights load from a transformers / diffusers folder (`text_encoder/`, `text_encoder_2/`,
//! `text_encoder_3/`: `config.json` beside `model.safetensors` or its shards) or a single
//! `.safetensors` file, including files that hold several encoders under prefixes (SDXL's
//! `conditioner.embedders.N.`, SD3.5's `text_encoders.*.transformer.`), found by their keys.
//!
//! ```no_run
//! use flame::encoders::{ClipTextModel, ClipTokenizer, T5Encoder, T5Tokenizer, Tokens};
//! use flame::{DType, Device};
//!
//! let dev = Device::Cpu;
//! // Flux: CLIP-L's pooled output and T5's hidden states, from a diffusers pipeline folder.
//! let clip_tok = ClipTokenizer::from_dir("FLUX.1-dev/tokenizer", 77, None)?;
//! let t5_tok = T5Tokenizer::from_file("FLUX.1-dev/tokenizer_2", 512)?;
//! let (clip, _) = ClipTextModel::load("FLUX.1-dev/text_encoder", None, DType::BF16, &dev, None)?;
//! let (t5, _) = T5Encoder::load("FLUX.1-dev/text_encoder_2", None, DType::BF16, &dev, None)?;
//! let caption = "a photo of a cat";
//! let (ids, _) = Tokens::batch(&[clip_tok.encode(caption)?], &dev)?;
//! let pooled = clip.forward(&ids, None)?.pooled; // (1, 768)
//! let (ids, _) = Tokens::batch(&[t5_tok.encode(caption)?], &dev)?;
//! let context = t5.forward(&ids, None)?; // (1, 512, 4096)
//! # Ok::<(), flame::Error>(())
//! ```
//!
//! Which outputs the pipelines use: SD 1.x CLIP-L's `last_hidden`; SDXL both CLIPs'
//! `penultimate` (concatenated) and bigG's `projected`; SD3.5 both CLIPs' `penultimate` and
//! both `projected` (concatenated, 768 + 1280) plus T5; Flux CLIP-L's `pooled` and T5's
//! hidden state; FLUX.2 \[klein\] Qwen3's hidden states 9, 18, 27 side by side
//! ([`QWEN3_FLUX2_KLEIN`]), Z-Image its `hidden_states[-2]` at each caption's tokens
//! ([`QWEN3_Z_IMAGE`]). The CLIP-L inside SD3 / SD3.5 single files has no `text_projection`
//! (`projected` is `None`): SD3's reference code and diffusers' single-file loader project it
//! by the identity, so its `pooled` stands in.
//!
//! tests/keylists.rs loads the key and shape lists of the released full-size files (made by
//! scripts/make_keylists.py) through each loader's `load_from` without their weights.

mod clip;
mod qwen3;
mod qwen3_cond;
mod spiece;
mod t5;
mod tokenizer;
mod vae;
mod vocab;

pub use clip::{
    clip_key_map, ClipAct, ClipConfig, ClipLayout, ClipOutput, ClipTextModel, SD3_CLIP_G,
    SD3_CLIP_L, SDXL_CLIP_G, SDXL_CLIP_L,
};
pub use qwen3::{Qwen3Config, Qwen3Encoder, Qwen3Options};
pub use qwen3_cond::{
    chat_prompt, Qwen3Combine, Qwen3Conditioning, Qwen3Context, Qwen3Output, QWEN3_FLUX2_KLEIN,
    QWEN3_Z_IMAGE,
};
pub use t5::{relative_bucket, T5Config, T5Encoder, SD3_T5};
pub use tokenizer::{
    ClipTokenizer, Qwen3Tokenizer, T5Tokenizer, Tokens, CLIP_BOS, CLIP_EOS, CLIP_MAX_LEN,
    T5_LEN_FLUX_DEV, T5_LEN_SCHNELL_SD35,
};
pub use vae::{
    vae_key_map, AutoencoderKl, LatentDist, LatentScaling, PatchNorm, VaeConfig, VaeKind,
    VaeLayout, VaeTiling,
};
pub use vocab::BuiltinTokenizer;
pub(crate) use vocab::NOT_BUILT as NO_BUILTIN_VOCAB;

use crate::{Error, Result};
use serde_json::Value;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// Fields of a `config.json` object, read with the file named in every error.
struct JsonFields<'a> {
    v: &'a Value,
    path: Option<&'a Path>,
}

impl<'a> JsonFields<'a> {
    fn new(v: &'a Value, path: Option<&'a Path>) -> Self {
        JsonFields { v, path }
    }

    fn err(&self, msg: String) -> Error {
        Error::Config {
            path: self.path.map(Path::to_path_buf),
            msg,
        }
    }

    /// The non-negative integer `name`; `default` when it is absent or null (an error
    /// naming it when there is no default).
    fn int(&self, name: &str, default: Option<usize>) -> Result<usize> {
        match (self.v.get(name).filter(|x| !x.is_null()), default) {
            (Some(x), _) => x
                .as_u64()
                .map(|x| x as usize)
                .ok_or_else(|| self.err(format!("\"{name}\" = {x} is not a non-negative integer"))),
            (None, Some(d)) => Ok(d),
            (None, None) => Err(self.err(format!("\"{name}\" is missing"))),
        }
    }
}

/// The weight files of an encoder and its parsed config.json, if it has one.
struct Located {
    files: Vec<PathBuf>,
    config: Option<Value>,
    config_path: Option<PathBuf>,
}

fn ck_err(path: &Path, msg: impl Into<String>) -> Error {
    Error::Checkpoint {
        path: path.to_path_buf(),
        msg: msg.into(),
    }
}

fn read_json(path: &Path) -> Result<Value> {
    let text = std::fs::read_to_string(path).map_err(|source| Error::Io {
        path: path.to_path_buf(),
        source,
    })?;
    serde_json::from_str(&text).map_err(|e| ck_err(path, format!("invalid JSON: {e}")))
}

/// The config a lone model's single `.safetensors` file carries in its metadata
/// ([`crate::safetensors::CONFIG_METADATA`]), if any.
fn file_config(path: &Path) -> Result<Option<Value>> {
    let file = crate::safetensors::SafeTensorsFile::open(path)?;
    match file.metadata().get(crate::safetensors::CONFIG_METADATA) {
        Some(text) => serde_json::from_str(text).map(Some).map_err(|e| {
            ck_err(
                path,
                format!(
                    "metadata \"{}\": invalid JSON: {e}",
                    crate::safetensors::CONFIG_METADATA
                ),
            )
        }),
        None => Ok(None),
    }
}

/// A single `.safetensors` file (its metadata's config read unless `prefixed`: a file of
/// several models describes none of them by it), or a folder with `config.json` and
/// `model.safetensors` (or the shards its `model.safetensors.index.json` lists).
fn locate(path: &Path, prefixed: bool) -> Result<Located> {
    if path.is_file() {
        let config = match prefixed {
            true => None,
            false => file_config(path)?,
        };
        return Ok(Located {
            files: vec![path.to_path_buf()],
            config_path: config.as_ref().map(|_| path.to_path_buf()),
            config,
        });
    }
    if !path.is_dir() {
        return Err(ck_err(path, "no such file or folder"));
    }
    let config_path = path.join("config.json");
    let config = if config_path.is_file() {
        Some(read_json(&config_path)?)
    } else {
        None
    };
    let single = path.join("model.safetensors");
    let index = path.join("model.safetensors.index.json");
    let files = if single.is_file() {
        vec![single]
    } else if index.is_file() {
        let json = read_json(&index)?;
        let map = json
            .get("weight_map")
            .and_then(Value::as_object)
            .ok_or_else(|| ck_err(&index, "no \"weight_map\" object"))?;
        let mut names = BTreeSet::new();
        for (key, file) in map {
            let f = file.as_str().ok_or_else(|| {
                ck_err(&index, format!("weight_map[\"{key}\"] is not a file name"))
            })?;
            names.insert(path.join(f));
        }
        for f in &names {
            if !f.is_file() {
                return Err(ck_err(
                    &index,
                    format!("lists {}, which does not exist", f.display()),
                ));
            }
        }
        names.into_iter().collect()
    } else {
        return Err(ck_err(
            path,
            "holds neither model.safetensors nor model.safetensors.index.json (a text \
             encoder folder such as a pipeline's text_encoder/, or give a .safetensors file)",
        ));
    };
    Ok(Located {
        files,
        config_path: config.as_ref().map(|_| config_path),
        config,
    })
}

/// What goes onto an encoder's Linears as it loads: adapters planned on them (training), an
/// adapter file merged into their weights (sampling), or both.
#[derive(Clone, Debug, Default)]
pub struct EncoderPatch {
    /// Adapters planned on the Linears whose key paths their targets match.
    pub adapters: Option<std::sync::Arc<crate::nn::Adapters>>,
    /// An adapter file merged into the weights as they load
    /// (`crate::nn::LoraMerge::for_text_encoder`).
    pub merge: Option<std::sync::Arc<crate::nn::LoraMerge>>,
}

impl EncoderPatch {
    /// Adapters alone.
    pub fn adapters(a: std::sync::Arc<crate::nn::Adapters>) -> Self {
        EncoderPatch {
            adapters: Some(a),
            merge: None,
        }
    }

    /// `raw` (a builder over a checkpoint's keys, not yet shared) with the patch set on it.
    pub(crate) fn apply(&self, raw: crate::nn::VarBuilder) -> Result<crate::nn::VarBuilder> {
        let raw = match &self.adapters {
            Some(a) => raw.with_adapters(a.clone())?,
            None => raw,
        };
        match &self.merge {
            Some(m) => raw.with_merge(m.clone()),
            None => Ok(raw),
        }
    }
}

/// How an encoder's blocks stream from host memory: `prefetch` blocks ahead of the one
/// running, and whether adapters train on them.
#[derive(Clone, Copy, Debug)]
struct BlockStream {
    prefetch: usize,
    trains: bool,
}

impl BlockStream {
    /// The streamer of the blocks named by `prefixes`. Their bf16 weights cross the link
    /// coded (`crate::backend::wire`) only where adapters train on the encoder: a caption's
    /// pass uploads the blocks once (T5-XXL: 8.9 GiB, 0.2 s uncoded at 50 GB/s), while
    /// coding them costs the host a pass over every weight when the first one runs; a
    /// training step's forwards and re-runs upload them again and again.
    fn streamer(
        self,
        device: &crate::Device,
        prefixes: Vec<String>,
    ) -> Result<std::sync::Arc<crate::memory::BlockStreamer>> {
        let s = crate::memory::BlockStreamer::new(device, prefixes, self.prefetch.max(1));
        s.set_wire_code(self.trains)?;
        Ok(s)
    }
}

/// The builder over the weight files at `path` (through [`locate`]) in `dtype` on `device`,
/// and the config: `config` when given, else the folder's config.json (or, unless
/// `prefixed`, a single file's metadata config) read by `parse`, else none (the loader
/// infers it from the shapes).
fn open_files<C>(
    path: &Path,
    prefixed: bool,
    dtype: crate::DType,
    device: &crate::Device,
    config: Option<C>,
    parse: fn(&Value, Option<&Path>) -> Result<C>,
) -> Result<(crate::nn::VarBuilder, Option<C>)> {
    let Located {
        files,
        config: json,
        config_path,
    } = locate(path, prefixed)?;
    let raw = crate::nn::VarBuilder::from_files(&files, dtype, device)?;
    let config = match (config, json) {
        (Some(c), _) => Some(c),
        (None, Some(j)) => Some(parse(&j, config_path.as_deref())?),
        (None, None) => None,
    };
    Ok((raw, config))
}

/// Every `p` such that `p + suffix` is a key, where `p` is empty or ends in a dot.
fn prefixes_with(keys: &[String], suffix: &str) -> Vec<String> {
    keys.iter()
        .filter_map(|k| k.strip_suffix(suffix))
        .filter(|p| p.is_empty() || p.ends_with('.'))
        .map(str::to_string)
        .collect()
}

/// The encoder's prefix among `found` (each with what the caller needs to know of it):
/// `wanted` if given and found, else the only one found; an error naming the file and the
/// prefixes otherwise.
fn detect_prefix<T>(
    path: &Path,
    what: &str,
    found: Vec<(String, T)>,
    wanted: Option<&str>,
) -> Result<(String, T)> {
    let names = || {
        found
            .iter()
            .map(|(p, _)| format!("'{p}'"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    if let Some(w) = wanted {
        let list = names();
        return found.into_iter().find(|(p, _)| p == w).ok_or_else(|| {
            ck_err(
                path,
                format!("no {what} under prefix '{w}' (found: {list})"),
            )
        });
    }
    if found.len() > 1 {
        return Err(ck_err(
            path,
            format!("holds several {what}s; pick one by its prefix: {}", names()),
        ));
    }
    found.into_iter().next().ok_or_else(|| {
        ck_err(
            path,
            format!("holds no {what} (none of its keys match one)"),
        )
    })
}

/// An encoder found among a file's keys ([`recognise`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Recognised {
    /// A CLIP text encoder of this width (CLIP-L 768, bigG 1280).
    Clip {
        /// Its key prefix.
        prefix: String,
        /// Its hidden width.
        width: usize,
    },
    /// A T5 encoder.
    T5 {
        /// Its key prefix.
        prefix: String,
    },
    /// A Qwen3 model.
    Qwen3 {
        /// Its key prefix.
        prefix: String,
    },
    /// A KL autoencoder.
    Vae {
        /// Its key prefix.
        prefix: String,
    },
}

impl Recognised {
    /// Its key prefix inside the file.
    pub fn prefix(&self) -> &str {
        match self {
            Recognised::Clip { prefix, .. }
            | Recognised::T5 { prefix }
            | Recognised::Qwen3 { prefix }
            | Recognised::Vae { prefix } => prefix,
        }
    }
}

impl std::fmt::Display for Recognised {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let at = |p: &str| match p {
            "" => String::new(),
            p => format!(" under '{p}'"),
        };
        match self {
            Recognised::Clip { prefix, width } => {
                write!(f, "a CLIP text encoder of width {width}{}", at(prefix))
            }
            Recognised::T5 { prefix } => write!(f, "a T5 encoder{}", at(prefix)),
            Recognised::Qwen3 { prefix } => write!(f, "a Qwen3 text encoder{}", at(prefix)),
            Recognised::Vae { prefix } => write!(f, "an autoencoder{}", at(prefix)),
        }
    }
}

/// Every encoder the loaders of this module would find among `keys` (a file's keys as
/// stored), by the same keys they look for; `shape` gives a key's shape (a CLIP's width is
/// its token embedding's).
pub fn recognise(keys: &[String], shape: &dyn Fn(&str) -> Option<Vec<usize>>) -> Vec<Recognised> {
    let mut keys = keys.to_vec();
    keys.sort();
    let mut out: Vec<Recognised> = clip::clip_candidates(&keys)
        .into_iter()
        .map(|(prefix, layout)| Recognised::Clip {
            width: shape(&format!("{prefix}{}", layout.token_embedding()))
                .and_then(|s| s.get(1).copied())
                .unwrap_or(0),
            prefix,
        })
        .collect();
    out.extend(
        t5::t5_candidates(&keys)
            .into_iter()
            .map(|prefix| Recognised::T5 { prefix }),
    );
    out.extend(
        qwen3::qwen3_candidates(&keys)
            .into_iter()
            .map(|prefix| Recognised::Qwen3 { prefix }),
    );
    out.extend(
        vae::vae_candidates(&keys)
            .into_iter()
            .map(|(prefix, _)| Recognised::Vae { prefix }),
    );
    out
}
