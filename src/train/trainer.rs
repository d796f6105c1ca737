//! The training loop behind `train`: a LoRA on any registered model family from pre-encoded
//! data, with AdamW, a warm-up + constant/cosine schedule, gradient accumulation and
//! clipping, a guard against non-finite losses and gradients, a JSONL loss log and atomic,
//! verified checkpoints that resume exactly. Every random draw (data order, noise,
//! timesteps, dropout) is a function of (seed, step), so a checkpoint needs only the step,
//! the adapter and the optimizer state.
//!
//! Steps count from 1: step k is the k-th optimizer step; the log's line for it says
//! `"step": k`, and `checkpoint-k` holds the state after it.

use super::config::{AdapterFormat, ModelDType, TrainConfig};
use super::data::{Batch, Dataset, Part, Samples};
use super::images::{self, ImageSamples};
use super::memory::{phase_plans, plan_memory, MemoryChoice, PhasePlan};
use super::objectives::{flow_matching, weighted_mse, Prediction};
use super::rundir::{
    read_log, write_atomic, CheckpointState, Manifest, RunDir, Survey, FINAL, LOG, PLOT, SAMPLES,
};
use super::scaler::LossScaler;
use crate::dist::{GradReducer, ProcessGroup, BUCKET_BYTES};
use crate::models::{self, DiffusionModel, LoadOptions, MemoryPlan, Objective};
use crate::nn::{Adapters, BatchPart, KeyMap, GOLDEN};
use crate::optim::{AdamConfig, AdamW, AdamW8bit, AdamW8bitConfig, Optimizer};
use crate::{sum_sq_multi, DType, Device, Error, Grads, Result, Tensor};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// A loaded model with its adapters, data and optimizer, ready to step.
pub struct Trainer {
    /// The checked config.
    pub config: TrainConfig,
    model: Box<dyn DiffusionModel>,
    map: KeyMap,
    /// The adapters being trained.
    pub adapters: Arc<Adapters>,
    data: Box<dyn Samples>,
    /// Held-out images for the validation loss.
    validation: Option<ImageSamples>,
    /// What sampling needs of the image pipeline (absent for pre-encoded data).
    pipeline: Option<PipelineParts>,
    opt: Box<dyn Optimizer>,
    /// The memory plan the model runs under, as chosen or configured.
    pub memory: MemoryChoice,
    device: Device,
    dtype: DType,
    /// Optimizer steps done (the next step is `step + 1`).
    pub step: usize,
    /// Non-finite steps skipped in a row up to `step`.
    skipped_in_row: usize,
    /// The dynamic loss scale (`train.loss_scale`), if any.
    pub scaler: Option<LossScaler>,
    run_id: String,
    /// Set (e.g. by a signal handler) to stop after the current step with a checkpoint.
    interrupt: Arc<AtomicBool>,
    /// Data-parallel training: the group, and the gradient sums over it.
    dist: Option<(Arc<dyn ProcessGroup>, Arc<GradReducer>)>,
    /// Whether any rank was interrupted by the last step (data-parallel training, where all
    /// ranks must stop after the same step).
    stop_all: bool,
    /// The next micro-batch (its index), fetched during the one before to announce its
    /// inputs to the model (`announce`).
    ahead: Option<(usize, Batch)>,
    /// The peak bytes in use on the device per phase of the run (GPU only).
    peaks: PhasePeaks,
    /// Each phase's plan and predicted peak, worked out at open.
    phases: Vec<PhasePlan>,
}

/// Where [`Trainer::open_in`] trains: the device (default: `train.device`'s) and, for
/// data-parallel training, the process group (on the group's GPU for NCCL).
#[derive(Clone, Default)]
pub struct Placement {
    /// The device; `None`: as `train.device` says (the first GPU for "cuda").
    pub device: Option<Device>,
    /// The process group of data-parallel training, if any.
    pub group: Option<Arc<dyn ProcessGroup>>,
    /// The flag a signal handler sets to stop: caching stops at the next image or caption
    /// ([`Error::Interrupted`]) and the run after the current step, with a checkpoint.
    /// `None`: a flag of the trainer's own ([`Trainer::interrupt_flag`]).
    pub interrupt: Option<Arc<AtomicBool>>,
}

/// The image pipeline's pieces sampling needs after the encoders are freed: the text cache
/// holding the prompts' embeddings, and where the autoencoder is.
struct PipelineParts {
    text: crate::data::TextCache,
    vae: crate::models::Located,
    factor: usize,
}

/// How [`Trainer::open`] prepares a run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Prepare {
    /// Fill the image caches (the normal start of a run).
    Encode,
    /// Work out shapes only; write nothing (`train --plan`).
    DryRun,
}

/// How `Trainer::run` ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RunEnd {
    /// All steps done; the final adapter is at this path.
    Finished(PathBuf),
    /// Stopped at the requested step (`RunOptions::stop_at`), without a checkpoint.
    Stopped(usize),
    /// Interrupted after this step; a checkpoint of it is at this path.
    Interrupted(usize, PathBuf),
}

/// What `Trainer::run` does with the output folder and how far it goes.
#[derive(Clone, Debug, Default)]
pub struct RunOptions {
    /// Continue from the newest intact checkpoint of the run in the output folder.
    pub resume: bool,
    /// Delete the run files of an earlier run in the output folder first.
    pub overwrite: bool,
    /// Stop after this step (tests of resuming).
    pub stop_at: Option<usize>,
}

/// One step's figures.
#[derive(Clone, Debug, PartialEq)]
pub struct StepReport {
    /// The step (from 1).
    pub step: usize,
    /// The steps of the run.
    pub steps: usize,
    /// The loss, averaged over micro-batches.
    pub loss: f64,
    /// The learning rate used.
    pub lr: f64,
    /// The global gradient norm before clipping.
    pub grad_norm: f64,
    /// Why the step was skipped (a non-finite loss or gradient), if it was.
    pub skipped: Option<String>,
}

/// What a run tells its caller as it goes.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// Something the user should know (a damaged checkpoint passed over, a resume point).
    Note(String),
    /// The validation loss after a step.
    Validation {
        /// The step.
        step: usize,
        /// The mean loss over the held-out samples at fixed timesteps and noise.
        loss: f64,
    },
    /// Sample images were written.
    Samples(Vec<PathBuf>),
    /// A step finished.
    Step(StepReport),
    /// A checkpoint was written.
    Saved(PathBuf),
}

/// What `decide` found: the folder action and, for a resume, the checkpoint to restore
/// (verified) and the ones passed over; the folder's survey.
struct Decision {
    action: FolderAction,
    from: Option<(PathBuf, CheckpointState)>,
    /// Checkpoints passed over (damaged, another run's), with why.
    passed: Vec<(PathBuf, String)>,
    survey: Survey,
}

/// What a run would do, from `Trainer::plan`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FolderAction {
    /// Start a new run in an empty or new folder.
    New,
    /// Delete these files of an earlier run, then start a new one.
    Overwrite(Vec<String>),
    /// Continue from this checkpoint (step, folder).
    Resume(usize, PathBuf),
    /// The run is already finished; only the final adapter is written if it is missing.
    AlreadyFinished(usize),
}

/// Fixed timesteps per held-out sample in [`Trainer::validation_loss`].
pub const VALIDATION_POINTS: usize = 4;

/// The name of the first tensor holding a NaN or an infinity: one host copy when all are
/// finite, one per tensor only to find the culprit.
fn first_nonfinite<'a>(tensors: &[(&'a str, &'a Tensor)]) -> Result<Option<String>> {
    let all: Vec<&Tensor> = tensors.iter().map(|(_, t)| *t).collect();
    if sum_sq_multi(&all)?.is_finite() {
        return Ok(None);
    }
    for (name, t) in tensors {
        if !sum_sq_multi(&[*t])?.is_finite() {
            return Ok(Some(name.to_string()));
        }
    }
    Ok(None)
}

