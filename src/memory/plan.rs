//! The memory planner: a model's memory profile (bytes of weights, inputs and activations per
//! block), the peak a plan predicts from it, and the fastest plan that fits a budget.
//!
//! What a training step holds on the device, by plan:
//! - every weight outside the streamed blocks (non-block weights always), plus, when blocks
//!   stream, the copies of the streamed blocks on the device at the step's heaviest moment,
//!   found place by place beside what the blocks hold for the backward
//!   (`MemoryProfile::layout`: each copy its own block's bytes);
//! - the trainable adapters, their gradients and the optimizer state;
//! - per block, for the backward: all it saves when resident; only its inputs when
//!   checkpointed (plus what it keeps: attention's output and log-sum-exp, the
//!   down-projections' outputs); and, while a checkpointed block is re-run and
//!   backpropagated, that block's saved activations and the gradients of its inputs;
//! - a fixed margin (the sample, the loss, transient buffers).
//!
//! The candidates: no, every n-th (n = 4, 3, 2) or every block checkpointed, with 0 to all
//! blocks streamed from host memory (the smallest blocks first: they free the most memory for
//! their copies; streamed blocks are always checkpointed), and with nothing streamed every
//! block but the first j (j in sixteenths of the blocks); with a prefetch of 5 down to 1, what
//! checkpointed blocks keep (attention, the down-projections, both or neither), block inputs
//! offloaded or not, streamed weights coded or not (the carried blocks, which only the
//! backward uploads, uncoded or not: `Plan::uncoded_carry`), the forward fetching deeper while the
//! memory its checkpoints will take is free (and the backward leaving those blocks for it:
//! `MemoryProfile::reach`); the last streams every block with a prefetch of one. They are ordered by
//! a time model (`MemoryProfile::step_ms`, `cost_model`) built from each block's work (its
//! FLOPs, attention, memory traffic and ops, from the model's own shapes) and the machine's
//! measured rates (`Machine`), which plays the step's compute and its uploads on two clocks:
//! recompute costs each checkpointed block its forward less what it keeps, and a block whose
//! upload has not arrived waits for it. On an H100 or H200 the host link (47-51 GiB/s)
//! uploads a Flux block in 2-4 times its forward, so once the compute stops hiding them, the
//! copies set the step. A budget under the last plan's peak cannot be met: `plan` says the
//! minimum.

use crate::autograd::Keep;
use crate::memory::Checkpointing;
use crate::{Error, Result};

/// One block's sizes, for one batch (all zero by default).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct BlockCost {
    /// The block's key prefix (`double_blocks.3`).
    pub prefix: String,
    /// Bytes of its frozen weights as stored on the device (bf16, or FP8 codes + scales).
    pub weight_bytes: u64,
    /// Bytes of those weights on the host link when bf16 weights cross coded
    /// (`crate::backend::wire`; estimated from their sizes at the code's ratio on normal
    /// values).
    pub wire_bytes: u64,
    /// Bytes of the coded weights among `wire_bytes` (the staging an upload needs).
    pub coded_bytes: u64,
    /// Bytes of its largest coded weight on the link: with its uncoded weights' bytes
    /// (`wire_bytes - coded_bytes`, which cross as one run), the largest part a piece of its
    /// upload takes in the staging ring (`wire::staging_ring_bytes`).
    pub largest_coded: u64,
    /// Bytes of its inputs: what a checkpoint keeps.
    pub input_bytes: u64,
    /// Bytes its forward keeps for the backward when it runs resident.
    pub saved_bytes: u64,
    /// Bytes of attention outputs and log-sum-exps that `Keep { attention }` keeps.
    pub attention_bytes: u64,
    /// Bytes of down-projection outputs that `Keep { down_projections }` keeps.
    pub down_bytes: u64,
    /// Bytes of its down-projections' weights (as stored), whose share of the block's work
    /// (and of its FP8 decodes) the re-run skips when their outputs are kept.
    pub down_weight_bytes: u64,
    /// FLOPs of its forward's products with its weights (Linears and convolutions: twice
    /// the positions each weight multiplies times its values), for the time model.
    pub gemm_flops: f64,
    /// Of those, the down-projections' (`down_weight_bytes`), which a re-run skips when their
    /// outputs are kept.
    pub down_flops: f64,
    /// Of `gemm_flops`, those of the block's tails (`BlockShape::tails`): Linears whose
    /// output no gradient of a re-run reads, which no re-run runs and no `Keep` keeps
    /// (`nn::Linear::forward_tail`); not among the down-projections'.
    pub tail_flops: f64,
    /// Of `conv_flops`, those of the block's tail convolutions (an SDXL ResBlock's `conv2`
    /// where it ends its unit), which no re-run runs either.
    pub tail_conv_flops: f64,
    /// Bytes of the tails' weights as stored (their share of a re-run's FP8 decodes).
    pub tail_weight_bytes: u64,
    /// FLOPs of its convolutions' forward (weights of four dimensions), apart from
    /// `gemm_flops`: they run at the machine's convolution rate.
    pub conv_flops: f64,
    /// FLOPs of its attention calls' forward (4 · queries · keys · width a call).
    pub attention_flops: f64,
    /// The width of its attention heads (the flash kernels' rate depends on it).
    pub head_dim: usize,
    /// Ops its forward records on the tape that launch work (`BlockShape::ops`): the host
    /// issues each, and each one's backward.
    pub ops: f64,
    /// Views its forward records (`BlockShape::views`).
    pub views: f64,
    /// Its weight tensors (an upload decodes its coded ones up to `wire::DECODE_BATCH` a
    /// launch).
    pub tensors: usize,
    /// Device memory its adapters' forward reads and writes beside the base's: each adapted
    /// layer reads its input again and adds into its output (the adapters' own products are
    /// a few columns wide: their time is their memory's).
    pub adapter_forward_bytes: u64,
    /// The same for their backward: the input read again for the adapter's gradients, the
    /// output's gradient read, and the input's gradient added into.
    pub adapter_backward_bytes: u64,
    /// Bytes of FP8 codes among its weights, decoded to the compute dtype at each use (the
    /// forward, a checkpoint's re-run, the backward); 0 for bf16 weights.
    pub decode_bytes: u64,
    /// Bytes of FP8 codes among its weights multiplied in 8 bits, never decoded
    /// (`model.compute = "fp8"`): like `decode_bytes`, weights held as codes.
    pub product_bytes: u64,
    /// Of `gemm_flops`, those of the Linears computing in 8 bits (`product_bytes`'s), at
    /// the machine's 8-bit product rate.
    pub product_flops: f64,
    /// Bytes of its weights that only the forward reads under `Keep::few_rows` (Linears over
    /// the conditioning vector, `BlockShape::conditioned`), as stored: the backward's uploads
    /// leave them out, and with `Plan::host_products` both passes'.
    pub forward_only_bytes: u64,
    /// The same weights' bytes on the host link (coded or not), and of those coded.
    pub forward_only_wire: u64,
    /// Of `forward_only_wire`, the coded bytes.
    pub forward_only_coded: u64,
    /// Bytes of its weights whose Linears take the model's context and see few rows under
    /// `Keep::few_rows` (SDXL's cross-attention keys and values over the text tokens,
    /// `BlockShape::context_keys`), as stored: only the forward reads them, so the
    /// backward's uploads leave them out; with `Plan::ahead_products` the backward brings
    /// them and computes their products for the next forward, whose uploads leave them out
    /// instead.
    pub context_bytes: u64,
    /// The same weights' bytes on the host link (coded or not), and of those coded.
    pub context_wire: u64,
    /// Of `context_wire`, the coded bytes.
    pub context_coded: u64,
    /// Bytes of those weights' products over one step's context (kept from the backward
    /// to the next forward under `Plan::ahead_products`).
    pub context_product_bytes: u64,
    /// Bytes its FP8 weights' backward keeps beside them while the block stays on the
    /// device (their transposed codes with 8-bit products, `nn::Fp8Kept`); none streamed.
    pub kept_bytes: u64,
}

/// The sizes the planner works from.
#[derive(Clone, Debug, PartialEq)]
pub struct MemoryProfile {
    /// The blocks in execution order.
    pub blocks: Vec<BlockCost>,
    /// Bytes of the weights outside the blocks (embedders, final layer), always resident.
    pub other_weight_bytes: u64,
    /// Bytes those weights' backward keeps beside them (`BlockCost::kept_bytes`) unless the
    /// plan remakes the transposes (`Plan::remake_transposes`).
    pub other_kept_bytes: u64,
    /// Bytes of the trainable parameters (f32 adapters); their gradients take as much again.
    pub trainable_bytes: u64,
    /// Bytes of the optimizer state.
    pub optimizer_bytes: u64,
    /// The sample, the loss, transient buffers and the step's compute copies of the
    /// adapters' weights (their gradients take the place of the f32 ones until the fold).
    pub fixed_bytes: u64,
    /// The machine the time model plays a step on (`Machine::REFERENCE` unless measured:
    /// `memory::measure_machine`).
    pub machine: Machine,
    /// The code of the blocks' 8-bit products (`BlockCost::product_flops`), whose measured
    /// rate the time model plays them at.
    pub product_code: crate::backend::fp8::Code8,
}

/// The terms of a step's predicted peak under a plan ([`MemoryProfile::peak_parts`]), bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PeakParts {
    /// The weights on the device throughout: those outside the blocks and the resident
    /// blocks' (with the transposes their FP8 backward keeps).
    pub weights: u64,
    /// The staging ring of coded uploads.
    pub staging: u64,
    /// The trainable parameters and their gradients.
    pub adapters: u64,
    /// The optimizer's state.
    pub optimizer: u64,
    /// What the blocks hold for the backward and the streamed blocks' copies at the
    /// heaviest moment, with the offloaded inputs' copies on the device.
    pub held: u64,
    /// The largest block's backward: a checkpointed block's re-run tape and its inputs'
    /// gradients.
    pub work: u64,
    /// The sample, the loss, transients and the adapters' compute copies.
    pub fixed: u64,
}

impl PeakParts {
    /// Their sum: the predicted peak.
    pub fn total(&self) -> u64 {
        self.weights
            + self.staging
            + self.adapters
            + self.optimizer
            + self.held
            + self.work
            + self.fixed
    }
}

impl std::fmt::Display for PeakParts {
    /// GiB of each term: `weights 1.20 + staging 0.00 + ...`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let g = |b: u64| b as f64 / (1u64 << 30) as f64;
        write!(
            f,
            "weights {:.2} + staging {:.2} + adapters {:.2} + optimizer {:.2} + held {:.2} + \
             work {:.2} + fixed {:.2} GiB",
            g(self.weights),
            g(self.staging),
            g(self.adapters),
            g(self.optimizer),
            g(self.held),
            g(self.work),
            g(self.fixed)
        )
    }
}

/// The machine the time model plays a plan's step on: the rates of the work a step is made
/// of, measured on it (`memory::measure_machine`). The planner's choice turns on how the link
/// compares with the compute: a slower link (PCIe 3 or 4 on a desktop card) makes uploads
/// dearer and the wire code worth its decodes; a slower GPU makes them cheaper; a slower
/// host makes a step of many small kernels (SDXL's UNet) wait on the host's issue.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Machine {
    /// The host-to-device rate of a streamed block's upload, GiB/s.
    pub upload_gib_per_s: f64,
    /// The same for a coded upload (the wire code), which crosses into the staging ring in
    /// pieces beside the decodes, GiB of coded bytes a second.
    pub coded_upload_gib_per_s: f64,
    /// The host link's two directions at once: a block's upload beside a copy of as many
    /// bytes out (an offloaded block input's), GiB/s of both together. Where it is less than
    /// twice `upload_gib_per_s` the directions share the host's side of the link, and a copy
    /// out slows the uploads beside it. 0: not measured, each direction played at its own
    /// full rate.
    #[serde(default)]
    pub duplex_gib_per_s: f64,
    /// bf16 GEMMs at a transformer block's Linears, forward and input gradient, TFLOP/s.
    pub gemm_tflops: f64,
    /// bf16 convolutions (3x3, forward and input gradient), TFLOP/s.
    pub conv_tflops: f64,
    /// Flash attention's forward at head widths 64 and 128, TFLOP/s (4·B·H·Lq·Lk·D a call).
    pub attention_tflops: [f64; 2],
    /// Its backward at head widths 64 and 128, TFLOP/s (2.5x the forward's FLOPs).
    pub attention_backward_tflops: [f64; 2],
    /// Elementwise work over device memory, GiB/s read and written.
    pub memory_gib_per_s: f64,
    /// The host's time to issue one recorded op (checks, allocation, tape, launch), µs.
    pub op_us: f64,
    /// The host's time for one recorded op's backward (its VJP's kernels), µs.
    pub backward_op_us: f64,
    /// The host's time for one recorded view (a reshape, permute, narrow or broadcast), µs.
    pub view_us: f64,
    /// The host's time for one recorded view's backward, µs.
    pub backward_view_us: f64,
    /// The host's time to issue one op that records nothing (a checkpointed block's forward,
    /// whose ops build no tape: its re-run records them), µs. 0: not measured (a record
    /// from before it was), `op_us` played instead.
    #[serde(default)]
    pub unrecorded_op_us: f64,
    /// The same for a view, µs. 0: not measured, `view_us` played instead.
    #[serde(default)]
    pub unrecorded_view_us: f64,
    /// Decoding weights that crossed the link coded, beside each kind of the compute's
    /// work (`Beside`: GEMMs, attention, elementwise), GiB of coded bytes a second: the
    /// decodes share the GPU with the step's kernels, and how fast they run turns on what
    /// those kernels need of it.
    pub wire_decode_gib_per_s: [f64; 3],
    /// What those decodes take from each kind of work beside them, ms a GiB coded.
    pub wire_decode_cost_ms_per_gib: [f64; 3],
    /// Decoding FP8 codes to bf16 before a matmul, GiB of codes a second.
    pub fp8_decode_gib_per_s: f64,
    /// A frozen Linear's 8-bit product as it runs (`model.compute = "fp8"`: its input
    /// quantized a token at a time, one FP8 GEMM; in the backward the output gradient
    /// quantized and multiplied by the kept transposed codes) at a transformer block's
    /// Linears, forward and input gradient, TFLOP/s of the product. 0: not measured (a GPU
    /// without FP8 tensor cores, or a record from before it was), the bf16 GEMMs' rate
    /// played instead.
    #[serde(default)]
    pub fp8_product_tflops: f64,
    /// The same with int8 codes (`model.compute = "int8"`: i32 sums, then the scales in a
    /// pass over the output), TFLOP/s. 0: not measured (a GPU without int8 tensor cores, or a
    /// record from before it was), the bf16 GEMMs' rate played instead.
    #[serde(default)]
    pub int8_product_tflops: f64,
    /// The host's products of weights it holds (`Plan::host_products`), GiB of weights a
    /// second.
    pub host_product_gib_per_s: f64,
}

impl Machine {
    /// The machine a profile plays until one is measured: an NVIDIA H100 80GB SXM on its
    /// 16-core host, from the measurements in BENCHMARKS.md (2026-11): the host link 47 GiB/s
    /// (a streamed block's uploads, 46.2-48.7, coded or not), cuBLAS at Flux's MLP shape 796.9 TFLOP/s,
    /// FLAME's 3x3 convolution at SDXL's first level 302 TFLOP/s, the flash kernels 473 / 422
    /// (D = 64, L 4096) and 580 / 490 (D = 128, Flux's shape) TFLOP/s forward / backward, a
    /// device copy 2744 GB/s, the wire code's decodes 5.3 ms a GiB beside the compute and
    /// 3.3 ms a GiB taken from it (measured beside GEMMs, played beside every kind of work), FP8 decodes 1.6 ms a GiB, the host products 35 GiB/s; the
    /// host's costs of an op (4.4 µs, 9.3 its backward) and of a view (2.4 µs, 1.1) from
    /// `measure_machine` on an H200 machine of the same kind (16 cores, 2026-11-29).
    pub const REFERENCE: Machine = Machine {
        upload_gib_per_s: 47.0,
        coded_upload_gib_per_s: 47.0,
        duplex_gib_per_s: 0.0,
        gemm_tflops: 796.9,
        conv_tflops: 302.0,
        attention_tflops: [473.0, 580.0],
        attention_backward_tflops: [422.0, 490.0],
        memory_gib_per_s: 2744e9 / (1u64 << 30) as f64,
        op_us: 4.4,
        backward_op_us: 9.3,
        view_us: 2.4,
        backward_view_us: 1.1,
        unrecorded_op_us: 0.0,
        unrecorded_view_us: 0.0,
        wire_decode_gib_per_s: [1e3 / 5.3; 3],
        wire_decode_cost_ms_per_gib: [3.3; 3],
        fp8_decode_gib_per_s: 1e3 / 1.6,
        fp8_product_tflops: 0.0,
        int8_product_tflops: 0.0,
        host_product_gib_per_s: 35.0,
    };

    /// The host's time to issue an op that records nothing, µs (`unrecorded_op_us`, or
    /// `op_us` where that was not measured).
    pub fn unrecorded_op(&self) -> f64 {
        if self.unrecorded_op_us > 0.0 {
            self.unrecorded_op_us
        } else {
            self.op_us
        }
    }

    /// The same for a view (`unrecorded_view_us`, or `view_us`).
    pub fn unrecorded_view(&self) -> f64 {
        if self.unrecorded_view_us > 0.0 {
            self.unrecorded_view_us
        } else {
            self.view_us
        }
    }

