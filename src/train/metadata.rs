//! What a saved adapter file says about its training in its safetensors `__metadata__`, as
//! kohya's sd-scripts (`ss_*` keys, `train_network.py`) and the ModelSpec convention
//! (`modelspec.*` keys, Stability AI's ModelSpec as sd-scripts' `library/sai_model_spec.py`
//! and musubi-tuner's `utils/sai_model_spec.py` write it) record it, so that tools which show
//! or sort LoRAs by these keys read FLAME's files as they read kohya's.
//!
//! The keys that depend on the adapter itself (`ss_network_dim`, `ss_network_alpha`,
//! `ss_network_module`, `ss_network_args`) are the adapters' own (`nn::adapter`); the
//! hashes (`sshs_model_hash`, `sshs_legacy_hash`) are computed by the writer from the bytes
//! it writes. [`RunMetadata`] holds the rest: the facts fixed when the run opens, and
//! [`RunMetadata::at`] adds those of a save (step, epoch, date).

use super::config::{MetadataLevel, TrainConfig};
use crate::data::Item;
use std::collections::BTreeMap;

/// The ModelSpec version sd-scripts writes (`sai_model_spec.py`, `BASE_METADATA`).
pub const MODELSPEC_VERSION: &str = "1.0.1";

/// The keys [`MetadataLevel::Minimal`] leaves out: what could identify the user's data.
pub const IDENTIFYING_KEYS: [&str; 4] = [
    "ss_dataset_dirs",
    "ss_tag_frequency",
    "ss_output_name",
    "ss_sd_model_name",
];

/// What the training images are, as kohya's metadata counts them.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DatasetFacts {
    /// Images times their repeats (kohya's `num_train_images`).
    pub images: usize,
    /// Regularisation images times their repeats (kohya's `num_reg_images`).
    pub reg_images: usize,
    /// Per folder (its name, kohya's `os.path.basename(image_dir)`): repeats and images.
    pub dirs: BTreeMap<String, (usize, usize)>,
    /// Per folder: each caption tag and the number of captions holding it.
    pub tags: BTreeMap<String, BTreeMap<String, usize>>,
}

impl DatasetFacts {
    /// The facts of a folder dataset's images: each image counts under the name of the
    /// folder it sits in (a `<repeats>_<name>` subfolder is a folder of its own, as in
    /// kohya's layout).
    pub fn of_items(items: &[Item]) -> Self {
        let mut f = DatasetFacts::default();
        for it in items {
            let dir = it
                .path
                .parent()
                .and_then(|p| p.file_name())
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            match it.reg {
                true => f.reg_images += it.repeats,
                false => f.images += it.repeats,
            }
            let e = f.dirs.entry(dir.clone()).or_insert((it.repeats, 0));
            e.1 += 1;
            let counts = f.tags.entry(dir).or_default();
            add_tags(counts, &it.caption);
        }
        f
    }

    /// Pre-encoded samples: `n` samples of one folder, no captions.
    pub fn encoded(dir: &std::path::Path, n: usize) -> Self {
        let name = dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        DatasetFacts {
            images: n,
            reg_images: 0,
            dirs: BTreeMap::from([(name, (1, n))]),
            tags: BTreeMap::new(),
        }
    }
}

/// Counts a caption's tags as kohya's `set_tag_frequency` does: split at commas, each part
/// trimmed and lower-cased, empty parts left out; one count per caption and tag occurrence.
pub fn add_tags(counts: &mut BTreeMap<String, usize>, caption: &str) {
    for tag in caption.split(',') {
        let tag = tag.trim();
        if !tag.is_empty() {
            *counts.entry(tag.to_lowercase()).or_insert(0) += 1;
        }
    }
}

/// The model's identity in the metadata: ModelSpec's architecture and implementation, and
/// kohya's `ss_base_model_version`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelIdentity {
    /// `modelspec.architecture` (with the `/lora` suffix ModelSpec gives adapters).
    pub architecture: String,
    /// `modelspec.implementation`.
    pub implementation: &'static str,
    /// `ss_base_model_version`.
    pub base_version: String,
    /// `modelspec.prediction_type` ("epsilon" / "v"), for the DDPM families only.
    pub prediction: Option<&'static str>,
}

