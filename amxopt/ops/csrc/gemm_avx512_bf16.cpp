// amxopt.linear / amxopt.patch_embed kernels: bf16 GEMM with fp32 accumulation on AVX-512-BF16.
//
// Packed weight (VNNI) layout: [N/32][K/2][32][2] bf16, N padded to 32 and K to 2 with zeros. For
// each block of 32 output columns, consecutive k pairs are interleaved per column, so one 64-byte
// load feeds a vdpbf16ps over 16 columns x 2 k. Microkernel: MR (<= 12) rows x 32 columns held in
// 2*MR zmm accumulators over the whole of K, then the epilogue: + bias (fp32), activation (gelu /
// gelu_tanh / silu), + a residual, round to bf16. A is first copied into k-pair-major chunks of MR
// rows (pack_a), so that a chunk is one contiguous stream. Work is split over tiles of rows x column
// blocks that gemm.cpp sizes to the thread count (96 x 4 where that gives every thread enough),
// column-major (a thread keeps a tile's weight panels hot while it sweeps rows; each A chunk
// fetched serves them all, which matters once A outgrows the caches, e.g. Wan's 1280 x 8960 FFN
// input), shared between the threads by parallel_shares (common.h).
//
// K is not blocked. Walking it in blocks of 512 with the accumulators parked in memory between
// blocks (so that the A chunk and the weight slice stay in L1) lost at every shape measured on a
// 2-core AMD EPYC (Zen 5 class: 48 KB L1d, 1 MB L2 per core), in-process A/B against whole K,
// 2 threads: 0.87x at 784 x 4096 x 1024, 0.76x at 1280 x 8960 x 1536, 0.89x at 390 x 5120 x 1280,
// 0.94x at 784 x 1024 x 4096, 0.69x at 8 x 4096 x 4096; blocks of 1024 and 2048 lost less, in
// step with their number (single-threaded alike). On a Zen 4 EPYC (32 KB L1d, 1 MB L2, half-width
// 512-bit units) alike, blocks of 512 / 1024 against whole K: 0.93x / 0.95x at 784 x 4096 x 1024,
// 0.96x / 0.97x at 1280 x 1536 x 8960, 0.94x / 0.97x at 390 x 5120 x 1280, 0.92x / 0.96x at
// 196 x 4096 x 2048, 0.97x / 1.00x at 784 x 1024 x 4096, 0.75x / 0.85x at 8 x 4096 x 4096.
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <immintrin.h>

#include <array>
#include <cstdint>
#include <utility>

#include "common.h"
#include "vec_math.h"

namespace amxopt {
namespace {  // everything here is compiled for AVX-512-BF16: internal linkage

using fVec = at::vec::Vectorized<float>;

// 16 bf16 (masked) -> 16 fp32.
inline __m512 load_bf16_masked(const bf16* p, __mmask16 m) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, (const __m256i*)p)), 16));
}
// 16 fp32 -> 16 bf16 (masked), round to nearest even.
inline void store_bf16_masked(bf16* p, __m512 v, __mmask16 m) {
  _mm256_mask_storeu_epi16((__m256i*)p, m, (__m256i)_mm512_cvtneps_pbh(v));
}
inline __mmask16 tail_mask(int64_t n) { return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1); }

// --- bf16 dot-product blocks (AVX-512-BF16) ------------------------------------------------------
//
// B ("VNNI") layout: [ceil(N/kNB)][ceil(K/2)][kNB][2] bf16 - per block of 32 output columns, k pairs
// interleaved per column; zero padded. A ("pairs") layout: chunks of kMR rows, [ceil(K/2)][kMR]
// uint32, each uint32 two consecutive-k bf16 of one row; zero padded.
constexpr int kMR = int(kAvx512Rows);  // rows per A chunk (24 accumulators + 2 B + 1 A registers)

// One chunk of up to kMR rows of A (rows ld apart) into the pairs layout, rows beyond `rows` zeroed.
inline void pack_a_chunk(const bf16* src, int64_t ld, int64_t rows, int64_t K, uint32_t* dst) {
  const int64_t pairs = (K + 1) / 2;
  for (int64_t i = 0; i < rows; ++i) {
    const bf16* row = src + i * ld;
    for (int64_t p = 0; p < K / 2; ++p) dst[p * kMR + i] = reinterpret_cast<const uint32_t*>(row)[p];
    if (K & 1) dst[(K / 2) * kMR + i] = uint32_t(row[K - 1].x);  // odd K: zero partner
  }
  for (int64_t i = rows; i < kMR; ++i)
    for (int64_t p = 0; p < pairs; ++p) dst[p * kMR + i] = 0u;
}

