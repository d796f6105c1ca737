//! The `train` binary's TOML config. Unknown keys and wrong types are errors that name the
//! key and its line (serde's `deny_unknown_fields` through the toml crate's spans); paths are
//! relative to the config file's folder. Every check runs before anything is written.

use super::objectives::TimestepSampling;
use crate::nn::LoraConfig;
use crate::{Error, Result};
use serde::Deserialize;
use std::path::{Path, PathBuf};

#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TrainConfig {
    pub model: ModelSection,
    pub adapter: AdapterSection,
    #[serde(default)]
    pub optimizer: OptimizerSection,
    #[serde(default)]
    pub schedule: ScheduleSection,
    pub train: TrainSection,
    pub data: DataSection,
}

#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Arch {
    Flux,
    Sd3,
    Sdxl,
}

impl Arch {
    /// The model's folder in a diffusers pipeline, which is also the key prefix diffusers
    /// expects in a PEFT LoRA file.
    pub fn diffusers_name(self) -> &'static str {
        match self {
            Arch::Flux | Arch::Sd3 => "transformer",
            Arch::Sdxl => "unet",
        }
    }
}

#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum ModelDType {
    F32,
    Bf16,
}

#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ModelSection {
    pub arch: Arch,
    /// A single file or a diffusers folder.
    pub path: PathBuf,
    #[serde(default = "default_dtype")]
    pub dtype: ModelDType,
    /// Make a tiny random model (fixed seed) at `path` when it does not exist: "flux-tiny".
    #[serde(default)]
    pub create_if_missing: Option<String>,
    /// Flux-dev's guidance input during training.
    #[serde(default = "default_guidance")]
    pub guidance: f64,
    /// SDXL: "epsilon" or "v".
    #[serde(default = "default_prediction")]
    pub prediction: String,
}

fn default_dtype() -> ModelDType {
    ModelDType::Bf16
}
fn default_guidance() -> f64 {
    1.0
}
fn default_prediction() -> String {
    "epsilon".into()
}

#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum AdapterFormat {
    /// `lora_unet_*.lora_down/lora_up/alpha` (ComfyUI, kohya).
    Kohya,
    /// `transformer.*.lora_A/lora_B` (diffusers, PEFT).
    Peft,
}

#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct AdapterSection {
    pub rank: usize,
    pub alpha: f64,
    #[serde(default)]
    pub dropout: f64,
    pub targets: Vec<String>,
    #[serde(default = "default_format")]
    pub format: AdapterFormat,
}

fn default_format() -> AdapterFormat {
    AdapterFormat::Kohya
}

#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct OptimizerSection {
    pub lr: f64,
    pub betas: [f64; 2],
    pub weight_decay: f64,
    pub eps: f64,
}

impl Default for OptimizerSection {
    fn default() -> Self {
        OptimizerSection {
            lr: 1e-4,
            betas: [0.9, 0.999],
            weight_decay: 0.01,
            eps: 1e-8,
        }
    }
}

#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ScheduleSection {
    /// "constant" or "cosine" (to zero at the last step).
    pub kind: String,
    pub warmup_steps: usize,
}

impl Default for ScheduleSection {
    fn default() -> Self {
        ScheduleSection {
            kind: "constant".into(),
            warmup_steps: 0,
        }
    }
}

#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TrainSection {
    pub steps: usize,
    #[serde(default = "one")]
    pub batch_size: usize,
    #[serde(default = "one")]
    pub grad_accum: usize,
    /// Clip the global gradient norm to this (0 = off).
    #[serde(default)]
    pub max_grad_norm: f64,
    #[serde(default)]
    pub seed: u64,
    /// 0 = only at the end.
    #[serde(default)]
    pub save_every: usize,
    #[serde(default = "two")]
    pub keep_last: usize,
    pub output_dir: PathBuf,
    /// "auto", "cuda" or "cpu".
    #[serde(default = "auto")]
    pub device: String,
    /// Flow matching: "uniform", "logit_normal", "shift" or "flux_shift".
    #[serde(default = "default_sampling")]
    pub timesteps: String,
    #[serde(default)]
    pub timestep_mean: f64,
    #[serde(default = "one_f")]
    pub timestep_std: f64,
    #[serde(default = "three_f")]
    pub timestep_shift: f64,
    /// SDXL: min-SNR-γ weighting (0 = off).
    #[serde(default)]
    pub min_snr_gamma: f64,
}

