//! The training run's memory plan: from `[memory]` and the model's profile to the plan the
//! model loads with, the predicted peak, the allocator cap, and the advice an out-of-memory
//! error carries.

use super::config::{OptimizerKind, TrainConfig};
use super::images::{decode_bytes, decode_tile_within};
use super::text::TextStepBytes;
pub use crate::memory::{split_budget, LATE_HEADROOM};
use crate::memory::{spread_evenly, MemoryProfile, NoPlan, Plan, Planned, Switches};
use crate::models::{Family, LoadOptions, RunShape};
use crate::{DType, Device, Error, Result};

const GIB: f64 = (1u64 << 30) as f64;

/// The plans of other kinds `memory.trial_steps` times beside the planner's pick, at most
/// (`MemoryProfile::rivals`): each that holds other weights than the loaded model costs the
/// run a load of the model.
pub const TRIAL_RIVALS: usize = 3;

fn gib(b: u64) -> f64 {
    b as f64 / GIB
}

/// Why no plan fits where plans fit the device's budget but not the host's memory
/// (`NoPlan::host`: the least host memory they need, the room there is, bytes), with
/// `more` advice after "free host memory, raise the budget".
fn host_short((least, room): (u64, u64), more: &str) -> String {
    format!(
        "the plans that fit it hold at least {:.2} GiB of host memory (the streamed weights' \
         pinned copies and the offloaded inputs), and {:.2} GiB is free for them (the \
         system's available memory, within its memory cgroup's limit, less an eighth and 2 \
         GiB, shared among this machine's ranks): free host memory or raise the budget{more}",
        gib(least),
        gib(room)
    )
}

/// A plan's host memory at its most (`MemoryProfile::host_bytes`) and the room there was for
/// it, for the plan's summary.
fn host_line(bytes: u64, room: Option<u64>) -> String {
    match room {
        Some(r) => format!(
            "{:.1} GiB of host memory at most, of {:.1} free for it",
            gib(bytes),
            gib(r)
        ),
        None => format!("{:.1} GiB of host memory at most", gib(bytes)),
    }
}

/// This process's share of the host memory plans may hold (`memory::host_room`), among the
/// ranks of the run on this machine (`dist::Launch::local_world`; `world` where the launch
/// environment cannot be read).
fn host_share(world: usize) -> Option<u64> {
    let local = if world > 1 {
        crate::dist::Launch::from_env()
            .ok()
            .flatten()
            .map_or(world, |l| l.local_world)
    } else {
        1
    };
    crate::memory::host_room(local)
}
/// The plan a run uses and what it predicts.
#[derive(Clone, Debug)]
pub struct MemoryChoice {
    /// What the model loads with (settled for it: `MemoryProfile::settle`).
    pub plan: Plan,
    /// The plan in words.
    pub summary: String,
    /// The budget in bytes for FLAME's allocator (its cap on a GPU), if any.
    pub budget: Option<u64>,
    /// On a GPU: the bytes of the budget held outside the allocator (the CUDA context,
    /// kernels, library workspaces, measured at start, and [`LATE_HEADROOM`]); the budget
    /// as the driver counts it is `budget` plus this.
    pub outside: Option<u64>,
    /// The predicted peak of a step, when the model's profile was worked out.
    pub predicted_peak: Option<u64>,
    /// What to change if a step runs out of memory anyway.
    pub hint: String,
    /// The model's profile for the run's largest sample and the plan chosen from it, when
    /// the plan was worked out (the other phases' predictions start from them).
    pub sized: Option<(MemoryProfile, Plan)>,
    /// The machine the time model played to choose the plan, when it chose one (the run
    /// records it: a resume plans with it).
    pub machine: Option<crate::memory::Machine>,
    /// What the trained text encoders hold in a step (`adapter.text_encoders`), counted in
    /// the profile and the predicted peak.
    pub text: Option<TextStepBytes>,
    /// The plans of other kinds the time model predicts near the chosen one, each settled,
    /// fastest predicted first (`MemoryProfile::rivals`): what `memory.trial_steps` times
    /// beside it. Empty where the planner did not choose.
    pub rivals: Vec<Planned>,
}

