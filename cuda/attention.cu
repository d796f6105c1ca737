// Flash attention, forward and backward, on tensor cores: mma.sync m16n8k16 with bf16/f16
// operands and f32 accumulators, after FlashAttention-2 (Dao 2023, arXiv:2307.08691).
// Nothing of size Lq x Lk is stored: the forward keeps a running max and sum per row and saves
// the log-sum-exp; the backward recomputes the probabilities tile by tile from it.
//
// B batch, H heads, Lq queries, Lk keys, D head dim (64 or 128). q, o, do: (B, H, Lq, D);
// k, v: (B, H, Lk, D); any strides over B, H and rows, unit stride over D, rows 16-byte
// aligned (the launcher copies views that are not). lse, dvec: (B, H, Lq) f32.
//
// Shared-memory tiles hold rows of D elements as 16-byte chunks, chunk c of row r stored at
// c ^ (r & 7): the eight rows an ldmatrix reads land in eight different bank groups.
//
// Fragment layouts (PTX ISA, mma.m16n8k16): with g = lane / 4 and t = lane % 4, the
// accumulator holds rows g and g + 8, columns 2t and 2t + 1 of an m16n8 tile; an A fragment
// is four 8x8 blocks (rows 0-7 / 8-15 by k 0-7 / 8-15), a B fragment two (k 0-7 / 8-15).
#include "attention.cuh"

// ----- forward ------------------------------------------------------------------------------
// A block of 4 warps takes 128 queries of one (b, h), 32 rows (two m16 tiles) a warp, so each
// K or V fragment read from shared memory feeds two products; two blocks fit an SM. Keys go
// by in tiles of 64, double-buffered with cp.async. Per row the warp keeps m (the max, in log2
// units), l (the sum, this thread's part) and the output accumulator, rescaled when m grows.
#define FWD_WARPS 4
#define FWD_MT 2
// Keys per tile: 32 at D = 128 keeps the scores and the output accumulator in registers.
#define FWD_BC(D) ((D) == 128 ? 32 : 64)

