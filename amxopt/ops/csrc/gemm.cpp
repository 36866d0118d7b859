// GEMM drivers behind amxopt.linear and amxopt.patch_embed: C = act(A @ W^T + bias), A bf16 or fp32.
//
// Weights are packed once (pack_linear_weight): bf16 with even K into the VNNI layout of common.h,
// [N/32][K/2][32][2], which is both oneDNN brgemm's bf16 B operand (per 32-column block, ld_b = 32)
// and the hand-written AVX-512-BF16 kernel's; anything else keeps the plain [N, K] matrix.
// Engines, by tier (common.h):
//   amx          per (32-row x 32-column) tile, A read in place, work items of 32 rows x 4 column
//                blocks (fewer blocks where many threads need more items: gemm_plan) over the
//                threads (parallel_shares; column group major, row tile major at K <= 128); each
//                tile by the hand-written AMX kernel of
//                gemm_amx.cpp where K % 32 == 0, else by oneDNN's brgemm (the kernel has no per-call
//                dispatch: Wan's K = 64 patch embedding ran 2-2.6x faster on it, larger K the same
//                within noise, 2 threads of an AMX Xeon); M = 1 (M <= 4 from K = 5120) goes to
//                the AVX-512-BF16 kernel (one row does not fill a tile). A work item holds its 4 B
//                panels and an A tile, 320 x K bytes, which nears a 2 MB L2 at K = 5120: from
//                K = 5120 on (4096 for 17 to 256 rows), K is blocked too, in work items of (up to
//                256 rows) x 256 columns (down to 32 x 32 for many threads) whose fp32
//                accumulator takes the partial products of K
//                steps of 512 (the tile kernel adding to it; steps of 1024 for brgemm calls at
//                M <= 16), so that the A chunk, the B block and the accumulator stay in L2.
//                Measured in one process on an AMX Xeon, two rounds (steps of 1024 then):
//                1280 x 8960 x 1536 at 0.98-1.09x eager blocked, 0.69-0.70x with
//                whole-K calls; 390 x 7680 x 1280 at 0.90-0.99x / 0.76-0.82x; but 784 x 4096 x
//                1024 at 0.83-0.94x / 1.08-1.17x. At K = 5120 (Qwen3-Omni's fc2), blocked against
//                whole-K, paired calls: 1.06-1.19x at M = 390, 1.01-1.13x at 784, 1.04-1.13x at 1280,
//                1.08x at 32, weights hot or cold (cycled through more than the L3 holds).
//                A second order of the same tile kernel, the Rows schedule (gemm_row_chunks: each
//                thread its own rows, A packed in K chunks held in L1), runs where asked for:
//                per linear where autotune timed it faster, or pinned for the process
//                (AMXOPT_AMX_SCHEDULE=rows); it awaits its measurement on AMX.
//   avx512_bf16  the hand-written vdpbf16ps kernel (gemm_avx512_bf16.cpp).
//   fp32         A converted to fp32 in waves of up to 64 MB; per work item of a group of 8
//                column blocks (256 columns) x a wave's rows (smaller groups, then row chunks, for
//                many threads) the weight is unpacked to fp32 in a per-thread buffer and
//                multiplied with ATen's sgemm in row tiles of 256; M <= 4 uses a VNNI GEMV that reads the bf16 weight
//                directly (the weight read is the whole cost there, so it stays bf16).
// Each engine's work items are sized to the thread count (gemm_plan, common.h's pick_split).
// Every engine ends in the same epilogue (common.h's Epilogue): + bias (fp32), activation, + a
// residual (the output's dtype), one rounding to the output dtype. On the AMX tile kernel the
// epilogue (with an activation, or at 128 < K < 4096) runs a few rows at a time between the next
// block's tile steps, on the vector units the tile unit leaves idle (OverlappedEpilogue).
#include <ATen/native/CPUBlas.h>

#include <cstdlib>
#include <memory>
#include <thread>

#include "common.h"

