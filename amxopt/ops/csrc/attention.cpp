// Driver of amxopt.varlen_attention: packed q [T, H, D], k/v [Tk, Hk, D], segments from cu_seqlens.
//
// Flash attention with its two block GEMMs, S = Q K^T and O += P V, on one of two engines. T is
// their element type:
//   bf16   the amx and avx512_bf16 tiers: B operands in the VNNI layout; P V's reduction padded to
//          a whole AMX tile (32 keys), as SGLang's CPU kernels do. On AMX, with a head dim that is a
//          multiple of 32 (unit stride), both GEMMs run on gemm_amx.cpp's tile kernel, K and V
//          packed in panels of 32 (each B tile one contiguous KB); else oneDNN's brgemm, B as
//          [K / 2][ldb][2], which runs oneDNN's AVX-512-BF16 kernel on a CPU without AMX. There it
//          replaced a hand-written vdpbf16ps flash kernel (12-row chunks, 48 x 256 blocks, P
//          re-laid into k-pair chunks by scalar copies, K / V packing zero-filled to 256 keys):
//          in-process A/B, 2 threads of an AMD EPYC (Zen 5 class), brgemm against it: 1.48x at
//          16 x 784 x 64, 1.48x at 8 segments of 104 x 20 heads x 64, 1.34x at 12 x 1280 x 128,
//          1.35x at 1280 queries x 512 keys (Wan's cross-attention);
//   float  the fp32 tier and fp32 inputs: plain B operands ([K][ldb]), oneDNN's AVX2 / AVX-512 fp32
//          brgemm (bf16 inputs are converted while packing, the output is rounded back once).
//
// Phase 1 (parallel over chunks of 32 keys, every kv head of a chunk in turn, so the source rows are
// read in order): K and V of each segment are packed once, keys zero padded to a multiple of
// kKeyPad: K as the B of S (a 32-bit transpose: fp32 values or bf16 pairs), V as the B of P V
// (bf16: pairs of keys interleaved). GQA heads read their kv head's packing.
// Phase 2 (parallel over segment x head x query block of at most kBQ rows, balanced: 784 rows are
// 3 x 208 + 160 in bf16, 12 x 64 + 16 in fp32; smaller blocks where those leave threads idle,
// query_block_rows; many short segments still fill every core): the
// block's Q rows are copied into a T buffer (a strided A measured slower than the copy), every
// buffer cache-line aligned and kept per thread (common.h's thread_scratch); per key block and per
// step of rows (the whole block on brgemm, 32 rows on tiles): S, one online softmax row at a time
// (vec(): max, exp, sum, P in T), the accumulator rows rescaled where the max moved, then acc += P V
// (the first key block writes acc instead). Finally O = acc / l, rounded once. Causal is
// bottom-right aligned; rows that see no key output zeros.
// With a rotary embedding (the op's rotary_cos / rotary_sin), each row of Q is rotated as it is
// copied and each key of K as it is packed, by glue.cpp's row kernel and rounded as it rounds: the
// result is bit for bit that of amxopt.rotary_embedding on q and k first, without their round trip
// through memory.
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <array>
#include <limits>
#include <vector>

#include "common.h"