fn one() -> usize {
    1
}
fn two() -> usize {
    2
}
fn one_f() -> f64 {
    1.0
}
fn three_f() -> f64 {
    3.0
}
fn auto() -> String {
    "auto".into()
}
fn default_sampling() -> String {
    "logit_normal".into()
}

#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct DataSection {
    /// One safetensors file per sample.
    pub dir: PathBuf,
    /// Make this many synthetic samples in `dir` when it does not exist (the tiny example).
    #[serde(default)]
    pub synthetic: usize,
}

fn bad(path: &Path, msg: impl Into<String>) -> Error {
    Error::Config {
        path: Some(path.to_path_buf()),
        msg: msg.into(),
    }
}

impl TrainConfig {
    /// Reads and checks `path`; relative paths inside become relative to its folder.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| Error::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let mut c: TrainConfig = toml::from_str(&text).map_err(|e| bad(path, e.to_string()))?;
        let base = path.parent().unwrap_or(Path::new("."));
        for p in [&mut c.model.path, &mut c.train.output_dir, &mut c.data.dir] {
            if p.is_relative() {
                *p = base.join(&*p);
            }
        }
        c.validate().map_err(|e| match e {
            Error::Config { msg, .. } => bad(path, msg),
            e => e,
        })?;
        Ok(c)
    }

    pub fn validate(&self) -> Result<()> {
        let b = |m: String| Err(Error::Config { path: None, msg: m });
        self.lora().validate()?;
        self.sampling()?.validate()?;
        let t = &self.train;
        if t.steps == 0 || t.batch_size == 0 || t.grad_accum == 0 {
            return b("train.steps, train.batch_size and train.grad_accum must be positive".into());
        }
        if !["auto", "cuda", "cpu"].contains(&t.device.as_str()) {
            return b(format!(
                "train.device = \"{}\": expected auto, cuda or cpu",
                t.device
            ));
        }
        if !["constant", "cosine"].contains(&self.schedule.kind.as_str()) {
            return b(format!(
                "schedule.kind = \"{}\": expected constant or cosine",
                self.schedule.kind
            ));
        }
        if !["epsilon", "v"].contains(&self.model.prediction.as_str()) {
            return b(format!(
                "model.prediction = \"{}\": expected epsilon or v",
                self.model.prediction
            ));
        }
        if let Some(m) = &self.model.create_if_missing {
            if m != "flux-tiny" || self.model.arch != Arch::Flux {
                return b(format!(
                    "model.create_if_missing = \"{m}\": only \"flux-tiny\" (arch flux)"
                ));
            }
        }
        if t.max_grad_norm < 0.0 || !t.max_grad_norm.is_finite() || t.min_snr_gamma < 0.0 {
            return b("train.max_grad_norm and train.min_snr_gamma must be >= 0".into());
        }
        Ok(())
    }

    pub fn lora(&self) -> LoraConfig {
        LoraConfig {
            rank: self.adapter.rank,
            alpha: self.adapter.alpha,
            dropout: self.adapter.dropout,
            targets: self.adapter.targets.clone(),
            seed: self.train.seed,
        }
    }

    pub fn sampling(&self) -> Result<TimestepSampling> {
        let t = &self.train;
        Ok(match t.timesteps.as_str() {
            "uniform" => TimestepSampling::Uniform,
            "logit_normal" => TimestepSampling::LogitNormal { mean: t.timestep_mean, std: t.timestep_std },
            "shift" => TimestepSampling::Shift { shift: t.timestep_shift },
            "flux_shift" => TimestepSampling::FluxShift { mean: t.timestep_mean, std: t.timestep_std },
            other => {
                return Err(Error::Config {
                    path: None,
                    msg: format!(
                        "train.timesteps = \"{other}\": expected uniform, logit_normal, shift or flux_shift"
                    ),
                })
            }
        })
    }

    /// The learning rate at `step` (0-based): linear warm-up, then constant or cosine to 0.
    pub fn lr_at(&self, step: usize) -> f64 {
        let (lr, w, n) = (
            self.optimizer.lr,
            self.schedule.warmup_steps,
            self.train.steps,
        );
        if step < w {
            return lr * (step + 1) as f64 / w as f64;
        }
        match self.schedule.kind.as_str() {
            "cosine" if n > w => {
                let p = (step - w) as f64 / (n - w) as f64;
                lr * 0.5 * (1.0 + (std::f64::consts::PI * p).cos())
            }
            _ => lr,
        }
    }
}
