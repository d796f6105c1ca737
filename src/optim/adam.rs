//! Adam (Kingma & Ba 2015, "Adam: A Method for Stochastic Optimization", Algorithm 1) and
//! AdamW (Loshchilov & Hutter 2019, "Decoupled Weight Decay Regularization", Algorithm 2),
//! one implementation for both, following PyTorch's `torch.optim.Adam` and
//! `torch.optim.AdamW` (<https://pytorch.org/docs/stable/generated/torch.optim.Adam.html>,
//! <https://pytorch.org/docs/stable/generated/torch.optim.AdamW.html>). Per step, for a
//! parameter `p` with gradient `g` and this parameter's step count `t` (1 on its first step):
//!
//! ```text
//! Adam:  g = g + weight_decay * p            (L2 penalty, added to the gradient)
//! AdamW: p = p * (1 - lr * weight_decay)     (decoupled decay, before the Adam update)
//! m = beta1 * m + (1 - beta1) * g            (m, v start at 0)
//! v = beta2 * v + (1 - beta2) * g * g
//! p = p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
//! ```
//!
//! `eps` is added after the square root of the bias-corrected `v`, as in PyTorch (and
//! Kingma & Ba's Algorithm 1); the bias corrections are computed in f64.

use super::{
    check_at_least, check_beta, check_grad_scale, check_lr, compute_dtype, metadata_for, opt_err,
    state_into, update_err, LoadedState, Optimizer, ParamSet, StateMap, StateSource,
};
use crate::backend::multi::{AdamBias, AdamHyper};
use crate::tensor::multi::{adam_multi, AdamSlot, Moments};
use crate::{DType, Grads, Result, Tensor};
use std::marker::PhantomData;

const EXP_AVG: &str = "exp_avg";
const EXP_AVG_SQ: &str = "exp_avg_sq";
pub(super) const HYPER_KEYS: &[&str] = &["lr", "beta1", "beta2", "eps", "weight_decay"];

/// Hyperparameters of [`Adam`] and [`AdamW`]. The defaults are torch.optim.Adam's (lr 1e-3,
/// betas (0.9, 0.999), eps 1e-8, weight_decay 0); note torch.optim.AdamW defaults
/// weight_decay to 1e-2, which must be set explicitly here.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamConfig {
    /// Learning rate, >= 0.
    pub lr: f64,
    /// Decay rate of the first moment `m`, in `[0, 1)`.
    pub beta1: f64,
    /// Decay rate of the second moment `v`, in `[0, 1)`.
    pub beta2: f64,
    /// Added to the bias-corrected `sqrt(v)`, >= 0.
    pub eps: f64,
    /// L2 penalty for [`Adam`], decoupled decay rate for [`AdamW`].
    pub weight_decay: f64,
}

impl Default for AdamConfig {
    fn default() -> Self {
        AdamConfig {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
        }
    }
}

impl AdamConfig {
    /// torch.optim.Adam's checks: lr, eps and weight_decay >= 0, betas in [0, 1); plus
    /// finiteness.
    pub(super) fn validate(&self, optimizer: &'static str) -> Result<()> {
        check_at_least(optimizer, "learning rate", self.lr, 0.0)?;
        check_beta(optimizer, "beta1", self.beta1)?;
        check_beta(optimizer, "beta2", self.beta2)?;
        check_at_least(optimizer, "eps", self.eps, 0.0)?;
        check_at_least(optimizer, "weight_decay", self.weight_decay, 0.0)
    }

    pub(super) fn to_metadata(self) -> Vec<(&'static str, String)> {
        vec![
            ("lr", self.lr.to_string()),
            ("beta1", self.beta1.to_string()),
            ("beta2", self.beta2.to_string()),
            ("eps", self.eps.to_string()),
            ("weight_decay", self.weight_decay.to_string()),
        ]
    }

    pub(super) fn from_metadata(optimizer: &'static str, state: &LoadedState) -> Result<Self> {
        let c = AdamConfig {
            lr: state.parse(optimizer, "lr")?,
            beta1: state.parse(optimizer, "beta1")?,
            beta2: state.parse(optimizer, "beta2")?,
            eps: state.parse(optimizer, "eps")?,
            weight_decay: state.parse(optimizer, "weight_decay")?,
        };
        c.validate(optimizer)?;
        Ok(c)
    }
}

