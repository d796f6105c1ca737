//! Plans for forwards without gradients: the `sample` binary's denoising within a budget.
//!
//! A forward under `no_grad` keeps no block's activations past the block, so the training
//! step's peak (which holds what the backward needs) asks far more memory of it than it
//! takes, and a plan chosen by the step's peak streams more blocks than a forward needs.
//! Here only the streamed blocks matter: a plan is a number of streamed blocks (the
//! planner's stream order, [`MemoryProfile::stream_order`]), how far ahead they are
//! fetched and whether their Linears over the conditioning vector keep their weights in
//! host memory and take their products from the host (`Plan::host_products`), nothing
//! checkpointed beyond them, uncoded. Its peak is the resident weights,
//! the streamer's window, the largest block's work and the sample's inputs
//! ([`MemoryProfile::forward_peak`]); its time a forward played on the compute stream's,
//! the host link's and the host products' clocks as the streamer issues the uploads
//! ([`MemoryProfile::forward_only_ms`]); the fastest plan that fits the budget and the
//! host's memory is taken ([`MemoryProfile::plan_forward_within`]).

use super::plan::{MemoryProfile, NoPlan, Plan, Planned, MARGIN_DIVISOR};
use super::Checkpointing;

/// The most blocks a forward plan fetches ahead of the one running.
const MOST_AHEAD: usize = 4;

/// A forward's predicted peak ([`MemoryProfile::forward_peak_parts`]) by part, bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ForwardPeak {
    /// The weights on the device throughout: the resident blocks' and the rest.
    pub weights: u64,
    /// The streamed blocks on the device at once (the streamer's window).
    pub window: u64,
    /// The largest block's work: its activations and its input twice.
    pub work: u64,
    /// The staging ring, trainable parameters with their gradients, the optimizer's state
    /// and the inputs and transients of the step ([`MemoryProfile::fixed_bytes`]).
    pub rest: u64,
}

impl ForwardPeak {
    /// The peak: every part at once.
    pub fn total(&self) -> u64 {
        self.weights + self.window + self.work + self.rest
    }
}

impl std::fmt::Display for ForwardPeak {
    /// In GiB: "weights W, streamed blocks in flight S, a block's work A, the rest R".
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let g = |b: u64| b as f64 / (1u64 << 30) as f64;
        write!(
            f,
            "weights {:.2}, streamed blocks in flight {:.2}, a block's work {:.2}, the rest {:.2} GiB",
            g(self.weights),
            g(self.window),
            g(self.work),
            g(self.rest)
        )
    }
}

impl MemoryProfile {
    /// A forward plan: the first `streamed` blocks of the stream order fetched `prefetch`
    /// ahead, nothing else checkpointed, nothing kept, uncoded, 8-bit weights' transposes not
    /// kept (no backward makes them); with `host_products`, the streamed blocks' Linears over
    /// the conditioning vector keep their floating-point weights in host memory and take
    /// their products from the host (`Plan::host_products`; on only where such weights
    /// stream).
    pub fn forward_plan(&self, streamed: usize, prefetch: usize, host_products: bool) -> Plan {
        self.forward_plan_in(&self.stream_order(), streamed, prefetch, host_products)
    }

    /// [`MemoryProfile::forward_plan`] over `order`, the stream order worked out once.
    fn forward_plan_in(
        &self,
        order: &[String],
        streamed: usize,
        prefetch: usize,
        host_products: bool,
    ) -> Plan {
        // 8-bit weights' transposes are for a backward: none is kept where any would be.
        let kept = self.other_kept_bytes > 0 || self.blocks.iter().any(|b| b.kept_bytes > 0);
        let streamed = order[..streamed.min(order.len())].to_vec();
        // Host products only where some streamed block has weights the host would hold.
        let held = self
            .blocks
            .iter()
            .any(|b| Self::holdable(b) && streamed.contains(&b.prefix));
        Plan {
            checkpointing: Checkpointing::Off,
            prefetch: prefetch.max(1),
            remake_transposes: kept,
            host_products: host_products && held,
            streamed,
            ..Plan::default()
        }
    }

