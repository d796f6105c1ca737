//! Launchers of the flash-attention kernels (cuda/attention.cu, cuda/attention_wgmma.cu) behind
//! the `Attention` and `AttentionBackward` kernels of `tensor/kernels/attention.rs`: bf16/f16,
//! head dims 64 and 128 (and 512 forward only).
//!
//! q, k, v, o and do are passed as views (strides over batch, head and row) when their rows
//! are unit-stride and 16-byte aligned, so attention on a permuted qkv projection reads it in
//! place; other views are copied first. Outputs are contiguous. Extra memory: the backward's
//! f32 dq accumulator (B, H, Lq, D) and dvec (B, H, Lq); nothing of size Lq x Lk.

use super::device::CudaDevice;
use super::layout::grid_for;
use super::storage::{launch, CudaStorage, Elem};
use crate::{DType, Error, Layout, Result, Shape};
use cudarc::driver::{DeviceRepr, LaunchConfig};
use half::{bf16, f16};

/// `AttnView` of cuda/attention.cu: a device address and element strides (batch, head, row).
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct View {
    ptr: u64,
    sb: i64,
    sh: i64,
    sr: i64,
}

/// `AttnParams` of cuda/attention.cu, passed by value.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct Params {
    q: View,
    k: View,
    v: View,
    o: View,
    dout: View,
    lse: u64,
    dvec: u64,
    dq_acc: u64,
    keep: u64,
    dq: u64,
    dk: u64,
    dv: u64,
    /// The wgmma forward's u32 tile counter (zeroed before the launch), or 0: blocks take
    /// tiles t, t + G, ... in order.
    tile_counter: u64,
    /// The wgmma backward's f32 dK and dV of the units it splits (zeroed), or 0.
    dkv_part: u64,
    b: i32,
    h: i32,
    lq: i32,
    lk: i32,
    scale: f32,
    scale_log2: f32,
    causal: i32,
    /// For the wgmma kernels: each descriptor's dims order (`tma_map`), 6 bits per operand.
    tma_order: u32,
    /// The deterministic mode's number of dQ slabs (0: atomic adds into one accumulator).
    dq_parts: i32,
    /// The first key block of this launch of the backward.
    kb0: i32,
    /// The wgmma forward's tile order: query tiles in groups of this many heads.
    head_group: i32,
    /// The wgmma backward's units (key block, head) in this launch: key blocks a head, the
    /// first unit split and the blocks each split unit takes (`wg_bwd_split`).
    kblocks: i32,
    split_from: i32,
    split_parts: i32,
}

// SAFETY: plain repr(C) structs of integers and floats, laid out as the C structs the
// kernels declare (8-byte fields first, then an even number of 4-byte fields: no padding).
unsafe impl DeviceRepr for Params {}

/// What `cuTensorMapEncodeTiled` gets for one operand: dims (D first), strides in bytes of
/// dims 1-3, the box, and where row, head and batch went (2 bits each).
#[derive(Debug, PartialEq)]
struct TmaLayout {
    global_dim: [u64; 4],
    global_strides: [u64; 3],
    box_dim: [u32; 4],
    order: u32,
}

/// The layout of `tma_map`: row, head and batch dims of view `v` (B, H, L, D) in the order
/// of their strides, a dim of size 1 last with the stride of a dense layout (its own stride
/// is never used); `None` for a stride of 0 (or less) over more than one element.
fn tma_layout(v: &View, dims: [usize; 4], rows: u32) -> Option<TmaLayout> {
    let [b, h, l, d] = dims;
    let mut outer = [(v.sr, l, 0u32), (v.sh, h, 1), (v.sb, b, 2)];
    outer.sort_by_key(|&(stride, n, _)| (n == 1, stride));
    let mut global_dim = [d as u64, 0, 0, 0];
    // Bytes: the kernels take 2-byte elements.
    let mut global_strides = [0u64; 3];
    let mut order = 0u32;
    let mut extent = d as u64 * 2;
    for (i, &(stride, n, which)) in outer.iter().enumerate() {
        let bytes = match (n, stride) {
            (1, _) => extent,
            (_, s) if s > 0 => s as u64 * 2,
            _ => return None,
        };
        global_dim[i + 1] = n as u64;
        global_strides[i] = bytes;
        extent = bytes * n as u64;
        order |= (i as u32) << (2 * which);
    }
    let mut box_dim = [64u32, 1, 1, 1];
    box_dim[1 + (order & 3) as usize] = rows;
    Some(TmaLayout {
        global_dim,
        global_strides,
        box_dim,
        order,
    })
}

/// A TMA descriptor (`CUtensorMap`, 128 bytes, 64-byte aligned), `TmaMap` of
/// cuda/attention_wgmma.cu, passed by value as a `__grid_constant__` kernel parameter.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct TmaMap([u64; 16]);

// SAFETY: 128 plain bytes, the size and alignment of the kernels' `TmaMap`.
unsafe impl DeviceRepr for TmaMap {}

