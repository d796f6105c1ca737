//! Schedule-free optimizers (Defazio et al. 2024, "The Road Less Scheduled",
//! <https://arxiv.org/abs/2405.15682>): [`AdamWScheduleFree`], with the semantics of the
//! `schedulefree` package's `AdamWScheduleFree` (version 1.4.1,
//! <https://github.com/facebookresearch/schedule_free>), and [`ProdigyScheduleFree`], the core
//! update of the `prodigy-plus-schedule-free` package's `ProdigyPlusScheduleFree` (version
//! 2.0.1, <https://github.com/LoganBooker/prodigy-plus-schedule-free>). `backend::multi_sf`
//! gives both updates operation by operation.
//!
//! The parameters hold y, where the gradient is taken; each keeps z, and the weights to
//! evaluate and save are x = lerp(y, z, 1 - 1/beta1). [`Optimizer::eval_mode`] moves the
//! parameters to x and [`Optimizer::train_mode`] back to y = lerp(x, z, 1 - beta1), as the
//! packages' `eval()` and `train()` (PyTorch's lerp, rounded to the parameter's dtype, so a
//! round trip may move y by a rounding: a run that saves x and resumes from it takes the same
//! round trip as the run that went on). A step in eval mode is an error, as in the packages.
//! The optimizers start in train mode; state files record the mode, and a loaded optimizer
//! takes the parameters to be at the point the saving one had them at (the trainer saves and
//! restores x).
//!
//! Learning rate: constant (the packages' advice: schedule-free replaces the schedule).
//! AdamWScheduleFree warms up on its own (`warmup_steps`) and weights the average by
//! `lr_max^weight_lr_power`; a schedule set with `set_learning_rate` still applies, as in the
//! package.
//!
//! Both take f32, bf16 and f16 parameters on one device; every step is one fused
//! multi-tensor call (`tensor::multi::schedulefree_multi`). v and z are f32 (the packages
//! keep them in the parameter's dtype; `ProdigyPlusScheduleFree` rounds bf16 weights
//! stochastically by default, FLAME to nearest); Prodigy's s and p0 are bf16 for every 11th
//! value, as the package keeps them.
//!
//! ProdigyPlusScheduleFree's defaults turn on a factored second moment, StableAdamW's update
//! clipping and stochastic rounding; FLAME implements the update with those off
//! (`factored=False, use_stableadamw=False, stochastic_rounding=False`) and the package's
//! other defaults (`d_limiter=True, schedulefree_c=0, weight_decay_by_lr=True,
//! use_bias_correction=False, prodigy_steps=0, eps` a number, one parameter group, SPEED,
//! cautious, grams, ADOPT, OrthoGrad and FOCUS off); the options it follows are the fields
//! of [`ProdigyScheduleFreeConfig`].
//!
//! State files: `<param>.exp_avg_sq`, `<param>.z` (f32), and for Prodigy `<param>.s` and
//! `<param>.p0` (bf16, p0 absent for a parameter that started at zero), `step.<param>`;
//! the hyperparameters, the global state (AdamW: `k`, `lr_max`, `weight_sum`; Prodigy: `d`,
//! `d_numerator`, `d_denom`, `weight_sum`, `k`) and `train_mode` in the metadata, as
//! shortest round-trip decimals, so a reloaded optimizer continues bit for bit.

use super::{
    check_at_least, check_beta, check_grad_scale, check_lr, metadata_for, opt_err, state_into,
    update_err, LoadedState, Optimizer, ParamSet, StateMap, StateSource,
};
use crate::backend::multi_sf::{
    prodigy_sf_sliced, prodigy_sf_slot as slot, ProdigySfHyper, SfAdamScalars, SfOp,
    PRODIGY_SF_SCALARS, PRODIGY_SF_SLICE,
};
use crate::tensor::multi::{schedulefree_multi, SfSlot};
use crate::{sum_sq_multi, DType, Device, Grads, Result, Tensor};

const EXP_AVG_SQ: &str = "exp_avg_sq";
const Z: &str = "z";
const S: &str = "s";
const P0: &str = "p0";

/// One parameter's schedule-free state.
#[derive(Debug, Clone)]
pub struct ScheduleFreeState {
    /// Steps this parameter had a gradient in.
    pub step: u64,
    /// Second moment (f32, the parameter's shape).
    pub exp_avg_sq: Tensor,
    /// The base sequence z (f32, the parameter's shape).
    pub z: Tensor,
    /// Prodigy: the running s of every 11th value (bf16).
    pub s: Option<Tensor>,
    /// Prodigy: every 11th value of the parameter at its first step (bf16; absent when the
    /// parameter was all zeros).
    pub p0: Option<Tensor>,
}

