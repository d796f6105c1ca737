// Decoding the host link's lossless bf16 code (format and the CPU reference in
// src/backend/wire.rs): a thread per 16 values, a warp per chunk of 512.
//
//   sm       (padded)       u8    sign in bit 7, mantissa in bits 0-6
//   codes    (padded / 2)   u8    4-bit exponent codes, value 2k in the low nibble of byte k
//   offsets  (chunks)       u32   escapes before each chunk
//   escapes  (escaped)      u8    the exponents of values coded 15, in value order
//   out      (len)          bf16
//
// Each thread loads its 16 bytes of sm and 8 bytes of codes, counts its escapes, and an
// exclusive scan over the warp puts its first escape at offsets[chunk] plus the lanes before.
#include <stdint.h>

extern "C" __global__ void wire_decode_bf16(const uint8_t* __restrict__ sm, const uint8_t* __restrict__ codes,
                                            const uint32_t* __restrict__ offsets,
                                            const uint8_t* __restrict__ escapes, uint16_t* __restrict__ out,
                                            unsigned long long len, unsigned long long padded, uint32_t base,
                                            int vec_out) {
  const unsigned long long t = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
  const unsigned long long first = t * 16;
  // padded / 16 threads is a whole number of warps: a warp is in or out as a whole.
  if (first >= padded) return;
  const uint32_t lane = threadIdx.x & 31u;
  const uint4 s = *reinterpret_cast<const uint4*>(sm + first);
  const uint2 c = *reinterpret_cast<const uint2*>(codes + first / 2);
  int n = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    n += ((c.x >> (4 * j)) & 0xFu) == 0xFu;
    n += ((c.y >> (4 * j)) & 0xFu) == 0xFu;
  }
  int incl = n;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(0xFFFFFFFFu, incl, o);
    if (lane >= (uint32_t)o) incl += y;
  }
  uint32_t pos = offsets[t >> 5] + (uint32_t)(incl - n);
  const uint32_t sw[4] = {s.x, s.y, s.z, s.w};
  uint32_t v[8];
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    const uint32_t code = ((j < 8 ? c.x : c.y) >> (4 * (j & 7))) & 0xFu;
    const uint32_t e = code == 0xFu ? (uint32_t)escapes[pos++] : ((base + code) & 0xFFu);
    const uint32_t b = (sw[j >> 2] >> (8 * (j & 3))) & 0xFFu;
    const uint32_t x = ((b & 0x80u) << 8) | (e << 7) | (b & 0x7Fu);
    if (j & 1) v[j >> 1] |= x << 16; else v[j >> 1] = x;
  }
  if (vec_out && first + 16 <= len) {
    uint4* o = reinterpret_cast<uint4*>(out + first);
    o[0] = make_uint4(v[0], v[1], v[2], v[3]);
    o[1] = make_uint4(v[4], v[5], v[6], v[7]);
  } else {
#pragma unroll
    for (int j = 0; j < 16; ++j)
      if (first + j < len) out[first + j] = (uint16_t)(v[j >> 1] >> (16 * (j & 1)));
  }
}
