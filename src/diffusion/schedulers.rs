//! diffusers 0.42.1's schedulers as the Flux, SD3 and SDXL pipelines configure them, with
//! their timesteps set: `FlowMatchEulerDiscreteScheduler` ([`FlowMatchEuler`]),
//! `EulerDiscreteScheduler` ([`EulerDiscrete`]) and `DDIMScheduler` ([`Ddim`]).
//!
//! diffusers computes its tables in float32 (torch and numpy) and, for some, float64 (numpy);
//! each formula below says which, and reproduces that arithmetic so the tables agree to the
//! last bit or two. Sample updates run in f32 on the device as diffusers' `step` does (it
//! casts the sample to float32), in the same order of operations.

use super::objectives::Prediction;
use super::{Process, Schedule};
use crate::{DType, Error, Result, Shape, Tensor};

fn bad(msg: String) -> Error {
    Error::Config { path: None, msg }
}

fn check_steps(what: &str, steps: usize) -> Result<()> {
    if steps == 0 {
        return Err(bad(format!("{what}: steps must be at least 1, got 0")));
    }
    Ok(())
}

/// numpy's `linspace(start, stop, n)` in f64: `i * step + start`, the last exactly `stop`;
/// one point is `[start]`.
fn np_linspace(start: f64, stop: f64, n: usize) -> Vec<f64> {
    if n == 1 {
        return vec![start];
    }
    let step = (stop - start) / (n - 1) as f64;
    let mut v: Vec<f64> = (0..n).map(|i| i as f64 * step + start).collect();
    v[n - 1] = stop;
    v
}

/// torch's CPU `linspace(start, end, n, dtype=float32)`: an f32 step, the first half counted
/// up from `start`, the second down from `end`, each as one fused multiply-add rounded once.
fn torch_linspace_f32(start: f64, end: f64, n: usize) -> Vec<f32> {
    let (a, b) = (start as f32, end as f32);
    if n == 1 {
        return vec![a];
    }
    let step = (b - a) / (n - 1) as f32;
    (0..n)
        .map(|i| {
            if i < n / 2 {
                (a as f64 + step as f64 * i as f64) as f32
            } else {
                (b as f64 - step as f64 * (n - 1 - i) as f64) as f32
            }
        })
        .collect()
}

/// A 0-dim f32 tensor on `like`'s device, to scale a tensor by in f32 as diffusers' 0-dim
/// float32 tensors do.
fn scalar(v: f32, like: &Tensor) -> Result<Tensor> {
    Tensor::full(v as f64, Shape::from(()), DType::F32, like.device())
}

fn check_index(what: &'static str, i: usize, n: usize) -> Result<()> {
    if i >= n {
        return Err(Error::InvalidArgument {
            op: what,
            msg: format!("step index {i} past the schedule's {n} steps"),
            shape: Shape::from(n),
        });
    }
    Ok(())
}

/// The pair a scheduler step takes, as f32, checked for equal shapes.
fn f32_pair(op: &'static str, model_output: &Tensor, sample: &Tensor) -> Result<(Tensor, Tensor)> {
    if model_output.shape() != sample.shape() {
        return Err(Error::ShapeMismatch {
            op,
            lhs: model_output.shape().clone(),
            rhs: sample.shape().clone(),
        });
    }
    Ok((
        model_output.to_dtype(DType::F32)?,
        sample.to_dtype(DType::F32)?,
    ))
}

// ---------------------------------------------------------------------------------------------
// Flow matching

