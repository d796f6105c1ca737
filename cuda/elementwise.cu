// Elementwise kernels: unary, binary, comparisons, where, cast, strided copy.
// Every kernel takes its inputs as (pointer, StridedLayout) and writes a contiguous output of
// n elements. Contiguous 16-byte-aligned operands take the Pack8 path (8 elements per load);
// anything else (transposed, narrowed, broadcast through stride 0) the strided path.
#include "common.cuh"

// ----- unary -------------------------------------------------------------------------------
// (x, p0, p1) -> y in the accumulation type. p0/p1: Affine's (mul, add), Powf's exponent.
struct UNeg { template <class A> __device__ A operator()(A x, A, A) const { return -x; } };
struct URecip { template <class A> __device__ A operator()(A x, A, A) const { return A(1) / x; } };
struct UExp { template <class A> __device__ A operator()(A x, A, A) const { return exp(x); } };
struct ULog { template <class A> __device__ A operator()(A x, A, A) const { return log(x); } };
struct USqrt { template <class A> __device__ A operator()(A x, A, A) const { return sqrt(x); } };
struct USin { template <class A> __device__ A operator()(A x, A, A) const { return sin(x); } };
struct UCos { template <class A> __device__ A operator()(A x, A, A) const { return cos(x); } };
struct UTanh { template <class A> __device__ A operator()(A x, A, A) const { return tanh(x); } };
struct UErf { template <class A> __device__ A operator()(A x, A, A) const { return erf(x); } };
struct UAbs { template <class A> __device__ A operator()(A x, A, A) const { return fabs(x); } };
struct USign { template <class A> __device__ A operator()(A x, A, A) const { return A((x > A(0)) - (x < A(0))); } };
struct UAffine { template <class A> __device__ A operator()(A x, A m, A a) const { return x * m + a; } };
struct UPowf { template <class A> __device__ A operator()(A x, A e, A) const { return pow(x, e); } };

// Fused activations and their derivatives, the formulas of src/backend/cpu/num.rs (GELU's tanh
// form in common.cuh); sigmoid is (1 + tanh(x/2))/2, which never overflows.
template <class A> __device__ __forceinline__ A phi_cdf(A x) { return A(0.5) * (A(1) + erf(x * A(0.7071067811865476))); }
struct UGelu { template <class A> __device__ A operator()(A x, A, A) const { return x * phi_cdf(x); } };
struct UGeluTanh { template <class A> __device__ A operator()(A x, A, A) const { return gelu_tanh_value(x); } };
struct USilu { template <class A> __device__ A operator()(A x, A, A) const { return x * sigmoid_t(x); } };

template <typename T, typename Op>
__device__ __forceinline__ void unary_impl(const T* in, StridedLayout l, T* out, size_t n, double p0d, double p1d) {
  typedef typename AccT<T>::type A;
  const A p0 = (A)p0d, p1 = (A)p1d;
  Op op;
  if (is_contiguous(l)) {
    const T* src = in + l.offset;
    if (aligned16(src) && aligned16(out)) {
      const size_t nv = n / 8;
      GRID_STRIDE(v, nv) {
        Pack8<T> p = reinterpret_cast<const Pack8<T>*>(src)[v];
#pragma unroll
        for (int k = 0; k < 8; ++k) p.v[k] = from_acc<T>(op(to_acc(p.v[k]), p0, p1));
        reinterpret_cast<Pack8<T>*>(out)[v] = p;
      }
      GRID_STRIDE(i, n - nv * 8) out[nv * 8 + i] = from_acc<T>(op(to_acc(src[nv * 8 + i]), p0, p1));
      return;
    }
    GRID_STRIDE(i, n) out[i] = from_acc<T>(op(to_acc(src[i]), p0, p1));
    return;
  }
  // Rows of whole packs (a narrowed or broadcast view): one address computation per 8 elements.
  if (n % 8 == 0 && packs8(l, in) && aligned16(out)) {
    GRID_STRIDE(v, n / 8) {
      Pack8<T> p = *reinterpret_cast<const Pack8<T>*>(in + offset_of(l, v * 8));
#pragma unroll
      for (int k = 0; k < 8; ++k) p.v[k] = from_acc<T>(op(to_acc(p.v[k]), p0, p1));
      reinterpret_cast<Pack8<T>*>(out)[v] = p;
    }
    return;
  }
  GRID_STRIDE(i, n) out[i] = from_acc<T>(op(to_acc(in[offset_of(l, i)]), p0, p1));
}

