// Flash attention on Hopper (sm_90a): the forward and backward of attention.cu with the
// products on warpgroup MMA (wgmma.mma_async, cuda/wgmma.cuh) instead of mma.sync, after
// FlashAttention-3 (Shah et al. 2024, arXiv:2407.08608): operands read by the tensor cores
// straight from shared memory in the 128-byte-swizzled layout wgmma defines, probabilities
// fed from registers, products issued asynchronously so the softmax and the gradient algebra
// of one warpgroup run while its next product is in flight and the other warpgroups compute.
// Both kernels are warp-specialised: producer warps (registers given away with setmaxnreg)
// load the tiles and, in the backward, write dQ; consumer warpgroups do the products.
//
// Same parameters, masks (key padding, causal with key j visible to query i iff j <= i),
// strided q/k/v/o/do views, outputs and dq accumulator as attention.cu; head dims 64 and 128,
// bf16/f16. Built only for compute_90a (build.rs), used on compute capability 9.0. Tiles
// are loaded by the tensor memory accelerator (TMA: one thread issues a tile, an mbarrier
// counts its bytes in), which writes them in the swizzled layout below and zero-fills rows
// past the sequence.
//
// Tiles: R rows of D elements are stored as D / 64 column chunks of 64 elements (128 bytes
// per row); chunk c at c R 128 bytes, row r at r 128, its 16-byte unit u at u ^ (r % 8)
// (PTX ISA, "Shared Memory Matrix Layout", 128B swizzle; the tile base is 1024-aligned).
// Read with rows as M or N and columns as k it is a K-major operand: 8 rows apart by 1024
// bytes (the stride offset), the k16 step kk at chunk kk / 4, byte 32 (kk % 4). Read with
// rows as k it is an MN-major operand (transposed): 64 columns to a 128-byte row, chunks
// apart by R 128 bytes (the leading offset), 8 rows apart by 1024 bytes.
#include "attention.cuh"
#include "wgmma.cuh"


// Byte offset of 16-byte unit c of row r in a tile of R rows.
template <int R> __device__ __forceinline__ uint32_t sw128(int r, int c) {
  return (uint32_t)((c >> 3) * (R * 128) + r * 128 + (((c & 7) ^ (r & 7)) << 4));
}

// A TMA descriptor (CUtensorMap, made by the launcher with cuTensorMapEncodeTiled) of one
// operand: 4-d, D then the row, head and batch dims in the order `tma_tile` is told, boxes of
// 64 columns x the tile's rows, 128-byte swizzle (the layout above), rows past L read as zeros.
struct alignas(64) TmaMap {
  uint64_t v[16];
};

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// Makes the initialised barriers visible to the async proxy (TMA).
__device__ __forceinline__ void mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
// Arms `bar` for `bytes` of TMA transfers (one arrival: the issuing thread's).
__device__ __forceinline__ void mbar_expect(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// Waits for the completion of `bar`'s phase `phase` (0, 1, 0, ... for its uses in order).
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t phase) {
  uint32_t done;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(phase)
        : "memory");
  } while (!done);
}
// Rows [row, row + R) of head (b, h) into a tile of R rows: D / 64 boxes, completing on bar.
// The descriptor's dims 1-3 are row, head and batch in the order the launcher chose (by
// stride); `order` (AttnParams::tma_order for this operand) says where each goes: 2 bits
// each, row, head, batch.
template <int R, int D>
__device__ __forceinline__ void tma_tile(uint32_t tile, const TmaMap& m, uint32_t bar, int row, int h, int b,
                                         uint32_t order) {
  const uint32_t pr = order & 3, ph = (order >> 2) & 3;
  int x[3];
#pragma unroll
  for (int i = 0; i < 3; ++i) x[i] = pr == (uint32_t)i ? row : (ph == (uint32_t)i ? h : b);
#pragma unroll
  for (int c = 0; c < D / 64; ++c)
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], "
        "[%6];\n" ::"r"(tile + c * R * 128),
        "l"(reinterpret_cast<uint64_t>(&m)), "r"(c * 64), "r"(x[0]), "r"(x[1]), "r"(x[2]), "r"(bar)
        : "memory");
}

// K-major operand: rows [row0, row0 + 64 or N) of a tile of R rows, k16 step kk.
template <int R> __device__ __forceinline__ uint64_t kmajor(uint32_t tile, int row0, int kk) {
  return sw128_desc(tile + (kk >> 2) * (R * 128) + row0 * 128 + (kk & 3) * 32, 16, 1024);
}
// MN-major operand: tile rows [k0, k0 + 16) as k, columns from chunk c0 on as M or N.
template <int R> __device__ __forceinline__ uint64_t mnmajor(uint32_t tile, int k0, int c0) {
  return sw128_desc(tile + c0 * (R * 128) + k0 * 128, R * 128, 1024);
}

template <int N> __device__ __forceinline__ void pin_regs(uint32_t (&a)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(a[i][e])::"memory");
}

template <int NB> __device__ __forceinline__ void zero(float (&d)[NB][4]) {
#pragma unroll
  for (int i = 0; i < NB; ++i) d[i][0] = d[i][1] = d[i][2] = d[i][3] = 0.f;
}

// The m64nN accumulator of probabilities (or dS) as A fragments of N / 16 k16 steps.
template <typename T, int NB>
__device__ __forceinline__ void to_a(const float (&s)[NB][4], uint32_t (&a)[NB / 2][4]) {
#pragma unroll
  for (int kk = 0; kk < NB / 2; ++kk) {
    a[kk][0] = pack2<T>(s[2 * kk][0], s[2 * kk][1]);
    a[kk][1] = pack2<T>(s[2 * kk][2], s[2 * kk][3]);
    a[kk][2] = pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
    a[kk][3] = pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
  }
}

