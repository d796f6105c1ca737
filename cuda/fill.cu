// Fill: out[i] = value for i < n, converted from double with one rounding (u32 saturates),
// as the CPU backend does. Grid-stride loop: any launch shape covers any n.
#include "common.cuh"

// An aligned buffer is written 8 elements (16 to 64 bytes) per store.
template <typename T>
__device__ __forceinline__ void fill_impl(T* __restrict__ out, double value, size_t n) {
  const T v = from_f64<T>(value);
  size_t done = 0;
  if (aligned16(out)) {
    Pack8<T> p;
#pragma unroll
    for (int k = 0; k < 8; ++k) p.v[k] = v;
    GRID_STRIDE(i, n / 8) reinterpret_cast<Pack8<T>*>(out)[i] = p;
    done = n / 8 * 8;
  }
  GRID_STRIDE(i, n - done) out[done + i] = v;
}
#define FILL(SUF, T)                                                                   \
  extern "C" __global__ void fill_##SUF(T* __restrict__ out, double value, size_t n) { \
    fill_impl<T>(out, value, n);                                                       \
  }

FILL(f32, float)
FILL(f64, double)
FILL(bf16, __nv_bfloat16)
FILL(f16, __half)
FILL(u32, uint32_t)
