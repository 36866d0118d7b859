// The amxopt ops' CPU kernels: input checks, provider choice, and the call into a driver.
//
// The schemas (and their fakes) are defined in Python (amxopt/ops/library.py); registering the CPU
// kernels here means a call from a graph goes through the C++ dispatcher only, with no Python in
// between. provider "auto" and "native" run amxopt's kernels on the active tier (cpu.cpp);
// "reference" calls the Python reference op of the same name (amxopt::reference_<op>), the oracle;
// "sgl_kernel" calls amxopt::sgl_<op> (SGLang's CPU kernels) for the ops it maps, see delegate().
// Every check raises ValueError naming the op and the offending shape or value.
#include <ATen/native/CPUBlas.h>
#include <c10/core/DispatchKeySet.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <optional>
#include <string>

#include "common.h"

namespace amxopt {
namespace {

#define AMX_CHECK(cond, op, ...) TORCH_CHECK_VALUE(cond, "amxopt.", op, ": ", __VA_ARGS__)

// The largest |scale| of an attention: the softmax multiplies it by log2(e) in float (library.py MAX_SCALE).
constexpr double kMaxScale = std::numeric_limits<float>::max() / 2.0;

// Shapes and dtypes as Python prints them, so a message reads the same from every provider.
std::string shape(at::IntArrayRef s) {
  std::ostringstream o;
  o << "(";
  for (size_t i = 0; i < s.size(); ++i) o << (i ? ", " : "") << s[i];
  o << (s.size() == 1 ? ",)" : ")");
  return o.str();
}

std::string list(const std::vector<int64_t>& v) {
  std::ostringstream o;
  o << "[";
  for (size_t i = 0; i < v.size(); ++i) o << (i ? ", " : "") << v[i];
  o << "]";
  return o.str();
}

std::string dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return "torch.float32";
    case at::kBFloat16:
      return "torch.bfloat16";
    case at::kHalf:
      return "torch.float16";
    case at::kDouble:
      return "torch.float64";
    case at::kLong:
      return "torch.int64";
    case at::kInt:
      return "torch.int32";
    case at::kShort:
      return "torch.int16";
    case at::kChar:
      return "torch.int8";
    case at::kByte:
      return "torch.uint8";
    case at::kBool:
      return "torch.bool";
    default:
      return std::string("torch.") + c10::toString(t);
  }
}

// Which Python-defined op runs instead of amxopt's kernels, if any: "reference" runs the oracle
// (amxopt::reference_<op>); "sgl_kernel" runs the op mapped onto SGLang's CPU kernels
// (amxopt::sgl_<op>, amxopt/ops/sgl.py) where one exists (`sgl_maps`), else amxopt's own kernels.
std::optional<std::string> delegate(c10::string_view provider, const char* op, bool sgl_maps) {
  if (provider == "auto" || provider == "native") return std::nullopt;
  if (provider == "reference") return std::string("amxopt::reference_") + op;
  if (provider == "sgl_kernel") return sgl_maps ? std::optional<std::string>(std::string("amxopt::sgl_") + op) : std::nullopt;
  AMX_CHECK(false, op, "unknown provider '", std::string(provider), "'; known: auto, native, reference, sgl_kernel");
}

template <typename Sig>
c10::TypedOperatorHandle<Sig> python_op(const std::string& name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), "").typed<Sig>();
}

// y = act(y) in place, by ATen's own activation kernels.
at::Tensor& activate_(at::Tensor& y, Act act) {
  switch (act) {
    case Act::None:
      return y;
    case Act::Gelu:
      return at::gelu_(y);
    case Act::GeluTanh:
      return at::gelu_(y, "tanh");
    case Act::Silu:
      return at::silu_(y);
  }
  return y;
}

Act parse_act(c10::string_view a, const char* op) {
  if (a == "none") return Act::None;
  if (a == "gelu") return Act::Gelu;
  if (a == "gelu_tanh") return Act::GeluTanh;
  if (a == "silu") return Act::Silu;
  AMX_CHECK(false, op, "activation must be one of none, gelu, gelu_tanh, silu, got '", std::string(a), "'");
}

AmxSchedule parse_schedule(c10::string_view name, const char* op) {
  const auto s = find_amx_schedule(name);
  AMX_CHECK(s, op, "amx_schedule must be one of default, groups, rows, got '", std::string(name), "'");
  return *s;
}