    /// Every rate positive (a decode may be infinitely fast: nothing to decode).
    pub fn check(&self) -> std::result::Result<(), String> {
        let rates = [
            ("the host link", self.upload_gib_per_s),
            ("the host link, coded", self.coded_upload_gib_per_s),
            ("GEMMs", self.gemm_tflops),
            ("convolutions", self.conv_tflops),
            ("attention at D 64", self.attention_tflops[0]),
            ("attention at D 128", self.attention_tflops[1]),
            (
                "attention's backward at D 64",
                self.attention_backward_tflops[0],
            ),
            (
                "attention's backward at D 128",
                self.attention_backward_tflops[1],
            ),
            ("device memory", self.memory_gib_per_s),
            (
                "coded weights' decodes beside GEMMs",
                self.wire_decode_gib_per_s[0],
            ),
            (
                "coded weights' decodes beside attention",
                self.wire_decode_gib_per_s[1],
            ),
            (
                "coded weights' decodes beside elementwise work",
                self.wire_decode_gib_per_s[2],
            ),
            ("FP8 decodes", self.fp8_decode_gib_per_s),
            ("host products", self.host_product_gib_per_s),
        ];
        for (what, r) in rates {
            if r.is_nan() || r <= 0.0 {
                return Err(format!("the machine's rate for {what} is {r}"));
            }
        }
        if self.duplex_gib_per_s.is_nan() || self.duplex_gib_per_s < 0.0 {
            return Err(format!(
                "the machine's rate for the link both ways is {}",
                self.duplex_gib_per_s
            ));
        }
        for (what, r) in [
            ("FP8", self.fp8_product_tflops),
            ("int8", self.int8_product_tflops),
        ] {
            if r.is_nan() || r < 0.0 {
                return Err(format!("the machine's rate for {what} products is {r}"));
            }
        }
        for (what, us) in [
            ("an op", self.op_us),
            ("an op's backward", self.backward_op_us),
            ("a view", self.view_us),
            ("a view's backward", self.backward_view_us),
            ("an op that records nothing", self.unrecorded_op_us),
            ("a view that records nothing", self.unrecorded_view_us),
            (
                "a GiB decoded beside GEMMs",
                self.wire_decode_cost_ms_per_gib[0] * 1e3,
            ),
            (
                "a GiB decoded beside attention",
                self.wire_decode_cost_ms_per_gib[1] * 1e3,
            ),
            (
                "a GiB decoded beside elementwise work",
                self.wire_decode_cost_ms_per_gib[2] * 1e3,
            ),
        ] {
            if !(us.is_finite() && us >= 0.0) {
                return Err(format!("the host's time for {what} is {us} µs"));
            }
        }
        Ok(())
    }

    /// A copy out of `gib` GiB that starts while the uploads keep the link busy for
    /// `busy_ms` more: its own time and the time it takes from those uploads, ms. Beside
    /// uploads each direction runs at half of `duplex_gib_per_s` (where that is less than an
    /// upload's own rate, the uploads lose the difference for as long as both run); alone,
    /// or on a machine whose two directions were not measured, at the upload's rate.
    pub fn copy_out_ms(&self, gib: f64, busy_ms: f64) -> (f64, f64) {
        let r = self.upload_gib_per_s.max(1e-3);
        let alone = gib / r * 1e3;
        if self.duplex_gib_per_s <= 0.0 || busy_ms <= 0.0 {
            return (alone, 0.0);
        }
        let half = (self.duplex_gib_per_s / 2.0).min(r);
        let beside = gib / half * 1e3;
        // The part of the copy that runs beside the uploads.
        let both = beside.min(busy_ms);
        let own = both + (1.0 - both / beside) * alone;
        (own, both * (1.0 - half / r))
    }

    /// The rate 8-bit products in `code` play at, TFLOP/s: the measured one, or the bf16
    /// GEMMs'.
    fn product_rate(&self, code: crate::backend::fp8::Code8) -> f64 {
        let measured = match code {
            crate::backend::fp8::Code8::E4m3 => self.fp8_product_tflops,
            crate::backend::fp8::Code8::Int8 => self.int8_product_tflops,
        };
        if measured > 0.0 {
            measured
        } else {
            self.gemm_tflops
        }
    }

    /// Attention's (forward, backward) rate at head width `d`, TFLOP/s: the measured widths
    /// 64 and 128, linear between them, the nearer one outside.
    fn attention_rates(&self, d: usize) -> (f64, f64) {
        let f = ((d as f64 - 64.0) / 64.0).clamp(0.0, 1.0);
        let mix = |r: [f64; 2]| r[0] + (r[1] - r[0]) * f;
        (
            mix(self.attention_tflops),
            mix(self.attention_backward_tflops),
        )
    }
}

impl std::fmt::Display for Machine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "host link {:.1} GiB/s ({:.1} coded, {:.1} both ways at once), GEMM {:.0} and convolution {:.0} TFLOP/s, attention {:.0}/{:.0} (D 64) and \
             {:.0}/{:.0} (D 128) TFLOP/s forward/backward, memory {:.0} GiB/s, {:.1}/{:.1} µs \
             an op and its backward on the host and {:.1}/{:.1} a view ({:.1} and {:.1} recording \
             nothing), coded decodes beside GEMMs, attention \
             and elementwise work {:.0}/{:.0}/{:.0} GiB/s costing them {:.1}/{:.1}/{:.1} ms a GiB, FP8 \
             decodes {:.0} GiB/s, 8-bit products {:.0} (FP8) and {:.0} (int8) TFLOP/s, host products {:.1} GiB/s",
            self.upload_gib_per_s,
            self.coded_upload_gib_per_s,
            self.duplex_gib_per_s,
            self.gemm_tflops,
            self.conv_tflops,
            self.attention_tflops[0],
            self.attention_backward_tflops[0],
            self.attention_tflops[1],
            self.attention_backward_tflops[1],
            self.memory_gib_per_s,
            self.op_us,
            self.backward_op_us,
            self.view_us,
            self.backward_view_us,
            self.unrecorded_op(),
            self.unrecorded_view(),
            self.wire_decode_gib_per_s[0],
            self.wire_decode_gib_per_s[1],
            self.wire_decode_gib_per_s[2],
            self.wire_decode_cost_ms_per_gib[0],
            self.wire_decode_cost_ms_per_gib[1],
            self.wire_decode_cost_ms_per_gib[2],
            self.fp8_decode_gib_per_s,
            self.fp8_product_tflops,
            self.int8_product_tflops,
            self.host_product_gib_per_s
        )
    }
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
    /// With `offload_inputs`, the outputs checkpointed blocks keep (`keep`'s attention and
    /// down-projections) wait in host memory too (`InputOffload::keeping_outputs`): copied
    /// out on the link's idle direction in the forward, back beside the backward's uploads.
    pub offload_kept: bool,
    /// Streamed bf16 weights cross the host link in its lossless code
    /// (`BlockStreamer::set_wire_code`): fewer bytes copied, a staging ring on the device.
    pub wire_code: bool,
    /// With `wire_code`, the first streamed blocks, those the backward leaves on the device
    /// for the next forward (`carry`), cross uncoded: only the backward uploads them, and
    /// its link has time to spare where the decodes beside its kernels would slow them
    /// (their decodes take the compute's time). Their device copies are the same.
    pub uncoded_carry: bool,
    /// With `wire_code`, the backward's uploads cross uncoded, the forward's coded
    /// (`BlockStreamer::set_raw_backward`): where the backward is paced by its re-runs and
    /// products, its link has time to spare for the raw bytes, and their decodes leave the
    /// kernels beside them. The streamer then keeps each coded block's raw bytes in host
    /// memory beside its code (`MemoryProfile::raw_backward_host_bytes` more pinned memory).
    /// The device copies are the same.
    pub raw_backward: bool,
    /// Streamed blocks' Linears over the model's context that only the forward reads
    /// (`BlockCost::context_bytes`: SDXL's cross-attention keys and values) get their
    /// products over the next forward's context in the backward before, from the input
    /// the trainer announces there (`BlockStreamer::set_ahead_products`): their weights move
    /// from the forward's uploads to the backward's, and the products are held between.
    pub ahead_products: bool,
    /// With `wire_code`, the backward's end crosses the coded bytes of the next forward's
    /// first uploads into the staging ring, idle with the link from the backward's last
    /// upload to that forward's first (`BlockStreamer::set_cross_ahead`): those bytes leave
    /// the forward's link.
    pub cross_ahead: bool,
    /// The forward fetches as far ahead as the memory its checkpoints have not yet taken
    /// allows, and the backward leaves that many blocks on the device for the next forward
    /// (`MemoryProfile::reach`, `BlockStreamer::set_reach`): fewer uploads in the forward,
    /// at no cost to the peak. Off, each pass fetches `prefetch` ahead and leaves
    /// `prefetch + 1`.
    pub deep_prefetch: bool,
    /// Streamed blocks' Linears over the conditioning vector keep their weights in host
    /// memory and get their products from the host (`BlockStreamer::set_host_products`):
    /// those weights (`BlockCost::forward_only_bytes`, where they are floating-point) never
    /// cross the link nor take device memory.
    pub host_products: bool,
    /// Resident blocks' 8-bit weights transpose their codes at each backward, as streamed
    /// blocks' do, instead of keeping the transposed codes beside them (`nn::Fp8Kept`): the
    /// codes' bytes less on the device (`BlockCost::kept_bytes`) for a pass over them in
    /// each backward. Nothing without 8-bit products.
    pub remake_transposes: bool,
    /// Worked out by [`MemoryProfile::settle`] from the fields above: how far the forward
    /// fetches ahead of each streamed block, by its place among them (`deep_prefetch`,
    /// `BlockStreamer::set_reach`); empty: `prefetch` ahead.
    pub reach: Vec<usize>,
    /// Worked out by [`MemoryProfile::settle`]: how many of the first streamed blocks cross
    /// uncoded though the wire code is on (`uncoded_carry`,
    /// `BlockStreamer::set_uncoded_first`).
    pub uncoded_first: usize,
    /// Each checkpointed block's re-run is issued on a second host thread while the backward
    /// of the block after it is issued (`autograd::ahead`): where the host's issue of many
    /// small kernels paces the step, the re-runs' issue leaves the walk's. The next re-run's
    /// activations and its streamed block then live beside each block's backward.
    pub rerun_ahead: bool,
}

impl Plan {
    /// Whether the outputs checkpointed blocks keep wait in host memory: `offload_kept` with
    /// the inputs offloaded and something kept (the few-row outputs stay).
    pub fn offloads_kept(&self) -> bool {
        self.offload_kept
            && self.offload_inputs
            && (self.keep.attention || self.keep.down_projections)
    }

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
            Checkpointing::Every(n) => format!(
                "every {n}{} block checkpointed",
                match n {
                    2 => "nd",
                    3 => "rd",
                    _ => "th",
                }
            ),
            Checkpointing::AllBut(n) => format!("every block but the first {n} checkpointed"),
        };
        write!(f, "{ck}")?;
        if self.keep.attention {
            write!(f, ", attention kept")?;
        }
        if self.keep.down_projections {
            write!(f, ", down-projections kept")?;
        }
        let checkpointed = self.checkpointing != Checkpointing::Off || !self.streamed.is_empty();
        if self.keep.few_rows && checkpointed {
            write!(f, ", few-row outputs kept")?;
        }
        if self.offloads_kept() {
            write!(f, ", block inputs and kept outputs in host memory")?;
        } else if self.offload_inputs {
            write!(f, ", block inputs in host memory")?;
        }
        if !self.streamed.is_empty() {
            write!(
                f,
                ", {} blocks streamed from host memory (prefetch {}{}{})",
                self.streamed.len(),
                self.prefetch,
                if self.deep_prefetch {
                    ", deeper while memory allows"
                } else {
                    ""
                },
                if self.wire_code { ", coded" } else { "" }
            )?;
            if self.wire_code && self.raw_backward {
                write!(f, ", the backward's uploads uncoded")?;
            } else if self.wire_code && self.uncoded_carry {
                write!(f, ", the carried blocks uncoded")?;
            }
            if self.host_products {
                write!(f, ", conditioning products on the host")?;
            }
            if self.ahead_products {
                write!(f, ", context products computed in the backward before")?;
            }
        }
        if self.remake_transposes {
            write!(f, ", 8-bit weights transposed at each backward")?;
        }
        if self.rerun_ahead && checkpointed {
            write!(f, ", re-runs issued ahead")?;
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
    /// Bytes copied from host memory per step (each streamed block twice, the forward and
    /// the backward's re-run, but those each pass leaves on the device for the next).
    pub streamed_bytes: u64,
    /// The time model's step under the plan against the resident step's
    /// (`MemoryProfile::step_ms` over `resident_ms`).
    pub slowdown: f64,
}

/// A candidate plan with the weights the planner takes it by: the time model's cost
/// ([`MemoryProfile::cost`]), the predicted peak ([`MemoryProfile::peak`]), whether it is
/// held to a margin ([`MemoryProfile::spare`]) and its pinned host memory
/// ([`MemoryProfile::host_bytes`]), taken once where the candidates are made
/// ([`MemoryProfile::weighed_candidates`], [`Weighed::new`]) and read again by the choice
/// ([`MemoryProfile::plan_among`], [`MemoryProfile::plan_within`]). Each weight is the
/// profile's for this `plan`: a plan changed afterwards is weighed again.
#[derive(Clone, Debug, PartialEq)]
pub struct Weighed {
    /// The plan.
    pub plan: Plan,
    /// The time model's step under the plan beyond the resident step, as a fraction of it.
    pub cost: f64,
    /// Predicted peak bytes on the device.
    pub peak: u64,
    /// Whether the plan is held to its budget less `MARGIN_DIVISOR`'s share
    /// ([`MemoryProfile::spare`]).
    pub spare: bool,
    /// Its pinned host memory ([`MemoryProfile::host_bytes`]).
    pub host: u64,
}

impl Weighed {
    /// `plan` with its weights under `profile`.
    pub fn new(profile: &MemoryProfile, plan: Plan) -> Weighed {
        let times = profile.block_times_for(&plan);
        Weighed::with_times(profile, plan, &times)
    }

    /// `new` with the profile's blocks' times made already (`MemoryProfile::block_times`):
    /// weighing many plans of one profile.
    /// The plan's blocks are marked and laid out once for its step, peak and margin
    /// (`Placed`): each of those took them again (about a third of SDXL's planning).
    pub(crate) fn with_times(profile: &MemoryProfile, plan: Plan, times: &BlockTimes) -> Weighed {
        let placed = profile.placed(&plan);
        Weighed {
            cost: profile.cost_placed(&plan, times, &placed),
            peak: profile.peak_parts_placed(&plan, &placed).total(),
            spare: MemoryProfile::spare_within(&plan, &placed.layout.reach),
            host: profile.host_bytes_placed(&plan, &placed),
            plan,
        }
    }
}

/// What [`MemoryProfile::plan_among`] chooses among: plans, weighed there, or plans weighed
/// already (owned, or borrowed from a list the caller keeps: only the chosen one is copied).
pub trait Candidate: Send + Sync + Sized {
    /// The plan.
    fn plan(&self) -> &Plan;
    /// The plan's predicted peak, and the time model's cost where that peak fits `budget`
    /// (`None` else: a plan weighed here is not costed then).
    fn weights(&self, profile: &MemoryProfile, budget: u64) -> (u64, Option<f64>);
    /// The plan's pinned host memory (`MemoryProfile::host_bytes`).
    fn host_bytes(&self, profile: &MemoryProfile) -> u64;
    /// The plan, owned.
    fn into_plan(self) -> Plan;
}

impl Candidate for Plan {
    fn plan(&self) -> &Plan {
        self
    }
    fn weights(&self, profile: &MemoryProfile, budget: u64) -> (u64, Option<f64>) {
        let peak = profile.peak(self);
        (
            peak,
            profile.fits(self, peak, budget).then(|| profile.cost(self)),
        )
    }
    fn host_bytes(&self, profile: &MemoryProfile) -> u64 {
        profile.host_bytes(self)
    }
    fn into_plan(self) -> Plan {
        self
    }
}

impl Candidate for Weighed {
    fn plan(&self) -> &Plan {
        &self.plan
    }
    fn weights(&self, _: &MemoryProfile, budget: u64) -> (u64, Option<f64>) {
        let fits = MemoryProfile::fits_within(self.peak, budget, self.spare);
        (self.peak, fits.then_some(self.cost))
    }
    fn host_bytes(&self, _: &MemoryProfile) -> u64 {
        self.host
    }
    fn into_plan(self) -> Plan {
        self.plan
    }
}

impl Candidate for &Weighed {
    fn plan(&self) -> &Plan {
        &self.plan
    }
    fn weights(&self, profile: &MemoryProfile, budget: u64) -> (u64, Option<f64>) {
        (*self).weights(profile, budget)
    }
    fn host_bytes(&self, profile: &MemoryProfile) -> u64 {
        (*self).host_bytes(profile)
    }
    fn into_plan(self) -> Plan {
        self.plan.clone()
    }
}

