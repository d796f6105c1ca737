// Warp-per-row helpers shared by the row kernels (norm.cu, fused.cu): each lane visits its
// elements of one contiguous row with 16-byte loads when the row is aligned.
#pragma once
#include "common.cuh"

// Calls f(index, value) for this lane's elements of a row, with 16-byte loads when aligned.
// `step` is the number of lanes sharing the row: 32 for a warp, blockDim.x for a block.
template <typename T, typename F>
__device__ __forceinline__ void for_row(const T* x, size_t cols, size_t lane, F f, size_t step = 32) {
  size_t start = 0;
  if (aligned16(x)) {
    const size_t nv = cols / 8;
    for (size_t v = lane; v < nv; v += step) {
      const Pack8<T> p = reinterpret_cast<const Pack8<T>*>(x)[v];
#pragma unroll
      for (int k = 0; k < 8; ++k) f(v * 8 + k, p.v[k]);
    }
    start = nv * 8;
  }
  for (size_t c = start + lane; c < cols; c += step) f(c, x[c]);
}

// Like for_row over two rows of one shape.
template <typename T, typename F>
__device__ __forceinline__ void for_row2(const T* x, const T* y, size_t cols, size_t lane, F f, size_t step = 32) {
  size_t start = 0;
  if (aligned16(x) && aligned16(y)) {
    const size_t nv = cols / 8;
    for (size_t v = lane; v < nv; v += step) {
      const Pack8<T> p = reinterpret_cast<const Pack8<T>*>(x)[v];
      const Pack8<T> q = reinterpret_cast<const Pack8<T>*>(y)[v];
#pragma unroll
      for (int k = 0; k < 8; ++k) f(v * 8 + k, p.v[k], q.v[k]);
    }
    start = nv * 8;
  }
  for (size_t c = start + lane; c < cols; c += step) f(c, x[c], y[c]);
}

// out[c] = f(c, x[c], y[c]) with 16-byte stores when aligned.
template <typename T, typename F>
__device__ __forceinline__ void map_row2(const T* x, const T* y, T* out, size_t cols, size_t lane, F f,
                                         size_t step = 32) {
  size_t start = 0;
  if (aligned16(x) && aligned16(y) && aligned16(out)) {
    const size_t nv = cols / 8;
    for (size_t v = lane; v < nv; v += step) {
      const Pack8<T> p = reinterpret_cast<const Pack8<T>*>(x)[v];
      const Pack8<T> q = reinterpret_cast<const Pack8<T>*>(y)[v];
      Pack8<T> o;
#pragma unroll
      for (int k = 0; k < 8; ++k) o.v[k] = f(v * 8 + k, p.v[k], q.v[k]);
      reinterpret_cast<Pack8<T>*>(out)[v] = o;
    }
    start = nv * 8;
  }
  for (size_t c = start + lane; c < cols; c += step) out[c] = f(c, x[c], y[c]);
}

__device__ __forceinline__ double warp_sum(double v) {
#pragma unroll
  for (int s = 16; s > 0; s >>= 1) v += __shfl_xor_sync(0xffffffff, v, s);
  return v;
}

// ---- column sums by row blocks -----------------------------------------------------------
// The parameter gradients of the norms and of the modulation are column sums over rows that
// the backward's row kernel reads anyway (dw = sum dy xhat, db = sum dy; dscale = sum dy x,
// dshift = sum dy), so that kernel sums them on the way instead of a second sweep re-reading
// x and dy. A block owns a chunk of consecutive rows; its threads form groups of `lw` lanes
// (a power of two up to 32, or a multiple of 32), lane l of a group holding column packs
// l, l + lw, ... (P of them) in every row, so each thread keeps its columns' sums in float
// registers over the whole chunk (as PyTorch's per-thread sums are float). Group g takes
// every groups-th row of the chunk. At the end the groups meet in shared memory in a fixed
// order and the block writes one partial row per sum; `sum_partials2` (fused.cu) adds the
// blocks' rows in order, in double, so the result does not depend on timing.
#define COLSUM_THREADS 256  // a block's threads when a row needs fewer (several groups)

// Lanes [0, lw) of a group take part; sums over a group of lw lanes within one warp (lw <= 32).
__device__ __forceinline__ float lane_group_sum(float v, int lw) {
  for (int s = (lw < 32 ? lw : 32) / 2; s > 0; s >>= 1) v += __shfl_xor_sync(0xffffffff, v, s);
  return v;
}

