// 8-bit AdamW (FusedOp::AdamW8bit in src/backend/mod.rs; the CPU reference is
// src/backend/cpu/adam8bit.rs, block-wise quantization as src/backend/quant8.rs describes, after
// Dettmers et al. 2022, "8-bit Optimizers via Block-wise Quantization").
//
// N = values of the parameter, blocks = ceil(N / 256). One thread block of 256 threads per
// quantization block, one value per thread:
//   p, g, p_out   (N)            T (f32, bf16 or f16)
//   maps          (2, 256) f32   the signed map (m) then the unsigned map (v), sorted ascending
//   m/v codes     (blocks, 64)   u32, four one-byte codes a word, little end first
//   m/v absmax    (blocks)       f32
//
// The arithmetic matches the CPU's operation for operation: every multiply, add, divide and
// square root is an _rn intrinsic, so nvcc cannot contract a multiply and an add into an fma
// (Rust never does) and division and sqrt are IEEE. CPU and GPU therefore give the same codes,
// absmax and parameters bit for bit.
#include "common.cuh"

#define ADAM8_BLOCK 256
#define ADAM8_WARPS (ADAM8_BLOCK / 32)

// AdamW8bitStep::apply: decoupled decay, the moments, the bias-corrected step.
__device__ __forceinline__ void adam_value(float& p, float g, float& m, float& v, float beta1, float beta2,
                                           float omb1, float omb2, float eps, float decay, float step_size,
                                           float bias2_sqrt) {
  p = __fmul_rn(p, decay);
  m = __fadd_rn(__fmul_rn(beta1, m), __fmul_rn(omb1, g));
  v = __fadd_rn(__fmul_rn(beta2, v), __fmul_rn(omb2, __fmul_rn(g, g)));
  const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), bias2_sqrt), eps);
  p = __fsub_rn(p, __fmul_rn(step_size, __fdiv_rn(m, denom)));
}

// quant8::nearest_code: the last entry <= x by binary search (entry 0 if none), then the
// nearer of it and the next, the lower on a tie. NaN gives 0.
__device__ __forceinline__ unsigned nearest_code(const float* map, float x) {
  unsigned lo = 0;
#pragma unroll
  for (unsigned step = 128; step > 0; step >>= 1)
    if (map[lo + step] <= x) lo += step;
  if (lo < 255 && __fsub_rn(map[lo + 1], x) < __fsub_rn(x, map[lo])) lo += 1;
  return lo;
}

// The largest of every thread's `a` (and `b`) in the block; `red` holds 2 x ADAM8_WARPS.
// fmaxf is exact and ignores NaN, so the order of the reduction does not matter.
__device__ __forceinline__ void block_max2(float& a, float& b, float* red) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, o));
    b = fmaxf(b, __shfl_xor_sync(0xffffffffu, b, o));
  }
  const unsigned warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    red[warp] = a;
    red[ADAM8_WARPS + warp] = b;
  }
  __syncthreads();
  a = red[0];
  b = red[ADAM8_WARPS];
#pragma unroll
  for (int w = 1; w < ADAM8_WARPS; ++w) {
    a = fmaxf(a, red[w]);
    b = fmaxf(b, red[ADAM8_WARPS + w]);
  }
}

template <typename T>
__device__ __forceinline__ void adamw8bit(const T* __restrict__ p, const T* __restrict__ g,
                                          const float* __restrict__ maps, const uint32_t* __restrict__ mc,
                                          const float* __restrict__ ma, const uint32_t* __restrict__ vc,
                                          const float* __restrict__ va, T* __restrict__ p_out,
                                          uint32_t* __restrict__ mc_out, float* __restrict__ ma_out,
                                          uint32_t* __restrict__ vc_out, float* __restrict__ va_out, size_t n,
                                          float beta1, float beta2, float omb1, float omb2, float eps,
                                          float decay, float step_size, float bias2_sqrt) {
  __shared__ float smap[2 * 256];
  __shared__ float red[2 * ADAM8_WARPS];
  __shared__ uint8_t codes[2][ADAM8_BLOCK];
  const unsigned t = threadIdx.x;
  const size_t b = blockIdx.x, i = b * ADAM8_BLOCK + t;
  smap[t] = maps[t];
  smap[256 + t] = maps[256 + t];
  __syncthreads();
  const float* smap_m = smap;
  const float* smap_v = smap + 256;
  const bool valid = i < n;
  float pv = 0.f, mv = 0.f, vv = 0.f;
  if (valid) {
    const unsigned shift = 8 * (t % 4);
    const unsigned cm = (mc[b * 64 + t / 4] >> shift) & 0xffu;
    const unsigned cv = (vc[b * 64 + t / 4] >> shift) & 0xffu;
    mv = __fmul_rn(smap_m[cm], ma[b]);
    vv = __fmul_rn(smap_v[cv], va[b]);
    pv = to_acc(p[i]);
    adam_value(pv, to_acc(g[i]), mv, vv, beta1, beta2, omb1, omb2, eps, decay, step_size, bias2_sqrt);
  }
  float am = valid ? fabsf(mv) : 0.f, av = valid ? fabsf(vv) : 0.f;
  block_max2(am, av, red);
  // Values past N take the code of 0, as quant8::quantize_block.
  const float xm = valid && am > 0.f ? __fdiv_rn(mv, am) : 0.f;
  const float xv = valid && av > 0.f ? __fdiv_rn(vv, av) : 0.f;
  codes[0][t] = (uint8_t)nearest_code(smap_m, xm);
  codes[1][t] = (uint8_t)nearest_code(smap_v, xv);
  __syncthreads();
  if (t < 128) {
    const unsigned s = t / 64, w = t % 64;
    const uint8_t* c = codes[s] + 4 * w;
    const uint32_t word = (uint32_t)c[0] | ((uint32_t)c[1] << 8) | ((uint32_t)c[2] << 16) | ((uint32_t)c[3] << 24);
    (s == 0 ? mc_out : vc_out)[b * 64 + w] = word;
  }
  if (t == 0) {
    ma_out[b] = am;
    va_out[b] = av;
  }
  if (valid) p_out[i] = from_acc<T>(pv);
}

#define ADAM8(SUF, T)                                                                                             \
  extern "C" __global__ void __launch_bounds__(ADAM8_BLOCK)                                                       \
      adamw8bit_##SUF(const T* p, const T* g, const float* maps, const uint32_t* mc, const float* ma,             \
                      const uint32_t* vc, const float* va, T* p_out, uint32_t* mc_out, float* ma_out,             \
                      uint32_t* vc_out, float* va_out, size_t n, float beta1, float beta2, float omb1, float omb2, \
                      float eps, float decay, float step_size, float bias2_sqrt) {                                \
    adamw8bit<T>(p, g, maps, mc, ma, vc, va, p_out, mc_out, ma_out, vc_out, va_out, n, beta1, beta2, omb1, omb2,  \
                 eps, decay, step_size, bias2_sqrt);                                                              \
  }
ADAM8(f32, float)
ADAM8(bf16, __nv_bfloat16)
ADAM8(f16, __half)
