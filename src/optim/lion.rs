//! Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms",
//! <https://arxiv.org/abs/2302.06675>) with the semantics of lion-pytorch's `Lion`
//! (lucidrains/lion-pytorch), and [`Lion8bit`], its momentum block-wise 8-bit as
//! bitsandbytes' `Lion8bit`. Per step, for a parameter `p` with gradient `g`:
//!
//! ```text
//! p = p * (1 - lr * weight_decay)                 (decoupled decay)
//! p = p - lr * sign(beta1 * m + (1 - beta1) * g)
//! m = beta2 * m + (1 - beta2) * g                 (m starts at 0)
//! ```
//!
//! `backend::lion` gives the f32 operations; the step is one fused multi-tensor launch per
//! device, dtype and kind of momentum, the same f32 arithmetic on the CPU and on CUDA.
//! Defaults are lion-pytorch's: lr 1e-4, betas (0.9, 0.99), weight decay 0 (its authors
//! advise an lr 3-10 times smaller than AdamW's and a weight decay 3-10 times larger).
//! lion-pytorch's `decoupled_weight_decay` (weight decay divided by the first lr) is not
//! offered; its `use_triton` computes the same update.
//!
//! [`Lion8bit`] keeps the momentum of a parameter of at least `min_8bit_size` (4096,
//! bitsandbytes' default) values as `quant8` codes with the signed dynamic map (the
//! quantization [`AdamW8bit`](super::AdamW8bit)'s first moment uses, blocks of 256), 1.03
//! bytes a value; smaller parameters keep f32 and take exactly [`Lion`]'s update.
//!
//! State files: `<param>.exp_avg` (F32; Lion, and Lion8bit's small parameters) or
//! `<param>.exp_avg_codes` (U32 (blocks, 64)) and `<param>.exp_avg_absmax` (F32 (blocks));
//! metadata `optimizer` ("lion" or "lion8bit"), `lr`, `beta1`, `beta2`, `weight_decay`,
//! (Lion8bit:) `block_size` and `min_8bit_size`, and `step.<param>`.

use super::{
    check_at_least, check_grad_scale, check_lr, metadata_for, opt_err, state_into, update_err,
    LoadedState, Optimizer, ParamSet, StateMap, StateSource,
};
use crate::backend::lion::LionHyper;
use crate::backend::quant8::{self, BLOCK, WORDS_PER_BLOCK};
use crate::tensor::multi::{lion_multi, LionMomentum, LionSlot};
use crate::{DType, Device, Grads, Result, Tensor};

const EXP_AVG: &str = "exp_avg";
const EXP_AVG_CODES: &str = "exp_avg_codes";
const EXP_AVG_ABSMAX: &str = "exp_avg_absmax";
/// Every state tensor suffix, longest first where one ends another.
const SUFFIXES: [&str; 3] = [EXP_AVG_CODES, EXP_AVG_ABSMAX, EXP_AVG];
const HYPER_KEYS: [&str; 4] = ["lr", "beta1", "beta2", "weight_decay"];
const BLOCK_SIZE_KEY: &str = "block_size";
const MIN_8BIT_KEY: &str = "min_8bit_size";

/// Hyperparameters of [`Lion`]; the defaults are lion-pytorch's.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LionConfig {
    /// Learning rate, >= 0 (the size of every value's step).
    pub lr: f64,
    /// The interpolation between momentum and gradient whose sign is the update, in [0, 1].
    pub beta1: f64,
    /// The momentum's decay, in [0, 1].
    pub beta2: f64,
    /// Decoupled weight decay, >= 0: each step multiplies p by 1 - lr * weight_decay.
    pub weight_decay: f64,
}

impl Default for LionConfig {
    fn default() -> Self {
        // lion-pytorch, Lion.__init__'s defaults.
        LionConfig {
            lr: 1e-4,
            beta1: 0.9,
            beta2: 0.99,
            weight_decay: 0.0,
        }
    }
}

