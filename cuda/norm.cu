// Fused LayerNorm / RMSNorm over contiguous (rows, cols), forward and backward side by side.
// One warp per row; statistics accumulate in double (as the CPU backend), y and dx are computed
// in the accumulation type. Saved statistics S are float (double for f64 inputs).
//   forward:  mean = sum(x)/n (0 for RMS); rstd = 1/sqrt(sum((x-mean)^2)/n + eps);
//             y = (x - mean) * rstd * w + b          (w, b optional: null pointers)
//   backward: xhat = (x - mean) * rstd; g = dy * w; a = sum(g)/n (0 for RMS);
//             b = sum(g*xhat)/n; dx = rstd * (g - a - xhat * b)
#include "common.cuh"
#include "rows.cuh"

template <typename T, typename S>
__device__ __forceinline__ void norm_fwd(const T* __restrict__ in, const T* w, const T* b, T* __restrict__ out,
                                         S* mean_out, S* rstd_out, size_t rows, size_t cols, double eps, int rms) {
  typedef typename AccT<T>::type A;
  const size_t warps = blockDim.x / 32, lane = threadIdx.x & 31;
  for (size_t r = blockIdx.x * warps + threadIdx.x / 32; r < rows; r += (size_t)gridDim.x * warps) {
    const T* x = in + r * cols;
    double sum = 0.0;
    if (!rms) for_row(x, cols, lane, [&](size_t, T v) { sum += to_f64(v); });
    const double mean = rms ? 0.0 : warp_sum(sum) / (double)cols;
    double sq = 0.0;
    for_row(x, cols, lane, [&](size_t, T v) {
      const double d = to_f64(v) - mean;
      sq += d * d;
    });
    const double rstd = 1.0 / sqrt(warp_sum(sq) / (double)cols + eps);
    const A m = (A)mean, s = (A)rstd;
    T* y = out + r * cols;
    size_t start = 0;
    if (aligned16(x) && aligned16(y) && (!w || aligned16(w)) && (!b || aligned16(b))) {
      // 16-byte packs of x, w, b and y.
      const size_t nv = cols / 8;
      for (size_t v = lane; v < nv; v += 32) {
        const Pack8<T> p = reinterpret_cast<const Pack8<T>*>(x)[v];
        Pack8<T> o, wp, bp;
        if (w) wp = reinterpret_cast<const Pack8<T>*>(w)[v];
        if (b) bp = reinterpret_cast<const Pack8<T>*>(b)[v];
#pragma unroll
        for (int k = 0; k < 8; ++k)
          o.v[k] = from_acc<T>((to_acc(p.v[k]) - m) * s * (w ? to_acc(wp.v[k]) : A(1)) + (b ? to_acc(bp.v[k]) : A(0)));
        reinterpret_cast<Pack8<T>*>(y)[v] = o;
      }
      start = nv * 8;
    }
    for (size_t c = start + lane; c < cols; c += 32) {
      const A wv = w ? to_acc(w[c]) : A(1), bv = b ? to_acc(b[c]) : A(0);
      y[c] = from_acc<T>((to_acc(x[c]) - m) * s * wv + bv);
    }
    if (lane == 0) {
      mean_out[r] = (S)mean;
      rstd_out[r] = (S)rstd;
    }
  }
}

template <typename T, typename S>
__device__ __forceinline__ void norm_bwd(const T* __restrict__ in, const T* __restrict__ dy, const T* w,
                                         const S* mean_in, const S* rstd_in, T* __restrict__ dx, size_t rows,
                                         size_t cols, int rms) {
  typedef typename AccT<T>::type A;
  const size_t warps = blockDim.x / 32, lane = threadIdx.x & 31;
  for (size_t r = blockIdx.x * warps + threadIdx.x / 32; r < rows; r += (size_t)gridDim.x * warps) {
    const T* x = in + r * cols;
    const T* g = dy + r * cols;
    const double m = (double)mean_in[r], s = (double)rstd_in[r];
    double sum_dy = 0.0, sum_dy_xhat = 0.0;
    // g = dy * w in the accumulation type, as the CPU backend computes it.
    auto gw = [&](size_t c, T gv) { return w ? to_acc(gv) * to_acc(w[c]) : to_acc(gv); };
    for_row2(x, g, cols, lane, [&](size_t c, T xv, T gv) {
      const double d = (double)gw(c, gv);
      sum_dy += d;
      sum_dy_xhat += d * ((to_f64(xv) - m) * s);
    });
    const A a = rms ? A(0) : (A)(warp_sum(sum_dy) / (double)cols);
    const A b = (A)(warp_sum(sum_dy_xhat) / (double)cols);
    const A am = (A)m, as = (A)s;
    map_row2(x, g, dx + r * cols, cols, lane, [&](size_t c, T xv, T gv) {
      const A xh = (to_acc(xv) - am) * as;
      return from_acc<T>(as * (gw(c, gv) - a - xh * b));
    });
  }
}

