// Reductions over any set of dims: sum, max, min, argmax, argmin.
// The launcher splits the input layout into `kept` (one entry per output) and `red` (the
// reduced dims, offset 0): element r of output o is at offset_of(kept, o) + offset_of(red, r).
// Values accumulate in double, as in the CPU reference. Max/min keep the first NaN; ties go to
// the lower index, so results do not depend on the reduction tree and runs are deterministic.
//
// Three shapes of work:
//   reduce_small_*    one thread per output, for short reduced ranges (n_red <= 64);
//   reduce_rows_*     one warp per output, for contiguous reduced ranges and many outputs;
//   reduce_block_*    one block per (output, chunk); with one chunk it writes the result,
//                     otherwise a Partial per chunk;
//   reduce_partials_* one block per output combining its chunks' Partials;
//   reduce_cols_*     one thread per output (neighbouring outputs adjacent in memory), chunks
//                     of the reduced range over grid.y, combined by reduce_cols_partials_*.
#include "common.cuh"

#define OP_SUM 0
#define OP_MAX 1
#define OP_MIN 2
#define OP_ARGMAX 3
#define OP_ARGMIN 4
#define NO_INDEX 0xffffffffffffffffull

struct Partial {
  double v;
  unsigned long long idx;
};

template <int OP>
__device__ __forceinline__ Partial combine(Partial a, Partial b) {
  if (OP == OP_SUM) return Partial{a.v + b.v, 0};
  if (a.idx == NO_INDEX) return b;
  if (b.idx == NO_INDEX) return a;
  const bool an = a.v != a.v, bn = b.v != b.v;
  if (an || bn) {
    if (an && bn) return a.idx <= b.idx ? a : b;
    return an ? a : b;
  }
  const bool b_better = (OP == OP_MAX || OP == OP_ARGMAX) ? b.v > a.v : b.v < a.v;
  if (b_better) return b;
  if (b.v == a.v && b.idx < a.idx) return b;
  return a;
}

template <int OP>
__device__ __forceinline__ Partial identity() {
  return Partial{0.0, OP == OP_SUM ? 0ull : NO_INDEX};
}

template <int OP>
__device__ __forceinline__ Partial block_combine(Partial p) {
  __shared__ Partial warp_part[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    Partial q;
    q.v = __shfl_down_sync(0xffffffff, p.v, o);
    q.idx = __shfl_down_sync(0xffffffff, p.idx, o);
    p = combine<OP>(p, q);
  }
  if (lane == 0) warp_part[warp] = p;
  __syncthreads();
  const int warps = (blockDim.x + 31) >> 5;
  p = threadIdx.x < warps ? warp_part[threadIdx.x] : identity<OP>();
  if (warp == 0) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      Partial q;
      q.v = __shfl_down_sync(0xffffffff, p.v, o);
      q.idx = __shfl_down_sync(0xffffffff, p.idx, o);
      p = combine<OP>(p, q);
    }
  }
  return p;  // valid in thread 0
}

template <typename T, int OP>
__device__ __forceinline__ void write_out(T* out, uint32_t* out_idx, size_t o, Partial p) {
  if (OP == OP_ARGMAX || OP == OP_ARGMIN)
    out_idx[o] = (uint32_t)p.idx;
  else
    out[o] = from_f64<T>(p.v);
}

template <typename T, int OP>
__device__ __forceinline__ void reduce_small(const T* in, StridedLayout kept, StridedLayout red, size_t n_out,
                                             size_t n_red, T* out, uint32_t* out_idx) {
  GRID_STRIDE(o, n_out) {
    const size_t base = offset_of(kept, o);
    Partial p = identity<OP>();
    for (size_t r = 0; r < n_red; ++r) p = combine<OP>(p, Partial{to_f64(in[base + offset_of(red, r)]), r});
    write_out<T, OP>(out, out_idx, o, p);
  }
}

