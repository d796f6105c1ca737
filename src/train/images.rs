//! Training from images with captions: the `[data]` image sources scanned and bucketed
//! ([`crate::data`]), latents and text embeddings encoded once into the caches by the
//! family's autoencoder and text encoders ([`crate::models::pipeline`]), the encoders freed,
//! and batches read back from the caches step by step.

use super::config::{DeviceChoice, ModelDType, Toggle, TrainConfig};
use super::data::{Batch, Part, Samples};
use super::text::TextTraining;
use crate::data::{self, BatchSampler, LatentCache, Progress, TextCache};
use crate::dist::ProcessGroup;
use crate::encoders::{AutoencoderKl, VaeTiling};
use crate::models::pipeline::{
    encoder_device_bytes, file_identity, load_vae, qwen3_file_is_fp8, tokenizer_lines,
    weight_bytes, Located, Named, Sources, TextConditioner, TextEncoderKind, TextOptions,
    TokenizerSource,
};
use crate::models::{Family, Input, Size};
use crate::{DType, Device, Error, Result, Tensor};
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub use crate::models::pipeline::TIME_IDS;

/// The input every family takes its latents in.
const LATENTS: &str = "latents";

/// A bucketed image dataset with its caches: batches for training or validation.
pub struct ImageSamples {
    /// The images and their samples.
    pub ds: data::Dataset,
    sampler: BatchSampler,
    latents: LatentCache,
    text: TextCache,
    names: Vec<&'static str>,
    largest: Vec<Vec<usize>>,
    /// The loss weight of regularisation samples (`data.prior_loss_weight`).
    prior_loss_weight: f64,
    /// The trained text encoders, whose inputs are encoded from the captions every step
    /// instead of read from the cache.
    live: Option<Arc<TextTraining>>,
}

/// What [`prepare`] made: the training samples, the held-out ones, and what the user should
/// hear about (skipped files, cache reports).
pub struct ImageRun {
    /// The training samples.
    pub train: ImageSamples,
    /// The validation samples, when `data.validation_split` or `data.validation_dir` is set.
    pub validation: Option<ImageSamples>,
    /// The autoencoder's downsampling factor (8 in the released ones).
    pub vae_factor: usize,
    /// The autoencoder's first stage's width (`block_out_channels[0]`), for memory estimates.
    pub vae_width: usize,
    /// The located autoencoder (sampling loads it again to decode).
    pub vae: Located,
    /// The text cache holding the sample prompts' embeddings.
    pub text: TextCache,
    /// The sample prompts' reference images (edit sampling): per prompt, each file with its
    /// way into the model, encoded into `pictures`.
    pub sample_references: Vec<Vec<(PathBuf, data::Geometry)>>,
    /// The latent cache holding the sample prompts' reference images.
    pub pictures: LatentCache,
}

fn cfg_err(msg: String) -> Error {
    Error::Config { path: None, msg }
}

/// [`Error::Interrupted`] once `stop` is set.
fn interrupted(stop: &std::sync::atomic::AtomicBool, what: &str) -> Result<()> {
    match stop.load(std::sync::atomic::Ordering::Relaxed) {
        true => Err(Error::Interrupted(format!(
            "while caching {what} (the entries cached so far are kept and reused)"
        ))),
        false => Ok(()),
    }
}

/// The model's check of one sample's input shapes (`DiffusionModel::check_shapes`).
pub type ShapeCheck<'a> = &'a dyn Fn(&[Vec<usize>]) -> std::result::Result<(), String>;

/// Checks every bucket's size and the sample images' size against the autoencoder's
/// downsampling `factor` and the model's rules for its latents (`latents`: (C, H, W)), so a
/// size no batch could train on fails before anything is encoded, naming the keys.
fn check_sizes(
    config: &TrainConfig,
    family: &Family,
    latents: &Input,
    (factor, channels): (usize, usize),
    buckets: &[data::Bucket],
    model: ShapeCheck<'_>,
) -> Result<()> {
    let multiple = |dim: usize| match latents.dims.get(dim) {
        Some(Size::MultipleOf(m)) => factor * m.max(&1),
        Some(Size::Exactly(_)) | None => factor,
    };
    let (mh, mw) = (multiple(1), multiple(2));
    let d = &config.data;
    let bad = |w: usize, h: usize| w % mw != 0 || h % mh != 0 || w == 0 || h == 0;
    if let Some(b) = buckets.iter().find(|b| bad(b.width, b.height)) {
        return Err(cfg_err(format!(
            "data.bucket_step = {} with data.resolution = {} makes a {}x{} bucket: {} takes \
             images whose sides are multiples of {} (its autoencoder shrinks them {factor}x, \
             its latents need sides in multiples of {}); use a data.bucket_step and \
             data.resolution that are multiples of {}",
            d.bucket_step,
            d.resolution,
            b.width,
            b.height,
            family.name,
            mw.max(mh),
            mw.max(mh) / factor,
            mw.max(mh)
        )));
    }
    // The model's own limits on its latents (SD3's position table).
    let grid = |w: usize, h: usize| model(&[vec![channels, h / factor, w / factor]]);
    if let Some((b, why)) = buckets
        .iter()
        .find_map(|b| grid(b.width, b.height).err().map(|e| (b, e)))
    {
        return Err(cfg_err(format!(
            "data.resolution = {} makes a {}x{} bucket: {why}; lower data.resolution",
            d.resolution, b.width, b.height
        )));
    }
    let s = &config.sample;
    if !s.prompts.is_empty() {
        let (w, h, key) = match s.size {
            [0, 0] => (
                d.resolution,
                d.resolution,
                "sample.size (default: data.resolution)",
            ),
            [w, h] => (w, h, "sample.size"),
        };
        if bad(w, h) {
            return Err(cfg_err(format!(
                "{key} = [{w}, {h}]: {} samples images whose sides are multiples of {}",
                family.name,
                mw.max(mh)
            )));
        }
        if let Err(why) = grid(w, h) {
            return Err(cfg_err(format!("{key} = [{w}, {h}]: {why}")));
        }
    }
    Ok(())
}

/// The device the encoders run on (`encoders.device`).
pub fn encoder_device(config: &TrainConfig, train: &Device) -> Result<Device> {
    match config.encoders.device {
        DeviceChoice::Auto => Ok(train.clone()),
        other => Device::chosen(other),
    }
}

/// The dtype the encoders compute in: f32 for f32 training or on the CPU, else bf16.
pub fn encoder_dtype(config: &TrainConfig, device: &Device) -> DType {
    if config.model.dtype == ModelDType::F32 || !device.is_cuda() {
        DType::F32
    } else {
        DType::BF16
    }
}