template <typename T, int D>
__device__ __forceinline__ void attn_fwd(const AttnParams& p) {
  constexpr int MT = FWD_MT, BR = 16 * MT * FWD_WARPS, BC = FWD_BC(D), NT = 32 * FWD_WARPS;
  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t sQ = smem_u32(smem);
  const uint32_t sKV = sQ + BR * D * 2;  // stage s: K at sKV + s * 2 * BC * D * 2, then V
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int bh = blockIdx.y, b = bh / p.H, h = bh % p.H;
  const int q0 = blockIdx.x * BR, r0 = warp * 16 * MT;
  const T* Q = view_at<T>(p.q, b, h);
  const T* K = view_at<T>(p.k, b, h);
  const T* V = view_at<T>(p.v, b, h);
  const float* keep = p.keep ? reinterpret_cast<const float*>(p.keep) + (int64_t)b * p.Lk : nullptr;
  // Key j is visible to query i only if j <= i when causal.
  const int kend = p.causal ? min(p.Lk, min(q0 + BR, p.Lq)) : p.Lk;
  const int nkt = (kend + BC - 1) / BC;
  const float sl2 = p.scale_log2;

  load_tile<T, BR, D, NT>(sQ, Q, p.q.sr, q0, p.Lq);
  load_tile<T, BC, D, NT>(sKV, K, p.k.sr, 0, p.Lk);
  load_tile<T, BC, D, NT>(sKV + BC * D * 2, V, p.v.sr, 0, p.Lk);
  cp_commit();

  float o[MT][D / 8][4];
#pragma unroll
  for (int t = 0; t < MT; ++t)
#pragma unroll
    for (int n = 0; n < D / 8; ++n) o[t][n][0] = o[t][n][1] = o[t][n][2] = o[t][n][3] = 0.f;
  float m[MT][2], l[MT][2];
#pragma unroll
  for (int t = 0; t < MT; ++t) m[t][0] = m[t][1] = -INFINITY, l[t][0] = l[t][1] = 0.f;
  const int qrow0 = q0 + r0 + (lane >> 2);  // + 16 t + 8 r

  for (int j = 0; j < nkt; ++j) {
    if (j + 1 < nkt) {
      const uint32_t nk = sKV + ((j + 1) & 1) * (2 * BC * D * 2);
      load_tile<T, BC, D, NT>(nk, K, p.k.sr, (j + 1) * BC, p.Lk);
      load_tile<T, BC, D, NT>(nk + BC * D * 2, V, p.v.sr, (j + 1) * BC, p.Lk);
      cp_commit();
      cp_wait<1>();
    } else {
      cp_wait<0>();
    }
    __syncthreads();
    const uint32_t sK = sKV + (j & 1) * (2 * BC * D * 2), sV = sK + BC * D * 2;

    // S = Q K^T for this warp's 32 rows and the tile's 64 keys.
    float s[MT][BC / 8][4];
#pragma unroll
    for (int t = 0; t < MT; ++t)
#pragma unroll
      for (int n = 0; n < BC / 8; ++n) s[t][n][0] = s[t][n][1] = s[t][n][2] = s[t][n][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t qa[MT][4];
#pragma unroll
      for (int t = 0; t < MT; ++t) ldsm4(a_addr<D>(sQ, r0 + 16 * t, kk, lane), qa[t]);
#pragma unroll
      for (int np = 0; np < BC / 16; ++np) {
        uint32_t bf[4];
        ldsm4(bn_addr<D>(sK, np * 16, kk, lane), bf);
#pragma unroll
        for (int t = 0; t < MT; ++t) {
          mma<T>(s[t][2 * np], qa[t], bf[0], bf[1]);
          mma<T>(s[t][2 * np + 1], qa[t], bf[2], bf[3]);
        }
      }
    }
    // To log2 units; hide keys past Lk, masked keys, and keys after the query when causal.
    const int k0 = j * BC;
    const bool edge = k0 + BC > p.Lk || keep || (p.causal && k0 + BC - 1 > q0 + r0);
#pragma unroll
    for (int t = 0; t < MT; ++t)
#pragma unroll
      for (int n = 0; n < BC / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float x = s[t][n][e] * sl2;
          if (edge) {
            const int key = k0 + n * 8 + 2 * (lane & 3) + (e & 1);
            const int row = qrow0 + 16 * t + (e >> 1) * 8;
            const bool vis = key < p.Lk && (!keep || keep[key] != 0.f) && (!p.causal || key <= row);
            if (!vis) x = -INFINITY;
          }
          s[t][n][e] = x;
        }
    // Online softmax: new max, rescale what is accumulated, exponentiate.
#pragma unroll
    for (int t = 0; t < MT; ++t)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float mx = -INFINITY;
#pragma unroll
        for (int n = 0; n < BC / 8; ++n) mx = fmaxf(mx, fmaxf(s[t][n][2 * r], s[t][n][2 * r + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float mnew = fmaxf(m[t][r], mx);
        const float muse = mnew == -INFINITY ? 0.f : mnew;
        const float alpha = ex2(m[t][r] - muse);
        m[t][r] = mnew;
        float sum = 0.f;
#pragma unroll
        for (int n = 0; n < BC / 8; ++n) {
          s[t][n][2 * r] = ex2(s[t][n][2 * r] - muse);
          s[t][n][2 * r + 1] = ex2(s[t][n][2 * r + 1] - muse);
          sum += s[t][n][2 * r] + s[t][n][2 * r + 1];
        }
        l[t][r] = l[t][r] * alpha + sum;
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
          o[t][n][2 * r] *= alpha;
          o[t][n][2 * r + 1] *= alpha;
        }
      }
    // O += P V: P's accumulators become A fragments (two n8 tiles make one k16 step).
#pragma unroll
    for (int kk = 0; kk < BC / 16; ++kk) {
      uint32_t a[MT][4];
#pragma unroll
      for (int t = 0; t < MT; ++t) {
        a[t][0] = pack2<T>(s[t][2 * kk][0], s[t][2 * kk][1]);
        a[t][1] = pack2<T>(s[t][2 * kk][2], s[t][2 * kk][3]);
        a[t][2] = pack2<T>(s[t][2 * kk + 1][0], s[t][2 * kk + 1][1]);
        a[t][3] = pack2<T>(s[t][2 * kk + 1][2], s[t][2 * kk + 1][3]);
      }
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        uint32_t bf[4];
        ldsm4t(bk_addr<D>(sV, kk * 16, dp * 2, lane), bf);
#pragma unroll
        for (int t = 0; t < MT; ++t) {
          mma<T>(o[t][2 * dp], a[t], bf[0], bf[1]);
          mma<T>(o[t][2 * dp + 1], a[t], bf[2], bf[3]);
        }
      }
    }
    __syncthreads();
  }

  // o / l and lse = ln(2^m l) = m ln 2 + ln l; a row that saw no key: o = 0, lse = +inf.
  T* O = reinterpret_cast<T*>(p.o.ptr) + b * p.o.sb + h * p.o.sh;
  float* lse = reinterpret_cast<float*>(p.lse) + (int64_t)bh * p.Lq;
#pragma unroll
  for (int t = 0; t < MT; ++t) store_rows<T>(p, O, lse, o[t], m[t], l[t], qrow0 + 16 * t, lane, true);
}


