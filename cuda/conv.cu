// im2col (unfold2d) and col2im (fold2d) over contiguous planes: x is (N*C) planes of H*W,
// cols is (N*C) planes of (kh*kw) rows of Ho*Wo. col2im gathers: each input pixel sums the
// columns that read it in (ki, kj) order, so there are no atomics and the sum matches the CPU.
#include "common.cuh"

// Must match `ConvGeometry` in src/backend/cuda/conv.rs (repr(C)).
struct ConvGeometry {
  uint64_t planes, h, w, kh, kw, sh, sw, ph, pw, dh, dw, ho, wo;
};

template <typename T>
__device__ __forceinline__ void im2col(const T* __restrict__ x, T* __restrict__ cols, ConvGeometry g) {
  const size_t n = g.planes * g.kh * g.kw * g.ho * g.wo;
  GRID_STRIDE(i, n) {
    const size_t ow = i % g.wo, oh = (i / g.wo) % g.ho;
    const size_t k = (i / (g.wo * g.ho)) % (g.kh * g.kw), nc = i / (g.wo * g.ho * g.kh * g.kw);
    const size_t ki = k / g.kw, kj = k % g.kw;
    const long long y = (long long)(oh * g.sh + ki * g.dh) - (long long)g.ph;
    const long long xx = (long long)(ow * g.sw + kj * g.dw) - (long long)g.pw;
    const bool inside = y >= 0 && y < (long long)g.h && xx >= 0 && xx < (long long)g.w;
    cols[i] = inside ? x[nc * g.h * g.w + (size_t)y * g.w + (size_t)xx] : from_f64<T>(0.0);
  }
}

template <typename T>
__device__ __forceinline__ void col2im(const T* __restrict__ cols, T* __restrict__ x, ConvGeometry g) {
  typedef typename AccT<T>::type A;
  const size_t n = g.planes * g.h * g.w;
  GRID_STRIDE(i, n) {
    const size_t xx = i % g.w, y = (i / g.w) % g.h, nc = i / (g.w * g.h);
    const T* src = cols + nc * g.kh * g.kw * g.ho * g.wo;
    A acc = A(0);
    for (size_t ki = 0; ki < g.kh; ++ki) {
      const long long t = (long long)(y + g.ph) - (long long)(ki * g.dh);
      if (t < 0 || t % (long long)g.sh != 0 || (size_t)(t / g.sh) >= g.ho) continue;
      const size_t oh = (size_t)(t / g.sh);
      for (size_t kj = 0; kj < g.kw; ++kj) {
        const long long u = (long long)(xx + g.pw) - (long long)(kj * g.dw);
        if (u < 0 || u % (long long)g.sw != 0 || (size_t)(u / g.sw) >= g.wo) continue;
        const size_t ow = (size_t)(u / g.sw);
        acc += to_acc(src[((ki * g.kw + kj) * g.ho + oh) * g.wo + ow]);
      }
    }
    x[i] = from_acc<T>(acc);
  }
}

#define CONV(SUF, T)                                                                                   \
  extern "C" __global__ void im2col_##SUF(const T* x, T* cols, ConvGeometry g) { im2col<T>(x, cols, g); } \
  extern "C" __global__ void col2im_##SUF(const T* cols, T* x, ConvGeometry g) { col2im<T>(cols, x, g); }
CONV(f32, float)
CONV(f64, double)
CONV(bf16, __nv_bfloat16)
CONV(f16, __half)
