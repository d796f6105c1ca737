// Checks and times the Hopper wgmma attention kernels (cuda/attention_wgmma.cu) against the
// mma.sync kernels (cuda/attention.cu) on the same random inputs, without the crate: the
// output, lse, dq, dk and dv of both, compared as max |new - old| / max |old|, at odd sizes,
// with masks and causality; then both timed at the Flux shape (B 1, H 24, L 4608, D 128) and
// SD3.5's (B 1, H 38, L 4250, D 64) with CUDA events. The crate's GPU suite
// (tests/gpu_ops/attention.rs) is the real test; this is for kernel work on the GPU machine.
// Build here (the GPU machine needs only the driver; cudart is linked statically from the pip
// nvcc's lib folder):
//   . ../shared/gpu/nvcc-env
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -L$(dirname $(which nvcc))/../lib \
//     -Icuda scripts/attn_wgmma_check.cu -o .gpu/attn_check
// Run there: `.gpu/attn_check` (checks, then timings), `.gpu/attn_check t` (the Flux timing,
// the backward's last wave split as the launcher splits it, then not), `t64` (SD3.5's), `tab`
// (the wgmma kernels alone at benches/attention.rs's shapes under the forward's grids;
// `tab 64`: its D = 64 rows), `tc` (the forward alone under each grid, tile order and
// consumer count), `tb [64]` (each shape once, split then not, for the backward), `tr i j ..`
// (rows i, j, .. of the bench's shapes, one past the last SD3.5's, split as launched), `dbg i`
// (the i-th check of a big persistent grid alone: a hang ends the process).
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <vector>

#include <cuda.h>
#include <cudaTypedefs.h>

#include "attention.cu"
#include "attention_wgmma.cu"

#define CK(x)                                                                              \
  do {                                                                                     \
    cudaError_t e = (x);                                                                   \
    if (e != cudaSuccess) {                                                                \
      printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e), __FILE__, __LINE__);       \
      exit(1);                                                                             \
    }                                                                                      \
  } while (0)

typedef void (*Kern)(const AttnParams);
typedef void (*WKern)(const AttnParams, const TmaMap, const TmaMap, const TmaMap, const TmaMap, const TmaMap);

struct Kernels {
  Kern fwd, bwd;
  WKern wfwd, wbwd, wfwd2;  // wfwd2: D = 64 with two consumers (null at D = 128)
  Kern pre;
  void (*dq)(const float*, void*, size_t);
  Kern wfold;  // the split backward's dk / dv from their f32 sums
};

template <typename T> Kernels kernels(int d);
template <> Kernels kernels<__nv_bfloat16>(int d) {
  if (d == 128)
    return {attn_fwd_bf16_d128, attn_bwd_bf16_d128, attnw_fwd_bf16_d128, attnw_bwd_bf16_d128, nullptr,
            attn_bwd_pre_bf16_d128, (void (*)(const float*, void*, size_t))attn_dq_bf16, attnw_dkv_fold_bf16_d128};
  return {attn_fwd_bf16_d64,     attn_bwd_bf16_d64,     attnw_fwd_bf16_d64, attnw_bwd_bf16_d64, attnw_fwd_bf16_d64_c2,
          attn_bwd_pre_bf16_d64, (void (*)(const float*, void*, size_t))attn_dq_bf16,  attnw_dkv_fold_bf16_d64};
}
template <> Kernels kernels<__half>(int d) {
  if (d == 128)
    return {attn_fwd_f16_d128, attn_bwd_f16_d128, attnw_fwd_f16_d128, attnw_bwd_f16_d128, nullptr,
            attn_bwd_pre_f16_d128, (void (*)(const float*, void*, size_t))attn_dq_f16, attnw_dkv_fold_f16_d128};
  return {attn_fwd_f16_d64,     attn_bwd_f16_d64,     attnw_fwd_f16_d64, attnw_bwd_f16_d64, attnw_fwd_f16_d64_c2,
          attn_bwd_pre_f16_d64, (void (*)(const float*, void*, size_t))attn_dq_f16,  attnw_dkv_fold_f16_d64};
}

