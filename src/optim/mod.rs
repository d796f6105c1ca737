//! Optimizers over named parameters: [`Sgd`], [`Adam`] and [`AdamW`], with the semantics of
//! PyTorch's `torch.optim.SGD`, `torch.optim.Adam` and `torch.optim.AdamW`
//! (<https://pytorch.org/docs/stable/optim.html>), [`AdamW8bit`], AdamW with block-wise
//! 8-bit moments as bitsandbytes' `AdamW8bit`, [`Prodigy`], Adam with a D-adapted step
//! size as the `prodigyopt` package's `Prodigy`, [`Lion`] and [`Lion8bit`], the sign
//! update of lion-pytorch's `Lion` with an f32 or block-wise 8-bit momentum, and the
//! schedule-free [`AdamWScheduleFree`] and [`ProdigyScheduleFree`] (the `schedulefree` and
//! `prodigy-plus-schedule-free` packages'), whose parameters move between the point the
//! gradient is taken at and the point to evaluate ([`Optimizer::eval_mode`]), and
//! [`Adafactor`], transformers' `Adafactor` (factored second moments, relative steps).
//!
//! Conventions shared by every optimizer here:
//! - Parameters are given as `(name, tensor)` pairs. Names are unique; each tensor is a float
//!   leaf that requires grad. A parameter with no gradient in the [`Grads`] passed to `step`
//!   is skipped and its state left as it was, as PyTorch skips parameters whose `.grad` is
//!   `None`.
//! - The update runs under [`no_grad`](crate::no_grad), in f32 for f32, bf16 and f16
//!   parameters and in f64 for f64 ones: the gradient and the parameter are cast up, the new
//!   value is computed and cast back, and [`Tensor::assign`] writes it into the parameter's
//!   storage, so every clone of the parameter handle sees it. Optimizer state (momentum
//!   buffers, moment estimates) is kept in that compute dtype.
//! - `step` checks every gradient (shape, dtype, device) before it updates anything.
//! - State is saved to and loaded from a safetensors file: tensors `<param>.<state>`
//!   (`momentum_buffer`, `exp_avg`, `exp_avg_sq`) and, in `__metadata__`, the optimizer kind
//!   (`"optimizer"`), its hyperparameters (`"lr"`, ...) and per-parameter step counts
//!   (`"step.<param>"`). Floats are written in Rust's shortest round-trip form, so a saved and
//!   reloaded optimizer continues bit for bit.
//! - [`AdamW8bit`] departs from two of these on purpose: its moments are 8-bit codes (U32
//!   tensors of packed codes plus F32 block maxima, saved as `<param>.exp_avg_codes`,
//!   `<param>.exp_avg_absmax`, ...), and it takes f32, bf16 and f16 parameters only.
//! - [`Prodigy`] takes f32, bf16 and f16 parameters on one device only (its step size is one
//!   estimate over all of them) and keeps that global state in the file's metadata.
//! - [`Lion`] and [`Lion8bit`] take contiguous f32, bf16 and f16 parameters (one fused step
//!   per device and dtype); Lion8bit's momenta are 8-bit codes as AdamW8bit's moments are.

mod adafactor;
mod adam;
mod adam8bit;
mod grouped;
mod lion;
mod prodigy;
mod schedulefree;
mod sgd;

pub use crate::backend::quant8;
pub use adafactor::{Adafactor, AdafactorConfig, AdafactorState};
pub use adam::{Adam, AdamConfig, AdamOptimizer, AdamState, AdamVariant, AdamW, Decoupled, L2};
pub use adam8bit::{AdamW8bit, AdamW8bitConfig, AdamW8bitState, QuantizedState};
pub use grouped::{build_groups, Grouped, ParamGroup};
pub use lion::{Lion, Lion8bit, Lion8bitConfig, LionConfig, LionState};
pub use prodigy::{Prodigy, ProdigyConfig, ProdigyEstimate, ProdigyState};
pub use schedulefree::{
    AdamWScheduleFree, AdamWScheduleFreeConfig, AdamWScheduleFreeGlobal, ProdigyScheduleFree,
    ProdigyScheduleFreeConfig, ProdigyScheduleFreeEstimate, ScheduleFreeState,
};
pub use sgd::{Sgd, SgdConfig};