void check_float(const char* op, const char* name, const at::Tensor& t) {
  AMX_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, op, name,
            " must be float32 or bfloat16, got ", dtype_name(t.scalar_type()));
}

std::vector<int64_t> packed_shape(int64_t n, int64_t k, at::ScalarType dtype) {
  if (dtype == at::kBFloat16 && k % 2 == 0 && k > 0 && n > 0) return vnni_shape(n, k);
  return {n, k};
}

// Shared by linear and patch_embed: the packed weight must be the packing of an [N, K] weight.
at::Tensor check_gemm(const char* op, const std::string& x_desc, int64_t K, at::ScalarType x_dtype,
                      const at::Tensor& packed, const std::optional<at::Tensor>& bias, int64_t N) {
  AMX_CHECK(N > 0 && N <= INT32_MAX, op, "out_features must be in [1, 2**31), got ", N);
  AMX_CHECK(x_dtype == packed.scalar_type(), op, x_desc, " is ", dtype_name(x_dtype), " but the packed weight is ",
            dtype_name(packed.scalar_type()), "; cast the input or re-pack");
  const auto expected = packed_shape(N, K, x_dtype);
  AMX_CHECK(packed.sizes() == at::IntArrayRef(expected), op, x_desc, " has ", K,
            " input features; with out_features=", N, " the packed weight should have shape ", shape(expected),
            ", got ", shape(packed.sizes()));
  AMX_CHECK(packed.dim() == 2 || packed.is_contiguous(), op, "the packed weight must be contiguous");
  if (!bias.has_value()) return at::Tensor();
  AMX_CHECK(bias->dim() == 1 && bias->size(0) == N, op, "bias has shape ", shape(bias->sizes()), ", expected (", N, ",)");
  AMX_CHECK(bias->scalar_type() == x_dtype || bias->scalar_type() == at::kFloat, op, "bias is ", dtype_name(bias->scalar_type()),
            "; it must be ", x_dtype == at::kFloat ? "" : dtype_name(x_dtype) + " or ", "torch.float32");
  if (bias->scalar_type() == at::kFloat) return bias->contiguous();
  // Converted here rather than by Tensor::to, which cost ~10 us a call inside the op (2 threads of
  // an AMX Xeon, 16 x 1024 x 4096: 195 us with a bf16 bias, 185 with an fp32 one, 189 this way).
  auto src = bias->contiguous();
  auto bias32 = at::empty({N}, src.options().dtype(at::kFloat));
  vec().bf16_to_f32(src.data_ptr<bf16>(), bias32.data_ptr<float>(), N);
  return bias32;
}

// --- pack_linear_weight / linear / patch_embed -------------------------------------------------------

at::Tensor pack_linear_weight(const at::Tensor& w, c10::string_view provider) {
  const char* op = "pack_linear_weight";
  if (auto impl = delegate(provider, op, true))
    return python_op<at::Tensor(const at::Tensor&)>(*impl).call(w);
  AMX_CHECK(w.dim() == 2, op, "weight must be [N, K], got ", shape(w.sizes()));
  check_float(op, "weight", w);
  if (packed_shape(w.size(0), w.size(1), w.scalar_type()).size() == 3) return pack_vnni(w.detach());
  return w.detach().contiguous().clone();
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                  c10::string_view activation, int64_t out_features, c10::string_view provider,
                  const std::optional<at::Tensor>& residual, c10::string_view amx_schedule) {
  const char* op = "linear";
  const AmxSchedule schedule = parse_schedule(amx_schedule, op);  // checked for every provider
  if (auto impl = delegate(provider, op, true))
    return python_op<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                   c10::string_view, int64_t, const std::optional<at::Tensor>&)>(*impl)
        .call(x, packed, bias, activation, out_features, residual);
  const Act act = parse_act(activation, op);
  check_float(op, "x", x);
  AMX_CHECK(x.dim() >= 1 && x.size(-1) > 0, op, "x has shape ", shape(x.sizes()),
            "; it needs at least one dim, and in_features > 0");
  std::ostringstream desc;
  desc << "x " << shape(x.sizes());
  auto bias32 = check_gemm(op, desc.str(), x.size(-1), x.scalar_type(), packed, bias, out_features);
  auto x2 = x.reshape({-1, x.size(-1)});
  if (x2.stride(1) != 1 || (x2.size(0) > 1 && x2.stride(0) < x2.size(1))) x2 = x2.contiguous();
  auto sizes = x.sizes().vec();
  sizes.back() = out_features;
  at::Tensor r2;
  if (residual.has_value()) {
    AMX_CHECK(residual->sizes() == at::IntArrayRef(sizes), op, "residual has shape ", shape(residual->sizes()),
              ", expected the output's ", shape(sizes));
    AMX_CHECK(residual->scalar_type() == x.scalar_type(), op, "residual is ", dtype_name(residual->scalar_type()),
              " but x is ", dtype_name(x.scalar_type()));
    r2 = residual->reshape({-1, out_features});
    if (r2.stride(1) != 1 || (r2.size(0) > 1 && r2.stride(0) < out_features)) r2 = r2.contiguous();
  }
  return linear_2d(x2, packed, bias32, act, out_features, active_tier(), r2, schedule).view(sizes);
}

