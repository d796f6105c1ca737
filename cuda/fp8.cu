// FP8 E4M3 and int8 weights (the DequantFp8 kernel of src/tensor/kernels/dequant_fp8.rs, which holds
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
#include <type_traits>

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

// Int8 codes (src/backend/int8.rs): the byte as a two's-complement integer, exact in f32.
__device__ __forceinline__ float i8_decode(uint32_t c) { return (float)(int)(int8_t)(uint8_t)c; }

// The codes' formats (src/backend/fp8.rs's Code8): 0 FP8 E4M3, 1 int8.
#define CODE_E4M3 0
#define CODE_INT8 1

template <int C>
__device__ __forceinline__ float decode8(uint32_t c) {
  if constexpr (C == CODE_INT8) return i8_decode(c);
  else return e4m3_decode(c);
}

// The j-th code of a word decoded and multiplied by its row's scale, in f32 (rounded once).
template <int C = CODE_E4M3>
__device__ __forceinline__ float scaled_code(uint32_t word, int j, float s) {
  return __fmul_rn(decode8<C>((word >> (8 * j)) & 0xFFu), s);
}

template <typename T, int C>
__device__ __forceinline__ void dequant_fp8(const uint32_t* codes, const float* scale, T* w, size_t words_per_row,
                                            size_t words) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < words; i += (size_t)gridDim.x * blockDim.x) {
    const uint32_t word = codes[i];
    const float s = scale[i / words_per_row];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if constexpr (std::is_same<T, double>::value) w[4 * i + j] = (double)scaled_code<C>(word, j, s);
      else w[4 * i + j] = from_acc<T>(scaled_code<C>(word, j, s));
    }
  }
}

// Rows of whole 16-code groups (cols % 16 == 0, 16-byte aligned operands; the launcher checks):
// a thread per group, one 16-byte load, 16 values out in 16-byte stores. The values are those
// of dequant_fp8 bit for bit (the same decode and product). The row of a group comes from a
// 32-bit division while the groups fit 32 bits.
template <typename T, int C>
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
    for (int j = 0; j < 16; ++j) out[j] = from_acc<T>(scaled_code<C>(words[j / 4], j % 4, s));
    uint4* dst = reinterpret_cast<uint4*>(w + 16 * g);
    const uint4* src = reinterpret_cast<const uint4*>(out);
#pragma unroll
    for (int k = 0; k < (int)(16 * sizeof(T) / 16); ++k) dst[k] = src[k];
  }
}

// dequant_fp8_* decode E4M3 codes, dequant_i8_* int8 codes (the same packing and product).
#define DEQUANT_FP8(NAME, C, SUF, T)                                                                         \
  extern "C" __global__ void NAME##_##SUF(const uint32_t* codes, const float* scale, T* w,                  \
                                          size_t words_per_row, size_t words) {                              \
    dequant_fp8<T, C>(codes, scale, w, words_per_row, words);                                                \
  }
DEQUANT_FP8(dequant_fp8, CODE_E4M3, f32, float)
DEQUANT_FP8(dequant_fp8, CODE_E4M3, f64, double)
DEQUANT_FP8(dequant_fp8, CODE_E4M3, bf16, __nv_bfloat16)
DEQUANT_FP8(dequant_fp8, CODE_E4M3, f16, __half)
DEQUANT_FP8(dequant_i8, CODE_INT8, f32, float)
DEQUANT_FP8(dequant_i8, CODE_INT8, f64, double)
DEQUANT_FP8(dequant_i8, CODE_INT8, bf16, __nv_bfloat16)
DEQUANT_FP8(dequant_i8, CODE_INT8, f16, __half)

#define DEQUANT_FP8_X16(NAME, C, SUF, T)                                                                     \
  extern "C" __global__ void NAME##_x16_##SUF(const uint4* codes, const float* scale, T* w,                 \
                                              size_t groups_per_row, size_t groups) {                        \
    dequant_fp8_x16<T, C>(codes, scale, w, groups_per_row, groups);                                          \
  }
DEQUANT_FP8_X16(dequant_fp8, CODE_E4M3, f32, float)
DEQUANT_FP8_X16(dequant_fp8, CODE_E4M3, bf16, __nv_bfloat16)
DEQUANT_FP8_X16(dequant_fp8, CODE_E4M3, f16, __half)
DEQUANT_FP8_X16(dequant_i8, CODE_INT8, f32, float)
DEQUANT_FP8_X16(dequant_i8, CODE_INT8, bf16, __nv_bfloat16)
DEQUANT_FP8_X16(dequant_i8, CODE_INT8, f16, __half)

