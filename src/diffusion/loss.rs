//! The per-element loss and the noise options every family shares, as kohya's sd-scripts
//! names and computes them (library/train_util.py and library/custom_train_functions.py,
//! commit 48d368fa): `loss_type` l2 | l1 | huber | smooth_l1 with `huber_schedule`, `huber_c`
//! and `huber_scale`; masked loss; `noise_offset` with `adaptive_noise_scale` and
//! `noise_offset_random_strength`; multi-resolution (pyramid) noise; input perturbation
//! noise (`ip_noise_gamma`, with `ip_noise_gamma_random_strength`);
//! `min_timestep` / `max_timestep`.
//! Shape letters: B batch, C channels, H and W the latent grid.
//!
//! The reduction is kohya's (train_network.py): the per-element loss, times the mask
//! (B, 1, H, W) broadcast over the channels, is averaged over (C, H, W) dividing by
//! C·H·W (not by the mask's sum, so a half-masked image weighs half), then each sample's
//! mean is multiplied by its weight (regularisation images: `prior_loss_weight`; min-SNR-γ)
//! and the batch averaged.

use crate::{DType, Error, Result, Tensor};
use serde::{Deserialize, Serialize};

/// The per-element loss (kohya's `loss_type`, its `conditional_loss`).
#[derive(Clone, Copy, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum LossType {
    /// (pred - target)².
    L2,
    /// |pred - target| (kohya's "l1", torch's `l1_loss`).
    L1,
    /// Pseudo-Huber: 2c (sqrt((pred - target)² + c²) - c).
    Huber,
    /// 2 (sqrt((pred - target)² + c²) - c).
    SmoothL1,
}

impl LossType {
    /// Whether the loss reads the Huber threshold c (Huber and smooth L1).
    pub fn thresholded(self) -> bool {
        matches!(self, LossType::Huber | LossType::SmoothL1)
    }
}

/// How the Huber threshold c follows the timestep (kohya's `huber_schedule`).
#[derive(Clone, Copy, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum HuberSchedule {
    /// c = huber_c · huber_scale.
    Constant,
    /// c = exp(-α t) · huber_scale, α = -ln(huber_c) / 1000, t on 0..1000.
    Exponential,
    /// c = (1 - huber_c) / (1 + σ)² + huber_c, σ = sqrt((1 - ᾱ_t) / ᾱ_t) (DDPM only).
    Snr,
}

/// The timesteps of the noise schedule kohya's Huber schedules count in (diffusers'
/// `num_train_timesteps`, 1000 for every family here).
pub const TRAIN_TIMESTEPS: f64 = 1000.0;

/// The Huber threshold c of each sample (kohya's `get_huber_threshold_if_needed`):
/// `timesteps` on 0..1000 (flow matching: t · 1000, as kohya's Flux and SD3 scripts pass
/// them), `alphas_cumprod` the DDPM schedule's ᾱ (none for flow matching, where the "snr"
/// schedule is undefined and an error).
pub fn huber_threshold(
    schedule: HuberSchedule,
    huber_c: f64,
    huber_scale: f64,
    timesteps: &[f64],
    alphas_cumprod: Option<&[f64]>,
) -> Result<Vec<f64>> {
    match schedule {
        HuberSchedule::Constant => Ok(vec![huber_c * huber_scale; timesteps.len()]),
        HuberSchedule::Exponential => {
            let alpha = -huber_c.ln() / TRAIN_TIMESTEPS;
            Ok(timesteps
                .iter()
                .map(|&t| (-alpha * t).exp() * huber_scale)
                .collect())
        }
        HuberSchedule::Snr => {
            let Some(ab) = alphas_cumprod else {
                return Err(Error::Config {
                    path: None,
                    msg: "train.huber_schedule = \"snr\" needs a DDPM model's ᾱ (SDXL); flow \
                          matching has none: use \"constant\" or \"exponential\""
                        .into(),
                });
            };
            timesteps
                .iter()
                .map(|&t| {
                    let a = ab.get(t as usize).copied().ok_or_else(|| Error::Config {
                        path: None,
                        msg: format!("train.huber_schedule: timestep {t} outside the schedule"),
                    })?;
                    let sigma = ((1.0 - a) / a).sqrt();
                    Ok((1.0 - huber_c) / (1.0 + sigma).powi(2) + huber_c)
                })
                .collect()
        }
    }
}