// ----- forward for wide heads (D = 512: the VAE's single-head mid-block attention) -----------
// Forward only (no backward kernel: the autoencoder runs without gradients). A block of 4
// warps takes 64 queries (16 a warp) and one 128-column chunk of the output (blockIdx.z): the
// scores Q K^T run over all DK columns (Q's and K's tiles in shared memory, A fragments read
// per k step, so no warp holds a 512-wide row in registers), and the output accumulator holds
// only the chunk's DV columns. Every chunk's block computes the same scores; the chunk-0
// block writes the log-sum-exp. Keys go by in tiles of 32, double-buffered with cp.async.
#define WIDE_WARPS 4
#define WIDE_BR (16 * WIDE_WARPS)
#define WIDE_BC 32
#define WIDE_DV 128

template <typename T, int DK>
__device__ __forceinline__ void attn_fwd_wide(const AttnParams& p) {
  constexpr int BR = WIDE_BR, BC = WIDE_BC, DV = WIDE_DV, NT = 32 * WIDE_WARPS;
  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t sQ = smem_u32(smem);
  const uint32_t sK0 = sQ + BR * DK * 2;       // stage s: K at sK0 + s * BC * DK * 2
  const uint32_t sV0 = sK0 + 2 * BC * DK * 2;  // stage s: V at sV0 + s * BC * DV * 2
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int bh = blockIdx.y, b = bh / p.H, h = bh % p.H;
  const int q0 = blockIdx.x * BR, r0 = warp * 16, c0 = blockIdx.z * DV;
  const T* Q = view_at<T>(p.q, b, h);
  const T* K = view_at<T>(p.k, b, h);
  const T* V = view_at<T>(p.v, b, h) + c0;
  const float* keep = p.keep ? reinterpret_cast<const float*>(p.keep) + (int64_t)b * p.Lk : nullptr;
  const int kend = p.causal ? min(p.Lk, min(q0 + BR, p.Lq)) : p.Lk;
  const int nkt = (kend + BC - 1) / BC;
  const float sl2 = p.scale_log2;

  load_tile<T, BR, DK, NT>(sQ, Q, p.q.sr, q0, p.Lq);
  load_tile<T, BC, DK, NT>(sK0, K, p.k.sr, 0, p.Lk);
  load_tile<T, BC, DV, NT>(sV0, V, p.v.sr, 0, p.Lk);
  cp_commit();

  float o[DV / 8][4];
#pragma unroll
  for (int n = 0; n < DV / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  const int qrow0 = q0 + r0 + (lane >> 2);  // + 8 r

  for (int j = 0; j < nkt; ++j) {
    if (j + 1 < nkt) {
      const int st = (j + 1) & 1;
      load_tile<T, BC, DK, NT>(sK0 + st * BC * DK * 2, K, p.k.sr, (j + 1) * BC, p.Lk);
      load_tile<T, BC, DV, NT>(sV0 + st * BC * DV * 2, V, p.v.sr, (j + 1) * BC, p.Lk);
      cp_commit();
      cp_wait<1>();
    } else {
      cp_wait<0>();
    }
    __syncthreads();
    const uint32_t sK = sK0 + (j & 1) * BC * DK * 2, sV = sV0 + (j & 1) * BC * DV * 2;

    float s[BC / 8][4];
#pragma unroll
    for (int n = 0; n < BC / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll 4
    for (int kk = 0; kk < DK / 16; ++kk) {
      uint32_t qa[4];
      ldsm4(a_addr<DK>(sQ, r0, kk, lane), qa);
#pragma unroll
      for (int np = 0; np < BC / 16; ++np) {
        uint32_t bf[4];
        ldsm4(bn_addr<DK>(sK, np * 16, kk, lane), bf);
        mma<T>(s[2 * np], qa, bf[0], bf[1]);
        mma<T>(s[2 * np + 1], qa, bf[2], bf[3]);
      }
    }
    const int k0 = j * BC;
    const bool edge = k0 + BC > p.Lk || keep || (p.causal && k0 + BC - 1 > q0 + r0);
#pragma unroll
    for (int n = 0; n < BC / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float x = s[n][e] * sl2;
        if (edge) {
          const int key = k0 + n * 8 + 2 * (lane & 3) + (e & 1);
          const int row = qrow0 + (e >> 1) * 8;
          const bool vis = key < p.Lk && (!keep || keep[key] != 0.f) && (!p.causal || key <= row);
          if (!vis) x = -INFINITY;
        }
        s[n][e] = x;
      }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx = -INFINITY;
#pragma unroll
      for (int n = 0; n < BC / 8; ++n) mx = fmaxf(mx, fmaxf(s[n][2 * r], s[n][2 * r + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float mnew = fmaxf(m[r], mx);
      const float muse = mnew == -INFINITY ? 0.f : mnew;
      const float alpha = ex2(m[r] - muse);
      m[r] = mnew;
      float sum = 0.f;
#pragma unroll
      for (int n = 0; n < BC / 8; ++n) {
        s[n][2 * r] = ex2(s[n][2 * r] - muse);
        s[n][2 * r + 1] = ex2(s[n][2 * r + 1] - muse);
        sum += s[n][2 * r] + s[n][2 * r + 1];
      }
      l[r] = l[r] * alpha + sum;
#pragma unroll
      for (int n = 0; n < DV / 8; ++n) {
        o[n][2 * r] *= alpha;
        o[n][2 * r + 1] *= alpha;
      }
    }
#pragma unroll
    for (int kk = 0; kk < BC / 16; ++kk) {
      uint32_t a[4];
      a[0] = pack2<T>(s[2 * kk][0], s[2 * kk][1]);
      a[1] = pack2<T>(s[2 * kk][2], s[2 * kk][3]);
      a[2] = pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
      a[3] = pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
      for (int dp = 0; dp < DV / 16; ++dp) {
        uint32_t bf[4];
        ldsm4t(bk_addr<DV>(sV, kk * 16, dp * 2, lane), bf);
        mma<T>(o[2 * dp], a, bf[0], bf[1]);
        mma<T>(o[2 * dp + 1], a, bf[2], bf[3]);
      }
    }
    __syncthreads();
  }

  T* O = reinterpret_cast<T*>(p.o.ptr) + b * p.o.sb + h * p.o.sh + c0;
  float* lse = reinterpret_cast<float*>(p.lse) + (int64_t)bh * p.Lq;
  store_rows<T>(p, O, lse, o, m, l, qrow0, lane, blockIdx.z == 0);
}

// ----- backward -----------------------------------------------------------------------------
// dvec = rowsum(do * o) per query (f32), and the f32 dq accumulator zeroed (not in the
// deterministic mode, whose slabs need no zeros: see dq_fold). A group of G = D / 8 lanes per
// row, 8 adjacent elements a lane: one 16-byte load of o and of do where their rows are
// aligned to that, else 8 loads; 32 / G rows a warp at once. (A warp per row with one 4-byte
// load a lane ran the B 16, H 32, L 1024, D 64 pass at 2.3 TB/s on an H100, 0.115 ms.)
template <typename T, int D>
__device__ __forceinline__ void attn_bwd_pre(const AttnParams& p) {
  constexpr int G = D / 8, RW = 32 / G;
  static_assert(D % 8 == 0 && 32 % G == 0, "a row is a power-of-two group of lanes of 8 elements");
  const int64_t rows = (int64_t)p.B * p.H * p.Lq;
  const int lane = threadIdx.x & 31, c0 = (lane % G) * 8;
  const uint64_t align = p.o.ptr | p.dout.ptr | (uint64_t)((p.o.sr | p.o.sh | p.o.sb | p.dout.sr | p.dout.sh | p.dout.sb) * sizeof(T));
  const bool vec = align % 16 == 0;
  const bool zero_acc = p.dq_parts == 0;
  const int64_t warps = ((int64_t)gridDim.x * blockDim.x) >> 5;
  for (int64_t base = ((blockIdx.x * (int64_t)blockDim.x + threadIdx.x) >> 5) * RW; base < rows; base += warps * RW) {
    const int64_t row = base + lane / G;
    float sum = 0.f;
    if (row < rows) {
      const int i = (int)(row % p.Lq);
      const int bh = (int)(row / p.Lq), b = bh / p.H, h = bh % p.H;
      const T* o = view_at<T>(p.o, b, h) + (int64_t)i * p.o.sr + c0;
      const T* g = view_at<T>(p.dout, b, h) + (int64_t)i * p.dout.sr + c0;
      T ov[8], gv[8];
      if (vec) {
        *reinterpret_cast<uint4*>(ov) = *reinterpret_cast<const uint4*>(o);
        *reinterpret_cast<uint4*>(gv) = *reinterpret_cast<const uint4*>(g);
      } else {
#pragma unroll
        for (int e = 0; e < 8; ++e) ov[e] = o[e], gv[e] = g[e];
      }
#pragma unroll
      for (int e = 0; e < 8; ++e) sum += to_acc(ov[e]) * to_acc(gv[e]);
      if (zero_acc) {
        float4* acc = reinterpret_cast<float4*>(reinterpret_cast<float*>(p.dq_acc) + row * D + c0);
        acc[0] = acc[1] = make_float4(0.f, 0.f, 0.f, 0.f);
      }
    }
    // The row's sum over its group of lanes (xor within the group; every lane takes part).
#pragma unroll
    for (int w = G / 2; w > 0; w >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, w);
    if (lane % G == 0 && row < rows) reinterpret_cast<float*>(p.dvec)[row] = sum;
  }
}

// A block owns 128 keys of one (b, h) (8 warps x 16 keys) and walks the queries in tiles of
// 64, double-buffered. Per tile each warp forms S^T = K Q^T for its keys, P^T from the saved
// lse, dV += P^T dO, dP^T = V dO^T, dS^T = P^T (dP^T - dvec), dK += dS^T Q; dS^T goes through
// shared memory so the block can add dQ += dS K into the f32 accumulator with atomics.
template <typename T, int D>
__device__ __forceinline__ void attn_bwd(const AttnParams& p) {
  constexpr int BC = 128, BR = 64;
  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t sK = smem_u32(smem);
  const uint32_t sV = sK + BC * D * 2;
  const uint32_t sQ0 = sV + BC * D * 2;        // stage s: Q at sQ0 + s * 2 * BR * D * 2, then dO
  const uint32_t sdS = sQ0 + 4 * BR * D * 2;   // BC x BR
  float* sL = reinterpret_cast<float*>(smem + (2 * BC * D + 4 * BR * D + BC * BR) * 2);  // [2][BR]: lse log2e
  float* sDv = sL + 2 * BR;                                                                 // [2][BR]: dvec
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int bh = blockIdx.y, b = bh / p.H, h = bh % p.H;
  const int k0 = (blockIdx.x + p.kb0) * BC, kr0 = warp * 16;
  const T* Q = view_at<T>(p.q, b, h);
  const T* K = view_at<T>(p.k, b, h);
  const T* V = view_at<T>(p.v, b, h);
  const T* dO = view_at<T>(p.dout, b, h);
  const float* lse = reinterpret_cast<const float*>(p.lse) + (int64_t)bh * p.Lq;
  const float* dvec = reinterpret_cast<const float*>(p.dvec) + (int64_t)bh * p.Lq;
  // The deterministic mode: this key block's own slab.
  const int64_t slab = p.dq_parts ? (int64_t)blockIdx.x * p.B * p.H * p.Lq * D : 0;
  float* dqacc = reinterpret_cast<float*>(p.dq_acc) + slab + (int64_t)bh * p.Lq * D;
  const float* keep = p.keep ? reinterpret_cast<const float*>(p.keep) + (int64_t)b * p.Lk : nullptr;
  const float sl2 = p.scale_log2;

  // Queries before k0 see none of these keys when causal.
  const int it0 = p.causal ? k0 / BR : 0;
  const int nqt = (p.Lq + BR - 1) / BR;
  // Q and dO of query tile `it` into stage s (asynchronously); its lse (log2 units, +inf
  // past Lq) and dvec are loaded into registers here and stored by `put_rows` once the
  // loads have had time to land.
  float nl = 0.f, nd = 0.f;
  auto stage_rows = [&](int s, int it) {
    const uint32_t q = sQ0 + s * (2 * BR * D * 2);
    load_tile<T, BR, D, ATTN_THREADS>(q, Q, p.q.sr, it * BR, p.Lq);
    load_tile<T, BR, D, ATTN_THREADS>(q + BR * D * 2, dO, p.dout.sr, it * BR, p.Lq);
    if (tid < BR) {
      const int qi = it * BR + tid;
      nl = qi < p.Lq ? lse[qi] * LOG2E : INFINITY;
      nd = qi < p.Lq ? dvec[qi] : 0.f;
    }
  };
  auto put_rows = [&](int s) {
    if (tid < BR) {
      sL[s * BR + tid] = nl;
      sDv[s * BR + tid] = nd;
    }
  };
  load_tile<T, BC, D, ATTN_THREADS>(sK, K, p.k.sr, k0, p.Lk);
  load_tile<T, BC, D, ATTN_THREADS>(sV, V, p.v.sr, k0, p.Lk);
  if (it0 < nqt) {
    stage_rows(0, it0);
    put_rows(0);
  }
  cp_commit();

  int kidx[2];
  bool kvis[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    kidx[r] = k0 + kr0 + (lane >> 2) + 8 * r;
    kvis[r] = kidx[r] < p.Lk && (!keep || keep[kidx[r]] != 0.f);
  }
  float dk[D / 8][4], dv[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[n][e] = dv[n][e] = 0.f;

  for (int it = it0; it < nqt; ++it) {
    const int st = (it - it0) & 1;
    if (it + 1 < nqt) {
      stage_rows(st ^ 1, it + 1);
      cp_commit();
      cp_wait<1>();
    } else {
      cp_wait<0>();
    }
    __syncthreads();
    const int q0 = it * BR;
    const uint32_t sQ = sQ0 + st * (2 * BR * D * 2), sdO = sQ + BR * D * 2;
    const float* L = sL + st * BR;
    const float* Dv = sDv + st * BR;

    // S^T = K Q^T: this warp's 16 keys x the tile's 64 queries. The k loops here and in dP^T
    // are unrolled by 2 only: fully unrolled, ptxas hoists every fragment and spills (the
    // backward was 196 TFLOP/s at the Flux shape that way, 208 like this, on an H100).
    float s[BR / 8][4];
#pragma unroll
    for (int n = 0; n < BR / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll 2
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t a[4];
      ldsm4(a_addr<D>(sK, kr0, kk, lane), a);
#pragma unroll
      for (int np = 0; np < BR / 16; ++np) {
        uint32_t bf[4];
        ldsm4(bn_addr<D>(sQ, np * 16, kk, lane), bf);
        mma<T>(s[2 * np], a, bf[0], bf[1]);
        mma<T>(s[2 * np + 1], a, bf[2], bf[3]);
      }
    }
    // P^T = 2^(s scale log2e - lse log2e); 0 for hidden keys, and for queries past Lq (lse inf).
    const bool diag = p.causal && k0 + kr0 + 15 > q0;
#pragma unroll
    for (int n = 0; n < BR / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int qc = n * 8 + 2 * (lane & 3) + (e & 1);
        float pv = ex2(s[n][e] * sl2 - L[qc]);
        if (!kvis[e >> 1] || (diag && kidx[e >> 1] > q0 + qc)) pv = 0.f;
        s[n][e] = pv;
      }
    }
    // dV += P^T dO.
#pragma unroll
    for (int kk = 0; kk < BR / 16; ++kk) {
      const uint32_t a[4] = {pack2<T>(s[2 * kk][0], s[2 * kk][1]), pack2<T>(s[2 * kk][2], s[2 * kk][3]),
                             pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                             pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        uint32_t bf[4];
        ldsm4t(bk_addr<D>(sdO, kk * 16, dp * 2, lane), bf);
        mma<T>(dv[2 * dp], a, bf[0], bf[1]);
        mma<T>(dv[2 * dp + 1], a, bf[2], bf[3]);
      }
    }
    // dP^T = V dO^T.
    float dpt[BR / 8][4];
#pragma unroll
    for (int n = 0; n < BR / 8; ++n) dpt[n][0] = dpt[n][1] = dpt[n][2] = dpt[n][3] = 0.f;
#pragma unroll 2
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t a[4];
      ldsm4(a_addr<D>(sV, kr0, kk, lane), a);
#pragma unroll
      for (int np = 0; np < BR / 16; ++np) {
        uint32_t bf[4];
        ldsm4(bn_addr<D>(sdO, np * 16, kk, lane), bf);
        mma<T>(dpt[2 * np], a, bf[0], bf[1]);
        mma<T>(dpt[2 * np + 1], a, bf[2], bf[3]);
      }
    }
    // dS^T = P^T (dP^T - dvec), kept in s; also stored to shared memory (BC x BR, swizzled).
#pragma unroll
    for (int n = 0; n < BR / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) s[n][e] *= dpt[n][e] - Dv[n * 8 + 2 * (lane & 3) + (e & 1)];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = kr0 + (lane >> 2) + 8 * r;
        const uint32_t addr = sdS + swz<BR>(row, n) + 4 * (lane & 3);
        asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(pack2<T>(s[n][2 * r], s[n][2 * r + 1])));
      }
    }
    // dK += dS^T Q (the scale is applied once at the end).
#pragma unroll
    for (int kk = 0; kk < BR / 16; ++kk) {
      const uint32_t a[4] = {pack2<T>(s[2 * kk][0], s[2 * kk][1]), pack2<T>(s[2 * kk][2], s[2 * kk][3]),
                             pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                             pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        uint32_t bf[4];
        ldsm4t(bk_addr<D>(sQ, kk * 16, dp * 2, lane), bf);
        mma<T>(dk[2 * dp], a, bf[0], bf[1]);
        mma<T>(dk[2 * dp + 1], a, bf[2], bf[3]);
      }
    }
    __syncthreads();
    // dQ += scale dS K: warp w takes queries (w % 4) * 16.. and columns (w / 4) * D/2..; the A
    // fragments of dS are read transposed from dS^T.
    {
      const int mq = warp & 3, dh = warp >> 2;
      float dq[D / 16][4];
#pragma unroll
      for (int n = 0; n < D / 16; ++n) dq[n][0] = dq[n][1] = dq[n][2] = dq[n][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < BC / 16; ++kk) {
        uint32_t a[4];
        const int mat = lane >> 3;
        ldsm4t(sdS + swz<BR>(kk * 16 + ((mat >> 1) << 3) + (lane & 7), mq * 2 + (mat & 1)), a);
#pragma unroll
        for (int dp = 0; dp < D / 32; ++dp) {
          uint32_t bf[4];
          ldsm4t(bk_addr<D>(sK, kk * 16, dh * (D / 16) + dp * 2, lane), bf);
          mma<T>(dq[2 * dp], a, bf[0], bf[1]);
          mma<T>(dq[2 * dp + 1], a, bf[2], bf[3]);
        }
      }
#if __CUDA_ARCH__ >= 900
      {
        const int qi = q0 + mq * 16 + (lane >> 2) + ((lane & 1) ? 8 : 0);
        red_rows_v4(dqacc + (int64_t)qi * D + dh * (D / 2) + 2 * ((lane & 3) & ~1), dq, p.scale, qi < p.Lq, lane,
                    p.dq_parts > 0);
      }
#else
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int qi = q0 + mq * 16 + (lane >> 2) + 8 * r;
        if (qi < p.Lq) {
          float* dst = dqacc + (int64_t)qi * D + dh * (D / 2) + 2 * (lane & 3);
#pragma unroll
          for (int n = 0; n < D / 16; ++n) {
            if (p.dq_parts) {
              dst[n * 8] = dq[n][2 * r] * p.scale;
              dst[n * 8 + 1] = dq[n][2 * r + 1] * p.scale;
            } else {
              atomicAdd(dst + n * 8, dq[n][2 * r] * p.scale);
              atomicAdd(dst + n * 8 + 1, dq[n][2 * r + 1] * p.scale);
            }
          }
        }
      }
#endif
    }
    if (it + 1 < nqt) put_rows(st ^ 1);
    __syncthreads();
  }

  store_dkdv<T, D>(p, bh, kidx, dk, dv, lane);
}

