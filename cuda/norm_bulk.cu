// LayerNorm / RMSNorm backward with the parameter gradients on Hopper (compute_90 build only):
// dx, dw = sum dy xhat and db = sum dy in one kernel, the rows brought into shared memory by
// bulk copies (cp.async.bulk, the TMA unit) instead of by the threads.
//
// Why: norm_bwd_params (norm.cu) keeps a step of rows in flight in registers, two steps deep,
// which takes 168 registers a thread and leaves one or two blocks a multiprocessor; at Flux's
// 4608 x 3072 bf16 it took 43 us against 34 us for dx alone. Here a block's chunk of
// consecutive rows arrives in stages of `srows` rows, each stage two bulk copies (x, dy) that
// complete on one mbarrier, several stages in flight at once and no register holding a row
// that is not being worked on.
//
// The threads are laid out as in norm_bwd_params (rows.cuh's column sums by row blocks): groups
// of lw lanes, lane l holding column packs l, l + lw, ... (P of them) in every row it takes, so
// that its columns' sums of dy xhat and dy stay in float registers over the whole chunk. A stage
// holds RPT rows a group. A stage's rows are read from shared memory into registers, their two
// row sums meet (shuffles, then shared memory when a group spans warps), and one barrier a stage
// both publishes those sums and frees the stage for its next bulk copy.
//
// At the end the blocks meet once more, through a grid-wide barrier (the kernel is launched
// cooperatively, so all its blocks are resident): each block has written its partial rows, and
// the blocks then add all partial rows for a slice of the columns, in double and in a fixed
// order (deterministic), into dw and db of the input's type. That replaces sum_partials2f and
// its launch.
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900  // (the host pass of a full build sees it too)
#include "common.cuh"
#include "rows.cuh"

// Bytes at the start of the dynamic shared memory: the stages' mbarriers (8 bytes each, so at
// most 16 stages; the launcher takes at most 8).
#define BULK_BARRIERS 128

__device__ __forceinline__ unsigned smem_u32(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void mbar_init(uint64_t* bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}
// Makes the mbarrier initialisations visible to the bulk copies (the async proxy).
__device__ __forceinline__ void mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }
// Arrives (the barrier's one arrival) and says how many bytes the phase's copies bring.
__device__ __forceinline__ void mbar_expect(uint64_t* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, unsigned parity) {
  asm volatile(
      "{\n"
      " .reg .pred done;\n"
      "WAIT:\n"
      " mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      " @!done bra WAIT;\n"
      "}\n" ::"r"(smem_u32(bar)),
      "r"(parity)
      : "memory");
}
// `bytes` (a multiple of 16, both addresses 16-byte aligned) from global to this block's shared
// memory, completing on `bar`.
__device__ __forceinline__ void bulk_load(void* dst, const void* src, unsigned bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   smem_u32(dst)),
               "l"(src), "r"(bytes), "r"(smem_u32(bar))
               : "memory");
}

// Sums each of V values (a power of two, 2 to 32) over the warp's 32 lanes, scattered: lane l
// returns the sum of value l / (32 / V), computed by log2(V) halving exchanges and then
// 5 - log2(V) plain ones (V + 4 - log2(V) shuffles instead of 5 V; a fixed order).
template <int V>
__device__ __forceinline__ float warp_reduce_scatter(float (&t)[V]) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int width = V / 2, m = 16; width >= 1; width /= 2, m /= 2) {
    const bool upper = lane & m;  // keeps the upper half of its values, sends the lower
#pragma unroll
    for (int q = 0; q < width; ++q) {
      const float send = upper ? t[q] : t[q + width], keep = upper ? t[q + width] : t[q];
      t[q] = keep + __shfl_xor_sync(0xffffffff, send, m);
    }
  }
  float s = t[0];
#pragma unroll
  for (int m = 16 / V; m >= 1; m /= 2) s += __shfl_xor_sync(0xffffffff, s, m);
  return s;
}

