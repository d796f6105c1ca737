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
//   Prodigy    (K) p, g (N) T; m, v, s, p0 (N) f32;            chunks of PRODIGY_CHUNK values
//                  scalars (PRODIGY_SCALARS) f64; partial (2 x all chunks) f64
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

// ----- Prodigy (ProdigyHyper in src/backend/multi.rs) -------------------------------------
// A step is three launches with no host round-trip: pass 1 updates m, v and s and writes
// each chunk's f64 sums of g * (p0 - p) and |s|; prodigy_reduce (one block) adds them and
// updates the scalar state (d, d_max, the numerator, k, ...) in device memory; pass 2 reads
// the new d and the step's dlr from there and updates the parameters. Sums go in the order
// the CPU reference takes (src/backend/cpu/prodigy.rs): each thread's strided values in
// turn, then the threads' sums in thread order; every operation is an _rn intrinsic.

#define PRODIGY_CHUNK 4096
// Slots of the scalar state (backend::multi::prodigy_slot).
#define PS_D 0
#define PS_D_MAX 1
#define PS_D_NUMERATOR 2
#define PS_D_DENOM 3
#define PS_D_HAT 4
#define PS_K 5
#define PS_BETA1_POW 6
#define PS_BETA2_POW 7
#define PS_DLR 8
#define PS_APPLY 9
// Flags.
#define PF_DECOUPLE 1u
#define PF_BIAS_CORRECTION 2u
#define PF_SAFEGUARD 4u
#define PF_FIRST_MOMENT 8u

// Must match the table written by src/backend/cuda/prodigy.rs (u64 words). m is 0 without
// a first moment, p0 is 0 for a parameter that starts at zero; first counts chunks within
// the launch, pfirst within the step (the index of the chunk's partial sums).
struct ProdigyEntry {
  unsigned long long p, g, m, v, s, p0, n, first, pfirst;
};

struct ProdigyH {
  double lr, beta1, beta2, beta3, eps, wd, d0, d_coef, growth;
  float grad_scale;
  unsigned flags;
};

struct ProdigyP1 {
  double dlr;
  float gs, l2, b1, b2, b3, am, av, as;
};

// ProdigyHyper::pass1.
__device__ __forceinline__ ProdigyP1 prodigy_pass1_scalars(const double* st, const ProdigyH& h) {
  const double d = st[PS_D];
  double bc = 1.0;
  if (h.flags & PF_BIAS_CORRECTION)
    bc = __ddiv_rn(__dsqrt_rn(__dsub_rn(1.0, __dmul_rn(st[PS_BETA2_POW], h.beta2))),
                   __dsub_rn(1.0, __dmul_rn(st[PS_BETA1_POW], h.beta1)));
  ProdigyP1 c;
  c.dlr = __dmul_rn(__dmul_rn(d, h.lr), bc);
  const double dd0 = __ddiv_rn(d, h.d0);
  c.gs = h.grad_scale;
  c.l2 = (h.flags & PF_DECOUPLE) ? 0.f : __double2float_rn(h.wd);
  c.b1 = __double2float_rn(h.beta1);
  c.b2 = __double2float_rn(h.beta2);
  c.b3 = __double2float_rn(h.beta3);
  c.am = __double2float_rn(__dmul_rn(d, __dsub_rn(1.0, h.beta1)));
  c.av = __double2float_rn(__dmul_rn(__dmul_rn(d, d), __dsub_rn(1.0, h.beta2)));
  c.as = __double2float_rn(__dmul_rn(dd0, (h.flags & PF_SAFEGUARD) ? d : c.dlr));
  return c;
}

// ProdigyPass1::grad.
__device__ __forceinline__ float prodigy_grad(float p, float g, float gs, float l2) {
  g = __fmul_rn(g, gs);
  if (l2 != 0.f) g = __fadd_rn(g, __fmul_rn(l2, p));
  return g;
}

// The threads' sums of `a` and `b` added in thread order by thread 0 (red: 2 x MT_THREADS).
__device__ __forceinline__ void ordered_sum2(double& a, double& b, double* red) {
  red[threadIdx.x] = a;
  red[MT_THREADS + threadIdx.x] = b;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < MT_THREADS; ++w) {
      a = __dadd_rn(a, red[w]);
      b = __dadd_rn(b, red[MT_THREADS + w]);
    }
  }
}

// ProdigyPass1::apply over one chunk; the chunk's two sums to partial[2 * (pfirst + chunk)].
template <typename T>
__device__ __forceinline__ void prodigy_pass1(const ProdigyEntry* table, unsigned k, const double* st,
                                              double* partial, ProdigyH h) {
  __shared__ double red[2 * MT_THREADS];
  const ProdigyEntry e = table[find_entry(table, k, blockIdx.x)];
  const ProdigyP1 c = prodigy_pass1_scalars(st, h);
  const bool has_m = h.flags & PF_FIRST_MOMENT;
  const T* p = (const T*)e.p;
  const T* g = (const T*)e.g;
  float* m = (float*)e.m;
  float* v = (float*)e.v;
  float* s = (float*)e.s;
  const float* p0 = (const float*)e.p0;
  const size_t chunk = blockIdx.x - e.first;
  const size_t start = chunk * PRODIGY_CHUNK;
  const size_t end = min(start + PRODIGY_CHUNK, (size_t)e.n);
  double dot = 0.0, ab = 0.0;
  for (size_t i = start + threadIdx.x; i < end; i += MT_THREADS) {
    const float pv = to_acc(p[i]);
    const float gv = prodigy_grad(pv, to_acc(g[i]), c.gs, c.l2);
    const float p0v = p0 ? p0[i] : 0.f;
    dot = __dadd_rn(dot, __dmul_rn((double)gv, __dsub_rn((double)p0v, (double)pv)));
    if (has_m) m[i] = __fadd_rn(__fmul_rn(m[i], c.b1), __fmul_rn(c.am, gv));
    v[i] = __fadd_rn(__fmul_rn(v[i], c.b2), __fmul_rn(__fmul_rn(c.av, gv), gv));
    const float sv = __fadd_rn(__fmul_rn(s[i], c.b3), __fmul_rn(c.as, gv));
    s[i] = sv;
    ab = __dadd_rn(ab, (double)fabsf(sv));
  }
  ordered_sum2(dot, ab, red);
  if (threadIdx.x == 0) {
    partial[2 * (e.pfirst + chunk)] = dot;
    partial[2 * (e.pfirst + chunk) + 1] = ab;
  }
}