impl MemoryChoice {
    /// One line for the run's summary and `--plan`.
    pub fn describe(&self) -> String {
        let mut s = format!("memory: {}", self.summary);
        if let Some(p) = self.predicted_peak {
            s += &format!(", predicted peak {:.2} GiB", gib(p));
        }
        if let Some(t) = &self.text {
            s += &format!(", {}", t.describe());
        }
        match (self.budget, self.outside) {
            (Some(b), Some(o)) => {
                s += &format!(
                    " (budget {:.2} GiB on the device as the driver counts it: {:.2} for \
                     FLAME's allocator, {:.2} for the CUDA context, kernels and workspaces)",
                    gib(b + o),
                    gib(b),
                    gib(o)
                )
            }
            (Some(b), None) => s += &format!(" (budget {:.2} GiB)", gib(b)),
            (None, _) => s += " (no budget)",
        }
        s
    }

    /// The plans of other kinds predicted near the chosen one (`rivals`), in one line for
    /// `--plan`, saying whether `trial_steps` (`memory.trial_steps`) times them; without
    /// rivals, why nothing is timed where the planner chose the plan and `trial_steps` asks
    /// for timing, else `None`.
    pub fn rivals_line(&self, trial_steps: usize) -> Option<String> {
        if self.rivals.is_empty() {
            return (trial_steps > 0)
                .then(|| self.no_rival())
                .flatten()
                .map(|why| format!("nothing timed before the first step: {why}"));
        }
        let list: Vec<String> = self
            .rivals
            .iter()
            .map(|r| format!("{} (predicted {:.2}x)", r.plan, r.slowdown))
            .collect();
        Some(match trial_steps {
            0 => format!(
                "plans of other kinds predicted near it (memory.trial_steps > 0 times them \
                 beside it before the first step): {}",
                list.join("; ")
            ),
            n => format!(
                "before the first step, {n} steps each of it and of these, as many as fit in \
                 memory.trial_share of the run's time: {}; the fastest is kept",
                list.join("; ")
            ),
        })
    }

    /// Why the planner's pick has no rival to time, where the planner chose the plan and
    /// found none: "no other kind of plan is predicted within 25% of the pick's step (N.NNx
    /// the resident one)" (`memory::RIVAL_SLACK`).
    pub fn no_rival(&self) -> Option<String> {
        let (prof, plan) = self.sized.as_ref()?;
        (self.rivals.is_empty() && self.machine.is_some()).then(|| {
            format!(
                "no other kind of plan is predicted within {:.0}% of the pick's step ({:.2}x \
                 the resident one)",
                crate::memory::RIVAL_SLACK * 1e2,
                prof.step_ms(plan) / prof.resident_ms()
            )
        })
    }

    /// The step's predicted peak by its terms (`MemoryProfile::peak_parts`: weights, the
    /// staging ring, adapters, optimizer state, what the blocks hold, the largest re-run,
    /// fixed), when the plan was worked out from the model's profile.
    pub fn peak_terms(&self) -> Option<crate::memory::PeakParts> {
        let (prof, plan) = self.sized.as_ref()?;
        let parts = prof.peak_parts(plan);
        // Only the terms of the peak said: a peak worked out another way has none.
        (Some(parts.total()) == self.predicted_peak).then_some(parts)
    }

    /// `e` with the plan and the advice attached when it is an out-of-memory error.
    pub fn explain(&self, e: Error) -> Error {
        match e {
            Error::OutOfMemory { .. } => Error::PlanExceeded {
                error: Box::new(e),
                plan: self.describe(),
                hint: self.hint.clone(),
            },
            e => e,
        }
    }
}

/// State bytes per trainable value beyond the value and its gradient: AdamW's two f32
/// moments, or AdamW8bit's two 8-bit codes plus an f32 absmax per 256-value block for each
/// moment; with several ranks (`world` > 1), the data-parallel reducer's bucket buffers too,
/// which hold a flat f32 copy of every gradient while its sum is in flight
/// ([`crate::dist::GradReducer`]).
fn optimizer_bytes(kind: OptimizerKind, world: usize) -> f64 {
    let buckets = if world > 1 { 4.0 } else { 0.0 };
    buckets + kind.state_bytes_per_value()
}

/// Bytes per trainable value of the moving average of the weights (`[ema]`): its f32 copy
/// where it is kept on the training device, none in host memory or without one.
fn ema_bytes(config: &TrainConfig) -> f64 {
    match (config.ema.enabled, config.ema.device) {
        (true, crate::train::config::EmaDevice::Gpu) => 4.0,
        _ => 0.0,
    }
}

