//! Running a model's blocks within a memory budget: gradient checkpointing per block and
//! block streaming ("block swap"), behind one small object the models call, [`BlockExec`].
//!
//! A model names its blocks by key prefix in execution order (`double_blocks.0`, ...,
//! `single_blocks.37`) and runs each through `BlockExec::run(prefix, inputs, f)`. The exec
//! decides per block:
//! - **resident**: `f(inputs)`, everything kept for the backward as usual;
//! - **checkpointed**: `autograd::checkpoint`: only the inputs are kept, the backward
//!   re-runs `f`;
//! - **streamed**: checkpointed, and the block's frozen weights live in host memory
//!   (page-locked on a GPU). [`BlockStreamer`] copies them to the device before the block
//!   runs (in the forward, and again for the backward's re-run), a few blocks ahead on a copy
//!   stream so the copy overlaps the compute of the blocks before it, and releases them after.
//!   Streaming needs the checkpoint: otherwise the tape would hold the weights until the
//!   backward. The backward's uploads leave out the weights its re-runs showed only the
//!   forward reads (`autograd::Keep::few_rows`: the modulations over the conditioning
//!   vector). With `BlockStreamer::set_host_products` those weights (the Linears over the
//!   conditioning vector, a few rows each) stay in host memory for good, in every streamed
//!   block, and their products are computed on the host (`products`), ahead where the next
//!   forward's input was announced (`BlockStreamer::prepare_products`): they cross the link
//!   in neither pass.
//!
//! A streamed weight is one `Tensor` handle throughout (the model keeps it in its `Linear`);
//! only the buffer behind it changes: a one-element placeholder while released, the device
//! copy while fetched. Reading a released weight is an error (`Error::Stream`), never
//! garbage. docs/MEMORY.md's "Memory model" section states who owns which buffer on which
//! stream.

mod budget;
mod forward;
mod link;
mod machine;
mod offload;
mod phases;
mod plan;
mod products;
mod streamer;
mod switches;
mod trace;
mod trial;

pub use budget::{
    agree_memory_at_start, allocator_free, allocator_in_use, hold_to_budget, limit_share_at_start,
    memory_at_start, split_at_start, split_budget, LATE_HEADROOM,
};
pub use forward::ForwardPeak;
pub use machine::{
    host_room, machine_cache_path, measure_machine, measure_machine_cached, mem_available,
    read_machine, write_machine, MachineProbe,
};
pub use offload::{InputOffload, OffloadReport};
pub use plan::{
    carry, cost_model, spread_evenly, BlockCost, BlockShape, Candidate, Machine, MemoryProfile,
    NoPlan, PeakParts, Plan, Planned, Weighed, MARGIN_DIVISOR, ROOM_DIVISOR,
    SAVED_PER_TOKEN_CHANNEL,
};

pub use phases::{arena_overflows, PhasePeaks};
pub use products::ProductReport;
pub use streamer::{BlockStreamer, StallRecord, StreamReport, UploadRecord, TIME_EVERY};
pub use switches::Switches;
pub use trace::{take_block_trace, trace_blocks, BlockMemory};
pub use trial::{fastest, median, PlanKind, Trial, RIVAL_SLACK, TRIAL_MARGIN};

use crate::autograd::{checkpoint_opts, CheckpointHooks, CheckpointOptions, Keep, SavedHooks};
use crate::{Result, Tensor};
use std::sync::Arc;

/// Whether parameter `key` belongs to the block of key prefix `prefix` (`<prefix>.<rest>`).
pub(crate) fn under(key: &str, prefix: &str) -> bool {
    key.strip_prefix(prefix)
        .is_some_and(|rest| rest.starts_with('.'))
}

/// Which blocks are checkpointed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Checkpointing {
    /// None (streamed blocks still are).
    #[default]
    Off,
    /// Every block.
    All,
    /// Every n-th block in execution order (0, n, 2n, ...).
    Every(usize),
    /// Every block but the first n in execution order, which keep their activations: the
    /// room between `Every(2)` and `All`, where a budget holds the activations of some
    /// blocks but not of half of them.
    AllBut(usize),
}

