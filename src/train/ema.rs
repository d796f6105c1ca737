//! An exponential moving average (EMA) of the trained weights, as diffusers' `EMAModel`
//! (`diffusers/training_utils.py`, 0.42) defines it: after each optimizer step,
//! `optimization_step += 1`, `d = get_decay(optimization_step)`, and every shadow weight
//! `s -= (1 - d) * (s - p)`, with
//!
//! ```text
//! n = max(0, optimization_step - update_after_step - 1)
//! d = 0                                         if n == 0
//!     1 - (1 + n / inv_gamma)^(-power)          with use_ema_warmup
//!     (1 + n) / (10 + n)                        without
//! d = max(min(d, decay), min_decay)
//! ```
//!
//! The shadow starts as a copy of the weights, so with d = 0 the first steps copy them.
//! It is kept in f32 on the training device (updated by one fused multi-tensor launch) or in
//! host memory (updated on the CPU), and saved as named f32 tensors with its step count, so a resume
//! continues it bit for bit.

use super::config::{EmaDevice, EmaSection};
use crate::{DType, Device, Error, Result, Tensor};
use std::collections::BTreeMap;
use std::path::Path;

/// The metadata key of a saved average's step count (EMAModel's `optimization_step`).
pub const STEPS_KEY: &str = "flame_ema_steps";

/// The decay schedule: EMAModel's `decay`, `min_decay`, `update_after_step`,
/// `use_ema_warmup`, `inv_gamma` and `power`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EmaSchedule {
    /// The largest decay.
    pub decay: f64,
    /// The smallest decay.
    pub min_decay: f64,
    /// Steps before the average moves.
    pub update_after_step: u64,
    /// The warm-up form of the decay.
    pub warmup: bool,
    /// The warm-up's inverse multiplicative factor.
    pub inv_gamma: f64,
    /// The warm-up's exponent.
    pub power: f64,
}

impl EmaSchedule {
    /// The schedule of the `[ema]` section.
    pub fn of(c: &EmaSection) -> Self {
        EmaSchedule {
            decay: c.decay,
            min_decay: c.min_decay,
            update_after_step: c.update_after_step as u64,
            warmup: c.warmup,
            inv_gamma: c.inv_gamma,
            power: c.power,
        }
    }

    /// EMAModel's `get_decay(optimization_step)`.
    pub fn decay_at(&self, optimization_step: u64) -> f64 {
        let n = optimization_step.saturating_sub(self.update_after_step + 1);
        if n == 0 {
            return 0.0;
        }
        let n = n as f64;
        let d = match self.warmup {
            true => 1.0 - (1.0 + n / self.inv_gamma).powf(-self.power),
            false => (1.0 + n) / (10.0 + n),
        };
        d.min(self.decay).max(self.min_decay)
    }
}

/// Where the shadow weights are: every weight's values one after another (in the order of
/// `names`), so that an update is a few operations over one buffer, not a few per weight.
enum Shadow {
    /// An f32 vector on the training device.
    Device(Tensor),
    /// f32 values in host memory.
    Host(Vec<f32>),
}

/// The moving average of a set of named weights.
pub struct Ema {
    schedule: EmaSchedule,
    names: Vec<String>,
    shapes: Vec<Vec<usize>>,
    shadow: Shadow,
    /// EMAModel's `optimization_step`: the updates made.
    steps: u64,
}

/// The weights' values in f32, one after another (a view of the weight itself where there is
/// one f32 weight: `cat` of one tensor is that tensor).
fn flat(params: &[(String, Tensor)]) -> Result<Tensor> {
    if params.is_empty() {
        return Err(Error::Config {
            path: None,
            msg: "an EMA needs at least one weight".into(),
        });
    }
    let parts = params
        .iter()
        .map(|(_, t)| t.reshape(t.elem_count())?.to_dtype(DType::F32))
        .collect::<Result<Vec<_>>>()?;
    Tensor::cat(&parts.iter().collect::<Vec<_>>(), 0)
}