/// The pipeline pieces of `config`'s model (`[encoders]`, else next to `model.path`).
pub fn locate(
    config: &TrainConfig,
    family: &Family,
) -> Result<(Vec<(Located, TokenizerSource)>, Located)> {
    let e = &config.encoders;
    Sources {
        text: e.text.clone(),
        tokenizers: e.tokenizers.clone(),
        vae: e.vae.clone(),
    }
    .locate(
        family,
        &config.model.path,
        ["encoders.text", "encoders.tokenizers", "encoders.vae"],
    )
}

/// The loaded autoencoder with `encoders.vae_tile` applied.
pub fn vae(
    config: &TrainConfig,
    family: &Family,
    at: &Located,
    dtype: DType,
    device: &Device,
) -> Result<AutoencoderKl> {
    let mut v = load_vae(family, at, dtype, device, "encoders.vae")?;
    if config.encoders.vae_tile > 0 {
        v.tiling = Some(VaeTiling::new(config.encoders.vae_tile));
    }
    Ok(v)
}

/// The first stage's width of the released Flux, SD3 and SDXL autoencoders (diffusers'
/// `block_out_channels[0]`), for estimates made before one is loaded.
pub(crate) const VAE_FIRST_WIDTH: usize = 128;

/// The side of the tiles the autoencoder works in when a whole image does not fit.
pub const AUTO_TILE: usize = 512;

/// The tile the autoencoder decodes in: `vae_tile` when set, else [`AUTO_TILE`] under a
/// memory budget (the model holds most of it: Flux's decoder takes 1.8 GiB at 1024² in
/// tiles against 6.7 whole), else 0 (whole images). The trainer's samples and the `sample`
/// binary decode with it.
pub fn decode_tile(vae_tile: usize, budgeted: bool) -> usize {
    match (vae_tile, budgeted) {
        (0, true) => AUTO_TILE,
        (t, _) => t,
    }
}

/// The tile the autoencoder works in on an image whose whole encode or decode takes `whole`
/// bytes ([`encode_bytes`], [`decode_bytes`]), beside what FLAME's buffers hold on `device`
/// now: [`decode_tile`] under a budget (`budgeted`); without one, on a GPU, whole images
/// where the work fits beside those buffers within the memory free at start
/// ([`crate::memory::split_at_start`]), else [`AUTO_TILE`]; on the CPU `vae_tile` (0:
/// whole). The `sample` binary's references and decode (after its model is freed).
pub fn tile_now(vae_tile: usize, budgeted: bool, device: &Device, whole: u64) -> Result<usize> {
    let cap = match budgeted {
        true => None,
        false => crate::memory::split_at_start(device)?.0,
    };
    let in_use = crate::memory::allocator_in_use(device);
    Ok(decode_tile_within(
        vae_tile,
        budgeted,
        cap.map(|c| (c, in_use)),
        whole,
    ))
}

/// The width of `vae`'s first stage (diffusers' `block_out_channels[0]`), which its encode
/// and decode estimates scale with.
pub fn first_width(vae: &AutoencoderKl) -> usize {
    vae.config
        .block_out_channels
        .first()
        .copied()
        .unwrap_or(VAE_FIRST_WIDTH)
}

/// The decode tile: `vae_tile` where set; under a given budget (`given`),
/// [`AUTO_TILE`] (the model holds most of it:
/// [`decode_tile`]); under the default budget (a GPU's free memory), `room` = (the
/// allocator's share, what the run keeps beside the decode): whole images where a whole
/// decode (`whole` bytes) fits beside what it keeps, else that tile; whole images without a
/// budget (the CPU).
pub(crate) fn decode_tile_within(
    vae_tile: usize,
    given: bool,
    room: Option<(u64, u64)>,
    whole: u64,
) -> usize {
    match (decode_tile(vae_tile, given), room) {
        (0, Some((cap, keeps))) if keeps.saturating_add(whole) > cap => AUTO_TILE,
        (t, _) => t,
    }
}

/// The smallest tile a decode that ran out of memory is tried again in.
const LEAST_TILE: usize = 128;

/// `vae.decode_latents(z)`, tried again in smaller tiles where the device runs out of memory
/// (whole images in [`AUTO_TILE`]-pixel tiles, tiles in half their side, down to 128
/// pixels): the sample images of a run are not lost to a prediction of the decode's memory
/// that fell short. Each retry is told to `on`, and the tile stays for the images after; an
/// error of any other kind, or at the smallest tile, is returned as it is.
pub fn decode_fitting(
    vae: &mut AutoencoderKl,
    z: &Tensor,
    on: &mut dyn FnMut(String),
) -> Result<Tensor> {
    loop {
        let decoded = match crate::fault::out_of_memory("decode") {
            true => Err(Error::OutOfMemory {
                device: z.device().location(),
                requested: 0,
                in_use: 0,
                limit: 0,
                device_full: true,
            }),
            false => vae.decode_latents(z),
        };
        let e = match decoded {
            Err(e @ Error::OutOfMemory { .. }) => e,
            other => return other,
        };
        let now = vae.tiling.as_ref().map_or(0, |t| t.tile);
        let next = match now {
            0 => AUTO_TILE,
            t if t / 2 >= LEAST_TILE => t / 2,
            _ => return Err(e),
        };
        on(format!(
            "the autoencoder ran out of memory decoding {} ({e}); decoding again in \
             {next}-pixel tiles (encoders.vae_tile sets the tile)",
            match now {
                0 => "whole images".to_string(),
                t => format!("in {t}-pixel tiles"),
            }
        ));
        vae.tiling = Some(VaeTiling::new(next));
    }
}

/// The pixels the autoencoder holds at once for an image of `pixels` in tiles of side
/// `tile` (0: whole).
pub(crate) fn pixels_at_once(pixels: usize, tile: usize) -> usize {
    match tile {
        0 => pixels,
        t => pixels.min(t * t),
    }
}

/// Bytes the autoencoder's encoder holds at once for an image (or tile) of `pixels`: about
/// 16 activations of its first stage's `width` at full resolution (measured: a 1024² encode
/// with the 128-wide stage peaks at 3.9 GiB in bf16, weights included).
pub fn encode_bytes(pixels: usize, width: usize, dtype: DType) -> u64 {
    (pixels * width * dtype.size_in_bytes() * 16) as u64
}

/// Bytes the autoencoder's decoder holds at once for an image (or tile) of `pixels`: about
/// 27 activations of its first stage's `width` at full resolution (measured: Flux's decoder
/// at 1024² peaks at 6.7 GiB in bf16; in 512-pixel tiles at 1.8 GiB).
pub fn decode_bytes(pixels: usize, width: usize, dtype: DType) -> u64 {
    (pixels * width * dtype.size_in_bytes() * 27) as u64
}

