//! The host link: values of device storages kept in host memory while their buffers are
//! released (`HostCopy`: on a GPU page-locked where offloaded, plain where stashed for a
//! pack), several joined for one upload (`HostPack`,
//! bf16 parts optionally in the link's lossless code, `crate::backend::wire`), the device
//! memory coded uploads land in (`Staging`), what compute must wait for (`Ticket`), and the
//! storage and device methods that move values across. Only the streamer, the input offload
//! and the machine probe use it; each backend implements the moves (`backend/cuda/host.rs`).

use crate::device::{Device, Storage};
use crate::{CpuStorage, Result};
#[cfg(feature = "cpu-ref")]
use crate::{Layout, Shape};

/// A storage's values kept in host memory while its device buffer is released (block
/// streaming): for a GPU page-locked memory where the device copies it back (`offload`),
/// the process's own where the host packs it (`stash`); a plain copy for the CPU backend.
pub(crate) enum HostCopy {
    #[cfg(feature = "cpu-ref")]
    Cpu(CpuStorage),
    #[cfg(feature = "cuda")]
    Cuda(crate::backend::cuda::HostBuf),
}

impl HostCopy {
    /// The values in host memory of the CPU's own.
    pub(crate) fn to_cpu(&self) -> Result<CpuStorage> {
        match self {
            #[cfg(feature = "cpu-ref")]
            HostCopy::Cpu(s) => Ok(s.clone()),
            #[cfg(feature = "cuda")]
            HostCopy::Cuda(p) => p.to_cpu(),
        }
    }

    pub(crate) fn bytes(&self) -> usize {
        match self {
            #[cfg(feature = "cpu-ref")]
            HostCopy::Cpu(s) => s.len() * s.dtype().size_in_bytes(),
            #[cfg(feature = "cuda")]
            HostCopy::Cuda(p) => p.bytes(),
        }
    }
}

/// Several host copies joined for one upload (`Device::upload_pack`): on a GPU one
/// page-locked buffer brought into one device allocation; on the CPU backend the copies as
/// they are. Either way bf16 parts may be held in the host link's lossless code
/// (`crate::backend::wire`) and decoded at each upload.
pub(crate) enum HostPack {
    #[cfg(feature = "cpu-ref")]
    Cpu(Vec<CpuPart>),
    #[cfg(feature = "cuda")]
    Cuda(crate::backend::cuda::PinnedPack),
}

/// A part of a CPU pack: the values, or a bf16 tensor's code.
#[cfg(feature = "cpu-ref")]
pub(crate) enum CpuPart {
    Raw(CpuStorage),
    Coded(crate::backend::wire::Coded),
}

#[cfg(feature = "cpu-ref")]
impl CpuPart {
    /// (bytes on the device, bytes on the link).
    fn bytes(&self) -> (usize, usize) {
        match self {
            CpuPart::Raw(s) => {
                let b = s.len() * s.dtype().size_in_bytes();
                (b, b)
            }
            CpuPart::Coded(c) => (2 * c.layout.len, c.bytes.len()),
        }
    }
}

impl HostPack {
    /// Bytes the parts take on the device.
    pub(crate) fn bytes(&self) -> usize {
        match self {
            #[cfg(feature = "cpu-ref")]
            HostPack::Cpu(v) => v.iter().map(|p| p.bytes().0).sum(),
            #[cfg(feature = "cuda")]
            HostPack::Cuda(p) => p.bytes(),
        }
    }

    /// Whether some part is held in the link's code.
    pub(crate) fn is_coded(&self) -> bool {
        match self {
            #[cfg(feature = "cpu-ref")]
            HostPack::Cpu(v) => v.iter().any(|p| matches!(p, CpuPart::Coded(_))),
            #[cfg(feature = "cuda")]
            HostPack::Cuda(p) => p.is_coded(),
        }
    }

