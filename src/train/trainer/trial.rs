//! Plans timed before the first step (`memory.trial_steps`): the planner's pick and its
//! rivals (`MemoryChoice::rivals`, `memory::trial`), each loaded in turn and timed on the
//! run's first batches with nothing trained, within a share of the run's time
//! (`memory.trial_share`), the fastest kept; and the plan a resumed run kept, loaded again.

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
    /// (`contenders`) that fits in `memory.trial_share` of the run's time (`allowance`:
    /// nothing where not even the pick and its cheapest rival fit) for that many steps
    /// after one untimed, the pick first, and keeps the
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
        let contenders = self.contenders(on).unwrap_or_else(|e| {
            // Rivals never fail a run: the pick alone (the ranks' agreement sees the list
            // differ where another rank worked one out).
            on(Event::Note(format!(
                "timing plans: none timed: the rivals' phases were not worked out ({e})"
            )));
            vec![]
        });
        if !self.ranks_agree(&contenders, on)? {
            return Ok(None);
        }
        if contenders.len() < 2 {
            // Where the planner chose the plan, the run says why nothing was timed (a plan
            // given by hand, or no budget, has no rivals to time).
            if self.memory.machine.is_some() && !contenders.is_empty() {
                on(Event::Note(format!(
                    "timing plans: none timed: {}",
                    self.memory
                        .no_rival()
                        .unwrap_or_else(|| "every rival's phases would pass the budget".into())
                )));
            }
            return Ok(None);
        }
        let Some(allowance) = self.allowance(&contenders, steps, on)? else {
            return Ok(None);
        };
        self.peaks.start(&self.device, "timing plans");
        let r = self.time_contenders(&contenders, steps, allowance, on);
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

    /// What timing `contenders` may take of the run (`memory.trial_share` of its steps at
    /// the pick's predicted step, with the model's first load as the cost of a load), agreed
    /// over the ranks; `None`, with a note, where not even the pick and its cheapest rival
    /// fit.
    fn allowance(
        &self,
        contenders: &[Planned],
        steps: usize,
        on: &mut dyn FnMut(Event),
    ) -> Result<Option<Allowance>> {
        let Some((prof, _)) = &self.memory.sized else {
            return Ok(None);
        };
        let pick = &contenders[0];
        let step_s = prof.step_ms(&pick.plan) * self.config.train.grad_accum as f64 / 1e3;
        let load_s = self
            .peaks
            .seconds()
            .iter()
            .filter(|(p, _)| *p == "loading the model")
            .map(|&(_, s)| s)
            .sum::<f64>();
        // Every number a decision reads, averaged over the ranks: they decide alike.
        let mut v = vec![step_s, load_s];
        v.extend(contenders.iter().map(|c| c.slowdown));
        let agreed = self.agreed(v)?;
        let mut a = Allowance::new(
            self.config.memory.trial_share,
            self.config.train.steps.saturating_sub(self.step),
            steps,
            agreed[2..].to_vec(),
            agreed[0],
        );
        a.load_s = agreed[1];
        let cheapest = (1..contenders.len())
            .map(|i| a.cost(i, !same_weights(&pick.plan, &contenders[i].plan)))
            .fold(f64::INFINITY, f64::min);
        let first = a.steps_s(0) + cheapest;
        if !a.fits(first) {
            on(Event::Note(format!(
                "timing plans: none timed: the pick and its cheapest rival would take about \
                 {first:.1} s, more than the {:.1} s memory.trial_share = {} gives them of the \
                 run's {:.0} s of steps (predicted)",
                a.total_s,
                self.config.memory.trial_share,
                a.run_s()
            )));
            return Ok(None);
        }
        Ok(Some(a))
    }

    /// `v` averaged over the ranks of a data-parallel run (every rank then decides alike);
    /// one process's as it is.
    fn agreed(&self, mut v: Vec<f64>) -> Result<Vec<f64>> {
        if let Some(g) = self.group().cloned() {
            g.sum_host(&mut v)?;
            let world = g.world() as f64;
            v.iter_mut().for_each(|x| *x /= world);
        }
        Ok(v)
    }

    /// Each contender loaded (the pick is loaded already) and timed, while `allowance`
    /// holds (a rival past it is not timed, with the reason; after the pick's steps the
    /// allowance counts its measured step): a rival whose load or steps fail is left out
    /// with the reason (ranks of a data-parallel run agree on a failed load, and leave that
    /// rival out together; a failure in their steps, where they sum gradients, ends the
    /// run); the pick's failure or an interruption ends it too. `None` where the pick's steps
    /// met a non-finite loss (nothing more is timed).
    fn time_contenders(
        &mut self,
        contenders: &[Planned],
        steps: usize,
        mut allowance: Allowance,
        on: &mut dyn FnMut(Event),
    ) -> Result<Option<Vec<Trial>>> {
        let mut trials = vec![];
        for (i, c) in contenders.iter().enumerate() {
            // A load counted wherever any rank loads (a rank whose load of the rival before
            // failed loads where the others may not).
            let reloads = i > 0 && (self.released || !same_weights(&self.load.memory, &c.plan));
            let reloads = i > 0 && self.agreed(vec![f64::from(u8::from(reloads))])?[0] > 0.0;
            if let Some(why) = (i > 0).then(|| allowance.refuse(i, reloads)).flatten() {
                let t = Trial {
                    plan: c.plan.clone(),
                    predicted: c.slowdown,
                    steps_ms: vec![],
                    failed: Some(why),
                };
                on(Event::Note(format!("timing plans: {}", t.describe())));
                trials.push(t);
                continue;
            }
            let t0 = std::time::Instant::now();
            let load = match i {
                0 => Ok(false),
                _ => self.reload(&c.plan),
            };
            let load_s = t0.elapsed().as_secs_f64();
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
            let spent = self.agreed(vec![
                t0.elapsed().as_secs_f64(),
                load_s,
                t.median_ms().unwrap_or(0.0),
            ])?;
            allowance.spent(spent[0], spent[1], reloads);
            if i == 0 && t.median_ms().is_some() {
                allowance.measured(spent[2] / 1e3);
            }
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

/// What timing plans may take of a run, seconds (`memory.trial_share`), and what it took.
#[derive(Clone, Debug, PartialEq)]
struct Allowance {
    /// The share of the run's training time timing plans may take.
    share: f64,
    /// The run's steps left.
    run_steps: usize,
    /// The steps timed of each plan, one untimed before them.
    trial_steps: usize,
    /// The pick's step, s: predicted, then measured.
    step_s: f64,
    /// Each contender's predicted step over the resident one, the pick's first: a rival's
    /// step is the pick's scaled by their predictions.
    slowdowns: Vec<f64>,
    /// What timing plans may take, s.
    total_s: f64,
    /// What it took so far, s.
    spent_s: f64,
    /// A load's cost, s: the longest seen.
    load_s: f64,
    /// Whether a rival was loaded (the kept plan may then need a load of its own).
    reloaded: bool,
}

impl Allowance {
    fn new(
        share: f64,
        run_steps: usize,
        trial_steps: usize,
        slowdowns: Vec<f64>,
        step_s: f64,
    ) -> Self {
        let mut a = Allowance {
            share,
            run_steps,
            trial_steps,
            step_s: 0.0,
            slowdowns,
            total_s: 0.0,
            spent_s: 0.0,
            load_s: 0.0,
            reloaded: false,
        };
        a.measured(step_s);
        a
    }

    /// The run's steps at the pick's step, s.
    fn run_s(&self) -> f64 {
        self.run_steps as f64 * self.step_s
    }

    /// The pick's step is now `step_s` (measured): the run's time and the allowance follow.
    fn measured(&mut self, step_s: f64) {
        self.step_s = step_s;
        self.total_s = self.share * self.run_s();
    }

    /// Timing contender `i`'s steps, s (the untimed one included): NaN where a prediction
    /// is not a positive number (nothing fits then).
    fn steps_s(&self, i: usize) -> f64 {
        let (pick, c) = (self.slowdowns[0], self.slowdowns[i]);
        match pick > 0.0 && c > 0.0 {
            true => (self.trial_steps + 1) as f64 * self.step_s * c / pick,
            false => f64::NAN,
        }
    }

    /// Timing contender `i` and, where `reloads` (or a rival was loaded before), the kept
    /// plan's load after, s.
    fn cost(&self, i: usize, reloads: bool) -> f64 {
        let loads = u8::from(reloads) + u8::from(reloads || self.reloaded);
        self.steps_s(i) + f64::from(loads) * self.load_s
    }

    /// Whether `cost` more, s, stays within the allowance (not where it is not a number).
    fn fits(&self, cost: f64) -> bool {
        use std::cmp::Ordering::{Equal, Less};
        matches!(
            (self.spent_s + cost).partial_cmp(&self.total_s),
            Some(Less | Equal)
        )
    }

    /// Why contender `i` is not timed: it would pass the allowance (or its cost is not a
    /// number).
    fn refuse(&self, i: usize, reloads: bool) -> Option<String> {
        let cost = self.cost(i, reloads);
        (!self.fits(cost)).then(|| {
            format!(
                "about {cost:.1} s more{} would pass the {:.1} s memory.trial_share = {} gives \
                 timing plans of the run's {:.0} s of steps ({:.1} s taken)",
                if reloads { " with its load" } else { "" },
                self.total_s,
                self.share,
                self.run_s(),
                self.spent_s
            )
        })
    }

    /// A plan was timed: its load and steps took `took_s`, its load `load_s` (where it
    /// `reloaded`).
    fn spent(&mut self, took_s: f64, load_s: f64, reloaded: bool) {
        self.spent_s += took_s;
        if reloaded {
            self.reloaded = true;
            self.load_s = self.load_s.max(load_s);
        }
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
    fn the_allowance_is_a_share_of_the_run_and_counts_loads() {
        // 1000 steps of 0.2 s, 5%: 10 s for timing plans; 5 steps timed after one untimed.
        // The pick predicted at 1.2x the resident step, the rival at 1.5x.
        let mut a = Allowance::new(0.05, 1000, 5, vec![1.2, 1.5, 0.0, f64::NAN], 0.2);
        a.load_s = 2.0;
        assert!((a.total_s - 10.0).abs() < 1e-9);
        // A rival predicted at 1.5x the pick's 1.2x: its steps at 0.25 s.
        let rival = 1;
        assert!((a.steps_s(rival) - 1.5).abs() < 1e-9);
        // On the loaded weights, its steps alone; loading, its load and the kept plan's.
        assert!((a.cost(rival, false) - 1.5).abs() < 1e-9);
        assert!((a.cost(rival, true) - 5.5).abs() < 1e-9);
        assert_eq!(a.refuse(rival, true), None);
        // The pick's steps taken (1.2 s) and a measured step of 0.1 s: 5 s in all now.
        a.spent(1.2, 0.0, false);
        a.measured(0.1);
        assert!((a.total_s - 5.0).abs() < 1e-9);
        // 1.2 + 0.75 + 2 loads of 2 s passes 5 s; on the loaded weights it fits.
        let why = a.refuse(rival, true).unwrap();
        assert!(
            why.contains("with its load") && why.contains("5.0 s"),
            "{why}"
        );
        assert_eq!(a.refuse(rival, false), None);
        // A rival loaded, slower than thought: loads count at the longest seen, and the
        // kept plan's load stays counted for a rival on the loaded weights.
        a.spent(1.0, 3.0, true);
        assert_eq!(a.load_s, 3.0);
        assert!((a.cost(rival, false) - (0.75 + 3.0)).abs() < 1e-9);
        assert!(a.refuse(rival, false).is_some());
        // Nothing at a share of 0, nor where a prediction is not a positive number.
        let none = Allowance::new(0.0, 1000, 5, vec![1.2, 1.5], 0.2);
        assert!(none.refuse(rival, false).is_some());
        let lots = Allowance::new(1e9, 1000, 5, vec![1.2, 1.5, 0.0, f64::NAN], 0.2);
        assert_eq!(lots.refuse(1, true), None);
        assert!(lots.refuse(2, false).is_some() && lots.refuse(3, false).is_some());
    }

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
