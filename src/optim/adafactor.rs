//! Adafactor (Shazeer & Stern 2018, "Adafactor: Adaptive Learning Rates with Sublinear
//! Memory Cost", <https://arxiv.org/abs/1804.04235>) with the semantics of transformers 5's
//! `transformers.optimization.Adafactor` (itself fairseq's). Per step, for a parameter `p`
//! with gradient `g`, this parameter's step count `t` (1 on its first step) and `n` values:
//!
//! ```text
//! rms(x)  = ||x||_2 / sqrt(n)
//! lr_t    = relative_step ? lr * min(warmup_init ? 1e-6 t : 1e-2, 1 / sqrt(t)) : lr
//! lr_t    = scale_parameter ? max(eps2, rms(p)) * lr_t : lr_t
//! beta2t  = 1 - t^decay_rate
//! u       = g^2 + eps1
//! p of two or more dims (factored: row and column means of u, over the last two dims):
//!   R = beta2t R + (1 - beta2t) mean_{-1}(u)       (R, C start at 0)
//!   C = beta2t C + (1 - beta2t) mean_{-2}(u)
//!   u = g / sqrt(R / mean_{-1}(R))[..., None] / sqrt(C)[..., None, :]
//! else:
//!   V = beta2t V + (1 - beta2t) u;  u = g / sqrt(V)
//! u = lr_t u / max(rms(u) / clip_threshold, 1)
//! beta1 set:  m = beta1 m + (1 - beta1) u;  u = m      (m starts at 0)
//! p = p - weight_decay lr_t p;  p = p - u
//! ```
//!
//! `lr` differs from transformers' in one way: with `relative_step` it multiplies the relative
//! step (1.0, the default, is transformers'; transformers refuses an `lr` there), so a
//! parameter group's learning-rate multiplier scales its step as it does for other kinds.
//!
//! The step is one fused multi-tensor call per device (`tensor::multi::adafactor_multi`,
//! `backend::adafactor` gives it operation by operation): on CUDA five launches over every
//! parameter, whatever their number, with `max(eps2, rms(p))` and the clipping worked out on
//! the device, so a step reads nothing back to the host. The update is computed in f32 for
//! f32, bf16 and f16 parameters, as transformers computes half parameters in f32. The same
//! step composed of tensor ops ([`Adafactor::step_composite`]) is its reference, and takes
//! the parameters the fused step does not (f64 ones, computed in f64, and strided views).
//!
//! State files: `<param>.exp_avg_sq_row` (the parameter's dims but the last) and
//! `<param>.exp_avg_sq_col` (its dims but the second to last) for factored parameters,
//! `<param>.exp_avg_sq` for others, `<param>.exp_avg` with beta1; metadata `optimizer`
//! ("adafactor"), the hyperparameters (`lr`, `eps1`, `eps2`, `clip_threshold`, `decay_rate`,
//! `beta1` ("none" when unset), `weight_decay`, `scale_parameter`, `relative_step`,
//! `warmup_init`) and `step.<param>`. transformers' per-parameter `RMS` is recomputed from the
//! parameter at each step before it is read, so it is not state.

use super::{
    check_at_least, check_beta, check_grad_scale, check_lr, compute_dtype, metadata_for, opt_err,
    state_into, update_err, LoadedState, Optimizer, ParamSet, StateMap, StateSource,
};
use crate::backend::adafactor::{AdafactorHyper, AdafactorStep};
use crate::tensor::multi::{adafactor_multi, AdafactorMoments, AdafactorSlot};
use crate::{DType, Device, Grads, Result, Tensor};

const NAME: &str = "Adafactor";
const KIND: &str = "adafactor";
const EXP_AVG: &str = "exp_avg";
const ROW: &str = "exp_avg_sq_row";
const COL: &str = "exp_avg_sq_col";
const FULL: &str = "exp_avg_sq";
/// Every state tensor suffix, longest first where one ends another.
const SUFFIXES: [&str; 4] = [ROW, COL, FULL, EXP_AVG];
const HYPER_KEYS: [&str; 10] = [
    "lr",
    "eps1",
    "eps2",
    "clip_threshold",
    "decay_rate",
    "beta1",
    "weight_decay",
    "scale_parameter",
    "relative_step",
    "warmup_init",
];

