use super::{StepReport, Trainer};
use crate::diffusion::loss::{self, HuberSchedule, LossType, TimestepRange};
use crate::models::Objective;
use crate::nn::adapter::ComputeCopies;
use crate::nn::{BatchPart, GOLDEN};
use crate::train::config::OnNonFinite;
use crate::train::config::TrainConfig;
use crate::train::data::{Batch, Part};
use crate::train::objectives::{flow_matching, Prediction};
use crate::{sum_sq_multi, DType, Error, Grads, Result, Tensor};
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// What weighs a batch's loss besides the prediction: each row's mask on the latent grid
/// (B, 1, H, W) and loss weight (B,).
#[derive(Clone, Copy, Default)]
pub(super) struct LossWeights<'a> {
    pub(super) mask: Option<&'a Tensor>,
    pub(super) weight: Option<&'a Tensor>,
}

impl<'a> LossWeights<'a> {
    fn of(batch: &'a Batch) -> Self {
        LossWeights {
            mask: batch.loss_mask.as_ref(),
            weight: batch.loss_weight.as_ref(),
        }
    }
}

fn config_err(msg: String) -> Error {
    Error::Config { path: None, msg }
}

/// The loss options the model's objective cannot take, named by key: the Huber "snr"
/// schedule needs a DDPM schedule's ᾱ; a DDPM timestep range within its schedule.
pub(super) fn check_loss_options(config: &TrainConfig, objective: &Objective) -> Result<()> {
    let t = &config.train;
    match objective {
        Objective::FlowMatching
            if t.loss_type.thresholded() && t.huber_schedule == HuberSchedule::Snr =>
        {
            Err(config_err(format!(
                "train.huber_schedule = \"snr\" with train.loss_type = {:?}: the SNR schedule \
                 needs a DDPM model's ᾱ, and {} trains by flow matching; use \"constant\" or \
                 \"exponential\"",
                t.loss_type, config.model.arch
            )))
        }
        Objective::Ddpm(d) if t.max_timestep > d.steps() => Err(config_err(format!(
            "train.max_timestep = {}: the model's schedule has {} timesteps",
            t.max_timestep,
            d.steps()
        ))),
        _ => Ok(()),
    }
}

/// The timestep range of `config` (`train.min_timestep`, `train.max_timestep`).
fn range(config: &TrainConfig) -> TimestepRange {
    TimestepRange {
        min: config.train.min_timestep,
        max: config.train.max_timestep,
    }
}

/// The name of the first tensor holding a NaN or an infinity: one host copy when all are
/// finite, one per tensor only to find the culprit.
pub(super) fn first_nonfinite<'a>(tensors: &[(&'a str, &'a Tensor)]) -> Result<Option<String>> {
    let all: Vec<&Tensor> = tensors.iter().map(|(_, t)| *t).collect();
    if sum_sq_multi(&all)?.is_finite() {
        return Ok(None);
    }
    for (name, t) in tensors {
        if !sum_sq_multi(&[*t])?.is_finite() {
            return Ok(Some(name.to_string()));
        }
    }
    Ok(None)
}

impl Trainer {
    /// The loss of this process's rows of one batch of clean latents, noised with draws
    /// from `seed`: noise and timesteps are drawn for the whole global batch and the rows
    /// taken, so the ranks together see what one process would.
    pub(super) fn loss(&self, batch: &Batch, seed: u64) -> Result<Tensor> {
        let x0 = &batch.inputs[0];
        let (b, mut dims) = (batch.global, x0.dims().to_vec());
        let (start, len) = (batch.rows.start, batch.rows.len());
        dims[0] = b;
        let noise =
            Tensor::randn(dims.clone(), DType::F32, &self.device, seed)?.narrow(0, start, len)?;
        let noise = self.shape_noise(noise, batch, seed)?.to_dtype(self.dtype)?;
        let t = self.timesteps(batch, seed)?;
        let input = self.perturbed(&noise, batch, seed)?;
        self.loss_with(
            &batch.inputs,
            &batch.references,
            &t,
            &noise,
            input.as_ref(),
            LossWeights::of(batch),
        )
    }

