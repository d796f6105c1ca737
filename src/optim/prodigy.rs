//! Prodigy: Adam with a learning rate found by D-adaptation (Mishchenko & Defazio 2024,
//! "Prodigy: An Expeditiously Adaptive Parameter-Free Learner", <https://arxiv.org/abs/2306.06101>),
//! with the semantics of the `prodigyopt` package's `Prodigy` (version 1.1.2,
//! <https://github.com/konstmish/prodigy>), the one kohya sd-scripts, ai-toolkit, OneTrainer
//! and SimpleTuner use. `backend::multi::ProdigyHyper` gives the update operation by
//! operation.
//!
//! The estimate d is global: each step sums `<g, p0 - p>` and `|s|` over every value of
//! every parameter. The step is one fused multi-tensor call (`tensor::multi::prodigy_multi`):
//! on CUDA a first pass per parameter dtype writes each chunk's partial sums, one block adds
//! them and updates d in a small f64 tensor on the device, and a second pass reads d from
//! there; no value comes back to the host during a step. The host reads the scalar state
//! only to save it ([`Optimizer::save_state`]) or when asked ([`Prodigy::estimate`]). A
//! parameter's first step also reads one number (whether the parameter is all zeros, as
//! prodigyopt's `p.any()`, to keep no p0 copy for the zero-initialized LoRA up matrices).
//!
//! Differences from prodigyopt: one parameter group; no `slice_p` (every value counts) and no
//! FSDP; the state (m, v, s, p0) is f32 for f32, bf16 and f16 parameters (prodigyopt keeps
//! it in the parameter's dtype) and f64 parameters are refused; `<g, p0 - p>` is summed in
//! f64; the bias correction's `beta^(k+1)` is a running product instead of a power (equal
//! to within f64 rounding).
//!
//! Learning rate: `lr` multiplies d (prodigyopt's default and advice: 1.0). A schedule
//! scales it as for Adam; prodigyopt advises cosine annealing or a constant rate, and
//! `safeguard_warmup` with a warm-up (a small lr in the warm-up steps shrinks s's growth and
//! so inflates d otherwise).
//!
//! State files: `<param>.exp_avg` (absent when beta1 = 0), `<param>.exp_avg_sq`, `<param>.s`,
//! `<param>.p0` (absent for a parameter that started at zero), `step.<param>` (the steps the
//! parameter had a gradient in); the global state `d`, `d_max`, `d_numerator`, `d_denom`,
//! `d_hat`, `k`, `beta1_pow`, `beta2_pow` and the hyperparameters in the metadata, as
//! shortest round-trip decimals, so a reloaded optimizer continues bit for bit.

use super::{
    check_at_least, check_beta, check_grad_scale, check_lr, fresh_copy, metadata_for, opt_err,
    state_into, update_err, LoadedState, Optimizer, ParamSet, StateMap, StateSource,
};
use crate::backend::multi::{prodigy_slot as slot, ProdigyHyper, PRODIGY_SCALARS};
use crate::tensor::multi::{prodigy_multi, ProdigySlot};
use crate::{sum_sq_multi, DType, Device, Grads, Result, Tensor};

const NAME: &str = "Prodigy";
const KIND: &str = "prodigy";
const EXP_AVG: &str = "exp_avg";
const EXP_AVG_SQ: &str = "exp_avg_sq";
const S: &str = "s";
const P0: &str = "p0";
/// Every state tensor suffix, longest first where one ends another.
const SUFFIXES: [&str; 4] = [EXP_AVG_SQ, EXP_AVG, P0, S];
/// The hyperparameters' metadata keys.
const HYPER_KEYS: [&str; 12] = [
    "lr",
    "beta1",
    "beta2",
    "beta3",
    "eps",
    "weight_decay",
    "decouple",
    "use_bias_correction",
    "safeguard_warmup",
    "d0",
    "d_coef",
    "growth_rate",
];
/// The scalar state's metadata keys, by slot.
const SCALAR_KEYS: [(&str, usize); 8] = [
    ("d", slot::D),
    ("d_max", slot::D_MAX),
    ("d_numerator", slot::D_NUMERATOR),
    ("d_denom", slot::D_DENOM),
    ("d_hat", slot::D_HAT),
    ("k", slot::K),
    ("beta1_pow", slot::BETA1_POW),
    ("beta2_pow", slot::BETA2_POW),
];

