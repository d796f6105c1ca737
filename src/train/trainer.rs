//! The training loop behind `train`: LoRA on Flux, SD3.5 or SDXL from pre-encoded data, with
//! AdamW, a warm-up + constant/cosine schedule, gradient accumulation and clipping, a JSONL
//! loss log and atomic checkpoints that resume exactly. Every random draw (data order, noise,
//! timesteps, dropout) is a function of (seed, step), so a checkpoint needs only the step, the
//! adapter and the optimizer state.

use super::config::{AdapterFormat, Arch, ModelDType, TrainConfig};
use super::data::{indices, Dataset, Spec};
use super::objectives::{flow_matching, weighted_mse, Ddpm, Prediction};
use crate::models::flux::{self, Flux, FluxConfig};
use crate::models::sd3::{self, Sd3};
use crate::models::sdxl::{self, SdxlConfig, Unet};
use crate::models::Checkpoint;
use crate::nn::{Adapters, KeyMap, VarBuilder, GOLDEN};
use crate::optim::{AdamConfig, AdamW, Optimizer};
use crate::{DType, Device, Error, Grads, Result, Tensor};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

enum Net {
    Flux(Box<Flux>),
    Sd3(Box<Sd3>),
    /// With its noise schedule, made once.
    Sdxl(Box<Unet>, SdxlConfig, Ddpm),
}

/// A loaded model with its adapters, data and optimizer, ready to step.
pub struct Trainer {
    pub config: TrainConfig,
    net: Net,
    map: KeyMap,
    pub adapters: Arc<Adapters>,
    data: Dataset,
    opt: AdamW,
    device: Device,
    dtype: DType,
    /// The next step to run (0-based).
    pub step: usize,
    /// Set (e.g. by a Ctrl-C handler) to stop after the current step with a checkpoint.
    interrupt: Arc<AtomicBool>,
}

/// How `Trainer::run` ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RunEnd {
    /// All steps done; the final adapter is written.
    Finished,
    /// Stopped at the requested step.
    Stopped(usize),
    /// Interrupted after this step; a checkpoint of it is written.
    Interrupted(usize),
}

/// The tiny Flux of `create_if_missing = "flux-tiny"`: 4 latent channels, hidden 32, one
/// block of each kind, text width 32, pooled 16.
pub fn flux_tiny_config() -> FluxConfig {
    FluxConfig {
        in_channels: 16,
        out_channels: 16,
        vec_in_dim: 16,
        context_in_dim: 32,
        hidden_size: 32,
        mlp_ratio: 4.0,
        num_heads: 2,
        depth: 1,
        depth_single_blocks: 1,
        axes_dim: vec![4, 6, 6],
        theta: 10_000.0,
        qkv_bias: true,
        guidance_embed: true,
    }
}

/// Seed of the tiny model's weights and of the synthetic data.
const TINY_SEED: u64 = 20_261_122;

fn make_tiny_flux(path: &Path, device: &Device) -> Result<()> {
    let vb = VarBuilder::random(TINY_SEED, 0.08, DType::F32, device);
    Flux::new(&vb, &flux_tiny_config())?;
    let params = vb.params()?;
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|source| Error::Io {
            path: dir.to_path_buf(),
            source,
        })?;
    }
    crate::safetensors::save(params.iter().map(|(k, t)| (k.as_str(), t)), path)
}

