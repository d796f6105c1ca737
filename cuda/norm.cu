// Fused LayerNorm / RMSNorm over contiguous (rows, cols), forward and backward side by side.
// Statistics accumulate in the accumulation type A (float for f32 and the half types, double
// for f64): each lane sums its share of the row (8 elements pairwise at a time), the lanes then
// meet through shuffles. y and dx are computed in A. Saved statistics S are float (double for
// f64 inputs).
//   forward:  mean = sum(x)/n (0 for RMS); rstd = 1/sqrt(sum((x-mean)^2)/n + eps);
//             y = (x - mean) * rstd * w + b          (w, b optional: null pointers)
//   backward: xhat = (x - mean) * rstd; g = dy * w; a = sum(g)/n (0 for RMS);
//             b = sum(g*xhat)/n; dx = rstd * (g - a - xhat * b)
// Float statistics are what PyTorch's CUDA kernels keep too; per lane they add at most a few
// hundred terms, so their relative error stays near 1e-7 (the f32 GPU tests bound it at 2e-6).
#include "common.cuh"
#include "rows.cuh"

// Where row r of x starts, in elements, for the register-resident kernels: rows indexed by
// up to three leading dims (d0 = rows / (d1 d2), d1, d2) with their strides, so a strided
// view (a head-split q or k of a fused projection, (B, H, N, E) over (B, N, 3, H, E)) is
// normed where it lies instead of being copied first. A dense x is d1 = d2 = 1, s0 = cols.
struct RowMap {
  unsigned long long d1, d2, s0, s1, s2;
};
__device__ __forceinline__ RowMap dense_rows(size_t cols) { return RowMap{1, 1, cols, 0, 0}; }
__device__ __forceinline__ size_t row_off(const RowMap& m, size_t r) {
  const size_t i2 = r % m.d2, t = r / m.d2;
  return (t / m.d1) * m.s0 + (t % m.d1) * m.s1 + i2 * m.s2;
}

// Sum over groups of LANES neighbouring lanes (LANES a power of two, at most 32).
template <int LANES, typename A>
__device__ __forceinline__ A group_sum(A v) {
#pragma unroll
  for (int s = LANES / 2; s > 0; s >>= 1) v += __shfl_xor_sync(0xffffffff, v, s);
  return v;
}

// Streaming version for any row length: a warp per row, the row re-read from L1 per pass.
template <typename T, typename S>
__device__ __forceinline__ void norm_fwd(const T* __restrict__ in, const T* w, const T* b, T* __restrict__ out,
                                         S* mean_out, S* rstd_out, size_t rows, size_t cols, double eps, int rms,
                                         const RowMap xm) {
  typedef typename AccT<T>::type A;
  const size_t warps = blockDim.x / 32, lane = threadIdx.x & 31;
  for (size_t r = blockIdx.x * warps + threadIdx.x / 32; r < rows; r += (size_t)gridDim.x * warps) {
    const T* x = in + row_off(xm, r);
    A sum = A(0);
    if (!rms) for_row(x, cols, lane, [&](size_t, T v) { sum += to_acc(v); });
    const A mean = rms ? A(0) : group_sum<32>(sum) / (A)cols;
    A sq = A(0);
    for_row(x, cols, lane, [&](size_t, T v) {
      const A d = to_acc(v) - mean;
      sq += d * d;
    });
    const A s = A(1) / sqrt(group_sum<32>(sq) / (A)cols + (A)eps);
    T* y = out + r * cols;
    size_t start = 0;
    if (aligned16(x) && aligned16(y) && (!w || aligned16(w)) && (!b || aligned16(b))) {
      // 16-byte packs of x, w, b and y.
      const size_t nv = cols / 8;
      for (size_t v = lane; v < nv; v += 32) {
        const Pack8<T> p = reinterpret_cast<const Pack8<T>*>(x)[v];
        Pack8<T> o, wp, bp;
        if (w) wp = reinterpret_cast<const Pack8<T>*>(w)[v];
        if (b) bp = reinterpret_cast<const Pack8<T>*>(b)[v];
#pragma unroll
        for (int k = 0; k < 8; ++k)
          o.v[k] = from_acc<T>((to_acc(p.v[k]) - mean) * s * (w ? to_acc(wp.v[k]) : A(1)) + (b ? to_acc(bp.v[k]) : A(0)));
        reinterpret_cast<Pack8<T>*>(y)[v] = o;
      }
      start = nv * 8;
    }
    for (size_t c = start + lane; c < cols; c += 32) {
      const A wv = w ? to_acc(w[c]) : A(1), bv = b ? to_acc(b[c]) : A(0);
      y[c] = from_acc<T>((to_acc(x[c]) - mean) * s * wv + bv);
    }
    if (lane == 0) {
      mean_out[r] = (S)mean;
      rstd_out[r] = (S)s;
    }
  }
}