/// The bytes per trainable value of the optimizer's state and the moving average.
pub(crate) fn state_bytes_per_value(config: &TrainConfig, world: usize) -> f64 {
    optimizer_bytes(config.optimizer.kind, world) + ema_bytes(config)
}

/// The profile of this run's model (reads the checkpoint's header only), with what the
/// trained text encoders hold in a step (`text`) counted beside it.
fn profile(
    config: &TrainConfig,
    family: &Family,
    opts: &LoadOptions,
    sample: &[Vec<usize>],
    world: usize,
    text: Option<&TextStepBytes>,
) -> Result<MemoryProfile> {
    let mut prof = profile_model(config, family, opts, sample, world)?;
    if let Some(t) = text {
        t.add_to(&mut prof);
    }
    Ok(prof)
}

/// The model's profile alone.
fn profile_model(
    config: &TrainConfig,
    family: &Family,
    opts: &LoadOptions,
    sample: &[Vec<usize>],
    world: usize,
) -> Result<MemoryProfile> {
    family.profile(
        &config.model.path,
        opts,
        &RunShape {
            sample: sample.to_vec(),
            batch: config.train.batch_size,
            optimizer_bytes_per_value: state_bytes_per_value(config, world),
        },
    )
}

/// The plan for denoising with `family`'s model at `path` (`opts`: dtype, FP8, no adapters)
/// within a budget of `budget_gb` GiB on `device`, for inputs of `sample` shapes (one
/// sample, `DiffusionModel::inputs` order): the fastest plan for forwards without gradients
/// (`MemoryProfile::plan_forward_within`: streamed blocks only, as few as fit), planned
/// within the budget's share less what FLAME's buffers hold at the call (on a GPU: the autoencoder, the prompts'
/// conditioning, references), which stays through the denoising. The allocator is capped
/// at the budget's share (see [`split_budget`]) when a GPU has a budget; of `switches`,
/// whether the machine is measured and whether products may be computed on the host apply
/// (a forward plan has no checkpointing, coding or offloading to switch). Without a budget
/// (`budget_gb` 0) on a GPU, every block stays resident where that fits the memory free at
/// start ([`crate::memory::split_at_start`]), else the plan is worked out within it (the
/// allocator is capped already: `memory::hold_to_budget`).
/// Errors name `key`.
#[allow(clippy::too_many_arguments)]
pub fn plan_denoising(
    family: &Family,
    path: &std::path::Path,
    opts: &LoadOptions,
    device: &Device,
    budget_gb: f64,
    sample: &[Vec<usize>],
    key: &str,
    switches: &Switches,
) -> Result<MemoryChoice> {
    let given = budget_gb > 0.0;
    let (cap, outside) = match given {
        true => split_budget(device, budget_gb)?,
        false => crate::memory::split_at_start(device)?,
    };
    let resident = |summary: String| MemoryChoice {
        plan: Plan::default(),
        summary,
        budget: None,
        outside: None,
        predicted_peak: None,
        hint: format!("set {key}"),
        sized: None,
        machine: None,
        text: None,
        rivals: vec![],
    };
    let Some(cap) = cap else {
        return Ok(resident("every block resident (no budget)".into()));
    };
    let prof = family.profile(
        path,
        opts,
        &RunShape {
            sample: sample.to_vec(),
            batch: 1,
            optimizer_bytes_per_value: 0.0,
        },
    )?;
    // What lives now and through the denoising, and a LoRA merge's room while the model
    // loads (`LoraMerge::merge_bytes`: its copies are freed before the denoising, but the
    // weights it changes are on the device beside them).
    let in_use = crate::memory::allocator_in_use(device);
    let merge_room = opts.merge.as_ref().map_or(0, |m| m.merge_bytes());
    let held = in_use + merge_room;
    let free_at_start = gib(cap + outside.unwrap_or(0));
    // Without a budget, every block resident where a forward of two samples at once fits
    // (guidance's predictions batched: the resident choice batches them), without measuring
    // the machine.
    if !given {
        let two = family.profile(
            path,
            opts,
            &RunShape {
                sample: sample.to_vec(),
                batch: 2,
                optimizer_bytes_per_value: 0.0,
            },
        )?;
        if two.forward_peak(&two.forward_plan(0, 1, false)) + held <= cap {
            return Ok(resident(format!(
                "every block resident (within the {free_at_start:.2} GiB free at start)"
            )));
        }
    }
    let mut prof = prof;
    if let (Some(m), _) = machine_for(device, switches.measure_machine) {
        prof.machine = m;
    }
    let named = match given {
        true => format!("{key} {budget_gb:.2}"),
        false => format!("the {free_at_start:.2} GiB of the GPU free at start (no {key} given)"),
    };
    let host = host_share(1);
    // A forward without gradients: only the streamed blocks matter (`memory::forward`).
    let p = prof
        .plan_forward_within(cap.saturating_sub(held), host, switches.host_products)
        .map_err(|no| Error::Config {
            path: None,
            msg: match no.host {
                Some(host) => format!(
                    "{named}: {}",
                    host_short(
                        host,
                        if opts.fp8 {
                            ""
                        } else {
                            ", or take FP8 weights (--dtype fp8)"
                        }
                    )
                ),
                None => format!(
                    "{named}: no plan fits; the smallest (every block streamed from host \
                     memory) needs {:.2} GiB for a forward with the CUDA context, kernels and \
                     workspaces, the autoencoder and the prompts{}{}",
                    gib(no.minimum + outside.unwrap_or(0) + held),
                    match &opts.merge {
                        Some(m) => format!(
                            ", {:.2} GiB of it to merge the LoRA as the model loads",
                            gib(m.merge_bytes())
                        ),
                        None => String::new(),
                    },
                    if opts.fp8 {
                        ""
                    } else {
                        "; FP8 weights (--dtype fp8) need less"
                    }
                ),
            },
        })?;
    #[cfg(feature = "cuda")]
    #[allow(irrefutable_let_patterns)]
    if let (Device::Cuda(c), true) = (device, given) {
        c.set_memory_limit(Some(cap));
    }
    let plan = prof.settle(&p.plan)?;
    Ok(MemoryChoice {
        plan: plan.clone(),
        summary: format!(
            "{}, for forwards without gradients ({:.1} GiB streamed a forward, predicted \
             {:.2}x of the resident forward, {}; its peak: {}, beside what lives now {:.2} \
             GiB{}){}",
            prof.describe_forward(&p.plan),
            gib(p.streamed_bytes),
            p.slowdown,
            host_line(prof.host_bytes(&p.plan), host),
            prof.forward_peak_parts(&p.plan),
            gib(in_use),
            match merge_room {
                0 => String::new(),
                m => format!(" and the LoRA merge's room {:.2} GiB", gib(m)),
            },
            match given {
                true => String::new(),
                false => format!(
                    ", planned within the {free_at_start:.2} GiB free at start: every block \
                     resident does not fit"
                ),
            }
        ),
        budget: Some(cap),
        outside,
        predicted_peak: Some(p.peak + held),
        hint: match given {
            true => format!("lower the image size or raise {key}"),
            false => format!("lower the image size, or set {key} below the free memory"),
        },
        machine: Some(prof.machine),
        text: None,
        rivals: vec![],
        sized: Some((prof, plan)),
    })
}