namespace amxopt {
namespace {

constexpr int64_t kSmallM = 4;    // rows up to which the weight-streaming kernels win
// On AMX, rows up to which the AVX-512-BF16 kernel beats 16-row tiles (in-process A/B, 2 threads of an
// AMX Xeon, tiles against it: 0.91x at M = 1, 1.23x at M = 2, 1.41x at M = 4; K = 1536, N = 1536).
constexpr int64_t kAmxSmallM = 1;
constexpr int64_t kBrgemmM = 32;  // rows per brgemm call (2 AMX tiles of 16 rows)
constexpr int64_t kBrgemmG = 4;   // column blocks per tile work item (A tile reused 4 times), as tuned
// K from which an epilogue without activation is not overlapped (nor at K <= kRowsFirstK)
constexpr int64_t kOverlapPlainK = 4096;
constexpr int64_t kRowsFirstK = 128;  // K up to which gemm_blocks hands out row tiles first
constexpr int64_t kBlockedK = 5120;  // K from which the brgemm engine blocks K (gemm_brgemm_kblocked)
// ... and from which it does so for 17 to kBlkM rows (one row chunk at 2 threads, on tiles; fewer
// rows were not measured there): gemm_blocks reads all of A once per 128 columns, the blocked items
// once per 256 (in-process A/B, 2 threads of an AMX Xeon: 1.06-1.11x at 196 x 4096 x 2048-4096,
// Qwen3-VL's patch mergers; 0.95x at 784 x 4096 x 1024).
constexpr int64_t kBlockedSmallK = 4096;
constexpr int64_t kBlkM = 256, kBlkN = 256;  // its work item (rows x columns), as tuned
// ... and its K step: 512 on the tile kernel, 1024 for brgemm calls (M <= 16). In-process A/B,
// alternating order, 2 threads of a Granite Rapids-class Xeon, 512 against 1024 on tiles: 1.10x at
// 390 x 5120 x 1280 + residual (Omni's fc2), 1.04x at 1280 x 8960 x 1536 (Wan's FFN down), 1.13x /
// 1.15x at 196 x 4096 x 4096 (gelu) / 2048 (Qwen3-VL's mergers), 1.10x at 784 x 5120 x 1280, 1.16x
// at 256 x 4096 x 1024; 2048 gave 1.04-1.09x, 256 0.97-1.06x against 512. On brgemm calls, 512
// measured 0.93x at 8 and 16 x 5120 x 1280.
constexpr int64_t kBlkK = 512, kBlkKBrgemm = 1024;
// The Rows schedule (gemm_row_chunks): K columns of a packed A chunk (32 rows x 256 = 16 KB, which
// stays in L1 while the 4 panels of a column group pass), the most packed A a row chunk holds (in L2
// together with a column group's B: 128 columns x K) and a wave of chunks, and the rows from which it
// is used (and at least one 32-row tile per thread; fewer rows gain more from splitting the columns).
constexpr int64_t kChunkK = 256;
constexpr int64_t kRowChunkBytes = int64_t(1) << 20, kRowsWaveBytes = int64_t(8) << 20;
constexpr int64_t kRowsMinM = 64;
constexpr int64_t kFp32G = 8;     // column blocks unpacked together by the fp32 engine
constexpr int64_t kFp32M = 256;   // rows per sgemm call of the fp32 engine

// rows (< kBrgemmM) rows of A from src, zero padded to a whole 32-row tile of K columns: the tile
// kernels read 16 or 32 whole rows, so a row tile that would read past A's end runs on this copy.
void pad_tile(const bf16* src, int64_t lda, int64_t rows, int64_t K, bf16* dst) {
  for (int64_t r = 0; r < rows; ++r) std::copy(src + r * lda, src + r * lda + K, dst + r * K);
  std::fill(dst + rows * K, dst + kBrgemmM * K, bf16(0.f));
}

// Where the tile engines' finished blocks go through the epilogue: right away, or (overlap) a few
// rows at a time between the next block's tile steps (OverlappedEpilogue), on the vector units while
// the tile unit drains the block's last products; so two accumulators of Floats each (whole cache
// lines for the C tiles, see Scratch), one written while the other's epilogue runs. Overlapped where
// the blocks run on the tile kernel and it measured faster (in-process A/B, 2 threads, against the
// epilogue after each block). With an activation, on the Emerald Rapids Xeon of earlier sessions:
// 1.03x at 784 x 1024 x 4096 with gelu, 1.01-1.06x at 1280 x 1536 x 8960 with gelu_tanh, 1.04x with
// silu, 1.12x at 390 x 1280 x 5120, 1.17x at 64 x 1024 x 4096. Without one (bias, residual) it
// measured 0.93-0.99x there, but on the Granite Rapids-class Xeon (CPUID model 167) of a later
// session 1.12-1.14x at 784 x 1024 x 3072-4096, 1.04x at 1280 x 1536 x 8960, 1.02-1.04x at M = 16,
// with a residual 1.07-1.11x at K = 1024-1536; at K = 4096 0.98-0.99x (with a residual too), so from
// there it stays after each block; and at K <= kRowsFirstK, where writing C dominates (5120 rows x
// 1536: 0.95x at K = 64, Wan's patch embedding, 0.85x at K = 128; 1.01x at K = 256).
template <int64_t Floats>
class BlockEpilogues {
 public:
  BlockEpilogues(const VecKernels& v, bool tiles, Act act, int64_t K)
      : v_(v), overlap_(tiles && (act != Act::None || (K > kRowsFirstK && K < kOverlapPlainK))) {}
  ~BlockEpilogues() { pending_.finish(); }
  float* acc() { return accs_[cur_]; }
  OverlappedEpilogue* pending() { return overlap_ ? &pending_ : nullptr; }
  // acc()'s rows x cols (lda apart) are done: through e into out, now or during the next block (spread
  // over its first `steps` K steps of the tile kernel; 0: over its first call's).
  void done(int64_t lda, const Epilogue<bf16>& e, bf16* out, int64_t ldo, int64_t rows, int64_t cols,
            int64_t steps = 0) {
    if (!overlap_) return v_.epilogue_bf16(accs_[cur_], lda, e, out, ldo, rows, cols);
    pending_.finish();
    pending_ = {&v_, accs_[cur_], lda, e, out, ldo, rows, cols};
    pending_.steps = steps;
    cur_ ^= 1;
  }

