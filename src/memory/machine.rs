//! Measuring the machine the planner's time model plays a step on (`Machine`): the rates of
//! the work a training step is made of, each timed through FLAME's own path: the host link
//! (a page-locked pack copied into one allocation, as the streamer uploads a block), bf16
//! GEMMs at a transformer Linear's shape, flash attention forward and backward at head
//! widths 64 and 128, elementwise work over device memory, the host's cost to issue a
//! recorded op and its backward, the decodes of coded and FP8 weights, and the host's
//! products of weights it holds.
//!
//! A measurement is kept per GPU in the cache folder (`machine_cache_path`) and reused while
//! the crate's version is the same, so runs on one machine plan alike, all but the host's
//! costs of issuing work, which are timed in each process (the host's pace moves between
//! processes where the GPU's rates do not); a run records the machine it planned with in its
//! output folder, and a resumed run plans with that one.

use crate::memory::Machine;
use crate::{Device, Error, Result};
use std::path::{Path, PathBuf};

/// Bytes of the probe upload: a Flux single block's streamed weights are about 230 MiB.
#[cfg(feature = "cuda")]
const PROBE_BYTES: usize = 256 << 20;

/// Repeats of each timed probe (the fastest counts: the first of a process ran its upload at
/// 38.6 GiB/s where its steps' copies ran at 47.1 on an H100).
#[cfg(feature = "cuda")]
const REPEATS: usize = 6;

/// What `measure_machine` measured: the machine, and where it came from.
#[derive(Clone, Debug, PartialEq)]
pub struct MachineProbe {
    /// The machine the time model will play.
    pub machine: Machine,
    /// The GPU's name as the driver gives it.
    pub gpu: String,
    /// Whether its GPU's and link's rates were read from the cache (`machine_cache_path`)
    /// rather than timed now (the host's costs are timed now either way).
    pub cached: bool,
}

/// The machine of `device`: read from the cache when a measurement of this GPU by this
/// version of FLAME is there, else measured (a few seconds on a GPU, about 2 GiB of
/// device memory for the moment it runs: the planner calls it before any weight is read)
/// and written to the cache (a cache that cannot be written is skipped). The host's costs
/// of issuing work (`Machine::op_us`, `backward_op_us`, `view_us`, `backward_view_us`,
/// `unrecorded_op_us`, `unrecorded_view_us`) are
/// timed now either way (a few milliseconds): the host's pace moves between processes on
/// one machine where the GPU's rates do not (the probe's op 4.1 µs in one process and 6.7
/// in another on H200 machines of one kind, SDXL's resident step 95-140 ms against 171-198),
/// and a pick made for another pace misses: SDXL within 4 GiB, planned at a cached 6.7 µs,
/// ran 1.31x of resident where the host kept that pace and 1.63x where it issued at about
/// 4.5. `None` on the CPU backend, where nothing streams over a link.
pub fn measure_machine(device: &Device) -> Result<Option<MachineProbe>> {
    match device {
        #[cfg(feature = "cuda")]
        Device::Cuda(cuda) => {
            let path = machine_cache_path(&cuda.name()?, cuda.ordinal());
            measure_machine_cached(device, path)
        }
        #[allow(unreachable_patterns)]
        _ => Ok(None),
    }
}

/// Host memory a plan may hold (`MemoryProfile::host_bytes`: the streamed weights' pinned
/// copies and packs, the backward's raw forms, offloaded inputs), for one of `processes`
/// processes planning on this machine at once (the ranks of a data-parallel run here): what
/// the kernel reports available now (`MemAvailable` in /proc/meminfo, Linux 3.14 on: free
/// memory and the page cache it can reclaim), no more than the memory cgroup still allows
/// (`cgroup_room`: a container's or a job's limit), less an eighth of it and 2 GiB for the
/// rest of the run (its data, caches and the text encoders while they cache), shared
/// evenly. `None` where /proc/meminfo cannot be read: the planner then leaves no plan out
/// for the host.
pub fn host_room(processes: usize) -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let mut available = mem_available(&text)?;
    if let Some(c) = cgroup_room() {
        available = available.min(c);
    }
    let room = available.saturating_sub(available / 8 + (2u64 << 30));
    Some(room / processes.max(1) as u64)
}