template <typename T, typename S>
__device__ __forceinline__ void norm_bwd(const T* __restrict__ in, const T* __restrict__ dy, const T* w,
                                         const S* mean_in, const S* rstd_in, T* __restrict__ dx, size_t rows,
                                         size_t cols, int rms, const RowMap xm) {
  typedef typename AccT<T>::type A;
  const size_t warps = blockDim.x / 32, lane = threadIdx.x & 31;
  for (size_t r = blockIdx.x * warps + threadIdx.x / 32; r < rows; r += (size_t)gridDim.x * warps) {
    const T* x = in + row_off(xm, r);
    const T* g = dy + r * cols;
    const A m = (A)mean_in[r], s = (A)rstd_in[r];
    A sum_g = A(0), sum_gx = A(0);
    auto gw = [&](size_t c, T gv) { return w ? to_acc(gv) * to_acc(w[c]) : to_acc(gv); };
    for_row2(x, g, cols, lane, [&](size_t c, T xv, T gv) {
      const A d = gw(c, gv);
      sum_g += d;
      sum_gx += d * ((to_acc(xv) - m) * s);
    });
    const A a = rms ? A(0) : group_sum<32>(sum_g) / (A)cols;
    const A bq = group_sum<32>(sum_gx) / (A)cols;
    map_row2(x, g, dx + r * cols, cols, lane, [&](size_t c, T xv, T gv) {
      const A xh = (to_acc(xv) - m) * s;
      return from_acc<T>(s * (gw(c, gv) - a - xh * bq));
    });
  }
}

// Register-resident rows: LANES lanes share a row of up to LANES * PACKS * 8 columns (cols % 8
// == 0, rows 16-byte aligned), each lane holding PACKS packs of 8, and each group of lanes
// takes RPT rows at once, so that every load of a step is in flight before the first sum.
// x (and dy) are read once, y (dx) written once. Rows advance per block, so every lane of a
// warp takes part in every shuffle.
// Loads this lane's packs of a row (PACKS packs, LANES lanes a row); absent packs are left
// unset and never read.
template <typename T, int PACKS, int LANES>
__device__ __forceinline__ void load_row(const T* __restrict__ row, bool valid, size_t packs, int lane,
                                         Pack8<T> (&v)[PACKS]) {
#pragma unroll
  for (int k = 0; k < PACKS; ++k) {
    const size_t p = (size_t)k * LANES + lane;
    if (valid && p < packs) v[k] = reinterpret_cast<const Pack8<T>*>(row)[p];
  }
}

// Copies the optional weight and bias rows (cols each, whole packs) into the block's dynamic
// shared memory, which the launcher sizes at 2 * cols elements when either is present: read
// there per pack, they cost no registers and no global-memory latency after the row's sums.
// The copies are cp.async (no registers, no wait), issued before the block's first rows load;
// `params_ready` waits for them once, while those rows are still in flight.
__device__ __forceinline__ void copy_async16(void* smem, const void* gmem) {
  const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(gmem));
}

template <typename T>
__device__ __forceinline__ void stage_params(const T*& w, const T*& b, size_t cols) {
  extern __shared__ __align__(16) unsigned char norm_smem[];
  T* sw = reinterpret_cast<T*>(norm_smem);
  T* sb = sw + cols;
  // 16-byte pieces (an f32 pack is two); cols % 8 == 0 makes each row whole pieces.
  const size_t pieces = cols * sizeof(T) / 16;
  for (size_t q = threadIdx.x; q < pieces; q += blockDim.x) {
    if (w) copy_async16(reinterpret_cast<uint4*>(sw) + q, reinterpret_cast<const uint4*>(w) + q);
    if (b) copy_async16(reinterpret_cast<uint4*>(sb) + q, reinterpret_cast<const uint4*>(b) + q);
  }
  asm volatile("cp.async.commit_group;" ::: "memory");
  if (w) w = sw;
  if (b) b = sb;
}

