//! The block streamer: frozen weights of chosen blocks kept in host memory and brought to
//! the device around each use.

use crate::autograd::{CheckpointHooks, Pass};
use crate::device::{HostCopy, HostPack, Staging, Storage, Ticket};
use crate::{Device, Error, Result, Tensor};
use std::sync::{Arc, Mutex, MutexGuard};

/// Counters of a streamer since it was made.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StreamReport {
    /// Blocks streamed.
    pub blocks: usize,
    /// Bytes of weights kept in host memory.
    pub host_bytes: u64,
    /// Block uploads started (each brings all of a block's weights).
    pub uploads: u64,
    /// Bytes copied to the device over the host link.
    pub uploaded_bytes: u64,
    /// Bytes those uploads put on the device: more than `uploaded_bytes` where bf16 weights
    /// crossed in the link's lossless code (`crate::backend::wire`).
    pub decoded_bytes: u64,
    /// Microseconds the device spent in those copies, over the copies that have finished and
    /// were timed (on a GPU; 0 on the CPU backend): `uploaded_bytes` over it is the bandwidth
    /// the streaming got.
    pub copy_us: u64,
    /// Uploads counted in `copy_us`.
    pub timed_uploads: u64,
}

struct Param {
    /// The model's handle; its buffer is swapped in and out.
    tensor: Tensor,
    /// The values until the block's first fetch joins them into the block's pack.
    host: Option<HostCopy>,
    /// The one-element buffer the tensor holds while released; `None` while the device copy
    /// is in.
    placeholder: Option<Storage>,
}

enum Residency {
    Released,
    /// Copies started, not yet waited for by the compute work.
    InFlight(Ticket),
    Resident,
}

struct Block {
    prefix: String,
    params: Vec<Param>,
    /// Every parameter's values in one host buffer, made at the first fetch: one copy and
    /// one device allocation per fetch instead of one per parameter.
    pack: Option<HostPack>,
    residency: Residency,
}

struct State {
    blocks: Vec<Block>,
    report: StreamReport,
    /// Tickets of uploads the compute work has waited for, until their copies' durations can
    /// be read.
    timing: Vec<Ticket>,
    /// The bytes every block's device copy takes (the largest pack), set when the packs are
    /// made.
    slot_bytes: usize,
    /// Whether bf16 weights cross the link coded (`set_wire_code`).
    code: bool,
    /// Where coded uploads land before their decode (the largest pack's coded bytes), made
    /// with the packs.
    staging: Option<Staging>,
}

impl State {
    /// Adds the durations of the finished copies in `timing` to the report.
    fn collect_timings(&mut self) {
        let report = &mut self.report;
        self.timing.retain(|t| match t.copy_ms() {
            Some(ms) => {
                report.copy_us += (ms * 1e3).round() as u64;
                report.timed_uploads += 1;
                false
            }
            None => true,
        });
    }
}

/// Streams the frozen weights of a list of blocks (key prefixes, in execution order) between
/// host memory and `device`: see the module docs of `crate::stream`.
pub struct BlockStreamer {
    device: Device,
    prefetch: usize,
    state: Mutex<State>,
}

impl std::fmt::Debug for BlockStreamer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = self.state.lock().map(|s| s.blocks.len()).unwrap_or(0);
        write!(
            f,
            "BlockStreamer({n} blocks on {}, prefetch {})",
            self.device.location(),
            self.prefetch
        )
    }
}

impl BlockStreamer {
    /// A streamer for the blocks named by `prefixes` (execution order), fetching up to
    /// `prefetch` blocks ahead of the one running. Weights join it through `adopt` (the
    /// `VarBuilder` does this for keys under a prefix: `VarBuilder::with_streamer`).
    pub fn new(device: &Device, prefixes: Vec<String>, prefetch: usize) -> Arc<Self> {
        let blocks = prefixes
            .into_iter()
            .map(|prefix| Block {
                prefix,
                params: vec![],
                pack: None,
                residency: Residency::Released,
            })
            .collect::<Vec<_>>();
        Arc::new(BlockStreamer {
            device: device.clone(),
            prefetch,
            state: Mutex::new(State {
                blocks,
                report: StreamReport::default(),
                timing: vec![],
                slot_bytes: 0,
                code: true,
                staging: None,
            }),
        })
    }