impl LionConfig {
    /// lion-pytorch's checks (betas in [0, 1]) plus lr and weight_decay finite and >= 0.
    pub fn validate(&self, optimizer: &'static str) -> Result<()> {
        check_at_least(optimizer, "learning rate", self.lr, 0.0)?;
        for (what, b) in [("beta1", self.beta1), ("beta2", self.beta2)] {
            if !(0.0..=1.0).contains(&b) {
                return Err(opt_err(
                    optimizer,
                    format!("invalid {what} {b}: must be in [0, 1]"),
                ));
            }
        }
        check_at_least(optimizer, "weight_decay", self.weight_decay, 0.0)
    }

    fn to_metadata(self) -> Vec<(&'static str, String)> {
        vec![
            ("lr", self.lr.to_string()),
            ("beta1", self.beta1.to_string()),
            ("beta2", self.beta2.to_string()),
            ("weight_decay", self.weight_decay.to_string()),
        ]
    }

    fn from_metadata(optimizer: &'static str, state: &LoadedState) -> Result<Self> {
        let c = LionConfig {
            lr: state.parse(optimizer, "lr")?,
            beta1: state.parse(optimizer, "beta1")?,
            beta2: state.parse(optimizer, "beta2")?,
            weight_decay: state.parse(optimizer, "weight_decay")?,
        };
        c.validate(optimizer)?;
        Ok(c)
    }

    /// The step's f32 scalars.
    fn hyper(&self, grad_scale: f64) -> LionHyper {
        LionHyper {
            beta1: self.beta1 as f32,
            beta2: self.beta2 as f32,
            one_minus_beta1: (1.0 - self.beta1) as f32,
            one_minus_beta2: (1.0 - self.beta2) as f32,
            decay: (1.0 - self.lr * self.weight_decay) as f32,
            neg_lr: (-self.lr) as f32,
            grad_scale: grad_scale as f32,
        }
    }
}

/// Hyperparameters of [`Lion8bit`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Lion8bitConfig {
    /// lr, betas and weight decay, as for [`Lion`] (bitsandbytes' defaults are the same).
    pub lion: LionConfig,
    /// Parameters with fewer values keep an f32 momentum (bitsandbytes' `min_8bit_size`,
    /// 4096).
    pub min_8bit_size: usize,
}

impl Default for Lion8bitConfig {
    fn default() -> Self {
        Lion8bitConfig {
            lion: LionConfig::default(),
            min_8bit_size: 4096,
        }
    }
}

/// One parameter's Lion momentum.
#[derive(Debug, Clone)]
pub enum LionState {
    /// f32 of the parameter's shape.
    Full {
        /// Steps taken by the parameter.
        step: u64,
        /// The momentum m.
        exp_avg: Tensor,
    },
    /// Block-wise 8-bit ([`Lion8bit`] on a parameter of at least `min_8bit_size` values).
    Quantized {
        /// Steps taken by the parameter.
        step: u64,
        /// Four one-byte codes per u32, U32 `(blocks, 64)`.
        codes: Tensor,
        /// The largest |value| of each block, F32 `(blocks,)`.
        absmax: Tensor,
    },
}

impl LionState {
    /// Steps taken by the parameter.
    pub fn step(&self) -> u64 {
        match self {
            LionState::Full { step, .. } | LionState::Quantized { step, .. } => *step,
        }
    }

    /// Bytes held by the state tensors.
    pub fn bytes(&self) -> usize {
        let t = |t: &Tensor| t.elem_count() * t.dtype().size_in_bytes();
        match self {
            LionState::Full { exp_avg, .. } => t(exp_avg),
            LionState::Quantized { codes, absmax, .. } => t(codes) + t(absmax),
        }
    }

    fn stepped(&self) -> Self {
        match self.clone() {
            LionState::Full { step, exp_avg } => LionState::Full {
                step: step.saturating_add(1),
                exp_avg,
            },
            LionState::Quantized {
                step,
                codes,
                absmax,
            } => LionState::Quantized {
                step: step.saturating_add(1),
                codes,
                absmax,
            },
        }
    }
}

/// What [`Lion`] and [`Lion8bit`] share: the parameters, the state, and where 8-bit momenta
/// start (`None`: never).
struct LionCore {
    name: &'static str,
    kind: &'static str,
    config: LionConfig,
    min_8bit_size: Option<usize>,
    params: ParamSet,
    state: Vec<Option<LionState>>,
    /// The (256) signed map, one per device of a quantized parameter.
    maps: Vec<(Device, Tensor)>,
}