/// Hyperparameters of [`Prodigy`]; the defaults are prodigyopt 1.1.2's.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ProdigyConfig {
    /// The multiplier of the adapted step size d (prodigyopt's lr, default 1.0), >= 0.
    pub lr: f64,
    /// First-moment decay in [0, 1) (0: no first moment is kept).
    pub beta1: f64,
    /// Second-moment decay in [0, 1).
    pub beta2: f64,
    /// Decay of s and of d's numerator in [0, 1); `None`: sqrt(beta2).
    pub beta3: Option<f64>,
    /// Added to sqrt(v) after scaling by d, > 0.
    pub eps: f64,
    /// Weight decay, >= 0.
    pub weight_decay: f64,
    /// Decoupled (AdamW-style, default) rather than an L2 penalty on the gradient.
    pub decouple: bool,
    /// Adam's bias correction in the step size (default off).
    pub use_bias_correction: bool,
    /// s grows by d rather than by d * lr (default off; advised with a warm-up).
    pub safeguard_warmup: bool,
    /// The first estimate of d, > 0 (default 1e-6).
    pub d0: f64,
    /// The multiplier of the raw estimate, > 0 (default 1.0).
    pub d_coef: f64,
    /// The most d may grow in a step, a factor > 0 (default infinity: unbounded).
    pub growth_rate: f64,
}

impl Default for ProdigyConfig {
    fn default() -> Self {
        // prodigyopt 1.1.2, Prodigy.__init__'s defaults.
        ProdigyConfig {
            lr: 1.0,
            beta1: 0.9,
            beta2: 0.999,
            beta3: None,
            eps: 1e-8,
            weight_decay: 0.0,
            decouple: true,
            use_bias_correction: false,
            safeguard_warmup: false,
            d0: 1e-6,
            d_coef: 1.0,
            growth_rate: f64::INFINITY,
        }
    }
}

impl ProdigyConfig {
    /// prodigyopt's checks (d0, eps > 0; betas in [0, 1)) and finiteness, plus beta3 in
    /// [0, 1), d_coef > 0 and growth_rate > 0 (infinity allowed).
    pub fn validate(&self) -> Result<()> {
        check_at_least(NAME, "learning rate", self.lr, 0.0)?;
        check_beta(NAME, "beta1", self.beta1)?;
        check_beta(NAME, "beta2", self.beta2)?;
        if let Some(b3) = self.beta3 {
            check_beta(NAME, "beta3", b3)?;
        }
        check_at_least(NAME, "weight_decay", self.weight_decay, 0.0)?;
        for (what, v) in [("eps", self.eps), ("d0", self.d0), ("d_coef", self.d_coef)] {
            if !(v.is_finite() && v > 0.0) {
                return Err(opt_err(
                    NAME,
                    format!("invalid {what} {v}: must be finite and > 0"),
                ));
            }
        }
        if self.growth_rate.is_nan() || self.growth_rate <= 0.0 {
            return Err(opt_err(
                NAME,
                format!(
                    "invalid growth_rate {}: must be > 0 (infinity: unbounded)",
                    self.growth_rate
                ),
            ));
        }
        Ok(())
    }

    /// beta3 as used: the given value or sqrt(beta2) (prodigyopt's default).
    pub fn beta3(&self) -> f64 {
        self.beta3.unwrap_or_else(|| self.beta2.sqrt())
    }

    fn to_metadata(self) -> Vec<(&'static str, String)> {
        let mut v = vec![
            ("lr", self.lr.to_string()),
            ("beta1", self.beta1.to_string()),
            ("beta2", self.beta2.to_string()),
            ("eps", self.eps.to_string()),
            ("weight_decay", self.weight_decay.to_string()),
            ("decouple", self.decouple.to_string()),
            ("use_bias_correction", self.use_bias_correction.to_string()),
            ("safeguard_warmup", self.safeguard_warmup.to_string()),
            ("d0", self.d0.to_string()),
            ("d_coef", self.d_coef.to_string()),
            ("growth_rate", self.growth_rate.to_string()),
        ];
        if let Some(b3) = self.beta3 {
            v.push(("beta3", b3.to_string()));
        }
        v
    }

