use super::{Event, FolderAction, RunOptions, Trainer};
use crate::train::config::TrainConfig;
use crate::train::images;
use crate::train::rundir::{
    read_log, write_atomic, CheckpointState, Manifest, RunDir, Survey, LOG,
};
use crate::{Error, Result};
use std::path::PathBuf;

/// What `decide` found: the folder action and, for a resume, the checkpoint to restore
/// (verified) and the ones passed over; the folder's survey.
pub(super) struct Decision {
    pub(super) action: FolderAction,
    pub(super) from: Option<(PathBuf, CheckpointState)>,
    /// Checkpoints passed over (damaged, another run's), with why.
    pub(super) passed: Vec<(PathBuf, String)>,
    pub(super) survey: Survey,
}

/// The config's resume keys, and the number of ranks where there are several (the global
/// batch depends on it).
pub(super) fn resume_keys_of(config: &TrainConfig, world: usize) -> Vec<(&'static str, String)> {
    let mut k = config.resume_keys();
    if world > 1 {
        k.push((
            "ranks (GPUs or workers of data-parallel training)",
            world.to_string(),
        ));
    }
    k
}

/// What a run of `config` over `world` ranks would do with its output folder, as
/// [`Trainer::plan`] says, from the config alone (nothing loaded, nothing written): for a
/// front end to refuse an occupied folder before any data is cached.
pub fn plan_folder(config: &TrainConfig, world: usize, opts: &RunOptions) -> Result<FolderAction> {
    decide(config, world, opts).map(|d| d.action)
}

/// The checks that need neither the model nor a device, for a front end to run once before
/// it starts `world` workers (so a problem every rank would meet is said once): the
/// config's values and paths, the output folder as `opts` asks ([`plan_folder`]), and for
/// image data the scan and the batch size ([`images::scan`]).
pub fn preflight(config: &TrainConfig, world: usize, opts: &RunOptions) -> Result<()> {
    config.validate()?;
    config.check_paths()?;
    config.discovered()?;
    plan_folder(config, world, opts)?;
    if config.data.dir.is_none() {
        images::scan(config, world, &mut |_| {})?;
    }
    Ok(())
}