use crate::safetensors::SafeTensorsFile;
use crate::{DType, Error, Grads, Result, Tensor};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

/// The optimizers a training run picks by name (`optimizer.kind`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum OptimizerKind {
    /// [`AdamW`]: f32 moments.
    AdamW,
    /// [`AdamW8bit`]: block-wise 8-bit moments.
    AdamW8bit,
    /// [`Prodigy`]: f32 moments, s and the first value p0.
    Prodigy,
    /// [`AdamWScheduleFree`]: f32 v and z.
    #[serde(rename = "adamw_schedulefree")]
    AdamWScheduleFree,
    /// [`ProdigyScheduleFree`]: f32 v and z, bf16 s and p0 of every 11th value.
    #[serde(rename = "prodigy_schedulefree")]
    ProdigyScheduleFree,
    /// [`Lion`]: an f32 momentum.
    Lion,
    /// [`Lion8bit`]: a block-wise 8-bit momentum.
    Lion8bit,
    /// [`Adafactor`]: factored f32 second moments, an f32 first moment with beta1.
    Adafactor,
}

impl OptimizerKind {
    /// Bytes of state per parameter value: AdamW's two f32 moments; AdamW8bit's two 8-bit
    /// codes and each block's f32 maximum per moment (parameters under 4096 values keep f32
    /// moments, a negligible share of a model's adapters); Prodigy's two f32 moments, s and
    /// p0 (less where beta1 = 0 or a parameter starts at zero, as LoRA's up matrices do);
    /// the schedule-free kinds' f32 v and z, and schedule-free Prodigy's bf16 s and p0 of
    /// every 11th value;
    /// Lion's f32 momentum; Lion8bit's one code and its block's share of an f32 maximum;
    /// Adafactor's at most: an f32 first moment (with beta1) and, for its factored second
    /// moments, the row and column means (4/rows + 4/cols bytes a value; 4 for a vector).
    pub fn state_bytes_per_value(self) -> f64 {
        match self {
            OptimizerKind::AdamW => 8.0,
            OptimizerKind::AdamW8bit => 2.0 + 8.0 / quant8::BLOCK as f64,
            OptimizerKind::Prodigy => 16.0,
            OptimizerKind::AdamWScheduleFree => 8.0,
            OptimizerKind::ProdigyScheduleFree => {
                8.0 + 4.0 / crate::backend::multi_sf::PRODIGY_SF_SLICE as f64
            }
            OptimizerKind::Lion => 4.0,
            OptimizerKind::Lion8bit => 1.0 + 4.0 / quant8::BLOCK as f64,
            OptimizerKind::Adafactor => 8.0,
        }
    }

    /// Whether the kind is schedule-free: its parameters hold the point the gradient is
    /// taken at, and [`Optimizer::eval_mode`] moves them to the weights to evaluate and
    /// save.
    pub fn is_schedule_free(self) -> bool {
        matches!(
            self,
            OptimizerKind::AdamWScheduleFree | OptimizerKind::ProdigyScheduleFree
        )
    }
}

/// An optimizer of some kind with its hyperparameters, as a training run builds it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum OptimizerConfig {
    /// [`AdamW`].
    AdamW(AdamConfig),
    /// [`AdamW8bit`].
    AdamW8bit(AdamW8bitConfig),
    /// [`Prodigy`].
    Prodigy(ProdigyConfig),
    /// [`AdamWScheduleFree`].
    AdamWScheduleFree(AdamWScheduleFreeConfig),
    /// [`ProdigyScheduleFree`].
    ProdigyScheduleFree(ProdigyScheduleFreeConfig),
    /// [`Lion`].
    Lion(LionConfig),
    /// [`Lion8bit`].
    Lion8bit(Lion8bitConfig),
    /// [`Adafactor`].
    Adafactor(AdafactorConfig),
}