namespace amxopt {
namespace {

constexpr int64_t kTileM = 16;  // query blocks are whole AMX tiles of rows where they can be
// A segment's keys are zero padded to this (a whole AMX tile of P V's reduction); it is also the
// packing's chunk of keys and the width of a panel on the tile kernel.
constexpr int64_t kKeyPad = 32;

template <typename T>
constexpr int64_t kPair = std::is_same_v<T, bf16> ? 2 : 1;  // reduction values per B row (VNNI pairs)
template <typename T>
constexpr int64_t kTileK = std::is_same_v<T, bf16> ? kKeyPad : 1;  // P V's reduction is padded to this

// brgemm: query rows per work item at most (the M of both brgemm calls; fewer for many threads,
// query_block_rows) and keys per block (the N of S, the K of P V), by GEMM element type. bf16, on
// AMX tiles: 256 x 512, so that each call reuses its B
// block over 16 row tiles and the per-call cost is spread over 16x more work (on a 2-core AMX Xeon,
// one long segment ran at 0.84-0.93x eager SDPA with these against 0.74-0.84x with 64 x 256; about
// 1 MB of scratch per thread; on oneDNN's AVX-512-BF16 brgemm, a Zen 5-class EPYC, 64-256 rows x
// 256-1024 keys were level within noise, and on a Zen 4 EPYC too: 64-256 x 256-1024 within
// 0.94-1.04x of 256 x 512 at 16 x 784 x 64, 8 segments of 104 x 20 heads, 12 x 1280 x 128). fp32:
// 64 x 256, whose 64 KB score block fits a 512 KB L2 (Zen 3, where it was measured).
template <typename T>
constexpr int64_t kBQ = std::is_same_v<T, bf16> ? 256 : 64;
template <typename T>
constexpr int64_t kBK = std::is_same_v<T, bf16> ? 512 : 256;
// The tile kernel: query rows per S -> softmax -> P V step, keys per block. A step's scores (32 x
// 2048 fp32, 256 KB) and P stay in L2, and up to 2048 keys (Wan's 1280, Qwen3-VL's 784) make one
// block: no rescaling, one softmax pass per row. In-process A/B against the brgemm engine's
// 256 x 512 blocks on the tile kernel, 2 threads of an AMX Xeon: 1.11x at 16 x 784 x 64, 1.16x at
// 12 x 1280 x 128 (where 2048-key blocks ran 1.12x faster than 512-key ones).
constexpr int64_t kStepRows = 32;
constexpr int64_t kTilesBK = 2048;

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// A segment's query blocks for blocks of at most bq rows: as few as fit, of nearly equal size in
// whole tiles of rows (784 rows are 3 x 208 + 160 at bq = 256). Returns the block's rows.
int64_t query_step(int64_t lq, int64_t bq) {
  const int64_t nblk = (lq + bq - 1) / bq;
  return nblk ? std::min(bq, round_up((lq + nblk - 1) / nblk, kTileM)) : 0;
}

// Query rows per work item (segment x head x query block) for `threads` threads: max_rows (the
// engine's tuned block) halved down to 32 while that leaves threads idle (common.h's pick_split):
// on a many-core Xeon, Wan2.1's 12 heads x 1280 queries are 60 blocks of 256 rows, one round for 56
// threads and a second one for 4 of them. *items: the work items it makes.
int64_t query_block_rows(const std::vector<int64_t>& lq, int64_t heads, int64_t max_rows, int64_t threads,
                         int64_t* items = nullptr) {
  std::vector<int64_t> rows, counts;
  for (int64_t bq = max_rows; bq >= 32 || rows.empty(); bq /= 2) {
    int64_t n = 0;
    for (int64_t l : lq) {
      const int64_t step = query_step(l, bq);
      if (l > 0) n += heads * ((l + step - 1) / step);
    }
    rows.push_back(bq), counts.push_back(n);
  }
  const int i = pick_split(int(rows.size()), threads, [&](int j) { return counts[j]; });
  if (items) *items = counts[i];
  return rows[i];
}

// Columns [0, width) of a B operand from a [rows (reduction), cols] source whose element (i, j) is
// src[i * si + j * sj]: B element (i, j) at dst[(i / r) * ldb * r + j * r + i % r] (r = kPair<T>)
// for i < rows_pad; rows beyond the source and columns beyond cols (< width) are zero. Element by
// element: for the layouts the vector paths of pack_k / pack_v do not take (a head dim with a
// stride, an odd one in bf16).
template <typename T, typename S>
void pack_b(const S* src, int64_t si, int64_t sj, int64_t rows, int64_t cols, int64_t rows_pad, int64_t width,
            int64_t ldb, T* dst) {
  constexpr int64_t r = kPair<T>;
  for (int64_t i = 0; i < rows_pad; ++i) {
    T* row = dst + (i / r) * ldb * r + i % r;
    const int64_t n = i < rows ? cols : 0;
    for (int64_t j = 0; j < n; ++j) row[j * r] = T(float(src[i * si + j * sj]));
    for (int64_t j = n; j < width; ++j) row[j * r] = T(0.f);
  }
}

// K^T of one chunk of nk <= kKeyPad keys as kKeyPad columns of the B of S ([Dp / r][ldb][r], from
// dst): key j at src + j * ld, value d at + d * sd; keys past nk are zero columns. A key's values (or
// bf16 pairs of them) are 32-bit units, so the packing is a 32-bit transpose (after a conversion to
// fp32 for T = float); tmp holds kKeyPad x D floats.
template <typename T, typename S>
void pack_k(const S* src, int64_t ld, int64_t sd, int64_t nk, int64_t D, int64_t Dp, int64_t ldb, T* dst,
            float* tmp) {
  const auto& vk = vec();
  constexpr int64_t r = kPair<T>;
  if (sd != 1 || (r == 2 && (D % 2 || ld % 2))) return pack_b<T, S>(src, sd, ld, D, nk, Dp, kKeyPad, ldb, dst);
  const float* s32 = reinterpret_cast<const float*>(src);
  int64_t lds = ld / r;
  if constexpr (std::is_same_v<T, float> && std::is_same_v<S, bf16>) {  // convert, then transpose
    for (int64_t j = 0; j < nk; ++j) vk.bf16_to_f32(src + j * ld, tmp + j * D, D);
    s32 = tmp, lds = D;
  }
  float* d32 = reinterpret_cast<float*>(dst);
  vk.transpose32(s32, lds, d32, ldb, nk, D / r);
  if (nk < kKeyPad)
    for (int64_t p = 0; p < D / r; ++p) std::fill(d32 + p * ldb + nk, d32 + p * ldb + kKeyPad, 0.f);
}

// One chunk of nv <= kKeyPad keys of V as kKeyPad rows of the B of P V (key j at src + j * ld, value e
// at + e * sd; keys past nv are zero rows). Key j's row starts at dst + j * ldk (bf16: pairs of keys
// interleaved, pair row j / 2 at dst + j * ldk), its columns in panels of 32 that start `panel`
// elements apart: [keys / r][D][r] with ldk = D and panel = 32 r; on the tile kernel
// [D / 32][keys / 2][32][2], ldk = 32 and panel = 32 x keys.
template <typename T, typename S>
void pack_v(const S* src, int64_t ld, int64_t sd, int64_t nv, int64_t D, int64_t ldk, int64_t panel, T* dst) {
  const auto& vk = vec();
  if (sd != 1) return pack_b<T, S>(src, ld, sd, nv, D, kKeyPad, D, D, dst);  // only with ldk = D
  if constexpr (std::is_same_v<T, bf16>) {
    for (int64_t j = 0; j < kKeyPad; j += 2)
      vk.interleave_bf16(j < nv ? src + j * ld : nullptr, j + 1 < nv ? src + (j + 1) * ld : nullptr, D, panel,
                         dst + j * ldk);
  } else {
    for (int64_t j = 0; j < nv; ++j) {
      if constexpr (std::is_same_v<S, bf16>)
        vk.bf16_to_f32(src + j * ld, dst + j * D, D);
      else
        std::copy(src + j * ld, src + j * ld + D, dst + j * D);
    }
    std::fill(dst + nv * D, dst + kKeyPad * D, 0.f);
  }
}

struct Segment {
  int64_t q0, lq, k0, lk, keys;  // keys: lk zero padded to kKeyPad, the packed length
};

// The rotary embedding applied to q and k rows (none where cos is null): token t's factors at
// cos + t * width; hi as rotary_native's.
struct Rotary {
  const float *cos = nullptr, *sin = nullptr;
  int64_t width = 0, hi = 0;
  bool interleaved = false;

