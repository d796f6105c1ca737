// Fused kernels of src/tensor/kernels/ (modulate, RoPE, SwiGLU), forward and backward side by side,
// and the deterministic sums of partial rows that the column sums of several kernels share
// (softmax's backward is in softmax.cu beside its forward, the norms' in norm.cu, GroupNorm's
// in group_norm.cu). Every operand is contiguous (the launcher copies views), but SwiGLU's input,
// read in place as rows of pitch ld (a narrow of a wider projection). Sums accumulate
// in double, as the CPU reference does; y and dx are computed in the accumulation type and
// rounded once.
//
// Shape letters: (B, L, D) for modulation; (B, H, L, D) for RoPE with R = 1 or B rotation
// sets.
#include "common.cuh"
#include "rows.cuh"

// ---- column sweeps ------------------------------------------------------------------------
// Block (x: 256 columns, y: chunk p of rows, z: batch b); each thread sums its column over
// its chunk and writes two partials, part[(p * 2 + j) * M + b * cols + c] with M = B * cols;
// sum_partials2 adds the chunks in a fixed order (deterministic).

// ModulateBackward: dx = dy (1 + scale) written on the way; dshift = sum_l dy, dscale = sum_l dy x.
template <typename T>
__device__ __forceinline__ void modulate_bwd(const T* __restrict__ x, const T* __restrict__ dy, const T* scale,
                                             T* __restrict__ dx, double* part, size_t B, size_t L, size_t D,
                                             size_t chunk) {
  typedef typename AccT<T>::type A;
  const size_t d = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
  if (d >= D) return;
  const size_t p = blockIdx.y, b = blockIdx.z, l0 = p * chunk, l1 = min(L, l0 + chunk);
  const A s1 = A(1) + to_acc(scale[b * D + d]);
  double ss = 0.0, sc = 0.0;
#pragma unroll 4
  for (size_t l = l0; l < l1; ++l) {
    const size_t i = (b * L + l) * D + d;
    const T g = dy[i];
    dx[i] = from_acc<T>(to_acc(g) * s1);
    ss += to_f64(g);
    sc += to_f64(g) * to_f64(x[i]);
  }
  const size_t M = B * D;
  part[(p * 2) * M + b * D + d] = ss;
  part[(p * 2 + 1) * M + b * D + d] = sc;
}

// ModulateBackward by row blocks (rows.cuh's column sums): block (blockIdx.x, b) owns a
// chunk of the L rows of batch b and writes its partial rows of dshift = sum dy and
// dscale = sum dy x into part[(blockIdx.x * 2 + k) * B * D + b * D]; dx = dy (1 + scale) on
// the way. D % 8 == 0 and 16-byte aligned rows; P packs a lane, RPT rows a group at once.
template <typename T, int P, int RPT>
__device__ __forceinline__ void modulate_bwd_rows(const T* __restrict__ x, const T* __restrict__ dy, const T* scale,
                                                  T* __restrict__ dx, float* __restrict__ part, size_t B, size_t L,
                                                  size_t D, size_t chunk, int lw) {
  const int groups = blockDim.x / lw, g = threadIdx.x / lw, lane = threadIdx.x % lw;
  const size_t b = blockIdx.y, packs = D / 8, l0 = blockIdx.x * chunk, l1 = min(L, l0 + chunk);
  float s1[P][8], as[P][8], ax[P][8];
#pragma unroll
  for (int k = 0; k < P; ++k) {
    const size_t p = (size_t)k * lw + lane;
    if (p < packs) widen<true>(reinterpret_cast<const Pack8<T>*>(scale + b * D)[p], s1[k]);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      s1[k][e] = p < packs ? 1.f + s1[k][e] : 1.f;
      as[k][e] = ax[k][e] = 0.f;
    }
  }
  for (size_t base = l0; base < l1; base += (size_t)groups * RPT) {
    Pack8<T> xv[RPT][P], gv[RPT][P];
#pragma unroll
    for (int j = 0; j < RPT; ++j) {
      const size_t l = base + (size_t)j * groups + g, off = (b * L + (l < l1 ? l : 0)) * D;
#pragma unroll
      for (int k = 0; k < P; ++k) {
        const size_t p = (size_t)k * lw + lane;
        if (l < l1 && p < packs) {
          xv[j][k] = reinterpret_cast<const Pack8<T>*>(x + off)[p];
          gv[j][k] = reinterpret_cast<const Pack8<T>*>(dy + off)[p];
        }
      }
    }
#pragma unroll
    for (int j = 0; j < RPT; ++j) {
      const size_t l = base + (size_t)j * groups + g;
      if (l >= l1) continue;
      Pack8<T>* out = reinterpret_cast<Pack8<T>*>(dx + (b * L + l) * D);
#pragma unroll
      for (int k = 0; k < P; ++k) {
        const size_t p = (size_t)k * lw + lane;
        if (p < packs) {
          float xf[8], gf[8];
          widen<true>(xv[j][k], xf);
          widen<true>(gv[j][k], gf);
          Pack8<T> o;
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            o.v[e] = from_acc<T>(gf[e] * s1[k][e]);
            as[k][e] += gf[e];
            ax[k][e] += gf[e] * xf[e];
          }
          out[p] = o;
        }
      }
    }
  }
  const size_t M = B * D;
  colsum_finish<P>(as, ax, part + blockIdx.x * 2 * M + b * D, part + (blockIdx.x * 2 + 1) * M + b * D, packs, lw);
}