// Grid-wide barrier over counters[0] (zero before the kernel), for cooperative launches only.
__device__ __forceinline__ void grid_barrier(unsigned* counters) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(&counters[0], 1u);
    while (*(volatile unsigned*)&counters[0] < gridDim.x) {
    }
    __threadfence();
  }
  __syncthreads();
}

struct alignas(32) D4 {
  double x, y, z, w;
};

// After grid_barrier: adds the gridDim.x blocks' partial rows part[(b * 2 + k) * cols + c] into
// out0 (k = 0) and out1 (k = 1), in double. The 2 cols outputs go in units of four (16-byte
// loads; cols % 4 == 0), an equal share of units a block, so that every block takes part.
// A block's threads hold (unit, phase) pairs, a power of two of phases a unit: a thread adds
// rows phase, phase + phases, ... of its unit, then the phases meet in a tree in `acc`
// (blockDim.x D4 of shared memory). The order is fixed by the launch shape (deterministic).
// The last block out sets the counters back to zero.
template <typename T>
__device__ __forceinline__ void grid_sum_partials(const float* part, size_t cols, T* out0, T* out1,
                                                  unsigned* counters, D4* acc) {
  const size_t units = cols / 2, share = (units + gridDim.x - 1) / gridDim.x;
  const size_t u0 = min(units, blockIdx.x * share), u1 = min(units, u0 + share);
  const int width = (int)min(share, (size_t)blockDim.x), unit = threadIdx.x % width, phase = threadIdx.x / width;
  int phases = 1;
  while (2 * phases * width <= (int)blockDim.x) phases *= 2;
  for (size_t ub = u0; ub < u1; ub += width) {
    const size_t u = ub + unit;
    const bool mine = phase < phases && u < u1;
    const size_t o = 4 * u, k = o < cols ? 0 : 1, c = o - k * cols;
    if (mine) {
      D4 s = {0, 0, 0, 0};
#pragma unroll 4
      for (size_t b = phase; b < gridDim.x; b += phases) {
        const float4 v = __ldcg(reinterpret_cast<const float4*>(part + (b * 2 + k) * cols + c));
        s.x += v.x, s.y += v.y, s.z += v.z, s.w += v.w;
      }
      acc[phase * width + unit] = s;
    }
    __syncthreads();
    for (int h = phases / 2; h >= 1; h /= 2) {
      if (mine && phase < h) {
        D4& s = acc[phase * width + unit];
        const D4 t = acc[(phase + h) * width + unit];
        s.x += t.x, s.y += t.y, s.z += t.z, s.w += t.w;
      }
      __syncthreads();
    }
    if (mine && phase == 0) {
      const D4 s = acc[unit];
      T* out = (k ? out1 : out0) + c;
      out[0] = from_f64<T>(s.x), out[1] = from_f64<T>(s.y), out[2] = from_f64<T>(s.z), out[3] = from_f64<T>(s.w);
    }
    __syncthreads();
  }
  if (threadIdx.x == 0 && atomicAdd(&counters[1], 1u) == gridDim.x - 1) {
    counters[0] = 0;
    counters[1] = 0;
  }
}

