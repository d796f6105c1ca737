//! The CUDA device: creation fails cleanly where CUDA is absent; on a GPU machine (run with
//! --include-ignored) memory accounting and its hard limit work as documented.
#![cfg(feature = "cuda")]

use flame::cuda::{driver_available, kernel_modules, kernels_compiled, CudaDevice};
use flame::{DType, Device, Error, Tensor};
use std::sync::Mutex;

/// The device's byte counters are shared: tests that read them run one at a time.
static GPU: Mutex<()> = Mutex::new(());

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
fn build_embeds_every_kernel_module_when_nvcc_is_present() {
    // Hopper variants (`<stem>_sm90`) exist only when the main target is below compute_90;
    // attention_wgmma is built for compute_90a alone, always.
    let mut found: Vec<_> = kernel_modules().filter(|m| !m.ends_with("_sm90")).collect();
    found.sort_unstable();
    if kernels_compiled() {
        assert_eq!(
            found,
            [
                "attention",
                "attention_wgmma",
                "conv",
                "elementwise",
                "fill",
                "fp8",
                "fused",
                "group_norm",
                "index",
                "multi_tensor",
                "norm",
                "norm_bulk",
                "random",
                "reduce",
                "softmax",
                "wire"
            ]
        );
    } else {
        assert!(found.is_empty());
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn fill_round_trip_every_dtype() {
    let _one = GPU.lock().unwrap_or_else(|e| e.into_inner());
    let dev = Device::cuda(0).expect("a GPU");
    for n in [1usize, 7, 1_000_003] {
        for (dtype, v) in [
            (DType::F32, -3.25),
            (DType::F64, 1.0 / 3.0),
            (DType::BF16, 2.5),
            (DType::F16, -0.125),
            (DType::U32, 77.0),
        ] {
            let got = Tensor::full(v, n, dtype, &dev)
                .unwrap()
                .to_vec_f64()
                .unwrap();
            assert_eq!(got.len(), n);
            // Each value is exact in its dtype.
            assert!(
                got.iter().all(|&x| x == v),
                "{dtype} n={n}: {:?}",
                &got[..got.len().min(4)]
            );
        }
    }
    // u32 saturates like the CPU's cast.
    assert_eq!(
        Tensor::full(-5.0, 3, DType::U32, &dev)
            .unwrap()
            .to_vec::<u32>()
            .unwrap(),
        vec![0; 3]
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn memory_accounting_and_hard_limit() {
    let _one = GPU.lock().unwrap_or_else(|e| e.into_inner());
    let Device::Cuda(cuda) = Device::cuda(0).expect("a GPU") else {
        unreachable!()
    };
    let dev = Device::Cuda(cuda.clone());
    let before = cuda.memory();
    let a = Tensor::zeros((1024, 1024), DType::F32, &dev).unwrap();
    let mid = cuda.memory();
    assert_eq!(mid.in_use - before.in_use, 4 << 20, "4 MiB buffer counted");
    assert!(mid.peak >= mid.in_use);
    drop(a);
    cuda.synchronize().unwrap();
    assert_eq!(cuda.memory().in_use, before.in_use, "freed on drop");

    // Under a 64 MiB limit a 128 MiB tensor is refused with the figures in the error.
    cuda.set_memory_limit(Some(before.in_use + (64 << 20)));
    let err = Tensor::zeros(32 << 20, DType::F32, &dev).unwrap_err();
    cuda.set_memory_limit(None);
    match &err {
        Error::OutOfMemory {
            requested, limit, ..
        } => {
            assert_eq!(*requested, 128 << 20);
            assert_eq!(*limit, before.in_use + (64 << 20));
        }
        other => panic!("expected OutOfMemory, got {other}"),
    }
    let msg = err.to_string();
    assert!(
        msg.contains("requested 134217728 bytes") && msg.contains("cap"),
        "{msg}"
    );
    // After the refusal the device still works.
    assert_eq!(
        Tensor::ones(3, DType::F32, &dev)
            .unwrap()
            .to_vec::<f32>()
            .unwrap(),
        vec![1.0; 3]
    );

    // A request larger than the GPU is an error too, not an abort.
    let huge = Tensor::zeros(1usize << 40, DType::F32, &dev).unwrap_err();
    assert!(matches!(huge, Error::OutOfMemory { .. }), "{huge}");
}
