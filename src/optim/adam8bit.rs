//! 8-bit AdamW: torch.optim.AdamW's update with both moment estimates stored block-wise
//! quantized to one byte per value, as bitsandbytes' `AdamW8bit` (Dettmers, Lewis, Shleifer &
//! Zettlemoyer 2022, "8-bit Optimizers via Block-wise Quantization",
//! <https://arxiv.org/abs/2110.02861>).
//!
//! Per step and parameter, for each block of 256 values: dequantize `m` (signed dynamic map)
//! and `v` (unsigned dynamic map), do the AdamW update in f32 (see [`AdamW`](super::AdamW) and
//! `backend::multi` for the exact order of operations), requantize each moment with a
//! new absmax: the largest |value| of the block, each value taking the code of the map entry
//! nearest to `value / absmax`. The quantization is `backend::quant8`; the step is one fused
//! multi-tensor kernel launch for all quantized parameters of a device and dtype (and one for
//! the small f32-state ones), the same f32 arithmetic on the CPU and on CUDA, so both give the
//! same codes and parameters bit for bit.
//!
//! Differences from bitsandbytes: `eps` is added as in torch.optim.AdamW
//! (`sqrt(v) / sqrt(1 - beta2^t) + eps`; bitsandbytes adds `eps * sqrt(1 - beta2^t)` to
//! `sqrt(v)` and folds the correction into the step size); no percentile clipping, no paged
//! state, no amsgrad (refused).
//!
//! Storage: FLAME has no u8 dtype, so a moment of a parameter of N values is two ordinary
//! tensors on the parameter's device: the codes packed four to a u32 (U32, shape
//! `(blocks, 64)`, `blocks = ceil(N / 256)`), and the absmax (F32, shape `(blocks,)`). Packing
//! into the existing U32 dtype keeps the tensor library, the backends' dtype tables and the
//! safetensors code unchanged, costs nothing in memory (4 codes are exactly 4 bytes), and the
//! state moves between devices and into files like any other tensor. A u8 dtype would touch
//! every backend for the sake of one optimizer.
//!
//! Memory: `2 + 8 / 256 = 2.03125` bytes of state per parameter value (one byte per moment
//! plus one f32 absmax per moment per 256 values, the last block padded), against 8 bytes for
//! [`AdamW`](super::AdamW) in f32: 3.9 times less. Parameters with fewer than
//! [`AdamW8bitConfig::min_8bit_size`] values (bitsandbytes' `min_8bit_size`, 4096: biases and
//! norm weights, where quantization would save little and cost precision) keep f32 state and
//! take exactly [`AdamW`](super::AdamW)'s update.
//!
//! State files (see [`Optimizer::save_state`]): `<param>.exp_avg_codes` (U32),
//! `<param>.exp_avg_absmax` (F32), `<param>.exp_avg_sq_codes`, `<param>.exp_avg_sq_absmax`
//! for quantized parameters, `<param>.exp_avg` and `<param>.exp_avg_sq` (F32) for the others;
//! metadata `optimizer = "adamw8bit"`, the hyperparameters, `block_size` (256),
//! `min_8bit_size` and `step.<param>`.

use super::adam::{bias, hyper, HYPER_KEYS};
use super::{
    check_grad_scale, check_lr, metadata_for, opt_err, state_into, update_err, AdamConfig,
    AdamState, LoadedState, Optimizer, ParamSet, StateMap, StateSource,
};
use crate::backend::quant8::{self, BLOCK, WORDS_PER_BLOCK};
use crate::tensor::multi::{adam_multi, AdamSlot, Moments};
use crate::{DType, Device, Grads, Result, Tensor};

const NAME: &str = "AdamW8bit";
const KIND: &str = "adamw8bit";
const EXP_AVG: &str = "exp_avg";
const EXP_AVG_SQ: &str = "exp_avg_sq";
const EXP_AVG_CODES: &str = "exp_avg_codes";
const EXP_AVG_ABSMAX: &str = "exp_avg_absmax";
const EXP_AVG_SQ_CODES: &str = "exp_avg_sq_codes";
const EXP_AVG_SQ_ABSMAX: &str = "exp_avg_sq_absmax";
/// Every state tensor suffix, longest first where one ends another.
const SUFFIXES: [&str; 6] = [
    EXP_AVG_SQ_CODES,
    EXP_AVG_SQ_ABSMAX,
    EXP_AVG_CODES,
    EXP_AVG_ABSMAX,
    EXP_AVG_SQ,
    EXP_AVG,
];
const BLOCK_SIZE_KEY: &str = "block_size";
const MIN_8BIT_KEY: &str = "min_8bit_size";