/// `n` synthetic samples for a model with `c` latent channels: latents made of a few smooth
/// patterns (something to learn), random text features.
fn make_synthetic(
    dir: &Path,
    n: usize,
    (c, ctx, pooled): (usize, usize, usize),
    device: &Device,
) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|source| Error::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    for i in 0..n {
        let k = (i % 4) as f32;
        let lat: Vec<f32> = (0..c * 8 * 8)
            .map(|j| {
                let (ch, y, x) = (j / 64, (j / 8) % 8, j % 8);
                ((x as f32 * (0.5 + k * 0.3) + ch as f32).sin() + (y as f32 * 0.7 - k).cos()) * 0.8
            })
            .collect();
        let seed = TINY_SEED ^ (i as u64 + 1);
        let sample = [
            ("latents", Tensor::from_vec(lat, (c, 8, 8), device)?),
            (
                "context",
                Tensor::randn((6, ctx), DType::F32, device, seed)?.affine(1.0, k as f64 * 0.2)?,
            ),
            (
                "pooled",
                Tensor::randn(pooled, DType::F32, device, seed ^ 7)?,
            ),
        ];
        let p = dir.join(format!("sample-{i:04}.safetensors"));
        crate::safetensors::save(sample.iter().map(|(k, t)| (*k, t)), p)?;
    }
    Ok(())
}

/// `train.device`: "cuda" (an error without a GPU), "cpu", or "auto" (the GPU if one opens).
fn pick_device(name: &str) -> Result<Device> {
    #[cfg(feature = "cuda")]
    if name != "cpu" {
        match Device::cuda(0) {
            Ok(d) => return Ok(d),
            Err(e) if name == "cuda" => return Err(e),
            Err(_) => {}
        }
    }
    #[cfg(not(feature = "cuda"))]
    if name == "cuda" {
        return Err(Error::CudaUnavailable(
            "train.device = \"cuda\" in a build without the `cuda` feature".into(),
        ));
    }
    cpu_device()
}

#[cfg(feature = "cpu-ref")]
fn cpu_device() -> Result<Device> {
    Ok(Device::Cpu)
}

#[cfg(not(feature = "cpu-ref"))]
fn cpu_device() -> Result<Device> {
    Err(Error::NoBackend("training on the CPU"))
}

/// The global L2 norm of the gradients of `params`, and the factor that clips it to `max`.
/// The squares are summed on the device, in f64, with one copy to the host per step.
fn clip(grads: &mut Grads, params: &[(String, Tensor)], max: f64) -> Result<f64> {
    let mut sq: Option<Tensor> = None;
    for (_, p) in params {
        if let Some(g) = grads.get(p) {
            let s = g.to_dtype(DType::F64)?.sqr()?.sum_all()?;
            sq = Some(match sq {
                Some(acc) => acc.add(&s)?,
                None => s,
            });
        }
    }
    let norm = match sq {
        Some(s) => s.to_scalar_f64()?.sqrt(),
        None => 0.0,
    };
    if max > 0.0 && norm > max {
        let f = max / (norm + 1e-6);
        for (_, p) in params {
            if let Some(g) = grads.remove(p) {
                grads.insert(p, g.affine(f, 0.0)?);
            }
        }
    }
    Ok(norm)
}