/// How weight decay is applied: the one difference between Adam and AdamW.
pub trait AdamVariant: private::Sealed {
    /// The name in error messages.
    const NAME: &'static str;
    /// The `"optimizer"` kind in state files.
    const KIND: &'static str;
    /// Decoupled (AdamW) rather than L2 added to the gradient (Adam).
    const DECOUPLED: bool;
}

mod private {
    pub trait Sealed {}
    impl Sealed for super::L2 {}
    impl Sealed for super::Decoupled {}
}

/// Weight decay as an L2 penalty added to the gradient: [`Adam`].
#[derive(Debug, Clone, Copy)]
pub struct L2;

/// Weight decay decoupled from the gradient: [`AdamW`].
#[derive(Debug, Clone, Copy)]
pub struct Decoupled;

impl AdamVariant for L2 {
    const NAME: &'static str = "Adam";
    const KIND: &'static str = "adam";
    const DECOUPLED: bool = false;
}

impl AdamVariant for Decoupled {
    const NAME: &'static str = "AdamW";
    const KIND: &'static str = "adamw";
    const DECOUPLED: bool = true;
}

/// Adam with L2 weight decay, as torch.optim.Adam.
pub type Adam = AdamOptimizer<L2>;

/// Adam with decoupled weight decay, as torch.optim.AdamW.
pub type AdamW = AdamOptimizer<Decoupled>;

/// One parameter's Adam state, in the parameter's compute dtype.
#[derive(Debug, Clone)]
pub struct AdamState {
    /// Steps taken by this parameter (it has state only after its first).
    pub step: u64,
    /// First-moment estimate `m`.
    pub exp_avg: Tensor,
    /// Second-moment estimate `v`.
    pub exp_avg_sq: Tensor,
}

/// The shared implementation of [`Adam`] and [`AdamW`]; use those aliases.
pub struct AdamOptimizer<V: AdamVariant> {
    config: AdamConfig,
    params: ParamSet,
    /// Indexed like `params`; `None` until the parameter's first step.
    state: Vec<Option<AdamState>>,
    variant: PhantomData<V>,
}

impl<V: AdamVariant> std::fmt::Debug for AdamOptimizer<V> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct(V::NAME)
            .field("config", &self.config)
            .field("params", &self.params.len())
            .finish()
    }
}

impl<V: AdamVariant> AdamOptimizer<V> {
    /// Checks `config` and the parameters (unique names; float leaves that require grad).
    pub fn new(params: Vec<(String, Tensor)>, config: AdamConfig) -> Result<Self> {
        config.validate(V::NAME)?;
        let params = ParamSet::new(V::NAME, params)?;
        let state = vec![None; params.len()];
        Ok(AdamOptimizer {
            config,
            params,
            state,
            variant: PhantomData,
        })
    }

    /// The hyperparameters in use.
    pub fn config(&self) -> &AdamConfig {
        &self.config
    }

    /// The parameters, in the order given.
    pub fn params(&self) -> &[(String, Tensor)] {
        &self.params.params
    }

    /// A parameter's state, once it has taken a step.
    pub fn state(&self, name: &str) -> Option<&AdamState> {
        self.params
            .lookup(name)
            .and_then(|(i, _)| self.state.get(i))
            .and_then(Option::as_ref)
    }
}

/// The group scalars of a step of `c` (AdamW: `decoupled`), rounded once to f32.
pub(super) fn hyper(c: &AdamConfig, decoupled: bool, grad_scale: f64) -> AdamHyper {
    AdamHyper {
        beta1: c.beta1 as f32,
        beta2: c.beta2 as f32,
        one_minus_beta1: (1.0 - c.beta1) as f32,
        one_minus_beta2: (1.0 - c.beta2) as f32,
        eps: c.eps as f32,
        // Loshchilov & Hutter 2019, Algorithm 2 line 12, in torch.optim.AdamW's form:
        // p <- p * (1 - lr * weight_decay), before the Adam step; torch.optim.Adam adds
        // weight_decay * p to the gradient instead.
        decay: if decoupled {
            (1.0 - c.lr * c.weight_decay) as f32
        } else {
            1.0
        },
        l2: if decoupled {
            0.0
        } else {
            c.weight_decay as f32
        },
        grad_scale: grad_scale as f32,
    }
}