// Waits once for the staged parameters. Called in a block-uniform loop: every thread reaches
// the barrier.
__device__ __forceinline__ void params_ready(bool& staged) {
  if (staged) return;
  asm volatile("cp.async.wait_all;" ::: "memory");
  __syncthreads();
  staged = true;
}

template <typename T, int PACKS, int LANES, int RPT>
__device__ __forceinline__ void norm_fwd_reg(const T* __restrict__ in, const T* w, const T* b, T* __restrict__ out, float* mean_out,
                                             float* rstd_out, size_t rows, size_t cols, double eps, int rms,
                                             const RowMap xm) {
  constexpr bool VW = PACKS >= 4;
  const int lane = threadIdx.x % LANES;
  const size_t per_block = blockDim.x / LANES, packs = cols / 8, grp = threadIdx.x / LANES;
  const float n = (float)cols, epsf = (float)eps;
  stage_params(w, b, cols);
  bool staged = false;
  for (size_t base = blockIdx.x * per_block * RPT; base < rows; base += (size_t)gridDim.x * per_block * RPT) {
    Pack8<T> v[RPT][PACKS];
#pragma unroll
    for (int j = 0; j < RPT; ++j) {
      const size_t r = base + j * per_block + grp;
      load_row<T, PACKS, LANES>(in + row_off(xm, r < rows ? r : 0), r < rows, packs, lane, v[j]);
    }
    params_ready(staged);
#pragma unroll
    for (int j = 0; j < RPT; ++j) {
      const size_t r = base + j * per_block + grp;
      const bool valid = r < rows;
      float sum = 0.f, f[8];
      if (!rms) {
#pragma unroll
        for (int k = 0; k < PACKS; ++k)
          if (valid && (size_t)k * LANES + lane < packs) {
            widen<VW>(v[j][k], f);
            sum += ((f[0] + f[1]) + (f[2] + f[3])) + ((f[4] + f[5]) + (f[6] + f[7]));
          }
      }
      const float mean = rms ? 0.f : group_sum<LANES>(sum) / n;
      float sq = 0.f;
#pragma unroll
      for (int k = 0; k < PACKS; ++k)
        if (valid && (size_t)k * LANES + lane < packs) {
          widen<VW>(v[j][k], f);
#pragma unroll
          for (int e = 0; e < 8; ++e) sq += (f[e] - mean) * (f[e] - mean);
        }
      const float s = 1.f / sqrtf(group_sum<LANES>(sq) / n + epsf);
      if (!valid) continue;
      Pack8<T>* y = reinterpret_cast<Pack8<T>*>(out + r * cols);
#pragma unroll
      for (int k = 0; k < PACKS; ++k) {
        const size_t p = (size_t)k * LANES + lane;
        if (p < packs) {
          Pack8<T> o, wp, bp;
          if (w) wp = reinterpret_cast<const Pack8<T>*>(w)[p];
          if (b) bp = reinterpret_cast<const Pack8<T>*>(b)[p];
          widen<VW>(v[j][k], f);
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            const float xs = (f[e] - mean) * s;
            o.v[e] = from_acc<T>(w ? (b ? xs * to_acc(wp.v[e]) + to_acc(bp.v[e]) : xs * to_acc(wp.v[e]))
                                   : (b ? xs + to_acc(bp.v[e]) : xs));
          }
          y[p] = o;
        }
      }
      if (lane == 0) {
        mean_out[r] = mean;
        rstd_out[r] = s;
      }
    }
  }
}

