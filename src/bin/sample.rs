//! `sample`: images from a Flux, SD3.5, SDXL, FLUX.2 klein or Z-Image model, optionally with
//! a LoRA merged in (one FLAME trained, or a kohya / diffusers / PEFT / ai-toolkit /
//! musubi-tuner file made elsewhere).
//!
//! ```text
//! sample --model flux1-dev.safetensors --text-encoder clip_l.safetensors \
//!        --text-encoder t5xxl_fp16.safetensors --vae ae.safetensors --lora out/lora.safetensors \
//!        --prompt "a photo of a cat" --steps 28 --guidance 3.5 --out samples
//! ```
//!
//! The family is found from the model's keys (or its diffusers config) as `train` finds it;
//! `--arch` chooses where the path holds models of several families.
//!
//! The tokenizers are the pipeline folder's when the model sits in one, the `--tokenizer`
//! folders when given, else the CLIP, T5 and Qwen3 vocabularies built into FLAME (the log
//! names each encoder's).
//!
//! The text encoders run first (with the LoRA's text-encoder tensors merged into their
//! weights: kohya's `lora_te1_` / `lora_te2_` / `lora_te3_` / `lora_te_model_` names or the
//! PEFT layout's `text_encoder.` / `text_encoder_2.` / `text_encoder_3.`; a tensor of that
//! kind no encoder takes is an error naming it) and are freed, then the model (with the
//! LoRA merged into its weights as they load) denoises every prompt and is freed, then the
//! autoencoder decodes.
//! Image i is `<out>/<i>-<seed + i>.png`, written atomically. `--latents` starts from given
//! noise instead of the seed's. `--reference` (FLUX.2 \[klein\]) conditions every image on
//! reference pictures, sized and encoded as diffusers' Flux2KleinPipeline does its `image`
//! (`flame::data::reference`); the image is then the first reference's size unless
//! `--width` / `--height` say. Exit status: 0 done, 1 failed, 2 usage error.

use argh::FromArgs;
use flame::cli::{failure, parse_args, usage};
use flame::models::pipeline::{
    conditioning, load_vae, qwen3_file_is_fp8, tokenizer_lines, SlotUse, Sources, TextConditioner,
    TextOptions,
};
use flame::models::{self, LoadOptions};
use flame::nn::LoraMerge;
use flame::sample::{generate_referenced, seeded_noise, CfgOptions, Request, StepInfo};
use flame::train::images::{
    decode_bytes, decode_fitting, encode_bytes, first_width, streams_within, tile_now,
};
use flame::train::Prediction;
use flame::{DType, Error};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