/// Hyperparameters of [`Adafactor`]; the defaults are transformers' (`lr=None`, relative
/// steps scaled by the parameter's RMS).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdafactorConfig {
    /// The learning rate, >= 0; with `relative_step`, the multiplier of the relative step
    /// (1.0: transformers' `lr=None`).
    pub lr: f64,
    /// Added to the squared gradient, >= 0 (transformers' `eps[0]`, 1e-30).
    pub eps1: f64,
    /// The least parameter scale, >= 0 (`eps[1]`, 1e-3).
    pub eps2: f64,
    /// The update's RMS is clipped to this, > 0 (1.0).
    pub clip_threshold: f64,
    /// The second moments' decay is 1 - t^decay_rate, <= 0 (-0.8).
    pub decay_rate: f64,
    /// The first moment's decay, in [0, 1); `None`: no first moment (the default).
    pub beta1: Option<f64>,
    /// Decoupled weight decay, >= 0: p = p - weight_decay * lr_t * p (0).
    pub weight_decay: f64,
    /// Multiply the step by max(eps2, rms(p)) (true).
    pub scale_parameter: bool,
    /// The step is min(1e-2, 1 / sqrt(t)) times lr (true).
    pub relative_step: bool,
    /// With `relative_step`: min(1e-6 t, 1 / sqrt(t)) instead (false).
    pub warmup_init: bool,
}

impl Default for AdafactorConfig {
    fn default() -> Self {
        // transformers 5, optimization.Adafactor.__init__'s defaults.
        AdafactorConfig {
            lr: 1.0,
            eps1: 1e-30,
            eps2: 1e-3,
            clip_threshold: 1.0,
            decay_rate: -0.8,
            beta1: None,
            weight_decay: 0.0,
            scale_parameter: true,
            relative_step: true,
            warmup_init: false,
        }
    }
}

impl AdafactorConfig {
    /// kohya's usual settings: `scale_parameter=False, relative_step=False,
    /// warmup_init=False` at learning rate `lr`.
    pub fn with_given_lr(lr: f64) -> Self {
        AdafactorConfig {
            lr,
            scale_parameter: false,
            relative_step: false,
            ..Default::default()
        }
    }

    /// Checks every value (see the fields).
    pub fn validate(&self) -> Result<()> {
        check_at_least(NAME, "learning rate", self.lr, 0.0)?;
        check_at_least(NAME, "eps1", self.eps1, 0.0)?;
        check_at_least(NAME, "eps2", self.eps2, 0.0)?;
        if !(self.clip_threshold.is_finite() && self.clip_threshold > 0.0) {
            return Err(opt_err(
                NAME,
                format!(
                    "invalid clip_threshold {}: must be finite and > 0",
                    self.clip_threshold
                ),
            ));
        }
        if !(self.decay_rate.is_finite() && self.decay_rate <= 0.0) {
            return Err(opt_err(
                NAME,
                format!(
                    "invalid decay_rate {}: must be finite and <= 0 (the second moments \
                     decay by 1 - t^decay_rate)",
                    self.decay_rate
                ),
            ));
        }
        if let Some(b) = self.beta1 {
            check_beta(NAME, "beta1", b)?;
        }
        check_at_least(NAME, "weight decay", self.weight_decay, 0.0)?;
        if self.warmup_init && !self.relative_step {
            // transformers: "`warmup_init=True` requires `relative_step=True`".
            return Err(opt_err(
                NAME,
                "warmup_init requires relative_step (it changes the relative step)",
            ));
        }
        Ok(())
    }

    fn to_metadata(self) -> Vec<(&'static str, String)> {
        vec![
            ("lr", self.lr.to_string()),
            ("eps1", self.eps1.to_string()),
            ("eps2", self.eps2.to_string()),
            ("clip_threshold", self.clip_threshold.to_string()),
            ("decay_rate", self.decay_rate.to_string()),
            ("beta1", self.beta1.map_or("none".into(), |b| b.to_string())),
            ("weight_decay", self.weight_decay.to_string()),
            ("scale_parameter", self.scale_parameter.to_string()),
            ("relative_step", self.relative_step.to_string()),
            ("warmup_init", self.warmup_init.to_string()),
        ]
    }

