// Vector math shared by the kernels of every ISA build (vec_kernels.h, avx512_bf16.h): the exp of the
// softmax and the epilogue activations. Internal linkage, so builds with different flags never share
// a definition at link time.
//
// exp (exp_fast): e^x = 2^n * e^r with n = round(x log2 e) and r = x - n ln 2 in [-ln2 / 2, ln2 / 2]
// (ln 2 in two parts, so r is exact to fp32 rounding for every x); e^r by a degree-5 polynomial (a
// relative minimax fit: at most 2.1e-7 relative error in fp32, about 2 ulp); 2^n applied by one
// vscalefps, which also gives 0 below the fp32 range and inf above it. 12 instructions per AVX-512
// vector, against 19 for ATen's exp_u20 (its error bound is 20 ulp), which was the largest single
// cost of the softmax in attention on an AMX Xeon. Other ISAs: exp_u20.
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

// e^x. NaN gives 0 (exp_u20 gives a finite value too): callers never feed NaN on purpose.
inline at::vec::Vectorized<float> exp_fast(at::vec::Vectorized<float> x) {
#if defined(__AVX512F__)
  const __m512 v = _mm512_min_ps(_mm512_max_ps(__m512(x), _mm512_set1_ps(-104.f)), _mm512_set1_ps(89.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(v, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.6931471824645996f), v);  // ln 2 = hi + lo
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-1.9046542121259336e-09f), r);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(8.297654800117016e-3f), r, _mm512_set1_ps(4.191538318991661e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6667574644088745e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.9998894333839417e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(9.999997019767761e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0000001192092896f));
  return _mm512_scalef_ps(p, n);  // p 2^n, rounded once: subnormal or 0 at the bottom, inf past the top
#else
  return x.exp_u20();
#endif
}

// 2^t for t <= 0 (larger t is correct too, up to 2^127), at most 7.5e-5 relative error: for values
// rounded to bf16 next, whose rounding error is up to 2^-9 = 2e-3 (the softmax's P on the AMX tier).
// vreduceps splits off r = t - floor(t) in [0, 1), a degree-3 minimax polynomial gives 2^r, and
// vscalefps multiplies by 2^floor(t) itself (0 below the fp32 range): 6 instructions with the
// caller's fmsub folding log2(e) into the scale, against 8 with a separate round, subtract and clamp.
// NaN stays NaN.
inline at::vec::Vectorized<float> exp2_for_bf16(at::vec::Vectorized<float> t) {
#if defined(__AVX512DQ__)
  const __m512 r = _mm512_reduce_ps(__m512(t), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(7.8024164094e-2f), r, _mm512_set1_ps(2.2606782266e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(6.9583319469e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(9.9992526318e-1f));
  return _mm512_scalef_ps(p, __m512(t));
#else
  return (t * at::vec::Vectorized<float>(float(M_LN2))).exp_u20();
#endif
}

// An epilogue activation on fp32 values.
inline at::vec::Vectorized<float> activate(at::vec::Vectorized<float> v, Act act) {
  using fVec = at::vec::Vectorized<float>;
  switch (act) {
    case Act::None:
      return v;
    case Act::Gelu:
      return v * (fVec(0.5f) + fVec(0.5f) * (v * fVec(float(M_SQRT1_2))).erf());
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
