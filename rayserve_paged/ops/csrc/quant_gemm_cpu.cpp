// Group-quantized GEMM on the CPU: y = x W^T in float32, with W kept as 4- or 8-bit codes.
//
//   W[n, k] = scale[n, g] * code[n, k] + offset[n, g],   g = k / group_size
//
//   x       [M, K]                 float32, row-major
//   y       [M, N]                 float32, written
//   codes   [N / 16, K / 2, 16]    uint8, 4-bit: byte j of column pair p holds row j's code of
//                                  column 2p in its low nibble and of column 2p + 1 in its high one
//           [N / 16, K, 16]        uint8, 8-bit: one code per byte
//   scales, offsets [N / 16, K / group_size, 16]  float32
//
// Output rows come in blocks of 16 (one vector of lanes) so every load of codes feeds 16
// outputs, and the codes of a block (K * 8 bytes at 4 bits) stay in L1 while the rows of x
// pass over them in tiles of up to 8. Within a group the products are summed as code * x and
// the group's affine terms are applied once at its end:
//
//   y[m, n] += scale[n, g] * sum_k code[n, k] x[m, k]  +  offset[n, g] * sum_k x[m, k]
//
// so per weight and row there is one multiply-add in float32; the codes are converted to
// float once per tile. Nothing is rounded below float32 (the float32 path's weights exactly,
// summed in another order). Blocks of output rows are split over the threads.
//
// A plain C ABI with no torch headers (called through ctypes; see paged_decode_cpu.cpp).

#include <omp.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kLanes = 16;
constexpr int64_t kTile = 8;  // rows of x per pass over a block's codes

struct GemmArgs {
  const float* x;
  float* y;
  const uint8_t* codes;
  const float* scales;
  const float* offsets;
  const float* xsums;  // [M, K / group_size]: sum of x over each group
  int64_t M, N, K, group_size, bits;
};

// Output block nb's codes, scales and offsets.
struct Block {
  const uint8_t* codes;
  const float* scales;
  const float* offsets;
  int64_t num_groups;
};

inline Block block_of(const GemmArgs& a, int64_t nb) {
  const int64_t num_groups = a.K / a.group_size;
  const int64_t code_cols = a.bits == 4 ? a.K / 2 : a.K;
  return {a.codes + nb * code_cols * kLanes, a.scales + nb * num_groups * kLanes, a.offsets + nb * num_groups * kLanes,
          num_groups};
}

// Rows [m0, m0 + ROWS) of x against output block nb. ROWS is the tile's row count, fixed at
// compile time so the accumulators live in registers.
#if defined(__AVX512F__)
// One vector of 16 lanes per row: the codes of a column (pair) are widened and converted
// once, then multiplied into every row of the tile.
template <int ROWS>
void block_tile(const GemmArgs& a, const Block& b, int64_t nb, int64_t m0) {
  const float* x = a.x + m0 * a.K;
  // 4-bit codes become floats by a lookup (one permute; it reads only an index's low 4 bits,
  // so the low nibble needs no mask): fewer vector operations than mask / shift + convert
  const __m512 code_values = _mm512_setr_ps(0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f, 8.f, 9.f, 10.f, 11.f, 12.f, 13.f,
                                            14.f, 15.f);
  __m512 acc[ROWS];
  for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < b.num_groups; ++g) {
    __m512 part[ROWS], part2[ROWS];  // two chains per row: even and odd columns
    for (int r = 0; r < ROWS; ++r) part[r] = part2[r] = _mm512_setzero_ps();
    const int64_t k0 = g * a.group_size;
    if (a.bits == 4) {
      for (int64_t k = k0; k < k0 + a.group_size; k += 2) {
        const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b.codes + (k / 2) * kLanes)));
        const __m512 lo = _mm512_permutexvar_ps(c, code_values);
        const __m512 hi = _mm512_permutexvar_ps(_mm512_srli_epi32(c, 4), code_values);
        for (int r = 0; r < ROWS; ++r) {
          part[r] = _mm512_fmadd_ps(lo, _mm512_set1_ps(x[r * a.K + k]), part[r]);
          part2[r] = _mm512_fmadd_ps(hi, _mm512_set1_ps(x[r * a.K + k + 1]), part2[r]);
        }
      }
    } else {
      for (int64_t k = k0; k < k0 + a.group_size; k += 2) {
        const __m128i* c = reinterpret_cast<const __m128i*>(b.codes + k * kLanes);
        const __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(c)));
        const __m512 w1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(c + 1)));
        for (int r = 0; r < ROWS; ++r) {
          part[r] = _mm512_fmadd_ps(w0, _mm512_set1_ps(x[r * a.K + k]), part[r]);
          part2[r] = _mm512_fmadd_ps(w1, _mm512_set1_ps(x[r * a.K + k + 1]), part2[r]);
        }
      }
    }
    for (int r = 0; r < ROWS; ++r) part[r] = _mm512_add_ps(part[r], part2[r]);
    const __m512 s = _mm512_loadu_ps(b.scales + g * kLanes);
    const __m512 o = _mm512_loadu_ps(b.offsets + g * kLanes);
    for (int r = 0; r < ROWS; ++r) {
      acc[r] = _mm512_fmadd_ps(s, part[r], acc[r]);
      acc[r] = _mm512_fmadd_ps(o, _mm512_set1_ps(a.xsums[(m0 + r) * b.num_groups + g]), acc[r]);
    }
  }
  for (int r = 0; r < ROWS; ++r) _mm512_storeu_ps(a.y + (m0 + r) * a.N + nb * kLanes, acc[r]);
}