// SUMS: also this block's partial rows of dw = sum dy xhat and db = sum dy into `part` (float,
// [gridDim.x][2][cols]). A row's pack is held by one lane for every row the group takes, so
// each group of lanes keeps its own two sums per column in shared memory after the staged
// weight (only the lane that owns a column touches it: no barrier until the end), laid out
// [half-pack][lane] so a warp's float4 accesses are consecutive; the groups meet at the end
// in a fixed order.
template <typename T, int PACKS, int LANES, int RPT, bool SUMS = false>
__device__ __forceinline__ void norm_bwd_reg(const T* __restrict__ in, const T* __restrict__ dy,
                                             const T* w, const float* mean_in, const float* rstd_in,
                                             T* __restrict__ dx, size_t rows, size_t cols, int rms,
                                             const RowMap xm, float* __restrict__ part = nullptr) {
  constexpr bool VW = PACKS >= 4;
  const int lane = threadIdx.x % LANES;
  const size_t per_block = blockDim.x / LANES, packs = cols / 8, grp = threadIdx.x / LANES;
  const float n = (float)cols;
  const T* b = nullptr;
  stage_params(w, b, cols);
  bool staged = false;
  constexpr int Q = 2 * PACKS * LANES;  // float4s of one sum of one group
  extern __shared__ __align__(16) unsigned char norm_smem[];
  float4* const sums = reinterpret_cast<float4*>(norm_smem + 2 * cols * sizeof(T));
  float4* const acc = sums + grp * 2 * Q;  // this group's dw, then db
  if (SUMS)
#pragma unroll
    for (int q = 0; q < 2 * PACKS; ++q) {
      acc[q * LANES + lane] = make_float4(0.f, 0.f, 0.f, 0.f);
      acc[Q + q * LANES + lane] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
  for (size_t base = blockIdx.x * per_block * RPT; base < rows; base += (size_t)gridDim.x * per_block * RPT) {
    Pack8<T> xv[RPT][PACKS], gv[RPT][PACKS];
    float ms[RPT], ss[RPT];
#pragma unroll
    for (int j = 0; j < RPT; ++j) {
      const size_t r = base + j * per_block + grp;
      const size_t off = (r < rows ? r : 0) * cols, xoff = row_off(xm, r < rows ? r : 0);
      // The statistics load with the row: read after the shuffles, they would stall each row.
      ms[j] = r < rows && !rms ? mean_in[r] : 0.f;
      ss[j] = r < rows ? rstd_in[r] : 0.f;
      load_row<T, PACKS, LANES>(in + xoff, r < rows, packs, lane, xv[j]);
      load_row<T, PACKS, LANES>(dy + off, r < rows, packs, lane, gv[j]);
    }
    params_ready(staged);
#pragma unroll
    for (int j = 0; j < RPT; ++j) {
      const size_t r = base + j * per_block + grp;
      const bool valid = r < rows;
      const float m = ms[j], s = ss[j];
      float sum_g = 0.f, sum_gx = 0.f, xf[8], gf[8];
#pragma unroll
      for (int k = 0; k < PACKS; ++k) {
        const size_t p = (size_t)k * LANES + lane;
        if (valid && p < packs) {
          Pack8<T> wp;
          if (w) wp = reinterpret_cast<const Pack8<T>*>(w)[p];
          widen<VW>(xv[j][k], xf);
          widen<VW>(gv[j][k], gf);
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            const float g = w ? gf[e] * to_acc(wp.v[e]) : gf[e];
            sum_g += g;
            sum_gx += g * (xf[e] - m);
          }
        }
      }
      // sum(g xhat) = rstd sum(g (x - mean)): one multiply a row instead of one an element.
      const float a = rms ? 0.f : group_sum<LANES>(sum_g) / n;
      const float bq = group_sum<LANES>(sum_gx) * s / n;
      if (!valid) continue;
      Pack8<T>* out = reinterpret_cast<Pack8<T>*>(dx + r * cols);
#pragma unroll
      for (int k = 0; k < PACKS; ++k) {
        const size_t p = (size_t)k * LANES + lane;
        if (p < packs) {
          Pack8<T> o, wp;
          if (w) wp = reinterpret_cast<const Pack8<T>*>(w)[p];
          widen<VW>(xv[j][k], xf);
          widen<VW>(gv[j][k], gf);
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            const float g = w ? gf[e] * to_acc(wp.v[e]) : gf[e];
            o.v[e] = from_acc<T>(s * (g - a - (xf[e] - m) * s * bq));
          }
          out[p] = o;
          if (SUMS) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              float4* aw = acc + (2 * k + h) * LANES + lane;
              float4 u = aw[0], v = aw[Q];
              const float* xe = xf + 4 * h;
              const float* ge = gf + 4 * h;
              u.x += ge[0] * ((xe[0] - m) * s), u.y += ge[1] * ((xe[1] - m) * s);
              u.z += ge[2] * ((xe[2] - m) * s), u.w += ge[3] * ((xe[3] - m) * s);
              v.x += ge[0], v.y += ge[1], v.z += ge[2], v.w += ge[3];
              aw[0] = u;
              aw[Q] = v;
            }
          }
        }
      }
    }
  }
  if (SUMS) {
    __syncthreads();
    const int groups = blockDim.x / LANES;
    for (int q = threadIdx.x; q < Q; q += blockDim.x) {
      float4 u = sums[q], v = sums[Q + q];
      for (int o = 1; o < groups; ++o) {
        const float4 u2 = sums[o * 2 * Q + q], v2 = sums[o * 2 * Q + Q + q];
        u.x += u2.x, u.y += u2.y, u.z += u2.z, u.w += u2.w;
        v.x += v2.x, v.y += v2.y, v.z += v2.z, v.w += v2.w;
      }
      const size_t kh = q / LANES, p = (kh / 2) * LANES + q % LANES, c = p * 8 + (kh % 2) * 4;
      if (p < packs) {
        *reinterpret_cast<float4*>(part + blockIdx.x * 2 * cols + c) = u;
        *reinterpret_cast<float4*>(part + (blockIdx.x * 2 + 1) * cols + c) = v;
      }
    }
  }
}

