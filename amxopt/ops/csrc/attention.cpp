// Driver of amxopt.varlen_attention: packed q [T, H, D], k/v [Tk, Hk, D], segments from cu_seqlens.
//
// bf16 on the avx512_bf16 tier: the hand-written flash kernel of attention_avx512_bf16.cpp.
// Everything else: flash attention on oneDNN's brgemm (below), whose two block GEMMs, S = Q K^T and
// O += P V, are at::native::cpublas::brgemm calls. T is their element type:
//   bf16   the amx tier: B operands in the VNNI layout ([K / 2][ldb][2]) that brgemm runs on AMX
//          tiles; P V's reduction padded to a whole AMX tile (32 keys), as SGLang's CPU kernels do;
//          with a head dim that is a multiple of 32, both GEMMs run on gemm_amx.cpp's tile kernel;
//   float  the fp32 tier and fp32 inputs: plain B operands ([K][ldb]), oneDNN's AVX2 / AVX-512 fp32
//          brgemm (bf16 inputs are converted while packing, the output is rounded back once).
//
// Phase 1 (parallel over segment x kv head): K and V of each segment are packed once, keys zero
// padded to a multiple of kKeyPad: K as the B of S, one [D (even for bf16)] x [up to kBK keys]
// operand per key block (a 32-bit transpose: fp32 values or bf16 pairs); V as the B of P V, one
// [keys] x [D] operand (bf16: pairs of keys interleaved). GQA heads read their kv head's packing.
// Phase 2 (parallel over segment x head x query block of at most kBQ rows, balanced: 784 rows are
// 3 x 208 + 160 in bf16, 12 x 64 + 16 in fp32; many short segments still fill every core): the
// block's Q rows are copied into a T buffer (a strided A measured slower than the copy), every
// buffer cache-line aligned (common.h's Scratch); per key block: S by one brgemm, one online
// softmax row at a time (vec(): max, exp, sum, P in T), the accumulator rows rescaled where the max
// moved, then acc += P V by one brgemm (the first key block writes acc instead). Finally O = acc / l, rounded
// once. Causal is bottom-right aligned; rows that see no key output zeros.
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <array>
#include <limits>
#include <vector>

#include "common.h"

