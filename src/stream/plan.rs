//! The memory planner: a model's memory profile (bytes of weights, inputs and activations per
//! block), the peak a plan predicts from it, and the fastest plan that fits a budget.
//!
//! What a training step holds on the device, by plan:
//! - every weight outside the streamed blocks (non-block weights always), plus, when blocks
//!   stream, the block running and the `prefetch` streamed blocks after it (the heaviest
//!   such window);
//! - the trainable adapters, their gradients and the optimizer state;
//! - per block, for the backward: all it saves when resident; only its inputs when
//!   checkpointed (plus attention's output and log-sum-exp when kept); and, while a
//!   checkpointed block is re-run and backpropagated, that block's saved activations and the
//!   gradients of its inputs;
//! - a fixed margin (the sample, the loss, transient buffers).
//!
//! The candidates: no, every n-th (n = 4, 3, 2) or every block checkpointed, with 0 to all
//! blocks streamed from host memory (the smallest blocks first: they free the most memory for
//! their copies; streamed blocks are always checkpointed), attention kept or not, block inputs
//! offloaded or not; the last streams every block with a prefetch of one. They are ordered by
//! a time model (`MemoryProfile::cost`, calibrated on an H100): recompute costs each
//! checkpointed block its share of the work, each GiB copied per step costs a little of the
//! exposed copy time, and a step is never shorter than its uploads at the measured bandwidth. Streaming more blocks to leave others resident and unrecomputed is
//! often the faster way to a budget: Flux-dev within 24 GiB ran at 1.23x with 43 of 57 blocks
//! streamed and the rest resident, against 1.33x with every block checkpointed and 16
//! streamed. A budget under the last plan's peak cannot be met: `plan` says the minimum.

use crate::autograd::Keep;
use crate::stream::Checkpointing;

/// One block's sizes, for one batch.
#[derive(Clone, Debug, PartialEq)]
pub struct BlockCost {
    /// The block's key prefix (`double_blocks.3`).
    pub prefix: String,
    /// Bytes of its frozen weights as stored on the device (bf16, or FP8 codes + scales).
    pub weight_bytes: u64,
    /// Bytes of its inputs: what a checkpoint keeps.
    pub input_bytes: u64,
    /// Bytes its forward keeps for the backward when it runs resident.
    pub saved_bytes: u64,
    /// Bytes of attention outputs and log-sum-exps that `Keep { attention }` keeps.
    pub attention_bytes: u64,
    /// Its share of the step's work in relative units (positions times weight bytes: a
    /// Linear's or a convolution's FLOPs are positions times weights), for the time model.
    pub compute: f64,
}

/// The sizes the planner works from.
#[derive(Clone, Debug, PartialEq)]
pub struct MemoryProfile {
    /// The blocks in execution order.
    pub blocks: Vec<BlockCost>,
    /// Bytes of the weights outside the blocks (embedders, final layer), always resident.
    pub other_weight_bytes: u64,
    /// Bytes of the trainable parameters (f32 adapters); their gradients take as much again.
    pub trainable_bytes: u64,
    /// Bytes of the optimizer state.
    pub optimizer_bytes: u64,
    /// The sample, the loss and transient buffers.
    pub fixed_bytes: u64,
}

/// A plan: how blocks run (the planner's choice, or the user's).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    /// Which blocks are checkpointed (streamed blocks always are).
    pub checkpointing: Checkpointing,
    /// The blocks whose weights stream from host memory, by prefix.
    pub streamed: Vec<String>,
    /// Blocks copied ahead of the one running.
    pub prefetch: usize,
    /// What checkpointed blocks keep.
    pub keep: Keep,
    /// Checkpointed blocks keep their inputs in host memory (`InputOffload`).
    pub offload_inputs: bool,
}

impl Plan {
    /// Whether blocks that keep their activations run beside streamed ones (the plans whose
    /// peak the model was seen to under-predict: they keep `MARGIN_DIVISOR` spare).
    pub fn mixes(&self) -> bool {
        self.checkpointing != Checkpointing::All && !self.streamed.is_empty()
    }
}