static int g_fwd_blocks = 0;  // the wgmma forward's grid: 0 a block per tile, else persistent
static bool g_dynamic = false;  // persistent: tiles claimed from a counter (else t, t + G, ...)
static int g_head_group = 1;    // AttnParams::head_group; 0: the launcher's rule (causal: K/V in 32 MiB)
static int g_nc64 = 3;          // consumers of the D = 64 forward (3 or 2)
static int* g_counter = nullptr;
static bool g_split = true;  // the backward's last wave split as the launcher's wg_bwd_split rule
static int g_sms = 132;
static float* g_dkv_part = nullptr;  // the split units' f32 dK and dV (at most g_sms units)

// src/backend/cuda/attention.rs's wg_bwd_split: (first unit split, blocks per split unit).
static void bwd_split(int units, int tiles, int& from, int& parts) {
  from = units, parts = 1;
  const int rem = units % g_sms;
  double best = 1e30;
  int bs = 1;
  for (int s = 2; s <= std::min(tiles, 8); ++s) {
    const double t = (double)((rem * s + g_sms - 1) / g_sms) * ((tiles + s - 1) / s + 3.0);
    if (t < best) best = t, bs = s;
  }
  if (rem > 0 && bs > 1 && best <= 0.9 * tiles) from = units - rem, parts = bs;
}
static size_t fwd_smem(int d) { return (128 + 4 * (d == 128 ? 32 : 64)) * d * 2; }
static size_t bwd_smem(int d) { return (2 * 128 * d + 4 * 64 * d + 128 * 64) * 2 + 4 * 64 * 4; }
static int wfwd_rows(int d) { return d == 64 ? 64 * g_nc64 : FwdCfg<128, 2>::BR; }
static int wfwd_threads(int d) { return d == 64 ? 128 * (g_nc64 + 1) : FwdCfg<128, 2>::THREADS; }
// Q, two stages of K and V, the alignment and the barriers.
static size_t wfwd_smem(int d) { return (wfwd_rows(d) + 4 * 128) * d * 2 + 1024 + 128; }
static size_t wfwd_smem_max() { return (192 + 4 * 128) * 128 * 2 + 1024 + 128; }
static int wbwd_rows(int d) { return d == 64 ? BwdCfg<64>::BR : BwdCfg<128>::BR; }
// K, V, two stages of Q and dO, two dS buffers, the f32 dQ tile, lse and dvec rows.
static size_t wbwd_smem(int d) {
  const int br = wbwd_rows(d);
  return (2 * 128 * d + 4 * br * d + 2 * 128 * br) * 2 + br * d * 4 + 4 * br * 4 + 1024 + 64;
}

// cuTensorMapEncodeTiled of a 4-d tensor (dims innermost first, byte strides of dims 1-3),
// 128-byte swizzle, as the crate's encode_tma.
static TmaMap encode(CUtensorMapDataType ty, const void* ptr, const cuuint64_t (&dims)[4],
                     const cuuint64_t (&strides)[3], const cuuint32_t (&box)[4]) {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
  if (!fn) {
    cudaDriverEntryPointQueryResult q;
    CK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", (void**)&fn, 12000, cudaEnableDefault, &q));
  }
  CUtensorMap m;
  const cuuint32_t es[4] = {1, 1, 1, 1};
  CUresult r = fn(&m, ty, 4, (void*)ptr, dims, strides, box, es, CU_TENSOR_MAP_INTERLEAVE_NONE,
                  CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    printf("cuTensorMapEncodeTiled failed: %d\n", (int)r);
    exit(1);
  }
  TmaMap t;
  memcpy(&t, &m, sizeof t);
  return t;
}

// The launcher's tensor map of a dense (B, H, L, D) operand with boxes of 64 x rows.
static TmaMap tma_map(const void* ptr, bool bf16, int B, int H, int L, int D, int rows) {
  const cuuint64_t dims[4] = {(cuuint64_t)D, (cuuint64_t)L, (cuuint64_t)H, (cuuint64_t)B};
  const cuuint64_t strides[3] = {(cuuint64_t)D * 2, (cuuint64_t)L * D * 2, (cuuint64_t)H * L * D * 2};
  const cuuint32_t box[4] = {64, (cuuint32_t)rows, 1, 1};
  return encode(bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, ptr, dims, strides, box);
}