// Python's max(a, b) and min(a, b) (b only when strictly larger / smaller).
__device__ __forceinline__ double py_max(double a, double b) { return b > a ? b : a; }
__device__ __forceinline__ double py_min(double a, double b) { return b < a ? b : a; }

// ProdigyHyper::reduce, after adding the chunks' sums; one block of MT_THREADS.
extern "C" __global__ void __launch_bounds__(MT_THREADS)
    prodigy_reduce(const double* partial, unsigned long long chunks, double* st, double lr, double beta1,
                   double beta2, double beta3, double eps, double wd, double d0, double d_coef, double growth,
                   float grad_scale, unsigned flags) {
  __shared__ double red[2 * MT_THREADS];
  const ProdigyH h{lr, beta1, beta2, beta3, eps, wd, d0, d_coef, growth, grad_scale, flags};
  double dot = 0.0, ab = 0.0;
  for (unsigned long long i = threadIdx.x; i < chunks; i += MT_THREADS) {
    dot = __dadd_rn(dot, partial[2 * i]);
    ab = __dadd_rn(ab, partial[2 * i + 1]);
  }
  ordered_sum2(dot, ab, red);
  if (threadIdx.x != 0) return;
  const double dlr = prodigy_pass1_scalars(st, h).dlr;
  const double d = st[PS_D];
  const double numerator =
      __dadd_rn(__dmul_rn(h.beta3, st[PS_D_NUMERATOR]), __dmul_rn(__dmul_rn(__ddiv_rn(d, h.d0), dlr), dot));
  st[PS_DLR] = dlr;
  if (ab == 0.0) {
    st[PS_APPLY] = 0.0;
    return;
  }
  const double d_hat = __ddiv_rn(__dmul_rn(h.d_coef, numerator), ab);
  double d_new = d;
  if (d == h.d0) d_new = py_max(d, d_hat);
  const double d_max = py_max(st[PS_D_MAX], d_hat);
  d_new = py_min(d_max, __dmul_rn(d_new, h.growth));
  st[PS_D_NUMERATOR] = numerator;
  st[PS_D_DENOM] = ab;
  st[PS_D_HAT] = d_hat;
  st[PS_D] = d_new;
  st[PS_D_MAX] = d_max;
  st[PS_K] = __dadd_rn(st[PS_K], 1.0);
  st[PS_BETA1_POW] = __dmul_rn(st[PS_BETA1_POW], h.beta1);
  st[PS_BETA2_POW] = __dmul_rn(st[PS_BETA2_POW], h.beta2);
  st[PS_APPLY] = 1.0;
}

// ProdigyHyper::pass2 and ProdigyPass2::apply over one chunk; nothing when the step does not
// apply.
template <typename T>
__device__ __forceinline__ void prodigy_pass2(const ProdigyEntry* table, unsigned k, const double* st,
                                              ProdigyH h) {
  if (st[PS_APPLY] == 0.0) return;
  const ProdigyEntry e = table[find_entry(table, k, blockIdx.x)];
  const bool has_m = h.flags & PF_FIRST_MOMENT;
  const double d = st[PS_D], dlr = st[PS_DLR];
  const float eps_d = __double2float_rn(__dmul_rn(d, h.eps));
  const float decay = (h.flags & PF_DECOUPLE) ? __double2float_rn(__dmul_rn(-h.wd, dlr)) : 0.f;
  const float step = has_m ? __double2float_rn(-dlr) : __double2float_rn(__dmul_rn(-dlr, d));
  const float gs = h.grad_scale;
  const float l2 = (h.flags & PF_DECOUPLE) ? 0.f : __double2float_rn(h.wd);
  T* p = (T*)e.p;
  const T* g = (const T*)e.g;
  const float* m = (const float*)e.m;
  const float* v = (const float*)e.v;
  const size_t start = (size_t)(blockIdx.x - e.first) * PRODIGY_CHUNK;
  const size_t end = min(start + PRODIGY_CHUNK, (size_t)e.n);
  for (size_t i = start + threadIdx.x; i < end; i += MT_THREADS) {
    float pv = to_acc(p[i]);
    const float num = has_m ? m[i] : prodigy_grad(pv, to_acc(g[i]), gs, l2);
    const float denom = __fadd_rn(__fsqrt_rn(v[i]), eps_d);
    if (decay != 0.f) pv = __fadd_rn(pv, __fmul_rn(decay, pv));
    pv = __fadd_rn(pv, __fmul_rn(step, __fdiv_rn(num, denom)));
    p[i] = from_acc<T>(pv);
  }
}

