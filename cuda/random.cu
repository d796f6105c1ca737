// Counter-based random numbers: Philox4x32-10 (Salmon et al., SC 2011), the same stream as the
// CPU backend (src/backend/cpu/random.rs): element i takes lane i % 4 of the block whose
// counter is (i / 4 as u64, 0) under key = seed. Uniform: ((x >> 8) + 0.5) * 2^-24, then
// lo + (hi - lo) * u in double. Normal: Box-Muller on lanes (0, 1) and (2, 3) in double.
// One thread per block of 4 elements.
#include "common.cuh"

__device__ __forceinline__ uint4 philox4x32_10(uint4 c, uint2 k) {
  const uint32_t M0 = 0xD2511F53u, M1 = 0xCD9E8D57u, W0 = 0x9E3779B9u, W1 = 0xBB67AE85u;
#pragma unroll
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      k.x += W0;
      k.y += W1;
    }
    const uint32_t hi0 = __umulhi(M0, c.x), lo0 = M0 * c.x;
    const uint32_t hi1 = __umulhi(M1, c.z), lo1 = M1 * c.z;
    c = make_uint4(hi1 ^ c.y ^ k.x, lo1, hi0 ^ c.w ^ k.y, lo0);
  }
  return c;
}

__device__ __forceinline__ double to_unit(uint32_t x) { return ((double)(x >> 8) + 0.5) * (1.0 / 16777216.0); }

__device__ __forceinline__ uint4 block_bits(unsigned long long seed, size_t b) {
  return philox4x32_10(make_uint4((uint32_t)b, (uint32_t)(b >> 32), 0u, 0u),
                       make_uint2((uint32_t)seed, (uint32_t)(seed >> 32)));
}

#define RANDOM(SUF, T)                                                                              \
  extern "C" __global__ void rand_uniform_##SUF(T* out, size_t n, unsigned long long seed, double lo, \
                                                double hi) {                                        \
    GRID_STRIDE(b, (n + 3) / 4) {                                                                   \
      const uint4 x = block_bits(seed, b);                                                          \
      const uint32_t lanes[4] = {x.x, x.y, x.z, x.w};                                               \
      for (int k = 0; k < 4 && 4 * b + k < n; ++k) out[4 * b + k] = from_f64<T>(lo + (hi - lo) * to_unit(lanes[k])); \
    }                                                                                               \
  }                                                                                                 \
  extern "C" __global__ void rand_normal_##SUF(T* out, size_t n, unsigned long long seed, double mean, \
                                               double std) {                                        \
    GRID_STRIDE(b, (n + 3) / 4) {                                                                   \
      const uint4 x = block_bits(seed, b);                                                          \
      const double r0 = sqrt(-2.0 * log(to_unit(x.x))), t0 = 6.283185307179586 * to_unit(x.y);      \
      const double r1 = sqrt(-2.0 * log(to_unit(x.z))), t1 = 6.283185307179586 * to_unit(x.w);      \
      const double z[4] = {r0 * cos(t0), r0 * sin(t0), r1 * cos(t1), r1 * sin(t1)};                 \
      for (int k = 0; k < 4 && 4 * b + k < n; ++k) out[4 * b + k] = from_f64<T>(mean + std * z[k]); \
    }                                                                                               \
  }
RANDOM(f32, float)
RANDOM(f64, double)
RANDOM(bf16, __nv_bfloat16)
RANDOM(f16, __half)