#else
// Portable: the same loops over 16 lanes, vectorised by the compiler.
template <int ROWS>
void block_tile(const GemmArgs& a, const Block& b, int64_t nb, int64_t m0) {
  float acc[ROWS][kLanes] = {};
  for (int64_t g = 0; g < b.num_groups; ++g) {
    float part[ROWS][kLanes] = {};
    const int64_t k0 = g * a.group_size;
    if (a.bits == 4) {
      for (int64_t k = k0; k < k0 + a.group_size; k += 2) {
        const uint8_t* c = b.codes + (k / 2) * kLanes;
        float lo[kLanes], hi[kLanes];
#pragma omp simd
        for (int64_t j = 0; j < kLanes; ++j) {
          lo[j] = static_cast<float>(c[j] & 15);
          hi[j] = static_cast<float>(c[j] >> 4);
        }
        for (int r = 0; r < ROWS; ++r) {
          const float x0 = a.x[(m0 + r) * a.K + k], x1 = a.x[(m0 + r) * a.K + k + 1];
#pragma omp simd
          for (int64_t j = 0; j < kLanes; ++j) part[r][j] += lo[j] * x0 + hi[j] * x1;
        }
      }
    } else {
      for (int64_t k = k0; k < k0 + a.group_size; ++k) {
        const uint8_t* c = b.codes + k * kLanes;
        float w[kLanes];
#pragma omp simd
        for (int64_t j = 0; j < kLanes; ++j) w[j] = static_cast<float>(c[j]);
        for (int r = 0; r < ROWS; ++r) {
          const float x0 = a.x[(m0 + r) * a.K + k];
#pragma omp simd
          for (int64_t j = 0; j < kLanes; ++j) part[r][j] += w[j] * x0;
        }
      }
    }
    const float* s = b.scales + g * kLanes;
    const float* o = b.offsets + g * kLanes;
    for (int r = 0; r < ROWS; ++r) {
      const float xs = a.xsums[(m0 + r) * b.num_groups + g];
#pragma omp simd
      for (int64_t j = 0; j < kLanes; ++j) acc[r][j] += s[j] * part[r][j] + o[j] * xs;
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    float* out = a.y + (m0 + r) * a.N + nb * kLanes;
#pragma omp simd
    for (int64_t j = 0; j < kLanes; ++j) out[j] = acc[r][j];
  }
}

#endif

using TileFn = void (*)(const GemmArgs&, const Block&, int64_t, int64_t);
constexpr TileFn kTiles[kTile + 1] = {nullptr,       block_tile<1>, block_tile<2>, block_tile<3>, block_tile<4>,
                                      block_tile<5>, block_tile<6>, block_tile<7>, block_tile<8>};

// Output block nb for all M rows, a tile of up to kTile rows at a time.
void block(const GemmArgs& a, int64_t nb) {
  const Block b = block_of(a, nb);
  for (int64_t m0 = 0; m0 < a.M; m0 += kTile) kTiles[a.M - m0 < kTile ? a.M - m0 : kTile](a, b, nb, m0);
}

}  // namespace

extern "C" {

// Returns 0, or 1 when the shapes do not fit the layout (nothing written).
int rayserve_group_quant_gemm_f32(const float* x, float* y, const uint8_t* codes, const float* scales,
                                  const float* offsets, int64_t M, int64_t N, int64_t K, int64_t group_size,
                                  int64_t bits, int num_threads) {
  if (M < 0 || N % kLanes || group_size <= 0 || group_size % 2 || K % group_size || (bits != 4 && bits != 8)) return 1;
  if (M == 0 || N == 0) return 0;
  const int64_t num_groups = K / group_size;
  std::vector<float> xsums(M * num_groups);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < num_groups; ++g) {
      float sum = 0.f;
      for (int64_t k = g * group_size; k < (g + 1) * group_size; ++k) sum += x[m * K + k];
      xsums[m * num_groups + g] = sum;
    }
  const GemmArgs args{x, y, codes, scales, offsets, xsums.data(), M, N, K, group_size, bits};
  const int64_t num_blocks = N / kLanes;
  if (num_threads <= 1) {
    for (int64_t nb = 0; nb < num_blocks; ++nb) block(args, nb);
  } else {
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t nb = 0; nb < num_blocks; ++nb) block(args, nb);
  }
  return 0;
}

}  // extern "C"