impl std::fmt::Display for Plan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ck = match self.checkpointing {
            Checkpointing::Off if self.streamed.is_empty() => "no checkpointing".to_string(),
            Checkpointing::Off => "only streamed blocks checkpointed".to_string(),
            Checkpointing::All => "every block checkpointed".to_string(),
            Checkpointing::Every(n) => format!("every {n}th block checkpointed"),
        };
        write!(f, "{ck}")?;
        if self.keep.attention {
            write!(f, ", attention kept")?;
        }
        if self.offload_inputs {
            write!(f, ", block inputs in host memory")?;
        }
        if !self.streamed.is_empty() {
            write!(
                f,
                ", {} blocks streamed from host memory (prefetch {})",
                self.streamed.len(),
                self.prefetch
            )?;
        }
        Ok(())
    }
}

/// A plan with its predicted peak.
#[derive(Clone, Debug, PartialEq)]
pub struct Planned {
    /// The plan.
    pub plan: Plan,
    /// Predicted peak bytes on the device.
    pub peak: u64,
    /// Bytes copied from host memory per step (each streamed block twice: the forward and
    /// the backward's re-run).
    pub streamed_bytes: u64,
}

/// Plans that mix resident-activation blocks with streamed ones are held to the budget less
/// 1/32 of it: their predicted peak measured up to 1.6% under the real one (every 2nd block
/// checkpointed, 37 streamed: 23.27 predicted, 23.65 GiB measured); the others' predictions
/// measured over.
pub const MARGIN_DIVISOR: u64 = 32;

/// No plan fits the budget.
#[derive(Clone, Debug, PartialEq)]
pub struct NoPlan {
    /// The budget asked for.
    pub budget: u64,
    /// The smallest predicted peak of any plan (every block streamed, prefetch 1).
    pub minimum: u64,
}

/// The time model's constants, as fractions of the resident step, from one H100 call
/// (session 13, Flux-dev LoRA at 1024², resident 759.6 ms): every block checkpointed with
/// attention kept ran 967.0 ms (recompute 0.273); no checkpointing with 43 blocks streamed
/// 935.5 ms, every 4th with 40 streamed 932.5 ms, every 2nd with 37 streamed 945.2 ms and
/// none with 50 streamed 1003.3 ms, each within 1% of the model with 2 ms (0.0026) of exposed
/// copy per GiB streamed per step. Without kept attention the recompute was 1.35x (session
/// 12). Offloading block inputs measured dearer than streaming the same bytes, so it is
/// chosen where only it fits. Run-to-run noise on that machine is about ±2% (the resident
/// step ran 757–776 ms within one call).
pub mod cost_model {
    /// Recompute of every block, attention kept (fraction of the resident step).
    pub const RECOMPUTE_KEEP: f64 = 0.273;
    /// Recompute of every block, nothing kept (fraction of the resident step).
    pub const RECOMPUTE_FULL: f64 = 0.35;
    /// The resident step's length, estimated from the activations it saves: 24.1 ms a GiB
    /// (Flux-dev's 31.6 GiB ran 760 ms; the same rate predicts SD3.5-large's step at 440 ms
    /// and SDXL's at 170 ms, measured 402 and 161–295 ms). Copy costs are absolute times,
    /// so a faster step pays relatively more for the same copies.
    pub const STEP_MS_PER_SAVED_GIB: f64 = 24.1;
    /// Exposed copy time per GiB streamed per step, ms.
    pub const COPY_MS_PER_GIB: f64 = 1.2;
    /// Exposed time per streamed block per step, ms: the fetch, wait and release around each
    /// run (with the per-GiB term, 65 ms for Flux-dev's 43 blocks and 25.6 GiB, measured
    /// 52–80; it keeps SDXL, whose blocks are small and many, from streaming where
    /// checkpointing alone fits: 14 of its blocks streamed cost about 4.5 ms each).
    pub const STREAM_MS_PER_BLOCK: f64 = 0.8;
    /// Per GiB of block inputs moved to host memory and back per step, ms (every block
    /// checkpointed with 10 streamed and the inputs offloaded ran 1062 ms; with 52 streamed,
    /// nothing kept and the inputs offloaded 1232 ms: 29 and 45 ms a GiB).
    pub const OFFLOAD_MS_PER_GIB: f64 = 34.0;
    /// A prefetch of one block instead of two (the copies hide less), fraction of the step.
    pub const PREFETCH_ONE: f64 = 0.02;
    /// Copy time per GiB uploaded per step, ms: past the compute, the step waits for the
    /// copies (no checkpointing with 53 blocks streamed, 38.3 GiB a step, ran 1091 ms; every
    /// block checkpointed with 56 streamed, 42.1 GiB, 1140 ms: about 36.5 GiB/s).
    pub const UPLOAD_MS_PER_GIB: f64 = 27.4;
}