/// The number of blocks a checkpoint's tensor names show under any of `prefixes` (the
/// highest index + 1 of `<prefix><i>.`).
pub fn count_blocks<'a>(names: impl Iterator<Item = &'a str>, prefixes: &[&str]) -> usize {
    let mut n = 0;
    for name in names {
        for p in prefixes {
            let Some(rest) = name.find(p).map(|i| &name[i + p.len()..]) else {
                continue;
            };
            let digits: String = rest.chars().take_while(|c| c.is_ascii_digit()).collect();
            if let (Ok(i), true) = (
                digits.parse::<usize>(),
                rest[digits.len()..].starts_with('.'),
            ) {
                n = n.max(i + 1);
            }
        }
    }
    n
}

/// The identity of a model of `family` (`model.arch`), given what its checkpoint shows:
/// `guidance` (Flux: a guidance input, i.e. dev rather than schnell), the count of its
/// (double) blocks and whether its joint blocks have a second attention (SD3.5 medium's
/// x-block self-attention). The names are the peers': sd-scripts' `ARCH_*` / `IMPL_*`
/// constants and `determine_implementation` for Flux, SD3 and SDXL, the `MODEL_VERSION_*`
/// strings its trainers record; musubi-tuner's `ARCH_FLUX_2_KLEIN_4B` / `_9B`,
/// `ARCH_Z_IMAGE` and their `IMPL_*` for FLUX.2 \[klein\] and Z-Image, and ai-toolkit's arch
/// names (`flux2_klein_4b`, `zimage`) for their base model version, which sd-scripts does
/// not define.
pub fn identity(
    family: &str,
    guidance: bool,
    blocks: usize,
    attn2: bool,
    v_prediction: bool,
) -> ModelIdentity {
    let id = |arch: &str, implementation, base: &str| ModelIdentity {
        architecture: format!("{arch}/lora"),
        implementation,
        base_version: base.to_string(),
        prediction: None,
    };
    match family {
        "flux" => id(
            if guidance {
                "flux-1-dev"
            } else {
                "flux-1-schnell"
            },
            "https://github.com/black-forest-labs/flux",
            "flux1",
        ),
        "sd3" => {
            // sd-scripts' SD3 model types: "m" (SD3 medium), "5-m" (SD3.5 medium, with
            // x-block self-attention), "5-large" (38 joint blocks).
            let kind = match (blocks >= 38, attn2) {
                (true, _) => "5-large",
                (false, true) => "5-m",
                (false, false) => "m",
            };
            id(&format!("stable-diffusion-3-{kind}"), "diffusers", kind)
        }
        "sdxl" => ModelIdentity {
            prediction: Some(if v_prediction { "v" } else { "epsilon" }),
            ..id(
                "stable-diffusion-xl-v1-base",
                "https://github.com/Stability-AI/generative-models",
                "sdxl_base_v1-0",
            )
        },
        "flux2" => {
            // FLUX.2 [klein] 4B has 5 double blocks, 9B has 8.
            let (arch, base) = match blocks {
                8 => ("Flux.2-klein-9b", "flux2_klein_9b"),
                5 => ("Flux.2-klein-4b", "flux2_klein_4b"),
                _ => ("Flux.2-klein", "flux2_klein"),
            };
            id(arch, "https://github.com/black-forest-labs/flux2", base)
        }
        "zimage" => id("Z-Image", "https://github.com/Tongyi-MAI/Z-Image", "zimage"),
        // A family the peers do not name: its own name, and FLAME as the implementation.
        other => id(other, "flame", other),
    }
}

