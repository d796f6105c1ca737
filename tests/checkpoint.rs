//! Gradient checkpointing and block streaming on the CPU reference backend: gradients with
//! checkpointed or streamed blocks equal those of the resident run bit for bit (the same
//! kernels run on the same values, dropout masks included), for a hand-written function and
//! for tiny Flux, SD3.5 and SDXL models with LoRA adapters.

use flame::autograd::gradcheck::graph_ops;
use flame::autograd::{checkpoint, checkpoint_keeping, kept_reused, Keep};
use flame::memory::{BlockExec, BlockStreamer, Checkpointing, InputOffload, StreamReport};
use flame::models::flux::{self, Flux, FluxConfig};
use flame::models::sd3::{Sd3, Sd3Config};
use flame::models::sdxl::{SdxlConfig, Unet};
use flame::nn::{Adapters, Dropout, LoraConfig, VarBuilder};
use flame::{DType, Device, Error, Grads, Result, Tensor};
use std::sync::Arc;

const CPU: Device = Device::Cpu;

/// The CUDA tests of this file one at a time: they share the device, and one reads its
/// memory counters.
#[cfg(feature = "cuda")]
fn cuda_alone() -> std::sync::MutexGuard<'static, ()> {
    static ONE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    ONE.lock().unwrap_or_else(|e| e.into_inner())
}

/// The tests that count the re-runs the process's one helper thread took
/// (`autograd::ahead::taken`) run one at a time: the helper refuses a job while it runs
/// another test's, and a test whose every offer met a busy helper would count none.
fn helper_alone() -> std::sync::MutexGuard<'static, ()> {
    static ONE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    ONE.lock().unwrap_or_else(|e| e.into_inner())
}

fn randn(shape: &[usize], seed: u64) -> Tensor {
    randn_on(shape, seed, &CPU)
}

fn randn_on(shape: &[usize], seed: u64, dev: &Device) -> Tensor {
    Tensor::randn(shape.to_vec(), DType::F32, dev, seed).unwrap()
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.to_vec::<f32>()
        .unwrap()
        .iter()
        .map(|x| x.to_bits())
        .collect()
}

/// out0 = dropout(tanh(x W)) * y, out1 = exp(x): two outputs, a captured trainable weight,
/// a random draw.
fn block(w: Tensor, drop: Arc<Dropout>) -> impl Fn(&[Tensor]) -> Result<Vec<Tensor>> {
    move |xs: &[Tensor]| {
        let h = drop.forward(&xs[0].matmul(&w)?.tanh()?, true)?;
        Ok(vec![h.mul(&xs[1])?, xs[0].exp()?])
    }
}

fn run_block(checkpointed: bool) -> (Grads, Tensor, Tensor, Tensor, Vec<&'static str>) {
    let x = randn(&[4, 3], 1).requires_grad_().unwrap();
    let y = randn(&[4, 5], 2).requires_grad_().unwrap();
    let w = randn(&[3, 5], 3).requires_grad_().unwrap();
    let f = block(w.clone(), Arc::new(Dropout::new(0.3, 7).unwrap()));
    let out = if checkpointed {
        checkpoint(&[x.clone(), y.clone()], f).unwrap()
    } else {
        f(&[x.clone(), y.clone()]).unwrap()
    };
    let r = randn(&[4, 5], 4);
    let loss = out[0]
        .mul(&r)
        .unwrap()
        .sum_all()
        .unwrap()
        .add(&out[1].sum_all().unwrap())
        .unwrap();
    let ops = graph_ops(&loss).unwrap().into_iter().collect();
    (loss.backward().unwrap(), x, y, w, ops)
}

#[test]
fn checkpointed_gradients_equal_the_resident_ones_bit_for_bit() {
    let (g0, x0, y0, w0, ops0) = run_block(false);
    let (g1, x1, y1, w1, ops1) = run_block(true);
    for (a, b, name) in [(&x0, &x1, "x"), (&y0, &y1, "y"), (&w0, &w1, "w")] {
        let (ga, gb) = (g0.get(a).unwrap(), g1.get(b).unwrap());
        assert_eq!(bits(ga), bits(gb), "gradient of {name}");
    }
    // Nothing inside the checkpoint is on the tape: only the node and its outputs.
    assert!(ops0.contains(&"tanh") && !ops0.contains(&"checkpoint"));
    assert!(ops1.contains(&"checkpoint") && ops1.contains(&"custom_output"));
    assert!(
        !ops1.contains(&"tanh") && !ops1.contains(&"matmul"),
        "{ops1:?}"
    );
}

/// With block runs traced (`memory::trace_blocks`), each block's forward is recorded in
/// order, then each checkpointed block's re-run as the backward reaches it; a resident block
/// has no re-run. (Other tests of this binary may run blocks meanwhile: only this test's
/// prefixes are read.)
#[test]
fn block_runs_are_traced_forwards_then_reruns_in_reverse() {
    let w = randn(&[3, 3], 5).requires_grad_().unwrap();
    let x = randn(&[2, 3], 6).requires_grad_().unwrap();
    let run = |exec: &BlockExec, prefix: &str, i: usize, x: &Tensor| {
        let w = w.clone();
        exec.run(prefix, i, std::slice::from_ref(x), move |xs| {
            Ok(vec![xs[0].matmul(&w)?.tanh()?])
        })
        .unwrap()
        .remove(0)
    };
    let (all, resident) = (BlockExec::checkpoint_all(), BlockExec::default());
    flame::memory::trace_blocks(true);
    let h = run(&all, "trace_probe.0", 0, &x);
    let h = run(&resident, "trace_probe.1", 1, &h);
    let out = run(&all, "trace_probe.2", 2, &h);
    let grads = out.sum_all().unwrap().backward().unwrap();
    flame::memory::trace_blocks(false);
    let mine: Vec<(String, bool)> = flame::memory::take_block_trace()
        .into_iter()
        .filter(|r| r.prefix.starts_with("trace_probe."))
        .map(|r| (r.prefix, r.rerun))
        .collect();
    let want: Vec<(String, bool)> = [(0, false), (1, false), (2, false), (2, true), (0, true)]
        .iter()
        .map(|&(i, rerun)| (format!("trace_probe.{i}"), rerun))
        .collect();
    assert_eq!(mine, want);
    assert!(grads.get(&w).is_some() && grads.get(&x).is_some());
    // Off: nothing more is recorded.
    run(&all, "trace_probe.3", 3, &x);
    assert!(flame::memory::take_block_trace()
        .iter()
        .all(|r| r.prefix != "trace_probe.3"));
}

#[test]
fn a_checkpoint_finds_captured_parameters_when_no_input_needs_a_gradient() {
    let x = randn(&[2, 3], 10);
    let w = randn(&[3, 3], 11).requires_grad_().unwrap();
    let w2 = w.clone();
    let out = checkpoint(std::slice::from_ref(&x), move |xs| {
        Ok(vec![xs[0].matmul(&w2)?])
    })
    .unwrap();
    assert!(out[0].requires_grad());
    let g = out[0].sum_all().unwrap().backward().unwrap();
    let want = x.matmul(&w).unwrap().sum_all().unwrap().backward().unwrap();
    assert_eq!(bits(g.get(&w).unwrap()), bits(want.get(&w).unwrap()));
    // Nothing trainable at all: plain outputs.
    let frozen = randn(&[3, 3], 12);
    let out = checkpoint(&[x], move |xs| Ok(vec![xs[0].matmul(&frozen)?])).unwrap();
    assert!(!out[0].requires_grad());
}

#[test]
fn a_checkpoint_under_no_grad_records_nothing() {
    let x = randn(&[2, 3], 20).requires_grad_().unwrap();
    let _g = flame::no_grad();
    let out = checkpoint(&[x], |xs| Ok(vec![xs[0].sqr()?])).unwrap();
    assert!(!out[0].requires_grad());
}

#[test]
fn an_unused_output_and_a_frozen_input_get_no_gradient() {
    let x = randn(&[3], 30).requires_grad_().unwrap();
    let c = randn(&[3], 31);
    let out = checkpoint(&[x.clone(), c.clone()], |xs| {
        Ok(vec![xs[0].mul(&xs[1])?, xs[0].exp()?])
    })
    .unwrap();
    let g = out[0].sum_all().unwrap().backward().unwrap();
    assert_eq!(bits(g.get(&x).unwrap()), bits(&c));
    assert!(g.get(&c).is_none());
}

/// An identity node that notes when it is dropped and, at its backward, whether the node
/// after it in the forward (`after`) had been dropped by then.
struct Noted {
    dropped: Arc<std::sync::atomic::AtomicBool>,
    after: Option<Arc<std::sync::atomic::AtomicBool>>,
    saw_after_dropped: Arc<std::sync::atomic::AtomicBool>,
}

impl flame::autograd::CustomBackward for Noted {
    fn name(&self) -> &'static str {
        "noted"
    }
    fn backward(&self, g: &[Option<Tensor>], _: &mut Grads) -> Result<Vec<Option<Tensor>>> {
        if let Some(after) = &self.after {
            let seen = after.load(std::sync::atomic::Ordering::SeqCst);
            self.saw_after_dropped
                .store(seen, std::sync::atomic::Ordering::SeqCst);
        }
        Ok(g.to_vec())
    }
}

