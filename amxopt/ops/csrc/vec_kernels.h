// The vector kernels of amxopt's drivers, written once with ATen's at::vec and compiled once per
// ISA: vec_default.cpp, vec_avx2.cpp, vec_avx512.cpp and vec_avx512_bf16.cpp each include this file
// with their own CPU_CAPABILITY and compiler flags, then publish the functions as a VecKernels table
// (common.h). The AVX512-BF16 build differs from the AVX-512 one only in round_bf16.
// Everything here has internal linkage, so the ISA builds never collide at link time.
//
// Memory layouts: rows are contiguous with a leading dimension; a VNNI column block is
// [pairs][kNB][2] bf16 (the two k of a pair adjacent, per output column).
#pragma once

#ifndef CPU_CAPABILITY
#error "vec_kernels.h must be compiled with a CPU_CAPABILITY"
#endif

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <limits>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include "common.h"
#include "vec_math.h"

namespace amxopt {
namespace {

using fVec = at::vec::Vectorized<float>;
using bVec = at::vec::Vectorized<bf16>;
constexpr int64_t kF = fVec::size();

// Two fp32 vectors rounded (to nearest even) into one bf16 vector, a's values first. With AVX512-BF16
// that is one vcvtne2ps2bf16; ATen's portable conversion takes about 8 instructions per fp32 vector,
// which was a third of the softmax's time in attention on an AMX Xeon. (vcvtne2ps2bf16 flushes values
// below 1.2e-38 to zero; both keep NaN a NaN.)
inline bVec round_bf16(fVec a, fVec c) {
#if defined(__AVX512BF16__)
  return bVec(reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(c, a)));
#else
  return at::vec::convert_from_float<bf16>(a, c);
#endif
}

inline float activate(float x, Act act) {
  switch (act) {
    case Act::None:
      return x;
    case Act::Gelu:
      return 0.5f * x * (1.0f + std::erf(x * float(M_SQRT1_2)));
    case Act::GeluTanh:
      return 0.5f * x * (1.0f + std::tanh(0.7978845608028654f * (x + 0.044715f * x * x * x)));
    case Act::Silu:
      return x / (1.0f + std::exp(-x));
  }
  return x;
}

void bf16_to_f32(const bf16* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + bVec::size() <= n; i += bVec::size()) {
    auto [lo, hi] = at::vec::convert_to_float<bf16>(bVec::loadu(src + i));
    lo.store(dst + i);
    hi.store(dst + i + kF);
  }
  for (; i < n; ++i) dst[i] = float(src[i]);
}

void f32_to_bf16(const float* src, bf16* dst, int64_t n) {
  int64_t i = 0;
  for (; i + bVec::size() <= n; i += bVec::size())
    round_bf16(fVec::loadu(src + i), fVec::loadu(src + i + kF)).store(dst + i);
  for (; i < n; ++i) dst[i] = bf16(src[i]);
}

// acc[r] += residual row r (fp32 math).
void add_rows(float* acc, int64_t lda, const bf16* res, int64_t ldr, int64_t rows, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r) {
    float* a = acc + r * lda;
    const bf16* s = res + r * ldr;
    int64_t c = 0;
    for (; c + bVec::size() <= cols; c += bVec::size()) {
      auto [lo, hi] = at::vec::convert_to_float<bf16>(bVec::loadu(s + c));
      (fVec::loadu(a + c) + lo).store(a + c);
      (fVec::loadu(a + c + kF) + hi).store(a + c + kF);
    }
    for (; c < cols; ++c) a[c] += float(s[c]);
  }
}

void add_rows(float* acc, int64_t lda, const float* res, int64_t ldr, int64_t rows, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r) {
    float* a = acc + r * lda;
    const float* s = res + r * ldr;
    int64_t c = 0;
    for (; c + kF <= cols; c += kF) (fVec::loadu(a + c) + fVec::loadu(s + c)).store(a + c);
    for (; c < cols; ++c) a[c] += s[c];
  }
}

