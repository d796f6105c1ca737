// GGML block-quantized weights of GGUF files (the DequantGgml kernel of
// src/tensor/kernels/dequant_ggml.rs; the CPU reference and the layouts, from ggml's
// ggml-common.h and gguf-py's quants.py, in src/backend/ggml.rs).
//
//   blocks  (nblocks * block bytes) u8, read from u32 words   the blocks as the file stores them
//   w       (nblocks * block values) T                       rows of whole blocks, row order
//
// One thread per block, grid-stride loops; each thread writes its block's values. Every scale
// is an f16 read byte by byte (blocks of 18, 22, 34 or 210 bytes leave them 2-aligned at best).
// The arithmetic is gguf-py's, in f32 with explicit rounding (__fmul_rn, __fadd_rn,
// __fsub_rn: no fused multiply-add), so the values are the CPU's bit for bit; each is rounded
// once to T.
#include "common.cuh"

#define QK_K 256

__device__ __forceinline__ float f16_at(const uint8_t* b) {
  return __half2float(__ushort_as_half((unsigned short)(b[0] | (b[1] << 8))));
}

template <typename T>
__device__ __forceinline__ void put(T* y, size_t i, float v) {
  y[i] = from_acc<T>(v);
}
template <>
__device__ __forceinline__ void put<double>(double* y, size_t i, float v) {
  y[i] = (double)v;
}

// A block type: BYTES per block, VALUES per block, and `block(b, y)` writing its values.
template <typename T>
__device__ __forceinline__ void blk_f32(const uint8_t* b, T* y) {
  put(y, 0, __uint_as_float((uint32_t)b[0] | ((uint32_t)b[1] << 8) | ((uint32_t)b[2] << 16) | ((uint32_t)b[3] << 24)));
}
template <typename T>
__device__ __forceinline__ void blk_f16(const uint8_t* b, T* y) {
  put(y, 0, f16_at(b));
}
template <typename T>
__device__ __forceinline__ void blk_bf16(const uint8_t* b, T* y) {
  put(y, 0, __uint_as_float(((uint32_t)b[0] | ((uint32_t)b[1] << 8)) << 16));
}

// Q4_0: d | qs[16]; value j < 16 the low nibble of qs[j], j >= 16 the high of qs[j - 16]; d (q - 8).
template <typename T>
__device__ __forceinline__ void blk_q4_0(const uint8_t* b, T* y) {
  const float d = f16_at(b);
  for (int j = 0; j < 16; ++j) {
    const uint8_t q = b[2 + j];
    put(y, j, __fmul_rn(d, (float)((int)(q & 0xF) - 8)));
    put(y, j + 16, __fmul_rn(d, (float)((int)(q >> 4) - 8)));
  }
}

// Q4_1: d | m | qs[16]; d q + m.
template <typename T>
__device__ __forceinline__ void blk_q4_1(const uint8_t* b, T* y) {
  const float d = f16_at(b), m = f16_at(b + 2);
  for (int j = 0; j < 16; ++j) {
    const uint8_t q = b[4 + j];
    put(y, j, __fadd_rn(__fmul_rn(d, (float)(q & 0xF)), m));
    put(y, j + 16, __fadd_rn(__fmul_rn(d, (float)(q >> 4)), m));
  }
}

__device__ __forceinline__ uint32_t u32_at(const uint8_t* b) {
  return (uint32_t)b[0] | ((uint32_t)b[1] << 8) | ((uint32_t)b[2] << 16) | ((uint32_t)b[3] << 24);
}

// The 5-bit code j of a Q5 block: the nibble as Q4, bit j of qh on top.
__device__ __forceinline__ int q5_code(uint32_t qh, const uint8_t* qs, int j) {
  const int lo = j < 16 ? (qs[j] & 0xF) : (qs[j - 16] >> 4);
  return lo | (int)(((qh >> j) & 1u) << 4);
}

// Q5_0: d | qh u32 | qs[16]; d (q - 16).
template <typename T>
__device__ __forceinline__ void blk_q5_0(const uint8_t* b, T* y) {
  const float d = f16_at(b);
  const uint32_t qh = u32_at(b + 2);
  for (int j = 0; j < 32; ++j) put(y, j, __fmul_rn(d, (float)(q5_code(qh, b + 6, j) - 16)));
}