    /// Bytes of host memory it holds (pinned, on a GPU).
    pub(crate) fn host_bytes(&self) -> usize {
        match self {
            #[cfg(feature = "cpu-ref")]
            HostPack::Cpu(v) => v.iter().map(|p| p.bytes().1).sum(),
            #[cfg(feature = "cuda")]
            HostPack::Cuda(p) => p.host_bytes(),
        }
    }

    /// How many parts it holds.
    pub(crate) fn parts(&self) -> usize {
        match self {
            #[cfg(feature = "cpu-ref")]
            HostPack::Cpu(v) => v.len(),
            #[cfg(feature = "cuda")]
            HostPack::Cuda(p) => p.parts(),
        }
    }

    /// Each part's bytes on the device and on the host link, in order.
    pub(crate) fn part_bytes(&self) -> Vec<(usize, usize)> {
        match self {
            #[cfg(feature = "cpu-ref")]
            HostPack::Cpu(v) => v.iter().map(CpuPart::bytes).collect(),
            #[cfg(feature = "cuda")]
            HostPack::Cuda(p) => p.part_bytes(),
        }
    }

    /// What an upload stages before decoding its coded parts: (the whole pack's bytes on the
    /// link when it has any, its largest raw prefix or coded part, the most pieces it may
    /// take); zeros on the CPU backend, which decodes from host memory.
    pub(crate) fn staging_bytes(&self) -> (usize, usize, usize) {
        match self {
            #[cfg(feature = "cpu-ref")]
            HostPack::Cpu(_) => (0, 0, 0),
            #[cfg(feature = "cuda")]
            HostPack::Cuda(p) => p.staging_bytes(),
        }
    }

    /// What an upload of it uncoded through the staging ring stages (`upload_pack` given a
    /// ring for an uncoded pack: the backward's raw forms), as `staging_bytes`; zeros on the
    /// CPU backend.
    pub(crate) fn raw_staging_bytes(&self) -> (usize, usize, usize) {
        match self {
            #[cfg(feature = "cpu-ref")]
            HostPack::Cpu(_) => (0, 0, 0),
            #[cfg(feature = "cuda")]
            HostPack::Cuda(p) => p.raw_staging_bytes(),
        }
    }
}

/// Device memory that coded uploads land in before their decode (`Device::staging`).
pub(crate) enum Staging {
    #[cfg(feature = "cuda")]
    Cuda(crate::backend::cuda::Staging),
}

/// What the compute work must wait for before reading an uploaded storage.
pub(crate) enum Ticket {
    /// Nothing (the CPU backend copies synchronously).
    #[cfg_attr(not(feature = "cpu-ref"), allow(dead_code))]
    Ready,
    #[cfg(feature = "cuda")]
    Cuda(crate::backend::cuda::Upload),
}

/// How long the compute work stood waiting for an upload (`Device::wait_timed`).
pub(crate) enum Stall {
    /// No wait (the CPU backend, or an upload the device had not to wait for).
    Ready,
    #[cfg(feature = "cuda")]
    Cuda(crate::backend::cuda::Stall),
}

impl Stall {
    /// The milliseconds, once the device has passed the wait (None before).
    pub(crate) fn ms(&self) -> Option<f64> {
        match self {
            Stall::Ready => Some(0.0),
            #[cfg(feature = "cuda")]
            Stall::Cuda(s) => s.ms(),
        }
    }
}

impl Ticket {
    /// Bytes of the upload's pieces that had crossed into the staging ring ahead of it
    /// (`Device::cross_pack`): 0 on the CPU backend.
    pub(crate) fn landed_bytes(&self) -> usize {
        match self {
            #[cfg(feature = "cuda")]
            Ticket::Cuda(u) => u.landed_bytes(),
            _ => 0,
        }
    }

    /// Once the copies have finished (None before, for copies that were not timed, or on the
    /// CPU backend): their time on the link, from the first one's start to the last one's
    /// end, and the decodes' time.
    pub(crate) fn copy_ms(&self) -> Option<(f64, f64, f64)> {
        match self {
            #[cfg(feature = "cuda")]
            Ticket::Cuda(u) => u.copy_ms(),
            _ => None,
        }
    }