// acc[MR][2] += A chunk (pairs layout, `pairs` k pairs) x one 32-column B block.
template <int MR>
inline void dot_block(__m512 (&acc)[MR][2], const uint32_t* Ap, const bf16* B, int64_t pairs) {
  for (int64_t p = 0; p < pairs; ++p) {
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(B + p * 64);
    const __m512bh b1 = (__m512bh)_mm512_loadu_si512(B + p * 64 + 32);
#pragma GCC unroll 12
    for (int i = 0; i < MR; ++i) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(Ap[p * kMR + i]);
      acc[i][0] = _mm512_dpbf16_ps(acc[i][0], a, b0);
      acc[i][1] = _mm512_dpbf16_ps(acc[i][1], a, b1);
    }
  }
}

// Table of f<1>..f<kMR> so that a runtime row count picks a fully unrolled instantiation.
template <template <int> class F, int... Is>
constexpr auto make_row_table(std::integer_sequence<int, Is...>) {
  return std::array{F<Is + 1>::run...};
}

// Ap: packed A, kMR uint32 (bf16 pairs) per k pair, rows beyond MR ignored.
template <int MR>
void microkernel(const uint32_t* Ap, const bf16* B, int64_t pairs, const Epilogue<bf16>& e, bf16* C, int64_t ldc,
                 int64_t ncols) {
  __m512 acc[MR][2];
#pragma GCC unroll 12
  for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  dot_block<MR>(acc, Ap, B, pairs);
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

// A [M, K] (rows lda apart) -> d, [ceil(M/kMR)][pairs][kMR] uint32 bf16 pairs, zero padded: the
// microkernel then reads one contiguous 48-byte line per k pair instead of 12 rows whose large,
// power-of-two strides (K = 4096) alias the same L1 sets.
void pack_a(const bf16* A, int64_t lda, int64_t M, int64_t K, uint32_t* d) {
  const int64_t pairs = (K + 1) / 2, chunks = (M + kMR - 1) / kMR;
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c)
      pack_a_chunk(A + c * kMR * lda, lda, std::min<int64_t>(kMR, M - c * kMR), K, d + c * pairs * kMR);
  });
}

// Packed A, at most this much at a time (more threads: one row tile each). A fresh buffer per call
// for all of A came from mmap above 32 MB and page-faulted on every 4 KB: 6240 x 4320 (the Omni
// encoder's second conv as a GEMM) took 13,000 faults a call and ran at 0.76x ATen's linear on a Zen 4
// EPYC. Waves in a buffer kept across calls (thread_scratch) also keep the packed rows that the
// column groups sweep in turn within the last-level cache.
constexpr int64_t kWaveBytes = int64_t(16) << 20;

}  // namespace

// C[M, N] (rows ldc apart) = A[M, K] @ W^T with the epilogue e, W packed; A rows lda apart.
void gemm_avx512_bf16(const bf16* A, int64_t lda, const bf16* Wp, const Epilogue<bf16>& e, bf16* C, int64_t ldc,
                      int64_t M, int64_t N, int64_t K, const WorkSplit& split) {
  const int64_t nblocks = (N + kNB - 1) / kNB, tile_rows = split.rows, group = split.blocks;
  const int64_t ngroups = (nblocks + group - 1) / group;
  const int64_t pairs = (K + 1) / 2;
  const int64_t panel = pairs * 2 * kNB;  // bf16 elements per packed column block
  TORCH_INTERNAL_ASSERT(K > 0 && tile_rows % kMR == 0 && group > 0, "amxopt: GEMM split ", tile_rows, " x ", group);
  const int64_t tile_bytes = tile_rows * pairs * 4;
  const int64_t wave_rows = std::max<int64_t>(at::get_num_threads(), kWaveBytes / tile_bytes) * tile_rows;
  // The calling thread's buffer, read by every thread of the region.
  uint32_t* Ap = thread_scratch<uint32_t, 0>((std::min(M, wave_rows) + kMR - 1) / kMR * kMR * pairs);
  for (int64_t w0 = 0; w0 < M; w0 += wave_rows) {
    const int64_t wm = std::min(wave_rows, M - w0), mtiles = (wm + tile_rows - 1) / tile_rows;
    pack_a(A + w0 * lda, lda, wm, K, Ap);
    parallel_shares(ngroups * mtiles, [&](auto next) {
      for (int64_t t; (t = next()) >= 0;) {
        const int64_t g = t / mtiles, mt = t % mtiles;
        const int64_t nb_end = std::min(nblocks, (g + 1) * group);
        const int64_t m0 = mt * tile_rows, m_end = std::min(wm, m0 + tile_rows);  // rows of the wave
        for (int64_t m = m0; m < m_end; m += kMR) {
          const int rows = int(std::min<int64_t>(kMR, m_end - m));
          const uint32_t* a = Ap + (m / kMR) * pairs * kMR;
          const int64_t row = w0 + m;
          for (int64_t nb = g * group; nb < nb_end; ++nb) {
            const int64_t n0 = nb * kNB;
            kMicro[rows - 1](a, Wp + nb * panel, pairs, e.at(row, n0), C + row * ldc + n0, ldc,
                             std::min(kNB, N - n0));
          }
        }
      }
    });
  }
}

}  // namespace amxopt
