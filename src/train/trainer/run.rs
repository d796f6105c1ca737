use super::folder::decide;
use super::outputs::sample_name;
use super::{Event, FolderAction, RunEnd, RunOptions, Trainer};
use crate::train::config::TrainConfig;
use crate::train::ema::Ema;
use crate::train::rundir::{read_log, CheckpointState, FINAL, LOG, TENSORBOARD};
use crate::train::tensorboard::EventWriter;
use crate::{Error, Result, Tensor};
use std::io::Write;
use std::sync::atomic::Ordering;

/// The phases due after a step.
#[derive(Clone, Copy, Debug)]
pub(super) struct Due {
    pub(super) validation: bool,
    pub(super) samples: bool,
    pub(super) plot: bool,
}

impl Due {
    pub(super) fn describe(&self) -> String {
        let mut v = vec![];
        if self.validation {
            v.push("the validation loss");
        }
        if self.samples {
            v.push("the sample images");
        }
        v.join(" and ")
    }
}

impl Trainer {
    /// Decides what `run` would do with the output folder, checking everything it can
    /// without writing: another run's files without `overwrite` or `resume`, files at a
    /// run's names that no run recorded, a resume with no run to resume or whose config
    /// differs in a key that matters, a checkpoint past `train.steps`.
    pub fn plan(&self, opts: &RunOptions) -> Result<FolderAction> {
        decide(&self.config, self.part().world, opts).map(|d| d.action)
    }

    /// Runs to `train.steps` (or `opts.stop_at`): prepares the output folder as
    /// [`Trainer::plan`] decides, logs each step to `loss.jsonl`, saves checkpoints and the
    /// final adapter, and tells `on` about notes, steps and saves. The checkpoint of a step
    /// (and at the last step the final adapter) is written before that step's validation,
    /// samples and plot, so a failure in one of those loses no training: it is an
    /// [`Error::Phase`], and `--resume` then does only the phases still missing.
    ///
    /// In data-parallel training every rank calls it: rank 0 decides and prepares the
    /// folder, every other rank starts where rank 0 does (reading the same checkpoint: the
    /// output folder must be one every rank can read), the adapter is broadcast from rank 0,
    /// and only rank 0 writes the log, checkpoints, samples and the final adapter.
    pub fn run(&mut self, opts: &RunOptions, on: &mut dyn FnMut(Event)) -> Result<RunEnd> {
        self.run_steps(opts, on).map_err(TrainConfig::named)
    }