    fn from_metadata(st: &LoadedState) -> Result<Self> {
        let beta1 = match st.metadata.get("beta1").map(String::as_str) {
            Some("none") => None,
            _ => Some(st.parse(NAME, "beta1")?),
        };
        let c = AdafactorConfig {
            lr: st.parse(NAME, "lr")?,
            eps1: st.parse(NAME, "eps1")?,
            eps2: st.parse(NAME, "eps2")?,
            clip_threshold: st.parse(NAME, "clip_threshold")?,
            decay_rate: st.parse(NAME, "decay_rate")?,
            beta1,
            weight_decay: st.parse(NAME, "weight_decay")?,
            scale_parameter: st.parse(NAME, "scale_parameter")?,
            relative_step: st.parse(NAME, "relative_step")?,
            warmup_init: st.parse(NAME, "warmup_init")?,
        };
        c.validate()
            .map_err(|e| st.err(NAME, format!("hyperparameters: {e}")))?;
        Ok(c)
    }

    /// The fused step's shared scalars.
    fn hyper(&self, grad_scale: f64) -> AdafactorHyper {
        AdafactorHyper {
            eps1: self.eps1 as f32,
            eps2: self.eps2,
            clip_threshold: self.clip_threshold,
            beta1: self.beta1.map(|b| b as f32),
            one_minus_beta1: self.beta1.map_or(0.0, |b| (1.0 - b) as f32),
            weight_decay: self.weight_decay,
            scale_parameter: self.scale_parameter,
            grad_scale: grad_scale as f32,
        }
    }

    /// The fused step's scalars of a parameter's step `t`.
    fn step_scalars(&self, t: u64) -> AdafactorStep {
        let beta2t = self.beta2t(t);
        AdafactorStep {
            rel: self.relative(t),
            beta2t: beta2t as f32,
            one_minus_beta2t: (1.0 - beta2t) as f32,
        }
    }

    /// The second moments' decay at step `t`: 1 - t^decay_rate.
    fn beta2t(&self, t: u64) -> f64 {
        1.0 - (t as f64).powf(self.decay_rate)
    }

    /// The step size before the parameter scale at step `t` (transformers' `rel_step_sz`).
    fn relative(&self, t: u64) -> f64 {
        let t = t as f64;
        match self.relative_step {
            true => {
                let min_step = if self.warmup_init { 1e-6 * t } else { 1e-2 };
                self.lr * min_step.min(1.0 / t.sqrt())
            }
            false => self.lr,
        }
    }
}

/// One parameter's Adafactor state.
#[derive(Debug, Clone)]
pub struct AdafactorState {
    /// Steps this parameter had a gradient in.
    pub step: u64,
    /// The first moment (with beta1).
    pub exp_avg: Option<Tensor>,
    /// Factored parameters: the row means of the squared gradients (the dims but the last).
    pub exp_avg_sq_row: Option<Tensor>,
    /// Factored parameters: the column means (the dims but the second to last).
    pub exp_avg_sq_col: Option<Tensor>,
    /// Other parameters: the squared gradients' average (the parameter's shape).
    pub exp_avg_sq: Option<Tensor>,
}

/// Adafactor over named parameters (any float dtype; see the module docs).
pub struct Adafactor {
    config: AdafactorConfig,
    params: ParamSet,
    state: Vec<Option<AdafactorState>>,
}

impl std::fmt::Debug for Adafactor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct(NAME)
            .field("config", &self.config)
            .field("params", &self.params.len())
            .finish()
    }
}

/// rms(x) = ||x||_2 / sqrt(n), a 0-dim tensor on x's device.
fn rms(x: &Tensor) -> Result<Tensor> {
    x.sqr()?
        .sum_all()?
        .sqrt()?
        .affine(1.0 / (x.elem_count() as f64).sqrt(), 0.0)
}

/// The step size lr_t: a number, or a 0-dim tensor where it holds the parameter's RMS.
enum StepSize {
    Host(f64),
    Device(Tensor),
}

impl StepSize {
    /// x * lr_t * k.
    fn times(&self, x: &Tensor, k: f64) -> Result<Tensor> {
        match self {
            StepSize::Host(lr) => x.affine(lr * k, 0.0),
            StepSize::Device(lr) => match k {
                1.0 => x.mul(lr),
                _ => x.mul(&lr.affine(k, 0.0)?),
            },
        }
    }
}

