//! FLAME: training large diffusion models (Flux, SD3.5, SDXL) on GPUs with limited memory.
//!
//! This crate is built in layers: [`Tensor`] (shared storage + strided layout) over the
//! [`backend`] traits (a CPU reference backend behind `cpu-ref`; the CUDA backend behind
//! `cuda`), a tape-based [`autograd`] with f64 gradcheck, [`safetensors`] I/O and [`optim`].

#![warn(missing_docs)]

pub mod autograd;
pub mod backend;
mod device;
mod dtype;
mod error;
pub mod models;
pub mod nn;
pub mod optim;
pub mod safetensors;
mod shape;
pub mod stream;
mod tensor;
#[allow(missing_docs)]
pub mod train;

#[cfg(feature = "cuda")]
pub use backend::cuda;

pub use autograd::{grad_enabled, no_grad, Grads, NoGradGuard};
pub use backend::{BinaryOp, CmpOp, ReduceOp, UnaryOp, Window2d};
pub use device::Device;
pub use dtype::{CpuStorage, DType, WithDType};
pub use error::{Error, Result};
pub use shape::{Dim, Layout, Shape};
pub use tensor::{Tensor, TensorId};