// ---------------------------------------------------------------------------------------------
// 8-bit products (src/tensor/kernels/fp8_products.rs holds the CPU reference of each).
//
// quant_rows_fp8: x (rows, cols) T, optional col_scale (cols) f32 -> codes (rows, cols / 4) u32,
// scale (rows) f32. Per row: v = x * col_scale (f32, rounded once), s = absmax(v) / 448 (1 for an
// all-zero or non-finite maximum), r = 1 / s (f32, rounded once), code = e4m3(v * r) (the product
// rounded once, then to E4M3 with ties to even, saturating). The encode follows
// src/backend/fp8.rs's `encode` bit for bit.
__device__ __forceinline__ uint32_t e4m3_encode(float x) {
  if (isnan(x)) return 0x7Fu;
  const uint32_t sign = signbit(x) ? 0x80u : 0u;
  const float a = fabsf(x);
  if (a >= 448.0f) return sign | 0x7Eu;
  const uint32_t bits = __float_as_uint(a);
  const int exp = (int)(bits >> 23) - 127;
  if (exp < -6) return sign | (uint32_t)rintf(a * 512.0f);
  const uint32_t man = bits & 0x7FFFFFu;
  uint32_t code = ((uint32_t)(exp + 7) << 3) | (man >> 20);
  const uint32_t rest = man & 0xFFFFFu;
  if (rest > 0x80000u || (rest == 0x80000u && (code & 1u))) code += 1u;
  return sign | min(code, 0x7Eu);
}

// Four values to four codes, the first in the low byte: e4m3_encode's codes. Built for
// compute_90 (build.rs's `fp8_sm90` module, which launchers pick on Hopper), two hardware
// conversions (cvt.rn.satfinite.e4m3x2.f32: round to nearest even, saturating to +-448, sign
// kept through zero) with NaN set to e4m3_encode's 0x7F; tests/fp8_products.rs holds them to
// the CPU's encode over every code's value, the midpoints between codes and their neighbours.
__device__ __forceinline__ uint32_t e4m3_encode4(float a, float b, float c, float d) {
#if __CUDA_ARCH__ >= 890
  uint16_t lo, hi;
  // The second source goes to the low byte.
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(b), "f"(a));
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(d), "f"(c));
  uint32_t w = (uint32_t)lo | ((uint32_t)hi << 16);
  if (isnan(a)) w = (w & 0xFFFFFF00u) | 0x7Fu;
  if (isnan(b)) w = (w & 0xFFFF00FFu) | 0x7F00u;
  if (isnan(c)) w = (w & 0xFF00FFFFu) | 0x7F0000u;
  if (isnan(d)) w = (w & 0x00FFFFFFu) | 0x7F000000u;
  return w;
#else
  return e4m3_encode(a) | (e4m3_encode(b) << 8) | (e4m3_encode(c) << 16) | (e4m3_encode(d) << 24);
#endif
}

// Int8 (src/backend/int8.rs's `encode`): round to nearest even (cvt.rni), clamp to +-127, NaN to 0.
__device__ __forceinline__ uint32_t i8_encode(float x) {
  if (isnan(x)) return 0u;
  const int q = max(-127, min(127, __float2int_rn(x)));
  return (uint32_t)(uint8_t)(int8_t)q;
}

template <int C>
__device__ __forceinline__ uint32_t encode4(float a, float b, float c, float d) {
  if constexpr (C == CODE_INT8) {
    return i8_encode(a) | (i8_encode(b) << 8) | (i8_encode(c) << 16) | (i8_encode(d) << 24);
  } else {
    return e4m3_encode4(a, b, c, d);
  }
}

// One step of a row's absmax: E4M3's fmaxf drops NaN values (they keep their own NaN code);
// int8's keeps a NaN (src/backend/int8.rs's `absmax_step`), which gives the row a NaN scale.
template <int C>
__device__ __forceinline__ float absmax_step(float m, float v) {
  if constexpr (C == CODE_INT8) return (isnan(m) || isnan(v)) ? __int_as_float(0x7FC00000) : fmaxf(m, v);
  else return fmaxf(m, v);
}

// The row's scale from its absmax: E4M3 absmax / 448 (1 for zero or non-finite); int8 absmax /
// 127 (1 for zero, NaN for non-finite).
template <int C>
__device__ __forceinline__ float row_scale8(float m) {
  if constexpr (C == CODE_INT8) {
    if (m == 0.0f) return 1.0f;
    return isfinite(m) ? __fdiv_rn(m, 127.0f) : __int_as_float(0x7FC00000);
  } else {
    return (m > 0.0f && isfinite(m)) ? __fdiv_rn(m, 448.0f) : 1.0f;
  }
}

