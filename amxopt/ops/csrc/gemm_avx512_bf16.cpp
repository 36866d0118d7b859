// amxopt.linear / amxopt.patch_embed kernels: bf16 GEMM with fp32 accumulation on AVX-512-BF16.
//
// Packed weight (VNNI) layout: [N/32][K/2][32][2] bf16, K even, N padded to 32 with zeros. For
// each block of 32 output columns, consecutive k pairs are interleaved per column, so one 64-byte
// load feeds a vdpbf16ps over 16 columns x 2 k. Microkernel: MR (<= 12) rows x 32 columns held in
// 2*MR zmm accumulators over the whole of K, then the epilogue: + bias (fp32), activation (gelu /
// gelu_tanh / silu), + a residual, round to bf16. The microkernel reads A's rows in place, or,
// where they alias in L1 (rows 4 KB apart, reads_a_in_place), copied into k-pair-major chunks of 12
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
#include <cstring>
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
inline __mmask16 tail_mask(int64_t n) {
  return n >= 16 ? (__mmask16)0xFFFF : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1);
}

// --- bf16 dot-product blocks (AVX-512-BF16) ------------------------------------------------------
//
// B ("VNNI") layout: [ceil(N/kNB)][K/2][kNB][2] bf16 (K even) - per block of 32 output columns, k pairs
// interleaved per column; zero padded. A ("pairs") layout: chunks of kMR rows, [K/2][kMR]
// uint32, each uint32 two consecutive-k bf16 of one row; zero padded.
constexpr int kMR = int(kAvx512Rows);  // rows per A chunk (24 accumulators + 2 B + 1 A registers)

// v[r][c] -> v[c][r]: a 16 x 16 transpose of 32-bit elements (unpack 32, unpack 64, then two
// rounds of 128-bit lane shuffles). Not vec_kernels.h's transpose32 (ATen's transpose_mxn): packing
// through it made calls 1.16-1.21x slower at 784 x 4096 x 64 and 1.08-1.17x at 2100 x 4096 x 40 on a
// Zen 4 EPYC.
inline void transpose_16x16(__m512i (&v)[16]) {
  __m512i a[16], b[16];
  for (int i = 0; i < 8; ++i) {
    a[2 * i] = _mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]);
    a[2 * i + 1] = _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]);
  }
  // b[4i + c], 128-bit lane L: rows 4i..4i+3 of column 4L + c
  for (int i = 0; i < 4; ++i) {
    b[4 * i] = _mm512_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
    b[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
    b[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
    b[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
  }
  for (int c = 0; c < 4; ++c) {  // a 4 x 4 transpose of lanes across b[c], b[4 + c], b[8 + c], b[12 + c]
    const __m512i x0 = _mm512_shuffle_i32x4(b[c], b[4 + c], 0x88), x1 = _mm512_shuffle_i32x4(b[c], b[4 + c], 0xDD);
    const __m512i y0 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0x88);
    const __m512i y1 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0xDD);
    v[c] = _mm512_shuffle_i32x4(x0, y0, 0x88);
    v[4 + c] = _mm512_shuffle_i32x4(x1, y1, 0x88);
    v[8 + c] = _mm512_shuffle_i32x4(x0, y0, 0xDD);
    v[12 + c] = _mm512_shuffle_i32x4(x1, y1, 0xDD);
  }
}

// One chunk of up to kMR rows of A (rows ld apart, K even) into the pairs layout, rows beyond `rows`
// zeroed: 16 k pairs of every row at a time, transposed in registers, so that each k pair's kMR
// values are one 48-byte store (a scalar copy, one strided 4-byte store per value, made the packing
// 40% of a call at N = 64 on a Zen 4 EPYC).
inline void pack_a_chunk(const bf16* src, int64_t ld, int64_t rows, int64_t K, uint32_t* dst) {
  static_assert(kMR <= 16, "one transpose holds 16 rows");
  const int64_t pairs = K / 2;
  for (int64_t p0 = 0; p0 < pairs; p0 += 16) {
    const int64_t n = std::min<int64_t>(16, pairs - p0);
    const __mmask16 m = tail_mask(n);
    __m512i v[16];
    for (int i = 0; i < 16; ++i)
      v[i] = i < rows ? _mm512_maskz_loadu_epi32(m, reinterpret_cast<const uint32_t*>(src + i * ld) + p0)
                      : _mm512_setzero_si512();
    transpose_16x16(v);
    for (int64_t j = 0; j < n; ++j) _mm512_mask_storeu_epi32(dst + (p0 + j) * kMR, (1u << kMR) - 1, v[j]);
  }
}