// Conv3d with kernel == stride as one GEMM: gather patches [B*T'*H'*W', C*kt*kh*kw], multiply, and
// return [B, O, T', H', W'] as a permuted view of the GEMM's [B, T', H', W', O] (channels-last).
at::Tensor patch_embed(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                       at::IntArrayRef kernel, int64_t out_channels, c10::string_view provider) {
  const char* op = "patch_embed";
  if (auto impl = delegate(provider, op, true))
    return python_op<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                   at::IntArrayRef, int64_t)>(*impl)
        .call(x, packed, bias, kernel, out_channels);
  AMX_CHECK(x.dim() == 5, op, "x must be [B, C, T, H, W], got ", shape(x.sizes()));
  AMX_CHECK(kernel.size() == 3, op, "kernel_size must have 3 entries, got ", list(kernel.vec()));
  AMX_CHECK(kernel[0] > 0 && kernel[1] > 0 && kernel[2] > 0, op, "kernel_size must be positive, got ", list(kernel.vec()));
  check_float(op, "x", x);
  for (int i = 0; i < 3; ++i)
    AMX_CHECK(x.size(2 + i) % kernel[i] == 0, op, "x ", shape(x.sizes()), " is not divisible by kernel ", shape(kernel));
  const int64_t B = x.size(0), C = x.size(1), kt = kernel[0], kh = kernel[1], kw = kernel[2];
  const int64_t nt = x.size(2) / kt, nh = x.size(3) / kh, nw = x.size(4) / kw, K = C * kt * kh * kw;
  std::ostringstream desc;
  desc << "x " << shape(x.sizes()) << " (patches of " << C << "x" << kt << "x" << kh << "x" << kw << " = " << K << ")";
  auto bias32 = check_gemm(op, desc.str(), K, x.scalar_type(), packed, bias, out_channels);
  auto patches = x.reshape({B, C, nt, kt, nh, kh, nw, kw})
                     .permute({0, 2, 4, 6, 1, 3, 5, 7})
                     .reshape({B * nt * nh * nw, K})
                     .contiguous();
  auto y = linear_2d(patches, packed, bias32, Act::None, out_channels, active_tier());
  return y.view({B, nt, nh, nw, out_channels}).permute({0, 4, 1, 2, 3});
}