// Writes the block's partial rows part_a[c], part_b[c] for this thread's column packs, after
// adding the other groups' sums (groups > 1 only when P == 1 and blockDim.x == COLSUM_THREADS).
template <int P>
__device__ __forceinline__ void colsum_finish(float (&a)[P][8], float (&b)[P][8], float* __restrict__ part_a,
                                              float* __restrict__ part_b, size_t packs, int lw) {
  const int groups = blockDim.x / lw, g = threadIdx.x / lw, lane = threadIdx.x % lw;
  if (P == 1 && groups > 1) {
    __shared__ float4 comb[2][COLSUM_THREADS][2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      comb[0][threadIdx.x][h] = make_float4(a[0][4 * h], a[0][4 * h + 1], a[0][4 * h + 2], a[0][4 * h + 3]);
      comb[1][threadIdx.x][h] = make_float4(b[0][4 * h], b[0][4 * h + 1], b[0][4 * h + 2], b[0][4 * h + 3]);
    }
    __syncthreads();
    if (g == 0)
      for (int o = 1; o < groups; ++o)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const float4 u = comb[0][o * lw + lane][h], v = comb[1][o * lw + lane][h];
          a[0][4 * h] += u.x, a[0][4 * h + 1] += u.y, a[0][4 * h + 2] += u.z, a[0][4 * h + 3] += u.w;
          b[0][4 * h] += v.x, b[0][4 * h + 1] += v.y, b[0][4 * h + 2] += v.z, b[0][4 * h + 3] += v.w;
        }
  }
  if (g != 0) return;
#pragma unroll
  for (int k = 0; k < P; ++k) {
    const size_t p = (size_t)k * lw + lane;
    if (p >= packs) continue;
    float4* pa = reinterpret_cast<float4*>(part_a + p * 8);
    float4* pb = reinterpret_cast<float4*>(part_b + p * 8);
    pa[0] = make_float4(a[k][0], a[k][1], a[k][2], a[k][3]);
    pa[1] = make_float4(a[k][4], a[k][5], a[k][6], a[k][7]);
    pb[0] = make_float4(b[k][0], b[k][1], b[k][2], b[k][3]);
    pb[1] = make_float4(b[k][4], b[k][5], b[k][6], b[k][7]);
  }
}

// ---- the norms' backward with column sums (norm.cu norm_bwd_params, norm_bulk.cu) ----------
// xhat = (x - mean) rstd; g = dy w; a = sum(g)/n (0 for RMS); bq = rstd sum(g (x - mean))/n;
// dx = rstd (g - a - xhat bq); dw += dy xhat, db += dy.

// A lane's P weight packs (packs lane, lane + lw, ...) widened, 1 where there is no weight or
// pack; its column sums zeroed.
template <typename T, int P>
__device__ __forceinline__ void norm_sums_init(const T* w, float (&wf)[P][8], float (&aw)[P][8], float (&ab)[P][8],
                                               size_t packs, int lw, int lane) {
#pragma unroll
  for (int k = 0; k < P; ++k) {
    const size_t p = (size_t)k * lw + lane;
    if (w && p < packs) {
      widen<true>(reinterpret_cast<const Pack8<T>*>(w)[p], wf[k]);
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) wf[k][e] = 1.f;
    }
#pragma unroll
    for (int e = 0; e < 8; ++e) aw[k][e] = ab[k][e] = 0.f;
  }
}

// One pack's share of a row's two sums: sum(g) and sum(g (x - mean)).
template <typename T>
__device__ __forceinline__ void norm_row_sums(const Pack8<T>& xp, const Pack8<T>& gp, const float (&wf)[8], float m,
                                              float& sum_g, float& sum_gx) {
  float xf[8], gf[8];
  widen<true>(xp, xf);
  widen<true>(gp, gf);
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    const float gw = gf[e] * wf[e];
    sum_g += gw;
    sum_gx += gw * (xf[e] - m);
  }
}

// One pack of dx, adding dy xhat and dy to the pack's column sums.
template <typename T>
__device__ __forceinline__ Pack8<T> norm_dx_sums(const Pack8<T>& xp, const Pack8<T>& gp, const float (&wf)[8], float m,
                                                 float s, float a, float bq, float (&aw)[8], float (&ab)[8]) {
  float xf[8], gf[8];
  widen<true>(xp, xf);
  widen<true>(gp, gf);
  Pack8<T> o;
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    const float xh = (xf[e] - m) * s;
    o.v[e] = from_acc<T>(s * (gf[e] * wf[e] - a - xh * bq));
    aw[e] += gf[e] * xh;
    ab[e] += gf[e];
  }
  return o;
}