template <typename T, int OP>
__device__ __forceinline__ void reduce_block(const T* in, StridedLayout kept, StridedLayout red, size_t n_red,
                                             size_t chunk, T* out, uint32_t* out_idx, Partial* parts) {
  const size_t o = blockIdx.x, c = blockIdx.y;
  const size_t base = offset_of(kept, o);
  const size_t start = c * chunk, end = min(n_red, start + chunk);
  Partial p = identity<OP>();
  if (is_contiguous(red)) {
    for (size_t r = start + threadIdx.x; r < end; r += blockDim.x) p = combine<OP>(p, Partial{to_f64(in[base + r]), r});
  } else {
    for (size_t r = start + threadIdx.x; r < end; r += blockDim.x)
      p = combine<OP>(p, Partial{to_f64(in[base + offset_of(red, r)]), r});
  }
  p = block_combine<OP>(p);
  if (threadIdx.x == 0) {
    if (gridDim.y == 1)
      write_out<T, OP>(out, out_idx, o, p);
    else
      parts[o * gridDim.y + c] = p;
  }
}

template <typename T, int OP>
__device__ __forceinline__ void reduce_partials(const Partial* parts, size_t n_parts, T* out, uint32_t* out_idx) {
  const size_t o = blockIdx.x;
  Partial p = identity<OP>();
  for (size_t c = threadIdx.x; c < n_parts; c += blockDim.x) p = combine<OP>(p, parts[o * n_parts + c]);
  p = block_combine<OP>(p);
  if (threadIdx.x == 0) write_out<T, OP>(out, out_idx, o, p);
}

// One warp per output when the reduced range is contiguous: 16-byte loads, shuffles only.
template <typename T, int OP>
__device__ __forceinline__ void reduce_rows(const T* in, StridedLayout kept, size_t n_out, size_t n_red, T* out,
                                            uint32_t* out_idx) {
  const size_t warps = blockDim.x / 32, lane = threadIdx.x & 31;
  for (size_t o = blockIdx.x * warps + threadIdx.x / 32; o < n_out; o += (size_t)gridDim.x * warps) {
    const T* row = in + offset_of(kept, o);
    Partial p = identity<OP>();
    size_t start = 0;
    if (aligned16(row)) {
      const size_t nv = n_red / 8;
      for (size_t v = lane; v < nv; v += 32) {
        const Pack8<T> pk = reinterpret_cast<const Pack8<T>*>(row)[v];
#pragma unroll
        for (int k = 0; k < 8; ++k) p = combine<OP>(p, Partial{to_f64(pk.v[k]), v * 8 + k});
      }
      start = nv * 8;
    }
    for (size_t r = start + lane; r < n_red; r += 32) p = combine<OP>(p, Partial{to_f64(row[r]), r});
#pragma unroll
    for (int s = 16; s > 0; s >>= 1) {
      Partial q;
      q.v = __shfl_down_sync(0xffffffff, p.v, s);
      q.idx = __shfl_down_sync(0xffffffff, p.idx, s);
      p = combine<OP>(p, q);
    }
    if (lane == 0) write_out<T, OP>(out, out_idx, o, p);
  }
}

// One thread per output when consecutive outputs sit next to each other in memory (a sum over
// leading dims, e.g. a bias gradient): a warp reads 32 neighbours per step, coalesced. Block
// (x: 256 outputs, y: chunk c of the reduced range); with several chunks each writes
// parts[c * n_out + o] and reduce_cols_partials combines them in chunk order.
template <typename T, int OP>
__device__ __forceinline__ void reduce_cols(const T* in, StridedLayout kept, StridedLayout red, size_t n_out,
                                            size_t n_red, size_t chunk, T* out, uint32_t* out_idx, Partial* parts) {
  const size_t o = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
  if (o >= n_out) return;
  const size_t c = blockIdx.y, start = c * chunk, end = min(n_red, start + chunk);
  const size_t base = offset_of(kept, o);
  Partial p = identity<OP>();
  // One reduced dim of size > 1 (a bias or modulation gradient: rows of a matrix): plain
  // strides, eight loads in flight before they are combined (in order, as below). H100, a
  // column sum of 4608 x 3072 bf16 in Flux's step: 51 us a call through offset_of.
  int big = -1, nbig = 0;
  for (int d = 0; d < (int)red.rank; ++d)
    if (red.dims[d] > 1) big = d, ++nbig;
  if (nbig <= 1) {
    const size_t rs = (red.flags & LAYOUT_CONTIGUOUS) ? 1 : big < 0 ? 0 : red.strides[big];
    const T* col = in + base + red.offset;
    size_t r = start;
    for (; r + 8 <= end; r += 8) {
      T v[8];
#pragma unroll
      for (int k = 0; k < 8; ++k) v[k] = col[(r + k) * rs];
#pragma unroll
      for (int k = 0; k < 8; ++k) p = combine<OP>(p, Partial{to_f64(v[k]), r + k});
    }
    for (; r < end; ++r) p = combine<OP>(p, Partial{to_f64(col[r * rs]), r});
  } else {
    for (size_t r = start; r < end; ++r) p = combine<OP>(p, Partial{to_f64(in[base + offset_of(red, r)]), r});
  }
  if (gridDim.y == 1)
    write_out<T, OP>(out, out_idx, o, p);
  else
    parts[c * n_out + o] = p;
}