/// `FlowMatchEulerDiscreteScheduler`'s config (the pipelines' `scheduler_config.json`).
#[derive(Clone, Debug, PartialEq)]
pub struct FlowMatchConfig {
    /// `num_train_timesteps`: timesteps are sigma x this.
    pub num_train_timesteps: usize,
    /// `shift`: sigma' = s sigma / (1 + (s - 1) sigma) when not shifting dynamically.
    pub shift: f64,
    /// `use_dynamic_shifting`: shift by the image's size through mu (Flux) instead.
    pub use_dynamic_shifting: bool,
    /// `base_shift`: mu at `base_image_seq_len` tokens.
    pub base_shift: f64,
    /// `max_shift`: mu at `max_image_seq_len` tokens.
    pub max_shift: f64,
    /// `base_image_seq_len`.
    pub base_image_seq_len: usize,
    /// `max_image_seq_len`.
    pub max_image_seq_len: usize,
}

impl FlowMatchConfig {
    /// FLUX.1-dev's `scheduler/scheduler_config.json`: shift 3 (unused), dynamic shifting,
    /// mu from 0.5 at 256 tokens to 1.15 at 4096.
    pub fn flux_dev() -> Self {
        FlowMatchConfig {
            num_train_timesteps: 1000,
            shift: 3.0,
            use_dynamic_shifting: true,
            base_shift: 0.5,
            max_shift: 1.15,
            base_image_seq_len: 256,
            max_image_seq_len: 4096,
        }
    }

    /// FLUX.1-schnell's: shift 1, no dynamic shifting (the sigmas as given).
    pub fn flux_schnell() -> Self {
        FlowMatchConfig {
            shift: 1.0,
            use_dynamic_shifting: false,
            ..Self::flux_dev()
        }
    }

    /// SD3 / SD3.5's (large, medium, large-turbo): shift 3, no dynamic shifting.
    pub fn sd3() -> Self {
        FlowMatchConfig {
            shift: 3.0,
            use_dynamic_shifting: false,
            ..Self::flux_dev()
        }
    }

    /// FluxPipeline's `calculate_shift(image_seq_len, base_image_seq_len, max_image_seq_len,
    /// base_shift, max_shift)`: mu on the line through (base len, base shift) and (max len,
    /// max shift), in f64.
    pub fn mu(&self, image_seq_len: usize) -> f64 {
        let m = (self.max_shift - self.base_shift)
            / (self.max_image_seq_len as f64 - self.base_image_seq_len as f64);
        let b = self.base_shift - m * self.base_image_seq_len as f64;
        image_seq_len as f64 * m + b
    }

    fn validate(&self) -> Result<()> {
        let ok = self.num_train_timesteps > 0
            && self.shift.is_finite()
            && self.shift > 0.0
            && self.base_shift.is_finite()
            && self.max_shift.is_finite()
            && self.max_image_seq_len != self.base_image_seq_len;
        if !ok {
            return Err(bad(format!(
                "flow matching scheduler config {self:?}: needs num_train_timesteps > 0, a \
                 finite shift > 0, finite base/max shifts and max_image_seq_len != \
                 base_image_seq_len"
            )));
        }
        Ok(())
    }
}

/// `FlowMatchEulerDiscreteScheduler` with its timesteps set: Euler steps of the velocity,
/// x_{i+1} = x_i + (sigma_{i+1} - sigma_i) v.
#[derive(Clone, Debug, PartialEq)]
pub struct FlowMatchEuler {
    /// diffusers' `timesteps`: sigma x num_train_timesteps, one per step (f32).
    pub timesteps: Vec<f32>,
    /// diffusers' `sigmas`: one per step and a final 0 (f32).
    pub sigmas: Vec<f32>,
}

