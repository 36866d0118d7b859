// amxopt.varlen_attention kernel: flash-style attention over packed [T, H, D] segments, bf16 in,
// fp32 accumulation, AVX-512-BF16 dot products; never materializes more than a [kBQ, kBK] score tile.
//
// Phase 1 (parallel over segment x kv head): K and V of each segment are packed once into the VNNI
// B layout (common.h): K as the B of S = Q K^T (keys are output columns, D the reduction), V as the
// B of O = P V (D is the output, keys the reduction), keys zero padded to a multiple of kBK. GQA heads
// share their kv head's packing.
// Phase 2 (parallel over segment x head x query block of kBQ rows, so many short segments still fill
// every core): Q rows are packed into A chunks; for each key block S = Q K^T (fp32), masked (segment
// end; causal, bottom-right aligned), online softmax with running max/sum, P rounded to bf16 and
// re-laid into A-chunk layout, O += P V in fp32; finally O / sum -> bf16. Rows that see no key output zeros.
#include "avx512_bf16.h"

#include <limits>
#include <vector>

namespace amxopt {
namespace {

constexpr int64_t kBQ = 48;   // query rows per work item (4 A chunks)
constexpr int64_t kBK = 256;  // keys per block (measured: 256 beats 128 by 5-20% on 784 x 64, 8 x 104 and 1280 x 128)
static_assert(kBQ % kMR == 0 && kBK % kNB == 0, "blocks must hold whole chunks");

// C[MR rows, ncols] (ldc apart, fp32) = (accumulate ? C : 0) + A chunk x one B block.
template <int MR>
struct Mma {
  static void run(const uint32_t* Ap, const bf16* B, int64_t pairs, float* C, int64_t ldc, int64_t ncols,
                  bool accumulate) {
    const __mmask16 m0 = tail_mask(ncols), m1 = tail_mask(ncols - 16);
    __m512 acc[MR][2];
    for (int i = 0; i < MR; ++i) {
      acc[i][0] = accumulate ? _mm512_maskz_loadu_ps(m0, C + i * ldc) : _mm512_setzero_ps();
      acc[i][1] = accumulate && ncols > 16 ? _mm512_maskz_loadu_ps(m1, C + i * ldc + 16) : _mm512_setzero_ps();
    }
    dot_block<MR>(acc, Ap, B, pairs);
    for (int i = 0; i < MR; ++i) {
      _mm512_mask_storeu_ps(C + i * ldc, m0, acc[i][0]);
      if (ncols > 16) _mm512_mask_storeu_ps(C + i * ldc + 16, m1, acc[i][1]);
    }
  }
};
const auto kMma = make_row_table<Mma>(std::make_integer_sequence<int, kMR>{});

struct Segment {
  int64_t q0, lq, k0, lk;
};

}  // namespace

// q/k/v bf16 with unit head-dim stride (checked by the caller); bq/bk the segment bounds.
at::Tensor varlen_attention_avx512_bf16(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                        const std::vector<int64_t>& bq, const std::vector<int64_t>& bk, double scale_d,
                                        bool causal) {
  const int64_t H = q.size(1), Hk = k.size(1), D = q.size(2), group = H / Hk;
  const int64_t q_row = q.stride(0), q_head = q.stride(1), k_row = k.stride(0), k_head = k.stride(1);
  const int64_t v_row = v.stride(0), v_head = v.stride(1);
  const int64_t nseg = int64_t(bq.size()) - 1;
  std::vector<Segment> segs(nseg);
  std::vector<int64_t> pack_off(nseg + 1, 0);  // bf16 elements of packed K+V per kv head, prefix sums
  const int64_t d_pairs = (D + 1) / 2, d_blocks = (D + kNB - 1) / kNB;
  for (int64_t s = 0; s < nseg; ++s) {
    segs[s] = {bq[s], bq[s + 1] - bq[s], bk[s], bk[s + 1] - bk[s]};
    const int64_t keys = (segs[s].lk + kBK - 1) / kBK * kBK;
    pack_off[s + 1] = pack_off[s] + Hk * (keys * d_pairs * 2 + d_blocks * kNB * keys);
  }
  auto packed = at::zeros({pack_off[nseg]}, q.options());
  bf16* P = packed.data_ptr<bf16>();
  const bf16 *Q = q.data_ptr<bf16>(), *K = k.data_ptr<bf16>(), *V = v.data_ptr<bf16>();
  auto kv_of = [&](int64_t s, int64_t hk, bool value) {
    const int64_t keys = (segs[s].lk + kBK - 1) / kBK * kBK, k_size = keys * d_pairs * 2;
    bf16* base = P + pack_off[s] + hk * (k_size + d_blocks * kNB * keys);
    return value ? base + k_size : base;
  };
  // Phase 1: pack K and V per (segment, kv head).
  at::parallel_for(0, nseg * Hk, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const int64_t s = i / Hk, hk = i % Hk;
      const Segment& sg = segs[s];
      const int64_t keys = (sg.lk + kBK - 1) / kBK * kBK;
      pack_b_vnni(K + sg.k0 * k_row + hk * k_head, k_row, sg.lk, D, kv_of(s, hk, false));
      pack_b_vnni_t(V + sg.k0 * v_row + hk * v_head, v_row, D, sg.lk, keys / 2, kv_of(s, hk, true));
    }
  });
  // Phase 2: work items (segment, head, query block).
  // Query blocks of at most kBQ rows, balanced (104 rows -> 3 x 36, not 48 + 48 + 8).
  std::vector<std::array<int64_t, 4>> items;
  for (int64_t s = 0; s < nseg; ++s) {
    const int64_t lq = segs[s].lq, nblk = (lq + kBQ - 1) / kBQ;
    const int64_t step = nblk ? ((lq + nblk - 1) / nblk + kMR - 1) / kMR * kMR : 0;
    for (int64_t h = 0; h < H; ++h)
      for (int64_t r = 0; r < lq; r += step) items.push_back({s, h, r, std::min(step, lq - r)});
  }
  auto out = new_output({q.size(0), H, D}, q.options());
  bf16* O = out.data_ptr<bf16>();
  const float scale = float(scale_d);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, int64_t(items.size()), 1, [&](int64_t b, int64_t e) {
    std::vector<uint32_t> qa(kBQ / kMR * d_pairs * kMR), pa(kBQ / kMR * (kBK / 2) * kMR);
    std::vector<bf16> pt(kBQ * kBK);
    std::vector<float> S(kBQ * kBK), acc(kBQ * D), row_max(kBQ), row_sum(kBQ);
    for (int64_t it = b; it < e; ++it) {
      const auto [s, h, r0, rows] = items[it];
      const Segment& sg = segs[s];
      const int64_t hk = h / group, chunks = (rows + kMR - 1) / kMR;
      const int64_t keys_pad = (sg.lk + kBK - 1) / kBK * kBK;
      const bf16* Kp = kv_of(s, hk, false);
      const bf16* Vp = kv_of(s, hk, true);
      for (int64_t c = 0; c < chunks; ++c)
        pack_a_chunk(Q + (sg.q0 + r0 + c * kMR) * q_row + h * q_head, q_row, std::min<int64_t>(kMR, rows - c * kMR),
                     D, qa.data() + c * d_pairs * kMR);
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(row_max.begin(), row_max.end(), neg_inf);
      std::fill(row_sum.begin(), row_sum.end(), 0.f);
      // Causal (bottom-right): query row i of the segment sees keys j <= i + lk - lq.
      const int64_t shift = sg.lk - sg.lq;
      const int64_t key_end = causal ? std::min(sg.lk, r0 + rows + shift) : sg.lk;
      for (int64_t j0 = 0; j0 < key_end; j0 += kBK) {
        const int64_t nk = std::min(kBK, key_end - j0);
        for (int64_t c = 0; c < chunks; ++c) {
          const int mr = int(std::min<int64_t>(kMR, rows - c * kMR));
          for (int64_t nb = 0; nb < (nk + kNB - 1) / kNB; ++nb)
            kMma[mr - 1](qa.data() + c * d_pairs * kMR, Kp + (j0 / kNB + nb) * d_pairs * kNB * 2, d_pairs,
                         S.data() + c * kMR * kBK + nb * kNB, kBK, std::min(kNB, nk - nb * kNB), false);
        }
        // Online softmax over this key block, vectorized per row; P rounded to bf16 row-major, then
        // re-laid into A chunks (k pairs major) for P V.
        const __m512 vscale = _mm512_set1_ps(scale);
        for (int64_t i = 0; i < rows; ++i) {
          const float* srow = S.data() + i * kBK;
          bf16* prow = pt.data() + i * kBK;
          const int64_t visible = causal ? std::max<int64_t>(0, std::min(nk, r0 + i + shift + 1 - j0)) : nk;
          // max(S * scale): from the largest raw score, or the smallest one when the scale is negative.
          __m512 vmax = _mm512_set1_ps(neg_inf), vmin = _mm512_set1_ps(-neg_inf);
          for (int64_t j = 0; j < visible; j += 16) {
            const __mmask16 m = tail_mask(visible - j);
            const __m512 x = _mm512_loadu_ps(srow + j);
            vmax = _mm512_mask_max_ps(vmax, m, vmax, x);
            vmin = _mm512_mask_min_ps(vmin, m, vmin, x);
          }
          const float extreme = scale >= 0.f ? _mm512_reduce_max_ps(vmax) : _mm512_reduce_min_ps(vmin);
          const float mx = visible > 0 ? std::max(row_max[i], extreme * scale) : row_max[i];
          const __m512 vm = _mm512_set1_ps(mx);
          __m512 vsum = _mm512_setzero_ps();
          for (int64_t j = 0; j < nk; j += 16) {
            const __mmask16 m = visible > j ? tail_mask(visible - j) : 0;
            const __m512 x = _mm512_fmsub_ps(_mm512_maskz_loadu_ps(m, srow + j), vscale, vm);
            const __m512 p = _mm512_maskz_mov_ps(m, __m512(exp_fast(fVec(x))));
            vsum = _mm512_add_ps(vsum, p);
            store_bf16_masked(prow + j, p, tail_mask(nk - j));
          }
          if (visible <= 0) continue;
          const float corr = row_max[i] == neg_inf ? 0.f : std::exp(row_max[i] - mx);
          row_max[i] = mx;
          row_sum[i] = row_sum[i] * corr + _mm512_reduce_add_ps(vsum);
          if (corr != 1.f) {
            float* arow = acc.data() + i * D;
            const __m512 vc = _mm512_set1_ps(corr);
            for (int64_t d = 0; d < D; d += 16) {
              const __mmask16 m = tail_mask(D - d);
              _mm512_mask_storeu_ps(arow + d, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, arow + d), vc));
            }
          }
        }
        for (int64_t c = 0; c < chunks; ++c)
          pack_a_chunk(pt.data() + c * kMR * kBK, kBK, std::min<int64_t>(kMR, rows - c * kMR), nk,
                       pa.data() + c * (kBK / 2) * kMR);
        for (int64_t c = 0; c < chunks; ++c) {
          const int mr = int(std::min<int64_t>(kMR, rows - c * kMR));
          for (int64_t db = 0; db < d_blocks; ++db)
            kMma[mr - 1](pa.data() + c * (kBK / 2) * kMR, Vp + db * (keys_pad / 2) * kNB * 2 + (j0 / 2) * kNB * 2,
                         (nk + 1) / 2, acc.data() + c * kMR * D + db * kNB, D, std::min(kNB, D - db * kNB), true);
        }
      }
      for (int64_t i = 0; i < rows; ++i) {
        const float inv = row_sum[i] > 0.f ? 1.f / row_sum[i] : 0.f;
        bf16* orow = O + (sg.q0 + r0 + i) * H * D + h * D;
        const float* arow = acc.data() + i * D;
        for (int64_t d = 0; d < D; d += 16) {
          const __mmask16 m = tail_mask(D - d);
          store_bf16_masked(orow + d, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, arow + d), _mm512_set1_ps(inv)), m);
        }
      }
    }
  });
  return out;
}

}  // namespace amxopt