impl Trainer {
    /// Checks the config, makes the tiny model / synthetic data if asked, loads the model
    /// with its adapters and the data; writes nothing to the output folder.
    pub fn new(config: TrainConfig) -> Result<Trainer> {
        config.validate()?;
        let m = &config.model;
        let device = pick_device(&config.train.device)?;
        if m.create_if_missing.is_some() && !m.path.exists() {
            make_tiny_flux(&m.path, &device)?;
        }
        let dtype = match m.dtype {
            ModelDType::F32 => DType::F32,
            ModelDType::Bf16 => DType::BF16,
        };
        let adapters = Adapters::new(config.lora())?;
        let sub = m.arch.diffusers_name();
        let ckpt = Checkpoint::open(&m.path, sub)?;
        let (net, map, spec): (Net, KeyMap, Spec) = match m.arch {
            Arch::Flux => {
                let cfg = match (&ckpt.config, m.create_if_missing.is_some()) {
                    (_, true) => flux_tiny_config(),
                    (Some(j), _) => FluxConfig::from_diffusers(j)?,
                    (None, _) => {
                        let vb = ckpt.var_builder(
                            dtype,
                            &device,
                            flux::diffusers_map(&FluxConfig::dev()),
                        )?;
                        FluxConfig::from_single_file(&vb)?
                    }
                };
                let map = flux::diffusers_map(&cfg);
                let vb = ckpt
                    .var_builder(dtype, &device, map.clone())?
                    .with_adapters(adapters.clone())?;
                let spec = vec![
                    ("latents", vec![Some(cfg.in_channels / 4), None, None]),
                    ("context", vec![None, Some(cfg.context_in_dim)]),
                    ("pooled", vec![Some(cfg.vec_in_dim)]),
                ];
                (Net::Flux(Box::new(Flux::new(&vb, &cfg)?)), map, spec)
            }
            Arch::Sd3 => {
                let cfg = match &ckpt.config {
                    Some(j) => sd3::Sd3Config::from_diffusers(j)?,
                    None => {
                        let vb = ckpt.var_builder(
                            dtype,
                            &device,
                            sd3::diffusers_map(&sd3::Sd3Config::large()),
                        )?;
                        sd3::Sd3Config::from_single_file(&vb)?
                    }
                };
                let map = sd3::diffusers_map(&cfg);
                let vb = ckpt
                    .var_builder(dtype, &device, map.clone())?
                    .with_adapters(adapters.clone())?;
                let spec = vec![
                    ("latents", vec![Some(cfg.in_channels), None, None]),
                    ("context", vec![None, Some(cfg.context_dim)]),
                    ("pooled", vec![Some(cfg.pooled_dim)]),
                ];
                (Net::Sd3(Box::new(Sd3::new(&vb, &cfg)?)), map, spec)
            }
            Arch::Sdxl => {
                let cfg = match &ckpt.config {
                    Some(j) => SdxlConfig::from_diffusers(j)?,
                    None => {
                        let vb = ckpt.var_builder(
                            dtype,
                            &device,
                            sdxl::diffusers_map(&SdxlConfig::base()),
                        )?;
                        SdxlConfig::from_single_file(&vb)?
                    }
                };
                let map = sdxl::diffusers_map(&cfg);
                let vb = ckpt
                    .var_builder(dtype, &device, map.clone())?
                    .with_adapters(adapters.clone())?;
                let pooled = cfg.adm_in_channels - 6 * cfg.addition_time_embed_dim;
                let spec = vec![
                    ("latents", vec![Some(cfg.in_channels), None, None]),
                    ("context", vec![None, Some(cfg.context_dim)]),
                    ("pooled", vec![Some(pooled)]),
                    ("time_ids", vec![Some(6)]),
                ];
                (
                    Net::Sdxl(Box::new(Unet::new(&vb, &cfg)?), cfg, Ddpm::scaled_linear()),
                    map,
                    spec,
                )
            }
        };
        if adapters.layers()?.is_empty() {
            return Err(Error::Config {
                path: None,
                msg: format!(
                    "adapter.targets {:?} match no Linear layer of the model",
                    config.adapter.targets
                ),
            });
        }
        if config.data.synthetic > 0 && !config.data.dir.exists() {
            let c = spec[0].1[0].unwrap_or(4);
            let ctx = spec[1].1[1].unwrap_or(32);
            let pooled = spec[2].1[0].unwrap_or(16);
            make_synthetic(
                &config.data.dir,
                config.data.synthetic,
                (c, ctx, pooled),
                &device,
            )?;
        }
        let data = Dataset::open(&config.data.dir, &spec)?;
        let o = &config.optimizer;
        let opt = AdamW::new(
            adapters.params()?,
            AdamConfig {
                lr: o.lr,
                beta1: o.betas[0],
                beta2: o.betas[1],
                eps: o.eps,
                weight_decay: o.weight_decay,
            },
        )?;
        Ok(Trainer {
            config,
            net,
            map,
            adapters,
            data,
            opt,
            device,
            dtype,
            step: 0,
            interrupt: Arc::new(AtomicBool::new(false)),
        })
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The flag that stops the run after the current step, with a checkpoint.
    pub fn interrupt_flag(&self) -> Arc<AtomicBool> {
        self.interrupt.clone()
    }

    /// The loss of one batch of clean latents, noised with draws from `seed`.
    fn loss(&self, batch: &[Tensor], seed: u64) -> Result<Tensor> {
        let x0 = &batch[0];
        let (b, dims) = (x0.dims()[0], x0.dims().to_vec());
        let noise =
            Tensor::randn(dims.clone(), DType::F32, &self.device, seed)?.to_dtype(self.dtype)?;
        let (ctx, pooled) = (&batch[1], &batch[2]);
        // Flow matching (Flux, SD3): t from the configured sampler, x_t and the velocity.
        let flow = || -> Result<(Tensor, Tensor, Tensor)> {
            let tokens = dims[2] * dims[3] / 4;
            let t = self
                .config
                .sampling()?
                .sample(b, tokens, seed ^ 0x7133, &self.device)?;
            let (xt, target) = flow_matching(x0, &noise, &t)?;
            Ok((xt, target, t))
        };
        match &self.net {
            Net::Flux(m) => {
                let (xt, target, t) = flow()?;
                let (h, w) = (dims[2] / 2, dims[3] / 2);
                let img = flux::pack_latents(&xt)?;
                let txt_ids = flux::text_ids(ctx.dims()[1], &self.device)?;
                let img_ids = flux::image_ids(h, w, &self.device)?;
                let g = Tensor::full(self.config.model.guidance, b, DType::F32, &self.device)?;
                let out = m.forward(&img, &img_ids, ctx, &txt_ids, &t, pooled, Some(&g))?;
                weighted_mse(&flux::unpack_latents(&out, h, w)?, &target, None)
            }
            Net::Sd3(m) => {
                let (xt, target, t) = flow()?;
                // SD3's transformer takes t x 1000 (diffusers' SD3 training script).
                let pred = m.forward(&xt, &t.affine(1000.0, 0.0)?, ctx, pooled)?;
                weighted_mse(&pred, &target, None)
            }
            Net::Sdxl(m, cfg, ddpm) => {
                let kind = if self.config.model.prediction == "v" {
                    Prediction::V
                } else {
                    Prediction::Epsilon
                };
                let t = ddpm.sample_timesteps(b, seed ^ 0x7133, &self.device)?;
                let (xt, target) = ddpm.noisy_and_target(x0, &noise, &t, kind)?;
                let time_ids = batch[3].to_dtype(DType::F32)?;
                let y = sdxl::sdxl_vector(pooled, &time_ids, cfg.addition_time_embed_dim)?;
                let pred = m.forward(&xt, &t, ctx, &y)?;
                let gamma = self.config.train.min_snr_gamma;
                let w = if gamma > 0.0 {
                    Some(ddpm.min_snr_weights(&t, gamma, kind)?)
                } else {
                    None
                };
                weighted_mse(&pred, &target, w.as_ref())
            }
        }
    }

    /// One optimizer step (with its accumulated micro-batches); returns (loss, grad norm).
    pub fn train_step(&mut self) -> Result<(f64, f64)> {
        let t = &self.config.train;
        let (b, acc, seed) = (t.batch_size, t.grad_accum, t.seed);
        self.opt.set_learning_rate(self.config.lr_at(self.step));
        self.adapters.set_step(self.step as u64)?;
        let mut grads = Grads::new();
        let mut total = 0.0;
        for micro in 0..acc {
            let pos = (self.step * acc + micro) * b;
            let idx = indices(self.data.len(), seed, pos, b);
            let batch = self.data.batch(&idx, self.dtype, &self.device)?;
            let s = seed ^ ((self.step * acc + micro) as u64 + 1).wrapping_mul(GOLDEN);
            let loss = self.loss(&batch, s)?.affine(1.0 / acc as f64, 0.0)?;
            total += loss.to_scalar_f64()?;
            loss.backward_into(&mut grads)?;
        }
        let norm = clip(
            &mut grads,
            &self.adapters.params()?,
            self.config.train.max_grad_norm,
        )?;
        self.opt.step(&grads)?;
        self.step += 1;
        Ok((total, norm))
    }

    fn checkpoint_dir(&self, step: usize) -> PathBuf {
        self.config
            .train
            .output_dir
            .join(format!("checkpoint-{step:07}"))
    }

    fn save_adapter(&self, path: &Path) -> Result<()> {
        match self.config.adapter.format {
            AdapterFormat::Kohya => self.adapters.save_kohya(path, DType::F32),
            AdapterFormat::Peft => {
                let prefix = self.config.model.arch.diffusers_name();
                self.adapters.save_peft(path, &self.map, prefix, DType::F32)
            }
        }
    }

    fn load_adapter(&self, path: &Path) -> Result<()> {
        match self.config.adapter.format {
            AdapterFormat::Kohya => self.adapters.load_kohya(path),
            AdapterFormat::Peft => {
                let prefix = self.config.model.arch.diffusers_name();
                self.adapters.load_peft(path, &self.map, prefix)
            }
        }
    }

    /// Writes `checkpoint-<step>/` (adapter, optimizer state, step) into a temporary folder
    /// and renames it into place, then keeps only the last `keep_last` checkpoints.
    pub fn save_checkpoint(&self) -> Result<PathBuf> {
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |source| Error::Io { path, source }
        };
        let out = &self.config.train.output_dir;
        let dir = self.checkpoint_dir(self.step);
        let tmp = out.join(format!(".tmp-checkpoint-{:07}", self.step));
        if tmp.exists() {
            std::fs::remove_dir_all(&tmp).map_err(io(&tmp))?;
        }
        std::fs::create_dir_all(&tmp).map_err(io(&tmp))?;
        self.save_adapter(&tmp.join("adapter.safetensors"))?;
        self.opt.save_state(&tmp.join("optimizer.safetensors"))?;
        let state = serde_json::json!({ "step": self.step, "seed": self.config.train.seed });
        std::fs::write(tmp.join("state.json"), state.to_string()).map_err(io(&tmp))?;
        if dir.exists() {
            std::fs::remove_dir_all(&dir).map_err(io(&dir))?;
        }
        std::fs::rename(&tmp, &dir).map_err(io(&dir))?;
        let mut all = checkpoints(out)?;
        let keep = self.config.train.keep_last.max(1);
        while all.len() > keep {
            let (_, old) = all.remove(0);
            std::fs::remove_dir_all(&old).map_err(io(&old))?;
        }
        Ok(dir)
    }