impl OptimizerConfig {
    /// The kind.
    pub fn kind(&self) -> OptimizerKind {
        match self {
            OptimizerConfig::AdamW(_) => OptimizerKind::AdamW,
            OptimizerConfig::AdamW8bit(_) => OptimizerKind::AdamW8bit,
            OptimizerConfig::Prodigy(_) => OptimizerKind::Prodigy,
            OptimizerConfig::AdamWScheduleFree(_) => OptimizerKind::AdamWScheduleFree,
            OptimizerConfig::ProdigyScheduleFree(_) => OptimizerKind::ProdigyScheduleFree,
            OptimizerConfig::Lion(_) => OptimizerKind::Lion,
            OptimizerConfig::Lion8bit(_) => OptimizerKind::Lion8bit,
            OptimizerConfig::Adafactor(_) => OptimizerKind::Adafactor,
        }
    }

    /// The (peak) learning rate.
    pub fn lr(&self) -> f64 {
        match self {
            OptimizerConfig::AdamW(c) => c.lr,
            OptimizerConfig::AdamW8bit(c) => c.adam.lr,
            OptimizerConfig::Prodigy(c) => c.lr,
            OptimizerConfig::AdamWScheduleFree(c) => c.lr,
            OptimizerConfig::ProdigyScheduleFree(c) => c.lr,
            OptimizerConfig::Lion(c) => c.lr,
            OptimizerConfig::Lion8bit(c) => c.lion.lr,
            OptimizerConfig::Adafactor(c) => c.lr,
        }
    }

    /// The same optimizer with learning rate `lr`.
    pub fn with_lr(mut self, lr: f64) -> Self {
        match &mut self {
            OptimizerConfig::AdamW(c) => c.lr = lr,
            OptimizerConfig::AdamW8bit(c) => c.adam.lr = lr,
            OptimizerConfig::Prodigy(c) => c.lr = lr,
            OptimizerConfig::AdamWScheduleFree(c) => c.lr = lr,
            OptimizerConfig::ProdigyScheduleFree(c) => c.lr = lr,
            OptimizerConfig::Lion(c) => c.lr = lr,
            OptimizerConfig::Lion8bit(c) => c.lion.lr = lr,
            OptimizerConfig::Adafactor(c) => c.lr = lr,
        }
        self
    }

    /// The same optimizer with weight decay `wd`.
    pub fn with_weight_decay(mut self, wd: f64) -> Self {
        match &mut self {
            OptimizerConfig::AdamW(c) => c.weight_decay = wd,
            OptimizerConfig::AdamW8bit(c) => c.adam.weight_decay = wd,
            OptimizerConfig::Prodigy(c) => c.weight_decay = wd,
            OptimizerConfig::AdamWScheduleFree(c) => c.weight_decay = wd,
            OptimizerConfig::ProdigyScheduleFree(c) => c.weight_decay = wd,
            OptimizerConfig::Lion(c) => c.weight_decay = wd,
            OptimizerConfig::Lion8bit(c) => c.lion.weight_decay = wd,
            OptimizerConfig::Adafactor(c) => c.weight_decay = wd,
        }
        self
    }

    /// The optimizer over `params`.
    pub fn build(self, params: Vec<(String, Tensor)>) -> Result<Box<dyn Optimizer>> {
        Ok(match self {
            OptimizerConfig::AdamW(c) => Box::new(AdamW::new(params, c)?),
            OptimizerConfig::AdamW8bit(c) => Box::new(AdamW8bit::new(params, c)?),
            OptimizerConfig::Prodigy(c) => Box::new(Prodigy::new(params, c)?),
            OptimizerConfig::AdamWScheduleFree(c) => Box::new(AdamWScheduleFree::new(params, c)?),
            OptimizerConfig::ProdigyScheduleFree(c) => {
                Box::new(ProdigyScheduleFree::new(params, c)?)
            }
            OptimizerConfig::Lion(c) => Box::new(Lion::new(params, c)?),
            OptimizerConfig::Lion8bit(c) => Box::new(Lion8bit::new(params, c)?),
            OptimizerConfig::Adafactor(c) => Box::new(Adafactor::new(params, c)?),
        })
    }
}

/// An optimizer: updates its parameters in place from their gradients.
///
/// Object safe, so a trainer can hold a `Box<dyn Optimizer>`.
pub trait Optimizer {
    /// One update of every parameter that has a gradient in `grads`.
    fn step(&mut self, grads: &Grads) -> Result<()> {
        self.step_scaled(grads, 1.0)
    }

