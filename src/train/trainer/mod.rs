//! The training loop behind `train`: a LoRA on any registered model family from pre-encoded
//! data, with AdamW, a warm-up + constant/cosine schedule, gradient accumulation and
//! clipping, a guard against non-finite losses and gradients, a JSONL loss log and atomic,
//! verified checkpoints that resume exactly. Every random draw (data order, noise,
//! timesteps, dropout) is a function of (seed, step), so a checkpoint needs only the step,
//! the adapter and the optimizer state.
//!
//! Steps count from 1: step k is the k-th optimizer step; the log's line for it says
//! `"step": k`, and `checkpoint-k` holds the state after it.
//!
//! The parts: `open` (the config checked, the model probed, data prepared, memory planned,
//! the model loaded, the optimizer made), `step` (one optimizer step: micro-batches, the
//! ranks' agreement, loss scaling, the non-finite policy, clipping), `outputs` (validation
//! loss, sample images, the loss plot), `checkpoint` (adapter files and checkpoints, saved
//! and restored), `run` (the loop and the phases due after each step) and `folder` (what a
//! run does with its output folder: new, overwrite, resume or finished).

use super::config::TrainConfig;
use super::data::{Batch, Part, Samples};
use super::ema::Ema;
use super::images::ImageSamples;
use super::metadata::RunMetadata;
use super::planning::{MemoryChoice, PhasePlan};
use super::rundir::RunDir;
use super::scaler::LossScaler;
use super::tensorboard::EventWriter;
use super::text::TextTraining;
use crate::dist::{GradReducer, ProcessGroup};
use crate::memory::PhasePeaks;
use crate::models::DiffusionModel;
use crate::nn::{Adapters, KeyMap};
use crate::optim::Optimizer;
use crate::{DType, Device, Result, Tensor};
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

mod checkpoint;
mod folder;
mod open;
mod outputs;
mod run;
mod step;
mod trial;

use folder::resume_keys_of;
pub use folder::{plan_folder, preflight};
pub use open::plan_run;

/// A loaded model with its adapters, data and optimizer, ready to step.
pub struct Trainer {
    /// The checked config.
    pub config: TrainConfig,
    model: Box<dyn DiffusionModel>,
    map: KeyMap,
    /// The adapters being trained.
    pub adapters: Arc<Adapters>,
    /// The text encoders trained with the model (`adapter.text_encoders`), if any.
    text: Option<Arc<TextTraining>>,
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
    /// The moving average of the adapter's weights (`[ema]`), if kept.
    ema: Option<Ema>,
    /// What saved adapters' metadata says of the run.
    meta: RunMetadata,
    /// The TensorBoard event file being written (rank 0 with `train.tensorboard`, once the
    /// run has its folder).
    events: std::sync::Mutex<Option<EventWriter>>,
    /// The model's family and the options it loaded with (its plan in `memory`): a plan
    /// timed or kept after the load loads it again with these.
    family: &'static crate::models::Family,
    load: crate::models::LoadOptions,
    /// The autoencoder's downsampling factor and first stage's width (image data) and whether
    /// the model takes a distilled guidance input: each phase's plan is worked out again
    /// from them under another step plan.
    vae_shape: Option<(usize, usize)>,
    guided: bool,
    /// Whether the model was released for a load under another plan that failed (the
    /// trainer's model is then a stand-in that refuses to predict).
    released: bool,
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
    /// ([`crate::Error::Interrupted`]) and the run after the current step, with a checkpoint.
    /// `None`: a flag of the trainer's own ([`Trainer::interrupt_flag`]).
    pub interrupt: Option<Arc<AtomicBool>>,
    /// The machine the planner's time model plays instead of measuring this one: a resumed
    /// run's ([`crate::train::recorded_machine`]), so it chooses the plan the run started
    /// with. `None`: this machine, measured or read from the cache.
    pub machine: Option<crate::memory::Machine>,
    /// The allocator's share of the default budget a resumed run planned its phases within
    /// ([`crate::train::recorded_share_at_start`]): it plans within no more, so that it
    /// chooses as it did (the encode tile keys the latent cache). `None`: this process's.
    pub share_at_start: Option<u64>,
}