// Backward with the parameter gradients (rows.cuh's column sums by row blocks): dx as
// norm_bwd_reg, and this block's partial rows of dw = sum dy xhat and db = sum dy in `part`
// (float, [gridDim.x][2][cols]). A group of lw lanes shares a row (P packs a lane, cols % 8
// == 0, rows 16-byte aligned) and takes RPT rows at once; a row's two sums meet through
// shuffles and, when a group spans several warps, through shared memory (double-buffered:
// one barrier a step). The weight's packs stay in registers for the whole chunk.
template <typename T, int P, int RPT>
__device__ __forceinline__ void norm_bwd_params(const T* __restrict__ in, const T* __restrict__ dy, const T* w,
                                                const float* mean_in, const float* rstd_in, T* __restrict__ dx,
                                                float* __restrict__ part, size_t rows, size_t cols, size_t chunk,
                                                int lw, int rms) {
  const int groups = blockDim.x / lw, g = threadIdx.x / lw, lane = threadIdx.x % lw;
  const int wpg = lw / 32, warp = threadIdx.x / 32;  // warps a group (0: a group within a warp)
  const size_t packs = cols / 8, r0 = blockIdx.x * chunk, r1 = min(rows, r0 + chunk);
  const float n = (float)cols;
  float wf[P][8], aw[P][8], ab[P][8];
  norm_sums_init<T, P>(w, wf, aw, ab, packs, lw, lane);
  __shared__ float red[2][32][2 * RPT];
  int buf = 0;
  const size_t step = (size_t)groups * RPT;
  // This step's rows, loaded during the previous step (the next step's rows load while a
  // step's sums meet and its dx is written).
  Pack8<T> xv[RPT][P], gv[RPT][P];
  float ms[RPT], ss[RPT];
  auto load = [&](size_t base, Pack8<T>(&xs)[RPT][P], Pack8<T>(&gs)[RPT][P], float(&mn)[RPT], float(&rs)[RPT]) {
#pragma unroll
    for (int j = 0; j < RPT; ++j) {
      const size_t r = base + (size_t)j * groups + g;
      const bool valid = r < r1;
      mn[j] = valid && !rms ? mean_in[r] : 0.f;
      rs[j] = valid ? rstd_in[r] : 0.f;
      const size_t off = (valid ? r : 0) * cols;
#pragma unroll
      for (int k = 0; k < P; ++k) {
        const size_t p = (size_t)k * lw + lane;
        if (valid && p < packs) {
          xs[j][k] = reinterpret_cast<const Pack8<T>*>(in + off)[p];
          gs[j][k] = reinterpret_cast<const Pack8<T>*>(dy + off)[p];
        }
      }
    }
  };
  if (r0 < r1) load(r0, xv, gv, ms, ss);
  for (size_t base = r0; base < r1; base += step) {
    Pack8<T> xn[RPT][P], gn[RPT][P];
    float mn[RPT], sn[RPT], v[2 * RPT];
    if (base + step < r1) load(base + step, xn, gn, mn, sn);
#pragma unroll
    for (int j = 0; j < RPT; ++j) {
      const bool valid = base + (size_t)j * groups + g < r1;
      float sum_g = 0.f, sum_gx = 0.f;
#pragma unroll
      for (int k = 0; k < P; ++k)
        if (valid && (size_t)k * lw + lane < packs) norm_row_sums(xv[j][k], gv[j][k], wf[k], ms[j], sum_g, sum_gx);
      v[2 * j] = lane_group_sum(sum_g, lw);
      v[2 * j + 1] = lane_group_sum(sum_gx, lw);
    }
    if (wpg > 1) {
      if ((threadIdx.x & 31) == 0)
#pragma unroll
        for (int i = 0; i < 2 * RPT; ++i) red[buf][warp][i] = v[i];
      __syncthreads();
#pragma unroll
      for (int i = 0; i < 2 * RPT; ++i) v[i] = 0.f;
      for (int q = 0; q < wpg; ++q)
#pragma unroll
        for (int i = 0; i < 2 * RPT; ++i) v[i] += red[buf][g * wpg + q][i];
      buf ^= 1;
    }
#pragma unroll
    for (int j = 0; j < RPT; ++j) {
      const size_t r = base + (size_t)j * groups + g;
      if (r >= r1) continue;
      const float m = ms[j], s = ss[j];
      // sum(g xhat) = rstd sum(g (x - mean)), as norm_bwd_reg.
      const float a = rms ? 0.f : v[2 * j] / n, bq = v[2 * j + 1] * s / n;
      Pack8<T>* out = reinterpret_cast<Pack8<T>*>(dx + r * cols);
#pragma unroll
      for (int k = 0; k < P; ++k) {
        const size_t p = (size_t)k * lw + lane;
        if (p < packs) out[p] = norm_dx_sums(xv[j][k], gv[j][k], wf[k], m, s, a, bq, aw[k], ab[k]);
      }
    }
#pragma unroll
    for (int j = 0; j < RPT; ++j) {
      ms[j] = mn[j];
      ss[j] = sn[j];
#pragma unroll
      for (int k = 0; k < P; ++k) {
        xv[j][k] = xn[j][k];
        gv[j][k] = gn[j][k];
      }
    }
  }
  colsum_finish<P>(aw, ab, part + blockIdx.x * 2 * cols, part + (blockIdx.x * 2 + 1) * cols, packs, lw);
}