impl MemoryProfile {
    /// The predicted cost of a step under `plan` beyond the resident step, as a fraction of
    /// it (see `cost_model`): candidates are ordered by it.
    pub fn cost(&self, plan: &Plan) -> f64 {
        use cost_model::*;
        const GIB: f64 = (1u64 << 30) as f64;
        let total: f64 = self
            .blocks
            .iter()
            .map(|b| b.compute)
            .sum::<f64>()
            .max(1e-30);
        let rate = if plan.keep.attention {
            RECOMPUTE_KEEP
        } else {
            RECOMPUTE_FULL
        };
        let mut c = 0.0;
        let mut offloaded = 0u64;
        for (i, b) in self.blocks.iter().enumerate() {
            let streamed = plan.streamed.iter().any(|p| p == &b.prefix);
            if Self::checkpointed(plan, i, streamed) {
                c += rate * b.compute / total;
                offloaded += b.input_bytes;
            }
        }
        let streamed = self.streamed_bytes(plan) as f64 / GIB;
        let saved: u64 = self.blocks.iter().map(|b| b.saved_bytes).sum();
        let step_ms = (STEP_MS_PER_SAVED_GIB * saved as f64 / GIB).max(f64::MIN_POSITIVE);
        c += (COPY_MS_PER_GIB * streamed + STREAM_MS_PER_BLOCK * plan.streamed.len() as f64)
            / step_ms;
        let mut uploaded = streamed;
        if plan.offload_inputs {
            c += OFFLOAD_MS_PER_GIB * 2.0 * offloaded as f64 / GIB / step_ms;
            uploaded += offloaded as f64 / GIB;
        }
        if plan.prefetch < 2 && !plan.streamed.is_empty() {
            c += PREFETCH_ONE;
        }
        // The step is at least as long as its uploads.
        c.max(UPLOAD_MS_PER_GIB * uploaded / step_ms - 1.0)
    }

    /// Whether block `i` is checkpointed under `plan`.
    fn checkpointed(plan: &Plan, i: usize, streamed: bool) -> bool {
        streamed
            || match plan.checkpointing {
                Checkpointing::Off => false,
                Checkpointing::All => true,
                Checkpointing::Every(n) => n > 0 && i % n == 0,
            }
    }

