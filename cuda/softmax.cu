// Softmax over the last dim of contiguous (rows, cols): one warp per row, three passes over
// the row (max, sum of exponentials, write). Re-reads of a row hit L1, so device memory sees
// one read and one write. Same arithmetic as the CPU backend: y = exp(x - max) / sum, with
// exp in the accumulation type and the sum in double. A row of -inf gives NaN, as in PyTorch.
#include "common.cuh"
#include "rows.cuh"

template <typename T>
__device__ __forceinline__ void softmax_rows(const T* __restrict__ in, T* __restrict__ out, size_t rows, size_t cols) {
  typedef typename AccT<T>::type A;
  const size_t warps = blockDim.x / 32, lane = threadIdx.x & 31;
  for (size_t r = blockIdx.x * warps + threadIdx.x / 32; r < rows; r += (size_t)gridDim.x * warps) {
    const T* x = in + r * cols;
    T* y = out + r * cols;
    const bool packed = aligned16(x) && aligned16(y);
    const size_t nv = packed ? cols / 8 : 0;
    A m = -INFINITY;
    bool nan = false;
    for (size_t v = lane; v < nv; v += 32) {
      const Pack8<T> p = reinterpret_cast<const Pack8<T>*>(x)[v];
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const A a = to_acc(p.v[k]);
        nan |= a != a;
        m = a > m ? a : m;
      }
    }
    for (size_t c = nv * 8 + lane; c < cols; c += 32) {
      const A a = to_acc(x[c]);
      nan |= a != a;
      m = a > m ? a : m;
    }
#pragma unroll
    for (int s = 16; s > 0; s >>= 1) {
      const A o = __shfl_xor_sync(0xffffffff, m, s);
      m = o > m ? o : m;
      nan |= __shfl_xor_sync(0xffffffff, (int)nan, s);
    }
    if (nan) m = NAN;
    double sum = 0.0;
    for (size_t v = lane; v < nv; v += 32) {
      const Pack8<T> p = reinterpret_cast<const Pack8<T>*>(x)[v];
#pragma unroll
      for (int k = 0; k < 8; ++k) sum += (double)exp(to_acc(p.v[k]) - m);
    }
    for (size_t c = nv * 8 + lane; c < cols; c += 32) sum += (double)exp(to_acc(x[c]) - m);
#pragma unroll
    for (int s = 16; s > 0; s >>= 1) sum += __shfl_xor_sync(0xffffffff, sum, s);
    const A inv = (A)(1.0 / sum);
    for (size_t v = lane; v < nv; v += 32) {
      Pack8<T> p = reinterpret_cast<const Pack8<T>*>(x)[v];
#pragma unroll
      for (int k = 0; k < 8; ++k) p.v[k] = from_acc<T>(exp(to_acc(p.v[k]) - m) * inv);
      reinterpret_cast<Pack8<T>*>(y)[v] = p;
    }
    for (size_t c = nv * 8 + lane; c < cols; c += 32) y[c] = from_acc<T>(exp(to_acc(x[c]) - m) * inv);
  }
}

// exp(x - m), given ml = m * log2(e). f32 keeps the accurate expf. For the half types one FFMA
// and the MUFU ex2.approx (relative error ~2^-22, far under their rounding): expf's range
// reduction made the row kernels instruction-bound, not memory-bound (80% of copy on an H100).
template <typename T>
__device__ __forceinline__ float exp_shifted(float x, float m, float ml) {
  if (sizeof(T) == 4) return expf(x - m);
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(fmaf(x, 1.4426950408889634f, -ml)));
  return r;
}