    /// One update with every gradient multiplied by `grad_scale` first (finite, > 0): the
    /// unscaling of a scaled loss and the clipping factor, folded into the update instead of
    /// a pass over the gradients.
    fn step_scaled(&mut self, grads: &Grads, grad_scale: f64) -> Result<()>;

    /// The current learning rate.
    fn learning_rate(&self) -> f64;

    /// Sets the learning rate for the following steps (for schedules). The value is checked
    /// by the next `step`: a negative or non-finite rate makes it fail.
    fn set_learning_rate(&mut self, lr: f64);

    /// Moves the parameters to the weights to evaluate and save (schedule-free's x, the
    /// packages' `optimizer.eval()`); nothing when they are there already, and nothing for
    /// an optimizer whose parameters are those weights.
    fn eval_mode(&mut self) -> Result<()> {
        Ok(())
    }

    /// Moves the parameters back to the point the next step takes its gradient at
    /// (schedule-free's y, `optimizer.train()`); nothing when they are there already, and
    /// nothing for other optimizers. A schedule-free step in eval mode is an error.
    fn train_mode(&mut self) -> Result<()> {
        Ok(())
    }

    /// Writes the optimizer's kind, hyperparameters and per-parameter state to a safetensors
    /// file at `path` (atomically: the file appears only once fully written). By default
    /// the state of [`Optimizer::save_state_to`] in a file of its own.
    fn save_state(&self, path: &Path) -> Result<()> {
        let mut out = StateMap::default();
        self.save_state_to(&mut out)?;
        out.save(path)
    }

    /// Replaces the state (and hyperparameters) with those saved by `save_state` of an
    /// optimizer of the same kind. Every state tensor in the file must belong to one of this
    /// optimizer's parameters and have its shape; on any error nothing is changed.
    /// Parameters absent from the file start with fresh state. By default
    /// [`Optimizer::load_state_from`] over the whole file.
    fn load_state(&mut self, path: &Path) -> Result<()> {
        let file = SafeTensorsFile::open(path)?;
        self.load_state_from(&StateSource::whole(&file))
    }

    /// Adds what `save_state` writes (tensors and metadata, under their own names) to `out`:
    /// how several optimizers share one file ([`Grouped`], one optimizer per parameter
    /// group).
    fn save_state_to(&self, out: &mut StateMap) -> Result<()>;

    /// Reads what `save_state_to` wrote from `src` (a whole file, or one group's part of
    /// it), with `load_state`'s checks.
    fn load_state_from(&mut self, src: &StateSource<'_>) -> Result<()>;
}

/// An optimizer's state being written: tensors by name and `__metadata__` entries, saved as
/// one safetensors file ([`StateMap::save`]); several optimizers' states go into one map
/// under prefixes ([`StateMap::absorb`]).
#[derive(Default)]
pub struct StateMap {
    tensors: Vec<(String, Tensor)>,
    metadata: BTreeMap<String, String>,
}

impl StateMap {
    /// Adds a tensor.
    pub fn tensor(&mut self, name: String, t: Tensor) {
        self.tensors.push((name, t));
    }

    /// Sets a metadata entry.
    pub fn meta(&mut self, key: String, value: String) {
        self.metadata.insert(key, value);
    }

    /// Every tensor and metadata entry of `other`, each name and key prefixed by `prefix`.
    pub fn absorb(&mut self, prefix: &str, other: StateMap) {
        for (n, t) in other.tensors {
            self.tensors.push((format!("{prefix}{n}"), t));
        }
        for (k, v) in other.metadata {
            self.metadata.insert(format!("{prefix}{k}"), v);
        }
    }

    /// Writes the map to a safetensors file at `path`, atomically.
    pub fn save(&self, path: &Path) -> Result<()> {
        crate::safetensors::save_with_metadata(
            self.tensors.iter().map(|(n, t)| (n.as_str(), t)),
            &self.metadata,
            path,
        )
    }
}

/// A saved state being read: a safetensors file, or the part of it under a prefix (one
/// parameter group's of a [`Grouped`] file), with names and metadata keys seen without
/// the prefix.
pub struct StateSource<'a> {
    file: &'a SafeTensorsFile,
    prefix: String,
    metadata: BTreeMap<String, String>,
    names: Vec<String>,
    shown: String,
}