// acc rows get bias, activation and residual in place (fp32), then are written out (rounded once for
// bf16).
template <class T>
void epilogue_rows(float* acc, int64_t lda, const Epilogue<T>& e, int64_t rows, int64_t cols) {
  const float* bias = e.bias;
  if (bias || e.act != Act::None)
    for (int64_t r = 0; r < rows; ++r) {
      float* a = acc + r * lda;
      int64_t c = 0;
      for (; c + kF <= cols; c += kF) {
        fVec v = fVec::loadu(a + c);
        if (bias) v = v + fVec::loadu(bias + c);
        activate(v, e.act).store(a + c);
      }
      for (; c < cols; ++c) a[c] = activate(a[c] + (bias ? bias[c] : 0.f), e.act);
    }
  if (e.residual) add_rows(acc, lda, e.residual, e.ldr, rows, cols);
}

void epilogue_bf16(float* acc, int64_t lda, const Epilogue<bf16>& e, bf16* out, int64_t ldo, int64_t rows,
                   int64_t cols) {
  epilogue_rows(acc, lda, e, rows, cols);
  for (int64_t r = 0; r < rows; ++r) f32_to_bf16(acc + r * lda, out + r * ldo, cols);
}

void epilogue_f32(float* acc, int64_t lda, const Epilogue<float>& e, float* out, int64_t ldo, int64_t rows,
                  int64_t cols) {
  epilogue_rows(acc, lda, e, rows, cols);
  if (out != acc || ldo != lda)
    for (int64_t r = 0; r < rows; ++r) std::copy(acc + r * lda, acc + r * lda + cols, out + r * ldo);
}

void unpack_vnni(const bf16* src, int64_t pairs, float* dst, int64_t ldd) {
  for (int64_t p = 0; p < pairs; ++p) {
    const bf16* s = src + p * kNB * 2;
    float* even = dst + (2 * p) * ldd;
    float* odd = even + ldd;
    for (int64_t c = 0; c < kNB; ++c) {
      even[c] = float(s[2 * c]);
      odd[c] = float(s[2 * c + 1]);
    }
  }
}

// Lanes of a converted pair row alternate (column c, k even), (column c, k odd): multiply by a
// vector alternating a[2p], a[2p+1] and sum adjacent lanes at the end.
void gemv_vnni(const float* a, const bf16* block, int64_t pairs, float* out) {
  constexpr int64_t kVecs = 2 * kNB / kF;  // fp32 vectors per pair row (64 values)
  constexpr int64_t kOdd = kF == 16 ? 0xAAAA : kF == 8 ? 0xAA : 0xA;
  fVec acc[kVecs];
  for (auto& v : acc) v = fVec(0.f);
  for (int64_t p = 0; p < pairs; ++p) {
    const fVec alt = fVec::blend<kOdd>(fVec(a[2 * p]), fVec(a[2 * p + 1]));
    const bf16* s = block + p * 2 * kNB;
    for (int64_t j = 0; j < kVecs; j += 2) {
      auto [lo, hi] = at::vec::convert_to_float<bf16>(bVec::loadu(s + j * kF));
      acc[j] = at::vec::fmadd(lo, alt, acc[j]);
      acc[j + 1] = at::vec::fmadd(hi, alt, acc[j + 1]);
    }
  }
  float lanes[2 * kNB];
  for (int64_t j = 0; j < kVecs; ++j) acc[j].store(lanes + j * kF);
  for (int64_t c = 0; c < kNB; ++c) out[c] = lanes[2 * c] + lanes[2 * c + 1];
}

inline float hsum(fVec v) {
  return at::vec::vec_reduce_all<float>([](fVec x, fVec y) { return x + y; }, v);
}

// 2 * kF values of a row as two fp32 vectors (one full bf16 vector converted, or two fp32 loads).
template <typename T>
inline std::tuple<fVec, fVec> load2(const T* p) {
  if constexpr (std::is_same_v<T, bf16>) {
    return at::vec::convert_to_float<bf16>(bVec::loadu(p));
  } else {
    return {fVec::loadu(p), fVec::loadu(p + kF)};
  }
}