/// Whether `batch` samples of `sample` shapes at once fit `choice`'s budget under its plan
/// (`choice` from [`plan_denoising`] for one sample): the forward's peak for that batch
/// (`MemoryProfile::forward_peak`) beside what lived when it was planned (its predicted
/// peak less its profile's). Without a budget or a worked-out plan: true.
pub fn batch_fits(
    family: &Family,
    path: &std::path::Path,
    opts: &LoadOptions,
    choice: &MemoryChoice,
    sample: &[Vec<usize>],
    batch: usize,
) -> Result<bool> {
    let (Some(cap), Some((one, plan))) = (choice.budget, &choice.sized) else {
        return Ok(true);
    };
    // (A LoRA's merge is over by the denoising: its room is not held beside the batch.)
    let merge = opts.merge.as_ref().map_or(0, |m| m.merge_bytes());
    let held = choice
        .predicted_peak
        .map_or(0, |p| p.saturating_sub(one.forward_peak(plan) + merge));
    // A plan that streams keeps its margin (`memory::MARGIN_DIVISOR`), as it was planned.
    let cap = match plan.streamed.is_empty() {
        true => cap,
        false => cap - cap.saturating_sub(held) / crate::memory::MARGIN_DIVISOR,
    };
    let prof = family.profile(
        path,
        opts,
        &RunShape {
            sample: sample.to_vec(),
            batch,
            optimizer_bytes_per_value: 0.0,
        },
    )?;
    Ok(prof.forward_peak(plan) + held <= cap)
}