impl LionCore {
    fn new(
        name: &'static str,
        kind: &'static str,
        params: Vec<(String, Tensor)>,
        config: LionConfig,
        min_8bit_size: Option<usize>,
    ) -> Result<Self> {
        config.validate(name)?;
        let params = ParamSet::new(name, params)?;
        params.check_fused()?;
        let maps = maps_for(&params, min_8bit_size)?;
        let state = vec![None; params.len()];
        Ok(LionCore {
            name,
            kind,
            config,
            min_8bit_size,
            params,
            state,
            maps,
        })
    }

    fn quantized(&self, p: &Tensor) -> bool {
        self.min_8bit_size.is_some_and(|m| p.elem_count() >= m)
    }

    fn state(&self, name: &str) -> Option<&LionState> {
        self.params
            .lookup(name)
            .and_then(|(i, _)| self.state.get(i))
            .and_then(Option::as_ref)
    }

    /// A parameter's momentum (dequantized on the host where 8-bit), once it has taken a
    /// step.
    fn momentum(&self, name: &str) -> Result<Option<Vec<f32>>> {
        let Some((i, p)) = self.params.lookup(name) else {
            return Ok(None);
        };
        Ok(match self.state.get(i).and_then(Option::as_ref) {
            None => None,
            Some(LionState::Full { exp_avg, .. }) => Some(exp_avg.flatten_all()?.to_vec::<f32>()?),
            Some(LionState::Quantized { codes, absmax, .. }) => Some(quant8::dequantize_blockwise(
                &quant8::dynamic_map(true),
                &codes.to_vec::<u32>()?,
                &absmax.to_vec::<f32>()?,
                p.elem_count(),
            )),
        })
    }

    fn fresh(&self, p: &Tensor) -> Result<LionState> {
        if self.quantized(p) {
            let nb = quant8::blocks(p.elem_count());
            let word = quant8::splat(quant8::zero_code(&quant8::dynamic_map(true)));
            Ok(LionState::Quantized {
                step: 0,
                codes: Tensor::full(
                    f64::from(word),
                    (nb, WORDS_PER_BLOCK),
                    DType::U32,
                    p.device(),
                )?,
                absmax: Tensor::zeros(nb, DType::F32, p.device())?,
            })
        } else {
            Ok(LionState::Full {
                step: 0,
                exp_avg: Tensor::zeros(p.shape().clone(), DType::F32, p.device())?,
            })
        }
    }

    fn step_scaled(&mut self, grads: &Grads, grad_scale: f64) -> Result<()> {
        let name = self.name;
        check_lr(name, self.config.lr)?;
        check_grad_scale(name, grad_scale)?;
        let _guard = crate::no_grad();
        let gs = self.params.gradients(grads)?;
        let mut next: Vec<(usize, Tensor, LionState)> = vec![];
        for (i, ((pname, p), g)) in self.params.params.iter().zip(&gs).enumerate() {
            let Some(g) = g else { continue };
            let prep = || -> Result<_> {
                let g = g.to_dtype(p.dtype())?.contiguous()?;
                let st = match &self.state[i] {
                    Some(s) => s.clone(),
                    None => self.fresh(p)?,
                };
                Ok((g, st.stepped()))
            };
            let (g, st) = prep().map_err(|e| update_err(name, pname, e))?;
            next.push((i, g, st));
        }
        let slots: Vec<LionSlot<'_>> = next
            .iter()
            .map(|(i, g, s)| LionSlot {
                p: &self.params.params[*i].1,
                g,
                m: match s {
                    LionState::Full { exp_avg, .. } => LionMomentum::Full(exp_avg),
                    LionState::Quantized { codes, absmax, .. } => {
                        LionMomentum::Quantized { codes, absmax }
                    }
                },
            })
            .collect();
        let maps: Vec<&Tensor> = self.maps.iter().map(|(_, m)| m).collect();
        lion_multi(&self.config.hyper(grad_scale), &maps, &slots)
            .map_err(|e| opt_err(name, e.to_string()))?;
        for (i, _, s) in next {
            self.state[i] = Some(s);
        }
        Ok(())
    }