// 2 * kF fp32 values stored as T (rounded once for bf16).
template <typename T>
inline void store2(T* p, fVec a, fVec c) {
  if constexpr (std::is_same_v<T, bf16>) {
    round_bf16(a, c).store(p);
  } else {
    a.store(p);
    c.store(p + kF);
  }
}

// A row's mean (LayerNorm) and 1 / sqrt(variance + eps) in double, for a row whose fp32 moments
// overflowed; a NaN or an infinity in the row still gives NaN, as eager's norms do.
inline float wide_moments(const float* f, int64_t D, bool rms, float eps, float& mean, float& fix) {
  double m = 0.0, squares = 0.0;
  if (!rms) {
    for (int64_t i = 0; i < D; ++i) m += f[i];
    m /= double(D);
  }
  for (int64_t i = 0; i < D; ++i) squares += (f[i] - m) * (f[i] - m);
  mean = float(m);
  fix = 0.f;
  return float(1.0 / std::sqrt(squares / double(D) + eps));
}

// Three fused passes per row, all but the first on an fp32 copy in L1: (1) load, convert, keep the
// copy and sum (sum of squares for RMSNorm); (2) LayerNorm only: the centred sum of squares (two
// passes, so no cancellation when |mean| >> std); (3) normalize, weight, bias, modulate
// (v * (1 + scale) + shift, when scale is given), round and store.
template <typename T>
void norm_rows(const T* x, int64_t ldx, T* y, int64_t rows, int64_t D, const float* w, const float* b,
               const float* scale, const float* shift, float eps, bool rms, float* f) {
  const int64_t Dv = D / (2 * kF) * (2 * kF);  // vector part; the rest is scalar
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * ldx;
    T* yr = y + r * D;
    fVec s0(0.f), s1(0.f);
    for (int64_t i = 0; i < Dv; i += 2 * kF) {
      const auto [a, c] = load2(xr + i);
      a.store(f + i);
      c.store(f + i + kF);
      s0 = rms ? at::vec::fmadd(a, a, s0) : s0 + a;
      s1 = rms ? at::vec::fmadd(c, c, s1) : s1 + c;
    }
    float tail = 0.f;
    for (int64_t i = Dv; i < D; ++i) {
      f[i] = float(xr[i]);
      tail += rms ? f[i] * f[i] : f[i];
    }
    const float first = hsum(s0 + s1) + tail;
    float mean = 0.f, var = first / D, fix = 0.f;  // fix: the rounded mean's error (LayerNorm)
    if (!rms) {
      // Corrected two-pass: the deviations' own sum is the rounded mean's error, which matters where
      // the spread is small beside the mean (300 +- 1e-3: the rounded mean alone was off by 2% of
      // the spread). It is kept apart, as rounding it into the mean would lose it again.
      mean = first / D;
      const fVec mu(mean);
      fVec c0(0.f), c1(0.f);
      s0 = fVec(0.f);
      s1 = fVec(0.f);
      for (int64_t i = 0; i < Dv; i += 2 * kF) {
        const fVec d0 = fVec::loadu(f + i) - mu, d1 = fVec::loadu(f + i + kF) - mu;
        s0 = at::vec::fmadd(d0, d0, s0);
        s1 = at::vec::fmadd(d1, d1, s1);
        c0 = c0 + d0;
        c1 = c1 + d1;
      }
      tail = 0.f;
      float ctail = 0.f;
      for (int64_t i = Dv; i < D; ++i) tail += (f[i] - mean) * (f[i] - mean), ctail += f[i] - mean;
      const float c = hsum(c0 + c1) + ctail;
      fix = c / D;
      var = std::max((hsum(s0 + s1) + tail - c * fix) / D, 0.f);
    }
    // x * x overflowed fp32 (|x| above ~1.8e19; zeros, not the normalized row): its moments again in double
    const float inv = std::isfinite(var) ? 1.f / std::sqrt(var + eps) : wide_moments(f, D, rms, eps, mean, fix);
    const fVec mu(mean), sc(inv), off(-fix * inv);
    for (int64_t i = 0; i < Dv; i += 2 * kF) {
      fVec v0 = at::vec::fmadd(fVec::loadu(f + i) - mu, sc, off);
      fVec v1 = at::vec::fmadd(fVec::loadu(f + i + kF) - mu, sc, off);
      if (w) v0 = v0 * fVec::loadu(w + i), v1 = v1 * fVec::loadu(w + i + kF);
      if (b) v0 = v0 + fVec::loadu(b + i), v1 = v1 + fVec::loadu(b + i + kF);
      if (scale) {
        v0 = at::vec::fmadd(v0, fVec::loadu(scale + i) + fVec(1.f), fVec::loadu(shift + i));
        v1 = at::vec::fmadd(v1, fVec::loadu(scale + i + kF) + fVec(1.f), fVec::loadu(shift + i + kF));
      }
      store2(yr + i, v0, v1);
    }
    for (int64_t i = Dv; i < D; ++i) {
      float v = ((f[i] - mean) * inv - fix * inv) * (w ? w[i] : 1.f) + (b ? b[i] : 0.f);
      yr[i] = T(scale ? v * (1.f + scale[i]) + shift[i] : v);
    }
  }
}