#define UNARY_T(NAME, OP, SUF, T)                                                                \
  extern "C" __global__ void NAME##_##SUF(const T* in, StridedLayout l, T* out, size_t n, double p0, \
                                          double p1) {                                           \
    unary_impl<T, OP>(in, l, out, n, p0, p1);                                                   \
  }
#define UNARY(NAME, OP)                   \
  UNARY_T(NAME, OP, f32, float)           \
  UNARY_T(NAME, OP, f64, double)          \
  UNARY_T(NAME, OP, bf16, __nv_bfloat16)  \
  UNARY_T(NAME, OP, f16, __half)

UNARY(u_neg, UNeg)
UNARY(u_recip, URecip)
UNARY(u_exp, UExp)
UNARY(u_log, ULog)
UNARY(u_sqrt, USqrt)
UNARY(u_sin, USin)
UNARY(u_cos, UCos)
UNARY(u_tanh, UTanh)
UNARY(u_erf, UErf)
UNARY(u_abs, UAbs)
UNARY(u_sign, USign)
UNARY(u_affine, UAffine)
UNARY(u_powf, UPowf)
UNARY(u_gelu, UGelu)
UNARY(u_gelu_tanh, UGeluTanh)
UNARY(u_silu, USilu)

// ----- binary ------------------------------------------------------------------------------
struct BAdd { template <class A> __device__ A operator()(A x, A y) const { return x + y; } };
struct BSub { template <class A> __device__ A operator()(A x, A y) const { return x - y; } };
struct BMul { template <class A> __device__ A operator()(A x, A y) const { return x * y; } };
struct BDiv { template <class A> __device__ A operator()(A x, A y) const { return x / y; } };
// NaN propagates from the left; ties keep the left operand (matches the CPU backend).
struct BMax { template <class A> __device__ A operator()(A x, A y) const { return (x != x || x >= y) ? x : y; } };
struct BMin { template <class A> __device__ A operator()(A x, A y) const { return (x != x || x <= y) ? x : y; } };
// (x, dy) -> dy * f'(x) for the fused activations.
struct BGeluBwd {
  template <class A> __device__ A operator()(A x, A g) const {
    const A pdf = exp(-(x * x) * A(0.5)) * A(0.3989422804014327);
    return g * (phi_cdf(x) + x * pdf);
  }
};
struct BGeluTanhBwd {
  template <class A> __device__ A operator()(A x, A g) const {
    const A k = A(GELU_K), c = A(GELU_C);
    const A t = tanh(k * (x + c * x * x * x));
    return g * (A(0.5) * (A(1) + t) + A(0.5) * x * (A(1) - t * t) * k * (A(1) + A(3) * c * x * x));
  }
};
struct BSiluBwd {
  template <class A> __device__ A operator()(A x, A g) const {
    const A s = sigmoid_t(x);
    return g * (s * (A(1) + x * (A(1) - s)));
  }
};

template <typename T, typename Op>
__device__ __forceinline__ void binary_impl(const T* a, StridedLayout al, const T* b, StridedLayout bl, T* out,
                                            size_t n) {
  Op op;
  if (is_contiguous(al) && is_contiguous(bl)) {
    const T* x = a + al.offset;
    const T* y = b + bl.offset;
    if (aligned16(x) && aligned16(y) && aligned16(out)) {
      const size_t nv = n / 8;
      GRID_STRIDE(v, nv) {
        Pack8<T> p = reinterpret_cast<const Pack8<T>*>(x)[v];
        const Pack8<T> q = reinterpret_cast<const Pack8<T>*>(y)[v];
#pragma unroll
        for (int k = 0; k < 8; ++k) p.v[k] = from_acc<T>(op(to_acc(p.v[k]), to_acc(q.v[k])));
        reinterpret_cast<Pack8<T>*>(out)[v] = p;
      }
      GRID_STRIDE(i, n - nv * 8) {
        const size_t j = nv * 8 + i;
        out[j] = from_acc<T>(op(to_acc(x[j]), to_acc(y[j])));
      }
      return;
    }
    GRID_STRIDE(i, n) out[i] = from_acc<T>(op(to_acc(x[i]), to_acc(y[i])));
    return;
  }
  // Rows of whole packs on both sides (narrowed views, a row broadcast against a matrix).
  if (n % 8 == 0 && packs8(al, a) && packs8(bl, b) && aligned16(out)) {
    GRID_STRIDE(v, n / 8) {
      Pack8<T> p = *reinterpret_cast<const Pack8<T>*>(a + offset_of(al, v * 8));
      const Pack8<T> q = *reinterpret_cast<const Pack8<T>*>(b + offset_of(bl, v * 8));
#pragma unroll
      for (int k = 0; k < 8; ++k) p.v[k] = from_acc<T>(op(to_acc(p.v[k]), to_acc(q.v[k])));
      reinterpret_cast<Pack8<T>*>(out)[v] = p;
    }
    return;
  }
  GRID_STRIDE(i, n) out[i] = from_acc<T>(op(to_acc(a[offset_of(al, i)]), to_acc(b[offset_of(bl, i)])));
}

