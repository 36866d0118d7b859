// Drivers of the glue ops that sit between Wan's GEMMs: amxopt.gated_residual (x + y * gate) and
// amxopt.rotary_embedding. Each is one pass over x: rows split across threads (at::parallel_for),
// each row computed in fp32 by the CPU's VecKernels (vec_kernels.h) and rounded once, where eager
// PyTorch runs 4 (residual) to 14 (rotary) separate ops with fp32 intermediates in memory.
#include "common.h"

namespace amxopt {
LeadingIndex::LeadingIndex(at::IntArrayRef x_sizes, int64_t r)
    : sizes_(x_sizes.begin(), x_sizes.end() - 1), idx_(sizes_.size()) {
  for (int64_t d = int64_t(sizes_.size()) - 1; d >= 0; --d) {
    idx_[d] = r % sizes_[d];
    r /= sizes_[d];
  }
}

void LeadingIndex::next() {
  for (int64_t d = int64_t(sizes_.size()) - 1; d >= 0; --d) {
    if (++idx_[d] < sizes_[d]) return;
    idx_[d] = 0;
  }
}

int64_t LeadingIndex::offset(const std::vector<int64_t>& strides) const {
  int64_t off = 0;
  for (size_t d = 0; d < idx_.size(); ++d) off += idx_[d] * strides[d];
  return off;
}

OperandRows::OperandRows(const at::Tensor& t)
    : t_(t.size(-1) > 1 && t.stride(-1) != 1 ? t.contiguous() : t), base_(t_.data_ptr()) {
  strides_.assign(t_.strides().begin(), t_.strides().end() - 1);
}

OperandRows OperandRows::broadcast(const at::Tensor& p, at::IntArrayRef x_sizes, int64_t width) {
  std::vector<int64_t> full(x_sizes.begin(), x_sizes.end());
  full.back() = width;
  // Made contiguous in its own shape first (a strided slice such as freqs[..., 0::2]): the expanded
  // view then has a unit last stride and is not copied.
  auto q = p.to(at::kFloat);
  if (q.stride(-1) != 1) q = q.contiguous();
  return OperandRows(q.expand(full));
}

at::Tensor gated_residual_native(const at::Tensor& x, const at::Tensor& y, const at::Tensor& gate) {
  const int64_t D = x.size(-1);
  auto out = new_output(x.sizes(), x.options());
  if (x.numel() == 0) return out;
  const OperandRows xr(x), yr(y), g = OperandRows::broadcast(gate, x.sizes(), D);
  const auto& v = vec();
  const bool bf = x.scalar_type() == at::kBFloat16;
  void* o = out.data_ptr();  // once, not data_ptr<T>() per row (see rotary_native)
  at::parallel_for(0, x.numel() / D, row_grain(D), [&](int64_t r0, int64_t r1) {
    LeadingIndex i(x.sizes(), r0);
    for (int64_t r = r0; r < r1; ++r, i.next()) {
      if (bf)
        v.residual_bf16(xr.at<bf16>(i), yr.at<bf16>(i), g.at<float>(i), static_cast<bf16*>(o) + r * D, D);
      else
        v.residual_f32(xr.at<float>(i), yr.at<float>(i), g.at<float>(i), static_cast<float*>(o) + r * D, D);
    }
  });
  return out;
}

at::Tensor rotary_native(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool interleaved) {
  const int64_t D = x.size(-1);
  auto out = new_output(x.sizes(), x.options());
  if (x.numel() == 0) return out;
  const OperandRows xr(x);
  const int64_t width = cos.size(-1), hi = width == D ? D / 2 : 0;  // ops.cpp checked: D / 2 or D
  const auto c = OperandRows::broadcast(cos, x.sizes(), width), s = OperandRows::broadcast(sin, x.sizes(), width);
  const auto& v = vec();
  const bool bf = x.scalar_type() == at::kBFloat16;
  // The output's base once: data_ptr<T>() checks the tensor at each call, which cost rotary at 784 x
  // 16 x 64 (one call per 64-wide row) a quarter of its time (194-229 us against 145-158 us, 2 threads
  // of an AMD EPYC Zen 4).
  void* o = out.data_ptr();
  at::parallel_for(0, x.numel() / D, row_grain(D), [&](int64_t r0, int64_t r1) {
    LeadingIndex i(x.sizes(), r0);
    for (int64_t r = r0; r < r1; ++r, i.next()) {
      if (bf)
        v.rotary_bf16(xr.at<bf16>(i), static_cast<bf16*>(o) + r * D, D, c.at<float>(i), s.at<float>(i), hi,
                      interleaved);
      else
        v.rotary_f32(xr.at<float>(i), static_cast<float*>(o) + r * D, D, c.at<float>(i), s.at<float>(i), hi,
                     interleaved);
    }
  });
  return out;
}

}  // namespace amxopt