// --- conv2d -----------------------------------------------------------------------------------------
// Any 2-D convolution, computed where this CPU is fast: few input values per output (Cin x kh x kw
// <= kDirectK, groups 1) by conv.cpp's direct kernel on every tier; a larger bf16 one (groups 1,
// even Cin x kh x kw) as im2col + the GEMM engine on the amx tier (conv.cpp); on the fp32 tier, a
// bf16 convolution runs in fp32 (ATen's bf16 convolution is emulated there: 30x slower for the Omni
// audio encoder's 3x3 stride-2 convs); elsewhere ATen's (oneDNN's) convolution in the input dtype.
// The activation is fused into conv.cpp's kernels; after ATen's convolution it runs in place (on the
// fp32 result, before the rounding, on the fp32 tier).
at::Tensor conv2d(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                  at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups,
                  c10::string_view activation, c10::string_view provider) {
  const char* op = "conv2d";
  if (auto impl = delegate(provider, op, false))
    return python_op<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                   at::IntArrayRef, at::IntArrayRef, at::IntArrayRef, int64_t, c10::string_view)>(
               *impl)
        .call(x, w, bias, stride, padding, dilation, groups, activation);
  const Act act = parse_act(activation, op);
  AMX_CHECK(x.dim() == 4, op, "x must be [B, C, H, W], got ", shape(x.sizes()));
  check_float(op, "x", x);
  AMX_CHECK(w.dim() == 4 && w.scalar_type() == x.scalar_type(), op, "weight must be a 4-D ", dtype_name(x.scalar_type()),
            " tensor, got ", dtype_name(w.scalar_type()), " ", shape(w.sizes()));
  AMX_CHECK(groups > 0 && w.size(1) * groups == x.size(1), op, "weight ", shape(w.sizes()), " with groups=", groups,
            " does not take the ", x.size(1), " channels of x ", shape(x.sizes()));
  AMX_CHECK(w.size(0) % groups == 0, op, "weight ", shape(w.sizes()), " has ", w.size(0),
            " output channels, not a multiple of groups=", groups);
  AMX_CHECK(stride.size() == 2 && padding.size() == 2 && dilation.size() == 2, op,
            "stride, padding and dilation need 2 entries each, got ", list(stride.vec()), ", ", list(padding.vec()),
            ", ", list(dilation.vec()));
  AMX_CHECK(w.size(0) > 0, op, "weight ", shape(w.sizes()), " has no output channels");
  AMX_CHECK(w.size(2) > 0 && w.size(3) > 0, op, "weight ", shape(w.sizes()), " has an empty kernel");
  AMX_CHECK(x.size(0) == 0 || x.size(1) == 0 || (x.size(2) > 0 && x.size(3) > 0), op, "x ", shape(x.sizes()),
            " has an empty spatial dim (only an empty batch or no channels may be empty)");
  for (int d = 0; d < 2; ++d) {
    AMX_CHECK(stride[d] > 0 && padding[d] >= 0 && dilation[d] > 0, op,
              "stride and dilation must be positive and padding not negative, got stride ", list(stride.vec()),
              ", padding ", list(padding.vec()), ", dilation ", list(dilation.vec()));
    // In checked arithmetic: a dilation of 2**62 wrapped, and its window was accepted.
    int64_t window, room;
    AMX_CHECK(!__builtin_mul_overflow(padding[d], 2, &room) && !__builtin_add_overflow(room, x.size(2 + d), &room),
              op, "padding ", list(padding.vec()), " overflows int64 with x ", shape(x.sizes()));
    const bool huge = __builtin_mul_overflow(dilation[d], w.size(2 + d) - 1, &window) ||
                      __builtin_add_overflow(window, 1, &window);
    AMX_CHECK(!huge && window <= room, op, "the kernel's window (", huge ? "past int64" : std::to_string(window),
              " with dilation ", dilation[d], ") is larger than x's padded size ", room, " in dim ", 2 + d, " of x ",
              shape(x.sizes()));
  }
  if (bias.has_value())
    AMX_CHECK(bias->dim() == 1 && bias->size(0) == w.size(0) &&
                  (bias->scalar_type() == x.scalar_type() || bias->scalar_type() == at::kFloat),
              op, "bias must be (", w.size(0), ",) in ", dtype_name(x.scalar_type()), " or float32, got ",
              dtype_name(bias->scalar_type()), " ", shape(bias->sizes()));
  if (auto direct = conv2d_direct(x, w, bias, stride, padding, dilation, groups, act)) return *direct;
  if (auto gemm = conv2d_gemm(x, w, bias, stride, padding, dilation, groups, act, active_tier())) return *gemm;
  // ATen's convolution of the layouts given, except where a window at an edge lies wholly in the
  // padding: there oneDNN's fp32 kernels for a channels-last x or weight (torch 2.13, AVX2) read out
  // of bounds, and crashed the process where eager fp32 crashes too. Its NCHW kernel does not; the
  // output is then laid out as ATen's would be (channels-last where x or the weight is).
  const bool edge_in_padding =
      padding[0] > dilation[0] * (w.size(2) - 1) || padding[1] > dilation[1] * (w.size(3) - 1);
  const auto aten_conv = [&](const at::Tensor& xs, const at::Tensor& ws, const std::optional<at::Tensor>& bs) {
    if (!edge_in_padding) return at::conv2d(xs, ws, bs, stride, padding, dilation, groups);
    const auto cl = at::MemoryFormat::ChannelsLast;
    const bool nhwc = x.suggest_memory_format() == cl || ws.suggest_memory_format() == cl;
    auto y = at::conv2d(xs.contiguous(), ws.contiguous(), bs, stride, padding, dilation, groups);
    return at::empty(y.sizes(), y.options().memory_format(nhwc ? cl : at::MemoryFormat::Contiguous)).copy_(y);
  };
  if (x.scalar_type() == at::kBFloat16 && active_tier() == Tier::Fp32) {
    std::optional<at::Tensor> b32;
    if (bias.has_value()) b32 = rounded_bias(bias, x.scalar_type());
    auto y = aten_conv(x.to(at::kFloat), w.to(at::kFloat), b32);
    return activate_(y, act).to(at::kBFloat16);
  }
  std::optional<at::Tensor> b;
  if (bias.has_value()) b = bias->to(x.scalar_type());
  // A channels-last x (the direct kernel's output) with a channels-last weight: oneDNN's NHWC kernel.
  const bool nhwc = x.suggest_memory_format() == at::MemoryFormat::ChannelsLast;
  auto y = aten_conv(x, nhwc ? w.contiguous(at::MemoryFormat::ChannelsLast) : w, b);
  return activate_(y, act);
}