/// The tensor map of operand `v` (B, H, L, D) for the wgmma kernels: boxes of 64 columns x
/// `rows`, 128-byte swizzle, rows past L read as zeros; and its dims order. Row, head and
/// batch go in the order of their strides, a dim of size 1 last with a stride made up (a
/// squeezed batch of 1 can carry stride 0, which the driver refuses: Flux's single blocks
/// fell back to the mma.sync kernels for that); the order is 2 bits each for row, head and
/// batch (`tma_tile` in cuda/attention_wgmma.cu). `None` when the driver refuses the view
/// (a stride of 0 over more than one element); the caller then takes the mma.sync kernels.
fn tma_map(v: &View, dims: [usize; 4], rows: u32, dtype: DType) -> Option<(TmaMap, u32)> {
    use cudarc::driver::sys::CUtensorMapDataType as Ty;
    let TmaLayout {
        global_dim,
        global_strides,
        box_dim,
        order,
    } = tma_layout(v, dims, rows)?;
    let ty = match dtype {
        DType::BF16 => Ty::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
        _ => Ty::CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
    };
    Some((
        encode_tma(v.ptr, ty, global_dim, global_strides, box_dim)?,
        order,
    ))
}

/// The tensor map of the backward's f32 dq accumulator, (slabs, B H, Lq, D) dense, for the
/// wgmma backward's bulk reductions (stores of the deterministic mode's slabs): boxes of 32
/// columns x 64 rows, 128-byte swizzle (the dQ tiles' layout in shared memory).
fn tma_map_dq(ptr: u64, bh: usize, lq: usize, d: usize, slabs: usize) -> Option<TmaMap> {
    use cudarc::driver::sys::CUtensorMapDataType as Ty;
    let row = d as u64 * 4;
    encode_tma(
        ptr,
        Ty::CU_TENSOR_MAP_DATA_TYPE_FLOAT32,
        [d as u64, lq as u64, bh as u64, slabs as u64],
        [row, row * lq as u64, row * (lq * bh) as u64],
        [32, WG_BWD_DQ_ROWS as u32, 1, 1],
    )
}

