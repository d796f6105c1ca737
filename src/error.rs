//! The library's one error type. Every variant names what failed and where: the op and the
//! shapes involved, or the file and the tensor.

use crate::{DType, Shape};
use std::path::PathBuf;

/// `std::result::Result` with this crate's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

/// Every error FLAME returns; the `Display` text names the op, shapes, file or tensor involved.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Two operands of an op need the same shape and do not have it.
    #[error("{op}: shape mismatch, lhs {lhs} vs rhs {rhs}")]
    ShapeMismatch {
        /// The op that failed.
        op: &'static str,
        /// Shape of the first operand.
        lhs: Shape,
        /// Shape of the second operand.
        rhs: Shape,
    },
    /// Two shapes cannot be broadcast together (a dim differs and neither side is 1).
    #[error("{op}: cannot broadcast {lhs} with {rhs}")]
    BroadcastIncompatible {
        /// The op that failed.
        op: &'static str,
        /// Shape of the first operand.
        lhs: Shape,
        /// Shape of the second operand.
        rhs: Shape,
    },
    /// Two operands of an op need the same dtype and do not have it.
    #[error("{op}: dtype mismatch, lhs {lhs:?} vs rhs {rhs:?}")]
    DTypeMismatch {
        /// The op that failed.
        op: &'static str,
        /// Dtype of the first operand.
        lhs: DType,
        /// Dtype of the second operand.
        rhs: DType,
    },
    /// The operands of an op live on different devices.
    #[error("{op}: tensors on different devices, {lhs} vs {rhs}")]
    DeviceMismatch {
        /// The op that failed.
        op: &'static str,
        /// Where the first operand lives (e.g. `cuda:0`).
        lhs: String,
        /// Where the second operand lives.
        rhs: String,
    },
    /// The op has no implementation for this dtype (on this backend).
    #[error("{op}: dtype {dtype:?} is not supported")]
    UnsupportedDType {
        /// The op that failed.
        op: &'static str,
        /// The dtype it was given.
        dtype: DType,
    },
    /// A dimension index (possibly negative, counting from the end) is outside the tensor's rank.
    #[error("{op}: dim {dim} out of range for a tensor of shape {shape}")]
    DimOutOfRange {
        /// The op that failed.
        op: &'static str,
        /// The dim as given (negative counts from the end).
        dim: i64,
        /// Shape of the tensor it was resolved against.
        shape: Shape,
    },
    /// An index (of `index_select`, `gather`, `scatter_add`, ...) is `>=` the size of the dim it indexes.
    #[error("{op}: index {index} out of range for size {size} (shape {shape})")]
    IndexOutOfRange {
        /// The op that failed.
        op: &'static str,
        /// The first offending index.
        index: u64,
        /// Size of the indexed dim.
        size: usize,
        /// Shape of the indexed tensor.
        shape: Shape,
    },
    /// An argument an op was given is invalid for a tensor of this shape; `msg` says why.
    #[error("{op}: {msg} (shape {shape})")]
    InvalidArgument {
        /// The op that failed.
        op: &'static str,
        /// What is wrong.
        msg: String,
        /// Shape of the tensor involved.
        shape: Shape,
    },
    /// A number of elements does not fit a shape (`reshape`, `from_vec`, `from_host`).
    #[error("{op}: {count} elements cannot be viewed as shape {shape}")]
    ElementCount {
        /// The op that failed.
        op: &'static str,
        /// Number of elements available.
        count: usize,
        /// The requested shape.
        shape: Shape,
    },
    /// Block streaming misuse, e.g. reading a weight of a block that is not fetched.
    #[error("streaming: {0}")]
    Stream(String),
    /// The tape or backward pass failed (e.g. a gradient of the wrong shape, a custom op
    /// returning the wrong number of outputs).
    #[error("autograd: {0}")]
    Autograd(String),
    /// Reading or writing a file failed.
    #[error("{path}: {source}")]
    Io {
        /// The file involved.
        path: PathBuf,
        /// The underlying I/O error.
        #[source]
        source: std::io::Error,
    },
    #[error("safetensors file {path}{}: {msg}", tensor.as_ref().map(|t| format!(", tensor '{t}'")).unwrap_or_default())]
    /// A safetensors file is malformed, or a tensor in it is missing or has an unusable dtype.
    SafeTensors {
        /// The file.
        path: PathBuf,
        /// The tensor involved, if the error is about one.
        tensor: Option<String>,
        /// What is wrong.
        msg: String,
    },
    #[error("GGUF file {path}{}: {msg}", tensor.as_ref().map(|t| format!(", tensor '{t}'")).unwrap_or_default())]
    /// A GGUF file is malformed (truncated, corrupt, a tensor out of bounds), or a tensor in it
    /// is missing or of a type FLAME does not read.
    Gguf {
        /// The file.
        path: PathBuf,
        /// The tensor involved, if the error is about one.
        tensor: Option<String>,
        /// What is wrong.
        msg: String,
    },
    #[error("parameter '{key}'{}: {msg}", file.as_ref().map(|f| format!(" in {}", f.display())).unwrap_or_default())]
    /// A parameter cannot be provided: missing from the weights, of the wrong shape, present in
    /// two weight files, or asked of a misused `VarBuilder`.
    Param {
        /// The parameter's full name (e.g. `double_blocks.0.img_attn.qkv.weight`; empty if none).
        key: String,
        /// The weights file it was looked up in, if any.
        file: Option<PathBuf>,
        /// What is wrong.
        msg: String,
    },
    /// A model checkpoint (file or diffusers folder) cannot be located or read, or a
    /// training checkpoint cannot be resumed from.
    #[error("checkpoint {path}: {msg}")]
    Checkpoint {
        /// The checkpoint file or folder.
        path: PathBuf,
        /// What is wrong.
        msg: String,
    },
    /// A value of one of the library's settings does not fit (an adapter's rank for a layer,
    /// a kind the adapters do not have, more streamed blocks than a model has), named in the
    /// library's terms ([`Setting::name`]); a front end with its own names for the settings
    /// maps it (`train`'s config: [`crate::train::config::TrainConfig::named`]).
    #[error("{} {msg}", setting.name())]
    Setting {
        /// The setting.
        setting: Setting,
        /// What is wrong with its value, beginning with the value.
        msg: String,
    },
    #[error("config{}: {msg}", path.as_ref().map(|p| format!(" {}", p.display())).unwrap_or_default())]
    /// A model, LoRA or training configuration is invalid.
    Config {
        /// The config file, if the config came from one.
        path: Option<PathBuf>,
        /// What is wrong.
        msg: String,
    },
    /// A run's output folder cannot take the run as asked: another run's files in it, files
    /// at a run's names that no run there recorded, nothing to resume.
    #[error("output folder {path}: {msg}")]
    RunFolder {
        /// The output folder.
        path: PathBuf,
        /// What is in the way, and what to do.
        msg: String,
    },
    /// A phase of a run besides its training steps (the validation loss, sample images, the
    /// loss plot) failed; what was trained up to `step` is saved.
    #[error("{phase} after step {step} failed: {error}\n  {saved}\n  {hint}")]
    Phase {
        /// The phase ("validation", "sample images", "the loss plot").
        phase: &'static str,
        /// The last training step done.
        step: usize,
        /// The phase's error.
        error: Box<Error>,
        /// What is saved (the checkpoint, the final adapter).
        saved: String,
        /// The knob that would let the phase fit, and how to finish.
        hint: String,
    },
    /// An error with what was under way when it happened: the flag whose file could not be
    /// used (`--lora x.safetensors`), the phase that ran out of memory (`caching latents`).
    #[error("{what}: {error}")]
    Context {
        /// What was under way, with the setting that would change it where one would.
        what: String,
        /// The error.
        #[source]
        error: Box<Error>,
    },
    /// Stopped by a signal (Ctrl-C, SIGTERM) before training started: what was under way.
    #[error("interrupted {0}")]
    Interrupted(String),
    /// A host (CPU) memory allocation this large failed: what it was for and its size.
    #[error("out of host memory: {what} needs {bytes} bytes")]
    HostMemory {
        /// What the memory was for (a tensor's shape, a setting's key).
        what: String,
        /// Bytes requested.
        bytes: u64,
    },
    /// A training image, caption, manifest or dataset cache entry cannot be used: the file
    /// and why.
    #[error("data {path}: {msg}")]
    Data {
        /// The file (or folder) involved.
        path: PathBuf,
        /// What is wrong.
        msg: String,
    },
    /// A tokenizer's files cannot be found or read, or it cannot encode a text.
    #[error("tokenizer {path}: {msg}")]
    Tokenizer {
        /// The tokenizer file or folder.
        path: PathBuf,
        /// What is wrong.
        msg: String,
    },
    /// An optimizer was misused or its saved state does not match its parameters.
    #[error("optimizer {optimizer}: {msg}")]
    Optimizer {
        /// The optimizer's name (e.g. `AdamW`).
        optimizer: &'static str,
        /// What is wrong.
        msg: String,
    },
    #[error("out of GPU memory on {device}: requested {requested} bytes with {in_use} in use, {}", oom_where(*limit, *device_full))]
    /// A GPU allocation would pass the memory limit (the budget's cap,
    /// `FLAME_GPU_MEMORY_LIMIT`), or the device itself has no memory left.
    OutOfMemory {
        /// The GPU (e.g. `cuda:0`).
        device: String,
        /// Bytes requested, rounded up to the allocator's granularity.
        requested: u64,
        /// Bytes held by live buffers when the request was made.
        in_use: u64,
        /// The allocator's cap in bytes, or the GPU's total memory when the device ran out.
        limit: u64,
        /// The device itself had no memory left (other processes, or memory outside
        /// FLAME's count, hold the rest), rather than the cap refusing.
        device_full: bool,
    },
    /// A training step ran out of GPU memory under a memory plan: the allocator's error and
    /// what to change (the planner's next plan, or the knob that would fit).
    #[error("{error}\n  memory plan: {plan}\n  {hint}")]
    PlanExceeded {
        /// The out-of-memory error.
        error: Box<Error>,
        /// The plan the run used, with its predicted peak.
        plan: String,
        /// The knob to change.
        hint: String,
    },
    /// No CUDA device can be opened: no driver or GPU, no nvcc at build time, a bad
    /// `FLAME_GPU_MEMORY_LIMIT`, or the crate built without the `cuda` feature.
    #[error("CUDA is not available: {0}")]
    CudaUnavailable(String),
    /// A CUDA driver, cuBLAS or kernel launch call failed.
    #[error("CUDA: {0}")]
    Cuda(String),
    /// The requested work needs a backend that is not compiled in (the CPU without `cpu-ref`).
    #[error("no backend is compiled in for {0}: enable the `cpu-ref` feature")]
    NoBackend(&'static str),
    /// Training over several processes or GPUs (`dist`): a rank that failed or vanished,
    /// a broken connection, a rendezvous that timed out, an NCCL call that failed.
    #[error("distributed: {0}")]
    Dist(String),
    /// Training over several processes: another rank failed, was killed or left, so this
    /// one stops too. The cause is that rank's (a launcher names it, not this one).
    #[error("distributed: {0}")]
    PeerFailed(String),
    /// A lock inside FLAME (named here) was poisoned by a panic on another thread.
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

fn oom_where(limit: u64, device_full: bool) -> String {
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    match device_full {
        true => format!(
            "and the device itself has no more ({:.2} GiB in all: other processes and memory \
             outside FLAME's allocator hold the rest)",
            gib(limit)
        ),
        false => format!(
            "over the allocator's cap of {limit} bytes ({:.2} GiB: the budget less the CUDA \
             context, kernels and workspaces)",
            gib(limit)
        ),
    }
}

fn fmt_files(files: &[String]) -> String {
    if files.is_empty() {
        String::new()
    } else {
        format!("; the batch: {}", files.join(", "))
    }
}

impl Error {
    /// `self` with the phase it happened in (`what`: the phase, and the knob that would let
    /// it fit) where it is an out-of-memory error, bare or with the memory plan
    /// ([`Error::PlanExceeded`]); any other error as it is.
    pub fn in_phase(self, what: impl FnOnce() -> String) -> Error {
        match self {
            Error::OutOfMemory { .. } | Error::PlanExceeded { .. } => Error::Context {
                what: what(),
                error: Box::new(self),
            },
            e => e,
        }
    }

    pub(crate) fn invalid(op: &'static str, msg: impl Into<String>, shape: &Shape) -> Self {
        Error::InvalidArgument {
            op,
            msg: msg.into(),
            shape: shape.clone(),
        }
    }
}

/// The library's settings an [`Error::Setting`] names: fields of
/// [`crate::nn::AdapterConfig`], and the layout an adapter file is written in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Setting {
    /// `AdapterConfig::kind`.
    AdapterKind,
    /// `AdapterConfig::rank`.
    AdapterRank,
    /// `AdapterConfig::alpha`.
    AdapterAlpha,
    /// `AdapterConfig::conv_alpha`.
    AdapterConvAlpha,
    /// `AdapterConfig::dropout`.
    AdapterDropout,
    /// `AdapterConfig::module_dropout`.
    AdapterModuleDropout,
    /// `AdapterConfig::rank_dropout`.
    AdapterRankDropout,
    /// `AdapterConfig::factor`.
    AdapterFactor,
    /// `AdapterConfig::targets`.
    AdapterTargets,
    /// `AdapterConfig::tucker`.
    AdapterTucker,
    /// `AdapterConfig::per_projection`.
    AdapterPerProjection,
    /// `AdapterConfig::weight_decompose`.
    AdapterWeightDecompose,
    /// The layout of the adapter file written (`Adapters::save_peft`, `save_kohya`, ...).
    AdapterLayout,
    /// The per-block settings (`Adapters::with_blocks`).
    AdapterBlocks,
}