    fn from_metadata(state: &LoadedState) -> Result<Self> {
        let c = ProdigyConfig {
            lr: state.parse(NAME, "lr")?,
            beta1: state.parse(NAME, "beta1")?,
            beta2: state.parse(NAME, "beta2")?,
            beta3: match state.metadata.contains_key("beta3") {
                true => Some(state.parse(NAME, "beta3")?),
                false => None,
            },
            eps: state.parse(NAME, "eps")?,
            weight_decay: state.parse(NAME, "weight_decay")?,
            decouple: state.parse(NAME, "decouple")?,
            use_bias_correction: state.parse(NAME, "use_bias_correction")?,
            safeguard_warmup: state.parse(NAME, "safeguard_warmup")?,
            d0: state.parse(NAME, "d0")?,
            d_coef: state.parse(NAME, "d_coef")?,
            growth_rate: state.parse(NAME, "growth_rate")?,
        };
        c.validate()?;
        Ok(c)
    }

    /// The step's hyperparameters for the fused call.
    fn hyper(&self, grad_scale: f64) -> ProdigyHyper {
        ProdigyHyper {
            lr: self.lr,
            beta1: self.beta1,
            beta2: self.beta2,
            beta3: self.beta3(),
            eps: self.eps,
            weight_decay: self.weight_decay,
            decouple: self.decouple,
            use_bias_correction: self.use_bias_correction,
            safeguard_warmup: self.safeguard_warmup,
            d0: self.d0,
            d_coef: self.d_coef,
            growth_rate: self.growth_rate,
            grad_scale: grad_scale as f32,
        }
    }

    /// The scalar state before the first step: d = d_max = d0, k = 0, beta powers 1.
    fn initial_scalars(&self) -> [f64; PRODIGY_SCALARS] {
        let mut st = [0.0; PRODIGY_SCALARS];
        st[slot::D] = self.d0;
        st[slot::D_MAX] = self.d0;
        st[slot::BETA1_POW] = 1.0;
        st[slot::BETA2_POW] = 1.0;
        st
    }
}

/// One parameter's Prodigy state, f32 tensors of the parameter's shape.
#[derive(Debug, Clone)]
pub struct ProdigyState {
    /// Steps this parameter had a gradient in.
    pub step: u64,
    /// First moment (absent when beta1 = 0).
    pub exp_avg: Option<Tensor>,
    /// Second moment.
    pub exp_avg_sq: Tensor,
    /// The running sum s of d's denominator.
    pub s: Tensor,
    /// The parameter's value at its first step (absent when that was all zeros).
    pub p0: Option<Tensor>,
}

/// The global D-adaptation state, read back from the device.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ProdigyEstimate {
    /// The current step-size estimate d.
    pub d: f64,
    /// The largest raw estimate so far.
    pub d_max: f64,
    /// The last step's raw estimate.
    pub d_hat: f64,
    /// The running numerator.
    pub d_numerator: f64,
    /// The last step's denominator.
    pub d_denom: f64,
    /// Steps applied (prodigyopt's k).
    pub k: u64,
}

/// Prodigy over named parameters (f32, bf16 or f16, contiguous, all on one device).
pub struct Prodigy {
    config: ProdigyConfig,
    params: ParamSet,
    state: Vec<Option<ProdigyState>>,
    /// (PRODIGY_SCALARS) f64 on the parameters' device: `backend::multi::prodigy_slot`.
    scalars: Tensor,
}

impl std::fmt::Debug for Prodigy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct(NAME)
            .field("config", &self.config)
            .field("params", &self.params.len())
            .finish()
    }
}

impl Prodigy {
    /// Checks `config` and the parameters: unique names, float leaves that require grad,
    /// f32, bf16 or f16, contiguous, on one device (d is one estimate over all of them).
    pub fn new(params: Vec<(String, Tensor)>, config: ProdigyConfig) -> Result<Self> {
        config.validate()?;
        let params = ParamSet::new(NAME, params)?;
        let device = params.params[0].1.device().clone();
        params.check_fused()?;
        for (name, p) in &params.params {
            if p.device() != &device {
                return Err(opt_err(
                    NAME,
                    format!(
                        "parameter '{name}' is on {} but '{}' is on {device}: Prodigy's d is \
                         one estimate over every parameter, kept on one device",
                        p.device(),
                        params.params[0].0
                    ),
                ));
            }
        }
        let scalars = scalars_tensor(&config.initial_scalars(), &device)?;
        let state = vec![None; params.len()];
        Ok(Prodigy {
            config,
            params,
            state,
            scalars,
        })
    }