 private:
  alignas(64) float accs_[2][Floats];
  const VecKernels& v_;
  bool overlap_;
  OverlappedEpilogue pending_;
  int cur_ = 0;
};

// Work items of 32 rows x split.blocks column blocks (4 where that keeps the threads busy); each
// 32 x 32 block by the hand-written tile kernel (gemm_amx.cpp) where K % 32 == 0 and the process may
// use AMX tiles, else by one brgemm call. The
// tile kernel reads whole 16-row tiles: the last row tile, when M is not a multiple of 32, is copied
// once into a zero-padded buffer and, at 16 rows or fewer, runs on the 16-row kernel; only its own
// rows reach the epilogue.
void gemm_blocks(const bf16* A, int64_t lda, const bf16* Wp, const Epilogue<bf16>& e, bf16* C, int64_t ldc, int64_t M,
                 int64_t N, int64_t K, const WorkSplit& split) {
  const int64_t nblocks = (N + kNB - 1) / kNB, group = split.blocks, ngroups = (nblocks + group - 1) / group;
  const int64_t mtiles = (M + kBrgemmM - 1) / kBrgemmM, panel = K * kNB, tail = M % kBrgemmM;
  const bool tiles = K > 0 && K % 32 == 0 && amx_tiles_usable();
  // Item order: column group major (a group's B panels stay in L2 while the row tiles pass), except
  // at K <= kRowsFirstK, where writing C dominates and row-tile major order writes it row by row
  // (in-process A/B, 2 threads of an AMX Xeon: 1.16-1.29x faster at K = 64 and 128, 0.79-0.96x at
  // K = 256 and 512).
  const bool rows_first = K <= kRowsFirstK;
  const auto& v = vec();
  Scratch<bf16> pad(tiles && tail ? kBrgemmM * K : 0);
  if (tiles && tail) pad_tile(A + (M - tail) * lda, lda, tail, K, pad.data());
  parallel_shares(ngroups * mtiles, [&](auto next) {
    BlockEpilogues<kBrgemmM * kNB> blocks(v, tiles, e.act, K);
    std::optional<AmxTiles> held;
    if (tiles) held.emplace();
    for (int64_t t; (t = next()) >= 0;) {
      const int64_t g = rows_first ? t % ngroups : t / mtiles;
      const int64_t m0 = (rows_first ? t / ngroups : t % mtiles) * kBrgemmM, mb = std::min(kBrgemmM, M - m0);
      const bool padded = tiles && mb < kBrgemmM;
      const bf16* a = padded ? pad.data() : A + m0 * lda;
      const int64_t la = padded ? K : lda;
      for (int64_t nb = g * group; nb < std::min(nblocks, (g + 1) * group); ++nb) {
        const int64_t n0 = nb * kNB;
        if (!tiles)
          at::native::cpublas::brgemm(mb, kNB, K, la, kNB, kNB, false, a, Wp + nb * panel, blocks.acc(), true);
        else
          (mb <= 16 ? amx_tile_16x32 : amx_tile_32x32)(a, la, Wp + nb * panel, K, blocks.acc(), kNB, false,
                                                      blocks.pending());
        blocks.done(kNB, e.at(m0, n0), C + m0 * ldc + n0, ldc, mb, std::min(kNB, N - n0));
      }
    }
    if (!tiles) at::native::cpublas::brgemm_release(true);
  });
}

// The Rows schedule of the tile engine, for K < kBlockedK (gemm_blocks' sizes), where the 2 x 2 tile
// block reads a 2 KB A tile and a 2 KB B tile per 4 products: with A read in place over the whole K,
// both stream from L2 (A's rows, 2K bytes apart, fall into a few L1 sets and do not stay there). A
// standalone harness on 2 threads of a Granite Rapids-class Xeon put this order (rows split between
// the threads, A packed in K chunks held in L1 across 4 column blocks) at 2.56-2.78 TFLOP/s against
// 2.33-2.45 for gemm_blocks' order at 784 x 1024 x 3072; in the library it has not been measured on
// AMX yet, so it runs only where asked for: per linear where autotune timed it faster (the call's
// amx_schedule), or pinned for the process (AMXOPT_AMX_SCHEDULE=rows, native.use_amx_schedule);
// bench_ops runs it as native[amx/rows], bench_models --pinned-schedules as a model variant.
// Rows are cut into chunks of whole 32-row tiles (only M's last tile may be short), at least one per
// thread and at most kRowChunkBytes of A each; work items are (row chunk, column group of 4 panels),
// chunk major, so each thread's share is its own rows. The first item of a chunk packs it (the others
// wait for that): per tile, per K chunk of kChunkK, a contiguous [32][kw] block, zero rows past M
// (so no tail copy). Each tile then runs K chunk by K chunk over the group's panels, accumulating in
// a 32 x 128 fp32 block, whose epilogue runs between the next tile's tile steps, spread over all of
// them (OverlappedEpilogue). Chunks go in waves of at most kRowsWaveBytes of packed A (more threads:
// one chunk each), so that the packed buffer, kept across calls, stays bounded.
int64_t row_chunk_count(int64_t M, int64_t K, int64_t threads) {
  const int64_t tiles = (M + kBrgemmM - 1) / kBrgemmM, most = std::max<int64_t>(1, kRowChunkBytes / (2 * kBrgemmM * K));
  return std::max(std::min(threads, tiles), (tiles + most - 1) / most);
}

void gemm_row_chunks(const bf16* A, int64_t lda, const bf16* Wp, const Epilogue<bf16>& e, bf16* C, int64_t ldc,
                     int64_t M, int64_t N, int64_t K) {
  constexpr int64_t kGroupCols = kBrgemmG * kNB;
  const int64_t nblocks = (N + kNB - 1) / kNB, ngroups = (nblocks + kBrgemmG - 1) / kBrgemmG, panel = K * kNB;
  const int64_t tile = kBrgemmM * K, tiles = (M + kBrgemmM - 1) / kBrgemmM;  // bf16 of a packed tile
  const int64_t threads = at::get_num_threads(), nchunks = row_chunk_count(M, K, threads);
  const int64_t wave = std::max(threads, kRowsWaveBytes / kRowChunkBytes);  // chunks per wave
  // chunk c: tiles [first_tile(c), first_tile(c + 1))
  auto first_tile = [&](int64_t c) { return tiles * c / nchunks; };
  // The calling thread's buffer, kept across calls (a fresh one of a few MB would page-fault on every
  // call; see thread_scratch), read by every thread of the region; slot 1: conv.cpp's im2col holds 0.
  int64_t most_tiles = 0;
  for (int64_t c0 = 0; c0 < nchunks; c0 += wave)
    most_tiles = std::max(most_tiles, first_tile(std::min(nchunks, c0 + wave)) - first_tile(c0));
  bf16* packed = thread_scratch<bf16, 1>(most_tiles * tile);
  const auto& v = vec();
  for (int64_t c0 = 0; c0 < nchunks; c0 += wave) {
    const int64_t c1 = std::min(nchunks, c0 + wave), t0 = first_tile(c0);
    std::unique_ptr<std::atomic<int>[]> state(new std::atomic<int>[c1 - c0]());  // 0 to pack, 1 packing, 2 ready
    auto pack_chunk = [&](int64_t c) {
      for (int64_t t = first_tile(c); t < first_tile(c + 1); ++t) {
        const int64_t m0 = t * kBrgemmM, rows = std::min(kBrgemmM, M - m0);
        for (int64_t k0 = 0; k0 < K; k0 += kChunkK) {
          const int64_t kw = std::min(kChunkK, K - k0);
          bf16* d = packed + (t - t0) * tile + kBrgemmM * k0;
          for (int64_t r = 0; r < rows; ++r) std::copy_n(A + (m0 + r) * lda + k0, kw, d + r * kw);
          std::fill(d + rows * kw, d + kBrgemmM * kw, bf16(0.f));
        }
      }
    };
    parallel_shares((c1 - c0) * ngroups, [&](auto next) {
      AmxTiles held;
      BlockEpilogues<kBrgemmM * kGroupCols> blocks(v, true, e.act, K);
      for (int64_t item; (item = next()) >= 0;) {
        const int64_t c = c0 + item / ngroups, g = item % ngroups;
        if (int idle = 0; state[c - c0].compare_exchange_strong(idle, 1)) {
          pack_chunk(c);
          state[c - c0].store(2, std::memory_order_release);
        } else {
          while (state[c - c0].load(std::memory_order_acquire) != 2) std::this_thread::yield();
        }
        const int64_t nb0 = g * kBrgemmG, nb1 = std::min(nblocks, nb0 + kBrgemmG), n0 = nb0 * kNB;
        for (int64_t t = first_tile(c); t < first_tile(c + 1); ++t) {
          const int64_t m0 = t * kBrgemmM, rows = std::min(kBrgemmM, M - m0);
          const bf16* a = packed + (t - t0) * tile;
          for (int64_t k0 = 0; k0 < K; k0 += kChunkK) {
            const int64_t kw = std::min(kChunkK, K - k0);
            for (int64_t nb = nb0; nb < nb1; ++nb)
              (rows <= 16 ? amx_tile_16x32 : amx_tile_32x32)(a + kBrgemmM * k0, kw, Wp + nb * panel + k0 * kNB, kw,
                                                            blocks.acc() + (nb - nb0) * kNB, kGroupCols, k0 > 0,
                                                            blocks.pending());
          }
          blocks.done(kGroupCols, e.at(m0, n0), C + m0 * ldc + n0, ldc, rows, std::min(kGroupCols, N - n0),
                      (nb1 - nb0) * (K / 32));
        }
      }
    });
  }
}

void gemm_brgemm_kblocked(const bf16* A, int64_t lda, const bf16* Wp, const Epilogue<bf16>& e, bf16* C, int64_t ldc,
                          int64_t M, int64_t N, int64_t K, const WorkSplit& split) {
  const int64_t nblocks = (N + kNB - 1) / kNB, panel = K * kNB, group = split.blocks, cols = group * kNB;
  const int64_t ngroups = (nblocks + group - 1) / group;
  const int64_t mc = split.rows, mchunks = (M + mc - 1) / mc;  // rows of a chunk (kblocked_rows)
  // The tile kernel, accumulating over the K steps in acc, where the rows fill its tiles: in-process
  // A/B, 2 threads of an AMX Xeon, against brgemm calls: 1.11-1.13x at 390-1560 x 6144-8960, level at
  // M = 16, 0.87x at M = 5 (a 16-row tile for 5 rows).
  const bool tiles = M > 16 && K % 32 == 0 && amx_tiles_usable();
  const int64_t kstep = tiles ? kBlkK : kBlkKBrgemm;
  // Row tiles start every kBrgemmM rows of a chunk; the one holding A's last row reads 16 or 32 whole
  // rows, and past A's end it runs on a padded copy (pad_row: its first row, or -1).
  const int64_t last_m0 = (M - 1) / mc * mc, pad_row = last_m0 + (M - 1 - last_m0) / kBrgemmM * kBrgemmM;
  const int64_t pad_rows = M - pad_row;
  const bool padded = tiles && pad_row + (pad_rows <= 16 ? 16 : kBrgemmM) > M;
  Scratch<bf16> pad(padded ? kBrgemmM * K : 0);
  if (padded) pad_tile(A + pad_row * lda, lda, pad_rows, K, pad.data());
  const auto& v = vec();
  // Column group major, so each thread's share of items is whole column groups of every chunk.
  parallel_shares(ngroups * mchunks, [&](auto next) {
    float* acc = thread_scratch<float, 0>(mc * cols);
    std::optional<AmxTiles> held;
    if (tiles) held.emplace();
    for (int64_t t; (t = next()) >= 0;) {
      const int64_t n0 = (t / mchunks) * cols, m0 = (t % mchunks) * mc;
      const int64_t rows = std::min(mc, M - m0), nb0 = n0 / kNB, nb1 = std::min(nblocks, nb0 + group);
      if (rows <= 0) continue;
      for (int64_t k0 = 0; k0 < K; k0 += kstep) {
        const int64_t kk = std::min(kstep, K - k0);
        for (int64_t nb = nb0; nb < nb1; ++nb)
          for (int64_t r = 0; r < rows; r += kBrgemmM) {
            const int64_t mr = std::min(kBrgemmM, rows - r);
            const bf16* b = Wp + nb * panel + k0 * kNB;
            float* c = acc + r * cols + (nb - nb0) * kNB;
            if (!tiles) {
              at::native::cpublas::brgemm(mr, kNB, kk, lda, kNB, cols, k0 > 0, A + (m0 + r) * lda + k0, b, c, true);
              continue;
            }
            const bool own = padded && m0 + r == pad_row;
            const bf16* a = own ? pad.data() + k0 : A + (m0 + r) * lda + k0;
            if (mr <= 16)
              amx_tile_16x32(a, own ? K : lda, b, kk, c, cols, k0 > 0);
            else
              amx_tile_32x32(a, own ? K : lda, b, kk, c, cols, k0 > 0);
          }
      }
      v.epilogue_bf16(acc, cols, e.at(m0, n0), C + m0 * ldc + n0, ldc, rows, std::min(cols, N - n0));
    }
    if (!tiles) at::native::cpublas::brgemm_release(true);
  });
}

// A converted to fp32 in waves of at most this much (more where it takes more to keep the threads
// busy), in the calling thread's buffer kept across calls. All of A at once came to 1.2 GB at Wan2.1's
// 480p size (32,760 tokens x K = 8960), fresh per call (page faults on every 4 KB) or held by the
// output pool. Each further wave costs one more unpacking of the weight: waves of 32 MB (11 at 8192 x
// 8960 x 1536) measured 0.97x the single conversion on a Zen 4 EPYC (capped to this tier, 2 threads),
// waves of 64 MB (5 there) 1.01x, within noise; about 1% by the unpacking's share of a wave's work.
constexpr int64_t kFp32WaveBytes = int64_t(64) << 20;

void gemm_fp32_engine(const bf16* A, int64_t lda, const bf16* Wp, const Epilogue<bf16>& e, bf16* C, int64_t ldc,
                      int64_t M, int64_t N, int64_t K, const WorkSplit& split) {
  const int64_t nblocks = (N + kNB - 1) / kNB, pairs = K / 2, panel = K * kNB;
  const auto& v = vec();
  if (M <= kSmallM) {
    float* Af = thread_scratch<float, 2>(M * K);
    for (int64_t r = 0; r < M; ++r) v.bf16_to_f32(A + r * lda, Af + r * K, K);
    at::parallel_for(0, nblocks, 1, [&](int64_t b0, int64_t b1) {
      float acc[kNB];
      for (int64_t nb = b0; nb < b1; ++nb) {
        const int64_t n0 = nb * kNB;
        for (int64_t r = 0; r < M; ++r) {
          v.gemv_vnni(Af + r * K, Wp + nb * panel, pairs, acc);
          v.epilogue_bf16(acc, kNB, e.at(r, n0), C + r * ldc + n0, ldc, 1, std::min(kNB, N - n0));
        }
      }
    });
    return;
  }
  // Items of split.rows rows (all of a wave's where the split takes all rows) x split.blocks column
  // blocks, column group major: a thread's share is mostly row chunks of one group, whose weight it
  // unpacks once a wave.
  const int64_t group = split.blocks, ngroups = (nblocks + group - 1) / group, ldb = group * kNB;
  // Waves of whole row chunks (of 256 rows where an item takes all rows), as many as the wave's bytes
  // allow, and at least as many as keep the threads as busy as the whole split would (the waves end
  // one after the other, so a wave of fewer items would idle threads the split kept busy).
  const bool all_rows = split.rows >= M;
  const int64_t unit = all_rows ? kFp32M : split.rows, chunks = (M + unit - 1) / unit;
  int64_t per_wave = std::clamp<int64_t>(kFp32WaveBytes / (K * 4 * unit), 1, chunks);
  if (!all_rows) {
    const int64_t threads = at::get_num_threads();
    const double want = std::min(kMinBalance, balance(ngroups * chunks, threads));
    while (per_wave < chunks && balance(ngroups * per_wave, threads) < want) ++per_wave;
  }
  const int64_t wave_rows = std::min(M, per_wave * unit), chunk_rows = all_rows ? wave_rows : unit;
  float* Af = thread_scratch<float, 2>(wave_rows * K);  // the calling thread's, read by every thread
  for (int64_t w0 = 0; w0 < M; w0 += wave_rows) {
    const int64_t wm = std::min(wave_rows, M - w0), mchunks = (wm + chunk_rows - 1) / chunk_rows;
    at::parallel_for(0, wm, 64, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) v.bf16_to_f32(A + (w0 + r) * lda, Af + r * K, K);
    });
    parallel_shares(ngroups * mchunks, [&](auto next) {
      float *b = thread_scratch<float, 0>(K * ldb), *acc = thread_scratch<float, 1>(std::min(chunk_rows, kFp32M) * ldb);
      int64_t unpacked = -1;  // the group whose weight b holds
      for (int64_t t; (t = next()) >= 0;) {
        const int64_t g = t / mchunks, m_begin = (t % mchunks) * chunk_rows, m_end = std::min(wm, m_begin + chunk_rows);
        const int64_t nb0 = g * group, nb1 = std::min(nblocks, nb0 + group), n0 = nb0 * kNB;
        const int64_t cols = std::min(N, nb1 * kNB) - n0, gcols = (nb1 - nb0) * kNB;
        if (g != unpacked)
          for (int64_t nb = nb0; nb < nb1; ++nb) v.unpack_vnni(Wp + nb * panel, pairs, b + (nb - nb0) * kNB, ldb);
        unpacked = g;
        auto bt = at::from_blob(b, {K, gcols}, {ldb, 1}, at::kFloat);
        for (int64_t m0 = m_begin; m0 < m_end; m0 += kFp32M) {
          const int64_t mt = std::min(kFp32M, m_end - m0), row = w0 + m0;
          // ATen's sgemm (MKL), single-threaded inside this parallel region.
          auto ct = at::from_blob(acc, {mt, gcols}, at::kFloat);
          at::mm_out(ct, at::from_blob(Af + m0 * K, {mt, K}, at::kFloat), bt);
          v.epilogue_bf16(acc, gcols, e.at(row, n0), C + row * ldc + n0, ldc, mt, cols);
        }
      }
    });
  }
}