void norm_bf16(const bf16* x, int64_t ldx, bf16* y, int64_t rows, int64_t D, const float* w, const float* b,
               const float* scale, const float* shift, float eps, bool rms, float* buf) {
  norm_rows<bf16>(x, ldx, y, rows, D, w, b, scale, shift, eps, rms, buf);
}

void norm_f32(const float* x, int64_t ldx, float* y, int64_t rows, int64_t D, const float* w, const float* b,
              const float* scale, const float* shift, float eps, bool rms, float* buf) {
  norm_rows<float>(x, ldx, y, rows, D, w, b, scale, shift, eps, rms, buf);
}

// out = x + y * gate over one row of D, in fp32, rounded once (Wan's gated residual).
template <typename T>
void residual_row(const T* x, const T* y, const float* gate, T* out, int64_t D) {
  int64_t i = 0;
  for (; i + 2 * kF <= D; i += 2 * kF) {
    const auto [x0, x1] = load2(x + i);
    const auto [y0, y1] = load2(y + i);
    store2(out + i, at::vec::fmadd(y0, fVec::loadu(gate + i), x0), at::vec::fmadd(y1, fVec::loadu(gate + i + kF), x1));
  }
  for (; i < D; ++i) out[i] = T(float(x[i]) + float(y[i]) * gate[i]);
}

void residual_bf16(const bf16* x, const bf16* y, const float* gate, bf16* out, int64_t D) {
  residual_row<bf16>(x, y, gate, out, D);
}

void residual_f32(const float* x, const float* y, const float* gate, float* out, int64_t D) {
  residual_row<float>(x, y, gate, out, D);
}

