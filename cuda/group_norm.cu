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
// the two kernels; in the one-pass kernel, the last of each group's N clusters.
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
// sums once through distributed shared memory: each block stores its partials into every peer's
// shared memory before one cluster barrier, so that after it every thread reads them locally
// (no remote read on the critical path, and no barrier at exit: nothing remote is touched after).
//   forward:  each thread's (mean, M2) from one pass over its elements, about one of them (so the
//             shifted sums lose at most ~n ulps), combined over the warp in float and over the
//             warps and the cluster in double with Chan et al.'s M2 = sum M2_r + n_r (mean_r -
//             mean)^2. x read once, y written once.
//   backward: per-channel (sum dy, sum dy (x - mean)) exchanged; they give dx and, written per
//             plane and summed over N by the last of a group's N clusters, dw and db. dy does not
//             fit in shared memory beside x (the two take 80 KiB a block at SDXL's size: two
//             waves, 62.6% of copy on an H100), so it is read twice from global memory, the
//             first time marked evict_last in L2 and the second evict_first, with x's copy and
//             dx's stores marked streaming: the second read hits L2 (21 MB at SDXL's size, beside
//             50 MB of L2) and the grid stays one wave.
// Staggered start. With every block loading at once, every block's chunk lands at about the same
// time, and the whole GPU then reduces and waits at the cluster barrier with no memory traffic
// before any store. So when the grid is one wave the later half of the clusters ("late") waits
// until the first block of the earlier half has its chunk (a count in global memory, polled by
// one thread, with a time limit so that it never deadlocks): the early half's chunks land sooner,
// and their reductions and stores overlap the late half's loads. H100, SDXL's 2x320x128x128 bf16
// (a scratch probe, the kernels launched interleaved, as one kernel's timing drifts by up to 3%
// within a run): forward 86.8-87.3% of copy staggered against 84.0-85.7% not; on an H200 it is
// neutral (74.5-75.9% against 74.8-75.4%). A fixed delay peaked lower (1.5-2.5 us) and would need
// tuning per GPU and size; opening the gate later (half the early blocks or more) measured worse.
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
#define GNB_UNROLL 4            // dy packs a thread has in flight
#define GATE_TIMEOUT_NS 20000u  // the longest a late block waits for the gate

// The two halves of a cluster barrier. Distributed shared memory may be written only once every
// block of the cluster runs: each kernel arrives (relaxed) at its start and waits before its
// first remote store, then meets the others once more (cluster.sync) after the stores.
__device__ __forceinline__ void cluster_arrive_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory"); }