// The process's schedule: Default (not pinned) unless AMXOPT_AMX_SCHEDULE or set_amx_schedule pins one.
std::atomic<int>& schedule_state() {
  static std::atomic<int> s{[] {
    const char* env = std::getenv("AMXOPT_AMX_SCHEDULE");
    return int(env ? parse_amx_schedule(env) : AmxSchedule::Default);
  }()};
  return s;
}

// Rows' engine for M x K on the amx tier (the K-blocked engine, which precedes it, aside).
bool rows_schedule_runs(int64_t M, int64_t K, int64_t threads) {
  return M >= std::max(kRowsMinM, kBrgemmM * threads) && K > kRowsFirstK && K < kBlockedK && K % 32 == 0 &&
         amx_tiles_usable();
}

bool k_blocked(int64_t M, int64_t K) {
  return M > kSmallM && (K >= kBlockedK || (K >= kBlockedSmallK && M > 16 && M <= kBlkM));
}

// --- which engine, and its work items for the thread count -------------------------------------------
enum class Engine { KBlocked, Rows, Blocks, Avx512, Fp32Gemv, Fp32 };
struct GemmPlan {
  Engine engine;
  WorkSplit split;
};

// Of candidate (rows, column blocks) items, largest first, the one pick_split takes for M x nblocks.
WorkSplit split_work(std::initializer_list<std::pair<int64_t, int64_t>> candidates, int64_t M, int64_t nblocks,
                     int64_t threads) {
  std::vector<WorkSplit> splits;
  for (auto [rows, blocks] : candidates)
    splits.push_back({rows, blocks, (M + rows - 1) / rows * ((nblocks + blocks - 1) / blocks)});
  return splits[pick_split(int(splits.size()), threads, [&](int i) { return splits[i].items; })];
}