/// The per-element loss of `pred` against `target` (B, ...) in f32: `c` is each sample's
/// Huber threshold (B,), needed by Huber and smooth L1.
pub fn elementwise(
    kind: LossType,
    pred: &Tensor,
    target: &Tensor,
    c: Option<&Tensor>,
) -> Result<Tensor> {
    if pred.shape() != target.shape() || pred.rank() == 0 {
        return Err(Error::ShapeMismatch {
            op: "elementwise loss",
            lhs: pred.shape().clone(),
            rhs: target.shape().clone(),
        });
    }
    let d = pred
        .to_dtype(DType::F32)?
        .sub(&target.to_dtype(DType::F32)?)?;
    if kind == LossType::L1 {
        // torch's l1_loss: |d|, whose gradient at 0 is sign(0) = 0.
        return d.abs();
    }
    let sq = d.sqr()?;
    let c = match (kind, c) {
        (LossType::L2, _) => return Ok(sq),
        (_, Some(c)) if c.dims() == [pred.dims()[0]] => {
            let mut shape = vec![pred.dims()[0]];
            shape.resize(pred.rank(), 1);
            c.to_dtype(DType::F32)?.reshape(shape)?
        }
        (_, c) => {
            return Err(Error::invalid(
                "elementwise loss",
                format!(
                    "Huber threshold of shape {:?} for a batch of {}",
                    c.map(|c| c.dims().to_vec()),
                    pred.dims()[0]
                ),
                pred.shape(),
            ))
        }
    };
    // sqrt(d² + c²) - c, then 2c· (Huber) or 2· (smooth L1).
    let root = sq.add(&c.sqr()?)?.sqrt()?.sub(&c)?;
    match kind {
        LossType::Huber => root.mul(&c)?.affine(2.0, 0.0),
        _ => root.affine(2.0, 0.0),
    }
}

/// kohya's reduction of a per-element loss (B, C, H, W): times `mask` (B, 1, H, W) when
/// given, averaged over all but the batch dim (dividing by C·H·W), times `weights` (B,)
/// when given, averaged over the batch.
pub fn reduce(loss: &Tensor, mask: Option<&Tensor>, weights: Option<&Tensor>) -> Result<Tensor> {
    let b = *loss.dims().first().ok_or_else(|| {
        Error::invalid("loss reduction", "a loss without a batch dim", loss.shape())
    })?;
    let loss = match mask {
        Some(m) => {
            let d = loss.dims();
            let ok = m.rank() == d.len()
                && d.len() >= 2
                && m.dims()[0] == b
                && m.dims()[1] == 1
                && m.dims()[2..] == d[2..];
            if !ok {
                return Err(Error::ShapeMismatch {
                    op: "masked loss",
                    lhs: loss.shape().clone(),
                    rhs: m.shape().clone(),
                });
            }
            loss.mul(&m.to_dtype(DType::F32)?)?
        }
        None => loss.clone(),
    };
    let per = loss.reshape((b, loss.elem_count() / b))?.mean(&[1])?;
    let per = match weights {
        Some(w) => per.mul(&w.to_dtype(DType::F32)?)?,
        None => per,
    };
    per.mean_all()
}