    /// The predicted peak bytes of a forward without gradients under `plan` (a
    /// [`MemoryProfile::forward_plan`], or a step's plan: a validation or a sample image
    /// under it): the weights on the device throughout (the resident blocks' and the rest;
    /// a streamed block's less those held on the host for their products),
    /// the staging ring of coded uploads, the trainable parameters with their gradients and
    /// the optimizer's state where the profile counts them, the streamer's window, the
    /// largest block's work (its re-run tape, which holds every activation the block makes,
    /// and its input twice) and the inputs and transients of the step
    /// ([`MemoryProfile::fixed_bytes`]).
    ///
    /// The window: the block running and `prefetch` ahead (a forward without gradients
    /// releases each streamed block as it leaves it), with one block spare, so `prefetch + 2`
    /// of the largest streamed block, or every streamed block where they are fewer; under a
    /// step's plan that fetches deeper (`Plan::reach`), the most any place's reach holds and
    /// one block more.
    pub fn forward_peak(&self, plan: &Plan) -> u64 {
        self.forward_peak_parts(plan).total()
    }

    /// [`forward_peak`](Self::forward_peak) by part.
    pub fn forward_peak_parts(&self, plan: &Plan) -> ForwardPeak {
        let streamed = self.streamed_marks(plan);
        let kept = |bytes: u64| if plan.remake_transposes { 0 } else { bytes };
        let mut weights = self.other_weight_bytes + kept(self.other_kept_bytes);
        let (mut largest, mut work) = (0u64, 0u64);
        for (b, &s) in self.blocks.iter().zip(&streamed) {
            if s {
                largest = largest.max(Self::on_device_bytes(plan, b));
            } else {
                weights += b.weight_bytes + kept(b.kept_bytes);
            }
            work = work.max(b.saved_bytes + 2 * b.input_bytes);
        }
        let count = streamed.iter().filter(|&&s| s).count() as u64;
        let mut window = (plan.prefetch.max(1) as u64 + 2).min(count) * largest;
        // A step's plan that fetches deeper (`Plan::reach`): a forward without gradients
        // fetches each place's whole reach, since none of the memory it was sized against is
        // taken by checkpoints; and one block more while the last is released.
        if !plan.reach.is_empty() {
            let sizes: Vec<u64> = (self.blocks.iter().zip(&streamed))
                .filter(|&(_, &s)| s)
                .map(|(b, _)| Self::on_device_bytes(plan, b))
                .collect();
            let deepest = (0..sizes.len())
                .map(|j| {
                    let last = plan.reach.get(j).copied().unwrap_or(j).min(sizes.len() - 1);
                    sizes[j..=last.max(j)].iter().sum::<u64>()
                })
                .max()
                .unwrap_or(0);
            window = window.max(deepest + largest);
        }
        // A step's plan that codes its uploads holds their staging ring throughout.
        let staging = match plan.wire_code {
            true => self.peak_parts(plan).staging,
            false => 0,
        };
        ForwardPeak {
            weights,
            window,
            work,
            rest: staging + 2 * self.trainable_bytes + self.optimizer_bytes + self.fixed_bytes,
        }
    }

    /// The predicted milliseconds of one forward without gradients under `plan` (a
    /// [`MemoryProfile::forward_plan`]): the blocks run in order on the compute stream, each
    /// for its unrecorded forward ([`MemoryProfile::unrecorded_forward_ms`]); a streamed
    /// block waits for its upload. The uploads cross the host link one after another at the
    /// machine's upload rate, each issued when the forward enters the streamed block
    /// `prefetch` places before it (the first `prefetch + 1` when it enters the first):
    /// nothing is on the device at a forward's start, since no backward left blocks there.
    /// With `Plan::host_products` the weights the host holds leave the uploads, and a block
    /// also waits for their products, which the host computes in block order at the
    /// machine's rate from when the forward enters the first streamed block (its product
    /// brings the conditioning over and starts them all: `crate::memory` module `products`).
    pub fn forward_only_ms(&self, plan: &Plan) -> f64 {
        const GIB: f64 = (1u64 << 30) as f64;
        let rate = self.machine.upload_gib_per_s.max(1e-3);
        let host_rate = self.machine.host_product_gib_per_s.max(1e-3);
        let streamed = self.streamed_marks(plan);
        let order: Vec<usize> = (0..self.blocks.len()).filter(|&i| streamed[i]).collect();
        let ahead = plan.prefetch.max(1);
        let mut ready = vec![0.0f64; order.len()];
        let (mut issued, mut link, mut t) = (0usize, 0.0f64, 0.0f64);
        let mut host: Option<f64> = None;
        let mut place = 0usize;
        for (i, b) in self.blocks.iter().enumerate() {
            if streamed[i] {
                // Entering streamed place `place`: its upload and those up to `ahead` past it.
                let last = (place + ahead).min(order.len() - 1);
                while issued <= last {
                    let bytes = Self::on_device_bytes(plan, &self.blocks[order[issued]]);
                    link = link.max(t) + bytes as f64 / GIB / rate * 1e3;
                    ready[issued] = link;
                    issued += 1;
                }
                let held = Self::host_held(plan, b).0;
                if held > 0 {
                    let start = *host.get_or_insert(t);
                    let done = start + held as f64 / GIB / host_rate * 1e3;
                    host = Some(done);
                    t = t.max(done);
                }
                t = t.max(ready[place]);
                place += 1;
            }
            t += self.unrecorded_forward_ms(b);
        }
        t
    }