/// What this process's memory cgroup (v2, the namespace's root at /sys/fs/cgroup: a
/// container's or a job's limit) still allows: `memory.max` less `memory.current`, the
/// file cache it holds (`file` in `memory.stat`, which the kernel reclaims before it
/// refuses) given back. `None` without a limit or where the files cannot be read.
fn cgroup_room() -> Option<u64> {
    let read = |f: &str| std::fs::read_to_string(format!("/sys/fs/cgroup/{f}")).ok();
    let max: u64 = read("memory.max")?.trim().parse().ok()?;
    let current: u64 = read("memory.current")?.trim().parse().ok()?;
    let file = read("memory.stat")
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("file ")?.trim().parse::<u64>().ok())
        })
        .unwrap_or(0);
    Some(max.saturating_sub(current.saturating_sub(file)))
}

/// The `MemAvailable` entry of /proc/meminfo's `text`, bytes (the kernel writes it in kB).
pub fn mem_available(text: &str) -> Option<u64> {
    text.lines().find_map(|line| {
        let mut words = line.strip_prefix("MemAvailable:")?.split_whitespace();
        let n: u64 = words.next()?.parse().ok()?;
        match words.next() {
            Some("kB") => n.checked_mul(1024),
            _ => None,
        }
    })
}

/// [`measure_machine`] with the cache at `path` (`None`: no cache, measured every time).
pub fn measure_machine_cached(
    device: &Device,
    path: Option<PathBuf>,
) -> Result<Option<MachineProbe>> {
    match device {
        #[cfg(feature = "cuda")]
        Device::Cuda(cuda) => {
            let gpu = cuda.name()?;
            if let Some(machine) = path.as_deref().and_then(|p| read_machine(p).ok().flatten()) {
                return Ok(Some(MachineProbe {
                    machine: with_host_timed(device, cuda, machine)?,
                    gpu,
                    cached: true,
                }));
            }
            let machine = measure_cuda(device, cuda)?;
            if let Some(p) = &path {
                // A cache that cannot be written costs a measurement next time, nothing more.
                let _ = write_machine(p, &machine);
            }
            Ok(Some(MachineProbe {
                machine,
                gpu,
                cached: false,
            }))
        }
        #[allow(unreachable_patterns)]
        _ => {
            drop(path);
            Ok(None)
        }
    }
}

/// Where the measurement of GPU `gpu` at index `ordinal` is cached:
/// `$FLAME_CACHE_DIR`, else `$XDG_CACHE_HOME/flame`, else `$HOME/.cache/flame`, a file named
/// after the GPU; `None` where none of these is set.
pub fn machine_cache_path(gpu: &str, ordinal: usize) -> Option<PathBuf> {
    let var = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    let dir = var("FLAME_CACHE_DIR")
        .or_else(|| var("XDG_CACHE_HOME").map(|d| d.join("flame")))
        .or_else(|| var("HOME").map(|d| d.join(".cache").join("flame")))?;
    let name: String = gpu
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .collect();
    Some(dir.join(format!("machine-{name}-{ordinal}.toml")))
}

/// The rates a machine file holds, beside the crate's version: a file of another set (one
/// written before the 8-bit products' rates, FP8's or int8's, or the link's two directions at
/// once, were measured) is measured again.
const RATES: u32 = 4;

/// The version a machine file is written with and read back at.
fn file_version() -> String {
    format!("{}+rates{RATES}", env!("CARGO_PKG_VERSION"))
}

/// The machine written at `path` by `write_machine`, `None` when there is no file or it was
/// written by another version of FLAME or another set of rates (its kernels, and so its
/// rates, may differ); an error
/// for a file that is there but cannot be read as a machine.
pub fn read_machine(path: &Path) -> Result<Option<Machine>> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(Error::Io {
                path: path.to_path_buf(),
                source,
            })
        }
    };
    let file: MachineFile = toml::from_str(&text).map_err(|e| Error::Config {
        path: Some(path.to_path_buf()),
        msg: format!("not a machine measurement: {e}"),
    })?;
    if file.version != file_version() {
        return Ok(None);
    }
    file.machine.check().map_err(|msg| Error::Config {
        path: Some(path.to_path_buf()),
        msg,
    })?;
    Ok(Some(file.machine))
}