    /// The predicted peak bytes of a step under `plan` (see the module docs).
    pub fn peak(&self, plan: &Plan) -> u64 {
        let mut weights = self.other_weight_bytes;
        let mut streamed_sizes = vec![];
        let (mut held, mut work, mut offloaded) = (0u64, 0u64, 0u64);
        for (i, b) in self.blocks.iter().enumerate() {
            let streamed = plan.streamed.iter().any(|p| p == &b.prefix);
            if streamed {
                streamed_sizes.push(b.weight_bytes);
            } else {
                weights += b.weight_bytes;
            }
            if Self::checkpointed(plan, i, streamed) {
                if plan.offload_inputs {
                    // In host memory; on the device only while its copy runs (forward) or
                    // once fetched ahead of its re-run (backward): two blocks' worth.
                    offloaded = offloaded.max(b.input_bytes);
                } else {
                    held += b.input_bytes;
                }
                if plan.keep.attention {
                    held += b.attention_bytes;
                }
                // The re-run's tape and the gradients of its inputs.
                work = work.max(b.saved_bytes + 2 * b.input_bytes);
            } else {
                held += b.saved_bytes;
                work = work.max(2 * b.input_bytes);
            }
        }
        // The block running and the `prefetch` streamed blocks after it (in execution
        // order) are on the device together: the heaviest such window. Not the mean block:
        // the SDXL UNet's large blocks sit next to each other (a 4 GiB plan sized with the
        // mean ran out of memory on the H100).
        let window = (plan.prefetch.max(1) + 1).min(streamed_sizes.len()).max(1);
        weights += streamed_sizes
            .windows(window)
            .map(|w| w.iter().sum::<u64>())
            .max()
            .unwrap_or(0);
        held += 2 * offloaded;
        weights + 2 * self.trainable_bytes + self.optimizer_bytes + held + work + self.fixed_bytes
    }

    /// Bytes copied from host memory per step under `plan`.
    pub fn streamed_bytes(&self, plan: &Plan) -> u64 {
        self.blocks
            .iter()
            .filter(|b| plan.streamed.contains(&b.prefix))
            .map(|b| 2 * b.weight_bytes)
            .sum()
    }

    /// Block prefixes in the order the planner streams them: the smallest blocks first,
    /// ties kept in execution order but spread (every other one first), so the streamed
    /// blocks alternate with resident ones while there are few.
    pub fn stream_order(&self) -> Vec<String> {
        let mut idx: Vec<usize> = (0..self.blocks.len()).collect();
        // Spread: even positions before odd ones, then a stable sort by size.
        idx.sort_by_key(|&i| (i % 2, i));
        idx.sort_by_key(|&i| self.blocks[i].weight_bytes);
        idx.into_iter()
            .map(|i| self.blocks[i].prefix.clone())
            .collect()
    }

    /// The candidate plans, fastest first by the time model (see the module docs); ties go
    /// to the smaller peak.
    pub fn candidates(&self) -> Vec<Plan> {
        let order = self.stream_order();
        let n = self.blocks.len();
        let mut v = vec![];
        for checkpointing in [
            Checkpointing::Off,
            Checkpointing::Every(4),
            Checkpointing::Every(3),
            Checkpointing::Every(2),
            Checkpointing::All,
        ] {
            for k in 0..=n {
                let nothing_checkpointed = k == 0 && checkpointing == Checkpointing::Off;
                for attention in [true, false] {
                    for offload_inputs in [false, true] {
                        // Keeping and offloading mean nothing without a checkpoint.
                        if nothing_checkpointed && (!attention || offload_inputs) {
                            continue;
                        }
                        v.push(Plan {
                            checkpointing,
                            streamed: order[..k].to_vec(),
                            prefetch: 2,
                            keep: Keep {
                                attention: attention && !nothing_checkpointed,
                            },
                            offload_inputs,
                        });
                    }
                }
            }
        }
        let mut keyed: Vec<(f64, u64, Plan)> = v
            .into_iter()
            .map(|p| (self.cost(&p), self.peak(&p), p))
            .collect();
        keyed.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
        let mut v: Vec<Plan> = keyed.into_iter().map(|(_, _, p)| p).collect();
        // The smallest plan, last: every block streamed with a prefetch of one, nothing kept,
        // the inputs in host memory.
        v.push(Plan {
            checkpointing: Checkpointing::All,
            streamed: order,
            prefetch: 1,
            keep: Keep::NONE,
            offload_inputs: true,
        });
        v
    }