// Register-resident rows: LANES lanes share a row of up to LANES * PACKS * 8 columns (cols % 8
// == 0, rows 16-byte aligned), each lane holding PACKS packs of 8. x (and dy) are read once,
// y (dx) written once; the sums reduce with shuffles inside each group of LANES lanes. Rows
// advance per block, so every lane of a warp takes part in every shuffle.
template <int LANES>
__device__ __forceinline__ double group_sum(double v) {
#pragma unroll
  for (int s = LANES / 2; s > 0; s >>= 1) v += __shfl_xor_sync(0xffffffff, v, s);
  return v;
}

template <typename T, typename S, int PACKS, int LANES>
__device__ __forceinline__ void norm_fwd_reg(const T* __restrict__ in, const T* w, const T* b, T* __restrict__ out,
                                             S* mean_out, S* rstd_out, size_t rows, size_t cols, double eps, int rms) {
  typedef typename AccT<T>::type A;
  const int lane = threadIdx.x % LANES;
  const size_t per_block = blockDim.x / LANES, packs = cols / 8;
  for (size_t base = blockIdx.x * per_block; base < rows; base += (size_t)gridDim.x * per_block) {
    const size_t r = base + threadIdx.x / LANES;
    const bool valid = r < rows;
    const Pack8<T>* x = reinterpret_cast<const Pack8<T>*>(in + (valid ? r : 0) * cols);
    Pack8<T> v[PACKS];
    double sum = 0.0;
#pragma unroll
    for (int k = 0; k < PACKS; ++k) {
      const size_t p = (size_t)k * LANES + lane;
      if (valid && p < packs) {
        v[k] = x[p];
#pragma unroll
        for (int e = 0; e < 8; ++e) sum += to_f64(v[k].v[e]);
      }
    }
    const double mean = rms ? 0.0 : group_sum<LANES>(sum) / (double)cols;
    double sq = 0.0;
#pragma unroll
    for (int k = 0; k < PACKS; ++k) {
      const size_t p = (size_t)k * LANES + lane;
      if (valid && p < packs) {
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          const double d = to_f64(v[k].v[e]) - mean;
          sq += d * d;
        }
      }
    }
    const double rstd = 1.0 / sqrt(group_sum<LANES>(sq) / (double)cols + eps);
    if (!valid) continue;
    const A m = (A)mean, s = (A)rstd;
    Pack8<T>* y = reinterpret_cast<Pack8<T>*>(out + r * cols);
#pragma unroll
    for (int k = 0; k < PACKS; ++k) {
      const size_t p = (size_t)k * LANES + lane;
      if (p < packs) {
        Pack8<T> o, wp, bp;
        if (w) wp = reinterpret_cast<const Pack8<T>*>(w)[p];
        if (b) bp = reinterpret_cast<const Pack8<T>*>(b)[p];
#pragma unroll
        for (int e = 0; e < 8; ++e)
          o.v[e] = from_acc<T>((to_acc(v[k].v[e]) - m) * s * (w ? to_acc(wp.v[e]) : A(1)) + (b ? to_acc(bp.v[e]) : A(0)));
        y[p] = o;
      }
    }
    if (lane == 0) {
      mean_out[r] = (S)mean;
      rstd_out[r] = (S)rstd;
    }
  }
}

