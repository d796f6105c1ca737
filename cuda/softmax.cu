// Softmax over the last dim of contiguous (rows, cols): one warp per row, three passes over
// the row (max, sum of exponentials, write). Re-reads of a row hit L1, so device memory sees
// one read and one write. Same arithmetic as the CPU backend: y = exp(x - max) / sum, with
// exp in the accumulation type and the sum in double. A row of -inf gives NaN, as in PyTorch.
#include "common.cuh"

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

#define SOFTMAX(SUF, T)                                                                             \
  extern "C" __global__ void softmax_rows_##SUF(const T* in, T* out, size_t rows, size_t cols) { \
    softmax_rows<T>(in, out, rows, cols);                                                          \
  }
SOFTMAX(f32, float)
SOFTMAX(f64, double)
SOFTMAX(bf16, __nv_bfloat16)
SOFTMAX(f16, __half)
