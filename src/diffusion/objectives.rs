//! Training objectives: flow matching for Flux and SD3.5, DDPM for SDXL, and the weighted MSE.
//! Shape letters: B batch; `x0` and `noise` are latents (B, ...).
//!
//! Flow matching (rectified flow; Esser et al. 2024, "Scaling Rectified Flow Transformers",
//! the SD3 paper): x_t = (1 - t) x0 + t ε, and the model predicts the velocity ε - x0.
//! DDPM (Ho et al. 2020) with Stable Diffusion's scaled-linear betas; ε- or v-prediction
//! (Salimans & Ho 2022); min-SNR-γ loss weights (Hang et al. 2023).

use super::loss::TimestepRange;
use crate::{DType, Device, Error, Result, Tensor};

/// How flow-matching timesteps t ∈ (0, 1) are drawn.
#[derive(Clone, Debug, PartialEq)]
pub enum TimestepSampling {
    /// t ~ U(0, 1).
    Uniform,
    /// t = sigmoid(n), n ~ N(mean, std²) (SD3 paper §3.1; it trains with mean 0, std 1).
    LogitNormal {
        /// The mean of the normal.
        mean: f64,
        /// Its standard deviation.
        std: f64,
    },
    /// Uniform t moved by a fixed shift s: t' = s t / (1 + (s - 1) t) (SD3 uses s = 3.0).
    Shift {
        /// The shift s.
        shift: f64,
    },
    /// Flux's resolution-dependent shift (BFL `get_schedule`): mu grows linearly with the
    /// image token count from 0.5 at 256 to 1.15 at 4096, and
    /// t' = e^mu / (e^mu + (1/t - 1)), applied to logit-normal t.
    FluxShift {
        /// The mean of the normal.
        mean: f64,
        /// Its standard deviation.
        std: f64,
    },
}

/// BFL's `get_lin_function(x1=256, y1=0.5, x2=4096, y2=1.15)` at `tokens`.
pub fn flux_mu(tokens: usize) -> f64 {
    let (x1, y1, x2, y2) = (256.0, 0.5, 4096.0, 1.15);
    let m = (y2 - y1) / (x2 - x1);
    m * tokens as f64 + (y1 - m * x1)
}

/// BFL's `time_shift(mu, sigma = 1, t)`.
pub fn flux_time_shift(mu: f64, t: f64) -> f64 {
    mu.exp() / (mu.exp() + (1.0 / t - 1.0))
}

/// The fixed shift s t / (1 + (s - 1) t).
pub fn shift_time(shift: f64, t: f64) -> f64 {
    shift * t / (1.0 + (shift - 1.0) * t)
}

impl TimestepSampling {
    /// Checks the parameters: finite, std and shift positive.
    pub fn validate(&self) -> Result<()> {
        let bad = |msg: String| Err(Error::Config { path: None, msg });
        match *self {
            TimestepSampling::LogitNormal { std, mean }
            | TimestepSampling::FluxShift { std, mean }
                if !(std > 0.0 && std.is_finite() && mean.is_finite()) =>
            {
                bad(format!(
                    "timestep sampling: mean {mean} / std {std} must be finite, std > 0"
                ))
            }
            TimestepSampling::Shift { shift } if !(shift > 0.0 && shift.is_finite()) => {
                bad(format!("timestep sampling: shift {shift} must be positive"))
            }
            _ => Ok(()),
        }
    }

    /// `b` timesteps in (0, 1) as f32 (B,), for images of `tokens` latent tokens (used by
    /// the Flux shift), from `seed`. The same seed gives the same draws on every device
    /// (Philox, identical on the CPU and CUDA backends).
    pub fn sample(&self, b: usize, tokens: usize, seed: u64, device: &Device) -> Result<Tensor> {
        self.validate()?;
        // Keep t inside (0, 1): the ends make x_t exactly x0 or noise and 1/t infinite.
        let clamp = |v: f64| v.clamp(1e-5, 1.0 - 1e-5);
        let u = Tensor::rand(b, DType::F32, device, seed)?.to_vec_f64()?;
        let n = Tensor::randn(b, DType::F32, device, seed ^ 0x5EED)?.to_vec_f64()?;
        let sig = |x: f64| 1.0 / (1.0 + (-x).exp());
        let t: Vec<f32> = (0..b)
            .map(|i| {
                clamp(match *self {
                    TimestepSampling::Uniform => u[i],
                    TimestepSampling::LogitNormal { mean, std } => sig(mean + std * n[i]),
                    TimestepSampling::Shift { shift } => shift_time(shift, clamp(u[i])),
                    TimestepSampling::FluxShift { mean, std } => {
                        flux_time_shift(flux_mu(tokens), clamp(sig(mean + std * n[i])))
                    }
                }) as f32
            })
            .collect();
        Tensor::from_vec(t, b, device)
    }
}