#define PRODIGY(SUF, T)                                                                                        \
  extern "C" __global__ void __launch_bounds__(MT_THREADS)                                                     \
      prodigy_pass1_##SUF(const ProdigyEntry* table, unsigned k, const double* st, double* partial, double lr, \
                          double beta1, double beta2, double beta3, double eps, double wd, double d0,          \
                          double d_coef, double growth, float grad_scale, unsigned flags) {                    \
    prodigy_pass1<T>(table, k, st, partial,                                                                    \
                     ProdigyH{lr, beta1, beta2, beta3, eps, wd, d0, d_coef, growth, grad_scale, flags});       \
  }                                                                                                            \
  extern "C" __global__ void __launch_bounds__(MT_THREADS)                                                     \
      prodigy_pass2_##SUF(const ProdigyEntry* table, unsigned k, const double* st, double lr, double beta1,    \
                          double beta2, double beta3, double eps, double wd, double d0, double d_coef,         \
                          double growth, float grad_scale, unsigned flags) {                                   \
    prodigy_pass2<T>(table, k, st, ProdigyH{lr, beta1, beta2, beta3, eps, wd, d0, d_coef, growth, grad_scale,  \
                                            flags});                                                           \
  }
PRODIGY(f32, float)
PRODIGY(bf16, __nv_bfloat16)
PRODIGY(f16, __half)

// ----- Schedule-free (src/backend/multi_sf.rs; launcher src/backend/cuda/schedulefree.rs) --
// Shape letters as above; S = ceil(N / PSF_SLICE) sliced values.
//   SfLerp     (K) p (N) T; z (N) f32                           chunks of ADAM_CHUNK values
//   SfAdamW    (K) p, g (N) T; v, z (N) f32                     chunks of ADAM_CHUNK values
//   ProdigySf  (K) p, g (N) T; v, z (N) f32; s, p0 (S) bf16;   chunks of PRODIGY_CHUNK values
//                  scalars (PSF_SCALARS) f64; partial (2 x all chunks) f64; ifirst (K + 1) u64
// The pass writes each chunk's f64 sums of g * (p0 - z) and |s| over its sliced values;
// prodigy_sf_reduce (one block) adds each parameter's chunks in order, rounds its terms as the
// package's f32 / bf16 sums do, adds the parameters' terms in thread order and updates the
// scalar state for the next step.

#define PSF_SLICE 11
#define PSF_D 0
#define PSF_D_NUMERATOR 1
#define PSF_D_DENOM 2
#define PSF_WEIGHT_SUM 3
#define PSF_K 4
#define PSF_D_LIMITER 1u

// Must match the table written by src/backend/cuda/schedulefree.rs (u64 words); unused
// addresses are 0 (g and v for a lerp, s and p0 outside Prodigy, p0 for a parameter that
// started at zero).
struct SfEntry {
  unsigned long long p, g, v, z, s, p0, n, first, pfirst;
};

struct SfAdam {
  float grad_scale, beta2, omb2, bias2, eps, wd, ckp1, y_step, lr;
};

// multi_sf::lerp.
__device__ __forceinline__ float sf_lerp(float a, float b, float w) {
  return fabsf(w) < 0.5f ? __fadd_rn(a, __fmul_rn(w, __fsub_rn(b, a)))
                         : __fsub_rn(b, __fmul_rn(__fsub_rn(b, a), __fsub_rn(1.f, w)));
}

template <typename T>
__device__ __forceinline__ void sf_lerp_chunk(const SfEntry* table, unsigned k, float w) {
  const SfEntry e = table[find_entry(table, k, blockIdx.x)];
  T* p = (T*)e.p;
  const float* z = (const float*)e.z;
  const size_t start = (size_t)(blockIdx.x - e.first) * ADAM_CHUNK;
  const size_t end = min(start + ADAM_CHUNK, (size_t)e.n);
  for (size_t i = start + threadIdx.x; i < end; i += MT_THREADS) p[i] = from_acc<T>(sf_lerp(to_acc(p[i]), z[i], w));
}

// SfAdamScalars::apply.
template <typename T>
__device__ __forceinline__ void sf_adamw_chunk(const SfEntry* table, unsigned k, SfAdam c) {
  const SfEntry e = table[find_entry(table, k, blockIdx.x)];
  T* p = (T*)e.p;
  const T* g = (const T*)e.g;
  float* v = (float*)e.v;
  float* z = (float*)e.z;
  const size_t start = (size_t)(blockIdx.x - e.first) * ADAM_CHUNK;
  const size_t end = min(start + ADAM_CHUNK, (size_t)e.n);
  for (size_t i = start + threadIdx.x; i < end; i += MT_THREADS) {
    const float gv = __fmul_rn(to_acc(g[i]), c.grad_scale);
    const float vv = __fadd_rn(__fmul_rn(v[i], c.beta2), __fmul_rn(__fmul_rn(c.omb2, gv), gv));
    const float denom = __fadd_rn(__fsqrt_rn(__fdiv_rn(vv, c.bias2)), c.eps);
    float y = to_acc(p[i]);
    float gn = __fdiv_rn(gv, denom);
    if (c.wd != 0.f) gn = __fadd_rn(gn, __fmul_rn(c.wd, y));
    const float zv = z[i];
    y = sf_lerp(y, zv, c.ckp1);
    y = __fadd_rn(y, __fmul_rn(c.y_step, gn));
    z[i] = __fsub_rn(zv, __fmul_rn(c.lr, gn));
    v[i] = vv;
    p[i] = from_acc<T>(y);
  }
}

struct ProdigySfH {
  double lr, beta1, beta2, beta3, eps, wd, d0, d_coef, sf_c;
  float grad_scale;
  unsigned flags;
};

struct ProdigySfPassC {
  float gs, b2, b3, av, d, eps_d, d_update, wd, ckp1, dlr, y_step;
};

__device__ __forceinline__ double psf_min(double a, double b) { return b < a ? b : a; }
__device__ __forceinline__ double psf_max(double a, double b) { return b > a ? b : a; }

