// amxopt.layer_norm / amxopt.rms_norm kernels: bf16 rows, fp32 accumulation, AVX-512.
//
// One row at a time (rows split across threads): pass 1 converts the row to fp32 into a per-thread
// buffer and accumulates its sum (sum of squares for RMSNorm), pass 2 the centred sum of squares for
// LayerNorm (two-pass, so no cancellation), pass 3 normalizes, applies fp32 weight/bias and rounds
// to bf16. A row of these models (<= 5120 values, 20 KB in fp32) stays in L1 between passes, so
// memory is read once and written once.
#include "common.h"

#include <vector>

namespace amxopt {
namespace {

// Weight/bias as fp32 (converted once per call: they are tiny next to the activations).
const float* as_f32(const std::optional<at::Tensor>& t, at::Tensor& holder) {
  if (!t.has_value()) return nullptr;
  holder = t->to(at::kFloat).contiguous();
  return holder.data_ptr<float>();
}

template <bool kRms>
void norm_rows(const bf16* x, int64_t ldx, bf16* y, int64_t rows, int64_t D, const float* w, const float* b,
               float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    std::vector<float> row(D + 16);  // the row in fp32: converted once, read by the later passes
    float* f = row.data();
    for (int64_t r = r0; r < r1; ++r) {
      const bf16* xr = x + r * ldx;
      bf16* yr = y + r * D;
      __m512 s = _mm512_setzero_ps();
      for (int64_t i = 0; i < D; i += 16) {
        const __m512 v = load_bf16_masked(xr + i, tail_mask(D - i));  // zero beyond D
        _mm512_storeu_ps(f + i, v);
        s = kRms ? _mm512_fmadd_ps(v, v, s) : _mm512_add_ps(s, v);
      }
      float mean = 0.f, inv;
      if (kRms) {
        inv = 1.f / std::sqrt(hsum(s) / D + eps);
      } else {
        mean = hsum(s) / D;
        const __m512 mu = _mm512_set1_ps(mean);
        __m512 q = _mm512_setzero_ps();
        for (int64_t i = 0; i < D; i += 16) {
          const __m512 d = _mm512_maskz_sub_ps(tail_mask(D - i), _mm512_loadu_ps(f + i), mu);
          q = _mm512_fmadd_ps(d, d, q);
        }
        inv = 1.f / std::sqrt(hsum(q) / D + eps);
      }
      const __m512 mu = _mm512_set1_ps(mean), sc = _mm512_set1_ps(inv);
      for (int64_t i = 0; i < D; i += 16) {
        const __mmask16 m = tail_mask(D - i);
        __m512 v = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(f + i), mu), sc);
        if (w) v = _mm512_mul_ps(v, _mm512_maskz_loadu_ps(m, w + i));
        if (b) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, b + i));
        store_bf16_masked(yr + i, v, m);
      }
    }
  });
}

at::Tensor run(const at::Tensor& x, const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
               double eps, bool rms) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "amxopt native norm: x must be bf16, got ", x.scalar_type());
  const int64_t D = x.size(-1);
  auto x2 = x.reshape({-1, D});
  if (x2.stride(1) != 1) x2 = x2.contiguous();
  auto y = at::empty(x.sizes(), x.options());
  at::Tensor wh, bh;
  const float* w = as_f32(weight, wh);
  const float* b = as_f32(bias, bh);
  if (rms)
    norm_rows<true>(x2.data_ptr<bf16>(), x2.stride(0), y.data_ptr<bf16>(), x2.size(0), D, w, nullptr, float(eps));
  else
    norm_rows<false>(x2.data_ptr<bf16>(), x2.stride(0), y.data_ptr<bf16>(), x2.size(0), D, w, b, float(eps));
  return y;
}

at::Tensor layer_norm(const at::Tensor& x, const std::optional<at::Tensor>& w, const std::optional<at::Tensor>& b,
                      double eps) {
  return run(x, w, b, eps, false);
}

at::Tensor rms_norm(const at::Tensor& x, const std::optional<at::Tensor>& w, double eps) {
  return run(x, w, std::nullopt, eps, true);
}

}  // namespace
}  // namespace amxopt

TORCH_LIBRARY_FRAGMENT(amxopt_native, m) {
  m.def("layer_norm(Tensor x, Tensor? weight, Tensor? bias, float eps) -> Tensor", &amxopt::layer_norm);
  m.def("rms_norm(Tensor x, Tensor? weight, float eps) -> Tensor", &amxopt::rms_norm);
}
