use super::{Trainer, VALIDATION_POINTS};
use crate::models::Objective;
use crate::train::images;
use crate::train::rundir::{read_log, LOG, PLOT, SAMPLES};
use crate::{DType, Error, Result, Tensor};
use std::path::PathBuf;

/// A sample image's path in the output folder (relative): `samples/step-<step>-<i>.png`.
pub(super) fn sample_name(step: usize, i: usize) -> String {
    format!("{SAMPLES}/step-{step:07}-{i}.png")
}

impl Trainer {
    /// The validation loss: each held-out sample at [`VALIDATION_POINTS`] fixed timesteps
    /// spread over the noise range, with noise drawn from the seed and the sample's id, its
    /// caption as written, no adapter dropout; averaged. The same number for the same
    /// adapter in any run. `None` without held-out images.
    pub fn validation_loss(&self) -> Result<Option<f64>> {
        let Some(v) = &self.validation else {
            return Ok(None);
        };
        let _g = crate::no_grad();
        let was = self.set_train(false);
        let result = (|| {
            let k = VALIDATION_POINTS;
            let mid = |j: usize| (j as f64 + 0.5) / k as f64;
            let t: Vec<f32> = match self.model.objective() {
                Objective::FlowMatching => (0..k).map(|j| mid(j) as f32).collect(),
                Objective::Ddpm(d) => (0..k)
                    .map(|j| (mid(j) * d.steps() as f64).floor() as f32)
                    .collect(),
            };
            let t = Tensor::from_vec(t, k, &self.device)?;
            // The timesteps go through the model in batches no larger than a training
            // micro-batch, so the validation forward fits where the step does.
            let rows = self.config.train.batch_size.clamp(1, k);
            let mut total = 0.0;
            for i in 0..v.ds.len() {
                let batch = v.inputs(&[i], 0, true, self.dtype, &self.device)?;
                let seed = self.config.train.seed ^ v.ds.sample(i)?.id ^ 0x7A1;
                let mut dims = batch.inputs[0].dims().to_vec();
                dims[0] = k;
                let noise =
                    Tensor::randn(dims, DType::F32, &self.device, seed)?.to_dtype(self.dtype)?;
                let mut sum = 0.0;
                for start in (0..k).step_by(rows) {
                    crate::progress::tick();
                    let n = rows.min(k - start);
                    let rep = batch
                        .inputs
                        .iter()
                        .map(|x| Tensor::cat(&vec![x; n], 0))
                        .collect::<Result<Vec<_>>>()?;
                    // The image's references (edit training), with every timestep.
                    let refs = batch
                        .references
                        .iter()
                        .map(|x| Tensor::cat(&vec![x; n], 0))
                        .collect::<Result<Vec<_>>>()?;
                    let mask = match &batch.loss_mask {
                        Some(m) => Some(Tensor::cat(&vec![m; n], 0)?),
                        None => None,
                    };
                    let weights = super::step::LossWeights {
                        mask: mask.as_ref(),
                        weight: None,
                    };
                    let loss = self.loss_at(
                        &rep,
                        &refs,
                        &t.narrow(0, start, n)?,
                        &noise.narrow(0, start, n)?,
                        weights,
                    )?;
                    sum += loss.to_scalar_f64()? * n as f64;
                }
                total += sum / k as f64;
            }
            Ok(total / v.ds.len().max(1) as f64)
        })();
        self.set_train(was);
        result.map(Some)
    }

    /// Makes the `[sample]` images with the adapter as it is now and writes them to
    /// `samples/step-<step>-<i>.png` in the output folder: the prompts' embeddings from the
    /// text cache, the noise of prompt i from `sample.seed + i`, the family's sampler, the
    /// autoencoder loaded for the decode and freed. Needs image data (the caches); nothing
    /// without prompts.
    pub fn sample_images(&self) -> Result<Vec<PathBuf>> {
        self.sample_images_noting(&mut |_| {})
    }