/// Plans that mix resident-activation blocks with streamed ones are held to the budget less
/// 1/32 of it: their predicted peak measured up to 1.6% under the real one (every 2nd block
/// checkpointed, 37 streamed: 23.27 predicted, 23.65 GiB measured); the others' predictions
/// measured over. So are plans whose forward fetches deeper than `prefetch`
/// (`MemoryProfile::spare`): their accounting holds (the peak measured under the prediction)
/// but the blocks fetched early, released as the checkpoints fill the memory, cut the cap's
/// arena into pieces: SD3.5-large within 8 GiB with 2.3% of it spare sent 3 requests a step
/// past the arena, while Flux-dev's plans with 3.4% and more sent none (H100).
pub const MARGIN_DIVISOR: u64 = 32;

/// Of the plans predicted equally fast (`cost_model::NEAR`), those whose predicted peak leaves
/// at least 1/16 of the budget spare go first, the one that copies the fewest bytes over the
/// host link leading. The link's rate moved by 5-10% between calls on the same machine
/// (46-51 GiB/s, H100) and the compute overlaps it less fully the closer the two are, so
/// a plan that leans less on it holds its step better than the model's tie says: SD3.5-large
/// within 16 GiB, 26 of 38 blocks streamed (10.2 GiB a step, the link busy for 213 of the
/// step's 260 ms) ran 1.33x of the resident step where the model put 13-17 streamed blocks
/// (3.9-6.0 GiB a step) within 1% of it (H200). Plans without that room keep the smallest
/// peak first (FP8 within 6 GiB: a plan predicted 0.7% under the cap sent 7 requests a step
/// past its arena).
pub const ROOM_DIVISOR: u64 = 16;

/// No plan fits the budget.
#[derive(Clone, Debug, PartialEq)]
pub struct NoPlan {
    /// The budget asked for.
    pub budget: u64,
    /// The smallest predicted peak of any plan (every block streamed, prefetch 1).
    pub minimum: u64,
    /// Where plans fit the device's budget but none the host's memory
    /// (`MemoryProfile::plan_within`): the least host memory among those plans
    /// (`MemoryProfile::host_bytes`) and the room there was, bytes.
    pub host: Option<(u64, u64)>,
}

/// The time model (`MemoryProfile::step_ms`) plays a step on two clocks, the compute
/// stream's and the host link's, from each block's work and the machine's rates
/// (`Machine`): a block's forward is its products with its weights at the GEMM rate, its
/// attention at the flash kernels' rate for its head width, its elementwise work as passes
/// over the activations it saves at the device memory's rate, and its FP8 decodes; or the
/// host's time to issue its ops, when that is longer (a step of many small kernels waits on
/// the host). Its backward is the input gradients' products (the base weights are frozen:
/// no weight gradient), attention's backward, twice the forward's passes over memory, and
/// the decodes again; a checkpointed block's re-run is its forward less what it keeps. A
/// streamed block's upload starts when its slot is free (the compute has reached the block
/// `prefetch` uploads before it) and the link is idle, and the block waits for it; coded
/// uploads are decoded after their copy, the decodes taking the compute's time. Nothing in
/// it is fitted to a model's steps: the constants below are counts of work.
pub mod cost_model {
    /// Passes over a block's saved activations in its forward: each is written by the op
    /// that makes it and read by the op after.
    pub const FORWARD_MEMORY_PASSES: f64 = 2.0;
    /// Passes over them in its backward: each saved value is read, and its gradient written
    /// and read, beside the gradients the ops sum.
    pub const BACKWARD_MEMORY_PASSES: f64 = 4.0;
    /// Attention's backward FLOPs over its forward's (FlashAttention's count: five products
    /// of the size of the forward's two).
    pub const ATTENTION_BACKWARD_FLOPS: f64 = 2.5;
    /// Host ops a streamed block's upload (or an offloaded input's copy, each way) issues
    /// besides a decode a coded tensor: the copy, its event and the compute's wait.
    pub const STREAM_OPS: f64 = 3.0;
    /// Plans predicted within this fraction of the fastest fitting one's step count as
    /// equally fast: of those the planner takes one with room (`ROOM_DIVISOR`) that leans
    /// least on the link, else the smallest peak, which leaves the allocator the most room
    /// (FP8 at 6 GiB: the fastest plan by 0.2%, predicted at 5.96 GiB, sent 7 requests a step
    /// past the cap's arena and held 7.01 GiB on the driver).
    pub const NEAR: f64 = 0.01;
    /// The host's issue with two threads issuing (`Plan::rerun_ahead`) against one: each
    /// thread's ops cost this much more (the driver's launch path, the allocator and the
    /// kernel table are shared). Measured: SDXL within 4 GiB, one plan (every block
    /// checkpointed, 71 of 91 streamed), five rounds in one process (H200, 2026-12-02):
    /// 218.4 ms a step serial, 197.5 with the re-runs ahead (0.90x); the model gives that
    /// ratio at 1.4 (182.6 and 163.8 ms).
    pub const AHEAD_ISSUE: f64 = 1.4;
}

/// Each block's times under the profile's machine, which every plan's step reads
/// (`MemoryProfile::block_times`): made once for all the candidates a planning weighs.
pub(crate) struct BlockTimes {
    /// The forward recorded (`forward_ms` with nothing kept) and recording nothing
    /// (`unrecorded_forward_ms`).
    forward: Vec<[f64; 2]>,
    /// The backward (`backward_ms`).
    backward: Vec<f64>,
    /// A checkpointed block's backward and re-run (`backward_rerun_ms`), by `rerun_slot`
    /// (NaN in a slot not made: `MemoryProfile::block_times_in`).
    rerun: Vec<[f64; 8]>,
    /// The transposes remade in a backward (`transpose_ms`).
    transpose: Vec<f64>,
    /// The coded decodes beside the forward and the backward (`decode_beside`).
    beside: Vec<[(f64, f64); 2]>,
    /// The resident step (`resident_ms`).
    resident: f64,
}

/// The resident step, ms, from each block's (forward, backward) in execution order.
fn resident_of(blocks: impl Iterator<Item = (f64, f64)>) -> f64 {
    blocks.map(|(f, b)| f + b).sum::<f64>().max(1e-9)
}

/// The slot of `BlockTimes::rerun` for what a plan keeps and whether its re-runs are
/// issued ahead (a re-run's time turns on the attention and down-projection outputs kept).
fn rerun_slot(kept: Keep, ahead: bool) -> usize {
    kept.attention as usize | (kept.down_projections as usize) << 1 | (ahead as usize) << 2
}

/// The streamed blocks' device copies under a plan (`MemoryProfile::layout`).
struct Layout {
    /// The forward's reach at each streamed place (`MemoryProfile::reach`).
    reach: Vec<usize>,
    /// The most bytes the blocks hold for the backward and the streamed copies take
    /// together at any moment of the step.
    held: u64,
}

impl Layout {
    /// How many of the first streamed blocks the backward leaves for the next forward
    /// under `plan` (`carry` of the reach).
    fn carried(&self, plan: &Plan) -> usize {
        carry(&self.reach, plan.prefetch.max(1))
    }
}

/// A plan's streamed blocks by place (`MemoryProfile::streamed_marks`) and their device
/// copies (`MemoryProfile::layout`): what each estimate of the plan reads (its step, peak,
/// ring and margin), made once where the plan is weighed.
struct Placed {
    marks: Vec<bool>,
    layout: Layout,
}

impl MemoryProfile {
    /// Bytes of streamed block `b`'s weights held in host memory under `plan` (as stored, on
    /// the link, coded): its forward-only weights with `Plan::host_products`, unless they are
    /// FP8 codes (the host products take floating-point weights). Their products are
    /// computed from the start of the backward before each forward (`DiffusionModel::prepare`).
    pub(super) fn host_held(plan: &Plan, b: &BlockCost) -> (u64, u64, u64) {
        if plan.host_products && Self::holdable(b) {
            (
                b.forward_only_bytes,
                b.forward_only_wire,
                b.forward_only_coded,
            )
        } else {
            (0, 0, 0)
        }
    }

    /// Whether `Plan::host_products` holds some of block `b`'s weights on the host: it has
    /// forward-only weights, and they are floating-point (not FP8 codes).
    pub(super) fn holdable(b: &BlockCost) -> bool {
        b.forward_only_bytes > 0 && b.decode_bytes == 0 && b.product_bytes == 0
    }

    /// Bytes of streamed block `b`'s weights on the device under `plan`: its weights less
    /// those held on the host for their products (`host_held`).
    pub(super) fn on_device_bytes(plan: &Plan, b: &BlockCost) -> u64 {
        b.weight_bytes.saturating_sub(Self::host_held(plan, b).0)
    }

    /// The resident step's predicted length, ms: every block's forward and backward.
    pub fn resident_ms(&self) -> f64 {
        resident_of(
            self.blocks
                .iter()
                .map(|b| (self.forward_ms(b, Keep::NONE), self.backward_ms(b))),
        )
    }

    /// Block `b`'s GPU work in its forward (less what `kept` outputs spare a re-run) or its
    /// `backward`, ms, by the kind of work (see `cost_model`): [GEMMs and convolutions,
    /// attention, elementwise traffic with the FP8 decodes]. A coded upload's decodes run
    /// beside this mix (`decode_beside`).
    fn work_ms(&self, b: &BlockCost, backward: bool, kept: Keep) -> [f64; 3] {
        self.pass_ms(b, backward, kept, false)
    }

    /// `work_ms`, and with `rerun` a checkpoint's re-run, which runs none of the block's
    /// tails (`BlockCost::tail_flops`).
    fn pass_ms(&self, b: &BlockCost, backward: bool, kept: Keep, rerun: bool) -> [f64; 3] {
        use cost_model::*;
        let m = &self.machine;
        let (forward_rate, backward_rate) = m.attention_rates(b.head_dim);
        // A re-run runs none of the tail convolutions.
        let conv_flops = if rerun && !backward {
            b.conv_flops - b.tail_conv_flops
        } else {
            b.conv_flops
        };
        let convolutions = conv_flops.max(0.0) / (m.conv_tflops * 1e9);
        // GEMM FLOPs at the bf16 rate and at the 8-bit products' (the products' share of
        // what runs).
        let gemms = |flops: f64| {
            let eight = if b.gemm_flops > 0.0 {
                b.product_flops * flops / b.gemm_flops
            } else {
                0.0
            };
            (flops - eight).max(0.0) / (m.gemm_tflops * 1e9)
                + eight / (m.product_rate(self.product_code) * 1e9)
        };
        if backward {
            return [
                gemms(b.gemm_flops) + convolutions,
                ATTENTION_BACKWARD_FLOPS * b.attention_flops / (backward_rate * 1e9),
                BACKWARD_MEMORY_PASSES * self.memory_ms(b.saved_bytes)
                    + self.memory_ms(b.adapter_backward_bytes)
                    + self.decode_ms(b),
            ];
        }
        // The share of its weights (and their products and decodes) in down-projections
        // whose outputs are kept, and in a re-run its tails'.
        let tails = if rerun {
            (b.tail_weight_bytes, b.tail_flops)
        } else {
            (0, 0.0)
        };
        let skipped = if kept.down_projections {
            (b.down_weight_bytes + tails.0, b.down_flops + tails.1)
        } else {
            tails
        };
        let down = if b.weight_bytes > 0 {
            skipped.0 as f64 / b.weight_bytes as f64
        } else {
            0.0
        };
        let gemm = b.gemm_flops - skipped.1;
        [
            gemms(gemm.max(0.0)) + convolutions,
            if kept.attention {
                0.0
            } else {
                b.attention_flops / (forward_rate * 1e9)
            },
            FORWARD_MEMORY_PASSES * self.memory_ms(b.saved_bytes)
                + self.memory_ms(b.adapter_forward_bytes)
                + self.decode_ms(b) * (1.0 - down),
        ]
    }

    /// Block `b`'s forward, ms, less what `kept` outputs spare a re-run: its GPU work or the
    /// host's issue of its ops, the longer (see `cost_model`).
    pub fn forward_ms(&self, b: &BlockCost, kept: Keep) -> f64 {
        let (gpu, host) = self.forward_parts(b, kept);
        gpu.max(host)
    }

    /// Block `b`'s forward (less what `kept` outputs spare a re-run), ms: (its GPU work, the
    /// host's issue of its ops).
    fn forward_parts(&self, b: &BlockCost, kept: Keep) -> (f64, f64) {
        self.run_parts(b, kept, false)
    }

    /// A checkpointed block's forward, ms: its GPU work as `forward_ms`'s, or the host's issue
    /// of its ops, which record nothing (the re-run records them), the longer.
    pub fn unrecorded_forward_ms(&self, b: &BlockCost) -> f64 {
        let m = &self.machine;
        let (gpu, _) = self.forward_parts(b, Keep::NONE);
        gpu.max((b.ops * m.unrecorded_op() + b.views * m.unrecorded_view()) / 1e3)
    }

    /// `forward_parts`, and with `rerun` a checkpoint's re-run (without the block's tails).
    fn run_parts(&self, b: &BlockCost, kept: Keep, rerun: bool) -> (f64, f64) {
        let m = &self.machine;
        let gpu: f64 = self.pass_ms(b, false, kept, rerun).iter().sum();
        (gpu, (b.ops * m.op_us + b.views * m.view_us) / 1e3)
    }

    /// Block `b`'s backward, ms (see `cost_model`).
    pub fn backward_ms(&self, b: &BlockCost) -> f64 {
        let (gpu, host) = self.backward_parts(b);
        gpu.max(host)
    }

    /// Block `b`'s backward, ms: (its GPU work, the host's issue of its ops).
    fn backward_parts(&self, b: &BlockCost) -> (f64, f64) {
        let m = &self.machine;
        let gpu: f64 = self.work_ms(b, true, Keep::NONE).iter().sum();
        (
            gpu,
            (b.ops * m.backward_op_us + b.views * m.backward_view_us) / 1e3,
        )
    }

    /// Whether issuing re-runs ahead (`Plan::rerun_ahead`) shortens some block's backward
    /// and re-run in the time model, whatever it keeps: only then do the candidates hold
    /// plans with it (a GPU-paced model's would tie with their serial twins and hold more).
    fn ahead_gains(&self) -> bool {
        self.blocks.iter().any(|b| {
            KEEPS.iter().any(|&k| {
                self.backward_rerun_ms(b, k, true) < 0.99 * self.backward_rerun_ms(b, k, false)
            })
        })
    }

    /// A checkpointed block's backward and re-run, ms: one after the other; or, with the
    /// re-run issued on the second host thread (`ahead`), the GPU work of both or either
    /// thread's issue, the longest (each thread's issue slowed by `cost_model::AHEAD_ISSUE`).
    fn backward_rerun_ms(&self, b: &BlockCost, kept: Keep, ahead: bool) -> f64 {
        let (gpu_back, host_back) = self.backward_parts(b);
        let (gpu_rerun, host_rerun) = self.run_parts(b, kept, true);
        if !ahead {
            return gpu_back.max(host_back) + gpu_rerun.max(host_rerun);
        }
        let issue = cost_model::AHEAD_ISSUE;
        (gpu_back + gpu_rerun)
            .max(host_back * issue)
            .max(host_rerun * issue)
    }

    /// A coded upload's decode beside block `b`'s forward (or its `backward`): (ms a GiB
    /// coded until the decode is done, ms a GiB it takes from the compute), the machine's
    /// figures beside GEMMs (convolutions with them), attention and elementwise work
    /// weighted by each one's share of the block's GPU time in that pass (`work_ms`).
    fn decode_beside(&self, b: &BlockCost, backward: bool) -> (f64, f64) {
        let m = &self.machine;
        let work = self.work_ms(b, backward, Keep::NONE);
        let total: f64 = work.iter().sum();
        let shares = if total > 0.0 {
            work.map(|w| w / total)
        } else {
            [1.0, 0.0, 0.0]
        };
        let mut until = 0.0;
        let mut cost = 0.0;
        for (k, share) in shares.iter().enumerate() {
            until += share * 1e3 / m.wire_decode_gib_per_s[k];
            cost += share * m.wire_decode_cost_ms_per_gib[k];
        }
        (until, cost)
    }

    /// One pass over `bytes` of device memory, ms.
    fn memory_ms(&self, bytes: u64) -> f64 {
        bytes as f64 / (1u64 << 30) as f64 / self.machine.memory_gib_per_s * 1e3
    }

    /// Whether any weight keeps transposed codes where it stays on the device (8-bit
    /// products): only then may a plan remake them (`Plan::remake_transposes`).
    fn keeps_transposes(&self) -> bool {
        self.other_kept_bytes > 0 || self.blocks.iter().any(|b| b.kept_bytes > 0)
    }

    /// The transposes of block `b`'s 8-bit weights' codes in a backward that does not find
    /// them kept (a streamed block's, or a resident one's under `Plan::remake_transposes`),
    /// ms: a pass reading and writing the codes.
    fn transpose_ms(&self, b: &BlockCost) -> f64 {
        self.memory_ms(2 * b.product_bytes)
    }

    /// One decode of block `b`'s FP8 codes, ms.
    fn decode_ms(&self, b: &BlockCost) -> f64 {
        b.decode_bytes as f64 / (1u64 << 30) as f64 / self.machine.fp8_decode_gib_per_s * 1e3
    }

    /// The predicted length of a step under `plan`, ms: the forward over the blocks in
    /// execution order, then the backward in reverse, on a compute clock and a link clock
    /// (see `cost_model`). A streamed block's upload is issued when the first block whose
    /// reach (`reach`: `prefetch` ahead, or deeper) takes it in enters (so after the compute
    /// before that block) and runs when the link is free; the block starts when its upload
    /// is done. The first `carry` streamed blocks are on the device at the forward's start
    /// and the last `prefetch + 1` at the backward's (each pass leaves the blocks the next
    /// begins with). Offloaded inputs go out
    /// on the other direction of the link (the next checkpointed block waits for the copy) and come back
    /// a block ahead in the backward, sharing the link with the weights. The products of
    /// weights held on the host run in block order from the start of the backward before
    /// (a steady step: that backward is as long as this one's), and a block waits for its
    /// own.
    pub fn step_ms(&self, plan: &Plan) -> f64 {
        self.step_phases_ms(plan).1
    }

