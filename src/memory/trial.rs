//! Plans timed on the machine. The time model ranks the plans that fit a budget by their
//! predicted steps; across some kinds of plan it can rank them wrongly on a given host, because what paces a step there (the host's issue of small kernels,
//! the GPU, the link) is what it models least surely (docs/PERFORMANCE.md, "SDXL: where the
//! time model misses": within 8 GiB on one H200 the pick, resident blocks beside 53 streamed
//! ones, ran 1.23x / 1.34x of the resident step's means / medians, where a plan of another
//! kind the model put 15% behind it ran 1.08x / 1.20x). So a run may time the model's pick
//! beside the planner's choice among each other kind of plan predicted near it
//! ([`MemoryProfile::rivals`]), a few steps each on its own data, and keep the fastest
//! measured ([`fastest`]).

use super::plan::{MemoryProfile, Plan, Planned, Weighed};
use super::Checkpointing;

/// What sets plans apart where the time model ranks them least surely (docs/PERFORMANCE.md,
/// "SDXL: where the time model misses"): whether blocks that keep their activations run
/// beside streamed ones (the mixed plans' backward measured 1.45-2.1x of the model's, the
/// others' 0.90-1.71x), and whether the re-runs are issued ahead on a second thread (the
/// model's cost of issuing on two threads, `cost_model::AHEAD_ISSUE`, was fitted on one
/// host; on a faster one the re-runs in turn ran ahead of them where the model put them
/// behind).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PlanKind {
    /// Blocks keeping their activations run beside streamed ones
    /// (`MemoryProfile::saves_activations` with blocks streamed).
    pub mixes: bool,
    /// Checkpointed blocks' re-runs are issued ahead (`Plan::rerun_ahead`, where something
    /// re-runs).
    pub rerun_ahead: bool,
}

impl PlanKind {
    /// The kind of `plan` under `profile`.
    pub fn of(profile: &MemoryProfile, plan: &Plan) -> PlanKind {
        let reruns = plan.checkpointing != Checkpointing::Off || !plan.streamed.is_empty();
        PlanKind {
            mixes: profile.saves_activations(plan) && !plan.streamed.is_empty(),
            rerun_ahead: plan.rerun_ahead && reruns,
        }
    }
}

/// The rivals timed beside the pick are predicted within this fraction of its step. The
/// model's step for a kind of plan measured 0.90-2.1x of what it played on the H200's hosts
/// (docs/PERFORMANCE.md, "SDXL: where the time model misses"); the plan that beat the pick
/// within 8 GiB there was predicted 15% behind it.
pub const RIVAL_SLACK: f64 = 0.25;

/// Another plan's median step must be this much shorter than the pick's for a trial to
/// take it over the pick: two steps' medians of one plan in one process differed by up to 2%
/// (H200, SDXL within 4 GiB, five rounds).
pub const TRIAL_MARGIN: f64 = 0.02;

impl MemoryProfile {
    /// The plans to time beside `pick` (the planner's choice among `candidates` within
    /// `budget` and `host_room`: [`MemoryProfile::plan_within`]): for each kind of plan
    /// ([`PlanKind`], at most three besides the pick's) other than the pick's, the one the
    /// planner would choose among that kind's candidates, where its predicted step is within
    /// [`RIVAL_SLACK`] of the pick's; at most `most`, the fastest predicted first. Each is settled
    /// ([`MemoryProfile::settle`]).
    pub fn rivals(
        &self,
        budget: u64,
        host_room: Option<u64>,
        candidates: &[Weighed],
        pick: &Plan,
        most: usize,
    ) -> Vec<Planned> {
        let own = PlanKind::of(self, pick);
        let limit = (self.step_ms(pick) / self.resident_ms()) * (1.0 + RIVAL_SLACK);
        // Each candidate's kind on the host's cores (a pass over its blocks each).
        let of: Vec<PlanKind> = {
            use rayon::prelude::*;
            candidates
                .par_iter()
                .map(|c| PlanKind::of(self, &c.plan))
                .collect()
        };
        let mut kinds: std::collections::BTreeMap<PlanKind, Vec<&Weighed>> = Default::default();
        for (c, kind) in candidates.iter().zip(of) {
            if kind != own {
                kinds.entry(kind).or_default().push(c);
            }
        }
        let mut rivals: Vec<Planned> = kinds
            .into_values()
            .filter_map(|of_kind| self.plan_within(budget, host_room, of_kind).ok())
            .filter(|p| p.slowdown <= limit)
            .collect();
        rivals.sort_by(|a, b| a.slowdown.total_cmp(&b.slowdown));
        rivals.truncate(most);
        // (A candidate's plan always settles; one that did not would be left out.)
        rivals
            .into_iter()
            .filter_map(|p| {
                Some(Planned {
                    plan: self.settle(&p.plan).ok()?,
                    ..p
                })
            })
            .collect()
    }
}

