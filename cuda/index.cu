// index_select, gather, scatter_add over contiguous (outer, size, inner) blocks; the launcher
// makes operands contiguous. An index past its dim sets *bad (and the element is skipped);
// the launcher reads the flag and returns an error, as the CPU backend does.
#include "common.cuh"

// out[o, j, i] = src[o, ids[j], i]
#define INDEX_SELECT(SUF, T)                                                                       \
  extern "C" __global__ void index_select_##SUF(const T* src, const uint32_t* ids, T* out, size_t outer, \
                                                size_t size, size_t n_ids, size_t inner, uint32_t* bad) { \
    GRID_STRIDE(k, outer * n_ids * inner) {                                                        \
      const size_t i = k % inner, j = (k / inner) % n_ids, o = k / (inner * n_ids);                \
      const uint32_t id = ids[j];                                                                  \
      if (id >= size) {                                                                            \
        *bad = 1;                                                                                  \
        continue;                                                                                  \
      }                                                                                            \
      out[k] = src[(o * size + id) * inner + i];                                                   \
    }                                                                                              \
  }

// out[o, j, i] = src[o, ids[o, j, i], i]
#define GATHER(SUF, T)                                                                             \
  extern "C" __global__ void gather_##SUF(const T* src, const uint32_t* ids, T* out, size_t outer,  \
                                          size_t size, size_t n_j, size_t inner, uint32_t* bad) {  \
    GRID_STRIDE(k, outer * n_j * inner) {                                                          \
      const size_t i = k % inner, o = k / (inner * n_j);                                           \
      const uint32_t id = ids[k];                                                                  \
      if (id >= size) {                                                                            \
        *bad = 1;                                                                                  \
        continue;                                                                                  \
      }                                                                                            \
      out[k] = src[(o * size + id) * inner + i];                                                   \
    }                                                                                              \
  }

// out[o, ids[o, j, i], i] += src[o, j, i]: one thread per (o, i) column walks j in order, so
// there are no atomics and the sum order (hence the rounding) matches the CPU backend.
#define SCATTER_ADD(SUF, T)                                                                        \
  extern "C" __global__ void scatter_add_##SUF(T* out, const uint32_t* ids, const T* src, size_t outer, \
                                               size_t size, size_t n_j, size_t inner, uint32_t* bad) { \
    GRID_STRIDE(c, outer * inner) {                                                                \
      const size_t i = c % inner, o = c / inner;                                                   \
      for (size_t j = 0; j < n_j; ++j) {                                                           \
        const size_t k = (o * n_j + j) * inner + i;                                                \
        const uint32_t id = ids[k];                                                                \
        if (id >= size) {                                                                          \
          *bad = 1;                                                                                \
          continue;                                                                                \
        }                                                                                          \
        T* dst = &out[(o * size + id) * inner + i];                                                \
        *dst = from_acc<T>(to_acc(*dst) + to_acc(src[k]));                                         \
      }                                                                                            \
    }                                                                                              \
  }

#define INDEX_ALL(SUF, T) INDEX_SELECT(SUF, T) GATHER(SUF, T)
INDEX_ALL(f32, float)
INDEX_ALL(f64, double)
INDEX_ALL(bf16, __nv_bfloat16)
INDEX_ALL(f16, __half)
INDEX_ALL(u32, uint32_t)
SCATTER_ADD(f32, float)
SCATTER_ADD(f64, double)
SCATTER_ADD(bf16, __nv_bfloat16)
SCATTER_ADD(f16, __half)