impl<'a> StateSource<'a> {
    /// The whole of `file`.
    pub fn whole(file: &'a SafeTensorsFile) -> Self {
        Self::under(file, "")
    }

    /// The tensors and metadata of `file` whose names start with `prefix`, without it.
    pub fn under(file: &'a SafeTensorsFile, prefix: &str) -> Self {
        Self::under_except(file, prefix, &[])
    }

    /// [`StateSource::under`] without the metadata keys `skip` (after the prefix).
    pub fn under_except(file: &'a SafeTensorsFile, prefix: &str, skip: &[&str]) -> Self {
        let strip = |k: &str| k.strip_prefix(prefix).map(str::to_string);
        let metadata = file
            .metadata()
            .iter()
            .filter_map(|(k, v)| Some((strip(k)?, v.clone())))
            .filter(|(k, _)| !skip.contains(&k.as_str()))
            .collect();
        let names = file.names().filter_map(strip).collect();
        let shown = match prefix {
            "" => file.path().display().to_string(),
            p => format!("{} (entries {p}*)", file.path().display()),
        };
        StateSource {
            file,
            prefix: prefix.to_string(),
            metadata,
            names,
            shown,
        }
    }

    /// The metadata entries, keys without the prefix.
    pub fn metadata(&self) -> &BTreeMap<String, String> {
        &self.metadata
    }

    /// The tensors' names, without the prefix.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.names.iter().map(String::as_str)
    }

    /// A tensor's header entry.
    pub fn info(&self, name: &str) -> Option<&crate::safetensors::TensorInfo> {
        self.file.info(&format!("{}{name}", self.prefix))
    }

    /// A tensor as stored, on `device`.
    pub fn load(&self, name: &str, device: &crate::Device) -> Result<Tensor> {
        self.file.load(&format!("{}{name}", self.prefix), device)
    }

    /// A tensor in `dtype` on `device`.
    pub fn load_as(&self, name: &str, device: &crate::Device, dtype: DType) -> Result<Tensor> {
        self.file
            .load_as(&format!("{}{name}", self.prefix), device, dtype)
    }

    /// The file and part, for messages.
    pub fn shown(&self) -> &str {
        &self.shown
    }

    /// The file read.
    pub fn file(&self) -> &'a SafeTensorsFile {
        self.file
    }

    /// The prefix of this part's names ("" for a whole file).
    pub fn prefix(&self) -> &str {
        &self.prefix
    }
}

/// The error every optimizer returns.
fn opt_err(optimizer: &'static str, msg: impl Into<String>) -> Error {
    Error::Optimizer {
        optimizer,
        msg: msg.into(),
    }
}

/// The dtype an update of a `dtype` parameter is computed in: f64 for f64, else f32 (half
/// types gain the f32 accumulation PyTorch's mixed-precision recipes rely on).
fn compute_dtype(dtype: DType) -> DType {
    match dtype {
        DType::F64 => DType::F64,
        _ => DType::F32,
    }
}

/// A hyperparameter must be finite and at least `min`.
fn check_at_least(optimizer: &'static str, what: &str, value: f64, min: f64) -> Result<()> {
    if !value.is_finite() || value < min {
        return Err(opt_err(
            optimizer,
            format!("invalid {what} {value}: must be finite and >= {min}"),
        ));
    }
    Ok(())
}

/// A beta must lie in [0, 1), as torch.optim.Adam requires.
fn check_beta(optimizer: &'static str, what: &str, value: f64) -> Result<()> {
    if !(0.0..1.0).contains(&value) {
        return Err(opt_err(
            optimizer,
            format!("invalid {what} {value}: must be in [0, 1)"),
        ));
    }
    Ok(())
}

/// An exact, independent copy of `t` (same dtype and device), so that state never aliases a
/// tensor the caller owns (a gradient may later be modified in place with `assign`).
fn fresh_copy(t: &Tensor) -> Result<Tensor> {
    let out = Tensor::zeros(t.shape().clone(), t.dtype(), t.device())?;
    out.assign(t)?;
    Ok(out)
}