/// `secs` since the Unix epoch as an ISO-8601 UTC date and time without fraction
/// (`2026-11-29T17:45:00`), as ModelSpec's `date` takes it. Civil date from days by Howard
/// Hinnant's `civil_from_days` algorithm.
pub fn iso_date(secs: f64) -> String {
    let s = secs.max(0.0) as i64;
    let (days, rem) = (s.div_euclid(86_400), s.rem_euclid(86_400));
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// The optimizer as kohya records it (`ss_optimizer`: the class's module path, then its
/// arguments), by the config's name for it; another name is recorded as it is.
fn optimizer_name(config: &TrainConfig) -> String {
    let o = &config.optimizer;
    let kind = crate::config::show(&o.kind).trim_matches('"').to_string();
    let class = match kind.as_str() {
        "adamw" => "torch.optim.adamw.AdamW".to_string(),
        "adamw8bit" => "bitsandbytes.optim.adamw.AdamW8bit".to_string(),
        "prodigy" => "prodigyopt.prodigy.Prodigy".to_string(),
        "lion" => "lion_pytorch.lion_pytorch.Lion".to_string(),
        "lion8bit" => "bitsandbytes.optim.lion.Lion8bit".to_string(),
        "adafactor" => {
            let a = match config.optimizer.optimizer_config() {
                crate::optim::OptimizerConfig::Adafactor(a) => a,
                _ => crate::optim::AdafactorConfig::default(),
            };
            let py = |b: bool| if b { "True" } else { "False" };
            return format!(
                "transformers.optimization.Adafactor(weight_decay={},scale_parameter={},\
                 relative_step={},warmup_init={})",
                a.weight_decay,
                py(a.scale_parameter),
                py(a.relative_step),
                py(a.warmup_init)
            );
        }
        _ => kind,
    };
    format!(
        "{class}(weight_decay={},betas=({}, {}),eps={})",
        o.weight_decay,
        o.betas()[0],
        o.betas()[1],
        o.eps
    )
}

/// The metadata of a run's adapter files, less what each save adds.
#[derive(Clone, Debug, PartialEq)]
pub struct RunMetadata {
    keys: BTreeMap<String, String>,
    level: MetadataLevel,
    started_at: f64,
}

impl RunMetadata {
    /// The run's keys: `config`'s settings, the model's `identity`, the data's `facts`,
    /// `started_at` (seconds since the Unix epoch). [`MetadataLevel::Minimal`] leaves out
    /// [`IDENTIFYING_KEYS`] and titles the file kohya's way without an output name.
    pub fn new(
        config: &TrainConfig,
        identity: &ModelIdentity,
        facts: &DatasetFacts,
        started_at: f64,
    ) -> Self {
        let t = &config.train;
        let level = config.train.metadata;
        let res = config.data.resolution;
        let output_name = t
            .output_dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let json = |v: serde_json::Value| v.to_string();
        let dirs: serde_json::Map<String, serde_json::Value> = facts
            .dirs
            .iter()
            .map(|(d, (r, n))| {
                (
                    d.clone(),
                    serde_json::json!({"n_repeats": r, "img_count": n}),
                )
            })
            .collect();
        let title = match level {
            MetadataLevel::Full if !output_name.is_empty() => output_name.clone(),
            // sd-scripts' title without one: "LoRA@<timestamp>".
            _ => format!("LoRA@{started_at}"),
        };
        let mut keys: BTreeMap<String, String> = [
            ("ss_training_started_at", started_at.to_string()),
            ("ss_base_model_version", identity.base_version.clone()),
            ("ss_learning_rate", config.optimizer.lr().to_string()),
            // kohya's train_network.py: the U-Net's and the text encoders' rates, and
            // whether only the diffusion model trains (--network_train_unet_only).
            ("ss_unet_lr", config.optimizer.lr().to_string()),
            (
                "ss_text_encoder_lr",
                config
                    .optimizer
                    .text_encoder_lr
                    .unwrap_or(config.optimizer.lr())
                    .to_string(),
            ),
            (
                "ss_network_train_unet_only",
                match config.adapter.text_encoders.is_empty() {
                    true => "True",
                    false => "False",
                }
                .to_string(),
            ),
            ("ss_network_train_text_encoder_only", "False".to_string()),
            ("ss_optimizer", optimizer_name(config)),
            (
                "ss_lr_scheduler",
                crate::config::show(&config.schedule.kind)
                    .trim_matches('"')
                    .to_string(),
            ),
            (
                "ss_lr_warmup_steps",
                config.schedule.warmup_steps.to_string(),
            ),
            ("ss_max_train_steps", t.steps.to_string()),
            ("ss_batch_size_per_device", t.batch_size.to_string()),
            ("ss_gradient_accumulation_steps", t.grad_accum.to_string()),
            ("ss_max_grad_norm", t.max_grad_norm.to_string()),
            ("ss_min_snr_gamma", t.min_snr_gamma.to_string()),
            (
                "ss_mixed_precision",
                crate::config::show(&config.model.dtype)
                    .trim_matches('"')
                    .to_string(),
            ),
            ("ss_seed", t.seed.to_string()),
            ("ss_resolution", format!("({res}, {res})")),
            ("ss_num_train_images", facts.images.to_string()),
            ("ss_num_reg_images", facts.reg_images.to_string()),
            ("ss_dataset_dirs", json(dirs.into())),
            ("ss_tag_frequency", json(serde_json::json!(facts.tags))),
            ("ss_output_name", output_name),
            (
                "ss_sd_model_name",
                config
                    .model
                    .path
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default(),
            ),
            ("modelspec.sai_model_spec", MODELSPEC_VERSION.to_string()),
            ("modelspec.architecture", identity.architecture.clone()),
            ("modelspec.implementation", identity.implementation.into()),
            ("modelspec.title", title),
            ("modelspec.resolution", format!("{res}x{res}")),
            (
                "modelspec.implementation_version",
                format!("flame/{}", env!("CARGO_PKG_VERSION")),
            ),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        if let Some(p) = identity.prediction {
            keys.insert("modelspec.prediction_type".into(), p.into());
        }
        if level == MetadataLevel::Minimal {
            for k in IDENTIFYING_KEYS {
                keys.remove(k);
            }
        }
        RunMetadata {
            keys,
            level,
            started_at,
        }
    }

    /// The keys of a file saved after `step` optimizer steps, `samples_per_epoch` samples an
    /// epoch and `samples_per_step` drawn a step, at `now`: `ss_steps`, `ss_epoch` (the
    /// epoch the step is in, from 1, as kohya numbers a save), `ss_training_finished_at`
    /// and `modelspec.date`.
    pub fn at(
        &self,
        step: usize,
        samples_per_step: usize,
        samples_per_epoch: usize,
        now: f64,
    ) -> BTreeMap<String, String> {
        let mut k = self.keys.clone();
        let drawn = step.saturating_mul(samples_per_step);
        let epoch = drawn.div_ceil(samples_per_epoch.max(1)).max(1);
        k.insert("ss_steps".into(), step.to_string());
        k.insert("ss_epoch".into(), epoch.to_string());
        k.insert("ss_training_finished_at".into(), now.to_string());
        k.insert("modelspec.date".into(), iso_date(now));
        k
    }

    /// The level the keys were made at.
    pub fn level(&self) -> MetadataLevel {
        self.level
    }

    /// When the run (this process) started, in seconds since the Unix epoch.
    pub fn started_at(&self) -> f64 {
        self.started_at
    }
}

/// What two runs of one config write alike in an adapter file: its metadata less
/// [`TIME_KEYS`] (and a `modelspec.title` made from the start time), with the SHA-256 of its
/// tensor bytes as `"tensors.sha256"`. A resumed run's adapter equals an uninterrupted run's
/// in this, not byte for byte (their times differ).
pub fn content(path: &std::path::Path) -> crate::Result<BTreeMap<String, String>> {
    let mut m = crate::safetensors::SafeTensorsFile::open(path)?
        .metadata()
        .clone();
    for k in TIME_KEYS {
        m.remove(k);
    }
    if m.get("modelspec.title")
        .is_some_and(|t| t.starts_with("LoRA@"))
    {
        m.remove("modelspec.title");
    }
    let bytes = std::fs::read(path).map_err(|e| crate::Error::Io {
        path: path.to_path_buf(),
        source: e,
    })?;
    m.insert(
        "tensors.sha256".into(),
        crate::safetensors::addnet_hashes(&bytes).0,
    );
    Ok(m)
}

/// The keys of a file's metadata that change between two runs of one config (the times;
/// with [`MetadataLevel::Minimal`], `modelspec.title` too, made from the start time): what
/// a comparison of two runs' files leaves out.
pub const TIME_KEYS: [&str; 3] = [
    "ss_training_started_at",
    "ss_training_finished_at",
    "modelspec.date",
];