    /// Restores the adapter, optimizer state and step from `dir`.
    pub fn load_checkpoint(&mut self, dir: &Path) -> Result<()> {
        let text = std::fs::read_to_string(dir.join("state.json")).map_err(|source| Error::Io {
            path: dir.join("state.json"),
            source,
        })?;
        let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| Error::Checkpoint {
            path: dir.to_path_buf(),
            msg: format!("state.json: {e}"),
        })?;
        let step = v["step"].as_u64().ok_or_else(|| Error::Checkpoint {
            path: dir.to_path_buf(),
            msg: "state.json has no step".into(),
        })?;
        if v["seed"].as_u64() != Some(self.config.train.seed) {
            return Err(Error::Checkpoint {
                path: dir.to_path_buf(),
                msg: format!(
                    "saved with seed {}, the config has {}",
                    v["seed"], self.config.train.seed
                ),
            });
        }
        self.load_adapter(&dir.join("adapter.safetensors"))?;
        self.opt.load_state(&dir.join("optimizer.safetensors"))?;
        self.step = step as usize;
        Ok(())
    }

    /// Runs to `train.steps` (or to `stop_at`, for tests of resuming), logging each step's
    /// loss to `loss.jsonl` and saving checkpoints and the final adapter. `resume` continues
    /// from the latest checkpoint in the output folder if there is one.
    pub fn run(&mut self, resume: bool, stop_at: Option<usize>, progress: bool) -> Result<RunEnd> {
        let out = self.config.train.output_dir.clone();
        std::fs::create_dir_all(&out).map_err(|source| Error::Io {
            path: out.clone(),
            source,
        })?;
        if resume {
            if let Some((_, dir)) = checkpoints(&out)?.pop() {
                self.load_checkpoint(&dir)?;
            }
        }
        let log_path = out.join("loss.jsonl");
        let kept = read_log(&log_path)?
            .into_iter()
            .filter(|(s, _)| *s < self.step)
            .map(|(_, line)| line + "\n")
            .collect::<String>();
        std::fs::write(&log_path, kept).map_err(|source| Error::Io {
            path: log_path.clone(),
            source,
        })?;
        let mut log = std::fs::OpenOptions::new()
            .append(true)
            .open(&log_path)
            .map_err(|source| Error::Io {
                path: log_path.clone(),
                source,
            })?;
        let (n, every) = (self.config.train.steps, self.config.train.save_every);
        let end = stop_at.unwrap_or(n).min(n);
        let start = std::time::Instant::now();
        let first = self.step;
        while self.step < end {
            let lr = self.config.lr_at(self.step);
            let (loss, norm) = self.train_step()?;
            let line = serde_json::json!({ "step": self.step - 1, "loss": loss, "lr": lr, "grad_norm": norm });
            writeln!(log, "{line}").map_err(|source| Error::Io {
                path: log_path.clone(),
                source,
            })?;
            if progress {
                let its = (self.step - first) as f64 / start.elapsed().as_secs_f64();
                let mem = gpu_memory(&self.device);
                let done = self.step * 24 / n;
                let bar = format!("{}{}", "#".repeat(done), ".".repeat(24 - done));
                eprint!(
                    "\r[{bar}] step {}/{n} | loss {loss:.5} | {its:.2} it/s{mem}   ",
                    self.step
                );
            }
            let interrupted = self.interrupt.load(Ordering::Relaxed);
            if interrupted || self.step == n || (every > 0 && self.step % every == 0) {
                self.save_checkpoint()?;
            }
            if interrupted {
                if progress {
                    eprintln!();
                }
                return Ok(RunEnd::Interrupted(self.step));
            }
        }
        if progress {
            eprintln!();
        }
        if self.step == n {
            self.save_adapter(&out.join("lora.safetensors"))?;
            return Ok(RunEnd::Finished);
        }
        Ok(RunEnd::Stopped(self.step))
    }
}

