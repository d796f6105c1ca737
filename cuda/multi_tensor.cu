// Multi-tensor kernels (src/backend/multi.rs; launchers in src/backend/cuda/multi.rs): one
// launch over many tensors. The launcher uploads a table with one entry per tensor; each
// thread block finds its entry by binary search over the entries' first chunk (the table is
// sorted by it) and works on one chunk of that tensor.
//
// Shape letters: N = values of one tensor, K = tensors in the launch.
//   AdamFull   (K) p, g (N) T; m, v (N) f32;                  chunks of ADAM_CHUNK values
//   Adam8      (K) p, g (N) T; m/v codes (blocks, 64) u32,     one chunk per quantization
//                  m/v absmax (blocks) f32; maps (2, 256) f32  block of 256 values
//   SumSq      (K) x (N) T -> partial (chunks) f64             chunks of SUMSQ_CHUNK values
//
// The Adam arithmetic matches AdamHyper::apply on the CPU operation for operation: every
// multiply, add, divide and square root is an _rn intrinsic, so nvcc cannot contract a
// multiply and an add into an fma (Rust never does) and division and sqrt are IEEE; CPU and
// GPU give the same parameters, moments and 8-bit codes bit for bit. 8-bit moments are
// block-wise quantized as src/backend/quant8.rs describes (Dettmers et al. 2022, "8-bit
// Optimizers via Block-wise Quantization").
#include "common.cuh"

#define MT_THREADS 256
#define MT_WARPS (MT_THREADS / 32)
#define ADAM_CHUNK 4096
#define SUMSQ_CHUNK 4096

// Must match the tables written by src/backend/cuda/multi.rs (u64 words, little end first).
struct AdamFullEntry {
  unsigned long long p, g, m, v, n, first;
  float step_size, bias2_sqrt;
};
struct Adam8Entry {
  unsigned long long p, g, mc, ma, vc, va, n, first;
  float step_size, bias2_sqrt;
};
struct SumSqEntry {
  unsigned long long x, n, first;
};

struct AdamHyper {
  float beta1, beta2, omb1, omb2, eps, decay, l2, grad_scale;
};

// The last entry whose first chunk is <= chunk (entry 0 starts at chunk 0).
template <typename E>
__device__ __forceinline__ unsigned find_entry(const E* table, unsigned k, unsigned long long chunk) {
  unsigned lo = 0, hi = k;
  while (hi - lo > 1) {
    const unsigned mid = (lo + hi) / 2;
    if (table[mid].first <= chunk) lo = mid; else hi = mid;
  }
  return lo;
}

// AdamHyper::apply.
__device__ __forceinline__ void adam_value(float& p, float g, float& m, float& v, const AdamHyper& h, float step_size,
                                           float bias2_sqrt) {
  g = __fmul_rn(g, h.grad_scale);
  if (h.l2 != 0.f) g = __fadd_rn(g, __fmul_rn(h.l2, p));
  p = __fmul_rn(p, h.decay);
  m = __fadd_rn(__fmul_rn(h.beta1, m), __fmul_rn(h.omb1, g));
  v = __fadd_rn(__fmul_rn(h.beta2, v), __fmul_rn(h.omb2, __fmul_rn(g, g)));
  const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), bias2_sqrt), h.eps);
  p = __fsub_rn(p, __fmul_rn(step_size, __fdiv_rn(m, denom)));
}

template <typename T>
__device__ __forceinline__ void adam_full(const AdamFullEntry* table, unsigned k, AdamHyper h) {
  const AdamFullEntry e = table[find_entry(table, k, blockIdx.x)];
  T* p = (T*)e.p;
  const T* g = (const T*)e.g;
  float* m = (float*)e.m;
  float* v = (float*)e.v;
  const size_t start = (size_t)(blockIdx.x - e.first) * ADAM_CHUNK;
  const size_t end = min(start + ADAM_CHUNK, (size_t)e.n);
  for (size_t i = start + threadIdx.x; i < end; i += MT_THREADS) {
    float pv = to_acc(p[i]), mv = m[i], vv = v[i];
    adam_value(pv, to_acc(g[i]), mv, vv, h, e.step_size, e.bias2_sqrt);
    p[i] = from_acc<T>(pv);
    m[i] = mv;
    v[i] = vv;
  }
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

// The largest of every thread's `a` (and `b`) in the block; `red` holds 2 x MT_WARPS.
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
    red[MT_WARPS + warp] = b;
  }
  __syncthreads();
  a = red[0];
  b = red[MT_WARPS];
#pragma unroll
  for (int w = 1; w < MT_WARPS; ++w) {
    a = fmaxf(a, red[w]);
    b = fmaxf(b, red[MT_WARPS + w]);
  }
}

