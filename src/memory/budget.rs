//! What a budget of device memory leaves FLAME's allocator: the budget is what the process
//! holds as the driver counts it, so what it holds outside the allocator comes off it.

use crate::{Device, Result};

const GIB: f64 = (1u64 << 30) as f64;

#[cfg(feature = "cuda")]
fn gib(b: u64) -> f64 {
    b as f64 / GIB
}

/// What a budget leaves for what the process makes after the plan is chosen and outside
/// FLAME's allocator: kernels loaded on first use, the cuBLASLt workspace (32 MiB on
/// Hopper). (A data-parallel group's NCCL buffers are made by a first collective before
/// the measurement, so they are measured, not guessed.)
pub const LATE_HEADROOM: u64 = 384 << 20;

/// A budget of `budget_gb` GiB (0: none given) split into (bytes for FLAME's allocator,
/// bytes outside it). On a GPU the budget is what the process may hold as the driver counts
/// it (`budget_gb`, else the memory free now): the context, kernels and workspaces measured
/// the first time a budget is split on the device (`CudaDevice::held_for_budget`: every
/// later split gets the same share) plus [`LATE_HEADROOM`] come off it. On the CPU,
/// `budget_gb` as it is (none when 0). (The step's default is the memory free now; the other
/// phases' default, planned before the step's memory is taken, is [`memory_at_start`].)
pub fn split_budget(device: &Device, budget_gb: f64) -> Result<(Option<u64>, Option<u64>)> {
    let asked = (budget_gb > 0.0).then_some((budget_gb * GIB) as u64);
    #[cfg(feature = "cuda")]
    #[allow(irrefutable_let_patterns)] // the only variant in builds without cpu-ref
    if let Device::Cuda(c) = device {
        let held = c.held_for_budget()?;
        let (alloc, outside) = match asked {
            Some(b) => split_held(b, held)?,
            // What FLAME's buffers may take now: the memory free on the device (what the
            // process has not taken yet), the free part of an arena it made before (another
            // run of this process) and its live buffers (the cap counts them); only the
            // headroom comes off it; no more than a limit set by hand
            // (`FLAME_GPU_MEMORY_LIMIT`).
            None => {
                let r = c.memory();
                let room = c.total_memory()? - c.device_memory_used()? + r.arena_free + r.in_use;
                let (alloc, outside) = split_held(room, 0)?;
                (alloc.min(c.memory_limit_by_hand()?), outside)
            }
        };
        return Ok((Some(alloc), Some(outside)));
    }
    let _ = device;
    Ok((asked, None))
}

/// [`split_budget`], and on a GPU FLAME's allocator capped at the allocator's share from
/// here on: called before a process's first work, so that every phase after it (text
/// encoders, caching, the model, sampling) is held to the budget. Without a budget
/// (`budget_gb` 0) the share is of the memory free now, the default budget: capped, the
/// allocator cuts its buffers from one arena of that size, where uncapped the driver's pool
/// would keep the pieces of freed buffers it cannot reuse beside them and take the process
/// past the memory the plans were made within (a card's last free bytes: out of memory).
pub fn hold_to_budget(device: &Device, budget_gb: f64) -> Result<(Option<u64>, Option<u64>)> {
    let (alloc, outside) = split_budget(device, budget_gb)?;
    #[cfg(feature = "cuda")]
    #[allow(irrefutable_let_patterns)]
    if let (Device::Cuda(c), Some(b)) = (device, alloc) {
        c.set_memory_limit(Some(b));
    }
    Ok((alloc, outside))
}

/// The memory a run's phases plan within when no budget is given, bytes as the driver counts
/// them: on a GPU, what the process could hold when it opened the device (its context and
/// the memory free then: `CudaDevice::memory_at_start`, lowered where ranks agreed on less
/// or a resumed run planned within less, [`limit_share_at_start`]); `None` on the CPU.
/// Another process's memory (a display, a second job, a process holding part of the card)
/// is left to it.
pub fn memory_at_start(device: &Device) -> Result<Option<u64>> {
    #[cfg(feature = "cuda")]
    #[allow(irrefutable_let_patterns)]
    if let Device::Cuda(c) = device {
        return Ok(Some(c.memory_at_start()?));
    }
    let _ = device;
    Ok(None)
}

