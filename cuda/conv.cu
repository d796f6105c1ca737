// im2col (unfold2d) and col2im (fold2d) over contiguous planes: x is (N*C) planes of H*W,
// cols is (N*C) planes of (kh*kw) rows of Ho*Wo. col2im gathers: each input pixel sums the
// columns that read it in (ki, kj) order, so there are no atomics and the sum matches the CPU.
#include "common.cuh"

// Must match `ConvGeometry` in src/backend/cuda/conv.rs (repr(C)).
struct ConvGeometry {
  uint64_t planes, h, w, kh, kw, sh, sw, ph, pw, dh, dw, ho, wo;
};

// grid.y walks the rows (nc, ki, kj) of the column matrix, grid.x its Ho*Wo columns: a row's
// threads write neighbouring columns and read neighbouring pixels. I is int when every size
// fits 31 bits (the launcher checks), long long otherwise: 64-bit division is emulated.
template <typename T, typename I>
__device__ __forceinline__ void im2col(const T* __restrict__ x, T* __restrict__ cols, ConvGeometry g) {
  const I h = (I)g.h, w = (I)g.w, kh = (I)g.kh, kw = (I)g.kw, wo = (I)g.wo, L = (I)(g.ho * g.wo);
  const I rows = (I)(g.planes * g.kh * g.kw);
  for (I row = blockIdx.y; row < rows; row += gridDim.y) {
    const I k = row % (kh * kw), nc = row / (kh * kw), ki = k / kw, kj = k % kw;
    const T* xp = x + (size_t)nc * (size_t)(h * w);
    T* out = cols + (size_t)row * (size_t)L;
    const I y0 = ki * (I)g.dh - (I)g.ph, x0 = kj * (I)g.dw - (I)g.pw;
    if (L % 8 == 0) {
      // Eight neighbouring columns a thread, one 16-byte store; (oh, ow) advance by steps.
      for (I c = (blockIdx.x * blockDim.x + threadIdx.x) * 8; c < L; c += gridDim.x * blockDim.x * 8) {
        I oh = c / wo, ow = c % wo;
        Pack8<T> o;
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          const I y = oh * (I)g.sh + y0, xx = ow * (I)g.sw + x0;
          o.v[e] = (y >= 0 && y < h && xx >= 0 && xx < w) ? xp[y * w + xx] : from_f64<T>(0.0);
          if (++ow == wo) {
            ow = 0;
            ++oh;
          }
        }
        *reinterpret_cast<Pack8<T>*>(out + c) = o;
      }
      continue;
    }
    for (I c = blockIdx.x * blockDim.x + threadIdx.x; c < L; c += gridDim.x * blockDim.x) {
      const I y = c / wo * (I)g.sh + y0, xx = c % wo * (I)g.sw + x0;
      out[c] = (y >= 0 && y < h && xx >= 0 && xx < w) ? xp[y * w + xx] : from_f64<T>(0.0);
    }
  }
}