    fn save_state_to(&self, out: &mut StateMap) -> Result<()> {
        let mut hyper = self.config.to_metadata();
        if let Some(m) = self.min_8bit_size {
            hyper.push((BLOCK_SIZE_KEY, BLOCK.to_string()));
            hyper.push((MIN_8BIT_KEY, m.to_string()));
        }
        let mut metadata = metadata_for(self.kind, &hyper);
        let mut tensors = Vec::new();
        for (i, ((name, _), s)) in self.params.params.iter().zip(&self.state).enumerate() {
            let Some(s) = s else { continue };
            match s {
                LionState::Full { exp_avg, .. } => tensors.push((i, EXP_AVG, exp_avg)),
                LionState::Quantized { codes, absmax, .. } => {
                    tensors.push((i, EXP_AVG_CODES, codes));
                    tensors.push((i, EXP_AVG_ABSMAX, absmax));
                }
            }
            metadata.insert(format!("step.{name}"), s.step().to_string());
        }
        state_into(&self.params, tensors, &metadata, out);
        Ok(())
    }

    fn load_state_from(&mut self, src: &StateSource<'_>) -> Result<()> {
        let _guard = crate::no_grad();
        let name = self.name;
        let mut keys = HYPER_KEYS.to_vec();
        if self.min_8bit_size.is_some() {
            keys.extend([BLOCK_SIZE_KEY, MIN_8BIT_KEY]);
        }
        let exact = |suffix: &str, p: &Tensor| {
            let nb = quant8::blocks(p.elem_count());
            match suffix {
                EXP_AVG_CODES => Some((DType::U32, vec![nb, WORDS_PER_BLOCK])),
                EXP_AVG_ABSMAX => Some((DType::F32, vec![nb])),
                _ => None,
            }
        };
        let mut loaded = LoadedState::read_with_from(
            &self.params,
            self.kind,
            &SUFFIXES,
            &keys,
            true,
            &exact,
            src,
        )?;
        let config = LionConfig::from_metadata(name, &loaded)?;
        let min_8bit_size = match self.min_8bit_size {
            Some(_) => {
                let block: usize = loaded.parse(name, BLOCK_SIZE_KEY)?;
                if block != BLOCK {
                    return Err(loaded.err(
                        name,
                        format!("block size {block}, but {name} quantizes blocks of {BLOCK}"),
                    ));
                }
                Some(loaded.parse(name, MIN_8BIT_KEY)?)
            }
            None => None,
        };
        let per_param = std::mem::take(&mut loaded.tensors);
        let mut state = Vec::with_capacity(self.params.len());
        for ((pname, p), mut t) in self.params.params.iter().zip(per_param) {
            let step = loaded.step(name, pname)?;
            let quantized = min_8bit_size.is_some_and(|m| p.elem_count() >= m);
            let (m, c, a) = (
                t.remove(EXP_AVG),
                t.remove(EXP_AVG_CODES),
                t.remove(EXP_AVG_ABSMAX),
            );
            state.push(match (step, m, c, a) {
                (None, None, None, None) => None,
                (Some(step), Some(exp_avg), None, None) if step >= 1 && !quantized => {
                    Some(LionState::Full { step, exp_avg })
                }
                (Some(step), None, Some(codes), Some(absmax)) if step >= 1 && quantized => {
                    Some(LionState::Quantized {
                        step,
                        codes,
                        absmax,
                    })
                }
                (step, ..) => {
                    let want = if quantized {
                        format!("{pname}.{EXP_AVG_CODES} and {pname}.{EXP_AVG_ABSMAX}")
                    } else {
                        format!("{pname}.{EXP_AVG}")
                    };
                    return Err(loaded.err(
                        name,
                        format!(
                            "parameter '{pname}': incomplete state (step {}); a parameter's \
                             state is a step >= 1 and exactly {want} ({} values), or nothing",
                            step.map_or("missing".into(), |s| s.to_string()),
                            p.elem_count()
                        ),
                    ));
                }
            });
        }
        let maps = maps_for(&self.params, min_8bit_size)?;
        self.config = config;
        self.min_8bit_size = min_8bit_size;
        self.state = state;
        self.maps = maps;
        Ok(())
    }
}