    /// The predicted forward of a step under `plan` and the whole step, ms (`step_ms`): the
    /// backward with the update is the difference. Beside a measured step's phases
    /// (`benches/train_step.rs --phases`), where the model is off.
    pub fn step_phases_ms(&self, plan: &Plan) -> (f64, f64) {
        self.step_phases_with(plan, &self.block_times_for(plan))
    }

    /// Each block's times under this profile's machine (`BlockTimes`), for any plan.
    pub(crate) fn block_times(&self) -> BlockTimes {
        self.block_times_in(u8::MAX)
    }

    /// Each block's times for `plan` alone: its re-runs' slot of `BlockTimes::rerun` made,
    /// the others NaN.
    fn block_times_for(&self, plan: &Plan) -> BlockTimes {
        self.block_times_in(1 << rerun_slot(plan.keep, plan.rerun_ahead))
    }

    /// Each block's times, the re-runs' in the slots `slots` marks (bit `rerun_slot`), NaN
    /// in the others.
    fn block_times_in(&self, slots: u8) -> BlockTimes {
        let rerun = |b: &BlockCost| {
            let mut v = [f64::NAN; 8];
            for (slot, t) in v
                .iter_mut()
                .enumerate()
                .filter(|(k, _)| slots >> k & 1 != 0)
            {
                let kept = Keep {
                    attention: slot & 1 != 0,
                    down_projections: slot & 2 != 0,
                    ..Keep::NONE
                };
                *t = self.backward_rerun_ms(b, kept, slot & 4 != 0);
            }
            v
        };
        let forward: Vec<[f64; 2]> = (self.blocks.iter())
            .map(|b| {
                [
                    self.forward_ms(b, Keep::NONE),
                    self.unrecorded_forward_ms(b),
                ]
            })
            .collect();
        let backward: Vec<f64> = self.blocks.iter().map(|b| self.backward_ms(b)).collect();
        BlockTimes {
            // `resident_ms` from the passes just made.
            resident: resident_of(forward.iter().zip(&backward).map(|(f, &b)| (f[0], b))),
            forward,
            backward,
            rerun: self.blocks.iter().map(rerun).collect(),
            transpose: self.blocks.iter().map(|b| self.transpose_ms(b)).collect(),
            beside: (self.blocks.iter())
                .map(|b| [self.decode_beside(b, false), self.decode_beside(b, true)])
                .collect(),
        }
    }

    /// `step_phases_ms` with the blocks' times made already.
    fn step_phases_with(&self, plan: &Plan, times: &BlockTimes) -> (f64, f64) {
        self.step_phases_placed(plan, times, &self.placed(plan))
    }

    /// `step_phases_with` with the plan's blocks placed already (`placed`).
    fn step_phases_placed(&self, plan: &Plan, times: &BlockTimes, placed: &Placed) -> (f64, f64) {
        use cost_model::*;
        const GIB: f64 = (1u64 << 30) as f64;
        let n = self.blocks.len();
        let machine = &self.machine;
        let upload_rate = machine.upload_gib_per_s.max(1e-3);
        // Each block's coded decodes beside its forward and its backward (`decode_beside`).
        let beside = &times.beside;
        let link_ms = |bytes: u64| bytes as f64 / GIB / upload_rate * 1e3;
        let coded_rate = machine.coded_upload_gib_per_s.max(1e-3);
        let coded_link_ms = |bytes: u64| bytes as f64 / GIB / coded_rate * 1e3;
        // A streamed block's bytes on the link, coded (`code`) or not, and of those coded:
        // the backward's uploads leave out what only the forward reads (`Keep::few_rows`).
        // Weights held on the host for their products never cross.
        // The weights over the context (`BlockCost::context_bytes`) are left out of the
        // backward's uploads with the forward-only ones, or under `Plan::ahead_products` out
        // of the forward's (`context_out`) instead.
        let upload_bytes = |b: &BlockCost, left_out: bool, context_out: bool, code: bool| {
            let (all, only, context) = if code {
                (b.wire_bytes, b.forward_only_wire, b.context_wire)
            } else {
                (b.weight_bytes, b.forward_only_bytes, b.context_bytes)
            };
            let coded = if code { b.coded_bytes } else { 0 };
            let (only_coded, context_coded) = if code {
                (b.forward_only_coded, b.context_coded)
            } else {
                (0, 0)
            };
            let (host, host_wire, host_coded) = Self::host_held(plan, b);
            let (mut out, mut out_coded) = if host > 0 {
                if code {
                    (host_wire, host_coded)
                } else {
                    (host, 0)
                }
            } else if left_out {
                (only, only_coded)
            } else {
                (0, 0)
            };
            if (left_out && !plan.ahead_products) || context_out {
                out += context;
                out_coded += context_coded;
            }
            (all.saturating_sub(out), coded.saturating_sub(out_coded))
        };
        let is_streamed = &placed.marks;
        let ck: Vec<bool> = (0..n)
            .map(|i| Self::checkpointed(plan, i, is_streamed[i]))
            .collect();
        let offload = |i: usize| plan.offload_inputs && ck[i];
        let offloaded = |i: usize| Self::offloaded_bytes(plan, &self.blocks[i]);
        // The host's issue of an offloaded input's copy, each way.
        let offload_ms = STREAM_OPS * machine.op_us / 1e3;
        // The streamed blocks in execution order, and each block's place among them.
        let order: Vec<usize> = (0..n).filter(|&i| is_streamed[i]).collect();
        let mut place = vec![usize::MAX; n];
        for (j, &i) in order.iter().enumerate() {
            place[i] = j;
        }
        let m = order.len();
        let ahead = plan.prefetch;
        let reach = &placed.layout.reach;
        let carried = placed.layout.carried(plan);
        // Whether streamed place `k` crosses coded in the forward or the backward
        // (`Plan::uncoded_carry`, `Plan::raw_backward`).
        let coded_at = |k: usize, backward: bool| Self::coded_place(plan, k, carried, backward);
        // Whether streamed place `k`'s backward upload crosses uncoded through the staging
        // ring (`Plan::raw_backward`: the raw forms of the blocks the forward brings coded).
        let raw_staged = |k: usize, backward: bool| {
            backward
                && plan.raw_backward
                && Self::forward_codes(plan, k, carried, &self.blocks[order[k]])
        };
        // A staged raw piece is copied into place on the device: read and written once.
        let copy_ms_per_gib = 2.0 / machine.memory_gib_per_s.max(1e-3) * 1e3;
        // Decode launches a coded upload issues: one a staged piece (`wire::staging_piece` of
        // the largest upload through the streamer's ring, what the ring is sized by, or one
        // tensor), and more where its coded tensors outnumber the pieces `DECODE_BATCH`
        // times; a staged raw upload, one copy into place a piece.
        let ring = self.ring_parts(plan, is_streamed, carried);
        let piece = crate::backend::wire::staging_piece(ring.0 as usize).max(1) as u64;
        let decode_launches = |b: &BlockCost| -> f64 {
            let pieces = b.coded_bytes.div_ceil(piece).max(1);
            pieces.max(b.tensors.div_ceil(crate::backend::wire::DECODE_BATCH) as u64) as f64
        };
        let copy_launches = |b: &BlockCost| -> f64 { b.weight_bytes.div_ceil(piece).max(1) as f64 };
        // Uploads streamed blocks `ks` not on the device or coming, then returns when block
        // `j`'s upload is done and the compute may start it. Uncoded, an upload runs once the
        // compute has reached `t` (its slot is free) and the link is free. Coded, it crosses
        // into the staging ring once the link is free and the ring has room (the upload
        // issued before it has been decoded: its slot was free at `gate`), and is decoded
        // into its slot once the compute has reached `t`.
        // The backward's uploads leave out the forward-only weights, but for the blocks it
        // leaves on the device for the next forward (`BlockStreamer`).
        let leaves_out =
            |backward: bool, k: usize| backward && plan.keep.few_rows && k > ahead && k >= carried;
        // The forward's uploads leave out the weights whose products over the context the
        // backward before computed (`Plan::ahead_products`), but for the last `prefetch + 1`,
        // which stay for the backward.
        let context_out =
            |backward: bool, k: usize| !backward && plan.ahead_products && k + 1 + ahead < m;
        // `crossed`: bytes of the forward's first coded uploads that crossed into the
        // staging ring at the backward's end (`BlockStreamer`'s crossing ahead), taken off
        // their uploads in order.
        let enter = |ready: &mut [Option<f64>],
                     link: &mut f64,
                     gate: &mut f64,
                     crossed: &mut u64,
                     t: f64,
                     j: usize,
                     backward: bool,
                     ks: &mut dyn Iterator<Item = usize>| {
            // The decodes of the uploads issued here take the compute stream's time too;
            // they run beside this block's work.
            let mut decodes = 0.0;
            let (until, cost) = beside[order[j]][backward as usize];
            for k in ks {
                if ready[k].is_none() {
                    let b = &self.blocks[order[k]];
                    let code = coded_at(k, backward);
                    let (bytes, coded) =
                        upload_bytes(b, leaves_out(backward, k), context_out(backward, k), code);
                    if raw_staged(k, backward) {
                        // Through the ring as a coded upload, at its raw bytes, then copied
                        // into its slot once the compute has reached `t`.
                        *link = link.max(*gate) + link_ms(bytes);
                        *gate = t;
                        let gib = bytes as f64 / GIB;
                        ready[k] = Some(link.max(t) + copy_ms_per_gib * gib);
                        decodes += copy_ms_per_gib * gib;
                    } else if code {
                        let ahead = if backward { 0 } else { bytes.min(*crossed) };
                        *crossed -= ahead;
                        *link = link.max(*gate) + coded_link_ms(bytes - ahead);
                        *gate = t;
                        ready[k] = Some(link.max(t) + until * coded as f64 / GIB);
                        decodes += cost * coded as f64 / GIB;
                    } else {
                        *link = link.max(t) + link_ms(bytes);
                        ready[k] = Some(*link);
                    }
                }
            }
            // The decodes take the compute's time, but where it waits for the link anyway;
            // the host issues the upload's copy, its decodes and the waits.
            let b = &self.blocks[order[j]];
            let launches = STREAM_OPS
                + if coded_at(j, backward) {
                    decode_launches(b)
                } else if raw_staged(j, backward) {
                    copy_launches(b)
                } else {
                    0.0
                };
            (t + decodes).max(ready[j].unwrap_or(t)) + launches * machine.op_us / 1e3
        };
        // One step from the forward's start: the forward's end and the step's. The host
        // computes the held weights' products in execution order from `lead` before the
        // forward (the backward before, which announced its input); a block runs once its
        // own are done.
        // The bytes the staging ring takes ahead of the forward: the largest coded upload and
        // its largest part (the ring less the piece a wrap may skip).
        // Not under `Plan::ahead_products`: the forward's first uploads then leave weights
        // out, and a crossing of a whole pack is copied again (`BlockStreamer::cross_ahead`).
        let crossing = if plan.cross_ahead && !plan.ahead_products {
            ring.0 + ring.1
        } else {
            0
        };
        // One step from the forward's start, its link busy until `link0` (the crossing's
        // copies past the backward before): the forward's end, the step's and when the
        // backward's last upload was done.
        let play = |lead: f64, link0: f64| -> (f64, f64, f64) {
            // Compute clock, link clock (host to device), the other direction's clock (its last
            // copy out, which the next checkpointed block's packing waits for).
            let (mut t, mut link, mut down) = (0.0f64, link0, 0.0f64);
            let mut crossed = crossing;
            let mut host = -lead;
            // When the ring last had room (coded uploads).
            let mut gate = 0.0f64;
            // The backward left the first `carried` streamed blocks on the device.
            let mut ready: Vec<Option<f64>> = vec![None; m];
            for r in ready.iter_mut().take(carried) {
                *r = Some(0.0);
            }
            for i in 0..n {
                if offload(i) {
                    // The block's inputs are packed once the previous copy out is done; the
                    // host issues the copy and its events.
                    t = t.max(down) + offload_ms;
                }
                if is_streamed[i] {
                    let j = place[i];
                    t = enter(
                        &mut ready,
                        &mut link,
                        &mut gate,
                        &mut crossed,
                        t,
                        j,
                        false,
                        &mut (j..=reach[j]),
                    );
                    let held = Self::host_held(plan, &self.blocks[i]).0;
                    if held > 0 {
                        host += held as f64 / GIB / machine.host_product_gib_per_s * 1e3;
                        t = t.max(host);
                    }
                }
                // A checkpointed block's forward records nothing; its re-run does.
                t += times.forward[i][ck[i] as usize];
                if offload(i) {
                    // The copy out shares the link with the uploads still running
                    // (`Machine::copy_out_ms`).
                    let start = down.max(t);
                    let gib = offloaded(i) as f64 / GIB;
                    let (own, taken) = machine.copy_out_ms(gib, link - start);
                    down = start + own;
                    link += taken;
                }
            }
            let forward = t;
            // The backward: the last `prefetch + 1` streamed blocks stay from the forward;
            // offloaded inputs come back one checkpointed block ahead.
            let mut ready: Vec<Option<f64>> = vec![None; m];
            for r in ready
                .iter_mut()
                .skip(m.saturating_sub(ahead.saturating_add(1)))
            {
                *r = Some(t);
            }
            let mut inputs: Vec<Option<f64>> = vec![None; n];
            let upload_input = |i: usize, link: &mut f64, t: f64, inputs: &mut Vec<Option<f64>>| {
                if offload(i) && inputs[i].is_none() {
                    *link = link.max(t) + link_ms(offloaded(i));
                    inputs[i] = Some(*link);
                }
            };
            for i in (0..n).rev() {
                upload_input(i, &mut link, t, &mut inputs);
                if let Some(prev) = (0..i).rev().find(|&p| offload(p)) {
                    upload_input(prev, &mut link, t, &mut inputs);
                }
                if is_streamed[i] {
                    let j = place[i];
                    t = enter(
                        &mut ready,
                        &mut link,
                        &mut gate,
                        &mut crossed,
                        t,
                        j,
                        true,
                        &mut (j.saturating_sub(ahead)..=j).rev(),
                    );
                }
                if let Some(r) = inputs[i] {
                    t = t.max(r) + offload_ms;
                }
                if ck[i] {
                    // The backward and the re-run, less what the block kept.
                    t += times.rerun[i][rerun_slot(plan.keep, plan.rerun_ahead)];
                } else {
                    t += times.backward[i];
                }
                if is_streamed[i] || plan.remake_transposes {
                    t += times.transpose[i];
                }
            }
            (forward, t, link)
        };
        // A steady step: the backward before is as long as this one's, and the crossing's
        // copies follow its last upload on the link.
        let (forward, step, link) = play(0.0, 0.0);
        let spill = link + coded_link_ms(crossing) - step;
        let (forward, step, _) = play(step - forward, spill.max(0.0));
        (forward, step)
    }

    /// The largest coded upload's bytes on the link and its largest part under `plan`, its
    /// streamed blocks marked by `marks` (`streamed_marks`) and the backward leaving
    /// `carried` blocks for the forward: what the streamer's staging ring is sized by
    /// (`wire::staging_ring_bytes`); zeros for an uncoded plan.
    fn ring_parts(&self, plan: &Plan, marks: &[bool], carried: usize) -> (u64, u64) {
        let (wire, part) = self
            .forward_coded(plan, marks, carried)
            .map(|b| (b.wire_bytes, Self::largest_part(b)))
            .fold((0, 0), |(w, p), (bw, bp)| (w.max(bw), p.max(bp)));
        if !plan.raw_backward {
            return (wire, part);
        }
        // The backward's raw forms cross the ring too, whole, in pieces of the ring's
        // largest upload's (`BlockStreamer::set_raw_backward`).
        let raw = self
            .forward_coded(plan, marks, carried)
            .map(|b| Self::raw_form_bytes(plan, b))
            .max()
            .unwrap_or(0);
        let wire = wire.max(raw);
        if raw == 0 {
            return (wire, part);
        }
        let piece = crate::backend::wire::staging_piece(wire as usize) as u64;
        (wire, part.max(piece))
    }