/// The bias corrections of step `t` (>= 1) of `c`, in f64 and rounded once to f32
/// (torch.optim.Adam: step_size = lr / (1 - beta1^t), denom = sqrt(v) / sqrt(1 - beta2^t) + eps).
pub(super) fn bias(c: &AdamConfig, t: u64) -> AdamBias {
    let t = t as f64;
    AdamBias {
        step_size: (c.lr / (1.0 - c.beta1.powf(t))) as f32,
        bias2_sqrt: (1.0 - c.beta2.powf(t)).sqrt() as f32,
    }
}

/// Whether the fused multi-tensor step takes `p`: f32, bf16 or f16 and contiguous.
pub(super) fn fused_step(p: &Tensor) -> bool {
    matches!(p.dtype(), DType::F32 | DType::BF16 | DType::F16) && p.is_contiguous()
}

/// Updates `p` from `grad` (times `grad_scale`) with tensor ops, for parameters the fused
/// step does not take (f64, or not contiguous); the new state is stored in `state` only once
/// the parameter has been written.
pub(super) fn update(
    c: &AdamConfig,
    decoupled: bool,
    grad_scale: f64,
    p: &Tensor,
    grad: &Tensor,
    state: &mut Option<AdamState>,
) -> Result<()> {
    let cd = compute_dtype(p.dtype());
    let mut p_up = p.to_dtype(cd)?;
    let mut g = grad.to_dtype(cd)?;
    if grad_scale != 1.0 {
        g = g.affine(grad_scale, 0.0)?;
    }
    if c.weight_decay != 0.0 {
        if decoupled {
            // Loshchilov & Hutter 2019, Algorithm 2 line 12, in torch.optim.AdamW's form:
            // p <- p * (1 - lr * weight_decay), before the Adam step.
            p_up = p_up.affine(1.0 - c.lr * c.weight_decay, 0.0)?;
        } else {
            // torch.optim.Adam: g <- g + weight_decay * p.
            g = g.add(&p_up.affine(c.weight_decay, 0.0)?)?;
        }
    }
    // Kingma & Ba 2015, Algorithm 1: biased moment estimates, starting from zero (the
    // first step's b * 0 terms are left out).
    let g_sq = g.mul(&g)?;
    let (step, m, v) = match state.as_ref() {
        None => (
            1,
            g.affine(1.0 - c.beta1, 0.0)?,
            g_sq.affine(1.0 - c.beta2, 0.0)?,
        ),
        Some(s) => (
            s.step.saturating_add(1),
            s.exp_avg
                .affine(c.beta1, 0.0)?
                .add(&g.affine(1.0 - c.beta1, 0.0)?)?,
            s.exp_avg_sq
                .affine(c.beta2, 0.0)?
                .add(&g_sq.affine(1.0 - c.beta2, 0.0)?)?,
        ),
    };
    // Bias corrections, as torch.optim.Adam: step_size = lr / (1 - beta1^t),
    // denom = sqrt(v) / sqrt(1 - beta2^t) + eps.
    let t = step as f64;
    let bias1 = 1.0 - c.beta1.powf(t);
    let bias2_sqrt = (1.0 - c.beta2.powf(t)).sqrt();
    let step_size = c.lr / bias1;
    let denom = v.sqrt()?.affine(1.0 / bias2_sqrt, c.eps)?;
    let new_p = p_up
        .sub(&m.div(&denom)?.affine(step_size, 0.0)?)?
        .to_dtype(p.dtype())?;
    p.assign(&new_p)?;
    *state = Some(AdamState {
        step,
        exp_avg: m,
        exp_avg_sq: v,
    });
    Ok(())
}

