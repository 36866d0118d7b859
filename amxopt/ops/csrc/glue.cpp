// Drivers of the glue ops that sit between Wan's GEMMs: amxopt.gated_residual (x + y * gate) and
// amxopt.rotary_embedding. Each is one pass over x: rows split across threads (at::parallel_for),
// each row computed in fp32 by the CPU's VecKernels (vec_kernels.h) and rounded once, where eager
// PyTorch runs 4 (residual) to 14 (rotary) separate ops with fp32 intermediates in memory.
#include "common.h"

namespace amxopt {

BroadcastRows::BroadcastRows(const at::Tensor& p, at::IntArrayRef x_sizes, int64_t width) {
  std::vector<int64_t> full(x_sizes.begin(), x_sizes.end());
  full.back() = width;
  auto q = p.to(at::kFloat);
  if (q.stride(-1) != 1) q = q.contiguous();  // its own shape: a strided slice such as freqs[..., 0::2]
  data_ = q;
  auto e = q.expand(full);
  sizes_.assign(full.begin(), full.end() - 1);
  strides_.assign(e.strides().begin(), e.strides().end() - 1);
}

const float* BroadcastRows::row(int64_t r) const {
  int64_t off = 0;
  for (int64_t d = int64_t(sizes_.size()) - 1; d >= 0; --d) {
    off += (r % sizes_[d]) * strides_[d];
    r /= sizes_[d];
  }
  return data_.data_ptr<float>() + off;
}

namespace {

// x as contiguous rows of D (a copy only when the last dim is strided).
at::Tensor rows_of(const at::Tensor& x) {
  const int64_t D = x.size(-1);
  auto x2 = x.reshape({-1, D});
  return D > 0 && x2.stride(1) != 1 ? x2.contiguous() : x2;
}

}  // namespace

at::Tensor gated_residual_native(const at::Tensor& x, const at::Tensor& y, const at::Tensor& gate) {
  const int64_t D = x.size(-1);
  auto out = at::empty(x.sizes(), x.options());
  if (x.numel() == 0) return out;
  auto x2 = rows_of(x), y2 = rows_of(y);
  const BroadcastRows g(gate, x.sizes(), D);
  const auto& v = vec();
  const bool bf = x.scalar_type() == at::kBFloat16;
  const int64_t ldx = x2.stride(0), ldy = y2.stride(0);
  at::parallel_for(0, x2.size(0), 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      if (bf)
        v.residual_bf16(x2.data_ptr<bf16>() + r * ldx, y2.data_ptr<bf16>() + r * ldy, g.row(r),
                        out.data_ptr<bf16>() + r * D, D);
      else
        v.residual_f32(x2.data_ptr<float>() + r * ldx, y2.data_ptr<float>() + r * ldy, g.row(r),
                       out.data_ptr<float>() + r * D, D);
    }
  });
  return out;
}

at::Tensor rotary_native(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool interleaved) {
  const int64_t D = x.size(-1);
  auto out = at::empty(x.sizes(), x.options());
  if (x.numel() == 0) return out;
  auto x2 = rows_of(x);
  const int64_t width = cos.size(-1), hi = width == D ? D / 2 : 0;  // ops.cpp checked: D / 2 or D
  const BroadcastRows c(cos, x.sizes(), width), s(sin, x.sizes(), width);
  const auto& v = vec();
  const bool bf = x.scalar_type() == at::kBFloat16;
  const int64_t ld = x2.stride(0);
  at::parallel_for(0, x2.size(0), 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      if (bf)
        v.rotary_bf16(x2.data_ptr<bf16>() + r * ld, out.data_ptr<bf16>() + r * D, D, c.row(r), s.row(r), hi,
                      interleaved);
      else
        v.rotary_f32(x2.data_ptr<float>() + r * ld, out.data_ptr<float>() + r * D, D, c.row(r), s.row(r), hi,
                     interleaved);
    }
  });
  return out;
}

}  // namespace amxopt