impl Checkpointing {
    /// Whether the `index`-th block in execution order is checkpointed (streamed blocks are,
    /// whatever this says).
    pub fn covers(self, index: usize) -> bool {
        match self {
            Checkpointing::Off => false,
            Checkpointing::All => true,
            Checkpointing::Every(n) => n > 0 && index % n == 0,
            Checkpointing::AllBut(n) => index >= n,
        }
    }
}

/// The written form: "off", "all", "every:N" or "all-but:N" (N >= 1), as configs and the
/// bench take it.
impl std::str::FromStr for Checkpointing {
    type Err = String;
    fn from_str(c: &str) -> std::result::Result<Self, String> {
        let n = |prefix: &str| {
            c.strip_prefix(prefix)
                .and_then(|n| n.trim().parse::<usize>().ok())
                .filter(|&n| n > 0)
        };
        match c {
            "off" => Ok(Checkpointing::Off),
            "all" => Ok(Checkpointing::All),
            _ => n("every:")
                .map(Checkpointing::Every)
                .or_else(|| n("all-but:").map(Checkpointing::AllBut))
                .ok_or_else(|| "off, all, every:N or all-but:N with N >= 1".to_string()),
        }
    }
}

impl std::fmt::Display for Checkpointing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Checkpointing::Off => write!(f, "off"),
            Checkpointing::All => write!(f, "all"),
            Checkpointing::Every(n) => write!(f, "every:{n}"),
            Checkpointing::AllBut(n) => write!(f, "all-but:{n}"),
        }
    }
}

/// How a model runs its blocks (see the module docs). Cheap to clone; the default runs every
/// block resident.
#[derive(Clone, Debug, Default)]
pub struct BlockExec {
    /// Which blocks are checkpointed (streamed blocks always are).
    pub checkpointing: Checkpointing,
    /// The streamer of the blocks whose weights live in host memory, if any.
    pub streamer: Option<Arc<BlockStreamer>>,
    /// What checkpointed (and streamed) blocks keep from their forward instead of
    /// recomputing it (selective recompute, `autograd::Keep`).
    pub keep: Keep,
    /// Where checkpointed blocks keep their inputs until the backward: host memory when set
    /// (`InputOffload`), else the device.
    pub offload: Option<Arc<InputOffload>>,
    /// Each checkpointed block's re-run is issued on a helper thread while the backward of
    /// the block after it is issued (`Plan::rerun_ahead`, `autograd::ahead`); never while
    /// the blocks' memory is traced.
    pub rerun_ahead: bool,
}

/// The smallest checkpoint input an [`InputOffload`] made for a plan moves to host memory
/// (smaller ones cost more in copy overhead than they free).
pub const OFFLOAD_MIN_BYTES: usize = 1 << 20;

impl BlockExec {
    /// How a model runs its blocks under `plan`, with `plan`'s streamer (`streamer`,
    /// `BlockStreamer::for_plan`) and, where the plan offloads block inputs, an
    /// [`InputOffload`] on `device`.
    pub fn for_plan(
        plan: &Plan,
        streamer: Option<Arc<BlockStreamer>>,
        device: &crate::Device,
    ) -> Self {
        BlockExec {
            checkpointing: plan.checkpointing,
            streamer,
            keep: plan.keep,
            offload: plan.offload_inputs.then(|| {
                if plan.offloads_kept() {
                    InputOffload::keeping_outputs(device, OFFLOAD_MIN_BYTES)
                } else {
                    InputOffload::new(device, OFFLOAD_MIN_BYTES)
                }
            }),
            rerun_ahead: plan.rerun_ahead,
        }
    }