// ----- forward ------------------------------------------------------------------------------
// Warp-specialised, after FlashAttention-3 (arXiv:2407.08608, sections 3.1-3.2): a block takes
// 64 NC queries of one (b, h) and has NC + 1 warpgroups. Warpgroup 0 is the producer: it gives
// its registers away (setmaxnreg) and one thread loads each tile's Q and the K and V tiles of
// 128 keys into ST stages by TMA, each stage freed by an mbarrier the consumers arrive at. The NC
// consumer warpgroups own 64 queries each. Per key tile j a consumer issues S_j = Q K_j^T
// (SS) and O += P_{j-1} V_{j-1} (RS, P from registers, V read transposed), then runs the
// online softmax of S_j while PV_{j-1} is in flight (intra-warpgroup overlap). The consumers
// take turns issuing their products (a ring of named barriers, "ping-pong"): the tensor cores
// run one warpgroup's products while the others do their softmax.
template <int D, int NC_> struct FwdCfg {
  static constexpr int NC = NC_;  // consumer warpgroups
  static constexpr int BR = 64 * NC, BC = 128, ST = 2;
  static constexpr int THREADS = 128 * (NC + 1);
  // Registers a thread after setmaxnreg (multiples of 8; 65536 in all).
  static constexpr int PRODUCER_REGS = 24, CONSUMER_REGS = NC == 2 ? 240 : 160;
};

__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