    fn run_steps(&mut self, opts: &RunOptions, on: &mut dyn FnMut(Event)) -> Result<RunEnd> {
        let root = self.is_root();
        let dir = self.run_dir();
        let log_path = dir.path.join(LOG);
        let n = self.config.train.steps;
        let action = match root {
            true => self.prepare_folder(opts, on)?,
            false => FolderAction::New,
        };
        if let Some(g) = self.group().cloned() {
            // Rank 0's starting step on every rank.
            let mut v = [if root { self.step as f64 } else { 0.0 }];
            g.sum_host(&mut v)?;
            let step = v[0] as usize;
            if !root {
                self.step = 0;
                self.skipped_in_row = 0;
                if step > 0 {
                    let path = dir.checkpoint_dir(step);
                    let st = CheckpointState::read_verified(&path).map_err(|e| {
                        Error::Dist(format!(
                            "rank {} cannot read the checkpoint rank 0 resumes from ({e}); \
                             train.output_dir must be a folder every rank reads",
                            g.rank()
                        ))
                    })?;
                    self.restore(&path, &st)?;
                }
            }
            let params: Vec<Tensor> = self.params()?.into_iter().map(|(_, t)| t).collect();
            g.broadcast(&params.iter().collect::<Vec<_>>())?;
        }
        // The plans timed before the first step (`memory.trial_steps`), or the plan a
        // resumed run kept after timing them, before the model runs.
        if self.step == 0 {
            if let Some((_, _, kept)) = self.time_plans(on)? {
                if root {
                    dir.record_timed_plan(&kept)?;
                }
            }
        } else if let Some(timed) = dir.manifest()?.and_then(|m| m.timed_plan) {
            self.keep_recorded(&timed, on)?;
        }
        let mut log = match root {
            false => None,
            true => Some(
                std::fs::OpenOptions::new()
                    .append(true)
                    .open(&log_path)
                    .map_err(|source| Error::Io {
                        path: log_path.clone(),
                        source,
                    })?,
            ),
        };
        if root && self.config.train.tensorboard {
            self.open_events()?;
        }
        let fin = dir.path.join(FINAL);
        if root && self.step > 0 {
            // A resume: the final adapter of a finished run is the one of its last step, and
            // the phases due at the step it resumes from are done if they are missing (with
            // the weights to evaluate: a checkpoint holds them and its optimizer state says
            // so; a schedule-free optimizer keeps them there until the next step).
            self.opt.eval_mode()?;
            if self.step == n && !self.final_is_current()? {
                self.save_final()?;
            }
            let due = self.due_at(self.step, true);
            let missing = Due {
                validation: due.validation && !self.validated_in_log(self.step)?,
                samples: due.samples && !self.samples_written(self.step)?,
                plot: due.plot,
            };
            if missing.validation || missing.samples {
                on(Event::Note(format!(
                    "doing what step {} still lacks: {}",
                    self.step,
                    missing.describe()
                )));
            }
            self.phases(missing, true, log.as_mut(), on)?;
        }
        if matches!(action, FolderAction::AlreadyFinished(_)) {
            return Ok(RunEnd::Finished(fin));
        }
        let every = self.config.train.save_every;
        let end = opts.stop_at.unwrap_or(n).min(n);
        while self.step < end {
            let r = match self.train_step() {
                // Stopped inside a step: the steps done so far are saved.
                Err(Error::Interrupted(why)) if self.step > 0 => {
                    on(Event::Note(format!("interrupted {why}")));
                    self.opt.eval_mode()?;
                    let p = self.save_checkpoint()?;
                    on(Event::Saved(p.clone()));
                    return Ok(RunEnd::Interrupted(self.step, p));
                }
                r => r?,
            };
            if r.skipped.is_none() && self.ema.is_some() {
                let params = self.params()?;
                if let Some(ema) = &mut self.ema {
                    ema.update(&params)?;
                }
            }
            self.log_events(|ev| {
                ev.scalar(r.step, "train/loss", r.loss)?;
                ev.scalar(r.step, "train/lr", r.lr)?;
                ev.scalar(r.step, "train/grad_norm", r.grad_norm)
            })?;
            let mut line = serde_json::json!({
                "step": r.step, "loss": r.loss, "lr": r.lr, "grad_norm": r.grad_norm
            });
            if let Some(why) = &r.skipped {
                line["skipped"] = why.clone().into();
            }
            if let Some(log) = &mut log {
                crate::fault::point("log-append")
                    .and_then(|()| writeln!(log, "{line}"))
                    .and_then(|()| log.flush())
                    .map_err(|source| Error::Io {
                        path: log_path.clone(),
                        source,
                    })?;
            }
            on(Event::Step(r));
            let interrupted = match self.dist {
                Some(_) => self.stop_all,
                None => self.interrupt.load(Ordering::Relaxed),
            };
            let save = interrupted || self.step == n || (every > 0 && self.step % every == 0);
            // Checkpoints, the final adapter, the validation loss and the samples use the
            // weights to evaluate (a schedule-free optimizer's x; the trained weights for
            // the others): moved there once on every rank, so that the ranks' parameters
            // stay equal, and back by the next step (`train_step`).
            let due = self.due_at(self.step, save);
            if save || due.validation || due.samples {
                self.opt.eval_mode()?;
            }
            if save {
                let p = match root {
                    true => {
                        let p = self.save_checkpoint()?;
                        if self.step == n {
                            self.save_final()?;
                        }
                        on(Event::Saved(p.clone()));
                        p
                    }
                    false => dir.checkpoint_dir(self.step),
                };
                if let Some(g) = self.group() {
                    g.barrier()?;
                }
                if interrupted {
                    return Ok(RunEnd::Interrupted(self.step, p));
                }
            }
            if root {
                self.phases(due, save, log.as_mut(), on)?;
            }
        }
        if let Some(g) = self.group() {
            g.barrier()?;
        }
        Ok(match self.step == n {
            true => RunEnd::Finished(fin),
            false => RunEnd::Stopped(self.step),
        })
    }

    /// What is due after `step` (`saved`: a checkpoint of it was written).
    pub(super) fn due_at(&self, step: usize, saved: bool) -> Due {
        let n = self.config.train.steps;
        let ve = self.config.train.validate_every;
        let se = self.config.sample.every;
        Due {
            validation: self.validation.is_some()
                && match ve {
                    0 => saved,
                    _ => step % ve == 0 || step == n,
                },
            samples: !self.config.sample.prompts.is_empty()
                && (step == n || (se > 0 && step % se == 0)),
            plot: saved && self.pipeline.is_some(),
        }
    }