// Rows of at most PACKS * 256 elements with cols % 8 == 0 and 16-byte aligned (f32 and the half
// types): the row stays in registers, so it is read from memory once. Each exponential is
// computed twice (for the sum, then for the write): keeping them in float instead took 220+
// registers a thread and measured slower on an H100 (84.7% vs 94% of copy at 4608 x 3072).
// The lane's partial sum is float (at most 128 terms, each in [0, 1]); lanes meet in double.
template <typename T, int PACKS>
__device__ __forceinline__ void softmax_rows_reg(const T* __restrict__ in, T* __restrict__ out, size_t rows,
                                                  size_t cols) {
  const size_t warps = blockDim.x / 32, lane = threadIdx.x & 31;
  const size_t nv = cols / 8;
  for (size_t r = blockIdx.x * warps + threadIdx.x / 32; r < rows; r += (size_t)gridDim.x * warps) {
    const Pack8<T>* x = reinterpret_cast<const Pack8<T>*>(in + r * cols);
    Pack8<T>* y = reinterpret_cast<Pack8<T>*>(out + r * cols);
    Pack8<T> buf[PACKS];
#pragma unroll
    for (int k = 0; k < PACKS; ++k)
      if (lane + 32 * k < nv) buf[k] = x[lane + 32 * k];
    float m = -INFINITY, f[8];
    bool nan = false;
#pragma unroll
    for (int k = 0; k < PACKS; ++k) {
      if (lane + 32 * k < nv) {
        widen8(buf[k], f);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          nan |= f[e] != f[e];
          m = fmaxf(m, f[e]);
        }
      }
    }
#pragma unroll
    for (int s = 16; s > 0; s >>= 1) {
      m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, s));
      nan |= __shfl_xor_sync(0xffffffff, (int)nan, s);
    }
    if (nan) m = NAN;
    const float ml = m * 1.4426950408889634f;
    float sum = 0.f;
#pragma unroll
    for (int k = 0; k < PACKS; ++k) {
      if (lane + 32 * k < nv) {
        widen8(buf[k], f);
#pragma unroll
        for (int e = 0; e < 8; ++e) sum += exp_shifted<T>(f[e], m, ml);
      }
    }
    const float inv = (float)(1.0 / warp_sum((double)sum));
#pragma unroll
    for (int k = 0; k < PACKS; ++k) {
      if (lane + 32 * k < nv) {
        Pack8<T> o;
        widen8(buf[k], f);
#pragma unroll
        for (int e = 0; e < 8; ++e) o.v[e] = from_acc<T>(exp_shifted<T>(f[e], m, ml) * inv);
        y[lane + 32 * k] = o;
      }
    }
  }
}

#define SOFTMAX_REG(SUF, T, PACKS)                                                                           \
  extern "C" __global__ void softmax_reg##PACKS##_##SUF(const T* in, T* out, size_t rows, size_t cols) { \
    softmax_rows_reg<T, PACKS>(in, out, rows, cols);                                                        \
  }
// Must match `softmax_t` in src/backend/cuda/storage.rs: f32 rows of up to 1024 columns, half
// types up to 4096 (f32 packs take twice the registers).
#define SOFTMAX_REGS(SUF, T) SOFTMAX_REG(SUF, T, 4) SOFTMAX_REG(SUF, T, 12) SOFTMAX_REG(SUF, T, 16)
SOFTMAX_REG(f32, float, 4)
SOFTMAX_REGS(bf16, __nv_bfloat16)
SOFTMAX_REGS(f16, __half)

#define SOFTMAX(SUF, T)                                                                             \
  extern "C" __global__ void softmax_rows_##SUF(const T* in, T* out, size_t rows, size_t cols) { \
    softmax_rows<T>(in, out, rows, cols);                                                          \
  }
SOFTMAX(f32, float)
SOFTMAX(f64, double)
SOFTMAX(bf16, __nv_bfloat16)
SOFTMAX(f16, __half)

