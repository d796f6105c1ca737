//! GPU kernel throughput beside the device's measured copy ceiling (run on the GPU machine):
//!   bandwidth ops at 256 MiB per input: achieved GB/s and % of device-to-device copy GB/s;
//!   bf16 matmuls: TFLOP/s; an AdamW8bit step against AdamW's; Prodigy's, Adafactor's (fused
//!   and composite) and the moving average of the weights (fused and composite); the pieces
//!   of 8-bit products (row quantization, code transpose: GB/s; the FP8 GEMM: TFLOP/s); the
//!   host's cost of a small Linear with a bias (bf16, no gradient): `CALLS` issued one after
//!   another, µs a call, where its kernel is shorter than the host's issue.
//!   benches/torch_kernels.py times PyTorch on the same shapes.
//! Timed with the stream synchronised around `ITERS` launches after a warm-up.

mod common;

use flame::{DType, Device, Result, Tensor};

const MIB: usize = 1 << 20;
const ITERS: usize = 20;
/// Calls of the small Linear whose issue is timed (the host's cost a call).
const CALLS: usize = 4000;

fn time<R>(dev: &flame::cuda::CudaDevice, f: impl FnMut() -> Result<R>) -> Result<f64> {
    common::time(dev, 3, ITERS, f)
}

fn main() -> Result<()> {
    let dev = Device::cuda(0)?;
    let Device::Cuda(cuda) = &dev else {
        return Ok(());
    };
    let n = 256 * MIB / 4; // f32 elements per input

    // The ceiling: cuMemcpyDtoD of 256 MiB, read + write.
    let stream = cuda.stream();
    let src = stream
        .alloc_zeros::<u8>(256 * MIB)
        .map_err(|e| flame::Error::Cuda(format!("{e:?}")))?;
    let mut dst = stream
        .alloc_zeros::<u8>(256 * MIB)
        .map_err(|e| flame::Error::Cuda(format!("{e:?}")))?;
    let t = time(cuda, || {
        stream
            .memcpy_dtod(&src, &mut dst)
            .map_err(|e| flame::Error::Cuda(format!("{e:?}")))
    })?;
    let copy = 2.0 * (256 * MIB) as f64 / t / 1e9;
    println!("flame copy_d2d_256MiB          {copy:8.1} GB/s  100.0% (ceiling)");

    let a = Tensor::randn(n, DType::F32, &dev, 1)?;
    let b = Tensor::randn(n, DType::F32, &dev, 2)?;
    let rows = a.reshape((n / 1024, 1024))?;
    let report = |name: &str, bytes: usize, secs: f64| {
        let gbs = bytes as f64 / secs / 1e9;
        println!(
            "flame {name:<24} {gbs:8.1} GB/s  {:5.1}% of copy  ({:.3} ms)",
            100.0 * gbs / copy,
            secs * 1e3
        );
    };
    report("add_f32", 3 * 256 * MIB, time(cuda, || a.add(&b))?);
    report(
        "cast_f32_to_bf16",
        256 * MIB + 128 * MIB,
        time(cuda, || a.to_dtype(DType::BF16))?,
    );
    report(
        "sum_last_dim_f32",
        256 * MIB,
        time(cuda, || rows.sum_keepdim(&[1]))?,
    );
    report(
        "softmax_last_dim_f32",
        2 * 256 * MIB,
        time(cuda, || rows.softmax(1))?,
    );
    let ah = a.to_dtype(DType::BF16)?;
    let bh = b.to_dtype(DType::BF16)?;
    report("add_bf16", 3 * 128 * MIB, time(cuda, || ah.add(&bh))?);

    // One optimizer step of a bf16 parameter of 64 Mi values (one kernel launch for
    // AdamW8bit): bytes counted as the kernel's reads and writes (p, g, p', two code bytes in
    // and out; absmax is 1/64 of that) plus the assign of p' into p.
    {
        use flame::optim::{AdamConfig, AdamW, AdamW8bit, AdamW8bitConfig, Optimizer};
        let p = a.to_dtype(DType::BF16)?.requires_grad_()?;
        let mut grads = flame::Grads::new();
        grads.insert(&p, bh.clone());
        let c = AdamConfig::default();
        let mut o8 = AdamW8bit::new(
            vec![("p".into(), p.clone())],
            AdamW8bitConfig {
                adam: c,
                ..Default::default()
            },
        )?;
        report(
            "adamw8bit_step_bf16",
            n * (2 + 2 + 2 + 2 + 2 + 4),
            time(cuda, || o8.step(&grads))?,
        );
        drop(o8);
        let mut o32 = AdamW::new(vec![("p".into(), p.clone())], c)?;
        let secs = time(cuda, || o32.step(&grads))?;
        println!(
            "flame adamw_step_bf16 (composite, f32 state) {:.3} ms",
            secs * 1e3
        );
        drop(o32);
        // Prodigy: pass 1 reads p, g, p0, m, v, s and writes m, v, s; pass 2 reads p, m, v
        // and writes p (the reduction between them is one block over 2 x 16 Ki sums).
        let mut op = flame::optim::Prodigy::new(
            vec![("p".into(), p.clone())],
            flame::optim::ProdigyConfig::default(),
        )?;
        report(
            "prodigy_step_bf16",
            n * ((2 + 2 + 4 * 4 + 3 * 4) + (2 + 4 + 4 + 2)),
            time(cuda, || op.step(&grads))?,
        );
        drop(op);
        // Adafactor, factored (8192, 8192): the line sums read g twice, the update's sums
        // read g and p, the update reads g and p and writes p (R and C are 1/8192 of that).
        let pm = a
            .reshape((8192, n / 8192))?
            .to_dtype(DType::BF16)?
            .requires_grad_()?;
        let mut gm = flame::Grads::new();
        gm.insert(&pm, bh.reshape((8192, n / 8192))?.contiguous()?);
        let mut oa = flame::optim::Adafactor::new(
            vec![("p".into(), pm.clone())],
            flame::optim::AdafactorConfig::default(),
        )?;
        report(
            "adafactor_step_bf16",
            n * (2 * 2 + 2 * 2 + 3 * 2),
            time(cuda, || oa.step(&gm))?,
        );
        let secs = time(cuda, || oa.step_composite(&gm, 1.0))?;
        println!("flame adafactor_step_bf16 (composite) {:.3} ms", secs * 1e3);
        drop(oa);
        // The moving average of the weights: reads the f32 shadow and the bf16 weights,
        // writes the shadow.
        let ws = vec![("p".to_string(), pm.clone())];
        let mut ema = flame::train::ema::Ema::new(
            &ws,
            flame::train::ema::EmaSchedule {
                decay: 0.9999,
                min_decay: 0.0,
                update_after_step: 0,
                warmup: false,
                inv_gamma: 1.0,
                power: 2.0 / 3.0,
            },
            flame::train::config::EmaDevice::Gpu,
        )?;
        report(
            "ema_update_bf16",
            n * (4 + 2 + 4),
            time(cuda, || ema.update(&ws))?,
        );
        let secs = time(cuda, || ema.update_composite(&ws))?;
        println!("flame ema_update_bf16 (composite) {:.3} ms", secs * 1e3);
    }

    for (m, k, nn) in [(4096, 4096, 4096), (4608, 3072, 12288)] {
        let x = Tensor::randn((m, k), DType::BF16, &dev, 3)?;
        let w = Tensor::randn((k, nn), DType::BF16, &dev, 4)?;
        let secs = time(cuda, || x.matmul(&w))?;
        let tf = 2.0 * (m * k * nn) as f64 / secs / 1e12;
        println!(
            "flame matmul_bf16_{m}x{k}x{nn:<8} {tf:8.1} TFLOP/s ({:.3} ms)",
            secs * 1e3
        );
    }
    // The pieces of a Linear with 8-bit products at Flux's shapes (4608 tokens): the row
    // quantization of a bf16 input (reads 2 bytes a value, writes 1), with a column factor
    // (the backward's folded dy), the code transpose of a (12288, 3072) weight (reads and
    // writes 1 byte a value), and the scaled FP8 GEMM of (4608, 3072) by (3072, 3072)^T.
    for (rows, cols) in [(4608, 3072), (4608, 12288), (4608, 21504)] {
        let x = Tensor::randn((rows, cols), DType::BF16, &dev, 5)?;
        let col = Tensor::randn(cols, DType::F32, &dev, 6)?.abs()?;
        report(
            &format!("quant_rows_fp8_{rows}x{cols}"),
            rows * cols * 3,
            time(cuda, || x.quant_rows_fp8(None))?,
        );
        report(
            &format!("quant_rows_fp8_cols_{rows}x{cols}"),
            rows * cols * 3,
            time(cuda, || x.quant_rows_fp8(Some(&col)))?,
        );
    }
    {
        let w = Tensor::randn((12288, 3072), DType::BF16, &dev, 7)?;
        let (qw, _) = w.quant_rows_fp8(None)?;
        report(
            "transpose_fp8_12288x3072",
            2 * 12288 * 3072,
            time(cuda, || qw.transpose_fp8())?,
        );
        let x = Tensor::randn((4608, 3072), DType::BF16, &dev, 8)?;
        let w = Tensor::randn((3072, 3072), DType::BF16, &dev, 9)?;
        let ((qx, sx), (qw, sw)) = (x.quant_rows_fp8(None)?, w.quant_rows_fp8(None)?);
        let secs = time(cuda, || flame::fp8_product(&qx, &sx, &qw, &sw, DType::BF16))?;
        let tf = 2.0 * (4608.0 * 3072.0 * 3072.0) / secs / 1e12;
        println!(
            "flame fp8_product_4608x3072x3072 {tf:8.1} TFLOP/s ({:.3} ms)",
            secs * 1e3
        );
    }
    {
        let x = Tensor::randn((16usize, 64usize), DType::BF16, &dev, 10)?;
        let w = Tensor::randn((64usize, 64usize), DType::BF16, &dev, 11)?;
        let b = Tensor::randn(64usize, DType::BF16, &dev, 12)?;
        let mut best = f64::INFINITY;
        for _ in 0..3 {
            cuda.synchronize()?;
            let t = std::time::Instant::now();
            for _ in 0..CALLS {
                drop(x.matmul_bias(&w.t()?, &b)?);
            }
            best = best.min(t.elapsed().as_secs_f64());
        }
        cuda.synchronize()?;
        println!(
            "flame linear_bias_bf16_16x64x64 host {:8.2} us a call",
            best * 1e6 / CALLS as f64
        );
    }
    let mem = cuda.memory();
    println!(
        "flame memory: peak {} MiB, in use {} MiB",
        mem.peak / MIB as u64,
        mem.in_use / MIB as u64
    );
    Ok(())
}