/// Hyperparameters of [`AdamW8bit`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamW8bitConfig {
    /// lr, betas, eps and the decoupled weight decay, as for [`AdamW`](super::AdamW) (whose
    /// default weight decay is 0 here; torch.optim.AdamW and bitsandbytes default to 1e-2).
    pub adam: AdamConfig,
    /// Not supported: `true` makes [`AdamW8bit::new`] fail.
    pub amsgrad: bool,
    /// Parameters with fewer values keep f32 state (bitsandbytes' `min_8bit_size`, 4096).
    pub min_8bit_size: usize,
}

impl Default for AdamW8bitConfig {
    fn default() -> Self {
        AdamW8bitConfig {
            adam: AdamConfig::default(),
            amsgrad: false,
            min_8bit_size: 4096,
        }
    }
}

/// One moment estimate quantized block-wise (see the module doc).
#[derive(Debug, Clone)]
pub struct QuantizedState {
    /// Four one-byte codes per u32, U32 `(blocks, 64)`.
    pub codes: Tensor,
    /// The largest |value| of each block, F32 `(blocks,)`.
    pub absmax: Tensor,
}

impl QuantizedState {
    /// The moment's values (dequantized on the host), for inspection and tests.
    pub fn dequantize(&self, map: &[f32; 256], n: usize) -> Result<Vec<f32>> {
        let words = self.codes.to_vec::<u32>()?;
        let absmax = self.absmax.to_vec::<f32>()?;
        Ok(quant8::dequantize_blockwise(map, &words, &absmax, n))
    }
}

/// One parameter's [`AdamW8bit`] state.
#[derive(Debug, Clone)]
pub enum AdamW8bitState {
    /// A parameter of at least `min_8bit_size` values: the moments in 8 bits.
    Quantized {
        /// Steps taken by this parameter.
        step: u64,
        /// First moment `m`, signed map.
        exp_avg: QuantizedState,
        /// Second moment `v`, unsigned map.
        exp_avg_sq: QuantizedState,
    },
    /// A smaller parameter: f32 moments, exactly as [`AdamW`](super::AdamW) keeps them.
    Full(AdamState),
}

impl AdamW8bitState {
    /// Steps taken by the parameter.
    pub fn step(&self) -> u64 {
        match self {
            AdamW8bitState::Quantized { step, .. } => *step,
            AdamW8bitState::Full(s) => s.step,
        }
    }

    /// The same state one step later (the moments are updated in place by the step).
    fn stepped(&self) -> Self {
        match self {
            AdamW8bitState::Quantized {
                step,
                exp_avg,
                exp_avg_sq,
            } => AdamW8bitState::Quantized {
                step: step.saturating_add(1),
                exp_avg: exp_avg.clone(),
                exp_avg_sq: exp_avg_sq.clone(),
            },
            AdamW8bitState::Full(s) => AdamW8bitState::Full(AdamState {
                step: s.step.saturating_add(1),
                exp_avg: s.exp_avg.clone(),
                exp_avg_sq: s.exp_avg_sq.clone(),
            }),
        }
    }

    /// Whether the moments are quantized.
    pub fn is_quantized(&self) -> bool {
        matches!(self, AdamW8bitState::Quantized { .. })
    }

    /// Bytes held by the state tensors.
    pub fn bytes(&self) -> usize {
        let t = |t: &Tensor| t.elem_count() * t.dtype().size_in_bytes();
        match self {
            AdamW8bitState::Quantized {
                exp_avg,
                exp_avg_sq,
                ..
            } => [exp_avg, exp_avg_sq]
                .iter()
                .map(|q| t(&q.codes) + t(&q.absmax))
                .sum(),
            AdamW8bitState::Full(s) => t(&s.exp_avg) + t(&s.exp_avg_sq),
        }
    }
}

/// AdamW with block-wise 8-bit moment estimates (see the module doc). A gradient of another
/// float dtype than its parameter's is cast to the parameter's before the step (PyTorch
/// gradients always have their parameter's dtype).
pub struct AdamW8bit {
    config: AdamW8bitConfig,
    params: ParamSet,
    /// Indexed like `params`; `None` until the parameter's first step.
    state: Vec<Option<AdamW8bitState>>,
    /// The (2, 256) maps operand (signed, unsigned), one per device of a quantized parameter.
    maps: Vec<(Device, Tensor)>,
}