// One row of D = 2 * H rotated by angles with cos/sin (fp32), rounded once. interleaved: the pairs
// are (x[2i], x[2i+1]) (Wan); else (x[i], x[i + H]) (rotate_half), whose second half reads its
// factors at cos + hi / sin + hi (hi = 0: one angle per pair; hi = H: rotate_half's D-wide cos / sin).
template <typename T>
void rotary_row(const T* x, T* out, int64_t D, const float* cos, const float* sin, int64_t hi, bool interleaved) {
  const int64_t H = D / 2;
  int64_t i = 0;  // pair index
  if (interleaved) {
    for (; i + kF <= H; i += kF) {  // 2 * kF values of x: kF pairs
      const auto [a, c] = load2(x + 2 * i);
      const auto [x1, x2] = at::vec::deinterleave2(a, c);
      const fVec cs = fVec::loadu(cos + i), sn = fVec::loadu(sin + i);
      const auto [o0, o1] = at::vec::interleave2(x1 * cs - x2 * sn, x1 * sn + x2 * cs);
      store2(out + 2 * i, o0, o1);
    }
    for (; i < H; ++i) {
      const float x1 = float(x[2 * i]), x2 = float(x[2 * i + 1]);
      out[2 * i] = T(x1 * cos[i] - x2 * sin[i]);
      out[2 * i + 1] = T(x1 * sin[i] + x2 * cos[i]);
    }
  } else {
    const float *cos2 = cos + hi, *sin2 = sin + hi;
    for (; i + 2 * kF <= H; i += 2 * kF) {
      const auto [a0, a1] = load2(x + i);
      const auto [b0, b1] = load2(x + H + i);
      const fVec c0 = fVec::loadu(cos + i), c1 = fVec::loadu(cos + i + kF);
      const fVec s0 = fVec::loadu(sin + i), s1 = fVec::loadu(sin + i + kF);
      const fVec d0 = fVec::loadu(cos2 + i), d1 = fVec::loadu(cos2 + i + kF);
      const fVec t0 = fVec::loadu(sin2 + i), t1 = fVec::loadu(sin2 + i + kF);
      store2(out + i, a0 * c0 - b0 * s0, a1 * c1 - b1 * s1);
      store2(out + H + i, a0 * t0 + b0 * d0, a1 * t1 + b1 * d1);
    }
    for (; i < H; ++i) {
      const float x1 = float(x[i]), x2 = float(x[H + i]);
      out[i] = T(x1 * cos[i] - x2 * sin[i]);
      out[H + i] = T(x1 * sin2[i] + x2 * cos2[i]);
    }
  }
}

void rotary_bf16(const bf16* x, bf16* out, int64_t D, const float* cos, const float* sin, int64_t hi,
                 bool interleaved) {
  rotary_row<bf16>(x, out, D, cos, sin, hi, interleaved);
}

void rotary_f32(const float* x, float* out, int64_t D, const float* cos, const float* sin, int64_t hi,
                bool interleaved) {
  rotary_row<float>(x, out, D, cos, sin, hi, interleaved);
}

// p[0, count) as T, count <= kF (rounded once for bf16).
template <typename T>
inline void store_n(T* p, fVec v, int64_t count) {
  if constexpr (std::is_same_v<T, bf16>) {
    round_bf16(v, v).store(p, int(count));
  } else {
    v.store(p, int(count));
  }
}

// One query row of an online softmax over a block of raw scores s (fp32). Keys [0, visible) count,
// [visible, n) are masked: p = exp(scale * (s - m')) for the first, 0 for the rest (rounded once to
// T); m (the running extreme raw score: the max, or the min for a negative scale, whose scaled value
// is the largest; -inf before the first key) becomes m', l (running sum) l * exp(scale * (m - m')) +
// sum(p). Returns exp(scale * (m - m')), the factor for the row's accumulator. The reference is a raw
// score, not a scaled one: the largest p is exp(0) = 1 exactly, where a rounded scaled max left it
// exp of the rounding residual, which overflows past |scale * s| ~ 2^31. A row's last partial vector
// goes through the vector code with a masked load (segments of 104 keys spent more in scalar exps
// than in the other 96 keys).
template <typename T>
float softmax_row(const float* s, int64_t visible, int64_t n, float scale, float* m, float* l, T* p) {
  if (visible <= 0) {
    std::fill(p, p + n, T(0.f));
    return 1.f;
  }
  const int64_t vend = visible / kF * kF, rem = visible - vend;
  const bool neg = scale < 0.f;
  const auto pick = [neg](fVec a, fVec b) { return neg ? at::vec::clamp_max(a, b) : at::vec::clamp_min(a, b); };
  const fVec none(neg ? std::numeric_limits<float>::infinity() : -std::numeric_limits<float>::infinity());
  fVec e0 = none, e1 = none;
  int64_t i = 0;
  for (; i + 2 * kF <= vend; i += 2 * kF) {  // two chains
    e0 = pick(fVec::loadu(s + i), e0);
    e1 = pick(fVec::loadu(s + i + kF), e1);
  }
  for (; i < vend; i += kF) e0 = pick(fVec::loadu(s + i), e0);
  if (rem) e1 = pick(fVec::set(none, fVec::loadu(s + vend, int(rem)), rem), e1);
  const float raw = at::vec::vec_reduce_all<float>(pick, pick(e0, e1));
  const bool first = *m == -std::numeric_limits<float>::infinity();
  const float ref = first ? raw : neg ? std::min(*m, raw) : std::max(*m, raw);
  const fVec vr(ref), sc(scale), sc2(scale * kLog2e);
  // bf16 P: 2^((s - m') scale log2(e)) by the cheaper exp2 of vec_math.h (its error, and the
  // rounding of log2(e) into the scale, stay far below P's bf16 rounding); fp32 P: exp_fast.
  const auto p_of = [&](fVec x) {
    if constexpr (std::is_same_v<T, bf16>)
      return exp2_for_bf16((x - vr) * sc2);
    else
      return exp_fast((x - vr) * sc);
  };
  fVec sum(0.f), sum1(0.f);
  int64_t j = 0;
  for (; j + 2 * kF <= vend; j += 2 * kF) {  // two vectors at a time: one 2 * kF store of T
    const fVec a = p_of(fVec::loadu(s + j)), c = p_of(fVec::loadu(s + j + kF));
    sum = sum + a;
    sum1 = sum1 + c;
    store2(p + j, a, c);
  }
  for (; j < vend; j += kF) {
    const fVec e = p_of(fVec::loadu(s + j));
    sum = sum + e;
    store_n(p + j, e, kF);
  }
  if (rem) {
    const fVec e = fVec::set(fVec(0.f), p_of(fVec::loadu(s + vend, int(rem))), rem);
    sum1 = sum1 + e;
    store_n(p + vend, e, rem);
  }
  const float corr = first ? 0.f : std::exp((*m - ref) * scale);
  *l = *l * corr + hsum(sum + sum1);
  *m = ref;
  std::fill(p + visible, p + n, T(0.f));
  return corr;
}

