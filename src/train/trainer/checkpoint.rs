use super::step::first_nonfinite;
use super::Trainer;
use crate::nn::adapter::{
    load_kohya_sets, load_peft_sets, save_kohya_sets, save_peft_sets, FileSet, ModuleNames, Tool,
    KOHYA_MODEL, PEFT_CONFIG,
};
use crate::train::config::{AdapterFormat, TrainConfig};
use crate::train::ema::Ema;
use crate::train::rundir::{
    read_log, write_atomic, CheckpointState, EMA_STATE, FINAL, FINAL_EMA, LOG,
};
use crate::train::tensorboard::wall_time;
use crate::train::text::TextTraining;
use crate::{models, DType, Device, Error, Result, Tensor};
use std::path::{Path, PathBuf};

impl Trainer {
    /// The layout of the adapter in checkpoints: the configured one, but "kohya" for
    /// "comfyui", whose DoRA magnitudes would not read back bit for bit, and for another
    /// trainer's layout, whose scale folded into a tensor would not either (a resume is
    /// exact).
    pub(super) fn checkpoint_format(&self) -> AdapterFormat {
        match self.config.adapter.format {
            AdapterFormat::Comfyui | AdapterFormat::AiToolkit | AdapterFormat::Musubi => {
                AdapterFormat::Kohya
            }
            f => f,
        }
    }

    /// The module names `tool`'s files give this model's layers.
    fn tool_names(&self, tool: Tool) -> Result<ModuleNames> {
        let family = self.model.family();
        family.tool_names.of(tool).ok_or_else(|| Error::Config {
            path: None,
            msg: format!(
                "adapter.format = \"{}\": written for {}; not for {}",
                tool.name(),
                models::FAMILIES
                    .iter()
                    .filter(|f| f.tool_names.of(tool).is_some())
                    .map(|f| f.name)
                    .collect::<Vec<_>>()
                    .join(" and "),
                family.name
            ),
        })
    }

    /// Writes the adapter in `format`, refusing one with a non-finite value; in the PEFT
    /// layout, PEFT's `adapter_config.json` of the diffusion model's adapters beside it
    /// (`Adapters::peft_config`; each file written whole or not at all).
    pub(super) fn save_adapter(&self, path: &Path, format: AdapterFormat) -> Result<()> {
        self.save_adapter_file(path, format)?;
        if format == AdapterFormat::Peft {
            self.adapters
                .save_peft_config(path.with_file_name(PEFT_CONFIG), &self.map)?;
        }
        Ok(())
    }

    /// Writes the adapter file alone in `format`, refusing one with a non-finite value.
    fn save_adapter_file(&self, path: &Path, format: AdapterFormat) -> Result<()> {
        let params = self.params()?;
        let named: Vec<(&str, &Tensor)> = params.iter().map(|(n, t)| (n.as_str(), t)).collect();
        if let Some(name) = first_nonfinite(&named)? {
            return Err(Error::NonFinite {
                step: self.step,
                what: format!("adapter weight {name}"),
                files: vec![],
                why: format!("refusing to write {}", path.display()),
            });
        }
        let meta = self.file_metadata();
        if let Some(text) = &self.text {
            let sets = self.file_sets(text, format)?;
            return match format {
                AdapterFormat::Peft => save_peft_sets(&sets, path, DType::F32, &meta),
                _ => save_kohya_sets(&sets, path, DType::F32, &meta),
            };
        }
        if let Some(tool) = format.tool() {
            let names = self.tool_names(tool)?;
            return self
                .adapters
                .save_tool(tool, names, &self.map, path, DType::F32, Some(&meta));
        }
        match format {
            AdapterFormat::Kohya => self.adapters.save_kohya_with(path, DType::F32, &meta),
            AdapterFormat::Peft => {
                let prefix = self.model.family().subfolder;
                self.adapters
                    .save_peft_with(path, &self.map, prefix, DType::F32, &meta)
            }
            AdapterFormat::Comfyui => {
                self.adapters
                    .save_comfyui_with(path, DType::F32, &self.base_weights()?, &meta)
            }
            AdapterFormat::AiToolkit | AdapterFormat::Musubi => Err(Error::Config {
                path: None,
                msg: format!("adapter.format = {format:?}: another trainer's layout"),
            }),
        }
    }