/// One plan's timed steps in a trial.
#[derive(Clone, Debug, PartialEq)]
pub struct Trial {
    /// The plan.
    pub plan: Plan,
    /// The time model's step under it over the resident step's.
    pub predicted: f64,
    /// Its timed steps, ms (after a first one left untimed).
    pub steps_ms: Vec<f64>,
    /// Why it could not be timed (its load or a step failed), if so.
    pub failed: Option<String>,
}

impl Trial {
    /// The median of the timed steps (the mean of the middle two of an even count); `None`
    /// with none timed or where it failed.
    pub fn median_ms(&self) -> Option<f64> {
        match self.failed {
            Some(_) => None,
            None => median(&self.steps_ms),
        }
    }

    /// One line: the plan, its prediction and its median step (or why it has none).
    pub fn describe(&self) -> String {
        let measured = match (&self.failed, self.median_ms()) {
            (Some(why), _) => format!("not timed: {why}"),
            (None, Some(ms)) => format!(
                "{ms:.1} ms a step (median of {}: {})",
                self.steps_ms.len(),
                self.steps_ms
                    .iter()
                    .map(|s| format!("{s:.1}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            (None, None) => "no step timed".into(),
        };
        format!(
            "{} (predicted {:.2}x the resident step): {measured}",
            self.plan, self.predicted
        )
    }
}

/// The median of `v` (the mean of the middle two of an even count); `None` when empty or any
/// value is not finite.
pub fn median(v: &[f64]) -> Option<f64> {
    if v.is_empty() || v.iter().any(|x| !x.is_finite()) {
        return None;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let n = s.len();
    Some(match n % 2 {
        1 => s[n / 2],
        _ => (s[n / 2 - 1] + s[n / 2]) / 2.0,
    })
}

/// Which of the trials whose median steps are `medians` (`Trial::median_ms`, or the ranks'
/// sums of them) to keep: the first (the model's pick) unless another's median is shorter
/// than its by more than [`TRIAL_MARGIN`], then the one with the shortest. A trial without a
/// median (failed, or none timed) is never taken over the first; where the first has none,
/// the shortest of the others. `None` where no trial has a median.
pub fn fastest(medians: &[Option<f64>]) -> Option<usize> {
    let (best, best_ms) = medians
        .iter()
        .enumerate()
        .filter_map(|(i, m)| m.filter(|m| m.is_finite()).map(|m| (i, m)))
        .min_by(|a, b| a.1.total_cmp(&b.1).then(a.0.cmp(&b.0)))?;
    match medians.first().copied().flatten() {
        Some(first) if best_ms >= first * (1.0 - TRIAL_MARGIN) => Some(0),
        _ => Some(best),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn trial(steps: &[f64], failed: bool) -> Trial {
        Trial {
            plan: Plan::default(),
            predicted: 1.0,
            steps_ms: steps.to_vec(),
            failed: failed.then(|| "out of memory".to_string()),
        }
    }

    #[test]
    fn medians() {
        assert_eq!(median(&[]), None);
        assert_eq!(median(&[3.0]), Some(3.0));
        assert_eq!(median(&[5.0, 1.0, 3.0]), Some(3.0));
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), Some(2.5));
        assert_eq!(median(&[1.0, f64::NAN]), None);
    }

    /// `fastest` over the trials' medians.
    fn fastest_of(t: &[Trial]) -> Option<usize> {
        fastest(&t.iter().map(Trial::median_ms).collect::<Vec<_>>())
    }

    #[test]
    fn the_pick_stays_unless_another_is_clearly_faster() {
        // 1.5% faster: within the margin, the pick stays.
        let t = [trial(&[100.0, 101.0, 99.0], false), trial(&[98.5], false)];
        assert_eq!(fastest_of(&t), Some(0));
        // 10% faster: taken; of two faster, the fastest.
        let t = [
            trial(&[100.0, 100.0, 100.0], false),
            trial(&[90.0, 91.0, 89.0], false),
            trial(&[85.0, 200.0, 84.0], false),
        ];
        assert_eq!(fastest_of(&t), Some(2));
        // A failed rival is never taken, however fast its steps were.
        let t = [trial(&[100.0], false), trial(&[50.0], true)];
        assert_eq!(fastest_of(&t), Some(0));
        // A failed pick: the fastest rival timed.
        let t = [
            trial(&[], true),
            trial(&[120.0], false),
            trial(&[110.0], false),
        ];
        assert_eq!(fastest_of(&t), Some(2));
        // Nothing timed.
        assert_eq!(fastest_of(&[trial(&[], true), trial(&[], false)]), None);
        assert_eq!(fastest_of(&[]), None);
    }
}