// ProdigySfHyper::averaging: the step's weight_sum' and ckp1.
__device__ __forceinline__ void psf_averaging(const double* st, const ProdigySfH& h, double& weight_sum, double& ckp1) {
  const double dlr = __dmul_rn(st[PSF_D], h.lr);
  const double weight = __dmul_rn(dlr, dlr);
  weight_sum = __dadd_rn(st[PSF_WEIGHT_SUM], weight);
  ckp1 = weight_sum != 0.0 ? __ddiv_rn(weight, weight_sum) : 0.0;
  if (h.sf_c > 0.0) ckp1 = psf_min(1.0, __dmul_rn(__dmul_rn(ckp1, __dsub_rn(1.0, h.beta1)), h.sf_c));
}

// ProdigySfHyper::pass.
__device__ __forceinline__ ProdigySfPassC psf_scalars(const double* st, const ProdigySfH& h) {
  const double d = st[PSF_D];
  const double dlr = __dmul_rn(d, h.lr);
  double ws, ckp1;
  psf_averaging(st, h, ws, ckp1);
  const double xy_step = __dsub_rn(1.0, __dmul_rn(h.beta1, __dsub_rn(1.0, ckp1)));
  ProdigySfPassC c;
  c.gs = h.grad_scale;
  c.b2 = __double2float_rn(h.beta2);
  c.b3 = __double2float_rn(h.beta3);
  c.av = __double2float_rn(__dmul_rn(__dsub_rn(1.0, h.beta2), __dmul_rn(d, d)));
  c.d = __double2float_rn(d);
  c.eps_d = __double2float_rn(__dmul_rn(d, h.eps));
  c.d_update = __double2float_rn(__ddiv_rn(__dmul_rn(d, d), __dsqrt_rn(h.d0)));
  c.wd = __double2float_rn(h.wd);
  c.ckp1 = __double2float_rn(ckp1);
  c.dlr = __double2float_rn(dlr);
  c.y_step = __double2float_rn(__dmul_rn(dlr, xy_step));
  return c;
}

// ProdigySfPass::stats and ::apply over one chunk; the chunk's sums to
// partial[2 * (pfirst + chunk)].
template <typename T>
__device__ __forceinline__ void prodigy_sf_chunk(const SfEntry* table, unsigned k, const double* st, double* partial,
                                                 ProdigySfH h) {
  __shared__ double red[2 * MT_THREADS];
  const SfEntry e = table[find_entry(table, k, blockIdx.x)];
  const ProdigySfPassC c = psf_scalars(st, h);
  T* p = (T*)e.p;
  const T* g = (const T*)e.g;
  float* v = (float*)e.v;
  float* z = (float*)e.z;
  __nv_bfloat16* s = (__nv_bfloat16*)e.s;
  const __nv_bfloat16* p0 = (const __nv_bfloat16*)e.p0;
  const size_t chunk = blockIdx.x - e.first;
  const size_t start = chunk * PRODIGY_CHUNK;
  const size_t end = min(start + PRODIGY_CHUNK, (size_t)e.n);
  double dot = 0.0, ab = 0.0;
  for (size_t i = start + threadIdx.x; i < end; i += MT_THREADS) {
    const float gv = __fmul_rn(to_acc(g[i]), c.gs);
    const float zv = z[i];
    if (i % PSF_SLICE == 0) {
      const size_t q = i / PSF_SLICE;
      const float p0v = p0 ? __bfloat162float(p0[q]) : 0.f;
      const float x0 = __fsub_rn(p0v, zv);
      const float s1 = __bfloat162float(__float2bfloat16_rn(__fmul_rn(__bfloat162float(s[q]), c.b3)));
      const __nv_bfloat16 s2 = __float2bfloat16_rn(__fadd_rn(s1, __fmul_rn(c.d_update, gv)));
      s[q] = s2;
      dot = __dadd_rn(dot, __dmul_rn((double)gv, (double)x0));
      ab = __dadd_rn(ab, (double)fabsf(__bfloat162float(s2)));
    }
    const float vv = __fadd_rn(__fmul_rn(v[i], c.b2), __fmul_rn(__fmul_rn(c.av, gv), gv));
    float u = __fdiv_rn(__fmul_rn(gv, c.d), __fadd_rn(__fsqrt_rn(vv), c.eps_d));
    float y = to_acc(p[i]);
    if (c.wd != 0.f) u = __fadd_rn(u, __fmul_rn(c.wd, y));
    y = sf_lerp(y, zv, c.ckp1);
    z[i] = __fsub_rn(zv, __fmul_rn(c.dlr, u));
    y = __fsub_rn(y, __fmul_rn(c.y_step, u));
    v[i] = vv;
    p[i] = from_acc<T>(y);
  }
  ordered_sum2(dot, ab, red);
  if (threadIdx.x == 0) {
    partial[2 * (e.pfirst + chunk)] = dot;
    partial[2 * (e.pfirst + chunk) + 1] = ab;
  }
}

