// Vector math shared by the kernels of every ISA build (vec_kernels.h, gemm_avx512_bf16.cpp): the
// exp of the softmax and the epilogue activations. Internal linkage, so builds with different flags
// never share a definition at link time.
//
// exp (exp_fast): e^x = 2^n * e^r with n = round(x log2 e) and r = x - n ln 2 in [-ln2 / 2, ln2 / 2]
// (ln 2 in two parts, so r is exact to fp32 rounding for every x); e^r by a degree-5 polynomial (a
// relative minimax fit: at most 2.1e-7 relative error in fp32, about 2 ulp); 2^n applied by one
// vscalefps, which also gives 0 below the fp32 range and inf above it. 12 instructions per AVX-512
// vector, against 19 for ATen's exp_u20 (its error bound is 20 ulp), which was the largest single
// cost of the softmax in attention on an AMX Xeon. Other ISAs: exp_u20.
//
// No function here returns a subnormal number: below fp32's normal range the result is 0. On Intel
// cores an instruction that produces a subnormal takes a microcode assist (tens to hundreds of
// cycles); with the gelu of the GEMM epilogue computing e^(-z^2) for z up to 13 (a linear's outputs
// of standard deviation 6), ATen's erf made that linear 2.2x slower than on small values
// (interleaved calls in one process, 2 threads of an AMX Xeon: 784 x 32 x 4096 with gelu 5.3 ms
// against 2.4 ms; 2.1 ms with flush-to-zero).
#pragma once

#include <ATen/cpu/vec/vec.h>

#include <cmath>

#include "common.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace amxopt {
namespace {

constexpr float kLog2e = 1.4426950408889634f;

// e^x; 0 below e^-87.33 (the smallest normal fp32 is e^-87.34), inf above e^89, NaN for NaN (a
// softmax over a NaN score must give NaN, as ATen's does, not treat the key as masked).
inline at::vec::Vectorized<float> exp_fast(at::vec::Vectorized<float> x) {
#if defined(__AVX512F__)
  const __m512 v = _mm512_min_ps(_mm512_max_ps(__m512(x), _mm512_set1_ps(-88.f)), _mm512_set1_ps(89.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(v, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.6931471824645996f), v);  // ln 2 = hi + lo
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-1.9046542121259336e-09f), r);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(8.297654800117016e-3f), r, _mm512_set1_ps(4.191538318991661e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6667574644088745e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.9998894333839417e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(9.999997019767761e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0000001192092896f));
  // p 2^n, rounded once, inf past the top; where x >= -87.33, n >= -126 and p 2^n is normal.
  const __mmask16 normal = _mm512_cmp_ps_mask(__m512(x), _mm512_set1_ps(-87.33f), _CMP_GE_OQ);
  const __mmask16 nan = _mm512_cmp_ps_mask(__m512(x), __m512(x), _CMP_UNORD_Q);
  return _mm512_mask_mov_ps(_mm512_maskz_scalef_ps(normal, p, n), nan, __m512(x));
#else
  return at::vec::clamp_min(x, at::vec::Vectorized<float>(-87.f)).exp_u20();  // e^-87 is normal
#endif
}

