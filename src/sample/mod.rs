//! Sampling: diffusers' schedulers ([`schedulers`]) and one denoising loop ([`denoise`]) over
//! any [`DiffusionModel`].
//!
//! ```no_run
//! use flame::models::{self, LoadOptions};
//! use flame::sample::{denoise, FlowMatchConfig, FlowMatchEuler, Guidance};
//! use flame::{DType, Device, Tensor};
//!
//! let dev = Device::cuda(0)?;
//! let model = models::load("flux", "flux1-dev.safetensors", &LoadOptions::new(DType::BF16, &dev))?.model;
//! # let (context, pooled) = (Tensor::zeros((1, 512, 4096), DType::BF16, &dev)?, Tensor::zeros((1, 768), DType::BF16, &dev)?);
//! // 1024² images: (1, 16, 128, 128) latents, 64 x 64 packed tokens.
//! let noise = Tensor::randn((1, 16, 128, 128), DType::F32, &dev, 42)?;
//! let schedule = FlowMatchEuler::flux(&FlowMatchConfig::flux_dev(), 28, 64 * 64)?;
//! let latents = denoise(&*model, &schedule, &noise, &[context, pooled],
//!                       &Guidance::distilled(3.5), None)?;
//! # Ok::<(), flame::Error>(())
//! ```

pub use crate::diffusion::schedulers;
pub use crate::diffusion::schedulers::{
    Ddim, DdpmConfig, EulerDiscrete, FlowMatchConfig, FlowMatchEuler,
};
pub use crate::diffusion::{Process, Schedule};

use crate::models::{DiffusionModel, Objective};
use crate::{no_grad, DType, Error, Result, Shape, Tensor};

/// Classifier-free guidance: the prediction is uncond + scale (cond - uncond).
#[derive(Clone, Debug)]
pub struct Cfg {
    /// The unconditional (negative prompt) conditioning, in the same order and shapes as the
    /// conditional one.
    pub uncond: Vec<Tensor>,
    /// The guidance scale, >= 0. At most 1 runs the conditional prediction alone, as diffusers'
    /// `do_classifier_free_guidance` (scale > 1) decides.
    pub scale: f64,
    /// The conditional and unconditional predictions as one batch of twice the rows
    /// (diffusers' way: one pass, twice the activations), else one after the other.
    pub batched: bool,
    /// Z-Image's renormalization and truncation of the guided prediction.
    pub options: CfgOptions,
}

/// The two options diffusers' `ZImagePipeline.__call__` (diffusers 0.42.1,
/// `pipelines/z_image/pipeline_z_image.py`) gives classifier-free guidance, for any family
/// that guides so. The defaults change nothing.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CfgOptions {
    /// `cfg_normalization`: where the guided prediction of a sample has a larger L2 norm (over
    /// all its values) than this times the norm of its conditional prediction, it is scaled
    /// down to that norm. 0: off (diffusers' `False`; its `True` is 1), >= 0.
    pub normalization: f64,
    /// `cfg_truncation`: a step whose normalized time (1000 - timestep) / 1000 (diffusers'
    /// `t_norm`: 0 at the first step of a flow-matching schedule, rising toward 1) is above
    /// this runs the conditional prediction alone, unguided. 1 (the default) or more: every
    /// step guided, >= 0.
    pub truncation: f64,
}

impl Default for CfgOptions {
    fn default() -> Self {
        CfgOptions {
            normalization: 0.0,
            truncation: 1.0,
        }
    }
}

impl CfgOptions {
    /// Whether step `timestep` (diffusers' timestep, in [0, 1000]) runs unguided:
    /// `(1000 - t) / 1000 > truncation`, computed in f32 as the pipeline's
    /// `((1000 - timesteps.float()) / 1000)` (only where `truncation <= 1`, as there).
    pub fn truncates(&self, timestep: f32) -> bool {
        let t_norm = (1000f32 - timestep) / 1000f32;
        self.truncation <= 1.0 && f64::from(t_norm) > self.truncation
    }

    fn check(&self) -> Result<()> {
        check_scale("cfg_normalization", self.normalization)?;
        check_scale("cfg_truncation", self.truncation)
    }
}