/// The encode tile for images of up to `pixels` with an allocator share of `cap` bytes
/// (none: no budget on a GPU): `encoders.vae_tile` when set, else [`AUTO_TILE`] when a
/// whole image would need more than `cap`, else 0 (whole images).
pub(crate) fn choose_encode_tile(
    config: &TrainConfig,
    cap: Option<u64>,
    pixels: usize,
    width: usize,
    dtype: DType,
) -> usize {
    match (config.encoders.vae_tile, cap) {
        (0, Some(cap)) if encode_bytes(pixels, width, dtype) > cap => AUTO_TILE,
        (t, _) => t,
    }
}

/// The budget the choices that shape what a run caches and draws plan within (the encode
/// and decode tiles, the text encoders' streaming), bytes: (as the driver counts them, the
/// allocator's share). `memory.budget_gb` where given, split as `memory::split_budget`
/// splits it; without one, on a GPU, what the process could hold when it opened the device
/// (`memory::memory_at_start`: its context and the memory free then, the least of the
/// ranks' in data-parallel training, which the ranks agree on before caching) less what it
/// holds outside the allocator and `memory::LATE_HEADROOM`: the same figure in every phase
/// of a run, and on every rank, where the free memory of the moment is not (the encode tile
/// is part of the latent cache's key). `None` on the CPU without a budget.
pub fn phase_budget(config: &TrainConfig, device: &Device) -> Result<Option<(u64, u64)>> {
    let (alloc, outside) = match config.memory.budget_gb > 0.0 {
        true => crate::memory::split_budget(device, config.memory.budget_gb)?,
        false => crate::memory::split_at_start(device)?,
    };
    Ok(alloc.map(|a| (a + outside.unwrap_or(0), a)))
}

/// The allocator's share of the run's [`phase_budget`] on a GPU; none on the CPU.
pub(crate) fn allocator_share(config: &TrainConfig, device: &Device) -> Result<Option<u64>> {
    if !device.is_cuda() {
        return Ok(None);
    }
    Ok(phase_budget(config, device)?.map(|(_, a)| a))
}

/// The run's [`phase_budget`] as the driver counts it, bytes: what the text encoders'
/// "auto" streaming weighs.
pub fn driver_budget(config: &TrainConfig, device: &Device) -> Result<Option<u64>> {
    Ok(phase_budget(config, device)?.map(|(d, _)| d))
}

/// The tile the autoencoder encodes in ([`choose_encode_tile`] for this run's budget on
/// `device`); a tile chosen for the budget is said in a note.
fn encode_tile(
    config: &TrainConfig,
    device: &Device,
    vae: &AutoencoderKl,
    dtype: DType,
    pixels: usize,
    on: &mut dyn FnMut(String),
) -> Result<usize> {
    let width = first_width(vae);
    let cap = allocator_share(config, device)?;
    let tile = choose_encode_tile(config, cap, pixels, width, dtype);
    if let (Some(cap), true) = (cap, tile != config.encoders.vae_tile) {
        on(format!(
            "the autoencoder encodes in {tile}-pixel tiles: a whole image of {pixels} pixels \
             needs about {:.1} GiB, more than the {:.1} GiB of {} FLAME's allocator may hold \
             (set encoders.vae_tile to choose the tile)",
            encode_bytes(pixels, width, dtype) as f64 / (1u64 << 30) as f64,
            cap as f64 / (1u64 << 30) as f64,
            match config.memory.budget_gb > 0.0 {
                true => "memory.budget_gb",
                false => "the GPU's memory free at start",
            }
        ));
    }
    Ok(tile)
}

/// Bytes the text encoders hold while captions are encoded, about: their weight files
/// (at most: a file stored in f32 is encoded in bf16 on a GPU), T5 an eighth of its
/// weights when streamed (its embedding and the blocks in flight), Qwen3 a quarter (its
/// embedding, a tenth of Qwen3-4B, and three layers), and, resident with its Linears made
/// FP8 from a 16-bit file, 11/20 of them (`encoder_device_bytes`). With whether one of them
/// streams.
pub(crate) fn text_encoder_bytes(
    config: &TrainConfig,
    family: &Family,
    budget: Option<u64>,
) -> Result<(u64, bool)> {
    let (text_at, _) = locate(config, family)?;
    let opts = text_options(config, family, &text_at, false, budget);
    let bytes = family
        .pipeline
        .text
        .iter()
        .zip(&text_at)
        .map(|(slot, (l, _))| encoder_device_bytes(slot.kind, &l.path, &opts))
        .sum();
    Ok((bytes, opts.stream_t5 || opts.stream_qwen3))
}

/// Device memory that encoding captions holds beside the text encoders' weights, as the
/// driver counts it: the CUDA context and the libraries' workspaces (0.6-0.8 GiB on an H100
/// with CUDA 13: the `train` summary's "held outside it"), the allocator's late headroom,
/// the activations of a pass (one caption of T5-XXL at 512 tokens: about 0.1 GiB; a batch
/// takes at most half of what is left, [`caption_batch`]) and room for the pool's pieces.
pub const ENCODE_RESERVE: u64 = 2 << 30;

/// The most captions a pass of the text encoders takes while the cache fills.
pub const MAX_CAPTION_BATCH: usize = 16;

/// The most device memory a pass's captions may take while the cache fills (their
/// activations, at [`TextConditioner::caption_bytes`] each): what the plan of the caching
/// phase adds to the text encoders' weights.
pub const CAPTION_WORK: u64 = 1 << 30;

/// The memory a pass's captions may take while the cache fills, of `free` bytes left to
/// FLAME's allocator beside the text encoders: [`CAPTION_WORK`], or half of `free` where
/// that is less (the rest for the pool's pieces).
pub fn caption_work(free: u64) -> u64 {
    CAPTION_WORK.min(free / 2)
}

/// How many captions a pass of the loaded text encoders `cond` takes while the cache fills:
/// as many as [`caption_work`] holds ([`TextConditioner::caption_bytes`] each, in `dtype`)
/// of what FLAME's allocator may still hand out less four blocks of each streamed encoder
/// (the streamer's blocks in flight), at most [`MAX_CAPTION_BATCH`]; one where an encoder's
/// captions differ in length (Qwen3). Without a cap (the CPU), the most. Fewer passes: a
/// streamed encoder's weights cross the link once a pass, and a pass of one caption leaves
/// the GPU mostly idle. The groups are the sorted missing captions in order: the same
/// captions and batch make the same groups.
pub fn caption_batch(cond: &TextConditioner, dtype: DType, device: &Device) -> Result<usize> {
    let Some(per) = cond.caption_bytes(dtype)? else {
        return Ok(1);
    };
    let Some(free) = crate::memory::allocator_free(device) else {
        return Ok(MAX_CAPTION_BATCH);
    };
    let window: u64 = cond
        .stream_reports()?
        .iter()
        .map(|(_, r)| 4 * (r.host_bytes / r.blocks.max(1) as u64))
        .sum();
    let fits = caption_work(free.saturating_sub(window)) / per.max(1);
    Ok((fits as usize).clamp(1, MAX_CAPTION_BATCH))
}

