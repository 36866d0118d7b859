// Shared helpers for amxopt's native CPU kernels (AVX-512 + AVX-512-BF16).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>

namespace amxopt {

using bf16 = at::BFloat16;
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

}  // namespace amxopt
