//! Plans timed before the first step (`memory.trial_steps`): the planner's pick and its
//! rivals (`MemoryChoice::rivals`, `memory::trial`), each loaded in turn and timed on the
//! run's first batches with nothing trained, the fastest kept; and the plan a resumed run
//! kept, loaded again.

use super::{Event, Trainer};
use crate::memory::{fastest, BlockExec, Plan, Planned, Trial};
use crate::models::{DiffusionModel, Family, Input, Objective};
use crate::train::planning::phase_plans;
use crate::{Error, Result, Tensor};

/// What stands in the trainer's place for its model while the model loads again under
/// another plan: the old model's memory is given back first (the budget holds one model),
/// and a load that fails leaves this, which answers what the model was and refuses to
/// predict.
struct Released {
    family: &'static Family,
    inputs: Vec<Input>,
    objective: Objective,
    guided: bool,
    exec: BlockExec,
}

impl DiffusionModel for Released {
    fn family(&self) -> &'static Family {
        self.family
    }
    fn inputs(&self) -> Vec<Input> {
        self.inputs.clone()
    }
    fn objective(&self) -> Objective {
        self.objective.clone()
    }
    fn predict(&self, _: &Tensor, _: &Tensor, _: &[Tensor], _: f64) -> Result<Tensor> {
        Err(Error::Stream(format!(
            "the {} model was released to load under another memory plan, and that load \
             failed",
            self.family.name
        )))
    }
    fn guidance_input(&self) -> bool {
        self.guided
    }
    fn set_exec(&mut self, exec: BlockExec) {
        self.exec = exec;
    }
    fn exec(&self) -> &BlockExec {
        &self.exec
    }
}