// Q5_1: d | m | qh u32 | qs[16]; d q + m.
template <typename T>
__device__ __forceinline__ void blk_q5_1(const uint8_t* b, T* y) {
  const float d = f16_at(b), m = f16_at(b + 2);
  const uint32_t qh = u32_at(b + 4);
  for (int j = 0; j < 32; ++j) put(y, j, __fadd_rn(__fmul_rn(d, (float)q5_code(qh, b + 8, j)), m));
}

// Q8_0: d | qs[32] i8; q d.
template <typename T>
__device__ __forceinline__ void blk_q8_0(const uint8_t* b, T* y) {
  const float d = f16_at(b);
  for (int j = 0; j < 32; ++j) put(y, j, __fmul_rn((float)(int8_t)b[2 + j], d));
}

// Q2_K: scales[16] | qs[64] | d | dmin. Value j: group j / 16 (scale low nibble, min high),
// code (qs[32 (j / 128) + j % 32] >> 2 ((j % 128) / 32)) & 3; (d sc) q - (dmin m).
template <typename T>
__device__ __forceinline__ void blk_q2_k(const uint8_t* b, T* y) {
  const uint8_t *sc = b, *qs = b + 16;
  const float d = f16_at(b + 80), dmin = f16_at(b + 82);
  for (int j = 0; j < QK_K; ++j) {
    const int q = (qs[(j / 128) * 32 + j % 32] >> (2 * ((j % 128) / 32))) & 3;
    const uint8_t s = sc[j / 16];
    const float dl = __fmul_rn(d, (float)(s & 0xF)), ml = __fmul_rn(dmin, (float)(s >> 4));
    put(y, j, __fsub_rn(__fmul_rn(dl, (float)q), ml));
  }
}

// Q3_K: hmask[32] | qs[64] | scales[12] | d. 16 6-bit scales (low nibbles in bytes 0..8, two
// high bits in bytes 8..12), minus 32; code = 2 bits of qs (as Q2_K) minus 4 where the hmask
// bit (j / 32 of hmask[j % 32]) is clear; (d sc) q.
template <typename T>
__device__ __forceinline__ void blk_q3_k(const uint8_t* b, T* y) {
  const uint8_t *hm = b, *qs = b + 32, *sc = b + 96;
  const float d = f16_at(b + 108);
  for (int j = 0; j < QK_K; ++j) {
    const int i = j / 16;
    const int lo = i < 8 ? (sc[i] & 0xF) : (sc[i - 8] >> 4);
    const int hi = (sc[8 + i % 4] >> (2 * (i / 4))) & 3;
    const int s = (int)(int8_t)(uint8_t)(lo | (hi << 4)) - 32;
    const int ql = (qs[(j / 128) * 32 + j % 32] >> (2 * ((j % 128) / 32))) & 3;
    const int h = ((hm[j % 32] >> (j / 32)) & 1) ^ 1;
    put(y, j, __fmul_rn(__fmul_rn(d, (float)s), (float)(ql - (h << 2))));
  }
}

// The scale and minimum of group g (0..8) of a Q4_K / Q5_K block's 12 scale bytes.
__device__ __forceinline__ void k_scale_min(const uint8_t* sc, int g, int* s, int* m) {
  if (g < 4) {
    *s = sc[g] & 0x3F;
    *m = sc[g + 4] & 0x3F;
  } else {
    *s = (sc[g + 4] & 0xF) | ((sc[g - 4] >> 2) & 0x30);
    *m = (sc[g + 4] >> 4) | ((sc[g] >> 2) & 0x30);
  }
}

// Q4_K: d | dmin | scales[12] | qs[128]. Group g (32 values): nibble g % 2 of qs[32 (g / 2) + l];
// (d sc) q - (dmin m).
template <typename T>
__device__ __forceinline__ void blk_q4_k(const uint8_t* b, T* y) {
  const float d = f16_at(b), dmin = f16_at(b + 2);
  const uint8_t *sc = b + 4, *qs = b + 16;
  for (int g = 0; g < 8; ++g) {
    int s, m;
    k_scale_min(sc, g, &s, &m);
    const float dl = __fmul_rn(d, (float)s), ml = __fmul_rn(dmin, (float)m);
    for (int l = 0; l < 32; ++l) {
      const int q = (qs[(g / 2) * 32 + l] >> (4 * (g % 2))) & 0xF;
      put(y, g * 32 + l, __fsub_rn(__fmul_rn(dl, (float)q), ml));
    }
  }
}