impl FlowMatchEuler {
    /// As FluxPipeline sets it: sigmas `linspace(1, 1/steps, steps)` (numpy, f64, then
    /// float32), shifted by mu = `config.mu(image_seq_len)` (`time_shift`, exponential:
    /// e^mu / (e^mu + (1/sigma - 1))) with dynamic shifting, else by `config.shift`; both in
    /// float32 as numpy computes them on the float32 array. `image_seq_len` is the packed
    /// token count, (H/2)(W/2) of (C, H, W) latents.
    pub fn flux(config: &FlowMatchConfig, steps: usize, image_seq_len: usize) -> Result<Self> {
        check_steps("flux scheduler", steps)?;
        config.validate()?;
        let given: Vec<f32> = np_linspace(1.0, 1.0 / steps as f64, steps)
            .into_iter()
            .map(|s| s as f32)
            .collect();
        let sigmas: Vec<f32> = if config.use_dynamic_shifting {
            // numpy with a Python float and a float32 array stays in float32.
            let e = config.mu(image_seq_len).exp() as f32;
            given.iter().map(|&t| e / (e + (1.0 / t - 1.0))).collect()
        } else {
            let s = config.shift as f32;
            let s1 = (config.shift - 1.0) as f32;
            given.iter().map(|&t| s * t / (1.0 + s1 * t)).collect()
        };
        Ok(Self::from_shifted(config, sigmas))
    }

    /// As StableDiffusion3Pipeline sets it (no sigmas given): the scheduler's own range,
    /// `linspace(sigma_max, sigma_min, steps)` over its training sigmas (already shifted at
    /// construction: sigma_min = shift(1/1000), 0.002994 at shift 3), shifted again (in f64)
    /// by `config.shift`, or by mu = `config.mu(image_seq_len)` with dynamic shifting
    /// (`image_seq_len`: patch tokens, (H/p)(W/p); unused otherwise).
    pub fn sd3(config: &FlowMatchConfig, steps: usize, image_seq_len: usize) -> Result<Self> {
        check_steps("sd3 scheduler", steps)?;
        config.validate()?;
        let n = config.num_train_timesteps;
        // __init__: sigmas = (1..=n) / n in float32 torch, shifted in float32 unless dynamic.
        let train = |t: f32| -> f32 {
            let sigma = t / n as f32;
            if config.use_dynamic_shifting {
                sigma
            } else {
                let (s, s1) = (config.shift as f32, (config.shift - 1.0) as f32);
                s * sigma / (1.0 + s1 * sigma)
            }
        };
        let (sigma_max, sigma_min) = (train(n as f32) as f64, train(1.0) as f64);
        let nt = n as f64;
        let mu = config.mu(image_seq_len);
        let sigmas: Vec<f32> = np_linspace(sigma_max * nt, sigma_min * nt, steps)
            .into_iter()
            .map(|t| {
                let s = t / nt;
                let shifted = if config.use_dynamic_shifting {
                    mu.exp() / (mu.exp() + (1.0 / s - 1.0))
                } else {
                    config.shift * s / (1.0 + (config.shift - 1.0) * s)
                };
                shifted as f32
            })
            .collect();
        Ok(Self::from_shifted(config, sigmas))
    }

    /// From final sigmas (one per step): timesteps sigma x n in float32, and a 0 appended.
    fn from_shifted(config: &FlowMatchConfig, mut sigmas: Vec<f32>) -> Self {
        let n = config.num_train_timesteps as f32;
        let timesteps = sigmas.iter().map(|&s| s * n).collect();
        sigmas.push(0.0);
        FlowMatchEuler { timesteps, sigmas }
    }
}

impl Schedule for FlowMatchEuler {
    fn timesteps(&self) -> &[f32] {
        &self.timesteps
    }
    fn process(&self) -> Process {
        Process::FlowMatching
    }
    /// sigma_i, the t of x_t = (1 - t) x0 + t ε.
    fn model_time(&self, i: usize) -> Result<f32> {
        check_index("flow_match_euler", i, self.timesteps.len())?;
        Ok(self.sigmas[i])
    }
    /// `sample + dt * model_output`, dt = sigma_{i+1} - sigma_i (float32).
    fn step(&self, model_output: &Tensor, i: usize, sample: &Tensor) -> Result<Tensor> {
        check_index("flow_match_euler", i, self.timesteps.len())?;
        let (v, x) = f32_pair("flow_match_euler.step", model_output, sample)?;
        let dt = self.sigmas[i + 1] - self.sigmas[i];
        x.add(&v.mul(&scalar(dt, &v)?)?)
    }
}