    /// The streamed blocks (by `marks`, `streamed_marks`) whose forward uploads cross coded
    /// under `plan` (the backward leaving `carried` for the forward), in execution order;
    /// none for an uncoded plan.
    fn forward_coded<'a>(
        &'a self,
        plan: &'a Plan,
        marks: &'a [bool],
        carried: usize,
    ) -> impl Iterator<Item = &'a BlockCost> + 'a {
        self.marked(marks.iter().copied())
            .enumerate()
            .filter(move |&(k, b)| Self::forward_codes(plan, k, carried, b))
            .map(|(_, b)| b)
    }

    /// The predicted cost of a step under `plan` beyond the resident step, as a fraction of
    /// it (`step_ms` over `resident_ms`, less one): candidates are ordered by it.
    pub fn cost(&self, plan: &Plan) -> f64 {
        self.cost_with(plan, &self.block_times_for(plan))
    }

    /// `cost` with the blocks' times made already.
    pub(crate) fn cost_with(&self, plan: &Plan, times: &BlockTimes) -> f64 {
        self.cost_placed(plan, times, &self.placed(plan))
    }

    /// `cost_with` with the plan's blocks placed already (`placed`).
    fn cost_placed(&self, plan: &Plan, times: &BlockTimes, placed: &Placed) -> f64 {
        self.step_phases_placed(plan, times, placed).1 / times.resident - 1.0
    }

    /// The largest part of block `b`'s coded upload in the staging ring: its largest coded
    /// weight or its uncoded weights together; profiles made without per-weight sizes
    /// (`largest_coded` 0) take a fifth of its bytes on the link (Flux-dev's largest, a
    /// single block's linear1, is 0.2 of a double block).
    fn largest_part(b: &BlockCost) -> u64 {
        if b.largest_coded == 0 {
            return b.wire_bytes / 5;
        }
        b.largest_coded
            .max(b.wire_bytes.saturating_sub(b.coded_bytes))
    }

    /// Whether the streamed block at place `k` (execution order among the streamed) crosses
    /// the link coded under `plan` in the forward or the `backward`, the backward leaving
    /// the first `carried` on the device.
    fn coded_place(plan: &Plan, k: usize, carried: usize, backward: bool) -> bool {
        plan.wire_code && !(plan.uncoded_carry && k < carried) && !(backward && plan.raw_backward)
    }

    /// Whether streamed block `b` at place `k` crosses coded in the forward under `plan`
    /// (the backward leaving `carried`): a place that crosses coded and a block with code.
    /// Under `Plan::raw_backward` these are the blocks whose raw forms the backward uploads.
    fn forward_codes(plan: &Plan, k: usize, carried: usize, b: &BlockCost) -> bool {
        Self::coded_place(plan, k, carried, false) && b.coded_bytes > 0
    }

    /// Bytes of block `b`'s raw form (`Plan::raw_backward`): its weights less those held on
    /// the host for their products, which no pack takes.
    fn raw_form_bytes(plan: &Plan, b: &BlockCost) -> u64 {
        Self::on_device_bytes(plan, b)
    }

    /// Bytes of pinned host memory `plan` takes beyond the streamed weights' code: with
    /// `Plan::raw_backward`, the raw bytes of every block that crosses coded in the forward
    /// (the backward uploads those), less the weights held on the host for their products
    /// (no pack takes them); 0 otherwise.
    pub fn raw_backward_host_bytes(&self, plan: &Plan) -> u64 {
        if !plan.raw_backward {
            return 0;
        }
        let marks = self.streamed_marks(plan);
        self.forward_coded(plan, &marks, self.carried(plan))
            .map(|b| Self::raw_form_bytes(plan, b))
            .sum()
    }

    /// Whether block `i` is checkpointed under `plan`.
    fn checkpointed(plan: &Plan, i: usize, streamed: bool) -> bool {
        streamed || plan.checkpointing.covers(i)
    }

    /// Bytes of the outputs a checkpointed block `b` keeps from its forward under `plan`
    /// (attention's, the down-projections').
    fn kept_output_bytes(plan: &Plan, b: &BlockCost) -> u64 {
        let mut bytes = 0;
        if plan.keep.attention {
            bytes += b.attention_bytes;
        }
        if plan.keep.down_projections {
            bytes += b.down_bytes;
        }
        bytes
    }

    /// Bytes a checkpointed block `b` keeps in host memory under `plan`: its inputs, and its
    /// kept outputs where `Plan::offloads_kept`.
    fn offloaded_bytes(plan: &Plan, b: &BlockCost) -> u64 {
        if !plan.offload_inputs {
            return 0;
        }
        if plan.offloads_kept() {
            b.input_bytes + Self::kept_output_bytes(plan, b)
        } else {
            b.input_bytes
        }
    }

    /// Bytes block `i` holds on the device from its forward to its backward under `plan`:
    /// what it saves when resident; its inputs (unless offloaded) and what it keeps when
    /// checkpointed.
    fn held_bytes(&self, plan: &Plan, i: usize, streamed: bool) -> u64 {
        let b = &self.blocks[i];
        if !Self::checkpointed(plan, i, streamed) {
            return b.saved_bytes;
        }
        let mut held = if plan.offload_inputs {
            0
        } else {
            b.input_bytes
        };
        if !plan.offloads_kept() {
            held += Self::kept_output_bytes(plan, b);
        }
        held
    }

    /// Whether some block runs resident under `plan`, keeping its activations for the
    /// backward. Such plans fetch only `prefetch` ahead (`reach`): the activations, large
    /// buffers made all through the forward, land among the blocks fetched early and cut the
    /// room the next ones need (SD3.5-large within 8 GiB, 4 resident blocks beside 34
    /// streamed: requests past the cap's arena, 9.05 GiB on the driver; H100).
    pub fn saves_activations(&self, plan: &Plan) -> bool {
        Self::saves_marked(plan, &self.streamed_marks(plan))
    }

    /// `saves_activations` with the plan's blocks marked already (`streamed_marks`).
    fn saves_marked(plan: &Plan, marks: &[bool]) -> bool {
        (0..marks.len()).any(|i| !Self::checkpointed(plan, i, marks[i]))
    }

    /// Whether `plan` is held to its budget less `MARGIN_DIVISOR`'s share: it mixes
    /// resident-activation blocks with streamed ones (`Plan::mixes`), or its forward fetches
    /// deeper than `prefetch` somewhere (`reach`).
    pub fn spare(&self, plan: &Plan) -> bool {
        Self::spare_within(plan, &self.reach(plan))
    }

    /// `spare` with the forward's `reach` under `plan` worked out already.
    fn spare_within(plan: &Plan, reach: &[usize]) -> bool {
        let ahead = plan.prefetch.max(1);
        plan.mixes()
            || reach
                .iter()
                .enumerate()
                .any(|(j, &r)| r > j.saturating_add(ahead))
    }

    /// How far ahead the forward may fetch under `plan`: for each streamed block (by its
    /// place among the streamed blocks, in execution order), the last place that may be on
    /// the device while it runs. Always at least `prefetch` ahead; with
    /// `plan.deep_prefetch` (and every block checkpointed: `saves_activations`), as far as
    /// the memory the step's peak sets aside for the blocks' weights and for what the blocks
    /// hold for the backward (`held_bytes`), less what the blocks up to this one already
    /// hold, takes more blocks: at the forward's start nothing is held yet, and the heaviest
    /// moment comes in the backward, most often at its start with everything held. Each
    /// place's reach is at most every later place's window, so no fetch issued early exceeds
    /// a later place's room.
    /// The backward leaves the first `carry(reach, prefetch)` streamed blocks on the device
    /// for the next forward (see `layout`).
    pub fn reach(&self, plan: &Plan) -> Vec<usize> {
        self.layout(plan).reach
    }

    /// The streamed blocks' device copies under `plan` and where they fit: each upload
    /// takes its own block's bytes (`BlockStreamer`), which leave out the weights held on
    /// the host (`host_held`), so the heaviest moment is found place by place: at the
    /// backward's place `j` the blocks up to it still hold their checkpoints (`held_bytes`)
    /// while block `j` and the `prefetch` before it are on the device; at its start
    /// everything is held beside the last `prefetch + 1`. The forward's reach at each place
    /// takes the blocks that fit in what that heaviest moment sets aside less what the
    /// blocks up to it hold, and the backward leaves no more of the first blocks than fit
    /// there. The cap on the first place's reach that holds the carry to its bytes also
    /// stops that place's forward fetching deeper.
    fn layout(&self, plan: &Plan) -> Layout {
        self.layout_marked(plan, &self.streamed_marks(plan))
    }

    /// `layout` with the plan's blocks marked already (`is_streamed`, `streamed_marks`).
    fn layout_marked(&self, plan: &Plan, is_streamed: &[bool]) -> Layout {
        let n = self.blocks.len();
        let held: Vec<u64> = (0..n)
            .map(|i| self.held_bytes(plan, i, is_streamed[i]))
            .collect();
        let total: u64 = held.iter().sum();
        let streamed: Vec<usize> = (0..n).filter(|&i| is_streamed[i]).collect();
        let m = streamed.len();
        if m == 0 {
            return Layout {
                reach: vec![],
                held: total,
            };
        }
        // A prefetch past the last block fetches them all.
        let ahead = plan.prefetch.clamp(1, m);
        let shallow = shallow_reach(m, ahead);
        // What the blocks up to each place (its own included) hold.
        let upto: Vec<u64> = held
            .iter()
            .scan(0u64, |sum, &h| {
                *sum += h;
                Some(*sum)
            })
            .collect();
        let taken: Vec<u64> = streamed.iter().map(|&i| upto[i]).collect();
        let sizes: Vec<u64> = streamed
            .iter()
            .map(|&i| Self::on_device_bytes(plan, &self.blocks[i]))
            .collect();
        let sum = |a: usize, b: usize| sizes[a..=b].iter().sum::<u64>();
        // The heaviest moment of the backward: held bytes and streamed blocks together.
        let peak = (0..m)
            .map(|j| {
                let h = if j + 1 == m { total } else { taken[j] };
                h + sum(j.saturating_sub(ahead), j)
            })
            .max()
            .unwrap_or(total);
        if !plan.deep_prefetch || Self::saves_marked(plan, is_streamed) {
            return Layout {
                reach: shallow,
                held: peak,
            };
        }
        // What place j may have on the device: the peak's set-aside less what is held.
        let room: Vec<u64> = (0..m)
            .map(|j| peak.saturating_sub(taken[j]).max(sum(j, shallow[j])))
            .collect();
        let mut reach = vec![0usize; m];
        let mut limit = usize::MAX;
        for j in (0..m).rev() {
            let mut own = j;
            let mut bytes = sizes[j];
            while own + 1 < m && bytes + sizes[own + 1] <= room[j] {
                own += 1;
                bytes += sizes[own];
            }
            limit = limit.min(own.max(j + ahead));
            reach[j] = limit.min(m - 1).max(shallow[j]);
        }
        // The most first blocks the backward may leave, in bytes: at each place below them,
        // those from it (and the `prefetch` fetched below it) up to the last fit its room.
        // The count the streamer works out from the reach (`carry`) is held to it through
        // the first place's reach.
        let fits =
            |c: usize| (0..c).all(|j| sizes[j - ahead.min(j)..c].iter().sum::<u64>() <= room[j]);
        let most = (ahead + 1..=m)
            .take_while(|&c| fits(c))
            .last()
            .unwrap_or(ahead + 1)
            .min(m);
        reach[0] = reach[0].min((most - 1).max(shallow[0]));
        Layout { reach, held: peak }
    }

    /// The predicted peak bytes of a step under `plan` (see the module docs): the sum of
    /// [`MemoryProfile::peak_parts`].
    pub fn peak(&self, plan: &Plan) -> u64 {
        self.peak_parts(plan).total()
    }

    /// The terms of the predicted peak of a step under `plan`, each a maximum over the step
    /// (see [`PeakParts`]).
    pub fn peak_parts(&self, plan: &Plan) -> PeakParts {
        self.peak_parts_placed(plan, &self.placed(plan))
    }

    /// `plan`'s blocks placed: marked and laid out, once for all its estimates.
    fn placed(&self, plan: &Plan) -> Placed {
        let marks = self.streamed_marks(plan);
        let layout = self.layout_marked(plan, &marks);
        Placed { marks, layout }
    }

    /// `peak_parts` with the plan's blocks placed already (`placed`).
    fn peak_parts_placed(&self, plan: &Plan, placed: &Placed) -> PeakParts {
        let kept = |bytes: u64| if plan.remake_transposes { 0 } else { bytes };
        let mut weights = self.other_weight_bytes + kept(self.other_kept_bytes);
        let (mut work, mut offloaded) = (0u64, 0u64);
        let (mut ahead, mut ahead_block) = (0u64, 0u64);
        let marks = &placed.marks;
        for (i, b) in self.blocks.iter().enumerate() {
            let streamed = marks[i];
            if !streamed {
                weights += b.weight_bytes + kept(b.kept_bytes);
            }
            if Self::checkpointed(plan, i, streamed) {
                if plan.offload_inputs {
                    // In host memory; on the device only while its copy runs (forward) or
                    // once fetched ahead of its re-run (backward): two blocks' worth.
                    offloaded = offloaded.max(Self::offloaded_bytes(plan, b));
                }
                // The re-run's tape and the gradients of its inputs.
                work = work.max(b.saved_bytes + 2 * b.input_bytes);
                ahead = ahead.max(b.saved_bytes);
            } else {
                work = work.max(2 * b.input_bytes);
            }
            if streamed {
                ahead_block = ahead_block.max(b.weight_bytes);
            }
        }
        // Re-runs issued ahead: the next re-run's tape beside each block's backward, and
        // its block in the streamer's window beside those the prefetch holds.
        if plan.rerun_ahead {
            work += ahead + ahead_block;
        }
        // What the blocks hold for the backward and the streamed blocks' copies at the
        // heaviest moment (`layout`).
        let layout = &placed.layout;
        // The products over the context computed ahead, held from the backward to the next
        // forward (`Plan::ahead_products`).
        let products: u64 = if plan.ahead_products {
            self.marked(marks.iter().copied())
                .map(|b| b.context_product_bytes)
                .sum()
        } else {
            0
        };
        let held = layout.held + 2 * offloaded + products;
        let carried = layout.carried(plan);
        // Coded uploads cross into a staging ring that holds the largest streamed block's
        // bytes on the link beside a piece and the largest part (a coded weight, or a
        // block's uncoded weights together), as the streamer sizes it from its packs
        // (32 pieces' alignment). The carried blocks crossing uncoded
        // (`Plan::uncoded_carry`) take no staging.
        let (wire, part) = self.ring_parts(plan, marks, carried);
        let staging =
            crate::backend::wire::staging_ring_bytes(wire as usize, part as usize, 32) as u64;
        PeakParts {
            weights,
            staging,
            adapters: 2 * self.trainable_bytes,
            optimizer: self.optimizer_bytes,
            held,
            work,
            fixed: self.fixed_bytes,
        }
    }

    /// Bytes copied from host memory per step under `plan`, in a steady run: the forward
    /// uploads every streamed block but the first `carry` (`prefetch + 1` unless
    /// `deep_prefetch`) and the backward every one but the last `prefetch + 1` (each pass
    /// leaves those for the next); weights held on the host never cross.
    pub fn streamed_bytes(&self, plan: &Plan) -> u64 {
        let carried = self.carried(plan);
        // Each streamed block's bytes on the link in the forward and in the backward, less
        // what it holds on the host.
        // Under `Plan::ahead_products` the forward's uploads but the last `kept` leave out
        // the weights over the context.
        let kept = plan.prefetch.max(1).saturating_add(1);
        let m = plan.streamed.len();
        let marks = self.streamed_marks(plan);
        let sizes = |backward: bool| -> Vec<u64> {
            self.marked(marks.iter().copied())
                .enumerate()
                .map(|(k, b)| {
                    let (host, host_wire, _) = Self::host_held(plan, b);
                    let out = !backward && plan.ahead_products && k + kept < m;
                    if Self::coded_place(plan, k, carried, backward) {
                        let context = if out { b.context_wire } else { 0 };
                        b.wire_bytes.saturating_sub(host_wire + context)
                    } else {
                        let context = if out { b.context_bytes } else { 0 };
                        b.weight_bytes.saturating_sub(host + context)
                    }
                })
                .collect()
        };
        let (forward, backward) = (sizes(false), sizes(true));
        let m = forward.len();
        if m <= kept {
            return 0;
        }
        // At least `kept` (every place holds that many), at most `m`.
        forward[carried..].iter().sum::<u64>() + backward[..m - kept].iter().sum::<u64>()
    }

    /// `plan` as a model loads and streams it: the streamed blocks in execution order (a
    /// prefix that is not a block of this model is an error), `reach` and `uncoded_first`
    /// worked out, and the host products kept only where some weights are read by the forward
    /// alone (none with DoRA, or with adapters before the blocks, whose inputs then need
    /// gradients). What the planner weighs is unchanged: settling twice gives the same plan.
    pub fn settle(&self, plan: &Plan) -> Result<Plan> {
        if let Some(bad) = plan
            .streamed
            .iter()
            .find(|p| !self.blocks.iter().any(|b| &b.prefix == *p))
        {
            return Err(Error::Stream(format!(
                "the plan streams \"{bad}\", which is not a block of this model"
            )));
        }
        let mut p = Plan {
            streamed: self
                .streamed_blocks(plan)
                .map(|b| b.prefix.clone())
                .collect(),
            prefetch: plan.prefetch.max(1),
            host_products: plan.host_products
                && !plan.streamed.is_empty()
                && self.blocks.iter().any(|b| b.forward_only_bytes > 0),
            remake_transposes: plan.remake_transposes && self.keeps_transposes(),
            raw_backward: plan.raw_backward && plan.wire_code && !plan.streamed.is_empty(),
            ahead_products: plan.ahead_products && self.computes_ahead(plan),
            rerun_ahead: plan.rerun_ahead
                && (plan.checkpointing != Checkpointing::Off || !plan.streamed.is_empty()),
            reach: vec![],
            uncoded_first: 0,
            ..plan.clone()
        };
        p.uncoded_first = self.uncoded_first(&p);
        if p.deep_prefetch && !p.streamed.is_empty() {
            p.reach = self.reach(&p);
        }
        Ok(p)
    }

    /// Whether `plan` has products to compute ahead (`Plan::ahead_products`): streamed
    /// blocks keeping their few-row outputs, some with Linears over the model's context.
    fn computes_ahead(&self, plan: &Plan) -> bool {
        plan.keep.few_rows && self.streamed_blocks(plan).any(|b| b.context_bytes > 0)
    }

    /// How many of the first streamed blocks cross uncoded under `plan`
    /// (`Plan::uncoded_carry`: those the backward leaves for the next forward), for
    /// `BlockStreamer::set_uncoded_first`.
    pub fn uncoded_first(&self, plan: &Plan) -> usize {
        if plan.wire_code && plan.uncoded_carry {
            self.carried(plan)
        } else {
            0
        }
    }

    /// How many of the first streamed blocks the backward leaves on the device for the next
    /// forward under `plan` (`carry` of its `reach`; 0 when nothing streams).
    fn carried(&self, plan: &Plan) -> usize {
        self.layout(plan).carried(plan)
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

    /// Whether `plan` streams each block, by place: the one test of a block's membership
    /// every estimate makes, the plan's names hashed once a call. A scan of the names for
    /// each block (blocks times names string comparisons, several times an estimate) took
    /// most of SDXL's planning: 91 units, about 110,000 candidates.
    pub(super) fn streamed_marks(&self, plan: &Plan) -> Vec<bool> {
        if plan.streamed.is_empty() {
            return vec![false; self.blocks.len()];
        }
        let mut names = std::collections::HashSet::with_capacity_and_hasher(
            plan.streamed.len(),
            foldhash::fast::FixedState::default(),
        );
        names.extend(plan.streamed.iter().map(String::as_str));
        self.blocks
            .iter()
            .map(|b| names.contains(b.prefix.as_str()))
            .collect()
    }

    /// The blocks `plan` streams, in execution order.
    fn streamed_blocks<'a>(&'a self, plan: &Plan) -> impl Iterator<Item = &'a BlockCost> + 'a {
        self.marked(self.streamed_marks(plan))
    }

    /// The blocks `marks` (`streamed_marks`) marks, in execution order.
    fn marked<'a>(
        &'a self,
        marks: impl IntoIterator<Item = bool> + 'a,
    ) -> impl Iterator<Item = &'a BlockCost> + 'a {
        self.blocks
            .iter()
            .zip(marks)
            .filter(|&(_, s)| s)
            .map(|(b, _)| b)
    }

    /// The candidate plans, fastest first by the time model (see the module docs); ties go
    /// to the smaller peak.
    pub fn candidates(&self) -> Vec<Plan> {
        self.candidates_with(false)
    }

    /// [`MemoryProfile::candidates`], and with `offload_kept_allowed` the plans that offload block
    /// inputs also with their kept outputs in host memory (`Plan::offload_kept`; the planner's
    /// switch of that name).
    pub fn candidates_with(&self, offload_kept_allowed: bool) -> Vec<Plan> {
        self.candidates_among(offload_kept_allowed, false)
    }

    /// [`MemoryProfile::candidates_with`], and with `raw_backward_allowed` the coded plans
    /// whose backward's uploads cross uncoded too (`Plan::raw_backward`; the planner's switch
    /// of that name).
    pub fn candidates_among(
        &self,
        offload_kept_allowed: bool,
        raw_backward_allowed: bool,
    ) -> Vec<Plan> {
        self.candidates_allowing(offload_kept_allowed, raw_backward_allowed, false)
    }

    /// [`MemoryProfile::candidates_among`], and with `ahead_allowed` each plan with products
    /// over the context to compute ahead beside its twin that does (`Plan::ahead_products`;
    /// the planner's switch of that name).
    pub fn candidates_allowing(
        &self,
        offload_kept_allowed: bool,
        raw_backward_allowed: bool,
        ahead_allowed: bool,
    ) -> Vec<Plan> {
        self.weighed_candidates(offload_kept_allowed, raw_backward_allowed, ahead_allowed)
            .into_iter()
            .map(|w| w.plan)
            .collect()
    }

    /// [`MemoryProfile::candidates_allowing`] with each plan's weights, in the same order:
    /// what [`MemoryProfile::plan_among`] takes without weighing each plan again.
    pub fn weighed_candidates(
        &self,
        offload_kept_allowed: bool,
        raw_backward_allowed: bool,
        ahead_allowed: bool,
    ) -> Vec<Weighed> {
        use rayon::prelude::*;
        let order = self.stream_order();
        let codes = self.blocks.iter().any(|b| b.coded_bytes > 0);
        let held = self.blocks.iter().any(Self::holdable);
        // With 8-bit products, resident blocks keep their weights' transposed codes or remake
        // them at each backward (`Plan::remake_transposes`).
        let remakes: &[bool] = if self.keeps_transposes() {
            &[false, true]
        } else {
            &[false]
        };
        let n = self.blocks.len();
        let ahead_gains = self.ahead_gains();
        // Every block but the first j, j a sixteenth of the blocks, two ... fifteen, with
        // nothing streamed: where the weights fit and the activations of some blocks do, but
        // not those of every other block (Z-Image 6B within 32 GiB). Beside streamed blocks
        // such plans mix, which the model under-predicts (`plan_among`); `Every(n)` covers
        // those.
        let all_but: Vec<usize> = {
            let mut j: Vec<usize> = (1..16).map(|s| (n * s).div_ceil(16)).collect();
            j.dedup();
            j.retain(|&j| j > 0 && j < n);
            j
        };
        let checkpointings = [
            Checkpointing::Off,
            Checkpointing::Every(4),
            Checkpointing::Every(3),
            Checkpointing::Every(2),
            Checkpointing::All,
        ]
        .into_iter()
        .chain(all_but.into_iter().map(Checkpointing::AllBut));
        // Each checkpointing with each count of streamed blocks, made on the host's cores
        // (in this order: the sort below keeps it among equals).
        let kinds: Vec<(Checkpointing, usize)> = checkpointings
            .flat_map(|checkpointing| {
                // Partial checkpointing only with nothing streamed (above).
                let most_streamed = if matches!(checkpointing, Checkpointing::AllBut(_)) {
                    0
                } else {
                    n
                };
                (0..=most_streamed).map(move |k| (checkpointing, k))
            })
            .collect();
        let mut v: Vec<Plan> = kinds
            .into_par_iter()
            .flat_map_iter(|(checkpointing, k)| {
                let mut v = vec![];
                let nothing_checkpointed = k == 0 && checkpointing == Checkpointing::Off;
                for (ki, keep) in KEEPS.into_iter().enumerate() {
                    for (offload_inputs, offload_kept) in
                        [(false, false), (true, false), (true, true)]
                    {
                        // Keeping and offloading mean nothing without a checkpoint.
                        if nothing_checkpointed && (ki > 0 || offload_inputs) {
                            continue;
                        }
                        // Kept outputs offloaded: where asked, and something is kept.
                        if offload_kept
                            && !(offload_kept_allowed && (keep.attention || keep.down_projections))
                        {
                            continue;
                        }
                        // A prefetch of one holds a streamed block less on the device and
                        // hides less of the copies; a deeper one holds more and hides more
                        // (the time model weighs both). Three ran 4 ms faster than two for
                        // Flux-dev within 12 GiB (580.6 against 585.5 ms, H100) and 8-12 ms
                        // faster for SD3.5-large within 8 GiB (295.4 against 303.7 and 307.4,
                        // H200); five ran 292.1 ms there against three's 306.4 in one call
                        // (H200), the time model's order too (245.6 against 250.6 ms).
                        for prefetch in [5, 4, 3, 2, 1] {
                            // Nothing streamed: the prefetch means nothing (one plan, at 2).
                            if k == 0 && prefetch != 2 {
                                continue;
                            }
                            // Coded uploads when anything would be coded (fewer bytes on
                            // the link, decodes taking the GPU's time; nothing to code
                            // without streamed blocks), with the carried blocks uncoded or
                            // not, with the backward's uploads uncoded where allowed, and
                            // uncoded: (wire_code, uncoded_carry, raw_backward).
                            let codings: &[(bool, bool, bool)] = if codes && k > 0 {
                                if raw_backward_allowed {
                                    &[
                                        (true, true, false),
                                        (true, false, false),
                                        (true, true, true),
                                        (false, false, false),
                                    ]
                                } else {
                                    &[
                                        (true, true, false),
                                        (true, false, false),
                                        (false, false, false),
                                    ]
                                }
                            } else {
                                &[(false, false, false)]
                            };
                            // The conditioning products on the host or not, when
                            // blocks stream and hold weights only the forward reads.
                            let hosts: &[bool] = if k > 0 && held {
                                &[true, false]
                            } else {
                                &[false]
                            };
                            // Re-runs issued ahead or not, where anything is checkpointed
                            // and some block's re-run would gain (a host-paced one).
                            let aheads: &[bool] = if nothing_checkpointed || !ahead_gains {
                                &[false]
                            } else {
                                &[false, true]
                            };
                            for &(wire_code, uncoded_carry, raw_backward) in codings {
                                for (&host_products, &remake_transposes, &rerun_ahead) in hosts
                                    .iter()
                                    .flat_map(|h| remakes.iter().map(move |r| (h, r)))
                                    .flat_map(|(h, r)| aheads.iter().map(move |a| (h, r, a)))
                                {
                                    v.push(Plan {
                                        checkpointing,
                                        streamed: order[..k].to_vec(),
                                        prefetch,
                                        // It costs no peak: always, when blocks stream
                                        // (`reach` leaves it out where it would cut the
                                        // arena).
                                        deep_prefetch: k > 0,
                                        keep: if nothing_checkpointed {
                                            Keep::NONE
                                        } else {
                                            keep
                                        },
                                        offload_inputs,
                                        offload_kept,
                                        wire_code,
                                        uncoded_carry,
                                        raw_backward,
                                        ahead_products: false,
                                        cross_ahead: wire_code,
                                        host_products,
                                        remake_transposes,
                                        rerun_ahead,
                                        reach: vec![],
                                        uncoded_first: 0,
                                    });
                                }
                            }
                        }
                    }
                }
                v
            })
            .collect();
        if ahead_allowed {
            let twins: Vec<Plan> = v
                .par_iter()
                .filter(|p| self.computes_ahead(p))
                .map(|p| Plan {
                    ahead_products: true,
                    ..p.clone()
                })
                .collect();
            v.extend(twins);
        }
        // Fastest first: the time model's step and the peak of each, on the host's cores.
        let times = self.block_times();
        let mut v: Vec<Weighed> = (v.into_par_iter())
            .map(|p| Weighed::with_times(self, p, &times))
            .collect();
        v.sort_by(|a, b| a.cost.total_cmp(&b.cost).then(a.peak.cmp(&b.peak)));
        // The smallest plan, last: every block streamed with a prefetch of one, nothing kept,
        // the inputs in host memory, the weights uncoded.
        let smallest = Plan {
            checkpointing: Checkpointing::All,
            streamed: order,
            prefetch: 1,
            keep: Keep::NONE,
            offload_inputs: true,
            offload_kept: false,
            // Uncoded: the staging ring would add to the smallest peak.
            wire_code: false,
            uncoded_carry: false,
            raw_backward: false,
            ahead_products: false,
            cross_ahead: false,
            deep_prefetch: true,
            host_products: held,
            remake_transposes: remakes.len() > 1,
            rerun_ahead: false,
            reach: vec![],
            uncoded_first: 0,
        };
        v.push(Weighed::with_times(self, smallest, &times));
        v
    }

    /// The fastest plan whose predicted peak is within `budget` bytes.
    pub fn plan(&self, budget: u64) -> std::result::Result<Planned, NoPlan> {
        self.plan_among(budget, self.weighed_candidates(false, false, false))
    }

    /// Bytes of host memory `plan` holds at its most, beside what the process holds
    /// anyway. In the steps: each streamed block's weights as its pack keeps them in pinned
    /// memory (their code where the forward brings them coded, else as they are; the weights
    /// held for products on the host as they are), the backward's raw forms
    /// (`raw_backward_host_bytes`) and the offloaded checkpoint inputs with what they keep
    /// (`Plan::offload_inputs`), all at once at the backward's start. Before them, while the
    /// streamer packs the blocks (`BlockStreamer`'s first fetch), every streamed weight's
    /// copy as loaded beside the first block's pack and raw form: the larger of the
    /// two.
    pub fn host_bytes(&self, plan: &Plan) -> u64 {
        self.host_bytes_placed(plan, &self.placed(plan))
    }

    /// `host_bytes` with the plan's blocks placed already (`placed`).
    fn host_bytes_placed(&self, plan: &Plan, placed: &Placed) -> u64 {
        let carried = placed.layout.carried(plan);
        // Each streamed block's pack with its raw form where the backward uploads one, and
        // its weights as loaded.
        let marks = &placed.marks;
        let (packs, loaded): (Vec<u64>, Vec<u64>) = self
            .marked(marks.iter().copied())
            .enumerate()
            .map(|(k, b)| {
                let pack = if Self::forward_codes(plan, k, carried, b) {
                    let (held, held_wire, _) = Self::host_held(plan, b);
                    let raw = if plan.raw_backward {
                        Self::raw_form_bytes(plan, b)
                    } else {
                        0
                    };
                    b.wire_bytes.saturating_sub(held_wire) + held + raw
                } else {
                    b.weight_bytes
                };
                (pack, b.weight_bytes)
            })
            .unzip();
        let offloaded: u64 = self
            .blocks
            .iter()
            .enumerate()
            .filter(|&(i, _)| Self::checkpointed(plan, i, marks[i]))
            .map(|(_, b)| Self::offloaded_bytes(plan, b))
            .sum();
        let steps = packs.iter().sum::<u64>() + offloaded;
        let packing = loaded.iter().sum::<u64>() + packs.iter().copied().max().unwrap_or(0);
        steps.max(packing)
    }

    /// Whether `plan`, of predicted `peak`, fits `budget`: within it, less `MARGIN_DIVISOR`'s
    /// share of it for the plans `spare` names.
    fn fits(&self, plan: &Plan, peak: u64, budget: u64) -> bool {
        Self::fits_within(peak, budget, self.spare(plan))
    }

    /// `fits` for a plan `spare` names or not (`spare`).
    fn fits_within(peak: u64, budget: u64, spare: bool) -> bool {
        let usable = budget - budget / MARGIN_DIVISOR;
        peak <= if spare { usable } else { budget }
    }

    /// `plan_among` over the candidates whose host memory (`host_bytes`) is within
    /// `host_room` bytes (`None`: not known, none left out). Where some plan fits `budget`
    /// but none of those fits the host too, the error says how much host memory the
    /// leanest of them needs (`NoPlan::host`).
    pub fn plan_within<C: Candidate>(
        &self,
        budget: u64,
        host_room: Option<u64>,
        candidates: Vec<C>,
    ) -> std::result::Result<Planned, NoPlan> {
        let Some(room) = host_room else {
            return self.plan_among(budget, candidates);
        };
        // Each candidate's host memory on the host's cores, then the split in order.
        let held: Vec<bool> = {
            use rayon::prelude::*;
            candidates
                .par_iter()
                .map(|c| c.host_bytes(self) <= room)
                .collect()
        };
        let (mut fit, mut over) = (Vec::new(), Vec::new());
        for (c, ok) in candidates.into_iter().zip(held) {
            if ok {
                fit.push(c);
            } else {
                over.push(c);
            }
        }
        match self.plan_among(budget, fit) {
            Ok(p) => Ok(p),
            Err(mut no) => {
                // The least host memory of the plans the device's budget would take.
                // Each one's peak, and whether it fits the budget (a cost where it does).
                let over: Vec<(&C, u64, bool)> = over
                    .iter()
                    .map(|c| {
                        let (peak, cost) = c.weights(self, budget);
                        (c, peak, cost.is_some())
                    })
                    .collect();
                no.host = over
                    .iter()
                    .filter(|&&(_, _, fits)| fits)
                    .map(|&(c, _, _)| c.host_bytes(self))
                    .min()
                    .map(|least| (least, room));
                no.minimum = no.minimum.min(
                    over.iter()
                        .map(|&(_, peak, _)| peak)
                        .min()
                        .unwrap_or(u64::MAX),
                );
                Err(no)
            }
        }
    }

    /// The first of `candidates` (fastest first) whose predicted peak is within `budget`
    /// (less `MARGIN_DIVISOR`'s share of it for the plans `spare` names), or, of the fitting plans
    /// predicted within `cost_model::NEAR` of its step, one that does not mix blocks keeping
    /// their activations (`saves_activations`) with streamed ones before one that does, then
    /// one that leaves `ROOM_DIVISOR`'s share of the budget spare, the fewest bytes over the
    /// link first, then the one with the smallest peak. Mixed plans ran slower than the model says: Flux-dev
    /// within 24 GiB, 12 resident blocks beside 45 streamed, 506.4 and 494.2 ms against 492.8
    /// predicted, where every block checkpointed with 31 streamed ran 489.3 (1.26x) and 492.9
    /// on an earlier build (H100).
    pub fn plan_among<C: Candidate>(
        &self,
        budget: u64,
        candidates: Vec<C>,
    ) -> std::result::Result<Planned, NoPlan> {
        use rayon::prelude::*;
        let mut minimum = u64::MAX;
        // The chosen plan, and its rank among the near ones: (mixes, lacks room, bytes over
        // the link if it has room, peak).
        let mut chosen: Option<(usize, (bool, bool, u64, u64))> = None;
        let mut limit = f64::INFINITY;
        // Each candidate's peak, and the time model's cost of those that fit (taken on the
        // host's cores where not weighed already: the time model plays every block's passes,
        // seconds over a few thousand candidates on one core); the choice then goes through
        // them in order.
        let weights: Vec<(u64, Option<f64>)> = candidates
            .par_iter()
            .map(|c| c.weights(self, budget))
            .collect();
        for (i, (c, &(peak, cost))) in candidates.iter().zip(&weights).enumerate() {
            minimum = minimum.min(peak);
            let Some(cost) = cost else {
                continue;
            };
            // Past the first fitting plan, only those near its step are ranked.
            if chosen.is_some() && cost > limit {
                continue;
            }
            let plan = c.plan();
            let mixes = self.saves_activations(plan) && !plan.streamed.is_empty();
            let roomy = peak <= budget - budget / ROOM_DIVISOR;
            let link = if roomy { self.streamed_bytes(plan) } else { 0 };
            let rank = (mixes, !roomy, link, peak);
            match &chosen {
                None => {
                    limit = (1.0 + cost) * (1.0 + cost_model::NEAR) - 1.0;
                    chosen = Some((i, rank));
                }
                Some((_, r)) if rank < *r => chosen = Some((i, rank)),
                _ => {}
            }
        }
        let no = || NoPlan {
            budget,
            minimum,
            host: None,
        };
        let (i, (_, _, _, peak)) = chosen.ok_or_else(no)?;
        let plan = candidates
            .into_iter()
            .nth(i)
            .map(Candidate::into_plan)
            .ok_or_else(no)?;
        Ok(Planned {
            streamed_bytes: self.streamed_bytes(&plan),
            slowdown: self.step_ms(&plan) / self.resident_ms(),
            plan,
            peak,
        })
    }
}

