// Times FLAME's row and layer kernels directly (no Rust, no tensor layer) at the shapes of
// benches/layers.rs, with CUDA events: the median of 5 runs of 50 launches after a warm-up,
// against cudaMemcpyAsync on the same buffer. For kernel work on the GPU machine, where a
// change can be timed in seconds without rebuilding the crate:
//   bash scripts/kernel_bench.sh        (compiles with the machine's nvcc for sm_90, runs)
// The launch shapes follow the launchers in src/backend/cuda (norm.rs, storage.rs' softmax,
// fused.rs, conv.rs) and src/tensor/kernels (norm.rs, softmax.rs, modulate.rs, group_norm.rs);
// keep them in step when a launcher changes. Inputs are random, never zero.
#include <algorithm>
#include <cstdio>
#include <functional>
#include <vector>

#include "conv.cu"
#include "fused.cu"
#include "group_norm.cu"
#include "norm.cu"
#include "norm_bulk.cu"
#include "softmax.cu"

typedef __nv_bfloat16 bf;
#define CK(x)                                                               \
  do {                                                                      \
    cudaError_t e = (x);                                                    \
    if (e != cudaSuccess) {                                                 \
      printf("CUDA error %s at line %d\n", cudaGetErrorString(e), __LINE__); \
      exit(1);                                                              \
    }                                                                       \
  } while (0)

static float time_ms(const std::function<void()>& f, int iters = 50) {
  for (int i = 0; i < 5; ++i) f();
  CK(cudaDeviceSynchronize());
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  std::vector<float> ts;
  for (int rep = 0; rep < 5; ++rep) {
    CK(cudaEventRecord(a));
    for (int i = 0; i < iters; ++i) f();
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    float ms;
    CK(cudaEventElapsedTime(&ms, a, b));
    ts.push_back(ms / iters);
  }
  CK(cudaGetLastError());
  std::sort(ts.begin(), ts.end());
  return ts[2];
}

__global__ void fill_random(bf* p, size_t n, unsigned seed, float scale, float offset) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    unsigned h = (unsigned)i * 2654435761u ^ seed;
    h ^= h >> 13;
    h *= 0x5bd1e995;
    h ^= h >> 15;
    p[i] = __float2bfloat16(((h & 0xffff) / 65536.f - 0.5f) * scale + offset);
  }
}

static bf* random_bf16(size_t n, unsigned seed, float scale = 4.f, float offset = 0.f) {
  bf* p;
  CK(cudaMalloc(&p, n * 2));
  fill_random<<<1024, 256>>>(p, n, seed, scale, offset);
  return p;
}

static double copy_gbs;
static void report(const char* name, double bytes, float ms) {
  const double gbs = bytes / (ms * 1e-3) / 1e9;
  printf("%-34s %8.4f ms %7.0f GB/s %6.1f%% of copy\n", name, ms, gbs, 100 * gbs / copy_gbs);
}