/// Images from a Flux, SD3.5, SDXL, FLUX.2 klein or Z-Image model, optionally with a LoRA
/// merged in.
#[derive(FromArgs)]
#[argh(help_triggers("-h", "--help"))]
struct Args {
    /// the model family: flux, sd3, sdxl, flux2 or zimage (default: the one found by the
    /// model's keys; needed where the model path holds several)
    #[argh(option)]
    arch: Option<String>,
    /// the model: a single .safetensors or .gguf file, a diffusers model folder or a
    /// pipeline folder, a Hugging Face cache folder or snapshot, or a ComfyUI `models/`
    /// folder (the diffusion model, text encoders and autoencoder found by their keys)
    /// (required)
    #[argh(option)]
    model: Option<PathBuf>,
    /// a LoRA file to merge (kohya, diffusers / PEFT, ai-toolkit, musubi-tuner, or FLAME's
    /// own)
    #[argh(option)]
    lora: Option<PathBuf>,
    /// the LoRA's strength (default 1)
    #[argh(option, default = "1.0")]
    lora_strength: f64,
    /// a prompt; repeat for several images
    #[argh(option)]
    prompt: Vec<String>,
    /// the negative prompt (classifier-free guidance: SD3.5, SDXL, FLUX.2 klein base,
    /// Z-Image)
    #[argh(option, default = "String::new()")]
    negative: String,
    /// denoising steps (default 28; Z-Image 50)
    #[argh(option)]
    steps: Option<usize>,
    /// guidance: Flux dev's distilled input, or the classifier-free scale s of
    /// neg + s (pos - neg), none at 1 (default 3.5; Z-Image 6, diffusers' 5 + 1; a
    /// step-distilled pipeline, model_index.json's is_distilled, takes none)
    #[argh(option)]
    guidance: Option<f64>,
    /// classifier-free guidance's renormalization (diffusers' ZImagePipeline
    /// cfg_normalization): a guided prediction whose norm is above this times the
    /// conditional prediction's is scaled down to it (default 0: off; diffusers' True is 1)
    #[argh(option, default = "0.0")]
    cfg_normalization: f64,
    /// classifier-free guidance's truncation (diffusers' ZImagePipeline cfg_truncation):
    /// steps whose normalized time (1000 - timestep) / 1000 is above this run unguided
    /// (default 1: every step guided)
    #[argh(option, default = "1.0")]
    cfg_truncation: f64,
    /// width in pixels, a multiple of 16 (default 1024, or with --reference the first
    /// reference's as the pipeline sizes it)
    #[argh(option)]
    width: Option<usize>,
    /// height in pixels, a multiple of 16 (default 1024, or with --reference the first
    /// reference's as the pipeline sizes it)
    #[argh(option)]
    height: Option<usize>,
    /// a reference image every image is conditioned on (FLUX.2 klein's editing; repeat for
    /// several, in order): resized to at most 1024x1024 pixels of area, its sides floored
    /// to multiples of 16 and centre-cropped, as diffusers' Flux2KleinPipeline does
    #[argh(option)]
    reference: Vec<PathBuf>,
    /// the noise seed of the first image; image i uses seed + i (default 0)
    #[argh(option, default = "0")]
    seed: u64,
    /// the output folder (default "samples")
    #[argh(option, default = "PathBuf::from(\"samples\")")]
    out: PathBuf,
    /// the weights' dtype: bf16 (default), f16, f32 or fp8
    #[argh(option, default = "String::from(\"bf16\")")]
    dtype: String,
    /// what the frozen Linears compute in: bf16 (default: the weights' dtype), fp8 (8-bit
    /// products on FP8 tensor cores, the weights held in FP8 E4M3 with per-row scales) or
    /// int8 (the same on integer tensor cores, the weights held as int8 codes), as the
    /// `train` binary's `model.compute`: the Linears whose products pay at the image's size
    /// (large products, or few rows), the others in the model's dtype
    #[argh(option, default = "String::from(\"bf16\")")]
    compute: String,
    /// with --compute int8: rotate the products' inner axis (the outlier treatment, as the
    /// `train` binary's `model.int8_rotation`)
    #[argh(switch)]
    int8_rotation: bool,
    /// auto (default), cuda or cpu
    #[argh(option, default = "String::from(\"auto\")")]
    device: String,
    /// text encoder weights in the family's order (flux: clip_l, t5; sd3: clip_l, clip_g,
    /// t5; sdxl: clip_l, clip_g); repeat. Default: next to the model
    #[argh(option)]
    text_encoder: Vec<PathBuf>,
    /// tokenizer folders in the same order; repeat. Default: next to the model, else the
    /// tokenizers built into FLAME
    #[argh(option)]
    tokenizer: Vec<PathBuf>,
    /// the autoencoder's weights. Default: next to the model
    #[argh(option)]
    vae: Option<PathBuf>,
    /// T5's tokens per prompt (0, the default: the pipeline's)
    #[argh(option, default = "0")]
    t5_tokens: usize,
    /// a diffusers config.json for a single file whose shapes do not pin its config down
    #[argh(option)]
    config: Option<PathBuf>,
    /// DDPM models (SDXL): what the model predicts, epsilon (default) or v
    #[argh(option, default = "String::from(\"epsilon\")")]
    prediction: String,
    /// stream T5's blocks from host memory while encoding (T5-XXL in about 1.5 GiB)
    #[argh(switch)]
    stream_t5: bool,
    /// stream Qwen3's layers from host memory while encoding (Qwen3-4B in about 1.4 GiB)
    #[argh(switch)]
    stream_qwen3: bool,
    /// encode and decode in tiles of this many pixels (0, the default: whole images)
    #[argh(option, default = "0")]
    vae_tile: usize,
    /// start from these latents instead of the seed's noise: a .safetensors file whose
    /// `latents` tensor is (N, C, H/f, W/f), one per prompt (Flux: also diffusers' packed
    /// (N, tokens, 4C); FLUX.2: also its packed (N, tokens, C))
    #[argh(option)]
    latents: Option<PathBuf>,
    /// hold the process to this many GiB of the GPU as the driver counts them: the
    /// planner's plan for forwards (blocks streamed from host memory as needed), T5 and
    /// Qwen3 streamed where the text encoders do not fit it whole, the decode tiled (0, the
    /// default: on a GPU, the memory free at start)
    #[argh(option, default = "0.0")]
    budget: f64,
    /// print the version
    #[argh(switch)]
    version: bool,
}

fn bad(msg: String) -> Error {
    Error::Config { path: None, msg }
}