/// What checkpointed blocks may keep, in the candidates: each of attention and the
/// down-projections, or both, or neither; always the outputs of Linears that see few rows
/// (at most a sixteenth of their weights' values, and their weights then stay off the
/// backward's uploads where only the forward reads them).
const KEEPS: [Keep; 4] = [
    Keep {
        attention: true,
        down_projections: true,
        few_rows: true,
    },
    Keep {
        attention: true,
        down_projections: false,
        few_rows: true,
    },
    Keep {
        attention: false,
        down_projections: true,
        few_rows: true,
    },
    Keep {
        attention: false,
        down_projections: false,
        few_rows: true,
    },
];

/// `n` of `prefixes` (execution order) spread evenly over it: block `k * len / n` for `k < n`
/// (all of them when `n >= len`). The hand-set `memory.stream_blocks` picks its blocks so.
pub fn spread_evenly(prefixes: &[String], n: usize) -> Vec<String> {
    let (len, n) = (prefixes.len(), n.min(prefixes.len()));
    (0..n).map(|k| prefixes[k * len / n].clone()).collect()
}

/// The forward's reach over `m` streamed blocks without a deeper fetch: `prefetch` ahead,
/// within the last.
pub(crate) fn shallow_reach(m: usize, prefetch: usize) -> Vec<usize> {
    (0..m)
        .map(|j| j.saturating_add(prefetch).min(m - 1))
        .collect()
}

