//! Training: objectives (flow matching, DDPM), the config, pre-encoded data, the run folder
//! and the loop with its checkpoints; adapters live in `nn` (LoRA), optimizers in `optim`,
//! models and their loader in `models`.

pub mod config;
pub mod data;
pub mod demo;
pub mod ema;
pub mod groups;
pub mod images;
pub mod init;
pub mod metadata;
pub mod planning;
pub use crate::diffusion::objectives;
pub mod rundir;
pub mod scaler;
pub mod tensorboard;
pub mod text;
pub mod trainer;

pub use config::TrainConfig;
pub use objectives::{
    flow_matching, flux_mu, flux_time_shift, shift_time, weighted_mse, Ddpm, Prediction,
    TimestepSampling,
};
pub use planning::{MemoryChoice, PhasePlan};
pub use rundir::{recorded_machine, recorded_share_at_start};
pub use trainer::{
    plan_folder, plan_run, preflight, Event, FolderAction, ParamList, Placement, Prepare, RunEnd,
    RunOptions, StepReport, Trainer,
};