/// Picks (or takes from the config) the memory plan, caps the allocator at the budget, and
/// refuses a budget no plan fits before any weight is loaded. `world`: the ranks of a
/// data-parallel run (each plans for its own device, with the reducer's buffers).
/// The machine the planner's time model plays on `device`: measured (or read from the cache,
/// `memory::measure_machine`) when `measure` is on, else `None` (the reference machine). A
/// measurement that fails (a GPU without room for the probe's buffers) leaves the reference
/// machine too, with the reason: the plan is still sound, only its ranking less exact.
fn machine_for(device: &Device, measure: bool) -> (Option<crate::memory::Machine>, Option<String>) {
    if !measure {
        return (None, None);
    }
    match crate::memory::measure_machine(device) {
        Ok(m) => (m.map(|m| m.machine), None),
        Err(e) => (None, Some(e.to_string())),
    }
}

/// `split`: the budget as `memory::hold_to_budget` split it (and capped the allocator at it)
/// before caching; `recorded`: the machine to play instead of this one's (a resumed run's).
#[allow(clippy::too_many_arguments)]
pub(crate) fn plan_memory(
    config: &TrainConfig,
    family: &Family,
    opts: &LoadOptions,
    device: &Device,
    sample: &[Vec<usize>],
    world: usize,
    split: (Option<u64>, Option<u64>),
    recorded: Option<crate::memory::Machine>,
    text: Option<&TextStepBytes>,
) -> Result<MemoryChoice> {
    let mem = &config.memory;
    let manual = config.checkpointing();
    let (budget, outside) = split;
    let choice = match (manual, budget) {
        (Some(checkpointing), _) => {
            let prof = profile(config, family, opts, sample, world, text)?;
            let prefixes: Vec<String> = prof.blocks.iter().map(|b| b.prefix.clone()).collect();
            if mem.stream_blocks > prefixes.len() {
                return Err(Error::Config {
                    path: None,
                    msg: format!(
                        "memory.stream_blocks = {}: {} has {} blocks",
                        mem.stream_blocks,
                        family.name,
                        prefixes.len()
                    ),
                });
            }
            let as_plan = Plan {
                checkpointing,
                streamed: spread_evenly(&prefixes, mem.stream_blocks),
                prefetch: mem.prefetch,
                keep: crate::autograd::Keep {
                    attention: mem.keep_attention,
                    down_projections: mem.keep_down_projections,
                    few_rows: true,
                },
                offload_inputs: mem.offload_inputs || mem.offload_kept,
                offload_kept: mem.offload_kept,
                wire_code: true,
                uncoded_carry: true,
                raw_backward: false,
                ahead_products: false,
                cross_ahead: true,
                deep_prefetch: true,
                host_products: true,
                remake_transposes: false,
                rerun_ahead: false,
                reach: vec![],
                uncoded_first: 0,
            };
            // The planner's switches bind a plan given by hand too.
            let plan = prof.settle(&config.planner.bind(as_plan))?;
            MemoryChoice {
                summary: format!("{plan} (as configured)"),
                predicted_peak: Some(prof.peak(&plan)),
                sized: Some((prof.clone(), plan.clone())),
                hint: "set memory.checkpointing = \"auto\" with memory.budget_gb to let the \
                       planner choose, or stream more blocks (memory.stream_blocks)"
                    .into(),
                plan,
                budget,
                outside,
                machine: None,
                text: text.cloned(),
                rivals: vec![],
            }
        }
        (None, None) => MemoryChoice {
            plan: Plan::default(),
            summary: "every block resident (no budget on this device)".into(),
            budget,
            outside,
            predicted_peak: None,
            hint: "set memory.budget_gb".into(),
            sized: None,
            machine: None,
            text: text.cloned(),
            rivals: vec![],
        },
        (None, Some(b)) => {
            let mut prof = profile(config, family, opts, sample, world, text)?;
            // The time model plays the machine a resumed run recorded, else this machine's
            // rates where the switch says so.
            let (machine, unmeasured) = match recorded {
                Some(m) => (Some(m), None),
                None => machine_for(device, config.planner.measure_machine),
            };
            if let Some(m) = machine {
                prof.machine = m;
            }
            let candidates = config.planner.weighed_candidates(&prof);
            let host = host_share(world);
            match prof.plan_within(b, host, candidates.iter().collect()) {
                Ok(p) => {
                    // The next plan down the list that the host holds too, for the
                    // out-of-memory advice.
                    let next = candidates
                        .iter()
                        .filter(|c| host.is_none_or(|room| c.host <= room))
                        .map(|c| (c.peak, &c.plan))
                        .find(|(peak, _)| *peak < p.peak);
                    let hint = match next {
                        Some((peak, c)) => format!(
                            "the next plan ({c}) predicts {:.2} GiB: lower memory.budget_gb to \
                             {:.1} to choose it",
                            gib(peak),
                            (gib(with_margin(peak) + outside.unwrap_or(0)) * 10.0).ceil() / 10.0
                        ),
                        None => fp8_hint(config, family, opts, sample, p.peak, world, text)?,
                    };
                    let plan = prof.settle(&p.plan)?;
                    let rivals = prof.rivals(b, host, &candidates, &p.plan, TRIAL_RIVALS);
                    MemoryChoice {
                        rivals,
                        plan: plan.clone(),
                        summary: format!(
                            "{} ({:.1} GiB streamed a step, {}; a step predicted at {:.2}x \
                             the resident one by the time model of {})",
                            p.plan,
                            gib(p.streamed_bytes),
                            host_line(prof.host_bytes(&p.plan), host),
                            p.slowdown,
                            match (machine, unmeasured) {
                                (Some(m), _) if recorded.is_some() => {
                                    format!("the machine the run recorded ({m})")
                                }
                                (Some(m), _) => format!("this machine ({m})"),
                                (None, Some(why)) => format!(
                                    "the reference machine (this one could not be measured: \
                                     {why})"
                                ),
                                (None, None) => "the reference machine".into(),
                            }
                        ),
                        budget,
                        outside,
                        predicted_peak: Some(p.peak),
                        hint,
                        sized: Some((prof.clone(), plan.clone())),
                        machine: Some(prof.machine),
                        text: text.cloned(),
                    }
                }
                Err(NoPlan {
                    host: Some(host), ..
                }) => {
                    return Err(Error::Config {
                        path: None,
                        msg: format!(
                            "memory.budget_gb = {:.2}: {}",
                            gib(b + outside.unwrap_or(0)),
                            host_short(
                                host,
                                if opts.fp8 {
                                    ""
                                } else {
                                    ", or take FP8 weights (model.dtype = \"fp8\")"
                                }
                            )
                        ),
                    })
                }
                Err(no) => {
                    return Err(Error::Config {
                        path: None,
                        msg: format!(
                            "memory.budget_gb = {:.2}: no plan fits; the smallest (every block \
                             checkpointed and streamed from host memory, prefetch 1) needs \
                             {:.2} GiB with the {:.2} GiB the process holds outside FLAME's \
                             allocator (CUDA context, kernels, workspaces, headroom). {}",
                            gib(no.budget + outside.unwrap_or(0)),
                            gib(no.minimum + outside.unwrap_or(0)),
                            gib(outside.unwrap_or(0)),
                            fp8_hint(config, family, opts, sample, no.minimum, world, text)?
                        ),
                    })
                }
            }
        }
    };
    Ok(choice)
}

