// Decoding the host link's lossless bf16 code (format and the CPU reference in
// src/backend/wire.rs): a warp per chunk of 4096 values, a thread per run of 128 taken four
// consecutive values a step with the warp's 32 runs side by side (so every load and store of
// the warp is one contiguous piece), each code looked up in a table of the next 10 bits.
//
//   sm      (len, to 16)  u8    sign in bit 7, mantissa in bits 0-6
//   table   (1024)        u16   next 10 bits (first bit lowest) -> exponent | length << 8
//   chunks  (chunks)      u32   the word each chunk's interleaved streams start at
//   bits    (words + 64)  u32   word w of run t of a chunk at chunks[c] + 32 w + t
//   out     (len)         bf16
#include <stdint.h>

#define WIRE_STEPS 32
#define WIRE_MAX_LEN 10
#define WIRE_TABLE (1 << WIRE_MAX_LEN)

// One coded tensor's run `t` (a thread's share: see the header).
__device__ __forceinline__ void wire_decode_run(const uint8_t* __restrict__ sm, const uint16_t* __restrict__ table,
                                                const uint32_t* __restrict__ chunks,
                                                const uint32_t* __restrict__ bits, uint16_t* __restrict__ out,
                                                unsigned long long len, int vec_out, unsigned long long t) {
  // The table is read through the read-only cache (2 KiB, hot after the first lookups), not
  // staged in shared memory: a block that needs none fits beside a GEMM's on an SM, so the
  // decode (on a high-priority stream) runs while the compute does.
  const unsigned long long c = t / 32;
  const uint32_t lane = (uint32_t)(t & 31);
  const unsigned long long base = c * 32 * 4 * WIRE_STEPS;
  if (base + 4ull * lane >= len) return;
  // Word w of this run's stream.
  const uint32_t* w = bits + chunks[c] + lane;
  // `buf` holds `have` bits of the stream, the next code's first bit lowest.
  uint64_t buf = (uint64_t)w[0] | ((uint64_t)w[32] << 32);
  int have = 64;
  w += 64;
  for (int k = 0; k < WIRE_STEPS; ++k) {
    const unsigned long long at = base + 4ull * (32 * k + lane);
    if (at >= len) break;
    const int n = (int)min(4ull, len - at);
    uint32_t b4;
    if (n == 4) {
      b4 = *reinterpret_cast<const uint32_t*>(sm + at);
    } else {
      b4 = 0;
      for (int j = 0; j < n; ++j) b4 |= (uint32_t)sm[at + j] << (8 * j);
    }
    uint32_t v[2] = {0, 0};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if (j < n) {
        if (have < WIRE_MAX_LEN) {
          buf |= (uint64_t)(*w) << have;
          w += 32;
          have += 32;
        }
        const uint32_t e = __ldg(table + (buf & (WIRE_TABLE - 1)));
        const int l = (int)(e >> 8);
        buf >>= l;
        have -= l;
        const uint32_t b = (b4 >> (8 * j)) & 0xFFu;
        const uint32_t x = ((b & 0x80u) << 8) | ((e & 0xFFu) << 7) | (b & 0x7Fu);
        v[j >> 1] |= x << (16 * (j & 1));
      }
    }
    if (vec_out && n == 4) {
      *reinterpret_cast<uint2*>(out + at) = make_uint2(v[0], v[1]);
    } else {
      for (int j = 0; j < n; ++j) out[at + j] = (uint16_t)(v[j >> 1] >> (16 * (j & 1)));
    }
  }
}

// Up to WIRE_BATCH coded tensors decoded in one launch (a staged piece's coded parts): part i
// takes blocks first_block[i] .. first_block[i + 1] - 1, a thread a run as above. Must match
// `WireParts` in src/backend/cuda/host.rs.
#define WIRE_BATCH 32
struct WireParts {
  unsigned long long sm[WIRE_BATCH];
  unsigned long long table[WIRE_BATCH];
  unsigned long long chunks[WIRE_BATCH];
  unsigned long long bits[WIRE_BATCH];
  unsigned long long out[WIRE_BATCH];
  unsigned long long len[WIRE_BATCH];
  unsigned int first_block[WIRE_BATCH + 1];
  unsigned int count;
};

extern "C" __global__ void wire_decode_bf16(const WireParts p) {
  // The block's part, its fields read with constant indices (a dynamic index into a kernel
  // parameter would copy the whole struct to local memory).
  unsigned long long sm = 0, table = 0, chunks = 0, bits = 0, out = 0, len = 0;
  unsigned int first = 0;
#pragma unroll
  for (int i = 0; i < WIRE_BATCH; ++i) {
    if (i < (int)p.count && blockIdx.x >= p.first_block[i]) {
      sm = p.sm[i];
      table = p.table[i];
      chunks = p.chunks[i];
      bits = p.bits[i];
      out = p.out[i];
      len = p.len[i];
      first = p.first_block[i];
    }
  }
  const unsigned long long t = (blockIdx.x - first) * (unsigned long long)blockDim.x + threadIdx.x;
  wire_decode_run(reinterpret_cast<const uint8_t*>(sm), reinterpret_cast<const uint16_t*>(table),
                  reinterpret_cast<const uint32_t*>(chunks), reinterpret_cast<const uint32_t*>(bits),
                  reinterpret_cast<uint16_t*>(out), len, (int)(out % 16 == 0), t);
}

// Copies `n` bytes from `src` to `dst` (both 16-byte aligned): a staged upload's raw parts
// into place on the decode stream. A kernel, not a device-to-device memcpy, so the copy runs
// on the SMs and never queues on a copy engine behind the link's next pieces.
extern "C" __global__ void wire_copy_bytes(const uint8_t* __restrict__ src, uint8_t* __restrict__ dst,
                                           unsigned long long n) {
  const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
  const unsigned long long i0 = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
  for (unsigned long long i = i0; i < n / 16; i += stride)
    reinterpret_cast<uint4*>(dst)[i] = reinterpret_cast<const uint4*>(src)[i];
  for (unsigned long long i = n / 16 * 16 + i0; i < n; i += stride) dst[i] = src[i];
}