/// How many of the first streamed blocks the backward may leave on the device for the next
/// forward, given the forward's `reach` (`MemoryProfile::reach`) and `prefetch`: the most,
/// `c`, such that at each place `j < c` the backward holds no more blocks (the kept places
/// `j..c` and the `prefetch` being fetched below `j`) than the forward may hold there (its
/// reach, and never less than `prefetch + 1`, what any place of a pass holds). So
/// `prefetch + 1` without a deeper reach.
pub fn carry(reach: &[usize], prefetch: usize) -> usize {
    let room = |j: usize| {
        (reach[j] + 1)
            .saturating_sub(j)
            .max(prefetch.saturating_add(1))
    };
    // If `c` fits, every smaller count does.
    (1..=reach.len())
        .take_while(|&c| (0..c).all(|j| c - j + prefetch.min(j) <= room(j)))
        .last()
        .unwrap_or(0)
}

/// Activation bytes of a transformer-style block per token and channel of its width, in
/// units of the activation dtype's size: what a resident block's forward keeps for the LoRA
/// step's backward. Measured on Flux-dev at 1024² (H100): the resident step's
/// peak (54.69 GiB) less weights, adapters, gradients and AdamW state (23.3 GiB), over 57
/// blocks of 4608 tokens x 3072 channels in bf16, is 20.9 values a token-channel.
pub const SAVED_PER_TOKEN_CHANNEL: f64 = 21.0;

/// The shape of one block's activations, which the families describe and the planner sizes
/// (`BlockCost`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BlockShape {
    /// Positions (tokens, or pixels of a feature map) per sample.
    pub tokens: usize,
    /// Positions each of the block's weights multiplies, on average (its work is this times
    /// its weights): `tokens`, except in double-stream blocks (Flux's, SD3's joint blocks),
    /// whose image weights see the image tokens and text weights the text tokens.
    pub weight_tokens: usize,
    /// Channels of the block's stream.
    pub width: usize,
    /// Transformer-layer equivalents of work per token (1 for a Flux or SD3 block; a UNet
    /// block counts its transformer layers and a fraction for its ResNet).
    pub layers: f64,
    /// Attention calls whose outputs `Keep { attention }` would keep.
    pub attention_calls: usize,
    /// Of those, the calls whose keys are the context's tokens (`context_tokens`), not the
    /// block's own (an SDXL transformer layer's cross-attention).
    pub cross_calls: usize,
    /// Tokens of the context that cross-attention and the `context_keys` weights see.
    pub context_tokens: usize,
    /// Key fragments of the block's weights that multiply the context's tokens, not the
    /// block's positions (an SDXL layer's cross-attention keys and values).
    pub context_keys: &'static [&'static str],
    /// Ops the block's forward records on the tape that launch work, with an adapter on
    /// each of its Linears (`autograd::recorded_ops`, counted on each family's blocks): the
    /// host issues each, and each one's backward.
    pub ops: usize,
    /// Views among the ops it records (reshapes, permutes, narrows, broadcasts): no launch,
    /// but the host's time.
    pub views: usize,
    /// Attention heads (for the f32 log-sum-exp per head and token).
    pub heads: usize,
    /// Key fragments of the block's Linear weights whose input is the conditioning vector
    /// (a row a sample: Flux's and SD3's modulations, a UNet ResNet's time embedding): with
    /// `Keep::few_rows` only the forward reads them, and the backward's uploads leave them
    /// out (`BlockCost::forward_only_bytes`); with `Plan::host_products` they stay on the
    /// host, past the blocks the backward leaves for the forward, in both passes.
    pub conditioned: &'static [&'static str],
    /// Key fragments of the block's last Linears whose outputs no gradient of a
    /// checkpoint's re-run reads (an SDXL transformer layer ends `x + ff(h)`; FLUX.2's
    /// blocks `x + gate * linear(h)`, the gate from the model's modulation, while that needs
    /// no gradient): the re-run runs none of their base products and no `Keep` keeps them
    /// (`nn::Linear::forward_tail`; `BlockCost::tail_flops`).
    pub tails: &'static [&'static str],
    /// Key fragments of the layers outside the blocks that the tails' gates come from: an
    /// adapter on any of them makes the gates need gradients, and the tails plain Linears.
    pub tail_gates: &'static [&'static str],
}

impl BlockShape {
    /// The forward's attention FLOPs for `batch` samples (4 · queries · keys · width a call).
    pub fn attention_flops(&self, batch: usize) -> f64 {
        let own = self.attention_calls.saturating_sub(self.cross_calls) * self.tokens;
        let cross = self.cross_calls * self.context_tokens;
        4.0 * (batch * self.tokens * self.width) as f64 * (own + cross) as f64
    }

    /// The positions a weight of key `key` multiplies for `batch` samples: the context's
    /// tokens for `context_keys`, else `weight_tokens`.
    pub fn positions(&self, key: &str, batch: usize) -> usize {
        batch
            * if self.context_keys.iter().any(|c| key.contains(c)) {
                self.context_tokens
            } else {
                self.weight_tokens
            }
    }

    /// The rows a Linear of weight key `key` multiplies for `batch` samples: a row a sample
    /// for the Linears over the conditioning vector (`conditioned`), else its `positions`.
    pub fn rows_of(&self, key: &str, batch: usize) -> usize {
        if self.conditioned.iter().any(|c| key.contains(c)) {
            batch
        } else {
            self.positions(key, batch)
        }
    }