// --- varlen_attention ---------------------------------------------------------------------------------

std::vector<int64_t> checked_bounds(const char* op, const char* name, const at::Tensor& cu, int64_t total,
                                    int64_t bound_arg, const char* bound_name) {
  AMX_CHECK(cu.dim() == 1 && cu.numel() >= 2 && !cu.is_floating_point() && !cu.is_complex() &&
                cu.scalar_type() != at::kBool, op, name,
            " must be a 1-D integer tensor of at least 2 segment bounds (0, ..., the token count), got ", dtype_name(cu.scalar_type()), " ", shape(cu.sizes()));
  auto c = cu.to(at::kLong).contiguous();
  std::vector<int64_t> b(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
  AMX_CHECK(b.front() == 0, op, name, " must start at 0, got ", b.front());
  AMX_CHECK(b.back() == total, op, name, " ends at ", b.back(), " but there are ", total, " tokens");
  int64_t longest = 0;
  for (size_t i = 1; i < b.size(); ++i) {
    AMX_CHECK(b[i] >= b[i - 1], op, name, " must be non-decreasing, got ", list(b));
    longest = std::max(longest, b[i] - b[i - 1]);
  }
  AMX_CHECK(bound_arg == 0 || bound_arg >= longest, op, bound_name, "=", bound_arg, " but the longest segment has ",
            longest, " tokens (pass 0 when unknown)");
  return b;
}

// The rotary embedding varlen_attention applies to q and k: one cos / sin row per token of a
// self-attention (D / 2 wide, or D wide for rotate_half's factors per half), as fp32 contiguous.
std::pair<at::Tensor, at::Tensor> checked_rotary(const char* op, const at::Tensor& q, const at::Tensor& k,
                                                 const std::optional<at::Tensor>& cos,
                                                 const std::optional<at::Tensor>& sin, bool interleaved) {
  AMX_CHECK(cos.has_value() == sin.has_value(), op, "rotary_cos and rotary_sin come together; got only ",
            cos.has_value() ? "rotary_cos" : "rotary_sin");
  if (!cos.has_value()) return {};
  const int64_t T = q.size(0), D = q.size(2);
  AMX_CHECK(k.size(0) == T, op, "a rotary embedding needs q and k of the same tokens (self-attention); q has ", T,
            " and k ", k.size(0));
  AMX_CHECK(D % 2 == 0, op, "a rotary embedding needs an even head dim, got ", D);
  check_float(op, "rotary_cos", *cos);
  check_float(op, "rotary_sin", *sin);
  const int64_t width = cos->dim() == 2 ? cos->size(1) : -1;
  const std::string wide = interleaved ? "" : " or [" + std::to_string(T) + ", " + std::to_string(D) + "] (rotate_half's "
                                                "factors per half)";
  AMX_CHECK(cos->dim() == 2 && cos->size(0) == T && (width == D / 2 || (width == D && !interleaved)), op,
            "rotary_cos must be [tokens, head_dim / 2], i.e. [", T, ", ", D / 2, "]", wide, ", got ",
            shape(cos->sizes()));
  AMX_CHECK(sin->sizes() == cos->sizes(), op, "rotary_cos ", shape(cos->sizes()), " and rotary_sin ",
            shape(sin->sizes()), " must have the same shape");
  return {cos->to(at::kFloat).contiguous(), sin->to(at::kFloat).contiguous()};
}

at::Tensor varlen_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_q,
                            const at::Tensor& cu_k, int64_t max_q, int64_t max_k, double scale, bool causal,
                            c10::string_view provider, const std::optional<at::Tensor>& rotary_cos,
                            const std::optional<at::Tensor>& rotary_sin, bool rotary_interleaved) {
  const char* op = "varlen_attention";
  if (auto impl = delegate(provider, op, true))
    return python_op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                   const at::Tensor&, int64_t, int64_t, double, bool,
                                   const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, bool)>(*impl)
        .call(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, rotary_cos, rotary_sin, rotary_interleaved);
  for (auto [name, t] : {std::pair<const char*, const at::Tensor&>{"q", q}, {"k", k}, {"v", v}}) {
    AMX_CHECK(t.dim() == 3, op, name, " must be packed [T, H, D], got ", shape(t.sizes()));
    check_float(op, name, t);
  }
  AMX_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type(), op, "q/k/v dtypes differ: ",
            dtype_name(q.scalar_type()), ", ", dtype_name(k.scalar_type()), ", ", dtype_name(v.scalar_type()));
  AMX_CHECK(k.sizes() == v.sizes(), op, "k ", shape(k.sizes()), " and v ", shape(v.sizes()), " must match");
  AMX_CHECK(q.size(2) == k.size(2), op, "head dims differ: q ", q.size(2), ", k ", k.size(2));
  AMX_CHECK(k.size(1) > 0, op, "k and v have no heads: ", shape(k.sizes()));
  AMX_CHECK(q.size(1) % k.size(1) == 0, op, q.size(1), " query heads are not a multiple of ", k.size(1),
            " key/value heads");
  AMX_CHECK(std::abs(scale) <= kMaxScale, op, "scale must be finite, at most ", kMaxScale, " in magnitude, got ", scale);
  const auto bq = checked_bounds(op, "cu_seqlens_q", cu_q, q.size(0), max_q, "max_seqlen_q");
  const auto bk = checked_bounds(op, "cu_seqlens_k", cu_k, k.size(0), max_k, "max_seqlen_k");
  AMX_CHECK(bq.size() == bk.size(), op, bq.size() - 1, " query segments but ", bk.size() - 1, " key segments");
  const auto [cos, sin] = checked_rotary(op, q, k, rotary_cos, rotary_sin, rotary_interleaved);
  if (q.numel() == 0) return at::empty({q.size(0), q.size(1), v.size(2)}, q.options());
  return varlen_attention_native(q, k, v, bq, bk, scale, causal, active_tier(), cos, sin, rotary_interleaved);
}