// The f32 dq accumulator (slabs, b h, Lq, D) for the backward's bulk reductions: boxes of
// 32 columns x 64 rows.
static TmaMap tma_map_dq(const float* ptr, int BH, int L, int D, int slabs) {
  const cuuint64_t dims[4] = {(cuuint64_t)D, (cuuint64_t)L, (cuuint64_t)BH, (cuuint64_t)slabs};
  const cuuint64_t strides[3] = {(cuuint64_t)D * 4, (cuuint64_t)L * D * 4, (cuuint64_t)BH * L * D * 4};
  const cuuint32_t box[4] = {32, 64, 1, 1};
  return encode(CU_TENSOR_MAP_DATA_TYPE_FLOAT32, ptr, dims, strides, box);
}

struct Case {
  int B, H, Lq, Lk, D;
  bool causal, mask;
};

template <typename T> struct Run {
  Case c;
  Kernels k;
  T *q, *kk, *v, *dout, *o, *dq, *dk, *dv;
  float *lse, *dvec, *acc, *keep;
  size_t nq, nk;

  AttnParams params() {
    AttnParams p{};
    auto view = [&](T* ptr, int L) { return AttnView{(uint64_t)ptr, (int64_t)c.H * L * c.D, (int64_t)L * c.D, (int64_t)c.D}; };
    p.q = view(q, c.Lq);
    p.k = view(kk, c.Lk);
    p.v = view(v, c.Lk);
    p.o = view(o, c.Lq);
    p.dout = view(dout, c.Lq);
    p.lse = (uint64_t)lse;
    p.dvec = (uint64_t)dvec;
    p.dq_acc = (uint64_t)acc;
    p.keep = c.mask ? (uint64_t)keep : 0;
    p.dq = (uint64_t)dq;
    p.dk = (uint64_t)dk;
    p.dv = (uint64_t)dv;
    p.B = c.B, p.H = c.H, p.Lq = c.Lq, p.Lk = c.Lk;
    p.scale = 1.f / sqrtf((float)c.D);
    p.scale_log2 = p.scale * 1.4426950408889634f;
    p.causal = c.causal;
    // Dense maps: row, head, batch in dims 1, 2, 3 (see tma_tile).
    const uint32_t natural = 0 | 1 << 2 | 2 << 4;
    p.tma_order = natural | natural << 6 | natural << 12 | natural << 18;
    // The launcher's rule: causal tiles in groups of heads whose K and V take 32 MiB.
    p.kblocks = (c.Lk + 127) / 128;
    p.split_from = p.kblocks * c.B * c.H, p.split_parts = 1;
    p.head_group = g_head_group > 0 ? g_head_group
                                    : (c.causal ? std::max(1, (int)((32 << 20) / ((size_t)c.Lk * c.D * 4))) : 1);
    return p;
  }

  void fwd(bool wg) {
    AttnParams p = params();
    const int bh = c.B * c.H;
    const bool bf = sizeof(T) == 2 && std::is_same<T, __nv_bfloat16>::value;
    const int tiles = (c.Lq + wfwd_rows(c.D) - 1) / wfwd_rows(c.D) * bh;
    // g_fwd_blocks > 0: a persistent grid of that many blocks (each takes tiles t, t + G, ...).
    const dim3 grid = g_fwd_blocks > 0 ? dim3(std::min(g_fwd_blocks, tiles)) : dim3(tiles / bh, bh);
    if (wg && g_fwd_blocks > 0 && g_dynamic) {
      CK(cudaMemsetAsync(g_counter, 0, 4));
      p.tile_counter = (uint64_t)g_counter;
    }
    if (wg)
      (c.D == 64 && g_nc64 == 2 ? k.wfwd2 : k.wfwd)<<<grid, wfwd_threads(c.D), wfwd_smem(c.D)>>>(
          p, tma_map(q, bf, c.B, c.H, c.Lq, c.D, wfwd_rows(c.D)), tma_map(kk, bf, c.B, c.H, c.Lk, c.D, 128),
          tma_map(v, bf, c.B, c.H, c.Lk, c.D, 128), tma_map(dout, bf, c.B, c.H, c.Lq, c.D, 64),
          tma_map_dq(acc, c.B * c.H, c.Lq, c.D, 1));
    else
      k.fwd<<<dim3((c.Lq + 127) / 128, bh), 128, fwd_smem(c.D)>>>(p);
  }
  void bwd(bool wg) {
    AttnParams p = params();
    const int bh = c.B * c.H;
    k.pre<<<1024, 256>>>(p);
    const bool bf = std::is_same<T, __nv_bfloat16>::value;
    const int units = p.kblocks * bh;
    int from = units, parts = 1;
    if (wg && g_split && !c.causal) bwd_split(units, (c.Lq + wbwd_rows(c.D) - 1) / wbwd_rows(c.D), from, parts);
    p.split_from = from, p.split_parts = parts;
    if (parts > 1) {
      p.dkv_part = (uint64_t)g_dkv_part;
      CK(cudaMemsetAsync(g_dkv_part, 0, (size_t)(units - from) * 2 * 128 * c.D * 4));
    }
    if (wg)
      k.wbwd<<<from + (units - from) * parts, 384, wbwd_smem(c.D)>>>(
          p, tma_map(q, bf, c.B, c.H, c.Lq, c.D, wbwd_rows(c.D)), tma_map(kk, bf, c.B, c.H, c.Lk, c.D, 128),
          tma_map(v, bf, c.B, c.H, c.Lk, c.D, 128), tma_map(dout, bf, c.B, c.H, c.Lq, c.D, wbwd_rows(c.D)),
          tma_map_dq(acc, c.B * c.H, c.Lq, c.D, 1));
    else
      k.bwd<<<dim3((c.Lk + 127) / 128, bh), 256, bwd_smem(c.D)>>>(p);
    if (parts > 1) k.wfold<<<1024, 256>>>(p);
    k.dq<<<1024, 256>>>(acc, dq, nq);
  }
};