template <typename T, int D, int NC_>
__device__ __forceinline__ void attnw_fwd(const AttnParams& p, const TmaMap& tq, const TmaMap& tk, const TmaMap& tv) {
  using C = FwdCfg<D, NC_>;
  constexpr int NC = C::NC, BR = C::BR, BC = C::BC, ST = C::ST, NB = D / 8;
  extern __shared__ __align__(128) unsigned char smem[];
  constexpr int KV = BC * D * 2;
  // One Q buffer (two, the next tile's Q loading under this one, measured no faster on an
  // H100: 227 against 223 TFLOP/s at B 16, H 32, L 1024, D 64, causal), ST stages of K and V
  // (three at D = 64 measured the same as two).
  const uint32_t sQ = (smem_u32(smem) + 1023) & ~1023u;
  const uint32_t sK0 = sQ + BR * D * 2;  // K stage s at sK0 + s KV
  const uint32_t sV0 = sK0 + ST * KV;    // V stage s at sV0 + s KV
  // Barriers: Q full; K full, V full, K empty, V empty, ST each; Q empty.
  const uint32_t fullQ = sV0 + ST * KV;
  auto fullK = [&](int s) { return fullQ + 8 + 8 * s; };
  auto fullV = [&](int s) { return fullQ + 8 + 8 * (ST + s); };
  auto emptyK = [&](int s) { return fullQ + 8 + 8 * (2 * ST + s); };
  auto emptyV = [&](int s) { return fullQ + 8 + 8 * (3 * ST + s); };
  const uint32_t emptyQ = fullQ + 8 + 8 * 4 * ST;
  // The tile the block works on next, from the producer (written before it arms Q's barrier,
  // read by the consumers once that phase completes); ntiles or more: no tile left.
  volatile int* next_tile = reinterpret_cast<volatile int*>(smem + (emptyQ + 8 - smem_u32(smem)));
  const int tid = threadIdx.x, wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
  // The work: nq query blocks of BR rows for each of the B H heads, numbered in groups of
  // p.head_group heads (their K and V fit in L2 together), within a group by query block,
  // causal ones with the most keys first, the group's heads side by side. All heads' heaviest
  // blocks first ran a causal L 1024, D 128 at 252 TFLOP/s against 306 on an H100 (the K/V
  // of 132 heads at once thrash L2); head_group 1 puts a head's blocks side by side. One tile
  // per block of a full grid, or several per block of a persistent grid (fewer blocks than
  // tiles): tile t, t + G, ... for G blocks, or, with p.tile_counter, block b's first tile b
  // and then G + the counter's next value (the first block free takes the next tile, which
  // keeps causal tiles of unequal length balanced). The next tile's Q and first K/V tiles
  // load while this one's output is written.
  const int nq = (p.Lq + BR - 1) / BR, BH = p.B * p.H, ntiles = nq * BH;
  const int G = gridDim.x * gridDim.y, t0 = blockIdx.x + gridDim.x * blockIdx.y;
  struct Tile {
    int q0, bh, nkt;
  };
  auto tile = [&](int t) {
    const int HG = max(1, p.head_group), g = t / (HG * nq), r = t - g * HG * nq, hg = min(HG, BH - g * HG);
    const int qi = r / hg, bh = g * HG + r % hg, qb = p.causal ? nq - 1 - qi : qi;
    const int q0 = qb * BR;
    const int kend = p.causal ? min(p.Lk, min(q0 + BR, p.Lq)) : p.Lk;
    return Tile{q0, bh, (kend + BC - 1) / BC};
  };

  if (tid == 0) {
    mbar_init(fullQ, 1);
    mbar_init(emptyQ, 4 * NC);  // lane 0 of every consumer warp
    for (int s = 0; s < ST; ++s) {
      mbar_init(fullK(s), 1);
      mbar_init(fullV(s), 1);
      mbar_init(emptyK(s), 4 * NC);
      mbar_init(emptyV(s), 4 * NC);
    }
    mbar_init_fence();
  }
  __syncthreads();

  if (wg == 0) {  // the producer
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(C::PRODUCER_REGS));
    if (tid == 0) {
      int it = 0;  // K/V tiles loaded so far, over the block's tiles: stage it % ST
      int* counter = reinterpret_cast<int*>(p.tile_counter);
      for (int t = t0, ti = 0;; ++ti) {
        if (ti > 0) mbar_wait(emptyQ, (ti - 1) & 1);  // the last tile's S products are done
        *next_tile = t;
        if (t >= ntiles) {
          mbar_arrive(fullQ);  // no tile left: the phase completes without a load
          break;
        }
        const Tile w = tile(t);
        const int b = w.bh / p.H, h = w.bh % p.H;
        mbar_expect(fullQ, BR * D * 2);
        tma_tile<BR, D>(sQ, tq, fullQ, w.q0, h, b, p.tma_order & 63);
        // The next tile claimed now: the atomic's latency passes under this tile's loads.
        t = counter ? G + atomicAdd(counter, 1) : t + G;
        for (int j = 0; j < w.nkt; ++j, ++it) {
          const int s = it % ST;
          const uint32_t ph = ((it / ST) + 1) & 1;  // the previous use's phase
          if (it >= ST) mbar_wait(emptyK(s), ph);
          mbar_expect(fullK(s), KV);
          tma_tile<BC, D>(sK0 + s * KV, tk, fullK(s), j * BC, h, b, (p.tma_order >> 6) & 63);
          if (it >= ST) mbar_wait(emptyV(s), ph);
          mbar_expect(fullV(s), KV);
          tma_tile<BC, D>(sV0 + s * KV, tv, fullV(s), j * BC, h, b, (p.tma_order >> 12) & 63);
        }
      }
    }
    return;
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(C::CONSUMER_REGS));
  const int cw = wg - 1;  // consumer index
  const float sl2 = p.scale_log2;
  // The turn ring: consumer c waits at barrier 1 + c, then passes the turn to c + 1; it runs
  // on over the block's tiles, and consumer 0 takes the last consumer's final pass at the end.
  const int my_turn = 1 + cw, next_turn = 1 + (cw + 1) % NC;
  if (cw == NC - 1 && t0 < ntiles) asm volatile("bar.arrive 1, 256;\n" ::: "memory");  // consumer 0 goes first

  float o[NB][4];
  float m[2], l[2];
  float s[BC / 8][4];
  uint32_t a[BC / 16][4];
  int it0 = 0;  // K/V tiles before this tile's
  for (int ti = 0;; ++ti) {
    mbar_wait(fullQ, ti & 1);  // this tile's Q, or the producer's word that none is left
    const int t = *next_tile;
    if (t >= ntiles) break;
    const Tile w = tile(t);
    const int b = w.bh / p.H, h = w.bh % p.H, nkt = w.nkt;
    const float* keep = p.keep ? reinterpret_cast<const float*>(p.keep) + (int64_t)b * p.Lk : nullptr;
    const int rbase = w.q0 + 64 * cw + 16 * warp;  // this warp's first query
    const int qrow0 = rbase + (lane >> 2);         // + 8 r
    zero(o);
    m[0] = m[1] = -INFINITY;
    l[0] = l[1] = 0.f;

    auto pv = [&](int j) {
      const uint32_t sV = sV0 + ((it0 + j) % ST) * KV;
#pragma unroll
      for (int kk = 0; kk < BC / 16; ++kk) wgmma_rs<T, 1>(o, a[kk], mnmajor<BC>(sV, 16 * kk, 0), 1);
      wgmma_commit();
    };
    // S_j issued in this consumer's turn, with PV_{j-1} behind it when j > 0.
    auto issue = [&](int j, bool with_pv) {
      const int st = (it0 + j) % ST;
      mbar_wait(fullK(st), ((it0 + j) / ST) & 1);
      if (with_pv) mbar_wait(fullV((it0 + j - 1) % ST), ((it0 + j - 1) / ST) & 1);
      asm volatile("bar.sync %0, 256;\n" ::"r"(my_turn) : "memory");
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk)
        wgmma_ss<T, 0, 0>(s, kmajor<BR>(sQ, 64 * cw, kk), kmajor<BC>(sK0 + st * KV, 0, kk), kk);
      wgmma_commit();
      if (with_pv) pv(j - 1);
      asm volatile("bar.arrive %0, 256;\n" ::"r"(next_turn) : "memory");
    };
    // The online softmax of S_j in s: P_j as A fragments in a; o rescaled once PV_{j-1} is
    // done. Q's stage is free once the tile's last S is (its lane 0 arrives for the warp).
    auto softmax = [&](int j) {
      if (lane == 0) {
        mbar_arrive(emptyK((it0 + j) % ST));
        if (j == nkt - 1) mbar_arrive(emptyQ);
      }
      // Raw scores; hidden keys -inf (the scale > 0 keeps the max and the masks the same).
      const int k0 = j * BC;
      if (k0 + BC > p.Lk || keep) {
#pragma unroll
        for (int n = 0; n < BC / 8; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int key = k0 + n * 8 + 2 * (lane & 3) + (e & 1);
            const int row = qrow0 + (e >> 1) * 8;
            const bool vis = key < p.Lk && (!keep || keep[key] != 0.f) && (!p.causal || key <= row);
            if (!vis) s[n][e] = -INFINITY;
          }
      } else if (p.causal && k0 + BC - 1 > rbase) {
        // The causal diagonal alone: element (n, e) hides its key when key - row, which is
        // dk + 8 n + (e & 1) - 8 (e >> 1), is above 0; one compare with a constant each
        // (the general test above ran the causal B 16, H 32, L 1024, D 64 forward at 226
        // TFLOP/s on an H100, no mask at all 304).
        const int dk = k0 + 2 * (lane & 3) - qrow0;
#pragma unroll
        for (int n = 0; n < BC / 8; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            if (dk > (e >> 1) * 8 - n * 8 - (e & 1)) s[n][e] = -INFINITY;
      }
      // Max and sum over four partials each: short dependency chains.
      float alpha[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float mp[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
#pragma unroll
        for (int n = 0; n < BC / 8; ++n) mp[n & 3] = fmaxf(mp[n & 3], fmaxf(s[n][2 * r], s[n][2 * r + 1]));
        float mx = fmaxf(fmaxf(mp[0], mp[1]), fmaxf(mp[2], mp[3]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float mnew = fmaxf(m[r], mx * sl2);  // log2 units
        const float muse = mnew == -INFINITY ? 0.f : mnew;
        alpha[r] = ex2(m[r] - muse);
        m[r] = mnew;
        float sp[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int n = 0; n < BC / 8; ++n) {
          s[n][2 * r] = ex2(fmaf(s[n][2 * r], sl2, -muse));
          s[n][2 * r + 1] = ex2(fmaf(s[n][2 * r + 1], sl2, -muse));
          sp[n & 3] += s[n][2 * r] + s[n][2 * r + 1];
        }
        l[r] = l[r] * alpha[r] + ((sp[0] + sp[1]) + (sp[2] + sp[3]));
      }
      wgmma_wait<0>();  // PV_{j-1}
      pin(o);
      pin_regs(a);
      if (j > 0 && lane == 0) mbar_arrive(emptyV((it0 + j - 1) % ST));
#pragma unroll
      for (int n = 0; n < NB; ++n) {
        o[n][0] *= alpha[0];
        o[n][1] *= alpha[0];
        o[n][2] *= alpha[1];
        o[n][3] *= alpha[1];
      }
      to_a<T>(s, a);
    };
    issue(0, false);
    wgmma_wait<0>();
    pin(s);
    softmax(0);
    for (int j = 1; j < nkt; ++j) {
      issue(j, true);
      wgmma_wait<1>();  // S_j; PV_{j-1} may still run
      pin(s);
      softmax(j);
    }
    mbar_wait(fullV((it0 + nkt - 1) % ST), ((it0 + nkt - 1) / ST) & 1);
    wgmma_fence();
    pv(nkt - 1);
    wgmma_wait<0>();
    pin(o);
    pin_regs(a);
    if (lane == 0) mbar_arrive(emptyV((it0 + nkt - 1) % ST));

    T* O = reinterpret_cast<T*>(p.o.ptr) + b * p.o.sb + h * p.o.sh;
    float* lse = reinterpret_cast<float*>(p.lse) + (int64_t)w.bh * p.Lq;
    store_rows<T>(p, O, lse, o, m, l, qrow0, lane, true);
    it0 += nkt;
  }
  // The last consumer's final pass of the turn (a block with tiles only): the ring ends
  // balanced.
  if (cw == 0 && t0 < ntiles) asm volatile("bar.sync 1, 256;\n" ::: "memory");
}

// ----- backward -----------------------------------------------------------------------------
// Warp-specialised like the forward: a block owns 128 keys of one (b, h) and has three
// warpgroups. In warpgroup 0 (registers given away) warp 0 is the producer: K and V once,
// then per query tile (BR: 64 at D = 128, 128 at D = 64) the Q and dO tiles by TMA and the lse
// (times log2 e) and dvec rows by plain loads, into two stages freed by mbarriers; warp 1 is
// the dQ writer: it adds each tile's dQ, which the consumers leave in shared memory, to the
// f32 accumulator with bulk tensor reductions (cp.reduce.async.bulk.tensor through the
// accumulator's tensor map tdq; bulk tensor stores of the slab in the deterministic mode).
// The tile sits in shared memory in the 128-byte swizzle those copies read, which keeps the
// consumers' stores free of most bank conflicts (shared memory bandwidth is what the SS
// products here run short of: row-major tiles with one bulk reduction ran at 421 / 294
// TFLOP/s at the Flux / SD3.5 shapes on an H100, swizzled tiles at 449 / 329; a bulk
// operation per row, 381 / 132). The two consumer warpgroups own 64 keys each. Per query tile
// a consumer forms S^T = K Q^T and dP^T = V dO^T (SS), P^T from the saved lse, dV += P^T dO
// (RS, dO read transposed), dS^T = P^T (dP^T - dvec), stores dS to shared memory (two
// buffers), then, after a barrier of the two, dQ (SS) and dK += dS^T Q (RS); dQ goes to
// shared memory while dK runs. Both consumers fill one dQ tile over all 128 keys: at D = 128
// consumer w forms columns 64w.. as dQ^T = K^T dS^T (K read transposed, dS stored
// query-major by transposing stmatrix: FlashAttention-3's dQ_swapAB at head dim 128), at
// D = 64 queries 64w.. as dQ = dS K (both read transposed from dS^T stored key-major).
// Tiles of 128 queries at D = 64 (after FlashAttention-3's 128 x 128 at head dim 64) make
// S^T and dP^T m64n128 products, which read 6 KiB of shared memory per 131k multiply-adds
// against 4 KiB per 65k at n64: on an H100, 377 against 357 TFLOP/s at B 4, H 32, L 4096
// (368 / 351 at SD3.5's shape), each consumer adding its own keys' dQ of every other tile
// before. There dV is issued once dS^T is formed (LATE_DV): P^T, dP^T and P^T's fragments
// live at once took 256 registers with the accumulators and spilled. At D = 128 issuing dV
// late measured slower (444 against 457 at the Flux shape), and so did carrying a tile's dK
// product into the next tile under its S^T and dP^T (384: ptxas serialises the products).
// attention.cu's attn_bwd_pre (dvec, zeroed accumulator) runs before, attn_dq after.
template <int D> struct BwdCfg {
  static constexpr int BC = 128, BR = D == 64 ? 128 : 64, ST = 2, THREADS = 384;
  static constexpr bool LATE_DV = BR == 128;
  // dQ transposed: dQ^T = K^T dS^T with dS stored query-major (see the consumer's dQ).
  static constexpr bool DQT = D == 128;
  static constexpr int PRODUCER_REGS = 24, CONSUMER_REGS = 240;
};
// Named barriers of the backward (0 is __syncthreads): the consumers' dS exchange; the dQ
// tile in shared memory (the consumers arrive, the writer waits) and free again (the reverse).
#define BWD_BAR_DS 1
#define BWD_BAR_DQ_FULL 2
#define BWD_BAR_DQ_EMPTY 3

template <typename T, int D>
__device__ __forceinline__ void attnw_bwd(const AttnParams& p, const TmaMap& tq, const TmaMap& tk, const TmaMap& tv,
                                          const TmaMap& tdo, const TmaMap& tdq) {
  using C = BwdCfg<D>;
  constexpr int BC = C::BC, BR = C::BR, ST = C::ST, NB = D / 8;
  constexpr bool LATE_DV = C::LATE_DV, DQT = C::DQT;
  constexpr int DQ_SYNC = 288;  // threads at a dQ barrier: the consumers and the writer
  // The dQ tile in boxes of 64 rows x 32 columns (the accumulator map's), box (r, j) (rows
  // 64r.., columns 32j..) at sdQ + (r D / 32 + j) 8 KiB.
  constexpr int DQ_BOX = 64 * 128, DQ_RB = BR / 64;
  extern __shared__ __align__(128) unsigned char smem[];
  constexpr int QD = BR * D * 2;
  const uint32_t sK = (smem_u32(smem) + 1023) & ~1023u;
  const uint32_t sV = sK + BC * D * 2;
  const uint32_t sQ0 = sV + BC * D * 2;          // stage s: Q at sQ0 + s 2 QD, then dO
  // dS, two buffers of BC x BR: query-major at D = 128 (DQT), key-major (dS^T) at D = 64.
  const uint32_t sdS0 = sQ0 + ST * 2 * QD;
  const uint32_t sdQ = sdS0 + 2 * BC * BR * 2;   // dQ, f32: DQ_RB boxes of 64 rows x D
  // Stage s: lse (times log2 e) at s 2 BR, dvec after.
  const uint32_t sRows = sdQ + DQ_RB * (D / 32) * DQ_BOX;
  const uint32_t sBar = sRows + ST * 2 * BR * 4;  // barriers: K and V; full, empty per stage
  float* rows = reinterpret_cast<float*>(smem + (sRows - smem_u32(smem)));
  auto full = [&](int s) { return sBar + 8 + 8 * s; };
  auto empty = [&](int s) { return sBar + 8 + 8 * (ST + s); };
  const int tid = threadIdx.x, wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
  // The block's unit u (key block kx of this launch, head bh) and its run of query tiles
  // [it0, it1): all of them (from the diagonal's when causal), or part `part` of `parts`
  // when the unit is one of the split last wave's (AttnParams::split_from).
  // (Recomputed after the loop, not kept in registers through it.)
  auto unit = [&](int& u, int& part, int& parts) {
    u = blockIdx.x, part = 0, parts = 1;
    if (u >= p.split_from) {
      const int j = u - p.split_from;
      u = p.split_from + j / p.split_parts, part = j % p.split_parts, parts = p.split_parts;
    }
  };
  int u, part, parts;
  unit(u, part, parts);
  const int kx = u % p.kblocks, bh = u / p.kblocks, b = bh / p.H, h = bh % p.H;
  const int k0 = (kx + p.kb0) * BC;
  const int nqt = (p.Lq + BR - 1) / BR, first = p.causal ? min(nqt, k0 / BR) : 0;
  const int it0 = first + part * (nqt - first) / parts, it1 = first + (part + 1) * (nqt - first) / parts;

  if (tid == 0) {
    mbar_init(sBar, 1);
    for (int st = 0; st < ST; ++st) {
      mbar_init(full(st), 1 + 32);  // the TMA's expected bytes and the producer warp's rows
      mbar_init(empty(st), 8);      // lane 0 of every consumer warp
    }
    mbar_init_fence();
  }
  __syncthreads();

  if (wg == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(C::PRODUCER_REGS));
    if (warp == 0) {  // the producer
      if (lane == 0) {
        mbar_expect(sBar, 2 * BC * D * 2);
        tma_tile<BC, D>(sK, tk, sBar, k0, h, b, (p.tma_order >> 6) & 63);
        tma_tile<BC, D>(sV, tv, sBar, k0, h, b, (p.tma_order >> 12) & 63);
      }
      const float* lse = reinterpret_cast<const float*>(p.lse) + (int64_t)bh * p.Lq;
      const float* dvec = reinterpret_cast<const float*>(p.dvec) + (int64_t)bh * p.Lq;
      for (int it = it0; it < it1; ++it) {
        const int n = it - it0, st = n % ST;
        if (n >= ST) mbar_wait(empty(st), ((n / ST) + 1) & 1);
        if (lane == 0) {
          mbar_expect(full(st), 2 * QD);
          tma_tile<BR, D>(sQ0 + st * 2 * QD, tq, full(st), it * BR, h, b, p.tma_order & 63);
          tma_tile<BR, D>(sQ0 + st * 2 * QD + QD, tdo, full(st), it * BR, h, b, (p.tma_order >> 18) & 63);
        }
        // Rows past Lq: lse 0 and dvec 0 (their Q and dO load as zeros: they add nothing).
        float* r = rows + st * 2 * BR;
#pragma unroll
        for (int i = 0; i < BR / 32; ++i) {
          const int c = lane + 32 * i, qi = it * BR + c;
          r[c] = qi < p.Lq ? lse[qi] * LOG2E : 0.f;
          r[BR + c] = qi < p.Lq ? dvec[qi] : 0.f;
        }
        mbar_arrive(full(st));
      }
    } else if (warp == 1) {  // the dQ writer
      // The deterministic mode: a slab per key block.
      const bool det = p.dq_parts > 0;
      const int sl = kx;
      // The tile starts free (a block with no tile leaves no barrier half-arrived).
      if (it0 < it1) asm volatile("bar.arrive %0, %1;\n" ::"n"(BWD_BAR_DQ_EMPTY), "n"(DQ_SYNC) : "memory");
      for (int it = it0; it < it1; ++it) {
        asm volatile("bar.sync %0, %1;\n" ::"n"(BWD_BAR_DQ_FULL), "n"(DQ_SYNC) : "memory");
        if (lane == 0) {
          // The tile's boxes of 64 rows x 32 columns (tdq: the accumulator, or the slabs, as
          // (slab, b h, Lq, D) f32, 128-byte swizzle; rows past Lq are not written).
#pragma unroll
          for (int rb = 0; rb < DQ_RB; ++rb)
#pragma unroll
            for (int j = 0; j < D / 32; ++j) {
              const uint32_t src = sdQ + (rb * (D / 32) + j) * DQ_BOX;
              const int row = it * BR + 64 * rb;
              if (det)
                asm volatile(
                    "cp.async.bulk.tensor.4d.global.shared::cta.tile.bulk_group [%0, {%1, %2, %3, %4}], [%5];\n" ::"l"(
                        reinterpret_cast<uint64_t>(&tdq)),
                    "r"(32 * j), "r"(row), "r"(bh), "r"(sl), "r"(src)
                    : "memory");
              else
                asm volatile(
                    "cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.tile.bulk_group [%0, {%1, %2, %3, %4}], "
                    "[%5];\n" ::"l"(reinterpret_cast<uint64_t>(&tdq)),
                    "r"(32 * j), "r"(row), "r"(bh), "r"(0), "r"(src)
                    : "memory");
            }
          asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
          asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
        }
        __syncwarp();
        if (it + 1 < it1) asm volatile("bar.arrive %0, %1;\n" ::"n"(BWD_BAR_DQ_EMPTY), "n"(DQ_SYNC) : "memory");
      }
      if (lane == 0) asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
    }
    return;
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(C::CONSUMER_REGS));
  const int cw = wg - 1, kw = 64 * cw;  // this consumer's keys: k0 + kw ..
  const float* keep = p.keep ? reinterpret_cast<const float*>(p.keep) + (int64_t)b * p.Lk : nullptr;
  const float sl2 = p.scale_log2;
  int kidx[2];
  bool kvis[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    kidx[r] = k0 + kw + 16 * warp + (lane >> 2) + 8 * r;
    kvis[r] = kidx[r] < p.Lk && (!keep || keep[kidx[r]] != 0.f);
  }
  float dk[NB][4], dv[NB][4];
  zero(dk);
  zero(dv);
  mbar_wait(sBar, 0);

  for (int it = it0; it < it1; ++it) {
    const int n = it - it0, st = n % ST;
    mbar_wait(full(st), (n / ST) & 1);
    const int q0 = it * BR;
    const uint32_t sQ = sQ0 + st * 2 * QD, sdO = sQ + QD, sdS = sdS0 + (n & 1) * BC * BR * 2;
    const float* L = rows + st * 2 * BR;
    const float* Dv = L + BR;

    float s[BR / 8][4], dp[BR / 8][4];  // written by their first products (scale_d = 0)
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) wgmma_ss<T, 0, 0>(s, kmajor<BC>(sK, kw, kk), kmajor<BR>(sQ, 0, kk), kk);
    wgmma_commit();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) wgmma_ss<T, 0, 0>(dp, kmajor<BC>(sV, kw, kk), kmajor<BR>(sdO, 0, kk), kk);
    wgmma_commit();
    wgmma_wait<1>();
    pin(s);

    // P^T = 2^(s scale log2e - lse log2e); 0 for hidden keys. Key kidx[r] is hidden from
    // the thread's query column 8 nn + e (query q0 + 8 nn + 2 (lane % 4) + e) when 8 nn + e
    // < hide[r]: every column for a masked or missing key, those before the key on a causal
    // diagonal, none else; the compares run only where some key of the thread is hidden.
    // (The general test per score, key visible and not after the query, took five
    // instructions a score, half of the elementwise work at D = 64: on an H100, SD3.5's
    // shape 382 -> 410 TFLOP/s, B 4 H 32 L 4096 D 64 393-400 -> 429-432, the Flux shape
    // 492-495 -> 529-531; the compare on every score instead, 410 / 415-418 / 517-528.)
    const bool diag = p.causal && k0 + kw + 16 * warp + 15 > q0;
    int hide[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) hide[r] = !kvis[r] ? BR : diag ? kidx[r] - q0 - 2 * (lane & 3) : 0;
#pragma unroll
    for (int nn = 0; nn < BR / 8; ++nn)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float lq = L[nn * 8 + 2 * (lane & 3) + e];
#pragma unroll
        for (int r = 0; r < 2; ++r) s[nn][2 * r + e] = ex2(s[nn][2 * r + e] * sl2 - lq);
      }
    if (hide[0] > 0 || hide[1] > 0) {
#pragma unroll
      for (int nn = 0; nn < BR / 8; ++nn)
#pragma unroll
        for (int e = 0; e < 2; ++e)
#pragma unroll
          for (int r = 0; r < 2; ++r)
            if (nn * 8 + e < hide[r]) s[nn][2 * r + e] = 0.f;
    }
    // LATE_DV (tiles of 128 queries): dV is issued after dS^T is formed, when P^T's float
    // values are no longer needed, which keeps P^T, dP^T and P^T's fragments from being live
    // at once (256 registers with the accumulators); else as soon as P^T is.
    uint32_t pa[BR / 16][4], da[BR / 16][4];
    auto issue_dv = [&] {
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < BR / 16; ++kk) wgmma_rs<T, 1>(dv, pa[kk], mnmajor<BR>(sdO, 16 * kk, 0), 1);
      wgmma_commit();
    };
    if constexpr (!LATE_DV) {
      to_a<T>(s, pa);
      issue_dv();
      wgmma_wait<1>();  // dP^T is ready; dV may still run
    } else {
      wgmma_wait<0>();
    }
    pin(dp);

    // dS^T = P^T (dP^T - dvec), to shared memory as T: at D = 128 as dS (rows: queries,
    // columns: keys; dQ^T's K-major B), at D = 64 as dS^T (rows: keys, columns: queries).
