// Fill: out[i] = value for i < n. One kernel per dtype; grid-stride loop, so any launch shape
// covers any n (including n > 2^31).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#define FILL(NAME, T, CONVERT)                                                        \
  extern "C" __global__ void NAME(T* __restrict__ out, double value, size_t n) {     \
    const T v = CONVERT(value);                                                        \
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;             \
         i += (size_t)gridDim.x * blockDim.x) {                                        \
      out[i] = v;                                                                      \
    }                                                                                  \
  }

#define AS_F32(x) ((float)(x))
#define AS_F64(x) (x)
#define AS_BF16(x) __double2bfloat16(x)
#define AS_F16(x) __double2half(x)
#define AS_U32(x) ((x) <= 0.0 ? 0u : ((x) >= 4294967295.0 ? 4294967295u : (uint32_t)(x)))

FILL(fill_f32, float, AS_F32)
FILL(fill_f64, double, AS_F64)
FILL(fill_bf16, __nv_bfloat16, AS_BF16)
FILL(fill_f16, __half, AS_F16)
FILL(fill_u32, uint32_t, AS_U32)