impl Setting {
    /// The setting in the library's terms.
    pub fn name(self) -> &'static str {
        match self {
            Setting::AdapterKind => "AdapterConfig::kind",
            Setting::AdapterRank => "AdapterConfig::rank",
            Setting::AdapterAlpha => "AdapterConfig::alpha",
            Setting::AdapterConvAlpha => "AdapterConfig::conv_alpha",
            Setting::AdapterDropout => "AdapterConfig::dropout",
            Setting::AdapterModuleDropout => "AdapterConfig::module_dropout",
            Setting::AdapterRankDropout => "AdapterConfig::rank_dropout",
            Setting::AdapterFactor => "AdapterConfig::factor",
            Setting::AdapterTargets => "AdapterConfig::targets",
            Setting::AdapterTucker => "AdapterConfig::tucker",
            Setting::AdapterPerProjection => "AdapterConfig::per_projection",
            Setting::AdapterBlocks => "Adapters::with_blocks",
            Setting::AdapterWeightDecompose => "AdapterConfig::weight_decompose",
            Setting::AdapterLayout => "the adapter file's layout:",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn oom() -> Error {
        Error::OutOfMemory {
            device: "cuda:0".into(),
            requested: 1 << 20,
            in_use: 7 << 30,
            limit: 7 << 30,
            device_full: false,
        }
    }

    #[test]
    fn an_out_of_memory_error_is_given_its_phase_and_no_other_is() {
        let phase = || "decoding (--vae-tile 256 decodes in smaller tiles)".to_string();
        let e = oom().in_phase(phase).to_string();
        assert!(
            e.starts_with("decoding (--vae-tile 256") && e.contains("out of GPU memory on cuda:0"),
            "{e}"
        );
        assert!(
            e.contains("allocator's cap") && !e.contains("device itself"),
            "{e}"
        );
        let planned = Error::PlanExceeded {
            error: Box::new(oom()),
            plan: "every block checkpointed".into(),
            hint: "lower memory.budget_gb".into(),
        };
        let e = planned.in_phase(phase).to_string();
        assert!(
            e.starts_with("decoding") && e.contains("memory plan: every block checkpointed"),
            "{e}"
        );
        let io = Error::Io {
            path: "x.png".into(),
            source: std::io::Error::other("No space left on device"),
        };
        assert!(matches!(io.in_phase(phase), Error::Io { .. }));
    }
}
