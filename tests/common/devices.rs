//! The devices a suite runs on: the CPU always, and the first CUDA GPU where the crate is
//! built with CUDA (those tests are ignored without a GPU; `--include-ignored` runs them on a
//! GPU machine). `on_every_device!(f, g, ...)` makes, for each test body `fn f(dev: &Device)`,
//! the tests `f::cpu` and `f::cuda`.
//!
//! A result on a device is held to the CPU backend (the reference implementation) through
//! [`oracle`]: on the CPU, to the CPU backend in f64 (`Against::F64`), so the CPU's own
//! rounding is what is checked; on a GPU, to the CPU backend at the same dtype
//! (`Against::Cpu`), so a kernel is held to the reference the CPU suite holds to f64.
#![allow(dead_code, unused_macros, unused_imports)]

use super::tolerance::{tolerance, Against};
use flame::{DType, Device, Tensor};

/// Tests on one GPU share its memory counters: they run one at a time.
pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    static ONE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    ONE.lock().unwrap_or_else(|e| e.into_inner())
}

/// How a result in `dt` on `dev` is checked: the dtype the CPU reference computes in, and
/// the (atol, rtol) between them.
pub fn oracle(dev: &Device, dt: DType) -> (DType, (f64, f64)) {
    if dev.is_cuda() {
        (dt, tolerance(Against::Cpu, dt))
    } else {
        (DType::F64, tolerance(Against::F64, dt))
    }
}

/// Normal values rounded to `dt`: (the reference's copy on the CPU, in the dtype `oracle`
/// says, and the same values in `dt` on `dev`).
pub fn normal_pair(dev: &Device, shape: &[usize], dt: DType, seed: u64) -> (Tensor, Tensor) {
    let x = Tensor::randn(shape.to_vec(), DType::F64, &Device::Cpu, seed)
        .unwrap()
        .to_dtype(dt)
        .unwrap();
    let (rdt, _) = oracle(dev, dt);
    (x.to_dtype(rdt).unwrap(), x.to_device(dev).unwrap())
}

/// `got` (in `dt` on `dev`) against the reference `want` (on the CPU, from `oracle`):
/// |got - want| <= atol + rtol * max(|want|, mag) elementwise; NaN must match NaN. `mag`
/// scales the bound for sums of many terms, whose error follows the terms, not the result.
pub fn close_mag(what: &str, dev: &Device, got: &Tensor, want: &Tensor, dt: DType, mag: f64) {
    assert_eq!(got.dims(), want.dims(), "{what}: shapes");
    assert_eq!(got.dtype(), dt, "{what}: dtype");
    assert_eq!(got.device(), dev, "{what}: device");
    let (rdt, (atol, rtol)) = oracle(dev, dt);
    assert_eq!(want.dtype(), rdt, "{what}: the reference's dtype");
    let (gv, wv) = (got.to_vec_f64().unwrap(), want.to_vec_f64().unwrap());
    for (i, (a, b)) in gv.iter().zip(&wv).enumerate() {
        let ok =
            (a.is_nan() && b.is_nan()) || a == b || (a - b).abs() <= atol + rtol * b.abs().max(mag);
        assert!(ok, "{what} [{dt} on {dev}] element {i}: {a} against {b}");
    }
}

/// The tests `$name::cpu` and `$name::cuda` for each body `fn $name(dev: &Device)`.
#[allow(unused_macros)]
macro_rules! on_every_device {
    ($($name:ident),* $(,)?) => {$(
        mod $name {
            #[test]
            fn cpu() {
                super::$name(&flame::Device::Cpu)
            }

            #[cfg(feature = "cuda")]
            #[test]
            #[ignore = "needs a CUDA GPU"]
            fn cuda() {
                let _one = crate::common::devices::serial();
                super::$name(&flame::Device::cuda(0).expect("a CUDA GPU"))
            }
        }
    )*};
}
#[allow(unused_imports)]
pub(crate) use on_every_device;