/// Whether an encoder of `kind` is the one a streaming rule weighs: T5, or with `qwen3`
/// Qwen3.
fn streamed_kind(kind: TextEncoderKind, qwen3: bool) -> bool {
    match kind {
        TextEncoderKind::T5 => !qwen3,
        TextEncoderKind::Qwen3(_) => qwen3,
        TextEncoderKind::Clip => false,
    }
}

/// Whether `family`'s T5 (or, with `qwen3`, its Qwen3) streams its blocks under a budget
/// of `budget` bytes as the driver counts them while the text encoders run alone on the
/// device (caching the captions, `sample`'s prompts: the model loads after they are freed):
/// where the weight files of the pipeline's text encoders (`text_at`, its text slots in
/// order; a file several slots share counted once), which encode the captions together,
/// and [`ENCODE_RESERVE`] take more than it; never without a budget.
pub fn streams_within(
    family: &Family,
    text_at: &[(Located, TokenizerSource)],
    qwen3: bool,
    budget: Option<u64>,
) -> bool {
    let Some(budget) = budget.filter(|&b| b > 0) else {
        return false;
    };
    let streamable = family
        .pipeline
        .text
        .iter()
        .any(|slot| streamed_kind(slot.kind, qwen3));
    let files: std::collections::BTreeSet<&Path> =
        text_at.iter().map(|(w, _)| w.path.as_path()).collect();
    let weights: u64 = files.into_iter().map(weight_bytes).sum();
    streamable && weights.saturating_add(ENCODE_RESERVE) > budget
}

/// Whether `family`'s T5 (or, with `qwen3`, its Qwen3) streams its blocks under a budget
/// of `budget` bytes where adapters train on it beside the diffusion model, every step:
/// where its weight files take more than half of the budget (the model's plan takes the
/// rest); never without a budget.
pub fn streams_beside_model(
    family: &Family,
    text_at: &[(Located, TokenizerSource)],
    qwen3: bool,
    budget: Option<u64>,
) -> bool {
    let budget = budget.unwrap_or(0) as f64;
    budget > 0.0
        && family
            .pipeline
            .text
            .iter()
            .zip(text_at)
            .any(|(slot, (w, _))| {
                streamed_kind(slot.kind, qwen3) && weight_bytes(&w.path) as f64 > budget / 2.0
            })
}

/// How the captions' encoders are set up to encode them before the model loads (`guided`:
/// the model takes a guidance input). T5 and Qwen3 stream while encoding as
/// `encoders.stream_t5` and `encoders.stream_qwen3` say: "auto" streams under a budget
/// (`budget`, bytes as the driver counts them: the run's, [`driver_budget`], the default one
/// on a GPU included) where the text encoders' weights do not fit it resident
/// ([`streams_within`]; one inside an all-in-one file counts the whole file: streaming is
/// then the safe side). Qwen3's Linears are FP8 as `encoders.fp8_qwen3` says: "auto" when
/// the model's weights are FP8 or Qwen3's file is ([`qwen3_file_is_fp8`]).
pub fn text_options(
    config: &TrainConfig,
    family: &Family,
    text_at: &[(Located, TokenizerSource)],
    guided: bool,
    budget: Option<u64>,
) -> TextOptions {
    options_by(config, family, text_at, guided, budget, streams_within)
}

/// [`text_options`] for encoders that adapters train beside the diffusion model: "auto"
/// streams where the encoder takes more than half of the budget
/// ([`streams_beside_model`]).
pub fn training_text_options(
    config: &TrainConfig,
    family: &Family,
    text_at: &[(Located, TokenizerSource)],
    guided: bool,
    budget: Option<u64>,
) -> TextOptions {
    options_by(
        config,
        family,
        text_at,
        guided,
        budget,
        streams_beside_model,
    )
}

/// Whether an encoder streams ([`streams_within`], [`streams_beside_model`]).
type StreamRule = fn(&Family, &[(Located, TokenizerSource)], bool, Option<u64>) -> bool;

/// The options, "auto" streaming as `rule` says.
fn options_by(
    config: &TrainConfig,
    family: &Family,
    text_at: &[(Located, TokenizerSource)],
    guided: bool,
    budget: Option<u64>,
    rule: StreamRule,
) -> TextOptions {
    let streams = |toggle: Toggle, qwen3: bool| match toggle {
        Toggle::On => true,
        Toggle::Off => false,
        Toggle::Auto => rule(family, text_at, qwen3, budget),
    };
    TextOptions {
        guided,
        t5_tokens: config.encoders.t5_tokens,
        stream_t5: streams(config.encoders.stream_t5, false),
        stream_qwen3: streams(config.encoders.stream_qwen3, true),
        fp8_qwen3: match config.encoders.fp8_qwen3 {
            Toggle::On => true,
            Toggle::Off => false,
            Toggle::Auto => {
                config.model.dtype == ModelDType::Fp8 || qwen3_file_is_fp8(family, text_at)
            }
        },
    }
}

/// The cache folder: `data.cache_dir`, else `cache` in the output folder.
pub fn cache_dir(config: &TrainConfig) -> PathBuf {
    config
        .data
        .cache_dir
        .clone()
        .unwrap_or_else(|| config.train.output_dir.join("cache"))
}

/// The most captions a run may encode ahead (its epochs' captions with `data.shuffle_tags`):
/// each is a text cache entry on disk (Flux's T5 at 512 tokens: 4 MiB).
pub const MAX_CAPTIONS: usize = 1_000_000;

/// Every distinct caption the training samples `ds` are drawn with over the run's epochs
/// (`world` ranks of `train.batch_size`), in first-drawn order; without
/// `data.shuffle_tags` the captions as written (caption dropout draws only the empty
/// caption besides). An error naming the keys when the run would draw more than
/// [`MAX_CAPTIONS`].
fn run_captions(config: &TrainConfig, ds: &data::Dataset, world: usize) -> Result<Vec<String>> {
    let mut seen = std::collections::HashSet::new();
    if !config.data.shuffle_tags {
        return Ok(ds
            .items
            .iter()
            .filter(|it| seen.insert(it.caption.clone()))
            .map(|it| it.caption.clone())
            .collect());
    }
    let mut captions = vec![];
    for e in 0..shuffled_epochs(config, ds, world)? as u64 {
        for i in 0..ds.len() {
            let c = ds.caption(i, e)?;
            if seen.insert(c.clone()) {
                captions.push(c);
            }
        }
    }
    Ok(captions)
}

