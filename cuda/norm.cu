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
    map_row2(x, x, out + r * cols, cols, lane, [&](size_t c, T v, T) {
      const A wv = w ? to_acc(w[c]) : A(1), bv = b ? to_acc(b[c]) : A(0);
      return from_acc<T>((to_acc(v) - m) * s * wv + bv);
    });
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
