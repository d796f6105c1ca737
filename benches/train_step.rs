//! One full-size LoRA training step at 1024² (batch 1, bf16 or FP8 random base weights,
//! rank-16 LoRA on every Linear of the blocks, f32 adapters): forward, backward and the
//! optimizer update, timed after a warm-up, with peak GPU memory. `--model flux` (Flux-dev:
//! 4096 image + 512 text tokens; the default), `sd35` (SD3.5-large: 4096 + 333), `sdxl`
//! (128² latents, 77 text tokens), `klein4b` or `klein9b` (FLUX.2 [klein]: 4096 + 512) or
//! `zimage` (Z-Image 6B: 4096 + 512).
//!
//! The memory plan: `--budget GB` lets the planner choose (its plan and predicted peak are
//! printed; the allocator is capped at the budget), or by hand `--checkpoint
//! none|all|every:N`, `--stream N` (N blocks spread evenly over the model), `--prefetch K`
//! (with the planner too: every streaming plan then fetches K ahead),
//! `--cap GB` (the allocator capped for a plan given by hand), `--keep-attention`,
//! `--keep-down` (the down-projections' outputs), `--no-keep-few` (the
//! outputs of Linears that see few rows are recomputed, and their weights not left out of the
//! backward's uploads; with the planner too), `--raw-wire` (streamed
//! bf16 weights cross the link uncoded, with the planner too), `--no-cross` (nothing crossed
//! into the staging ring at the backward's end, with the planner too), `--no-mixed` /
//! `--only-mixed` (the planner only among the plans that do not mix resident blocks keeping
//! their activations with streamed ones, `Plan::mixes`, or only among those that do),
//! `--shallow` (the forward
//! fetches only `--prefetch` ahead and the backward leaves only that many and one for it,
//! with the planner too), `--no-host-products` (streamed blocks' Linears over the
//! conditioning vector bring their weights to the GPU instead of computing their products on
//! the host, with the planner too), `--raw-backward` (the plan, the planner's pick or one by
//! hand, with the backward's uploads uncoded and the forward's coded: `Plan::raw_backward`;
//! `FLAME_PLANNER=raw_backward=on` lets the planner weigh such plans), `--ahead-products` (the
//! plan with the products of the Linears over the context computed in the backward before:
//! `Plan::ahead_products`; `FLAME_PLANNER=ahead_products=on` lets the planner weigh such
//! plans). `--budget GB` is the process's budget as the driver
//! counts it, split as `train` splits it (what the process holds outside the allocator,
//! measured, and `memory::LATE_HEADROOM` come off it; the allocator is capped at the rest);
//! `--headroom GB` instead plans for the budget less that, the cap staying at the budget. `--fp8` stores the base weights
//! in FP8 E4M3, `--fp8-compute` also computes their products in 8 bits (`model.compute =
//! "fp8"`), `--int8-compute` in int8 (`model.compute = "int8"`, the weights as int8 codes;
//! `--int8-rotation` with their inner axis rotated, the outlier treatment),
//! `--adam8bit` uses 8-bit AdamW. `FLAME_GPU_MEMORY_LIMIT` caps FLAME's device memory. The line printed has FLAME's
//! peak, the driver's view of the device memory in use (sampled every 2 ms through the timed
//! steps; `--no-sampling` leaves the driver unqueried), host peak RSS and the bytes streamed. `--steps N` times N steps after the warm-up (3 unless given). `--host-probe` issues one more step with about a second of GEMMs queued between
//! its forward and backward, and prints when the host had issued the backward and the update:
//! the host's own cost where nothing in them waits for the GPU. `--phases` times one more
//! step with the device synchronised after its forward and after its backward;
//! `--memory-trace` one more with FLAME's allocator read around each block's forward and
//! re-run (`memory::trace_blocks`): where the step's peak falls. `--link-trace FILE` writes
//! each upload of the timed steps (copies and decodes timed) as CSV and prints how long the
//! compute stream stood waiting for the uploads, pass by pass and block by block. Each step
//! announces the next one's inputs between its forward and its backward
//! (`DiffusionModel::prepare`: host products computed during the backward); `--no-prepare`
//! leaves them to each forward. Each step reads bf16 compute copies of the adapters' f32
//! weights made in one launch at its start, their gradients folded back in one
//! (`ComputeCopies`); `--per-use-casts` casts each weight at each use instead.
//!
//! Data-parallel: started with torchrun's variables (`WORLD_SIZE`, `RANK`, `LOCAL_RANK`,
//! `MASTER_ADDR`, `MASTER_PORT`; one process per GPU), each rank takes its part of a global
//! batch of `--batch N` samples (default: one per rank), the adapter gradients are summed
//! over NCCL in buckets during the backward, and rank 0 prints the global loss and the step
//! time; `--allreduce-mib M` first times NCCL sums of M MiB (bus bandwidth, as nccl-tests
//! counts it).
//!
//! `--alternate "ARGS" [--rounds N]` runs the step N times (2 unless given) in one process
//! as the other arguments say and then with ARGS added (say `--alternate "--prefetch 3"`),
//! the model and its streamer built afresh each time: a plan's effect apart from the
//! process's (one GPU, not data-parallel). `--alternate` may be given several times: each
//! round runs every variant in turn. It ends with the runs' times and each variant's ratio
//! to the first, round by round and of the means.
//!
//! `--rivals` (with `--budget`) prints the plans of other kinds the planner puts near its
//! pick, those `train` times beside it with `memory.trial_steps`
//! (`MemoryProfile::rivals`); `--rival K` runs the K-th of them instead of the pick.
//!
//! `--rerun-ahead` (a plan given by hand) issues each checkpoint's re-run on a helper
//! thread while the backward before it is issued (`flame::autograd::ahead`,
//! `Plan::rerun_ahead`); `--serial-reruns` keeps the planner from it. `--side-stream` runs
//! those re-runs on the GPU's second compute stream beside the backward under a cap
//! (`CudaDevice::set_side_stream`).

mod common;

