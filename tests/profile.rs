//! Kernel timing by category (`flame::profile`): scopes nest and restore; on a GPU every
//! kernel of a small forward and backward is filed once by kind, by phase (forward, or the
//! backward of the op it serves) and by name, and inside a scope under the scope too.

use flame::profile;

#[test]
fn nothing_is_recorded_without_a_gpu_kernel_and_scopes_restore() {
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
