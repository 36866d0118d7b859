// amxopt.conv2d's own kernels (ops.cpp leaves every other convolution to ATen).
//
// Direct, for convolutions with few input values per output (Cin x kh x kw <= kDirectK), such as
// the Qwen3-Omni audio encoder's first 3x3 stride-2 conv on the 1-channel mel spectrogram (30 x 1 x
// 128 x 100 -> 480 channels). oneDNN runs that one at about 0.01 TFLOP/s (118 ms on 2 cores of an
// AMX Xeon): a K = 9 reduction leaves its GEMM kernels nothing to block. Here each (image, output
// row) gathers its K rows of taps once (fp32, zeros where the window hangs over the padding); each
// output position's channels are the taps' weighted sum, bias first, then the fused activation if
// any, rounded once (vec(): conv_cols). The output is channels-last: one contiguous block per
// (image, output row). Parallel over image x output row.
//
// GEMM, for larger bf16 convolutions (groups 1, even Cin x kh x kw) on the amx tier: im2col rows
// of a channels-last x (each tap's channels one contiguous run) times the weight packed as [Cout,
// kh x kw x Cin], by gemm_bf16, with the bias and activation in its epilogue; the output is
// channels-last ([N x OH x OW, Cout] rows). The Omni encoder's second and third convs
// (480 -> 480 channels, 3x3 stride 2, K = 4320), paired calls on 2 threads of an AMX Xeon: level
// with oneDNN's convolution + gelu on the same channels-last x (1.00-1.07x; the GEMM runs at about
// oneDNN's 1.2-1.3 TFLOP/s there), 1.24-1.51x faster than oneDNN's on an NCHW x (as eager runs
// them); the im2col is 3-14 ms of 77 ms. What it adds: the activation in the GEMM's epilogue, one
// engine for linear and conv, and autotune a second candidate per shape. The im2col matrix is built
// kGemmRows rows at a time into a per-thread buffer (8.8 MB at K = 4320) that is reused, never a
// whole [M, K] matrix (207 MB there): chunks of 256 or 4096 rows ran slower (1.4x, 1.2x). The
// weight is packed on every call (1.5 ms at 480 x 4320). Not on the avx512_bf16 tier: on a Zen 4
// EPYC this path ran the Omni encoder's second and third convs at 0.85x and 0.79x oneDNN's
// AVX-512-BF16 convolution on the same channels-last x (paired calls, 2 threads), and on the Xeon,
// capped to that tier, at 0.12x oneDNN's (AMX) convolution.
#include <array>

#include "common.h"

namespace amxopt {
namespace {

constexpr int64_t kGemmRows = 1024;  // im2col rows per GEMM call of the GEMM path

// The output's (OH, OW), or nullopt where ATen's convolution should report the arguments (a stride,
// padding or dilation out of range) or the output is empty.
std::optional<std::array<int64_t, 2>> output_size(const at::Tensor& x, const at::Tensor& w, at::IntArrayRef stride,
                                                  at::IntArrayRef padding, at::IntArrayRef dilation) {
  std::array<int64_t, 2> o;
  for (int d = 0; d < 2; ++d) {
    if (stride[d] < 1 || padding[d] < 0 || dilation[d] < 1) return std::nullopt;
    // A window larger than the padded input makes this negative, which '/' would round up to 0.
    const int64_t room = x.size(2 + d) + 2 * padding[d] - dilation[d] * (w.size(2 + d) - 1) - 1;
    if (room < 0) return std::nullopt;
    o[d] = room / stride[d] + 1;
  }
  if (x.size(0) == 0) return std::nullopt;
  return o;
}

template <typename S>
at::Tensor conv2d_direct_impl(const at::Tensor& x, const at::Tensor& w32, const at::Tensor& b32, int64_t kh,
                              int64_t kw, at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation,
                              int64_t OH, int64_t OW, Act act) {
  const int64_t N = x.size(0), C = x.size(1), H = x.size(2), W = x.size(3), K = w32.size(0), Co = w32.size(1);
  const int64_t sh = stride[0], sw = stride[1], ph = padding[0], pw = padding[1], dh = dilation[0], dw = dilation[1];
  auto out = new_output({N, Co, OH, OW}, x.options().memory_format(at::MemoryFormat::ChannelsLast));
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

// Rows [m0, m0 + rows) of x's im2col matrix: row (n, oh, ow) holds, for each tap (i, j) in turn, the
// C channels of x at (n, oh * sh - ph + i * dh, ow * sw - pw + j * dw) (zeros where the tap lies in
// the padding). x is channels-last, so each tap's channels are one contiguous run.
void im2col_rows(const bf16* X, int64_t C, int64_t H, int64_t W, int64_t kh, int64_t kw, const int64_t* s,
                 const int64_t* p, const int64_t* d, int64_t OH, int64_t OW, int64_t m0, int64_t rows, bf16* A) {
  const int64_t K = C * kh * kw;
  at::parallel_for(0, rows, row_grain(K), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t m = m0 + r, ow = m % OW, oh = m / OW % OH, n = m / (OW * OH);
      bf16* dst = A + r * K;
      for (int64_t i = 0; i < kh; ++i) {
        const int64_t ih = oh * s[0] - p[0] + i * d[0];
        for (int64_t j = 0; j < kw; ++j, dst += C) {
          const int64_t iw = ow * s[1] - p[1] + j * d[1];
          if (ih < 0 || ih >= H || iw < 0 || iw >= W)
            std::fill(dst, dst + C, bf16(0.f));
          else
            std::copy_n(X + ((n * H + ih) * W + iw) * C, C, dst);
        }
      }
    }
  });
}

}  // namespace