// dq = the f32 accumulator rounded to T.
template <typename T>
__device__ __forceinline__ void attn_dq(const float* acc, T* dq, size_t n) {
  // n is a multiple of D: four elements a thread.
  GRID_STRIDE(i, n / 4) {
    const float4 a = reinterpret_cast<const float4*>(acc)[i];
    reinterpret_cast<uint2*>(dq)[i] = make_uint2(pack2<T>(a.x, a.y), pack2<T>(a.z, a.w));
  }
}

// The deterministic mode, after each launch of the backward: acc (n f32 = rows of D, row r
// the query r % Lq) = acc (0 for the first launch) + the `parts` slabs of n in slab order,
// four columns a thread. Slab k is key block kb0 + k's; when causal a key block
// reaches only the queries from its first key on, and its slab's rows before them hold
// another launch's values: they are skipped (so no slab is ever zeroed).
__device__ __forceinline__ void dq_fold(float* __restrict__ acc, const float* __restrict__ slabs, size_t n,
                                        int parts, int first, int D, int Lq, int causal, int kb0, int keys) {
  GRID_STRIDE(v, n / 4) {
    const size_t i = v * 4;
    const int q = (int)((i / D) % Lq);
    float4 s = first ? make_float4(0.f, 0.f, 0.f, 0.f) : reinterpret_cast<const float4*>(acc)[v];
    for (int k = 0; k < parts; ++k) {
      if (causal && q < (kb0 + k) * keys) break;
      const float4 x = reinterpret_cast<const float4*>(slabs + (size_t)k * n)[v];
      s.x += x.x;
      s.y += x.y;
      s.z += x.z;
      s.w += x.w;
    }
    reinterpret_cast<float4*>(acc)[v] = s;
  }
}

