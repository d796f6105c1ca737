//! Training: objectives (flow matching, DDPM), with adapters in `nn` (LoRA) and optimizers in
//! `optim`. The training loop and its checkpoints come next (issue 7).

pub mod objectives;

pub use objectives::{
    flow_matching, flux_mu, flux_time_shift, shift_time, weighted_mse, Ddpm, Prediction,
    TimestepSampling,
};