/// A budget that takes a plan of predicted `peak` whatever its kind (mixed plans keep 1/32
/// of the budget spare).
fn with_margin(peak: u64) -> u64 {
    peak.saturating_add(peak / (crate::memory::MARGIN_DIVISOR - 1))
}

/// Advice past the last plan, whose budget is `minimum`: FP8 base weights when the run does
/// not use them and they lower that minimum, else a smaller batch or resolution.
fn fp8_hint(
    config: &TrainConfig,
    family: &Family,
    opts: &LoadOptions,
    sample: &[Vec<usize>],
    minimum: u64,
    world: usize,
    text: Option<&TextStepBytes>,
) -> Result<String> {
    let advice = "Lower train.batch_size or the resolution, or raise the budget.";
    if opts.fp8 {
        return Ok(advice.into());
    }
    let mut o = opts.clone();
    o.fp8 = true;
    let prof = profile(config, family, &o, sample, world, text)?;
    Ok(match prof.candidates().iter().map(|c| prof.peak(c)).min() {
        // Only where it helps: a model whose weights are not what fills the device gains
        // nothing from FP8.
        Some(b) if (b as f64) < 0.98 * minimum as f64 => format!(
            "model.dtype = \"fp8\" lowers that minimum to {:.2} GiB.",
            gib(b)
        ),
        _ => advice.into(),
    })
}