    /// Input perturbation (kohya's `ip_noise_gamma`, Ning et al. 2023): the noise the model's
    /// input is made with, noise + γ · ξ, ξ unit normals drawn for the global batch from
    /// `seed` (its rows taken) and γ `train.ip_noise_gamma`, or with
    /// `ip_noise_gamma_random_strength` γ times a uniform draw of the micro-batch; `None`
    /// when off. Computed on the device.
    fn perturbed(&self, noise: &Tensor, batch: &Batch, seed: u64) -> Result<Option<Tensor>> {
        let t = &self.config.train;
        if t.ip_noise_gamma == 0.0 {
            return Ok(None);
        }
        let u = crate::data::unit(crate::data::draw(seed, &[0x1B_0153, 1]));
        let gamma = loss::strength(t.ip_noise_gamma, t.ip_noise_gamma_random_strength, u);
        let mut dims = noise.dims().to_vec();
        dims[0] = batch.global;
        let xi = Tensor::randn(dims, DType::F32, &self.device, seed ^ 0x1B_0153_0000)?.narrow(
            0,
            batch.rows.start,
            batch.rows.len(),
        )?;
        loss::perturbed_noise(noise, &xi, gamma).map(Some)
    }

    /// kohya's noise options on this process's rows of the noise (B, C, H, W), f32:
    /// `train.noise_offset` (with `adaptive_noise_scale`), then pyramid noise
    /// (`multires_noise_iterations`), its standard deviation over these rows. Every draw is
    /// made for the global batch and its rows taken, from `seed`. The noise as it was
    /// without them.
    fn shape_noise(&self, noise: Tensor, batch: &Batch, seed: u64) -> Result<Tensor> {
        let t = &self.config.train;
        if t.noise_offset == 0.0 && t.multires_noise_iterations == 0 {
            return Ok(noise);
        }
        let d = noise.dims().to_vec();
        let [rows, c, h, w] = d[..] else {
            return Err(config_err(format!(
                "train.noise_offset / train.multires_noise_iterations need latents (B, C, H, \
                 W); these are {d:?}"
            )));
        };
        let (b, start) = (batch.global, batch.rows.start);
        let dims = [rows, c, h, w];
        let mut v = noise.to_vec::<f32>()?;
        let draw = |mut shape: Vec<usize>, s: u64| -> Result<Vec<f32>> {
            shape[0] = b;
            Tensor::randn(shape, DType::F32, &self.device, s)?
                .narrow(0, start, rows)?
                .to_vec::<f32>()
        };
        if t.noise_offset > 0.0 {
            let latents = batch.inputs[0].to_dtype(DType::F32)?.to_vec::<f32>()?;
            let offsets = draw(vec![b, c], seed ^ 0x0FF5_E700)?;
            let adaptive = (t.adaptive_noise_scale != 0.0).then_some(t.adaptive_noise_scale);
            // kohya's noise_offset_random_strength: torch.rand(1) * noise_offset, here one
            // seeded draw per micro-batch.
            let u = crate::data::unit(crate::data::draw(seed, &[0x0FF5_E700, 1]));
            let offset = loss::strength(t.noise_offset, t.noise_offset_random_strength, u);
            loss::noise_offset(&mut v, &latents, dims, offset, adaptive, &offsets)?;
        }
        if t.multires_noise_iterations > 0 {
            // kohya's r = 2 + 2 u per level, u uniform: here seeded by the micro-batch.
            let r: Vec<f64> = (0..t.multires_noise_iterations)
                .map(|i| {
                    let u = crate::data::unit(crate::data::draw(seed, &[i as u64, 0x9A11D]));
                    2.0 + 2.0 * u
                })
                .collect();
            let levels = loss::pyramid_levels(h, w, &r);
            let draws = levels
                .iter()
                .enumerate()
                .map(|(i, &(hn, wn))| {
                    draw(
                        vec![b, c, hn, wn],
                        seed ^ (i as u64 + 1).wrapping_mul(GOLDEN) ^ 0x9A11D,
                    )
                })
                .collect::<Result<Vec<_>>>()?;
            v = loss::pyramid_noise(&v, dims, t.multires_noise_discount, &levels, &draws)?;
        }
        Tensor::from_vec(v, d, &self.device)
    }