/// The epochs whose shuffled captions the run encodes ahead (0 without
/// `data.shuffle_tags`); an error naming the keys past [`MAX_CAPTIONS`] drawn captions.
fn shuffled_epochs(config: &TrainConfig, ds: &data::Dataset, world: usize) -> Result<usize> {
    let t = &config.train;
    if !config.data.shuffle_tags {
        return Ok(0);
    }
    let sampler = ds.sampler(t.batch_size * world, false)?;
    let micro_batches = t.steps.saturating_mul(t.grad_accum);
    let epochs = micro_batches.div_ceil(sampler.batches_per_epoch().max(1));
    if epochs.saturating_mul(ds.len()) > MAX_CAPTIONS {
        return Err(cfg_err(format!(
            "data.shuffle_tags: train.steps = {} x train.grad_accum = {} make {epochs} epochs \
             of {} samples, and every epoch's shuffled captions are encoded ahead: at most \
             {MAX_CAPTIONS} captions; train fewer epochs or turn shuffle_tags off",
            t.steps,
            t.grad_accum,
            ds.len()
        )));
    }
    Ok(epochs)
}

/// The whole fill after every rank filled its share: one note at the end.
fn checked<'a>(what: &'a str, on: &'a mut dyn FnMut(String)) -> impl FnMut(&Progress) + 'a {
    move |p: &Progress| {
        if p.done == p.total {
            on(format!(
                "caching {what}: every rank's share done, {} on disk ({} encoded again)",
                p.total, p.computed
            ));
        }
    }
}

/// One process's share of a cache fill: (progress, rank, world) -> what it did.
type ShareFill<'a> =
    dyn FnMut(&mut dyn FnMut(&Progress), usize, usize) -> Result<data::FillReport> + 'a;

/// A cache fill of `what`, `fill(progress, rank, world)` filling process `rank`'s share of
/// `world`: alone, the whole, with progress notes; with a group, this rank's share (noted),
/// a barrier, then the whole, which finds every share on disk (one note at its end).
fn fill_shared(
    group: Option<&dyn ProcessGroup>,
    what: &str,
    on: &mut dyn FnMut(String),
    fill: &mut ShareFill<'_>,
) -> Result<data::FillReport> {
    let Some(g) = group else {
        return fill(&mut reporter(what, on), 0, 1);
    };
    let share = format!("{what}, rank {} of {}'s share", g.rank(), g.world());
    fill(&mut reporter(&share, &mut *on), g.rank(), g.world())?;
    g.barrier()?;
    fill(&mut checked(what, on), 0, 1)
}

/// Progress of a cache fill, as a note at every tenth of the way and at the end.
fn reporter<'a>(what: &'a str, on: &'a mut dyn FnMut(String)) -> impl FnMut(&Progress) + 'a {
    let mut last = 0;
    move |p: &Progress| {
        let tenth = p.done * 10 / p.total.max(1);
        if p.done == p.total || tenth > last {
            last = tenth;
            on(format!(
                "caching {what}: {}/{} ({} reused, {} encoded)",
                p.done, p.total, p.reused, p.computed
            ));
        }
    }
}

/// Scans, splits and buckets the images of `config.data` (the training set and the held-out
/// one), telling `on` about skipped files and notes, and checks what can be checked without
/// the model: the batch size against the samples (for `world` ranks) and the captions the
/// run would encode ahead ([`MAX_CAPTIONS`]).
pub fn scan(
    config: &TrainConfig,
    world: usize,
    on: &mut dyn FnMut(String),
) -> Result<(data::Dataset, Option<data::Dataset>)> {
    let d = &config.data;
    let opts = d.options(config.train.seed)?;
    let ds = data::Dataset::open(opts.clone())?;
    let (ds, val) = match &d.validation_dir {
        Some(dir) => {
            let mut o = opts.clone();
            o.sources = vec![data::Source::Folder {
                dir: dir.clone(),
                repeats: 1,
                references: d.validation_references.clone(),
            }];
            (ds, Some(data::Dataset::open(o)?))
        }
        None => ds.split(d.validation_split)?,
    };
    // Regularisation images join the training set after the split (never held out), their
    // repeats matched to the training samples as kohya's.
    let mut ds = ds;
    if !d.reg_dirs.is_empty() {
        let reg: Vec<data::Source> = d
            .reg_dirs
            .iter()
            .map(|e| data::Source::Folder {
                dir: e.path.clone(),
                repeats: e.repeats,
                references: e.references.clone(),
            })
            .collect();
        let found = data::scan_for(&reg, opts.on_bad_file, &opts.buckets)?;
        let given = found.items.len();
        let used = ds.add_regularisation(found)?;
        on(format!(
            "{used} of {given} regularisation images used, {} regularisation samples an epoch \
             (data.reg_dirs, repeats matched to the training images as kohya's)",
            ds.samples.iter().filter(|s| ds.items[s.item].reg).count()
        ));
    }
    for bad in ds.skipped.iter().chain(val.iter().flat_map(|v| &v.skipped)) {
        on(format!("skipped {bad}"));
    }
    for note in ds.notes.iter().chain(val.iter().flat_map(|v| &v.notes)) {
        on(note.clone());
    }
    super::data::check_batch_size(
        config,
        world,
        ds.len(),
        "training views (images x repeats x flips)",
    )?;
    // The run's captions are bounded before anything is encoded.
    shuffled_epochs(config, &ds, world)?;
    Ok((ds, val))
}

