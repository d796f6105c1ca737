//! The block streamer: frozen weights of chosen blocks kept in host memory and brought to
//! the device around each use.

use super::link::{HostCopy, HostPack, Staging, Stall, Ticket};
use super::plan::{carry, shallow_reach};
use super::products::{HostProducts, ProductReport};
use crate::autograd::{CheckpointHooks, Pass};
use crate::device::Storage;
use crate::{Device, Error, Result, Tensor};
use std::sync::{Arc, Mutex, MutexGuard};

/// One upload in this many has its copies and decodes timed on the device (the others order
/// the streams with untimed events a device keeps for reuse): a staged piece's four timed
/// events, made and destroyed each time, took about twice the driver calls of its copy and
/// decode (SDXL within 4 GiB, 150 uploads of about eight pieces a step: 44-63 ms a step of
/// the host's time in the blocks' entries against 7-9 ms uncoded, H200).
pub const TIME_EVERY: u64 = 8;

/// Counters of a streamer since it was made.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StreamReport {
    /// Blocks streamed.
    pub blocks: usize,
    /// Bytes of weights kept in host memory.
    pub host_bytes: u64,
    /// Microseconds of the host's wall time in taking the weights into host memory as
    /// they loaded (`adopt`: on a GPU each weight copied back into the process's memory,
    /// after waiting for its load's copy to land).
    pub adopt_us: u64,
    /// Microseconds of the host's wall time in joining each block's weights into its pack
    /// at the first fetch (page-locked memory on a GPU; bf16 weights coded for the link
    /// where the wire code is on).
    pub seal_us: u64,
    /// Block uploads started (each brings a block's weights: all of them, or in the
    /// backward all but those only the forward reads).
    pub uploads: u64,
    /// Bytes copied to the device over the host link (the parts brought, their alignment
    /// aside).
    pub uploaded_bytes: u64,
    /// Bytes those uploads put on the device: more than `uploaded_bytes` where bf16 weights
    /// crossed in the link's lossless code (`crate::backend::wire`).
    pub decoded_bytes: u64,
    /// Microseconds the device spent in the copies that have finished and were timed (on a
    /// GPU, one upload in `TIME_EVERY`; 0 on the CPU backend): `timed_bytes` over it is the
    /// bandwidth the streaming got.
    pub copy_us: u64,
    /// Microseconds from each of those uploads' first copy's start to its last copy's end:
    /// more than `copy_us` where a staged upload's copies waited for the staging ring.
    pub span_us: u64,
    /// Microseconds those uploads' decodes (and copies of staged raw parts) took on the
    /// device.
    pub decode_us: u64,
    /// Uploads counted in `copy_us`: one in `TIME_EVERY`, or every one while a trace is kept
    /// (`BlockStreamer::trace_uploads`).
    pub timed_uploads: u64,
    /// Their bytes over the link: `timed_bytes` over `copy_us` is the copies' rate.
    pub timed_bytes: u64,
    /// Bytes of weights the backward's uploads left out (neither copied nor decoded): weights
    /// only the forward reads (`autograd::Keep::few_rows`), which stay released through the
    /// backward.
    pub left_out_bytes: u64,
    /// Microseconds the host spent in the blocks' entries and exits (starting uploads,
    /// ordering the compute after them, releasing copies): the streaming's own cost to the
    /// host's issue of a step.
    pub host_us: u64,
    /// Blocks on the device or coming, now.
    pub resident: usize,
    /// Forwards begun at the first streamed block (`carried_found` is summed over them).
    pub forwards: u64,
    /// Of the first blocks the backward may leave for the next forward (`carried`), those
    /// found on the device or coming at each forward's start, summed: fewer than
    /// `forwards` times the carry where the device lacked the room to keep them.
    pub carried_found: u64,
    /// Bytes of the next forward's first coded uploads crossed into the staging ring at the
    /// backward's end, while the link had nothing else to carry (`cross_ahead`).
    pub crossed_bytes: u64,
    /// Of those, the bytes the uploads found there and decoded instead of copying again (a
    /// crossing another upload overwrote first is copied again).
    pub landed_bytes: u64,
    /// The products of the weights held on the host (`BlockStreamer::set_host_products`).
    pub host: ProductReport,
    /// Products computed in the backward over the input announced for the next forward
    /// (`BlockStreamer::set_ahead_products`).
    pub ahead_products: u64,
}

impl StreamReport {
    /// The host's side of the streaming for a run's summary: the blocks and their bytes in
    /// host memory, the seconds taking the weights in as they loaded (`adopt_us`), packing
    /// them at the first fetch (`seal_us`), and the uploads since.
    pub fn host_summary(&self) -> String {
        format!(
            "{} blocks, {:.2} GiB of weights in host memory: {:.1} s taking them in as they \
             loaded, {:.1} s packing them at the first fetch; {} uploads, {:.2} GiB over the link",
            self.blocks,
            self.host_bytes as f64 / (1u64 << 30) as f64,
            self.adopt_us as f64 / 1e6,
            self.seal_us as f64 / 1e6,
            self.uploads,
            self.uploaded_bytes as f64 / (1u64 << 30) as f64,
        )
    }
}

/// One timed upload (`BlockStreamer::trace_uploads`): which block, what it brought, and what
/// its copies and decodes took on the device.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct UploadRecord {
    /// The block's place in the streamer's order.
    pub block: usize,
    /// Whether the upload brought every weight (a forward's, or a backward's that leaves
    /// nothing out), or only those a re-run reads.
    pub whole: bool,
    /// Whether any of its parts crossed coded (through the staging ring).
    pub coded: bool,
    /// Bytes on the link.
    pub wire_bytes: u64,
    /// Milliseconds in its copies.
    pub copy_ms: f64,
    /// Milliseconds from its first copy's start to its last copy's end.
    pub span_ms: f64,
    /// Milliseconds in its decodes (and the staged copies of its raw parts).
    pub decode_ms: f64,
}

/// One wait of the compute work for a block's upload while a trace is kept
/// (`BlockStreamer::take_stalls`): which block, in which pass, and how long the compute
/// stream stood waiting for the upload's last copy or decode.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StallRecord {
    /// The block's place in the streamer's order.
    pub block: usize,
    /// Whether the wait was the backward's (a re-run's), else the forward's.
    pub backward: bool,
    /// Milliseconds the compute stream stood waiting.
    pub ms: f64,
}

struct Param {
    /// The model's handle; its buffer is swapped in and out.
    tensor: Tensor,
    /// The values until the block's first fetch joins them into the block's pack.
    host: Option<HostCopy>,
    /// While the device copy is in, the one-element buffer the tensor holds while released
    /// (put back at the release); `None` while released, or left out of the upload.
    placeholder: Option<Storage>,
    /// A Linear's weight over the conditioning vector (`set_host_products`): held on the
    /// host for its products from the first fetch on.
    conditioned: bool,
}