// x, dy, dx: (rows, cols) contiguous, 16-byte aligned, cols % 8 == 0; part: [gridDim.x][2][cols]
// floats; dw, db: cols each; counters: two zeroed u32s. A block takes rows [blockIdx.x * chunk,
// + chunk) in stages of groups * RPT rows, `stages` of them in flight; dynamic shared memory is
// BULK_BARRIERS + stages * 2 * srows * cols * sizeof(T) bytes, at least BULK_BARRIERS + 32
// blockDim.x bytes (grid_sum_partials' sums). xhat, dx as norm_bwd_params.
template <typename T, int P, int RPT>
__device__ __forceinline__ void norm_bwd_bulk(const T* __restrict__ in, const T* __restrict__ dy, const T* w,
                                              const float* mean_in, const float* rstd_in, T* __restrict__ dx,
                                              float* part, T* dw, T* db, unsigned* counters, size_t rows,
                                              size_t cols, size_t chunk, int lw, int stages, int rms) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int groups = blockDim.x / lw, g = threadIdx.x / lw, lane = threadIdx.x % lw;
  const int wpg = lw / 32, warp = threadIdx.x / 32;  // warps a group (0: a group within a warp)
  const size_t packs = cols / 8, r0 = min(rows, blockIdx.x * chunk), r1 = min(rows, r0 + chunk);
  const int npacks = (int)packs;
  const size_t srows = (size_t)groups * RPT, stage_elems = srows * cols;
  const int nst = (int)((r1 - r0 + srows - 1) / srows);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem);
  T* buf = reinterpret_cast<T*>(smem + BULK_BARRIERS);  // stage s: x at 2s, dy at 2s + 1
  auto issue = [&](int i) {
    const size_t base = r0 + (size_t)i * srows, n = min(srows, r1 - base);
    const unsigned bytes = (unsigned)(n * cols * sizeof(T));
    const int s = i % stages;
    mbar_expect(&full[s], 2 * bytes);
    bulk_load(buf + 2 * s * stage_elems, in + base * cols, bytes, &full[s]);
    bulk_load(buf + (2 * s + 1) * stage_elems, dy + base * cols, bytes, &full[s]);
  };
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) mbar_init(&full[s], 1);
    mbar_init_fence();
    for (int i = 0; i < min(stages, nst); ++i) issue(i);
  }
  const float n = (float)cols;
  float wf[P][8], aw[P][8], ab[P][8];
  norm_sums_init<T, P>(w, wf, aw, ab, packs, lw, lane);
  // The statistics of a stage's rows, loaded a stage ahead.
  float ms[RPT], ss[RPT];
  auto stats = [&](int i, float(&mn)[RPT], float(&sn)[RPT]) {
#pragma unroll
    for (int j = 0; j < RPT; ++j) {
      const size_t r = r0 + (size_t)i * srows + (size_t)j * groups + g;
      mn[j] = r < r1 && !rms ? mean_in[r] : 0.f;
      sn[j] = r < r1 ? rstd_in[r] : 0.f;
    }
  };
  stats(0, ms, ss);
  __shared__ float4 red[2][32][RPT / 2];  // a stage's row sums, by warp (RPT even)
  __syncthreads();  // the mbarriers are initialised
  for (int i = 0; i < nst; ++i) {
    const int s = i % stages;
    const size_t base = r0 + (size_t)i * srows;
    float mn[RPT], sn[RPT], v[2 * RPT];
    if (i + 1 < nst) stats(i + 1, mn, sn);
    mbar_wait(&full[s], (unsigned)(i / stages) & 1u);
    // (32-bit offsets within the stage: it holds at most a few hundred KiB.)
    const Pack8<T>* xs = reinterpret_cast<const Pack8<T>*>(buf + 2 * s * stage_elems);
    const Pack8<T>* gs = xs + stage_elems / 8;
    // The row sums, then dx and the column sums: each pass reads the rows from shared memory
    // (a second read there costs less than keeping them in registers across the barrier).
#pragma unroll
    for (int j = 0; j < RPT; ++j) {
      const int rj = j * groups + g;
      float sum_g = 0.f, sum_gx = 0.f;
#pragma unroll
      for (int k = 0; k < P; ++k) {
        const int p = k * lw + lane;
        if (base + rj < r1 && p < npacks) norm_row_sums(xs[rj * npacks + p], gs[rj * npacks + p], wf[k], ms[j], sum_g, sum_gx);
      }
      v[2 * j] = sum_g;
      v[2 * j + 1] = sum_gx;
    }
    if (wpg > 1) {
      // A group spans warps: each warp's sums go to shared memory, 32 / (2 RPT) lanes a sum.
      const float t = warp_reduce_scatter<2 * RPT>(v);
      if ((threadIdx.x & 31) % (16 / RPT) == 0) reinterpret_cast<float*>(red[i & 1][warp])[(threadIdx.x & 31) / (16 / RPT)] = t;
    } else {
#pragma unroll
      for (int q = 0; q < 2 * RPT; ++q) v[q] = lane_group_sum(v[q], lw);
    }
    // Every thread is done with the previous stage's rows (and has published its warp's row
    // sums): that stage's buffer takes the rows `stages` stages after it.
    __syncthreads();
    if (threadIdx.x == 0 && i >= 1 && i - 1 + stages < nst) issue(i - 1 + stages);
    if (wpg > 1) {
#pragma unroll
      for (int q = 0; q < 2 * RPT; ++q) v[q] = 0.f;
      for (int o = 0; o < wpg; ++o)
#pragma unroll
        for (int h = 0; h < RPT / 2; ++h) {
          const float4 u = red[i & 1][g * wpg + o][h];
          v[4 * h] += u.x, v[4 * h + 1] += u.y, v[4 * h + 2] += u.z, v[4 * h + 3] += u.w;
        }
    }
#pragma unroll
    for (int j = 0; j < RPT; ++j) {
      const int rj = j * groups + g;
      const size_t r = base + rj;
      if (r >= r1) continue;
      const float m = ms[j], s = ss[j];
      // sum(g xhat) = rstd sum(g (x - mean)), as norm_bwd_params.
      const float a = rms ? 0.f : v[2 * j] / n, bq = v[2 * j + 1] * s / n;
      Pack8<T>* out = reinterpret_cast<Pack8<T>*>(dx + r * cols);
#pragma unroll
      for (int k = 0; k < P; ++k) {
        const int p = k * lw + lane;
        if (p < npacks) out[p] = norm_dx_sums(xs[rj * npacks + p], gs[rj * npacks + p], wf[k], m, s, a, bq, aw[k], ab[k]);
      }
    }
#pragma unroll
    for (int j = 0; j < RPT; ++j) ms[j] = mn[j], ss[j] = sn[j];
  }
  colsum_finish<P>(aw, ab, part + blockIdx.x * 2 * cols, part + (blockIdx.x * 2 + 1) * cols, packs, lw);
  grid_barrier(counters);
  // (The stages are all consumed: their buffer holds the warps' sums.)
  grid_sum_partials<T>(part, cols, dw, db, counters, reinterpret_cast<D4*>(buf));
}