/// `beta * prev + (1 - beta) * x`, or `(1 - beta) * x` from a zero state.
fn ema(prev: Option<&Tensor>, beta: f64, x: &Tensor) -> Result<Tensor> {
    let new = x.affine(1.0 - beta, 0.0)?;
    match prev {
        Some(prev) => prev.affine(beta, 0.0)?.add(&new),
        None => Ok(new),
    }
}

impl Adafactor {
    /// Checks `config` and the parameters: at least one; unique names; float leaves that
    /// require grad.
    pub fn new(params: Vec<(String, Tensor)>, config: AdafactorConfig) -> Result<Self> {
        config.validate()?;
        let params = ParamSet::new(NAME, params)?;
        let state = vec![None; params.len()];
        Ok(Adafactor {
            config,
            params,
            state,
        })
    }

    /// The hyperparameters (the learning rate as last set).
    pub fn config(&self) -> &AdafactorConfig {
        &self.config
    }

    /// A parameter's state, once it has taken a step.
    pub fn state(&self, name: &str) -> Option<&AdafactorState> {
        self.params
            .lookup(name)
            .and_then(|(i, _)| self.state.get(i))
            .and_then(Option::as_ref)
    }

    /// One parameter's update; the new state is returned once the parameter is written.
    fn update(
        &self,
        p: &Tensor,
        grad: &Tensor,
        grad_scale: f64,
        prev: Option<&AdafactorState>,
    ) -> Result<AdafactorState> {
        let c = &self.config;
        let cd = compute_dtype(p.dtype());
        let mut g = grad.to_dtype(cd)?;
        if grad_scale != 1.0 {
            g = g.affine(grad_scale, 0.0)?;
        }
        let mut pf = p.to_dtype(cd)?;
        let t = prev.map_or(0, |s| s.step).saturating_add(1);
        let lr = match c.scale_parameter {
            // max(eps2, rms(p)) on the device (transformers' Python max of a number and a
            // 0-dim tensor).
            true => {
                let eps2 = Tensor::full(c.eps2, (), cd, p.device())?;
                StepSize::Device(rms(&pf)?.maximum(&eps2)?.affine(c.relative(t), 0.0)?)
            }
            false => StepSize::Host(c.relative(t)),
        };
        let beta2t = c.beta2t(t);
        let u = g.sqr()?.add_scalar(c.eps1)?;
        let rank = p.rank();
        let (mut update, row, col, full) = if rank >= 2 {
            let row = ema(
                prev.and_then(|s| s.exp_avg_sq_row.as_ref()),
                beta2t,
                &u.mean(&[rank - 1])?,
            )?;
            let col = ema(
                prev.and_then(|s| s.exp_avg_sq_col.as_ref()),
                beta2t,
                &u.mean(&[rank - 2])?,
            )?;
            // rsqrt(R / mean(R)) over the rows times rsqrt(C) over the columns.
            let r = row
                .div(&row.mean_keepdim(&[rank - 2])?)?
                .sqrt()?
                .recip()?
                .unsqueeze(rank - 1)?;
            let cf = col.sqrt()?.recip()?.unsqueeze(rank - 2)?;
            (r.mul(&cf)?.mul(&g)?, Some(row), Some(col), None)
        } else {
            let v = ema(prev.and_then(|s| s.exp_avg_sq.as_ref()), beta2t, &u)?;
            (v.sqrt()?.recip()?.mul(&g)?, None, None, Some(v))
        };
        // u / max(rms(u) / clip_threshold, 1), on the device.
        let one = Tensor::full(1.0, (), cd, p.device())?;
        let clip = rms(&update)?
            .affine(1.0 / c.clip_threshold, 0.0)?
            .maximum(&one)?;
        update = lr.times(&update.div(&clip)?, 1.0)?;
        let exp_avg = match c.beta1 {
            Some(b1) => {
                let m = ema(prev.and_then(|s| s.exp_avg.as_ref()), b1, &update)?;
                update = m.clone();
                Some(m)
            }
            None => None,
        };
        if c.weight_decay != 0.0 {
            pf = pf.add(&lr.times(&pf, -c.weight_decay)?)?;
        }
        let new_p = pf.sub(&update)?.to_dtype(p.dtype())?;
        p.assign(&new_p)?;
        Ok(AdafactorState {
            step: t,
            exp_avg,
            exp_avg_sq_row: row,
            exp_avg_sq_col: col,
            exp_avg_sq: full,
        })
    }
}