// Each engine's first candidate is the item its caches were tuned for on 2 cores, where every model
// shape has enough of them; the smaller ones serve many cores. The avx512_bf16 microkernel's: 96 rows
// x 4 blocks (on a Zen 4 EPYC, 96 x 1-2, 48 x 2-4 and 192 x 4 measured within 2% of it at K =
// 1024-5120, in-process A/B), rows in whole microkernel chunks. The tile engine's: 32-row tiles x 4
// blocks. The K-blocked engine's: up to kBlkM rows (chunks of nearly equal size) x kBlkN columns. The
// fp32 engine's: all rows (of a wave) x 8 blocks (one weight unpacking per group and wave), then row
// chunks. Fewer blocks per item cost the tile engine some reuse of A (2 or 8 blocks instead of 4
// measured 0.74-1.03x on 2 threads of an AMX Xeon, gemm_amx.cpp): less than the idle threads they
// put to work.
GemmPlan gemm_plan(int64_t M, int64_t N, int64_t K, Tier tier, AmxSchedule schedule, int64_t threads) {
  const int64_t nblocks = (N + kNB - 1) / kNB, r = kAvx512Rows;
  switch (tier) {
    case Tier::Amx:
      if (k_blocked(M, K)) {
        WorkSplit s = split_work({{kBlkM, kBlkN / kNB}, {kBlkM, 4}, {128, 4}, {128, 2}, {64, 2}, {64, 1}, {32, 1}},
                                 M, nblocks, threads);
        // Row chunks of nearly equal size (whole AMX tiles of 16 rows): 390 rows are 208 + 182, not 256 + 134.
        const int64_t chunks = (M + s.rows - 1) / s.rows;
        s.rows = ((M + chunks - 1) / chunks + 15) / 16 * 16;
        s.items = (M + s.rows - 1) / s.rows * ((nblocks + s.blocks - 1) / s.blocks);
        return {Engine::KBlocked, s};
      }
      if (amx_schedule_for(schedule) == AmxSchedule::Rows && rows_schedule_runs(M, K, threads)) {
        // its own split: each thread whole chunks of rows (gemm_row_chunks), x column groups of 4
        const int64_t chunks = row_chunk_count(M, K, threads), tiles = (M + kBrgemmM - 1) / kBrgemmM;
        return {Engine::Rows, {(tiles + chunks - 1) / chunks * kBrgemmM, kBrgemmG,
                               chunks * ((nblocks + kBrgemmG - 1) / kBrgemmG)}};
      }
      if (M > kAmxSmallM && K < kBlockedK)
        return {Engine::Blocks, split_work({{kBrgemmM, kBrgemmG}, {kBrgemmM, 2}, {kBrgemmM, 1}}, M, nblocks, threads)};
      [[fallthrough]];
    case Tier::Avx512Bf16:
      return {Engine::Avx512,
              split_work({{8 * r, 4}, {8 * r, 2}, {4 * r, 2}, {4 * r, 1}, {2 * r, 1}, {r, 1}}, M, nblocks, threads)};
    case Tier::Fp32:
      if (M <= kSmallM) return {Engine::Fp32Gemv, {M, 1, nblocks}};
      return {Engine::Fp32, split_work({{M, kFp32G}, {M, 4}, {kFp32M, 4}, {kFp32M, 2}, {128, 2}, {128, 1}, {64, 1}}, M,
                                       nblocks, threads)};
  }
  return {Engine::Fp32, {}};
}

}  // namespace