// acc[MR][2] += MR rows of A x one 32-column B block, over `pairs` k pairs. A: packed (InPlace false:
// the pairs layout, kMR uint32 per k pair, lda unused) or rows of A itself, lda bf16 apart.
template <int MR, bool InPlace>
inline void dot_block(__m512 (&acc)[MR][2], const void* A, int64_t lda, const bf16* B, int64_t pairs) {
  const uint32_t* Ap = static_cast<const uint32_t*>(A);
  const bf16* Ar = static_cast<const bf16*>(A);
  for (int64_t p = 0; p < pairs; ++p) {
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(B + p * 64);
    const __m512bh b1 = (__m512bh)_mm512_loadu_si512(B + p * 64 + 32);
#pragma GCC unroll 12
    for (int i = 0; i < MR; ++i) {
      uint32_t pair;
      if constexpr (InPlace)
        std::memcpy(&pair, Ar + i * lda + 2 * p, 4);
      else
        pair = Ap[p * kMR + i];
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
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

// MR rows of A (as dot_block reads them) x one packed 32-column block of B, through the epilogue.
template <int MR, bool InPlace>
void microkernel(const void* A, int64_t lda, const bf16* B, int64_t pairs, const Epilogue<bf16>& e, bf16* C,
                 int64_t ldc, int64_t ncols) {
  __m512 acc[MR][2];
#pragma GCC unroll 12
  for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  dot_block<MR, InPlace>(acc, A, lda, B, pairs);
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
  static constexpr auto run = &microkernel<MR, false>;
};
template <int MR>
struct MicroInPlace {
  static constexpr auto run = &microkernel<MR, true>;
};
const auto kMicro = make_row_table<Micro>(std::make_integer_sequence<int, kMR>{});
const auto kMicroInPlace = make_row_table<MicroInPlace>(std::make_integer_sequence<int, kMR>{});

// A [M, K] (rows lda apart) -> d, [ceil(M/kMR)][pairs][kMR] uint32 bf16 pairs, zero padded: the
// microkernel then reads one contiguous 48-byte line per k pair instead of 12 rows whose strides,
// multiples of 4 KB, alias the same L1 set (reads_a_in_place).
void pack_a(const bf16* A, int64_t lda, int64_t M, int64_t K, uint32_t* d) {
  const int64_t pairs = K / 2, chunks = (M + kMR - 1) / kMR;
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c)
      pack_a_chunk(A + c * kMR * lda, lda, std::min<int64_t>(kMR, M - c * kMR), K, d + c * pairs * kMR);
  });
}

// Rows of A, at most this much at a time (more threads: one row tile each), packed or not: the
// column groups sweep a wave's rows in turn, which then stay in the last-level cache. (A fresh
// buffer per call for all of packed A came from mmap above 32 MB and page-faulted on every 4 KB:
// 6240 x 4320, the Omni encoder's second conv as a GEMM, took 13,000 faults a call and ran at 0.76x
// ATen's linear on a Zen 4 EPYC; the packing buffer is kept across calls, thread_scratch.)
constexpr int64_t kWaveBytes = int64_t(16) << 20;

