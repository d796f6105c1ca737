//! Training: objectives (flow matching, DDPM), the config, pre-encoded data and the loop with
//! its checkpoints; adapters live in `nn` (LoRA), optimizers in `optim`.

pub mod config;
pub mod data;
pub mod objectives;
pub mod trainer;

pub use config::TrainConfig;
pub use objectives::{
    flow_matching, flux_mu, flux_time_shift, shift_time, weighted_mse, Ddpm, Prediction,
    TimestepSampling,
};
pub use trainer::{RunEnd, Trainer};
