//! Stochastic gradient descent with momentum, dampening, L2 weight decay and Nesterov
//! momentum, following PyTorch's `torch.optim.SGD`
//! (<https://pytorch.org/docs/stable/generated/torch.optim.SGD.html>). Per step, for a
//! parameter `p` with gradient `g`:
//!
//! ```text
//! g = g + weight_decay * p                          (if weight_decay != 0)
//! if momentum != 0:
//!     buf = g                                       (first step of this parameter)
//!     buf = momentum * buf + (1 - dampening) * g    (later steps)
//!     g = g + momentum * buf   if nesterov   else   g = buf
//! p = p - lr * g
//! ```
//!
//! The Nesterov form is PyTorch's reformulation of Sutskever et al. 2013, "On the importance
//! of initialization and momentum in deep learning".

use super::{
    check_at_least, check_grad_scale, check_lr, compute_dtype, fresh_copy, metadata_for, opt_err,
    state_into, update_err, LoadedState, Optimizer, ParamSet, StateMap, StateSource,
};
use crate::{Grads, Result, Tensor};

const NAME: &str = "SGD";
const KIND: &str = "sgd";
const BUFFER: &str = "momentum_buffer";

/// Hyperparameters of [`Sgd`]; the defaults are PyTorch's (lr 1e-3, everything else off).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SgdConfig {
    /// Learning rate, >= 0.
    pub lr: f64,
    /// Momentum factor, >= 0 (0: plain SGD).
    pub momentum: f64,
    /// Scales the gradient's share of the momentum buffer by `1 - dampening`.
    pub dampening: f64,
    /// L2 penalty: `weight_decay * p` is added to the gradient.
    pub weight_decay: f64,
    /// Nesterov momentum (needs momentum > 0 and zero dampening).
    pub nesterov: bool,
}

impl Default for SgdConfig {
    fn default() -> Self {
        SgdConfig {
            lr: 1e-3,
            momentum: 0.0,
            dampening: 0.0,
            weight_decay: 0.0,
            nesterov: false,
        }
    }
}

impl SgdConfig {
    /// The checks of torch.optim.SGD's constructor (lr, momentum and weight decay >= 0;
    /// Nesterov needs momentum > 0 and zero dampening), plus finiteness.
    fn validate(&self) -> Result<()> {
        check_at_least(NAME, "learning rate", self.lr, 0.0)?;
        check_at_least(NAME, "momentum", self.momentum, 0.0)?;
        check_at_least(NAME, "weight_decay", self.weight_decay, 0.0)?;
        if !self.dampening.is_finite() {
            return Err(opt_err(
                NAME,
                format!("invalid dampening {}: must be finite", self.dampening),
            ));
        }
        if self.nesterov && (self.momentum <= 0.0 || self.dampening != 0.0) {
            return Err(opt_err(
                NAME,
                format!(
                    "Nesterov momentum requires a momentum > 0 and zero dampening (momentum {}, \
                     dampening {})",
                    self.momentum, self.dampening
                ),
            ));
        }
        Ok(())
    }

    fn to_metadata(self) -> Vec<(&'static str, String)> {
        vec![
            ("lr", self.lr.to_string()),
            ("momentum", self.momentum.to_string()),
            ("dampening", self.dampening.to_string()),
            ("weight_decay", self.weight_decay.to_string()),
            ("nesterov", self.nesterov.to_string()),
        ]
    }

    fn from_metadata(state: &LoadedState) -> Result<Self> {
        let c = SgdConfig {
            lr: state.parse(NAME, "lr")?,
            momentum: state.parse(NAME, "momentum")?,
            dampening: state.parse(NAME, "dampening")?,
            weight_decay: state.parse(NAME, "weight_decay")?,
            nesterov: state.parse(NAME, "nesterov")?,
        };
        c.validate()?;
        Ok(c)
    }
}

const HYPER_KEYS: &[&str] = &["lr", "momentum", "dampening", "weight_decay", "nesterov"];

/// SGD over named parameters (see the module docs for the update).
pub struct Sgd {
    config: SgdConfig,
    params: ParamSet,
    /// Momentum buffers in the compute dtype, indexed like `params`; `None` until the
    /// parameter's first step with momentum.
    buffers: Vec<Option<Tensor>>,
}

impl std::fmt::Debug for Sgd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sgd")
            .field("config", &self.config)
            .field("params", &self.params.len())
            .finish()
    }
}