/// `cuTensorMapEncodeTiled` of a 4-d tensor at `ptr`: dims innermost first, byte strides of
/// dims 1-3, the box; 128-byte swizzle, elements past the dims read as zeros and not written.
/// `None` when the driver refuses it.
fn encode_tma(
    ptr: u64,
    ty: cudarc::driver::sys::CUtensorMapDataType,
    global_dim: [u64; 4],
    global_strides: [u64; 3],
    box_dim: [u32; 4],
) -> Option<TmaMap> {
    use cudarc::driver::sys;
    let element_strides = [1u32; 4];
    let mut map = std::mem::MaybeUninit::<sys::CUtensorMap>::zeroed();
    // SAFETY: every pointer refers to a live local array of the length the rank (4) implies;
    // the driver only writes the descriptor and reads the arrays.
    let r = unsafe {
        sys::cuTensorMapEncodeTiled(
            map.as_mut_ptr(),
            ty,
            4,
            ptr as *mut std::ffi::c_void,
            global_dim.as_ptr(),
            global_strides.as_ptr(),
            box_dim.as_ptr(),
            element_strides.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    if r != sys::CUresult::CUDA_SUCCESS {
        return None;
    }
    // SAFETY: the driver initialised the descriptor (CUDA_SUCCESS); it is 16 u64s.
    let map = unsafe { map.assume_init() };
    Some(TmaMap(map.opaque))
}

/// Tile sizes, as cuda/attention.cu sets them: the forward's 4 warps take 128 queries and
/// walk keys in tiles of FWD_BC(D); the backward's 8 warps take 128 keys and walk queries in
/// tiles of 64.
const FWD_THREADS: u32 = 128;
const FWD_ROWS: usize = 128;
const BWD_THREADS: u32 = 256;
const BWD_KEYS: usize = 128;
const BWD_ROWS: usize = 64;

fn fwd_keys(d: usize) -> usize {
    if d == 128 {
        32
    } else {
        64
    }
}

fn fwd_smem(d: usize) -> usize {
    // Q (128 x D) and two stages of K and V (FWD_BC x D each), 2-byte elements.
    (FWD_ROWS + 4 * fwd_keys(d)) * d * 2
}

/// Head width of the wide forward kernel (the VAE's single head), its query rows and keys
/// per block, and the output columns each block computes (cuda/attention.cu).
pub(crate) const WIDE_D: usize = 512;
const WIDE_ROWS: usize = 64;
const WIDE_KEYS: usize = 32;
const WIDE_DV: usize = 128;

fn wide_smem() -> usize {
    // Q (64 x 512), two stages of K (32 x 512) and of the V chunk (32 x 128), 2-byte elements.
    (WIDE_ROWS * WIDE_D + 2 * WIDE_KEYS * WIDE_D + 2 * WIDE_KEYS * WIDE_DV) * 2
}

fn bwd_smem(d: usize) -> usize {
    // K, V (128 x D), two stages of Q and dO (64 x D), dS^T (128 x 64); lse and dvec stages.
    (2 * BWD_KEYS * d + 4 * BWD_ROWS * d + BWD_KEYS * BWD_ROWS) * 2 + 4 * BWD_ROWS * 4
}

/// The wgmma kernels (cuda/attention_wgmma.cu). The forward is warp-specialised and
/// persistent (a block per SM; causal attention past 8192 keys a block per tile, see
/// `wg_fwd_grid`): a producer warpgroup and `wg_fwd_consumers` consumer warpgroups of 64
/// queries each, walking keys in tiles of 128 through two stages of K and V. The backward has
/// three warpgroups (a producer and dQ writer, two consumers of 64 keys each), takes 128 keys
/// and walks queries in tiles of `wg_bwd_rows`, adding dQ through a tensor map of the
/// accumulator (`tma_map_dq`, boxes of `WG_BWD_DQ_ROWS` rows). Tiles come by TMA (`tma_map`)
/// and start 1024-aligned, hence the extra KiB.
const WG_BWD_THREADS: u32 = 384;
const WG_FWD_KEYS: usize = 128;
const WG_FWD_STAGES: usize = 2;
const WG_BWD_KEYS: usize = 128;
const WG_BWD_DQ_ROWS: usize = 64;

/// Queries of a backward tile (BwdCfg<D>::BR in the kernel): 128 at D = 64, where the
/// products S^T = K Q^T and dP^T = V dO^T are m64n128 and read 6 KiB of shared memory per
/// 131k multiply-adds instead of 4 KiB per 65k at n64 (after FlashAttention-3's 128 x 128
/// tiles at head dim 64); 64 at D = 128, where the registers hold no more.
fn wg_bwd_rows(d: usize) -> usize {
    if d == 64 {
        128
    } else {
        64
    }
}

/// Consumer warpgroups of the forward (FwdCfg<D, NC>::NC in the kernel): 2 at D = 128; at
/// D = 64 3 (192 queries a tile: the softmax, which costs as much as the products there,
/// hidden under two others' products), but 2 for causal attention up to 2048 queries, whose
/// short tiles of 192 queries compute many keys their first rows never see. H100, harness:
/// causal B 16, H 32, L 1024 302 against 286 TFLOP/s; L 4096 393 against 447.
fn wg_fwd_consumers(d: usize, p: &Params) -> usize {
    if d == 64 && !(p.causal != 0 && p.lq <= 2048) {
        3
    } else {
        2
    }
}

fn wg_fwd_rows(d: usize, p: &Params) -> usize {
    64 * wg_fwd_consumers(d, p)
}

fn wg_fwd_kernel(sfx: &str, d: usize, p: &Params) -> String {
    match (d, wg_fwd_consumers(d, p)) {
        (64, 2) => format!("attnw_fwd_{sfx}_d64_c2"),
        _ => format!("attnw_fwd_{sfx}_d{d}"),
    }
}

fn wg_fwd_threads(d: usize, p: &Params) -> u32 {
    128 * (wg_fwd_consumers(d, p) as u32 + 1)
}

/// The wgmma forward's grid and tile order for `tiles` query tiles. Non-causal tiles are
/// equal: persistent, a block per SM, block b taking tiles b, b + G, ..., a head's tiles side
/// by side. Causal tiles differ in length: up to 8192 keys, persistent with blocks claiming
/// their next tile from a counter (the first free one takes the next), the heaviest first, in
/// groups of heads whose K and V take 32 MiB of L2 (the H100 has 50); longer, a block per
/// tile, a head's tiles side by side, the heaviest first. H100, harness, TFLOP/s (a block per
/// tile / persistent in order / persistent claiming in head groups): non-causal B 16, H 16,
/// L 1024, D 128 503 / 541 / 537; causal 357 / 323 / 390; causal Flux shape 506 / 420 / 546;
/// causal B 16, H 32, L 1024, D 64 (two consumers) 248 / 242 / 302; causal B 1, H 16,
/// L 16384, D 128 647 / 407 / 595. Returns (blocks, head group, counter).
fn wg_fwd_grid(tiles: usize, p: &Params, d: usize, sms: usize) -> (usize, i32, bool) {
    let blocks = tiles.min(sms.max(1));
    if p.causal == 0 {
        return (blocks, 1, false);
    }
    if p.lk > 8192 {
        return (tiles, 1, false);
    }
    // K and V of one head: Lk rows of D 2-byte elements each. At most every head (the
    // kernel's tile numbers, group times query blocks, stay within the tile count).
    let head = (p.lk.max(1) as usize) * d * 2 * 2;
    let heads = (p.b * p.h).max(1) as usize;
    let group = ((32usize << 20) / head).clamp(1, heads) as i32;
    (blocks, group, true)
}

fn wg_fwd_smem(d: usize, p: &Params) -> usize {
    // Q and the stages of K and V; the TMA barriers (Q full and empty, 4 per stage, 8 bytes
    // each) and the next tile's number.
    (wg_fwd_rows(d, p) + 2 * WG_FWD_STAGES * WG_FWD_KEYS) * d * 2
        + 1024
        + 8 * (2 + 4 * WG_FWD_STAGES)
        + 8
}

fn wg_bwd_smem(d: usize) -> usize {
    // K, V, two stages of Q and dO, two buffers of dS; the f32 dQ tile (rows x d); two
    // stages of lse and dvec; the TMA barriers.
    let rows = wg_bwd_rows(d);
    (2 * WG_BWD_KEYS * d + 4 * rows * d + 2 * WG_BWD_KEYS * rows) * 2
        + rows * d * 4
        + 4 * rows * 4
        + 1024
        + 64
}

/// The module of the wgmma kernels, on compute capability 9.0 for head dims 64 and 128,
/// unless `FLAME_ATTENTION=mma` asks for the mma.sync kernels everywhere (for comparisons).
fn wgmma_module(dev: &CudaDevice, d: usize) -> Option<&'static str> {
    static MMA_ONLY: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let mma_only =
        *MMA_ONLY.get_or_init(|| std::env::var("FLAME_ATTENTION").is_ok_and(|v| v == "mma"));
    if mma_only || !matches!(d, 64 | 128) {
        return None;
    }
    super::sm90a_module(dev, "attention_wgmma")
}

fn ptr(s: &CudaStorage) -> u64 {
    s.buf.raw_ptr(s.dev.stream())
}

/// The kernel's view of operand (s, l) (B, H, L, D): in place when rows are unit-stride and
/// 16-byte aligned, else from a contiguous copy kept alive in `keep`.
fn view(
    op: &'static str,
    s: &CudaStorage,
    l: &Layout,
    copies: &mut Vec<CudaStorage>,
) -> Result<View> {
    s.check(op, l)?;
    let st = l.strides();
    let aligned = st[3] == 1 && st[..3].iter().all(|&x| x % 8 == 0) && l.offset() % 8 == 0;
    if aligned {
        return Ok(View {
            ptr: ptr(s) + (l.offset() * 2) as u64,
            sb: st[0] as i64,
            sh: st[1] as i64,
            sr: st[2] as i64,
        });
    }
    let c = s.contiguous(l)?;
    let d = l.dims();
    let v = View {
        ptr: ptr(&c),
        sb: (d[1] * d[2] * d[3]) as i64,
        sh: (d[2] * d[3]) as i64,
        sr: d[3] as i64,
    };
    copies.push(c);
    Ok(v)
}

fn dense_view(ptr: u64, h: usize, l: usize, d: usize) -> View {
    View {
        ptr,
        sb: (h * l * d) as i64,
        sh: (l * d) as i64,
        sr: d as i64,
    }
}

/// Runs the forward (`backward` false: [q, k, v, keep?] -> [o, lse]) or the backward
/// ([q, k, v, o, do, lse, keep?] -> [dq, dk, dv]) of kernel `name` on operands checked by its
/// `check`, with dims [B, H, Lq, Lk, D], `keep` passed when `mask`.
pub(crate) fn flash(
    name: &'static str,
    backward: bool,
    causal: bool,
    scale: f64,
    mask: bool,
    dims: &[usize],
    args: &[(&CudaStorage, &Layout)],
) -> Result<Vec<CudaStorage>> {
    let (b, h, lq, lk, d) = (dims[0], dims[1], dims[2], dims[3], dims[4]);
    let x = args[0].0;
    let shape = || Shape::from(&[b, h, lq, d][..]);
    if !matches!(x.buf.dtype(), DType::BF16 | DType::F16) {
        return Err(Error::UnsupportedDType {
            op: name,
            dtype: x.buf.dtype(),
        });
    }
    let fwd = !backward;
    if !(matches!(d, 64 | 128) || (fwd && d == WIDE_D)) {
        return Err(Error::invalid(
            name,
            format!(
                "the CUDA kernels take head dims 64 and 128 (and {WIDE_D} forward only), not {d}"
            ),
            &shape(),
        ));
    }
    // The persistent forward numbers its query tiles (64 rows or more) in 32 bits, the
    // backward its units (128 keys of a head) and their split parts.
    if b * h > 65535 || lq.max(lk) >= 1 << 30 || b * h * lq.max(lk).div_ceil(64) >= 1 << 31 {
        return Err(Error::invalid(
            name,
            "B * H above 65535, a sequence of 2^30 rows or 2^31 tiles of 64 queries or keys \
             exceeds one launch"
                .to_string(),
            &shape(),
        ));
    }
    let mut copies = vec![];
    let mut p = Params {
        b: b as i32,
        h: h as i32,
        lq: lq as i32,
        lk: lk as i32,
        scale: scale as f32,
        scale_log2: (scale * std::f64::consts::LOG2_E) as f32,
        causal: i32::from(causal),
        ..Params::default()
    };
    p.q = view(name, args[0].0, args[0].1, &mut copies)?;
    p.k = view(name, args[1].0, args[1].1, &mut copies)?;
    p.v = view(name, args[2].0, args[2].1, &mut copies)?;
    if !fwd {
        p.o = view(name, args[3].0, args[3].1, &mut copies)?;
        p.dout = view(name, args[4].0, args[4].1, &mut copies)?;
        let (s, l) = args[5];
        let lse = s.dense(name, l)?;
        p.lse = ptr(lse.as_ref().unwrap_or(s));
        copies.extend(lse);
    }
    if mask {
        let (s, l) = args[args.len() - 1];
        let keep = s.dense(name, l)?;
        p.keep = ptr(keep.as_ref().unwrap_or(s));
        copies.extend(keep);
    }
    let out = match x.buf.dtype() {
        DType::BF16 => launch_all::<bf16>(&x.dev, fwd, &mut p, d),
        DType::F16 => launch_all::<f16>(&x.dev, fwd, &mut p, d),
        dt => Err(Error::UnsupportedDType {
            op: name,
            dtype: dt,
        }),
    }?;
    // The copies must outlive the launches: the stream orders the frees after the kernels.
    drop(copies);
    Ok(out.into_iter().map(|b| x.wrap(b)).collect())
}

/// Launches attention kernel `kernel` of `module`, (grid, threads, shared memory bytes) as
/// given: the parameters, and for the wgmma kernels the five TMA descriptors.
fn launch_attention(
    dev: &CudaDevice,
    module: &'static str,
    kernel: String,
    ((gx, gy), threads, smem): ((usize, usize), u32, usize),
    p: &Params,
    maps: Option<&[TmaMap; 5]>,
) -> Result<()> {
    super::allow_shared_memory(dev, module, &kernel, smem)?;
    let cfg = LaunchConfig {
        grid_dim: (gx as u32, gy as u32, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    match maps {
        Some([tq, tk, tv, tdo, tdq]) => launch!(dev, module, kernel, cfg, p, tq, tk, tv, tdo, tdq),
        None => launch!(dev, module, kernel, cfg, p),
    }
}

fn launch_all<T: Elem>(
    dev: &CudaDevice,
    fwd: bool,
    p: &mut Params,
    d: usize,
) -> Result<Vec<super::storage::Buf>> {
    let (b, h, lq, lk) = (p.b as usize, p.h as usize, p.lq as usize, p.lk as usize);
    let bh = b * h;
    // Hopper gets the compute_90 build, whose backward adds dq with 16-byte reductions.
    let module = super::hopper_module(dev, "attention").unwrap_or("attention");
    if fwd && d == WIDE_D {
        let o = dev.alloc::<T>(bh * lq * d)?;
        let lse = dev.alloc::<f32>(bh * lq)?;
        p.o = dense_view(o.raw(dev.stream()), h, lq, d);
        p.lse = lse.raw(dev.stream());
        let kernel = format!("attn_fwd_wide_{}_d{d}", T::SFX);
        super::allow_shared_memory(dev, module, &kernel, wide_smem())?;
        let grid = LaunchConfig {
            grid_dim: (
                lq.div_ceil(WIDE_ROWS) as u32,
                bh as u32,
                (d / WIDE_DV) as u32,
            ),
            block_dim: (FWD_THREADS, 1, 1),
            shared_mem_bytes: wide_smem() as u32,
        };
        launch!(dev, module, kernel, grid, &*p)?;
        return Ok(vec![T::wrap(o), f32::wrap(lse)]);
    }
    // The wgmma kernels fold the scale into the exponent after the row max: scale > 0. Their
    // descriptors are made only where they run.
    let (qd, kd) = ([b, h, lq, d], [b, h, lk, d]);
    let rows = if fwd {
        wg_fwd_rows(d, p)
    } else {
        wg_bwd_rows(d)
    } as u32;
    let maps = |p: &Params| -> Option<[(TmaMap, u32); 4]> {
        let dt = T::DTYPE;
        let q = tma_map(&p.q, qd, rows, dt)?;
        let keys = if fwd { WG_FWD_KEYS } else { WG_BWD_KEYS } as u32;
        let k = tma_map(&p.k, kd, keys, dt)?;
        let v = tma_map(&p.v, kd, keys, dt)?;
        // The forward reads no do: q's descriptor stands in.
        let dout = if fwd {
            q
        } else {
            tma_map(&p.dout, qd, rows, dt)?
        };
        Some([q, k, v, dout])
    };
    let wg = wgmma_module(dev, d)
        .filter(|_| p.scale > 0.0)
        .and_then(|m| Some((m, maps(p)?)));
    let wg = wg.map(|(m, maps)| {
        p.tma_order = maps
            .iter()
            .enumerate()
            .fold(0, |acc, (i, (_, o))| acc | o << (6 * i));
        (m, maps.map(|(t, _)| t))
    });
    if fwd {
        let o = dev.alloc::<T>(bh * lq * d)?;
        let lse = dev.alloc::<f32>(bh * lq)?;
        p.o = dense_view(o.raw(dev.stream()), h, lq, d);
        p.lse = lse.raw(dev.stream());
        match &wg {
            Some((wm, maps)) => {
                let tiles = lq.div_ceil(wg_fwd_rows(d, p)) * bh;
                let (blocks, group, counted) = wg_fwd_grid(tiles, p, d, dev.sm_count());
                p.head_group = group;
                // The counter lives until the stream has run the kernel (frees are ordered
                // after it).
                let counter = match counted {
                    true => {
                        let c =
                            dev.alloc_zeroed::<u32>(1, "clearing the attention tile counter")?;
                        p.tile_counter = c.raw(dev.stream());
                        Some(c)
                    }
                    false => None,
                };
                launch_attention(
                    dev,
                    wm,
                    wg_fwd_kernel(T::SFX, d, p),
                    ((blocks, 1), wg_fwd_threads(d, p), wg_fwd_smem(d, p)),
                    p,
                    // The forward reads no dq accumulator: q's descriptor stands in.
                    Some(&[maps[0], maps[1], maps[2], maps[3], maps[0]]),
                )?;
                drop(counter);
            }
            None => launch_attention(
                dev,
                module,
                format!("attn_fwd_{}_d{d}", T::SFX),
                ((lq.div_ceil(FWD_ROWS), bh), FWD_THREADS, fwd_smem(d)),
                p,
                None,
            )?,
        }
        return Ok(vec![T::wrap(o), f32::wrap(lse)]);
    }
    let n = bh * lq * d;
    let sms = dev.sm_count().max(1);
    // Keys of a backward block. The deterministic mode gives each key block a dQ slab (every
    // kernel sums a query tile's dQ over its block's keys before adding it).
    let keys = match &wg {
        Some(_) => WG_BWD_KEYS,
        None => BWD_KEYS,
    };
    let blocks = lk.div_ceil(keys);
    let det = super::deterministic();
    let chunk = match det {
        true => deterministic_chunk(blocks, bh, n, sms),
        false => blocks,
    };
    p.dq_parts = if det { chunk as i32 } else { 0 };
    let dvec = dev.alloc::<f32>(bh * lq)?;
    // The accumulator, or the deterministic mode's slabs and their running sum.
    let acc = dev.alloc::<f32>(n * (p.dq_parts.max(1) as usize))?;
    let mut total = if det {
        Some(dev.alloc::<f32>(n)?)
    } else {
        None
    };
    let dq = dev.alloc::<T>(n)?;
    let dk = dev.alloc::<T>(bh * lk * d)?;
    let dv = dev.alloc::<T>(bh * lk * d)?;
    p.dvec = dvec.raw(dev.stream());
    p.dq_acc = acc.raw(dev.stream());
    p.dk = dk.raw(dev.stream());
    p.dv = dv.raw(dev.stream());
    // The wgmma backward adds dQ tiles to the accumulator (or stores the slabs) through a
    // tensor map of it.
    let wg = match wg {
        Some((wm, [q, k, v, dout])) => {
            let tdq = tma_map_dq(p.dq_acc, bh, lq, d, p.dq_parts.max(1) as usize).ok_or_else(|| {
                Error::Cuda(format!(
                    "the driver refused a tensor map of the attention dq accumulator ({} slabs of {bh} x {lq} x {d} f32)",
                    p.dq_parts.max(1)
                ))
            })?;
            Some((wm, [q, k, v, dout, tdq]))
        }
        None => None,
    };
    launch!(
        dev,
        module,
        format!("attn_bwd_pre_{}_d{d}", T::SFX),
        grid_for(bh * lq * (d / 8), sms),
        &*p
    )?;
    for (i, kb0) in (0..blocks).step_by(chunk).enumerate() {
        p.kb0 = kb0 as i32;
        let launched = chunk.min(blocks - kb0);
        match &wg {
            Some((wm, maps)) => {
                // A 1-d grid of units (key block, head); a last wave that would leave SMs
                // idle is split over runs of query tiles (not causal: its units are unequal;
                // not deterministic: the parts' dK and dV are summed with atomic adds).
                let units = launched * bh;
                let (from, parts) = match p.causal != 0 || det {
                    true => (units, 1),
                    false => wg_bwd_split(units, sms, lq.div_ceil(wg_bwd_rows(d))),
                };
                p.kblocks = launched as i32;
                p.split_from = from as i32;
                p.split_parts = parts as i32;
                let part = match parts > 1 {
                    true => {
                        let part = dev.alloc_zeroed::<f32>(
                            (units - from) * 2 * WG_BWD_KEYS * d,
                            "clearing the attention dk/dv partial sums",
                        )?;
                        p.dkv_part = part.raw(dev.stream());
                        Some(part)
                    }
                    false => None,
                };
                launch_attention(
                    dev,
                    wm,
                    format!("attnw_bwd_{}_d{d}", T::SFX),
                    (
                        (from + (units - from) * parts, 1),
                        WG_BWD_THREADS,
                        wg_bwd_smem(d),
                    ),
                    p,
                    Some(maps),
                )?;
                if let Some(part) = part {
                    launch!(
                        dev,
                        wm,
                        format!("attnw_dkv_fold_{}_d{d}", T::SFX),
                        grid_for(part.len() / 2, sms),
                        &*p
                    )?;
                }
            }
            None => launch_attention(
                dev,
                module,
                format!("attn_bwd_{}_d{d}", T::SFX),
                ((launched, bh), BWD_THREADS, bwd_smem(d)),
                p,
                None,
            )?,
        }
        if let Some(total) = &mut total {
            let (parts, first) = (launched as i32, i32::from(i == 0));
            let (dd, blocks0, kk) = (d as i32, kb0 as i32, keys as i32);
            launch!(
                dev,
                module,
                "attn_dq_fold",
                grid_for(n / 4, sms),
                &mut *total.slice,
                &*acc.slice,
                &n,
                &parts,
                &first,
                &dd,
                &p.lq,
                &p.causal,
                &blocks0,
                &kk
            )?;
        }
    }
    let mut dq = dq;
    launch!(
        dev,
        module,
        format!("attn_dq_{}", T::SFX),
        grid_for(n / 4, sms),
        &*total.as_ref().unwrap_or(&acc).slice,
        &mut *dq.slice,
        &n
    )?;
    Ok(vec![T::wrap(dq), T::wrap(dk), T::wrap(dv)])
}

/// How the wgmma backward splits its last wave: (the first unit split, blocks per split unit),
/// `(units, 1)` for none. `units` (key block, head) of equal work, `tiles` query tiles each,
/// run a block per SM (`sms`) in waves; a last wave of `units % sms` leaves the other SMs idle
/// for a unit's time. Split into s runs of query tiles, its units take
/// ceil(rem s / sms) rounds of a run (ceil(tiles / s) tiles) plus a part's fixed cost (loading
/// K and V, filling the pipeline, adding its f32 dK and dV with atomics: taken as 3 tiles).
/// The s of the least time (the fewest parts among equals) is taken where it saves a tenth of
/// a unit's time or more; at most 8 parts. The Flux shape (864 units of 72 tiles on 132 SMs:
/// a last wave of 72) splits its last wave in 3: 54 tiles' time instead of 72.
fn wg_bwd_split(units: usize, sms: usize, tiles: usize) -> (usize, usize) {
    const FIXED: f64 = 3.0;
    let sms = sms.max(1);
    let (from, rem) = (units / sms * sms, units % sms);
    let time = |s: usize| (rem * s).div_ceil(sms) as f64 * (tiles.div_ceil(s) as f64 + FIXED);
    let best = (2..=tiles.min(8))
        .map(|s| (time(s), s))
        .min_by(|a, b| a.0.total_cmp(&b.0));
    match best {
        Some((t, s)) if rem > 0 && t <= 0.9 * tiles as f64 => (from, s),
        _ => (units, 1),
    }
}

/// Bytes the deterministic mode's backward of one attention call holds beyond the atomic
/// one's (`super::deterministic`): its dQ slabs, a launch's key blocks' worth of the
/// queries' size in f32 in place of the one accumulator, and their running sum; for `bh`
/// batch x heads, `lq` queries and `lk` keys of width `d` on a GPU of `sms` SMs (the
/// backward's key block, 128 on either path, sets the blocks).
pub(crate) fn deterministic_dq_bytes(bh: usize, lq: usize, lk: usize, d: usize, sms: usize) -> u64 {
    let n = bh * lq * d;
    let blocks = lk.div_ceil(BWD_KEYS.min(WG_BWD_KEYS));
    let chunk = deterministic_chunk(blocks, bh, n, sms);
    // n x chunk slabs against n, and the running sum's n.
    (n * chunk * 4) as u64
}

/// Key blocks per launch of the deterministic backward: enough for two blocks per SM over
/// the batch x heads, or as many as 512 MiB of slabs (`n` f32 values each, one per key
/// block) hold, whichever is more; at least 1, at most all `blocks`.
fn deterministic_chunk(blocks: usize, bh: usize, n: usize, sms: usize) -> usize {
    let fill = (2 * sms).div_ceil(bh.max(1));
    let fit = (512usize << 20) / (n * 4).max(1);
    fill.max(fit).clamp(1, blocks.max(1))
}

#[cfg(test)]
mod tests {
    use super::{
        deterministic_chunk, tma_layout, wg_bwd_rows, wg_bwd_smem, wg_bwd_split, wg_fwd_consumers,
        wg_fwd_grid, wg_fwd_kernel, wg_fwd_smem, Params, TmaLayout, View,
    };

    fn params(b: i32, h: i32, lq: i32, lk: i32, causal: bool) -> Params {
        Params {
            b,
            h,
            lq,
            lk,
            causal: i32::from(causal),
            ..Params::default()
        }
    }

    #[test]
    fn the_forward_picks_its_consumers_and_kernel() {
        // D = 128: two consumers; D = 64: three, but two for causal attention to 2048 queries.
        let cases = [
            (
                128,
                params(1, 24, 4608, 4608, true),
                2,
                "attnw_fwd_bf16_d128",
            ),
            (
                64,
                params(16, 32, 1024, 1024, false),
                3,
                "attnw_fwd_bf16_d64",
            ),
            (
                64,
                params(16, 32, 1024, 1024, true),
                2,
                "attnw_fwd_bf16_d64_c2",
            ),
            (64, params(2, 12, 77, 77, true), 2, "attnw_fwd_bf16_d64_c2"),
            (64, params(4, 32, 4096, 4096, true), 3, "attnw_fwd_bf16_d64"),
        ];
        for (d, p, nc, kernel) in cases {
            assert_eq!(wg_fwd_consumers(d, &p), nc);
            assert_eq!(wg_fwd_kernel("bf16", d, &p), kernel);
            // Q, two stages of K and V, the alignment, barriers and the tile slot: under the
            // 227 KiB of shared memory a block may have on an H100.
            assert!(wg_fwd_smem(d, &p) <= 227 * 1024, "{}", wg_fwd_smem(d, &p));
        }
    }

    #[test]
    fn the_backward_splits_a_last_wave_that_leaves_sms_idle() {
        // (units, SMs, query tiles a unit) and (the first unit split, blocks per split unit).
        let cases = [
            // Flux, D = 128: 864 units, a last wave of 72 in runs of 24 tiles (2 rounds).
            ((864, 132, 72), (792, 3)),
            // B 1, H 32, L 16384, D = 64: 4 units left over, each in 8 runs of 16 tiles.
            ((4096, 132, 128), (4092, 8)),
            // A grid under one wave: its 72 units split as well.
            ((72, 132, 72), (0, 3)),
            // Whole waves; a last wave too short to gain a tenth; a single tile: no split.
            ((264, 132, 72), (264, 1)),
            ((2048, 132, 16), (2048, 1)),
            ((10, 132, 1), (10, 1)),
        ];
        for ((units, sms, tiles), want) in cases {
            assert_eq!(
                wg_bwd_split(units, sms, tiles),
                want,
                "{units} {sms} {tiles}"
            );
        }
    }

    #[test]
    fn the_backward_tiles_fit_shared_memory() {
        // (D, queries a tile, shared memory): K, V, two stages of Q and dO, two dS buffers,
        // the 32 KiB f32 dQ tile, lse and dvec, alignment and barriers; under 227 KiB.
        for (d, rows, smem) in [(64, 128, 199_744), (128, 64, 198_720)] {
            assert_eq!(wg_bwd_rows(d), rows);
            assert_eq!(wg_bwd_smem(d), smem);
            assert!(wg_bwd_smem(d) <= 227 * 1024);
        }
    }

    #[test]
    fn causal_forwards_claim_tiles_in_head_groups_that_fit_l2() {
        // (tiles, params, D) and the grid on 132 SMs: (blocks, head group, counter).
        let cases = [
            // Non-causal: a block per SM in order, no counter.
            (864, params(1, 24, 4608, 4608, false), 128, (132, 1, false)),
            // Causal: a block per SM claiming from the counter; K and V of a head (Lk D 4
            // bytes) in 32 MiB: Flux's 2.25 MiB heads in groups of 14, L 1024 D 64 of 128.
            (864, params(1, 24, 4608, 4608, true), 128, (132, 14, true)),
            (4096, params(16, 32, 1024, 1024, true), 64, (132, 128, true)),
            // At most every head; fewer tiles than SMs, a block each.
            (8, params(2, 4, 77, 77, true), 64, (8, 8, true)),
            // Past 8192 keys: a block per tile, in order.
            (
                2048,
                params(1, 16, 16384, 16384, true),
                128,
                (2048, 1, false),
            ),
        ];
        for (tiles, p, d, grid) in cases {
            assert_eq!(wg_fwd_grid(tiles, &p, d, 132), grid, "{tiles} tiles, D {d}");
        }
    }

    #[test]
    fn the_deterministic_slabs_are_what_the_backward_adds() {
        use super::deterministic_dq_bytes;
        // Flux-dev at 1024²: 24 heads of 128 over 4608 tokens on 132 SMs, 11 slabs of
        // 56.6 MB (the 0.45-0.6 GiB its step's peak rose by).
        let n = 24 * 4608 * 128;
        assert_eq!(
            deterministic_dq_bytes(24, 4608, 4608, 128, 132),
            (11 * n * 4) as u64
        );
        // Few keys: no more slabs than key blocks.
        assert_eq!(
            deterministic_dq_bytes(1, 1000, 77, 64, 132),
            (1000 * 64 * 4) as u64
        );
    }

    #[test]
    fn deterministic_launches_fill_the_gpu_within_bounded_slabs() {
        // Flux (B 1, H 24, L 4608, D 128) on 132 SMs: 36 key blocks, 11 a launch (fill) beat
        // the 9 slabs of 56.6 MB that 512 MiB holds.
        let flux = 24 * 4608 * 128;
        assert_eq!(deterministic_chunk(36, 24, flux, 132), 11);
        // Short sequences: every key block in one launch.
        assert_eq!(deterministic_chunk(3, 32, 32 * 333 * 64, 132), 3);
        // Huge slabs on a small GPU: one key block a launch.
        assert_eq!(deterministic_chunk(128, 64, 64 * 16384 * 128, 1), 1);
    }

    fn view(sb: i64, sh: i64, sr: i64) -> View {
        View { ptr: 0, sb, sh, sr }
    }

    /// Row, head, batch positions packed as `tma_tile` (cuda/attention_wgmma.cu) reads them.
    fn order(row: u32, head: u32, batch: u32) -> u32 {
        row | head << 2 | batch << 4
    }

    #[test]
    fn dense_operands_keep_row_head_batch_order() {
        let (b, h, l, d) = (2, 3, 301, 128);
        let dense = view((h * l * d) as i64, (l * d) as i64, d as i64);
        let t = tma_layout(&dense, [b, h, l, d], 128).unwrap();
        assert_eq!(
            t,
            TmaLayout {
                global_dim: [128, 301, 3, 2],
                global_strides: [256, 301 * 256, 3 * 301 * 256],
                box_dim: [64, 128, 1, 1],
                order: order(0, 1, 2),
            }
        );
    }

    #[test]
    fn a_projection_view_puts_heads_before_rows_and_a_batch_of_one_last() {
        // Flux's single block: v is a view into (1, L, 21504) with heads 128 apart; the
        // squeezed batch of 1 reports stride 0, which the driver would refuse.
        let (l, h, d, w) = (4608, 24, 128, 21504);
        let v = view(0, d as i64, w as i64);
        let t = tma_layout(&v, [1, h, l, d], 64).unwrap();
        assert_eq!(t.global_dim, [128, 24, 4608, 1]);
        assert_eq!(t.global_strides, [256, 2 * w as u64, 2 * (w * l) as u64]);
        assert_eq!(t.box_dim, [64, 1, 64, 1]);
        assert_eq!(t.order, order(1, 0, 2));
    }

    #[test]
    fn broadcast_heads_have_no_layout_but_a_single_head_does() {
        let (l, d) = (77, 64);
        assert_eq!(
            tma_layout(&view((l * d) as i64, 0, d as i64), [2, 3, l, d], 64),
            None
        );
        let one = tma_layout(&view((l * d) as i64, 0, d as i64), [2, 1, l, d], 64).unwrap();
        assert_eq!(one.global_dim, [64, 77, 2, 1]);
        assert_eq!(one.order, order(0, 2, 1));
    }
}