// Layout of the work: a row is read in chunks of N elements (N a multiple of 4: a chunk encodes
// into N / 4 whole code words), with one 16- or 8-byte load a chunk (VEC) or N scalar loads.
// G threads share a row (blockDim.x = G), R rows a block (blockDim.y = R); thread t of a row
// takes chunks t, t + G, t + 2G, ... Its first K chunks stay in registers between the absmax
// pass and the encode pass, so a row of at most K * G chunks is read from global memory once;
// chunks past those (rows wider than the launcher's largest block holds) are read again in the
// encode pass. G is a power of two up to 32 (R rows share a warp, the absmax reduced by
// shuffles within G lanes) or a multiple of 32 with R = 1 (reduced through shared memory).
// Every thread of a warp takes part in the shuffles, also those of a row past the last.
template <typename T, int N>
struct alignas(N * sizeof(T) >= 16 ? 16 : N * sizeof(T)) QuantChunk {
  T v[N];
};

template <int BYTES> struct QuantVec;
template <> struct QuantVec<8> { typedef uint2 type; };
template <> struct QuantVec<16> { typedef uint4 type; };

template <typename T, int N, bool VEC>
__device__ __forceinline__ void load_quant_chunk(const T* p, QuantChunk<T, N>& c) {
  if constexpr (VEC) {
    static_assert(N * sizeof(T) == 8 || N * sizeof(T) == 16, "one 8- or 16-byte load a chunk");
    typedef typename QuantVec<N * sizeof(T)>::type V;
    *reinterpret_cast<V*>(c.v) = *reinterpret_cast<const V*>(p);
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j) c.v[j] = p[j];
  }
}

// The chunk's N values as f32, each multiplied by its column's factor when COLS (cs: the
// chunk's N factors; 16-byte aligned when VEC).
template <typename T, int N, bool COLS, bool VEC>
__device__ __forceinline__ void quant_values(const QuantChunk<T, N>& c, const float* cs, float (&v)[N]) {
#pragma unroll
  for (int j = 0; j < N; ++j) v[j] = to_acc(c.v[j]);
  if constexpr (COLS) {
    float f[N];
    if constexpr (VEC) {
#pragma unroll
      for (int q = 0; q < N / 4; ++q) {
        const float4 g = reinterpret_cast<const float4*>(cs)[q];
        f[4 * q] = g.x;
        f[4 * q + 1] = g.y;
        f[4 * q + 2] = g.z;
        f[4 * q + 3] = g.w;
      }
    } else {
#pragma unroll
      for (int j = 0; j < N; ++j) f[j] = cs[j];
    }
#pragma unroll
    for (int j = 0; j < N; ++j) v[j] = __fmul_rn(v[j], f[j]);
  }
}

template <typename T, int N, bool COLS, bool VEC, int C>
__device__ __forceinline__ float chunk_absmax(const QuantChunk<T, N>& c, const float* cs, float m) {
  float v[N];
  quant_values<T, N, COLS, VEC>(c, cs, v);
#pragma unroll
  for (int j = 0; j < N; ++j) m = absmax_step<C>(m, fabsf(v[j]));
  return m;
}

// The chunk's N codes, e4m3(v * r), stored as N / 4 words at `out` (8-byte aligned when VEC and
// N == 8).
template <typename T, int N, bool COLS, bool VEC, int C>
__device__ __forceinline__ void encode_chunk(const QuantChunk<T, N>& c, const float* cs, float r, uint32_t* out) {
  float v[N];
  quant_values<T, N, COLS, VEC>(c, cs, v);
  uint32_t words[N / 4];
#pragma unroll
  for (int q = 0; q < N / 4; ++q) {
    words[q] = encode4<C>(__fmul_rn(v[4 * q], r), __fmul_rn(v[4 * q + 1], r), __fmul_rn(v[4 * q + 2], r),
                            __fmul_rn(v[4 * q + 3], r));
  }
  if constexpr (VEC && N == 8) {
    *reinterpret_cast<uint2*>(out) = make_uint2(words[0], words[1]);
  } else {
#pragma unroll
    for (int q = 0; q < N / 4; ++q) out[q] = words[q];
  }
}

// Chunks a thread keeps in registers between the two passes.
#define QUANT_HELD 4