    /// Every block checkpointed, nothing streamed.
    pub fn checkpoint_all() -> Self {
        BlockExec {
            checkpointing: Checkpointing::All,
            streamer: None,
            keep: Keep::NONE,
            offload: None,
            rerun_ahead: false,
        }
    }

    /// Announces the conditioning activation of a coming forward, `x()`, to the streamer,
    /// which computes the products of the weights it holds on the host ahead
    /// (`BlockStreamer::prepare_products`). `x` runs only where the streamer holds weights.
    pub fn prepare_products(&self, x: impl FnOnce() -> Result<Tensor>) -> Result<()> {
        match &self.streamer {
            Some(s) if s.host_product_bytes()? > 0 => s.prepare_products(&x()?),
            _ => Ok(()),
        }
    }

    /// Announces what the next forward's blocks take from the model's input `source`,
    /// `input()` (SDXL's text context in the compute dtype), to the streamer, whose backward
    /// then computes the products of the forward-only weights over it ahead
    /// (`BlockStreamer::set_ahead_products`). `input` runs only where the streamer does so.
    pub fn announce_input(
        &self,
        source: &Tensor,
        input: impl FnOnce() -> Result<Tensor>,
    ) -> Result<()> {
        match &self.streamer {
            Some(s) if s.ahead_products() => s.announce_input(source, input()?),
            _ => Ok(()),
        }
    }

    /// What a forward's blocks take from the model's input `source`: the announced input
    /// where `source` is the one announced (`announce_input`), else `make()`
    /// (`BlockStreamer::take_input`).
    pub fn take_input(
        &self,
        source: &Tensor,
        make: impl FnOnce() -> Result<Tensor>,
    ) -> Result<Tensor> {
        match &self.streamer {
            Some(s) => s.take_input(source, make),
            None => make(),
        }
    }

    /// Runs block `prefix`, the `index`-th in execution order, as `f(inputs)`.
    pub fn run<F>(&self, prefix: &str, index: usize, inputs: &[Tensor], f: F) -> Result<Vec<Tensor>>
    where
        F: Fn(&[Tensor]) -> Result<Vec<Tensor>> + Send + Sync + 'static,
    {
        if trace::tracing() {
            // The first call is the forward, any later one a checkpoint's re-run.
            let (name, ran) = (
                prefix.to_string(),
                std::sync::atomic::AtomicBool::new(false),
            );
            let traced = move |xs: &[Tensor]| {
                let rerun = ran.swap(true, std::sync::atomic::Ordering::Relaxed);
                trace::traced(&name, rerun, xs, || f(xs))
            };
            return self.run_block(prefix, index, inputs, traced);
        }
        self.run_block(prefix, index, inputs, f)
    }

    fn run_block<F>(
        &self,
        prefix: &str,
        index: usize,
        inputs: &[Tensor],
        f: F,
    ) -> Result<Vec<Tensor>>
    where
        F: Fn(&[Tensor]) -> Result<Vec<Tensor>> + Send + Sync + 'static,
    {
        let saved = self.offload.clone().map(|o| -> Arc<dyn SavedHooks> { o });
        // The memory trace reads the allocator around each run: one at a time.
        let ahead = self.rerun_ahead && !trace::tracing();
        if let Some(hooks) = self.streamer.as_ref().and_then(|s| s.hooks_for(prefix)) {
            let hooks: Arc<dyn CheckpointHooks> = hooks;
            let opts = CheckpointOptions {
                hooks: Some(hooks),
                keep: self.keep,
                saved,
                ahead,
            };
            return checkpoint_opts(inputs, Arc::new(f), opts);
        }
        if self.checkpointing.covers(index) {
            let opts = CheckpointOptions {
                hooks: None,
                keep: self.keep,
                saved,
                ahead,
            };
            checkpoint_opts(inputs, Arc::new(f), opts)
        } else {
            // A resident block's tails feed what follows it in any enclosing checkpoint.
            crate::autograd::uncheckpointed(|| f(inputs))
        }
    }
}