template <typename T, typename S, int PACKS, int LANES>
__device__ __forceinline__ void norm_bwd_reg(const T* __restrict__ in, const T* __restrict__ dy, const T* w,
                                             const S* mean_in, const S* rstd_in, T* __restrict__ dx, size_t rows,
                                             size_t cols, int rms) {
  typedef typename AccT<T>::type A;
  const int lane = threadIdx.x % LANES;
  const size_t per_block = blockDim.x / LANES, packs = cols / 8;
  for (size_t base = blockIdx.x * per_block; base < rows; base += (size_t)gridDim.x * per_block) {
    const size_t r = base + threadIdx.x / LANES;
    const bool valid = r < rows;
    const size_t off = (valid ? r : 0) * cols;
    const double m = valid ? (double)mean_in[r] : 0.0, s = valid ? (double)rstd_in[r] : 0.0;
    Pack8<T> xv[PACKS], gv[PACKS];
    double sum_g = 0.0, sum_gx = 0.0;
#pragma unroll
    for (int k = 0; k < PACKS; ++k) {
      const size_t p = (size_t)k * LANES + lane;
      if (valid && p < packs) {
        xv[k] = reinterpret_cast<const Pack8<T>*>(in + off)[p];
        gv[k] = reinterpret_cast<const Pack8<T>*>(dy + off)[p];
        Pack8<T> wp;
        if (w) wp = reinterpret_cast<const Pack8<T>*>(w)[p];
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          const double g = (double)(w ? to_acc(gv[k].v[e]) * to_acc(wp.v[e]) : to_acc(gv[k].v[e]));
          sum_g += g;
          sum_gx += g * ((to_f64(xv[k].v[e]) - m) * s);
        }
      }
    }
    const A a = rms ? A(0) : (A)(group_sum<LANES>(sum_g) / (double)cols);
    const A bq = (A)(group_sum<LANES>(sum_gx) / (double)cols);
    if (!valid) continue;
    const A am = (A)m, as = (A)s;
#pragma unroll
    for (int k = 0; k < PACKS; ++k) {
      const size_t p = (size_t)k * LANES + lane;
      if (p < packs) {
        Pack8<T> o, wp;
        if (w) wp = reinterpret_cast<const Pack8<T>*>(w)[p];
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          const A g = w ? to_acc(gv[k].v[e]) * to_acc(wp.v[e]) : to_acc(gv[k].v[e]);
          const A xh = (to_acc(xv[k].v[e]) - am) * as;
          o.v[e] = from_acc<T>(as * (g - a - xh * bq));
        }
        reinterpret_cast<Pack8<T>*>(dx + off)[p] = o;
      }
    }
  }
}

#define NORM_REG(SUF, T, P, L)                                                                               \
  extern "C" __global__ void norm_fwd_reg_##P##_##L##_##SUF(const T* x, const T* w, const T* b, T* y, float* mean, \
                                                            float* rstd, size_t rows, size_t cols, double eps,  \
                                                            int rms) {                                          \
    norm_fwd_reg<T, float, P, L>(x, w, b, y, mean, rstd, rows, cols, eps, rms);                                \
  }                                                                                                             \
  extern "C" __global__ void norm_bwd_reg_##P##_##L##_##SUF(const T* x, const T* dy, const T* w,               \
                                                            const float* mean, const float* rstd, T* dx,        \
                                                            size_t rows, size_t cols, int rms) {                \
    norm_bwd_reg<T, float, P, L>(x, dy, w, mean, rstd, dx, rows, cols, rms);                                    \
  }
// Must match `reg_shape` in src/backend/cuda/norm.rs.
#define NORM_REG_ALL(SUF, T) \
  NORM_REG(SUF, T, 1, 4)     \
  NORM_REG(SUF, T, 1, 8)     \
  NORM_REG(SUF, T, 1, 16)    \
  NORM_REG(SUF, T, 1, 32)
NORM_REG_ALL(f32, float)
NORM_REG_ALL(bf16, __nv_bfloat16)
NORM_REG_ALL(f16, __half)

#define NORM(SUF, T, S)                                                                                  \
  extern "C" __global__ void norm_fwd_##SUF(const T* x, const T* w, const T* b, T* y, S* mean, S* rstd,   \
                                            size_t rows, size_t cols, double eps, int rms) {             \
    norm_fwd<T, S>(x, w, b, y, mean, rstd, rows, cols, eps, rms);                                        \
  }                                                                                                      \
  extern "C" __global__ void norm_bwd_##SUF(const T* x, const T* dy, const T* w, const S* mean,           \
                                            const S* rstd, T* dx, size_t rows, size_t cols, int rms) {   \
    norm_bwd<T, S>(x, dy, w, mean, rstd, dx, rows, cols, rms);                                           \
  }
NORM(f32, float, float)
NORM(f64, double, double)
NORM(bf16, __nv_bfloat16, float)
NORM(f16, __half, float)
