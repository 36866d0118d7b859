// Driver of amxopt.varlen_attention: packed q [T, H, D], k/v [Tk, Hk, D], segments from cu_seqlens.
//
// bf16 on the avx512_bf16 tier: the flash kernel of attention_avx512_bf16.cpp (one call for all
// segments, K/V packed once per segment and kv head). Everything else: ATen's fused CPU attention,
// one call per run of consecutive segments with equal lengths (a batch of views, no copies; Qwen's
// frames and the audio windows are such runs), so there is no per-segment loop in Python and,
// usually, one call in C++. It computes in bf16 on the amx tier (its block GEMMs are oneDNN's, on
// AMX tiles: faster there than the AVX-512 kernel) and in fp32 otherwise (the fp32 tier converts
// bf16 inputs: where bf16 is emulated, fp32 is faster).
// Causal is bottom-right aligned; query rows that see no key give zeros.
#include "common.h"

namespace amxopt {
namespace {

// n segments of l rows of a packed [T, heads, d] tensor, from row `skip` of each, as an
// [n, heads, l - skip, d] view (ATen's fused kernel runs as fast on it as on a contiguous copy).
at::Tensor batch(const at::Tensor& x, int64_t row0, int64_t n, int64_t l, int64_t skip) {
  return x.narrow(0, row0, n * l).reshape({n, l, x.size(1), x.size(2)}).narrow(1, skip, l - skip).transpose(1, 2);
}

at::Tensor attention_sdpa(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::vector<int64_t>& bq,
                          const std::vector<int64_t>& bk, double scale, bool causal, at::ScalarType compute) {
  const int64_t H = q.size(1), Hk = k.size(1), Dv = v.size(2), nseg = int64_t(bq.size()) - 1;
  // softmax(s q.k) == softmax(|s| (-q).k): ATen's kernels mishandle a negative scale with a mask.
  auto q32 = scale < 0 ? q.neg().to(compute) : q.to(compute), k32 = k.to(compute), v32 = v.to(compute);
  bool blind = false;  // some query row sees no key: its output is zero
  for (int64_t s = 0; s < nseg; ++s) {
    const int64_t lq = bq[s + 1] - bq[s], lk = bk[s + 1] - bk[s];
    blind |= lq > 0 && (lk == 0 || (causal && lq > lk));
  }
  auto out = blind ? at::zeros({q.size(0), H, Dv}, q.options()) : at::empty({q.size(0), H, Dv}, q.options());
  for (int64_t s = 0; s < nseg;) {
    const int64_t lq = bq[s + 1] - bq[s], lk = bk[s + 1] - bk[s];
    int64_t e = s + 1;
    while (e < nseg && bq[e + 1] - bq[e] == lq && bk[e + 1] - bk[e] == lk) ++e;
    const int64_t n = e - s;
    // Causal: the first lq - lk rows of a segment see no key (zeros); the rest see a bottom-right mask.
    const int64_t skip = causal ? std::min(lq, std::max<int64_t>(0, lq - lk)) : 0;
    if (lq > skip && lk > 0) {
      const int64_t rows = lq - skip;
      auto qs = batch(q32, bq[s], n, lq, skip), ks = batch(k32, bk[s], n, lk, 0), vs = batch(v32, bk[s], n, lk, 0);
      std::optional<at::Tensor> mask;
      if (causal && rows != lk)  // row i sees key j iff j <= i + lk - rows
        mask = at::arange(lk).unsqueeze(0) <= at::arange(rows).unsqueeze(1) + (lk - rows);
      auto o = at::scaled_dot_product_attention(qs, ks, vs, mask, 0.0, causal && rows == lk, std::abs(scale), H != Hk);
      out.narrow(0, bq[s], n * lq).view({n, lq, H, Dv}).narrow(1, skip, rows).copy_(o.transpose(1, 2));
    }
    s = e;
  }
  return out;
}

}  // namespace

const char* attention_engine(Tier tier, const at::Tensor& q) {
  if (q.scalar_type() != at::kBFloat16 || tier == Tier::Fp32)
    return "ATen fused attention in fp32, per run of equal segments";
  return tier == Tier::Amx ? "ATen fused attention in bf16 (oneDNN on AMX), per run of equal segments"
                           : "avx512_bf16 flash kernel";
}

at::Tensor varlen_attention_native(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   const std::vector<int64_t>& bq, const std::vector<int64_t>& bk, double scale,
                                   bool causal, Tier tier) {
  const bool bf = q.scalar_type() == at::kBFloat16;
  const bool unit_d = q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1;
  if (bf && tier == Tier::Avx512Bf16 && unit_d) return varlen_attention_avx512_bf16(q, k, v, bq, bk, scale, causal);
  return attention_sdpa(q, k, v, bq, bk, scale, causal, bf && tier == Tier::Amx ? at::kBFloat16 : at::kFloat);
}

}  // namespace amxopt
