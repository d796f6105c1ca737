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