// 2^t for t <= 0 (larger t is correct too, up to 2^127), at most 7.5e-5 relative error: for values
// rounded to bf16 next, whose rounding error is up to 2^-9 = 2e-3 (the softmax's P on the AMX tier).
// vreduceps splits off r = t - floor(t) in [0, 1), a degree-3 minimax polynomial gives 2^r, and
// vscalefps multiplies by 2^floor(t) itself: 7 instructions with the caller's fmsub folding log2(e)
// into the scale, against 9 with a separate round, subtract and clamp. 0 below t = -126 (where the
// result would be subnormal); NaN stays NaN.
inline at::vec::Vectorized<float> exp2_for_bf16(at::vec::Vectorized<float> t) {
#if defined(__AVX512DQ__)
  const __m512 r = _mm512_reduce_ps(__m512(t), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(7.8024164094e-2f), r, _mm512_set1_ps(2.2606782266e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(6.9583319469e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(9.9992526318e-1f));
  const __mmask16 normal = _mm512_cmp_ps_mask(__m512(t), _mm512_set1_ps(-126.f), _CMP_NLT_UQ);
  return _mm512_maskz_scalef_ps(normal, p, __m512(t));
#else
  return (at::vec::clamp_min(t, at::vec::Vectorized<float>(-126.f)) * at::vec::Vectorized<float>(float(M_LN2)))
      .exp_u20();
#endif
}

#if defined(__AVX512F__)
// v (1 + erf(v / sqrt 2)) / 2 with erf by Abramowitz & Stegun 7.1.26 (|error| <= 1.5e-7, the formula
// of ATen's erf): for z = |v| / sqrt 2, 1 - erf(z) = q(t) t e^(-z^2) with t = 1 / (1 + 0.3275911 z),
// so the factor is 1 - q t e^(-z^2) / 2 for v >= 0 and q t e^(-z^2) / 2 below (no cancellation there:
// ATen's 1 + erf gives 0 from v = -5.7 on). z is capped at 8.9, where q t e^(-z^2) is 1e-37 and
// still normal; below v = -12.59 (the cap) the result is -0, what ATen gives there (v times the
// capped tail would grow with |v|: -1.3 at v = -1e36). NaN stays NaN (the cap makes z finite; v
// multiplies last). 25-33 cycles per vector on one core of an AMX Xeon, against 32-44 for ATen's
// erf (which calls Sleef's exp) and 100-260 once its e^(-z^2) goes subnormal.
inline __m512 gelu_erf(__m512 v) {
  const __m512 z_uncapped = _mm512_mul_ps(_mm512_abs_ps(v), _mm512_set1_ps(float(M_SQRT1_2)));
  const __m512 z = _mm512_min_ps(z_uncapped, _mm512_set1_ps(8.9f));
  const __m512 d = _mm512_fmadd_ps(_mm512_set1_ps(0.3275911f), z, _mm512_set1_ps(1.f));
  const __m512 t = _mm512_div_ps(_mm512_set1_ps(1.f), d);
  // A&S's q(t) = p1 + p2 t + ... + p5 t^4, halved.
  __m512 q = _mm512_fmadd_ps(_mm512_set1_ps(0.5f * 1.061405429f), t, _mm512_set1_ps(0.5f * -1.453152027f));
  q = _mm512_fmadd_ps(q, t, _mm512_set1_ps(0.5f * 1.421413741f));
  q = _mm512_fmadd_ps(q, t, _mm512_set1_ps(0.5f * -0.284496736f));
  q = _mm512_fmadd_ps(q, t, _mm512_set1_ps(0.5f * 0.254829592f));
  const __m512 e = __m512(exp_fast(at::vec::Vectorized<float>(_mm512_mul_ps(z, z)).neg()));
  const __m512 tail = _mm512_mul_ps(_mm512_mul_ps(q, t), e);  // (1 - erf(z)) / 2
  const __mmask16 neg = _mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_LT_OQ);
  const __mmask16 far = neg & _mm512_cmp_ps_mask(z_uncapped, _mm512_set1_ps(8.9f), _CMP_GE_OQ);
  const __m512 y = _mm512_mul_ps(v, _mm512_mask_mov_ps(_mm512_sub_ps(_mm512_set1_ps(1.f), tail), neg, tail));
  return _mm512_mask_mov_ps(y, far, _mm512_set1_ps(-0.f));
}
#endif

// An epilogue activation on fp32 values.
inline at::vec::Vectorized<float> activate(at::vec::Vectorized<float> v, Act act) {
  using fVec = at::vec::Vectorized<float>;
  switch (act) {
    case Act::None:
      return v;
    case Act::Gelu:
#if defined(__AVX512F__)
      return gelu_erf(v);
#else  // erf(+-4) rounds to +-1; the cap keeps e^(-z^2) in ATen's erf normal
      return v * (fVec(0.5f) + fVec(0.5f) * at::vec::clamp(v * fVec(float(M_SQRT1_2)), fVec(-4.f), fVec(4.f)).erf());
#endif
    case Act::GeluTanh: {
      // 0.5 x (1 + tanh(u)) == x * sigmoid(2u): one exp instead of a tanh (Sleef's tanh was 20% of
      // Wan's FFN-up GEMM). For u -> +inf the quotient is x, for u -> -inf it is -0.
      const fVec u2 = fVec(-2.0f * 0.7978845608028654f) * (v + fVec(0.044715f) * v * v * v);
      return v / (fVec(1.0f) + exp_fast(u2));
    }
    case Act::Silu:
      return v / (fVec(1.0f) + exp_fast(v.neg()));
  }
  return v;
}

}  // namespace
}  // namespace amxopt