    /// The hyperparameters in use.
    pub fn config(&self) -> &ProdigyConfig {
        &self.config
    }

    /// The parameters, in the order given.
    pub fn params(&self) -> &[(String, Tensor)] {
        &self.params.params
    }

    /// A parameter's state, once it has taken a step.
    pub fn state(&self, name: &str) -> Option<&ProdigyState> {
        self.params
            .lookup(name)
            .and_then(|(i, _)| self.state.get(i))
            .and_then(Option::as_ref)
    }

    /// The global estimate, read from the device (a host synchronization on CUDA).
    pub fn estimate(&self) -> Result<ProdigyEstimate> {
        let st = self.read_scalars()?;
        Ok(ProdigyEstimate {
            d: st[slot::D],
            d_max: st[slot::D_MAX],
            d_hat: st[slot::D_HAT],
            d_numerator: st[slot::D_NUMERATOR],
            d_denom: st[slot::D_DENOM],
            k: st[slot::K] as u64,
        })
    }

    fn read_scalars(&self) -> Result<[f64; PRODIGY_SCALARS]> {
        let v = self.scalars.to_vec_f64()?;
        let mut st = [0.0; PRODIGY_SCALARS];
        if v.len() != PRODIGY_SCALARS {
            return Err(opt_err(
                NAME,
                "internal: the scalar state has the wrong size",
            ));
        }
        st.copy_from_slice(&v);
        Ok(st)
    }

    /// Fresh state for parameter `p`: zero moments and s, and p0 a copy of `p` unless `p` is
    /// all zeros (prodigyopt's `p.any()`; a NaN counts as non-zero).
    fn fresh_state(&self, p: &Tensor) -> Result<ProdigyState> {
        let z = || Tensor::zeros(p.shape().clone(), DType::F32, p.device());
        let nonzero = sum_sq_multi(&[p])? != 0.0;
        Ok(ProdigyState {
            step: 0,
            exp_avg: if self.config.beta1 > 0.0 {
                Some(z()?)
            } else {
                None
            },
            exp_avg_sq: z()?,
            s: z()?,
            p0: if nonzero {
                Some(fresh_copy(&p.to_dtype(DType::F32)?)?)
            } else {
                None
            },
        })
    }
}

/// The scalar state as an f64 tensor on `device`.
fn scalars_tensor(st: &[f64; PRODIGY_SCALARS], device: &Device) -> Result<Tensor> {
    Tensor::from_vec(st.to_vec(), vec![PRODIGY_SCALARS], device)
}