// Must match `ModulateBackward`'s launcher in src/tensor/kernels/modulate.rs (as norm_bwd_params).
#define MODULATE_BWD_ROWS(SUF, T)                                                                               \
  extern "C" __global__ void __launch_bounds__(512)                                                             \
      modulate_bwd_rows_1_##SUF(const T* x, const T* dy, const T* scale, T* dx, float* part, size_t B, size_t L, \
                                size_t D, size_t chunk, int lw) {                                               \
    modulate_bwd_rows<T, 1, 4>(x, dy, scale, dx, part, B, L, D, chunk, lw);                                     \
  }                                                                                                             \
  extern "C" __global__ void __launch_bounds__(512)                                                             \
      modulate_bwd_rows_2_##SUF(const T* x, const T* dy, const T* scale, T* dx, float* part, size_t B, size_t L, \
                                size_t D, size_t chunk, int lw) {                                               \
    modulate_bwd_rows<T, 2, 2>(x, dy, scale, dx, part, B, L, D, chunk, lw);                                     \
  }
MODULATE_BWD_ROWS(f32, float)
MODULATE_BWD_ROWS(bf16, __nv_bfloat16)
MODULATE_BWD_ROWS(f16, __half)

// Block (x: 32 outputs, y: slice of the partial rows) of 32 x SUM_GROUPS threads: the groups
// walk the slice's rows and meet in shared memory in a fixed order. With several slices, each
// block leaves its slice's sums in `scratch` ([slice][2][m], double) and counts itself done in
// done[blockIdx.x]; the last of a column tile's blocks adds the slices in slice order and sets
// the count back to zero, so the result does not depend on which block finishes last. (One
// block per 32 outputs walking all partial rows took 8 us for a Flux-width norm's 264 rows and
// 13 us for RMSNorm's 660 rows of 128 on an H100, each thread's loads mostly serial.)
#define SUM_GROUPS 32  // must match `sum_parts` in src/backend/cuda/fused.rs (32 * 32 threads)
template <typename PT, typename S>
__device__ __forceinline__ void sum_partials2(const PT* part, size_t parts, size_t m_total, S* out0, S* out1,
                                              double* scratch, unsigned* done) {
  __shared__ double sh[2][SUM_GROUPS][32];
  __shared__ bool last;
  const int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;
  const size_t m = blockIdx.x * (size_t)32 + tx, slices = gridDim.y;
  const size_t per = (parts + slices - 1) / slices, p0 = blockIdx.y * per, p1 = min(parts, p0 + per);
  double a = 0.0, b = 0.0;
  if (m < m_total) {
#pragma unroll 4
    for (size_t p = p0 + ty; p < p1; p += SUM_GROUPS) {
      a += part[(p * 2) * m_total + m];
      b += part[(p * 2 + 1) * m_total + m];
    }
  }
  sh[0][ty][tx] = a;
  sh[1][ty][tx] = b;
  __syncthreads();
  if (ty == 0) {
    a = 0.0;
    b = 0.0;
    for (int k = 0; k < SUM_GROUPS; ++k) {
      a += sh[0][k][tx];
      b += sh[1][k][tx];
    }
  }
  if (slices == 1) {
    if (ty == 0 && m < m_total) {
      out0[m] = from_f64<S>(a);
      out1[m] = from_f64<S>(b);
    }
    return;
  }
  if (ty == 0 && m < m_total) {
    scratch[(blockIdx.y * 2) * m_total + m] = a;
    scratch[(blockIdx.y * 2 + 1) * m_total + m] = b;
  }
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(done + blockIdx.x, 1u) == slices - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  if (ty == 0 && m < m_total) {
    a = 0.0;
    b = 0.0;
    for (size_t s = 0; s < slices; ++s) {
      a += __ldcg(scratch + (s * 2) * m_total + m);
      b += __ldcg(scratch + (s * 2 + 1) * m_total + m);
    }
    out0[m] = from_f64<S>(a);
    out1[m] = from_f64<S>(b);
  }
  if (threadIdx.x == 0) done[blockIdx.x] = 0;
}

