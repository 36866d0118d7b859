// amxopt.linear / amxopt.patch_embed kernels: bf16 GEMM with fp32 accumulation on AVX-512-BF16.
//
// Packed weight (VNNI) layout: [N/32][K/2][32][2] bf16, N padded to 32 and K to 2 with zeros. For
// each block of 32 output columns, consecutive k pairs are interleaved per column, so one 64-byte
// load feeds a vdpbf16ps over 16 columns x 2 k. Microkernel: MR (<= 12) rows x 32 columns held in
// 2*MR zmm accumulators. A is first copied into k-pair-major chunks of MR rows (pack_a). K is walked
// in blocks of kKC so that the A chunk and the weight slice
// (kKC/2 * 128 bytes) stay in L1 while a tile's rows are swept; between K blocks the accumulators
// park in a per-tile fp32 buffer. Epilogue: + bias (fp32), activation (gelu / gelu_tanh / silu),
// + a residual, round to bf16. Work is split over tiles of kMT rows x kNG column blocks,
// column-major (a thread keeps kNG weight panels hot while it sweeps rows; each A chunk fetched
// serves kNG panels, which matters once A outgrows the caches, e.g. Wan's 1280 x 8960 FFN input),
// shared between the threads by parallel_shares (common.h).
#include "avx512_bf16.h"

#include <vector>

namespace amxopt {
namespace {

constexpr int64_t kMT = 96;  // rows per parallel tile (measured: 48-192 within noise; 96 best on 784x4096x1024)
constexpr int64_t kKC = 512; // K per block (even: blocks start on a k pair)
constexpr int64_t kNG = 4;   // column blocks per tile: each A chunk read from memory serves 128 columns
static_assert(kMT % kMR == 0, "row tiles must hold whole microkernel row chunks");

// Ap: packed A, kMR uint32 (bf16 pairs) per k pair, rows beyond MR ignored.
// acc_buf: [MR][32] fp32 partial sums carried between K blocks (read unless first, written unless last).
template <int MR>
void microkernel(const uint32_t* Ap, const bf16* B, int64_t pairs, const Epilogue<bf16>& e, bf16* C, int64_t ldc,
                 int64_t ncols, float* acc_buf, bool first, bool last) {
  __m512 acc[MR][2];
#pragma GCC unroll 12
  for (int i = 0; i < MR; ++i) {
    acc[i][0] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(acc_buf + i * 32);
    acc[i][1] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(acc_buf + i * 32 + 16);
  }
  dot_block<MR>(acc, Ap, B, pairs);
  if (!last) {
    for (int i = 0; i < MR; ++i) {
      _mm512_storeu_ps(acc_buf + i * 32, acc[i][0]);
      _mm512_storeu_ps(acc_buf + i * 32 + 16, acc[i][1]);
    }
    return;
  }
  const __mmask16 m0 = tail_mask(ncols), m1 = tail_mask(ncols - 16);
  __m512 bias0 = _mm512_setzero_ps(), bias1 = _mm512_setzero_ps();
  if (e.bias) {
    bias0 = _mm512_maskz_loadu_ps(m0, e.bias);
    if (ncols > 16) bias1 = _mm512_maskz_loadu_ps(m1, e.bias + 16);
  }
  // act(acc + bias) (+ the residual), one rounding.
  const auto out = [&](int i, int h, __m512 b, __mmask16 m) {
    __m512 y = __m512(activate(fVec(_mm512_add_ps(acc[i][h], b)), e.act));
    if (e.residual) y = _mm512_add_ps(y, load_bf16_masked(e.residual + i * e.ldr + 16 * h, m));
    store_bf16_masked(C + i * ldc + 16 * h, y, m);
  };
  for (int i = 0; i < MR; ++i) {
    out(i, 0, bias0, m0);
    if (ncols > 16) out(i, 1, bias1, m1);
  }
}

template <int MR>
struct Micro {
  static constexpr auto run = &microkernel<MR>;
};
const auto kMicro = make_row_table<Micro>(std::make_integer_sequence<int, kMR>{});

// A [M, K] (rows lda apart) -> [ceil(M/kMR)][pairs][kMR] uint32 bf16 pairs, zero padded: the
// microkernel then reads one contiguous 48-byte line per k pair instead of 12 rows whose large,
// power-of-two strides (K = 4096) alias the same L1 sets.
at::Tensor pack_a(const bf16* A, int64_t lda, int64_t M, int64_t K) {
  const int64_t pairs = (K + 1) / 2, chunks = (M + kMR - 1) / kMR;
  auto buf = at::empty({chunks, pairs, kMR}, at::TensorOptions().dtype(at::kInt));  // every entry written
  uint32_t* d = reinterpret_cast<uint32_t*>(buf.data_ptr<int32_t>());
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c)
      pack_a_chunk(A + c * kMR * lda, lda, std::min<int64_t>(kMR, M - c * kMR), K, d + c * pairs * kMR);
  });
  return buf;
}

}  // namespace

// C[M, N] (rows ldc apart) = A[M, K] @ W^T with the epilogue e, W packed; A rows lda apart.
void gemm_avx512_bf16(const bf16* A, int64_t lda, const bf16* Wp, const Epilogue<bf16>& e, bf16* C, int64_t ldc,
                      int64_t M, int64_t N, int64_t K) {
  const int64_t nblocks = (N + kNB - 1) / kNB;
  const int64_t ngroups = (nblocks + kNG - 1) / kNG;
  const int64_t mtiles = (M + kMT - 1) / kMT;
  const int64_t pairs = (K + 1) / 2;
  const int64_t panel = pairs * 2 * kNB;  // bf16 elements per packed column block
  const int64_t kc_pairs = kKC / 2;
  auto a_buf = pack_a(A, lda, M, K);
  const uint32_t* Ap = reinterpret_cast<const uint32_t*>(a_buf.data_ptr<int32_t>());
  parallel_shares(ngroups * mtiles, [&](auto next) {
    std::vector<float> acc_buf(kMT * kNG * kNB);  // partial sums of a tile between K blocks
    for (int64_t t; (t = next()) >= 0;) {
      const int64_t g = t / mtiles, mt = t % mtiles;
      const int64_t nb_end = std::min(nblocks, (g + 1) * kNG);
      const int64_t m0 = mt * kMT, m_end = std::min(M, m0 + kMT);
      for (int64_t p0 = 0; p0 < pairs; p0 += kc_pairs) {
        const int64_t np = std::min(kc_pairs, pairs - p0);
        const bool first = p0 == 0, last = p0 + np >= pairs;
        for (int64_t m = m0; m < m_end; m += kMR) {
          const int rows = int(std::min<int64_t>(kMR, m_end - m));
          const uint32_t* a = Ap + (m / kMR) * pairs * kMR + p0 * kMR;  // stays in L1 across the group
          for (int64_t nb = g * kNG; nb < nb_end; ++nb) {
            const int64_t n0 = nb * kNB;
            float* parked = acc_buf.data() + (((m - m0) / kMR) * kNG + nb - g * kNG) * kMR * kNB;
            kMicro[rows - 1](a, Wp + nb * panel + p0 * 2 * kNB, np, e.at(m, n0), C + m * ldc + n0, ldc,
                             std::min(kNB, N - n0), parked, first, last);
          }
        }
      }
    }
  });
}

}  // namespace amxopt