impl std::fmt::Debug for AdamW8bit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct(NAME)
            .field("config", &self.config)
            .field("params", &self.params.len())
            .finish()
    }
}

/// The (2, 256) F32 maps operand: `quant8::dynamic_map(true)` then `(false)`.
fn maps_tensor(device: &Device) -> Result<Tensor> {
    let mut v = quant8::dynamic_map(true).to_vec();
    v.extend_from_slice(&quant8::dynamic_map(false));
    Tensor::from_vec(v, (2, 256), device)
}

/// The maps operand of every device that holds a parameter quantized under `min_8bit_size`.
fn maps_for(params: &ParamSet, min_8bit_size: usize) -> Result<Vec<(Device, Tensor)>> {
    let mut maps: Vec<(Device, Tensor)> = Vec::new();
    for (_, p) in &params.params {
        if p.elem_count() >= min_8bit_size && !maps.iter().any(|(d, _)| d == p.device()) {
            maps.push((p.device().clone(), maps_tensor(p.device())?));
        }
    }
    Ok(maps)
}

impl AdamW8bit {
    /// Checks `config` and the parameters: at least one; unique names; f32, bf16 or f16
    /// leaves that require grad. amsgrad is refused.
    pub fn new(params: Vec<(String, Tensor)>, config: AdamW8bitConfig) -> Result<Self> {
        config.adam.validate(NAME)?;
        if config.amsgrad {
            return Err(opt_err(
                NAME,
                "amsgrad is not supported (bitsandbytes' 8-bit AdamW has no 8-bit max state \
                 either); use AdamW for amsgrad",
            ));
        }
        if params.is_empty() {
            return Err(opt_err(NAME, "no parameters to optimize"));
        }
        let params = ParamSet::new(NAME, params)?;
        params.check_fused()?;
        let maps = maps_for(&params, config.min_8bit_size)?;
        let state = vec![None; params.len()];
        Ok(AdamW8bit {
            config,
            params,
            state,
            maps,
        })
    }

    /// The hyperparameters (the learning rate as last set).
    pub fn config(&self) -> &AdamW8bitConfig {
        &self.config
    }

    /// The parameters, in the order given.
    pub fn params(&self) -> &[(String, Tensor)] {
        &self.params.params
    }

    /// A parameter's state, once it has taken a step.
    pub fn state(&self, name: &str) -> Option<&AdamW8bitState> {
        self.params
            .lookup(name)
            .and_then(|(i, _)| self.state.get(i))
            .and_then(Option::as_ref)
    }

    /// Bytes of optimizer state held now (all parameters).
    pub fn state_bytes(&self) -> usize {
        self.state.iter().flatten().map(AdamW8bitState::bytes).sum()
    }

    /// The signed (first moment) map.
    pub fn signed_map() -> [f32; 256] {
        quant8::dynamic_map(true)
    }

    /// The unsigned (second moment) map.
    pub fn unsigned_map() -> [f32; 256] {
        quant8::dynamic_map(false)
    }
}

/// A fresh moment of `n` values on `device`: every code that of 0, every absmax 0.
fn zero_state(map: &[f32; 256], n: usize, device: &Device) -> Result<QuantizedState> {
    let nb = quant8::blocks(n);
    let word = quant8::splat(quant8::zero_code(map));
    Ok(QuantizedState {
        codes: Tensor::full(f64::from(word), (nb, WORDS_PER_BLOCK), DType::U32, device)?,
        absmax: Tensor::zeros(nb, DType::F32, device)?,
    })
}

