//! Plans timed before the first step (`memory.trial_steps`): the planner's pick and its
//! rivals (`MemoryChoice::rivals`, `memory::trial`), each loaded in turn and timed on the
//! run's first batches with nothing trained, the fastest kept; and the plan a resumed run
//! kept, loaded again.

use super::{Event, Trainer};
use crate::memory::{fastest, BlockExec, Plan, Trial};
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

/// A plan to time: the plan (settled), the time model's step under it over the resident
/// one's, and its predicted peak.
#[derive(Clone)]
struct Contender {
    plan: Plan,
    predicted: f64,
    peak: u64,
}

impl Trainer {
    /// The planner's pick and the rivals worth timing beside it: those whose phases are
    /// predicted within the budget wherever the pick's are, those on the pick's weights first
    /// (`same_weights`).
    fn contenders(&self, on: &mut dyn FnMut(Event)) -> Result<Vec<Contender>> {
        let Some((prof, plan)) = &self.memory.sized else {
            return Ok(vec![]);
        };
        let pick = Contender {
            plan: plan.clone(),
            predicted: prof.step_ms(plan) / prof.resident_ms(),
            peak: self
                .memory
                .predicted_peak
                .unwrap_or_else(|| prof.peak(plan)),
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
            let choice = self.memory_under(&r.plan, r.peak)?;
            let phases = self.phases_under(&choice)?;
            let worse: Vec<&str> = past(&phases)
                .into_iter()
                .filter(|p| !over.contains(p))
                .collect();
            if worse.is_empty() {
                out.push(Contender {
                    plan: r.plan.clone(),
                    predicted: r.slowdown,
                    peak: r.peak,
                });
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

    /// The run's memory choice with `plan` (settled, of predicted `peak`) in place of the
    /// planner's pick: its summary says so.
    fn memory_under(&self, plan: &Plan, peak: u64) -> Result<crate::train::MemoryChoice> {
        let mut m = self.memory.clone();
        if plan == &m.plan {
            return Ok(m);
        }
        let (prof, _) = m.sized.clone().ok_or_else(|| Error::Config {
            path: None,
            msg: "timing plans: the memory plan was not worked out from the model's profile".into(),
        })?;
        m.summary = format!(
            "{plan} (kept over the planner's pick, {}, as the fastest timed on this machine; \
             predicted at {:.2}x the resident step)",
            m.plan,
            prof.step_ms(plan) / prof.resident_ms()
        );
        m.plan = plan.clone();
        m.predicted_peak = Some(peak);
        m.sized = Some((prof, plan.clone()));
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
    fn reload(&mut self, plan: &Plan) -> Result<bool> {
        self.ahead = None;
        if same_weights(&self.load.memory, plan) {
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
        let mut opts = self.load.clone();
        opts.memory = plan.clone();
        self.peaks.clock_in();
        let loaded = self.family.load(&self.config.model.path, &opts);
        self.peaks.clock_out("loading the model");
        self.model = loaded?.model;
        self.load = opts;
        Ok(true)
    }

    /// Runs the micro-batches of steps 1 to `n + 1` forward and backward, the ranks' sums
    /// included, and drops their gradients: the times of all but the first, ms.
    fn timed_steps(&mut self, n: usize) -> Result<Vec<f64>> {
        let start = self.step;
        let mut ms = vec![];
        let mut r = Ok(());
        for k in 0..=n {
            self.step = start + k;
            let t0 = std::time::Instant::now();
            r = self.untrained_step();
            if r.is_err() {
                break;
            }
            if k > 0 {
                ms.push(t0.elapsed().as_secs_f64() * 1e3);
            }
        }
        self.step = start;
        self.ahead = None;
        r.map(|()| ms)
    }

    /// With `memory.trial_steps` and rivals to the planner's pick, times each of them
    /// (`contenders`) for that many steps after one untimed, the pick first, and keeps the
    /// one [`fastest`] says (across ranks: the sum of their medians), loading it again where
    /// another was timed last. Nothing is trained: the steps' gradients are dropped, and the
    /// run's first step then starts from the same point. Tells `on` each plan's times and
    /// the choice; returns the trials, the kept one's index, and the kept plan in words for
    /// the run's record, or `None` where nothing was timed. [`Trainer::run`] calls it before
    /// a new run's first step (and records the kept plan); a loop of its own over
    /// [`Trainer::train_step`] may call it first.
    pub fn time_plans(
        &mut self,
        on: &mut dyn FnMut(Event),
    ) -> Result<Option<(Vec<Trial>, usize, String)>> {
        let steps = self.config.memory.trial_steps;
        if steps == 0 || self.memory.rivals.is_empty() {
            return Ok(None);
        }
        let contenders = self.contenders(on)?;
        if contenders.len() < 2 {
            return Ok(None);
        }
        self.peaks.start(&self.device, "timing plans");
        let r = self.time_contenders(&contenders, steps, on);
        self.peaks.end(&self.device, "timing plans");
        let trials = r.map_err(|e| self.memory.explain(e))?;
        // The ranks' medians summed: every rank keeps the same plan.
        let mut medians: Vec<f64> = trials
            .iter()
            .map(|t| t.median_ms().unwrap_or(f64::NAN))
            .collect();
        if let Some(g) = self.group().cloned() {
            g.sum_host(&mut medians)?;
        }
        let summed: Vec<Trial> = trials
            .iter()
            .zip(&medians)
            .map(|(t, &m)| Trial {
                steps_ms: vec![m],
                ..t.clone()
            })
            .collect();
        let k = fastest(&summed).ok_or_else(|| Error::Config {
            path: None,
            msg: "timing plans: no plan was timed".into(),
        })?;
        let kept = &contenders[k];
        if k + 1 != contenders.len() {
            self.reload(&kept.plan)
                .map_err(|e| self.memory.explain(e))?;
        }
        self.keep(&kept.plan, kept.peak)?;
        on(Event::Note(format!(
            "timing plans: kept {}{}",
            kept.plan,
            if k == 0 { " (the planner's pick)" } else { "" }
        )));
        Ok(Some((trials, k, kept.plan.to_string())))
    }

    /// Each contender loaded (the pick is loaded already) and timed: a rival whose load or
    /// steps fail is left out with the reason, where one process trains; the pick's failure,
    /// an interruption, or any failure where ranks train together ends the run (the ranks'
    /// sums must stay in step).
    fn time_contenders(
        &mut self,
        contenders: &[Contender],
        steps: usize,
        on: &mut dyn FnMut(Event),
    ) -> Result<Vec<Trial>> {
        let mut trials = vec![];
        for (i, c) in contenders.iter().enumerate() {
            let r = match i {
                0 => self.timed_steps(steps).map(|ms| (ms, false)),
                _ => self
                    .reload(&c.plan)
                    .and_then(|loaded| Ok((self.timed_steps(steps)?, !loaded))),
            };
            let (steps_ms, failed, in_place) = match r {
                Ok((ms, in_place)) => (ms, None, in_place),
                Err(e) if i == 0 || self.dist.is_some() => return Err(e),
                Err(e @ Error::Interrupted(_)) => return Err(e),
                Err(e) => (vec![], Some(e.to_string()), false),
            };
            let t = Trial {
                plan: c.plan.clone(),
                predicted: c.predicted,
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
        Ok(trials)
    }

    /// Makes `plan` (settled, of predicted `peak`) the run's plan: its memory choice and
    /// each phase's plan follow it.
    fn keep(&mut self, plan: &Plan, peak: u64) -> Result<()> {
        let m = self.memory_under(plan, peak)?;
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
        self.reload(&r.plan).map_err(|e| self.memory.explain(e))?;
        self.keep(&r.plan, r.peak)?;
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
