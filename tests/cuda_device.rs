//! The CUDA device: creation fails cleanly where CUDA is absent; on a GPU machine (run with
//! --include-ignored) memory accounting and its hard limit, the memory pool's cache and its
//! arena under a cap, tensors past 2 GiB, loads from a file's bytes, gradients across
//! devices and the TF32 switch work as documented.
#![cfg(feature = "cuda")]

#[cfg(feature = "cpu-ref")]
mod common;

#[cfg(feature = "cpu-ref")]
use common::devices::{close_mag, normal_pair};
use flame::cuda::{driver_available, kernel_modules, kernels_compiled, CudaDevice};
use flame::{DType, Device, Error, Tensor};
use std::sync::Mutex;

/// The device's byte counters are shared: tests that read them run one at a time.
static GPU: Mutex<()> = Mutex::new(());

fn gpu() -> Device {
    Device::cuda(0).expect("a CUDA GPU")
}

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
                "ggml",
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

/// The context gives its threads a small stack (CUDA's default of 1 KiB sets aside about
/// 200 MiB more of an H200), and kernels still run: the f32 LayerNorm backward's
/// parameter-gradient kernel, whose 200-byte stack frame is the largest of FLAME's, and a
/// cuBLAS GEMM.
#[cfg(feature = "cpu-ref")]
#[test]
#[ignore = "needs a CUDA GPU"]
fn threads_get_a_small_stack_and_kernels_still_run() {
    let _one = GPU.lock().unwrap_or_else(|e| e.into_inner());
    let Device::Cuda(cuda) = Device::cuda(0).expect("a GPU") else {
        unreachable!()
    };
    let stack = cuda.thread_stack_bytes().unwrap();
    assert!(stack > 0 && stack <= 256, "stack of {stack} bytes a thread");
    let dev = Device::Cuda(cuda.clone());
    let dt = DType::F32;
    let (xc, x) = normal_pair(&dev, &[37, 203], dt, 11);
    let (wc, w) = normal_pair(&dev, &[203], dt, 12);
    let (bc, b) = normal_pair(&dev, &[203], dt, 13);
    for t in [&x, &w, &b, &xc, &wc, &bc] {
        t.set_requires_grad(true).unwrap();
    }
    let run = |x: &Tensor, w: &Tensor, b: &Tensor| {
        let y = x.layer_norm(Some(w), Some(b), 1e-5).unwrap();
        let g = y.sqr().unwrap().sum_all().unwrap().backward().unwrap();
        let prod = x.matmul(&x.t().unwrap()).unwrap();
        (g.get(w).unwrap().clone(), g.get(b).unwrap().clone(), prod)
    };
    let (gw, gb, p) = run(&x, &w, &b);
    let (gwc, gbc, pc) = run(&xc, &wc, &bc);
    close_mag("LayerNorm's weight gradient", &dev, &gw, &gwc, dt, 37.0);
    close_mag("LayerNorm's bias gradient", &dev, &gb, &gbc, dt, 37.0);
    close_mag("a GEMM", &dev, &p, &pc, dt, 203.0);
    assert!(
        cuda.thread_stack_bytes().unwrap() <= 256,
        "no launch needed more stack"
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

#[cfg(feature = "cpu-ref")]
#[test]
#[ignore = "needs a CUDA GPU"]
fn gradients_flow_across_devices() {
    let _one = GPU.lock().unwrap_or_else(|e| e.into_inner());
    let x = Tensor::randn(37, DType::F32, &Device::Cpu, 9)
        .unwrap()
        .requires_grad_()
        .unwrap();
    let y = x
        .to_device(&gpu())
        .unwrap()
        .exp()
        .unwrap()
        .sum_all()
        .unwrap();
    let g = y.backward().unwrap();
    let gx = g.get(&x).expect("grad on the cpu leaf");
    assert!(!gx.device().is_cuda());
    let want = x.exp().unwrap().to_vec::<f32>().unwrap();
    for (a, b) in gx.to_vec::<f32>().unwrap().iter().zip(&want) {
        assert!((a - b).abs() <= 1e-6 * b.abs(), "{a} vs {b}");
    }
}

#[cfg(feature = "cpu-ref")]
#[test]
#[ignore = "needs a CUDA GPU"]
fn tensors_over_2_gib() {
    let _one = GPU.lock().unwrap_or_else(|e| e.into_inner());
    // 600M f32 = 2.4 GB: offsets past 2^31 bytes and 2^29 elements. rand is counter-based, so
    // both backends generate the same numbers without copying 2.4 GB.
    let n = 600_000_000usize;
    let dev = gpu();
    let g = Tensor::rand(n, DType::F32, &dev, 3)
        .unwrap()
        .affine(2.0, -1.0)
        .unwrap();
    let c = Tensor::rand(n, DType::F32, &Device::Cpu, 3)
        .unwrap()
        .affine(2.0, -1.0)
        .unwrap();
    let tail = n - 1_000;
    close_mag(
        "tail of a 2.4 GB tensor",
        &dev,
        &g.narrow(0, tail, 1_000).unwrap(),
        &c.narrow(0, tail, 1_000).unwrap(),
        DType::F32,
        0.0,
    );
    let (sg, sc) = (g.sum_all().unwrap(), c.sum_all().unwrap());
    close_mag("sum of 600M", &dev, &sg, &sc, DType::F32, 1.0);
    let mg = g.max_all().unwrap().to_scalar_f64().unwrap();
    assert_eq!(mg, c.max_all().unwrap().to_scalar_f64().unwrap());
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn training_steps_reuse_pool_memory() {
    let _one = GPU.lock().unwrap_or_else(|e| e.into_inner());
    use flame::optim::{AdamConfig, AdamW, Optimizer};
    let dev = gpu();
    let Device::Cuda(cuda) = &dev else {
        unreachable!()
    };
    let w = Tensor::randn((256, 256), DType::F32, &dev, 1)
        .unwrap()
        .requires_grad_()
        .unwrap();
    let x = Tensor::randn((64, 256), DType::F32, &dev, 2).unwrap();
    let mut opt = AdamW::new(vec![("w".into(), w.clone())], AdamConfig::default()).unwrap();
    let mut reserved = vec![];
    for _ in 0..6 {
        let loss = x
            .matmul(&w)
            .unwrap()
            .gelu()
            .unwrap()
            .sqr()
            .unwrap()
            .mean_all()
            .unwrap();
        let grads = loss.backward().unwrap();
        opt.step(&grads).unwrap();
        cuda.synchronize().unwrap();
        reserved.push((cuda.pool_reserved_bytes().unwrap(), cuda.memory().in_use));
    }
    // After the first steps warm the pool, the driver is asked for nothing more.
    assert_eq!(
        reserved[2], reserved[5],
        "pool (reserved, in use) per step: {reserved:?}"
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn freed_buffers_are_cached_and_handed_out_again() {
    let _one = GPU.lock().unwrap_or_else(|e| e.into_inner());
    let dev = gpu();
    let Device::Cuda(cuda) = &dev else {
        unreachable!()
    };
    // 1000 x 1000 f32: 4,000,000 bytes, counted as 4,000,256 (a multiple of 512).
    let rounded = 4_000_256u64;
    let a = Tensor::ones((1000, 1000), DType::F32, &dev).unwrap();
    cuda.synchronize().unwrap();
    let held = cuda.memory();
    drop(a);
    let freed = cuda.memory();
    assert_eq!(held.in_use - freed.in_use, rounded, "in use falls on drop");
    assert_eq!(freed.cached - held.cached, rounded, "the buffer is cached");
    let reserved = cuda.pool_reserved_bytes().unwrap();

    // The same size comes from the cache: no new driver memory, the cache shrinks back.
    let b = Tensor::full(2.5, (1000, 1000), DType::F32, &dev).unwrap();
    let again = cuda.memory();
    assert_eq!(again.cached, held.cached, "taken from the cache");
    assert_eq!(again.in_use, held.in_use);
    assert_eq!(again.allocations, freed.allocations + 1);
    assert_eq!(cuda.pool_reserved_bytes().unwrap(), reserved);
    // The reused memory holds what the new tensor wrote, not the old ones.
    let v = b.to_vec::<f32>().unwrap();
    assert!(v.iter().all(|&x| x == 2.5), "reused buffer rewritten");
    drop(b);

    // A near size (within the 512-byte rounding) shares the list; emptying returns it all.
    let c = Tensor::zeros(999_990, DType::F32, &dev).unwrap();
    assert_eq!(cuda.memory().cached, held.cached, "near size reused");
    drop(c);
    cuda.empty_cache();
    assert_eq!(
        cuda.memory().cached,
        0,
        "empty_cache returns every cached buffer"
    );
    assert_eq!(
        Tensor::ones(5, DType::BF16, &dev)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
            .to_vec::<f32>()
            .unwrap(),
        vec![1.0; 5],
        "the device works after emptying"
    );
}

/// Under a cap, buffers are cut from one arena of the cap's size (made at the first request):
/// small ones from the bottom by best fit (below the large ones first), large ones (32 MiB
/// and up) from the top, freed neighbours merged; a request no free range holds although the cap does goes to the driver,
/// counted as an overflow.
#[test]
#[ignore = "needs a CUDA GPU"]
fn under_a_cap_buffers_come_from_one_arena_small_below_large_above() {
    let _one = GPU.lock().unwrap_or_else(|e| e.into_inner());
    let dev = gpu();
    let Device::Cuda(cuda) = &dev else {
        unreachable!()
    };
    cuda.synchronize().unwrap();
    cuda.empty_cache();
    let mib = |n: usize| Tensor::full(n as f64, n << 18, DType::F32, &dev); // n MiB
    let before = cuda.memory();
    cuda.set_memory_limit(Some(before.in_use + (160 << 20)));
    // Small 16 MiB buffers from the bottom: [0, 16) [16, 32) [32, 48); a large 64 MiB one
    // from the top: [96, 160). Free: [48, 96).
    let (a, b, c) = (mib(16).unwrap(), mib(16).unwrap(), mib(16).unwrap());
    let big = mib(64).unwrap();
    drop(b);
    // Free: [16, 32) and [48, 96). 40 MiB (large) fits only the upper range, from its top.
    let d = mib(40).unwrap();
    // Free: [16, 32) and [48, 56). A small 8 MiB buffer takes the smallest range that holds
    // it, [48, 56), leaving [16, 32) whole for 16.
    let e = mib(8).unwrap();
    let f = mib(16).unwrap();
    assert_eq!(cuda.memory().overflows, before.overflows);
    // Nothing is free now; freeing a and c leaves two 16 MiB pieces: 24 MiB fits the cap but
    // no piece, so the driver serves it, counted.
    drop(a);
    drop(c);
    let g = mib(24).unwrap();
    assert_eq!(cuda.memory().overflows, before.overflows + 1);
    assert_eq!(
        cuda.memory().in_use,
        before.in_use + ((64 + 40 + 8 + 16 + 24) << 20)
    );
    // Freed neighbours merge: with g gone and f freed, [0, 48) is whole again.
    drop(g);
    drop(f);
    let h = mib(48).unwrap();
    assert_eq!(cuda.memory().overflows, before.overflows + 1);
    for (t, v) in [(&big, 64.0), (&d, 40.0), (&e, 8.0), (&h, 48.0)] {
        assert!(t.to_vec::<f32>().unwrap().iter().all(|&x| x == v));
    }
    drop((big, d, e, h));
    // A range a large buffer frees among large ones (a streamed block's, which the next one
    // takes) stays whole: small buffers take the smallest range below every live large one
    // first. Large [120, 160) and [56, 120), small [0, 8); free [8, 56).
    let l1 = mib(40).unwrap();
    let l2 = mib(64).unwrap();
    let a = mib(8).unwrap();
    // Freed: [120, 160), smaller than [8, 56) but above the large [56, 120). 16 MiB goes
    // below, [8, 24), so two large ones fit after it: [120, 160) and [24, 56).
    drop(l1);
    let b = mib(16).unwrap();
    let l3 = mib(40).unwrap();
    let l4 = mib(32).unwrap();
    assert_eq!(cuda.memory().overflows, before.overflows + 1);
    cuda.set_memory_limit(None);
    for (t, v) in [(&l2, 64.0), (&a, 8.0), (&b, 16.0), (&l3, 40.0), (&l4, 32.0)] {
        assert!(t.to_vec::<f32>().unwrap().iter().all(|&x| x == v));
    }
}

/// A cap lifted while no buffer lives in its arena gives the arena back: the next cap makes
/// its own of its size (the step bench caps, lifts and caps again in one process). Past the
/// first cap's arena every request went to the driver before.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_lifted_cap_gives_its_idle_arena_back() {
    let _one = GPU.lock().unwrap_or_else(|e| e.into_inner());
    let dev = gpu();
    let Device::Cuda(cuda) = &dev else {
        unreachable!()
    };
    cuda.synchronize().unwrap();
    cuda.empty_cache();
    let mib = |n: usize| Tensor::full(n as f64, n << 18, DType::F32, &dev); // n MiB
    let before = cuda.memory();
    cuda.set_memory_limit(Some(before.in_use + (64 << 20)));
    drop(mib(32).unwrap());
    assert!(cuda.memory().arena_room < u64::MAX, "the first cap's arena");
    cuda.set_memory_limit(None);
    assert_eq!(cuda.memory().arena_room, u64::MAX, "given back");
    cuda.set_memory_limit(Some(before.in_use + (256 << 20)));
    let big = mib(192).unwrap();
    assert_eq!(
        cuda.memory().overflows,
        before.overflows,
        "in the new arena"
    );
    assert!(big.to_vec::<f32>().unwrap().iter().all(|&x| x == 192.0));
    // A cap lifted while a buffer lives in the arena keeps it.
    cuda.set_memory_limit(None);
    assert!(cuda.memory().arena_room < u64::MAX, "kept while in use");
    drop(big);
    cuda.set_memory_limit(None);
    assert_eq!(cuda.memory().arena_room, u64::MAX);
}

#[cfg(feature = "cpu-ref")]
#[test]
#[ignore = "needs a CUDA GPU"]
fn tf32_matmul_is_opt_in() {
    let _one = GPU.lock().unwrap_or_else(|e| e.into_inner());
    let dev = gpu();
    let Device::Cuda(cuda) = &dev else {
        unreachable!()
    };
    let (ca, ga) = normal_pair(&dev, &[256, 512], DType::F32, 700);
    let (cb, gb) = normal_pair(&dev, &[512, 256], DType::F32, 701);
    let want = ca
        .to_dtype(DType::F64)
        .unwrap()
        .matmul(&cb.to_dtype(DType::F64).unwrap())
        .unwrap();
    let err = |t: &Tensor| {
        let d = t
            .to_device(&Device::Cpu)
            .unwrap()
            .to_dtype(DType::F64)
            .unwrap()
            .sub(&want)
            .unwrap();
        d.sqr()
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar_f64()
            .unwrap()
            .sqrt()
            / want
                .sqr()
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar_f64()
                .unwrap()
                .sqrt()
    };
    let exact = err(&ga.matmul(&gb).unwrap());
    cuda.set_allow_tf32(true).unwrap();
    let tf32 = err(&ga.matmul(&gb).unwrap());
    cuda.set_allow_tf32(false).unwrap();
    let again = err(&ga.matmul(&gb).unwrap());
    // f32: ~1e-7 relative; TF32 (10-bit mantissa inputs): ~1e-4 to 1e-3.
    assert!(
        exact < 1e-6 && again < 1e-6,
        "f32 error {exact}, after switching back {again}"
    );
    assert!(tf32 > 1e-5 && tf32 < 3e-3, "tf32 error {tf32}");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn the_default_budget_is_what_the_process_could_hold_at_start() {
    let _one = GPU.lock().unwrap_or_else(|e| e.into_inner());
    let dev = gpu();
    let Device::Cuda(cuda) = &dev else {
        unreachable!()
    };
    const MIB: u64 = 1 << 20;
    const GIB: u64 = 1 << 30;
    let at_start = cuda.memory_at_start().unwrap();
    let total = cuda.total_memory().unwrap();
    let free_now = total - cuda.device_memory_used().unwrap();
    assert!(
        at_start <= total && at_start >= free_now,
        "at start {at_start} bytes, {free_now} free now of {total}"
    );
    // What the process takes later does not move it: every phase plans within one figure.
    let t = Tensor::zeros((256 * MIB / 4) as usize, DType::F32, &dev).unwrap();
    assert_eq!(cuda.memory_at_start().unwrap(), at_start);
    assert_eq!(
        flame::memory::memory_at_start(&dev).unwrap(),
        Some(at_start)
    );
    let outside = cuda.held_for_budget().unwrap() + flame::memory::LATE_HEADROOM;
    assert_eq!(
        flame::memory::split_at_start(&dev).unwrap(),
        (Some(at_start - outside), Some(outside))
    );
    // A card of 80 GB or more decodes a 1024² image whole (about 6.8 GiB in bf16).
    use flame::train::images::{decode_bytes, encode_bytes, tile_now};
    let decode_1024 = decode_bytes(1024 * 1024, 128, DType::BF16);
    let whole_1024 = |dev: &Device| tile_now(0, false, dev, decode_1024).unwrap();
    if at_start > 60 * GIB {
        assert_eq!(whole_1024(&dev), 0, "{at_start} bytes at start");
    }
    // Under a budget the decode tiles whatever the memory; --vae-tile wins.
    assert_eq!(
        tile_now(0, true, &dev, decode_1024).unwrap(),
        flame::train::images::AUTO_TILE
    );
    assert_eq!(tile_now(256, false, &dev, decode_1024).unwrap(), 256);
    // A lower share (what ranks agreed on, a resumed run's record) replaces the device's own
    // for the rest of the process, and only lowers it: the tiles follow it. (No other test
    // of this binary reads the figure.)
    flame::memory::limit_share_at_start(&dev, GIB).unwrap();
    assert_eq!(flame::memory::split_at_start(&dev).unwrap().0, Some(GIB));
    assert_eq!(cuda.memory_at_start().unwrap(), GIB + outside);
    flame::memory::limit_share_at_start(&dev, 4 * GIB).unwrap();
    assert_eq!(flame::memory::split_at_start(&dev).unwrap().0, Some(GIB));
    assert_eq!(
        whole_1024(&dev),
        flame::train::images::AUTO_TILE,
        "a 1024² decode does not fit 1 GiB"
    );
    assert_eq!(
        tile_now(0, false, &dev, encode_bytes(1024 * 1024, 128, DType::BF16)).unwrap(),
        flame::train::images::AUTO_TILE
    );
    drop(t);
}

/// Values loaded from their little-endian bytes (as a file's mapped tensors are) come back
/// bit for bit: every dtype, none and odd counts, a source at an odd address, loads small
/// enough to copy as they are and loads of several pieces through the device's two
/// page-locked load buffers, issued one after another so that each buffer is refilled
/// while earlier copies may still be in flight.
#[test]
#[ignore = "needs a CUDA GPU"]
fn loads_from_bytes_come_back_bit_for_bit() {
    let _g = GPU.lock().unwrap_or_else(|e| e.into_inner());
    let dev = gpu();
    const PIECE: usize = 16 << 20;
    let mut raw = vec![0u8; 3 * PIECE + 64 * 1024 + 9];
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for b in raw.iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = (x >> 24) as u8;
    }
    // An odd address: a header whose length is no multiple of the element size.
    let src = &raw[1..];
    let cases = [
        (DType::BF16, 0),
        (DType::BF16, 3),
        (DType::F32, 1031),
        (DType::F16, (1 << 20) / 2 - 1),
        (DType::BF16, (1 << 20) / 2 + 7),
        (DType::F32, PIECE / 4),
        (DType::BF16, 3 * PIECE / 2 + 4099),
        (DType::U32, 5 * (1 << 20) / 4 + 3),
        (DType::F64, (3 * PIECE + 1000) / 8),
    ];
    let loaded: Vec<_> = cases
        .iter()
        .map(|&(dtype, n)| {
            let bytes = &src[..n * dtype.size_in_bytes()];
            (Tensor::from_le_bytes(bytes, dtype, n, &dev).unwrap(), bytes)
        })
        .collect();
    for ((t, bytes), (dtype, n)) in loaded.iter().zip(cases) {
        let back = t.to_host().unwrap();
        assert_eq!((back.dtype(), back.len()), (dtype, n));
        assert!(back.as_bytes() == *bytes, "{dtype:?} x {n}");
    }
    // A byte count that is no whole number of values, or not the shape's, is refused.
    assert!(Tensor::from_le_bytes(&src[..7], DType::F32, 2, &dev).is_err());
    assert!(Tensor::from_le_bytes(&src[..8], DType::F32, 3, &dev).is_err());
}