    /// The timesteps of this process's rows of `batch`, drawn from `seed` for the whole global
    /// batch (as `loss` draws them).
    pub(super) fn timesteps(&self, batch: &Batch, seed: u64) -> Result<Tensor> {
        let dims = batch.inputs[0].dims();
        let b = batch.global;
        let range = range(&self.config);
        let t = match self.model.objective() {
            Objective::FlowMatching => {
                // Flux's resolution-dependent shift counts the transformer's image tokens.
                let tokens = self.model.image_tokens(dims[2], dims[3]);
                let t = self
                    .config
                    .sampling()
                    .sample(b, tokens, seed ^ 0x7133, &self.device)?;
                match range == TimestepRange::FULL {
                    true => t,
                    // The range's affine map on the device (no copy to the host).
                    false => {
                        let (lo, hi) = (range.flow(0.0), range.flow(1.0));
                        t.affine(hi - lo, lo)?.clamp(1e-5, 1.0 - 1e-5)?
                    }
                }
            }
            Objective::Ddpm(ddpm) if range != TimestepRange::FULL => {
                ddpm.sample_timesteps_in(b, range, seed ^ 0x7133, &self.device)?
            }
            Objective::Ddpm(ddpm) => ddpm.sample_timesteps(b, seed ^ 0x7133, &self.device)?,
        };
        t.narrow(0, batch.rows.start, batch.rows.len())
    }

    /// The seed of micro-batch `m`'s noise and timesteps.
    pub(super) fn micro_seed(&self, m: usize) -> u64 {
        self.config.train.seed ^ (m as u64 + 1).wrapping_mul(GOLDEN)
    }

    /// Micro-batch `m`: the one fetched ahead when it is that one, else read now.
    pub(super) fn micro_batch(&mut self, m: usize, part: Part) -> Result<Batch> {
        let t = &self.config.train;
        match self.ahead.take() {
            Some((k, batch)) if k == m => Ok(batch),
            _ => self.data.batch(
                m,
                t.batch_size * part.world,
                t.seed,
                part,
                self.dtype,
                &self.device,
            ),
        }
    }

    /// Fetches micro-batch `m` and announces its inputs to the model
    /// (`DiffusionModel::prepare`): called between a micro-batch's forward and its backward
    /// where the model computes conditioning products on the host
    /// (`Plan::host_products`), which it then does during that backward instead of in
    /// `m`'s forward.
    pub(super) fn announce(&mut self, m: usize, part: Part) -> Result<()> {
        let batch = self.micro_batch(m, part)?;
        if !batch.inputs.is_empty() {
            let t = self.timesteps(&batch, self.micro_seed(m))?;
            let guidance = self.config.model.guidance;
            self.model
                .prepare(&batch.inputs[0], &t, &batch.inputs[1..], guidance)?;
        }
        self.ahead = Some((m, batch));
        Ok(())
    }

    /// What the model is trained to predict (DDPM models).
    pub(super) fn prediction(&self) -> Prediction {
        self.config.model.prediction
    }

    /// The loss of one batch of clean latents at timesteps `t` (B) with `noise`, conditioned
    /// on the rows' reference images `refs` (edit training; each (B, C, h, w)): the
    /// per-element loss of `train.loss_type`, masked and weighted by `weights` and
    /// min-SNR-γ, reduced as kohya's ([`loss::reduce`]).
    pub(super) fn loss_at(
        &self,
        batch: &[Tensor],
        refs: &[Tensor],
        t: &Tensor,
        noise: &Tensor,
        weights: LossWeights<'_>,
    ) -> Result<Tensor> {
        self.loss_with(batch, refs, t, noise, None, weights)
    }

