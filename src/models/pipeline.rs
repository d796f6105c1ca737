//! What a model family needs around it to go from captions and images to training inputs
//! and back to images: its text encoders and how their outputs become the model's text
//! inputs, its autoencoder, and its sampler. Each family declares one [`PipelineSpec`] in its
//! own `family.rs`; [`TextConditioner`] and [`load_vae`] load the encoders it names from a
//! diffusers pipeline folder, an all-in-one single file, or the files a config points at.

use super::family::Family;
use crate::encoders::{
    AutoencoderKl, BuiltinTokenizer, ClipTextModel, ClipTokenizer, EncoderPatch, Qwen3Conditioning,
    Qwen3Encoder, Qwen3Options, Qwen3Tokenizer, T5Encoder, T5Tokenizer, Tokens, NO_BUILTIN_VOCAB,
};
use crate::nn::{Adapters, KeyMap, KeySource, LoraMerge};
use crate::{no_grad, DType, Device, Error, Result, Tensor};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::spec::pipeline_err;
pub use super::spec::{EncoderSlot, Named, PipelineSpec, SampleSetup, TextEncoderKind, TextOutput};

/// Output `i` of `outs` (for a family's `combine`), or an error naming the count.
pub fn output(outs: &[TextOutput], i: usize) -> Result<&TextOutput> {
    outs.get(i).ok_or_else(|| {
        pipeline_err(format!(
            "text conditioning: {} encoder outputs, output {i} asked for",
            outs.len()
        ))
    })
}

/// Where the pieces of a pipeline are: each `None` takes the default of [`Sources::locate`].
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Sources {
    /// The text encoders' weights, one per slot of the family.
    pub text: Vec<PathBuf>,
    /// The tokenizers' folders (or T5 `tokenizer.json` files), one per slot.
    pub tokenizers: Vec<PathBuf>,
    /// The autoencoder's weights.
    pub vae: Option<PathBuf>,
}

/// The pipeline folder a model path belongs to: the path itself when it holds `folder`, or
/// its parent (the path is the pipeline's `transformer/` or `unet/`).
fn pipeline_root(model: &Path, folder: &str) -> Option<PathBuf> {
    if !model.is_dir() {
        return None;
    }
    [Some(model), model.parent()]
        .into_iter()
        .flatten()
        .find(|r| r.join(folder).is_dir())
        .map(Path::to_path_buf)
}

/// The tensor names of a safetensors file, or `None` when it cannot be read as one (the
/// loader then reports why).
fn names_in(file: &Path) -> Option<Vec<String>> {
    crate::safetensors::SafeTensorsFile::open(file)
        .ok()
        .map(|f| f.names().map(str::to_string).collect())
}

/// Where a text encoder's tokenizer comes from.
#[derive(Clone, Debug, PartialEq)]
pub enum TokenizerSource {
    /// A tokenizer folder or file (a pipeline's `tokenizer*/`, a T5 `tokenizer.json` or
    /// `spiece.model`).
    Path(PathBuf),
    /// The tokenizer shipped with FLAME (feature `vocab`), when none was given or found.
    Builtin(BuiltinTokenizer),
}

impl std::fmt::Display for TokenizerSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TokenizerSource::Path(p) => write!(f, "{}", p.display()),
            TokenizerSource::Builtin(b) => f.write_str(b.describe()),
        }
    }
}

/// One line per text encoder of `family` saying which tokenizer it uses: what the train and
/// sample binaries log.
pub fn tokenizer_lines(family: &Family, located: &[(Located, TokenizerSource)]) -> Vec<String> {
    family
        .pipeline
        .text
        .iter()
        .zip(located)
        .map(|(slot, (_, tok))| format!("{} tokenizer: {tok}", slot.name))
        .collect()
}

/// One located piece: the path and, when it is the family's all-in-one single file, the
/// prefix to read it under.
#[derive(Clone, Debug, PartialEq)]
pub struct Located {
    /// The file or folder.
    pub path: PathBuf,
    /// The key prefix inside an all-in-one file.
    pub prefix: Option<&'static str>,
}