impl Optimizer for Prodigy {
    fn step_scaled(&mut self, grads: &Grads, grad_scale: f64) -> Result<()> {
        check_lr(NAME, self.config.lr)?;
        check_grad_scale(NAME, grad_scale)?;
        let _guard = crate::no_grad();
        let gs = self.params.gradients(grads)?;
        // Each parameter with a gradient: its gradient in its dtype, contiguous, and its
        // state (fresh before its first step).
        let mut taken: Vec<(usize, Tensor, ProdigyState)> = vec![];
        for (i, ((name, p), g)) in self.params.params.iter().zip(&gs).enumerate() {
            let Some(g) = g else { continue };
            let prep = || -> Result<_> {
                let g = g.to_dtype(p.dtype())?.contiguous()?;
                let st = match &self.state[i] {
                    Some(s) => s.clone(),
                    None => self.fresh_state(p)?,
                };
                Ok((g, st))
            };
            let (g, st) = prep().map_err(|e| update_err(NAME, name, e))?;
            taken.push((i, g, st));
        }
        // prodigyopt with lr = 0 creates the state and changes nothing else.
        if self.config.lr > 0.0 && !taken.is_empty() {
            let slots: Vec<ProdigySlot<'_>> = taken
                .iter()
                .map(|(i, g, st)| ProdigySlot {
                    p: &self.params.params[*i].1,
                    g,
                    m: st.exp_avg.as_ref(),
                    v: &st.exp_avg_sq,
                    s: &st.s,
                    p0: st.p0.as_ref(),
                })
                .collect();
            prodigy_multi(&self.config.hyper(grad_scale), &self.scalars, &slots)
                .map_err(|e| opt_err(NAME, e.to_string()))?;
        }
        for (i, _, mut st) in taken {
            if self.config.lr > 0.0 {
                st.step = st.step.saturating_add(1);
            }
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
        let mut hyper = self.config.to_metadata();
        let st = self.read_scalars()?;
        for (key, i) in SCALAR_KEYS {
            hyper.push((key, st[i].to_string()));
        }
        let mut metadata = metadata_for(KIND, &hyper);
        let mut tensors = Vec::new();
        for (i, ((name, _), s)) in self.params.params.iter().zip(&self.state).enumerate() {
            if let Some(s) = s {
                if let Some(m) = &s.exp_avg {
                    tensors.push((i, EXP_AVG, m));
                }
                tensors.push((i, EXP_AVG_SQ, &s.exp_avg_sq));
                tensors.push((i, S, &s.s));
                if let Some(p0) = &s.p0 {
                    tensors.push((i, P0, p0));
                }
                metadata.insert(format!("step.{name}"), s.step.to_string());
            }
        }
        state_into(&self.params, tensors, &metadata, out);
        Ok(())
    }

    fn load_state_from(&mut self, src: &StateSource<'_>) -> Result<()> {
        let _guard = crate::no_grad();
        let keys: Vec<&str> = HYPER_KEYS
            .iter()
            .copied()
            .chain(SCALAR_KEYS.iter().map(|k| k.0))
            .collect();
        let mut loaded = LoadedState::read_from(&self.params, KIND, &SUFFIXES, &keys, true, src)?;
        let config = ProdigyConfig::from_metadata(&loaded)?;
        let mut st = config.initial_scalars();
        for (key, i) in SCALAR_KEYS {
            st[i] = loaded.parse(NAME, key)?;
        }
        let k = st[slot::K];
        if !(k >= 0.0 && k.fract() == 0.0 && st[slot::D].is_finite() && st[slot::D] > 0.0) {
            return Err(loaded.err(
                NAME,
                format!(
                    "k = {k} and d = {} are not a step count and a positive estimate",
                    st[slot::D]
                ),
            ));
        }
        let device = self.scalars.device().clone();
        let scalars = scalars_tensor(&st, &device)?;
        let mut state = Vec::with_capacity(self.params.len());
        let per_param = std::mem::take(&mut loaded.tensors);
        for ((name, _), mut t) in self.params.params.iter().zip(per_param) {
            let step = loaded.step(NAME, name)?;
            let (m, v, s, p0) = (
                t.remove(EXP_AVG),
                t.remove(EXP_AVG_SQ),
                t.remove(S),
                t.remove(P0),
            );
            let m_ok = m.is_some() == (config.beta1 > 0.0);
            state.push(match (step, v, s) {
                (None, None, None) if m.is_none() && p0.is_none() => None,
                (Some(step), Some(exp_avg_sq), Some(s)) if m_ok => Some(ProdigyState {
                    step,
                    exp_avg: m,
                    exp_avg_sq,
                    s,
                    p0,
                }),
                (step, v, s) => {
                    return Err(loaded.err(
                        NAME,
                        format!(
                            "parameter '{name}': incomplete state (step {}, {name}.{EXP_AVG} \
                             {}, {name}.{EXP_AVG_SQ} {}, {name}.{S} {}); a parameter's state \
                             is a step, exp_avg_sq, s and (when beta1 > 0) exp_avg, or nothing",
                            step.map_or("missing".into(), |s| s.to_string()),
                            if m.is_some() { "present" } else { "missing" },
                            if v.is_some() { "present" } else { "missing" },
                            if s.is_some() { "present" } else { "missing" },
                        ),
                    ))
                }
            });
        }
        self.config = config;
        self.state = state;
        self.scalars = scalars;
        Ok(())
    }
}