/// How a sample is guided.
#[derive(Clone, Debug, Default)]
pub struct Guidance {
    /// Classifier-free guidance (SD3.5, SDXL; Flux's "true CFG"); `None`: none.
    pub cfg: Option<Cfg>,
    /// The guidance input of guidance-distilled models (Flux dev's `guidance_scale`, 3.5 in
    /// its pipeline), >= 0; `None` for models without one (schnell, SD3, SDXL).
    pub distilled: Option<f64>,
}

impl Guidance {
    /// No guidance (Flux schnell).
    pub fn none() -> Self {
        Guidance::default()
    }

    /// Flux dev's distilled guidance input.
    pub fn distilled(scale: f64) -> Self {
        Guidance {
            cfg: None,
            distilled: Some(scale),
        }
    }

    /// Classifier-free guidance with the unconditional conditioning `uncond` at `scale`.
    pub fn cfg(uncond: Vec<Tensor>, scale: f64) -> Self {
        Guidance {
            cfg: Some(Cfg {
                uncond,
                scale,
                batched: false,
                options: CfgOptions::default(),
            }),
            distilled: None,
        }
    }

    /// The same guidance with Z-Image's renormalization and truncation ([`CfgOptions`]); no
    /// effect without classifier-free guidance.
    pub fn with_options(mut self, options: CfgOptions) -> Self {
        if let Some(c) = self.cfg.as_mut() {
            c.options = options;
        }
        self
    }

    /// The same guidance with classifier-free guidance's two predictions batched (`on`) or
    /// run one after the other ([`Cfg::batched`]); no effect without it.
    pub fn batched(mut self, on: bool) -> Self {
        if let Some(c) = self.cfg.as_mut() {
            c.batched = on;
        }
        self
    }
}

/// What a per-step callback sees.
#[derive(Debug)]
pub struct StepInfo<'a> {
    /// The step just taken (0 = the first).
    pub index: usize,
    /// The schedule's number of steps.
    pub steps: usize,
    /// diffusers' timestep of this step.
    pub timestep: f32,
    /// The latents after this step (f32, (B, C, H, W)).
    pub latents: &'a Tensor,
}