/// [`plan_folder`] with what a resume needs: the newest checkpoint of the run that verifies
/// (its files hashed once, here), the ones passed over (damaged, another run's) newest
/// first, and the folder's survey.
pub(super) fn decide(config: &TrainConfig, world: usize, opts: &RunOptions) -> Result<Decision> {
    let dir = RunDir::new(&config.train.output_dir);
    let out = dir.path.display().to_string();
    let folder = |msg: String| Error::RunFolder {
        path: dir.path.clone(),
        msg,
    };
    if opts.resume && opts.overwrite {
        return Err(Error::Config {
            path: None,
            msg: "--resume and --overwrite exclude each other".into(),
        });
    }
    let survey = dir.survey()?;
    let run_id = survey.manifest.as_ref().map(|m| m.run_id.clone());
    let strangers: Vec<String> = survey
        .checkpoints
        .iter()
        .filter(|(_, _, r)| r.is_none() || *r != run_id)
        .map(|(_, p, _)| p.file_name().map(|f| f.to_string_lossy().into_owned()))
        .map(Option::unwrap_or_default)
        .collect();
    let plain = |action, survey| Decision {
        action,
        from: None,
        passed: vec![],
        survey,
    };
    if !opts.resume {
        let mut blocked = survey.foreign.clone();
        blocked.extend(strangers);
        if !blocked.is_empty() {
            return Err(folder(format!(
                "{} {} where a run writes, and no run recorded in this folder wrote {}; \
                 runs delete or replace only files they recorded as their own: move {} away \
                 or set train.output_dir to another folder",
                blocked.join(", "),
                if blocked.len() == 1 { "is" } else { "are" },
                if blocked.len() == 1 { "it" } else { "them" },
                if blocked.len() == 1 { "it" } else { "them" },
            )));
        }
        return match (survey.manifest.is_some(), opts.overwrite) {
            (false, _) => Ok(plain(FolderAction::New, survey)),
            (true, true) => {
                let owned = survey.owned.clone();
                Ok(plain(FolderAction::Overwrite(owned), survey))
            }
            (true, false) => Err(folder(format!(
                "holds another run ({}); continue it with --resume, replace it with \
                 --overwrite (which deletes only that run's recorded files), or set \
                 train.output_dir to another folder",
                survey.owned.join(", ")
            ))),
        };
    }
    // Resume.
    let Some(m) = &survey.manifest else {
        // A run stopped before its manifest was in place (killed, a full disk) left at most
        // its interrupted writes and its caches: it starts again. Anything else is no run.
        let cache = images::cache_dir(config);
        let started = std::fs::read_dir(&dir.path).ok().map(|entries| {
            entries.filter_map(|e| e.ok()).all(|e| {
                let n = e.file_name().to_string_lossy().into_owned();
                e.path() == cache || crate::train::rundir::is_temp_name(&n, e.path().is_dir())
            })
        });
        if started == Some(true) {
            return Ok(plain(FolderAction::New, survey));
        }
        let what = match started {
            None => format!("{out} does not exist"),
            Some(_) => format!("{out} has no {}", crate::train::rundir::MANIFEST),
        };
        return Err(folder(format!(
            "--resume: no run to resume ({what}); check train.output_dir, or start a new run \
             without --resume"
        )));
    };
    if !survey.foreign.is_empty() {
        let n = survey.foreign.len();
        return Err(folder(format!(
            "--resume: {} {} where the run writes, and the run did not record {} (or {} \
             changed since); runs replace only files they recorded as their own: move {} \
             away, then resume",
            survey.foreign.join(", "),
            if n == 1 { "is" } else { "are" },
            if n == 1 { "it" } else { "them" },
            if n == 1 { "it" } else { "they" },
            if n == 1 { "it" } else { "them" },
        )));
    }
    let diff = m.differences(&resume_keys_of(config, world));
    if !diff.is_empty() {
        let lines: Vec<String> = diff
            .iter()
            .map(|(k, was, now)| format!("{k} was {was}, the config says {now}"))
            .collect();
        return Err(Error::Config {
            path: None,
            msg: format!(
                "--resume: the run in {out} was made with another config:\n{}\n\
                 (restore those values, or start over with --overwrite)",
                lines.join("\n")
            ),
        });
    }
    let n = config.train.steps;
    let mut passed = vec![];
    for (step, path, run) in survey.checkpoints.iter().rev() {
        if run.is_none() || *run != run_id {
            let why = match run {
                Some(r) => format!("was written by another run (id {r}): passed over"),
                None => "is damaged (its state.json is unreadable)".into(),
            };
            passed.push((path.clone(), why));
            continue;
        }
        let st = match CheckpointState::read_verified(path) {
            Ok(st) => st,
            Err(e) => {
                passed.push((path.clone(), format!("is damaged ({e})")));
                continue;
            }
        };
        if *step > n {
            return Err(Error::Config {
                path: None,
                msg: format!(
                    "--resume: {} is at step {step}, past train.steps = {n}",
                    path.display()
                ),
            });
        }
        // Folders the resumed steps would save over that no run here can be shown to own.
        let in_the_way: Vec<String> = survey
            .checkpoints
            .iter()
            .filter(|(s, _, r)| s > step && *s <= n && (r.is_none() || *r != run_id))
            .map(|(_, p, _)| p.display().to_string())
            .collect();
        if !in_the_way.is_empty() {
            return Err(folder(format!(
                "--resume from step {step}: {} would be replaced by the run's own \
                 checkpoints, and no run here recorded them: move them away, then resume",
                in_the_way.join(", ")
            )));
        }
        let action = if *step == n {
            FolderAction::AlreadyFinished(*step)
        } else {
            FolderAction::Resume(*step, path.clone())
        };
        return Ok(Decision {
            action,
            from: Some((path.clone(), st)),
            passed,
            survey,
        });
    }
    let ours_damaged: Vec<String> = passed
        .iter()
        .filter(|(_, why)| why.starts_with("is damaged"))
        .map(|(p, _)| p.display().to_string())
        .collect();
    if !ours_damaged.is_empty() {
        return Err(Error::Checkpoint {
            path: dir.path.clone(),
            msg: format!(
                "no intact checkpoint to resume from ({} damaged); start over with \
                 --overwrite",
                ours_damaged.join(", ")
            ),
        });
    }
    Ok(Decision {
        action: FolderAction::Resume(0, dir.path.clone()),
        from: None,
        passed,
        survey,
    })
}