/// What an upload of a block must bring (`BlockStreamer::start`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Need {
    /// Every weight: a forward, or a re-run whose forward's digest is unknown.
    Whole,
    /// The weights a re-run of a forward of this digest reads.
    Rerun(u64),
    /// A forward that finds the products of its weights over an announced input computed
    /// ahead (`set_ahead_products`): every weight but those, for the announcement of this
    /// number.
    Ahead(u64),
}

/// What a partial device copy lacks (`Block::partial`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Partial {
    /// The forward-only weights of forwards of this digest (a backward's upload).
    Rerun(u64),
    /// The weights whose products for announcement this number were computed ahead.
    Ahead(u64),
}

enum Residency {
    Released,
    /// Copies started, not yet waited for by the compute work.
    InFlight(Ticket, UploadRecord),
    Resident,
}

struct Block {
    prefix: String,
    params: Vec<Param>,
    /// Every parameter's values in one host buffer, made at the first fetch: one copy (a few
    /// pieces when coded) and one device allocation per fetch instead of one per parameter.
    pack: Option<HostPack>,
    /// With `set_raw_backward`, the same values uncoded for the backward's uploads, where
    /// `pack` is coded.
    raw_pack: Option<HostPack>,
    residency: Residency,
    /// For each parameter, whether the last re-run found only the forward reads it
    /// (`CheckpointHooks::forward_only`), and the digest of the forward it re-ran: a backward
    /// whose forward has the same digest (`digest`) leaves those weights out of its upload.
    forward_only: Vec<bool>,
    only_digest: Option<u64>,
    /// The digest of the forwards since the block's last re-run that a backward will re-run
    /// (`None` when two of them differ: a backward may then serve either).
    digest: Option<u64>,
    /// Whether a forward has reported its digest since the block's last re-run.
    pending: bool,
    /// What the device copy lacks: the forward-only weights of the forward whose re-run it
    /// was brought for (a backward's upload), or the weights whose products were computed
    /// ahead (a forward's); `None` when whole.
    partial_for: Option<Partial>,
    /// For each parameter, whether its Linear took the forward's announced input
    /// (`set_ahead_products`): the products the backward computes ahead.
    fed: Vec<bool>,
    /// For each parameter, its product over the input announced for the next forward, and
    /// that announcement's number (`set_ahead_products`).
    ahead: Vec<Option<(u64, Tensor)>>,
    /// A crossing of its first pieces into the staging ring made at the backward's end for
    /// the next forward's upload (`cross_ahead`).
    crossed: Option<u64>,
}

struct State {
    blocks: Vec<Block>,
    report: StreamReport,
    /// Nanoseconds spent in the blocks' entries and exits (`StreamReport::host_us`), summed
    /// before rounding so short calls count.
    host_ns: u64,
    /// Tickets of uploads the compute work has waited for, until their copies' durations can
    /// be read.
    timing: Vec<(Ticket, UploadRecord)>,
    /// The timed uploads' records, when traced (`BlockStreamer::trace_uploads`).
    trace: Option<Vec<UploadRecord>>,
    /// The compute work's timed waits for uploads while traced, until their events have
    /// passed, and their records since (`BlockStreamer::take_stalls`).
    waits: Vec<(usize, bool, Stall)>,
    stalls: Vec<StallRecord>,
    /// Whether the blocks' packs are made (`seal`, at the first fetch).
    sealed: bool,
    /// Whether bf16 weights cross the link coded (`set_wire_code`).
    code: bool,
    /// The first blocks that cross uncoded whatever `code` says (`set_uncoded_first`).
    uncoded_first: usize,
    /// Whether the backward's uploads cross uncoded (`set_raw_backward`).
    raw_backward: bool,
    /// Where coded uploads land before their decode (the largest pack's coded bytes), made
    /// with the packs.
    staging: Option<Staging>,
    /// For each block, the last block the forward may have on the device while it runs
    /// (`set_reach`; `prefetch` ahead unless set).
    reach: Vec<usize>,
    /// The first blocks the backward leaves on the device for the next forward
    /// (`memory::carry` of `reach`).
    carry: usize,
    /// Key endings of the weights held on the host for their products
    /// (`set_host_products`).
    host_keys: Vec<String>,
    /// Whether the backward's end crosses the next forward's first uploads into the staging
    /// ring (`set_cross_ahead`).
    cross: bool,
    /// Whether this backward has crossed the next forward's first uploads into the staging
    /// ring (`cross_ahead`); cleared at each forward's start.
    crossed_ahead: bool,
    /// The input announced for the next forward: its number, the model's input it is made
    /// from, and itself (`announce_input`).
    announced: Option<(u64, Tensor, Tensor)>,
    /// The input the forward under way takes, and the number of the announcement it is
    /// (`take_input`); `None` for an input nobody announced.
    input: Option<(Option<u64>, Tensor)>,
    /// Announcements made so far.
    announcements: u64,
}

impl State {
    /// Adds the durations of the finished copies in `timing` to the report, and of the
    /// passed waits in `waits` to `stalls`.
    fn collect_timings(&mut self) {
        let stalls = &mut self.stalls;
        self.waits.retain(|(block, backward, w)| match w.ms() {
            Some(ms) => {
                stalls.push(StallRecord {
                    block: *block,
                    backward: *backward,
                    ms,
                });
                false
            }
            None => true,
        });
        let (report, trace) = (&mut self.report, &mut self.trace);
        self.timing.retain(|(t, r)| match t.copy_ms() {
            Some((ms, span, decode)) => {
                report.copy_us += (ms * 1e3).round() as u64;
                report.span_us += (span * 1e3).round() as u64;
                report.decode_us += (decode * 1e3).round() as u64;
                report.timed_uploads += 1;
                report.timed_bytes += r.wire_bytes;
                if let Some(v) = trace {
                    v.push(UploadRecord {
                        copy_ms: ms,
                        span_ms: span,
                        decode_ms: decode,
                        ..*r
                    });
                }
                false
            }
            None => true,
        });
    }
}

/// Streams the frozen weights of a list of blocks (key prefixes, in execution order) between
/// host memory and `device`: see the module docs of `crate::memory`.
pub struct BlockStreamer {
    device: Device,
    prefetch: usize,
    state: Mutex<State>,
    /// The weights held on the host for their products (`set_host_products`).
    products: HostProducts,
    /// Whether the backward computes the products of the forward-only weights over the
    /// input announced for the next forward (`set_ahead_products`); read without the lock
    /// by every hooked Linear (`ahead_product`).
    ahead_on: std::sync::atomic::AtomicBool,
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

impl crate::nn::HostWeights for BlockStreamer {
    fn device(&self) -> &Device {
        &self.device
    }