// A block is 32 outputs by 8 groups of chunks, combined in shared memory in a fixed order.
template <typename T, int OP>
__device__ __forceinline__ void reduce_cols_partials(const Partial* parts, size_t n_parts, size_t n_out, T* out,
                                                     uint32_t* out_idx) {
  __shared__ Partial sh[8][32];
  const int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;
  const size_t o = blockIdx.x * (size_t)32 + tx;
  Partial p = identity<OP>();
  if (o < n_out) {
#pragma unroll 4
    for (size_t c = ty; c < n_parts; c += 8) p = combine<OP>(p, parts[c * n_out + o]);
  }
  sh[ty][tx] = p;
  __syncthreads();
  if (ty == 0 && o < n_out) {
    for (int k = 1; k < 8; ++k) p = combine<OP>(p, sh[k][tx]);
    write_out<T, OP>(out, out_idx, o, p);
  }
}

#define REDUCE_T(NAME, OP, SUF, T)                                                                    \
  extern "C" __global__ void NAME##_small_##SUF(const T* in, StridedLayout kept, StridedLayout red,   \
                                                size_t n_out, size_t n_red, T* out, uint32_t* out_idx) { \
    reduce_small<T, OP>(in, kept, red, n_out, n_red, out, out_idx);                                  \
  }                                                                                                   \
  extern "C" __global__ void NAME##_block_##SUF(const T* in, StridedLayout kept, StridedLayout red,   \
                                                size_t n_red, size_t chunk, T* out, uint32_t* out_idx, \
                                                Partial* parts) {                                     \
    reduce_block<T, OP>(in, kept, red, n_red, chunk, out, out_idx, parts);                           \
  }                                                                                                   \
  extern "C" __global__ void NAME##_rows_##SUF(const T* in, StridedLayout kept, size_t n_out, size_t n_red, \
                                               T* out, uint32_t* out_idx) {                           \
    reduce_rows<T, OP>(in, kept, n_out, n_red, out, out_idx);                                        \
  }                                                                                                   \
  extern "C" __global__ void NAME##_partials_##SUF(const Partial* parts, size_t n_parts, T* out,      \
                                                   uint32_t* out_idx) {                               \
    reduce_partials<T, OP>(parts, n_parts, out, out_idx);                                            \
  } \
  extern "C" __global__ void NAME##_cols_##SUF(const T* in, StridedLayout kept, StridedLayout red,    \
                                               size_t n_out, size_t n_red, size_t chunk, T* out,       \
                                               uint32_t* out_idx, Partial* parts) {                   \
    reduce_cols<T, OP>(in, kept, red, n_out, n_red, chunk, out, out_idx, parts);                     \
  }                                                                                                   \
  extern "C" __global__ void NAME##_cols_partials_##SUF(const Partial* parts, size_t n_parts,         \
                                                        size_t n_out, T* out, uint32_t* out_idx) {   \
    reduce_cols_partials<T, OP>(parts, n_parts, n_out, out, out_idx);                                \
  }
#define REDUCE(NAME, OP)                  \
  REDUCE_T(NAME, OP, f32, float)          \
  REDUCE_T(NAME, OP, f64, double)         \
  REDUCE_T(NAME, OP, bf16, __nv_bfloat16) \
  REDUCE_T(NAME, OP, f16, __half)

REDUCE(r_sum, OP_SUM)
REDUCE(r_max, OP_MAX)
REDUCE(r_min, OP_MIN)
REDUCE(r_argmax, OP_ARGMAX)
REDUCE(r_argmin, OP_ARGMIN)
REDUCE_T(r_argmax, OP_ARGMAX, u32, uint32_t)
REDUCE_T(r_argmin, OP_ARGMIN, u32, uint32_t)