/// Peak bytes in use on a GPU per phase of a run: [`PhasePeaks::start`] resets the
/// device's peak, [`PhasePeaks::end`] keeps the largest seen for the phase.
#[derive(Default)]
struct PhasePeaks(std::sync::Mutex<Vec<(&'static str, u64)>>);

impl PhasePeaks {
    /// A phase begins: its peak counts from here, and the data-parallel watchdog names it
    /// ([`crate::progress`]).
    fn start(&self, device: &Device, phase: &str) {
        crate::progress::set_phase(phase);
        #[cfg(feature = "cuda")]
        #[allow(irrefutable_let_patterns)]
        if let Device::Cuda(c) = device {
            c.reset_peak_memory();
        }
        let _ = device;
    }

    fn end(&self, device: &Device, phase: &'static str) {
        #[cfg(feature = "cuda")]
        if let (Device::Cuda(c), Ok(mut v)) = (device, self.0.lock()) {
            let peak = c.memory().peak;
            match v.iter_mut().find(|(p, _)| *p == phase) {
                Some((_, b)) => *b = (*b).max(peak),
                None => v.push((phase, peak)),
            }
        }
        let _ = (device, phase);
    }

    fn all(&self) -> Vec<(&'static str, u64)> {
        self.0.lock().map(|v| v.clone()).unwrap_or_default()
    }
}

/// The adapters made on a model's layers (`map`: its key map) can train and be saved as
/// `config` says: some layer matched, and a PEFT file can name every one.
fn check_adapters(config: &TrainConfig, adapters: &Adapters, map: &KeyMap) -> Result<()> {
    if adapters.layers()?.is_empty() {
        return Err(Error::Config {
            path: None,
            msg: format!(
                "adapter.targets = {:?} match no Linear layer (nor, with adapter.conv_rank, a \
                 convolution) of the model",
                config.adapter.targets
            ),
        });
    }
    if config.adapter.format == AdapterFormat::Peft {
        adapters.check_peft(map)?;
    }
    Ok(())
}

/// One sum of a reducer bucket's size and one of a single value over `group`, finished: the
/// group's transport is connected and its buffers allocated before memory is measured.
fn warm_collectives(group: &dyn ProcessGroup, device: &Device) -> Result<()> {
    if !group.asynchronous() {
        return Ok(());
    }
    // What caching left in FLAME's cache goes back to the driver first: NCCL allocates
    // with the driver, not through FLAME.
    #[cfg(feature = "cuda")]
    #[allow(irrefutable_let_patterns)]
    if let Device::Cuda(c) = device {
        c.release_cached()?;
    }
    for n in [BUCKET_BYTES / 4, 1] {
        let t = Tensor::zeros(n, DType::F32, device)?;
        group.all_reduce_sum(&[&t])?.wait()?;
        t.to_vec_f64()?;
    }
    Ok(())
}

impl Trainer {
    /// Checks the config, loads the model with its adapters and the data, and checks every
    /// sample; fills the image caches; writes nothing else. [`Trainer::open`] with [`Prepare::Encode`] and no notes.
    pub fn new(config: TrainConfig) -> Result<Trainer> {
        Self::open(config, Prepare::Encode, &mut |_| {})
    }

    /// As [`Trainer::new`], telling `on` about data preparation (skipped files, cache
    /// progress); with [`Prepare::DryRun`] the image caches are not filled (the trainer can
    /// then plan but not step).
    pub fn open(
        config: TrainConfig,
        prepare: Prepare,
        on: &mut dyn FnMut(Event),
    ) -> Result<Trainer> {
        Self::open_in(config, prepare, Placement::default(), on)
    }

    /// As [`Trainer::open`], on `place`'s device, as one rank of data-parallel training
    /// when it has a group:
    /// `train.batch_size` is then each rank's part of a global batch of `batch_size` ×
    /// ranks; every rank encodes its share of the image and caption caches (then reads the
    /// whole of them), and only rank 0 writes the run's files.
    pub fn open_in(
        config: TrainConfig,
        prepare: Prepare,
        place: Placement,
        on: &mut dyn FnMut(Event),
    ) -> Result<Trainer> {
        config.validate()?;
        config.check_paths()?;
        let m = &config.model;
        #[cfg(feature = "cuda")]
        if config.train.deterministic {
            crate::cuda::set_deterministic(true);
        }
        let device = match place.device {
            Some(d) => d,
            None => Device::by_name(&config.train.device)?,
        };
        let group = place.group;
        let interrupt = place.interrupt.unwrap_or_default();
        let world = group.as_ref().map_or(1, |g| g.world());
        let family = models::family(&m.arch)?;
        let mut json = None;
        if let Some(p) = &m.config {
            let text = std::fs::read_to_string(p).map_err(|source| Error::Io {
                path: p.clone(),
                source,
            })?;
            json = Some(serde_json::from_str(&text).map_err(|e| Error::Config {
                path: Some(p.clone()),
                msg: format!("model.config: invalid JSON: {e}"),
            })?);
        }
        let dtype = match m.dtype {
            ModelDType::F32 => DType::F32,
            ModelDType::F16 => DType::F16,
            ModelDType::Bf16 | ModelDType::Fp8 => DType::BF16,
        };
        let adapters = Adapters::new(config.adapter_config())?;
        let mut opts = LoadOptions {
            dtype,
            device: device.clone(),
            adapters: None,
            config: json,
            fp8: m.dtype == ModelDType::Fp8,
            memory: MemoryPlan::default(),
            merge: None,
        };
        let peaks = PhasePeaks::default();
        // The model's inputs and shape checks, and the adapters on its layers, first, from one
        // build without weights (on the CPU where the build has it; the adapters a set of
        // their own, dropped with the build): bad data, targets that match nothing, a rank a
        // layer cannot take, a PEFT layout the model cannot be given and an impossible memory
        // budget fail before any data is cached or weight read.
        let trial = Adapters::new(config.adapter_config())?;
        let built = family.probe(
            &m.path,
            &LoadOptions {
                adapters: Some(trial.clone()),
                device: Device::cpu_backend().unwrap_or_else(|_| device.clone()),
                ..opts.clone()
            },
        )?;
        check_adapters(&config, &trial, &built.key_map)?;
        // The builder and key map (holding the trial adapters) go here, the model stays.
        let probe = {
            let b = built;
            b.model
        };
        drop(trial);
        let guided = probe.guidance_input();
        let inputs = probe.inputs();
        let (data, validation, pipeline, vae_shape): (Box<dyn Samples>, _, _, _) = match &config
            .data
            .dir
        {
            Some(dir) => {
                let data = Dataset::open(dir, &inputs, &|s| probe.check_shapes(s))?;
                super::data::check_batch_size(&config, world, data.len(), "pre-encoded samples")?;
                (Box::new(data), None, None, None)
            }
            None => {
                peaks.start(&device, "caching");
                let run = images::prepare(
                    &config,
                    family,
                    &inputs,
                    guided,
                    &|s| probe.check_shapes(s),
                    &device,
                    prepare == Prepare::Encode,
                    world,
                    group.as_deref(),
                    &interrupt,
                    &mut |n| on(Event::Note(n)),
                )?;
                peaks.end(&device, "caching");
                probe
                    .check_shapes(&run.train.largest())
                    .map_err(|msg| Error::Config {
                        path: None,
                        msg: format!("[data]: {msg}"),
                    })?;
                let parts = PipelineParts {
                    text: run.text,
                    vae: run.vae,
                    factor: run.vae_factor,
                };
                let vae_shape = Some((run.vae_factor, run.vae_width));
                (Box::new(run.train), run.validation, Some(parts), vae_shape)
            }
        };
        drop(probe);
        opts.adapters = Some(adapters.clone());
        // NCCL sets up its connections and buffers at the first collective: one of a
        // bucket's size, now, puts them in the memory measured outside FLAME's allocator.
        if let Some(g) = &group {
            warm_collectives(g.as_ref(), &device)?;
        }
        let memory = plan_memory(&config, family, &opts, &device, &data.largest(), world)?;
        let phases = phase_plans(
            &config,
            family,
            &opts,
            &memory,
            &data.largest(),
            vae_shape,
            guided,
            &device,
            world,
        )?;
        if let Some(cap) = memory.budget {
            for p in phases.iter().filter(|p| p.peak.is_some_and(|b| b > cap)) {
                on(Event::Note(format!(
                    "{} may not fit memory.budget_gb: predicted up to {:.2} GiB of the {:.2} \
                     GiB FLAME's allocator may hold ({}); {}",
                    p.phase,
                    p.peak.unwrap_or(0) as f64 / (1u64 << 30) as f64,
                    cap as f64 / (1u64 << 30) as f64,
                    p.plan,
                    match p.phase {
                        "sample images" => "a smaller sample.size or encoders.vae_tile lowers it",
                        "caching" =>
                            "encoders.vae_tile = 512 and encoders.stream_t5 = \"on\" lower it",
                        _ => "a larger budget or a smaller batch lowers it",
                    }
                )));
            }
        }
        opts.memory = memory.plan.clone();
        let loaded = family.load(&m.path, &opts)?;
        let model = loaded.model;
        check_adapters(&config, &adapters, &loaded.key_map)?;
        let o = &config.optimizer;
        let adam = AdamConfig {
            lr: o.lr,
            beta1: o.betas[0],
            beta2: o.betas[1],
            eps: o.eps,
            weight_decay: o.weight_decay,
        };
        let opt: Result<Box<dyn Optimizer>> = if o.kind == "adamw8bit" {
            AdamW8bit::new(
                adapters.params()?,
                AdamW8bitConfig {
                    adam,
                    ..Default::default()
                },
            )
            .map(|o| Box::new(o) as Box<dyn Optimizer>)
        } else {
            AdamW::new(adapters.params()?, adam).map(|o| Box::new(o) as Box<dyn Optimizer>)
        };
        let opt = opt.map_err(|e| Error::Config {
            path: None,
            msg: format!("[optimizer]: {e}"),
        })?;
        let scaler = config.loss_scaler();
        let dist = match group {
            Some(g) => {
                let params = adapters.params()?.into_iter().map(|(_, t)| t).collect();
                let r = GradReducer::new(g.clone(), params, BUCKET_BYTES);
                Some((g, r))
            }
            None => None,
        };
        Ok(Trainer {
            config,
            memory,
            model,
            map: loaded.key_map,
            adapters,
            data,
            validation,
            pipeline,
            opt,
            device,
            dtype,
            step: 0,
            skipped_in_row: 0,
            scaler,
            run_id: String::new(),
            interrupt,
            dist,
            stop_all: false,
            ahead: None,
            peaks,
            phases,
        })
    }

    /// The process group of data-parallel training, if any.
    pub fn group(&self) -> Option<&Arc<dyn ProcessGroup>> {
        self.dist.as_ref().map(|(g, _)| g)
    }

    /// Whether this process writes the run's files (rank 0, or a single process).
    pub fn is_root(&self) -> bool {
        self.group().is_none_or(|g| g.rank() == 0)
    }

    /// The config's resume keys, and the number of ranks where there are several (the
    /// global batch depends on it).
    fn resume_keys(&self) -> Vec<(&'static str, String)> {
        resume_keys_of(&self.config, self.part().world)
    }

    /// This process's part of every global batch.
    fn part(&self) -> Part {
        match self.group() {
            Some(g) => Part {
                rank: g.rank(),
                world: g.world(),
            },
            None => Part::WHOLE,
        }
    }

    /// The device it trains on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The loaded model.
    pub fn model(&self) -> &dyn DiffusionModel {
        self.model.as_ref()
    }

    /// The training samples.
    pub fn data(&self) -> &dyn Samples {
        self.data.as_ref()
    }

    /// The flag that stops the run after the current step, with a checkpoint.
    pub fn interrupt_flag(&self) -> Arc<AtomicBool> {
        self.interrupt.clone()
    }

    fn run_dir(&self) -> RunDir {
        RunDir::new(&self.config.train.output_dir)
    }

    /// The loss of this process's rows of one batch of clean latents, noised with draws
    /// from `seed`: noise and timesteps are drawn for the whole global batch and the rows
    /// taken, so the ranks together see what one process would.
    fn loss(&self, batch: &Batch, seed: u64) -> Result<Tensor> {
        let x0 = &batch.inputs[0];
        let (b, mut dims) = (batch.global, x0.dims().to_vec());
        let (start, len) = (batch.rows.start, batch.rows.len());
        dims[0] = b;
        let noise = Tensor::randn(dims.clone(), DType::F32, &self.device, seed)?
            .narrow(0, start, len)?
            .to_dtype(self.dtype)?;
        let t = self.timesteps(batch, seed)?;
        self.loss_at(&batch.inputs, &t, &noise)
    }

    /// The timesteps of this process's rows of `batch`, drawn from `seed` for the whole global
    /// batch (as `loss` draws them).
    fn timesteps(&self, batch: &Batch, seed: u64) -> Result<Tensor> {
        let dims = batch.inputs[0].dims();
        let b = batch.global;
        let t = match self.model.objective() {
            Objective::FlowMatching => {
                // Flux's resolution-dependent shift counts 2x2 latent patches as tokens.
                let tokens = dims[2] * dims[3] / 4;
                self.config
                    .sampling()?
                    .sample(b, tokens, seed ^ 0x7133, &self.device)?
            }
            Objective::Ddpm(ddpm) => ddpm.sample_timesteps(b, seed ^ 0x7133, &self.device)?,
        };
        t.narrow(0, batch.rows.start, batch.rows.len())
    }

    /// The counters of the model's block streamer, when blocks are streamed.
    pub fn stream_report(&self) -> Result<Option<crate::stream::StreamReport>> {
        self.model
            .exec()
            .streamer
            .as_ref()
            .map(|s| s.report())
            .transpose()
    }

    /// The seed of micro-batch `m`'s noise and timesteps.
    fn micro_seed(&self, m: usize) -> u64 {
        self.config.train.seed ^ (m as u64 + 1).wrapping_mul(GOLDEN)
    }

    /// Micro-batch `m`: the one fetched ahead when it is that one, else read now.
    fn micro_batch(&mut self, m: usize, part: Part) -> Result<Batch> {
        let t = &self.config.train;
        match self.ahead.take() {
            Some((k, batch)) if k == m => Ok(batch),
            _ => self.data.batch(
                m,
                t.batch_size * part.world,
                t.seed,
                part,
                self.dtype,
                &self.device,
            ),
        }
    }

    /// Fetches micro-batch `m` and announces its inputs to the model
    /// (`DiffusionModel::prepare`): called between a micro-batch's forward and its backward
    /// where the model computes conditioning products on the host
    /// (`MemoryPlan::host_products`), which it then does during that backward instead of in
    /// `m`'s forward.
    fn announce(&mut self, m: usize, part: Part) -> Result<()> {
        let batch = self.micro_batch(m, part)?;
        if !batch.inputs.is_empty() {
            let t = self.timesteps(&batch, self.micro_seed(m))?;
            let guidance = self.config.model.guidance;
            self.model
                .prepare(&batch.inputs[0], &t, &batch.inputs[1..], guidance)?;
        }
        self.ahead = Some((m, batch));
        Ok(())
    }

    /// What the model is trained to predict (DDPM models).
    fn prediction(&self) -> Prediction {
        if self.config.model.prediction == "v" {
            Prediction::V
        } else {
            Prediction::Epsilon
        }
    }

    /// The loss of one batch of clean latents at timesteps `t` (B) with `noise`.
    fn loss_at(&self, batch: &[Tensor], t: &Tensor, noise: &Tensor) -> Result<Tensor> {
        let x0 = &batch[0];
        let cond = &batch[1..];
        let guidance = self.config.model.guidance;
        match self.model.objective() {
            Objective::FlowMatching => {
                let (xt, target) = flow_matching(x0, noise, t)?;
                let pred = self.model.predict(&xt, t, cond, guidance)?;
                weighted_mse(&pred, &target, None)
            }
            Objective::Ddpm(ddpm) => {
                let kind = self.prediction();
                let (xt, target) = ddpm.noisy_and_target(x0, noise, t, kind)?;
                let pred = self.model.predict(&xt, t, cond, guidance)?;
                let gamma = self.config.train.min_snr_gamma;
                let w = if gamma > 0.0 {
                    Some(ddpm.min_snr_weights(t, gamma, kind)?)
                } else {
                    None
                };
                weighted_mse(&pred, &target, w.as_ref())
            }
        }
    }

    /// The validation loss: each held-out sample at [`VALIDATION_POINTS`] fixed timesteps
    /// spread over the noise range, with noise drawn from the seed and the sample's id, its
    /// caption as written, no adapter dropout; averaged. The same number for the same
    /// adapter in any run. `None` without held-out images.
    pub fn validation_loss(&self) -> Result<Option<f64>> {
        let Some(v) = &self.validation else {
            return Ok(None);
        };
        let _g = crate::no_grad();
        let was = self.adapters.training();
        self.adapters.set_train(false);
        let result = (|| {
            let k = VALIDATION_POINTS;
            let mid = |j: usize| (j as f64 + 0.5) / k as f64;
            let t: Vec<f32> = match self.model.objective() {
                Objective::FlowMatching => (0..k).map(|j| mid(j) as f32).collect(),
                Objective::Ddpm(d) => (0..k)
                    .map(|j| (mid(j) * d.steps() as f64).floor() as f32)
                    .collect(),
            };
            let t = Tensor::from_vec(t, k, &self.device)?;
            // The timesteps go through the model in batches no larger than a training
            // micro-batch, so the validation forward fits where the step does.
            let rows = self.config.train.batch_size.clamp(1, k);
            let mut total = 0.0;
            for i in 0..v.ds.len() {
                let batch = v.inputs(&[i], 0, true, self.dtype, &self.device)?;
                let seed = self.config.train.seed ^ v.ds.sample(i)?.id ^ 0x7A1;
                let mut dims = batch.inputs[0].dims().to_vec();
                dims[0] = k;
                let noise =
                    Tensor::randn(dims, DType::F32, &self.device, seed)?.to_dtype(self.dtype)?;
                let mut sum = 0.0;
                for start in (0..k).step_by(rows) {
                    crate::progress::tick();
                    let n = rows.min(k - start);
                    let rep = batch
                        .inputs
                        .iter()
                        .map(|x| Tensor::cat(&vec![x; n], 0))
                        .collect::<Result<Vec<_>>>()?;
                    let loss =
                        self.loss_at(&rep, &t.narrow(0, start, n)?, &noise.narrow(0, start, n)?)?;
                    sum += loss.to_scalar_f64()? * n as f64;
                }
                total += sum / k as f64;
            }
            Ok(total / v.ds.len().max(1) as f64)
        })();
        self.adapters.set_train(was);
        result.map(Some)
    }

    /// Makes the `[sample]` images with the adapter as it is now and writes them to
    /// `samples/step-<step>-<i>.png` in the output folder: the prompts' embeddings from the
    /// text cache, the noise of prompt i from `sample.seed + i`, the family's sampler, the
    /// autoencoder loaded for the decode and freed. Needs image data (the caches); nothing
    /// without prompts.
    pub fn sample_images(&self) -> Result<Vec<PathBuf>> {
        let sc = &self.config.sample;
        if sc.prompts.is_empty() {
            return Ok(vec![]);
        }
        let Some(parts) = &self.pipeline else {
            return Err(Error::Config {
                path: None,
                msg: "[sample]: sampling needs image data (data.dirs or data.manifest), which \
                      brings the text encoders and the autoencoder"
                    .into(),
            });
        };
        let _g = crate::no_grad();
        let was = self.adapters.training();
        self.adapters.set_train(false);
        let result = (|| {
            let family = self.model.family();
            let res = self.config.data.resolution;
            let (w, h) = match sc.size {
                [0, 0] => (res, res),
                [w, h] => (w, h),
            };
            let inputs = self.model.inputs();
            let text = |prompt: &str| -> Result<Vec<Tensor>> {
                let cached =
                    parts
                        .text
                        .load_batch(&[prompt.to_string()], &self.device, self.dtype)?;
                crate::models::pipeline::conditioning(
                    &inputs,
                    &cached,
                    (h, w),
                    self.dtype,
                    &self.device,
                )
            };
            let conds = sc
                .prompts
                .iter()
                .map(|p| text(p))
                .collect::<Result<Vec<_>>>()?;
            let req = crate::sample::Request {
                steps: sc.steps,
                guidance: sc.guidance,
                latent_hw: (h / parts.factor, w / parts.factor),
                seed: sc.seed,
                prediction: self.prediction(),
                batched_guidance: super::memory::guidance_batched(&self.config),
            };
            let uncond = Some(text(&sc.negative_prompt)?);
            let latents =
                crate::sample::generate(self.model.as_ref(), &conds, uncond, &req, &self.device)?;
            let mut vae = images::vae(&self.config, family, &parts.vae, self.dtype, &self.device)?;
            let tile = images::decode_tile(
                self.config.encoders.vae_tile,
                self.config.memory.budget_gb > 0.0,
            );
            if tile > 0 {
                vae.tiling = Some(crate::encoders::VaeTiling::new(tile));
            }
            let run = self.run_dir();
            let dir = run.path.join(SAMPLES);
            std::fs::create_dir_all(&dir).map_err(|source| Error::Io {
                path: dir.clone(),
                source,
            })?;
            let mut written = vec![];
            for (i, z) in latents.iter().enumerate() {
                let img = vae.decode_latents(&z.to_dtype(self.dtype)?)?;
                let rel = sample_name(self.step, i);
                let path = run.path.join(&rel);
                crate::data::save_png(&img.squeeze(0)?, &path)?;
                if self.is_root() {
                    run.record(&rel, Some(self.step), false)?;
                }
                written.push(path);
            }
            Ok(written)
        })();
        self.adapters.set_train(was);
        result
    }

    /// Redraws `loss.png` from the loss log (training and validation loss against step).
    fn plot(&self) -> Result<()> {
        let dir = self.run_dir();
        let (mut train, mut val) = (vec![], vec![]);
        for (step, line) in read_log(&dir.path.join(LOG))? {
            let v: serde_json::Value = serde_json::from_str(&line).unwrap_or_default();
            if let Some(l) = v.get("loss").and_then(|x| x.as_f64()) {
                train.push((step, l));
            }
            if let Some(l) = v.get("val_loss").and_then(|x| x.as_f64()) {
                val.push((step, l));
            }
        }
        crate::data::plot_loss(&train, &val, 640, 400, dir.path.join(PLOT))?;
        dir.record(PLOT, None, false)
    }

    /// One optimizer step (with its accumulated micro-batches). A non-finite loss or
    /// gradient norm stops with an error naming the step, the batch's files and the tensor,
    /// or (`train.on_nonfinite = "skip"`) skips the update.
    pub fn train_step(&mut self) -> Result<StepReport> {
        self.peaks
            .start(&self.device, &format!("training step {}", self.step + 1));
        crate::fault::point("step").map_err(|source| Error::Io {
            path: format!("step {}", self.step + 1).into(),
            source,
        })?;
        let r = self.step_inner().map_err(|e| self.memory.explain(e));
        self.peaks.end(&self.device, "training steps");
        r
    }

    /// Each phase's plan and predicted peak in FLAME's allocator (caching, training steps,
    /// validation, sample images, checkpoints), as worked out when the trainer opened.
    pub fn phase_plans(&self) -> &[PhasePlan] {
        &self.phases
    }

    /// The peak bytes FLAME's allocator held in use on the GPU in each phase of this
    /// process's run so far ("caching", "training steps", "validation", "sample images",
    /// "checkpoints"), in the order first met; empty on the CPU.
    pub fn phase_peaks(&self) -> Vec<(&'static str, u64)> {
        self.peaks.all()
    }

    fn step_inner(&mut self) -> Result<StepReport> {
        let (acc, max_skipped) = (self.config.train.grad_accum, self.config.train.max_skipped);
        let lr = self.config.lr_at(self.step);
        self.opt.set_learning_rate(lr);
        let mut grads = Grads::new();
        let mut total = 0.0;
        let mut files: Vec<String> = vec![];
        let mut bad: Option<String> = None;
        // Dynamic loss scaling: the backward runs on loss * scale, the step divides by it.
        let scale = self.scaler.map_or(1.0, |s| s.scale);
        let part = self.part();
        let reducer = self.dist.as_ref().map(|(_, r)| r.clone());
        if let Some(r) = &reducer {
            grads.set_hook(Some(r.clone()));
        }
        // Host-held conditioning products are computed ahead, during the backward before.
        let announce = self.memory.plan.host_products && self.memory.plan.stream_blocks > 0;
        for micro in 0..acc {
            crate::progress::tick();
            // A signal in a long accumulation stops between micro-batches (one process: the
            // ranks of a group agree on a stop at the step's end instead); the step is dropped.
            if micro > 0 && self.dist.is_none() && self.interrupt.load(Ordering::Relaxed) {
                return Err(Error::Interrupted(format!(
                    "during step {} after {micro} of its {acc} micro-batches (the step is \
                     dropped)",
                    self.step + 1
                )));
            }
            let m = self.step * acc + micro;
            let batch = self.micro_batch(m, part)?;
            files.extend(batch.files.iter().cloned());
            if micro + 1 == acc {
                // The last backward of the step starts the gradient sums over the ranks.
                if let Some(r) = &reducer {
                    r.arm()?;
                }
            }
            if batch.inputs.is_empty() {
                // This rank has no rows of a short last batch: it adds zeros.
                continue;
            }
            let part = BatchPart {
                start: batch.rows.start,
                len: batch.rows.len(),
                global: batch.global,
            };
            self.adapters
                .set_batch(self.step as u64, micro as u64, part)?;
            let s = self.micro_seed(m);
            // Each rank's mean over its rows, weighted by its share of the global batch:
            // the ranks' sum is the global batch's mean.
            let w = batch.rows.len() as f64 / batch.global.max(1) as f64 / acc as f64;
            let loss = self.loss(&batch, s)?.affine(w, 0.0)?;
            if announce && m + 1 < self.config.train.steps * acc {
                // Best effort: where the announcement fails (the next batch unreadable, no
                // page-locked memory), that micro-batch reads its data and computes its
                // products in its own turn, which reports any error that persists.
                if self.announce(m + 1, self.part()).is_err() {
                    self.ahead = None;
                }
            }
            let value = loss.to_scalar_f64()?;
            total += value;
            if !value.is_finite() {
                // Inputs that were not finite before the model ran: the data, not training.
                let names: Vec<String> = self
                    .model
                    .inputs()
                    .iter()
                    .map(|i| i.name.to_string())
                    .collect();
                let named: Vec<(&str, &Tensor)> = names
                    .iter()
                    .map(String::as_str)
                    .zip(batch.inputs.iter())
                    .collect();
                bad = Some(match first_nonfinite(&named)? {
                    Some(input) => format!(
                        "the input {input} of micro-batch {} holds a NaN or an infinity as \
                         read from the data (the files below, before the model ran): delete \
                         those cache entries or samples to make them again",
                        micro + 1
                    ),
                    None => format!("the loss of micro-batch {} is {value}", micro + 1),
                });
                if reducer.is_none() {
                    break;
                }
                // The other ranks go on to the gradient sums: so does this one.
                continue;
            }
            if scale == 1.0 {
                loss.backward_into(&mut grads)?;
            } else {
                loss.affine(scale, 0.0)?.backward_into(&mut grads)?;
            }
        }
        grads.set_hook(None);
        if let Some((g, r)) = &self.dist {
            r.finish(&mut grads)?;
            // Every rank agrees on the loss, on a non-finite loss anywhere and on a stop.
            let mut v = [
                total,
                f64::from(u8::from(bad.is_some())),
                f64::from(u8::from(self.interrupt.load(Ordering::Relaxed))),
            ];
            g.sum_host(&mut v)?;
            total = v[0];
            if bad.is_none() && v[1] > 0.0 {
                bad = Some(format!(
                    "the loss is not finite on {} of {} ranks",
                    v[1], part.world
                ));
            }
            self.stop_all = v[2] > 0.0;
        }
        let params = self.adapters.params()?;
        let with_grads: Vec<(&str, &Tensor)> = params
            .iter()
            .filter_map(|(n, p)| Some((n.as_str(), grads.get(p)?)))
            .collect();
        let mut norm = f64::NAN;
        let mut overflow = false;
        if bad.is_none() {
            let gs: Vec<&Tensor> = with_grads.iter().map(|(_, g)| *g).collect();
            norm = sum_sq_multi(&gs)?.sqrt() / scale;
            if !norm.is_finite() {
                match &mut self.scaler {
                    // The loss was finite: the scaled gradients overflowed f16.
                    Some(sc) if sc.can_back_off() => {
                        overflow = true;
                        sc.overflowed();
                    }
                    _ => {
                        bad = Some(match first_nonfinite(&with_grads)? {
                            Some(n) => {
                                format!("the gradient of {n} is not finite (gradient norm {norm})")
                            }
                            None => format!("the gradient norm is {norm}"),
                        })
                    }
                }
            }
        }
        let step = self.step + 1;
        let steps = self.config.train.steps;
        let mut report = StepReport {
            step,
            steps,
            loss: total,
            lr,
            grad_norm: norm,
            skipped: None,
        };
        if overflow {
            // GradScaler's skipped step: no update, the scale halved; not a failure.
            self.step = step;
            let now = self.scaler.map_or(1.0, |s| s.scale);
            report.skipped = Some(format!(
                "the f16 gradients overflowed at loss scale {scale}; the scale is now {now}"
            ));
            return Ok(report);
        }
        if let Some(what) = bad {
            let names = files;
            if self.config.train.on_nonfinite == "stop" || self.skipped_in_row + 1 > max_skipped {
                let why = if self.config.train.on_nonfinite == "stop" {
                    "train.on_nonfinite = \"stop\"".to_string()
                } else {
                    format!(
                        "{} steps skipped in a row (train.max_skipped)",
                        max_skipped + 1
                    )
                };
                return Err(Error::NonFinite {
                    step,
                    what,
                    files: names,
                    why,
                });
            }
            self.skipped_in_row += 1;
            self.step = step;
            report.skipped = Some(what);
            return Ok(report);
        }
        // Clipping and unscaling, folded into the optimizer's fused update.
        let max = self.config.train.max_grad_norm;
        let clip = if max > 0.0 && norm > max {
            max / (norm + 1e-6)
        } else {
            1.0
        };
        self.opt.step_scaled(&grads, clip / scale)?;
        if let Some(sc) = &mut self.scaler {
            sc.clean();
        }
        self.skipped_in_row = 0;
        self.step = step;
        Ok(report)
    }

    /// The layout of the adapter in checkpoints: the configured one, but "kohya" for
    /// "comfyui", whose DoRA magnitudes would not read back bit for bit (a resume is exact).
    fn checkpoint_format(&self) -> AdapterFormat {
        match self.config.adapter.format {
            AdapterFormat::Comfyui => AdapterFormat::Kohya,
            f => f,
        }
    }

    /// Writes the adapter in `format`, refusing one with a non-finite value.
    fn save_adapter(&self, path: &Path, format: AdapterFormat) -> Result<()> {
        let params = self.adapters.params()?;
        let named: Vec<(&str, &Tensor)> = params.iter().map(|(n, t)| (n.as_str(), t)).collect();
        if let Some(name) = first_nonfinite(&named)? {
            return Err(Error::NonFinite {
                step: self.step,
                what: format!("adapter weight {name}"),
                files: vec![],
                why: format!("refusing to write {}", path.display()),
            });
        }
        match format {
            AdapterFormat::Kohya => self.adapters.save_kohya(path, DType::F32),
            AdapterFormat::Peft => {
                let prefix = self.model.family().subfolder;
                self.adapters.save_peft(path, &self.map, prefix, DType::F32)
            }
            AdapterFormat::Comfyui => {
                self.adapters
                    .save_comfyui(path, DType::F32, &self.base_weights()?)
            }
        }
    }

    fn load_adapter(&self, path: &Path, format: AdapterFormat) -> Result<()> {
        match format {
            AdapterFormat::Kohya => self.adapters.load_kohya(path),
            AdapterFormat::Peft => {
                let prefix = self.model.family().subfolder;
                self.adapters.load_peft(path, &self.map, prefix)
            }
            AdapterFormat::Comfyui => self.adapters.load_comfyui(path, &self.base_weights()?),
        }
    }

    /// The frozen weight of the layer at a path, read from the model's files as ComfyUI will
    /// have it (f32, memory-mapped; on the CPU backend where the build has it, else on the
    /// run's device), for the "comfyui" layout. Each call reads through a builder of its own,
    /// which keeps nothing once the weight is returned: one layer's weight is held at a time.
    fn base_weights(&self) -> Result<impl Fn(&str) -> Result<Tensor> + '_> {
        let m = &self.config.model;
        let device = Device::cpu_backend().unwrap_or_else(|_| self.device.clone());
        let ckpt = models::Checkpoint::open(&m.path, self.model.family().subfolder)?;
        Ok(move |path: &str| {
            let vb = ckpt.var_builder(DType::F32, &device, self.map.clone())?;
            let name = format!("{path}.weight");
            let shape = vb.shape_of(&name).ok_or_else(|| Error::Config {
                path: Some(m.path.clone()),
                msg: format!("the model holds no {name} for the \"comfyui\" layout"),
            })?;
            vb.get(shape, &name)
        })
    }

    /// Writes `checkpoint-<step>/` (adapter, optimizer state, `state.json` with each file's
    /// size and hash) atomically, then deletes this run's older checkpoints beyond
    /// `train.keep_last`.
    pub fn save_checkpoint(&self) -> Result<PathBuf> {
        self.peaks.start(&self.device, "checkpoint");
        let r = self.write_checkpoint();
        self.peaks.end(&self.device, "checkpoints");
        r
    }

    fn write_checkpoint(&self) -> Result<PathBuf> {
        let keep = self.config.train.keep_last;
        let state = (
            self.config.train.seed,
            self.run_id.as_str(),
            self.skipped_in_row,
            self.scaler.map(|s| (s.scale, s.clean_steps)),
        );
        self.run_dir()
            .save_checkpoint(self.step, state, keep, |tmp| {
                self.save_adapter(&tmp.join("adapter.safetensors"), self.checkpoint_format())?;
                self.opt.save_state(&tmp.join("optimizer.safetensors"))?;
                // The loss log up to this step: a resume restores it from here when the
                // folder's log lost lines.
                let log = self.run_dir().path.join(LOG);
                let text: String = read_log(&log)?
                    .into_iter()
                    .filter(|(s, _)| *s <= self.step)
                    .map(|(_, l)| l + "\n")
                    .collect();
                write_atomic(&tmp.join(LOG), text.as_bytes())?;
                Ok(vec!["adapter.safetensors", "optimizer.safetensors", LOG])
            })
            .and_then(|p| {
                self.run_dir().record(LOG, None, true)?;
                Ok(p)
            })
    }

    /// Restores the adapter, optimizer state and step from `dir`, after checking its files
    /// against the sizes and hashes recorded when it was written.
    pub fn load_checkpoint(&mut self, dir: &Path) -> Result<()> {
        let st = CheckpointState::read_verified(dir)?;
        self.restore(dir, &st)
    }

    /// Restores from `dir`, whose files `st` has verified.
    fn restore(&mut self, dir: &Path, st: &CheckpointState) -> Result<()> {
        if st.seed != self.config.train.seed {
            return Err(Error::Checkpoint {
                path: dir.to_path_buf(),
                msg: format!(
                    "saved with train.seed = {}, the config has {}",
                    st.seed, self.config.train.seed
                ),
            });
        }
        self.load_adapter(&dir.join("adapter.safetensors"), self.checkpoint_format())?;
        self.opt.load_state(&dir.join("optimizer.safetensors"))?;
        self.step = st.step;
        self.skipped_in_row = st.skipped_in_row;
        // A run that scales resumes at the saved scale (a checkpoint without one, from a
        // run that did not scale, starts at the configured initial scale).
        self.scaler = self.config.loss_scaler().map(|mut s| {
            if let Some((scale, clean)) = st.loss_scale {
                s.scale = scale;
                s.clean_steps = clean;
            }
            s
        });
        Ok(())
    }

    /// Decides what `run` would do with the output folder, checking everything it can
    /// without writing: another run's files without `overwrite` or `resume`, files at a
    /// run's names that no run recorded, a resume with no run to resume or whose config
    /// differs in a key that matters, a checkpoint past `train.steps`.
    pub fn plan(&self, opts: &RunOptions) -> Result<FolderAction> {
        decide(&self.config, self.part().world, opts).map(|d| d.action)
    }

    /// Runs to `train.steps` (or `opts.stop_at`): prepares the output folder as
    /// [`Trainer::plan`] decides, logs each step to `loss.jsonl`, saves checkpoints and the
    /// final adapter, and tells `on` about notes, steps and saves. The checkpoint of a step
    /// (and at the last step the final adapter) is written before that step's validation,
    /// samples and plot, so a failure in one of those loses no training: it is an
    /// [`Error::Phase`], and `--resume` then does only the phases still missing.
    ///
    /// In data-parallel training every rank calls it: rank 0 decides and prepares the
    /// folder, every other rank starts where rank 0 does (reading the same checkpoint: the
    /// output folder must be one every rank can read), the adapter is broadcast from rank 0,
    /// and only rank 0 writes the log, checkpoints, samples and the final adapter.
    pub fn run(&mut self, opts: &RunOptions, on: &mut dyn FnMut(Event)) -> Result<RunEnd> {
        let root = self.is_root();
        let dir = self.run_dir();
        let log_path = dir.path.join(LOG);
        let n = self.config.train.steps;
        let action = match root {
            true => self.prepare_folder(opts, on)?,
            false => FolderAction::New,
        };
        if let Some(g) = self.group().cloned() {
            // Rank 0's starting step on every rank.
            let mut v = [if root { self.step as f64 } else { 0.0 }];
            g.sum_host(&mut v)?;
            let step = v[0] as usize;
            if !root {
                self.step = 0;
                self.skipped_in_row = 0;
                if step > 0 {
                    let path = dir.checkpoint_dir(step);
                    let st = CheckpointState::read_verified(&path).map_err(|e| {
                        Error::Dist(format!(
                            "rank {} cannot read the checkpoint rank 0 resumes from ({e}); \
                             train.output_dir must be a folder every rank reads",
                            g.rank()
                        ))
                    })?;
                    self.restore(&path, &st)?;
                }
            }
            let params: Vec<Tensor> = self
                .adapters
                .params()?
                .into_iter()
                .map(|(_, t)| t)
                .collect();
            g.broadcast(&params.iter().collect::<Vec<_>>())?;
        }
        let mut log = match root {
            false => None,
            true => Some(
                std::fs::OpenOptions::new()
                    .append(true)
                    .open(&log_path)
                    .map_err(|source| Error::Io {
                        path: log_path.clone(),
                        source,
                    })?,
            ),
        };
        let fin = dir.path.join(FINAL);
        if root && self.step > 0 {
            // A resume: the final adapter of a finished run is the one of its last step, and
            // the phases due at the step it resumes from are done if they are missing.
            if self.step == n && !self.final_is_current()? {
                self.save_final()?;
            }
            let due = self.due_at(self.step, true);
            let missing = Due {
                validation: due.validation && !self.validated_in_log(self.step)?,
                samples: due.samples && !self.samples_written(self.step)?,
                plot: due.plot,
            };
            if missing.validation || missing.samples {
                on(Event::Note(format!(
                    "doing what step {} still lacks: {}",
                    self.step,
                    missing.describe()
                )));
            }
            self.phases(missing, true, log.as_mut(), on)?;
        }
        if matches!(action, FolderAction::AlreadyFinished(_)) {
            return Ok(RunEnd::Finished(fin));
        }
        let every = self.config.train.save_every;
        let end = opts.stop_at.unwrap_or(n).min(n);
        while self.step < end {
            let r = match self.train_step() {
                // Stopped inside a step: the steps done so far are saved.
                Err(Error::Interrupted(why)) if self.step > 0 => {
                    on(Event::Note(format!("interrupted {why}")));
                    let p = self.save_checkpoint()?;
                    on(Event::Saved(p.clone()));
                    return Ok(RunEnd::Interrupted(self.step, p));
                }
                r => r?,
            };
            let mut line = serde_json::json!({
                "step": r.step, "loss": r.loss, "lr": r.lr, "grad_norm": r.grad_norm
            });
            if let Some(why) = &r.skipped {
                line["skipped"] = why.clone().into();
            }
            if let Some(log) = &mut log {
                crate::fault::point("log-append")
                    .and_then(|()| writeln!(log, "{line}"))
                    .and_then(|()| log.flush())
                    .map_err(|source| Error::Io {
                        path: log_path.clone(),
                        source,
                    })?;
            }
            on(Event::Step(r));
            let interrupted = match self.dist {
                Some(_) => self.stop_all,
                None => self.interrupt.load(Ordering::Relaxed),
            };
            let save = interrupted || self.step == n || (every > 0 && self.step % every == 0);
            if save {
                let p = match root {
                    true => {
                        let p = self.save_checkpoint()?;
                        if self.step == n {
                            self.save_final()?;
                        }
                        on(Event::Saved(p.clone()));
                        p
                    }
                    false => dir.checkpoint_dir(self.step),
                };
                if let Some(g) = self.group() {
                    g.barrier()?;
                }
                if interrupted {
                    return Ok(RunEnd::Interrupted(self.step, p));
                }
            }
            if root {
                let due = self.due_at(self.step, save);
                self.phases(due, save, log.as_mut(), on)?;
            }
        }
        if let Some(g) = self.group() {
            g.barrier()?;
        }
        Ok(match self.step == n {
            true => RunEnd::Finished(fin),
            false => RunEnd::Stopped(self.step),
        })
    }

    /// What is due after `step` (`saved`: a checkpoint of it was written).
    fn due_at(&self, step: usize, saved: bool) -> Due {
        let n = self.config.train.steps;
        let ve = self.config.train.validate_every;
        let se = self.config.sample.every;
        Due {
            validation: self.validation.is_some()
                && match ve {
                    0 => saved,
                    _ => step % ve == 0 || step == n,
                },
            samples: !self.config.sample.prompts.is_empty()
                && (step == n || (se > 0 && step % se == 0)),
            plot: saved && self.pipeline.is_some(),
        }
    }

    /// Does the phases `due` after the current step: the validation loss (logged), the
    /// sample images and the loss plot, each recorded as the run's. A failure saves a
    /// checkpoint of the step first, if none was (`saved`), and says which phase failed,
    /// what is saved and what to change.
    fn phases(
        &mut self,
        due: Due,
        saved: bool,
        mut log: Option<&mut std::fs::File>,
        on: &mut dyn FnMut(Event),
    ) -> Result<()> {
        let step = self.step;
        let dir = self.run_dir();
        let log_path = dir.path.join(LOG);
        let validated = (|| -> Result<()> {
            if !due.validation {
                return Ok(());
            }
            self.peaks.start(&self.device, "validation");
            let loss = self.validation_loss();
            self.peaks.end(&self.device, "validation");
            let (Some(loss), Some(log)) = (loss?, log.as_mut()) else {
                return Ok(());
            };
            let line = serde_json::json!({"step": step, "val_loss": loss});
            writeln!(log, "{line}")
                .and_then(|()| log.flush())
                .map_err(|source| Error::Io {
                    path: log_path.clone(),
                    source,
                })?;
            on(Event::Validation { step, loss });
            Ok(())
        })();
        let sampled = validated.as_ref().ok().map(|_| -> Result<()> {
            if due.samples {
                self.peaks.start(&self.device, "sample images");
                let written = self.sample_images();
                self.peaks.end(&self.device, "sample images");
                let written = written?;
                if !written.is_empty() {
                    on(Event::Samples(written));
                }
            }
            Ok(())
        });
        let plotted = match (&validated, &sampled) {
            (Ok(()), Some(Ok(()))) if due.plot => self.plot(),
            _ => Ok(()),
        };
        let (phase, error) = match (validated, sampled, plotted) {
            (Err(e), _, _) => ("validation", e),
            (_, Some(Err(e)), _) => ("sample images", e),
            (_, _, Err(e)) => ("the loss plot", e),
            _ => return Ok(()),
        };
        // Nothing trained is lost: the step's checkpoint, if it has none yet.
        let mut saved_what = vec![];
        let checkpoint = match saved {
            true => Ok(dir.checkpoint_dir(step)),
            false => self.save_checkpoint(),
        };
        match &checkpoint {
            Ok(p) => saved_what.push(format!("{} holds step {step}", p.display())),
            Err(e) => saved_what.push(format!("the checkpoint of step {step} failed too: {e}")),
        }
        if step == self.config.train.steps && dir.path.join(FINAL).is_file() {
            saved_what.push(format!(
                "the final adapter is {}",
                dir.path.join(FINAL).display()
            ));
        }
        let knob = match phase {
            "validation" => {
                "the validation loss runs every held-out image at 4 timesteps under the \
                 step's memory plan: give it room (a larger memory.budget_gb, fewer or \
                 smaller held-out images) or turn it off (train.validate_every = 0 with no \
                 data.validation_split or data.validation_dir)"
                    .to_string()
            }
            "sample images" => {
                let [w, h] = self.config.sample.size;
                format!(
                    "sampling denoises {} prompt(s) at {} and decodes them in tiles under a \
                     budget: lower sample.size, or turn it off (sample.prompts = [])",
                    self.config.sample.prompts.len(),
                    match (w, h) {
                        (0, 0) => format!("data.resolution = {}", self.config.data.resolution),
                        _ => format!("sample.size = [{w}, {h}]"),
                    }
                )
            }
            _ => "see the error above (the output folder's disk space or permissions)".into(),
        };
        Err(Error::Phase {
            phase,
            step,
            error: Box::new(error),
            saved: saved_what.join("; "),
            hint: format!(
                "{knob}; then run again with --resume: it does the missing phases without \
                 training again"
            ),
        })
    }

    /// Whether `lora.safetensors` is the one this run wrote at its last step (recorded in
    /// `run.json` with that step, and unchanged since).
    fn final_is_current(&self) -> Result<bool> {
        let dir = self.run_dir();
        let Some(m) = dir.manifest()? else {
            return Ok(false);
        };
        Ok(m.files.get(FINAL).is_some_and(|r| {
            r.step == Some(self.config.train.steps) && r.matches(&dir.path.join(FINAL))
        }))
    }

    /// Writes the final adapter of the current step and records it as this run's.
    fn save_final(&self) -> Result<()> {
        let dir = self.run_dir();
        self.save_adapter(&dir.path.join(FINAL), self.config.adapter.format)?;
        dir.record(FINAL, Some(self.step), false)
    }

    /// Whether the loss log has a validation line for `step`.
    fn validated_in_log(&self, step: usize) -> Result<bool> {
        Ok(read_log(&self.run_dir().path.join(LOG))?
            .iter()
            .any(|(s, l)| *s == step && l.contains("\"val_loss\"")))
    }

    /// Whether every sample image of `step` is written and recorded as this run's.
    fn samples_written(&self, step: usize) -> Result<bool> {
        let dir = self.run_dir();
        let Some(m) = dir.manifest()? else {
            return Ok(false);
        };
        Ok((0..self.config.sample.prompts.len()).all(|i| {
            let rel = sample_name(step, i);
            m.files
                .get(&rel)
                .is_some_and(|r| r.matches(&dir.path.join(&rel)))
        }))
    }

    /// Rank 0's (or a single process's) start of `run`: decides, prepares the folder and
    /// restores the checkpoint it resumes from.
    fn prepare_folder(
        &mut self,
        opts: &RunOptions,
        on: &mut dyn FnMut(Event),
    ) -> Result<FolderAction> {
        let Decision {
            action,
            from,
            passed,
            survey,
        } = decide(&self.config, self.part().world, opts)?;
        let dir = self.run_dir();
        let log_path = dir.path.join(LOG);
        match &action {
            FolderAction::New | FolderAction::Overwrite(_) => {
                if opts.resume {
                    on(Event::Note(format!(
                        "no run was recorded in {} yet (it stopped before its first write): \
                         starting it",
                        dir.path.display()
                    )));
                }
                if matches!(action, FolderAction::Overwrite(_)) {
                    on(Event::Note(format!(
                        "--overwrite: deleting the earlier run's files in {} (only those it \
                         recorded)",
                        dir.path.display()
                    )));
                    dir.clear(&survey)?;
                }
                let m = Manifest::new(self.resume_keys());
                dir.create(&m)?;
                self.run_id = m.run_id;
                self.step = 0;
                write_atomic(&log_path, b"")?;
                dir.record(LOG, None, true)?;
            }
            FolderAction::Resume(..) | FolderAction::AlreadyFinished(_) => {
                let m = survey.manifest.ok_or_else(|| Error::Checkpoint {
                    path: dir.path.clone(),
                    msg: "the run manifest disappeared".into(),
                })?;
                self.run_id = m.run_id;
                for (path, why) in passed {
                    on(Event::Note(format!(
                        "{} {why}; trying the one before",
                        path.display()
                    )));
                }
                let mut copy = None;
                match from {
                    Some((path, st)) => {
                        self.restore(&path, &st)?;
                        if st.files.contains_key(LOG) {
                            copy = Some(path.join(LOG));
                        }
                        on(Event::Note(format!(
                            "resuming after step {} from {}",
                            self.step,
                            path.display()
                        )));
                    }
                    None => {
                        on(Event::Note("no checkpoint yet: starting at step 1".into()));
                        self.step = 0;
                        self.skipped_in_row = 0;
                    }
                }
                // The log keeps the steps the checkpoint covers; where the folder's log
                // lacks some of them (deleted, cut), the checkpoint's copy replaces it.
                let kept: Vec<(usize, String)> = read_log(&log_path)?
                    .into_iter()
                    .filter(|(s, _)| *s <= self.step)
                    .collect();
                let covered = |lines: &[(usize, String)]| {
                    let steps: std::collections::BTreeSet<usize> = lines
                        .iter()
                        .filter(|(_, l)| l.contains("\"loss\""))
                        .map(|(s, _)| *s)
                        .collect();
                    (1..=self.step).filter(|s| !steps.contains(s)).count()
                };
                let mut lines = kept;
                let lacking = covered(&lines);
                if lacking > 0 {
                    match &copy {
                        Some(c) => {
                            lines = read_log(c)?;
                            on(Event::Note(format!(
                                "{} lacked {lacking} of steps 1-{}: taken from {}",
                                log_path.display(),
                                self.step,
                                c.display()
                            )));
                        }
                        None => on(Event::Note(format!(
                            "{} lacks {lacking} of steps 1-{} and the checkpoint holds no \
                             copy of it: those lines are lost",
                            log_path.display(),
                            self.step
                        ))),
                    }
                }
                let text: String = lines.into_iter().map(|(_, l)| l + "\n").collect();
                write_atomic(&log_path, text.as_bytes())?;
                dir.record(LOG, None, true)?;
            }
        }
        Ok(action)
    }
}

/// The phases due after a step.
#[derive(Clone, Copy, Debug)]
struct Due {
    validation: bool,
    samples: bool,
    plot: bool,
}

impl Due {
    fn describe(&self) -> String {
        let mut v = vec![];
        if self.validation {
            v.push("the validation loss");
        }
        if self.samples {
            v.push("the sample images");
        }
        v.join(" and ")
    }
}

/// A sample image's path in the output folder (relative): `samples/step-<step>-<i>.png`.
fn sample_name(step: usize, i: usize) -> String {
    format!("{SAMPLES}/step-{step:07}-{i}.png")
}

/// The config's resume keys, and the number of ranks where there are several (the global
/// batch depends on it).
fn resume_keys_of(config: &TrainConfig, world: usize) -> Vec<(&'static str, String)> {
    let mut k = config.resume_keys();
    if world > 1 {
        k.push((
            "ranks (GPUs or workers of data-parallel training)",
            world.to_string(),
        ));
    }
    k
}

/// What a run of `config` over `world` ranks would do with its output folder, as
/// [`Trainer::plan`] says, from the config alone (nothing loaded, nothing written): for a
/// front end to refuse an occupied folder before any data is cached.
pub fn plan_folder(config: &TrainConfig, world: usize, opts: &RunOptions) -> Result<FolderAction> {
    decide(config, world, opts).map(|d| d.action)
}

/// The checks that need neither the model nor a device, for a front end to run once before
/// it starts `world` workers (so a problem every rank would meet is said once): the
/// config's values and paths, the output folder as `opts` asks ([`plan_folder`]), and for
/// image data the scan and the batch size ([`images::scan`]).
pub fn preflight(config: &TrainConfig, world: usize, opts: &RunOptions) -> Result<()> {
    config.validate()?;
    config.check_paths()?;
    plan_folder(config, world, opts)?;
    if config.data.dir.is_none() {
        images::scan(config, world, &mut |_| {})?;
    }
    Ok(())
}

/// [`plan_folder`] with what a resume needs: the newest checkpoint of the run that verifies
/// (its files hashed once, here), the ones passed over (damaged, another run's) newest
/// first, and the folder's survey.
fn decide(config: &TrainConfig, world: usize, opts: &RunOptions) -> Result<Decision> {
    let dir = RunDir::new(&config.train.output_dir);
    let out = dir.path.display().to_string();
    let folder = |msg: String| Error::RunFolder {
        path: dir.path.clone(),
        msg,
    };
    if opts.resume && opts.overwrite {
        return Err(Error::Config {
            path: None,
            msg: "--resume and --overwrite exclude each other".into(),
        });
    }
    let survey = dir.survey()?;
    let run_id = survey.manifest.as_ref().map(|m| m.run_id.clone());
    let strangers: Vec<String> = survey
        .checkpoints
        .iter()
        .filter(|(_, _, r)| r.is_none() || *r != run_id)
        .map(|(_, p, _)| p.file_name().map(|f| f.to_string_lossy().into_owned()))
        .map(Option::unwrap_or_default)
        .collect();
    let plain = |action, survey| Decision {
        action,
        from: None,
        passed: vec![],
        survey,
    };
    if !opts.resume {
        let mut blocked = survey.foreign.clone();
        blocked.extend(strangers);
        if !blocked.is_empty() {
            return Err(folder(format!(
                "{} {} where a run writes, and no run recorded in this folder wrote {}; \
                 runs delete or replace only files they recorded as their own: move {} away \
                 or set train.output_dir to another folder",
                blocked.join(", "),
                if blocked.len() == 1 { "is" } else { "are" },
                if blocked.len() == 1 { "it" } else { "them" },
                if blocked.len() == 1 { "it" } else { "them" },
            )));
        }
        return match (survey.manifest.is_some(), opts.overwrite) {
            (false, _) => Ok(plain(FolderAction::New, survey)),
            (true, true) => {
                let owned = survey.owned.clone();
                Ok(plain(FolderAction::Overwrite(owned), survey))
            }
            (true, false) => Err(folder(format!(
                "holds another run ({}); continue it with --resume, replace it with \
                 --overwrite (which deletes only that run's recorded files), or set \
                 train.output_dir to another folder",
                survey.owned.join(", ")
            ))),
        };
    }
    // Resume.
    let Some(m) = &survey.manifest else {
        // A run stopped before its manifest was in place (killed, a full disk) left at most
        // its interrupted writes and its caches: it starts again. Anything else is no run.
        let cache = super::images::cache_dir(config);
        let started = std::fs::read_dir(&dir.path).ok().map(|entries| {
            entries.filter_map(|e| e.ok()).all(|e| {
                let n = e.file_name().to_string_lossy().into_owned();
                e.path() == cache || super::rundir::is_temp_name(&n, e.path().is_dir())
            })
        });
        if started == Some(true) {
            return Ok(plain(FolderAction::New, survey));
        }
        let what = match started {
            None => format!("{out} does not exist"),
            Some(_) => format!("{out} has no {}", super::rundir::MANIFEST),
        };
        return Err(folder(format!(
            "--resume: no run to resume ({what}); check train.output_dir, or start a new run \
             without --resume"
        )));
    };
    if !survey.foreign.is_empty() {
        let n = survey.foreign.len();
        return Err(folder(format!(
            "--resume: {} {} where the run writes, and the run did not record {} (or {} \
             changed since); runs replace only files they recorded as their own: move {} \
             away, then resume",
            survey.foreign.join(", "),
            if n == 1 { "is" } else { "are" },
            if n == 1 { "it" } else { "them" },
            if n == 1 { "it" } else { "they" },
            if n == 1 { "it" } else { "them" },
        )));
    }
    let diff = m.differences(&resume_keys_of(config, world));
    if !diff.is_empty() {
        let lines: Vec<String> = diff
            .iter()
            .map(|(k, was, now)| format!("{k} was {was}, the config says {now}"))
            .collect();
        return Err(Error::Config {
            path: None,
            msg: format!(
                "--resume: the run in {out} was made with another config:\n{}\n\
                 (restore those values, or start over with --overwrite)",
                lines.join("\n")
            ),
        });
    }
    let n = config.train.steps;
    let mut passed = vec![];
    for (step, path, run) in survey.checkpoints.iter().rev() {
        if run.is_none() || *run != run_id {
            let why = match run {
                Some(r) => format!("was written by another run (id {r}): passed over"),
                None => "is damaged (its state.json is unreadable)".into(),
            };
            passed.push((path.clone(), why));
            continue;
        }
        let st = match CheckpointState::read_verified(path) {
            Ok(st) => st,
            Err(e) => {
                passed.push((path.clone(), format!("is damaged ({e})")));
                continue;
            }
        };
        if *step > n {
            return Err(Error::Config {
                path: None,
                msg: format!(
                    "--resume: {} is at step {step}, past train.steps = {n}",
                    path.display()
                ),
            });
        }
        // Folders the resumed steps would save over that no run here can be shown to own.
        let in_the_way: Vec<String> = survey
            .checkpoints
            .iter()
            .filter(|(s, _, r)| s > step && *s <= n && (r.is_none() || *r != run_id))
            .map(|(_, p, _)| p.display().to_string())
            .collect();
        if !in_the_way.is_empty() {
            return Err(folder(format!(
                "--resume from step {step}: {} would be replaced by the run's own \
                 checkpoints, and no run here recorded them: move them away, then resume",
                in_the_way.join(", ")
            )));
        }
        let action = if *step == n {
            FolderAction::AlreadyFinished(*step)
        } else {
            FolderAction::Resume(*step, path.clone())
        };
        return Ok(Decision {
            action,
            from: Some((path.clone(), st)),
            passed,
            survey,
        });
    }
    let ours_damaged: Vec<String> = passed
        .iter()
        .filter(|(_, why)| why.starts_with("is damaged"))
        .map(|(p, _)| p.display().to_string())
        .collect();
    if !ours_damaged.is_empty() {
        return Err(Error::Checkpoint {
            path: dir.path.clone(),
            msg: format!(
                "no intact checkpoint to resume from ({} damaged); start over with \
                 --overwrite",
                ours_damaged.join(", ")
            ),
        });
    }
    Ok(Decision {
        action: FolderAction::Resume(0, dir.path.clone()),
        from: None,
        passed,
        survey,
    })
}

/// " | GPU x GiB" in use on a CUDA device, "" on the CPU.
#[allow(irrefutable_let_patterns)]
pub fn gpu_memory(device: &Device) -> String {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(c) = device {
        let gib = c.memory().in_use as f64 / (1u64 << 30) as f64;
        return format!(" | GPU {gib:.2} GiB");
    }
    let _ = device;
    String::new()
}