/// The parameters an optimizer updates, in the order given, with a name index.
struct ParamSet {
    optimizer: &'static str,
    params: Vec<(String, Tensor)>,
    index: HashMap<String, usize>,
}

impl ParamSet {
    /// What a fused multi-tensor step takes beyond [`ParamSet::new`]: contiguous parameters
    /// of f32, bf16 or f16 (the update is computed in f32).
    fn check_fused(&self) -> Result<()> {
        for (name, p) in &self.params {
            if !p.is_contiguous() {
                return Err(opt_err(
                    self.optimizer,
                    format!(
                        "parameter '{name}' is a strided view (shape {}); the fused step \
                         updates contiguous parameters",
                        p.shape()
                    ),
                ));
            }
            if !matches!(p.dtype(), DType::F32 | DType::BF16 | DType::F16) {
                return Err(opt_err(
                    self.optimizer,
                    format!(
                        "parameter '{name}': dtype {} is not supported (f32, bf16 or f16: the \
                         update is computed in f32)",
                        p.dtype()
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Checks the parameters: unique non-empty names, no tensor given twice, each a float leaf
    /// that requires grad and can be written in place (not a broadcast view).
    fn new(optimizer: &'static str, params: Vec<(String, Tensor)>) -> Result<Self> {
        if params.is_empty() {
            return Err(opt_err(
                optimizer,
                "no parameters to optimize (an empty list: did the adapter targets or the \
                 trainable filter match nothing?)",
            ));
        }
        let mut index = HashMap::with_capacity(params.len());
        let mut ids = HashMap::with_capacity(params.len());
        for (i, (name, p)) in params.iter().enumerate() {
            let bad = |msg: String| opt_err(optimizer, format!("parameter '{name}': {msg}"));
            if name.is_empty() {
                return Err(opt_err(
                    optimizer,
                    format!("parameter #{i} has an empty name"),
                ));
            }
            if index.insert(name.clone(), i).is_some() {
                return Err(bad("the name is given twice".into()));
            }
            if let Some(other) = ids.insert(p.id(), name) {
                return Err(bad(format!(
                    "the same tensor is also given as parameter '{other}'"
                )));
            }
            if !p.dtype().is_float() {
                return Err(bad(format!("dtype {} is not a float dtype", p.dtype())));
            }
            if !p.is_var() {
                return Err(bad(if p.requires_grad() {
                    format!(
                        "not a leaf: computed by an op (shape {}); detach() it and \
                         set_requires_grad(true)",
                        p.shape()
                    )
                } else {
                    format!("does not require grad (shape {})", p.shape())
                }));
            }
            let l = p.layout();
            if l.dims()
                .iter()
                .zip(l.strides())
                .any(|(&d, &s)| d > 1 && s == 0)
            {
                return Err(bad(format!(
                    "a broadcast view (shape {}) cannot be updated in place",
                    p.shape()
                )));
            }
        }
        Ok(ParamSet {
            optimizer,
            params,
            index,
        })
    }

    fn len(&self) -> usize {
        self.params.len()
    }

    /// The index and tensor of the parameter called `name`.
    fn lookup(&self, name: &str) -> Option<(usize, &Tensor)> {
        let i = *self.index.get(name)?;
        self.params.get(i).map(|(_, t)| (i, t))
    }

    /// Each parameter's gradient (`None` where it has none), in parameter order, after
    /// checking each against its parameter. Nothing is updated unless every gradient passes.
    fn gradients<'g>(&self, grads: &'g Grads) -> Result<Vec<Option<&'g Tensor>>> {
        let mut out = Vec::with_capacity(self.params.len());
        for (name, p) in &self.params {
            let g = grads.get(p);
            if let Some(g) = g {
                let bad = |msg: String| {
                    opt_err(
                        self.optimizer,
                        format!("parameter '{name}': gradient {msg}"),
                    )
                };
                if g.shape() != p.shape() {
                    return Err(bad(format!(
                        "shape {} does not match the parameter's shape {}",
                        g.shape(),
                        p.shape()
                    )));
                }
                if !g.dtype().is_float() {
                    return Err(bad(format!("dtype {} is not a float dtype", g.dtype())));
                }
                if g.device() != p.device() {
                    return Err(bad(format!(
                        "is on {} but the parameter is on {}",
                        g.device(),
                        p.device()
                    )));
                }
            }
            out.push(g);
        }
        Ok(out)
    }
}

/// Wraps an error raised while updating a parameter so that it names the parameter.
fn update_err(optimizer: &'static str, name: &str, e: Error) -> Error {
    opt_err(optimizer, format!("parameter '{name}': update failed: {e}"))
}

/// Per-parameter state tensors, each saved as `<param>.<suffix>`.
type StateTensors = Vec<HashMap<&'static str, Tensor>>;

/// Adds `tensors` (`(param index, suffix, tensor)`, saved as `<param>.<suffix>`) and
/// `metadata` (which must hold the `"optimizer"` kind) to `out`.
fn state_into(
    params: &ParamSet,
    tensors: Vec<(usize, &'static str, &Tensor)>,
    metadata: &BTreeMap<String, String>,
    out: &mut StateMap,
) {
    for (i, suffix, t) in tensors {
        if let Some((name, _)) = params.params.get(i) {
            out.tensor(format!("{name}.{suffix}"), t.clone());
        }
    }
    for (k, v) in metadata {
        out.meta(k.clone(), v.clone());
    }
}

/// For a state tensor (suffix, parameter): the exact dtype and shape it must have, or `None`
/// for a float tensor of the parameter's shape (see `LoadedState::read_with_from`).
type ExactState = dyn Fn(&str, &Tensor) -> Option<(DType, Vec<usize>)>;

/// A state file read and checked against an optimizer's parameters.
struct LoadedState {
    metadata: BTreeMap<String, String>,
    /// Indexed like the parameters: suffix -> tensor, in the parameter's compute dtype.
    tensors: StateTensors,
    path: String,
}

impl LoadedState {
    /// Reads `src` (a file or one group's part of one) and checks it: `"optimizer"` equals
    /// `kind`; every tensor is `<param>.<suffix>` for a known parameter and one of
    /// `suffixes`, of a float dtype and the parameter's shape; every metadata key is
    /// `"optimizer"`, one of `keys`, or (when `step_keys`) `"step.<param>"` for a known
    /// parameter.
    fn read_from(
        params: &ParamSet,
        kind: &str,
        suffixes: &[&'static str],
        keys: &[&str],
        step_keys: bool,
        src: &StateSource<'_>,
    ) -> Result<Self> {
        Self::read_with_from(params, kind, suffixes, keys, step_keys, &|_, _| None, src)
    }

    /// `read_from`, where `exact(suffix, param)` may instead require a tensor of exactly this
    /// dtype and shape (loaded as it is): `None` keeps `read_from`'s rule (a float tensor of
    /// the parameter's shape, loaded in its compute dtype).
    #[allow(clippy::too_many_arguments)]
    fn read_with_from(
        params: &ParamSet,
        kind: &str,
        suffixes: &[&'static str],
        keys: &[&str],
        step_keys: bool,
        exact: &ExactState,
        file: &StateSource<'_>,
    ) -> Result<Self> {
        let optimizer = params.optimizer;
        let shown = file.shown().to_string();
        let bad = |msg: String| opt_err(optimizer, format!("state file {shown}: {msg}"));
        let metadata = file.metadata().clone();
        match metadata.get("optimizer") {
            Some(k) if k == kind => {}
            Some(k) => {
                return Err(bad(format!(
                    "holds the state of optimizer kind '{k}', not '{kind}'"
                )))
            }
            None => return Err(bad("no \"optimizer\" kind in __metadata__".into())),
        }
        for key in metadata.keys() {
            if key == "optimizer" || keys.contains(&key.as_str()) {
                continue;
            }
            match key.strip_prefix("step.") {
                Some(p) if step_keys => {
                    if params.lookup(p).is_none() {
                        return Err(bad(format!(
                            "metadata key '{key}': '{p}' is not a parameter of this optimizer"
                        )));
                    }
                }
                _ => return Err(bad(format!("unexpected metadata key '{key}'"))),
            }
        }
        let mut tensors: StateTensors = vec![HashMap::new(); params.len()];
        for name in file.names() {
            let found = suffixes.iter().find_map(|s| {
                name.strip_suffix(s)
                    .and_then(|rest| rest.strip_suffix('.'))
                    .map(|p| (p, *s))
            });
            let Some((pname, suffix)) = found else {
                return Err(bad(format!(
                    "tensor '{name}' is not a state tensor of this optimizer (expected \
                     <param>.{})",
                    suffixes.join(" or <param>.")
                )));
            };
            let Some((i, p)) = params.lookup(pname) else {
                return Err(bad(format!(
                    "tensor '{name}' belongs to '{pname}', which is not a parameter of this \
                     optimizer"
                )));
            };
            let info = file
                .info(name)
                .ok_or_else(|| bad(format!("tensor '{name}' vanished from the header")))?;
            if let Some((dtype, dims)) = exact(suffix, p) {
                if info.flame_dtype() != Some(dtype) || info.shape != dims {
                    return Err(bad(format!(
                        "tensor '{name}' is {} {:?}, expected {dtype} {dims:?} for parameter \
                         '{pname}' of shape {}",
                        info.dtype,
                        info.shape,
                        p.shape()
                    )));
                }
                let t = file.load(name, p.device())?;
                if let Some(slot) = tensors.get_mut(i) {
                    slot.insert(suffix, t);
                }
                continue;
            }
            if info.shape.as_slice() != p.dims() {
                return Err(bad(format!(
                    "tensor '{name}' has shape {:?} but parameter '{pname}' has shape {}",
                    info.shape,
                    p.shape()
                )));
            }
            match info.flame_dtype() {
                Some(d) if d.is_float() => {}
                _ => {
                    return Err(bad(format!(
                        "tensor '{name}' has dtype {}, not a float dtype",
                        info.dtype
                    )))
                }
            }
            let t = file.load_as(name, p.device(), compute_dtype(p.dtype()))?;
            if let Some(slot) = tensors.get_mut(i) {
                slot.insert(suffix, t);
            }
        }
        Ok(LoadedState {
            metadata,
            tensors,
            path: shown,
        })
    }

    fn err(&self, optimizer: &'static str, msg: String) -> Error {
        opt_err(optimizer, format!("state file {}: {msg}", self.path))
    }

    /// A metadata value parsed as `T`.
    fn parse<T: std::str::FromStr>(&self, optimizer: &'static str, key: &str) -> Result<T> {
        let v = self
            .metadata
            .get(key)
            .ok_or_else(|| self.err(optimizer, format!("no '{key}' in __metadata__")))?;
        v.parse().map_err(|_| {
            self.err(
                optimizer,
                format!("metadata '{key}' = '{v}' is not a valid value"),
            )
        })
    }

    /// The step count saved for a parameter, if any.
    fn step(&self, optimizer: &'static str, param: &str) -> Result<Option<u64>> {
        let key = format!("step.{param}");
        if !self.metadata.contains_key(&key) {
            return Ok(None);
        }
        self.parse(optimizer, &key).map(Some)
    }
}

/// Metadata map starting with the optimizer kind.
fn metadata_for(kind: &str, hyper: &[(&str, String)]) -> BTreeMap<String, String> {
    let mut m = BTreeMap::new();
    m.insert("optimizer".to_string(), kind.to_string());
    for (k, v) in hyper {
        m.insert(k.to_string(), v.clone());
    }
    m
}

/// A gradient scale must be finite and > 0.
fn check_grad_scale(optimizer: &'static str, s: f64) -> Result<()> {
    if !s.is_finite() || s <= 0.0 {
        return Err(opt_err(
            optimizer,
            format!("invalid gradient scale {s}: must be finite and > 0"),
        ));
    }
    Ok(())
}

/// Checks the learning rate before a step (it may have been set after construction).
fn check_lr(optimizer: &'static str, lr: f64) -> Result<()> {
    check_at_least(optimizer, "learning rate", lr, 0.0)
}
