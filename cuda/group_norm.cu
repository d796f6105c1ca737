// GroupNorm over (N, C, S): G groups of cpg = C / G channels, a "plane" being one (n, c) of S
// positions; a group's planes are contiguous. Forward and backward side by side, in two forms:
//
// Any GPU, any size, f64 too (two kernels a direction): gn_stats gives each plane (mean_p, M2_p)
// (two passes over the plane, the second from cache); gn_fwd combines its group's planes (Chan
// et al.: M2 = sum M2_p + S sum (mean_p - mean)^2) and writes y = (x - mean) rstd w[c] + b[c].
// Backward: gn_bwd_stats gives each plane (sum dy, sum dy (x - mean)); gn_bwd_dx combines the
// group's planes into dx = rstd (w dy - mean(g) - xhat mean(g xhat)), g = w dy.
//
// Hopper, groups that fit (one pass a direction): gn_fwd_cluster and gn_bwd_cluster below.
//
// The planes' (sum dy, sum dy (x - mean)) summed over N give db and dw: gn_param_grads after
// the two kernels, the one-pass kernel's last cluster itself.
#include "common.cuh"
#include "rows.cuh"

// Sum of (a, b) over the block, returned to every thread.
__device__ __forceinline__ double2 block_sum2(double a, double b) {
  __shared__ double sa[32], sb[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
  a = warp_sum(a);
  b = warp_sum(b);
  if (lane == 0) {
    sa[warp] = a;
    sb[warp] = b;
  }
  __syncthreads();
  if (warp == 0) {
    a = lane < warps ? sa[lane] : 0.0;
    b = lane < warps ? sb[lane] : 0.0;
    a = warp_sum(a);
    b = warp_sum(b);
    if (lane == 0) {
      sa[0] = a;
      sb[0] = b;
    }
  }
  __syncthreads();
  const double2 r = make_double2(sa[0], sb[0]);
  __syncthreads();
  return r;
}

template <typename T>
__device__ __forceinline__ void gn_stats(const T* __restrict__ x, double* st, size_t S) {
  const size_t plane = blockIdx.x;
  const T* xp = x + plane * S;
  double s = 0.0;
  for_row(xp, S, threadIdx.x, [&](size_t, T v) { s += to_f64(v); }, blockDim.x);
  const double mean = block_sum2(s, 0.0).x / (double)S;
  double q = 0.0;
  for_row(
      xp, S, threadIdx.x,
      [&](size_t, T v) {
        const double d = to_f64(v) - mean;
        q += d * d;
      },
      blockDim.x);
  q = block_sum2(q, 0.0).x;
  if (threadIdx.x == 0) {
    st[2 * plane] = mean;
    st[2 * plane + 1] = q;
  }
}

template <typename T, typename S_>
__device__ __forceinline__ void gn_fwd(const T* __restrict__ x, const double* st, const T* w, const T* b,
                                       T* __restrict__ y, S_* mean_out, S_* rstd_out, size_t C, size_t S, size_t cpg,
                                       double eps) {
  typedef typename AccT<T>::type A;
  const size_t plane = blockIdx.x, n = plane / C, c = plane % C, first = plane - c % cpg;
  __shared__ double sh[2];
  if (threadIdx.x == 0) {
    double m = 0.0;
    for (size_t k = 0; k < cpg; ++k) m += st[2 * (first + k)];
    m /= (double)cpg;
    double q = 0.0;
    for (size_t k = 0; k < cpg; ++k) {
      const double dm = st[2 * (first + k)] - m;
      q += st[2 * (first + k) + 1] + (double)S * dm * dm;
    }
    const double rstd = 1.0 / sqrt(q / (double)(cpg * S) + eps);
    sh[0] = m;
    sh[1] = rstd;
    if (c % cpg == 0) {
      const size_t ng = n * (C / cpg) + c / cpg;
      mean_out[ng] = (S_)m;
      rstd_out[ng] = (S_)rstd;
    }
  }
  __syncthreads();
  const A m = (A)sh[0], scale = (A)sh[1] * (w ? to_acc(w[c]) : A(1)), shift = b ? to_acc(b[c]) : A(0);
  const T* xp = x + plane * S;
  map_row2(
      xp, xp, y + plane * S, S, threadIdx.x, [&](size_t, T v, T) { return from_acc<T>((to_acc(v) - m) * scale + shift); },
      blockDim.x);
}

template <typename T, typename S_>
__device__ __forceinline__ void gn_bwd_stats(const T* __restrict__ x, const T* __restrict__ dy, const S_* mean,
                                             double* st, size_t C, size_t S, size_t cpg) {
  const size_t plane = blockIdx.x, n = plane / C, c = plane % C;
  const double m = (double)mean[n * (C / cpg) + c / cpg];
  double s1 = 0.0, s2 = 0.0;
  for_row2(
      x + plane * S, dy + plane * S, S, threadIdx.x,
      [&](size_t, T xv, T g) {
        s1 += to_f64(g);
        s2 += to_f64(g) * (to_f64(xv) - m);
      },
      blockDim.x);
  const double2 r = block_sum2(s1, s2);
  if (threadIdx.x == 0) {
    st[2 * plane] = r.x;
    st[2 * plane + 1] = r.y;
  }
}

template <typename T, typename S_>
__device__ __forceinline__ void gn_bwd_dx(const T* __restrict__ x, const T* __restrict__ dy, const double* st,
                                          const S_* mean, const S_* rstd, const T* w, T* __restrict__ dx, size_t C,
                                          size_t S, size_t cpg) {
  typedef typename AccT<T>::type A;
  const size_t plane = blockIdx.x, n = plane / C, c = plane % C, first = plane - c % cpg, c0 = c - c % cpg;
  const size_t ng = n * (C / cpg) + c / cpg;
  __shared__ double sh[2];
  if (threadIdx.x == 0) {
    double a1 = 0.0, a2 = 0.0;
    for (size_t k = 0; k < cpg; ++k) {
      const double wk = w ? to_f64(w[c0 + k]) : 1.0;
      a1 += wk * st[2 * (first + k)];
      a2 += wk * st[2 * (first + k) + 1];
    }
    const double M = (double)(cpg * S);
    sh[0] = a1 / M;
    sh[1] = a2 * (double)rstd[ng] / M;
  }
  __syncthreads();
  const A r = (A)rstd[ng], m = (A)mean[ng], a = (A)sh[0], bb = (A)sh[1], wc = w ? to_acc(w[c]) : A(1);
  map_row2(
      x + plane * S, dy + plane * S, dx + plane * S, S, threadIdx.x,
      [&](size_t, T xv, T g) { return from_acc<T>(r * (wc * to_acc(g) - a - (to_acc(xv) - m) * r * bb)); },
      blockDim.x);
}

template <typename S_, typename T>
__device__ __forceinline__ void gn_param_grads(const double* st, const S_* rstd, T* dw, T* db, size_t N, size_t C,
                                               size_t cpg) {
  GRID_STRIDE(c, C) {
    double w = 0.0, b = 0.0;
    for (size_t n = 0; n < N; ++n) {
      b += st[2 * (n * C + c)];
      w += st[2 * (n * C + c) + 1] * (double)rstd[n * (C / cpg) + c / cpg];
    }
    dw[c] = from_f64<T>(w);
    db[c] = from_f64<T>(b);
  }
}

#define GN_T(SUF, T, S_)                                                                                      \
  extern "C" __global__ void gn_stats_##SUF(const T* x, double* st, size_t S) { gn_stats<T>(x, st, S); }      \
  extern "C" __global__ void gn_fwd_##SUF(const T* x, const double* st, const T* w, const T* b, T* y,          \
                                          S_* mean, S_* rstd, size_t C, size_t S, size_t cpg, double eps) {    \
    gn_fwd<T, S_>(x, st, w, b, y, mean, rstd, C, S, cpg, eps);                                                 \
  }                                                                                                            \
  extern "C" __global__ void gn_bwd_stats_##SUF(const T* x, const T* dy, const S_* mean, double* st, size_t C, \
                                                size_t S, size_t cpg) {                                        \
    gn_bwd_stats<T, S_>(x, dy, mean, st, C, S, cpg);                                                           \
  }                                                                                                            \
  extern "C" __global__ void gn_bwd_dx_##SUF(const T* x, const T* dy, const double* st, const S_* mean,        \
                                             const S_* rstd, const T* w, T* dx, size_t C, size_t S,            \
                                             size_t cpg) {                                                     \
    gn_bwd_dx<T, S_>(x, dy, st, mean, rstd, w, dx, C, S, cpg);                                                 \
  }
