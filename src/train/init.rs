//! `train init`: a commented config a user can run as it is, from a model path and a folder
//! of images. The model's family and files are found as a run finds them
//! ([`crate::models::discover()`]), the tokenizers as a run locates them, the resolution and
//! buckets from the images' sizes by the trainer's own bucketing ([`crate::data::buckets`]),
//! the budget from the GPU's free memory (or the one given), and the memory plan by the
//! planner `train --plan` runs ([`crate::train::plan_run`]). Every key written is a config
//! key (the text is read back with [`TrainConfig::from_toml`] before it is written), and a
//! comment beside each choice says what it is and where it came from.

use super::config::TrainConfig;
use super::{plan_run, Event, Placement};
use crate::data::{self, Bucket, BucketConfig, Item, OnBadFile, Source};
use crate::device::DeviceChoice;
use crate::models::discover::Keys;
use crate::models::pipeline::{tokenizer_lines, Sources, TokenizerSource};
use crate::models::{self, Family};
use crate::{Device, Error, Result};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// What `train init` is asked.
#[derive(Clone, Debug)]
pub struct InitOptions {
    /// The model: any path `model.path` takes (a single file, a GGUF Flux, a diffusers
    /// folder, a Hugging Face cache folder or snapshot, a ComfyUI `models/` folder).
    pub model: PathBuf,
    /// The family, where the model path holds several (`--arch`); `None`: the one found.
    pub arch: Option<String>,
    /// The folder of images with captions.
    pub images: PathBuf,
    /// GiB of GPU memory for the run (`memory.budget_gb`); `None`: the GPU's free memory.
    pub budget_gb: Option<f64>,
    /// Optimizer steps (`train.steps`); `None`: [`DEFAULT_STEPS`].
    pub steps: Option<usize>,
    /// The config file to write.
    pub out: PathBuf,
    /// Replace an existing file at `out`.
    pub force: bool,
}

/// The steps a config gets when none are asked: a usual length for a LoRA of one subject
/// or style (the examples' templates train 2000).
pub const DEFAULT_STEPS: usize = 2000;

/// The sample prompts taken from the captions.
const PROMPTS: usize = 3;

/// The flags errors name.
const KEYS: Keys = Keys {
    model: "--model",
    arch: "--arch",
    text: "encoders.text",
    vae: "encoders.vae",
};

/// A family's starting recipe: the values of its template in examples/ (flux.toml,
/// sd35.toml, sdxl.toml, klein.toml, zimage.toml; tests/train_init.rs checks that they
/// agree).
#[derive(Clone, Copy, Debug)]
pub struct Recipe {
    /// The family (`model.arch`).
    pub arch: &'static str,
    /// Its template's file name in examples/.
    pub template: &'static str,
    /// `adapter.targets`: the attention and MLP Linears of every block.
    pub targets: &'static [&'static str],
    /// `train.timesteps` for flow-matching families; `None` for DDPM (SDXL).
    pub timesteps: Option<&'static str>,
    /// `train.min_snr_gamma` (DDPM only; 0: off).
    pub min_snr_gamma: f64,
    /// `sample.steps`.
    pub sample_steps: usize,
    /// `sample.guidance`.
    pub sample_guidance: f64,
    /// The resolution the family was trained at (data.resolution's ceiling).
    pub resolution: usize,
}