impl Trainer {
    /// The planner's pick and the rivals worth timing beside it: those whose phases are
    /// predicted within the budget wherever the pick's are, those on the pick's weights first
    /// (`same_weights`).
    fn contenders(&self, on: &mut dyn FnMut(Event)) -> Result<Vec<Planned>> {
        let Some((prof, plan)) = &self.memory.sized else {
            return Ok(vec![]);
        };
        let pick = Planned {
            plan: plan.clone(),
            peak: self
                .memory
                .predicted_peak
                .unwrap_or_else(|| prof.peak(plan)),
            streamed_bytes: prof.streamed_bytes(plan),
            slowdown: prof.step_ms(plan) / prof.resident_ms(),
        };
        let past = |phases: &[crate::train::planning::PhasePlan]| -> Vec<&'static str> {
            let cap = self.memory.budget.unwrap_or(u64::MAX);
            phases
                .iter()
                .filter(|p| p.peak.is_some_and(|b| b > cap))
                .map(|p| p.phase)
                .collect()
        };
        let over = past(&self.phases);
        let out_pick = pick.plan.clone();
        let mut out = vec![pick];
        for r in &self.memory.rivals {
            let choice = self.memory_under(r)?;
            let phases = self.phases_under(&choice)?;
            let worse: Vec<&str> = past(&phases)
                .into_iter()
                .filter(|p| !over.contains(p))
                .collect();
            if worse.is_empty() {
                out.push(r.clone());
            } else {
                on(Event::Note(format!(
                    "timing plans: not {} (its {} would pass the budget)",
                    r.plan,
                    worse.join(" and ")
                )));
            }
        }
        // The rivals that hold the pick's weights first: they run on the loaded model.
        out[1..].sort_by_key(|c| !same_weights(&out_pick, &c.plan));
        Ok(out)
    }

    /// The run's memory choice with `p` (settled, with its predicted peak and step) in place
    /// of the planner's pick: its summary says so.
    fn memory_under(&self, p: &Planned) -> Result<crate::train::MemoryChoice> {
        let mut m = self.memory.clone();
        if p.plan == m.plan {
            return Ok(m);
        }
        let (prof, _) = m.sized.clone().ok_or_else(|| Error::Config {
            path: None,
            msg: "timing plans: the memory plan was not worked out from the model's profile".into(),
        })?;
        m.summary = format!(
            "{} (kept over the planner's pick, {}, as the fastest timed on this machine; \
             predicted at {:.2}x the resident step)",
            p.plan, m.plan, p.slowdown
        );
        m.plan = p.plan.clone();
        m.predicted_peak = Some(p.peak);
        m.sized = Some((prof, p.plan.clone()));
        Ok(m)
    }

    /// Each phase's plan under `choice` (`phase_plans`, as at open).
    fn phases_under(
        &self,
        choice: &crate::train::MemoryChoice,
    ) -> Result<Vec<crate::train::planning::PhasePlan>> {
        phase_plans(
            &self.config,
            self.family,
            &self.load,
            choice,
            &self.data.largest(),
            self.vae_shape,
            self.guided,
            &self.device,
            self.part().world,
        )
    }

    /// Runs the model under `plan`, its adapters the trainer's own as they are: where `plan`
    /// differs from the loaded one only in how its blocks run (checkpointing, what they
    /// keep, offloaded inputs, re-runs ahead: `BlockExec`), the loaded weights and streamer
    /// run that way (returns false); else the model is released and loaded again (true).
    /// After a failed load the model stays released (`Released`) until a load succeeds.
    fn reload(&mut self, plan: &Plan) -> Result<bool> {
        self.ahead = None;
        if !self.released && same_weights(&self.load.memory, plan) {
            let streamer = self.model.exec().streamer.clone();
            self.model
                .set_exec(BlockExec::for_plan(plan, streamer, &self.device));
            self.load.memory = plan.clone();
            return Ok(false);
        }
        let released = Released {
            family: self.family,
            inputs: self.model.inputs(),
            objective: self.model.objective(),
            guided: self.model.guidance_input(),
            exec: BlockExec::default(),
        };
        drop(std::mem::replace(&mut self.model, Box::new(released)));
        self.released = true;
        let mut opts = self.load.clone();
        opts.memory = plan.clone();
        self.model = self.family.load(&self.config.model.path, &opts)?.model;
        self.released = false;
        self.load = opts;
        Ok(true)
    }

    /// Runs the micro-batches of steps 1 to `n + 1` forward and backward, the ranks' sums
    /// included, and drops their gradients: the times of all but the first, ms; `None` where
    /// a loss was not finite (the steps stop there). A signal to stop ends it between steps
    /// where one process trains (ranks stop together after a step).
    fn timed_steps(&mut self, n: usize) -> Result<Option<Vec<f64>>> {
        let start = self.step;
        let r = (|| {
            let mut ms = vec![];
            for k in 0..=n {
                if self.dist.is_none() && self.interrupt.load(std::sync::atomic::Ordering::Relaxed)
                {
                    return Err(Error::Interrupted(
                        "while timing plans before the first step".into(),
                    ));
                }
                self.step = start + k;
                let t0 = std::time::Instant::now();
                if !self.untrained_step()? {
                    return Ok(None);
                }
                if k > 0 {
                    ms.push(t0.elapsed().as_secs_f64() * 1e3);
                }
            }
            Ok(Some(ms))
        })();
        self.step = start;
        self.ahead = None;
        r
    }

    /// With `memory.trial_steps` and rivals to the planner's pick, times each of them
    /// (`contenders`) for that many steps after one untimed, the pick first, and keeps the
    /// one [`fastest`] says (across ranks: the sum of their medians), loading it again where
    /// another was timed last. Nothing is trained: the steps' gradients are dropped, and the
    /// run's first step then starts from the same point. Ranks of a data-parallel run time
    /// plans only where they all work out the same ones. A non-finite loss in the first
    /// batches stops the timing and leaves the pick. Tells `on` each plan's times and the
    /// choice; returns the trials, the kept one's index, and the kept plan in words for the
    /// run's record, or `None` where nothing was timed. On an error the pick is loaded again
    /// where it can be. [`Trainer::run`] calls it before a new run's first step (and
    /// records the kept plan); a loop of its own over [`Trainer::train_step`] may call it
    /// first.
    pub fn time_plans(
        &mut self,
        on: &mut dyn FnMut(Event),
    ) -> Result<Option<(Vec<Trial>, usize, String)>> {
        let steps = self.config.memory.trial_steps;
        if steps == 0 {
            return Ok(None);
        }
        // Every rank asks the others, rivals or none (the config is the same on all).
        let contenders = self.contenders(on)?;
        if !self.ranks_agree(&contenders, on)? || contenders.len() < 2 {
            return Ok(None);
        }
        self.peaks.start(&self.device, "timing plans");
        let r = self.time_contenders(&contenders, steps, on);
        self.peaks.end(&self.device, "timing plans");
        let trials = match r {
            Ok(Some(t)) => t,
            Ok(None) => {
                // The pick's steps met a non-finite loss: the run's own policy meets it next.
                self.run_plan(&contenders[0])?;
                on(Event::Note(
                    "timing plans: a loss of the first batches is not finite: the planner's \
                     pick stays"
                        .into(),
                ));
                return Ok(None);
            }
            Err(e) => {
                // Best effort: the error is the one to report.
                let _ = self.run_plan(&contenders[0]);
                return Err(self.memory.explain(e));
            }
        };
        // The ranks' medians summed (NaN where a trial has none): every rank keeps the same
        // plan.
        let mut medians: Vec<f64> = trials
            .iter()
            .map(|t| t.median_ms().unwrap_or(f64::NAN))
            .collect();
        if let Some(g) = self.group().cloned() {
            g.sum_host(&mut medians)?;
        }
        let medians: Vec<Option<f64>> = medians.into_iter().map(Some).collect();
        let k = fastest(&medians).unwrap_or(0);
        let kept = &contenders[k];
        self.run_plan(kept).map_err(|e| self.memory.explain(e))?;
        on(Event::Note(format!(
            "timing plans: kept {}{}",
            kept.plan,
            if k == 0 { " (the planner's pick)" } else { "" }
        )));
        Ok(Some((trials, k, kept.plan.to_string())))
    }

    /// Loads `c` where the model does not run it now (released, or under another plan), and
    /// makes it the run's plan.
    fn run_plan(&mut self, c: &Planned) -> Result<()> {
        if self.released || self.load.memory != c.plan {
            self.reload(&c.plan)?;
        }
        self.keep(c)
    }

    /// Whether every rank works out the same plans to time (their count and words hashed
    /// and summed over the ranks); one process always does. Where they differ (each rank
    /// plans with its own host's costs and memory), nothing is timed, with a note.
    fn ranks_agree(&self, contenders: &[Planned], on: &mut dyn FnMut(Event)) -> Result<bool> {
        let Some(g) = self.group().cloned() else {
            return Ok(true);
        };
        let words: String = contenders.iter().map(|c| format!("{};", c.plan)).collect();
        // 40 bits of the hash (the same binary on every rank hashes alike): sums over the
        // ranks stay exact in f64.
        let hash = {
            use std::hash::{Hash, Hasher};
            let mut h = std::hash::DefaultHasher::new();
            words.hash(&mut h);
            (h.finish() >> 24) as f64
        };
        let mine = [contenders.len() as f64, hash];
        let mut v = mine;
        g.sum_host(&mut v)?;
        let world = g.world() as f64;
        let agree = v[0] == mine[0] * world && v[1] == mine[1] * world;
        if !agree {
            on(Event::Note(
                "timing plans: the ranks worked out different plans to time (each plans with \
                 its own host's costs and memory): the planner's pick stays"
                    .into(),
            ));
        }
        Ok(agree)
    }

    /// Each contender loaded (the pick is loaded already) and timed: a rival whose load or
    /// steps fail is left out with the reason (ranks of a data-parallel run agree on a
    /// failed load, and leave that rival out together; a failure in their steps, where they
    /// sum gradients, ends the run); the pick's failure or an interruption ends it too.
    /// `None` where the pick's steps met a non-finite loss (nothing more is timed).
    fn time_contenders(
        &mut self,
        contenders: &[Planned],
        steps: usize,
        on: &mut dyn FnMut(Event),
    ) -> Result<Option<Vec<Trial>>> {
        let mut trials = vec![];
        for (i, c) in contenders.iter().enumerate() {
            let load = match i {
                0 => Ok(false),
                _ => self.reload(&c.plan),
            };
            let (steps_ms, failed, in_place) = match self.agree_on_load(load)? {
                Err(e @ Error::Interrupted(_)) => return Err(e),
                // A rival's load that failed (on any rank): left out on every rank.
                Err(e) => (vec![], Some(e.to_string()), false),
                Ok(loaded) => match self.timed_steps(steps) {
                    Ok(Some(ms)) => (ms, None, i > 0 && !loaded),
                    // A non-finite loss (agreed over the ranks by their sums).
                    Ok(None) if i == 0 => return Ok(None),
                    Ok(None) => (vec![], Some("a loss was not finite".into()), false),
                    Err(e @ Error::Interrupted(_)) => return Err(e),
                    Err(e) if i == 0 || self.dist.is_some() => return Err(e),
                    Err(e) => (vec![], Some(e.to_string()), false),
                },
            };
            let t = Trial {
                plan: c.plan.clone(),
                predicted: c.slowdown,
                steps_ms,
                failed,
            };
            on(Event::Note(format!(
                "timing plans: {}{}",
                t.describe(),
                if in_place {
                    " (the loaded weights, the blocks run its way)"
                } else {
                    ""
                }
            )));
            trials.push(t);
        }
        Ok(Some(trials))
    }

    /// A rival's load, agreed over the ranks of a data-parallel run: where any rank's load
    /// failed, every rank takes it as failed (`Error::PeerFailed` naming it on the others),
    /// so that none starts the rival's steps alone. One process: the load as it went.
    fn agree_on_load(&self, load: Result<bool>) -> Result<Result<bool>> {
        let Some(g) = self.group().cloned() else {
            return Ok(load);
        };
        let mut v = [f64::from(u8::from(load.is_err()))];
        g.sum_host(&mut v)?;
        Ok(match (load, v[0] > 0.0) {
            (Ok(_), true) => Err(Error::PeerFailed(format!(
                "its load failed on {} of {} ranks",
                v[0],
                g.world()
            ))),
            (load, _) => load,
        })
    }

    /// Makes `p` (settled) the run's plan: its memory choice and each phase's plan follow it.
    fn keep(&mut self, p: &Planned) -> Result<()> {
        let m = self.memory_under(p)?;
        self.phases = self.phases_under(&m)?;
        self.memory = m;
        Ok(())
    }

    /// A resumed run's plan as it recorded it after timing plans (`timed_plan`, in words):
    /// the pick or the rival that reads the same, loaded where it is not the one loaded.
    /// Where none does (the rivals worked out now differ), the pick stays, with a note.
    pub(super) fn keep_recorded(&mut self, timed: &str, on: &mut dyn FnMut(Event)) -> Result<()> {
        if self.memory.plan.to_string() == timed {
            return Ok(());
        }
        let Some(r) = self
            .memory
            .rivals
            .iter()
            .find(|r| r.plan.to_string() == timed)
            .cloned()
        else {
            on(Event::Note(format!(
                "the run kept the plan {timed} after timing plans, which is not among the \
                 plans worked out now: the planner's pick stays ({})",
                self.memory.plan
            )));
            return Ok(());
        };
        self.peaks.clock_in();
        let loaded = self.reload(&r.plan);
        self.peaks.clock_out("loading the model");
        loaded.map_err(|e| self.memory.explain(e))?;
        self.keep(&r)?;
        on(Event::Note(format!(
            "resuming with the plan the run kept after timing plans: {}",
            r.plan
        )));
        Ok(())
    }
}