/// " | GPU x GiB" in use on a CUDA device, "" on the CPU.
#[allow(irrefutable_let_patterns)]
fn gpu_memory(device: &Device) -> String {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(c) = device {
        let gib = c.memory().in_use as f64 / (1u64 << 30) as f64;
        return format!(" | GPU {gib:.2} GiB");
    }
    let _ = device;
    String::new()
}

/// The checkpoint folders in `out`, oldest first, with their steps.
pub fn checkpoints(out: &Path) -> Result<Vec<(usize, PathBuf)>> {
    let Ok(entries) = std::fs::read_dir(out) else {
        return Ok(vec![]);
    };
    let mut v: Vec<(usize, PathBuf)> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter_map(|p| {
            let name = p.file_name()?.to_str()?.to_string();
            let step = name.strip_prefix("checkpoint-")?.parse().ok()?;
            Some((step, p))
        })
        .collect();
    v.sort();
    Ok(v)
}

/// The loss log's lines with their steps (missing file: none).
pub fn read_log(path: &Path) -> Result<Vec<(usize, String)>> {
    let Ok(text) = std::fs::read_to_string(path) else {
        return Ok(vec![]);
    };
    Ok(text
        .lines()
        .filter_map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).ok()?;
            Some((v["step"].as_u64()? as usize, l.to_string()))
        })
        .collect())
}