    /// [`Trainer::loss_at`] with the model's input noised with `input` instead of `noise`
    /// where given (input perturbation); the target is made from `noise`.
    pub(super) fn loss_with(
        &self,
        batch: &[Tensor],
        refs: &[Tensor],
        t: &Tensor,
        noise: &Tensor,
        input: Option<&Tensor>,
        weights: LossWeights<'_>,
    ) -> Result<Tensor> {
        let x0 = &batch[0];
        let cond = &batch[1..];
        let guidance = self.config.model.guidance;
        let tc = &self.config.train;
        let objective = self.model.objective();
        let (pred, target, snr) = match &objective {
            Objective::FlowMatching => {
                let (mut xt, target) = flow_matching(x0, noise, t)?;
                if let Some(n) = input {
                    xt = flow_matching(x0, n, t)?.0;
                }
                let pred = self
                    .model
                    .predict_with_references(&xt, t, cond, refs, guidance)?;
                (pred, target, None)
            }
            Objective::Ddpm(ddpm) => {
                let kind = self.prediction();
                let (mut xt, target) = ddpm.noisy_and_target(x0, noise, t, kind)?;
                if let Some(n) = input {
                    xt = ddpm.noisy_and_target(x0, n, t, kind)?.0;
                }
                let pred = self
                    .model
                    .predict_with_references(&xt, t, cond, refs, guidance)?;
                let gamma = tc.min_snr_gamma;
                let w = match gamma > 0.0 {
                    true => Some(ddpm.min_snr_weights(t, gamma, kind)?),
                    false => None,
                };
                (pred, target, w)
            }
        };
        // Huber's threshold per sample, from the timesteps on 0..1000 (kohya's).
        let c = match tc.loss_type {
            LossType::L2 | LossType::L1 => None,
            LossType::Huber | LossType::SmoothL1 => {
                // The constant schedule reads no timestep: none is copied to the host.
                let (steps, ab) = match &objective {
                    _ if tc.huber_schedule == HuberSchedule::Constant => {
                        (vec![0.0; t.elem_count()], None)
                    }
                    Objective::FlowMatching => (
                        t.to_vec_f64()?
                            .iter()
                            .map(|t| t * loss::TRAIN_TIMESTEPS)
                            .collect(),
                        None,
                    ),
                    Objective::Ddpm(d) => (t.to_vec_f64()?, Some(&d.alphas_cumprod[..])),
                };
                let c = loss::huber_threshold(
                    tc.huber_schedule,
                    tc.huber_c,
                    tc.huber_scale,
                    &steps,
                    ab,
                )?;
                let c: Vec<f32> = c.iter().map(|&c| c as f32).collect();
                Some(Tensor::from_vec(c, t.elem_count(), &self.device)?)
            }
        };
        let per = loss::elementwise(tc.loss_type, &pred, &target, c.as_ref())?;
        let w = match (snr, weights.weight) {
            (Some(a), Some(b)) => Some(a.mul(&b.to_dtype(DType::F32)?)?),
            (a, b) => a.or_else(|| b.cloned()),
        };
        loss::reduce(&per, weights.mask, w.as_ref())
    }

    /// One optimizer step (with its accumulated micro-batches). A non-finite loss or
    /// gradient norm stops with an error naming the step, the batch's files and the tensor,
    /// or (`train.on_nonfinite = "skip"`) skips the update.
    pub fn train_step(&mut self) -> Result<StepReport> {
        self.peaks
            .start(&self.device, &format!("training step {}", self.step + 1));
        crate::fault::point("step").map_err(|source| Error::Io {
            path: format!("step {}", self.step + 1).into(),
            source,
        })?;
        let r = self.step_inner().map_err(|e| self.memory.explain(e));
        self.peaks.end(&self.device, "training steps");
        r
    }

