//! FLAME: training large diffusion models (Flux, SD3.5, SDXL) on GPUs with limited memory.
//!
//! This crate is built in layers: [`Tensor`] (shared storage + strided layout) over the
//! [`backend`] traits (a CPU reference backend behind `cpu-ref`; the CUDA backend behind
//! `cuda`), a tape-based [`autograd`] with f64 gradcheck, [`safetensors`] I/O and [`optim`].
//! Layers ([`nn`]) take their parameters from a [`nn::VarBuilder`] by key path; the models
//! ([`models`]) are built from those layers and run their blocks through [`memory`] (checkpointing, block streaming
//! from host memory, the planner that fits a run to its budget).
//!
//! # Example
//!
//! A two-layer MLP fits a small regression task on the CPU with [`nn::Linear`] and
//! [`optim::AdamW`]: the layers take random parameters from a [`nn::VarBuilder`], which
//! are then marked trainable and handed to the optimizer; each step records the forward,
//! runs [`Tensor::backward`] and applies the gradients.
//!
//! ```rust
//! use flame::nn::{Linear, VarBuilder};
//! use flame::optim::{AdamConfig, AdamW, Optimizer};
//! use flame::{DType, Device, Tensor};
//!
//! let dev = Device::Cpu;
//! // Every parameter drawn from N(0, 0.5^2), seeded per key ("l1.weight", ...).
//! let vb = VarBuilder::random(0, 0.5, DType::F32, &dev);
//! let l1 = Linear::new(&vb.pp("l1"), 4, 32, true)?;
//! let l2 = Linear::new(&vb.pp("l2"), 32, 1, true)?;
//! vb.set_trainable(|_key| true)?;
//! let config = AdamConfig {
//!     lr: 1e-2,
//!     weight_decay: 1e-2,
//!     ..AdamConfig::default()
//! };
//! let mut opt = AdamW::new(vb.trainable_params()?, config)?;
//!
//! // Targets y = sin(x0) + x1 x2 - x3 for 256 random points: x (B, 4) -> y (B, 1).
//! let x = Tensor::randn((256, 4), DType::F32, &dev, 1)?;
//! let col = |i: usize| x.narrow(1, i, 1);
//! let y = col(0)?.sin()?.add(&col(1)?.mul(&col(2)?)?)?.sub(&col(3)?)?;
//!
//! let mut losses = vec![];
//! for _ in 0..100 {
//!     let pred = l2.forward(&l1.forward(&x)?.silu()?)?; // (B, 1)
//!     let loss = pred.mse_loss(&y)?; // a 0-dim tensor
//!     losses.push(loss.to_scalar_f64()?);
//!     let grads = loss.backward()?;
//!     opt.step(&grads)?;
//! }
//! let (first, last) = (losses[0], losses[losses.len() - 1]);
//! assert!(last < first / 10.0, "loss {first} -> {last}");
//! # Ok::<(), flame::Error>(())
//! ```

#![warn(missing_docs)]

pub mod autograd;
pub mod backend;
#[cfg(feature = "cli")]
pub mod cli;
mod config;
pub mod data;
mod device;
pub mod diffusion;
pub mod dist;
mod dtype;
pub mod encoders;
mod error;
mod fault;
pub mod gguf;
pub mod memory;
pub mod models;
pub mod nn;
pub mod optim;
pub mod progress;
pub mod safetensors;
pub mod sample;
mod shape;
mod tensor;
pub mod train;

#[cfg(feature = "cuda")]
pub use backend::cuda;
pub use backend::profile;

pub use autograd::{grad_enabled, no_grad, Grads, NoGradGuard};
pub use backend::{BinaryOp, CmpOp, ReduceOp, UnaryOp, Window2d};
pub use device::{Device, DeviceChoice};
pub use dtype::{bf16_nearest, f16_nearest, CpuStorage, DType, WithDType};
pub use error::{Error, Result, Setting};
pub use shape::{Dim, Layout, Shape};
pub use tensor::{fp8_product, product8, product8_bias, sum_sq_multi, Rows8, Tensor, TensorId};