// ProdigySfPass::item_terms per parameter, summed in thread order, then
// ProdigySfHyper::reduce; one block of MT_THREADS. ifirst[i] is parameter i's first chunk.
extern "C" __global__ void __launch_bounds__(MT_THREADS)
    prodigy_sf_reduce(const double* partial, const unsigned long long* ifirst, unsigned long long items, double* st,
                      double lr, double beta1, double beta2, double beta3, double eps, double wd, double d0,
                      double d_coef, double sf_c, float grad_scale, unsigned flags) {
  __shared__ double red[2 * MT_THREADS];
  const ProdigySfH h{lr, beta1, beta2, beta3, eps, wd, d0, d_coef, sf_c, grad_scale, flags};
  const ProdigySfPassC c = psf_scalars(st, h);
  double num = 0.0, den = 0.0;
  for (unsigned long long i = threadIdx.x; i < items; i += MT_THREADS) {
    double dot = 0.0, ab = 0.0;
    for (unsigned long long j = ifirst[i]; j < ifirst[i + 1]; ++j) {
      dot = __dadd_rn(dot, partial[2 * j]);
      ab = __dadd_rn(ab, partial[2 * j + 1]);
    }
    num = __dadd_rn(num, (double)__fmul_rn(c.d_update, __double2float_rn(dot)));
    den = __dadd_rn(den, (double)__bfloat162float(__float2bfloat16_rn(__double2float_rn(ab))));
  }
  ordered_sum2(num, den, red);
  if (threadIdx.x != 0) return;
  double weight_sum, ckp1;
  psf_averaging(st, h, weight_sum, ckp1);
  const double d = st[PSF_D];
  num = (double)__double2float_rn(num);
  den = (double)__double2float_rn(den);
  double d_numerator = __dmul_rn(st[PSF_D_NUMERATOR], h.beta3);
  if (d > h.d0 || num > 0.0) d_numerator = __dadd_rn(d_numerator, num);
  double d_new = d;
  if (den > 0.0) {
    double d_hat = __ddiv_rn(d_numerator, den);
    // 2^0.25 (multi_sf::TWO_POW_QUARTER).
    if (h.flags & PSF_D_LIMITER) d_hat = psf_min(__dmul_rn(d, 1.189207115002721), d_hat);
    d_new = psf_max(d, __dmul_rn(d_hat, h.d_coef));
  }
  st[PSF_D] = d_new;
  st[PSF_D_NUMERATOR] = d_numerator;
  st[PSF_D_DENOM] = den;
  st[PSF_WEIGHT_SUM] = weight_sum;
  st[PSF_K] = __dadd_rn(st[PSF_K], 1.0);
}

#define SCHEDULEFREE(SUF, T)                                                                                      \
  extern "C" __global__ void __launch_bounds__(MT_THREADS) sf_lerp_##SUF(const SfEntry* table, unsigned k,        \
                                                                         float w) {                               \
    sf_lerp_chunk<T>(table, k, w);                                                                                \
  }                                                                                                               \
  extern "C" __global__ void __launch_bounds__(MT_THREADS)                                                        \
      sf_adamw_##SUF(const SfEntry* table, unsigned k, float grad_scale, float beta2, float omb2, float bias2,     \
                     float eps, float wd, float ckp1, float y_step, float lr) {                                   \
    sf_adamw_chunk<T>(table, k, SfAdam{grad_scale, beta2, omb2, bias2, eps, wd, ckp1, y_step, lr});              \
  }                                                                                                               \
  extern "C" __global__ void __launch_bounds__(MT_THREADS)                                                        \
      prodigy_sf_pass_##SUF(const SfEntry* table, unsigned k, const double* st, double* partial, double lr,       \
                            double beta1, double beta2, double beta3, double eps, double wd, double d0,           \
                            double d_coef, double sf_c, float grad_scale, unsigned flags) {                       \
    prodigy_sf_chunk<T>(table, k, st, partial,                                                                    \
                        ProdigySfH{lr, beta1, beta2, beta3, eps, wd, d0, d_coef, sf_c, grad_scale, flags});       \
  }
SCHEDULEFREE(f32, float)
SCHEDULEFREE(bf16, __nv_bfloat16)
SCHEDULEFREE(f16, __half)

// ----- Lion (LionHyper in src/backend/lion.rs) ---------------------------------------------
// Shape letters as above:
//   LionFull  (K) p, g (N) T; m (N) f32;                       chunks of ADAM_CHUNK values
//   Lion8     (K) p, g (N) T; codes (blocks, 64) u32,          one chunk per quantization
//                 absmax (blocks) f32; map (256) f32 signed    block of 256 values
// Every operation is an _rn intrinsic, as LionHyper::apply on the CPU.

// Must match the tables written by src/backend/cuda/lion.rs (u64 words).
struct LionFullEntry {
  unsigned long long p, g, m, n, first;
};
struct Lion8Entry {
  unsigned long long p, g, mc, ma, n, first;
};

struct LionH {
  float beta1, beta2, omb1, omb2, decay, neg_lr, grad_scale;
};

// torch.sign: -1, 0 or 1; NaN stays NaN.
__device__ __forceinline__ float sign_of(float x) { return x > 0.f ? 1.f : (x < 0.f ? -1.f : x); }

// LionHyper::apply.
__device__ __forceinline__ void lion_value(float& p, float g, float& m, const LionH& h) {
  g = __fmul_rn(g, h.grad_scale);
  p = __fmul_rn(p, h.decay);
  const float c = __fadd_rn(__fmul_rn(h.beta1, m), __fmul_rn(h.omb1, g));
  p = __fadd_rn(p, __fmul_rn(h.neg_lr, sign_of(c)));
  m = __fadd_rn(__fmul_rn(h.beta2, m), __fmul_rn(h.omb2, g));
}

template <typename T>
__device__ __forceinline__ void lion_full(const LionFullEntry* table, unsigned k, LionH h) {
  const LionFullEntry e = table[find_entry(table, k, blockIdx.x)];
  T* p = (T*)e.p;
  const T* g = (const T*)e.g;
  float* m = (float*)e.m;
  const size_t start = (size_t)(blockIdx.x - e.first) * ADAM_CHUNK;
  const size_t end = min(start + ADAM_CHUNK, (size_t)e.n);
  for (size_t i = start + threadIdx.x; i < end; i += MT_THREADS) {
    float pv = to_acc(p[i]), mv = m[i];
    lion_value(pv, to_acc(g[i]), mv, h);
    p[i] = from_acc<T>(pv);
    m[i] = mv;
  }
}