impl Optimizer for AdamW8bit {
    fn step_scaled(&mut self, grads: &Grads, grad_scale: f64) -> Result<()> {
        let c = self.config.adam;
        check_lr(NAME, c.lr)?;
        check_grad_scale(NAME, grad_scale)?;
        let _guard = crate::no_grad();
        let gs = self.params.gradients(grads)?;
        // Every parameter with a gradient: its gradient (contiguous, the parameter's dtype)
        // and its state after this step (fresh zeros before the first); the state is stored
        // only once the fused step has run.
        let mut next: Vec<(usize, Tensor, AdamW8bitState)> = vec![];
        for (i, ((name, p), g)) in self.params.params.iter().zip(&gs).enumerate() {
            let Some(g) = g else { continue };
            let quantized = p.elem_count() >= self.config.min_8bit_size;
            let prep = || -> Result<_> {
                let g = g.to_dtype(p.dtype())?.contiguous()?;
                let n = p.elem_count();
                let state = match (&self.state[i], quantized) {
                    (Some(s @ AdamW8bitState::Quantized { .. }), true)
                    | (Some(s @ AdamW8bitState::Full(_)), false) => s.clone(),
                    (None, true) => AdamW8bitState::Quantized {
                        step: 0,
                        exp_avg: zero_state(&quant8::dynamic_map(true), n, p.device())?,
                        exp_avg_sq: zero_state(&quant8::dynamic_map(false), n, p.device())?,
                    },
                    (None, false) => {
                        let z = || Tensor::zeros(p.shape().clone(), DType::F32, p.device());
                        AdamW8bitState::Full(AdamState {
                            step: 0,
                            exp_avg: z()?,
                            exp_avg_sq: z()?,
                        })
                    }
                    (Some(_), _) => {
                        return Err(opt_err(
                            NAME,
                            "internal: the state's kind does not match min_8bit_size",
                        ))
                    }
                };
                Ok((g, state.stepped()))
            };
            let (g, state) = prep().map_err(|e| update_err(NAME, name, e))?;
            next.push((i, g, state));
        }
        let slots: Vec<AdamSlot<'_>> = next
            .iter()
            .map(|(i, g, s)| AdamSlot {
                p: &self.params.params[*i].1,
                g,
                moments: match s {
                    AdamW8bitState::Full(f) => Moments::Full {
                        m: &f.exp_avg,
                        v: &f.exp_avg_sq,
                    },
                    AdamW8bitState::Quantized {
                        exp_avg,
                        exp_avg_sq,
                        ..
                    } => Moments::Quantized {
                        m_codes: &exp_avg.codes,
                        m_absmax: &exp_avg.absmax,
                        v_codes: &exp_avg_sq.codes,
                        v_absmax: &exp_avg_sq.absmax,
                    },
                },
                bias: bias(&c, s.step()),
            })
            .collect();
        let maps: Vec<&Tensor> = self.maps.iter().map(|(_, m)| m).collect();
        adam_multi(&hyper(&c, true, grad_scale), &maps, &slots)
            .map_err(|e| opt_err(NAME, e.to_string()))?;
        for (i, _, s) in next {
            self.state[i] = Some(s);
        }
        Ok(())
    }

    fn learning_rate(&self) -> f64 {
        self.config.adam.lr
    }

    fn set_learning_rate(&mut self, lr: f64) {
        self.config.adam.lr = lr;
    }

    fn save_state_to(&self, out: &mut StateMap) -> Result<()> {
        let mut hyper = self.config.adam.to_metadata();
        hyper.push((BLOCK_SIZE_KEY, BLOCK.to_string()));
        hyper.push((MIN_8BIT_KEY, self.config.min_8bit_size.to_string()));
        let mut metadata = metadata_for(KIND, &hyper);
        let mut tensors = Vec::new();
        for (i, ((name, _), s)) in self.params.params.iter().zip(&self.state).enumerate() {
            let Some(s) = s else { continue };
            match s {
                AdamW8bitState::Quantized {
                    exp_avg,
                    exp_avg_sq,
                    ..
                } => {
                    tensors.push((i, EXP_AVG_CODES, &exp_avg.codes));
                    tensors.push((i, EXP_AVG_ABSMAX, &exp_avg.absmax));
                    tensors.push((i, EXP_AVG_SQ_CODES, &exp_avg_sq.codes));
                    tensors.push((i, EXP_AVG_SQ_ABSMAX, &exp_avg_sq.absmax));
                }
                AdamW8bitState::Full(f) => {
                    tensors.push((i, EXP_AVG, &f.exp_avg));
                    tensors.push((i, EXP_AVG_SQ, &f.exp_avg_sq));
                }
            }
            metadata.insert(format!("step.{name}"), s.step().to_string());
        }
        state_into(&self.params, tensors, &metadata, out);
        Ok(())
    }

    fn load_state_from(&mut self, src: &StateSource<'_>) -> Result<()> {
        let _guard = crate::no_grad();
        let (config, state) = read_state(&self.params, self.config, src)?;
        let maps = maps_for(&self.params, config.min_8bit_size)?;
        self.config = config;
        self.state = state;
        self.maps = maps;
        Ok(())
    }
}