impl Sources {
    /// The pipeline's pieces for `family` with its model at `model`: the given paths (a
    /// path equal to `model` is read under the family's single-file prefix), else the
    /// pipeline folder's `text_encoder*/`, `tokenizer*/` and `vae/`, else (weights only) the
    /// model's own single file when the family's single files hold them, and (tokenizers
    /// only) the slot's tokenizer shipped with FLAME when built with the feature `vocab`. An
    /// error names the config key to set (`key_text`, `key_tok`, `key_vae`) when nothing is
    /// found.
    pub fn locate(
        &self,
        family: &Family,
        model: &Path,
        keys: [&str; 3],
    ) -> Result<(Vec<(Located, TokenizerSource)>, Located)> {
        let spec = family.pipeline;
        let [key_text, key_tok, key_vae] = keys;
        let n = spec.text.len();
        let names = || {
            spec.text
                .iter()
                .map(|s| s.name)
                .collect::<Vec<_>>()
                .join(", ")
        };
        for (key, list) in [(key_text, &self.text), (key_tok, &self.tokenizers)] {
            if !list.is_empty() && list.len() != n {
                return Err(pipeline_err(format!(
                    "{key}: {} paths given; {} takes {n} ({}), in that order",
                    list.len(),
                    family.name,
                    names()
                )));
            }
        }
        let single = model.is_file().then(|| model.to_path_buf());
        let mut single_names: Option<Option<Vec<String>>> = None;
        let mut out = vec![];
        for (i, slot) in spec.text.iter().enumerate() {
            let weights = match self.text.get(i) {
                Some(p) => Located {
                    prefix: (p == model).then_some(slot.single_file_prefix).flatten(),
                    path: p.clone(),
                },
                None => match (pipeline_root(model, slot.folder), &single) {
                    (Some(root), _) => Located {
                        path: root.join(slot.folder),
                        prefix: None,
                    },
                    (None, Some(file)) if slot.single_file_prefix.is_some() => {
                        let prefix = slot.single_file_prefix.unwrap_or_default();
                        // SD3 / SD3.5 files are published with and without their encoders:
                        // say so here, where the config key to set is known.
                        if single_names
                            .get_or_insert_with(|| names_in(file))
                            .as_ref()
                            .is_some_and(|names| !names.iter().any(|k| k.starts_with(prefix)))
                        {
                            return Err(pipeline_err(format!(
                                "{key_text}: {} holds no {} text encoder (no keys under \
                                 '{prefix}'); give the {} files ({}) in that order",
                                file.display(),
                                slot.name,
                                n,
                                names()
                            )));
                        }
                        Located {
                            path: file.clone(),
                            prefix: slot.single_file_prefix,
                        }
                    }
                    _ => {
                        return Err(pipeline_err(format!(
                            "{key_text}: no {} text encoder next to {}; give the {} files \
                             ({}) in that order",
                            slot.name,
                            model.display(),
                            n,
                            names()
                        )))
                    }
                },
            };
            let tok = match self.tokenizers.get(i) {
                Some(p) => TokenizerSource::Path(p.clone()),
                None => match pipeline_root(model, slot.tokenizer) {
                    Some(root) => TokenizerSource::Path(root.join(slot.tokenizer)),
                    None if BuiltinTokenizer::AVAILABLE => TokenizerSource::Builtin(slot.builtin),
                    None => {
                        return Err(pipeline_err(format!(
                            "{key_tok}: no {} tokenizer next to {}; give the tokenizer \
                             folders of a diffusers pipeline ({}), in that order ({NO_BUILTIN_VOCAB})",
                            slot.name,
                            model.display(),
                            spec.text
                                .iter()
                                .map(|s| format!("{}/ for {}", s.tokenizer, s.name))
                                .collect::<Vec<_>>()
                                .join(", ")
                        )))
                    }
                },
            };
            out.push((weights, tok));
        }
        let vae = match &self.vae {
            Some(p) => Located {
                prefix: (p == model)
                    .then_some(spec.vae_single_file_prefix)
                    .flatten(),
                path: p.clone(),
            },
            None => match (pipeline_root(model, "vae"), &single) {
                (Some(root), _) => Located {
                    path: root.join("vae"),
                    prefix: None,
                },
                (None, Some(file)) if spec.vae_single_file_prefix.is_some() => Located {
                    path: file.clone(),
                    prefix: spec.vae_single_file_prefix,
                },
                _ => {
                    return Err(pipeline_err(format!(
                        "{key_vae}: no autoencoder next to {}; give the VAE file or folder",
                        model.display()
                    )))
                }
            },
        };
        Ok((out, vae))
    }
}