    /// The fastest plan whose predicted peak is within `budget` bytes.
    pub fn plan(&self, budget: u64) -> std::result::Result<Planned, NoPlan> {
        self.plan_among(budget, self.candidates())
    }

    /// The first of `candidates` (fastest first) whose predicted peak is within `budget`
    /// (less `MARGIN_DIVISOR`'s share of it for mixed plans).
    pub fn plan_among(
        &self,
        budget: u64,
        candidates: Vec<Plan>,
    ) -> std::result::Result<Planned, NoPlan> {
        let usable = budget - budget / MARGIN_DIVISOR;
        let mut minimum = u64::MAX;
        for plan in candidates {
            let peak = self.peak(&plan);
            minimum = minimum.min(peak);
            if peak <= if plan.mixes() { usable } else { budget } {
                let streamed_bytes = self.streamed_bytes(&plan);
                return Ok(Planned {
                    plan,
                    peak,
                    streamed_bytes,
                });
            }
        }
        Err(NoPlan { budget, minimum })
    }
}

/// `n` of `prefixes` (execution order) spread evenly over it: block `k * len / n` for `k < n`
/// (all of them when `n >= len`). The hand-set `memory.stream_blocks` picks its blocks so.
pub fn spread_evenly(prefixes: &[String], n: usize) -> Vec<String> {
    let (len, n) = (prefixes.len(), n.min(prefixes.len()));
    (0..n).map(|k| prefixes[k * len / n].clone()).collect()
}

/// Activation bytes of a transformer-style block per token and channel of its width, in
/// units of the activation dtype's size: what a resident block's forward keeps for the LoRA
/// step's backward. Measured on Flux-dev at 1024² (H100, session 12): the resident step's
/// peak (54.69 GiB) less weights, adapters, gradients and AdamW state (23.3 GiB), over 57
/// blocks of 4608 tokens x 3072 channels in bf16, is 20.9 values a token-channel.
pub const SAVED_PER_TOKEN_CHANNEL: f64 = 21.0;

/// The shape of one block's activations, which the families describe and the planner sizes
/// (`BlockCost`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BlockShape {
    /// Positions (tokens, or pixels of a feature map) per sample.
    pub tokens: usize,
    /// Channels of the block's stream.
    pub width: usize,
    /// Transformer-layer equivalents of work per token (1 for a Flux or SD3 block; a UNet
    /// block counts its transformer layers and a fraction for its ResNet).
    pub layers: f64,
    /// Attention calls whose outputs `Keep { attention }` would keep.
    pub attention_calls: usize,
    /// Attention heads (for the f32 log-sum-exp per head and token).
    pub heads: usize,
}