/// What both optimizers share: the parameters, their state and the mode.
struct Core {
    name: &'static str,
    params: ParamSet,
    state: Vec<Option<ScheduleFreeState>>,
    train_mode: bool,
}

impl Core {
    fn new(name: &'static str, params: Vec<(String, Tensor)>) -> Result<Self> {
        let params = ParamSet::new(name, params)?;
        params.check_fused()?;
        let device = params.params[0].1.device().clone();
        for (pname, p) in &params.params {
            if p.device() != &device {
                return Err(opt_err(
                    name,
                    format!(
                        "parameter '{pname}' is on {} but '{}' is on {device}: one fused step \
                         updates parameters of one device",
                        p.device(),
                        params.params[0].0
                    ),
                ));
            }
        }
        let state = vec![None; params.len()];
        Ok(Core {
            name,
            params,
            state,
            train_mode: true,
        })
    }

    fn device(&self) -> Device {
        self.params.params[0].1.device().clone()
    }

    fn state(&self, name: &str) -> Option<&ScheduleFreeState> {
        self.params
            .lookup(name)
            .and_then(|(i, _)| self.state.get(i))
            .and_then(Option::as_ref)
    }

    /// Moves every parameter with state to `lerp(p, z, w)`, w = 1 - beta1 into train mode
    /// and 1 - 1/beta1 out of it; nothing when already in that mode.
    fn set_mode(&mut self, train: bool, beta1: f64) -> Result<()> {
        if self.train_mode == train {
            return Ok(());
        }
        let _guard = crate::no_grad();
        let w = if train {
            1.0 - beta1
        } else {
            1.0 - 1.0 / beta1
        };
        let slots: Vec<SfSlot<'_>> = self
            .params
            .params
            .iter()
            .zip(&self.state)
            .filter_map(|((_, p), st)| {
                st.as_ref().map(|st| SfSlot {
                    p,
                    g: None,
                    v: None,
                    z: &st.z,
                    s: None,
                    p0: None,
                })
            })
            .collect();
        schedulefree_multi(&SfOp::Lerp(w as f32), None, &slots)
            .map_err(|e| opt_err(self.name, e.to_string()))?;
        self.train_mode = train;
        Ok(())
    }

    /// Each parameter with a gradient: its gradient in its dtype, contiguous, and its state
    /// (fresh before its first step). Refused in eval mode.
    fn taken(
        &self,
        grads: &Grads,
        fresh: impl Fn(&Tensor) -> Result<ScheduleFreeState>,
    ) -> Result<Vec<(usize, Tensor, ScheduleFreeState)>> {
        if !self.train_mode {
            return Err(opt_err(
                self.name,
                "a step in eval mode: the parameters hold x, the weights to evaluate; call \
                 train_mode() first (the packages' optimizer.train())",
            ));
        }
        let gs = self.params.gradients(grads)?;
        let mut taken = vec![];
        for (i, ((name, p), g)) in self.params.params.iter().zip(&gs).enumerate() {
            let Some(g) = g else { continue };
            let prep = || -> Result<_> {
                let g = g.to_dtype(p.dtype())?.contiguous()?;
                let st = match &self.state[i] {
                    Some(s) => s.clone(),
                    None => fresh(p)?,
                };
                Ok((g, st))
            };
            let (g, st) = prep().map_err(|e| update_err(self.name, name, e))?;
            taken.push((i, g, st));
        }
        Ok(taken)
    }

    fn run(
        &mut self,
        op: &SfOp,
        scalars: Option<&Tensor>,
        taken: Vec<(usize, Tensor, ScheduleFreeState)>,
    ) -> Result<()> {
        let slots: Vec<SfSlot<'_>> = taken
            .iter()
            .map(|(i, g, st)| SfSlot {
                p: &self.params.params[*i].1,
                g: Some(g),
                v: Some(&st.exp_avg_sq),
                z: &st.z,
                s: st.s.as_ref(),
                p0: st.p0.as_ref(),
            })
            .collect();
        if !slots.is_empty() {
            schedulefree_multi(op, scalars, &slots)
                .map_err(|e| opt_err(self.name, e.to_string()))?;
        }
        for (i, _, mut st) in taken {
            st.step = st.step.saturating_add(1);
            self.state[i] = Some(st);
        }
        Ok(())
    }