const char* amx_schedule_name(AmxSchedule s) {
  return s == AmxSchedule::Rows ? "rows" : s == AmxSchedule::Groups ? "groups" : "default";
}

std::optional<AmxSchedule> find_amx_schedule(c10::string_view name) {
  for (AmxSchedule s : {AmxSchedule::Default, AmxSchedule::Groups, AmxSchedule::Rows})
    if (name == amx_schedule_name(s)) return s;
  return std::nullopt;
}

AmxSchedule parse_amx_schedule(const std::string& name) {
  const auto s = find_amx_schedule(name);
  TORCH_CHECK_VALUE(s, "amxopt: unknown AMX GEMM schedule '", name, "' (AMXOPT_AMX_SCHEDULE); known: default, groups, rows");
  return *s;
}

AmxSchedule amx_schedule() { return AmxSchedule(schedule_state().load(std::memory_order_relaxed)); }

void set_amx_schedule(AmxSchedule s) { schedule_state().store(int(s)); }

AmxSchedule amx_schedule_for(AmxSchedule requested) {
  const AmxSchedule pinned = amx_schedule();
  if (pinned != AmxSchedule::Default) return pinned;
  return requested == AmxSchedule::Default ? AmxSchedule::Groups : requested;
}

bool amx_schedule_matters(int64_t M, int64_t K) {
  return active_tier() == Tier::Amx && !k_blocked(M, K) && rows_schedule_runs(M, K, at::get_num_threads());
}