/// Scans, splits and buckets the images of `config.data` ([`scan`]); with `encode`, fills the latent
/// and text caches (loading the autoencoder, then the text encoders, each freed when done)
/// so that every batch of the run and every sample prompt is on disk. Without it (a dry
/// run) nothing is written and only the shapes are worked out. `inputs` are the model's,
/// `guided` whether it takes a guidance input, `model_shapes` its check of input shapes
/// (run on every bucket and the sample size before anything is encoded). Notes go to `on`. Batches are cut for `world`
/// processes of `train.batch_size` samples each (data-parallel training; 1 alone). With
/// `group` (the processes of a data-parallel run, every one calling this), each process
/// encodes its share of the images and captions, then, once all are done, every process
/// finds the whole cache on disk.
///
/// Everything that can be checked is checked before the first encode: the batch size
/// against the samples, and every bucket (and the sample size) against the autoencoder's
/// factor and the model's latent rules. `stop` set (a signal) ends the caching with
/// [`Error::Interrupted`] at the next image or caption.
#[allow(clippy::too_many_arguments)]
pub fn prepare(
    config: &TrainConfig,
    family: &'static Family,
    inputs: &[Input],
    guided: bool,
    model_shapes: ShapeCheck<'_>,
    train_device: &Device,
    encode: bool,
    world: usize,
    group: Option<&dyn ProcessGroup>,
    stop: &std::sync::atomic::AtomicBool,
    on: &mut dyn FnMut(String),
) -> Result<ImageRun> {
    let group = group.filter(|g| g.world() > 1);
    let t = &config.train;
    let (mut ds, mut val) = scan(config, world, on)?;
    let names: Vec<&'static str> = inputs.iter().map(|i| i.name).collect();
    if names.first() != Some(&LATENTS) {
        return Err(cfg_err(format!(
            "{} takes {names:?}: image data needs latents first",
            family.name
        )));
    }
    let device = encoder_device(config, train_device)?;
    let dtype = encoder_dtype(config, &device);
    let (text_at, vae_at) = locate(config, family)?;
    let cache = cache_dir(config);

    // Latents: the autoencoder, loaded once for the training and validation images.
    let mut vae = vae(config, family, &vae_at, dtype, &device)?;
    // The diffusion latents' downscale and channels (FLUX.2's are 2x2 patches of the
    // autoencoder's).
    let factor = vae.config.diffusion_downscale();
    let vae_width = first_width(&vae);
    let channels = vae.config.diffusion_channels();
    // References are floored to the autoencoder's factor with its patches, as the pipeline's
    // `vae_scale_factor * 2`.
    let mut sets_refs = vec![&mut ds];
    if let Some(v) = val.as_mut() {
        sets_refs.push(v);
    }
    for set in sets_refs {
        set.options.references.multiple = factor;
        if set.has_references() && !family.references {
            return Err(cfg_err(format!(
                "data.manifest: its lines list reference images (edit training), and {} \
                 takes none: only \"flux2\" (FLUX.2 [klein]) is conditioned on reference \
                 images",
                family.name
            )));
        }
    }
    let sample_references = sample_references(config, family, factor)?;
    if let Some(Size::Exactly(c)) = inputs[0].dims.first() {
        if *c != channels {
            return Err(cfg_err(format!(
                "encoders.vae ({}): {channels} latent channels, the {} model takes {c}",
                vae_at.path.display(),
                family.name
            )));
        }
    }
    let mut shapes: Vec<data::Bucket> = ds.buckets.clone();
    if let Some(v) = &val {
        shapes.extend(v.buckets.iter().copied());
    }
    check_sizes(
        config,
        family,
        &inputs[0],
        (factor, channels),
        &shapes,
        model_shapes,
    )?;
    // The largest picture the autoencoder encodes: a bucket, or a reference (edit training).
    let reference_pixels = [Some(&ds), val.as_ref()]
        .into_iter()
        .flatten()
        .flat_map(|set| (0..set.items.len()).flat_map(move |i| set.reference_sizes(i)))
        .chain(
            sample_references
                .iter()
                .flatten()
                .map(|(_, g)| (g.bucket.width, g.bucket.height)),
        )
        .map(|(w, h)| w * h);
    let largest = shapes
        .iter()
        .map(|b| b.width * b.height)
        .chain(reference_pixels)
        .max()
        .unwrap_or(0);
    let tile = encode_tile(config, &device, &vae, dtype, largest, &mut *on)?;
    if tile > 0 {
        vae.tiling = Some(VaeTiling::new(tile));
    }
    let vae_id = format!(
        "{} under {:?}, {dtype:?}, tile {tile}",
        file_identity(&vae_at.path),
        vae_at.prefix,
    );
    let mut sets = vec![(ds, "latents")];
    if let Some(v) = val {
        sets.push((v, "validation latents"));
    }
    let mut caches = vec![];
    for (ds, what) in sets.iter_mut() {
        let mut lc = LatentCache::open(&cache, &vae_id)?;
        if let Some(src) = mask_source(config) {
            lc = lc.with_masks(src, factor);
        }
        if encode {
            let mut enc = |x: &Tensor| -> Result<data::cache::Encoded> {
                interrupted(stop, what)?;
                let z = vae.encode_latents(&x.unsqueeze(0)?.to_dtype(dtype)?)?;
                Ok(vec![(
                    LATENTS.to_string(),
                    z.squeeze(0)?.to_dtype(DType::F32)?,
                )])
            };
            let report = fill_shared(group, what, &mut *on, &mut |progress, rank, world| {
                lc.fill_part(ds, &device, &mut enc, progress, rank, world)
            })
            .map_err(|e| match e {
                Error::OutOfMemory { .. } => Error::Context {
                    what: format!(
                        "caching {what} (encoders.vae_tile = 512 encodes in tiles, or raise \
                         memory.budget_gb; the text encoders and the autoencoder run before \
                         the model loads, under the budget's cap)"
                    ),
                    error: Box::new(e),
                },
                e => e,
            })?;
            for bad in &report.skipped {
                on(format!("skipped {bad}"));
            }
        } else {
            // A dry run decodes the pixels a fill would, to find the files it would fail on.
            let bad = ds.check_pixels();
            match (ds.options.on_bad_file, bad.first()) {
                (_, None) => {}
                (data::OnBadFile::Stop, Some(b)) => return Err(b.to_error()),
                (data::OnBadFile::Skip, Some(_)) => {
                    for b in &bad {
                        on(format!("would skip {b}"));
                    }
                    let items: Vec<(usize, String)> = bad
                        .iter()
                        .filter_map(|b| {
                            let i = ds.items.iter().position(|it| it.path == b.path)?;
                            Some((i, b.reason.clone()))
                        })
                        .collect();
                    ds.remove_items(items)?;
                }
            }
        }
        caches.push(lc);
    }
    // The sample prompts' reference images, into the same cache.
    let mut pictures = LatentCache::open(&cache, &vae_id)?;
    if encode && sample_references.iter().any(|r| !r.is_empty()) {
        let all: Vec<(PathBuf, data::Geometry)> =
            sample_references.iter().flatten().cloned().collect();
        let mut enc = |x: &Tensor| -> Result<data::cache::Encoded> {
            interrupted(stop, "the sample prompts' reference images")?;
            let z = vae.encode_latents(&x.unsqueeze(0)?.to_dtype(dtype)?)?;
            Ok(vec![(
                LATENTS.to_string(),
                z.squeeze(0)?.to_dtype(DType::F32)?,
            )])
        };
        let report = pictures
            .fill_pictures(&all, &device, &mut enc)
            .map_err(|e| Error::Context {
                what: "sample.prompts: encoding their reference images".into(),
                error: Box::new(e),
            })?;
        on(format!(
            "caching the sample prompts' reference images: {} ({} reused, {} encoded)",
            report.total, report.reused, report.computed
        ));
    }
    drop(vae);

    // Text: every caption the run's epochs will draw, the held-out captions, the empty
    // caption and the sample prompts.
    let train_ds = &sets[0].0;
    let mut captions: Vec<String> = vec![String::new()];
    captions.extend(run_captions(config, train_ds, world)?);
    if let Some((v, _)) = sets.get(1) {
        captions.extend(v.items.iter().map(|it| it.caption.clone()));
    }
    captions.extend(config.sample.prompts.iter().map(|p| p.text().to_string()));
    captions.push(config.sample.negative_prompt.clone());
    let text_opts = text_options(
        config,
        family,
        &text_at,
        guided,
        driver_budget(config, &device)?,
    );
    let text_id = TextConditioner::identity_of(family, &text_at, &text_opts, dtype);
    if text_opts.stream_t5 && encode {
        on("T5 streams its blocks from host memory while the captions are encoded".into());
    }
    if text_opts.stream_qwen3 && encode {
        on("Qwen3 streams its layers from host memory while the captions are encoded".into());
    }
    let qwen3 = family
        .pipeline
        .text
        .iter()
        .any(|s| matches!(s.kind, TextEncoderKind::Qwen3(_)));
    if qwen3 && text_opts.fp8_qwen3 && encode {
        on("Qwen3's Linear weights are held in FP8 (encoders.fp8_qwen3)".into());
    }
    let text = TextCache::open(&cache, &text_id)?;
    let empty = text.entry_path("");
    // Out of memory under the budget's cap while the text encoders load or encode: the
    // phase and the knobs that fit it.
    let text_oom = |e: Error| match e {
        Error::OutOfMemory { .. } => Error::Context {
            what: "caching the captions' text encodings (encoders.stream_t5 and \
                   encoders.stream_qwen3 stream the large encoders from host memory; or raise \
                   memory.budget_gb)"
                .into(),
            error: Box::new(e),
        },
        e => e,
    };
    let text_shapes: Vec<(String, Vec<usize>)> = if encode || !empty.is_file() {
        for line in tokenizer_lines(family, &text_at) {
            on(line);
        }
        let cond = TextConditioner::load(family, &text_at, &text_opts, dtype, &device, "encoders")
            .map_err(text_oom)?;
        let batch = caption_batch(&cond, dtype, &device)?;
        // A group's pass; where a batch finds no room after all (the pool in pieces), its
        // captions one a pass.
        let split = |named: Named, n: usize| -> Result<Vec<data::cache::Encoded>> {
            (0..n)
                .map(|i| {
                    named
                        .iter()
                        .map(|(k, t)| Ok((k.clone(), t.narrow(0, i, 1)?.squeeze(0)?)))
                        .collect()
                })
                .collect()
        };
        let mut enc = |cs: &[&str]| -> Result<Vec<data::cache::Encoded>> {
            interrupted(stop, "captions")?;
            match cond.encode(cs) {
                Ok(named) => split(named, cs.len()),
                Err(Error::OutOfMemory { .. }) if cs.len() > 1 => {
                    let each = cs
                        .iter()
                        .map(|c| split(cond.encode(&[c])?, 1))
                        .collect::<Result<Vec<_>>>()?;
                    Ok(each.into_iter().flatten().collect())
                }
                Err(e) => Err(e),
            }
        };
        if encode {
            if batch > 1 {
                on(format!("captions encoded {batch} at a time"));
            }
            fill_shared(group, "captions", &mut *on, &mut |progress, rank, world| {
                text.fill_batched(&captions, batch, &mut enc, progress, rank, world)
            })
            .map_err(text_oom)?;
            for (name, r) in cond.stream_reports()? {
                on(format!(
                    "{name} streamed while encoding: {}",
                    r.host_summary()
                ));
            }
            read_shapes(&empty)?
        } else {
            enc(&[""])
                .map_err(text_oom)?
                .into_iter()
                .flatten()
                .map(|(n, t)| (n, t.dims().to_vec()))
                .collect()
        }
    } else {
        read_shapes(&empty)?
    };

    let mut samples = vec![];
    for ((ds, _), latents) in sets.into_iter().zip(caches) {
        let sampler = ds.sampler((t.batch_size * world).min(ds.len()), false)?;
        // The group of the most pixels, its references' counted (edit training).
        let ((bw, bh), refs) = sampler
            .bucket_sizes()
            .iter()
            .zip(sampler.reference_sizes())
            .map(|((b, _), r)| ((b.width, b.height), r.clone()))
            .max_by_key(|((w, h), r)| w * h + r.iter().map(|(rw, rh)| rw * rh).sum::<usize>())
            .unwrap_or(((factor, factor), vec![]));
        let mut largest = vec![];
        for name in &names {
            largest.push(match *name {
                LATENTS => vec![channels, bh / factor, bw / factor],
                TIME_IDS => vec![6],
                other => text_shapes
                    .iter()
                    .find(|(n, _)| n == other)
                    .map(|(_, s)| s.clone())
                    .ok_or_else(|| {
                        cfg_err(format!(
                            "the {} model takes \"{other}\", which its text encoders do not \
                             give ({:?})",
                            family.name,
                            text_shapes.iter().map(|(n, _)| n).collect::<Vec<_>>()
                        ))
                    })?,
            });
        }
        largest.extend(
            refs.iter()
                .map(|&(rw, rh)| vec![channels, rh / factor, rw / factor]),
        );
        samples.push(ImageSamples {
            ds,
            sampler,
            latents,
            text: text.clone(),
            names: names.clone(),
            largest,
            prior_loss_weight: config.data.prior_loss_weight,
            live: None,
        });
    }
    let mut it = samples.into_iter();
    let train = it
        .next()
        .ok_or_else(|| cfg_err("no training images".into()))?;
    Ok(ImageRun {
        train,
        validation: it.next(),
        vae_factor: factor,
        vae_width,
        vae: vae_at,
        text,
        sample_references,
        pictures,
    })
}