/// t (B,) as (B, 1, ..., 1) for latents of rank `rank`, in `dtype`.
fn per_sample(t: &Tensor, rank: usize, dtype: DType) -> Result<Tensor> {
    let mut shape = vec![t.elem_count()];
    shape.resize(rank, 1);
    t.to_dtype(dtype)?.reshape(shape)
}

fn check_pair(op: &'static str, x0: &Tensor, noise: &Tensor, t: &Tensor) -> Result<()> {
    if x0.shape() != noise.shape() {
        return Err(Error::ShapeMismatch {
            op,
            lhs: x0.shape().clone(),
            rhs: noise.shape().clone(),
        });
    }
    if t.rank() != 1 || x0.rank() == 0 || t.dims()[0] != x0.dims()[0] {
        return Err(Error::ShapeMismatch {
            op,
            lhs: x0.shape().clone(),
            rhs: t.shape().clone(),
        });
    }
    Ok(())
}

/// Flow matching's noisy input and target: x_t = (1 - t) x0 + t ε, v = ε - x0.
pub fn flow_matching(x0: &Tensor, noise: &Tensor, t: &Tensor) -> Result<(Tensor, Tensor)> {
    check_pair("flow_matching", x0, noise, t)?;
    let t = per_sample(t, x0.rank(), x0.dtype())?;
    let xt = x0.add(&noise.sub(x0)?.mul(&t)?)?;
    Ok((xt, noise.sub(x0)?))
}

/// What an SDXL-style model predicts ("epsilon" or "v" in a config).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Prediction {
    /// The noise ε that was added.
    Epsilon,
    /// v = sqrt(ᾱ) ε - sqrt(1 - ᾱ) x0.
    V,
}

/// A DDPM noise schedule: ᾱ_t for t = 0..T.
#[derive(Clone, Debug)]
pub struct Ddpm {
    /// ᾱ_t = prod_{s <= t} (1 - beta_s), for t = 0..T.
    pub alphas_cumprod: Vec<f64>,
}

impl Ddpm {
    /// Stable Diffusion's "scaled_linear" betas: sqrt(beta) linear from sqrt(0.00085) to
    /// sqrt(0.012) over 1000 steps (the SDXL scheduler config).
    pub fn scaled_linear() -> Self {
        Self::scaled_linear_with(0.00085, 0.012, 1000)
    }

    /// sqrt(beta) linear from sqrt(`beta_start`) to sqrt(`beta_end`) over `steps` steps.
    pub fn scaled_linear_with(beta_start: f64, beta_end: f64, steps: usize) -> Self {
        let (a, b) = (beta_start.sqrt(), beta_end.sqrt());
        let mut prod = 1.0;
        let alphas_cumprod = (0..steps)
            .map(|i| {
                let s = if steps > 1 {
                    i as f64 / (steps - 1) as f64
                } else {
                    0.0
                };
                let beta = (a + (b - a) * s).powi(2);
                prod *= 1.0 - beta;
                prod
            })
            .collect();
        Ddpm { alphas_cumprod }
    }

    /// The number of timesteps T.
    pub fn steps(&self) -> usize {
        self.alphas_cumprod.len()
    }

    /// `b` integer timesteps, uniform over 0..T, as f32 (B,) (what the UNet takes).
    pub fn sample_timesteps(&self, b: usize, seed: u64, device: &Device) -> Result<Tensor> {
        let u = Tensor::rand(b, DType::F32, device, seed)?.to_vec_f64()?;
        let n = self.steps();
        let t: Vec<f32> = u
            .iter()
            .map(|u| ((u * n as f64) as usize).min(n - 1) as f32)
            .collect();
        Tensor::from_vec(t, b, device)
    }