/// kohya's `apply_noise_offset` on host values: `noise` and `latents` (B, C, H, W) flat,
/// `draws` (B, C) unit normals. Each (sample, channel) plane of the noise gets
/// o · draw added, o = `offset`, or with `adaptive` a: max(0, offset + a · |mean of the
/// latents' plane|).
pub fn noise_offset(
    noise: &mut [f32],
    latents: &[f32],
    dims: [usize; 4],
    offset: f64,
    adaptive: Option<f64>,
    draws: &[f32],
) -> Result<()> {
    let [b, c, h, w] = dims;
    let n = b * c * h * w;
    if noise.len() != n || latents.len() != n || draws.len() != b * c {
        return Err(Error::invalid(
            "noise_offset",
            format!(
                "{} noise, {} latent and {} draw values for {dims:?}",
                noise.len(),
                latents.len(),
                draws.len()
            ),
            &crate::Shape::from(dims.to_vec()),
        ));
    }
    let plane = h * w;
    for (k, &draw) in draws.iter().enumerate() {
        let span = k * plane..(k + 1) * plane;
        let o = match adaptive {
            Some(a) => {
                let mean = latents[span.clone()].iter().map(|&v| v as f64).sum::<f64>()
                    / plane.max(1) as f64;
                (offset + a * mean.abs()).max(0.0)
            }
            None => offset,
        };
        for v in &mut noise[span] {
            *v = (*v as f64 + o * draw as f64) as f32;
        }
    }
    Ok(())
}

/// The strength of a noise option drawn at random (kohya's `noise_offset_random_strength`
/// and `ip_noise_gamma_random_strength`: `torch.rand(1) * value`, one draw per batch): `u`
/// (uniform in [0, 1)) times `value` when `random`, else `value`.
pub fn strength(value: f64, random: bool, u: f64) -> f64 {
    match random {
        true => u * value,
        false => value,
    }
}

/// The noise a model's input is made with under input perturbation (kohya's
/// `ip_noise_gamma`, Ning et al. 2023, "Input Perturbation Reduces Exposure Bias in
/// Diffusion Models"): `noise` + `gamma` · `xi`, `xi` unit normals of its shape, in f32 and
/// back in `noise`'s dtype. The target stays the one `noise` gives.
pub fn perturbed_noise(noise: &Tensor, xi: &Tensor, gamma: f64) -> Result<Tensor> {
    noise
        .to_dtype(DType::F32)?
        .add(&xi.to_dtype(DType::F32)?.affine(gamma, 0.0)?)?
        .to_dtype(noise.dtype())
}

/// torch's bilinear `Upsample(size=(h, w))` (align_corners = False) of `src` (planes of
/// `sh` x `sw`) to `h` x `w`.
fn upsample_bilinear(
    src: &[f32],
    planes: usize,
    (sh, sw): (usize, usize),
    (h, w): (usize, usize),
) -> Vec<f32> {
    // The source coordinate of output index i: (i + 0.5) · in / out - 0.5, clamped at 0;
    // the two neighbours and the weight of the second.
    let axis = |out: usize, inp: usize| -> Vec<(usize, usize, f64)> {
        let scale = inp as f64 / out as f64;
        (0..out)
            .map(|i| {
                let x = ((i as f64 + 0.5) * scale - 0.5).max(0.0);
                let i0 = (x.floor() as usize).min(inp - 1);
                let i1 = (i0 + 1).min(inp - 1);
                (i0, i1, x - i0 as f64)
            })
            .collect()
    };
    let (ys, xs) = (axis(h, sh), axis(w, sw));
    let mut out = vec![0f32; planes * h * w];
    for p in 0..planes {
        let s = &src[p * sh * sw..(p + 1) * sh * sw];
        for (y, &(y0, y1, ly)) in ys.iter().enumerate() {
            for (x, &(x0, x1, lx)) in xs.iter().enumerate() {
                let at = |yy: usize, xx: usize| s[yy * sw + xx] as f64;
                let top = at(y0, x0) * (1.0 - lx) + at(y0, x1) * lx;
                let bottom = at(y1, x0) * (1.0 - lx) + at(y1, x1) * lx;
                out[(p * h + y) * w + x] = (top * (1.0 - ly) + bottom * ly) as f32;
            }
        }
    }
    out
}

