//! The library's one error type. Every variant names what failed and where: the op and the
//! shapes involved, or the file and the tensor.

use crate::{DType, Shape};
use std::path::PathBuf;

pub type Result<T> = std::result::Result<T, Error>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{op}: shape mismatch, lhs {lhs} vs rhs {rhs}")]
    ShapeMismatch {
        op: &'static str,
        lhs: Shape,
        rhs: Shape,
    },
    #[error("{op}: cannot broadcast {lhs} with {rhs}")]
    BroadcastIncompatible {
        op: &'static str,
        lhs: Shape,
        rhs: Shape,
    },
    #[error("{op}: dtype mismatch, lhs {lhs:?} vs rhs {rhs:?}")]
    DTypeMismatch {
        op: &'static str,
        lhs: DType,
        rhs: DType,
    },
    #[error("{op}: tensors on different devices, {lhs} vs {rhs}")]
    DeviceMismatch {
        op: &'static str,
        lhs: String,
        rhs: String,
    },
    #[error("{op}: dtype {dtype:?} is not supported")]
    UnsupportedDType { op: &'static str, dtype: DType },
    #[error("{op}: dim {dim} out of range for a tensor of shape {shape}")]
    DimOutOfRange {
        op: &'static str,
        dim: i64,
        shape: Shape,
    },
    #[error("{op}: index {index} out of range for size {size} (shape {shape})")]
    IndexOutOfRange {
        op: &'static str,
        index: u64,
        size: usize,
        shape: Shape,
    },
    #[error("{op}: {msg} (shape {shape})")]
    InvalidArgument {
        op: &'static str,
        msg: String,
        shape: Shape,
    },
    #[error("{op}: {count} elements cannot be viewed as shape {shape}")]
    ElementCount {
        op: &'static str,
        count: usize,
        shape: Shape,
    },
    #[error("streaming: {0}")]
    Stream(String),
    #[error("autograd: {0}")]
    Autograd(String),
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("safetensors file {path}{}: {msg}", tensor.as_ref().map(|t| format!(", tensor '{t}'")).unwrap_or_default())]
    SafeTensors {
        path: PathBuf,
        tensor: Option<String>,
        msg: String,
    },
    #[error("parameter '{key}'{}: {msg}", file.as_ref().map(|f| format!(" in {}", f.display())).unwrap_or_default())]
    Param {
        key: String,
        file: Option<PathBuf>,
        msg: String,
    },
    #[error("checkpoint {path}: {msg}")]
    Checkpoint { path: PathBuf, msg: String },
    #[error("config{}: {msg}", path.as_ref().map(|p| format!(" {}", p.display())).unwrap_or_default())]
    Config { path: Option<PathBuf>, msg: String },
    #[error("optimizer {optimizer}: {msg}")]
    Optimizer {
        optimizer: &'static str,
        msg: String,
    },
    #[error("out of GPU memory on {device}: requested {requested} bytes with {in_use} in use, limit {limit}")]
    OutOfMemory {
        device: String,
        requested: u64,
        in_use: u64,
        limit: u64,
    },
    #[error("CUDA is not available: {0}")]
    CudaUnavailable(String),
    #[error("CUDA: {0}")]
    Cuda(String),
    #[error("no backend is compiled in for {0}: enable the `cpu-ref` feature")]
    NoBackend(&'static str),
    #[error("internal: a lock was poisoned by a panic on another thread ({0})")]
    Poisoned(&'static str),
    /// A NaN or an infinity in training: the step, what held it, the batch's sample files
    /// and why the run stopped.
    #[error("step {step}: {what}; stopped ({why}){}", fmt_files(files))]
    NonFinite {
        /// The step (from 1).
        step: usize,
        /// The tensor that was not finite.
        what: String,
        /// The sample files of the step's batch.
        files: Vec<String>,
        /// Why this stops the run.
        why: String,
    },
}

fn fmt_files(files: &[String]) -> String {
    if files.is_empty() {
        String::new()
    } else {
        format!("; the batch: {}", files.join(", "))
    }
}

impl Error {
    pub(crate) fn invalid(op: &'static str, msg: impl Into<String>, shape: &Shape) -> Self {
        Error::InvalidArgument {
            op,
            msg: msg.into(),
            shape: shape.clone(),
        }
    }
}