/// A per-step callback; an `Err` stops the loop and is returned.
pub type OnStep<'a> = &'a mut dyn FnMut(&StepInfo<'_>) -> Result<()>;

fn invalid(msg: String, shape: &Shape) -> Error {
    Error::InvalidArgument {
        op: "denoise",
        msg,
        shape: shape.clone(),
    }
}

/// Checks `cond` (named `what`) against the model's inputs after `latents`, for batch `b`.
fn check_cond(
    model: &dyn DiffusionModel,
    what: &str,
    cond: &[Tensor],
    latents: &Shape,
) -> Result<()> {
    let inputs = model.inputs();
    let b = latents.dims()[0];
    let names: Vec<&str> = inputs[1..].iter().map(|i| i.name).collect();
    if cond.len() != inputs.len() - 1 {
        return Err(invalid(
            format!(
                "{what}: {} tensors, the model takes {} ({})",
                cond.len(),
                names.len(),
                names.join(", ")
            ),
            latents,
        ));
    }
    let mut shapes = vec![latents.dims()[1..].to_vec()];
    for (t, input) in cond.iter().zip(&inputs[1..]) {
        let d = t.dims();
        if d.first() != Some(&b) {
            return Err(invalid(
                format!(
                    "{what}: {} has shape {:?}, its batch must be the noise's {b}",
                    input.name, d
                ),
                latents,
            ));
        }
        if let Some(why) = input.mismatch(&d[1..]) {
            return Err(invalid(
                format!("{what}: {} (batch excluded) has {why}", input.name),
                t.shape(),
            ));
        }
        shapes.push(d[1..].to_vec());
    }
    model
        .check_shapes(&shapes)
        .map_err(|why| invalid(format!("{what}: {why}"), latents))
}

fn check_scale(what: &str, v: f64) -> Result<()> {
    if !(v.is_finite() && v >= 0.0) {
        return Err(Error::Config {
            path: None,
            msg: format!("denoise: {what} {v} must be finite and >= 0"),
        });
    }
    Ok(())
}

/// Denoises `noise` (B, C, H, W), unit-variance (it is multiplied by the schedule's
/// `init_noise_sigma`), through every step of `schedule` with `model`, conditioned on `cond`
/// (the model's `inputs()` after `latents`, each (B, ...)) and guided by `guidance`; returns
/// the final latents in f32. `on_step` sees the latents after each step.
///
/// Each step is diffusers' pipeline loop: the model input is `scale_model_input` of the
/// latents, cast to the conditioning's dtype (the first tensor of `cond`, the model's
/// compute dtype); the prediction is guided with classifier-free guidance when
/// `guidance.cfg` has a scale above 1 (a second `predict` on the unconditional conditioning,
/// then uncond + scale (cond - uncond) in f32, renormalized and left out at late steps as
/// its [`CfgOptions`] say); `schedule.step` makes the next latents in f32. Nothing is
/// recorded for autograd.
///
/// Errors, before the model runs: an empty schedule, a schedule of another noise process
/// than the model's objective, noise or conditioning whose shapes the model does not take
/// (named), an unconditional conditioning unlike the conditional one, a negative or
/// non-finite scale or guidance option, a distilled guidance scale for a model without a guidance input or
/// none for one with it.
pub fn denoise(
    model: &dyn DiffusionModel,
    schedule: &dyn Schedule,
    noise: &Tensor,
    cond: &[Tensor],
    guidance: &Guidance,
    on_step: Option<OnStep<'_>>,
) -> Result<Tensor> {
    denoise_with(model, schedule, noise, cond, &[], guidance, on_step)
}

/// [`denoise`] conditioned on reference images too (FLUX.2 \[klein\]'s editing): `refs` are
/// their latents, each (B, C, h_i, w_i) with the noise's batch, given to every prediction
/// ([`DiffusionModel::predict_with_references`]), the unconditional one of classifier-free
/// guidance included, as diffusers' `Flux2KleinPipeline` gives its `image_latents` to both.
/// Refused, before the model runs, for a family that takes no references.
pub fn denoise_with(
    model: &dyn DiffusionModel,
    schedule: &dyn Schedule,
    noise: &Tensor,
    cond: &[Tensor],
    refs: &[Tensor],
    guidance: &Guidance,
    mut on_step: Option<OnStep<'_>>,
) -> Result<Tensor> {
    let steps = schedule.timesteps().len();
    if steps == 0 {
        return Err(invalid("the schedule has no steps".into(), noise.shape()));
    }
    let process = match model.objective() {
        Objective::FlowMatching => Process::FlowMatching,
        Objective::Ddpm(_) => Process::Ddpm,
    };
    if schedule.process() != process {
        return Err(Error::Config {
            path: None,
            msg: format!(
                "denoise: a {:?} schedule for a {} model, which is trained with {process:?}",
                schedule.process(),
                model.family().name
            ),
        });
    }
    let inputs = model.inputs();
    if noise.rank() != 4 || noise.dims()[0] == 0 {
        return Err(invalid(
            "noise must be (B, C, H, W) with B >= 1".into(),
            noise.shape(),
        ));
    }
    if let Some(why) = inputs[0].mismatch(&noise.dims()[1..]) {
        return Err(invalid(
            format!("noise (batch excluded) has {why}"),
            noise.shape(),
        ));
    }
    check_cond(model, "cond", cond, noise.shape())?;
    if !refs.is_empty() && !model.family().references {
        return Err(Error::Config {
            path: None,
            msg: format!(
                "denoise: {} reference image(s) given, and {} takes none (FLUX.2 [klein] does)",
                refs.len(),
                model.family().name
            ),
        });
    }
    if let Some(r) = refs
        .iter()
        .find(|r| r.rank() != 4 || r.dims()[0] != noise.dims()[0])
    {
        return Err(invalid(
            format!(
                "a reference's latents must be (B, C, h, w) with the noise's batch {}",
                noise.dims()[0]
            ),
            r.shape(),
        ));
    }
    let cfg = match &guidance.cfg {
        Some(c) => {
            check_scale("the classifier-free guidance scale", c.scale)?;
            c.options.check()?;
            check_cond(model, "uncond", &c.uncond, noise.shape())?;
            if let Some((u, t)) = c
                .uncond
                .iter()
                .zip(cond)
                .find(|(u, t)| u.shape() != t.shape() || u.dtype() != t.dtype())
            {
                return Err(Error::ShapeMismatch {
                    op: "denoise: uncond vs cond (shapes and dtypes must match)",
                    lhs: u.shape().clone(),
                    rhs: t.shape().clone(),
                });
            }
            (c.scale > 1.0).then_some(c)
        }
        None => None,
    };
    let distilled = match (guidance.distilled, model.guidance_input()) {
        (Some(g), true) => {
            check_scale("the distilled guidance scale", g)?;
            g
        }
        (None, false) => 0.0,
        (Some(g), false) => {
            return Err(Error::Config {
                path: None,
                msg: format!(
                    "denoise: distilled guidance {g} given, but this {} model has no guidance \
                     input (use classifier-free guidance)",
                    model.family().name
                ),
            })
        }
        (None, true) => {
            return Err(Error::Config {
                path: None,
                msg: format!(
                    "denoise: this {} model is guidance-distilled and needs a distilled \
                     guidance scale (Flux dev's pipeline uses 3.5)",
                    model.family().name
                ),
            })
        }
    };

    let _no_grad = no_grad();
    let b = noise.dims()[0];
    let dtype = cond.first().map_or(DType::F32, |c| c.dtype());
    let dev = noise.device();
    let mut x = noise.to_dtype(DType::F32)?.mul(&Tensor::full(
        schedule.init_noise_sigma() as f64,
        Shape::from(()),
        DType::F32,
        dev,
    )?)?;
    let refs = refs
        .iter()
        .map(|r| r.to_dtype(dtype))
        .collect::<Result<Vec<_>>>()?;
    // The batched guidance's conditioning, [cond; uncond] along the batch, made once: the
    // same tensors go to every step (a model may key work it derives from them on them).
    // The references are the same for both halves.
    let (both_cond, both_refs) = match cfg {
        Some(c) if c.batched => (Some(doubled(cond, &c.uncond)?), doubled(&refs, &refs)?),
        _ => (None, vec![]),
    };
    for i in 0..steps {
        let input = schedule.scale_model_input(&x, i)?.to_dtype(dtype)?;
        let t = Tensor::full(schedule.model_time(i)? as f64, b, DType::F32, dev)?;
        // Z-Image's truncation: late steps run the conditional prediction alone.
        let cfg = cfg.filter(|c| !c.options.truncates(schedule.timesteps()[i]));
        let (pred, un) = match (cfg, &both_cond) {
            (Some(_), Some(both_cond)) => {
                // [cond; uncond] rows through the model at once, then split.
                let both = model
                    .predict_with_references(
                        &Tensor::cat(&[&input, &input], 0)?,
                        &Tensor::cat(&[&t, &t], 0)?,
                        both_cond,
                        &both_refs,
                        distilled,
                    )?
                    .to_dtype(DType::F32)?;
                (both.narrow(0, 0, b)?, Some(both.narrow(0, b, b)?))
            }
            (Some(c), None) => (
                model
                    .predict_with_references(&input, &t, cond, &refs, distilled)?
                    .to_dtype(DType::F32)?,
                Some(
                    model
                        .predict_with_references(&input, &t, &c.uncond, &refs, distilled)?
                        .to_dtype(DType::F32)?,
                ),
            ),
            (None, _) => (
                model
                    .predict_with_references(&input, &t, cond, &refs, distilled)?
                    .to_dtype(DType::F32)?,
                None,
            ),
        };
        let pred = match (cfg, un) {
            (Some(c), Some(un)) => {
                let scale = Tensor::full(c.scale, Shape::from(()), DType::F32, dev)?;
                let guided = un.add(&pred.sub(&un)?.mul(&scale)?)?;
                match c.options.normalization > 0.0 {
                    true => renormalized(&guided, &pred, c.options.normalization)?,
                    false => guided,
                }
            }
            _ => pred,
        };
        if pred.shape() != x.shape() {
            return Err(Error::ShapeMismatch {
                op: "denoise: the model's prediction vs the latents",
                lhs: pred.shape().clone(),
                rhs: x.shape().clone(),
            });
        }
        x = schedule.step(&pred, i, &x)?;
        if let Some(f) = on_step.as_mut() {
            f(&StepInfo {
                index: i,
                steps,
                timestep: schedule.timesteps()[i],
                latents: &x,
            })?;
        }
    }
    Ok(x)
}

/// Z-Image's `cfg_normalization` of a guided prediction `guided` (B, ...) f32 against the
/// conditional prediction `pos`: each sample whose norm is above `ratio` times `pos`'s is
/// scaled to that norm (`ZImagePipeline.__call__`: `torch.linalg.vector_norm` of each
/// sample's prediction, `pred * (max_new_norm / new_pos_norm)`), in f32.
fn renormalized(guided: &Tensor, pos: &Tensor, ratio: f64) -> Result<Tensor> {
    let b = guided.dims()[0];
    let norms = |t: &Tensor| -> Result<Vec<f32>> {
        t.reshape((b, t.elem_count() / b.max(1)))?
            .sqr()?
            .sum(&[1usize])?
            .sqrt()?
            .to_vec::<f32>()
    };
    let (new, ori) = (norms(guided)?, norms(pos)?);
    let factors: Vec<f32> = new
        .iter()
        .zip(&ori)
        .map(|(&n, &o)| {
            let max = o * ratio as f32;
            if n > max {
                max / n
            } else {
                1.0
            }
        })
        .collect();
    if factors.iter().all(|&f| f == 1.0) {
        return Ok(guided.clone());
    }
    let mut dims = vec![1; guided.rank()];
    dims[0] = b;
    guided.mul(&Tensor::from_vec(factors, dims, guided.device())?)
}

/// Each conditioning tensor with its unconditional one after it along the batch.
fn doubled(cond: &[Tensor], uncond: &[Tensor]) -> Result<Vec<Tensor>> {
    cond.iter()
        .zip(uncond)
        .map(|(c, u)| Tensor::cat(&[c, u], 0))
        .collect()
}

/// What [`generate`] makes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Request {
    /// Denoising steps.
    pub steps: usize,
    /// Distilled guidance for models with a guidance input (Flux dev), else the
    /// classifier-free guidance scale (used when above 1 and a negative conditioning is
    /// given).
    pub guidance: f64,
    /// Latent height and width.
    pub latent_hw: (usize, usize),
    /// The noise of the i-th image is drawn (f32, on the model's device) from `seed + i`.
    pub seed: u64,
    /// What a DDPM model predicts.
    pub prediction: crate::diffusion::Prediction,
    /// Classifier-free guidance's two predictions as one batch ([`Cfg::batched`]): faster,
    /// twice the activations.
    pub batched_guidance: bool,
    /// Z-Image's renormalization and truncation of classifier-free guidance
    /// ([`CfgOptions`]; the default changes nothing).
    pub cfg_options: CfgOptions,
}

