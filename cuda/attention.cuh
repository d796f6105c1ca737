// Shared by the flash-attention kernels (attention.cu: mma.sync, every GPU from Ampere;
// attention_wgmma.cu: wgmma, Hopper): the parameter block, cp.async, ldmatrix, mma.sync,
// packing and the swizzled tile layout of attention.cu.
#pragma once
#include <type_traits>

#include "common.cuh"

// A tensor view: element strides over batch, head and row.
struct AttnView {
  uint64_t ptr;
  int64_t sb, sh, sr;
};

// Must match `AttnParams` in src/backend/cuda/attention.rs (repr(C)).
struct AttnParams {
  AttnView q, k, v, o, dout;
  uint64_t lse, dvec, dq_acc, keep, dq, dk, dv;
  // attention_wgmma.cu's persistent forward: a u32 tile counter the launcher zeroes (blocks
  // claim their next query tile from it), or 0 for the static order (tile t, t + G, ...).
  uint64_t tile_counter;
  // attention_wgmma.cu's backward, when its last wave is split (split_parts > 1): f32 dK then
  // dV (128 keys x D each) of every split unit, zeroed by the launcher; the parts add to it
  // and attnw_dkv_fold writes dk and dv from it.
  uint64_t dkv_part;
  int32_t B, H, Lq, Lk;
  float scale, scale_log2;
  int32_t causal;
  // attention_wgmma.cu: where each TMA descriptor (q, k, v, do: 6 bits each from bit 0) puts
  // the row, head and batch coordinates among its dims 1-3 (2 bits each).
  uint32_t tma_order;
  // 0: dQ summed into one f32 accumulator with atomic adds (fast, order varies). n > 0: the
  // deterministic mode: each key block of a launch stores its dQ in a slab of its own among
  // n, and attn_dq_fold adds the slabs in order to the running sum. The backward then runs in
  // launches of a few key blocks each, from key block kb0, so the slabs stay small.
  int32_t dq_parts, kb0;
  // attention_wgmma.cu's forward: query tiles are ordered in groups of head_group heads (the
  // K and V of a group fit in L2), within a group by query block (the heaviest first when
  // causal), heads side by side; 1: a head's query blocks side by side.
  // attention_wgmma.cu's backward: a 1-d grid of units (key block x of kblocks in this launch,
  // head b h) numbered x + kblocks b h. Blocks below split_from take a unit each, all its
  // query tiles; the units from split_from on (the last wave's) are each split into
  // split_parts blocks over runs of their query tiles (1: none). (An even number of 4-byte
  // fields keeps the struct free of padding.)
  int32_t head_group, kblocks, split_from, split_parts;
};

#define ATTN_THREADS 256
#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return (uint32_t)__cvta_generic_to_shared(p);
}

// 16 bytes global -> shared, asynchronously; zero-filled when !valid.
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ void ldsm4(uint32_t a, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}
__device__ __forceinline__ void ldsm4t(uint32_t a, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}

// c += a b on one m16n8k16 tile.
template <typename T> __device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);
template <> __device__ __forceinline__ void mma<__nv_bfloat16>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <> __device__ __forceinline__ void mma<__half>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two floats as one register of two T (x in the low half).
template <typename T> __device__ __forceinline__ uint32_t pack2(float x, float y);
template <> __device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float x, float y) {
  __nv_bfloat162 h = __floats2bfloat162_rn(x, y);
  return *reinterpret_cast<uint32_t*>(&h);
}
template <> __device__ __forceinline__ uint32_t pack2<__half>(float x, float y) {
  __half2 h = __floats2half2_rn(x, y);
  return *reinterpret_cast<uint32_t*>(&h);
}

__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Byte offset of chunk c (8 elements) of row r in a swizzled tile of W-element rows.
template <int W> __device__ __forceinline__ uint32_t swz(int r, int c) {
  return (uint32_t)((r * W + ((c ^ (r & 7)) << 3)) * 2);
}

// Rows [row0, row0 + R) of a slice with row stride sr into a swizzled R x D tile; rows at or
// past L are zeros.
template <typename T, int R, int D, int NT>
__device__ __forceinline__ void load_tile(uint32_t tile, const T* g, int64_t sr, int row0, int L) {
  constexpr int CH = D / 8;
  static_assert((R * CH) % NT == 0, "tile chunks must split evenly over the block");
#pragma unroll
  for (int it = 0; it < R * CH / NT; ++it) {
    const int i = threadIdx.x + it * NT;
    const int r = i / CH, c = i % CH;
    const bool ok = row0 + r < L;
    cp_async16(tile + swz<D>(r, c), g + (ok ? (int64_t)(row0 + r) * sr : 0) + c * 8, ok);
  }
}