// --- norms ------------------------------------------------------------------------------------------

void check_norm(const char* op, const at::Tensor& x, const std::optional<at::Tensor>& w,
                const std::optional<at::Tensor>& b, double eps) {
  AMX_CHECK(x.dim() >= 1, op, "x has shape ", shape(x.sizes()), "; it needs at least one dim");
  AMX_CHECK(std::isfinite(eps) && eps >= 0, op, "eps must be finite and not negative, got ", eps);
  check_float(op, "x", x);
  for (auto [name, p] : {std::pair<const char*, const std::optional<at::Tensor>&>{"weight", w}, {"bias", b}}) {
    if (!p.has_value()) continue;
    AMX_CHECK(p->dim() == 1 && p->size(0) == x.size(-1), op, name, " has shape ", shape(p->sizes()), ", expected (",
              x.size(-1), ",) for x ", shape(x.sizes()));
    check_float(op, name, *p);
  }
}

at::Tensor layer_norm(const at::Tensor& x, const std::optional<at::Tensor>& w, const std::optional<at::Tensor>& b,
                      double eps, c10::string_view provider) {
  const char* op = "layer_norm";
  if (auto impl = delegate(provider, op, true))
    return python_op<at::Tensor(const at::Tensor&, const std::optional<at::Tensor>&,
                                   const std::optional<at::Tensor>&, double)>(*impl)
        .call(x, w, b, eps);
  check_norm(op, x, w, b, eps);
  return norm_native(x, w, b, eps, false);
}

at::Tensor rms_norm(const at::Tensor& x, const std::optional<at::Tensor>& w, double eps, c10::string_view provider) {
  const char* op = "rms_norm";
  if (auto impl = delegate(provider, op, true))
    return python_op<at::Tensor(const at::Tensor&, const std::optional<at::Tensor>&, double)>(*impl)
        .call(x, w, eps);
  check_norm(op, x, w, std::nullopt, eps);
  return norm_native(x, w, std::nullopt, eps, true);
}

// --- glue: modulated norm, gated residual, rotary embedding ------------------------------------------