// One quantization block per thread block, one value per thread, in place as adam_8bit.
template <typename T>
__device__ __forceinline__ void lion_8bit(const Lion8Entry* table, unsigned k, const float* __restrict__ map,
                                          LionH h) {
  __shared__ float smap[256];
  __shared__ float red[2 * MT_WARPS];
  __shared__ uint8_t codes[MT_THREADS];
  const Lion8Entry e = table[find_entry(table, k, blockIdx.x)];
  T* p = (T*)e.p;
  const T* g = (const T*)e.g;
  uint32_t* mc = (uint32_t*)e.mc;
  float* ma = (float*)e.ma;
  const unsigned t = threadIdx.x;
  const size_t b = blockIdx.x - e.first, i = b * MT_THREADS + t;
  smap[t] = map[t];
  __syncthreads();
  const bool valid = i < e.n;
  float pv = 0.f, mv = 0.f;
  if (valid) {
    const unsigned cm = (mc[b * 64 + t / 4] >> (8 * (t % 4))) & 0xffu;
    mv = __fmul_rn(smap[cm], ma[b]);
    pv = to_acc(p[i]);
    lion_value(pv, to_acc(g[i]), mv, h);
  }
  float am = valid ? fabsf(mv) : 0.f, unused = 0.f;
  block_max2(am, unused, red);
  const float xm = valid && am > 0.f ? __fdiv_rn(mv, am) : 0.f;
  codes[t] = (uint8_t)nearest_code(smap, xm);
  __syncthreads();
  if (t < 64) {
    const uint8_t* c = codes + 4 * t;
    mc[b * 64 + t] = (uint32_t)c[0] | ((uint32_t)c[1] << 8) | ((uint32_t)c[2] << 16) | ((uint32_t)c[3] << 24);
  }
  if (t == 0) ma[b] = am;
  if (valid) p[i] = from_acc<T>(pv);
}

#define LION(SUF, T)                                                                                            \
  extern "C" __global__ void __launch_bounds__(MT_THREADS)                                                      \
      lion_full_##SUF(const LionFullEntry* table, unsigned k, float beta1, float beta2, float omb1, float omb2, \
                      float decay, float neg_lr, float grad_scale) {                                            \
    lion_full<T>(table, k, LionH{beta1, beta2, omb1, omb2, decay, neg_lr, grad_scale});                         \
  }                                                                                                             \
  extern "C" __global__ void __launch_bounds__(MT_THREADS)                                                      \
      lion_8bit_##SUF(const Lion8Entry* table, unsigned k, const float* map, float beta1, float beta2,          \
                      float omb1, float omb2, float decay, float neg_lr, float grad_scale) {                    \
    lion_8bit<T>(table, k, map, LionH{beta1, beta2, omb1, omb2, decay, neg_lr, grad_scale});                    \
  }
LION(f32, float)
LION(bf16, __nv_bfloat16)
LION(f16, __half)

// ----- Adafactor (src/backend/adafactor.rs; launcher src/backend/cuda/adafactor.rs) --------
// Shape letters as above; a factored parameter is B matrices of (ROWS, COLS).
//   AfEntry  (K) p, g (N) T; m (N) f32 or 0; a: R (B, ROWS) or V (N) f32; c: C (B, COLS)
//                f32 or 0 (full); rmean (all B) f32; partial (2 x all chunks) f64;
//                scal (2 K) f32
// A step is five launches over every parameter, with no host round-trip:
//   af_lines    one warp per line (each row and each column of each matrix): the line's sum
//               of u = g^2 + eps1 into R or C;
//   af_rmean    one warp per matrix: the mean of its R;
//   af_update   one block per chunk of AF_CHUNK values: the full V, and the chunk's sums of
//               x^2 and p^2 (x the unscaled update);
//   af_scalars  one thread per parameter: its chunks' sums in order, lr_t and the clipping
//               into (k, decay);
//   af_apply    one block per chunk: x again (the same operations give the same bits), m and p.
// Lines are summed in 32 strided lane sums added in lane order, chunks in MT_THREADS thread
// sums added in thread order, as AdafactorHyper's CPU reference (src/backend/cpu/adafactor.rs)
// does; every operation is an _rn intrinsic, so CPU and GPU agree bit for bit.

#define AF_CHUNK 4096
#define AF_SCALE_PARAMETER 1u
#define AF_FIRST_MOMENT 2u

// Must match the table written by src/backend/cuda/adafactor.rs (u64 words). dtype: 0 f32,
// 1 bf16, 2 f16. first_line, first_batch and first_chunk count lines, matrices and chunks
// before the entry (each entry's own count may be 0).
struct AfEntry {
  unsigned long long p, g, m, a, c, n, rows, cols, dtype, first_line, first_batch, first_chunk;
  double rel;
  float beta2t, omb2t;
};

__device__ __forceinline__ float af_load(unsigned long long base, unsigned long long dtype, size_t i) {
  if (dtype == 1) return __bfloat162float(((const __nv_bfloat16*)base)[i]);
  if (dtype == 2) return __half2float(((const __half*)base)[i]);
  return ((const float*)base)[i];
}

__device__ __forceinline__ void af_store(unsigned long long base, unsigned long long dtype, size_t i, float x) {
  if (dtype == 1) ((__nv_bfloat16*)base)[i] = __float2bfloat16_rn(x);
  else if (dtype == 2) ((__half*)base)[i] = __float2half_rn(x);
  else ((float*)base)[i] = x;
}

// The last entry whose `field` is <= idx.
__device__ __forceinline__ unsigned af_find(const AfEntry* table, unsigned k, unsigned long long idx,
                                            unsigned long long AfEntry::*field) {
  unsigned lo = 0, hi = k;
  while (hi - lo > 1) {
    const unsigned mid = (lo + hi) / 2;
    if (table[mid].*field <= idx) lo = mid; else hi = mid;
  }
  return lo;
}

// The warp's lane sums added in lane order; the result in lane 0.
__device__ __forceinline__ double af_lane_order(double s) {
  double total = s;
  for (int l = 1; l < 32; ++l) {
    const double o = __shfl_sync(0xffffffffu, s, l);
    total = __dadd_rn(total, o);
  }
  return total;
}