    /// One optimizer step: the micro-batches' gradients (`accumulate`), the ranks'
    /// agreement (`agree`), the gradient norm (`gradient_norm`), then the update, or a step
    /// skipped as the loss scale or `train.on_nonfinite` says (`skip_or_stop`).
    pub(super) fn step_inner(&mut self) -> Result<StepReport> {
        // The gradient is taken at the training point (a schedule-free optimizer's y, where
        // outputs moved the parameters to x).
        self.opt.train_mode()?;
        let lr = self.config.lr_at(self.step);
        self.opt.set_learning_rate(lr);
        // Dynamic loss scaling: the backward runs on loss * scale, the step divides by it.
        let scale = self.scaler.map_or(1.0, |s| s.scale);
        let mut acc = self.accumulate(scale)?;
        self.agree(&mut acc)?;
        let (norm, overflow) = self.gradient_norm(&mut acc, scale)?;
        let step = self.step + 1;
        let mut report = StepReport {
            step,
            steps: self.config.train.steps,
            loss: acc.total,
            lr,
            grad_norm: norm,
            skipped: None,
        };
        if overflow {
            // GradScaler's skipped step: no update, the scale halved; not a failure.
            self.step = step;
            let now = self.scaler.map_or(1.0, |s| s.scale);
            report.skipped = Some(format!(
                "the f16 gradients overflowed at loss scale {scale}; the scale is now {now}"
            ));
            return Ok(report);
        }
        if let Some(what) = acc.bad {
            return self.skip_or_stop(report, what, acc.files);
        }
        // Clipping and unscaling, folded into the optimizer's fused update.
        let max = self.config.train.max_grad_norm;
        let clip = if max > 0.0 && norm > max {
            max / (norm + 1e-6)
        } else {
            1.0
        };
        self.opt.step_scaled(&acc.grads, clip / scale)?;
        if let Some(sc) = &mut self.scaler {
            sc.clean();
        }
        self.skipped_in_row = 0;
        self.step = step;
        Ok(report)
    }

    /// The next step's micro-batches forward and backward, the ranks' sums included, and
    /// the device waited for; the gradients are dropped: nothing is trained (plans timed
    /// before the first step, `Trainer::time_plans`). Whether every loss was finite (a
    /// non-finite one stops one process's micro-batches early).
    pub(super) fn untrained_step(&mut self) -> Result<bool> {
        self.opt.train_mode()?;
        let scale = self.scaler.map_or(1.0, |s| s.scale);
        let mut acc = self.accumulate(scale)?;
        self.agree(&mut acc)?;
        self.device.synchronize()?;
        Ok(acc.bad.is_none())
    }