    fn save(&self, kind: &str, mut hyper: Vec<(&str, String)>, out: &mut StateMap) -> Result<()> {
        let mode = self.train_mode.to_string();
        hyper.push(("train_mode", mode));
        let mut metadata = metadata_for(kind, &hyper);
        let mut tensors = Vec::new();
        for (i, ((name, _), s)) in self.params.params.iter().zip(&self.state).enumerate() {
            if let Some(s) = s {
                tensors.push((i, EXP_AVG_SQ, &s.exp_avg_sq));
                tensors.push((i, Z, &s.z));
                if let Some(t) = &s.s {
                    tensors.push((i, S, t));
                }
                if let Some(t) = &s.p0 {
                    tensors.push((i, P0, t));
                }
                metadata.insert(format!("step.{name}"), s.step.to_string());
            }
        }
        state_into(&self.params, tensors, &metadata, out);
        Ok(())
    }

    /// Reads a state file: the loaded metadata and each parameter's state, checked (s and
    /// p0 bf16 of the sliced size, with `prodigy`).
    fn load(
        &self,
        kind: &str,
        keys: &[&str],
        prodigy: bool,
        src: &StateSource<'_>,
    ) -> Result<(LoadedState, Vec<Option<ScheduleFreeState>>, bool)> {
        let name = self.name;
        let suffixes: &[&'static str] = if prodigy {
            &[EXP_AVG_SQ, P0, Z, S]
        } else {
            &[EXP_AVG_SQ, Z]
        };
        let mut keys = keys.to_vec();
        keys.push("train_mode");
        let exact = |suffix: &str, p: &Tensor| match suffix {
            S | P0 => Some((DType::BF16, vec![prodigy_sf_sliced(p.elem_count())])),
            _ => None,
        };
        let mut loaded =
            LoadedState::read_with_from(&self.params, kind, suffixes, &keys, true, &exact, src)?;
        let train_mode: bool = loaded.parse(name, "train_mode")?;
        let mut state = Vec::with_capacity(self.params.len());
        let per_param = std::mem::take(&mut loaded.tensors);
        for ((pname, _), mut t) in self.params.params.iter().zip(per_param) {
            let step = loaded.step(name, pname)?;
            let (v, z, s, p0) = (t.remove(EXP_AVG_SQ), t.remove(Z), t.remove(S), t.remove(P0));
            state.push(match (step, v, z) {
                (None, None, None) if s.is_none() && p0.is_none() => None,
                (Some(step), Some(exp_avg_sq), Some(z)) if s.is_some() == prodigy => {
                    Some(ScheduleFreeState {
                        step,
                        exp_avg_sq,
                        z,
                        s,
                        p0,
                    })
                }
                (step, v, z) => {
                    return Err(loaded.err(
                        name,
                        format!(
                            "parameter '{pname}': incomplete state (step {}, {EXP_AVG_SQ} {}, \
                             {Z} {}, {S} {}); a parameter's state is a step, exp_avg_sq, z{}, \
                             or nothing",
                            step.map_or("missing".into(), |s| s.to_string()),
                            if v.is_some() { "present" } else { "missing" },
                            if z.is_some() { "present" } else { "missing" },
                            if s.is_some() { "present" } else { "missing" },
                            if prodigy { " and s" } else { "" },
                        ),
                    ))
                }
            });
        }
        Ok((loaded, state, train_mode))
    }
}

/// Zero v and z a copy of `p`, in f32.
fn fresh_adam(p: &Tensor) -> Result<ScheduleFreeState> {
    let z = Tensor::zeros(p.shape().clone(), DType::F32, p.device())?;
    z.assign(&p.to_dtype(DType::F32)?)?;
    Ok(ScheduleFreeState {
        step: 0,
        exp_avg_sq: Tensor::zeros(p.shape().clone(), DType::F32, p.device())?,
        z,
        s: None,
        p0: None,
    })
}

/// Python's `max(a, b)`: `b` only when `b > a`.
fn py_max(a: f64, b: f64) -> f64 {
    if b > a {
        b
    } else {
        a
    }
}

// ----- AdamW ------------------------------------------------------------------------------