std::vector<int64_t> linear_work_split(int64_t M, int64_t N, int64_t K, int64_t threads) {
  const WorkSplit s = gemm_plan(M, N, K, active_tier(), AmxSchedule::Default, threads).split;
  return {s.rows, s.blocks, s.items};
}

const char* gemm_engine(Tier tier, int64_t M) {
  switch (tier) {
    case Tier::Amx:
      if (M <= kAmxSmallM) return "avx512_bf16 microkernel (small M)";
#define AMXOPT_TILE_ENGINE \
  "AMX tile kernel (K % 32 == 0; else oneDNN brgemm; K >= 5120, or >= 4096 at 17-256 rows: blocked in K; below that, "
      switch (amx_schedule()) {
        case AmxSchedule::Rows:
          return AMXOPT_TILE_ENGINE "rows schedule (pinned) from 64 rows and 32 per thread at K > 128)";
        case AmxSchedule::Groups:
          return AMXOPT_TILE_ENGINE "groups schedule (pinned))";
        case AmxSchedule::Default:
          return AMXOPT_TILE_ENGINE "groups or rows schedule per linear as autotune chose)";
      }
#undef AMXOPT_TILE_ENGINE
      return "?";
    case Tier::Avx512Bf16:
      return "avx512_bf16 microkernel";
    case Tier::Fp32:
      return M <= kSmallM ? "fp32 VNNI GEMV (small M)" : "fp32 sgemm on unpacked weight blocks";
  }
  return "?";
}