    /// `b` integer timesteps uniform over `range` (kohya's `min_timestep` /
    /// `max_timestep`, [`TimestepRange::ddpm`]) as f32 (B,), from the uniform draws
    /// [`Ddpm::sample_timesteps`] makes. An error when the range leaves the schedule.
    pub fn sample_timesteps_in(
        &self,
        b: usize,
        range: TimestepRange,
        seed: u64,
        device: &Device,
    ) -> Result<Tensor> {
        if range.max > self.steps() || range.min >= self.steps() {
            return Err(Error::Config {
                path: None,
                msg: format!(
                    "train.min_timestep = {} / train.max_timestep = {}: the schedule has {} \
                     timesteps",
                    range.min,
                    range.max,
                    self.steps()
                ),
            });
        }
        let u = Tensor::rand(b, DType::F32, device, seed)?.to_vec_f64()?;
        let t: Vec<f32> = u.iter().map(|&u| range.ddpm(u) as f32).collect();
        Tensor::from_vec(t, b, device)
    }

    fn coefs(&self, t: &Tensor) -> Result<Vec<f64>> {
        t.to_vec_f64()?
            .iter()
            .map(|&s| {
                let i = s as usize;
                if s < 0.0 || s.fract() != 0.0 || i >= self.steps() {
                    return Err(Error::invalid(
                        "ddpm",
                        format!("timestep {s} is not an integer in 0..{}", self.steps()),
                        t.shape(),
                    ));
                }
                Ok(self.alphas_cumprod[i])
            })
            .collect()
    }

    /// The noisy latents x_t = sqrt(ᾱ_t) x0 + sqrt(1 - ᾱ_t) ε and the target for
    /// `prediction`.
    pub fn noisy_and_target(
        &self,
        x0: &Tensor,
        noise: &Tensor,
        t: &Tensor,
        prediction: Prediction,
    ) -> Result<(Tensor, Tensor)> {
        check_pair("ddpm", x0, noise, t)?;
        let ab = self.coefs(t)?;
        let col = |f: &dyn Fn(f64) -> f64| -> Result<Tensor> {
            let v: Vec<f64> = ab.iter().map(|&a| f(a)).collect();
            per_sample(
                &Tensor::from_vec(v, ab.len(), x0.device())?,
                x0.rank(),
                x0.dtype(),
            )
        };
        let (sa, sb) = (col(&|a: f64| a.sqrt())?, col(&|a: f64| (1.0 - a).sqrt())?);
        let xt = x0.mul(&sa)?.add(&noise.mul(&sb)?)?;
        let target = match prediction {
            Prediction::Epsilon => noise.clone(),
            Prediction::V => noise.mul(&sa)?.sub(&x0.mul(&sb)?)?,
        };
        Ok((xt, target))
    }

    /// Min-SNR-γ weights (B,) f32 with SNR = ᾱ / (1 - ᾱ): min(SNR, γ) / SNR for
    /// ε-prediction, min(SNR, γ) / (SNR + 1) for v-prediction.
    pub fn min_snr_weights(
        &self,
        t: &Tensor,
        gamma: f64,
        prediction: Prediction,
    ) -> Result<Tensor> {
        let w: Vec<f32> = self
            .coefs(t)?
            .iter()
            .map(|&a| {
                let snr = a / (1.0 - a);
                let m = snr.min(gamma);
                (match prediction {
                    Prediction::Epsilon => m / snr,
                    Prediction::V => m / (snr + 1.0),
                }) as f32
            })
            .collect();
        Tensor::from_vec(w, t.elem_count(), t.device())
    }
}

/// Mean squared error per sample (mean over all but dim 0), times `weights` (B,) if given,
/// averaged over the batch; computed in f32.
pub fn weighted_mse(pred: &Tensor, target: &Tensor, weights: Option<&Tensor>) -> Result<Tensor> {
    if pred.shape() != target.shape() || pred.rank() == 0 {
        return Err(Error::ShapeMismatch {
            op: "weighted_mse",
            lhs: pred.shape().clone(),
            rhs: target.shape().clone(),
        });
    }
    let b = pred.dims()[0];
    let diff = pred
        .to_dtype(DType::F32)?
        .sub(&target.to_dtype(DType::F32)?)?;
    let per = diff
        .sqr()?
        .reshape((b, pred.elem_count() / b))?
        .mean(&[1])?;
    let per = match weights {
        Some(w) => per.mul(&w.to_dtype(DType::F32)?)?,
        None => per,
    };
    per.mean_all()
}