float softmax_row_bf16(const float* s, int64_t visible, int64_t n, float scale, float* m, float* l, bf16* p) {
  return softmax_row<bf16>(s, visible, n, scale, m, l, p);
}

float softmax_row_f32(const float* s, int64_t visible, int64_t n, float scale, float* m, float* l, float* p) {
  return softmax_row<float>(s, visible, n, scale, m, l, p);
}

// out[0, n) = x * c as T (rounded once); out may be x.
template <typename T>
void scaled_row(const float* x, int64_t n, float c, T* out) {
  const fVec vc(c);
  int64_t i = 0;
  for (; i + 2 * kF <= n; i += 2 * kF) store2(out + i, fVec::loadu(x + i) * vc, fVec::loadu(x + i + kF) * vc);
  for (; i < n; ++i) out[i] = T(x[i] * c);
}

void scaled_bf16(const float* x, int64_t n, float c, bf16* out) { scaled_row<bf16>(x, n, c, out); }

void scaled_f32(const float* x, int64_t n, float c, float* out) { scaled_row<float>(x, n, c, out); }

// A convolution's channels-last outputs from its taps: out[i * ldo + c] = act(bias[c] + sum_k
// taps[k * n + i] * wt[k * cout + c]) for i < n positions, c < cout channels; fp32 accumulation
// over channel vectors (the weights of a K x 32 block stay in L1), rounded once.
template <typename T>
void conv_cols(const float* taps, int64_t K, int64_t n, const float* wt, const float* bias, int64_t cout, Act act,
               T* out, int64_t ldo) {
  for (int64_t i = 0; i < n; ++i) {
    T* o = out + i * ldo;
    int64_t c = 0;
    for (; c + 2 * kF <= cout; c += 2 * kF) {
      fVec a = bias ? fVec::loadu(bias + c) : fVec(0.f), e = bias ? fVec::loadu(bias + c + kF) : fVec(0.f);
      for (int64_t k = 0; k < K; ++k) {
        const fVec t(taps[k * n + i]);
        a = at::vec::fmadd(fVec::loadu(wt + k * cout + c), t, a);
        e = at::vec::fmadd(fVec::loadu(wt + k * cout + c + kF), t, e);
      }
      store2(o + c, activate(a, act), activate(e, act));
    }
    for (; c < cout; c += kF) {
      const int cnt = int(std::min<int64_t>(kF, cout - c));
      fVec a = bias ? fVec::loadu(bias + c, cnt) : fVec(0.f);
      for (int64_t k = 0; k < K; ++k) a = at::vec::fmadd(fVec::loadu(wt + k * cout + c, cnt), fVec(taps[k * n + i]), a);
      store_n(o + c, activate(a, act), cnt);
    }
  }
}