impl BlockShape {
    /// (input, saved, attention) bytes for `batch` samples with `elem` bytes a value.
    pub fn bytes(&self, batch: usize, elem: usize) -> (u64, u64, u64) {
        let tw = (batch * self.tokens * self.width) as f64 * elem as f64;
        let input = tw as u64;
        let saved = (tw * SAVED_PER_TOKEN_CHANNEL * self.layers) as u64;
        let attention =
            self.attention_calls as u64 * (input + (batch * self.heads * self.tokens * 4) as u64);
        (input, saved, attention)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn profile() -> MemoryProfile {
        let blocks = (0..6)
            .map(|i| BlockCost {
                prefix: format!("b.{i}"),
                weight_bytes: if i < 2 { 300 } else { 100 },
                input_bytes: 10,
                saved_bytes: 200,
                attention_bytes: 5,
                compute: if i < 2 { 3.0 } else { 1.0 },
            })
            .collect();
        MemoryProfile {
            blocks,
            other_weight_bytes: 50,
            trainable_bytes: 20,
            optimizer_bytes: 40,
            fixed_bytes: 30,
        }
    }

    #[test]
    fn peaks_by_plan() {
        let p = profile();
        // Resident: weights 50 + 1000, adapters 40 + 40, saved 6 x 200, work 20, fixed 30.
        let resident = Plan::default();
        assert_eq!(p.peak(&resident), 1050 + 80 + 1200 + 20 + 30);
        // All checkpointed with attention: inputs 60 + kept 30, work 200 + 20.
        let all = Plan {
            checkpointing: Checkpointing::All,
            keep: Keep { attention: true },
            ..Plan::default()
        };
        assert_eq!(p.peak(&all), 1050 + 80 + 90 + 220 + 30);
        // Streaming the two large blocks with prefetch 2: both on the device at once.
        let streamed = Plan {
            streamed: vec!["b.0".into(), "b.1".into()],
            prefetch: 2,
            ..all.clone()
        };
        assert_eq!(p.peak(&streamed), 50 + 400 + 600 + 80 + 90 + 220 + 30);
        assert_eq!(p.streamed_bytes(&streamed), 1200);
    }

    #[test]
    fn the_fastest_plan_that_fits_and_the_minimum() {
        let p = profile();
        let resident = p.peak(&Plan::default());
        assert_eq!(
            p.plan(resident).unwrap().plan,
            Plan {
                prefetch: 2,
                ..Plan::default()
            }
        );
        // Any budget: the cheapest candidate by the time model among those that fit.
        for budget in [1500, 1300, 1100] {
            let planned = p.plan(budget).unwrap();
            let best = p
                .candidates()
                .into_iter()
                .filter(|c| {
                    let mixed = c.checkpointing != Checkpointing::All && !c.streamed.is_empty();
                    p.peak(c)
                        <= if mixed {
                            budget - budget / MARGIN_DIVISOR
                        } else {
                            budget
                        }
                })
                .map(|c| p.cost(&c))
                .fold(f64::INFINITY, f64::min);
            assert!(planned.peak <= budget);
            assert_eq!(p.cost(&planned.plan), best);
            // Streamed blocks are the small ones first.
            if let Some(first) = planned.plan.streamed.first() {
                assert!(first != "b.0" && first != "b.1", "{budget}: {first}");
            }
        }
        // The time model: recompute in proportion to the work, copies per GiB.
        let all = Plan {
            checkpointing: Checkpointing::All,
            keep: Keep { attention: true },
            ..Plan::default()
        };
        assert!((p.cost(&all) - cost_model::RECOMPUTE_KEEP).abs() < 1e-12);
        let first_two = Plan {
            checkpointing: Checkpointing::Off,
            streamed: vec!["b.0".into(), "b.1".into()],
            prefetch: 2,
            keep: Keep { attention: true },
            offload_inputs: false,
        };
        // 6 of the 10 units of work, 2 blocks and 1200 bytes copied, against a step of
        // 6 x 200 saved bytes; at least the uploads' time.
        let gib = (1u64 << 30) as f64;
        let step_ms = cost_model::STEP_MS_PER_SAVED_GIB * 1200.0 / gib;
        let want = (0.6 * cost_model::RECOMPUTE_KEEP
            + (cost_model::COPY_MS_PER_GIB * 1200.0 / gib + cost_model::STREAM_MS_PER_BLOCK * 2.0)
                / step_ms)
            .max(cost_model::UPLOAD_MS_PER_GIB * 1200.0 / gib / step_ms - 1.0);
        assert!((p.cost(&first_two) - want).abs() < 1e-9 * want);
        // Below every plan: the minimum is every block streamed, prefetch 1, nothing kept.
        let err = p.plan(10).unwrap_err();
        let last = p.candidates().pop().unwrap();
        assert_eq!(err.minimum, p.peak(&last));
        assert_eq!(last.streamed.len(), 6);
        // Every candidate the planner returns fits, for every budget.
        for budget in (0..3000).step_by(37) {
            if let Ok(pl) = p.plan(budget) {
                assert!(pl.peak <= budget);
                assert_eq!(pl.peak, p.peak(&pl.plan));
            }
        }
    }
}