/// Reads and checks a state file written by `save_state`: the new config and state, or an
/// error naming the file and what is wrong (the optimizer is left as it was).
fn read_state(
    params: &ParamSet,
    current: AdamW8bitConfig,
    src: &StateSource<'_>,
) -> Result<(AdamW8bitConfig, Vec<Option<AdamW8bitState>>)> {
    let mut keys = HYPER_KEYS.to_vec();
    keys.extend([BLOCK_SIZE_KEY, MIN_8BIT_KEY]);
    // Codes and absmax are exactly U32 (blocks, 64) and F32 (blocks); f32 moments are read
    // as AdamW reads them.
    let exact = |suffix: &str, p: &Tensor| {
        let nb = quant8::blocks(p.elem_count());
        match suffix {
            EXP_AVG_CODES | EXP_AVG_SQ_CODES => Some((DType::U32, vec![nb, WORDS_PER_BLOCK])),
            EXP_AVG_ABSMAX | EXP_AVG_SQ_ABSMAX => Some((DType::F32, vec![nb])),
            _ => None,
        }
    };
    let mut loaded =
        LoadedState::read_with_from(params, KIND, &SUFFIXES, &keys, true, &exact, src)?;
    let bad = |msg: String| opt_err(NAME, format!("state file {}: {msg}", src.shown()));
    let block: usize = loaded.parse(NAME, BLOCK_SIZE_KEY)?;
    if block != BLOCK {
        return Err(bad(format!(
            "block size {block}, but this AdamW8bit quantizes blocks of {BLOCK}"
        )));
    }
    let config = AdamW8bitConfig {
        adam: AdamConfig::from_metadata(NAME, &loaded)?,
        amsgrad: current.amsgrad,
        min_8bit_size: loaded.parse(NAME, MIN_8BIT_KEY)?,
    };
    let per_param = std::mem::take(&mut loaded.tensors);
    let mut state = Vec::with_capacity(params.len());
    for ((name, p), mut t) in params.params.iter().zip(per_param) {
        let step = loaded.step(NAME, name)?;
        let quantized = p.elem_count() >= config.min_8bit_size;
        let mut take = |s: &str| t.remove(s);
        let (m, v) = (take(EXP_AVG), take(EXP_AVG_SQ));
        let q = (
            take(EXP_AVG_CODES),
            take(EXP_AVG_ABSMAX),
            take(EXP_AVG_SQ_CODES),
            take(EXP_AVG_SQ_ABSMAX),
        );
        let present = [&m, &v, &q.0, &q.1, &q.2, &q.3]
            .iter()
            .filter(|t| t.is_some())
            .count();
        state.push(match (step, m, v, q) {
            (None, None, None, (None, None, None, None)) => None,
            (Some(step), None, None, (Some(mc), Some(ma), Some(vc), Some(va)))
                if step >= 1 && quantized =>
            {
                Some(AdamW8bitState::Quantized {
                    step,
                    exp_avg: QuantizedState {
                        codes: mc,
                        absmax: ma,
                    },
                    exp_avg_sq: QuantizedState {
                        codes: vc,
                        absmax: va,
                    },
                })
            }
            (Some(step), Some(exp_avg), Some(exp_avg_sq), (None, None, None, None))
                if step >= 1 && !quantized =>
            {
                Some(AdamW8bitState::Full(AdamState {
                    step,
                    exp_avg,
                    exp_avg_sq,
                }))
            }
            (step, ..) => {
                let want = if quantized {
                    format!(
                        "{name}.{EXP_AVG_CODES}, .{EXP_AVG_ABSMAX}, .{EXP_AVG_SQ_CODES} and \
                         .{EXP_AVG_SQ_ABSMAX} (it has {} >= min_8bit_size {} values)",
                        p.elem_count(),
                        config.min_8bit_size
                    )
                } else {
                    format!(
                        "{name}.{EXP_AVG} and {name}.{EXP_AVG_SQ} (it has {} < min_8bit_size \
                         {} values)",
                        p.elem_count(),
                        config.min_8bit_size
                    )
                };
                return Err(bad(format!(
                    "parameter '{name}': state of step {} with {present} state tensors; a \
                     parameter's state is a step >= 1 and exactly {want}, or nothing",
                    step.map_or("missing".into(), |s| s.to_string()),
                )));
            }
        });
    }
    Ok((config, state))
}