    /// Does the phases `due` after the current step: the validation loss (logged), the
    /// sample images and the loss plot, each recorded as the run's. A failure saves a
    /// checkpoint of the step first, if none was (`saved`), and says which phase failed,
    /// what is saved and what to change.
    pub(super) fn phases(
        &mut self,
        due: Due,
        saved: bool,
        mut log: Option<&mut std::fs::File>,
        on: &mut dyn FnMut(Event),
    ) -> Result<()> {
        let step = self.step;
        let dir = self.run_dir();
        let log_path = dir.path.join(LOG);
        let validated = (|| -> Result<()> {
            if !due.validation {
                return Ok(());
            }
            self.peaks.start(&self.device, "validation");
            let loss = self.with_output_weights(|t| t.validation_loss());
            self.peaks.end(&self.device, "validation");
            let (Some(loss), Some(log)) = (loss?, log.as_mut()) else {
                return Ok(());
            };
            self.log_events(|ev| ev.scalar(step, "validation/loss", loss))?;
            let line = serde_json::json!({"step": step, "val_loss": loss});
            writeln!(log, "{line}")
                .and_then(|()| log.flush())
                .map_err(|source| Error::Io {
                    path: log_path.clone(),
                    source,
                })?;
            on(Event::Validation { step, loss });
            Ok(())
        })();
        let sampled = validated.as_ref().ok().map(|_| -> Result<()> {
            if due.samples {
                self.peaks.start(&self.device, "sample images");
                let mut notes = vec![];
                let written =
                    self.with_output_weights(|t| t.sample_images_noting(&mut |n| notes.push(n)));
                self.peaks.end(&self.device, "sample images");
                for n in notes {
                    on(Event::Note(n));
                }
                let written = written?;
                self.log_events(|ev| {
                    for (i, path) in written.iter().enumerate() {
                        let png = std::fs::read(path).map_err(|source| Error::Io {
                            path: path.clone(),
                            source,
                        })?;
                        ev.png(step, &format!("samples/{i}"), &png)?;
                    }
                    Ok(())
                })?;
                if !written.is_empty() {
                    on(Event::Samples(written));
                }
            }
            Ok(())
        });
        let plotted = match (&validated, &sampled) {
            (Ok(()), Some(Ok(()))) if due.plot => self.plot(),
            _ => Ok(()),
        };
        let (phase, error) = match (validated, sampled, plotted) {
            (Err(e), _, _) => ("validation", e),
            (_, Some(Err(e)), _) => ("sample images", e),
            (_, _, Err(e)) => ("the loss plot", e),
            _ => return Ok(()),
        };
        // Nothing trained is lost: the step's checkpoint, if it has none yet.
        let mut saved_what = vec![];
        let checkpoint = match saved {
            true => Ok(dir.checkpoint_dir(step)),
            false => self.save_checkpoint(),
        };
        match &checkpoint {
            Ok(p) => saved_what.push(format!("{} holds step {step}", p.display())),
            Err(e) => saved_what.push(format!("the checkpoint of step {step} failed too: {e}")),
        }
        if step == self.config.train.steps && dir.path.join(FINAL).is_file() {
            saved_what.push(format!(
                "the final adapter is {}",
                dir.path.join(FINAL).display()
            ));
        }
        let knob = match phase {
            _ if a_write_failed(&error) => {
                "see the error above (the output folder's disk space or permissions)".into()
            }
            "validation" => {
                "the validation loss runs every held-out image at 4 timesteps under the \
                 step's memory plan: give it room (a larger memory.budget_gb, fewer or \
                 smaller held-out images) or turn it off (train.validate_every = 0 with no \
                 data.validation_split or data.validation_dir)"
                    .to_string()
            }
            "sample images" => {
                let [w, h] = self.config.sample.size;
                format!(
                    "sampling denoises {} prompt(s) at {} and decodes them: lower sample.size, \
                     decode in smaller tiles (encoders.vae_tile = 256), give it a larger \
                     memory.budget_gb, or turn it off (sample.prompts = [])",
                    self.config.sample.prompts.len(),
                    match (w, h) {
                        (0, 0) => format!("data.resolution = {}", self.config.data.resolution),
                        _ => format!("sample.size = [{w}, {h}]"),
                    }
                )
            }
            _ => "see the error above (the output folder's disk space or permissions)".into(),
        };
        Err(Error::Phase {
            phase,
            step,
            error: Box::new(error),
            saved: saved_what.join("; "),
            hint: format!(
                "{knob}; then run again with --resume: it does the missing phases without \
                 training again"
            ),
        })
    }