#define BINARY_T(NAME, OP, SUF, T)                                                               \
  extern "C" __global__ void NAME##_##SUF(const T* a, StridedLayout al, const T* b, StridedLayout bl, \
                                          T* out, size_t n) {                                    \
    binary_impl<T, OP>(a, al, b, bl, out, n);                                                   \
  }
#define BINARY(NAME, OP)                  \
  BINARY_T(NAME, OP, f32, float)          \
  BINARY_T(NAME, OP, f64, double)         \
  BINARY_T(NAME, OP, bf16, __nv_bfloat16) \
  BINARY_T(NAME, OP, f16, __half)

BINARY(b_add, BAdd)
BINARY(b_sub, BSub)
BINARY(b_mul, BMul)
BINARY(b_div, BDiv)
BINARY(b_maximum, BMax)
BINARY(b_minimum, BMin)
BINARY(b_gelu_backward, BGeluBwd)
BINARY(b_gelu_tanh_backward, BGeluTanhBwd)
BINARY(b_silu_backward, BSiluBwd)

// ----- comparisons: 1 or 0 in the operands' dtype ------------------------------------------
struct CEq { __device__ bool operator()(double x, double y) const { return x == y; } };
struct CNe { __device__ bool operator()(double x, double y) const { return x != y; } };
struct CLt { __device__ bool operator()(double x, double y) const { return x < y; } };
struct CLe { __device__ bool operator()(double x, double y) const { return x <= y; } };
struct CGt { __device__ bool operator()(double x, double y) const { return x > y; } };
struct CGe { __device__ bool operator()(double x, double y) const { return x >= y; } };

// Compared in double: exact for every dtype, including u32.
#define CMP_T(NAME, OP, SUF, T)                                                                  \
  extern "C" __global__ void NAME##_##SUF(const T* a, StridedLayout al, const T* b, StridedLayout bl, \
                                          T* out, size_t n) {                                    \
    OP op;                                                                                       \
    GRID_STRIDE(i, n) {                                                                          \
      out[i] = from_f64<T>(op(to_f64(a[offset_of(al, i)]), to_f64(b[offset_of(bl, i)])) ? 1.0 : 0.0); \
    }                                                                                            \
  }
#define CMP(NAME, OP)                  \
  CMP_T(NAME, OP, f32, float)          \
  CMP_T(NAME, OP, f64, double)         \
  CMP_T(NAME, OP, bf16, __nv_bfloat16) \
  CMP_T(NAME, OP, f16, __half)         \
  CMP_T(NAME, OP, u32, uint32_t)

CMP(c_eq, CEq)
CMP(c_ne, CNe)
CMP(c_lt, CLt)
CMP(c_le, CLe)
CMP(c_gt, CGt)
CMP(c_ge, CGe)

// ----- where: out = mask != 0 ? t : f (the mask has the values' dtype) ---------------------
#define WHERE_T(SUF, T)                                                                          \
  extern "C" __global__ void where_##SUF(const T* m, StridedLayout ml, const T* t, StridedLayout tl, \
                                         const T* f, StridedLayout fl, T* out, size_t n) {      \
    GRID_STRIDE(i, n) {                                                                          \
      out[i] = to_f64(m[offset_of(ml, i)]) != 0.0 ? t[offset_of(tl, i)] : f[offset_of(fl, i)];  \
    }                                                                                            \
  }