// ---- modulate forward: y = x (1 + scale[b]) + shift[b] ------------------------------------
template <typename T, typename I>
__device__ __forceinline__ void modulate_fwd(const T* __restrict__ x, const T* shift, const T* scale,
                                             T* __restrict__ y, I B, I L, I D) {
  typedef typename AccT<T>::type A;
  const I n = B * L * D, LD = L * D;
  if (D % 8 == 0 && aligned16(x) && aligned16(y)) {
    GRID_STRIDE(v, (size_t)(n / 8)) {
      const I i = (I)v * 8, p = i / LD * D + i % D;
      const Pack8<T> a = reinterpret_cast<const Pack8<T>*>(x)[v];
      Pack8<T> o;
#pragma unroll
      for (int k = 0; k < 8; ++k)
        o.v[k] = from_acc<T>(modulate_value<A>(to_acc(a.v[k]), to_acc(scale[p + k]), to_acc(shift[p + k])));
      reinterpret_cast<Pack8<T>*>(y)[v] = o;
    }
    return;
  }
  GRID_STRIDE(j, (size_t)n) {
    const I i = (I)j, p = i / LD * D + i % D;
    y[i] = from_acc<T>(modulate_value<A>(to_acc(x[i]), to_acc(scale[p]), to_acc(shift[p])));
  }
}

// ---- RoPE: (a, b) -> (m0 a + m1 b, m2 a + m3 b), or by the transpose (the backward) ---------
template <typename T, typename R, typename I>
__device__ __forceinline__ void rope(const T* __restrict__ x, const R* __restrict__ rot, T* __restrict__ y,
                                     I H, I L, I half, I Rb, I pairs, int transpose) {
  typedef typename AccT<T>::type A;
  GRID_STRIDE(j, (size_t)pairs) {
    const I p = (I)j, i = p % half, l = p / half % L, b = p / (half * L * H);
    const R* m = rot + (((b % Rb) * L + l) * half + i) * 4;
    const A m0 = (A)m[0], m1 = (A)m[transpose ? 2 : 1], m2 = (A)m[transpose ? 1 : 2], m3 = (A)m[3];
    const A a = to_acc(x[2 * p]), c = to_acc(x[2 * p + 1]);
    y[2 * p] = from_acc<T>(m0 * a + m1 * c);
    y[2 * p + 1] = from_acc<T>(m2 * a + m3 * c);
  }
}

// Four pairs per thread with 16-byte loads of x and y (half % 4 == 0, aligned), float rotations,
// for ROPE_HEADS heads at once: the heads share the rotation, which is then read once for all
// of them (read once per head, from L2, it moved 4x the bytes of x), and their loads are in
// flight together. Work items run pack-fastest, then position, then head group.
#define ROPE_HEADS 4
template <typename T, typename I>
__device__ __forceinline__ void rope_vec(const T* __restrict__ x, const float* __restrict__ rot, T* __restrict__ y,
                                         I H, I L, I half, I Rb, I pairs, int transpose) {
  if (H == 0) return;
  const I qn = half / 4, hg = (H + ROPE_HEADS - 1) / ROPE_HEADS;
  const size_t items = (size_t)(pairs / (4 * H)) * hg;
  GRID_STRIDE(j, items) {
    const I t = (I)j, q = t % qn, l = t / qn % L, g = t / (qn * L) % hg, b = t / (qn * L * hg);
    const float4* m = reinterpret_cast<const float4*>(rot + (((b % Rb) * L + l) * half + q * 4) * 4);
    float4 r[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      r[k] = m[k];
      if (transpose) {
        const float z = r[k].y;
        r[k].y = r[k].z;
        r[k].z = z;
      }
    }
    const size_t head_stride = (size_t)L * qn;
    const size_t at = (((size_t)b * H + g * ROPE_HEADS) * L + l) * qn + q;
    Pack8<T> a[ROPE_HEADS];
#pragma unroll
    for (int h = 0; h < ROPE_HEADS; ++h)
      if (g * ROPE_HEADS + h < H) a[h] = reinterpret_cast<const Pack8<T>*>(x)[at + h * head_stride];
#pragma unroll
    for (int h = 0; h < ROPE_HEADS; ++h) {
      if (g * ROPE_HEADS + h >= H) break;
      Pack8<T> o;
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const float u = to_acc(a[h].v[2 * k]), v = to_acc(a[h].v[2 * k + 1]);
        o.v[2 * k] = from_acc<T>(r[k].x * u + r[k].y * v);
        o.v[2 * k + 1] = from_acc<T>(r[k].z * u + r[k].w * v);
      }
      reinterpret_cast<Pack8<T>*>(y)[at + h * head_stride] = o;
    }
  }
}