// `p` broadcasts to x's leading dims with a last dim of `width` (its own last dim must be `width`).
void check_broadcast(const char* op, const char* name, const at::Tensor& p, const at::Tensor& x, int64_t width) {
  check_float(op, name, p);
  bool ok = p.dim() >= 1 && p.dim() <= x.dim() && p.size(-1) == width;
  for (int64_t d = 2; ok && d <= p.dim(); ++d) ok = p.size(-d) == 1 || p.size(-d) == x.size(-d);
  std::vector<int64_t> want(x.sizes().begin(), x.sizes().end());
  want.back() = width;
  AMX_CHECK(ok, op, name, " has shape ", shape(p.sizes()), ", which does not broadcast to ", shape(want), " for x ",
            shape(x.sizes()));
}

at::Tensor norm_modulate(const at::Tensor& x, const std::optional<at::Tensor>& w, const std::optional<at::Tensor>& b,
                         const at::Tensor& scale, const at::Tensor& shift, double eps, bool rms,
                         c10::string_view provider) {
  const char* op = "norm_modulate";
  if (auto impl = delegate(provider, op, false))
    return python_op<at::Tensor(const at::Tensor&, const std::optional<at::Tensor>&,
                                   const std::optional<at::Tensor>&, const at::Tensor&, const at::Tensor&, double,
                                   bool)>(*impl)
        .call(x, w, b, scale, shift, eps, rms);
  check_norm(op, x, w, b, eps);
  AMX_CHECK(!(rms && b.has_value()), op, "an RMSNorm has no bias");
  check_broadcast(op, "scale", scale, x, x.size(-1));
  check_broadcast(op, "shift", shift, x, x.size(-1));
  return norm_native(x, w, b, eps, rms, scale, shift);
}

at::Tensor gated_residual(const at::Tensor& x, const at::Tensor& y, const at::Tensor& gate,
                          c10::string_view provider) {
  const char* op = "gated_residual";
  if (auto impl = delegate(provider, op, false))
    return python_op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&)>(*impl)
        .call(x, y, gate);
  AMX_CHECK(x.dim() >= 1, op, "x has shape ", shape(x.sizes()), "; it needs at least one dim");
  check_float(op, "x", x);
  AMX_CHECK(y.sizes() == x.sizes() && y.scalar_type() == x.scalar_type(), op, "y must match x ",
            dtype_name(x.scalar_type()), " ", shape(x.sizes()), ", got ", dtype_name(y.scalar_type()), " ",
            shape(y.sizes()));
  check_broadcast(op, "gate", gate, x, x.size(-1));
  return gated_residual_native(x, y, gate);
}

at::Tensor rotary_embedding(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool interleaved,
                            c10::string_view provider) {
  const char* op = "rotary_embedding";
  if (auto impl = delegate(provider, op, false))
    return python_op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, bool)>(*impl)
        .call(x, cos, sin, interleaved);
  AMX_CHECK(x.dim() >= 1 && x.size(-1) % 2 == 0, op, "x ", shape(x.sizes()),
            " must end in an even dim (pairs of values to rotate)");
  check_float(op, "x", x);
  AMX_CHECK(cos.sizes() == sin.sizes(), op, "cos ", shape(cos.sizes()), " and sin ", shape(sin.sizes()),
            " must have the same shape");
  // One cos / sin per pair (D / 2), or rotate_half's factors for each half (D, not interleaved).
  const int64_t D = x.size(-1), width = !interleaved && cos.dim() >= 1 && cos.size(-1) == D ? D : D / 2;
  check_broadcast(op, "cos", cos, x, width);
  check_broadcast(op, "sin", sin, x, width);
  return rotary_native(x, cos, sin, interleaved);
}

// --- what runs here (amxopt info, tests, benches) ---------------------------------------------------------

