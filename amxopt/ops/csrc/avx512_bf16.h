// Helpers of the hand-written AVX-512-BF16 GEMM kernel (gemm_avx512_bf16.cpp): only that translation
// unit includes this, and it is compiled with the AVX-512-BF16 flags.
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

// 16 bf16 (masked) -> 16 fp32.
inline __m512 load_bf16_masked(const bf16* p, __mmask16 m) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, (const __m256i*)p)), 16));
}
// 16 fp32 -> 16 bf16 (masked), round to nearest even.
inline void store_bf16_masked(bf16* p, __m512 v, __mmask16 m) {
  _mm256_mask_storeu_epi16((__m256i*)p, m, (__m256i)_mm512_cvtneps_pbh(v));
}
inline __mmask16 tail_mask(int64_t n) { return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1); }

// --- bf16 dot-product blocks (AVX-512-BF16) ------------------------------------------------------
//
// B ("VNNI") layout: [ceil(N/kNB)][ceil(K/2)][kNB][2] bf16 - per block of 32 output columns, k pairs
// interleaved per column; zero padded. A ("pairs") layout: chunks of kMR rows, [ceil(K/2)][kMR]
// uint32, each uint32 two consecutive-k bf16 of one row; zero padded.
constexpr int kMR = 12;      // rows per A chunk (24 accumulators + 2 B + 1 A registers)

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