void conv_cols_bf16(const float* taps, int64_t K, int64_t n, const float* wt, const float* bias, int64_t cout,
                    Act act, bf16* out, int64_t ldo) {
  conv_cols<bf16>(taps, K, n, wt, bias, cout, act, out, ldo);
}

void conv_cols_f32(const float* taps, int64_t K, int64_t n, const float* wt, const float* bias, int64_t cout,
                   Act act, float* out, int64_t ldo) {
  conv_cols<float>(taps, K, n, wt, bias, cout, act, out, ldo);
}

// dst[j * ldd + i] = src[i * lds + j] for i < rows, j < cols: a transpose of 32-bit values (fp32, or
// bf16 pairs moved as one); moves and shuffles only, so every bit pattern goes through unchanged.
void transpose32(const float* src, int64_t lds, float* dst, int64_t ldd, int64_t rows, int64_t cols) {
#if defined(CPU_CAPABILITY_AVX512)
  at::vec::transpose_mxn<float>(src, lds, dst, ldd, int(rows), int(cols));
#else
  // (the values may be bf16 pairs only 2-byte aligned: moved by load32 / store32, common.h)
  int64_t i = 0;
#if defined(CPU_CAPABILITY_AVX2)
  for (; i + 8 <= rows; i += 8) {
    int64_t j = 0;
    for (; j + 8 <= cols; j += 8) at::vec::transpose_mxn<float, 8, 8>(src + i * lds + j, lds, dst + j * ldd + i, ldd);
    for (; j < cols; ++j)
      for (int64_t ii = i; ii < i + 8; ++ii) store32(dst + j * ldd + ii, load32(src + ii * lds + j));
  }
#endif
  for (; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) store32(dst + j * ldd + i, load32(src + i * lds + j));
#endif
}

// One VNNI pair row of n columns, in panels of 32 columns that start `panel` bf16 apart: the pair
// of column e at dst + (e / 32) * panel + 2 (e % 32), a[e] first, b[e] second; a null row reads as
// zeros. panel = 64 writes one contiguous row.
void interleave_bf16(const bf16* a, const bf16* b, int64_t n, int64_t panel, bf16* dst) {
  const uint16_t* ua = reinterpret_cast<const uint16_t*>(a);
  const uint16_t* ub = reinterpret_cast<const uint16_t*>(b);
  for (int64_t e0 = 0; e0 < n; e0 += 32) {
    uint32_t* d = reinterpret_cast<uint32_t*>(dst + e0 / 32 * panel);
    const int64_t m = std::min<int64_t>(32, n - e0);
    if (a && b) {
      for (int64_t e = 0; e < m; ++e) d[e] = uint32_t(ua[e0 + e]) | uint32_t(ub[e0 + e]) << 16;
    } else if (a) {
      for (int64_t e = 0; e < m; ++e) d[e] = ua[e0 + e];
    } else {
      std::fill(d, d + m, 0u);
    }
  }
}

}  // namespace
}  // namespace amxopt

#define AMXOPT_VEC_TABLE(name, isa_name)                                                                 \
  namespace amxopt {                                                                                     \
  const VecKernels name = {isa_name,        epilogue_bf16,   epilogue_f32, bf16_to_f32,   unpack_vnni,   \
                           gemv_vnni,       norm_bf16,       norm_f32,     residual_bf16, residual_f32,  \
                           rotary_bf16,     rotary_f32,      softmax_row_bf16, softmax_row_f32,          \
                           scaled_bf16,     scaled_f32,      transpose32,  interleave_bf16,              \
                           conv_cols_bf16,  conv_cols_f32};                                              \
  }