// Must match `launch_bwd_bulk` in src/backend/cuda/norm.rs: two rows a group a stage; one pack
// a lane up to 384 packs (80 registers: two blocks of 384 threads a multiprocessor), two up to
// 768 (6144 columns of bf16). Four rows a group (one block a multiprocessor) timed the same
// on an H100 at 4608 x 3072 bf16 (41.4 us against 41.2) and slower at 110592 x 128.
#define NORM_BWD_BULK_1(SUF, T, P, MIN_BLOCKS)                                                               \
  extern "C" __global__ void __launch_bounds__(384, MIN_BLOCKS) norm_bwd_bulk_##P##_##SUF(                   \
      const T* x, const T* dy, const T* w, const float* mean, const float* rstd, T* dx, float* part, T* dw, \
      T* db, unsigned* counters, size_t rows, size_t cols, size_t chunk, int lw, int stages, int rms) {     \
    norm_bwd_bulk<T, P, 2>(x, dy, w, mean, rstd, dx, part, dw, db, counters, rows, cols, chunk, lw, stages, rms); \
  }
#define NORM_BWD_BULK(SUF, T)   \
  NORM_BWD_BULK_1(SUF, T, 1, 2) \
  NORM_BWD_BULK_1(SUF, T, 2, 1)
NORM_BWD_BULK(f32, float)
NORM_BWD_BULK(bf16, __nv_bfloat16)
NORM_BWD_BULK(f16, __half)
#endif