// One quantization block of one tensor per thread block, one value per thread. Each block
// reads its own codes and maxima before the barrier of block_max2 and writes them after, so
// the update is in place.
template <typename T>
__device__ __forceinline__ void adam_8bit(const Adam8Entry* table, unsigned k, const float* __restrict__ maps,
                                          AdamHyper h) {
  __shared__ float smap[2 * 256];
  __shared__ float red[2 * MT_WARPS];
  __shared__ uint8_t codes[2][MT_THREADS];
  const Adam8Entry e = table[find_entry(table, k, blockIdx.x)];
  T* p = (T*)e.p;
  const T* g = (const T*)e.g;
  uint32_t* mc = (uint32_t*)e.mc;
  float* ma = (float*)e.ma;
  uint32_t* vc = (uint32_t*)e.vc;
  float* va = (float*)e.va;
  const unsigned t = threadIdx.x;
  const size_t b = blockIdx.x - e.first, i = b * MT_THREADS + t;
  smap[t] = maps[t];
  smap[256 + t] = maps[256 + t];
  __syncthreads();
  const float* smap_m = smap;
  const float* smap_v = smap + 256;
  const bool valid = i < e.n;
  float pv = 0.f, mv = 0.f, vv = 0.f;
  if (valid) {
    const unsigned shift = 8 * (t % 4);
    const unsigned cm = (mc[b * 64 + t / 4] >> shift) & 0xffu;
    const unsigned cv = (vc[b * 64 + t / 4] >> shift) & 0xffu;
    mv = __fmul_rn(smap_m[cm], ma[b]);
    vv = __fmul_rn(smap_v[cv], va[b]);
    pv = to_acc(p[i]);
    adam_value(pv, to_acc(g[i]), mv, vv, h, e.step_size, e.bias2_sqrt);
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
    (s == 0 ? mc : vc)[b * 64 + w] = word;
  }
  if (t == 0) {
    ma[b] = am;
    va[b] = av;
  }
  if (valid) p[i] = from_acc<T>(pv);
}

// Squares summed in double: each thread over its strided values of the chunk, then the
// warps' and the block's sums in a fixed tree, so the result does not depend on timing.
template <typename T>
__device__ __forceinline__ void sum_sq(const SumSqEntry* table, unsigned k, double* partial) {
  __shared__ double red[MT_WARPS];
  const SumSqEntry e = table[find_entry(table, k, blockIdx.x)];
  const T* x = (const T*)e.x;
  const size_t start = (size_t)(blockIdx.x - e.first) * SUMSQ_CHUNK;
  const size_t end = min(start + SUMSQ_CHUNK, (size_t)e.n);
  double s = 0.0;
  for (size_t i = start + threadIdx.x; i < end; i += MT_THREADS) {
    const double xv = (double)to_acc(x[i]);
    s = __dadd_rn(s, __dmul_rn(xv, xv));
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) s = __dadd_rn(s, __shfl_xor_sync(0xffffffffu, s, o));
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = s;
  __syncthreads();
  if (threadIdx.x == 0) {
    double total = red[0];
#pragma unroll
    for (int w = 1; w < MT_WARPS; ++w) total = __dadd_rn(total, red[w]);
    partial[blockIdx.x] = total;
  }
}

#define MULTI(SUF, T)                                                                                              \
  extern "C" __global__ void __launch_bounds__(MT_THREADS)                                                         \
      adam_full_##SUF(const AdamFullEntry* table, unsigned k, float beta1, float beta2, float omb1, float omb2,    \
                      float eps, float decay, float l2, float grad_scale) {                                        \
    adam_full<T>(table, k, AdamHyper{beta1, beta2, omb1, omb2, eps, decay, l2, grad_scale});                       \
  }                                                                                                                \
  extern "C" __global__ void __launch_bounds__(MT_THREADS)                                                         \
      adam_8bit_##SUF(const Adam8Entry* table, unsigned k, const float* maps, float beta1, float beta2, float omb1, \
                      float omb2, float eps, float decay, float l2, float grad_scale) {                            \
    adam_8bit<T>(table, k, maps, AdamHyper{beta1, beta2, omb1, omb2, eps, decay, l2, grad_scale});                 \
  }                                                                                                                \
  extern "C" __global__ void __launch_bounds__(MT_THREADS)                                                         \
      sum_sq_##SUF(const SumSqEntry* table, unsigned k, double* partial) {                                         \
    sum_sq<T>(table, k, partial);                                                                                  \
  }
MULTI(f32, float)
MULTI(bf16, __nv_bfloat16)
MULTI(f16, __half)
extern "C" __global__ void __launch_bounds__(MT_THREADS)
    sum_sq_f64(const SumSqEntry* table, unsigned k, double* partial) {
  sum_sq<double>(table, k, partial);
}