use flame::autograd::Keep;
use flame::memory::{
    spread_evenly, BlockExec, BlockStreamer, Checkpointing, MemoryProfile, Plan, Switches,
};
use flame::models::flux::{Flux, FluxConfig};
use flame::models::flux2::{Flux2, Flux2Config};
use flame::models::sd3::{Sd3, Sd3Config};
use flame::models::sdxl::{SdxlConfig, Unet};
use flame::models::zimage::{ZImage, ZImageConfig};
use flame::models::{profile_config, LoadOptions, ModelSpec, Objective, RunShape};
use flame::nn::adapter::ComputeCopies;
use flame::nn::{Adapters, LoraConfig, VarBuilder};
use flame::optim::{AdamConfig, AdamW, AdamW8bit, AdamW8bitConfig, Optimizer};
use flame::train::{flow_matching, weighted_mse, TimestepSampling};
use flame::{DType, Device, Grads, Result, Tensor};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

const GIB: f64 = (1u64 << 30) as f64;

/// The command line.
struct Args(Vec<String>);

impl Args {
    /// The arguments but the values given to `--alternate` (another variant's arguments, not
    /// this one's).
    fn own(&self) -> impl Iterator<Item = &String> + '_ {
        self.0
            .iter()
            .enumerate()
            .filter(|&(i, _)| i == 0 || self.0[i - 1] != "--alternate")
            .map(|(_, a)| a)
    }
    fn value(&self, name: &str) -> Option<String> {
        let own: Vec<&String> = self.own().collect();
        own.iter()
            .position(|a| *a == name)
            .and_then(|i| own.get(i + 1).map(|v| v.to_string()))
    }
    /// Every value given after `name`, in order.
    fn values(&self, name: &str) -> Vec<String> {
        self.0
            .windows(2)
            .filter(|w| w[0] == name)
            .map(|w| w[1].clone())
            .collect()
    }
    fn flag(&self, name: &str) -> bool {
        self.own().any(|a| a == name)
    }
}