// ---- the parameter gradients alone, by column sweeps --------------------------------------
// Block (x: 256 columns, y: chunk p of rows); each thread sums its column over its chunk and
// writes two partials, part[(p * 2 + j) * cols + c]; fused.cu's sum_partials2 adds the chunks
// in a fixed order (deterministic).

// NormParamGrads: dw = sum_r dy xhat, db = sum_r dy over (rows, cols); mean unused for RMS.
template <typename T, typename S>
__device__ __forceinline__ void norm_param_grads(const T* __restrict__ x, const T* __restrict__ dy, const S* mean,
                                                 const S* rstd, double* part, size_t rows, size_t cols,
                                                 size_t chunk, int rms) {
  const size_t c = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
  if (c >= cols) return;
  const size_t p = blockIdx.y, r0 = p * chunk, r1 = min(rows, r0 + chunk);
  double sw = 0.0, sb = 0.0;
#pragma unroll 4
  for (size_t r = r0; r < r1; ++r) {
    const double g = to_f64(dy[r * cols + c]);
    const double xh = (to_f64(x[r * cols + c]) - (rms ? 0.0 : (double)mean[r])) * (double)rstd[r];
    sw += g * xh;
    sb += g;
  }
  part[(p * 2) * cols + c] = sw;
  part[(p * 2 + 1) * cols + c] = sb;
}