    /// Blocks the calling thread until the copies are done (at once on the CPU backend).
    pub(crate) fn wait_host(&self) -> crate::Result<()> {
        match self {
            #[cfg(feature = "cuda")]
            Ticket::Cuda(u) => u.wait_host(),
            _ => Ok(()),
        }
    }

    /// Whether the copy can still report a duration (a timed GPU copy).
    pub(crate) fn timed(&self) -> bool {
        match self {
            #[cfg(feature = "cuda")]
            Ticket::Cuda(u) => u.timed(),
            _ => false,
        }
    }
}

impl Storage {
    /// The first `len` elements copied to host memory without waiting (on a GPU: on the copy
    /// stream, into page-locked memory, into `reuse` when it has the same size), and what the
    /// compute work must wait for before this storage may be dropped (`Device::wait`).
    pub(crate) fn offload(
        &self,
        len: usize,
        reuse: Option<HostCopy>,
    ) -> Result<(HostCopy, Ticket)> {
        match self {
            #[cfg(feature = "cpu-ref")]
            Storage::Cpu(s) => {
                use crate::backend::BackendStorage;
                let _ = reuse;
                let l = Layout::contiguous(Shape::from(len));
                Ok((HostCopy::Cpu(s.to_host(&l)?), Ticket::Ready))
            }
            #[cfg(feature = "cuda")]
            Storage::Cuda(s) => {
                let reuse = match reuse {
                    Some(HostCopy::Cuda(p)) => Some(p),
                    _ => None,
                };
                let (p, u) = s.dev.offload(s, len, reuse)?;
                Ok((HostCopy::Cuda(p), Ticket::Cuda(u)))
            }
            #[cfg(not(any(feature = "cpu-ref", feature = "cuda")))]
            Storage::None(n) => match *n {},
        }
    }
    /// The first `len` elements copied to host memory (synchronously).
    pub(crate) fn stash(&self, len: usize) -> Result<HostCopy> {
        match self {
            #[cfg(feature = "cpu-ref")]
            Storage::Cpu(s) => {
                use crate::backend::BackendStorage;
                let l = Layout::contiguous(Shape::from(len));
                Ok(HostCopy::Cpu(s.to_host(&l)?))
            }
            #[cfg(feature = "cuda")]
            Storage::Cuda(s) => Ok(HostCopy::Cuda(s.dev.stash(s, len)?)),
            #[cfg(not(any(feature = "cpu-ref", feature = "cuda")))]
            Storage::None(n) => match *n {},
        }
    }
}

impl Device {
    /// New storages on this device holding the values of host copies `Storage::offload` made,
    /// and what to wait for before reading them (see `wait`; on a GPU the copies run on the
    /// offload stream, after the copies out).
    pub(crate) fn upload_offloaded(&self, hs: &[&HostCopy]) -> Result<(Vec<Storage>, Ticket)> {
        let other = || crate::Error::DeviceMismatch {
            op: "upload",
            lhs: self.location(),
            rhs: "a host copy made for another device".into(),
        };
        match self {
            #[cfg(feature = "cpu-ref")]
            Device::Cpu => {
                let storages = hs
                    .iter()
                    .map(|h| match h {
                        HostCopy::Cpu(s) => Ok(Storage::Cpu(s.clone())),
                        #[allow(unreachable_patterns)]
                        _ => Err(other()),
                    })
                    .collect::<Result<_>>()?;
                Ok((storages, Ticket::Ready))
            }
            #[cfg(feature = "cuda")]
            Device::Cuda(d) => {
                let pinned = hs
                    .iter()
                    .map(|h| match h {
                        HostCopy::Cuda(p) => Ok(p),
                        #[allow(unreachable_patterns)]
                        _ => Err(other()),
                    })
                    .collect::<Result<Vec<_>>>()?;
                let (storages, u) = d.upload_offloaded(&pinned)?;
                Ok((
                    storages.into_iter().map(Storage::Cuda).collect(),
                    Ticket::Cuda(u),
                ))
            }
            #[cfg(not(any(feature = "cpu-ref", feature = "cuda")))]
            Device::None(n) => match *n {},
        }
    }