fn main() -> ExitCode {
    let args: Args = match parse_args() {
        Ok(a) => a,
        Err(code) => return code,
    };
    if args.version {
        println!("sample (flame) {}", env!("CARGO_PKG_VERSION"));
        return ExitCode::SUCCESS;
    }
    let Some(model) = &args.model else {
        return usage("sample", "--model is required");
    };
    if let Err(msg) = check_flags(&args) {
        return usage("sample", &msg);
    }
    match run(&args, model) {
        Ok(paths) => {
            for p in paths {
                println!("{}", p.display());
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            let (code, msg) = failure(&e);
            eprintln!("{msg}");
            code
        }
    }
}

/// The image size when neither `--width` nor `--height` nor a reference says.
const DEFAULT_SIDE: usize = 1024;

impl Args {
    /// (height, width) as given, each side `DEFAULT_SIDE` where not.
    fn size(&self) -> (usize, usize) {
        (
            self.height.unwrap_or(DEFAULT_SIDE),
            self.width.unwrap_or(DEFAULT_SIDE),
        )
    }

    /// `--steps`, or the family's default: diffusers' pipeline default for Z-Image
    /// (`ZImagePipeline.__call__`: `num_inference_steps=50`), else 28.
    fn steps(&self, arch: &str) -> usize {
        let default = match arch {
            "zimage" => 50,
            _ => 28,
        };
        self.steps.unwrap_or(default)
    }

    /// `--guidance`, or the family's default: for Z-Image diffusers' `guidance_scale=5.0`
    /// (`ZImagePipeline.__call__`), which computes pos + 5 (pos - neg): FLAME's scale 6;
    /// else 3.5.
    fn guidance(&self, arch: &str) -> f64 {
        let default = match arch {
            "zimage" => 6.0,
            _ => 3.5,
        };
        self.guidance.unwrap_or(default)
    }
}

/// The flags' values that are wrong whatever the files say (a usage error).
fn check_flags(a: &Args) -> Result<(), String> {
    let max_t5 = flame::models::pipeline::T5_MAX_TOKENS;
    let problems = [
        (a.prompt.is_empty(), "no --prompt given".to_string()),
        (a.steps == Some(0), "--steps 0: at least 1".into()),
        (
            a.guidance.is_some_and(|g| !(g.is_finite() && g >= 0.0)),
            format!("--guidance {}: finite and >= 0", a.guidance.unwrap_or(0.0)),
        ),
        (
            !(a.cfg_normalization.is_finite() && a.cfg_normalization >= 0.0),
            format!(
                "--cfg-normalization {}: finite and >= 0",
                a.cfg_normalization
            ),
        ),
        (
            !(a.cfg_truncation.is_finite() && a.cfg_truncation >= 0.0),
            format!("--cfg-truncation {}: finite and >= 0", a.cfg_truncation),
        ),
        (
            [a.width, a.height]
                .into_iter()
                .flatten()
                .any(|s| s == 0 || s % 16 != 0),
            format!(
                "--width {} --height {}: positive multiples of 16",
                a.size().1,
                a.size().0
            ),
        ),
        (
            !matches!(a.prediction.as_str(), "epsilon" | "v"),
            format!("--prediction {}: epsilon or v", a.prediction),
        ),
        (
            !matches!(a.dtype.as_str(), "bf16" | "f16" | "f32" | "fp8"),
            format!("--dtype {}: bf16, f16, f32 or fp8", a.dtype),
        ),
        (
            !matches!(a.compute.as_str(), "bf16" | "fp8" | "int8"),
            format!("--compute {}: bf16, fp8 or int8", a.compute),
        ),
        (
            !matches!(a.device.as_str(), "auto" | "cuda" | "cpu"),
            format!("--device {}: auto, cuda or cpu", a.device),
        ),
        (
            a.t5_tokens > max_t5,
            format!(
                "--t5-tokens {}: T5 takes at most {max_t5} a prompt",
                a.t5_tokens
            ),
        ),
        (
            !(a.budget.is_finite() && a.budget >= 0.0),
            format!("--budget {}: a number of GiB >= 0", a.budget),
        ),
        (
            !(a.lora_strength.is_finite()),
            format!("--lora-strength {}: a finite number", a.lora_strength),
        ),
        (
            a.vae_tile != 0 && a.vae_tile < 64,
            format!(
                "--vae-tile {}: 0 (whole images) or at least 64 pixels",
                a.vae_tile
            ),
        ),
        (
            a.seed.checked_add(a.prompt.len() as u64).is_none(),
            format!(
                "--seed {}: image i takes seed + i, which passes the largest seed",
                a.seed
            ),
        ),
    ];
    let bad: Vec<String> = problems
        .into_iter()
        .filter(|(b, _)| *b)
        .map(|(_, m)| m)
        .collect();
    match bad.is_empty() {
        true => Ok(()),
        false => Err(bad.join("; ")),
    }
}

/// The image files this run writes, refused where one exists (the user's, or an earlier
/// run's: a run replaces nothing).
fn outputs(a: &Args) -> flame::Result<Vec<PathBuf>> {
    let paths: Vec<PathBuf> = (0..a.prompt.len())
        .map(|i| a.out.join(format!("{i}-{}.png", a.seed + i as u64)))
        .collect();
    if let Some(p) = paths.iter().find(|p| p.exists()) {
        return Err(Error::Io {
            path: p.clone(),
            source: std::io::Error::new(
                std::io::ErrorKind::AlreadyExists,
                "exists: sample writes new files only; choose another --out or --seed",
            ),
        });
    }
    Ok(paths)
}

/// The text encoders' phase, for an out-of-memory error there.
fn text_phase() -> String {
    "encoding the prompts (--stream-t5 and --stream-qwen3 stream the large encoders from host \
     memory, as --budget GB does)"
        .into()
}

/// `error` as the failure of what `name` (a flag) gives at `path`.
fn flag(name: &str, path: &std::path::Path, error: Error) -> Error {
    Error::Context {
        what: format!("{name} {}", path.display()),
        error: Box::new(error),
    }
}

/// The starting latents of `--latents` for `n` prompts at `hw` latent pixels, each
/// (1, C, h, w) in f32 on `device`.
fn read_latents(
    path: &std::path::Path,
    arch: &str,
    n: usize,
    hw: (usize, usize),
    device: &flame::Device,
) -> flame::Result<Vec<flame::Tensor>> {
    let file = flame::safetensors::SafeTensorsFile::open(path)?;
    let t = file.load_as("latents", device, DType::F32)?;
    let t = match (t.rank(), arch) {
        (4, _) => t,
        // diffusers' Flux pipeline takes its latents packed in 2x2 patches.
        (3, "flux") => flame::models::flux::unpack_latents(&t, hw.0 / 2, hw.1 / 2)?,
        // FLUX.2's latents are its patches already; its pipeline packs them one token a
        // position (Flux2KleinPipeline._pack_latents).
        (3, "flux2") if t.dims()[1] == hw.0 * hw.1 => {
            flame::models::flux2::unpack_latents(&t, hw.0, hw.1)?
        }
        _ => {
            return Err(Error::SafeTensors {
                path: path.to_path_buf(),
                tensor: Some("latents".into()),
                msg: format!("shape {:?}: (N, C, h, w) expected", t.dims()),
            })
        }
    };
    let d = t.dims().to_vec();
    if d[0] != n || (d[2], d[3]) != hw {
        return Err(Error::SafeTensors {
            path: path.to_path_buf(),
            tensor: Some("latents".into()),
            msg: format!(
                "shape {d:?}: {n} prompt(s) at {}x{} latent pixels need ({n}, C, {}, {})",
                hw.1, hw.0, hw.0, hw.1
            ),
        });
    }
    (0..n).map(|i| t.narrow(0, i, 1)).collect()
}

/// Every file or folder a flag names exists, and no output file does: checked before
/// anything is loaded, one error naming every flag that is wrong.
fn check_files(a: &Args, model: &std::path::Path) -> flame::Result<()> {
    let mut named: Vec<(&str, &std::path::Path)> = vec![("--model", model)];
    for (f, p) in [
        ("--lora", &a.lora),
        ("--latents", &a.latents),
        ("--config", &a.config),
        ("--vae", &a.vae),
    ] {
        if let Some(p) = p {
            named.push((f, p));
        }
    }
    named.extend(
        a.text_encoder
            .iter()
            .map(|p| ("--text-encoder", p.as_path())),
    );
    named.extend(a.tokenizer.iter().map(|p| ("--tokenizer", p.as_path())));
    named.extend(a.reference.iter().map(|p| ("--reference", p.as_path())));
    let missing: Vec<String> = named
        .iter()
        .filter(|(_, p)| !p.exists())
        .map(|(f, p)| format!("{f} {}: no such file or folder", p.display()))
        .collect();
    if !missing.is_empty() {
        return Err(bad(missing.join("; ")));
    }
    outputs(a).map(|_| ())
}

/// `--reference` for a family whose models take none, refused naming the flag.
fn check_references(a: &Args, family: &models::Family) -> flame::Result<()> {
    if !a.reference.is_empty() && !family.references {
        return Err(bad(format!(
            "--reference: {} takes no reference images (FLUX.2 [klein], flux2, does)",
            family.name
        )));
    }
    Ok(())
}

fn run(a: &Args, model_path: &std::path::Path) -> flame::Result<Vec<PathBuf>> {
    let started = std::time::Instant::now();
    // Where the minutes go, printed at the end.
    let mut phases = flame::memory::PhasePeaks::default();
    check_files(a, model_path)?;
    // Before anything is looked for, where --arch names the family.
    if let Some(f) = a.arch.as_deref().and_then(|n| models::family(n).ok()) {
        check_references(a, f)?;
    }
    // A ComfyUI or other folder of loose files: the diffusion model, text encoders and
    // autoencoder found by their keys; a Hugging Face cache folder: its snapshot. The family
    // is `--arch`'s, else the one found.
    let found = models::discover(
        model_path,
        a.arch.as_deref(),
        !a.text_encoder.is_empty(),
        a.vae.is_some(),
        models::discover::Keys {
            model: "--model",
            arch: "--arch",
            text: "--text-encoder",
            vae: "--vae",
        },
    )?;
    let family = found.family;
    let arch = family.name;
    check_references(a, family)?;
    let max_t5 = flame::models::pipeline::T5_MAX_TOKENS;
    if a.t5_tokens > max_t5 {
        return Err(bad(format!(
            "--t5-tokens {}: T5 takes at most {max_t5} tokens a prompt",
            a.t5_tokens
        )));
    }
    if a.steps(arch) == 0 {
        return Err(bad("--steps 0: at least 1".into()));
    }
    if !(a.guidance(arch).is_finite() && a.guidance(arch) >= 0.0) {
        return Err(bad(format!(
            "--guidance {}: finite and >= 0",
            a.guidance(arch)
        )));
    }
    let (height, width) = a.size();
    if width == 0 || height == 0 || width % 16 != 0 || height % 16 != 0 {
        return Err(bad(format!(
            "--width {width} --height {height}: positive multiples of 16"
        )));
    }
    let prediction = match a.prediction.as_str() {
        "epsilon" => Prediction::Epsilon,
        "v" => Prediction::V,
        other => return Err(bad(format!("--prediction {other}: epsilon or v"))),
    };
    for line in &found.lines {
        eprintln!("{line}");
    }
    let model_path = found.model.as_path();
    let text_encoders = match a.text_encoder.is_empty() {
        true => found.text.clone(),
        false => a.text_encoder.clone(),
    };
    let vae_at = a.vae.clone().or(found.vae.clone());
    let device = flame::Device::by_name(&a.device)?;
    let (dtype, fp8) = match a.dtype.as_str() {
        "bf16" => (DType::BF16, false),
        "f16" => (DType::F16, false),
        "f32" => (DType::F32, false),
        "fp8" => (DType::BF16, true),
        other => return Err(bad(format!("--dtype {other}: bf16, f16, f32 or fp8"))),
    };
    let mut opts = LoadOptions::new(dtype, &device);
    opts.fp8 = fp8;
    let code = match a.compute.as_str() {
        "fp8" => Some(flame::backend::fp8::Code8::E4m3),
        "int8" => Some(flame::backend::fp8::Code8::Int8),
        _ => None,
    };
    if let Some(code) = code {
        if let Some(why) = models::products_refusal(code, model_path, &device) {
            return Err(bad(format!(
                "--compute {} {why}; use --compute bf16",
                code.name()
            )));
        }
        opts.products = Some(code);
        opts.int8_rotation = a.int8_rotation;
    }
    if let Some(p) = &a.config {
        let text = std::fs::read_to_string(p).map_err(|source| Error::Io {
            path: p.clone(),
            source,
        })?;
        opts.config = Some(serde_json::from_str(&text).map_err(|e| Error::Config {
            path: Some(p.clone()),
            msg: format!("invalid JSON: {e}"),
        })?);
    }
    // The model's inputs and guidance input, from a build without weights.
    let probe = family.probe(model_path, &opts)?.model;
    let (inputs, guided) = (probe.inputs(), probe.guidance_input());
    drop(probe);
    let (text_at, vae_at) = Sources {
        text: text_encoders,
        tokenizers: a.tokenizer.clone(),
        vae: vae_at,
    }
    .locate(
        family,
        model_path,
        ["--text-encoder", "--tokenizer", "--vae"],
    )?;

    // Text first, then the encoders are freed.
    let enc_dtype = if dtype == DType::F32 || !device.is_cuda() {
        DType::F32
    } else {
        DType::BF16
    };
    if !(a.budget.is_finite() && a.budget >= 0.0) {
        return Err(bad(format!("--budget {}: a number of GiB >= 0", a.budget)));
    }
    // The budget split and FLAME's allocator capped before the text encoders run: every
    // phase (encoders, references, the model, the decode) is held to it.
    let (_, outside) = flame::memory::hold_to_budget(&device, a.budget)?;
    // Without --budget, on a GPU: what the process could hold at start, which the text
    // encoders' streaming, the model's plan and the decode's tile weigh (the card's other
    // tenants keep what they hold).
    let budgeted = a.budget > 0.0;
    let at_start = match budgeted {
        true => Some((a.budget * (1u64 << 30) as f64) as u64),
        false => flame::memory::memory_at_start(&device)?,
    };
    phases.watch(&device);
    // (FLUX.2's conditioning does not read the size: with references it may change below.)
    let size = (height, width);
    phases.start(&device, "text encoders");
    let (conds, uncond) = {
        let opts = TextOptions {
            guided,
            t5_tokens: a.t5_tokens,
            // T5 and Qwen3 stream their blocks (the same embeddings in less memory) where
            // the text encoders do not fit the budget whole, or without one the memory free
            // at start (as `train`'s "auto").
            stream_t5: a.stream_t5 || streams_within(family, &text_at, false, at_start),
            stream_qwen3: a.stream_qwen3 || streams_within(family, &text_at, true, at_start),
            // FP8 weights (`--dtype fp8`) take Qwen3's Linears to FP8 too, and an FP8 file's
            // codes stay as they are.
            fp8_qwen3: fp8 || qwen3_file_is_fp8(family, &text_at),
        };
        for line in tokenizer_lines(family, &text_at) {
            eprintln!("{line}");
        }
        // The LoRA's text-encoder tensors, merged into each encoder under its names.
        let merges = match &a.lora {
            Some(l) => family
                .pipeline
                .text
                .iter()
                .map(|slot| {
                    LoraMerge::for_text_encoder(l, a.lora_strength, slot.kohya, slot.folder)
                        .map(Arc::new)
                        .map_err(|e| flag("--lora", l, e))
                })
                .collect::<flame::Result<Vec<_>>>()?,
            None => vec![],
        };
        // An encoder the file has no tensor for loads as it would without it (a merge
        // keeps its weights dense: FP8 codes are decoded).
        let uses: Vec<SlotUse> = family
            .pipeline
            .text
            .iter()
            .zip(&merges)
            .map(|(slot, m)| {
                let (kohya, peft) = (format!("{}_", slot.kohya), format!("{}.", slot.folder));
                match m
                    .text_encoder_tensors()
                    .iter()
                    .any(|n| n.starts_with(&kohya) || n.starts_with(&peft))
                {
                    true => SlotUse::Merged(m.clone()),
                    false => SlotUse::Frozen,
                }
            })
            .collect();
        let cond = TextConditioner::load_slots(
            family,
            &text_at,
            &opts,
            enc_dtype,
            &device,
            "--text-encoder",
            &uses,
        )
        .map_err(|e| e.in_phase(text_phase))?;
        if let (Some(l), Some(first)) = (&a.lora, merges.first()) {
            let mut used = std::collections::BTreeSet::new();
            for m in &merges {
                used.extend(m.used()?);
            }
            let names = first.text_encoder_tensors();
            if let Some(k) = names.iter().find(|k| !used.contains(*k)) {
                return Err(flag(
                    "--lora",
                    l,
                    Error::SafeTensors {
                        path: l.clone(),
                        tensor: Some(k.clone()),
                        msg: format!(
                            "a text-encoder tensor no encoder of {} takes (its encoders' names: \
                             {})",
                            family.name,
                            family
                                .pipeline
                                .text
                                .iter()
                                .map(|s| format!("{}: {}_*, {}.*", s.name, s.kohya, s.folder))
                                .collect::<Vec<_>>()
                                .join("; ")
                        ),
                    },
                ));
            }
            if !names.is_empty() {
                eprintln!(
                    "{}: {} text-encoder tensors merged into the text encoders",
                    l.display(),
                    names.len()
                );
            }
        }
        let encode = |p: &str| -> flame::Result<Vec<flame::Tensor>> {
            cond.encode(&[p])
                .and_then(|c| conditioning(&inputs, &c, size, dtype, &device))
                .map_err(|e| e.in_phase(text_phase))
        };
        let conds = a
            .prompt
            .iter()
            .map(|p| encode(p))
            .collect::<flame::Result<Vec<_>>>()?;
        let negative = encode(&a.negative)?;
        for (name, r) in cond.stream_reports().unwrap_or_default() {
            eprintln!("{name} streamed while encoding: {}", r.host_summary());
        }
        (conds, negative)
    };
    phases.end(&device, "text encoders");

    // The model, with the LoRA merged as its weights load.
    if let Some(l) = &a.lora {
        let m = LoraMerge::open(l, a.lora_strength, family.subfolder)
            .map_err(|e| flag("--lora", l, e))?;
        opts.merge = Some(Arc::new(m));
    }
    phases.start(&device, "autoencoder and references");
    // The autoencoder's tile is chosen for each reference's encode, and for the decode once
    // the model is freed.
    let mut vae = load_vae(family, &vae_at, dtype, &device, "--vae")?;
    let vae_width = first_width(&vae);
    let f = vae.config.diffusion_downscale();
    // The references, sized as the pipeline sizes them and encoded before the model loads;
    // the image takes the first one's size where --width / --height do not say
    // (Flux2KleinPipeline.__call__: `height = height or image_height`).
    let ref_opts = flame::data::ReferenceOptions {
        max_pixels: flame::data::reference::PIPELINE_MAX_PIXELS,
        multiple: f,
    };
    let refs = {
        let _g = flame::no_grad();
        let mut refs = Vec::with_capacity(a.reference.len());
        for p in &a.reference {
            let x = flame::data::reference::load(p, &ref_opts, false, &device)
                .map_err(|e| flag("--reference", p, e))?;
            let pixels = x.dims()[1..].iter().product::<usize>();
            let whole = encode_bytes(pixels, vae_width, dtype);
            let tile = tile_now(a.vae_tile, budgeted, &device, whole)?;
            vae.tiling = (tile > 0).then(|| flame::encoders::VaeTiling::new(tile));
            refs.push(
                vae.encode_latents(&x.unsqueeze(0)?.to_dtype(dtype)?)?
                    .to_dtype(dtype)?,
            );
        }
        refs
    };
    phases.end(&device, "autoencoder and references");
    let (height, width) = match refs.first() {
        Some(r) => (
            a.height.unwrap_or(r.dims()[2] * f),
            a.width.unwrap_or(r.dims()[3] * f),
        ),
        None => (height, width),
    };
    if width % f != 0 || height % f != 0 {
        return Err(bad(format!(
            "--width {width} --height {height}: multiples of the autoencoder's factor {f}"
        )));
    }
    let mut batched = true;
    // One sample's inputs: the latents, then the conditioning as encoded (the references'
    // tokens join the image's in every block). The plan sizes them; with 8-bit products, the
    // Linears whose products pay at their rows take them (`nn::products_pay`, as `train`
    // decides at its largest bucket), the others compute in the model's dtype.
    let shapes = if budgeted || device.is_cuda() || opts.products.is_some() {
        let channels = match inputs.first().and_then(|i| i.dims.first()) {
            Some(models::Size::Exactly(c)) => *c,
            _ => {
                return Err(bad(format!(
                    "{arch}: the latents' channel count is not fixed"
                )))
            }
        };
        let mut shapes = vec![vec![channels, height / f, width / f]];
        shapes.extend(conds[0].iter().map(|t| t.dims()[1..].to_vec()));
        shapes.extend(refs.iter().map(|r| r.dims()[1..].to_vec()));
        shapes
    } else {
        vec![]
    };
    if opts.products.is_some() {
        opts.run = Some(models::RunShape {
            sample: shapes.clone(),
            batch: 1,
            optimizer_bytes_per_value: 0.0,
        });
    }
    // Under --budget, and without one on a GPU where every block resident would not fit the
    // memory free at start.
    if budgeted || device.is_cuda() {
        phases.start(&device, "planning");
        let choice = flame::train::planning::plan_denoising(
            family,
            model_path,
            &opts,
            &device,
            a.budget,
            &shapes,
            "--budget",
            &flame::memory::Switches::default().with_env()?,
        )?;
        eprintln!("{}", choice.describe());
        // Guidance's two predictions at once where the plan holds a batch of two.
        batched =
            flame::train::planning::batch_fits(family, model_path, &opts, &choice, &shapes, 2)?;
        opts.memory = choice.plan;
        phases.end(&device, "planning");
    }
    phases.start(&device, "loading the model");
    let model = family
        .load(model_path, &opts)
        .map_err(|e| {
            e.in_phase(|| {
                "loading the model (--budget GB plans it within GB, streaming blocks from host \
                 memory; --dtype fp8 halves its weights)"
                    .into()
            })
        })?
        .model;
    phases.end(&device, "loading the model");
    // A step-distilled pipeline (FLUX.2 [klein]) takes no classifier-free guidance, as
    // diffusers ignores its scale there.
    let guidance = if !guided && a.guidance(arch) > 1.0 && models::step_distilled(model_path)? {
        eprintln!(
            "note: {} is step-distilled (model_index.json): no classifier-free guidance, \
             --guidance {} ignored",
            model_path.display(),
            a.guidance(arch)
        );
        1.0
    } else {
        a.guidance(arch)
    };
    let req = Request {
        steps: a.steps(arch),
        guidance,
        latent_hw: (height / f, width / f),
        seed: a.seed,
        prediction,
        batched_guidance: batched,
        cfg_options: CfgOptions {
            normalization: a.cfg_normalization,
            truncation: a.cfg_truncation,
        },
    };
    let paths = outputs(a)?;
    let noise = match &a.latents {
        Some(p) => read_latents(p, arch, conds.len(), req.latent_hw, &device)
            .map_err(|e| flag("--latents", p, e))?,
        None => seeded_noise(model.as_ref(), conds.len(), &req, &device)?,
    };
    // A line a step on stderr (stdout is for the written paths): denoising a large image
    // takes minutes.
    let count = conds.len();
    let start = std::time::Instant::now();
    let mut progress = |i: usize, s: &StepInfo<'_>| -> flame::Result<()> {
        eprintln!(
            "image {}/{count}: step {}/{} ({:.1} s)",
            i + 1,
            s.index + 1,
            s.steps,
            start.elapsed().as_secs_f64()
        );
        Ok(())
    };
    let refs = match refs.is_empty() {
        true => vec![],
        false => vec![refs; count],
    };
    phases.start(&device, "denoising");
    let latents = generate_referenced(
        model.as_ref(),
        &conds,
        &refs,
        Some(uncond),
        &req,
        &noise,
        &mut progress,
    )
    .map_err(|e| {
        e.in_phase(|| {
            "denoising (a smaller --width and --height, or --budget GB to plan the model within \
             GB)"
            .into()
        })
    })?;
    phases.end(&device, "denoising");
    if let Some(Ok(r)) = model.exec().streamer.as_ref().map(|s| s.report()) {
        eprintln!("streamed blocks: {}", r.host_summary());
    }
    // The model's memory given back (its pinned host copies too) before the decode.
    phases.start(&device, "freeing the model");
    drop(model);
    phases.end(&device, "freeing the model");
    for (i, z) in latents.iter().enumerate() {
        if z.to_dtype(DType::F32)?
            .to_vec_f64()?
            .iter()
            .any(|v| !v.is_finite())
        {
            return Err(Error::NonFinite {
                step: a.steps(arch),
                what: format!("the denoised latents of prompt {i} hold a NaN or an infinity"),
                files: [a.lora.as_ref(), a.latents.as_ref()]
                    .into_iter()
                    .flatten()
                    .map(|p| p.display().to_string())
                    .collect(),
                why: "no image written: check the LoRA (and --lora-strength) or the starting \
                      latents"
                    .into(),
            });
        }
    }

    std::fs::create_dir_all(&a.out).map_err(|source| Error::Io {
        path: a.out.clone(),
        source,
    })?;
    let _g = flame::no_grad();
    let mut written = vec![];
    // The decode's tile, now that the model is freed: whole images where they fit the memory
    // free at start beside the autoencoder and the latents (without --budget).
    let whole = decode_bytes(height * width, vae_width, dtype);
    let tile = tile_now(a.vae_tile, budgeted, &device, whole)?;
    vae.tiling = (tile > 0).then(|| flame::encoders::VaeTiling::new(tile));
    phases.start(&device, "decoding and writing");
    for (z, path) in latents.iter().zip(paths) {
        let img = decode_fitting(&mut vae, &z.to_dtype(dtype)?, &mut |n| {
            eprintln!("note: {n}")
        })
        .map_err(|e| {
            e.in_phase(|| "decoding (--vae-tile 128 decodes in the smallest tiles)".into())
        })?;
        flame::data::save_png(&img.squeeze(0)?, &path)?;
        written.push(path);
    }
    phases.end(&device, "decoding and writing");
    eprintln!(
        "{}",
        flame::progress::time_line(
            &phases.seconds(),
            started.elapsed().as_secs_f64(),
            "start-up and the rest",
        )
    );
    for line in phases.memory_lines(&device, outside) {
        eprintln!("{line}");
    }
    if let Some((n, secs)) = device.kernel_loads() {
        eprintln!("kernels: {n} modules loaded in {secs:.1} s");
    }
    Ok(written)
}