// The norm's sweep with eight columns a thread (cols % 8 == 0, 16-byte loads): a block is
// 32 column packs (256 columns) by 8 row groups, whose sums meet in shared memory, so one
// chunk writes one partial per column however many rows it has.
#define SWEEP_GROUPS 8
template <typename F>
__device__ __forceinline__ void sweep_combine(double (&a)[8], double (&b)[8], F write) {
  __shared__ double sh[2][SWEEP_GROUPS][32][8];
  const int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    sh[0][ty][tx][e] = a[e];
    sh[1][ty][tx][e] = b[e];
  }
  __syncthreads();
  if (ty == 0) {
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      double x = 0.0, y = 0.0;
      for (int k = 0; k < SWEEP_GROUPS; ++k) {
        x += sh[0][k][tx][e];
        y += sh[1][k][tx][e];
      }
      write(e, x, y);
    }
  }
}

template <typename T, typename S>
__device__ __forceinline__ void norm_param_grads_vec(const T* __restrict__ x, const T* __restrict__ dy,
                                                     const S* mean, const S* rstd, double* part, size_t rows,
                                                     size_t cols, size_t chunk, int rms) {
  const int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;
  const size_t c = (blockIdx.x * (size_t)32 + tx) * 8;
  const size_t p = blockIdx.y, r0 = p * chunk, r1 = min(rows, r0 + chunk);
  // Each thread's sums over its chunk / 8 rows (8 at Flux's 4608 rows) are float, as
  // PyTorch's are: widening every element to double made this sweep conversion-bound. The
  // groups and chunks meet in double.
  float fw[8] = {}, fb[8] = {};
  if (c < cols) {
    for (size_t r = r0 + ty; r < r1; r += SWEEP_GROUPS) {
      const Pack8<T> xv = *reinterpret_cast<const Pack8<T>*>(x + r * cols + c);
      const Pack8<T> gv = *reinterpret_cast<const Pack8<T>*>(dy + r * cols + c);
      const float m = rms ? 0.f : (float)mean[r], s = (float)rstd[r];
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const float g = to_acc(gv.v[e]);
        fw[e] += g * ((to_acc(xv.v[e]) - m) * s);
        fb[e] += g;
      }
    }
  }
  double sw[8], sb[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    sw[e] = fw[e];
    sb[e] = fb[e];
  }
  sweep_combine(sw, sb, [&](int e, double a, double b) {
    if (c < cols) {
      part[(p * 2) * cols + c + e] = a;
      part[(p * 2 + 1) * cols + c + e] = b;
    }
  });
}

// Must match `NormBackward`'s launcher in src/tensor/kernels/norm.rs: one pack a lane for rows
// up to 3072 columns, two up to 6144 and for half-type rows of 2049-3072 (at most 384 threads a
// block: 168 registers a thread, which two steps of rows in flight need; bounds that force more
// blocks a multiprocessor spill and measured 1.4-2.4x slower at 3072 columns).
#define NORM_BWD_PARAMS(SUF, T)                                                                            \
  extern "C" __global__ void __launch_bounds__(384) norm_bwd_params_1_##SUF(const T* x, const T* dy, const T* w, const float* mean, \
                                                     const float* rstd, T* dx, float* part, size_t rows,     \
                                                     size_t cols, size_t chunk, int lw, int rms) {           \
    norm_bwd_params<T, 1, 4>(x, dy, w, mean, rstd, dx, part, rows, cols, chunk, lw, rms);                   \
  }                                                                                                          \
  extern "C" __global__ void __launch_bounds__(384) norm_bwd_params_2_##SUF(const T* x, const T* dy, const T* w, const float* mean, \
                                                     const float* rstd, T* dx, float* part, size_t rows,     \
                                                     size_t cols, size_t chunk, int lw, int rms) {           \
    norm_bwd_params<T, 2, 2>(x, dy, w, mean, rstd, dx, part, rows, cols, chunk, lw, rms);                   \
  }
NORM_BWD_PARAMS(f32, float)
NORM_BWD_PARAMS(bf16, __nv_bfloat16)
NORM_BWD_PARAMS(f16, __half)