#pragma unroll
    for (int nn = 0; nn < BR / 8; ++nn) {
#pragma unroll
      for (int e = 0; e < 4; ++e) dp[nn][e] = s[nn][e] * (dp[nn][e] - Dv[nn * 8 + 2 * (lane & 3) + (e & 1)]);
      if constexpr (!DQT)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int row = kw + 16 * warp + (lane >> 2) + 8 * r;
          asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(sdS + sw128<BC>(row, nn) + 4 * (lane & 3)),
                       "r"(pack2<T>(dp[nn][2 * r], dp[nn][2 * r + 1])));
        }
    }
    if constexpr (LATE_DV) {
      to_a<T>(s, pa);
      issue_dv();
    }
    to_a<T>(dp, da);
    if constexpr (DQT) {
      // da[kk] holds four 8 x 8 blocks of dS^T (keys 16 warp + 8 (j & 1).., queries
      // 16 kk + 8 (j >> 1)..) in mma.sync's fragment layout; stmatrix .trans writes each
      // transposed, a query's 8 keys as one 16-byte unit, lane l giving the address of row
      // l % 8 of block l / 8 (a block's 8 rows on 8 distinct units: no bank conflicts).
      const int j = lane >> 3, q = 8 * (j >> 1) + (lane & 7), unit = 8 * cw + 2 * warp + (j & 1);
#pragma unroll
      for (int kk = 0; kk < BR / 16; ++kk)
        asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(
                         sdS + sw128<BR>(16 * kk + q, unit)),
                     "r"(da[kk][0]), "r"(da[kk][1]), "r"(da[kk][2]), "r"(da[kk][3])
                     : "memory");
    }
    fence_async_smem();
    // dQ reads both consumers' dS. (The other dS buffer is free: the stages keep the
    // consumers within a tile of each other, and each finishes its dQ product of a tile
    // before it releases the tile's stage.)
    asm volatile("bar.sync %0, 256;\n" ::"n"(BWD_BAR_DS) : "memory");

    // D = 128: dQ^T (m64n64: columns 64 cw.. x the tile's 64 queries) = K^T (M-major) dS^T
    // (K-major). D = 64: dQ (m64n64: queries 64 cw.. x the 64 columns) = dS (M-major) K
    // (N-major). Both over the block's 128 keys.
    float dq[8][4];
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BC / 16; ++kk) {
      if constexpr (DQT)
        wgmma_ss<T, 1, 0>(dq, mnmajor<BC>(sK, 16 * kk, cw), kmajor<BR>(sdS, 0, kk), kk);
      else
        wgmma_ss<T, 1, 1>(dq, mnmajor<BC>(sdS, 16 * kk, cw), mnmajor<BC>(sK, 16 * kk, 0), kk);
    }
    wgmma_commit();