// dx, dw, db of the last norm_bwd_bulk launch against a double reference on the host (from the
// same x, dy, w and saved statistics).
static void check_bulk(size_t R, size_t C, bf* x, bf* dy, bf* w, float* mean, float* rstd, bf* dx, bf* dw, bf* db,
                       int rms) {
  std::vector<bf> hx(R * C), hg(R * C), hdx(R * C), hw(C), hdw(C), hdb(C);
  std::vector<float> hm(R), hs(R);
  CK(cudaMemcpy(hx.data(), x, R * C * 2, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(hg.data(), dy, R * C * 2, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(hdx.data(), dx, R * C * 2, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(hw.data(), w, C * 2, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(hdw.data(), dw, C * 2, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(hdb.data(), db, C * 2, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(hm.data(), mean, R * 4, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(hs.data(), rstd, R * 4, cudaMemcpyDeviceToHost));
  auto f = [](bf v) { return (double)__bfloat162float(v); };
  std::vector<double> sw(C, 0), sb(C, 0);
  double dx_err = 0, dx_max = 0;
  for (size_t r = 0; r < R; ++r) {
    const double m = rms ? 0 : hm[r], s = hs[r];
    double a = 0, b = 0;
    for (size_t c = 0; c < C; ++c) {
      const double g = f(hg[r * C + c]) * f(hw[c]), xh = (f(hx[r * C + c]) - m) * s;
      a += g, b += g * xh;
      sw[c] += f(hg[r * C + c]) * xh, sb[c] += f(hg[r * C + c]);
    }
    a = rms ? 0 : a / C, b /= C;
    for (size_t c = 0; c < C; ++c) {
      const double g = f(hg[r * C + c]) * f(hw[c]), xh = (f(hx[r * C + c]) - m) * s;
      const double want = s * (g - a - xh * b), d = fabs(want - f(hdx[r * C + c]));
      if (!(d <= dx_err)) dx_err = d;
      dx_max = std::max(dx_max, fabs(want));
    }
  }
  double w_err = 0, w_max = 0;
  for (size_t c = 0; c < C; ++c) {
    const double d = std::max(fabs(sw[c] - f(hdw[c])), fabs(sb[c] - f(hdb[c])));
    if (!(d <= w_err)) w_err = d;
    w_max = std::max(w_max, std::max(fabs(sw[c]), fabs(sb[c])));
  }
  printf("  bulk vs host double: dx max |diff| %.3g of max %.3g; dw, db max |diff| %.3g of max %.3g\n", dx_err, dx_max,
         w_err, w_max);
}

// Times norm_bwd_bulk at (rows, cols) for a few (packs a lane, stages, blocks a multiprocessor),
// after checking each instance's dx, dw and db against a double reference on the host. (norm.rs
// launch_bwd_bulk picks one pack a lane up to 384 packs and about 96 KiB of stages a
// multiprocessor.)
static void bulk_rows(size_t R, size_t C, double bytes, const char* what, bf* x, bf* dy, bf* w, float* mean,
                      float* rstd, bf* dx, float* part, bf* dwp, bf* dbp, unsigned* zero, int rms) {
  int sms;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const size_t packs = C / 8;
  for (int P : {1, 2}) {  // two rows a group a stage (norm_bulk.cu's instances)
    bool checked = false;
    const int rpt = 2;
    if ((P == 1 && packs > 384) || (P == 2 && (packs <= 192 || packs > 768))) continue;
    auto k = P == 1 ? norm_bwd_bulk_1_bf16 : norm_bwd_bulk_2_bf16;
    const size_t lanes = (packs + P - 1) / P;
    const int lw = (int)(lanes < 32 ? std::max<size_t>(4, lanes) : (lanes + 31) / 32 * 32);
    const int groups = std::max(1, 256 / lw), threads = groups * lw;
    const size_t stage = 2 * (size_t)groups * rpt * C * 2;
    for (int per_sm : {1, 2, 3}) {
      for (int stages : {2, 3, 4}) {
        const size_t smem = BULK_BARRIERS + std::max<size_t>(stages * stage, 12 * 32 * 32);
        if (smem * per_sm > 220 * 1024) continue;
        CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
        int res = 0;
        CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&res, k, threads, smem));
        if (res < per_sm) continue;
        const size_t srows = (size_t)groups * rpt;
        const size_t nb = std::min<size_t>((size_t)sms * per_sm, (R + srows - 1) / srows);
        const size_t chunk = (R + nb - 1) / nb;
        const unsigned g = (unsigned)((R + chunk - 1) / chunk);
        auto run = [&] {
          k<<<g, threads, smem>>>(x, dy, w, mean, rstd, dx, part, dwp, dbp, zero, R, C, chunk, lw, stages, rms);
        };
        run();
        CK(cudaDeviceSynchronize());
        if (!checked) {
          check_bulk(R, C, x, dy, w, mean, rstd, dx, dwp, dbp, rms);
          checked = true;
        }
        char name[96];
        snprintf(name, sizeof name, "%s P%d R%d s%d b%d", what, P, rpt, stages, per_sm);
        report(name, bytes, time_ms(run));
      }
    }
  }
}

int main() {
  int sms;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const size_t R = 4608, C = 3072, N = R * C;  // Flux: 4608 tokens x 3072, bf16
  bf *x = random_bf16(N, 1, 6.f, 1.f), *dy = random_bf16(N, 2), *y = random_bf16(N, 3), *dx = random_bf16(N, 4);
  bf *w = random_bf16(C, 5), *b = random_bf16(C, 6);
  float *mean, *rstd;
  CK(cudaMalloc(&mean, 4 * (N / 128)));
  CK(cudaMalloc(&rstd, 4 * (N / 128)));
  copy_gbs = 2.0 * N * 2 / (time_ms([&] { cudaMemcpyAsync(y, x, N * 2, cudaMemcpyDeviceToDevice); }) * 1e-3) / 1e9;
  printf("copy %.0f GB/s, %d SMs\n", copy_gbs, sms);
  const double B = N * 2.0;
  // A block per `per_block` rows, at most 32 blocks a multiprocessor (the launchers' cap).
  auto blocks = [&](size_t rows, size_t per_block) {
    return (unsigned)std::min<size_t>(std::max<size_t>(1, (rows + per_block - 1) / per_block), (size_t)sms * 32);
  };

  // LayerNorm, 12 packs a lane, 128 threads (norm.rs); weight and bias staged in shared memory.
  const unsigned ln = blocks(R, 4);
  report("layer_norm fwd", 2 * B, time_ms([&] { norm_fwd_reg_12_32_bf16<<<ln, 128, 4 * C>>>(x, nullptr, nullptr, y, mean, rstd, R, C, 1e-6, 0); }));
  report("layer_norm fwd affine", 2 * B, time_ms([&] { norm_fwd_reg_12_32_bf16<<<ln, 128, 4 * C>>>(x, w, b, y, mean, rstd, R, C, 1e-6, 0); }));
  report("layer_norm bwd", 3 * B, time_ms([&] { norm_bwd_reg_12_32_bf16<<<ln, 128, 4 * C>>>(x, dy, nullptr, mean, rstd, dx, R, C, 0); }));
  report("layer_norm bwd affine", 3 * B, time_ms([&] { norm_bwd_reg_12_32_bf16<<<ln, 128, 4 * C>>>(x, dy, w, mean, rstd, dx, R, C, 0); }));
  {  // With dw and db (full fine-tuning): the partial rows of the two sums, before sum_partials2f.
    // Register-resident rows with per-lane-group sums in shared memory (norm.rs launch_bwd_sums,
    // which tensor/kernels/norm.rs no longer picks at 3072 columns in half types):
    const size_t sm_bytes = 2 * C * 2 + 4 * 2 * (2 * 12 * 32) * 16;
    CK(cudaFuncSetAttribute(norm_bwd_sums_12_32_bf16, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)sm_bytes));
    int res = 0;
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&res, norm_bwd_sums_12_32_bf16, 128, sm_bytes));
    const unsigned nb = (unsigned)std::min<size_t>(R / 4, (size_t)sms * res);
    float* part;
    CK(cudaMalloc(&part, (size_t)sms * 8 * 2 * C * 4));
    report("layer_norm bwd dw db, lane sums", 3 * B, time_ms([&] {
             norm_bwd_sums_12_32_bf16<<<nb, 128, sm_bytes>>>(x, dy, w, mean, rstd, dx, part, R, C, 0);
           }));
    // Row blocks with the sums in registers (fused.rs colsum_shape): one or two packs a lane,
    // then the partial rows' sum (sum_partials2f, as fused.rs sum_parts launches it).
    bf *dwp, *dbp;
    CK(cudaMalloc(&dwp, C * 2));
    CK(cudaMalloc(&dbp, C * 2));
    double* scratch;
    CK(cudaMalloc(&scratch, (size_t)16 * 2 * C * 8));
    unsigned* zero;
    CK(cudaMalloc(&zero, 4096 * 4));
    CK(cudaMemset(zero, 0, 4096 * 4));
    auto parts_ms = [&](size_t parts) {
      const size_t tiles = C / 32, slices = std::max<size_t>(1, std::min((2 * (size_t)sms + tiles - 1) / tiles, parts / 32));
      return time_ms([&] {
        sum_partials2f_bf16<<<dim3((unsigned)tiles, (unsigned)slices), 1024>>>(part, parts, C, dwp, dbp, scratch, zero);
      });
    };
    printf("  (their partial rows summed: %.4f ms for %u rows)\n", parts_ms(nb), nb);
    for (int P : {1, 2}) {  // the production kernels: at most two blocks a multiprocessor
      auto k = P == 1 ? norm_bwd_params_1_bf16 : norm_bwd_params_2_bf16;
      const int lw = (int)(C / 8 / P), step = P == 1 ? 4 : 2;
      CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&res, k, lw, 0));
      const size_t blocks = std::min<size_t>((size_t)sms * std::min(res, 2), (R + step - 1) / step);
      const size_t chunk = ((R + blocks - 1) / blocks + step - 1) / step * step;
      const unsigned g = (unsigned)((R + chunk - 1) / chunk);
      char name[64];
      snprintf(name, sizeof name, "layer_norm bwd dw db, row blocks P%d", P);
      report(name, 3 * B, time_ms([&] { k<<<g, lw>>>(x, dy, w, mean, rstd, dx, part, R, C, chunk, lw, 0); }));
      printf("  (%u blocks of %d threads, %d resident a multiprocessor; their partial rows summed: %.4f ms)\n", g, lw,
             res, parts_ms(g));
    }
    // Hopper: rows brought in by bulk copies, the partial rows added after a grid-wide barrier
    // in the same kernel (norm_bulk.cu; tensor/kernels/norm.rs picks it on compute capability 9).
    bulk_rows(R, C, 3 * B, "layer_norm bwd dw db, bulk", x, dy, w, mean, rstd, dx, part, dwp, dbp, zero, 0);
    CK(cudaFree(dwp));
    CK(cudaFree(dbp));
    CK(cudaFree(scratch));
    CK(cudaFree(zero));
    CK(cudaFree(part));
  }

  // RMSNorm over head dim 128 (1, 24, 4608, 128): 16 lanes a row, 4 rows at once.
  const size_t r2 = N / 128;
  const unsigned rms = blocks(r2, 128 / 16 * 4);
  report("rms_norm 128 fwd", 2 * B, time_ms([&] { norm_fwd_reg_1_16_bf16<<<rms, 128, 512>>>(x, w, nullptr, y, mean, rstd, r2, 128, 1e-6, 1); }));
  report("rms_norm 128 bwd", 3 * B, time_ms([&] { norm_bwd_reg_1_16_bf16<<<rms, 128, 512>>>(x, dy, w, mean, rstd, dx, r2, 128, 1); }));
  {  // With dw: lane sums in shared memory (norm.rs launch_bwd_sums) + sum_partials2f, against the bulk kernel.
    const size_t sm_bytes = 2 * 128 * 2 + 8 * 2 * (2 * 1 * 16) * 16;
    CK(cudaFuncSetAttribute(norm_bwd_sums_1_16_bf16, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)sm_bytes));
    int res = 0;
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&res, norm_bwd_sums_1_16_bf16, 128, sm_bytes));
    const unsigned nb = (unsigned)std::min<size_t>(r2 / 32, (size_t)sms * res);
    float* part;
    CK(cudaMalloc(&part, (size_t)nb * 2 * 128 * 4 + (size_t)sms * 4 * 2 * 128 * 4));
    bf *dwp, *dbp;
    CK(cudaMalloc(&dwp, 128 * 2));
    CK(cudaMalloc(&dbp, 128 * 2));
    double* scratch;
    CK(cudaMalloc(&scratch, (size_t)64 * 2 * 128 * 8));
    unsigned* zero;
    CK(cudaMalloc(&zero, 4096 * 4));
    CK(cudaMemset(zero, 0, 4096 * 4));
    const size_t slices = std::max<size_t>(1, std::min((2 * (size_t)sms + 3) / 4, (size_t)nb / 32));
    report("rms_norm 128 bwd dw, lane sums+sum", 3 * B, time_ms([&] {
             norm_bwd_sums_1_16_bf16<<<nb, 128, sm_bytes>>>(x, dy, w, mean, rstd, dx, part, r2, 128, 1);
             sum_partials2f_bf16<<<dim3(4, (unsigned)slices), 1024>>>(part, nb, 128, dwp, dbp, scratch, zero);
           }));
    bulk_rows(r2, 128, 3 * B, "rms_norm 128 bwd dw, bulk", x, dy, w, mean, rstd, dx, part, dwp, dbp, zero, 1);
    CK(cudaFree(part));
    CK(cudaFree(dwp));
    CK(cudaFree(dbp));
    CK(cudaFree(scratch));
    CK(cudaFree(zero));
  }

  // Softmax over 3072: a warp per row, 12 packs a lane, 128 threads.
  const unsigned sm = blocks(R, 4);
  report("softmax fwd", 2 * B, time_ms([&] { softmax_reg12_bf16<<<sm, 128>>>(x, y, R, C); }));
  report("softmax bwd", 3 * B, time_ms([&] { softmax_bwd_reg12_bf16<<<sm, 128>>>(y, dy, dx, R, C); }));

  // GroupNorm, SDXL's 2 x 320 x 128 x 128 in 32 groups: statistics, then apply (tensor/kernels/group_norm.rs).
  {
    const size_t n = 2, c = 320, s = 128 * 128, planes = n * c, cpg = 10;
    const double GB = planes * s * 2.0;
    double* st;
    CK(cudaMalloc(&st, planes * 2 * 8));
    bf *dw, *db;  // the one-pass backward's parameter gradients, and its zeroed completion count
    CK(cudaMalloc(&dw, c * 2));
    CK(cudaMalloc(&db, c * 2));
    // The completion counters: the staggered start's gate (a u64), then one count per group index.
    unsigned* done;
    CK(cudaMalloc(&done, 4 * 64));
    CK(cudaMemset(done, 0, 4 * 64));
    unsigned long long* gate = reinterpret_cast<unsigned long long*>(done);
    const uint32_t late = n * 32 / 2;  // the launcher's choice when all 64 clusters are resident
    report("group_norm fwd", 2 * GB, time_ms([&] {
             gn_stats_bf16<<<planes, 256>>>(x, st, s);
             gn_fwd_bf16<<<planes, 256>>>(x, st, w, b, y, mean, rstd, c, s, cpg, 1e-5);
           }));
    const size_t chunk_bytes = c * s / 32 / 8 * 2;  // a group's eighth, bf16
    {  // the one-pass kernel against the two-kernel path, on the same input
      std::vector<bf> a(planes * s), bb(planes * s);
      gn_stats_bf16<<<planes, 256>>>(x, st, s);
      gn_fwd_bf16<<<planes, 256>>>(x, st, w, b, y, mean, rstd, c, s, cpg, 1e-5);
      CK(cudaMemcpy(a.data(), y, planes * s * 2, cudaMemcpyDeviceToHost));
      CK(cudaMemset(y, 0xff, planes * s * 2));
      gn_fwd_cluster_bf16<<<n * 32 * 8, 256, chunk_bytes>>>(x, w, b, y, mean, rstd, c, s, cpg, 1e-5f, gate, late);
      CK(cudaGetLastError());
      CK(cudaMemcpy(bb.data(), y, planes * s * 2, cudaMemcpyDeviceToHost));
      double worst = 0;
      for (size_t i = 0; i < a.size(); ++i) {
        const double d = fabsf(__bfloat162float(a[i]) - __bfloat162float(bb[i]));
        if (!(d <= worst)) worst = d;  // keeps a NaN
      }
      printf("group_norm one pass vs two kernels: max |diff| %.3g (NaN if unwritten)\n", worst);
    }
    report("group_norm fwd, one pass (sm_90)", 2 * GB, time_ms([&] {
             gn_fwd_cluster_bf16<<<n * 32 * 8, 256, chunk_bytes>>>(x, w, b, y, mean, rstd, c, s, cpg, 1e-5f, gate, late);
           }));
    report("group_norm bwd (dx)", 3 * GB, time_ms([&] {
             gn_bwd_stats_bf16<<<planes, 256>>>(x, dy, mean, st, c, s, cpg);
             gn_bwd_dx_bf16<<<planes, 256>>>(x, dy, st, mean, rstd, w, dx, c, s, cpg);
           }));
    {  // the one-pass backward against the two kernels: dx and the per-plane sums
      std::vector<bf> a(planes * s), bb(planes * s);
      std::vector<double> sa(2 * planes), sb(2 * planes);
      gn_bwd_stats_bf16<<<planes, 256>>>(x, dy, mean, st, c, s, cpg);
      gn_bwd_dx_bf16<<<planes, 256>>>(x, dy, st, mean, rstd, w, dx, c, s, cpg);
      CK(cudaMemcpy(a.data(), dx, planes * s * 2, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(sa.data(), st, planes * 16, cudaMemcpyDeviceToHost));
      CK(cudaMemset(dx, 0xff, planes * s * 2));
      CK(cudaMemset(st, 0xff, planes * 16));
      gn_bwd_cluster_bf16<<<n * 32 * 8, 256, chunk_bytes>>>(x, dy, mean, rstd, w, dx, st, dw, db, done + 2, n, c, s, cpg,
                                                          gate, late);
      CK(cudaGetLastError());
      CK(cudaMemcpy(bb.data(), dx, planes * s * 2, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(sb.data(), st, planes * 16, cudaMemcpyDeviceToHost));
      double worst = 0, scale = 0, sworst = 0;
      for (size_t i = 0; i < a.size(); ++i) {
        const double d = fabsf(__bfloat162float(a[i]) - __bfloat162float(bb[i]));
        if (!(d <= worst)) worst = d;
        scale = std::max(scale, (double)fabsf(__bfloat162float(a[i])));
      }
      for (size_t i = 0; i < sa.size(); ++i) {
        const double d = fabs(sa[i] - sb[i]) / (1 + fabs(sa[i]));
        if (!(d <= sworst)) sworst = d;
      }
      printf("group_norm bwd one pass vs two kernels: dx max |diff| %.3g of max |dx| %.3g, sums rel %.3g\n", worst,
             scale, sworst);
    }
    report("group_norm bwd, one pass (sm_90)", 3 * GB, time_ms([&] {
             gn_bwd_cluster_bf16<<<n * 32 * 8, 256, chunk_bytes>>>(x, dy, mean, rstd, w, dx, st, dw, db, done + 2, n, c, s, cpg,
                                                          gate, late);
           }));
    CK(cudaFree(st));
  }

  // RoPE (1, 24, 4608, 128) with Flux's (1, 1, 4608, 64, 2, 2) float rotations.
  {
    float* rot;
    CK(cudaMalloc(&rot, 4608 * 64 * 16));
    CK(cudaMemset(rot, 0x3f, 4608 * 64 * 16));
    const size_t pairs = N / 2, items = pairs / 4 / 24 * 6;
    report("apply_rope fwd", 2 * B, time_ms([&] { rope_vec_bf16<<<blocks(items, 256), 256>>>(x, rot, y, 24, 4608, 64, 1, pairs, 0); }));
    CK(cudaFree(rot));
  }

  // col2im / im2col of a 3x3 convolution, 320 channels at 128 x 128, batch 2 (conv.rs).
  {
    ConvGeometry g{640, 128, 128, 3, 3, 1, 1, 1, 1, 1, 1, 128, 128};
    const size_t ncols = 640ull * 9 * 16384;
    bf* cols = random_bf16(ncols, 7);
    const double moved = (ncols + 640.0 * 16384) * 2;
    report("col2im 3x3", moved, time_ms([&] { col2im_bf16<<<dim3(64, 640), 256>>>(cols, dx, g, 0); }, 20));
    const unsigned gx = std::min<unsigned>(8, (sms * 64 + 5759) / 5760);
    report("im2col 3x3", moved, time_ms([&] { im2col_bf16<<<dim3(gx, 5760), 256>>>(x, cols, g, 0); }, 20));
    CK(cudaFree(cols));
  }
  return 0;
}