#define NORM_REG(SUF, T, P, L, R)                                                                             \
  extern "C" __global__ void norm_fwd_reg_##P##_##L##_##SUF(const T* x, const T* w, const T* b, T* y, float* mean, \
                                                            float* rstd, size_t rows, size_t cols, double eps,  \
                                                            int rms, RowMap xm) {                               \
    norm_fwd_reg<T, P, L, R>(x, w, b, y, mean, rstd, rows, cols, eps, rms, xm);                                 \
  }                                                                                                             \
  extern "C" __global__ void norm_bwd_reg_##P##_##L##_##SUF(const T* x, const T* dy, const T* w,               \
                                                            const float* mean, const float* rstd, T* dx,        \
                                                            size_t rows, size_t cols, int rms, RowMap xm) {     \
    norm_bwd_reg<T, P, L, R>(x, dy, w, mean, rstd, dx, rows, cols, rms, xm);                                    \
  }                                                                                                             \
  extern "C" __global__ void norm_bwd_sums_##P##_##L##_##SUF(const T* x, const T* dy, const T* w,              \
                                                             const float* mean, const float* rstd, T* dx,       \
                                                             float* part, size_t rows, size_t cols, int rms) {  \
    norm_bwd_reg<T, P, L, R, true>(x, dy, w, mean, rstd, dx, rows, cols, rms, dense_rows(cols), part);        \
  }
// Must match `reg_shape` in src/backend/cuda/norm.rs: rows of up to 256 columns take 4 rows
// a group at once, of 512 two; longer rows one, with up to 12 packs a lane (3072 columns).
#define NORM_REG_SHORT(SUF, T) \
  NORM_REG(SUF, T, 1, 4, 4)      \
  NORM_REG(SUF, T, 1, 8, 4)      \
  NORM_REG(SUF, T, 1, 16, 4)     \
  NORM_REG(SUF, T, 1, 32, 4)     \
  NORM_REG(SUF, T, 2, 32, 2)     \
  NORM_REG(SUF, T, 4, 32, 1)
#define NORM_REG_LONG(SUF, T) \
  NORM_REG(SUF, T, 8, 32, 1)    \
  NORM_REG(SUF, T, 12, 32, 1)
NORM_REG_SHORT(f32, float)
NORM_REG_SHORT(bf16, __nv_bfloat16)
NORM_REG_LONG(bf16, __nv_bfloat16)
NORM_REG_SHORT(f16, __half)
NORM_REG_LONG(f16, __half)

#define NORM(SUF, T, S)                                                                                  \
  extern "C" __global__ void norm_fwd_##SUF(const T* x, const T* w, const T* b, T* y, S* mean, S* rstd,   \
                                            size_t rows, size_t cols, double eps, int rms, RowMap xm) {  \
    norm_fwd<T, S>(x, w, b, y, mean, rstd, rows, cols, eps, rms, xm);                                    \
  }                                                                                                      \
  extern "C" __global__ void norm_bwd_##SUF(const T* x, const T* dy, const T* w, const S* mean,           \
                                            const S* rstd, T* dx, size_t rows, size_t cols, int rms,     \
                                            RowMap xm) {                                                 \
    norm_bwd<T, S>(x, dy, w, mean, rstd, dx, rows, cols, rms, xm);                                       \
  }
NORM(f32, float, float)
NORM(f64, double, double)
NORM(bf16, __nv_bfloat16, float)
NORM(f16, __half, float)

#define NORM_PARAM_GRADS(SUF, T, S_)                                                                          \
  extern "C" __global__ void norm_param_grads_##SUF(const T* x, const T* dy, const S_* mean, const S_* rstd,   \
                                                    double* part, size_t rows, size_t cols, size_t chunk,      \
                                                    int rms) {                                                 \
    norm_param_grads<T, S_>(x, dy, mean, rstd, part, rows, cols, chunk, rms);                                  \
  }                                                                                                            \
  extern "C" __global__ void norm_param_grads_vec_##SUF(const T* x, const T* dy, const S_* mean,                \
                                                        const S_* rstd, double* part, size_t rows, size_t cols,   \
                                                        size_t chunk, int rms) {                                  \
    norm_param_grads_vec<T, S_>(x, dy, mean, rstd, part, rows, cols, chunk, rms);                                 \
  }
NORM_PARAM_GRADS(f32, float, float)
NORM_PARAM_GRADS(f64, double, double)
NORM_PARAM_GRADS(bf16, __nv_bfloat16, float)
NORM_PARAM_GRADS(f16, __half, float)