    /// The micro-batches of the next step, forward and backward, their gradients summed
    /// (and, across ranks, handed to the reducer as the last backward makes them). A
    /// non-finite loss stops a single process's accumulation; ranks of a group go on to the
    /// sums, which every rank must join.
    fn accumulate(&mut self, scale: f64) -> Result<Accumulated> {
        let acc = self.config.train.grad_accum;
        let mut out = Accumulated {
            grads: Grads::new(),
            total: 0.0,
            files: vec![],
            bad: None,
        };
        let part = self.part();
        let reducer = self.dist.as_ref().map(|(_, r)| r.clone());
        if let Some(r) = &reducer {
            out.grads.set_hook(Some(r.clone()));
        }
        // The adapters' compute copies, from the masters as the last optimizer step left
        // them: one grouped launch, read by every micro-batch's forward (and checkpointed
        // re-runs), their gradients folded into the f32 masters' after each backward. Not
        // where ranks sum gradients while the backward runs: the fold makes the masters'
        // gradients only after the whole backward, the per-use casts' VJPs as each layer's
        // backward ends, which the buckets' sums overlap.
        let copies = match &reducer {
            Some(r) if r.overlaps() => ComputeCopies::new(vec![], self.dtype)?,
            _ => self.compute_copies()?,
        };
        // Host-held conditioning products are computed ahead, during the backward before.
        // So are the products of the context's Linears where the plan computes them ahead.
        // (The plan the model was loaded with: a plan timed before the first step is not
        // yet the run's.)
        let loaded = &self.load.memory;
        let announce =
            (loaded.host_products || loaded.ahead_products) && !loaded.streamed.is_empty();
        for micro in 0..acc {
            crate::progress::tick();
            // A signal in a long accumulation stops between micro-batches (one process: the
            // ranks of a group agree on a stop at the step's end instead); the step is dropped.
            if micro > 0 && self.dist.is_none() && self.interrupt.load(Ordering::Relaxed) {
                return Err(Error::Interrupted(format!(
                    "during step {} after {micro} of its {acc} micro-batches (the step is \
                     dropped)",
                    self.step + 1
                )));
            }
            let m = self.step * acc + micro;
            let batch = self.micro_batch(m, part)?;
            out.files.extend(batch.files.iter().cloned());
            if micro + 1 == acc {
                // The last backward of the step starts the gradient sums over the ranks.
                if let Some(r) = &reducer {
                    r.arm()?;
                }
            }
            if batch.inputs.is_empty() {
                // This rank has no rows of a short last batch: it adds zeros.
                continue;
            }
            let rows = BatchPart {
                start: batch.rows.start,
                len: batch.rows.len(),
                global: batch.global,
            };
            self.adapters
                .set_batch(self.step as u64, micro as u64, rows)?;
            if let Some(t) = &self.text {
                t.set_batch(self.step as u64, micro as u64, rows)?;
            }
            let s = self.micro_seed(m);
            let _copies = copies.enter();
            // Each rank's mean over its rows, weighted by its share of the global batch:
            // the ranks' sum is the global batch's mean.
            let w = batch.rows.len() as f64 / batch.global.max(1) as f64 / acc as f64;
            let loss = self.loss(&batch, s)?.affine(w, 0.0)?;
            if announce && m + 1 < self.config.train.steps * acc {
                // Best effort: where the announcement fails (the next batch unreadable, no
                // page-locked memory), that micro-batch reads its data and computes its
                // products in its own turn, which reports any error that persists.
                if self.announce(m + 1, self.part()).is_err() {
                    self.ahead = None;
                }
            }
            let value = loss.to_scalar_f64()?;
            out.total += value;
            if !value.is_finite() {
                out.bad = Some(self.why_not_finite(&batch, micro, value)?);
                if reducer.is_none() {
                    break;
                }
                // The other ranks go on to the gradient sums: so does this one.
                continue;
            }
            if scale == 1.0 {
                loss.backward_into(&mut out.grads)?;
            } else {
                loss.affine(scale, 0.0)?.backward_into(&mut out.grads)?;
            }
            copies.fold(&mut out.grads)?;
        }
        out.grads.set_hook(None);
        Ok(out)
    }

    /// The compute copies (in the model's dtype) of the weights the adapters' forwards cast:
    /// the model's and the trained text encoders' in one set (an encoder computing in
    /// another dtype casts its own, as without copies).
    fn compute_copies(&self) -> Result<Arc<ComputeCopies>> {
        let mut weights: Vec<(Tensor, f64)> = vec![];
        let sets = std::iter::once(&self.adapters).chain(
            self.text
                .iter()
                .flat_map(|t| t.sets.iter().map(|(_, a, _)| a)),
        );
        for a in sets {
            weights.extend(a.cast_params()?);
        }
        ComputeCopies::new(weights, self.dtype)
    }

    /// Why micro-batch `micro`'s loss is `value`: an input that was not finite before the
    /// model ran (the data, not training), else the loss itself.
    fn why_not_finite(&self, batch: &Batch, micro: usize, value: f64) -> Result<String> {
        let names: Vec<String> = self
            .model
            .inputs()
            .iter()
            .map(|i| i.name.to_string())
            .collect();
        let refs: Vec<String> = (0..batch.references.len())
            .map(|i| format!("reference {i}"))
            .collect();
        let named: Vec<(&str, &Tensor)> = names
            .iter()
            .map(String::as_str)
            .zip(batch.inputs.iter())
            .chain(refs.iter().map(String::as_str).zip(batch.references.iter()))
            .collect();
        Ok(match first_nonfinite(&named)? {
            Some(input) => format!(
                "the input {input} of micro-batch {} holds a NaN or an infinity as read from \
                 the data (the files below, before the model ran): delete those cache entries \
                 or samples to make them again",
                micro + 1
            ),
            None => format!("the loss of micro-batch {} is {value}", micro + 1),
        })
    }