// ---------------------------------------------------------------------------------------------
// DDPM schedules (SDXL)

/// The DDPM noise schedule of `EulerDiscreteScheduler` and `DDIMScheduler` as SDXL configures
/// them: "scaled_linear" betas, "leading" timestep spacing with `steps_offset`.
#[derive(Clone, Debug, PartialEq)]
pub struct DdpmConfig {
    /// `num_train_timesteps`.
    pub num_train_timesteps: usize,
    /// `beta_start`.
    pub beta_start: f64,
    /// `beta_end`.
    pub beta_end: f64,
    /// `steps_offset`, added to every "leading" timestep.
    pub steps_offset: usize,
    /// `prediction_type`: what the model predicts (epsilon or v).
    pub prediction: Prediction,
}

impl DdpmConfig {
    /// SDXL base's `scheduler/scheduler_config.json`: betas 0.00085..0.012 scaled-linear over
    /// 1000 steps, steps_offset 1, epsilon prediction.
    pub fn sdxl() -> Self {
        DdpmConfig {
            num_train_timesteps: 1000,
            beta_start: 0.00085,
            beta_end: 0.012,
            steps_offset: 1,
            prediction: Prediction::Epsilon,
        }
    }

    /// ᾱ_t for t = 0..T in float32 as diffusers makes it: betas =
    /// `torch.linspace(beta_start ** 0.5, beta_end ** 0.5, T, dtype=float32) ** 2`,
    /// `torch.cumprod(1 - betas)` (accumulated in f64 on the CPU, each rounded to f32).
    pub fn alphas_cumprod(&self) -> Vec<f32> {
        let lin = torch_linspace_f32(
            self.beta_start.sqrt(),
            self.beta_end.sqrt(),
            self.num_train_timesteps,
        );
        let mut p = 1.0f64;
        lin.iter()
            .map(|&l| {
                p *= (1.0 - l * l) as f64;
                p as f32
            })
            .collect()
    }

    /// "leading" spacing: `arange(steps) * (T // steps)` reversed, plus `steps_offset`.
    pub fn leading_timesteps(&self, steps: usize) -> Vec<usize> {
        let ratio = self.num_train_timesteps / steps.max(1);
        (0..steps)
            .rev()
            .map(|i| i * ratio + self.steps_offset)
            .collect()
    }

    fn validate(&self, what: &str, steps: usize) -> Result<()> {
        check_steps(what, steps)?;
        let ok = self.num_train_timesteps > 0
            && self.beta_start.is_finite()
            && self.beta_end.is_finite()
            && self.beta_start > 0.0
            && self.beta_end < 1.0
            && self.beta_start <= self.beta_end;
        if !ok {
            return Err(bad(format!(
                "{what}: config {self:?} needs num_train_timesteps > 0 and 0 < beta_start <= \
                 beta_end < 1"
            )));
        }
        if steps > self.num_train_timesteps {
            return Err(bad(format!(
                "{what}: {steps} steps, more than the {} training timesteps",
                self.num_train_timesteps
            )));
        }
        Ok(())
    }
}

/// `EulerDiscreteScheduler` with its timesteps set (SDXL's default sampler): sigmas
/// sqrt((1 - ᾱ_t) / ᾱ_t) at the leading timesteps, then 0; the model input is scaled by
/// 1 / sqrt(sigma² + 1) and the step is an Euler step in sigma.
#[derive(Clone, Debug, PartialEq)]
pub struct EulerDiscrete {
    /// What the model predicts.
    pub prediction: Prediction,
    /// diffusers' `timesteps` (the UNet's timesteps), one per step.
    pub timesteps: Vec<f32>,
    /// diffusers' `sigmas`: one per step and a final 0.
    pub sigmas: Vec<f32>,
}