#define ATTN_KERNELS(T, SFX, D)                                                                         \
  extern "C" __global__ void __launch_bounds__(32 * FWD_WARPS, 2) attn_fwd_##SFX##_d##D(const AttnParams p) { \
    attn_fwd<T, D>(p);                                                                                 \
  }                                                                                                    \
  extern "C" __global__ void __launch_bounds__(ATTN_THREADS, 1) attn_bwd_##SFX##_d##D(const AttnParams p) { \
    attn_bwd<T, D>(p);                                                                                 \
  }                                                                                                    \
  extern "C" __global__ void attn_bwd_pre_##SFX##_d##D(const AttnParams p) { attn_bwd_pre<T, D>(p); }

ATTN_KERNELS(__nv_bfloat16, bf16, 64)
ATTN_KERNELS(__nv_bfloat16, bf16, 128)
ATTN_KERNELS(__half, f16, 64)
ATTN_KERNELS(__half, f16, 128)

extern "C" __global__ void __launch_bounds__(32 * WIDE_WARPS, 1) attn_fwd_wide_bf16_d512(const AttnParams p) {
  attn_fwd_wide<__nv_bfloat16, 512>(p);
}
extern "C" __global__ void __launch_bounds__(32 * WIDE_WARPS, 1) attn_fwd_wide_f16_d512(const AttnParams p) {
  attn_fwd_wide<__half, 512>(p);
}

extern "C" __global__ void attn_dq_bf16(const float* acc, __nv_bfloat16* dq, size_t n) { attn_dq(acc, dq, n); }
extern "C" __global__ void attn_dq_f16(const float* acc, __half* dq, size_t n) { attn_dq(acc, dq, n); }
extern "C" __global__ void attn_dq_fold(float* acc, const float* slabs, size_t n, int parts, int first, int D,
                                        int Lq, int causal, int kb0, int keys) {
  dq_fold(acc, slabs, n, parts, first, D, Lq, causal, kb0, keys);
}