__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// The staggered start's gate: *gate counts early blocks whose chunk has landed (low 32 bits) and
// late blocks through the gate (high 32 bits); the last block of all to count sets it back to
// zero, so it is zero between kernels (it lives among the device's completion counters). It only
// orders loads: a late block passes after the first early block's chunk lands or after
// GATE_TIMEOUT_NS, whichever is first, and either way the results are the same.
struct Gate {
  unsigned long long* count;
  bool on, late;
  unsigned long long full;
  __device__ Gate(unsigned long long* c, uint32_t late_from, uint32_t group, uint32_t groups)
      : count(c),
        on(late_from > 0 && late_from < groups),
        late(on && group >= late_from),
        full((unsigned long long)late_from * GNC + ((unsigned long long)(groups - late_from) * GNC << 32)) {}
  __device__ void add(unsigned long long inc) const {
    if (atomicAdd(count, inc) + inc == full) atomicExch(count, 0ull);
  }
  // Late blocks: all threads call it before loading.
  __device__ void wait() const {
    if (!late) return;
    if (threadIdx.x == 0) {
      const unsigned long long t0 = global_ns();
      while ((uint32_t) * (volatile unsigned long long*)count == 0u && global_ns() - t0 < GATE_TIMEOUT_NS) {
      }
      add(1ull << 32);
    }
    __syncthreads();
  }
  // Early blocks: thread 0, once the chunk has landed.
  __device__ void landed() const {
    if (on && !late && threadIdx.x == 0) add(1ull);
  }
};

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
                                               float* rstd_out, uint32_t C, uint32_t S, uint32_t cpg, float eps,
                                               unsigned long long* gate_count, uint32_t late_from) {
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  extern __shared__ __align__(16) unsigned char gn_smem[];
  constexpr uint32_t W = GNC_THREADS / 32;
  __shared__ double2 part[GNC];  // block r's (mean, M2) at [r], stored here by block r
  __shared__ float2 wpart[W];    // each warp's (mean, M2)
  __shared__ float2 wb[GNC_CHANNELS];
  cluster_arrive_relaxed();
  const uint32_t rank = cluster.block_rank(), group = blockIdx.x / GNC, lane = threadIdx.x & 31,
                 warp = threadIdx.x >> 5;
  const Gate gate(gate_count, late_from, group, gridDim.x / GNC);
  gate.wait();
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
  gate.landed();
  // Sums of d = f - p and d^2 about p, the thread's first element: then M2_t = S2 - S1^2 / n_t
  // cancels at most ~n_t ulps (p being one of the data, S2 <= (n_t + 1) M2_t).
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
  // The warp's (n, mean, M2) by Chan's pairwise update (threads may hold no packs: n = 0).
  float n = (float)cnt, m = 0.f, M = 0.f;
  if (cnt) {
    const float inv = 1.f / n;
    m = piv + s1 * inv;
    M = fmaxf(s2 - s1 * s1 * inv, 0.f);
  }
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const float nb = __shfl_xor_sync(0xffffffffu, n, off), mb = __shfl_xor_sync(0xffffffffu, m, off),
                Mb = __shfl_xor_sync(0xffffffffu, M, off);
    const float tot = n + nb, d = mb - m, fb = tot > 0.f ? __fdividef(nb, tot) : 0.f;
    m = fmaf(d, fb, m);
    M = M + Mb + d * d * n * fb;
    n = tot;
  }
  if (lane == 0) wpart[warp] = make_float2(m, M);
  __syncthreads();
  // Warp 0: the block's (mean, M2) over the warps in double (a warp's count follows from np),
  // stored by lane r into block r's part[rank].
  if (warp == 0) {
    const uint32_t rounds = np / blockDim.x, rem = np % blockDim.x;
    const double nk = lane < W ? 8.0 * (32.0 * rounds + (rem > 32 * lane ? min(32u, rem - 32 * lane) : 0u)) : 0.0;
    const double mk = lane < W ? (double)wpart[lane].x : 0.0;
    double bm = nk * mk;
#pragma unroll
    for (uint32_t off = 1; off < W; off <<= 1) bm += __shfl_xor_sync(0xffffffffu, bm, off);
    bm /= (double)chunk;
    double bM = lane < W ? (double)wpart[lane].y + nk * (mk - bm) * (mk - bm) : 0.0;
#pragma unroll
    for (uint32_t off = 1; off < W; off <<= 1) bM += __shfl_xor_sync(0xffffffffu, bM, off);
    cluster_wait();
    if (lane < GNC) *cluster.map_shared_rank(&part[rank], lane) = make_double2(bm, bM);
  } else {
    cluster_wait();
  }
  cluster.sync();
  // Every thread: the group's statistics from the eight partials (each of `chunk` elements).
  double gm = 0.0;
#pragma unroll
  for (int r = 0; r < GNC; ++r) gm += part[r].x;
  gm /= GNC;
  double gM = 0.0;
#pragma unroll
  for (int r = 0; r < GNC; ++r) {
    const double d = part[r].x - gm;
    gM += part[r].y + (double)chunk * d * d;
  }
  const float mean = (float)gm, rstd = (float)rsqrt(gM / (double)E + (double)eps);
  if (rank == 0 && threadIdx.x == 0) {
    mean_out[group] = mean;
    rstd_out[group] = rstd;
  }
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
}