    /// Data-parallel training: the gradient sums finished, and every rank agreeing on the
    /// loss, on a non-finite loss anywhere and on a stop. One process: nothing to do.
    fn agree(&mut self, acc: &mut Accumulated) -> Result<()> {
        let Some((g, r)) = &self.dist else {
            return Ok(());
        };
        r.finish(&mut acc.grads)?;
        let mut v = [
            acc.total,
            f64::from(u8::from(acc.bad.is_some())),
            f64::from(u8::from(self.interrupt.load(Ordering::Relaxed))),
        ];
        g.sum_host(&mut v)?;
        acc.total = v[0];
        if acc.bad.is_none() && v[1] > 0.0 {
            acc.bad = Some(format!(
                "the loss is not finite on {} of {} ranks",
                v[1],
                g.world()
            ));
        }
        self.stop_all = v[2] > 0.0;
        Ok(())
    }

    /// The global norm of the adapters' gradients, unscaled, and whether the f16 gradients
    /// overflowed (the loss scaler then backs off: no failure). A non-finite norm the scaler
    /// cannot explain names the first parameter whose gradient is not finite in `acc.bad`.
    fn gradient_norm(&mut self, acc: &mut Accumulated, scale: f64) -> Result<(f64, bool)> {
        if acc.bad.is_some() {
            return Ok((f64::NAN, false));
        }
        let params = self.params()?;
        let with_grads: Vec<(&str, &Tensor)> = params
            .iter()
            .filter_map(|(n, p)| Some((n.as_str(), acc.grads.get(p)?)))
            .collect();
        let gs: Vec<&Tensor> = with_grads.iter().map(|(_, g)| *g).collect();
        let norm = sum_sq_multi(&gs)?.sqrt() / scale;
        if norm.is_finite() {
            return Ok((norm, false));
        }
        match &mut self.scaler {
            // The loss was finite: the scaled gradients overflowed f16.
            Some(sc) if sc.can_back_off() => {
                sc.overflowed();
                Ok((norm, true))
            }
            _ => {
                acc.bad = Some(match first_nonfinite(&with_grads)? {
                    Some(n) => format!("the gradient of {n} is not finite (gradient norm {norm})"),
                    None => format!("the gradient norm is {norm}"),
                });
                Ok((norm, false))
            }
        }
    }

    /// A step whose loss or gradients are not finite (`what`, from the micro-batches of
    /// `files`): skipped, or the run stopped as `train.on_nonfinite` and
    /// `train.max_skipped` say.
    fn skip_or_stop(
        &mut self,
        mut report: StepReport,
        what: String,
        files: Vec<String>,
    ) -> Result<StepReport> {
        let t = &self.config.train;
        let stop = t.on_nonfinite == OnNonFinite::Stop;
        if stop || self.skipped_in_row + 1 > t.max_skipped {
            let why = if stop {
                "train.on_nonfinite = \"stop\"".to_string()
            } else {
                format!(
                    "{} steps skipped in a row (train.max_skipped)",
                    t.max_skipped + 1
                )
            };
            return Err(Error::NonFinite {
                step: report.step,
                what,
                files,
                why,
            });
        }
        self.skipped_in_row += 1;
        self.step = report.step;
        report.skipped = Some(what);
        Ok(report)
    }
}

/// What the micro-batches of a step gave: their gradients summed, the loss (averaged over
/// them), the files they were read from, and why the step cannot update (a non-finite loss
/// or gradient), if it cannot.
struct Accumulated {
    grads: Grads,
    total: f64,
    files: Vec<String>,
    bad: Option<String>,
}