impl Trainer {
    /// Rank 0's (or a single process's) start of `run`: decides, prepares the folder and
    /// restores the checkpoint it resumes from.
    pub(super) fn prepare_folder(
        &mut self,
        opts: &RunOptions,
        on: &mut dyn FnMut(Event),
    ) -> Result<FolderAction> {
        let Decision {
            action,
            from,
            passed,
            survey,
        } = decide(&self.config, self.part().world, opts)?;
        let dir = self.run_dir();
        let log_path = dir.path.join(LOG);
        match &action {
            FolderAction::New | FolderAction::Overwrite(_) => {
                if opts.resume {
                    on(Event::Note(format!(
                        "no run was recorded in {} yet (it stopped before its first write): \
                         starting it",
                        dir.path.display()
                    )));
                }
                if matches!(action, FolderAction::Overwrite(_)) {
                    on(Event::Note(format!(
                        "--overwrite: deleting the earlier run's files in {} (only those it \
                         recorded)",
                        dir.path.display()
                    )));
                    dir.clear(&survey)?;
                }
                let mut m = Manifest::new(self.resume_keys());
                m.machine = self.memory.machine;
                // (A record, never a reason to fail: a device that cannot split it has none.)
                m.share_at_start = crate::memory::split_at_start(&self.device)
                    .ok()
                    .and_then(|(share, _)| share);
                dir.create(&m)?;
                self.run_id = m.run_id;
                self.step = 0;
                write_atomic(&log_path, b"")?;
                dir.record(LOG, None, true)?;
            }
            FolderAction::Resume(..) | FolderAction::AlreadyFinished(_) => {
                let m = survey.manifest.ok_or_else(|| Error::Checkpoint {
                    path: dir.path.clone(),
                    msg: "the run manifest disappeared".into(),
                })?;
                if m.machine.is_some() && m.machine != self.memory.machine {
                    on(Event::Note(
                        "the run chose its memory plan with the machine it recorded in run.json, \
                         this process with another (Placement::machine takes the recorded one, \
                         as `train --resume` does): its plan may differ"
                            .into(),
                    ));
                }
                self.run_id = m.run_id;
                for (path, why) in passed {
                    on(Event::Note(format!(
                        "{} {why}; trying the one before",
                        path.display()
                    )));
                }
                let mut copy = None;
                match from {
                    Some((path, st)) => {
                        self.restore(&path, &st)?;
                        if st.files.contains_key(LOG) {
                            copy = Some(path.join(LOG));
                        }
                        on(Event::Note(format!(
                            "resuming after step {} from {}",
                            self.step,
                            path.display()
                        )));
                    }
                    None => {
                        on(Event::Note("no checkpoint yet: starting at step 1".into()));
                        self.step = 0;
                        self.skipped_in_row = 0;
                    }
                }
                // The log keeps the steps the checkpoint covers; where the folder's log
                // lacks some of them (deleted, cut), the checkpoint's copy replaces it.
                let kept: Vec<(usize, String)> = read_log(&log_path)?
                    .into_iter()
                    .filter(|(s, _)| *s <= self.step)
                    .collect();
                let covered = |lines: &[(usize, String)]| {
                    let steps: std::collections::BTreeSet<usize> = lines
                        .iter()
                        .filter(|(_, l)| l.contains("\"loss\""))
                        .map(|(s, _)| *s)
                        .collect();
                    (1..=self.step).filter(|s| !steps.contains(s)).count()
                };
                let mut lines = kept;
                let lacking = covered(&lines);
                if lacking > 0 {
                    match &copy {
                        Some(c) => {
                            lines = read_log(c)?;
                            on(Event::Note(format!(
                                "{} lacked {lacking} of steps 1-{}: taken from {}",
                                log_path.display(),
                                self.step,
                                c.display()
                            )));
                        }
                        None => on(Event::Note(format!(
                            "{} lacks {lacking} of steps 1-{} and the checkpoint holds no \
                             copy of it: those lines are lost",
                            log_path.display(),
                            self.step
                        ))),
                    }
                }
                let text: String = lines.into_iter().map(|(_, l)| l + "\n").collect();
                write_atomic(&log_path, text.as_bytes())?;
                dir.record(LOG, None, true)?;
            }
        }
        Ok(action)
    }
}