#pragma unroll
    for (int kk = 0; kk < BR / 16; ++kk) wgmma_rs<T, 1>(dk, da[kk], mnmajor<BR>(sQ, 16 * kk, 0), 1);
    wgmma_commit();
    wgmma_wait<1>();  // dV and dQ; dK may still run
    pin(dq);
    pin(dv);
    pin_regs(pa);
    // scale dQ to shared memory in the tensor map's boxes: row box rb, column box j at
    // sdQ + (rb D / 32 + j) 8 KiB, rows of 128 bytes, 16-byte unit u of row r at u ^ (r % 8)
    // (the 128-byte swizzle the bulk tensor copy reads).
    asm volatile("bar.sync %0, %1;\n" ::"n"(BWD_BAR_DQ_EMPTY), "n"(DQ_SYNC) : "memory");
    if constexpr (DQT) {
      // Thread's dQ^T rows: columns d = 64 cw + 16 warp + lane / 4 + 8 r; its columns: queries
      // 8 nn + 2 (lane % 4) + e. A store of the warp takes 8 columns x 4 queries of one
      // parity: 8 distinct 16-byte units of the swizzle, no bank conflicts. (Against dQ = dS
      // K with both operands M/N-major, dS^T stored by 4-byte stores and dQ by 8-byte ones:
      // 492 against 459 TFLOP/s at the Flux shape on an H100, 514 / 488 at L 16384. At
      // D = 64 the transposed form measured slower, 335 against 385 at SD3.5's shape.)
#pragma unroll
      for (int nn = 0; nn < 8; ++nn)
#pragma unroll
        for (int r = 0; r < 2; ++r)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int d = 64 * cw + 16 * warp + (lane >> 2) + 8 * r, q = 8 * nn + 2 * (lane & 3) + e;
            const uint32_t at = sdQ + (d >> 5) * DQ_BOX + q * 128 + ((((d & 31) >> 2) ^ (q & 7)) << 4) + (d & 3) * 4;
            asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(at), "f"(dq[nn][2 * r + e] * p.scale) : "memory");
          }
    } else {
      const int rb = cw;
      const uint32_t base = sdQ + rb * (D / 32) * DQ_BOX;
      // A half-warp's 8-byte stores take 4 rows r, r ^ 1, ...; a row's 8 columns of group g
      // are units 2g, 2g + 1 swizzled by r % 8, which rows r and r ^ 1 share for the same g
      // (a 2-way bank conflict: ncu counted 16M excess wavefronts a Flux-shape backward). So
      // store k of a box writes group k ^ s (s = lane / 4 % 4) in each thread: the 4 rows
      // then take 8 distinct units. The thread's groups are permuted by s in registers.
      // H100: SD3.5's shape 383 against 375 TFLOP/s; the Flux shape within noise.
      const int sw = (lane >> 2) & 3;
#pragma unroll
      for (int bx = 0; bx < 2; ++bx)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          float x[4], y[4];
#pragma unroll
          for (int k = 0; k < 4; ++k) x[k] = dq[4 * bx + k][2 * r], y[k] = dq[4 * bx + k][2 * r + 1];
          // x[k] <- x[k ^ sw]: swap neighbours if bit 0, pairs if bit 1.
#pragma unroll
          for (int k = 0; k < 4; k += 2) {
            const float x0 = x[k], y0 = y[k];
            x[k] = sw & 1 ? x[k + 1] : x0, y[k] = sw & 1 ? y[k + 1] : y0;
            x[k + 1] = sw & 1 ? x0 : x[k + 1], y[k + 1] = sw & 1 ? y0 : y[k + 1];
          }
#pragma unroll
          for (int k = 0; k < 2; ++k) {
            const float x0 = x[k], y0 = y[k];
            x[k] = sw & 2 ? x[k + 2] : x0, y[k] = sw & 2 ? y[k + 2] : y0;
            x[k + 2] = sw & 2 ? x0 : x[k + 2], y[k + 2] = sw & 2 ? y0 : y[k + 2];
          }
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            const int nn = 4 * bx + (k ^ sw);
            const int row = 16 * warp + (lane >> 2) + 8 * r, col = nn * 8 + 2 * (lane & 3);
            const uint32_t at =
                base + (col >> 5) * DQ_BOX + row * 128 + ((((col & 31) >> 2) ^ (row & 7)) << 4) + (col & 3) * 4;
            asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(at), "f"(x[k] * p.scale), "f"(y[k] * p.scale)
                         : "memory");
          }
        }
    }
    fence_async_smem();
    asm volatile("bar.arrive %0, %1;\n" ::"n"(BWD_BAR_DQ_FULL), "n"(DQ_SYNC) : "memory");
    wgmma_wait<0>();  // dK
    pin(dk);
    pin_regs(da);
    if (lane == 0) mbar_arrive(empty(st));
  }

  unit(u, part, parts);
  if (parts == 1) {
    store_dkdv<T, D>(p, bh, kidx, dk, dv, lane);
    return;
  }
  // A split unit's part: its dK (scaled) and dV added to the unit's f32 rows of dkv_part.
  float* part_dk = reinterpret_cast<float*>(p.dkv_part) + (size_t)(u - p.split_from) * 2 * BC * D;
  float* part_dv = part_dk + BC * D;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (kidx[r] >= p.Lk) continue;
    const int off = (kidx[r] - k0) * D + 2 * (lane & 3);
