// amxopt.conv2d's direct kernel for convolutions with few input values per output (Cin x kh x kw <=
// kDirectK), such as the Qwen3-Omni audio encoder's first 3x3 stride-2 conv on the 1-channel mel
// spectrogram (30 x 1 x 128 x 100 -> 480 channels). oneDNN runs that one at about 0.01 TFLOP/s
// (118 ms on 2 cores of an AMX Xeon): a K = 9 reduction leaves its GEMM kernels nothing to block.
// Here each (image, output row) gathers its K rows of taps once (fp32, zeros where the window hangs
// over the padding); each output position's channels are the taps' weighted sum, bias first, then
// the fused activation if any, rounded once (vec(): conv_cols). The output is channels-last: one
// contiguous block per (image, output row), and oneDNN runs the next convolution on a channels-last
// input faster (the Omni encoder's second conv, 480 -> 480 channels: 102 against 179 ms). Parallel
// over image x output row.
#include "common.h"

namespace amxopt {
namespace {

template <typename S>
at::Tensor conv2d_direct_impl(const at::Tensor& x, const at::Tensor& w32, const at::Tensor& b32, int64_t kh,
                              int64_t kw, at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation,
                              int64_t OH, int64_t OW, Act act) {
  const int64_t N = x.size(0), C = x.size(1), H = x.size(2), W = x.size(3), K = w32.size(0), Co = w32.size(1);
  const int64_t sh = stride[0], sw = stride[1], ph = padding[0], pw = padding[1], dh = dilation[0], dw = dilation[1];
  auto out = at::empty({N, Co, OH, OW}, x.options().memory_format(at::MemoryFormat::ChannelsLast));
  const S* X = x.data_ptr<S>();
  S* O = out.data_ptr<S>();
  const float* Wt = w32.data_ptr<float>();
  const float* Bs = b32.defined() ? b32.data_ptr<float>() : nullptr;
  const auto& v = vec();
  at::parallel_for(0, N * OH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> taps(K * OW);
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t n = idx / OH, oh = idx % OH;
      for (int64_t ci = 0; ci < C; ++ci)
        for (int64_t i = 0; i < kh; ++i)
          for (int64_t j = 0; j < kw; ++j) {
            float* row = taps.data() + ((ci * kh + i) * kw + j) * OW;
            const int64_t ih = oh * sh - ph + i * dh;
            if (ih < 0 || ih >= H) {
              std::fill(row, row + OW, 0.f);
              continue;
            }
            const S* src = X + ((n * C + ci) * H + ih) * W;
            for (int64_t ow = 0; ow < OW; ++ow) {
              const int64_t iw = ow * sw - pw + j * dw;
              row[ow] = iw >= 0 && iw < W ? float(src[iw]) : 0.f;
            }
          }
      S* o = O + (n * OH + oh) * OW * Co;  // [OW][Co], channels last
      if constexpr (std::is_same_v<S, bf16>)
        v.conv_cols_bf16(taps.data(), K, OW, Wt, Bs, Co, act, o, Co);
      else
        v.conv_cols_f32(taps.data(), K, OW, Wt, Bs, Co, act, o, Co);
    }
  });
  return out;
}

}  // namespace

std::optional<at::Tensor> conv2d_direct(const at::Tensor& x, const at::Tensor& w,
                                        const std::optional<at::Tensor>& bias, at::IntArrayRef stride,
                                        at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups, Act act) {
  const int64_t K = w.size(1) * w.size(2) * w.size(3), kh = w.size(2), kw = w.size(3);
  if (groups != 1 || K > kDirectK || K == 0) return std::nullopt;
  for (int d = 0; d < 2; ++d)
    if (stride[d] < 1 || padding[d] < 0 || dilation[d] < 1) return std::nullopt;  // ATen's own error
  const int64_t OH = (x.size(2) + 2 * padding[0] - dilation[0] * (kh - 1) - 1) / stride[0] + 1;
  const int64_t OW = (x.size(3) + 2 * padding[1] - dilation[1] * (kw - 1) - 1) / stride[1] + 1;
  if (OH <= 0 || OW <= 0 || x.size(0) == 0) return std::nullopt;
  auto w32 = w.to(at::kFloat).reshape({w.size(0), K}).t().contiguous();  // [K][Co]
  at::Tensor b32;  // the bias rounded to x's dtype first, as the reference and ATen's path do
  if (bias.has_value()) b32 = bias->to(x.scalar_type()).to(at::kFloat).contiguous();
  auto xc = x.contiguous();
  if (x.scalar_type() == at::kBFloat16)
    return conv2d_direct_impl<bf16>(xc, w32, b32, kh, kw, stride, padding, dilation, OH, OW, act);
  return conv2d_direct_impl<float>(xc, w32, b32, kh, kw, stride, padding, dilation, OH, OW, act);
}

}  // namespace amxopt