GN_T(f32, float, float)
GN_T(f64, double, double)
GN_T(bf16, __nv_bfloat16, float)
GN_T(f16, __half, float)

// dw and db in the dtype of x (and of the weight).
#define GN_PARAM_GRADS(SUF, T, S_)                                                                       \
  extern "C" __global__ void gn_param_grads_##SUF(const double* st, const S_* rstd, T* dw, T* db, size_t N, \
                                                  size_t C, size_t cpg) {                                \
    gn_param_grads<S_, T>(st, rstd, dw, db, N, C, cpg);                                                 \
  }
GN_PARAM_GRADS(f32, float, float)
GN_PARAM_GRADS(f64, double, double)
GN_PARAM_GRADS(bf16, __nv_bfloat16, float)
GN_PARAM_GRADS(f16, __half, float)

// ---- One pass a direction (Hopper) ------------------------------------------------------------
// The two-kernel forms read x (and dy) twice, which caps them near 2/3 of copy bandwidth. Here a
// cluster of GNC blocks owns one group: block r copies the r-th 1/GNC of the group's x ("chunk")
// into shared memory with cp.async, reduces it from there, and the blocks exchange their partial
// sums once through distributed shared memory.
//   forward:  each thread's (mean, M2) from one pass over its elements, about one of them (so the
//             shifted sums lose at most ~n ulps), combined over the block and then the cluster
//             with Chan et al.'s M2 = sum M2_r + n_r (mean_r - mean)^2. x read once, y written once.
//   backward: per-channel (sum dy, sum dy (x - mean)) exchanged; they give dx and, written per
//             plane and summed over N by the last cluster, dw and db. dy does not fit in shared memory beside x (the
//             two take 80 KiB a block at SDXL's size: two waves, 62.6% of copy on an H100), so it
//             is read twice from global memory, the first time marked evict_last in L2 and the
//             second evict_first, with x's copy and dx's stores marked streaming: the second read
//             hits L2 (21 MB at SDXL's size, beside 50 MB of L2) and the grid stays one wave
//             (kernel_bench, H100: 81-89% of copy, 56.4% without the hints; its back-to-back
//             launches find x in L2 too, so through the crate it is ~32 us, ~66%).
// x's chunk is 40 KiB at SDXL's 320 channels, so each block keeps 4-5 a multiprocessor and the
// whole tensor is resident in one wave. An earlier forward holding the chunk in registers (512
// threads, 8 packs each) needed three waves and measured slower than the two kernels.
// Needs sm_90 (the group_norm_sm90 module), S % 8 == 0 (a pack never straddles two channels), a
// chunk of whole packs within GNC_SMEM bytes touching at most GNC_CHANNELS channels (forward) or
// GNB_CHANNELS (backward, whose group has at most GNC_CHANNELS); the launcher checks and falls back.
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900  // (the host pass of a full build sees it too)
#include <cooperative_groups.h>
#define GNC 8
#define GNC_SMEM 49152
#define GNC_CHANNELS 64
#define GNB_CHANNELS 16
#define GNC_THREADS 256
#define GNB_UNROLL 4  // dy packs a thread has in flight