// ---- SwiGLU: x = [a | u] (rows of pitch ld, 2 M used) -> y = silu(a) u (R, M) --------------
// The backward writes da = g u silu'(a) and du = g silu(a) side by side, (R, 2 M) dense:
// silu'(a) = s (1 + a (1 - s)), s = sigmoid(a). Eight columns a thread with 16-byte packs where
// M, ld and the pointers allow.
template <typename T, typename I>
__device__ __forceinline__ void swiglu_fwd(const T* __restrict__ x, T* __restrict__ y, I R, I M, I ld) {
  typedef typename AccT<T>::type A;
  if (M % 8 == 0 && ld % 8 == 0 && aligned16(x) && aligned16(y)) {
    const I m8 = M / 8;
    GRID_STRIDE(v, (size_t)(R * m8)) {
      const I r = (I)v / m8, c = (I)v % m8 * 8;
      const Pack8<T> a = *reinterpret_cast<const Pack8<T>*>(x + r * ld + c);
      const Pack8<T> u = *reinterpret_cast<const Pack8<T>*>(x + r * ld + M + c);
      Pack8<T> o;
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const A av = to_acc(a.v[k]);
        o.v[k] = from_acc<T>(av * sigmoid_t(av) * to_acc(u.v[k]));
      }
      *reinterpret_cast<Pack8<T>*>(y + r * M + c) = o;
    }
    return;
  }
  GRID_STRIDE(j, (size_t)(R * M)) {
    const I r = (I)j / M, c = (I)j % M;
    const A av = to_acc(x[r * ld + c]);
    y[(I)j] = from_acc<T>(av * sigmoid_t(av) * to_acc(x[r * ld + M + c]));
  }
}

template <typename T, typename I>
__device__ __forceinline__ void swiglu_bwd(const T* __restrict__ x, const T* __restrict__ g, T* __restrict__ dx,
                                           I R, I M, I ld, I ldg) {
  typedef typename AccT<T>::type A;
  if (M % 8 == 0 && ld % 8 == 0 && ldg % 8 == 0 && aligned16(x) && aligned16(g) && aligned16(dx)) {
    const I m8 = M / 8;
    GRID_STRIDE(v, (size_t)(R * m8)) {
      const I r = (I)v / m8, c = (I)v % m8 * 8;
      const Pack8<T> a = *reinterpret_cast<const Pack8<T>*>(x + r * ld + c);
      const Pack8<T> u = *reinterpret_cast<const Pack8<T>*>(x + r * ld + M + c);
      const Pack8<T> gv = *reinterpret_cast<const Pack8<T>*>(g + r * ldg + c);
      Pack8<T> da, du;
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const A av = to_acc(a.v[k]), gk = to_acc(gv.v[k]), s = sigmoid_t(av);
        da.v[k] = from_acc<T>(gk * to_acc(u.v[k]) * (s * (A(1) + av * (A(1) - s))));
        du.v[k] = from_acc<T>(gk * av * s);
      }
      *reinterpret_cast<Pack8<T>*>(dx + r * 2 * M + c) = da;
      *reinterpret_cast<Pack8<T>*>(dx + r * 2 * M + M + c) = du;
    }
    return;
  }
  GRID_STRIDE(j, (size_t)(R * M)) {
    const I r = (I)j / M, c = (I)j % M;
    const A av = to_acc(x[r * ld + c]), gk = to_acc(g[r * ldg + c]), s = sigmoid_t(av);
    dx[r * 2 * M + c] = from_acc<T>(gk * to_acc(x[r * ld + M + c]) * (s * (A(1) + av * (A(1) - s))));
    dx[r * 2 * M + M + c] = from_acc<T>(gk * av * s);
  }
}


