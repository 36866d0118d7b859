// Driver of amxopt.layer_norm / amxopt.rms_norm (and their modulated form, norm_modulate): rows split
// across threads (at::parallel_for), each row normalized by the CPU's VecKernels (vec_kernels.h: fp32
// math, two passes over an fp32 copy of the row held in a per-thread buffer, one write in the input
// dtype). Weight and bias are converted to fp32 once per call: they are tiny next to the activations;
// scale and shift are read per row where they broadcast (Wan's [B, 1, D] against x [B, S, D]).
#include "common.h"

namespace amxopt {

at::Tensor norm_native(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                       const std::optional<at::Tensor>& bias, double eps, bool rms,
                       const std::optional<at::Tensor>& scale, const std::optional<at::Tensor>& shift) {
  const int64_t D = x.size(-1);
  auto x2 = x.reshape({c10::multiply_integers(x.sizes().begin(), x.sizes().end() - 1), D});  // D may be 0
  if (D > 0 && x2.stride(1) != 1) x2 = x2.contiguous();
  auto y = new_output(x.sizes(), x.options());
  if (x2.numel() == 0) return y;
  at::Tensor w32, b32;
  if (weight.has_value()) w32 = weight->to(at::kFloat).contiguous();
  if (bias.has_value()) b32 = bias->to(at::kFloat).contiguous();
  const float* w = w32.defined() ? w32.data_ptr<float>() : nullptr;
  const float* b = b32.defined() ? b32.data_ptr<float>() : nullptr;
  std::optional<OperandRows> sc, sh;
  if (scale.has_value())
    sc = OperandRows::broadcast(*scale, x.sizes(), D), sh = OperandRows::broadcast(*shift, x.sizes(), D);
  const auto& v = vec();
  const bool bf = x.scalar_type() == at::kBFloat16;
  const int64_t ld = x2.stride(0);
  const void* xp = x2.data_ptr();  // the bases once, not per row (glue.cpp)
  void* yp = y.data_ptr();
  at::parallel_for(0, x2.size(0), row_grain(D), [&](int64_t r0, int64_t r1) {
    std::vector<float> buf(D);
    // Unmodulated: the chunk at once; modulated: row by row, each with its scale and shift rows.
    const int64_t step = sc ? 1 : r1 - r0;
    LeadingIndex i(x.sizes(), r0);
    for (int64_t r = r0; r < r1; r += step, i.next()) {
      const float* s = sc ? sc->at<float>(i) : nullptr;
      const float* t = sh ? sh->at<float>(i) : nullptr;
      if (bf)
        v.norm_bf16(static_cast<const bf16*>(xp) + r * ld, ld, static_cast<bf16*>(yp) + r * D, step, D, w, b, s, t,
                    float(eps), rms, buf.data());
      else
        v.norm_f32(static_cast<const float*>(xp) + r * ld, ld, static_cast<float*>(yp) + r * D, step, D, w, b, s, t,
                   float(eps), rms, buf.data());
    }
  });
  return y;
}

}  // namespace amxopt