/// Bytes FLAME's allocator may still hand out under its cap on `device` (the cap less the
/// live buffers; freed buffers it caches give way): `None` on the CPU or without a cap.
pub fn allocator_free(device: &Device) -> Option<u64> {
    #[cfg(feature = "cuda")]
    #[allow(irrefutable_let_patterns)]
    if let Device::Cuda(c) = device {
        let m = c.memory();
        return (m.limit != u64::MAX).then(|| m.limit.saturating_sub(m.in_use));
    }
    let _ = device;
    None
}

/// Bytes FLAME's allocator holds in live buffers on `device` now (0 on the CPU): what lives
/// beside a phase planned at this moment (the autoencoder, the prompts' conditioning).
pub fn allocator_in_use(device: &Device) -> u64 {
    #[cfg(feature = "cuda")]
    #[allow(irrefutable_let_patterns)]
    if let Device::Cuda(c) = device {
        return c.memory().in_use;
    }
    let _ = device;
    0
}

/// The default budget of the phases planned before their memory is taken (caching, the
/// samples' decode, `sample`'s model), split as [`split_budget`] splits a given one:
/// [`memory_at_start`] less what the process holds outside its allocator and
/// [`LATE_HEADROOM`] for the allocator (no more than a limit set by hand,
/// `FLAME_GPU_MEMORY_LIMIT`), that for outside it; an error where nothing is left for the
/// allocator; `(None, None)` on the CPU.
pub fn split_at_start(device: &Device) -> Result<(Option<u64>, Option<u64>)> {
    #[cfg(feature = "cuda")]
    #[allow(irrefutable_let_patterns)]
    if let Device::Cuda(c) = device {
        let (alloc, outside) =
            split_held(c.memory_at_start()?, c.held_for_budget()?).map_err(|e| {
                crate::Error::Context {
                    what: "the default budget, the GPU's memory free at start (none given)".into(),
                    error: Box::new(e),
                }
            })?;
        return Ok((Some(alloc.min(c.memory().limit)), Some(outside)));
    }
    let _ = device;
    Ok((None, None))
}

/// Lowers the allocator's share of the default budget ([`split_at_start`]) to at most
/// `share` bytes for the rest of the process (nothing on the CPU, or where it is no more
/// already): what a resumed run planned within, or the least of data-parallel ranks'.
pub fn limit_share_at_start(device: &Device, share: u64) -> Result<()> {
    #[cfg(feature = "cuda")]
    #[allow(irrefutable_let_patterns)]
    if let (Device::Cuda(c), (Some(alloc), Some(outside))) = (device, split_at_start(device)?) {
        if share < alloc {
            c.limit_memory_at_start(share + outside)?;
        }
    }
    let _ = (device, share);
    Ok(())
}

/// Every rank of `group` takes the least of the ranks' shares of the default budget
/// ([`split_at_start`]) as its own, so that what they choose under a default budget (the
/// autoencoder's tile, which keys the latent cache the ranks fill together; the text
/// encoders' streaming) is the same on every rank. Every rank calls it, on a GPU or not
/// (nothing is taken where any rank has no GPU).
pub fn agree_memory_at_start(device: &Device, group: &dyn crate::dist::ProcessGroup) -> Result<()> {
    let mut each = vec![0.0; group.world()];
    // A rank's own share, sent once the others are asked (an error after the collective).
    let own = split_at_start(device);
    if let Some(slot) = each.get_mut(group.rank()) {
        *slot = match &own {
            Ok((Some(a), _)) => *a as f64,
            _ => -1.0,
        };
    }
    group.sum_host(&mut each)?;
    own?;
    // A rank without a GPU (or whose share failed) sends -1: then no rank takes a figure.
    if each.iter().any(|&b| b < 0.0) {
        return Ok(());
    }
    let least = each.iter().copied().fold(f64::INFINITY, f64::min);
    if least.is_finite() {
        limit_share_at_start(device, least as u64)?;
    }
    Ok(())
}

/// A budget of `total` bytes as the driver counts it, for a process that holds `held` bytes
/// outside its allocator, split into (bytes for the allocator, bytes outside it: `held` and
/// [`LATE_HEADROOM`]); an error where nothing is left for the allocator.
#[cfg(feature = "cuda")]
fn split_held(total: u64, held: u64) -> Result<(u64, u64)> {
    let outside = held + LATE_HEADROOM;
    if total <= outside {
        return Err(crate::Error::Config {
            path: None,
            msg: format!(
                "a budget of {:.2} GiB: the CUDA context, kernels and workspaces take \
                 {:.2} GiB of it (measured), leaving nothing for the work",
                gib(total),
                gib(outside)
            ),
        });
    }
    Ok((total - outside, outside))
}