namespace amxopt {
namespace {

constexpr int64_t kTileM = 16;  // query blocks are whole AMX tiles of rows where they can be
constexpr int64_t kKeyPad = 32;  // a segment's keys are zero padded to this (a whole AMX tile of P V)

template <typename T>
constexpr int64_t kPair = std::is_same_v<T, bf16> ? 2 : 1;  // reduction values per B row (VNNI pairs)
template <typename T>
constexpr int64_t kTileK = std::is_same_v<T, bf16> ? kKeyPad : 1;  // P V's reduction is padded to this

// Query rows per work item (the M of both brgemm calls) and keys per block (the N of S, the K of P V),
// by GEMM element type. bf16, on AMX tiles: 256 x 512, so that each call reuses its B block over 16 row
// tiles and the per-call cost is spread over 16x more work (on a 2-core AMX Xeon, one long segment ran
// at 0.84-0.93x eager SDPA with these against 0.74-0.84x with 64 x 256; about 1 MB of scratch per
// thread). fp32: 64 x 256, whose 64 KB score block fits a 512 KB L2 (Zen 3, where it was measured).
template <typename T>
constexpr int64_t kBQ = std::is_same_v<T, bf16> ? 256 : 64;
template <typename T>
constexpr int64_t kBK = std::is_same_v<T, bf16> ? 512 : 256;

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// A brgemm B operand [rows_pad / r][ldb][r] (r = kPair<T>) from a [rows (reduction), cols] source
// whose element (i, j) is src[i * si + j * sj]; rows beyond the source and columns beyond cols are
// zero (rows_pad a multiple of r, cols <= ldb). Element by element: for the layouts the vector paths
// of pack_k / pack_v do not take (a head dim with a stride, an odd one in bf16).
template <typename T, typename S>
void pack_b(const S* src, int64_t si, int64_t sj, int64_t rows, int64_t cols, int64_t rows_pad, int64_t ldb,
            T* dst) {
  constexpr int64_t r = kPair<T>;
  for (int64_t i = 0; i < rows_pad; ++i) {
    T* row = dst + (i / r) * ldb * r + i % r;
    const int64_t n = i < rows ? cols : 0;
    for (int64_t j = 0; j < n; ++j) row[j * r] = T(float(src[i * si + j * sj]));
    for (int64_t j = n; j < ldb; ++j) row[j * r] = T(0.f);
  }
}

// K^T of one key block as the B of S: [Dp / r][ldb][r] from nk keys of D values (key j at src + j * ld,
// value d at + d * sd); keys past nk are zero columns. A key's values (or bf16 pairs of them) are
// 32-bit units, so the packing is a 32-bit transpose (after a conversion to fp32 for T = float).
template <typename T, typename S>
void pack_k(const S* src, int64_t ld, int64_t sd, int64_t nk, int64_t D, int64_t Dp, int64_t ldb, T* dst,
            std::vector<float>& tmp) {
  const auto& vk = vec();
  constexpr int64_t r = kPair<T>;
  if (sd != 1 || (r == 2 && (D % 2 || ld % 2))) return pack_b<T, S>(src, sd, ld, D, nk, Dp, ldb, dst);
  const float* s32 = reinterpret_cast<const float*>(src);
  int64_t lds = ld / r;
  if constexpr (std::is_same_v<T, float> && std::is_same_v<S, bf16>) {  // convert, then transpose
    tmp.resize(nk * D);
    for (int64_t j = 0; j < nk; ++j) vk.bf16_to_f32(src + j * ld, tmp.data() + j * D, D);
    s32 = tmp.data(), lds = D;
  }
  float* d32 = reinterpret_cast<float*>(dst);
  vk.transpose32(s32, lds, d32, ldb, nk, D / r);
  for (int64_t p = 0; p < D / r; ++p) std::fill(d32 + p * ldb + nk, d32 + (p + 1) * ldb, 0.f);
}

// V as the B of P V: [keys / r][D][r] from lk keys of D values (key j at src + j * ld, value e at
// + e * sd); keys past lk are zero rows.
template <typename T, typename S>
void pack_v(const S* src, int64_t ld, int64_t sd, int64_t lk, int64_t keys, int64_t D, T* dst) {
  const auto& vk = vec();
  if (sd != 1) return pack_b<T, S>(src, ld, sd, lk, D, keys, D, dst);
  if constexpr (std::is_same_v<T, bf16>) {  // pairs of keys interleaved
    for (int64_t j = 0; j < keys; j += 2)
      vk.interleave_bf16(j < lk ? src + j * ld : nullptr, j + 1 < lk ? src + (j + 1) * ld : nullptr, dst + j * D, D);
  } else {
    for (int64_t j = 0; j < lk; ++j) {
      if constexpr (std::is_same_v<S, bf16>)
        vk.bf16_to_f32(src + j * ld, dst + j * D, D);
      else
        std::copy(src + j * ld, src + j * ld + D, dst + j * D);
    }
    std::fill(dst + lk * D, dst + keys * D, 0.f);
  }
}

struct Segment {
  int64_t q0, lq, k0, lk, keys;  // keys: lk zero padded to kKeyPad, the packed length
};

template <typename T, typename S>
at::Tensor attention_brgemm(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const std::vector<int64_t>& bq, const std::vector<int64_t>& bk, double scale_d,
                            bool causal) {
  constexpr int64_t r = kPair<T>, BQ = kBQ<T>, BK = kBK<T>;
  constexpr bool vnni = r == 2;
  const int64_t H = q.size(1), Hk = k.size(1), D = q.size(2), group = H / Hk, nseg = int64_t(bq.size()) - 1;
  const int64_t Dp = round_up(D, r);  // reduction width of S
  std::vector<Segment> segs(nseg);
  std::vector<int64_t> off(nseg + 1, 0);  // elements of packed K + V per kv head, prefix sums
  for (int64_t s = 0; s < nseg; ++s) {
    const int64_t lk = bk[s + 1] - bk[s];
    segs[s] = {bq[s], bq[s + 1] - bq[s], bk[s], lk, round_up(lk, kKeyPad)};
    off[s + 1] = off[s] + Hk * segs[s].keys * (Dp + D);
  }
  Scratch<T> packed(off[nseg]);  // every element is written by the packing
  const S *Q = q.data_ptr<S>(), *K = k.data_ptr<S>(), *V = v.data_ptr<S>();
  const int64_t q_row = q.stride(0), q_head = q.stride(1), q_d = q.stride(2);
  auto k_of = [&](int64_t s, int64_t hk) {
    return packed.data() + off[s] + hk * segs[s].keys * (Dp + D);
  };
  auto v_of = [&](int64_t s, int64_t hk) { return k_of(s, hk) + segs[s].keys * Dp; };
  // Phase 1: K^T per key block, then V.
  at::parallel_for(0, nseg * Hk, 1, [&](int64_t b, int64_t e) {
    std::vector<float> tmp;
    for (int64_t i = b; i < e; ++i) {
      const int64_t s = i / Hk, hk = i % Hk, lk = segs[s].lk, keys = segs[s].keys;
      const S* ks = K + segs[s].k0 * k.stride(0) + hk * k.stride(1);
      for (int64_t j0 = 0; j0 < keys; j0 += BK)
        pack_k<T, S>(ks + j0 * k.stride(0), k.stride(0), k.stride(2), std::min(BK, lk - j0), D, Dp,
                     std::min(BK, keys - j0), k_of(s, hk) + j0 * Dp, tmp);
      pack_v<T, S>(V + segs[s].k0 * v.stride(0) + hk * v.stride(1), v.stride(0), v.stride(2), lk, keys, D,
                   v_of(s, hk));
    }
  });
  // Phase 2: work items (segment, head, query block), blocks of at most BQ rows, as few as fit.
  std::vector<std::array<int64_t, 4>> items;
  for (int64_t s = 0; s < nseg; ++s) {
    const int64_t lq = segs[s].lq, nblk = (lq + BQ - 1) / BQ;
    const int64_t step = nblk ? std::min(BQ, round_up((lq + nblk - 1) / nblk, kTileM)) : 0;
    for (int64_t h = 0; h < H; ++h)
      for (int64_t r0 = 0; r0 < lq; r0 += step) items.push_back({s, h, r0, std::min(step, lq - r0)});
  }
  auto out = at::empty({q.size(0), H, D}, q.options());
  S* O = out.data_ptr<S>();
  const float scale = float(scale_d);
  const auto& vk = vec();
  auto softmax_row = [&](const float* s, int64_t visible, int64_t n, float* m, float* l, T* p) {
    if constexpr (vnni)
      return vk.softmax_row_bf16(s, visible, n, scale, m, l, p);
    else
      return vk.softmax_row_f32(s, visible, n, scale, m, l, p);
  };
  // On AMX tiles with a head dim of whole tiles: both block GEMMs by gemm_amx.cpp's tile kernel, 32
  // rows x 32 columns at a time (16 rows for a short last tile: the buffers hold BQ rows, so whole
  // tiles past `rows` stay inside them, and their rows are never read). In-process A/B against the
  // brgemm calls, 2 threads of an AMX Xeon: 1.05x at 16 x 784 x 64, 1.01x at 12 x 1280 x 128 and at
  // 8 segments of 104, 1.15x causal (4 segments up to 600, 16 x 64).
  const bool tiles = vnni && D % 32 == 0 && amx_tiles_usable();
  // c[rows x cols] (+)= a[rows x k] x b (VNNI, ldb columns per k pair) on the tile kernel.
  auto on_tiles = [&](const T* a, int64_t lda, const T* b, int64_t ldb, int64_t k, float* c, int64_t ldc,
                      int64_t rows, int64_t cols, bool accumulate) {
    if constexpr (vnni) {
      for (int64_t r = 0; r < rows; r += 32)
        for (int64_t j = 0; j < cols; j += 32)
          (rows - r <= 16 ? amx_tile_16x32 : amx_tile_32x32)(a + r * lda, lda, b + 2 * j, k, c + r * ldc + j, ldc,
                                                             accumulate, ldb);
    }
  };
  parallel_shares(int64_t(items.size()), [&](auto next) {
    std::optional<AmxTiles> held;
    if (tiles) held.emplace();
    Scratch<T> qa(BQ * Dp), pa(BQ * BK);  // brgemm operands: cache-line aligned (common.h)
    Scratch<float> S_(BQ * BK), acc(BQ * D);
    std::vector<float> row_max(BQ), row_sum(BQ);
    std::fill_n(qa.data(), BQ * Dp, T(0.f));  // an odd head dim's padding column stays zero
    for (int64_t it; (it = next()) >= 0;) {
      const auto [s, h, r0, rows] = items[it];
      const Segment& sg = segs[s];
      const T* Kp = k_of(s, h / group);
      const T* Vp = v_of(s, h / group);
      for (int64_t i = 0; i < rows; ++i) {  // Q rows as brgemm's A: a copy in T, even width
        const S* src = Q + (sg.q0 + r0 + i) * q_row + h * q_head;
        T* dst = qa.data() + i * Dp;
        if (q_d != 1) {
          for (int64_t d = 0; d < D; ++d) dst[d] = T(float(src[d * q_d]));
        } else if constexpr (std::is_same_v<S, T>) {
          std::copy(src, src + D, dst);
        } else {
          vk.bf16_to_f32(src, dst, D);
        }
      }
      std::fill(row_max.begin(), row_max.end(), -std::numeric_limits<float>::infinity());
      std::fill(row_sum.begin(), row_sum.end(), 0.f);
      // Causal (bottom-right): query row i of the segment sees keys j <= i + lk - lq.
      const int64_t shift = sg.lk - sg.lq;
      const int64_t key_end = causal ? std::max<int64_t>(0, std::min(sg.lk, r0 + rows + shift)) : sg.lk;
      if (key_end == 0) std::fill_n(acc.data(), rows * D, 0.f);  // no row sees a key
      for (int64_t j0 = 0; j0 < key_end; j0 += BK) {
        const int64_t nk = std::min(BK, key_end - j0), nk_r = round_up(nk, kTileK<T>);
        const int64_t ldb = std::min(BK, sg.keys - j0);  // this key block's packed width
        if (tiles)
          on_tiles(qa.data(), Dp, Kp + j0 * Dp, ldb, Dp, S_.data(), BK, rows, nk, false);
        else
          at::native::cpublas::brgemm(rows, nk, Dp, Dp, ldb, BK, false, qa.data(), Kp + j0 * Dp, S_.data(), vnni);
        for (int64_t i = 0; i < rows; ++i) {
          const int64_t visible = causal ? std::clamp<int64_t>(r0 + i + shift + 1 - j0, 0, nk) : nk;
          const float corr =
              softmax_row(S_.data() + i * BK, visible, nk_r, &row_max[i], &row_sum[i], pa.data() + i * BK);
          if (j0 > 0 && corr != 1.f) vk.scaled_f32(acc.data() + i * D, D, corr, acc.data() + i * D);
        }
        if (tiles)
          on_tiles(pa.data(), BK, Vp + j0 * D, D, nk_r, acc.data(), D, rows, D, j0 > 0);
        else
          at::native::cpublas::brgemm(rows, D, nk_r, BK, D, D, j0 > 0, pa.data(), Vp + j0 * D, acc.data(), vnni);
      }
      for (int64_t i = 0; i < rows; ++i) {
        S* orow = O + (sg.q0 + r0 + i) * H * D + h * D;
        const float inv = row_sum[i] > 0.f ? 1.f / row_sum[i] : 0.f;
        if constexpr (std::is_same_v<S, bf16>)
          vk.scaled_bf16(acc.data() + i * D, D, inv, orow);
        else
          vk.scaled_f32(acc.data() + i * D, D, inv, orow);
      }
    }
    if (!tiles) at::native::cpublas::brgemm_release(vnni);
  });
  return out;
}

}  // namespace

const char* attention_engine(Tier tier, const at::Tensor& q) {
  const bool bf = q.scalar_type() == at::kBFloat16;
  if (bf && tier == Tier::Avx512Bf16) return "avx512_bf16 flash kernel";
  if (bf && tier == Tier::Amx)
    return "flash attention on AMX tiles (amxopt tile kernel if head dim % 32 == 0, else oneDNN brgemm)";
  return "flash attention on oneDNN brgemm in fp32";
}

at::Tensor varlen_attention_native(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   const std::vector<int64_t>& bq, const std::vector<int64_t>& bk, double scale,
                                   bool causal, Tier tier) {
  const bool bf = q.scalar_type() == at::kBFloat16;
  const bool unit_d = q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1;
  if (bf && tier == Tier::Avx512Bf16 && unit_d) return varlen_attention_avx512_bf16(q, k, v, bq, bk, scale, causal);
  if (!bf) return attention_brgemm<float, float>(q, k, v, bq, bk, scale, causal);
  if (tier == Tier::Amx) return attention_brgemm<bf16, bf16>(q, k, v, bq, bk, scale, causal);
  return attention_brgemm<float, bf16>(q, k, v, bq, bk, scale, causal);
}

}  // namespace amxopt