std::string cpu_tier_name() { return tier_name(cpu_tier()); }
std::string active_tier_name() { return tier_name(active_tier()); }
void set_max_tier_name(c10::string_view name) { set_max_tier(parse_tier(std::string(name))); }
std::string vec_isa() { return vec().isa; }
std::string amx_schedule_now() { return amx_schedule_name(amx_schedule()); }
void set_amx_schedule_name(c10::string_view name) { set_amx_schedule(parse_amx_schedule(std::string(name))); }
bool amx_schedule_matters_for(int64_t rows, int64_t k) { return amx_schedule_matters(rows, k); }
std::string gemm_engine_name(c10::string_view tier, int64_t rows) {
  return gemm_engine(parse_tier(std::string(tier)), rows);
}
std::string attention_engine_name(c10::string_view tier, bool bf16) {
  return attention_engine(parse_tier(std::string(tier)), at::empty({0}, bf16 ? at::kBFloat16 : at::kFloat));
}
std::vector<int64_t> linear_work_split_for(int64_t m, int64_t n, int64_t k, int64_t threads) {
  AMX_CHECK(m >= 1 && n >= 1 && k >= 2 && k % 2 == 0 && threads >= 1, "linear_work_split",
            "needs positive sizes, an even K (packed bf16 weights) and threads, got M=", m, " N=", n, " K=", k,
            " threads=", threads);
  return linear_work_split(m, n, k, threads);
}
std::vector<int64_t> attention_work_split_for(at::IntArrayRef q_lens, int64_t heads, bool bf16, int64_t threads) {
  AMX_CHECK(heads >= 1 && threads >= 1 && std::all_of(q_lens.begin(), q_lens.end(), [](int64_t l) { return l >= 0; }),
            "attention_work_split", "needs non-negative segment lengths and positive heads and threads, got ",
            list(q_lens.vec()), ", heads=", heads, ", threads=", threads);
  return attention_work_split(q_lens.vec(), heads, bf16 && active_tier() != Tier::Fp32, threads);
}

}  // namespace
}  // namespace amxopt

// Every amxopt op's Autograd kernel: torch's "not implemented" one. The ops compute inference only:
// an output of inputs that require grad gets a node whose backward raises, naming the op. (Without
// one, PyTorch's default fallback let the ATen calls inside a kernel record a partial graph: a
// linear's gradient silently missed its fused bias and activation.) Forward calls and traces
// (export, make_fx with parameters that require grad) run as before.
TORCH_LIBRARY_IMPL(amxopt, Autograd, m) {
  for (const char* op : {"pack_linear_weight", "linear", "patch_embed", "varlen_attention", "conv2d", "layer_norm",
                         "rms_norm", "norm_modulate", "gated_residual", "rotary_embedding"})
    m.impl(op, torch::autograd::autogradNotImplementedFallback());
}

TORCH_LIBRARY_IMPL(amxopt, CPU, m) {
  m.impl("pack_linear_weight", &amxopt::pack_linear_weight);
  m.impl("linear", &amxopt::linear);
  m.impl("patch_embed", &amxopt::patch_embed);
  m.impl("varlen_attention", &amxopt::varlen_attention);
  m.impl("conv2d", &amxopt::conv2d);
  m.impl("layer_norm", &amxopt::layer_norm);
  m.impl("rms_norm", &amxopt::rms_norm);
  m.impl("norm_modulate", &amxopt::norm_modulate);
  m.impl("gated_residual", &amxopt::gated_residual);
  m.impl("rotary_embedding", &amxopt::rotary_embedding);
}

TORCH_LIBRARY(amxopt_native, m) {
  m.def("cpu_tier() -> str", &amxopt::cpu_tier_name);
  m.def("active_tier() -> str", &amxopt::active_tier_name);
  m.def("set_max_tier(str tier) -> ()", &amxopt::set_max_tier_name);
  m.def("vec_isa() -> str", &amxopt::vec_isa);
  m.def("amx_emulated() -> bool", &amxopt::amx_emulated);
  m.def("amx_emulated_blocks() -> int", &amxopt::amx_emulated_blocks);
  m.def("amx_schedule() -> str", &amxopt::amx_schedule_now);
  m.def("set_amx_schedule(str schedule) -> ()", &amxopt::set_amx_schedule_name);
  m.def("amx_schedule_matters(int rows, int k) -> bool", &amxopt::amx_schedule_matters_for);
  m.def("gemm_engine(str tier, int rows) -> str", &amxopt::gemm_engine_name);
  m.def("attention_engine(str tier, bool bf16) -> str", &amxopt::attention_engine_name);
  m.def("linear_work_split(int m, int n, int k, int threads) -> int[]", &amxopt::linear_work_split_for);
  m.def("release_output_pool() -> ()", &amxopt::release_output_pool);
  m.def("output_pool_bytes() -> int", &amxopt::output_pool_bytes);
  m.def("set_output_pool_enabled(bool on) -> bool", &amxopt::set_output_pool_enabled);
  m.def("output_pool_enabled() -> bool", &amxopt::output_pool_enabled);
  m.def("attention_work_split(int[] q_lens, int heads, bool bf16, int threads) -> int[]",
        &amxopt::attention_work_split_for);
}