/// Whether models loaded under plans `a` and `b` (settled) hold the same weights the same
/// way: the same 8-bit transposes, the same streamed blocks and, where some are, the same
/// streamer settings; they may differ in how their blocks run (`BlockExec::for_plan`:
/// checkpointing, what is kept, offloaded inputs, re-runs ahead).
fn same_weights(a: &Plan, b: &Plan) -> bool {
    if a.remake_transposes != b.remake_transposes || a.streamed != b.streamed {
        return false;
    }
    let weights = |p: &Plan| Plan {
        checkpointing: crate::memory::Checkpointing::Off,
        keep: crate::autograd::Keep::NONE,
        offload_inputs: false,
        offload_kept: false,
        rerun_ahead: false,
        ..p.clone()
    };
    a.streamed.is_empty() || weights(a) == weights(b)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::Checkpointing;

    #[test]
    fn plans_share_weights_where_only_their_blocks_run_otherwise() {
        let streamed = Plan {
            checkpointing: Checkpointing::All,
            streamed: vec!["b.1".into(), "b.3".into()],
            prefetch: 2,
            wire_code: true,
            ..Plan::default()
        };
        let ahead = Plan {
            rerun_ahead: true,
            offload_inputs: true,
            checkpointing: Checkpointing::Every(2),
            ..streamed.clone()
        };
        assert!(same_weights(&streamed, &ahead));
        // Another streamer: another prefetch, code, or blocks.
        for other in [
            Plan {
                prefetch: 3,
                ..streamed.clone()
            },
            Plan {
                wire_code: false,
                ..streamed.clone()
            },
            Plan {
                streamed: vec!["b.1".into()],
                ..streamed.clone()
            },
            Plan {
                remake_transposes: true,
                ..streamed.clone()
            },
        ] {
            assert!(!same_weights(&streamed, &other), "{other:?}");
        }
        // Nothing streamed: the streamer's settings mean nothing.
        let resident = Plan::default();
        let checkpointed = Plan {
            checkpointing: Checkpointing::All,
            prefetch: 4,
            wire_code: true,
            rerun_ahead: true,
            ..Plan::default()
        };
        assert!(same_weights(&resident, &checkpointed));
        assert!(!same_weights(&resident, &streamed));
    }
}