// Address lanes give ldmatrix.x4 for an A fragment (16 rows x 16 k) at rows r0, k chunk 2kk.
template <int W> __device__ __forceinline__ uint32_t a_addr(uint32_t tile, int r0, int kk, int lane) {
  return tile + swz<W>(r0 + (lane & 15), kk * 2 + (lane >> 4));
}
// ... for two B fragments (n 0-7 and 8-15) from rows n0.. stored n-major (k contiguous).
template <int W> __device__ __forceinline__ uint32_t bn_addr(uint32_t tile, int n0, int kk, int lane) {
  return tile + swz<W>(n0 + ((lane >> 4) << 3) + (lane & 7), kk * 2 + ((lane >> 3) & 1));
}
// ... for two B fragments (n chunks c0, c0 + 1) from rows k0.. stored k-major (n contiguous),
// with ldmatrix.trans.
template <int W> __device__ __forceinline__ uint32_t bk_addr(uint32_t tile, int k0, int c0, int lane) {
  return tile + swz<W>(k0 + (lane & 7) + (((lane >> 3) & 1) << 3), c0 + (lane >> 4));
}

template <typename T> __device__ __forceinline__ const T* view_at(const AttnView& v, int b, int h) {
  return reinterpret_cast<const T*>(v.ptr) + b * v.sb + h * v.sh;
}

// ----- epilogues shared by the kernels --------------------------------------------------------
// An m16 tile's accumulator, as mma.sync and wgmma lay it out: this thread holds rows g and
// g + 8 (g = lane / 4), columns 8n + 2 (lane % 4) and the next.

// The normalised output o / l of one tile into O (rows row0 and row0 + 8 for this thread) and,
// when with_lse, lse = m ln 2 + ln l (+inf for a row that saw no key). m is the row max in
// log2 units, l this thread's part of the row sum.
template <typename T, int NB>
__device__ __forceinline__ void store_rows(const AttnParams& p, T* O, float* lse, const float (&o)[NB][4],
                                           const float (&m)[2], const float (&l)[2], int row0, int lane,
                                           bool with_lse) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float lt = l[r];
    lt += __shfl_xor_sync(0xffffffffu, lt, 1);
    lt += __shfl_xor_sync(0xffffffffu, lt, 2);
    const float inv = lt > 0.f ? 1.f / lt : 0.f;
    const int row = row0 + r * 8;
    if (row < p.Lq) {
      T* orow = O + (int64_t)row * p.o.sr + 2 * (lane & 3);
#pragma unroll
      for (int n = 0; n < NB; ++n)
        *reinterpret_cast<uint32_t*>(orow + n * 8) = pack2<T>(o[n][2 * r] * inv, o[n][2 * r + 1] * inv);
      if (with_lse && (lane & 3) == 0) lse[row] = lt > 0.f ? m[r] * LN2 + logf(lt) : INFINITY;
    }
  }
}

// scale times one tile's accumulator added to f32 rows with 16-byte reductions (sm_90), or
// stored (`store`: a dQ slab of the deterministic mode): lanes t and t ^ 1 swap halves so
// each holds four adjacent columns of one row, row g for even t, g + 8 for odd t. dst: that
// row at this lane's first column (the tile's + 2 (t & ~1)); ok: whether the row exists.
template <int NB>
__device__ __forceinline__ void red_rows_v4(float* dst, const float (&acc)[NB][4], float scale, bool ok, int lane,
                                            bool store = false) {
  const bool odd = lane & 1;
#pragma unroll
  for (int n = 0; n < NB; ++n) {
    // Even lanes send their row g + 8 pair, odd lanes their row g pair.
    const float s0 = odd ? acc[n][0] : acc[n][2], s1 = odd ? acc[n][1] : acc[n][3];
    const float r0v = __shfl_xor_sync(0xffffffffu, s0, 1), r1v = __shfl_xor_sync(0xffffffffu, s1, 1);
    const float4 v = odd ? make_float4(r0v, r1v, acc[n][2], acc[n][3]) : make_float4(acc[n][0], acc[n][1], r0v, r1v);
    if (ok && store)
      *reinterpret_cast<float4*>(dst + n * 8) = make_float4(v.x * scale, v.y * scale, v.z * scale, v.w * scale);
    else if (ok)
      asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(dst + n * 8), "f"(v.x * scale),
                   "f"(v.y * scale), "f"(v.z * scale), "f"(v.w * scale)
                   : "memory");
  }
}

// dK (times the scale) and dV of this thread's key rows kidx[0], kidx[1] (rows past Lk
// skipped), contiguous (B, H, Lk, D).
template <typename T, int D>
__device__ __forceinline__ void store_dkdv(const AttnParams& p, int bh, const int (&kidx)[2],
                                           const float (&dk)[D / 8][4], const float (&dv)[D / 8][4], int lane) {
  T* gdk = reinterpret_cast<T*>(p.dk) + (int64_t)bh * p.Lk * D;
  T* gdv = reinterpret_cast<T*>(p.dv) + (int64_t)bh * p.Lk * D;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (kidx[r] < p.Lk) {
      const int64_t off = (int64_t)kidx[r] * D + 2 * (lane & 3);
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        *reinterpret_cast<uint32_t*>(gdk + off + n * 8) = pack2<T>(dk[n][2 * r] * p.scale, dk[n][2 * r + 1] * p.scale);
        *reinterpret_cast<uint32_t*>(gdv + off + n * 8) = pack2<T>(dv[n][2 * r], dv[n][2 * r + 1]);
      }
    }
  }
}