void gemm_bf16(const bf16* A, int64_t lda, const bf16* Wp, const Epilogue<bf16>& e, bf16* C, int64_t ldc, int64_t M,
               int64_t N, int64_t K, Tier tier, AmxSchedule schedule) {
  if (M == 0 || N == 0) return;
  const GemmPlan plan = gemm_plan(M, N, K, tier, schedule, at::get_num_threads());
  switch (plan.engine) {
    case Engine::KBlocked:
      return gemm_brgemm_kblocked(A, lda, Wp, e, C, ldc, M, N, K, plan.split);
    case Engine::Rows:
      return gemm_row_chunks(A, lda, Wp, e, C, ldc, M, N, K);
    case Engine::Blocks:
      return gemm_blocks(A, lda, Wp, e, C, ldc, M, N, K, plan.split);
    case Engine::Avx512:
      return gemm_avx512_bf16(A, lda, Wp, e, C, ldc, M, N, K, plan.split);
    case Engine::Fp32Gemv:
    case Engine::Fp32:
      return gemm_fp32_engine(A, lda, Wp, e, C, ldc, M, N, K, plan.split);
  }
}

at::Tensor pack_vnni(const at::Tensor& w) {
  const int64_t N = w.size(0), K = w.size(1), pairs = K / 2;
  auto src = w.contiguous();
  auto out = at::zeros(vnni_shape(N, K), w.options());
  const bf16* s = src.data_ptr<bf16>();  // (2-byte aligned only, where w is a view at an odd offset)
  uint32_t* d = reinterpret_cast<uint32_t*>(out.data_ptr<bf16>());
  // A row's k pairs are adjacent in [N, K]: each moves as one uint32 to column n of its block.
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      uint32_t* col = d + (n / kNB) * pairs * kNB + (n % kNB);
      for (int64_t p = 0; p < pairs; ++p) col[p * kNB] = load32(s + (n * pairs + p) * 2);
    }
  });
  return out;
}

// y = act(x2 @ W^T + bias) + residual for a plain [N, K] weight (fp32 models, odd K): ATen's GEMM in
// fp32, then the shared epilogue in place.
at::Tensor linear_plain(const at::Tensor& x2, const at::Tensor& w, const float* bias, Act act,
                        const at::Tensor& residual) {
  const bool bf = x2.scalar_type() == at::kBFloat16;
  auto y = at::mm(bf ? x2.to(at::kFloat) : x2, (bf ? w.to(at::kFloat) : w).t());
  const int64_t M = y.size(0), N = y.size(1), ldr = residual.defined() ? residual.stride(0) : 0;
  auto out = bf ? new_output({M, N}, x2.options()) : y;
  const auto& v = vec();
  float* acc = y.data_ptr<float>();
  at::parallel_for(0, M, row_grain(N), [&](int64_t r0, int64_t r1) {
    if (bf) {
      const Epilogue<bf16> e{bias, act, residual.defined() ? residual.data_ptr<bf16>() : nullptr, ldr};
      v.epilogue_bf16(acc + r0 * N, N, e.at(r0, 0), out.data_ptr<bf16>() + r0 * N, N, r1 - r0, N);
    } else {
      const Epilogue<float> e{bias, act, residual.defined() ? residual.data_ptr<float>() : nullptr, ldr};
      v.epilogue_f32(acc + r0 * N, N, e.at(r0, 0), acc + r0 * N, N, r1 - r0, N);
    }
  });
  return out;
}

// x2 [M, K] (unit column stride) times a packed weight; bias fp32 contiguous or undefined.
at::Tensor linear_2d(const at::Tensor& x2, const at::Tensor& packed, const at::Tensor& bias32, Act act, int64_t N,
                     Tier tier, const at::Tensor& residual, AmxSchedule schedule) {
  const float* bias = bias32.defined() ? bias32.data_ptr<float>() : nullptr;
  if (packed.dim() == 2) return linear_plain(x2, packed, bias, act, residual);
  const int64_t M = x2.size(0), K = x2.size(1);
  auto out = new_output({M, N}, x2.options());
  const Epilogue<bf16> e{bias, act, residual.defined() ? residual.data_ptr<bf16>() : nullptr,
                         residual.defined() ? residual.stride(0) : 0};
  gemm_bf16(x2.data_ptr<bf16>(), x2.stride(0), packed.data_ptr<bf16>(), e, out.data_ptr<bf16>(), N, M, N, K, tier,
            schedule);
  return out;
}

}  // namespace amxopt