// grid.y walks planes, grid.x the H*W pixels of a plane.
template <typename T, typename I>
__device__ __forceinline__ void col2im(const T* __restrict__ cols, T* __restrict__ x, ConvGeometry g) {
  typedef typename AccT<T>::type A;
  const I h = (I)g.h, w = (I)g.w, kh = (I)g.kh, kw = (I)g.kw, ho = (I)g.ho, wo = (I)g.wo;
  const I sh = (I)g.sh, sw = (I)g.sw, dh = (I)g.dh, dw = (I)g.dw, ph = (I)g.ph, pw = (I)g.pw;
  const I planes = (I)g.planes, hw = h * w;
  for (I nc = blockIdx.y; nc < planes; nc += gridDim.y) {
    const T* src = cols + (size_t)nc * (size_t)(kh * kw * ho * wo);
    for (I i = blockIdx.x * blockDim.x + threadIdx.x; i < hw; i += gridDim.x * blockDim.x) {
      const I y = i / w, xx = i % w;
      A acc = A(0);
      if (sh == 1 && sw == 1) {
        // Unit stride (most convolutions): no division per tap.
        for (I ki = 0; ki < kh; ++ki) {
          const I oh = y + ph - ki * dh;
          if (oh < 0 || oh >= ho) continue;
          for (I kj = 0; kj < kw; ++kj) {
            const I ow = xx + pw - kj * dw;
            if (ow >= 0 && ow < wo) acc += to_acc(src[((ki * kw + kj) * ho + oh) * wo + ow]);
          }
        }
      } else {
        for (I ki = 0; ki < kh; ++ki) {
          const I t = y + ph - ki * dh;
          if (t < 0 || t % sh != 0 || t / sh >= ho) continue;
          const I oh = t / sh;
          for (I kj = 0; kj < kw; ++kj) {
            const I u = xx + pw - kj * dw;
            if (u < 0 || u % sw != 0 || u / sw >= wo) continue;
            acc += to_acc(src[((ki * kw + kj) * ho + oh) * wo + u / sw]);
          }
        }
      }
      x[(size_t)nc * (size_t)hw + i] = from_acc<T>(acc);
    }
  }
}

// Unit stride with a KH x KW window known at compile time (3x3 is most convolutions): every
// tap's load is issued before the first add, where the loop above waits on one load after
// another. The sum runs in the same (ki, kj) order.
template <typename T, int KH, int KW>
__device__ __forceinline__ void col2im_fixed(const T* __restrict__ cols, T* __restrict__ x, ConvGeometry g) {
  typedef typename AccT<T>::type A;
  const int h = (int)g.h, w = (int)g.w, ho = (int)g.ho, wo = (int)g.wo, L = ho * wo, hw = h * w;
  const int dh = (int)g.dh, dw = (int)g.dw, ph = (int)g.ph, pw = (int)g.pw, planes = (int)g.planes;
  for (int nc = blockIdx.y; nc < planes; nc += gridDim.y) {
    const T* src = cols + (size_t)nc * (size_t)(KH * KW * L);
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < hw; i += gridDim.x * blockDim.x) {
      const int y = i / w, xx = i % w;
      T v[KH * KW];
#pragma unroll
      for (int ki = 0; ki < KH; ++ki) {
        const int oh = y + ph - ki * dh;
#pragma unroll
        for (int kj = 0; kj < KW; ++kj) {
          const int ow = xx + pw - kj * dw;
          const bool in = oh >= 0 && oh < ho && ow >= 0 && ow < wo;
          v[ki * KW + kj] = in ? src[(ki * KW + kj) * L + oh * wo + ow] : from_f64<T>(0.0);
        }
      }
      A acc = A(0);
#pragma unroll
      for (int t = 0; t < KH * KW; ++t) acc += to_acc(v[t]);
      x[(size_t)nc * (size_t)hw + i] = from_acc<T>(acc);
    }
  }
}

#define CONV(SUF, T)                                                                                  \
  extern "C" __global__ void im2col_##SUF(const T* x, T* cols, ConvGeometry g, int wide) {             \
    if (wide)                                                                                         \
      im2col<T, long long>(x, cols, g);                                                               \
    else                                                                                              \
      im2col<T, int>(x, cols, g);                                                                     \
  }                                                                                                   \
  extern "C" __global__ void col2im_##SUF(const T* cols, T* x, ConvGeometry g, int wide) {             \
    if (!wide && g.kh == 3 && g.kw == 3 && g.sh == 1 && g.sw == 1)                                    \
      col2im_fixed<T, 3, 3>(cols, x, g);                                                              \
    else if (wide)                                                                                    \
      col2im<T, long long>(cols, x, g);                                                               \
    else                                                                                              \
      col2im<T, int>(cols, x, g);                                                                     \
  }
CONV(f32, float)
CONV(f64, double)
CONV(bf16, __nv_bfloat16)
CONV(f16, __half)