    /// [`Trainer::sample_images`], telling `on` what it changed on the way (a decode that ran
    /// out of memory, tried again in smaller tiles: `images::decode_fitting`).
    pub fn sample_images_noting(&self, on: &mut dyn FnMut(String)) -> Result<Vec<PathBuf>> {
        let sc = &self.config.sample;
        if sc.prompts.is_empty() {
            return Ok(vec![]);
        }
        let Some(parts) = &self.pipeline else {
            return Err(Error::Config {
                path: None,
                msg: "[sample]: sampling needs image data (data.dirs or data.manifest), which \
                      brings the text encoders and the autoencoder"
                    .into(),
            });
        };
        let _g = crate::no_grad();
        let was = self.set_train(false);
        let result = (|| {
            let family = self.model.family();
            let res = self.config.data.resolution;
            let (w, h) = match sc.size {
                [0, 0] => (res, res),
                [w, h] => (w, h),
            };
            let inputs = self.model.inputs();
            let text = |prompt: &str| -> Result<Vec<Tensor>> {
                let prompts = [prompt.to_string()];
                let cached = parts.text.load_batch(&prompts, &self.device, self.dtype)?;
                // Trained text encoders encode the prompt with their adapters.
                let cached = match &self.text {
                    Some(t) => t.replace(cached, &prompts, self.dtype, &self.device)?,
                    None => cached,
                };
                crate::models::pipeline::conditioning(
                    &inputs,
                    &cached,
                    (h, w),
                    self.dtype,
                    &self.device,
                )
            };
            let conds = sc
                .prompts
                .iter()
                .map(|p| text(p.text()))
                .collect::<Result<Vec<_>>>()?;
            // The prompts' reference images (edit sampling), from the latent cache.
            let refs = parts
                .references
                .iter()
                .map(|list| {
                    list.iter()
                        .map(|(path, geo)| {
                            parts
                                .pictures
                                .load_picture(path, geo, &self.device, self.dtype)?
                                .into_iter()
                                .find(|(n, _)| n == "latents")
                                .map(|(_, t)| t)
                                .ok_or_else(|| Error::Config {
                                    path: Some(path.clone()),
                                    msg: "sample.prompts: its cached reference holds no latents"
                                        .into(),
                                })
                        })
                        .collect::<Result<Vec<_>>>()
                })
                .collect::<Result<Vec<_>>>()?;
            let req = crate::sample::Request {
                steps: sc.steps,
                // A step-distilled pipeline (FLUX.2 [klein]) takes no classifier-free
                // guidance (diffusers ignores its scale there).
                guidance: match !self.model.guidance_input()
                    && crate::models::step_distilled(&self.config.model.path)?
                {
                    true => sc.guidance.min(1.0),
                    false => sc.guidance,
                },
                latent_hw: (h / parts.factor, w / parts.factor),
                seed: sc.seed,
                prediction: self.prediction(),
                batched_guidance: crate::train::planning::guidance_batched(&self.config),
                cfg_options: crate::sample::CfgOptions {
                    normalization: sc.cfg_normalization,
                    truncation: sc.cfg_truncation,
                },
            };
            let uncond = Some(text(&sc.negative_prompt)?);
            let noise =
                crate::sample::seeded_noise(self.model.as_ref(), conds.len(), &req, &self.device)?;
            let latents = crate::sample::generate_referenced(
                self.model.as_ref(),
                &conds,
                &refs,
                uncond,
                &req,
                &noise,
                &mut |_, _| Ok(()),
            )?;
            let mut vae = images::vae(&self.config, family, &parts.vae, self.dtype, &self.device)?;
            let width = images::first_width(&vae);
            let tile = crate::train::planning::sample_decode_tile(
                &self.config,
                &self.memory,
                &self.device,
                w * h,
                width,
                images::encoder_dtype(&self.config, &self.device),
            )?;
            if tile > 0 {
                vae.tiling = Some(crate::encoders::VaeTiling::new(tile));
            }
            let run = self.run_dir();
            let dir = run.path.join(SAMPLES);
            std::fs::create_dir_all(&dir).map_err(|source| Error::Io {
                path: dir.clone(),
                source,
            })?;
            let mut written = vec![];
            for (i, z) in latents.iter().enumerate() {
                let img = images::decode_fitting(&mut vae, &z.to_dtype(self.dtype)?, on)?;
                let rel = sample_name(self.step, i);
                let path = run.path.join(&rel);
                crate::data::save_png(&img.squeeze(0)?, &path)?;
                if self.is_root() {
                    run.record(&rel, Some(self.step), false)?;
                }
                written.push(path);
            }
            Ok(written)
        })();
        self.set_train(was);
        result
    }

    /// Redraws `loss.png` from the loss log (training and validation loss against step).
    pub(super) fn plot(&self) -> Result<()> {
        let dir = self.run_dir();
        let (mut train, mut val) = (vec![], vec![]);
        for (step, line) in read_log(&dir.path.join(LOG))? {
            let v: serde_json::Value = serde_json::from_str(&line).unwrap_or_default();
            if let Some(l) = v.get("loss").and_then(|x| x.as_f64()) {
                train.push((step, l));
            }
            if let Some(l) = v.get("val_loss").and_then(|x| x.as_f64()) {
                val.push((step, l));
            }
        }
        crate::data::plot_loss(&train, &val, 640, 400, dir.path.join(PLOT))?;
        dir.record(PLOT, None, false)
    }
}