// ---- softmax backward: dx = y (dy - sum(dy y)), one warp per row -------------------------
template <typename T>
__device__ __forceinline__ void softmax_bwd(const T* __restrict__ y, const T* __restrict__ dy, T* __restrict__ dx,
                                            size_t rows, size_t cols) {
  typedef typename AccT<T>::type A;
  const size_t warps = blockDim.x / 32, lane = threadIdx.x & 31;
  for (size_t r = blockIdx.x * warps + threadIdx.x / 32; r < rows; r += (size_t)gridDim.x * warps) {
    const T* yr = y + r * cols;
    const T* gr = dy + r * cols;
    double dot = 0.0;
    for_row2(yr, gr, cols, lane, [&](size_t, T a, T b) { dot += to_f64(a) * to_f64(b); });
    const A d = (A)warp_sum(dot);
    map_row2(yr, gr, dx + r * cols, cols, lane,
             [&](size_t, T a, T b) { return from_acc<T>(to_acc(a) * (to_acc(b) - d)); });
  }
}

// Rows of at most PACKS * 256 elements (cols % 8 == 0, 16-byte aligned; f32 and half types):
// y and dy stay in registers, so each is read once; the dot product sums in float per lane.
template <typename T, int PACKS>
__device__ __forceinline__ void softmax_bwd_reg(const T* __restrict__ y, const T* __restrict__ dy, T* __restrict__ dx,
                                                size_t rows, size_t cols) {
  const size_t warps = blockDim.x / 32, lane = threadIdx.x & 31, nv = cols / 8;
  for (size_t r = blockIdx.x * warps + threadIdx.x / 32; r < rows; r += (size_t)gridDim.x * warps) {
    const Pack8<T>* yr = reinterpret_cast<const Pack8<T>*>(y + r * cols);
    const Pack8<T>* gr = reinterpret_cast<const Pack8<T>*>(dy + r * cols);
    Pack8<T> yv[PACKS], gv[PACKS];
#pragma unroll
    for (int k = 0; k < PACKS; ++k)
      if (lane + 32 * k < nv) {
        yv[k] = yr[lane + 32 * k];
        gv[k] = gr[lane + 32 * k];
      }
    float dot = 0.f, yf[8], gf[8];
#pragma unroll
    for (int k = 0; k < PACKS; ++k)
      if (lane + 32 * k < nv) {
        widen8(yv[k], yf);
        widen8(gv[k], gf);
#pragma unroll
        for (int e = 0; e < 8; ++e) dot += yf[e] * gf[e];
      }
    const float d = (float)warp_sum((double)dot);
    Pack8<T>* out = reinterpret_cast<Pack8<T>*>(dx + r * cols);
#pragma unroll
    for (int k = 0; k < PACKS; ++k)
      if (lane + 32 * k < nv) {
        Pack8<T> o;
        widen8(yv[k], yf);
        widen8(gv[k], gf);
#pragma unroll
        for (int e = 0; e < 8; ++e) o.v[e] = from_acc<T>(yf[e] * (gf[e] - d));
        out[lane + 32 * k] = o;
      }
  }
}

#define SOFTMAX_BWD_REG(SUF, T, P)                                                                             \
  extern "C" __global__ void softmax_bwd_reg##P##_##SUF(const T* y, const T* dy, T* dx, size_t rows, size_t cols) { \
    softmax_bwd_reg<T, P>(y, dy, dx, rows, cols);                                                               \
  }
#define SOFTMAX_BWD_REGS(SUF, T) SOFTMAX_BWD_REG(SUF, T, 4) SOFTMAX_BWD_REG(SUF, T, 12) SOFTMAX_BWD_REG(SUF, T, 16)
// Must match the SoftmaxBackward launcher in src/tensor/kernels/softmax.rs (as the forward).
SOFTMAX_BWD_REG(f32, float, 4)
SOFTMAX_BWD_REGS(bf16, __nv_bfloat16)
SOFTMAX_BWD_REGS(f16, __half)

#define SOFTMAX_BWD(SUF, T)                                                                                 \
  extern "C" __global__ void softmax_bwd_##SUF(const T* y, const T* dy, T* dx, size_t rows, size_t cols) {     \
    softmax_bwd<T>(y, dy, dx, rows, cols);                                                                     \
  }
SOFTMAX_BWD(f32, float)
SOFTMAX_BWD(f64, double)
SOFTMAX_BWD(bf16, __nv_bfloat16)
SOFTMAX_BWD(f16, __half)