    /// The host copies `hs` joined, in order, for `upload_pack` (on a GPU: copied into one
    /// new page-locked buffer; `hs` may be dropped after).
    pub(crate) fn pack(&self, hs: &[&HostCopy], code: bool) -> Result<HostPack> {
        let other = || crate::Error::DeviceMismatch {
            op: "pack",
            lhs: self.location(),
            rhs: "a host copy made for another device".into(),
        };
        match self {
            #[cfg(feature = "cpu-ref")]
            Device::Cpu => hs
                .iter()
                .map(|h| match h {
                    HostCopy::Cpu(CpuStorage::BF16(v)) if code => {
                        let bits: Vec<u16> = v.iter().map(|x| x.to_bits()).collect();
                        Ok(match crate::backend::wire::encode(&bits) {
                            Some(c) => CpuPart::Coded(c),
                            None => CpuPart::Raw(CpuStorage::BF16(v.clone())),
                        })
                    }
                    HostCopy::Cpu(s) => Ok(CpuPart::Raw(s.clone())),
                    #[allow(unreachable_patterns)]
                    _ => Err(other()),
                })
                .collect::<Result<_>>()
                .map(HostPack::Cpu),
            #[cfg(feature = "cuda")]
            Device::Cuda(d) => {
                let pinned = hs
                    .iter()
                    .map(|h| match h {
                        HostCopy::Cuda(p) => Ok(p),
                        #[allow(unreachable_patterns)]
                        _ => Err(other()),
                    })
                    .collect::<Result<Vec<_>>>()?;
                Ok(HostPack::Cuda(d.pack(&pinned, code)?))
            }
            #[cfg(not(any(feature = "cpu-ref", feature = "cuda")))]
            Device::None(n) => match *n {},
        }
    }

    /// New storages on this device with the values of the parts of `p`, in order, and what to
    /// wait for before reading them (see `wait`). On a GPU they are cut from one allocation of
    /// the pack's bytes filled by one copy per run of parts brought (coded packs: a few
    /// pieces through the staging ring, decoded into place), which returns to the cache when
    /// the last of them drops.
    /// Parts whose entry in `skip` is true (`skip` empty: none) are not brought: `None` in
    /// their place. With `timed`, a GPU upload brackets each copy and decode with timed
    /// events for `Ticket::copy_ms` (a few more driver calls a piece on the host).
    /// `crossed`: a crossing of the pack's first pieces into the staging ring made ahead
    /// (`cross_pack`), decoded instead of copied again where it is still there. An uncoded
    /// pack given `staging` crosses through it too where it fits (copied into place from the
    /// ring), else straight into place.
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    pub(crate) fn upload_pack(
        &self,
        p: &HostPack,
        staging: Option<&Staging>,
        skip: &[bool],
        timed: bool,
        crossed: Option<u64>,
    ) -> Result<(Vec<Option<Storage>>, Ticket)> {
        let parts = p.parts();
        if !skip.is_empty() && skip.len() != parts {
            return Err(crate::Error::Stream(format!(
                "an upload of {parts} parts told to skip {} entries",
                skip.len()
            )));
        }
        let skipped = |k: usize| skip.get(k).copied().unwrap_or(false);
        let other = || crate::Error::DeviceMismatch {
            op: "upload",
            lhs: self.location(),
            rhs: "host copies packed for another device".into(),
        };
        match (self, p) {
            #[cfg(feature = "cpu-ref")]
            (Device::Cpu, HostPack::Cpu(v)) => {
                let storages = v
                    .iter()
                    .enumerate()
                    .map(|(k, p)| match p {
                        _ if skipped(k) => Ok(None),
                        CpuPart::Raw(s) => Ok(Some(Storage::Cpu(s.clone()))),
                        CpuPart::Coded(c) => {
                            let mut bits = vec![0u16; c.layout.len];
                            crate::backend::wire::decode(&c.layout, &c.bytes, &mut bits)?;
                            Ok(Some(Storage::Cpu(CpuStorage::BF16(
                                bits.into_iter().map(half::bf16::from_bits).collect(),
                            ))))
                        }
                    })
                    .collect::<Result<_>>()?;
                Ok((storages, Ticket::Ready))
            }
            #[cfg(feature = "cuda")]
            (Device::Cuda(d), HostPack::Cuda(p)) => {
                let staging = match staging {
                    Some(Staging::Cuda(s)) => Some(s),
                    #[allow(unreachable_patterns)]
                    _ => None,
                };
                let (storages, u) = d.upload_pack(p, staging, skip, timed, crossed)?;
                Ok((
                    storages
                        .into_iter()
                        .enumerate()
                        .map(|(k, s)| (!skipped(k)).then_some(Storage::Cuda(s)))
                        .collect(),
                    Ticket::Cuda(u),
                ))
            }
            #[allow(unreachable_patterns)]
            _ => Err(other()),
        }
    }

