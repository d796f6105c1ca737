// Shared by every kernel file: dtype conversions, the strided layout passed by value, and
// 16-byte packs for wide loads.
//
// Dtypes: f32 (float), f64 (double), bf16 (__nv_bfloat16), f16 (__half), u32 (uint32_t).
// Arithmetic happens in Acc<T>: double for f64, float for everything else.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#define FLAME_MAX_RANK 8

// Must match `KernelLayout` in src/backend/cuda/layout.rs (repr(C)).
struct StridedLayout {
  uint32_t rank;
  uint32_t flags;  // LAYOUT_CONTIGUOUS | LAYOUT_INDEX32
  uint64_t offset;
  uint64_t dims[FLAME_MAX_RANK];
  uint64_t strides[FLAME_MAX_RANK];
};

// offset + i addresses element i.
#define LAYOUT_CONTIGUOUS 1u
// Fewer than 2^32 elements: index arithmetic in 32 bits (64-bit division is emulated).
#define LAYOUT_INDEX32 2u
// The innermost (merged) dim has stride 1 and a multiple of 8 elements, so elements 8v .. 8v + 7
// lie side by side; bits 8..12 of flags hold log2 of a power of two (at most 16) that divides
// the offset and every other stride, in elements (src/backend/cuda/layout.rs).
#define LAYOUT_ROWS8 4u

__device__ __forceinline__ bool is_contiguous(const StridedLayout& l) { return l.flags & LAYOUT_CONTIGUOUS; }

// Storage offset of the row-major linear index i.
__device__ __forceinline__ size_t offset_of(const StridedLayout& l, size_t i) {
  if (l.flags & LAYOUT_CONTIGUOUS) return l.offset + i;
  size_t off = l.offset;
  if (l.flags & LAYOUT_INDEX32) {
    uint32_t j = (uint32_t)i;
    for (int d = (int)l.rank - 1; d >= 0; --d) {
      const uint32_t dim = (uint32_t)l.dims[d];
      off += (size_t)(j % dim) * l.strides[d];
      j /= dim;
    }
    return off;
  }
  for (int d = (int)l.rank - 1; d >= 0; --d) {
    const size_t dim = l.dims[d];
    off += (i % dim) * l.strides[d];
    i /= dim;
  }
  return off;
}

template <typename T> struct AccT { typedef float type; };
template <> struct AccT<double> { typedef double type; };

// Producer formulas shared by the kernels that compute them (the elementwise and fused kernels,
// and the quantizing kernels of fp8.cu that fuse them), so each compiles to the same roundings.
// GELU's tanh form uses sqrt(2/pi) and 0.044715 (Hendrycks & Gimpel, 2016).
#define GELU_K 0.7978845608028654
#define GELU_C 0.044715
template <class A> __device__ __forceinline__ A gelu_tanh_value(A x) {
  const A u = A(GELU_K) * (x + A(GELU_C) * x * x * x);
  return A(0.5) * x * (A(1) + tanh(u));
}
// adaLN modulation x (1 + scale) + shift.
template <class A> __device__ __forceinline__ A modulate_value(A x, A scale, A shift) { return x * (A(1) + scale) + shift; }