const ADAMW_NAME: &str = "AdamWScheduleFree";
const ADAMW_KIND: &str = "adamw_schedulefree";
const ADAMW_KEYS: [&str; 11] = [
    "lr",
    "beta1",
    "beta2",
    "eps",
    "weight_decay",
    "warmup_steps",
    "r",
    "weight_lr_power",
    "k",
    "lr_max",
    "weight_sum",
];

/// Hyperparameters of [`AdamWScheduleFree`]; the defaults are the package's.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWScheduleFreeConfig {
    /// The learning rate (the package's default 0.0025), >= 0.
    pub lr: f64,
    /// The interpolation's beta1, in (0, 1) (x = lerp(y, z, 1 - 1/beta1) divides by it).
    pub beta1: f64,
    /// Second-moment decay, in [0, 1).
    pub beta2: f64,
    /// Added to the bias-corrected root, >= 0.
    pub eps: f64,
    /// Weight decay, taken at y, >= 0.
    pub weight_decay: f64,
    /// Steps of linear warm-up of the rate, from lr / warmup_steps.
    pub warmup_steps: u64,
    /// The average's polynomial weighting power (weights (k+1)^r), >= 0.
    pub r: f64,
    /// The average's weights are lr_max^weight_lr_power, >= 0.
    pub weight_lr_power: f64,
}

impl Default for AdamWScheduleFreeConfig {
    fn default() -> Self {
        // schedulefree 1.4.1, AdamWScheduleFree.__init__'s defaults.
        AdamWScheduleFreeConfig {
            lr: 0.0025,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
            warmup_steps: 0,
            r: 0.0,
            weight_lr_power: 2.0,
        }
    }
}

/// beta1 of a schedule-free optimizer: in (0, 1), since x divides by it.
fn check_beta1(name: &'static str, beta1: f64) -> Result<()> {
    if !(beta1 > 0.0 && beta1 < 1.0) {
        return Err(opt_err(
            name,
            format!(
                "invalid beta1 {beta1}: must be in (0, 1) (the evaluation point x = lerp(y, z, \
                 1 - 1/beta1) divides by it)"
            ),
        ));
    }
    Ok(())
}

impl AdamWScheduleFreeConfig {
    /// The checks: lr, eps, weight_decay, r and weight_lr_power finite and >= 0, beta1 in
    /// (0, 1), beta2 in [0, 1).
    pub fn validate(&self) -> Result<()> {
        let n = ADAMW_NAME;
        check_at_least(n, "learning rate", self.lr, 0.0)?;
        check_beta1(n, self.beta1)?;
        check_beta(n, "beta2", self.beta2)?;
        check_at_least(n, "eps", self.eps, 0.0)?;
        check_at_least(n, "weight_decay", self.weight_decay, 0.0)?;
        check_at_least(n, "r", self.r, 0.0)?;
        check_at_least(n, "weight_lr_power", self.weight_lr_power, 0.0)
    }

    fn to_metadata(self) -> Vec<(&'static str, String)> {
        vec![
            ("lr", self.lr.to_string()),
            ("beta1", self.beta1.to_string()),
            ("beta2", self.beta2.to_string()),
            ("eps", self.eps.to_string()),
            ("weight_decay", self.weight_decay.to_string()),
            ("warmup_steps", self.warmup_steps.to_string()),
            ("r", self.r.to_string()),
            ("weight_lr_power", self.weight_lr_power.to_string()),
        ]
    }

    fn from_metadata(st: &LoadedState) -> Result<Self> {
        let n = ADAMW_NAME;
        let c = AdamWScheduleFreeConfig {
            lr: st.parse(n, "lr")?,
            beta1: st.parse(n, "beta1")?,
            beta2: st.parse(n, "beta2")?,
            eps: st.parse(n, "eps")?,
            weight_decay: st.parse(n, "weight_decay")?,
            warmup_steps: st.parse(n, "warmup_steps")?,
            r: st.parse(n, "r")?,
            weight_lr_power: st.parse(n, "weight_lr_power")?,
        };
        c.validate()?;
        Ok(c)
    }
}

/// The package's group state of [`AdamWScheduleFree`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWScheduleFreeGlobal {
    /// Steps taken (the package's `k`).
    pub k: u64,
    /// The largest warmed-up rate so far (-1 before the first step).
    pub lr_max: f64,
    /// The sum of the average's weights.
    pub weight_sum: f64,
}

/// Schedule-free AdamW over named parameters (f32, bf16 or f16, contiguous, one device).
pub struct AdamWScheduleFree {
    config: AdamWScheduleFreeConfig,
    core: Core,
    global: AdamWScheduleFreeGlobal,
}