// Whether the microkernel reads A's rows where they are, rather than packed. Packing costs a pass
// over A (40% of a call at N = 64 with a scalar copy, 27% with the vector transpose), which pays only
// where reading the rows in place is slow: where they lie a multiple of 4 KB apart (K = 2048, 4096),
// all of a chunk's rows fall into one L1 set, whose 8 ways (Zen 4; 12 on Intel's 48 KB L1d) more
// than 8 rows thrash. In place against packed, one process, alternating calls, 2 threads of a Zen 4
// EPYC: 1.37x at 4096 x 1536 -> 64 and 1.33x at 32760 x 1536 -> 64 (Wan's 480p output projection,
// now 1.06-1.11x ATen's linear, 0.56x before), 1.48x at 1 x 1536 x 1536, 1.13x at 16 x 1536 x
// 1536, 1.05x at 16 x 1024 x 4096, 1.10x at 390 x 1280 x 1280, 1.07x at 784 x 1536 x 1024, 1.03x
// at 5120 x 64 x 1536, 1.02-1.03x at 1280 x 1536 x 8960 and 1280 x 8960 x 1536, 0.99x at 390 x
// 5120 x 1280, 0.99-1.02x at 784 x 1024 x 3072-4096; 1.36x at 1 x 4096 x 4096 and 1.04x at 8 x
// 4096 x 4096. But with 4 KB strides and more rows: 0.62x at 12 x 4096 x 4096, 0.93x at 784 x 4096
// x 1024 and 784 x 2048 x 2048, 0.86-0.94x at 784 x 4096 x 64-256 (yet 1.09-1.23x at 4096 x 4096 x
// 64-128, where A outgrows the L3: left packed, as no model has such a shape).
constexpr int64_t kAliasFreeRows = 8;
inline bool reads_a_in_place(int64_t lda, int64_t M) {
  return (lda * int64_t(sizeof(bf16))) % 4096 != 0 || std::min<int64_t>(M, kMR) <= kAliasFreeRows;
}

}  // namespace

// C[M, N] (rows ldc apart) = A[M, K] @ W^T with the epilogue e, W packed; A rows lda apart.
void gemm_avx512_bf16(const bf16* A, int64_t lda, const bf16* Wp, const Epilogue<bf16>& e, bf16* C, int64_t ldc,
                      int64_t M, int64_t N, int64_t K, const WorkSplit& split) {
  const int64_t nblocks = (N + kNB - 1) / kNB, tile_rows = split.rows, group = split.blocks;
  const int64_t ngroups = (nblocks + group - 1) / group;
  const int64_t pairs = K / 2;
  const int64_t panel = pairs * 2 * kNB;  // bf16 elements per packed column block
  TORCH_INTERNAL_ASSERT(K > 0 && K % 2 == 0 && tile_rows % kMR == 0 && group > 0, "amxopt: GEMM K ", K, ", split ",
                        tile_rows, " x ", group);
  // Work items (column group, row tile) of rows [w0, w0 + wm), each chunk of kMR rows by `chunk`.
  const auto sweep = [&](int64_t w0, int64_t wm, auto chunk) {
    const int64_t mtiles = (wm + tile_rows - 1) / tile_rows;
    parallel_shares(ngroups * mtiles, [&](auto next) {
      for (int64_t t; (t = next()) >= 0;) {
        const int64_t g = t / mtiles, mt = t % mtiles;
        const int64_t nb_end = std::min(nblocks, (g + 1) * group);
        const int64_t m0 = mt * tile_rows, m_end = std::min(wm, m0 + tile_rows);  // rows of the wave
        for (int64_t m = m0; m < m_end; m += kMR) {
          const int rows = int(std::min<int64_t>(kMR, m_end - m));
          const int64_t row = w0 + m;
          for (int64_t nb = g * group; nb < nb_end; ++nb) {
            const int64_t n0 = nb * kNB;
            chunk(m, rows, Wp + nb * panel, e.at(row, n0), C + row * ldc + n0, std::min(kNB, N - n0));
          }
        }
      }
    });
  };
  const bool in_place = reads_a_in_place(lda, M);
  const int64_t tile_bytes = tile_rows * pairs * 4;
  const int64_t wave_rows = std::max<int64_t>(at::get_num_threads(), kWaveBytes / tile_bytes) * tile_rows;
  // Packed A: the calling thread's buffer, read by every thread of the region.
  const int64_t packed_length = (std::min(M, wave_rows) + kMR - 1) / kMR * kMR * pairs;
  uint32_t* Ap = in_place ? nullptr : thread_scratch<uint32_t, 0>(packed_length);
  for (int64_t w0 = 0; w0 < M; w0 += wave_rows) {
    const int64_t wm = std::min(wave_rows, M - w0);
    if (!in_place) pack_a(A + w0 * lda, lda, wm, K, Ap);
    sweep(w0, wm, [&](int64_t m, int rows, const bf16* B, const Epilogue<bf16>& em, bf16* c, int64_t nc) {
      if (in_place)
        kMicroInPlace[rows - 1](A + (w0 + m) * lda, lda, B, pairs, em, c, ldc, nc);
      else
        kMicro[rows - 1](Ap + (m / kMR) * pairs * kMR, 0, B, pairs, em, c, ldc, nc);
    });
  }
}

}  // namespace amxopt