__device__ __forceinline__ float to_acc(float x) { return x; }
__device__ __forceinline__ double to_acc(double x) { return x; }
__device__ __forceinline__ float to_acc(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_acc(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_acc(uint32_t x) { return (float)x; }

template <typename T> __device__ __forceinline__ T from_acc(float x);
template <> __device__ __forceinline__ float from_acc<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_acc<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <> __device__ __forceinline__ __half from_acc<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ uint32_t from_acc<uint32_t>(float x) {
  return x != x || x <= 0.f ? 0u : (x >= 4294967295.f ? 4294967295u : (uint32_t)x);
}
template <typename T> __device__ __forceinline__ T from_acc(double x);
template <> __device__ __forceinline__ double from_acc<double>(double x) { return x; }

// Exact conversion between any two dtypes through double (casts and comparisons).
__device__ __forceinline__ double to_f64(float x) { return (double)x; }
__device__ __forceinline__ double to_f64(double x) { return x; }
__device__ __forceinline__ double to_f64(__nv_bfloat16 x) { return (double)__bfloat162float(x); }
__device__ __forceinline__ double to_f64(__half x) { return (double)__half2float(x); }
__device__ __forceinline__ double to_f64(uint32_t x) { return (double)x; }

template <typename T> __device__ __forceinline__ T from_f64(double x);
template <> __device__ __forceinline__ float from_f64<float>(double x) { return (float)x; }
template <> __device__ __forceinline__ double from_f64<double>(double x) { return x; }
// One rounding straight from double, as the CPU backend's `bf16_nearest` and `f16_nearest` round.
template <> __device__ __forceinline__ __nv_bfloat16 from_f64<__nv_bfloat16>(double x) { return __double2bfloat16(x); }
template <> __device__ __forceinline__ __half from_f64<__half>(double x) { return __double2half(x); }
template <> __device__ __forceinline__ uint32_t from_f64<uint32_t>(double x) {
  return x != x || x <= 0.0 ? 0u : (x >= 4294967295.0 ? 4294967295u : (uint32_t)x);
}

// Eight elements, 16-byte aligned: one to four 128-bit loads.
// The logistic sigmoid as (1 + tanh(x / 2)) / 2: no overflow for any x (elementwise SiLU and
// its backward, the fused SwiGLU).
template <class A> __device__ __forceinline__ A sigmoid_t(A x) { return A(0.5) * (A(1) + tanh(x * A(0.5))); }

template <typename T> struct alignas(16) Pack8 { T v[8]; };

__device__ __forceinline__ bool aligned16(const void* p) { return ((uintptr_t)p & 15) == 0; }

// Whether every pack of 8 elements of `l` (elements 8v .. 8v + 7 in row-major order) is one
// 16-byte-aligned Pack8 at base + offset_of(l, 8v): a contiguous view from an aligned start, or
// rows of whole packs whose offset and strides keep the packs aligned for T.
template <typename T>
__device__ __forceinline__ bool packs8(const StridedLayout& l, const T* base) {
  if (!aligned16(base)) return false;
  if (l.flags & LAYOUT_CONTIGUOUS) return aligned16(base + l.offset);
  return (l.flags & LAYOUT_ROWS8) && (((size_t)1 << ((l.flags >> 8) & 31u)) * sizeof(T)) % 16 == 0;
}

#define GRID_STRIDE(i, n) \
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < (n); i += (size_t)gridDim.x * blockDim.x)

// Widens a pack to float. For the half types the conversion is volatile asm, so the compiler
// converts again at each use rather than keeping 8 floats per pack alive between passes over
// a register-resident row (which doubled the registers of the norm and softmax kernels and
// halved their occupancy).
__device__ __forceinline__ void widen8(const Pack8<float>& p, float (&f)[8]) {
#pragma unroll
  for (int e = 0; e < 8; ++e) f[e] = p.v[e];
}
__device__ __forceinline__ void widen8(const Pack8<__nv_bfloat16>& p, float (&f)[8]) {
  const uint4 u = *reinterpret_cast<const uint4*>(&p);
  const unsigned w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i)
    asm volatile("{ shl.b32 %0, %2, 16; and.b32 %1, %2, 0xffff0000; }" : "=f"(f[2 * i]), "=f"(f[2 * i + 1]) : "r"(w[i]));
}
__device__ __forceinline__ void widen8(const Pack8<__half>& p, float (&f)[8]) {
  const uint4 u = *reinterpret_cast<const uint4*>(&p);
  const unsigned w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i)
    asm volatile("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, %2; cvt.f32.f16 %0, lo; cvt.f32.f16 %1, hi; }"
                 : "=f"(f[2 * i]), "=f"(f[2 * i + 1])
                 : "r"(w[i]));
}

// widen8 for rows of many packs (VOLATILE), a plain conversion (that the compiler may keep)
// for short ones, where the registers are there and the asm would only constrain scheduling.
template <bool VOLATILE, typename T>
__device__ __forceinline__ void widen(const Pack8<T>& p, float (&f)[8]) {
  if (VOLATILE) {
    widen8(p, f);
  } else {
#pragma unroll
    for (int e = 0; e < 8; ++e) f[e] = to_acc(p.v[e]);
  }
}