impl EulerDiscrete {
    /// `set_timesteps(steps)` with "leading" spacing and linear interpolation: timestep t's
    /// sigma is the training sigma at t (a timestep past the table takes its last sigma, as
    /// `np.interp` does: 1000 steps with offset 1 reach t = 1000).
    pub fn new(config: &DdpmConfig, steps: usize) -> Result<Self> {
        config.validate("euler scheduler", steps)?;
        let ac = config.alphas_cumprod();
        // ((1 - ᾱ) / ᾱ) ** 0.5 on float32 tensors.
        let train: Vec<f32> = ac.iter().map(|&a| ((1.0 - a) / a).sqrt()).collect();
        let ts = config.leading_timesteps(steps);
        let mut sigmas: Vec<f32> = ts.iter().map(|&t| train[t.min(train.len() - 1)]).collect();
        sigmas.push(0.0);
        Ok(EulerDiscrete {
            prediction: config.prediction,
            timesteps: ts.iter().map(|&t| t as f32).collect(),
            sigmas,
        })
    }

    /// SDXL's config with `prediction`.
    pub fn sdxl(steps: usize, prediction: Prediction) -> Result<Self> {
        Self::new(
            &DdpmConfig {
                prediction,
                ..DdpmConfig::sdxl()
            },
            steps,
        )
    }
}

impl Schedule for EulerDiscrete {
    fn timesteps(&self) -> &[f32] {
        &self.timesteps
    }
    fn process(&self) -> Process {
        Process::Ddpm
    }
    fn model_time(&self, i: usize) -> Result<f32> {
        check_index("euler_discrete", i, self.timesteps.len())?;
        Ok(self.timesteps[i])
    }
    /// "leading" spacing: sqrt(max sigma² + 1) (float32).
    fn init_noise_sigma(&self) -> f32 {
        let m = self.sigmas.iter().fold(0f32, |m, &s| m.max(s));
        (m * m + 1.0).sqrt()
    }
    /// `sample / (sigma² + 1) ** 0.5`.
    fn scale_model_input(&self, x: &Tensor, i: usize) -> Result<Tensor> {
        check_index("euler_discrete", i, self.timesteps.len())?;
        let s = self.sigmas[i];
        let x = x.to_dtype(DType::F32)?;
        x.div(&scalar((s * s + 1.0).sqrt(), &x)?)
    }
    /// With s_churn 0 (sigma_hat = sigma): x0 = sample - sigma ε (epsilon) or
    /// ε · (-sigma / sqrt(sigma² + 1)) + sample / (sigma² + 1) (v); derivative =
    /// (sample - x0) / sigma; prev = sample + derivative (sigma_{i+1} - sigma).
    fn step(&self, model_output: &Tensor, i: usize, sample: &Tensor) -> Result<Tensor> {
        check_index("euler_discrete", i, self.timesteps.len())?;
        let (m, x) = f32_pair("euler_discrete.step", model_output, sample)?;
        let sigma = self.sigmas[i];
        let x0 = match self.prediction {
            Prediction::Epsilon => x.sub(&m.mul(&scalar(sigma, &x)?)?)?,
            Prediction::V => {
                let q = sigma * sigma + 1.0;
                m.mul(&scalar(-sigma / q.sqrt(), &x)?)?
                    .add(&x.div(&scalar(q, &x)?)?)?
            }
        };
        let derivative = x.sub(&x0)?.div(&scalar(sigma, &x)?)?;
        let dt = self.sigmas[i + 1] - sigma;
        x.add(&derivative.mul(&scalar(dt, &x)?)?)
    }
}

