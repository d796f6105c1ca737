//! Measuring the machine the planner's time model plays a step on (`Machine`): the host
//! link's rate for a streamed block's upload, through the streamer's own path (a page-locked
//! pack copied into one allocation), and the GPU's bf16 GEMM rate against the H100's the
//! model was calibrated on.

use crate::memory::Machine;
use crate::{Device, Result};

/// The bf16 GEMM rate of the H100 80GB the time model was calibrated on, TFLOP/s: cuBLAS at
/// 8192³ through `Tensor::matmul` (BENCHMARKS.md: 805.6 at 4096³ and 796.9 at Flux's
/// 4608 x 3072 @ 3072 x 12288; this probe's 8192³ GEMMs ran 782-792 on an H100).
pub const H100_GEMM_TFLOPS: f64 = 790.0;

/// Bytes of the probe upload: a Flux single block's streamed weights are about 230 MiB.
#[cfg(feature = "cuda")]
const PROBE_BYTES: usize = 256 << 20;

/// Uploads timed (the fastest counts).
#[cfg(feature = "cuda")]
const UPLOADS: usize = 6;

/// The GEMM's side (three 128 MiB bf16 operands: 1.1 TFLOP a product).
#[cfg(feature = "cuda")]
const PROBE_SIDE: usize = 8192;

/// What `measure_machine` measured, with the figures behind the `Machine`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MachineProbe {
    /// The machine the time model will play.
    pub machine: Machine,
    /// The bf16 GEMM rate measured, TFLOP/s.
    pub gemm_tflops: f64,
}

/// Measures the host link and the GPU of `device` (a quarter of a second or less on a GPU:
/// six 256 MiB uploads, the fastest counting, and six 8192³ bf16 GEMMs, the first a
/// warm-up); `None` on
/// the CPU backend, where nothing streams over a link. Needs about 640 MiB of device memory
/// for the moment it runs (the planner calls it before any weight is read).
pub fn measure_machine(device: &Device) -> Result<Option<MachineProbe>> {
    match device {
        #[cfg(feature = "cuda")]
        Device::Cuda(cuda) => measure_cuda(device, cuda).map(Some),
        #[allow(unreachable_patterns)]
        _ => Ok(None),
    }
}

#[cfg(feature = "cuda")]
fn measure_cuda(device: &Device, cuda: &crate::backend::cuda::CudaDevice) -> Result<MachineProbe> {
    use crate::{DType, Tensor};
    use std::time::Instant;
    const GIB: f64 = (1u64 << 30) as f64;
    let _g = crate::no_grad();
    // The link: one block's worth packed and uploaded as the streamer does.
    let pack = {
        let t = Tensor::zeros(PROBE_BYTES / 2, DType::BF16, device)?;
        let host = t.storage()?.stash(t.elem_count())?;
        device.pack(&[&host], false)?
    };
    // Each upload timed alone; the fastest counts: the first of a process ran at 38.6 GiB/s
    // where its steps' copies ran at 47.1 (H100).
    let upload = || -> Result<f64> {
        cuda.synchronize()?;
        let start = Instant::now();
        let (storages, ticket) = device.upload_pack(&pack, None, &[])?;
        device.wait(&ticket)?;
        cuda.synchronize()?;
        let secs = start.elapsed().as_secs_f64();
        drop(storages);
        Ok(PROBE_BYTES as f64 / GIB / secs)
    };
    let mut link = 0.0f64;
    for _ in 0..UPLOADS {
        link = link.max(upload()?);
    }
    drop(pack);
    // The GPU: square bf16 GEMMs, the step's dominant work.
    let a = Tensor::randn((PROBE_SIDE, PROBE_SIDE), DType::BF16, device, 1)?;
    let b = Tensor::randn((PROBE_SIDE, PROBE_SIDE), DType::BF16, device, 2)?;
    drop(a.matmul(&b)?);
    cuda.synchronize()?;
    const GEMMS: usize = 5;
    let start = Instant::now();
    for _ in 0..GEMMS {
        drop(a.matmul(&b)?);
    }
    cuda.synchronize()?;
    let flops = GEMMS as f64 * 2.0 * (PROBE_SIDE as f64).powi(3);
    let tflops = flops / start.elapsed().as_secs_f64() / 1e12;
    Ok(MachineProbe {
        machine: Machine {
            upload_gib_per_s: link,
            compute_scale: H100_GEMM_TFLOPS / tflops.max(1e-6),
        },
        gemm_tflops: tflops,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(feature = "cpu-ref")]
    #[test]
    fn the_cpu_has_no_link_to_measure() {
        assert_eq!(measure_machine(&Device::Cpu).unwrap(), None);
    }
}