  // The D values of token t's row src (unit stride) rotated into dst.
  template <typename S>
  void apply(const S* src, S* dst, int64_t D, int64_t t) const {
    const auto& vk = vec();
    if constexpr (std::is_same_v<S, bf16>)
      vk.rotary_bf16(src, dst, D, cos + t * width, sin + t * width, hi, interleaved);
    else
      vk.rotary_f32(src, dst, D, cos + t * width, sin + t * width, hi, interleaved);
  }
};

template <typename T, typename S>
at::Tensor attention_brgemm(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const std::vector<int64_t>& bq, const std::vector<int64_t>& bk, double scale_d,
                            bool causal, Tier tier, const Rotary& rot) {
  constexpr int64_t r = kPair<T>;
  constexpr bool vnni = r == 2;
  const int64_t H = q.size(1), Hk = k.size(1), D = q.size(2), group = H / Hk, nseg = int64_t(bq.size()) - 1;
  std::vector<int64_t> lq(nseg);
  for (int64_t s = 0; s < nseg; ++s) lq[s] = bq[s + 1] - bq[s];
  const int64_t BQ = query_block_rows(lq, H, kBQ<T>, at::get_num_threads());
  const int64_t Dp = round_up(D, r);  // reduction width of S
  // On AMX tiles with a head dim of whole tiles (unit stride): both block GEMMs by gemm_amx.cpp's
  // tile kernel, on K and V packed in panels of 32 keys / 32 columns (each B tile one contiguous
  // KB), in steps of 32 query rows (16 for a short last tile: the buffers hold whole tiles past
  // `rows`, whose rows are never read). Only on the amx tier: capped below it, the tile kernel stays
  // out (oneDNN's brgemm follows ONEDNN_MAX_CPU_ISA).
  const bool tiles =
      vnni && tier == Tier::Amx && D % 32 == 0 && k.stride(2) == 1 && v.stride(2) == 1 && amx_tiles_usable();
  // On tiles, key blocks no wider than the longest segment needs, so that short segments' score
  // rows lie close together (in-process A/B, 2 threads of an AMX Xeon: 1.18x at 8 segments of 104,
  // 1.06x causal with segments up to 600).
  int64_t max_keys = kKeyPad;
  for (int64_t s = 0; s < nseg; ++s) max_keys = std::max(max_keys, round_up(bk[s + 1] - bk[s], kKeyPad));
  const int64_t BK = tiles ? std::min(max_keys, kTilesBK) : kBK<T>, step = tiles ? kStepRows : BQ;
  // Row strides of the score and P buffers, padded past a multiple of 4 KB so that a tile's 16 rows
  // do not share a few cache sets.
  const int64_t lds = BK + 16, ldp = BK + 32;
  std::vector<Segment> segs(nseg);
  std::vector<int64_t> off(nseg + 1, 0);     // elements of packed K + V per kv head, prefix sums
  std::vector<int64_t> chunks(nseg + 1, 0);  // kKeyPad-key chunks, prefix sums
  for (int64_t s = 0; s < nseg; ++s) {
    const int64_t lk = bk[s + 1] - bk[s];
    segs[s] = {bq[s], bq[s + 1] - bq[s], bk[s], lk, round_up(lk, kKeyPad)};
    off[s + 1] = off[s] + Hk * segs[s].keys * (Dp + D);
    chunks[s + 1] = chunks[s] + segs[s].keys / kKeyPad;
  }
  // Every element is written by the packing. From the output pool where it is large (common.h's
  // new_output): fresh per call, Wan2.1's K and V at 480p (32,760 keys, 200 MB) page-faulted 49,000
  // times a call.
  auto packed_buffer = new_output({off[nseg]}, q.options().dtype(c10::CppTypeToScalarType<T>::value));
  T* packed = packed_buffer.template data_ptr<T>();
  const S *Q = q.data_ptr<S>(), *K = k.data_ptr<S>(), *V = v.data_ptr<S>();
  const int64_t q_row = q.stride(0), q_head = q.stride(1), q_d = q.stride(2);
  auto k_of = [&](int64_t s, int64_t hk) {
    return packed + off[s] + hk * segs[s].keys * (Dp + D);
  };
  auto v_of = [&](int64_t s, int64_t hk) { return k_of(s, hk) + segs[s].keys * Dp; };
  // Phase 1, parallel over chunks of kKeyPad keys, every kv head of a chunk in turn (the source rows
  // are read in order). K^T in blocks of BK keys ([Dp / r][up to BK][r] each; on tiles, blocks of one
  // panel); V as one [keys / r][D][r] operand (on tiles: [D / 32][keys / 2][32][2]).
  at::parallel_for(0, chunks[nseg], 1, [&](int64_t c0, int64_t c1) {
    std::vector<float> tmp(std::is_same_v<T, S> ? 0 : kKeyPad * D);
    std::vector<S> rotated(rot.cos ? kKeyPad * D : 0);  // a chunk's keys rotated, [n][D]
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t s = std::upper_bound(chunks.begin(), chunks.end(), c) - chunks.begin() - 1;
      const Segment& sg = segs[s];
      const int64_t j = (c - chunks[s]) * kKeyPad, n = std::min(kKeyPad, sg.lk - j);
      const int64_t kb = tiles ? kKeyPad : BK, j0 = j / kb * kb, ldb = std::min(kb, sg.keys - j0);
      for (int64_t hk = 0; hk < Hk; ++hk) {
        const S* ks = K + (sg.k0 + j) * k.stride(0) + hk * k.stride(1);
        int64_t ld = k.stride(0);
        if (rot.cos) {  // the entry made k's head dim unit stride
          for (int64_t i = 0; i < n; ++i) rot.apply(ks + i * ld, rotated.data() + i * D, D, sg.k0 + j + i);
          ks = rotated.data(), ld = D;
        }
        pack_k<T, S>(ks, ld, k.stride(2), n, D, Dp, ldb, k_of(s, hk) + j0 * Dp + (j - j0) * r, tmp.data());
        const S* vs = V + (sg.k0 + j) * v.stride(0) + hk * v.stride(1);
        const int64_t ldk = tiles ? 32 : D;
        pack_v<T, S>(vs, v.stride(0), v.stride(2), n, D, ldk, tiles ? 32 * sg.keys : 32 * r, v_of(s, hk) + j * ldk);
      }
    }
  });
  // Phase 2: work items (segment, head, query block), blocks of at most BQ rows, as few as fit.
  std::vector<std::array<int64_t, 4>> items;
  for (int64_t s = 0; s < nseg; ++s) {
    const int64_t qstep = query_step(segs[s].lq, BQ);
    for (int64_t h = 0; h < H; ++h)
      for (int64_t r0 = 0; r0 < segs[s].lq; r0 += qstep)
        items.push_back({s, h, r0, std::min(qstep, segs[s].lq - r0)});
  }
  auto out = new_output({q.size(0), H, D}, q.options());
  S* O = out.data_ptr<S>();
  const float scale = float(scale_d);
  const auto& vk = vec();
  auto softmax_row = [&](const float* s, int64_t visible, int64_t n, float* m, float* l, T* p) {
    if constexpr (vnni)
      return vk.softmax_row_bf16(s, visible, n, scale, m, l, p);
    else
      return vk.softmax_row_f32(s, visible, n, scale, m, l, p);
  };
  // c[rows x cols] (+)= a[rows x k] x b on the tile kernel, 32 x 32 at a time: b's panels of 32
  // columns start `panel` elements apart.
  auto on_tiles = [&](const T* a, int64_t lda, const T* b, int64_t panel, int64_t k, float* c, int64_t ldc,
                      int64_t rows, int64_t cols, bool accumulate) {
    if constexpr (vnni) {
      for (int64_t r = 0; r < rows; r += 32)
        for (int64_t j = 0; j < cols; j += 32)
          (rows - r <= 16 ? amx_tile_16x32 : amx_tile_32x32)(a + r * lda, lda, b + j / 32 * panel, k,
                                                             c + r * ldc + j, ldc, accumulate, nullptr);
    }
  };
  parallel_shares(int64_t(items.size()), [&](auto next) {
    std::optional<AmxTiles> held;
    if (tiles) held.emplace();
    // brgemm operands: cache-line aligned (common.h)
    T *qa = thread_scratch<T, 0>(BQ * Dp), *pa = thread_scratch<T, 1>(step * ldp);
    float *S_ = thread_scratch<float, 2>(step * lds), *acc = thread_scratch<float, 3>(BQ * D);
    float *row_max = thread_scratch<float, 4>(BQ), *row_sum = thread_scratch<float, 5>(BQ);
    S* q_rotated = rot.cos && !std::is_same_v<S, T> ? thread_scratch<S, 6>(D) : nullptr;
    if (Dp != D)
      for (int64_t i = 0; i < BQ; ++i) qa[i * Dp + D] = T(0.f);  // an odd head dim's padding column
    for (int64_t it; (it = next()) >= 0;) {
      const auto [s, h, r0, rows] = items[it];
      const Segment& sg = segs[s];
      const T* Kp = k_of(s, h / group);
      const T* Vp = v_of(s, h / group);
      for (int64_t i = 0; i < rows; ++i) {  // Q rows as brgemm's A: a copy in T, even width
        const int64_t t = sg.q0 + r0 + i;
        const S* src = Q + t * q_row + h * q_head;
        T* dst = qa + i * Dp;
        if (rot.cos) {  // rotated on the way (the entry made q's head dim unit stride)
          if constexpr (std::is_same_v<S, T>) {
            rot.apply(src, dst, D, t);
          } else {
            rot.apply(src, q_rotated, D, t);
            vk.bf16_to_f32(q_rotated, dst, D);
          }
        } else if (q_d != 1) {
          for (int64_t d = 0; d < D; ++d) dst[d] = T(float(src[d * q_d]));
        } else if constexpr (std::is_same_v<S, T>) {
          std::copy(src, src + D, dst);
        } else {
          vk.bf16_to_f32(src, dst, D);
        }
      }
      std::fill_n(row_max, rows, -std::numeric_limits<float>::infinity());
      std::fill_n(row_sum, rows, 0.f);
      // Causal (bottom-right): query row i of the segment sees keys j <= i + lk - lq.
      const int64_t shift = sg.lk - sg.lq;
      auto key_end = [&](int64_t end_row) {  // keys seen by the block's rows before end_row
        return causal ? std::clamp<int64_t>(r0 + end_row + shift, 0, sg.lk) : sg.lk;
      };
      if (key_end(rows) == 0) std::fill_n(acc, rows * D, 0.f);  // no row sees a key
      for (int64_t j0 = 0; j0 < key_end(rows); j0 += BK) {
        // Per step of rows: S = Q K^T over this block's keys, the online softmax one row at a time
        // (max, exp, sum, P in T), the accumulator rows rescaled where the max moved, acc += P V
        // (the first key block writes acc instead).
        for (int64_t i0 = 0; i0 < rows; i0 += step) {
          const int64_t n = std::min(BK, key_end(i0 + std::min(step, rows - i0)) - j0), mr = std::min(step, rows - i0);
          if (n <= 0) {  // these rows see no key of this block (nor of later ones)
            if (j0 == 0) std::fill_n(acc + i0 * D, mr * D, 0.f);
            continue;
          }
          const int64_t n_r = round_up(n, kTileK<T>);
          if (tiles)
            on_tiles(qa + i0 * Dp, Dp, Kp + j0 * Dp, kKeyPad * Dp, Dp, S_, lds, mr, n, false);
          else
            at::native::cpublas::brgemm(mr, n, Dp, Dp, std::min(BK, sg.keys - j0), lds, false, qa + i0 * Dp,
                                        Kp + j0 * Dp, S_, vnni);
          for (int64_t i = 0; i < mr; ++i) {
            const int64_t row = i0 + i;
            const int64_t visible = causal ? std::clamp<int64_t>(r0 + row + shift + 1 - j0, 0, n) : n;
            const float corr = softmax_row(S_ + i * lds, visible, n_r, &row_max[row], &row_sum[row],
                                           pa + i * ldp);
            if (j0 > 0 && corr != 1.f) vk.scaled_f32(acc + row * D, D, corr, acc + row * D);
          }
          if (tiles)
            on_tiles(pa, ldp, Vp + j0 * 32, sg.keys * 32, n_r, acc + i0 * D, D, mr, D, j0 > 0);
          else
            at::native::cpublas::brgemm(mr, D, n_r, ldp, D, D, j0 > 0, pa, Vp + j0 * D, acc + i0 * D,
                                        vnni);
        }
      }
      for (int64_t i = 0; i < rows; ++i) {
        S* orow = O + (sg.q0 + r0 + i) * H * D + h * D;
        // A row that saw no key is 0; a NaN score (or +inf) made its sum NaN, and the row NaN, as in ATen.
        const float inv = row_sum[i] > 0.f ? 1.f / row_sum[i] : row_sum[i] == 0.f ? 0.f : row_sum[i];
        if constexpr (std::is_same_v<S, bf16>)
          vk.scaled_bf16(acc + i * D, D, inv, orow);
        else
          vk.scaled_f32(acc + i * D, D, inv, orow);
      }
    }
    if (!tiles) at::native::cpublas::brgemm_release(vnni);
  });
  return out;
}

}  // namespace