/// Whether the diffusers pipeline `model` belongs to (the path itself or its parent, as
/// [`Sources::locate`] finds a pipeline) is step-distilled: `model_index.json`'s
/// `is_distilled` (diffusers 0.42.1 `Flux2KleinPipeline.__init__`; its
/// `do_classifier_free_guidance` is false for such a pipeline whatever the scale, as for the
/// released FLUX.2 \[klein\] 4B / 9B). False where no pipeline folder or no field says so.
pub fn step_distilled(model: &Path) -> Result<bool> {
    if !model.is_dir() {
        return Ok(false);
    }
    let Some(path) = [Some(model), model.parent()]
        .into_iter()
        .flatten()
        .map(|r| r.join("model_index.json"))
        .find(|p| p.is_file())
    else {
        return Ok(false);
    };
    let text = std::fs::read_to_string(&path).map_err(|source| Error::Io {
        path: path.clone(),
        source,
    })?;
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| Error::Config {
        path: Some(path.clone()),
        msg: format!("model_index.json: {e}"),
    })?;
    Ok(v.get("is_distilled")
        .and_then(serde_json::Value::as_bool)
        .unwrap_or(false))
}

/// A string that changes when the file or folder at `path` does (its path, and each weight
/// file's size and modification time): part of the caches' keys.
pub fn file_identity(path: &Path) -> String {
    let stamp = |p: &Path| match std::fs::metadata(p) {
        Ok(m) => format!(
            "{} {} {:?}",
            p.display(),
            m.len(),
            m.modified()
                .ok()
                .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                .map(|d| d.as_nanos())
        ),
        Err(_) => format!("{} missing", p.display()),
    };
    if path.is_dir() {
        let mut files: Vec<PathBuf> = std::fs::read_dir(path)
            .map(|rd| {
                rd.filter_map(|e| e.ok().map(|e| e.path()))
                    .filter(|p| {
                        p.extension()
                            .is_some_and(|e| e == "safetensors" || e == "json")
                    })
                    .collect()
            })
            .unwrap_or_default();
        files.sort();
        files
            .iter()
            .map(|f| stamp(f))
            .collect::<Vec<_>>()
            .join("; ")
    } else {
        stamp(path)
    }
}

enum Tokenizer {
    Clip(ClipTokenizer),
    T5(T5Tokenizer),
    Qwen3(Qwen3Tokenizer, &'static Qwen3Conditioning),
}

enum Encoder {
    Clip(ClipTextModel),
    T5(T5Encoder),
    Qwen3(Qwen3Encoder, &'static Qwen3Conditioning),
}

/// The most T5 tokens a caption may take: the length T5 was trained to and diffusers' Flux
/// and SD3 pipelines accept (`max_sequence_length` cannot be greater than 512 there).
pub const T5_MAX_TOKENS: usize = 512;

/// How a [`TextConditioner`] is set up.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TextOptions {
    /// Whether the model takes a guidance input (FLUX.1 dev: T5 reads 512 tokens, not 256).
    pub guided: bool,
    /// T5's tokens per caption when not 0, instead of the pipeline's.
    pub t5_tokens: usize,
    /// T5's blocks stream from host memory ([`T5Encoder::load_streamed`]): T5-XXL encodes in
    /// about 1.5 GiB of device memory instead of 9.
    pub stream_t5: bool,
    /// Qwen3's layers stream from host memory ([`Qwen3Options::stream`]), two ahead: its
    /// embedding and three layers on the device (about 1.4 GiB for Qwen3-4B instead of 8).
    pub stream_qwen3: bool,
    /// Qwen3's Linear weights held as FP8 E4M3 with per-row scales ([`Qwen3Options::fp8`]):
    /// half the memory and streamed bytes; an FP8 file's codes are kept as they are.
    pub fp8_qwen3: bool,
}

/// Whether the family's Qwen3 encoder, where `located` puts it, stores FP8 weights (ComfyUI's
/// fp8 files), whose codes [`TextOptions::fp8_qwen3`] then keeps as they are. A header that
/// cannot be read counts as not FP8: loading the encoder names the problem.
pub fn qwen3_file_is_fp8(family: &Family, located: &[(Located, TokenizerSource)]) -> bool {
    family
        .pipeline
        .text
        .iter()
        .zip(located)
        .any(|(slot, (w, _))| {
            matches!(slot.kind, TextEncoderKind::Qwen3(_))
                && crate::safetensors::holds_fp8(&w.path).unwrap_or(false)
        })
}

/// The map of the key paths of `slot`'s adapters to the module names of the PEFT layout
/// (transformers' names, as `PeftModel` and diffusers' `load_lora_into_text_encoder` name
/// them): CLIP's and T5's paths are those names; Qwen3's leave out the `model.` of
/// `Qwen3ForCausalLM`, the class FLUX.2 \[klein\]'s and Z-Image's pipelines hold as
/// `text_encoder` (diffusers `Flux2KleinPipeline`; transformers `Qwen3ForCausalLM.model`).
pub fn peft_map(slot: &EncoderSlot) -> KeyMap {
    match slot.kind {
        TextEncoderKind::Qwen3(_) => Arc::new(|k: &str| Some(KeySource::Key(format!("model.{k}")))),
        TextEncoderKind::Clip | TextEncoderKind::T5 => {
            Arc::new(|k: &str| Some(KeySource::Key(k.to_string())))
        }
    }
}

/// Bytes of the weight files at `path` (a file, or the .safetensors files of a folder).
pub fn weight_bytes(path: &Path) -> u64 {
    let size = |p: &Path| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0);
    match std::fs::read_dir(path) {
        Ok(rd) => rd
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
            .map(|p| size(&p))
            .sum(),
        Err(_) => size(path),
    }
}

