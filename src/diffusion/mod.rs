//! The diffusion core, below the models, sampling, data and training: the training
//! objectives and their noise processes ([`objectives`]: flow matching, DDPM, what a model
//! predicts, timestep sampling), the loss and noise options ([`loss`]: kohya's Huber,
//! masks, noise offset, pyramid noise, timestep ranges) and diffusers' schedulers ([`schedulers`]) with the
//! [`Schedule`] trait the denoising loop steps through.

pub mod loss;
pub mod objectives;
pub mod schedulers;

pub use objectives::{
    flow_matching, flux_mu, flux_time_shift, shift_time, weighted_mse, Ddpm, Prediction,
    TimestepSampling,
};

use crate::{DType, Result, Tensor};

/// The noise process a schedule steps through; it must be the model's [`Objective`](crate::models::Objective).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Process {
    /// Rectified flow (Flux, SD3): the model takes t ∈ (0, 1] and predicts a velocity.
    FlowMatching,
    /// DDPM (SDXL): the model takes a training timestep and predicts ε or v.
    Ddpm,
}

/// A scheduler with its timesteps set: what [`denoise`](crate::sample::denoise) steps through. Steps are addressed
/// by index (0 = the noisiest), so a schedule holds no state and can be reused.
pub trait Schedule: Send + Sync {
    /// diffusers' `scheduler.timesteps`, one per step (flow matching: sigma x 1000).
    fn timesteps(&self) -> &[f32];
    /// The noise process it belongs to.
    fn process(&self) -> Process;
    /// The `t` [`DiffusionModel::predict`](crate::models::DiffusionModel::predict) takes at step `i` (flow matching: sigma in
    /// (0, 1]; DDPM: the timestep).
    fn model_time(&self, i: usize) -> Result<f32>;
    /// What unit-variance noise is multiplied by to make the first latents (diffusers'
    /// `init_noise_sigma`).
    fn init_noise_sigma(&self) -> f32 {
        1.0
    }
    /// The model's input at step `i` from the latents (diffusers' `scale_model_input`).
    fn scale_model_input(&self, x: &Tensor, i: usize) -> Result<Tensor> {
        let _ = i;
        x.to_dtype(DType::F32)
    }
    /// The latents after step `i` from the (guided) model output and the latents before it,
    /// in f32 (diffusers' `step(...).prev_sample`).
    fn step(&self, model_output: &Tensor, i: usize, sample: &Tensor) -> Result<Tensor>;
}