impl Drop for Noted {
    fn drop(&mut self) {
        self.dropped
            .store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

/// The backward frees a custom node (a checkpoint, with its saved inputs and kept outputs)
/// once it has passed it, not at its end: what blocks hold for the backward shrinks as it
/// goes, which the memory plans count on.
#[test]
fn the_backward_frees_each_custom_node_once_past_it() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let x = randn(&[4], 40).requires_grad_().unwrap();
    let flag = || Arc::new(AtomicBool::new(false));
    let (first_dropped, second_dropped, seen, unused) = (flag(), flag(), flag(), flag());
    let first = Noted {
        dropped: first_dropped.clone(),
        after: Some(second_dropped.clone()),
        saw_after_dropped: seen.clone(),
    };
    let second = Noted {
        dropped: second_dropped.clone(),
        after: None,
        saw_after_dropped: unused,
    };
    let h = flame::autograd::custom_op(
        std::slice::from_ref(&x),
        vec![x.detach()],
        Arc::new(first),
        true,
    )
    .unwrap()
    .remove(0);
    let h = flame::autograd::custom_op(
        std::slice::from_ref(&h),
        vec![h.detach()],
        Arc::new(second),
        true,
    )
    .unwrap()
    .remove(0);
    let loss = h.sqr().unwrap().sum_all().unwrap();
    drop(h);
    let g = loss.backward().unwrap();
    assert!(
        seen.load(Ordering::SeqCst),
        "the second node was still alive when the backward reached the first"
    );
    assert!(first_dropped.load(Ordering::SeqCst));
    let want = x.affine(2.0, 0.0).unwrap();
    assert_eq!(bits(g.get(&x).unwrap()), bits(&want));
}

// ----- models -------------------------------------------------------------------------------

fn lora(targets: &[&str]) -> Arc<Adapters> {
    Adapters::new(LoraConfig {
        rank: 2,
        alpha: 2.0,
        // Dropout on: the re-run must repeat the masks.
        dropout: 0.25,
        targets: targets.iter().map(|s| s.to_string()).collect(),
        seed: 5,
    })
    .unwrap()
}

/// The LoRA gradients (by name, as bits) and the loss of the second of two steps (the
/// adapters unchanged, the dropout masks new) of a model built by `build` with `exec`,
/// optionally streaming `streamed` blocks of `prefixes`; the outputs the re-runs took from
/// their logs, and the bytes the backward's uploads left out.
#[allow(clippy::too_many_arguments)]
fn lora_grads<M>(
    dev: &Device,
    build: impl Fn(&VarBuilder) -> Result<M>,
    set_exec: impl Fn(&mut M, BlockExec),
    forward: impl Fn(&M, &Device) -> Result<Tensor>,
    prefixes: Vec<String>,
    streamed: &[usize],
    checkpointing: Checkpointing,
    keep: Keep,
    fp8: bool,
    rerun_ahead: bool,
) -> (Vec<(String, Vec<u32>)>, u64, u64, u64) {
    // Adapters on the blocks' layers (the LoRA use case; embeddings before the blocks stay
    // frozen: a trainable input shared by every block, such as the time embedding, sums
    // its per-block gradients in another grouping with checkpoints, equal only to rounding).
    let targets: Vec<String> = prefixes.iter().map(|p| format!("{p}.*")).collect();
    let adapters = lora(&targets.iter().map(String::as_str).collect::<Vec<_>>());
    let mut vb = VarBuilder::random(3, 0.3, DType::F32, dev)
        .with_adapters(adapters.clone())
        .unwrap()
        .with_fp8(fp8)
        .unwrap();
    let mut streamer = None;
    if !streamed.is_empty() {
        let names = streamed.iter().map(|&i| prefixes[i].clone()).collect();
        let s = BlockStreamer::new(dev, names, 1);
        vb = vb.with_host_weights(s.clone()).unwrap();
        streamer = Some(s);
    }
    let mut model = build(&vb).unwrap();
    set_exec(
        &mut model,
        BlockExec {
            checkpointing,
            streamer: streamer.clone(),
            keep,
            rerun_ahead,
            ..Default::default()
        },
    );
    let reused = kept_reused();
    // The second step begins with blocks the first one's backward left (whole, though the
    // backward leaves forward-only weights out of the others).
    let _ = forward(&model, dev).unwrap().backward().unwrap();
    let loss = forward(&model, dev).unwrap();
    let grads = loss.backward().unwrap();
    let reused = kept_reused() - reused;
    let mut left_out = 0;
    if let Some(s) = &streamer {
        let r = s.report().unwrap();
        assert_eq!(r.blocks, streamed.len());
        assert!(r.host_bytes > 0);
        // The first forward fetches every block; each backward all but the last
        // prefetch + 1 = 2, which the forward left on the device for it; the second forward
        // all but the first 2, which the backward left.
        let m = streamed.len();
        let k = m.min(2);
        assert_eq!(r.uploads as usize, m + 3 * (m - k), "{r:?}");
        left_out = r.left_out_bytes;
    }
    let named = adapters
        .params()
        .unwrap()
        .into_iter()
        .map(|(n, p)| {
            let g = grads
                .get(&p)
                .unwrap_or_else(|| panic!("no gradient for {n}"));
            (n, bits(g))
        })
        .collect();
    (
        named,
        loss.to_scalar_f64().unwrap().to_bits(),
        reused,
        left_out,
    )
}

fn check_model<M>(
    what: &str,
    build: impl Fn(&VarBuilder) -> Result<M> + Copy,
    set_exec: impl Fn(&mut M, BlockExec) + Copy,
    forward: impl Fn(&M, &Device) -> Result<Tensor> + Copy,
    prefixes: Vec<String>,
) {
    check_model_on(&CPU, what, false, build, set_exec, forward, prefixes)
}

/// `fp8`: the base weights in FP8 (codes and scales of several dtypes in one streamed pack).
fn check_model_on<M>(
    dev: &Device,
    what: &str,
    fp8: bool,
    build: impl Fn(&VarBuilder) -> Result<M> + Copy,
    set_exec: impl Fn(&mut M, BlockExec) + Copy,
    forward: impl Fn(&M, &Device) -> Result<Tensor> + Copy,
    prefixes: Vec<String>,
) {
    let _helper = helper_alone();
    let n = prefixes.len();
    let resident = lora_grads(
        dev,
        build,
        set_exec,
        forward,
        prefixes.clone(),
        &[],
        Checkpointing::Off,
        Keep::NONE,
        fp8,
        false,
    );
    assert!(!resident.0.is_empty());
    let down = Keep {
        down_projections: true,
        ..Keep::NONE
    };
    let both = Keep {
        attention: true,
        down_projections: true,
        ..Keep::NONE
    };
    let few = Keep {
        few_rows: true,
        ..Keep::NONE
    };
    let all = Keep {
        attention: true,
        down_projections: true,
        few_rows: true,
    };
    // The re-run of each checkpointed block issued on the helper thread while the backward
    // of the block after it is issued (`autograd::ahead`): the same values.
    let ahead: Vec<(&str, Vec<usize>, Checkpointing, Keep)> = vec![
        (
            "every block checkpointed, re-runs ahead",
            vec![],
            Checkpointing::All,
            Keep::NONE,
        ),
        (
            "all blocks streamed, few-row outputs kept, re-runs ahead",
            (0..n).collect(),
            Checkpointing::All,
            few,
        ),
        (
            "alternate blocks streamed, everything kept, re-runs ahead",
            (0..n).step_by(2).collect(),
            Checkpointing::Every(3),
            all,
        ),
    ];
    let variants: Vec<(&str, Vec<usize>, Checkpointing, Keep)> = vec![
        (
            "every block checkpointed",
            vec![],
            Checkpointing::All,
            Keep::NONE,
        ),
        (
            "every block checkpointed, down-projections kept",
            vec![],
            Checkpointing::All,
            down,
        ),
        (
            "every 2nd block checkpointed, attention and down-projections kept",
            vec![],
            Checkpointing::Every(2),
            both,
        ),
        (
            "every block but the first two checkpointed, down-projections kept",
            vec![],
            Checkpointing::AllBut(2),
            down,
        ),
        (
            "alternate blocks streamed",
            (0..n).step_by(2).collect(),
            Checkpointing::Off,
            Keep::NONE,
        ),
        (
            "all blocks streamed, down-projections kept",
            (0..n).collect(),
            Checkpointing::All,
            down,
        ),
        (
            "every block checkpointed, few-row outputs kept",
            vec![],
            Checkpointing::All,
            few,
        ),
        (
            "all blocks streamed, few-row outputs kept",
            (0..n).collect(),
            Checkpointing::All,
            few,
        ),
        (
            "alternate blocks streamed, everything kept",
            (0..n).step_by(2).collect(),
            Checkpointing::Every(3),
            all,
        ),
    ];
    let taken = flame::autograd::ahead::taken();
    let runs = variants
        .into_iter()
        .map(|v| (v, false))
        .chain(ahead.into_iter().map(|v| (v, true)));
    for ((name, streamed, ck, keep), rerun_ahead) in runs {
        let got = lora_grads(
            dev,
            build,
            set_exec,
            forward,
            prefixes.clone(),
            &streamed,
            ck,
            keep,
            fp8,
            rerun_ahead,
        );
        // A keeping checkpoint's re-run takes some outputs from its log (every block of
        // these models has a down-projection and a Linear over the conditioning vector); one
        // that keeps nothing takes none.
        assert_eq!(got.2 > 0, keep.any(), "{what}, {name}: {} reused", got.2);
        // Those Linears' weights are then the forward's only: the backward's uploads of
        // streamed blocks past the first two leave them out (the backward fetches blocks
        // 0..m - 2, the forward having left the last two).
        // (A down-projection over the conditioning vector, as an SDXL ResNet's time
        // embedding, is left out when down-projections are kept too.)
        let m = streamed.len();
        if keep.few_rows && m >= 5 {
            assert!(got.3 > 0, "{what}, {name}: nothing left out");
        }
        if !keep.few_rows && !keep.down_projections || m < 5 {
            assert_eq!(got.3, 0, "{what}, {name}: {} bytes left out", got.3);
        }
        assert_eq!(got.1, resident.1, "{what}, {name}: loss");
        assert_eq!(got.0.len(), resident.0.len());
        for ((n0, g0), (n1, g1)) in resident.0.iter().zip(&got.0) {
            assert_eq!(n0, n1);
            assert!(g0 == g1, "{what}, {name}: gradient of {n0} differs");
        }
    }
    assert!(
        flame::autograd::ahead::taken() > taken,
        "{what}: no re-run was issued ahead"
    );
}

fn tiny_flux() -> FluxConfig {
    FluxConfig {
        in_channels: 8,
        out_channels: 8,
        vec_in_dim: 8,
        context_in_dim: 12,
        hidden_size: 32,
        mlp_ratio: 2.0,
        num_heads: 2,
        depth: 2,
        depth_single_blocks: 3,
        axes_dim: vec![4, 6, 6],
        theta: 10_000.0,
        qkv_bias: true,
        guidance_embed: true,
    }
}

fn flux_loss(m: &Flux, dev: &Device) -> Result<Tensor> {
    let img = randn_on(&[1, 6, 8], 40, dev);
    let txt = randn_on(&[1, 4, 12], 41, dev);
    let y = randn_on(&[1, 8], 42, dev);
    let t = Tensor::full(0.4, 1, DType::F32, dev)?;
    let g = Tensor::full(3.5, 1, DType::F32, dev)?;
    let (ii, ti) = (flux::image_ids(2, 3, dev)?, flux::text_ids(4, dev)?);
    let out = m.forward(&img, &ii, &txt, &ti, &t, &y, Some(&g))?;
    out.sqr()?.mean_all()
}

#[test]
fn flux_blocks_checkpointed_or_streamed_give_the_resident_gradients() {
    check_model(
        "flux",
        |vb| Flux::new(vb, &tiny_flux()),
        |m, e| m.exec = e,
        flux_loss,
        tiny_flux().block_prefixes(),
    );
}

/// On a GPU: the streamed weights go through page-locked host memory, the copy stream and
/// its events; the gradients must still equal the resident run's bit for bit (the same
/// kernels on the same values).
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a GPU (run with --include-ignored on the GPU machine)"]
fn flux_blocks_streamed_on_cuda_give_the_resident_gradients() {
    let _one = cuda_alone();
    let Ok(dev) = Device::cuda(0) else {
        panic!("no CUDA device");
    };
    check_flux_and_fp8_flux(&dev, "on cuda");
}

/// `check_model_on` for the tiny Flux with its weights as they are and in FP8, each check
/// named by `how`.
#[cfg(feature = "cuda")]
fn check_flux_and_fp8_flux(dev: &Device, how: &str) {
    for fp8 in [false, true] {
        let what = format!("{}flux {how}", if fp8 { "fp8 " } else { "" });
        check_model_on(
            dev,
            &what,
            fp8,
            |vb| Flux::new(vb, &tiny_flux()),
            |m, e| m.exec = e,
            flux_loss,
            tiny_flux().block_prefixes(),
        );
    }
}

/// The same with an FP8 base on the CPU: a streamed block's pack holds the codes (u32) and
/// the scales and biases (f32).
#[test]
fn fp8_flux_blocks_streamed_give_the_resident_gradients() {
    check_model_on(
        &CPU,
        "fp8 flux",
        true,
        |vb| Flux::new(vb, &tiny_flux()),
        |m, e| m.exec = e,
        flux_loss,
        tiny_flux().block_prefixes(),
    );
}

fn tiny_sd3() -> Sd3Config {
    Sd3Config {
        patch_size: 2,
        in_channels: 4,
        out_channels: 4,
        depth: 3,
        hidden_size: 32,
        num_heads: 2,
        context_dim: 12,
        pooled_dim: 8,
        pos_embed_max_size: 4,
        qk_norm: true,
        dual_attention_layers: vec![0],
        mlp_ratio: 2.0,
    }
}

#[test]
fn sd3_blocks_checkpointed_or_streamed_give_the_resident_gradients() {
    check_model(
        "sd3",
        |vb| Sd3::new(vb, &tiny_sd3()),
        |m, e| m.exec = e,
        |m, dev| {
            let x = randn_on(&[1, 4, 4, 6], 50, dev);
            let t = Tensor::full(300.0, 1, DType::F32, dev)?;
            let ctx = randn_on(&[1, 5, 12], 51, dev);
            let y = randn_on(&[1, 8], 52, dev);
            m.forward(&x, &t, &ctx, &y)?.sqr()?.mean_all()
        },
        tiny_sd3().block_prefixes(),
    );
}

fn tiny_sdxl() -> SdxlConfig {
    SdxlConfig {
        in_channels: 4,
        out_channels: 4,
        model_channels: 8,
        block_out_channels: vec![8, 16],
        num_res_blocks: 1,
        transformer_depth: vec![0, 2],
        num_heads: vec![1, 2],
        transformer_depth_middle: 2,
        context_dim: 12,
        adm_in_channels: 10,
        addition_time_embed_dim: 4,
        num_groups: 4,
    }
}

fn sdxl_loss(m: &Unet, dev: &Device) -> Result<Tensor> {
    let x = randn_on(&[1, 4, 6, 6], 60, dev);
    let t = Tensor::full(500.0, 1, DType::F32, dev)?;
    let ctx = randn_on(&[1, 3, 12], 61, dev);
    let y = randn_on(&[1, 10], 62, dev);
    m.forward(&x, &t, &ctx, &y)?.sqr()?.mean_all()
}

/// Every SDXL unit's re-run leaves out its tail: a transformer layer's feed-forward's last
/// Linear, a ResBlock's `conv2` where the ResBlock ends its unit (not where the level's
/// upsampler follows it in the same unit), once each a step; the plain `forward` of the
/// same blocks (a resident run) skips nothing.
#[test]
fn sdxl_reruns_leave_out_each_units_tail() {
    use flame::models::sdxl::UnitKind;
    let _helper = helper_alone();
    let cfg = tiny_sdxl();
    let tails = cfg
        .units()
        .iter()
        .filter(|u| {
            matches!(
                u.kind,
                UnitKind::Res | UnitKind::SkipRes { up: false } | UnitKind::Layer
            )
        })
        .count() as u64;
    let run = |checkpointing| {
        let skipped = flame::autograd::unread_skipped();
        lora_grads(
            &CPU,
            |vb| Unet::new(vb, &tiny_sdxl()),
            |m, e| m.exec = e,
            sdxl_loss,
            cfg.block_prefixes(),
            &[],
            checkpointing,
            Keep::NONE,
            false,
            false,
        );
        flame::autograd::unread_skipped() - skipped
    };
    assert_eq!(run(Checkpointing::Off), 0);
    // `lora_grads` runs two steps.
    assert_eq!(run(Checkpointing::All), 2 * tails);
}

/// A whole tiny SDXL under one checkpoint, its units resident inside it: the units' tails
/// feed what follows them there, so the outer re-run computes them (`uncheckpointed`), and
/// the gradients equal the resident run's bit for bit.
#[test]
fn sdxl_under_an_outer_checkpoint_computes_its_resident_units_tails() {
    let _helper = helper_alone();
    let cfg = tiny_sdxl();
    let run = |outer: bool| {
        lora_grads(
            &CPU,
            |vb| Unet::new(vb, &tiny_sdxl()),
            |m, e| m.exec = e,
            if outer {
                |m: &Unet, dev: &Device| {
                    let m = m.clone();
                    let dev2 = dev.clone();
                    let f = move |_: &[Tensor]| Ok(vec![sdxl_loss(&m, &dev2)?]);
                    let x = randn_on(&[1], 70, dev);
                    let mut out = checkpoint(&[x], f)?;
                    Ok(out.remove(0))
                }
            } else {
                |m: &Unet, dev: &Device| sdxl_loss(m, dev)
            },
            cfg.block_prefixes(),
            &[],
            Checkpointing::Off,
            Keep::NONE,
            false,
            false,
        )
    };
    let skipped = flame::autograd::unread_skipped();
    let (outer, plain) = (run(true), run(false));
    assert_eq!(
        flame::autograd::unread_skipped(),
        skipped,
        "no tail skipped"
    );
    assert_eq!(outer.0, plain.0);
}

/// The same for SDXL, whose units' re-runs leave out their tails (above).
#[test]
fn sdxl_blocks_checkpointed_or_streamed_give_the_resident_gradients() {
    let skipped = flame::autograd::unread_skipped();
    check_model(
        "sdxl",
        |vb| Unet::new(vb, &tiny_sdxl()),
        |m, e| m.exec = e,
        sdxl_loss,
        tiny_sdxl().block_prefixes(),
    );
    assert!(flame::autograd::unread_skipped() > skipped);
}

/// Under a cap, whose arena keeps the two streams' reuse of freed memory apart, the re-runs
/// issued ahead run on the GPU's side stream beside the backward the walking thread issues:
/// the gradients still equal the resident run's bit for bit (Flux, FP8 Flux and SDXL).
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a CUDA GPU"]
fn re_runs_on_the_side_stream_give_the_resident_gradients() {
    let _one = cuda_alone();
    let Ok(dev) = Device::cuda(0) else {
        panic!("no CUDA device");
    };
    let Device::Cuda(cuda) = &dev else {
        panic!("not a CUDA device");
    };
    cuda.set_side_stream(true);
    cuda.set_memory_limit(Some(cuda.memory().in_use + (4 << 30)));
    let before = cuda.memory().side_windows;
    check_flux_and_fp8_flux(&dev, "on the side stream");
    check_model_on(
        &dev,
        "sdxl, side stream",
        false,
        |vb| Unet::new(vb, &tiny_sdxl()),
        |m, e| m.exec = e,
        sdxl_loss,
        tiny_sdxl().block_prefixes(),
    );
    let windows = cuda.memory().side_windows - before;
    cuda.set_memory_limit(None);
    assert!(windows > 0, "no re-run ran on the side stream");
}

#[test]
fn block_prefixes_name_every_block_the_models_build() {
    // Streaming a prefix that is not a block would leave its weights resident silently:
    // the names must be the models' own key paths.
    let vb = VarBuilder::random(1, 0.1, DType::F32, &CPU);
    Unet::new(&vb, &tiny_sdxl()).unwrap();
    let layers: Vec<String> = vb.params().unwrap().into_iter().map(|(k, _)| k).collect();
    for p in tiny_sdxl().block_prefixes() {
        assert!(
            layers.iter().any(|l| l.starts_with(&format!("{p}."))),
            "no layer under {p}"
        );
    }
}

/// What `sdxl_ahead_steps` returns.
type AheadSteps = (Vec<u64>, Vec<Vec<Vec<u32>>>, Option<StreamReport>, u64);

/// Losses (bits), LoRA gradients (bits) of each of three SDXL steps, each with a context of
/// its own announced between the forward before and its backward as the trainer announces
/// it, and a forward under `no_grad` with a context nobody announced (a validation's)
/// between the second and the third; with `ahead`, every unit streamed and the products of
/// the cross-attention's keys and values over the next context computed in the backward
/// before (`BlockStreamer::set_ahead_products`), else resident. The streamer's report, and
/// the bytes the third step's forward left out of its uploads.
fn sdxl_ahead_steps(dev: &Device, ahead: bool) -> AheadSteps {
    // A context wide enough that its Linears see few rows (`FEW_ROWS` x 3 tokens <= 64).
    let cfg = SdxlConfig {
        context_dim: 64,
        ..tiny_sdxl()
    };
    let prefixes = cfg.block_prefixes();
    let targets: Vec<String> = prefixes.iter().map(|p| format!("{p}.*")).collect();
    let adapters = lora(&targets.iter().map(String::as_str).collect::<Vec<_>>());
    let mut vb = VarBuilder::random(3, 0.3, DType::F32, dev)
        .with_adapters(adapters.clone())
        .unwrap();
    let streamer = ahead.then(|| {
        let s = BlockStreamer::new(dev, prefixes.clone(), 1);
        s.set_ahead_products(true).unwrap();
        s
    });
    if let Some(s) = &streamer {
        vb = vb.with_host_weights(s.clone()).unwrap();
    }
    let mut m = Unet::new(&vb, &cfg).unwrap();
    m.exec = BlockExec {
        checkpointing: if ahead {
            Checkpointing::All
        } else {
            Checkpointing::Off
        },
        streamer: streamer.clone(),
        keep: Keep {
            few_rows: true,
            ..Keep::NONE
        },
        ..Default::default()
    };
    let x = randn_on(&[1, 4, 6, 6], 60, dev);
    let t = Tensor::full(500.0, 1, DType::F32, dev).unwrap();
    let y = randn_on(&[1, 10], 62, dev);
    let ctx: Vec<Tensor> = (0..3).map(|k| randn_on(&[1, 3, 64], 70 + k, dev)).collect();
    let (mut losses, mut grads, mut left) = (vec![], vec![], 0);
    for k in 0..3 {
        if k == 2 {
            let _g = flame::no_grad();
            let other = randn_on(&[1, 3, 64], 80, dev);
            losses.push(
                m.forward(&x, &t, &other, &y)
                    .unwrap()
                    .sqr()
                    .unwrap()
                    .mean_all()
                    .unwrap()
                    .to_scalar_f64()
                    .unwrap()
                    .to_bits(),
            );
        }
        let before = streamer
            .as_ref()
            .map_or(0, |s| s.report().unwrap().left_out_bytes);
        let loss = m
            .forward(&x, &t, &ctx[k], &y)
            .unwrap()
            .sqr()
            .unwrap()
            .mean_all()
            .unwrap();
        if k == 2 {
            left = streamer
                .as_ref()
                .map_or(0, |s| s.report().unwrap().left_out_bytes)
                - before;
        }
        if k < 2 {
            let next = &ctx[k + 1];
            m.exec.announce_input(next, || Ok(next.clone())).unwrap();
        }
        let g = loss.backward().unwrap();
        losses.push(loss.to_scalar_f64().unwrap().to_bits());
        grads.push(
            adapters
                .params()
                .unwrap()
                .into_iter()
                .map(|(_, p)| bits(g.get(&p).unwrap()))
                .collect(),
        );
    }
    let report = streamer.map(|s| s.report().unwrap());
    (losses, grads, report, left)
}

/// SDXL's keys and values over the text context computed in the backward before: every
/// step's loss and gradients, and a validation forward's loss between, equal the resident
/// run's bit for bit; the backward computed those products, and the forward given the
/// announced context left their weights out of its uploads.
#[test]
fn sdxl_context_products_computed_ahead_give_the_resident_values() {
    let _helper = helper_alone();
    check_sdxl_ahead(&CPU);
}

/// The same on CUDA: the forward's partial uploads and the products on the device.
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a GPU (run with --include-ignored on the GPU machine)"]
fn sdxl_context_products_computed_ahead_on_cuda_give_the_resident_values() {
    let _one = cuda_alone();
    let _helper = helper_alone();
    check_sdxl_ahead(&Device::cuda(0).unwrap());
}

fn check_sdxl_ahead(dev: &Device) {
    let (losses, grads, _, _) = sdxl_ahead_steps(dev, false);
    let (ahead_losses, ahead_grads, report, left) = sdxl_ahead_steps(dev, true);
    assert_eq!(ahead_losses, losses);
    assert_eq!(ahead_grads.len(), grads.len());
    for (k, (a, b)) in ahead_grads.iter().zip(&grads).enumerate() {
        assert!(a == b, "step {k}: gradients differ");
    }
    let r = report.unwrap();
    // Two announcements, each a product a unit with cross-attention per key and value.
    assert!(r.ahead_products > 0, "{r:?}");
    assert!(left > 0, "the third forward brought every weight: {r:?}");
}

#[test]
fn a_released_streamed_weight_is_an_error_to_read_and_comes_back_when_fetched() {
    let s = BlockStreamer::new(&CPU, vec!["blk".into()], 1);
    let vb = VarBuilder::random(1, 1.0, DType::F32, &CPU)
        .with_host_weights(s.clone())
        .unwrap();
    let w = vb.pp("blk").get((3, 4), "weight").unwrap();
    let other = vb.pp("head").get((3, 4), "weight").unwrap();
    assert!(other.to_vec::<f32>().is_ok());
    match w.to_vec::<f32>() {
        Err(Error::Stream(msg)) => assert!(msg.contains("streamed weight"), "{msg}"),
        other => panic!("expected a streaming error, got {other:?}"),
    }
    // The weight comes back with its values inside a checkpointed run of its block.
    let fresh = VarBuilder::random(1, 1.0, DType::F32, &CPU)
        .pp("blk")
        .get((3, 4), "weight")
        .unwrap();
    let exec = BlockExec {
        checkpointing: Checkpointing::Off,
        streamer: Some(s.clone()),
        ..Default::default()
    };
    let w2 = w.clone();
    let out = exec
        .run("blk", 0, &[randn(&[1, 3], 1)], move |_| {
            Ok(vec![w2.affine(1.0, 0.0)?])
        })
        .unwrap();
    assert_eq!(bits(&out[0]), bits(&fresh));
    s.release_all().unwrap();
    assert!(w.to_vec::<f32>().is_err());
    // A trainable tensor is never streamed.
    let t = randn(&[2], 3).requires_grad_().unwrap();
    assert!(s.adopt(0, &t).is_err());
}

/// `n` seeded bf16 bit patterns: roughly normal values of scale `scale`, with zeros,
/// subnormals, infinities, NaNs and the largest value mixed in.
fn bf16_patterns(n: usize, scale: f32, seed: u64) -> Vec<u16> {
    let mut state = 0x2545_F491_4F6C_DD1Du64 ^ seed.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    (0..n)
        .map(|i| match i % 89 {
            0 => 0x0000,
            1 => 0x8000,
            2 => 0x0003,
            3 => 0xFF80,
            4 => 0x7FC0,
            5 => 0x7F7F,
            _ => {
                let u: f32 = (0..4)
                    .map(|_| (next() >> 40) as f32 / (1u64 << 24) as f32)
                    .sum();
                ((scale * (u - 2.0)).to_bits() >> 16) as u16
            }
        })
        .collect()
}

/// A bf16 tensor on `dev` with the bit patterns `bits`.
fn bf16_tensor(bits: &[u16], dev: &Device) -> Tensor {
    let x: Vec<half::bf16> = bits.iter().map(|&b| half::bf16::from_bits(b)).collect();
    Tensor::from_vec(x, bits.len(), dev).unwrap()
}

/// The bit patterns of bf16 tensor `t`.
fn bf16_bits(t: &Tensor) -> Vec<u16> {
    let v = t.to_vec::<half::bf16>().unwrap();
    v.iter().map(|x| x.to_bits()).collect()
}

/// bf16 weights of a streamed block (odd sizes, zeros, subnormals, infinities, NaNs and wide
/// exponents among normal values; many small tensors after a large one) stream through the link's lossless code and come back bit
/// for bit on `dev`; with the code off they cross as they are. Returns (uploaded, decoded)
/// bytes of one fetch with the code on.
fn wire_round_trip(dev: &Device) -> (u64, u64) {
    let sizes = [
        1usize, 300, 511, 4095, 4097, 16_384, 20_001, 49_153, 70_001, 131_073,
    ];
    let mut values: Vec<Vec<u16>> = sizes
        .iter()
        .map(|&n| bf16_patterns(n, 0.05, n as u64))
        .collect();
    // The longest codes: three exponents in all but the fourth of four chunks (2-bit codes),
    // the 253 others in that one (10-bit codes, the Kraft sum leaving no room for shorter
    // ones), so its streams take about the 40 words a run may.
    values.push(
        (0..4 * 4096)
            .map(|i: usize| {
                let e = if i < 3 * 4096 {
                    118 + i % 3
                } else {
                    (121 + i % 253) % 256
                };
                (i as u16 & 0x807F) | ((e as u16) << 7)
            })
            .collect(),
    );
    // A large tensor, then forty small coded ones: the small ones share a staged piece
    // (`staging_piece` of the block's bytes on the link: half of a block this small), more
    // of them than one decode launch takes.
    values.push(bf16_patterns(4_000_037, 0.05, 99));
    values.extend((0..40).map(|k| bf16_patterns(8_191, 0.01 * (k + 1) as f32, 200 + k as u64)));
    let mut report = (0, 0);
    for code in [true, false] {
        let s = BlockStreamer::new(dev, vec!["blk".into()], 1);
        s.set_wire_code(code).unwrap();
        let mut ws: Vec<Tensor> = values.iter().map(|v| bf16_tensor(v, dev)).collect();
        ws.push(Tensor::randn(33, DType::F32, dev, 7).unwrap());
        let handles: Vec<Tensor> = ws.iter().map(|w| s.adopt(0, w).unwrap()).collect();
        drop(ws);
        let exec = BlockExec {
            streamer: Some(s.clone()),
            ..Default::default()
        };
        let hs = handles.clone();
        let (tx, rx) = std::sync::mpsc::channel();
        exec.run("blk", 0, &[randn_on(&[1], 4, dev)], move |_| {
            let got: Vec<Vec<u16>> = hs[..hs.len() - 1].iter().map(bf16_bits).collect();
            tx.send(got).unwrap();
            Ok(vec![hs[0].affine(1.0, 0.0)?])
        })
        .unwrap();
        assert_eq!(rx.recv().unwrap(), values, "fetched values, code {code}");
        let r = s.report().unwrap();
        assert_eq!(r.uploads, 1);
        if code {
            // The large tensors go coded (a byte and ~3.2 bits a value, and a 2 KiB table
            // each), the small ones as they are.
            assert!(
                (r.uploaded_bytes as f64) < 0.8 * r.decoded_bytes as f64,
                "{r:?}"
            );
            report = (r.uploaded_bytes, r.decoded_bytes);
        } else {
            assert_eq!(r.uploaded_bytes, r.decoded_bytes, "{r:?}");
        }
        s.release_all().unwrap();
        // The wire code is chosen before the first fetch.
        assert!(s.set_wire_code(!code).is_err());
    }
    report
}

#[test]
fn bf16_weights_stream_in_the_wire_code_and_come_back_bit_for_bit() {
    wire_round_trip(&CPU);
}

/// Five streamed blocks of bf16 weights of different sizes, coded but the first
/// `uncoded_first`, run in order for six passes with two blocks fetched ahead: every fetch
/// brings the exact values, the uploads cross the staging ring at every offset (pieces wrap
/// around it) and one pass's uploads overlap the next's decodes; the uncoded blocks cross
/// beside them straight into place. Returns the streamer's report.
fn coded_blocks_cycle(dev: &Device, uncoded_first: usize) -> StreamReport {
    let n = 5;
    let prefixes: Vec<String> = (0..n).map(|i| format!("b{i}")).collect();
    let s = BlockStreamer::new(dev, prefixes.clone(), 2);
    s.set_wire_code(true).unwrap();
    s.set_uncoded_first(uncoded_first).unwrap();
    let values: Vec<Vec<Vec<u16>>> = (0..n)
        .map(|b| {
            [30_011 + 7_919 * b, 70_001 - 9_001 * b, 4_097 * (b + 1), 129]
                .iter()
                .enumerate()
                .map(|(k, &len)| bf16_patterns(len, 0.02 * (k + 1) as f32, (10 * b + k) as u64))
                .collect()
        })
        .collect();
    let handles: Vec<Vec<Tensor>> = values
        .iter()
        .enumerate()
        .map(|(b, vs)| {
            vs.iter()
                .map(|v| s.adopt(b, &bf16_tensor(v, dev)).unwrap())
                .collect()
        })
        .collect();
    let exec = BlockExec {
        streamer: Some(s.clone()),
        ..Default::default()
    };
    for pass in 0..6 {
        for (b, prefix) in prefixes.iter().enumerate() {
            let hs = handles[b].clone();
            let (tx, rx) = std::sync::mpsc::channel();
            exec.run(prefix, b, &[randn_on(&[1], 4, dev)], move |_| {
                let got: Vec<Vec<u16>> = hs.iter().map(bf16_bits).collect();
                tx.send(got).unwrap();
                Ok(vec![hs[0].affine(1.0, 0.0)?])
            })
            .unwrap();
            assert_eq!(rx.recv().unwrap(), values[b], "pass {pass}, block {b}");
        }
    }
    let r = s.report().unwrap();
    assert!(r.uploaded_bytes < r.decoded_bytes, "{r:?}");
    s.release_all().unwrap();
    // Chosen before the first fetch.
    assert!(s.set_uncoded_first(0).is_err());
    r
}

#[test]
fn coded_blocks_cycle_exactly_on_the_cpu() {
    let coded = coded_blocks_cycle(&CPU, 0);
    assert!(coded.uploads >= 5);
    // The first two uncoded: the same fetches, more bytes.
    let more = coded_blocks_cycle(&CPU, 2);
    assert_eq!(more.uploads, coded.uploads);
    assert!(
        more.uploaded_bytes > coded.uploaded_bytes,
        "{more:?} against {coded:?}"
    );
    // Nothing to time on the CPU.
    assert_eq!(coded.timed_uploads, 0);
}

/// The same on the GPU, where the pieces cross a staging ring of the largest block's bytes
/// and are decoded on the decode stream, the streams ordered by events reused from one
/// upload to the next: one upload in `TIME_EVERY` is timed.
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a CUDA GPU"]
fn coded_blocks_cycle_through_the_staging_ring_on_cuda() {
    let _one = cuda_alone();
    let dev = Device::cuda(0).expect("a CUDA GPU");
    for uncoded_first in [0, 2] {
        let r = coded_blocks_cycle(&dev, uncoded_first);
        let (uploads, bytes) = (r.uploads, r.uploaded_bytes);
        // The same fetches as on the CPU.
        let cpu = coded_blocks_cycle(&CPU, uncoded_first);
        let (cpu_uploads, cpu_bytes) = (cpu.uploads, cpu.uploaded_bytes);
        assert_eq!(uploads, cpu_uploads);
        assert!(uploads >= 5 * 6 - 3 * 5, "{uploads}");
        // The GPU's packs add only alignment.
        assert!(bytes >= cpu_bytes && bytes < cpu_bytes + uploads * 8 * 256);
        // One upload in `TIME_EVERY` timed (those finished by the report), with its bytes.
        assert!(
            r.timed_uploads >= 1 && r.timed_uploads <= uploads.div_ceil(flame::memory::TIME_EVERY)
        );
        assert!(
            r.timed_bytes > 0 && r.timed_bytes < bytes && r.copy_us > 0,
            "{r:?}"
        );
    }
}

/// The same through pinned memory, the staging ring and cuda/wire.cu's decoder.
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a CUDA GPU"]
fn bf16_weights_stream_in_the_wire_code_on_cuda() {
    let _one = cuda_alone();
    let dev = Device::cuda(0).expect("a CUDA GPU");
    let on_cpu = wire_round_trip(&CPU);
    let (uploaded, decoded) = wire_round_trip(&dev);
    // The same code on both backends; the GPU's pack adds only alignment.
    assert!(decoded >= on_cpu.1 && uploaded >= on_cpu.0 && uploaded < on_cpu.0 + 8 * 256);
}

/// On a GPU a streamed block's weights (of several dtypes) come in as one allocation, cut
/// into one buffer per weight: counted once, exact values, and back in the cache (all of it)
/// when the block is released.
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_streamed_block_comes_in_as_one_allocation_and_goes_back_whole() {
    let _one = cuda_alone();
    let dev = Device::cuda(0).expect("a CUDA GPU");
    let Device::Cuda(cuda) = &dev else {
        unreachable!()
    };
    let s = BlockStreamer::new(&dev, vec!["blk".into()], 1);
    // Odd sizes: each part starts at a multiple of 256 bytes after the one before.
    let ws = [
        Tensor::randn((37, 11), DType::BF16, &dev, 1).unwrap(),
        Tensor::randn(5, DType::F32, &dev, 2).unwrap(),
        Tensor::randn((3, 129), DType::F16, &dev, 3).unwrap(),
    ];
    let handles: Vec<Tensor> = ws.iter().map(|w| s.adopt(0, w).unwrap()).collect();
    let f32_bits = |t: &Tensor| bits(&t.to_dtype(DType::F32).unwrap());
    let want: Vec<Vec<u32>> = ws.iter().map(f32_bits).collect();
    drop(ws);
    cuda.synchronize().unwrap();
    cuda.empty_cache();
    let before = cuda.memory();
    let exec = BlockExec {
        streamer: Some(s.clone()),
        ..Default::default()
    };
    let hs = handles.clone();
    let (during_tx, during_rx) = std::sync::mpsc::channel();
    let cu = cuda.clone();
    exec.run("blk", 0, &[randn_on(&[1], 4, &dev)], move |_| {
        let got: Vec<Vec<u32>> = hs
            .iter()
            .map(|t| bits(&t.to_dtype(DType::F32).unwrap()))
            .collect();
        during_tx.send((got, cu.memory())).unwrap();
        Ok(vec![hs[0].affine(1.0, 0.0)?])
    })
    .unwrap();
    let (got, during) = during_rx.recv().unwrap();
    assert_eq!(got, want, "fetched values");
    // 37*11 bf16 = 814 bytes -> the f32 part at 1024 (20 bytes) -> the f16 part at 1280
    // (774 bytes): 2054 bytes, one buffer rounded to 512.
    let pack = 2560u64;
    assert!(
        during.in_use >= before.in_use + pack,
        "{before:?} {during:?}"
    );
    s.release_all().unwrap();
    cuda.synchronize().unwrap();
    let after = cuda.memory();
    assert!(handles[0].to_vec::<f32>().is_err(), "released again");
    assert_eq!(s.report().unwrap().uploads, 1);
    assert!(
        after.cached >= before.cached + pack,
        "the pack is cached whole: {before:?} {after:?}"
    );
}

/// An attention block: q, k, v projections of x, fused attention (the op that `Keep` can
/// keep), an output projection, and a second attention call on the result.
fn attention_block(ws: Vec<Tensor>) -> impl Fn(&[Tensor]) -> Result<Vec<Tensor>> {
    move |xs: &[Tensor]| {
        let mut h = xs[0].clone(); // (B, H, L, D): (1, 2, 7, 4) on the CPU
        for w in ws.chunks(4) {
            let (q, k, v) = (h.matmul(&w[0])?, h.matmul(&w[1])?, h.matmul(&w[2])?);
            let a = q.attention_fused(&k, &v, None, false, 0.5)?;
            h = a.matmul(&w[3])?.tanh()?.add(&h)?;
        }
        Ok(vec![h])
    }
}

fn attention_grads(mode: Option<Keep>) -> (Vec<u32>, Vec<Vec<u32>>, u64) {
    let x = randn(&[1, 2, 7, 4], 1).requires_grad_().unwrap();
    let ws: Vec<Tensor> = (0..8)
        .map(|i| randn(&[4, 4], 10 + i).requires_grad_().unwrap())
        .collect();
    let f = attention_block(ws.clone());
    let before = kept_reused();
    let out = match mode {
        None => f(std::slice::from_ref(&x)).unwrap(),
        Some(keep) => {
            checkpoint_keeping(std::slice::from_ref(&x), Arc::new(f), None, keep).unwrap()
        }
    };
    let loss = out[0]
        .mul(&randn(&[1, 2, 7, 4], 5))
        .unwrap()
        .sum_all()
        .unwrap();
    let grads = loss.backward().unwrap();
    let gx = bits(grads.get(&x).unwrap());
    let gw = ws.iter().map(|w| bits(grads.get(w).unwrap())).collect();
    (gx, gw, kept_reused() - before)
}

/// Selective recompute: a checkpoint that keeps attention outputs gives the gradients of the
/// resident run bit for bit, and its re-run takes both attention calls from the kept log
/// instead of running the kernel; without `Keep` the re-run computes them again.
#[test]
fn checkpoint_keeping_attention_equals_resident_and_skips_the_kernel() {
    let (gx, gw, reused) = attention_grads(None);
    assert_eq!(reused, 0);
    let (gx_none, gw_none, reused_none) = attention_grads(Some(Keep::NONE));
    assert_eq!(reused_none, 0, "nothing is kept without Keep");
    let (gx_keep, gw_keep, reused_keep) = attention_grads(Some(Keep {
        attention: true,
        ..Keep::NONE
    }));
    assert_eq!(
        reused_keep, 2,
        "both attention calls come from the kept log"
    );
    assert_eq!(gx, gx_none);
    assert_eq!(gw, gw_none);
    assert_eq!(gx, gx_keep);
    assert_eq!(gw, gw_keep);
}

/// A chain of small checkpointed blocks on `dev`, their inputs offloaded by `off` if given;
/// returns the gradients of the input and of every weight.
fn offload_chain(dev: &Device, off: Option<Arc<InputOffload>>, ahead: bool) -> Vec<Vec<u32>> {
    let x = randn_on(&[3, 37], 1, dev).requires_grad_().unwrap();
    let ws: Vec<Tensor> = (0..5)
        .map(|i| {
            randn_on(&[37, 37], 20 + i, dev)
                .affine(0.2, 0.0)
                .unwrap()
                .requires_grad_()
                .unwrap()
        })
        .collect();
    let cond = randn_on(&[3, 37], 9, dev); // an input without a gradient: never offloaded
    let exec = BlockExec {
        checkpointing: Checkpointing::All,
        offload: off,
        rerun_ahead: ahead,
        ..Default::default()
    };
    let mut h = x.clone();
    for (i, w) in ws.iter().enumerate() {
        let w = w.clone();
        h = exec
            .run(&format!("b{i}"), i, &[h, cond.clone()], move |xs| {
                Ok(vec![xs[0].matmul(&w)?.tanh()?.add(&xs[1])?])
            })
            .unwrap()
            .remove(0);
    }
    let grads = h.sqr().unwrap().sum_all().unwrap().backward().unwrap();
    let mut out = vec![bits(grads.get(&x).unwrap())];
    out.extend(ws.iter().map(|w| bits(grads.get(w).unwrap())));
    out
}

fn check_offload(dev: &Device) {
    let _helper = helper_alone();
    let plain = offload_chain(dev, None, false);
    let o = InputOffload::new(dev, 0);
    assert_eq!(offload_chain(dev, Some(o.clone()), false), plain);
    let r = o.report().unwrap();
    // Every block's activation input (not the shared condition) went out and came back; all
    // but the first needed (the last block's) were fetched ahead by the block after them.
    assert_eq!((r.packed, r.unpacked, r.prefetched), (5, 5, 4), "{r:?}");
    assert_eq!(r.packed_bytes, 5 * 3 * 37 * 4);
    // A second step recycles the host buffers the first one released.
    assert_eq!(offload_chain(dev, Some(o.clone()), false), plain);
    let r2 = o.report().unwrap();
    assert_eq!((r2.packed, r2.host_bytes), (10, r.host_bytes), "{r2:?}");
    // The inputs come back on the helper thread where re-runs are issued ahead.
    let taken = flame::autograd::ahead::taken();
    assert_eq!(offload_chain(dev, Some(o.clone()), true), plain);
    assert!(flame::autograd::ahead::taken() > taken);
    let r3 = o.report().unwrap();
    assert_eq!((r3.packed, r3.unpacked), (15, 15), "{r3:?}");
}

/// A chain of attention blocks on `dev`, every one checkpointed keeping its attention
/// outputs, their inputs (and with `off` built by `keeping_outputs`, their kept outputs)
/// offloaded by `off`; `None` for `keep`: the resident run. In bf16 and head dim 64 on a GPU
/// (its fused attention takes bf16 and f16, head dims 64 and 128), f32 and head dim 4 on the
/// CPU. Returns the gradients (as f32 bits) and how many kept outputs the re-runs reused.
fn offload_kept_chain(
    dev: &Device,
    keep: Option<Keep>,
    off: Option<Arc<InputOffload>>,
    ahead: bool,
) -> (Vec<Vec<u32>>, u64) {
    let dtype = if dev.is_cuda() {
        DType::BF16
    } else {
        DType::F32
    };
    // The fused attention's CUDA kernels take head dims 64 and 128.
    let d = if dev.is_cuda() { 64 } else { 4 };
    let rand = |shape: &[usize], seed: u64| randn_on(shape, seed, dev).to_dtype(dtype).unwrap();
    let x = rand(&[1, 2, 7, d], 1).requires_grad_().unwrap();
    let ws: Vec<Vec<Tensor>> = (0..3)
        .map(|b| {
            (0..8)
                .map(|i| {
                    rand(&[d, d], 10 + 8 * b + i)
                        .affine(1.0 / (d as f64).sqrt(), 0.0)
                        .unwrap()
                        .requires_grad_()
                        .unwrap()
                })
                .collect()
        })
        .collect();
    let exec = BlockExec {
        checkpointing: if keep.is_some() {
            Checkpointing::All
        } else {
            Checkpointing::Off
        },
        keep: keep.unwrap_or(Keep::NONE),
        offload: off,
        rerun_ahead: ahead,
        ..Default::default()
    };
    let before = kept_reused();
    let mut h = x.clone();
    for (i, w) in ws.iter().enumerate() {
        let f = attention_block(w.clone());
        h = exec
            .run(&format!("b{i}"), i, &[h], move |xs| f(xs))
            .unwrap()
            .remove(0);
    }
    let loss = h.mul(&rand(&[1, 2, 7, d], 5)).unwrap().sum_all().unwrap();
    let grads = loss.backward().unwrap();
    let f32_bits = |t: &Tensor| bits(&t.to_dtype(DType::F32).unwrap());
    let mut out = vec![f32_bits(grads.get(&x).unwrap())];
    out.extend(ws.iter().flatten().map(|w| f32_bits(grads.get(w).unwrap())));
    (out, kept_reused() - before)
}

fn check_offload_kept(dev: &Device) {
    let _helper = helper_alone();
    let attention = Keep {
        attention: true,
        ..Keep::NONE
    };
    let (resident, _) = offload_kept_chain(dev, None, None, false);
    let (kept_here, reused_here) = offload_kept_chain(dev, Some(attention), None, false);
    assert_eq!(kept_here, resident);
    assert_eq!(reused_here, 6, "two attention calls a block, three blocks");
    // Inputs alone offloaded: the kept outputs stay where they are.
    let inputs = InputOffload::new(dev, 0);
    let (g, reused) = offload_kept_chain(dev, Some(attention), Some(inputs.clone()), false);
    assert_eq!((g, reused), (resident.clone(), 6));
    assert_eq!(inputs.report().unwrap().packed, 3);
    // Kept outputs offloaded too: each block's input and its two attention calls' output
    // and log-sum-exp go out and come back, every one but the first the backward needs
    // fetched ahead by the unpack before it, none twice.
    let o = InputOffload::keeping_outputs(dev, 0);
    let (g, reused) = offload_kept_chain(dev, Some(attention), Some(o.clone()), false);
    assert_eq!((g, reused), (resident.clone(), 6));
    let r = o.report().unwrap();
    assert_eq!((r.packed, r.unpacked, r.prefetched), (15, 15, 14), "{r:?}");
    // Re-runs issued ahead on the helper thread unpack them there: the same values.
    let (g, reused) = offload_kept_chain(dev, Some(attention), Some(o.clone()), true);
    assert_eq!((g, reused), (resident, 6));
    let r2 = o.report().unwrap();
    assert_eq!((r2.packed, r2.unpacked), (30, 30), "{r2:?}");
}

#[test]
fn offloaded_kept_outputs_give_the_same_gradients_and_come_back_in_order() {
    check_offload_kept(&CPU);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn offloaded_kept_outputs_on_cuda_give_the_same_gradients() {
    #[cfg(feature = "cuda")]
    {
        let _one = cuda_alone();
        match Device::cuda(0) {
            Ok(gpu) => check_offload_kept(&gpu),
            Err(e) => eprintln!("skipping: no CUDA device ({e})"),
        }
    }
}

#[test]
fn offloaded_block_inputs_give_the_same_gradients_and_come_back_ahead() {
    check_offload(&CPU);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn offloaded_block_inputs_on_cuda_give_the_same_gradients() {
    #[cfg(feature = "cuda")]
    {
        let _one = cuda_alone();
        match Device::cuda(0) {
            Ok(gpu) => check_offload(&gpu),
            Err(e) => eprintln!("skipping: no CUDA device ({e})"),
        }
    }
}

/// The trainable `T` of a chain's `n` blocks, `d` x `d` each.
fn trained_chain(n: usize, d: usize, dev: &Device) -> Vec<Tensor> {
    (0..n)
        .map(|i| {
            randn_on(&[d, d], 60 + i as u64, dev)
                .affine(0.05, 0.0)
                .unwrap()
                .requires_grad_()
                .unwrap()
        })
        .collect()
}

/// A chain's frozen weights, block `i`'s adopted by `streamer` as its block `i` where one
/// streams them.
fn adopted(streamer: Option<&Arc<BlockStreamer>>, frozen: Vec<Tensor>) -> Vec<Tensor> {
    match streamer {
        Some(s) => frozen
            .iter()
            .enumerate()
            .map(|(i, w)| s.adopt(i, w).unwrap())
            .collect(),
        None => frozen,
    }
}

/// Four steps of a chain of eight blocks, each `tanh(h Wf + h T)` with `Wf` frozen and `T`
/// trainable, a forward under `no_grad` (a validation loss) before the last; with `reach`,
/// every `Wf` streams from host memory (prefetch 1) and the forward fetches up to
/// `reach[j]` while block `j` runs. Returns each step's gradients of the input and every
/// `T`, and, when streamed, the uploads counted when block 0's forward ran and at each
/// step's end, and the blocks on the device when block 0's forward ran.
type ChainRun = (Vec<Vec<Vec<u32>>>, Vec<(u64, u64)>, Vec<usize>);
fn streamed_chain(dev: &Device, reach: Option<Vec<usize>>) -> ChainRun {
    const N: usize = 8;
    let names: Vec<String> = (0..N).map(|i| format!("b{i}")).collect();
    let frozen: Vec<Tensor> = (0..N)
        .map(|i| {
            randn_on(&[37, 37], 40 + i as u64, dev)
                .affine(0.2, 0.0)
                .unwrap()
        })
        .collect();
    let trained = trained_chain(N, 37, dev);
    let streamer = reach.map(|r| {
        let s = BlockStreamer::new(dev, names.clone(), 1);
        s.set_reach(r).unwrap();
        s
    });
    let frozen = adopted(streamer.as_ref(), frozen);
    let exec = BlockExec {
        checkpointing: Checkpointing::All,
        streamer: streamer.clone(),
        ..Default::default()
    };
    // What the streamer reported in block 0's forward (not its re-run).
    let first = Arc::new(std::sync::Mutex::new(None::<flame::memory::StreamReport>));
    let forward = |x: &Tensor| {
        *first.lock().unwrap() = None;
        let mut h = x.clone();
        for (i, (wf, t)) in frozen.iter().zip(&trained).enumerate() {
            let (wf, t, s, at) = (wf.clone(), t.clone(), streamer.clone(), first.clone());
            h = exec
                .run(&names[i], i, &[h], move |xs| {
                    if let (0, Some(s)) = (i, &s) {
                        let mut at = at.lock().unwrap();
                        if at.is_none() {
                            *at = Some(s.report()?);
                        }
                    }
                    Ok(vec![xs[0].matmul(&wf)?.add(&xs[0].matmul(&t)?)?.tanh()?])
                })
                .unwrap()
                .remove(0);
        }
        h
    };
    let (mut grads, mut counts, mut resident) = (vec![], vec![], vec![]);
    for step in 0..4u64 {
        if step == 3 {
            let _g = flame::no_grad();
            forward(&randn_on(&[3, 37], 99, dev));
        }
        let x = randn_on(&[3, 37], 100 + step, dev)
            .requires_grad_()
            .unwrap();
        let h = forward(&x);
        let at_first = first.lock().unwrap().unwrap_or_default();
        let g = h.sqr().unwrap().sum_all().unwrap().backward().unwrap();
        let mut out = vec![bits(g.get(&x).unwrap())];
        out.extend(trained.iter().map(|t| bits(g.get(t).unwrap())));
        grads.push(out);
        if let Some(s) = &streamer {
            counts.push((at_first.uploads, s.report().unwrap().uploads));
            resident.push(at_first.resident);
        }
    }
    (grads, counts, resident)
}

fn check_deep_prefetch(dev: &Device) {
    let (plain, _, _) = streamed_chain(dev, None);
    // The shallow reach (prefetch 1): each pass leaves two blocks for the next. The first
    // step's forward uploads 8 (two by block 0's run), its backward 6; each later forward 6.
    // The validation forward uploads 6 (its last two stay); the training forward after it
    // finds them outside its window, releases them and uploads all 8.
    let shallow: Vec<usize> = (0..8).map(|j| (j + 1).min(7)).collect();
    let (got, counts, resident) = streamed_chain(dev, Some(shallow));
    assert_eq!(got, plain, "shallow");
    assert_eq!(counts, vec![(2, 14), (14, 26), (26, 38), (46, 58)]);
    assert_eq!(resident, vec![2; 4]);
    // Three ahead: block 0's forward has blocks 0-3 fetched, and the backward leaves four
    // (stream::carry), so each later forward uploads four; the validation forward releases
    // all but the last two, so the next forward uploads 8.
    let deep = vec![3, 4, 5, 6, 7, 7, 7, 7];
    assert_eq!(flame::memory::carry(&deep, 1), 4);
    let (got, counts, resident) = streamed_chain(dev, Some(deep));
    assert_eq!(got, plain, "deep");
    assert_eq!(counts, vec![(4, 14), (14, 24), (24, 34), (42, 52)]);
    assert_eq!(resident, vec![4; 4]);
}

#[test]
fn a_deeper_forward_fetch_leaves_blocks_for_the_next_step_and_the_same_gradients() {
    check_deep_prefetch(&CPU);
    // A reach must cover the prefetch, never fall, and stay within the blocks.
    let s = BlockStreamer::new(&CPU, (0..4).map(|i| format!("b{i}")).collect(), 1);
    for bad in [
        vec![1, 2, 3],
        vec![0, 2, 3, 3],
        vec![2, 2, 3, 4],
        vec![3, 2, 3, 3],
    ] {
        assert!(
            matches!(s.set_reach(bad.clone()), Err(Error::Stream(_))),
            "{bad:?}"
        );
    }
    // Block 0 may have all four: the backward keeps three (at block 1 it holds 1-3 and
    // fetches 0, four blocks, where the forward held three).
    s.set_reach(vec![3, 3, 3, 3]).unwrap();
    assert_eq!(s.carried().unwrap(), 3);
    // A prefetch past the blocks fetches them all and leaves them all for the next forward.
    let s = BlockStreamer::new(&CPU, (0..4).map(|i| format!("b{i}")).collect(), usize::MAX);
    assert_eq!(s.carried().unwrap(), 4);
    s.set_reach(vec![3, 3, 3, 3]).unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_deeper_forward_fetch_on_cuda_gives_the_same_gradients() {
    #[cfg(feature = "cuda")]
    {
        let _one = cuda_alone();
        check_deep_prefetch(&Device::cuda(0).expect("a CUDA GPU"));
    }
}

/// Six checkpointed blocks, each `tanh(x · W + x · T)` with a frozen bf16 `W` (96 x 96: coded
/// on the link) and a trained f32 `T`, over four steps with a validation forward (no
/// backward) before the last; with `stream`, every block streamed coded (prefetch 1, so the
/// backward leaves two for the next forward), with `raw` the backward's uploads uncoded.
/// The input's and the trained weights' gradients of each step (bits), the streamer's
/// report and the host memory its packs hold.
fn coded_chain(
    dev: &Device,
    stream: bool,
    cross: bool,
    raw: bool,
) -> (Vec<Vec<Vec<u32>>>, StreamReport, u64) {
    let t = coded_chain_traced(dev, stream, cross, raw);
    (t.grads, t.report, t.host)
}

/// `coded_chain`, every upload timed and its record kept (`BlockStreamer::trace_uploads`;
/// none on the CPU backend, which times nothing), and the compute work's waits for the
/// uploads (`BlockStreamer::take_stalls`).
fn coded_chain_traced(dev: &Device, stream: bool, cross: bool, raw: bool) -> Traced {
    const N: usize = 6;
    const D: usize = 96;
    let names: Vec<String> = (0..N).map(|i| format!("b{i}")).collect();
    let frozen: Vec<Tensor> = (0..N)
        .map(|i| {
            let v = bf16_patterns(D * D, 0.05, 80 + i as u64);
            let v: Vec<u16> = v
                .into_iter()
                .map(|b| {
                    if half::bf16::from_bits(b).is_finite() {
                        b
                    } else {
                        0
                    }
                })
                .collect();
            bf16_tensor(&v, dev).reshape((D, D)).unwrap()
        })
        .collect();
    let trained = trained_chain(N, D, dev);
    let streamer = stream.then(|| {
        let s = BlockStreamer::new(dev, names.clone(), 1);
        s.set_wire_code(true).unwrap();
        s.set_cross_ahead(cross).unwrap();
        s.set_raw_backward(raw).unwrap();
        s.trace_uploads(true).unwrap();
        s
    });
    let frozen = adopted(streamer.as_ref(), frozen);
    let exec = BlockExec {
        checkpointing: Checkpointing::All,
        streamer: streamer.clone(),
        ..Default::default()
    };
    let forward = |x: &Tensor| {
        let mut h = x.clone();
        for (i, (wf, t)) in frozen.iter().zip(&trained).enumerate() {
            let (wf, t) = (wf.clone(), t.clone());
            h = exec
                .run(&names[i], i, &[h], move |xs| {
                    let w = wf.to_dtype(DType::F32)?;
                    Ok(vec![xs[0].matmul(&w)?.add(&xs[0].matmul(&t)?)?.tanh()?])
                })
                .unwrap()
                .remove(0);
        }
        h
    };
    let mut grads = vec![];
    for step in 0..4u64 {
        if step == 3 {
            let _g = flame::no_grad();
            forward(&randn_on(&[3, D], 99, dev));
        }
        let x = randn_on(&[3, D], 100 + step, dev).requires_grad_().unwrap();
        let g = forward(&x)
            .sqr()
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let mut out = vec![bits(g.get(&x).unwrap())];
        out.extend(trained.iter().map(|t| bits(g.get(t).unwrap())));
        grads.push(out);
    }
    // (Reading the gradients waited for the device: every wait has passed.)
    let (report, host, trace, stalls) = match &streamer {
        Some(s) => (
            s.report().unwrap(),
            s.host_pack_bytes().unwrap(),
            s.take_trace().unwrap(),
            s.take_stalls().unwrap(),
        ),
        None => (StreamReport::default(), 0, vec![], vec![]),
    };
    Traced {
        grads,
        report,
        host,
        trace,
        stalls,
    }
}

/// What `coded_chain_traced` returns: each step's gradients (bits), the streamer's report,
/// the host memory its packs hold, the uploads' records and the compute work's waits.
struct Traced {
    grads: Vec<Vec<Vec<u32>>>,
    report: StreamReport,
    host: u64,
    trace: Vec<flame::memory::UploadRecord>,
    stalls: Vec<flame::memory::StallRecord>,
}

/// While a trace is kept, each wait of the compute work for a block's upload is recorded
/// with its pass: every block's in the first forward (nothing carried yet), the re-runs'
/// in the backwards, no more than the uploads made, none twice (a second take is empty).
fn check_stalls(dev: &Device) -> Vec<flame::memory::StallRecord> {
    let Traced {
        report: r, stalls, ..
    } = coded_chain_traced(dev, true, true, false);
    let blocks = |backward: bool| {
        stalls
            .iter()
            .filter(|w| w.backward == backward)
            .map(|w| w.block)
            .collect::<std::collections::BTreeSet<_>>()
    };
    assert_eq!(blocks(false), (0..6).collect(), "{stalls:?}");
    assert!(
        !blocks(true).is_empty() && blocks(true).iter().all(|&b| b < 6),
        "{stalls:?}"
    );
    assert!(stalls.len() as u64 <= r.uploads, "{stalls:?} {r:?}");
    stalls
}

#[test]
fn waits_for_uploads_are_recorded_pass_by_pass_on_the_cpu() {
    let stalls = check_stalls(&CPU);
    // The CPU backend's copies are done when made: nothing to wait for.
    assert!(stalls.iter().all(|w| w.ms == 0.0), "{stalls:?}");
}

/// On a GPU each recorded wait has its duration from the compute stream's events.
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a CUDA GPU"]
fn waits_for_uploads_are_recorded_pass_by_pass_on_cuda() {
    let _one = cuda_alone();
    let dev = Device::cuda(0).expect("a CUDA GPU");
    let stalls = check_stalls(&dev);
    assert!(
        stalls.iter().all(|w| w.ms.is_finite() && w.ms >= 0.0),
        "{stalls:?}"
    );
}

/// The backward's end crosses the next forward's first coded uploads into the staging ring
/// (the link and the ring idle until that forward's uploads): on the CPU backend, which has
/// no ring, nothing crosses and the gradients are the resident ones.
#[test]
fn coded_uploads_crossed_ahead_give_the_resident_gradients_on_the_cpu() {
    let (plain, ..) = coded_chain(&CPU, false, true, false);
    let (got, r, _) = coded_chain(&CPU, true, true, false);
    assert_eq!(got, plain);
    assert!(r.uploads > 0 && r.uploaded_bytes < r.decoded_bytes, "{r:?}");
    assert_eq!((r.crossed_bytes, r.landed_bytes), (0, 0), "{r:?}");
}

/// On a GPU each backward's end crosses the first blocks past the two it leaves into the
/// ring, and the next forward (a training one, or the validation one) decodes them where
/// they lie: the same gradients bit for bit, and every byte crossed either landed or was
/// copied again after another upload took its place.
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a CUDA GPU"]
fn coded_uploads_crossed_ahead_give_the_resident_gradients_on_cuda() {
    let _one = cuda_alone();
    let dev = Device::cuda(0).expect("a CUDA GPU");
    let (plain, ..) = coded_chain(&dev, false, true, false);
    let (got, r, _) = coded_chain(&dev, true, true, false);
    assert_eq!(got, plain);
    // Switched off, nothing crosses, and the gradients are the same.
    let (off, o, _) = coded_chain(&dev, true, false, false);
    assert_eq!(off, plain);
    assert_eq!((o.crossed_bytes, o.landed_bytes), (0, 0), "{o:?}");
    // Four backwards, each crossing at least the third block (a whole coded block fits the
    // ring); every forward after one lands it.
    assert!(r.crossed_bytes > 0 && r.landed_bytes > 0, "{r:?}");
    assert!(r.landed_bytes <= r.crossed_bytes, "{r:?}");
    let (_, cpu, _) = coded_chain(&CPU, true, true, false);
    // The link carried what the CPU's uploads would, the crossings that landed counted
    // once, those overwritten again; the GPU's packs add only alignment.
    assert!(
        r.uploaded_bytes >= cpu.uploaded_bytes
            && r.uploaded_bytes
                <= cpu.uploaded_bytes + (r.crossed_bytes - r.landed_bytes) + r.uploads * 8 * 256,
        "{r:?} against {cpu:?}"
    );
}

/// The backward's uploads uncoded, the forward's coded: the same gradients bit for bit as
/// resident and as every upload coded; the backward's uploads carry the raw bytes (more on
/// the link, nothing decoded), the forward's the code; the raw forms take host memory beside
/// the codes. Returns the raw run's report and its uploads' records.
fn check_raw_backward(dev: &Device) -> (StreamReport, Vec<flame::memory::UploadRecord>) {
    let (plain, ..) = coded_chain(dev, false, true, false);
    let (coded, c, coded_host) = coded_chain(dev, true, true, false);
    let Traced {
        grads: raw,
        report: r,
        host: raw_host,
        trace,
        ..
    } = coded_chain_traced(dev, true, true, true);
    assert_eq!(coded, plain);
    assert_eq!(raw, plain);
    // The same uploads, in the same places.
    assert_eq!(
        (r.uploads, r.decoded_bytes),
        (c.uploads, c.decoded_bytes),
        "{r:?} {c:?}"
    );
    // The backward's uploads cross raw: more bytes on the link, the forward's still fewer
    // than the values.
    assert!(r.uploaded_bytes > c.uploaded_bytes, "{r:?} against {c:?}");
    assert!(r.uploaded_bytes < r.decoded_bytes, "{r:?}");
    // Each block's raw form beside its code (its bytes on the device, as they are).
    assert!(raw_host > coded_host, "{raw_host} against {coded_host}");
    (r, trace)
}

#[test]
fn uncoded_backward_uploads_give_the_resident_gradients_on_the_cpu() {
    let (_, trace) = check_raw_backward(&CPU);
    // The CPU backend times nothing.
    assert!(trace.is_empty());
    // Chosen before the first fetch.
    let s = BlockStreamer::new(&CPU, vec!["b".into()], 1);
    let w = s
        .adopt(0, &randn_on(&[4], 1, &CPU).to_dtype(DType::BF16).unwrap())
        .unwrap();
    let exec = BlockExec {
        streamer: Some(s.clone()),
        ..Default::default()
    };
    exec.run("b", 0, &[randn_on(&[1], 2, &CPU)], move |_| {
        Ok(vec![w.to_dtype(DType::F32)?])
    })
    .unwrap();
    assert!(s.set_raw_backward(true).is_err());
}

/// On a GPU the backward's raw uploads cross the staging ring beside the forward's coded
/// ones, each piece copied into place from it (timed as a decode is), and the crossing at
/// each backward's end still lands.
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a CUDA GPU"]
fn uncoded_backward_uploads_give_the_resident_gradients_on_cuda() {
    let _one = cuda_alone();
    let dev = Device::cuda(0).expect("a CUDA GPU");
    let (r, trace) = check_raw_backward(&dev);
    assert!(r.crossed_bytes > 0 && r.landed_bytes > 0, "{r:?}");
    // Every upload traced: the raw ones (the backward's) staged, their copies into place
    // timed; an upload straight into place has none.
    let raw: Vec<_> = trace.iter().filter(|u| !u.coded).collect();
    assert!(!raw.is_empty() && raw.len() < trace.len(), "{trace:?}");
    assert!(
        raw.iter().all(|u| u.wire_bytes > 0 && u.decode_ms > 0.0),
        "{raw:?}"
    );
}

// ----- weights only the forward reads -------------------------------------------------------

/// The backward of a gradient that never arrives: an error, injected between two blocks.
struct Injected;

impl flame::autograd::CustomBackward for Injected {
    fn name(&self) -> &'static str {
        "injected"
    }
    fn backward(&self, _: &[Option<Tensor>], _: &mut Grads) -> Result<Vec<Option<Tensor>>> {
        Err(Error::Autograd("injected failure".into()))
    }
}

/// Six blocks `b.i`, each a Linear over a conditioning row (`mod`, 1 row: few rows) scaling a
/// Linear over 8 rows (`main`), LoRA on both.
struct Toy {
    blocks: Vec<(flame::nn::Linear, flame::nn::Linear)>,
    exec: BlockExec,
}

const TOY_BLOCKS: usize = 6;

impl Toy {
    fn new(vb: &VarBuilder) -> Result<Toy> {
        let blocks = (0..TOY_BLOCKS)
            .map(|i| {
                let b = vb.pp(format!("b.{i}"));
                Ok((
                    flame::nn::Linear::new(&b.pp("mod"), 32, 32, true)?,
                    flame::nn::Linear::new(&b.pp("main"), 32, 32, true)?,
                ))
            })
            .collect::<Result<_>>()?;
        Ok(Toy {
            blocks,
            exec: BlockExec::default(),
        })
    }

    /// The toy with random weights and LoRA on every Linear, every block checkpointed with
    /// the few-row outputs kept when `few`; with `streamed`, every block streamed (prefetch
    /// 1), the `mod` weights held on the host for their products when `host`.
    fn built(
        dev: &Device,
        streamed: bool,
        host: bool,
        few: bool,
    ) -> (Toy, Arc<Adapters>, Option<Arc<BlockStreamer>>) {
        let adapters = Adapters::new(LoraConfig {
            rank: 2,
            alpha: 2.0,
            dropout: 0.0,
            targets: vec!["b.*".into()],
            seed: 7,
        })
        .unwrap();
        let mut vb = VarBuilder::random(9, 0.3, DType::F32, dev)
            .with_adapters(adapters.clone())
            .unwrap();
        let prefixes: Vec<String> = (0..TOY_BLOCKS).map(|i| format!("b.{i}")).collect();
        let streamer = streamed.then(|| BlockStreamer::new(dev, prefixes, 1));
        if let Some(s) = &streamer {
            if host {
                s.set_host_products(vec!["mod.weight".into()]).unwrap();
            }
            vb = vb.with_host_weights(s.clone()).unwrap();
        }
        let mut toy = Toy::new(&vb).unwrap();
        toy.exec = BlockExec {
            checkpointing: Checkpointing::All,
            streamer: streamer.clone(),
            keep: Keep {
                few_rows: few,
                ..Keep::NONE
            },
            ..Default::default()
        };
        (toy, adapters, streamer)
    }

    /// The loss over `rows` conditioning rows (1: few; 8, one a row of the input: not); with
    /// `fail_after`, an op whose backward fails follows that block.
    fn loss(&self, dev: &Device, rows: usize, fail_after: Option<usize>) -> Result<Tensor> {
        self.loss_with(dev, randn_on(&[rows, 32], 60, dev), fail_after)
    }

    /// As `loss`, over the conditioning rows `c`.
    fn loss_with(&self, dev: &Device, c: Tensor, fail_after: Option<usize>) -> Result<Tensor> {
        let mut h = randn_on(&[8, 32], 61, dev);
        for (i, (m, l)) in self.blocks.iter().enumerate() {
            let (m, l) = (m.clone(), l.clone());
            let out = self
                .exec
                .run(&format!("b.{i}"), i, &[h, c.clone()], move |xs| {
                    let s = m.forward(&xs[1])?;
                    Ok(vec![l.forward(&xs[0])?.mul(&s)?.tanh()?])
                })?;
            h = out[0].clone();
            if fail_after == Some(i) {
                let y = h.detach();
                h = flame::autograd::custom_op(&[h], vec![y], Arc::new(Injected), true)?.remove(0);
            }
        }
        h.sqr()?.mean_all()
    }
}

/// Streamed blocks keeping their few-row outputs leave the conditioning Linears' weights out
/// of the backward's uploads, the gradients unchanged; a backward that fails midway leaves a
/// block on the device without them, which the next forward brings again, whole.
#[test]
fn forward_only_weights_stay_out_of_the_backward_and_come_back_for_the_forward() {
    let dev = &CPU;
    // A loss over `held` rows made first and held, steps of (conditioning rows, failing
    // block), then the step compared: the held loss and the losses over `rows` conditioning
    // rows each, summed (every forward before the backward).
    let grads =
        |streamed: bool, held: Option<usize>, steps: &[(usize, Option<usize>)], rows: &[usize]| {
            let (toy, adapters, streamer) = Toy::built(dev, streamed, false, true);
            if let Some(s) = &streamer {
                // The forward holds up to block 3 from the first: the block the failed backward
                // left (3) is inside its window, not released as outside it. The backward leaves
                // blocks 0-2 for the forward (whole) and brings block 3 without the conditioning
                // weights.
                s.set_reach(vec![3, 3, 3, 4, 5, 5]).unwrap();
                assert_eq!(s.carried().unwrap(), 3);
            }
            let held = held.map(|r| toy.loss(dev, r, None).unwrap());
            let mut left_out = vec![];
            for &(r, fail) in steps {
                let r = toy.loss(dev, r, fail).unwrap().backward();
                assert_eq!(r.is_err(), fail.is_some(), "{:?}", r.err());
                if let Some(s) = &streamer {
                    left_out.push(s.report().unwrap().left_out_bytes);
                }
            }
            let mut total = toy.loss(dev, rows[0], None).unwrap();
            if let Some(h) = held {
                total = h.add(&total).unwrap();
            }
            for &r in &rows[1..] {
                total = total.add(&toy.loss(dev, r, None).unwrap()).unwrap();
            }
            let g = total.backward().unwrap();
            if let Some(s) = &streamer {
                left_out.push(s.report().unwrap().left_out_bytes);
            }
            let named: Vec<(String, Vec<u32>)> = adapters
                .params()
                .unwrap()
                .into_iter()
                .map(|(n, p)| (n.clone(), bits(g.get(&p).unwrap())))
                .collect();
            (named, left_out)
        };
    // The streamed run's gradients against the resident one's (the same losses; the steps
    // before do not change the adapters), and its bytes left out after each backward.
    let compare =
        |what: &str, held: Option<usize>, steps: &[(usize, Option<usize>)], rows: &[usize]| {
            let (resident, _) = grads(false, held, &[], rows);
            let (streamed, left_out) = grads(true, held, steps, rows);
            assert_eq!(resident.len(), streamed.len());
            for ((n0, g0), (n1, g1)) in resident.iter().zip(&streamed) {
                assert_eq!(n0, n1);
                assert!(g0 == g1, "{what}: gradient of {n0} differs");
            }
            left_out
        };
    // A whole step (the re-runs find the conditioning Linears' weights unread), a step whose
    // backward fails after leaving out those weights, then the step compared.
    let left_out = compare(
        "after a failed backward",
        None,
        &[(1, None), (1, Some(3)), (1, None)],
        &[1],
    );
    assert_eq!(left_out[0], 0, "the first backward brings every weight");
    assert!(left_out[1] > 0 && left_out[2] > left_out[1], "{left_out:?}");
    // A step whose conditioning has as many rows as the input: its Linears no longer see
    // few rows, nothing is kept, their weights are read again in the re-run; the backward
    // must bring them although the steps before left them out.
    let left_out = compare(
        "after a change of rows",
        None,
        &[(1, None), (1, None)],
        &[8],
    );
    assert!(
        left_out[1] > 0 && left_out[2] == left_out[1],
        "{left_out:?}"
    );
    // Two forwards before their backward (two losses summed), the last like the steps
    // before: the first's re-runs read the weights, so the backward brings them.
    let left_out = compare(
        "two forwards of different digests",
        None,
        &[(1, None), (1, None)],
        &[8, 1],
    );
    assert!(
        left_out[1] > 0 && left_out[2] == left_out[1],
        "{left_out:?}"
    );
    // Two forwards of the same digest: the backward leaves the weights out for both.
    let left_out = compare(
        "two forwards of one digest",
        None,
        &[(1, None), (1, None)],
        &[1, 1],
    );
    assert!(left_out[2] > left_out[1], "{left_out:?}");
    // A forward held across another step: its re-runs read the weights the step's re-runs
    // left unread, so the blocks prefetched for the steps' digest are brought again whole.
    let left_out = compare("a forward held across a step", Some(8), &[(1, None)], &[1]);
    assert!(left_out[1] > left_out[0], "{left_out:?}");
}

/// The toy's streamed blocks holding their conditioning Linears' weights on the host
/// (`set_host_products`): those weights never cross (every upload brings the rest of a
/// block), the losses and gradients over two steps are the resident ones up to the order
/// of the f32 sums, with and without the few-row outputs kept, for one and eight
/// conditioning rows; an input that needs a gradient is refused.
fn check_host_products(dev: &Device) {
    let run = |host: bool, few: bool, rows: usize| {
        let (toy, adapters, streamer) = Toy::built(dev, host, host, few);
        let mut out = vec![];
        for _ in 0..2 {
            let loss = toy.loss(dev, rows, None).unwrap();
            let g = loss.backward().unwrap();
            out.push(loss.to_vec::<f32>().unwrap());
            for (_, p) in adapters.params().unwrap() {
                out.push(g.get(&p).unwrap().to_vec::<f32>().unwrap());
            }
        }
        if let Some(s) = &streamer {
            let r = s.report().unwrap();
            // Every block holds its `mod.weight` on the host; the uploads bring the rest
            // (`main`'s weight and both biases).
            assert_eq!(r.decoded_bytes, r.uploads * (32 * 32 + 64) * 4, "{r:?}");
            assert_eq!(
                s.host_product_bytes().unwrap(),
                (TOY_BLOCKS * 32 * 32 * 4) as u64
            );
            // One input a step, brought over by block 0's product; a product a block a
            // forward (the re-runs take theirs from the log when the few-row outputs are
            // kept).
            assert_eq!(r.host.inputs, 2, "{r:?}");
            let reruns = if few && rows == 1 { 0 } else { 1 };
            assert_eq!(
                r.host.products,
                2 * (1 + reruns) * TOY_BLOCKS as u64,
                "{r:?}"
            );
        }
        (out, toy)
    };
    for few in [true, false] {
        for rows in [1, 8] {
            let (want, _) = run(false, few, rows);
            let (got, _) = run(true, few, rows);
            assert_eq!(want.len(), got.len());
            for (w, g) in want.iter().zip(&got) {
                let scale = w.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-6);
                for (a, b) in w.iter().zip(g) {
                    assert!(
                        (a - b).abs() <= 1e-5 * scale,
                        "few {few}, rows {rows}: {a} against {b}"
                    );
                }
            }
        }
    }
    // A conditioning input that needs a gradient: the weight's backward would need it on the
    // device.
    let (_, toy) = run(true, true, 1);
    let c = randn_on(&[1, 32], 61, dev).requires_grad_().unwrap();
    match toy.loss_with(dev, c, None) {
        Err(Error::Stream(m)) => assert!(m.contains("host"), "{m}"),
        other => panic!("{:?}", other.map(|_| ())),
    }
}

/// The toy's host products announced ahead (`BlockStreamer::prepare_products`, between a
/// step's forward and its backward, as the trainer does): a forward whose conditioning has the
/// announced values (another tensor) takes the products computed ahead, one with other
/// values computes its own, and the losses and gradients of three steps are the same bits
/// as without announcements; an announcement before any weight is held does nothing.
fn check_products_ahead(dev: &Device) {
    let conds: Vec<Tensor> = (0..3).map(|k| randn_on(&[1, 32], 70 + k, dev)).collect();
    let run = |announce: bool| {
        let (toy, adapters, streamer) = Toy::built(dev, true, true, true);
        let s = streamer.unwrap();
        if announce {
            s.prepare_products(&conds[0]).unwrap();
        }
        let mut out = vec![];
        for (k, c) in conds.iter().enumerate() {
            let loss = toy.loss_with(dev, c.clone(), None).unwrap();
            if announce {
                // The next step's values in a tensor of their own; the third step's announced
                // wrong.
                let next = match k {
                    0 => conds[1].affine(1.0, 0.0).unwrap(),
                    _ => randn_on(&[1, 32], 90 + k as u64, dev),
                };
                s.prepare_products(&next).unwrap();
            }
            let g = loss.backward().unwrap();
            out.push(bits(&loss));
            for (_, p) in adapters.params().unwrap() {
                out.push(bits(g.get(&p).unwrap()));
            }
        }
        (out, s.report().unwrap().host)
    };
    let (want, plain) = run(false);
    let (got, ahead) = run(true);
    assert!(
        want == got,
        "the announced run's losses or gradients differ"
    );
    assert_eq!((plain.announced, plain.taken_ahead), (0, 0), "{plain:?}");
    // The first announcement came before the first fetch: no weight was held.
    assert_eq!((ahead.announced, ahead.taken_ahead), (3, 1), "{ahead:?}");
    assert_eq!(
        (ahead.inputs, ahead.products),
        (plain.inputs, plain.products)
    );
}

#[test]
fn host_products_announced_ahead_are_taken_by_the_forward_of_the_same_values() {
    check_products_ahead(&CPU);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn host_products_announced_ahead_on_cuda() {
    #[cfg(feature = "cuda")]
    {
        let _one = cuda_alone();
        check_products_ahead(&Device::cuda(0).expect("a CUDA GPU"));
    }
}

#[test]
fn host_held_conditioning_weights_never_cross_and_give_the_resident_gradients() {
    check_host_products(&CPU);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn host_held_conditioning_weights_on_cuda_give_the_resident_gradients() {
    #[cfg(feature = "cuda")]
    {
        let _one = cuda_alone();
        check_host_products(&Device::cuda(0).expect("a CUDA GPU"));
    }
}