#pragma unroll
    for (int nn = 0; nn < NB; ++nn) {  // 8-byte atomic adds (compute capability 9.0)
      atomicAdd(reinterpret_cast<float2*>(part_dk + off + nn * 8),
                make_float2(dk[nn][2 * r] * p.scale, dk[nn][2 * r + 1] * p.scale));
      atomicAdd(reinterpret_cast<float2*>(part_dv + off + nn * 8), make_float2(dv[nn][2 * r], dv[nn][2 * r + 1]));
    }
  }
}

// dk and dv of the backward's split units from their f32 sums in dkv_part (see AttnParams):
// two columns a thread.
template <typename T, int D> __device__ __forceinline__ void attnw_dkv_fold(const AttnParams& p) {
  constexpr int BC = BwdCfg<D>::BC;
  const size_t pairs = (size_t)(p.kblocks * p.B * p.H - p.split_from) * 2 * BC * D / 2;
  const float* src = reinterpret_cast<const float*>(p.dkv_part);
  GRID_STRIDE(i, pairs) {
    const size_t e = 2 * i;
    const int col = (int)(e % D), row = (int)(e / D % BC), dv = (int)(e / (BC * D) % 2);
    const int u = p.split_from + (int)(e / (2 * BC * D)), kx = u % p.kblocks, bh = u / p.kblocks;
    const int key = (kx + p.kb0) * BC + row;
    if (key < p.Lk) {
      T* dst = reinterpret_cast<T*>(dv ? p.dv : p.dk) + ((int64_t)bh * p.Lk + key) * D + col;
      *reinterpret_cast<uint32_t*>(dst) = pack2<T>(src[e], src[e + 1]);
    }
  }
}