impl Ema {
    /// A shadow that starts as a copy of `params`, kept where `place` says.
    pub fn new(
        params: &[(String, Tensor)],
        schedule: EmaSchedule,
        place: EmaDevice,
    ) -> Result<Self> {
        let _g = crate::no_grad();
        let names = params.iter().map(|(n, _)| n.clone()).collect();
        let shapes = params.iter().map(|(_, t)| t.dims().to_vec()).collect();
        let shadow = match place {
            // New storage: the shadow must not be the weights' own.
            // `affine(1, 0)` copies them exactly (x * 1 + 0 is exact).
            EmaDevice::Gpu => Shadow::Device(flat(params)?.affine(1.0, 0.0)?),
            EmaDevice::Cpu => Shadow::Host(flat(params)?.to_vec::<f32>()?),
        };
        Ok(Ema {
            schedule,
            names,
            shapes,
            shadow,
            steps: 0,
        })
    }

    /// The updates made so far (EMAModel's `optimization_step`).
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// Bytes the shadow holds (4 a value), on the device or in host memory.
    pub fn bytes(&self) -> u64 {
        self.shapes
            .iter()
            .map(|s| s.iter().product::<usize>() as u64 * 4)
            .sum()
    }

    /// Whether the shadow is on the training device.
    pub fn on_device(&self) -> bool {
        matches!(self.shadow, Shadow::Device(_))
    }

    fn check(&self, params: &[(String, Tensor)]) -> Result<()> {
        let same = params.len() == self.names.len()
            && params
                .iter()
                .zip(self.names.iter().zip(&self.shapes))
                .all(|((n, t), (m, s))| n == m && t.dims() == s.as_slice());
        match same {
            true => Ok(()),
            false => Err(Error::Config {
                path: None,
                msg: "the EMA's weights are not the adapter's (other names or shapes)".into(),
            }),
        }
    }

    /// One EMAModel `step` after an optimizer step: the step count, then each shadow weight
    /// `s -= (1 - d) * (s - p)` at the step's decay. A shadow on the device takes one fused
    /// multi-tensor launch over every weight (`backend::multi::ema_value`, in f32, with the
    /// decay worked out here: it depends on the step count alone), where the weights are
    /// contiguous f32, bf16 or f16 on its device; [`Ema::update_composite`] otherwise.
    pub fn update(&mut self, params: &[(String, Tensor)]) -> Result<()> {
        self.check(params)?;
        let fused = match &self.shadow {
            Shadow::Device(s) => params.iter().all(|(_, t)| {
                t.device() == s.device()
                    && t.is_contiguous()
                    && matches!(t.dtype(), DType::F32 | DType::BF16 | DType::F16)
            }),
            Shadow::Host(_) => false,
        };
        if !fused {
            return self.update_composite(params);
        }
        let _g = crate::no_grad();
        let k = self.advance();
        if let Shadow::Device(s) = &self.shadow {
            let ts: Vec<&Tensor> = params.iter().map(|(_, t)| t).collect();
            crate::tensor::multi::ema_multi(k as f32, s, &ts)?;
        }
        Ok(())
    }

    /// [`Ema::update`] composed of tensor ops (a shadow on the device) or a loop over host
    /// memory: the fused update's reference.
    pub fn update_composite(&mut self, params: &[(String, Tensor)]) -> Result<()> {
        self.check(params)?;
        let _g = crate::no_grad();
        let k = self.advance();
        let p = flat(params)?;
        match &mut self.shadow {
            Shadow::Device(s) => *s = s.sub(&s.sub(&p)?.mul_scalar(k)?)?,
            Shadow::Host(s) => {
                let k = k as f32;
                for (s, p) in s.iter_mut().zip(p.to_vec::<f32>()?) {
                    *s = crate::backend::multi::ema_value(k, *s, p);
                }
            }
        }
        Ok(())
    }