impl Sgd {
    /// Checks `config` and the parameters (unique names; float leaves that require grad).
    pub fn new(params: Vec<(String, Tensor)>, config: SgdConfig) -> Result<Self> {
        config.validate()?;
        let params = ParamSet::new(NAME, params)?;
        let buffers = vec![None; params.len()];
        Ok(Sgd {
            config,
            params,
            buffers,
        })
    }

    /// The hyperparameters in use.
    pub fn config(&self) -> &SgdConfig {
        &self.config
    }

    /// The parameters, in the order given.
    pub fn params(&self) -> &[(String, Tensor)] {
        &self.params.params
    }

    /// The momentum buffer of a parameter, once it has one (in the compute dtype).
    pub fn momentum_buffer(&self, name: &str) -> Option<&Tensor> {
        self.params
            .lookup(name)
            .and_then(|(i, _)| self.buffers.get(i))
            .and_then(Option::as_ref)
    }
}

/// Updates `p` from `grad`; the new momentum buffer is stored in `buffer` only once the
/// parameter has been written.
fn update(c: &SgdConfig, p: &Tensor, grad: &Tensor, buffer: &mut Option<Tensor>) -> Result<()> {
    let cd = compute_dtype(p.dtype());
    let p_up = p.to_dtype(cd)?;
    let mut d = grad.to_dtype(cd)?;
    if c.weight_decay != 0.0 {
        d = d.add(&p_up.affine(c.weight_decay, 0.0)?)?;
    }
    let mut new_buf = None;
    if c.momentum != 0.0 {
        let buf = match buffer.as_ref() {
            // torch.optim.SGD: the first buffer is a copy of the gradient, undampened.
            None if d.same_storage(grad) => fresh_copy(&d)?,
            None => d.clone(),
            Some(b) => {
                let decayed = b.affine(c.momentum, 0.0)?;
                if c.dampening == 0.0 {
                    decayed.add(&d)?
                } else {
                    decayed.add(&d.affine(1.0 - c.dampening, 0.0)?)?
                }
            }
        };
        d = if c.nesterov {
            d.add(&buf.affine(c.momentum, 0.0)?)?
        } else {
            buf.clone()
        };
        new_buf = Some(buf);
    }
    let new_p = p_up.add(&d.affine(-c.lr, 0.0)?)?.to_dtype(p.dtype())?;
    p.assign(&new_p)?;
    if new_buf.is_some() {
        *buffer = new_buf;
    }
    Ok(())
}

impl Optimizer for Sgd {
    fn step_scaled(&mut self, grads: &Grads, grad_scale: f64) -> Result<()> {
        check_lr(NAME, self.config.lr)?;
        check_grad_scale(NAME, grad_scale)?;
        let _guard = crate::no_grad();
        let gs = self.params.gradients(grads)?;
        let params = self.params.params.iter().zip(gs);
        for (((name, p), g), buffer) in params.zip(self.buffers.iter_mut()) {
            if let Some(g) = g {
                let scaled;
                let g = if grad_scale == 1.0 {
                    g
                } else {
                    scaled = g.affine(grad_scale, 0.0)?;
                    &scaled
                };
                update(&self.config, p, g, buffer).map_err(|e| update_err(NAME, name, e))?;
            }
        }
        Ok(())
    }

    fn learning_rate(&self) -> f64 {
        self.config.lr
    }

    fn set_learning_rate(&mut self, lr: f64) {
        self.config.lr = lr;
    }

    fn save_state_to(&self, out: &mut StateMap) -> Result<()> {
        let tensors = self
            .buffers
            .iter()
            .enumerate()
            .filter_map(|(i, b)| b.as_ref().map(|b| (i, BUFFER, b)))
            .collect();
        let metadata = metadata_for(KIND, &self.config.to_metadata());
        state_into(&self.params, tensors, &metadata, out);
        Ok(())
    }

    fn load_state_from(&mut self, src: &StateSource<'_>) -> Result<()> {
        let _guard = crate::no_grad();
        let mut state =
            LoadedState::read_from(&self.params, KIND, &[BUFFER], HYPER_KEYS, false, src)?;
        let config = SgdConfig::from_metadata(&state)?;
        let buffers = state.tensors.iter_mut().map(|t| t.remove(BUFFER)).collect();
        self.config = config;
        self.buffers = buffers;
        Ok(())
    }
}