/// `DDIMScheduler` with its timesteps set, deterministic (eta 0), SDXL's config:
/// `set_alpha_to_one` false (the step past timestep 0 uses ᾱ_0), no clipping.
#[derive(Clone, Debug, PartialEq)]
pub struct Ddim {
    /// What the model predicts.
    pub prediction: Prediction,
    /// The UNet's timesteps, one per step (integers as f32).
    pub timesteps: Vec<f32>,
    /// ᾱ at each step's timestep.
    pub alphas_cumprod_t: Vec<f32>,
    /// ᾱ at each step's previous timestep t - T // steps (ᾱ_0 below 0).
    pub alphas_cumprod_prev: Vec<f32>,
}

impl Ddim {
    /// `set_timesteps(steps)` with "leading" spacing. diffusers indexes ᾱ at t directly, so
    /// 1000 steps with offset 1 (t = 1000) fail there with an IndexError; here with an error.
    pub fn new(config: &DdpmConfig, steps: usize) -> Result<Self> {
        config.validate("ddim scheduler", steps)?;
        let ac = config.alphas_cumprod();
        let ts = config.leading_timesteps(steps);
        if let Some(&t) = ts.iter().find(|&&t| t >= ac.len()) {
            return Err(bad(format!(
                "ddim scheduler: {steps} steps with steps_offset {} put timestep {t} past the \
                 {} training timesteps (0..{})",
                config.steps_offset,
                ac.len(),
                ac.len() - 1
            )));
        }
        let ratio = config.num_train_timesteps / steps;
        Ok(Ddim {
            prediction: config.prediction,
            timesteps: ts.iter().map(|&t| t as f32).collect(),
            alphas_cumprod_t: ts.iter().map(|&t| ac[t]).collect(),
            alphas_cumprod_prev: ts
                .iter()
                .map(|&t| if t >= ratio { ac[t - ratio] } else { ac[0] })
                .collect(),
        })
    }

    /// SDXL's config with `prediction`.
    pub fn sdxl(steps: usize, prediction: Prediction) -> Result<Self> {
        Self::new(
            &DdpmConfig {
                prediction,
                ..DdpmConfig::sdxl()
            },
            steps,
        )
    }
}

impl Schedule for Ddim {
    fn timesteps(&self) -> &[f32] {
        &self.timesteps
    }
    fn process(&self) -> Process {
        Process::Ddpm
    }
    fn model_time(&self, i: usize) -> Result<f32> {
        check_index("ddim", i, self.timesteps.len())?;
        Ok(self.timesteps[i])
    }
    /// DDIM (Song et al. 2021, eq. 12) with eta 0: x0 = (sample - sqrt(1 - ᾱ_t) ε) /
    /// sqrt(ᾱ_t) and ε = model output (epsilon), or x0 = sqrt(ᾱ_t) sample - sqrt(1 - ᾱ_t) v
    /// and ε = sqrt(ᾱ_t) v + sqrt(1 - ᾱ_t) sample (v); prev = sqrt(ᾱ_prev) x0 +
    /// sqrt(1 - ᾱ_prev) ε.
    fn step(&self, model_output: &Tensor, i: usize, sample: &Tensor) -> Result<Tensor> {
        check_index("ddim", i, self.timesteps.len())?;
        let (m, x) = f32_pair("ddim.step", model_output, sample)?;
        let (a, a_prev) = (self.alphas_cumprod_t[i], self.alphas_cumprod_prev[i]);
        let (sa, sb) = (a.sqrt(), (1.0 - a).sqrt());
        let c = |v: f32| scalar(v, &x);
        let (x0, eps) = match self.prediction {
            Prediction::Epsilon => (x.sub(&m.mul(&c(sb)?)?)?.div(&c(sa)?)?, m),
            Prediction::V => (
                x.mul(&c(sa)?)?.sub(&m.mul(&c(sb)?)?)?,
                m.mul(&c(sa)?)?.add(&x.mul(&c(sb)?)?)?,
            ),
        };
        let direction = eps.mul(&c((1.0 - a_prev).sqrt())?)?;
        x0.mul(&c(a_prev.sqrt())?)?.add(&direction)
    }
}