    /// Copies the first pieces of the coded pack `p` into `staging` ahead of its upload, as
    /// far as the ring has room no other crossing holds (on a GPU: `CudaDevice::cross_pack`):
    /// the link's idle time before the memory the upload lands in is free. Returns the
    /// crossing's id for `upload_pack`, its bytes and whether every piece crossed; None where
    /// nothing crossed (the CPU backend, an uncoded pack, no staging, no room).
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    pub(crate) fn cross_pack(
        &self,
        p: &HostPack,
        staging: Option<&Staging>,
    ) -> Result<Option<(u64, usize, bool)>> {
        match (self, p, staging) {
            #[cfg(feature = "cuda")]
            (Device::Cuda(d), HostPack::Cuda(p), Some(Staging::Cuda(s))) => d.cross_pack(p, s),
            _ => Ok(None),
        }
    }

    /// Device memory of `bytes` for coded uploads to stage in (`upload_pack`); `None` on the
    /// CPU backend or for 0 bytes.
    pub(crate) fn staging(
        &self,
        wire: usize,
        part: usize,
        pieces: usize,
    ) -> Result<Option<Staging>> {
        match self {
            #[cfg(feature = "cuda")]
            Device::Cuda(d) if wire > 0 => {
                Ok(Some(Staging::Cuda(d.alloc_staging(wire, part, pieces)?)))
            }
            _ => {
                // Only a GPU stages (the CPU backend alone reads none of them).
                let _ = (wire, part, pieces);
                Ok(None)
            }
        }
    }

    /// Makes the device's compute work wait for an upload (on a GPU, without waiting on the
    /// host).
    pub(crate) fn wait(&self, t: &Ticket) -> Result<()> {
        match (self, t) {
            #[cfg(feature = "cuda")]
            (Device::Cuda(d), Ticket::Cuda(u)) => d.wait(u),
            _ => Ok(()),
        }
    }

    /// `wait`, timing how long the compute work stands waiting for the upload (`Stall::ms`):
    /// nothing to time on the CPU backend, whose copies are done when made.
    pub(crate) fn wait_timed(&self, t: &Ticket) -> Result<Stall> {
        match (self, t) {
            #[cfg(feature = "cuda")]
            (Device::Cuda(d), Ticket::Cuda(u)) => Ok(Stall::Cuda(d.wait_timed(u)?)),
            _ => Ok(Stall::Ready),
        }
    }

    /// The largest buffer the device can make now without going past its memory cap (a
    /// GPU under a cap: the largest free range of the cap's arena); u64::MAX where nothing
    /// limits it.
    pub(crate) fn room(&self) -> u64 {
        match self {
            #[cfg(feature = "cuda")]
            Device::Cuda(d) => d.arena_room(),
            #[allow(unreachable_patterns)]
            _ => u64::MAX,
        }
    }
}
