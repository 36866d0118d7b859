// Helpers of the hand-written AVX-512-BF16 kernels (gemm_avx512_bf16.cpp, attention_avx512_bf16.cpp):
// only those translation units include this, and they are compiled with the AVX-512-BF16 flags.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <immintrin.h>

#include "common.h"
#include "vec_math.h"

#include <array>
#include <cmath>
#include <utility>
#include <cstdint>

namespace amxopt {

using fVec = at::vec::Vectorized<float>;

// 16 bf16 (one 256-bit load) -> 16 fp32.
inline __m512 load_bf16(const bf16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
inline __m512 load_bf16_masked(const bf16* p, __mmask16 m) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, (const __m256i*)p)), 16));
}
// 16 fp32 -> 16 bf16, round to nearest even.
inline void store_bf16(bf16* p, __m512 v) { _mm256_storeu_si256((__m256i*)p, (__m256i)_mm512_cvtneps_pbh(v)); }
inline void store_bf16_masked(bf16* p, __m512 v, __mmask16 m) {
  _mm256_mask_storeu_epi16((__m256i*)p, m, (__m256i)_mm512_cvtneps_pbh(v));
}
inline __mmask16 tail_mask(int64_t n) { return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1); }

inline float hsum(__m512 v) { return _mm512_reduce_add_ps(v); }

// --- bf16 dot-product blocks (AVX-512-BF16), shared by the GEMM and attention kernels -----------
//
// B ("VNNI") layout: [ceil(N/kNB)][ceil(K/2)][kNB][2] bf16 - per block of 32 output columns, k pairs
// interleaved per column; zero padded. A ("pairs") layout: chunks of kMR rows, [ceil(K/2)][kMR]
// uint32, each uint32 two consecutive-k bf16 of one row; zero padded.
constexpr int kMR = 12;      // rows per A chunk (24 accumulators + 2 B + 1 A registers)

// B[n][k] = src[n * ld + k] for n < N, k < K, packed VNNI; dst must be zeroed (padding).
inline void pack_b_vnni(const bf16* src, int64_t ld, int64_t N, int64_t K, bf16* dst) {
  const int64_t pairs = (K + 1) / 2;
  uint32_t* d32 = reinterpret_cast<uint32_t*>(dst);
  for (int64_t n = 0; n < N; ++n) {  // a row's k pairs are already adjacent: copy them as uint32
    const bf16* row = src + n * ld;
    uint32_t* col = d32 + (n / kNB) * pairs * kNB + (n % kNB);
    for (int64_t p = 0; p < K / 2; ++p) col[p * kNB] = reinterpret_cast<const uint32_t*>(row)[p];
    if (K & 1) col[(K / 2) * kNB] = uint32_t(row[K - 1].x);
  }
}

// B[n][k] = src[k * ld + n] (src holds B transposed, e.g. V [keys, D] as B with N = D), packed VNNI
// with `pairs` (>= ceil(K/2)) k pairs per column block; dst must be zeroed. Two source rows are
// interleaved 32 columns at a time (one 128-byte store per k pair and column block).
inline void pack_b_vnni_t(const bf16* src, int64_t ld, int64_t N, int64_t K, int64_t pairs, bf16* dst) {
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, 37,
                                      5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  for (int64_t k = 0; k < K; k += 2) {
    const bf16* r0 = src + k * ld;
    const bf16* r1 = r0 + ld;
    for (int64_t n = 0; n < N; n += kNB) {
      const __mmask32 m = n + 32 <= N ? ~__mmask32(0) : __mmask32((1ull << (N - n)) - 1);
      const __m512i a = _mm512_maskz_loadu_epi16(m, r0 + n);
      const __m512i b = k + 1 < K ? _mm512_maskz_loadu_epi16(m, r1 + n) : _mm512_setzero_si512();
      bf16* out = dst + (n / kNB) * pairs * kNB * 2 + (k / 2) * kNB * 2;
      _mm512_storeu_si512(out, _mm512_permutex2var_epi16(a, lo, b));
      _mm512_storeu_si512(out + 32, _mm512_permutex2var_epi16(a, hi, b));
    }
  }
}

// One chunk of up to kMR rows of A (rows ld apart) into the pairs layout, rows beyond `rows` zeroed.
inline void pack_a_chunk(const bf16* src, int64_t ld, int64_t rows, int64_t K, uint32_t* dst) {
  const int64_t pairs = (K + 1) / 2;
  for (int64_t i = 0; i < rows; ++i) {
    const bf16* row = src + i * ld;
    for (int64_t p = 0; p < K / 2; ++p) dst[p * kMR + i] = reinterpret_cast<const uint32_t*>(row)[p];
    if (K & 1) dst[(K / 2) * kMR + i] = uint32_t(row[K - 1].x);  // odd K: zero partner
  }
  for (int64_t i = rows; i < kMR; ++i)
    for (int64_t p = 0; p < pairs; ++p) dst[p * kMR + i] = 0u;
}

// acc[MR][2] += A chunk (pairs layout, `pairs` k pairs) x one 32-column B block.
template <int MR>
inline void dot_block(__m512 (&acc)[MR][2], const uint32_t* Ap, const bf16* B, int64_t pairs) {
  for (int64_t p = 0; p < pairs; ++p) {
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(B + p * 64);
    const __m512bh b1 = (__m512bh)_mm512_loadu_si512(B + p * 64 + 32);
#pragma GCC unroll 12
    for (int i = 0; i < MR; ++i) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(Ap[p * kMR + i]);
      acc[i][0] = _mm512_dpbf16_ps(acc[i][0], a, b0);
      acc[i][1] = _mm512_dpbf16_ps(acc[i][1], a, b1);
    }
  }
}

// Table of f<1>..f<kMR> so that a runtime row count picks a fully unrolled instantiation.
template <template <int> class F, int... Is>
constexpr auto make_row_table(std::integer_sequence<int, Is...>) {
  return std::array{F<Is + 1>::run...};
}

}  // namespace amxopt