impl std::fmt::Debug for AdamWScheduleFree {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct(ADAMW_NAME)
            .field("config", &self.config)
            .field("params", &self.core.params.len())
            .field("global", &self.global)
            .finish()
    }
}

impl AdamWScheduleFree {
    /// Checks `config` and the parameters (unique names, float leaves that require grad, f32,
    /// bf16 or f16, contiguous, one device).
    pub fn new(params: Vec<(String, Tensor)>, config: AdamWScheduleFreeConfig) -> Result<Self> {
        config.validate()?;
        Ok(AdamWScheduleFree {
            config,
            core: Core::new(ADAMW_NAME, params)?,
            global: AdamWScheduleFreeGlobal {
                k: 0,
                lr_max: -1.0,
                weight_sum: 0.0,
            },
        })
    }

    /// The hyperparameters in use.
    pub fn config(&self) -> &AdamWScheduleFreeConfig {
        &self.config
    }

    /// The group state.
    pub fn global(&self) -> AdamWScheduleFreeGlobal {
        self.global
    }

    /// A parameter's state, once it has taken a step.
    pub fn state(&self, name: &str) -> Option<&ScheduleFreeState> {
        self.core.state(name)
    }

    /// The step's scalars, and the group state after it (the package's step, in f64).
    fn scalars(&self, grad_scale: f64) -> (SfAdamScalars, AdamWScheduleFreeGlobal) {
        let c = &self.config;
        let k = self.global.k;
        let sched = if k < c.warmup_steps {
            (k + 1) as f64 / c.warmup_steps as f64
        } else {
            1.0
        };
        let bias2 = 1.0 - c.beta2.powf((k + 1) as f64);
        let lr = c.lr * sched;
        let lr_max = py_max(lr, self.global.lr_max);
        let weight = ((k + 1) as f64).powf(c.r) * lr_max.powf(c.weight_lr_power);
        let weight_sum = self.global.weight_sum + weight;
        let ckp1 = if weight_sum != 0.0 {
            weight / weight_sum
        } else {
            0.0
        };
        let s = SfAdamScalars {
            grad_scale: grad_scale as f32,
            beta2: c.beta2 as f32,
            one_minus_beta2: (1.0 - c.beta2) as f32,
            bias2: bias2 as f32,
            eps: c.eps as f32,
            weight_decay: c.weight_decay as f32,
            ckp1: ckp1 as f32,
            y_step: (lr * (c.beta1 * (1.0 - ckp1) - 1.0)) as f32,
            lr: lr as f32,
        };
        let g = AdamWScheduleFreeGlobal {
            k: k + 1,
            lr_max,
            weight_sum,
        };
        (s, g)
    }
}

impl Optimizer for AdamWScheduleFree {
    fn step_scaled(&mut self, grads: &Grads, grad_scale: f64) -> Result<()> {
        check_lr(ADAMW_NAME, self.config.lr)?;
        check_grad_scale(ADAMW_NAME, grad_scale)?;
        let _guard = crate::no_grad();
        let taken = self.core.taken(grads, fresh_adam)?;
        let (s, global) = self.scalars(grad_scale);
        self.core.run(&SfOp::AdamW(s), None, taken)?;
        self.global = global;
        Ok(())
    }

    fn learning_rate(&self) -> f64 {
        self.config.lr
    }

    fn set_learning_rate(&mut self, lr: f64) {
        self.config.lr = lr;
    }

    fn eval_mode(&mut self) -> Result<()> {
        self.core.set_mode(false, self.config.beta1)
    }

    fn train_mode(&mut self) -> Result<()> {
        self.core.set_mode(true, self.config.beta1)
    }

    fn save_state_to(&self, out: &mut StateMap) -> Result<()> {
        let mut hyper = self.config.to_metadata();
        hyper.push(("k", self.global.k.to_string()));
        hyper.push(("lr_max", self.global.lr_max.to_string()));
        hyper.push(("weight_sum", self.global.weight_sum.to_string()));
        self.core.save(ADAMW_KIND, hyper, out)
    }