// The TMA descriptors of q, k, v, do and the f32 dq accumulator (the forward ignores do's and
// dq's): q's boxes are FwdCfg<D, NC>::BR rows in the forward (64 NC: 128 at D = 128, 192 or
// 128 at D = 64) and BwdCfg<D>::BR in the backward (64 at D = 128, 128 at D = 64), k's and
// v's 128, dq's 64 rows x 32 columns (`tma_map_dq`).
#define ATTNW_KERNELS(T, SFX, D)                                                                         \
  ATTNW_FWD(T, SFX, D, (D == 64 ? 3 : 2), )                                                              \
  extern "C" __global__ void __launch_bounds__(BwdCfg<D>::THREADS, 1)                                   \
      attnw_bwd_##SFX##_d##D(const AttnParams p, const __grid_constant__ TmaMap tq,                      \
                             const __grid_constant__ TmaMap tk, const __grid_constant__ TmaMap tv,       \
                             const __grid_constant__ TmaMap tdo, const __grid_constant__ TmaMap tdq) {  \
    attnw_bwd<T, D>(p, tq, tk, tv, tdo, tdq);                                                            \
  }                                                                                                      \
  extern "C" __global__ void attnw_dkv_fold_##SFX##_d##D(const AttnParams p) { attnw_dkv_fold<T, D>(p); }