// The two halves of a cluster barrier. A block whose shared memory its peers read must not exit
// before they are done; arriving right after the reads and waiting only at exit keeps the apply
// loop off the barrier's critical path (cluster.sync() would stall it).
__device__ __forceinline__ void cluster_arrive() { asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory"); }

// L2 eviction policies (createpolicy) and a 16-byte global load under one.
__device__ __forceinline__ uint64_t l2_evict_first() {
  uint64_t p;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
  return p;
}
__device__ __forceinline__ uint64_t l2_evict_last() {
  uint64_t p;
  asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(p));
  return p;
}
__device__ __forceinline__ uint4 load_hinted(const uint4* a, uint64_t policy) {
  uint4 v;
  asm volatile("ld.global.nc.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], %5;"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(a), "l"(policy));
  return v;
}

// Starts the copy of `bytes` (a multiple of 16) from global `src` into shared `dst`, with L2
// eviction `policy`.
__device__ __forceinline__ void copy_async(void* dst, const void* src, size_t bytes, uint64_t policy) {
  const uint4* s = reinterpret_cast<const uint4*>(src);
  uint4* d = reinterpret_cast<uint4*>(dst);
  for (uint32_t q = threadIdx.x; q < bytes / 16; q += blockDim.x) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(d + q);
    asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;" ::"r"(a), "l"(s + q), "l"(policy));
  }
  asm volatile("cp.async.commit_group;" ::: "memory");
}