    /// Starts this process's TensorBoard event file in `tensorboard/` and records it as the
    /// run's; a resumed run marks a restart at its next step, so TensorBoard drops what
    /// earlier files logged from there on.
    fn open_events(&mut self) -> Result<()> {
        let dir = self.run_dir();
        let mut ev = EventWriter::create(&dir.path.join(TENSORBOARD))?;
        if self.step > 0 {
            ev.restart(self.step + 1)?;
        }
        *self
            .events
            .lock()
            .map_err(|_| Error::Poisoned("event file"))? = Some(ev);
        match self.events_file() {
            Some(rel) => dir.record(&rel, None, true),
            None => Ok(()),
        }
    }

    /// The event file's path relative to the output folder, if one is open.
    pub(super) fn events_file(&self) -> Option<String> {
        let dir = self.run_dir();
        let guard = self.events.lock().ok()?;
        let path = &guard.as_ref()?.path;
        let rel = path.strip_prefix(&dir.path).unwrap_or(path);
        Some(rel.to_string_lossy().into_owned())
    }

    /// Writes to the event file with `f`, if one is open.
    pub(super) fn log_events(&self, f: impl FnOnce(&mut EventWriter) -> Result<()>) -> Result<()> {
        let mut guard = self
            .events
            .lock()
            .map_err(|_| Error::Poisoned("event file"))?;
        match guard.as_mut() {
            Some(ev) => f(ev),
            None => Ok(()),
        }
    }

    /// Runs `f` with the weights the validation loss and sample images use: the moving
    /// average's with `ema.for_outputs` (swapped in, and back out exactly after), else the
    /// trained ones.
    fn with_output_weights<T>(&self, f: impl FnOnce(&Self) -> Result<T>) -> Result<T> {
        let ema = match (&self.ema, self.config.ema.for_outputs) {
            (Some(ema), true) => ema,
            _ => return f(self),
        };
        let params = self.params()?;
        let kept = ema.swap_in(&params)?;
        let r = f(self);
        Ema::swap_out(&params, &kept)?;
        r
    }

    /// Whether the loss log has a validation line for `step`.
    pub(super) fn validated_in_log(&self, step: usize) -> Result<bool> {
        Ok(read_log(&self.run_dir().path.join(LOG))?
            .iter()
            .any(|(s, l)| *s == step && l.contains("\"val_loss\"")))
    }

    /// Whether every sample image of `step` is written and recorded as this run's.
    pub(super) fn samples_written(&self, step: usize) -> Result<bool> {
        let dir = self.run_dir();
        let Some(m) = dir.manifest()? else {
            return Ok(false);
        };
        Ok((0..self.config.sample.prompts.len()).all(|i| {
            let rel = sample_name(step, i);
            m.files
                .get(&rel)
                .is_some_and(|r| r.matches(&dir.path.join(&rel)))
        }))
    }
}

/// Whether `e` is, under its context, a file the disk refused (full, over its quota,
/// read-only, or not permitted): the phase's memory knobs do not help there.
fn a_write_failed(e: &Error) -> bool {
    match e {
        Error::Io { source, .. } => {
            // ENOSPC, EDQUOT, EROFS and EACCES on Linux.
            source.kind() == std::io::ErrorKind::PermissionDenied
                || matches!(source.raw_os_error(), Some(28 | 122 | 30 | 13))
        }
        Error::Context { error, .. } | Error::PlanExceeded { error, .. } => a_write_failed(error),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_what_the_disk_refused_is_blamed_on_the_disk() {
        let io = |e: std::io::Error| Error::Io {
            path: "samples/step-0000002-0.png".into(),
            source: e,
        };
        assert!(a_write_failed(&io(std::io::Error::from_raw_os_error(28))));
        assert!(a_write_failed(&io(
            std::io::ErrorKind::PermissionDenied.into()
        )));
        let wrapped = Error::Context {
            what: "sample images".into(),
            error: Box::new(io(std::io::Error::from_raw_os_error(30))),
        };
        assert!(a_write_failed(&wrapped));
        // A cached file that is not there is no full disk.
        assert!(!a_write_failed(&io(std::io::ErrorKind::NotFound.into())));
        assert!(!a_write_failed(&Error::Interrupted("x".into())));
    }
}