    /// A weight under one of the streamed blocks' prefixes, into host memory
    /// (`adopt_key`); others stay.
    fn place(&self, key: &str, t: &Tensor) -> Result<Option<Tensor>> {
        match self.owner(key)? {
            Some(block) => self.adopt_key(block, key, t).map(Some),
            None => Ok(None),
        }
    }
}

impl BlockStreamer {
    /// A streamer for the blocks named by `prefixes` (execution order), fetching up to
    /// `prefetch` blocks ahead of the one running. Weights join it through `adopt` (the
    /// `VarBuilder` does this for keys under a prefix: `VarBuilder::with_host_weights`).
    pub fn new(device: &Device, prefixes: Vec<String>, prefetch: usize) -> Arc<Self> {
        let blocks = prefixes
            .into_iter()
            .map(|prefix| Block {
                prefix,
                params: vec![],
                pack: None,
                raw_pack: None,
                residency: Residency::Released,
                forward_only: vec![],
                only_digest: None,
                digest: None,
                pending: false,
                partial_for: None,
                fed: vec![],
                ahead: vec![],
                crossed: None,
            })
            .collect::<Vec<_>>();
        // A prefetch past the last block fetches them all.
        let prefetch = prefetch.min(blocks.len());
        let reach = shallow_reach(blocks.len(), prefetch);
        let carry = carry(&reach, prefetch);
        Arc::new(BlockStreamer {
            device: device.clone(),
            prefetch,
            state: Mutex::new(State {
                blocks,
                report: StreamReport::default(),
                host_ns: 0,
                timing: vec![],
                trace: None,
                waits: vec![],
                stalls: vec![],
                sealed: false,
                code: true,
                uncoded_first: 0,
                raw_backward: false,
                staging: None,
                reach,
                carry,
                host_keys: vec![],
                cross: true,
                crossed_ahead: false,
                announced: None,
                input: None,
                announcements: 0,
            }),
            products: HostProducts::default(),
            ahead_on: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// The streamer of `plan` (settled: `MemoryProfile::settle`), `None` where it streams
    /// nothing: its blocks, prefetch, wire code, uncoded first blocks and reach, and with
    /// `plan.host_products` the weights whose keys end with one of `conditioned` (the
    /// family's Linears over the conditioning vector) held on the host for their products.
    /// Weights join it as they load (`VarBuilder::with_host_weights`).
    pub fn for_plan(
        device: &Device,
        plan: &super::Plan,
        conditioned: &[&str],
    ) -> Result<Option<Arc<Self>>> {
        if plan.streamed.is_empty() {
            return Ok(None);
        }
        let s = BlockStreamer::new(device, plan.streamed.clone(), plan.prefetch.max(1));
        s.set_wire_code(plan.wire_code)?;
        s.set_uncoded_first(plan.uncoded_first)?;
        s.set_cross_ahead(plan.cross_ahead)?;
        s.set_raw_backward(plan.raw_backward)?;
        s.set_ahead_products(plan.ahead_products)?;
        if plan.host_products {
            s.set_host_products(conditioned.iter().map(|c| c.to_string()).collect())?;
        }
        if !plan.reach.is_empty() {
            s.set_reach(plan.reach.clone())?;
        }
        Ok(Some(s))
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
    /// (`crate::backend::wire`: about 0.69 of the bytes, decoded on the device as each piece
    /// arrives; the values are the same bit for bit). On by default; set before the first
    /// fetch.
    pub fn set_wire_code(&self, on: bool) -> Result<()> {
        self.unsealed("the wire code is")?.code = on;
        Ok(())
    }

    /// Whether bf16 weights cross the link coded (`set_wire_code`).
    pub fn wire_code(&self) -> Result<bool> {
        Ok(self.lock()?.code)
    }

    /// Makes the first `n` blocks cross uncoded though the wire code is on: the blocks the
    /// backward leaves on the device for the next forward (`carried`), which only the
    /// backward uploads, while its link has time to spare (the planner's
    /// `Plan::uncoded_carry`). Set before the first fetch.
    pub fn set_uncoded_first(&self, n: usize) -> Result<()> {
        self.unsealed("the uncoded blocks are")?.uncoded_first = n;
        Ok(())
    }

    /// Whether the backward's uploads cross uncoded while the forward's cross coded (the
    /// planner's `Plan::raw_backward`): each coded block keeps its raw bytes in host memory
    /// too, and the backward uploads those through the staging ring (sized for them too),
    /// each piece copied into place on the device where a coded one is decoded: no
    /// decodes, more bytes on the link, and the copies still cross ahead of the compute.
    /// Off by default; nothing changes without the wire code. Set before the first fetch.
    pub fn set_raw_backward(&self, on: bool) -> Result<()> {
        self.unsealed("the backward's uncoded uploads are")?
            .raw_backward = on;
        Ok(())
    }

    /// Bytes of pinned host memory the blocks' packs hold (made at the first fetch: 0
    /// before), the raw forms kept for the backward (`set_raw_backward`) among them.
    pub fn host_pack_bytes(&self) -> Result<u64> {
        Ok(self
            .lock()?
            .blocks
            .iter()
            .flat_map(|b| b.pack.iter().chain(b.raw_pack.iter()))
            .map(|p| p.host_bytes() as u64)
            .sum())
    }

    /// Whether the backward's end crosses the coded packs of the next forward's first
    /// uploads into the staging ring (`cross_ahead`; the planner's `Plan::cross_ahead`). On
    /// by default; nothing crosses without the wire code.
    pub fn set_cross_ahead(&self, on: bool) -> Result<()> {
        self.lock()?.cross = on;
        Ok(())
    }

    /// Whether the backward computes the products of the weights the forward reads alone
    /// over an input announced for the next forward (`announce_input`; the planner's
    /// `Plan::ahead_products`): where a forward-only weight's Linear took the forward's input
    /// (`take_input`: SDXL's cross-attention keys and values over the text context, a few
    /// rows each), its re-run's upload brings it anyway, and once the block's backward is
    /// done its product over the announced input is computed and kept; the next forward,
    /// given that input, takes the products and leaves those weights out of its uploads
    /// (but for the last `prefetch + 1` blocks, which stay for the backward). The link's
    /// bytes move from the forward, where they pace SDXL's step within a few GiB, to the
    /// backward. Off by default; a forward given any other input brings every weight.
    pub fn set_ahead_products(&self, on: bool) -> Result<()> {
        self.ahead_on
            .store(on, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }

    /// Whether the backward computes products ahead (`set_ahead_products`).
    pub fn ahead_products(&self) -> bool {
        self.ahead_on.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Announces `input`, made from the model's input `source`, as what the next forward's
    /// blocks take (`set_ahead_products`); the forward that is handed `source` itself takes
    /// it (`take_input`). Nothing without `set_ahead_products`.
    pub fn announce_input(&self, source: &Tensor, input: Tensor) -> Result<()> {
        if !self.ahead_products() {
            return Ok(());
        }
        let mut st = self.lock()?;
        st.announcements += 1;
        st.announced = Some((st.announcements, source.clone(), input));
        Ok(())
    }

    /// The input a forward's blocks take from the model's input `source`: the announced one
    /// where `source` is the announced source (the same buffer, view and dtype), whose
    /// products the backward before computed; else `make()`, whose products the blocks
    /// compute as usual.
    pub fn take_input(
        &self,
        source: &Tensor,
        make: impl FnOnce() -> Result<Tensor>,
    ) -> Result<Tensor> {
        if !self.ahead_products() {
            return make();
        }
        let mut st = self.lock()?;
        if let Some((g, src, input)) = &st.announced {
            // An input that needs a gradient (a text encoder trained with the model) needs
            // the weights in the backward: its forward brings them.
            if src.same_storage(source)
                && src.layout() == source.layout()
                && !source.requires_grad()
            {
                let (g, input) = (*g, input.clone());
                st.announced = None;
                st.input = Some((Some(g), input.clone()));
                return Ok(input);
            }
        }
        drop(st);
        let input = make()?;
        self.lock()?.input = Some((None, input.clone()));
        Ok(input)
    }

    /// The state, while the packs are not made yet (`seal`): what they are made with
    /// (`what`, with its verb) is chosen before the first fetch.
    fn unsealed(&self, what: &str) -> Result<MutexGuard<'_, State>> {
        let st = self.lock()?;
        if st.sealed {
            return Err(Error::Stream(format!(
                "{what} chosen before the first fetch"
            )));
        }
        Ok(st)
    }

    /// Lets the forward fetch further ahead than `prefetch` where memory allows: while
    /// block `j` runs, blocks up to `reach[j]` may be on the device (fetched in order, the
    /// link kept busy). The backward then leaves the first `memory::carry(reach, prefetch)`
    /// blocks on the device for the next forward, which begins with them. `reach` has one
    /// entry per block, each at least `prefetch` ahead (or the last block), never beyond
    /// the last, and never decreasing; the planner's `MemoryProfile::reach` makes it from
    /// the memory the blocks' checkpoints take later in the step. Past the prefetch, blocks
    /// are fetched and kept only while the device's cap has room for two in one piece each
    /// (`Device::room`).
    pub fn set_reach(&self, reach: Vec<usize>) -> Result<()> {
        let mut st = self.lock()?;
        let n = st.blocks.len();
        if reach.len() != n {
            return Err(Error::Stream(format!(
                "a reach for {} blocks given to a streamer of {n}",
                reach.len()
            )));
        }
        let floor = shallow_reach(n, self.prefetch);
        for (j, &r) in reach.iter().enumerate() {
            if r >= n || r < floor[j] || (j > 0 && r < reach[j - 1]) {
                return Err(Error::Stream(format!(
                    "reach {r} for block {j} of {n} (prefetch {}): each must be at least \
                     {} and no less than the one before, below {n}",
                    self.prefetch, floor[j]
                )));
            }
        }
        st.carry = carry(&reach, self.prefetch);
        st.reach = reach;
        Ok(())
    }

    /// How many of the first blocks the backward may leave on the device for the next
    /// forward (fewer while the device lacks the room `set_reach` asks for).
    pub fn carried(&self) -> Result<usize> {
        Ok(self.lock()?.carry)
    }

    /// Keeps a record of each timed upload from now on (`take_trace`), or stops.
    pub fn trace_uploads(&self, on: bool) -> Result<()> {
        let mut st = self.lock()?;
        st.collect_timings();
        st.trace = on.then(Vec::new);
        st.waits.clear();
        st.stalls.clear();
        Ok(())
    }

    /// While a trace is kept (`trace_uploads`): each wait of the compute work for an upload
    /// since the last call, in the order the device passed them (those it has not passed
    /// yet come at a later call). Where the compute stood idle for the link or the decodes.
    pub fn take_stalls(&self) -> Result<Vec<StallRecord>> {
        let mut st = self.lock()?;
        st.collect_timings();
        Ok(std::mem::take(&mut st.stalls))
    }

    /// The timed uploads' records since the last call (or since `trace_uploads`), in the
    /// order their copies were waited for.
    pub fn take_trace(&self) -> Result<Vec<UploadRecord>> {
        let mut st = self.lock()?;
        st.collect_timings();
        Ok(st.trace.as_mut().map(std::mem::take).unwrap_or_default())
    }

    /// The counters so far, with `blocks` the number of streamed blocks.
    pub fn report(&self) -> Result<StreamReport> {
        let mut st = self.lock()?;
        st.collect_timings();
        Ok(StreamReport {
            blocks: st.blocks.len(),
            resident: st
                .blocks
                .iter()
                .filter(|b| !matches!(b.residency, Residency::Released))
                .count(),
            host: self.products.report()?,
            host_us: st.host_ns / 1000,
            ..st.report
        })
    }

    /// The streamed block that parameter `key` belongs to (`<prefix>.<rest>`).
    pub fn owner(&self, key: &str) -> Result<Option<usize>> {
        Ok(self
            .lock()?
            .blocks
            .iter()
            .position(|b| super::under(key, &b.prefix)))
    }

    /// Holds the weights whose keys end with one of `endings` in host memory for good,
    /// computing their products there (`crate::memory` module `products`): the Linears over
    /// the conditioning vector (`BlockShape::conditioned`), a few rows each, whose weights
    /// then never cross the link nor take device memory. Only for weights whose input needs
    /// no gradient and whose adapter reads no frozen weight (not DoRA): a Linear that would
    /// read such a weight on the device is an error (`Error::Stream`). Set before the
    /// weights are adopted (`VarBuilder::with_host_weights`); none by default.
    pub fn set_host_products(&self, endings: Vec<String>) -> Result<()> {
        let mut st = self.lock()?;
        if st.sealed || st.blocks.iter().any(|b| !b.params.is_empty()) {
            return Err(Error::Stream(
                "the weights held on the host are chosen before any weight is adopted".into(),
            ));
        }
        st.host_keys = endings;
        Ok(())
    }

    /// Bytes of the weights held on the host for their products (`set_host_products`).
    pub fn host_product_bytes(&self) -> Result<u64> {
        self.products.bytes()
    }

    /// As `adopt`, for the weight of key `key`: one whose key ends with one of
    /// `set_host_products`' endings, a floating-point (out, in) weight (FP8 codes are not),
    /// is held on the host for its products from the first fetch on. The products of a
    /// forward's input are computed ahead where it was announced (`prepare_products`);
    /// otherwise the first block's product brings the input over and starts them all.
    pub fn adopt_key(&self, block: usize, key: &str, t: &Tensor) -> Result<Tensor> {
        let conditioned = self
            .lock()?
            .host_keys
            .iter()
            .any(|e| key.ends_with(e.as_str()))
            && matches!(
                t.dtype(),
                crate::DType::BF16 | crate::DType::F16 | crate::DType::F32
            )
            && t.rank() == 2;
        self.adopt_as(block, t, conditioned)
    }

    /// Whether `weight` is held on the host for its products.
    fn computes(&self, weight: &Tensor) -> Result<bool> {
        self.products.holds(weight)
    }

    /// Announces the input of the conditioning Linears of a coming forward (the
    /// activation the model hands every block, `x` (rows, in)): the products of the weights
    /// held on the host (`set_host_products`) are computed for it from when the device's work
    /// so far has computed it, without the caller waiting, and a forward whose input has the
    /// same values takes them instead of waiting for its own (`crate::memory` module
    /// `products`). Nothing where no weights are held (before the first fetch, too).
    pub fn prepare_products(&self, x: &Tensor) -> Result<()> {
        self.products.prepare(x)
    }

    /// `x @ weight^T` computed on the host when `weight` is held there
    /// (`set_host_products`), else `None`.
    pub(crate) fn product(&self, weight: &Tensor, x: &Tensor) -> Result<Option<Tensor>> {
        self.products.product(weight, x)
    }

    /// Takes parameter `t` of block `block` into host memory and returns the handle the
    /// model keeps: same shape, dtype and device, its buffer released until the block is
    /// fetched. `t`'s own device buffer is freed once the caller drops `t`.
    pub fn adopt(&self, block: usize, t: &Tensor) -> Result<Tensor> {
        self.adopt_as(block, t, false)
    }

    fn adopt_as(&self, block: usize, t: &Tensor, conditioned: bool) -> Result<Tensor> {
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
        let began = std::time::Instant::now();
        let host = {
            let s = t.storage()?;
            s.stash(t.layout().offset() + t.elem_count())?
        };
        let handle = t.with_storage(self.device.placeholder(t.dtype())?);
        let mut st = self.lock()?;
        st.report.host_bytes += host.bytes() as u64;
        st.report.adopt_us += began.elapsed().as_micros() as u64;
        let sealed = st.sealed;
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
            conditioned,
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

    /// Starts copying block `i`'s weights to the device for `need`, unless they are there or
    /// coming. A backward's upload for the re-run of a forward of digest `d`
    /// (`Need::Rerun(d)`) leaves out the weights an earlier re-run of a forward of that
    /// digest found only the forward reads, except for the blocks the backward leaves on the
    /// device for the next forward. With `verify`, a copy that lacks weights `need` may read
    /// (brought for another digest's re-run, or a forward finding one a backward that stopped
    /// midway left) is released and the block brought again; without (a prefetch, whose
    /// digest is a guess), a copy there stays until its own run verifies it. The backward's
    /// uploads take the block's raw form where it keeps one (`set_raw_backward`). Whether an
    /// upload was started.
    fn start(
        &self,
        st: &mut State,
        i: usize,
        need: Need,
        pass: Pass,
        verify: bool,
    ) -> Result<bool> {
        let Some(b) = st.blocks.get(i) else {
            return Ok(false);
        };
        if !matches!(b.residency, Residency::Released) {
            let enough = match (b.partial_for, need) {
                (None, _) => true,
                (Some(Partial::Rerun(d)), Need::Rerun(e)) => d == e,
                (Some(Partial::Ahead(g)), Need::Ahead(h)) => g == h,
                (Some(_), _) => false,
            };
            if enough || !verify {
                return Ok(false);
            }
            self.release(st, i)?;
        }
        let b = &st.blocks[i];
        if b.params.is_empty() {
            return Ok(false);
        }
        // The weights the upload leaves out: a re-run's, those only the forward reads but
        // for the ones whose products over an announced input it computes ahead (`fed`);
        // a forward's, those whose products it finds computed (`Need::Ahead`).
        let skip: Vec<bool> = match need {
            Need::Rerun(d) if i > self.prefetch && i >= st.carry && b.only_digest == Some(d) => {
                let ahead = self.ahead_products() && st.announced.is_some();
                b.forward_only
                    .iter()
                    .enumerate()
                    .map(|(k, &f)| f && !(ahead && b.fed.get(k).copied().unwrap_or(false)))
                    .collect()
            }
            Need::Ahead(g) => b
                .ahead
                .iter()
                .map(|a| matches!(a, Some((h, _)) if *h == g))
                .collect(),
            _ => vec![],
        };
        let left_out = skip.iter().any(|&f| f);
        if b.pack.is_none() {
            let began = std::time::Instant::now();
            self.seal(st)?;
            st.report.seal_us += began.elapsed().as_micros() as u64;
        }
        let State {
            blocks,
            report,
            staging,
            trace,
            ..
        } = st;
        let Some(b) = blocks.get_mut(i) else {
            return Ok(false);
        };
        let raw = match (pass, &b.raw_pack) {
            (Pass::Backward, Some(raw)) => Some(raw),
            _ => None,
        };
        let Some(pack) = raw.or(b.pack.as_ref()) else {
            return Ok(false);
        };
        let skip: &[bool] = if left_out { &skip } else { &[] };
        let (mut wire, mut bytes, mut left) = (0u64, 0u64, 0u64);
        for (k, (device, link)) in pack.part_bytes().into_iter().enumerate() {
            if skip.get(k).copied().unwrap_or(false) {
                left += device as u64;
            } else {
                wire += link as u64;
                bytes += device as u64;
            }
        }
        // The copy takes its own pack's bytes (Flux-dev's single blocks, their conditioning
        // weights held on the host, a third of a double block's).
        // One upload in `TIME_EVERY` is timed (each of its copies and decodes between timed
        // events), or every one while a trace is kept: chosen by the upload count's
        // Fibonacci hash, so that the sample does not lock onto the same places of every
        // step (a step of a multiple of `TIME_EVERY` uploads would time the same blocks).
        let timed = trace.is_some()
            || (report.uploads.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32) % TIME_EVERY == 0;
        // A crossing made at the backward's end for this upload is decoded in place of
        // its first pieces (where another upload has not overwritten it). A raw form
        // crosses through the staging ring too, copied into place from it (the crossing
        // waits for the forward); an uncoded pack (the carried blocks with
        // `set_uncoded_first`) straight into place.
        let (staging, crossed) = match raw {
            Some(_) => (staging.as_ref(), None),
            None if pack.is_coded() => (staging.as_ref(), b.crossed.take()),
            None => (None, b.crossed.take()),
        };
        let (storages, ticket) = self
            .device
            .upload_pack(pack, staging, skip, timed, crossed)?;
        // Those pieces crossed the link at the crossing (counted then).
        let landed = ticket.landed_bytes() as u64;
        report.landed_bytes += landed;
        wire -= landed.min(wire);
        for (p, storage) in b.params.iter_mut().zip(storages) {
            if let Some(storage) = storage {
                p.placeholder = Some(p.tensor.swap_storage(storage)?);
            }
        }
        let coded = wire < bytes;
        b.residency = Residency::InFlight(
            ticket,
            UploadRecord {
                block: i,
                whole: !left_out,
                coded,
                wire_bytes: wire,
                copy_ms: 0.0,
                span_ms: 0.0,
                decode_ms: 0.0,
            },
        );
        b.partial_for = match need {
            Need::Rerun(d) if left_out => Some(Partial::Rerun(d)),
            Need::Ahead(g) if left_out => Some(Partial::Ahead(g)),
            _ => None,
        };
        report.uploads += 1;
        report.uploaded_bytes += wire;
        report.decoded_bytes += bytes;
        report.left_out_bytes += left;
        Ok(true)
    }

    /// Marks the weights of block `i` among `weights` as read by its forward only, for
    /// forwards of digest `digest` (see `CheckpointHooks::forward_only`); the others as read
    /// by its backward too.
    fn note_forward_only(&self, i: usize, weights: &[Tensor], digest: u64) -> Result<()> {
        let mut st = self.lock()?;
        let Some(b) = st.blocks.get_mut(i) else {
            return Ok(());
        };
        let ids: Vec<_> = weights.iter().map(Tensor::id).collect();
        b.forward_only = b
            .params
            .iter()
            .map(|p| ids.contains(&p.tensor.id()))
            .collect();
        b.only_digest = Some(digest);
        b.pending = false;
        Ok(())
    }

    /// Records the digest of block `i`'s forward (`CheckpointHooks::forward_digest`). Several
    /// forwards before their backwards (two losses summed, say) with different digests leave
    /// none: the backward's uploads then bring every weight until a forward follows a re-run.
    fn note_digest(&self, i: usize, digest: u64) -> Result<()> {
        if let Some(b) = self.lock()?.blocks.get_mut(i) {
            if b.pending {
                if b.digest != Some(digest) {
                    b.digest = None;
                }
            } else {
                b.digest = Some(digest);
                b.pending = true;
            }
        }
        Ok(())
    }

    /// Joins every block's weights into its pack (at the first fetch: every weight has been
    /// adopted by then), bf16 weights coded when `code` is on (but in the first
    /// `uncoded_first` blocks; each upload then takes its
    /// pack's bytes: the planner's `MemoryProfile::layout` counts them so); and makes the
    /// staging ring coded uploads cross into (`crate::backend::wire::staging_ring_bytes`: a copy goes
    /// into the ring while the decode stream empties the pieces before it).
    fn seal(&self, st: &mut State) -> Result<()> {
        let (code, uncoded_first, raw_backward) = (st.code, st.uncoded_first, st.raw_backward);
        for (i, b) in st.blocks.iter_mut().enumerate() {
            if b.pack.is_some() || b.params.is_empty() {
                continue;
            }
            // The conditioning Linears' weights stay on the host for their products. The
            // values first: an error leaves the block's weights as they were.
            let values = b
                .params
                .iter()
                .map(|p| match (&p.host, p.conditioned) {
                    (Some(h), true) => h.to_cpu().map(Some),
                    _ => Ok(None),
                })
                .collect::<Result<Vec<_>>>()?;
            let mut kept = Vec::with_capacity(b.params.len());
            for (p, v) in b.params.drain(..).zip(values) {
                match v {
                    Some(v) => self.products.hold(&p.tensor, v)?,
                    None => kept.push(p),
                }
            }
            b.params = kept;
            if b.params.is_empty() {
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
            let coded = code && i >= uncoded_first;
            let pack = self.device.pack(&hosts, coded)?;
            // The raw form beside a pack that holds code (a block of no bf16 weight has
            // none to code: its pack is raw already).
            b.raw_pack = if coded && raw_backward && pack.is_coded() {
                Some(self.device.pack(&hosts, false)?)
            } else {
                None
            };
            b.pack = Some(pack);
            for p in &mut b.params {
                p.host = None;
            }
        }
        // The raw forms cross the ring whole too, in pieces of the ring's size (their
        // largest piece that of the ring's largest upload).
        let raw = st
            .blocks
            .iter()
            .filter_map(|b| b.raw_pack.as_ref().map(HostPack::raw_staging_bytes));
        let (wire, part, pieces) = st
            .blocks
            .iter()
            .filter_map(|b| b.pack.as_ref().map(HostPack::staging_bytes))
            .chain(raw.clone())
            .fold((0, 0, 0), |(w, p, n), (bw, bp, bn)| {
                (w.max(bw), p.max(bp), n.max(bn))
            });
        let part = if raw.clone().any(|(w, _, _)| w > 0) {
            part.max(crate::backend::wire::staging_piece(wire))
        } else {
            part
        };
        st.staging = self.device.staging(wire, part, pieces)?;
        st.sealed = true;
        Ok(())
    }

    /// Makes the compute work wait for block `i`'s upload, if in flight; `pass`: the pass
    /// about to use it (its wait is timed while a trace is kept), None for a release.
    fn wait(&self, st: &mut State, i: usize, pass: Option<Pass>) -> Result<()> {
        let Some(b) = st.blocks.get_mut(i) else {
            return Ok(());
        };
        if let Residency::InFlight(ticket, _) = &b.residency {
            match pass {
                Some(p) if st.trace.is_some() => {
                    let w = self.device.wait_timed(ticket)?;
                    st.waits.push((i, p == Pass::Backward, w));
                }
                _ => self.device.wait(ticket)?,
            }
            let Some(b) = st.blocks.get_mut(i) else {
                return Ok(());
            };
            if let Residency::InFlight(ticket, record) =
                std::mem::replace(&mut b.residency, Residency::Resident)
            {
                if ticket.timed() {
                    st.timing.push((ticket, record));
                }
            }
        }
        if st.timing.len() + st.waits.len() >= 64 {
            st.collect_timings();
        }
        Ok(())
    }

    /// Releases block `i`'s device copies (after the compute work waits for their copies, so
    /// a buffer never returns to the cache while a copy may write it).
    fn release(&self, st: &mut State, i: usize) -> Result<()> {
        self.wait(st, i, None)?;
        let Some(b) = st.blocks.get_mut(i) else {
            return Ok(());
        };
        if !matches!(b.residency, Residency::Resident) {
            return Ok(());
        }
        // A parameter without a placeholder kept holds its own: it was left out.
        for p in &mut b.params {
            if let Some(placeholder) = p.placeholder.take() {
                drop(p.tensor.swap_storage(placeholder)?);
            }
        }
        b.residency = Residency::Released;
        b.partial_for = None;
        Ok(())
    }

    /// Brings block `i` in, and starts the blocks after it in the pass's direction: up to
    /// its reach in the forward, `prefetch` in the backward. `digest`: the digest of the
    /// forward a backward's run re-runs.
    fn enter(&self, i: usize, pass: Pass, digest: Option<u64>) -> Result<()> {
        let t0 = std::time::Instant::now();
        let mut st = self.lock()?;
        let r = self.enter_locked(&mut st, i, pass, digest);
        st.host_ns += t0.elapsed().as_nanos() as u64;
        r
    }

    fn enter_locked(
        &self,
        st: &mut State,
        i: usize,
        pass: Pass,
        digest: Option<u64>,
    ) -> Result<()> {
        // A re-run needs what its forward's digest says; a forward, everything.
        let need = |digest: Option<u64>| match digest {
            Some(d) if pass == Pass::Backward => Need::Rerun(d),
            _ => Need::Whole,
        };
        // What the backward before left for this forward (`StreamReport::carried_found`).
        if pass == Pass::Forward && i == 0 {
            let found = st.blocks[..st.carry.min(st.blocks.len())]
                .iter()
                .filter(|b| !matches!(b.residency, Residency::Released))
                .count();
            st.report.forwards += 1;
            st.report.carried_found += found as u64;
            st.crossed_ahead = false;
        }
        let first = if pass == Pass::Forward {
            self.forward_need(st, i)
        } else {
            need(digest)
        };
        self.start(st, i, first, pass, true)?;
        match pass {
            Pass::Forward => {
                let (n, last) = (st.blocks.len(), st.reach.get(i).copied().unwrap_or(i));
                // Blocks outside the forward's window here (before this one, but for the last
                // ones the forward keeps for the backward; past the reach) were left by a
                // pass no backward followed (a validation forward under no_grad, a skipped
                // step): release them, so the window has the memory the plan gives it.
                let tail = i.min(n.saturating_sub(self.prefetch + 1));
                for j in (0..tail).chain(last + 1..n) {
                    if !matches!(st.blocks[j].residency, Residency::Released) {
                        self.release(st, j)?;
                    }
                }
                // The device's room, read again only after an upload took some of it.
                let mut room = self.device.room();
                for j in i + 1..=last {
                    // Past the prefetch, only while the device has room for this block and
                    // one more in one piece (`has_room`).
                    if j > i + self.prefetch && room < 2 * Self::pack_bytes(st, j) {
                        break;
                    }
                    let need = self.forward_need(st, j);
                    if self.start(st, j, need, pass, true)? {
                        room = self.device.room();
                    }
                }
            }
            Pass::Backward => {
                // The blocks before it will most likely serve re-runs of the forwards since
                // their last re-run (`digest`): a guess, verified when each enters.
                for j in (i.saturating_sub(self.prefetch)..i).rev() {
                    let guess = need(st.blocks[j].digest);
                    self.start(st, j, guess, pass, false)?;
                }
                // The backward's last upload is issued (its window reached the first block):
                // the link has nothing more to carry this step.
                if i <= self.prefetch && !st.crossed_ahead {
                    st.crossed_ahead = true;
                    self.cross_ahead(st)?;
                }
            }
        }
        self.wait(st, i, Some(pass))
    }

    /// Crosses the coded packs of the next forward's first uploads (the first released
    /// blocks, in order, past those that cross uncoded) into the staging ring, as far
    /// as it has room (`Device::cross_pack`): the link is idle from the backward's last
    /// upload to the next forward's first, and the ring too, so those bytes leave the
    /// forward's link (Klein 9B within 8 GiB: a link-paced forward, about 0.8 GiB of ring).
    /// The forward's uploads decode them instead of copying them again.
    fn cross_ahead(&self, st: &mut State) -> Result<()> {
        // Where the next forward takes products computed ahead its uploads leave weights
        // out, and a whole pack's crossing would be copied again: nothing crosses.
        if !st.code || !st.cross || (self.ahead_products() && st.announced.is_some()) {
            return Ok(());
        }
        // The forward uploads its released blocks in order, those the backward could not
        // leave for lack of room among them; the first ones cross uncoded, past the ring.
        let from = st.uncoded_first;
        let State {
            blocks,
            report,
            staging,
            ..
        } = st;
        if staging.is_none() {
            return Ok(());
        }
        for b in blocks.iter_mut().skip(from) {
            if !matches!(b.residency, Residency::Released) {
                continue;
            }
            // A block with nothing on the device (its weights held on the host) has no pack.
            let Some(pack) = &b.pack else {
                continue;
            };
            match self.device.cross_pack(pack, staging.as_ref())? {
                Some((id, bytes, whole)) => {
                    b.crossed = Some(id);
                    report.crossed_bytes += bytes as u64;
                    report.uploaded_bytes += bytes as u64;
                    if !whole {
                        break;
                    }
                }
                None => break,
            }
        }
        Ok(())
    }

    /// Releases block `i` after a run, except the blocks the next pass starts with: the last
    /// `prefetch + 1` after a forward that records (the backward begins there and would
    /// fetch them at once; a forward without gradients releases every block), the first
    /// `carry` after the backward (the next step's forward begins there: `prefetch + 1`, or
    /// more with `set_reach`). The device holds that many streamed blocks
    /// at those points of a pass anyway (the one running and those in flight), so keeping
    /// them costs no peak and saves their uploads.
    fn exit(&self, i: usize, pass: Pass) -> Result<()> {
        let t0 = std::time::Instant::now();
        if pass == Pass::Backward {
            self.compute_ahead(i)?;
        }
        let mut st = self.lock()?;
        // A forward's last blocks stay for the backward, which begins with them; a forward
        // without gradients (validation, sampling) has no backward to keep them for.
        let keep = match pass {
            Pass::Forward => {
                crate::autograd::grad_enabled() && i + 1 + self.prefetch >= st.blocks.len()
            }
            Pass::Backward => i <= self.prefetch || (i < st.carry && self.has_room(&st, i)),
        };
        let r = if keep {
            Ok(())
        } else {
            self.release(&mut st, i)
        };
        st.host_ns += t0.elapsed().as_nanos() as u64;
        r
    }

    /// What the forward's upload of block `i` must bring: every weight but those whose
    /// products over the forward's input were computed ahead for it (`set_ahead_products`),
    /// and every weight for the last `prefetch + 1` blocks, which the forward leaves on the
    /// device for the backward (where the products for the next announcement are computed).
    fn forward_need(&self, st: &State, i: usize) -> Need {
        let n = st.blocks.len();
        match (&st.input, st.blocks.get(i)) {
            (Some((Some(g), _)), Some(b))
                if self.ahead_products()
                    && i + 1 + self.prefetch < n
                    && b.ahead.iter().any(|a| matches!(a, Some((h, _)) if h == g)) =>
            {
                Need::Ahead(*g)
            }
            _ => Need::Whole,
        }
    }

    /// After block `i`'s re-run and backward, while its weights are on the device: the
    /// products of the weights whose Linears took the forward's input (`fed`) over the input
    /// announced for the next forward (`announce_input`), kept for that forward, which then
    /// leaves those weights out of its upload (`set_ahead_products`).
    fn compute_ahead(&self, i: usize) -> Result<()> {
        let (g, x, jobs) = {
            let st = self.lock()?;
            let (Some((g, _, x)), Some(b)) = (&st.announced, st.blocks.get(i)) else {
                return Ok(());
            };
            if !self.ahead_products() || !matches!(b.residency, Residency::Resident) {
                return Ok(());
            }
            let jobs: Vec<(usize, Tensor)> = b
                .params
                .iter()
                .enumerate()
                .filter(|(k, p)| {
                    b.fed.get(*k).copied().unwrap_or(false)
                        && p.placeholder.is_some()
                        && !matches!(b.ahead.get(*k), Some(Some((h, _))) if h == g)
                })
                .map(|(k, p)| (k, p.tensor.clone()))
                .collect();
            (*g, x.clone(), jobs)
        };
        if jobs.is_empty() {
            return Ok(());
        }
        // The same product the Linear's forward computes (no bias: the Linear adds its bias
        // after a product it is handed, as for the host's products).
        let _g = crate::no_grad();
        let mut done = Vec::with_capacity(jobs.len());
        for (k, w) in jobs {
            let (n, inp) = (x.elem_count(), w.dims().get(1).copied().unwrap_or(0));
            if w.rank() != 2 || inp == 0 || n % inp != 0 || w.dtype() != x.dtype() {
                continue;
            }
            let rows = x.reshape((n / inp, inp))?;
            let (y, _) = rows.linear_product(&w.t()?, None, &[])?;
            done.push((k, y));
        }
        let mut st = self.lock()?;
        let State { blocks, report, .. } = &mut *st;
        if let Some(b) = blocks.get_mut(i) {
            b.ahead.resize(b.params.len(), None);
            for (k, y) in done {
                report.ahead_products += 1;
                b.ahead[k] = Some((g, y));
            }
        }
        Ok(())
    }

    /// Block `i`'s product of `weight` over `x` computed ahead, where `x` is the forward's
    /// input (`take_input`) and the product was computed for its announcement; and marks
    /// `weight` as one whose Linear takes that input (`fed`), whose products the backward
    /// then computes ahead for the next announcement.
    fn ahead_product(&self, i: usize, weight: &Tensor, x: &Tensor) -> Result<Option<Tensor>> {
        if !self.ahead_products() {
            return Ok(None);
        }
        let mut st = self.lock()?;
        let Some((number, input)) = &st.input else {
            return Ok(None);
        };
        let same = !x.requires_grad()
            && x.same_storage(input)
            && x.dtype() == input.dtype()
            && x.is_contiguous()
            && x.layout().offset() == input.layout().offset()
            && x.elem_count() == input.elem_count();
        if !same {
            return Ok(None);
        }
        let number = *number;
        let Some(b) = st.blocks.get_mut(i) else {
            return Ok(None);
        };
        let Some(k) = b.params.iter().position(|p| p.tensor.id() == weight.id()) else {
            return Ok(None);
        };
        b.fed.resize(b.params.len(), false);
        b.fed[k] = true;
        Ok(match (number, b.ahead.get(k)) {
            (Some(g), Some(Some((h, y)))) if *h == g && y.dims().first() == x.dims().first() => {
                Some(y.clone())
            }
            _ => None,
        })
    }

    /// Whether the device can make two of block `i`'s buffers in one piece each without going
    /// past its cap: the condition for fetching it past the prefetch or keeping more than
    /// `prefetch + 1` blocks for the next forward. The planner's reach holds the step's
    /// bytes under the peak, but blocks fetched early and released as the checkpoints fill
    /// the memory can cut a cap's arena into pieces no block fits (SD3.5-large within 8 GiB:
    /// 2-3 requests a step past the arena, H100); then the streamer falls back to
    /// the prefetch.
    fn has_room(&self, st: &State, i: usize) -> bool {
        self.device.room() >= 2 * Self::pack_bytes(st, i)
    }

    /// Bytes of block `i`'s device copy (0 before its pack is made).
    fn pack_bytes(st: &State, i: usize) -> u64 {
        st.blocks
            .get(i)
            .and_then(|b| b.pack.as_ref())
            .map_or(0, HostPack::bytes) as u64
    }

    /// Releases every block (e.g. before sampling with another model, or at the end).
    /// The products computed ahead and the inputs they were for go too.
    pub fn release_all(&self) -> Result<()> {
        let mut st = self.lock()?;
        for i in 0..st.blocks.len() {
            self.release(&mut st, i)?;
        }
        for b in &mut st.blocks {
            b.ahead.clear();
        }
        st.announced = None;
        st.input = None;
        Ok(())
    }
}

/// The checkpoint hooks of one streamed block.
pub(crate) struct BlockHooks {
    streamer: Arc<BlockStreamer>,
    index: usize,
}

impl CheckpointHooks for BlockHooks {
    fn enter(&self, pass: Pass, digest: Option<u64>) -> Result<()> {
        self.streamer.enter(self.index, pass, digest)
    }
    fn exit(&self, pass: Pass) -> Result<()> {
        self.streamer.exit(self.index, pass)
    }
    fn forward_digest(&self, digest: u64) -> Result<()> {
        self.streamer.note_digest(self.index, digest)
    }
    fn forward_only(&self, weights: &[Tensor], digest: u64) -> Result<()> {
        self.streamer.note_forward_only(self.index, weights, digest)
    }
    fn product(&self, weight: &Tensor, x: &Tensor) -> Result<Option<Tensor>> {
        match self.streamer.product(weight, x)? {
            Some(y) => Ok(Some(y)),
            None => self.streamer.ahead_product(self.index, weight, x),
        }
    }
    fn computes(&self, weight: &Tensor, x: &Tensor) -> Result<bool> {
        Ok(self.streamer.computes(weight)?
            || self
                .streamer
                .ahead_product(self.index, weight, x)?
                .is_some())
    }
}