/// Every family's [`Recipe`], in `models::FAMILIES` order.
pub const RECIPES: [Recipe; 5] = [
    Recipe {
        arch: "flux",
        template: "flux.toml",
        targets: &[
            "double_blocks.*_attn.qkv",
            "double_blocks.*_attn.proj",
            "double_blocks.*_mlp.*",
            "single_blocks.*.linear*",
        ],
        timesteps: Some("flux_shift"),
        min_snr_gamma: 0.0,
        sample_steps: 28,
        sample_guidance: 3.5,
        resolution: 1024,
    },
    Recipe {
        arch: "sd3",
        template: "sd35.toml",
        targets: &[
            "joint_blocks.*.attn.qkv",
            "joint_blocks.*.attn.proj",
            "joint_blocks.*.mlp.*",
        ],
        timesteps: Some("logit_normal"),
        min_snr_gamma: 0.0,
        sample_steps: 28,
        sample_guidance: 4.5,
        resolution: 1024,
    },
    Recipe {
        arch: "sdxl",
        template: "sdxl.toml",
        targets: &[
            "*transformer_blocks.*.attn1.to_*",
            "*transformer_blocks.*.attn2.to_*",
            "*transformer_blocks.*.ff.net.*",
        ],
        timesteps: None,
        min_snr_gamma: 5.0,
        sample_steps: 30,
        sample_guidance: 5.0,
        resolution: 1024,
    },
    Recipe {
        arch: "flux2",
        template: "klein.toml",
        targets: &[
            "double_blocks.*_attn.qkv",
            "double_blocks.*_attn.proj",
            "double_blocks.*_mlp.*",
            "single_blocks.*.linear*",
        ],
        timesteps: Some("flux_shift"),
        min_snr_gamma: 0.0,
        sample_steps: 50,
        sample_guidance: 4.0,
        resolution: 1024,
    },
    Recipe {
        arch: "zimage",
        template: "zimage.toml",
        targets: &[
            "layers.*.attention.qkv",
            "layers.*.attention.out",
            "layers.*.feed_forward.w*",
        ],
        timesteps: Some("shift"),
        min_snr_gamma: 0.0,
        sample_steps: 50,
        sample_guidance: 6.0,
        resolution: 1024,
    },
];

/// The recipe of `family`.
pub fn recipe(family: &Family) -> Result<&'static Recipe> {
    RECIPES
        .iter()
        .find(|r| r.arch == family.name)
        .ok_or_else(|| Error::Config {
            path: None,
            msg: format!("train init has no starting recipe for {}", family.name),
        })
}

/// What `train init` wrote.
#[derive(Clone, Debug)]
pub struct Written {
    /// The config file.
    pub path: PathBuf,
    /// Its text.
    pub text: String,
    /// What was found and chosen, one line each, for the log.
    pub lines: Vec<String>,
}

/// A TOML basic string of `s`.
fn q(s: &str) -> String {
    toml::Value::String(s.to_string()).to_string()
}

/// A path as a TOML string, absolute; an error naming `what` where it is not UTF-8.
fn qpath(p: &Path, what: &str) -> Result<String> {
    let abs = std::path::absolute(p).map_err(|source| Error::Io {
        path: p.to_path_buf(),
        source,
    })?;
    abs.to_str().map(q).ok_or_else(|| Error::Config {
        path: None,
        msg: format!(
            "{what} {}: the path is not valid UTF-8 (a TOML config holds text)",
            abs.display()
        ),
    })
}

/// A float as TOML writes it (always with a point or an exponent).
fn qf(x: f64) -> String {
    toml::Value::Float(x).to_string()
}

/// The resolution and bucket step for images whose typical side (the median of
/// sqrt(width x height)) is `typical`: the family's resolution, or the typical side where
/// it is smaller (a run does not upscale most of its images), on the trainer's step of 64
/// (16 below 512 pixels, still a whole number of latent patches for every family).
fn resolution(typical: usize, ceiling: usize) -> (usize, usize) {
    let r = typical.min(ceiling);
    let step = if r >= 512 { 64 } else { 16 };
    ((r / step * step).max(step), step)
}

/// The images' typical side: the median of sqrt(width x height).
fn typical_side(items: &[Item]) -> usize {
    let mut sides: Vec<usize> = items
        .iter()
        .map(|it| ((it.width * it.height) as f64).sqrt() as usize)
        .collect();
    sides.sort_unstable();
    sides.get(sides.len() / 2).copied().unwrap_or(0)
}

/// Up to [`PROMPTS`] distinct captions spread over the images (first, middle, last).
fn prompts(items: &[Item]) -> Vec<String> {
    let n = items.len();
    let mut out: Vec<String> = vec![];
    for i in [0, n / 2, n.saturating_sub(1)] {
        let c = &items[i.min(n - 1)].caption;
        if !c.is_empty() && !out.contains(c) && out.len() < PROMPTS {
            out.push(c.clone());
        }
    }
    out
}