    fn load_state_from(&mut self, src: &StateSource<'_>) -> Result<()> {
        let _guard = crate::no_grad();
        let (loaded, state, train_mode) = self.core.load(ADAMW_KIND, &ADAMW_KEYS, false, src)?;
        let config = AdamWScheduleFreeConfig::from_metadata(&loaded)?;
        let global = AdamWScheduleFreeGlobal {
            k: loaded.parse(ADAMW_NAME, "k")?,
            lr_max: loaded.parse(ADAMW_NAME, "lr_max")?,
            weight_sum: loaded.parse(ADAMW_NAME, "weight_sum")?,
        };
        self.config = config;
        self.global = global;
        self.core.state = state;
        self.core.train_mode = train_mode;
        Ok(())
    }
}

// ----- Prodigy ----------------------------------------------------------------------------

const PRODIGY_NAME: &str = "ProdigyScheduleFree";
const PRODIGY_KIND: &str = "prodigy_schedulefree";
const PRODIGY_KEYS: [&str; 10] = [
    "lr",
    "beta1",
    "beta2",
    "beta3",
    "eps",
    "weight_decay",
    "d0",
    "d_coef",
    "d_limiter",
    "schedulefree_c",
];
/// The scalar state's metadata keys, by slot.
const PRODIGY_SCALAR_KEYS: [(&str, usize); 5] = [
    ("d", slot::D),
    ("d_numerator", slot::D_NUMERATOR),
    ("d_denom", slot::D_DENOM),
    ("weight_sum", slot::WEIGHT_SUM),
    ("k", slot::K),
];

/// Hyperparameters of [`ProdigyScheduleFree`]: the options of `ProdigyPlusScheduleFree` it
/// follows, with the package's defaults.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ProdigyScheduleFreeConfig {
    /// The multiplier of d (the package's lr, default 1.0), > 0.
    pub lr: f64,
    /// The interpolation's beta1, in (0, 1) (default 0.9).
    pub beta1: f64,
    /// Second-moment decay, in [0, 1) (default 0.99).
    pub beta2: f64,
    /// The decay of s and of the numerator, in [0, 1); `None`: sqrt(beta2).
    pub beta3: Option<f64>,
    /// Added to sqrt(v), times d, > 0 (default 1e-8).
    pub eps: f64,
    /// Decoupled weight decay at y, times the step size, >= 0 (default 0).
    pub weight_decay: f64,
    /// The first estimate of d, > 0 (default 1e-6).
    pub d0: f64,
    /// The multiplier of the raw estimate, > 0 (default 1.0).
    pub d_coef: f64,
    /// Limit the raw estimate's growth to 2^0.25 a step (default true).
    pub d_limiter: bool,
    /// Refined schedule-free averaging strength, >= 0 (default 0: off).
    pub schedulefree_c: f64,
}

impl Default for ProdigyScheduleFreeConfig {
    fn default() -> Self {
        // prodigy-plus-schedule-free 2.0.1, ProdigyPlusScheduleFree.__init__'s defaults.
        ProdigyScheduleFreeConfig {
            lr: 1.0,
            beta1: 0.9,
            beta2: 0.99,
            beta3: None,
            eps: 1e-8,
            weight_decay: 0.0,
            d0: 1e-6,
            d_coef: 1.0,
            d_limiter: true,
            schedulefree_c: 0.0,
        }
    }
}