    /// The model's adapters and the text encoders' as the sets of one file in `format`
    /// (the "comfyui" layout is refused with trained text encoders by the config check).
    fn file_sets<'a>(
        &'a self,
        text: &'a TextTraining,
        format: AdapterFormat,
    ) -> Result<Vec<FileSet<'a>>> {
        if format == AdapterFormat::Comfyui || format.tool().is_some() {
            return Err(Error::Config {
                path: None,
                msg: format!(
                    "adapter.format = {format:?} holds the diffusion model's adapters only; \
                     with adapter.text_encoders use \"kohya\""
                ),
            });
        }
        let mut sets = vec![FileSet {
            adapters: self.adapters.as_ref(),
            kohya: KOHYA_MODEL,
            peft: self.model.family().subfolder,
            map: &self.map,
        }];
        sets.extend(text.file_sets());
        Ok(sets)
    }

    /// The training metadata of an adapter file saved now (`train::metadata`).
    fn file_metadata(&self) -> std::collections::BTreeMap<String, String> {
        let t = &self.config.train;
        let per_step = t.batch_size * t.grad_accum * self.part().world;
        self.meta
            .at(self.step, per_step, self.data.len(), wall_time())
    }

    /// Writes the moving average's weights as an adapter file in `format` (the adapter's
    /// layout and metadata): swapped into the adapter, saved, and swapped back out exactly.
    pub(super) fn save_ema_adapter(&self, path: &Path, format: AdapterFormat) -> Result<()> {
        let Some(ema) = &self.ema else {
            return Ok(());
        };
        let params = self.params()?;
        let kept = ema.swap_in(&params)?;
        let saved = self.save_adapter(path, format);
        Ema::swap_out(&params, &kept)?;
        saved
    }

    pub(super) fn load_adapter(&self, path: &Path, format: AdapterFormat) -> Result<()> {
        if let Some(text) = &self.text {
            let sets = self.file_sets(text, format)?;
            return match format {
                AdapterFormat::Peft => load_peft_sets(&sets, path),
                _ => load_kohya_sets(&sets, path),
            };
        }
        if let Some(tool) = format.tool() {
            let names = self.tool_names(tool)?;
            return self.adapters.load_tool(tool, names, &self.map, path);
        }
        match format {
            AdapterFormat::Kohya => self.adapters.load_kohya(path),
            AdapterFormat::Peft => {
                let prefix = self.model.family().subfolder;
                self.adapters.load_peft(path, &self.map, prefix)
            }
            AdapterFormat::Comfyui => self.adapters.load_comfyui(path, &self.base_weights()?),
            AdapterFormat::AiToolkit | AdapterFormat::Musubi => Err(Error::Config {
                path: None,
                msg: format!("adapter.format = {format:?}: another trainer's layout"),
            }),
        }
    }

    /// The frozen weight of the layer at a path, read from the model's files as ComfyUI will
    /// have it (f32, memory-mapped; on the CPU backend where the build has it, else on the
    /// run's device), for the "comfyui" layout. Each call reads through a builder of its own,
    /// which keeps nothing once the weight is returned: one layer's weight is held at a time.
    pub(super) fn base_weights(&self) -> Result<impl Fn(&str) -> Result<Tensor> + '_> {
        let m = &self.config.model;
        let device = Device::cpu_backend().unwrap_or_else(|_| self.device.clone());
        let ckpt = self.model.family().open_checkpoint(&m.path)?;
        Ok(move |path: &str| {
            let vb = ckpt.var_builder(DType::F32, &device, self.map.clone())?;
            let name = format!("{path}.weight");
            let shape = vb.shape_of(&name).ok_or_else(|| Error::Config {
                path: Some(m.path.clone()),
                msg: format!("the model holds no {name} for the \"comfyui\" layout"),
            })?;
            vb.get(shape, &name)
        })
    }

    /// Writes `checkpoint-<step>/` (adapter, optimizer state, `state.json` with each file's
    /// size and hash) atomically, then deletes this run's older checkpoints beyond
    /// `train.keep_last`.
    pub fn save_checkpoint(&self) -> Result<PathBuf> {
        self.peaks.start(&self.device, "checkpoints");
        let r = self.write_checkpoint().map_err(|e| {
            TrainConfig::named(e).in_phase(|| {
                "saving a checkpoint (the adapter and optimizer state go to host memory \
                 through the device: a larger memory.budget_gb leaves them room)"
                    .into()
            })
        });
        self.peaks.end(&self.device, "checkpoints");
        r
    }

    pub(super) fn write_checkpoint(&self) -> Result<PathBuf> {
        let keep = self.config.train.keep_last;
        let state = (
            self.config.train.seed,
            self.run_id.as_str(),
            self.skipped_in_row,
            self.scaler.map(|s| (s.scale, s.clean_steps)),
        );
        self.run_dir()
            .save_checkpoint(self.step, state, keep, |tmp| {
                self.save_adapter(&tmp.join("adapter.safetensors"), self.checkpoint_format())?;
                self.opt.save_state(&tmp.join("optimizer.safetensors"))?;
                let mut names = vec!["adapter.safetensors", "optimizer.safetensors", LOG];
                if self.checkpoint_format() == AdapterFormat::Peft {
                    names.push(PEFT_CONFIG);
                }
                if let Some(ema) = &self.ema {
                    ema.save(&tmp.join(EMA_STATE), &self.device)?;
                    names.push(EMA_STATE);
                }
                // The loss log up to this step: a resume restores it from here when the
                // folder's log lost lines.
                let log = self.run_dir().path.join(LOG);
                let text: String = read_log(&log)?
                    .into_iter()
                    .filter(|(s, _)| *s <= self.step)
                    .map(|(_, l)| l + "\n")
                    .collect();
                write_atomic(&tmp.join(LOG), text.as_bytes())?;
                Ok(names)
            })
            .and_then(|p| {
                let dir = self.run_dir();
                dir.record(LOG, None, true)?;
                if let Some(rel) = self.events_file() {
                    dir.record(&rel, None, true)?;
                }
                Ok(p)
            })
    }

    /// Restores the adapter, optimizer state and step from `dir`, after checking its files
    /// against the sizes and hashes recorded when it was written.
    pub fn load_checkpoint(&mut self, dir: &Path) -> Result<()> {
        let st = CheckpointState::read_verified(dir)?;
        self.restore(dir, &st).map_err(TrainConfig::named)
    }

    /// Restores from `dir`, whose files `st` has verified.
    pub(super) fn restore(&mut self, dir: &Path, st: &CheckpointState) -> Result<()> {
        if st.seed != self.config.train.seed {
            return Err(Error::Checkpoint {
                path: dir.to_path_buf(),
                msg: format!(
                    "saved with train.seed = {}, the config has {}",
                    st.seed, self.config.train.seed
                ),
            });
        }
        self.load_adapter(&dir.join("adapter.safetensors"), self.checkpoint_format())?;
        self.opt.load_state(&dir.join("optimizer.safetensors"))?;
        if let Some(ema) = &mut self.ema {
            let path = dir.join(EMA_STATE);
            if !path.is_file() {
                return Err(Error::Checkpoint {
                    path: dir.to_path_buf(),
                    msg: format!(
                        "holds no {EMA_STATE}: it was saved without ema.enabled; resume with \
                         the config it was saved with"
                    ),
                });
            }
            ema.load(&path, &self.device)?;
        }
        self.step = st.step;
        self.skipped_in_row = st.skipped_in_row;
        // A run that scales resumes at the saved scale (a checkpoint without one, from a
        // run that did not scale, starts at the configured initial scale).
        self.scaler = self.config.loss_scaler().map(|mut s| {
            if let Some((scale, clean)) = st.loss_scale {
                s.scale = scale;
                s.clean_steps = clean;
            }
            s
        });
        Ok(())
    }

    /// Whether `lora.safetensors` is the one this run wrote at its last step (recorded in
    /// `run.json` with that step, and unchanged since).
    pub(super) fn final_is_current(&self) -> Result<bool> {
        let dir = self.run_dir();
        let Some(m) = dir.manifest()? else {
            return Ok(false);
        };
        Ok(m.files.get(FINAL).is_some_and(|r| {
            r.step == Some(self.config.train.steps) && r.matches(&dir.path.join(FINAL))
        }))
    }

    /// Writes the final adapter of the current step and records it as this run's.
    pub(super) fn save_final(&self) -> Result<()> {
        let dir = self.run_dir();
        if self.ema.is_some() {
            self.save_ema_adapter(&dir.path.join(FINAL_EMA), self.config.adapter.format)?;
            dir.record(FINAL_EMA, Some(self.step), false)?;
        }
        self.save_adapter(&dir.path.join(FINAL), self.config.adapter.format)?;
        if self.config.adapter.format == AdapterFormat::Peft {
            dir.record(PEFT_CONFIG, Some(self.step), false)?;
        }
        dir.record(FINAL, Some(self.step), false)
    }
}
