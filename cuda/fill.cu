// Fill: out[i] = value for i < n, converted from double with one rounding (u32 saturates),
// as the CPU backend does. Grid-stride loop: any launch shape covers any n.
#include "common.cuh"

#define FILL(SUF, T)                                                                   \
  extern "C" __global__ void fill_##SUF(T* __restrict__ out, double value, size_t n) { \
    const T v = from_f64<T>(value);                                                    \
    GRID_STRIDE(i, n) out[i] = v;                                                      \
  }

FILL(f32, float)
FILL(f64, double)
FILL(bf16, __nv_bfloat16)
FILL(f16, __half)
FILL(u32, uint32_t)