// The forward with NC consumer warpgroups (64 NC queries a tile): kernel attnw_fwd_SFX_dD,
// or attnw_fwd_SFX_dD_cNC for another count than the default (3 at D = 64, 2 at D = 128).
#define ATTNW_FWD(T, SFX, D, NC, NAME_TAIL)                                                              \
  extern "C" __global__ void __launch_bounds__(FwdCfg<D, NC>::THREADS, 1)                               \
      attnw_fwd_##SFX##_d##D##NAME_TAIL(const AttnParams p, const __grid_constant__ TmaMap tq,           \
                                        const __grid_constant__ TmaMap tk, const __grid_constant__ TmaMap tv, \
                                        const __grid_constant__ TmaMap tdo,                             \
                                        const __grid_constant__ TmaMap tdq) {                           \
    attnw_fwd<T, D, NC>(p, tq, tk, tv);                                                                  \
  }

ATTNW_KERNELS(__nv_bfloat16, bf16, 64)
ATTNW_KERNELS(__nv_bfloat16, bf16, 128)
ATTNW_KERNELS(__half, f16, 64)
ATTNW_KERNELS(__half, f16, 128)
// D = 64 with two consumers (tiles of 128 queries): causal attention, where a tile of 192
// queries computes keys its first rows never see.
ATTNW_FWD(__nv_bfloat16, bf16, 64, 2, _c2)
ATTNW_FWD(__half, f16, 64, 2, _c2)