// AdafactorHyper::grad_u.
__device__ __forceinline__ float af_grad(float g, float gs) { return __fmul_rn(g, gs); }
__device__ __forceinline__ float af_u(float g, float eps1) { return __fadd_rn(__fmul_rn(g, g), eps1); }
// adafactor::decayed.
__device__ __forceinline__ float af_decayed(float b, float omb, float prev, float x) {
  return __fadd_rn(__fmul_rn(b, prev), __fmul_rn(omb, x));
}
// adafactor::factored_x and full_x.
__device__ __forceinline__ float af_factored_x(float g, float r, float rmean, float c) {
  const float rf = __fdiv_rn(1.f, __fsqrt_rn(__fdiv_rn(r, rmean)));
  const float cf = __fdiv_rn(1.f, __fsqrt_rn(c));
  return __fmul_rn(__fmul_rn(rf, cf), g);
}
__device__ __forceinline__ float af_full_x(float g, float v) { return __fmul_rn(__fdiv_rn(1.f, __fsqrt_rn(v)), g); }

extern "C" __global__ void __launch_bounds__(MT_THREADS)
    af_lines(const AfEntry* table, unsigned k, unsigned long long lines, float eps1, float gs) {
  const unsigned long long w = (unsigned long long)blockIdx.x * MT_WARPS + threadIdx.x / 32;
  const unsigned lane = threadIdx.x % 32;
  if (w >= lines) return;  // the whole warp
  const AfEntry e = table[af_find(table, k, w, &AfEntry::first_line)];
  const unsigned long long local = w - e.first_line, mat = e.rows * e.cols, rowlines = (e.n / mat) * e.rows;
  unsigned long long base, stride, len;
  float* out;
  if (local < rowlines) {
    base = (local / e.rows) * mat + (local % e.rows) * e.cols;
    stride = 1;
    len = e.cols;
    out = (float*)e.a + local;
  } else {
    const unsigned long long l = local - rowlines;
    base = (l / e.cols) * mat + l % e.cols;
    stride = e.cols;
    len = e.rows;
    out = (float*)e.c + l;
  }
  double s = 0.0;
  for (unsigned long long q = lane; q < len; q += 32)
    s = __dadd_rn(s, (double)af_u(af_grad(af_load(e.g, e.dtype, base + q * stride), gs), eps1));
  const double total = af_lane_order(s);
  if (lane == 0) {
    const float mean = __double2float_rn(__ddiv_rn(total, (double)len));
    *out = af_decayed(e.beta2t, e.omb2t, *out, mean);
  }
}

extern "C" __global__ void __launch_bounds__(MT_THREADS)
    af_rmean(const AfEntry* table, unsigned k, unsigned long long batches, float* rmean) {
  const unsigned long long w = (unsigned long long)blockIdx.x * MT_WARPS + threadIdx.x / 32;
  const unsigned lane = threadIdx.x % 32;
  if (w >= batches) return;
  const AfEntry e = table[af_find(table, k, w, &AfEntry::first_batch)];
  const float* r = (const float*)e.a + (w - e.first_batch) * e.rows;
  double s = 0.0;
  for (unsigned long long q = lane; q < e.rows; q += 32) s = __dadd_rn(s, (double)r[q]);
  const double total = af_lane_order(s);
  if (lane == 0) rmean[w] = __double2float_rn(__ddiv_rn(total, (double)e.rows));
}

// x of value i of entry e (its V already updated).
__device__ __forceinline__ float af_x(const AfEntry& e, const float* rmean, size_t i, float gv) {
  if (e.c == 0) return af_full_x(gv, ((const float*)e.a)[i]);
  const unsigned long long mat = e.rows * e.cols, b = i / mat, rem = i % mat;
  return af_factored_x(gv, ((const float*)e.a)[b * e.rows + rem / e.cols], rmean[e.first_batch + b],
                       ((const float*)e.c)[b * e.cols + rem % e.cols]);
}

extern "C" __global__ void __launch_bounds__(MT_THREADS)
    af_update(const AfEntry* table, unsigned k, const float* rmean, double* partial, float eps1, float gs,
              unsigned flags) {
  __shared__ double red[2 * MT_THREADS];
  const AfEntry e = table[af_find(table, k, blockIdx.x, &AfEntry::first_chunk)];
  const size_t start = (size_t)(blockIdx.x - e.first_chunk) * AF_CHUNK;
  const size_t end = min(start + AF_CHUNK, (size_t)e.n);
  double sx = 0.0, sp = 0.0;
  for (size_t i = start + threadIdx.x; i < end; i += MT_THREADS) {
    const float gv = af_grad(af_load(e.g, e.dtype, i), gs);
    if (e.c == 0) {
      float* v = (float*)e.a;
      v[i] = af_decayed(e.beta2t, e.omb2t, v[i], af_u(gv, eps1));
    }
    const double xv = (double)af_x(e, rmean, i, gv);
    sx = __dadd_rn(sx, __dmul_rn(xv, xv));
    if (flags & AF_SCALE_PARAMETER) {
      const double pv = (double)af_load(e.p, e.dtype, i);
      sp = __dadd_rn(sp, __dmul_rn(pv, pv));
    }
  }
  ordered_sum2(sp, sx, red);
  if (threadIdx.x == 0) {
    partial[2 * blockIdx.x] = sp;
    partial[2 * blockIdx.x + 1] = sx;
  }
}