std::vector<int64_t> attention_work_split(const std::vector<int64_t>& q_lens, int64_t heads, bool bf16_gemm,
                                          int64_t threads) {
  int64_t items = 0;
  const int64_t rows = query_block_rows(q_lens, heads, bf16_gemm ? kBQ<bf16> : kBQ<float>, threads, &items);
  return {rows, items};
}

const char* attention_engine(Tier tier, const at::Tensor& q) {
  const bool bf = q.scalar_type() == at::kBFloat16;
  if (bf && tier == Tier::Avx512Bf16) return "flash attention on oneDNN's AVX-512-BF16 brgemm";
  if (bf && tier == Tier::Amx)
    return "flash attention on AMX tiles (amxopt tile kernel if head dim % 32 == 0, else oneDNN brgemm)";
  return "flash attention on oneDNN brgemm in fp32";
}

at::Tensor varlen_attention_native(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v,
                                   const std::vector<int64_t>& bq, const std::vector<int64_t>& bk, double scale,
                                   bool causal, Tier tier, const at::Tensor& rotary_cos, const at::Tensor& rotary_sin,
                                   bool rotary_interleaved) {
  Rotary rot;
  at::Tensor q = q_in, k = k_in;
  if (rotary_cos.defined()) {  // the row kernel reads a row at unit stride
    if (q.stride(2) != 1) q = q.contiguous();
    if (k.stride(2) != 1) k = k.contiguous();
    const int64_t D = q.size(2), width = rotary_cos.size(1);
    rot = {rotary_cos.data_ptr<float>(), rotary_sin.data_ptr<float>(), width, width == D ? D / 2 : 0,
           rotary_interleaved};
  }
  const bool bf = q.scalar_type() == at::kBFloat16;
  if (!bf) return attention_brgemm<float, float>(q, k, v, bq, bk, scale, causal, tier, rot);
  if (tier != Tier::Fp32) return attention_brgemm<bf16, bf16>(q, k, v, bq, bk, scale, causal, tier, rot);
  return attention_brgemm<float, bf16>(q, k, v, bq, bk, scale, causal, tier, rot);
}

}  // namespace amxopt