#define FUSED_T(SUF, T, S_)                                                                                   \
  extern "C" __global__ void modulate_bwd_##SUF(const T* x, const T* dy, const T* scale, T* dx, double* part,  \
                                                size_t B, size_t L, size_t D, size_t chunk) {                  \
    modulate_bwd<T>(x, dy, scale, dx, part, B, L, D, chunk);                                                   \
  }                                                                                                            \
  extern "C" __global__ void modulate_fwd_##SUF(const T* x, const T* shift, const T* scale, T* y, size_t B,    \
                                                size_t L, size_t D) {                                          \
    if (B * L * D < 0xffffffffull)                                                                             \
      modulate_fwd<T, uint32_t>(x, shift, scale, y, (uint32_t)B, (uint32_t)L, (uint32_t)D);                    \
    else                                                                                                       \
      modulate_fwd<T, size_t>(x, shift, scale, y, B, L, D);                                                    \
  }                                                                                                            \
  extern "C" __global__ void rope_##SUF(const T* x, const S_* rot, T* y, size_t H, size_t L, size_t half,      \
                                        size_t Rb, size_t pairs, int transpose) {                              \
    if (Rb * L * half * 4 < 0xffffffffull && pairs < 0x7fffffffull)                                            \
      rope<T, S_, uint32_t>(x, rot, y, (uint32_t)H, (uint32_t)L, (uint32_t)half, (uint32_t)Rb,                 \
                            (uint32_t)pairs, transpose);                                                       \
    else                                                                                                       \
      rope<T, S_, size_t>(x, rot, y, H, L, half, Rb, pairs, transpose);                                        \
  }                                                                                                            \
  extern "C" __global__ void swiglu_fwd_##SUF(const T* x, T* y, size_t R, size_t M, size_t ld) {               \
    if (R * ld < 0xffffffffull && R * 2 * M < 0xffffffffull)                                                   \
      swiglu_fwd<T, uint32_t>(x, y, (uint32_t)R, (uint32_t)M, (uint32_t)ld);                                   \
    else                                                                                                       \
      swiglu_fwd<T, size_t>(x, y, R, M, ld);                                                                   \
  }                                                                                                            \
  extern "C" __global__ void swiglu_bwd_##SUF(const T* x, const T* g, T* dx, size_t R, size_t M, size_t ld,   \
                                              size_t ldg) {                                                    \
    if (R * ld < 0xffffffffull && R * 2 * M < 0xffffffffull && R * ldg < 0xffffffffull)                        \
      swiglu_bwd<T, uint32_t>(x, g, dx, (uint32_t)R, (uint32_t)M, (uint32_t)ld, (uint32_t)ldg);                \
    else                                                                                                       \
      swiglu_bwd<T, size_t>(x, g, dx, R, M, ld, ldg);                                                          \
  }
FUSED_T(f32, float, float)
FUSED_T(f64, double, double)
FUSED_T(bf16, __nv_bfloat16, float)
FUSED_T(f16, __half, float)

// Rotations in float with 16-byte packs of x: the fast path for f32, bf16 and f16.
#define ROPE_VEC(SUF, T)                                                                                     \
  extern "C" __global__ void rope_vec_##SUF(const T* x, const float* rot, T* y, size_t H, size_t L,           \
                                            size_t half, size_t Rb, size_t pairs, int transpose) {            \
    rope_vec<T, uint32_t>(x, rot, y, (uint32_t)H, (uint32_t)L, (uint32_t)half, (uint32_t)Rb, (uint32_t)pairs, \
                          transpose);                                                                         \
  }
ROPE_VEC(f32, float)
ROPE_VEC(bf16, __nv_bfloat16)
ROPE_VEC(f16, __half)

// The sweeps' double partials (sum_partials2_*) and the row blocks' float ones (rows.cuh,
// sum_partials2f_*), summed in double into the output's type.
#define SUM_PARTIALS2(NAME, PT, SUF, T)                                                                      \
  extern "C" __global__ void __launch_bounds__(1024)                                                        \
      NAME##_##SUF(const PT* part, size_t parts, size_t m, T* a, T* b, double* scratch, unsigned* done) {   \
    sum_partials2<PT, T>(part, parts, m, a, b, scratch, done);                                             \
  }
SUM_PARTIALS2(sum_partials2, double, f32, float)
SUM_PARTIALS2(sum_partials2, double, f64, double)
SUM_PARTIALS2(sum_partials2, double, bf16, __nv_bfloat16)
SUM_PARTIALS2(sum_partials2, double, f16, __half)
SUM_PARTIALS2(sum_partials2f, float, f32, float)
SUM_PARTIALS2(sum_partials2f, float, bf16, __nv_bfloat16)
SUM_PARTIALS2(sum_partials2f, float, f16, __half)
