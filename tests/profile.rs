//! Kernel timing by category (`flame::profile`): scopes nest and restore; on a GPU every
//! kernel of a small forward and backward is filed once by kind, by phase (forward, or the
//! backward of the op it serves) and by name, and inside a scope under the scope too.

use flame::profile;
use std::sync::Mutex;

/// The profiler is one per process: the tests here take turns with it.
static PROFILER: Mutex<()> = Mutex::new(());

#[test]
fn nothing_is_recorded_without_a_gpu_kernel_and_scopes_restore() {
    let _turn = PROFILER.lock().unwrap_or_else(|e| e.into_inner());
    profile::enable(true);
    {
        let _a = profile::scope("outer");
        let _b = profile::scope("inner");
        let _c = profile::backward_op("matmul");
    }
    let p = profile::report().unwrap();
    profile::enable(false);
    assert!(p.kinds.is_empty() && p.scopes.is_empty() && p.phases.is_empty());
}

#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a GPU"]
fn gpu_kernels_are_filed_by_kind_scope_phase_and_name() {
    let _turn = PROFILER.lock().unwrap_or_else(|e| e.into_inner());
    use flame::{DType, Device, Tensor};
    let dev = Device::cuda(0).unwrap();
    let a = Tensor::randn((64, 32), DType::F32, &dev, 1)
        .unwrap()
        .requires_grad_()
        .unwrap();
    let b = Tensor::randn((32, 16), DType::F32, &dev, 2).unwrap();
    profile::enable(true);
    let y = {
        let _s = profile::scope("layer");
        a.matmul(&b).unwrap()
    };
    let loss = y.sum_all().unwrap();
    let _g = loss.backward().unwrap();
    let p = profile::report().unwrap();
    profile::enable(false);
    let find = |rows: &[profile::Row], k: &str| rows.iter().find(|r| r.category == k).cloned();
    let gemm = find(&p.kinds, "gemm").expect("a gemm row");
    assert_eq!(gemm.kernels, 2, "forward and the one input gradient: {p:?}");
    assert_eq!(find(&p.scopes, "layer").unwrap().kernels, 1, "{p:?}");
    assert!(find(&p.phases, "backward of matmul").is_some(), "{p:?}");
    let all = |rows: &[profile::Row]| rows.iter().map(|r| r.kernels).sum::<usize>();
    assert_eq!(all(&p.kinds), all(&p.phases));
    assert_eq!(all(&p.kinds), all(&p.kernels));
    assert_eq!(all(&p.kinds), all(&p.phase_kernels));
    assert!(p.kinds.iter().all(|r| r.ms >= 0.0));
}

/// A rank-r adapter's x A beside the base layer: x's gradient through A is added into the
/// base's by one GEMM with beta = 1 when the gradient sums come, with no add kernel, through
/// the reshape a linear layer makes of its rows, and equals the formed sum.
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a GPU"]
fn a_low_rank_input_gradient_is_summed_by_a_gemm_not_an_add() {
    let _turn = PROFILER.lock().unwrap_or_else(|e| e.into_inner());
    use flame::{DType, Device, Tensor};
    let dev = Device::cuda(0).unwrap();
    let r = |dims: &[usize], seed| {
        Tensor::randn(dims.to_vec(), DType::F32, &Device::Cpu, seed)
            .unwrap()
            .affine(0.2, 0.0)
            .unwrap()
    };
    let (x, w, bias, a, b) = (
        r(&[1, 64, 128], 1),
        r(&[256, 128], 2),
        r(&[256], 3),
        r(&[16, 128], 4),
        r(&[256, 16], 5),
    );
    let wts = r(&[64, 256], 6);
    let run = |dev: &Device, dtype: DType, profiled: bool| {
        let on = |t: &Tensor| t.to_device(dev).unwrap().to_dtype(dtype).unwrap();
        let x = on(&x).requires_grad_().unwrap();
        let (w, bias, a, b) = (on(&w), on(&bias), on(&a), on(&b));
        profile::enable(profiled);
        let x2 = x.reshape((64, 128)).unwrap();
        let y = x2
            .matmul_bias(&w.t().unwrap(), &bias)
            .unwrap()
            .add_matmul(&x2.matmul(&a.t().unwrap()).unwrap(), &b.t().unwrap())
            .unwrap();
        // A fixed weighting: x's gradient has two contributions, y's one (not y * y's two).
        let loss = y
            .to_dtype(DType::F32)
            .unwrap()
            .mul(&on(&wts).to_dtype(DType::F32).unwrap())
            .unwrap()
            .sum_all()
            .unwrap();
        let g = loss.backward().unwrap();
        let p = profiled.then(|| profile::report().unwrap());
        profile::enable(false);
        let gx = g
            .get(&x)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
            .to_vec::<f32>()
            .unwrap();
        (gx, p)
    };
    let (got, p) = run(&dev, DType::BF16, true);
    let p = p.unwrap();
    let sums: Vec<&profile::Row> = p
        .phase_kernels
        .iter()
        .filter(|r| r.category.starts_with("backward of gradient sums"))
        .collect();
    assert!(sums.iter().any(|r| r.category.contains("gemm")), "{sums:?}");
    assert!(!sums.iter().any(|r| r.category.contains("add")), "{sums:?}");
    let (want, _) = run(&Device::Cpu, DType::F32, false);
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    let err = got
        .iter()
        .zip(&want)
        .fold(0f32, |m, (g, w)| m.max((g - w).abs()));
    assert!(
        err <= 0.03 * scale,
        "x's gradient: max error {err} of {scale}"
    );
}

/// Two host threads launching onto the one stream while profiling (as re-runs issued ahead
/// do): every kernel is filed once, and each pair of events brackets its own kernel alone,
/// so the kernels' sum stays within the time the work took.
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a GPU"]
fn kernels_launched_from_two_threads_are_each_timed_alone() {
    let _turn = PROFILER.lock().unwrap_or_else(|e| e.into_inner());
    use flame::{DType, Device, Tensor};
    let dev = Device::cuda(0).unwrap();
    let Device::Cuda(cuda) = &dev else {
        unreachable!()
    };
    let a = Tensor::randn((512, 512), DType::BF16, &dev, 1).unwrap();
    const EACH: usize = 200;
    let chain = |a: &Tensor| {
        let mut h = a.clone();
        for _ in 0..EACH {
            h = h.matmul(a).unwrap().affine(0.04, 0.0).unwrap();
        }
        h
    };
    let _g = flame::no_grad();
    drop(chain(&a));
    cuda.synchronize().unwrap();
    profile::enable(true);
    let t = std::time::Instant::now();
    std::thread::scope(|s| {
        let helper = s.spawn(|| {
            let _g = flame::no_grad();
            chain(&a)
        });
        drop(chain(&a));
        drop(helper.join().unwrap());
    });
    cuda.synchronize().unwrap();
    let wall_ms = t.elapsed().as_secs_f64() * 1e3;
    let p = profile::report().unwrap();
    profile::enable(false);
    let find = |k: &str| p.kinds.iter().find(|r| r.category == k).cloned();
    let gemm = find("gemm").expect("a gemm row");
    assert_eq!(gemm.kernels, 2 * EACH, "{p:?}");
    let kernels_ms: f64 = p.kinds.iter().map(|r| r.ms).sum();
    assert!(
        kernels_ms <= wall_ms,
        "the kernels' sum {kernels_ms:.2} ms past the {wall_ms:.2} ms the work took"
    );
}