    /// Counts an update and returns its `1 - d`.
    fn advance(&mut self) -> f64 {
        self.steps += 1;
        1.0 - self.schedule.decay_at(self.steps)
    }

    /// The shadow weights as f32 tensors on `device`.
    pub fn tensors(&self, device: &Device) -> Result<Vec<Tensor>> {
        let mut start = 0;
        let mut out = Vec::with_capacity(self.shapes.len());
        for shape in &self.shapes {
            let n = shape.iter().product::<usize>();
            out.push(match &self.shadow {
                Shadow::Device(v) => v
                    .narrow(0, start, n)?
                    .reshape(shape.clone())?
                    .to_device(device)?,
                Shadow::Host(v) => Tensor::from_slice(&v[start..start + n], shape.clone(), device)?,
            });
            start += n;
        }
        Ok(out)
    }

    /// Puts the shadow weights into `params` (in their dtype) and returns what they held,
    /// for [`Ema::swap_out`].
    pub fn swap_in(&self, params: &[(String, Tensor)]) -> Result<Vec<Tensor>> {
        self.check(params)?;
        let _g = crate::no_grad();
        let Some(device) = params.first().map(|(_, t)| t.device().clone()) else {
            return Ok(vec![]);
        };
        let mut kept = Vec::with_capacity(params.len());
        for ((_, p), s) in params.iter().zip(self.tensors(&device)?) {
            kept.push(p.affine(1.0, 0.0)?);
            p.assign(&s.to_dtype(p.dtype())?)?;
        }
        Ok(kept)
    }

    /// Puts back what [`Ema::swap_in`] took out of `params`, bit for bit.
    pub fn swap_out(params: &[(String, Tensor)], kept: &[Tensor]) -> Result<()> {
        let _g = crate::no_grad();
        for ((_, p), k) in params.iter().zip(kept) {
            p.assign(k)?;
        }
        Ok(())
    }

    /// Writes the shadow (f32 tensors by name) with its step count, atomically.
    pub fn save(&self, path: &Path, device: &Device) -> Result<()> {
        let tensors = self.tensors(device)?;
        let meta = BTreeMap::from([(STEPS_KEY.to_string(), self.steps.to_string())]);
        crate::safetensors::save_with_metadata(
            self.names.iter().map(String::as_str).zip(tensors.iter()),
            &meta,
            path,
        )
    }

    /// Reads a shadow [`Ema::save`] wrote: every weight by name and shape, and the step count.
    pub fn load(&mut self, path: &Path, device: &Device) -> Result<()> {
        let file = crate::safetensors::SafeTensorsFile::open(path)?;
        let bad = |msg: String| Error::Checkpoint {
            path: path.to_path_buf(),
            msg,
        };
        let steps = file
            .metadata()
            .get(STEPS_KEY)
            .and_then(|s| s.parse::<u64>().ok())
            .ok_or_else(|| bad(format!("no {STEPS_KEY} in its metadata")))?;
        if file.names().count() != self.names.len() {
            return Err(bad(format!(
                "holds {} tensors, the EMA has {}",
                file.names().count(),
                self.names.len()
            )));
        }
        let mut loaded = vec![];
        for (n, shape) in self.names.iter().zip(&self.shapes) {
            let t = file.load_as(n, device, DType::F32)?;
            if t.dims() != shape.as_slice() {
                return Err(bad(format!(
                    "{n}: shape {:?}, expected {shape:?}",
                    t.dims()
                )));
            }
            loaded.push((n.clone(), t));
        }
        let loaded = flat(&loaded)?;
        self.shadow = match &self.shadow {
            Shadow::Device(_) => Shadow::Device(loaded),
            Shadow::Host(_) => Shadow::Host(loaded.to_vec::<f32>()?),
        };
        self.steps = steps;
        Ok(())
    }
}
