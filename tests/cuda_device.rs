//! The CUDA device: creation fails cleanly where CUDA is absent, and (on a GPU machine, run
//! with --include-ignored) the embedded fill kernel writes what the host reads back.
#![cfg(feature = "cuda")]

use flame::cuda::{driver_available, kernel_modules, kernels_compiled, CudaDevice};
use flame::{DType, Error};

#[test]
fn device_creation_reports_what_is_missing() {
    match (kernels_compiled(), driver_available(), CudaDevice::new(0)) {
        (false, _, Err(Error::CudaUnavailable(msg))) => {
            assert!(
                msg.contains("nvcc"),
                "the error must say how to get nvcc: {msg}"
            )
        }
        (true, false, Err(Error::CudaUnavailable(msg))) => {
            assert!(msg.contains("libcuda"), "{msg}")
        }
        // A driver without a usable GPU.
        (true, true, Err(Error::CudaUnavailable(msg))) => {
            assert!(msg.contains("opening GPU 0"), "{msg}")
        }
        (true, true, Ok(dev)) => assert_eq!(dev.ordinal(), 0),
        (k, d, r) => panic!("kernels {k}, driver {d}: unexpected {:?}", r.map(|_| ())),
    }
}

#[test]
fn build_embeds_the_fill_module_when_nvcc_is_present() {
    if kernels_compiled() {
        assert!(kernel_modules().any(|m| m == "fill"));
    } else {
        assert_eq!(kernel_modules().count(), 0);
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn fill_kernel_round_trip() {
    let dev = CudaDevice::new(0).expect("a GPU");
    for n in [1usize, 7, 1_000_003] {
        for (dtype, v) in [
            (DType::F32, -3.25),
            (DType::F64, 1.0 / 3.0),
            (DType::BF16, 2.5),
            (DType::F16, -0.125),
            (DType::U32, 77.0),
        ] {
            let host = dev
                .to_host(&dev.full(n, dtype, v).expect("fill"))
                .expect("copy back");
            assert_eq!(host.dtype(), dtype);
            let got = host.to_f64_vec();
            assert_eq!(got.len(), n);
            // Each value is exact in its dtype except 1/3 in f64, which is exact as f64.
            assert!(
                got.iter().all(|&x| x == v),
                "{dtype} n={n}: {:?}",
                &got[..got.len().min(4)]
            );
        }
    }
    // u32 saturates like the CPU's cast.
    let neg = dev
        .to_host(&dev.full(3, DType::U32, -5.0).expect("fill"))
        .expect("copy");
    assert_eq!(neg.to_f64_vec(), vec![0.0; 3]);
}