/// Bytes an encoder of `kind` whose weights are at `path` holds on the device, about: its
/// weight files, an eighth of them for T5 streamed, a quarter for Qwen3 streamed, and for
/// Qwen3 resident with its Linears made FP8 from a 16-bit file 11/20 of them (the embedding
/// kept, the Linears halved): what the trainer plans the caching phase and the steps by.
pub fn encoder_device_bytes(kind: TextEncoderKind, path: &Path, opts: &TextOptions) -> u64 {
    let b = weight_bytes(path);
    match kind {
        TextEncoderKind::T5 if opts.stream_t5 => b / 8,
        TextEncoderKind::Qwen3(_) if opts.stream_qwen3 => b / 4,
        TextEncoderKind::Qwen3(_)
            if opts.fp8_qwen3 && !crate::safetensors::holds_fp8(path).unwrap_or(true) =>
        {
            b * 11 / 20
        }
        _ => b,
    }
}

/// The sizes of a loaded text encoder ([`TextConditioner::dims`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EncoderDims {
    /// The residual stream's width.
    pub width: usize,
    /// The attention's inner width (heads times head width).
    pub attention: usize,
    /// The MLP's hidden width.
    pub mlp: usize,
    /// The layers run.
    pub layers: usize,
    /// Attention heads.
    pub heads: usize,
    /// Whether the MLP is gated (two input projections: T5's wi_0 / wi_1, Qwen3's gate / up).
    pub gated: bool,
}

impl EncoderDims {
    /// An upper bound on the bytes one caption of `tokens` takes on the device while a
    /// layer runs without gradients, in values of `elem` bytes: the query, key, value and
    /// attention outputs, three (heads, tokens, tokens) score tensors (the scores, the
    /// scores with the bias or mask, their softmax: two are alive at once), the MLP's
    /// hidden values (four with a gate: both projections, the activation and the product;
    /// three without: the projection, the activation's steps) and four of the residual
    /// stream's.
    pub fn pass_bytes(&self, tokens: usize, elem: usize) -> u64 {
        let t = tokens as u64;
        let mlp = self.mlp as u64 * if self.gated { 4 } else { 3 };
        let values = 3 * self.heads as u64 * t * t
            + t * (4 * self.attention as u64 + mlp + 4 * self.width as u64);
        values * elem as u64
    }
}

/// How [`TextConditioner::load_slots`] takes one of a family's text encoders.
#[derive(Clone, Debug)]
pub enum SlotUse {
    /// Not loaded: its outputs stand in as zeros ([`stand_in`]), for conditioning whose
    /// inputs from it are not used.
    Skip,
    /// Loaded, frozen.
    Frozen,
    /// Loaded with these adapters planned on its Linears (streamed or not, as
    /// [`TextOptions`] says: a streamed encoder's adapters stay on the device).
    Adapted(Arc<Adapters>),
    /// Loaded frozen with this adapter file merged into its weights
    /// ([`LoraMerge::for_text_encoder`] under the slot's names; the PEFT layout read through
    /// [`peft_map`]).
    Merged(Arc<LoraMerge>),
}

