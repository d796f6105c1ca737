// FP8 E4M3 weights (the DequantFp8 kernel of src/tensor/kernels/dequant_fp8.rs, which holds
// the CPU reference; the format in src/backend/fp8.rs).
//
//   codes  (rows, words) u32   four E4M3 codes a word, the first in the low byte
//   scale  (rows)        f32   one scale per row (output channel)
//   w      (rows, cols)  T     cols = 4 words; w = decode(code) * scale in f32, rounded once
//
// One thread per word: one 4-byte load, four values out; rows of whole 16-code groups take
// dequant_fp8_x16 (a thread per 16 codes, 16-byte loads and stores). E4M3 decodes exactly into f32 by bit
// rules (OCP OFP8: bias 7, subnormals 0.mmm * 2^-6, S.1111.111 is NaN), so the f32 product is
// the CPU's bit for bit.
#include "common.cuh"

__device__ __forceinline__ float e4m3_decode(uint32_t c) {
  const uint32_t sign = (c & 0x80u) << 24;
  const uint32_t e = (c >> 3) & 0xFu, m = c & 0x7u;
  if (e == 0xFu && m == 0x7u) return __int_as_float(0x7FC00000u | sign);
  if (e == 0) {
    // m * 2^-9, exact in f32.
    const float v = (float)m * 0.001953125f;
    return __int_as_float(__float_as_int(v) | sign);
  }
  // Rebias 7 -> 127 and widen the mantissa 3 -> 23 bits.
  return __int_as_float(sign | ((e + 120u) << 23) | (m << 20));
}

// The j-th code of a word decoded and multiplied by its row's scale, in f32 (rounded once).
__device__ __forceinline__ float scaled_code(uint32_t word, int j, float s) {
  return __fmul_rn(e4m3_decode((word >> (8 * j)) & 0xFFu), s);
}

template <typename T>
__device__ __forceinline__ void dequant_fp8(const uint32_t* codes, const float* scale, T* w, size_t words_per_row,
                                            size_t words) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < words; i += (size_t)gridDim.x * blockDim.x) {
    const uint32_t word = codes[i];
    const float s = scale[i / words_per_row];
#pragma unroll
    for (int j = 0; j < 4; ++j) w[4 * i + j] = from_acc<T>(scaled_code(word, j, s));
  }
}

template <>
__device__ __forceinline__ void dequant_fp8<double>(const uint32_t* codes, const float* scale, double* w,
                                                    size_t words_per_row, size_t words) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < words; i += (size_t)gridDim.x * blockDim.x) {
    const uint32_t word = codes[i];
    const float s = scale[i / words_per_row];
#pragma unroll
    for (int j = 0; j < 4; ++j) w[4 * i + j] = (double)scaled_code(word, j, s);
  }
}

// Rows of whole 16-code groups (cols % 16 == 0, 16-byte aligned operands; the launcher checks):
// a thread per group, one 16-byte load, 16 values out in 16-byte stores. The values are those
// of dequant_fp8 bit for bit (the same decode and product). The row of a group comes from a
// 32-bit division while the groups fit 32 bits.
template <typename T>
__device__ __forceinline__ void dequant_fp8_x16(const uint4* codes, const float* scale, T* w, size_t groups_per_row,
                                                size_t groups) {
  static_assert((16 * sizeof(T)) % 16 == 0, "whole 16-byte stores");
  const bool narrow = groups <= 0xFFFFFFFFull;
  for (size_t g = blockIdx.x * (size_t)blockDim.x + threadIdx.x; g < groups; g += (size_t)gridDim.x * blockDim.x) {
    const size_t row = narrow ? (size_t)((uint32_t)g / (uint32_t)groups_per_row) : g / groups_per_row;
    const float s = scale[row];
    const uint4 q = codes[g];
    const uint32_t words[4] = {q.x, q.y, q.z, q.w};
    alignas(16) T out[16];
#pragma unroll
    for (int j = 0; j < 16; ++j) out[j] = from_acc<T>(scaled_code(words[j / 4], j % 4, s));
    uint4* dst = reinterpret_cast<uint4*>(w + 16 * g);
    const uint4* src = reinterpret_cast<const uint4*>(out);
#pragma unroll
    for (int k = 0; k < (int)(16 * sizeof(T) / 16); ++k) dst[k] = src[k];
  }
}

#define DEQUANT_FP8(SUF, T)                                                                                  \
  extern "C" __global__ void dequant_fp8_##SUF(const uint32_t* codes, const float* scale, T* w,              \
                                               size_t words_per_row, size_t words) {                         \
    dequant_fp8<T>(codes, scale, w, words_per_row, words);                                                   \
  }
DEQUANT_FP8(f32, float)
DEQUANT_FP8(f64, double)
DEQUANT_FP8(bf16, __nv_bfloat16)
DEQUANT_FP8(f16, __half)

#define DEQUANT_FP8_X16(SUF, T)                                                                              \
  extern "C" __global__ void dequant_fp8_x16_##SUF(const uint4* codes, const float* scale, T* w,             \
                                                   size_t groups_per_row, size_t groups) {                   \
    dequant_fp8_x16<T>(codes, scale, w, groups_per_row, groups);                                             \
  }
DEQUANT_FP8_X16(f32, float)
DEQUANT_FP8_X16(bf16, __nv_bfloat16)
DEQUANT_FP8_X16(f16, __half)