/// Writes `machine` to `path` (its folder made if missing), through a temporary file renamed
/// into place, so a reader never sees half a file.
pub fn write_machine(path: &Path, machine: &Machine) -> Result<()> {
    let io = |source: std::io::Error| Error::Io {
        path: path.to_path_buf(),
        source,
    };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(io)?;
    }
    let text = toml::to_string(&MachineFile {
        version: file_version(),
        machine: *machine,
    })
    .map_err(|e| Error::Config {
        path: Some(path.to_path_buf()),
        msg: format!("the machine could not be written: {e}"),
    })?;
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, text).map_err(io)?;
    std::fs::rename(&tmp, path).map_err(io)
}

#[derive(serde::Serialize, serde::Deserialize)]
struct MachineFile {
    version: String,
    machine: Machine,
}

#[cfg(feature = "cuda")]
fn measure_cuda(device: &Device, cuda: &crate::backend::cuda::CudaDevice) -> Result<Machine> {
    use crate::{DType, Tensor};
    use std::time::Instant;
    const GIB: f64 = (1u64 << 30) as f64;
    let sync = || cuda.synchronize();
    // The fastest of `REPEATS` runs of `f`, seconds, the device synchronised around each.
    let fastest = |f: &mut dyn FnMut() -> Result<()>| -> Result<f64> {
        f()?;
        let mut best = f64::INFINITY;
        for _ in 0..REPEATS {
            sync()?;
            let t = Instant::now();
            f()?;
            sync()?;
            best = best.min(t.elapsed().as_secs_f64());
        }
        Ok(best.max(1e-9))
    };
    let _g = crate::no_grad();
    // The link: one block's worth packed and uploaded as the streamer does.
    let host = {
        let t = Tensor::zeros(PROBE_BYTES / 2, DType::BF16, device)?;
        let host = t.storage()?.stash(t.elem_count())?;
        host
    };
    let pack = device.pack(&[&host], false)?;
    let link = PROBE_BYTES as f64
        / GIB
        / fastest(&mut || {
            let (storages, ticket) = device.upload_pack(&pack, None, &[], false, None)?;
            device.wait(&ticket)?;
            drop(storages);
            Ok(())
        })?;
    // Both ways at once: the same upload beside a copy of as many bytes out, as an offloaded
    // block input's leaves while the next blocks' weights come in; both directions' bytes
    // over the time of the pair.
    let duplex = {
        let out = Tensor::zeros(PROBE_BYTES / 2, DType::BF16, device)?;
        let mut reuse = None;
        2.0 * PROBE_BYTES as f64
            / GIB
            / fastest(&mut || {
                let (copy, sent) = out.storage()?.offload(out.elem_count(), reuse.take())?;
                let (storages, ticket) = device.upload_pack(&pack, None, &[], false, None)?;
                device.wait(&ticket)?;
                device.wait(&sent)?;
                drop(storages);
                reuse = Some(copy);
                Ok(())
            })?
    };
    drop(pack);
    drop(host);
    // GEMMs at a transformer block's Linears over 4096 tokens of a 3072-wide stream (Flux's:
    // the attention's projections and the MLP's two), each as the forward runs it (x · Wᵀ)
    // and as the input's gradient does (dy · W), after a warm-up long enough for the
    // clocks a step's sustained load runs at.
    let tokens = 4096usize;
    let shapes = [
        (3072usize, 9216usize),
        (3072, 3072),
        (3072, 12288),
        (12288, 3072),
    ];
    let mut operands = vec![];
    for (i, &(inp, out)) in shapes.iter().enumerate() {
        let seed = 10 + 3 * i as u64;
        operands.push((
            Tensor::randn((tokens, inp), DType::BF16, device, seed)?,
            Tensor::randn((out, inp), DType::BF16, device, seed + 1)?,
            Tensor::randn((tokens, out), DType::BF16, device, seed + 2)?,
        ));
    }
    let flops_once: f64 = shapes
        .iter()
        .map(|&(inp, out)| 2.0 * 2.0 * (tokens * inp * out) as f64)
        .sum();
    let block = || -> Result<()> {
        for (x, w, dy) in &operands {
            drop(x.matmul(&w.t()?)?);
            drop(dy.matmul(w)?);
        }
        Ok(())
    };
    for _ in 0..20 {
        block()?;
    }
    const BLOCKS: usize = 4;
    let gemm = flops_once * BLOCKS as f64
        / fastest(&mut || {
            for _ in 0..BLOCKS {
                block()?;
            }
            Ok(())
        })?
        / 1e12;
    // The same Linears' 8-bit products as `model.compute = "fp8"` and "int8" run them, on FP8
    // tensor cores (compute capability 8.9 and later) and int8 ones (7.5 and later), each
    // code measured apart: each weight quantized once (at load) with
    // its transposed codes kept; each product quantizes its input a token at a time, the
    // backward's its output gradient with the weight's row scales folded in. A failure
    // leaves the rate unmeasured (0: the bf16 GEMMs' rate is played), not the machine.
    let product = |code: crate::backend::fp8::Code8| {
        let cc = (
            cuda.compute_capability_major(),
            cuda.compute_capability_minor(),
        );
        let measure = || -> Result<f64> {
            let weights = operands
                .iter()
                .map(|(_, w, _)| {
                    let (q, s) = w.quant_rows8(code, None)?;
                    let t = q.transpose_fp8()?;
                    let ones = Tensor::ones(w.dims()[1], DType::F32, device)?;
                    Ok((q, s, t, ones))
                })
                .collect::<Result<Vec<_>>>()?;
            let products = || -> Result<()> {
                for ((x, _, dy), (q, s, t, ones)) in operands.iter().zip(&weights) {
                    let (qx, sx) = x.quant_rows8(code, None)?;
                    drop(crate::product8(code, &qx, &sx, q, s, DType::BF16)?);
                    let (qg, sg) = dy.quant_rows8(code, Some(s))?;
                    drop(crate::product8(code, &qg, &sg, t, ones, DType::BF16)?);
                }
                Ok(())
            };
            for _ in 0..5 {
                products()?;
            }
            let secs = fastest(&mut || {
                for _ in 0..BLOCKS {
                    products()?;
                }
                Ok(())
            })?;
            Ok(flops_once * BLOCKS as f64 / secs / 1e12)
        };
        if cc >= code.min_compute_capability() {
            measure().unwrap_or(0.0)
        } else {
            0.0
        }
    };
    let fp8_product = product(crate::backend::fp8::Code8::E4m3);
    let int8_product = product(crate::backend::fp8::Code8::Int8);
    // Coded weights (normal values, as trained weights are) uploaded while the compute runs
    // a step's kinds of work, each alone: GEMMs, attention (forward and backward) and
    // elementwise sums over a block's activation size. Beside each: the decodes' rate (their
    // events) and what they take from the work.
    let coded = {
        let t = Tensor::randn(PROBE_BYTES / 2, DType::BF16, device, 3)?.affine(0.02, 0.0)?;
        let host = {
            let s = t.storage()?;
            s.stash(t.elem_count())?
        };
        drop(t);
        device.pack(&[&host], true)?
    };
    let (wire, part, pieces) = coded.staging_bytes();
    let staging = device.staging(wire, part, pieces)?;
    // Four uploads in a row beside enough of the work to outlast them (`units` of it, about
    // 60 ms), against the same work alone; the median of the runs (a millisecond's noise in
    // the work would read as several a GiB on one upload's decodes).
    // Returns the decodes' rate, what they take from the work (ms a GiB), and the coded
    // uploads' rate on the link (their copies' own time).
    let decodes_beside = |units: usize, work: &dyn Fn() -> Result<()>| -> Result<(f64, f64, f64)> {
        const UPLOADS: usize = 4;
        let median = |mut v: Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        work()?;
        let mut alone = vec![];
        let (mut decode, mut with, mut copies) = (vec![], vec![], vec![]);
        for _ in 0..=REPEATS {
            sync()?;
            let t = Instant::now();
            for _ in 0..units {
                work()?;
            }
            sync()?;
            alone.push(t.elapsed().as_secs_f64());
            let t = Instant::now();
            work()?;
            let mut uploads = vec![];
            for _ in 0..UPLOADS {
                uploads.push(device.upload_pack(&coded, staging.as_ref(), &[], true, None)?);
            }
            for _ in 1..units {
                work()?;
            }
            for (_, ticket) in &uploads {
                ticket.wait_host()?;
            }
            sync()?;
            with.push(t.elapsed().as_secs_f64());
            let times: Option<Vec<(f64, f64, f64)>> =
                uploads.iter().map(|(_, ticket)| ticket.copy_ms()).collect();
            if let Some(times) = times {
                let link: f64 = times.iter().map(|c| c.0).sum();
                let ms: f64 = times.iter().map(|c| c.2).sum();
                if ms > 0.0 && link > 0.0 {
                    decode.push(ms / 1e3);
                    copies.push(link / 1e3);
                }
            }
        }
        let (alone, with) = (median(alone), median(with));
        let gib = (UPLOADS * wire) as f64 / GIB;
        Ok(if !decode.is_empty() && gib > 0.0 {
            (
                gib / median(decode),
                ((with - alone) * 1e3 / gib).max(0.0),
                gib / median(copies),
            )
        } else {
            // Nothing was coded (or timed): no decodes for the model to play, and coded
            // uploads cross as plain ones.
            (f64::INFINITY, 0.0, link)
        })
    };
    // About 2.5 ms of GEMMs a unit on an H100.
    let beside_gemms = decodes_beside(24, &block)?;
    // Flux's attention (24 heads of 128 over 4096 tokens), forward and backward: about
    // 1.2 ms a unit.
    let beside_attention = {
        let shape = (1usize, 24usize, 4096usize, 128usize);
        let q = Tensor::randn(shape, DType::BF16, device, 30)?.requires_grad_()?;
        let kk = Tensor::randn(shape, DType::BF16, device, 31)?.requires_grad_()?;
        let v = Tensor::randn(shape, DType::BF16, device, 32)?.requires_grad_()?;
        decodes_beside(50, &|| {
            let _on = crate::autograd::enable_grad();
            let o = crate::tensor::scaled_dot_product_attention(&q, &kk, &v, None, false, None)?;
            drop(o.sum_all()?.backward()?);
            Ok(())
        })?
    };
    // Sums over a block's activation size (Flux's 4608 x 3072 in bf16): about 1.2 ms of
    // memory traffic a unit of 40.
    let beside_memory = {
        let n = 4608 * 3072;
        let x = Tensor::randn(n, DType::BF16, device, 33)?;
        let y = Tensor::randn(n, DType::BF16, device, 34)?;
        decodes_beside(50, &|| {
            for _ in 0..40 {
                drop(x.add(&y)?);
            }
            Ok(())
        })?
    };
    drop((staging, coded));
    let wire_decode = [beside_gemms.0, beside_attention.0, beside_memory.0];
    let decode_cost = [beside_gemms.1, beside_attention.1, beside_memory.1];
    // The coded uploads' rate on the link, the median of the three probes.
    let coded_link = {
        let mut v = [beside_gemms.2, beside_attention.2, beside_memory.2];
        v.sort_by(f64::total_cmp);
        v[1]
    };
    drop(operands);
    // Convolutions: a 3x3 one of 640 channels over 64 x 64 positions (SDXL's middle
    // level), forward and the input's gradient, through FLAME's own path.
    let conv = {
        let x = Tensor::randn(
            (1usize, 640usize, 64usize, 64usize),
            DType::BF16,
            device,
            20,
        )?
        .requires_grad_()?;
        let w = Tensor::randn(
            (640usize, 640usize, 3usize, 3usize),
            DType::BF16,
            device,
            21,
        )?;
        let flops = 2.0 * 2.0 * 64.0 * 64.0 * 640.0 * 640.0 * 9.0;
        flops
            / fastest(&mut || {
                let _on = crate::autograd::enable_grad();
                let y = crate::nn::conv2d(&x, &w, None, (1, 1), (1, 1), (1, 1), 1)?;
                drop(y.sum_all()?.backward()?);
                Ok(())
            })?
            / 1e12
    };
    // Elementwise work on operands of a block's activation size (28 MiB, Flux's 4608 x 3072
    // in bf16), many in a row: each sum reads two and writes a third.
    const SUMS: usize = 40;
    let n = 4608 * 3072;
    let x = Tensor::randn(n, DType::BF16, device, 4)?;
    let y = Tensor::randn(n, DType::BF16, device, 5)?;
    let memory = SUMS as f64 * 3.0 * (2 * n) as f64
        / GIB
        / fastest(&mut || {
            for _ in 0..SUMS {
                drop(x.add(&y)?);
            }
            Ok(())
        })?;
    drop((x, y));
    // Attention at 4096 tokens over a 3072-wide stream (heads of 128) and a 2048-wide one
    // (heads of 64): forward, then forward and backward (FLOPs 4·B·H·L²·D forward, 2.5x that
    // backward, as FlashAttention counts them).
    let attention = |heads: usize, d: usize| -> Result<(f64, f64)> {
        let l = 4096usize;
        let shape = (1usize, heads, l, d);
        let q = Tensor::randn(shape, DType::BF16, device, 6)?;
        let kk = Tensor::randn(shape, DType::BF16, device, 7)?;
        let v = Tensor::randn(shape, DType::BF16, device, 8)?;
        let flops = 4.0 * (heads * l * l * d) as f64;
        let fwd = fastest(&mut || {
            drop(crate::tensor::scaled_dot_product_attention(
                &q, &kk, &v, None, false, None,
            )?);
            Ok(())
        })?;
        let (q, kk, v) = (
            q.requires_grad_()?,
            kk.requires_grad_()?,
            v.requires_grad_()?,
        );
        let both = fastest(&mut || {
            let _on = crate::autograd::enable_grad();
            let o = crate::tensor::scaled_dot_product_attention(&q, &kk, &v, None, false, None)?;
            drop(o.sum_all()?.backward()?);
            Ok(())
        })?;
        // The backward's time: the pair's less the forward's (the sum's is negligible).
        let bwd = (both - fwd).max(fwd * 1e-3);
        Ok((flops / fwd / 1e12, 2.5 * flops / bwd / 1e12))
    };
    let (a64, b64) = attention(32, 64)?;
    let (a128, b128) = attention(24, 128)?;
    // FP8 codes decoded to bf16: a 3072 x 12288 weight (four codes a word).
    let (rows, cols) = (12288usize, 3072usize);
    let codes = Tensor::zeros(
        (rows, cols / crate::backend::fp8::CODES_PER_WORD),
        DType::U32,
        device,
    )?;
    let scale = Tensor::ones(rows, DType::F32, device)?;
    let fp8_decode = (rows * cols) as f64
        / GIB
        / fastest(&mut || {
            drop(codes.dequant_fp8(&scale, DType::BF16)?);
            Ok(())
        })?;
    drop((codes, scale));
    let machine = with_host_timed(
        device,
        cuda,
        Machine {
            upload_gib_per_s: link,
            coded_upload_gib_per_s: coded_link,
            duplex_gib_per_s: duplex,
            gemm_tflops: gemm,
            conv_tflops: conv,
            attention_tflops: [a64, a128],
            attention_backward_tflops: [b64, b128],
            memory_gib_per_s: memory,
            wire_decode_gib_per_s: wire_decode,
            wire_decode_cost_ms_per_gib: decode_cost,
            fp8_decode_gib_per_s: fp8_decode,
            fp8_product_tflops: fp8_product,
            int8_product_tflops: int8_product,
            host_product_gib_per_s: crate::memory::products::measure_rate(),
            // The host's costs: timed by `with_host_timed`.
            ..Machine::REFERENCE
        },
    )?;
    machine.check().map_err(Error::Stream)?;
    Ok(machine)
}