/// A small output of `slot`'s architecture, zeros on `device` (batch 1, one token, widths
/// that every family's combination accepts): what stands in for an encoder that is not
/// loaded, and what [`input_sources`] traces.
pub fn stand_in(slot: &EncoderSlot, device: &Device) -> Result<TextOutput> {
    let z = |dims: &[usize]| Tensor::zeros(dims.to_vec(), DType::F32, device);
    Ok(match slot.kind {
        TextEncoderKind::Clip => TextOutput::Clip(crate::encoders::ClipOutput {
            last_hidden: z(&[1, 1, 1])?,
            penultimate: z(&[1, 1, 1])?,
            pooled: z(&[1, 1])?,
            projected: Some(z(&[1, 1])?),
        }),
        // Wider than the CLIPs' stand-ins side by side (SD3 pads them to T5's width).
        TextEncoderKind::T5 => TextOutput::T5(z(&[1, 1, 4])?),
        TextEncoderKind::Qwen3(_) => {
            return Err(pipeline_err(format!(
                "{}: a Qwen3 encoder has no stand-in; it must be loaded",
                slot.name
            )))
        }
    })
}

/// Which encoders each of `family`'s text inputs is made from: (input name, the slots'
/// indices), traced through the family's combination of stand-in outputs ([`stand_in`]),
/// one slot's marked as needing gradients at a time. Families of a Qwen3 encoder (one slot,
/// not traced) give every input from slot 0.
pub fn input_sources(family: &Family, device: &Device) -> Result<Vec<(String, Vec<usize>)>> {
    let slots = family.pipeline.text;
    if slots
        .iter()
        .any(|s| matches!(s.kind, TextEncoderKind::Qwen3(_)))
    {
        return Ok(vec![]);
    }
    let mut sources: Vec<(String, Vec<usize>)> = vec![];
    for traced in 0..slots.len() {
        let outs = slots
            .iter()
            .enumerate()
            .map(|(i, slot)| {
                let out = stand_in(slot, device)?;
                if i != traced {
                    return Ok(out);
                }
                let mark = |t: Tensor| t.requires_grad_();
                Ok(match out {
                    TextOutput::Clip(c) => TextOutput::Clip(crate::encoders::ClipOutput {
                        last_hidden: mark(c.last_hidden)?,
                        penultimate: mark(c.penultimate)?,
                        pooled: mark(c.pooled)?,
                        projected: c.projected.map(mark).transpose()?,
                    }),
                    TextOutput::T5(t) => TextOutput::T5(mark(t)?),
                    q @ TextOutput::Qwen3(_) => q,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        for (name, t) in (family.pipeline.combine)(&outs)? {
            let entry = match sources.iter_mut().find(|(n, _)| *n == name) {
                Some(e) => e,
                None => {
                    sources.push((name.clone(), vec![]));
                    let last = sources.len() - 1;
                    &mut sources[last]
                }
            };
            if t.requires_grad() {
                entry.1.push(traced);
            }
        }
    }
    Ok(sources)
}

/// A family's text encoders with their tokenizers, loaded: captions to the model's text
/// inputs.
pub struct TextConditioner {
    family: &'static Family,
    /// Per slot: its tokenizer and encoder, `None` where not loaded ([`SlotUse::Skip`]).
    encoders: Vec<Option<(Tokenizer, Encoder)>>,
    device: Device,
    identity: String,
}

fn wrap(key: &str, slot: &EncoderSlot, e: Error) -> Error {
    pipeline_err(format!("{key} ({}): {e}", slot.name))
}

impl TextConditioner {
    /// Loads `family`'s text encoders and tokenizers from `located` (from
    /// [`Sources::locate`]) in `dtype` on `device`, as `opts` says. Errors name `key` and the
    /// slot.
    pub fn load(
        family: &'static Family,
        located: &[(Located, TokenizerSource)],
        opts: &TextOptions,
        dtype: DType,
        device: &Device,
        key: &str,
    ) -> Result<Self> {
        Self::load_slots(family, located, opts, dtype, device, key, &[])
    }

    /// [`load`](Self::load) with each slot taken as `uses` says (one per slot; empty: every
    /// slot [`SlotUse::Frozen`]).
    pub fn load_slots(
        family: &'static Family,
        located: &[(Located, TokenizerSource)],
        opts: &TextOptions,
        dtype: DType,
        device: &Device,
        key: &str,
        uses: &[SlotUse],
    ) -> Result<Self> {
        if !uses.is_empty() && uses.len() != family.pipeline.text.len() {
            return Err(pipeline_err(format!(
                "{key}: {} encoder uses given, {} takes {}",
                uses.len(),
                family.name,
                family.pipeline.text.len()
            )));
        }
        if located.len() != family.pipeline.text.len() {
            return Err(pipeline_err(format!(
                "{key}: {} text encoders located, {} takes {}",
                located.len(),
                family.name,
                family.pipeline.text.len()
            )));
        }
        if opts.t5_tokens > T5_MAX_TOKENS {
            return Err(pipeline_err(format!(
                "{key}: {} T5 tokens a caption; T5 takes at most {T5_MAX_TOKENS}",
                opts.t5_tokens
            )));
        }
        let mut encoders = vec![];
        for (i, (slot, (w, tok))) in family.pipeline.text.iter().zip(located).enumerate() {
            let patch = match uses.get(i) {
                Some(SlotUse::Skip) => {
                    encoders.push(None);
                    continue;
                }
                Some(SlotUse::Adapted(a)) => EncoderPatch::adapters(a.clone()),
                Some(SlotUse::Merged(m)) => {
                    m.set_diffusers_map(peft_map(slot))?;
                    EncoderPatch {
                        adapters: None,
                        merge: Some(m.clone()),
                    }
                }
                Some(SlotUse::Frozen) | None => EncoderPatch::default(),
            };
            let len = slot.len(opts.guided, opts.t5_tokens);
            if let TokenizerSource::Builtin(b) = tok {
                if !slot.builtin_fits(*b) {
                    return Err(wrap(
                        key,
                        slot,
                        pipeline_err(format!("{} is not a tokenizer for it", b.describe())),
                    ));
                }
            }
            let pair = match slot.kind {
                TextEncoderKind::Clip => (
                    Tokenizer::Clip(
                        match tok {
                            TokenizerSource::Path(p) => ClipTokenizer::from_dir(p, len, None),
                            TokenizerSource::Builtin(b) => ClipTokenizer::builtin(*b, len),
                        }
                        .map_err(|e| wrap(key, slot, e))?,
                    ),
                    Encoder::Clip(
                        ClipTextModel::load_patched(&w.path, w.prefix, dtype, device, None, patch)
                            .map_err(|e| wrap(key, slot, e))?
                            .0,
                    ),
                ),
                TextEncoderKind::T5 => {
                    // T5 overflows in f16 (the loader refuses it): f32 then.
                    let dt = if dtype == DType::F16 {
                        DType::F32
                    } else {
                        dtype
                    };
                    (
                        Tokenizer::T5(
                            match tok {
                                TokenizerSource::Path(p) => T5Tokenizer::from_file(p, len),
                                TokenizerSource::Builtin(_) => T5Tokenizer::builtin(len),
                            }
                            .map_err(|e| wrap(key, slot, e))?,
                        ),
                        Encoder::T5(
                            T5Encoder::load_adapted(
                                &w.path,
                                w.prefix,
                                dt,
                                device,
                                None,
                                opts.stream_t5.then_some(2),
                                patch,
                            )
                            .map_err(|e| wrap(key, slot, e))?
                            .0,
                        ),
                    )
                }
                TextEncoderKind::Qwen3(cond) => {
                    // Qwen3 is not run in f16 (the loader refuses it): bf16, as released.
                    let dt = if dtype == DType::F16 {
                        DType::BF16
                    } else {
                        dtype
                    };
                    let opts = Qwen3Options {
                        prefix: w.prefix.map(str::to_string),
                        stream: opts.stream_qwen3.then_some(2),
                        fp8: opts.fp8_qwen3,
                        patch,
                        ..cond.options()
                    };
                    (
                        Tokenizer::Qwen3(
                            match tok {
                                TokenizerSource::Path(p) => Qwen3Tokenizer::from_dir(p, len),
                                TokenizerSource::Builtin(_) => Qwen3Tokenizer::builtin(len),
                            }
                            .map_err(|e| wrap(key, slot, e))?,
                            cond,
                        ),
                        Encoder::Qwen3(
                            Qwen3Encoder::load(&w.path, dt, device, &opts)
                                .map_err(|e| wrap(key, slot, e))?
                                .0,
                            cond,
                        ),
                    )
                }
            };
            encoders.push(Some(pair));
        }
        Ok(TextConditioner {
            family,
            encoders,
            device: device.clone(),
            identity: Self::identity_of(family, located, opts, dtype),
        })
    }

    /// The [`identity`](Self::identity) the encoders at `located` would have, without
    /// loading them.
    pub fn identity_of(
        family: &Family,
        located: &[(Located, TokenizerSource)],
        opts: &TextOptions,
        dtype: DType,
    ) -> String {
        let mut id = vec![format!("{} {dtype:?}", family.name)];
        for (slot, (w, tok)) in family.pipeline.text.iter().zip(located) {
            id.push(format!(
                "{}: {} under {:?}, tokenizer {}, {} tokens",
                slot.name,
                file_identity(&w.path),
                w.prefix,
                match tok {
                    TokenizerSource::Path(p) => file_identity(p),
                    TokenizerSource::Builtin(b) =>
                        format!("{} (FLAME {})", b.describe(), env!("CARGO_PKG_VERSION")),
                },
                slot.len(opts.guided, opts.t5_tokens)
            ));
            if opts.fp8_qwen3 && matches!(slot.kind, TextEncoderKind::Qwen3(_)) {
                id.push(format!("{}: Linears in FP8", slot.name));
            }
        }
        id.join("\n")
    }

    /// A string that changes whenever the embeddings would (files, prefixes, dtype, token
    /// lengths): the text cache's encoder name.
    pub fn identity(&self) -> &str {
        &self.identity
    }

    /// The sizes of slot `i`'s encoder where it is loaded: what the memory planner counts
    /// a trained encoder's activations by.
    pub fn dims(&self, i: usize) -> Option<EncoderDims> {
        let (_, enc) = self.encoders.get(i)?.as_ref()?;
        Some(match enc {
            Encoder::Clip(m) => {
                let c = &m.config;
                EncoderDims {
                    width: c.hidden_size,
                    attention: c.hidden_size,
                    mlp: c.intermediate_size,
                    layers: c.num_hidden_layers,
                    heads: c.num_attention_heads,
                    gated: false,
                }
            }
            Encoder::T5(m) => {
                let c = &m.config;
                EncoderDims {
                    width: c.d_model,
                    attention: c.num_heads * c.d_kv,
                    mlp: c.d_ff,
                    layers: c.num_layers,
                    heads: c.num_heads,
                    gated: true,
                }
            }
            Encoder::Qwen3(m, _) => {
                let c = &m.config;
                EncoderDims {
                    width: c.hidden_size,
                    attention: c.num_attention_heads * c.head_dim,
                    mlp: c.intermediate_size,
                    layers: m.depth(),
                    heads: c.num_attention_heads,
                    gated: true,
                }
            }
        })
    }

    /// What one more caption in a pass of the loaded encoders takes on the device, the
    /// encoders loaded in `dtype`: the largest layer's work ([`EncoderDims::pass_bytes`], in
    /// the dtype each encoder runs in: T5 asked for f16 runs in f32) and every slot's
    /// outputs in f32 (the whole sequence and a pooled vector). `None` where an encoder's
    /// captions do not all take its fixed length (Qwen3's conditioning keeps each caption's
    /// tokens): those are encoded one at a time.
    pub fn caption_bytes(&self, dtype: DType) -> Result<Option<u64>> {
        let (mut work, mut outputs) = (0u64, 0u64);
        for (i, pair) in self.encoders.iter().enumerate() {
            let Some((tok, enc)) = pair else { continue };
            let tokens = match tok {
                Tokenizer::Clip(t) => t.encode("")?.ids.len(),
                Tokenizer::T5(t) => t.encode("")?.ids.len(),
                Tokenizer::Qwen3(..) => return Ok(None),
            };
            let elem = match (enc, dtype) {
                (Encoder::T5(_), DType::F16) => DType::F32.size_in_bytes(),
                _ => dtype.size_in_bytes(),
            };
            let Some(d) = self.dims(i) else { continue };
            work = work.max(d.pass_bytes(tokens, elem));
            outputs += ((tokens + 1) * d.width * 4) as u64;
        }
        Ok(Some(work + outputs))
    }

    /// The counters of each encoder whose blocks stream from host memory, by slot name
    /// ("t5", "qwen3"): none where every encoder is resident.
    pub fn stream_reports(&self) -> Result<Vec<(&'static str, crate::memory::StreamReport)>> {
        let mut out = vec![];
        for (slot, pair) in self.family.pipeline.text.iter().zip(&self.encoders) {
            let streamer = match pair {
                Some((_, Encoder::T5(m))) => m.exec().streamer.as_ref(),
                Some((_, Encoder::Qwen3(m, _))) => m.exec().streamer.as_ref(),
                _ => None,
            };
            if let Some(s) = streamer {
                out.push((slot.name, s.report()?));
            }
        }
        Ok(out)
    }

    /// The model's text inputs for `captions`, by input name, each (B, ...) in f32 on the
    /// device the encoders run on; no gradients are recorded.
    pub fn encode(&self, captions: &[&str]) -> Result<Named> {
        let _g = no_grad();
        self.encode_tracked(captions)
    }

    /// [`encode`](Self::encode) recording gradients where they flow (through adapters on
    /// the encoders, when not under `no_grad`); encoders not loaded give zeros
    /// ([`stand_in`]) to the inputs made from them.
    pub fn encode_tracked(&self, captions: &[&str]) -> Result<Named> {
        let mut outs = vec![];
        for (slot, pair) in self.family.pipeline.text.iter().zip(&self.encoders) {
            let Some((tok, enc)) = pair else {
                outs.push(stand_in(slot, &self.device)?);
                continue;
            };
            let tokens: Vec<Tokens> = captions
                .iter()
                .map(|c| match tok {
                    Tokenizer::Clip(t) => t.encode(c),
                    Tokenizer::T5(t) => t.encode(c),
                    Tokenizer::Qwen3(t, cond) => cond.tokens(t, c),
                })
                .collect::<Result<_>>()?;
            let (ids, mask) = Tokens::batch(&tokens, &self.device)?;
            // CLIP and T5 run without a mask (diffusers' pipelines pass none); Qwen3 with the
            // tokenizer's, as FLUX.2 [klein]'s and Z-Image's pipelines do.
            outs.push(match enc {
                Encoder::Clip(m) => TextOutput::Clip(m.forward(&ids, None)?),
                Encoder::T5(m) => TextOutput::T5(m.forward(&ids, None)?),
                Encoder::Qwen3(m, cond) => TextOutput::Qwen3(cond.encode(m, &ids, &mask)?),
            });
        }
        (self.family.pipeline.combine)(&outs)?
            .into_iter()
            .map(|(n, t)| Ok((n, t.to_dtype(DType::F32)?)))
            .collect()
    }
}

/// Loads `family`'s autoencoder from `located` in `dtype` on `device`, with the family's
/// latent scaling. Errors name `key`.
pub fn load_vae(
    family: &Family,
    located: &Located,
    dtype: DType,
    device: &Device,
    key: &str,
) -> Result<AutoencoderKl> {
    AutoencoderKl::load(
        &located.path,
        located.prefix,
        Some(family.pipeline.vae),
        dtype,
        device,
        None,
    )
    .map(|(v, _)| v)
    .map_err(|e| pipeline_err(format!("{key}: {e}")))
}

/// `x` (B, L, d) zero-padded on its last dim to `width`; an error when d > width.
pub fn pad_last(x: &Tensor, width: usize) -> Result<Tensor> {
    let dims = x.dims().to_vec();
    let d = dims.last().copied().unwrap_or(0);
    if d > width {
        return Err(Error::invalid(
            "pad_last",
            format!("width {d} is wider than {width}"),
            x.shape(),
        ));
    }
    if d == width {
        return Ok(x.clone());
    }
    let mut zdims = dims.clone();
    if let Some(last) = zdims.last_mut() {
        *last = width - d;
    }
    let z = Tensor::zeros(zdims, x.dtype(), x.device())?;
    Tensor::cat(&[x, &z], dims.len() - 1)
}

/// The name of the input SDXL-style models take from an image's geometry: (original height,
/// original width, crop top, crop left, target height, target width).
pub const TIME_IDS: &str = "time_ids";

/// The model's inputs after the latents, in its order, for one image of `size` (height,
/// width) in pixels: the text inputs from `text` (by name, as [`TextConditioner::encode`]
/// or the text cache gives them) and, where the model takes them, the `time_ids` of an
/// uncropped image of that size (diffusers' default at inference). In `dtype` on `device`.
pub fn conditioning(
    inputs: &[super::Input],
    text: &[(String, Tensor)],
    size: (usize, usize),
    dtype: DType,
    device: &Device,
) -> Result<Vec<Tensor>> {
    let (h, w) = size;
    inputs
        .iter()
        .skip(1)
        .map(|i| {
            if i.name == TIME_IDS {
                let ids = [h, w, 0, 0, h, w].map(|x| x as f32).to_vec();
                return Tensor::from_vec(ids, (1, 6), device)?.to_dtype(dtype);
            }
            let t = text
                .iter()
                .find(|(n, _)| n == i.name)
                .map(|(_, t)| t)
                .ok_or_else(|| {
                    pipeline_err(format!(
                        "the model takes \"{}\", which the text conditioning does not give \
                         ({:?})",
                        i.name,
                        text.iter().map(|(n, _)| n).collect::<Vec<_>>()
                    ))
                })?;
            t.to_device(device)?.to_dtype(dtype)
        })
        .collect()
}