/// The sizes of kohya's pyramid levels for latents of `h` x `w` with level factors `r`
/// (each in [2, 4)): level i is max(1, ⌊h / rᵢ^i⌋) x max(1, ⌊w / rᵢ^i⌋), and the levels
/// stop after the first with a side of 1.
pub fn pyramid_levels(h: usize, w: usize, r: &[f64]) -> Vec<(usize, usize)> {
    let mut out = vec![];
    for (i, &r) in r.iter().enumerate() {
        let s = r.powi(i as i32);
        let hn = ((h as f64 / s) as usize).max(1);
        let wn = ((w as f64 / s) as usize).max(1);
        out.push((hn, wn));
        if hn == 1 || wn == 1 {
            break;
        }
    }
    out
}

/// kohya's `pyramid_noise_like` on host values: to `noise` (B, C, H, W) flat, each level i
/// of [`pyramid_levels`] adds its unit normals `draws[i]` (B, C, hᵢ, wᵢ) upsampled
/// bilinearly to H x W, times `discount`^i; the sum is divided by its standard deviation
/// (torch's, with N - 1).
pub fn pyramid_noise(
    noise: &[f32],
    dims: [usize; 4],
    discount: f64,
    levels: &[(usize, usize)],
    draws: &[Vec<f32>],
) -> Result<Vec<f32>> {
    let [b, c, h, w] = dims;
    let bad =
        |msg: String| Error::invalid("pyramid_noise", msg, &crate::Shape::from(dims.to_vec()));
    if noise.len() != b * c * h * w || levels.len() != draws.len() || h == 0 || w == 0 {
        return Err(bad(format!(
            "{} values, {} levels, {} draws",
            noise.len(),
            levels.len(),
            draws.len()
        )));
    }
    let mut acc: Vec<f64> = noise.iter().map(|&v| v as f64).collect();
    for (i, (&(hn, wn), d)) in levels.iter().zip(draws).enumerate() {
        if d.len() != b * c * hn * wn {
            return Err(bad(format!("level {i}: {} draws for {hn}x{wn}", d.len())));
        }
        let up = upsample_bilinear(d, b * c, (hn, wn), (h, w));
        let k = discount.powi(i as i32);
        for (a, u) in acc.iter_mut().zip(up) {
            // torch adds the f32 upsampled draws times the discount into the f32 noise.
            *a = (*a as f32 + (u as f64 * k) as f32) as f64;
        }
    }
    let n = acc.len() as f64;
    let mean = acc.iter().sum::<f64>() / n;
    let var = acc.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1.0).max(1.0);
    let std = var.sqrt();
    Ok(acc.iter().map(|v| (v / std) as f32).collect())
}

/// kohya's `min_timestep` / `max_timestep`: DDPM timesteps drawn uniformly from
/// min..max (its `get_timesteps`: `randint(min, max)`, or max when they are equal); flow
/// matching's t, drawn as `train.timesteps` says, mapped affinely into
/// [min / 1000, max / 1000].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TimestepRange {
    /// The smallest timestep, 0..1000.
    pub min: usize,
    /// The largest (DDPM: excluded unless equal to `min`), 1..=1000.
    pub max: usize,
}

impl TimestepRange {
    /// The whole range: 0..1000.
    pub const FULL: TimestepRange = TimestepRange { min: 0, max: 1000 };

    /// The DDPM timestep of a uniform draw `u` in [0, 1): min + ⌊u (max - min)⌋.
    pub fn ddpm(&self, u: f64) -> usize {
        if self.max <= self.min {
            return self.max;
        }
        let span = self.max - self.min;
        self.min + ((u * span as f64) as usize).min(span - 1)
    }

    /// Flow matching's t in (0, 1) moved into the range: min/1000 + (max - min)/1000 · t.
    pub fn flow(&self, t: f64) -> f64 {
        let (lo, hi) = (
            self.min as f64 / TRAIN_TIMESTEPS,
            self.max as f64 / TRAIN_TIMESTEPS,
        );
        lo + (hi - lo) * t
    }
}