/// The `[sample]` prompts' reference images (edit sampling), each with its way into the model
/// ([`data::reference::geometry`] at `data.reference_resolution`, floored to multiples of
/// `factor`), per prompt. Errors name `sample.prompts` and the file.
pub fn sample_references(
    config: &TrainConfig,
    family: &Family,
    factor: usize,
) -> Result<Vec<Vec<(PathBuf, data::Geometry)>>> {
    let opts = data::ReferenceOptions {
        max_pixels: config
            .data
            .reference_resolution
            .saturating_mul(config.data.reference_resolution),
        multiple: factor,
    };
    config
        .sample
        .prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            if !p.references().is_empty() && !family.references {
                return Err(cfg_err(format!(
                    "sample.prompts[{i}]: reference images for {}, which takes none (FLUX.2 \
                     [klein] does)",
                    family.name
                )));
            }
            p.references()
                .iter()
                .map(|r| {
                    let bad = |why: String| {
                        cfg_err(format!(
                            "sample.prompts[{i}]: reference {}: {why}",
                            r.display()
                        ))
                    };
                    let (w, h) = data::source::image_size(r).map_err(bad)?;
                    let g = data::reference::geometry(w, h, &opts).map_err(bad)?;
                    Ok((r.clone(), g))
                })
                .collect()
        })
        .collect()
}

/// Where the loss masks come from (`data.masked_loss`, `data.alpha_mask`), if anywhere.
pub fn mask_source(config: &TrainConfig) -> Option<data::MaskSource> {
    match (config.data.alpha_mask, config.data.masked_loss) {
        (true, _) => Some(data::MaskSource::Alpha),
        (false, true) => Some(data::MaskSource::File),
        (false, false) => None,
    }
}