// AdafactorHyper::scalars per entry, from its chunks' sums added in chunk order.
extern "C" __global__ void __launch_bounds__(MT_THREADS)
    af_scalars(const AfEntry* table, unsigned k, const double* partial, float* scal, double eps2, double clip_threshold,
               double wd, unsigned flags) {
  const unsigned t = blockIdx.x * MT_THREADS + threadIdx.x;
  if (t >= k) return;
  const AfEntry e = table[t];
  const unsigned long long chunks = (e.n + AF_CHUNK - 1) / AF_CHUNK;
  double sp = 0.0, sx = 0.0;
  for (unsigned long long j = 0; j < chunks; ++j) {
    sp = __dadd_rn(sp, partial[2 * (e.first_chunk + j)]);
    sx = __dadd_rn(sx, partial[2 * (e.first_chunk + j) + 1]);
  }
  const double n = (double)e.n;
  double lr_t = e.rel;
  if (flags & AF_SCALE_PARAMETER) {
    const double rms = __dsqrt_rn(__ddiv_rn(sp, n));
    lr_t = __dmul_rn(lr_t, rms > eps2 ? rms : eps2);
  }
  const double r = __ddiv_rn(__dsqrt_rn(__ddiv_rn(sx, n)), clip_threshold);
  const double clip = r > 1.0 ? r : 1.0;
  scal[2 * t] = __double2float_rn(__ddiv_rn(lr_t, clip));
  scal[2 * t + 1] = __double2float_rn(__dmul_rn(-wd, lr_t));
}

// AdafactorHyper::apply over one chunk.
extern "C" __global__ void __launch_bounds__(MT_THREADS)
    af_apply(const AfEntry* table, unsigned k, const float* rmean, const float* scal, float gs, float beta1,
             float omb1, unsigned flags) {
  const unsigned slot = af_find(table, k, blockIdx.x, &AfEntry::first_chunk);
  const AfEntry e = table[slot];
  const float kk = scal[2 * slot], decay = scal[2 * slot + 1];
  float* m = (float*)e.m;
  const size_t start = (size_t)(blockIdx.x - e.first_chunk) * AF_CHUNK;
  const size_t end = min(start + AF_CHUNK, (size_t)e.n);
  for (size_t i = start + threadIdx.x; i < end; i += MT_THREADS) {
    const float gv = af_grad(af_load(e.g, e.dtype, i), gs);
    float x = __fmul_rn(af_x(e, rmean, i, gv), kk);
    if (flags & AF_FIRST_MOMENT) {
      const float mv = __fadd_rn(__fmul_rn(beta1, m[i]), __fmul_rn(omb1, x));
      m[i] = mv;
      x = mv;
    }
    float pv = af_load(e.p, e.dtype, i);
    if (decay != 0.f) pv = __fadd_rn(pv, __fmul_rn(decay, pv));
    af_store(e.p, e.dtype, i, __fsub_rn(pv, x));
  }
}

// ----- EMA of weights (backend::multi::ema_value; launcher src/backend/cuda/adafactor.rs) --
//   EmaEntry  (K) p (N) T; shadow (all N) f32                  chunks of ADAM_CHUNK values
struct EmaEntry {
  unsigned long long p, n, dtype, offset, first;
};

extern "C" __global__ void __launch_bounds__(MT_THREADS)
    ema_update(const EmaEntry* table, unsigned k, float* shadow, float kk) {
  const EmaEntry e = table[find_entry(table, k, blockIdx.x)];
  const size_t start = (size_t)(blockIdx.x - e.first) * ADAM_CHUNK;
  const size_t end = min(start + ADAM_CHUNK, (size_t)e.n);
  float* s = shadow + e.offset;
  for (size_t i = start + threadIdx.x; i < end; i += MT_THREADS) {
    const float sv = s[i];
    s[i] = __fsub_rn(sv, __fmul_rn(kk, __fsub_rn(sv, af_load(e.p, e.dtype, i))));
  }
}

// ----- Grouped compute-dtype copies and their gradients' fold into f32 ---------------------
// (backend::multi::copy_value / fold_value; launchers src/backend/cuda/multi.rs)
//   CopyEntry (K) src (N) T; dst (N) out dtype                     chunks of ADAM_CHUNK values
//   FoldEntry (K) g (N) T; prev (N) f32 or 0; dst (N) f32           chunks of ADAM_CHUNK values
// The factor travels as its f32 bits in the low half of a word.
struct CopyEntry {
  unsigned long long src, n, dtype, dst, first, scale;
};
struct FoldEntry {
  unsigned long long g, n, dtype, prev, dst, first, scale;
};

// copy_value: p, or p * s + 0 rounded in f32 as the per-use affine.
__device__ __forceinline__ float copy_value(float s, float p) {
  return s == 1.f ? p : __fadd_rn(__fmul_rn(p, s), 0.f);
}

extern "C" __global__ void __launch_bounds__(MT_THREADS)
    grouped_copy(const CopyEntry* table, unsigned k, unsigned long long out_dtype) {
  const CopyEntry e = table[find_entry(table, k, blockIdx.x)];
  const float s = __uint_as_float((unsigned)e.scale);
  const size_t start = (size_t)(blockIdx.x - e.first) * ADAM_CHUNK;
  const size_t end = min(start + ADAM_CHUNK, (size_t)e.n);
  for (size_t i = start + threadIdx.x; i < end; i += MT_THREADS)
    af_store(e.dst, out_dtype, i, copy_value(s, af_load(e.src, e.dtype, i)));
}

extern "C" __global__ void __launch_bounds__(MT_THREADS)
    grouped_fold(const FoldEntry* table, unsigned k) {
  const FoldEntry e = table[find_entry(table, k, blockIdx.x)];
  const float s = __uint_as_float((unsigned)e.scale);
  const float* prev = (const float*)e.prev;
  float* dst = (float*)e.dst;
  const size_t start = (size_t)(blockIdx.x - e.first) * ADAM_CHUNK;
  const size_t end = min(start + ADAM_CHUNK, (size_t)e.n);
  for (size_t i = start + threadIdx.x; i < end; i += MT_THREADS) {
    const float c = copy_value(s, af_load(e.g, e.dtype, i));
    dst[i] = prev ? __fadd_rn(prev[i], c) : c;
  }
}