/// The GPU's free memory in GiB, on a GPU.
fn free_gib(device: &Device) -> Result<Option<f64>> {
    #[cfg(feature = "cuda")]
    #[allow(irrefutable_let_patterns)]
    if let Device::Cuda(c) = device {
        let free = c.total_memory()?.saturating_sub(c.device_memory_used()?);
        return Ok(Some(free as f64 / (1u64 << 30) as f64));
    }
    let _ = device;
    Ok(None)
}

/// A run folder beside the config that is not taken: `runs/<arch>-lora`, then `-2`, `-3`...
fn run_folder(base: &Path, arch: &str) -> PathBuf {
    let name = |i: usize| match i {
        1 => format!("{arch}-lora"),
        i => format!("{arch}-lora-{i}"),
    };
    (1..10_000)
        .map(|i| PathBuf::from("runs").join(name(i)))
        .find(|p| !base.join(p).exists())
        .unwrap_or_else(|| PathBuf::from("runs").join(name(10_000)))
}

/// Everything chosen, for writing the text.
struct Choices<'a> {
    opts: &'a InitOptions,
    family: &'static Family,
    recipe: &'static Recipe,
    found: &'a models::Discovery,
    tokenizer_lines: Vec<String>,
    builtin: bool,
    items: &'a [Item],
    skipped: usize,
    unfit: Vec<String>,
    bucket: BucketConfig,
    typical: usize,
    buckets: Vec<(Bucket, usize)>,
    prompts: Vec<String>,
    steps: usize,
    cuda: bool,
    budget: Option<(f64, &'static str)>,
    output_dir: PathBuf,
}