static float frand(uint64_t& s) {
  s = s * 6364136223846793005ull + 1442695040888963407ull;
  const float u1 = ((s >> 40) + 1) / 16777217.f;
  s = s * 6364136223846793005ull + 1442695040888963407ull;
  const float u2 = (s >> 40) / 16777216.f;
  return sqrtf(-2.f * logf(u1)) * cosf(6.2831853f * u2);
}

template <typename T> static T* upload_rand(size_t n, uint64_t seed) {
  std::vector<T> h(n);
  for (auto& x : h) x = (T)frand(seed);
  T* d;
  CK(cudaMalloc(&d, n * sizeof(T)));
  CK(cudaMemcpy(d, h.data(), n * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

template <typename T> static std::vector<float> download(const T* d, size_t n) {
  std::vector<T> h(n);
  CK(cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
  std::vector<float> f(n);
  for (size_t i = 0; i < n; ++i) f[i] = (float)h[i];
  return f;
}

static double rel(const std::vector<float>& a, const std::vector<float>& r) {
  double m = 0, s = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isinf(r[i]) && r[i] == a[i]) continue;
    const double e = std::isnan(a[i]) ? INFINITY : fabs((double)a[i] - r[i]);
    m = fmax(m, e);
    if (!std::isinf(r[i])) s = fmax(s, fabs(r[i]));
  }
  return m / (s > 0 ? s : 1);
}

template <typename T> static Run<T> make(Case c, uint64_t seed) {
  Run<T> r{};
  r.c = c;
  r.k = kernels<T>(c.D);
  r.nq = (size_t)c.B * c.H * c.Lq * c.D;
  r.nk = (size_t)c.B * c.H * c.Lk * c.D;
  r.q = upload_rand<T>(r.nq, seed);
  r.kk = upload_rand<T>(r.nk, seed + 1);
  r.v = upload_rand<T>(r.nk, seed + 2);
  r.dout = upload_rand<T>(r.nq, seed + 3);
  CK(cudaMalloc(&r.o, r.nq * sizeof(T)));
  CK(cudaMalloc(&r.dq, r.nq * sizeof(T)));
  CK(cudaMalloc(&r.dk, r.nk * sizeof(T)));
  CK(cudaMalloc(&r.dv, r.nk * sizeof(T)));
  CK(cudaMalloc(&r.lse, (size_t)c.B * c.H * c.Lq * 4));
  CK(cudaMalloc(&r.dvec, (size_t)c.B * c.H * c.Lq * 4));
  CK(cudaMalloc(&r.acc, r.nq * 4));
  std::vector<float> keep((size_t)c.B * c.Lk);
  uint64_t s = seed + 9;
  for (size_t i = 0; i < keep.size(); ++i) keep[i] = (frand(s) > -0.5f && i / c.Lk != 1) ? 1.f : 0.f;
  keep[0] = 1.f;
  CK(cudaMalloc(&r.keep, keep.size() * 4));
  CK(cudaMemcpy(r.keep, keep.data(), keep.size() * 4, cudaMemcpyHostToDevice));
  return r;
}

template <typename T> static void free_run(Run<T>& r) {
  for (void* p : {(void*)r.q, (void*)r.kk, (void*)r.v, (void*)r.dout, (void*)r.o, (void*)r.dq, (void*)r.dk, (void*)r.dv,
                  (void*)r.lse, (void*)r.dvec, (void*)r.acc, (void*)r.keep})
    CK(cudaFree(p));
}

// Waits for the device, at most 10 s: a hang names its phase instead of blocking forever.
static void sync_or_die(const char* phase) {
  for (int i = 0; i < 10000; ++i) {
    cudaError_t e = cudaStreamQuery(0);
    if (e == cudaSuccess) return;
    if (e != cudaErrorNotReady) {
      printf("CUDA error %s in %s\n", cudaGetErrorString(e), phase);
      exit(1);
    }
    struct timespec ts = {0, 1000000};
    nanosleep(&ts, nullptr);
  }
  printf("HANG in %s\n", phase);
  exit(2);
}

template <typename T> static bool check(Case c, const char* ty, uint64_t seed) {
  Run<T> r = make<T>(c, seed);
  std::vector<float> out[2][5];
  for (int wg = 0; wg < 2; ++wg) {
    r.fwd(wg);
    CK(cudaGetLastError());
    sync_or_die(wg ? "wgmma forward" : "mma forward");
    out[wg][0] = download(r.o, r.nq);
    out[wg][1] = download(r.lse, (size_t)c.B * c.H * c.Lq);
    r.bwd(wg);
    CK(cudaGetLastError());
    sync_or_die(wg ? "wgmma backward" : "mma backward");
    out[wg][2] = download(r.dq, r.nq);
    out[wg][3] = download(r.dk, r.nk);
    out[wg][4] = download(r.dv, r.nk);
  }
  double e[5];
  bool ok = true;
  for (int i = 0; i < 5; ++i) {
    e[i] = rel(out[1][i], out[0][i]);
    ok &= e[i] < (i == 1 ? 1e-4 : 2e-2);
  }
  printf("%s %s B=%d H=%d Lq=%d Lk=%d D=%d causal=%d mask=%d  [o lse dq dk dv] %.2e %.2e %.2e %.2e %.2e\n", ok ? "ok  " : "FAIL",
         ty, c.B, c.H, c.Lq, c.Lk, c.D, c.causal, c.mask, e[0], e[1], e[2], e[3], e[4]);
  free_run(r);
  return ok;
}

template <typename T> static void timeit(Case c, bool only_wg = false) {
  Run<T> r = make<T>(c, 7);
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  const double flops = 4.0 * c.B * c.H * (double)c.Lq * c.Lk * c.D / (c.causal ? 2 : 1);
  for (int wg = only_wg ? 1 : 0; wg < 2; ++wg) {
    float ms[2];
    for (int pass = 0; pass < 2; ++pass) {
      for (int i = 0; i < 3; ++i) pass ? r.bwd(wg) : r.fwd(wg);
      CK(cudaEventRecord(a));
      const int n = 20;
      for (int i = 0; i < n; ++i) pass ? r.bwd(wg) : r.fwd(wg);
      CK(cudaEventRecord(b));
      CK(cudaEventSynchronize(b));
      CK(cudaGetLastError());
      CK(cudaEventElapsedTime(&ms[pass], a, b));
      ms[pass] /= n;
    }
    printf("%s%s%s B=%d H=%d L=%d D=%d causal=%d  fwd %.3f ms %.1f TFLOP/s | bwd (pre+kernel+dq) %.3f ms %.1f TFLOP/s\n",
           wg ? "wgmma" : "mma  ", wg && g_fwd_blocks ? (g_dynamic ? "Pd" : "Ps") : "  ",
           c.D == 64 && g_nc64 == 2 ? "c2" : "  ", c.B, c.H, c.Lq, c.D, c.causal, ms[0], flops / ms[0] / 1e9, ms[1],
           2.5 * flops / ms[1] / 1e9);
  }
  free_run(r);
}

// benches/attention.rs's shapes (B L = 16384, H D = 2048 beside Flux's), and SD3.5's.
static const Case kBench[] = {{1, 24, 4608, 4608, 128, false, false}, {1, 24, 4608, 4608, 128, true, false},
                              {16, 16, 1024, 1024, 128, false, false}, {16, 16, 1024, 1024, 128, true, false},
                              {4, 16, 4096, 4096, 128, false, false},  {4, 16, 4096, 4096, 128, true, false},
                              {1, 16, 16384, 16384, 128, false, false}, {1, 16, 16384, 16384, 128, true, false},
                              {16, 32, 1024, 1024, 64, false, false},  {16, 32, 1024, 1024, 64, true, false},
                              {4, 32, 4096, 4096, 64, false, false},   {4, 32, 4096, 4096, 64, true, false},
                              {1, 32, 16384, 16384, 64, false, false}, {1, 32, 16384, 16384, 64, true, false}};
static const Case kSd35 = {1, 38, 4250, 4250, 64, false, false};

// The wgmma forward alone, on one set of inputs, under each grid variant (fast sweeps).
static void time_fwd_variants(Case c) {
  Run<__nv_bfloat16> r = make<__nv_bfloat16>(c, 7);
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  const double flops = 4.0 * c.B * c.H * (double)c.Lq * c.Lk * c.D / (c.causal ? 2 : 1);
  struct V {
    int blocks, nc, hg;
    bool dyn;
  };
  const V vs[] = {{0, 3, 1, false}, {132, 3, 1, false}, {132, 3, 0, true}, {132, 3, 8, true},
                  {0, 2, 1, false}, {132, 2, 1, false}, {132, 2, 0, true}, {132, 2, 8, true}};
  printf("B=%d H=%d L=%d D=%d causal=%d:", c.B, c.H, c.Lq, c.D, c.causal);
  for (const V& v : vs) {
    if (c.D == 128 && v.nc == 3) continue;
    if (!c.causal && v.hg != 1 && v.hg != 0) continue;
    g_fwd_blocks = v.blocks, g_nc64 = v.nc, g_head_group = v.hg, g_dynamic = v.dyn;
    for (int i = 0; i < 3; ++i) r.fwd(true);
    CK(cudaEventRecord(a));
    const int n = 20;
    for (int i = 0; i < n; ++i) r.fwd(true);
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    CK(cudaGetLastError());
    float ms;
    CK(cudaEventElapsedTime(&ms, a, b));
    printf("  %s%s%s%s %.0f", v.blocks ? (v.dyn ? "Pd" : "Ps") : "B", c.D == 64 ? (v.nc == 2 ? "c2" : "c3") : "",
           v.hg == 0 ? "g" : "", v.hg == 8 ? "g8" : "", flops / (ms / n) / 1e9);
  }
  printf("\n");
  free_run(r);
  g_fwd_blocks = 0, g_nc64 = 3, g_head_group = 1, g_dynamic = false;
}

int main(int argc, char** argv) {
  const bool time_only = argc > 1;
  setvbuf(stdout, nullptr, _IONBF, 0);  // any argument: the Flux-shape timing alone (for ncu)
  for (WKern f : {attnw_fwd_bf16_d128, attnw_fwd_bf16_d64, attnw_fwd_f16_d128, attnw_fwd_f16_d64, attnw_fwd_bf16_d64_c2,
                  attnw_fwd_f16_d64_c2})
    CK(cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)wfwd_smem_max()));
  CK(cudaMalloc(&g_counter, 4));
  CK(cudaDeviceGetAttribute(&g_sms, cudaDevAttrMultiProcessorCount, 0));
  CK(cudaMalloc(&g_dkv_part, (size_t)g_sms * 2 * 128 * 128 * 4));
  for (WKern f : {attnw_bwd_bf16_d128, attnw_bwd_f16_d128})
    CK(cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)wbwd_smem(128)));
  for (WKern f : {attnw_bwd_bf16_d64, attnw_bwd_f16_d64})
    CK(cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)wbwd_smem(64)));
  for (Kern f : {(Kern)attn_fwd_bf16_d128, (Kern)attn_fwd_bf16_d64, (Kern)attn_fwd_f16_d128, (Kern)attn_fwd_f16_d64})
    CK(cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)fwd_smem(128)));
  for (Kern f : {(Kern)attn_bwd_bf16_d128, (Kern)attn_bwd_bf16_d64, (Kern)attn_bwd_f16_d128, (Kern)attn_bwd_f16_d64})
    CK(cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bwd_smem(128)));
  if (time_only) {  // "t": the Flux shape; "t64": SD3.5's; "tab": benches/attention.rs's shapes
    if (strcmp(argv[1], "tc") == 0) {  // the forward's grid variants at the bench's shapes
      for (const Case& c : kBench) time_fwd_variants(c);
      time_fwd_variants(kSd35);
      return 0;
    }
    if (strcmp(argv[1], "tb") == 0) {  // the bench's shapes once each (for the backward); "tb 64": D = 64
      const int only_d = argc > 2 ? atoi(argv[2]) : 0;
      for (int split = 1; split >= 0; --split) {  // the last wave split, then not
        g_split = split;
        printf("last wave split: %d\n", split);
        for (const Case& c : kBench)
          if (!only_d || c.D == only_d) timeit<__nv_bfloat16>(c, true);
        if (!only_d || only_d == 64) timeit<__nv_bfloat16>(kSd35, true);
      }
      g_split = true;
      return 0;
    }
    if (strcmp(argv[1], "tr") == 0) {  // "tr i j ..": kBench rows i, j, .. (one past the last: SD3.5's)
      constexpr int rows = sizeof(kBench) / sizeof(kBench[0]);
      for (int a = 2; a < argc; ++a) {
        const int i = atoi(argv[a]);
        timeit<__nv_bfloat16>(i >= 0 && i < rows ? kBench[i] : kSd35, true);
      }
      return 0;
    }
    if (strcmp(argv[1], "tab") == 0) {
      const int only_d = argc > 2 ? atoi(argv[2]) : 0;  // "tab 64": D = 64 alone
      for (const Case& c : kBench)
        if (!only_d || c.D == only_d)
          for (int nc : {2, 3}) {  // D = 64: two consumers, then three
            if (c.D == 128 && nc == 3) continue;
            g_nc64 = nc;
            g_head_group = 1;
            g_fwd_blocks = 0;  // a block per tile
            timeit<__nv_bfloat16>(c, true);
            g_fwd_blocks = 132;  // persistent, one block per SM of an H100
            g_dynamic = false;
            timeit<__nv_bfloat16>(c, true);
            g_dynamic = true;
            timeit<__nv_bfloat16>(c, true);
            if (c.causal) {
              g_head_group = 0;  // heads grouped by L2
              printf("  head groups: ");
              timeit<__nv_bfloat16>(c, true);
              g_fwd_blocks = 0;
              printf("  head groups: ");
              timeit<__nv_bfloat16>(c, true);
            }
          }
      g_nc64 = 3, g_dynamic = false, g_head_group = 1;
    } else if (strcmp(argv[1], "dbg") == 0) {  // checks of big persistent grids, one config each
      struct V {
        int blocks, nc, hg;
        bool dyn;
      };
      const V vs[] = {{132, 3, 0, true}, {132, 3, 2, true}, {132, 2, 0, true}, {0, 3, 0, false},
                      {132, 3, 0, false}, {132, 3, 1, true}, {132, 2, 1, true}};
      const Case cs[] = {{16, 32, 1024, 1024, 64, true, false}, {4, 32, 4096, 4096, 64, true, false}};
      uint64_t seed = 5;
      const int only = argc > 2 ? atoi(argv[2]) : -1;  // "dbg i": the i-th alone (a hang ends the process)
      int i = 0;
      for (const Case& c : cs)
        for (const V& v : vs) {
          if (only >= 0 && i++ != only) continue;
          g_fwd_blocks = v.blocks, g_nc64 = v.nc, g_head_group = v.hg, g_dynamic = v.dyn;
          printf("blocks %d nc %d hg %d dyn %d: ", v.blocks, v.nc, v.hg, (int)v.dyn);
          check<__nv_bfloat16>(c, "bf16", seed += 10);
        }
    } else {  // "t64": SD3.5's shape, else Flux's; the backward's last wave split, then not
      const Case c = strcmp(argv[1], "t64") == 0 ? kSd35 : Case{1, 24, 4608, 4608, 128, false, false};
      timeit<__nv_bfloat16>(c);
      g_split = false;
      printf("unsplit: ");
      timeit<__nv_bfloat16>(c, true);
      g_split = true;
    }
    return 0;
  }
  int fails = 0;
  const Case cases[] = {
      {1, 2, 256, 256, 128, false, false}, {1, 2, 256, 256, 64, false, false}, {2, 3, 1, 1, 128, false, false},
      {2, 2, 77, 77, 128, false, true},    {2, 2, 333, 77, 64, true, false},   {1, 3, 77, 333, 128, true, true},
      {2, 2, 333, 333, 64, false, true},   {1, 2, 1024, 1024, 128, true, false}, {1, 2, 4608, 4608, 128, false, false},
      {1, 2, 1000, 1000, 64, true, true},  {2, 2, 333, 77, 128, false, true}, {1, 2, 1000, 1000, 64, false, true},
  };
  uint64_t seed = 1;
  for (const Case& c : cases) fails += !check<__nv_bfloat16>(c, "bf16", seed += 10);
  for (const Case& c : cases) fails += !check<__half>(c, "f16 ", seed += 10);
  g_fwd_blocks = 7;  // persistent forward: several tiles per block, uneven counts
  for (int variant = 0; variant < 3; ++variant) {
    // static order; claimed from the counter in L2 head groups; two consumers at D = 64
    g_dynamic = variant > 0, g_head_group = variant > 0 ? 0 : 1, g_nc64 = variant == 2 ? 2 : 3;
    printf("persistent forward, 7 blocks, %s:\n", variant == 0 ? "static" : variant == 1 ? "counter" : "counter, D 64 c2");
    for (const Case& c : cases) fails += !check<__nv_bfloat16>(c, "bf16", seed += 10);
    for (const Case& c : cases) fails += !check<__half>(c, "f16 ", seed += 10);
  }
  g_fwd_blocks = 0, g_dynamic = false, g_nc64 = 2;
  printf("a block per tile, D 64 c2, head groups:\n");
  for (const Case& c : cases) fails += !check<__nv_bfloat16>(c, "bf16", seed += 10);
  g_nc64 = 3, g_head_group = 1;
  timeit<__nv_bfloat16>({1, 24, 4608, 4608, 128, false, false});
  timeit<__nv_bfloat16>(kSd35);
  timeit<__nv_bfloat16>({4, 16, 4096, 4096, 128, true, false});
  printf("%d failures\n", fails);
  return fails != 0;
}