/// The names and shapes of the tensors in the cache entry at `path`.
fn read_shapes(path: &Path) -> Result<Vec<(String, Vec<usize>)>> {
    let f = crate::safetensors::SafeTensorsFile::open(path)?;
    let names: Vec<String> = f.names().map(str::to_string).collect();
    names
        .into_iter()
        .map(|n| {
            let shape = f
                .info(&n)
                .map(|i| i.shape.clone())
                .ok_or_else(|| cfg_err(format!("{}: no tensor {n}", path.display())))?;
            Ok((n, shape))
        })
        .collect()
}

impl ImageSamples {
    /// Encodes the inputs of `live`'s trained text encoders from the captions at every
    /// batch (the rest still from the cache).
    pub fn set_live(&mut self, live: Option<Arc<TextTraining>>) {
        self.live = live;
    }

    /// The inputs of the samples `idx` in `epoch`, in the model's order; `raw_captions`
    /// takes each image's caption as written (validation) instead of the epoch's (dropout,
    /// shuffled tags).
    pub fn inputs(
        &self,
        idx: &[usize],
        epoch: u64,
        raw_captions: bool,
        dtype: DType,
        device: &Device,
    ) -> Result<Batch> {
        let latents = self
            .latents
            .load_batch(&self.ds, idx, epoch, device, dtype)?;
        let captions = idx
            .iter()
            .map(|&i| match raw_captions {
                true => self.ds.item(i).map(|it| it.caption.clone()),
                false => self.ds.caption(i, epoch),
            })
            .collect::<Result<Vec<_>>>()?;
        let text = self.text.load_batch(&captions, device, dtype)?;
        let text = match &self.live {
            Some(l) => l.replace(text, &captions, dtype, device)?,
            None => text,
        };
        let mut out = vec![];
        for name in &self.names {
            out.push(match *name {
                TIME_IDS => {
                    let mut v = vec![];
                    for &i in idx {
                        v.extend(self.ds.time_ids(i, epoch)?.iter().map(|&x| x as f32));
                    }
                    Tensor::from_vec(v, (idx.len(), 6), device)?.to_dtype(dtype)?
                }
                other => latents
                    .iter()
                    .chain(&text)
                    .find(|(n, _)| n == other)
                    .map(|(_, t)| t.clone())
                    .ok_or_else(|| cfg_err(format!("the caches hold no \"{other}\"")))?,
            });
        }
        // Each image with the cache entries its inputs were read from (where a NaN in the
        // inputs would come from: a damaged entry, not the picture).
        let files = idx
            .iter()
            .zip(&captions)
            .map(|(&i, c)| {
                Ok(format!(
                    "{} (latents {}, text {})",
                    self.ds.item(i)?.path.display(),
                    self.latents.entry_path(&self.ds, i, epoch)?.display(),
                    self.text.entry_path(c).display()
                ))
            })
            .collect::<Result<Vec<_>>>()?;
        let loss_mask = latents
            .iter()
            .find(|(n, _)| n == data::LOSS_MASK)
            .map(|(_, m)| m.clone());
        let references = self
            .latents
            .load_references(&self.ds, idx, epoch, device, dtype)?
            .into_iter()
            .map(|named| {
                named
                    .into_iter()
                    .find(|(n, _)| n == LATENTS)
                    .map(|(_, t)| t)
                    .ok_or_else(|| cfg_err("a reference's cache entry holds no latents".into()))
            })
            .collect::<Result<Vec<_>>>()?;
        let loss_weight = match self.ds.has_reg() {
            true => {
                let w = idx
                    .iter()
                    .map(|&i| {
                        Ok(match self.ds.item(i)?.reg {
                            true => self.prior_loss_weight as f32,
                            false => 1.0,
                        })
                    })
                    .collect::<Result<Vec<f32>>>()?;
                Some(Tensor::from_vec(w, idx.len(), device)?)
            }
            false => None,
        };
        Ok(Batch {
            inputs: out,
            files,
            rows: 0..idx.len(),
            global: idx.len(),
            loss_mask,
            loss_weight,
            references,
        })
    }
}

impl Samples for ImageSamples {
    fn len(&self) -> usize {
        self.ds.len()
    }
    fn largest(&self) -> Vec<Vec<usize>> {
        self.largest.clone()
    }
    fn batch(
        &self,
        micro: usize,
        _batch: usize,
        _seed: u64,
        part: Part,
        dtype: DType,
        device: &Device,
    ) -> Result<Batch> {
        // The sampler cuts global batches (`prepare`'s `world` times the batch size).
        let (epoch, all) = self.sampler.batch_at(micro);
        let rows = crate::dist::shard(all.len(), part.rank, part.world);
        let idx = &all[rows.clone()];
        if idx.is_empty() {
            return Ok(Batch {
                inputs: vec![],
                files: vec![],
                rows,
                global: all.len(),
                loss_mask: None,
                loss_weight: None,
                references: vec![],
            });
        }
        let mut b = self.inputs(idx, epoch, false, dtype, device)?;
        b.rows = rows;
        b.global = all.len();
        Ok(b)
    }
    fn describe(&self) -> String {
        let buckets: Vec<String> = self
            .sampler
            .bucket_sizes()
            .iter()
            .zip(self.sampler.reference_sizes())
            .map(|((b, n), refs)| match refs.is_empty() {
                true => format!("{b}: {n}"),
                false => {
                    let r: Vec<String> = refs.iter().map(|(w, h)| format!("{w}x{h}")).collect();
                    format!("{b} with references {}: {n}", r.join(" + "))
                }
            })
            .collect();
        format!(
            "{} images ({} samples an epoch) in buckets {}",
            self.ds.items.len(),
            self.ds.len(),
            buckets.join(", ")
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_budget_tiles_a_sample_decode_only_where_a_whole_one_does_not_fit() {
        const GIB: u64 = 1 << 30;
        let auto = AUTO_TILE;
        // Set by hand: as set, budget or not.
        assert_eq!(decode_tile_within(256, true, Some((GIB, GIB)), GIB), 256);
        assert_eq!(decode_tile_within(256, false, Some((GIB, 0)), 1), 256);
        // A given budget: tiles, whatever fits.
        assert_eq!(decode_tile_within(0, true, Some((80 * GIB, 0)), GIB), auto);
        // No budget (the CPU): whole.
        assert_eq!(decode_tile_within(0, false, None, 100 * GIB), 0);
        // The default budget: whole where the decode fits beside what the run keeps.
        assert_eq!(
            decode_tile_within(0, false, Some((10 * GIB, 3 * GIB)), 7 * GIB),
            0
        );
        assert_eq!(
            decode_tile_within(0, false, Some((10 * GIB, 3 * GIB)), 7 * GIB + 1),
            auto
        );
        assert_eq!(decode_tile_within(0, false, Some((GIB, u64::MAX)), 1), auto);
    }
}