/// The config's text; `plan`: the memory plan's lines, as comments under `[memory]`.
fn render(c: &Choices, plan: &[String]) -> Result<String> {
    let r = c.recipe;
    let mut s = String::new();
    let w = &mut s;
    let out_name = c
        .opts
        .out
        .file_name()
        .map_or("train.toml".into(), |f| f.to_string_lossy().into_owned());
    let _ = writeln!(
        w,
        "# Written by `train init` (FLAME {}) from --model {} and --images {}.\n\
         # Every key is one of `train --print-config` (docs/CONFIG.md); relative paths are \
         relative to this file.\n\
         # Check: train --plan {out_name}    Run: train {out_name}\n",
        env!("CARGO_PKG_VERSION"),
        c.opts.model.display(),
        c.opts.images.display()
    );
    // [model]
    let _ = writeln!(w, "[model]");
    for line in &c.found.lines {
        let _ = writeln!(w, "# {line}");
    }
    let _ = writeln!(
        w,
        "arch = {}  # {}",
        q(c.family.name),
        match &c.opts.arch {
            Some(_) => "as --arch says",
            None => "found by the model's keys",
        }
    );
    let _ = writeln!(
        w,
        "path = {}",
        qpath(&c.found.model, "the diffusion model")?
    );
    let dtype = match c.cuda {
        true => "\"bf16\"  # the weights on the GPU in bf16 (\"fp8\": half the memory)",
        false => "\"f32\"  # no GPU: the CPU computes in f32",
    };
    let _ = writeln!(w, "dtype = {dtype}\n");
    // [encoders]
    let _ = writeln!(w, "[encoders]");
    if c.found.text.is_empty() && c.found.vae.is_none() {
        let _ = writeln!(
            w,
            "# text encoders and autoencoder: from the model's own folder or file (no key needed)"
        );
    }
    if !c.found.text.is_empty() {
        let paths = c
            .found
            .text
            .iter()
            .map(|p| qpath(p, "a text encoder"))
            .collect::<Result<Vec<_>>>()?;
        let names: Vec<&str> = c.family.pipeline.text.iter().map(|s| s.name).collect();
        let _ = writeln!(
            w,
            "# the text encoders in the family's order ({}), found by their keys",
            names.join(", ")
        );
        let _ = writeln!(w, "text = [{}]", paths.join(", "));
    }
    if let Some(v) = &c.found.vae {
        let _ = writeln!(w, "# the autoencoder, found by its keys");
        let _ = writeln!(w, "vae = {}", qpath(v, "the autoencoder")?);
    }
    for line in &c.tokenizer_lines {
        let _ = writeln!(w, "# {line}");
    }
    if c.builtin {
        let _ = writeln!(
            w,
            "# (no tokenizer folder found: the vocabularies built into FLAME are used; \
             encoders.tokenizers takes folders)"
        );
    }
    let _ = writeln!(w);
    // [adapter]
    let _ = writeln!(w, "[adapter]");
    let _ = writeln!(
        w,
        "# a LoRA of rank 16 on every block's attention and MLP (examples/{})",
        r.template
    );
    let _ = writeln!(w, "kind = \"lora\"\nrank = 16\nalpha = 16.0");
    let targets: Vec<String> = r.targets.iter().map(|t| q(t)).collect();
    let _ = writeln!(w, "targets = [{}]", targets.join(", "));
    let _ = writeln!(
        w,
        "format = \"kohya\"  # read by ComfyUI and kohya (\"peft\" for diffusers)\n"
    );
    // [optimizer]
    let _ = writeln!(w, "[optimizer]");
    let _ = writeln!(
        w,
        "kind = \"adamw\"  # \"adamw8bit\" holds a quarter of the state\nlr = 1e-4\n"
    );
    // [train]
    let _ = writeln!(w, "[train]");
    let _ = writeln!(
        w,
        "steps = {}  # {}",
        c.steps,
        match c.opts.steps {
            Some(_) => "as --steps says",
            None => "a usual length for one subject or style (--steps)",
        }
    );
    let _ = writeln!(
        w,
        "batch_size = 1\nseed = 42\nsave_every = {}  # checkpoints (0: only at the end)",
        save_every(c.steps)
    );
    let _ = writeln!(
        w,
        "output_dir = {}  # the run folder: checkpoints, samples, loss plot, lora.safetensors",
        q(&c.output_dir.to_string_lossy())
    );
    let _ = writeln!(w, "device = \"auto\"  # the GPU if one opens, else the CPU");
    match r.timesteps {
        Some(t) => {
            let _ = writeln!(w, "timesteps = {}  # as examples/{}", q(t), r.template);
        }
        None => {
            let _ = writeln!(
                w,
                "min_snr_gamma = {}  # as examples/{}",
                qf(r.min_snr_gamma),
                r.template
            );
        }
    }
    let _ = writeln!(w);
    // [data]
    let _ = writeln!(w, "[data]");
    let _ = writeln!(
        w,
        "# {} images{} in {}; typical side (median of sqrt(w x h)) {} pixels",
        c.items.len(),
        match c.skipped {
            0 => String::new(),
            n => format!(" ({n} more left out: unreadable or without a caption)"),
        },
        c.opts.images.display(),
        c.typical
    );
    let _ = writeln!(
        w,
        "resolution = {}  # {}",
        c.bucket.resolution,
        match c.bucket.resolution < r.resolution {
            true => format!(
                "the images' typical side (the family trains at {}; a run does not upscale \
                 most images)",
                r.resolution
            ),
            false => format!(
                "the family's resolution (images of {}+ pixels)",
                r.resolution
            ),
        }
    );
    let _ = writeln!(w, "bucket_step = {}", c.bucket.step);
    let _ = writeln!(w, "max_aspect = {}", qf(c.bucket.max_aspect));
    let used: Vec<String> = c
        .buckets
        .iter()
        .map(|(b, n)| format!("{b} ({n})"))
        .collect();
    let _ = writeln!(
        w,
        "# aspect-ratio buckets the images fall in (images): {}",
        used.join(", ")
    );
    if !c.unfit.is_empty() || c.skipped > 0 {
        let _ = writeln!(
            w,
            "# {} images cannot be bucketed at this resolution or were left out; a run skips \
             them:",
            c.unfit.len() + c.skipped
        );
        for u in c.unfit.iter().take(5) {
            let _ = writeln!(w, "#   {u}");
        }
        let _ = writeln!(w, "on_bad_file = \"skip\"");
    }
    let _ = writeln!(
        w,
        "# validation_split = 0.1  # hold images out for a validation loss\n"
    );
    let _ = writeln!(w, "[[data.dirs]]");
    let _ = writeln!(w, "path = {}", qpath(&c.opts.images, "--images")?);
    let _ = writeln!(w, "repeats = 1\n");
    // [sample]
    let _ = writeln!(w, "[sample]");
    let _ = writeln!(
        w,
        "# prompts: {} of the captions; images at data.resolution",
        c.prompts.len()
    );
    let _ = writeln!(w, "every = {}", save_every(c.steps));
    let ps: Vec<String> = c.prompts.iter().map(|p| q(p)).collect();
    let _ = writeln!(w, "prompts = [{}]", ps.join(", "));
    let _ = writeln!(
        w,
        "steps = {}\nguidance = {}  # as examples/{}\n",
        r.sample_steps,
        qf(r.sample_guidance),
        r.template
    );
    // [memory]
    let _ = writeln!(w, "[memory]");
    match c.budget {
        Some((gb, why)) => {
            let _ = writeln!(w, "budget_gb = {}  # {why}", qf(gb));
        }
        None => {
            let _ = writeln!(
                w,
                "# budget_gb = 12  # no GPU here{}: no budget (on a GPU, 0 or no key is its \
                 free memory)",
                match cfg!(feature = "cuda") {
                    true => "",
                    false => " (a build without CUDA)",
                }
            );
        }
    }
    let _ = writeln!(
        w,
        "checkpointing = \"auto\"  # the planner picks the fastest plan predicted to fit"
    );
    for line in plan {
        let _ = writeln!(w, "# {line}");
    }
    Ok(s)
}