template <typename T>
__device__ __forceinline__ void gn_fwd_cluster(const T* __restrict__ x, const T* __restrict__ w,
                                               const T* __restrict__ b, T* __restrict__ y, float* mean_out,
                                               float* rstd_out, uint32_t C, uint32_t S, uint32_t cpg, float eps) {
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  extern __shared__ __align__(16) unsigned char gn_smem[];
  __shared__ double part[2];
  __shared__ float stat[2];
  __shared__ float2 wb[GNC_CHANNELS];
  const uint32_t rank = cluster.block_rank(), group = blockIdx.x / GNC;
  const size_t E = (size_t)cpg * S, chunk = E / GNC, first = (size_t)group * E + rank * chunk;
  const uint32_t np = (uint32_t)(chunk / 8);
  Pack8<T>* sx = reinterpret_cast<Pack8<T>*>(gn_smem);
  copy_async(sx, x + first, chunk * sizeof(T), l2_evict_first());
  // The weight and bias of the few channels the chunk touches, loaded while it streams in: read
  // per pack in the apply loop, their latency would stall every iteration.
  const uint32_t c_first = (uint32_t)(rank * chunk / S), c0 = group % (C / cpg) * cpg + c_first;
  const uint32_t nch = (uint32_t)((rank * chunk + chunk - 1) / S) - c_first + 1;
  for (uint32_t t = threadIdx.x; t < nch; t += blockDim.x)
    wb[t] = make_float2(w ? to_acc(w[c0 + t]) : 1.f, b ? to_acc(b[c0 + t]) : 0.f);
  asm volatile("cp.async.wait_all;" ::: "memory");
  __syncthreads();
  // Sums of d = f - p and d^2 about p, the thread's first element: then M2_t = S2 - S1^2 / n_t
  // cancels at most ~n_t ulps (p being one of the data, S2 <= n_t M2_t). One pass over shared
  // memory instead of two (mean, then squares about it): 82.4% of copy against 81.5%.
  float f[8], s1 = 0.f, s2 = 0.f, piv = 0.f;
  uint32_t cnt = 0;
  if (threadIdx.x < np) piv = to_acc(sx[threadIdx.x].v[0]);
  for (uint32_t i = threadIdx.x; i < np; i += blockDim.x) {
    widen8(sx[i], f);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const float d = f[e] - piv;
      s1 += d;
      s2 += d * d;
    }
    cnt += 8;
  }
  const double nt = (double)cnt, mt = cnt ? (double)piv + (double)s1 / nt : 0.0;
  const double m2t = cnt ? (double)s2 - (double)s1 * (double)s1 / nt : 0.0;
  const double n = (double)chunk, bmean = block_sum2(mt * nt, 0.0).x / n;
  const double m2 = block_sum2(m2t + nt * (mt - bmean) * (mt - bmean), 0.0).x;
  if (threadIdx.x == 0) {
    part[0] = bmean;
    part[1] = m2;
  }
  cluster.sync();
  // Lane r of warp 0 reads block r's partials (one round trip for all eight, not eight).
  if (threadIdx.x < 32) {
    const uint32_t lane = threadIdx.x;
    const double mr = lane < GNC ? *cluster.map_shared_rank(&part[0], lane) : 0.0;
    const double qr = lane < GNC ? *cluster.map_shared_rank(&part[1], lane) : 0.0;
    const double mean = warp_sum(mr) / GNC;
    const double M2 = warp_sum(lane < GNC ? qr + n * (mr - mean) * (mr - mean) : 0.0);
    if (lane == 0) {
      const float rstd = (float)(1.0 / sqrt(M2 / (double)E + (double)eps));
      stat[0] = (float)mean;
      stat[1] = rstd;
      if (rank == 0) {
        mean_out[group] = (float)mean;
        rstd_out[group] = rstd;
      }
    }
  }
  __syncthreads();
  cluster_arrive();
  const float mean = stat[0], rstd = stat[1];
  Pack8<T>* yp = reinterpret_cast<Pack8<T>*>(y + first);
  // The pack's channel by a 32-bit division (a group fits in 32 bits: its chunks fit in shared
  // memory). A 64-bit one per pack cost 4 points of copy bandwidth (kernel_bench, H100: 82.4%
  // against 86.5%); a float reciprocal with a correction step measured 84.3% in a later run.
  const uint32_t base = (uint32_t)(rank * chunk);
  for (uint32_t i = threadIdx.x; i < np; i += blockDim.x) {
    const float2 p = wb[(base + i * 8) / S - c_first];
    const float sc = rstd * p.x, sh = p.y - mean * sc;
    Pack8<T> o;
    widen8(sx[i], f);
#pragma unroll
    for (int e = 0; e < 8; ++e) o.v[e] = from_acc<T>(f[e] * sc + sh);
    yp[i] = o;  // (streaming stores, __stcs, measured 62.8% of copy against 83.8%)
  }
  cluster_wait();
}