at::Tensor rounded_bias(const std::optional<at::Tensor>& bias, at::ScalarType dtype) {
  return bias.has_value() ? bias->to(dtype).to(at::kFloat).contiguous() : at::Tensor();
}

std::optional<at::Tensor> conv2d_gemm(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                                      at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation,
                                      int64_t groups, Act act, Tier tier) {
  const int64_t C = w.size(1), kh = w.size(2), kw = w.size(3), K = C * kh * kw, Co = w.size(0);
  if (x.scalar_type() != at::kBFloat16 || tier != Tier::Amx || groups != 1 || K <= kDirectK || K % 2)
    return std::nullopt;
  const auto size = output_size(x, w, stride, padding, dilation);
  if (!size) return std::nullopt;
  const int64_t N = x.size(0), H = x.size(2), W = x.size(3), OH = (*size)[0], OW = (*size)[1];
  auto xc = x.contiguous(at::MemoryFormat::ChannelsLast);
  auto wp = pack_vnni(w.permute({0, 2, 3, 1}).reshape({Co, K}));
  const auto b32 = rounded_bias(bias, x.scalar_type());
  auto out = new_output({N, Co, OH, OW}, x.options().memory_format(at::MemoryFormat::ChannelsLast));
  const int64_t M = N * OH * OW;
  const int64_t s[2] = {stride[0], stride[1]}, p[2] = {padding[0], padding[1]}, d[2] = {dilation[0], dilation[1]};
  const int64_t mc = std::min(M, kGemmRows);
  bf16* A = thread_scratch<bf16, 0>(mc * K);
  for (int64_t m0 = 0; m0 < M; m0 += mc) {
    const int64_t rows = std::min(mc, M - m0);
    im2col_rows(xc.data_ptr<bf16>(), C, H, W, kh, kw, s, p, d, OH, OW, m0, rows, A);
    gemm_bf16(A, K, wp.data_ptr<bf16>(), {b32.defined() ? b32.data_ptr<float>() : nullptr, act},
              out.data_ptr<bf16>() + m0 * Co, Co, rows, Co, K, tier);
  }
  return out;
}

std::optional<at::Tensor> conv2d_direct(const at::Tensor& x, const at::Tensor& w,
                                        const std::optional<at::Tensor>& bias, at::IntArrayRef stride,
                                        at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups, Act act) {
  const int64_t K = w.size(1) * w.size(2) * w.size(3), kh = w.size(2), kw = w.size(3);
  if (groups != 1 || K > kDirectK || K == 0) return std::nullopt;
  const auto size = output_size(x, w, stride, padding, dilation);
  if (!size) return std::nullopt;
  const int64_t OH = (*size)[0], OW = (*size)[1];
  auto w32 = w.to(at::kFloat).reshape({w.size(0), K}).t().contiguous();  // [K][Co]
  const auto b32 = rounded_bias(bias, x.scalar_type());
  auto xc = x.contiguous();
  if (x.scalar_type() == at::kBFloat16)
    return conv2d_direct_impl<bf16>(xc, w32, b32, kh, kw, stride, padding, dilation, OH, OW, act);
  return conv2d_direct_impl<float>(xc, w32, b32, kh, kw, stride, padding, dilation, OH, OW, act);
}

}  // namespace amxopt