/// Latents (1, C, h, w) for each conditioning of `conds` (the model's inputs after the
/// latents, one batch of one per image) with the family's default sampler: Flux dev with
/// its distilled guidance input, otherwise classifier-free guidance against `uncond` when
/// `guidance > 1`. The same request gives the same latents.
pub fn generate(
    model: &dyn DiffusionModel,
    conds: &[Vec<Tensor>],
    uncond: Option<Vec<Tensor>>,
    req: &Request,
    device: &crate::Device,
) -> Result<Vec<Tensor>> {
    let noise = seeded_noise(model, conds.len(), req, device)?;
    generate_from(model, conds, uncond, req, &noise)
}

/// The starting noise [`generate`] draws for `count` images: image i's (1, C, h, w) f32
/// on `device` from `req.seed + i`.
pub fn seeded_noise(
    model: &dyn DiffusionModel,
    count: usize,
    req: &Request,
    device: &crate::Device,
) -> Result<Vec<Tensor>> {
    let channels = match model.inputs().first().and_then(|i| i.dims.first()) {
        Some(crate::models::Size::Exactly(c)) => *c,
        _ => {
            return Err(Error::Config {
                path: None,
                msg: format!(
                    "{}: the latents' channel count is not fixed",
                    model.family().name
                ),
            })
        }
    };
    (0..count)
        .map(|i| {
            Tensor::randn(
                (1, channels, req.latent_hw.0, req.latent_hw.1),
                DType::F32,
                device,
                req.seed.wrapping_add(i as u64),
            )
        })
        .collect()
}