fn main() -> Result<()> {
    let args = Args(std::env::args().skip(1).collect());
    // `--alternate "ARGS" [--rounds N]`: see the module's doc.
    let extras = args.values("--alternate");
    if extras.is_empty() {
        return run_model(&args).map(drop);
    }
    if std::env::var_os("WORLD_SIZE").is_some() {
        eprintln!("--alternate runs one process on one GPU, not under torchrun");
        std::process::exit(2);
    }
    let rounds: usize = args
        .value("--rounds")
        .map_or(2, |n| n.parse().expect("--rounds N"));
    let mut variants = vec![("as given".to_string(), Args(args.0.clone()))];
    for extra in &extras {
        let mut with = args.0.clone();
        with.extend(extra.split_whitespace().map(String::from));
        variants.push((format!("with \"{extra}\""), Args(with)));
    }
    let mut times: Vec<Vec<f64>> = vec![vec![]; variants.len()];
    for round in 0..rounds {
        for (i, (what, a)) in variants.iter().enumerate() {
            println!("== round {round}, {what}");
            times[i].extend(run_model(a)?);
        }
    }
    let list = |t: &[f64]| {
        t.iter()
            .map(|ms| format!("{ms:.1}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let mean = |t: &[f64]| t.iter().sum::<f64>() / t.len().max(1) as f64;
    println!("== alternation: as given {} ms", list(&times[0]));
    for ((what, _), t) in variants.iter().zip(&times).skip(1) {
        let ratios: Vec<String> = times[0]
            .iter()
            .zip(t)
            .map(|(a, b)| format!("{:.2}x", b / a))
            .collect();
        println!(
            "== alternation: {what} {} ms; over the first {} a round, {:.2}x of the means",
            list(t),
            ratios.join(", "),
            mean(t) / mean(&times[0]),
        );
    }
    Ok(())
}

/// One run of the step for the model `--model` names: its time a step in ms, None where it
/// did not run (no plan fits, or not the printing rank).
fn run_model(args: &Args) -> Result<Option<f64>> {
    match args.value("--model").as_deref() {
        None | Some("flux") => run::<Flux>(
            args,
            "flux-dev",
            FluxConfig::dev(),
            &["double_blocks.*", "single_blocks.*"],
            vec![vec![16, 128, 128], vec![512, 4096], vec![768]],
        ),
        Some("sd35") => run::<Sd3>(
            args,
            "sd3.5-large",
            Sd3Config::large(),
            &["joint_blocks.*"],
            vec![vec![16, 128, 128], vec![333, 4096], vec![2048]],
        ),
        Some("sdxl") => run::<Unet>(
            args,
            "sdxl",
            SdxlConfig::base(),
            &["input_blocks.*", "middle_block.*", "output_blocks.*"],
            vec![vec![4, 128, 128], vec![77, 2048], vec![1280], vec![6]],
        ),
        // FLUX.2 [klein]: 1024² is 64x64 patched latents of 128 channels; Qwen3's three
        // hidden states side by side over 512 tokens.
        Some("klein4b") => run::<Flux2>(
            args,
            "flux2-klein-4b",
            Flux2Config::klein_4b(),
            &["double_blocks.*", "single_blocks.*"],
            vec![vec![128, 64, 64], vec![512, 7680]],
        ),
        Some("klein9b") => run::<Flux2>(
            args,
            "flux2-klein-9b",
            Flux2Config::klein_9b(),
            &["double_blocks.*", "single_blocks.*"],
            vec![vec![128, 64, 64], vec![512, 12288]],
        ),
        // Z-Image 6B: 128² latents of 16 channels, 512 caption tokens of Qwen3-4B's 2560
        // (every one valid: the mask is made of ones below).
        Some("zimage") => run::<ZImage>(
            args,
            "zimage-6b",
            ZImageConfig::z_image_6b(),
            &["noise_refiner.*", "context_refiner.*", "layers.*"],
            vec![vec![16, 128, 128], vec![512, 2560], vec![512]],
        ),
        Some(m) => {
            eprintln!("--model flux|sd35|sdxl|klein4b|klein9b|zimage, got {m}");
            std::process::exit(2)
        }
    }
}

fn run<M: ModelSpec>(
    args: &Args,
    name: &str,
    cfg: M::Config,
    targets: &[&str],
    sample: Vec<Vec<usize>>,
) -> Result<Option<f64>> {
    let launch = flame::dist::Launch::from_env()?;
    let dev = Device::cuda(launch.as_ref().map_or(Ok(0), |l| l.gpu())?)?;
    let Device::Cuda(cuda) = &dev else {
        return Ok(None);
    };
    // With `--alternate`, each run starts from the driver's memory as a fresh process does:
    // nothing cached, no cap until its plan sets one (`FLAME_GPU_MEMORY_LIMIT` does not
    // hold there).
    if args.value("--alternate").is_some() {
        cuda.release_cached()?;
        cuda.set_memory_limit(None);
    }
    // `--side-stream`: re-runs issued ahead run on the side stream under a cap.
    cuda.set_side_stream(args.flag("--side-stream"));
    // What the process holds outside the allocator (the context, cuBLAS) is measured once a
    // device: now, before the first model of the process, as `train` measures it before
    // caching (`memory::split_budget` then reuses it).
    cuda.held_for_budget()?;
    let group = match &launch {
        Some(l) => Some(l.join(&dev)?),
        None => None,
    };
    let (rank, world) = group.as_ref().map_or((0, 1), |g| (g.rank(), g.world()));
    let batch: usize = args
        .value("--batch")
        .map_or(world, |s| s.parse().expect("a number"));
    let rows = flame::dist::shard(batch, rank, world);
    let root = rank == 0;
    if let (Some(g), Some(mib)) = (&group, args.value("--allreduce-mib")) {
        let mib: usize = mib.parse().expect("a number");
        let buf = Tensor::ones(mib << 18, DType::F32, &dev)?;
        let s = common::time(cuda, 3, 10, &mut || g.all_reduce_sum(&[&buf])?.wait())?;
        let bytes = (mib << 20) as f64;
        let bus = 2.0 * (world - 1) as f64 / world as f64 * bytes / s / 1e9;
        if root {
            println!(
                "NCCL all-reduce of {mib} MiB f32 over {world} GPUs: {:.3} ms, algorithm bandwidth {:.1} GB/s, bus bandwidth {bus:.1} GB/s",
                s * 1e3,
                bytes / s / 1e9
            );
        }
    }
    let lora = LoraConfig {
        rank: 16,
        alpha: 16.0,
        dropout: 0.0,
        targets: targets.iter().map(|t| t.to_string()).collect(),
        seed: 0,
    };
    let timed: usize = args.value("--steps").map_or(3, |n| {
        n.parse().ok().filter(|&n| n > 0).expect("--steps N, N > 0")
    });
    let (fp8, adam8bit) = (args.flag("--fp8"), args.flag("--adam8bit"));
    // `--fp8-compute` / `--int8-compute`: 8-bit products (`model.compute = "fp8"` / "int8");
    // the weights are held as the code's values.
    let products = if args.flag("--int8-compute") {
        Some(flame::backend::fp8::Code8::Int8)
    } else if args.flag("--fp8-compute") {
        Some(flame::backend::fp8::Code8::E4m3)
    } else {
        None
    };
    // `--int8-rotation`: int8 products with their inner axis rotated.
    let int8_rotation = args.flag("--int8-rotation");
    let num = |name: &str, default: usize| {
        args.value(name)
            .map_or(default, |s| s.parse().expect("a number"))
    };
    // The profile, for the planner and for the predicted peak of a hand-made plan.
    let mut opts = LoadOptions::new(DType::BF16, &dev).with_adapters(Adapters::new(lora.clone())?);
    opts.fp8 = fp8;
    opts.products = products;
    opts.int8_rotation = int8_rotation;
    let run_shape = RunShape {
        sample: sample.clone(),
        // This rank's samples: the planner sizes the activations for them.
        batch: rows.len().max(1),
        optimizer_bytes_per_value: if adam8bit { 2.0 + 8.0 / 256.0 } else { 8.0 },
    };
    // 8-bit products where they pay at this run's rows, as `train` chooses them;
    // `--every-linear-8bit`: on every Linear the tensor cores take.
    if !args.flag("--every-linear-8bit") {
        opts.run = Some(run_shape.clone());
    }
    let mut profile: MemoryProfile = profile_config::<M>(&cfg, &opts, &run_shape)?;
    // The planner's switches: `FLAME_PLANNER`, then the flags `--raw-wire` (streamed bf16
    // weights cross uncoded), `--no-uncoded-carry`, `--no-cross` (nothing crossed into the
    // staging ring at the backward's end), `--shallow` (no deep prefetch),
    // `--no-host-products`, `--no-keep-few`, `--keep-transposes` (resident blocks' 8-bit
    // weights keep their transposed codes), `--serial-reruns` (no re-run issued ahead),
    // `--reference-machine` (the time model plays `Machine::REFERENCE`, not this machine
    // measured) and `--offload-kept` (plans that offload block inputs may keep their kept
    // outputs in host memory too; with a plan by hand, it offloads inputs and kept outputs).
    let mut switches = Switches::default().with_env()?;
    for (flag, name, on) in [
        ("--raw-wire", "wire_code", false),
        ("--no-uncoded-carry", "uncoded_carry", false),
        ("--no-cross", "cross_ahead", false),
        ("--shallow", "deep_prefetch", false),
        ("--no-host-products", "host_products", false),
        ("--no-keep-few", "keep_few_rows", false),
        ("--keep-transposes", "remake_transposes", false),
        ("--serial-reruns", "rerun_ahead", false),
        ("--reference-machine", "measure_machine", false),
        ("--offload-kept", "offload_kept", true),
    ] {
        if args.flag(flag) {
            if let Some(s) = switches.get_mut(name) {
                *s = on;
            }
        }
    }
    // The time model plays this machine's link and GPU where the switch says so.
    if switches.measure_machine {
        if let Some(m) = flame::memory::measure_machine(&dev)? {
            if root {
                println!(
                    "machine: {} ({}): {}",
                    m.gpu,
                    if m.cached {
                        "cached, the host timed now"
                    } else {
                        "measured now"
                    },
                    m.machine
                );
            }
            profile.machine = m.machine;
        }
    }
    let plan = match args.value("--budget") {
        Some(gb) => {
            let gb_f = gb.parse::<f64>().expect("--budget GB");
            // `--headroom GB`: plan for the budget less this, cap at the budget. Without it
            // the budget is the process's as the driver counts it, split as `train` splits
            // it (`memory::split_budget`): what the process holds outside the allocator
            // (measured at its first model) and `LATE_HEADROOM` come off it, and the
            // allocator is capped at the rest.
            let (b, headroom) = match args.value("--headroom") {
                Some(h) => (
                    (gb_f * GIB) as u64,
                    (h.parse::<f64>().expect("--headroom GB") * GIB) as u64,
                ),
                None => {
                    let (alloc, outside) = match flame::memory::split_budget(&dev, gb_f)? {
                        (Some(a), Some(o)) => (a, o),
                        _ => unreachable!("a GPU's budget is split in two"),
                    };
                    if root {
                        println!(
                            "budget {gb_f} GiB as the driver counts it: {:.2} GiB for the \
                             allocator, {:.2} outside it (held now and LATE_HEADROOM)",
                            alloc as f64 / GIB,
                            outside as f64 / GIB
                        );
                    }
                    (alloc, 0)
                }
            };
            cuda.set_memory_limit(Some(b));
            // `--no-offload`: the planner without the plans that offload block inputs (to
            // time what offloading gains); the planner's switches from the flags.
            let candidates: Vec<Plan> = switches
                .candidates(&profile)
                .into_iter()
                .filter(|p| !(args.flag("--no-offload") && p.offload_inputs))
                .filter(|p| !(args.flag("--no-mixed") && p.mixes()))
                .filter(|p| !args.flag("--only-mixed") || p.mixes())
                // `--prefetch K` with the planner: every streaming plan fetches K ahead (the
                // planner then picks among those).
                .map(|p| Plan {
                    prefetch: match args.value("--prefetch") {
                        Some(k) if !p.streamed.is_empty() => k.parse().expect("--prefetch K"),
                        _ => p.prefetch,
                    },
                    ..p
                })
                .collect();
            let budget = b.saturating_sub(headroom);
            // `--rivals`: the plans of other kinds the planner puts near its pick, which
            // `train` times beside it with `memory.trial_steps` (`MemoryProfile::rivals`);
            // `--rival K`: the K-th of them instead of the pick (a process a plan).
            let rival = args
                .value("--rival")
                .map(|k| k.parse::<usize>().expect("--rival K"));
            let weighed = (args.flag("--rivals") || rival.is_some()).then(|| {
                use rayon::prelude::*;
                candidates
                    .par_iter()
                    .map(|p| flame::memory::Weighed::new(&profile, p.clone()))
                    .collect::<Vec<_>>()
            });
            match profile.plan_among(budget, candidates) {
                Ok(p) => {
                    let rivals = match &weighed {
                        // As `train` works them out: within this process's host memory.
                        Some(w) => profile.rivals(
                            budget,
                            flame::memory::host_room(world),
                            w,
                            &p.plan,
                            flame::train::planning::TRIAL_RIVALS,
                        ),
                        None => vec![],
                    };
                    if root {
                        for (k, r) in rivals.iter().enumerate() {
                            println!(
                                "flame {name}: rival {}: {} (predicted {:.2}x, peak {:.2} GiB)",
                                k + 1,
                                r.plan,
                                r.slowdown,
                                r.peak as f64 / GIB
                            );
                        }
                    }
                    match rival {
                        None | Some(0) => p.plan,
                        Some(k) => match rivals.into_iter().nth(k - 1) {
                            Some(r) => r.plan,
                            None => {
                                println!("flame {name}: no rival {k} within {gb} GiB");
                                return Ok(None);
                            }
                        },
                    }
                }
                Err(e) => {
                    println!(
                        "flame {name}: no plan fits {gb} GiB (minimum {:.2} GiB)",
                        e.minimum as f64 / GIB
                    );
                    return Ok(None);
                }
            }
        }
        None => {
            // `--cap GB`: the allocator capped at GB for a plan given by hand (its arena, as a
            // budget's).
            if let Some(gb) = args.value("--cap") {
                let gb: f64 = gb.parse().expect("--cap GB");
                cuda.set_memory_limit(Some((gb * GIB) as u64));
            }
            let checkpointing = match args.value("--checkpoint").as_deref() {
                None | Some("none") => Checkpointing::Off,
                Some(s) => s
                    .parse()
                    .unwrap_or_else(|e| panic!("--checkpoint none or {e}, got {s}")),
            };
            let prefixes: Vec<String> = profile.blocks.iter().map(|b| b.prefix.clone()).collect();
            // `--stream-smallest`: the planner's order (smallest blocks first) instead of
            // spread evenly.
            let streamed = if args.flag("--stream-smallest") {
                let mut o = profile.stream_order();
                o.truncate(num("--stream", 0));
                o
            } else {
                spread_evenly(&prefixes, num("--stream", 0))
            };
            switches.bind(Plan {
                checkpointing,
                streamed,
                prefetch: num("--prefetch", 1),
                keep: Keep {
                    attention: args.flag("--keep-attention"),
                    down_projections: args.flag("--keep-down"),
                    few_rows: true,
                },
                offload_inputs: args.flag("--offload") || args.flag("--offload-kept"),
                offload_kept: args.flag("--offload-kept"),
                wire_code: true,
                uncoded_carry: args.flag("--uncoded-carry"),
                deep_prefetch: true,
                host_products: true,
                rerun_ahead: args.flag("--rerun-ahead"),
                ..Plan::default()
            })
        }
    };
    let plan = if args.flag("--raw-backward") {
        profile.settle(&Plan {
            raw_backward: true,
            ..plan
        })?
    } else {
        plan
    };
    let plan = if args.flag("--ahead-products") {
        profile.settle(&Plan {
            ahead_products: true,
            ..plan
        })?
    } else {
        plan
    };
    let predicted = profile.peak(&plan) as f64 / GIB;
    if root {
        let (step, resident) = (profile.step_ms(&plan), profile.resident_ms());
        println!(
            "flame {name}: plan {plan}, predicted peak {predicted:.2} GiB, predicted step {:.2}x the resident one ({step:.1} ms by the time model, resident {resident:.1})",
            step / resident
        );
        println!(
            "flame {name}: predicted peak's terms {}",
            profile.peak_parts(&plan)
        );
    }
    let adapters = Adapters::new(lora)?;
    let mut vb = VarBuilder::random(1, 0.02, DType::BF16, &dev)
        .with_fp8(fp8)?
        .with_products(products)?
        .with_int8_rotation(int8_rotation)?
        .with_kept_transposes(!plan.remake_transposes)?
        .with_adapters(adapters.clone())?;
    vb = flame::models::with_run_rows::<M>(vb, &cfg, &opts)?;
    let plan = profile.settle(&plan)?;
    let streamer = BlockStreamer::for_plan(&dev, &plan, M::CONDITIONED)?;
    if let Some(s) = &streamer {
        vb = vb.with_host_weights(s.clone())?;
    }
    let mut model = M::build(&vb, &cfg)?;
    let exec = BlockExec::for_plan(&plan, streamer.clone(), &dev);
    let offload = exec.offload.clone();
    model.set_exec(exec);
    let params = adapters.params()?;
    let n_params: usize = params.iter().map(|(_, t)| t.elem_count()).sum();
    let reducer = match &group {
        Some(g) => {
            let ts: Vec<Tensor> = params.iter().map(|(_, t)| t.clone()).collect();
            g.broadcast(&ts.iter().collect::<Vec<_>>())?;
            let r = flame::dist::GradReducer::new(g.clone(), ts, flame::dist::BUCKET_BYTES);
            if root {
                println!(
                    "data-parallel: {} ranks, global batch {batch}, adapter gradients {:.1} MiB in {} buckets",
                    world,
                    (n_params * 4) as f64 / (1u64 << 20) as f64,
                    r.buckets()
                );
            }
            Some(r)
        }
        None => None,
    };
    let adam = AdamConfig {
        lr: 1e-4,
        ..Default::default()
    };
    let mut opt: Box<dyn Optimizer> = if adam8bit {
        Box::new(AdamW8bit::new(
            params,
            AdamW8bitConfig {
                adam,
                ..Default::default()
            },
        )?)
    } else {
        Box::new(AdamW::new(params, adam)?)
    };
    // The global batch, the same on every rank; each takes its rows.
    let with_batch = |s: &[usize]| [&[batch][..], s].concat();
    let mine = |t: Tensor| t.narrow(0, rows.start, rows.len())?.contiguous();
    let x0 = mine(Tensor::randn(
        with_batch(&sample[0]),
        DType::BF16,
        &dev,
        10,
    )?)?;
    let cond: Vec<Tensor> = sample[1..]
        .iter()
        .enumerate()
        .map(|(i, s)| {
            // A caption mask (Z-Image's `context_mask`): every token valid.
            if M::entry().name == "zimage" && i == 1 {
                return mine(Tensor::ones(with_batch(s), DType::BF16, &dev)?);
            }
            mine(Tensor::randn(
                with_batch(s),
                DType::BF16,
                &dev,
                11 + i as u64,
            )?)
        })
        .collect::<Result<_>>()?;
    let share = rows.len() as f64 / batch as f64;
    let tokens = sample[0][1] * sample[0][2] / 4;
    let sampling = TimestepSampling::FluxShift {
        mean: 0.0,
        std: 1.0,
    };
    let ddpm = matches!(model.objective(), Objective::Ddpm(_));
    // The seed of the last step drawn: each step draws from the next (`--phases` too).
    let seed = std::cell::Cell::new(100u64);
    // Each step of a streamed plan announces the next one's inputs between its forward and
    // its backward (`DiffusionModel::prepare`: the host products are computed ahead);
    // `--no-prepare` leaves them to the forward.
    let announce = streamer.is_some() && !args.flag("--no-prepare");
    // Steps run in all (the warm-up, the timed ones and any `--phases` or probe step).
    let steps_run = std::cell::Cell::new(0u32);
    // The host's time to issue the forward (from the timestep draw), then the backward and
    // the optimizer update (from after the probe's queue) (for `--host-probe`).
    let marks = std::cell::Cell::new([0.0f64; 3]);
    // GEMMs queued between the forward and the backward: the GPU's work ahead of the
    // backward's (ditto).
    let probe = args
        .flag("--host-probe")
        .then(|| Tensor::randn((8192, 8192), DType::BF16, &dev, 7))
        .transpose()?;
    let queue = std::cell::Cell::new(0usize);
    // A step's noise and timesteps (this rank's rows).
    let times = |seed: u64| mine(sampling.sample(batch, tokens, seed, &dev)?);
    let draw = |seed: u64| -> Result<(Tensor, Tensor)> {
        let noise = mine(Tensor::randn(
            with_batch(&sample[0]),
            DType::BF16,
            &dev,
            seed,
        )?)?;
        Ok((noise, times(seed)?))
    };
    // The model's time input: a DDPM model takes a timestep in [0, 1000).
    let time_in = |t: Tensor| if ddpm { t.affine(999.0, 0.0) } else { Ok(t) };
    // The flow-matching pair for every family (the step's cost does not depend on the
    // objective) and the model's time input.
    let pair = |noise: &Tensor, t: Tensor| -> Result<(Tensor, Tensor, Tensor)> {
        let (xt, target) = flow_matching(&x0, noise, &t)?;
        Ok((xt, target, time_in(t)?))
    };
    // A step's forward from the next seed, then the next step's inputs announced.
    let forward = || -> Result<(Tensor, Tensor)> {
        seed.set(seed.get() + 1);
        let (noise, t) = draw(seed.get())?;
        // (The timesteps are drawn on the host from device random numbers: a wait, so the
        // next step's are drawn here too.)
        let next = announce.then(|| times(seed.get() + 1)).transpose()?;
        let (xt, target, t_in) = pair(&noise, t)?;
        let out = model.predict(&xt, &t_in, &cond, 1.0)?;
        if let Some(t) = next {
            model.prepare(&x0, &time_in(t)?, &cond, 1.0)?;
        }
        Ok((out, target))
    };
    // The adapters' bf16 compute copies, made once a step after the optimizer's update
    // (`--per-use-casts`: each use casts its f32 weight instead, as before the copies).
    // Not where ranks sum gradients while the backward runs (the trainer's rule: the fold
    // would hand the buckets every gradient only after the whole backward).
    let per_use = args.flag("--per-use-casts") || reducer.as_ref().is_some_and(|r| r.overlaps());
    let copies = || -> Result<Option<Arc<ComputeCopies>>> {
        match per_use {
            true => Ok(None),
            false => adapters.compute_copies(DType::BF16).map(Some),
        }
    };
    let mut step = || -> Result<f64> {
        steps_run.set(steps_run.get() + 1);
        let mut m = [0.0; 3];
        let issued = std::time::Instant::now();
        let copies = copies()?;
        let entered = copies.as_ref().map(|c| c.enter());
        let (out, target) = forward()?;
        m[0] = issued.elapsed().as_secs_f64();
        if let Some(a) = &probe {
            for _ in 0..queue.get() {
                a.matmul(a)?;
            }
        }
        let issued = std::time::Instant::now();
        // Each rank's mean weighted by its share: the ranks' sum is the batch's mean.
        let loss = weighted_mse(&out, &target, None)?.affine(share, 0.0)?;
        let mut grads = Grads::new();
        if let Some(r) = &reducer {
            grads.set_hook(Some(r.clone()));
            r.arm()?;
        }
        loss.backward_into(&mut grads)?;
        if let Some(c) = &copies {
            c.fold(&mut grads)?;
        }
        drop(entered);
        m[1] = issued.elapsed().as_secs_f64();
        if let Some(r) = &reducer {
            grads.set_hook(None);
            r.finish(&mut grads)?;
        }
        opt.step(&grads)?;
        m[2] = issued.elapsed().as_secs_f64();
        marks.set(m);
        let mut v = [loss.to_scalar_f64()?];
        if let Some(g) = &group {
            g.sum_host(&mut v)?;
        }
        Ok(v[0])
    };
    let first = step()?;
    cuda.synchronize()?;
    // The streamer's counters after the warm-up, to report the timed steps alone (the
    // warm-up's forward finds no block carried over; `--phases` and the probes run more).
    let stream_before = streamer.as_ref().map(|s| s.report()).transpose()?;
    // `--link-trace FILE`: each timed upload of the timed steps, written as CSV, and the
    // copy rate by kind of upload printed; and how long the compute stream stood waiting
    // for the uploads in each pass, block by block (every upload and wait timed: the
    // events cost the host some time).
    let link_trace = args.value("--link-trace");
    if let (Some(s), Some(_)) = (&streamer, &link_trace) {
        s.trace_uploads(true)?;
    }
    cuda.reset_peak_memory();
    let mut losses = vec![first];
    let (evictions, flushes, overflows, windows) = (
        cuda.memory().evictions,
        cuda.memory().flushes,
        cuda.memory().overflows,
        cuda.memory().side_windows,
    );
    // The driver's view of the device memory, sampled every 2 ms through the timed steps:
    // the cap's proof is its peak, not its value after the last sync.
    // `--no-sampling`: no sampler (the driver's peak then reads 0): what its queries of the
    // driver cost a host-paced step.
    let sampling = Arc::new(AtomicBool::new(!args.flag("--no-sampling")));
    let sampler = {
        let (cuda, sampling) = (cuda.clone(), sampling.clone());
        std::thread::spawn(move || {
            let (mut peak, mut own) = (0u64, 0u64);
            while sampling.load(Ordering::Relaxed) {
                peak = peak.max(cuda.device_memory_used().unwrap_or(0));
                own = own.max(cuda.process_memory().unwrap_or(0));
                std::thread::sleep(std::time::Duration::from_millis(2));
            }
            (peak, own)
        })
    };
    let ms = common::time(cuda, 0, timed, &mut || {
        losses.push(step()?);
        Ok(())
    })? * 1e3;
    // The timed steps' peak (the probes and traces below run more steps, and the memory
    // trace resets the peak around each block).
    let timed_peak = cuda.memory().peak;
    let stream_after = streamer.as_ref().map(|s| s.report()).transpose()?;
    if let (Some(s), Some(path)) = (&streamer, &link_trace) {
        // Where the compute stream stood waiting for the uploads: each pass's waits per
        // step, block by block (the streamer's order), their sum, the blocks waited on the
        // longest and the stretches of eight blocks they fall in.
        let stalls = s.take_stalls()?;
        let blocks = stalls.iter().map(|r| r.block + 1).max().unwrap_or(0);
        let mut chunks = String::new();
        for (label, backward) in [("forward", false), ("backward", true)] {
            let (mut per, mut waits) = (vec![0.0f64; blocks], 0usize);
            for r in stalls.iter().filter(|r| r.backward == backward) {
                per[r.block] += r.ms / timed as f64;
                waits += 1;
            }
            let mut worst: Vec<(usize, f64)> = per.iter().copied().enumerate().collect();
            worst.sort_by(|a, b| b.1.total_cmp(&a.1));
            let worst: Vec<String> = worst
                .iter()
                .take(12)
                .map(|(b, ms)| format!("{b}: {ms:.2}"))
                .collect();
            println!(
                "compute waiting for uploads, {label}: {:.1} ms/step over {:.1} waits/step; the longest by block (ms/step): {}",
                per.iter().sum::<f64>(),
                waits as f64 / timed as f64,
                worst.join(", ")
            );
            chunks.push_str(&format!("\n{label}:"));
            for chunk in per.chunks(8) {
                chunks.push_str(&format!(" {:.1}", chunk.iter().sum::<f64>()));
            }
        }
        println!("compute waiting for uploads, ms/step by eight blocks at a time:{chunks}");
        let records = s.take_trace()?;
        let carried = s.carried()?;
        let mut csv = String::from("block,whole,coded,wire_bytes,copy_ms,span_ms,decode_ms\n");
        for r in &records {
            csv.push_str(&format!(
                "{},{},{},{},{:.4},{:.4},{:.4}\n",
                r.block, r.whole, r.coded, r.wire_bytes, r.copy_ms, r.span_ms, r.decode_ms
            ));
        }
        std::fs::write(path, csv).map_err(|source| flame::Error::Io {
            path: path.into(),
            source,
        })?;
        type Pick = fn(&flame::memory::UploadRecord, usize) -> bool;
        let kinds: [(&str, Pick); 5] = [
            ("carried, coded", |r, c| r.block < c && r.coded),
            ("carried, uncoded", |r, c| r.block < c && !r.coded),
            ("others, whole, coded", |r, c| {
                r.block >= c && r.whole && r.coded
            }),
            ("others, part, coded", |r, c| {
                r.block >= c && !r.whole && r.coded
            }),
            ("others, uncoded", |r, c| r.block >= c && !r.coded),
        ];
        for (label, pick) in kinds {
            let v: Vec<_> = records.iter().filter(|r| pick(r, carried)).collect();
            let bytes: u64 = v.iter().map(|r| r.wire_bytes).sum();
            let (copy, span, decode) = v.iter().fold((0.0, 0.0, 0.0), |a, r| {
                (a.0 + r.copy_ms, a.1 + r.span_ms, a.2 + r.decode_ms)
            });
            if !v.is_empty() {
                println!(
                    "link trace, {label}: {} uploads, {:.2} GiB, copies {copy:.1} ms ({:.1} GiB/s), spans {span:.1} ms, decodes {decode:.1} ms",
                    v.len(),
                    bytes as f64 / GIB,
                    bytes as f64 / GIB / (copy / 1e3).max(1e-9)
                );
            }
        }
    }
    sampling.store(false, Ordering::Relaxed);
    let (driver_peak, process_peak) = sampler.join().unwrap_or((0, 0));
    let per_step = |n: u64| n as f64 / timed as f64;
    let (evictions, flushes, overflows, windows) = (
        per_step(cuda.memory().evictions - evictions),
        per_step(cuda.memory().flushes - flushes),
        per_step(cuda.memory().overflows - overflows),
        per_step(cuda.memory().side_windows - windows),
    );
    if !root {
        return Ok(None);
    }
    println!("losses: {losses:?}");
    if let Some(a) = &probe {
        // About a second of large GEMMs queued between one step's forward and backward: where
        // the host has issued the backward and the update before that queue drains, nothing
        // in them waited for the GPU and their marks are the host's own cost.
        let one = common::time(cuda, 1, 8, || a.matmul(a))?;
        queue.set((1.0 / one).ceil() as usize);
        let t = std::time::Instant::now();
        step()?;
        cuda.synchronize()?;
        let total = t.elapsed().as_secs_f64();
        let m = marks.get();
        println!(
            "host probe: the forward issued in {:.1} ms; then {} GEMMs queued ({:.1} ms of GPU work, timed back to back), the backward issued in {:.1} ms after them, the update by {:.1}; all done at {:.1} ms (step {ms:.1} ms)",
            m[0] * 1e3,
            queue.get(),
            one * queue.get() as f64 * 1e3,
            m[1] * 1e3,
            m[2] * 1e3,
            total * 1e3
        );
        queue.set(0);
    }
    if args.flag("--profile") {
        // One more step with every kernel timed; the step's own time is the timed one above.
        flame::profile::enable(true);
        step()?;
        cuda.synchronize()?;
        let p = flame::profile::report()?;
        flame::profile::enable(false);
        let kernels: f64 = p.kinds.iter().map(|r| r.ms).sum();
        println!(
            "profile of one step ({ms:.1} ms unprofiled, {kernels:.1} ms in kernels with events around each)"
        );
        let table = |title: &str, rows: &[flame::profile::Row], n: usize| {
            println!("{title} | ms | share of the step | kernels");
            for r in rows.iter().take(n) {
                println!(
                    "  {} | {:.1} | {:.1}% | {}",
                    r.category,
                    r.ms,
                    100.0 * r.ms / ms,
                    r.kernels
                );
            }
        };
        table("kind", &p.kinds, 20);
        table("scope", &p.scopes, 5);
        table("phase", &p.phases, 25);
        table("kernel", &p.kernels, 30);
        table("phase / kernel", &p.phase_kernels, 30);
    }
    if args.flag("--memory-trace") {
        // One more step with FLAME's allocator read around each block's run (forward and
        // re-run): where the step's peak falls, against the planner's predicted peak.
        flame::memory::trace_blocks(true);
        cuda.reset_peak_memory();
        step()?;
        cuda.synchronize()?;
        flame::memory::trace_blocks(false);
        let trace = flame::memory::take_block_trace();
        let gib = |b: u64| b as f64 / GIB;
        println!("memory trace (GiB in FLAME's allocator): block | pass | before | peak | after");
        for r in &trace {
            println!(
                "  {} | {} | {:.3} | {:.3} | {:.3}",
                r.prefix,
                if r.rerun { "re-run" } else { "forward" },
                gib(r.before),
                gib(r.peak),
                gib(r.after)
            );
        }
        if let Some(top) = trace.iter().max_by_key(|r| r.peak) {
            println!(
                "memory trace: the blocks' highest peak {:.3} GiB in {}'s {}",
                gib(top.peak),
                top.prefix,
                if top.rerun { "re-run" } else { "forward" }
            );
        }
    }
    if args.flag("--phases") {
        // One more step, the device synchronised after the forward and after the backward:
        // each pass's own time (the passes no longer overlap at their boundary).
        let before = streamer.as_ref().map(|s| s.report()).transpose()?;
        let t = std::time::Instant::now();
        cuda.synchronize()?;
        let t0 = t.elapsed().as_secs_f64();
        // The forward from its inputs' draw (a short wait for the device) on, with the inputs
        // the step before announced (as a timed step's).
        let copies = copies()?;
        let entered = copies.as_ref().map(|c| c.enter());
        let (out, target) = forward()?;
        let loss = weighted_mse(&out, &target, None)?.affine(share, 0.0)?;
        cuda.synchronize()?;
        let t1 = t.elapsed().as_secs_f64();
        let mid = streamer.as_ref().map(|s| s.report()).transpose()?;
        let mut grads = loss.backward()?;
        if let Some(c) = &copies {
            c.fold(&mut grads)?;
        }
        drop(entered);
        cuda.synchronize()?;
        let t2 = t.elapsed().as_secs_f64();
        opt.step(&grads)?;
        cuda.synchronize()?;
        let t3 = t.elapsed().as_secs_f64();
        let after = streamer.as_ref().map(|s| s.report()).transpose()?;
        let gib_between = |a: &Option<flame::memory::StreamReport>,
                           b: &Option<flame::memory::StreamReport>| match (
            a, b,
        ) {
            (Some(a), Some(b)) => (b.uploaded_bytes - a.uploaded_bytes) as f64 / GIB,
            _ => 0.0,
        };
        println!(
            "phases (one more step, synchronised between them): forward {:.1} ms ({:.2} GiB over the link), backward {:.1} ms ({:.2} GiB), update {:.1} ms",
            (t1 - t0) * 1e3,
            gib_between(&before, &mid),
            (t2 - t1) * 1e3,
            gib_between(&mid, &after),
            (t3 - t2) * 1e3
        );
        // The time model's split of its steady step (its forward starting with the blocks
        // the backward before left, its backward overlapping nothing after): where it is off.
        let (forward, step) = profile.step_phases_ms(&plan);
        println!(
            "phases by the time model (steady, not synchronised): forward {forward:.1} ms, backward and update {:.1} ms",
            step - forward
        );
    }
    let gib = |b: u64| b as f64 / GIB;
    let weights: u64 = vb
        .params()?
        .iter()
        .map(|(_, t)| (t.elem_count() * t.dtype().size_in_bytes()) as u64)
        .sum();
    let (streamed_gib, per_step, decoded_per_step) = match (&streamer, stream_before, stream_after)
    {
        (Some(s), Some(b), Some(a)) => {
            // The timed steps' share of each counter, a step.
            let r = flame::memory::StreamReport {
                uploads: a.uploads - b.uploads,
                uploaded_bytes: a.uploaded_bytes - b.uploaded_bytes,
                decoded_bytes: a.decoded_bytes - b.decoded_bytes,
                copy_us: a.copy_us - b.copy_us,
                span_us: a.span_us - b.span_us,
                decode_us: a.decode_us - b.decode_us,
                timed_uploads: a.timed_uploads - b.timed_uploads,
                timed_bytes: a.timed_bytes - b.timed_bytes,
                left_out_bytes: a.left_out_bytes - b.left_out_bytes,
                host_us: a.host_us - b.host_us,
                ..a
            };
            println!(
                "streaming on the host: {:.1} ms/step in the blocks' entries and exits; {:.2} GiB/step crossed into the staging ring at the backward's end, {:.2} landed",
                r.host_us as f64 / 1e3 / timed as f64,
                gib(a.crossed_bytes - b.crossed_bytes) / timed as f64,
                gib(a.landed_bytes - b.landed_bytes) / timed as f64
            );
            if r.timed_bytes > 0 {
                // The timed uploads (one in `TIME_EVERY`) stand for all by their bytes.
                let share = r.timed_bytes as f64 / r.uploaded_bytes.max(1) as f64;
                println!(
                    "link: {:.1} ms/step copying at {:.1} GiB/s, {:.1} ms/step from uploads' first copies to their last, decodes {:.1} ms/step ({} of {} uploads timed; the backward leaves up to {} blocks for the forward, {:.1} found; {:.2} GiB/step of forward-only weights left out of the backward's uploads)",
                    r.copy_us as f64 / 1e3 / share / timed as f64,
                    gib(r.timed_bytes) / (r.copy_us as f64 / 1e6),
                    r.span_us as f64 / 1e3 / share / timed as f64,
                    r.decode_us as f64 / 1e3 / share / timed as f64,
                    r.timed_uploads,
                    r.uploads,
                    s.carried()?,
                    (a.carried_found - b.carried_found) as f64
                        / (a.forwards - b.forwards).max(1) as f64,
                    gib(r.left_out_bytes) / timed as f64
                );
            }
            let (h, b) = (a.host, b.host);
            if h.products > b.products {
                // Per timed step (the warm-up's left out).
                let per = |a: u64, b: u64| (a - b) as f64 / timed as f64;
                println!(
                    "host products (the timed steps): {:.1} a step, {} inputs ({} of them announced ahead and taken); {:.1} ms/step computing, the model's thread waited {:.1} ms/step for them and spent {:.1} ms/step bringing inputs, {:.1} sending products",
                    per(h.products, b.products),
                    h.inputs - b.inputs,
                    h.taken_ahead - b.taken_ahead,
                    per(h.compute_us, b.compute_us) / 1e3,
                    per(h.wait_us, b.wait_us) / 1e3,
                    per(h.input_us, b.input_us) / 1e3,
                    per(h.transfer_us, b.transfer_us) / 1e3
                );
            }
            (
                gib(r.host_bytes),
                gib(r.uploaded_bytes) / timed as f64,
                gib(r.decoded_bytes) / timed as f64,
            )
        }
        _ => (0.0, 0.0, 0.0),
    };
    if let Some(o) = &offload {
        let r = o.report()?;
        println!(
            "offloaded block inputs: {:.2} GiB/step out and back, {} of {} fetched ahead, {:.2} GiB pinned",
            gib(r.packed_bytes) / steps_run.get() as f64,
            r.prefetched,
            r.unpacked,
            gib(r.host_bytes)
        );
    }
    let cap = match (
        args.value("--budget"),
        std::env::var("FLAME_GPU_MEMORY_LIMIT"),
    ) {
        (Some(gb), _) => format!("{gb} GiB (budget)"),
        (None, _) if args.value("--cap").is_some() => {
            format!("{} GiB", args.value("--cap").unwrap_or_default())
        }
        (None, Ok(b)) => format!("{:.1} GiB", b.parse::<f64>().unwrap_or(0.0) / GIB),
        _ => "none".into(),
    };
    println!(
        "flame {name} LoRA step (rank 16, {:.1} M adapter params, base {}, {}, plan: {plan}, {streamed_gib:.2} GiB in host memory, cap {cap}, batch {batch} on {world} GPU(s), {:.3} samples/s): {ms:.1} ms | base weights {:.2} GiB | peak {:.2} GiB (predicted {predicted:.2}) | device in use (driver) {:.2} GiB, peak while stepping {:.2} GiB | host peak RSS {:.2} GiB | streamed {per_step:.2} GiB/step ({decoded_per_step:.2} GiB of weights) | cache evictions {evictions:.1}/step, pool trims {flushes:.1}/step, beyond the arena {overflows:.1}/step, re-runs on the side stream {windows:.1}/step",
        n_params as f64 / 1e6,
        match (fp8, products) {
            (_, Some(flame::backend::fp8::Code8::E4m3)) => "fp8 with 8-bit products",
            (_, Some(flame::backend::fp8::Code8::Int8)) if int8_rotation => {
                "int8 with 8-bit products, rotated"
            }
            (_, Some(flame::backend::fp8::Code8::Int8)) => "int8 with 8-bit products",
            (true, None) => "fp8",
            _ => "bf16",
        },
        if adam8bit { "AdamW8bit" } else { "AdamW" },
        batch as f64 / (ms / 1e3),
        gib(weights),
        gib(timed_peak),
        gib(cuda.device_memory_used()?),
        gib(driver_peak),
        peak_rss_gib(),
    );
    println!(
        "this process on the device as the driver counts it, peak while stepping: {:.2} GiB",
        gib(process_peak)
    );
    // The kernel modules' loads: the driver's compile of their PTX for this GPU on a
    // machine's first run (its disk cache after that).
    let mut loads = cuda.module_loads();
    let secs: f64 = loads.iter().map(|(_, s)| s).sum();
    loads.sort_by(|a, b| b.1.total_cmp(&a.1));
    let slowest: Vec<String> = loads
        .iter()
        .take(5)
        .map(|(m, s)| format!("{m} {s:.1}"))
        .collect();
    println!(
        "kernel modules: {} loaded in {secs:.1} s (the slowest, s: {})",
        loads.len(),
        slowest.join(", ")
    );
    Ok(Some(ms))
}

/// The process's peak resident set (VmHWM) in GiB, 0 where /proc is not there.
fn peak_rss_gib() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
        })
        .map_or(0.0, |kb| kb / (1 << 20) as f64)
}