/// What one phase of a run does with memory, and the peak predicted for it in FLAME's
/// allocator.
#[derive(Clone, Debug, PartialEq)]
pub struct PhasePlan {
    /// The phase, as the run's summary names its measured peak ("caching", "training
    /// steps", "validation", "sample images", "checkpoints").
    pub phase: &'static str,
    /// How it runs.
    pub plan: String,
    /// The predicted peak in FLAME's allocator (an upper bound where the plan says "at
    /// most"), when it can be worked out.
    pub peak: Option<u64>,
}

impl PhasePlan {
    /// One line: the phase, its plan and its predicted peak.
    pub fn describe(&self) -> String {
        match self.peak {
            Some(p) => format!(
                "{}: {}; predicted peak {:.2} GiB",
                self.phase,
                self.plan,
                gib(p)
            ),
            None => format!("{}: {}", self.phase, self.plan),
        }
    }
}

/// How the autoencoder goes through an image in tiles of side `tile` (0: whole), in words.
fn tiling_words(tile: usize) -> String {
    match tile {
        0 => "whole images".into(),
        t => format!("in {t}-pixel tiles"),
    }
}

/// The tile the run's sample images decode in on `device`, images of `pixels` through an
/// autoencoder whose first stage is `width` wide in `dtype` (`images::decode_tile_within`: under
/// the default budget, the allocator's share of the memory free at start,
/// `images::phase_budget`, against what the run keeps between steps under `choice`'s plan
/// beside the decode).
pub(crate) fn sample_decode_tile(
    config: &TrainConfig,
    choice: &MemoryChoice,
    device: &Device,
    pixels: usize,
    width: usize,
    dtype: DType,
) -> Result<usize> {
    let keeps = choice
        .sized
        .as_ref()
        .map(|(prof, plan)| between_steps(prof, plan));
    let cap = super::images::allocator_share(config, device)?;
    Ok(decode_tile_within(
        config.encoders.vae_tile,
        config.memory.budget_gb > 0.0,
        cap.zip(keeps),
        decode_bytes(pixels, width, dtype),
    ))
}

/// Whether the run's sample images put classifier-free guidance's two predictions through
/// the model as one batch: not under a budget, whose plan leaves room for one at a time.
pub(crate) fn guidance_batched(config: &TrainConfig) -> bool {
    config.memory.budget_gb <= 0.0
}

/// What the run keeps on the device between its steps under `plan`: the weights not
/// streamed, the adapters and the optimizer state.
fn between_steps(prof: &MemoryProfile, plan: &Plan) -> u64 {
    let resident: u64 = prof
        .blocks
        .iter()
        .filter(|b| !plan.streamed.contains(&b.prefix))
        .map(|b| b.weight_bytes)
        .sum();
    prof.other_weight_bytes + resident + prof.trainable_bytes + prof.optimizer_bytes
}