    fn lock(&self) -> Result<MutexGuard<'_, State>> {
        self.state
            .lock()
            .map_err(|_| Error::Poisoned("block streamer"))
    }

    /// The device the blocks' weights are copied to.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Whether bf16 weights are held in host memory and cross the link in a lossless code
    /// (`crate::backend::wire`: about a quarter fewer bytes, decoded on the device after
    /// each copy; the values are the same bit for bit). On by default; set before the first
    /// fetch.
    pub fn set_wire_code(&self, on: bool) -> Result<()> {
        let mut st = self.lock()?;
        if st.slot_bytes > 0 {
            return Err(Error::Stream(
                "the wire code is chosen before the first fetch".into(),
            ));
        }
        st.code = on;
        Ok(())
    }

    /// The counters so far, with `blocks` the number of streamed blocks.
    pub fn report(&self) -> Result<StreamReport> {
        let mut st = self.lock()?;
        st.collect_timings();
        Ok(StreamReport {
            blocks: st.blocks.len(),
            ..st.report
        })
    }

    /// The streamed block that parameter `key` belongs to (`<prefix>.<rest>`).
    pub fn owner(&self, key: &str) -> Result<Option<usize>> {
        Ok(self.lock()?.blocks.iter().position(|b| {
            key.strip_prefix(b.prefix.as_str())
                .is_some_and(|rest| rest.starts_with('.'))
        }))
    }

    /// Takes parameter `t` of block `block` into host memory and returns the handle the
    /// model keeps: same shape, dtype and device, its buffer released until the block is
    /// fetched. `t`'s own device buffer is freed once the caller drops `t`.
    pub fn adopt(&self, block: usize, t: &Tensor) -> Result<Tensor> {
        if t.device() != &self.device {
            return Err(Error::DeviceMismatch {
                op: "stream adopt",
                lhs: self.device.location(),
                rhs: t.device().location(),
            });
        }
        if t.requires_grad() {
            return Err(Error::Stream(format!(
                "a trainable tensor of shape {} cannot be streamed (only frozen weights are)",
                t.shape()
            )));
        }
        // Whole buffers only: the handle's layout is contiguous from offset 0.
        let t = if t.is_contiguous() && t.layout().offset() == 0 {
            t.clone()
        } else {
            let _g = crate::no_grad();
            t.affine(1.0, 0.0)?
        };
        let host = {
            let s = t.storage()?;
            s.stash(t.layout().offset() + t.elem_count())?
        };
        let handle = t.with_storage(self.device.placeholder(t.dtype())?);
        let mut st = self.lock()?;
        st.report.host_bytes += host.bytes() as u64;
        let sealed = st.slot_bytes > 0;
        let b = st
            .blocks
            .get_mut(block)
            .ok_or_else(|| Error::Stream(format!("no streamed block {block}")))?;
        if !matches!(b.residency, Residency::Released) || b.pack.is_some() || sealed {
            return Err(Error::Stream(format!(
                "block {} took a new weight after its first fetch",
                b.prefix
            )));
        }
        // The handle holds its placeholder until the first fetch swaps it out.
        b.params.push(Param {
            tensor: handle.clone(),
            host: Some(host),
            placeholder: None,
        });
        Ok(handle)
    }

    /// Hooks that fetch and release block `prefix` around a checkpointed run; `None` when
    /// the block is not streamed.
    pub(crate) fn hooks_for(self: &Arc<Self>, prefix: &str) -> Option<Arc<BlockHooks>> {
        let index = self
            .lock()
            .ok()?
            .blocks
            .iter()
            .position(|b| b.prefix == prefix)?;
        Some(Arc::new(BlockHooks {
            streamer: self.clone(),
            index,
        }))
    }

    /// Starts copying block `i`'s weights to the device, unless they are there or coming.
    fn start(&self, st: &mut State, i: usize) -> Result<()> {
        let Some(b) = st.blocks.get_mut(i) else {
            return Ok(());
        };
        if !matches!(b.residency, Residency::Released) {
            return Ok(());
        }
        if b.params.is_empty() {
            return Ok(());
        }
        if b.pack.is_none() {
            self.seal(st)?;
        }
        let State {
            blocks,
            report,
            slot_bytes,
            staging,
            ..
        } = st;
        let Some(b) = blocks.get_mut(i) else {
            return Ok(());
        };
        let Some(pack) = &b.pack else {
            return Ok(());
        };
        let (wire, bytes) = (pack.wire_bytes() as u64, pack.bytes() as u64);
        let (storages, ticket) = self
            .device
            .upload_pack(pack, *slot_bytes, staging.as_ref())?;
        for (p, storage) in b.params.iter_mut().zip(storages) {
            p.placeholder = Some(p.tensor.swap_storage(storage)?);
        }
        b.residency = Residency::InFlight(ticket);
        report.uploads += 1;
        report.uploaded_bytes += wire;
        report.decoded_bytes += bytes;
        Ok(())
    }

    /// Joins every block's weights into its pack (at the first fetch: every weight has been
    /// adopted by then), bf16 weights coded when `code` is on, and sets the slot size every
    /// upload takes: the largest pack, so a released block's memory holds any block's next
    /// (no pieces between packs of different sizes under a cap's arena); and makes the
    /// staging buffer coded uploads land in (the largest pack's coded bytes: uploads run one
    /// after another on the copy stream, each decoded before the next copy starts).
    fn seal(&self, st: &mut State) -> Result<()> {
        for b in &mut st.blocks {
            if b.pack.is_some() || b.params.is_empty() {
                continue;
            }
            let hosts = b
                .params
                .iter()
                .map(|p| p.host.as_ref())
                .collect::<Option<Vec<&HostCopy>>>()
                .ok_or_else(|| {
                    Error::Stream(format!("block {}: a weight lost its values", b.prefix))
                })?;
            b.pack = Some(self.device.pack(&hosts, st.code)?);
            for p in &mut b.params {
                p.host = None;
            }
        }
        st.slot_bytes = st
            .blocks
            .iter()
            .filter_map(|b| b.pack.as_ref().map(HostPack::bytes))
            .max()
            .unwrap_or(0);
        let staging = st
            .blocks
            .iter()
            .filter_map(|b| b.pack.as_ref().map(HostPack::staging_bytes))
            .max()
            .unwrap_or(0);
        st.staging = self.device.staging(staging)?;
        Ok(())
    }

    /// Makes the compute work wait for block `i`'s copies.
    fn wait(&self, st: &mut State, i: usize) -> Result<()> {
        let Some(b) = st.blocks.get_mut(i) else {
            return Ok(());
        };
        if let Residency::InFlight(ticket) = &b.residency {
            self.device.wait(ticket)?;
            if let Residency::InFlight(ticket) =
                std::mem::replace(&mut b.residency, Residency::Resident)
            {
                if ticket.timed() {
                    st.timing.push(ticket);
                }
            }
        }
        if st.timing.len() >= 64 {
            st.collect_timings();
        }
        Ok(())
    }

    /// Releases block `i`'s device copies (after the compute work waits for their copies, so
    /// a buffer never returns to the cache while a copy may write it).
    fn release(&self, st: &mut State, i: usize) -> Result<()> {
        self.wait(st, i)?;
        let Some(b) = st.blocks.get_mut(i) else {
            return Ok(());
        };
        if !matches!(b.residency, Residency::Resident) {
            return Ok(());
        }
        for p in &mut b.params {
            let placeholder = match p.placeholder.take() {
                Some(s) => s,
                None => self.device.placeholder(p.tensor.dtype())?,
            };
            drop(p.tensor.swap_storage(placeholder)?);
        }
        b.residency = Residency::Released;
        Ok(())
    }

    /// Brings block `i` in (and starts the next `prefetch` blocks in the pass's direction).
    fn enter(&self, i: usize, pass: Pass) -> Result<()> {
        let mut st = self.lock()?;
        self.start(&mut st, i)?;
        for k in 1..=self.prefetch {
            let j = match pass {
                Pass::Forward => i + k,
                Pass::Backward => match i.checked_sub(k) {
                    Some(j) => j,
                    None => break,
                },
            };
            self.start(&mut st, j)?;
        }
        self.wait(&mut st, i)
    }

    /// Releases block `i` after a run, except the blocks the next pass starts with: the last
    /// `prefetch + 1` after the forward (the backward begins there and would fetch them at
    /// once), the first `prefetch + 1` after the backward (the next step's forward begins
    /// there). The device holds that many streamed blocks throughout a pass anyway (the one
    /// running and those in flight), so keeping them costs no peak and saves their uploads:
    /// 2 (prefetch + 1) fewer a step.
    fn exit(&self, i: usize, pass: Pass) -> Result<()> {
        let mut st = self.lock()?;
        let keep = match pass {
            Pass::Forward => i + 1 + self.prefetch >= st.blocks.len(),
            Pass::Backward => i <= self.prefetch,
        };
        if keep {
            return Ok(());
        }
        self.release(&mut st, i)
    }

    /// Releases every block (e.g. before sampling with another model, or at the end).
    pub fn release_all(&self) -> Result<()> {
        let mut st = self.lock()?;
        for i in 0..st.blocks.len() {
            self.release(&mut st, i)?;
        }
        Ok(())
    }
}

/// The checkpoint hooks of one streamed block.
pub(crate) struct BlockHooks {
    streamer: Arc<BlockStreamer>,
    index: usize,
}

impl CheckpointHooks for BlockHooks {
    fn enter(&self, pass: Pass) -> Result<()> {
        self.streamer.enter(self.index, pass)
    }
    fn exit(&self, pass: Pass) -> Result<()> {
        self.streamer.exit(self.index, pass)
    }
}