// st[2 p], st[2 p + 1] = (sum dy, sum dy (x - mean)) of each plane p, as gn_bwd_stats writes them.
// counts[g] (zero at launch and left zero) counts the clusters of group index g (one per sample)
// that have written their planes' sums; the last of the N adds them over N into g's dw and db,
// so no second kernel is needed (a launch costs ~2.6 us of GPU time however small its work) and
// the tail after the last dx store is a group's channels, not all C.
template <typename T>
__device__ __forceinline__ void gn_bwd_cluster(const T* __restrict__ x, const T* __restrict__ dy,
                                               const float* mean_in, const float* rstd_in, const T* __restrict__ w,
                                               T* __restrict__ dx, double* st, T* dw, T* db, unsigned* counts,
                                               uint32_t N, uint32_t C, uint32_t S, uint32_t cpg,
                                               unsigned long long* gate_count, uint32_t late_from) {
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  extern __shared__ __align__(16) unsigned char gn_smem[];
  __shared__ float2 wpart[GNB_CHANNELS][GNC_THREADS / 32];  // a channel's sums, per warp
  // Each (block r, channel j of the group) pair's sums at part[j + r]: a block's channels are
  // consecutive and consecutive blocks share at most one, so j + r is one-to-one.
  __shared__ double2 part[GNC_CHANNELS + GNC];
  __shared__ float wg[GNC_CHANNELS];  // the group's weights
  __shared__ bool last;
  static_assert(sizeof(Pack8<T>) % 16 == 0, "packs load as 16-byte pieces");
  constexpr uint32_t PIECES = sizeof(Pack8<T>) / 16;
  cluster_arrive_relaxed();
  const uint32_t rank = cluster.block_rank(), group = blockIdx.x / GNC, groups = gridDim.x / GNC;
  const uint32_t lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const Gate gate(gate_count, late_from, group, groups);
  gate.wait();
  const size_t E = (size_t)cpg * S, chunk = E / GNC, first = (size_t)group * E + rank * chunk;
  const uint32_t np = (uint32_t)(chunk / 8), ch32 = (uint32_t)chunk;
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
  const uint32_t base = rank * ch32;  // the chunk's first element within the group
  const uint32_t c_first = base / S, c_last = (base + ch32 - 1) / S;
  // The first channel's first loads of dy leave before x has landed (they do not need it).
  Pack8<T> d[GNB_UNROLL];
  const uint32_t hi0 = c_first == c_last ? np : ((c_first + 1) * S - base) / 8;
#pragma unroll
  for (int k = 0; k < GNB_UNROLL; ++k)
    if (threadIdx.x + k * blockDim.x < hi0) d[k] = load_dy(threadIdx.x + k * blockDim.x, keep);
  asm volatile("cp.async.wait_all;" ::: "memory");
  __syncthreads();
  gate.landed();
  // Per channel of the chunk: (sum dy, sum dy (x - mean)) in float a thread, double across
  // warps. GNB_UNROLL loads of dy in flight a thread.
  float f[8], g[8];
  for (uint32_t j = c_first; j <= c_last; ++j) {
    const uint32_t lo = j == c_first ? 0 : (j * S - base) / 8, hi = j == c_last ? np : ((j + 1) * S - base) / 8;
    float s1 = 0.f, s2 = 0.f;
    for (uint32_t i0 = lo + threadIdx.x; i0 < hi; i0 += GNB_UNROLL * blockDim.x) {
      if (j != c_first || i0 != threadIdx.x) {
#pragma unroll
        for (int k = 0; k < GNB_UNROLL; ++k)
          if (i0 + k * blockDim.x < hi) d[k] = load_dy(i0 + k * blockDim.x, keep);
      }
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
  // The block's sums per channel, stored into every peer's part[j + rank].
  cluster_wait();
  for (uint32_t t = threadIdx.x; t < (c_last - c_first + 1) * GNC; t += blockDim.x) {
    const uint32_t j = t / GNC, peer = t % GNC;
    double a = 0.0, b = 0.0;
    for (uint32_t k = 0; k < GNC_THREADS / 32; ++k) {
      a += wpart[j][k].x;
      b += wpart[j][k].y;
    }
    *cluster.map_shared_rank(&part[c_first + j + rank], peer) = make_double2(a, b);
  }
  cluster.sync();
  // A channel's sums over the blocks whose chunks touch it, in rank order (deterministic).
  auto channel = [&](uint32_t j) {
    double s1 = 0.0, s2 = 0.0;
    for (uint32_t r = j * S / ch32; r <= ((j + 1) * S - 1) / ch32; ++r) {
      s1 += part[j + r].x;
      s2 += part[j + r].y;
    }
    return make_double2(s1, s2);
  };
  // Every warp: the weighted group sums A1 = sum w_c sum dy, A2 = sum w_c sum dy (x - mean),
  // and dx = rstd (w dy - A1 / M - (x - mean) rstd^2 A2 / M), M = cpg S.
  double a1 = 0.0, a2 = 0.0;
  for (uint32_t j = lane; j < cpg; j += 32) {
    const double2 sj = channel(j);
    a1 += wg[j] * sj.x;
    a2 += wg[j] * sj.y;
  }
  a1 = warp_sum(a1);
  a2 = warp_sum(a2);
  const double rd = (double)rstd, q = rd / (double)E;
  const float k0 = (float)(-q * a1), kx = (float)(-q * rd * rd * a2);
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
  // After the block's own dx (off the critical path): rank 0 writes the planes' sums, and the
  // last of the group index's N clusters adds them into dw and db.
  if (rank != 0) return;
  const uint32_t G = C / cpg, gi = group % G;
  if (warp == 0) {
    for (uint32_t j = lane; j < cpg; j += 32) {
      const double2 sj = channel(j);
      st[2 * ((size_t)group * cpg + j)] = sj.x;
      st[2 * ((size_t)group * cpg + j) + 1] = sj.y;
    }
    __threadfence();  // the sums, before the count
    if (lane == 0) last = atomicAdd(counts + gi, 1u) == N - 1;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  for (uint32_t j = threadIdx.x; j < cpg; j += blockDim.x) {
    const uint32_t c = gi * cpg + j;
    double sw = 0.0, sb = 0.0;
    for (uint32_t n = 0; n < N; ++n) {
      sb += __ldcg(st + 2 * ((size_t)n * C + c));
      sw += __ldcg(st + 2 * ((size_t)n * C + c) + 1) * (double)rstd_in[n * G + gi];
    }
    dw[c] = from_f64<T>(sw);
    db[c] = from_f64<T>(sb);
  }
  if (threadIdx.x == 0) counts[gi] = 0;
}

#define GN_CLUSTER(SUF, T, MINB)                                                                               \
  extern "C" __global__ void __cluster_dims__(GNC, 1, 1) __launch_bounds__(GNC_THREADS, MINB)              \
      gn_fwd_cluster_##SUF(const T* x, const T* w, const T* b, T* y, float* mean, float* rstd, uint32_t C, \
                           uint32_t S, uint32_t cpg, float eps, unsigned long long* gate, uint32_t late_from) { \
    gn_fwd_cluster<T>(x, w, b, y, mean, rstd, C, S, cpg, eps, gate, late_from);                            \
  }                                                                                                         \
  extern "C" __global__ void __cluster_dims__(GNC, 1, 1) __launch_bounds__(GNC_THREADS, MINB)              \
      gn_bwd_cluster_##SUF(const T* x, const T* dy, const float* mean, const float* rstd, const T* w,      \
                           T* dx, double* st, T* dw, T* db, unsigned* counts, uint32_t N, uint32_t C,      \
                           uint32_t S, uint32_t cpg, unsigned long long* gate, uint32_t late_from) {       \
    gn_bwd_cluster<T>(x, dy, mean, rstd, w, dx, st, dw, db, counts, N, C, S, cpg, gate, late_from);        \
  }
// Five blocks a multiprocessor (48 registers) keep SDXL's 64 clusters resident in one wave. The
// f32 backward needs 64 registers (it spills at 48); its chunks hold half the elements anyway.
GN_CLUSTER(f32, float, 1)
GN_CLUSTER(bf16, __nv_bfloat16, 5)
GN_CLUSTER(f16, __half, 5)
#endif