/// Each phase's plan and predicted peak for a run of `config` with `choice` (the step's
/// plan), for `world` ranks: caching (the autoencoder's encode, whole or tiled, and the text
/// encoders), the training step, validation (forward only, under the step's plan: its
/// forward's peak, `MemoryProfile::forward_peak`, at most the step's), sample images (the
/// denoising forward at `sample.size` under the step's plan, its forward's peak at that
/// size, and the decode beside what the run keeps between steps: a forward without
/// gradients leaves no streamed block on the device) and checkpoints (written through host
/// memory). `largest` is the largest sample's input shapes, `vae` the autoencoder's
/// downsampling factor and first stage's width (image data only; `None` for pre-encoded
/// samples), `guided` whether the model takes a distilled guidance input (no
/// classifier-free guidance in its samples).
#[allow(clippy::too_many_arguments)]
pub(crate) fn phase_plans(
    config: &TrainConfig,
    family: &Family,
    opts: &LoadOptions,
    choice: &MemoryChoice,
    largest: &[Vec<usize>],
    vae: Option<(usize, usize)>,
    guided: bool,
    device: &Device,
    world: usize,
) -> Result<Vec<PhasePlan>> {
    use super::images::{
        choose_encode_tile, encode_bytes, encoder_dtype, pixels_at_once, text_encoder_bytes,
    };
    let dtype = encoder_dtype(config, device);
    let factor = vae.map(|(f, _)| f);
    let width = vae.map_or(0, |(_, w)| w);
    // The step's profile and plan (every block resident when no plan was worked out).
    let (prof, plan) = match &choice.sized {
        Some((p, plan)) => (p.clone(), plan.clone()),
        None => (
            profile(config, family, opts, largest, world, choice.text.as_ref())?,
            Plan::default(),
        ),
    };
    let step_peak = choice.predicted_peak.unwrap_or_else(|| prof.peak(&plan));
    let mut out = vec![];
    let latent_hw = largest
        .first()
        .filter(|d| d.len() == 3)
        .map(|d| (d[1], d[2]));
    match (factor, latent_hw) {
        (Some(f), Some((h, w))) => {
            let pixels = h * w * f * f;
            let cap = super::images::allocator_share(config, device)?;
            let tile = choose_encode_tile(config, cap, pixels, width, dtype);
            let encode = encode_bytes(pixels_at_once(pixels, tile), width, dtype);
            let budget = super::images::driver_budget(config, device)?;
            let (weights, streamed) = text_encoder_bytes(config, family, budget)?;
            // And a pass's captions, batched within what the weights leave of the
            // allocator's share (of the budget where the device has no allocator's cap).
            let room = cap
                .or(budget)
                .map_or(u64::MAX, |c| c.saturating_sub(weights));
            let text = weights + super::images::caption_work(room);
            out.push(PhasePlan {
                phase: "caching",
                plan: format!(
                    "the autoencoder encodes {} (about {:.2} GiB), then the text encoders run \
                     ({}about {:.2} GiB with a pass's captions, up to {} a pass), before the \
                     model loads{}",
                    tiling_words(tile),
                    gib(encode),
                    if streamed {
                        "the large encoder streamed from host memory, "
                    } else {
                        ""
                    },
                    gib(text),
                    super::images::MAX_CAPTION_BATCH,
                    if world > 1 {
                        "; each rank its share"
                    } else {
                        ""
                    }
                ),
                peak: Some(encode.max(text)),
            });
        }
        _ => out.push(PhasePlan {
            phase: "caching",
            plan: "none (pre-encoded samples)".into(),
            peak: None,
        }),
    }
    out.push(PhasePlan {
        phase: "training steps",
        plan: "the memory plan above".into(),
        peak: Some(step_peak),
    });
    // A forward without gradients under the step's plan: no block's activations held past
    // the block (`MemoryProfile::forward_peak`), and never more than the step at its shapes.
    out.push(PhasePlan {
        phase: "validation",
        plan: "forward only under the step's plan, micro-batches of at most train.batch_size"
            .into(),
        peak: Some(prof.forward_peak(&plan).min(step_peak)),
    });
    let sc = &config.sample;
    match (factor, sc.prompts.is_empty()) {
        (Some(f), false) => {
            let res = config.data.resolution;
            let (w, h) = match sc.size {
                [0, 0] => (res, res),
                [w, h] => (w, h),
            };
            let mut shape = largest.to_vec();
            if let Some(l) = shape.first_mut().filter(|l| l.len() == 3) {
                (l[1], l[2]) = (h / f, w / f);
            }
            // Classifier-free guidance's two predictions as one batch where the run does so.
            let cfg = !guided && sc.guidance > 1.0;
            let batch = if cfg && guidance_batched(config) {
                2
            } else {
                1
            };
            let denoise = family
                .profile(
                    &config.model.path,
                    opts,
                    &RunShape {
                        sample: shape,
                        batch,
                        optimizer_bytes_per_value: state_bytes_per_value(config, world),
                    },
                )?
                .forward_peak(&plan);
            let tile = sample_decode_tile(config, choice, device, w * h, width, dtype)?;
            let decode = between_steps(&prof, &plan)
                + decode_bytes(pixels_at_once(w * h, tile), width, dtype);
            out.push(PhasePlan {
                phase: "sample images",
                plan: format!(
                    "{} at {w}x{h}, one at a time{} without gradients under the step's plan \
                     (at most {:.2} GiB), the autoencoder decoding {} (about {:.2} GiB with \
                     what the run keeps)",
                    sc.prompts.len(),
                    if batch > 1 {
                        ", guidance's two predictions batched,"
                    } else {
                        ""
                    },
                    gib(denoise),
                    tiling_words(tile),
                    gib(decode)
                ),
                peak: Some(denoise.max(decode)),
            });
        }
        _ => out.push(PhasePlan {
            phase: "sample images",
            plan: "none".into(),
            peak: None,
        }),
    }
    out.push(PhasePlan {
        phase: "checkpoints",
        plan: "the adapter and optimizer state through host memory".into(),
        peak: Some(between_steps(&prof, &plan)),
    });
    Ok(out)
}