impl ProdigyScheduleFreeConfig {
    /// The package's checks (lr, d0, eps > 0; betas in [0, 1); weight_decay,
    /// schedulefree_c >= 0), beta1 > 0, d_coef > 0, everything finite.
    pub fn validate(&self) -> Result<()> {
        let n = PRODIGY_NAME;
        check_beta1(n, self.beta1)?;
        check_beta(n, "beta2", self.beta2)?;
        if let Some(b3) = self.beta3 {
            check_beta(n, "beta3", b3)?;
        }
        check_at_least(n, "weight_decay", self.weight_decay, 0.0)?;
        check_at_least(n, "schedulefree_c", self.schedulefree_c, 0.0)?;
        for (what, v) in [
            ("learning rate", self.lr),
            ("eps", self.eps),
            ("d0", self.d0),
            ("d_coef", self.d_coef),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return Err(opt_err(
                    n,
                    format!("invalid {what} {v}: must be finite and > 0"),
                ));
            }
        }
        Ok(())
    }

    /// beta3 as used: the given value or sqrt(beta2) (the package's `beta2 ** 0.5`).
    pub fn beta3(&self) -> f64 {
        self.beta3.unwrap_or_else(|| self.beta2.powf(0.5))
    }

    fn to_metadata(self) -> Vec<(&'static str, String)> {
        let mut v = vec![
            ("lr", self.lr.to_string()),
            ("beta1", self.beta1.to_string()),
            ("beta2", self.beta2.to_string()),
            ("eps", self.eps.to_string()),
            ("weight_decay", self.weight_decay.to_string()),
            ("d0", self.d0.to_string()),
            ("d_coef", self.d_coef.to_string()),
            ("d_limiter", self.d_limiter.to_string()),
            ("schedulefree_c", self.schedulefree_c.to_string()),
        ];
        if let Some(b3) = self.beta3 {
            v.push(("beta3", b3.to_string()));
        }
        v
    }

    fn from_metadata(st: &LoadedState) -> Result<Self> {
        let n = PRODIGY_NAME;
        let c = ProdigyScheduleFreeConfig {
            lr: st.parse(n, "lr")?,
            beta1: st.parse(n, "beta1")?,
            beta2: st.parse(n, "beta2")?,
            beta3: match st.metadata.contains_key("beta3") {
                true => Some(st.parse(n, "beta3")?),
                false => None,
            },
            eps: st.parse(n, "eps")?,
            weight_decay: st.parse(n, "weight_decay")?,
            d0: st.parse(n, "d0")?,
            d_coef: st.parse(n, "d_coef")?,
            d_limiter: st.parse(n, "d_limiter")?,
            schedulefree_c: st.parse(n, "schedulefree_c")?,
        };
        c.validate()?;
        Ok(c)
    }

    fn hyper(&self, grad_scale: f64) -> ProdigySfHyper {
        ProdigySfHyper {
            lr: self.lr,
            beta1: self.beta1,
            beta2: self.beta2,
            beta3: self.beta3(),
            eps: self.eps,
            weight_decay: self.weight_decay,
            d0: self.d0,
            d_coef: self.d_coef,
            d_limiter: self.d_limiter,
            schedulefree_c: self.schedulefree_c,
            grad_scale: grad_scale as f32,
        }
    }
}

/// The global estimate of [`ProdigyScheduleFree`], read back from the device.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ProdigyScheduleFreeEstimate {
    /// The step-size estimate d the next step uses.
    pub d: f64,
    /// The running numerator.
    pub d_numerator: f64,
    /// The last step's denominator.
    pub d_denom: f64,
    /// The sum of the average's weights.
    pub weight_sum: f64,
    /// Steps taken.
    pub k: u64,
}

/// Schedule-free Prodigy over named parameters (f32, bf16 or f16, contiguous, one device).
pub struct ProdigyScheduleFree {
    config: ProdigyScheduleFreeConfig,
    core: Core,
    /// (PRODIGY_SF_SCALARS) f64 on the parameters' device: `multi_sf::prodigy_sf_slot`.
    scalars: Tensor,
}

impl std::fmt::Debug for ProdigyScheduleFree {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct(PRODIGY_NAME)
            .field("config", &self.config)
            .field("params", &self.core.params.len())
            .finish()
    }
}

fn initial_scalars(d0: f64) -> [f64; PRODIGY_SF_SCALARS] {
    let mut st = [0.0; PRODIGY_SF_SCALARS];
    st[slot::D] = d0;
    st
}

impl ProdigyScheduleFree {
    /// Checks `config` and the parameters (unique names, float leaves that require grad, f32,
    /// bf16 or f16, contiguous, one device: d is one estimate over all of them).
    pub fn new(params: Vec<(String, Tensor)>, config: ProdigyScheduleFreeConfig) -> Result<Self> {
        config.validate()?;
        let core = Core::new(PRODIGY_NAME, params)?;
        let scalars = Tensor::from_vec(
            initial_scalars(config.d0).to_vec(),
            vec![PRODIGY_SF_SCALARS],
            &core.device(),
        )?;
        Ok(ProdigyScheduleFree {
            config,
            core,
            scalars,
        })
    }

    /// The hyperparameters in use.
    pub fn config(&self) -> &ProdigyScheduleFreeConfig {
        &self.config
    }

    /// A parameter's state, once it has taken a step.
    pub fn state(&self, name: &str) -> Option<&ScheduleFreeState> {
        self.core.state(name)
    }

    /// The global estimate, read from the device (a host synchronization on CUDA).
    pub fn estimate(&self) -> Result<ProdigyScheduleFreeEstimate> {
        let st = self.read_scalars()?;
        Ok(ProdigyScheduleFreeEstimate {
            d: st[slot::D],
            d_numerator: st[slot::D_NUMERATOR],
            d_denom: st[slot::D_DENOM],
            weight_sum: st[slot::WEIGHT_SUM],
            k: st[slot::K] as u64,
        })
    }