impl Adafactor {
    /// The step composed of tensor ops, parameter by parameter: the reference of the fused
    /// step ([`Optimizer::step_scaled`]), which it equals within f32 rounding; it keeps the
    /// same state, so the two may alternate.
    pub fn step_composite(&mut self, grads: &Grads, grad_scale: f64) -> Result<()> {
        check_lr(NAME, self.config.lr)?;
        check_grad_scale(NAME, grad_scale)?;
        let _guard = crate::no_grad();
        let gs = self.params.gradients(grads)?;
        for (i, ((name, p), g)) in self.params.params.iter().zip(&gs).enumerate() {
            let Some(g) = g else { continue };
            let prev = self.state.get(i).and_then(Option::as_ref);
            let st = self
                .update(p, g, grad_scale, prev)
                .map_err(|e| update_err(NAME, name, e))?;
            if let Some(slot) = self.state.get_mut(i) {
                *slot = Some(st);
            }
        }
        Ok(())
    }

    /// Whether the fused step updates `p`: contiguous f32, bf16 or f16.
    fn fused(p: &Tensor) -> bool {
        p.is_contiguous() && matches!(p.dtype(), DType::F32 | DType::BF16 | DType::F16)
    }

    /// A parameter's state before its first fused step: zero moments (the composite starts
    /// from none; `beta * 0 + (1 - beta) * x` is the same value).
    fn fresh(&self, p: &Tensor) -> Result<AdafactorState> {
        let z = |dims: Vec<usize>| Tensor::zeros(dims, DType::F32, p.device());
        let d = p.dims();
        let without = |k: usize| {
            let mut v = d.to_vec();
            v.remove(d.len() - k);
            v
        };
        let factored = p.rank() >= 2;
        Ok(AdafactorState {
            step: 0,
            exp_avg: match self.config.beta1 {
                Some(_) => Some(z(d.to_vec())?),
                None => None,
            },
            exp_avg_sq_row: if factored { Some(z(without(1))?) } else { None },
            exp_avg_sq_col: if factored { Some(z(without(2))?) } else { None },
            exp_avg_sq: if factored { None } else { Some(z(d.to_vec())?) },
        })
    }
}