// st[2 p], st[2 p + 1] = (sum dy, sum dy (x - mean)) of each plane p, as gn_bwd_stats writes them.
// The last cluster to write its planes' sums (counted in `done`, which is zero at launch and
// left zero) adds them over N into dw and db, so no second kernel is needed: a launch costs
// ~2.6 us of GPU time however small its work, as much as a tenth of this kernel's.
template <typename T>
__device__ __forceinline__ void gn_bwd_cluster(const T* __restrict__ x, const T* __restrict__ dy,
                                               const float* mean_in, const float* rstd_in, const T* __restrict__ w,
                                               T* __restrict__ dx, double* st, T* dw, T* db, unsigned* done,
                                               uint32_t N, uint32_t C, uint32_t S, uint32_t cpg) {
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  extern __shared__ __align__(16) unsigned char gn_smem[];
  __shared__ float2 wpart[GNB_CHANNELS][GNC_THREADS / 32];  // a channel's sums, per warp
  __shared__ double2 part[GNC_CHANNELS];                     // ... per block, by channel of the group
  __shared__ float wg[GNC_CHANNELS];                         // the group's weights
  __shared__ float coef[2];
  __shared__ bool last;
  static_assert(sizeof(Pack8<T>) % 16 == 0, "packs load as 16-byte pieces");
  constexpr uint32_t PIECES = sizeof(Pack8<T>) / 16;
  const uint32_t rank = cluster.block_rank(), group = blockIdx.x / GNC;
  const uint32_t lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const size_t E = (size_t)cpg * S, chunk = E / GNC, first = (size_t)group * E + rank * chunk;
  const uint32_t np = (uint32_t)(chunk / 8);
  Pack8<T>* sx = reinterpret_cast<Pack8<T>*>(gn_smem);
  const uint64_t keep = l2_evict_last(), drop = l2_evict_first();
  copy_async(sx, x + first, chunk * sizeof(T), drop);
  const uint4* gd = reinterpret_cast<const uint4*>(dy + first);
  // A pack of dy (its 16-byte pieces) under an L2 policy.
  auto load_dy = [&](uint32_t i, uint64_t policy) {
    Pack8<T> p;
#pragma unroll
    for (uint32_t k = 0; k < PIECES; ++k) reinterpret_cast<uint4*>(&p)[k] = load_hinted(gd + i * PIECES + k, policy);
    return p;
  };
  const uint32_t c0 = group % (C / cpg) * cpg;
  for (uint32_t t = threadIdx.x; t < cpg; t += blockDim.x) wg[t] = w ? to_acc(w[c0 + t]) : 1.f;
  const float mean = mean_in[group], rstd = rstd_in[group];
  const uint32_t base = (uint32_t)(rank * chunk);  // the chunk's first element within the group
  const uint32_t c_first = base / S, c_last = (uint32_t)((base + chunk - 1) / S);
  asm volatile("cp.async.wait_all;" ::: "memory");
  __syncthreads();
  // Per channel of the chunk: (sum dy, sum dy (x - mean)) in float a thread, double across
  // warps. GNB_UNROLL loads of dy in flight a thread.
  float f[8], g[8];
  for (uint32_t j = c_first; j <= c_last; ++j) {
    const uint32_t lo = j == c_first ? 0 : (j * S - base) / 8, hi = j == c_last ? np : ((j + 1) * S - base) / 8;
    float s1 = 0.f, s2 = 0.f;
    for (uint32_t i0 = lo + threadIdx.x; i0 < hi; i0 += GNB_UNROLL * blockDim.x) {
      Pack8<T> d[GNB_UNROLL];
#pragma unroll
      for (int k = 0; k < GNB_UNROLL; ++k)
        if (i0 + k * blockDim.x < hi) d[k] = load_dy(i0 + k * blockDim.x, keep);
#pragma unroll
      for (int k = 0; k < GNB_UNROLL; ++k) {
        if (i0 + k * blockDim.x >= hi) break;
        widen8(sx[i0 + k * blockDim.x], f);
        widen8(d[k], g);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          s1 += g[e];
          s2 += g[e] * (f[e] - mean);
        }
      }
    }
    s1 = warp_sum(s1);
    s2 = warp_sum(s2);
    if (lane == 0) wpart[j - c_first][warp] = make_float2(s1, s2);
  }
  __syncthreads();
  if (threadIdx.x <= c_last - c_first) {
    double a = 0.0, b = 0.0;
    for (uint32_t k = 0; k < GNC_THREADS / 32; ++k) {
      a += wpart[threadIdx.x][k].x;
      b += wpart[threadIdx.x][k].y;
    }
    part[c_first + threadIdx.x] = make_double2(a, b);
  }
  cluster.sync();
  // Warp 0 adds each channel's sums over the blocks whose chunks touch it (in rank order, so
  // the result is deterministic), rank 0 writes them per plane, and the weighted group sums
  // A1 = sum w_c sum dy, A2 = sum w_c sum dy (x - mean) give dx's coefficients.
  if (warp == 0) {
    double a1 = 0.0, a2 = 0.0;
    for (uint32_t j = lane; j < cpg; j += 32) {
      double s1 = 0.0, s2 = 0.0;
      for (uint32_t r = j * S / chunk; r <= ((j + 1) * S - 1) / chunk; ++r) {
        const double2 p = *cluster.map_shared_rank(&part[j], r);
        s1 += p.x;
        s2 += p.y;
      }
      if (rank == 0) {
        st[2 * ((size_t)group * cpg + j)] = s1;
        st[2 * ((size_t)group * cpg + j) + 1] = s2;
      }
      a1 += wg[j] * s1;
      a2 += wg[j] * s2;
    }
    if (rank == 0) __threadfence();  // each writer's sums, before the count below
    a1 = warp_sum(a1);
    a2 = warp_sum(a2);
    if (lane == 0) {
      // dx = rstd (w dy - A1 / M - (x - mean) rstd^2 A2 / M), M = cpg S
      const double M = (double)E, r = (double)rstd;
      coef[0] = (float)(-r * a1 / M);
      coef[1] = (float)(-r * r * r * a2 / M);
      if (rank == 0) last = atomicAdd(done, 1u) == gridDim.x / GNC - 1;
    }
  }
  __syncthreads();
  cluster_arrive();
  const float k0 = coef[0], kx = coef[1];
  Pack8<T>* dp = reinterpret_cast<Pack8<T>*>(dx + first);
  for (uint32_t i0 = threadIdx.x; i0 < np; i0 += GNB_UNROLL * blockDim.x) {
    Pack8<T> d[GNB_UNROLL];
#pragma unroll
    for (int k = 0; k < GNB_UNROLL; ++k)
      if (i0 + k * blockDim.x < np) d[k] = load_dy(i0 + k * blockDim.x, drop);
#pragma unroll
    for (int k = 0; k < GNB_UNROLL; ++k) {
      const uint32_t i = i0 + k * blockDim.x;
      if (i >= np) break;
      const float kd = rstd * wg[(base + i * 8) / S];
      Pack8<T> o;
      widen8(sx[i], f);
      widen8(d[k], g);
#pragma unroll
      for (int e = 0; e < 8; ++e) o.v[e] = from_acc<T>(kd * g[e] + (f[e] - mean) * kx + k0);
#pragma unroll
      for (uint32_t q = 0; q < PIECES; ++q)
        __stcs(reinterpret_cast<uint4*>(dp + i) + q, reinterpret_cast<const uint4*>(&o)[q]);
    }
  }
  // After this block's own dx, so that the last cluster adds only this short sum to the tail.
  if (rank == 0 && last) {
    __threadfence();
    const uint32_t G = C / cpg;
    for (uint32_t c = threadIdx.x; c < C; c += blockDim.x) {
      double sw = 0.0, sb = 0.0;
      for (uint32_t n = 0; n < N; ++n) {
        sb += __ldcg(st + 2 * ((size_t)n * C + c));
        sw += __ldcg(st + 2 * ((size_t)n * C + c) + 1) * (double)rstd_in[n * G + c / cpg];
      }
      dw[c] = from_f64<T>(sw);
      db[c] = from_f64<T>(sb);
    }
    if (threadIdx.x == 0) *done = 0;
  }
  cluster_wait();
}

#define GN_CLUSTER(SUF, T)                                                                                  \
  extern "C" __global__ void __cluster_dims__(GNC, 1, 1) __launch_bounds__(GNC_THREADS)                    \
      gn_fwd_cluster_##SUF(const T* x, const T* w, const T* b, T* y, float* mean, float* rstd, uint32_t C, \
                           uint32_t S, uint32_t cpg, float eps) {                                        \
    gn_fwd_cluster<T>(x, w, b, y, mean, rstd, C, S, cpg, eps);                                             \
  }                                                                                                         \
  extern "C" __global__ void __cluster_dims__(GNC, 1, 1) __launch_bounds__(GNC_THREADS)                    \
      gn_bwd_cluster_##SUF(const T* x, const T* dy, const float* mean, const float* rstd, const T* w,      \
                           T* dx, double* st, T* dw, T* db, unsigned* done, uint32_t N, uint32_t C,        \
                           uint32_t S, uint32_t cpg) {                                                     \
    gn_bwd_cluster<T>(x, dy, mean, rstd, w, dx, st, dw, db, done, N, C, S, cpg);                           \
  }
GN_CLUSTER(f32, float)
GN_CLUSTER(bf16, __nv_bfloat16)
GN_CLUSTER(f16, __half)
#endif