    fn read_scalars(&self) -> Result<[f64; PRODIGY_SF_SCALARS]> {
        let v = self.scalars.to_vec_f64()?;
        let mut st = [0.0; PRODIGY_SF_SCALARS];
        if v.len() != PRODIGY_SF_SCALARS {
            return Err(opt_err(
                PRODIGY_NAME,
                "internal: the scalar state has the wrong size",
            ));
        }
        st.copy_from_slice(&v);
        Ok(st)
    }
}

/// Zero v and s, z a copy of `p` in f32, p0 every 11th value of `p` in bf16 unless `p` is
/// all zeros (the package's `p.any()`; a NaN counts as non-zero).
fn fresh_prodigy(p: &Tensor) -> Result<ScheduleFreeState> {
    let mut st = fresh_adam(p)?;
    let ns = prodigy_sf_sliced(p.elem_count());
    st.s = Some(Tensor::zeros(vec![ns], DType::BF16, p.device())?);
    if sum_sq_multi(&[p])? != 0.0 {
        let idx: Vec<u32> = (0..ns).map(|q| (q * PRODIGY_SF_SLICE) as u32).collect();
        let idx = Tensor::from_vec(idx, vec![ns], p.device())?;
        let sliced = p.flatten_all()?.index_select(&idx, 0)?;
        let p0 = Tensor::zeros(vec![ns], DType::BF16, p.device())?;
        p0.assign(&sliced.to_dtype(DType::BF16)?)?;
        st.p0 = Some(p0);
    }
    Ok(st)
}

impl Optimizer for ProdigyScheduleFree {
    fn step_scaled(&mut self, grads: &Grads, grad_scale: f64) -> Result<()> {
        check_lr(PRODIGY_NAME, self.config.lr)?;
        check_grad_scale(PRODIGY_NAME, grad_scale)?;
        let _guard = crate::no_grad();
        let taken = self.core.taken(grads, fresh_prodigy)?;
        let h = self.config.hyper(grad_scale);
        let scalars = self.scalars.clone();
        self.core.run(&SfOp::Prodigy(h), Some(&scalars), taken)
    }

    fn learning_rate(&self) -> f64 {
        self.config.lr
    }

    fn set_learning_rate(&mut self, lr: f64) {
        self.config.lr = lr;
    }

    fn eval_mode(&mut self) -> Result<()> {
        self.core.set_mode(false, self.config.beta1)
    }

    fn train_mode(&mut self) -> Result<()> {
        self.core.set_mode(true, self.config.beta1)
    }

    fn save_state_to(&self, out: &mut StateMap) -> Result<()> {
        let mut hyper = self.config.to_metadata();
        let st = self.read_scalars()?;
        for (key, i) in PRODIGY_SCALAR_KEYS {
            hyper.push((key, st[i].to_string()));
        }
        self.core.save(PRODIGY_KIND, hyper, out)
    }

    fn load_state_from(&mut self, src: &StateSource<'_>) -> Result<()> {
        let _guard = crate::no_grad();
        let keys: Vec<&str> = PRODIGY_KEYS
            .iter()
            .copied()
            .chain(PRODIGY_SCALAR_KEYS.iter().map(|k| k.0))
            .collect();
        let (loaded, state, train_mode) = self.core.load(PRODIGY_KIND, &keys, true, src)?;
        let config = ProdigyScheduleFreeConfig::from_metadata(&loaded)?;
        let mut st = initial_scalars(config.d0);
        for (key, i) in PRODIGY_SCALAR_KEYS {
            st[i] = loaded.parse(PRODIGY_NAME, key)?;
        }
        let (k, d) = (st[slot::K], st[slot::D]);
        if !(k >= 0.0 && k.fract() == 0.0 && d.is_finite() && d > 0.0) {
            return Err(loaded.err(
                PRODIGY_NAME,
                format!("k = {k} and d = {d} are not a step count and a positive estimate"),
            ));
        }
        let scalars = Tensor::from_vec(st.to_vec(), vec![PRODIGY_SF_SCALARS], &self.core.device())?;
        self.config = config;
        self.core.state = state;
        self.core.train_mode = train_mode;
        self.scalars = scalars;
        Ok(())
    }
}