WHERE_T(f32, float)
WHERE_T(f64, double)
WHERE_T(bf16, __nv_bfloat16)
WHERE_T(f16, __half)
WHERE_T(u32, uint32_t)

// ----- cast: through double, one rounding (bit-identical to the CPU backend) ---------------
template <typename S, typename D>
__device__ __forceinline__ void cast_impl(const S* in, StridedLayout l, D* out, size_t n) {
  if (is_contiguous(l)) {
    const S* src = in + l.offset;
    if (aligned16(src) && aligned16(out)) {
      const size_t nv = n / 8;
      GRID_STRIDE(v, nv) {
        const Pack8<S> p = reinterpret_cast<const Pack8<S>*>(src)[v];
        Pack8<D> q;
#pragma unroll
        for (int k = 0; k < 8; ++k) q.v[k] = from_f64<D>(to_f64(p.v[k]));
        reinterpret_cast<Pack8<D>*>(out)[v] = q;
      }
      GRID_STRIDE(i, n - nv * 8) out[nv * 8 + i] = from_f64<D>(to_f64(src[nv * 8 + i]));
      return;
    }
    GRID_STRIDE(i, n) out[i] = from_f64<D>(to_f64(src[i]));
    return;
  }
  if (n % 8 == 0 && packs8(l, in) && aligned16(out)) {
    GRID_STRIDE(v, n / 8) {
      const Pack8<S> p = *reinterpret_cast<const Pack8<S>*>(in + offset_of(l, v * 8));
      Pack8<D> q;
#pragma unroll
      for (int k = 0; k < 8; ++k) q.v[k] = from_f64<D>(to_f64(p.v[k]));
      reinterpret_cast<Pack8<D>*>(out)[v] = q;
    }
    return;
  }
  GRID_STRIDE(i, n) out[i] = from_f64<D>(to_f64(in[offset_of(l, i)]));
}

#define CAST(SS, S, DS, D)                                                                        \
  extern "C" __global__ void cast_##SS##_##DS(const S* in, StridedLayout l, D* out, size_t n) { \
    cast_impl<S, D>(in, l, out, n);                                                              \
  }
#define CAST_FROM(SS, S)                \
  CAST(SS, S, f32, float)               \
  CAST(SS, S, f64, double)              \
  CAST(SS, S, bf16, __nv_bfloat16)      \
  CAST(SS, S, f16, __half)              \
  CAST(SS, S, u32, uint32_t)
CAST_FROM(f32, float)
CAST_FROM(f64, double)
CAST_FROM(bf16, __nv_bfloat16)
CAST_FROM(f16, __half)
CAST_FROM(u32, uint32_t)

// ----- strided copy: dst view <- src view, by element size ---------------------------------
// Whole packs of 8 where both views allow them (contiguous runs, the slices of a concatenation,
// permuted heads with a contiguous head dim), element by element otherwise.
template <typename T>
__device__ __forceinline__ void copy_impl(const T* in, StridedLayout sl, T* out, StridedLayout dl, size_t n) {
  if (n % 8 == 0 && packs8(sl, in) && packs8(dl, out)) {
    GRID_STRIDE(v, n / 8) {
      *reinterpret_cast<Pack8<T>*>(out + offset_of(dl, v * 8)) =
          *reinterpret_cast<const Pack8<T>*>(in + offset_of(sl, v * 8));
    }
    return;
  }
  if (is_contiguous(sl) && is_contiguous(dl)) {
    GRID_STRIDE(i, n) out[dl.offset + i] = in[sl.offset + i];
    return;
  }
  GRID_STRIDE(i, n) out[offset_of(dl, i)] = in[offset_of(sl, i)];
}
#define COPY(SUF, T)                                                                             \
  extern "C" __global__ void copy_##SUF(const T* in, StridedLayout sl, T* out, StridedLayout dl, \
                                        size_t n) {                                              \
    copy_impl<T>(in, sl, out, dl, n);                                                            \
  }
COPY(b16, uint16_t)
COPY(b32, uint32_t)
COPY(b64, uint64_t)