/// `m` with the host's costs of issuing recorded work timed now (`Machine::op_us`,
/// `backward_op_us`, `view_us`, `backward_view_us`): chains of small recorded ops (their
/// kernels take less than the host's issue), issued, then their backward; ops that launch
/// work (a scale and a product), then views (a reshape and a transpose). The same chains
/// issued recording nothing (`unrecorded_op_us`, `unrecorded_view_us`: a checkpointed
/// block's forward). The fastest of `REPEATS` each.
#[cfg(feature = "cuda")]
fn with_host_timed(
    device: &Device,
    cuda: &crate::backend::cuda::CudaDevice,
    m: Machine,
) -> Result<Machine> {
    use crate::{DType, Tensor};
    use std::time::Instant;
    let sync = || cuda.synchronize();
    let _g = crate::no_grad();
    // `record`: the chain recorded and its backward timed; else issued recording nothing (a
    // checkpointed block's forward), no backward.
    let chain = |views: bool, record: bool| -> Result<(f64, f64)> {
        const OPS: usize = 400;
        let w = Tensor::ones((16usize, 16usize), DType::BF16, device)?.requires_grad_()?;
        let mut best = (f64::INFINITY, f64::INFINITY);
        for _ in 0..=REPEATS {
            let _on = record.then(crate::autograd::enable_grad);
            sync()?;
            let t = Instant::now();
            let mut h = w.affine(1.0, 0.0)?;
            for _ in 0..OPS / 2 {
                h = if views {
                    h.reshape(256usize)?.reshape((16usize, 16usize))?.t()?
                } else {
                    h.affine(1.0, 0.0)?.mul(&w)?
                };
            }
            let issued = t.elapsed().as_secs_f64();
            if !record {
                drop(h);
                best.0 = best.0.min(issued);
                continue;
            }
            let loss = h.sum_all()?;
            sync()?;
            let t = Instant::now();
            drop(loss.backward()?);
            sync()?;
            let back = t.elapsed().as_secs_f64();
            best = (best.0.min(issued), best.1.min(back));
        }
        // A view pair is three views here (two reshapes and a transpose).
        let per = if views { 1.5 * OPS as f64 } else { OPS as f64 };
        Ok((best.0 * 1e6 / per, best.1 * 1e6 / per))
    };
    let (op_us, backward_op_us) = chain(false, true)?;
    let (view_us, backward_view_us) = chain(true, true)?;
    let (unrecorded_op_us, _) = chain(false, false)?;
    let (unrecorded_view_us, _) = chain(true, false)?;
    Ok(Machine {
        op_us,
        backward_op_us,
        view_us,
        backward_view_us,
        unrecorded_op_us,
        unrecorded_view_us,
        ..m
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

    #[test]
    fn a_cached_machine_reads_back_and_another_version_is_not_taken() {
        let dir = std::env::temp_dir().join(format!("flame-machine-{}", std::process::id()));
        let path = dir.join("m.toml");
        let m = Machine {
            upload_gib_per_s: 12.5,
            op_us: 7.25,
            ..Machine::REFERENCE
        };
        write_machine(&path, &m).unwrap();
        assert_eq!(read_machine(&path).unwrap(), Some(m));
        // No temporary file is left beside it.
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1);
        let other = std::fs::read_to_string(&path)
            .unwrap()
            .replace(env!("CARGO_PKG_VERSION"), "0.0.0-other");
        std::fs::write(&path, other).unwrap();
        assert_eq!(read_machine(&path).unwrap(), None);
        std::fs::write(&path, "machine = 3").unwrap();
        let err = read_machine(&path).unwrap_err().to_string();
        assert!(err.contains("not a machine measurement"), "{err}");
        assert_eq!(read_machine(&dir.join("none.toml")).unwrap(), None);
        std::fs::remove_dir_all(&dir).unwrap();
        let p = machine_cache_path("NVIDIA H200 (x)", 1);
        if let Some(p) = p {
            assert!(
                p.ends_with("machine-NVIDIA-H200--x--1.toml"),
                "{}",
                p.display()
            );
        }
    }
}