impl Optimizer for Adafactor {
    /// One fused call per device over every parameter with a gradient (see the module
    /// docs); parameters it does not take go through [`Adafactor::step_composite`]'s update.
    fn step_scaled(&mut self, grads: &Grads, grad_scale: f64) -> Result<()> {
        check_lr(NAME, self.config.lr)?;
        check_grad_scale(NAME, grad_scale)?;
        let _guard = crate::no_grad();
        let gs = self.params.gradients(grads)?;
        // Each fused parameter with a gradient: its gradient in its dtype, contiguous, and
        // its state (fresh before its first step).
        let mut taken: Vec<(usize, Tensor, AdafactorState)> = vec![];
        let mut composite: Vec<(usize, AdafactorState)> = vec![];
        for (i, ((name, p), g)) in self.params.params.iter().zip(&gs).enumerate() {
            let Some(g) = g else { continue };
            let prev = self.state.get(i).and_then(Option::as_ref);
            if !Self::fused(p) {
                let st = self
                    .update(p, g, grad_scale, prev)
                    .map_err(|e| update_err(NAME, name, e))?;
                composite.push((i, st));
                continue;
            }
            let prep = || -> Result<_> {
                let g = g.to_dtype(p.dtype())?.contiguous()?;
                let st = match prev {
                    Some(s) => s.clone(),
                    None => self.fresh(p)?,
                };
                Ok((g, st))
            };
            let (g, st) = prep().map_err(|e| update_err(NAME, name, e))?;
            taken.push((i, g, st));
        }
        let hyper = self.config.hyper(grad_scale);
        let mut devices: Vec<Device> = vec![];
        for (i, _, _) in &taken {
            let d = self.params.params[*i].1.device();
            if !devices.contains(d) {
                devices.push(d.clone());
            }
        }
        for dev in devices {
            let mut slots = vec![];
            for (i, g, st) in &taken {
                let p = &self.params.params[*i].1;
                if p.device() != &dev {
                    continue;
                }
                let v = match (&st.exp_avg_sq_row, &st.exp_avg_sq_col, &st.exp_avg_sq) {
                    (Some(row), Some(col), None) => AdafactorMoments::Factored { row, col },
                    (None, None, Some(v)) => AdafactorMoments::Full(v),
                    _ => {
                        return Err(opt_err(
                            NAME,
                            format!(
                                "internal: parameter '{}' holds neither factored nor full \
                                 second moments",
                                self.params.params[*i].0
                            ),
                        ))
                    }
                };
                slots.push(AdafactorSlot {
                    p,
                    g,
                    m: st.exp_avg.as_ref(),
                    v,
                    step: self.config.step_scalars(st.step.saturating_add(1)),
                });
            }
            adafactor_multi(&hyper, &slots).map_err(|e| opt_err(NAME, e.to_string()))?;
        }
        for (i, _, mut st) in taken {
            st.step = st.step.saturating_add(1);
            self.state[i] = Some(st);
        }
        for (i, st) in composite {
            self.state[i] = Some(st);
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
        let mut metadata = metadata_for(KIND, &self.config.to_metadata());
        let mut tensors = Vec::new();
        for (i, ((name, _), s)) in self.params.params.iter().zip(&self.state).enumerate() {
            let Some(s) = s else { continue };
            for (suffix, t) in [
                (EXP_AVG, &s.exp_avg),
                (ROW, &s.exp_avg_sq_row),
                (COL, &s.exp_avg_sq_col),
                (FULL, &s.exp_avg_sq),
            ] {
                if let Some(t) = t {
                    tensors.push((i, suffix, t));
                }
            }
            metadata.insert(format!("step.{name}"), s.step.to_string());
        }
        state_into(&self.params, tensors, &metadata, out);
        Ok(())
    }

    fn load_state_from(&mut self, src: &StateSource<'_>) -> Result<()> {
        let _guard = crate::no_grad();
        // The factored moments' shapes: the parameter's dims without the last, or without
        // the second to last.
        let exact = |suffix: &str, p: &Tensor| {
            let without = |k: usize| {
                let mut d = p.dims().to_vec();
                d.remove(d.len() - k);
                d
            };
            let cd = compute_dtype(p.dtype());
            match suffix {
                ROW if p.rank() >= 2 => Some((cd, without(1))),
                COL if p.rank() >= 2 => Some((cd, without(2))),
                _ => None,
            }
        };
        let mut loaded = LoadedState::read_with_from(
            &self.params,
            KIND,
            &SUFFIXES,
            &HYPER_KEYS,
            true,
            &exact,
            src,
        )?;
        let config = AdafactorConfig::from_metadata(&loaded)?;
        let per_param = std::mem::take(&mut loaded.tensors);
        let mut state = Vec::with_capacity(self.params.len());
        for ((pname, p), mut t) in self.params.params.iter().zip(per_param) {
            let step = loaded.step(NAME, pname)?;
            let factored = p.rank() >= 2;
            let (m, r, c, v) = (
                t.remove(EXP_AVG),
                t.remove(ROW),
                t.remove(COL),
                t.remove(FULL),
            );
            let complete = m.is_some() == config.beta1.is_some()
                && r.is_some() == factored
                && c.is_some() == factored
                && v.is_some() != factored;
            state.push(match step {
                None if m.is_none() && r.is_none() && c.is_none() && v.is_none() => None,
                Some(step) if step >= 1 && complete => Some(AdafactorState {
                    step,
                    exp_avg: m,
                    exp_avg_sq_row: r,
                    exp_avg_sq_col: c,
                    exp_avg_sq: v,
                }),
                step => {
                    let want = match factored {
                        true => format!("{pname}.{ROW} and {pname}.{COL}"),
                        false => format!("{pname}.{FULL}"),
                    };
                    let first = match config.beta1 {
                        Some(_) => format!(" and {pname}.{EXP_AVG} (beta1 is set)"),
                        None => String::new(),
                    };
                    return Err(loaded.err(
                        NAME,
                        format!(
                            "parameter '{pname}' (shape {}): incomplete state (step {}); a \
                             parameter's state is a step >= 1, exactly {want}{first}, or \
                             nothing",
                            p.shape(),
                            step.map_or("missing".into(), |s| s.to_string()),
                        ),
                    ));
                }
            });
        }
        self.config = config;
        self.state = state;
        Ok(())
    }
}