    /// The fastest forward plan ([`MemoryProfile::forward_only_ms`]) whose forward peak
    /// ([`MemoryProfile::forward_peak`]) is within `budget` bytes (less
    /// [`MARGIN_DIVISOR`]'s share of it where blocks stream) and whose pinned host
    /// memory ([`MemoryProfile::host_bytes`]) within `host_room` where given: every count of
    /// streamed blocks in the stream order, each fetched 1 to 4 ahead, and with
    /// `host_products` each of those also with the conditioning products on the host (where
    /// its streamed blocks have such weights); of plans predicted alike, the fewer streamed
    /// blocks, then the one without host products. `Planned::streamed_bytes` is a forward's
    /// uploads, `Planned::slowdown` its forward over the resident one's. Where none fits,
    /// the smallest budget a plan needs (its peak, and the margin where it streams) and,
    /// where plans fit the device but not the host, their least host memory.
    pub fn plan_forward_within(
        &self,
        budget: u64,
        host_room: Option<u64>,
        host_products: bool,
    ) -> std::result::Result<Planned, NoPlan> {
        let n = self.blocks.len();
        let order = self.stream_order();
        let resident_ms = self
            .forward_only_ms(&self.forward_plan_in(&order, 0, 1, false))
            .max(1e-9);
        let hosts: &[bool] = match host_products {
            true => &[false, true],
            false => &[false],
        };
        let mut best: Option<(f64, Plan, u64)> = None;
        let mut minimum = u64::MAX;
        let mut host_least: Option<u64> = None;
        for streamed in 0..=n {
            for (prefetch, &host) in (1..=MOST_AHEAD.min(streamed.max(1)))
                .flat_map(|p| hosts.iter().map(move |h| (p, h)))
            {
                let plan = self.forward_plan_in(&order, streamed, prefetch, host);
                if host && !plan.host_products {
                    // Nothing the host would hold streams: the plan without is weighed.
                    continue;
                }
                let peak = self.forward_peak(&plan);
                // The budget it needs, its margin included.
                minimum = minimum.min(match streamed {
                    0 => peak,
                    _ => peak + peak / (MARGIN_DIVISOR - 1),
                });
                // Streamed blocks fetched and released cut the cap's arena into pieces: a
                // plan that streams keeps `MARGIN_DIVISOR`'s share of the budget spare.
                let usable = match streamed {
                    0 => budget,
                    _ => budget - budget / MARGIN_DIVISOR,
                };
                if peak > usable {
                    continue;
                }
                if let Some(room) = host_room {
                    let host = self.host_bytes(&plan);
                    if host > room {
                        host_least = Some(host_least.map_or(host, |h| h.min(host)));
                        continue;
                    }
                }
                let ms = self.forward_only_ms(&plan);
                // A plan must be faster by more than rounding to displace one streaming less.
                if best.as_ref().is_none_or(|(b, _, _)| ms < b * (1.0 - 1e-9)) {
                    best = Some((ms, plan, peak));
                }
            }
        }
        match best {
            Some((ms, plan, peak)) => Ok(Planned {
                streamed_bytes: self
                    .blocks
                    .iter()
                    .zip(self.streamed_marks(&plan))
                    .filter(|&(_, s)| s)
                    .map(|(b, _)| Self::on_device_bytes(&plan, b))
                    .sum(),
                slowdown: ms / resident_ms,
                plan,
                peak,
            }),
            None => Err(NoPlan {
                budget,
                minimum,
                host: host_least.map(|least| (least, host_room.unwrap_or(0))),
            }),
        }
    }

    /// `plan` (a [`MemoryProfile::forward_plan`]) in words: what it streams, how far ahead
    /// and where the conditioning products are computed (`Plan`'s `Display` speaks of a
    /// step's checkpoints and backward).
    pub fn describe_forward(&self, plan: &Plan) -> String {
        match plan.streamed.len() {
            0 => "every block resident".into(),
            n => format!(
                "{n} of {} blocks streamed from host memory, fetched {} ahead{}",
                self.blocks.len(),
                plan.prefetch.max(1),
                match plan.host_products {
                    true => ", conditioning products on the host",
                    false => "",
                }
            ),
        }
    }
}