/// Checkpoints and samples every quarter of a long run; only at the end of a short one.
fn save_every(steps: usize) -> usize {
    match steps >= 400 {
        true => steps / 4,
        false => 0,
    }
}

/// Writes the config (module docs) and returns it; `on` hears what the planning run says.
/// Refused, naming what: an existing `out` without `force` (checked first), a model path
/// with no model FLAME trains, an image folder with no usable image, a budget no plan fits.
pub fn init(opts: &InitOptions, on: &mut dyn FnMut(String)) -> Result<Written> {
    if opts.out.exists() && !opts.force {
        return Err(Error::Io {
            path: opts.out.clone(),
            source: std::io::Error::new(
                std::io::ErrorKind::AlreadyExists,
                "exists: train init replaces a config only with --force",
            ),
        });
    }
    if let Some(b) = opts.budget_gb {
        if !(b.is_finite() && b > 0.0) {
            return Err(Error::Config {
                path: None,
                msg: format!("--budget {b}: a number of GiB > 0"),
            });
        }
    }
    if opts.steps == Some(0) {
        return Err(Error::Config {
            path: None,
            msg: "--steps 0: at least 1".into(),
        });
    }
    let found = models::discover(&opts.model, opts.arch.as_deref(), false, false, KEYS)?;
    let family = found.family;
    let recipe = recipe(family)?;
    let (text_at, _) = Sources {
        text: found.text.clone(),
        tokenizers: vec![],
        vae: found.vae.clone(),
    }
    .locate(
        family,
        &found.model,
        ["encoders.text", "encoders.tokenizers", "encoders.vae"],
    )?;
    let builtin = text_at
        .iter()
        .any(|(_, t)| matches!(t, TokenizerSource::Builtin(_)));

    // The images, by the data code's scan: bad files are counted, not fatal.
    let scan = data::scan(
        &[Source::Folder {
            dir: opts.images.clone(),
            repeats: 1,
            references: vec![],
        }],
        OnBadFile::Skip,
    )?;
    if scan.items.is_empty() {
        return Err(Error::Data {
            path: opts.images.clone(),
            msg: format!(
                "no images to train on: a folder of PNG, JPEG or WebP pictures, each with a \
                 .txt caption beside it, is needed ({} files left out{})",
                scan.skipped.len(),
                scan.skipped
                    .first()
                    .map(|b| format!(", e.g. {b}"))
                    .unwrap_or_default()
            ),
        });
    }
    let typical = typical_side(&scan.items);
    let (res, step) = resolution(typical, recipe.resolution);
    let bucket = BucketConfig {
        resolution: res,
        step,
        ..BucketConfig::default()
    };
    let all = data::buckets(&bucket)?;
    let mut unfit = vec![];
    let mut counts: Vec<(Bucket, usize)> = vec![];
    for it in &scan.items {
        if let Some(why) = data::bucket::unfit(it.width, it.height, &bucket) {
            unfit.push(format!("{}: {why}", it.path.display()));
            continue;
        }
        if let Some(b) = data::bucket::closest(&all, it.width, it.height) {
            match counts.iter_mut().find(|(x, _)| *x == b) {
                Some((_, n)) => *n += 1,
                None => counts.push((b, 1)),
            }
        }
    }
    if counts.is_empty() {
        return Err(Error::Data {
            path: opts.images.clone(),
            msg: format!(
                "none of its {} images can be bucketed at resolution {res}: {}",
                scan.items.len(),
                unfit.first().cloned().unwrap_or_default()
            ),
        });
    }
    counts.sort_by(|(a, _), (b, _)| (a.width * b.height).cmp(&(b.width * a.height)));

    let device = Device::chosen(DeviceChoice::Auto)?;
    let cuda = device.is_cuda();
    let budget = match (opts.budget_gb, free_gib(&device)?) {
        (Some(b), _) => Some((b, "as --budget says")),
        // The free memory, rounded down to a tenth of a GiB.
        (None, Some(free)) => Some((
            (free * 10.0).floor() / 10.0,
            "this GPU's free memory when train init ran (--budget to choose)",
        )),
        (None, None) => None,
    };
    let out_abs = std::path::absolute(&opts.out).map_err(|source| Error::Io {
        path: opts.out.clone(),
        source,
    })?;
    let base = out_abs.parent().unwrap_or(Path::new(".")).to_path_buf();
    let choices = Choices {
        opts,
        family,
        recipe,
        found: &found,
        tokenizer_lines: tokenizer_lines(family, &text_at),
        builtin,
        items: &scan.items,
        skipped: scan.skipped.len(),
        unfit,
        bucket,
        typical,
        buckets: counts,
        prompts: prompts(&scan.items),
        steps: opts.steps.unwrap_or(DEFAULT_STEPS),
        cuda,
        budget,
        output_dir: run_folder(&base, family.name),
    };

    // The memory plan of this config, by the planner `train --plan` runs.
    let draft = render(&choices, &[])?;
    let mut config = TrainConfig::from_toml(&draft)?;
    config.train.output_dir = base.join(&config.train.output_dir);
    let place = Placement {
        device: Some(device),
        ..Placement::default()
    };
    let (memory, phases, samples) = plan_run(config, place, &mut |e| {
        if let Event::Note(n) = e {
            on(n)
        }
    })
    .map_err(|e| Error::Context {
        what: "the memory plan of the config train init would write".into(),
        error: Box::new(e),
    })?;
    let mut plan = vec![
        "the plan `train --plan` makes of this config (when train init ran):".to_string(),
        format!("training data: {samples}"),
        memory.describe(),
    ];
    plan.extend(phases.iter().map(|p| format!("  {}", p.describe())));
    let text = render(&choices, &plan)?;
    // Every key is a real one: the text reads back as a config.
    TrainConfig::from_toml(&text)?;
    if let Some(dir) = out_abs.parent() {
        std::fs::create_dir_all(dir).map_err(|source| Error::Io {
            path: dir.to_path_buf(),
            source,
        })?;
    }
    crate::data::write_atomic(&out_abs, text.as_bytes())?;
    let mut lines = found.lines.clone();
    lines.extend(choices.tokenizer_lines.iter().cloned());
    lines.push(format!(
        "{} images, resolution {res} (bucket step {step}), {} buckets",
        scan.items.len(),
        choices.buckets.len()
    ));
    lines.push(memory.describe());
    Ok(Written {
        path: opts.out.clone(),
        text,
        lines,
    })
}