    /// The width of its attention heads.
    pub fn head_dim(&self) -> usize {
        self.width / self.heads.max(1)
    }

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
                wire_bytes: if i < 2 { 225 } else { 75 },
                coded_bytes: if i < 2 { 225 } else { 75 },
                input_bytes: 10,
                saved_bytes: 200,
                attention_bytes: 5,
                down_bytes: 4,
                down_weight_bytes: if i < 2 { 100 } else { 25 },
                gemm_flops: if i < 2 { 3e12 } else { 1e12 },
                // A third of the large blocks' weights, a quarter of the others'.
                down_flops: if i < 2 { 1e12 } else { 0.25e12 },
                head_dim: 128,
                tensors: 1,
                ..BlockCost::default()
            })
            .collect();
        MemoryProfile {
            blocks,
            other_weight_bytes: 50,
            other_kept_bytes: 0,
            trainable_bytes: 20,
            optimizer_bytes: 40,
            fixed_bytes: 30,
            machine: Machine::REFERENCE,
            product_code: Default::default(),
        }
    }

    /// The products of the Linears over the context computed in the backward before
    /// (`Plan::ahead_products`): their weights leave the forward's uploads but for the last
    /// `prefetch + 1` blocks' and join the backward's, their products held between; the
    /// plans that do so are candidates only where allowed, beside their twins, and only
    /// with few-row outputs kept and such Linears among the streamed blocks.
    #[test]
    fn context_products_computed_ahead_move_their_weights_to_the_backward() {
        let mut p = profile();
        for b in &mut p.blocks {
            b.context_bytes = 40;
            b.context_wire = 30;
            b.context_coded = 30;
            b.context_product_bytes = 2;
        }
        let base = p
            .settle(&Plan {
                checkpointing: Checkpointing::All,
                streamed: (0..6).map(|i| format!("b.{i}")).collect(),
                prefetch: 1,
                keep: Keep {
                    few_rows: true,
                    ..Keep::NONE
                },
                wire_code: true,
                ..Plan::default()
            })
            .unwrap();
        let ahead = p
            .settle(&Plan {
                ahead_products: true,
                ..base.clone()
            })
            .unwrap();
        assert!(ahead.ahead_products && ahead.to_string().contains("context products"));
        // The forward uploads blocks 2..6 (the backward left the first two on the device)
        // and those of 2 and 3 leave out 30 coded bytes each (the last two stay for the
        // backward, whole).
        assert_eq!(p.streamed_bytes(&base) - p.streamed_bytes(&ahead), 2 * 30);
        // Six blocks' products held.
        assert_eq!(p.peak_parts(&ahead).held, p.peak_parts(&base).held + 6 * 2);
        assert_ne!(p.step_phases_ms(&ahead), p.step_phases_ms(&base));
        // Nothing to compute ahead without the few-row outputs kept or such Linears.
        let none = Plan {
            keep: Keep::NONE,
            ..ahead.clone()
        };
        assert!(!p.settle(&none).unwrap().ahead_products);
        let plain = profile();
        assert!(!plain.settle(&ahead).unwrap().ahead_products);
        // Candidates: none by default, each beside its twin where allowed.
        assert!(p.candidates().iter().all(|c| !c.ahead_products));
        let with = p.candidates_allowing(false, false, true);
        let twins: Vec<&Plan> = with.iter().filter(|c| c.ahead_products).collect();
        assert!(!twins.is_empty());
        for c in twins {
            assert!(c.keep.few_rows && !c.streamed.is_empty());
            let twin = Plan {
                ahead_products: false,
                ..c.clone()
            };
            assert!(with.contains(&twin), "{c}");
        }
    }

    #[test]
    fn kept_transposes_count_only_for_resident_blocks() {
        let mut p = profile();
        let streamed = Plan {
            streamed: vec!["b.0".into(), "b.1".into()],
            prefetch: 2,
            ..Plan::default()
        };
        let (before, before_streamed) = (p.peak(&Plan::default()), p.peak(&streamed));
        // Each block's FP8 codes transposed beside them: as many bytes again (b.0, b.1: 300).
        for b in &mut p.blocks {
            b.kept_bytes = b.weight_bytes;
        }
        assert_eq!(p.peak(&Plan::default()), before + 300 + 300 + 4 * 100);
        // The streamed blocks keep none.
        assert_eq!(p.peak(&streamed), before_streamed + 4 * 100);
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
            keep: Keep {
                attention: true,
                ..Keep::NONE
            },
            ..Plan::default()
        };
        assert_eq!(p.peak(&all), 1050 + 80 + 90 + 220 + 30);
        // Keeping the down-projections too: 6 x 4 more held; the re-run skips their share
        // of each block's work (a third of the large blocks', a quarter of the others').
        let both = Plan {
            keep: Keep {
                attention: true,
                down_projections: true,
                ..Keep::NONE
            },
            ..all.clone()
        };
        assert_eq!(p.peak(&both), p.peak(&all) + 24);
        let skipped = (2.0 * 1e12 + 4.0 * 0.25e12) / (p.machine.gemm_tflops * 1e9);
        assert!((p.step_ms(&all) - p.step_ms(&both) - skipped).abs() < 1e-9);
        // Streaming the two large blocks with prefetch 2: both on the device at once.
        let streamed = Plan {
            streamed: vec!["b.0".into(), "b.1".into()],
            prefetch: 2,
            ..all.clone()
        };
        assert_eq!(p.peak(&streamed), 50 + 400 + 600 + 80 + 90 + 220 + 30);
        // The same peak by its terms: the streamed blocks' copies among what is held.
        assert_eq!(
            p.peak_parts(&streamed),
            PeakParts {
                weights: 50 + 400,
                staging: 0,
                adapters: 40,
                optimizer: 40,
                held: 600 + 90,
                work: 220,
                fixed: 30,
            }
        );
        // No more than prefetch + 1 blocks: none ever leaves the device.
        assert_eq!(p.streamed_bytes(&streamed), 0);
        // Four with a prefetch of one: the forward uploads all but the first two (b.2, b.3),
        // the backward all but the last two (b.0, b.1).
        let four = Plan {
            streamed: (0..4).map(|i| format!("b.{i}")).collect(),
            prefetch: 1,
            ..all.clone()
        };
        assert_eq!(p.streamed_bytes(&four), 200 + 600);
    }

    /// Each copy takes its own block's bytes, so the heaviest moment is found place by
    /// place. Six blocks streamed with a prefetch of one, two of 300 bytes before four of
    /// 100, each holding 10 bytes of inputs: the backward at b.1 has b.0 and b.1 on the
    /// device beside 20 held (620), more than at its start (all 60 held beside b.4 and b.5:
    /// 260), and less than both large blocks beside everything held (660).
    #[test]
    fn each_copy_takes_its_own_blocks_bytes() {
        let p = profile();
        let all = Plan {
            checkpointing: Checkpointing::All,
            streamed: (0..6).map(|i| format!("b.{i}")).collect(),
            prefetch: 1,
            ..Plan::default()
        };
        // Other weights 50, adapters and their gradients 40, optimizer 40, fixed 30; the
        // re-run's tape 200 and its inputs' gradients 20.
        assert_eq!(p.peak(&all), 50 + 40 + 40 + 30 + 620 + 220);
        // Weights held on the host leave every copy: four blocks of 100 holding 60 each, 40
        // of each block's bytes read only by the forward. At the backward's start 240 are
        // held beside b.2 and b.3 without theirs (120): 360, against 440 with them.
        let mut p = profile();
        p.blocks.truncate(4);
        for b in &mut p.blocks {
            b.weight_bytes = 100;
            b.input_bytes = 60;
            b.forward_only_bytes = 40;
        }
        let off = Plan {
            streamed: (0..4).map(|i| format!("b.{i}")).collect(),
            ..all.clone()
        };
        let on = Plan {
            host_products: true,
            ..off.clone()
        };
        assert_eq!(p.peak(&off) - p.peak(&on), 80);
        // Fetching deeper: place 0 has 360 - 60 = 300 for the four copies (240): the
        // forward starts with all four, the peak unchanged, and the backward leaves three
        // (at place 1 it holds b.1-b.3 and fetches b.0, one more than the forward holds
        // there). With their weights whole (100 each), place 0 has 440 - 60 = 380, not the
        // 400 of four copies.
        let deep = Plan {
            deep_prefetch: true,
            ..on.clone()
        };
        assert_eq!(p.reach(&deep), vec![3, 3, 3, 3]);
        assert_eq!(carry(&p.reach(&deep), 1), 3);
        assert_eq!(p.peak(&deep), p.peak(&on));
        let whole = Plan {
            deep_prefetch: true,
            ..off.clone()
        };
        assert_eq!(p.reach(&whole), vec![2, 3, 3, 3]);
        assert_eq!(p.peak(&whole), p.peak(&off));
    }

    /// The products of weights held on the host start with the backward before the forward
    /// that needs them: where the host finishes them in that time the forward waits for
    /// none and the step is shorter than with those weights on the link; where they take
    /// the host far longer than the backward (nearly all of each block's bytes read only by
    /// the forward, the backward's uploads small), the forward waits for them and the
    /// weights are better on the link.
    #[test]
    fn host_products_count_their_time_against_the_backward_before() {
        const GIB: u64 = 1 << 30;
        let with = |forward_only: u64| MemoryProfile {
            blocks: (0..4)
                .map(|i| BlockCost {
                    prefix: format!("b.{i}"),
                    weight_bytes: 4 * GIB,
                    wire_bytes: 4 * GIB,
                    input_bytes: 10 << 20,
                    saved_bytes: GIB,
                    gemm_flops: 4e12,
                    head_dim: 128,
                    tensors: 1,
                    forward_only_bytes: forward_only,
                    forward_only_wire: forward_only,
                    ..BlockCost::default()
                })
                .collect(),
            other_weight_bytes: 0,
            other_kept_bytes: 0,
            trainable_bytes: 0,
            optimizer_bytes: 0,
            fixed_bytes: 0,
            machine: Machine::REFERENCE,
            product_code: Default::default(),
        };
        let plan = |host: bool| Plan {
            checkpointing: Checkpointing::All,
            streamed: (0..4).map(|i| format!("b.{i}")).collect(),
            prefetch: 1,
            keep: Keep {
                few_rows: true,
                ..Keep::NONE
            },
            host_products: host,
            ..Plan::default()
        };
        let p = with(GIB);
        assert!(p.step_ms(&plan(true)) < p.step_ms(&plan(false)));
        // 3 GiB a block: the host's 343 ms of products would hold the forward back past the
        // link's uploads if they began with it; begun with the backward before, they do not.
        let p = with(3 * GIB);
        assert!(p.step_ms(&plan(true)) < p.step_ms(&plan(false)));
        let p = with(4 * GIB - (64 << 20));
        assert!(p.step_ms(&plan(true)) > p.step_ms(&plan(false)));
    }

    /// A block's forward and backward worked by hand from its work and the machine's rates:
    /// the GPU's time (GEMMs, convolutions, attention at its head width, memory passes) or the
    /// host's issue of its ops and views, the longer; keeping attention takes its FLOPs out
    /// of a re-run.
    #[test]
    fn a_block_takes_its_work_at_the_machines_rates_or_the_hosts_issue() {
        let m = Machine {
            gemm_tflops: 500.0,
            conv_tflops: 250.0,
            attention_tflops: [300.0, 600.0],
            attention_backward_tflops: [200.0, 400.0],
            memory_gib_per_s: 1000.0,
            fp8_decode_gib_per_s: 500.0,
            op_us: 10.0,
            backward_op_us: 20.0,
            view_us: 2.0,
            backward_view_us: 1.0,
            ..Machine::REFERENCE
        };
        const GIB: u64 = 1 << 30;
        let mut p = profile();
        p.machine = m;
        let b = BlockCost {
            gemm_flops: 1e12,
            conv_flops: 5e11,
            // At D 96: half way between the rates at 64 and 128.
            attention_flops: 9e11,
            head_dim: 96,
            saved_bytes: GIB,
            adapter_forward_bytes: GIB / 2,
            adapter_backward_bytes: GIB,
            ops: 10.0,
            views: 10.0,
            ..p.blocks[0].clone()
        };
        // 2 + 2 + 2 ms of products and attention (450 TFLOP/s), 2 + 0.5 ms over memory.
        assert!((p.forward_ms(&b, Keep::NONE) - 8.5).abs() < 1e-9);
        // 2 + 2 + 2.5 x 3 (300 TFLOP/s backward), 4 + 1 ms over memory.
        assert!((p.backward_ms(&b) - 16.5).abs() < 1e-9);
        let kept = Keep {
            attention: true,
            ..Keep::NONE
        };
        assert!((p.forward_ms(&b, kept) - 6.5).abs() < 1e-9);
        // Many small kernels: the host's issue sets the time (10 000 ops, 20 000 views).
        let small = BlockCost {
            ops: 10_000.0,
            views: 20_000.0,
            ..b.clone()
        };
        assert!((p.forward_ms(&small, Keep::NONE) - (100.0 + 40.0)).abs() < 1e-9);
        assert!((p.backward_ms(&small) - (200.0 + 20.0)).abs() < 1e-9);
        // An FP8 block decodes its codes at each use: 0.5 GiB at 500 GiB/s.
        let fp8 = BlockCost {
            decode_bytes: GIB / 2,
            ..b.clone()
        };
        assert!((p.forward_ms(&fp8, Keep::NONE) - 9.5).abs() < 1e-9);
        assert!((p.backward_ms(&fp8) - 17.5).abs() < 1e-9);
        // A checkpointed block's forward records nothing: not measured, it issues at the
        // recorded costs; measured (4 µs an op, 0.5 a view), at its own: 40 + 10 ms.
        assert!((p.unrecorded_forward_ms(&small) - 140.0).abs() < 1e-9);
        p.machine = Machine {
            unrecorded_op_us: 4.0,
            unrecorded_view_us: 0.5,
            ..m
        };
        assert!((p.unrecorded_forward_ms(&small) - 50.0).abs() < 1e-9);
        // Its GPU work is the forward's where that is the longer.
        assert!((p.unrecorded_forward_ms(&b) - 8.5).abs() < 1e-9);
    }

    /// One table of the blocks' times (`block_times`), and each plan's blocks placed once
    /// (`Placed`), weigh every candidate exactly as its own estimates do (`cost`, which
    /// makes only the slot its plan reads; `peak`; `spare`; `host_bytes`).
    #[test]
    fn one_table_of_block_times_weighs_every_plan_as_its_own() {
        let mut p = profile();
        p.machine = Machine {
            op_us: 9.0,
            unrecorded_op_us: 6.0,
            ..Machine::REFERENCE
        };
        let times = p.block_times();
        let candidates = p.candidates();
        assert!(candidates.len() > 10);
        for plan in candidates {
            let w = Weighed::with_times(&p, plan.clone(), &times);
            assert_eq!(w.cost.to_bits(), p.cost(&plan).to_bits(), "{plan}");
            assert_eq!(w.peak, p.peak(&plan));
            assert_eq!(w.spare, p.spare(&plan), "{plan}");
            assert_eq!(w.host, p.host_bytes(&plan), "{plan}");
        }
    }

    /// The step's forward issues a checkpointed block's ops recording nothing and a resident
    /// block's recorded: a host-paced step with every block checkpointed has the shorter
    /// forward, the re-runs (recorded) in its backward.
    #[test]
    fn checkpointed_forwards_issue_without_recording() {
        let mut p = profile();
        for b in p.blocks.iter_mut() {
            b.ops = 10_000.0;
            b.views = 0.0;
        }
        p.machine = Machine {
            op_us: 10.0,
            unrecorded_op_us: 4.0,
            ..Machine::REFERENCE
        };
        let all = Plan {
            checkpointing: Checkpointing::All,
            ..Plan::default()
        };
        let (resident_forward, _) = p.step_phases_ms(&Plan::default());
        let (forward, step) = p.step_phases_ms(&all);
        let n = p.blocks.len() as f64;
        assert!(
            (resident_forward - n * 100.0).abs() < 1e-6,
            "{resident_forward}"
        );
        assert!((forward - n * 40.0).abs() < 1e-6, "{forward}");
        // The backward re-runs each block recorded (100 ms) beside its backward.
        let back: f64 = p.blocks.iter().map(|b| p.backward_ms(b)).sum();
        assert!((step - forward - back - n * 100.0).abs() < 1e-6, "{step}");
    }

    /// A prefetch past the last block (up to `usize::MAX`) fetches them all, as one of the
    /// blocks' count does: the same reach, carry, peak, time and bytes, no overflow.
    #[test]
    fn a_prefetch_past_the_blocks_fetches_them_all() {
        let p = profile();
        let with = |prefetch: usize| Plan {
            checkpointing: Checkpointing::All,
            streamed: (0..6).map(|i| format!("b.{i}")).collect(),
            prefetch,
            deep_prefetch: true,
            ..Plan::default()
        };
        let (all, huge) = (with(6), with(usize::MAX));
        assert_eq!(p.reach(&huge), p.reach(&all));
        assert_eq!(carry(&p.reach(&huge), usize::MAX), 6);
        assert_eq!(p.peak(&huge), p.peak(&all));
        assert_eq!(p.step_ms(&huge), p.step_ms(&all));
        assert_eq!(p.streamed_bytes(&huge), 0);
        assert_eq!(p.spare(&huge), p.spare(&all));
    }

    /// The forward's reach worked by hand: four blocks of 100 bytes, all streamed with a
    /// prefetch of one and checkpointed, each holding 60 bytes of inputs until the
    /// backward. The peak sets aside the window (200) and everything held (240); once block
    /// j has run, the blocks up to it hold 60 (j + 1).
    #[test]
    fn the_forward_reaches_as_far_as_the_memory_held_later_allows() {
        let mut p = profile();
        p.blocks.truncate(4);
        for b in &mut p.blocks {
            b.weight_bytes = 100;
            b.input_bytes = 60;
        }
        let shallow = Plan {
            checkpointing: Checkpointing::All,
            streamed: (0..4).map(|i| format!("b.{i}")).collect(),
            prefetch: 1,
            ..Plan::default()
        };
        let deep = Plan {
            deep_prefetch: true,
            ..shallow.clone()
        };
        assert_eq!(p.reach(&shallow), vec![1, 2, 3, 3]);
        // The heaviest moment is the backward's start: 240 held beside b.2 and b.3. Place 0
        // has 440 - 60 = 380 for b.0-b.2, place 1 has 320 for b.1-b.3.
        assert_eq!(p.reach(&deep), vec![2, 3, 3, 3]);
        assert_eq!(carry(&p.reach(&shallow), 1), 2);
        // At place 1 the backward holds 0-2 (three, as the forward there); four would not fit
        // at place 0.
        assert_eq!(carry(&p.reach(&deep), 1), 3);
        assert_eq!(p.peak(&deep), p.peak(&shallow));
        // The forward uploads the last one only; the backward the first two.
        assert_eq!(p.streamed_bytes(&shallow), 200 + 200);
        assert_eq!(p.streamed_bytes(&deep), 100 + 200);
        assert!(p.step_ms(&deep) <= p.step_ms(&shallow));
        // A block that keeps its activations (resident, not checkpointed) keeps the reach
        // at the prefetch.
        let mixed = Plan {
            checkpointing: Checkpointing::Off,
            streamed: (0..3).map(|i| format!("b.{i}")).collect(),
            ..deep.clone()
        };
        assert!(p.saves_activations(&mixed) && !p.saves_activations(&deep));
        assert_eq!(p.reach(&mixed), vec![1, 2, 2]);
        // All streamed: checkpointed whatever the checkpointing says.
        let all_streamed = Plan {
            checkpointing: Checkpointing::Off,
            ..deep.clone()
        };
        assert_eq!(p.reach(&all_streamed), p.reach(&deep));
        // A reach never falls below the prefetch's, nor past the last block.
        let one = Plan {
            streamed: vec!["b.3".into()],
            ..deep.clone()
        };
        assert_eq!(p.reach(&one), vec![0]);
        assert_eq!(carry(&p.reach(&one), 1), 1);
    }

    /// Every block but the first j: those keep what a resident block saves, the rest their
    /// inputs; the re-runs of the first j are saved. The candidates hold them for each
    /// sixteenth of the blocks, with nothing streamed.
    #[test]
    fn every_block_but_the_first_keeps_the_firsts_activations() {
        let p = profile();
        let all = Plan {
            checkpointing: Checkpointing::All,
            ..Plan::default()
        };
        let but2 = Plan {
            checkpointing: Checkpointing::AllBut(2),
            ..all.clone()
        };
        // b.0 and b.1 hold their 200 saved bytes instead of their 10 of inputs.
        assert_eq!(p.peak(&but2), p.peak(&all) + 2 * (200 - 10));
        let reruns: f64 = p.blocks[..2]
            .iter()
            .map(|b| p.forward_ms(b, Keep::NONE))
            .sum();
        assert!((p.step_ms(&all) - p.step_ms(&but2) - reruns).abs() < 1e-9);
        assert!(!Checkpointing::AllBut(2).covers(1) && Checkpointing::AllBut(2).covers(2));
        // Six blocks: every j from 1 to 5, never beside streamed blocks.
        let mut js: Vec<usize> = p
            .candidates()
            .iter()
            .filter_map(|c| match c.checkpointing {
                Checkpointing::AllBut(j) => {
                    assert!(c.streamed.is_empty(), "{c}");
                    Some(j)
                }
                _ => None,
            })
            .collect();
        js.sort();
        js.dedup();
        assert_eq!(js, [1, 2, 3, 4, 5]);
        // Where it fits and every 2nd block's activations do not, the planner does no
        // worse than it.
        let budget = p.peak(&but2) + p.peak(&but2) / MARGIN_DIVISOR + 1;
        let planned = p.plan(budget).unwrap();
        assert!(
            p.cost(&planned.plan) <= p.cost(&but2) + 1e-12,
            "{}",
            planned.plan
        );
        assert_eq!(but2.to_string(), "every block but the first 2 checkpointed");
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
                    p.peak(c)
                        <= if p.spare(c) {
                            budget - budget / MARGIN_DIVISOR
                        } else {
                            budget
                        }
                })
                .map(|c| p.cost(&c))
                .fold(f64::INFINITY, f64::min);
            assert!(planned.peak <= budget);
            // The fastest, or one within NEAR of it with a smaller peak.
            let cost = p.cost(&planned.plan);
            assert!(
                cost >= best && 1.0 + cost <= (1.0 + best) * (1.0 + cost_model::NEAR) + 1e-12,
                "{budget}: {cost} against {best}"
            );
            // Streamed blocks are the small ones first.
            if let Some(first) = planned.plan.streamed.first() {
                assert!(first != "b.0" && first != "b.1", "{budget}: {first}");
            }
        }
        // The time model: every block checkpointed costs each block's re-run (its forward
        // less what it keeps).
        let all = Plan {
            checkpointing: Checkpointing::All,
            keep: Keep {
                attention: true,
                ..Keep::NONE
            },
            ..Plan::default()
        };
        let reruns: f64 = p.blocks.iter().map(|b| p.forward_ms(b, all.keep)).sum();
        assert!((p.cost(&all) - reruns / p.resident_ms()).abs() < 1e-12);
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

    /// The time model's two clocks on four blocks of 1 GiB weights, all streamed with a
    /// prefetch of one, worked by hand.
    #[test]
    fn the_time_model_plays_uploads_against_compute() {
        use cost_model::*;
        const G: u64 = 1 << 30;
        let p = MemoryProfile {
            blocks: (0..4)
                .map(|i| BlockCost {
                    prefix: format!("b.{i}"),
                    weight_bytes: G,
                    wire_bytes: G,
                    saved_bytes: G,
                    gemm_flops: 4e12,
                    head_dim: 128,
                    tensors: 1,
                    ..BlockCost::default()
                })
                .collect(),
            other_weight_bytes: 0,
            other_kept_bytes: 0,
            trainable_bytes: 0,
            optimizer_bytes: 0,
            fixed_bytes: 0,
            machine: Machine::REFERENCE,
            product_code: Default::default(),
        };
        let b0 = &p.blocks[0];
        let (f, bk) = (p.forward_ms(b0, Keep::NONE), p.backward_ms(b0));
        assert!((p.resident_ms() - 4.0 * (f + bk)).abs() < 1e-9);
        let all = Plan {
            checkpointing: Checkpointing::All,
            keep: Keep {
                attention: true,
                ..Keep::NONE
            },
            ..Plan::default()
        };
        let r = p.forward_ms(b0, all.keep);
        assert!((p.cost(&all) - r / (f + bk)).abs() < 1e-12);
        let streamed = Plan {
            streamed: (0..4).map(|i| format!("b.{i}")).collect(),
            prefetch: 1,
            ..all.clone()
        };
        let up = 1e3 / p.machine.upload_gib_per_s;
        // Each streamed block's entry: the host issues its (uncoded) upload.
        let o = STREAM_OPS * p.machine.op_us / 1e3;
        let b = bk + r;
        // Forward: blocks 0 and 1 stay from the last backward; block 1's entry starts 2's
        // upload, block 2's entry 3's (after 2's, on the one link).
        let t0 = o + f;
        let up2 = t0 + up; // issued as block 1 entered: after block 0's compute
        let t1 = t0 + o + f;
        let t2 = t1.max(up2) + o + f;
        let up3 = up2.max(t1) + up;
        let t3 = t2.max(up3) + o + f;
        // Backward: blocks 3 and 2 stay; block 2's entry starts 1's upload, 1's starts 0's.
        let t = t3 + o + b;
        let up1 = up3.max(t) + up;
        let t = t + o + b;
        let up0 = up1.max(t) + up;
        let t = t.max(up1) + o + b;
        let t = t.max(up0) + o + b;
        assert!(
            (p.step_ms(&streamed) - t).abs() < 1e-9,
            "{} against {t}",
            p.step_ms(&streamed)
        );
        // Copies the compute cannot hide set the step: at least the uploads of each pass.
        assert!(t > 4.0 * up);
        // Streaming no more than prefetch + 1 blocks costs only the per-block time: they
        // never leave the device.
        let two = Plan {
            streamed: vec!["b.2".into(), "b.3".into()],
            ..streamed.clone()
        };
        let want = p.step_ms(&all) + 4.0 * o;
        assert!((p.step_ms(&two) - want).abs() < 1e-9);
    }
}
