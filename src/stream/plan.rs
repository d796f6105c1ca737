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
//! Plans, fastest first (measured on an H100, README "Memory"): all resident; every n-th block
//! checkpointed (n = 4, 3, 2) with attention kept; every block checkpointed with attention
//! kept; then more and more blocks streamed from host memory (the smallest blocks first: at the
//! same compute they bring the fewest bytes, so their copies hide best behind the compute);
//! then the same without keeping attention; the last plan streams every block with a prefetch
//! of one. A budget under that last plan's peak cannot be met: `plan` says what the minimum is.

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

impl std::fmt::Display for Plan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ck = match self.checkpointing {
            Checkpointing::Off => "no checkpointing".to_string(),
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

/// No plan fits the budget.
#[derive(Clone, Debug, PartialEq)]
pub struct NoPlan {
    /// The budget asked for.
    pub budget: u64,
    /// The smallest predicted peak of any plan (every block streamed, prefetch 1).
    pub minimum: u64,
}

impl MemoryProfile {
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
    fn stream_order(&self) -> Vec<String> {
        let mut idx: Vec<usize> = (0..self.blocks.len()).collect();
        // Spread: even positions before odd ones, then a stable sort by size.
        idx.sort_by_key(|&i| (i % 2, i));
        idx.sort_by_key(|&i| self.blocks[i].weight_bytes);
        idx.into_iter()
            .map(|i| self.blocks[i].prefix.clone())
            .collect()
    }

    /// The candidate plans, fastest first (see the module docs).
    pub fn candidates(&self) -> Vec<Plan> {
        let keep = Keep { attention: true };
        let mut v = vec![Plan {
            prefetch: 2,
            ..Plan::default()
        }];
        for n in [4, 3, 2] {
            v.push(Plan {
                checkpointing: Checkpointing::Every(n),
                prefetch: 2,
                keep,
                ..Plan::default()
            });
        }
        let order = self.stream_order();
        for keep in [keep, Keep::NONE] {
            for k in 0..=order.len() {
                // Offloading the inputs moves ~1.5 GiB (Flux-dev at 1024²) for two copies of
                // their bytes a step, the first device-to-host (beside the weights' uploads
                // on a full-duplex link): cheaper than streaming the blocks that would free
                // as much, so it comes before the next streamed block.
                for offload_inputs in [false, true] {
                    v.push(Plan {
                        checkpointing: Checkpointing::All,
                        streamed: order[..k].to_vec(),
                        prefetch: 2,
                        keep,
                        offload_inputs,
                    });
                }
            }
        }
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

    /// The first of `candidates` (fastest first) whose predicted peak is within `budget`.
    pub fn plan_among(
        &self,
        budget: u64,
        candidates: Vec<Plan>,
    ) -> std::result::Result<Planned, NoPlan> {
        let mut minimum = u64::MAX;
        for plan in candidates {
            let peak = self.peak(&plan);
            minimum = minimum.min(peak);
            if peak <= budget {
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
        // A budget between all-checkpointed and resident picks a checkpointing plan.
        let planned = p.plan(1500).unwrap();
        assert!(planned.peak <= 1500 && planned.plan.streamed.is_empty());
        assert!(planned.plan.keep.attention);
        // Tighter: blocks stream, the small ones first.
        let planned = p.plan(1300).unwrap();
        assert!(planned.peak <= 1300);
        assert!(!planned.plan.streamed.is_empty());
        assert!(planned.plan.streamed[0] != "b.0" && planned.plan.streamed[0] != "b.1");
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