impl<V: AdamVariant> Optimizer for AdamOptimizer<V> {
    fn step_scaled(&mut self, grads: &Grads, grad_scale: f64) -> Result<()> {
        check_lr(V::NAME, self.config.lr)?;
        check_grad_scale(V::NAME, grad_scale)?;
        let _guard = crate::no_grad();
        let gs = self.params.gradients(grads)?;
        let h = hyper(&self.config, V::DECOUPLED, grad_scale);
        // Parameters the fused step takes: their gradient (contiguous, the parameter's
        // dtype), their moments (fresh zeros before the first step) and the step they take.
        let mut fused: Vec<(usize, Tensor, Tensor, Tensor, u64)> = vec![];
        for (i, ((name, p), g)) in self.params.params.iter().zip(&gs).enumerate() {
            let Some(g) = g else { continue };
            if !fused_step(p) {
                update(
                    &self.config,
                    V::DECOUPLED,
                    grad_scale,
                    p,
                    g,
                    &mut self.state[i],
                )
                .map_err(|e| update_err(V::NAME, name, e))?;
                continue;
            }
            let prep = || -> Result<_> {
                let g = g.to_dtype(p.dtype())?.contiguous()?;
                Ok(match &self.state[i] {
                    Some(s) => (g, s.exp_avg.clone(), s.exp_avg_sq.clone(), s.step),
                    None => {
                        let z = || Tensor::zeros(p.shape().clone(), DType::F32, p.device());
                        (g, z()?, z()?, 0)
                    }
                })
            };
            let (g, m, v, step) = prep().map_err(|e| update_err(V::NAME, name, e))?;
            fused.push((i, g, m, v, step.saturating_add(1)));
        }
        let slots: Vec<AdamSlot<'_>> = fused
            .iter()
            .map(|(i, g, m, v, t)| AdamSlot {
                p: &self.params.params[*i].1,
                g,
                moments: Moments::Full { m, v },
                bias: bias(&self.config, *t),
            })
            .collect();
        adam_multi(&h, &[], &slots).map_err(|e| opt_err(V::NAME, e.to_string()))?;
        for (i, _, m, v, t) in fused {
            self.state[i] = Some(AdamState {
                step: t,
                exp_avg: m,
                exp_avg_sq: v,
            });
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
        let mut tensors = Vec::new();
        let mut metadata = metadata_for(V::KIND, &self.config.to_metadata());
        for (i, ((name, _), s)) in self.params.params.iter().zip(&self.state).enumerate() {
            if let Some(s) = s {
                tensors.push((i, EXP_AVG, &s.exp_avg));
                tensors.push((i, EXP_AVG_SQ, &s.exp_avg_sq));
                metadata.insert(format!("step.{name}"), s.step.to_string());
            }
        }
        state_into(&self.params, tensors, &metadata, out);
        Ok(())
    }

    fn load_state_from(&mut self, src: &StateSource<'_>) -> Result<()> {
        let _guard = crate::no_grad();
        let mut loaded = LoadedState::read_from(
            &self.params,
            V::KIND,
            &[EXP_AVG, EXP_AVG_SQ],
            HYPER_KEYS,
            true,
            src,
        )?;
        let config = AdamConfig::from_metadata(V::NAME, &loaded)?;
        let mut state = Vec::with_capacity(self.params.len());
        let per_param = std::mem::take(&mut loaded.tensors);
        for ((name, _), mut tensors) in self.params.params.iter().zip(per_param) {
            let step = loaded.step(V::NAME, name)?;
            let (m, v) = (tensors.remove(EXP_AVG), tensors.remove(EXP_AVG_SQ));
            state.push(match (step, m, v) {
                (None, None, None) => None,
                (Some(step), Some(exp_avg), Some(exp_avg_sq)) if step >= 1 => Some(AdamState {
                    step,
                    exp_avg,
                    exp_avg_sq,
                }),
                (step, m, v) => {
                    return Err(loaded.err(
                        V::NAME,
                        format!(
                            "parameter '{name}': incomplete state (step {}, {name}.{EXP_AVG} \
                             {}, {name}.{EXP_AVG_SQ} {}); a parameter's state is a step >= 1 \
                             and both moment tensors, or nothing",
                            step.map_or("missing".into(), |s| s.to_string()),
                            if m.is_some() { "present" } else { "missing" },
                            if v.is_some() { "present" } else { "missing" },
                        ),
                    ))
                }
            });
        }
        self.config = config;
        self.state = state;
        Ok(())
    }
}