/// The image pipeline's pieces sampling needs after the encoders are freed: the text cache
/// holding the prompts' embeddings, and where the autoencoder is.
struct PipelineParts {
    text: crate::data::TextCache,
    vae: crate::models::Located,
    factor: usize,
    /// The sample prompts' reference images (per prompt: file, way into the model) and the
    /// cache holding their latents.
    references: Vec<Vec<(PathBuf, crate::data::Geometry)>>,
    pictures: crate::data::LatentCache,
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

/// A named list of trainable tensors (`Trainer::param_lists`): the list's name and its
/// `(name, tensor)` pairs.
pub type ParamList = (&'static str, Vec<(String, Tensor)>);

impl Trainer {
    /// Every trainable tensor by name as named lists: "model" (the diffusion model's
    /// adapters, `<layer path>.<tensor>`) and, with `adapter.text_encoders`, "text_encoders"
    /// (`<kohya prefix>.<layer path>.<tensor>`, `lora_te1.text_model...`): the lists a
    /// parameter group each.
    pub fn param_lists(&self) -> Result<Vec<ParamList>> {
        param_lists(&self.adapters, self.text.as_deref())
    }

    /// Every trainable tensor by name, the model's then the text encoders'.
    pub fn params(&self) -> Result<Vec<(String, Tensor)>> {
        Ok(self
            .param_lists()?
            .into_iter()
            .flat_map(|(_, v)| v)
            .collect())
    }

    /// The trained text encoders, if any.
    pub fn text_training(&self) -> Option<&TextTraining> {
        self.text.as_deref()
    }

    /// Dropout on (training) or off, for every adapter; returns whether it was on.
    fn set_train(&self, on: bool) -> bool {
        let was = self.adapters.training();
        self.adapters.set_train(on);
        if let Some(t) = &self.text {
            t.set_train(on);
        }
        was
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

    /// The adapters it trains.
    pub fn adapters(&self) -> &Arc<crate::nn::Adapters> {
        &self.adapters
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

    /// The counters of the model's block streamer, when blocks are streamed.
    pub fn stream_report(&self) -> Result<Option<crate::memory::StreamReport>> {
        self.model
            .exec()
            .streamer
            .as_ref()
            .map(|s| s.report())
            .transpose()
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
        self.peaks.allocator()
    }

    /// The most bytes this process held on the GPU as the driver counts them in each phase
    /// of [`Trainer::phase_peaks`] (what `nvidia-smi` shows for it, read every 100 ms
    /// through the phase and at its ends: the allocator's arena, the context, and what a
    /// phase took outside the allocator), what a card of the budget's size must hold; empty
    /// on the CPU.
    pub fn phase_driver_peaks(&self) -> Vec<(&'static str, u64)> {
        self.peaks.driver()
    }

    /// The wall seconds this process's run has spent so far in each phase ("caching",
    /// "loading the model", "training steps", "validation", "sample images", "checkpoints"),
    /// in the order first met, on every device: with the run's whole time, where its minutes
    /// went (the `train` summary prints it).
    pub fn phase_seconds(&self) -> Vec<(&'static str, f64)> {
        self.peaks.seconds()
    }

    /// How many requests the allocator has served from the driver beyond its cap's arena
    /// (each holds the process past the cap while it lives: `MemoryReport::overflows`); `None`
    /// on the CPU.
    pub fn arena_overflows(&self) -> Option<u64> {
        crate::memory::arena_overflows(&self.device)
    }

    /// The summary's memory lines of this process's run so far: each phase's peak in FLAME's
    /// allocator and its driver-side peak (`memory::PhasePeaks::memory_lines`); none on
    /// the CPU.
    pub fn memory_lines(&self) -> Vec<String> {
        self.peaks.memory_lines(&self.device, self.memory.outside)
    }
}

/// The trainable tensors of `adapters` and `text` as named lists ([`Trainer::param_lists`]).
fn param_lists(adapters: &Adapters, text: Option<&TextTraining>) -> Result<Vec<ParamList>> {
    let mut v = vec![("model", adapters.params()?)];
    if let Some(t) = text {
        v.push(("text_encoders", t.params()?));
    }
    Ok(v)
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