// What a quantizing kernel computes from x before it quantizes (the fused producers of
// src/tensor/kernels/produce8.rs): nothing, adaLN's modulation y = x (1 + scale) + shift (shift
// and scale rows a batch of `per_batch` rows), GELU's tanh form, or the row [a, gelu_tanh(x)]
// (Flux's single blocks: attention's output beside the MLP's activation; with nothing of x,
// attention's heads merged): row r = (b, l) of a is a_seq rows a batch (b = r / a_seq), its
// `split` values heads of a_hd at strides a_sb, a_sl, a_sh (attention's (B, H, L, D) output
// read as (B, L, H, D); a plain matrix is one head of `split` values at a pitch of a_sl); x's
// rows cols - split values at a pitch of `x_pitch`; split and a_hd multiples of the chunk.
// With a producer the kernel writes y (rounded to T, the values it quantizes) beside the
// codes, as the producer's own kernel computes it (common.cuh).
#define PRO_NONE 0
#define PRO_MODULATE 1
#define PRO_GELU_TANH 2
#define PRO_CAT_GELU 3
template <typename T> struct Producer {
  T* y;
  const T* shift;
  const T* scale;
  size_t per_batch;
  const T* a;
  size_t a_sb, a_sl, a_sh, a_seq, a_hd;
  size_t x_pitch;
  size_t split;
};

// Chunk c of row `row` of the producer's source: x's row (xr) for every producer but the
// concatenation, which reads its first `split` values from a.
template <typename T, int N, bool VEC, int PRO>
__device__ __forceinline__ void load_source(const T* xr, const Producer<T>& p, size_t row, size_t c,
                                            QuantChunk<T, N>& q) {
  if constexpr (PRO == PRO_CAT_GELU) {
    const size_t i = c * N;
    if (i < p.split) {
      const size_t b = row / p.a_seq, l = row - b * p.a_seq, h = i / p.a_hd, d = i - h * p.a_hd;
      load_quant_chunk<T, N, VEC>(p.a + b * p.a_sb + l * p.a_sl + h * p.a_sh + d, q);
    } else {
      load_quant_chunk<T, N, VEC>(xr + (i - p.split), q);
    }
  } else {
    load_quant_chunk<T, N, VEC>(xr + c * N, q);
  }
}

template <typename T, int N, bool VEC>
__device__ __forceinline__ void store_quant_chunk(T* p, const QuantChunk<T, N>& c) {
  if constexpr (VEC) {
    typedef typename QuantVec<N * sizeof(T)>::type V;
    *reinterpret_cast<V*>(p) = *reinterpret_cast<const V*>(c.v);
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j) p[j] = c.v[j];
  }
}

// Chunk c of x's row `row` (read into `q`) made into the producer's values, stored into y.
template <typename T, int N, bool VEC, int PRO>
__device__ __forceinline__ void produce_chunk(QuantChunk<T, N>& q, const Producer<T>& p, size_t row, size_t cols,
                                              size_t c) {
  typedef typename AccT<T>::type A;
  if constexpr (PRO == PRO_MODULATE) {
    const size_t o = (row / p.per_batch) * cols + c * N;
    QuantChunk<T, N> sh, sc;
    load_quant_chunk<T, N, VEC>(p.shift + o, sh);
    load_quant_chunk<T, N, VEC>(p.scale + o, sc);
#pragma unroll
    for (int j = 0; j < N; ++j) q.v[j] = from_acc<T>(modulate_value<A>(to_acc(q.v[j]), to_acc(sc.v[j]), to_acc(sh.v[j])));
  } else if constexpr (PRO == PRO_GELU_TANH) {
#pragma unroll
    for (int j = 0; j < N; ++j) q.v[j] = from_acc<T>(gelu_tanh_value<A>(to_acc(q.v[j])));
  } else if constexpr (PRO == PRO_CAT_GELU) {
    if (c * N >= p.split) {
#pragma unroll
      for (int j = 0; j < N; ++j) q.v[j] = from_acc<T>(gelu_tanh_value<A>(to_acc(q.v[j])));
    }
  }
  if constexpr (PRO != PRO_NONE) store_quant_chunk<T, N, VEC>(p.y + row * cols + c * N, q);
}