// Q5_K: d | dmin | scales[12] | qh[32] | qs[128]; as Q4_K with bit g of qh[l] as the fifth bit.
template <typename T>
__device__ __forceinline__ void blk_q5_k(const uint8_t* b, T* y) {
  const float d = f16_at(b), dmin = f16_at(b + 2);
  const uint8_t *sc = b + 4, *qh = b + 16, *qs = b + 48;
  for (int g = 0; g < 8; ++g) {
    int s, m;
    k_scale_min(sc, g, &s, &m);
    const float dl = __fmul_rn(d, (float)s), ml = __fmul_rn(dmin, (float)m);
    for (int l = 0; l < 32; ++l) {
      const int q = ((qs[(g / 2) * 32 + l] >> (4 * (g % 2))) & 0xF) | (((qh[l] >> g) & 1) << 4);
      put(y, g * 32 + l, __fsub_rn(__fmul_rn(dl, (float)q), ml));
    }
  }
}

// Q6_K: ql[128] | qh[64] | scales[16] i8 | d. Value j (half h = j / 128, r = j % 128): low
// nibble r / 64 of ql[64 h + r % 64], two high bits r / 32 of qh[32 h + r % 32], minus 32;
// (d sc) q.
template <typename T>
__device__ __forceinline__ void blk_q6_k(const uint8_t* b, T* y) {
  const uint8_t *ql = b, *qh = b + 128, *sc = b + 192;
  const float d = f16_at(b + 208);
  for (int j = 0; j < QK_K; ++j) {
    const int h = j / 128, r = j % 128;
    const int lo = (ql[h * 64 + r % 64] >> (4 * (r / 64))) & 0xF;
    const int hi = (qh[h * 32 + r % 32] >> (2 * (r / 32))) & 3;
    const int q = (int)(int8_t)(uint8_t)(lo | (hi << 4)) - 32;
    put(y, j, __fmul_rn(__fmul_rn(d, (float)(int8_t)sc[j / 16]), (float)q));
  }
}

#define DEQUANT_GGML(NAME, BYTES, VALUES, SUF, T)                                                         \
  extern "C" __global__ void dequant_##NAME##_##SUF(const uint32_t* words, T* w, size_t blocks) {         \
    const uint8_t* bytes = reinterpret_cast<const uint8_t*>(words);                                         \
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < blocks;                              \
         i += (size_t)gridDim.x * blockDim.x)                                                               \
      blk_##NAME<T>(bytes + i * (BYTES), w + i * (VALUES));                                                 \
  }

#define DEQUANT_GGML_ALL(NAME, BYTES, VALUES)     \
  DEQUANT_GGML(NAME, BYTES, VALUES, f32, float)  \
  DEQUANT_GGML(NAME, BYTES, VALUES, f64, double) \
  DEQUANT_GGML(NAME, BYTES, VALUES, bf16, __nv_bfloat16) \
  DEQUANT_GGML(NAME, BYTES, VALUES, f16, __half)

DEQUANT_GGML_ALL(f32, 4, 1)
DEQUANT_GGML_ALL(f16, 2, 1)
DEQUANT_GGML_ALL(bf16, 2, 1)
DEQUANT_GGML_ALL(q4_0, 18, 32)
DEQUANT_GGML_ALL(q4_1, 20, 32)
DEQUANT_GGML_ALL(q5_0, 22, 32)
DEQUANT_GGML_ALL(q5_1, 24, 32)
DEQUANT_GGML_ALL(q8_0, 34, 32)
DEQUANT_GGML_ALL(q2_k, 84, QK_K)
DEQUANT_GGML_ALL(q3_k, 110, QK_K)
DEQUANT_GGML_ALL(q4_k, 144, QK_K)
DEQUANT_GGML_ALL(q5_k, 176, QK_K)
DEQUANT_GGML_ALL(q6_k, 210, QK_K)