/// [`generate`] from given starting noise instead of `req.seed`'s: `noise[i]` (1, C, h, w)
/// for `conds[i]` (a user reproducing an image of another tool from the same latents).
pub fn generate_from(
    model: &dyn DiffusionModel,
    conds: &[Vec<Tensor>],
    uncond: Option<Vec<Tensor>>,
    req: &Request,
    noise: &[Tensor],
) -> Result<Vec<Tensor>> {
    generate_watched(model, conds, uncond, req, noise, &mut |_, _| Ok(()))
}

/// [`generate_from`], with `on_step(i, step)` called after every denoising step of image
/// `i` (progress; an `Err` stops and is returned).
pub fn generate_watched(
    model: &dyn DiffusionModel,
    conds: &[Vec<Tensor>],
    uncond: Option<Vec<Tensor>>,
    req: &Request,
    noise: &[Tensor],
    on_step: &mut dyn FnMut(usize, &StepInfo<'_>) -> Result<()>,
) -> Result<Vec<Tensor>> {
    generate_referenced(model, conds, &[], uncond, req, noise, on_step)
}

/// [`generate_watched`] with reference images: `refs[i]` are image i's references' latents,
/// each (1, C, h, w) ([`denoise_with`]); `refs` empty: none for any image, else one list per
/// conditioning (an empty list: that image has none).
pub fn generate_referenced(
    model: &dyn DiffusionModel,
    conds: &[Vec<Tensor>],
    refs: &[Vec<Tensor>],
    uncond: Option<Vec<Tensor>>,
    req: &Request,
    noise: &[Tensor],
    on_step: &mut dyn FnMut(usize, &StepInfo<'_>) -> Result<()>,
) -> Result<Vec<Tensor>> {
    if !refs.is_empty() && refs.len() != conds.len() {
        return Err(Error::Config {
            path: None,
            msg: format!(
                "{} lists of reference images for {} prompts: give one per prompt",
                refs.len(),
                conds.len()
            ),
        });
    }
    if noise.len() != conds.len() {
        return Err(Error::Config {
            path: None,
            msg: format!(
                "{} starting latents for {} prompts: give one per prompt",
                noise.len(),
                conds.len()
            ),
        });
    }
    let guided = model.guidance_input();
    let schedule = (model.family().pipeline.schedule)(&crate::models::SampleSetup {
        steps: req.steps,
        latent_hw: req.latent_hw,
        guided,
        prediction: req.prediction,
    })?;
    let guidance = match (guided, uncond) {
        (true, _) => Guidance::distilled(req.guidance),
        (false, Some(u)) if req.guidance > 1.0 => Guidance::cfg(u, req.guidance)
            .batched(req.batched_guidance)
            .with_options(req.cfg_options),
        _ => Guidance::none(),
    };
    let want = model.inputs();
    for n in noise {
        let d = n.dims();
        let ok = d.len() == 4
            && d[0] == 1
            && (d[2], d[3]) == req.latent_hw
            && want
                .first()
                .and_then(|i| i.dims.first())
                .is_none_or(|c| c.admits(d[1]));
        if !ok {
            return Err(Error::invalid(
                "generate_from",
                format!(
                    "starting latents must be (1, C, {}, {}) with the model's C",
                    req.latent_hw.0, req.latent_hw.1
                ),
                n.shape(),
            ));
        }
    }
    conds
        .iter()
        .zip(noise)
        .enumerate()
        .map(|(i, (cond, z))| {
            let z = z.to_dtype(DType::F32)?;
            let mut each = |s: &StepInfo<'_>| {
                crate::progress::tick();
                on_step(i, s)
            };
            denoise_with(
                model,
                schedule.as_ref(),
                &z,
                cond,
                refs.get(i).map_or(&[][..], Vec::as_slice),
                &guidance,
                Some(&mut each),
            )
        })
        .collect()
}