template <typename T, int N, bool COLS, bool VEC, int C, int PRO = PRO_NONE>
__device__ __forceinline__ void quant_rows_fp8(const T* x, const float* cs, uint32_t* codes, float* scale, size_t rows,
                                               size_t cols, Producer<T> pro = Producer<T>{}) {
  __shared__ float red[32];
  const unsigned g = blockDim.x, t = threadIdx.x;
  const size_t row = (size_t)blockIdx.x * blockDim.y + threadIdx.y;
  const bool live = row < rows;
  const size_t chunks = live ? cols / N : 0;
  const T* xr = x + row * (PRO == PRO_CAT_GELU ? pro.x_pitch : cols);
  QuantChunk<T, N> held[QUANT_HELD];
  float m = 0.0f;
#pragma unroll
  for (int k = 0; k < QUANT_HELD; ++k) {
    const size_t c = t + (size_t)k * g;
    if (c < chunks) {
      load_source<T, N, VEC, PRO>(xr, pro, row, c, held[k]);
      produce_chunk<T, N, VEC, PRO>(held[k], pro, row, cols, c);
      m = chunk_absmax<T, N, COLS, VEC, C>(held[k], cs + c * N, m);
    }
  }
  for (size_t c = t + (size_t)QUANT_HELD * g; c < chunks; c += g) {
    QuantChunk<T, N> q;
    load_source<T, N, VEC, PRO>(xr, pro, row, c, q);
    produce_chunk<T, N, VEC, PRO>(q, pro, row, cols, c);
    m = chunk_absmax<T, N, COLS, VEC, C>(q, cs + c * N, m);
  }
  if (g <= 32) {
    // A row's G lanes are an aligned group of its warp: xor offsets below G stay inside it.
    for (unsigned o = g >> 1; o > 0; o >>= 1) m = absmax_step<C>(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
  } else {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = absmax_step<C>(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
    const unsigned lane = t & 31, warp = t >> 5, warps = (g + 31) >> 5;
    if (lane == 0) red[warp] = m;
    __syncthreads();
    if (warp == 0) {
      m = lane < warps ? red[lane] : 0.0f;
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) m = absmax_step<C>(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
      if (lane == 0) red[0] = m;
    }
    __syncthreads();
    m = red[0];
  }
  // A producer asked for its output alone (the concatenation without codes) stops here.
  if (!live || codes == nullptr) return;
  const float s = row_scale8<C>(m);
  const float r = __frcp_rn(s);
  if (t == 0) scale[row] = s;
  uint32_t* cr = codes + row * (cols / 4);
#pragma unroll
  for (int k = 0; k < QUANT_HELD; ++k) {
    const size_t c = t + (size_t)k * g;
    if (c < chunks) encode_chunk<T, N, COLS, VEC, C>(held[k], cs + c * N, r, cr + c * (N / 4));
  }
  // Chunks past the held ones are read again: a producer's from its own output (this thread's
  // stores).
  const T* again = PRO == PRO_NONE ? xr : pro.y + row * cols;
  for (size_t c = t + (size_t)QUANT_HELD * g; c < chunks; c += g) {
    QuantChunk<T, N> q;
    load_quant_chunk<T, N, VEC>(again + c * N, q);
    encode_chunk<T, N, COLS, VEC, C>(q, cs + c * N, r, cr + c * (N / 4));
  }
}

// Three forms a dtype, by how a row is read (the launcher picks one):
//   quant_rows_fp8_v16_*: 16-byte chunks (cols * sizeof(T) a multiple of 16, x and col_scale
//                         16-byte aligned);
//   quant_rows_fp8_v8_*:  8-byte chunks of four bf16/f16 (x 8-byte aligned, col_scale 16-byte);
//   quant_rows_fp8_*:     chunks of four read one element at a time (any alignment).
// Each has a `_cols` twin that multiplies by col_scale first.
// The int8 twins, quant_rows_i8*, have the same forms.
#define QUANT_ROWS_FP8_FORM(NAME, T, N, VEC, C)                                                              \
  extern "C" __global__ void NAME(const T* x, uint32_t* codes, float* scale, size_t rows, size_t cols) {    \
    quant_rows_fp8<T, N, false, VEC, C>(x, nullptr, codes, scale, rows, cols);                               \
  }                                                                                                          \
  extern "C" __global__ void NAME##_cols(const T* x, const float* cs, uint32_t* codes, float* scale,        \
                                         size_t rows, size_t cols) {                                         \
    quant_rows_fp8<T, N, true, VEC, C>(x, cs, codes, scale, rows, cols);                                     \
  }
#define QUANT_ROWS_FORMS(P, C)                                                                               \
  QUANT_ROWS_FP8_FORM(P##_f32, float, 4, false, C)                                                           \
  QUANT_ROWS_FP8_FORM(P##_bf16, __nv_bfloat16, 4, false, C)                                                  \
  QUANT_ROWS_FP8_FORM(P##_f16, __half, 4, false, C)                                                          \
  QUANT_ROWS_FP8_FORM(P##_v16_f32, float, 4, true, C)                                                        \
  QUANT_ROWS_FP8_FORM(P##_v16_bf16, __nv_bfloat16, 8, true, C)                                               \
  QUANT_ROWS_FP8_FORM(P##_v16_f16, __half, 8, true, C)                                                       \
  QUANT_ROWS_FP8_FORM(P##_v8_bf16, __nv_bfloat16, 4, true, C)                                                \
  QUANT_ROWS_FP8_FORM(P##_v8_f16, __half, 4, true, C)
QUANT_ROWS_FORMS(quant_rows_fp8, CODE_E4M3)
QUANT_ROWS_FORMS(quant_rows_i8, CODE_INT8)

// The fused producers, in the same forms: NAME##_mod (modulation), NAME##_gelu (GELU's tanh
// form) and NAME##_catgelu ([a, gelu_tanh(x)], codes null for y alone) write y (rows, cols) and
// the codes and scales of y's rows.
#define PRODUCE_ROWS_FORM(NAME, T, N, VEC, C)                                                                \
  extern "C" __global__ void NAME##_mod(const T* x, const T* shift, const T* sc, size_t per_batch, T* y,     \
                                        uint32_t* codes, float* scale, size_t rows, size_t cols) {           \
    quant_rows_fp8<T, N, false, VEC, C, PRO_MODULATE>(x, nullptr, codes, scale, rows, cols,                  \
                                                      Producer<T>{y, shift, sc, per_batch});                 \
  }                                                                                                          \
  extern "C" __global__ void NAME##_gelu(const T* x, T* y, uint32_t* codes, float* scale, size_t rows,      \
                                         size_t cols) {                                                      \
    quant_rows_fp8<T, N, false, VEC, C, PRO_GELU_TANH>(x, nullptr, codes, scale, rows, cols,                 \
                                                       Producer<T>{y, nullptr, nullptr, 1});                 \
  }                                                                                                          \
  extern "C" __global__ void NAME##_catgelu(const T* a, size_t a_sb, size_t a_sl, size_t a_sh, size_t a_seq, \
                                            size_t a_hd, const T* x, size_t x_pitch, size_t split, T* y,      \
                                            uint32_t* codes, float* scale, size_t rows, size_t cols) {       \
    quant_rows_fp8<T, N, false, VEC, C, PRO_CAT_GELU>(                                                       \
        x, nullptr, codes, scale, rows, cols,                                                                \
        Producer<T>{y, nullptr, nullptr, 1, a, a_sb, a_sl, a_sh, a_seq, a_hd, x_pitch, split});              \
  }
#define PRODUCE_ROWS_FORMS(P, C)                                                                             \
  PRODUCE_ROWS_FORM(P##_f32, float, 4, false, C)                                                             \
  PRODUCE_ROWS_FORM(P##_bf16, __nv_bfloat16, 4, false, C)                                                    \
  PRODUCE_ROWS_FORM(P##_f16, __half, 4, false, C)                                                            \
  PRODUCE_ROWS_FORM(P##_v16_f32, float, 4, true, C)                                                          \
  PRODUCE_ROWS_FORM(P##_v16_bf16, __nv_bfloat16, 8, true, C)                                                 \
  PRODUCE_ROWS_FORM(P##_v16_f16, __half, 8, true, C)                                                         \
  PRODUCE_ROWS_FORM(P##_v8_bf16, __nv_bfloat16, 4, true, C)                                                  \
  PRODUCE_ROWS_FORM(P##_v8_f16, __half, 4, true, C)
PRODUCE_ROWS_FORMS(quant_rows_fp8, CODE_E4M3)
PRODUCE_ROWS_FORMS(quant_rows_i8, CODE_INT8)

// hadamard_rows: x (rows, cols) T -> y (rows, cols) T, each block of B values of a row (B a power of
// two up to 256 dividing cols; the launcher checks) rotated by the normalized Sylvester Hadamard
// matrix: log2(B) butterfly stages (a, b) -> (a + b, a - b) at distances 1, 2, 4, ... in f32 shared
// memory, then the scale 1 / sqrt(B) (f32, given), rounded once to T: src/backend/int8.rs's
// `rotate_blocks` bit for bit (a stage's butterflies are independent). 128 threads a block, a block
// of values at a time in a grid-stride loop.
template <typename T>
__device__ __forceinline__ void hadamard_rows(const T* x, T* y, size_t rows, size_t cols, unsigned B, float scale) {
  __shared__ float v[256];
  const size_t blocks = rows * (cols / B);
  for (size_t g = blockIdx.x; g < blocks; g += gridDim.x) {
    const size_t base = g * B;  // rows are contiguous: block g starts at value g * B
    for (unsigned i = threadIdx.x; i < B; i += blockDim.x) v[i] = to_acc(x[base + i]);
    __syncthreads();
    for (unsigned h = 1; h < B; h <<= 1) {
      for (unsigned p = threadIdx.x; p < B / 2; p += blockDim.x) {
        const unsigned i = (p / h) * 2 * h + p % h, j = i + h;
        const float a = v[i], b = v[j];
        v[i] = __fadd_rn(a, b);
        v[j] = __fsub_rn(a, b);
      }
      __syncthreads();
    }
    for (unsigned i = threadIdx.x; i < B; i += blockDim.x) y[base + i] = from_acc<T>(__fmul_rn(v[i], scale));
    __syncthreads();
  }
}
#define HADAMARD_ROWS(SUF, T)                                                                                \
  extern "C" __global__ void hadamard_rows_##SUF(const T* x, T* y, size_t rows, size_t cols, unsigned B,    \
                                                 float scale) {                                              \
    hadamard_rows<T>(x, y, rows, cols, B, scale);                                                            \
  }
HADAMARD_ROWS(f32, float)
HADAMARD_ROWS(bf16, __nv_bfloat16)
HADAMARD_ROWS(f16, __half)

// transpose_fp8: codes (rows, cols / 4) u32 -> (cols, rows / 4) u32, the byte matrix transposed
// (rows % 4 == 0 and cols % 4 == 0; the launcher checks). A block moves a 64 x 64 byte tile
// through shared memory: 256 threads load 64 rows of 16 words and store 64 rows of 16 words.
extern "C" __global__ void transpose_fp8(const uint32_t* in, uint32_t* out, size_t rows, size_t cols) {
  __shared__ uint8_t tile[64][65];
  const size_t r0 = (size_t)blockIdx.y * 64, c0 = (size_t)blockIdx.x * 64;
  const size_t in_words = cols / 4, out_words = rows / 4;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int idx = threadIdx.x + 256 * i, lr = idx / 16, lw = idx % 16;
    const size_t r = r0 + lr, cw = c0 / 4 + lw;
    if (r < rows && cw < in_words) {
      const uint32_t w = in[r * in_words + cw];
#pragma unroll
      for (int j = 0; j < 4; ++j) tile[lr][4 * lw + j] = (uint8_t)(w >> (8 * j));
    }
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int idx = threadIdx.x + 256 * i, lc = idx / 16, lw = idx % 16;
    const size_t c = c0 + lc, rw = r0 / 4 + lw;
    if (c < cols && rw < out_words) {
      uint32_t w = 0;
#pragma unroll
      for (int j = 0; j < 4; ++j) w |= (uint32_t)tile[4 * lw + j][lc] << (8 * j);
      out[c * out_words + rw] = w;
    }
  }
}

// scale_outer: acc (m, n) f32 -> y (m, n) T = acc * a (m) * b (n) [+ bias (n) T], in f32 and
// rounded once: an 8-bit product whose GEMM ran without its own scales (scalar-scaled cuBLASLt),
// scaled after, with the Linear's frozen bias where one is given (null: none).
// scale_outer_i32_*: the same from an int8 GEMM's exact i32 sums (converted to f32, rounded once).
__device__ __forceinline__ float acc_f32(float v) { return v; }
__device__ __forceinline__ float acc_f32(int v) { return __int2float_rn(v); }

template <typename A, typename T>
__device__ __forceinline__ T scaled_out(A acc, float a, float b, const T* bias, size_t c) {
  float v = __fmul_rn(__fmul_rn(acc_f32(acc), a), b);
  if (bias != nullptr) v = __fadd_rn(v, to_acc(bias[c]));
  return from_acc<T>(v);
}

template <typename A, typename T>
__device__ __forceinline__ void scale_outer(const A* acc, const float* a, const float* b, const T* bias, T* y,
                                            size_t n, size_t total) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x) {
    const size_t r = i / n, c = i % n;
    y[i] = scaled_out<A, T>(acc[i], a[r], b[c], bias, c);
  }
}
#define SCALE_OUTER(NAME, A, SUF, T)                                                                         \
  extern "C" __global__ void NAME##_##SUF(const A* acc, const float* a, const float* b, const T* bias, T* y, \
                                          size_t n, size_t total) {                                          \
    scale_outer<A, T>(acc, a, b, bias, y, n, total);                                                         \
  }
SCALE_OUTER(scale_outer, float, f32, float)
SCALE_OUTER(scale_outer, float, bf16, __nv_bfloat16)
SCALE_OUTER(scale_outer, float, f16, __half)
SCALE_OUTER(scale_outer_i32, int, f32, float)
SCALE_OUTER(scale_outer_i32, int, bf16, __nv_bfloat16)
SCALE_OUTER(scale_outer_i32, int, f16, __half)

// scale_outer_v4*: the same values four columns a thread (n % 4 == 0, acc 16-byte aligned, y and
// bias aligned to four of their elements; the launcher checks): one 16-byte load of the sums,
// one store of four outputs, no division; blockIdx.x over column groups, rows from blockIdx.y
// in a grid-stride loop.
template <typename T> struct Out4;
template <> struct Out4<float> { typedef float4 type; };
template <> struct Out4<__nv_bfloat16> { typedef uint2 type; };
template <> struct Out4<__half> { typedef uint2 type; };

template <typename A, typename T>
__device__ __forceinline__ void scale_outer_v4(const A* acc, const float* a, const float* b, const T* bias, T* y,
                                               size_t m, size_t n) {
  const size_t c = 4 * ((size_t)blockIdx.x * blockDim.x + threadIdx.x);
  if (c >= n) return;
  const float4 sb = *reinterpret_cast<const float4*>(b + c);
  for (size_t r = blockIdx.y; r < m; r += gridDim.y) {
    const float sa = a[r];
    alignas(16) A in[4];
    *reinterpret_cast<uint4*>(in) = *reinterpret_cast<const uint4*>(acc + r * n + c);
    alignas(16) T out[4];
    out[0] = scaled_out<A, T>(in[0], sa, sb.x, bias, c);
    out[1] = scaled_out<A, T>(in[1], sa, sb.y, bias, c + 1);
    out[2] = scaled_out<A, T>(in[2], sa, sb.z, bias, c + 2);
    out[3] = scaled_out<A, T>(in[3], sa, sb.w, bias, c + 3);
    typedef typename Out4<T>::type V;
    *reinterpret_cast<V*>(y + r * n + c) = *reinterpret_cast<const V*>(out);
  }
}
#define SCALE_OUTER_V4(NAME, A, SUF, T)                                                                      \
  extern "C" __global__ void NAME##_v4_##SUF(const A* acc, const float* a, const float* b, const T* bias,    \
                                             T* y, size_t m, size_t n) {                                     \
    scale_outer_v4<A, T>(acc, a, b, bias, y, m, n);                                                          \
  }
SCALE_OUTER_V4(scale_outer, float, f32, float)
SCALE_OUTER_V4(scale_outer, float, bf16, __nv_bfloat16)
SCALE_OUTER_V4(scale_outer, float, f16, __half)
SCALE_OUTER_V4(scale_outer_i32, int, f32, float)
SCALE_OUTER_V4(scale_outer_i32, int, bf16, __nv_bfloat16)
SCALE_OUTER_V4(scale_outer_i32, int, f16, __half)

// fp8_product_naive: y (m, n) T = sa[i] * sb[j] * sum_k decode(a[i, k]) * decode(b[j, k]), a thread
// an output: the product for shapes and GPUs that cuBLASLt's FP8 GEMM does not take (tests, odd
// widths). words = k / 4.
// i8_product_naive_*: the same over int8 codes, the sum exact in i32 (as the int8 GEMM's).
template <typename T, int C>
__device__ __forceinline__ void fp8_product_naive(const uint32_t* a, const float* sa, const uint32_t* b,
                                                  const float* sb, const T* bias, T* y, size_t m, size_t n,
                                                  size_t words) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < m * n; i += (size_t)gridDim.x * blockDim.x) {
    const size_t r = i / n, c = i % n;
    float acc = 0.0f;
    int iacc = 0;
    for (size_t w = 0; w < words; ++w) {
      const uint32_t wa = a[r * words + w], wb = b[c * words + w];
      if constexpr (C == CODE_INT8) {
        iacc = __dp4a((int)wa, (int)wb, iacc);
      } else {
#pragma unroll
        for (int j = 0; j < 4; ++j) acc = fmaf(e4m3_decode((wa >> (8 * j)) & 0xFFu), e4m3_decode((wb >> (8 * j)) & 0xFFu), acc);
      }
    }
    if constexpr (C == CODE_INT8) acc = __int2float_rn(iacc);
    y[i] = scaled_out<float, T>(acc, sa[r], sb[c], bias, c);
  }
}
#define FP8_PRODUCT_NAIVE(NAME, C, SUF, T)                                                                   \
  extern "C" __global__ void NAME##_##SUF(const uint32_t* a, const float* sa, const uint32_t* b,            \
                                          const float* sb, const T* bias, T* y, size_t m, size_t n,          \
                                          size_t words) {                                                    \
    fp8_product_naive<T, C>(a, sa, b, sb, bias, y, m, n, words);                                             \
  }
FP8_PRODUCT_NAIVE(fp8_product_naive, CODE_E4M3, f32, float)
FP8_PRODUCT_NAIVE(fp8_product_naive, CODE_E4M3, bf16, __nv_bfloat16)
FP8_PRODUCT_NAIVE(fp8_product_naive, CODE_E4M3, f16, __half)
FP8_PRODUCT_NAIVE(i8_product_naive, CODE_INT8, f32, float)
FP8_PRODUCT_NAIVE(i8_product_naive, CODE_INT8, bf16, __nv_bfloat16)
FP8_PRODUCT_NAIVE(i8_product_naive, CODE_INT8, f16, __half)