/// The signed map on every device holding a parameter quantized under `min_8bit_size`.
fn maps_for(params: &ParamSet, min_8bit_size: Option<usize>) -> Result<Vec<(Device, Tensor)>> {
    let mut maps: Vec<(Device, Tensor)> = Vec::new();
    let Some(min) = min_8bit_size else {
        return Ok(maps);
    };
    for (_, p) in &params.params {
        if p.elem_count() >= min && !maps.iter().any(|(d, _)| d == p.device()) {
            let map = Tensor::from_vec(quant8::dynamic_map(true).to_vec(), 256, p.device())?;
            maps.push((p.device().clone(), map));
        }
    }
    Ok(maps)
}

/// Lion over named parameters (f32, bf16 or f16, contiguous): f32 momenta.
pub struct Lion(LionCore);

/// Lion with block-wise 8-bit momenta (bitsandbytes' `Lion8bit`).
pub struct Lion8bit(LionCore);

impl std::fmt::Debug for Lion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lion")
            .field("config", &self.0.config)
            .field("params", &self.0.params.len())
            .finish()
    }
}

impl std::fmt::Debug for Lion8bit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lion8bit")
            .field("config", &self.config())
            .field("params", &self.0.params.len())
            .finish()
    }
}

impl Lion {
    /// Checks `config` and the parameters: at least one; unique names; f32, bf16 or f16
    /// contiguous leaves that require grad.
    pub fn new(params: Vec<(String, Tensor)>, config: LionConfig) -> Result<Self> {
        LionCore::new("Lion", "lion", params, config, None).map(Lion)
    }

    /// The hyperparameters (the learning rate as last set).
    pub fn config(&self) -> &LionConfig {
        &self.0.config
    }

    /// A parameter's momentum as f32 values (dequantized on the host where 8-bit), once it
    /// has taken a step.
    pub fn momentum(&self, name: &str) -> Result<Option<Vec<f32>>> {
        self.0.momentum(name)
    }

    /// A parameter's state, once it has taken a step.
    pub fn state(&self, name: &str) -> Option<&LionState> {
        self.0.state(name)
    }
}

impl Lion8bit {
    /// As [`Lion::new`]; parameters of at least `min_8bit_size` values get 8-bit momenta.
    pub fn new(params: Vec<(String, Tensor)>, config: Lion8bitConfig) -> Result<Self> {
        LionCore::new(
            "Lion8bit",
            "lion8bit",
            params,
            config.lion,
            Some(config.min_8bit_size),
        )
        .map(Lion8bit)
    }

    /// The hyperparameters (the learning rate as last set).
    pub fn config(&self) -> Lion8bitConfig {
        Lion8bitConfig {
            lion: self.0.config,
            min_8bit_size: self.0.min_8bit_size.unwrap_or(usize::MAX),
        }
    }

    /// A parameter's momentum as f32 values (dequantized on the host where 8-bit), once it
    /// has taken a step.
    pub fn momentum(&self, name: &str) -> Result<Option<Vec<f32>>> {
        self.0.momentum(name)
    }

    /// A parameter's state, once it has taken a step.
    pub fn state(&self, name: &str) -> Option<&LionState> {
        self.0.state(name)
    }

    /// Bytes of optimizer state held now (all parameters).
    pub fn state_bytes(&self) -> usize {
        self.0.state.iter().flatten().map(LionState::bytes).sum()
    }
}

macro_rules! lion_optimizer {
    ($t:ty) => {
        impl Optimizer for $t {
            fn step_scaled(&mut self, grads: &Grads, grad_scale: f64) -> Result<()> {
                self.0.step_scaled(grads, grad_scale)
            }
            fn learning_rate(&self) -> f64 {
                self.0.config.lr
            }
            fn set_learning_rate(&mut self, lr: f64) {
                self.0.config.lr = lr;
            }
            fn save_state_to(&self, out: &mut StateMap) -> Result<()> {
                self.0.save_state_to(out)
            }
            fn load_state_from(&mut self, src: &StateSource<'_>) -> Result<()> {
                self.0.load_state_from(src)
            }
        }
    };
}
lion_optimizer!(Lion);
lion_optimizer!(Lion8bit);
